/* rt_cuda_mem.c: the host runtime's CUDA memory (see rt.h, rt_cuda.h).
 *
 * Every cudaMalloc and cudaMallocHost block is in a registry with its kind
 * and device, so a pointer handed to an API can be checked (rt_mem_kind,
 * rt_need); device memory starts as NaN bytes. cudaFree waits for the
 * device, as CUDA's does, and reports queued work that still uses the block.
 * The copies and memsets are stream ops like any other.
 */
#include "rt_cuda.h"

static block *blocks;

/* ---- memory ---- */

block *rt_find_block(const void *p)
{
    const char *c = p;
    for (block *b = blocks; b; b = b->next)
        if (c >= b->base && c < b->base + b->bytes) return b;
    return NULL;
}

int rt_stream_device(cudaStream_t s)
{
    return s && s != &rt_legacy ? s->device : rt_current_device;
}

int rt_mem_device(const void *p)
{
    rt_lock();
    block *b = rt_find_block(p);
    int d = b && b->kind == RT_MEM_DEVICE ? b->device : -1;
    rt_unlock();
    return d;
}

const char *rt_kind_name(rt_mem k)
{
    return k == RT_MEM_DEVICE   ? "device memory (cudaMalloc)"
           : k == RT_MEM_PINNED ? "pinned host memory (cudaMallocHost)"
                                : "pageable host memory";
}

rt_mem rt_mem_kind(const char *call, const char *arg, const void *p, size_t bytes)
{
    rt_lock();
    block *b = rt_find_block(p);
    rt_mem k = b ? b->kind : RT_MEM_UNKNOWN;
    size_t off = b ? (size_t)((const char *)p - b->base) : 0;
    size_t size = b ? b->bytes : 0;
    rt_unlock();
    if (b && bytes > size - off)
        rt_die("%s: %s=%p (%zu bytes) runs %zu bytes past the end of its %zu-byte %s block", call,
               arg, p, bytes, bytes - (size - off), size, rt_kind_name(k));
    return k;
}

void rt_need(const char *call, const char *arg, const void *p, size_t bytes, unsigned need)
{
    if (bytes == 0) return;
    if (!p) rt_die("%s: %s is NULL (%zu bytes)", call, arg, bytes);
    rt_mem k = rt_mem_kind(call, arg, p, bytes);
    if (need & (1u << k)) return;
    rt_die("%s: %s=%p (%zu bytes) is %s; %s needs %s", call, arg, p, bytes, rt_kind_name(k), call,
           need == RT_NEED_DEVICE ? "device memory" : "host memory");
}

