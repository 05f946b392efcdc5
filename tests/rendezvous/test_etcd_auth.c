/* test_etcd_auth.c: user/password auth against a real etcd with auth on.
 *
 * Before auth is on, a client given credentials waits for it up to its
 * deadline and then says why (a deployment turns auth on just after etcd
 * starts, while clients may already call). The test turns auth on through
 * the gateway (root user, root role, enable), then checks that a client with the right password
 * works for every kind of call, that a wrong password, no credentials and a user without a role get
 * ETCD_ERR_AUTH, and that after an etcd restart (which forgets every simple
 * token) the client and a live watch log in again by themselves.
 */
#include "ductile/etcd.h"
#include "test_etcd.h"
#include "test_etcd_util.h"

#include <string.h>

static test_etcd srv;

/* An admin call before auth is on; must answer 200. */
static void admin(const char *path, const char *body)
{
    long code = test_etcd_post(srv.endpoint, path, body, 5000);
    if (code != 200) fprintf(stderr, "%s: HTTP %ld\n", path, code);
    CHECK_OR_EXIT(code == 200);
}

static etcd_client *client_as(const char *user, const char *password)
{
    etcd_config cfg = {
        .endpoints = srv.endpoint, .user = user, .password = password, .timeout_ms = 5000};
    return test_client_cfg(&cfg);
}

int main(void)
{
    if (test_etcd_start(&srv) != 0) return 1;
    admin("/v3/auth/user/add", "{\"name\":\"root\",\"password\":\"s3cret\"}");
    admin("/v3/auth/user/grant", "{\"user\":\"root\",\"role\":\"root\"}");
    admin("/v3/auth/user/add", "{\"name\":\"alice\",\"password\":\"apw\"}");

    etcd_config early_cfg = {
        .endpoints = srv.endpoint, .user = "root", .password = "s3cret", .timeout_ms = 1000};
    etcd_client *early = test_client_cfg(&early_cfg);
    etcd_err early_err = etcd_put(early, "/a/early", "v", 1, 0, NULL);
    CHECK(early_err == ETCD_ERR_UNAVAILABLE, "before auth is on: %s", etcd_strerror(early_err));
    CHECK(strstr(etcd_last_error(early), "authentication is not enabled") != NULL, "%s",
          etcd_last_error(early));
    etcd_client_free(early);

    admin("/v3/auth/enable", "{}");

    etcd_client *c = client_as("root", "s3cret");
    int64_t rev, id, ttl;
    CHECK_OK(c, etcd_put(c, "/a/k", "v", 1, 0, &rev));
    etcd_kv kv;
    CHECK_OK(c, etcd_get(c, "/a/k", &kv));
    CHECK_OR_EXIT(kv.mod_revision == rev);
    etcd_kv_free(&kv);
    etcd_cmp cmp = {.key = "/a/k",
                    .target = ETCD_CMP_VALUE,
                    .op = ETCD_CMP_EQUAL,
                    .value = "v",
                    .value_len = 1};
    etcd_op op = {.type = ETCD_OP_PUT, .key = "/a/k", .value = "w", .value_len = 1};
    etcd_txn_result t;
    CHECK_OK(c, etcd_txn(c, &cmp, 1, &op, 1, NULL, 0, &t));
    CHECK_OR_EXIT(t.succeeded);
    etcd_txn_result_free(&t);
    CHECK_OK(c, etcd_lease_grant(c, 30, &id));
    CHECK_OK(c, etcd_lease_keepalive(c, id, &ttl));
    CHECK_OK(c, etcd_lease_revoke(c, id));
    etcd_watch *w;
    CHECK_OK(c, etcd_watch_open(c, "/a/", 1, 0, &w));

    /* wrong password, no credentials, a user with no role */
    etcd_client *bad = client_as("root", "wrong");
    CHECK_ERR(bad, ETCD_ERR_AUTH, etcd_get(bad, "/a/k", &kv));
    CHECK_OR_EXIT(strstr(etcd_last_error(bad), "authentication failed"));
    etcd_watch *bw = NULL;
    CHECK_ERR(bad, ETCD_ERR_AUTH, etcd_watch_open(bad, "/a/", 1, 0, &bw));
    etcd_client_free(bad);
    etcd_client *anon = test_client(srv.endpoint, 5000);
    CHECK_ERR(anon, ETCD_ERR_AUTH, etcd_put(anon, "/a/k", "x", 1, 0, NULL));
    CHECK_ERR(anon, ETCD_ERR_AUTH, etcd_watch_open(anon, "/a/", 1, 0, &bw));
    etcd_client_free(anon);
    etcd_client *alice = client_as("alice", "apw");
    CHECK_ERR(alice, ETCD_ERR_AUTH, etcd_put(alice, "/a/k", "x", 1, 0, NULL));
    CHECK_OR_EXIT(strstr(etcd_last_error(alice), "permission denied"));
    etcd_client_free(alice);

    /* a restart forgets every token: the client logs in again, once */
    test_etcd_kill(&srv);
    CHECK_OR_EXIT(test_etcd_restart(&srv) == 0);
    CHECK_OK(c, etcd_put(c, "/a/after", "1", 1, 0, &rev));
    CHECK_OK(c, etcd_get(c, "/a/after", &kv));
    etcd_kv_free(&kv);
    /* and so does the watch, with no event lost */
    etcd_event *ev;
    etcd_err last;
    size_t got = test_watch_collect(w, 1, 10000, &ev, &last);
    if (got != 1) fprintf(stderr, "watch: %s\n", etcd_watch_last_error(w));
    CHECK_OR_EXIT(got == 1 && strcmp(ev[0].kv.key, "/a/after") == 0 &&
                  ev[0].kv.mod_revision == rev);
    etcd_events_free(ev, got);
    CHECK_OK(c, etcd_put(c, "/a/later", "2", 1, 0, NULL));
    got = test_watch_collect(w, 1, 5000, &ev, &last);
    CHECK_OR_EXIT(got == 1 && strcmp(ev[0].kv.key, "/a/later") == 0);
    etcd_events_free(ev, got);
    etcd_watch_close(w);

    /* configuration errors: a user without a password */
    etcd_config cfg = {.endpoints = srv.endpoint, .user = "root"};
    char err[256];
    CHECK_OR_EXIT(etcd_client_new_err(&cfg, &bad, err, sizeof(err)) == ETCD_ERR_ARG && bad == NULL);
    CHECK_OR_EXIT(strstr(err, "password"));

    etcd_client_free(c);
    test_etcd_stop(&srv);
    printf("test_etcd_auth: ok\n");
    return 0;
}
