/* rt_nccl_comm.c: the host runtime's NCCL communicator (see rt_nccl.h).
 *
 * A communicator is a handle (struct ncclComm) and the state it shares with
 * its thread and its queued ops (nc_shared, counted references): init makes
 * both and starts the thread (which bootstraps, rt_nccl_boot.c, then runs
 * the proxy, rt_nccl_proxy.c); finalize drains the comm's ops and says
 * goodbye to each peer; abort and destroy stop the thread and close the
 * sockets, while ops still queued keep the shared state until they see
 * `aborted`. The queries (count, device, rank, the async error) are here too.
 */
#include "rt_nccl.h"

void nc_wake_locked(nc_shared *sh)
{
    uint64_t one = 1;
    if (sh->wake < 0) return;
    ssize_t k = write(sh->wake, &one, sizeof(one));
    (void)k; /* a full counter wakes the proxy just as well */
}

int nc_stopping(nc_shared *sh)
{
    pthread_mutex_lock(&sh->mu);
    int stop = sh->stopping;
    pthread_mutex_unlock(&sh->mu);
    return stop;
}

static void nc_free_msgs(nc_msg *m)
{
    while (m) {
        nc_msg *next = m->next;
        free(m);
        m = next;
    }
}

static void nc_shared_free(nc_shared *sh)
{
    for (int p = 0; sh->peer && p < sh->nranks; p++) {
        nc_free_msgs(sh->peer[p].out);
        nc_free_msgs(sh->peer[p].in);
        free(sh->peer[p].rx);
    }
    free(sh->peer);
    free(sh->streams);
    pthread_cond_destroy(&sh->ready_cv);
    pthread_mutex_destroy(&sh->mu);
    free(sh);
}

void nc_ref(nc_shared *sh)
{
    atomic_fetch_add(&sh->refs, 1);
}

void nc_unref(nc_shared *sh)
{
    if (atomic_fetch_sub(&sh->refs, 1) == 1) nc_shared_free(sh);
}

static nc_shared *nc_shared_new(int rank, int nranks, const nc_id *id)
{
    nc_shared *sh = calloc(1, sizeof(*sh));
    if (!sh) return NULL;
    atomic_init(&sh->refs, 1);
    pthread_mutex_init(&sh->mu, NULL);
    pthread_cond_init(&sh->ready_cv, NULL); /* no timed waits: see nc_init_wait */
    sh->rank = rank;
    sh->nranks = nranks;
    sh->nonce = id->nonce;
    sh->root = (nc_where){.addr = id->addr, .port = id->port};
    sh->listen_fd = -1;
    sh->wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    sh->peer = calloc((size_t)nranks, sizeof(*sh->peer));
    if (sh->wake < 0 || !sh->peer) {
        if (sh->wake >= 0) close(sh->wake);
        nc_shared_free(sh);
        return NULL;
    }
    for (int p = 0; p < nranks; p++)
        sh->peer[p].fd = -1;
    return sh;
}

/* Closes every socket once the comm thread is gone; the frames stay until
 * the last reference. */
static void nc_close_all(nc_shared *sh)
{
    pthread_mutex_lock(&sh->mu);
    for (int p = 0; p < sh->nranks; p++) {
        if (sh->peer[p].fd >= 0) close(sh->peer[p].fd);
        sh->peer[p].fd = -1;
        sh->peer[p].closed = 1;
    }
    if (sh->listen_fd >= 0) close(sh->listen_fd);
    sh->listen_fd = -1;
    close(sh->wake);
    sh->wake = -1;
    pthread_mutex_unlock(&sh->mu);
}

/* ---- init ---- */

static ncclResult_t nc_init_check(const char *name, int nranks, const ncclUniqueId *uid, int rank,
                                  const ncclConfig_t *cfg, nc_id *id)
{
    if (nranks < 1 || nranks > NC_MAX_RANKS)
        return nc_fail_here(ncclInvalidArgument, "%s: nranks %d out of range", name, nranks);
    if (rank < 0 || rank >= nranks)
        return nc_fail_here(ncclInvalidArgument, "%s: rank %d of %d", name, rank, nranks);
    memcpy(id, uid->internal, sizeof(*id));
    if (memcmp(id->magic, nc_id_magic, sizeof(id->magic)) != 0)
        return nc_fail_here(ncclInvalidArgument, "%s: not an id from ncclGetUniqueId", name);
    if (cfg && cfg->magic != NC_CONFIG_MAGIC)
        return nc_fail_here(ncclInvalidArgument, "%s: config not made with NCCL_CONFIG_INITIALIZER",
                            name);
    return ncclSuccess;
}

