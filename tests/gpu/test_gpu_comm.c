/* test_gpu_comm.c: the NCCL collectives backend (trainer/comm_nccl.c) on the
 * host test runtime, one process per rank, through a real etcd round store.
 *
 *   test_gpu_comm CASE      (ctest runs each case as its own process, so a
 *                            case's DUCTILE_FAILPOINTS is read fresh)
 *
 * Cases, each the test of one way the backend used to break:
 *   host_buffers   host memory to every collective (the state sync's
 *                  claims, a broadcast from the last rank, an all-reduce
 *                  larger than one staging chunk): right values, no abort
 *                  for a host pointer handed to NCCL;
 *   finalize       a healthy communicator's comm_free finalizes and
 *                  destroys it: nothing is aborted;
 *   peer_remote    a peer dies under a collective and the runtime says
 *                  ncclRemoteError (NCCL 2.13 and later): the survivors get
 *                  COMM_ERR_PEER, a peer's loss, not their own failure;
 *   peer_system    the same with ncclSystemError (NCCL before 2.13): the
 *                  survivors count it as their own (COMM_ERR_NCCL), since
 *                  a system error is a local one on NCCL 2.28;
 *   local_system   every peer alive, one rank's allreduce fails with an
 *   local_error    async ncclSystemError (or the call returns it): that
 *                  rank's own failure (COMM_ERR_NCCL), and the others'
 *                  a peer's loss once it has torn its comm down;
 *   peer_free_first  the same, then the buffer is freed before the comm (the
 *                  reducer's order): the failed collective left nothing queued
 *                  on it (the runtime reports a free under queued work);
 *   peer_late      the same, but the survivors call the collective a second
 *                  after the peer died, so the runtime has (almost always)
 *                  seen the loss already and the call itself returns the
 *                  error: a peer's loss whichever way it arrives;
 *   mixed_cpu0     rank 0 trains on the CPU (--device auto found no GPU
 *                  on its node), ranks 1 and 2 on CUDA: rank 0 refuses the
 *                  round and every rank fails with one line naming rank
 *                  0's node (COMM_ERR_ARG, not a deadline);
 *   mixed_cpu1     rank 1 on the CPU, rank 0 on CUDA: rank 1 fails at once
 *                  naming its own node (its agent's report then ends the
 *                  round for the CUDA ranks, which here just time out);
 *   cancel         a peer never comes to the init, and the round is declared
 *                  over (the cancel hook): the init ends COMM_ERR_ABORTED
 *                  (or, on a rank that sees rank 0's root go first, a
 *                  peer's loss), not after its 60 s deadline;
 *   deadlines      the id wait and the init have a deadline each: a rank
 *                  that waited most of its deadline for the id still has a
 *                  whole one for the init (rank 0 comes 5 s late, rank 2
 *                  9.5 s late, with 8 s deadlines);
 *   teardown_error a failed stream sync while the reducer's gradient
 *                  buffer is freed is kept as the context's error, naming
 *                  the call (gpu_status), not dropped;
 *   staging_error  a failed staging copy (failpoint) is COMM_ERR_CUDA with
 *                  the call named in the comm's error line.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ductile/clock.h"
#include "ductile/comm.h"
#include "ductile/elastic.h"
#include "gpu_test.h"
#include "rt.h"
#include "test_comm_launch.h"
#include "test_etcd.h"
#include "th_scenario.h"

#define BIG_FLOATS ((size_t)5 << 20) /* 20 MiB: several staging chunks */

