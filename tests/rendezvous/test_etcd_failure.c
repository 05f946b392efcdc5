/* test_etcd_failure.c: the etcd client when etcd fails.
 *
 * A real etcd is killed, stopped (SIGSTOP) and restarted under a live watch
 * and a client: no event is lost or repeated across the restart, compaction
 * of the resume revision is reported, a lease left alone expires, a dead
 * first endpoint fails over to the second, and with no etcd at all every call
 * gives ETCD_ERR_UNAVAILABLE at its deadline instead of hanging.
 */
#include "ductile/etcd.h"
#include "test_etcd.h"
#include "test_etcd_util.h"

#include <signal.h>
#include <unistd.h>

static test_etcd srv;

/* Compact etcd's history up to rev (the client has no call for it). */
static void compact(int64_t rev)
{
    char body[64];
    snprintf(body, sizeof(body), "{\"revision\":\"%lld\",\"physical\":true}", (long long)rev);
    CHECK_OR_EXIT(test_etcd_post(srv.endpoint, "/v3/kv/compaction", body, 5000) == 200);
}

static void put_n(etcd_client *c, const char *prefix, int from, int n, int64_t *revs)
{
    for (int i = 0; i < n; i++) {
        char key[64], val[32];
        snprintf(key, sizeof(key), "%s%03d", prefix, from + i);
        snprintf(val, sizeof(val), "%d", from + i);
        CHECK_OK(c, etcd_put(c, key, val, strlen(val), 0, revs ? &revs[i] : NULL));
    }
}

/* Events [0, n) must be exactly the puts from..from+n-1, in order. */
static void check_seq(etcd_event *ev, size_t n, int from)
{
    for (size_t i = 0; i < n; i++) {
        char val[32];
        snprintf(val, sizeof(val), "%d", from + (int)i);
        if (strcmp(ev[i].kv.value, val) != 0) {
            fprintf(stderr, "event %zu: value %s, want %s\n", i, ev[i].kv.value, val);
            exit(1);
        }
        CHECK_OR_EXIT(i == 0 || ev[i].kv.mod_revision > ev[i - 1].kv.mod_revision);
    }
}

static void test_watch_survives_restart(etcd_client *c)
{
    etcd_watch *w;
    CHECK_OK(c, etcd_watch_open(c, "/f/r/", 1, 0, &w));
    put_n(c, "/f/r/", 0, 5, NULL);
    etcd_event *ev;
    etcd_err last;
    size_t got = test_watch_collect(w, 5, 5000, &ev, &last);
    CHECK_OR_EXIT(got == 5);
    check_seq(ev, 5, 0);
    etcd_events_free(ev, got);

    /* three puts the watch has not read yet, then the server dies */
    put_n(c, "/f/r/", 5, 3, NULL);
    test_etcd_kill(&srv);
    /* down: a put fails at its deadline, the watch reports nothing */
    etcd_set_timeout(c, 300);
    int64_t t0 = mono_now_ms();
    CHECK_ERR(c, ETCD_ERR_UNAVAILABLE, etcd_put(c, "/f/r/x", "x", 1, 0, NULL));
    CHECK_OR_EXIT(mono_now_ms() - t0 >= 250);
    etcd_set_timeout(c, 0);
    etcd_event *none;
    size_t n;
    etcd_err e = etcd_watch_next(w, 200, &none, &n);
    CHECK_OR_EXIT(e == ETCD_OK || e == ETCD_ERR_UNAVAILABLE);
    /* the three unread events were either read before the stream broke or
     * come again after the resume: either way exactly once */
    size_t early = n;
    etcd_events_free(none, n);

    CHECK_OR_EXIT(test_etcd_restart(&srv) == 0);
    put_n(c, "/f/r/", 8, 4, NULL); /* before the watch reconnects */
    got = test_watch_collect(w, 7 - early, 10000, &ev, &last);
    CHECK_OR_EXIT(last == ETCD_OK && got == 7 - early);
    check_seq(ev, got, 5 + (int)early);
    etcd_events_free(ev, got);
    put_n(c, "/f/r/", 12, 3, NULL); /* after it reconnected */
    got = test_watch_collect(w, 3, 5000, &ev, &last);
    CHECK_OR_EXIT(got == 3);
    check_seq(ev, got, 12);
    etcd_events_free(ev, got);
    /* and nothing more: no duplicates trail behind */
    CHECK_OK(c, etcd_watch_next(w, 300, &ev, &n));
    CHECK_OR_EXIT(n == 0);
    etcd_watch_close(w);
}

