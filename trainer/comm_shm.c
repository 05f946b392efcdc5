/* comm_shm.c: collectives through shared memory, for ranks on one host:
 * the segment.
 *
 * The ranks map one segment (a memfd: it has no name, so nothing is left
 * behind on any exit, SIGKILL included) and move data through it in chunks
 * (comm_shm_coll.c). A host's ranks come to share it by the join handshake
 * (comm_shm_join.c); a test or bench hands it over (comm_shm_from_fds).
 * This file owns the segment itself: its layout, mapping one rank's view
 * of it, the barrier every collective steps through, and the checks that
 * end a wait.
 *
 * The barrier is a counter and a generation word: the last rank to arrive
 * bumps the generation and wakes the others from FUTEX_WAIT. A waiter spins
 * only briefly, then sleeps in slices of SHM_SLICE_MS; between slices it
 * checks its abort flag, the segment's dead word (set by any rank whose
 * collective failed, so a failure reaches everyone at once) and its
 * peers' liveness, and gives up with COMM_ERR_TIMEOUT once nothing moved
 * for timeout_ms.
 *
 * Liveness: every pair of ranks holds a connected AF_UNIX socket pair that
 * carries nothing after the bootstrap; a peer's death closes its ends, and
 * poll() says POLLHUP. This works across PID namespaces (containers that
 * share a network namespace) where pidfds would not.
 */
#include "comm_shm.h"
#include "ductile/clock.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define SHM_SPIN 200    /* polls of the generation before yielding */
#define SHM_YIELDS 50   /* sched_yield()s before sleeping */
#define SHM_SLICE_MS 50 /* a sleeping waiter checks its peers this often */
#define SHM_DEFAULT_TIMEOUT_MS 30000

