/* rdzv_driver.c: the rendezvous protocol's driver (docs/design.md, "Rounds").
 *
 * One driver thread per handle is level-triggered: whatever woke it (a
 * watch event, the last-call timer, a retry), it reads one consistent
 * snapshot of the job (the round record, then in one txn guarded by the
 * record's mod_revision: node keys, waiting keys and leave markers of a
 * frozen round; single keys and counts of an open round's joins) and takes
 * the one step that snapshot calls for: join, freeze, open the next round,
 * or report what happened. Every write is a
 * txn guarded by the record's mod_revision, so two agents acting on the same
 * snapshot cannot both win; the loser simply reads again. Because each step
 * starts from etcd's state rather than from the events, a lost event or an
 * etcd restart costs a re-read, never a wrong belief.
 *
 * The reads and writes of the job's keys it shares with the caller's
 * thread are in rdzv_keys.c, and the events it sends in rdzv_events.c: it
 * calls nothing of the handle's file (rdzv.c).
 */
#include "rdzv_internal.h"

#include "ductile/clock.h"

#include <cjson/cJSON.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* What a step returns besides rdzv_err: the record moved (or this step
 * wrote it), read it again; or the step wrote a key other than the record,
 * so the next step reads a new snapshot of the same record (its guard
 * tells if the record moved meanwhile), one request less. */
#define STEP_AGAIN (-1)
#define STEP_SNAPSHOT (-2)

/* ---- reading a snapshot ---- */

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

static const char *key_suffix(const char *key)
{
    const char *s = strrchr(key, '/');
    return s ? s + 1 : key;
}

static const etcd_kv *first_kv(const etcd_range_result *rr)
{
    return rr->n ? &rr->kvs[0] : NULL;
}

/* This node's index in a frozen record, -1 when it is not a member: listed
 * under an older lease is not this node but what it was before it lost its
 * lease, a lost member like any other. */
