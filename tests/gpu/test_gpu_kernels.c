/* test_gpu_kernels.c: every device kernel and layer against its CPU reference.
 *
 * The references are the trainer's own CPU code (layers.c, optim.c,
 * model.c), run on the same random inputs. Tolerances, as relative L2 and
 * relative max difference over each output array:
 *   element-wise kernels (fill, scale, ReLU, max-pool, SGD, AdamW): 1e-6;
 *     they are built without FMA contraction and should agree exactly;
 *   softmax cross-entropy: 1e-6 (device expf/log differ by an ulp or two);
 *   GEMM-based layers (linear, conv through im2col/col2im) and reductions
 *     (bias gradients, per-sample weight-gradient sums): 1e-4, float
 *     rounding in a different summation order over up to ~50k terms;
 *   whole models (forward, loss, backward): 1e-4.
 * Max-pool's argmax must match exactly, ties included.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ductile/data.h"
#include "gpu_test.h"
#include "kernels.h"
#include "ductile/layers.h"
#include "ductile/model.h"
#include "ductile/optim.h"

#define TOL_EXACT 1e-6
#define TOL_SUM 1e-4

static uint64_t rng = 20240611;

static float *rnd(size_t n, float lo, float hi)
{
    float *x = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++)
        x[i] = lo + (hi - lo) * data_rng_uniform(&rng);
    return x;
}

static float *dup(const float *x, size_t n)
{
    float *y = malloc(sizeof(float) * (n ? n : 1));
    memcpy(y, x, sizeof(float) * n);
    return y;
}

static float *dev_floats(size_t n)
{
    float *d = NULL;
    if (cudaMalloc((void **)&d, sizeof(float) * (n ? n : 1)) != cudaSuccess) {
        fprintf(stderr, "cudaMalloc of %zu floats failed\n", n);
        exit(1);
    }
    return d;
}

static void sync_ok(gpu_ctx *g, const char *what)
{
    char msg[256];
    CHECK(gpu_sync(g, msg) == 0, "%s: %s", what, msg);
}

/* ---- gemm: every transpose combination, padded leading dimensions ---- */

static void test_gemm(gpu_ctx *g)
{
    int M = 37, N = 53, K = 71;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            int lda = (ta ? M : K) + 2, ldb = (tb ? K : N) + 1, ldc = N + 4;
            size_t na = (size_t)(ta ? K : M) * lda, nb = (size_t)(tb ? N : K) * ldb,
                   nc = (size_t)M * ldc;
            float *a = rnd(na, -1, 1), *b = rnd(nb, -1, 1), *c = rnd(nc, -1, 1), *got = dup(c, nc);
            float *da = gpu_test_up(a, sizeof(float) * na),
                  *db = gpu_test_up(b, sizeof(float) * nb),
                  *dc = gpu_test_up(c, sizeof(float) * nc);
            gemm(ta, tb, M, N, K, 0.7f, a, lda, b, ldb, 0.3f, c, ldc);
            gpu_gemm(g, ta, tb, M, N, K, 0.7f, da, lda, db, ldb, 0.3f, dc, ldc);
            sync_ok(g, "gemm");
            gpu_test_down(got, dc, sizeof(float) * nc);
            char what[64];
            snprintf(what, sizeof(what), "gemm trans_a=%d trans_b=%d", ta, tb);
            gpu_test_near(what, got, c, nc, TOL_SUM);
            free(a), free(b), free(c), free(got);
            cudaFree(da), cudaFree(db), cudaFree(dc);
        }
}

/* ---- linear (bias fill, bias gradient, three GEMMs) ---- */