static int futex(atomic_uint *w, int op, unsigned val, const struct timespec *ts)
{
    return (int)syscall(SYS_futex, (unsigned *)w, op, val, ts, NULL, 0);
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

/* Marks the segment dead (the first rank to fail says who) and wakes all. */
static void shm_poison(shm *g)
{
    unsigned none = 0;
    atomic_compare_exchange_strong(&g->h->dead, &none, (unsigned)g->base.rank + 1);
    atomic_fetch_add(&g->h->gen, 0); /* a full fence before the wake */
    futex(&g->h->gen, FUTEX_WAKE, INT_MAX, NULL);
}

comm_err shm_fail(shm *g, comm_err err, const char *fmt, ...)
{
    char line[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (g->h) shm_poison(g);
    if (comm_is_aborted(&g->base))
        return comm_fail(&g->base, COMM_ERR_ABORTED, "rank %d: aborted",
                         shm_job_rank(g, g->base.rank));
    return comm_fail(&g->base, err, "rank %d: %s", shm_job_rank(g, g->base.rank), line);
}

/* 1 when generation v has reached k (wrap-safe). */
static int reached(unsigned v, uint32_t k)
{
    return (int32_t)(v - k) >= 0;
}

/* Between sleeps: why this rank should stop waiting, or COMM_OK. */
static comm_err shm_check(shm *g, int64_t deadline)
{
    if (comm_is_aborted(&g->base)) return shm_fail(g, COMM_ERR_ABORTED, "aborted");
    unsigned d = atomic_load(&g->h->dead);
    if (d)
        return shm_fail(g, COMM_ERR_PEER, "rank %d failed or aborted its collective",
                        shm_job_rank(g, (int)d - 1));
    if (poll(g->pfd, (nfds_t)g->npfd, 0) > 0)
        for (int i = 0; i < g->npfd; i++)
            if (g->pfd[i].revents) {
                int r = 0;
                for (; r < g->base.world_size; r++)
                    if (g->peer_fd[r] == g->pfd[i].fd) break;
                return shm_fail(g, COMM_ERR_PEER, "rank %d died or closed its communicator",
                                shm_job_rank(g, r));
            }
    if (mono_now_ms() >= deadline)
        return shm_fail(g, COMM_ERR_TIMEOUT, "no progress for %d ms (a peer is silent)",
                        g->timeout_ms);
    return COMM_OK;
}

comm_err shm_barrier_wait(shm *g)
{
    shm_header *h = g->h;
    uint32_t k = ++g->nbar;
    unsigned a = atomic_fetch_add(&h->arrived, 1) + 1;
    if (a == k * (uint32_t)g->base.world_size) {
        atomic_store(&h->gen, k);
        if (atomic_load(&h->waiters)) futex(&h->gen, FUTEX_WAKE, INT_MAX, NULL);
        return COMM_OK;
    }
    /* A short spin (a peer on another core is microseconds away), then a
     * few yields (with more ranks than free cores, the peer needs this
     * core), then sleep. */
    for (int i = 0; i < SHM_SPIN + SHM_YIELDS; i++) {
        if (reached(atomic_load_explicit(&h->gen, memory_order_acquire), k)) return COMM_OK;
        if (i < SHM_SPIN)
            cpu_relax();
        else
            sched_yield();
    }
    int64_t deadline = mono_now_ms() + g->timeout_ms;
    for (;;) {
        atomic_fetch_add(&h->waiters, 1);
        unsigned v = atomic_load(&h->gen);
        if (!reached(v, k) && !atomic_load(&h->dead) && !comm_is_aborted(&g->base)) {
            struct timespec ts = {0, SHM_SLICE_MS * 1000000L};
            futex(&h->gen, FUTEX_WAIT, v, &ts);
        }
        atomic_fetch_sub(&h->waiters, 1);
        if (reached(atomic_load(&h->gen), k)) return COMM_OK;
        comm_err err = shm_check(g, deadline);
        if (err != COMM_OK) return err;
    }
}

void shm_abort(comm *c)
{
    shm *g = (shm *)c;
    if (g->h) shm_poison(g);
}

void shm_destroy(comm *c)
{
    shm *g = (shm *)c;
    if (g->h) munmap(g->h, g->seg_bytes);
    for (int r = 0; r < g->base.world_size && r < SHM_MAX_RANKS; r++)
        if (g->peer_fd[r] >= 0) close(g->peer_fd[r]);
    free(g);
}

size_t shm_seg_bytes(int world)
{
    return SHM_DATA_OFF + 2 * (size_t)(world + 1) * SHM_SLOT;
}

comm_err shm_map(shm *g, int memfd, size_t bytes)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    if (p == MAP_FAILED)
        return shm_fail(g, COMM_ERR_SYS, "mmap of the segment: %s", strerror(errno));
    g->h = p;
    g->data = (char *)p + SHM_DATA_OFF;
    g->seg_bytes = bytes;
    return COMM_OK;
}

void shm_add_peer(shm *g, int r, int fd)
{
    g->peer_fd[r] = fd;
    g->pfd[g->npfd++] = (struct pollfd){fd, POLLIN, 0};
}

comm_err shm_new(const comm_config *cfg, int rank, int world, shm **out)
{
    shm *g = calloc(1, sizeof(*g));
    if (!g) return COMM_ERR_NOMEM;
    comm_base_init(&g->base, &shm_ops, rank, world);
    g->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : SHM_DEFAULT_TIMEOUT_MS;
    for (int r = 0; r < SHM_MAX_RANKS; r++) {
        g->peer_fd[r] = -1;
        g->grank[r] = r;
    }
    *out = g;
    return COMM_OK;
}

size_t comm_shm_bytes(int world)
{
    return world >= 2 && world <= SHM_MAX_RANKS ? shm_seg_bytes(world) : 0;
}

comm_err comm_shm_from_fds(const comm_config *cfg, int memfd, const int *peer_fd, comm **out)
{
    int w = cfg ? cfg->world_size : 0;
    comm_err err = COMM_ERR_ARG;
    shm *g = NULL;
    *out = NULL;
    if (w >= 2 && w <= SHM_MAX_RANKS && cfg->rank >= 0 && cfg->rank < w &&
        (err = shm_new(cfg, cfg->rank, w, &g)) == COMM_OK) {
        for (int r = 0; r < w; r++)
            if (r != cfg->rank) shm_add_peer(g, r, peer_fd[r]);
        err = shm_map(g, memfd, shm_seg_bytes(w));
        if (err == COMM_OK) err = shm_barrier_wait(g);
        if (err == COMM_OK) {
            *out = &g->base;
            return COMM_OK;
        }
        shm_destroy(&g->base);
        return err;
    }
    for (int r = 0; r < w && w <= SHM_MAX_RANKS; r++)
        if (r != cfg->rank && peer_fd[r] >= 0) close(peer_fd[r]);
    return err;
}
