/* etcd_conn.c: one connection to an etcd cluster, and its retry policy.
 *
 * A connection is a list of endpoints, the TLS files and auth credentials,
 * the auth token once logged in, and one curl easy handle. Every unary call
 * goes through one function, etcd_conn_call(): it POSTs a JSON body to one
 * endpoint with curl timeouts cut from what is left of the call's deadline,
 * and decides from the outcome whether to answer, or to try the next
 * endpoint after an exponential backoff with jitter. Only transient failures
 * are retried (no connection, a reset, HTTP 5xx without a gRPC verdict, gRPC
 * "unavailable", which includes "no leader": every call requires a leader,
 * so a member cut off from its peers refuses it before acting and the call
 * goes on to the next endpoint); a failed compare, a bad request or a missing lease are
 * answers. A request that may have reached etcd is sent again only when doing
 * so cannot change the outcome (ranges, lease calls); for a put, delete or a
 * writing txn a connection lost after sending, or an "unavailable" that etcd
 * gives after proposing ("request timed out", "leader changed"), is
 * reported, not repeated, because repeating it could apply it twice or make
 * a guarded txn fail on its own first write (etcd's clientv3 draws the same
 * line).
 *
 * A watch (etcd_watch.c) copies its client's connection and drives its own
 * stream with the same endpoints, setup and error mapping.
 */
#include "etcd_internal.h"

#include "ductile/clock.h"

#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

