/* rt_cuda_stream.c: the host runtime's CUDA streams and events (see rt.h, rt_cuda.h).
 *
 * Streams are queues of ops that run lazily, under the one lock: only a
 * synchronize, a query, or a wait that reaches another stream runs work.
 * Happens-before is a vector clock per stream and one for the host; each
 * op's accesses are checked at its enqueue against other streams' unordered
 * accesses, and a race aborts. Events carry their stream's clock.
 */
#include "rt_cuda.h"

struct CUstream_st rt_legacy = {.id = 0};
struct CUstream_st *rt_all_streams = &rt_legacy; /* every stream ever made: reachable */
static uint64_t id_clock[RT_MAX_STREAMS];        /* never reset, so a reused id stays monotonic */
static int id_used[RT_MAX_STREAMS] = {1};
static vclock host_vc;

static __thread int launcher; /* rt_set_launcher */

/* ---- happens-before ---- */

static void vc_join(vclock *into, const vclock *from)
{
    for (int i = 0; i < RT_MAX_STREAMS; i++)
        if (from->c[i] > into->c[i]) into->c[i] = from->c[i];
}

/* Under rt_mu: drops records every stream and the host are already past. */
static void prune(block *b)
{
    int k = 0;
    for (int i = 0; i < b->nrec; i++) {
        record *r = &b->rec[i];
        int seen = host_vc.c[r->stream] >= r->clock;
        for (cudaStream_t s = rt_all_streams; s && seen; s = s->next_all)
            if (!s->destroyed && s->vc.c[r->stream] < r->clock) seen = 0;
        if (!seen) b->rec[k++] = *r;
    }
    b->nrec = k;
}

/* Under rt_mu: the race check of one access of op on s, then its record. */
static void track(cudaStream_t s, const rt_op *op, const void *p, size_t bytes, int write)
{
    block *b = rt_find_block(p);
    if (!b || bytes == 0) return;
    size_t lo = (size_t)((const char *)p - b->base), hi = lo + bytes;
    for (int i = 0; i < b->nrec; i++) {
        record *r = &b->rec[i];
        if (r->stream == s->id || r->hi <= lo || r->lo >= hi || !(r->write || write)) continue;
        if (r->clock > s->vc.c[r->stream])
            rt_die("race: %s on stream %d %s bytes [%zu, %zu) of %s block %p that %s on stream %d "
                   "%s, with no event wait or host sync between them",
                   op->name, s->id, write ? "writes" : "reads", lo, hi, rt_kind_name(b->kind),
                   (void *)b->base, r->name, r->stream, r->write ? "wrote" : "read");
    }
    /* This access covers older ones of the same stream that it orders after. */
    int k = 0;
    for (int i = 0; i < b->nrec; i++) {
        record *r = &b->rec[i];
        int covered = r->stream == s->id && r->lo >= lo && r->hi <= hi && (write || !r->write);
        if (!covered) b->rec[k++] = *r;
    }
    b->nrec = k;
    if (b->nrec == RT_MAX_RECORDS) prune(b);
    if (b->nrec == RT_MAX_RECORDS) {
        memmove(b->rec, b->rec + 1, sizeof(record) * (RT_MAX_RECORDS - 1));
        b->nrec--;
    }
    b->rec[b->nrec++] = (record){s->id, s->vc.c[s->id], lo, hi, write, op->name};
}

/* ---- streams and ops ---- */

void rt_op_access(rt_op *op, const void *p, size_t bytes, int write)
{
    if (op->naccess == RT_MAX_ACCESS) rt_die("%s: more than %d accesses", op->name, RT_MAX_ACCESS);
    op->access[op->naccess].p = p;
    op->access[op->naccess].bytes = bytes;
    op->access[op->naccess].write = write;
    op->naccess++;
}

static void drop_op(rt_op *op)
{
    if (op->drop)
        op->drop(op);
    else
        free(op);
}

/* A stream waiting for another to reach a point (an event wait, the
 * legacy stream's implicit barrier). */
typedef struct {
    rt_op op;
    cudaStream_t other;
    uint64_t target;
} wait_op;

static rt_state run_wait(rt_op *op)
{
    wait_op *w = (wait_op *)op;
    if (w->other->done < w->target) rt_pump(w->other);
    return w->other->done >= w->target ? RT_DONE : RT_PENDING;
}

/* Under rt_mu: appends op to s with its clock tick; checks its accesses. */
static void append(cudaStream_t s, rt_op *op)
{
    vc_join(&s->vc, &host_vc);
    s->vc.c[s->id] = ++id_clock[s->id];
    for (int i = 0; i < op->naccess; i++)
        track(s, op, op->access[i].p, op->access[i].bytes, op->access[i].write);
    op->seq = ++s->enq;
    op->next = NULL;
    if (s->tail)
        s->tail->next = op;
    else
        s->head = op;
    s->tail = op;
}

