/* layers.h: the math of each layer, forward and backward side by side.
 *
 * Plain C on flat float arrays in row-major order, with every matrix product
 * going through one gemm() wrapper (OpenBLAS today; a device build swaps the
 * wrapper and the element-wise loops for kernels with the same signatures).
 * Backward functions ADD into parameter gradients (so micro-batches can
 * accumulate) and OVERWRITE input gradients; a NULL input gradient means
 * "not needed" (the first layer).
 */
#ifndef DUCTILE_LAYERS_H
#define DUCTILE_LAYERS_H

#include <stddef.h>
#include <stdint.h>

/* C[M,N] = alpha * op(A)[M,K] * op(B)[K,N] + beta * C, row-major. */
void gemm(int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
          const float *b, int ldb, float beta, float *c, int ldc);

/* Bias of a [outer, channels, inner] output (linear: inner 1; convolution:
 * outer 1 per sample, inner OH*OW): fill sets out[(i*channels + c)*inner + p]
 * = b[c]; grad adds the sum over i and p of dout at the same index to db[c]. */
void layer_bias_fill(float *out, const float *b, int outer, int channels, int inner);
void layer_bias_grad(float *db, const float *dout, int outer, int channels, int inner);

/* Linear: out[B,O] = in[B,I] * W[O,I]^T + b[O] (PyTorch's weight layout). */
void linear_forward(float *out, const float *in, const float *w, const float *b, int batch,
                    int in_dim, int out_dim);
void linear_backward(float *din, float *dw, float *db, const float *dout, const float *in,
                     const float *w, int batch, int in_dim, int out_dim);

/* ReLU, in place-safe; backward uses the forward's output. */
void relu_forward(float *out, const float *in, size_t n);
void relu_backward(float *din, const float *dout, const float *out, size_t n);

/* 2-D convolution, stride 1, square kernel k, zero padding pad, through
 * im2col + GEMM per sample. in[B,C,H,W], w[OC, C*k*k], b[OC],
 * out[B,OC,OH,OW] with OH = H + 2*pad - k + 1. col is scratch of
 * conv_col_size() floats (and dcol the same in backward). */
typedef struct conv_shape {
    int c, h, w; /* input */
    int oc, k, pad;
    int oh, ow; /* output, filled by conv_shape_init */
} conv_shape;

void conv_shape_init(conv_shape *s, int c, int h, int w, int oc, int k, int pad);
size_t conv_col_size(const conv_shape *s);
/* One sample: col[(c*k + ki)*k + kj][oy*OW + ox] = in[c][oy+ki-pad][ox+kj-pad]
 * (0 in the padding); col2im is its adjoint and OVERWRITES in[C,H,W]. */
void conv_im2col(float *col, const float *in, const conv_shape *s);
void conv_col2im(float *in, const float *col, const conv_shape *s);
void conv_forward(float *out, const float *in, const float *w, const float *b, int batch,
                  const conv_shape *s, float *col);
void conv_backward(float *din, float *dw, float *db, const float *dout, const float *in,
                   const float *w, int batch, const conv_shape *s, float *col, float *dcol);

/* 2x2 max-pool, stride 2, on [B,C,H,W] (H and W even). argmax[B*C*H/2*W/2]
 * remembers which input won, for backward. */
void maxpool_forward(float *out, int32_t *argmax, const float *in, int batch, int c, int h, int w);
void maxpool_backward(float *din, const float *dout, const int32_t *argmax, int batch, int c, int h,
                      int w);

/* Softmax cross-entropy over logits[B,K]: fills probs, returns the SUM of the
 * per-sample losses. Backward: dlogits = (probs - onehot) * scale, where the
 * caller's scale makes the sum over every rank a mean over the global batch. */
double softmax_xent_forward(float *probs, const float *logits, const uint8_t *labels, int batch,
                            int classes);
void softmax_xent_backward(float *dlogits, const float *probs, const uint8_t *labels, int batch,
                           int classes, float scale);

#endif