/* Which host this process stands for, as NCCL's host hash: NCCL_HOSTID
 * when set (NCCL reads it too), else the host name and the parent's pid,
 * so the workers of one agent share a host and each agent is a host of its
 * own (on a real cluster, each agent is its own pod). FNV-1a. */
static uint64_t nc_host_hash(void)
{
    char name[320] = "";
    const char *id = getenv("NCCL_HOSTID");
    if (id && *id) {
        snprintf(name, sizeof(name), "%s", id);
    } else {
        char host[256] = "";
        gethostname(host, sizeof(host) - 1);
        snprintf(name, sizeof(name), "%s/%ld", host, (long)getppid());
    }
    uint64_t h = 1469598103934665603ull;
    for (const char *p = name; *p; p++)
        h = (h ^ (unsigned char)*p) * 1099511628211ull;
    return h;
}

/* Makes the comm (on `device`) and starts its thread. */
static ncclResult_t nc_comm_new(const char *name, const char *action, int nranks, int rank,
                                int device, const nc_id *id, ncclComm_t *out)
{
    nc_shared *sh = nc_shared_new(rank, nranks, id);
    ncclComm_t c = sh ? calloc(1, sizeof(*c)) : NULL;
    ncclResult_t r = ncclSuccess;
    if (!c) {
        r = nc_fail_here(ncclSystemError, "%s: out of memory", name);
        goto err;
    }
    c->sh = sh;
    c->device = device;
    sh->device = rt_device_physical(device); /* its bus id: what NCCL compares */
    sh->host = nc_host_hash();
    const char *lost = getenv("DUCTILE_GPURT_PEER_ERROR");
    sh->peer_error = lost && strcmp(lost, "system") == 0 ? ncclSystemError : ncclRemoteError;
    if (nc_env_addr(&sh->addr) != 0) {
        r = nc_fail_here(ncclInvalidUsage, "DUCTILE_GPURT_ADDR is not an IPv4 address");
        goto err;
    }
    ncclResult_t async = nc_action_async(action, sh->peer_error);
    sh->idle = nc_action_is(action, "hang") || async != ncclSuccess;
    if (async != ncclSuccess) nc_fail(sh, async, "%s: failpoint %s", name, action);
    int rc = pthread_create(&c->thread, NULL, nc_thread, sh);
    if (rc != 0) {
        r = nc_fail_here(ncclSystemError, "%s: pthread_create: %s", name, strerror(rc));
        goto err;
    }
    *out = c;
    return ncclSuccess;
err:
    if (sh) nc_unref(sh);
    free(c);
    return r;
}

static void nc_teardown(ncclComm_t comm);

/* A blocking init waits here, without a deadline: NCCL's has none, and a
 * missing peer is the caller's to time out (with a non-blocking comm). */
static ncclResult_t nc_init_wait(ncclComm_t c)
{
    nc_shared *sh = c->sh;
    pthread_mutex_lock(&sh->mu);
    while (!sh->ready && sh->error == ncclSuccess)
        pthread_cond_wait(&sh->ready_cv, &sh->mu);
    ncclResult_t r = sh->ready ? ncclSuccess : sh->error;
    if (r != ncclSuccess) nc_fail_here(r, "%s", sh->reason);
    pthread_mutex_unlock(&sh->mu);
    return r;
}

