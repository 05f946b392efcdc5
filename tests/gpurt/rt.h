/* rt.h: the host GPU test runtime's insides (tests/gpurt, private).
 *
 * -DDUCTILE_GPU_RUNTIME=host builds the trainer's GPU sources (gpu_cuda.c, gpu_model_cuda.c,
 * comm_nccl.c) against this runtime instead of libcudart, libcublas and
 * libnccl. It is for correctness, not speed: it checks what the real thing
 * only crashes on, and keeps the real thing's semantics where they hurt.
 *
 * The one idea: device work is a queue of ops per stream that runs lazily,
 * only when something waits for it (a synchronize, a query, an event wait
 * another stream reaches), and every op says which memory it reads and
 * writes. So:
 *  - a host read without a sync sees stale data (the op has not run yet);
 *  - two ops on different streams that touch the same bytes (one writing)
 *    with no happens-before edge between them (an event wait, a host sync
 *    between the two enqueues) are reported when the second is queued: the
 *    edges are tracked with one vector clock per stream and one for the host
 *    (all host threads together: the runtime cannot see their mutexes);
 *  - every pointer handed to a kernel launcher, cuBLAS, NCCL or a memcpy is
 *    looked up among the allocations: a kind the real API forbids aborts
 *    with the call and the pointer named. Stricter than CUDA in one place:
 *    kernels and cuBLAS take only cudaMalloc memory, never mapped pinned.
 *
 * Devices: DUCTILE_GPURT_DEVICES=N (default 0: "no CUDA device", so a CPU
 * test built with this runtime still picks the CPU), of which a process
 * sees those CUDA_VISIBLE_DEVICES names, as with CUDA.
 *
 * Failpoints (DUCTILE_FAILPOINTS, ductile/failpoint.h), counted per process:
 *   gpurt.cuda       every CUDA runtime call, kernel launch and cuBLAS call;
 *   gpurt.cuda.NAME  only the call NAME (cudaMalloc, kern_fill, cublasSgemm);
 *   gpurt.nccl, gpurt.nccl.NAME   likewise for NCCL calls.
 * ACTIONs: error (the call returns an error at once), async (the call
 * succeeds, its work fails later: a sticky launch failure for CUDA, an
 * async error on the communicator for NCCL, "async:remote" or
 * "async:system" to choose which), hang (its work never completes).
 */
#ifndef DUCTILE_GPURT_RT_H
#define DUCTILE_GPURT_RT_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

/* ---- dying loudly ---- */

/* "gpurt: MESSAGE" on stderr, then abort(): a misuse of the API that the
 * real GPU would crash on or silently corrupt. */
void rt_die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

/* ---- memory ---- */

typedef enum {
    RT_MEM_UNKNOWN = 0, /* pageable host memory (malloc, the stack, globals) */
    RT_MEM_PINNED = 1,  /* cudaMallocHost */
    RT_MEM_DEVICE = 2,  /* cudaMalloc */
} rt_mem;

#define RT_NEED_DEVICE (1u << RT_MEM_DEVICE)
#define RT_NEED_HOST ((1u << RT_MEM_UNKNOWN) | (1u << RT_MEM_PINNED))

/* The kind of [p, p+bytes): an allocation's kind when the range lies
 * inside one cudaMalloc/cudaMallocHost block, else RT_MEM_UNKNOWN. A range
 * that starts inside a block and runs past its end aborts (call, arg). */
rt_mem rt_mem_kind(const char *call, const char *arg, const void *p, size_t bytes);

/* Aborts unless [p, p+bytes) has a kind in `need` ("CALL: ARG=P (N bytes)
 * is host memory; CALL needs device memory"). bytes 0 checks nothing. */
void rt_need(const char *call, const char *arg, const void *p, size_t bytes, unsigned need);

/* ---- streams and ops ---- */

typedef enum {
    RT_DONE = 0, /* finished; the op is popped and dropped */
    RT_PENDING,  /* not yet (a collective waiting for its peers): ask again later */
} rt_state;

#define RT_MAX_ACCESS 6

