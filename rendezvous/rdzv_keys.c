/* rdzv_keys.c: the job's keys that the handle, the driver and the reports
 * all read and write (docs/design.md, "Keys"): the round record, the job
 * state, and a node's registration and joins.
 *
 * Every write of the round record is a txn guarded by its mod_revision, so
 * two threads or two agents acting on the same snapshot cannot both win;
 * each caller passes its own etcd connection.
 */
#include "rdzv_internal.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void rdzv_reg_parse(const etcd_kv *kv, rdzv_reg *out)
{
    memset(out, 0, sizeof(*out));
    cJSON *o = cJSON_ParseWithLength(kv->value, kv->value_len);
    const cJSON *addr = cJSON_GetObjectItemCaseSensitive(o, "addr");
    const cJSON *inc = cJSON_GetObjectItemCaseSensitive(o, "inc");
    const cJSON *probe = cJSON_GetObjectItemCaseSensitive(o, "probe");
    if (cJSON_IsString(addr)) snprintf(out->addr, sizeof(out->addr), "%s", addr->valuestring);
    if (cJSON_IsNumber(inc) && inc->valuedouble >= 1 && inc->valuedouble < 9e15)
        out->inc = (int64_t)inc->valuedouble;
    if (cJSON_IsNumber(probe)) out->probe = probe->valueint;
    cJSON_Delete(o);
}

rdzv_err rdzv_read_round(rdzv *r, etcd_client *c, rdzv_record *rec, int64_t *mod, int *have)
{
    char key[RDZV_KEY_MAX];
    rdzv_key(key, sizeof(key), r->cfg.job, "round");
    etcd_kv kv;
    etcd_err e = etcd_get(c, key, &kv);
    if (e == ETCD_ERR_NOT_FOUND) {
        *have = 0;
        return RDZV_OK;
    }
    if (e != ETCD_OK) return RDZV_ERR_ETCD;
    rdzv_err err = rdzv_record_parse(kv.value, kv.value_len, rec);
    *mod = kv.mod_revision;
    etcd_kv_free(&kv);
    *have = err == RDZV_OK;
    return err;
}

rdzv_err rdzv_put_record(rdzv *r, etcd_client *c, const rdzv_record *next, int64_t mod,
                         int bump_epoch, const char *state_json, int *won)
{
    return rdzv_put_record_seen(r, c, next, mod, bump_epoch, state_json, won, NULL);
}

rdzv_err rdzv_put_record_seen(rdzv *r, etcd_client *c, const rdzv_record *next, int64_t mod,
                              int bump_epoch, const char *state_json, int *won, rdzv_seen *seen)
{
    char round[RDZV_KEY_MAX], epoch[RDZV_KEY_MAX], stale[RDZV_KEY_MAX], restarts[RDZV_KEY_MAX],
        state[RDZV_KEY_MAX];
    rdzv_key(round, sizeof(round), r->cfg.job, "round");
    rdzv_key(epoch, sizeof(epoch), r->cfg.job, "epoch");
    rdzv_key(restarts, sizeof(restarts), r->cfg.job, "restarts");
    rdzv_key(state, sizeof(state), r->cfg.job, "state");
    /* Keys of round N-2 (relative to the new round N) are garbage by now:
     * no agent and no trainer of the last two rounds reads them. */
    rdzv_key(stale, sizeof(stale), r->cfg.job, "rounds/%lld/", (long long)(next->number - 2));
    char *json = rdzv_record_json(next);
    if (!json) return RDZV_ERR_NOMEM;
    char num[32], rs[32];
    snprintf(num, sizeof(num), "%lld", (long long)next->number);
    snprintf(rs, sizeof(rs), "%lld", (long long)next->restarts);
    etcd_cmp cmp = {.key = round,
                    .target = mod ? ETCD_CMP_MOD : ETCD_CMP_VERSION,
                    .op = ETCD_CMP_EQUAL,
                    .number = mod};
    etcd_op ops[5];
    size_t n = 0;
    ops[n++] =
        (etcd_op){.type = ETCD_OP_PUT, .key = round, .value = json, .value_len = strlen(json)};
    ops[n++] =
        (etcd_op){.type = ETCD_OP_PUT, .key = restarts, .value = rs, .value_len = strlen(rs)};
    if (bump_epoch) {
        ops[n++] =
            (etcd_op){.type = ETCD_OP_PUT, .key = epoch, .value = num, .value_len = strlen(num)};
        if (next->number > 2)
            ops[n++] = (etcd_op){.type = ETCD_OP_DELETE, .key = stale, .prefix = 1};
    }
    if (state_json)
        ops[n++] = (etcd_op){.type = ETCD_OP_PUT,
                             .key = state,
                             .value = state_json,
                             .value_len = strlen(state_json)};
    etcd_op els = {.type = ETCD_OP_RANGE, .key = round};
    etcd_txn_result res;
    etcd_err e = etcd_txn(c, &cmp, 1, ops, n, seen ? &els : NULL, seen ? 1 : 0, &res);
    free(json);
    if (e != ETCD_OK) return RDZV_ERR_ETCD;
    *won = res.succeeded;
    if (!res.succeeded) __atomic_fetch_add(&r->counts.moved, 1, __ATOMIC_RELAXED);
    rdzv_err err = RDZV_OK;
    if (seen) {
        memset(seen, 0, sizeof(*seen));
        seen->mod = res.revision; /* won: the record's mod_revision */
        if (!res.succeeded && res.n == 1 && res.ranges[0].n == 1) {
            const etcd_kv *kv = &res.ranges[0].kvs[0];
            err = rdzv_record_parse(kv->value, kv->value_len, &seen->rec);
            seen->mod = kv->mod_revision;
            seen->have = err == RDZV_OK;
        }
    }
    etcd_txn_result_free(&res);
    return err;
}

