/* rt_nccl.h: the insides the files of the host runtime's NCCL share (tests/gpurt, private).
 *
 * What it is for: the trainer's NCCL code (trainer/comm_nccl.c) built with
 * -DDUCTILE_GPU_RUNTIME=host runs multi-process on machines without GPUs,
 * and meets the failures it must survive (a peer killed, a peer stalled, a
 * failpoint) with the real library's semantics: every rank gets the same
 * bits, errors come only through ncclCommGetAsyncError, and a collective
 * with a lost or stalled peer stays pending until ncclCommAbort.
 *
 * The one idea: a collective is a stream op (rt.h) that never blocks. When
 * it first reaches the head of its stream it copies its send data into one
 * frame per peer and hands them to the communicator's proxy thread; every
 * later run() only looks whether each peer's frame for its sequence number
 * has arrived, and once all have, computes the result locally, reducing in
 * rank order 0..n-1 so every rank gets the same bits. The proxy owns the
 * sockets and never takes the runtime lock; the op never touches a socket.
 * They meet only under the communicator's mutex: outboxes, inboxes, the
 * async error.
 *
 * Bootstrap: ncclGetUniqueId starts a root thread (one listener serving one
 * communicator) and writes its address and a random nonce into the id. Each
 * rank listens, registers with the root, gets every rank's address,
 * connects to each lower rank and accepts each higher one (a hello with the
 * nonce and the rank each way). Every wait there also watches an eventfd
 * that ncclCommAbort writes, and none has a deadline: as with NCCL, a
 * missing peer keeps init in progress until the caller gives up.
 *
 * Environment: DUCTILE_GPURT_ADDR (the IPv4 address to listen on, default
 * 127.0.0.1), DUCTILE_GPURT_PEER_ERROR=system (a lost peer is
 * ncclSystemError, as NCCL before 2.13 said; by default ncclRemoteError,
 * what NCCL 2.13 and later's socket transport says of a closed peer). Failpoints (rt.h) count
 * ncclGetUniqueId, the inits, ncclCommFinalize, the collectives, ncclSend and ncclRecv; queries,
 * group brackets and teardown are not counted (a poll loop would make counts depend on timing, and
 * teardown must always work).
 *
 * Knowingly simple: every rank sends its whole share to every other (n^2
 * frames per collective where NCCL runs a ring); frames wait in per-peer
 * lists searched linearly; calls with count 0 do nothing and take no
 * sequence number (as in NCCL); ncclAvg and reductions of 16- and 8-bit
 * floats are refused with ncclInvalidArgument.
 *
 * The files, in the order a call meets them:
 *   rt_nccl_comm.c    the communicator: init, the shared state, finalize, abort, destroy, queries;
 *   rt_nccl_boot.c    sockets, the unique id, the bootstrap root, the rank's bootstrap;
 *   rt_nccl_proxy.c   the comm thread once bootstrapped: frames to and from the peers;
 *   rt_nccl_coll.c    the collectives and point-to-point calls, their checks, groups;
 *   rt_nccl_launch.c  a non-blocking comm's calls, launched later from a thread of its own;
 *   rt_nccl_work.c    reductions, a call's work as stream ops, started together per batch;
 *   rt_nccl_fault.c   failpoint actions, the async error and its reason, the error strings.
 */
#ifndef DUCTILE_GPURT_RT_NCCL_H
#define DUCTILE_GPURT_RT_NCCL_H

#include "rt.h"

#include <nccl.h>

#include "ductile/clock.h"

#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define NC_MAX_RANKS 1024
#define NC_REASON_MAX 256
#define NC_ROOT_LIFETIME_MS (10 * 60 * 1000)
#define NC_ROOT_IO_MS 5000          /* one registrant's hello, or its table */
#define NC_FINALIZE_NAP_NS 1000000L /* blocking finalize polls every 1 ms */
#define NC_FRAME_MAGIC 0x6e63666du
#define NC_HELLO_MAGIC 0x6e636865u
#define NC_CONFIG_MAGIC 0xcafebeefu
#define NC_READ_BURST 64

/* ---- sockets: every wait is a poll that also watches `wake` ---- */

typedef enum { NC_IO_OK = 0, NC_IO_STOP, NC_IO_TIMEOUT, NC_IO_CLOSED, NC_IO_ERROR } nc_io;

/* ---- the unique id and the bootstrap messages ---- */

