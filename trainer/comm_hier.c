/* comm_hier.c: collectives for ranks on several hosts, some sharing one.
 *
 * Two comms joined: shared memory among the ranks of each host (comm_shm.c)
 * and the TCP ring among one leader per host (its lowest rank). Every
 * collective is local, then between hosts, then local again: allreduce is
 * a local allreduce, the leaders' ring allreduce of the host sums, and a
 * local broadcast from the leader; so the slow network carries each byte
 * once per host instead of once per rank. comm_cpu_init (comm_cpu.c)
 * builds the parts (which rank is on which host is rank 0's decision in
 * the round store).
 *
 * Failure: the first part to fail fails the whole comm, and this rank then
 * aborts both parts, so its local peers (the segment's dead word) and the
 * other hosts (the ring's sockets shut) fail at once instead of waiting out
 * their deadlines.
 *
 * Knowingly simple: the local step of an allreduce is a full allreduce
 * where a reduce to the leader would do (it costs one more local copy, far
 * cheaper than the ring step), and allgather pads every host's block to
 * the largest host's, so the ring's equal blocks fit.
 */
#include "comm_impl.h"

#include <stdlib.h>
#include <string.h>

typedef struct hier {
    comm base;     /* first: comm.c sees the same pointer */
    comm *local;   /* this host's ranks; NULL when alone on it */
    comm *leaders; /* the ring among leaders; NULL off a leader */
    int nhosts, host, maxlocal;
    int *host_of; /* per rank */
    int *lrank;   /* per rank: its index on its host */
} hier;

/* Records a part's failure as the comm's and drops both parts' peers. */
static comm_err hier_fail(hier *h, comm *part, comm_err err)
{
    comm_abort(h->local);
    comm_abort(h->leaders);
    if (comm_is_aborted(&h->base)) return comm_fail(&h->base, COMM_ERR_ABORTED, "aborted");
    return comm_fail(&h->base, err, "%s", comm_last_error(part));
}

#define HIER_STEP(h, part, call)                                                                   \
    do {                                                                                           \
        if (part) {                                                                                \
            comm_err e_ = (call);                                                                  \
            if (e_ != COMM_OK) return hier_fail(h, part, e_);                                      \
        }                                                                                          \
    } while (0)

static comm_err hier_allreduce(comm *c, float *buf, size_t n)
{
    hier *h = (hier *)c;
    HIER_STEP(h, h->local, comm_allreduce_sum_f32(h->local, buf, n));
    HIER_STEP(h, h->leaders, comm_allreduce_sum_f32(h->leaders, buf, n));
    HIER_STEP(h, h->local, comm_broadcast(h->local, buf, n * sizeof(float), 0));
    return COMM_OK;
}

static comm_err hier_broadcast(comm *c, void *buf, size_t bytes, int root)
{
    hier *h = (hier *)c;
    int rh = h->host_of[root];
    if (rh == h->host) HIER_STEP(h, h->local, comm_broadcast(h->local, buf, bytes, h->lrank[root]));
    HIER_STEP(h, h->leaders, comm_broadcast(h->leaders, buf, bytes, rh));
    if (rh != h->host) HIER_STEP(h, h->local, comm_broadcast(h->local, buf, bytes, 0));
    return COMM_OK;
}

/* Host blocks of maxlocal ranks each, in host order: gathered locally,
 * between leaders, spread locally, then put in rank order. */
static comm_err hier_allgather(comm *c, const void *send, size_t bytes, void *recv)
{
    hier *h = (hier *)c;
    size_t block = (size_t)h->maxlocal * bytes;
    char *all = calloc((size_t)h->nhosts, block);
    if (!all) return comm_fail(c, COMM_ERR_NOMEM, "out of memory");
    char *mine = all + (size_t)h->host * block;
    comm_err err = COMM_OK;
    if (h->local)
        err = comm_allgather(h->local, send, bytes, mine);
    else
        memcpy(mine, send, bytes);
    if (err != COMM_OK) {
        err = hier_fail(h, h->local, err);
        goto out;
    }
    if (h->leaders && (err = comm_allgather(h->leaders, mine, block, all)) != COMM_OK) {
        err = hier_fail(h, h->leaders, err);
        goto out;
    }
    if (h->local &&
        (err = comm_broadcast(h->local, all, block * (size_t)h->nhosts, 0)) != COMM_OK) {
        err = hier_fail(h, h->local, err);
        goto out;
    }
    for (int r = 0; r < h->base.world_size; r++)
        memcpy((char *)recv + (size_t)r * bytes,
               all + (size_t)h->host_of[r] * block + (size_t)h->lrank[r] * bytes, bytes);
out:
    free(all);
    return err;
}

static comm_err hier_barrier(comm *c)
{
    hier *h = (hier *)c;
    HIER_STEP(h, h->local, comm_barrier(h->local));
    HIER_STEP(h, h->leaders, comm_barrier(h->leaders));
    HIER_STEP(h, h->local, comm_barrier(h->local));
    return COMM_OK;
}

static void hier_abort(comm *c)
{
    hier *h = (hier *)c;
    comm_abort(h->local);
    comm_abort(h->leaders);
}

static void hier_destroy(comm *c)
{
    hier *h = (hier *)c;
    comm_free(h->local);
    comm_free(h->leaders);
    free(h->host_of);
    free(h->lrank);
    free(h);
}

static const comm_ops hier_ops = {.name = "hier",
                                  .allreduce_sum_f32 = hier_allreduce,
                                  .broadcast = hier_broadcast,
                                  .allgather = hier_allgather,
                                  .barrier = hier_barrier,
                                  .wait_event = NULL,
                                  .abort = hier_abort,
                                  .destroy = hier_destroy};

comm_err comm_hier_new(const comm_config *cfg, const int *host_of, comm *local, comm *leaders,
                       comm **out)
{
    int w = cfg->world_size;
    hier *h = calloc(1, sizeof(*h));
    int *count = calloc((size_t)w, sizeof(int));
    if (h) {
        h->host_of = malloc(sizeof(int) * (size_t)w);
        h->lrank = malloc(sizeof(int) * (size_t)w);
    }
    if (!h || !count || !h->host_of || !h->lrank) {
        if (h) {
            free(h->host_of);
            free(h->lrank);
        }
        free(h);
        free(count);
        return COMM_ERR_NOMEM;
    }
    comm_base_init(&h->base, &hier_ops, cfg->rank, w);
    h->local = local;
    h->leaders = leaders;
    h->host = host_of[cfg->rank];
    for (int r = 0; r < w; r++) {
        h->host_of[r] = host_of[r];
        h->lrank[r] = count[host_of[r]]++;
        if (host_of[r] + 1 > h->nhosts) h->nhosts = host_of[r] + 1;
        if (count[host_of[r]] > h->maxlocal) h->maxlocal = count[host_of[r]];
    }
    free(count);
    *out = &h->base;
    return COMM_OK;
}
