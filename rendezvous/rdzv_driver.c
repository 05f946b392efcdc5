/* rdzv_driver.c: the rendezvous protocol's driver (docs/design.md, "Rounds").
 *
 * One driver thread per handle is level-triggered: whatever woke it (a
 * watch event, the last-call timer, a retry), it reads one consistent
 * snapshot of the job (the round record, then in one txn guarded by the
 * record's mod_revision: node keys, waiting keys and leave markers of a
 * frozen round; single keys and counts of an open round's joins) and takes
 * the one step that snapshot calls for: join (rdzv_join.c), freeze
 * (rdzv_freeze.c), end the round and open the next (rdzv_fence.c), or
 * report what happened. Every write is a
 * txn guarded by the record's mod_revision, so two agents acting on the same
 * snapshot cannot both win; the loser simply reads again. Because each step
 * starts from etcd's state rather than from the events, a lost event or an
 * etcd restart costs a re-read, never a wrong belief.
 *
 * This file holds the thread, the reconcile loop, the snapshot and the
 * step that dispatches on it. The reads and writes of the job's keys it
 * shares with the caller's thread are in rdzv_keys.c, and the events it
 * sends in rdzv_events.c: it calls nothing of the handle's file (rdzv.c).
 */
#include "rdzv_driver.h"

#include "ductile/clock.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- reading a snapshot ---- */

static const etcd_kv *first_kv(const etcd_range_result *rr)
{
    return rr->n ? &rr->kvs[0] : NULL;
}

/* The snapshot a step needs, read in one txn guarded by the round record's
 * mod_revision. For a frozen round: this node's registration, and of the
 * ring's next members after it (rdzv_ring_next; a node not in the round:
 * the first members) each registration (with its value, which the
 * sentinel uses: rdzv_sentinel_reg) and leave marker (keys only), and
 * the waiting keys; never every registration ("Rounds", End). For an open
 * round only single keys and
 * counts, whatever N: this node's registration and join, the counts of
 * joins and of registered nodes, and once this node has joined the join
 * just before its own (sorted by create revision in etcd, limit 1, with
 * max_create_revision = this join's - 1): a non-freezer watches it, and
 * where there is none this node is the earliest joiner, the freezer, which
 * also asks for the newest join (the last call restarts when it changes).
 * A sorted range costs etcd a walk of the joins (about 2 ms at 1024), so
 * each snapshot asks for at most two; only the freezer reads the whole
 * list, once, when it freezes (read_joins). */
