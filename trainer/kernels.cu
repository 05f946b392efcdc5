/* kernels.cu: the device twins of the element-wise loops in layers.c and optim.c.
 *
 * Each kernel computes what its C reference computes, in the same order
 * per output element, one thread per output (or per sample, or one block
 * per channel for the bias-gradient reduction). The file is built with
 * -fmad=false, like the C code (no contraction of a*b+c into an FMA), so
 * element-wise kernels agree with the CPU to the last bit and the only
 * differences left come from summation order (cuBLAS, reductions) and from
 * expf/log. Gathers instead of scatters (col2im reads every column entry
 * that lands on a pixel) keep every kernel free of atomics and
 * deterministic.
 */
#include "kernels.h"

#include <cfloat>
#include <cuda_runtime.h>

#define THREADS 256

static unsigned blocks_for(size_t n)
{
    return (unsigned)((n + THREADS - 1) / THREADS);
}

static int launched(void)
{
    return (int)cudaGetLastError();
}

/* ---- fill, scale ---- */

__global__ void k_fill(float *x, size_t n, float v)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}

__global__ void k_scale(float *x, size_t n, float a)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= a;
}

extern "C" int kern_fill(float *x, size_t n, float v, kern_stream s)
{
    if (n == 0) return 0;
    k_fill<<<blocks_for(n), THREADS, 0, s>>>(x, n, v);
    return launched();
}

extern "C" int kern_scale(float *x, size_t n, float a, kern_stream s)
{
    if (n == 0) return 0;
    k_scale<<<blocks_for(n), THREADS, 0, s>>>(x, n, a);
    return launched();
}

/* ---- bias ---- */

__global__ void k_bias_fill(float *out, const float *b, size_t total, int channels, int inner)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) out[i] = b[(i / inner) % channels];
}

/* One block per channel; a fixed tree, so the result does not vary run to run. */
__global__ void k_bias_grad(float *db, const float *dout, int outer, int channels, int inner)
{
    __shared__ float part[THREADS];
    int c = blockIdx.x;
    size_t count = (size_t)outer * inner;
    float acc = 0.0f;
    for (size_t j = threadIdx.x; j < count; j += blockDim.x) {
        size_t i = j / inner, p = j % inner;
        acc += dout[(i * channels + c) * inner + p];
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if ((int)threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) db[c] += part[0];
}

extern "C" int kern_bias_fill(float *out, const float *b, int outer, int channels, int inner,
                              kern_stream s)
{
    size_t total = (size_t)outer * channels * inner;
    if (total == 0) return 0;
    k_bias_fill<<<blocks_for(total), THREADS, 0, s>>>(out, b, total, channels, inner);
    return launched();
}

extern "C" int kern_bias_grad(float *db, const float *dout, int outer, int channels, int inner,
                              kern_stream s)
{
    if (outer <= 0 || channels <= 0 || inner <= 0) return 0;
    k_bias_grad<<<channels, THREADS, 0, s>>>(db, dout, outer, channels, inner);
    return launched();
}

/* ---- relu ---- */

__global__ void k_relu_forward(float *out, const float *in, size_t n)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = in[i] > 0.0f ? in[i] : 0.0f;
}

__global__ void k_relu_backward(float *din, const float *dout, const float *out, size_t n)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) din[i] = out[i] > 0.0f ? dout[i] : 0.0f;
}

extern "C" int kern_relu_forward(float *out, const float *in, size_t n, kern_stream s)
{
    if (n == 0) return 0;
    k_relu_forward<<<blocks_for(n), THREADS, 0, s>>>(out, in, n);
    return launched();
}

extern "C" int kern_relu_backward(float *din, const float *dout, const float *out, size_t n,
                                  kern_stream s)
{
    if (n == 0) return 0;
    k_relu_backward<<<blocks_for(n), THREADS, 0, s>>>(din, dout, out, n);
    return launched();
}

/* ---- im2col / col2im ---- */