/* A communicator of g's round for rank, with this config's deadline and hook. */
static comm_err connect_with(tc_group *g, int rank, int timeout_ms, int (*cancelled)(void *),
                             comm **out)
{
    rdzv_etcd e = {0};
    e.endpoints = g->etcd;
    rdzv_store *s = NULL;
    if (rdzv_store_open(&e, g->job, g->round, &s) != RDZV_OK) return COMM_ERR_STORE;
    char why[COMM_MSG_MAX] = "";
    comm_config cfg = {.rank = rank,
                       .world_size = g->world,
                       .store = s,
                       .timeout_ms = timeout_ms,
                       .device = rank,
                       .msg = why,
                       .cancelled = cancelled};
    comm_err err = comm_nccl_init(&cfg, out);
    if (err != COMM_OK) fprintf(stderr, "rank %d: init: %s: %s\n", rank, comm_strerror(err), why);
    rdzv_store_close(s);
    return err;
}

/* ---- host_buffers ---- */

static int host_buffers_rank(tc_group *g, int rank, void *arg)
{
    (void)arg;
    int w = g->world;
    comm *c = tc_connect_or_exit(g, rank);
    elastic_claim mine = {1, rank, 10 * rank}, all[TC_MAX_RANKS];
    CHECK_OR_RETURN(comm_allgather(c, &mine, sizeof(mine), all) == COMM_OK, "%s",
                    comm_last_error(c));
    for (int r = 0; r < w; r++)
        CHECK_OR_RETURN(all[r].round == r && all[r].step == 10 * r, "claim of rank %d", r);
    char text[64];
    snprintf(text, sizeof(text), rank == w - 1 ? "from the last rank" : "not yet");
    CHECK_OR_RETURN(comm_broadcast(c, text, sizeof(text), w - 1) == COMM_OK, "%s",
                    comm_last_error(c));
    CHECK_OR_RETURN(strcmp(text, "from the last rank") == 0, "rank %d got '%s'", rank, text);
    float *big = malloc(sizeof(float) * BIG_FLOATS);
    CHECK_OR_RETURN(big);
    for (size_t i = 0; i < BIG_FLOATS; i++)
        big[i] = (float)(i % 1000) + (float)rank;
    CHECK_OR_RETURN(comm_allreduce_sum_f32(c, big, BIG_FLOATS) == COMM_OK, "%s",
                    comm_last_error(c));
    for (size_t i = 0; i < BIG_FLOATS; i++)
        CHECK_OR_RETURN(big[i] == (float)w * (float)(i % 1000) + (float)(w * (w - 1) / 2),
                        "rank %d: element %zu is %g", rank, i, big[i]);
    free(big);
    comm_free(c);
    return 0;
}

/* ---- finalize ---- */

static int finalize_rank(tc_group *g, int rank, void *arg)
{
    (void)arg;
    comm *c = tc_connect_or_exit(g, rank);
    CHECK_OR_RETURN(comm_barrier(c) == COMM_OK, "%s", comm_last_error(c));
    comm_free(c);
    int clean = 0, aborted = 0;
    rt_nccl_teardowns(&clean, &aborted);
    CHECK_OR_RETURN(clean == 1 && aborted == 0, "rank %d: %d clean teardowns, %d aborts", rank,
                    clean, aborted);
    return 0;
}

/* ---- peer_system, peer_remote, peer_free_first, peer_late ---- */

enum { PEER_PLAIN, PEER_FREE_FIRST, PEER_LATE, PEER_SYSTEM, LOCAL_SYSTEM, LOCAL_ERROR };

