/* gpu_model_cuda.c: the model's compute on a CUDA device.
 *
 * Forward and backward walk model.c's layer list on the device mirror
 * (gpu_cuda.c) with cuBLAS for the products and kernels.cu for the rest,
 * then the optimizer updates there. Row-major gemm() maps onto
 * column-major cuBLAS by computing C^T = op(B)^T op(A)^T: swap the operands
 * and m with n, keep every leading dimension, and the bytes come out as
 * the row-major C. Convolution runs im2col over the whole
 * batch and one strided-batched GEMM where the CPU loops over samples.
 *
 * Batches go through two pinned host slots: the trainer gathers into m->x,
 * forward copies that slot on the copy stream and hands the other slot to
 * the host, waiting only until that slot's previous copy has finished; the
 * copy of a slot waits for the compute stream to be done reading it.
 *
 * Knowingly simple: one GEMM per linear layer is tiny at this model size,
 * so a small-batch MLP is launch-bound on a big GPU. CUDA graphs of the
 * whole step would remove the launch cost.
 */
#include "gpu_cuda.h"

#include <math.h>
#include <stdint.h>

/* ---- the layers ---- */

static cublasOperation_t op(int trans)
{
    return trans ? CUBLAS_OP_T : CUBLAS_OP_N;
}

void gpu_gemm(gpu_ctx *g, int trans_a, int trans_b, int m, int n, int k, float alpha,
              const float *a, int lda, const float *b, int ldb, float beta, float *c, int ldc)
{
    blas_ok(g,
            cublasSgemm(g->blas, op(trans_b), op(trans_a), n, m, k, &alpha, b, ldb, a, lda, &beta,
                        c, ldc),
            "cublasSgemm");
}

/* gpu_gemm over `count` independent problems at fixed strides (0: shared). */
static void gemm_batched(gpu_ctx *g, int trans_a, int trans_b, int m, int n, int k, float alpha,
                         const float *a, int lda, long long sa, const float *b, int ldb,
                         long long sb, float beta, float *c, int ldc, long long sc, int count)
{
    blas_ok(g,
            cublasSgemmStridedBatched(g->blas, op(trans_b), op(trans_a), n, m, k, &alpha, b, ldb,
                                      sb, a, lda, sa, &beta, c, ldc, sc, count),
            "cublasSgemmStridedBatched");
}

void gpu_linear_forward(gpu_ctx *g, float *out, const float *in, const float *w, const float *b,
                        int batch, int in_dim, int out_dim)
{
    kern_ok(g, kern_bias_fill(out, b, batch, out_dim, 1, g->compute), "bias");
    gpu_gemm(g, 0, 1, batch, out_dim, in_dim, 1.0f, in, in_dim, w, in_dim, 1.0f, out, out_dim);
}

void gpu_linear_backward(gpu_ctx *g, float *din, float *dw, float *db, const float *dout,
                         const float *in, const float *w, int batch, int in_dim, int out_dim)
{
    gpu_gemm(g, 1, 0, out_dim, in_dim, batch, 1.0f, dout, out_dim, in, in_dim, 1.0f, dw, in_dim);
    kern_ok(g, kern_bias_grad(db, dout, batch, out_dim, 1, g->compute), "bias gradient");
    if (din)
        gpu_gemm(g, 0, 0, batch, in_dim, out_dim, 1.0f, dout, out_dim, w, in_dim, 0.0f, din,
                 in_dim);
}

void gpu_conv_forward(gpu_ctx *g, float *out, const float *in, const float *w, const float *b,
                      int batch, const conv_shape *s, float *col)
{
    int ohw = s->oh * s->ow, ckk = s->c * s->k * s->k;
    kern_ok(g, kern_im2col(col, in, batch, s, g->compute), "im2col");
    kern_ok(g, kern_bias_fill(out, b, batch, s->oc, ohw, g->compute), "bias");
    gemm_batched(g, 0, 0, s->oc, ohw, ckk, 1.0f, w, ckk, 0, col, ohw, (long long)ckk * ohw, 1.0f,
                 out, ohw, (long long)s->oc * ohw, batch);
}

void gpu_conv_backward(gpu_ctx *g, float *din, float *dw, float *db, const float *dout,
                       const float *in, const float *w, int batch, const conv_shape *s, float *col,
                       float *dcol, float *dwtmp)
{
    int ohw = s->oh * s->ow, ckk = s->c * s->k * s->k;
    kern_ok(g, kern_im2col(col, in, batch, s, g->compute), "im2col");
    /* Per-sample weight gradients, then their sum: two launches, not one per sample. */
    gemm_batched(g, 0, 1, s->oc, ckk, ohw, 1.0f, dout, ohw, (long long)s->oc * ohw, col, ohw,
                 (long long)ckk * ohw, 0.0f, dwtmp, ckk, (long long)s->oc * ckk, batch);
    kern_ok(g, kern_sum_batches(dw, dwtmp, batch, (size_t)s->oc * ckk, g->compute), "dw sum");
    kern_ok(g, kern_bias_grad(db, dout, batch, s->oc, ohw, g->compute), "bias gradient");
    if (din) {
        gemm_batched(g, 1, 0, ckk, ohw, s->oc, 1.0f, w, ckk, 0, dout, ohw, (long long)s->oc * ohw,
                     0.0f, dcol, ohw, (long long)ckk * ohw, batch);
        kern_ok(g, kern_col2im(din, dcol, batch, s, g->compute), "col2im");
    }
}

