/* rt_cuda.c: the CUDA runtime of the host test runtime (see rt.h).
 *
 * Memory is host memory the runtime remembers: every cudaMalloc and
 * cudaMallocHost block is in a registry with its kind, so a pointer handed
 * to an API can be checked, and each block keeps the recent accesses of
 * queued ops for the race check. Device memory starts as NaN bytes (0xff),
 * so a read of memory nothing wrote shows up in the numbers.
 *
 * Streams are queues that run lazily (rt_pump, under the one lock): only a
 * synchronize, a query, or a wait that reaches another stream runs work.
 * Happens-before is a vector clock per stream plus one for the host; an
 * event carries its stream's clock at the record, a wait joins it, a
 * completed host wait joins the stream's clock into the host's, and every
 * op queued by the host starts after what the host has seen. Two accesses
 * to one byte range from different streams, one of them a write, with
 * neither clock covering the other, are a race: reported at the enqueue of
 * the second, whatever the order the lazy queues would run them in.
 *
 * Knowingly simple: the registry is a list searched linearly (a model has
 * tens of blocks), and a block remembers its last RT_MAX_RECORDS accesses
 * (older ones are forgotten, so a race with a long-gone access can go
 * unreported, never reported falsely).
 */
#include "rt.h"

#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ductile/clock.h"
#include "ductile/failpoint.h"

#define RT_MAX_STREAMS 128    /* stream ids alive at once, the legacy stream's 0 included */
#define RT_MAX_RECORDS 96     /* remembered accesses per block */
#define RT_WAIT_NS 20000      /* sleep between polls of a blocking wait */
#define RT_FREE_WAIT_MS 60000 /* cudaFree's wait for the device, before it is called a hang */

typedef struct {
    uint64_t c[RT_MAX_STREAMS];
} vclock;

typedef struct {
    int stream;     /* stream id */
    uint64_t clock; /* the stream's clock at that op */
    size_t lo, hi;  /* byte offsets in the block */
    int write;
    const char *name;
} record;

typedef struct block {
    char *base;
    size_t bytes;
    rt_mem kind;
    int device; /* device memory: the device current at cudaMalloc */
    int nrec;
    record rec[RT_MAX_RECORDS];
    struct block *next;
} block;

struct CUstream_st {
    int id;
    int device; /* current at its creation */
    unsigned flags;
    int destroyed;
    int pumping; /* rt_pump is on the stack for this stream */
    rt_op *head, *tail;
    uint64_t enq, done;  /* ops queued and completed, in seq order */
    int held;            /* NCCL calls on it not yet launched (rt_stream_hold) */
    const char *held_by; /* the latest of them */
    vclock vc;
    struct CUstream_st *next_all;
};

