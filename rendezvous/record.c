/* record.c: the round record and the key layout (see rdzv_internal.h).
 *
 * The round record is small JSON written only inside txns guarded by its
 * mod_revision, so what one agent reads is what every agent reads at that
 * revision; the parser trusts nothing in it (a malformed record is a
 * protocol error, never a crash). Numbers in it stay far below 2^53, so
 * cJSON's doubles carry them exactly.
 */
#include "rdzv_internal.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int rdzv_key(char *buf, size_t len, const char *job, const char *fmt, ...)
{
    int n = snprintf(buf, len, "/ductile/%s/", job);
    if (n < 0 || (size_t)n >= len) return -1;
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(buf + n, len - (size_t)n, fmt, ap);
    va_end(ap);
    if (m < 0 || (size_t)m >= len - (size_t)n) return -1;
    return 0;
}

int rdzv_job_id_valid(const char *job)
{
    if (!job) return 0;
    size_t n = strlen(job);
    if (n < 1 || n > 63) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = job[i];
        int ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || (i > 0 && c == '-');
        if (!ok) return 0;
    }
    return 1;
}

int rdzv_install_id_valid(const char *id)
{
    if (!id) return 0;
    size_t n = strlen(id);
    if (n < 1 || n > RDZV_INSTALL_ID_MAX) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = id[i];
        int ok =
            (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-';
        if (!ok) return 0;
    }
    return 1;
}

int rdzv_node_id_valid(const char *node)
{
    if (!node) return 0;
    size_t n = strlen(node);
    if (n < 1 || n > RDZV_NODE_ID_MAX) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = node[i];
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                 c == '.' || c == '_' || c == '-';
        if (!ok) return 0;
    }
    return 1;
}

const char *rdzv_strerror(rdzv_err err)
{
    switch (err) {
    case RDZV_OK:
        return "ok";
    case RDZV_ERR_ARG:
        return "invalid argument";
    case RDZV_ERR_NOMEM:
        return "out of memory";
    case RDZV_ERR_ETCD:
        return "etcd failed or unreachable";
    case RDZV_ERR_TIMEOUT:
        return "deadline passed";
    case RDZV_ERR_FENCED:
        return "round is no longer current (fenced)";
    case RDZV_ERR_NOT_FOUND:
        return "no such key";
    case RDZV_ERR_LEASE_LOST:
        return "lease lost";
    case RDZV_ERR_JOB_DONE:
        return "job done";
    case RDZV_ERR_JOB_FAILED:
        return "job failed";
    case RDZV_ERR_DUPLICATE:
        return "node id already in use";
    case RDZV_ERR_CLOSED:
        return "handle closed";
    case RDZV_ERR_PROTOCOL:
        return "malformed rendezvous data in etcd";
    case RDZV_ERR_JOB_ENDED_ELSEWHERE:
        return "job ended in an earlier install";
    }
    return "unknown error";
}

static const char *cause_names[RDZV_CAUSE_COUNT] = {"none",         "member_lost", "member_left",
                                                    "node_waiting", "failure",     "peer_lost"};

const char *rdzv_cause_name(rdzv_cause cause)
{
    if ((int)cause < 0 || (size_t)cause >= sizeof(cause_names) / sizeof(cause_names[0]))
        return "unknown";
    return cause_names[cause];
}

rdzv_cause rdzv_cause_from_name(const char *name)
{
    for (size_t i = 0; i < sizeof(cause_names) / sizeof(cause_names[0]); i++)
        if (name && strcmp(name, cause_names[i]) == 0) return (rdzv_cause)i;
    return RDZV_CAUSE_NONE;
}

rdzv_err rdzv_from_etcd(etcd_err err)
{
    switch (err) {
    case ETCD_OK:
        return RDZV_OK;
    case ETCD_ERR_ARG:
        return RDZV_ERR_ARG;
    case ETCD_ERR_NOMEM:
        return RDZV_ERR_NOMEM;
    case ETCD_ERR_NOT_FOUND:
        return RDZV_ERR_NOT_FOUND;
    default:
        return RDZV_ERR_ETCD;
    }
}

rdzv_err rdzv_etcd_connect(const rdzv_etcd *cfg, etcd_client **out, char *msg)
{
    etcd_config ec = {
        .endpoints = cfg->endpoints,
        .cacert = cfg->cacert,
        .cert = cfg->cert,
        .key = cfg->key,
        .user = cfg->user,
        .password = cfg->password,
        .timeout_ms = cfg->timeout_ms,
    };
    if (!cfg->endpoints || !*cfg->endpoints) {
        if (msg) snprintf(msg, RDZV_MSG_MAX, "no etcd endpoints given");
        return RDZV_ERR_ARG;
    }
    etcd_err e = etcd_client_new(&ec, out);
    if (e != ETCD_OK) {
        if (msg) snprintf(msg, RDZV_MSG_MAX, "etcd client: %s", etcd_strerror(e));
        return e == ETCD_ERR_NOMEM ? RDZV_ERR_NOMEM : RDZV_ERR_ARG;
    }
    return RDZV_OK;
}

