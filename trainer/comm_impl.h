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
