/* group.h: the trainer's process group (private to ductile-train).
 *
 * A group is this process's place in one round: its rank, the world, the
 * round's store and the communicator built through it (a TCP ring, or NCCL
 * on a GPU). A world of one has neither store nor communicator. The first
 * group comes from the environment ductile-agent starts the worker with
 * (control.h); every later one, after an in-place rebuild, from the round
 * the agent announces. Both are built by the same group_connect().
 */
#ifndef DUCTILE_TRAIN_GROUP_H
#define DUCTILE_TRAIN_GROUP_H

#include <stdint.h>

#include "ductile/comm.h"
#include "ductile/rdzv.h"

/* The size of the msg buffers group_* functions fill with a one-line reason. */
#define GROUP_MSG_MAX 512

/* What the agent told this worker through its environment (control.h),
 * read once at start. Without an agent: a world of one, round 0. */
typedef struct group_env {
    int rank, world, local_rank, local_world;
    int64_t round;
    int control_fd;        /* the control channel, or -1 */
    rdzv_etcd etcd;        /* endpoints and credentials (NULL when unset) */
    const char *job;       /* NULL when unset */
    const char *node_addr; /* where this node's workers listen, or NULL */
} group_env;

/* Reads and checks the environment. 0, or -1 with the reason in msg
 * (GROUP_MSG_MAX bytes). */
int group_env_read(group_env *env, char *msg);

typedef struct group {
    int rank, world, local_world;
    int64_t round;
    rdzv_store *store;
    comm *comm;
} group;

typedef enum {
    GROUP_OK = 0,
    GROUP_ERR_PEER,  /* a peer or the store is missing: a membership change, not ours */
    GROUP_ERR_LOCAL, /* this process failed: configuration, memory, a socket, CUDA */
} group_err;

/* How this process's end of the communicator is set up. */
typedef struct group_link {
    const char *host;         /* address to listen on and publish; NULL: env->node_addr */
    int timeout_ms;           /* deadline for a silent peer */
    int cuda;                 /* NCCL on CUDA device `device` instead of the CPU transports */
    comm_transport transport; /* on CPU: shared memory, the TCP ring or either (auto) */
    int device;
    /* Optional: 1 when the round being built already ended (comm_config.cancelled). */
    int (*cancelled)(void *ctx);
    void *cancel_ctx;
    /* Optional: this process's own NCCL failure, said before the teardown
     * (comm_config.failed_here). */
    void (*failed_here)(void *ctx, const char *why);
    void *failed_ctx;
} group_link;

/* Builds g's store and communicator for its rank, world and round (set by
 * the caller; a world of one gets neither). On failure g has neither and
 * msg (GROUP_MSG_MAX bytes) says what failed. */
group_err group_connect(group *g, const group_env *env, const group_link *link, char *msg);
/* Frees the communicator and closes the store; g keeps its rank and round. */
void group_leave(group *g);

#endif
