/* test_etcd_partition: a watch on a member cut off from its peers.
 *
 * Three real members. Member 0 runs in a network namespace of its own and
 * has two veth pairs to the test's namespace: one carries the clients'
 * traffic, the other its peers'. The watch lists member 0 first. With the
 * peer link down, member 0 still answers but has no leader, and the cluster
 * goes on without it: a watch served there would go silent. The client's
 * watch requires a leader (Grpc-Metadata-Hasleader), so member 0 cancels it
 * ("no leader") and it resumes on another member from its last revision;
 * the put made after the cut arrives. Two raw gateway streams open on member
 * 0 all along show what the client builds on, and that the test can fail:
 * with the header the stream ends in the no-leader error, without it the
 * put never arrives there.
 *
 * Unary calls require a leader too. Once member 0 has lost its leader, a
 * raw serializable range there without the header serves a stale answer
 * (the put made after the cut is missing), and with it is refused at once
 * (HTTP 503, code 14, "etcdserver: no leader"). Fresh clients that list
 * member 0 first then read (linearizably), put, txn and grant a lease: each
 * is refused by member 0 before it acts, goes on to another member and
 * succeeds, the write exactly once. Without the header the read would wait
 * out the client's deadline there and the write time out as "may have been
 * applied", so succeeding at all is the proof; the times are printed.
 *
 * The namespace has no name: it is member 0's own (unshare), so it and its
 * veth pairs are gone when member 0 dies, killed with the test. Exits 77
 * (skipped) where namespaces or veth pairs cannot be made.
 */
#include "ductile/etcd.h"
#include "test_etcd.h"
#include "test_etcd_util.h"
#include "th_netns.h"

#include <curl/curl.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <unistd.h>

#define MEMBERS 3
#define SKIP TH_SKIP
#define DEADLINE_MS 15000

static test_cluster cl; /* member 0 behind its two links, 1 and 2 here */

/* the two veth pairs: peer link 10.214.<net>.1-2, client link .5-6 */
static int net;
static char peer_host[16], peer_ns[16], cli_host[16], cli_ns[16];

static void cleanup(void)
{
    test_cluster_stop(&cl);
    /* the veths went with member 0's namespace; this is for a failed start */
    th_link_del(peer_host);
    th_link_del(cli_host);
}

/* In member 0's namespace, once its links exist: sets them up, becomes m0. */
static void member0(void *arg)
{
    (void)arg;
    char peer[32], cli[32];
    snprintf(peer, sizeof(peer), "10.214.%d.2/30", net);
    snprintf(cli, sizeof(cli), "10.214.%d.6/30", net);
    if (th_sh("ip link set lo up") != 0 || th_link_up(peer_ns, peer) != 0 ||
        th_link_up(cli_ns, cli) != 0)
        _exit(1);
    test_cluster_exec(&cl, 0);
}

/* Member 0 in a new network namespace, wired to this one by two veth pairs
 * made once it exists. Returns 0, or SKIP when that cannot be done. */
static int start_member0(void)
{
    th_netns ns;
    int rc = th_netns_fork(&ns, member0, NULL);
    CHECK_OR_EXIT(rc >= 0);
    if (rc != 0) return SKIP;
    cl.pids[0] = ns.pid;
    char peer[32], cli[32];
    snprintf(peer, sizeof(peer), "10.214.%d.1/30", net);
    snprintf(cli, sizeof(cli), "10.214.%d.5/30", net);
    if (th_netns_veth(&ns, peer_host, peer_ns, peer) != 0 ||
        th_netns_veth(&ns, cli_host, cli_ns, cli) != 0) {
        th_netns_kill(&ns);
        cl.pids[0] = 0;
        return SKIP;
    }
    CHECK_OR_EXIT(th_netns_go(&ns) == 0);
    return 0;
}

/* ---- a raw gateway watch stream, read by a thread ---- */

