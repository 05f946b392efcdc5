/* gpu_test.h: what the GPU tests share: skip without a device, compare arrays.
 *
 * A test that needs a CUDA device calls gpu_test_require() first: without
 * one it prints "SKIP: <reason>" and exits 77, which ctest reports as
 * skipped (SKIP_RETURN_CODE). Arrays are compared the way compare_params
 * does: relative L2 and relative max difference against the CPU reference,
 * so entries near zero do not turn rounding noise into failures.
 */
#ifndef DUCTILE_GPU_TEST_H
#define DUCTILE_GPU_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime.h>

#include "gpu.h"
#include "trainer_test.h"

#define GPU_TEST_SKIP 77

/* The small MLP the DDP tests train (three buckets at a 1000-byte cap). */
#define GPU_TEST_MLP                                                                               \
    {                                                                                              \
        .kind = MODEL_MLP, .in_c = 1, .in_h = 8, .in_w = 8, .classes = 10, .nhidden = 2,           \
        .hidden = {                                                                                \
            64,                                                                                    \
            32                                                                                     \
        }                                                                                          \
    }

static inline void gpu_test_require(void)
{
    char why[256];
    if (gpu_device_count(why) == 0) {
        printf("SKIP: %s\n", why);
        fflush(stdout);
        exit(GPU_TEST_SKIP);
    }
}

/* 1 when got is within tol of want (relative L2 and relative max). */
static inline int gpu_test_near(const char *what, const float *got, const float *want, size_t n,
                                double tol)
{
    double d2 = 0, w2 = 0, dmax = 0, wmax = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - want[i]);
        d2 += d * d;
        w2 += (double)want[i] * want[i];
        dmax = d > dmax ? d : dmax;
        wmax = fabs(want[i]) > wmax ? fabs(want[i]) : wmax;
    }
    double rel = sqrt(d2) / (sqrt(w2) + 1e-30), relmax = dmax / (wmax + 1e-30);
    int ok = isfinite(rel) && rel <= tol && relmax <= tol;
    printf("  %-28s n=%-8zu rel L2 %.2e, rel max %.2e (tol %.0e) %s\n", what, n, rel, relmax, tol,
           ok ? "ok" : "MISMATCH");
    CHECK(ok, "%s: GPU differs from the CPU reference", what);
    return ok;
}

/* Device copies of host arrays, and back. Failures abort the test.
 * Neither synchronises the device: cudaMemcpy runs on the legacy stream,
 * which does not wait for the trainer's non-blocking streams, so a test must
 * wait for the stream its kernels ran on (gpu_sync) before it reads a
 * result, as the trainer must; a missing wait shows as stale data (and, on
 * the host test runtime, as a reported race). An upload from pageable
 * memory may return before its DMA lands, so it waits for the legacy
 * stream (only that one) before kernels on other streams read the data. */
static inline void *gpu_test_up(const void *host, size_t bytes)
{
    void *d = NULL;
    if (cudaMalloc(&d, bytes ? bytes : 1) != cudaSuccess ||
        (bytes && cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess) ||
        cudaStreamSynchronize(NULL) != cudaSuccess) {
        fprintf(stderr, "cuda: upload of %zu bytes failed\n", bytes);
        exit(1);
    }
    return d;
}

static inline void gpu_test_down(void *host, const void *dev, size_t bytes)
{
    cudaError_t e = cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) {
        fprintf(stderr, "cuda: download failed: %s\n", cudaGetErrorString(e));
        exit(1);
    }
}

#endif