/* A set across a restart: each key resumes from its own revision, so
 * what one key saw before is not repeated and what the other missed is
 * not lost. */
static void test_watch_set_survives_restart(etcd_client *c)
{
    etcd_watch_key keys[2] = {{.key = "/f/sa/", .prefix = 1}, {.key = "/f/sb/", .prefix = 1}};
    etcd_watch *w;
    CHECK_OK(c, etcd_watch_open_set(c, keys, 2, &w));
    put_n(c, "/f/sa/", 0, 3, NULL);
    etcd_event *ev;
    etcd_err last;
    size_t got = test_watch_collect(w, 3, 5000, &ev, &last);
    CHECK_OR_EXIT(got == 3 && ev[0].watch == 0 && ev[2].watch == 0);
    check_seq(ev, got, 0);
    etcd_events_free(ev, got);
    test_etcd_kill(&srv);
    CHECK_OR_EXIT(test_etcd_restart(&srv) == 0);
    put_n(c, "/f/sb/", 100, 2, NULL); /* b's first events; a saw 0..2 already */
    put_n(c, "/f/sa/", 3, 1, NULL);
    got = test_watch_collect(w, 3, 10000, &ev, &last);
    CHECK_OR_EXIT(last == ETCD_OK && got == 3);
    int a = 0, b = 0;
    for (size_t i = 0; i < got; i++) {
        char want[16];
        snprintf(want, sizeof(want), "%d", ev[i].watch == 0 ? 3 + a : 100 + b);
        CHECK_OR_EXIT(strcmp(ev[i].kv.value, want) == 0);
        if (ev[i].watch == 0) a++;
        else b++;
    }
    CHECK_OR_EXIT(a == 1 && b == 2);
    test_watch_end_quiet(c, w, ev, got, 300);
}

static void test_watch_while_stopped(etcd_client *c)
{
    /* SIGSTOP: connections stay open but nothing answers; calls end with
     * TIMEOUT (request sent) at their deadline, the watch just waits */
    etcd_watch *w;
    CHECK_OK(c, etcd_watch_open(c, "/f/s/", 1, 0, &w));
    CHECK_OK(c, etcd_put(c, "/f/s/warm", "1", 1, 0, NULL)); /* a kept-alive connection */
    CHECK_OR_EXIT(kill(srv.pid, SIGSTOP) == 0);
    etcd_set_timeout(c, 400);
    int64_t t0 = mono_now_ms();
    etcd_err e = etcd_put(c, "/f/s/a", "1", 1, 0, NULL);
    int64_t took = mono_now_ms() - t0;
    CHECK_OR_EXIT(kill(srv.pid, SIGCONT) == 0);
    CHECK_OR_EXIT(e == ETCD_ERR_TIMEOUT || e == ETCD_ERR_UNAVAILABLE);
    CHECK_OR_EXIT(took >= 350 && took < 4000);
    etcd_set_timeout(c, 0);
    CHECK_OK(c, etcd_put(c, "/f/s/b", "2", 1, 0, NULL));
    etcd_event *ev;
    etcd_err last;
    size_t got = test_watch_collect(w, 3, 5000, &ev, &last);
    /* the put that timed out may or may not have been applied, and if it
     * was, possibly after /f/s/b: etcd may read the stalled connection's
     * request only after the new one's */
    CHECK_OR_EXIT(got >= 2 && strcmp(ev[0].kv.key, "/f/s/warm") == 0);
    int seen_b = 0;
    for (size_t i = 1; i < got; i++) {
        CHECK_OR_EXIT(strcmp(ev[i].kv.key, "/f/s/a") == 0 || strcmp(ev[i].kv.key, "/f/s/b") == 0);
        seen_b += strcmp(ev[i].kv.key, "/f/s/b") == 0;
    }
    CHECK_OR_EXIT(seen_b == 1);
    etcd_events_free(ev, got);
    etcd_watch_close(w);
}

