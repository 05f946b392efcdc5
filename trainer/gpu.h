/* gpu.h: the trainer on a CUDA device, behind the CPU code's own calls.
 *
 * The idea: the model, optimizer and reducer keep their structs and their
 * functions; gpu_attach() moves a model's parameters, gradients,
 * activations and scratch into device memory and sets model->dev, and from
 * then on model_forward/backward/loss/correct, optim_step and the reducer's
 * buffer operations dispatch here (one `if (m->dev)` at the top of each).
 * params[i].data and .grad become device pointers; m->weights stays a host
 * copy that gpu_download()/gpu_upload() keep in step for checkpoints, dumps
 * and broadcasts, so every file format stays the CPU one. The math is the
 * CPU math: cuBLAS for every gemm() call with the same row-major operands,
 * kernels.cu for every loop (layers.c and optim.c are the references).
 *
 * Streams: one compute stream runs every kernel and GEMM in issue order; a
 * copy stream moves each batch from pinned host memory (m->x and m->y point
 * there while attached, two slots used in turn) and the compute stream waits
 * for it through an event. The reducer records one event per bucket when its
 * last gradient's kernels are queued; the bucket's NCCL all-reduce waits for
 * that event on the NCCL stream (cudaStreamWaitEvent), not on the host.
 *
 * Errors inside forward/backward (whose signatures return no status) are
 * sticky: the first one is kept and gpu_status() reports it once per step.
 * A build without CUDA gets inline stubs: m->dev is then always NULL.
 */
#ifndef DUCTILE_GPU_H
#define DUCTILE_GPU_H

#include <stddef.h>
#include <stdio.h>

#include "ductile/comm.h"
#include "kernels.h"
#include "ductile/model.h"
#include "ductile/optim.h"

typedef struct gpu_ctx gpu_ctx;
struct elastic_part; /* ductile/elastic.h */

/* The size of the msg (or why) buffer gpu_* functions fill with one line. */
#define GPU_MSG_MAX 256

#if DUCTILE_HAVE_CUDA

/* CUDA devices present; 0 with the reason in why (GPU_MSG_MAX bytes) when none. */
int gpu_device_count(char *why);

/* Moves m onto device `device`; 0, or -1 with one line in msg (GPU_MSG_MAX bytes). */
int gpu_attach(model *m, int device, char *msg);
/* Back to host pointers (device contents are not copied back) and frees. */
void gpu_detach(model *m);
/* Host parameters (and optimizer state, if o) to the device and back. */
int gpu_upload(model *m, const optim *o, char *msg);
int gpu_download(model *m, optim *o, char *msg);
/* Waits for queued work; 0, or -1 and the first error since attach. */
int gpu_status(model *m, char *msg);
/* After a failure: 1 when this process's CUDA context holds a sticky error
 * (an illegal address, a launch failure, ECC, an Xid: every later call
 * answers it, so only a fresh process can go on), with one line in msg;
 * else 0, and an error that was not sticky is forgotten, so the next
 * round starts clean in place. */
int gpu_poisoned(model *m, char *msg);

/* The state sync on the device: the parameters and the optimizer state as
 * elastic parts in device memory, each with a device scratch of its size
 * that a receiving rank's broadcast goes into (device to device, no host
 * copy); after waiting once for the compute stream, so that NCCL's stream
 * may read and write them. 0, or -1 with msg. */
int gpu_state_parts(model *m, optim *o, struct elastic_part *weights, struct elastic_part *state,
                    char *msg);
/* A receiver, after a state sync that succeeded: the scratch buffers are
 * the parameters and the optimizer state from now on (the old ones become
 * the scratch). */
void gpu_state_adopt(model *m);

/* The model.h and optim.h operations on the device. */
const float *gpu_forward(model *m, int batch);
double gpu_loss(model *m, int batch); /* waits for the compute stream */
/* The loss of one micro-batch without a host sync: queued into pinned
 * memory, summed by gpu_loss_take() after the step's sync (ddp_finish);
 * at most GPU_LOSS_SLOTS micro-batches a step. */
#define GPU_LOSS_SLOTS 16
void gpu_loss_queue(model *m, int batch);
/* The summed losses of the micro-batches queued since the last take, in
 * order, into loss (at most max); their count. Only after a host sync. */
int gpu_loss_take(model *m, double *loss, int max);
/* The first error since attach (or the last gpu_poisoned), without
 * waiting for the device: 0, or -1 with it in msg. */
int gpu_error(model *m, char *msg);
int gpu_correct(const model *m, int batch);
void gpu_backward(model *m, int batch, float scale, model_ready_fn ready, void *ctx);
void gpu_optim_step(model *m, optim *o, float lr, float bc1, float bc2);

/* The reducer's buffers: zeroed device floats, queued on the compute stream. */
float *gpu_grad_alloc(model *m, size_t n);
void gpu_grad_free(model *m, float *p);
void gpu_fill(model *m, float *p, size_t n, float v);
void gpu_scale(model *m, float *p, size_t n, float a);
float gpu_read(model *m, const float *p); /* waits for the compute stream */
/* Event `slot` (< MODEL_MAX_PARAMS) after the work queued so far, and that
 * event (a cudaEvent_t) for comm_allreduce_sum_f32_after. */