/* The local cases: rank 1 fails by itself, the others lose it. */
static int local_rank(tc_group *g, int rank, int mode)
{
    comm *c = tc_connect_or_exit(g, rank);
    CHECK_OR_RETURN(comm_barrier(c) == COMM_OK, "%s", comm_last_error(c));
    g->shared->progress[rank] = 1;
    /* Rank 1 fails once every rank has its barrier (its frames may still be
     * in flight until then). */
    for (int64_t end = mono_now_ms() + 20000; rank == 1 && mono_now_ms() < end;) {
        int all = 1;
        for (int r = 0; r < g->world; r++)
            all &= g->shared->progress[r] != 0;
        if (all) break;
        th_sleep_ms(10);
    }
    if (rank == 1)
        rt_fail_next(mode == LOCAL_SYSTEM ? "ncclAllReduce:async:system" : "ncclAllReduce");
    float *x = NULL;
    CHECK_OR_RETURN(cudaMalloc((void **)&x, 16 * sizeof(float)) == cudaSuccess);
    comm_err err = comm_allreduce_sum_f32(c, x, 16);
    printf("  rank %d: %s (%s)\n", rank, comm_strerror(err), comm_last_error(c));
    comm_err want = rank == 1 ? COMM_ERR_NCCL : COMM_ERR_PEER;
    CHECK_OR_RETURN(err == want, "rank %d: gave %s, want %s", rank, comm_strerror(err),
                    comm_strerror(want));
    CHECK_OR_RETURN(comm_err_is_peer(err) == (rank != 1));
    comm_free(c); /* rank 1's teardown is what its peers see */
    CHECK_OR_RETURN(cudaFree(x) == cudaSuccess);
    return 0;
}

static int peer_rank(tc_group *g, int rank, void *arg)
{
    int mode = (int)(intptr_t)arg;
    if (mode == LOCAL_SYSTEM || mode == LOCAL_ERROR) return local_rank(g, rank, mode);
    int free_first = mode == PEER_FREE_FIRST; /* the reducer's order: buckets go before the comm */
    comm *c = tc_connect_or_exit(g, rank);
    CHECK_OR_RETURN(comm_barrier(c) == COMM_OK, "%s", comm_last_error(c));
    int last = g->world - 1;
    if (rank == last) {
        /* Gone once every survivor has its barrier (its frames may still be
         * in flight until then): a pod lost, its sockets close. */
        int64_t deadline = mono_now_ms() + 20000;
        for (int r = 0; r < last; r++)
            while (!g->shared->progress[r] && mono_now_ms() < deadline)
                th_sleep_ms(10);
        _exit(0);
    }
    g->shared->progress[rank] = 1;
    if (mode == PEER_LATE) th_sleep_ms(1000); /* the loss is known before the call */
    float *x = NULL; /* device memory: only the error's kind is under test */
    CHECK_OR_RETURN(cudaMalloc((void **)&x, 16 * sizeof(float)) == cudaSuccess);
    comm_err err = comm_allreduce_sum_f32(c, x, 16);
    printf("  rank %d: %s (%s)\n", rank, comm_strerror(err), comm_last_error(c));
    comm_err want = mode == PEER_SYSTEM ? COMM_ERR_NCCL : COMM_ERR_PEER;
    CHECK_OR_RETURN(err == want, "rank %d: a dead peer gave %s, want %s", rank, comm_strerror(err),
                    comm_strerror(want));
    CHECK_OR_RETURN(comm_err_is_peer(err) == (mode != PEER_SYSTEM));
    if (free_first) CHECK_OR_RETURN(cudaFree(x) == cudaSuccess);
    comm_free(c);
    if (!free_first) CHECK_OR_RETURN(cudaFree(x) == cudaSuccess);
    return 0;
}

/* ---- mixed_cpu0, mixed_cpu1 ---- */

