/* test_etcd.c: start and stop a private etcd for tests (see test_etcd.h).
 *
 * Readiness is checked by asking the gateway for a range over /, the same
 * path the client uses, with a deadline of 15 s.
 */
#include "test_etcd.h"

#include "ductile/clock.h"

#include <curl/curl.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static size_t discard(void *p, size_t s, size_t n, void *u)
{
    (void)p;
    (void)u;
    return s * n;
}

long test_etcd_post(const char *endpoint, const char *path, const char *body, long timeout_ms)
{
    CURL *h = curl_easy_init();
    if (!h) return -1;
    char url[160];
    snprintf(url, sizeof(url), "%s%s", endpoint, path);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, timeout_ms);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, discard);
    long code = -1;
    if (curl_easy_perform(h) != CURLE_OK ||
        curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code) != CURLE_OK)
        code = -1;
    curl_easy_cleanup(h);
    return code;
}

static int answers(const test_etcd *e)
{
    long code = test_etcd_post(e->endpoint, "/v3/kv/range", "{\"key\":\"Lw==\"}", 1000);
    return code == 200 || code == 400 || code == 401; /* 400/401: auth is on */
}

static int spawn(test_etcd *e)
{
    char client[64], peer[64], cluster[96];
    snprintf(client, sizeof(client), "http://127.0.0.1:%d", e->client_port);
    snprintf(peer, sizeof(peer), "http://127.0.0.1:%d", e->peer_port);
    snprintf(cluster, sizeof(cluster), "t=%s", peer);
    /* one flag and its value a line */
    /* clang-format off */
    char *argv[] = {"etcd", "--name", "t",
                    "--data-dir", e->data_dir,
                    "--listen-client-urls", client,
                    "--advertise-client-urls", client,
                    "--listen-peer-urls", peer,
                    "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", cluster,
                    "--initial-cluster-state", "new",
                    "--logger", "zap", "--log-level", "warn", NULL};
    /* clang-format on */
    th_spawn_opts o = {.log = e->log_path, .die_with_parent = 1};
    e->pid = th_spawn(argv, &o);
    if (e->pid < 0) {
        e->pid = 0;
        return -1;
    }
    double deadline = mono_now_s() + 15.0;
    while (mono_now_s() < deadline) {
        if (th_wait(&e->pid, 0, NULL) != 0) {
            e->pid = 0;
            fprintf(stderr, "test_etcd: etcd exited at start (see %s)\n", e->log_path);
            return -1;
        }
        if (answers(e)) return 0;
        th_sleep_ms(50);
    }
    fprintf(stderr, "test_etcd: etcd did not answer within 15 s (see %s)\n", e->log_path);
    test_etcd_kill(e);
    return -1;
}

int test_etcd_start(test_etcd *e)
{
    memset(e, 0, sizeof(*e));
    curl_global_init(CURL_GLOBAL_DEFAULT);
    const char *tmp = getenv("TMPDIR");
    snprintf(e->data_dir, sizeof(e->data_dir), "%s/ductile-etcd-XXXXXX", tmp ? tmp : "/tmp");
    if (!mkdtemp(e->data_dir)) {
        fprintf(stderr, "test_etcd: mkdtemp: %s\n", strerror(errno));
        return -1;
    }
    snprintf(e->log_path, sizeof(e->log_path), "%s.log", e->data_dir);
    for (int attempt = 0; attempt < 5; attempt++) {
        e->client_port = th_free_port();
        e->peer_port = th_free_port();
        if (e->client_port <= 0 || e->peer_port <= 0 || e->client_port == e->peer_port) continue;
        snprintf(e->endpoint, sizeof(e->endpoint), "http://127.0.0.1:%d", e->client_port);
        if (spawn(e) == 0) return 0;
    }
    test_etcd_stop(e);
    return -1;
}

const char *test_etcd_shared_or_start(test_etcd *e)
{
    const char *shared = getenv("DUCTILE_TEST_ETCD");
    if (shared) {
        memset(e, 0, sizeof(*e));
        return shared;
    }
    return test_etcd_start(e) == 0 ? e->endpoint : NULL;
}

void test_etcd_kill(test_etcd *e)
{
    th_kill(&e->pid);
}

int test_etcd_restart(test_etcd *e)
{
    test_etcd_kill(e);
    return spawn(e);
}

void test_etcd_stop(test_etcd *e)
{
    th_stop(&e->pid, 5000);
    if (e->data_dir[0]) {
        if (th_sh("rm -rf '%s' '%s'", e->data_dir, e->log_path) != 0)
            fprintf(stderr, "test_etcd: could not remove %s\n", e->data_dir);
        e->data_dir[0] = 0;
    }
}