static rdzv_err read_snapshot(rdzv *r, const rdzv_record *rec, int64_t mod, snapshot *s, int *moved)
{
    char round[RDZV_KEY_MAX], waiting[RDZV_KEY_MAX], joined[RDZV_KEY_MAX], own[RDZV_KEY_MAX],
        all[RDZV_KEY_MAX], mine[RDZV_KEY_MAX], reg[RDZV_RING_PEERS][RDZV_KEY_MAX],
        left[RDZV_RING_PEERS][RDZV_KEY_MAX];
    long long number = (long long)rec->number;
    rdzv_key(round, sizeof(round), r->cfg.job, "round");
    rdzv_key(all, sizeof(all), r->cfg.job, "nodes/");
    rdzv_key(mine, sizeof(mine), r->cfg.job, "nodes/%s", r->node);
    rdzv_key(waiting, sizeof(waiting), r->cfg.job, "waiting/");
    rdzv_key(joined, sizeof(joined), r->cfg.job, "rounds/%lld/joined/", number);
    rdzv_key(own, sizeof(own), r->cfg.job, "rounds/%lld/joined/%s", number, r->node);
    etcd_cmp cmp = {.key = round, .target = ETCD_CMP_MOD, .op = ETCD_CMP_EQUAL, .number = mod};
    enum { FROZEN_OPS = 2 + 2 * RDZV_RING_PEERS, OPEN_OPS = 6 };
    etcd_op ops[FROZEN_OPS > OPEN_OPS ? FROZEN_OPS : OPEN_OPS];
    size_t nops = 0;
    memset(s, 0, sizeof(*s));
    if (rec->frozen) {
        /* a registration's key and lease are what tell a member lost */
        ops[nops++] = (etcd_op){.type = ETCD_OP_RANGE, .key = mine, .keys_only = 1};
        ops[nops++] = (etcd_op){.type = ETCD_OP_RANGE, .key = waiting, .prefix = 1};
        s->nnext = rdzv_ring_next(rdzv_member_me(r, rec), rec->nmembers, s->next);
        for (int i = 0; i < s->nnext; i++) {
            const char *node = rec->members[s->next[i]].node;
            rdzv_key(reg[i], sizeof(reg[i]), r->cfg.job, "nodes/%s", node);
            rdzv_key(left[i], sizeof(left[i]), r->cfg.job, "rounds/%lld/left/%s", number, node);
            /* with its value: the sentinel holds its probe (rdzv_sentinel_reg) */
            ops[nops++] = (etcd_op){.type = ETCD_OP_RANGE, .key = reg[i]};
            ops[nops++] = (etcd_op){.type = ETCD_OP_RANGE, .key = left[i], .keys_only = 1};
        }
    } else {
        ops[nops++] = (etcd_op){.type = ETCD_OP_RANGE, .key = mine};
        ops[nops++] = (etcd_op){.type = ETCD_OP_RANGE, .key = own};
        ops[nops++] = (etcd_op){.type = ETCD_OP_RANGE, .key = joined, .prefix = 1, .count_only = 1};
        ops[nops++] = (etcd_op){.type = ETCD_OP_RANGE, .key = all, .prefix = 1, .count_only = 1};
        s->asked_pred = r->join_round == rec->number && r->join_rev > 1;
        if (s->asked_pred)
            ops[nops++] = (etcd_op){.type = ETCD_OP_RANGE,
                                    .key = joined,
                                    .prefix = 1,
                                    .limit = 1,
                                    .keys_only = 1,
                                    .sort = ETCD_SORT_CREATE_DESCEND,
                                    .max_create_revision = r->join_rev - 1};
        s->asked_latest = s->asked_pred && r->fz_round == rec->number;
        if (s->asked_latest)
            ops[nops++] = (etcd_op){.type = ETCD_OP_RANGE,
                                    .key = joined,
                                    .prefix = 1,
                                    .limit = 1,
                                    .keys_only = 1,
                                    .sort = ETCD_SORT_CREATE_DESCEND};
    }
    etcd_err e = etcd_txn(r->dc, &cmp, 1, ops, nops, NULL, 0, &s->txn);
    if (e != ETCD_OK) return RDZV_ERR_ETCD;
    __atomic_fetch_add(&r->counts.steps, 1, __ATOMIC_RELAXED);
    *moved = !s->txn.succeeded;
    if (*moved) {
        __atomic_fetch_add(&r->counts.moved, 1, __ATOMIC_RELAXED);
        return RDZV_OK;
    }
    if (s->txn.n != nops) return RDZV_ERR_PROTOCOL;
    s->mine = first_kv(&s->txn.ranges[0]);
    if (rec->frozen) {
        s->waiting = &s->txn.ranges[1];
        for (int i = 0; i < s->nnext; i++) {
            s->next_reg[i] = first_kv(&s->txn.ranges[2 + 2 * i]);
            s->next_left[i] = first_kv(&s->txn.ranges[3 + 2 * i]);
        }
    } else {
        s->own = first_kv(&s->txn.ranges[1]);
        s->joined = s->txn.ranges[2].count;
        s->registered = s->txn.ranges[3].count;
        if (s->asked_pred) s->pred = first_kv(&s->txn.ranges[4]);
        if (s->asked_latest) s->latest = first_kv(&s->txn.ranges[5]);
    }
    s->revision = s->txn.revision;
    return RDZV_OK;
}

/* Creates round 1 if there is no round; *rec and *mod are then the record
 * there is, the one written or the one found in its place (*got 0: none,
 * read it). */
static rdzv_err create_first_round(rdzv *r, rdzv_record *out, int64_t *mod, int *got)
{
    *got = 0;
    rdzv_record rec;
    memset(&rec, 0, sizeof(rec));
    rec.number = 1;
    rec.max_restarts = r->cfg.max_restarts;
    rec.min_nodes = r->cfg.min_nodes;
    rec.max_nodes = r->cfg.max_nodes;
    snprintf(rec.job, sizeof(rec.job), "running");
    char *st = rdzv_state_json(r, "running", "");
    if (!st) return RDZV_ERR_NOMEM;
    int won = 0;
    rdzv_seen seen;
    rdzv_err err = rdzv_put_record_seen(r, r->dc, &rec, 0, 1, st, &won, &seen);
    free(st);
    if (err != RDZV_OK) return err;
    if (won) {
        dlog_debug(&r->log, NULL, "created round 1");
        *out = rec; /* owns nothing: no members, no previous order */
        *mod = seen.mod;
        *got = 1;
    } else if (seen.have) {
        *out = seen.rec;
        *mod = seen.mod;
        *got = 1;
    }
    return RDZV_OK;
}

/* ---- one step ---- */

