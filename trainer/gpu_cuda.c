/* gpu_cuda.c: the model, optimizer and reducer buffers on a CUDA device.
 *
 * A mirror of model.c: gpu_attach() allocates in device memory what
 * model_create() allocated on the host and re-points the model's parameter
 * and gradient views there; forward and backward walk the same layer list
 * with cuBLAS for the products and kernels.cu for the rest. Row-major
 * gemm() maps onto column-major cuBLAS by computing C^T = op(B)^T op(A)^T:
 * swap the operands and m with n, keep every leading dimension, and the
 * bytes come out as the row-major C. Convolution runs im2col over the whole
 * batch and one strided-batched GEMM where the CPU loops over samples.
 *
 * Batches go through two pinned host slots: the trainer gathers into m->x,
 * forward copies that slot on the copy stream and hands the other slot to
 * the host, waiting only until that slot's previous copy has finished; the
 * copy of a slot waits for the compute stream to be done reading it.
 *
 * Gradient buckets leave without a host round trip: the reducer records a
 * mark (an event) after the kernels that wrote a bucket, and the NCCL
 * stream waits for it (comm_allreduce_sum_f32_after). Host buffers (the
 * state sync, evaluation counts) go to the communicator as they are; the
 * NCCL backend stages them itself.
 *
 * One host sync a step: ddp_finish() reads the stop flag into pinned
 * memory and waits for the compute stream once; the step's losses were
 * queued into pinned memory beside it (gpu_loss_queue) and are summed
 * after that sync, and the staging slots are known free from it.
 *
 * Knowingly simple: one GEMM per linear layer is tiny at this model size,
 * so a small-batch MLP is launch-bound on a big GPU. CUDA graphs of the
 * whole step would remove the launch cost.
 */
#include "gpu.h"
#include "ductile/clock.h"
#include "ductile/elastic.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct gpu_ctx {
    int device;
    cudaStream_t compute, copy;
    cublasHandle_t blas;
    int failed; /* sticky: the first error, kept in err */
    char err[GPU_MSG_MAX];

    /* the model mirror (gpu_attach) */
    model *m;
    float *weights, *grads; /* device: the flat parameters, the model's own gradients */
    float *host_grads;      /* the model's host own_grads, restored on detach */
    float *host_x;          /* the model's host x and y, restored on detach */
    uint8_t *host_y;
    float *out[MODEL_MAX_LAYERS], *dout[MODEL_MAX_LAYERS];
    int32_t *argmax[MODEL_MAX_LAYERS];
    float *col, *dcol, *dwtmp;
    float *probs;
    double *loss, *hloss; /* per sample: device; pinned, GPU_LOSS_SLOTS + 1 batches */
    int loss_n;           /* micro-batches whose losses were queued (gpu_loss_queue) */
    int loss_count[GPU_LOSS_SLOTS];
    float *hword;         /* pinned: one float read back (gpu_read) */
    int slot_free[2];     /* the slot's last copy is known done (a host sync saw it) */
    float *hlogits;       /* pinned: logits read back for model_correct */
    float *dx[2], *hx[2]; /* two staging slots: device and pinned host */
    uint8_t *dy[2], *hy[2];
    cudaEvent_t copied[2], consumed[2];
    int slot; /* the slot m->x points at */
    int cur;  /* the slot of the last forward */
    float *state;
    size_t state_floats;
    float *scratch_w, *scratch_s; /* a receiver's state sync lands here (gpu_state_parts) */
    size_t scratch_s_floats;
    cudaEvent_t marks[MODEL_MAX_PARAMS];
};

/* ---- errors ---- */

static void fail(gpu_ctx *g, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void fail(gpu_ctx *g, const char *fmt, ...)
{
    if (g->failed) return;
    g->failed = 1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g->err, sizeof(g->err), fmt, ap);
    va_end(ap);
}

static int cuda_ok(gpu_ctx *g, cudaError_t e, const char *what)
{
    if (e == cudaSuccess) return 1;
    fail(g, "cuda: %s: %s", what, cudaGetErrorString(e));
    return 0;
}

