/* etcd_client.c: the client a caller holds.
 *
 * An etcd_client is a connection (etcd_conn.c), a deadline per call and a
 * name for failpoints. This file makes and frees it, sets its deadline and
 * name, and counts its requests; its calls are in etcd_kv.c and
 * etcd_watch.c, and every unary one goes through etcd_send() (etcd_send.c)
 * with the client's deadline.
 */
#include "etcd_internal.h"

#include <curl/curl.h>
#include <libssh2.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_TIMEOUT_MS 5000

const char *etcd_strerror(etcd_err err)
{
    switch (err) {
    case ETCD_OK:
        return "ok";
    case ETCD_ERR_ARG:
        return "invalid argument";
    case ETCD_ERR_NOMEM:
        return "out of memory";
    case ETCD_ERR_UNAVAILABLE:
        return "etcd unavailable";
    case ETCD_ERR_TIMEOUT:
        return "deadline passed";
    case ETCD_ERR_PROTOCOL:
        return "malformed answer from etcd";
    case ETCD_ERR_TOO_LARGE:
        return "request or answer too large";
    case ETCD_ERR_SERVER:
        return "etcd error";
    case ETCD_ERR_AUTH:
        return "authentication failed or permission denied";
    case ETCD_ERR_NOT_FOUND:
        return "not found";
    case ETCD_ERR_COMPACTED:
        return "revision compacted";
    case ETCD_ERR_CANCELED:
        return "watch canceled";
    case ETCD_ERR_TLS:
        return "TLS error";
    }
    return "unknown error";
}

/* Debian's libcurl links libssh2 (for SCP and SFTP), and curl_global_init
 * calls libssh2_init, which initialises OpenSSL's libcrypto for libssh2's
 * ciphers: about 1.5 MB resident in every agent (bench/agent) for protocols
 * the client never enables (etcd_conn: CURLOPT_PROTOCOLS_STR "http,https").
 * libssh2 initialises its crypto on its first libssh2_init only, so this
 * one, without crypto, comes first. libcurl's own TLS library (GnuTLS, the
 * Makefile's DEBS) initialises as before. */
etcd_err etcd_global_init(void)
{
    libssh2_init(LIBSSH2_INIT_NO_CRYPTO);
    return curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK ? ETCD_OK : ETCD_ERR_NOMEM;
}

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static etcd_err curl_init_result;

static void curl_init_once(void)
{
    curl_init_result = etcd_global_init();
}

static etcd_err client_new(const etcd_config *cfg, etcd_client **out, char *err, size_t errlen)
{
    *out = NULL;
    if (err && errlen) err[0] = 0;
    if (!cfg) {
        if (err) snprintf(err, errlen, "no etcd configuration");
        return ETCD_ERR_ARG;
    }
    pthread_once(&curl_once, curl_init_once);
    if (curl_init_result != ETCD_OK) {
        if (err) snprintf(err, errlen, "curl_global_init failed");
        return ETCD_ERR_NOMEM;
    }
    etcd_client *c = calloc(1, sizeof(*c));
    if (!c) return ETCD_ERR_NOMEM;
    etcd_err e = etcd_conn_init(&c->k, cfg);
    if (e != ETCD_OK) goto err;
    if (cfg->timeout_ms < 0) {
        etcd_conn_seterr(&c->k, "negative etcd timeout");
        e = ETCD_ERR_ARG;
        goto err;
    }
    c->cfg_timeout_ms = cfg->timeout_ms ? cfg->timeout_ms : DEFAULT_TIMEOUT_MS;
    c->timeout_ms = c->cfg_timeout_ms;
    etcd_client_set_name(c, NULL);
    *out = c;
    return ETCD_OK;
err:
    if (err) snprintf(err, errlen, "%s", c->k.err[0] ? c->k.err : etcd_strerror(e));
    etcd_conn_free(&c->k);
    free(c);
    return e;
}

etcd_err etcd_client_new(const etcd_config *cfg, etcd_client **out)
{
    return client_new(cfg, out, NULL, 0);
}

etcd_err etcd_client_new_err(const etcd_config *cfg, etcd_client **out, char *err, size_t errlen)
{
    return client_new(cfg, out, err, errlen);
}

void etcd_client_free(etcd_client *c)
{
    if (!c) return;
    etcd_conn_free(&c->k);
    free(c);
}

const char *etcd_last_error(const etcd_client *c)
{
    return c ? c->k.err : "";
}

void etcd_set_timeout(etcd_client *c, int timeout_ms)
{
    c->timeout_ms = timeout_ms > 0 ? timeout_ms : c->cfg_timeout_ms;
}

void etcd_client_set_name(etcd_client *c, const char *name)
{
    snprintf(c->name, sizeof(c->name), "%s", name && *name ? name : "client");
}

const char *etcd_req_kind_name(etcd_req_kind kind)
{
    static const char *names[ETCD_REQ_KINDS] = {"range",        "put",         "delete",
                                                "txn",          "lease_grant", "keepalive",
                                                "lease_revoke", "watch",       "other"};
    return (unsigned)kind < ETCD_REQ_KINDS ? names[kind] : "unknown";
}

void etcd_client_count_into(etcd_client *c, etcd_counts *counts)
{
    c->k.counts = counts;
}

void etcd_counts_read(const etcd_counts *counts, etcd_counts *out)
{
    for (int i = 0; i < ETCD_REQ_KINDS; i++)
        out->n[i] = __atomic_load_n(&counts->n[i], __ATOMIC_RELAXED);
    out->answer_bytes = __atomic_load_n(&counts->answer_bytes, __ATOMIC_RELAXED);
    out->finished = __atomic_load_n(&counts->finished, __ATOMIC_RELAXED);
}

uint64_t etcd_counts_total(const etcd_counts *counts)
{
    uint64_t t = 0;
    for (int i = 0; i < ETCD_REQ_KINDS; i++)
        t += __atomic_load_n(&counts->n[i], __ATOMIC_RELAXED);
    return t;
}
