/* comm_ring.c: the CPU collectives backend, a TCP ring.
 *
 * Each rank keeps two connections: it sends to its right neighbour
 * (rank+1) and receives from its left one (rank-1). This file is the ring
 * once those connections exist; comm_ring_boot.c makes them.
 *
 * Every collective is a sequence of steps; in step t a rank sends one span
 * of its buffer to the right and receives one span from the left. A step's
 * send may only use data that an earlier receive completed (allreduce:
 * send(t) is what recv(t-1) just reduced; broadcast: forward what arrived).
 * The idea that makes it fast and safe is that this dependency is tracked
 * per chunk, not per step: as soon as chunk k of recv(t-1) is reduced,
 * chunk k of send(t) may leave, so the ring is a pipeline. One poll() loop
 * over non-blocking sockets moves both directions at once; receiving never
 * waits for sending, so no two ranks can block on each other's full socket
 * buffers. Allreduce is reduce-scatter then all-gather (2(W-1) steps of n/W
 * floats each: the bandwidth-optimal ring), allgather is W-1 steps, and
 * broadcast one step pipelined from the root around the ring.
 *
 * Knowingly simple: one thread per rank does both directions, taking turns
 * a chunk at a time. A separate sender thread (so the kernel's copy into
 * the right socket runs beside the copy out of the left one) was built and
 * measured slower on a 2-core machine (1.5 vs 2.0 GB/s bus bandwidth at
 * 64 MiB, 2 ranks); with cores to spare per rank it may win.
 *
 * Every collective starts with a 32-byte header (op, sequence number, size,
 * root) so ranks that call different collectives fail with a clear error
 * instead of mixing data. Failures: EOF or reset on a needed connection is
 * COMM_ERR_PEER at once; no byte moving for timeout_ms is COMM_ERR_TIMEOUT;
 * comm_abort() writes an eventfd that is in every poll set. A failing rank
 * shuts its sockets down, so the failure runs around the ring in
 * microseconds instead of every rank waiting out its own deadline.
 *
 * Headers are in host byte order: every rank of a job runs the same binary
 * on the same architecture.
 *
 * Failpoint (ductile/failpoint.h), for tests of the fault paths:
 * ring.collective (counted per collective that reaches the ring: world > 1,
 * non-empty) with action closed fails it as a closed connection does
 * (COMM_ERR_PEER, both sockets shut so the neighbours see a closed peer, the
 * comm dead). The bootstrap's ring.connect is described in comm_ring_boot.c.
 */
#include "comm_ring.h"
#include "ductile/clock.h"
#include "ductile/failpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#define RING_DEFAULT_TIMEOUT_MS 30000
#define RING_DEFAULT_CHUNK (256u * 1024u)
#define RING_MIN_CHUNK 4096u
#define RING_SOCKBUF (4 * 1024 * 1024)
#define RING_OP_MAGIC 0x4f525444u /* "DTRO" */

typedef struct ring_header {
    uint32_t magic;
    uint32_t op;
    uint64_t seq;
    uint64_t size;
    uint32_t root;
    uint32_t pad;
} ring_header;

enum { OP_ALLREDUCE = 1, OP_BROADCAST, OP_ALLGATHER, OP_BARRIER };

static const char *op_name(uint32_t op)
{
    switch (op) {
    case OP_ALLREDUCE:
        return "allreduce";
    case OP_BROADCAST:
        return "broadcast";
    case OP_ALLGATHER:
        return "allgather";
    case OP_BARRIER:
        return "barrier";
    }
    return "unknown";
}

int ring_ms_left(int64_t deadline)
{
    int64_t left = deadline - mono_now_ms();
    if (left < 0) return 0;
    if (left > 1000000) return 1000000;
    return (int)left;
}

static int mod(int x, int w)
{
    return ((x % w) + w) % w;
}

/* ---- plans: what each step sends and receives ---- */

typedef enum { PLAN_ALLREDUCE, PLAN_ALLGATHER, PLAN_BROADCAST } plan_kind;

typedef struct plan {
    plan_kind kind;
    char *buf;
    size_t count; /* allreduce: floats; allgather: bytes per rank; broadcast: bytes */
    int root;
    int nsteps;
    int lag; /* send(t) waits for recv(t - lag); none when t - lag < 0 */
    int rank, world;
} plan;

