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
#include "gpurt_nccl_world.h"

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
