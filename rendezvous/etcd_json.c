/* etcd_json.c: parsing the etcd v3 gateway's JSON answers (see etcd_internal.h).
 *
 * The gateway leaves out every field that holds its zero value, writes 64-bit
 * integers as strings and bytes as base64. So every field here is optional
 * unless the protocol cannot work without it, a missing number reads as 0, and
 * an integer is parsed from its text with strtoll (a number is accepted too,
 * but only when a double holds it exactly). Anything of the wrong type is an
 * error, never a guess.
 */
#include "etcd_internal.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- base64 ---- */

static const char b64_alphabet[] =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

char *etcd_b64_encode(const void *data, size_t len)
{
    const unsigned char *p = data;
    size_t outlen = 4 * ((len + 2) / 3);
    char *out = malloc(outlen + 1);
    if (!out) return NULL;
    size_t o = 0;
    for (size_t i = 0; i < len; i += 3) {
        unsigned v = (unsigned)p[i] << 16;
        if (i + 1 < len) v |= (unsigned)p[i + 1] << 8;
        if (i + 2 < len) v |= p[i + 2];
        out[o++] = b64_alphabet[(v >> 18) & 63];
        out[o++] = b64_alphabet[(v >> 12) & 63];
        out[o++] = i + 1 < len ? b64_alphabet[(v >> 6) & 63] : '=';
        out[o++] = i + 2 < len ? b64_alphabet[v & 63] : '=';
    }
    out[o] = 0;
    return out;
}

static int b64_value(char ch)
{
    if (ch >= 'A' && ch <= 'Z') return ch - 'A';
    if (ch >= 'a' && ch <= 'z') return ch - 'a' + 26;
    if (ch >= '0' && ch <= '9') return ch - '0' + 52;
    if (ch == '+') return 62;
    if (ch == '/') return 63;
    return -1;
}

int etcd_b64_decode(const char *in, size_t inlen, char **out, size_t *outlen)
{
    if (inlen % 4 != 0) return -1;
    size_t pad = 0;
    if (inlen >= 1 && in[inlen - 1] == '=') pad++;
    if (inlen >= 2 && in[inlen - 2] == '=') pad++;
    size_t n = inlen / 4 * 3 - pad;
    char *buf = malloc(n + 1);
    if (!buf) return -1;
    size_t o = 0;
    for (size_t i = 0; i < inlen; i += 4) {
        int last = i + 4 == inlen;
        int v[4];
        for (int k = 0; k < 4; k++) {
            v[k] = b64_value(in[i + k]);
            /* '=' only as the final one or two characters */
            if (v[k] < 0 && !(last && in[i + k] == '=' && k >= 4 - (int)pad)) goto bad;
            if (v[k] < 0) v[k] = 0;
        }
        unsigned w = (unsigned)v[0] << 18 | (unsigned)v[1] << 12 | (unsigned)v[2] << 6 | v[3];
        buf[o++] = (char)(w >> 16);
        if (!(last && pad == 2)) buf[o++] = (char)(w >> 8);
        if (!(last && pad >= 1)) buf[o++] = (char)w;
        /* canonical form: the bits the padding drops are zero */
        if (last && ((pad == 2 && (v[1] & 15)) || (pad == 1 && (v[2] & 3)))) goto bad;
    }
    buf[o] = 0;
    *out = buf;
    *outlen = o;
    return 0;
bad:
    free(buf);
    return -1;
}

/* ---- field helpers ---- */

static cJSON *parse_object(const char *body, size_t len, char *err, size_t errlen)
{
    cJSON *root = cJSON_ParseWithLength(body, len);
    if (!root) {
        snprintf(err, errlen, "answer is not valid JSON (%zu bytes)", len);
        return NULL;
    }
    if (!cJSON_IsObject(root)) {
        snprintf(err, errlen, "answer is JSON but not an object");
        cJSON_Delete(root);
        return NULL;
    }
    return root;
}

/* An optional object member: NULL when absent; *bad set when present with
 * another type. */
static const cJSON *get_object(const cJSON *obj, const char *name, int *bad)
{
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (!m || cJSON_IsNull(m)) return NULL;
    if (!cJSON_IsObject(m)) {
        *bad = 1;
        return NULL;
    }
    return m;
}