/* ---- the round record ---- */

char *rdzv_record_json(const rdzv_record *rec)
{
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    cJSON_AddNumberToObject(o, "number", (double)rec->number);
    cJSON_AddStringToObject(o, "state", rec->frozen ? "frozen" : "open");
    cJSON *ms = cJSON_AddArrayToObject(o, "members");
    for (int i = 0; ms && i < rec->nmembers; i++) {
        cJSON *m = cJSON_CreateObject();
        if (!m) break;
        cJSON_AddStringToObject(m, "node", rec->members[i].node);
        cJSON_AddStringToObject(m, "addr", rec->members[i].addr ? rec->members[i].addr : "");
        cJSON_AddNumberToObject(m, "lws", rec->members[i].lws);
        /* lease ids are 64-bit: a string, like the gateway writes them */
        char lease[32];
        snprintf(lease, sizeof(lease), "%lld", (long long)rec->members[i].lease);
        cJSON_AddStringToObject(m, "lease", lease);
        cJSON_AddItemToArray(ms, m);
    }
    cJSON *prev = cJSON_AddArrayToObject(o, "prev");
    for (int i = 0; prev && i < rec->nprev; i++)
        cJSON_AddItemToArray(prev, cJSON_CreateString(rec->prev[i]));
    cJSON_AddNumberToObject(o, "restarts", (double)rec->restarts);
    cJSON_AddNumberToObject(o, "max_restarts", rec->max_restarts);
    if (rec->max_nodes > 0) {
        cJSON_AddNumberToObject(o, "min_nodes", rec->min_nodes);
        cJSON_AddNumberToObject(o, "max_nodes", rec->max_nodes);
    }
    if (rec->counted > 0) cJSON_AddNumberToObject(o, "counted", (double)rec->counted);
    if (rec->peer_lost_of) {
        char h[24];
        snprintf(h, sizeof(h), "%016llx", (unsigned long long)rec->peer_lost_of);
        cJSON_AddStringToObject(o, "peer_lost_of", h);
    }
    cJSON_AddStringToObject(o, "job", rec->job[0] ? rec->job : "running");
    cJSON_AddStringToObject(o, "cause", rec->cause[0] ? rec->cause : "none");
    cJSON_AddStringToObject(o, "cause_node", rec->cause_node);
    cJSON_AddStringToObject(o, "reason", rec->reason);
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

static int get_int(const cJSON *o, const char *name, int64_t lo, int64_t hi, int64_t *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!cJSON_IsNumber(v)) return -1;
    double d = v->valuedouble;
    if (!(d >= (double)lo && d <= (double)hi) || floor(d) != d) return -1;
    *out = (int64_t)d;
    return 0;
}

static int get_str(const cJSON *o, const char *name, char *buf, size_t len)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!v) {
        buf[0] = '\0';
        return 0;
    }
    if (!cJSON_IsString(v) || strlen(v->valuestring) >= len) return -1;
    snprintf(buf, len, "%s", v->valuestring);
    return 0;
}

void rdzv_record_free(rdzv_record *rec)
{
    if (!rec) return;
    for (int i = 0; i < rec->nmembers; i++) {
        free(rec->members[i].node);
        free(rec->members[i].addr);
    }
    free(rec->members);
    for (int i = 0; i < rec->nprev; i++)
        free(rec->prev[i]);
    free(rec->prev);
    memset(rec, 0, sizeof(*rec));
}

