/* status.c: a read-only view of a job for `ductile-agent status`, and
 * `ductile-agent reset`, which deletes an ended job's keys.
 *
 * One txn of ranges gives a consistent picture (round record, live nodes,
 * waiting nodes, job state, restart count) at a single etcd revision, so the
 * status never shows, say, members of one round with the number of another.
 */
#include "rdzv_internal.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void rdzv_status_free(rdzv_status *s)
{
    if (!s) return;
    for (int i = 0; i < s->nmembers; i++) {
        free(s->members[i].node_id);
        free(s->members[i].addr);
    }
    free(s->members);
    for (int i = 0; i < s->nnodes; i++)
        free(s->nodes[i]);
    free(s->nodes);
    for (int i = 0; i < s->nwaiting; i++)
        free(s->waiting[i]);
    free(s->waiting);
    memset(s, 0, sizeof(*s));
}

static rdzv_err names(const etcd_range_result *rr, char ***out, int *n)
{
    *out = rr->n ? calloc(rr->n, sizeof(char *)) : NULL;
    if (rr->n && !*out) return RDZV_ERR_NOMEM;
    for (size_t i = 0; i < rr->n; i++) {
        const char *slash = strrchr(rr->kvs[i].key, '/');
        (*out)[i] = strdup(slash ? slash + 1 : rr->kvs[i].key);
        if (!(*out)[i]) return RDZV_ERR_NOMEM;
        (*n)++;
    }
    return RDZV_OK;
}

/* Checks the job id and connects: the start of every call of this file. */
static rdzv_err job_connect(const rdzv_etcd *etcd, const char *job, etcd_client **c, char *msg)
{
    if (!rdzv_job_id_valid(job)) {
        snprintf(msg, RDZV_MSG_MAX, "job id must match [a-z0-9][a-z0-9-]{0,62}");
        return RDZV_ERR_ARG;
    }
    return rdzv_etcd_connect(etcd, c, msg);
}

rdzv_err rdzv_get_status(const rdzv_etcd *etcd, const char *job, rdzv_status *out, char *msg)
{
    char scratch[RDZV_MSG_MAX];
    if (!msg) msg = scratch;
    msg[0] = '\0';
    if (!etcd || !out) return RDZV_ERR_ARG;
    memset(out, 0, sizeof(*out));
    snprintf(out->job_state, sizeof(out->job_state), "none");
    etcd_client *c = NULL;
    rdzv_err err = job_connect(etcd, job, &c, msg);
    if (err != RDZV_OK) return err;
    char round[RDZV_KEY_MAX], nodes[RDZV_KEY_MAX], waiting[RDZV_KEY_MAX], state[RDZV_KEY_MAX];
    rdzv_key(round, sizeof(round), job, "round");
    rdzv_key(nodes, sizeof(nodes), job, "nodes/");
    rdzv_key(waiting, sizeof(waiting), job, "waiting/");
    rdzv_key(state, sizeof(state), job, "state");
    etcd_op ops[4] = {
        {.type = ETCD_OP_RANGE, .key = round},
        {.type = ETCD_OP_RANGE, .key = nodes, .prefix = 1},
        {.type = ETCD_OP_RANGE, .key = waiting, .prefix = 1},
        {.type = ETCD_OP_RANGE, .key = state},
    };
    etcd_txn_result res;
    etcd_err e = etcd_txn(c, NULL, 0, ops, 4, NULL, 0, &res);
    if (e != ETCD_OK) {
        snprintf(msg, RDZV_MSG_MAX, "etcd at %s: %s", etcd->endpoints,
                 etcd_last_error(c)[0] ? etcd_last_error(c) : etcd_strerror(e));
        etcd_client_free(c);
        return RDZV_ERR_ETCD;
    }
    etcd_client_free(c);
    if (res.n != 4) {
        etcd_txn_result_free(&res);
        snprintf(msg, RDZV_MSG_MAX, "etcd answered a 4-range txn with %zu results", res.n);
        return RDZV_ERR_PROTOCOL;
    }
    if (res.ranges[0].n > 0) {
        rdzv_record rec;
        err = rdzv_record_parse(res.ranges[0].kvs[0].value, res.ranges[0].kvs[0].value_len, &rec);
        if (err != RDZV_OK) {
            snprintf(msg, RDZV_MSG_MAX, "malformed round record under %.200s", round);
            goto out;
        }
        out->round = rec.number;
        snprintf(out->round_state, sizeof(out->round_state), "%s", rec.frozen ? "frozen" : "open");
        out->restarts = rec.restarts;
        out->max_restarts = rec.max_restarts;
        snprintf(out->job_state, sizeof(out->job_state), "%s", rec.job);
        if (rec.frozen) {
            rdzv_round rr;
            err = rdzv_record_to_round(&rec, NULL, &rr);
            if (err == RDZV_OK) {
                out->nmembers = rr.nmembers;
                out->members = rr.members;
            }
        }
        if (strcmp(rec.job, "failed") == 0)
            snprintf(out->reason, sizeof(out->reason), "%s", rec.reason);
        rdzv_record_free(&rec);
        if (err != RDZV_OK) goto out;
    }
    rdzv_job_state st;
    if (res.ranges[3].n > 0 && rdzv_state_parse(res.ranges[3].kvs[0].value,
                                                res.ranges[3].kvs[0].value_len, &st) == RDZV_OK) {
        snprintf(out->job_state, sizeof(out->job_state), "%s", st.state);
        if (st.reason[0]) snprintf(out->reason, sizeof(out->reason), "%s", st.reason);
        snprintf(out->install, sizeof(out->install), "%s", st.install);
    }
    if ((err = names(&res.ranges[1], &out->nodes, &out->nnodes)) != RDZV_OK) goto out;
    err = names(&res.ranges[2], &out->waiting, &out->nwaiting);
out:
    etcd_txn_result_free(&res);
    if (err != RDZV_OK) rdzv_status_free(out);
    return err;
}

