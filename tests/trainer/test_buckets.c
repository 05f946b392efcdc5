/* test_buckets.c: bucket assignment and the reducer's bookkeeping.
 *
 * Assignment is checked against hand-worked cases (reverse order, the small
 * first bucket, caps reached exactly, a parameter larger than the cap). The
 * reducer is checked with a real model and no peers: gradients are views
 * into bucket memory in reverse parameter order, the stop flag rides in the
 * last bucket, no_sync accumulates, and a parameter that never got a
 * gradient is an error rather than a silent wrong update. A recording
 * collectives backend (comm_impl.h's ops table) shows the communication
 * thread reduces buckets in index order whatever order they become ready
 * in, and that a failed collective fails the step and stops the rest.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm_impl.h"
#include "ductile/ddp.h"
#include "ductile/model.h"
#include "trainer_test.h"

#define KB 1024u
#define MB (1024u * 1024u)

static void expect(const char *name, const size_t *numel, int n, size_t first, size_t cap,
                   int want_buckets, const int *want)
{
    int got[16];
    int nb = ddp_assign_buckets(numel, n, first, cap, got);
    CHECK(nb == want_buckets, "%s: %d buckets, want %d", name, nb, want_buckets);
    for (int i = 0; i < n; i++)
        CHECK(got[i] == want[i], "%s: parameter %d in bucket %d, want %d", name, i, got[i],
              want[i]);
}

static void test_assignment(void)
{
    /* Everything fits the 1 MB first bucket. */
    size_t small[3] = {10, 10, 10};
    int all0[3] = {0, 0, 0};
    expect("small", small, 3, MB, 25 * MB, 1, all0);

    /* Reverse order: p3 (400 KB) + p2 (800 KB) reach 1 MB and close bucket 0;
     * the rest share the 25 MB bucket 1. */
    size_t mixed[4] = {300000, 100, 200000, 100000};
    int want_mixed[4] = {1, 1, 0, 0};
    expect("first cap", mixed, 4, MB, 25 * MB, 2, want_mixed);

    /* A small cap also caps the first bucket; 400-byte parameters, 1 KB cap:
     * three per bucket (1200 >= 1024), counted from the end. */
    size_t even[7] = {100, 100, 100, 100, 100, 100, 100};
    int want_even[7] = {2, 1, 1, 1, 0, 0, 0};
    expect("small cap", even, 7, MB, KB, 3, want_even);

    /* Exactly reaching the cap closes the bucket. */
    size_t exact[3] = {256, 256, 256};
    int want_exact[3] = {2, 1, 0};
    expect("exact cap", exact, 3, KB, KB, 3, want_exact);

    /* A parameter larger than the cap gets a bucket of its own. */
    size_t huge[3] = {10, 1000000, 10};
    int want_huge[3] = {2, 1, 0};
    expect("huge", huge, 3, 16, 64, 3, want_huge);
    size_t huge2[4] = {10, 10, 1000000, 10};
    int want_huge2[4] = {2, 2, 1, 0};
    expect("huge in the middle", huge2, 4, 16, 64, 3, want_huge2);

    /* Second cap applies after the first bucket: 1 MB then 2 MB. */
    size_t mb[6] = {262144, 262144, 262144, 262144, 262144, 262144}; /* 1 MB each */
    int want_mb[6] = {3, 2, 2, 1, 1, 0};
    expect("first then cap", mb, 6, MB, 2 * MB, 4, want_mb);
}

/* An MLP on 16x16 inputs, 10 classes; NULL after saying why. */
static model *mlp16(int batch, int nhidden, const int *hidden)
{
    model_config cfg = {
        .kind = MODEL_MLP, .in_c = 1, .in_h = 16, .in_w = 16, .classes = 10, .nhidden = nhidden};
    for (int i = 0; i < nhidden; i++)
        cfg.hidden[i] = hidden[i];
    model *m;
    char msg[256];
    if (model_create(&cfg, batch, &m, msg) != 0) {
        fprintf(stderr, "model_create: %s\n", msg);
        return NULL;
    }
    return m;
}

