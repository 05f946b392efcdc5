/* store.c: the round store, /ductile/<job>/rounds/<N>/store/<key>.
 *
 * Trainers of round N meet here (NCCL unique id, ring addresses, barriers).
 * The idea that keeps rounds apart is fencing: every write is a txn that
 * also compares the job's `epoch` key with N, so once round N+1 is opened
 * (which writes epoch N+1 in the same txn as the round record) no write of
 * round N can land. Reads need no fence: round N's keys only ever hold what
 * round N wrote. Waiting is a watch on the one key, never a polling loop,
 * and a second watch on `epoch` on the same stream: once a later round is
 * opened the key can never appear, so the wait ends at once with
 * RDZV_ERR_FENCED.
 */
#include "rdzv_internal.h"

#include "ductile/clock.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct rdzv_store {
    etcd_client *c;
    rdzv_etcd etcd;
    char job[64];
    int64_t round;
    char epoch_key[RDZV_KEY_MAX];
    char epoch_val[32];
    char last_error[RDZV_MSG_MAX];
};

static rdzv_err fail(rdzv_store *s, rdzv_err err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static rdzv_err fail(rdzv_store *s, rdzv_err err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->last_error, sizeof(s->last_error), fmt, ap);
    va_end(ap);
    return err;
}

static rdzv_err etcd_fail(rdzv_store *s, etcd_err e, const char *what)
{
    return fail(s, e == ETCD_ERR_TIMEOUT ? RDZV_ERR_TIMEOUT : RDZV_ERR_ETCD, "%s: %s (%s)", what,
                etcd_strerror(e), etcd_last_error(s->c));
}

static rdzv_err watch_fail(rdzv_store *s, etcd_err e, const char *what, const etcd_watch *w)
{
    return fail(s, e == ETCD_ERR_TIMEOUT ? RDZV_ERR_TIMEOUT : RDZV_ERR_ETCD, "%s: %s (%s)", what,
                etcd_strerror(e), etcd_watch_last_error(w));
}

static int store_key(rdzv_store *s, char *buf, size_t len, const char *key)
{
    if (!key || !*key) return -1;
    return rdzv_key(buf, len, s->job, "rounds/%lld/store/%s", (long long)s->round, key);
}

rdzv_err rdzv_store_open(const rdzv_etcd *etcd, const char *job, int64_t round, rdzv_store **out)
{
    if (!etcd || !out || !rdzv_job_id_valid(job) || round < 1) return RDZV_ERR_ARG;
    *out = NULL;
    rdzv_store *s = calloc(1, sizeof(*s));
    if (!s) return RDZV_ERR_NOMEM;
    s->etcd = *etcd;
    snprintf(s->job, sizeof(s->job), "%s", job);
    s->round = round;
    rdzv_key(s->epoch_key, sizeof(s->epoch_key), job, "epoch");
    snprintf(s->epoch_val, sizeof(s->epoch_val), "%lld", (long long)round);
    rdzv_err err = rdzv_etcd_connect(etcd, &s->c, NULL);
    if (err != RDZV_OK) {
        free(s);
        return err;
    }
    etcd_client_set_name(s->c, "store");
    *out = s;
    return RDZV_OK;
}

void rdzv_store_close(rdzv_store *s)
{
    if (!s) return;
    etcd_client_free(s->c);
    free(s);
}

const char *rdzv_store_last_error(const rdzv_store *s)
{
    return s ? s->last_error : "";
}

/* Called when a fenced txn failed: tells which round is current now. */
static rdzv_err fenced(rdzv_store *s, const etcd_txn_result *res, size_t epoch_op)
{
    const char *now = "none";
    if (res && res->n > epoch_op && res->ranges[epoch_op].n > 0)
        now = res->ranges[epoch_op].kvs[0].value;
    return fail(s, RDZV_ERR_FENCED, "round %lld is no longer current (epoch is %s)",
                (long long)s->round, now);
}

