/* etcd.c: the etcd v3 client over the HTTP/JSON gateway (see etcd.h).
 *
 * Every unary call goes through one function, conn_call(): it POSTs a JSON
 * body to one endpoint with curl timeouts cut from what is left of the call's
 * deadline, and decides from the outcome whether to answer, or to try the next
 * endpoint after an exponential backoff with jitter. Only transient failures
 * are retried (no connection, a reset, HTTP 5xx without a gRPC verdict, gRPC
 * "unavailable"); a failed compare, a bad request or a missing lease are
 * answers. A request that may have reached etcd is sent again only when doing
 * so cannot change the outcome (ranges, lease calls); for a put, delete or a
 * writing txn a connection lost after sending, or an "unavailable" that etcd
 * gives after proposing ("request timed out", "leader changed"), is
 * reported, not repeated, because repeating it could apply it twice or make
 * a guarded txn fail on its own first write (etcd's clientv3 draws the same
 * line).
 *
 * A watch is one long POST read incrementally through a curl multi handle, so
 * etcd_watch_next can wait with a deadline and be woken from another thread
 * (curl_multi_poll + curl_multi_wakeup). Messages are split on newlines and
 * parsed one by one; the watch remembers the revision after the last event it
 * queued, reconnects from there when the stream breaks, and drops any event
 * older than that, so a resume never loses or repeats one.
 *
 * Parsing of answers lives in etcd_json.c, where the fuzz target reaches it.
 */
#include "ductile/etcd.h"
#include "etcd_internal.h"
#include "ductile/failpoint.h"

#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define DEFAULT_TIMEOUT_MS 5000
#define CONNECT_TIMEOUT_MS 2000 /* one endpoint; a dead one must not eat the deadline */
#define BACKOFF_FIRST_MS 25
#define BACKOFF_MAX_MS 1000

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

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int64_t ms)
{
    if (ms <= 0) return;
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static CURLcode curl_init_result;

static void curl_init_once(void)
{
    curl_init_result = curl_global_init(CURL_GLOBAL_DEFAULT);
}

/* ---- growing buffer with a cap ---- */

typedef struct buf {
    char *p;
    size_t len, cap, limit;
    int over; /* the answer went past limit */
} buf;

static int buf_append(buf *b, const void *data, size_t n)
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

static void buf_reset(buf *b, size_t limit)
{
    b->len = 0;
    b->over = 0;
    b->limit = limit;
    if (b->p) b->p[0] = 0;
}

static void buf_free(buf *b)
{
    free(b->p);
    memset(b, 0, sizeof(*b));
}

static size_t buf_write(void *data, size_t size, size_t n, void *user)
{
    return buf_append(user, data, size * n) == 0 ? size * n : 0;
}

/* ---- a connection: endpoints, TLS, auth, one curl handle ---- */

typedef struct conn {
    char **endpoints;
    size_t nendpoints;
    size_t cur; /* endpoint tried first; moves on after a failure */
    char *cacert, *cert, *key, *user, *password;
    char *token;
    CURL *easy;
    uint64_t rng;
    char err[512];
} conn;

static void conn_seterr(conn *k, const char *fmt, ...)
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

static void conn_free(conn *k)
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

static uint64_t seed(const void *p)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t s = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 32) ^ (uint64_t)(uintptr_t)p;
    return s ? s : 0x9e3779b97f4a7c15u;
}

static uint64_t conn_rand(conn *k)
{
    /* xorshift64: jitter only, no need for more */
    uint64_t x = k->rng;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return k->rng = x;
}

/* Split "a,b,c" into endpoints; a bare host:port means http. */
static etcd_err parse_endpoints(conn *k, const char *list)
{
    if (!list || !*list) {
        conn_seterr(k, "no etcd endpoints given");
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
            conn_seterr(k, "etcd endpoint \"%.*s\": only http:// and https:// are supported",
                        (int)len, p);
            return ETCD_ERR_ARG;
        }
        size_t hostlen = len - (has_scheme ? (size_t)(scheme + 3 - p) : 0);
        if (hostlen == 0 || memchr(p, '?', len) || memchr(p, '#', len)) {
            conn_seterr(k, "etcd endpoint \"%.*s\" is not scheme://host:port", (int)len, p);
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
        conn_seterr(k, "no etcd endpoints given");
        return ETCD_ERR_ARG;
    }
    return ETCD_OK;
}

static etcd_err check_file(conn *k, const char *what, const char *path)
{
    if (!path) return ETCD_OK;
    FILE *f = fopen(path, "r");
    if (!f) {
        conn_seterr(k, "cannot read TLS %s file \"%s\"", what, path);
        return ETCD_ERR_TLS;
    }
    fclose(f);
    return ETCD_OK;
}

static etcd_err conn_init(conn *k, const etcd_config *cfg)
{
    memset(k, 0, sizeof(*k));
    k->rng = seed(k);
    etcd_err e = parse_endpoints(k, cfg->endpoints);
    if (e != ETCD_OK) return e;
    if (cfg->key && !cfg->cert) {
        conn_seterr(k, "a TLS client key needs a client certificate");
        return ETCD_ERR_ARG;
    }
    if ((e = check_file(k, "CA", cfg->cacert)) != ETCD_OK) return e;
    if ((e = check_file(k, "certificate", cfg->cert)) != ETCD_OK) return e;
    if ((e = check_file(k, "key", cfg->key)) != ETCD_OK) return e;
    if (cfg->user && (!*cfg->user || !cfg->password)) {
        conn_seterr(k, "etcd auth needs a non-empty user name and a password");
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
        conn_seterr(k, "curl_easy_init failed");
        return ETCD_ERR_NOMEM;
    }
    return ETCD_OK;
}

