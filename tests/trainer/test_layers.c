/* test_layers.c: every layer's backward against central finite differences.
 *
 * For a layer y = f(x, w, b) and a fixed random R, the scalar
 * L = sum(y * R) has dL/dy = R, so backward(dout = R) must give the
 * derivative of L with respect to every input, weight and bias. L is summed
 * in double so float rounding does not drown the differences. Inputs are
 * kept away from ReLU's kink and max-pool's ties, so the check is exact up
 * to rounding. Then the same check on whole small models, through the loss.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ductile/data.h"
#include "ductile/layers.h"
#include "ductile/model.h"
#include "trainer_test.h"

static uint64_t rng = 12345;

static void fill(float *x, size_t n, float lo, float hi)
{
    for (size_t i = 0; i < n; i++)
        x[i] = lo + (hi - lo) * data_rng_uniform(&rng);
}

static double dot(const float *a, const float *b, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += (double)a[i] * b[i];
    return s;
}

typedef double (*objective_fn)(void *ctx);

/* Central differences of f over every entry of x (at most 64 of them,
 * spread out), against analytic[]. */
static void check_grad(const char *what, objective_fn f, void *ctx, float *x, const float *analytic,
                       size_t n, float eps)
{
    size_t stride = n > 64 ? n / 64 : 1;
    int bad = 0;
    for (size_t i = 0; i < n; i += stride) {
        float keep = x[i];
        x[i] = keep + eps;
        double up = f(ctx);
        x[i] = keep - eps;
        double down = f(ctx);
        x[i] = keep;
        double numeric = (up - down) / (2.0 * eps);
        if (!test_close(analytic[i], numeric, 2e-3, 1e-2) && bad++ < 3)
            CHECK(0, "%s[%zu]: backward %.6f, finite difference %.6f", what, i, analytic[i],
                  numeric);
    }
    printf("  %-16s %zu entries checked%s\n", what, (n + stride - 1) / stride,
           bad ? " (MISMATCH)" : "");
}

/* ---- linear ---- */

typedef struct {
    int b, i, o;
    float *x, *w, *bias, *y, *r;
} linear_ctx;

static double linear_obj(void *p)
{
    linear_ctx *c = p;
    linear_forward(c->y, c->x, c->w, c->bias, c->b, c->i, c->o);
    return dot(c->y, c->r, (size_t)c->b * c->o);
}

static void test_linear(void)
{
    linear_ctx c = {.b = 3, .i = 7, .o = 5};
    float x[21], w[35], bias[5], y[15], r[15], dx[21], dw[35], db[5];
    c.x = x, c.w = w, c.bias = bias, c.y = y, c.r = r;
    fill(x, 21, -1, 1), fill(w, 35, -1, 1), fill(bias, 5, -1, 1), fill(r, 15, -1, 1);
    memset(dw, 0, sizeof(dw));
    memset(db, 0, sizeof(db));
    linear_forward(y, x, w, bias, 3, 7, 5);
    linear_backward(dx, dw, db, r, x, w, 3, 7, 5);
    printf("linear\n");
    check_grad("input", linear_obj, &c, x, dx, 21, 1e-2f);
    check_grad("weight", linear_obj, &c, w, dw, 35, 1e-2f);
    check_grad("bias", linear_obj, &c, bias, db, 5, 1e-2f);

    /* Backward adds into parameter gradients: a second call doubles them. */
    float dw2[35];
    memcpy(dw2, dw, sizeof(dw));
    linear_backward(NULL, dw2, db, r, x, w, 3, 7, 5);
    CHECK(test_close(dw2[3], 2 * dw[3], 1e-6, 1e-5), "accumulate: %f vs 2*%f", dw2[3], dw[3]);
}

/* ---- relu ---- */

typedef struct {
    size_t n;
    float *x, *y, *r;
} relu_ctx;

static double relu_obj(void *p)
{
    relu_ctx *c = p;
    relu_forward(c->y, c->x, c->n);
    return dot(c->y, c->r, c->n);
}

static void test_relu(void)
{
    float x[40], y[40], r[40], dx[40];
    for (int i = 0; i < 40; i++) { /* away from the kink at 0 */
        x[i] = 0.1f + data_rng_uniform(&rng);
        if (i % 2) x[i] = -x[i];
    }
    fill(r, 40, -1, 1);
    relu_ctx c = {40, x, y, r};
    relu_forward(y, x, 40);
    relu_backward(dx, r, y, 40);
    printf("relu\n");
    check_grad("input", relu_obj, &c, x, dx, 40, 1e-2f);
}