static int member_me(const rdzv *r, const rdzv_record *rec)
{
    int me = rdzv_record_member_index(rec, r->node);
    return me >= 0 && rec->members[me].lease == r->lease ? me : -1;
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
        s->nnext = rdzv_ring_next(member_me(r, rec), rec->nmembers, s->next);
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

/* The freezer's one read of the whole list of joins, when it freezes,
 * guarded by the record's mod_revision like every snapshot. */
static rdzv_err read_joins(rdzv *r, const rdzv_record *rec, int64_t mod, etcd_txn_result *out,
                           int *moved)
{
    char round[RDZV_KEY_MAX], joined[RDZV_KEY_MAX];
    rdzv_key(round, sizeof(round), r->cfg.job, "round");
    rdzv_key(joined, sizeof(joined), r->cfg.job, "rounds/%lld/joined/", (long long)rec->number);
    etcd_cmp cmp = {.key = round, .target = ETCD_CMP_MOD, .op = ETCD_CMP_EQUAL, .number = mod};
    etcd_op op = {.type = ETCD_OP_RANGE, .key = joined, .prefix = 1};
    etcd_err e = etcd_txn(r->dc, &cmp, 1, &op, 1, NULL, 0, out);
    if (e != ETCD_OK) return RDZV_ERR_ETCD;
    *moved = !out->succeeded;
    if (*moved) __atomic_fetch_add(&r->counts.moved, 1, __ATOMIC_RELAXED);
    if (!*moved && out->n != 1) return RDZV_ERR_PROTOCOL;
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

static int open_next(rdzv *r, const rdzv_record *rec, int64_t mod, rdzv_cause cause,
                     const char *node, const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static int open_next(rdzv *r, const rdzv_record *rec, int64_t mod, rdzv_cause cause,
                     const char *node, const char *fmt, ...)
{
    rdzv_record next;
    memset(&next, 0, sizeof(next));
    next.number = rec->number + 1;
    rdzv_record_carry(rec, &next);
    next.peer_lost_of = 0; /* only a lost peer's end sets it */
    snprintf(next.job, sizeof(next.job), "running");
    snprintf(next.cause, sizeof(next.cause), "%s", rdzv_cause_name(cause));
    snprintf(next.cause_node, sizeof(next.cause_node), "%s", node ? node : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(next.reason, sizeof(next.reason), fmt, ap);
    va_end(ap);
    int won = 0;
    rdzv_err err = rdzv_record_copy_order(rec, &next);
    if (err == RDZV_OK) err = rdzv_put_record(r, r->dc, &next, mod, 1, NULL, &won);
    if (err == RDZV_OK && won)
        dlog_debug(&r->log, NULL, "opened round %lld: %s", (long long)next.number, next.reason);
    rdzv_record_free(&next);
    return err == RDZV_OK ? STEP_AGAIN : (int)err;
}

/* ---- one step ---- */

static void begin_seek(rdzv *r)
{
    int64_t now = mono_now_ms();
    if (r->deadline_ms == 0) r->deadline_ms = now + r->cfg.join_timeout_ms;
    pthread_mutex_lock(&r->mu);
    if (r->seek_start_ms == 0) r->seek_start_ms = now;
    pthread_mutex_unlock(&r->mu);
}

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
    begin_seek(r);
}

static int frozen_step(rdzv *r, const rdzv_record *rec, int64_t mod, const snapshot *s)
{
    char key[RDZV_KEY_MAX];
    rdzv_set_join_watch(r, NULL, 0, 0);
    int me = member_me(r, rec);
    rdzv_start_member_watches(r, s->revision + 1, me >= 0 && rec->nmembers < r->cfg.max_nodes);
    if (me < 0 && !r->waiting_written) {
        /* Not in this round: say so, for whoever sees that there is room. */
        rdzv_key(key, sizeof(key), r->cfg.job, "waiting/%s", r->node);
        if (etcd_put(r->dc, key, r->cfg.addr, strlen(r->cfg.addr), r->lease, NULL) != ETCD_OK)
            return RDZV_ERR_ETCD;
        r->waiting_written = 1;
    }
    if (me >= 0 && r->waiting_written) {
        rdzv_key(key, sizeof(key), r->cfg.job, "waiting/%s", r->node);
        etcd_delete(r->dc, key, 0, NULL);
        r->waiting_written = 0;
    }
    /* Does the round end? The next members around the ring gone or left
     * (whoever is gone is seen by the nearest live member before it; a
     * node not in the round checks the first members: if every member
     * died, only it can tell), or a waiting node and room. */
    for (int i = 0; i < s->nnext; i++) {
        const rdzv_rec_member *m = &rec->members[s->next[i]];
        if (me >= 0) rdzv_sentinel_reg(r->sentinel, m->node, s->next_reg[i]);
        if (s->next_left[i])
            return open_next(r, rec, mod, RDZV_CAUSE_MEMBER_LEFT, m->node, "node %s left", m->node);
        const etcd_kv *kv = s->next_reg[i];
        if (!kv)
            return open_next(r, rec, mod, RDZV_CAUSE_MEMBER_LOST, m->node,
                             "node %s lost (its lease ended or was revoked)", m->node);
        if (kv->lease != m->lease)
            return open_next(r, rec, mod, RDZV_CAUSE_MEMBER_LOST, m->node,
                             "node %s restarted (registered again under a new lease)", m->node);
    }
    if (rec->nmembers < r->cfg.max_nodes) {
        const char *waiting = me < 0 ? r->node : NULL;
        for (size_t i = 0; !waiting && i < s->waiting->n; i++) {
            const char *node = key_suffix(s->waiting->kvs[i].key);
            if (rdzv_record_member_index(rec, node) < 0) waiting = node;
        }
        if (waiting)
            return open_next(r, rec, mod, RDZV_CAUSE_NODE_WAITING, waiting,
                             "node %s is waiting and round %lld has room", waiting,
                             (long long)rec->number);
    }
    if (me < 0 && r->spare_round != rec->number) {
        /* Full: a hot spare, which waits as long as it takes. */
        r->spare_round = rec->number;
        r->deadline_ms = 0;
        rdzv_emit_simple(r, RDZV_EV_SPARE, RDZV_OK, "round %lld is full (%d nodes)",
                         (long long)rec->number, rec->nmembers);
    }
    return RDZV_OK;
}

static int by_create_revision(const void *a, const void *b)
{
    const etcd_kv *x = *(etcd_kv *const *)a, *y = *(etcd_kv *const *)b;
    return (x->create_revision > y->create_revision) - (x->create_revision < y->create_revision);
}

/* Freezes the round: previous members first, in their old order, then
 * newcomers in join order; at most max_nodes (the rest become spares). */
static int freeze(rdzv *r, const rdzv_record *rec, int64_t mod, etcd_kv **joined, size_t n)
{
    rdzv_record fz;
    memset(&fz, 0, sizeof(fz));
    fz.number = rec->number;
    fz.frozen = 1;
    rdzv_record_carry(rec, &fz);
    snprintf(fz.job, sizeof(fz.job), "%s", rec->job);
    snprintf(fz.cause, sizeof(fz.cause), "%s", rec->cause);
    snprintf(fz.cause_node, sizeof(fz.cause_node), "%s", rec->cause_node);
    snprintf(fz.reason, sizeof(fz.reason), "%s", rec->reason);
    etcd_kv **order = calloc(n ? n : 1, sizeof(*order));
    char *used = calloc(n ? n : 1, 1);
    fz.members = calloc(n ? n : 1, sizeof(*fz.members));
    rdzv_err err = RDZV_ERR_NOMEM;
    if (!order || !used || !fz.members) goto out;
    size_t k = 0;
    for (int p = 0; p < rec->nprev; p++)
        for (size_t i = 0; i < n; i++)
            if (!used[i] && strcmp(key_suffix(joined[i]->key), rec->prev[p]) == 0) {
                used[i] = 1;
                order[k++] = joined[i];
            }
    for (size_t i = 0; i < n; i++)
        if (!used[i]) order[k++] = joined[i];
    for (size_t i = 0; i < k && fz.nmembers < r->cfg.max_nodes; i++) {
        cJSON *o = cJSON_ParseWithLength(order[i]->value, order[i]->value_len);
        const cJSON *addr = cJSON_GetObjectItemCaseSensitive(o, "addr");
        const cJSON *lws = cJSON_GetObjectItemCaseSensitive(o, "lws");
        if (!cJSON_IsString(addr) || !cJSON_IsNumber(lws) || lws->valueint < 1 ||
            lws->valueint > RDZV_MAX_LOCAL_WORLD) {
            dlog_debug(&r->log, NULL, "skipping malformed join %s", order[i]->key);
            cJSON_Delete(o);
            continue;
        }
        rdzv_rec_member *m = &fz.members[fz.nmembers];
        m->node = strdup(key_suffix(order[i]->key));
        m->addr = strdup(addr->valuestring);
        m->lws = lws->valueint;
        m->lease = order[i]->lease;
        cJSON_Delete(o);
        fz.nmembers++;
        if (!m->node || !m->addr) goto out;
    }
    int won = 0;
    err = rdzv_put_record(r, r->dc, &fz, mod, 0, NULL, &won);
    if (err == RDZV_OK && won)
        dlog_debug(&r->log, NULL, "froze round %lld with %d nodes", (long long)fz.number,
                   fz.nmembers);
out:
    free(order);
    free(used);
    rdzv_record_free(&fz);
    return err == RDZV_OK ? STEP_AGAIN : (int)err;
}

/* A join of this node id under another lease is its dead incarnation's,
 * left behind when this one took the registration over and the old lease
 * was not revoked (yet): delete it, unless it changed meanwhile. */
static int drop_stale_join(rdzv *r, const etcd_kv *kv)
{
    etcd_cmp same = {
        .key = kv->key, .target = ETCD_CMP_MOD, .op = ETCD_CMP_EQUAL, .number = kv->mod_revision};
    etcd_op del = {.type = ETCD_OP_DELETE, .key = kv->key};
    if (etcd_txn(r->dc, &same, 1, &del, 1, NULL, 0, NULL) != ETCD_OK) return RDZV_ERR_ETCD;
    dlog_debug(&r->log, NULL, "deleted %s of lease %lld", kv->key, (long long)kv->lease);
    return STEP_SNAPSHOT;
}

/* Whether the freezer freezes a round that n have joined now: at
 * max_nodes, or at min_nodes once the last call has passed since the last
 * join (r->fz_last_join). After the job's first round, a round that every
 * registered node has joined freezes at once: nobody is left to wait for
 * (a node that registers now waits for the next round, as after the last
 * call), so a lost member costs no last call. The first round keeps its
 * last call, for the agents of a starting job still on their way. */
static int freeze_due(const rdzv *r, const rdzv_record *rec, int64_t n, int64_t registered,
                      int64_t now)
{
    int all_in = rec->nprev > 0 && n >= registered;
    return n >= r->cfg.max_nodes ||
           (n >= r->cfg.min_nodes && (all_in || now >= r->fz_last_join + r->cfg.last_call_ms));
}

/* The freezer's step: it decides on counts, then reads the whole list of
 * joins once to freeze. A list that is not the one counted (a join or a
 * joiner's lease came in between) is read again as a new snapshot, so the
 * freeze always follows the rule for the list it writes. */
static int freezer_step(rdzv *r, const rdzv_record *rec, int64_t mod, const snapshot *s)
{
    char prefix[RDZV_KEY_MAX];
    rdzv_key(prefix, sizeof(prefix), r->cfg.job, "rounds/%lld/joined/", (long long)rec->number);
    rdzv_set_join_watch(r, prefix, 1, s->revision + 1);
    int64_t now = mono_now_ms();
    int64_t maxrev = s->latest ? s->latest->create_revision : 0;
    if (r->fz_round != rec->number || r->fz_count != s->joined || r->fz_maxrev != maxrev) {
        r->fz_round = rec->number;
        r->fz_count = s->joined;
        r->fz_maxrev = maxrev;
        r->fz_last_join = now;
    }
    if (!freeze_due(r, rec, s->joined, s->registered, now)) {
        if (s->joined >= r->cfg.min_nodes) r->last_call_at = r->fz_last_join + r->cfg.last_call_ms;
        return RDZV_OK;
    }
    etcd_txn_result list;
    int moved = 0;
    rdzv_err err = read_joins(r, rec, mod, &list, &moved);
    int rc = err != RDZV_OK ? (int)err : moved ? STEP_AGAIN : STEP_SNAPSHOT;
    if (err == RDZV_OK && !moved && (int64_t)list.ranges[0].n == s->joined) {
        size_t n = list.ranges[0].n;
        etcd_kv **joined = calloc(n ? n : 1, sizeof(*joined));
        if (!joined) {
            rc = RDZV_ERR_NOMEM;
        } else {
            for (size_t i = 0; i < n; i++)
                joined[i] = &list.ranges[0].kvs[i];
            qsort(joined, n, sizeof(*joined), by_create_revision);
            rc = freeze(r, rec, mod, joined, n);
            free(joined);
        }
    }
    etcd_txn_result_free(&list);
    return rc;
}

/* Joins the open round: create-only, only while the round is still
 * current (epoch) and its record is the one this step read (mod), and only
 * while this node's registration is under its lease: the checks a
 * snapshot would make first, so a node's first step in an open round joins
 * without one. The same txn reads this join and the one before it (a
 * range after a put in one txn sees the put; sorted by create revision in
 * etcd, limit 2, keys only), so a joiner with one before it watches that
 * one at once; the earliest (the freezer) takes its snapshot. Any compare
 * that fails sends the step to a snapshot, which says which. */
static int join(rdzv *r, const rdzv_record *rec, int64_t mod)
{
    char key[RDZV_KEY_MAX], epoch[RDZV_KEY_MAX], waiting[RDZV_KEY_MAX], joined[RDZV_KEY_MAX],
        round[RDZV_KEY_MAX], mine[RDZV_KEY_MAX];
    rdzv_key(key, sizeof(key), r->cfg.job, "rounds/%lld/joined/%s", (long long)rec->number,
             r->node);
    rdzv_key(joined, sizeof(joined), r->cfg.job, "rounds/%lld/joined/", (long long)rec->number);
    rdzv_key(epoch, sizeof(epoch), r->cfg.job, "epoch");
    rdzv_key(waiting, sizeof(waiting), r->cfg.job, "waiting/%s", r->node);
    char num[32];
    snprintf(num, sizeof(num), "%lld", (long long)rec->number);
    rdzv_key(round, sizeof(round), r->cfg.job, "round");
    rdzv_key(mine, sizeof(mine), r->cfg.job, "nodes/%s", r->node);
    etcd_cmp guards[3] = {
        {.key = epoch,
         .target = ETCD_CMP_VALUE,
         .op = ETCD_CMP_EQUAL,
         .value = num,
         .value_len = strlen(num)},
        {.key = round, .target = ETCD_CMP_MOD, .op = ETCD_CMP_EQUAL, .number = mod},
        {.key = mine, .target = ETCD_CMP_LEASE, .op = ETCD_CMP_EQUAL, .number = r->lease},
    };
    etcd_op also[2] = {{.type = ETCD_OP_DELETE, .key = waiting},
                       {.type = ETCD_OP_RANGE,
                        .key = joined,
                        .prefix = 1,
                        .limit = 2,
                        .keys_only = 1,
                        .sort = ETCD_SORT_CREATE_DESCEND}};
    etcd_txn_result res;
    rdzv_err err = rdzv_register_txn(r, r->dc, key, guards, 3, also, 2, &res);
    if (err != RDZV_OK) return err;
    r->waiting_written = 0;
    r->spare_round = 0;
    int rc = STEP_SNAPSHOT;
    if (res.succeeded) {
        /* the txn's revision is the join's create revision */
        r->join_round = rec->number;
        r->join_rev = res.revision;
        dlog_debug(&r->log, NULL, "joined round %lld", (long long)rec->number);
        const etcd_range_result *jr = res.n == 3 ? &res.ranges[2] : NULL;
        if (jr && jr->n >= 1 && strcmp(jr->kvs[0].key, key) == 0 &&
            jr->kvs[0].create_revision == res.revision) {
            if (jr->n >= 2 && jr->kvs[1].create_revision < res.revision) {
                /* Not the freezer: watch the joiner just before this one. */
                r->fz_round = 0;
                rdzv_set_join_watch(r, jr->kvs[1].key, 0, res.revision + 1);
                rc = RDZV_OK;
            } else if (jr->n == 1) {
                /* The earliest: its next snapshot is the freezer's. */
                r->fz_round = rec->number;
                r->fz_count = -1;
            }
        }
    }
    etcd_txn_result_free(&res);
    return rc;
}

static int open_step(rdzv *r, const rdzv_record *rec, int64_t mod, const snapshot *s)
{
    begin_seek(r);
    const etcd_kv *own = s->own;
    if (own && own->lease != r->lease) return drop_stale_join(r, own);
    if (!own) return join(r, rec, mod);
    if (r->join_round != rec->number || r->join_rev != own->create_revision) {
        /* A join this driver did not see made (an answer lost): learn its
         * revision, then read again with the join before it. */
        r->join_round = rec->number;
        r->join_rev = own->create_revision;
        return STEP_SNAPSHOT;
    }
    if (s->pred && s->pred->create_revision >= own->create_revision) return RDZV_ERR_PROTOCOL;
    if (!s->pred) {
        /* No join before this one: the earliest live joiner freezes. Its
         * first step as the freezer reads again with the newest join. */
        if (s->asked_latest) return freezer_step(r, rec, mod, s);
        r->fz_round = rec->number;
        r->fz_count = -1;
        return STEP_SNAPSHOT;
    }
    /* Not the freezer: watch the joiner just before this one. */
    r->fz_round = 0;
    rdzv_set_join_watch(r, s->pred->key, 0, s->revision + 1);
    return RDZV_OK;
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
        begin_seek(r);
        return join(r, rec, mod);
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
        rc = frozen_step(r, rec, mod, &s);
    } else {
        rc = open_step(r, rec, mod, &s);
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
