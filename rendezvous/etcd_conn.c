/* etcd_conn.c: one connection to an etcd cluster, and one try on it.
 *
 * A connection is a list of endpoints, the TLS files and auth credentials,
 * the auth token once logged in, and one curl easy handle. etcd_conn_setup
 * sets what every request carries (the current endpoint's URL, the headers
 * with the token, TLS, keep-alive) and counts it; etcd_conn_post makes one
 * POST with it and reports what happened, without judging: whether to
 * answer, retry or log in again is etcd_send.c's policy.
 *
 * A watch (etcd_watch.c) copies its client's connection and drives its own
 * stream with the same endpoints and setup.
 */
#include "etcd_internal.h"

#include <curl/curl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

/* ---- growing buffer with a cap ---- */

int etcd_buf_append(etcd_buf *b, const void *data, size_t n)
{
    if (n > b->limit - b->len) {
        b->over = 1;
        return -1;
    }
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) return -1;
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, data, n);
    b->len += n;
    b->p[b->len] = 0;
    return 0;
}

void etcd_buf_reset(etcd_buf *b, size_t limit)
{
    b->len = 0;
    b->over = 0;
    b->limit = limit;
    if (b->p) b->p[0] = 0;
}

void etcd_buf_free(etcd_buf *b)
{
    free(b->p);
    memset(b, 0, sizeof(*b));
}

static size_t buf_write(void *data, size_t size, size_t n, void *user)
{
    return etcd_buf_append(user, data, size * n) == 0 ? size * n : 0;
}

/* ---- a connection: endpoints, TLS, auth, one curl handle ---- */

void etcd_conn_seterr(etcd_conn *k, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(k->err, sizeof(k->err), fmt, ap);
    va_end(ap);
}

static char *dup_or_null(const char *s, int *fail)
{
    if (!s) return NULL;
    char *d = strdup(s);
    if (!d) *fail = 1;
    return d;
}

void etcd_conn_free(etcd_conn *k)
{
    for (size_t i = 0; i < k->nendpoints; i++)
        free(k->endpoints[i]);
    free(k->endpoints);
    free(k->cacert);
    free(k->cert);
    free(k->key);
    free(k->user);
    free(k->password);
    free(k->token);
    if (k->easy) curl_easy_cleanup(k->easy);
    memset(k, 0, sizeof(*k));
}

/* The jitter's seed: the clock's nanoseconds as entropy, not as a time. */
static uint64_t seed(const void *p)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t s = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 32) ^ (uint64_t)(uintptr_t)p;
    return s ? s : 0x9e3779b97f4a7c15u;
}

uint64_t etcd_conn_rand(etcd_conn *k)
{
    /* xorshift64: jitter only, no need for more */
    uint64_t x = k->rng;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return k->rng = x;
}

/* Split "a,b,c" into endpoints; a bare host:port means http. */
static etcd_err parse_endpoints(etcd_conn *k, const char *list)
{
    if (!list || !*list) {
        etcd_conn_seterr(k, "no etcd endpoints given");
        return ETCD_ERR_ARG;
    }
    size_t n = 1;
    for (const char *p = list; *p; p++)
        n += *p == ',';
    k->endpoints = calloc(n, sizeof(char *));
    if (!k->endpoints) return ETCD_ERR_NOMEM;
    const char *p = list;
    while (*p) {
        while (*p == ' ' || *p == ',')
            p++;
        if (!*p) break;
        size_t len = strcspn(p, ", ");
        const char *scheme = strstr(p, "://");
        int has_scheme = scheme && scheme < p + len;
        if (has_scheme && !(strncmp(p, "http://", 7) == 0 || strncmp(p, "https://", 8) == 0)) {
            etcd_conn_seterr(k, "etcd endpoint \"%.*s\": only http:// and https:// are supported",
                             (int)len, p);
            return ETCD_ERR_ARG;
        }
        size_t hostlen = len - (has_scheme ? (size_t)(scheme + 3 - p) : 0);
        if (hostlen == 0 || memchr(p, '?', len) || memchr(p, '#', len)) {
            etcd_conn_seterr(k, "etcd endpoint \"%.*s\" is not scheme://host:port", (int)len, p);
            return ETCD_ERR_ARG;
        }
        while (len > 0 && p[len - 1] == '/')
            len--;
        char *ep = malloc(len + 8);
        if (!ep) return ETCD_ERR_NOMEM;
        snprintf(ep, len + 8, "%s%.*s", has_scheme ? "" : "http://", (int)len, p);
        k->endpoints[k->nendpoints++] = ep;
        p += strcspn(p, ", ");
    }
    if (k->nendpoints == 0) {
        etcd_conn_seterr(k, "no etcd endpoints given");
        return ETCD_ERR_ARG;
    }
    return ETCD_OK;
}

