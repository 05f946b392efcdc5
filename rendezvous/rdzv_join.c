/* rdzv_join.c: the driver's steps in an open round: joining it, and
 * finding this join's place among the others.
 *
 * A join is create-only and guarded by the round's epoch, the record and
 * this node's registration, so it lands only in the round the step read.
 * Each joiner then watches the join just before its own (by create
 * revision); the one with none before it is the earliest, the freezer
 * (rdzv_freeze.c). A join left behind by this node's dead incarnation is
 * deleted first.
 */
#include "rdzv_driver.h"

#include <stdio.h>
#include <string.h>

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

/* Joins the open round: create-only, only while the round is still
 * current (epoch) and its record is the one this step read (mod), and only
 * while this node's registration is under its lease: the checks a
 * snapshot would make first, so a node's first step in an open round joins
 * without one. The same txn reads this join and the one before it (a
 * range after a put in one txn sees the put; sorted by create revision in
 * etcd, limit 2, keys only), so a joiner with one before it watches that
 * one at once; the earliest (the freezer) takes its snapshot. Any compare
 * that fails sends the step to a snapshot, which says which. */
int rdzv_join(rdzv *r, const rdzv_record *rec, int64_t mod)
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

int rdzv_step_open(rdzv *r, const rdzv_record *rec, int64_t mod, const snapshot *s)
{
    rdzv_begin_seek(r);
    const etcd_kv *own = s->own;
    if (own && own->lease != r->lease) return drop_stale_join(r, own);
    if (!own) return rdzv_join(r, rec, mod);
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
        if (s->asked_latest) return rdzv_step_freezer(r, rec, mod, s);
        r->fz_round = rec->number;
        r->fz_count = -1;
        return STEP_SNAPSHOT;
    }
    /* Not the freezer: watch the joiner just before this one. */
    r->fz_round = 0;
    rdzv_set_join_watch(r, s->pred->key, 0, s->revision + 1);
    return RDZV_OK;
}
