/* etcd_internal.h: private to the etcd client (etcd_*.c) and its tests.
 *
 * The client is split along the steps of a call, and a call goes down them,
 * never back up:
 *   etcd_kv.c      key-value, txn and lease calls: build, send, parse
 *   etcd_watch.c   the watch stream
 *   etcd_build.c   request bodies, and the checks of a call's arguments
 *   etcd_send.c    one send: failpoint, size check, deadline, retry, login
 *   etcd_conn.c    a connection: endpoints, TLS, headers, one POST
 *   etcd_json.c    answer parsing (and base64), where the fuzz target reaches it
 *   etcd_client.c  the client object, its deadline, name and counts
 *
 * The parsers take the raw bytes of an answer, so that the fuzz target and
 * the corpus replay drive exactly the code a real answer goes through. Each
 * fills its result only on ETCD_OK and frees what it made otherwise; on error
 * it writes a one-line reason into err. The fuzz target builds etcd_json.c
 * alone: it uses only the parser half of this header.
 */
#ifndef DUCTILE_ETCD_INTERNAL_H
#define DUCTILE_ETCD_INTERNAL_H

#include "ductile/etcd.h"

#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <stddef.h>
#include <stdint.h>

/* Size limits: etcd takes requests up to 1.5 MiB and a txn of at most 128
 * operations; answers that can carry many values (range, txn, a watch
 * message) are capped at 64 MiB, the others at 1 MiB. */
#define ETCD_MAX_REQUEST_BYTES ((size_t)1536 * 1024)
#define ETCD_MAX_TXN_OPS 128
#define ETCD_MAX_BIG_ANSWER ((size_t)64 << 20)
#define ETCD_MAX_SMALL_ANSWER ((size_t)1 << 20)

/* The message of one gRPC error or watch cancel, as kept (longer ones are cut). */
#define ETCD_REASON_MAX 200

/* Base64 (standard alphabet, padded), as the gateway writes bytes. The
 * decoder NUL-terminates its output and rejects anything that is not
 * canonical base64. */
char *etcd_b64_encode(const void *data, size_t len);
int etcd_b64_decode(const char *in, size_t inlen, char **out, size_t *outlen);

/* A gRPC error answer: {"error":"...","code":N,"message":"..."} or, inside a
 * stream, {"error":{"grpc_code":N,"message":"..."}}. Returns 1 and fills
 * code/msg when body is one, 0 otherwise. */
int etcd_parse_error(const char *body, size_t len, int *code, char *msg, size_t msglen);

/* header.revision of a put / delete / compaction answer; *deleted (may be
 * NULL) gets "deleted" of a delete answer. */
etcd_err etcd_parse_header(const char *body, size_t len, int64_t *revision, int64_t *deleted,
                           char *err, size_t errlen);
etcd_err etcd_parse_range(const char *body, size_t len, etcd_range_result *out, char *err,
                          size_t errlen);
etcd_err etcd_parse_txn(const char *body, size_t len, etcd_txn_result *out, char *err,
                        size_t errlen);
/* Lease grant ({"ID","TTL"}) or keep-alive ({"result":{"ID","TTL"}}). A
 * missing TTL is returned as 0 (the lease is gone). */
etcd_err etcd_parse_lease(const char *body, size_t len, int keepalive, int64_t *id, int64_t *ttl,
                          char *err, size_t errlen);
/* {"token":"..."} of /v3/auth/authenticate; *token is malloc'd. */
etcd_err etcd_parse_token(const char *body, size_t len, char **token, char *err, size_t errlen);

/* One message of a watch stream. */
typedef struct etcd_watch_msg {
    int created;
    int canceled;
    int64_t header_revision;
    int64_t compact_revision;
    int64_t watch_id;             /* which watch of the stream (0 when absent) */
    int error_code;               /* set when the message is an error (stream error or cancel) */
    char reason[ETCD_REASON_MAX]; /* cancel_reason or the stream error's message */
    etcd_event *events;
    size_t n;
} etcd_watch_msg;

etcd_err etcd_parse_watch_msg(const char *line, size_t len, etcd_watch_msg *out, char *err,
                              size_t errlen);
void etcd_watch_msg_free(etcd_watch_msg *m);

/* ---- a connection (etcd_conn.c) ---- */

#define ETCD_CONNECT_TIMEOUT_MS 2000 /* one endpoint; a dead one must not eat the deadline */
#define ETCD_BACKOFF_FIRST_MS 25
#define ETCD_BACKOFF_MAX_MS 1000

/* A growing buffer with a cap: an answer, or a watch stream's unread bytes. */
typedef struct etcd_buf {
    char *p;
    size_t len, cap, limit;
    int over; /* the answer went past limit */
} etcd_buf;

int etcd_buf_append(etcd_buf *b, const void *data, size_t n);
void etcd_buf_reset(etcd_buf *b, size_t limit);
void etcd_buf_free(etcd_buf *b);

/* Endpoints, TLS, auth, one curl handle. */
typedef struct etcd_conn {
    char **endpoints;
    size_t nendpoints;
    size_t cur; /* endpoint tried first; moves on after a failure */
    char *cacert, *cert, *key, *user, *password;
    char *token;
    CURL *easy;
    uint64_t rng;
    etcd_counts *counts;    /* every request is added here; NULL: not counted */
    char err[ETCD_MSG_MAX]; /* etcd_last_error, etcd_watch_last_error */
} etcd_conn;