typedef struct raw_stream {
    int hasleader;
    char url[96];
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    char body[1 << 16];
    size_t len;
    int done;
    atomic_int stop;
} raw_stream;

static size_t raw_write(void *data, size_t size, size_t n, void *user)
{
    raw_stream *r = user;
    pthread_mutex_lock(&r->mu);
    size_t k = size * n < sizeof(r->body) - 1 - r->len ? size * n : sizeof(r->body) - 1 - r->len;
    memcpy(r->body + r->len, data, k);
    r->len += k;
    r->body[r->len] = 0;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    return size * n;
}

static int raw_progress(void *user, curl_off_t a, curl_off_t b, curl_off_t c, curl_off_t d)
{
    (void)a, (void)b, (void)c, (void)d;
    return atomic_load(&((raw_stream *)user)->stop) != 0;
}

static void *raw_run(void *arg)
{
    raw_stream *r = arg;
    CURL *h = curl_easy_init();
    struct curl_slist *hdrs = curl_slist_append(NULL, "Content-Type: application/json");
    if (r->hasleader) hdrs = curl_slist_append(hdrs, "Grpc-Metadata-Hasleader: true");
    if (h && hdrs) {
        /* key "/pt/", range_end "/pt0": the prefix /pt/ */
        curl_easy_setopt(h, CURLOPT_URL, r->url);
        curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdrs);
        curl_easy_setopt(h, CURLOPT_POSTFIELDS,
                         "{\"create_request\":{\"key\":\"L3B0Lw==\",\"range_end\":\"L3B0MA==\"}}");
        curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, raw_write);
        curl_easy_setopt(h, CURLOPT_WRITEDATA, r);
        curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
        curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, raw_progress);
        curl_easy_setopt(h, CURLOPT_XFERINFODATA, r);
        curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, 120000L);
        curl_easy_perform(h);
    }
    curl_slist_free_all(hdrs);
    curl_easy_cleanup(h);
    pthread_mutex_lock(&r->mu);
    r->done = 1;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

static void raw_start(raw_stream *r, const char *endpoint, int hasleader)
{
    memset(r, 0, sizeof(*r));
    r->hasleader = hasleader;
    snprintf(r->url, sizeof(r->url), "%s/v3/watch", endpoint);
    pthread_mutex_init(&r->mu, NULL);
    CHECK_OR_EXIT(mono_cond_init(&r->cv) == 0);
    atomic_init(&r->stop, 0);
    CHECK_OR_EXIT(pthread_create(&r->thread, NULL, raw_run, r) == 0);
}

/* Waits until the body holds needle (or, with needle NULL, the stream has
 * ended), at most until end_ms; returns whether it did. */
static int raw_wait(raw_stream *r, const char *needle, int64_t end_ms)
{
    pthread_mutex_lock(&r->mu);
    for (;;) {
        int hit = needle ? strstr(r->body, needle) != NULL : r->done;
        int64_t left = end_ms - mono_now_ms();
        if (hit || (needle && r->done) || left <= 0) {
            pthread_mutex_unlock(&r->mu);
            return hit;
        }
        struct timespec ts = mono_deadline(left < 200 ? left : 200);
        pthread_cond_timedwait(&r->cv, &r->mu, &ts);
    }
}

/* Ends the stream if it is still open; afterwards the body can be read. */
static void raw_stop(raw_stream *r)
{
    atomic_store(&r->stop, 1);
    pthread_join(r->thread, NULL);
}

/* ---- raw unary gateway calls ---- */

/* POSTs body to endpoint+path, with or without the require-leader header;
 * returns the HTTP status (0: no answer) and the body in out. */