/* The record's scalar fields: its number, state, counts and job state. */
static rdzv_err parse_fields(const cJSON *o, rdzv_record *out)
{
    int64_t v;
    char state[16];
    if (get_int(o, "number", 1, (int64_t)1 << 52, &out->number) != 0) return RDZV_ERR_PROTOCOL;
    if (get_str(o, "state", state, sizeof(state)) != 0) return RDZV_ERR_PROTOCOL;
    if (strcmp(state, "frozen") == 0)
        out->frozen = 1;
    else if (strcmp(state, "open") != 0)
        return RDZV_ERR_PROTOCOL;
    if (get_int(o, "restarts", 0, (int64_t)1 << 52, &out->restarts) != 0) return RDZV_ERR_PROTOCOL;
    if (get_int(o, "max_restarts", 0, 1 << 30, &v) != 0) return RDZV_ERR_PROTOCOL;
    out->max_restarts = (int)v;
    /* Fields added later are optional: a record from an older agent has none. */
    if (cJSON_GetObjectItemCaseSensitive(o, "max_nodes")) {
        int64_t lo, hi;
        if (get_int(o, "min_nodes", 1, 100000, &lo) != 0 ||
            get_int(o, "max_nodes", lo, 100000, &hi) != 0)
            return RDZV_ERR_PROTOCOL;
        out->min_nodes = (int)lo;
        out->max_nodes = (int)hi;
    }
    if (cJSON_GetObjectItemCaseSensitive(o, "counted") &&
        get_int(o, "counted", 0, (int64_t)1 << 52, &out->counted) != 0)
        return RDZV_ERR_PROTOCOL;
    char hash[24];
    if (get_str(o, "peer_lost_of", hash, sizeof(hash)) != 0) return RDZV_ERR_PROTOCOL;
    if (hash[0]) {
        char *end = NULL;
        out->peer_lost_of = strtoull(hash, &end, 16);
        if (!end || *end) return RDZV_ERR_PROTOCOL;
    }
    if (get_str(o, "job", out->job, sizeof(out->job)) != 0) return RDZV_ERR_PROTOCOL;
    if (strcmp(out->job, "running") != 0 && strcmp(out->job, "done") != 0 &&
        strcmp(out->job, "failed") != 0)
        return RDZV_ERR_PROTOCOL;
    if (get_str(o, "cause", out->cause, sizeof(out->cause)) != 0 ||
        get_str(o, "cause_node", out->cause_node, sizeof(out->cause_node)) != 0 ||
        get_str(o, "reason", out->reason, sizeof(out->reason)) != 0)
        return RDZV_ERR_PROTOCOL;
    return RDZV_OK;
}

static rdzv_err parse_members(const cJSON *o, rdzv_record *out)
{
    const cJSON *ms = cJSON_GetObjectItemCaseSensitive(o, "members");
    if (!cJSON_IsArray(ms)) return RDZV_ERR_PROTOCOL;
    int n = cJSON_GetArraySize(ms);
    if (n > 100000)
        return RDZV_ERR_PROTOCOL; /* with lws <= RDZV_MAX_LOCAL_WORLD, a world fits an int */
    if (n > 0) {
        out->members = calloc((size_t)n, sizeof(*out->members));
        if (!out->members) return RDZV_ERR_NOMEM;
    }
    const cJSON *m;
    cJSON_ArrayForEach(m, ms)
    {
        rdzv_rec_member *dst = &out->members[out->nmembers];
        const cJSON *node = cJSON_GetObjectItemCaseSensitive(m, "node");
        const cJSON *addr = cJSON_GetObjectItemCaseSensitive(m, "addr");
        const cJSON *lease = cJSON_GetObjectItemCaseSensitive(m, "lease");
        if (!cJSON_IsString(node) || !rdzv_node_id_valid(node->valuestring))
            return RDZV_ERR_PROTOCOL;
        if (!cJSON_IsString(addr) || !cJSON_IsString(lease)) return RDZV_ERR_PROTOCOL;
        int64_t v;
        if (get_int(m, "lws", 1, RDZV_MAX_LOCAL_WORLD, &v) != 0) return RDZV_ERR_PROTOCOL;
        dst->lws = (int)v;
        char *end = NULL;
        dst->lease = strtoll(lease->valuestring, &end, 10);
        if (!end || *end) return RDZV_ERR_PROTOCOL;
        dst->node = strdup(node->valuestring);
        dst->addr = strdup(addr->valuestring);
        out->nmembers++;
        if (!dst->node || !dst->addr) return RDZV_ERR_NOMEM;
    }
    return RDZV_OK;
}

/* The previous members' order (optional). */
static rdzv_err parse_prev(const cJSON *o, rdzv_record *out)
{
    const cJSON *prev = cJSON_GetObjectItemCaseSensitive(o, "prev");
    if (prev && !cJSON_IsArray(prev)) return RDZV_ERR_PROTOCOL;
    int n = prev ? cJSON_GetArraySize(prev) : 0;
    if (n <= 0) return RDZV_OK;
    out->prev = calloc((size_t)n, sizeof(char *));
    if (!out->prev) return RDZV_ERR_NOMEM;
    const cJSON *p;
    cJSON_ArrayForEach(p, prev)
    {
        if (!cJSON_IsString(p)) return RDZV_ERR_PROTOCOL;
        out->prev[out->nprev] = strdup(p->valuestring);
        if (!out->prev[out->nprev]) return RDZV_ERR_NOMEM;
        out->nprev++;
    }
    return RDZV_OK;
}

