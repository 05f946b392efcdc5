/* test_gpurt_nccl.c: the host runtime's NCCL, across real processes.
 *
 *   test_gpurt_nccl [CASE...]
 *
 * Every case forks one child per rank (alarm(60) its deadline). Rank 0's
 * child makes the unique id and passes it to the others over pipes; each
 * child's exit status says whether its checks passed (0), so a rank that
 * hangs, crashes or leaks (LeakSanitizer runs at every child's exit) fails
 * the case. Two more pipes per child let the parent steer the fault cases:
 * a child notes how far it got ('r' up, 'q' queued, ...), the parent kills
 * or stops a rank, then says go.
 *
 *   allreduce2, allreduce3  float sums equal bit for bit on every rank and
 *                           to the rank-order sum (the data is such that
 *                           another order gives other bits), one of 4 MiB;
 *                           int32 sums that wrap, in place; double min
 *   collectives   allgather and reduce-scatter (also in place), broadcast
 *                 from root 1, a send/recv ring in a group (with a send to
 *                 itself), a send that completes before its recv is posted
 *   duplicate_gpu two ranks of one host (one parent process) on device 0:
 *                 the init fails with ncclInvalidUsage, "Duplicate GPU
 *                 detected", on both, as NCCL's does;
 *   nonblocking   init returns ncclInProgress and stays so while a peer is
 *                 missing; finalize returns ncclInProgress, then ncclSuccess
 *                 with the queued allreduce done
 *   killed, killed_system   a peer SIGKILLed: the survivors get
 *                 ncclRemoteError (ncclSystemError, NCCL before 2.13, with
 *                 DUCTILE_GPURT_PEER_ERROR=system), their queued allreduce
 *                 completes only after ncclCommAbort, recv untouched
 *   stopped       a peer SIGSTOPped: no error, the allreduce still pending
 *                 after 1 s, done after ncclCommAbort
 *   host_pointer  a malloc'd buffer to ncclAllReduce: SIGABRT, "gpurt:"
 *   mismatch      ncclAllReduce on one rank, ncclBroadcast on the other:
 *                 SIGABRT naming both
 *   failpoint_async  "ncclAllReduce=2:async:remote" on rank 0
 *   failpoints    error, hang and async on one rank (collectives, init,
 *                 ncclGetUniqueId)
 *   arguments     what NCCL refuses with ncclInvalidArgument, and queues
 *                 nothing for
 *   duplicate_rank, wrong_id  the bootstrap refuses a second rank 1 and an
 *                 id with a wrong nonce
 */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include "th_proc.h"
#include "th_scenario.h"
#include "rt.h"

#define MAX_RANKS 4
#define CHILD_DEADLINE_S 60
#define WAIT_MS 10000 /* for a state that must show up */
#define STILL_MS 1000 /* for one that must not */
#define NAP_NS 2000000L

/* CHECK_OR_RETURN for functions that return nothing. */
#define CHECK_OR_RETURN_VOID(cond, ...) CHECK_THEN_(cond, #cond, check_fail(); return, __VA_ARGS__)

/* ---- the parent's side: a world of child processes ---- */

typedef struct rank_ctx {
    int rank, nranks; /* this process's index and the process count */
    ncclUniqueId id;
    int note_fd, go_fd;
} rank_ctx;

/* A rank's body; returns 0 when its checks passed. */
typedef int (*rank_fn)(rank_ctx *c);

typedef struct world_spec {
    int n;
    rank_fn fn;
    const char *failpoints[MAX_RANKS]; /* DUCTILE_FAILPOINTS of each rank, or NULL */
    const char *peer_error;            /* DUCTILE_GPURT_PEER_ERROR of every rank, or NULL */
    int capture;                       /* stderr comes back in err[] */
} world_spec;

typedef struct world {
    int n;
    pid_t pid[MAX_RANKS];
    int note[MAX_RANKS], go[MAX_RANKS], errfd[MAX_RANKS]; /* the parent's ends, or -1 */
    int status[MAX_RANKS];
    char err[MAX_RANKS][4096];
    size_t errlen[MAX_RANKS];
} world;

typedef struct world_pipes {
    int id[MAX_RANKS][2], note[MAX_RANKS][2], go[MAX_RANKS][2], err[MAX_RANKS][2];
} world_pipes;