typedef struct span {
    char *ptr;
    size_t len;
} span;

/* Allreduce segment i: n floats split into W nearly equal parts. */
static span plan_segment(const plan *p, int i)
{
    size_t base = p->count / (size_t)p->world, rem = p->count % (size_t)p->world;
    size_t ui = (size_t)i;
    size_t first = ui * base + (ui < rem ? ui : rem);
    span s = {p->buf + first * sizeof(float), (base + (ui < rem ? 1 : 0)) * sizeof(float)};
    return s;
}

static span plan_block(const plan *p, int i)
{
    span s = {p->buf + (size_t)i * p->count, p->count};
    return s;
}

static span plan_send(const plan *p, int t)
{
    int r = p->rank, w = p->world;
    span none = {NULL, 0};
    switch (p->kind) {
    case PLAN_ALLREDUCE:
        /* reduce-scatter, then all-gather of the segment each rank completed */
        if (t < w - 1) return plan_segment(p, mod(r - t, w));
        return plan_segment(p, mod(r + 1 - (t - (w - 1)), w));
    case PLAN_ALLGATHER:
        return plan_block(p, mod(r - t, w));
    case PLAN_BROADCAST:
        if (mod(r - p->root, w) == w - 1) return none; /* the last one only receives */
        return (span){p->buf, p->count};
    }
    return none;
}

static span plan_recv(const plan *p, int t, int *reduce)
{
    int r = p->rank, w = p->world;
    span none = {NULL, 0};
    *reduce = 0;
    switch (p->kind) {
    case PLAN_ALLREDUCE:
        if (t < w - 1) {
            *reduce = 1;
            return plan_segment(p, mod(r - t - 1, w));
        }
        return plan_segment(p, mod(r - (t - (w - 1)), w));
    case PLAN_ALLGATHER:
        return plan_block(p, mod(r - t - 1, w));
    case PLAN_BROADCAST:
        if (r == p->root) return none;
        return (span){p->buf, p->count};
    }
    return none;
}

/* ---- the transfer engine ---- */

typedef struct xfer {
    ring *g;
    const plan *p;
    ring_header hout, hin;
    size_t hout_off, hin_off;
    int st;       /* send step; nsteps when all sent */
    span ss;      /* its span */
    size_t soff;  /* bytes of it sent */
    int rt;       /* recv step; nsteps when all received */
    span rs;      /* its span */
    int reduce;   /* add incoming floats instead of copying */
    size_t roff;  /* copy: bytes received */
    size_t rdone; /* bytes final in rs (chunk-granular): what dependent sends may use */
    size_t fill;  /* reduce: bytes in the stage for the current chunk */
} xfer;

