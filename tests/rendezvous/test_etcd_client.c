/* test_etcd_client.c: every etcd client operation against a real etcd.
 *
 * One private etcd for the whole program; each test uses its own key prefix
 * so the tests do not see each other's keys.
 */
#include "ductile/etcd.h"
#include "test_etcd.h"
#include "test_etcd_util.h"

#include <pthread.h>
#include <unistd.h>

static test_etcd srv;

static void test_put_get_range_delete(etcd_client *c)
{
    int64_t r1, r2, r3;
    CHECK_OK(c, etcd_put(c, "/t/kv/a", "1", 1, 0, &r1));
    CHECK_OK(c, etcd_put(c, "/t/kv/b", "22", 2, 0, &r2));
    /* a value with every byte value, NUL included, survives base64 */
    char bin[256];
    for (int i = 0; i < 256; i++)
        bin[i] = (char)i;
    CHECK_OK(c, etcd_put(c, "/t/kv/c", bin, sizeof(bin), 0, &r3));
    CHECK_OR_EXIT(r1 > 0 && r2 == r1 + 1 && r3 == r2 + 1);
    CHECK_OK(c, etcd_put(c, "/t/kv0", "x", 1, 0, NULL)); /* past the prefix's end */

    etcd_kv kv;
    CHECK_OK(c, etcd_get(c, "/t/kv/b", &kv));
    CHECK_OR_EXIT(strcmp(kv.key, "/t/kv/b") == 0 && kv.value_len == 2 &&
                  strcmp(kv.value, "22") == 0);
    CHECK_OR_EXIT(kv.create_revision == r2 && kv.mod_revision == r2 && kv.version == 1 &&
                  kv.lease == 0);
    etcd_kv_free(&kv);
    CHECK_OK(c, etcd_get(c, "/t/kv/c", &kv));
    CHECK_OR_EXIT(kv.value_len == 256 && memcmp(kv.value, bin, 256) == 0);
    etcd_kv_free(&kv);
    CHECK_ERR(c, ETCD_ERR_NOT_FOUND, etcd_get(c, "/t/kv/zz", &kv));
    CHECK_OR_EXIT(kv.key == NULL);

    etcd_range_result r;
    CHECK_OK(c, etcd_range(c, "/t/kv/", 1, 0, &r));
    CHECK_OR_EXIT(r.n == 3 && r.count == 3 && !r.more && r.revision >= r3 + 1);
    CHECK_OR_EXIT(strcmp(r.kvs[0].key, "/t/kv/a") == 0 && strcmp(r.kvs[2].key, "/t/kv/c") == 0);
    etcd_range_result_free(&r);
    CHECK_OK(c, etcd_range(c, "/t/kv/", 1, 2, &r));
    CHECK_OR_EXIT(r.n == 2 && r.count == 3 && r.more);
    etcd_range_result_free(&r);
    CHECK_OK(c, etcd_range(c, "/t/nothing/", 1, 0, &r));
    CHECK_OR_EXIT(r.n == 0 && r.count == 0 && r.kvs == NULL && r.revision > 0);
    etcd_range_result_free(&r);
    /* an empty prefix is the whole key space */
    CHECK_OK(c, etcd_range(c, "", 1, 0, &r));
    CHECK_OR_EXIT(r.n >= 4);
    etcd_range_result_free(&r);

    /* overwrite bumps version and mod_revision, keeps create_revision */
    int64_t r4;
    CHECK_OK(c, etcd_put(c, "/t/kv/a", "", 0, 0, &r4));
    CHECK_OK(c, etcd_get(c, "/t/kv/a", &kv));
    CHECK_OR_EXIT(kv.value_len == 0 && kv.value && kv.value[0] == 0 && kv.version == 2);
    CHECK_OR_EXIT(kv.create_revision == r1 && kv.mod_revision == r4);
    etcd_kv_free(&kv);

    int64_t deleted = -1;
    CHECK_OK(c, etcd_delete(c, "/t/kv/a", 0, &deleted));
    CHECK_OR_EXIT(deleted == 1);
    CHECK_OK(c, etcd_delete(c, "/t/kv/a", 0, &deleted));
    CHECK_OR_EXIT(deleted == 0);
    CHECK_OK(c, etcd_delete(c, "/t/kv/", 1, &deleted));
    CHECK_OR_EXIT(deleted == 2);
    CHECK_OK(c, etcd_get(c, "/t/kv0", &kv)); /* outside the prefix: kept */
    etcd_kv_free(&kv);

    CHECK_ERR(c, ETCD_ERR_ARG, etcd_put(c, "", "x", 1, 0, NULL));
    CHECK_ERR(c, ETCD_ERR_ARG, etcd_range(c, "", 0, 0, &r));
}