rdzv_err rdzv_store_set(rdzv_store *s, const char *key, const void *value, size_t len)
{
    if (!s || (!value && len)) return RDZV_ERR_ARG;
    char k[RDZV_KEY_MAX];
    if (store_key(s, k, sizeof(k), key) != 0) return fail(s, RDZV_ERR_ARG, "bad store key");
    etcd_cmp cmp = {.key = s->epoch_key,
                    .target = ETCD_CMP_VALUE,
                    .op = ETCD_CMP_EQUAL,
                    .value = s->epoch_val,
                    .value_len = strlen(s->epoch_val)};
    etcd_op put = {.type = ETCD_OP_PUT, .key = k, .value = value ? value : "", .value_len = len};
    etcd_op els = {.type = ETCD_OP_RANGE, .key = s->epoch_key};
    etcd_txn_result res;
    etcd_err e = etcd_txn(s->c, &cmp, 1, &put, 1, &els, 1, &res);
    if (e != ETCD_OK) return etcd_fail(s, e, "store set");
    rdzv_err err = res.succeeded ? RDZV_OK : fenced(s, &res, 0);
    etcd_txn_result_free(&res);
    return err;
}

static rdzv_err take_value(const etcd_kv *kv, void **value, size_t *len)
{
    char *v = malloc(kv->value_len + 1);
    if (!v) return RDZV_ERR_NOMEM;
    memcpy(v, kv->value, kv->value_len);
    v[kv->value_len] = '\0';
    *value = v;
    if (len) *len = kv->value_len;
    return RDZV_OK;
}

rdzv_err rdzv_store_get(rdzv_store *s, const char *key, void **value, size_t *len)
{
    if (!s || !value) return RDZV_ERR_ARG;
    char k[RDZV_KEY_MAX];
    if (store_key(s, k, sizeof(k), key) != 0) return fail(s, RDZV_ERR_ARG, "bad store key");
    etcd_kv kv;
    etcd_err e = etcd_get(s->c, k, &kv);
    if (e == ETCD_ERR_NOT_FOUND) return fail(s, RDZV_ERR_NOT_FOUND, "no key %s", key);
    if (e != ETCD_OK) return etcd_fail(s, e, "store get");
    rdzv_err err = take_value(&kv, value, len);
    etcd_kv_free(&kv);
    return err;
}

static int parse_counter(const etcd_kv *kv, int64_t *out)
{
    char *end = NULL;
    errno = 0;
    long long v = strtoll(kv->value, &end, 10);
    if (errno || end == kv->value || *end) return -1;
    *out = v;
    return 0;
}

/* 1 when the job's epoch (NULL: no such key) says round s->round is over:
 * a later round was opened, or there is no round number at all. No write of
 * the round can land then (every one compares the epoch with it), so a key
 * that is missing never appears. An epoch below the round, one not opened
 * yet, is worth waiting for. */
static int superseded(const rdzv_store *s, const etcd_kv *epoch)
{
    int64_t n;
    return !epoch || parse_counter(epoch, &n) != 0 || n > s->round;
}

