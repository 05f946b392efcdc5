/* rt_nccl_coll.c: the NCCL calls that queue work (see rt_nccl.h).
 *
 * ncclAllReduce, ncclBroadcast, ncclAllGather, ncclReduceScatter, ncclSend
 * and ncclRecv take one path: the comm usable, the arguments in range in
 * NCCL's order, the buffers device memory of the comm's device, a sequence
 * number, then queued at once, held in this thread's open group until the
 * outermost ncclGroupEnd, or deferred to the launch thread for a
 * non-blocking comm (rt_nccl_launch.c).
 */
#include "rt_nccl.h"

/* ---- groups ---- */

/* This thread's open group: NCCL's group state is per thread. */
static _Thread_local struct nc_group {
    int depth;
    nc_pending *item;
    int n, cap;
} nc_grp;

static ncclResult_t nc_group_add(const nc_pending *it)
{
    if (nc_grp.n == nc_grp.cap) {
        int cap = nc_grp.cap ? 2 * nc_grp.cap : 8;
        nc_pending *v = realloc(nc_grp.item, (size_t)cap * sizeof(*v));
        if (!v) {
            nc_unref(it->work.sh);
            return nc_fail_here(ncclSystemError, "%s: out of memory", it->name);
        }
        nc_grp.item = v;
        nc_grp.cap = cap;
    }
    nc_grp.item[nc_grp.n++] = *it;
    return ncclSuccess;
}

/* Queues a group: one batch per stream, streams in order of first use. */
ncclResult_t nc_group_flush(nc_pending *it, int n)
{
    nc_pending *same = malloc((size_t)n * sizeof(*same));
    char *taken = calloc((size_t)n, 1);
    ncclResult_t r = ncclSuccess;
    if (n > 0 && (!same || !taken)) {
        for (int i = 0; i < n; i++)
            nc_unref(it[i].work.sh);
        r = nc_fail_here(ncclSystemError, "ncclGroupEnd: out of memory");
        n = 0;
    }
    for (int i = 0; i < n; i++) {
        if (taken[i]) continue;
        int k = 0;
        for (int j = i; j < n; j++) {
            if (taken[j] || it[j].stream != it[i].stream) continue;
            same[k++] = it[j];
            taken[j] = 1;
        }
        ncclResult_t e = nc_enqueue(same, k);
        if (r == ncclSuccess) r = e;
    }
    free(same);
    free(taken);
    return r;
}