static etcd_err get_int64(const cJSON *obj, const char *name, int64_t *out, char *err,
                          size_t errlen)
{
    *out = 0;
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (!m || cJSON_IsNull(m)) return ETCD_OK;
    if (cJSON_IsString(m)) {
        const char *s = m->valuestring;
        char *end;
        errno = 0;
        long long v = strtoll(s, &end, 10);
        if (end == s || *end || errno || (*s != '-' && (*s < '0' || *s > '9'))) {
            snprintf(err, errlen, "field \"%s\" is not a 64-bit integer", name);
            return ETCD_ERR_PROTOCOL;
        }
        *out = v;
        return ETCD_OK;
    }
    if (cJSON_IsNumber(m)) {
        double d = m->valuedouble;
        /* only integers a double holds exactly (|d| <= 2^53) */
        if (!(d >= -9007199254740992.0 && d <= 9007199254740992.0) || d != (double)(int64_t)d) {
            snprintf(err, errlen, "field \"%s\" is not an exact integer", name);
            return ETCD_ERR_PROTOCOL;
        }
        *out = (int64_t)d;
        return ETCD_OK;
    }
    snprintf(err, errlen, "field \"%s\" has the wrong type", name);
    return ETCD_ERR_PROTOCOL;
}

static etcd_err get_bool(const cJSON *obj, const char *name, int *out, char *err, size_t errlen)
{
    *out = 0;
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (!m || cJSON_IsNull(m)) return ETCD_OK;
    if (!cJSON_IsBool(m)) {
        snprintf(err, errlen, "field \"%s\" is not a boolean", name);
        return ETCD_ERR_PROTOCOL;
    }
    *out = cJSON_IsTrue(m) ? 1 : 0;
    return ETCD_OK;
}

/* Optional base64 bytes; absent means empty. */
static etcd_err get_bytes(const cJSON *obj, const char *name, char **out, size_t *outlen, char *err,
                          size_t errlen)
{
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(obj, name);
    const char *s = "";
    if (m && !cJSON_IsNull(m)) {
        if (!cJSON_IsString(m)) {
            snprintf(err, errlen, "field \"%s\" is not a string", name);
            return ETCD_ERR_PROTOCOL;
        }
        s = m->valuestring;
    }
    if (etcd_b64_decode(s, strlen(s), out, outlen) != 0) {
        snprintf(err, errlen, "field \"%s\" is not valid base64", name);
        return ETCD_ERR_PROTOCOL;
    }
    return ETCD_OK;
}

static etcd_err header_revision(const cJSON *root, int64_t *rev, char *err, size_t errlen)
{
    int bad = 0;
    const cJSON *h = get_object(root, "header", &bad);
    if (bad) {
        snprintf(err, errlen, "field \"header\" is not an object");
        return ETCD_ERR_PROTOCOL;
    }
    *rev = 0;
    if (!h) return ETCD_OK;
    return get_int64(h, "revision", rev, err, errlen);
}

/* ---- key-values ---- */

static etcd_err parse_kv(const cJSON *o, etcd_kv *kv, char *err, size_t errlen)
{
    memset(kv, 0, sizeof(*kv));
    if (!cJSON_IsObject(o)) {
        snprintf(err, errlen, "a key-value is not an object");
        return ETCD_ERR_PROTOCOL;
    }
    size_t keylen;
    etcd_err e = get_bytes(o, "key", &kv->key, &keylen, err, errlen);
    if (e == ETCD_OK) e = get_bytes(o, "value", &kv->value, &kv->value_len, err, errlen);
    if (e == ETCD_OK) e = get_int64(o, "create_revision", &kv->create_revision, err, errlen);
    if (e == ETCD_OK) e = get_int64(o, "mod_revision", &kv->mod_revision, err, errlen);
    if (e == ETCD_OK) e = get_int64(o, "version", &kv->version, err, errlen);
    if (e == ETCD_OK) e = get_int64(o, "lease", &kv->lease, err, errlen);
    if (e != ETCD_OK) etcd_kv_free(kv);
    return e;
}

void etcd_kv_free(etcd_kv *kv)
{
    if (!kv) return;
    free(kv->key);
    free(kv->value);
    memset(kv, 0, sizeof(*kv));
}

