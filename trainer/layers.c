/* layers.c: forward and backward of every layer the trainer's models use.
 *
 * Each layer's two halves sit next to each other. Matrix products go through
 * gemm() (cblas_sgemm); convolution is im2col + one GEMM per sample, which
 * keeps the scratch small (one sample's columns) and the code short. A
 * batched im2col would make fewer, larger GEMMs; at these sizes the
 * per-sample calls are not the bottleneck.
 */
#include "ductile/layers.h"

#include <float.h>
#include <math.h>
#include <string.h>

#include <cblas.h>

void gemm(int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
          const float *b, int ldb, float beta, float *c, int ldc)
{
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

/* ---- bias (linear: inner 1; convolution: inner = OH*OW) ---- */

void layer_bias_fill(float *out, const float *b, int outer, int channels, int inner)
{
    for (int i = 0; i < outer; i++)
        for (int c = 0; c < channels; c++) {
            float *row = out + ((size_t)i * channels + c) * inner;
            for (int p = 0; p < inner; p++)
                row[p] = b[c];
        }
}

/* Each row of inner entries is summed on its own, then added into db (for
 * inner 1, linear's case, that is each entry added straight in). */
void layer_bias_grad(float *db, const float *dout, int outer, int channels, int inner)
{
    for (int i = 0; i < outer; i++)
        for (int c = 0; c < channels; c++) {
            const float *row = dout + ((size_t)i * channels + c) * inner;
            float acc = 0.0f;
            for (int p = 0; p < inner; p++)
                acc += row[p];
            db[c] += acc;
        }
}

/* ---- linear ---- */

void linear_forward(float *out, const float *in, const float *w, const float *b, int batch,
                    int in_dim, int out_dim)
{
    layer_bias_fill(out, b, batch, out_dim, 1);
    gemm(0, 1, batch, out_dim, in_dim, 1.0f, in, in_dim, w, in_dim, 1.0f, out, out_dim);
}

void linear_backward(float *din, float *dw, float *db, const float *dout, const float *in,
                     const float *w, int batch, int in_dim, int out_dim)
{
    gemm(1, 0, out_dim, in_dim, batch, 1.0f, dout, out_dim, in, in_dim, 1.0f, dw, in_dim);
    layer_bias_grad(db, dout, batch, out_dim, 1);
    if (din) gemm(0, 0, batch, in_dim, out_dim, 1.0f, dout, out_dim, w, in_dim, 0.0f, din, in_dim);
}

/* ---- relu ---- */

void relu_forward(float *out, const float *in, size_t n)
{
    for (size_t i = 0; i < n; i++)
        out[i] = in[i] > 0.0f ? in[i] : 0.0f;
}

/* dout[i] is loaded whatever the sign: a load only on one side of the
 * select keeps the compiler from vectorizing it. */
void relu_backward(float *din, const float *dout, const float *out, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float g = dout[i];
        din[i] = out[i] > 0.0f ? g : 0.0f;
    }
}

/* ---- convolution ---- */

void conv_shape_init(conv_shape *s, int c, int h, int w, int oc, int k, int pad)
{
    s->c = c;
    s->h = h;
    s->w = w;
    s->oc = oc;
    s->k = k;
    s->pad = pad;
    s->oh = h + 2 * pad - k + 1;
    s->ow = w + 2 * pad - k + 1;
}

size_t conv_col_size(const conv_shape *s)
{
    return (size_t)s->c * s->k * s->k * s->oh * s->ow;
}

/* The output columns ox whose input column ox + kj - pad lies inside the
 * image: [*lo, *hi). Outside it the padding is zero. */
static void valid_cols(const conv_shape *s, int kj, int *lo, int *hi)
{
    *lo = s->pad - kj > 0 ? s->pad - kj : 0;
    *hi = s->w + s->pad - kj < s->ow ? s->w + s->pad - kj : s->ow;
    if (*hi < *lo) *hi = *lo;
}

/* col[(c*k + ki)*k + kj][oy*OW + ox] = in[c][oy+ki-pad][ox+kj-pad], 0 outside.
 * Each row is a zero edge, a contiguous copy and a zero edge. */
void conv_im2col(float *col, const float *in, const conv_shape *s)
{
    int ohw = s->oh * s->ow;
    for (int c = 0; c < s->c; c++)
        for (int ki = 0; ki < s->k; ki++)
            for (int kj = 0; kj < s->k; kj++) {
                float *dst = col + (size_t)((c * s->k + ki) * s->k + kj) * ohw;
                int lo, hi;
                valid_cols(s, kj, &lo, &hi);
                for (int oy = 0; oy < s->oh; oy++) {
                    int y = oy + ki - s->pad;
                    float *row = dst + oy * s->ow;
                    if (y < 0 || y >= s->h) {
                        memset(row, 0, sizeof(float) * s->ow);
                        continue;
                    }
                    const float *src = in + ((size_t)c * s->h + y) * s->w;
                    memset(row, 0, sizeof(float) * lo);
                    memcpy(row + lo, src + (lo + kj - s->pad), sizeof(float) * (hi - lo));
                    memset(row + hi, 0, sizeof(float) * (s->ow - hi));
                }
            }
}