static void test_prefix_end_ff(etcd_client *c)
{
    /* the prefix "\xff" ends at the end of the key space; "a\xff" ends at "b" */
    CHECK_OK(c, etcd_put(c, "/t/ff/a\xff\x01", "1", 1, 0, NULL));
    CHECK_OK(c, etcd_put(c, "/t/ff/b", "2", 1, 0, NULL));
    etcd_range_result r;
    CHECK_OK(c, etcd_range(c, "/t/ff/a\xff", 1, 0, &r));
    CHECK_OR_EXIT(r.n == 1 && strcmp(r.kvs[0].key, "/t/ff/a\xff\x01") == 0);
    etcd_range_result_free(&r);
}

static void test_large_values(etcd_client *c)
{
    /* 1 MiB travels (1.33 MiB of base64); just under etcd's 1.5 MiB with its
     * overhead is refused by etcd itself, and that verdict is not retried */
    size_t len = (size_t)1 << 20;
    char *v = malloc(len);
    CHECK_OR_EXIT(v);
    for (size_t i = 0; i < len; i++)
        v[i] = (char)(i * 7);
    CHECK_OK(c, etcd_put(c, "/t/big", v, len, 0, NULL));
    etcd_kv kv;
    CHECK_OK(c, etcd_get(c, "/t/big", &kv));
    CHECK_OR_EXIT(kv.value_len == len && memcmp(kv.value, v, len) == 0);
    etcd_kv_free(&kv);
    char *w = calloc(1, (size_t)1536 * 1024);
    CHECK_OR_EXIT(w);
    CHECK_ERR(c, ETCD_ERR_TOO_LARGE, etcd_put(c, "/t/big", w, (size_t)1536 * 1024 - 10, 0, NULL));
    CHECK_OR_EXIT(strstr(etcd_last_error(c), "too large"));
    free(w);
    free(v);
    CHECK_OK(c, etcd_delete(c, "/t/big", 0, NULL));
}

