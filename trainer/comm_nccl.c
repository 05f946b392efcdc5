/* comm_nccl.c: the GPU collectives backend, NCCL.
 *
 * Rank 0 makes the NCCL unique id and publishes it in the round store
 * ("nccl/id", hex); every rank reads it and joins with a non-blocking
 * ncclCommInitRankConfig. Buffers are device memory.
 *
 * The idea that keeps NCCL from hanging a process: the communicator is
 * non-blocking, and the calling thread never waits inside NCCL or CUDA. It
 * enqueues a collective on the comm's stream and then polls: the stream
 * (done?), ncclCommGetAsyncError (a peer or network failure?), the abort
 * flag (comm_abort from another thread) and the deadline. On anything but
 * completion it calls ncclCommAbort, which tears the communicator down with
 * the kernels in flight, and the comm is dead. Only the calling thread
 * touches the NCCL communicator, so comm_abort() just sets the flag.
 *
 * Knowingly simple: the deadline covers a whole collective, not "no
 * progress" as on the ring (NCCL does not report progress); polling sleeps
 * 50 us between checks, which costs a core's sliver while waiting.
 */
#include "comm_impl.h"
#include "ductile/clock.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NCCL_DEFAULT_TIMEOUT_MS 30000
#define NCCL_POLL_NS 50000

typedef struct nccl_comm {
    comm base; /* first: comm.c sees the same pointer */
    ncclComm_t nc;
    cudaStream_t stream;
    float *dev_one; /* barrier's one-float allreduce */
    int device;
    int timeout_ms;
    int broken; /* aborted or failed: destroy must abort, not finalize */
} nccl_comm;

static void pause_briefly(void)
{
    struct timespec ts = {0, NCCL_POLL_NS};
    nanosleep(&ts, NULL);
}

static comm_err nccl_fail(nccl_comm *g, comm_err err, const char *what, ncclResult_t r)
{
    const char *detail = g->nc ? ncclGetLastError(g->nc) : "";
    comm_err out =
        comm_fail(&g->base, err, "rank %d: %s: %s%s%s", g->base.rank, what, ncclGetErrorString(r),
                  detail && *detail ? ": " : "", detail ? detail : "");
    if (g->nc && !g->broken) {
        g->broken = 1;
        ncclCommAbort(g->nc);
        g->nc = NULL;
    }
    return out;
}

static comm_err cuda_fail(nccl_comm *g, const char *what, cudaError_t e)
{
    comm_err out = comm_fail(&g->base, COMM_ERR_CUDA, "rank %d: %s: %s", g->base.rank, what,
                             cudaGetErrorString(e));
    if (g->nc && !g->broken) {
        g->broken = 1;
        ncclCommAbort(g->nc);
        g->nc = NULL;
    }
    return out;
}

/* Waits for the communicator to leave ncclInProgress (init, finalize, or
 * a call on a non-blocking comm), watching the abort flag and deadline. */
static comm_err nccl_settle(nccl_comm *g, const char *what, int64_t deadline)
{
    for (;;) {
        ncclResult_t st = ncclSuccess;
        ncclResult_t r = ncclCommGetAsyncError(g->nc, &st);
        if (r != ncclSuccess) return nccl_fail(g, COMM_ERR_NCCL, what, r);
        if (st == ncclSuccess) return COMM_OK;
        if (st != ncclInProgress)
            return nccl_fail(g, st == ncclRemoteError ? COMM_ERR_PEER : COMM_ERR_NCCL, what, st);
        if (comm_is_aborted(&g->base)) return nccl_fail(g, COMM_ERR_ABORTED, what, ncclInProgress);
        if (mono_now_ms() >= deadline) return nccl_fail(g, COMM_ERR_TIMEOUT, what, ncclInProgress);
        pause_briefly();
    }
}