/* Under rt_mu: s waits for other's work queued so far (and sees its writes). */
static void append_wait(cudaStream_t s, cudaStream_t other, uint64_t target, const vclock *vc,
                        const char *name)
{
    vc_join(&s->vc, vc);
    if (other->done >= target) return;
    wait_op *w = calloc(1, sizeof(*w));
    if (!w) rt_die("out of memory");
    w->op.name = name;
    w->op.run = run_wait;
    w->other = other;
    w->target = target;
    append(s, &w->op);
}

/* Under rt_mu: the legacy stream orders itself with every blocking stream. */
static void implicit_sync(cudaStream_t s)
{
    if (s == &rt_legacy) {
        for (cudaStream_t b = rt_all_streams; b; b = b->next_all)
            if (b != &rt_legacy && !b->destroyed && !(b->flags & cudaStreamNonBlocking))
                append_wait(s, b, b->enq, &b->vc, "legacy stream barrier");
    } else if (!(s->flags & cudaStreamNonBlocking)) {
        append_wait(s, &rt_legacy, rt_legacy.enq, &rt_legacy.vc, "legacy stream barrier");
    }
}

void rt_set_launcher(int on)
{
    launcher = on;
}

void rt_stream_hold(cudaStream_t s, int delta, const char *what)
{
    cudaStream_t st = s ? s : &rt_legacy;
    rt_lock();
    st->held += delta;
    if (st->held < 0) rt_die("stream %d: released more NCCL holds than it had", st->id);
    if (delta > 0) st->held_by = what;
    rt_unlock();
}

/* Under rt_mu: work the host queues on a stream whose NCCL call has not been
 * launched yet would run before that call (NCCL 2.28 queues a non-blocking
 * communicator's kernel from its own thread, after the call returned
 * ncclInProgress). */
static void check_held(cudaStream_t st, const char *name)
{
    if (st->held == 0 || launcher) return;
    rt_unlock();
    rt_die("race: %s queued on stream %d while %s on it has not settled: the communicator "
           "answered ncclInProgress and NCCL queues its kernel later from its own thread, so "
           "this would run first; wait until ncclCommGetAsyncError says ncclSuccess",
           name, st->id, st->held_by);
}

/* Under rt_mu: a kernel runs on its stream's device, which must be the
 * caller's current one (CUDA: the launch fails), and touches only that
 * device's memory (without peer access, an illegal address). */
static cudaError_t check_device(cudaStream_t st, const rt_op *op)
{
    if (!op->kernel || launcher) return cudaSuccess;
    int dev = st == &rt_legacy ? rt_current_device : st->device;
    if (dev != rt_current_device) return cudaErrorInvalidResourceHandle;
    for (int i = 0; i < op->naccess; i++) {
        block *b = rt_find_block(op->access[i].p);
        if (b && b->kind == RT_MEM_DEVICE && b->device != dev) {
            rt_unlock();
            rt_die("%s on device %d touches device %d's memory %p (no peer access: an illegal "
                   "address on a GPU)",
                   op->name, dev, b->device, op->access[i].p);
        }
    }
    return cudaSuccess;
}

cudaError_t rt_enqueue(cudaStream_t s, rt_op *op, const char *action)
{
    cudaStream_t st = s ? s : &rt_legacy;
    rt_lock();
    check_held(st, op->name);
    cudaError_t de = check_device(st, op);
    if (de != cudaSuccess) {
        rt_unlock();
        drop_op(op);
        return rt_ret(de);
    }
    if (rt_sticky_err) {
        cudaError_t e = rt_sticky_err;
        rt_unlock();
        drop_op(op);
        return rt_ret(e);
    }
    if (st->destroyed) rt_die("%s: stream %d was destroyed", op->name, st->id);
    op->hang = rt_is_action(action, "hang");
    op->fails = rt_is_action(action, "async");
    implicit_sync(st);
    append(st, op);
    rt_unlock();
    return cudaSuccess;
}

int rt_pump(cudaStream_t s)
{
    cudaStream_t st = s ? s : &rt_legacy;
    if (st->pumping) return st->head == NULL;
    st->pumping = 1;
    while (st->head && !rt_sticky_err) {
        rt_op *op = st->head;
        if (op->hang || op->run(op) == RT_PENDING) break;
        if (op->fails) rt_sticky_err = cudaErrorLaunchFailure;
        st->head = op->next;
        if (!st->head) st->tail = NULL;
        st->done = op->seq;
        drop_op(op);
    }
    st->pumping = 0;
    return st->head == NULL;
}