static int mixed_rank(tc_group *g, int rank, void *arg)
{
    int cpu = (int)(intptr_t)arg;
    char node[32];
    snprintf(node, sizeof(node), "node-%d", rank);
    setenv("DUCTILE_NODE_ID", node, 1);
    rdzv_etcd e = {0};
    e.endpoints = g->etcd;
    rdzv_store *s = NULL;
    CHECK_OR_RETURN(rdzv_store_open(&e, g->job, g->round, &s) == RDZV_OK);
    char why[COMM_MSG_MAX] = "";
    /* The CUDA ranks of mixed_cpu1 only wait; their deadline is short. */
    comm_config cfg = {.rank = rank,
                       .world_size = g->world,
                       .store = s,
                       .timeout_ms = cpu == 0 || rank == cpu ? 60000 : 3000,
                       .device = rank,
                       .msg = why};
    comm *c = NULL;
    comm_err err = rank == cpu ? comm_cpu_init(&cfg, &c) : comm_nccl_init(&cfg, &c);
    printf("  rank %d (%s): %s: %s\n", rank, rank == cpu ? "cpu" : "cuda", comm_strerror(err), why);
    rdzv_store_close(s);
    CHECK_OR_RETURN(!c);
    if (cpu == 0 || rank == cpu) {
        char named[64];
        snprintf(named, sizeof(named), "rank %d (node node-%d) has no CUDA device", cpu, cpu);
        CHECK_OR_RETURN(err == COMM_ERR_ARG, "rank %d: gave %s, want the round refused", rank,
                        comm_strerror(err));
        CHECK_OR_RETURN(strstr(why, named), "rank %d: '%s' does not say '%s'", rank, why, named);
    }
    return 0;
}

/* ---- cancel ---- */

static int64_t cancel_at;

static int cancel_soon(void *ctx)
{
    (void)ctx;
    return mono_now_ms() >= cancel_at;
}

static int cancel_rank(tc_group *g, int rank, void *arg)
{
    (void)arg;
    comm *c = NULL;
    if (rank == g->world - 1) {
        th_sleep_ms(3000); /* never joins, never fails: only the round's end tells */
        return 0;
    }
    cancel_at = mono_now_ms() + 500;
    comm_err err = connect_with(g, rank, 60000, cancel_soon, &c);
    /* Rank 0 holds the bootstrap root: once it gives up, rank 1 may see
     * that first (a peer's loss) instead of its own cancel. Either way the
     * init ended long before its deadline. */
    CHECK_OR_RETURN(err == COMM_ERR_ABORTED || (rank != 0 && err == COMM_ERR_PEER),
                    "rank %d: init gave %s, want aborted", rank, comm_strerror(err));
    CHECK_OR_RETURN(c == NULL);
    return 0;
}

/* ---- deadlines ---- */

static int deadlines_rank(tc_group *g, int rank, void *arg)
{
    (void)arg;
    comm *c = NULL;
    if (rank == 0) th_sleep_ms(5000); /* publishes the id late */
    if (rank == 2) th_sleep_ms(9500); /* past rank 1's id wait plus what is left */
    comm_err err = connect_with(g, rank, 8000, NULL, &c);
    CHECK_OR_RETURN(err == COMM_OK, "rank %d: init gave %s", rank, comm_strerror(err));
    CHECK_OR_RETURN(comm_barrier(c) == COMM_OK, "%s", comm_last_error(c));
    comm_free(c);
    return 0;
}

/* ---- staging_error (world 1, DUCTILE_FAILPOINTS set by ctest) ---- */

static int staging_error(void)
{
    comm_config cfg = {.rank = 0, .world_size = 1, .timeout_ms = 10000, .device = 0};
    comm *c = NULL;
    CHECK_OR_RETURN(comm_nccl_init(&cfg, &c) == COMM_OK);
    float x[4] = {1, 2, 3, 4};
    comm_err err = comm_allreduce_sum_f32(c, x, 4);
    printf("  staged all-reduce: %s (%s)\n", comm_strerror(err), comm_last_error(c));
    CHECK(err == COMM_ERR_CUDA, "gave %s", comm_strerror(err));
    CHECK(strstr(comm_last_error(c), "cudaMemcpyAsync") != NULL, "no call named in '%s'",
          comm_last_error(c));
    comm_free(c);
    return check_failures() != 0;
}

/* ---- teardown_error (world 1) ---- */

