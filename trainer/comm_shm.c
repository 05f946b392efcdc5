/* comm_shm.c: collectives through shared memory, for ranks on one host.
 *
 * The ranks map one segment (a memfd: it has no name, so nothing is left
 * behind on any exit, SIGKILL included) and move data through it in
 * chunks. Allreduce is reduce-scatter then all-gather on each chunk: every
 * rank copies its chunk into its slot, then sums its own slice of all the
 * slots into the result (so the W ranks reduce in parallel, each element
 * in rank order, the same bits everywhere), then copies the whole result
 * out. The one idea that keeps it fast is double buffering: two sets of
 * slots, so one barrier per chunk suffices (a rank copies chunk k-1's
 * result out, sums its slice of chunk k and fills its slot for chunk k+1
 * between two barriers; the set it writes was last read two barriers ago).
 * Broadcast and allgather run the same loop with other copies.
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
 *
 * Bootstrap (comm_cpu_init): rank 0 chooses for the round from what every
 * rank publishes (comm_choose.c: its device, node and host, the boot id
 * and network namespace that say "same kernel, same abstract socket
 * namespace"), and every rank follows. One host: shared memory alone; a
 * host each: the ring; else both (comm_hier.c). A host's leader (its lowest
 * rank) makes the segment, listens on an abstract AF_UNIX socket (a random
 * name, so rounds and jobs never collide; abstract names vanish with the
 * process) and publishes it with a nonce as "shm/<host>"; each other rank
 * of the host connects,
 * proves it read the store by echoing the nonce, and gets back by
 * SCM_RIGHTS the memfd and its ends of the socket pairs. The connection to
 * the leader is that pair's liveness socket.
 *
 * Failpoints (ductile/failpoint.h): shm.collective (counted per collective
 * that reaches the segment) with action closed fails it as a dead peer
 * does (COMM_ERR_PEER, the others see the dead word at once); shm.connect
 * (counted per comm_cpu_init bootstrap of world >= 2 not forced to the
 * ring) with action fail fails it at once with a timeout, publishing
 * nothing, so its peers time out too.
 */
#include "comm_impl.h"
#include "comm_ring.h"
#include "ductile/clock.h"
#include "ductile/failpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stddef.h>
#include <inttypes.h>
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define SHM_SLOT (128u * 1024u) /* bytes per rank per chunk */
#define SHM_SPIN 200            /* polls of the generation before yielding */
#define SHM_YIELDS 50           /* sched_yield()s before sleeping */
#define SHM_SLICE_MS 50         /* a sleeping waiter checks its peers this often */
#define SHM_HELLO_MS 2000
#define SHM_HELLO_MAGIC 0x4f4c4c45484d4853ull  /* "SHMHELLO" */
#define SHM_ANSWER_MAGIC 0x5245575341484d53ull /* "SHMASWER" */
#define SHM_DEFAULT_TIMEOUT_MS 30000

enum { OP_ALLREDUCE = 1, OP_BROADCAST, OP_ALLGATHER, OP_BARRIER };

/* What a rank says it is doing: all must agree before data is used. */
typedef struct shm_desc {
    alignas(64) uint32_t op;
    uint32_t root;
    uint64_t seq;
    uint64_t size;
} shm_desc;

typedef struct shm_header {
    alignas(64) atomic_uint arrived; /* barrier arrivals so far, all ranks */
    alignas(64) atomic_uint gen;     /* barriers completed: the futex word */
    atomic_uint waiters;             /* ranks asleep (or about to be) on gen */
    alignas(64) atomic_uint dead;    /* rank+1 of the first rank that failed */
    /* By the collective's parity: a rank may start collective s+1 while a
     * slower one still reads collective s's descriptions. */
    alignas(64) shm_desc desc[2][SHM_MAX_RANKS];
} shm_header;

#define SHM_DATA_OFF (((sizeof(shm_header) + 4095) / 4096) * 4096)

typedef struct shm {
    comm base; /* first: comm.c sees the same pointer */
    shm_header *h;
    char *data; /* 2 sets of world+1 slots of SHM_SLOT bytes (the last: the result) */
    size_t seg_bytes;
    int timeout_ms;
    uint32_t nbar; /* barriers this rank has entered */
    uint64_t seq;
    int peer_fd[SHM_MAX_RANKS]; /* liveness: -1 for this rank */
    int grank[SHM_MAX_RANKS];   /* the job's rank of each (one host's ranks under comm_hier.c) */
    struct pollfd pfd[SHM_MAX_RANKS];
    int npfd;
} shm;

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

