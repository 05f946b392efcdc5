/* etcd_send.c: sending one request, the one door every unary call goes through.
 *
 * etcd_send() checks the call's failpoint (failpoint.h), refuses a body over
 * etcd's size limit and cuts the client's deadline; etcd_send_conn() then
 * POSTs the body (etcd_conn_post, one try on one endpoint) and decides from
 * the outcome whether to answer, to log in again, or to try the next
 * endpoint after an exponential backoff with jitter. So failpoints, limits,
 * deadlines, retries and auth hold for every call alike.
 *
 * Only transient failures are retried (no connection, a reset, HTTP 5xx
 * without a gRPC verdict, gRPC "unavailable", which includes "no leader":
 * every call requires a leader, so a member cut off from its peers refuses
 * it before acting and the call goes on to the next endpoint); a failed
 * compare, a bad request or a missing lease are answers. A request that may
 * have reached etcd is sent again only when doing so cannot change the
 * outcome (ranges, lease calls); for a put, delete or a writing txn a
 * connection lost after sending, or an "unavailable" that etcd gives after
 * proposing ("request timed out", "leader changed"), is reported, not
 * repeated, because repeating it could apply it twice or make a guarded txn
 * fail on its own first write (etcd's clientv3 draws the same line).
 *
 * A watch (etcd_watch.c) drives its own stream, and shares from here the
 * failpoints, the login and what a gRPC status means.
 */
#include "etcd_internal.h"

#include "ductile/clock.h"
#include "ductile/failpoint.h"

#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The reason of the last failed try, said when the deadline passes. */
#define LAST_MAX 300

/* ---- failpoints ---- */

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

/* ---- what an answer means ---- */

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

/* ---- one try's verdict ---- */

/* What follows a try that did not bring a 200 answer. */
typedef enum { TRY_ANSWER, TRY_RETRY, TRY_LOGIN } try_next;

/* An HTTP answer other than 200: a gRPC error, or none. */
static try_next judge_answer(etcd_conn *k, const char *path, const etcd_buf *ans, const etcd_try *t,
                             int flags, int *reauthed, char *last, etcd_err *e)
{
    const char *ep = k->endpoints[k->cur];
    int code;
    char msg[ETCD_REASON_MAX];
    if (!etcd_parse_error(ans->p ? ans->p : "", ans->len, &code, msg, sizeof(msg))) {
        code = -1;
        snprintf(msg, sizeof(msg), "HTTP %ld without an etcd error body", t->http);
    }
    if (k->user && !(flags & ETCD_CALL_NO_AUTH) && etcd_is_token_error(code, msg) && !*reauthed) {
        /* the token expired or etcd restarted: log in again, once */
        *reauthed = 1;
        free(k->token);
        k->token = NULL;
        return TRY_LOGIN;
    }
    snprintf(last, LAST_MAX, "%s%s: %s (HTTP %ld, code %d)", ep, path, msg, t->http, code);
    if (code == 14 && !(flags & ETCD_CALL_IDEMPOTENT) && is_ambiguous(msg)) {
        etcd_conn_seterr(k, "%s; the request may have been applied, not repeating it", last);
        *e = ETCD_ERR_UNAVAILABLE;
        return TRY_ANSWER;
    }
    /* "no leader" (the require-leader refusal) comes before
     * anything was proposed: another endpoint may have one */
    if (code == 14 || (code < 0 && t->http >= 500)) return TRY_RETRY;
    /* A client given credentials waits, within its deadline, for
     * etcd's auth to be switched on, as it waits for etcd to start:
     * a deployment enables it just after etcd comes up (the chart's
     * post-install hook) while the agents may already be calling. */
    if (code == 9 && strstr(msg, "authentication is not enabled")) return TRY_RETRY;
    etcd_conn_seterr(k, "%s", last);
    *e = code < 0 ? ETCD_ERR_PROTOCOL : etcd_map_grpc(code, msg, (int)t->http);
    return TRY_ANSWER;
}