static comm_err ring_fail(ring *g, comm_err err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Shuts both connections so the neighbours notice at once; the fds stay
 * open (and owned) until ring_destroy, so comm_abort() on another thread
 * never sees a reused descriptor. */
static void ring_shutdown(ring *g)
{
    if (g->left_fd >= 0) shutdown(g->left_fd, SHUT_RDWR);
    if (g->right_fd >= 0) shutdown(g->right_fd, SHUT_RDWR);
}

static comm_err ring_fail(ring *g, comm_err err, const char *fmt, ...)
{
    char line[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    ring_shutdown(g);
    /* comm_abort() shuts the sockets too: what that breaks is the abort. */
    if (comm_is_aborted(&g->base))
        return comm_fail(&g->base, COMM_ERR_ABORTED, "rank %d: aborted", g->base.rank);
    return comm_fail(&g->base, err, "rank %d: %s", g->base.rank, line);
}

int ring_left_rank(const ring *g)
{
    return mod(g->base.rank - 1, g->base.world_size);
}

int ring_right_rank(const ring *g)
{
    return mod(g->base.rank + 1, g->base.world_size);
}

/* Bytes of the current send step that may leave now. */
static size_t xfer_sendable(const xfer *x)
{
    int dep = x->st - x->p->lag;
    if (dep < 0 || x->rt > dep) return x->ss.len;
    if (x->rt == dep) return x->rdone < x->ss.len ? x->rdone : x->ss.len;
    return 0;
}

/* Moves past finished (or empty) steps. */
static void xfer_advance(xfer *x)
{
    const plan *p = x->p;
    while (x->st < p->nsteps && x->soff == x->ss.len) {
        if (++x->st < p->nsteps) x->ss = plan_send(p, x->st);
        x->soff = 0;
    }
    while (x->rt < p->nsteps && x->rdone == x->rs.len) {
        if (++x->rt < p->nsteps) x->rs = plan_recv(p, x->rt, &x->reduce);
        x->roff = x->rdone = x->fill = 0;
    }
}

static int xfer_done(const xfer *x)
{
    return x->hout_off == sizeof(x->hout) && x->hin_off == sizeof(x->hin) &&
           x->st == x->p->nsteps && x->rt == x->p->nsteps;
}

static comm_err xfer_check_header(xfer *x)
{
    const ring_header *a = &x->hout, *b = &x->hin;
    if (b->magic != RING_OP_MAGIC)
        return ring_fail(x->g, COMM_ERR_PEER, "garbage from left neighbour (rank %d)",
                         ring_left_rank(x->g));
    if (a->op != b->op || a->seq != b->seq || a->size != b->size || a->root != b->root)
        return ring_fail(x->g, COMM_ERR_PEER,
                         "collective mismatch: this rank is in %s #%" PRIu64 " (size %" PRIu64
                         ", root %u), rank %d in %s #%" PRIu64 " (size %" PRIu64 ", root %u)",
                         op_name(a->op), a->seq, a->size, a->root, ring_left_rank(x->g),
                         op_name(b->op), b->seq, b->size, b->root);
    return COMM_OK;
}

static comm_err sock_error(ring *g, int err, int peer, const char *what)
{
    if (err == ECONNRESET || err == EPIPE || err == ECONNABORTED || err == ETIMEDOUT ||
        err == EHOSTUNREACH || err == ENETUNREACH || err == ENOTCONN)
        return ring_fail(g, COMM_ERR_PEER, "%s rank %d: %s", what, peer, strerror(err));
    return ring_fail(g, COMM_ERR_SYS, "%s rank %d: %s", what, peer, strerror(err));
}

/* Sends what may leave now, up to about a chunk per call so that sending
 * and receiving take turns; *moved is set when bytes went out. */
static comm_err xfer_send(xfer *x, int *moved)
{
    ring *g = x->g;
    for (size_t sent = 0; sent < g->chunk;) {
        const char *src;
        size_t len;
        if (x->hout_off < sizeof(x->hout)) {
            src = (const char *)&x->hout + x->hout_off;
            len = sizeof(x->hout) - x->hout_off;
        } else {
            xfer_advance(x);
            if (x->st >= x->p->nsteps) return COMM_OK;
            size_t avail = xfer_sendable(x);
            if (avail <= x->soff) return COMM_OK;
            src = x->ss.ptr + x->soff;
            len = avail - x->soff;
            if (len > g->chunk) len = g->chunk;
        }
        ssize_t k = send(g->right_fd, src, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return COMM_OK;
            return sock_error(g, errno, ring_right_rank(g), "send to");
        }
        *moved = 1;
        sent += (size_t)k;
        if (x->hout_off < sizeof(x->hout))
            x->hout_off += (size_t)k;
        else
            x->soff += (size_t)k;
    }
    return COMM_OK;
}

/* dst += src. Written with GCC/Clang vector types because -O2 does not
 * vectorise the plain loop; the memcpys are unaligned loads and stores. */
typedef float f32x4 __attribute__((vector_size(16)));

static void add_f32(float *restrict dst, const float *restrict src, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        f32x4 a0, a1, b0, b1;
        memcpy(&a0, dst + i, sizeof(a0));
        memcpy(&a1, dst + i + 4, sizeof(a1));
        memcpy(&b0, src + i, sizeof(b0));
        memcpy(&b1, src + i + 4, sizeof(b1));
        a0 += b0;
        a1 += b1;
        memcpy(dst + i, &a0, sizeof(a0));
        memcpy(dst + i + 4, &a1, sizeof(a1));
    }
    for (; i < n; i++)
        dst[i] += src[i];
}

/* Receives what has arrived, up to about a chunk per call (a completed
 * chunk may unlock a send: let it go first); *moved is set when bytes came in. */
static comm_err xfer_recv(xfer *x, int *moved)
{
    ring *g = x->g;
    for (size_t got_all = 0; got_all < g->chunk;) {
        char *dst;
        size_t len;
        if (x->hin_off < sizeof(x->hin)) {
            dst = (char *)&x->hin + x->hin_off;
            len = sizeof(x->hin) - x->hin_off;
        } else {
            xfer_advance(x);
            if (x->rt >= x->p->nsteps) return COMM_OK;
            if (x->reduce) {
                size_t cur = x->rs.len - x->rdone;
                if (cur > g->chunk) cur = g->chunk;
                dst = (char *)g->stage + x->fill;
                len = cur - x->fill;
            } else {
                dst = x->rs.ptr + x->roff;
                len = x->rs.len - x->roff;
                if (len > g->chunk) len = g->chunk;
            }
        }
        ssize_t k = recv(g->left_fd, dst, len, MSG_DONTWAIT);
        if (k < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return COMM_OK;
            return sock_error(g, errno, ring_left_rank(g), "receive from");
        }
        if (k == 0)
            return ring_fail(g, COMM_ERR_PEER, "left neighbour (rank %d) closed the connection",
                             ring_left_rank(g));
        *moved = 1;
        size_t got = (size_t)k;
        got_all += got;
        if (x->hin_off < sizeof(x->hin)) {
            x->hin_off += got;
            if (x->hin_off == sizeof(x->hin)) {
                comm_err err = xfer_check_header(x);
                if (err != COMM_OK) return err;
            }
        } else if (x->reduce) {
            x->fill += got;
            size_t cur = x->rs.len - x->rdone;
            if (cur > g->chunk) cur = g->chunk;
            if (x->fill == cur) {
                add_f32((float *)(x->rs.ptr + x->rdone), g->stage, cur / sizeof(float));
                x->rdone += cur;
                x->fill = 0;
            }
        } else {
            x->roff += got;
            x->rdone = x->roff == x->rs.len ? x->roff : x->roff - x->roff % g->chunk;
        }
    }
    return COMM_OK;
}

/* The right neighbour never sends after the hello: readable means it closed
 * (or broke the protocol). Only asked while this rank still owes it bytes,
 * so a neighbour that finished and left is not mistaken for a dead one. */
static comm_err check_right(ring *g)
{
    char b;
    ssize_t k = recv(g->right_fd, &b, 1, MSG_DONTWAIT);
    if (k == 0)
        return ring_fail(g, COMM_ERR_PEER, "right neighbour (rank %d) closed the connection",
                         ring_right_rank(g));
    if (k > 0)
        return ring_fail(g, COMM_ERR_PEER, "unexpected data from right neighbour (rank %d)",
                         ring_right_rank(g));
    if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) return COMM_OK;
    return sock_error(g, errno, ring_right_rank(g), "connection to");
}

