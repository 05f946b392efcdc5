/* test_store_fencing: the round store against a real etcd.
 *
 * set/get, wait (satisfied by a writer and timing out), atomic add under
 * contention from several threads with their own stores, barriers (complete
 * and short of participants), and fencing: once round 2 is opened the store
 * of round 1 refuses every write while round 2's accepts them, and a wait of
 * round 1 ends with RDZV_ERR_FENCED, not at its timeout. Ends with the job
 * status as `ductile-agent status` would print it.
 */
#include "check.h"
#include "ductile/etcd.h"
#include "ductile/rdzv.h"
#include "test_etcd.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define ADDERS 4
#define ADDS 25

typedef struct worker {
    rdzv_etcd etcd;
    int64_t round;
    int id;
    int64_t got[ADDS];
    rdzv_err err;
    int barrier_count;
} worker;

static void *adder(void *arg)
{
    worker *w = arg;
    rdzv_store *s = NULL;
    w->err = rdzv_store_open(&w->etcd, "store", w->round, &s);
    for (int i = 0; w->err == RDZV_OK && i < ADDS; i++)
        w->err = rdzv_store_add(s, "counter", 1, &w->got[i]);
    rdzv_store_close(s);
    return NULL;
}

static void *barrier_member(void *arg)
{
    worker *w = arg;
    rdzv_store *s = NULL;
    w->err = rdzv_store_open(&w->etcd, "store", w->round, &s);
    if (w->err == RDZV_OK)
        w->err = rdzv_store_barrier(s, w->barrier_count == ADDERS ? "all" : "short",
                                    w->barrier_count, 1500);
    rdzv_store_close(s);
    return NULL;
}

static void *late_writer(void *arg)
{
    worker *w = arg;
    rdzv_store *s = NULL;
    usleep(200 * 1000);
    w->err = rdzv_store_open(&w->etcd, "store", w->round, &s);
    if (w->err == RDZV_OK) w->err = rdzv_store_set(s, "nccl-id", "abc\0def", 7);
    rdzv_store_close(s);
    return NULL;
}

#define LONG_WAIT_MS 30000

typedef struct waiter {
    rdzv_store *s;
    rdzv_err err;
    int64_t took_ms;
} waiter;

/* Waits for a key nobody writes, with a long timeout. */
static void *long_waiter(void *arg)
{
    waiter *w = arg;
    void *v = NULL;
    size_t len = 0;
    int64_t t0 = mono_now_ms();
    w->err = rdzv_store_wait(w->s, "never-written", LONG_WAIT_MS, &v, &len);
    w->took_ms = mono_now_ms() - t0;
    free(v);
    return NULL;
}

static rdzv *open_node(const char *endpoint, const char *node)
{
    rdzv_config cfg = {
        .etcd = {.endpoints = endpoint},
        .job = "store",
        .node_id = node,
        .addr = "127.0.0.1:1234",
        .local_world_size = 2,
        .min_nodes = 1,
        .max_nodes = 2,
        .last_call_ms = 100,
        .lease_ttl_s = 10,
        .join_timeout_ms = 30000,
        .max_restarts = 3,
    };
    rdzv *r = NULL;
    char msg[256];
    rdzv_err err = rdzv_open(&cfg, &r, msg);
    CHECK_OR_EXIT(err == RDZV_OK, "open %s: %s: %s", node, rdzv_strerror(err), msg);
    return r;
}

/* Next event of the given type, skipping others; fails after 20 s. */
static void expect_event(rdzv *r, rdzv_event_type type, rdzv_event *ev)
{
    for (int i = 0; i < 40; i++) {
        if (rdzv_next_event(r, 500, ev) != RDZV_OK) continue;
        if (ev->type == type) return;
        rdzv_event_free(ev);
    }
    CHECK_OR_EXIT(0, "no event of type %d", (int)type);
}

