/* gpu_cuda.h: what the CUDA path's two files share (private to trainer/).
 *
 * gpu_cuda.c owns the device side: the context (streams, cuBLAS), the
 * model's mirror in device memory and its transfers, the state sync's
 * buffers and the reducer's. gpu_model_cuda.c runs the model there: the
 * layers, forward, loss, backward and the optimizer. Both record the first
 * error in the context (sticky, gpu.h) through the *_ok helpers below.
 */
#ifndef DUCTILE_GPU_CUDA_H
#define DUCTILE_GPU_CUDA_H

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <stddef.h>
#include <stdint.h>

#include "gpu.h"

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
/* Keeps the first error of g as its message (printf-style); later ones are dropped. */
void gpu_fail(gpu_ctx *g, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* 1 when a CUDA call succeeded; else 0, with the error kept. */
static inline int cuda_ok(gpu_ctx *g, cudaError_t e, const char *what)
{
    if (e == cudaSuccess) return 1;
    gpu_fail(g, "cuda: %s: %s", what, cudaGetErrorString(e));
    return 0;
}

/* As cuda_ok, for a kernel launcher's answer (kernels.h). */
static inline int kern_ok(gpu_ctx *g, int e, const char *what)
{
    return cuda_ok(g, (cudaError_t)e, what);
}

/* As cuda_ok, for cuBLAS. */
static inline int blas_ok(gpu_ctx *g, cublasStatus_t s, const char *what)
{
    if (s == CUBLAS_STATUS_SUCCESS) return 1;
    gpu_fail(g, "cublas: %s: %s", what, cublasGetStatusString(s));
    return 0;
}

/* The optimizer state on the device, sized for o: 0, or -1 with the error kept. */
int gpu_state_ready(gpu_ctx *g, const optim *o);

#endif