static char *shm_slot(shm *g, int set, int r)
{
    return g->data + ((size_t)set * (size_t)(g->base.world_size + 1) + (size_t)r) * SHM_SLOT;
}

/* Marks the segment dead (the first rank to fail says who) and wakes all. */
static void shm_poison(shm *g)
{
    unsigned none = 0;
    atomic_compare_exchange_strong(&g->h->dead, &none, (unsigned)g->base.rank + 1);
    atomic_fetch_add(&g->h->gen, 0); /* a full fence before the wake */
    futex(&g->h->gen, FUTEX_WAKE, INT_MAX, NULL);
}

static comm_err shm_fail(shm *g, comm_err err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The job's rank of local rank r, for messages. */
static int job_rank(const shm *g, int r)
{
    return r >= 0 && r < SHM_MAX_RANKS ? g->grank[r] : r;
}

static comm_err shm_fail(shm *g, comm_err err, const char *fmt, ...)
{
    char line[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (g->h) shm_poison(g);
    if (comm_is_aborted(&g->base))
        return comm_fail(&g->base, COMM_ERR_ABORTED, "rank %d: aborted", job_rank(g, g->base.rank));
    return comm_fail(&g->base, err, "rank %d: %s", job_rank(g, g->base.rank), line);
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
                        job_rank(g, (int)d - 1));
    if (poll(g->pfd, (nfds_t)g->npfd, 0) > 0)
        for (int i = 0; i < g->npfd; i++)
            if (g->pfd[i].revents) {
                int r = 0;
                for (; r < g->base.world_size; r++)
                    if (g->peer_fd[r] == g->pfd[i].fd) break;
                return shm_fail(g, COMM_ERR_PEER, "rank %d died or closed its communicator",
                                job_rank(g, r));
            }
    if (mono_now_ms() >= deadline)
        return shm_fail(g, COMM_ERR_TIMEOUT, "no progress for %d ms (a peer is silent)",
                        g->timeout_ms);
    return COMM_OK;
}

/* Arrives at the next barrier and waits for every rank to arrive. */
static comm_err shm_barrier_wait(shm *g)
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

/* ---- the collectives: one loop, three kinds of copy ---- */

typedef struct shm_plan {
    uint32_t op;
    char *buf;
    const char *send;
    size_t count; /* allreduce: floats; broadcast: bytes; allgather: bytes per rank */
    int root;
    size_t chunk;   /* units of count per chunk */
    size_t nchunks; /* chunks; the loop runs one more barrier to drain */
} shm_plan;

static size_t min_sz(size_t a, size_t b)
{
    return a < b ? a : b;
}

/* This rank's slice of an n-float chunk: W nearly equal parts. */
static void shm_slice(const shm *g, size_t n, size_t *first, size_t *len)
{
    size_t w = (size_t)g->base.world_size, r = (size_t)g->base.rank;
    size_t base = n / w, rem = n % w;
    *first = r * base + (r < rem ? r : rem);
    *len = base + (r < rem ? 1 : 0);
}

/* Copies an n-float chunk except this rank's slice (which it never posts
 * nor takes: it reads and writes its own buffer there). */
static void copy_but_slice(const shm *g, float *dst, const float *src, size_t n)
{
    size_t first, len;
    shm_slice(g, n, &first, &len);
    memcpy(dst, src, first * sizeof(float));
    memcpy(dst + first + len, src + first + len, (n - first - len) * sizeof(float));
}

/* Sums this rank's slice of chunk k (n floats at buf) over all ranks, in
 * rank order (its own part read from buf), into the result slot and buf. */
static void shm_reduce(shm *g, int set, float *buf, size_t n)
{
    enum { BLOCK = 2048 }; /* floats: the partial sum stays in L1 */
    int w = g->base.world_size, r = g->base.rank;
    size_t first, len;
    shm_slice(g, n, &first, &len);
    float *res = (float *)shm_slot(g, set, w) + first;
    const float *in[SHM_MAX_RANKS];
    for (int j = 0; j < w; j++)
        in[j] = j == r ? buf + first : (const float *)shm_slot(g, set, j) + first;
    for (size_t b = 0; b < len; b += BLOCK) {
        size_t m = min_sz(BLOCK, len - b);
        float *out = res + b;
        const float *a0 = in[0] + b, *a1 = in[1] + b;
        for (size_t i = 0; i < m; i++)
            out[i] = a0[i] + a1[i];
        for (int j = 2; j < w; j++) {
            const float *aj = in[j] + b;
            for (size_t i = 0; i < m; i++)
                out[i] += aj[i];
        }
        memcpy(buf + first + b, out, m * sizeof(float));
    }
}

/* Before chunk k's barrier: this rank's part goes into the segment. */
static void shm_post(shm *g, const shm_plan *p, size_t k)
{
    int set = (int)(k & 1), r = g->base.rank;
    size_t off = k * p->chunk, n = min_sz(p->chunk, p->count - off);
    switch (p->op) {
    case OP_ALLREDUCE:
        copy_but_slice(g, (float *)shm_slot(g, set, r), (const float *)p->buf + off, n);
        break;
    case OP_BROADCAST:
        if (r == p->root) memcpy(shm_slot(g, set, 0), p->buf + off, n);
        break;
    case OP_ALLGATHER:
        memcpy(shm_slot(g, set, r), p->send + off, n);
        break;
    }
}

/* After chunk k's barrier (every rank posted it, and finished chunk k-1's
 * reduce): take chunk k-1's result, reduce chunk k, or copy chunk k out. */
static void shm_take(shm *g, const shm_plan *p, size_t k)
{
    int set = (int)(k & 1), r = g->base.rank, w = g->base.world_size;
    switch (p->op) {
    case OP_ALLREDUCE:
        if (k > 0) {
            size_t off = (k - 1) * p->chunk, n = min_sz(p->chunk, p->count - off);
            copy_but_slice(g, (float *)p->buf + off, (const float *)shm_slot(g, set ^ 1, w), n);
        }
        if (k < p->nchunks) {
            size_t off = k * p->chunk;
            shm_reduce(g, set, (float *)p->buf + off, min_sz(p->chunk, p->count - off));
        }
        break;
    case OP_BROADCAST:
        if (k < p->nchunks && r != p->root) {
            size_t off = k * p->chunk;
            memcpy(p->buf + off, shm_slot(g, set, 0), min_sz(p->chunk, p->count - off));
        }
        break;
    case OP_ALLGATHER:
        if (k < p->nchunks) {
            size_t off = k * p->chunk, n = min_sz(p->chunk, p->count - off);
            for (int j = 0; j < w; j++)
                memcpy(p->buf + (size_t)j * p->count + off, shm_slot(g, set, j), n);
        }
        break;
    }
}

static const char *op_name(uint32_t op)
{
    static const char *names[] = {"?", "allreduce", "broadcast", "allgather", "barrier"};
    return op <= OP_BARRIER ? names[op] : "?";
}

/* After the first barrier: every rank must be in the same collective. */
static comm_err shm_agree(shm *g)
{
    int par = (int)((g->seq - 1) & 1);
    const shm_desc *me = &g->h->desc[par][g->base.rank];
    for (int j = 0; j < g->base.world_size; j++) {
        const shm_desc *d = &g->h->desc[par][j];
        if (d->op != me->op || d->seq != me->seq || d->size != me->size || d->root != me->root)
            return shm_fail(g, COMM_ERR_PEER,
                            "collective mismatch: rank %d is in %s #%" PRIu64 " of %" PRIu64
                            " bytes (root %u), this "
                            "rank in %s #%" PRIu64 " of %" PRIu64 " bytes (root %u)",
                            job_rank(g, j), op_name(d->op), d->seq, d->size, d->root,
                            op_name(me->op), me->seq, me->size, me->root);
    }
    return COMM_OK;
}

static comm_err shm_run(shm *g, const shm_plan *p, uint64_t size)
{
    if (ring_failpoint("shm.collective", "closed"))
        return shm_fail(g, COMM_ERR_PEER, "a peer died (failpoint shm.collective)");
    shm_desc *me = &g->h->desc[g->seq & 1][g->base.rank];
    me->op = p->op;
    me->root = (uint32_t)p->root;
    me->seq = g->seq++;
    me->size = size;
    for (size_t k = 0; k <= p->nchunks; k++) {
        if (k < p->nchunks) shm_post(g, p, k);
        comm_err err = shm_barrier_wait(g);
        if (err != COMM_OK) return err;
        if (k == 0 && (err = shm_agree(g)) != COMM_OK) return err;
        shm_take(g, p, k);
    }
    return COMM_OK;
}

static size_t chunks(size_t count, size_t chunk)
{
    return (count + chunk - 1) / chunk;
}

static comm_err shm_allreduce(comm *c, float *buf, size_t n)
{
    shm *g = (shm *)c;
    size_t per = SHM_SLOT / sizeof(float);
    shm_plan p = {OP_ALLREDUCE, (char *)buf, NULL, n, 0, per, chunks(n, per)};
    return shm_run(g, &p, n * sizeof(float));
}

static comm_err shm_broadcast(comm *c, void *buf, size_t bytes, int root)
{
    shm *g = (shm *)c;
    shm_plan p = {OP_BROADCAST, buf, NULL, bytes, root, SHM_SLOT, chunks(bytes, SHM_SLOT)};
    return shm_run(g, &p, bytes);
}

static comm_err shm_allgather(comm *c, const void *send, size_t bytes, void *recv)
{
    shm *g = (shm *)c;
    shm_plan p = {OP_ALLGATHER, recv, send, bytes, 0, SHM_SLOT, chunks(bytes, SHM_SLOT)};
    return shm_run(g, &p, bytes);
}

static comm_err shm_barrier(comm *c)
{
    shm *g = (shm *)c;
    shm_plan p = {OP_BARRIER, NULL, NULL, 0, 0, 1, 0};
    return shm_run(g, &p, 0);
}

/* As a ring's abort shuts its sockets: every rank's collectives fail now,
 * and this rank's waiter wakes to see its flag. */
static void shm_abort(comm *c)
{
    shm *g = (shm *)c;
    if (g->h) shm_poison(g);
}

static void shm_destroy(comm *c)
{
    shm *g = (shm *)c;
    if (g->h) munmap(g->h, g->seg_bytes);
    for (int r = 0; r < g->base.world_size && r < SHM_MAX_RANKS; r++)
        if (g->peer_fd[r] >= 0) close(g->peer_fd[r]);
    free(g);
}

static const comm_ops shm_ops = {.name = "shm",
                                 .allreduce_sum_f32 = shm_allreduce,
                                 .broadcast = shm_broadcast,
                                 .allgather = shm_allgather,
                                 .barrier = shm_barrier,
                                 .wait_event = NULL,
                                 .abort = shm_abort,
                                 .destroy = shm_destroy};

/* ---- bootstrap ---- */

typedef struct shm_hello {
    uint64_t magic;
    uint32_t rank, world;
    uint64_t nonce;
} shm_hello;

typedef struct shm_answer {
    uint64_t magic;
    uint32_t world, slot;
    uint64_t seg_bytes;
} shm_answer;

static size_t shm_seg_bytes(int world)
{
    return SHM_DATA_OFF + 2 * (size_t)(world + 1) * SHM_SLOT;
}

/* "BOOTID-NETNS": ranks with the same one share a kernel and an abstract
 * socket namespace, so they can pass a memfd. 0 or -1. */
int comm_host_id(char *out, size_t len)
{
    char boot[64] = "";
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "re");
    if (!f) return -1;
    int ok = fgets(boot, sizeof(boot), f) != NULL;
    fclose(f);
    struct stat st;
    if (!ok || stat("/proc/self/ns/net", &st) < 0) return -1;
    boot[strcspn(boot, "\n")] = '\0';
    snprintf(out, len, "%s-%llx-%llx", boot, (unsigned long long)st.st_dev,
             (unsigned long long)st.st_ino);
    return 0;
}

