/* rt_kernels.c: the kernel launchers of trainer/kernels.h on the host test
 * runtime (see rt.h).
 *
 * The one idea: a launch is a stream op whose run() calls the CPU code the
 * CPU trainer itself runs (layers.c, optim.c), so a "kernel" here computes
 * exactly what the CPU path computes, and a GPU test against the CPU
 * reference checks the GPU path's plumbing (pointers, shapes, streams, the
 * order of launches) rather than the arithmetic. What the launch adds is
 * what a real launch cannot check: every pointer is cudaMalloc memory over
 * the bytes the kernel touches, and those bytes are declared as the op's
 * reads and writes, so rt_enqueue finds a launch that races another stream.
 *
 * As kernels.cu, a launcher with nothing to compute queues nothing; every
 * launcher is still a call for the failpoints (gpurt.cuda.kern_NAME).
 * Stricter than the real kernels: a negative size, a label outside the
 * classes and an argmax outside its plane abort (the device would compute a
 * wrapped grid, or read and write out of bounds, without a word).
 */
#include "rt.h"

#include <stdlib.h>
#include <string.h>

#include "ductile/layers.h"
#include "ductile/optim.h"
#include "kernels.h"

/* ---- what every launcher does ---- */

/* The failpoint's action for this launch in *action; 1 when the launch
 * fails at once, as a bad launch configuration does. */
static int launch_refused(const char *call, const char **action)
{
    *action = rt_call("cuda", call);
    return *action && strcmp(*action, "error") == 0;
}

/* A copy of init (a struct with rt_op first, `size` bytes) on the heap, as
 * the op `call` that run() executes; the runtime frees it. */
static void *op_new(const void *init, size_t size, const char *call, rt_state (*run)(rt_op *))
{
    rt_op *op = malloc(size);
    if (!op) rt_die("%s: out of memory for the launch", call);
    memcpy(op, init, size);
    op->name = call;
    op->run = run;
    return op;
}

/* A pointer argument: device memory over the bytes the kernel touches,
 * which op reads (write 0) or writes. */
static void arg(rt_op *op, const char *name, const void *p, size_t bytes, int write)
{
    rt_need(op->name, name, p, bytes, RT_NEED_DEVICE);
    if (bytes) rt_op_access(op, p, bytes, write);
}

static int launch(kern_stream s, rt_op *op, const char *action)
{
    op->kernel = 1;
    return (int)rt_enqueue(s, op, action);
}

static void need_size(const char *call, const char *what, int v)
{
    if (v < 0) rt_die("%s: %s = %d is negative", call, what, v);
}
#define NEED_SIZE(call, v) need_size(call, #v, v)

static void need_shape(const char *call, const conv_shape *sh)
{
    if (!sh) rt_die("%s: sh is NULL", call);
    if (sh->c < 0 || sh->h < 0 || sh->w < 0 || sh->k < 0 || sh->oh < 0 || sh->ow < 0)
        rt_die("%s: shape c %d h %d w %d k %d oh %d ow %d has a negative size", call, sh->c, sh->h,
               sh->w, sh->k, sh->oh, sh->ow);
}

/* ---- fill, scale (no CPU twin: the loops of kernels.cu) ---- */

typedef struct {
    rt_op op;
    float *x;
    size_t n;
    float v;
} vec_op;

static rt_state run_fill(rt_op *op)
{
    vec_op *k = (vec_op *)op;
    for (size_t i = 0; i < k->n; i++)
        k->x[i] = k->v;
    return RT_DONE;
}

static rt_state run_scale(rt_op *op)
{
    vec_op *k = (vec_op *)op;
    for (size_t i = 0; i < k->n; i++)
        k->x[i] *= k->v;
    return RT_DONE;
}

static int launch_vec(const char *call, rt_state (*run)(rt_op *), float *x, size_t n, float v,
                      kern_stream s)
{
    const char *a;
    if (launch_refused(call, &a)) return cudaErrorLaunchFailure;
    if (n == 0) return 0;
    vec_op init = {.x = x, .n = n, .v = v};
    vec_op *k = op_new(&init, sizeof(init), call, run);
    arg(&k->op, "x", x, sizeof(float) * n, 1); /* scale's read is inside its write */
    return launch(s, &k->op, a);
}

int kern_fill(float *x, size_t n, float v, kern_stream s)
{
    return launch_vec(__func__, run_fill, x, n, v, s);
}

