/* comm_shm_coll.c: the shared-memory collectives, over the segment of
 * comm_shm.c.
 *
 * Allreduce is reduce-scatter then all-gather on each chunk: every
 * rank copies its chunk into its slot, then sums its own slice of all the
 * slots into the result (so the W ranks reduce in parallel, each element
 * in rank order, the same bits everywhere), then copies the whole result
 * out. The one idea that keeps it fast is double buffering: two sets of
 * slots, so one barrier per chunk suffices (a rank copies chunk k-1's
 * result out, sums its slice of chunk k and fills its slot for chunk k+1
 * between two barriers; the set it writes was last read two barriers ago).
 * Broadcast and allgather run the same loop with other copies.
 *
 * Failpoint (ductile/failpoint.h): shm.collective (counted per collective
 * that reaches the segment) with action closed fails it as a dead peer
 * does (COMM_ERR_PEER, the others see the dead word at once).
 */
#include "comm_ring.h"
#include "comm_shm.h"

#include <inttypes.h>
#include <string.h>

enum { OP_ALLREDUCE = 1, OP_BROADCAST, OP_ALLGATHER, OP_BARRIER };

static char *shm_slot(shm *g, int set, int r)
{
    return g->data + ((size_t)set * (size_t)(g->base.world_size + 1) + (size_t)r) * SHM_SLOT;
}

typedef struct shm_plan {
    uint32_t op;
    char *buf;
    const char *send;
    size_t count; /* allreduce: floats; broadcast: bytes; allgather: bytes per rank */
    int root;
    size_t chunk;   /* units of count per chunk */
    size_t nchunks; /* chunks; the loop runs one more barrier to drain */
} shm_plan;

static size_t min_sz(size_t a, size_t b)
{
    return a < b ? a : b;
}

/* This rank's slice of an n-float chunk: W nearly equal parts. */
static void shm_slice(const shm *g, size_t n, size_t *first, size_t *len)
{
    size_t w = (size_t)g->base.world_size, r = (size_t)g->base.rank;
    size_t base = n / w, rem = n % w;
    *first = r * base + (r < rem ? r : rem);
    *len = base + (r < rem ? 1 : 0);
}

/* Copies an n-float chunk except this rank's slice (which it never posts
 * nor takes: it reads and writes its own buffer there). */
static void copy_but_slice(const shm *g, float *dst, const float *src, size_t n)
{
    size_t first, len;
    shm_slice(g, n, &first, &len);
    memcpy(dst, src, first * sizeof(float));
    memcpy(dst + first + len, src + first + len, (n - first - len) * sizeof(float));
}

/* Sums this rank's slice of chunk k (n floats at buf) over all ranks, in
 * rank order (its own part read from buf), into the result slot and buf. */
static void shm_reduce(shm *g, int set, float *buf, size_t n)
{
    enum { BLOCK = 2048 }; /* floats: the partial sum stays in L1 */
    int w = g->base.world_size, r = g->base.rank;
    size_t first, len;
    shm_slice(g, n, &first, &len);
    float *res = (float *)shm_slot(g, set, w) + first;
    const float *in[SHM_MAX_RANKS];
    for (int j = 0; j < w; j++)
        in[j] = j == r ? buf + first : (const float *)shm_slot(g, set, j) + first;
    for (size_t b = 0; b < len; b += BLOCK) {
        size_t m = min_sz(BLOCK, len - b);
        float *out = res + b;
        const float *a0 = in[0] + b, *a1 = in[1] + b;
        for (size_t i = 0; i < m; i++)
            out[i] = a0[i] + a1[i];
        for (int j = 2; j < w; j++) {
            const float *aj = in[j] + b;
            for (size_t i = 0; i < m; i++)
                out[i] += aj[i];
        }
        memcpy(buf + first + b, out, m * sizeof(float));
    }
}

/* Before chunk k's barrier: this rank's part goes into the segment. */
static void shm_post(shm *g, const shm_plan *p, size_t k)
{
    int set = (int)(k & 1), r = g->base.rank;
    size_t off = k * p->chunk, n = min_sz(p->chunk, p->count - off);
    switch (p->op) {
    case OP_ALLREDUCE:
        copy_but_slice(g, (float *)shm_slot(g, set, r), (const float *)p->buf + off, n);
        break;
    case OP_BROADCAST:
        if (r == p->root) memcpy(shm_slot(g, set, 0), p->buf + off, n);
        break;
    case OP_ALLGATHER:
        memcpy(shm_slot(g, set, r), p->send + off, n);
        break;
    }
}

/* After chunk k's barrier (every rank posted it, and finished chunk k-1's
 * reduce): take chunk k-1's result, reduce chunk k, or copy chunk k out. */