static ncclResult_t nc_init(const char *name, ncclComm_t *out, int nranks, ncclUniqueId uid,
                            int rank, const ncclConfig_t *cfg)
{
    const char *action = rt_call("nccl", name);
    if (!out) return nc_fail_here(ncclInvalidArgument, "%s: comm is NULL", name);
    *out = NULL;
    if (nc_action_is(action, "error"))
        return nc_fail_here(ncclSystemError, "%s: failpoint error", name);
    nc_id id;
    ncclResult_t r = nc_init_check(name, nranks, &uid, rank, cfg, &id);
    if (r != ncclSuccess) return r;
    int device = 0;
    cudaError_t ce = cudaGetDevice(&device);
    if (ce != cudaSuccess)
        return nc_fail_here(ncclUnhandledCudaError, "%s: cudaGetDevice: %s", name,
                            cudaGetErrorString(ce));
    ncclComm_t c = NULL;
    r = nc_comm_new(name, action, nranks, rank, device, &id, &c);
    if (r != ncclSuccess) return r;
    c->blocking = !cfg || cfg->blocking != 0; /* NCCL_CONFIG_UNDEF_INT: blocking */
    *out = c;
    /* An async failpoint: the call succeeds, the comm has failed. */
    if (!c->blocking || nc_action_async(action, c->sh->peer_error) != ncclSuccess)
        return c->blocking ? ncclSuccess : ncclInProgress;
    r = nc_init_wait(c);
    if (r != ncclSuccess) {
        nc_teardown(c);
        *out = NULL;
    }
    return r;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank)
{
    return nc_init("ncclCommInitRank", comm, nranks, commId, rank, NULL);
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t *config)
{
    return nc_init("ncclCommInitRankConfig", comm, nranks, commId, rank, config);
}

/* ---- state, finalize, teardown ---- */

static void nc_say_bye_locked(nc_shared *sh)
{
    nc_work w = {.sh = sh};
    for (int p = 0; p < sh->nranks; p++) {
        if (p == sh->rank || sh->peer[p].closed) continue;
        nc_msg *m = nc_frame(&w, NC_BYE, NULL, 0);
        if (!m) return nc_fail_locked(sh, ncclSystemError, "out of memory saying goodbye");
        nc_append_locked(&sh->peer[p], m);
    }
    nc_wake_locked(sh);
    sh->finalize = NC_FIN_BYE;
}

static int nc_flushed_locked(const nc_shared *sh)
{
    for (int p = 0; p < sh->nranks; p++)
        if (p != sh->rank && !sh->peer[p].closed && sh->peer[p].out) return 0;
    return 1;
}

/* Runs what it can of the streams holding this comm's ops. */
static void nc_pump(cudaStream_t *s, int n)
{
    rt_lock();
    for (int i = 0; i < n; i++)
        rt_pump(s[i]);
    rt_unlock();
}

/* One step of finalize: while the comm's ops are queued, make their
 * streams progress (nothing else would: the runtime is lazy); then a
 * goodbye to each peer; done once the goodbyes are on the wire. */
static ncclResult_t nc_finalize_step(nc_shared *sh)
{
    cudaStream_t *pump = NULL;
    int npump = 0;
    pthread_mutex_lock(&sh->mu);
    if (sh->finalize == NC_FIN_OPS && sh->nstreams == 0 && !sh->fin_hang) nc_say_bye_locked(sh);
    if (sh->finalize == NC_FIN_BYE && nc_flushed_locked(sh)) sh->finalize = NC_FIN_DONE;
    ncclResult_t r = sh->finalize == NC_FIN_DONE ? ncclSuccess
                     : sh->error != ncclSuccess  ? sh->error
                                                 : ncclInProgress;
    if (r == ncclInProgress && sh->finalize == NC_FIN_OPS && sh->nstreams > 0 &&
        (pump = malloc((size_t)sh->nstreams * sizeof(*pump))))
        for (npump = 0; npump < sh->nstreams; npump++)
            pump[npump] = sh->streams[npump].s;
    pthread_mutex_unlock(&sh->mu);
    if (pump) nc_pump(pump, npump);
    free(pump);
    return r;
}

static ncclResult_t nc_finalize_wait(nc_shared *sh)
{
    /* No deadline: NCCL's blocking finalize has none either. */
    struct timespec nap = {0, NC_FINALIZE_NAP_NS};
    ncclResult_t r;
    while ((r = nc_finalize_step(sh)) == ncclInProgress)
        nanosleep(&nap, NULL);
    return r;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm)
{
    const char *action = rt_call("nccl", "ncclCommFinalize");
    ncclResult_t r = nc_usable(comm, "ncclCommFinalize", 1);
    if (r == ncclSuccess && nc_action_is(action, "error"))
        r = nc_fail_here(ncclSystemError, "ncclCommFinalize: failpoint error");
    if (r != ncclSuccess) return r;
    nc_shared *sh = comm->sh;
    ncclResult_t async = nc_action_async(action, sh->peer_error);
    if (async != ncclSuccess) nc_fail(sh, async, "ncclCommFinalize: failpoint %s", action);
    pthread_mutex_lock(&sh->mu);
    sh->fin_hang = nc_action_is(action, "hang");
    sh->finalize = NC_FIN_OPS;
    pthread_mutex_unlock(&sh->mu);
    if (!comm->blocking) {
        nc_finalize_step(sh);
        return ncclInProgress;
    }
    return nc_finalize_wait(sh);
}