/* ---- forward, loss, backward ---- */

/* The batch the host gathered into m->x/m->y goes to the device on the copy
 * stream; the other slot becomes m->x/m->y once its last copy is done. */
static void stage_batch(gpu_ctx *g, model *m, int batch)
{
    int s = g->slot;
    size_t in = (size_t)m->cfg.in_c * m->cfg.in_h * m->cfg.in_w;
    cuda_ok(g, cudaStreamWaitEvent(g->copy, g->consumed[s], 0), "copy wait");
    cuda_ok(g,
            cudaMemcpyAsync(g->dx[s], g->hx[s], sizeof(float) * in * batch, cudaMemcpyHostToDevice,
                            g->copy),
            "batch copy");
    cuda_ok(g, cudaMemcpyAsync(g->dy[s], g->hy[s], batch, cudaMemcpyHostToDevice, g->copy),
            "label copy");
    cuda_ok(g, cudaEventRecord(g->copied[s], g->copy), "event");
    cuda_ok(g, cudaStreamWaitEvent(g->compute, g->copied[s], 0), "compute wait");
    g->cur = s;
    g->slot = s ^ 1;
    g->slot_free[s] = 0;
    /* The host gathers the next batch into the other slot once its last
     * copy is done: a host sync since (the step's) already says so. */
    if (!g->slot_free[s ^ 1] && cuda_ok(g, cudaEventSynchronize(g->copied[s ^ 1]), "staging slot"))
        g->slot_free[s ^ 1] = 1;
    m->x = g->hx[s ^ 1];
    m->y = g->hy[s ^ 1];
}

static const float *input_of(gpu_ctx *g, int i)
{
    return i == 0 ? g->dx[g->cur] : g->out[i - 1];
}

const float *gpu_forward(model *m, int batch)
{
    gpu_ctx *g = m->dev;
    stage_batch(g, m, batch);
    for (int i = 0; i < m->nlayers; i++) {
        model_layer *l = &m->layers[i];
        const float *in = input_of(g, i);
        switch (l->kind) {
        case LAYER_LINEAR:
            gpu_linear_forward(g, g->out[i], in, m->params[l->wparam].data,
                               m->params[l->bparam].data, batch, l->in_size, l->out_size);
            break;
        case LAYER_RELU:
            kern_ok(g, kern_relu_forward(g->out[i], in, (size_t)batch * l->out_size, g->compute),
                    "relu");
            break;
        case LAYER_CONV:
            gpu_conv_forward(g, g->out[i], in, m->params[l->wparam].data, m->params[l->bparam].data,
                             batch, &l->conv, g->col);
            break;
        case LAYER_MAXPOOL:
            kern_ok(g,
                    kern_maxpool_forward(g->out[i], g->argmax[i], in, batch, l->c, l->h, l->w,
                                         g->compute),
                    "max-pool");
            break;
        }
    }
    cuda_ok(g, cudaEventRecord(g->consumed[g->cur], g->compute), "event");
    return g->out[m->nlayers - 1];
}

/* The per-sample losses of the last forward, queued into pinned slot
 * `slot` (GPU_LOSS_SLOTS of them for a step's queued micro-batches, one
 * more, the last, for gpu_loss). */
static double *loss_to_host(gpu_ctx *g, model *m, int batch, int slot)
{
    double *to = g->hloss + (size_t)slot * (size_t)m->max_batch;
    kern_ok(g,
            kern_softmax_xent_forward(g->probs, g->loss, g->out[m->nlayers - 1], g->dy[g->cur],
                                      batch, m->cfg.classes, g->compute),
            "softmax");
    cuda_ok(
        g, cudaMemcpyAsync(to, g->loss, sizeof(double) * batch, cudaMemcpyDeviceToHost, g->compute),
        "loss copy");
    /* The kernel read the slot's labels: its next batch copy waits for it
     * too (forward's mark is before it; a loss with no backward after it
     * would otherwise race the copy). */
    cuda_ok(g, cudaEventRecord(g->consumed[g->cur], g->compute), "event");
    return to;
}

static double sum_of(const double *v, int n)
{
    double s = 0.0;
    for (int i = 0; i < n; i++)
        s += v[i];
    return s;
}

