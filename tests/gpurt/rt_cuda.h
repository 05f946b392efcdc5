/* rt_cuda.h: what the files of the host runtime's CUDA share (tests/gpurt, private; see rt.h).
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
 *
 * The files: rt_cuda.c (the lock, failpoints, devices, errors),
 * rt_cuda_mem.c (the registry of blocks, allocation, copies and memsets),
 * rt_cuda_stream.c (happens-before, streams and their ops, events).
 */
#ifndef DUCTILE_GPURT_RT_CUDA_H
#define DUCTILE_GPURT_RT_CUDA_H

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

/* The runtime lock (rt_lock), the sticky context error, and this thread's
 * current device: rt_cuda.c's. */
extern pthread_mutex_t rt_mu;
extern cudaError_t rt_sticky_err;
extern __thread int rt_current_device;
/* The legacy default stream, and every stream ever made: rt_cuda_stream.c's. */
extern struct CUstream_st rt_legacy;
extern struct CUstream_st *rt_all_streams;

/* rt_cuda.c */
void rt_host_synced(void);
void rt_pause_briefly(void);
cudaError_t rt_ret(cudaError_t e);
int rt_is_action(const char *a, const char *want);

/* rt_cuda_mem.c */
block *rt_find_block(const void *p);
const char *rt_kind_name(rt_mem k);

/* rt_cuda_stream.c */
cudaError_t rt_check_stream(cudaStream_t s);
cudaStream_t rt_device_busy(void);

#endif