void etcd_range_result_free(etcd_range_result *r)
{
    if (!r) return;
    for (size_t i = 0; i < r->n; i++)
        etcd_kv_free(&r->kvs[i]);
    free(r->kvs);
    memset(r, 0, sizeof(*r));
}

static etcd_err range_from(const cJSON *o, etcd_range_result *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof(*out));
    etcd_err e = header_revision(o, &out->revision, err, errlen);
    if (e == ETCD_OK) e = get_int64(o, "count", &out->count, err, errlen);
    if (e == ETCD_OK) e = get_bool(o, "more", &out->more, err, errlen);
    if (e != ETCD_OK) return e;
    const cJSON *kvs = cJSON_GetObjectItemCaseSensitive(o, "kvs");
    if (!kvs || cJSON_IsNull(kvs)) return ETCD_OK;
    if (!cJSON_IsArray(kvs)) {
        snprintf(err, errlen, "field \"kvs\" is not an array");
        return ETCD_ERR_PROTOCOL;
    }
    int n = cJSON_GetArraySize(kvs);
    if (n == 0) return ETCD_OK;
    out->kvs = calloc((size_t)n, sizeof(etcd_kv));
    if (!out->kvs) return ETCD_ERR_NOMEM;
    const cJSON *it;
    cJSON_ArrayForEach(it, kvs)
    {
        e = parse_kv(it, &out->kvs[out->n], err, errlen);
        if (e != ETCD_OK) {
            etcd_range_result_free(out);
            return e;
        }
        out->n++;
    }
    return ETCD_OK;
}

/* ---- answers ---- */

int etcd_parse_error(const char *body, size_t len, int *code, char *msg, size_t msglen)
{
    cJSON *root = cJSON_ParseWithLength(body, len);
    if (!root) return 0;
    int found = 0;
    const cJSON *src = root;
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(root, "error");
    if (cJSON_IsObject(e)) src = e; /* stream error */
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(src, "code");
    if (!cJSON_IsNumber(c)) c = cJSON_GetObjectItemCaseSensitive(src, "grpc_code");
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(src, "message");
    /* an error is "error" (text or object), or at least a code and a message */
    if (!cJSON_IsObject(root) ||
        !(cJSON_IsObject(e) || cJSON_IsString(e) || (cJSON_IsNumber(c) && cJSON_IsString(m))))
        goto out;
    if (!cJSON_IsString(m) && cJSON_IsString(e)) m = e;
    *code = cJSON_IsNumber(c) && c->valuedouble >= 0 && c->valuedouble <= 1000 ? (int)c->valuedouble
                                                                               : -1;
    snprintf(msg, msglen, "%s", cJSON_IsString(m) ? m->valuestring : "(no message)");
    found = 1;
out:
    cJSON_Delete(root);
    return found;
}

etcd_err etcd_parse_header(const char *body, size_t len, int64_t *revision, int64_t *deleted,
                           char *err, size_t errlen)
{
    cJSON *root = parse_object(body, len, err, errlen);
    if (!root) return ETCD_ERR_PROTOCOL;
    int64_t rev, del;
    etcd_err e = header_revision(root, &rev, err, errlen);
    if (e == ETCD_OK) e = get_int64(root, "deleted", &del, err, errlen);
    cJSON_Delete(root);
    if (e != ETCD_OK) return e;
    if (revision) *revision = rev;
    if (deleted) *deleted = del;
    return ETCD_OK;
}

etcd_err etcd_parse_range(const char *body, size_t len, etcd_range_result *out, char *err,
                          size_t errlen)
{
    cJSON *root = parse_object(body, len, err, errlen);
    if (!root) return ETCD_ERR_PROTOCOL;
    etcd_err e = range_from(root, out, err, errlen);
    cJSON_Delete(root);
    return e;
}

void etcd_txn_result_free(etcd_txn_result *r)
{
    if (!r) return;
    if (r->ranges)
        for (size_t i = 0; i < r->n; i++)
            etcd_range_result_free(&r->ranges[i]);
    free(r->ranges);
    memset(r, 0, sizeof(*r));
}

