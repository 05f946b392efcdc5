/* comm_impl.h: what a collectives backend provides (private to trainer/).
 *
 * comm.c owns the parts every backend shares: argument checks, the "dead
 * after the first error" rule, the abort flag and the last error line. A
 * backend fills a comm_ops table and embeds struct comm as its first member,
 * so the generic layer and the backend share one allocation.
 */
#ifndef DUCTILE_COMM_IMPL_H
#define DUCTILE_COMM_IMPL_H

#include <stdatomic.h>

#include "ductile/comm.h"

typedef struct comm_ops {
    const char *name; /* "ring", "shm", "hier", "nccl" */
    comm_err (*allreduce_sum_f32)(comm *c, float *buf, size_t n);
    comm_err (*broadcast)(comm *c, void *buf, size_t bytes, int root);
    comm_err (*allgather)(comm *c, const void *send, size_t bytes, void *recv);
    comm_err (*barrier)(comm *c);
    /* The next collective starts once `event` (a backend's device event)
     * has happened, with no host round trip; NULL: a backend without
     * device streams (the ring), where comm_allreduce_sum_f32_after with an
     * event is an invalid argument. */
    comm_err (*wait_event)(comm *c, void *event);
    /* An all-reduce queued, not waited for, and the wait for all of them
     * (comm_allreduce_sum_f32_start, comm_wait); NULL: the backend's
     * all-reduce completes at once, and there is nothing to wait for. */
    comm_err (*allreduce_start)(comm *c, float *buf, size_t n);
    comm_err (*wait)(comm *c);
    /* Called from any thread after the abort flag is set: wake calls in flight. */
    void (*abort)(comm *c);
    /* Releases the backend's resources and the allocation itself. */
    void (*destroy)(comm *c);
} comm_ops;

struct comm {
    const comm_ops *ops;
    int rank;
    int world_size;
    atomic_int aborted; /* set by comm_abort() from any thread */
    comm_err dead;      /* first error; every later call returns it */
    char last_error[COMM_MSG_MAX];
};

/* Ranks one shared-memory segment takes. */
#define SHM_MAX_RANKS 64

/* This process's host for shared memory: the kernel's boot id and the
 * network namespace's inode ("same kernel, same abstract socket
 * namespace"); 0, or -1 when /proc cannot say. */
int comm_host_id(char *out, size_t len);

/* comm_choose.c: how a round's ranks meet, decided by rank 0 from what
 * every rank publishes (its device, node and host) and followed by all.
 * A CPU rank of a round of world >= 2 (cfg->store set): publishes, waits
 * for rank 0's verdict until deadline (rank 0 makes it). A refused round
 * is COMM_ERR_ARG with the one line in c's last error; *host_of is
 * malloc'd (world entries) when the ranks share hosts, NULL for the ring. */
comm_err comm_choose(comm *c, const comm_config *cfg, int64_t deadline, int **host_of);
/* A CUDA rank: publishes its entry; rank 0 also publishes "transport"
 * ("nccl NODE"), so a CPU rank of the round stops at once. */
comm_err comm_choose_nccl(comm *c, const comm_config *cfg);
/* When a store value of len bytes (the NCCL id a CUDA rank waits for) is a
 * CPU rank 0's refusal of the round, "refused REASON": REASON (the value
 * ends there); else NULL. */
const char *comm_choose_refused(const char *v, size_t len);

/* Fills the shared part of a new comm. */
void comm_base_init(comm *c, const comm_ops *ops, int rank, int world_size);

/* Records a one-line error (printf-style) and returns err; the first one wins. */
comm_err comm_fail(comm *c, comm_err err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* A round store call of a bootstrap failed: its deadline is a silent peer
 * (TIMEOUT), anything else the store's (STORE); says what and why. */
comm_err comm_store_error(comm *c, rdzv_store *s, rdzv_err e, const char *what);

/* Ends a failed init whose reason is why (NULL or "" when none was
 * recorded): says it in cfg->msg and returns err. */
comm_err comm_init_failed(const comm_config *cfg, comm_err err, const char *why);

/* 1 once comm_abort() was called. */
int comm_is_aborted(const comm *c);

/* Test hook: a ring over already-connected stream sockets (left: receives
 * from rank-1, right: sends to rank+1; AF_UNIX socketpairs work too). Takes
 * ownership of both fds, also on failure. */
comm_err comm_ring_from_fds(const comm_config *cfg, int left_fd, int right_fd, comm **out);

/* comm_cpu_init's hierarchical comm for ranks on several hosts, some
 * shared: host_of[r] is rank r's host index (0..H-1, a host's leader is its
 * lowest rank); local is the shared-memory comm of this rank's host (NULL
 * when it is alone there), leaders the ring among the leaders (only on a
 * leader). Takes ownership of both only on success. */
comm_err comm_hier_new(const comm_config *cfg, const int *host_of, comm *local, comm *leaders,
                       comm **out);

/* Test and bench hook: shared memory without a store. memfd is a zeroed
 * segment of comm_shm_bytes(world) bytes (mapped here, not owned);
 * peer_fd[r] is a connected stream socket to rank r, or -1 at this rank
 * (owned, also on failure). Returns once every rank has joined. */
size_t comm_shm_bytes(int world);
comm_err comm_shm_from_fds(const comm_config *cfg, int memfd, const int *peer_fd, comm **out);

#endif