/* After enqueuing a collective: its call's result, then the stream. */
static comm_err nccl_finish(nccl_comm *g, const char *what, ncclResult_t r)
{
    int64_t deadline = mono_now_ms() + g->timeout_ms;
    if (r != ncclSuccess && r != ncclInProgress) return nccl_fail(g, COMM_ERR_NCCL, what, r);
    comm_err err = nccl_settle(g, what, deadline);
    if (err != COMM_OK) return err;
    for (;;) {
        cudaError_t e = cudaStreamQuery(g->stream);
        if (e == cudaSuccess) return COMM_OK;
        if (e != cudaErrorNotReady) return cuda_fail(g, what, e);
        ncclResult_t st = ncclSuccess;
        r = ncclCommGetAsyncError(g->nc, &st);
        if (r != ncclSuccess) return nccl_fail(g, COMM_ERR_NCCL, what, r);
        if (st != ncclSuccess && st != ncclInProgress)
            return nccl_fail(g, st == ncclRemoteError ? COMM_ERR_PEER : COMM_ERR_NCCL, what, st);
        if (comm_is_aborted(&g->base)) return nccl_fail(g, COMM_ERR_ABORTED, what, ncclSuccess);
        if (mono_now_ms() >= deadline) return nccl_fail(g, COMM_ERR_TIMEOUT, what, ncclSuccess);
        pause_briefly();
    }
}

static comm_err nccl_enter(nccl_comm *g)
{
    cudaError_t e = cudaSetDevice(g->device);
    if (e != cudaSuccess) return cuda_fail(g, "cudaSetDevice", e);
    return COMM_OK;
}

static comm_err nccl_allreduce(comm *c, float *buf, size_t n)
{
    nccl_comm *g = (nccl_comm *)c;
    comm_err err = nccl_enter(g);
    if (err != COMM_OK) return err;
    ncclResult_t r = ncclAllReduce(buf, buf, n, ncclFloat, ncclSum, g->nc, g->stream);
    return nccl_finish(g, "ncclAllReduce", r);
}

static comm_err nccl_broadcast(comm *c, void *buf, size_t bytes, int root)
{
    nccl_comm *g = (nccl_comm *)c;
    comm_err err = nccl_enter(g);
    if (err != COMM_OK) return err;
    ncclResult_t r = ncclBroadcast(buf, buf, bytes, ncclUint8, root, g->nc, g->stream);
    return nccl_finish(g, "ncclBroadcast", r);
}

static comm_err nccl_allgather(comm *c, const void *send, size_t bytes, void *recv)
{
    nccl_comm *g = (nccl_comm *)c;
    comm_err err = nccl_enter(g);
    if (err != COMM_OK) return err;
    ncclResult_t r = ncclAllGather(send, recv, bytes, ncclUint8, g->nc, g->stream);
    return nccl_finish(g, "ncclAllGather", r);
}

static comm_err nccl_barrier(comm *c)
{
    nccl_comm *g = (nccl_comm *)c;
    comm_err err = nccl_enter(g);
    if (err != COMM_OK) return err;
    ncclResult_t r = ncclAllReduce(g->dev_one, g->dev_one, 1, ncclFloat, ncclSum, g->nc, g->stream);
    return nccl_finish(g, "barrier", r);
}

/* The flag is already set (comm.c); the polling thread does the aborting. */
static void nccl_abort(comm *c)
{
    (void)c;
}

static void nccl_destroy(comm *c)
{
    nccl_comm *g = (nccl_comm *)c;
    if (g->nc) {
        cudaSetDevice(g->device);
        int clean = !g->broken && g->base.dead == COMM_OK && !comm_is_aborted(&g->base);
        if (clean && ncclCommFinalize(g->nc) != ncclSuccess) clean = 0;
        if (clean) {
            /* Finalize flushes in the background; bounded like any call. */
            int64_t deadline = mono_now_ms() + g->timeout_ms;
            ncclResult_t st = ncclInProgress;
            while (ncclCommGetAsyncError(g->nc, &st) == ncclSuccess && st == ncclInProgress &&
                   mono_now_ms() < deadline)
                pause_briefly();
            clean = st == ncclSuccess;
        }
        if (clean)
            ncclCommDestroy(g->nc);
        else
            ncclCommAbort(g->nc);
    }
    if (g->dev_one) cudaFree(g->dev_one);
    if (g->stream) cudaStreamDestroy(g->stream);
    free(g);
}

static const comm_ops nccl_ops = {
    "nccl", nccl_allreduce, nccl_broadcast, nccl_allgather, nccl_barrier, nccl_abort, nccl_destroy,
};

static void hex_encode(const unsigned char *in, size_t n, char *out)
{
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[in[i] >> 4];
        out[2 * i + 1] = digits[in[i] & 15];
    }
    out[2 * n] = '\0';
}