/* ---- a cluster of real etcd members ---- */

int test_cluster_init(test_cluster *c, int n, const char *name)
{
    memset(c, 0, sizeof(*c));
    if (n < 1 || n > TEST_CLUSTER_MAX) return -1;
    c->n = n;
    const char *tmp = getenv("TMPDIR");
    snprintf(c->dir, sizeof(c->dir), "%s/ductile-%s-XXXXXX", tmp ? tmp : "/tmp", name);
    if (!mkdtemp(c->dir)) {
        fprintf(stderr, "test_cluster: mkdtemp: %s\n", strerror(errno));
        c->dir[0] = 0;
        return -1;
    }
    for (int i = 0; i < n; i++) {
        c->client_port[i] = th_free_port();
        c->peer_port[i] = th_free_port();
        if (c->client_port[i] <= 0 || c->peer_port[i] <= 0) {
            fprintf(stderr, "test_cluster: no free port\n");
            return -1;
        }
        snprintf(c->client_url[i], sizeof(c->client_url[i]), "http://127.0.0.1:%d",
                 c->client_port[i]);
        snprintf(c->peer_url[i], sizeof(c->peer_url[i]), "http://127.0.0.1:%d", c->peer_port[i]);
    }
    return 0;
}

void test_cluster_endpoints(const test_cluster *c, char *buf, size_t len)
{
    size_t used = 0;
    buf[0] = 0;
    for (int i = 0; i < c->n && used < len; i++)
        used += (size_t)snprintf(buf + used, len - used, "%s%s", i ? "," : "", c->client_url[i]);
}

/* Member i's command line, and the strings it points into. */
typedef struct member_cmd {
    char name[16], data[300], log[300], cluster[TEST_CLUSTER_MAX * 80];
    char *argv[32];
} member_cmd;

static void member_cmd_init(member_cmd *m, const test_cluster *c, int i)
{
    snprintf(m->name, sizeof(m->name), "m%d", i);
    snprintf(m->data, sizeof(m->data), "%s/%s", c->dir, m->name);
    snprintf(m->log, sizeof(m->log), "%s/%s.log", c->dir, m->name);
    m->cluster[0] = 0;
    size_t used = 0;
    for (int k = 0; k < c->n; k++)
        used += (size_t)snprintf(m->cluster + used, sizeof(m->cluster) - used, "%sm%d=%s",
                                 k ? "," : "", k, c->peer_url[k]);
    /* one flag and its value a line */
    /* clang-format off */
    char *argv[] = {"etcd", "--name", m->name,
                    "--data-dir", m->data,
                    "--listen-client-urls", (char *)c->client_url[i],
                    "--advertise-client-urls", (char *)c->client_url[i],
                    "--listen-peer-urls", (char *)c->peer_url[i],
                    "--initial-advertise-peer-urls", (char *)c->peer_url[i],
                    "--initial-cluster", m->cluster,
                    "--initial-cluster-state", "new",
                    "--initial-cluster-token", (char *)c->dir,
                    "--heartbeat-interval", "50", "--election-timeout", "500",
                    "--logger", "zap", "--log-level", "error", NULL};
    /* clang-format on */
    _Static_assert(sizeof(argv) <= sizeof(m->argv), "member_cmd.argv is too small");
    memcpy(m->argv, argv, sizeof(argv));
}

void test_cluster_exec(const test_cluster *c, int i)
{
    member_cmd m;
    member_cmd_init(&m, c, i);
    if (th_redirect(m.log) != 0) _exit(127);
    execvp(m.argv[0], m.argv);
    _exit(127);
}

int test_cluster_start(test_cluster *c, int i)
{
    member_cmd m;
    member_cmd_init(&m, c, i);
    th_spawn_opts o = {.log = m.log, .die_with_parent = 1};
    pid_t pid = th_spawn(m.argv, &o);
    if (pid < 0) return -1;
    c->pids[i] = pid;
    return 0;
}

void test_cluster_kill(test_cluster *c, int i)
{
    th_kill(&c->pids[i]);
}

void test_cluster_stop(test_cluster *c)
{
    for (int i = 0; i < c->n; i++)
        test_cluster_kill(c, i);
    if (c->dir[0]) {
        if (th_sh("rm -rf '%s'", c->dir) != 0)
            fprintf(stderr, "test_cluster: could not remove %s\n", c->dir);
        c->dir[0] = 0;
    }
}
