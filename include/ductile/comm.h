/* comm.h: collectives behind one small interface.
 *
 * Three backends share it: on CPU, shared memory for ranks on one host
 * (comm_shm.c) and a TCP ring between hosts (comm_ring.c: reduce-scatter +
 * all-gather, chunked and pipelined), both bootstrapped through the round
 * store; and NCCL on GPU (comm_nccl.c). Buffers are host memory for the ring; the
 * NCCL backend takes device memory as it is and stages host memory through
 * a pinned bounce buffer itself, so callers (the state sync, evaluation
 * counts) need not know which backend they have. Every call
 * is synchronous for its caller (the DDP reducer calls them from its
 * communication thread) and fails within the configured deadline when a
 * peer dies or goes silent, at once when a connection closes: none hangs.
 * comm_abort() may be called from any thread to make calls in flight fail
 * with COMM_ERR_ABORTED, which is how an in-place rebuild drops a group.
 */
#ifndef DUCTILE_COMM_H
#define DUCTILE_COMM_H

#include <stddef.h>

#include "ductile/rdzv.h"

typedef enum {
    COMM_OK = 0,
    COMM_ERR_ARG, /* invalid argument */
    COMM_ERR_NOMEM,
    COMM_ERR_SYS,     /* a socket or system call failed */
    COMM_ERR_PEER,    /* a peer closed its connection or sent garbage */
    COMM_ERR_TIMEOUT, /* a peer was silent past the deadline */
    COMM_ERR_STORE,   /* the round store failed during bootstrap */
    COMM_ERR_ABORTED, /* comm_abort() was called */
    COMM_ERR_CUDA,
    COMM_ERR_NCCL,
} comm_err;

const char *comm_strerror(comm_err err);

/* The size of the one-line reason a comm keeps (comm_last_error). */
#define COMM_MSG_MAX 256

/* 1 when err says a peer went away, not that this process failed: a closed
 * connection (PEER), a silent peer (TIMEOUT), an abort (the group was
 * dropped because a peer was lost) or the round store refusing the round
 * (STORE: it was superseded). The rest (ARG, NOMEM, SYS, CUDA, NCCL) are
 * this process's own. An elastic trainer reports the first kind to its
 * agent as `peer_lost`, the second as `failed`. */
int comm_err_is_peer(comm_err err);

/* How ranks on the CPU talk (comm_cpu_init). */
typedef enum {
    COMM_TRANSPORT_AUTO = 0, /* shared memory per host, the ring between hosts (comm_cpu_init) */
    COMM_TRANSPORT_RING,     /* the TCP ring always */
    COMM_TRANSPORT_SHM,      /* shared memory, or fail when the ranks span hosts */
} comm_transport;

typedef struct comm_config {
    int rank;
    int world_size;
    rdzv_store *store;        /* the round's store: bootstrap addresses / NCCL id */
    const char *host;         /* address to listen on and publish (default 127.0.0.1) */
    int timeout_ms;           /* deadline for a silent peer (default 30000) */
    size_t chunk_bytes;       /* ring pipeline chunk (default 256 KiB) */
    int device;               /* NCCL: CUDA device ordinal */
    comm_transport transport; /* comm_cpu_init: rank 0 decides; a rank forced to the ring gets it */
    /* comm_cpu_init: which host this rank is on (NULL: this kernel's boot
     * id and network namespace); tests name hosts to make several on one. */
    const char *host_id;
    char *msg; /* optional, COMM_MSG_MAX bytes: why an init failed */
    /* Optional: polled while an init waits (NCCL's), 1 to give up at once
     * with COMM_ERR_ABORTED: the round being built has already ended (an
     * in-place rebuild's control thread answers it), so no peer is coming. */
    int (*cancelled)(void *ctx);
    void *cancel_ctx;
    /* Optional (NCCL): called once, from the thread that found it, when the
     * communicator fails by this process's own NCCL error (not a peer's,
     * not CUDA's), before it is torn down: the caller says so first, so its
     * failure is on record before any peer sees the connections close. */
    void (*failed_here)(void *ctx, const char *why);
    void *failed_ctx;
} comm_config;

typedef struct comm comm;

/* CPU: TCP ring. On failure *out is NULL and cfg->msg, when set, says why
 * in one line. */
comm_err comm_ring_init(const comm_config *cfg, comm **out);
/* CPU (comm_cpu.c chooses): shared memory (comm_shm.c) when every rank
 * shares one host (the same kernel and network namespace, decided by rank
 * 0 from what each rank publishes in the round store), the TCP ring when
 * every rank is on a host of its own, and both (comm_hier.c: shared
 * memory on each host, the ring among one leader per host) in between;
 * cfg->transport forces the ring or shared memory alone. Fails as
 * comm_ring_init does. */
comm_err comm_cpu_init(const comm_config *cfg, comm **out);
/* GPU: NCCL (only when built with CUDA; else COMM_ERR_ARG). Fails as
 * comm_ring_init does. */
comm_err comm_nccl_init(const comm_config *cfg, comm **out);

int comm_rank(const comm *c);
/* What carries the collectives: "ring", "shm", "hier" or "nccl" ("none" for NULL). */
const char *comm_backend(const comm *c);
int comm_world_size(const comm *c);

/* In-place sum of n floats across all ranks. */
comm_err comm_allreduce_sum_f32(comm *c, float *buf, size_t n);
/* The same, started once `event` has happened: on a device backend a CUDA
 * event (cudaEvent_t) recorded after the kernels that wrote buf, which the
 * backend's stream waits for with no host round trip; NULL is plain
 * comm_allreduce_sum_f32. The ring has no events (COMM_ERR_ARG). */
comm_err comm_allreduce_sum_f32_after(comm *c, float *buf, size_t n, void *event);
/* comm_allreduce_sum_f32_after without waiting for the result: a backend
 * with a device stream (NCCL) queues it behind the ones before, so the
 * gradient buckets pipeline on its stream with no host round trip between
 * them; a CPU backend completes it here. comm_wait() then waits for every
 * one started: buf is not the caller's to read or free before. */
comm_err comm_allreduce_sum_f32_start(comm *c, float *buf, size_t n, void *event);
comm_err comm_wait(comm *c);
/* root's bytes to everyone. */
comm_err comm_broadcast(comm *c, void *buf, size_t bytes, int root);
/* Each rank's `bytes` from send, gathered in rank order into recv (world*bytes). */
comm_err comm_allgather(comm *c, const void *send, size_t bytes, void *recv);
comm_err comm_barrier(comm *c);

/* Thread-safe, async-signal-unsafe: fail calls in flight and all later ones. */
void comm_abort(comm *c);
/* The error a failed or aborted comm answers every call with (COMM_OK
 * while it works). Call it when no collective is in flight on c. */
comm_err comm_error(const comm *c);
/* One line on the last error ("" if none). */
const char *comm_last_error(const comm *c);
void comm_free(comm *c);

#endif