/* What the 128 bytes of ncclUniqueId hold: the root's address and the
 * nonce every hello must carry. */
typedef struct nc_id {
    char magic[8]; /* "gpurtid" */
    uint32_t addr; /* network order, as is port */
    uint16_t port;
    uint16_t pad;
    uint64_t nonce;
} nc_id;
_Static_assert(sizeof(nc_id) <= NCCL_UNIQUE_ID_BYTES, "nc_id fits ncclUniqueId");

extern const char nc_id_magic[8]; /* "gpurtid" */

/* A rank to the root (where it listens), and a rank to a peer. */
typedef struct nc_hello {
    uint32_t magic;
    int32_t rank, nranks;
    uint32_t addr;
    uint64_t nonce;
    uint16_t port;
    uint16_t pad[3];
    uint64_t host;  /* nc_host_hash() */
    int32_t device; /* the comm's CUDA device */
    int32_t pad2;
} nc_hello;

/* The root's answer: status, then (on success) nranks nc_where. */
typedef enum { NC_WHY_NONE = 0, NC_WHY_DUP, NC_WHY_NRANKS } nc_why;
typedef struct nc_answer {
    uint32_t magic;
    int32_t status; /* ncclResult_t */
    int32_t why;    /* nc_why */
    int32_t nranks;
} nc_answer;
typedef struct nc_where {
    uint32_t addr;
    uint16_t port;
    uint16_t pad;
    uint64_t host;  /* which host, and which device there: two ranks on one */
    int32_t device; /* GPU are refused, as NCCL does */
    int32_t pad2;
} nc_where;

/* ---- frames and the communicator's shared state ---- */

typedef enum {
    NC_ALLREDUCE = 1,
    NC_BROADCAST,
    NC_ALLGATHER,
    NC_REDUCESCATTER,
    NC_SEND, /* also the frame a send makes */
    NC_RECV,
    NC_BYE, /* finalize: what follows from this peer is no error */
} nc_kind;

/* The header of every frame on a peer connection. */
typedef struct nc_hdr {
    uint32_t magic;
    uint32_t kind;  /* nc_kind */
    uint64_t seq;   /* collectives: the comm's count; sends: this pair's */
    uint64_t count; /* the call's count, checked against the receiver's */
    int32_t type, op, root, pad;
    uint64_t bytes; /* the payload that follows */
} nc_hdr;

/* A frame in memory: header and payload in one block, as on the wire. */
typedef struct nc_msg {
    struct nc_msg *next;
    nc_hdr h;
    unsigned char data[];
} nc_msg;
_Static_assert(offsetof(nc_msg, data) == offsetof(nc_msg, h) + sizeof(nc_hdr),
               "a frame's payload follows its header");

typedef struct nc_peer {
    int fd;         /* -1 for this rank itself; owned by the comm thread */
    nc_where where; /* where it listens (bootstrap) */
    /* under the comm's mutex */
    int closed;               /* EOF or an error seen: no longer polled */
    int bye;                  /* it finalized: its EOF is no error */
    nc_msg *out, *out_tail;   /* frames to send, in order */
    uint64_t queued, flushed; /* frames ever queued, and fully written */
    nc_msg *in, *in_tail;     /* frames received and not yet taken */
    uint64_t sends, recvs;    /* point-to-point calls to / from it */
    /* the proxy's own */
    size_t out_off; /* bytes of `out` written */
    nc_hdr rx_hdr;  /* the header being read */
    size_t rx_got;  /* bytes of rx_hdr, then of rx's payload */
    nc_msg *rx;     /* the frame being read, once its header is in */
} nc_peer;

/* Streams that hold this comm's ops, so finalize can make them progress
 * (the runtime runs streams only when something waits on them). */
typedef struct nc_stream_use {
    cudaStream_t s;
    int ops;
} nc_stream_use;

enum { NC_FIN_NONE = 0, NC_FIN_OPS, NC_FIN_BYE, NC_FIN_DONE };

/* What the comm handle, its thread and its queued ops share: it lives
 * until the last of them lets go, so ops queued when the comm is aborted
 * can still complete. */