static int teardown_error(void)
{
    model_config cfg = {.kind = MODEL_MLP,
                        .in_c = 1,
                        .in_h = 4,
                        .in_w = 4,
                        .classes = 3,
                        .nhidden = 1,
                        .hidden = {8}};
    model *m = NULL;
    char msg[256];
    CHECK_OR_RETURN(model_create(&cfg, 4, &m, msg) == 0, "model: %s", msg);
    CHECK_OR_RETURN(gpu_attach(m, 0, msg) == 0, "attach: %s", msg);
    float *grads = gpu_grad_alloc(m, 64);
    CHECK_OR_RETURN(grads != NULL);
    CHECK(gpu_status(m, msg) == 0, "before: %s", msg);
    rt_fail_next("cudaStreamSynchronize");
    gpu_grad_free(m, grads);
    int st = gpu_status(m, msg);
    printf("  after a failed sync under gpu_grad_free: %d (%s)\n", st, st ? msg : "");
    CHECK(st != 0 && strstr(msg, "cudaStreamSynchronize") != NULL,
          "the failed sync was not kept: %d '%s'", st, st ? msg : "");
    gpu_detach(m);
    model_free(m);
    return check_failures() != 0;
}

typedef struct {
    const char *name;
    int world;
    tc_rank_fn fn;
} test_case;

static const test_case cases[] = {
    {"host_buffers", 3, host_buffers_rank},
    {"finalize", 2, finalize_rank},
    {"peer_system", 3, peer_rank},
    {"peer_remote", 3, peer_rank},
    {"peer_free_first", 3, peer_rank},
    {"peer_late", 3, peer_rank},
    {"local_system", 3, peer_rank},
    {"local_error", 3, peer_rank},
    {"mixed_cpu0", 3, mixed_rank},
    {"mixed_cpu1", 3, mixed_rank},
    {"cancel", 3, cancel_rank},
    {"deadlines", 3, deadlines_rank},
};

int main(int argc, char **argv)
{
    gpu_test_require();
    if (argc != 2) {
        fprintf(stderr, "usage: test_gpu_comm CASE\n");
        return 2;
    }
    if (strcmp(argv[1], "staging_error") == 0) return staging_error();
    if (strcmp(argv[1], "teardown_error") == 0) return teardown_error();
    const test_case *tc = th_find(cases, TH_COUNT(cases), sizeof(cases[0]), argv[1]);
    if (!tc) {
        fprintf(stderr, "test_gpu_comm: unknown case %s\n", argv[1]);
        return 2;
    }
    if (strcmp(argv[1], "peer_system") == 0) setenv("DUCTILE_GPURT_PEER_ERROR", "system", 1);
    test_etcd e;
    const char *etcd = test_etcd_shared_or_start(&e);
    CHECK_OR_EXIT(etcd, "no etcd");
    tc_group g;
    char job[32]; /* job ids take no '_' */
    snprintf(job, sizeof(job), "%s", tc->name);
    for (char *p = job; *p; p++)
        if (*p == '_') *p = '-';
    CHECK_OR_EXIT(tc_group_open(&g, tc->world, etcd, job) == 0);
    g.nccl = 1;
    g.timeout_ms = 20000;
    int mode = strcmp(argv[1], "peer_free_first") == 0 ? PEER_FREE_FIRST
               : strcmp(argv[1], "peer_late") == 0     ? PEER_LATE
               : strcmp(argv[1], "peer_system") == 0   ? PEER_SYSTEM
               : strcmp(argv[1], "local_system") == 0  ? LOCAL_SYSTEM
               : strcmp(argv[1], "local_error") == 0   ? LOCAL_ERROR
                                                       : PEER_PLAIN;
    void *arg = (void *)(intptr_t)mode;
    if (strcmp(argv[1], "mixed_cpu0") == 0) arg = (void *)(intptr_t)0;
    if (strcmp(argv[1], "mixed_cpu1") == 0) arg = (void *)(intptr_t)1;
    CHECK(tc_run(&g, tc->fn, arg, 60) == 0, "%s: a rank failed", tc->name);
    tc_group_free(&g);
    test_etcd_stop(&e);
    return check_finish(tc->name);
}