/* Deletes the job's keys unless a node is registered, and only while guard
 * (may be NULL) holds: rdzv_reset() and rdzv_start_over(). */
static rdzv_err reset_keys(const rdzv_etcd *etcd, etcd_client *c, const char *job,
                           const etcd_cmp *guard, int *live, int64_t *deleted, char *msg)
{
    char prefix[RDZV_KEY_MAX], nodes[RDZV_KEY_MAX];
    rdzv_key(prefix, sizeof(prefix), job, "%s", "");
    rdzv_key(nodes, sizeof(nodes), job, "nodes/");
    /* Knowingly simple: a node that registers between the count and the
     * delete loses its key (and its lease-bound registration with it). The
     * exact way is one txn whose compare covers the nodes/ range (etcd 3.3+
     * compares a range), which this client's etcd_cmp does not express;
     * reset runs before a job's agents start, so nobody registers then (and
     * rdzv_start_over's guard fails once one agent has started over). */
    etcd_range_result rr;
    etcd_err e = etcd_range(c, nodes, 1, 1, &rr); /* count: every match */
    if (e == ETCD_OK) {
        int n = (int)rr.count;
        etcd_range_result_free(&rr);
        if (live) *live = n;
        if (n == 0 && !guard) e = etcd_delete(c, prefix, 1, deleted);
        if (n == 0 && guard) {
            etcd_op ops[2] = {
                {.type = ETCD_OP_RANGE, .key = prefix, .prefix = 1, .count_only = 1},
                {.type = ETCD_OP_DELETE, .key = prefix, .prefix = 1},
            };
            etcd_txn_result res;
            e = etcd_txn(c, guard, 1, ops, 2, NULL, 0, &res);
            if (e == ETCD_OK) {
                if (deleted && res.succeeded && res.n > 0) *deleted = res.ranges[0].count;
                etcd_txn_result_free(&res);
            }
        }
    }
    if (e != ETCD_OK) {
        snprintf(msg, RDZV_MSG_MAX, "etcd at %s: %s", etcd->endpoints,
                 etcd_last_error(c)[0] ? etcd_last_error(c) : etcd_strerror(e));
        return RDZV_ERR_ETCD;
    }
    return RDZV_OK;
}

/* The job's keys go only while its state records an end under an install
 * id other than install_id (rdzv_start_over). */