int kern_scale(float *x, size_t n, float a, kern_stream s)
{
    return launch_vec(__func__, run_scale, x, n, a, s);
}

/* ---- bias ---- */

typedef struct {
    rt_op op;
    float *dst;
    const float *src;
    int outer, channels, inner;
} bias_op;

static rt_state run_bias_fill(rt_op *op)
{
    bias_op *k = (bias_op *)op;
    layer_bias_fill(k->dst, k->src, k->outer, k->channels, k->inner);
    return RT_DONE;
}

static rt_state run_bias_grad(rt_op *op)
{
    bias_op *k = (bias_op *)op;
    layer_bias_grad(k->dst, k->src, k->outer, k->channels, k->inner);
    return RT_DONE;
}

int kern_bias_fill(float *out, const float *b, int outer, int channels, int inner, kern_stream s)
{
    const char *a;
    if (launch_refused(__func__, &a)) return cudaErrorLaunchFailure;
    NEED_SIZE(__func__, outer);
    NEED_SIZE(__func__, channels);
    NEED_SIZE(__func__, inner);
    size_t total = (size_t)outer * channels * inner;
    if (total == 0) return 0;
    bias_op init = {.dst = out, .src = b, .outer = outer, .channels = channels, .inner = inner};
    bias_op *k = op_new(&init, sizeof(init), __func__, run_bias_fill);
    arg(&k->op, "out", out, sizeof(float) * total, 1);
    arg(&k->op, "b", b, sizeof(float) * channels, 0);
    return launch(s, &k->op, a);
}

int kern_bias_grad(float *db, const float *dout, int outer, int channels, int inner, kern_stream s)
{
    const char *a;
    if (launch_refused(__func__, &a)) return cudaErrorLaunchFailure;
    NEED_SIZE(__func__, outer);
    NEED_SIZE(__func__, channels);
    NEED_SIZE(__func__, inner);
    size_t total = (size_t)outer * channels * inner;
    if (total == 0) return 0;
    bias_op init = {.dst = db, .src = dout, .outer = outer, .channels = channels, .inner = inner};
    bias_op *k = op_new(&init, sizeof(init), __func__, run_bias_grad);
    arg(&k->op, "db", db, sizeof(float) * channels, 1);
    arg(&k->op, "dout", dout, sizeof(float) * total, 0);
    return launch(s, &k->op, a);
}

/* ---- relu ---- */

typedef struct {
    rt_op op;
    float *dst;
    const float *src, *out; /* out: backward only */
    size_t n;
} relu_op;

static rt_state run_relu_forward(rt_op *op)
{
    relu_op *k = (relu_op *)op;
    relu_forward(k->dst, k->src, k->n);
    return RT_DONE;
}

static rt_state run_relu_backward(rt_op *op)
{
    relu_op *k = (relu_op *)op;
    relu_backward(k->dst, k->src, k->out, k->n);
    return RT_DONE;
}

int kern_relu_forward(float *out, const float *in, size_t n, kern_stream s)
{
    const char *a;
    if (launch_refused(__func__, &a)) return cudaErrorLaunchFailure;
    if (n == 0) return 0;
    relu_op init = {.dst = out, .src = in, .n = n};
    relu_op *k = op_new(&init, sizeof(init), __func__, run_relu_forward);
    arg(&k->op, "out", out, sizeof(float) * n, 1);
    arg(&k->op, "in", in, sizeof(float) * n, 0);
    return launch(s, &k->op, a);
}

int kern_relu_backward(float *din, const float *dout, const float *out, size_t n, kern_stream s)
{
    const char *a;
    if (launch_refused(__func__, &a)) return cudaErrorLaunchFailure;
    if (n == 0) return 0;
    relu_op init = {.dst = din, .src = dout, .out = out, .n = n};
    relu_op *k = op_new(&init, sizeof(init), __func__, run_relu_backward);
    arg(&k->op, "din", din, sizeof(float) * n, 1);
    arg(&k->op, "dout", dout, sizeof(float) * n, 0);
    arg(&k->op, "out", out, sizeof(float) * n, 0);
    return launch(s, &k->op, a);
}

/* ---- im2col / col2im (layers.c's, one sample at a time), batch sums ---- */

