/* test_etcd_failpoint: failpoints in the etcd client, against a real etcd.
 *
 * Client "t" runs under a spec that breaks some of its calls; what etcd
 * holds afterwards is read through client "u", which has no failpoints.
 * "ambiguous" calls reach etcd and are applied, yet the caller hears
 * "unavailable, may have been applied"; "unavailable" calls never reach it.
 * Calls are counted per client name and operation (etcd_get is a range),
 * and a client that is not named is "client".
 */
#include "ductile/etcd.h"
#include "ductile/failpoint.h"
#include "test_etcd.h"
#include "test_etcd_util.h"

#define SPEC                                                                                       \
    "etcd.t.put=2:ambiguous;etcd.t.txn=1:unavailable;etcd.t.range=3-4:unavailable;"                \
    "etcd.t.delete=1:ambiguous;etcd.t.watch=1:unavailable;etcd.t.lease_grant=1:unavailable;"       \
    "etcd.t.lease_revoke=1:ambiguous;etcd.client.put=1:unavailable"

static test_etcd srv;

static void stop_etcd(void)
{
    test_etcd_stop(&srv);
}

static void expect_unsent(etcd_client *c)
{
    CHECK_OR_EXIT(strstr(etcd_last_error(c), "failpoint: unavailable"));
}

static void expect_ambiguous(etcd_client *c)
{
    CHECK_OR_EXIT(strstr(etcd_last_error(c), "may have been applied (failpoint)"));
}

static void expect_value(etcd_client *c, const char *key, const char *value)
{
    etcd_kv kv;
    if (!value) {
        CHECK_ERR(c, ETCD_ERR_NOT_FOUND, etcd_get(c, key, &kv));
        return;
    }
    CHECK_OK(c, etcd_get(c, key, &kv));
    CHECK_OR_EXIT(strcmp(kv.value, value) == 0);
    etcd_kv_free(&kv);
}

/* The calls "t" makes below, made by a client of another name: none fails. */
static void same_calls(etcd_client *c)
{
    CHECK_OK(c, etcd_put(c, "/fp/u1", "1", 1, 0, NULL));
    CHECK_OK(c, etcd_put(c, "/fp/u2", "2", 1, 0, NULL));
    etcd_op put = {.type = ETCD_OP_PUT, .key = "/fp/u3", .value = "3", .value_len = 1};
    CHECK_OK(c, etcd_txn(c, NULL, 0, &put, 1, NULL, 0, NULL));
    for (int i = 0; i < 5; i++)
        expect_value(c, "/fp/u1", "1");
    CHECK_OK(c, etcd_delete(c, "/fp/u1", 0, NULL));
    etcd_watch *w;
    CHECK_OK(c, etcd_watch_open(c, "/fp/u", 1, 0, &w));
    etcd_watch_close(w);
    int64_t id;
    CHECK_OK(c, etcd_lease_grant(c, 30, &id));
    CHECK_OK(c, etcd_lease_revoke(c, id));
}

