/* cublas_v2.h: the subset of cuBLAS that ductile calls, for the host test
 * runtime (tests/gpurt; -DDUCTILE_GPU_RUNTIME=host).
 *
 * Names, types and values follow the real header, so trainer code compiles
 * unchanged against either. The GEMMs are column-major, as cuBLAS's are,
 * queued on the handle's stream and computed by OpenBLAS (rt_blas.c);
 * alpha and beta are host pointers (CUBLAS_POINTER_MODE_HOST, the default
 * and the only mode here), read at the call.
 */
#ifndef DUCTILE_GPURT_CUBLAS_V2_H
#define DUCTILE_GPURT_CUBLAS_V2_H

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_ALLOC_FAILED = 3,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_ARCH_MISMATCH = 8,
    CUBLAS_STATUS_MAPPING_ERROR = 11,
    CUBLAS_STATUS_EXECUTION_FAILED = 13,
    CUBLAS_STATUS_INTERNAL_ERROR = 14,
    CUBLAS_STATUS_NOT_SUPPORTED = 15,
    CUBLAS_STATUS_LICENSE_ERROR = 16,
} cublasStatus_t;

typedef struct cublasContext *cublasHandle_t;

typedef enum {
    CUBLAS_OP_N = 0,
    CUBLAS_OP_T = 1,
    CUBLAS_OP_C = 2, /* real matrices: the same as CUBLAS_OP_T */
} cublasOperation_t;

typedef enum {
    CUBLAS_DEFAULT_MATH = 0,
    CUBLAS_TF32_TENSOR_OP_MATH = 3, /* emulated: A and B rounded to TF32 first */
} cublasMath_t;

cublasStatus_t cublasCreate(cublasHandle_t *handle);
cublasStatus_t cublasDestroy(cublasHandle_t handle);
cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream);
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode);
const char *cublasGetStatusString(cublasStatus_t status);

/* C = alpha op(A) op(B) + beta C, column-major: op(A) is m x k, op(B) k x n. */
cublasStatus_t cublasSgemm(cublasHandle_t handle, cublasOperation_t transa,
                           cublasOperation_t transb, int m, int n, int k, const float *alpha,
                           const float *A, int lda, const float *B, int ldb, const float *beta,
                           float *C, int ldc);
/* batchCount independent GEMMs, problem i at A + i*strideA (B, C likewise). */
cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t handle, cublasOperation_t transa,
                                         cublasOperation_t transb, int m, int n, int k,
                                         const float *alpha, const float *A, int lda,
                                         long long int strideA, const float *B, int ldb,
                                         long long int strideB, const float *beta, float *C,
                                         int ldc, long long int strideC, int batchCount);

#ifdef __cplusplus
}
#endif

#endif