static void test_compaction(etcd_client *c)
{
    int64_t revs[4];
    put_n(c, "/f/c/", 0, 4, revs);
    compact(revs[3]);
    /* a new watch from before the compaction */
    etcd_watch *w;
    CHECK_OK(c, etcd_watch_open(c, "/f/c/", 1, revs[0], &w));
    etcd_event *ev;
    size_t n;
    etcd_err e = etcd_watch_next(w, 5000, &ev, &n);
    CHECK_OR_EXIT(e == ETCD_ERR_COMPACTED && n == 0);
    CHECK_OR_EXIT(etcd_watch_revision(w) == revs[3]);
    CHECK_OR_EXIT(strstr(etcd_watch_last_error(w), "compacted"));
    /* and it stays over */
    CHECK_OR_EXIT(etcd_watch_next(w, 10, &ev, &n) == ETCD_ERR_COMPACTED);
    etcd_watch_close(w);

    /* a range at a compacted revision is not possible through the API; a
     * live watch whose resume point is compacted while etcd is down is */
    CHECK_OK(c, etcd_watch_open(c, "/f/c/", 1, 0, &w));
    put_n(c, "/f/c/", 10, 1, NULL);
    size_t got;
    etcd_err last;
    got = test_watch_collect(w, 1, 5000, &ev, &last);
    CHECK_OR_EXIT(got == 1);
    etcd_events_free(ev, got);
    test_etcd_kill(&srv);
    CHECK_OR_EXIT(test_etcd_restart(&srv) == 0);
    int64_t more[3];
    put_n(c, "/f/c/", 11, 3, more);
    compact(more[2]);
    e = etcd_watch_next(w, 5000, &ev, &n);
    CHECK_OR_EXIT(e == ETCD_ERR_COMPACTED && n == 0);
    CHECK_OR_EXIT(etcd_watch_revision(w) == more[2]);
    etcd_watch_close(w);
}

static void test_lease_expiry(etcd_client *c)
{
    int64_t id, ttl;
    CHECK_OK(c, etcd_lease_grant(c, 2, &id));
    CHECK_OK(c, etcd_put(c, "/f/l/k", "v", 1, id, NULL));
    etcd_watch *w;
    CHECK_OK(c, etcd_watch_open(c, "/f/l/k", 0, 0, &w));
    etcd_event *ev;
    etcd_err last;
    int64_t t0 = mono_now_ms();
    size_t got = test_watch_collect(w, 1, 15000, &ev, &last);
    /* gone within a generous bound of the TTL, and not before it */
    CHECK_OR_EXIT(got == 1 && ev[0].type == ETCD_EVENT_DELETE &&
                  strcmp(ev[0].kv.key, "/f/l/k") == 0);
    CHECK_OR_EXIT(mono_now_ms() - t0 >= 1000);
    etcd_events_free(ev, got);
    etcd_watch_close(w);
    etcd_kv kv;
    CHECK_ERR(c, ETCD_ERR_NOT_FOUND, etcd_get(c, "/f/l/k", &kv));
    CHECK_ERR(c, ETCD_ERR_NOT_FOUND, etcd_lease_keepalive(c, id, &ttl));
    CHECK_OR_EXIT(strstr(etcd_last_error(c), "not found"));

    /* kept alive, the same lease outlives its TTL */
    CHECK_OK(c, etcd_lease_grant(c, 2, &id));
    CHECK_OK(c, etcd_put(c, "/f/l/k2", "v", 1, id, NULL));
    for (int i = 0; i < 6; i++) {
        usleep(500 * 1000);
        CHECK_OK(c, etcd_lease_keepalive(c, id, &ttl));
        CHECK_OR_EXIT(ttl == 2);
    }
    CHECK_OK(c, etcd_get(c, "/f/l/k2", &kv));
    etcd_kv_free(&kv);
    CHECK_OK(c, etcd_lease_revoke(c, id));
}