static void shm_take(shm *g, const shm_plan *p, size_t k)
{
    int set = (int)(k & 1), r = g->base.rank, w = g->base.world_size;
    switch (p->op) {
    case OP_ALLREDUCE:
        if (k > 0) {
            size_t off = (k - 1) * p->chunk, n = min_sz(p->chunk, p->count - off);
            copy_but_slice(g, (float *)p->buf + off, (const float *)shm_slot(g, set ^ 1, w), n);
        }
        if (k < p->nchunks) {
            size_t off = k * p->chunk;
            shm_reduce(g, set, (float *)p->buf + off, min_sz(p->chunk, p->count - off));
        }
        break;
    case OP_BROADCAST:
        if (k < p->nchunks && r != p->root) {
            size_t off = k * p->chunk;
            memcpy(p->buf + off, shm_slot(g, set, 0), min_sz(p->chunk, p->count - off));
        }
        break;
    case OP_ALLGATHER:
        if (k < p->nchunks) {
            size_t off = k * p->chunk, n = min_sz(p->chunk, p->count - off);
            for (int j = 0; j < w; j++)
                memcpy(p->buf + (size_t)j * p->count + off, shm_slot(g, set, j), n);
        }
        break;
    }
}

static const char *op_name(uint32_t op)
{
    static const char *names[] = {"?", "allreduce", "broadcast", "allgather", "barrier"};
    return op <= OP_BARRIER ? names[op] : "?";
}

/* After the first barrier: every rank must be in the same collective. */
static comm_err shm_agree(shm *g)
{
    int par = (int)((g->seq - 1) & 1);
    const shm_desc *me = &g->h->desc[par][g->base.rank];
    for (int j = 0; j < g->base.world_size; j++) {
        const shm_desc *d = &g->h->desc[par][j];
        if (d->op != me->op || d->seq != me->seq || d->size != me->size || d->root != me->root)
            return shm_fail(g, COMM_ERR_PEER,
                            "collective mismatch: rank %d is in %s #%" PRIu64 " of %" PRIu64
                            " bytes (root %u), this "
                            "rank in %s #%" PRIu64 " of %" PRIu64 " bytes (root %u)",
                            shm_job_rank(g, j), op_name(d->op), d->seq, d->size, d->root,
                            op_name(me->op), me->seq, me->size, me->root);
    }
    return COMM_OK;
}

static comm_err shm_run(shm *g, const shm_plan *p, uint64_t size)
{
    if (ring_failpoint("shm.collective", "closed"))
        return shm_fail(g, COMM_ERR_PEER, "a peer died (failpoint shm.collective)");
    shm_desc *me = &g->h->desc[g->seq & 1][g->base.rank];
    me->op = p->op;
    me->root = (uint32_t)p->root;
    me->seq = g->seq++;
    me->size = size;
    for (size_t k = 0; k <= p->nchunks; k++) {
        if (k < p->nchunks) shm_post(g, p, k);
        comm_err err = shm_barrier_wait(g);
        if (err != COMM_OK) return err;
        if (k == 0 && (err = shm_agree(g)) != COMM_OK) return err;
        shm_take(g, p, k);
    }
    return COMM_OK;
}

static size_t chunks(size_t count, size_t chunk)
{
    return (count + chunk - 1) / chunk;
}

static comm_err shm_allreduce(comm *c, float *buf, size_t n)
{
    shm *g = (shm *)c;
    size_t per = SHM_SLOT / sizeof(float);
    shm_plan p = {OP_ALLREDUCE, (char *)buf, NULL, n, 0, per, chunks(n, per)};
    return shm_run(g, &p, n * sizeof(float));
}

static comm_err shm_broadcast(comm *c, void *buf, size_t bytes, int root)
{
    shm *g = (shm *)c;
    shm_plan p = {OP_BROADCAST, buf, NULL, bytes, root, SHM_SLOT, chunks(bytes, SHM_SLOT)};
    return shm_run(g, &p, bytes);
}

static comm_err shm_allgather(comm *c, const void *send, size_t bytes, void *recv)
{
    shm *g = (shm *)c;
    shm_plan p = {OP_ALLGATHER, recv, send, bytes, 0, SHM_SLOT, chunks(bytes, SHM_SLOT)};
    return shm_run(g, &p, bytes);
}

static comm_err shm_barrier(comm *c)
{
    shm *g = (shm *)c;
    shm_plan p = {OP_BARRIER, NULL, NULL, 0, 0, 1, 0};
    return shm_run(g, &p, 0);
}
const comm_ops shm_ops = {.name = "shm",
                          .allreduce_sum_f32 = shm_allreduce,
                          .broadcast = shm_broadcast,
                          .allgather = shm_allgather,
                          .barrier = shm_barrier,
                          .wait_event = NULL,
                          .abort = shm_abort,
                          .destroy = shm_destroy};