rdzv_err rdzv_record_parse(const char *json, size_t len, rdzv_record *out)
{
    memset(out, 0, sizeof(*out));
    cJSON *o = cJSON_ParseWithLength(json, len);
    if (!cJSON_IsObject(o)) {
        cJSON_Delete(o);
        return RDZV_ERR_PROTOCOL;
    }
    rdzv_err err = parse_fields(o, out);
    if (err == RDZV_OK) err = parse_members(o, out);
    if (err == RDZV_OK) err = parse_prev(o, out);
    cJSON_Delete(o);
    if (err != RDZV_OK) rdzv_record_free(out);
    return err;
}

void rdzv_record_carry(const rdzv_record *from, rdzv_record *to)
{
    to->restarts = from->restarts;
    to->max_restarts = from->max_restarts;
    to->min_nodes = from->min_nodes;
    to->max_nodes = from->max_nodes;
    to->counted = from->counted;
    to->peer_lost_of = from->peer_lost_of;
}

uint64_t rdzv_record_members_hash(const rdzv_record *rec)
{
    /* FNV-1a of each "node/lease", summed: the same set in any order. */
    uint64_t sum = 0;
    for (int i = 0; i < rec->nmembers; i++) {
        char buf[200];
        int n = snprintf(buf, sizeof(buf), "%s/%lld", rec->members[i].node,
                         (long long)rec->members[i].lease);
        uint64_t h = 1469598103934665603ULL;
        for (int j = 0; j < n && j < (int)sizeof(buf); j++) {
            h ^= (unsigned char)buf[j];
            h *= 1099511628211ULL;
        }
        sum += h;
    }
    return sum ? sum : 1;
}

rdzv_err rdzv_record_copy_order(const rdzv_record *from, rdzv_record *to)
{
    /* A frozen round's members in rank order; an open round passes on the
     * order it inherited. */
    int n = from->frozen ? from->nmembers : from->nprev;
    to->prev = n ? calloc((size_t)n, sizeof(char *)) : NULL;
    if (n && !to->prev) return RDZV_ERR_NOMEM;
    for (int i = 0; i < n; i++) {
        to->prev[i] = strdup(from->frozen ? from->members[i].node : from->prev[i]);
        if (!to->prev[i]) return RDZV_ERR_NOMEM;
        to->nprev++;
    }
    return RDZV_OK;
}

int rdzv_record_member_index(const rdzv_record *rec, const char *node)
{
    for (int i = 0; i < rec->nmembers; i++)
        if (strcmp(rec->members[i].node, node) == 0) return i;
    return -1;
}

int rdzv_ring_next(int me, int n, int out[RDZV_RING_PEERS])
{
    int k = 0;
    for (int i = 1; i <= n && k < RDZV_RING_PEERS; i++) {
        int at = ((me < 0 ? -1 : me) + i) % n;
        if (at != me) out[k++] = at;
    }
    return k;
}

void rdzv_round_free(rdzv_round *r)
{
    if (!r) return;
    for (int i = 0; i < r->nmembers; i++) {
        free(r->members[i].node_id);
        free(r->members[i].addr);
    }
    free(r->members);
    memset(r, 0, sizeof(*r));
}

const rdzv_member *rdzv_round_self(const rdzv_round *r)
{
    for (int i = 0; r && i < r->nmembers; i++)
        if (r->members[i].rank == r->my_rank) return &r->members[i];
    return NULL;
}

int rdzv_store_prefix(const char *job, int64_t round, char *out, size_t len)
{
    if (!rdzv_job_id_valid(job) || rdzv_key(out, len, job, "rounds/%lld/store/", (long long)round))
        return -1;
    return (int)strlen(out);
}

rdzv_err rdzv_record_to_round(const rdzv_record *rec, const char *me, rdzv_round *out)
{
    memset(out, 0, sizeof(*out));
    out->number = rec->number;
    out->my_rank = -1;
    out->restarts = rec->restarts;
    out->max_restarts = rec->max_restarts;
    if (rec->nmembers) {
        out->members = calloc((size_t)rec->nmembers, sizeof(*out->members));
        if (!out->members) return RDZV_ERR_NOMEM;
    }
    int global = 0;
    for (int i = 0; i < rec->nmembers; i++) {
        rdzv_member *m = &out->members[i];
        m->node_id = strdup(rec->members[i].node);
        m->addr = strdup(rec->members[i].addr);
        out->nmembers++;
        if (!m->node_id || !m->addr) {
            rdzv_round_free(out);
            return RDZV_ERR_NOMEM;
        }
        m->local_world_size = rec->members[i].lws;
        m->rank = i;
        m->first_global_rank = global;
        global += m->local_world_size;
        if (me && strcmp(me, m->node_id) == 0) out->my_rank = i;
    }
    out->world_size = global;
    return RDZV_OK;
}