int main(void)
{
    /* before the first failpoint() call: the table is read once */
    setenv(FAILPOINT_ENV, SPEC, 1);
    char msg[256];
    CHECK_OR_EXIT(failpoint_check_env(msg, sizeof(msg)) == 0);
    if (test_etcd_start(&srv) != 0) return 1;
    atexit(stop_etcd);
    etcd_client *t = test_client(srv.endpoint, 5000);
    etcd_client *u = test_client(srv.endpoint, 5000);
    etcd_client *d = test_client(srv.endpoint, 5000);
    etcd_client_set_name(t, "t");
    etcd_client_set_name(u, "u");
    same_calls(u);

    /* unnamed is "client": its first put fails unsent, the second works */
    CHECK_ERR(d, ETCD_ERR_UNAVAILABLE, etcd_put(d, "/fp/d", "d", 1, 0, NULL));
    expect_unsent(d);
    expect_value(u, "/fp/d", NULL);
    CHECK_OK(d, etcd_put(d, "/fp/d", "d", 1, 0, NULL));
    expect_value(u, "/fp/d", "d");

    /* put 2 is ambiguous: reported lost, yet applied */
    CHECK_OK(t, etcd_put(t, "/fp/a", "a", 1, 0, NULL));
    CHECK_ERR(t, ETCD_ERR_UNAVAILABLE, etcd_put(t, "/fp/b", "b", 1, 0, NULL));
    expect_ambiguous(t);
    expect_value(u, "/fp/b", "b");
    CHECK_OK(t, etcd_put(t, "/fp/c", "c", 1, 0, NULL));

    /* txn 1 is unavailable: not applied; txn 2 is */
    etcd_op put = {.type = ETCD_OP_PUT, .key = "/fp/txn", .value = "x", .value_len = 1};
    CHECK_ERR(t, ETCD_ERR_UNAVAILABLE, etcd_txn(t, NULL, 0, &put, 1, NULL, 0, NULL));
    expect_unsent(t);
    expect_value(u, "/fp/txn", NULL);
    CHECK_OK(t, etcd_txn(t, NULL, 0, &put, 1, NULL, 0, NULL));
    expect_value(u, "/fp/txn", "x");

    /* ranges 3 and 4 fail (etcd_get counts as one), 1, 2 and 5 work */
    etcd_range_result rr;
    etcd_kv kv;
    CHECK_OK(t, etcd_range(t, "/fp/", 1, 0, &rr));
    etcd_range_result_free(&rr);
    expect_value(t, "/fp/a", "a");
    CHECK_ERR(t, ETCD_ERR_UNAVAILABLE, etcd_get(t, "/fp/a", &kv));
    expect_unsent(t);
    CHECK_ERR(t, ETCD_ERR_UNAVAILABLE, etcd_range(t, "/fp/", 1, 0, &rr));
    expect_unsent(t);
    CHECK_OK(t, etcd_range(t, "/fp/", 1, 0, &rr));
    CHECK_OR_EXIT(rr.n == 7); /* a b c d txn u2 u3 */
    etcd_range_result_free(&rr);

    /* delete 1 is ambiguous: the key is gone all the same */
    CHECK_ERR(t, ETCD_ERR_UNAVAILABLE, etcd_delete(t, "/fp/a", 0, NULL));
    expect_ambiguous(t);
    expect_value(u, "/fp/a", NULL);

    /* watch 1 fails unsent; watch 2, of the same client, works */
    etcd_watch *w = NULL;
    CHECK_ERR(t, ETCD_ERR_UNAVAILABLE, etcd_watch_open(t, "/fp/w", 0, 0, &w));
    expect_unsent(t);
    CHECK_OR_EXIT(w == NULL);
    CHECK_OK(t, etcd_watch_open(t, "/fp/w", 0, 0, &w));
    CHECK_OK(u, etcd_put(u, "/fp/w", "w", 1, 0, NULL));
    etcd_event *ev;
    etcd_err last;
    size_t got = test_watch_collect(w, 1, 10000, &ev, &last);
    CHECK_OR_EXIT(got == 1 && strcmp(ev[0].kv.value, "w") == 0);
    etcd_events_free(ev, got);
    etcd_watch_close(w);

    /* grant 1 fails unsent; revoke 1 is ambiguous: the lease is gone */
    int64_t id = 0, ttl;
    CHECK_ERR(t, ETCD_ERR_UNAVAILABLE, etcd_lease_grant(t, 30, &id));
    expect_unsent(t);
    CHECK_OK(t, etcd_lease_grant(t, 30, &id));
    CHECK_OK(u, etcd_lease_keepalive(u, id, &ttl));
    CHECK_ERR(t, ETCD_ERR_UNAVAILABLE, etcd_lease_revoke(t, id));
    expect_ambiguous(t);
    CHECK_ERR(u, ETCD_ERR_NOT_FOUND, etcd_lease_keepalive(u, id, &ttl));

    etcd_client_free(t);
    etcd_client_free(u);
    etcd_client_free(d);
    printf("test_etcd_failpoint: ok\n");
    return 0;
}
