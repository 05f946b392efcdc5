/* standalone.c: a private etcd for one-machine runs (--standalone).
 *
 * Debian's etcd on two free loopback ports with a fresh mkdtemp data dir. It
 * dies with the agent (PR_SET_PDEATHSIG) even when the agent is killed, and
 * agent_standalone_stop() stops it and removes the dir on every clean exit.
 * Readiness is a read through the rendezvous library's own etcd client
 * (etcd.h), with a deadline: a served read means it is up.
 */
#include "standalone.h"

#include "ductile/clock.h"
#include "ductile/etcd.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define AGENT_STANDALONE_START_S 20.0
/* One readiness probe: a fresh etcd answers in milliseconds. */
#define AGENT_STANDALONE_PROBE_MS 1000

static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof(a);
    int port = -1;
    if (bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    close(fd);
    return port;
}

/* 1 when etcd at endpoint serves a read within timeout_ms (a missing key is
 * an answer too); 0 while it cannot be reached or is not ready to serve. */
static int answers(const char *endpoint, int timeout_ms)
{
    etcd_config cfg = {.endpoints = endpoint, .timeout_ms = timeout_ms};
    etcd_client *c = NULL;
    if (etcd_client_new(&cfg, &c) != ETCD_OK) return 0;
    etcd_client_set_name(c, "standalone"); /* not counted as the rendezvous' failpoints */
    etcd_kv kv;
    memset(&kv, 0, sizeof(kv));
    etcd_err err = etcd_get(c, "/", &kv);
    etcd_kv_free(&kv);
    etcd_client_free(c);
    return err == ETCD_OK || err == ETCD_ERR_NOT_FOUND;
}

static int spawn(agent_standalone *s, int client_port, int peer_port, char *msg, size_t msglen)
{
    char client[64], peer[64], cluster[96], data[300], log[300];
    snprintf(client, sizeof(client), "http://127.0.0.1:%d", client_port);
    snprintf(peer, sizeof(peer), "http://127.0.0.1:%d", peer_port);
    snprintf(cluster, sizeof(cluster), "standalone=%s", peer);
    snprintf(data, sizeof(data), "%s/data", s->dir);
    snprintf(log, sizeof(log), "%s/etcd.log", s->dir);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        snprintf(msg, msglen, "fork: %s", strerror(errno));
        return -1;
    }
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) _exit(127);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        setpgid(0, 0); /* a Ctrl-C at the terminal goes to the agent, not to etcd */
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0600);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        execl("/usr/bin/etcd", "etcd", "--name", "standalone", "--data-dir", data,
              "--listen-client-urls", client, "--advertise-client-urls", client,
              "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
              "--initial-cluster", cluster, "--initial-cluster-state", "new", "--logger", "zap",
              "--log-level", "warn", (char *)NULL);
        _exit(127);
    }
    s->pid = pid;
    snprintf(s->endpoint, sizeof(s->endpoint), "%s", client);
    double deadline = mono_now_s() + AGENT_STANDALONE_START_S;
    while (mono_now_s() < deadline) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            s->pid = 0;
            snprintf(msg, msglen, "private etcd exited at start (see %s)", log);
            return -1;
        }
        if (answers(s->endpoint, AGENT_STANDALONE_PROBE_MS)) return 0;
        usleep(50 * 1000);
    }
    snprintf(msg, msglen, "private etcd did not answer within %.0f s", AGENT_STANDALONE_START_S);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    s->pid = 0;
    return -1;
}

int agent_standalone_start(agent_standalone *s, char *msg, size_t msglen)
{
    memset(s, 0, sizeof(*s));
    if (access("/usr/bin/etcd", X_OK) != 0) {
        snprintf(msg, msglen, "--standalone needs /usr/bin/etcd (Debian package etcd-server)");
        return -1;
    }
    const char *tmp = getenv("TMPDIR");
    snprintf(s->dir, sizeof(s->dir), "%s/ductile-standalone-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(s->dir)) {
        snprintf(msg, msglen, "mkdtemp %s: %s", s->dir, strerror(errno));
        s->dir[0] = 0;
        return -1;
    }
    /* A port found free can be taken before etcd binds it: try a few pairs. */
    for (int attempt = 0; attempt < 3; attempt++) {
        int cp = free_port(), pp = free_port();
        if (cp <= 0 || pp <= 0 || cp == pp) continue;
        if (spawn(s, cp, pp, msg, msglen) == 0) return 0;
    }
    agent_standalone_stop(s);
    return -1;
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    remove(path);
    return 0;
}

void agent_standalone_stop(agent_standalone *s)
{
    if (s->pid > 0) {
        kill(s->pid, SIGTERM);
        double deadline = mono_now_s() + 5.0;
        int st;
        while (waitpid(s->pid, &st, WNOHANG) == 0 && mono_now_s() < deadline)
            usleep(20 * 1000);
        kill(s->pid, SIGKILL);
        waitpid(s->pid, NULL, 0);
        s->pid = 0;
    }
    if (s->dir[0]) {
        nftw(s->dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
        s->dir[0] = 0;
    }
}
