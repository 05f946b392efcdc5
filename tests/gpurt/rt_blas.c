/* rt_blas.c: the cuBLAS subset of cublas_v2.h on the host test runtime (see rt.h).
 *
 * The one idea: a GEMM is a stream op on the handle's stream that calls
 * OpenBLAS's cblas_sgemm with cuBLAS's own column-major arguments
 * (CblasColMajor), so the trainer's mapping of its row-major products onto
 * column-major cuBLAS (gpu_model_cuda.c swaps the operands) is exercised as on
 * the GPU: a mapping that is wrong gives wrong numbers here too. The call
 * checks what cuBLAS checks (sizes, leading dimensions: INVALID_VALUE) and
 * what cuBLAS cannot: each matrix is device memory over its exact extent,
 * (cols-1)*ld + rows floats, across the batch at its stride, and alpha and
 * beta are host memory, read at the call (pointer mode host, the default).
 *
 * CUBLAS_TF32_TENSOR_OP_MATH allows cuBLAS to round A and B to TF32 (10
 * mantissa bits) on tensor cores; here it always does, so a test that
 * passes on this runtime does not depend on a GPU choosing plain FP32.
 * Knowingly simple: negative batch strides, which cuBLAS takes, abort here;
 * nothing in ductile uses them.
 */
#include "rt.h"

#include <stdlib.h>
#include <string.h>

#include <cblas.h>
#include <cublas_v2.h>

struct cublasContext {
    cudaStream_t stream; /* NULL: the legacy default stream */
    int tf32;
};

/* The failpoint's action for this call in *action; 1 when it fails at once. */
static int call_refused(const char *call, const char **action)
{
    *action = rt_call("cuda", call);
    return *action && strcmp(*action, "error") == 0;
}

/* ---- handles ---- */

cublasStatus_t cublasCreate(cublasHandle_t *handle)
{
    const char *a;
    if (call_refused("cublasCreate", &a)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
    if (rt_device_count() == 0 || rt_sticky() != cudaSuccess) return CUBLAS_STATUS_NOT_INITIALIZED;
    *handle = calloc(1, sizeof(**handle));
    return *handle ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_ALLOC_FAILED;
}

/* Queued GEMMs keep no reference to their handle: it can go at once. */
cublasStatus_t cublasDestroy(cublasHandle_t handle)
{
    const char *a;
    if (call_refused("cublasDestroy", &a)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
    free(handle);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream)
{
    const char *a;
    if (call_refused("cublasSetStream", &a) || !handle) return CUBLAS_STATUS_NOT_INITIALIZED;
    handle->stream = stream;
    return CUBLAS_STATUS_SUCCESS;
}

/* The modes cuBLAS 11+ takes: 0..3, optionally with
 * CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION (16); only TF32 changes
 * the numbers here. */
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode)
{
    const char *a;
    if (call_refused("cublasSetMathMode", &a) || !handle) return CUBLAS_STATUS_NOT_INITIALIZED;
    unsigned m = (unsigned)mode & ~16u;
    if (m > 3) return CUBLAS_STATUS_INVALID_VALUE;
    handle->tf32 = m == CUBLAS_TF32_TENSOR_OP_MATH;
    return CUBLAS_STATUS_SUCCESS;
}

const char *cublasGetStatusString(cublasStatus_t status)
{
    switch (status) {
    case CUBLAS_STATUS_SUCCESS:
        return "the operation completed successfully";
    case CUBLAS_STATUS_NOT_INITIALIZED:
        return "the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED:
        return "the resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE:
        return "an invalid numeric value was used as an argument";
    case CUBLAS_STATUS_ARCH_MISMATCH:
        return "an absent device architectural feature is required";
    case CUBLAS_STATUS_MAPPING_ERROR:
        return "an access to GPU memory space failed";
    case CUBLAS_STATUS_EXECUTION_FAILED:
        return "the GPU program failed to execute";
    case CUBLAS_STATUS_INTERNAL_ERROR:
        return "an internal operation failed";
    case CUBLAS_STATUS_NOT_SUPPORTED:
        return "the functionality requested is not supported";
    case CUBLAS_STATUS_LICENSE_ERROR:
        return "error detected trying to check the license";
    }
    return "unknown error";
}

/* ---- GEMM ---- */

/* One operand across the batch: problem i's matrix at p + i*stride. */
typedef struct {
    const float *p;
    int ld;
    long long stride;
    size_t span; /* floats the batch touches; 0: none (an empty matrix) */
} matrix;

typedef struct {
    rt_op op;
    CBLAS_TRANSPOSE ta, tb;
    int m, n, k, count;
    float alpha, beta;
    matrix a, b, c;
    int tf32;
} gemm_op;

/* x rounded to the nearest TF32 (8-bit exponent, 10-bit mantissa), ties to
 * even; infinities and NaNs pass. */
static float to_tf32(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0xfffu + ((u >> 13) & 1u)) & ~0x1fffu;
    memcpy(&x, &u, sizeof(x));
    return x;
}

static float *tf32_copy(const matrix *x)
{
    float *y = malloc(sizeof(float) * (x->span ? x->span : 1));
    if (!y) rt_die("cublasSgemm: out of memory for the TF32 operands");
    for (size_t i = 0; i < x->span; i++)
        y[i] = to_tf32(x->p[i]);
    return y;
}