typedef struct {
    rt_op op;
    float *dst;
    const float *src;
    int batch;
    conv_shape sh; /* a copy: the launch takes the shape by value */
} conv_op;

static size_t image_size(const conv_shape *sh)
{
    return (size_t)sh->c * sh->h * sh->w;
}

static rt_state run_im2col(rt_op *op)
{
    conv_op *k = (conv_op *)op;
    size_t col = conv_col_size(&k->sh), img = image_size(&k->sh);
    for (int n = 0; n < k->batch; n++)
        conv_im2col(k->dst + n * col, k->src + n * img, &k->sh);
    return RT_DONE;
}

static rt_state run_col2im(rt_op *op)
{
    conv_op *k = (conv_op *)op;
    size_t col = conv_col_size(&k->sh), img = image_size(&k->sh);
    for (int n = 0; n < k->batch; n++)
        conv_col2im(k->dst + n * img, k->src + n * col, &k->sh);
    return RT_DONE;
}

int kern_im2col(float *col, const float *in, int batch, const conv_shape *sh, kern_stream s)
{
    const char *a;
    if (launch_refused(__func__, &a)) return cudaErrorLaunchFailure;
    NEED_SIZE(__func__, batch);
    need_shape(__func__, sh);
    size_t ncol = (size_t)batch * conv_col_size(sh), nin = (size_t)batch * image_size(sh);
    if (ncol == 0) return 0;
    conv_op init = {.dst = col, .src = in, .batch = batch, .sh = *sh};
    conv_op *k = op_new(&init, sizeof(init), __func__, run_im2col);
    arg(&k->op, "col", col, sizeof(float) * ncol, 1);
    arg(&k->op, "in", in, sizeof(float) * nin, 0);
    return launch(s, &k->op, a);
}

int kern_col2im(float *in, const float *col, int batch, const conv_shape *sh, kern_stream s)
{
    const char *a;
    if (launch_refused(__func__, &a)) return cudaErrorLaunchFailure;
    NEED_SIZE(__func__, batch);
    need_shape(__func__, sh);
    size_t ncol = (size_t)batch * conv_col_size(sh), nin = (size_t)batch * image_size(sh);
    if (nin == 0) return 0;
    conv_op init = {.dst = in, .src = col, .batch = batch, .sh = *sh};
    conv_op *k = op_new(&init, sizeof(init), __func__, run_col2im);
    arg(&k->op, "in", in, sizeof(float) * nin, 1);
    arg(&k->op, "col", col, sizeof(float) * ncol, 0);
    return launch(s, &k->op, a);
}

typedef struct {
    rt_op op;
    float *dst;
    const float *src;
    int batch;
    size_t n;
} sum_op;

/* No CPU twin (the CPU adds each sample's product into dw in its GEMM):
 * kernels.cu's loop, in its order per element. */
static rt_state run_sum_batches(rt_op *op)
{
    sum_op *k = (sum_op *)op;
    for (size_t j = 0; j < k->n; j++) {
        float acc = k->dst[j];
        for (int b = 0; b < k->batch; b++)
            acc += k->src[(size_t)b * k->n + j];
        k->dst[j] = acc;
    }
    return RT_DONE;
}

int kern_sum_batches(float *dst, const float *src, int batch, size_t n, kern_stream s)
{
    const char *a;
    if (launch_refused(__func__, &a)) return cudaErrorLaunchFailure;
    NEED_SIZE(__func__, batch);
    if (n == 0) return 0;
    sum_op init = {.dst = dst, .src = src, .batch = batch, .n = n};
    sum_op *k = op_new(&init, sizeof(init), __func__, run_sum_batches);
    arg(&k->op, "dst", dst, sizeof(float) * n, 1);
    arg(&k->op, "src", src, sizeof(float) * batch * n, 0);
    return launch(s, &k->op, a);
}

/* ---- max-pool 2x2 ---- */

typedef struct {
    rt_op op;
    float *dst;
    const float *src;
    int32_t *argmax_out;      /* forward */
    const int32_t *argmax_in; /* backward */
    int batch, c, h, w;
} pool_op;

static rt_state run_maxpool_forward(rt_op *op)
{
    pool_op *k = (pool_op *)op;
    maxpool_forward(k->dst, k->argmax_out, k->src, k->batch, k->c, k->h, k->w);
    return RT_DONE;
}