static model *make_model(void)
{
    model *m = mlp16(4, 2, (const int[]){300, 200});
    if (!m) exit(1);
    model_init_params(m, 3);
    for (int i = 0; i < 4 * 256; i++)
        m->x[i] = (float)((i * 37) % 19) / 19.0f - 0.5f;
    for (int i = 0; i < 4; i++)
        m->y[i] = (uint8_t)(i * 7 % 10);
    return m;
}

static void backward_once(model *m, ddp_reducer *r)
{
    model_forward(m, 4);
    model_loss(m, 4);
    model_backward(m, 4, 0.25f, ddp_mark_ready, r);
}

static int vote_yes(void *ctx)
{
    ++*(int *)ctx;
    return 1;
}

static void test_reducer_layout(void)
{
    model *m = make_model();
    ddp_reducer *r;
    /* 64 KB buckets: fc3 and fc2 (248 KB) close bucket 0, fc1 is bucket 1. */
    CHECK(ddp_reducer_create(m, NULL, 64 * KB, 1, &r) == DDP_OK, "create");
    float *g = ddp_grads(r);
    int nb = ddp_bucket_count(r);
    CHECK(nb == 2, "%d buckets, want 2", nb);
    CHECK(ddp_bucket_get(r, 0)->nparams == 4 && ddp_bucket_get(r, 1)->nparams == 2,
          "parameters per bucket %d, %d", ddp_bucket_get(r, 0)->nparams,
          ddp_bucket_get(r, 1)->nparams);
    size_t off = 0, total = 0;
    for (int b = 0; b < nb; b++) {
        const ddp_bucket *bk = ddp_bucket_get(r, b);
        CHECK(bk->offset == off, "bucket %d at %zu, want %zu", b, bk->offset, off);
        off += bk->numel;
        total += bk->numel;
    }
    CHECK(total == m->nfloats + 1, "buckets hold %zu floats, model %zu + stop flag", total,
          m->nfloats);
    /* Views in reverse order, back to back. */
    size_t want = 0;
    for (int i = m->nparams - 1; i >= 0; i--) {
        CHECK(m->params[i].grad == g + want, "%s grad at %td, want %zu", m->params[i].name,
              m->params[i].grad - g, want);
        want += m->params[i].numel;
    }

    /* Backward writes straight into bucket memory; the flag carries the vote. */
    int stop = -1;
    ddp_begin(r, 1, 1);
    backward_once(m, r);
    CHECK(ddp_finish(r, &stop) == DDP_OK, "finish: %s", ddp_last_error(r));
    CHECK(stop == 1, "stop flag %d, want 1", stop);
    double sum = 0;
    for (size_t i = 0; i < m->nfloats; i++)
        sum += g[i] * g[i];
    CHECK(sum > 0, "gradients landed in bucket memory");
    float first = m->params[0].grad[5];

    /* no_sync then sync: gradients accumulate (twice the single step). */
    ddp_zero_grad(r);
    ddp_begin(r, 0, 0);
    backward_once(m, r);
    CHECK(ddp_finish(r, &stop) == DDP_OK && stop == 0, "no_sync finish");
    ddp_begin(r, 1, 0);
    backward_once(m, r);
    CHECK(ddp_finish(r, &stop) == DDP_OK && stop == 0, "sync finish, stop %d", stop);
    CHECK(test_close(m->params[0].grad[5], 2 * first, 1e-7, 1e-5), "accumulated %g vs 2*%g",
          m->params[0].grad[5], first);

    /* A late vote, asked once per synchronised micro-step when the flag's
     * bucket is complete, adds a stop vote to ddp_begin's. */
    int asked = 0;
    ddp_set_vote(r, vote_yes, &asked);
    ddp_begin(r, 0, 0);
    backward_once(m, r);
    CHECK(ddp_finish(r, &stop) == DDP_OK && stop == 0 && asked == 0, "no_sync: asked %d", asked);
    ddp_begin(r, 1, 0);
    backward_once(m, r);
    CHECK(ddp_finish(r, &stop) == DDP_OK && stop == 1 && asked == 1, "late vote: stop %d, asked %d",
          stop, asked);
    ddp_set_vote(r, NULL, NULL);
    ddp_begin(r, 1, 0);
    backward_once(m, r);
    CHECK(ddp_finish(r, &stop) == DDP_OK && stop == 0, "no late vote: stop %d", stop);

    /* A parameter without a gradient is reported. */
    ddp_zero_grad(r);
    ddp_begin(r, 1, 0);
    for (int i = m->nparams - 1; i >= 1; i--)
        ddp_mark_ready(r, i);
    CHECK(ddp_finish(r, &stop) == DDP_ERR_UNUSED, "unused parameter detected");
    CHECK(strstr(ddp_last_error(r), m->params[0].name) != NULL, "names it: %s", ddp_last_error(r));

    /* Freeing the reducer points gradients back at the model's own memory. */
    ddp_reducer_free(r);
    CHECK(m->params[0].grad == m->own_grads, "grads restored");
    model_free(m);
}