/* A copy for a watch: same endpoints and credentials, its own handle. */
static etcd_err conn_copy(conn *dst, const conn *src)
{
    memset(dst, 0, sizeof(*dst));
    dst->rng = seed(dst);
    dst->cur = src->cur;
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

/* Options shared by unary calls and watch streams. */
static etcd_err conn_setup(conn *k, CURL *h, const char *path, struct curl_slist **hdrs)
{
    char url[1024];
    if (snprintf(url, sizeof(url), "%s%s", k->endpoints[k->cur], path) >= (int)sizeof(url)) {
        conn_seterr(k, "etcd endpoint URL too long");
        return ETCD_ERR_ARG;
    }
    *hdrs = NULL;
    struct curl_slist *l = curl_slist_append(NULL, "Content-Type: application/json");
    /* no "Expect: 100-continue" round trip for bodies over 1 KiB */
    struct curl_slist *l2 = l ? curl_slist_append(l, "Expect:") : NULL;
    if (!l2) {
        curl_slist_free_all(l);
        return ETCD_ERR_NOMEM;
    }
    l = l2;
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
static int is_tls_error(CURLcode cc, const char *detail)
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
static etcd_err map_grpc(int code, const char *msg, int http)
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

static int is_token_error(int code, const char *msg)
{
    return code == 16 || strstr(msg, "invalid auth token") != NULL;
}

/* Sleep before the next try: once every endpoint has failed in a row,
 * exponential backoff with jitter (half to full), never past the deadline. */
static void conn_backoff(conn *k, int tries, int64_t deadline)
{
    if (tries % (int)k->nendpoints != 0) return;
    int rounds = tries / (int)k->nendpoints - 1;
    int64_t d = BACKOFF_FIRST_MS << (rounds < 6 ? rounds : 6);
    if (d > BACKOFF_MAX_MS) d = BACKOFF_MAX_MS;
    d = d / 2 + (int64_t)(conn_rand(k) % (uint64_t)(d / 2 + 1));
    int64_t left = deadline - now_ms();
    sleep_ms(d < left ? d : left);
}

enum { CALL_IDEMPOTENT = 1, CALL_NO_AUTH = 2 };

static etcd_err conn_authenticate(conn *k, int64_t deadline);

/* POST body to path on some endpoint before deadline; on ETCD_OK *ans holds
 * the 200 answer (at most limit bytes). */
static etcd_err conn_call(conn *k, const char *path, const char *body, size_t limit, int flags,
                          int64_t deadline, buf *ans)
{
    int tries = 0, reauthed = 0;
    char last[300] = "no attempt";
    for (;;) {
        if (k->user && !k->token && !(flags & CALL_NO_AUTH)) {
            etcd_err e = conn_authenticate(k, deadline);
            if (e != ETCD_OK) return e;
        }
        int64_t left = deadline - now_ms();
        if (left <= 0) {
            /* every try failed in a way worth retrying: etcd is not there */
            conn_seterr(k, "%s: deadline passed; last: %s", path, last);
            return ETCD_ERR_UNAVAILABLE;
        }
        struct curl_slist *hdrs;
        etcd_err e = conn_setup(k, k->easy, path, &hdrs);
        if (e != ETCD_OK) return e;
        buf_reset(ans, limit);
        char curlerr[CURL_ERROR_SIZE] = "";
        CURL *h = k->easy;
        curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, (long)strlen(body));
        curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, buf_write);
        curl_easy_setopt(h, CURLOPT_WRITEDATA, ans);
        curl_easy_setopt(h, CURLOPT_ERRORBUFFER, curlerr);
        curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)left);
        curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS,
                         (long)(left < CONNECT_TIMEOUT_MS ? left : CONNECT_TIMEOUT_MS));
        CURLcode cc = curl_easy_perform(h);
        long http = 0, sent = 0;
        curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &http);
        curl_easy_getinfo(h, CURLINFO_REQUEST_SIZE, &sent);
        curl_easy_setopt(h, CURLOPT_ERRORBUFFER, NULL);
        curl_slist_free_all(hdrs);
        const char *ep = k->endpoints[k->cur];
        if (cc == CURLE_OK && http == 200) return ETCD_OK;
        if (cc == CURLE_OK) {
            int code;
            char msg[200];
            if (!etcd_parse_error(ans->p ? ans->p : "", ans->len, &code, msg, sizeof(msg))) {
                code = -1;
                snprintf(msg, sizeof(msg), "HTTP %ld without an etcd error body", http);
            }
            if (k->user && !(flags & CALL_NO_AUTH) && is_token_error(code, msg) && !reauthed) {
                /* the token expired or etcd restarted: log in again, once */
                reauthed = 1;
                free(k->token);
                k->token = NULL;
                continue;
            }
            snprintf(last, sizeof(last), "%s%s: %s (HTTP %ld, code %d)", ep, path, msg, http, code);
            if (code == 14 && !(flags & CALL_IDEMPOTENT) && is_ambiguous(msg)) {
                conn_seterr(k, "%s; the request may have been applied, not repeating it", last);
                return ETCD_ERR_UNAVAILABLE;
            }
            if (code == 14 || (code < 0 && http >= 500)) goto retry;
            conn_seterr(k, "%s", last);
            return code < 0 ? ETCD_ERR_PROTOCOL : map_grpc(code, msg, (int)http);
        }
        snprintf(last, sizeof(last), "%s%s: %s", ep, path,
                 curlerr[0] ? curlerr : curl_easy_strerror(cc));
        if (cc == CURLE_WRITE_ERROR && ans->over) {
            conn_seterr(k, "%s%s: answer larger than %zu bytes", ep, path, limit);
            return ETCD_ERR_TOO_LARGE;
        }
        if (cc == CURLE_WRITE_ERROR) {
            conn_seterr(k, "%s%s: out of memory for the answer", ep, path);
            return ETCD_ERR_NOMEM;
        }
        if (is_tls_error(cc, curlerr)) {
            conn_seterr(k, "%s", last);
            return ETCD_ERR_TLS;
        }
        switch (cc) {
        case CURLE_COULDNT_CONNECT:
        case CURLE_COULDNT_RESOLVE_HOST:
            goto retry;
        case CURLE_OPERATION_TIMEDOUT:
            if (sent > 0) {
                conn_seterr(k, "%s: deadline passed with the request in flight", last);
                return ETCD_ERR_TIMEOUT;
            }
            goto retry; /* one endpoint's connect timeout, or the deadline (said above) */
        case CURLE_SEND_ERROR:
        case CURLE_RECV_ERROR:
        case CURLE_GOT_NOTHING:
        case CURLE_PARTIAL_FILE:
            if (sent > 0 && !(flags & CALL_IDEMPOTENT)) {
                conn_seterr(k, "%s; the request may have been applied, not repeating it", last);
                k->cur = (k->cur + 1) % k->nendpoints;
                return ETCD_ERR_UNAVAILABLE;
            }
            goto retry;
        case CURLE_WEIRD_SERVER_REPLY:
        case CURLE_BAD_CONTENT_ENCODING:
        case CURLE_HTTP2:
        case CURLE_HTTP3:
        case CURLE_UNSUPPORTED_PROTOCOL: /* schemes are checked up front: an HTTP/0.9 reply */
            conn_seterr(k, "%s", last);
            return ETCD_ERR_PROTOCOL;
        case CURLE_URL_MALFORMAT:
            conn_seterr(k, "%s", last);
            return ETCD_ERR_ARG;
        case CURLE_OUT_OF_MEMORY:
            return ETCD_ERR_NOMEM;
        default:
            conn_seterr(k, "%s", last);
            return ETCD_ERR_UNAVAILABLE;
        }
    retry:
        tries++;
        k->cur = (k->cur + 1) % k->nendpoints;
        conn_backoff(k, tries, deadline);
    }
}

