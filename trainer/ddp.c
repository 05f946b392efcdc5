/* ddp.c: gradient buckets, readiness tracking and the communication thread.
 *
 * The thread owns every collective of a step: it waits for bucket `next`
 * to be ready, all-reduces it, moves to next+1. Because it only ever looks
 * at `next`, buckets are reduced in index order whatever order backward
 * finishes them in, which is what keeps ranks from issuing mismatched
 * collectives. The main thread only sets ready flags and, in finish(), waits
 * for `next` to reach the bucket count (with a deadline, although comm's own
 * deadlines make a hang there impossible in practice).
 *
 * On a device (model->dev, gpu.h) the same code runs with the buckets in
 * device memory: marking a bucket ready records a CUDA event after the
 * kernels that wrote it, and the bucket's NCCL all-reduce waits for that
 * event on the NCCL stream, while the compute stream runs the rest of
 * backward. The thread queues each bucket behind the last without waiting
 * for it (comm_allreduce_sum_f32_start), so buckets pipeline on NCCL's
 * stream as PyTorch's Reducer's do, and waits once, after the last; the
 * stop flag then comes back in the step's one host sync (ddp_finish).
 * Host buffers (the state sync) go to the communicator as they are,
 * whichever backend: NCCL stages host memory itself.
 */
#include "ductile/ddp.h"
#include "gpu.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ductile/clock.h"

/* Backstop for finish(): comm fails a collective within its own deadline,
 * so this only fires if that promise is broken. */
#define DDP_WAIT_MS (10 * 60 * 1000)

struct ddp_reducer {
    model *m;
    comm *comm;
    int world;
    int overlap;
    int nbuckets;
    ddp_bucket *buckets;
    int *bucket_of; /* per parameter */
    float *grads;   /* all buckets, back to back */
    size_t total;   /* floats in grads */
    size_t flag;    /* index of the stop flag */
    char *param_ready;
    int sync;
    int marked_twice;
    ddp_vote_fn vote; /* late stop vote, or NULL */
    void *vote_ctx;

    int have_thread;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    char *bucket_ready; /* handed to the thread in this step */
    int next;           /* next bucket the thread reduces */
    int shutdown;
    comm_err cerr; /* first collective error */
    char err[DDP_MSG_MAX];
};

const char *ddp_strerror(ddp_err err)
{
    switch (err) {
    case DDP_OK:
        return "ok";
    case DDP_ERR_NOMEM:
        return "out of memory";
    case DDP_ERR_COMM:
        return "collective failed";
    case DDP_ERR_UNUSED:
        return "a parameter received no gradient";
    case DDP_ERR_TIMEOUT:
        return "gradient all-reduce missed its deadline";
    case DDP_ERR_SYS:
        return "system call failed";
    }
    return "unknown ddp error";
}

int ddp_assign_buckets(const size_t *numel, int n, size_t first_cap, size_t cap, int *bucket_of)
{
    size_t limit = first_cap < cap ? first_cap : cap, filled = 0;
    int b = 0;
    for (int i = n - 1; i >= 0; i--) {
        bucket_of[i] = b;
        filled += numel[i] * sizeof(float);
        if (filled >= limit && i > 0) {
            b++;
            filled = 0;
            limit = cap;
        }
    }
    return n > 0 ? b + 1 : 0;
}

int ddp_overlap_choose(ddp_overlap_mode mode, int gpu, int cores, int local_world, int threads,
                       char *why, size_t len)
{
    if (local_world < 1) local_world = 1;
    if (mode != DDP_OVERLAP_AUTO) {
        snprintf(why, len, "forced by --%s", mode == DDP_OVERLAP_ON ? "overlap" : "no-overlap");
        return mode == DDP_OVERLAP_ON;
    }
    if (gpu) {
        snprintf(why, len, "auto: compute runs on the GPU");
        return 1;
    }
    int spare = cores >= local_world * (threads + 1);
    snprintf(why, len, "auto: %d core%s for %d local rank%s x %d compute thread%s %s", cores,
             cores == 1 ? "" : "s", local_world, local_world == 1 ? "" : "s", threads,
             threads == 1 ? "" : "s",
             spare ? "leave a core each for communication" : "leave no core for communication");
    return spare;
}

