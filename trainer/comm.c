/* comm.c: the backend-neutral half of the collectives interface.
 *
 * Every public call goes through here: arguments are checked once, a comm
 * that has failed stays failed (a collective that broke half-way leaves the
 * ranks out of step, so the only safe thing is to rebuild the group), and
 * the call is dispatched to the backend's ops table (ring on CPU, NCCL on
 * GPU). The first error's line is kept for comm_last_error().
 */
#include "comm_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

const char *comm_strerror(comm_err err)
{
    switch (err) {
    case COMM_OK:
        return "ok";
    case COMM_ERR_ARG:
        return "invalid argument";
    case COMM_ERR_NOMEM:
        return "out of memory";
    case COMM_ERR_SYS:
        return "system call failed";
    case COMM_ERR_PEER:
        return "peer failed or closed its connection";
    case COMM_ERR_TIMEOUT:
        return "peer silent past the deadline";
    case COMM_ERR_STORE:
        return "round store failed during bootstrap";
    case COMM_ERR_ABORTED:
        return "communicator aborted";
    case COMM_ERR_CUDA:
        return "CUDA error";
    case COMM_ERR_NCCL:
        return "NCCL error";
    }
    return "unknown error";
}

int comm_err_is_peer(comm_err err)
{
    return err == COMM_ERR_PEER || err == COMM_ERR_TIMEOUT || err == COMM_ERR_ABORTED ||
           err == COMM_ERR_STORE;
}

void comm_base_init(comm *c, const comm_ops *ops, int rank, int world_size)
{
    c->ops = ops;
    c->rank = rank;
    c->world_size = world_size;
    atomic_init(&c->aborted, 0);
    c->dead = COMM_OK;
    c->last_error[0] = '\0';
}

comm_err comm_fail(comm *c, comm_err err, const char *fmt, ...)
{
    if (c->dead != COMM_OK) return c->dead;
    c->dead = err;
    int k = snprintf(c->last_error, sizeof(c->last_error), "%s: ", c->ops->name);
    if (k < 0 || (size_t)k >= sizeof(c->last_error)) return err;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->last_error + k, sizeof(c->last_error) - (size_t)k, fmt, ap);
    va_end(ap);
    return err;
}

comm_err comm_store_error(comm *c, rdzv_store *s, rdzv_err e, const char *what)
{
    return comm_fail(c, e == RDZV_ERR_TIMEOUT ? COMM_ERR_TIMEOUT : COMM_ERR_STORE, "%s: %s (%s)",
                     what, rdzv_strerror(e), rdzv_store_last_error(s));
}

/* A failed init frees its comm, so the reason goes to the caller's cfg->msg.
 * A caller that gives none still gets the line on stderr it always got
 * (tests read it): transitional, until trainer/main.c and elastic.c pass a
 * msg and log it themselves; then this fallback goes. */
comm_err comm_init_failed(const comm_config *cfg, comm_err err, const char *why)
{
    if (cfg && cfg->msg) snprintf(cfg->msg, COMM_MSG_MAX, "%s", why && why[0] ? why : "");
    return err;
}

int comm_is_aborted(const comm *c)
{
    return atomic_load(&((comm *)c)->aborted);
}

int comm_rank(const comm *c)
{
    return c ? c->rank : -1;
}

const char *comm_backend(const comm *c)
{
    return c ? c->ops->name : "none";
}

int comm_world_size(const comm *c)
{
    return c ? c->world_size : 0;
}

/* Common entry check: a failed or aborted comm answers at once. */
static comm_err comm_enter(comm *c)
{
    if (c->dead != COMM_OK) return c->dead;
    if (comm_is_aborted(c)) return comm_fail(c, COMM_ERR_ABORTED, "aborted");
    return COMM_OK;
}

/* Backends report errors through comm_fail(); this makes sure a failing
 * call always leaves the comm dead, even if a backend forgot to. */
static comm_err comm_leave(comm *c, comm_err err)
{
    if (err != COMM_OK && c->dead == COMM_OK) comm_fail(c, err, "%s", comm_strerror(err));
    return err;
}

comm_err comm_allreduce_sum_f32(comm *c, float *buf, size_t n)
{
    if (!c || (!buf && n > 0)) return COMM_ERR_ARG;
    comm_err err = comm_enter(c);
    if (err != COMM_OK) return err;
    if (n == 0) return COMM_OK;
    return comm_leave(c, c->ops->allreduce_sum_f32(c, buf, n));
}

comm_err comm_allreduce_sum_f32_after(comm *c, float *buf, size_t n, void *event)
{
    if (!event) return comm_allreduce_sum_f32(c, buf, n);
    if (!c || (!buf && n > 0) || !c->ops->wait_event) return COMM_ERR_ARG;
    comm_err err = comm_enter(c);
    if (err != COMM_OK) return err;
    if (n == 0) return COMM_OK;
    err = comm_leave(c, c->ops->wait_event(c, event));
    if (err != COMM_OK) return err;
    return comm_leave(c, c->ops->allreduce_sum_f32(c, buf, n));
}

comm_err comm_allreduce_sum_f32_start(comm *c, float *buf, size_t n, void *event)
{
    if (!c || !c->ops->allreduce_start) return comm_allreduce_sum_f32_after(c, buf, n, event);
    if ((!buf && n > 0) || (event && !c->ops->wait_event)) return COMM_ERR_ARG;
    comm_err err = comm_enter(c);
    if (err != COMM_OK || n == 0) return err;
    if (event && (err = comm_leave(c, c->ops->wait_event(c, event))) != COMM_OK) return err;
    return comm_leave(c, c->ops->allreduce_start(c, buf, n));
}

comm_err comm_wait(comm *c)
{
    if (!c) return COMM_ERR_ARG;
    comm_err err = comm_enter(c);
    if (err != COMM_OK || !c->ops->wait) return err;
    return comm_leave(c, c->ops->wait(c));
}

comm_err comm_broadcast(comm *c, void *buf, size_t bytes, int root)
{
    if (!c || (!buf && bytes > 0) || root < 0 || root >= c->world_size) return COMM_ERR_ARG;
    comm_err err = comm_enter(c);
    if (err != COMM_OK) return err;
    if (bytes == 0) return COMM_OK;
    return comm_leave(c, c->ops->broadcast(c, buf, bytes, root));
}

comm_err comm_allgather(comm *c, const void *send, size_t bytes, void *recv)
{
    if (!c || (bytes > 0 && (!send || !recv))) return COMM_ERR_ARG;
    comm_err err = comm_enter(c);
    if (err != COMM_OK) return err;
    if (bytes == 0) return COMM_OK;
    return comm_leave(c, c->ops->allgather(c, send, bytes, recv));
}

comm_err comm_barrier(comm *c)
{
    if (!c) return COMM_ERR_ARG;
    comm_err err = comm_enter(c);
    if (err != COMM_OK) return err;
    return comm_leave(c, c->ops->barrier(c));
}

void comm_abort(comm *c)
{
    if (!c) return;
    atomic_store(&c->aborted, 1);
    c->ops->abort(c);
}

comm_err comm_error(const comm *c)
{
    if (!c) return COMM_OK;
    if (c->dead != COMM_OK) return c->dead;
    return comm_is_aborted(c) ? COMM_ERR_ABORTED : COMM_OK;
}

const char *comm_last_error(const comm *c)
{
    return c ? c->last_error : "";
}

void comm_free(comm *c)
{
    if (c) c->ops->destroy(c);
}