static socklen_t shm_sockaddr(const char *name, struct sockaddr_un *sa)
{
    memset(sa, 0, sizeof(*sa));
    sa->sun_family = AF_UNIX;
    size_t n = strlen(name);
    memcpy(sa->sun_path + 1, name, n); /* abstract: a leading NUL */
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

/* Reads exactly len bytes (and, when fds is set, up to nfds descriptors
 * with them) before the deadline: 0 or an errno. */
static int recv_msg(int fd, void *buf, size_t len, int *fds, int nfds, int64_t deadline)
{
    for (;;) {
        int w = ring_wait_fd(fd, POLLIN, deadline);
        if (w == 0) return ETIMEDOUT;
        if (w < 0) return errno;
        union {
            char b[CMSG_SPACE(sizeof(int) * SHM_MAX_RANKS)];
            struct cmsghdr align;
        } ctl;
        struct iovec iov = {buf, len};
        struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
        if (fds) {
            m.msg_control = ctl.b;
            m.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
        }
        ssize_t k = recvmsg(fd, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (k < 0) return errno;
        int got = 0;
        for (struct cmsghdr *cm = fds ? CMSG_FIRSTHDR(&m) : NULL; cm; cm = CMSG_NXTHDR(&m, cm))
            if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
                int n = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
                for (int i = 0; i < n; i++) {
                    int x;
                    memcpy(&x, CMSG_DATA(cm) + (size_t)i * sizeof(int), sizeof(int));
                    if (got < nfds)
                        fds[got++] = x;
                    else
                        close(x);
                }
            }
        if ((size_t)k != len || (fds && (got != nfds || (m.msg_flags & MSG_CTRUNC)))) {
            for (int i = 0; i < got; i++)
                close(fds[i]);
            return k == 0 ? ECONNRESET : EPROTO;
        }
        return 0;
    }
}

static int send_msg(int fd, const void *buf, size_t len, const int *fds, int nfds)
{
    union {
        char b[CMSG_SPACE(sizeof(int) * SHM_MAX_RANKS)];
        struct cmsghdr align;
    } ctl;
    struct iovec iov = {(void *)buf, len};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
    if (nfds > 0) {
        memset(&ctl, 0, sizeof(ctl));
        m.msg_control = ctl.b;
        m.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
        struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
        memcpy(CMSG_DATA(cm), fds, sizeof(int) * (size_t)nfds);
    }
    ssize_t k;
    do
        k = sendmsg(fd, &m, MSG_NOSIGNAL);
    while (k < 0 && errno == EINTR);
    if (k < 0) return errno;
    return (size_t)k == len ? 0 : EPROTO;
}

static comm_err shm_map(shm *g, int memfd, size_t bytes)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    if (p == MAP_FAILED)
        return shm_fail(g, COMM_ERR_SYS, "mmap of the segment: %s", strerror(errno));
    g->h = p;
    g->data = (char *)p + SHM_DATA_OFF;
    g->seg_bytes = bytes;
    return COMM_OK;
}

