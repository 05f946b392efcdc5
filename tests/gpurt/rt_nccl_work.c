/* rt_nccl_work.c: a NCCL call's work as stream ops (see rt_nccl.h).
 *
 * The reductions (in rank order, so every rank gets the same bits), then a
 * call's work: its extent in the buffers, the frames it sends when it
 * reaches the head of its stream, and the poll that takes every peer's
 * frame and computes the result. Works queued by one call or one group on
 * one stream form a batch, started together when the first reaches the
 * head, so a group's sends and receives never wait for each other.
 */
#include "rt_nccl.h"

static const char *nc_kind_name(int kind)
{
    static const char *const names[] = {
        "?",        "ncclAllReduce", "ncclBroadcast", "ncclAllGather", "ncclReduceScatter",
        "ncclSend", "ncclRecv",      "goodbye"};
    return kind >= 1 && kind <= NC_BYE ? names[kind] : names[0];
}

/* ---- reductions ---- */

/* Signed sums and products are done in the unsigned type U: they wrap as
 * the GPU's do, and stay defined C (UBSan watches). */
#define NC_REDUCER(NAME, T, U)                                                                     \
    static void NAME(void *acc, const void *in, size_t n, ncclRedOp_t op)                          \
    {                                                                                              \
        T *a = acc;                                                                                \
        const T *b = in;                                                                           \
        for (size_t i = 0; i < n; i++) {                                                           \
            switch (op) {                                                                          \
            case ncclSum:                                                                          \
                a[i] = (T)((U)a[i] + (U)b[i]);                                                     \
                break;                                                                             \
            case ncclProd:                                                                         \
                a[i] = (T)((U)a[i] * (U)b[i]);                                                     \
                break;                                                                             \
            case ncclMax:                                                                          \
                a[i] = a[i] > b[i] ? a[i] : b[i];                                                  \
                break;                                                                             \
            default:                                                                               \
                a[i] = a[i] < b[i] ? a[i] : b[i];                                                  \
                break;                                                                             \
            }                                                                                      \
        }                                                                                          \
    }

NC_REDUCER(nc_reduce_i8, int8_t, uint8_t)
NC_REDUCER(nc_reduce_u8, uint8_t, uint32_t)
NC_REDUCER(nc_reduce_i32, int32_t, uint32_t)
NC_REDUCER(nc_reduce_u32, uint32_t, uint32_t)
NC_REDUCER(nc_reduce_i64, int64_t, uint64_t)
NC_REDUCER(nc_reduce_u64, uint64_t, uint64_t)
NC_REDUCER(nc_reduce_f32, float, float)
NC_REDUCER(nc_reduce_f64, double, double)

const nc_type_info nc_types[ncclNumTypes] = {
    [ncclInt8] = {1, nc_reduce_i8},     [ncclUint8] = {1, nc_reduce_u8},
    [ncclInt32] = {4, nc_reduce_i32},   [ncclUint32] = {4, nc_reduce_u32},
    [ncclInt64] = {8, nc_reduce_i64},   [ncclUint64] = {8, nc_reduce_u64},
    [ncclFloat16] = {2, NULL},          [ncclFloat32] = {4, nc_reduce_f32},
    [ncclFloat64] = {8, nc_reduce_f64}, [ncclBfloat16] = {2, NULL},
    [ncclFloat8e4m3] = {1, NULL},       [ncclFloat8e5m2] = {1, NULL},
};

/* ---- work: one call's parameters and progress ---- */

static size_t nc_bytes(const nc_work *w)
{
    return w->count * nc_types[w->type].size;
}

/* The bytes of the send and receive buffers the call touches. */
void nc_extent(const nc_work *w, int rank, int nranks, size_t *send, size_t *recv)
{
    size_t b = nc_bytes(w), all = b * (size_t)nranks;
    switch (w->kind) {
    case NC_ALLREDUCE:
        *send = b, *recv = b;
        return;
    case NC_BROADCAST:
        *send = rank == w->root ? b : 0, *recv = b;
        return;
    case NC_ALLGATHER:
        *send = b, *recv = all;
        return;
    case NC_REDUCESCATTER:
        *send = all, *recv = b;
        return;
    case NC_SEND:
        *send = b, *recv = 0;
        return;
    default:
        *send = 0, *recv = b;
        return;
    }
}