static int kern_ok(gpu_ctx *g, int e, const char *what)
{
    return cuda_ok(g, (cudaError_t)e, what);
}

static int blas_ok(gpu_ctx *g, cublasStatus_t s, const char *what)
{
    if (s == CUBLAS_STATUS_SUCCESS) return 1;
    fail(g, "cublas: %s: %s", what, cublasGetStatusString(s));
    return 0;
}

/* ---- context ---- */

int gpu_device_count(char *why)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        if (why)
            snprintf(why, GPU_MSG_MAX, "no CUDA device (cudaGetDeviceCount: %s)",
                     cudaGetErrorString(e));
        cudaGetLastError(); /* not sticky: clear it */
        return 0;
    }
    if (n == 0 && why) snprintf(why, GPU_MSG_MAX, "no CUDA device (cudaGetDeviceCount: 0 devices)");
    return n;
}

gpu_ctx *gpu_ctx_create(int device, char *msg)
{
    gpu_ctx *g = calloc(1, sizeof(*g));
    if (!g) {
        snprintf(msg, GPU_MSG_MAX, "out of memory");
        return NULL;
    }
    g->device = device;
    if (!cuda_ok(g, cudaSetDevice(device), "cudaSetDevice") ||
        !cuda_ok(g, cudaStreamCreateWithFlags(&g->compute, cudaStreamNonBlocking), "stream") ||
        !cuda_ok(g, cudaStreamCreateWithFlags(&g->copy, cudaStreamNonBlocking), "stream"))
        goto err;
    if (!blas_ok(g, cublasCreate(&g->blas), "cublasCreate")) {
        g->blas = NULL;
        goto err;
    }
    /* Plain FP32, no TF32 tensor-op shortcut, so results match the CPU's SGEMM
     * within float rounding. */
    if (!blas_ok(g, cublasSetStream(g->blas, g->compute), "cublasSetStream") ||
        !blas_ok(g, cublasSetMathMode(g->blas, CUBLAS_DEFAULT_MATH), "cublasSetMathMode"))
        goto err;
    return g;
err:
    snprintf(msg, GPU_MSG_MAX, "device %d: %.200s", device, g->err);
    gpu_ctx_free(g);
    return NULL;
}

/* Teardown: a failure is kept as the context's error (gpu_status), though
 * whoever tears down has nothing left to do about it. */
static void dfree(gpu_ctx *g, void *p)
{
    if (p) cuda_ok(g, cudaFree(p), "cudaFree");
}

static void hfree(gpu_ctx *g, void *p)
{
    if (p) cuda_ok(g, cudaFreeHost(p), "cudaFreeHost");
}

static void efree(gpu_ctx *g, cudaEvent_t e)
{
    if (e) cuda_ok(g, cudaEventDestroy(e), "cudaEventDestroy");
}

static void free_mirror(gpu_ctx *g)
{
    if (g->compute)
        cuda_ok(g, cudaStreamSynchronize(g->compute), "cudaStreamSynchronize (compute)");
    if (g->copy) cuda_ok(g, cudaStreamSynchronize(g->copy), "cudaStreamSynchronize (copy)");
    for (int i = 0; i < MODEL_MAX_LAYERS; i++) {
        dfree(g, g->out[i]);
        dfree(g, g->dout[i]);
        dfree(g, g->argmax[i]);
    }
    void *dev[] = {g->weights, g->grads, g->col, g->dcol, g->dwtmp, g->probs, g->loss, g->state};
    for (size_t i = 0; i < sizeof(dev) / sizeof(dev[0]); i++)
        dfree(g, dev[i]);
    dfree(g, g->scratch_w);
    dfree(g, g->scratch_s);
    hfree(g, g->hloss);
    hfree(g, g->hword);
    hfree(g, g->hlogits);
    for (int s = 0; s < 2; s++) {
        dfree(g, g->dx[s]);
        dfree(g, g->dy[s]);
        hfree(g, g->hx[s]);
        hfree(g, g->hy[s]);
        efree(g, g->copied[s]);
        efree(g, g->consumed[s]);
    }
    for (int i = 0; i < MODEL_MAX_PARAMS; i++)
        efree(g, g->marks[i]);
}

