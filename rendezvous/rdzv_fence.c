/* rdzv_fence.c: the driver's step in a frozen round: whether it ends.
 *
 * Round numbers are the fencing epoch (docs/design.md, "Fencing"): a
 * round ends by opening the next one, in a txn guarded by the record, and
 * from then on nothing of the old round lands. A member ends the round
 * when one of the next members around the ring is gone or left; a node
 * not in the round, when there is room for it (else it is a hot spare).
 */
#include "rdzv_driver.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

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

int rdzv_step_frozen(rdzv *r, const rdzv_record *rec, int64_t mod, const snapshot *s)
{
    char key[RDZV_KEY_MAX];
    rdzv_set_join_watch(r, NULL, 0, 0);
    int me = rdzv_member_me(r, rec);
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
            const char *node = rdzv_key_suffix(s->waiting->kvs[i].key);
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