cudaError_t rt_sticky(void)
{
    return rt_sticky_err;
}

/* Pumps s once; when it is empty the host has seen all of it. Under rt_mu. */
static int settle(cudaStream_t s)
{
    if (!rt_pump(s)) return 0;
    vc_join(&host_vc, &s->vc);
    return 1;
}

void rt_wait_stream(cudaStream_t s)
{
    cudaStream_t st = s ? s : &rt_legacy;
    for (;;) {
        rt_lock();
        int done = settle(st) || rt_sticky_err;
        rt_unlock();
        if (done) return;
        rt_pause_briefly();
    }
}

static cudaError_t stream_create(cudaStream_t *out, unsigned flags, const char *call)
{
    if (!out) return rt_ret(cudaErrorInvalidValue);
    const char *a = rt_call("cuda", call);
    if (rt_sticky_err) return rt_ret(rt_sticky_err);
    if (rt_is_action(a, "error")) return rt_ret(cudaErrorMemoryAllocation);
    rt_lock();
    int id = 1;
    while (id < RT_MAX_STREAMS && id_used[id])
        id++;
    if (id == RT_MAX_STREAMS) rt_die("%s: more than %d streams alive", call, RT_MAX_STREAMS - 1);
    /* A destroyed stream's struct is kept (events may name it); reuse one. */
    cudaStream_t s = NULL;
    for (cudaStream_t t = rt_all_streams; t; t = t->next_all)
        if (t->destroyed) {
            s = t;
            break;
        }
    if (!s) {
        s = calloc(1, sizeof(*s));
        if (!s) rt_die("out of memory");
        s->next_all = rt_all_streams->next_all;
        rt_all_streams->next_all = s;
    }
    cudaStream_t keep = s->next_all;
    memset(s, 0, sizeof(*s));
    s->next_all = keep;
    s->id = id;
    s->device = rt_current_device;
    s->flags = flags;
    s->vc = host_vc;
    id_used[id] = 1;
    rt_unlock();
    *out = s;
    return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t *s)
{
    return stream_create(s, cudaStreamDefault, "cudaStreamCreate");
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags)
{
    return stream_create(s, flags, "cudaStreamCreateWithFlags");
}

/* CUDA lets a stream go with work queued (it finishes first); here what
 * can run, runs, and what cannot (a hung op, an aborted collective never
 * pumped) is dropped with the stream. Events recorded on it stay valid. */
cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    if (!s || s == &rt_legacy) return rt_ret(cudaErrorInvalidResourceHandle);
    rt_call("cuda", "cudaStreamDestroy");
    rt_lock();
    if (s->destroyed) rt_die("cudaStreamDestroy: stream %d destroyed twice", s->id);
    rt_pump(s);
    while (s->head) {
        rt_op *op = s->head;
        s->head = op->next;
        drop_op(op);
    }
    s->tail = NULL;
    s->done = s->enq;
    s->destroyed = 1;
    id_used[s->id] = 0;
    /* Events on it can be complete without a way to join its clock any more. */
    vc_join(&host_vc, &s->vc);
    /* Its records stay: the id's clock goes on, so they still order right. */
    cudaError_t e = rt_sticky_err;
    rt_unlock();
    return rt_ret(e);
}

cudaError_t rt_check_stream(cudaStream_t s)
{
    if (s && s->destroyed) rt_die("stream %d used after cudaStreamDestroy", s->id);
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
    const char *a = rt_call("cuda", "cudaStreamSynchronize");
    rt_check_stream(s);
    if (rt_is_action(a, "error")) return rt_ret(cudaErrorLaunchFailure);
    rt_host_synced();
    rt_wait_stream(s);
    return rt_ret(rt_sticky_err);
}

cudaError_t cudaStreamQuery(cudaStream_t s)
{
    const char *a = rt_call("cuda", "cudaStreamQuery");
    rt_check_stream(s);
    if (rt_is_action(a, "error")) return rt_ret(cudaErrorLaunchFailure);
    rt_lock();
    int done = settle(s ? s : &rt_legacy);
    cudaError_t e = rt_sticky_err ? rt_sticky_err : done ? cudaSuccess : cudaErrorNotReady;
    rt_unlock();
    return e == cudaErrorNotReady ? e : rt_ret(e);
}

/* Under rt_mu: runs every live stream as far as it goes; the first one that
 * still has work, or NULL when the device is idle (or poisoned: nothing
 * runs any more). */
cudaStream_t rt_device_busy(void)
{
    cudaStream_t busy = NULL;
    for (cudaStream_t s = rt_all_streams; s && !rt_sticky_err; s = s->next_all)
        if (!s->destroyed && !settle(s) && !busy) busy = s;
    return busy;
}

