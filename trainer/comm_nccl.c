/* comm_nccl.c: the GPU collectives backend, NCCL.
 *
 * Rank 0 makes the NCCL unique id and publishes it in the round store
 * ("nccl/id", hex); every rank reads it and joins with a non-blocking
 * ncclCommInitRankConfig. The id wait and the init have a deadline each
 * (--comm-timeout-ms), and the init gives up at once when the caller's
 * cancel hook says the round being built already ended.
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
 * Buffers: device memory goes to NCCL as it is; host memory (the state
 * sync's claims, parameters and optimizer state, evaluation counts) is
 * staged here, chunk by chunk, through a pinned bounce buffer and a device
 * buffer on the comm's own stream, so callers need not know the backend.
 * Pinned, not pageable: a pageable device-to-host copy blocks the calling
 * thread inside CUDA, where neither the abort flag nor the deadline is seen.
 *
 * Whose failure: ncclRemoteError (NCCL 2.13 and later: a peer closed its
 * connection, or the network failed) is a peer's (COMM_ERR_PEER, as a
 * closed socket is on the ring), whether the communicator reports it
 * asynchronously or the next call on it returns it. Everything else is
 * this process's own: ncclSystemError and ncclInternalError (memlock too
 * low, /dev/shm full, out of threads or descriptors: a node broken
 * locally, which must spend the job's restart budget, not rebuild
 * forever), an invalid argument or usage, a CUDA error. A timeout or an
 * abort stays a peer's (comm_err_is_peer).
 *
 * Buckets pipeline: comm_allreduce_sum_f32_start queues each bucket's
 * event wait and all-reduce behind the last (waiting only until NCCL has
 * queued it), and comm_wait polls the stream once for all of them.
 *
 * Knowingly simple: the deadline covers a whole collective, not "no
 * progress" as on the ring (NCCL does not report progress); polling yields
 * the core for its first 200 checks, then sleeps 50 us between checks.
 */
#include "comm_impl.h"
#include "ductile/clock.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NCCL_DEFAULT_TIMEOUT_MS 30000
#define NCCL_POLL_NS 50000
#define NCCL_STAGE_BYTES ((size_t)4 << 20) /* host-buffer staging chunk */

typedef struct nccl_comm {
    comm base; /* first: comm.c sees the same pointer */
    ncclComm_t nc;
    cudaStream_t stream;
    float *dev_one;   /* barrier's one-float allreduce */
    char *host_stage; /* pinned, NCCL_STAGE_BYTES */
    char *dev_stage;  /* device, NCCL_STAGE_BYTES */
    int device;
    int timeout_ms;
    int broken; /* aborted or failed: destroy must abort, not finalize */
    void (*failed_here)(void *ctx, const char *why); /* comm_config's */
    void *failed_ctx;
} nccl_comm;

/* Between two polls: the first NCCL_SPINS yield the core (a launch or a
 * short collective is over in microseconds, and a sleep costs 50-100 us of
 * timer slack), the rest sleep, so a long wait costs a sliver of a core. */
#define NCCL_SPINS 200
static void pause_briefly(int *polls)
{
    if ((*polls)++ < NCCL_SPINS) {
        sched_yield();
        return;
    }
    struct timespec ts = {0, NCCL_POLL_NS};
    nanosleep(&ts, NULL);
}

/* Tears the communicator down with whatever is in flight, and waits for its
 * stream: the aborted kernels end, so nothing of this comm stays queued on
 * buffers the caller frees next (the reducer's buckets go before the comm). */
static void nccl_break(nccl_comm *g)
{
    if (g->nc && !g->broken) {
        g->broken = 1;
        (void)ncclCommAbort(g->nc); /* its result changes nothing: the comm is gone */
        g->nc = NULL;
        if (g->stream) (void)cudaStreamSynchronize(g->stream);
    }
}

static comm_err nccl_fail(nccl_comm *g, comm_err err, const char *what, ncclResult_t r)
{
    const char *detail = g->nc ? ncclGetLastError(g->nc) : "";
    comm_err out =
        comm_fail(&g->base, err, "rank %d: %s: %s%s%s", g->base.rank, what, ncclGetErrorString(r),
                  detail && *detail ? ": " : "", detail ? detail : "");
    /* This process's own NCCL failure is said before the teardown closes
     * the connections: a peer that sees them close reports a lost peer,
     * and the two reports must not race for which comes first. */
    if (out == COMM_ERR_NCCL && g->failed_here && !g->broken) {
        g->failed_here(g->failed_ctx, g->base.last_error);
        g->failed_here = NULL;
    }
    nccl_break(g);
    return out;
}