static void test_txn(etcd_client *c)
{
    int64_t rev;
    CHECK_OK(c, etcd_put(c, "/t/txn/k", "v1", 2, 0, &rev));
    etcd_cmp cmp = {.key = "/t/txn/k", .target = ETCD_CMP_MOD, .op = ETCD_CMP_EQUAL, .number = rev};
    etcd_op then[] = {
        {.type = ETCD_OP_PUT, .key = "/t/txn/k", .value = "v2", .value_len = 2},
        {.type = ETCD_OP_RANGE, .key = "/t/txn/", .prefix = 1},
        {.type = ETCD_OP_PUT, .key = "/t/txn/other", .value = "o", .value_len = 1},
    };
    etcd_op els[] = {{.type = ETCD_OP_RANGE, .key = "/t/txn/k"}};
    etcd_txn_result t;
    CHECK_OK(c, etcd_txn(c, &cmp, 1, then, 3, els, 1, &t));
    CHECK_OR_EXIT(t.succeeded && t.n == 3 && t.revision == rev + 1);
    CHECK_OR_EXIT(t.ranges[0].n == 0 && t.ranges[2].n == 0);
    CHECK_OR_EXIT(t.ranges[1].n == 1 && strcmp(t.ranges[1].kvs[0].value, "v2") == 0);
    etcd_txn_result_free(&t);

    /* the same guard now fails: else runs, nothing written */
    CHECK_OK(c, etcd_txn(c, &cmp, 1, then, 3, els, 1, &t));
    CHECK_OR_EXIT(!t.succeeded && t.n == 1 && t.revision == rev + 1);
    CHECK_OR_EXIT(t.ranges[0].n == 1 && strcmp(t.ranges[0].kvs[0].value, "v2") == 0);
    etcd_txn_result_free(&t);

    /* create-only: version == 0 */
    etcd_cmp absent = {.key = "/t/txn/new", .target = ETCD_CMP_VERSION, .op = ETCD_CMP_EQUAL};
    etcd_op put_new = {.type = ETCD_OP_PUT, .key = "/t/txn/new", .value = "n", .value_len = 1};
    CHECK_OK(c, etcd_txn(c, &absent, 1, &put_new, 1, NULL, 0, &t));
    CHECK_OR_EXIT(t.succeeded);
    etcd_txn_result_free(&t);
    CHECK_OK(c, etcd_txn(c, &absent, 1, &put_new, 1, NULL, 0, &t));
    CHECK_OR_EXIT(!t.succeeded && t.n == 0);
    etcd_txn_result_free(&t);

    /* value, greater, less, not-equal, create, lease; out may be NULL */
    etcd_cmp many[] = {
        {.key = "/t/txn/k",
         .target = ETCD_CMP_VALUE,
         .op = ETCD_CMP_EQUAL,
         .value = "v2",
         .value_len = 2},
        {.key = "/t/txn/k", .target = ETCD_CMP_VERSION, .op = ETCD_CMP_GREATER, .number = 1},
        {.key = "/t/txn/k", .target = ETCD_CMP_CREATE, .op = ETCD_CMP_LESS, .number = rev + 1},
        {.key = "/t/txn/k",
         .target = ETCD_CMP_VALUE,
         .op = ETCD_CMP_NOT_EQUAL,
         .value = "v1",
         .value_len = 2},
        {.key = "/t/txn/k", .target = ETCD_CMP_LEASE, .op = ETCD_CMP_EQUAL, .number = 0},
    };
    etcd_op del = {.type = ETCD_OP_DELETE, .key = "/t/txn/", .prefix = 1};
    CHECK_OK(c, etcd_txn(c, many, 5, &del, 1, NULL, 0, &t));
    CHECK_OR_EXIT(t.succeeded && t.n == 1);
    etcd_txn_result_free(&t);
    etcd_range_result r;
    CHECK_OK(c, etcd_range(c, "/t/txn/", 1, 0, &r));
    CHECK_OR_EXIT(r.n == 0);
    etcd_range_result_free(&r);
    many[0].value = "zz";
    CHECK_OK(c, etcd_txn(c, many, 1, NULL, 0, NULL, 0, NULL));

    /* etcd's limit of 128 operations is checked before sending */
    etcd_op lots[129];
    for (int i = 0; i < 129; i++)
        lots[i] = (etcd_op){.type = ETCD_OP_RANGE, .key = "/t/txn/k"};
    CHECK_ERR(c, ETCD_ERR_TOO_LARGE, etcd_txn(c, NULL, 0, lots, 129, NULL, 0, &t));
    CHECK_OK(c, etcd_txn(c, NULL, 0, lots, 128, NULL, 0, &t));
    CHECK_OR_EXIT(t.succeeded && t.n == 128);
    etcd_txn_result_free(&t);
    /* a put to the same key twice in one txn: etcd refuses, not retried */
    etcd_op dup[] = {put_new, put_new};
    CHECK_ERR(c, ETCD_ERR_ARG, etcd_txn(c, NULL, 0, dup, 2, NULL, 0, &t));
    CHECK_OR_EXIT(strstr(etcd_last_error(c), "duplicate key"));
}

/* A txn's ranges sorted by create revision, limited, filtered by
 * max_create_revision (the rendezvous's predecessor and freezer reads),
 * the count of the whole range beside them, and keys without values;
 * every request counted. */
