/* kernels.h: the trainer's CUDA kernels, callable from C.
 *
 * One launcher per kernel, each the device twin of a loop in layers.c or
 * optim.c (that C code is its reference, and tests/gpu compares the two).
 * Pointers are device memory; every launcher enqueues on the given stream
 * and returns at once with 0 or the cudaError_t of the launch, so a C file
 * needs no CUDA header to call them. Matrix products are not here: they go
 * through cuBLAS in gpu_model_cuda.c.
 */
#ifndef DUCTILE_KERNELS_H
#define DUCTILE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "ductile/layers.h" /* conv_shape; a C header */

/* cudaStream_t without the CUDA headers. */
typedef struct CUstream_st *kern_stream;

int kern_fill(float *x, size_t n, float v, kern_stream s);
int kern_scale(float *x, size_t n, float a, kern_stream s);

/* out[(i*channels + c)*inner + p] = b[c]: the bias before a GEMM with beta 1
 * (linear: inner 1; conv: inner = OH*OW). */
int kern_bias_fill(float *out, const float *b, int outer, int channels, int inner, kern_stream s);
/* db[c] += sum over i, p of dout[(i*channels + c)*inner + p]. */
int kern_bias_grad(float *db, const float *dout, int outer, int channels, int inner, kern_stream s);

int kern_relu_forward(float *out, const float *in, size_t n, kern_stream s);
int kern_relu_backward(float *din, const float *dout, const float *out, size_t n, kern_stream s);

/* im2col of a whole batch: sample i's columns at col + i*conv_col_size(sh),
 * laid out as layers.c's im2col. col2im is its adjoint and OVERWRITES in. */
int kern_im2col(float *col, const float *in, int batch, const conv_shape *sh, kern_stream s);
int kern_col2im(float *in, const float *col, int batch, const conv_shape *sh, kern_stream s);
/* dst[j] += sum over b of src[b*n + j] (per-sample weight gradients summed). */
int kern_sum_batches(float *dst, const float *src, int batch, size_t n, kern_stream s);

int kern_maxpool_forward(float *out, int32_t *argmax, const float *in, int batch, int c, int h,
                         int w, kern_stream s);
int kern_maxpool_backward(float *din, const float *dout, const int32_t *argmax, int batch, int c,
                          int h, int w, kern_stream s);

/* probs as softmax_xent_forward; loss[i] = sample i's loss (the caller sums). */
int kern_softmax_xent_forward(float *probs, double *loss, const float *logits,
                              const uint8_t *labels, int batch, int classes, kern_stream s);
int kern_softmax_xent_backward(float *dlogits, const float *probs, const uint8_t *labels, int batch,
                               int classes, float scale, kern_stream s);

int kern_sgd_update(float *p, const float *g, float *buf, size_t n, float lr, float momentum,
                    float wd, kern_stream s);
int kern_adamw_update(float *p, const float *g, float *m, float *v, size_t n, float lr, float beta1,
                      float beta2, float eps, float wd, float bc1, float bc2, kern_stream s);

#ifdef __cplusplus
}
#endif

#endif