static comm_err cuda_fail(nccl_comm *g, const char *what, cudaError_t e)
{
    comm_err out = comm_fail(&g->base, COMM_ERR_CUDA, "rank %d: %s: %s", g->base.rank, what,
                             cudaGetErrorString(e));
    nccl_break(g);
    return out;
}

/* A peer's (or the network's), or this process's (see the top). */
static comm_err nccl_kind(ncclResult_t st)
{
    return st == ncclRemoteError ? COMM_ERR_PEER : COMM_ERR_NCCL;
}

/* The communicator's state: COMM_OK when settled, COMM_ERR_TIMEOUT (not an
 * error: still in progress) while ncclInProgress, else the failure. */
static comm_err nccl_poll(nccl_comm *g, const char *what, int *settled)
{
    ncclResult_t st = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(g->nc, &st);
    *settled = 0;
    if (r != ncclSuccess) return nccl_fail(g, COMM_ERR_NCCL, "ncclCommGetAsyncError", r);
    if (st == ncclInProgress) return COMM_OK;
    if (st != ncclSuccess) return nccl_fail(g, nccl_kind(st), what, st);
    *settled = 1;
    return COMM_OK;
}

/* Waits for the communicator to leave ncclInProgress (init, or a call on a
 * non-blocking comm), watching the abort flag, the cancel hook and the
 * deadline. */
static comm_err nccl_settle(nccl_comm *g, const char *what, int64_t deadline,
                            const comm_config *cfg)
{
    for (int polls = 0;;) {
        int settled;
        comm_err err = nccl_poll(g, what, &settled);
        if (err != COMM_OK || settled) return err;
        if (comm_is_aborted(&g->base) || (cfg && cfg->cancelled && cfg->cancelled(cfg->cancel_ctx)))
            return nccl_fail(g, COMM_ERR_ABORTED, what, ncclInProgress);
        if (mono_now_ms() >= deadline) return nccl_fail(g, COMM_ERR_TIMEOUT, what, ncclInProgress);
        pause_briefly(&polls);
    }
}

/* After a call on the communicator: its result, then (ncclInProgress) the
 * wait until NCCL has queued its work. On a non-blocking communicator NCCL
 * 2.28 answers every collective with ncclInProgress and queues the kernel
 * later from its own thread: until the communicator says ncclSuccess
 * nothing may be queued on its stream (it would run first) and no other
 * call may be made on it. */
static comm_err nccl_queued(nccl_comm *g, const char *what, ncclResult_t r, int64_t deadline)
{
    if (r != ncclSuccess && r != ncclInProgress) return nccl_fail(g, nccl_kind(r), what, r);
    return nccl_settle(g, what, deadline, NULL);
}

/* After enqueuing a collective: its call's result, then the stream. */
static comm_err nccl_finish(nccl_comm *g, const char *what, ncclResult_t r)
{
    int64_t deadline = mono_now_ms() + g->timeout_ms;
    if (r != ncclSuccess && r != ncclInProgress) return nccl_fail(g, nccl_kind(r), what, r);
    comm_err err = nccl_settle(g, what, deadline, NULL);
    if (err != COMM_OK) return err;
    for (int polls = 0;;) {
        cudaError_t e = cudaStreamQuery(g->stream);
        if (e == cudaSuccess) return COMM_OK;
        if (e != cudaErrorNotReady) return cuda_fail(g, what, e);
        int settled;
        err = nccl_poll(g, what, &settled);
        if (err != COMM_OK) return err;
        if (comm_is_aborted(&g->base)) return nccl_fail(g, COMM_ERR_ABORTED, what, ncclSuccess);
        if (mono_now_ms() >= deadline) return nccl_fail(g, COMM_ERR_TIMEOUT, what, ncclSuccess);
        pause_briefly(&polls);
    }
}

static comm_err nccl_enter(nccl_comm *g)
{
    cudaError_t e = cudaSetDevice(g->device);
    if (e != cudaSuccess) return cuda_fail(g, "cudaSetDevice", e);
    return COMM_OK;
}