/* ---- convolution ---- */

typedef struct {
    int b;
    conv_shape s;
    float *x, *w, *bias, *y, *r, *col;
} conv_ctx;

static double conv_obj(void *p)
{
    conv_ctx *c = p;
    conv_forward(c->y, c->x, c->w, c->bias, c->b, &c->s, c->col);
    return dot(c->y, c->r, (size_t)c->b * c->s.oc * c->s.oh * c->s.ow);
}

static void test_conv(int k, int pad)
{
    conv_ctx c = {.b = 2};
    conv_shape_init(&c.s, 2, 6, 6, 3, k, pad);
    size_t nx = 2 * 2 * 36, nw = 3 * 2 * k * k, ny = (size_t)2 * 3 * c.s.oh * c.s.ow;
    c.x = malloc(sizeof(float) * nx);
    c.w = malloc(sizeof(float) * nw);
    c.bias = malloc(sizeof(float) * 3);
    c.y = malloc(sizeof(float) * ny);
    c.r = malloc(sizeof(float) * ny);
    c.col = malloc(sizeof(float) * conv_col_size(&c.s));
    float *dcol = malloc(sizeof(float) * conv_col_size(&c.s));
    float *dx = malloc(sizeof(float) * nx), *dw = calloc(nw, sizeof(float));
    float db[3] = {0};
    fill(c.x, nx, -1, 1), fill(c.w, nw, -1, 1), fill(c.bias, 3, -1, 1), fill(c.r, ny, -1, 1);
    conv_forward(c.y, c.x, c.w, c.bias, 2, &c.s, c.col);
    conv_backward(dx, dw, db, c.r, c.x, c.w, 2, &c.s, c.col, dcol);
    printf("conv k%d pad%d (output %dx%d)\n", k, pad, c.s.oh, c.s.ow);
    check_grad("input", conv_obj, &c, c.x, dx, nx, 1e-2f);
    check_grad("weight", conv_obj, &c, c.w, dw, nw, 1e-2f);
    check_grad("bias", conv_obj, &c, c.bias, db, 3, 1e-2f);
    free(c.x), free(c.w), free(c.bias), free(c.y), free(c.r), free(c.col), free(dcol);
    free(dx), free(dw);
}

/* ---- max-pool ---- */

typedef struct {
    float *x, *y, *r;
    int32_t *am;
} pool_ctx;

static double pool_obj(void *p)
{
    pool_ctx *c = p;
    maxpool_forward(c->y, c->am, c->x, 2, 2, 4, 4);
    return dot(c->y, c->r, 2 * 2 * 4);
}

static void test_maxpool(void)
{
    float x[64], y[16], r[16], dx[64];
    int32_t am[16];
    for (int i = 0; i < 64; i++) /* distinct values 0.05 apart: no ties within eps */
        x[i] = 0.05f * i - 1.6f;
    for (int i = 63; i > 0; i--) {
        int j = (int)(data_rng_next(&rng) % (uint64_t)(i + 1));
        float t = x[i];
        x[i] = x[j];
        x[j] = t;
    }
    fill(r, 16, -1, 1);
    pool_ctx c = {x, y, r, am};
    maxpool_forward(y, am, x, 2, 2, 4, 4);
    maxpool_backward(dx, r, am, 2, 2, 4, 4);
    printf("maxpool\n");
    check_grad("input", pool_obj, &c, x, dx, 64, 1e-2f);
}

/* ---- softmax cross-entropy ---- */

typedef struct {
    float *z, *p;
    uint8_t *labels;
} xent_ctx;

static double xent_obj(void *p)
{
    xent_ctx *c = p;
    return softmax_xent_forward(c->p, c->z, c->labels, 4, 5) * 0.25;
}