/* A TLS file the client can read; with pem, one that holds a PEM block of
 * that kind ("CERTIFICATE"). GnuTLS takes a CA file without one as no CA
 * at all, and would only fail at the handshake, or not at all against a
 * server that never answers it: it is refused here, whatever the library. */
static etcd_err check_file(etcd_conn *k, const char *what, const char *path, const char *pem)
{
    if (!path) return ETCD_OK;
    FILE *f = fopen(path, "r");
    if (!f) {
        etcd_conn_seterr(k, "cannot read TLS %s file \"%s\"", what, path);
        return ETCD_ERR_TLS;
    }
    int found = !pem;
    char line[256];
    while (!found && fgets(line, sizeof(line), f))
        found = strncmp(line, "-----BEGIN ", 11) == 0 && strstr(line, pem) != NULL;
    fclose(f);
    if (!found) {
        etcd_conn_seterr(k, "TLS %s file \"%s\" holds no PEM %s", what, path, pem);
        return ETCD_ERR_TLS;
    }
    return ETCD_OK;
}

etcd_err etcd_conn_init(etcd_conn *k, const etcd_config *cfg)
{
    memset(k, 0, sizeof(*k));
    k->rng = seed(k);
    etcd_err e = parse_endpoints(k, cfg->endpoints);
    if (e != ETCD_OK) return e;
    if (cfg->key && !cfg->cert) {
        etcd_conn_seterr(k, "a TLS client key needs a client certificate");
        return ETCD_ERR_ARG;
    }
    if ((e = check_file(k, "CA", cfg->cacert, "CERTIFICATE")) != ETCD_OK) return e;
    if ((e = check_file(k, "certificate", cfg->cert, "CERTIFICATE")) != ETCD_OK) return e;
    if ((e = check_file(k, "key", cfg->key, NULL)) != ETCD_OK) return e;
    if (cfg->user && (!*cfg->user || !cfg->password)) {
        etcd_conn_seterr(k, "etcd auth needs a non-empty user name and a password");
        return ETCD_ERR_ARG;
    }
    int fail = 0;
    k->cacert = dup_or_null(cfg->cacert, &fail);
    k->cert = dup_or_null(cfg->cert, &fail);
    k->key = dup_or_null(cfg->key, &fail);
    k->user = dup_or_null(cfg->user, &fail);
    k->password = dup_or_null(cfg->user ? cfg->password : NULL, &fail);
    if (fail) return ETCD_ERR_NOMEM;
    k->easy = curl_easy_init();
    if (!k->easy) {
        etcd_conn_seterr(k, "curl_easy_init failed");
        return ETCD_ERR_NOMEM;
    }
    return ETCD_OK;
}

/* A copy for a watch: same endpoints and credentials, its own handle. */
etcd_err etcd_conn_copy(etcd_conn *dst, const etcd_conn *src)
{
    memset(dst, 0, sizeof(*dst));
    dst->rng = seed(dst);
    dst->cur = src->cur;
    dst->counts = src->counts;
    dst->endpoints = calloc(src->nendpoints, sizeof(char *));
    if (!dst->endpoints) return ETCD_ERR_NOMEM;
    int fail = 0;
    for (size_t i = 0; i < src->nendpoints; i++) {
        dst->endpoints[i] = dup_or_null(src->endpoints[i], &fail);
        if (!fail) dst->nendpoints++;
    }
    dst->cacert = dup_or_null(src->cacert, &fail);
    dst->cert = dup_or_null(src->cert, &fail);
    dst->key = dup_or_null(src->key, &fail);
    dst->user = dup_or_null(src->user, &fail);
    dst->password = dup_or_null(src->password, &fail);
    dst->token = dup_or_null(src->token, &fail);
    if (fail) return ETCD_ERR_NOMEM;
    dst->easy = curl_easy_init();
    return dst->easy ? ETCD_OK : ETCD_ERR_NOMEM;
}

/* Three lost keep-alive probes end a silent connection: a watch on an
 * endpoint that vanished without a reset fails over after about 11 s
 * (5 s idle + 3 x 2 s), not the kernel's default of minutes. */
static int set_keepcnt(void *user, curl_socket_t fd, curlsocktype purpose)
{
    (void)user;
    int cnt = 3;
    if (purpose == CURLSOCKTYPE_IPCXN) setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
    return CURL_SOCKOPT_OK;
}

