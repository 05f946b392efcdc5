/* gpu_cuda.c: the model, optimizer and reducer buffers on a CUDA device.
 *
 * A mirror of model.c: gpu_attach() allocates in device memory what
 * model_create() allocated on the host and re-points the model's parameter
 * and gradient views there; gpu_model_cuda.c runs the layers on them. This
 * file owns the device side: the context (streams, cuBLAS), that mirror and
 * its transfers, the state sync's buffers and the reducer's.
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
 * after that sync, and the staging slots are known free from it
 * (gpu_model_cuda.c).
 */
#include "gpu_cuda.h"
#include "ductile/elastic.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- errors ---- */

void gpu_fail(gpu_ctx *g, const char *fmt, ...)
{
    if (g->failed) return;
    g->failed = 1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g->err, sizeof(g->err), fmt, ap);
    va_end(ap);
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

int gpu_state_ready(gpu_ctx *g, const optim *o)
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
    if (o && gpu_state_ready(g, o) == 0)
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
    if (o && gpu_state_ready(g, o) == 0)
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
    if (gpu_state_ready(g, o) != 0 ||
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
