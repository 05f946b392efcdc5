/* test_gpu_ddp_ranks.c: the GPU DDP path with several ranks, one process each.
 *
 * It runs on the host test runtime (tests/gpurt), which shows each process
 * several devices: rank r uses device r, as on a real node (NCCL refuses
 * two ranks of one host on one GPU, and so does the runtime), and NCCL's
 * semantics hold across processes. World 2 and world 3, each rank a
 * process with its model on the device and an NCCL communicator built
 * through a real etcd round store:
 *  - the state sync with claims: the rank with the newest claim is not rank
 *    0 (world 2: rank 1, world 3: rank 2), its parameters and optimizer
 *    state (device memory, broadcast device to device into the receivers'
 *    scratch, which they adopt) must reach every rank;
 *    the others start from other seeds, so a broadcast from the wrong root
 *    or through the wrong memory shows;
 *  - twenty steps of two micro-batches (no_sync then sync), every rank on
 *    its own data, buckets all-reduced from the NCCL stream after waiting on
 *    each bucket's event (the runtime reports a read without that edge);
 *  - a host-buffer all-reduce (evaluation counts) sums right;
 *  - the final parameters are equal bit for bit on every rank, and within
 *    1e-3 of one CPU process that trains on the union of the ranks' batches
 *    from the root's starting state.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "ductile/comm.h"
#include "ductile/data.h"
#include "ductile/ddp.h"
#include "ductile/model.h"
#include "ductile/optim.h"
#include "gpu_test.h"
#include "rt.h" /* the host runtime's count of host syncs */
#include "test_comm_launch.h"
#include "test_etcd.h"

#define STEPS 20
#define BATCH 16
#define BUCKET_CAP 1000 /* bytes: three buckets for the model below */
#define MAX_FLOATS 8192

static const model_config cfg = {.kind = MODEL_MLP,
                                 .in_c = 1,
                                 .in_h = 8,
                                 .in_w = 8,
                                 .classes = 10,
                                 .nhidden = 2,
                                 .hidden = {64, 32}};

/* What the ranks hand back to the parent (shared memory). */
typedef struct {
    int root[TC_MAX_RANKS];
    int64_t best_step[TC_MAX_RANKS];
    float count[TC_MAX_RANKS];
    int done[TC_MAX_RANKS];
    float params[TC_MAX_RANKS][MAX_FLOATS];
} results;

static results *res;

/* The rank whose claim is newest in a world of w. */
static int root_of(int w)
{
    return w - 1;
}

/* Rank r's micro-batch of a step, the same wherever it is trained. */
static void batch_of(model *m, int step, int micro, int r)
{
    uint64_t rng = 1000003u * (uint64_t)step + 1009u * (uint64_t)micro + (uint64_t)r + 1;
    size_t in = (size_t)cfg.in_c * cfg.in_h * cfg.in_w;
    for (size_t i = 0; i < in * BATCH; i++)
        m->x[i] = data_rng_uniform(&rng);
    for (int i = 0; i < BATCH; i++)
        m->y[i] = (uint8_t)(data_rng_next(&rng) % cfg.classes);
}

/* The root's optimizer state: not zeros, so its broadcast shows. */
static void root_state(optim *o)
{
    for (size_t i = 0; i < o->n * (size_t)o->nstate; i++)
        o->state[i] = 0.001f * (float)(i % 17);
}

static int rank_main(tc_group *g, int rank, void *arg)
{
    (void)arg;
    int w = g->world, root = root_of(w);
    model *m = NULL;
    optim *o = NULL;
    ddp_reducer *r = NULL;
    char msg[256];
    optim_config oc = {.kind = OPTIM_SGD, .momentum = 0.9f};
    CHECK_OR_RETURN(model_create(&cfg, BATCH, &m, msg) == 0, "rank %d: %s", rank, msg);
    CHECK_OR_RETURN(optim_create(&oc, m->nfloats, &o) == 0);
    CHECK_OR_RETURN(m->nfloats <= MAX_FLOATS);
    model_init_params(m, rank == root ? 5 : 100 + (uint64_t)rank);
    if (rank == root) root_state(o);
    CHECK_OR_RETURN(gpu_attach(m, rank, msg) == 0, "rank %d: attach: %s", rank, msg);
    comm *c = tc_connect_or_exit(g, rank);
    CHECK_OR_RETURN(ddp_reducer_create(m, c, BUCKET_CAP, 1, &r) == DDP_OK);

    /* Rank 0 has state too, but of an older round: the root's must win. */
    elastic_claim mine = {rank == root || rank == 0, rank == root ? 3 : 2, rank == root ? 7 : 9};
    elastic_claim best;
    /* The state goes device to device, as ductile-train's: each rank's
     * state on its device, a receiver's broadcast into device scratch that
     * it adopts once every part arrived. */
    CHECK_OR_RETURN(gpu_upload(m, o, msg) == 0, "rank %d: %s", rank, msg);
    elastic_part parts[2];
    CHECK_OR_RETURN(gpu_state_parts(m, o, &parts[0], &parts[1], msg) == 0, "rank %d: %s", rank,
                    msg);
    int got_root = -1;
    ddp_err de = ddp_sync_state(r, &mine, parts, 2, &got_root, &best);
    CHECK_OR_RETURN(de == DDP_OK, "rank %d: state sync: %s", rank, ddp_last_error(r));
    if (got_root != rank) gpu_state_adopt(m);
    res->root[rank] = got_root;
    res->best_step[rank] = best.step;

    for (int step = 0; step < STEPS; step++) {
        int stop = -1;
        for (int micro = 0; micro < 2; micro++) {
            batch_of(m, step, micro, rank);
            ddp_begin(r, micro == 1, step == STEPS - 1 && rank == 0);
            model_forward(m, BATCH);
            model_loss(m, BATCH);
            model_backward(m, BATCH, 1.0f / (2 * BATCH), ddp_mark_ready, r);
            long before = rt_host_syncs();
            de = ddp_finish(r, &stop);
            long used = rt_host_syncs() - before;
            CHECK_OR_RETURN(de == DDP_OK, "rank %d: step %d: %s: %s", rank, step, ddp_strerror(de),
                            ddp_last_error(r));
            /* The buckets' all-reduces pipeline on NCCL's stream and the
             * stop flag comes back in one host sync: none for a no_sync
             * micro-batch, one for the step's last. */
            CHECK_OR_RETURN(used <= (micro == 1),
                            "rank %d: step %d: ddp_finish made %ld host syncs", rank, step, used);
        }
        /* Only rank 0 voted: the summed flag stops every rank at once. */
        CHECK_OR_RETURN(stop == (step == STEPS - 1), "rank %d: step %d: stop %d", rank, step, stop);
        optim_step(o, m, 0.05f);
        ddp_zero_grad(r);
        CHECK_OR_RETURN(gpu_status(m, msg) == 0, "rank %d: step %d: %s", rank, step, msg);
    }
    float count = (float)(rank + 1); /* an evaluation count, in host memory */
    CHECK_OR_RETURN(ddp_allreduce(r, &count, 1) == DDP_OK, "rank %d: %s", rank, ddp_last_error(r));
    res->count[rank] = count;
    CHECK_OR_RETURN(gpu_download(m, o, msg) == 0, "rank %d: %s", rank, msg);
    memcpy(res->params[rank], m->weights, sizeof(float) * m->nfloats);
    res->done[rank] = 1;
    ddp_reducer_free(r);
    comm_free(c);
    optim_free(o);
    model_free(m);
    return 0;
}

