/* rdzv_sentinel.c: a member's death seen when its agent's socket closes.
 *
 * A pod that dies takes its agent with it, and the kernel closes the
 * agent's sockets. Each member of a round holds a connection to the
 * liveness probe (probe.c) of the next RDZV_RING_PEERS members in rank
 * order, around the ring: every member is watched by that many others,
 * and the job holds n * RDZV_RING_PEERS connections, whatever its size.
 * Only a connection that answered (the member's node id and incarnation)
 * is watched: a refusal at an address where the member was never seen
 * proves nothing (a loopback address registered from another network
 * namespace is refused by this one's kernel), so such a member is left to
 * its lease and to its peers' workers. When a held connection ends, the
 * member is checked at once the way a
 * worker's error exit is (rdzv_check_members): its registration is
 * re-read and its probe asked afresh, and only a member whose agent is
 * gone (refused: nobody holds the port; or the registration is another
 * incarnation's or missing) has its lease revoked, so every agent sees it
 * lost now rather than a lease TTL later. A connection that merely goes
 * quiet (a stopped agent, a partition) never ends by itself: such a member
 * stays until its lease does, and a live member is never cut off by a
 * guess. A peer lost this way is a membership change, never a failure.
 *
 * The thread is the handle's; rdzv_emit points it at each round this node
 * is frozen into and clears it when that round ends. It is stopped with
 * the handle's other threads and freed with the handle, so a late
 * rdzv_sentinel_watch (a task's thread still holding the handle) only
 * writes to a sentinel that no longer acts.
 */
#include "rdzv_internal.h"

#include "ductile/clock.h"
#include "ductile/failpoint.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#define SENTINEL_RETRY_MS 1000 /* after a member's probe could not be reached */
/* How long the sentinel waits for the driver's snapshot to bring a member's
 * registration before it reads the key itself: the snapshot comes a round
 * trip after the record on a quiet etcd, seconds after it when a thousand
 * agents take that step at once, and reading then only adds to etcd's
 * load. Meanwhile a death is seen by the paths the sentinel only hastens
 * (the lease, the peers' workers). */
#define SENTINEL_REG_WAIT_MS 5000

typedef struct peer {
    char node[RDZV_NODE_ID_MAX + 1];
    int fd;           /* the held connection, -1 when none */
    int done;         /* nothing more to do for it in this round */
    int64_t retry_at; /* next connection attempt (mono ms) */
    int wait_reg;     /* the first attempt waits for the snapshot's registration */
    int has_reg;      /* reg came with the driver's snapshot: no read of our own */
    rdzv_reg reg;
} peer;

struct rdzv_sentinel {
    pthread_t th;
    int wakefd;
    pthread_mutex_t mu;
    int stop;
    unsigned gen; /* bumped by every rdzv_sentinel_watch */
    int holding;  /* connections held now (rdzv_watching) */
    int n;
    char nodes[RDZV_RING_PEERS][RDZV_NODE_ID_MAX + 1];
    /* each one's registration, from the driver's snapshot of the round */
    int have[RDZV_RING_PEERS];
    rdzv_reg regs[RDZV_RING_PEERS];
    int read_own; /* failpoint rdzv.sentinel=read */
};

static void wake(rdzv_sentinel *s)
{
    uint64_t one = 1;
    ssize_t w = write(s->wakefd, &one, sizeof(one));
    (void)w;
}

void rdzv_sentinel_watch(rdzv_sentinel *s, const rdzv_round *round)
{
    if (!s) return;
    const char *fp = round ? failpoint("rdzv.sentinel") : NULL;
    if (fp && strcmp(fp, "off") == 0) round = NULL;
    pthread_mutex_lock(&s->mu);
    /* "read": the snapshot's registrations are not taken (the path where
     * the sentinel reads each one itself) */
    s->read_own = fp && strcmp(fp, "read") == 0;
    s->n = 0;
    int next[RDZV_RING_PEERS], k = 0;
    if (round && round->my_rank >= 0) k = rdzv_ring_next(round->my_rank, round->nmembers, next);
    for (int i = 0; i < k; i++) {
        const rdzv_member *m = &round->members[next[i]];
        if (m->node_id) {
            s->have[s->n] = 0;
            snprintf(s->nodes[s->n++], RDZV_NODE_ID_MAX + 1, "%s", m->node_id);
        }
    }
    s->gen++;
    pthread_mutex_unlock(&s->mu);
    wake(s);
}