ncclResult_t ncclGroupStart(void)
{
    nc_grp.depth++;
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void)
{
    if (nc_grp.depth == 0)
        return nc_fail_here(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
    if (--nc_grp.depth > 0) return ncclSuccess;
    int later = 0;
    for (int i = 0; i < nc_grp.n; i++)
        later |= nc_grp.item[i].nonblocking;
    ncclResult_t r =
        later ? nc_defer(nc_grp.item, nc_grp.n) : nc_group_flush(nc_grp.item, nc_grp.n);
    free(nc_grp.item);
    nc_grp = (struct nc_group){.depth = 0};
    return r;
}

/* ---- the calls that queue work ---- */

/* NCCL's "ensure ready": a comm with an async error answers with it; one
 * still initializing (or finalizing, for new work) cannot take calls. */
ncclResult_t nc_usable(ncclComm_t comm, const char *name, int for_work)
{
    if (!comm) return nc_fail_here(ncclInvalidArgument, "%s: comm is NULL", name);
    nc_shared *sh = comm->sh;
    char why[NC_REASON_MAX];
    pthread_mutex_lock(&sh->mu);
    ncclResult_t r = sh->error;
    int ready = sh->ready, fin = sh->finalize, unsettled = sh->job != NULL;
    memcpy(why, sh->reason, sizeof(why));
    pthread_mutex_unlock(&sh->mu);
    if (r != ncclSuccess) return nc_fail_here(r, "%s: the communicator has failed: %s", name, why);
    if (!ready) return nc_fail_here(ncclInvalidArgument, "%s: init still in progress", name);
    if (for_work && unsettled)
        return nc_fail_here(ncclInvalidArgument,
                            "%s: attempt to use communicator before the previous operation "
                            "returned ncclSuccess",
                            name);
    if (for_work && fin != NC_FIN_NONE)
        return nc_fail_here(ncclInvalidUsage, "%s: the communicator is finalizing", name);
    return ncclSuccess;
}

/* Arguments in range, in NCCL's order; pointers are checked after. */
static ncclResult_t nc_check_args(const char *name, ncclComm_t comm, const nc_work *w)
{
    int n = comm->sh->nranks;
    int reduces = w->kind == NC_ALLREDUCE || w->kind == NC_REDUCESCATTER;
    if ((int)w->type < 0 || w->type >= ncclNumTypes)
        return nc_fail_here(ncclInvalidArgument, "%s: invalid datatype %d", name, (int)w->type);
    if (reduces && ((int)w->op < 0 || w->op >= ncclAvg || !nc_types[w->type].reduce))
        return nc_fail_here(ncclInvalidArgument, "%s: op %d on datatype %d is not supported", name,
                            (int)w->op, (int)w->type);
    if (w->kind == NC_BROADCAST && (w->root < 0 || w->root >= n))
        return nc_fail_here(ncclInvalidArgument, "%s: root %d out of range", name, w->root);
    if ((w->kind == NC_SEND || w->kind == NC_RECV) && (w->peer < 0 || w->peer >= n))
        return nc_fail_here(ncclInvalidArgument, "%s: peer %d out of range", name, w->peer);
    if (w->count > SIZE_MAX / nc_types[w->type].size / (size_t)n)
        return nc_fail_here(ncclInvalidArgument, "%s: count %zu too large", name, w->count);
    return ncclSuccess;
}

/* Buffers: NULL is an argument error, host memory a crash (rt_need). */
static ncclResult_t nc_check_buffers(const char *name, ncclComm_t comm, const nc_work *w)
{
    size_t send, recv;
    nc_extent(w, comm->sh->rank, comm->sh->nranks, &send, &recv);
    if ((send && !w->send) || (recv && !w->recv))
        return nc_fail_here(ncclInvalidArgument, "%s: %s is NULL", name,
                            send && !w->send ? "sendbuff" : "recvbuff");
    rt_need(name, "sendbuff", w->send, send, RT_NEED_DEVICE);
    rt_need(name, "recvbuff", w->recv, recv, RT_NEED_DEVICE);
    int sd = send ? rt_mem_device(w->send) : comm->device, rd = recv ? rt_mem_device(w->recv) : sd;
    if (sd != comm->device || rd != comm->device)
        rt_die("%s: a buffer is device %d's memory, the communicator device %d's (an illegal "
               "address on a GPU)",
               name, sd != comm->device ? sd : rd, comm->device);
    return ncclSuccess;
}

static void nc_assign_seq(nc_work *w)
{
    nc_shared *sh = w->sh;
    pthread_mutex_lock(&sh->mu);
    if (w->kind == NC_SEND)
        w->seq = sh->peer[w->peer].sends++;
    else if (w->kind == NC_RECV)
        w->seq = sh->peer[w->peer].recvs++;
    else
        w->seq = sh->seq++;
    pthread_mutex_unlock(&sh->mu);
}

/* The common path of every collective and point-to-point call. */
static ncclResult_t nc_submit(const char *name, const char *action, ncclComm_t comm, cudaStream_t s,
                              nc_work w)
{
    ncclResult_t r = nc_usable(comm, name, 1);
    if (r == ncclSuccess && nc_action_is(action, "error"))
        r = nc_fail_here(ncclSystemError, "%s: failpoint error", name);
    if (r == ncclSuccess) r = nc_check_args(name, comm, &w);
    if (r == ncclSuccess) r = nc_check_buffers(name, comm, &w);
    if (r == ncclSuccess && rt_stream_device(s) != comm->device)
        r = nc_fail_here(ncclUnhandledCudaError,
                         "%s: the stream is device %d's, the communicator device %d's (the "
                         "kernel launch fails)",
                         name, rt_stream_device(s), comm->device);
    if (r != ncclSuccess || w.count == 0) return r;
    nc_shared *sh = comm->sh;
    w.sh = sh;
    nc_ref(sh);
    nc_assign_seq(&w);
    ncclResult_t async = nc_action_async(action, sh->peer_error);
    if (async != ncclSuccess) nc_fail(sh, async, "%s: failpoint %s", name, action);
    /* Only "hang" is the stream's business: rt_enqueue's "async" is CUDA's. */
    const char *hang = nc_action_is(action, "hang") ? action : NULL;
    nc_pending it = {
        .name = name, .action = hang, .stream = s, .nonblocking = !comm->blocking, .work = w};
    if (nc_grp.depth > 0) return nc_group_add(&it);
    if (!it.nonblocking) return nc_enqueue(&it, 1);
    /* An async failpoint: launched at once, so its op sits on the stream
     * and never completes, as a kernel of a failed comm spins. */
    if (async != ncclSuccess) {
        r = nc_enqueue(&it, 1);
        return r == ncclSuccess ? ncclInProgress : r;
    }
    return nc_defer(&it, 1);
}

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream)
{
    const char *action = rt_call("nccl", "ncclAllReduce");
    nc_work w = {.kind = NC_ALLREDUCE,
                 .type = datatype,
                 .op = op,
                 .send = sendbuff,
                 .recv = recvbuff,
                 .count = count};
    return nc_submit("ncclAllReduce", action, comm, stream, w);
}

ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream)
{
    const char *action = rt_call("nccl", "ncclBroadcast");
    nc_work w = {.kind = NC_BROADCAST,
                 .type = datatype,
                 .root = root,
                 .send = sendbuff,
                 .recv = recvbuff,
                 .count = count};
    return nc_submit("ncclBroadcast", action, comm, stream, w);
}

ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream)
{
    const char *action = rt_call("nccl", "ncclAllGather");
    nc_work w = {.kind = NC_ALLGATHER,
                 .type = datatype,
                 .send = sendbuff,
                 .recv = recvbuff,
                 .count = sendcount};
    return nc_submit("ncclAllGather", action, comm, stream, w);
}

ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream)
{
    const char *action = rt_call("nccl", "ncclReduceScatter");
    nc_work w = {.kind = NC_REDUCESCATTER,
                 .type = datatype,
                 .op = op,
                 .send = sendbuff,
                 .recv = recvbuff,
                 .count = recvcount};
    return nc_submit("ncclReduceScatter", action, comm, stream, w);
}

ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream)
{
    const char *action = rt_call("nccl", "ncclSend");
    nc_work w = {.kind = NC_SEND, .type = datatype, .peer = peer, .send = sendbuff, .count = count};
    return nc_submit("ncclSend", action, comm, stream, w);
}

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream)
{
    const char *action = rt_call("nccl", "ncclRecv");
    nc_work w = {.kind = NC_RECV, .type = datatype, .peer = peer, .recv = recvbuff, .count = count};
    return nc_submit("ncclRecv", action, comm, stream, w);
}