/* 1 when p is memory NCCL can take (device or managed). */
static int on_device(const void *p)
{
    struct cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError(); /* pageable memory on older runtimes: not sticky */
        return 0;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

/* Copies a staged chunk between the bounce buffers on the comm's stream. */
static comm_err stage_copy(nccl_comm *g, int to_device, size_t off, size_t bytes)
{
    cudaError_t e = to_device ? cudaMemcpyAsync(g->dev_stage + off, g->host_stage + off, bytes,
                                                cudaMemcpyHostToDevice, g->stream)
                              : cudaMemcpyAsync(g->host_stage + off, g->dev_stage + off, bytes,
                                                cudaMemcpyDeviceToHost, g->stream);
    if (e != cudaSuccess)
        return cuda_fail(g,
                         to_device ? "staging host memory: cudaMemcpyAsync to the device"
                                   : "staging host memory: cudaMemcpyAsync to the host",
                         e);
    return COMM_OK;
}

static comm_err nccl_allreduce(comm *c, float *buf, size_t n)
{
    nccl_comm *g = (nccl_comm *)c;
    comm_err err = nccl_enter(g);
    if (err != COMM_OK) return err;
    if (on_device(buf)) {
        ncclResult_t r = ncclAllReduce(buf, buf, n, ncclFloat, ncclSum, g->nc, g->stream);
        return nccl_finish(g, "ncclAllReduce", r);
    }
    size_t per = NCCL_STAGE_BYTES / sizeof(float);
    for (size_t off = 0; off < n && err == COMM_OK; off += per) {
        size_t k = n - off < per ? n - off : per;
        memcpy(g->host_stage, buf + off, k * sizeof(float));
        if ((err = stage_copy(g, 1, 0, k * sizeof(float))) != COMM_OK) break;
        ncclResult_t r =
            ncclAllReduce(g->dev_stage, g->dev_stage, k, ncclFloat, ncclSum, g->nc, g->stream);
        if ((err = nccl_queued(g, "ncclAllReduce (staged)", r, mono_now_ms() + g->timeout_ms)) !=
                COMM_OK ||
            (err = stage_copy(g, 0, 0, k * sizeof(float))) != COMM_OK ||
            (err = nccl_finish(g, "ncclAllReduce (staged)", ncclSuccess)) != COMM_OK)
            break;
        memcpy(buf + off, g->host_stage, k * sizeof(float));
    }
    return err;
}

static comm_err nccl_broadcast(comm *c, void *buf, size_t bytes, int root)
{
    nccl_comm *g = (nccl_comm *)c;
    comm_err err = nccl_enter(g);
    if (err != COMM_OK) return err;
    if (on_device(buf)) {
        ncclResult_t r = ncclBroadcast(buf, buf, bytes, ncclUint8, root, g->nc, g->stream);
        return nccl_finish(g, "ncclBroadcast", r);
    }
    int sender = g->base.rank == root;
    for (size_t off = 0; off < bytes && err == COMM_OK; off += NCCL_STAGE_BYTES) {
        size_t k = bytes - off < NCCL_STAGE_BYTES ? bytes - off : NCCL_STAGE_BYTES;
        if (sender) {
            memcpy(g->host_stage, (char *)buf + off, k);
            if ((err = stage_copy(g, 1, 0, k)) != COMM_OK) break;
        }
        ncclResult_t r =
            ncclBroadcast(g->dev_stage, g->dev_stage, k, ncclUint8, root, g->nc, g->stream);
        err = nccl_queued(g, "ncclBroadcast (staged)", r, mono_now_ms() + g->timeout_ms);
        if (err != COMM_OK) break;
        if (!sender && (err = stage_copy(g, 0, 0, k)) != COMM_OK) break;
        if ((err = nccl_finish(g, "ncclBroadcast (staged)", ncclSuccess)) != COMM_OK) break;
        if (!sender) memcpy((char *)buf + off, g->host_stage, k);
    }
    return err;
}

static comm_err nccl_allgather(comm *c, const void *send, size_t bytes, void *recv)
{
    nccl_comm *g = (nccl_comm *)c;
    comm_err err = nccl_enter(g);
    if (err != COMM_OK) return err;
    int sdev = on_device(send), rdev = on_device(recv);
    if (sdev && rdev) {
        ncclResult_t r = ncclAllGather(send, recv, bytes, ncclUint8, g->nc, g->stream);
        return nccl_finish(g, "ncclAllGather", r);
    }
    if (sdev || rdev)
        return comm_fail(c, COMM_ERR_ARG,
                         "rank %d: allgather: send and recv must both be host "
                         "or both device memory",
                         c->rank);
    /* Chunks of `per` bytes from every rank, gathered in place in the stage. */
    size_t world = (size_t)c->world_size, per = NCCL_STAGE_BYTES / world;
    size_t mine = (size_t)c->rank;
    for (size_t off = 0; off < bytes && err == COMM_OK; off += per) {
        size_t k = bytes - off < per ? bytes - off : per;
        memcpy(g->host_stage + mine * k, (const char *)send + off, k);
        if ((err = stage_copy(g, 1, mine * k, k)) != COMM_OK) break;
        ncclResult_t r =
            ncclAllGather(g->dev_stage + mine * k, g->dev_stage, k, ncclUint8, g->nc, g->stream);
        if ((err = nccl_queued(g, "ncclAllGather (staged)", r, mono_now_ms() + g->timeout_ms)) !=
                COMM_OK ||
            (err = stage_copy(g, 0, 0, world * k)) != COMM_OK ||
            (err = nccl_finish(g, "ncclAllGather (staged)", ncclSuccess)) != COMM_OK)
            break;
        for (size_t i = 0; i < world; i++)
            memcpy((char *)recv + i * bytes + off, g->host_stage + i * k, k);
    }
    return err;
}

static comm_err nccl_barrier(comm *c)
{
    nccl_comm *g = (nccl_comm *)c;
    comm_err err = nccl_enter(g);
    if (err != COMM_OK) return err;
    ncclResult_t r = ncclAllReduce(g->dev_one, g->dev_one, 1, ncclFloat, ncclSum, g->nc, g->stream);
    return nccl_finish(g, "barrier", r);
}

/* The next collective's stream waits for the caller's event on the device. */
static comm_err nccl_wait_event(comm *c, void *event)
{
    nccl_comm *g = (nccl_comm *)c;
    comm_err err = nccl_enter(g);
    if (err != COMM_OK) return err;
    cudaError_t e = cudaStreamWaitEvent(g->stream, (cudaEvent_t)event, 0);
    if (e != cudaSuccess) return cuda_fail(g, "cudaStreamWaitEvent", e);
    return COMM_OK;
}

/* A bucket's all-reduce, queued behind the ones before it on the comm's
 * stream: the call, then only the wait until NCCL has queued it (so the
 * next bucket's event wait may follow), not for its result. */
static comm_err nccl_allreduce_start(comm *c, float *buf, size_t n)
{
    nccl_comm *g = (nccl_comm *)c;
    comm_err err = nccl_enter(g);
    if (err != COMM_OK) return err;
    if (!on_device(buf))
        return comm_fail(c, COMM_ERR_ARG, "rank %d: a started all-reduce takes device memory",
                         c->rank);
    ncclResult_t r = ncclAllReduce(buf, buf, n, ncclFloat, ncclSum, g->nc, g->stream);
    return nccl_queued(g, "ncclAllReduce", r, mono_now_ms() + g->timeout_ms);
}

/* Every started all-reduce done: the stream, polled (see nccl_finish). */
static comm_err nccl_wait(comm *c)
{
    nccl_comm *g = (nccl_comm *)c;
    comm_err err = nccl_enter(g);
    if (err != COMM_OK) return err;
    return nccl_finish(g, "ncclAllReduce (the step's buckets)", ncclSuccess);
}

/* The flag is already set (comm.c); the polling thread does the aborting. */
static void nccl_abort(comm *c)
{
    (void)c;
}

/* A clean end: finalize (ncclInProgress on a non-blocking comm, then
 * settled), destroy; anything else aborts. Teardown errors change nothing
 * for the caller: the comm is gone either way, so they are not reported. */
static void nccl_destroy(comm *c)
{
    nccl_comm *g = (nccl_comm *)c;
    if (g->nc) {
        (void)cudaSetDevice(g->device);
        int clean = !g->broken && g->base.dead == COMM_OK && !comm_is_aborted(&g->base);
        if (clean) {
            ncclResult_t r = ncclCommFinalize(g->nc);
            clean = r == ncclSuccess || r == ncclInProgress;
        }
        if (clean) {
            int64_t deadline = mono_now_ms() + g->timeout_ms;
            ncclResult_t st = ncclInProgress;
            int polls = 0;
            while (ncclCommGetAsyncError(g->nc, &st) == ncclSuccess && st == ncclInProgress &&
                   mono_now_ms() < deadline)
                pause_briefly(&polls);
            clean = st == ncclSuccess;
        }
        if (clean)
            (void)ncclCommDestroy(g->nc);
        else
            (void)ncclCommAbort(g->nc);
    }
    if (g->stream) (void)cudaStreamSynchronize(g->stream); /* nothing of ours left queued */
    if (g->dev_one) (void)cudaFree(g->dev_one);
    if (g->dev_stage) (void)cudaFree(g->dev_stage);
    if (g->host_stage) (void)cudaFreeHost(g->host_stage);
    if (g->stream) (void)cudaStreamDestroy(g->stream);
    free(g);
}

static const comm_ops nccl_ops = {.name = "nccl",
                                  .allreduce_sum_f32 = nccl_allreduce,
                                  .broadcast = nccl_broadcast,
                                  .allgather = nccl_allgather,
                                  .barrier = nccl_barrier,
                                  .wait_event = nccl_wait_event,
                                  .allreduce_start = nccl_allreduce_start,
                                  .wait = nccl_wait,
                                  .abort = nccl_abort,
                                  .destroy = nccl_destroy};

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
    if (e != RDZV_OK) return comm_store_error(&g->base, cfg->store, e, "waiting for the NCCL id");
    const char *why = comm_choose_refused(val, len);
    if (why) {
        comm_err err = comm_fail(&g->base, COMM_ERR_ARG, "%.*s",
                                 (int)(len - (size_t)(why - (const char *)val)), why);
        free(val);
        return err;
    }
    int bad = hex_decode(val, len, (unsigned char *)id->internal, sizeof(id->internal));
    free(val);
    if (bad) return comm_fail(&g->base, COMM_ERR_STORE, "malformed NCCL id in the store");
    return COMM_OK;
}