static void shm_add_peer(shm *g, int r, int fd)
{
    g->peer_fd[r] = fd;
    g->pfd[g->npfd++] = (struct pollfd){fd, POLLIN, 0};
}

/* Rank 0: makes the segment and the liveness pairs, and hands each rank
 * its share as it connects. */
static comm_err shm_serve(shm *g, int lfd, uint64_t nonce, int64_t deadline)
{
    int w = g->base.world_size;
    comm_err err = COMM_OK;
    int memfd = memfd_create("ductile-shm", MFD_CLOEXEC);
    if (memfd < 0) return shm_fail(g, COMM_ERR_SYS, "memfd_create: %s", strerror(errno));
    size_t bytes = shm_seg_bytes(w);
    /* pair[i][j] (i < j, both > 0): [0] is i's end, [1] j's. */
    int(*pair)[SHM_MAX_RANKS][2] = calloc(SHM_MAX_RANKS, sizeof(*pair));
    if (!pair) {
        close(memfd);
        return shm_fail(g, COMM_ERR_NOMEM, "out of memory");
    }
    for (int i = 0; i < w; i++)
        for (int j = 0; j < w; j++)
            pair[i][j][0] = pair[i][j][1] = -1;
    if (ftruncate(memfd, (off_t)bytes) < 0) {
        err = shm_fail(g, COMM_ERR_SYS, "sizing the segment: %s", strerror(errno));
        goto out;
    }
    if ((err = shm_map(g, memfd, bytes)) != COMM_OK) goto out;
    for (int i = 1; i < w; i++)
        for (int j = i + 1; j < w; j++)
            if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, pair[i][j]) <
                0) {
                err = shm_fail(g, COMM_ERR_SYS, "socketpair: %s", strerror(errno));
                goto out;
            }
    int joined = 0, rejected = 0;
    while (joined < w - 1) {
        int x = ring_wait_fd(lfd, POLLIN, deadline);
        if (x <= 0) {
            err = shm_fail(g, x == 0 ? COMM_ERR_TIMEOUT : COMM_ERR_SYS,
                           "%d of %d local ranks connected (%d stray connections refused)", joined,
                           w - 1, rejected);
            goto out;
        }
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) continue;
        struct ucred cred;
        socklen_t cl = sizeof(cred);
        shm_hello hi;
        int64_t hd = mono_now_ms() + SHM_HELLO_MS;
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) < 0 || cred.uid != getuid() ||
            recv_msg(fd, &hi, sizeof(hi), NULL, 0, hd < deadline ? hd : deadline) != 0 ||
            hi.magic != SHM_HELLO_MAGIC || hi.nonce != nonce || hi.world != (uint32_t)w ||
            hi.rank == 0 || hi.rank >= (uint32_t)w || g->peer_fd[hi.rank] >= 0) {
            close(fd);
            rejected++;
            continue;
        }
        int r = (int)hi.rank, fds[SHM_MAX_RANKS], n = 0;
        fds[n++] = memfd;
        for (int j = 1; j < w; j++)
            if (j != r) fds[n++] = r < j ? pair[r][j][0] : pair[j][r][1];
        shm_answer an = {SHM_ANSWER_MAGIC, (uint32_t)w, SHM_SLOT, bytes};
        int e = send_msg(fd, &an, sizeof(an), fds, n);
        if (e != 0) {
            close(fd);
            err = shm_fail(g, COMM_ERR_PEER, "handing rank %d the segment: %s", job_rank(g, r),
                           strerror(e));
            goto out;
        }
        for (int j = 1; j < w; j++) { /* r holds its ends now */
            int *end = r < j ? &pair[r][j][0] : &pair[j][r][1];
            if (j != r && *end >= 0) close(*end), *end = -1;
        }
        shm_add_peer(g, r, fd);
        joined++;
    }