/* One CPU process on the union of every rank's batches, from the root's state. */
static int reference(int w, float *out, size_t *n)
{
    model *m = NULL;
    optim *o = NULL;
    ddp_reducer *r = NULL;
    char msg[256];
    optim_config oc = {.kind = OPTIM_SGD, .momentum = 0.9f};
    if (model_create(&cfg, BATCH, &m, msg) != 0 || optim_create(&oc, m->nfloats, &o) != 0)
        return -1;
    model_init_params(m, 5);
    root_state(o);
    if (ddp_reducer_create(m, NULL, BUCKET_CAP, 1, &r) != DDP_OK) return -1;
    for (int step = 0; step < STEPS; step++) {
        int stop;
        for (int micro = 0; micro < 2; micro++)
            for (int k = 0; k < w; k++) {
                batch_of(m, step, micro, k);
                ddp_begin(r, micro == 1 && k == w - 1, 0);
                model_forward(m, BATCH);
                model_loss(m, BATCH);
                model_backward(m, BATCH, 1.0f / (2 * BATCH * w), ddp_mark_ready, r);
                if (ddp_finish(r, &stop) != DDP_OK) return -1;
            }
        optim_step(o, m, 0.05f);
        ddp_zero_grad(r);
    }
    *n = m->nfloats;
    memcpy(out, m->weights, sizeof(float) * m->nfloats);
    ddp_reducer_free(r);
    optim_free(o);
    model_free(m);
    return 0;
}

static void run_world(const char *etcd, int w)
{
    tc_group g;
    memset(res, 0, sizeof(*res));
    if (tc_group_open(&g, w, etcd, "gpu-ddp") != 0) {
        CHECK(0, "world %d: no group", w);
        return;
    }
    g.nccl = 1;
    CHECK(tc_run(&g, rank_main, NULL, 120) == 0, "world %d: a rank failed", w);
    tc_group_free(&g);
    float *want = calloc(MAX_FLOATS, sizeof(float));
    size_t n = 0;
    CHECK(want && reference(w, want, &n) == 0, "world %d: CPU reference failed", w);
    for (int k = 0; k < w; k++) {
        CHECK(res->done[k], "world %d: rank %d did not finish", w, k);
        CHECK(res->root[k] == root_of(w), "world %d: rank %d took rank %d's state, want %d", w, k,
              res->root[k], root_of(w));
        CHECK(res->best_step[k] == 7, "world %d: rank %d: best claim step %lld", w, k,
              (long long)res->best_step[k]);
        CHECK(res->count[k] == (float)(w * (w + 1) / 2), "world %d: rank %d: count sum %g", w, k,
              res->count[k]);
        CHECK(memcmp(res->params[k], res->params[0], sizeof(float) * n) == 0,
              "world %d: rank %d's parameters differ from rank 0's", w, k);
    }
    if (n) {
        char what[64];
        snprintf(what, sizeof(what), "world %d vs one CPU process", w);
        gpu_test_near(what, res->params[0], want, n, 1e-3);
    }
    printf("  world %d: state from rank %d, %zu parameters equal on every rank\n", w, root_of(w),
           n);
    free(want);
}

int main(void)
{
    gpu_test_require();
    res = mmap(NULL, sizeof(*res), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK_OR_EXIT(res != MAP_FAILED);
    test_etcd e;
    const char *etcd = test_etcd_shared_or_start(&e);
    CHECK_OR_EXIT(etcd, "no etcd");
    run_world(etcd, 2);
    run_world(etcd, 3);
    test_etcd_stop(&e);
    munmap(res, sizeof(*res));
    return check_finish("test_gpu_ddp_ranks");
}