/* What of this rank's send buffer goes to rank `to`. */
static const void *nc_share(const nc_work *w, int to, size_t *bytes)
{
    size_t b = nc_bytes(w);
    *bytes = b;
    if (w->kind == NC_REDUCESCATTER) return (const char *)w->send + (size_t)to * b;
    if (w->kind == NC_BROADCAST && w->sh->rank != w->root) *bytes = 0;
    return w->send;
}

nc_msg *nc_frame(const nc_work *w, int kind, const void *data, size_t bytes)
{
    nc_msg *m = malloc(sizeof(*m) + bytes);
    if (!m) return NULL;
    m->next = NULL;
    m->h = (nc_hdr){.magic = NC_FRAME_MAGIC,
                    .kind = (uint32_t)kind,
                    .seq = w->seq,
                    .count = w->count,
                    .type = w->type,
                    .op = w->op,
                    .root = w->root,
                    .bytes = bytes};
    if (bytes) memcpy(m->data, data, bytes);
    return m;
}

void nc_append_locked(nc_peer *pe, nc_msg *m)
{
    if (pe->out_tail)
        pe->out_tail->next = m;
    else
        pe->out = m;
    pe->out_tail = m;
    pe->queued++;
}

/* Copies the frames this work sends (one per peer for a collective, one
 * for a send) and this rank's own share; 0, or -1 out of memory. */
static int nc_work_copy(nc_work *w, nc_msg **out)
{
    int me = w->sh->rank;
    size_t bytes;
    if (w->kind == NC_SEND) {
        const void *p = nc_share(w, w->peer, &bytes);
        return (out[w->peer] = nc_frame(w, NC_SEND, p, bytes)) ? 0 : -1;
    }
    for (int p = 0; p < w->sh->nranks; p++) {
        const void *src = nc_share(w, p, &bytes);
        if (p != me && !(out[p] = nc_frame(w, w->kind, src, bytes))) return -1;
        if (p == me && bytes && !(w->mine = malloc(bytes))) return -1;
        if (p == me && bytes) memcpy(w->mine, src, bytes);
    }
    w->got = calloc((size_t)w->sh->nranks, sizeof(*w->got));
    return w->got ? 0 : -1;
}

/* The start of a work, when its batch reaches the head of its stream:
 * snapshot the send data into frames and hand them to the proxy. A send to
 * this rank itself lands in its own inbox. */
static void nc_work_start(nc_work *w)
{
    nc_shared *sh = w->sh;
    if (w->skip || w->kind == NC_RECV) return;
    nc_msg **out = calloc((size_t)sh->nranks, sizeof(*out));
    if (!out || nc_work_copy(w, out) != 0) nc_fail(sh, ncclSystemError, "out of memory");
    pthread_mutex_lock(&sh->mu);
    for (int p = 0; out && p < sh->nranks; p++) {
        if (!out[p]) continue;
        if (sh->aborted || sh->error != ncclSuccess) {
            free(out[p]);
        } else if (p == sh->rank) {
            nc_peer *self = &sh->peer[p];
            if (self->in_tail)
                self->in_tail->next = out[p];
            else
                self->in = out[p];
            self->in_tail = out[p];
        } else {
            nc_append_locked(&sh->peer[p], out[p]);
            w->mark = sh->peer[p].queued;
        }
    }
    nc_wake_locked(sh);
    pthread_mutex_unlock(&sh->mu);
    free(out);
}

/* The first frame in p's inbox for w's sequence number (the collectives'
 * sequence, or the pair's sends'), unlinked when `unlink`; NULL if none. */
static nc_msg *nc_find_locked(nc_peer *pe, const nc_work *w, int unlink)
{
    int p2p = w->kind == NC_RECV;
    nc_msg *prev = NULL;
    for (nc_msg *m = pe->in; m; prev = m, m = m->next) {
        if ((m->h.kind == NC_SEND) != p2p || m->h.seq != w->seq) continue;
        if (!unlink) return m;
        if (prev)
            prev->next = m->next;
        else
            pe->in = m->next;
        if (pe->in_tail == m) pe->in_tail = prev;
        m->next = NULL;
        return m;
    }
    return NULL;
}

/* Peers issued the same collective for this sequence number, with the
 * same arguments, or the program is wrong: real NCCL would hang or mix
 * buffers, so this dies saying both sides. */
