/* etcd_kv.c: the key-value, transaction and lease calls of the client.
 *
 * Each call checks its arguments (so a bad one fails before anything is
 * sent), builds its request, sends it through etcd_client_call() and parses
 * the answer with etcd_json.c. The one idea is the retry flag each passes:
 * reads and lease calls are idempotent and may be sent again after a lost
 * answer; a put, a delete or a txn that writes is not (etcd_conn.c).
 */
#include "etcd_internal.h"

#include <cjson/cJSON.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- KV ---- */

etcd_err etcd_range(etcd_client *c, const char *key, int prefix, int64_t limit,
                    etcd_range_result *out)
{
    memset(out, 0, sizeof(*out));
    etcd_err e = etcd_check_key(c, key, prefix);
    if (e != ETCD_OK) return e;
    if (limit < 0) {
        etcd_conn_seterr(&c->k, "negative range limit");
        return ETCD_ERR_ARG;
    }
    cJSON *req = cJSON_CreateObject();
    if (req && (!etcd_add_key_range(req, key, prefix) ||
                (limit && !etcd_add_int64(req, "limit", limit)))) {
        cJSON_Delete(req);
        return ETCD_ERR_NOMEM;
    }
    etcd_buf ans = {0};
    e = etcd_client_call(c, "range", "/v3/kv/range", req, ETCD_MAX_BIG_ANSWER, ETCD_CALL_IDEMPOTENT,
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
    etcd_err e = etcd_check_key(c, key, 0);
    if (e != ETCD_OK) return e;
    if (len && !value) {
        etcd_conn_seterr(&c->k, "put: NULL value with a length");
        return ETCD_ERR_ARG;
    }
    if (strlen(key) + len > ETCD_MAX_REQUEST_BYTES) {
        etcd_conn_seterr(&c->k, "put: key and value of %zu bytes are over etcd's 1.5 MiB limit",
                         strlen(key) + len);
        return ETCD_ERR_TOO_LARGE;
    }
    cJSON *req = cJSON_CreateObject();
    if (req &&
        (!etcd_add_b64(req, "key", key, strlen(key)) || !etcd_add_b64(req, "value", value, len) ||
         (lease && !etcd_add_int64(req, "lease", lease)))) {
        cJSON_Delete(req);
        return ETCD_ERR_NOMEM;
    }
    etcd_buf ans = {0};
    e = etcd_client_call(c, "put", "/v3/kv/put", req, ETCD_MAX_SMALL_ANSWER, 0, &ans);
    if (e == ETCD_OK)
        e = etcd_parse_header(ans.p, ans.len, revision, NULL, c->k.err, sizeof(c->k.err));
    etcd_buf_free(&ans);
    return e;
}

etcd_err etcd_delete(etcd_client *c, const char *key, int prefix, int64_t *deleted)
{
    etcd_err e = etcd_check_key(c, key, prefix);
    if (e != ETCD_OK) return e;
    cJSON *req = cJSON_CreateObject();
    if (req && !etcd_add_key_range(req, key, prefix)) {
        cJSON_Delete(req);
        return ETCD_ERR_NOMEM;
    }
    etcd_buf ans = {0};
    e = etcd_client_call(c, "delete", "/v3/kv/deleterange", req, ETCD_MAX_SMALL_ANSWER, 0, &ans);
    if (e == ETCD_OK)
        e = etcd_parse_header(ans.p, ans.len, NULL, deleted, c->k.err, sizeof(c->k.err));
    etcd_buf_free(&ans);
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
    int ok = etcd_add_b64(o, "key", m->key, strlen(m->key)) &&
             cJSON_AddStringToObject(o, "target", cmp_target_names[m->target]) &&
             cJSON_AddStringToObject(o, "result", cmp_op_names[m->op]);
    if (ok && m->target == ETCD_CMP_VALUE)
        ok = etcd_add_b64(o, "value", m->value, m->value_len);
    else if (ok)
        ok = etcd_add_int64(o, cmp_target_fields[m->target], m->number);
    if (!ok) {
        cJSON_Delete(o);
        return NULL;
    }
    return o;
}

/* count_only, keys_only, limit, sort and max_create_revision of a RANGE
 * op: the fields of etcd's RangeRequest, left out at their zero values. */
static int add_range_options(cJSON *r, const etcd_op *op)
{
    if (op->count_only && !cJSON_AddBoolToObject(r, "count_only", 1)) return 0;
    if (op->keys_only && !cJSON_AddBoolToObject(r, "keys_only", 1)) return 0;
    if (op->limit && !etcd_add_int64(r, "limit", op->limit)) return 0;
    if (op->sort != ETCD_SORT_KEY &&
        (!cJSON_AddStringToObject(r, "sort_order",
                                  op->sort == ETCD_SORT_CREATE_ASCEND ? "ASCEND" : "DESCEND") ||
         !cJSON_AddStringToObject(r, "sort_target", "CREATE")))
        return 0;
    if (op->max_create_revision &&
        !etcd_add_int64(r, "max_create_revision", op->max_create_revision))
        return 0;
    return 1;
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
        if (!etcd_add_b64(r, "key", op->key, strlen(op->key)) ||
            !etcd_add_b64(r, "value", op->value, op->value_len) ||
            (op->lease && !etcd_add_int64(r, "lease", op->lease)))
            goto err_o;
    } else if (!etcd_add_key_range(r, op->key, op->prefix) ||
               (op->type == ETCD_OP_RANGE && !add_range_options(r, op))) {
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
        etcd_conn_seterr(&c->k, "txn: NULL operation list with a count");
        return ETCD_ERR_ARG;
    }
    for (size_t i = 0; i < n; i++) {
        const etcd_op *op = &ops[i];
        if ((unsigned)op->type > ETCD_OP_DELETE) {
            etcd_conn_seterr(&c->k, "txn: operation %zu has an unknown type", i);
            return ETCD_ERR_ARG;
        }
        etcd_err e = etcd_check_key(c, op->key, op->type != ETCD_OP_PUT && op->prefix);
        if (e != ETCD_OK) return e;
        if (op->type == ETCD_OP_RANGE && (op->limit < 0 || op->max_create_revision < 0 ||
                                          (unsigned)op->sort > ETCD_SORT_CREATE_DESCEND)) {
            etcd_conn_seterr(&c->k,
                             "txn: range %zu has a negative limit or revision, or an "
                             "unknown order",
                             i);
            return ETCD_ERR_ARG;
        }
        if (op->type == ETCD_OP_PUT && op->value_len && !op->value) {
            etcd_conn_seterr(&c->k, "txn: put %zu has a NULL value with a length", i);
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
        etcd_conn_seterr(&c->k, "txn: %zu compares and operations, etcd allows %d",
                         ncmp + nthen + nels, ETCD_MAX_TXN_OPS);
        return ETCD_ERR_TOO_LARGE;
    }
    if (ncmp && !cmps) {
        etcd_conn_seterr(&c->k, "txn: NULL compare list with a count");
        return ETCD_ERR_ARG;
    }
    size_t bytes = 0;
    int writes = 0;
    for (size_t i = 0; i < ncmp; i++) {
        etcd_err e = etcd_check_key(c, cmps[i].key, 0);
        if (e != ETCD_OK) return e;
        if ((unsigned)cmps[i].target > ETCD_CMP_LEASE ||
            (unsigned)cmps[i].op > ETCD_CMP_NOT_EQUAL ||
            (cmps[i].target == ETCD_CMP_VALUE && cmps[i].value_len && !cmps[i].value)) {
            etcd_conn_seterr(&c->k, "txn: compare %zu is malformed", i);
            return ETCD_ERR_ARG;
        }
        bytes += strlen(cmps[i].key) + (cmps[i].target == ETCD_CMP_VALUE ? cmps[i].value_len : 0);
    }
    etcd_err e = check_ops(c, then, nthen, &bytes, &writes);
    if (e == ETCD_OK) e = check_ops(c, els, nels, &bytes, &writes);
    if (e != ETCD_OK) return e;
    if (bytes > ETCD_MAX_REQUEST_BYTES) {
        etcd_conn_seterr(&c->k, "txn: %zu bytes of keys and values, over etcd's 1.5 MiB limit",
                         bytes);
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
    etcd_buf ans = {0};
    e = etcd_client_call(c, "txn", "/v3/kv/txn", req, ETCD_MAX_BIG_ANSWER,
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
    cJSON *req = cJSON_CreateObject();
    if (req && !etcd_add_int64(req, field, v)) {
        cJSON_Delete(req);
        return ETCD_ERR_NOMEM;
    }
    return etcd_client_call(c, op, path, req, ETCD_MAX_SMALL_ANSWER, ETCD_CALL_IDEMPOTENT, ans);
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