/* On the CPU the thread averages each bucket as soon as it is summed, while
 * it is still in cache (a pass over all gradients in finish() reads them
 * back from memory) and, overlapped, beside backward. */
static void average_bucket(ddp_reducer *r, const ddp_bucket *b)
{
    float inv = 1.0f / (float)r->world, *g = r->grads + b->offset;
    for (size_t i = 0; i < b->numel; i++)
        g[i] *= inv;
}

static void *comm_thread(void *arg)
{
    ddp_reducer *r = arg;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!r->shutdown && !(r->next < r->nbuckets && r->bucket_ready[r->next]))
            pthread_cond_wait(&r->cv, &r->mu);
        if (r->shutdown) break;
        ddp_bucket *b = &r->buckets[r->next];
        comm_err e = r->cerr;
        /* On a device the collective's stream waits for the bucket's event,
         * and the buckets pipeline there: each is queued behind the last,
         * and only the step's last one is waited for. */
        void *ready = r->m->dev ? gpu_mark_event(r->m, r->next) : NULL;
        int last = r->next == r->nbuckets - 1;
        pthread_mutex_unlock(&r->mu);
        if (e == COMM_OK && ready) {
            e = comm_allreduce_sum_f32_start(r->comm, r->grads + b->offset, b->numel, ready);
            if (e == COMM_OK && last) e = comm_wait(r->comm);
        } else if (e == COMM_OK) {
            e = comm_allreduce_sum_f32(r->comm, r->grads + b->offset, b->numel);
        }
        if (e == COMM_OK && !r->m->dev && r->world > 1) average_bucket(r, b);
        pthread_mutex_lock(&r->mu);
        if (e != COMM_OK && r->cerr == COMM_OK) {
            r->cerr = e;
            snprintf(r->err, sizeof(r->err), "all-reduce of bucket %d: %s: %.180s", r->next,
                     comm_strerror(e), comm_last_error(r->comm));
        }
        r->next++;
        pthread_cond_broadcast(&r->cv);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

ddp_err ddp_reducer_create(model *m, comm *c, size_t bucket_cap_bytes, int overlap,
                           ddp_reducer **out)
{
    size_t numel[MODEL_MAX_PARAMS];
    ddp_reducer *r = calloc(1, sizeof(*r));
    *out = NULL;
    if (!r) return DDP_ERR_NOMEM;
    r->m = m;
    r->comm = c;
    r->world = c ? comm_world_size(c) : 1;
    r->overlap = overlap;
    r->bucket_of = calloc(m->nparams, sizeof(int));
    r->param_ready = calloc(m->nparams, 1);
    if (!r->bucket_of || !r->param_ready) goto nomem;
    for (int i = 0; i < m->nparams; i++)
        numel[i] = m->params[i].numel;
    r->nbuckets = ddp_assign_buckets(numel, m->nparams, DDP_FIRST_BUCKET_BYTES, bucket_cap_bytes,
                                     r->bucket_of);
    r->buckets = calloc(r->nbuckets, sizeof(ddp_bucket));
    r->bucket_ready = calloc(r->nbuckets, 1);
    r->total = m->nfloats + 1;
    r->grads = m->dev ? gpu_grad_alloc(m, r->total) : calloc(r->total, sizeof(float));
    if (!r->buckets || !r->bucket_ready || !r->grads) goto nomem;
    /* Lay buckets out in index order, parameters in reverse order inside. */
    size_t off = 0;
    for (int b = 0; b < r->nbuckets; b++) {
        r->buckets[b].offset = off;
        for (int i = m->nparams - 1; i >= 0; i--) {
            if (r->bucket_of[i] != b) continue;
            m->params[i].grad = r->grads + off;
            off += m->params[i].numel;
            r->buckets[b].nparams++;
        }
        r->buckets[b].numel = off - r->buckets[b].offset;
    }
    r->flag = off;
    r->buckets[r->nbuckets - 1].numel++;

    if (c) {
        pthread_mutex_init(&r->mu, NULL);
        if (mono_cond_init(&r->cv) != 0) {
            pthread_mutex_destroy(&r->mu);
            goto nomem;
        }
        if (pthread_create(&r->thread, NULL, comm_thread, r) != 0) {
            pthread_mutex_destroy(&r->mu);
            pthread_cond_destroy(&r->cv);
            goto nomem;
        }
        r->have_thread = 1;
    }
    *out = r;
    return DDP_OK;
nomem:
    /* The model's gradients must not point into memory about to be freed. */
    for (int i = 0; i < m->nparams; i++)
        m->params[i].grad = m->own_grads + m->params[i].offset;
    ddp_reducer_free(r);
    return DDP_ERR_NOMEM;
}