static void test_linear(gpu_ctx *g)
{
    int B = 33, I = 100, O = 47;
    float *in = rnd((size_t)B * I, -1, 1), *w = rnd((size_t)O * I, -0.5f, 0.5f),
          *b = rnd(O, -0.5f, 0.5f), *dout = rnd((size_t)B * O, -1, 1);
    float *out = malloc(sizeof(float) * B * O), *got = malloc(sizeof(float) * B * I * 2);
    float *dw = rnd((size_t)O * I, -1, 1), *db = rnd(O, -1, 1),
          *din = malloc(sizeof(float) * B * I);
    float *d_in = gpu_test_up(in, sizeof(float) * B * I),
          *d_w = gpu_test_up(w, sizeof(float) * O * I), *d_b = gpu_test_up(b, sizeof(float) * O),
          *d_dout = gpu_test_up(dout, sizeof(float) * B * O),
          *d_out = gpu_test_up(out, sizeof(float) * B * O),
          *d_dw = gpu_test_up(dw, sizeof(float) * O * I),
          *d_db = gpu_test_up(db, sizeof(float) * O),
          *d_din = gpu_test_up(din, sizeof(float) * B * I);

    linear_forward(out, in, w, b, B, I, O);
    gpu_linear_forward(g, d_out, d_in, d_w, d_b, B, I, O);
    sync_ok(g, "linear forward");
    gpu_test_down(got, d_out, sizeof(float) * B * O);
    gpu_test_near("linear forward", got, out, (size_t)B * O, TOL_SUM);

    linear_backward(din, dw, db, dout, in, w, B, I, O);
    gpu_linear_backward(g, d_din, d_dw, d_db, d_dout, d_in, d_w, B, I, O);
    sync_ok(g, "linear backward");
    gpu_test_down(got, d_dw, sizeof(float) * O * I);
    gpu_test_near("linear backward dw (+=)", got, dw, (size_t)O * I, TOL_SUM);
    gpu_test_down(got, d_db, sizeof(float) * O);
    gpu_test_near("linear backward db (+=)", got, db, O, TOL_SUM);
    gpu_test_down(got, d_din, sizeof(float) * B * I);
    gpu_test_near("linear backward din", got, din, (size_t)B * I, TOL_SUM);

    free(in), free(w), free(b), free(dout), free(out), free(got), free(dw), free(db), free(din);
    cudaFree(d_in), cudaFree(d_w), cudaFree(d_b), cudaFree(d_dout), cudaFree(d_out);
    cudaFree(d_dw), cudaFree(d_db), cudaFree(d_din);
}

/* ---- element-wise: fill, scale, relu ---- */

static void test_elementwise(gpu_ctx *g)
{
    size_t n = 10007;
    float *in = rnd(n, -1, 1), *dout = rnd(n, -1, 1), *out = malloc(sizeof(float) * n),
          *din = malloc(sizeof(float) * n), *got = malloc(sizeof(float) * n);
    float *d_in = gpu_test_up(in, sizeof(float) * n),
          *d_dout = gpu_test_up(dout, sizeof(float) * n),
          *d_out = gpu_test_up(in, sizeof(float) * n), *d_din = gpu_test_up(in, sizeof(float) * n);

    relu_forward(out, in, n);
    CHECK(kern_relu_forward(d_out, d_in, n, gpu_stream(g)) == 0, "relu launch");
    sync_ok(g, "relu forward");
    gpu_test_down(got, d_out, sizeof(float) * n);
    gpu_test_near("relu forward", got, out, n, TOL_EXACT);
    relu_backward(din, dout, out, n);
    CHECK(kern_relu_backward(d_din, d_dout, d_out, n, gpu_stream(g)) == 0, "relu launch");
    sync_ok(g, "relu backward");
    gpu_test_down(got, d_din, sizeof(float) * n);
    gpu_test_near("relu backward", got, din, n, TOL_EXACT);

    for (size_t i = 0; i < n; i++)
        out[i] = in[i] * 0.37f;
    CHECK(kern_scale(d_in, n, 0.37f, gpu_stream(g)) == 0, "scale launch");
    sync_ok(g, "scale");
    gpu_test_down(got, d_in, sizeof(float) * n);
    gpu_test_near("scale", got, out, n, TOL_EXACT);
    for (size_t i = 0; i < n; i++)
        out[i] = -2.5f;
    CHECK(kern_fill(d_in, n, -2.5f, gpu_stream(g)) == 0, "fill launch");
    sync_ok(g, "fill");
    gpu_test_down(got, d_in, sizeof(float) * n);
    gpu_test_near("fill", got, out, n, TOL_EXACT);

    free(in), free(dout), free(out), free(din), free(got);
    cudaFree(d_in), cudaFree(d_dout), cudaFree(d_out), cudaFree(d_din);
}