static void test_range_options(etcd_client *c)
{
    etcd_counts counts;
    memset(&counts, 0, sizeof(counts));
    etcd_client_count_into(c, &counts);
    int64_t rev[3];
    /* created in the order b, c, a: key order is not create order */
    CHECK_OK(c, etcd_put(c, "/t/sort/b", "1", 1, 0, &rev[0]));
    CHECK_OK(c, etcd_put(c, "/t/sort/c", "2", 1, 0, &rev[1]));
    CHECK_OK(c, etcd_put(c, "/t/sort/a", "3", 1, 0, &rev[2]));
    etcd_op ops[] = {
        {.type = ETCD_OP_RANGE,
         .key = "/t/sort/",
         .prefix = 1,
         .limit = 1,
         .sort = ETCD_SORT_CREATE_ASCEND},
        {.type = ETCD_OP_RANGE,
         .key = "/t/sort/",
         .prefix = 1,
         .limit = 1,
         .sort = ETCD_SORT_CREATE_DESCEND},
        {.type = ETCD_OP_RANGE,
         .key = "/t/sort/",
         .prefix = 1,
         .limit = 1,
         .sort = ETCD_SORT_CREATE_DESCEND,
         .max_create_revision = rev[2] - 1},
        {.type = ETCD_OP_RANGE,
         .key = "/t/sort/",
         .prefix = 1,
         .sort = ETCD_SORT_CREATE_DESCEND,
         .max_create_revision = rev[0] - 1},
        {.type = ETCD_OP_RANGE, .key = "/t/sort/", .prefix = 1, .count_only = 1},
        {.type = ETCD_OP_RANGE, .key = "/t/sort/", .prefix = 1, .keys_only = 1},
    };
    etcd_txn_result t;
    CHECK_OK(c, etcd_txn(c, NULL, 0, ops, 6, NULL, 0, &t));
    CHECK_OR_EXIT(t.succeeded && t.n == 6);
    CHECK_OR_EXIT(t.ranges[5].n == 3 && strcmp(t.ranges[5].kvs[0].key, "/t/sort/a") == 0);
    CHECK_OR_EXIT(t.ranges[5].kvs[0].value_len == 0 &&
                  t.ranges[5].kvs[0].create_revision == rev[2]);
    CHECK_OR_EXIT(t.ranges[0].n == 1 && strcmp(t.ranges[0].kvs[0].key, "/t/sort/b") == 0);
    CHECK_OR_EXIT(t.ranges[0].count == 3 && t.ranges[0].more);
    CHECK_OR_EXIT(t.ranges[1].n == 1 && strcmp(t.ranges[1].kvs[0].key, "/t/sort/a") == 0);
    CHECK_OR_EXIT(t.ranges[2].n == 1 && strcmp(t.ranges[2].kvs[0].key, "/t/sort/c") == 0);
    CHECK_OR_EXIT(t.ranges[3].n == 0);
    CHECK_OR_EXIT(t.ranges[4].n == 0 && t.ranges[4].count == 3);
    etcd_txn_result_free(&t);
    ops[0].limit = -1;
    CHECK_ERR(c, ETCD_ERR_ARG, etcd_txn(c, NULL, 0, ops, 1, NULL, 0, NULL));
    CHECK_OK(c, etcd_delete(c, "/t/sort/", 1, NULL));
    etcd_counts got;
    etcd_counts_read(&counts, &got);
    CHECK_OR_EXIT(got.n[ETCD_REQ_PUT] == 3 && got.n[ETCD_REQ_TXN] == 1 &&
                  got.n[ETCD_REQ_DELETE] == 1 && etcd_counts_total(&got) == 5);
    CHECK_OR_EXIT(got.answer_bytes > 0 && got.finished == 5);
    CHECK_OR_EXIT(strcmp(etcd_req_kind_name(ETCD_REQ_KEEPALIVE), "keepalive") == 0);
    etcd_client_count_into(c, NULL);
}

static void test_lease(etcd_client *c)
{
    int64_t id, ttl;
    CHECK_OK(c, etcd_lease_grant(c, 30, &id));
    CHECK_OR_EXIT(id != 0);
    CHECK_OK(c, etcd_put(c, "/t/lease/k", "v", 1, id, NULL));
    etcd_kv kv;
    CHECK_OK(c, etcd_get(c, "/t/lease/k", &kv));
    CHECK_OR_EXIT(kv.lease == id);
    etcd_kv_free(&kv);
    CHECK_OK(c, etcd_lease_keepalive(c, id, &ttl));
    CHECK_OR_EXIT(ttl == 30);
    CHECK_OK(c, etcd_lease_revoke(c, id));
    CHECK_ERR(c, ETCD_ERR_NOT_FOUND, etcd_get(c, "/t/lease/k", &kv));
    CHECK_ERR(c, ETCD_ERR_NOT_FOUND, etcd_lease_keepalive(c, id, &ttl));
    CHECK_ERR(c, ETCD_ERR_NOT_FOUND, etcd_lease_revoke(c, id));
    /* a put on a lease that does not exist */
    CHECK_ERR(c, ETCD_ERR_NOT_FOUND, etcd_put(c, "/t/lease/k", "v", 1, id, NULL));
    CHECK_ERR(c, ETCD_ERR_ARG, etcd_lease_grant(c, 0, &id));
}