int ring_failpoint(const char *name, const char *action)
{
    const char *a = failpoint(name);
    return a && strcmp(a, action) == 0;
}

static comm_err ring_run(ring *g, const plan *p, uint32_t op, uint64_t size, uint32_t root)
{
    if (ring_failpoint("ring.collective", "closed"))
        return ring_fail(g, COMM_ERR_PEER,
                         "left neighbour (rank %d) closed the connection (failpoint "
                         "ring.collective)",
                         ring_left_rank(g));
    xfer x;
    memset(&x, 0, sizeof(x));
    x.g = g;
    x.p = p;
    x.hout = (ring_header){RING_OP_MAGIC, op, g->seq++, size, root, 0};
    x.st = x.rt = 0;
    x.ss = plan_send(p, 0);
    x.rs = plan_recv(p, 0, &x.reduce);

    int64_t deadline = mono_now_ms() + g->timeout_ms;
    for (;;) {
        if (comm_is_aborted(&g->base)) return ring_fail(g, COMM_ERR_ABORTED, "aborted");
        int moved = 0;
        comm_err err = xfer_recv(&x, &moved);
        if (err == COMM_OK) err = xfer_send(&x, &moved);
        if (err != COMM_OK) return err;
        xfer_advance(&x);
        if (xfer_done(&x)) return COMM_OK;
        if (moved) {
            deadline = mono_now_ms() + g->timeout_ms;
            continue; /* try again before sleeping: a receive may have unlocked a send */
        }

        int sending = x.hout_off < sizeof(x.hout) || x.st < p->nsteps;
        int can_send =
            x.hout_off < sizeof(x.hout) || (x.st < p->nsteps && xfer_sendable(&x) > x.soff);
        int receiving = x.hin_off < sizeof(x.hin) || x.rt < p->nsteps;
        struct pollfd pfd[3] = {
            {g->abort_fd, POLLIN, 0},
            {receiving ? g->left_fd : -1, POLLIN, 0},
            {sending ? g->right_fd : -1, (short)(POLLIN | (can_send ? POLLOUT : 0)), 0},
        };
        int left = ring_ms_left(deadline);
        if (left == 0)
            return ring_fail(g, COMM_ERR_TIMEOUT,
                             "no progress for %d ms in %s #%" PRIu64 " (waiting for %s%s%s)",
                             g->timeout_ms, op_name(op), x.hout.seq,
                             receiving ? "left neighbour" : "", receiving && sending ? " and " : "",
                             sending ? "right neighbour" : "");
        int n = poll(pfd, 3, left);
        if (n < 0) {
            if (errno == EINTR) continue;
            return ring_fail(g, COMM_ERR_SYS, "poll: %s", strerror(errno));
        }
        if (pfd[0].revents) return ring_fail(g, COMM_ERR_ABORTED, "aborted");
        if (pfd[2].revents & (POLLIN | POLLHUP | POLLERR)) {
            if (pfd[2].revents & POLLERR) {
                int e = 0;
                socklen_t el = sizeof(e);
                if (getsockopt(g->right_fd, SOL_SOCKET, SO_ERROR, &e, &el) == 0 && e != 0)
                    return sock_error(g, e, ring_right_rank(g), "connection to");
            }
            err = check_right(g);
            if (err != COMM_OK) return err;
        }
        /* POLLIN/POLLHUP/POLLERR on the left is handled by the next recv. */
    }
}

