/* test_etcd_cluster.c: endpoint failover against a real three-member etcd.
 *
 * The client knows all three members. The member serving the watch (the
 * first endpoint) is killed: calls fail over to the others (retrying the
 * "no leader" answers of an election when it was the leader), and the watch
 * resumes on another member from its last revision, losing and repeating
 * nothing. With a second member gone there is no quorum: calls end with
 * ETCD_ERR_UNAVAILABLE or ETCD_ERR_TIMEOUT at their deadline.
 */
#include "ductile/etcd.h"
#include "test_etcd.h"
#include "test_etcd_util.h"

#define MEMBERS 3

static test_cluster cl;

static void cleanup(void)
{
    test_cluster_stop(&cl);
}

static void put_seq(etcd_client *c, int from, int n)
{
    for (int i = from; i < from + n; i++) {
        char key[32], val[16];
        snprintf(key, sizeof(key), "/cl/%03d", i);
        snprintf(val, sizeof(val), "%d", i);
        etcd_err e = etcd_put(c, key, val, strlen(val), 0, NULL);
        if (e == ETCD_ERR_UNAVAILABLE && strstr(etcd_last_error(c), "may have been applied")) {
            /* what a caller does with an unknown outcome: read, then decide */
            fprintf(stderr, "put %s: outcome unknown (%s), reading it\n", key, etcd_last_error(c));
            etcd_kv kv;
            e = etcd_get(c, key, &kv);
            if (e == ETCD_OK) etcd_kv_free(&kv);
            if (e == ETCD_ERR_NOT_FOUND) e = etcd_put(c, key, val, strlen(val), 0, NULL);
        }
        if (e != ETCD_OK) fprintf(stderr, "put %s: %s\n", key, etcd_last_error(c));
        CHECK_OR_EXIT(e == ETCD_OK);
    }
}

static void expect_seq(etcd_watch *w, int from, int n)
{
    etcd_event *ev;
    etcd_err last;
    size_t got = test_watch_collect(w, (size_t)n, 15000, &ev, &last);
    if (got != (size_t)n) fprintf(stderr, "watch: %s\n", etcd_watch_last_error(w));
    CHECK_OR_EXIT(got == (size_t)n);
    for (int i = 0; i < n; i++) {
        char val[16];
        snprintf(val, sizeof(val), "%d", from + i);
        CHECK_OR_EXIT(strcmp(ev[i].kv.value, val) == 0);
    }
    etcd_events_free(ev, got);
    etcd_event *more;
    size_t k;
    CHECK_OR_EXIT(etcd_watch_next(w, 200, &more, &k) == ETCD_OK && k == 0); /* no duplicates */
}

int main(void)
{
    atexit(cleanup);
    CHECK_OR_EXIT(test_cluster_init(&cl, MEMBERS, "cluster") == 0);
    char eps[256];
    test_cluster_endpoints(&cl, eps, sizeof(eps));
    for (int i = 0; i < MEMBERS; i++)
        CHECK_OR_EXIT(test_cluster_start(&cl, i) == 0);

    /* the client's own retries wait for the cluster to form */
    etcd_client *c = test_client(eps, 20000);
    int64_t rev;
    if (etcd_put(c, "/cl/start", "x", 1, 0, &rev) != ETCD_OK) {
        fprintf(stderr, "cluster did not form: %s (logs in %s)\n", etcd_last_error(c), cl.dir);
        return 1;
    }
    etcd_set_timeout(c, 10000);
    etcd_watch *w;
    CHECK_OK(c, etcd_watch_open(c, "/cl/0", 1, 0, &w));
    int64_t id;
    CHECK_OK(c, etcd_lease_grant(c, 30, &id));
    put_seq(c, 0, 3);
    expect_seq(w, 0, 3);

    /* the first endpoint, serving the watch and the client, dies */
    test_cluster_kill(&cl, 0);
    /* when it was the leader, a put caught in the election waits for etcd's
     * own request timeout (5 s + 2 elections): the deadline leaves room */
    etcd_set_timeout(c, 20000);
    put_seq(c, 3, 3);
    int64_t ttl;
    CHECK_OK(c, etcd_lease_keepalive(c, id, &ttl));
    expect_seq(w, 3, 3);
    put_seq(c, 6, 2);
    expect_seq(w, 6, 2);

    /* a second member gone: no quorum, a clear error at the deadline */
    test_cluster_kill(&cl, 1);
    etcd_set_timeout(c, 1500);
    int64_t t0 = mono_now_ms();
    etcd_err e = etcd_put(c, "/cl/noquorum", "x", 1, 0, NULL);
    int64_t took = mono_now_ms() - t0;
    fprintf(stderr, "no quorum: %s (%s) after %lld ms\n", etcd_strerror(e), etcd_last_error(c),
            (long long)took);
    CHECK_OR_EXIT(e == ETCD_ERR_UNAVAILABLE || e == ETCD_ERR_TIMEOUT);
    CHECK_OR_EXIT(took >= 1000 && took < 10000);

    etcd_watch_close(w);
    etcd_client_free(c);
    cleanup();
    printf("test_etcd_cluster: ok\n");
    return 0;
}
