/* rt_nccl.c: NCCL for the host GPU test runtime, across real processes.
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
 */
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

/* ---- results and reasons ---- */

/* A failure with no communicator to hold it, for ncclGetLastError(NULL).
 * Per thread, as NCCL's own last error is: the one thread-local here with
 * the open group below. */
static _Thread_local char nc_tls_reason[NC_REASON_MAX];

__attribute__((format(printf, 2, 3))) static ncclResult_t nc_fail_here(ncclResult_t r,
                                                                       const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(nc_tls_reason, sizeof(nc_tls_reason), fmt, ap);
    va_end(ap);
    return r;
}

const char *ncclGetErrorString(ncclResult_t r)
{
    switch (r) {
    case ncclSuccess:
        return "no error";
    case ncclUnhandledCudaError:
        return "unhandled cuda error";
    case ncclSystemError:
        return "unhandled system error";
    case ncclInternalError:
        return "internal error";
    case ncclInvalidArgument:
        return "invalid argument";
    case ncclInvalidUsage:
        return "invalid usage";
    case ncclRemoteError:
        return "remote process exited or there was a network error";
    case ncclInProgress:
        return "NCCL operation in progress";
    default:
        return "unknown result code";
    }
}

ncclResult_t ncclGetVersion(int *version)
{
    if (!version) return ncclInvalidArgument;
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}

static int nc_action_is(const char *action, const char *word)
{
    return action && strcmp(action, word) == 0;
}

/* The async error a failpoint action asks for; ncclSuccess for none. Plain
 * "async" is what a lost peer gives. */
static ncclResult_t nc_action_async(const char *action, ncclResult_t lost_peer)
{
    if (nc_action_is(action, "async:remote")) return ncclRemoteError;
    if (nc_action_is(action, "async:system")) return ncclSystemError;
    if (nc_action_is(action, "async")) return lost_peer;
    return ncclSuccess;
}

/* DUCTILE_GPURT_ADDR, or loopback; 0 or -1 (not an IPv4 address). */
static int nc_env_addr(uint32_t *addr)
{
    const char *s = getenv("DUCTILE_GPURT_ADDR");
    struct in_addr a;
    if (inet_pton(AF_INET, s && *s ? s : "127.0.0.1", &a) != 1) return -1;
    *addr = a.s_addr;
    return 0;
}

/* ---- sockets: every wait is a poll that also watches `wake` ---- */

typedef enum { NC_IO_OK = 0, NC_IO_STOP, NC_IO_TIMEOUT, NC_IO_CLOSED, NC_IO_ERROR } nc_io;

/* Waits until fd has `events`, wake (-1: none) is readable (NC_IO_STOP) or
 * the monotonic deadline_ms passes (-1: never). */
static nc_io nc_wait(int fd, short events, int wake, int64_t deadline_ms)
{
    struct pollfd p[2] = {{.fd = fd, .events = events}, {.fd = wake, .events = POLLIN}};
    for (;;) {
        int timeout = -1;
        if (deadline_ms >= 0) {
            int64_t left = deadline_ms - mono_now_ms();
            if (left <= 0) return NC_IO_TIMEOUT;
            timeout = left > INT_MAX ? INT_MAX : (int)left;
        }
        int n = poll(p, 2, timeout);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return NC_IO_ERROR;
        if (p[1].revents) return NC_IO_STOP;
        if (p[0].revents) return NC_IO_OK;
    }
}

/* Moves all n bytes over the non-blocking fd (out: send, else receive). */
static nc_io nc_xfer(int fd, void *buf, size_t n, int out, int wake, int64_t deadline_ms)
{
    char *p = buf;
    while (n > 0) {
        ssize_t k = out ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k == 0) return NC_IO_CLOSED;
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return NC_IO_ERROR;
        nc_io io = nc_wait(fd, out ? POLLOUT : POLLIN, wake, deadline_ms);
        if (io != NC_IO_OK) return io;
    }
    return NC_IO_OK;
}

static void nc_close_keep_errno(int fd)
{
    int e = errno;
    close(fd);
    errno = e;
}

/* A non-blocking listener on addr and an ephemeral port (network order). */
static int nc_listen(uint32_t addr, uint16_t *port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = addr};
    socklen_t len = sizeof(sa);
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0 || listen(fd, SOMAXCONN) != 0 ||
        getsockname(fd, (struct sockaddr *)&sa, &len) != 0) {
        nc_close_keep_errno(fd);
        return -1;
    }
    *port = sa.sin_port;
    return fd;
}

static void nc_nodelay(int fd)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

