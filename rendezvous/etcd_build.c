/* etcd_build.c: every request body the client sends, checked and built.
 *
 * Each builder takes a call's arguments, refuses what etcd would refuse (an
 * empty key, a txn over 128 operations or 1.5 MiB of keys and values), so
 * that a bad call fails before anything is sent, and returns the JSON body
 * as the gateway reads it: keys and values in base64 (etcd_json.c's
 * encoder), 64-bit integers as strings, fields at their zero value left
 * out. Like the parsers, a builder writes a one-line reason into err when
 * it refuses; out of memory is ETCD_ERR_NOMEM without one.
 */
#include "etcd_internal.h"

#include <cjson/cJSON.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- fields ---- */

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

/* The body of req (deleted here; NULL when it could not be made). */
static etcd_err finish(cJSON *req, int ok, char **body)
{
    *body = ok && req ? cJSON_PrintUnformatted(req) : NULL;
    cJSON_Delete(req);
    return *body ? ETCD_OK : ETCD_ERR_NOMEM;
}

etcd_err etcd_check_key(const char *key, int prefix, char *err, size_t errlen)
{
    if (!key || (!*key && !prefix)) {
        snprintf(err, errlen, "empty etcd key");
        return ETCD_ERR_ARG;
    }
    return ETCD_OK;
}

/* ---- KV ---- */

etcd_err etcd_build_range(const char *key, int prefix, int64_t limit, char **body, char *err,
                          size_t errlen)
{
    etcd_err e = etcd_check_key(key, prefix, err, errlen);
    if (e != ETCD_OK) return e;
    if (limit < 0) {
        snprintf(err, errlen, "negative range limit");
        return ETCD_ERR_ARG;
    }
    cJSON *req = cJSON_CreateObject();
    int ok = req && add_key_range(req, key, prefix) && (!limit || add_int64(req, "limit", limit));
    return finish(req, ok, body);
}

etcd_err etcd_build_put(const char *key, const void *value, size_t len, int64_t lease, char **body,
                        char *err, size_t errlen)
{
    etcd_err e = etcd_check_key(key, 0, err, errlen);
    if (e != ETCD_OK) return e;
    if (len && !value) {
        snprintf(err, errlen, "put: NULL value with a length");
        return ETCD_ERR_ARG;
    }
    if (strlen(key) + len > ETCD_MAX_REQUEST_BYTES) {
        snprintf(err, errlen, "put: key and value of %zu bytes are over etcd's 1.5 MiB limit",
                 strlen(key) + len);
        return ETCD_ERR_TOO_LARGE;
    }
    cJSON *req = cJSON_CreateObject();
    int ok = req && add_b64(req, "key", key, strlen(key)) && add_b64(req, "value", value, len) &&
             (!lease || add_int64(req, "lease", lease));
    return finish(req, ok, body);
}