/* The kind of request a path is, for etcd_counts. */
static etcd_req_kind path_kind(const char *path)
{
    static const struct {
        const char *path;
        etcd_req_kind kind;
    } kinds[] = {
        {"/v3/kv/range", ETCD_REQ_RANGE},
        {"/v3/kv/put", ETCD_REQ_PUT},
        {"/v3/kv/deleterange", ETCD_REQ_DELETE},
        {"/v3/kv/txn", ETCD_REQ_TXN},
        {"/v3/lease/grant", ETCD_REQ_LEASE_GRANT},
        {"/v3/lease/keepalive", ETCD_REQ_KEEPALIVE},
        {"/v3/lease/revoke", ETCD_REQ_LEASE_REVOKE},
        {"/v3/watch", ETCD_REQ_WATCH},
    };
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++)
        if (strcmp(path, kinds[i].path) == 0) return kinds[i].kind;
    return ETCD_REQ_OTHER;
}

/* Options shared by unary calls and watch streams: called once per request
 * sent, so this is where requests are counted. */
etcd_err etcd_conn_setup(etcd_conn *k, CURL *h, const char *path, struct curl_slist **hdrs)
{
    char url[1024];
    if (snprintf(url, sizeof(url), "%s%s", k->endpoints[k->cur], path) >= (int)sizeof(url)) {
        etcd_conn_seterr(k, "etcd endpoint URL too long");
        return ETCD_ERR_ARG;
    }
    if (k->counts) __atomic_fetch_add(&k->counts->n[path_kind(path)], 1, __ATOMIC_RELAXED);
    *hdrs = NULL;
    struct curl_slist *l = curl_slist_append(NULL, "Content-Type: application/json");
    /* no "Expect: 100-continue" round trip for bodies over 1 KiB */
    struct curl_slist *l2 = l ? curl_slist_append(l, "Expect:") : NULL;
    /* clientv3's WithRequireLeader, on every call: the gateway passes
     * Grpc-Metadata-* on as gRPC metadata, and with "hasleader" a member
     * that has no leader refuses the call at once ("etcdserver: no leader",
     * code 14, HTTP 503) before proposing or reading anything, where it
     * would otherwise serve a stale serializable read or hold a write until
     * it times out; a watch it cancels once it has lost its leader */
    struct curl_slist *l3 = l2 ? curl_slist_append(l2, "Grpc-Metadata-Hasleader: true") : NULL;
    if (!l3) {
        curl_slist_free_all(l);
        return ETCD_ERR_NOMEM;
    }
    l = l3;
    if (k->token && strcmp(path, "/v3/auth/authenticate") != 0) {
        size_t n = strlen(k->token) + 32;
        char *hdr = malloc(n);
        if (hdr) {
            snprintf(hdr, n, "Authorization: %s", k->token);
            l2 = curl_slist_append(l, hdr);
            free(hdr);
        }
        if (!hdr || !l2) {
            curl_slist_free_all(l);
            return ETCD_ERR_NOMEM;
        }
        l = l2;
    }
    *hdrs = l;
    curl_easy_reset(h);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, l);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L);
    curl_easy_setopt(h, CURLOPT_TCP_KEEPIDLE, 5L);
    curl_easy_setopt(h, CURLOPT_TCP_KEEPINTVL, 2L);
    curl_easy_setopt(h, CURLOPT_SOCKOPTFUNCTION, set_keepcnt);
    if (k->cacert) curl_easy_setopt(h, CURLOPT_CAINFO, k->cacert);
    if (k->cert) curl_easy_setopt(h, CURLOPT_SSLCERT, k->cert);
    if (k->key) curl_easy_setopt(h, CURLOPT_SSLKEY, k->key);
    return ETCD_OK;
}

/* One POST of body to path on the current endpoint, with curl's timeouts
 * cut from left ms; the answer goes to ans (at most limit bytes). */
etcd_err etcd_conn_post(etcd_conn *k, const char *path, const char *body, size_t limit,
                        int64_t left, etcd_buf *ans, etcd_try *t)
{
    struct curl_slist *hdrs;
    etcd_err e = etcd_conn_setup(k, k->easy, path, &hdrs);
    if (e != ETCD_OK) return e;
    etcd_buf_reset(ans, limit);
    t->curlerr[0] = 0;
    CURL *h = k->easy;
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, (long)strlen(body));
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, buf_write);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, ans);
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, t->curlerr);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)left);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS,
                     (long)(left < ETCD_CONNECT_TIMEOUT_MS ? left : ETCD_CONNECT_TIMEOUT_MS));
    t->cc = curl_easy_perform(h);
    if (k->counts) __atomic_fetch_add(&k->counts->finished, 1, __ATOMIC_RELAXED);
    t->http = 0;
    t->sent = 0;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &t->http);
    curl_easy_getinfo(h, CURLINFO_REQUEST_SIZE, &t->sent);
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, NULL);
    curl_slist_free_all(hdrs);
    if (t->cc == CURLE_OK && t->http == 200 && k->counts)
        __atomic_fetch_add(&k->counts->answer_bytes, ans->len, __ATOMIC_RELAXED);
    return ETCD_OK;
}