etcd_err etcd_conn_init(etcd_conn *k, const etcd_config *cfg);
/* A copy for a watch: same endpoints and credentials, its own handle. */
etcd_err etcd_conn_copy(etcd_conn *dst, const etcd_conn *src);
void etcd_conn_free(etcd_conn *k);
void etcd_conn_seterr(etcd_conn *k, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Jitter for backoffs. */
uint64_t etcd_conn_rand(etcd_conn *k);
/* Options shared by unary calls and watch streams: URL of the current
 * endpoint, headers (*hdrs, the caller frees them), TLS, keep-alive. */
etcd_err etcd_conn_setup(etcd_conn *k, CURL *h, const char *path, struct curl_slist **hdrs);

/* What one POST brought: curl's verdict, the HTTP status, the bytes sent. */
typedef struct etcd_try {
    CURLcode cc;
    long http, sent;
    char curlerr[CURL_ERROR_SIZE];
} etcd_try;

/* One POST of body to path on the current endpoint, curl's timeouts cut
 * from left ms; the answer goes to ans (at most limit bytes). An error only
 * when the request could not be set up; the outcome is in *t. */
etcd_err etcd_conn_post(etcd_conn *k, const char *path, const char *body, size_t limit,
                        int64_t left, etcd_buf *ans, etcd_try *t);

/* ---- request bodies (etcd_build.c) ---- */

/* Each checks the call's arguments (ETCD_ERR_ARG or ETCD_ERR_TOO_LARGE with
 * the reason in err) and returns the malloc'd JSON body in *body. */
etcd_err etcd_check_key(const char *key, int prefix, char *err, size_t errlen);
etcd_err etcd_build_range(const char *key, int prefix, int64_t limit, char **body, char *err,
                          size_t errlen);
etcd_err etcd_build_put(const char *key, const void *value, size_t len, int64_t lease, char **body,
                        char *err, size_t errlen);
etcd_err etcd_build_delete(const char *key, int prefix, char **body, char *err, size_t errlen);

/* The arguments of etcd_txn. */
typedef struct etcd_txn_req {
    const etcd_cmp *cmps;
    size_t ncmp;
    const etcd_op *then;
    size_t nthen;
    const etcd_op *els;
    size_t nels;
} etcd_txn_req;

/* *writes: whether any operation writes (then the txn is not idempotent). */
etcd_err etcd_build_txn(const etcd_txn_req *t, int *writes, char **body, char *err, size_t errlen);
/* {field: v} of a lease grant ("TTL"), keep-alive or revoke ("ID"). */
etcd_err etcd_build_lease(const char *field, int64_t v, char **body);
etcd_err etcd_build_auth(const char *user, const char *password, char **body);
/* One {"create_request":...} of a watch stream; NULL when out of memory. */
char *etcd_build_watch_create(const char *key, int prefix, int64_t start_revision);

/* ---- sending (etcd_send.c) ---- */

/* etcd_send flags: may be sent again after a lost answer; no token. */
enum { ETCD_CALL_IDEMPOTENT = 1, ETCD_CALL_NO_AUTH = 2 };

/* POST body to path on some endpoint before deadline, retrying what is
 * worth it; on ETCD_OK *ans holds the 200 answer (at most limit bytes).
 * flags: ETCD_CALL_*. */
etcd_err etcd_send_conn(etcd_conn *k, const char *path, const char *body, size_t limit, int flags,
                        int64_t deadline, etcd_buf *ans);
/* Logs in as k->user and keeps the token in k->token. */
etcd_err etcd_send_login(etcd_conn *k, int64_t deadline);

/* A TLS failure is final (retrying cannot fix a certificate). */
int etcd_is_tls_error(CURLcode cc, const char *detail);
/* What a gRPC status from the gateway means to a caller. */
etcd_err etcd_map_grpc(int code, const char *msg, int http);
/* The auth token expired or etcd restarted: log in again. */
int etcd_is_token_error(int code, const char *msg);

/* ---- the client (etcd_client.c) ---- */

struct etcd_client {
    etcd_conn k;
    int cfg_timeout_ms;
    int timeout_ms;
    char name[32]; /* for failpoints: etcd.<name>.<op> */
};

/* ---- a client's call (etcd_send.c) ---- */

/* The action of failpoint etcd.<client name>.<op> for this call:
 * "unavailable", "ambiguous", or NULL. */
const char *etcd_client_failpoint(const etcd_client *c, const char *op);
/* What a call hears when its failpoint fires: unsent, or answer dropped. */
etcd_err etcd_failpoint_unavailable(etcd_client *c, const char *path);
etcd_err etcd_failpoint_ambiguous(etcd_client *c, const char *path);
/* One call of the client: its failpoint (op names it), etcd's size limit,
 * the client's deadline, then etcd_send_conn. body is freed here. */
etcd_err etcd_send(etcd_client *c, const char *op, const char *path, char *body, size_t limit,
                   int flags, etcd_buf *ans);

#endif