static rt_state run_maxpool_backward(rt_op *op)
{
    pool_op *k = (pool_op *)op;
    size_t total = (size_t)k->batch * k->c * (k->h / 2) * (k->w / 2);
    for (size_t i = 0; i < total; i++)
        if (k->argmax_in[i] < 0 || k->argmax_in[i] >= k->h * k->w)
            rt_die("kern_maxpool_backward: argmax[%zu] = %d lies outside its %dx%d plane", i,
                   (int)k->argmax_in[i], k->h, k->w);
    maxpool_backward(k->dst, k->src, k->argmax_in, k->batch, k->c, k->h, k->w);
    return RT_DONE;
}

int kern_maxpool_forward(float *out, int32_t *argmax, const float *in, int batch, int c, int h,
                         int w, kern_stream s)
{
    const char *a;
    if (launch_refused(__func__, &a)) return cudaErrorLaunchFailure;
    NEED_SIZE(__func__, batch);
    NEED_SIZE(__func__, c);
    NEED_SIZE(__func__, h);
    NEED_SIZE(__func__, w);
    size_t nin = (size_t)batch * c * h * w, nout = (size_t)batch * c * (h / 2) * (w / 2);
    if (nout == 0) return 0;
    pool_op init = {
        .dst = out, .src = in, .argmax_out = argmax, .batch = batch, .c = c, .h = h, .w = w};
    pool_op *k = op_new(&init, sizeof(init), __func__, run_maxpool_forward);
    arg(&k->op, "out", out, sizeof(float) * nout, 1);
    arg(&k->op, "argmax", argmax, sizeof(int32_t) * nout, 1);
    arg(&k->op, "in", in, sizeof(float) * nin, 0);
    return launch(s, &k->op, a);
}

/* din is zeroed whole (kernels.cu: a memset before the scatter), even with
 * no window to scatter from. */
int kern_maxpool_backward(float *din, const float *dout, const int32_t *argmax, int batch, int c,
                          int h, int w, kern_stream s)
{
    const char *a;
    if (launch_refused(__func__, &a)) return cudaErrorLaunchFailure;
    NEED_SIZE(__func__, batch);
    NEED_SIZE(__func__, c);
    NEED_SIZE(__func__, h);
    NEED_SIZE(__func__, w);
    size_t nin = (size_t)batch * c * h * w, nout = (size_t)batch * c * (h / 2) * (w / 2);
    if (nin == 0) return 0;
    pool_op init = {
        .dst = din, .src = dout, .argmax_in = argmax, .batch = batch, .c = c, .h = h, .w = w};
    pool_op *k = op_new(&init, sizeof(init), __func__, run_maxpool_backward);
    arg(&k->op, "din", din, sizeof(float) * nin, 1);
    arg(&k->op, "dout", dout, sizeof(float) * nout, 0);
    arg(&k->op, "argmax", argmax, sizeof(int32_t) * nout, 0);
    return launch(s, &k->op, a);
}

/* ---- softmax cross-entropy ---- */

typedef struct {
    rt_op op;
    float *dst;
    double *loss; /* forward */
    const float *src;
    const uint8_t *labels;
    int batch, classes;
    float scale; /* backward */
} xent_op;

/* softmax_xent_forward one sample at a time: the sum it returns for a batch
 * of one is that sample's loss. */
static rt_state run_xent_forward(rt_op *op)
{
    xent_op *k = (xent_op *)op;
    for (int i = 0; i < k->batch; i++) {
        if (k->labels[i] >= k->classes)
            rt_die("kern_softmax_xent_forward: labels[%d] = %d, with %d classes", i, k->labels[i],
                   k->classes);
        size_t row = (size_t)i * k->classes;
        k->loss[i] = softmax_xent_forward(k->dst + row, k->src + row, k->labels + i, 1, k->classes);
    }
    return RT_DONE;
}

static rt_state run_xent_backward(rt_op *op)
{
    xent_op *k = (xent_op *)op;
    softmax_xent_backward(k->dst, k->src, k->labels, k->batch, k->classes, k->scale);
    return RT_DONE;
}