static cudaError_t alloc_block(void **p, size_t bytes, rt_mem kind, const char *call)
{
    if (!p) return rt_ret(cudaErrorInvalidValue);
    const char *a = rt_call("cuda", call);
    if (rt_sticky_err) return rt_ret(rt_sticky_err);
    if (rt_is_action(a, "error")) return rt_ret(cudaErrorMemoryAllocation);
    size_t size = bytes ? bytes : 1;
    block *b = calloc(1, sizeof(*b));
    char *mem = b ? aligned_alloc(256, (size + 255) / 256 * 256) : NULL;
    if (!mem) {
        free(b);
        return rt_ret(cudaErrorMemoryAllocation);
    }
    /* Device memory is not zeroed: NaN bytes make a read of unwritten memory show. */
    memset(mem, kind == RT_MEM_DEVICE ? 0xff : 0, size);
    b->base = mem;
    b->bytes = size;
    b->kind = kind;
    b->device = rt_current_device;
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

/* Under rt_mu: the first queued op of any stream that touches b, or NULL. */
static rt_op *queued_user(const block *b, cudaStream_t *on)
{
    for (cudaStream_t s = rt_all_streams; s; s = s->next_all)
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
        int inside = b || rt_find_block(p);
        rt_unlock();
        if (inside) rt_die("%s(%p): not the start of a %s block", call, p, rt_kind_name(kind));
        return rt_ret(cudaErrorInvalidValue);
    }
    /* Queued work that still uses the block is reported, not run: CUDA's
     * free waits for the device, but code that frees before it waits for
     * the stream is one reorder away from freeing under a kernel (and a
     * hung op or a collective whose peers never come would block it). */
    cudaStream_t on = NULL;
    rt_op *user =
        rt_sticky_err ? NULL : queued_user(b, &on); /* a poisoned context runs nothing more */
    if (user)
        rt_die("%s(%p): %s queued on stream %d still uses this memory", call, p, user->name,
               on->id);
    /* CUDA's free waits for the whole device first (a kernel of another
     * stream, a spinning collective included): so does this one, and a
     * wait that would never end on a GPU is reported, not waited out. */
    int64_t until = mono_now_ms() + RT_FREE_WAIT_MS;
    for (;;) {
        cudaStream_t busy = rt_device_busy();
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
        rt_pause_briefly();
        rt_lock();
    }
    pp = &blocks; /* the list may have changed while unlocked */
    while (*pp && (*pp)->base != p)
        pp = &(*pp)->next;
    if (*pp != b) {
        rt_unlock();
        rt_die("%s(%p): freed twice at once", call, p);
    }
    rt_host_synced();
    *pp = b->next;
    cudaError_t e = rt_sticky_err; /* a poisoned context frees (nothing leaks here) but says so */
    rt_unlock();
    free(b->base);
    free(b);
    return rt_ret(e);
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
    if (!a) return rt_ret(cudaErrorInvalidValue);
    if (rt_sticky_err) return rt_ret(rt_sticky_err);
    rt_lock();
    block *b = rt_find_block(p);
    rt_mem k = b ? b->kind : RT_MEM_UNKNOWN;
    int bdev = b ? b->device : -1;
    rt_unlock();
    memset(a, 0, sizeof(*a));
    a->type = k == RT_MEM_DEVICE   ? cudaMemoryTypeDevice
              : k == RT_MEM_PINNED ? cudaMemoryTypeHost
                                   : cudaMemoryTypeUnregistered;
    a->device = k == RT_MEM_DEVICE ? bdev : k == RT_MEM_UNKNOWN ? -2 : rt_current_device;
    a->devicePointer = k == RT_MEM_DEVICE ? (void *)p : NULL;
    a->hostPointer = k != RT_MEM_DEVICE ? (void *)p : NULL;
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
    rt_check_stream(s);
    if (rt_sticky_err) return rt_ret(rt_sticky_err);
    if (rt_is_action(a, "error")) return rt_ret(cudaErrorInvalidValue);
    if ((unsigned)kind > cudaMemcpyDefault) return rt_ret(cudaErrorInvalidValue);
    if (bytes == 0) return cudaSuccess;
    if (!dst || !src) rt_die("%s: %s pointer is NULL", call, dst ? "src" : "dst");
    rt_mem dk = rt_mem_kind(call, "dst", dst, bytes), sk = rt_mem_kind(call, "src", src, bytes);
    int d_dev = dk == RT_MEM_DEVICE, s_dev = sk == RT_MEM_DEVICE;
    if (kind != cudaMemcpyDefault) {
        int want_d = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
        int want_s = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
        if (d_dev != want_d)
            rt_die("%s: dst=%p is %s but the kind is %s", call, dst, rt_kind_name(dk),
                   kind_word(kind));
        if (s_dev != want_s)
            rt_die("%s: src=%p is %s but the kind is %s", call, src, rt_kind_name(sk),
                   kind_word(kind));
    }
    copy_op *c = copy_op_new(call, dst, src, bytes, -1);
    if (!c) return rt_ret(cudaErrorMemoryAllocation);
    /* Pageable memory: CUDA copies the source before returning, and a copy
     * into pageable memory is done when the call returns. */
    if (sk == RT_MEM_UNKNOWN && d_dev) {
        if (!(c->staged = malloc(bytes))) {
            free(c);
            return rt_ret(cudaErrorMemoryAllocation);
        }
        memcpy(c->staged, src, bytes);
    }
    if (dk == RT_MEM_UNKNOWN && s_dev) sync = 1;
    cudaError_t e = rt_enqueue(s, &c->op, a);
    if (e != cudaSuccess) return e;
    if (sync) {
        rt_host_synced();
        rt_wait_stream(s);
    }
    return rt_ret(rt_sticky_err);
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
    rt_check_stream(s);
    if (rt_sticky_err) return rt_ret(rt_sticky_err);
    if (rt_is_action(a, "error")) return rt_ret(cudaErrorInvalidValue);
    if (bytes == 0) return cudaSuccess;
    rt_need(call, "devPtr", p, bytes, RT_NEED_DEVICE);
    copy_op *c = copy_op_new(call, p, NULL, bytes, value & 0xff);
    if (!c) return rt_ret(cudaErrorMemoryAllocation);
    cudaError_t e = rt_enqueue(s, &c->op, a);
    if (e != cudaSuccess) return e;
    if (sync) {
        rt_host_synced();
        rt_wait_stream(s);
    }
    return rt_ret(rt_sticky_err);
}

cudaError_t cudaMemset(void *p, int value, size_t bytes)
{
    return set(p, value, bytes, NULL, 1, "cudaMemset");
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s)
{
    return set(p, value, bytes, s, 0, "cudaMemsetAsync");
}