/* ---- convolution: im2col + batched GEMM, col2im, bias and weight sums ---- */

static void test_conv_shape(gpu_ctx *g, int batch, int c, int h, int w, int oc, int k)
{
    conv_shape s;
    conv_shape_init(&s, c, h, w, oc, k, k / 2);
    size_t nin = (size_t)batch * c * h * w, nout = (size_t)batch * oc * s.oh * s.ow,
           nw = (size_t)oc * c * k * k, ncol = conv_col_size(&s);
    float *in = rnd(nin, -1, 1), *wt = rnd(nw, -0.5f, 0.5f), *b = rnd(oc, -0.5f, 0.5f),
          *dout = rnd(nout, -1, 1), *dw = rnd(nw, -1, 1), *db = rnd(oc, -1, 1);
    float *out = malloc(sizeof(float) * nout), *din = malloc(sizeof(float) * nin),
          *col = malloc(sizeof(float) * ncol), *dcol = malloc(sizeof(float) * ncol),
          *got = malloc(sizeof(float) * (nin > nout ? nin : nout) + sizeof(float) * nw);
    float *d_in = gpu_test_up(in, sizeof(float) * nin), *d_w = gpu_test_up(wt, sizeof(float) * nw),
          *d_b = gpu_test_up(b, sizeof(float) * oc),
          *d_dout = gpu_test_up(dout, sizeof(float) * nout),
          *d_dw = gpu_test_up(dw, sizeof(float) * nw), *d_db = gpu_test_up(db, sizeof(float) * oc),
          *d_out = dev_floats(nout), *d_din = dev_floats(nin), *d_col = dev_floats(ncol * batch),
          *d_dcol = dev_floats(ncol * batch), *d_dwtmp = dev_floats(nw * batch);
    char what[96];

    conv_forward(out, in, wt, b, batch, &s, col);
    gpu_conv_forward(g, d_out, d_in, d_w, d_b, batch, &s, d_col);
    sync_ok(g, "conv forward");
    gpu_test_down(got, d_out, sizeof(float) * nout);
    snprintf(what, sizeof(what), "conv %dx%dx%d->%d k%d fwd", c, h, w, oc, k);
    gpu_test_near(what, got, out, nout, TOL_SUM);

    conv_backward(din, dw, db, dout, in, wt, batch, &s, col, dcol);
    gpu_conv_backward(g, d_din, d_dw, d_db, d_dout, d_in, d_w, batch, &s, d_col, d_dcol, d_dwtmp);
    sync_ok(g, "conv backward");
    gpu_test_down(got, d_dw, sizeof(float) * nw);
    snprintf(what, sizeof(what), "conv %dx%dx%d->%d k%d dw", c, h, w, oc, k);
    gpu_test_near(what, got, dw, nw, TOL_SUM);
    gpu_test_down(got, d_db, sizeof(float) * oc);
    snprintf(what, sizeof(what), "conv %dx%dx%d->%d k%d db", c, h, w, oc, k);
    gpu_test_near(what, got, db, oc, TOL_SUM);
    gpu_test_down(got, d_din, sizeof(float) * nin);
    snprintf(what, sizeof(what), "conv %dx%dx%d->%d k%d din", c, h, w, oc, k);
    gpu_test_near(what, got, din, nin, TOL_SUM);

    free(in), free(wt), free(b), free(dout), free(dw), free(db), free(out), free(din), free(col);
    free(dcol), free(got);
    cudaFree(d_in), cudaFree(d_w), cudaFree(d_b), cudaFree(d_dout), cudaFree(d_dw), cudaFree(d_db);
    cudaFree(d_out), cudaFree(d_din), cudaFree(d_col), cudaFree(d_dcol), cudaFree(d_dwtmp);
}