/* Connects a non-blocking socket to addr:port (network order). */
static nc_io nc_dial(uint32_t addr, uint16_t port, int wake, int64_t deadline_ms, int *out)
{
    *out = -1;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return NC_IO_ERROR;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = addr, .sin_port = port};
    nc_io io = NC_IO_OK;
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        io = errno == EINPROGRESS || errno == EINTR ? nc_wait(fd, POLLOUT, wake, deadline_ms)
                                                    : NC_IO_ERROR;
        int err = 0;
        socklen_t len = sizeof(err);
        if (io == NC_IO_OK && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err) {
            errno = err;
            io = NC_IO_ERROR;
        }
    }
    if (io != NC_IO_OK) {
        nc_close_keep_errno(fd);
        return io;
    }
    nc_nodelay(fd);
    *out = fd;
    return NC_IO_OK;
}

static void nc_drain(int fd)
{
    uint64_t v;
    ssize_t k = read(fd, &v, sizeof(v));
    (void)k; /* an eventfd: empty (EAGAIN) is as good as drained */
}

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

static const char nc_id_magic[8] = "gpurtid";

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

static const char *nc_why_text(int why)
{
    return why == NC_WHY_DUP ? "another process registered that rank"
                             : "another rank registered a different number of ranks";
}

/* ---- the bootstrap root: one detached thread per ncclGetUniqueId ---- */

typedef struct nc_root {
    int fd;
    uint64_t nonce;
    int nranks, joined; /* nranks 0 until the first registration */
    int *conn;          /* [nranks]: each registered rank's connection, or -1 */
    nc_where *where;    /* [nranks] */
} nc_root;

static void nc_root_free(nc_root *rt)
{
    for (int r = 0; r < rt->nranks; r++)
        if (rt->conn[r] >= 0) close(rt->conn[r]);
    close(rt->fd);
    free(rt->conn);
    free(rt->where);
    free(rt);
}

static int nc_root_size(nc_root *rt, int nranks)
{
    rt->conn = malloc((size_t)nranks * sizeof(*rt->conn));
    rt->where = calloc((size_t)nranks, sizeof(*rt->where));
    if (!rt->conn || !rt->where) {
        free(rt->conn);
        free(rt->where);
        rt->conn = NULL;
        rt->where = NULL;
        return -1;
    }
    for (int r = 0; r < nranks; r++)
        rt->conn[r] = -1;
    rt->nranks = nranks;
    return 0;
}

static void nc_root_refuse(int fd, nc_why why)
{
    nc_answer a = {NC_HELLO_MAGIC, ncclInvalidUsage, why, 0};
    nc_xfer(fd, &a, sizeof(a), 1, -1, mono_now_ms() + NC_ROOT_IO_MS);
    close(fd);
}

/* One new connection: a registration kept, refused (a duplicate rank, a
 * different nranks) or dropped (not a hello with our nonce). */
static void nc_root_take(nc_root *rt, int fd)
{
    nc_hello h;
    if (nc_xfer(fd, &h, sizeof(h), 0, -1, mono_now_ms() + NC_ROOT_IO_MS) != NC_IO_OK ||
        h.magic != NC_HELLO_MAGIC || h.nonce != rt->nonce || h.nranks < 1 ||
        h.nranks > NC_MAX_RANKS || h.rank < 0 || h.rank >= h.nranks ||
        (rt->nranks == 0 && nc_root_size(rt, h.nranks) != 0)) {
        close(fd);
        return;
    }
    if (h.nranks != rt->nranks) return nc_root_refuse(fd, NC_WHY_NRANKS);
    if (rt->conn[h.rank] >= 0) return nc_root_refuse(fd, NC_WHY_DUP);
    rt->conn[h.rank] = fd;
    rt->where[h.rank] =
        (nc_where){.addr = h.addr, .port = h.port, .host = h.host, .device = h.device};
    rt->joined++;
}

/* Everyone is in: the table to each. A rank that died since it registered
 * misses it; its peers find out when they dial it. */
static void nc_root_answer(nc_root *rt)
{
    nc_answer a = {NC_HELLO_MAGIC, ncclSuccess, NC_WHY_NONE, rt->nranks};
    for (int r = 0; r < rt->nranks; r++) {
        int64_t deadline = mono_now_ms() + NC_ROOT_IO_MS;
        if (nc_xfer(rt->conn[r], &a, sizeof(a), 1, -1, deadline) == NC_IO_OK)
            nc_xfer(rt->conn[r], rt->where, (size_t)rt->nranks * sizeof(*rt->where), 1, -1,
                    deadline);
    }
}