static long raw_post(const char *endpoint, const char *path, const char *body, int hasleader,
                     char *out, size_t outlen)
{
    raw_stream r; /* reuses the stream's buffer and write callback */
    memset(&r, 0, sizeof(r));
    pthread_mutex_init(&r.mu, NULL);
    char url[128];
    snprintf(url, sizeof(url), "%s%s", endpoint, path);
    CURL *h = curl_easy_init();
    struct curl_slist *hdrs = curl_slist_append(NULL, "Content-Type: application/json");
    if (hasleader) hdrs = curl_slist_append(hdrs, "Grpc-Metadata-Hasleader: true");
    long http = 0;
    if (h && hdrs) {
        curl_easy_setopt(h, CURLOPT_URL, url);
        curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdrs);
        curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, raw_write);
        curl_easy_setopt(h, CURLOPT_WRITEDATA, &r);
        curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)DEADLINE_MS);
        if (curl_easy_perform(h) == CURLE_OK) curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &http);
    }
    curl_slist_free_all(hdrs);
    curl_easy_cleanup(h);
    pthread_mutex_destroy(&r.mu);
    /* The answer, cut to the caller's buffer. */
    size_t n = strnlen(r.body, sizeof(r.body));
    if (n >= outlen) n = outlen - 1;
    memcpy(out, r.body, n);
    out[n] = '\0';
    return http;
}

/* A client whose first endpoint is member 0 (a fresh one starts there). */
static etcd_client *m0_first(const char *eps)
{
    return test_client(eps, 10000);
}

/* Member 0 has no leader now: a serializable read there is stale without
 * the header and refused with it. */
static void check_stale_read_refused(void)
{
    /* key "/pt/b", serializable: member 0 answers from its own store */
    const char *body = "{\"key\":\"L3B0L2I=\",\"serializable\":true}";
    char ans[4096];
    long http = raw_post(cl.client_url[0], "/v3/kv/range", body, 0, ans, sizeof(ans));
    fprintf(stderr, "serializable range on member 0 without Hasleader: HTTP %ld %s\n", http, ans);
    CHECK_OR_EXIT(http == 200 && !strstr(ans, "\"kvs\"")); /* stale: /pt/b is missing */
    http = raw_post(cl.client_url[0], "/v3/kv/range", body, 1, ans, sizeof(ans));
    fprintf(stderr, "serializable range on member 0 with Hasleader: HTTP %ld %s\n", http, ans);
    CHECK_OR_EXIT(http == 503 && strstr(ans, "\"code\":14") &&
                  strstr(ans, "etcdserver: no leader") && !strstr(ans, "\"kvs\""));
}

/* Reads and writes of clients that try member 0 first go to the others. */
static void check_unary_failover(const char *eps, etcd_client *m1)
{
    int64_t t0 = mono_now_ms();
    etcd_client *c = m0_first(eps);
    etcd_kv kv;
    CHECK_OK(c, etcd_get(c, "/pt/b", &kv)); /* linearizable: never stale */
    CHECK_OR_EXIT(strcmp(kv.value, "after") == 0);
    etcd_kv_free(&kv);
    etcd_client_free(c);
    int64_t t1 = mono_now_ms();
    c = m0_first(eps);
    CHECK_OK(c, etcd_put(c, "/pt/c", "via-others", 10, 0, NULL));
    etcd_client_free(c);
    int64_t t2 = mono_now_ms();
    c = m0_first(eps);
    etcd_cmp cmp = {.key = "/pt/d", .target = ETCD_CMP_VERSION, .op = ETCD_CMP_EQUAL};
    etcd_op op = {.type = ETCD_OP_PUT, .key = "/pt/d", .value = "once", .value_len = 4};
    etcd_txn_result tr;
    CHECK_OK(c, etcd_txn(c, &cmp, 1, &op, 1, NULL, 0, &tr));
    CHECK_OR_EXIT(tr.succeeded); /* create-only, and applied once */
    etcd_txn_result_free(&tr);
    etcd_client_free(c);
    c = m0_first(eps);
    int64_t lease = 0;
    CHECK_OK(c, etcd_lease_grant(c, 30, &lease));
    CHECK_OK(c, etcd_lease_revoke(c, lease));
    etcd_client_free(c);
    int64_t t3 = mono_now_ms();
    fprintf(stderr, "member 0 listed first: read %lld ms, put %lld ms, txn and lease %lld ms\n",
            (long long)(t1 - t0), (long long)(t2 - t1), (long long)(t3 - t2));
    CHECK_OK(m1, etcd_get(m1, "/pt/c", &kv));
    CHECK_OR_EXIT(strcmp(kv.value, "via-others") == 0);
    etcd_kv_free(&kv);
    CHECK_OK(m1, etcd_get(m1, "/pt/d", &kv));
    CHECK_OR_EXIT(strcmp(kv.value, "once") == 0 && kv.version == 1);
    etcd_kv_free(&kv);
}