static void nc_check_match(const nc_work *w, int from, const nc_hdr *h)
{
    unsigned long long seq = (unsigned long long)w->seq;
    if ((int)h->kind != (int)w->kind)
        rt_die("%s #%llu on rank %d met %s on rank %d: every rank must call the same "
               "collectives in the same order",
               nc_kind_name(w->kind), seq, w->sh->rank, nc_kind_name((int)h->kind), from);
    if (h->count != w->count || h->type != (int32_t)w->type || h->op != (int32_t)w->op ||
        h->root != w->root)
        rt_die("%s #%llu: rank %d has count %zu, datatype %d, op %d, root %d; rank %d has "
               "count %llu, datatype %d, op %d, root %d",
               nc_kind_name(w->kind), seq, w->sh->rank, w->count, (int)w->type, (int)w->op, w->root,
               from, (unsigned long long)h->count, h->type, h->op, h->root);
}

/* Takes every peer's frame for w into w->got, or none while one is
 * missing; a frame that does not match dies at once. */
static int nc_take_all_locked(nc_work *w)
{
    nc_shared *sh = w->sh;
    int all = 1;
    for (int p = 0; p < sh->nranks; p++) {
        if (p == sh->rank) continue;
        nc_msg *m = nc_find_locked(&sh->peer[p], w, 0);
        if (m)
            nc_check_match(w, p, &m->h);
        else
            all = 0;
    }
    for (int p = 0; all && p < sh->nranks; p++)
        if (p != sh->rank) w->got[p] = nc_find_locked(&sh->peer[p], w, 1);
    return all;
}

static const unsigned char *nc_from(const nc_work *w, int r)
{
    return r == w->sh->rank ? w->mine : w->got[r]->data;
}

/* Every share is in: the result, reduced in rank order on every rank. */
static void nc_compute(nc_work *w)
{
    size_t b = nc_bytes(w);
    int n = w->sh->nranks;
    unsigned char *recv = w->recv;
    switch (w->kind) {
    case NC_ALLREDUCE:
    case NC_REDUCESCATTER:
        memcpy(recv, nc_from(w, 0), b);
        for (int r = 1; r < n; r++)
            nc_types[w->type].reduce(recv, nc_from(w, r), w->count, w->op);
        break;
    case NC_ALLGATHER:
        for (int r = 0; r < n; r++)
            memcpy(recv + (size_t)r * b, nc_from(w, r), b);
        break;
    default: /* NC_BROADCAST */
        memcpy(recv, nc_from(w, w->root), b);
        break;
    }
    for (int r = 0; r < n; r++) {
        free(w->got[r]);
        w->got[r] = NULL;
    }
}

static rt_state nc_recv_finish(nc_work *w, nc_msg *m)
{
    size_t b = nc_bytes(w);
    if (m->h.bytes != b)
        rt_die("ncclRecv #%llu on rank %d from rank %d: %zu bytes posted, %llu sent",
               (unsigned long long)w->seq, w->sh->rank, w->peer, b, (unsigned long long)m->h.bytes);
    memcpy(w->recv, m->data, b);
    free(m);
    return RT_DONE;
}

/* Asked at the head of the stream, under the runtime lock: done yet? An
 * aborted comm's work is done at once and untouched; one with an async
 * error never is (as a NCCL kernel spins until aborted). */
static rt_state nc_work_poll(nc_work *w)
{
    nc_shared *sh = w->sh;
    pthread_mutex_lock(&sh->mu);
    rt_state st = RT_PENDING;
    nc_msg *m = NULL;
    int ready = 0;
    if (sh->aborted)
        st = RT_DONE;
    else if (sh->error != ncclSuccess)
        st = RT_PENDING;
    else if (w->kind == NC_SEND)
        st = w->peer == sh->rank || sh->peer[w->peer].flushed >= w->mark ? RT_DONE : RT_PENDING;
    else if (w->kind == NC_RECV)
        m = nc_find_locked(&sh->peer[w->peer], w, 1);
    else
        ready = w->got && nc_take_all_locked(w);
    pthread_mutex_unlock(&sh->mu);
    if (m) return nc_recv_finish(w, m);
    if (ready) nc_compute(w);
    return ready ? RT_DONE : st;
}

/* ---- ops: works queued on streams, started together per batch ---- */

/* The works one stream received from one call, or from one group: the
 * first to reach the head starts them all, so a group's sends and
 * receives never wait for each other. */
typedef struct nc_batch {
    atomic_int refs; /* its ops */
    int started;     /* under the runtime lock */
    int n;
    nc_work work[];
} nc_batch;