out:
    for (int i = 0; i < w; i++)
        for (int j = 0; j < w; j++)
            for (int s = 0; s < 2; s++)
                if (pair[i][j][s] >= 0) close(pair[i][j][s]);
    free(pair);
    close(memfd);
    return err;
}

/* Ranks 1..W-1: connect to rank 0, get the segment and the pairs. */
static comm_err shm_join(shm *g, const char *name, uint64_t nonce, int64_t deadline)
{
    int w = g->base.world_size, r = g->base.rank;
    struct sockaddr_un sa;
    socklen_t sl = shm_sockaddr(name, &sa);
    int fd = -1, e = 0;
    for (;;) {
        /* Non-blocking: with rank 0's backlog full (strays) connect says
         * EAGAIN instead of blocking past the deadline. */
        fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) return shm_fail(g, COMM_ERR_SYS, "socket: %s", strerror(errno));
        if (connect(fd, (struct sockaddr *)&sa, sl) == 0) {
            fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
            break;
        }
        e = errno;
        close(fd);
        fd = -1;
        if ((e != ECONNREFUSED && e != EAGAIN && e != ENOENT) || mono_now_ms() >= deadline)
            return shm_fail(g, COMM_ERR_PEER, "cannot connect to rank 0's socket: %s", strerror(e));
        struct timespec pause = {0, 20 * 1000000};
        nanosleep(&pause, NULL);
    }
    shm_hello hi = {SHM_HELLO_MAGIC, (uint32_t)r, (uint32_t)w, nonce};
    shm_answer an;
    int fds[SHM_MAX_RANKS];
    e = send_msg(fd, &hi, sizeof(hi), NULL, 0);
    if (e == 0) e = recv_msg(fd, &an, sizeof(an), fds, w - 1, deadline);
    if (e != 0) {
        close(fd);
        return shm_fail(g, e == ETIMEDOUT ? COMM_ERR_TIMEOUT : COMM_ERR_PEER,
                        "no segment from rank 0: %s", strerror(e));
    }
    shm_add_peer(g, 0, fd);
    for (int j = 1, i = 1; j < w; j++)
        if (j != r) shm_add_peer(g, j, fds[i++]);
    comm_err err = COMM_OK;
    if (an.magic != SHM_ANSWER_MAGIC || an.world != (uint32_t)w || an.slot != SHM_SLOT ||
        an.seg_bytes != shm_seg_bytes(w))
        err = shm_fail(g, COMM_ERR_PEER, "rank 0 runs a different segment layout");
    else
        err = shm_map(g, fds[0], an.seg_bytes);
    close(fds[0]);
    return err;
}