static void test_conv(gpu_ctx *g)
{
    test_conv_shape(g, 5, 3, 12, 10, 4, 5);
    test_conv_shape(g, 4, 1, 28, 28, 16, 5);  /* the CNN's first block */
    test_conv_shape(g, 3, 16, 14, 14, 32, 5); /* and its second */
    test_conv_shape(g, 2, 2, 8, 8, 3, 3);
    test_conv_shape(g, 2, 3, 6, 6, 2, 1);
}

/* ---- max-pool (ties broken as the CPU breaks them) ---- */

static void test_maxpool_case(gpu_ctx *g, const char *name, int ties)
{
    int B = 3, C = 4, H = 8, W = 10;
    size_t nin = (size_t)B * C * H * W, nout = nin / 4;
    float *in = rnd(nin, -1, 1), *dout = rnd(nout, -1, 1);
    if (ties)
        for (size_t i = 0; i < nin; i++)
            in[i] = in[i] > 0 ? 1.0f : 0.0f;
    float *out = malloc(sizeof(float) * nout), *din = malloc(sizeof(float) * nin),
          *got = malloc(sizeof(float) * nin);
    int32_t *am = malloc(sizeof(int32_t) * nout), *gam = malloc(sizeof(int32_t) * nout);
    float *d_in = gpu_test_up(in, sizeof(float) * nin),
          *d_dout = gpu_test_up(dout, sizeof(float) * nout),
          *d_out = gpu_test_up(dout, sizeof(float) * nout),
          *d_din = gpu_test_up(in, sizeof(float) * nin);
    int32_t *d_am = gpu_test_up(am, sizeof(int32_t) * nout);
    char what[64];

    maxpool_forward(out, am, in, B, C, H, W);
    CHECK(kern_maxpool_forward(d_out, d_am, d_in, B, C, H, W, gpu_stream(g)) == 0, "launch");
    sync_ok(g, "max-pool forward");
    gpu_test_down(got, d_out, sizeof(float) * nout);
    snprintf(what, sizeof(what), "max-pool forward%s", name);
    gpu_test_near(what, got, out, nout, TOL_EXACT);
    gpu_test_down(gam, d_am, sizeof(int32_t) * nout);
    CHECK(memcmp(gam, am, sizeof(int32_t) * nout) == 0, "max-pool%s: argmax differs", name);

    maxpool_backward(din, dout, am, B, C, H, W);
    CHECK(kern_maxpool_backward(d_din, d_dout, d_am, B, C, H, W, gpu_stream(g)) == 0, "launch");
    sync_ok(g, "max-pool backward");
    gpu_test_down(got, d_din, sizeof(float) * nin);
    snprintf(what, sizeof(what), "max-pool backward%s", name);
    gpu_test_near(what, got, din, nin, TOL_EXACT);

    free(in), free(dout), free(out), free(din), free(got), free(am), free(gam);
    cudaFree(d_in), cudaFree(d_dout), cudaFree(d_out), cudaFree(d_din), cudaFree(d_am);
}

static void test_maxpool(gpu_ctx *g)
{
    test_maxpool_case(g, "", 0);
    test_maxpool_case(g, " (ties)", 1);
}

/* ---- softmax cross-entropy ---- */

