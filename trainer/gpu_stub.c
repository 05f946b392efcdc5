/* gpu_stub.c: the GPU entry points of a build without CUDA.
 *
 * The build compiles *_nccl.c and *_cuda.c only when CUDA is found; this
 * file stands in for them otherwise, so callers link either way and get a
 * clear "built without CUDA" error at run time instead of a link error.
 */
#include "ductile/comm.h"

#include <stdio.h>

comm_err comm_nccl_init(const comm_config *cfg, comm **out)
{
    (void)cfg;
    if (out) *out = NULL;
    fprintf(stderr, "comm: NCCL requested but ductile was built without CUDA\n");
    return COMM_ERR_ARG;
}