int main(void)
{
    test_etcd e;
    if (test_etcd_start(&e) != 0) return 1;
    rdzv_etcd etcd = {.endpoints = e.endpoint};

    rdzv *a = open_node(e.endpoint, "a");
    rdzv_event ev;
    expect_event(a, RDZV_EV_FROZEN, &ev);
    CHECK_OR_EXIT(ev.round.number == 1 && ev.round.nmembers == 1 && ev.round.world_size == 2,
                  "round 1");
    rdzv_event_free(&ev);

    rdzv_store *s1 = NULL;
    CHECK_OR_EXIT(rdzv_store_open(&etcd, "store", 1, &s1) == RDZV_OK, "store open");
    void *v = NULL;
    size_t len = 0;
    CHECK_OR_EXIT(rdzv_store_get(s1, "missing", &v, &len) == RDZV_ERR_NOT_FOUND, "get missing");
    CHECK_OR_EXIT(rdzv_store_set(s1, "addr/0", "10.0.0.1:29500", 14) == RDZV_OK, "set: %s",
                  rdzv_store_last_error(s1));
    CHECK_OR_EXIT(rdzv_store_get(s1, "addr/0", &v, &len) == RDZV_OK, "get");
    CHECK_OR_EXIT(len == 14 && memcmp(v, "10.0.0.1:29500", 14) == 0 && ((char *)v)[14] == '\0',
                  "value");
    free(v);

    /* wait: times out on a key nobody writes, returns a key written later */
    CHECK_OR_EXIT(rdzv_store_wait(s1, "never", 300, &v, &len) == RDZV_ERR_TIMEOUT, "wait timeout");
    CHECK_OR_EXIT(strstr(rdzv_store_last_error(s1), "never") != NULL, "%s",
                  rdzv_store_last_error(s1));
    worker lw = {.etcd = etcd, .round = 1};
    pthread_t th;
    pthread_create(&th, NULL, late_writer, &lw);
    rdzv_err err = rdzv_store_wait(s1, "nccl-id", 10000, &v, &len);
    pthread_join(th, NULL);
    CHECK_OR_EXIT(lw.err == RDZV_OK, "late writer: %s", rdzv_strerror(lw.err));
    CHECK_OR_EXIT(err == RDZV_OK && len == 7 && memcmp(v, "abc\0def", 7) == 0,
                  "wait got the value");
    free(v);

    /* add under contention: every result distinct, total exact */
    worker w[ADDERS];
    pthread_t ths[ADDERS];
    for (int i = 0; i < ADDERS; i++) {
        w[i] = (worker){.etcd = etcd, .round = 1, .id = i};
        pthread_create(&ths[i], NULL, adder, &w[i]);
    }
    char seen[ADDERS * ADDS + 1] = {0};
    for (int i = 0; i < ADDERS; i++) {
        pthread_join(ths[i], NULL);
        CHECK_OR_EXIT(w[i].err == RDZV_OK, "adder %d: %s", i, rdzv_strerror(w[i].err));
        for (int k = 0; k < ADDS; k++) {
            int64_t x = w[i].got[k];
            CHECK_OR_EXIT(x >= 1 && x <= ADDERS * ADDS && !seen[x],
                          "add result %lld twice or out of range", (long long)x);
            seen[x] = 1;
        }
    }
    int64_t total = 0;
    CHECK_OR_EXIT(rdzv_store_add(s1, "counter", 0, &total) == RDZV_OK && total == ADDERS * ADDS,
                  "total %lld", (long long)total);
    CHECK_OR_EXIT(rdzv_store_set(s1, "text", "x", 1) == RDZV_OK, "set text");
    CHECK_OR_EXIT(rdzv_store_add(s1, "text", 1, &total) == RDZV_ERR_PROTOCOL,
                  "add on a non-counter");

    /* barriers: complete with everyone, time out one short */
    for (int round = 0; round < 2; round++) {
        int count = round == 0 ? ADDERS : ADDERS + 1;
        for (int i = 0; i < ADDERS; i++) {
            w[i] = (worker){.etcd = etcd, .round = 1, .id = i, .barrier_count = count};
            pthread_create(&ths[i], NULL, barrier_member, &w[i]);
        }
        for (int i = 0; i < ADDERS; i++) {
            pthread_join(ths[i], NULL);
            rdzv_err want = round == 0 ? RDZV_OK : RDZV_ERR_TIMEOUT;
            CHECK_OR_EXIT(w[i].err == want, "barrier of %d, member %d: %s", count, i,
                          rdzv_strerror(w[i].err));
        }
    }

    /* fencing: a second node arrives, there is room, round 2 opens; a wait
     * of round 1 that began before (most likely: the second lets it reach
     * its watches) ends as the epoch moves on */
    CHECK_OR_EXIT(rdzv_store_check(s1) == RDZV_OK, "round 1 is current");
    rdzv_store *sw = NULL;
    CHECK_OR_EXIT(rdzv_store_open(&etcd, "store", 1, &sw) == RDZV_OK, "store for the waiter");
    waiter wt = {.s = sw};
    pthread_create(&th, NULL, long_waiter, &wt);
    sleep(1);
    rdzv *b = open_node(e.endpoint, "b");
    expect_event(a, RDZV_EV_ROUND_ENDED, &ev);
    CHECK_OR_EXIT(ev.round_number == 1 && ev.cause == RDZV_CAUSE_NODE_WAITING, "round 1 ended: %s",
                  ev.reason);
    expect_event(a, RDZV_EV_FROZEN, &ev);
    CHECK_OR_EXIT(ev.round.number == 2 && ev.round.nmembers == 2 && ev.round.my_rank == 0,
                  "a in round 2");
    rdzv_event_free(&ev);
    expect_event(b, RDZV_EV_FROZEN, &ev);
    CHECK_OR_EXIT(ev.round.number == 2 && ev.round.my_rank == 1 &&
                      ev.round.members[1].first_global_rank == 2,
                  "b in round 2");
    rdzv_event_free(&ev);

    pthread_join(th, NULL);
    printf("wait of round 1: %s after %lld ms: %s\n", rdzv_strerror(wt.err), (long long)wt.took_ms,
           rdzv_store_last_error(sw));
    CHECK_OR_EXIT(wt.err == RDZV_ERR_FENCED, "wait of round 1: %s", rdzv_strerror(wt.err));
    CHECK_OR_EXIT(wt.took_ms < LONG_WAIT_MS, "the wait ran out its timeout");
    CHECK_OR_EXIT(strstr(rdzv_store_last_error(sw), "epoch is") != NULL, "%s",
                  rdzv_store_last_error(sw));
    rdzv_store_close(sw);
    /* a wait that starts after the round ended ends at once */
    CHECK_OR_EXIT(rdzv_store_wait(s1, "never-written", LONG_WAIT_MS, &v, &len) == RDZV_ERR_FENCED,
                  "old round wait fenced");
    CHECK_OR_EXIT(strstr(rdzv_store_last_error(s1), "epoch is 2") != NULL, "%s",
                  rdzv_store_last_error(s1));
    CHECK_OR_EXIT(rdzv_store_get(s1, "addr/0", &v, &len) == RDZV_OK,
                  "a key of round 1 can still be read");
    free(v);
    CHECK_OR_EXIT(rdzv_store_wait(s1, "addr/0", LONG_WAIT_MS, &v, &len) == RDZV_OK,
                  "and waited for");
    free(v);

    CHECK_OR_EXIT(rdzv_store_set(s1, "addr/0", "stale", 5) == RDZV_ERR_FENCED,
                  "old round set fenced");
    CHECK_OR_EXIT(strstr(rdzv_store_last_error(s1), "epoch is 2") != NULL, "%s",
                  rdzv_store_last_error(s1));
    CHECK_OR_EXIT(rdzv_store_add(s1, "counter", 1, &total) == RDZV_ERR_FENCED,
                  "old round add fenced");
    CHECK_OR_EXIT(rdzv_store_check(s1) == RDZV_ERR_FENCED, "old round check");
    CHECK_OR_EXIT(rdzv_store_get(s1, "addr/0", &v, &len) == RDZV_OK && len == 14,
                  "old value untouched");
    free(v);
    rdzv_store *s2 = NULL;
    CHECK_OR_EXIT(rdzv_store_open(&etcd, "store", 2, &s2) == RDZV_OK, "store 2");
    CHECK_OR_EXIT(rdzv_store_check(s2) == RDZV_OK, "round 2 current");
    CHECK_OR_EXIT(rdzv_store_get(s2, "addr/0", &v, &len) == RDZV_ERR_NOT_FOUND,
                  "round 1 keys not in 2");
    CHECK_OR_EXIT(rdzv_store_set(s2, "addr/0", "new", 3) == RDZV_OK, "round 2 set");
    rdzv_store *s3 = NULL;
    CHECK_OR_EXIT(rdzv_store_open(&etcd, "store", 3, &s3) == RDZV_OK, "store 3");
    CHECK_OR_EXIT(rdzv_store_set(s3, "k", "v", 1) == RDZV_ERR_FENCED,
                  "a future round is not current");
    /* ... but may become current: a wait of it runs to its timeout */
    CHECK_OR_EXIT(rdzv_store_wait(s3, "k", 300, &v, &len) == RDZV_ERR_TIMEOUT,
                  "wait of a future round: %s", rdzv_store_last_error(s3));

    /* status, as `ductile-agent status` shows it */
    rdzv_status st;
    char msg[256];
    CHECK_OR_EXIT(rdzv_get_status(&etcd, "store", &st, msg) == RDZV_OK, "status: %s", msg);
    CHECK_OR_EXIT(st.round == 2 && !strcmp(st.round_state, "frozen") && st.nmembers == 2 &&
                      st.nnodes == 2 && !strcmp(st.job_state, "running") && st.max_restarts == 3,
                  "status fields");
    char *json = rdzv_status_json(&st);
    CHECK_OR_EXIT(json && strstr(json, "\"world_size\":4") && strstr(json, "\"node\":\"b\""),
                  "json %s", json ? json : "(null)");
    free(json);
    rdzv_status_free(&st);
    CHECK_OR_EXIT(rdzv_get_status(&etcd, "Bad_Job", &st, msg) == RDZV_ERR_ARG, "bad job id");

    CHECK_OR_EXIT(rdzv_seconds_in_rendezvous(a) > 0, "time in rendezvous");

    /* b leaves: round 3 opens, and round 1's keys are cleaned up (etcd must
     * not grow with every round) while round 2's are kept */
    CHECK_OR_EXIT(rdzv_leave(b) == RDZV_OK, "leave");
    rdzv_close(b);
    expect_event(a, RDZV_EV_FROZEN, &ev);
    CHECK_OR_EXIT(ev.round.number == 3 && ev.round.nmembers == 1, "round 3");
    rdzv_event_free(&ev);
    etcd_config ec = {.endpoints = e.endpoint};
    etcd_client *c = NULL;
    CHECK_OR_EXIT(etcd_client_new(&ec, &c) == ETCD_OK, "etcd client");
    etcd_range_result rr;
    CHECK_OR_EXIT(etcd_range(c, "/ductile/store/rounds/1/", 1, 0, &rr) == ETCD_OK, "range");
    CHECK_OR_EXIT(rr.n == 0, "round 1 still has %zu keys", rr.n);
    etcd_range_result_free(&rr);
    CHECK_OR_EXIT(etcd_range(c, "/ductile/store/rounds/2/store/", 1, 0, &rr) == ETCD_OK &&
                      rr.n == 1,
                  "round 2 keys kept");
    etcd_range_result_free(&rr);
    etcd_client_free(c);

    rdzv_store_close(s1);
    rdzv_store_close(s2);
    rdzv_store_close(s3);
    rdzv_close(a);
    test_etcd_stop(&e);
    printf("ok store\n");
    return 0;
}