static rdzv_err start_over_keys(const rdzv_etcd *etcd, etcd_client *c, const char *job,
                                const char *install_id, int *live, int64_t *deleted, char *msg)
{
    char key[RDZV_KEY_MAX];
    rdzv_key(key, sizeof(key), job, "state");
    etcd_kv kv;
    etcd_err e = etcd_get(c, key, &kv);
    if (e == ETCD_ERR_NOT_FOUND) return RDZV_OK; /* already started over */
    if (e != ETCD_OK) {
        snprintf(msg, RDZV_MSG_MAX, "etcd at %s: %s", etcd->endpoints,
                 etcd_last_error(c)[0] ? etcd_last_error(c) : etcd_strerror(e));
        return RDZV_ERR_ETCD;
    }
    rdzv_err err = RDZV_OK;
    rdzv_job_state st;
    int elsewhere = rdzv_state_parse(kv.value, kv.value_len, &st) == RDZV_OK &&
                    rdzv_state_elsewhere(&st, install_id);
    /* Only the end read here is deleted: once another agent has started
     * over, the state key is gone or new and the guard fails. */
    etcd_cmp guard = {
        .key = key, .target = ETCD_CMP_MOD, .op = ETCD_CMP_EQUAL, .number = kv.mod_revision};
    if (elsewhere) err = reset_keys(etcd, c, job, &guard, live, deleted, msg);
    if (err == RDZV_OK && deleted && *deleted > 0)
        snprintf(msg, RDZV_MSG_MAX, "it ended (%s) in install %s", st.state, st.install);
    etcd_kv_free(&kv);
    return err;
}

/* rdzv_reset (start_over 0) and rdzv_start_over. */
static rdzv_err reset_job(const rdzv_etcd *etcd, const char *job, int start_over,
                          const char *install_id, int *live, int64_t *deleted, char *msg)
{
    char scratch[RDZV_MSG_MAX];
    if (!msg) msg = scratch;
    msg[0] = '\0';
    if (live) *live = 0;
    if (deleted) *deleted = 0;
    if (!etcd) return RDZV_ERR_ARG;
    etcd_client *c = NULL;
    rdzv_err err = job_connect(etcd, job, &c, msg);
    if (err != RDZV_OK) return err;
    err = start_over ? start_over_keys(etcd, c, job, install_id, live, deleted, msg)
                     : reset_keys(etcd, c, job, NULL, live, deleted, msg);
    etcd_client_free(c);
    return err;
}

rdzv_err rdzv_reset(const rdzv_etcd *etcd, const char *job, int *live, int64_t *deleted, char *msg)
{
    return reset_job(etcd, job, 0, NULL, live, deleted, msg);
}

rdzv_err rdzv_start_over(const rdzv_etcd *etcd, const char *job, const char *install_id, int *live,
                         int64_t *deleted, char *msg)
{
    return reset_job(etcd, job, 1, install_id, live, deleted, msg);
}

char *rdzv_status_json(const rdzv_status *s)
{
    if (!s) return NULL;
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    cJSON_AddStringToObject(o, "job_state", s->job_state);
    if (s->reason[0]) cJSON_AddStringToObject(o, "reason", s->reason);
    if (s->install[0]) cJSON_AddStringToObject(o, "install", s->install);
    cJSON_AddNumberToObject(o, "round", (double)s->round);
    cJSON_AddStringToObject(o, "round_state", s->round_state);
    cJSON_AddNumberToObject(o, "restarts", (double)s->restarts);
    cJSON_AddNumberToObject(o, "max_restarts", s->max_restarts);
    cJSON *ms = cJSON_AddArrayToObject(o, "members");
    int world = 0;
    for (int i = 0; ms && i < s->nmembers; i++) {
        cJSON *m = cJSON_CreateObject();
        if (!m) break;
        cJSON_AddStringToObject(m, "node", s->members[i].node_id);
        cJSON_AddStringToObject(m, "addr", s->members[i].addr);
        cJSON_AddNumberToObject(m, "rank", s->members[i].rank);
        cJSON_AddNumberToObject(m, "local_world_size", s->members[i].local_world_size);
        cJSON_AddNumberToObject(m, "first_global_rank", s->members[i].first_global_rank);
        world += s->members[i].local_world_size;
        cJSON_AddItemToArray(ms, m);
    }
    cJSON_AddNumberToObject(o, "world_size", world);
    cJSON *nodes = cJSON_AddArrayToObject(o, "nodes");
    for (int i = 0; nodes && i < s->nnodes; i++)
        cJSON_AddItemToArray(nodes, cJSON_CreateString(s->nodes[i]));
    cJSON *waiting = cJSON_AddArrayToObject(o, "waiting");
    for (int i = 0; waiting && i < s->nwaiting; i++)
        cJSON_AddItemToArray(waiting, cJSON_CreateString(s->waiting[i]));
    char *out = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return out;
}