/* ---- collectives ---- */

static comm_err ring_allreduce(comm *c, float *buf, size_t n)
{
    ring *g = (ring *)c;
    if (c->world_size == 1) return COMM_OK;
    plan p = {PLAN_ALLREDUCE,          (char *)buf, n,       0,
              2 * (c->world_size - 1), 1,           c->rank, c->world_size};
    return ring_run(g, &p, OP_ALLREDUCE, n, 0);
}

static comm_err ring_broadcast(comm *c, void *buf, size_t bytes, int root)
{
    ring *g = (ring *)c;
    if (c->world_size == 1) return COMM_OK;
    /* The root waits for nothing; every other rank forwards what arrived. */
    int lag = c->rank == root ? 1 : 0;
    plan p = {PLAN_BROADCAST, buf, bytes, root, 1, lag, c->rank, c->world_size};
    return ring_run(g, &p, OP_BROADCAST, bytes, (uint32_t)root);
}

static comm_err ring_allgather(comm *c, const void *send, size_t bytes, void *recv)
{
    ring *g = (ring *)c;
    char *mine = (char *)recv + (size_t)c->rank * bytes;
    if (mine != send) memmove(mine, send, bytes);
    if (c->world_size == 1) return COMM_OK;
    plan p = {PLAN_ALLGATHER, recv, bytes, 0, c->world_size - 1, 1, c->rank, c->world_size};
    return ring_run(g, &p, OP_ALLGATHER, bytes, 0);
}

/* A one-float allreduce: the value only completes once every rank added
 * its 1, so no rank returns before all have entered. */