void rdzv_sentinel_reg(rdzv_sentinel *s, const char *node, const etcd_kv *kv)
{
    if (!s || !kv) return;
    int woke = 0;
    pthread_mutex_lock(&s->mu);
    for (int i = 0; !s->read_own && i < s->n; i++)
        if (!s->have[i] && strcmp(s->nodes[i], node) == 0) {
            rdzv_reg_parse(kv, &s->regs[i]);
            s->have[i] = woke = 1;
        }
    pthread_mutex_unlock(&s->mu);
    if (woke) wake(s);
}

/* The member's connection ended, or its probe refused: check it as a
 * worker's error exit is checked, and say what came of it. */
static void suspect(rdzv *r, peer *p, const char *how)
{
    char why[RDZV_MSG_MAX] = "";
    pthread_mutex_lock(&r->mu);
    int closed = r->closed;
    pthread_mutex_unlock(&r->mu);
    p->done = 1;
    if (closed) return;
    int revoked = 0;
    int gone = rdzv_check_member(r, p->node, mono_now_ms() + RDZV_PROBE_TIMEOUT_MS, &revoked, why,
                                 sizeof(why));
    if (gone && revoked) /* a node that left has no lease left to revoke: its leave says so */
        dlog_info(&r->log, "member_gone", "member %s is gone (%s; %s): its lease is revoked",
                  p->node, how, why);
    else if (gone)
        dlog_debug(&r->log, NULL, "member %s is gone (%s; %s)", p->node, how, why);
    else
        dlog_debug(&r->log, NULL, "member %s: %s, but it is not gone (%s): left to its lease",
                   p->node, how, why);
}

/* The member's registration: the one the driver's snapshot brought, the
 * first time; else (waited long enough for it, or a retry) read now.
 * 1 with *reg, 0 for nothing more to do, -1 to retry later. */
static int peer_reg(rdzv *r, peer *p, rdzv_reg *reg)
{
    if (p->has_reg) {
        *reg = p->reg;
        p->has_reg = 0; /* a retry reads afresh */
        return 1;
    }
    char key[RDZV_KEY_MAX];
    etcd_kv kv;
    if (rdzv_key(key, sizeof(key), r->cfg.job, "nodes/%s", p->node) != 0) return 0;
    pthread_mutex_lock(&r->rep_mu);
    etcd_err e = etcd_get(r->rep, key, &kv);
    pthread_mutex_unlock(&r->rep_mu);
    if (e == ETCD_ERR_NOT_FOUND) return 0; /* its key's end ends the round already */
    if (e != ETCD_OK) return -1;
    rdzv_reg_parse(&kv, reg);
    etcd_kv_free(&kv);
    return 1;
}

/* One attempt to hold p's probe connection. */
static void connect_peer(rdzv *r, peer *p)
{
    char why[RDZV_MSG_MAX] = "";
    rdzv_reg reg;
    p->wait_reg = 0;
    int got = peer_reg(r, p, &reg);
    if (got == 0) {
        p->done = 1;
        return;
    }
    if (got < 0) {
        p->retry_at = mono_now_ms() + SENTINEL_RETRY_MS;
        return;
    }
    if (reg.probe <= 0) { /* no probe: its lease is the only witness */
        p->done = 1;
        return;
    }
    rdzv_probe_verdict v;
    p->fd = rdzv_probe_hold(reg.addr, reg.probe, p->node, reg.inc, RDZV_PROBE_TIMEOUT_MS, &v, why,
                            sizeof(why));
    if (p->fd >= 0) {
        pthread_mutex_lock(&r->sentinel->mu);
        r->sentinel->holding++;
        pthread_mutex_unlock(&r->sentinel->mu);
        dlog_debug(&r->log, NULL, "watching member %s: %s", p->node, why);
    } else if (v == RDZV_PROBE_DEAD) {
        /* Never reached: a refusal proves nothing about an address this node
         * has not seen the member answer at (a loopback address registered
         * in another network namespace is refused by this one's kernel).
         * Only a connection that answered and then closed is judged. */
        dlog_debug(&r->log, NULL, "member %s not watched: %s", p->node, why);
        p->done = 1;
    } else {
        p->retry_at = mono_now_ms() + SENTINEL_RETRY_MS;
    }
}

/* 1 when a held connection has ended (EOF, reset); bytes are dropped. */
static int ended(int fd)
{
    char buf[256];
    for (;;) {
        ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (n > 0) continue;
        if (n == 0) return 1;
        if (errno == EINTR) continue;
        return errno != EAGAIN && errno != EWOULDBLOCK;
    }
}

static void drop_all(peer *ps, int n)
{
    for (int i = 0; i < n; i++)
        if (ps[i].fd >= 0) close(ps[i].fd);
}