/* col[i][(c*k + ki)*k + kj][oy*OW + ox] = in[i][c][oy+ki-pad][ox+kj-pad], 0 outside. */
__global__ void k_im2col(float *col, const float *in, size_t total, conv_shape sh)
{
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= total) return;
    size_t ohw = (size_t)sh.oh * sh.ow, per = (size_t)sh.c * sh.k * sh.k * ohw;
    size_t n = idx / per, r = idx % per;
    int row = (int)(r / ohw), p = (int)(r % ohw);
    int c = row / (sh.k * sh.k), ki = (row / sh.k) % sh.k, kj = row % sh.k;
    int y = p / sh.ow + ki - sh.pad, x = p % sh.ow + kj - sh.pad;
    float v = 0.0f;
    if (y >= 0 && y < sh.h && x >= 0 && x < sh.w) v = in[((n * sh.c + c) * sh.h + y) * sh.w + x];
    col[idx] = v;
}

/* in[i][c][y][x] = sum of the column entries im2col took from it. */
__global__ void k_col2im(float *in, const float *col, size_t total, conv_shape sh)
{
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= total) return;
    size_t ohw = (size_t)sh.oh * sh.ow, per = (size_t)sh.c * sh.k * sh.k * ohw;
    int x = (int)(idx % sh.w), y = (int)((idx / sh.w) % sh.h),
        c = (int)((idx / sh.w / sh.h) % sh.c);
    size_t n = idx / ((size_t)sh.w * sh.h * sh.c);
    const float *src = col + n * per;
    float acc = 0.0f;
    for (int ki = 0; ki < sh.k; ki++) {
        int oy = y - ki + sh.pad;
        if (oy < 0 || oy >= sh.oh) continue;
        for (int kj = 0; kj < sh.k; kj++) {
            int ox = x - kj + sh.pad;
            if (ox < 0 || ox >= sh.ow) continue;
            acc += src[(size_t)((c * sh.k + ki) * sh.k + kj) * ohw + oy * sh.ow + ox];
        }
    }
    in[idx] = acc;
}

__global__ void k_sum_batches(float *dst, const float *src, int batch, size_t n)
{
    size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    float acc = dst[j];
    for (int b = 0; b < batch; b++)
        acc += src[(size_t)b * n + j];
    dst[j] = acc;
}

extern "C" int kern_im2col(float *col, const float *in, int batch, const conv_shape *sh,
                           kern_stream s)
{
    size_t total = (size_t)batch * conv_col_size(sh);
    if (total == 0) return 0;
    k_im2col<<<blocks_for(total), THREADS, 0, s>>>(col, in, total, *sh);
    return launched();
}

extern "C" int kern_col2im(float *in, const float *col, int batch, const conv_shape *sh,
                           kern_stream s)
{
    size_t total = (size_t)batch * sh->c * sh->h * sh->w;
    if (total == 0) return 0;
    k_col2im<<<blocks_for(total), THREADS, 0, s>>>(in, col, total, *sh);
    return launched();
}

extern "C" int kern_sum_batches(float *dst, const float *src, int batch, size_t n, kern_stream s)
{
    if (n == 0) return 0;
    k_sum_batches<<<blocks_for(n), THREADS, 0, s>>>(dst, src, batch, n);
    return launched();
}

/* ---- max-pool 2x2 ---- */

__global__ void k_maxpool_forward(float *out, int32_t *argmax, const float *in, size_t total, int h,
                                  int w)
{
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= total) return;
    int oh = h / 2, ow = w / 2;
    size_t plane = idx / ((size_t)oh * ow);
    int q = (int)(idx % ((size_t)oh * ow)), oy = q / ow, ox = q % ow;
    const float *x = in + plane * h * w;
    int best = (2 * oy) * w + 2 * ox;
    int cand[3] = {best + 1, best + w, best + w + 1};
    for (int i = 0; i < 3; i++)
        if (x[cand[i]] > x[best]) best = cand[i];
    out[idx] = x[best];
    argmax[idx] = best;
}

/* Windows do not overlap, so each input has at most one writer. */
__global__ void k_maxpool_backward(float *din, const float *dout, const int32_t *argmax,
                                   size_t total, int h, int w)
{
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= total) return;
    size_t plane = idx / ((size_t)(h / 2) * (w / 2));
    din[plane * h * w + argmax[idx]] += dout[idx];
}

extern "C" int kern_maxpool_forward(float *out, int32_t *argmax, const float *in, int batch, int c,
                                    int h, int w, kern_stream s)
{
    size_t total = (size_t)batch * c * (h / 2) * (w / 2);
    if (total == 0) return 0;
    k_maxpool_forward<<<blocks_for(total), THREADS, 0, s>>>(out, argmax, in, total, h, w);
    return launched();
}