/* ---- a recording backend: world of 2, sums nothing, logs each call ---- */

typedef struct rec_comm {
    comm base; /* first: comm.c's part */
    const float *grads;
    size_t off[64], n[64];
    int calls;
    int fail_at; /* call index that fails, -1 for none */
} rec_comm;

static comm_err rec_allreduce(comm *c, float *buf, size_t n)
{
    rec_comm *r = (rec_comm *)c;
    if (r->calls < 64) {
        r->off[r->calls] = (size_t)(buf - r->grads);
        r->n[r->calls] = n;
    }
    /* Slow enough that later buckets are ready before this one is done. */
    usleep(2000);
    if (r->calls++ == r->fail_at)
        return comm_fail(c, COMM_ERR_PEER, "rank 1 closed its connection (test)");
    return COMM_OK;
}

static comm_err rec_broadcast(comm *c, void *buf, size_t bytes, int root)
{
    (void)c, (void)buf, (void)bytes, (void)root;
    return COMM_OK;
}

static comm_err rec_allgather(comm *c, const void *send, size_t bytes, void *recv)
{
    (void)c, (void)send, (void)bytes, (void)recv;
    return COMM_OK;
}

static comm_err rec_barrier(comm *c)
{
    (void)c;
    return COMM_OK;
}

static void rec_abort(comm *c)
{
    (void)c;
}

static void rec_destroy(comm *c)
{
    free(c);
}

static const comm_ops rec_ops = {.name = "recording",
                                 .allreduce_sum_f32 = rec_allreduce,
                                 .broadcast = rec_broadcast,
                                 .allgather = rec_allgather,
                                 .barrier = rec_barrier,
                                 .abort = rec_abort,
                                 .destroy = rec_destroy};

/* Marks every parameter ready in the given order, as backward would. */
static void mark_all(ddp_reducer *r, const int *order, int n)
{
    for (int i = 0; i < n; i++)
        ddp_mark_ready(r, order[i]);
}