void ddp_reducer_free(ddp_reducer *r)
{
    if (!r) return;
    if (r->have_thread) {
        pthread_mutex_lock(&r->mu);
        r->shutdown = 1;
        pthread_cond_broadcast(&r->cv);
        pthread_mutex_unlock(&r->mu);
        pthread_join(r->thread, NULL);
        pthread_mutex_destroy(&r->mu);
        pthread_cond_destroy(&r->cv);
    }
    if (r->grads)
        for (int i = 0; i < r->m->nparams; i++)
            r->m->params[i].grad = r->m->own_grads + r->m->params[i].offset;
    free(r->bucket_of);
    free(r->param_ready);
    free(r->buckets);
    free(r->bucket_ready);
    if (r->m->dev)
        gpu_grad_free(r->m, r->grads);
    else
        free(r->grads);
    free(r);
}

int ddp_bucket_count(const ddp_reducer *r)
{
    return r->nbuckets;
}

const ddp_bucket *ddp_bucket_get(const ddp_reducer *r, int i)
{
    return &r->buckets[i];
}

float *ddp_grads(ddp_reducer *r)
{
    return r->grads;
}

void ddp_begin(ddp_reducer *r, int sync, int want_stop)
{
    r->sync = sync;
    if (!sync) return;
    memset(r->param_ready, 0, r->m->nparams);
    for (int b = 0; b < r->nbuckets; b++)
        r->buckets[b].pending = r->buckets[b].nparams;
    if (r->m->dev)
        gpu_fill(r->m, r->grads + r->flag, 1, want_stop ? 1.0f : 0.0f);
    else
        r->grads[r->flag] = want_stop ? 1.0f : 0.0f;
    r->marked_twice = 0;
}

void ddp_set_vote(ddp_reducer *r, ddp_vote_fn fn, void *ctx)
{
    r->vote = fn;
    r->vote_ctx = ctx;
}

/* Before the flag's bucket is marked: a late vote may still set the flag. */
static void late_vote(ddp_reducer *r)
{
    if (!r->vote || !r->vote(r->vote_ctx)) return;
    if (r->m->dev)
        gpu_fill(r->m, r->grads + r->flag, 1, 1.0f);
    else
        r->grads[r->flag] = 1.0f;
}

void ddp_mark_ready(void *ctx, int param)
{
    ddp_reducer *r = ctx;
    if (!r->sync) return;
    if (r->param_ready[param]) {
        r->marked_twice = 1;
        return;
    }
    r->param_ready[param] = 1;
    int b = r->bucket_of[param];
    if (--r->buckets[b].pending != 0) return;
    if (b == r->nbuckets - 1) late_vote(r);
    if (r->m->dev) gpu_mark(r->m, b); /* after the kernels that wrote the bucket */
    if (r->overlap && r->have_thread) {
        pthread_mutex_lock(&r->mu);
        r->bucket_ready[b] = 1;
        pthread_cond_broadcast(&r->cv);
        pthread_mutex_unlock(&r->mu);
    }
}