static void *nc_root_main(void *arg)
{
    nc_root *rt = arg;
    int64_t end = mono_now_ms() + NC_ROOT_LIFETIME_MS;
    while (rt->nranks == 0 || rt->joined < rt->nranks) {
        if (nc_wait(rt->fd, POLLIN, -1, end) != NC_IO_OK) break;
        int c = accept4(rt->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (c >= 0)
            nc_root_take(rt, c);
        else if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED)
            break;
    }
    if (rt->nranks > 0 && rt->joined == rt->nranks) nc_root_answer(rt);
    nc_root_free(rt);
    return NULL;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *out)
{
    const char *action = rt_call("nccl", "ncclGetUniqueId");
    if (!out) return nc_fail_here(ncclInvalidArgument, "ncclGetUniqueId: uniqueId is NULL");
    if (nc_action_is(action, "error"))
        return nc_fail_here(ncclSystemError, "ncclGetUniqueId: failpoint error");
    nc_id id = {.pad = 0};
    memcpy(id.magic, nc_id_magic, sizeof(id.magic));
    if (nc_env_addr(&id.addr) != 0)
        return nc_fail_here(ncclInvalidUsage, "DUCTILE_GPURT_ADDR is not an IPv4 address");
    if (getrandom(&id.nonce, sizeof(id.nonce), 0) != (ssize_t)sizeof(id.nonce))
        return nc_fail_here(ncclSystemError, "getrandom: %s", strerror(errno));
    nc_root *rt = calloc(1, sizeof(*rt));
    if (!rt) return nc_fail_here(ncclSystemError, "ncclGetUniqueId: out of memory");
    rt->nonce = id.nonce;
    rt->fd = nc_listen(id.addr, &id.port);
    if (rt->fd < 0) {
        free(rt);
        return nc_fail_here(ncclSystemError, "bootstrap root: listen: %s", strerror(errno));
    }
    pthread_attr_t attr;
    pthread_t t;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &attr, nc_root_main, rt);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        nc_root_free(rt);
        return nc_fail_here(ncclSystemError, "bootstrap root: pthread_create: %s", strerror(rc));
    }
    memset(out, 0, sizeof(*out));
    memcpy(out->internal, &id, sizeof(id));
    return ncclSuccess;
}

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

static const char *nc_kind_name(int kind)
{
    static const char *const names[] = {
        "?",        "ncclAllReduce", "ncclBroadcast", "ncclAllGather", "ncclReduceScatter",
        "ncclSend", "ncclRecv",      "goodbye"};
    return kind >= 1 && kind <= NC_BYE ? names[kind] : names[0];
}

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

__attribute__((format(printf, 3, 0))) static void nc_vfail_locked(nc_shared *sh, ncclResult_t r,
                                                                  const char *fmt, va_list ap)
{
    if (sh->error != ncclSuccess) return;
    sh->error = r;
    int n = snprintf(sh->reason, sizeof(sh->reason), "rank %d: ", sh->rank);
    vsnprintf(sh->reason + n, sizeof(sh->reason) - (size_t)n, fmt, ap);
    pthread_cond_broadcast(&sh->ready_cv);
}

/* Gives the comm its async error (unless it has one): "rank R: REASON". */
__attribute__((format(printf, 3, 4))) static ncclResult_t nc_fail(nc_shared *sh, ncclResult_t r,
                                                                  const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&sh->mu);
    nc_vfail_locked(sh, r, fmt, ap);
    pthread_mutex_unlock(&sh->mu);
    va_end(ap);
    return r;
}

__attribute__((format(printf, 3, 4))) static void nc_fail_locked(nc_shared *sh, ncclResult_t r,
                                                                 const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    nc_vfail_locked(sh, r, fmt, ap);
    va_end(ap);
}

static void nc_wake_locked(nc_shared *sh)
{
    uint64_t one = 1;
    if (sh->wake < 0) return;
    ssize_t k = write(sh->wake, &one, sizeof(one));
    (void)k; /* a full counter wakes the proxy just as well */
}

static int nc_stopping(nc_shared *sh)
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

static void nc_ref(nc_shared *sh)
{
    atomic_fetch_add(&sh->refs, 1);
}

static void nc_unref(nc_shared *sh)
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

/* ---- bootstrap, on the comm thread ---- */

/* Records an I/O failure of the bootstrap ("WHAT: closed" and the like) as
 * a lost peer; a stop (abort) is no failure worth a reason. */