typedef struct waker {
    etcd_watch *w;
    int delay_ms;
} waker;

static void *wake_later(void *arg)
{
    waker *k = arg;
    usleep((useconds_t)k->delay_ms * 1000);
    etcd_watch_wakeup(k->w);
    return NULL;
}

static void test_watch(etcd_client *c)
{
    etcd_watch *w;
    CHECK_OK(c, etcd_watch_open(c, "/t/w/", 1, 0, &w));
    /* nothing yet: returns after the timeout with no events */
    etcd_event *ev;
    size_t n;
    CHECK_OK(c, etcd_watch_next(w, 50, &ev, &n));
    CHECK_OR_EXIT(n == 0 && ev == NULL);

    int64_t revs[20];
    for (int i = 0; i < 20; i++) {
        char key[32], val[32];
        snprintf(key, sizeof(key), "/t/w/%02d", i % 5);
        snprintf(val, sizeof(val), "v%d", i);
        CHECK_OK(c, etcd_put(c, key, val, strlen(val), 0, &revs[i]));
    }
    int64_t delrev;
    CHECK_OK(c, etcd_put(c, "/t/wx", "outside", 7, 0, NULL));
    etcd_txn_result t;
    /* one txn, three events with the same revision */
    etcd_op multi[] = {
        {.type = ETCD_OP_DELETE, .key = "/t/w/00"},
        {.type = ETCD_OP_PUT, .key = "/t/w/t1", .value = "a", .value_len = 1},
        {.type = ETCD_OP_PUT, .key = "/t/w/t2", .value = "b", .value_len = 1},
    };
    CHECK_OK(c, etcd_txn(c, NULL, 0, multi, 3, NULL, 0, &t));
    delrev = t.revision;
    etcd_txn_result_free(&t);

    etcd_err last;
    etcd_event *all;
    size_t got = test_watch_collect(w, 23, 5000, &all, &last);
    CHECK_OR_EXIT(last == ETCD_OK && got == 23);
    for (int i = 0; i < 20; i++) {
        char val[32];
        snprintf(val, sizeof(val), "v%d", i);
        CHECK_OR_EXIT(all[i].type == ETCD_EVENT_PUT && all[i].kv.mod_revision == revs[i]);
        CHECK_OR_EXIT(strcmp(all[i].kv.value, val) == 0);
    }
    CHECK_OR_EXIT(all[20].type == ETCD_EVENT_DELETE && strcmp(all[20].kv.key, "/t/w/00") == 0);
    CHECK_OR_EXIT(all[20].kv.mod_revision == delrev);
    CHECK_OR_EXIT(all[21].type == ETCD_EVENT_PUT && strcmp(all[21].kv.key, "/t/w/t1") == 0);
    CHECK_OR_EXIT(all[22].type == ETCD_EVENT_PUT && strcmp(all[22].kv.key, "/t/w/t2") == 0);
    CHECK_OR_EXIT(all[21].kv.mod_revision == delrev && all[22].kv.mod_revision == delrev);
    CHECK_OR_EXIT(etcd_watch_revision(w) == delrev);
    etcd_events_free(all, got);

    /* wakeup from another thread returns a blocked next at once */
    waker k = {w, 100};
    pthread_t th;
    CHECK_OR_EXIT(pthread_create(&th, NULL, wake_later, &k) == 0);
    int64_t t0 = mono_now_ms();
    CHECK_OK(c, etcd_watch_next(w, 30000, &ev, &n));
    CHECK_OR_EXIT(n == 0 && mono_now_ms() - t0 < 20000);
    pthread_join(th, NULL);
    etcd_watch_close(w);

    /* from a past revision: history replayed; a single key only sees itself */
    CHECK_OK(c, etcd_watch_open(c, "/t/w/01", 0, revs[0], &w));
    got = test_watch_collect(w, 4, 5000, &all, &last);
    CHECK_OR_EXIT(got == 4 && all[0].kv.mod_revision == revs[1] &&
                  all[3].kv.mod_revision == revs[16]);
    for (size_t i = 0; i < got; i++)
        CHECK_OR_EXIT(strcmp(all[i].kv.key, "/t/w/01") == 0);
    etcd_events_free(all, got);
    CHECK_OK(c, etcd_watch_next(w, 50, &ev, &n));
    CHECK_OR_EXIT(n == 0);
    etcd_watch_close(w);
}