/* ---- the test ---- */

static int64_t put(etcd_client *c, const char *key, const char *val)
{
    int64_t rev = 0;
    etcd_err e = etcd_put(c, key, val, strlen(val), 0, &rev);
    if (e == ETCD_ERR_UNAVAILABLE && strstr(etcd_last_error(c), "may have been applied")) {
        /* caught in an election: read, then decide */
        etcd_kv kv;
        e = etcd_get(c, key, &kv);
        if (e == ETCD_OK) rev = kv.mod_revision;
        if (e == ETCD_OK) etcd_kv_free(&kv);
        if (e == ETCD_ERR_NOT_FOUND) e = etcd_put(c, key, val, strlen(val), 0, &rev);
    }
    if (e != ETCD_OK) fprintf(stderr, "put %s: %s\n", key, etcd_last_error(c));
    CHECK_OR_EXIT(e == ETCD_OK);
    return rev;
}

static void expect_event(etcd_watch *w, const char *key, const char *val)
{
    etcd_event *ev;
    etcd_err last;
    size_t got = test_watch_collect(w, 1, DEADLINE_MS, &ev, &last);
    if (got != 1)
        fprintf(stderr, "watch: no event for %s: %s (%s)\n", key, etcd_strerror(last),
                etcd_watch_last_error(w));
    CHECK_OR_EXIT(got == 1);
    CHECK_OR_EXIT(strcmp(ev[0].kv.key, key) == 0 && strcmp(ev[0].kv.value, val) == 0);
    etcd_events_free(ev, got);
}