typedef struct nc_op {
    rt_op base; /* first: the runtime's pointer is ours */
    nc_batch *batch;
    int index;
    cudaStream_t stream;
} nc_op;

/* Counts an op of sh on stream s (delta +1 or -1); 0, or -1 out of memory. */
static int nc_streams_note(nc_shared *sh, cudaStream_t s, int delta)
{
    pthread_mutex_lock(&sh->mu);
    int i = 0;
    while (i < sh->nstreams && sh->streams[i].s != s)
        i++;
    if (i == sh->nstreams && delta > 0) {
        nc_stream_use *v = realloc(sh->streams, (size_t)(i + 1) * sizeof(*v));
        if (!v) {
            pthread_mutex_unlock(&sh->mu);
            return -1;
        }
        sh->streams = v;
        sh->streams[sh->nstreams++] = (nc_stream_use){.s = s, .ops = 0};
    }
    if (i < sh->nstreams) sh->streams[i].ops += delta;
    if (i < sh->nstreams && sh->streams[i].ops <= 0) sh->streams[i] = sh->streams[--sh->nstreams];
    pthread_mutex_unlock(&sh->mu);
    return 0;
}

static void nc_work_release(nc_work *w)
{
    free(w->mine);
    for (int r = 0; w->got && r < w->sh->nranks; r++)
        free(w->got[r]);
    free(w->got);
    nc_unref(w->sh);
}

static void nc_batch_unref(nc_batch *b)
{
    if (atomic_fetch_sub(&b->refs, 1) != 1) return;
    for (int i = 0; i < b->n; i++)
        nc_work_release(&b->work[i]);
    free(b);
}

static rt_state nc_op_run(rt_op *base)
{
    nc_op *op = (nc_op *)base;
    nc_batch *b = op->batch;
    if (!b->started) {
        b->started = 1;
        for (int i = 0; i < b->n; i++)
            nc_work_start(&b->work[i]);
    }
    return nc_work_poll(&b->work[op->index]);
}

static void nc_op_drop(rt_op *base)
{
    nc_op *op = (nc_op *)base;
    nc_streams_note(op->batch->work[op->index].sh, op->stream, -1);
    nc_batch_unref(op->batch);
    free(op);
}

/* Work i of b will never be queued: its op is not made. */
static void nc_batch_skip(nc_batch *b, int i)
{
    rt_lock();
    b->work[i].skip = 1;
    rt_unlock();
    nc_batch_unref(b);
}

static ncclResult_t nc_enqueue_one(nc_batch *b, int i, const nc_pending *it)
{
    nc_work *w = &b->work[i];
    nc_op *op = calloc(1, sizeof(*op));
    if (!op || nc_streams_note(w->sh, it->stream, +1) != 0) {
        free(op);
        nc_batch_skip(b, i);
        return nc_fail_here(ncclSystemError, "%s: out of memory", it->name);
    }
    *op = (nc_op){.base = {.name = it->name, .run = nc_op_run, .drop = nc_op_drop},
                  .batch = b,
                  .index = i,
                  .stream = it->stream};
    size_t send, recv;
    nc_extent(w, w->sh->rank, w->sh->nranks, &send, &recv);
    if (send) rt_op_access(&op->base, w->send, send, 0);
    if (recv) rt_op_access(&op->base, w->recv, recv, 1);
    cudaError_t e = rt_enqueue(it->stream, &op->base, it->action); /* drops op on failure */
    if (e == cudaSuccess) return ncclSuccess;
    return nc_fail_here(ncclUnhandledCudaError, "%s: %s", it->name, cudaGetErrorString(e));
}

/* Queues n calls, all for one stream, in call order, as one batch. */
ncclResult_t nc_enqueue(nc_pending *items, int n)
{
    nc_batch *b = calloc(1, sizeof(*b) + (size_t)n * sizeof(nc_work));
    if (!b) {
        for (int i = 0; i < n; i++)
            nc_unref(items[i].work.sh);
        return nc_fail_here(ncclSystemError, "%s: out of memory", items[0].name);
    }
    atomic_init(&b->refs, n);
    b->n = n;
    for (int i = 0; i < n; i++)
        b->work[i] = items[i].work;
    ncclResult_t r = ncclSuccess;
    for (int i = 0; i < n; i++) {
        if (r == ncclSuccess)
            r = nc_enqueue_one(b, i, &items[i]);
        else
            nc_batch_skip(b, i);
    }
    return r;
}