static void report_frozen(rdzv *r, const rdzv_record *rec)
{
    rdzv_event ev;
    memset(&ev, 0, sizeof(ev));
    ev.type = RDZV_EV_FROZEN;
    if (rdzv_record_to_round(rec, r->node, &ev.round) != RDZV_OK) return;
    r->in_round = rec->number;
    r->reported = rec->number;
    r->spare_round = 0;
    r->deadline_ms = 0;
    pthread_mutex_lock(&r->mu);
    r->member_round = rec->number;
    if (r->seek_start_ms) r->seconds_in_rdzv += (mono_now_ms() - r->seek_start_ms) / 1000.0;
    r->seek_start_ms = 0;
    pthread_mutex_unlock(&r->mu);
    dlog_debug(&r->log, NULL, "round %lld frozen, rank %d of %d", (long long)rec->number,
               ev.round.my_rank, ev.round.nmembers);
    rdzv_emit(r, &ev);
}

static void report_ended(rdzv *r, const rdzv_record *rec)
{
    rdzv_event ev;
    memset(&ev, 0, sizeof(ev));
    ev.type = RDZV_EV_ROUND_ENDED;
    ev.round_number = r->in_round;
    if (rec->number == r->in_round + 1) {
        ev.cause = rdzv_cause_from_name(rec->cause);
        snprintf(ev.node, sizeof(ev.node), "%s", rec->cause_node);
        snprintf(ev.reason, sizeof(ev.reason), "%s", rec->reason);
    } else {
        snprintf(ev.reason, sizeof(ev.reason), "round %lld superseded by round %lld",
                 (long long)r->in_round, (long long)rec->number);
    }
    r->in_round = 0;
    rdzv_emit(r, &ev);
    rdzv_begin_seek(r);
}

/* Returns RDZV_OK, an error, STEP_AGAIN or STEP_SNAPSHOT. */
static int step(rdzv *r, const rdzv_record *rec, int64_t mod)
{
    if (strcmp(rec->job, "done") == 0) {
        rdzv_emit_simple(r, RDZV_EV_JOB_DONE, RDZV_OK, "job done");
        r->terminal = 1;
        return RDZV_OK;
    }
    if (strcmp(rec->job, "failed") == 0) {
        rdzv_emit_simple(r, RDZV_EV_JOB_FAILED, RDZV_ERR_JOB_FAILED, "%s", rec->reason);
        r->terminal = 1;
        return RDZV_OK;
    }
    if (r->in_round && rec->number > r->in_round) report_ended(r, rec);
    /* A frozen record never changes its members: report at once, then
     * check whether the round already has to end. */
    int me = rdzv_record_member_index(rec, r->node);
    if (rec->frozen && rec->number > r->reported && me >= 0 && rec->members[me].lease == r->lease)
        report_frozen(r, rec);

    /* An open round this node has not joined: try the join first, once
     * per round (its compares are the snapshot's checks; if one fails, the
     * snapshot below says which). */
    if (!rec->frozen && r->join_round != rec->number && r->join_tried != rec->number) {
        r->join_tried = rec->number;
        rdzv_begin_seek(r);
        return rdzv_join(r, rec, mod);
    }
    snapshot s;
    int moved = 0;
    rdzv_err err = read_snapshot(r, rec, mod, &s, &moved);
    if (err != RDZV_OK || moved) {
        etcd_txn_result_free(&s.txn);
        return err != RDZV_OK ? (int)err : STEP_AGAIN;
    }
    const etcd_kv *mine = s.mine;
    int rc;
    if (!mine || mine->lease != r->lease) {
        /* Taken over: an agent with this node id found this one silent
         * and registered in its place. Either way this node is out. */
        if (mine)
            rdzv_emit_simple(r, RDZV_EV_ERROR, RDZV_ERR_LEASE_LOST,
                             "node %s: registration taken over by another agent with this node "
                             "id (lease %lld)",
                             r->node, (long long)mine->lease);
        else
            rdzv_emit_simple(r, RDZV_EV_ERROR, RDZV_ERR_LEASE_LOST,
                             "node %s: registration gone (lease expired or revoked)", r->node);
        r->terminal = 1;
        rc = RDZV_OK;
    } else if (rec->frozen) {
        rc = rdzv_step_frozen(r, rec, mod, &s);
    } else {
        rc = rdzv_step_open(r, rec, mod, &s);
    }
    etcd_txn_result_free(&s.txn);
    return rc;
}

/* Steps until one has nothing more to do. The first step's record is the
 * newest a `round` watch event brought, else (reuse: nothing but a join
 * event, a timer or a registration woke the driver) the record the last
 * step ended on, else read. A kept record that moved costs one snapshot:
 * its guard fails and the step reads the record again. */