etcd_err etcd_parse_txn(const char *body, size_t len, etcd_txn_result *out, char *err,
                        size_t errlen)
{
    memset(out, 0, sizeof(*out));
    cJSON *root = parse_object(body, len, err, errlen);
    if (!root) return ETCD_ERR_PROTOCOL;
    etcd_err e = header_revision(root, &out->revision, err, errlen);
    if (e == ETCD_OK) e = get_bool(root, "succeeded", &out->succeeded, err, errlen);
    if (e != ETCD_OK) goto out;
    const cJSON *resp = cJSON_GetObjectItemCaseSensitive(root, "responses");
    if (!resp || cJSON_IsNull(resp)) goto out;
    if (!cJSON_IsArray(resp)) {
        snprintf(err, errlen, "field \"responses\" is not an array");
        e = ETCD_ERR_PROTOCOL;
        goto out;
    }
    int n = cJSON_GetArraySize(resp);
    if (n == 0) goto out;
    out->ranges = calloc((size_t)n, sizeof(etcd_range_result));
    if (!out->ranges) {
        e = ETCD_ERR_NOMEM;
        goto out;
    }
    const cJSON *it;
    cJSON_ArrayForEach(it, resp)
    {
        int bad = 0;
        if (!cJSON_IsObject(it)) bad = 1;
        const cJSON *r = bad ? NULL : get_object(it, "response_range", &bad);
        if (!bad && !r) {
            /* a put or delete answer: only its shape is checked */
            get_object(it, "response_put", &bad);
            get_object(it, "response_delete_range", &bad);
        }
        if (bad) {
            snprintf(err, errlen, "a txn response is malformed");
            e = ETCD_ERR_PROTOCOL;
            goto out;
        }
        if (r) {
            e = range_from(r, &out->ranges[out->n], err, errlen);
            if (e != ETCD_OK) goto out;
        }
        out->n++;
    }
out:
    cJSON_Delete(root);
    if (e != ETCD_OK) etcd_txn_result_free(out);
    return e;
}

etcd_err etcd_parse_lease(const char *body, size_t len, int keepalive, int64_t *id, int64_t *ttl,
                          char *err, size_t errlen)
{
    cJSON *root = parse_object(body, len, err, errlen);
    if (!root) return ETCD_ERR_PROTOCOL;
    const cJSON *o = root;
    etcd_err e = ETCD_OK;
    if (keepalive) {
        int bad = 0;
        o = get_object(root, "result", &bad);
        if (!o) {
            snprintf(err, errlen, "keep-alive answer has no \"result\" object");
            e = ETCD_ERR_PROTOCOL;
        }
    }
    int64_t i = 0, t = 0;
    if (e == ETCD_OK) e = get_int64(o, "ID", &i, err, errlen);
    if (e == ETCD_OK) e = get_int64(o, "TTL", &t, err, errlen);
    if (e == ETCD_OK && !keepalive) {
        const cJSON *msg = cJSON_GetObjectItemCaseSensitive(o, "error");
        if (cJSON_IsString(msg) && msg->valuestring[0]) {
            snprintf(err, errlen, "lease grant: %s", msg->valuestring);
            e = ETCD_ERR_SERVER;
        } else if (i == 0) {
            snprintf(err, errlen, "lease grant answer has no lease ID");
            e = ETCD_ERR_PROTOCOL;
        }
    }
    cJSON_Delete(root);
    if (e != ETCD_OK) return e;
    *id = i;
    *ttl = t;
    return ETCD_OK;
}

etcd_err etcd_parse_token(const char *body, size_t len, char **token, char *err, size_t errlen)
{
    cJSON *root = parse_object(body, len, err, errlen);
    if (!root) return ETCD_ERR_PROTOCOL;
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(root, "token");
    etcd_err e = ETCD_OK;
    if (!cJSON_IsString(t) || !t->valuestring[0]) {
        snprintf(err, errlen, "authenticate answer has no token");
        e = ETCD_ERR_PROTOCOL;
    } else if (strpbrk(t->valuestring, "\r\n")) {
        snprintf(err, errlen, "authenticate answer has a token that is not one line");
        e = ETCD_ERR_PROTOCOL;
    } else if (!(*token = strdup(t->valuestring))) {
        e = ETCD_ERR_NOMEM;
    }
    cJSON_Delete(root);
    return e;
}