static void sleep_ms(int64_t ms)
{
    if (ms <= 0) return;
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

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

/* A TLS failure is final (retrying cannot fix a certificate). With TLS 1.3
 * a refused client certificate arrives as an alert on the first read, so a
 * read or write error that carries an alert counts too. */
int etcd_is_tls_error(CURLcode cc, const char *detail)
{
    if ((cc == CURLE_RECV_ERROR || cc == CURLE_SEND_ERROR) && strstr(detail, " alert ")) return 1;
    switch (cc) {
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_SSL_CERTPROBLEM:
    case CURLE_SSL_CIPHER:
    case CURLE_PEER_FAILED_VERIFICATION:
    case CURLE_SSL_CACERT_BADFILE:
    case CURLE_SSL_ENGINE_NOTFOUND:
    case CURLE_SSL_ENGINE_SETFAILED:
    case CURLE_SSL_ENGINE_INITFAILED:
    case CURLE_SSL_SHUTDOWN_FAILED:
    case CURLE_SSL_CRL_BADFILE:
    case CURLE_SSL_ISSUER_ERROR:
    case CURLE_SSL_PINNEDPUBKEYNOTMATCH:
    case CURLE_SSL_INVALIDCERTSTATUS:
    case CURLE_SSL_CLIENTCERT:
    case CURLE_USE_SSL_FAILED:
        return 1;
    default:
        return 0;
    }
}

/* What a gRPC status from the gateway means to a caller. */
etcd_err etcd_map_grpc(int code, const char *msg, int http)
{
    switch (code) {
    case 3: /* InvalidArgument */
        if (strstr(msg, "authentication failed") || strstr(msg, "user name is empty"))
            return ETCD_ERR_AUTH;
        if (strstr(msg, "too large") || strstr(msg, "too many operations"))
            return ETCD_ERR_TOO_LARGE;
        return ETCD_ERR_ARG;
    case 4:
        return ETCD_ERR_TIMEOUT;
    case 5:
        return ETCD_ERR_NOT_FOUND;
    case 7:
    case 16:
        return ETCD_ERR_AUTH;
    case 8:
        return strstr(msg, "larger than max") ? ETCD_ERR_TOO_LARGE : ETCD_ERR_SERVER;
    case 9:
        return strstr(msg, "auth") ? ETCD_ERR_AUTH : ETCD_ERR_SERVER;
    case 11:
        return strstr(msg, "compacted") ? ETCD_ERR_COMPACTED : ETCD_ERR_ARG;
    case 14:
        return ETCD_ERR_UNAVAILABLE;
    default:
        return http == 404 ? ETCD_ERR_NOT_FOUND : ETCD_ERR_SERVER;
    }
}

/* "Unavailable" answers that etcd gives after a proposal may have gone
 * through raft ("request timed out", "leader changed"); "no leader" and the
 * like come before anything was proposed. */
static int is_ambiguous(const char *msg)
{
    return strstr(msg, "timed out") || strstr(msg, "leader changed") ||
           strstr(msg, "server stopped");
}

int etcd_is_token_error(int code, const char *msg)
{
    return code == 16 || strstr(msg, "invalid auth token") != NULL;
}

/* Sleep before the next try: once every endpoint has failed in a row,
 * exponential backoff with jitter (half to full), never past the deadline. */
static void conn_backoff(etcd_conn *k, int tries, int64_t deadline)
{
    if (tries % (int)k->nendpoints != 0) return;
    int rounds = tries / (int)k->nendpoints - 1;
    int64_t d = ETCD_BACKOFF_FIRST_MS << (rounds < 6 ? rounds : 6);
    if (d > ETCD_BACKOFF_MAX_MS) d = ETCD_BACKOFF_MAX_MS;
    d = d / 2 + (int64_t)(etcd_conn_rand(k) % (uint64_t)(d / 2 + 1));
    int64_t left = deadline - mono_now_ms();
    sleep_ms(d < left ? d : left);
}

/* POST body to path on some endpoint before deadline; on ETCD_OK *ans holds
 * the 200 answer (at most limit bytes). */
etcd_err etcd_conn_call(etcd_conn *k, const char *path, const char *body, size_t limit, int flags,
                        int64_t deadline, etcd_buf *ans)
{
    int tries = 0, reauthed = 0;
    char last[300] = "no attempt";
    for (;;) {
        if (k->user && !k->token && !(flags & ETCD_CALL_NO_AUTH)) {
            etcd_err e = etcd_conn_authenticate(k, deadline);
            if (e != ETCD_OK) return e;
        }
        int64_t left = deadline - mono_now_ms();
        if (left <= 0) {
            /* every try failed in a way worth retrying: etcd is not there */
            etcd_conn_seterr(k, "%s: deadline passed; last: %s", path, last);
            return ETCD_ERR_UNAVAILABLE;
        }
        struct curl_slist *hdrs;
        etcd_err e = etcd_conn_setup(k, k->easy, path, &hdrs);
        if (e != ETCD_OK) return e;
        etcd_buf_reset(ans, limit);
        char curlerr[CURL_ERROR_SIZE] = "";
        CURL *h = k->easy;
        curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, (long)strlen(body));
        curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, buf_write);
        curl_easy_setopt(h, CURLOPT_WRITEDATA, ans);
        curl_easy_setopt(h, CURLOPT_ERRORBUFFER, curlerr);
        curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)left);
        curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS,
                         (long)(left < ETCD_CONNECT_TIMEOUT_MS ? left : ETCD_CONNECT_TIMEOUT_MS));
        CURLcode cc = curl_easy_perform(h);
        if (k->counts) __atomic_fetch_add(&k->counts->finished, 1, __ATOMIC_RELAXED);
        long http = 0, sent = 0;
        curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &http);
        curl_easy_getinfo(h, CURLINFO_REQUEST_SIZE, &sent);
        curl_easy_setopt(h, CURLOPT_ERRORBUFFER, NULL);
        curl_slist_free_all(hdrs);
        const char *ep = k->endpoints[k->cur];
        if (cc == CURLE_OK && http == 200) {
            if (k->counts) __atomic_fetch_add(&k->counts->answer_bytes, ans->len, __ATOMIC_RELAXED);
            return ETCD_OK;
        }
        if (cc == CURLE_OK) {
            int code;
            char msg[ETCD_REASON_MAX];
            if (!etcd_parse_error(ans->p ? ans->p : "", ans->len, &code, msg, sizeof(msg))) {
                code = -1;
                snprintf(msg, sizeof(msg), "HTTP %ld without an etcd error body", http);
            }
            if (k->user && !(flags & ETCD_CALL_NO_AUTH) && etcd_is_token_error(code, msg) &&
                !reauthed) {
                /* the token expired or etcd restarted: log in again, once */
                reauthed = 1;
                free(k->token);
                k->token = NULL;
                continue;
            }
            snprintf(last, sizeof(last), "%s%s: %s (HTTP %ld, code %d)", ep, path, msg, http, code);
            if (code == 14 && !(flags & ETCD_CALL_IDEMPOTENT) && is_ambiguous(msg)) {
                etcd_conn_seterr(k, "%s; the request may have been applied, not repeating it",
                                 last);
                return ETCD_ERR_UNAVAILABLE;
            }
            /* "no leader" (the require-leader refusal) comes before
             * anything was proposed: another endpoint may have one */
            if (code == 14 || (code < 0 && http >= 500)) goto retry;
            /* A client given credentials waits, within its deadline, for
             * etcd's auth to be switched on, as it waits for etcd to start:
             * a deployment enables it just after etcd comes up (the chart's
             * post-install hook) while the agents may already be calling. */
            if (code == 9 && strstr(msg, "authentication is not enabled")) goto retry;
            etcd_conn_seterr(k, "%s", last);
            return code < 0 ? ETCD_ERR_PROTOCOL : etcd_map_grpc(code, msg, (int)http);
        }
        snprintf(last, sizeof(last), "%s%s: %s", ep, path,
                 curlerr[0] ? curlerr : curl_easy_strerror(cc));
        if (cc == CURLE_WRITE_ERROR && ans->over) {
            etcd_conn_seterr(k, "%s%s: answer larger than %zu bytes", ep, path, limit);
            return ETCD_ERR_TOO_LARGE;
        }
        if (cc == CURLE_WRITE_ERROR) {
            etcd_conn_seterr(k, "%s%s: out of memory for the answer", ep, path);
            return ETCD_ERR_NOMEM;
        }
        if (etcd_is_tls_error(cc, curlerr)) {
            etcd_conn_seterr(k, "%s", last);
            return ETCD_ERR_TLS;
        }
        switch (cc) {
        case CURLE_COULDNT_CONNECT:
        case CURLE_COULDNT_RESOLVE_HOST:
            goto retry;
        case CURLE_OPERATION_TIMEDOUT:
            if (sent > 0) {
                etcd_conn_seterr(k, "%s: deadline passed with the request in flight", last);
                return ETCD_ERR_TIMEOUT;
            }
            goto retry; /* one endpoint's connect timeout, or the deadline (said above) */
        case CURLE_SEND_ERROR:
        case CURLE_RECV_ERROR:
        case CURLE_GOT_NOTHING:
        case CURLE_PARTIAL_FILE:
            if (sent > 0 && !(flags & ETCD_CALL_IDEMPOTENT)) {
                etcd_conn_seterr(k, "%s; the request may have been applied, not repeating it",
                                 last);
                k->cur = (k->cur + 1) % k->nendpoints;
                return ETCD_ERR_UNAVAILABLE;
            }
            goto retry;
        case CURLE_HTTP2:
            /* libcurl on GnuTLS reports a connection broken while it sends
             * HTTP/2's preface, before the request (etcd refusing a TLS 1.3
             * client certificate just after the handshake), as an HTTP/2
             * error: nothing was sent, so it is retried as a send failure
             * is, and the next try reads the TLS alert. */
            if (sent == 0) goto retry;
            etcd_conn_seterr(k, "%s", last);
            return ETCD_ERR_PROTOCOL;
        case CURLE_WEIRD_SERVER_REPLY:
        case CURLE_BAD_CONTENT_ENCODING:
        case CURLE_HTTP3:
        case CURLE_UNSUPPORTED_PROTOCOL: /* schemes are checked up front: an HTTP/0.9 reply */
            etcd_conn_seterr(k, "%s", last);
            return ETCD_ERR_PROTOCOL;
        case CURLE_URL_MALFORMAT:
            etcd_conn_seterr(k, "%s", last);
            return ETCD_ERR_ARG;
        case CURLE_OUT_OF_MEMORY:
            return ETCD_ERR_NOMEM;
        default:
            etcd_conn_seterr(k, "%s", last);
            return ETCD_ERR_UNAVAILABLE;
        }
    retry:
        tries++;
        k->cur = (k->cur + 1) % k->nendpoints;
        conn_backoff(k, tries, deadline);
    }
}

etcd_err etcd_conn_authenticate(etcd_conn *k, int64_t deadline)
{
    cJSON *req = cJSON_CreateObject();
    if (!req || !cJSON_AddStringToObject(req, "name", k->user) ||
        !cJSON_AddStringToObject(req, "password", k->password)) {
        cJSON_Delete(req);
        return ETCD_ERR_NOMEM;
    }
    char *body = cJSON_PrintUnformatted(req);
    cJSON_Delete(req);
    if (!body) return ETCD_ERR_NOMEM;
    etcd_buf ans = {0};
    etcd_err e = etcd_conn_call(k, "/v3/auth/authenticate", body, ETCD_MAX_SMALL_ANSWER,
                                ETCD_CALL_IDEMPOTENT | ETCD_CALL_NO_AUTH, deadline, &ans);
    free(body);
    if (e == ETCD_OK) {
        free(k->token);
        k->token = NULL;
        e = etcd_parse_token(ans.p, ans.len, &k->token, k->err, sizeof(k->err));
    } else {
        char why[sizeof(k->err)];
        snprintf(why, sizeof(why), "%s", k->err);
        etcd_conn_seterr(k, "authenticate as \"%s\": %s", k->user, why);
    }
    etcd_buf_free(&ans);
    return e;
}
