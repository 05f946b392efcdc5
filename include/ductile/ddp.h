/* ddp.h: the DDP reducer, as PyTorch's Reducer does it.
 *
 * Gradients live in buckets: parameters are taken in reverse order (the
 * order backward produces them) and packed into buckets of up to
 * bucket_cap bytes (the first one smaller, so communication starts early).
 * All buckets are one flat array and each parameter's grad pointer is a
 * view into it: backward writes where the all-reduce reads, no copy.
 * Backward marks parameters ready; when a bucket's last parameter is ready
 * it is handed to a communication thread, which all-reduces buckets strictly
 * in bucket-index order (never in ready order, so every rank issues the same
 * collectives in the same order). After backward, finish() waits for every
 * bucket; gradients end divided by the world size (on the CPU the thread
 * divides each bucket as soon as it is summed, while it is in cache).
 *
 * The last bucket carries one extra float, the stop flag: each rank writes
 * 1 there when it wants to stop after this step, and after the sum every rank
 * sees the same decision at the same step.
 */
#ifndef DUCTILE_DDP_H
#define DUCTILE_DDP_H

#include <stddef.h>

#include "ductile/comm.h"
#include "ductile/elastic.h" /* the agreement and the all-or-nothing share the state sync uses */
#include "ductile/model.h"

typedef enum {
    DDP_OK = 0,
    DDP_ERR_NOMEM,
    DDP_ERR_COMM,    /* a collective failed (detail in ddp_last_error) */
    DDP_ERR_UNUSED,  /* a parameter got no gradient in a synchronised step */
    DDP_ERR_TIMEOUT, /* the communication thread missed its deadline */
    DDP_ERR_SYS,
} ddp_err;

const char *ddp_strerror(ddp_err err);

/* The size of the one-line reasons the reducer keeps (ddp_last_error). */
#define DDP_MSG_MAX 256

#define DDP_FIRST_BUCKET_BYTES (1u << 20)

/* The bucket of each parameter (bucket_of[n]) for parameters of numel[i]
 * floats: reverse order, first bucket capped at min(first_cap, cap) bytes,
 * the others at cap; a bucket closes once it reaches its cap (so a parameter
 * larger than the cap gets a bucket of its own). Returns the bucket count. */
int ddp_assign_buckets(const size_t *numel, int n, size_t first_cap, size_t cap, int *bucket_of);

typedef struct ddp_bucket {
    size_t offset; /* into the flat gradient array, in floats */
    size_t numel;  /* floats, including the stop flag in the last bucket */
    int nparams;
    int pending; /* parameters not yet ready in this step */
} ddp_bucket;

typedef struct ddp_reducer ddp_reducer;

/* How the all-reduce meets backward (--overlap, --no-overlap, neither). */
typedef enum { DDP_OVERLAP_OFF = 0, DDP_OVERLAP_ON = 1, DDP_OVERLAP_AUTO = 2 } ddp_overlap_mode;

/* 1 to all-reduce buckets during backward, 0 after it, for `mode`; writes
 * why in one line. ON and OFF are forced. AUTO overlaps on a GPU (compute
 * runs there; the thread only queues collectives) and on the CPU only when
 * the cores this process may use hold every local rank's compute threads
 * and one more each for its communication thread: cores >= local_world *
 * (threads + 1). Without that spare core the thread takes its time slices
 * from backward and from the peers' rings, and overlap measured slower than
 * reducing after backward (bench/ddp). */
int ddp_overlap_choose(ddp_overlap_mode mode, int gpu, int cores, int local_world, int threads,
                       char *why, size_t len);

/* comm may be NULL for a world of one. With overlap 0 buckets are reduced
 * only in finish(), after backward. */
ddp_err ddp_reducer_create(model *m, comm *c, size_t bucket_cap_bytes, int overlap,
                           ddp_reducer **out);
void ddp_reducer_free(ddp_reducer *r);

int ddp_bucket_count(const ddp_reducer *r);
const ddp_bucket *ddp_bucket_get(const ddp_reducer *r, int i);
float *ddp_grads(ddp_reducer *r); /* the flat gradient array */

/* Starts a micro-step. sync 0 = no_sync: gradients accumulate locally and
 * nothing is reduced. want_stop is this rank's vote for the stop flag. */
void ddp_begin(ddp_reducer *r, int sync, int want_stop);
/* A late vote: in a synchronised micro-step, fn(ctx) is asked once more on
 * the calling thread just before the flag's bucket leaves, and 1 adds a stop
 * vote, so something that happened during this step's compute (a signal,
 * the end of an elastic round) still stops every rank right after it. The
 * sum stays the same on every rank whenever each one voted. NULL: none. */
typedef int (*ddp_vote_fn)(void *ctx);
void ddp_set_vote(ddp_reducer *r, ddp_vote_fn fn, void *ctx);
/* model_ready_fn for model_backward: ctx is the reducer. */
void ddp_mark_ready(void *ctx, int param);
/* Ends a micro-step: in a synchronised step waits for every bucket, divides
 * by the world size and sets *stop to the agreed decision. */
ddp_err ddp_finish(ddp_reducer *r, int *stop);
/* Zeroes every gradient (after the optimizer step). */
void ddp_zero_grad(ddp_reducer *r);

/* Rank 0's bytes to every rank, for parameters and optimizer state when a
 * group forms. buf is host memory, whichever backend. A no-op without comm. */
ddp_err ddp_broadcast(ddp_reducer *r, void *buf, size_t bytes);
/* The one state sync, when a group forms: every rank takes the same
 * training state, parts[0..n) (host memory: position, parameters,
 * optimizer state). With a claim (elastic mode) the group first agrees on
 * whose state is newest (elastic_agree; *root, *best); without one, rank
 * 0's goes out. Receivers take it all or nothing (elastic_share): on an
 * error their parts are as they were. A no-op without comm (*root 0). */
ddp_err ddp_sync_state(ddp_reducer *r, const elastic_claim *mine, const elastic_part *parts, int n,
                       int *root, elastic_claim *best);
/* In-place sum across ranks of small host values (evaluation counts). */
ddp_err ddp_allreduce(ddp_reducer *r, float *buf, size_t n);

/* One line about the last error ("" if none). */
const char *ddp_last_error(const ddp_reducer *r);

#endif