etcd_err etcd_build_delete(const char *key, int prefix, char **body, char *err, size_t errlen)
{
    etcd_err e = etcd_check_key(key, prefix, err, errlen);
    if (e != ETCD_OK) return e;
    cJSON *req = cJSON_CreateObject();
    int ok = req && add_key_range(req, key, prefix);
    return finish(req, ok, body);
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

/* count_only, keys_only, limit, sort and max_create_revision of a RANGE
 * op: the fields of etcd's RangeRequest, left out at their zero values. */
static int add_range_options(cJSON *r, const etcd_op *op)
{
    if (op->count_only && !cJSON_AddBoolToObject(r, "count_only", 1)) return 0;
    if (op->keys_only && !cJSON_AddBoolToObject(r, "keys_only", 1)) return 0;
    if (op->limit && !add_int64(r, "limit", op->limit)) return 0;
    if (op->sort != ETCD_SORT_KEY &&
        (!cJSON_AddStringToObject(r, "sort_order",
                                  op->sort == ETCD_SORT_CREATE_ASCEND ? "ASCEND" : "DESCEND") ||
         !cJSON_AddStringToObject(r, "sort_target", "CREATE")))
        return 0;
    if (op->max_create_revision && !add_int64(r, "max_create_revision", op->max_create_revision))
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
        if (!add_b64(r, "key", op->key, strlen(op->key)) ||
            !add_b64(r, "value", op->value, op->value_len) ||
            (op->lease && !add_int64(r, "lease", op->lease)))
            goto err_o;
    } else if (!add_key_range(r, op->key, op->prefix) ||
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

static etcd_err check_cmps(const etcd_cmp *cmps, size_t ncmp, size_t *bytes, char *err,
                           size_t errlen)
{
    if (ncmp && !cmps) {
        snprintf(err, errlen, "txn: NULL compare list with a count");
        return ETCD_ERR_ARG;
    }
    for (size_t i = 0; i < ncmp; i++) {
        etcd_err e = etcd_check_key(cmps[i].key, 0, err, errlen);
        if (e != ETCD_OK) return e;
        if ((unsigned)cmps[i].target > ETCD_CMP_LEASE ||
            (unsigned)cmps[i].op > ETCD_CMP_NOT_EQUAL ||
            (cmps[i].target == ETCD_CMP_VALUE && cmps[i].value_len && !cmps[i].value)) {
            snprintf(err, errlen, "txn: compare %zu is malformed", i);
            return ETCD_ERR_ARG;
        }
        *bytes += strlen(cmps[i].key) + (cmps[i].target == ETCD_CMP_VALUE ? cmps[i].value_len : 0);
    }
    return ETCD_OK;
}

static etcd_err check_ops(const etcd_op *ops, size_t n, size_t *bytes, int *writes, char *err,
                          size_t errlen)
{
    if (n && !ops) {
        snprintf(err, errlen, "txn: NULL operation list with a count");
        return ETCD_ERR_ARG;
    }
    for (size_t i = 0; i < n; i++) {
        const etcd_op *op = &ops[i];
        if ((unsigned)op->type > ETCD_OP_DELETE) {
            snprintf(err, errlen, "txn: operation %zu has an unknown type", i);
            return ETCD_ERR_ARG;
        }
        etcd_err e = etcd_check_key(op->key, op->type != ETCD_OP_PUT && op->prefix, err, errlen);
        if (e != ETCD_OK) return e;
        if (op->type == ETCD_OP_RANGE && (op->limit < 0 || op->max_create_revision < 0 ||
                                          (unsigned)op->sort > ETCD_SORT_CREATE_DESCEND)) {
            snprintf(err, errlen,
                     "txn: range %zu has a negative limit or revision, or an "
                     "unknown order",
                     i);
            return ETCD_ERR_ARG;
        }
        if (op->type == ETCD_OP_PUT && op->value_len && !op->value) {
            snprintf(err, errlen, "txn: put %zu has a NULL value with a length", i);
            return ETCD_ERR_ARG;
        }
        *bytes += strlen(op->key) + (op->type == ETCD_OP_PUT ? op->value_len : 0);
        *writes |= op->type != ETCD_OP_RANGE;
    }
    return ETCD_OK;
}

static etcd_err check_txn(const etcd_txn_req *t, int *writes, char *err, size_t errlen)
{
    if (t->ncmp + t->nthen + t->nels > ETCD_MAX_TXN_OPS) {
        snprintf(err, errlen, "txn: %zu compares and operations, etcd allows %d",
                 t->ncmp + t->nthen + t->nels, ETCD_MAX_TXN_OPS);
        return ETCD_ERR_TOO_LARGE;
    }
    size_t bytes = 0;
    *writes = 0;
    etcd_err e = check_cmps(t->cmps, t->ncmp, &bytes, err, errlen);
    if (e == ETCD_OK) e = check_ops(t->then, t->nthen, &bytes, writes, err, errlen);
    if (e == ETCD_OK) e = check_ops(t->els, t->nels, &bytes, writes, err, errlen);
    if (e != ETCD_OK) return e;
    if (bytes > ETCD_MAX_REQUEST_BYTES) {
        snprintf(err, errlen, "txn: %zu bytes of keys and values, over etcd's 1.5 MiB limit",
                 bytes);
        return ETCD_ERR_TOO_LARGE;
    }
    return ETCD_OK;
}

etcd_err etcd_build_txn(const etcd_txn_req *t, int *writes, char **body, char *err, size_t errlen)
{
    etcd_err e = check_txn(t, writes, err, errlen);
    if (e != ETCD_OK) return e;
    cJSON *req = cJSON_CreateObject();
    cJSON *cmp = cJSON_AddArrayToObject(req, "compare");
    cJSON *succ = cJSON_AddArrayToObject(req, "success");
    cJSON *fail = cJSON_AddArrayToObject(req, "failure");
    int ok = req && cmp && succ && fail;
    for (size_t i = 0; ok && i < t->ncmp; i++) {
        cJSON *o = build_cmp(&t->cmps[i]);
        ok = o && cJSON_AddItemToArray(cmp, o);
    }
    for (size_t i = 0; ok && i < t->nthen; i++) {
        cJSON *o = build_op(&t->then[i]);
        ok = o && cJSON_AddItemToArray(succ, o);
    }
    for (size_t i = 0; ok && i < t->nels; i++) {
        cJSON *o = build_op(&t->els[i]);
        ok = o && cJSON_AddItemToArray(fail, o);
    }
    return finish(req, ok, body);
}

/* ---- leases, auth, watch ---- */

etcd_err etcd_build_lease(const char *field, int64_t v, char **body)
{
    cJSON *req = cJSON_CreateObject();
    int ok = req && add_int64(req, field, v);
    return finish(req, ok, body);
}

etcd_err etcd_build_auth(const char *user, const char *password, char **body)
{
    cJSON *req = cJSON_CreateObject();
    int ok = req && cJSON_AddStringToObject(req, "name", user) &&
             cJSON_AddStringToObject(req, "password", password);
    return finish(req, ok, body);
}

char *etcd_build_watch_create(const char *key, int prefix, int64_t start_revision)
{
    cJSON *req = cJSON_CreateObject();
    cJSON *cr = cJSON_AddObjectToObject(req, "create_request");
    char *one;
    int ok = cr && add_key_range(cr, key, prefix) &&
             (!start_revision || add_int64(cr, "start_revision", start_revision));
    return finish(req, ok, &one) == ETCD_OK ? one : NULL;
}