/* A transfer that failed: what curl said, and whether the request was sent. */
static try_next judge_transfer(etcd_conn *k, const char *path, const etcd_buf *ans, size_t limit,
                               const etcd_try *t, int flags, char *last, etcd_err *e)
{
    const char *ep = k->endpoints[k->cur];
    CURLcode cc = t->cc;
    snprintf(last, LAST_MAX, "%s%s: %s", ep, path,
             t->curlerr[0] ? t->curlerr : curl_easy_strerror(cc));
    *e = ETCD_OK;
    if (cc == CURLE_WRITE_ERROR && ans->over) {
        etcd_conn_seterr(k, "%s%s: answer larger than %zu bytes", ep, path, limit);
        *e = ETCD_ERR_TOO_LARGE;
    } else if (cc == CURLE_WRITE_ERROR) {
        etcd_conn_seterr(k, "%s%s: out of memory for the answer", ep, path);
        *e = ETCD_ERR_NOMEM;
    } else if (etcd_is_tls_error(cc, t->curlerr)) {
        etcd_conn_seterr(k, "%s", last);
        *e = ETCD_ERR_TLS;
    }
    if (*e != ETCD_OK) return TRY_ANSWER;
    switch (cc) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
        return TRY_RETRY;
    case CURLE_OPERATION_TIMEDOUT:
        if (t->sent > 0) {
            etcd_conn_seterr(k, "%s: deadline passed with the request in flight", last);
            *e = ETCD_ERR_TIMEOUT;
            return TRY_ANSWER;
        }
        return TRY_RETRY; /* one endpoint's connect timeout, or the deadline (said above) */
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
        if (t->sent > 0 && !(flags & ETCD_CALL_IDEMPOTENT)) {
            etcd_conn_seterr(k, "%s; the request may have been applied, not repeating it", last);
            k->cur = (k->cur + 1) % k->nendpoints;
            *e = ETCD_ERR_UNAVAILABLE;
            return TRY_ANSWER;
        }
        return TRY_RETRY;
    case CURLE_HTTP2:
        /* libcurl on GnuTLS reports a connection broken while it sends
         * HTTP/2's preface, before the request (etcd refusing a TLS 1.3
         * client certificate just after the handshake), as an HTTP/2
         * error: nothing was sent, so it is retried as a send failure
         * is, and the next try reads the TLS alert. */
        if (t->sent == 0) return TRY_RETRY;
        *e = ETCD_ERR_PROTOCOL;
        break;
    case CURLE_WEIRD_SERVER_REPLY:
    case CURLE_BAD_CONTENT_ENCODING:
    case CURLE_HTTP3:
    case CURLE_UNSUPPORTED_PROTOCOL: /* schemes are checked up front: an HTTP/0.9 reply */
        *e = ETCD_ERR_PROTOCOL;
        break;
    case CURLE_URL_MALFORMAT:
        *e = ETCD_ERR_ARG;
        break;
    case CURLE_OUT_OF_MEMORY:
        *e = ETCD_ERR_NOMEM;
        return TRY_ANSWER;
    default:
        *e = ETCD_ERR_UNAVAILABLE;
        break;
    }
    etcd_conn_seterr(k, "%s", last);
    return TRY_ANSWER;
}

/* ---- sending ---- */

static void sleep_ms(int64_t ms)
{
    if (ms <= 0) return;
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

/* Sleep before the next try: once every endpoint has failed in a row,
 * exponential backoff with jitter (half to full), never past the deadline. */
static void backoff(etcd_conn *k, int tries, int64_t deadline)
{
    if (tries % (int)k->nendpoints != 0) return;
    int rounds = tries / (int)k->nendpoints - 1;
    int64_t d = ETCD_BACKOFF_FIRST_MS << (rounds < 6 ? rounds : 6);
    if (d > ETCD_BACKOFF_MAX_MS) d = ETCD_BACKOFF_MAX_MS;
    d = d / 2 + (int64_t)(etcd_conn_rand(k) % (uint64_t)(d / 2 + 1));
    int64_t left = deadline - mono_now_ms();
    sleep_ms(d < left ? d : left);
}

etcd_err etcd_send_conn(etcd_conn *k, const char *path, const char *body, size_t limit, int flags,
                        int64_t deadline, etcd_buf *ans)
{
    int tries = 0, reauthed = 0;
    char last[LAST_MAX] = "no attempt";
    for (;;) {
        if (k->user && !k->token && !(flags & ETCD_CALL_NO_AUTH)) {
            etcd_err e = etcd_send_login(k, deadline);
            if (e != ETCD_OK) return e;
        }
        int64_t left = deadline - mono_now_ms();
        if (left <= 0) {
            /* every try failed in a way worth retrying: etcd is not there */
            etcd_conn_seterr(k, "%s: deadline passed; last: %s", path, last);
            return ETCD_ERR_UNAVAILABLE;
        }
        etcd_try t;
        etcd_err e = etcd_conn_post(k, path, body, limit, left, ans, &t);
        if (e != ETCD_OK) return e;
        if (t.cc == CURLE_OK && t.http == 200) return ETCD_OK;
        try_next next = t.cc == CURLE_OK
                            ? judge_answer(k, path, ans, &t, flags, &reauthed, last, &e)
                            : judge_transfer(k, path, ans, limit, &t, flags, last, &e);
        if (next == TRY_ANSWER) return e;
        if (next == TRY_LOGIN) continue;
        tries++;
        k->cur = (k->cur + 1) % k->nendpoints;
        backoff(k, tries, deadline);
    }
}

etcd_err etcd_send_login(etcd_conn *k, int64_t deadline)
{
    char *body;
    if (etcd_build_auth(k->user, k->password, &body) != ETCD_OK) return ETCD_ERR_NOMEM;
    etcd_buf ans = {0};
    etcd_err e = etcd_send_conn(k, "/v3/auth/authenticate", body, ETCD_MAX_SMALL_ANSWER,
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

etcd_err etcd_send(etcd_client *c, const char *op, const char *path, char *body, size_t limit,
                   int flags, etcd_buf *ans)
{
    c->k.err[0] = 0;
    const char *fp = etcd_client_failpoint(c, op);
    etcd_err e;
    if (fp && strcmp(fp, "unavailable") == 0) {
        e = etcd_failpoint_unavailable(c, path);
    } else if (strlen(body) > ETCD_MAX_REQUEST_BYTES * 3 / 2 + 4096) {
        /* base64 makes JSON about 4/3 of the protobuf etcd limits; leave room */
        etcd_conn_seterr(&c->k, "%s: request of %zu bytes is over etcd's limit", path,
                         strlen(body));
        e = ETCD_ERR_TOO_LARGE;
    } else {
        e = etcd_send_conn(&c->k, path, body, limit, flags, mono_now_ms() + c->timeout_ms, ans);
        if (e == ETCD_OK && fp) e = etcd_failpoint_ambiguous(c, path);
    }
    free(body);
    return e;
}
