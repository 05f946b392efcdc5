/* rdzv_driver.h: private to the driver thread's files (rdzv_driver.c,
 * rdzv_join.c, rdzv_freeze.c, rdzv_fence.c).
 *
 * A step reads one snapshot (rdzv_driver.c) and takes the one action it
 * calls for: in an open round join it or watch the joiner before
 * (rdzv_join.c), or, as the earliest joiner, freeze it (rdzv_freeze.c); in
 * a frozen round, end it when a member is gone or a node waits with room,
 * opening the next round, which fences the old one (rdzv_fence.c).
 */
#ifndef DUCTILE_RDZV_DRIVER_H
#define DUCTILE_RDZV_DRIVER_H

#include "rdzv_internal.h"

#include "ductile/clock.h"

#include <pthread.h>
#include <string.h>

/* What a step returns besides rdzv_err: the record moved (or this step
 * wrote it), read it again; or the step wrote a key other than the record,
 * so the next step reads a new snapshot of the same record (its guard
 * tells if the record moved meanwhile), one request less. */
#define STEP_AGAIN (-1)
#define STEP_SNAPSHOT (-2)

/* What one step read, in one txn guarded by the record (read_snapshot). */
typedef struct snapshot {
    etcd_txn_result txn;
    const etcd_kv *mine; /* this node's registration (keys only in a frozen round) */
    /* frozen round: the ring's next members (rdzv_ring_next), by index in the
     * record, with their registrations and leave markers (keys only) */
    int nnext;
    int next[RDZV_RING_PEERS];
    const etcd_kv *next_reg[RDZV_RING_PEERS], *next_left[RDZV_RING_PEERS];
    etcd_range_result *waiting;
    /* open round: single keys and counts, never the whole list of joins */
    const etcd_kv *own;    /* this node's join, or NULL */
    const etcd_kv *pred;   /* the join just before this node's, NULL when it is the
                            * earliest (asked only when this join's create revision is
                            * known: r->join_rev) */
    const etcd_kv *latest; /* the newest join (asked only by the freezer) */
    int asked_pred, asked_latest;
    int64_t joined;     /* how many joins (a count) */
    int64_t registered; /* how many nodes are registered (a count) */
    int64_t revision;
} snapshot;

static inline const char *rdzv_key_suffix(const char *key)
{
    const char *s = strrchr(key, '/');
    return s ? s + 1 : key;
}

/* This node's index in a frozen record, -1 when it is not a member: listed
 * under an older lease is not this node but what it was before it lost its
 * lease, a lost member like any other. */
static inline int rdzv_member_me(const rdzv *r, const rdzv_record *rec)
{
    int me = rdzv_record_member_index(rec, r->node);
    return me >= 0 && rec->members[me].lease == r->lease ? me : -1;
}

/* The search for a round starts (once): the join timeout and the time in
 * rendezvous count from here. */
static inline void rdzv_begin_seek(rdzv *r)
{
    int64_t now = mono_now_ms();
    if (r->deadline_ms == 0) r->deadline_ms = now + r->cfg.join_timeout_ms;
    pthread_mutex_lock(&r->mu);
    if (r->seek_start_ms == 0) r->seek_start_ms = now;
    pthread_mutex_unlock(&r->mu);
}

/* The steps: each returns RDZV_OK, an error, STEP_AGAIN or STEP_SNAPSHOT. */

/* Joins the open round (rdzv_join.c). */
int rdzv_join(rdzv *r, const rdzv_record *rec, int64_t mod);
/* An open round this node has joined, or must join (rdzv_join.c). */
int rdzv_step_open(rdzv *r, const rdzv_record *rec, int64_t mod, const snapshot *s);
/* The earliest joiner's step: freeze when due (rdzv_freeze.c). */
int rdzv_step_freezer(rdzv *r, const rdzv_record *rec, int64_t mod, const snapshot *s);
/* A frozen round: end it, or wait as a member or a spare (rdzv_fence.c). */
int rdzv_step_frozen(rdzv *r, const rdzv_record *rec, int64_t mod, const snapshot *s);

#endif