double gpu_loss(model *m, int batch)
{
    gpu_ctx *g = m->dev;
    /* Its own slot: the step's queued losses are not yet read. */
    const double *from = loss_to_host(g, m, batch, GPU_LOSS_SLOTS);
    if (gpu_sync(g, NULL) != 0) return NAN;
    return sum_of(from, batch);
}

void gpu_loss_queue(model *m, int batch)
{
    gpu_ctx *g = m->dev;
    if (g->loss_n >= GPU_LOSS_SLOTS) {
        gpu_fail(g, "gpu_loss_queue: more than %d micro-batches in a step", GPU_LOSS_SLOTS);
        return;
    }
    loss_to_host(g, m, batch, g->loss_n);
    g->loss_count[g->loss_n++] = batch;
}

int gpu_loss_take(model *m, double *loss, int max)
{
    gpu_ctx *g = m->dev;
    int n = g->loss_n < max ? g->loss_n : max;
    for (int i = 0; i < n; i++)
        loss[i] = sum_of(g->hloss + (size_t)i * (size_t)m->max_batch, g->loss_count[i]);
    g->loss_n = 0;
    return n;
}

int gpu_error(model *m, char *msg)
{
    gpu_ctx *g = m->dev;
    if (g->failed) snprintf(msg, GPU_MSG_MAX, "%s", g->err);
    return g->failed ? -1 : 0;
}

int gpu_correct(const model *m, int batch)
{
    gpu_ctx *g = m->dev;
    int k = m->cfg.classes, correct = 0;
    cuda_ok(g,
            cudaMemcpyAsync(g->hlogits, g->out[m->nlayers - 1], sizeof(float) * k * batch,
                            cudaMemcpyDeviceToHost, g->compute),
            "logits copy");
    if (gpu_sync(g, NULL) != 0) return 0;
    const float *z = g->hlogits;
    const uint8_t *y = g->hy[g->cur]; /* the host slot is not reused before the next forward */
    for (int i = 0; i < batch; i++) {
        int best = 0;
        for (int j = 1; j < k; j++)
            if (z[i * k + j] > z[i * k + best]) best = j;
        correct += best == y[i];
    }
    return correct;
}

void gpu_backward(model *m, int batch, float scale, model_ready_fn ready, void *ctx)
{
    gpu_ctx *g = m->dev;
    int last = m->nlayers - 1;
    kern_ok(g,
            kern_softmax_xent_backward(g->dout[last], g->probs, g->dy[g->cur], batch,
                                       m->cfg.classes, scale, g->compute),
            "softmax backward");
    for (int i = last; i >= 0; i--) {
        model_layer *l = &m->layers[i];
        const float *in = input_of(g, i);
        float *din = i > 0 ? g->dout[i - 1] : NULL;
        switch (l->kind) {
        case LAYER_LINEAR:
            gpu_linear_backward(g, din, m->params[l->wparam].grad, m->params[l->bparam].grad,
                                g->dout[i], in, m->params[l->wparam].data, batch, l->in_size,
                                l->out_size);
            break;
        case LAYER_RELU:
            if (din)
                kern_ok(g,
                        kern_relu_backward(din, g->dout[i], g->out[i], (size_t)batch * l->out_size,
                                           g->compute),
                        "relu backward");
            break;
        case LAYER_CONV:
            gpu_conv_backward(g, din, m->params[l->wparam].grad, m->params[l->bparam].grad,
                              g->dout[i], in, m->params[l->wparam].data, batch, &l->conv, g->col,
                              g->dcol, g->dwtmp);
            break;
        case LAYER_MAXPOOL:
            if (din)
                kern_ok(g,
                        kern_maxpool_backward(din, g->dout[i], g->argmax[i], batch, l->c, l->h,
                                              l->w, g->compute),
                        "max-pool backward");
            break;
        }
        if (l->wparam >= 0 && ready) {
            ready(ctx, l->bparam);
            ready(ctx, l->wparam);
        }
    }
    cuda_ok(g, cudaEventRecord(g->consumed[g->cur], g->compute), "event");
}

/* ---- optimizer ---- */

void gpu_optim_step(model *m, optim *o, float lr, float bc1, float bc2)
{
    gpu_ctx *g = m->dev;
    if (gpu_state_ready(g, o) != 0) return;
    for (int i = 0; i < m->nparams; i++) {
        model_param *p = &m->params[i];
        float *s0 = g->state + p->offset;
        int e;
        if (o->cfg.kind == OPTIM_SGD)
            e = kern_sgd_update(p->data, p->grad, s0, p->numel, lr, o->cfg.momentum,
                                o->cfg.weight_decay, g->compute);
        else
            e = kern_adamw_update(p->data, p->grad, s0, s0 + o->n, p->numel, lr, o->cfg.beta1,
                                  o->cfg.beta2, o->cfg.eps, o->cfg.weight_decay, bc1, bc2,
                                  g->compute);
        kern_ok(g, e, "optimizer update");
    }
}