static void test_reduce_order(int overlap, const char *order_name, int forward)
{
    model *m = mlp16(2, 4, (const int[]){64, 64, 64, 64});
    CHECK(m != NULL, "model_create");
    if (!m) return;
    rec_comm *rc = calloc(1, sizeof(*rc));
    comm_base_init(&rc->base, &rec_ops, 0, 2);
    rc->fail_at = -1;
    ddp_reducer *r;
    CHECK(ddp_reducer_create(m, &rc->base, 10 * KB, overlap, &r) == DDP_OK, "create");
    rc->grads = ddp_grads(r);
    int nb = ddp_bucket_count(r), order[MODEL_MAX_PARAMS];
    CHECK(nb == 4, "%d buckets, want 4", nb);
    for (int i = 0; i < m->nparams; i++) /* forward order: the LAST bucket is ready first */
        order[i] = forward ? i : m->nparams - 1 - i;
    for (int i = 0; i < m->nparams; i++)
        m->params[i].grad[0] = 2.0f;
    int stop = -1;
    ddp_begin(r, 1, 1);
    mark_all(r, order, m->nparams);
    CHECK(ddp_finish(r, &stop) == DDP_OK, "finish: %s", ddp_last_error(r));
    CHECK(rc->calls == nb, "%s, overlap %d: %d all-reduces for %d buckets", order_name, overlap,
          rc->calls, nb);
    for (int b = 0; b < nb && b < rc->calls; b++)
        CHECK(rc->off[b] == ddp_bucket_get(r, b)->offset && rc->n[b] == ddp_bucket_get(r, b)->numel,
              "%s, overlap %d: call %d reduced [%zu, +%zu), want bucket %d [%zu, +%zu)", order_name,
              overlap, b, rc->off[b], rc->n[b], b, ddp_bucket_get(r, b)->offset,
              ddp_bucket_get(r, b)->numel);
    /* Divided by the world size (2) after the reduction; the flag too. */
    CHECK(m->params[0].grad[0] == 1.0f && stop == 1, "averaged %g, stop %d", m->params[0].grad[0],
          stop);

    /* The second collective fails: the step fails, naming the bucket, and
     * no later bucket is sent. */
    rc->calls = 0;
    rc->fail_at = 1;
    ddp_begin(r, 1, 0);
    mark_all(r, order, m->nparams);
    CHECK(ddp_finish(r, &stop) == DDP_ERR_COMM, "failed collective fails the step");
    CHECK(strstr(ddp_last_error(r), "bucket 1") && strstr(ddp_last_error(r), "rank 1 closed"),
          "error line: %s", ddp_last_error(r));
    CHECK(rc->calls == 2, "%d collectives after the failure, want none", rc->calls - 2);
    printf("  %s order, overlap %d: %s\n", order_name, overlap, ddp_last_error(r));
    ddp_reducer_free(r);
    comm_free(&rc->base);
    model_free(m);
}

/* The overlap decision against made-up core counts: forced modes win, a
 * GPU overlaps, the CPU overlaps only with a spare core per local rank. */
static void test_overlap_choice(void)
{
    static const struct {
        ddp_overlap_mode mode;
        int gpu, cores, local_world, threads, want;
        const char *says;
    } cases[] = {
        {DDP_OVERLAP_AUTO, 0, 2, 2, 1, 0, "no core"},     /* bench/ddp's 2 ranks on 2 cores */
        {DDP_OVERLAP_AUTO, 0, 4, 2, 1, 1, "a core each"}, /* 2 x (1 + 1) fits 4 */
        {DDP_OVERLAP_AUTO, 0, 3, 2, 1, 0, "no core"},     /* one spare core, two ranks */
        {DDP_OVERLAP_AUTO, 0, 16, 2, 8, 0, "no core"},    /* --threads took every core */
        {DDP_OVERLAP_AUTO, 0, 16, 2, 7, 1, "a core each"},
        {DDP_OVERLAP_AUTO, 0, 1, 1, 1, 0, "no core"},
        {DDP_OVERLAP_AUTO, 1, 1, 4, 1, 1, "GPU"},
        {DDP_OVERLAP_ON, 0, 1, 4, 1, 1, "--overlap"},
        {DDP_OVERLAP_OFF, 1, 64, 1, 1, 0, "--no-overlap"},
    };
    printf("overlap choice\n");
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char why[160];
        int got = ddp_overlap_choose(cases[i].mode, cases[i].gpu, cases[i].cores,
                                     cases[i].local_world, cases[i].threads, why, sizeof(why));
        CHECK(got == cases[i].want, "case %zu: overlap %d, want %d (%s)", i, got, cases[i].want,
              why);
        CHECK(strstr(why, cases[i].says) != NULL, "case %zu: '%s' does not say '%s'", i, why,
              cases[i].says);
        printf("  %d: %s\n", got, why);
    }
}

int main(void)
{
    test_assignment();
    test_overlap_choice();
    test_reducer_layout();
    printf("reduction order\n");
    for (int overlap = 0; overlap <= 1; overlap++) {
        test_reduce_order(overlap, "backward", 0);
        test_reduce_order(overlap, "forward", 1);
    }
    return check_finish("test_buckets");
}