static void close_fd(int *fd)
{
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

static void nap(void)
{
    struct timespec ts = {0, NAP_NS};
    nanosleep(&ts, NULL);
}

/* Reads exactly n bytes within ms; 0 or -1. */
static int read_within(int fd, void *buf, size_t n, int ms)
{
    char *p = buf;
    int64_t end = mono_now_ms() + ms;
    while (n > 0) {
        int left = (int)(end - mono_now_ms());
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        int r = left > 0 ? poll(&pf, 1, left) : 0;
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        ssize_t k = read(fd, p, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

static int write_all(int fd, const void *buf, size_t n)
{
    const char *p = buf;
    while (n > 0) {
        ssize_t k = write(fd, p, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

/* In a child: keeps only its own pipe ends (rank 0 also every id pipe's
 * writing end). */
static void child_close(world_pipes *p, int n, int r)
{
    for (int k = 1; k < n; k++) {
        if (r != 0) close_fd(&p->id[k][1]);
        if (k != r) close_fd(&p->id[k][0]);
    }
    for (int k = 0; k < n; k++) {
        if (k == r) continue;
        close_fd(&p->note[k][0]);
        close_fd(&p->note[k][1]);
        close_fd(&p->go[k][0]);
        close_fd(&p->go[k][1]);
        close_fd(&p->err[k][0]);
        close_fd(&p->err[k][1]);
    }
    close_fd(&p->note[r][0]);
    close_fd(&p->go[r][1]);
    close_fd(&p->err[r][0]);
}

/* A child's life: environment, the id, the rank's body, exit(). */
static void child_main(const world_spec *sp, world_pipes *p, int r)
{
    *check_counter() = 0; /* the parent's count is not this rank's */
    alarm(CHILD_DEADLINE_S);
    child_close(p, sp->n, r);
    if (p->err[r][1] >= 0) {
        dup2(p->err[r][1], STDERR_FILENO);
        close_fd(&p->err[r][1]);
    }
    if (sp->failpoints[r])
        setenv("DUCTILE_FAILPOINTS", sp->failpoints[r], 1);
    else
        unsetenv("DUCTILE_FAILPOINTS");
    /* A GPU of its own, as on a real node: NCCL refuses two ranks of one
     * host on one device (these processes share a parent: one host). */
    if (cudaSetDevice(r) != cudaSuccess) {
        fprintf(stderr, "rank %d: cudaSetDevice(%d) failed: DUCTILE_GPURT_DEVICES too small\n", r,
                r);
        _exit(1);
    }
    if (sp->peer_error) setenv("DUCTILE_GPURT_PEER_ERROR", sp->peer_error, 1);
    rank_ctx c = {.rank = r, .nranks = sp->n, .note_fd = p->note[r][1], .go_fd = p->go[r][0]};
    if (r == 0) {
        ncclResult_t res = ncclGetUniqueId(&c.id);
        if (res != ncclSuccess) {
            fprintf(stderr, "ncclGetUniqueId: %s\n", ncclGetErrorString(res));
            exit(2);
        }
        for (int k = 1; k < sp->n; k++)
            if (write_all(p->id[k][1], &c.id, sizeof(c.id)) != 0) exit(2);
    } else if (read_within(p->id[r][0], &c.id, sizeof(c.id), WAIT_MS) != 0) {
        fprintf(stderr, "rank %d: no unique id from rank 0\n", r);
        exit(2);
    }
    int rc = sp->fn(&c);
    fflush(NULL);
    exit(rc != 0 ? rc : check_failures() != 0);
}

static int world_pipes_open(world_pipes *p, const world_spec *sp)
{
    memset(p, -1, sizeof(*p));
    for (int r = 0; r < sp->n; r++)
        if ((r > 0 && pipe(p->id[r]) != 0) || pipe(p->note[r]) != 0 || pipe(p->go[r]) != 0 ||
            (sp->capture && pipe(p->err[r]) != 0))
            return -1;
    return 0;
}

static void world_pipes_close(world_pipes *p)
{
    for (int r = 0; r < MAX_RANKS; r++)
        for (int e = 0; e < 2; e++) {
            close_fd(&p->id[r][e]);
            close_fd(&p->note[r][e]);
            close_fd(&p->go[r][e]);
            close_fd(&p->err[r][e]);
        }
}

/* Forks the ranks; 0, or -1 (said) when the world could not be made. */
static int world_start(world *w, const world_spec *sp)
{
    world_pipes p;
    memset(w, 0, sizeof(*w));
    w->n = sp->n;
    for (int r = 0; r < MAX_RANKS; r++)
        w->note[r] = w->go[r] = w->errfd[r] = w->pid[r] = -1;
    if (world_pipes_open(&p, sp) != 0) {
        world_pipes_close(&p);
        fprintf(stderr, "pipe: %s\n", strerror(errno));
        return -1;
    }
    fflush(NULL);
    for (int r = 0; r < sp->n; r++) {
        w->pid[r] = fork();
        if (w->pid[r] == 0) child_main(sp, &p, r);
        if (w->pid[r] < 0) fprintf(stderr, "fork: %s\n", strerror(errno));
    }
    for (int r = 0; r < sp->n; r++) {
        w->note[r] = p.note[r][0];
        w->go[r] = p.go[r][1];
        w->errfd[r] = p.err[r][0];
        p.note[r][0] = p.go[r][1] = p.err[r][0] = -1;
    }
    world_pipes_close(&p);
    for (int r = 0; r < sp->n; r++)
        if (w->pid[r] < 0) return -1;
    return 0;
}

/* 1 when rank r notes `want` within WAIT_MS. */
static int world_note(world *w, int r, char want)
{
    char c = 0;
    if (read_within(w->note[r], &c, 1, WAIT_MS) != 0) return 0;
    return c == want;
}

static void world_go(world *w, int r)
{
    write_all(w->go[r], "g", 1);
}

/* Reads what the ranks write on stderr until each closes it. */
static void world_drain_stderr(world *w)
{
    int64_t end = mono_now_ms() + (CHILD_DEADLINE_S + 10) * 1000LL;
    for (;;) {
        struct pollfd pf[MAX_RANKS];
        int n = 0, who[MAX_RANKS];
        for (int r = 0; r < w->n; r++)
            if (w->errfd[r] >= 0) {
                pf[n] = (struct pollfd){.fd = w->errfd[r], .events = POLLIN};
                who[n++] = r;
            }
        int left = (int)(end - mono_now_ms());
        if (n == 0 || left <= 0 || (poll(pf, (nfds_t)n, left) < 0 && errno != EINTR)) return;
        for (int i = 0; i < n; i++) {
            int r = who[i];
            char sink[512];
            size_t room = sizeof(w->err[r]) - 1 - w->errlen[r];
            if (!pf[i].revents) continue;
            ssize_t k = read(w->errfd[r], room ? w->err[r] + w->errlen[r] : sink,
                             room ? room : sizeof(sink));
            if (k <= 0 && !(k < 0 && errno == EINTR)) close_fd(&w->errfd[r]);
            if (k > 0 && room) w->errlen[r] += (size_t)k;
            w->err[r][w->errlen[r]] = '\0';
        }
    }
}

/* Waits for every rank (a straggler past its own deadline is killed). */
static void world_finish(world *w)
{
    world_drain_stderr(w);
    th_wait_all(w->pid, w->n, (CHILD_DEADLINE_S + 10) * 1000, w->status, NULL);
    for (int r = 0; r < w->n; r++) {
        close_fd(&w->note[r]);
        close_fd(&w->go[r]);
        close_fd(&w->errfd[r]);
    }
}

static int exited(int status, int code)
{
    return WIFEXITED(status) && WEXITSTATUS(status) == code;
}

static int died_by(int status, int sig)
{
    return WIFSIGNALED(status) && WTERMSIG(status) == sig;
}

/* "exit N" or "signal N", for messages. */
static const char *how(int status)
{
    static char buf[4][32];
    static int i;
    char *b = buf[i++ % 4];
    if (WIFEXITED(status))
        snprintf(b, sizeof(buf[0]), "exit %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status))
        snprintf(b, sizeof(buf[0]), "signal %d", WTERMSIG(status));
    else
        snprintf(b, sizeof(buf[0]), "status %#x", status);
    return b;
}

/* Runs a world to the end; every rank must exit 0. */
static void world_run_clean(const world_spec *sp)
{
    world w;
    CHECK(world_start(&w, sp) == 0);
    world_finish(&w);
    for (int r = 0; r < sp->n; r++)
        CHECK(exited(w.status[r], 0), "rank %d: %s", r, how(w.status[r]));
}

/* ---- the ranks' side ---- */

static void note(rank_ctx *c, char what)
{
    write_all(c->note_fd, &what, 1);
}

/* Waits for the parent's go (the child's alarm bounds it). */
static void wait_go(rank_ctx *c)
{
    char g;
    while (read(c->go_fd, &g, 1) < 0 && errno == EINTR) {
    }
}

static void *dev_alloc(size_t bytes)
{
    void *p = NULL;
    return cudaMalloc(&p, bytes) == cudaSuccess ? p : NULL;
}

static int to_dev(void *d, const void *h, size_t bytes)
{
    return cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice) == cudaSuccess ? 0 : -1;
}

static int from_dev(void *h, const void *d, size_t bytes)
{
    return cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost) == cudaSuccess ? 0 : -1;
}

/* Polls the comm until it leaves ncclInProgress or ms pass; its state. */
static ncclResult_t settle(ncclComm_t comm, int ms)
{
    int64_t end = mono_now_ms() + ms;
    ncclResult_t st = ncclInProgress;
    while (ncclCommGetAsyncError(comm, &st) == ncclSuccess && st == ncclInProgress &&
           mono_now_ms() < end)
        nap();
    return st;
}

/* A call's answer on a blocking or non-blocking comm: 1 once it is
 * queued (ncclSuccess, or ncclInProgress and then settled to ncclSuccess:
 * NCCL launches a non-blocking comm's call later, from its own thread). */
static int issued(ncclComm_t comm, ncclResult_t r)
{
    return r == ncclSuccess || (r == ncclInProgress && settle(comm, WAIT_MS) == ncclSuccess);
}

/* Polls until the comm has an error (neither success nor in progress). */
static ncclResult_t error_within(ncclComm_t comm, int ms)
{
    int64_t end = mono_now_ms() + ms;
    ncclResult_t st = ncclSuccess;
    while (ncclCommGetAsyncError(comm, &st) == ncclSuccess &&
           (st == ncclSuccess || st == ncclInProgress) && mono_now_ms() < end)
        nap();
    return st;
}

/* 1 when s drains within ms (polled: a pending collective never blocks). */
static int drained_within(cudaStream_t s, int ms)
{
    int64_t end = mono_now_ms() + ms;
    for (;;) {
        cudaError_t e = cudaStreamQuery(s);
        if (e != cudaErrorNotReady) return e == cudaSuccess;
        if (mono_now_ms() >= end) return 0;
        nap();
    }
}

/* A comm of nranks as `rank`; NULL (said) when it does not come up. */
static ncclComm_t comm_up(const rank_ctx *c, int nranks, int rank, int blocking)
{
    ncclComm_t comm = NULL;
    if (blocking) {
        ncclResult_t r = ncclCommInitRank(&comm, nranks, c->id, rank);
        CHECK(r == ncclSuccess, "rank %d: ncclCommInitRank: %s", rank, ncclGetErrorString(r));
        return r == ncclSuccess ? comm : NULL;
    }
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&comm, nranks, c->id, rank, &cfg);
    CHECK(r == ncclInProgress, "rank %d: ncclCommInitRankConfig: %s", rank, ncclGetErrorString(r));
    if (r != ncclInProgress) return NULL;
    r = settle(comm, WAIT_MS);
    CHECK(r == ncclSuccess, "rank %d: init: %s (%s)", rank, ncclGetErrorString(r),
          ncclGetLastError(comm));
    if (r == ncclSuccess) return comm;
    ncclCommAbort(comm);
    return NULL;
}

/* Rank r's i-th float: magnitudes 1e-3 to 1e4 mixed, so the sum's rounding
 * depends on the order it is taken in. */
static float input_f(int r, size_t i)
{
    uint32_t h = (uint32_t)i * 2654435761u ^ ((uint32_t)r * 40503u + 17u);
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    float mag = (h & 1) ? 1e4f : 1e-3f;
    return ((float)(h % 20001u) - 10000.0f) * mag / 10000.0f;
}

static uint64_t fnv(const void *p, size_t n)
{
    const unsigned char *b = p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* ---- allreduce ---- */

/* One float sum of n elements; its result's hash goes to the parent. */
static int allreduce_floats(rank_ctx *c, ncclComm_t comm, cudaStream_t s, size_t n)
{
    size_t bytes = n * sizeof(float);
    float *in = malloc(bytes), *want = malloc(bytes), *got = malloc(bytes);
    float *d_in = dev_alloc(bytes), *d_out = dev_alloc(bytes);
    int ok = in && want && got && d_in && d_out;
    for (size_t i = 0; ok && i < n; i++) {
        in[i] = input_f(c->rank, i);
        want[i] = input_f(0, i);
        for (int r = 1; r < c->nranks; r++)
            want[i] += input_f(r, i);
    }
    ok = ok && to_dev(d_in, in, bytes) == 0;
    ncclResult_t res =
        ok ? ncclAllReduce(d_in, d_out, n, ncclFloat, ncclSum, comm, s) : ncclInternalError;
    CHECK(res == ncclSuccess, "rank %d: ncclAllReduce: %s", c->rank, ncclGetErrorString(res));
    ok = ok && res == ncclSuccess && cudaStreamSynchronize(s) == cudaSuccess &&
         from_dev(got, d_out, bytes) == 0;
    CHECK(ok && memcmp(got, want, bytes) == 0, "rank %d: %zu floats differ from the rank-order sum",
          c->rank, n);
    uint64_t h = ok ? fnv(got, bytes) : 0;
    write_all(c->note_fd, &h, sizeof(h));
    free(in), free(want), free(got);
    cudaFree(d_in), cudaFree(d_out);
    return ok ? 0 : 1;
}

/* int32 sums that wrap past INT32_MAX, in place. */
static void allreduce_ints_in_place(rank_ctx *c, ncclComm_t comm, cudaStream_t s)
{
    enum { N = 513 };
    int32_t in[N], got[N], want[N];
    int32_t *d = dev_alloc(sizeof(in));
    for (int i = 0; i < N; i++) {
        in[i] = INT32_MAX - c->rank * 7 - i;
        uint32_t sum = 0;
        for (int r = 0; r < c->nranks; r++)
            sum += (uint32_t)(INT32_MAX - r * 7 - i);
        want[i] = (int32_t)sum;
    }
    CHECK(d && to_dev(d, in, sizeof(in)) == 0);
    CHECK(issued(comm, ncclAllReduce(d, d, N, ncclInt32, ncclSum, comm, s)));
    CHECK(cudaStreamSynchronize(s) == cudaSuccess && from_dev(got, d, sizeof(got)) == 0);
    CHECK(memcmp(got, want, sizeof(got)) == 0, "rank %d: int32 in-place sums", c->rank);
    cudaFree(d);
}

static void allreduce_double_min(rank_ctx *c, ncclComm_t comm, cudaStream_t s)
{
    enum { N = 100 };
    double in[N], got[N];
    double *d_in = dev_alloc(sizeof(in)), *d_out = dev_alloc(sizeof(in));
    for (int i = 0; i < N; i++)
        in[i] = (double)((c->rank * 37 + i * 11) % 29) - 0.5 * c->rank;
    CHECK(d_in && d_out && to_dev(d_in, in, sizeof(in)) == 0);
    CHECK(issued(comm, ncclAllReduce(d_in, d_out, N, ncclDouble, ncclMin, comm, s)));
    CHECK(cudaStreamSynchronize(s) == cudaSuccess && from_dev(got, d_out, sizeof(got)) == 0);
    for (int i = 0; i < N; i++) {
        double want = 1e300;
        for (int r = 0; r < c->nranks; r++) {
            double v = (double)((r * 37 + i * 11) % 29) - 0.5 * r;
            want = v < want ? v : want;
        }
        CHECK(got[i] == want, "rank %d: min[%d] = %g, want %g", c->rank, i, got[i], want);
    }
    cudaFree(d_in), cudaFree(d_out);
}

static int rank_allreduce(rank_ctx *c)
{
    ncclComm_t comm = comm_up(c, c->nranks, c->rank, 1);
    cudaStream_t s;
    CHECK_OR_RETURN(comm && cudaStreamCreate(&s) == cudaSuccess);
    allreduce_floats(c, comm, s, 1031);
    allreduce_floats(c, comm, s, (size_t)1 << 20); /* 4 MiB: frames cross many writes */
    allreduce_ints_in_place(c, comm, s);
    allreduce_double_min(c, comm, s);
    /* A blocking finalize returns done; destroy without one finalizes first. */
    if (c->nranks == 3) CHECK(ncclCommFinalize(comm) == ncclSuccess);
    CHECK(ncclCommDestroy(comm) == ncclSuccess);
    int clean = 0, aborted = 0;
    rt_nccl_teardowns(&clean, &aborted);
    CHECK(clean == 1 && aborted == 0, "%d clean teardowns, %d aborted", clean, aborted);
    cudaStreamDestroy(s);
    return 0;
}

/* The test's own data must be order-sensitive, or bit equality says little. */
static int order_matters(int nranks)
{
    for (size_t i = 0; i < ((size_t)1 << 20); i++) {
        float fwd = input_f(0, i), rev = input_f(nranks - 1, i);
        for (int r = 1; r < nranks; r++)
            fwd += input_f(r, i);
        for (int r = nranks - 2; r >= 0; r--)
            rev += input_f(r, i);
        if (memcmp(&fwd, &rev, sizeof(fwd)) != 0) return 1;
    }
    return 0;
}

static void allreduce_world(int n)
{
    /* Two addends commute; from three on, the order shows in the bits. */
    if (n >= 3) CHECK(order_matters(n), "the inputs sum to the same bits in any order");
    world_spec sp = {.n = n, .fn = rank_allreduce};
    world w;
    uint64_t h[MAX_RANKS][2] = {{0}};
    int started = world_start(&w, &sp) == 0;
    CHECK(started);
    for (int r = 0; started && r < n; r++)
        CHECK(read_within(w.note[r], h[r], sizeof(h[r]), WAIT_MS) == 0, "rank %d: no results", r);
    world_finish(&w);
    for (int r = 0; r < n; r++) {
        CHECK(exited(w.status[r], 0), "rank %d: %s", r, how(w.status[r]));
        CHECK(h[r][0] == h[0][0] && h[r][1] == h[0][1], "rank %d's sums differ from rank 0's", r);
    }
}

static void test_allreduce2(void)
{
    allreduce_world(2);
}

static void test_allreduce3(void)
{
    allreduce_world(3);
}

/* ---- the other collectives and point to point ---- */

static void allgather(rank_ctx *c, ncclComm_t comm, cudaStream_t s)
{
    enum { N = 5 };
    int n = c->nranks;
    int32_t mine[N], all[MAX_RANKS * N], got[MAX_RANKS * N];
    for (int i = 0; i < N; i++)
        mine[i] = c->rank * 100 + i;
    for (int r = 0; r < n; r++)
        for (int i = 0; i < N; i++)
            all[r * N + i] = r * 100 + i;
    int32_t *d_in = dev_alloc(sizeof(mine)), *d_out = dev_alloc(sizeof(all));
    CHECK(d_in && d_out && to_dev(d_in, mine, sizeof(mine)) == 0);
    CHECK(issued(comm, ncclAllGather(d_in, d_out, N, ncclInt32, comm, s)));
    CHECK(cudaStreamSynchronize(s) == cudaSuccess);
    CHECK(from_dev(got, d_out, (size_t)n * sizeof(mine)) == 0 &&
              memcmp(got, all, (size_t)n * sizeof(mine)) == 0,
          "rank %d: allgather", c->rank);
    /* In place: this rank's share already sits at its offset. */
    CHECK(cudaMemset(d_out, 0, sizeof(all)) == cudaSuccess);
    CHECK(to_dev(d_out + c->rank * N, mine, sizeof(mine)) == 0);
    CHECK(issued(comm, ncclAllGather(d_out + c->rank * N, d_out, N, ncclInt32, comm, s)));
    CHECK(cudaStreamSynchronize(s) == cudaSuccess);
    CHECK(from_dev(got, d_out, (size_t)n * sizeof(mine)) == 0 &&
              memcmp(got, all, (size_t)n * sizeof(mine)) == 0,
          "rank %d: in-place allgather", c->rank);
    cudaFree(d_in), cudaFree(d_out);
}

static void broadcast_from_1(rank_ctx *c, ncclComm_t comm, cudaStream_t s)
{
    enum { N = 37 };
    uint8_t root[N], got[N];
    for (int i = 0; i < N; i++)
        root[i] = (uint8_t)(200 - i);
    uint8_t *d_in = dev_alloc(N), *d_out = dev_alloc(N);
    CHECK(d_in && d_out && cudaMemset(d_out, 0, N) == cudaSuccess);
    if (c->rank == 1) CHECK(to_dev(d_in, root, N) == 0);
    CHECK(issued(comm, ncclBroadcast(d_in, d_out, N, ncclUint8, 1, comm, s)));
    CHECK(cudaStreamSynchronize(s) == cudaSuccess && from_dev(got, d_out, N) == 0);
    CHECK(memcmp(got, root, N) == 0, "rank %d: broadcast from 1", c->rank);
    /* In place, as comm_nccl.c calls it. */
    if (c->rank == 1) CHECK(to_dev(d_out, root + 1, N - 1) == 0);
    CHECK(issued(comm, ncclBroadcast(d_out, d_out, N - 1, ncclUint8, 1, comm, s)));
    CHECK(cudaStreamSynchronize(s) == cudaSuccess && from_dev(got, d_out, N - 1) == 0);
    CHECK(memcmp(got, root + 1, N - 1) == 0, "rank %d: in-place broadcast", c->rank);
    cudaFree(d_in), cudaFree(d_out);
}

static void reduce_scatter(rank_ctx *c, ncclComm_t comm, cudaStream_t s)
{
    enum { N = 1000 };
    int n = c->nranks;
    size_t all = (size_t)n * N;
    float *in = malloc(all * sizeof(float)), want[N], got[N];
    CHECK_OR_RETURN_VOID(in);
    for (size_t i = 0; i < all; i++)
        in[i] = input_f(c->rank, i);
    for (int i = 0; i < N; i++) {
        want[i] = input_f(0, (size_t)c->rank * N + (size_t)i);
        for (int r = 1; r < n; r++)
            want[i] += input_f(r, (size_t)c->rank * N + (size_t)i);
    }
    float *d_in = dev_alloc(all * sizeof(float)), *d_out = dev_alloc(sizeof(want));
    CHECK(d_in && d_out && to_dev(d_in, in, all * sizeof(float)) == 0);
    CHECK(issued(comm, ncclReduceScatter(d_in, d_out, N, ncclFloat, ncclSum, comm, s)));
    CHECK(cudaStreamSynchronize(s) == cudaSuccess && from_dev(got, d_out, sizeof(got)) == 0);
    CHECK(memcmp(got, want, sizeof(got)) == 0, "rank %d: reduce-scatter", c->rank);
    /* In place: the result lands on this rank's own chunk. */
    float *mine = d_in + (size_t)c->rank * N;
    CHECK(issued(comm, ncclReduceScatter(d_in, mine, N, ncclFloat, ncclSum, comm, s)));
    CHECK(cudaStreamSynchronize(s) == cudaSuccess && from_dev(got, mine, sizeof(got)) == 0);
    CHECK(memcmp(got, want, sizeof(got)) == 0, "rank %d: in-place reduce-scatter", c->rank);
    free(in);
    cudaFree(d_in), cudaFree(d_out);
}

/* Each rank sends right and receives from the left, and sends to itself,
 * all in one group: receives first, which only a group lets complete. */
static void send_recv_ring(rank_ctx *c, ncclComm_t comm, cudaStream_t s)
{
    enum { N = 257 };
    int n = c->nranks, right = (c->rank + 1) % n, left = (c->rank + n - 1) % n;
    int64_t out[N], self[N], from_left[N], from_self[N];
    for (int i = 0; i < N; i++) {
        out[i] = (int64_t)c->rank << 40 | i;
        self[i] = -out[i];
    }
    int64_t *d_out = dev_alloc(sizeof(out)), *d_self = dev_alloc(sizeof(out));
    int64_t *d_left = dev_alloc(sizeof(out)), *d_back = dev_alloc(sizeof(out));
    CHECK(d_out && d_self && d_left && d_back);
    CHECK(to_dev(d_out, out, sizeof(out)) == 0 && to_dev(d_self, self, sizeof(self)) == 0);
    CHECK(ncclGroupStart() == ncclSuccess);
    CHECK(issued(comm, ncclRecv(d_left, N, ncclInt64, left, comm, s)));
    CHECK(issued(comm, ncclRecv(d_back, N, ncclInt64, c->rank, comm, s)));
    CHECK(issued(comm, ncclSend(d_out, N, ncclInt64, right, comm, s)));
    CHECK(issued(comm, ncclSend(d_self, N, ncclInt64, c->rank, comm, s)));
    CHECK(cudaStreamQuery(s) == cudaSuccess, "a group's calls must wait for ncclGroupEnd");
    CHECK(issued(comm, ncclGroupEnd()));
    CHECK(cudaStreamSynchronize(s) == cudaSuccess);
    CHECK(from_dev(from_left, d_left, sizeof(out)) == 0 &&
          from_dev(from_self, d_back, sizeof(out)) == 0);
    for (int i = 0; i < N; i++) {
        CHECK(from_left[i] == ((int64_t)left << 40 | i), "rank %d: ring[%d]", c->rank, i);
        CHECK(from_self[i] == self[i], "rank %d: self[%d]", c->rank, i);
    }
    cudaFree(d_out), cudaFree(d_self), cudaFree(d_left), cudaFree(d_back);
}

/* Rank 0 sends to rank 1, outside a group, and its stream drains before
 * rank 1 posts the receive: the receiving side buffers. */
static void send_before_recv(rank_ctx *c, ncclComm_t comm, cudaStream_t s)
{
    enum { N = 100 };
    double v[N], got[N];
    for (int i = 0; i < N; i++)
        v[i] = i * 0.25;
    double *d = dev_alloc(sizeof(v));
    CHECK(d && cudaMemset(d, 0, sizeof(v)) == cudaSuccess);
    if (c->rank == 0) {
        CHECK(to_dev(d, v, sizeof(v)) == 0);
        CHECK(issued(comm, ncclSend(d, N, ncclDouble, 1, comm, s)));
        CHECK(drained_within(s, WAIT_MS), "a send waits for its receive");
        note(c, 's');
    } else if (c->rank == 1) {
        wait_go(c);
        CHECK(issued(comm, ncclRecv(d, N, ncclDouble, 0, comm, s)));
        CHECK(cudaStreamSynchronize(s) == cudaSuccess && from_dev(got, d, sizeof(got)) == 0);
        CHECK(memcmp(got, v, sizeof(v)) == 0, "rank 1: the early send's data");
    }
    cudaFree(d);
}

static int rank_collectives(rank_ctx *c)
{
    ncclComm_t comm = comm_up(c, c->nranks, c->rank, 0);
    cudaStream_t s;
    CHECK_OR_RETURN(comm && cudaStreamCreate(&s) == cudaSuccess);
    int count = 0, rank = -1, device = -1;
    CHECK(ncclCommCount(comm, &count) == ncclSuccess && count == c->nranks);
    CHECK(ncclCommUserRank(comm, &rank) == ncclSuccess && rank == c->rank);
    CHECK(ncclCommCuDevice(comm, &device) == ncclSuccess && device == c->rank);
    allgather(c, comm, s);
    broadcast_from_1(c, comm, s);
    reduce_scatter(c, comm, s);
    send_recv_ring(c, comm, s);
    send_before_recv(c, comm, s);
    CHECK(ncclCommFinalize(comm) == ncclInProgress);
    CHECK(settle(comm, WAIT_MS) == ncclSuccess);
    CHECK(ncclCommDestroy(comm) == ncclSuccess);
    cudaStreamDestroy(s);
    return 0;
}

static void test_collectives(void)
{
    world_spec sp = {.n = 3, .fn = rank_collectives};
    world w;
    int started = world_start(&w, &sp) == 0;
    CHECK(started);
    if (started) {
        CHECK(world_note(&w, 0, 's'), "rank 0's send did not complete alone");
        world_go(&w, 1);
    }
    world_finish(&w);
    for (int r = 0; r < sp.n; r++)
        CHECK(exited(w.status[r], 0), "rank %d: %s", r, how(w.status[r]));
}

/* ---- two ranks on one GPU ---- */

static int rank_duplicate_gpu(rank_ctx *c)
{
    CHECK_OR_RETURN(cudaSetDevice(0) == cudaSuccess);
    ncclComm_t comm = NULL;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    CHECK_OR_RETURN(ncclCommInitRankConfig(&comm, 2, c->id, c->rank, &cfg) == ncclInProgress);
    ncclResult_t st = settle(comm, WAIT_MS);
    CHECK(st == ncclInvalidUsage, "rank %d: two ranks on one GPU gave %s", c->rank,
          ncclGetErrorString(st));
    CHECK(strstr(ncclGetLastError(comm), "Duplicate GPU detected"), "%s", ncclGetLastError(comm));
    ncclCommAbort(comm);
    return 0;
}

static void test_duplicate_gpu(void)
{
    world_spec sp = {.n = 2, .fn = rank_duplicate_gpu};
    world w;
    CHECK(world_start(&w, &sp) == 0);
    world_finish(&w);
    for (int r = 0; r < 2; r++)
        CHECK(exited(w.status[r], 0), "rank %d: %s", r, how(w.status[r]));
}

/* ---- non-blocking init and finalize ---- */

static int rank_nonblocking(rank_ctx *c)
{
    if (c->rank == 1) wait_go(c);
    ncclComm_t comm = NULL;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    CHECK_OR_RETURN(ncclCommInitRankConfig(&comm, 2, c->id, c->rank, &cfg) == ncclInProgress);
    float *d = dev_alloc(64 * sizeof(float));
    cudaStream_t s;
    CHECK_OR_RETURN(d && cudaStreamCreate(&s) == cudaSuccess);
    if (c->rank == 0) {
        /* Rank 1 has not started: init cannot finish, nor a call be made. */
        ncclResult_t st = ncclSuccess;
        CHECK(ncclCommGetAsyncError(comm, &st) == ncclSuccess && st == ncclInProgress);
        CHECK(ncclAllReduce(d, d, 64, ncclFloat, ncclSum, comm, s) == ncclInvalidArgument);
        note(c, 'i');
    }
    CHECK_OR_RETURN(settle(comm, WAIT_MS) == ncclSuccess);
    float one[64], got[64];
    for (int i = 0; i < 64; i++)
        one[i] = (float)(i + c->rank);
    CHECK(to_dev(d, one, sizeof(one)) == 0);
    CHECK(issued(comm, ncclAllReduce(d, d, 64, ncclFloat, ncclSum, comm, s)));
    /* Finalize with the allreduce still queued: it must run it to the end. */
    CHECK(ncclCommFinalize(comm) == ncclInProgress);
    CHECK(settle(comm, WAIT_MS) == ncclSuccess);
    CHECK(cudaStreamQuery(s) == cudaSuccess, "finalize finished with work queued");
    CHECK(from_dev(got, d, sizeof(got)) == 0);
    for (int i = 0; i < 64; i++)
        CHECK(got[i] == (float)(2 * i + 1), "sum[%d] = %g", i, got[i]);
    CHECK(ncclAllReduce(d, d, 64, ncclFloat, ncclSum, comm, s) == ncclInvalidUsage);
    CHECK(ncclCommDestroy(comm) == ncclSuccess);
    cudaStreamDestroy(s);
    cudaFree(d);
    return 0;
}

static void test_nonblocking(void)
{
    world_spec sp = {.n = 2, .fn = rank_nonblocking};
    world w;
    int started = world_start(&w, &sp) == 0;
    CHECK(started);
    if (started) {
        CHECK(world_note(&w, 0, 'i'));
        world_go(&w, 1);
    }
    world_finish(&w);
    for (int r = 0; r < sp.n; r++)
        CHECK(exited(w.status[r], 0), "rank %d: %s", r, how(w.status[r]));
}

/* ---- a peer killed, a peer stopped ---- */

#define SENTINEL 0x5a

/* A survivor's allreduce, queued while every peer is alive. */
typedef struct pending {
    ncclComm_t comm;
    cudaStream_t s;
    unsigned char *d_in, *d_out;
} pending;

static int pending_start(rank_ctx *c, pending *p)
{
    enum { N = 256 };
    p->comm = comm_up(c, c->nranks, c->rank, 0);
    CHECK_OR_RETURN(p->comm && cudaStreamCreate(&p->s) == cudaSuccess);
    p->d_in = dev_alloc(N * sizeof(float));
    p->d_out = dev_alloc(N * sizeof(float));
    CHECK_OR_RETURN(p->d_in && p->d_out);
    CHECK_OR_RETURN(cudaMemset(p->d_in, 0, N * sizeof(float)) == cudaSuccess);
    CHECK_OR_RETURN(cudaMemset(p->d_out, SENTINEL, N * sizeof(float)) == cudaSuccess);
    note(c, 'r');
    wait_go(c);
    CHECK_OR_RETURN(
        issued(p->comm, ncclAllReduce(p->d_in, p->d_out, N, ncclFloat, ncclSum, p->comm, p->s)));
    return 0;
}

/* After ncclCommAbort: the allreduce completes, its recv untouched. */
static void pending_end(rank_ctx *c, pending *p)
{
    CHECK(ncclCommAbort(p->comm) == ncclSuccess);
    CHECK(drained_within(p->s, WAIT_MS), "rank %d: the allreduce survived the abort", c->rank);
    unsigned char got[256 * sizeof(float)];
    CHECK(from_dev(got, p->d_out, sizeof(got)) == 0);
    for (size_t i = 0; i < sizeof(got); i++)
        if (got[i] != SENTINEL) {
            CHECK(got[i] == SENTINEL, "rank %d: recv[%zu] written by an aborted allreduce", c->rank,
                  i);
            break;
        }
    cudaStreamDestroy(p->s);
    cudaFree(p->d_in), cudaFree(p->d_out);
}

static int rank_victim(rank_ctx *c)
{
    ncclComm_t comm = comm_up(c, c->nranks, c->rank, 0);
    CHECK_OR_RETURN(comm);
    note(c, 'r');
    for (;;)
        pause(); /* killed or stopped by the parent */
}

static int rank_killed(rank_ctx *c)
{
    if (c->rank == 2) return rank_victim(c);
    const char *pe = getenv("DUCTILE_GPURT_PEER_ERROR");
    ncclResult_t want = pe && strcmp(pe, "system") == 0 ? ncclSystemError : ncclRemoteError;
    pending p;
    CHECK_OR_RETURN(pending_start(c, &p) == 0);
    note(c, 'q');
    ncclResult_t st = error_within(p.comm, WAIT_MS);
    CHECK(st == want, "rank %d: async error %s, want %s", c->rank, ncclGetErrorString(st),
          ncclGetErrorString(want));
    char reason[128];
    snprintf(reason, sizeof(reason), "rank %d: connection to rank 2 closed", c->rank);
    CHECK(strstr(ncclGetLastError(p.comm), reason), "reason '%s'", ncclGetLastError(p.comm));
    CHECK(cudaStreamQuery(p.s) == cudaErrorNotReady, "an allreduce with a dead peer completed");
    CHECK(ncclAllReduce(p.d_in, p.d_out, 1, ncclFloat, ncclSum, p.comm, p.s) == want);
    note(c, 'e');
    wait_go(c); /* both survivors have looked: an abort now is no news to the other */
    pending_end(c, &p);
    int clean = 0, aborted = 0;
    rt_nccl_teardowns(&clean, &aborted);
    CHECK(clean == 0 && aborted == 1, "%d clean teardowns, %d aborted", clean, aborted);
    return 0;
}

static void killed_world(const char *peer_error)
{
    world_spec sp = {.n = 3, .fn = rank_killed, .peer_error = peer_error};
    world w;
    int ok = world_start(&w, &sp) == 0;
    CHECK(ok);
    for (int r = 0; ok && r < 3; r++)
        ok = world_note(&w, r, 'r');
    for (int r = 0; ok && r < 2; r++)
        world_go(&w, r);
    for (int r = 0; ok && r < 2; r++)
        ok = world_note(&w, r, 'q');
    if (w.pid[2] > 0) kill(w.pid[2], SIGKILL);
    for (int r = 0; ok && r < 2; r++)
        ok = world_note(&w, r, 'e');
    for (int r = 0; r < 2; r++)
        world_go(&w, r);
    CHECK(ok, "the ranks did not get as far as they should");
    world_finish(&w);
    for (int r = 0; r < 2; r++)
        CHECK(exited(w.status[r], 0), "rank %d: %s", r, how(w.status[r]));
    CHECK(died_by(w.status[2], SIGKILL), "rank 2: %s", how(w.status[2]));
}

static void test_killed(void)
{
    killed_world(NULL);
}

static void test_killed_system(void)
{
    killed_world("system");
}

static int rank_stopped(rank_ctx *c)
{
    if (c->rank == 2) return rank_victim(c);
    pending p;
    CHECK_OR_RETURN(pending_start(c, &p) == 0);
    int64_t end = mono_now_ms() + STILL_MS;
    while (mono_now_ms() < end) {
        ncclResult_t st = ncclInProgress;
        CHECK_OR_RETURN(ncclCommGetAsyncError(p.comm, &st) == ncclSuccess && st == ncclSuccess,
                        "rank %d: a stalled peer gave %s", c->rank, ncclGetErrorString(st));
        CHECK_OR_RETURN(cudaStreamQuery(p.s) == cudaErrorNotReady,
                        "rank %d: an allreduce with a stalled peer completed", c->rank);
        nap();
    }
    note(c, 'p');
    wait_go(c);
    pending_end(c, &p);
    return 0;
}

static void test_stopped(void)
{
    world_spec sp = {.n = 3, .fn = rank_stopped};
    world w;
    int ok = world_start(&w, &sp) == 0;
    CHECK(ok);
    for (int r = 0; ok && r < 3; r++)
        ok = world_note(&w, r, 'r');
    if (ok) kill(w.pid[2], SIGSTOP);
    for (int r = 0; ok && r < 2; r++)
        world_go(&w, r);
    for (int r = 0; ok && r < 2; r++)
        ok = world_note(&w, r, 'p');
    for (int r = 0; r < 2; r++)
        world_go(&w, r);
    CHECK(ok, "the ranks did not get as far as they should");
    if (w.pid[2] > 0) kill(w.pid[2], SIGKILL);
    world_finish(&w);
    for (int r = 0; r < 2; r++)
        CHECK(exited(w.status[r], 0), "rank %d: %s", r, how(w.status[r]));
}

/* ---- misuse that must crash ---- */

static int rank_host_pointer(rank_ctx *c)
{
    ncclComm_t comm = comm_up(c, 1, 0, 1);
    CHECK_OR_RETURN(comm);
    float *host = calloc(64, sizeof(float));
    ncclAllReduce(host, host, 64, ncclFloat, ncclSum, comm, NULL);
    fprintf(stderr, "ncclAllReduce took a host pointer\n");
    free(host);
    ncclCommAbort(comm);
    return 1;
}

static void test_host_pointer(void)
{
    world_spec sp = {.n = 1, .fn = rank_host_pointer, .capture = 1};
    world w;
    CHECK(world_start(&w, &sp) == 0);
    world_finish(&w);
    CHECK(died_by(w.status[0], SIGABRT), "%s", how(w.status[0]));
    CHECK(strstr(w.err[0], "gpurt:") && strstr(w.err[0], "ncclAllReduce") &&
              strstr(w.err[0], "sendbuff"),
          "stderr: %s", w.err[0]);
}

static int rank_mismatch(rank_ctx *c)
{
    ncclComm_t comm = comm_up(c, 2, c->rank, 0);
    cudaStream_t s;
    float *d = dev_alloc(16 * sizeof(float));
    CHECK_OR_RETURN(comm && d && cudaStreamCreate(&s) == cudaSuccess);
    ncclResult_t r = c->rank == 0 ? ncclAllReduce(d, d, 16, ncclFloat, ncclSum, comm, s)
                                  : ncclBroadcast(d, d, 16, ncclFloat, 0, comm, s);
    CHECK_OR_RETURN(r == ncclInProgress);
    /* Dies in there; if the other rank died first, its loss shows here. */
    int64_t end = mono_now_ms() + WAIT_MS;
    while (mono_now_ms() < end) {
        ncclResult_t st = ncclSuccess;
        if (ncclCommGetAsyncError(comm, &st) != ncclSuccess) _exit(4);
        if (st != ncclSuccess && st != ncclInProgress) _exit(4);
        if (st == ncclSuccess && cudaStreamQuery(s) == cudaSuccess) return 3;
        nap();
    }
    return 5;
}

static void test_mismatch(void)
{
    world_spec sp = {.n = 2, .fn = rank_mismatch, .capture = 1};
    world w;
    CHECK(world_start(&w, &sp) == 0);
    world_finish(&w);
    int named = 0;
    for (int r = 0; r < 2; r++) {
        CHECK(died_by(w.status[r], SIGABRT) || exited(w.status[r], 4), "rank %d: %s: %s", r,
              how(w.status[r]), w.err[r]);
        named |= died_by(w.status[r], SIGABRT) && strstr(w.err[r], "gpurt:") &&
                 strstr(w.err[r], "ncclAllReduce") && strstr(w.err[r], "ncclBroadcast");
    }
    CHECK(named, "no rank died naming both calls: '%s' '%s'", w.err[0], w.err[1]);
}

/* ---- failpoints ---- */

/* Rank 0's second allreduce succeeds as a call and fails the comm with
 * ncclRemoteError; rank 1 waits in the same allreduce until rank 0's abort
 * closes the connection. */
static int rank_failpoint_async(rank_ctx *c)
{
    ncclComm_t comm = comm_up(c, 2, c->rank, 0);
    cudaStream_t s;
    float *d = dev_alloc(8 * sizeof(float)), got[8], one[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    CHECK_OR_RETURN(comm && d && cudaStreamCreate(&s) == cudaSuccess);
    CHECK(to_dev(d, one, sizeof(one)) == 0);
    CHECK(issued(comm, ncclAllReduce(d, d, 8, ncclFloat, ncclSum, comm, s)));
    CHECK(cudaStreamSynchronize(s) == cudaSuccess && from_dev(got, d, sizeof(got)) == 0);
    CHECK(got[7] == 2.0f, "the first allreduce gave %g", got[7]);
    /* Non-blocking: the call answers ncclInProgress, its state is the failure. */
    CHECK(ncclAllReduce(d, d, 8, ncclFloat, ncclSum, comm, s) == ncclInProgress);
    ncclResult_t st = ncclSuccess;
    if (c->rank == 0) {
        CHECK(ncclCommGetAsyncError(comm, &st) == ncclSuccess && st == ncclRemoteError,
              "async error %s", ncclGetErrorString(st));
        CHECK(strstr(ncclGetLastError(comm), "failpoint"), "%s", ncclGetLastError(comm));
        CHECK(!drained_within(s, 200), "an allreduce of a failed comm completed");
        CHECK(ncclAllReduce(d, d, 8, ncclFloat, ncclSum, comm, s) == ncclRemoteError);
    } else {
        st = error_within(comm, WAIT_MS);
        CHECK(st == ncclRemoteError, "rank 1: %s", ncclGetErrorString(st));
        CHECK(strstr(ncclGetLastError(comm), "rank 1: connection to rank 0 closed"), "%s",
              ncclGetLastError(comm));
        CHECK(cudaStreamQuery(s) == cudaErrorNotReady);
    }
    CHECK(ncclCommAbort(comm) == ncclSuccess);
    CHECK(drained_within(s, WAIT_MS));
    cudaStreamDestroy(s);
    cudaFree(d);
    return 0;
}

static void test_failpoint_async(void)
{
    world_spec sp = {.n = 2,
                     .fn = rank_failpoint_async,
                     .failpoints = {"gpurt.nccl.ncclAllReduce=2:async:remote"}};
    world_run_clean(&sp);
}

/* One rank, one comm per failpoint (DUCTILE_FAILPOINTS below). */
static void failpoint_error_then_hang(rank_ctx *c)
{
    ncclComm_t comm = comm_up(c, 1, 0, 0); /* ncclCommInitRankConfig #1 */
    cudaStream_t s;
    float *d = dev_alloc(4 * sizeof(float)), got[4], v[4] = {1, 2, 3, 4};
    CHECK_OR_RETURN_VOID(comm && d && cudaStreamCreate(&s) == cudaSuccess);
    CHECK(to_dev(d, v, sizeof(v)) == 0);
    CHECK(ncclAllReduce(d, d, 4, ncclFloat, ncclSum, comm, s) == ncclSystemError); /* #1 */
    CHECK(cudaStreamQuery(s) == cudaSuccess, "a failed call queued work");
    CHECK(issued(comm, ncclAllReduce(d, d, 4, ncclFloat, ncclSum, comm, s))); /* #2 */
    CHECK(cudaStreamSynchronize(s) == cudaSuccess && from_dev(got, d, sizeof(got)) == 0);
    CHECK(memcmp(got, v, sizeof(v)) == 0, "a world of one sums to itself");
    CHECK(issued(comm, ncclBroadcast(d, d, 4, ncclFloat, 0, comm, s))); /* hangs */
    ncclResult_t st = ncclInProgress;
    CHECK(!drained_within(s, 300), "a hung broadcast completed");
    CHECK(ncclCommGetAsyncError(comm, &st) == ncclSuccess && st == ncclSuccess);
    CHECK(ncclCommAbort(comm) == ncclSuccess);
    CHECK(cudaStreamQuery(s) == cudaErrorNotReady, "hang means never, even aborted");
    cudaStreamDestroy(s); /* drops the hung op */
    cudaFree(d);
}

static void failpoint_init_hang(void)
{
    ncclUniqueId id;
    ncclComm_t comm = NULL;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    CHECK_OR_RETURN_VOID(ncclGetUniqueId(&id) == ncclSuccess);              /* #2 */
    CHECK(ncclCommInitRankConfig(&comm, 1, id, 0, &cfg) == ncclInProgress); /* #2: hangs */
    CHECK(settle(comm, 300) == ncclInProgress, "a hung init finished");
    CHECK(ncclCommAbort(comm) == ncclSuccess);
}

static void failpoint_async_allgather(void)
{
    ncclUniqueId id;
    ncclComm_t comm = NULL;
    cudaStream_t s;
    float *d = dev_alloc(4 * sizeof(float));
    CHECK_OR_RETURN_VOID(d && cudaStreamCreate(&s) == cudaSuccess);
    CHECK_OR_RETURN_VOID(ncclGetUniqueId(&id) == ncclSuccess); /* #3 */
    CHECK_OR_RETURN_VOID(ncclCommInitRank(&comm, 1, id, 0) == ncclSuccess);
    CHECK(cudaMemset(d, 0, 4 * sizeof(float)) == cudaSuccess);
    CHECK(ncclAllGather(d, d + 2, 2, ncclFloat, comm, s) == ncclSuccess); /* async */
    ncclResult_t st = ncclSuccess;
    CHECK(ncclCommGetAsyncError(comm, &st) == ncclSuccess && st == ncclRemoteError,
          "plain async gave %s", ncclGetErrorString(st));
    CHECK(!drained_within(s, 100));
    CHECK(ncclCommAbort(comm) == ncclSuccess);
    CHECK(drained_within(s, WAIT_MS));
    CHECK(ncclGetUniqueId(&id) == ncclSystemError); /* #4 */
    cudaStreamDestroy(s);
    cudaFree(d);
}

static int rank_failpoints(rank_ctx *c)
{
    failpoint_error_then_hang(c);
    failpoint_init_hang();
    failpoint_async_allgather();
    return 0;
}

static void test_failpoints(void)
{
    world_spec sp = {.n = 1,
                     .fn = rank_failpoints,
                     .failpoints = {"gpurt.nccl.ncclAllReduce=1:error;"
                                    "gpurt.nccl.ncclBroadcast=1:hang;"
                                    "gpurt.nccl.ncclCommInitRankConfig=2:hang;"
                                    "gpurt.nccl.ncclAllGather=1:async;"
                                    "gpurt.nccl.ncclGetUniqueId=4:error"}};
    world_run_clean(&sp);
}

/* ---- arguments ---- */

static int rank_arguments(rank_ctx *c)
{
    int version = 0;
    CHECK(ncclGetVersion(&version) == ncclSuccess && version == NCCL_VERSION_CODE);
    ncclComm_t comm = comm_up(c, 1, 0, 1);
    cudaStream_t s;
    float *d = dev_alloc(16 * sizeof(float));
    CHECK_OR_RETURN(comm && d && cudaStreamCreate(&s) == cudaSuccess);
    const ncclResult_t bad = ncclInvalidArgument;
    CHECK(ncclAllReduce(d, d, 4, ncclFloat, ncclSum, NULL, s) == bad);
    CHECK(ncclAllReduce(d, d, 4, (ncclDataType_t)99, ncclSum, comm, s) == bad);
    CHECK(ncclAllReduce(d, d, 4, ncclFloat, (ncclRedOp_t)17, comm, s) == bad);
    CHECK(ncclAllReduce(d, d, 4, ncclFloat, ncclAvg, comm, s) == bad);
    CHECK(ncclAllReduce(d, d, 4, ncclHalf, ncclSum, comm, s) == bad);
    CHECK(ncclAllReduce(NULL, d, 4, ncclFloat, ncclSum, comm, s) == bad);
    CHECK(ncclBroadcast(d, d, 4, ncclFloat, 1, comm, s) == bad);
    CHECK(ncclSend(d, 4, ncclFloat, -1, comm, s) == bad);
    CHECK(ncclRecv(d, 4, ncclFloat, 1, comm, s) == bad);
    CHECK(strstr(ncclGetLastError(NULL), "peer 1"), "%s", ncclGetLastError(NULL));
    CHECK(ncclGroupEnd() == ncclInvalidUsage);
    CHECK(cudaStreamQuery(s) == cudaSuccess, "a refused call queued work");
    /* Moved, never reduced: 16-bit floats still broadcast. */
    CHECK(issued(comm, ncclBroadcast(d, d, 8, ncclHalf, 0, comm, s)));
    CHECK(issued(comm, ncclAllReduce(d, d, 0, ncclFloat, ncclSum, comm, s)));
    CHECK(cudaStreamSynchronize(s) == cudaSuccess);
    ncclComm_t none = NULL;
    ncclUniqueId junk;
    memset(&junk, 0, sizeof(junk));
    CHECK(ncclCommInitRank(&none, 1, junk, 0) == bad && !none);
    CHECK(ncclCommInitRank(&none, 2, c->id, 2) == bad && !none);
    CHECK(ncclCommDestroy(comm) == ncclSuccess);
    cudaStreamDestroy(s);
    cudaFree(d);
    return 0;
}

static void test_arguments(void)
{
    world_spec sp = {.n = 1, .fn = rank_arguments};
    world_run_clean(&sp);
}

/* ---- the bootstrap refuses strangers ---- */

/* Processes 1 and 2 both claim rank 1 of 2, before rank 0 registers: the
 * second is refused (exit 10), the first makes a comm with rank 0. */
static int rank_duplicate(rank_ctx *c)
{
    if (c->rank == 0) wait_go(c);
    int rank = c->rank == 0 ? 0 : 1;
    ncclComm_t comm = NULL;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    CHECK_OR_RETURN(ncclCommInitRankConfig(&comm, 2, c->id, rank, &cfg) == ncclInProgress);
    int64_t end = mono_now_ms() + WAIT_MS;
    ncclResult_t st = ncclInProgress;
    while (st == ncclInProgress && mono_now_ms() < end) {
        CHECK_OR_RETURN(ncclCommGetAsyncError(comm, &st) == ncclSuccess);
        if (st == ncclInvalidUsage) {
            CHECK(strstr(ncclGetLastError(comm), "refused rank 1"), "%s", ncclGetLastError(comm));
            note(c, 'x');
            ncclCommAbort(comm);
            return check_failures() ? 1 : 10;
        }
        nap();
    }
    CHECK_OR_RETURN(st == ncclSuccess, "%s: %s", ncclGetErrorString(st), ncclGetLastError(comm));
    cudaStream_t s;
    float *d = dev_alloc(sizeof(float)), one = 1.0f, got = 0;
    CHECK_OR_RETURN(d && cudaStreamCreate(&s) == cudaSuccess && to_dev(d, &one, 4) == 0);
    CHECK(issued(comm, ncclAllReduce(d, d, 1, ncclFloat, ncclSum, comm, s)));
    CHECK(cudaStreamSynchronize(s) == cudaSuccess && from_dev(&got, d, 4) == 0 && got == 2.0f);
    CHECK(ncclCommDestroy(comm) == ncclSuccess);
    cudaStreamDestroy(s);
    cudaFree(d);
    return 0;
}

/* The note of whichever of ranks 1 and 2 was refused. */
static int refused_note(world *w)
{
    struct pollfd pf[2] = {{.fd = w->note[1], .events = POLLIN},
                           {.fd = w->note[2], .events = POLLIN}};
    if (poll(pf, 2, WAIT_MS) <= 0) return 0;
    return world_note(w, pf[0].revents ? 1 : 2, 'x');
}

static void test_duplicate_rank(void)
{
    world_spec sp = {.n = 3, .fn = rank_duplicate};
    world w;
    int ok = world_start(&w, &sp) == 0;
    CHECK(ok);
    CHECK(ok && refused_note(&w), "neither rank 1 was refused");
    world_go(&w, 0);
    world_finish(&w);
    CHECK(exited(w.status[0], 0), "rank 0: %s", how(w.status[0]));
    CHECK((exited(w.status[1], 0) && exited(w.status[2], 10)) ||
              (exited(w.status[1], 10) && exited(w.status[2], 0)),
          "the two rank 1s: %s, %s", how(w.status[1]), how(w.status[2]));
}

/* Rank 1 holds an id whose nonce is not the root's: the root drops it. */
static int rank_wrong_id(rank_ctx *c)
{
    ncclComm_t comm = NULL;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    if (c->rank == 1) c->id.internal[16] ^= 1; /* the nonce: see nc_id in rt_nccl.c */
    CHECK_OR_RETURN(ncclCommInitRankConfig(&comm, 2, c->id, c->rank, &cfg) == ncclInProgress);
    if (c->rank == 1) {
        ncclResult_t st = settle(comm, WAIT_MS);
        CHECK(st == ncclRemoteError, "a wrong nonce gave %s", ncclGetErrorString(st));
        CHECK(strstr(ncclGetLastError(comm), "bootstrap root"), "%s", ncclGetLastError(comm));
        note(c, 'x');
    } else {
        wait_go(c);
        CHECK(settle(comm, 300) == ncclInProgress, "init finished without rank 1");
    }
    CHECK(ncclCommAbort(comm) == ncclSuccess);
    return 0;
}

static void test_wrong_id(void)
{
    world_spec sp = {.n = 2, .fn = rank_wrong_id};
    world w;
    int ok = world_start(&w, &sp) == 0;
    CHECK(ok && world_note(&w, 1, 'x'));
    world_go(&w, 0);
    world_finish(&w);
    for (int r = 0; r < 2; r++)
        CHECK(exited(w.status[r], 0), "rank %d: %s", r, how(w.status[r]));
}

int main(int argc, char **argv)
{
    setenv("DUCTILE_GPURT_DEVICES", "1", 0);
    unsetenv("DUCTILE_FAILPOINTS"); /* each case's ranks set their own */
    unsetenv("DUCTILE_GPURT_PEER_ERROR");
    static const th_case cases[] = {
        {"allreduce2", test_allreduce2},
        {"allreduce3", test_allreduce3},
        {"collectives", test_collectives},
        {"duplicate_gpu", test_duplicate_gpu},
        {"nonblocking", test_nonblocking},
        {"killed", test_killed},
        {"killed_system", test_killed_system},
        {"stopped", test_stopped},
        {"host_pointer", test_host_pointer},
        {"mismatch", test_mismatch},
        {"failpoint_async", test_failpoint_async},
        {"failpoints", test_failpoints},
        {"arguments", test_arguments},
        {"duplicate_rank", test_duplicate_rank},
        {"wrong_id", test_wrong_id},
    };
    th_run_cases(cases, TH_COUNT(cases), argc, argv, 1, NULL);
    return check_finish("test_gpurt_nccl");
}