static void test_softmax_xent(void)
{
    float z[20], p[20], dz[20];
    uint8_t labels[4] = {0, 3, 4, 1};
    fill(z, 20, -3, 3);
    xent_ctx c = {z, p, labels};
    double loss = softmax_xent_forward(p, z, labels, 4, 5);
    softmax_xent_backward(dz, p, labels, 4, 5, 0.25f);
    printf("softmax-xent\n");
    check_grad("logits", xent_obj, &c, z, dz, 20, 3e-3f);
    /* Hand-checked case: equal logits give log(K) per sample. */
    float flat[5] = {0}, pf[5];
    uint8_t l0 = 2;
    CHECK(test_close(softmax_xent_forward(pf, flat, &l0, 1, 5), log(5.0), 1e-6, 1e-6),
          "uniform logits");
    CHECK(loss > 0, "loss %f", loss);
    /* Large logits do not overflow. */
    float big[5] = {1000, 0, 0, 0, 0};
    double lb = softmax_xent_forward(pf, big, &l0, 1, 5);
    CHECK(isfinite(lb) && test_close(lb, 1000.0, 1e-3, 1e-6), "large logits: %f", lb);
}

/* ---- whole models, through the loss ---- */

typedef struct {
    model *m;
    int batch;
} model_ctx;

static double model_obj(void *p)
{
    model_ctx *c = p;
    model_forward(c->m, c->batch);
    return model_loss(c->m, c->batch) / c->batch;
}

static void test_model(const model_config *cfg, const char *name)
{
    model *m;
    char msg[256];
    int batch = 3;
    if (model_create(cfg, batch, &m, msg) != 0) {
        CHECK(0, "model_create: %s", msg);
        return;
    }
    model_init_params(m, 7);
    size_t in = (size_t)cfg->in_c * cfg->in_h * cfg->in_w;
    fill(m->x, in * batch, -1, 1);
    for (int i = 0; i < batch; i++)
        m->y[i] = (uint8_t)(i * 3 % cfg->classes);
    model_forward(m, batch);
    model_loss(m, batch);
    memset(m->own_grads, 0, sizeof(float) * m->nfloats);
    model_backward(m, batch, 1.0f / batch, NULL, NULL);
    model_ctx c = {m, batch};
    printf("model %s\n", name);
    float *analytic = malloc(sizeof(float) * m->nfloats);
    memcpy(analytic, m->own_grads, sizeof(float) * m->nfloats);
    for (int i = 0; i < m->nparams; i++)
        check_grad(m->params[i].name, model_obj, &c, m->params[i].data,
                   analytic + m->params[i].offset, m->params[i].numel, 1e-3f);
    free(analytic);
    model_free(m);
}

/* Parameters are reported ready in reverse order, each exactly once. */
typedef struct {
    int order[MODEL_MAX_PARAMS];
    int n;
} ready_log;

static void log_ready(void *ctx, int param)
{
    ready_log *l = ctx;
    if (l->n < MODEL_MAX_PARAMS) l->order[l->n] = param;
    l->n++;
}

static void test_ready_order(const model_config *cfg)
{
    model *m;
    char msg[256];
    if (model_create(cfg, 2, &m, msg) != 0) {
        CHECK(0, "model_create: %s", msg);
        return;
    }
    model_init_params(m, 1);
    memset(m->x, 0, sizeof(float) * cfg->in_c * cfg->in_h * cfg->in_w * 2);
    m->y[0] = m->y[1] = 1;
    model_forward(m, 2);
    model_loss(m, 2);
    ready_log l = {.n = 0};
    model_backward(m, 2, 0.5f, log_ready, &l);
    CHECK(l.n == m->nparams, "%d ready calls for %d parameters", l.n, m->nparams);
    for (int i = 0; i < l.n && i < m->nparams; i++)
        CHECK(l.order[i] == m->nparams - 1 - i, "ready call %d was parameter %d", i, l.order[i]);
    model_free(m);
}

int main(void)
{
    test_linear();
    test_relu();
    test_conv(3, 1);
    test_conv(5, 2);
    test_conv(3, 0);
    test_maxpool();
    test_softmax_xent();

    model_config mlp = {.kind = MODEL_MLP,
                        .in_c = 1,
                        .in_h = 4,
                        .in_w = 4,
                        .classes = 5,
                        .nhidden = 2,
                        .hidden = {6, 5}};
    model_config cnn = {.kind = MODEL_CNN,
                        .in_c = 1,
                        .in_h = 8,
                        .in_w = 8,
                        .classes = 4,
                        .nhidden = 1,
                        .hidden = {6},
                        .conv = {2, 3},
                        .kernel = 3};
    test_model(&mlp, "mlp");
    test_model(&cnn, "cnn");
    test_ready_order(&mlp);
    test_ready_order(&cnn);
    return check_finish("test_layers");
}