typedef struct nc_shared {
    atomic_int refs;
    pthread_mutex_t mu;
    pthread_cond_t ready_cv;
    int rank, nranks;
    uint64_t nonce;
    nc_where root;
    uint32_t addr;           /* where this rank listens */
    ncclResult_t peer_error; /* what a lost peer gives */
    int idle;                /* an init failpoint: the thread only waits for abort */
    uint64_t host;           /* nc_host_hash() */
    int device;              /* the comm's CUDA device */
    int fin_hang;            /* a finalize failpoint: it never ends */
    int listen_fd;           /* the comm thread's, during bootstrap */
    nc_peer *peer;           /* [nranks] */
    /* under mu */
    int ready;          /* bootstrap done */
    ncclResult_t error; /* the async error; the first one sticks */
    char reason[NC_REASON_MAX];
    int stopping, aborted; /* abort or destroy has begun */
    int finalize;          /* NC_FIN_* */
    int wake;              /* eventfd: abort, frames to send; -1 once closed */
    uint64_t seq;          /* collectives issued */
    nc_stream_use *streams;
    int nstreams;
    struct nc_job *job; /* a call that answered ncclInProgress, not yet launched */
} nc_shared;

struct ncclComm {
    nc_shared *sh;
    pthread_t thread;
    int blocking, device;
    char last[NC_REASON_MAX]; /* ncclGetLastError's copy of sh->reason */
};

/* ---- reductions and work ---- */

typedef void (*nc_reducer)(void *acc, const void *in, size_t n, ncclRedOp_t op);

typedef struct nc_type_info {
    size_t size;
    nc_reducer reduce; /* NULL: moved, never reduced */
} nc_type_info;
extern const nc_type_info nc_types[ncclNumTypes];

typedef struct nc_work {
    nc_shared *sh; /* a reference */
    nc_kind kind;
    ncclDataType_t type;
    ncclRedOp_t op; /* 0 unless it reduces */
    int root;       /* 0 unless a broadcast */
    int peer;       /* send and receive */
    const void *send;
    void *recv;
    size_t count; /* the call's count */
    uint64_t seq;
    /* under the runtime lock */
    int skip;            /* never queued: an enqueue before it failed */
    unsigned char *mine; /* this rank's own share, copied at the start */
    nc_msg **got;        /* [nranks]: the peers' frames, once taken */
    uint64_t mark;       /* a send: done when its peer's flushed count gets here */
} nc_work;

/* A call waiting to be queued: made by the API, queued at once or at the
 * outermost ncclGroupEnd. */
typedef struct nc_pending {
    const char *name, *action;
    cudaStream_t stream;
    int nonblocking; /* its comm's: the call is launched later (nc_defer) */
    nc_work work;
} nc_pending;

/* A failure with no communicator to hold it, for ncclGetLastError(NULL)
 * (rt_nccl_fault.c). */
extern _Thread_local char nc_tls_reason[NC_REASON_MAX];

/* rt_nccl_fault.c */
__attribute__((format(printf, 2, 3))) ncclResult_t nc_fail_here(ncclResult_t r, const char *fmt,
                                                                ...);
int nc_action_is(const char *action, const char *word);
ncclResult_t nc_action_async(const char *action, ncclResult_t lost_peer);
__attribute__((format(printf, 3, 4))) ncclResult_t nc_fail(nc_shared *sh, ncclResult_t r,
                                                           const char *fmt, ...);
__attribute__((format(printf, 3, 4))) void nc_fail_locked(nc_shared *sh, ncclResult_t r,
                                                          const char *fmt, ...);

/* rt_nccl_boot.c */
int nc_env_addr(uint32_t *addr);
void nc_drain(int fd);
ncclResult_t nc_bootstrap(nc_shared *sh);

/* rt_nccl_proxy.c */
void *nc_thread(void *arg);

/* rt_nccl_work.c */
void nc_extent(const nc_work *w, int rank, int nranks, size_t *send, size_t *recv);
nc_msg *nc_frame(const nc_work *w, int kind, const void *data, size_t bytes);
void nc_append_locked(nc_peer *pe, nc_msg *m);
ncclResult_t nc_enqueue(nc_pending *items, int n);

/* rt_nccl_coll.c */
ncclResult_t nc_group_flush(nc_pending *it, int n);
ncclResult_t nc_usable(ncclComm_t comm, const char *name, int for_work);

/* rt_nccl_launch.c */
ncclResult_t nc_defer(nc_pending *items, int n);
void nc_job_asked(nc_shared *sh);
void nc_job_cancel(nc_shared *sh);

/* rt_nccl_comm.c */
void nc_wake_locked(nc_shared *sh);
int nc_stopping(nc_shared *sh);
void nc_ref(nc_shared *sh);
void nc_unref(nc_shared *sh);

#endif