static comm_err shm_new(const comm_config *cfg, int rank, int world, shm **out)
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

/* The leader's half of a group's meeting: a random abstract socket, with
 * its name and nonce published as "shm/<host>". */
static comm_err shm_listen(shm *g, rdzv_store *store, int host, int *lfd, uint64_t *nonce)
{
    uint64_t rnd[2];
    if (getrandom(rnd, sizeof(rnd), 0) != (ssize_t)sizeof(rnd) ||
        getrandom(nonce, sizeof(*nonce), 0) != (ssize_t)sizeof(*nonce))
        return shm_fail(g, COMM_ERR_SYS, "getrandom: %s", strerror(errno));
    char name[64], key[32], v[128];
    snprintf(name, sizeof(name), "ductile-shm-%016" PRIx64 "%016" PRIx64, rnd[0], rnd[1]);
    struct sockaddr_un sa;
    socklen_t sl = shm_sockaddr(name, &sa);
    *lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (*lfd < 0 || bind(*lfd, (struct sockaddr *)&sa, sl) < 0 || listen(*lfd, 64) < 0)
        return shm_fail(g, COMM_ERR_SYS, "listening on an abstract socket: %s", strerror(errno));
    snprintf(key, sizeof(key), "shm/%d", host);
    snprintf(v, sizeof(v), "%s %016" PRIx64, name, *nonce);
    rdzv_err re = rdzv_store_set(store, key, v, strlen(v));
    if (re != RDZV_OK)
        return comm_store_error(&g->base, store, re, "publishing the segment's socket");
    return COMM_OK;
}

