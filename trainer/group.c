/* group.c: the trainer's process group (group.h).
 *
 * The one idea: the environment is read once, into a group_env, and a group
 * is always built the same way from it, whether it is the first one (rank,
 * world and round from the environment) or a rebuild (from the agent's
 * `round` line): open the round's store, then bootstrap the communicator
 * through it. A failure says whose it is, a peer's or this process's,
 * because the agent counts only the latter against --max-restarts.
 */
#include "group.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ductile/control.h" /* the agent-worker contract: the environment's names */

static int env_int(const char *name, long long lo, long long hi, long long dflt, long long *out,
                   char *msg)
{
    const char *v = getenv(name);
    int64_t x;
    if (!v) {
        *out = dflt;
        return 0;
    }
    if (ctl_int(v, lo, hi, &x) != 0) {
        snprintf(msg, GROUP_MSG_MAX, "environment %s='%s' is not an integer in %lld..%lld", name, v,
                 lo, hi);
        return -1;
    }
    *out = x;
    return 0;
}

int group_env_read(group_env *env, char *msg)
{
    long long rank, world, local, lws, round, fd;
    memset(env, 0, sizeof(*env));
    /* The torchrun names of CTL_ENV_VARS, then ductile's own. */
    if (env_int(CTL_ENV_WORLD_SIZE, 1, 65536, 1, &world, msg) ||
        env_int(CTL_ENV_RANK, 0, world - 1, 0, &rank, msg) ||
        env_int(CTL_ENV_LOCAL_WORLD_SIZE, 1, 65536, 1, &lws, msg) ||
        env_int(CTL_ENV_LOCAL_RANK, 0, lws - 1, 0, &local, msg) ||
        env_int(CTL_ENV_ROUND, 0, LLONG_MAX, 0, &round, msg) ||
        env_int(CTL_ENV, 0, INT_MAX, -1, &fd, msg))
        return -1;
    env->rank = (int)rank;
    env->world = (int)world;
    env->local_rank = (int)local;
    env->local_world = (int)lws;
    env->round = round;
    env->control_fd = (int)fd;
    env->etcd.endpoints = getenv(CTL_ENV_ENDPOINTS);
#define READ_CREDENTIAL(name, field) env->etcd.field = getenv(name);
    CTL_ENV_CREDENTIALS(READ_CREDENTIAL)
#undef READ_CREDENTIAL
    env->job = getenv(CTL_ENV_JOB);
    env->node_addr = getenv(CTL_ENV_NODE_ADDR);
    if (world > 1 && (!env->etcd.endpoints || !env->job || !getenv(CTL_ENV_ROUND))) {
        snprintf(msg, GROUP_MSG_MAX, "WORLD_SIZE=%lld needs %s, %s and %s", world,
                 CTL_ENV_ENDPOINTS, CTL_ENV_JOB, CTL_ENV_ROUND);
        return -1;
    }
    return 0;
}

group_err group_connect(group *g, const group_env *env, const group_link *link, char *msg)
{
    g->store = NULL;
    g->comm = NULL;
    msg[0] = '\0';
    if (g->world == 1) return GROUP_OK;
    if (!env->etcd.endpoints || !env->job) {
        snprintf(msg, GROUP_MSG_MAX, "%s and %s must be set", CTL_ENV_ENDPOINTS, CTL_ENV_JOB);
        return GROUP_ERR_LOCAL;
    }
    rdzv_err re = rdzv_store_open(&env->etcd, env->job, g->round, &g->store);
    if (re != RDZV_OK) {
        snprintf(msg, GROUP_MSG_MAX, "round %lld store of job %s: %s", (long long)g->round,
                 env->job, rdzv_strerror(re));
        g->store = NULL;
        return re == RDZV_ERR_ARG || re == RDZV_ERR_NOMEM ? GROUP_ERR_LOCAL : GROUP_ERR_PEER;
    }
    char why[COMM_MSG_MAX] = "";
    comm_config cc = {.rank = g->rank,
                      .world_size = g->world,
                      .store = g->store,
                      /* The ring listens on, and publishes, this node's address. */
                      .host = link->host ? link->host : env->node_addr,
                      .timeout_ms = link->timeout_ms,
                      .device = link->device,
                      .transport = link->transport,
                      .msg = why,
                      .cancelled = link->cancelled,
                      .cancel_ctx = link->cancel_ctx,
                      .failed_here = link->failed_here,
                      .failed_ctx = link->failed_ctx};
    comm_err ce = link->cuda ? comm_nccl_init(&cc, &g->comm) : comm_cpu_init(&cc, &g->comm);
    if (ce != COMM_OK) {
        /* The backend says why in cc.msg; the store's last error may add to it. */
        const char *detail = rdzv_store_last_error(g->store);
        snprintf(msg, GROUP_MSG_MAX, "round %lld: building the %s: %s%s%s%s%s", (long long)g->round,
                 link->cuda ? "NCCL communicator" : "communicator", comm_strerror(ce),
                 why[0] ? ": " : "", why, detail[0] ? ": " : "", detail);
        rdzv_store_close(g->store);
        g->store = NULL;
        g->comm = NULL;
        return comm_err_is_peer(ce) ? GROUP_ERR_PEER : GROUP_ERR_LOCAL;
    }
    return GROUP_OK;
}

void group_leave(group *g)
{
    comm_free(g->comm);
    rdzv_store_close(g->store);
    g->comm = NULL;
    g->store = NULL;
}