struct CUevent_st {
    int device; /* current at its creation */
    unsigned flags;
    int recorded;
    cudaStream_t stream;
    uint64_t seq; /* complete once stream->done reaches it */
    vclock vc;
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static block *blocks;
static struct CUstream_st legacy = {.id = 0};
static struct CUstream_st *all_streams = &legacy; /* every stream ever made: reachable */
static uint64_t id_clock[RT_MAX_STREAMS];         /* never reset, so a reused id stays monotonic */
static int id_used[RT_MAX_STREAMS] = {1};
static vclock host_vc;
static cudaError_t sticky = cudaSuccess;
static __thread cudaError_t last_error = cudaSuccess;
static __thread int current_device;
static __thread int launcher;  /* rt_set_launcher */
static atomic_long host_syncs; /* rt_host_syncs: a test-only counter, like the failpoint table */

long rt_host_syncs(void)
{
    return atomic_load(&host_syncs);
}

static void syncs_write(void)
{
    const char *path = getenv("DUCTILE_GPURT_SYNCS");
    FILE *f = path && *path ? fopen(path, "we") : NULL;
    if (!f) return;
    fprintf(f, "syncs %ld\n", rt_host_syncs());
    fclose(f);
}

__attribute__((constructor)) static void syncs_at_exit(void)
{
    const char *path = getenv("DUCTILE_GPURT_SYNCS");
    if (path && *path) atexit(syncs_write);
}

static void host_synced(void)
{
    atomic_fetch_add(&host_syncs, 1);
}

void rt_lock(void)
{
    pthread_mutex_lock(&mu);
}

void rt_unlock(void)
{
    pthread_mutex_unlock(&mu);
}

void rt_die(const char *fmt, ...)
{
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    fprintf(stderr, "gpurt: %s\n", line);
    fflush(stderr);
    abort();
}

static void pause_briefly(void)
{
    struct timespec ts = {0, RT_WAIT_NS};
    nanosleep(&ts, NULL);
}

/* Remembers a failed call's error for cudaGetLastError; returns it. */
static cudaError_t ret(cudaError_t e)
{
    if (e != cudaSuccess) last_error = e;
    return e;
}

static pthread_mutex_t armed_mu = PTHREAD_MUTEX_INITIALIZER;
static char armed[64];        /* rt_fail_next's call name, "" when none */
static char armed_action[32]; /* and its action */

void rt_fail_next(const char *spec)
{
    pthread_mutex_lock(&armed_mu);
    const char *colon = strchr(spec, ':');
    snprintf(armed, sizeof(armed), "%.*s", colon ? (int)(colon - spec) : (int)strlen(spec), spec);
    snprintf(armed_action, sizeof(armed_action), "%s", colon ? colon + 1 : "error");
    pthread_mutex_unlock(&armed_mu);
}

const char *rt_call(const char *family, const char *name)
{
    static __thread char fired[32];
    pthread_mutex_lock(&armed_mu);
    int fire = armed[0] && strcmp(armed, name) == 0;
    if (fire) {
        armed[0] = '\0';
        memcpy(fired, armed_action, sizeof(fired));
    }
    pthread_mutex_unlock(&armed_mu);
    if (fire) return fired;
    char full[128];
    snprintf(full, sizeof(full), "gpurt.%s", family);
    const char *any = failpoint(full);
    snprintf(full, sizeof(full), "gpurt.%s.%s", family, name);
    const char *one = failpoint(full);
    return one ? one : any;
}

static int is_action(const char *a, const char *want)
{
    return a && strncmp(a, want, strlen(want)) == 0;
}

/* ---- devices ---- */

/* The machine has DUCTILE_GPURT_DEVICES GPUs; this process sees those
 * CUDA_VISIBLE_DEVICES lists, renumbered from 0, as CUDA does (an entry
 * that is not a device there ends the list, as CUDA's parsing does). */
static int visible[64], nvisible = -1;
static pthread_once_t devices_once = PTHREAD_ONCE_INIT;

static void devices_load(void)
{
    const char *v = getenv("DUCTILE_GPURT_DEVICES");
    long x = 0;
    if (v && *v) {
        char *end;
        errno = 0;
        x = strtol(v, &end, 10);
        if (errno || *end || x < 0 || x > 64)
            rt_die("DUCTILE_GPURT_DEVICES='%s' is not a device count in 0..64", v);
    }
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    nvisible = 0;
    if (!cvd) {
        for (int i = 0; i < x; i++)
            visible[nvisible++] = i;
        return;
    }
    for (const char *p = cvd; *p && nvisible < 64;) {
        char *end;
        long d = strtol(p, &end, 10);
        if (end == p || d < 0 || d >= x) break;
        visible[nvisible++] = (int)d;
        p = *end == ',' ? end + 1 : end;
        if (*end != ',') break;
    }
}

int rt_device_count(void)
{
    pthread_once(&devices_once, devices_load);
    return nvisible;
}

int rt_device_physical(int device)
{
    return device >= 0 && device < rt_device_count() ? visible[device] : -1;
}

/* ---- memory ---- */

static block *find_block(const void *p)
{
    const char *c = p;
    for (block *b = blocks; b; b = b->next)
        if (c >= b->base && c < b->base + b->bytes) return b;
    return NULL;
}

int rt_stream_device(cudaStream_t s)
{
    return s && s != &legacy ? s->device : current_device;
}

int rt_mem_device(const void *p)
{
    rt_lock();
    block *b = find_block(p);
    int d = b && b->kind == RT_MEM_DEVICE ? b->device : -1;
    rt_unlock();
    return d;
}

static const char *kind_name(rt_mem k)
{
    return k == RT_MEM_DEVICE   ? "device memory (cudaMalloc)"
           : k == RT_MEM_PINNED ? "pinned host memory (cudaMallocHost)"
                                : "pageable host memory";
}

rt_mem rt_mem_kind(const char *call, const char *arg, const void *p, size_t bytes)
{
    rt_lock();
    block *b = find_block(p);
    rt_mem k = b ? b->kind : RT_MEM_UNKNOWN;
    size_t off = b ? (size_t)((const char *)p - b->base) : 0;
    size_t size = b ? b->bytes : 0;
    rt_unlock();
    if (b && bytes > size - off)
        rt_die("%s: %s=%p (%zu bytes) runs %zu bytes past the end of its %zu-byte %s block", call,
               arg, p, bytes, bytes - (size - off), size, kind_name(k));
    return k;
}

void rt_need(const char *call, const char *arg, const void *p, size_t bytes, unsigned need)
{
    if (bytes == 0) return;
    if (!p) rt_die("%s: %s is NULL (%zu bytes)", call, arg, bytes);
    rt_mem k = rt_mem_kind(call, arg, p, bytes);
    if (need & (1u << k)) return;
    rt_die("%s: %s=%p (%zu bytes) is %s; %s needs %s", call, arg, p, bytes, kind_name(k), call,
           need == RT_NEED_DEVICE ? "device memory" : "host memory");
}

static cudaError_t alloc_block(void **p, size_t bytes, rt_mem kind, const char *call)
{
    if (!p) return ret(cudaErrorInvalidValue);
    const char *a = rt_call("cuda", call);
    if (sticky) return ret(sticky);
    if (is_action(a, "error")) return ret(cudaErrorMemoryAllocation);
    size_t size = bytes ? bytes : 1;
    block *b = calloc(1, sizeof(*b));
    char *mem = b ? aligned_alloc(256, (size + 255) / 256 * 256) : NULL;
    if (!mem) {
        free(b);
        return ret(cudaErrorMemoryAllocation);
    }
    /* Device memory is not zeroed: NaN bytes make a read of unwritten memory show. */
    memset(mem, kind == RT_MEM_DEVICE ? 0xff : 0, size);
    b->base = mem;
    b->bytes = size;
    b->kind = kind;
    b->device = current_device;
    rt_lock();
    b->next = blocks;
    blocks = b;
    rt_unlock();
    *p = mem;
    return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t bytes)
{
    return alloc_block(p, bytes, RT_MEM_DEVICE, "cudaMalloc");
}

cudaError_t cudaMallocHost(void **p, size_t bytes)
{
    return alloc_block(p, bytes, RT_MEM_PINNED, "cudaMallocHost");
}

/* Under mu: the first queued op of any stream that touches b, or NULL. */
static rt_op *queued_user(const block *b, cudaStream_t *on)
{
    for (cudaStream_t s = all_streams; s; s = s->next_all)
        for (rt_op *op = s->head; op; op = op->next)
            for (int i = 0; i < op->naccess; i++) {
                const char *p = op->access[i].p;
                if (p < b->base + b->bytes && p + op->access[i].bytes > b->base) {
                    *on = s;
                    return op;
                }
            }
    return NULL;
}

static cudaStream_t device_busy(void);

static cudaError_t free_block(void *p, rt_mem kind, const char *call)
{
    if (!p) return cudaSuccess;
    rt_call("cuda", call);
    rt_lock();
    block **pp = &blocks;
    while (*pp && (*pp)->base != p)
        pp = &(*pp)->next;
    block *b = *pp;
    if (!b || b->kind != kind) {
        int inside = b || find_block(p);
        rt_unlock();
        if (inside) rt_die("%s(%p): not the start of a %s block", call, p, kind_name(kind));
        return ret(cudaErrorInvalidValue);
    }
    /* Queued work that still uses the block is reported, not run: CUDA's
     * free waits for the device, but code that frees before it waits for
     * the stream is one reorder away from freeing under a kernel (and a
     * hung op or a collective whose peers never come would block it). */
    cudaStream_t on = NULL;
    rt_op *user = sticky ? NULL : queued_user(b, &on); /* a poisoned context runs nothing more */
    if (user)
        rt_die("%s(%p): %s queued on stream %d still uses this memory", call, p, user->name,
               on->id);
    /* CUDA's free waits for the whole device first (a kernel of another
     * stream, a spinning collective included): so does this one, and a
     * wait that would never end on a GPU is reported, not waited out. */
    int64_t until = mono_now_ms() + RT_FREE_WAIT_MS;
    for (;;) {
        cudaStream_t busy = device_busy();
        if (!busy) break;
        if (mono_now_ms() >= until) {
            const char *what = busy->head ? busy->head->name : "work";
            int id = busy->id;
            rt_unlock();
            rt_die("%s(%p): waited %d s for the device, where %s on stream %d never completes: "
                   "on a GPU this free blocks for good",
                   call, p, RT_FREE_WAIT_MS / 1000, what, id);
        }
        rt_unlock();
        pause_briefly();
        rt_lock();
    }
    pp = &blocks; /* the list may have changed while unlocked */
    while (*pp && (*pp)->base != p)
        pp = &(*pp)->next;
    if (*pp != b) {
        rt_unlock();
        rt_die("%s(%p): freed twice at once", call, p);
    }
    host_synced();
    *pp = b->next;
    cudaError_t e = sticky; /* a poisoned context frees (nothing leaks here) but says so */
    rt_unlock();
    free(b->base);
    free(b);
    return ret(e);
}

cudaError_t cudaFree(void *p)
{
    return free_block(p, RT_MEM_DEVICE, "cudaFree");
}

cudaError_t cudaFreeHost(void *p)
{
    return free_block(p, RT_MEM_PINNED, "cudaFreeHost");
}

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p)
{
    if (!a) return ret(cudaErrorInvalidValue);
    if (sticky) return ret(sticky);
    rt_lock();
    block *b = find_block(p);
    rt_mem k = b ? b->kind : RT_MEM_UNKNOWN;
    int bdev = b ? b->device : -1;
    rt_unlock();
    memset(a, 0, sizeof(*a));
    a->type = k == RT_MEM_DEVICE   ? cudaMemoryTypeDevice
              : k == RT_MEM_PINNED ? cudaMemoryTypeHost
                                   : cudaMemoryTypeUnregistered;
    a->device = k == RT_MEM_DEVICE ? bdev : k == RT_MEM_UNKNOWN ? -2 : current_device;
    a->devicePointer = k == RT_MEM_DEVICE ? (void *)p : NULL;
    a->hostPointer = k != RT_MEM_DEVICE ? (void *)p : NULL;
    return cudaSuccess;
}