/* One host's ranks (lrank of lworld; the job's ranks r with host_of[r] ==
 * host) build their segment: the leader (lrank 0) serves it, the others
 * join. On failure *why says why. */
static comm_err shm_group(const comm_config *cfg, const int *host_of, int lrank, int lworld,
                          int host, int64_t deadline, comm **out, char *why)
{
    shm *g = NULL;
    comm_err err = shm_new(cfg, lrank, lworld, &g);
    if (err != COMM_OK) return err;
    for (int r = 0, j = 0; r < cfg->world_size && j < SHM_MAX_RANKS; r++)
        if (host_of[r] == host) g->grank[j++] = r;
    if (lrank == 0) {
        int lfd = -1;
        uint64_t nonce = 0;
        err = shm_listen(g, cfg->store, host, &lfd, &nonce);
        if (err == COMM_OK) err = shm_serve(g, lfd, nonce, deadline);
        if (lfd >= 0) close(lfd);
    } else {
        char key[32], name[64];
        void *val = NULL;
        size_t len = 0;
        uint64_t nonce;
        snprintf(key, sizeof(key), "shm/%d", host);
        rdzv_err re = rdzv_store_wait(cfg->store, key, ring_ms_left(deadline), &val, &len);
        if (re != RDZV_OK)
            err = comm_store_error(&g->base, cfg->store, re, "waiting for the segment's socket");
        else if (sscanf(val, "%63s %" SCNx64, name, &nonce) != 2)
            err = comm_fail(&g->base, COMM_ERR_STORE, "malformed segment socket '%s'", (char *)val);
        else
            err = shm_join(g, name, nonce, deadline);
        free(val);
    }
    /* Every rank has its segment: the first barrier says all mapped it. */
    if (err == COMM_OK) err = shm_barrier_wait(g);
    if (err != COMM_OK) {
        snprintf(why, COMM_MSG_MAX, "%s", g->base.last_error);
        shm_destroy(&g->base);
        return err;
    }
    *out = &g->base;
    return COMM_OK;
}