rdzv_err rdzv_store_wait(rdzv_store *s, const char *key, int timeout_ms, void **value, size_t *len)
{
    if (!s || !value || timeout_ms < 0) return RDZV_ERR_ARG;
    char k[RDZV_KEY_MAX];
    if (store_key(s, k, sizeof(k), key) != 0) return fail(s, RDZV_ERR_ARG, "bad store key");
    int64_t deadline = mono_now_ms() + timeout_ms;
    /* the key and the epoch at one revision, and both watched from the next:
     * nothing is missed between the read and the watches */
    etcd_op reads[2] = {{.type = ETCD_OP_RANGE, .key = k},
                        {.type = ETCD_OP_RANGE, .key = s->epoch_key}};
    etcd_txn_result res;
    etcd_err e = etcd_txn(s->c, NULL, 0, reads, 2, NULL, 0, &res);
    if (e != ETCD_OK) return etcd_fail(s, e, "store wait");
    int done = 1;
    rdzv_err err;
    if (res.ranges[0].n > 0)
        err = take_value(&res.ranges[0].kvs[0], value, len);
    else if (superseded(s, res.ranges[1].n > 0 ? &res.ranges[1].kvs[0] : NULL))
        err = fenced(s, &res, 1);
    else
        done = 0;
    int64_t from = res.revision + 1;
    etcd_txn_result_free(&res);
    if (done) return err;

    /* The key and the epoch on one stream: two one-key watches, where a
     * single watch over a range holding both keys would carry every key
     * of the job that sorts between them. */
    etcd_watch_key keys[2] = {{.key = k, .start_revision = from},
                              {.key = s->epoch_key, .start_revision = from}};
    etcd_watch *w = NULL;
    e = etcd_watch_open_set(s->c, keys, 2, &w);
    if (e != ETCD_OK) return etcd_fail(s, e, "store wait: watch");
    err = RDZV_ERR_TIMEOUT;
    const char *epoch = NULL; /* the epoch that superseded the round, once seen */
    char epoch_val[32];
    for (;;) {
        int64_t left = deadline - mono_now_ms();
        if (left <= 0) break;
        etcd_event *evs = NULL;
        size_t n = 0;
        e = etcd_watch_next(w, (int)left, &evs, &n);
        if (e != ETCD_OK) {
            err = watch_fail(s, e, "store wait: watch", w);
            break;
        }
        for (size_t i = 0; i < n && err == RDZV_ERR_TIMEOUT && !epoch; i++) {
            const etcd_kv *kv = evs[i].type == ETCD_EVENT_PUT ? &evs[i].kv : NULL;
            if (evs[i].watch == 0) {
                if (kv) err = take_value(kv, value, len);
            } else if (superseded(s, kv)) {
                snprintf(epoch_val, sizeof(epoch_val), "%s", kv ? kv->value : "none");
                epoch = epoch_val;
            }
        }
        etcd_events_free(evs, n);
        if (err != RDZV_ERR_TIMEOUT) break;
        if (epoch) {
            err = fail(s, RDZV_ERR_FENCED,
                       "round %lld ended while waiting for %s: no longer current (epoch is %s)",
                       (long long)s->round, key, epoch);
            break;
        }
    }
    etcd_watch_close(w);
    if (err == RDZV_ERR_TIMEOUT)
        fail(s, err, "key %s did not appear within %d ms", key, timeout_ms);
    return err;
}

