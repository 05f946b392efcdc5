/* gpu_probe.c: exit 0 and print the devices when CUDA has one; else print
 * "SKIP: <reason>" and exit 77. The GPU script tests and run.sh start with it. */
#include <stdio.h>

#include <cuda_runtime.h>

#include "gpu_test.h"

int main(void)
{
    gpu_test_require();
    int n = 0;
    cudaGetDeviceCount(&n);
    for (int i = 0; i < n; i++) {
        struct cudaDeviceProp p;
        if (cudaGetDeviceProperties(&p, i) == cudaSuccess)
            printf("cuda:%d %s, %d SMs, %.0f GiB, compute %d.%d\n", i, p.name,
                   p.multiProcessorCount, p.totalGlobalMem / 1073741824.0, p.major, p.minor);
    }
    return 0;
}
