/* etcd_kv.c: the key-value, transaction and lease calls of the client.
 *
 * Each call goes down three steps and never back: build its request
 * (etcd_build.c, which also refuses bad arguments before anything is sent),
 * send it (etcd_send.c), parse the answer (etcd_json.c). The one idea is the
 * retry flag each passes: reads and lease calls are idempotent and may be
 * sent again after a lost answer; a put, a delete or a txn that writes is
 * not (etcd_send.c).
 */
#include "etcd_internal.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- KV ---- */

etcd_err etcd_range(etcd_client *c, const char *key, int prefix, int64_t limit,
                    etcd_range_result *out)
{
    memset(out, 0, sizeof(*out));
    char *body;
    etcd_err e = etcd_build_range(key, prefix, limit, &body, c->k.err, sizeof(c->k.err));
    if (e != ETCD_OK) return e;
    etcd_buf ans = {0};
    e = etcd_send(c, "range", "/v3/kv/range", body, ETCD_MAX_BIG_ANSWER, ETCD_CALL_IDEMPOTENT,
                  &ans);
    if (e == ETCD_OK) e = etcd_parse_range(ans.p, ans.len, out, c->k.err, sizeof(c->k.err));
    etcd_buf_free(&ans);
    return e;
}

etcd_err etcd_get(etcd_client *c, const char *key, etcd_kv *out)
{
    memset(out, 0, sizeof(*out));
    etcd_range_result r;
    etcd_err e = etcd_range(c, key, 0, 0, &r);
    if (e != ETCD_OK) return e;
    if (r.n == 0) {
        etcd_conn_seterr(&c->k, "key \"%s\" not found", key);
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
    char *body;
    etcd_err e = etcd_build_put(key, value, len, lease, &body, c->k.err, sizeof(c->k.err));
    if (e != ETCD_OK) return e;
    etcd_buf ans = {0};
    e = etcd_send(c, "put", "/v3/kv/put", body, ETCD_MAX_SMALL_ANSWER, 0, &ans);
    if (e == ETCD_OK)
        e = etcd_parse_header(ans.p, ans.len, revision, NULL, c->k.err, sizeof(c->k.err));
    etcd_buf_free(&ans);
    return e;
}

etcd_err etcd_delete(etcd_client *c, const char *key, int prefix, int64_t *deleted)
{
    char *body;
    etcd_err e = etcd_build_delete(key, prefix, &body, c->k.err, sizeof(c->k.err));
    if (e != ETCD_OK) return e;
    etcd_buf ans = {0};
    e = etcd_send(c, "delete", "/v3/kv/deleterange", body, ETCD_MAX_SMALL_ANSWER, 0, &ans);
    if (e == ETCD_OK)
        e = etcd_parse_header(ans.p, ans.len, NULL, deleted, c->k.err, sizeof(c->k.err));
    etcd_buf_free(&ans);
    return e;
}

/* ---- txn ---- */

etcd_err etcd_txn(etcd_client *c, const etcd_cmp *cmps, size_t ncmp, const etcd_op *then,
                  size_t nthen, const etcd_op *els, size_t nels, etcd_txn_result *out)
{
    if (out) memset(out, 0, sizeof(*out));
    c->k.err[0] = 0;
    const etcd_txn_req t = {cmps, ncmp, then, nthen, els, nels};
    char *body;
    int writes;
    etcd_err e = etcd_build_txn(&t, &writes, &body, c->k.err, sizeof(c->k.err));
    if (e != ETCD_OK) return e;
    etcd_buf ans = {0};
    e = etcd_send(c, "txn", "/v3/kv/txn", body, ETCD_MAX_BIG_ANSWER,
                  writes ? 0 : ETCD_CALL_IDEMPOTENT, &ans);
    etcd_txn_result r;
    if (e == ETCD_OK) e = etcd_parse_txn(ans.p, ans.len, &r, c->k.err, sizeof(c->k.err));
    etcd_buf_free(&ans);
    if (e != ETCD_OK) return e;
    size_t ran = r.succeeded ? nthen : nels;
    if (r.n != ran) {
        etcd_conn_seterr(&c->k, "txn: %zu answers for %zu operations", r.n, ran);
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
                           int64_t v, etcd_buf *ans)
{
    char *body;
    etcd_err e = etcd_build_lease(field, v, &body);
    if (e != ETCD_OK) return e;
    return etcd_send(c, op, path, body, ETCD_MAX_SMALL_ANSWER, ETCD_CALL_IDEMPOTENT, ans);
}

etcd_err etcd_lease_grant(etcd_client *c, int64_t ttl_s, int64_t *id)
{
    c->k.err[0] = 0;
    if (ttl_s <= 0 || !id) {
        etcd_conn_seterr(&c->k, "lease grant: TTL must be positive");
        return ETCD_ERR_ARG;
    }
    /* sent again after a lost answer, a grant leaves at worst an unused
     * lease that expires by itself */
    etcd_buf ans = {0};
    etcd_err e = lease_call(c, "lease_grant", "/v3/lease/grant", "TTL", ttl_s, &ans);
    int64_t ttl;
    if (e == ETCD_OK) e = etcd_parse_lease(ans.p, ans.len, 0, id, &ttl, c->k.err, sizeof(c->k.err));
    etcd_buf_free(&ans);
    return e;
}

etcd_err etcd_lease_keepalive(etcd_client *c, int64_t id, int64_t *ttl_left)
{
    etcd_buf ans = {0};
    etcd_err e = lease_call(c, "keepalive", "/v3/lease/keepalive", "ID", id, &ans);
    int64_t rid, ttl = 0;
    if (e == ETCD_OK)
        e = etcd_parse_lease(ans.p, ans.len, 1, &rid, &ttl, c->k.err, sizeof(c->k.err));
    etcd_buf_free(&ans);
    if (e == ETCD_OK && ttl <= 0) {
        etcd_conn_seterr(&c->k, "lease %" PRId64 " not found (expired or revoked)", id);
        e = ETCD_ERR_NOT_FOUND;
    }
    if (e == ETCD_OK && ttl_left) *ttl_left = ttl;
    return e;
}

etcd_err etcd_lease_revoke(etcd_client *c, int64_t id)
{
    etcd_buf ans = {0};
    etcd_err e = lease_call(c, "lease_revoke", "/v3/lease/revoke", "ID", id, &ans);
    if (e == ETCD_OK) e = etcd_parse_header(ans.p, ans.len, NULL, NULL, c->k.err, sizeof(c->k.err));
    etcd_buf_free(&ans);
    return e;
}