static void *sentinel_main(void *arg)
{
    rdzv *r = arg;
    rdzv_sentinel *s = r->sentinel;
    pthread_setname_np(pthread_self(), "rdzv-sentinel");
    peer ps[RDZV_RING_PEERS];
    int np = 0;
    unsigned seen = 0;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        int stop = s->stop;
        if (!stop && s->gen != seen) {
            drop_all(ps, np);
            s->holding = 0;
            np = s->n;
            /* the first attempt waits a moment for the snapshot's registration */
            int64_t wait_reg = mono_now_ms() + SENTINEL_REG_WAIT_MS;
            for (int i = 0; i < np; i++)
                ps[i] = (peer){.fd = -1, .retry_at = wait_reg, .wait_reg = 1};
            for (int i = 0; i < np; i++)
                memcpy(ps[i].node, s->nodes[i], sizeof(ps[i].node));
            seen = s->gen;
        }
        for (int i = 0; !stop && i < np; i++)
            if (ps[i].wait_reg && s->have[i]) {
                ps[i].reg = s->regs[i];
                ps[i].has_reg = 1;
                ps[i].wait_reg = 0;
                ps[i].retry_at = 0;
            }
        pthread_mutex_unlock(&s->mu);
        if (stop) break;

        struct pollfd fds[1 + RDZV_RING_PEERS];
        int who[RDZV_RING_PEERS], nf = 1;
        int64_t next = 0;
        fds[0] = (struct pollfd){.fd = s->wakefd, .events = POLLIN};
        for (int i = 0; i < np; i++) {
            peer *p = &ps[i];
            if (!p->done && p->fd < 0 && p->retry_at <= mono_now_ms()) connect_peer(r, p);
            if (p->fd >= 0) {
                fds[nf] = (struct pollfd){.fd = p->fd, .events = POLLIN};
                who[nf - 1] = i;
                nf++;
            } else if (!p->done && (next == 0 || p->retry_at < next)) {
                next = p->retry_at;
            }
        }
        int timeout = -1;
        if (next) {
            int64_t left = next - mono_now_ms();
            timeout = left < 0 ? 0 : left > 60000 ? 60000 : (int)left;
        }
        if (poll(fds, (nfds_t)nf, timeout) < 0) {
            if (errno == EINTR) continue;
            break;
        }
        if (fds[0].revents) {
            uint64_t v;
            ssize_t rd = read(s->wakefd, &v, sizeof(v));
            (void)rd;
        }
        for (int k = 1; k < nf; k++) {
            peer *p = &ps[who[k - 1]];
            if (!fds[k].revents || !ended(p->fd)) continue;
            close(p->fd);
            p->fd = -1;
            pthread_mutex_lock(&s->mu);
            s->holding--;
            pthread_mutex_unlock(&s->mu);
            suspect(r, p, "its agent's connection closed");
        }
    }
    drop_all(ps, np);
    return NULL;
}

rdzv_err rdzv_sentinel_start(rdzv *r)
{
    rdzv_sentinel *s = calloc(1, sizeof(*s));
    if (!s) return RDZV_ERR_NOMEM;
    s->wakefd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (s->wakefd < 0) {
        free(s);
        return RDZV_ERR_NOMEM;
    }
    pthread_mutex_init(&s->mu, NULL);
    r->sentinel = s;
    if (pthread_create(&s->th, NULL, sentinel_main, r) != 0) {
        r->sentinel = NULL;
        pthread_mutex_destroy(&s->mu);
        close(s->wakefd);
        free(s);
        return RDZV_ERR_NOMEM;
    }
    return RDZV_OK;
}

int rdzv_watching(rdzv *r)
{
    rdzv_sentinel *s = r ? r->sentinel : NULL;
    if (!s) return 0;
    pthread_mutex_lock(&s->mu);
    int n = s->holding;
    pthread_mutex_unlock(&s->mu);
    return n;
}

void rdzv_sentinel_stop(rdzv *r)
{
    rdzv_sentinel *s = r->sentinel;
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    int joined = s->stop;
    s->stop = 1;
    pthread_mutex_unlock(&s->mu);
    if (joined) return;
    wake(s);
    pthread_join(s->th, NULL);
}

void rdzv_sentinel_free(rdzv *r)
{
    rdzv_sentinel *s = r->sentinel;
    if (!s) return;
    rdzv_sentinel_stop(r);
    r->sentinel = NULL;
    pthread_mutex_destroy(&s->mu);
    close(s->wakefd);
    free(s);
}