static void test_failover(void)
{
    char eps[256];
    int dead_fd;
    int dead = th_dead_port(&dead_fd);
    CHECK_OR_EXIT(dead > 0);
    snprintf(eps, sizeof(eps), "http://127.0.0.1:%d, %s", dead, srv.endpoint);
    etcd_client *c = test_client(eps, 3000);
    int64_t rev;
    CHECK_OK(c, etcd_put(c, "/f/fo/k", "v", 1, 0, &rev));
    etcd_kv kv;
    CHECK_OK(c, etcd_get(c, "/f/fo/k", &kv));
    CHECK_OR_EXIT(kv.mod_revision == rev);
    etcd_kv_free(&kv);
    /* a watch fails over too, and a bare host:port is http */
    etcd_client_free(c);
    snprintf(eps, sizeof(eps), "127.0.0.1:%d,127.0.0.1:%d", dead, srv.client_port);
    c = test_client(eps, 3000);
    etcd_watch *w;
    CHECK_OK(c, etcd_watch_open(c, "/f/fo/k", 0, rev, &w));
    CHECK_OR_EXIT(test_watch_one_rev(w, 5000) == rev);
    etcd_watch_close(w);
    etcd_client_free(c);
    close(dead_fd);
}

static void test_down_at_start(void)
{
    char eps[128];
    int fd[2];
    int p0 = th_dead_port(&fd[0]), p1 = th_dead_port(&fd[1]);
    CHECK_OR_EXIT(p0 > 0 && p1 > 0);
    snprintf(eps, sizeof(eps), "http://127.0.0.1:%d,http://127.0.0.1:%d", p0, p1);
    etcd_client *c = test_client(eps, 800);
    int64_t t0 = mono_now_ms();
    CHECK_ERR(c, ETCD_ERR_UNAVAILABLE, etcd_put(c, "/k", "v", 1, 0, NULL));
    int64_t took = mono_now_ms() - t0;
    CHECK_OR_EXIT(took >= 700 && took < 5000); /* at the deadline, not a hang */
    CHECK_OR_EXIT(strstr(etcd_last_error(c), "deadline"));
    etcd_range_result r;
    CHECK_ERR(c, ETCD_ERR_UNAVAILABLE, etcd_range(c, "/k", 1, 0, &r));
    int64_t id;
    CHECK_ERR(c, ETCD_ERR_UNAVAILABLE, etcd_lease_grant(c, 5, &id));
    etcd_watch *w = NULL;
    t0 = mono_now_ms();
    CHECK_ERR(c, ETCD_ERR_UNAVAILABLE, etcd_watch_open(c, "/k", 0, 0, &w));
    CHECK_OR_EXIT(w == NULL && mono_now_ms() - t0 < 5000);
    fprintf(stderr, "watch down: %s\n", etcd_last_error(c));
    CHECK_OR_EXIT(strstr(etcd_last_error(c), "Could not connect") ||
                  strstr(etcd_last_error(c), "Couldn't connect") ||
                  strstr(etcd_last_error(c), "refused"));
    etcd_client_free(c);
    close(fd[0]);
    close(fd[1]);
}

int main(void)
{
    test_down_at_start();
    if (test_etcd_start(&srv) != 0) return 1;
    etcd_client *c = test_client(srv.endpoint, 5000);
    test_failover();
    test_lease_expiry(c);
    test_watch_survives_restart(c);
    test_watch_set_survives_restart(c);
    test_watch_while_stopped(c);
    test_compaction(c);
    etcd_client_free(c);
    test_etcd_stop(&srv);
    printf("test_etcd_failure: ok\n");
    return 0;
}