/* The adjoint of im2col: scatter-add columns back into the image, which it
 * zeroes first. */
void conv_col2im(float *in, const float *col, const conv_shape *s)
{
    int ohw = s->oh * s->ow;
    memset(in, 0, sizeof(float) * s->c * s->h * s->w);
    for (int c = 0; c < s->c; c++)
        for (int ki = 0; ki < s->k; ki++)
            for (int kj = 0; kj < s->k; kj++) {
                const float *src = col + (size_t)((c * s->k + ki) * s->k + kj) * ohw;
                int lo, hi;
                valid_cols(s, kj, &lo, &hi);
                for (int oy = 0; oy < s->oh; oy++) {
                    int y = oy + ki - s->pad;
                    if (y < 0 || y >= s->h) continue;
                    float *dst = in + ((size_t)c * s->h + y) * s->w + (lo + kj - s->pad);
                    const float *row = src + oy * s->ow + lo;
                    for (int i = 0; i < hi - lo; i++)
                        dst[i] += row[i];
                }
            }
}

void conv_forward(float *out, const float *in, const float *w, const float *b, int batch,
                  const conv_shape *s, float *col)
{
    int ohw = s->oh * s->ow, ckk = s->c * s->k * s->k;
    for (int n = 0; n < batch; n++) {
        const float *x = in + (size_t)n * s->c * s->h * s->w;
        float *y = out + (size_t)n * s->oc * ohw;
        conv_im2col(col, x, s);
        layer_bias_fill(y, b, 1, s->oc, ohw);
        gemm(0, 0, s->oc, ohw, ckk, 1.0f, w, ckk, col, ohw, 1.0f, y, ohw);
    }
}

void conv_backward(float *din, float *dw, float *db, const float *dout, const float *in,
                   const float *w, int batch, const conv_shape *s, float *col, float *dcol)
{
    int ohw = s->oh * s->ow, ckk = s->c * s->k * s->k;
    for (int n = 0; n < batch; n++) {
        const float *x = in + (size_t)n * s->c * s->h * s->w;
        const float *dy = dout + (size_t)n * s->oc * ohw;
        conv_im2col(col, x, s);
        gemm(0, 1, s->oc, ckk, ohw, 1.0f, dy, ohw, col, ohw, 1.0f, dw, ckk);
        layer_bias_grad(db, dy, 1, s->oc, ohw);
        if (din) {
            gemm(1, 0, ckk, ohw, s->oc, 1.0f, w, ckk, dy, ohw, 0.0f, dcol, ohw);
            conv_col2im(din + (size_t)n * s->c * s->h * s->w, dcol, s);
        }
    }
}

/* ---- max-pool 2x2 ---- */

void maxpool_forward(float *out, int32_t *argmax, const float *in, int batch, int c, int h, int w)
{
    int oh = h / 2, ow = w / 2;
    for (int p = 0; p < batch * c; p++) {
        const float *x = in + (size_t)p * h * w;
        float *y = out + (size_t)p * oh * ow;
        int32_t *am = argmax + (size_t)p * oh * ow;
        for (int oy = 0; oy < oh; oy++)
            for (int ox = 0; ox < ow; ox++) {
                int best = (2 * oy) * w + 2 * ox;
                int cand[3] = {best + 1, best + w, best + w + 1};
                for (int i = 0; i < 3; i++)
                    if (x[cand[i]] > x[best]) best = cand[i];
                y[oy * ow + ox] = x[best];
                am[oy * ow + ox] = best;
            }
    }
}

void maxpool_backward(float *din, const float *dout, const int32_t *argmax, int batch, int c, int h,
                      int w)
{
    int ohw = (h / 2) * (w / 2);
    memset(din, 0, sizeof(float) * batch * c * h * w);
    for (int p = 0; p < batch * c; p++) {
        float *dx = din + (size_t)p * h * w;
        const float *dy = dout + (size_t)p * ohw;
        const int32_t *am = argmax + (size_t)p * ohw;
        for (int i = 0; i < ohw; i++)
            dx[am[i]] += dy[i];
    }
}

/* ---- softmax cross-entropy ---- */

double softmax_xent_forward(float *probs, const float *logits, const uint8_t *labels, int batch,
                            int classes)
{
    double loss = 0.0;
    for (int i = 0; i < batch; i++) {
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
        loss += -(z[labels[i]] - max - log(sum));
    }
    return loss;
}

void softmax_xent_backward(float *dlogits, const float *probs, const uint8_t *labels, int batch,
                           int classes, float scale)
{
    for (int i = 0; i < batch; i++) {
        const float *p = probs + (size_t)i * classes;
        float *d = dlogits + (size_t)i * classes;
        for (int k = 0; k < classes; k++)
            d[k] = (p[k] - (k == labels[i] ? 1.0f : 0.0f)) * scale;
    }
}