/* ---- comm_cpu_init: the transport comm_choose.c chose ---- */

/* Builds this rank's parts by host_of: the segment of its host (when it
 * shares the host), and on a host's leader (its lowest rank) the ring
 * among leaders; then the comm that joins them. */
static comm_err cpu_build(comm *c, const comm_config *cfg, const int *host_of, int64_t deadline,
                          comm **out, char *why)
{
    int w = cfg->world_size, me = cfg->rank, nhosts = 0, lrank = 0, lworld = 0;
    for (int r = 0; r < w; r++) {
        if (host_of[r] + 1 > nhosts) nhosts = host_of[r] + 1;
        if (host_of[r] == host_of[me]) {
            if (r < me) lrank++;
            lworld++;
        }
    }
    if (cfg->transport == COMM_TRANSPORT_SHM && nhosts > 1)
        return comm_fail(c, COMM_ERR_ARG, "--comm shm needs every rank on one host (%d hosts)",
                         nhosts);
    if (nhosts == w) return comm_ring_init(cfg, out); /* one rank per host */
    if (nhosts == 1) return shm_group(cfg, host_of, me, w, 0, deadline, out, why);
    comm *local = NULL, *leaders = NULL;
    comm_err err = COMM_OK;
    if (lworld > 1)
        err = shm_group(cfg, host_of, lrank, lworld, host_of[me], deadline, &local, why);
    if (err == COMM_OK && lrank == 0) {
        comm_config lc = *cfg;
        lc.rank = host_of[me];
        lc.world_size = nhosts;
        lc.msg = why;
        err = comm_ring_init(&lc, &leaders);
    }
    if (err == COMM_OK) err = comm_hier_new(cfg, host_of, local, leaders, out);
    if (err != COMM_OK) {
        comm_free(local);
        comm_free(leaders);
    }
    return err;
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

comm_err comm_cpu_init(const comm_config *cfg, comm **out)
{
    if (!out) return COMM_ERR_ARG;
    *out = NULL;
    if (!cfg || cfg->world_size < 1 || cfg->rank < 0 || cfg->rank >= cfg->world_size)
        return COMM_ERR_ARG;
    /* A rank forced to the ring still takes part in the decision (it
     * publishes a host of its own), so that ranks given different --comm
     * agree instead of waiting for each other's bootstrap. */
    if (cfg->world_size == 1 || (cfg->transport == COMM_TRANSPORT_RING && !cfg->store))
        return comm_ring_init(cfg, out);
    if (!cfg->store) return comm_init_failed(cfg, COMM_ERR_ARG, "no round store");
    /* A comm of its own for the bootstrap's errors: the one built may be
     * a ring, a segment or both. */
    shm *boot = NULL;
    comm_err err = shm_new(cfg, cfg->rank, cfg->world_size, &boot);
    if (err != COMM_OK) return comm_init_failed(cfg, err, NULL);
    char why[COMM_MSG_MAX] = "";
    int *host_of = NULL;
    int64_t deadline = mono_now_ms() + boot->timeout_ms;
    if (cfg->transport != COMM_TRANSPORT_RING && ring_failpoint("shm.connect", "fail"))
        err = comm_fail(&boot->base, COMM_ERR_TIMEOUT,
                        "the ranks did not meet (failpoint shm.connect)");
    else
        err = comm_choose(&boot->base, cfg, deadline, &host_of);
    if (err == COMM_OK && !host_of) {
        if (cfg->transport == COMM_TRANSPORT_SHM)
            err = comm_fail(&boot->base, COMM_ERR_ARG,
                            "--comm shm: rank 0 chose the ring (a host has over %d ranks)",
                            SHM_MAX_RANKS);
        else
            err = comm_ring_init(cfg, out); /* says why in cfg->msg itself */
    } else if (err == COMM_OK) {
        err = cpu_build(&boot->base, cfg, host_of, deadline, out, why);
    }
    if (err != COMM_OK && boot->base.last_error[0])
        comm_init_failed(cfg, err, boot->base.last_error);
    else if (err != COMM_OK && why[0])
        comm_init_failed(cfg, err, why);
    free(host_of);
    shm_destroy(&boot->base);
    return err;
}
