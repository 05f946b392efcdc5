/* gpu_stub.c: the GPU entry points of a build without CUDA.
 *
 * The build compiles *_nccl.c and *_cuda.c only when CUDA is found; this
 * file stands in for them otherwise, so callers link either way and get a
 * clear "built without CUDA" error at run time instead of a link error.
 */
#include "comm_impl.h"

comm_err comm_nccl_init(const comm_config *cfg, comm **out)
{
    if (out) *out = NULL;
    return comm_init_failed(cfg, COMM_ERR_ARG, "NCCL requested but ductile was built without CUDA");
}