cudaError_t cudaDeviceSynchronize(void)
{
    rt_call("cuda", "cudaDeviceSynchronize");
    rt_host_synced();
    for (;;) {
        rt_lock();
        int done = rt_device_busy() == NULL;
        rt_unlock();
        if (done) return rt_ret(rt_sticky_err);
        rt_pause_briefly();
    }
}

/* ---- events ---- */

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags)
{
    if (!e) return rt_ret(cudaErrorInvalidValue);
    const char *a = rt_call("cuda", "cudaEventCreate");
    if (rt_sticky_err) return rt_ret(rt_sticky_err);
    if (rt_is_action(a, "error")) return rt_ret(cudaErrorMemoryAllocation);
    *e = calloc(1, sizeof(**e));
    if (!*e) return rt_ret(cudaErrorMemoryAllocation);
    (*e)->flags = flags;
    (*e)->device = rt_current_device;
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *e)
{
    return cudaEventCreateWithFlags(e, cudaEventDefault);
}

cudaError_t cudaEventDestroy(cudaEvent_t e)
{
    if (!e) return rt_ret(cudaErrorInvalidResourceHandle);
    free(e);
    return rt_ret(rt_sticky_err);
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s)
{
    if (!e) return rt_ret(cudaErrorInvalidResourceHandle);
    const char *a = rt_call("cuda", "cudaEventRecord");
    rt_check_stream(s);
    if (rt_sticky_err) return rt_ret(rt_sticky_err);
    if (rt_is_action(a, "error")) return rt_ret(cudaErrorLaunchFailure);
    cudaStream_t st = s ? s : &rt_legacy;
    /* An event records only on a stream of its own device. */
    if (st != &rt_legacy && st->device != e->device) return rt_ret(cudaErrorInvalidResourceHandle);
    rt_lock();
    check_held(st, "cudaEventRecord");
    vc_join(&st->vc, &host_vc);
    e->recorded = 1;
    e->stream = st;
    e->seq = st->enq;
    e->vc = st->vc;
    rt_unlock();
    return cudaSuccess;
}

/* Under rt_mu: pumps the event's stream; 1 when the event has happened. */
static int event_done(cudaEvent_t e)
{
    if (!e->recorded) return 1;
    if (e->stream->done < e->seq) rt_pump(e->stream);
    if (e->stream->done < e->seq) return 0;
    vc_join(&host_vc, &e->vc);
    return 1;
}

cudaError_t cudaEventQuery(cudaEvent_t e)
{
    if (!e) return rt_ret(cudaErrorInvalidResourceHandle);
    const char *a = rt_call("cuda", "cudaEventQuery");
    if (rt_is_action(a, "error")) return rt_ret(cudaErrorLaunchFailure);
    rt_lock();
    int done = event_done(e);
    cudaError_t err = rt_sticky_err ? rt_sticky_err : done ? cudaSuccess : cudaErrorNotReady;
    rt_unlock();
    return err == cudaErrorNotReady ? err : rt_ret(err);
}

cudaError_t cudaEventSynchronize(cudaEvent_t e)
{
    if (!e) return rt_ret(cudaErrorInvalidResourceHandle);
    const char *a = rt_call("cuda", "cudaEventSynchronize");
    if (rt_is_action(a, "error")) return rt_ret(cudaErrorLaunchFailure);
    rt_host_synced();
    for (;;) {
        rt_lock();
        int done = event_done(e) || rt_sticky_err;
        rt_unlock();
        if (done) return rt_ret(rt_sticky_err);
        rt_pause_briefly();
    }
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags)
{
    (void)flags;
    if (!e) return rt_ret(cudaErrorInvalidResourceHandle);
    const char *a = rt_call("cuda", "cudaStreamWaitEvent");
    rt_check_stream(s);
    if (rt_sticky_err) return rt_ret(rt_sticky_err);
    if (rt_is_action(a, "error")) return rt_ret(cudaErrorLaunchFailure);
    if (!e->recorded) return cudaSuccess; /* as CUDA: nothing to wait for */
    cudaStream_t st = s ? s : &rt_legacy;
    rt_lock();
    check_held(st, "cudaStreamWaitEvent");
    vc_join(&st->vc, &host_vc);
    append_wait(st, e->stream, e->seq, &e->vc, "cudaStreamWaitEvent");
    rt_unlock();
    return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end)
{
    if (!ms || !start || !end || (start->flags | end->flags) & cudaEventDisableTiming)
        return rt_ret(cudaErrorInvalidResourceHandle);
    *ms = 0.0f; /* no clock on this device: correctness, not speed */
    return cudaSuccess;
}