static rdzv_err reconcile(rdzv *r, int reuse)
{
    if (r->terminal) return RDZV_OK;
    rdzv_record rec;
    memset(&rec, 0, sizeof(rec));
    int64_t mod = 0;
    int keep = 0; /* rec and mod hold the record the last step took */
    int from_watch = rdzv_take_cached_round(r, &rec, &mod);
    if ((from_watch || !reuse) && r->have_last) {
        rdzv_record_free(&r->last_rec);
        r->have_last = 0;
    }
    for (int attempt = 0; attempt < 100 && !r->terminal; attempt++) {
        int have = keep;
        rdzv_err err = RDZV_OK;
        if (!keep && attempt == 0 && from_watch) {
            have = 1;
        } else if (!keep && attempt == 0 && r->have_last) {
            rec = r->last_rec;
            mod = r->last_mod;
            r->have_last = 0;
            have = 1;
        } else if (!keep && attempt == 0 && r->round_absent) {
            have = 0; /* rdzv_open found none: create it, which reads it anyway */
        } else if (!keep) {
            err = rdzv_read_round(r, r->dc, &rec, &mod, &have);
        }
        r->round_absent = 0;
        if (err == RDZV_ERR_PROTOCOL) {
            rdzv_emit_simple(r, RDZV_EV_ERROR, RDZV_ERR_PROTOCOL,
                             "malformed round record under /ductile/%s/round", r->cfg.job);
            r->terminal = 1;
            return err;
        }
        if (err != RDZV_OK) return err;
        if (!have) {
            err = create_first_round(r, &rec, &mod, &keep);
            if (err != RDZV_OK) return err;
            continue;
        }
        int rc = step(r, &rec, mod);
        keep = rc == STEP_SNAPSHOT;
        if (keep) continue;
        if (rc == RDZV_OK && !r->terminal) {
            r->last_rec = rec;
            r->last_mod = mod;
            r->have_last = 1;
            return RDZV_OK;
        }
        rdzv_record_free(&rec);
        if (rc != STEP_AGAIN) return (rdzv_err)rc;
    }
    if (keep) rdzv_record_free(&rec);
    return RDZV_OK;
}

void *rdzv_driver_main(void *arg)
{
    rdzv *r = arg;
    pthread_setname_np(pthread_self(), "rdzv-driver");
    int need = 1;
    r->backoff_ms = 100;
    for (;;) {
        pthread_mutex_lock(&r->mu);
        for (;;) {
            if (r->stop || r->lease_lost || r->dirty || need) break;
            int64_t wake = 0;
            int64_t timers[3] = {r->deadline_ms, r->last_call_at, r->retry_at};
            for (int i = 0; i < 3; i++)
                if (timers[i] && (wake == 0 || timers[i] < wake)) wake = timers[i];
            if (wake && mono_now_ms() >= wake) break;
            rdzv_wait_until(r, wake);
        }
        int stop = r->stop, lost = r->lease_lost;
        unsigned dirty = r->dirty;
        r->dirty = 0;
        pthread_mutex_unlock(&r->mu);
        if (stop) break;
        if (lost) {
            rdzv_emit_simple(r, RDZV_EV_ERROR, RDZV_ERR_LEASE_LOST,
                             "node %s: lease %lld expired; this node is out of the job", r->node,
                             (long long)r->lease);
            break;
        }
        int64_t now = mono_now_ms();
        if (r->deadline_ms && now >= r->deadline_ms) {
            rdzv_emit_simple(r, RDZV_EV_ERROR, RDZV_ERR_TIMEOUT,
                             "no round froze within the join timeout (%d ms)",
                             r->cfg.join_timeout_ms);
            break;
        }
        int timer =
            (r->last_call_at && now >= r->last_call_at) || (r->retry_at && now >= r->retry_at);
        int relevant =
            need || timer || (dirty & (RDZV_TAG_ROUND | RDZV_TAG_JOIN | RDZV_TAG_RESYNC)) ||
            ((dirty & (RDZV_TAG_NODES | RDZV_TAG_WAITING)) && (r->in_round || r->spare_round));
        if (!relevant) continue;
        int reuse = !need && !(dirty & (RDZV_TAG_ROUND | RDZV_TAG_RESYNC));
        need = 0;
        r->last_call_at = 0;
        r->retry_at = 0;
        rdzv_err err = reconcile(r, reuse);
        if (r->terminal) break;
        rdzv_watch_apply(r);
        if (err != RDZV_OK) {
            dlog_debug(&r->log, NULL, "step failed: %s (%s); retrying in %lld ms",
                       rdzv_strerror(err), etcd_last_error(r->dc), (long long)r->backoff_ms);
            r->retry_at = mono_now_ms() + r->backoff_ms;
            r->backoff_ms = r->backoff_ms < 2000 ? r->backoff_ms * 2 : 2000;
        } else {
            r->backoff_ms = 100;
        }
    }
    r->terminal = 1;
    return NULL;
}