/* Teardown: errors are kept as the context's (see free_mirror). */
void gpu_ctx_free(gpu_ctx *g)
{
    if (!g) return;
    cuda_ok(g, cudaSetDevice(g->device), "cudaSetDevice");
    free_mirror(g);
    if (g->blas) blas_ok(g, cublasDestroy(g->blas), "cublasDestroy");
    if (g->copy) cuda_ok(g, cudaStreamDestroy(g->copy), "cudaStreamDestroy (copy)");
    if (g->compute) cuda_ok(g, cudaStreamDestroy(g->compute), "cudaStreamDestroy (compute)");
    free(g);
}

gpu_ctx *gpu_of(model *m)
{
    return m->dev;
}

kern_stream gpu_stream(gpu_ctx *g)
{
    return g->compute;
}

int gpu_sync(gpu_ctx *g, char *msg)
{
    /* Every batch copy is followed by a compute wait on it: once compute is
     * done, so are they, and both staging slots are the host's again. */
    if (cuda_ok(g, cudaStreamSynchronize(g->compute), "compute stream"))
        g->slot_free[0] = g->slot_free[1] = 1;
    if (g->failed && msg) snprintf(msg, GPU_MSG_MAX, "%s", g->err);
    return g->failed ? -1 : 0;
}

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

/* ---- attach / detach ---- */

/* Zeroed on the compute stream and waited for: the non-blocking streams do
 * not order themselves after work on the legacy default stream. */