static rt_state run_gemm(rt_op *op)
{
    gemm_op *g = (gemm_op *)op;
    const float *a = g->a.p, *b = g->b.p;
    float *c = (float *)g->c.p; /* the caller's C, kept const in the matrix struct */
    float *a32 = NULL, *b32 = NULL;
    if (g->tf32) {
        a = a32 = tf32_copy(&g->a);
        b = b32 = tf32_copy(&g->b);
    }
    for (int i = 0; i < g->count; i++)
        cblas_sgemm(CblasColMajor, g->ta, g->tb, g->m, g->n, g->k, g->alpha, a + i * g->a.stride,
                    g->a.ld, b + i * g->b.stride, g->b.ld, g->beta, c + i * g->c.stride, g->c.ld);
    free(a32);
    free(b32);
    return RT_DONE;
}

/* A rows x cols column-major operand, repeated count times: it spans
 * (count-1)*stride + (cols-1)*ld + rows floats. */
static matrix operand(const float *p, int rows, int cols, int ld, long long stride, int count)
{
    matrix x = {p, ld, stride, 0};
    if (rows > 0 && cols > 0 && count > 0)
        x.span = (size_t)(count - 1) * (size_t)stride + (size_t)(cols - 1) * ld + rows;
    return x;
}

static void need_matrix(const char *call, const char *name, const matrix *x)
{
    rt_need(call, name, x->p, sizeof(float) * x->span, RT_NEED_DEVICE);
}

static int max1(int x)
{
    return x > 1 ? x : 1;
}

static CBLAS_TRANSPOSE trans(cublasOperation_t op)
{
    return op == CUBLAS_OP_N ? CblasNoTrans : CblasTrans;
}

/* Every GEMM: one is a batch of one at stride 0. */
static cublasStatus_t gemm(const char *call, cublasHandle_t h, cublasOperation_t transa,
                           cublasOperation_t transb, int m, int n, int k, const float *alpha,
                           const float *A, int lda, long long sa, const float *B, int ldb,
                           long long sb, const float *beta, float *C, int ldc, long long sc,
                           int count)
{
    const char *act;
    if (call_refused(call, &act)) return CUBLAS_STATUS_EXECUTION_FAILED;
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if ((unsigned)transa > CUBLAS_OP_C || (unsigned)transb > CUBLAS_OP_C)
        return CUBLAS_STATUS_INVALID_VALUE;
    /* As stored: op(A) is m x k, op(B) k x n. */
    int ra = transa == CUBLAS_OP_N ? m : k, ca = transa == CUBLAS_OP_N ? k : m;
    int rb = transb == CUBLAS_OP_N ? k : n, cb = transb == CUBLAS_OP_N ? n : k;
    if (m < 0 || n < 0 || k < 0 || count < 0 || lda < max1(ra) || ldb < max1(rb) || ldc < max1(m))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (m == 0 || n == 0 || count == 0) return CUBLAS_STATUS_SUCCESS;
    if (sa < 0 || sb < 0 || sc < 0)
        rt_die("%s: negative strides (%lld, %lld, %lld) are not supported here", call, sa, sb, sc);
    rt_need(call, "alpha", alpha, sizeof(float), RT_NEED_HOST);
    rt_need(call, "beta", beta, sizeof(float), RT_NEED_HOST);
    matrix a = operand(A, ra, ca, lda, sa, count), b = operand(B, rb, cb, ldb, sb, count);
    matrix c = operand(C, m, n, ldc, sc, count);
    need_matrix(call, "A", &a);
    need_matrix(call, "B", &b);
    need_matrix(call, "C", &c);

    gemm_op *g = calloc(1, sizeof(*g));
    if (!g) return CUBLAS_STATUS_ALLOC_FAILED;
    g->op.name = call;
    g->op.run = run_gemm;
    g->ta = trans(transa);
    g->tb = trans(transb);
    g->m = m, g->n = n, g->k = k, g->count = count;
    g->alpha = *alpha, g->beta = *beta;
    g->a = a, g->b = b, g->c = c;
    g->tf32 = h->tf32;
    if (a.span) rt_op_access(&g->op, A, sizeof(float) * a.span, 0);
    if (b.span) rt_op_access(&g->op, B, sizeof(float) * b.span, 0);
    rt_op_access(&g->op, C, sizeof(float) * c.span, 1);
    g->op.kernel = 1;
    cudaError_t e = rt_enqueue(h->stream, &g->op, act);
    return e == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}

cublasStatus_t cublasSgemm(cublasHandle_t handle, cublasOperation_t transa,
                           cublasOperation_t transb, int m, int n, int k, const float *alpha,
                           const float *A, int lda, const float *B, int ldb, const float *beta,
                           float *C, int ldc)
{
    return gemm(__func__, handle, transa, transb, m, n, k, alpha, A, lda, 0, B, ldb, 0, beta, C,
                ldc, 0, 1);
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t handle, cublasOperation_t transa,
                                         cublasOperation_t transb, int m, int n, int k,
                                         const float *alpha, const float *A, int lda,
                                         long long int strideA, const float *B, int ldb,
                                         long long int strideB, const float *beta, float *C,
                                         int ldc, long long int strideC, int batchCount)
{
    return gemm(__func__, handle, transa, transb, m, n, k, alpha, A, lda, strideA, B, ldb, strideB,
                beta, C, ldc, strideC, batchCount);
}
