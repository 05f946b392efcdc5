/* etcd_internal.h: private to etcd.c and etcd_json.c (and their tests).
 *
 * The parsers take the raw bytes of an answer, so that the fuzz target and
 * the corpus replay drive exactly the code a real answer goes through. Each
 * fills its result only on ETCD_OK and frees what it made otherwise; on error
 * it writes a one-line reason into err.
 */
#ifndef DUCTILE_ETCD_INTERNAL_H
#define DUCTILE_ETCD_INTERNAL_H

#include "ductile/etcd.h"

#include <stddef.h>
#include <stdint.h>

/* Size limits: etcd takes requests up to 1.5 MiB and a txn of at most 128
 * operations; answers that can carry many values (range, txn, a watch
 * message) are capped at 64 MiB, the others at 1 MiB. */
#define ETCD_MAX_REQUEST_BYTES ((size_t)1536 * 1024)
#define ETCD_MAX_TXN_OPS 128
#define ETCD_MAX_BIG_ANSWER ((size_t)64 << 20)
#define ETCD_MAX_SMALL_ANSWER ((size_t)1 << 20)

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
    int error_code;   /* set when the message is an error (stream error or cancel) */
    char reason[200]; /* cancel_reason or the stream error's message */
    etcd_event *events;
    size_t n;
} etcd_watch_msg;

etcd_err etcd_parse_watch_msg(const char *line, size_t len, etcd_watch_msg *out, char *err,
                              size_t errlen);
void etcd_watch_msg_free(etcd_watch_msg *m);

#endif
