/* test_gpu_ddp.c: NCCL with world size 1 through the whole DDP path on a GPU.
 *
 * One process, one device: the model on the GPU, the reducer's buckets in
 * device memory (a small bucket cap makes three of them), an NCCL
 * communicator of one rank, the communication thread waiting on each
 * bucket's CUDA event before its all-reduce, no_sync accumulation, the stop
 * flag carried through the last bucket, host buffers broadcast and reduced
 * (the NCCL backend stages them), the state sync with a claim. Twenty optimizer steps of that must
 * give exactly the parameters of the same GPU run without a communicator (a one-rank all-reduce is
 * a copy), with and without overlap, and the CPU run's parameters within 1e-3 (relative L2 and max:
 * float rounding in cuBLAS vs OpenBLAS summation order, compounded over 20 steps). Then an aborted
 * communicator must fail the next step at once, not hang it. Last, a
 * step's losses read without a sync each (gpu_loss_queue, as ductile-train
 * does, up to GPU_LOSS_SLOTS micro-batches, then model_loss) equal the
 * losses read one sync at a time.
 *
 * Several ranks cannot be exercised with one GPU: test_gpu_ddp_ranks runs
 * them on the host test runtime (every rank its own process and "device").
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ductile/clock.h"
#include "ductile/comm.h"
#include "ductile/data.h"
#include "ductile/ddp.h"
#include "gpu.h"
#include "gpu_test.h"
#include "ductile/model.h"
#include "ductile/optim.h"

#define STEPS 20
#define BATCH 16
#define BUCKET_CAP 1000 /* bytes: three buckets for the model below */

static const model_config cfg = GPU_TEST_MLP;

typedef enum { RUN_CPU, RUN_GPU, RUN_NCCL, RUN_NCCL_NO_OVERLAP } run_kind;

static const char *run_name[] = {"cpu", "gpu", "gpu+nccl", "gpu+nccl no-overlap"};

/* Trains STEPS steps of two micro-batches each; final parameters in params. */
static int run(run_kind kind, float *params, int *buckets)
{
    model *m = NULL;
    optim *o = NULL;
    comm *c = NULL;
    ddp_reducer *r = NULL;
    char msg[256];
    int rc = -1;
    optim_config oc = {.kind = OPTIM_SGD, .momentum = 0.9f};
    if (model_create(&cfg, BATCH, &m, msg) != 0 || optim_create(&oc, m->nfloats, &o) != 0) {
        CHECK(0, "%s: model: %s", run_name[kind], msg);
        goto out;
    }
    model_init_params(m, 5);
    if (kind != RUN_CPU && gpu_attach(m, 0, msg) != 0) {
        CHECK(0, "%s: attach: %s", run_name[kind], msg);
        goto out;
    }
    if (kind >= RUN_NCCL) {
        comm_config cc = {.rank = 0, .world_size = 1, .timeout_ms = 20000, .device = 0};
        comm_err ce = comm_nccl_init(&cc, &c);
        if (ce != COMM_OK) {
            CHECK(0, "%s: comm_nccl_init: %s", run_name[kind], comm_strerror(ce));
            goto out;
        }
    }
    ddp_err de = ddp_reducer_create(m, c, BUCKET_CAP, kind != RUN_NCCL_NO_OVERLAP, &r);
    if (de != DDP_OK) {
        CHECK(0, "%s: reducer: %s", run_name[kind], ddp_strerror(de));
        goto out;
    }
    *buckets = ddp_bucket_count(r);

    /* Host buffers through the (staged) collectives: a one-rank identity. */
    float host[3] = {1.5f, -2.0f, 7.25f}, want[3] = {1.5f, -2.0f, 7.25f};
    CHECK(ddp_broadcast(r, host, sizeof(host)) == DDP_OK && ddp_allreduce(r, host, 3) == DDP_OK,
          "%s: host collectives: %s", run_name[kind], ddp_last_error(r));
    CHECK(memcmp(host, want, sizeof(host)) == 0, "%s: host collectives changed the values",
          run_name[kind]);
    /* The state sync with a claim: one rank's own state wins, unchanged. */
    elastic_claim mine = {1, 4, 2}, best = {0, 0, 0};
    elastic_part part = {host, sizeof(host), NULL};
    int root = -1;
    CHECK(ddp_sync_state(r, c ? &mine : NULL, &part, 1, &root, &best) == DDP_OK, "%s: sync: %s",
          run_name[kind], ddp_last_error(r));
    CHECK(root == 0 && (!c || best.step == 2) && memcmp(host, want, sizeof(host)) == 0,
          "%s: state sync: root %d, best step %lld", run_name[kind], root, (long long)best.step);
    if (m->dev && gpu_upload(m, o, msg) != 0) CHECK(0, "%s: upload: %s", run_name[kind], msg);

    uint64_t rng = 99;
    size_t in = (size_t)cfg.in_c * cfg.in_h * cfg.in_w;
    for (int step = 0; step < STEPS; step++) {
        int stop = -1;
        for (int micro = 0; micro < 2; micro++) {
            for (size_t i = 0; i < in * BATCH; i++)
                m->x[i] = data_rng_uniform(&rng);
            for (int i = 0; i < BATCH; i++)
                m->y[i] = (uint8_t)(data_rng_next(&rng) % cfg.classes);
            ddp_begin(r, micro == 1, step == STEPS - 1);
            model_forward(m, BATCH);
            model_loss(m, BATCH);
            model_backward(m, BATCH, 1.0f / (2 * BATCH), ddp_mark_ready, r);
            de = ddp_finish(r, &stop);
            if (de != DDP_OK) {
                CHECK(0, "%s: step %d: %s: %s", run_name[kind], step, ddp_strerror(de),
                      ddp_last_error(r));
                goto out;
            }
        }
        CHECK(stop == (step == STEPS - 1), "%s: step %d: stop flag %d", run_name[kind], step, stop);
        optim_step(o, m, 0.05f);
        ddp_zero_grad(r);
        if (m->dev && gpu_status(m, msg) != 0) {
            CHECK(0, "%s: step %d: %s", run_name[kind], step, msg);
            goto out;
        }
    }
    if (m->dev && gpu_download(m, o, msg) != 0) {
        CHECK(0, "%s: download: %s", run_name[kind], msg);
        goto out;
    }
    memcpy(params, m->weights, sizeof(float) * m->nfloats);
    rc = 0;

    /* A dropped group fails the next step at once. */
    if (c) {
        comm_abort(c);
        double t0 = mono_now_s();
        int stop;
        ddp_begin(r, 1, 0);
        model_forward(m, BATCH);
        model_loss(m, BATCH);
        model_backward(m, BATCH, 1.0f, ddp_mark_ready, r);
        de = ddp_finish(r, &stop);
        double s = mono_now_s() - t0;
        printf("  %s: after comm_abort: %s (%s) in %.3f s\n", run_name[kind], ddp_strerror(de),
               ddp_last_error(r), s);
        CHECK(de == DDP_ERR_COMM, "%s: step after abort gave %s", run_name[kind], ddp_strerror(de));
        CHECK(s < 15.0, "%s: abort noticed only after %.1f s", run_name[kind], s);
    }
out:
    ddp_reducer_free(r);
    comm_free(c);
    optim_free(o);
    model_free(m);
    return rc;
}