static comm_err ring_barrier(comm *c)
{
    ring *g = (ring *)c;
    if (c->world_size == 1) return COMM_OK;
    float one = 1.0f;
    plan p = {PLAN_ALLREDUCE, (char *)&one, 1, 0, 2 * (c->world_size - 1), 1,
              c->rank,        c->world_size};
    comm_err err = ring_run(g, &p, OP_BARRIER, 1, 0);
    if (err == COMM_OK && one != (float)c->world_size)
        return ring_fail(g, COMM_ERR_PEER, "barrier counted %g ranks, expected %d", (double)one,
                         c->world_size);
    return err;
}

static void ring_abort(comm *c)
{
    ring *g = (ring *)c;
    uint64_t one = 1;
    /* Best effort: the flag is already set; the write only wakes poll(). */
    ssize_t k = write(g->abort_fd, &one, sizeof(one));
    (void)k;
    ring_shutdown(g);
}

void ring_destroy(comm *c)
{
    ring *g = (ring *)c;
    if (g->left_fd >= 0) close(g->left_fd);
    if (g->right_fd >= 0) close(g->right_fd);
    if (g->abort_fd >= 0) close(g->abort_fd);
    free(g->stage);
    free(g);
}

static const comm_ops ring_ops = {.name = "ring",
                                  .allreduce_sum_f32 = ring_allreduce,
                                  .broadcast = ring_broadcast,
                                  .allgather = ring_allgather,
                                  .barrier = ring_barrier,
                                  .abort = ring_abort,
                                  .destroy = ring_destroy};

/* ---- construction ---- */

comm_err ring_new(const comm_config *cfg, ring **out)
{
    *out = NULL;
    if (!cfg || cfg->world_size < 1 || cfg->rank < 0 || cfg->rank >= cfg->world_size ||
        cfg->timeout_ms < 0)
        return COMM_ERR_ARG;
    ring *g = calloc(1, sizeof(*g));
    if (!g) return COMM_ERR_NOMEM;
    comm_base_init(&g->base, &ring_ops, cfg->rank, cfg->world_size);
    g->left_fd = g->right_fd = -1;
    g->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : RING_DEFAULT_TIMEOUT_MS;
    size_t chunk = cfg->chunk_bytes ? cfg->chunk_bytes : RING_DEFAULT_CHUNK;
    if (chunk < RING_MIN_CHUNK) chunk = RING_MIN_CHUNK;
    g->chunk = chunk - chunk % sizeof(float);
    comm_err err = COMM_ERR_SYS;
    g->abort_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (g->abort_fd < 0) goto err;
    err = COMM_ERR_NOMEM;
    g->stage = malloc(g->chunk);
    if (!g->stage) goto err;
    *out = g;
    return COMM_OK;
err:
    ring_destroy(&g->base);
    return err;
}

static int set_nonblock(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0) return -1;
    return fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

void ring_set_bufs(int fd)
{
    int sz = RING_SOCKBUF;
    (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof(sz));
    (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof(sz));
}

comm_err ring_ready_fds(ring *g)
{
    int one = 1;
    int fds[2] = {g->left_fd, g->right_fd};
    for (int i = 0; i < 2; i++) {
        ring_set_bufs(fds[i]); /* again: fds from comm_ring_from_fds were made elsewhere */
        if (set_nonblock(fds[i]) < 0)
            return comm_fail(&g->base, COMM_ERR_SYS, "fcntl: %s", strerror(errno));
        /* Not a TCP socket (a socketpair in tests): no Nagle to switch off. */
        if (setsockopt(fds[i], IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) < 0 &&
            errno != EOPNOTSUPP && errno != ENOPROTOOPT)
            return comm_fail(&g->base, COMM_ERR_SYS, "TCP_NODELAY: %s", strerror(errno));
    }
    return COMM_OK;
}

comm_err comm_ring_from_fds(const comm_config *cfg, int left_fd, int right_fd, comm **out)
{
    ring *g = NULL;
    comm_err err = ring_new(cfg, &g);
    if (err != COMM_OK) {
        if (left_fd >= 0) close(left_fd);
        if (right_fd >= 0) close(right_fd);
        return err;
    }
    g->left_fd = left_fd;
    g->right_fd = right_fd;
    if (cfg->world_size > 1) {
        err = ring_ready_fds(g);
        if (err != COMM_OK) goto err;
    }
    *out = &g->base;
    return COMM_OK;
err:
    ring_destroy(&g->base);
    return err;
}