/* The stream and the buffers a comm owns; CUDA says which call failed. */
static comm_err nccl_alloc(nccl_comm *g)
{
    cudaError_t e;
    const char *what;
    float one = 1.0f;
    if ((e = cudaSetDevice(g->device)) != cudaSuccess) {
        what = "cudaSetDevice";
    } else if ((e = cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        g->stream = NULL;
        what = "cudaStreamCreateWithFlags";
    } else if ((e = cudaMalloc((void **)&g->dev_one, sizeof(float))) != cudaSuccess) {
        g->dev_one = NULL;
        what = "cudaMalloc (barrier)";
    } else if ((e = cudaMalloc((void **)&g->dev_stage, NCCL_STAGE_BYTES)) != cudaSuccess) {
        g->dev_stage = NULL;
        what = "cudaMalloc (staging)";
    } else if ((e = cudaMallocHost((void **)&g->host_stage, NCCL_STAGE_BYTES)) != cudaSuccess) {
        g->host_stage = NULL;
        what = "cudaMallocHost (staging)";
    } else if ((e = cudaMemcpy(g->dev_one, &one, sizeof(one), cudaMemcpyHostToDevice)) !=
               cudaSuccess) {
        what = "cudaMemcpy (barrier)";
    } else {
        return COMM_OK;
    }
    return cuda_fail(g, what, e);
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
    g->failed_here = cfg->failed_here;
    g->failed_ctx = cfg->failed_ctx;

    ncclUniqueId id;
    comm_err err = nccl_alloc(g);
    /* Every rank must be on CUDA: a CPU rank never joins the NCCL
     * bootstrap, so the round is refused (comm_choose.c). */
    if (err == COMM_OK && cfg->world_size > 1) err = comm_choose_nccl(&g->base, cfg);
    if (err == COMM_OK) err = nccl_share_id(g, cfg, &id); /* its own deadline */
    if (err != COMM_OK) goto err;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    /* The init's deadline starts once the id is here: a slow id wait must
     * not eat the time the peers need to connect. */
    int64_t deadline = mono_now_ms() + g->timeout_ms;
    ncclResult_t r = ncclCommInitRankConfig(&g->nc, cfg->world_size, id, cfg->rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
        err = nccl_fail(g, nccl_kind(r), "ncclCommInitRankConfig", r);
        goto err;
    }
    err = nccl_settle(g, "ncclCommInitRankConfig", deadline, cfg);
    if (err != COMM_OK) goto err;
    *out = &g->base;
    return COMM_OK;
err:
    comm_init_failed(cfg, err, g->base.last_error);
    g->broken = 1;
    nccl_destroy(&g->base);
    return err;
}