/* A set: several keys on one stream, each event tagged with its key's
 * index, each key from its own start revision. */
static void test_watch_set(etcd_client *c)
{
    int64_t r1, r2, r3;
    CHECK_OK(c, etcd_put(c, "/t/s/a", "1", 1, 0, &r1));
    CHECK_OK(c, etcd_put(c, "/t/s/p/x", "2", 1, 0, &r2));
    CHECK_OK(c, etcd_put(c, "/t/s/b", "3", 1, 0, &r3));
    etcd_watch_key keys[3] = {
        {.key = "/t/s/a", .start_revision = r1}, /* sees its put again */
        {.key = "/t/s/p/", .prefix = 1},          /* from now: not /t/s/p/x */
        {.key = "/t/s/b", .start_revision = r3 + 1},
    };
    etcd_watch *w;
    CHECK_OK(c, etcd_watch_open_set(c, keys, 3, &w));
    CHECK_OR_EXIT(etcd_watch_next_revision(w, 1) > r3 && etcd_watch_next_revision(w, 2) == r3 + 1);
    int64_t rb, rp, ra;
    CHECK_OK(c, etcd_put(c, "/t/s/b", "4", 1, 0, &rb));
    CHECK_OK(c, etcd_put(c, "/t/s/p/y", "5", 1, 0, &rp));
    CHECK_OK(c, etcd_put(c, "/t/s/other", "6", 1, 0, NULL));
    CHECK_OK(c, etcd_put(c, "/t/s/a", "7", 1, 0, &ra));
    etcd_event *all;
    etcd_err last;
    size_t got = test_watch_collect(w, 4, 5000, &all, &last);
    CHECK_OR_EXIT(last == ETCD_OK && got == 4);
    int seen[3] = {0, 0, 0};
    int64_t prev[3] = {0, 0, 0};
    for (size_t i = 0; i < got; i++) {
        int k = all[i].watch;
        CHECK_OR_EXIT(k >= 0 && k < 3);
        CHECK_OR_EXIT(all[i].kv.mod_revision > prev[k]); /* in order, per key */
        prev[k] = all[i].kv.mod_revision;
        seen[k]++;
        if (k == 0) CHECK_OR_EXIT(strcmp(all[i].kv.key, "/t/s/a") == 0);
        if (k == 1) CHECK_OR_EXIT(strcmp(all[i].kv.key, "/t/s/p/y") == 0);
        if (k == 2) CHECK_OR_EXIT(strcmp(all[i].kv.key, "/t/s/b") == 0);
    }
    CHECK_OR_EXIT(seen[0] == 2 && seen[1] == 1 && seen[2] == 1);
    CHECK_OR_EXIT(etcd_watch_next_revision(w, 0) == ra + 1 && etcd_watch_next_revision(w, 1) == rp + 1 &&
                  etcd_watch_next_revision(w, 2) == rb + 1);
    test_watch_end_quiet(c, w, all, got, 50);
    /* bad sets are refused before any request */
    CHECK_ERR(c, ETCD_ERR_ARG, etcd_watch_open_set(c, keys, 0, &w));
    CHECK_ERR(c, ETCD_ERR_ARG, etcd_watch_open_set(c, keys, ETCD_WATCH_MAX_KEYS + 1, &w));
}

int main(void)
{
    if (test_etcd_start(&srv) != 0) return 1;
    etcd_client *c = test_client(srv.endpoint, 5000);
    test_put_get_range_delete(c);
    test_prefix_end_ff(c);
    test_large_values(c);
    test_txn(c);
    test_range_options(c);
    test_lease(c);
    test_watch(c);
    test_watch_set(c);
    etcd_client_free(c);
    test_etcd_stop(&srv);
    printf("test_etcd_client: ok\n");
    return 0;
}