static etcd_err conn_authenticate(conn *k, int64_t deadline)
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
    buf ans = {0};
    etcd_err e = conn_call(k, "/v3/auth/authenticate", body, ETCD_MAX_SMALL_ANSWER,
                           CALL_IDEMPOTENT | CALL_NO_AUTH, deadline, &ans);
    free(body);
    if (e == ETCD_OK) {
        free(k->token);
        k->token = NULL;
        e = etcd_parse_token(ans.p, ans.len, &k->token, k->err, sizeof(k->err));
    } else {
        char why[sizeof(k->err)];
        snprintf(why, sizeof(why), "%s", k->err);
        conn_seterr(k, "authenticate as \"%s\": %s", k->user, why);
    }
    buf_free(&ans);
    return e;
}

/* ---- the client ---- */

struct etcd_client {
    conn k;
    int cfg_timeout_ms;
    int timeout_ms;
    char name[32]; /* for failpoints: etcd.<name>.<op> */
};

static etcd_err client_new(const etcd_config *cfg, etcd_client **out, char *err, size_t errlen)
{
    *out = NULL;
    if (err && errlen) err[0] = 0;
    if (!cfg) {
        if (err) snprintf(err, errlen, "no etcd configuration");
        return ETCD_ERR_ARG;
    }
    pthread_once(&curl_once, curl_init_once);
    if (curl_init_result != CURLE_OK) {
        if (err) snprintf(err, errlen, "curl_global_init failed");
        return ETCD_ERR_NOMEM;
    }
    etcd_client *c = calloc(1, sizeof(*c));
    if (!c) return ETCD_ERR_NOMEM;
    etcd_err e = conn_init(&c->k, cfg);
    if (e != ETCD_OK) goto err;
    if (cfg->timeout_ms < 0) {
        conn_seterr(&c->k, "negative etcd timeout");
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
    conn_free(&c->k);
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
    conn_free(&c->k);
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

/* The action of failpoint etcd.<client name>.<op> for this call:
 * "unavailable", "ambiguous" (failpoint.h), or NULL. "sleep:MS" stalls the
 * call here and lets it go on; other actions mean nothing here and never
 * fire. */
static const char *client_failpoint(const etcd_client *c, const char *op)
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
static etcd_err failpoint_unavailable(etcd_client *c, const char *path)
{
    conn_seterr(&c->k, "%s: failpoint: unavailable", path);
    return ETCD_ERR_UNAVAILABLE;
}

/* A failpoint "ambiguous": etcd answered, the answer is dropped, and the
 * caller hears what it hears when a connection breaks after sending. */
static etcd_err failpoint_ambiguous(etcd_client *c, const char *path)
{
    conn_seterr(&c->k, "%s: answer dropped; the request may have been applied (failpoint)", path);
    return ETCD_ERR_UNAVAILABLE;
}

/* Serialize req (consumed) and make the call; op names its failpoint. */
static etcd_err client_call(etcd_client *c, const char *op, const char *path, cJSON *req,
                            size_t limit, int flags, buf *ans)
{
    c->k.err[0] = 0;
    const char *fp = client_failpoint(c, op);
    if (fp && strcmp(fp, "unavailable") == 0) {
        cJSON_Delete(req);
        return failpoint_unavailable(c, path);
    }
    if (!req) return ETCD_ERR_NOMEM;
    char *body = cJSON_PrintUnformatted(req);
    cJSON_Delete(req);
    if (!body) return ETCD_ERR_NOMEM;
    etcd_err e;
    /* base64 makes JSON about 4/3 of the protobuf etcd limits; leave room */
    if (strlen(body) > ETCD_MAX_REQUEST_BYTES * 3 / 2 + 4096) {
        conn_seterr(&c->k, "%s: request of %zu bytes is over etcd's limit", path, strlen(body));
        e = ETCD_ERR_TOO_LARGE;
    } else {
        e = conn_call(&c->k, path, body, limit, flags, now_ms() + c->timeout_ms, ans);
    }
    free(body);
    return e == ETCD_OK && fp ? failpoint_ambiguous(c, path) : e;
}

/* ---- request building ---- */

static int add_b64(cJSON *o, const char *name, const void *data, size_t len)
{
    char *s = etcd_b64_encode(data, len);
    if (!s) return 0;
    int ok = cJSON_AddStringToObject(o, name, s) != NULL;
    free(s);
    return ok;
}

static int add_int64(cJSON *o, const char *name, int64_t v)
{
    char s[32];
    snprintf(s, sizeof(s), "%" PRId64, v);
    return cJSON_AddStringToObject(o, name, s) != NULL;
}

/* key, and range_end for a prefix: the prefix with its last byte
 * incremented (bytes 0xff dropped first); "\0" means "to the end". */
static int add_key_range(cJSON *o, const char *key, int prefix)
{
    size_t len = strlen(key);
    if (!prefix) return add_b64(o, "key", key, len);
    if (len == 0) return add_b64(o, "key", "", 1) && add_b64(o, "range_end", "", 1);
    if (!add_b64(o, "key", key, len)) return 0;
    char *end = malloc(len);
    if (!end) return 0;
    memcpy(end, key, len);
    size_t n = len;
    while (n > 0 && (unsigned char)end[n - 1] == 0xff)
        n--;
    int ok;
    if (n == 0) {
        ok = add_b64(o, "range_end", "", 1);
    } else {
        end[n - 1] = (char)((unsigned char)end[n - 1] + 1);
        ok = add_b64(o, "range_end", end, n);
    }
    free(end);
    return ok;
}

static etcd_err check_key(etcd_client *c, const char *key, int prefix)
{
    if (!key || (!*key && !prefix)) {
        conn_seterr(&c->k, "empty etcd key");
        return ETCD_ERR_ARG;
    }
    return ETCD_OK;
}

/* ---- KV ---- */

etcd_err etcd_range(etcd_client *c, const char *key, int prefix, int64_t limit,
                    etcd_range_result *out)
{
    memset(out, 0, sizeof(*out));
    etcd_err e = check_key(c, key, prefix);
    if (e != ETCD_OK) return e;
    if (limit < 0) {
        conn_seterr(&c->k, "negative range limit");
        return ETCD_ERR_ARG;
    }
    cJSON *req = cJSON_CreateObject();
    if (req && (!add_key_range(req, key, prefix) || (limit && !add_int64(req, "limit", limit)))) {
        cJSON_Delete(req);
        return ETCD_ERR_NOMEM;
    }
    buf ans = {0};
    e = client_call(c, "range", "/v3/kv/range", req, ETCD_MAX_BIG_ANSWER, CALL_IDEMPOTENT, &ans);
    if (e == ETCD_OK) e = etcd_parse_range(ans.p, ans.len, out, c->k.err, sizeof(c->k.err));
    buf_free(&ans);
    return e;
}

etcd_err etcd_get(etcd_client *c, const char *key, etcd_kv *out)
{
    memset(out, 0, sizeof(*out));
    etcd_range_result r;
    etcd_err e = etcd_range(c, key, 0, 0, &r);
    if (e != ETCD_OK) return e;
    if (r.n == 0) {
        conn_seterr(&c->k, "key \"%s\" not found", key);
        e = ETCD_ERR_NOT_FOUND;
    } else {
        *out = r.kvs[0];
        memset(&r.kvs[0], 0, sizeof(r.kvs[0]));
    }
    etcd_range_result_free(&r);
    return e;
}

etcd_err etcd_put(etcd_client *c, const char *key, const void *value, size_t len, int64_t lease,
                  int64_t *revision)
{
    etcd_err e = check_key(c, key, 0);
    if (e != ETCD_OK) return e;
    if (len && !value) {
        conn_seterr(&c->k, "put: NULL value with a length");
        return ETCD_ERR_ARG;
    }
    if (strlen(key) + len > ETCD_MAX_REQUEST_BYTES) {
        conn_seterr(&c->k, "put: key and value of %zu bytes are over etcd's 1.5 MiB limit",
                    strlen(key) + len);
        return ETCD_ERR_TOO_LARGE;
    }
    cJSON *req = cJSON_CreateObject();
    if (req && (!add_b64(req, "key", key, strlen(key)) || !add_b64(req, "value", value, len) ||
                (lease && !add_int64(req, "lease", lease)))) {
        cJSON_Delete(req);
        return ETCD_ERR_NOMEM;
    }
    buf ans = {0};
    e = client_call(c, "put", "/v3/kv/put", req, ETCD_MAX_SMALL_ANSWER, 0, &ans);
    if (e == ETCD_OK)
        e = etcd_parse_header(ans.p, ans.len, revision, NULL, c->k.err, sizeof(c->k.err));
    buf_free(&ans);
    return e;
}

etcd_err etcd_delete(etcd_client *c, const char *key, int prefix, int64_t *deleted)
{
    etcd_err e = check_key(c, key, prefix);
    if (e != ETCD_OK) return e;
    cJSON *req = cJSON_CreateObject();
    if (req && !add_key_range(req, key, prefix)) {
        cJSON_Delete(req);
        return ETCD_ERR_NOMEM;
    }
    buf ans = {0};
    e = client_call(c, "delete", "/v3/kv/deleterange", req, ETCD_MAX_SMALL_ANSWER, 0, &ans);
    if (e == ETCD_OK)
        e = etcd_parse_header(ans.p, ans.len, NULL, deleted, c->k.err, sizeof(c->k.err));
    buf_free(&ans);
    return e;
}

/* ---- txn ---- */

static const char *cmp_target_names[] = {"VERSION", "CREATE", "MOD", "VALUE", "LEASE"};
static const char *cmp_target_fields[] = {"version", "create_revision", "mod_revision", "value",
                                          "lease"};
static const char *cmp_op_names[] = {"EQUAL", "GREATER", "LESS", "NOT_EQUAL"};

static cJSON *build_cmp(const etcd_cmp *m)
{
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    int ok = add_b64(o, "key", m->key, strlen(m->key)) &&
             cJSON_AddStringToObject(o, "target", cmp_target_names[m->target]) &&
             cJSON_AddStringToObject(o, "result", cmp_op_names[m->op]);
    if (ok && m->target == ETCD_CMP_VALUE)
        ok = add_b64(o, "value", m->value, m->value_len);
    else if (ok)
        ok = add_int64(o, cmp_target_fields[m->target], m->number);
    if (!ok) {
        cJSON_Delete(o);
        return NULL;
    }
    return o;
}

static cJSON *build_op(const etcd_op *op)
{
    cJSON *o = cJSON_CreateObject();
    cJSON *r = cJSON_CreateObject();
    if (!o || !r) goto err;
    const char *name = op->type == ETCD_OP_RANGE ? "request_range"
                       : op->type == ETCD_OP_PUT ? "request_put"
                                                 : "request_delete_range";
    cJSON_AddItemToObject(o, name, r);
    if (op->type == ETCD_OP_PUT) {
        if (!add_b64(r, "key", op->key, strlen(op->key)) ||
            !add_b64(r, "value", op->value, op->value_len) ||
            (op->lease && !add_int64(r, "lease", op->lease)))
            goto err_o;
    } else if (!add_key_range(r, op->key, op->prefix)) {
        goto err_o;
    }
    return o;
err:
    cJSON_Delete(r);
err_o:
    cJSON_Delete(o);
    return NULL;
}

static etcd_err check_ops(etcd_client *c, const etcd_op *ops, size_t n, size_t *bytes, int *writes)
{
    if (n && !ops) {
        conn_seterr(&c->k, "txn: NULL operation list with a count");
        return ETCD_ERR_ARG;
    }
    for (size_t i = 0; i < n; i++) {
        const etcd_op *op = &ops[i];
        if ((unsigned)op->type > ETCD_OP_DELETE) {
            conn_seterr(&c->k, "txn: operation %zu has an unknown type", i);
            return ETCD_ERR_ARG;
        }
        etcd_err e = check_key(c, op->key, op->type != ETCD_OP_PUT && op->prefix);
        if (e != ETCD_OK) return e;
        if (op->type == ETCD_OP_PUT && op->value_len && !op->value) {
            conn_seterr(&c->k, "txn: put %zu has a NULL value with a length", i);
            return ETCD_ERR_ARG;
        }
        *bytes += strlen(op->key) + (op->type == ETCD_OP_PUT ? op->value_len : 0);
        *writes |= op->type != ETCD_OP_RANGE;
    }
    return ETCD_OK;
}

etcd_err etcd_txn(etcd_client *c, const etcd_cmp *cmps, size_t ncmp, const etcd_op *then,
                  size_t nthen, const etcd_op *els, size_t nels, etcd_txn_result *out)
{
    if (out) memset(out, 0, sizeof(*out));
    c->k.err[0] = 0;
    if (ncmp + nthen + nels > ETCD_MAX_TXN_OPS) {
        conn_seterr(&c->k, "txn: %zu compares and operations, etcd allows %d", ncmp + nthen + nels,
                    ETCD_MAX_TXN_OPS);
        return ETCD_ERR_TOO_LARGE;
    }
    if (ncmp && !cmps) {
        conn_seterr(&c->k, "txn: NULL compare list with a count");
        return ETCD_ERR_ARG;
    }
    size_t bytes = 0;
    int writes = 0;
    for (size_t i = 0; i < ncmp; i++) {
        etcd_err e = check_key(c, cmps[i].key, 0);
        if (e != ETCD_OK) return e;
        if ((unsigned)cmps[i].target > ETCD_CMP_LEASE ||
            (unsigned)cmps[i].op > ETCD_CMP_NOT_EQUAL ||
            (cmps[i].target == ETCD_CMP_VALUE && cmps[i].value_len && !cmps[i].value)) {
            conn_seterr(&c->k, "txn: compare %zu is malformed", i);
            return ETCD_ERR_ARG;
        }
        bytes += strlen(cmps[i].key) + (cmps[i].target == ETCD_CMP_VALUE ? cmps[i].value_len : 0);
    }
    etcd_err e = check_ops(c, then, nthen, &bytes, &writes);
    if (e == ETCD_OK) e = check_ops(c, els, nels, &bytes, &writes);
    if (e != ETCD_OK) return e;
    if (bytes > ETCD_MAX_REQUEST_BYTES) {
        conn_seterr(&c->k, "txn: %zu bytes of keys and values, over etcd's 1.5 MiB limit", bytes);
        return ETCD_ERR_TOO_LARGE;
    }
    cJSON *req = cJSON_CreateObject();
    cJSON *cmp = cJSON_AddArrayToObject(req, "compare");
    cJSON *succ = cJSON_AddArrayToObject(req, "success");
    cJSON *fail = cJSON_AddArrayToObject(req, "failure");
    int ok = req && cmp && succ && fail;
    for (size_t i = 0; ok && i < ncmp; i++) {
        cJSON *o = build_cmp(&cmps[i]);
        ok = o && cJSON_AddItemToArray(cmp, o);
    }
    for (size_t i = 0; ok && i < nthen; i++) {
        cJSON *o = build_op(&then[i]);
        ok = o && cJSON_AddItemToArray(succ, o);
    }
    for (size_t i = 0; ok && i < nels; i++) {
        cJSON *o = build_op(&els[i]);
        ok = o && cJSON_AddItemToArray(fail, o);
    }
    if (!ok) {
        cJSON_Delete(req);
        return ETCD_ERR_NOMEM;
    }
    buf ans = {0};
    e = client_call(c, "txn", "/v3/kv/txn", req, ETCD_MAX_BIG_ANSWER, writes ? 0 : CALL_IDEMPOTENT,
                    &ans);
    etcd_txn_result r;
    if (e == ETCD_OK) e = etcd_parse_txn(ans.p, ans.len, &r, c->k.err, sizeof(c->k.err));
    buf_free(&ans);
    if (e != ETCD_OK) return e;
    size_t ran = r.succeeded ? nthen : nels;
    if (r.n != ran) {
        conn_seterr(&c->k, "txn: %zu answers for %zu operations", r.n, ran);
        etcd_txn_result_free(&r);
        return ETCD_ERR_PROTOCOL;
    }
    if (out)
        *out = r;
    else
        etcd_txn_result_free(&r);
    return ETCD_OK;
}

/* ---- leases ---- */

static etcd_err lease_call(etcd_client *c, const char *op, const char *path, const char *field,
                           int64_t v, buf *ans)
{
    cJSON *req = cJSON_CreateObject();
    if (req && !add_int64(req, field, v)) {
        cJSON_Delete(req);
        return ETCD_ERR_NOMEM;
    }
    return client_call(c, op, path, req, ETCD_MAX_SMALL_ANSWER, CALL_IDEMPOTENT, ans);
}

etcd_err etcd_lease_grant(etcd_client *c, int64_t ttl_s, int64_t *id)
{
    c->k.err[0] = 0;
    if (ttl_s <= 0 || !id) {
        conn_seterr(&c->k, "lease grant: TTL must be positive");
        return ETCD_ERR_ARG;
    }
    /* sent again after a lost answer, a grant leaves at worst an unused
     * lease that expires by itself */
    buf ans = {0};
    etcd_err e = lease_call(c, "lease_grant", "/v3/lease/grant", "TTL", ttl_s, &ans);
    int64_t ttl;
    if (e == ETCD_OK) e = etcd_parse_lease(ans.p, ans.len, 0, id, &ttl, c->k.err, sizeof(c->k.err));
    buf_free(&ans);
    return e;
}

etcd_err etcd_lease_keepalive(etcd_client *c, int64_t id, int64_t *ttl_left)
{
    buf ans = {0};
    etcd_err e = lease_call(c, "keepalive", "/v3/lease/keepalive", "ID", id, &ans);
    int64_t rid, ttl = 0;
    if (e == ETCD_OK)
        e = etcd_parse_lease(ans.p, ans.len, 1, &rid, &ttl, c->k.err, sizeof(c->k.err));
    buf_free(&ans);
    if (e == ETCD_OK && ttl <= 0) {
        conn_seterr(&c->k, "lease %" PRId64 " not found (expired or revoked)", id);
        e = ETCD_ERR_NOT_FOUND;
    }
    if (e == ETCD_OK && ttl_left) *ttl_left = ttl;
    return e;
}

etcd_err etcd_lease_revoke(etcd_client *c, int64_t id)
{
    buf ans = {0};
    etcd_err e = lease_call(c, "lease_revoke", "/v3/lease/revoke", "ID", id, &ans);
    if (e == ETCD_OK) e = etcd_parse_header(ans.p, ans.len, NULL, NULL, c->k.err, sizeof(c->k.err));
    buf_free(&ans);
    return e;
}

/* ---- watch ---- */

typedef enum { W_DOWN, W_CONNECTING, W_LIVE, W_DEAD } watch_state;

struct etcd_watch {
    conn k;
    int timeout_ms;
    char *key;
    int prefix;
    CURLM *multi;
    CURL *stream; /* non-NULL while a stream is in the multi handle */
    struct curl_slist *hdrs;
    long status; /* HTTP status of the current stream, 0 until known */
    buf in;      /* bytes of the stream not yet split into messages */
    size_t scanned;
    int64_t next_rev; /* first revision not yet queued; 0 before the first "created" */
    int64_t last_rev; /* etcd_watch_revision */
    etcd_event *queue;
    size_t nqueue, capqueue;
    watch_state state;
    etcd_err pending; /* error to report once the queue is drained */
    etcd_err dead_err;
    int64_t retry_at;   /* W_DOWN: when to reconnect */
    int64_t down_since; /* when the stream was last not live; 0 while live */
    int tries;          /* failed connects in a row, for backoff */
    int64_t live_since; /* when the current stream was created */
    int reauthed;
    int created_once;
    char curlerr[CURL_ERROR_SIZE];
    atomic_int woken;
};

static size_t stream_write(void *data, size_t size, size_t n, void *user)
{
    etcd_watch *w = user;
    if (w->status == 0) {
        curl_easy_getinfo(w->stream, CURLINFO_RESPONSE_CODE, &w->status);
        /* an error answer is small; a stream is capped per message below */
        if (w->status != 200) w->in.limit = ETCD_MAX_SMALL_ANSWER;
    }
    return buf_append(&w->in, data, size * n) == 0 ? size * n : 0;
}

static void stream_stop(etcd_watch *w)
{
    if (w->stream) {
        curl_multi_remove_handle(w->multi, w->stream);
        curl_easy_cleanup(w->stream);
        w->stream = NULL;
    }
    curl_slist_free_all(w->hdrs);
    w->hdrs = NULL;
}

static void watch_die(etcd_watch *w, etcd_err e)
{
    stream_stop(w);
    w->state = W_DEAD;
    w->dead_err = e;
}

/* The stream broke or could not start: try the next endpoint after a
 * backoff (no wait before the first retry of a stream that was live). */
static void watch_down(etcd_watch *w)
{
    int was_live = w->state == W_LIVE;
    stream_stop(w);
    w->state = W_DOWN;
    int64_t now = now_ms();
    if (!w->down_since) w->down_since = now;
    w->k.cur = (w->k.cur + 1) % w->k.nendpoints;
    /* a stream that lived a while starts over without waiting; one that
     * breaks right after "created" keeps backing off (no reconnect storm) */
    if (was_live && now - w->live_since >= 1000) w->tries = 0;
    int64_t d = 0;
    if (w->tries > 0) {
        int r = w->tries - 1 < 6 ? w->tries - 1 : 6;
        d = BACKOFF_FIRST_MS << r;
        if (d > BACKOFF_MAX_MS) d = BACKOFF_MAX_MS;
        d = d / 2 + (int64_t)(conn_rand(&w->k) % (uint64_t)(d / 2 + 1));
    }
    w->tries++;
    w->retry_at = now + d;
}

static etcd_err stream_start(etcd_watch *w)
{
    cJSON *req = cJSON_CreateObject();
    cJSON *cr = cJSON_AddObjectToObject(req, "create_request");
    if (!cr || !add_key_range(cr, w->key, w->prefix) ||
        (w->next_rev && !add_int64(cr, "start_revision", w->next_rev))) {
        cJSON_Delete(req);
        return ETCD_ERR_NOMEM;
    }
    char *body = cJSON_PrintUnformatted(req);
    cJSON_Delete(req);
    if (!body) return ETCD_ERR_NOMEM;
    w->stream = curl_easy_init();
    etcd_err e = w->stream ? conn_setup(&w->k, w->stream, "/v3/watch", &w->hdrs) : ETCD_ERR_NOMEM;
    /* clientv3's WithRequireLeader: the gateway passes Grpc-Metadata-* on as
     * gRPC metadata, and with "hasleader" a member that has no leader
     * refuses the watch, or cancels it once it has lost its leader for three
     * election timeouts (cut off from its peers, it would otherwise keep the
     * stream open and silent, while the others move on) */
    struct curl_slist *l =
        e == ETCD_OK ? curl_slist_append(w->hdrs, "Grpc-Metadata-Hasleader: true") : NULL;
    if (e == ETCD_OK && !l) e = ETCD_ERR_NOMEM;
    if (e != ETCD_OK) {
        free(body);
        stream_stop(w);
        return e;
    }
    curl_easy_setopt(w->stream, CURLOPT_HTTPHEADER, l);
    curl_easy_setopt(w->stream, CURLOPT_COPYPOSTFIELDS, body);
    free(body);
    curl_easy_setopt(w->stream, CURLOPT_WRITEFUNCTION, stream_write);
    curl_easy_setopt(w->stream, CURLOPT_WRITEDATA, w);
    curl_easy_setopt(w->stream, CURLOPT_CONNECTTIMEOUT_MS, (long)CONNECT_TIMEOUT_MS);
    w->curlerr[0] = 0;
    curl_easy_setopt(w->stream, CURLOPT_ERRORBUFFER, w->curlerr);
    w->status = 0;
    buf_reset(&w->in, ETCD_MAX_BIG_ANSWER);
    w->scanned = 0;
    if (curl_multi_add_handle(w->multi, w->stream) != CURLM_OK) {
        stream_stop(w);
        return ETCD_ERR_NOMEM;
    }
    w->state = W_CONNECTING;
    return ETCD_OK;
}

/* Events of one revision (a txn) share its number and always come in one
 * message, so what was seen before a resume is told apart by the revision
 * the stream resumed from, not by the event before. */
static etcd_err queue_events(etcd_watch *w, etcd_watch_msg *m)
{
    int64_t from = w->next_rev;
    for (size_t i = 0; i < m->n; i++) {
        etcd_event *ev = &m->events[i];
        if (ev->kv.mod_revision < from) continue; /* seen before a resume */
        if (w->nqueue == w->capqueue) {
            size_t cap = w->capqueue ? 2 * w->capqueue : 16;
            etcd_event *q = realloc(w->queue, cap * sizeof(*q));
            if (!q) return ETCD_ERR_NOMEM;
            w->queue = q;
            w->capqueue = cap;
        }
        w->queue[w->nqueue++] = *ev;
        memset(ev, 0, sizeof(*ev));
        w->next_rev = w->queue[w->nqueue - 1].kv.mod_revision + 1;
    }
    return ETCD_OK;
}

/* Act on one message of the stream. */
static void handle_msg(etcd_watch *w, const char *line, size_t len)
{
    etcd_watch_msg m;
    etcd_err e = etcd_parse_watch_msg(line, len, &m, w->k.err, sizeof(w->k.err));
    if (e == ETCD_ERR_NOMEM) {
        w->pending = e;
        watch_down(w);
        return;
    }
    if (e != ETCD_OK) {
        /* garbage: report it, then resume from the last good revision */
        char why[sizeof(w->k.err)];
        snprintf(why, sizeof(why), "%s", w->k.err);
        conn_seterr(&w->k, "watch stream from %s: %s", w->k.endpoints[w->k.cur], why);
        w->pending = ETCD_ERR_PROTOCOL;
        watch_down(w);
        return;
    }
    if (m.error_code) {
        conn_seterr(&w->k, "watch stream from %s: %s (code %d)", w->k.endpoints[w->k.cur], m.reason,
                    m.error_code);
        if (m.error_code == 14) {
            watch_down(w);
        } else if (w->k.user && is_token_error(m.error_code, m.reason) && !w->reauthed) {
            w->reauthed = 1;
            free(w->k.token);
            w->k.token = NULL;
            watch_down(w);
        } else {
            watch_die(w, map_grpc(m.error_code, m.reason, 200));
        }
    } else if (m.canceled) {
        if (m.compact_revision > 0) {
            conn_seterr(&w->k, "watch from revision %" PRId64 ": compacted up to %" PRId64,
                        w->next_rev, m.compact_revision);
            w->last_rev = m.compact_revision;
            watch_die(w, ETCD_ERR_COMPACTED);
        } else if (w->k.user && strstr(m.reason, "invalid auth token") && !w->reauthed) {
            /* an auth failure is a cancel with a reason: log in again, once */
            w->reauthed = 1;
            free(w->k.token);
            w->k.token = NULL;
            conn_seterr(&w->k, "watch canceled by etcd: %s", m.reason);
            watch_down(w);
        } else {
            conn_seterr(&w->k, "watch canceled by etcd: %s",
                        m.reason[0] ? m.reason : "(no reason)");
            int auth =
                strstr(m.reason, "Unauthenticated") || strstr(m.reason, "PermissionDenied") ||
                strstr(m.reason, "permission denied") || strstr(m.reason, "user name is empty");
            watch_die(w, auth ? ETCD_ERR_AUTH : ETCD_ERR_CANCELED);
        }
    } else {
        if (m.created && w->state == W_CONNECTING) {
            w->state = W_LIVE;
            w->created_once = 1;
            w->down_since = 0;
            w->live_since = now_ms();
            w->reauthed = 0;
            if (w->next_rev == 0) {
                w->next_rev = m.header_revision + 1;
                w->last_rev = m.header_revision;
            }
        }
        if (queue_events(w, &m) != ETCD_OK) {
            w->pending = ETCD_ERR_NOMEM;
            watch_down(w);
        }
    }
    etcd_watch_msg_free(&m);
}

/* Split what arrived into messages. */
static void split_messages(etcd_watch *w)
{
    size_t start = 0;
    while (w->stream && w->status == 200) {
        char *nl = memchr(w->in.p + w->scanned, '\n', w->in.len - w->scanned);
        if (!nl) {
            w->scanned = w->in.len;
            break;
        }
        size_t end = (size_t)(nl - w->in.p);
        size_t s = start;
        while (s < end && (w->in.p[s] == ' ' || w->in.p[s] == '\r'))
            s++;
        if (s < end) handle_msg(w, w->in.p + s, end - s);
        start = end + 1;
        w->scanned = start;
    }
    if (!w->stream) return; /* handle_msg dropped the stream and its buffer */
    if (start > 0) {
        memmove(w->in.p, w->in.p + start, w->in.len - start);
        w->in.len -= start;
        w->in.p[w->in.len] = 0;
        w->scanned -= start;
    }
}

/* The stream's transfer ended: why, and what next. */
static void stream_done(etcd_watch *w, CURLcode cc)
{
    const char *ep = w->k.endpoints[w->k.cur];
    int code;
    char msg[200];
    if (cc == CURLE_WRITE_ERROR && w->in.over) {
        conn_seterr(&w->k, "watch stream from %s: message larger than %zu bytes", ep, w->in.limit);
        w->pending = ETCD_ERR_TOO_LARGE;
        watch_down(w);
        return;
    }
    if (is_tls_error(cc, w->curlerr)) {
        conn_seterr(&w->k, "watch %s: %s", ep, w->curlerr[0] ? w->curlerr : curl_easy_strerror(cc));
        watch_die(w, ETCD_ERR_TLS);
        return;
    }
    if (cc == CURLE_OK && w->status != 200) {
        if (!etcd_parse_error(w->in.p ? w->in.p : "", w->in.len, &code, msg, sizeof(msg))) {
            code = -1;
            snprintf(msg, sizeof(msg), "HTTP %ld without an etcd error body", w->status);
        }
        conn_seterr(&w->k, "watch %s: %s (HTTP %ld, code %d)", ep, msg, w->status, code);
        if (w->k.user && is_token_error(code, msg) && !w->reauthed) {
            w->reauthed = 1;
            free(w->k.token);
            w->k.token = NULL;
        } else if (!(code == 14 || (code < 0 && w->status >= 500))) {
            watch_die(w, code < 0 ? ETCD_ERR_PROTOCOL : map_grpc(code, msg, (int)w->status));
            return;
        }
    } else if (cc == CURLE_OK && w->in.len &&
               etcd_parse_error(w->in.p, w->in.len, &code, msg, sizeof(msg))) {
        /* etcd ended the stream with an error (a member without a leader
         * cancels the watch: code 14, "etcdserver: no leader"), which the
         * gateway writes without the newline that ends other messages */
        handle_msg(w, w->in.p, w->in.len);
        if (!w->stream) return; /* down (14: on to the next endpoint) or over */
        conn_seterr(&w->k, "watch stream from %s ended after an error", ep);
    } else if (cc == CURLE_OK) {
        conn_seterr(&w->k, "watch stream from %s ended%s", ep,
                    w->in.len ? " in the middle of a message" : "");
    } else {
        conn_seterr(&w->k, "watch stream from %s: %s", ep,
                    w->curlerr[0] ? w->curlerr : curl_easy_strerror(cc));
    }
    watch_down(w); /* a resume sends what was lost with a partial message again */
}

/* Drive the stream until something for the caller is ready or until. */
static etcd_err watch_pump(etcd_watch *w, int64_t until, int want_created)
{
    for (;;) {
        /* once created, even a cancel right after it is the caller's to read */
        if (want_created && w->created_once) return ETCD_OK;
        if (w->state == W_DEAD) return w->dead_err;
        if (want_created && w->pending != ETCD_OK) return w->pending;
        if (!want_created && (w->nqueue || w->pending != ETCD_OK)) return ETCD_OK;
        if (!want_created && atomic_exchange(&w->woken, 0)) return ETCD_OK;
        if (w->state == W_DOWN && now_ms() >= w->retry_at) {
            if (w->k.user && !w->k.token) {
                /* log in again first: a short blocking call, bounded by the
                 * client's timeout (simpler than driving it through the
                 * multi handle, which would make it wakeable too) */
                etcd_err e = conn_authenticate(&w->k, now_ms() + w->timeout_ms);
                if (e == ETCD_ERR_AUTH || e == ETCD_ERR_TLS || e == ETCD_ERR_NOMEM) {
                    watch_die(w, e);
                    continue;
                }
                if (e != ETCD_OK) {
                    watch_down(w);
                    if (now_ms() >= until) return ETCD_OK;
                    continue;
                }
            }
            etcd_err e = stream_start(w);
            if (e != ETCD_OK) {
                watch_die(w, e);
                continue;
            }
        }
        /* at least one pass over the stream, even with no time to wait */
        int running = 0;
        curl_multi_perform(w->multi, &running);
        if (w->stream) split_messages(w);
        CURLMsg *msg;
        int left;
        while ((msg = curl_multi_info_read(w->multi, &left))) {
            if (msg->msg == CURLMSG_DONE && w->stream && msg->easy_handle == w->stream) {
                CURLcode cc = msg->data.result;
                split_messages(w);
                if (w->stream) stream_done(w, cc);
            }
        }
        /* anything that ends the wait is seen at the top, not after a poll */
        if (w->state == W_DEAD || w->nqueue || w->pending != ETCD_OK ||
            (want_created && w->created_once))
            continue;
        int64_t now = now_ms();
        if (now >= until) return ETCD_OK;
        int64_t wait = until - now;
        if (w->state == W_DOWN) {
            if (w->retry_at <= now) continue;
            if (w->retry_at - now < wait) wait = w->retry_at - now;
        }
        int numfds;
        curl_multi_poll(w->multi, NULL, 0, (int)(wait > 1000 ? 1000 : wait), &numfds);
    }
}

etcd_err etcd_watch_open(etcd_client *c, const char *key, int prefix, int64_t start_revision,
                         etcd_watch **out)
{
    *out = NULL;
    etcd_err e = check_key(c, key, prefix);
    if (e != ETCD_OK) return e;
    if (start_revision < 0) {
        conn_seterr(&c->k, "negative watch start revision");
        return ETCD_ERR_ARG;
    }
    c->k.err[0] = 0;
    const char *fp = client_failpoint(c, "watch");
    if (fp && strcmp(fp, "unavailable") == 0) return failpoint_unavailable(c, "/v3/watch");
    etcd_watch *w = calloc(1, sizeof(*w));
    if (!w) return ETCD_ERR_NOMEM;
    atomic_init(&w->woken, 0);
    w->timeout_ms = c->timeout_ms;
    w->prefix = prefix;
    w->next_rev = start_revision;
    w->last_rev = start_revision > 0 ? start_revision - 1 : 0;
    w->state = W_DOWN;
    w->down_since = now_ms();
    e = conn_copy(&w->k, &c->k);
    if (e != ETCD_OK) goto err;
    if (!(w->key = strdup(key)) || !(w->multi = curl_multi_init())) {
        e = ETCD_ERR_NOMEM;
        goto err;
    }
    /* wait for "created", so that every change after open is seen */
    int64_t deadline = now_ms() + c->timeout_ms;
    e = watch_pump(w, deadline, 1);
    if (e == ETCD_OK && !w->created_once) {
        e = ETCD_ERR_UNAVAILABLE;
        char why[sizeof(w->k.err)];
        snprintf(why, sizeof(why), "%s", w->k.err[0] ? w->k.err : "no answer");
        conn_seterr(&w->k, "watch %s: not created before the deadline; last: %s", key, why);
    }
    if (e != ETCD_OK) goto err;
    if (fp) {
        etcd_watch_close(w);
        return failpoint_ambiguous(c, "/v3/watch");
    }
    *out = w;
    return ETCD_OK;
err:
    snprintf(c->k.err, sizeof(c->k.err), "%s", w->k.err);
    etcd_watch_close(w);
    return e;
}

etcd_err etcd_watch_next(etcd_watch *w, int timeout_ms, etcd_event **events, size_t *n)
{
    *events = NULL;
    *n = 0;
    int64_t start = now_ms();
    etcd_err e = watch_pump(w, start + (timeout_ms > 0 ? timeout_ms : 0), 0);
    if (w->nqueue) {
        *events = w->queue;
        *n = w->nqueue;
        w->last_rev = w->queue[w->nqueue - 1].kv.mod_revision;
        w->queue = NULL;
        w->nqueue = w->capqueue = 0;
        return ETCD_OK;
    }
    if (e != ETCD_OK) return e;
    if (w->pending != ETCD_OK) {
        e = w->pending;
        w->pending = ETCD_OK;
        return e;
    }
    if (w->state != W_LIVE && w->down_since && now_ms() - w->down_since > w->timeout_ms) {
        char why[sizeof(w->k.err)];
        snprintf(why, sizeof(why), "%s", w->k.err);
        conn_seterr(&w->k, "watch: no endpoint for %" PRId64 " ms (still trying); last: %s",
                    now_ms() - w->down_since, why);
        return ETCD_ERR_UNAVAILABLE;
    }
    return ETCD_OK;
}

int64_t etcd_watch_revision(const etcd_watch *w)
{
    return w->last_rev;
}

void etcd_watch_wakeup(etcd_watch *w)
{
    atomic_store(&w->woken, 1);
    curl_multi_wakeup(w->multi);
}

const char *etcd_watch_last_error(const etcd_watch *w)
{
    return w ? w->k.err : "";
}

void etcd_watch_close(etcd_watch *w)
{
    if (!w) return;
    stream_stop(w);
    if (w->multi) curl_multi_cleanup(w->multi);
    etcd_events_free(w->queue, w->nqueue);
    buf_free(&w->in);
    free(w->key);
    conn_free(&w->k);
    free(w);
}
