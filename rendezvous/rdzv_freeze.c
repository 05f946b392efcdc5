/* rdzv_freeze.c: the freezer's step: when an open round freezes, and with
 * whom.
 *
 * The earliest live joiner decides on counts alone (how many joined, how
 * many are registered, the newest join) and reads the whole list of joins
 * only once, when the round is due: at max_nodes, or at min_nodes after the
 * last call. The frozen record lists the previous members first, in their
 * old order, then the newcomers in join order.
 */
#include "rdzv_driver.h"

#include "ductile/clock.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
            if (!used[i] && strcmp(rdzv_key_suffix(joined[i]->key), rec->prev[p]) == 0) {
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
        m->node = strdup(rdzv_key_suffix(order[i]->key));
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
int rdzv_step_freezer(rdzv *r, const rdzv_record *rec, int64_t mod, const snapshot *s)
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