static void *dalloc(gpu_ctx *g, size_t bytes)
{
    void *p = NULL;
    if (!cuda_ok(g, cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc")) return NULL;
    if (!cuda_ok(g, cudaMemsetAsync(p, 0, bytes ? bytes : 1, g->compute), "cudaMemset") ||
        !cuda_ok(g, cudaStreamSynchronize(g->compute), "cudaMemset")) {
        dfree(g, p);
        return NULL;
    }
    return p;
}

static void *halloc(gpu_ctx *g, size_t bytes)
{
    void *p = NULL;
    if (!cuda_ok(g, cudaMallocHost(&p, bytes ? bytes : 1), "cudaMallocHost")) return NULL;
    return p;
}

static int alloc_mirror(gpu_ctx *g, model *m)
{
    size_t in = (size_t)m->cfg.in_c * m->cfg.in_h * m->cfg.in_w, col = 0, dw = 0;
    size_t mb = (size_t)m->max_batch;
    for (int i = 0; i < m->nlayers; i++) {
        model_layer *l = &m->layers[i];
        if (!(g->out[i] = dalloc(g, sizeof(float) * l->out_size * mb)) ||
            !(g->dout[i] = dalloc(g, sizeof(float) * l->out_size * mb)))
            return -1;
        if (l->kind == LAYER_MAXPOOL &&
            !(g->argmax[i] = dalloc(g, sizeof(int32_t) * l->out_size * mb)))
            return -1;
        if (l->kind == LAYER_CONV) {
            size_t c = conv_col_size(&l->conv), w = m->params[l->wparam].numel;
            col = c > col ? c : col;
            dw = w > dw ? w : dw;
        }
    }
    if (!(g->weights = dalloc(g, sizeof(float) * m->nfloats)) ||
        !(g->grads = dalloc(g, sizeof(float) * m->nfloats)) ||
        !(g->probs = dalloc(g, sizeof(float) * m->cfg.classes * mb)) ||
        !(g->loss = dalloc(g, sizeof(double) * mb)) ||
        !(g->hloss = halloc(g, sizeof(double) * mb * (GPU_LOSS_SLOTS + 1))) ||
        !(g->hword = halloc(g, sizeof(float))) ||
        !(g->hlogits = halloc(g, sizeof(float) * m->cfg.classes * mb)))
        return -1;
    if (col && (!(g->col = dalloc(g, sizeof(float) * col * mb)) ||
                !(g->dcol = dalloc(g, sizeof(float) * col * mb)) ||
                !(g->dwtmp = dalloc(g, sizeof(float) * dw * mb))))
        return -1;
    for (int s = 0; s < 2; s++) {
        if (!(g->dx[s] = dalloc(g, sizeof(float) * in * mb)) || !(g->dy[s] = dalloc(g, mb)) ||
            !(g->hx[s] = halloc(g, sizeof(float) * in * mb)) || !(g->hy[s] = halloc(g, mb)) ||
            !cuda_ok(g, cudaEventCreateWithFlags(&g->copied[s], cudaEventDisableTiming), "event") ||
            !cuda_ok(g, cudaEventCreateWithFlags(&g->consumed[s], cudaEventDisableTiming), "event"))
            return -1;
    }
    for (int i = 0; i < MODEL_MAX_PARAMS; i++)
        if (!cuda_ok(g, cudaEventCreateWithFlags(&g->marks[i], cudaEventDisableTiming), "event"))
            return -1;
    return 0;
}

int gpu_attach(model *m, int device, char *msg)
{
    if (m->dev) {
        snprintf(msg, GPU_MSG_MAX, "model already on a device");
        return -1;
    }
    gpu_ctx *g = gpu_ctx_create(device, msg);
    if (!g) return -1;
    if (alloc_mirror(g, m) != 0 ||
        !cuda_ok(g,
                 cudaMemcpyAsync(g->weights, m->weights, sizeof(float) * m->nfloats,
                                 cudaMemcpyHostToDevice, g->compute),
                 "uploading parameters") ||
        gpu_sync(g, NULL) != 0) {
        snprintf(msg, GPU_MSG_MAX, "device %d: %.200s", device, g->err);
        gpu_ctx_free(g);
        return -1;
    }
    g->m = m;
    g->host_x = m->x;
    g->host_y = m->y;
    g->host_grads = m->own_grads;
    m->x = g->hx[0];
    m->y = g->hy[0];
    m->own_grads = g->grads;
    for (int i = 0; i < m->nparams; i++) {
        m->params[i].data = g->weights + m->params[i].offset;
        m->params[i].grad = g->grads + m->params[i].offset;
    }
    m->dev = g;
    return 0;
}

void gpu_detach(model *m)
{
    gpu_ctx *g = m->dev;
    if (!g) return;
    m->x = g->host_x;
    m->y = g->host_y;
    m->own_grads = g->host_grads;
    for (int i = 0; i < m->nparams; i++) {
        m->params[i].data = m->weights + m->params[i].offset;
        m->params[i].grad = m->own_grads + m->params[i].offset;
    }
    m->dev = NULL;
    gpu_ctx_free(g);
}

static int state_ready(gpu_ctx *g, const optim *o)
{
    size_t n = o->n * (size_t)o->nstate;
    if (g->state && g->state_floats == n) return 0;
    dfree(g, g->state);
    g->state_floats = 0;
    if (!(g->state = dalloc(g, sizeof(float) * n))) return -1;
    g->state_floats = n;
    return 0;
}

int gpu_upload(model *m, const optim *o, char *msg)
{
    gpu_ctx *g = m->dev;
    cuda_ok(g,
            cudaMemcpyAsync(g->weights, m->weights, sizeof(float) * m->nfloats,
                            cudaMemcpyHostToDevice, g->compute),
            "uploading parameters");
    if (o && state_ready(g, o) == 0)
        cuda_ok(g,
                cudaMemcpyAsync(g->state, o->state, sizeof(float) * g->state_floats,
                                cudaMemcpyHostToDevice, g->compute),
                "uploading optimizer state");
    return gpu_sync(g, msg);
}

int gpu_download(model *m, optim *o, char *msg)
{
    gpu_ctx *g = m->dev;
    cuda_ok(g,
            cudaMemcpyAsync(m->weights, g->weights, sizeof(float) * m->nfloats,
                            cudaMemcpyDeviceToHost, g->compute),
            "downloading parameters");
    if (o && state_ready(g, o) == 0)
        cuda_ok(g,
                cudaMemcpyAsync(o->state, g->state, sizeof(float) * g->state_floats,
                                cudaMemcpyDeviceToHost, g->compute),
                "downloading optimizer state");
    return gpu_sync(g, msg);
}

int gpu_state_parts(model *m, optim *o, elastic_part *w, elastic_part *s, char *msg)
{
    gpu_ctx *g = m->dev;
    size_t n = o->n * (size_t)o->nstate;
    if (state_ready(g, o) != 0 ||
        (!g->scratch_w && !(g->scratch_w = dalloc(g, sizeof(float) * m->nfloats)))) {
        snprintf(msg, GPU_MSG_MAX, "%s", g->err);
        return -1;
    }
    if (g->scratch_s_floats != n) {
        dfree(g, g->scratch_s);
        g->scratch_s = NULL;
        g->scratch_s_floats = 0;
        if (n && !(g->scratch_s = dalloc(g, sizeof(float) * n))) {
            snprintf(msg, GPU_MSG_MAX, "%s", g->err);
            return -1;
        }
        g->scratch_s_floats = n;
    }
    if (gpu_sync(g, msg) != 0) return -1;
    *w = (elastic_part){g->weights, sizeof(float) * m->nfloats, g->scratch_w};
    *s = (elastic_part){g->state, sizeof(float) * n, g->scratch_s};
    return 0;
}

void gpu_state_adopt(model *m)
{
    gpu_ctx *g = m->dev;
    float *w = g->weights, *s = g->state;
    g->weights = g->scratch_w;
    g->scratch_w = w;
    g->state = g->scratch_s;
    g->scratch_s = s;
    for (int i = 0; i < m->nparams; i++)
        m->params[i].data = g->weights + m->params[i].offset;
}

int gpu_status(model *m, char *msg)
{
    return gpu_sync(m->dev, msg);
}

/* CUDA gives no "is this sticky" call; a sticky error is the one every
 * later call answers. So: clear the thread's last error (a non-sticky one
 * goes with it) and ask the compute stream, which a healthy context
 * answers with success or "not ready". */
int gpu_poisoned(model *m, char *msg)
{
    gpu_ctx *g = m->dev;
    if (!g) return 0;
    (void)cudaGetLastError();
    cudaError_t e = cudaStreamQuery(g->compute);
    if (e == cudaSuccess || e == cudaErrorNotReady) {
        g->failed = 0;
        g->err[0] = '\0';
        return 0;
    }
    snprintf(msg, GPU_MSG_MAX, "the CUDA context is poisoned by a sticky error (%s: %s)",
             cudaGetErrorName(e), cudaGetErrorString(e));
    return 1;
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
        fail(g, "gpu_loss_queue: more than %d micro-batches in a step", GPU_LOSS_SLOTS);
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
    if (state_ready(g, o) != 0) return;
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

/* ---- the reducer's buffers ---- */

float *gpu_grad_alloc(model *m, size_t n)
{
    return dalloc(m->dev, sizeof(float) * n);
}

void gpu_grad_free(model *m, float *p)
{
    gpu_ctx *g = m->dev;
    if (!p) return;
    cuda_ok(g, cudaStreamSynchronize(g->compute), "cudaStreamSynchronize (freeing gradients)");
    cuda_ok(g, cudaFree(p), "cudaFree (gradients)");
}

void gpu_fill(model *m, float *p, size_t n, float v)
{
    gpu_ctx *g = m->dev;
    kern_ok(g, kern_fill(p, n, v, g->compute), "fill");
}

void gpu_scale(model *m, float *p, size_t n, float a)
{
    gpu_ctx *g = m->dev;
    kern_ok(g, kern_scale(p, n, a, g->compute), "scale");
}

float gpu_read(model *m, const float *p)
{
    gpu_ctx *g = m->dev;
    cuda_ok(g, cudaMemcpyAsync(g->hword, p, sizeof(float), cudaMemcpyDeviceToHost, g->compute),
            "read");
    if (gpu_sync(g, NULL) != 0) return NAN;
    return *g->hword;
}

void gpu_mark(model *m, int slot)
{
    gpu_ctx *g = m->dev;
    cuda_ok(g, cudaEventRecord(g->marks[slot], g->compute), "bucket event");
}

void *gpu_mark_event(model *m, int slot)
{
    gpu_ctx *g = m->dev;
    return g->marks[slot];
}
