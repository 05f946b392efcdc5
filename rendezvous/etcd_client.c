/* etcd_client.c: the client a caller holds, and the one door of its calls.
 *
 * An etcd_client is a connection (etcd_conn.c), a deadline per call and a
 * name for failpoints. Every API call builds its JSON request with the
 * helpers at the end of this file and sends it through etcd_client_call(),
 * which checks the failpoint of the call (failpoint.h), refuses a request
 * over etcd's size limit, and hands it to etcd_conn_call() with the
 * client's deadline: so failpoints, limits and deadlines hold for every
 * call alike.
 */
#include "etcd_internal.h"

#include "ductile/clock.h"
#include "ductile/failpoint.h"

#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <inttypes.h>
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

/* The action of failpoint etcd.<client name>.<op> for this call:
 * "unavailable", "ambiguous" (failpoint.h), or NULL. "sleep:MS" stalls the
 * call here and lets it go on; other actions mean nothing here and never
 * fire. */
const char *etcd_client_failpoint(const etcd_client *c, const char *op)
{
    char name[96];
    snprintf(name, sizeof(name), "etcd.%s.%s", c->name, op);
    const char *action = failpoint(name);
    if (failpoint_sleep(action)) return NULL;
    if (action && strcmp(action, "unavailable") != 0 && strcmp(action, "ambiguous") != 0)
        return NULL;
    return action;
}

/* A failpoint "unavailable": the call fails before it is sent. */
etcd_err etcd_failpoint_unavailable(etcd_client *c, const char *path)
{
    etcd_conn_seterr(&c->k, "%s: failpoint: unavailable", path);
    return ETCD_ERR_UNAVAILABLE;
}

/* A failpoint "ambiguous": etcd answered, the answer is dropped, and the
 * caller hears what it hears when a connection breaks after sending. */
etcd_err etcd_failpoint_ambiguous(etcd_client *c, const char *path)
{
    etcd_conn_seterr(&c->k, "%s: answer dropped; the request may have been applied (failpoint)",
                     path);
    return ETCD_ERR_UNAVAILABLE;
}

/* Serialize req (consumed) and make the call; op names its failpoint. */
etcd_err etcd_client_call(etcd_client *c, const char *op, const char *path, cJSON *req,
                          size_t limit, int flags, etcd_buf *ans)
{
    c->k.err[0] = 0;
    const char *fp = etcd_client_failpoint(c, op);
    if (fp && strcmp(fp, "unavailable") == 0) {
        cJSON_Delete(req);
        return etcd_failpoint_unavailable(c, path);
    }
    if (!req) return ETCD_ERR_NOMEM;
    char *body = cJSON_PrintUnformatted(req);
    cJSON_Delete(req);
    if (!body) return ETCD_ERR_NOMEM;
    etcd_err e;
    /* base64 makes JSON about 4/3 of the protobuf etcd limits; leave room */
    if (strlen(body) > ETCD_MAX_REQUEST_BYTES * 3 / 2 + 4096) {
        etcd_conn_seterr(&c->k, "%s: request of %zu bytes is over etcd's limit", path,
                         strlen(body));
        e = ETCD_ERR_TOO_LARGE;
    } else {
        e = etcd_conn_call(&c->k, path, body, limit, flags, mono_now_ms() + c->timeout_ms, ans);
    }
    free(body);
    return e == ETCD_OK && fp ? etcd_failpoint_ambiguous(c, path) : e;
}

/* ---- request building ---- */

int etcd_add_b64(cJSON *o, const char *name, const void *data, size_t len)
{
    char *s = etcd_b64_encode(data, len);
    if (!s) return 0;
    int ok = cJSON_AddStringToObject(o, name, s) != NULL;
    free(s);
    return ok;
}

int etcd_add_int64(cJSON *o, const char *name, int64_t v)
{
    char s[32];
    snprintf(s, sizeof(s), "%" PRId64, v);
    return cJSON_AddStringToObject(o, name, s) != NULL;
}

/* key, and range_end for a prefix: the prefix with its last byte
 * incremented (bytes 0xff dropped first); "\0" means "to the end". */
int etcd_add_key_range(cJSON *o, const char *key, int prefix)
{
    size_t len = strlen(key);
    if (!prefix) return etcd_add_b64(o, "key", key, len);
    if (len == 0) return etcd_add_b64(o, "key", "", 1) && etcd_add_b64(o, "range_end", "", 1);
    if (!etcd_add_b64(o, "key", key, len)) return 0;
    char *end = malloc(len);
    if (!end) return 0;
    memcpy(end, key, len);
    size_t n = len;
    while (n > 0 && (unsigned char)end[n - 1] == 0xff)
        n--;
    int ok;
    if (n == 0) {
        ok = etcd_add_b64(o, "range_end", "", 1);
    } else {
        end[n - 1] = (char)((unsigned char)end[n - 1] + 1);
        ok = etcd_add_b64(o, "range_end", end, n);
    }
    free(end);
    return ok;
}

etcd_err etcd_check_key(etcd_client *c, const char *key, int prefix)
{
    if (!key || (!*key && !prefix)) {
        etcd_conn_seterr(&c->k, "empty etcd key");
        return ETCD_ERR_ARG;
    }
    return ETCD_OK;
}