void etcd_events_free(etcd_event *events, size_t n)
{
    if (!events) return;
    for (size_t i = 0; i < n; i++)
        etcd_kv_free(&events[i].kv);
    free(events);
}

void etcd_watch_msg_free(etcd_watch_msg *m)
{
    etcd_events_free(m->events, m->n);
    m->events = NULL;
    m->n = 0;
}

static etcd_err parse_events(const cJSON *evs, etcd_watch_msg *m, char *err, size_t errlen)
{
    if (!evs || cJSON_IsNull(evs)) return ETCD_OK;
    if (!cJSON_IsArray(evs)) {
        snprintf(err, errlen, "field \"events\" is not an array");
        return ETCD_ERR_PROTOCOL;
    }
    int n = cJSON_GetArraySize(evs);
    if (n == 0) return ETCD_OK;
    m->events = calloc((size_t)n, sizeof(etcd_event));
    if (!m->events) return ETCD_ERR_NOMEM;
    const cJSON *it;
    cJSON_ArrayForEach(it, evs)
    {
        etcd_event *ev = &m->events[m->n];
        int bad = !cJSON_IsObject(it);
        const cJSON *kv = bad ? NULL : get_object(it, "kv", &bad);
        const cJSON *type = bad ? NULL : cJSON_GetObjectItemCaseSensitive(it, "type");
        if (!bad && !kv) bad = 1;
        if (!bad && type && !cJSON_IsNull(type)) {
            if (cJSON_IsString(type) && strcmp(type->valuestring, "PUT") == 0)
                ev->type = ETCD_EVENT_PUT;
            else if (cJSON_IsString(type) && strcmp(type->valuestring, "DELETE") == 0)
                ev->type = ETCD_EVENT_DELETE;
            else
                bad = 1;
        }
        if (bad) {
            snprintf(err, errlen, "a watch event is malformed");
            return ETCD_ERR_PROTOCOL;
        }
        etcd_err e = parse_kv(kv, &ev->kv, err, errlen);
        if (e != ETCD_OK) return e;
        m->n++;
        /* events arrive in revision order; anything else is a broken stream */
        if (m->n > 1 && ev->kv.mod_revision < m->events[m->n - 2].kv.mod_revision) {
            snprintf(err, errlen, "watch events out of revision order");
            return ETCD_ERR_PROTOCOL;
        }
    }
    return ETCD_OK;
}

etcd_err etcd_parse_watch_msg(const char *line, size_t len, etcd_watch_msg *out, char *err,
                              size_t errlen)
{
    memset(out, 0, sizeof(*out));
    cJSON *root = parse_object(line, len, err, errlen);
    if (!root) return ETCD_ERR_PROTOCOL;
    etcd_err e = ETCD_OK;
    int bad = 0;
    const cJSON *res = get_object(root, "result", &bad);
    if (!res) {
        int code;
        if (etcd_parse_error(line, len, &code, out->reason, sizeof(out->reason))) {
            out->error_code = code < 0 ? 2 : code;
        } else {
            snprintf(err, errlen, "watch message has no \"result\" object");
            e = ETCD_ERR_PROTOCOL;
        }
        goto out;
    }
    e = header_revision(res, &out->header_revision, err, errlen);
    if (e == ETCD_OK) e = get_bool(res, "created", &out->created, err, errlen);
    if (e == ETCD_OK) e = get_bool(res, "canceled", &out->canceled, err, errlen);
    if (e == ETCD_OK) e = get_int64(res, "compact_revision", &out->compact_revision, err, errlen);
    if (e == ETCD_OK) e = get_int64(res, "watch_id", &out->watch_id, err, errlen);
    if (e == ETCD_OK) {
        const cJSON *r = cJSON_GetObjectItemCaseSensitive(res, "cancel_reason");
        if (cJSON_IsString(r)) snprintf(out->reason, sizeof(out->reason), "%s", r->valuestring);
        e = parse_events(cJSON_GetObjectItemCaseSensitive(res, "events"), out, err, errlen);
    }
out:
    cJSON_Delete(root);
    if (e != ETCD_OK) etcd_watch_msg_free(out);
    return e;
}