/* ---- happens-before ---- */

static void vc_join(vclock *into, const vclock *from)
{
    for (int i = 0; i < RT_MAX_STREAMS; i++)
        if (from->c[i] > into->c[i]) into->c[i] = from->c[i];
}

/* Under mu: drops records every stream and the host are already past. */
static void prune(block *b)
{
    int k = 0;
    for (int i = 0; i < b->nrec; i++) {
        record *r = &b->rec[i];
        int seen = host_vc.c[r->stream] >= r->clock;
        for (cudaStream_t s = all_streams; s && seen; s = s->next_all)
            if (!s->destroyed && s->vc.c[r->stream] < r->clock) seen = 0;
        if (!seen) b->rec[k++] = *r;
    }
    b->nrec = k;
}

/* Under mu: the race check of one access of op on s, then its record. */
static void track(cudaStream_t s, const rt_op *op, const void *p, size_t bytes, int write)
{
    block *b = find_block(p);
    if (!b || bytes == 0) return;
    size_t lo = (size_t)((const char *)p - b->base), hi = lo + bytes;
    for (int i = 0; i < b->nrec; i++) {
        record *r = &b->rec[i];
        if (r->stream == s->id || r->hi <= lo || r->lo >= hi || !(r->write || write)) continue;
        if (r->clock > s->vc.c[r->stream])
            rt_die("race: %s on stream %d %s bytes [%zu, %zu) of %s block %p that %s on stream %d "
                   "%s, with no event wait or host sync between them",
                   op->name, s->id, write ? "writes" : "reads", lo, hi, kind_name(b->kind),
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

/* Under mu: appends op to s with its clock tick; checks its accesses. */
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

/* Under mu: s waits for other's work queued so far (and sees its writes). */
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

/* Under mu: the legacy stream orders itself with every blocking stream. */
static void implicit_sync(cudaStream_t s)
{
    if (s == &legacy) {
        for (cudaStream_t b = all_streams; b; b = b->next_all)
            if (b != &legacy && !b->destroyed && !(b->flags & cudaStreamNonBlocking))
                append_wait(s, b, b->enq, &b->vc, "legacy stream barrier");
    } else if (!(s->flags & cudaStreamNonBlocking)) {
        append_wait(s, &legacy, legacy.enq, &legacy.vc, "legacy stream barrier");
    }
}

void rt_set_launcher(int on)
{
    launcher = on;
}

void rt_stream_hold(cudaStream_t s, int delta, const char *what)
{
    cudaStream_t st = s ? s : &legacy;
    rt_lock();
    st->held += delta;
    if (st->held < 0) rt_die("stream %d: released more NCCL holds than it had", st->id);
    if (delta > 0) st->held_by = what;
    rt_unlock();
}

/* Under mu: work the host queues on a stream whose NCCL call has not been
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

/* Under mu: a kernel runs on its stream's device, which must be the
 * caller's current one (CUDA: the launch fails), and touches only that
 * device's memory (without peer access, an illegal address). */
static cudaError_t check_device(cudaStream_t st, const rt_op *op)
{
    if (!op->kernel || launcher) return cudaSuccess;
    int dev = st == &legacy ? current_device : st->device;
    if (dev != current_device) return cudaErrorInvalidResourceHandle;
    for (int i = 0; i < op->naccess; i++) {
        block *b = find_block(op->access[i].p);
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
    cudaStream_t st = s ? s : &legacy;
    rt_lock();
    check_held(st, op->name);
    cudaError_t de = check_device(st, op);
    if (de != cudaSuccess) {
        rt_unlock();
        drop_op(op);
        return ret(de);
    }
    if (sticky) {
        cudaError_t e = sticky;
        rt_unlock();
        drop_op(op);
        return ret(e);
    }
    if (st->destroyed) rt_die("%s: stream %d was destroyed", op->name, st->id);
    op->hang = is_action(action, "hang");
    op->fails = is_action(action, "async");
    implicit_sync(st);
    append(st, op);
    rt_unlock();
    return cudaSuccess;
}

int rt_pump(cudaStream_t s)
{
    cudaStream_t st = s ? s : &legacy;
    if (st->pumping) return st->head == NULL;
    st->pumping = 1;
    while (st->head && !sticky) {
        rt_op *op = st->head;
        if (op->hang || op->run(op) == RT_PENDING) break;
        if (op->fails) sticky = cudaErrorLaunchFailure;
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
    return sticky;
}

/* Pumps s once; when it is empty the host has seen all of it. Under mu. */
static int settle(cudaStream_t s)
{
    if (!rt_pump(s)) return 0;
    vc_join(&host_vc, &s->vc);
    return 1;
}

void rt_wait_stream(cudaStream_t s)
{
    cudaStream_t st = s ? s : &legacy;
    for (;;) {
        rt_lock();
        int done = settle(st) || sticky;
        rt_unlock();
        if (done) return;
        pause_briefly();
    }
}

static cudaError_t stream_create(cudaStream_t *out, unsigned flags, const char *call)
{
    if (!out) return ret(cudaErrorInvalidValue);
    const char *a = rt_call("cuda", call);
    if (sticky) return ret(sticky);
    if (is_action(a, "error")) return ret(cudaErrorMemoryAllocation);
    rt_lock();
    int id = 1;
    while (id < RT_MAX_STREAMS && id_used[id])
        id++;
    if (id == RT_MAX_STREAMS) rt_die("%s: more than %d streams alive", call, RT_MAX_STREAMS - 1);
    /* A destroyed stream's struct is kept (events may name it); reuse one. */
    cudaStream_t s = NULL;
    for (cudaStream_t t = all_streams; t; t = t->next_all)
        if (t->destroyed) {
            s = t;
            break;
        }
    if (!s) {
        s = calloc(1, sizeof(*s));
        if (!s) rt_die("out of memory");
        s->next_all = all_streams->next_all;
        all_streams->next_all = s;
    }
    cudaStream_t keep = s->next_all;
    memset(s, 0, sizeof(*s));
    s->next_all = keep;
    s->id = id;
    s->device = current_device;
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
    if (!s || s == &legacy) return ret(cudaErrorInvalidResourceHandle);
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
    cudaError_t e = sticky;
    rt_unlock();
    return ret(e);
}

static cudaError_t check_stream(cudaStream_t s)
{
    if (s && s->destroyed) rt_die("stream %d used after cudaStreamDestroy", s->id);
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
    const char *a = rt_call("cuda", "cudaStreamSynchronize");
    check_stream(s);
    if (is_action(a, "error")) return ret(cudaErrorLaunchFailure);
    host_synced();
    rt_wait_stream(s);
    return ret(sticky);
}

cudaError_t cudaStreamQuery(cudaStream_t s)
{
    const char *a = rt_call("cuda", "cudaStreamQuery");
    check_stream(s);
    if (is_action(a, "error")) return ret(cudaErrorLaunchFailure);
    rt_lock();
    int done = settle(s ? s : &legacy);
    cudaError_t e = sticky ? sticky : done ? cudaSuccess : cudaErrorNotReady;
    rt_unlock();
    return e == cudaErrorNotReady ? e : ret(e);
}

/* Under mu: runs every live stream as far as it goes; the first one that
 * still has work, or NULL when the device is idle (or poisoned: nothing
 * runs any more). */
static cudaStream_t device_busy(void)
{
    cudaStream_t busy = NULL;
    for (cudaStream_t s = all_streams; s && !sticky; s = s->next_all)
        if (!s->destroyed && !settle(s) && !busy) busy = s;
    return busy;
}

cudaError_t cudaDeviceSynchronize(void)
{
    rt_call("cuda", "cudaDeviceSynchronize");
    host_synced();
    for (;;) {
        rt_lock();
        int done = device_busy() == NULL;
        rt_unlock();
        if (done) return ret(sticky);
        pause_briefly();
    }
}

/* ---- events ---- */

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags)
{
    if (!e) return ret(cudaErrorInvalidValue);
    const char *a = rt_call("cuda", "cudaEventCreate");
    if (sticky) return ret(sticky);
    if (is_action(a, "error")) return ret(cudaErrorMemoryAllocation);
    *e = calloc(1, sizeof(**e));
    if (!*e) return ret(cudaErrorMemoryAllocation);
    (*e)->flags = flags;
    (*e)->device = current_device;
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *e)
{
    return cudaEventCreateWithFlags(e, cudaEventDefault);
}

cudaError_t cudaEventDestroy(cudaEvent_t e)
{
    if (!e) return ret(cudaErrorInvalidResourceHandle);
    free(e);
    return ret(sticky);
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s)
{
    if (!e) return ret(cudaErrorInvalidResourceHandle);
    const char *a = rt_call("cuda", "cudaEventRecord");
    check_stream(s);
    if (sticky) return ret(sticky);
    if (is_action(a, "error")) return ret(cudaErrorLaunchFailure);
    cudaStream_t st = s ? s : &legacy;
    /* An event records only on a stream of its own device. */
    if (st != &legacy && st->device != e->device) return ret(cudaErrorInvalidResourceHandle);
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

/* Under mu: pumps the event's stream; 1 when the event has happened. */
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
    if (!e) return ret(cudaErrorInvalidResourceHandle);
    const char *a = rt_call("cuda", "cudaEventQuery");
    if (is_action(a, "error")) return ret(cudaErrorLaunchFailure);
    rt_lock();
    int done = event_done(e);
    cudaError_t err = sticky ? sticky : done ? cudaSuccess : cudaErrorNotReady;
    rt_unlock();
    return err == cudaErrorNotReady ? err : ret(err);
}

cudaError_t cudaEventSynchronize(cudaEvent_t e)
{
    if (!e) return ret(cudaErrorInvalidResourceHandle);
    const char *a = rt_call("cuda", "cudaEventSynchronize");
    if (is_action(a, "error")) return ret(cudaErrorLaunchFailure);
    host_synced();
    for (;;) {
        rt_lock();
        int done = event_done(e) || sticky;
        rt_unlock();
        if (done) return ret(sticky);
        pause_briefly();
    }
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags)
{
    (void)flags;
    if (!e) return ret(cudaErrorInvalidResourceHandle);
    const char *a = rt_call("cuda", "cudaStreamWaitEvent");
    check_stream(s);
    if (sticky) return ret(sticky);
    if (is_action(a, "error")) return ret(cudaErrorLaunchFailure);
    if (!e->recorded) return cudaSuccess; /* as CUDA: nothing to wait for */
    cudaStream_t st = s ? s : &legacy;
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
        return ret(cudaErrorInvalidResourceHandle);
    *ms = 0.0f; /* no clock on this device: correctness, not speed */
    return cudaSuccess;
}

/* ---- copies ---- */

typedef struct {
    rt_op op;
    void *dst;
    const void *src;
    size_t bytes;
    int value;    /* memset: the byte; -1 for a copy */
    void *staged; /* a pageable source copied at the call, as CUDA does */
} copy_op;

static rt_state run_copy(rt_op *op)
{
    copy_op *c = (copy_op *)op;
    if (c->value >= 0)
        memset(c->dst, c->value, c->bytes);
    else
        memmove(c->dst, c->staged ? c->staged : c->src, c->bytes);
    return RT_DONE;
}

static void drop_copy(rt_op *op)
{
    free(((copy_op *)op)->staged);
    free(op);
}

/* A copy of bytes from src to dst (value -1), or a memset of dst to value;
 * its accesses declared. NULL when out of memory. */
static copy_op *copy_op_new(const char *call, void *dst, const void *src, size_t bytes, int value)
{
    copy_op *c = calloc(1, sizeof(*c));
    if (!c) return NULL;
    c->op.name = call;
    c->op.run = run_copy;
    c->op.drop = drop_copy;
    c->dst = dst;
    c->src = src;
    c->bytes = bytes;
    c->value = value;
    if (src) rt_op_access(&c->op, src, bytes, 0);
    rt_op_access(&c->op, dst, bytes, 1);
    return c;
}

static const char *kind_word(enum cudaMemcpyKind k)
{
    static const char *w[] = {"cudaMemcpyHostToHost", "cudaMemcpyHostToDevice",
                              "cudaMemcpyDeviceToHost", "cudaMemcpyDeviceToDevice",
                              "cudaMemcpyDefault"};
    return (unsigned)k <= cudaMemcpyDefault ? w[k] : "an unknown kind";
}

static cudaError_t copy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind,
                        cudaStream_t s, int sync, const char *call)
{
    const char *a = rt_call("cuda", call);
    check_stream(s);
    if (sticky) return ret(sticky);
    if (is_action(a, "error")) return ret(cudaErrorInvalidValue);
    if ((unsigned)kind > cudaMemcpyDefault) return ret(cudaErrorInvalidValue);
    if (bytes == 0) return cudaSuccess;
    if (!dst || !src) rt_die("%s: %s pointer is NULL", call, dst ? "src" : "dst");
    rt_mem dk = rt_mem_kind(call, "dst", dst, bytes), sk = rt_mem_kind(call, "src", src, bytes);
    int d_dev = dk == RT_MEM_DEVICE, s_dev = sk == RT_MEM_DEVICE;
    if (kind != cudaMemcpyDefault) {
        int want_d = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
        int want_s = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
        if (d_dev != want_d)
            rt_die("%s: dst=%p is %s but the kind is %s", call, dst, kind_name(dk),
                   kind_word(kind));
        if (s_dev != want_s)
            rt_die("%s: src=%p is %s but the kind is %s", call, src, kind_name(sk),
                   kind_word(kind));
    }
    copy_op *c = copy_op_new(call, dst, src, bytes, -1);
    if (!c) return ret(cudaErrorMemoryAllocation);
    /* Pageable memory: CUDA copies the source before returning, and a copy
     * into pageable memory is done when the call returns. */
    if (sk == RT_MEM_UNKNOWN && d_dev) {
        if (!(c->staged = malloc(bytes))) {
            free(c);
            return ret(cudaErrorMemoryAllocation);
        }
        memcpy(c->staged, src, bytes);
    }
    if (dk == RT_MEM_UNKNOWN && s_dev) sync = 1;
    cudaError_t e = rt_enqueue(s, &c->op, a);
    if (e != cudaSuccess) return e;
    if (sync) {
        host_synced();
        rt_wait_stream(s);
    }
    return ret(sticky);
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind)
{
    return copy(dst, src, bytes, kind, NULL, 1, "cudaMemcpy");
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind,
                            cudaStream_t s)
{
    return copy(dst, src, bytes, kind, s, 0, "cudaMemcpyAsync");
}

static cudaError_t set(void *p, int value, size_t bytes, cudaStream_t s, int sync, const char *call)
{
    const char *a = rt_call("cuda", call);
    check_stream(s);
    if (sticky) return ret(sticky);
    if (is_action(a, "error")) return ret(cudaErrorInvalidValue);
    if (bytes == 0) return cudaSuccess;
    rt_need(call, "devPtr", p, bytes, RT_NEED_DEVICE);
    copy_op *c = copy_op_new(call, p, NULL, bytes, value & 0xff);
    if (!c) return ret(cudaErrorMemoryAllocation);
    cudaError_t e = rt_enqueue(s, &c->op, a);
    if (e != cudaSuccess) return e;
    if (sync) {
        host_synced();
        rt_wait_stream(s);
    }
    return ret(sticky);
}

cudaError_t cudaMemset(void *p, int value, size_t bytes)
{
    return set(p, value, bytes, NULL, 1, "cudaMemset");
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s)
{
    return set(p, value, bytes, s, 0, "cudaMemsetAsync");
}

/* ---- devices and errors ---- */

cudaError_t cudaGetDeviceCount(int *count)
{
    if (!count) return ret(cudaErrorInvalidValue);
    const char *a = rt_call("cuda", "cudaGetDeviceCount");
    if (sticky) return ret(sticky);
    *count = is_action(a, "error") ? 0 : rt_device_count();
    return *count ? cudaSuccess : ret(cudaErrorNoDevice);
}

cudaError_t cudaSetDevice(int device)
{
    const char *a = rt_call("cuda", "cudaSetDevice");
    if (sticky) return ret(sticky);
    if (is_action(a, "error")) return ret(cudaErrorInitializationError);
    if (device < 0 || device >= rt_device_count()) return ret(cudaErrorInvalidDevice);
    current_device = device;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device)
{
    if (!device) return ret(cudaErrorInvalidValue);
    *device = current_device;
    return ret(sticky);
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int device)
{
    if (!p || device < 0 || device >= rt_device_count()) return ret(cudaErrorInvalidDevice);
    memset(p, 0, sizeof(*p));
    snprintf(p->name, sizeof(p->name), "ductile host test runtime %d", rt_device_physical(device));
    p->totalGlobalMem = (size_t)1 << 30;
    p->multiProcessorCount = 1;
    p->major = 9;
    p->pciBusID = rt_device_physical(device);
    return cudaSuccess;
}

cudaError_t cudaGetLastError(void)
{
    cudaError_t e = sticky ? sticky : last_error;
    last_error = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError(void)
{
    return sticky ? sticky : last_error;
}

const char *cudaGetErrorName(cudaError_t e)
{
    switch (e) {
    case cudaSuccess:
        return "cudaSuccess";
    case cudaErrorInvalidValue:
        return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
        return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError:
        return "cudaErrorInitializationError";
    case cudaErrorLaunchFailure:
        return "cudaErrorLaunchFailure";
    case cudaErrorNoDevice:
        return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice:
        return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle:
        return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady:
        return "cudaErrorNotReady";
    case cudaErrorIllegalAddress:
        return "cudaErrorIllegalAddress";
    case cudaErrorLaunchTimeout:
        return "cudaErrorLaunchTimeout";
    case cudaErrorUnknown:
        return "cudaErrorUnknown";
    }
    return "cudaErrorUnknown";
}

const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess:
        return "no error";
    case cudaErrorInvalidValue:
        return "invalid argument";
    case cudaErrorMemoryAllocation:
        return "out of memory";
    case cudaErrorInitializationError:
        return "initialization error";
    case cudaErrorLaunchFailure:
        return "unspecified launch failure";
    case cudaErrorNoDevice:
        return "no CUDA-capable device is detected (host test runtime: DUCTILE_GPURT_DEVICES=0)";
    case cudaErrorInvalidDevice:
        return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
        return "invalid resource handle";
    case cudaErrorNotReady:
        return "device not ready";
    case cudaErrorIllegalAddress:
        return "an illegal memory access was encountered";
    case cudaErrorLaunchTimeout:
        return "the launch timed out and was terminated";
    case cudaErrorUnknown:
        return "unknown error";
    }
    return "unknown error";
}