/* Waits for the thread to reduce every bucket; resets it for the next step. */
static ddp_err wait_buckets(ddp_reducer *r)
{
    struct timespec deadline = mono_deadline(DDP_WAIT_MS);
    ddp_err err = DDP_OK;
    pthread_mutex_lock(&r->mu);
    if (!r->overlap) {
        memset(r->bucket_ready, 1, r->nbuckets);
        pthread_cond_broadcast(&r->cv);
    }
    while (r->next < r->nbuckets)
        if (pthread_cond_timedwait(&r->cv, &r->mu, &deadline) == ETIMEDOUT) {
            snprintf(r->err, sizeof(r->err), "bucket %d of %d not reduced after %d s", r->next,
                     r->nbuckets, DDP_WAIT_MS / 1000);
            err = DDP_ERR_TIMEOUT;
            break;
        }
    if (err == DDP_OK && r->cerr != COMM_OK) err = DDP_ERR_COMM;
    if (err == DDP_OK) {
        r->next = 0;
        memset(r->bucket_ready, 0, r->nbuckets);
    }
    pthread_mutex_unlock(&r->mu);
    if (err == DDP_ERR_TIMEOUT) comm_abort(r->comm);
    return err;
}

ddp_err ddp_finish(ddp_reducer *r, int *stop)
{
    *stop = 0;
    if (!r->sync) return DDP_OK;
    for (int i = 0; i < r->m->nparams; i++)
        if (!r->param_ready[i] || r->marked_twice) {
            snprintf(r->err, sizeof(r->err), "parameter %s %s", r->m->params[i].name,
                     r->marked_twice ? "marked ready twice" : "got no gradient");
            return DDP_ERR_UNUSED;
        }
    if (r->have_thread) {
        ddp_err err = wait_buckets(r);
        if (err != DDP_OK) return err;
    }
    /* The thread averaged the CPU's buckets (average_bucket); a device's
     * are averaged here, in one kernel. */
    if (r->world > 1 && r->m->dev) gpu_scale(r->m, r->grads, r->total, 1.0f / (float)r->world);
    *stop = (r->m->dev ? gpu_read(r->m, r->grads + r->flag) : r->grads[r->flag]) > 0.0f;
    return DDP_OK;
}

void ddp_zero_grad(ddp_reducer *r)
{
    if (r->m->dev)
        gpu_fill(r->m, r->grads, r->total, 0.0f);
    else
        memset(r->grads, 0, sizeof(float) * r->total);
}

ddp_err ddp_broadcast(ddp_reducer *r, void *buf, size_t bytes)
{
    if (!r->comm) return DDP_OK;
    comm_err e = comm_broadcast(r->comm, buf, bytes, 0);
    if (e != COMM_OK) {
        snprintf(r->err, sizeof(r->err), "broadcast: %s: %s", comm_strerror(e),
                 comm_last_error(r->comm));
        return DDP_ERR_COMM;
    }
    return DDP_OK;
}

ddp_err ddp_sync_state(ddp_reducer *r, const elastic_claim *mine, const elastic_part *parts, int n,
                       int *root, elastic_claim *best)
{
    *root = 0;
    if (mine && best) *best = *mine;
    if (!r->comm) return DDP_OK;
    elastic_err e = mine ? elastic_agree(r->comm, mine, root, best) : ELASTIC_OK;
    if (e == ELASTIC_OK) e = elastic_share(r->comm, *root, parts, n);
    if (e == ELASTIC_OK) return DDP_OK;
    if (e == ELASTIC_ERR_COMM) {
        snprintf(r->err, sizeof(r->err), "state sync: %s", comm_last_error(r->comm));
        return DDP_ERR_COMM;
    }
    snprintf(r->err, sizeof(r->err), "state sync: %s", elastic_strerror(e));
    return e == ELASTIC_ERR_NOMEM ? DDP_ERR_NOMEM : DDP_ERR_SYS;
}

ddp_err ddp_allreduce(ddp_reducer *r, float *buf, size_t n)
{
    if (!r->comm) return DDP_OK;
    comm_err e = comm_allreduce_sum_f32(r->comm, buf, n);
    if (e != COMM_OK) {
        snprintf(r->err, sizeof(r->err), "all-reduce: %s: %s", comm_strerror(e),
                 comm_last_error(r->comm));
        return DDP_ERR_COMM;
    }
    return DDP_OK;
}

const char *ddp_last_error(const ddp_reducer *r)
{
    return r->err;
}
