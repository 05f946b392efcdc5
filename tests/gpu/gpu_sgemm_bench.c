/* gpu_sgemm_bench.c: cuBLAS SGEMM throughput, the GPU's FP32 ceiling.
 *
 * usage: gpu_sgemm_bench [N [REPS]]   (4096, 20)
 * Times REPS N^3 products (plain FP32, the trainer's math mode) with CUDA
 * events after a warm-up and prints one line: "sgemm N TFLOPS". run.sh puts
 * it beside the device's published dense FP32 peak. Exit 77 without a device.
 */
#include <stdio.h>
#include <stdlib.h>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "gpu_test.h"

int main(int argc, char **argv)
{
    gpu_test_require();
    int n = argc > 1 ? atoi(argv[1]) : 4096, reps = argc > 2 ? atoi(argv[2]) : 20;
    if (n < 64 || n > 32768 || reps < 1 || reps > 10000) {
        fprintf(stderr, "usage: gpu_sgemm_bench [N 64..32768 [REPS 1..10000]]\n");
        return 2;
    }
    size_t bytes = sizeof(float) * n * n;
    float *a, *b, *c;
    cublasHandle_t h;
    cudaEvent_t t0, t1;
    if (cudaMalloc((void **)&a, bytes) || cudaMalloc((void **)&b, bytes) ||
        cudaMalloc((void **)&c, bytes) || cublasCreate(&h) != CUBLAS_STATUS_SUCCESS ||
        cublasSetMathMode(h, CUBLAS_DEFAULT_MATH) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "gpu_sgemm_bench: setup failed\n");
        return 1;
    }
    cudaMemset(a, 0, bytes);
    cudaMemset(b, 0, bytes);
    cudaEventCreate(&t0);
    cudaEventCreate(&t1);
    float alpha = 1.0f, beta = 0.0f, ms = 0;
    for (int i = 0; i < 3; i++)
        cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, n, b, n, &beta, c, n);
    cudaEventRecord(t0, 0);
    for (int i = 0; i < reps; i++)
        cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, n, b, n, &beta, c, n);
    cudaEventRecord(t1, 0);
    cudaError_t e = cudaEventSynchronize(t1);
    if (e != cudaSuccess || cudaEventElapsedTime(&ms, t0, t1) != cudaSuccess || ms <= 0) {
        fprintf(stderr, "gpu_sgemm_bench: %s\n", cudaGetErrorString(e));
        return 1;
    }
    double tflops = 2.0 * n * (double)n * n * reps / (ms * 1e-3) / 1e12;
    printf("sgemm %d %.2f\n", n, tflops);
    cublasDestroy(h);
    cudaFree(a), cudaFree(b), cudaFree(c);
    return 0;
}