char *rdzv_state_json(const rdzv *r, const char *state, const char *reason)
{
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    cJSON_AddStringToObject(o, "state", state);
    cJSON_AddStringToObject(o, "reason", reason ? reason : "");
    if (r->cfg.install_id && r->cfg.install_id[0])
        cJSON_AddStringToObject(o, "install", r->cfg.install_id);
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

rdzv_err rdzv_state_parse(const char *value, size_t len, rdzv_job_state *out)
{
    memset(out, 0, sizeof(*out));
    cJSON *o = cJSON_ParseWithLength(value, len);
    const cJSON *st = cJSON_GetObjectItemCaseSensitive(o, "state");
    const cJSON *why = cJSON_GetObjectItemCaseSensitive(o, "reason");
    const cJSON *inst = cJSON_GetObjectItemCaseSensitive(o, "install");
    rdzv_err err = RDZV_ERR_PROTOCOL;
    if (cJSON_IsString(st) && strlen(st->valuestring) < sizeof(out->state)) {
        snprintf(out->state, sizeof(out->state), "%s", st->valuestring);
        err = RDZV_OK;
    }
    if (cJSON_IsString(why)) snprintf(out->reason, sizeof(out->reason), "%s", why->valuestring);
    if (cJSON_IsString(inst) && rdzv_install_id_valid(inst->valuestring))
        snprintf(out->install, sizeof(out->install), "%s", inst->valuestring);
    cJSON_Delete(o);
    return err;
}

int rdzv_state_elsewhere(const rdzv_job_state *st, const char *install)
{
    int ended = strcmp(st->state, "done") == 0 || strcmp(st->state, "failed") == 0;
    return ended && st->install[0] && install && install[0] && strcmp(st->install, install) != 0;
}

char *rdzv_node_value(const rdzv *r)
{
    char *val = NULL;
    cJSON *o = cJSON_CreateObject();
    if (o) {
        cJSON_AddStringToObject(o, "addr", r->cfg.addr);
        cJSON_AddNumberToObject(o, "lws", r->cfg.local_world_size);
        cJSON_AddNumberToObject(o, "inc", (double)r->incarnation);
        cJSON_AddNumberToObject(o, "probe", rdzv_probe_port(r->probe));
        val = cJSON_PrintUnformatted(o);
        cJSON_Delete(o);
    }
    return val;
}

rdzv_err rdzv_register_txn(rdzv *r, etcd_client *c, const char *key, const etcd_cmp *guards,
                           size_t nguards, const etcd_op *also, size_t nalso, etcd_txn_result *out)
{
    enum { MAX_GUARDS = 3, MAX_ALSO = 2 };
    if (nguards > MAX_GUARDS || nalso > MAX_ALSO) return RDZV_ERR_ARG;
    char *val = rdzv_node_value(r);
    if (!val) return RDZV_ERR_NOMEM;
    etcd_cmp cmps[1 + MAX_GUARDS];
    size_t ncmps = 0;
    for (size_t i = 0; i < nguards; i++)
        cmps[ncmps++] = guards[i];
    cmps[ncmps++] =
        (etcd_cmp){.key = key, .target = ETCD_CMP_VERSION, .op = ETCD_CMP_EQUAL, .number = 0};
    etcd_op ops[1 + MAX_ALSO] = {
        {.type = ETCD_OP_PUT,
         .key = key,
         .value = val,
         .value_len = strlen(val),
         .lease = r->lease},
    };
    for (size_t i = 0; i < nalso; i++)
        ops[1 + i] = also[i];
    etcd_err e = etcd_txn(c, cmps, ncmps, ops, 1 + nalso, NULL, 0, out);
    free(val);
    return e == ETCD_OK ? RDZV_OK : RDZV_ERR_ETCD;
}