/* Micro-batch i's input and labels, into the model's staging slot. */
static void fill_batch(model *m, int i)
{
    size_t in = (size_t)m->cfg.in_c * m->cfg.in_h * m->cfg.in_w;
    for (size_t j = 0; j < in * BATCH; j++)
        m->x[j] = (float)((i * 31 + (int)j) % 17) / 17.0f;
    for (int j = 0; j < BATCH; j++)
        m->y[j] = (uint8_t)((i + j) % m->cfg.classes);
}

/* One more micro-batch than the queue holds: the queued ones and the one
 * read with a sync must all be the losses a sync each gives. */
static int test_queued_losses(void)
{
    enum { N = GPU_LOSS_SLOTS + 1 };
    model *m = NULL;
    char msg[256];
    double want[N], got[N];
    CHECK_OR_RETURN(model_create(&cfg, BATCH, &m, msg) == 0, "model: %s", msg);
    model_init_params(m, 5);
    CHECK_OR_RETURN(gpu_attach(m, 0, msg) == 0, "attach: %s", msg);
    for (int i = 0; i < N; i++) {
        fill_batch(m, i);
        model_forward(m, BATCH);
        want[i] = model_loss(m, BATCH);
    }
    for (int i = 0; i < N; i++) {
        fill_batch(m, i);
        model_forward(m, BATCH);
        if (i < GPU_LOSS_SLOTS)
            gpu_loss_queue(m, BATCH);
        else
            got[i] = model_loss(m, BATCH); /* its own sync, as past the queue in train_step */
    }
    CHECK(gpu_status(m, msg) == 0, "%s", msg);
    CHECK(gpu_loss_take(m, got, GPU_LOSS_SLOTS) == GPU_LOSS_SLOTS);
    for (int i = 0; i < N; i++)
        CHECK(got[i] == want[i], "micro-batch %d: loss %.9g queued, %.9g read at once", i, got[i],
              want[i]);
    gpu_detach(m);
    model_free(m);
    return 0;
}

int main(void)
{
    gpu_test_require();
    model *probe;
    char msg[256];
    if (model_create(&cfg, BATCH, &probe, msg) != 0) return 1;
    size_t n = probe->nfloats;
    model_free(probe);
    float *p[4];
    int buckets[4] = {0};
    for (int k = RUN_CPU; k <= RUN_NCCL_NO_OVERLAP; k++) {
        p[k] = calloc(n, sizeof(float));
        CHECK(run(k, p[k], &buckets[k]) == 0, "%s run failed", run_name[k]);
        printf("  %s: %d buckets\n", run_name[k], buckets[k]);
    }
    CHECK(buckets[RUN_NCCL] == 3, "%d buckets, want 3", buckets[RUN_NCCL]);
    gpu_test_near("gpu+nccl vs gpu", p[RUN_NCCL], p[RUN_GPU], n, 0.0);
    gpu_test_near("no-overlap vs gpu", p[RUN_NCCL_NO_OVERLAP], p[RUN_GPU], n, 0.0);
    gpu_test_near("gpu+nccl vs cpu", p[RUN_NCCL], p[RUN_CPU], n, 1e-3);
    for (int k = 0; k < 4; k++)
        free(p[k]);
    CHECK(test_queued_losses() == 0, "queued losses: could not set up");
    return check_finish("test_gpu_ddp");
}