rdzv_err rdzv_store_add(rdzv_store *s, const char *key, int64_t delta, int64_t *value)
{
    if (!s) return RDZV_ERR_ARG;
    char k[RDZV_KEY_MAX];
    if (store_key(s, k, sizeof(k), key) != 0) return fail(s, RDZV_ERR_ARG, "bad store key");
    int timeout = s->etcd.timeout_ms ? s->etcd.timeout_ms : 5000;
    int64_t deadline = mono_now_ms() + timeout;
    /* Compare-and-swap on the counter's mod_revision (0: absent). The
     * failure branch reads the epoch and the counter back, so a retry costs
     * one round trip, not two. */
    int64_t cur = 0, mod = 0;
    for (;;) {
        char num[32];
        snprintf(num, sizeof(num), "%" PRId64, cur + delta);
        etcd_cmp cmps[2] = {
            {.key = s->epoch_key,
             .target = ETCD_CMP_VALUE,
             .op = ETCD_CMP_EQUAL,
             .value = s->epoch_val,
             .value_len = strlen(s->epoch_val)},
            {.key = k, .target = ETCD_CMP_MOD, .op = ETCD_CMP_EQUAL, .number = mod},
        };
        etcd_op put = {.type = ETCD_OP_PUT, .key = k, .value = num, .value_len = strlen(num)};
        etcd_op els[2] = {{.type = ETCD_OP_RANGE, .key = s->epoch_key},
                          {.type = ETCD_OP_RANGE, .key = k}};
        etcd_txn_result res;
        etcd_err e = etcd_txn(s->c, cmps, 2, &put, 1, els, 2, &res);
        if (e != ETCD_OK) return etcd_fail(s, e, "store add");
        if (res.succeeded) {
            etcd_txn_result_free(&res);
            if (value) *value = cur + delta;
            return RDZV_OK;
        }
        rdzv_err err = RDZV_OK;
        if (res.n < 2 || res.ranges[0].n == 0 ||
            res.ranges[0].kvs[0].value_len != strlen(s->epoch_val) ||
            memcmp(res.ranges[0].kvs[0].value, s->epoch_val, strlen(s->epoch_val)) != 0) {
            err = fenced(s, &res, 0);
        } else if (res.ranges[1].n == 0) {
            cur = 0;
            mod = 0;
        } else if (parse_counter(&res.ranges[1].kvs[0], &cur) != 0) {
            err = fail(s, RDZV_ERR_PROTOCOL, "store key %s is not a decimal counter", key);
        } else {
            mod = res.ranges[1].kvs[0].mod_revision;
        }
        etcd_txn_result_free(&res);
        if (err != RDZV_OK) return err;
        if (mono_now_ms() > deadline)
            return fail(s, RDZV_ERR_TIMEOUT, "store add on %s: too much contention", key);
    }
}

rdzv_err rdzv_store_barrier(rdzv_store *s, const char *name, int count, int timeout_ms)
{
    if (!s || !name || !*name || count < 1 || timeout_ms < 0) return RDZV_ERR_ARG;
    /* One counter and one "open" key per barrier name: the participant that
     * brings the counter to `count` writes the open key, the others wait for
     * it. A name is good for one use per round. */
    char counter[RDZV_KEY_MAX], open[RDZV_KEY_MAX];
    if (snprintf(counter, sizeof(counter), "barrier/%s/count", name) >= (int)sizeof(counter) ||
        snprintf(open, sizeof(open), "barrier/%s/open", name) >= (int)sizeof(open))
        return fail(s, RDZV_ERR_ARG, "barrier name too long");
    int64_t deadline = mono_now_ms() + timeout_ms;
    int64_t n = 0;
    rdzv_err err = rdzv_store_add(s, counter, 1, &n);
    if (err != RDZV_OK) return err;
    if (n == count) return rdzv_store_set(s, open, "1", 1);
    int64_t left = deadline - mono_now_ms();
    void *v = NULL;
    size_t len = 0;
    err = rdzv_store_wait(s, open, left > 0 ? (int)left : 0, &v, &len);
    free(v);
    if (err == RDZV_ERR_TIMEOUT)
        fail(s, err, "barrier %s: %lld of %d arrived within %d ms", name, (long long)n, count,
             timeout_ms);
    return err;
}

rdzv_err rdzv_store_check(rdzv_store *s)
{
    if (!s) return RDZV_ERR_ARG;
    etcd_kv kv;
    etcd_err e = etcd_get(s->c, s->epoch_key, &kv);
    if (e == ETCD_ERR_NOT_FOUND)
        return fail(s, RDZV_ERR_FENCED, "job %s has no current round", s->job);
    if (e != ETCD_OK) return etcd_fail(s, e, "store check");
    int same =
        kv.value_len == strlen(s->epoch_val) && memcmp(kv.value, s->epoch_val, kv.value_len) == 0;
    rdzv_err err = RDZV_OK;
    if (!same)
        err = fail(s, RDZV_ERR_FENCED, "round %lld is no longer current (epoch is %s)",
                   (long long)s->round, kv.value);
    etcd_kv_free(&kv);
    return err;
}