int main(void)
{
    if (geteuid() != 0) {
        fprintf(stderr, "skipped: making network namespaces needs root\n");
        return SKIP;
    }
    net = th_netns_pick_net("10.214");
    if (net < 0) {
        fprintf(stderr, "skipped: no free 10.214.x.0/24 (or no `ip`)\n");
        return SKIP;
    }
    int id = getpid() % 100000;
    snprintf(peer_host, sizeof(peer_host), "dtp%dh", id);
    snprintf(peer_ns, sizeof(peer_ns), "dtp%dn", id);
    snprintf(cli_host, sizeof(cli_host), "dtc%dh", id);
    snprintf(cli_ns, sizeof(cli_ns), "dtc%dn", id);
    atexit(cleanup);
    signal(SIGPIPE, SIG_IGN);

    /* member 0 on its own links; 1 and 2 meet it on the peer link's host end */
    CHECK_OR_EXIT(test_cluster_init(&cl, MEMBERS, "partition") == 0);
    snprintf(cl.client_url[0], sizeof(cl.client_url[0]), "http://10.214.%d.6:2379", net);
    snprintf(cl.peer_url[0], sizeof(cl.peer_url[0]), "http://10.214.%d.2:2380", net);
    for (int i = 1; i < MEMBERS; i++)
        snprintf(cl.peer_url[i], sizeof(cl.peer_url[i]), "http://10.214.%d.1:%d", net,
                 cl.peer_port[i]);
    char eps[256];
    test_cluster_endpoints(&cl, eps, sizeof(eps));

    if (start_member0() != 0) {
        fprintf(stderr, "skipped\n");
        return SKIP;
    }
    for (int i = 1; i < MEMBERS; i++)
        CHECK_OR_EXIT(test_cluster_start(&cl, i) == 0);

    /* the cluster forms, and member 0 serves linearizable reads */
    etcd_client *all = test_client(eps, 20000);
    if (etcd_put(all, "/pt/start", "x", 1, 0, NULL) != ETCD_OK) {
        fprintf(stderr, "cluster did not form: %s (logs in %s)\n", etcd_last_error(all), cl.dir);
        return 1;
    }
    etcd_client *m0 = test_client(cl.client_url[0], 20000);
    etcd_kv kv;
    CHECK_OK(m0, etcd_get(m0, "/pt/start", &kv));
    etcd_kv_free(&kv);
    etcd_client *m1 = test_client(cl.client_url[1], 20000);

    /* a fresh client starts at its first endpoint: the watch is on member 0 */
    etcd_client *c = test_client(eps, 10000);
    etcd_watch *w;
    CHECK_OK(c, etcd_watch_open(c, "/pt/", 1, 0, &w));
    raw_stream with, without;
    raw_start(&with, cl.client_url[0], 1);
    raw_start(&without, cl.client_url[0], 0);
    int64_t end = mono_now_ms() + DEADLINE_MS;
    CHECK_OR_EXIT(raw_wait(&with, "\"created\":true", end) &&
                  raw_wait(&without, "\"created\":true", end));
    put(m1, "/pt/a", "before");
    expect_event(w, "/pt/a", "before");
    end = mono_now_ms() + DEADLINE_MS;
    CHECK_OR_EXIT(raw_wait(&with, "L3B0L2E=", end) && raw_wait(&without, "L3B0L2E=", end));

    /* member 0 loses its peers; its clients' link stays up */
    fprintf(stderr, "peer link of member 0 down\n");
    CHECK_OR_EXIT(th_sh("ip link set %s down", peer_host) == 0);
    int64_t rev = put(m1, "/pt/b", "after");
    int64_t put_at = mono_now_ms();
    expect_event(w, "/pt/b", "after");
    CHECK_OR_EXIT(etcd_watch_revision(w) == rev);
    etcd_event *more;
    size_t n;
    CHECK_OR_EXIT(etcd_watch_next(w, 200, &more, &n) == ETCD_OK && n == 0); /* no duplicates */

    /* with the header, member 0 ended the stream with the no-leader error,
     * written without a newline after it */
    CHECK_OR_EXIT(raw_wait(&with, NULL, put_at + DEADLINE_MS));
    raw_stop(&with); /* ended: the body is complete */
    const char *last = strrchr(with.body, '\n');
    last = last ? last + 1 : with.body;
    fprintf(stderr, "stream with Hasleader ended with: %s\n", last);
    CHECK_OR_EXIT(strncmp(last, "{\"error\":{\"grpc_code\":14,", 25) == 0);
    CHECK_OR_EXIT(strstr(last, "\"message\":\"etcdserver: no leader\""));
    CHECK_OR_EXIT(last[strlen(last) - 1] == '}');
    /* without it, the stream stays open and the put never arrives there */
    CHECK_OR_EXIT(!raw_wait(&without, "L3B0L2I=", put_at + DEADLINE_MS));
    raw_stop(&without);
    CHECK_OR_EXIT(!strstr(without.body, "error") && !strstr(without.body, "L3B0L2I="));
    fprintf(stderr, "stream without Hasleader: open, silent for %d ms after the put\n",
            DEADLINE_MS);

    check_stale_read_refused();
    check_unary_failover(eps, m1);

    etcd_watch_close(w);
    etcd_client_free(c);
    etcd_client_free(m0);
    etcd_client_free(m1);
    etcd_client_free(all);
    cleanup();
    printf("test_etcd_partition: ok\n");
    return 0;
}