extern "C" int kern_maxpool_backward(float *din, const float *dout, const int32_t *argmax,
                                     int batch, int c, int h, int w, kern_stream s)
{
    size_t total = (size_t)batch * c * (h / 2) * (w / 2);
    cudaError_t e = cudaMemsetAsync(din, 0, sizeof(float) * batch * c * h * w, s);
    if (e != cudaSuccess) return (int)e;
    if (total == 0) return 0;
    k_maxpool_backward<<<blocks_for(total), THREADS, 0, s>>>(din, dout, argmax, total, h, w);
    return launched();
}

/* ---- softmax cross-entropy ---- */

__global__ void k_softmax_xent_forward(float *probs, double *loss, const float *logits,
                                       const uint8_t *labels, int batch, int classes)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= batch) return;
    const float *z = logits + (size_t)i * classes;
    float *p = probs + (size_t)i * classes;
    float max = -FLT_MAX;
    for (int k = 0; k < classes; k++)
        max = z[k] > max ? z[k] : max;
    double sum = 0.0;
    for (int k = 0; k < classes; k++) {
        p[k] = expf(z[k] - max);
        sum += p[k];
    }
    for (int k = 0; k < classes; k++)
        p[k] = (float)(p[k] / sum);
    loss[i] = -(z[labels[i]] - max - log(sum));
}

__global__ void k_softmax_xent_backward(float *dlogits, const float *probs, const uint8_t *labels,
                                        size_t total, int classes, float scale)
{
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= total) return;
    int k = (int)(idx % classes);
    dlogits[idx] = (probs[idx] - (k == labels[idx / classes] ? 1.0f : 0.0f)) * scale;
}

extern "C" int kern_softmax_xent_forward(float *probs, double *loss, const float *logits,
                                         const uint8_t *labels, int batch, int classes,
                                         kern_stream s)
{
    if (batch <= 0) return 0;
    k_softmax_xent_forward<<<blocks_for(batch), THREADS, 0, s>>>(probs, loss, logits, labels, batch,
                                                                 classes);
    return launched();
}

extern "C" int kern_softmax_xent_backward(float *dlogits, const float *probs, const uint8_t *labels,
                                          int batch, int classes, float scale, kern_stream s)
{
    size_t total = (size_t)batch * classes;
    if (total == 0) return 0;
    k_softmax_xent_backward<<<blocks_for(total), THREADS, 0, s>>>(dlogits, probs, labels, total,
                                                                  classes, scale);
    return launched();
}

/* ---- optimizers (optim.c's sgd_update and adamw_update) ---- */

__global__ void k_sgd_update(float *p, const float *g, float *buf, size_t n, float lr, float mom,
                             float wd)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float d = g[i] + wd * p[i];
    buf[i] = mom * buf[i] + d;
    p[i] -= lr * buf[i];
}

__global__ void k_adamw_update(float *p, const float *g, float *m, float *v, size_t n, float beta1,
                               float beta2, float eps, float decay, float step, float bc2_sqrt)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    p[i] *= decay;
    m[i] = beta1 * m[i] + (1.0f - beta1) * g[i];
    v[i] = beta2 * v[i] + (1.0f - beta2) * g[i] * g[i];
    p[i] -= step * m[i] / (sqrtf(v[i]) / bc2_sqrt + eps);
}

extern "C" int kern_sgd_update(float *p, const float *g, float *buf, size_t n, float lr,
                               float momentum, float wd, kern_stream s)
{
    if (n == 0) return 0;
    k_sgd_update<<<blocks_for(n), THREADS, 0, s>>>(p, g, buf, n, lr, momentum, wd);
    return launched();
}

/* decay, step and sqrt(bc2) are computed on the host exactly as optim.c does. */
extern "C" int kern_adamw_update(float *p, const float *g, float *m, float *v, size_t n, float lr,
                                 float beta1, float beta2, float eps, float wd, float bc1,
                                 float bc2, kern_stream s)
{
    if (n == 0) return 0;
    float decay = 1.0f - lr * wd;
    float step = lr / bc1, bc2_sqrt = sqrtf(bc2);
    k_adamw_update<<<blocks_for(n), THREADS, 0, s>>>(p, g, m, v, n, beta1, beta2, eps, decay, step,
                                                     bc2_sqrt);
    return launched();
}