static int hex_decode(const char *in, size_t len, unsigned char *out, size_t n)
{
    if (len != 2 * n) return -1;
    for (size_t i = 0; i < n; i++) {
        int v = 0;
        for (int k = 0; k < 2; k++) {
            char ch = in[2 * i + (size_t)k];
            int d = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1;
            if (d < 0) return -1;
            v = v * 16 + d;
        }
        out[i] = (unsigned char)v;
    }
    return 0;
}

/* Rank 0 makes the id and publishes it; the others wait for it. */
static comm_err nccl_share_id(nccl_comm *g, const comm_config *cfg, ncclUniqueId *id)
{
    char hex[2 * sizeof(id->internal) + 1];
    if (cfg->rank == 0) {
        ncclResult_t r = ncclGetUniqueId(id);
        if (r != ncclSuccess) return nccl_fail(g, COMM_ERR_NCCL, "ncclGetUniqueId", r);
        if (cfg->world_size == 1) return COMM_OK;
        hex_encode((const unsigned char *)id->internal, sizeof(id->internal), hex);
        rdzv_err e = rdzv_store_set(cfg->store, "nccl/id", hex, strlen(hex));
        if (e != RDZV_OK)
            return comm_fail(&g->base, COMM_ERR_STORE, "publishing the NCCL id: %s (%s)",
                             rdzv_strerror(e), rdzv_store_last_error(cfg->store));
        return COMM_OK;
    }
    void *val = NULL;
    size_t len = 0;
    rdzv_err e = rdzv_store_wait(cfg->store, "nccl/id", g->timeout_ms, &val, &len);
    if (e != RDZV_OK)
        return comm_fail(&g->base, e == RDZV_ERR_TIMEOUT ? COMM_ERR_TIMEOUT : COMM_ERR_STORE,
                         "waiting for the NCCL id: %s (%s)", rdzv_strerror(e),
                         rdzv_store_last_error(cfg->store));
    int bad = hex_decode(val, len, (unsigned char *)id->internal, sizeof(id->internal));
    free(val);
    if (bad) return comm_fail(&g->base, COMM_ERR_STORE, "malformed NCCL id in the store");
    return COMM_OK;
}

comm_err comm_nccl_init(const comm_config *cfg, comm **out)
{
    if (!out) return COMM_ERR_ARG;
    *out = NULL;
    if (!cfg || cfg->world_size < 1 || cfg->rank < 0 || cfg->rank >= cfg->world_size ||
        cfg->timeout_ms < 0 || cfg->device < 0 || (cfg->world_size > 1 && !cfg->store))
        return comm_init_failed(cfg, COMM_ERR_ARG, NULL);
    nccl_comm *g = calloc(1, sizeof(*g));
    if (!g) return comm_init_failed(cfg, COMM_ERR_NOMEM, NULL);
    comm_base_init(&g->base, &nccl_ops, cfg->rank, cfg->world_size);
    g->device = cfg->device;
    g->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : NCCL_DEFAULT_TIMEOUT_MS;
    int64_t deadline = mono_now_ms() + g->timeout_ms;

    comm_err err;
    cudaError_t ce = cudaSetDevice(g->device);
    if (ce != cudaSuccess) {
        err = cuda_fail(g, "cudaSetDevice", ce);
        goto err;
    }
    ce = cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking);
    if (ce != cudaSuccess) {
        g->stream = NULL;
        err = cuda_fail(g, "cudaStreamCreate", ce);
        goto err;
    }
    ce = cudaMalloc((void **)&g->dev_one, sizeof(float));
    if (ce != cudaSuccess) {
        g->dev_one = NULL;
        err = cuda_fail(g, "cudaMalloc", ce);
        goto err;
    }
    float one = 1.0f;
    ce = cudaMemcpy(g->dev_one, &one, sizeof(one), cudaMemcpyHostToDevice);
    if (ce != cudaSuccess) {
        err = cuda_fail(g, "cudaMemcpy", ce);
        goto err;
    }

    ncclUniqueId id;
    err = nccl_share_id(g, cfg, &id);
    if (err != COMM_OK) goto err;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&g->nc, cfg->world_size, id, cfg->rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
        err = nccl_fail(g, COMM_ERR_NCCL, "ncclCommInitRankConfig", r);
        goto err;
    }
    err = nccl_settle(g, "ncclCommInitRankConfig", deadline);
    if (err != COMM_OK) goto err;
    *out = &g->base;
    return COMM_OK;
err:
    comm_init_failed(cfg, err, g->base.last_error);
    g->broken = 1;
    nccl_destroy(&g->base);
    return err;
}