static void test_softmax(gpu_ctx *g)
{
    int B = 37, K = 10;
    size_t n = (size_t)B * K;
    float *logits = rnd(n, -5, 5), *probs = malloc(sizeof(float) * n),
          *dl = malloc(sizeof(float) * n), *got = malloc(sizeof(float) * n);
    uint8_t labels[37];
    double hloss[37];
    for (int i = 0; i < B; i++)
        labels[i] = (uint8_t)(data_rng_next(&rng) % K);
    float *d_logits = gpu_test_up(logits, sizeof(float) * n),
          *d_probs = gpu_test_up(logits, sizeof(float) * n),
          *d_dl = gpu_test_up(logits, sizeof(float) * n);
    uint8_t *d_labels = gpu_test_up(labels, B);
    double *d_loss = gpu_test_up(hloss, sizeof(hloss));

    double loss = softmax_xent_forward(probs, logits, labels, B, K);
    CHECK(kern_softmax_xent_forward(d_probs, d_loss, d_logits, d_labels, B, K, gpu_stream(g)) == 0,
          "launch");
    sync_ok(g, "softmax forward");
    gpu_test_down(got, d_probs, sizeof(float) * n);
    gpu_test_near("softmax probabilities", got, probs, n, TOL_EXACT);
    gpu_test_down(hloss, d_loss, sizeof(hloss));
    double sum = 0;
    for (int i = 0; i < B; i++)
        sum += hloss[i];
    printf("  softmax loss: cpu %.9f gpu %.9f\n", loss, sum);
    CHECK(test_close(sum, loss, 0, 1e-6), "softmax loss %.9f, cpu %.9f", sum, loss);

    softmax_xent_backward(dl, probs, labels, B, K, 0.03f);
    CHECK(kern_softmax_xent_backward(d_dl, d_probs, d_labels, B, K, 0.03f, gpu_stream(g)) == 0,
          "launch");
    sync_ok(g, "softmax backward");
    gpu_test_down(got, d_dl, sizeof(float) * n);
    gpu_test_near("softmax backward", got, dl, n, TOL_EXACT);

    free(logits), free(probs), free(dl), free(got);
    cudaFree(d_logits), cudaFree(d_probs), cudaFree(d_dl), cudaFree(d_labels), cudaFree(d_loss);
}

/* ---- optimizers: optim_step on a CPU model and on the same model on the device ---- */

static model_config tiny_mlp(void)
{
    model_config c = {.kind = MODEL_MLP,
                      .in_c = 1,
                      .in_h = 4,
                      .in_w = 4,
                      .classes = 3,
                      .nhidden = 1,
                      .hidden = {5}};
    return c;
}

static void test_optim_kind(int kind, const char *name)
{
    model_config cfg = tiny_mlp();
    model *a, *b;
    optim *oa, *ob;
    char msg[256];
    optim_config oc = {.kind = kind,
                       .momentum = 0.9f,
                       .weight_decay = 0.01f,
                       .beta1 = 0.9f,
                       .beta2 = 0.999f,
                       .eps = 1e-8f};
    if (model_create(&cfg, 4, &a, msg) || model_create(&cfg, 4, &b, msg)) {
        CHECK(0, "model: %s", msg);
        return;
    }
    model_init_params(a, 3);
    model_init_params(b, 3);
    optim_create(&oc, a->nfloats, &oa);
    optim_create(&oc, b->nfloats, &ob);
    CHECK(gpu_attach(b, 0, msg) == 0, "attach: %s", msg);
    float *grads = rnd(a->nfloats, -1, 1);
    memcpy(a->own_grads, grads, sizeof(float) * a->nfloats);
    CHECK(cudaMemcpy(b->own_grads, grads, sizeof(float) * b->nfloats, cudaMemcpyHostToDevice) ==
                  cudaSuccess &&
              cudaDeviceSynchronize() == cudaSuccess,
          "gradient upload");
    for (int step = 0; step < 3; step++) {
        optim_step(oa, a, 0.01f * (step + 1));
        optim_step(ob, b, 0.01f * (step + 1));
    }
    CHECK(gpu_download(b, ob, msg) == 0, "download: %s", msg);
    char what[64];
    snprintf(what, sizeof(what), "%s parameters", name);
    gpu_test_near(what, b->weights, a->weights, a->nfloats, TOL_EXACT);
    snprintf(what, sizeof(what), "%s state", name);
    gpu_test_near(what, ob->state, oa->state, oa->n * oa->nstate, TOL_EXACT);
    free(grads);
    optim_free(oa), optim_free(ob);
    model_free(a), model_free(b);
}