void gpu_mark(model *m, int slot);
void *gpu_mark_event(model *m, int slot);

/* ---- the layers on the device (tests call these against layers.h) ---- */

gpu_ctx *gpu_ctx_create(int device, char *msg);
void gpu_ctx_free(gpu_ctx *g);
gpu_ctx *gpu_of(model *m);
kern_stream gpu_stream(gpu_ctx *g);
/* Waits for the compute stream; 0, or -1 and the first error. */
int gpu_sync(gpu_ctx *g, char *msg);

/* layers.h's gemm(), row-major, on the compute stream. */
void gpu_gemm(gpu_ctx *g, int trans_a, int trans_b, int m, int n, int k, float alpha,
              const float *a, int lda, const float *b, int ldb, float beta, float *c, int ldc);
void gpu_linear_forward(gpu_ctx *g, float *out, const float *in, const float *w, const float *b,
                        int batch, int in_dim, int out_dim);
void gpu_linear_backward(gpu_ctx *g, float *din, float *dw, float *db, const float *dout,
                         const float *in, const float *w, int batch, int in_dim, int out_dim);
/* col and dcol: batch * conv_col_size(s) floats; dwtmp: batch * oc*c*k*k. */
void gpu_conv_forward(gpu_ctx *g, float *out, const float *in, const float *w, const float *b,
                      int batch, const conv_shape *s, float *col);
void gpu_conv_backward(gpu_ctx *g, float *din, float *dw, float *db, const float *dout,
                       const float *in, const float *w, int batch, const conv_shape *s, float *col,
                       float *dcol, float *dwtmp);

#else /* built without CUDA: nothing is ever attached */

static inline int gpu_device_count(char *why)
{
    if (why) snprintf(why, GPU_MSG_MAX, "ductile was built without CUDA");
    return 0;
}
static inline int gpu_attach(model *m, int device, char *msg)
{
    (void)m, (void)device;
    snprintf(msg, GPU_MSG_MAX, "ductile was built without CUDA");
    return -1;
}
static inline void gpu_detach(model *m)
{
    (void)m;
}
static inline int gpu_upload(model *m, const optim *o, char *msg)
{
    (void)m, (void)o, (void)msg;
    return -1;
}
static inline int gpu_download(model *m, optim *o, char *msg)
{
    (void)m, (void)o, (void)msg;
    return -1;
}
static inline int gpu_status(model *m, char *msg)
{
    (void)m, (void)msg;
    return 0;
}
static inline int gpu_poisoned(model *m, char *msg)
{
    (void)m, (void)msg;
    return 0;
}
static inline int gpu_state_parts(model *m, optim *o, struct elastic_part *w,
                                  struct elastic_part *s, char *msg)
{
    (void)m, (void)o, (void)w, (void)s, (void)msg;
    return -1;
}
static inline void gpu_state_adopt(model *m)
{
    (void)m;
}
#define GPU_LOSS_SLOTS 16
static inline void gpu_loss_queue(model *m, int batch)
{
    (void)m, (void)batch;
}
static inline int gpu_loss_take(model *m, double *loss, int max)
{
    (void)m, (void)loss, (void)max;
    return 0;
}
static inline int gpu_error(model *m, char *msg)
{
    (void)m, (void)msg;
    return 0;
}
static inline const float *gpu_forward(model *m, int batch)
{
    (void)m, (void)batch;
    return NULL;
}
static inline double gpu_loss(model *m, int batch)
{
    (void)m, (void)batch;
    return 0.0;
}
static inline int gpu_correct(const model *m, int batch)
{
    (void)m, (void)batch;
    return 0;
}
static inline void gpu_backward(model *m, int batch, float scale, model_ready_fn ready, void *ctx)
{
    (void)m, (void)batch, (void)scale, (void)ready, (void)ctx;
}
static inline void gpu_optim_step(model *m, optim *o, float lr, float bc1, float bc2)
{
    (void)m, (void)o, (void)lr, (void)bc1, (void)bc2;
}
static inline float *gpu_grad_alloc(model *m, size_t n)
{
    (void)m, (void)n;
    return NULL;
}
static inline void gpu_grad_free(model *m, float *p)
{
    (void)m, (void)p;
}
static inline void gpu_fill(model *m, float *p, size_t n, float v)
{
    (void)m, (void)p, (void)n, (void)v;
}
static inline void gpu_scale(model *m, float *p, size_t n, float a)
{
    (void)m, (void)p, (void)n, (void)a;
}
static inline float gpu_read(model *m, const float *p)
{
    (void)m, (void)p;
    return 0.0f;
}
static inline void gpu_mark(model *m, int slot)
{
    (void)m, (void)slot;
}
static inline void *gpu_mark_event(model *m, int slot)
{
    (void)m, (void)slot;
    return NULL;
}

#endif

#endif
