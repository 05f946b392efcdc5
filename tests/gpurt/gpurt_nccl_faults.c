/* gpurt_nccl_faults.c: test_gpurt_nccl's fault cases (the list is in test_gpurt_nccl.c).
 *
 * A peer SIGKILLed or SIGSTOPped under a queued allreduce, a host pointer
 * and a mismatched collective (the runtime aborts naming them), failpoints
 * (error, hang, async) on one rank, the arguments NCCL refuses, and the
 * bootstrap's refusals of a second rank 1 and of an id with a wrong nonce.
 */
#include "gpurt_nccl_world.h"
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

void test_killed(void)
{
    killed_world(NULL);
}

void test_killed_system(void)
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

void test_stopped(void)
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

void test_host_pointer(void)
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

void test_mismatch(void)
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

void test_failpoint_async(void)
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

void test_failpoints(void)
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

void test_arguments(void)
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

void test_duplicate_rank(void)
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

void test_wrong_id(void)
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