__attribute__((format(printf, 3, 4))) static ncclResult_t nc_io_fail(nc_shared *sh, nc_io io,
                                                                     const char *fmt, ...)
{
    if (io == NC_IO_STOP) return ncclInternalError;
    char what[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    const char *how = io == NC_IO_CLOSED ? "connection closed" : strerror(errno);
    return nc_fail(sh, sh->peer_error, "%s: %s", what, how);
}

static nc_hello nc_hello_of(const nc_shared *sh)
{
    nc_hello h = {.magic = NC_HELLO_MAGIC,
                  .rank = sh->rank,
                  .nranks = sh->nranks,
                  .addr = sh->addr,
                  .nonce = sh->nonce,
                  .port = sh->peer[sh->rank].where.port,
                  .host = sh->host,
                  .device = sh->device};
    return h;
}

/* NCCL's check after it has every rank's peer info: two ranks of one
 * communicator on the same GPU of the same host are refused. */
static ncclResult_t nc_check_duplicate(nc_shared *sh)
{
    const nc_where *me = &sh->peer[sh->rank].where;
    for (int p = 0; p < sh->nranks; p++)
        if (p != sh->rank && sh->peer[p].where.host == me->host &&
            sh->peer[p].where.device == me->device)
            return nc_fail(sh, ncclInvalidUsage,
                           "Duplicate GPU detected : rank %d and rank %d both on CUDA device %x",
                           sh->rank, p, me->device);
    return ncclSuccess;
}

/* Reads the root's answer and the table of addresses into sh->peer. */
static ncclResult_t nc_read_table(nc_shared *sh, int fd)
{
    nc_answer a;
    nc_io io = nc_xfer(fd, &a, sizeof(a), 0, sh->wake, -1);
    if (io == NC_IO_CLOSED)
        return nc_fail(sh, sh->peer_error,
                       "the bootstrap root dropped the registration (a wrong nonce: an id it "
                       "did not make), or gave up waiting");
    if (io != NC_IO_OK) return nc_io_fail(sh, io, "registering with the bootstrap root");
    if (a.magic != NC_HELLO_MAGIC || (a.status == ncclSuccess && a.nranks != sh->nranks))
        return nc_fail(sh, ncclInternalError, "garbled answer from the bootstrap root");
    if (a.status != ncclSuccess)
        return nc_fail(sh, (ncclResult_t)a.status, "the bootstrap root refused rank %d of %d: %s",
                       sh->rank, sh->nranks, nc_why_text(a.why));
    nc_where *table = calloc((size_t)sh->nranks, sizeof(*table));
    if (!table) return nc_fail(sh, ncclSystemError, "out of memory for the address table");
    io = nc_xfer(fd, table, (size_t)sh->nranks * sizeof(*table), 0, sh->wake, -1);
    for (int p = 0; io == NC_IO_OK && p < sh->nranks; p++)
        sh->peer[p].where = table[p];
    free(table);
    return io == NC_IO_OK ? ncclSuccess : nc_io_fail(sh, io, "reading the address table");
}

/* Listens, registers (rank, nranks, address, host, device) with the root,
 * gets the table. */
static ncclResult_t nc_register(nc_shared *sh)
{
    sh->peer[sh->rank].where.addr = sh->addr;
    sh->peer[sh->rank].where.host = sh->host;
    sh->peer[sh->rank].where.device = sh->device;
    sh->listen_fd = nc_listen(sh->addr, &sh->peer[sh->rank].where.port);
    if (sh->listen_fd < 0) return nc_fail(sh, ncclSystemError, "listen: %s", strerror(errno));
    int fd;
    nc_io io = nc_dial(sh->root.addr, sh->root.port, sh->wake, -1, &fd);
    if (io != NC_IO_OK) return nc_io_fail(sh, io, "connecting to the bootstrap root");
    nc_hello h = nc_hello_of(sh);
    io = nc_xfer(fd, &h, sizeof(h), 1, sh->wake, -1);
    ncclResult_t r = io == NC_IO_OK ? nc_read_table(sh, fd)
                                    : nc_io_fail(sh, io, "registering with the bootstrap root");
    close(fd);
    return r;
}

static int nc_hello_ok(const nc_shared *sh, const nc_hello *h)
{
    return h->magic == NC_HELLO_MAGIC && h->nonce == sh->nonce && h->nranks == sh->nranks &&
           h->rank >= 0 && h->rank < sh->nranks;
}

/* Connects to lower rank j and checks that j answers. */
static ncclResult_t nc_mesh_dial(nc_shared *sh, int j)
{
    int fd;
    nc_io io = nc_dial(sh->peer[j].where.addr, sh->peer[j].where.port, sh->wake, -1, &fd);
    if (io != NC_IO_OK) return nc_io_fail(sh, io, "connecting to rank %d", j);
    nc_hello h = nc_hello_of(sh), a;
    io = nc_xfer(fd, &h, sizeof(h), 1, sh->wake, -1);
    if (io == NC_IO_OK) io = nc_xfer(fd, &a, sizeof(a), 0, sh->wake, -1);
    if (io != NC_IO_OK) {
        nc_close_keep_errno(fd);
        return nc_io_fail(sh, io, "handshake with rank %d", j);
    }
    if (!nc_hello_ok(sh, &a) || a.rank != j) {
        close(fd);
        return nc_fail(sh, ncclInternalError, "rank %d's address answered as someone else", j);
    }
    sh->peer[j].fd = fd;
    return ncclSuccess;
}

/* Takes one connection to this rank's listener: 1 when it is a higher rank
 * not yet connected (answered and kept), 0 when refused (a wrong nonce, a
 * duplicate, a stranger: closed), -1 when the comm is stopping. */
static int nc_mesh_greet(nc_shared *sh, int fd)
{
    nc_hello h;
    nc_io io = nc_xfer(fd, &h, sizeof(h), 0, sh->wake, -1);
    if (io != NC_IO_OK || !nc_hello_ok(sh, &h) || h.rank <= sh->rank || sh->peer[h.rank].fd >= 0) {
        close(fd);
        return io == NC_IO_STOP ? -1 : 0;
    }
    nc_hello a = nc_hello_of(sh);
    io = nc_xfer(fd, &a, sizeof(a), 1, sh->wake, -1);
    if (io != NC_IO_OK) {
        close(fd);
        return io == NC_IO_STOP ? -1 : 0;
    }
    nc_nodelay(fd);
    sh->peer[h.rank].fd = fd;
    return 1;
}

/* Accepts until every higher rank is connected. */
static ncclResult_t nc_mesh_accept(nc_shared *sh)
{
    int missing = sh->nranks - 1 - sh->rank;
    while (missing > 0) {
        nc_io io = nc_wait(sh->listen_fd, POLLIN, sh->wake, -1);
        if (io != NC_IO_OK) return nc_io_fail(sh, io, "waiting for higher ranks");
        int fd = accept4(sh->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0 && (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED)) continue;
        if (fd < 0) return nc_fail(sh, ncclSystemError, "accept: %s", strerror(errno));
        int took = nc_mesh_greet(sh, fd);
        if (took < 0) return ncclInternalError;
        missing -= took;
    }
    return ncclSuccess;
}

static ncclResult_t nc_bootstrap(nc_shared *sh)
{
    ncclResult_t r = nc_register(sh);
    if (r == ncclSuccess) r = nc_check_duplicate(sh);
    for (int j = 0; r == ncclSuccess && j < sh->rank; j++)
        r = nc_mesh_dial(sh, j);
    if (r == ncclSuccess) r = nc_mesh_accept(sh);
    pthread_mutex_lock(&sh->mu);
    if (sh->listen_fd >= 0) close(sh->listen_fd);
    sh->listen_fd = -1;
    if (r == ncclSuccess) sh->ready = 1;
    pthread_cond_broadcast(&sh->ready_cv);
    pthread_mutex_unlock(&sh->mu);
    return r;
}

/* ---- the proxy: the comm thread once bootstrapped ---- */

/* Peer p is gone (err 0: EOF). An error unless it said goodbye, this comm
 * finished finalizing, or this comm is the one tearing down. */
static void nc_peer_lost(nc_shared *sh, int p, int err)
{
    char how[96];
    if (err)
        snprintf(how, sizeof(how), ": %s", strerror(err));
    else
        snprintf(how, sizeof(how), " closed");
    pthread_mutex_lock(&sh->mu);
    nc_peer *pe = &sh->peer[p];
    pe->closed = 1;
    if (!pe->bye && sh->finalize != NC_FIN_DONE && !sh->stopping)
        nc_fail_locked(sh, sh->peer_error, "connection to rank %d%s", p, how);
    pthread_mutex_unlock(&sh->mu);
}

/* The header of a frame from p is in: checks it and makes room for the
 * payload. A garbled header is a bug in this file, not a peer's fault. */
static int nc_rx_header(nc_shared *sh, int p)
{
    nc_peer *pe = &sh->peer[p];
    const nc_hdr *h = &pe->rx_hdr;
    if (h->magic != NC_FRAME_MAGIC || h->kind < NC_ALLREDUCE || h->kind > NC_BYE ||
        h->kind == NC_RECV)
        rt_die("rank %d: garbled frame from rank %d (magic %#x, kind %u)", sh->rank, p, h->magic,
               h->kind);
    pe->rx = h->bytes <= SIZE_MAX - sizeof(nc_msg) ? malloc(sizeof(nc_msg) + h->bytes) : NULL;
    if (!pe->rx) {
        pthread_mutex_lock(&sh->mu);
        pe->closed = 1; /* the rest of its stream cannot be read */
        nc_fail_locked(sh, ncclSystemError, "out of memory for %llu bytes from rank %d",
                       (unsigned long long)h->bytes, p);
        pthread_mutex_unlock(&sh->mu);
        return -1;
    }
    pe->rx->next = NULL;
    pe->rx->h = *h;
    pe->rx_got = 0;
    return 0;
}

/* A whole frame from p: into its inbox (a goodbye only marks p). */
static void nc_rx_deliver(nc_shared *sh, int p)
{
    nc_peer *pe = &sh->peer[p];
    nc_msg *m = pe->rx;
    pe->rx = NULL;
    pe->rx_got = 0;
    pthread_mutex_lock(&sh->mu);
    if (m->h.kind == NC_BYE) {
        pe->bye = 1;
        free(m);
    } else {
        if (pe->in_tail)
            pe->in_tail->next = m;
        else
            pe->in = m;
        pe->in_tail = m;
    }
    pthread_mutex_unlock(&sh->mu);
}

/* Reads what p has sent, frame by frame, without blocking; at most
 * NC_READ_BURST reads, so a peer streaming megabytes does not keep the
 * proxy from the others (poll calls again while there is more). */
static void nc_proxy_read(nc_shared *sh, int p)
{
    nc_peer *pe = &sh->peer[p];
    for (int burst = 0; !pe->closed && burst < NC_READ_BURST; burst++) {
        char *dst = pe->rx ? (char *)pe->rx->data + pe->rx_got : (char *)&pe->rx_hdr + pe->rx_got;
        size_t want = pe->rx ? pe->rx->h.bytes - pe->rx_got : sizeof(nc_hdr) - pe->rx_got;
        ssize_t k = recv(pe->fd, dst, want, 0); /* want > 0: empty frames are delivered at once */
        if (k == 0) return nc_peer_lost(sh, p, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (k < 0) return nc_peer_lost(sh, p, errno);
        pe->rx_got += (size_t)k;
        if (!pe->rx && pe->rx_got == sizeof(nc_hdr) && nc_rx_header(sh, p) != 0) return;
        if (pe->rx && pe->rx_got == pe->rx->h.bytes) nc_rx_deliver(sh, p);
    }
}

/* Writes p's queued frames until the socket is full. The head frame is the
 * proxy's to write and free; callers only append behind it. */
static void nc_proxy_write(nc_shared *sh, int p)
{
    nc_peer *pe = &sh->peer[p];
    while (!pe->closed) {
        pthread_mutex_lock(&sh->mu);
        nc_msg *m = pe->out;
        pthread_mutex_unlock(&sh->mu);
        if (!m) return;
        size_t total = sizeof(nc_hdr) + m->h.bytes;
        const char *from = (const char *)m + offsetof(nc_msg, h) + pe->out_off;
        ssize_t k = send(pe->fd, from, total - pe->out_off, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (k < 0) return nc_peer_lost(sh, p, errno);
        pe->out_off += (size_t)k;
        if (pe->out_off < total) continue;
        pthread_mutex_lock(&sh->mu);
        pe->out = m->next;
        if (!pe->out) pe->out_tail = NULL;
        pe->flushed++;
        pthread_mutex_unlock(&sh->mu);
        free(m);
        pe->out_off = 0;
    }
}

/* Fills the poll set: the eventfd, then each live peer (writable wanted
 * when it has frames queued). 0 when the comm is stopping. */
static int nc_proxy_fds(nc_shared *sh, struct pollfd *pfd, int *who, int *n)
{
    pthread_mutex_lock(&sh->mu);
    int stop = sh->stopping;
    pfd[0] = (struct pollfd){.fd = sh->wake, .events = POLLIN};
    *n = 1;
    for (int p = 0; p < sh->nranks; p++) {
        nc_peer *pe = &sh->peer[p];
        if (p == sh->rank || pe->closed) continue;
        pfd[*n] = (struct pollfd){.fd = pe->fd, .events = POLLIN | (pe->out ? POLLOUT : 0)};
        who[(*n)++] = p;
    }
    pthread_mutex_unlock(&sh->mu);
    return !stop;
}

/* Parks the thread until abort or destroy (the eventfd is drained first,
 * then the flag read, so a stop's write is never lost). */
static void nc_wait_stop(nc_shared *sh)
{
    while (!nc_stopping(sh)) {
        struct pollfd p = {.fd = sh->wake, .events = POLLIN};
        if (poll(&p, 1, -1) < 0 && errno != EINTR) return;
        nc_drain(sh->wake);
    }
}

static void nc_proxy(nc_shared *sh)
{
    struct pollfd *pfd = calloc((size_t)sh->nranks + 1, sizeof(*pfd));
    int *who = calloc((size_t)sh->nranks + 1, sizeof(*who));
    int n = 0;
    if (!pfd || !who) nc_fail(sh, ncclSystemError, "out of memory for the proxy");
    while (pfd && who && nc_proxy_fds(sh, pfd, who, &n)) {
        if (poll(pfd, (nfds_t)n, -1) < 0) {
            if (errno == EINTR) continue;
            nc_fail(sh, ncclSystemError, "poll: %s", strerror(errno));
            break;
        }
        if (pfd[0].revents) nc_drain(sh->wake);
        for (int i = 1; i < n; i++) {
            if (pfd[i].revents & (POLLIN | POLLHUP | POLLERR)) nc_proxy_read(sh, who[i]);
            if (pfd[i].revents & POLLOUT) nc_proxy_write(sh, who[i]);
        }
    }
    free(pfd);
    free(who);
    nc_wait_stop(sh);
}

static void *nc_thread(void *arg)
{
    nc_shared *sh = arg;
    if (sh->idle)
        nc_wait_stop(sh);
    else if (nc_bootstrap(sh) == ncclSuccess)
        nc_proxy(sh);
    return NULL;
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

typedef void (*nc_reducer)(void *acc, const void *in, size_t n, ncclRedOp_t op);

static const struct {
    size_t size;
    nc_reducer reduce; /* NULL: moved, never reduced */
} nc_types[ncclNumTypes] = {
    [ncclInt8] = {1, nc_reduce_i8},     [ncclUint8] = {1, nc_reduce_u8},
    [ncclInt32] = {4, nc_reduce_i32},   [ncclUint32] = {4, nc_reduce_u32},
    [ncclInt64] = {8, nc_reduce_i64},   [ncclUint64] = {8, nc_reduce_u64},
    [ncclFloat16] = {2, NULL},          [ncclFloat32] = {4, nc_reduce_f32},
    [ncclFloat64] = {8, nc_reduce_f64}, [ncclBfloat16] = {2, NULL},
    [ncclFloat8e4m3] = {1, NULL},       [ncclFloat8e5m2] = {1, NULL},
};

/* ---- work: one call's parameters and progress ---- */

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

static size_t nc_bytes(const nc_work *w)
{
    return w->count * nc_types[w->type].size;
}

/* The bytes of the send and receive buffers the call touches. */
static void nc_extent(const nc_work *w, int rank, int nranks, size_t *send, size_t *recv)
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

static nc_msg *nc_frame(const nc_work *w, int kind, const void *data, size_t bytes)
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

static void nc_append_locked(nc_peer *pe, nc_msg *m)
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

/* A call waiting to be queued: made by the API, queued at once or at the
 * outermost ncclGroupEnd. */
typedef struct nc_pending {
    const char *name, *action;
    cudaStream_t stream;
    int nonblocking; /* its comm's: the call is launched later (nc_defer) */
    nc_work work;
} nc_pending;

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
static ncclResult_t nc_enqueue(nc_pending *items, int n)
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
static ncclResult_t nc_group_flush(nc_pending *it, int n)
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

static ncclResult_t nc_defer(nc_pending *items, int n);

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

/* ---- non-blocking calls: launched later, from the runtime's own thread ---- */

/* On a non-blocking communicator NCCL 2.28 answers every collective (and
 * every group) with ncclInProgress and queues its kernel later, from a
 * thread of its own; until ncclCommGetAsyncError says ncclSuccess the
 * communicator takes no other call and its stream must get no CUDA work.
 * So here: the call becomes a job on one launch thread, which queues it
 * only after the caller has asked the communicator's state at least once
 * (or NC_LAUNCH_LATE_MS have passed: NCCL's thread does not wait to be
 * asked); until then the job's streams are held (rt_stream_hold), and
 * CUDA work queued on them is reported as a race. */
#define NC_LAUNCH_LATE_MS 20

typedef struct nc_job {
    struct nc_job *next;
    nc_pending *item;
    int n;
    int64_t late_ms; /* launched by then even if nobody asks */
    int asked;       /* ncclCommGetAsyncError was called on one of its comms */
} nc_job;

static pthread_mutex_t nc_launch_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t nc_launch_cv;
static pthread_once_t nc_launch_once = PTHREAD_ONCE_INIT;
static nc_job *nc_jobs; /* in call order */
static int nc_launch_started;

/* Under nc_launch_mu: the job's comms point at it (job) or at nothing. */
static void nc_job_mark(nc_job *j, nc_job *to)
{
    for (int i = 0; i < j->n; i++) {
        nc_shared *sh = j->item[i].work.sh;
        if (!sh) continue;
        pthread_mutex_lock(&sh->mu);
        sh->job = to;
        pthread_mutex_unlock(&sh->mu);
    }
}

/* Under nc_launch_mu: item i will not be launched (its comm was torn down). */
static void nc_job_drop_item(nc_job *j, int i)
{
    nc_pending *it = &j->item[i];
    if (!it->work.sh) return;
    rt_stream_hold(it->stream, -1, NULL);
    pthread_mutex_lock(&it->work.sh->mu);
    it->work.sh->job = NULL;
    pthread_mutex_unlock(&it->work.sh->mu);
    nc_unref(it->work.sh);
    it->work.sh = NULL;
}

/* Under nc_launch_mu: queues the job's calls as the blocking path would,
 * then lets its streams and comms go. A failure to queue becomes the
 * comms' async error, as a failed launch does in NCCL. */
static void nc_job_launch(nc_job *j)
{
    int k = 0;
    for (int i = 0; i < j->n; i++)
        if (j->item[i].work.sh) j->item[k++] = j->item[i];
    j->n = k;
    /* The flush hands each item's reference on to its op; one more each
     * keeps the comms here until they are told the call settled. */
    for (int i = 0; i < k; i++)
        nc_ref(j->item[i].work.sh);
    rt_set_launcher(1);
    ncclResult_t r = k > 0 ? nc_group_flush(j->item, k) : ncclSuccess;
    rt_set_launcher(0);
    for (int i = 0; i < k; i++) {
        rt_stream_hold(j->item[i].stream, -1, NULL);
        if (r != ncclSuccess)
            nc_fail(j->item[i].work.sh, r, "launching %s: %s", j->item[0].name, nc_tls_reason);
    }
    nc_job_mark(j, NULL); /* settled: ncclCommGetAsyncError says so from now on */
    for (int i = 0; i < k; i++)
        nc_unref(j->item[i].work.sh);
}

static void *nc_launcher(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&nc_launch_mu);
    for (;;) {
        nc_job *j = nc_jobs;
        if (!j) {
            pthread_cond_wait(&nc_launch_cv, &nc_launch_mu);
            continue;
        }
        if (!j->asked && mono_now_ms() < j->late_ms) {
            struct timespec until = mono_deadline((int)(j->late_ms - mono_now_ms()));
            pthread_cond_timedwait(&nc_launch_cv, &nc_launch_mu, &until);
            continue;
        }
        nc_jobs = j->next;
        nc_job_launch(j);
        free(j->item);
        free(j);
    }
    return NULL;
}

static void nc_launch_init(void)
{
    pthread_t t;
    pthread_attr_t attr;
    if (mono_cond_init(&nc_launch_cv) != 0) rt_die("launch thread: condition variable");
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    nc_launch_started = pthread_create(&t, &attr, nc_launcher, NULL) == 0;
    pthread_attr_destroy(&attr);
}

/* A non-blocking call (one, or a group's): held until launched. */
static ncclResult_t nc_defer(nc_pending *items, int n)
{
    if (n == 0) return ncclSuccess;
    pthread_once(&nc_launch_once, nc_launch_init);
    nc_job *j = calloc(1, sizeof(*j));
    nc_pending *copy = j ? malloc(sizeof(*copy) * (size_t)n) : NULL;
    if (!nc_launch_started || !copy) {
        free(j);
        for (int i = 0; i < n; i++)
            nc_unref(items[i].work.sh);
        return nc_fail_here(ncclSystemError, "%s: cannot start NCCL's launch thread",
                            items[0].name);
    }
    memcpy(copy, items, sizeof(*copy) * (size_t)n);
    *j = (nc_job){.item = copy, .n = n, .late_ms = mono_now_ms() + NC_LAUNCH_LATE_MS};
    for (int i = 0; i < n; i++)
        rt_stream_hold(items[i].stream, +1, items[i].name);
    pthread_mutex_lock(&nc_launch_mu);
    nc_job_mark(j, j);
    nc_job **tail = &nc_jobs;
    while (*tail)
        tail = &(*tail)->next;
    *tail = j;
    pthread_cond_broadcast(&nc_launch_cv);
    pthread_mutex_unlock(&nc_launch_mu);
    return ncclInProgress;
}

/* ncclCommGetAsyncError on a comm with a job: the job may go now. */
static void nc_job_asked(nc_shared *sh)
{
    pthread_mutex_lock(&nc_launch_mu);
    for (nc_job *j = nc_jobs; j; j = j->next)
        for (int i = 0; i < j->n; i++)
            if (j->item[i].work.sh == sh) j->asked = 1;
    pthread_cond_broadcast(&nc_launch_cv);
    pthread_mutex_unlock(&nc_launch_mu);
}

/* A comm torn down: its calls that were never launched never will be. */
static void nc_job_cancel(nc_shared *sh)
{
    pthread_mutex_lock(&nc_launch_mu);
    for (nc_job *j = nc_jobs; j; j = j->next)
        for (int i = 0; i < j->n; i++)
            if (j->item[i].work.sh == sh) nc_job_drop_item(j, i);
    pthread_mutex_unlock(&nc_launch_mu);
}

/* ---- the calls that queue work ---- */

/* NCCL's "ensure ready": a comm with an async error answers with it; one
 * still initializing (or finalizing, for new work) cannot take calls. */
static ncclResult_t nc_usable(ncclComm_t comm, const char *name, int for_work)
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

const char *ncclGetLastError(ncclComm_t comm)
{
    if (comm) {
        pthread_mutex_lock(&comm->sh->mu);
        int failed = comm->sh->error != ncclSuccess;
        if (failed) memcpy(comm->last, comm->sh->reason, sizeof(comm->last));
        pthread_mutex_unlock(&comm->sh->mu);
        if (failed) return comm->last;
    }
    return nc_tls_reason;
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