static void test_optim(void)
{
    test_optim_kind(OPTIM_SGD, "sgd momentum");
    test_optim_kind(OPTIM_ADAMW, "adamw");
}

/* ---- whole models: forward, loss, backward, readiness order ---- */

typedef struct order {
    int n, param[MODEL_MAX_PARAMS * 4];
} order;

static void record_ready(void *ctx, int param)
{
    order *o = ctx;
    if (o->n < MODEL_MAX_PARAMS * 4) o->param[o->n++] = param;
}

static void test_model(const model_config *cfg, const char *name)
{
    model *a, *b;
    char msg[256], what[96];
    int batch = 9;
    if (model_create(cfg, 16, &a, msg) || model_create(cfg, 16, &b, msg)) {
        CHECK(0, "model: %s", msg);
        return;
    }
    model_init_params(a, 11);
    model_init_params(b, 11);
    CHECK(gpu_attach(b, 0, msg) == 0, "attach: %s", msg);
    size_t in = (size_t)cfg->in_c * cfg->in_h * cfg->in_w;
    float *grads = malloc(sizeof(float) * a->nfloats);
    /* Three batches in a row: the staging slots alternate under the same model. */
    for (int it = 0; it < 3; it++) {
        order oa = {0}, ob = {0};
        float *x = rnd(in * batch, 0, 1);
        for (int i = 0; i < batch; i++)
            a->y[i] = b->y[i] = (uint8_t)(data_rng_next(&rng) % cfg->classes);
        memcpy(a->x, x, sizeof(float) * in * batch);
        memcpy(b->x, x, sizeof(float) * in * batch);
        model_forward(a, batch);
        model_forward(b, batch);
        double la = model_loss(a, batch), lb = model_loss(b, batch);
        int ca = model_correct(a, batch), cb = model_correct(b, batch);
        model_backward(a, batch, 1.0f / batch, record_ready, &oa);
        model_backward(b, batch, 1.0f / batch, record_ready, &ob);
        CHECK(gpu_status(b, msg) == 0, "%s: %s", name, msg);
        printf("  %s batch %d: loss cpu %.7f gpu %.7f, correct %d / %d\n", name, it, la, lb, ca,
               cb);
        CHECK(test_close(lb, la, 0, 1e-5), "%s: loss %.7f, cpu %.7f", name, lb, la);
        CHECK(abs(ca - cb) <= 1, "%s: %d correct, cpu %d", name, cb, ca);
        CHECK(oa.n == ob.n && memcmp(oa.param, ob.param, sizeof(int) * oa.n) == 0,
              "%s: parameters reported ready in another order", name);
        gpu_test_down(grads, b->own_grads, sizeof(float) * b->nfloats);
        snprintf(what, sizeof(what), "%s gradients (+=, batch %d)", name, it);
        gpu_test_near(what, grads, a->own_grads, a->nfloats, TOL_SUM);
        free(x);
    }
    free(grads);
    model_free(a);
    model_free(b);
}

int main(void)
{
    gpu_test_require();
    char msg[256];
    gpu_ctx *g = gpu_ctx_create(0, msg);
    if (!g) {
        fprintf(stderr, "test_gpu_kernels: %s\n", msg);
        return 1;
    }
    test_gemm(g);
    test_linear(g);
    test_elementwise(g);
    test_conv(g);
    test_maxpool(g);
    test_softmax(g);
    gpu_ctx_free(g);
    test_optim();
    model_config mlp = {.kind = MODEL_MLP,
                        .in_c = 1,
                        .in_h = 8,
                        .in_w = 8,
                        .classes = 10,
                        .nhidden = 2,
                        .hidden = {16, 12}};
    model_config cnn = {.kind = MODEL_CNN,
                        .in_c = 1,
                        .in_h = 8,
                        .in_w = 8,
                        .classes = 10,
                        .nhidden = 1,
                        .hidden = {10},
                        .conv = {4, 6},
                        .kernel = 3};
    test_model(&mlp, "mlp");
    test_model(&cnn, "cnn");
    return check_finish("test_gpu_kernels");
}