/* The process's teardowns, for rt_nccl_teardowns(): test-only counters,
 * like the failpoint table. */
static atomic_int nc_clean_teardowns, nc_aborted_teardowns;

void rt_nccl_teardowns(int *clean, int *aborted)
{
    *clean = atomic_load(&nc_clean_teardowns);
    *aborted = atomic_load(&nc_aborted_teardowns);
}

/* Stops the thread, closes the sockets, frees the handle. Ops still queued
 * hold the shared state; they see `aborted` and complete untouched. */
static void nc_teardown(ncclComm_t comm)
{
    nc_shared *sh = comm->sh;
    pthread_mutex_lock(&sh->mu);
    sh->stopping = 1;
    sh->aborted = 1;
    nc_wake_locked(sh);
    pthread_mutex_unlock(&sh->mu);
    nc_job_cancel(sh);
    pthread_join(comm->thread, NULL);
    nc_close_all(sh);
    free(comm);
    nc_unref(sh);
}

ncclResult_t ncclCommAbort(ncclComm_t comm)
{
    if (!comm) return ncclSuccess;
    atomic_fetch_add(&nc_aborted_teardowns, 1);
    nc_teardown(comm);
    return ncclSuccess;
}

/* Without ncclCommFinalize first, destroy finalizes (blocking, as NCCL
 * does); a comm that failed or never finished init is torn down as is, and
 * counts as aborted in rt_nccl_teardowns(). */
ncclResult_t ncclCommDestroy(ncclComm_t comm)
{
    if (!comm) return ncclSuccess;
    nc_shared *sh = comm->sh;
    pthread_mutex_lock(&sh->mu);
    int done = sh->finalize == NC_FIN_DONE;
    int can = !done && sh->ready && sh->error == ncclSuccess;
    if (can && sh->finalize == NC_FIN_NONE) sh->finalize = NC_FIN_OPS;
    pthread_mutex_unlock(&sh->mu);
    if (can) done = nc_finalize_wait(sh) == ncclSuccess;
    atomic_fetch_add(done ? &nc_clean_teardowns : &nc_aborted_teardowns, 1);
    nc_teardown(comm);
    return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError)
{
    if (!comm || !asyncError) return ncclInvalidArgument;
    nc_shared *sh = comm->sh;
    /* A poisoned CUDA context fails NCCL's kernels and proxy too. */
    if (rt_sticky() != cudaSuccess)
        nc_fail(sh, ncclUnhandledCudaError, "CUDA: %s", cudaGetErrorString(rt_sticky()));
    pthread_mutex_lock(&sh->mu);
    int fin = sh->finalize, unsettled = sh->job != NULL;
    ncclResult_t r = fin == NC_FIN_DONE         ? ncclSuccess
                     : sh->error != ncclSuccess ? sh->error
                     : !sh->ready || unsettled  ? ncclInProgress
                                                : ncclSuccess;
    pthread_mutex_unlock(&sh->mu);
    if (unsettled) nc_job_asked(sh);
    if (r == ncclSuccess && fin != NC_FIN_NONE && fin != NC_FIN_DONE) r = nc_finalize_step(sh);
    *asyncError = r;
    return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count)
{
    ncclResult_t r = count ? nc_usable(comm, "ncclCommCount", 0) : ncclInvalidArgument;
    if (r == ncclSuccess) *count = comm->sh->nranks;
    return r;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device)
{
    ncclResult_t r = device ? nc_usable(comm, "ncclCommCuDevice", 0) : ncclInvalidArgument;
    if (r == ncclSuccess) *device = comm->device;
    return r;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank)
{
    ncclResult_t r = rank ? nc_usable(comm, "ncclCommUserRank", 0) : ncclInvalidArgument;
    if (r == ncclSuccess) *rank = comm->sh->rank;
    return r;
}