typedef struct rt_op rt_op;
struct rt_op {
    const char *name; /* the call that queued it, for reports */
    /* Runs at the head of its stream, under the runtime lock, from whatever
     * thread waits. Must not block: return RT_PENDING and be asked again. */
    rt_state (*run)(rt_op *op);
    /* Frees op (allocated by the caller, rt_op first in its struct). NULL: free(). */
    void (*drop)(rt_op *op);
    struct {
        const void *p;
        size_t bytes;
        int write;
    } access[RT_MAX_ACCESS];
    int naccess;
    /* the runtime's own */
    rt_op *next;
    uint64_t seq;
    int hang;   /* failpoint: never completes */
    int fails;  /* failpoint: runs, then fails the context (a sticky launch failure) */
    int kernel; /* a kernel launch (rt_kernels, cuBLAS): its stream and memory must be
                 * the current device's */
};

/* Declares that op reads (write 0) or writes [p, p+bytes); at most
 * RT_MAX_ACCESS per op. */
void rt_op_access(rt_op *op, const void *p, size_t bytes, int write);

/* The start of every API call: counts it for the failpoints (gpurt.cuda and
 * gpurt.cuda.NAME, or gpurt.nccl...) and returns the action that fires for
 * this call, or NULL. family is "cuda" or "nccl". */
const char *rt_call(const char *family, const char *name);
/* White-box: the next call named NAME (cudaStreamSynchronize, ...) fails
 * as an "error" failpoint would, once, whatever DUCTILE_FAILPOINTS says: a
 * test reaches a call whose place in the count it cannot know. "NAME:ACTION"
 * fires ACTION instead (ncclAllReduce:async:system). */
void rt_fail_next(const char *spec);

/* Queues op (its name and accesses filled) on s, NULL meaning the legacy
 * default stream; checks its accesses against other streams' unordered
 * work first (a race aborts). `action` is rt_call's answer: "hang" makes
 * the op never complete, "async" makes it fail the context when it runs
 * (CUDA). Returns cudaSuccess, or the context's sticky error (op dropped). */
cudaError_t rt_enqueue(cudaStream_t s, rt_op *op, const char *action);

/* A non-blocking communicator's call that answered ncclInProgress holds
 * its stream (delta +1) until NCCL's launch thread has queued its work
 * (delta -1): CUDA work the host queues on a held stream would run before
 * the collective, and is reported as the race it is. `what` names the call
 * for that report. */
void rt_stream_hold(cudaStream_t s, int delta, const char *what);
/* The calling thread is the runtime's NCCL launch thread (on 1, off 0):
 * its enqueues are the held calls' own. */
void rt_set_launcher(int on);

/* Runs s's queue as far as it goes without blocking; 1 when empty. Under
 * the runtime lock (rt_lock) only. */
int rt_pump(cudaStream_t s);

/* The runtime lock: held while ops run and queues change. Code outside
 * rt_cuda.c takes it only around rt_pump or its own shared state. */
void rt_lock(void);
void rt_unlock(void);

/* The sticky context error (cudaSuccess while none). */
cudaError_t rt_sticky(void);

/* Blocks until s's queue is empty (ops pending on peers keep it waiting:
 * a collective whose peer is dead blocks here until the communicator is
 * aborted, as on a real GPU). */
void rt_wait_stream(cudaStream_t s);

/* NCCL teardowns in this process so far: communicators destroyed after a
 * completed finalize (clean) and communicators aborted. For tests that a
 * healthy communicator is finalized, not torn down. */
void rt_nccl_teardowns(int *clean, int *aborted);

/* Host synchronisations so far in this process: stream, event and device
 * syncs, copies into pageable memory and other blocking copies, and
 * cudaFree (which waits for the device). With DUCTILE_GPURT_SYNCS=FILE
 * the count is written there at exit ("syncs N"), for tests of a whole
 * program's budget. */
long rt_host_syncs(void);

/* Devices this process sees: DUCTILE_GPURT_DEVICES, or those of them that
 * CUDA_VISIBLE_DEVICES lists, renumbered from 0 as CUDA does. */
int rt_device_count(void);
/* The machine's GPU behind this process's device ordinal (its bus id): -1
 * when there is none. Two ranks of one host on one physical GPU are what
 * NCCL refuses. */
int rt_device_physical(int device);

/* The device a stream was made on (the legacy stream: the caller's current
 * one), and the device of the cudaMalloc block holding p (-1: not device
 * memory). Streams, events and device memory belong to the device current
 * when they were made, as in CUDA. */
int rt_stream_device(cudaStream_t s);
int rt_mem_device(const void *p);

#endif