int kern_softmax_xent_forward(float *probs, double *loss, const float *logits,
                              const uint8_t *labels, int batch, int classes, kern_stream s)
{
    const char *a;
    if (launch_refused(__func__, &a)) return cudaErrorLaunchFailure;
    NEED_SIZE(__func__, batch);
    NEED_SIZE(__func__, classes);
    size_t n = (size_t)batch * classes;
    if (batch == 0) return 0;
    xent_op init = {.dst = probs,
                    .loss = loss,
                    .src = logits,
                    .labels = labels,
                    .batch = batch,
                    .classes = classes};
    xent_op *k = op_new(&init, sizeof(init), __func__, run_xent_forward);
    arg(&k->op, "probs", probs, sizeof(float) * n, 1);
    arg(&k->op, "loss", loss, sizeof(double) * batch, 1);
    arg(&k->op, "logits", logits, sizeof(float) * n, 0);
    arg(&k->op, "labels", labels, batch, 0);
    return launch(s, &k->op, a);
}

int kern_softmax_xent_backward(float *dlogits, const float *probs, const uint8_t *labels, int batch,
                               int classes, float scale, kern_stream s)
{
    const char *a;
    if (launch_refused(__func__, &a)) return cudaErrorLaunchFailure;
    NEED_SIZE(__func__, batch);
    NEED_SIZE(__func__, classes);
    size_t n = (size_t)batch * classes;
    if (n == 0) return 0;
    xent_op init = {.dst = dlogits,
                    .src = probs,
                    .labels = labels,
                    .batch = batch,
                    .classes = classes,
                    .scale = scale};
    xent_op *k = op_new(&init, sizeof(init), __func__, run_xent_backward);
    arg(&k->op, "dlogits", dlogits, sizeof(float) * n, 1);
    arg(&k->op, "probs", probs, sizeof(float) * n, 0);
    arg(&k->op, "labels", labels, batch, 0);
    return launch(s, &k->op, a);
}

/* ---- optimizers (optim.c's updates) ---- */

typedef struct {
    rt_op op;
    float *p, *s0, *s1; /* parameters; SGD's momentum buffer, or AdamW's m and v */
    const float *g;
    size_t n;
    float lr, momentum, beta1, beta2, eps, wd, bc1, bc2;
} optim_op;

static rt_state run_sgd(rt_op *op)
{
    optim_op *k = (optim_op *)op;
    optim_sgd_update(k->p, k->g, k->s0, k->n, k->lr, k->momentum, k->wd);
    return RT_DONE;
}

static rt_state run_adamw(rt_op *op)
{
    optim_op *k = (optim_op *)op;
    optim_adamw_update(k->p, k->g, k->s0, k->s1, k->n, k->lr, k->beta1, k->beta2, k->eps, k->wd,
                       k->bc1, k->bc2);
    return RT_DONE;
}

int kern_sgd_update(float *p, const float *g, float *buf, size_t n, float lr, float momentum,
                    float wd, kern_stream s)
{
    const char *a;
    if (launch_refused(__func__, &a)) return cudaErrorLaunchFailure;
    if (n == 0) return 0;
    optim_op init = {.p = p, .s0 = buf, .g = g, .n = n, .lr = lr, .momentum = momentum, .wd = wd};
    optim_op *k = op_new(&init, sizeof(init), __func__, run_sgd);
    arg(&k->op, "p", p, sizeof(float) * n, 1);
    arg(&k->op, "g", g, sizeof(float) * n, 0);
    arg(&k->op, "buf", buf, sizeof(float) * n, 1);
    return launch(s, &k->op, a);
}

int kern_adamw_update(float *p, const float *g, float *m, float *v, size_t n, float lr, float beta1,
                      float beta2, float eps, float wd, float bc1, float bc2, kern_stream s)
{
    const char *a;
    if (launch_refused(__func__, &a)) return cudaErrorLaunchFailure;
    if (n == 0) return 0;
    optim_op init = {.p = p,
                     .s0 = m,
                     .s1 = v,
                     .g = g,
                     .n = n,
                     .lr = lr,
                     .beta1 = beta1,
                     .beta2 = beta2,
                     .eps = eps,
                     .wd = wd,
                     .bc1 = bc1,
                     .bc2 = bc2};
    optim_op *k = op_new(&init, sizeof(init), __func__, run_adamw);
    arg(&k->op, "p", p, sizeof(float) * n, 1);
    arg(&k->op, "g", g, sizeof(float) * n, 0);
    arg(&k->op, "m", m, sizeof(float) * n, 1);
    arg(&k->op, "v", v, sizeof(float) * n, 1);
    return launch(s, &k->op, a);
}
