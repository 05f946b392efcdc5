/* rdzv.c: the rendezvous handle: open, leave, close, and the events that
 * come back to the caller (docs/design.md, "Rounds").
 *
 * rdzv_open() registers the node under a lease of its own and starts the
 * threads that do the protocol; the caller never waits on etcd except in
 * open, leave and the reports. What the threads learn comes back as events
 * on a queue whose eventfd the caller polls, so an agent keeps one poll()
 * loop. The work is split along the threads:
 *
 *   rdzv.c          the handle, on the caller's thread
 *   rdzv_events.c   the events to the caller, queued by any thread
 *   rdzv_keys.c     the job's keys the handle, driver and reports share
 *   rdzv_driver.c   the driver thread: one protocol step per snapshot
 *   rdzv_join.c     its steps in an open round: join, watch the one before
 *   rdzv_freeze.c   the earliest joiner's step: when to freeze, with whom
 *   rdzv_fence.c    its step in a frozen round: end it, open the next
 *   rdzv_watch.c    what wakes the driver: watch threads and the keep-alive
 *   rdzv_report.c   failures and the end of the job (caller's thread)
 *   probe.c         the registration's liveness probe: a responder thread,
 *                   and the prober rdzv_open asks before taking over a
 *                   registration of its node id from a dead incarnation
 *   rdzv_suspect.c  whether a member's agent is gone (a worker's exit)
 *   rdzv_sentinel.c the sentinel thread: the next members' probe
 *                   connections held, a closed one checked at once
 */
#include "rdzv_internal.h"

#include "ductile/clock.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

/* ---- open / close ---- */

static rdzv_err check_config(const rdzv_config *c, char *msg)
{
    const char *bad = NULL;
    if (!rdzv_job_id_valid(c->job))
        bad = "job id must match [a-z0-9][a-z0-9-]{0,62}";
    else if (!rdzv_node_id_valid(c->node_id))
        bad = "node id must match [A-Za-z0-9._-]{1,128}";
    else if (c->local_world_size < 1 || c->local_world_size > RDZV_MAX_LOCAL_WORLD)
        bad = "local world size must be 1..1024 (RDZV_MAX_LOCAL_WORLD)";
    else if (c->min_nodes < 1 || c->max_nodes < c->min_nodes)
        bad = "need 1 <= min_nodes <= max_nodes";
    else if (c->lease_ttl_s < 2)
        bad = "lease TTL must be >= 2 s";
    else if (c->last_call_ms < 0 || c->join_timeout_ms < 0 || c->max_restarts < 0 ||
             c->etcd.timeout_ms < 0)
        bad = "negative timeout or restart budget";
    else if (c->addr && strlen(c->addr) > 1024)
        bad = "address too long";
    else if (c->install_id && c->install_id[0] && !rdzv_install_id_valid(c->install_id))
        bad = "install id must match [A-Za-z0-9-]{1,64}";
    if (!bad) return RDZV_OK;
    if (msg) snprintf(msg, RDZV_MSG_MAX, "%s", bad);
    return RDZV_ERR_ARG;
}

static char *dup_or_null(const char *s)
{
    return s ? strdup(s) : NULL;
}

static void rdzv_free(rdzv *r)
{
    if (!r) return;
    etcd_client_free(r->api);
    etcd_client_free(r->rep);
    etcd_client_free(r->dc);
    etcd_client_free(r->kac);
    rdzv_events_free(r);
    if (r->efd >= 0) close(r->efd);
    rdzv_sentinel_free(r);
    rdzv_probe_stop(r->probe);
    free(r->round_cache);
    if (r->have_last) rdzv_record_free(&r->last_rec);
    for (size_t i = 0; i < sizeof(r->strs) / sizeof(r->strs[0]); i++)
        free(r->strs[i]);
    pthread_mutex_destroy(&r->api_mu);
    pthread_mutex_destroy(&r->rep_mu);
    pthread_mutex_destroy(&r->ev_mu);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r);
}

/* The job state (kv: the `state` key, NULL when there is none);
 * RDZV_ERR_JOB_DONE / _FAILED when the job has ended. */
static rdzv_err check_job_state(rdzv *r, const etcd_kv *kv, char *msg)
{
    if (!kv) return RDZV_OK;
    rdzv_job_state st;
    rdzv_err err = rdzv_state_parse(kv->value, kv->value_len, &st);
    const char *inst = r->cfg.install_id;
    if (err != RDZV_OK) {
        snprintf(msg, RDZV_MSG_MAX, "malformed job state under %.200s", kv->key);
    } else if (rdzv_state_elsewhere(&st, inst)) {
        err = RDZV_ERR_JOB_ENDED_ELSEWHERE;
        snprintf(msg, RDZV_MSG_MAX,
                 "job %s ended (%s) in an earlier install (install %s); this is install %s: "
                 "set job.startOver=true (DUCTILE_START_OVER) to train it again, or use "
                 "another job name",
                 r->cfg.job, st.state, st.install, inst);
    } else if (strcmp(st.state, "done") == 0) {
        err = RDZV_ERR_JOB_DONE;
        snprintf(msg, RDZV_MSG_MAX, "job %s has already completed", r->cfg.job);
    } else if (strcmp(st.state, "failed") == 0) {
        err = RDZV_ERR_JOB_FAILED;
        snprintf(msg, RDZV_MSG_MAX, "job %s has failed: %.180s", r->cfg.job, st.reason);
    }
    return err;
}

/* --nnodes is job-wide: the first agent's limits are in the round record,
 * and an agent given others is refused (it would keep opening rounds that
 * the others freeze by other rules). */
static rdzv_err check_job_limits(rdzv *r, const etcd_kv *kv, char *msg)
{
    if (!kv) {
        r->round_absent = 1; /* the driver's first step creates it, no read before */
        return RDZV_OK;
    }
    rdzv_record rec;
    rdzv_err err = rdzv_record_parse(kv->value, kv->value_len, &rec);
    if (err != RDZV_OK) {
        snprintf(msg, RDZV_MSG_MAX, "malformed round record under /ductile/%s/round", r->cfg.job);
        return err;
    }
    /* The driver's first step starts from this record (one request less
     * per join); its snapshot is guarded by the record's mod_revision, so
     * a record that moved meanwhile is only read again. */
    rdzv_cache_round(r, kv);
    if (rec.max_nodes > 0 &&
        (rec.min_nodes != r->cfg.min_nodes || rec.max_nodes != r->cfg.max_nodes)) {
        snprintf(msg, RDZV_MSG_MAX,
                 "job %s runs with --nnodes %d:%d (set by its first agent) but this agent has "
                 "%d:%d",
                 r->cfg.job, rec.min_nodes, rec.max_nodes, r->cfg.min_nodes, r->cfg.max_nodes);
        err = RDZV_ERR_ARG;
    }
    rdzv_record_free(&rec);
    return err;
}

/* ---- registration: create, or take over from a dead incarnation ---- */

/* Puts this node's registration in place of kv, in one txn guarded by kv's
 * mod_revision, then revokes kv's lease: its waiting and join keys go with
 * it, and an old incarnation that was alive after all finds its lease
 * gone. A revoke that fails is harmless: the lease expires, and the round
 * record already sees the node under another lease. */
static rdzv_err take_over(rdzv *r, const etcd_kv *kv, int *won, int64_t *revision)
{
    char *val = rdzv_node_value(r);
    if (!val) return RDZV_ERR_NOMEM;
    etcd_cmp same = {
        .key = kv->key, .target = ETCD_CMP_MOD, .op = ETCD_CMP_EQUAL, .number = kv->mod_revision};
    etcd_op put = {.type = ETCD_OP_PUT,
                   .key = kv->key,
                   .value = val,
                   .value_len = strlen(val),
                   .lease = r->lease};
    etcd_txn_result res;
    etcd_err e = etcd_txn(r->dc, &same, 1, &put, 1, NULL, 0, &res);
    free(val);
    if (e != ETCD_OK) return RDZV_ERR_ETCD;
    *won = res.succeeded;
    *revision = res.revision;
    etcd_txn_result_free(&res);
    if (*won) {
        e = etcd_lease_revoke(r->dc, kv->lease);
        dlog_debug(&r->log, NULL, "took over %s from lease %lld (revoke: %s)", kv->key,
                   (long long)kv->lease, etcd_strerror(e));
    }
    return RDZV_OK;
}

/* The registration kv is in the way: refuse (RDZV_ERR_DUPLICATE, msg
 * says why) unless its incarnation is dead and taking over is allowed;
 * then *dead is set and r->incarnation is the next one. */
static rdzv_err judge_registration(rdzv *r, const etcd_kv *kv, int *dead, char *msg)
{
    rdzv_reg old;
    rdzv_reg_parse(kv, &old);
    char why[RDZV_MSG_MAX] = "";
    /* Not taking over at all: no probe, which could stall the caller. */
    rdzv_probe_verdict v = RDZV_PROBE_UNKNOWN;
    if (!r->cfg.no_takeover)
        v = rdzv_probe_check(old.addr, old.probe, r->node, old.inc, RDZV_PROBE_TIMEOUT_MS, why,
                             sizeof(why));
    *dead = v == RDZV_PROBE_DEAD;
    if (*dead) {
        r->incarnation = old.inc + 1;
        rdzv_probe_set_incarnation(r->probe, r->incarnation);
        dlog_debug(&r->log, NULL, "incarnation %lld of %s is gone (%s): taking over",
                   (long long)old.inc, r->node, why);
        return RDZV_OK;
    }
    /* Composed whole, then cut to the caller's one line. */
    char line[2 * RDZV_MSG_MAX + RDZV_NODE_ID_MAX + 128];
    if (r->cfg.no_takeover)
        snprintf(line, sizeof(line),
                 "node id %s is registered in job %s by another agent (incarnation %lld); this "
                 "one lost its registration and does not take it back",
                 r->node, r->cfg.job, (long long)old.inc);
    else
        snprintf(line, sizeof(line),
                 "node id %s is already registered in job %s by %s (incarnation %lld: %s)%s",
                 r->node, r->cfg.job,
                 v == RDZV_PROBE_ALIVE ? "a live agent" : "an agent that did not answer",
                 (long long)old.inc, why,
                 v == RDZV_PROBE_ALIVE ? "" : "; its lease ends within its TTL unless it is alive");
    line[RDZV_MSG_MAX - 1] = '\0';
    memcpy(msg, line, RDZV_MSG_MAX);
    return RDZV_ERR_DUPLICATE;
}

/* rdzv_open's one txn: registers nodes/<node> under this handle's lease
 * unless the job has ended or a registration is there, and reads the
 * job's state and round record either way (the registration that stands
 * too, where a compare failed). The job's state key is written twice at
 * most: "running" with round 1 (version 1), then its end with the record
 * that ends it (version 2; a reset or a start over deletes it), so
 * "version < 2" is "not ended" as a compare. res: the answer; the state
 * is ranges[0] and the round ranges[1] either way, the registration
 * ranges[2] on failure. */
static rdzv_err open_txn(rdzv *r, const char *node_key, etcd_txn_result *res)
{
    char state[RDZV_KEY_MAX], round[RDZV_KEY_MAX];
    rdzv_key(state, sizeof(state), r->cfg.job, "state");
    rdzv_key(round, sizeof(round), r->cfg.job, "round");
    char *val = rdzv_node_value(r);
    if (!val) return RDZV_ERR_NOMEM;
    etcd_cmp cmps[2] = {
        {.key = state, .target = ETCD_CMP_VERSION, .op = ETCD_CMP_LESS, .number = 2},
        {.key = node_key, .target = ETCD_CMP_VERSION, .op = ETCD_CMP_EQUAL, .number = 0},
    };
    etcd_op then[3] = {
        {.type = ETCD_OP_RANGE, .key = state},
        {.type = ETCD_OP_RANGE, .key = round},
        {.type = ETCD_OP_PUT,
         .key = node_key,
         .value = val,
         .value_len = strlen(val),
         .lease = r->lease},
    };
    etcd_op els[3] = {{.type = ETCD_OP_RANGE, .key = state},
                      {.type = ETCD_OP_RANGE, .key = round},
                      {.type = ETCD_OP_RANGE, .key = node_key}};
    etcd_err e = etcd_txn(r->dc, cmps, 2, then, 3, els, 3, res);
    free(val);
    if (e != ETCD_OK) return RDZV_ERR_ETCD;
    if (res->n != 3) {
        etcd_txn_result_free(res);
        return RDZV_ERR_PROTOCOL;
    }
    return RDZV_OK;
}

static const etcd_kv *first_kv(const etcd_txn_result *res, size_t i)
{
    return res->ranges[i].n ? &res->ranges[i].kvs[0] : NULL;
}

/* Registers nodes/<node> under this handle's lease: create-only, so a
 * second live agent with this node id is refused; a registration whose
 * incarnation is dead is taken over (docs/design.md, "Rounds"). The same
 * txn checks the job: an ended job (its state) and other node limits than
 * the job's (its round record) are refused; a registration made before
 * the limits said no goes with the lease the caller revokes. A few
 * attempts, since the key may change between the read and the txn. */
static rdzv_err register_self(rdzv *r, int64_t *revision, char *msg)
{
    char key[RDZV_KEY_MAX];
    rdzv_key(key, sizeof(key), r->cfg.job, "nodes/%s", r->node);
    rdzv_err err = RDZV_OK;
    for (int attempt = 0; attempt < 4; attempt++) {
        int won = 0, dead = 0;
        r->incarnation = 1;
        rdzv_probe_set_incarnation(r->probe, r->incarnation);
        etcd_txn_result res;
        err = open_txn(r, key, &res);
        if (err == RDZV_ERR_PROTOCOL) {
            snprintf(msg, RDZV_MSG_MAX, "etcd at %s: malformed answer to the registration txn",
                     r->etcd.endpoints);
            return err;
        }
        if (err != RDZV_OK) break;
        const etcd_kv *old = res.succeeded ? NULL : first_kv(&res, 2);
        /* On success too: a job ended by an agent that wrote no "running"
         * state has its end at version 1 (the registration then goes with
         * the lease the caller revokes). */
        err = check_job_state(r, first_kv(&res, 0), msg);
        if (err == RDZV_OK) err = check_job_limits(r, first_kv(&res, 1), msg);
        if (err == RDZV_OK && res.succeeded) {
            *revision = res.revision;
            etcd_txn_result_free(&res);
            return RDZV_OK;
        }
        if (err == RDZV_OK && old) {
            err = judge_registration(r, old, &dead, msg);
            if (err == RDZV_OK) err = take_over(r, old, &won, revision);
        }
        etcd_txn_result_free(&res);
        if (err != RDZV_OK) break;
        if (won) {
            r->took_over = 1;
            return RDZV_OK;
        }
        /* gone meanwhile (or moved before the takeover): try again */
    }
    if (err == RDZV_ERR_ETCD)
        snprintf(msg, RDZV_MSG_MAX, "etcd at %s: register %s: %s", r->etcd.endpoints, r->node,
                 etcd_last_error(r->dc)[0] ? etcd_last_error(r->dc) : "no answer");
    else if (err == RDZV_OK && !msg[0]) {
        snprintf(msg, RDZV_MSG_MAX, "node id %s: registration in job %s keeps changing", r->node,
                 r->cfg.job);
        err = RDZV_ERR_DUPLICATE;
    }
    return err;
}

int64_t rdzv_incarnation(const rdzv *r, int *took_over)
{
    if (took_over) *took_over = r->took_over;
    return r->incarnation;
}

/* The handle's locks, and its own copy of the configuration's strings. */
static rdzv_err handle_init(rdzv *r, const rdzv_config *cfg)
{
    pthread_mutex_init(&r->api_mu, NULL);
    pthread_mutex_init(&r->rep_mu, NULL);
    pthread_mutex_init(&r->ev_mu, NULL);
    pthread_mutex_init(&r->mu, NULL);
    mono_cond_init(&r->cv);
    r->cfg = *cfg;
    const char *src[10] = {cfg->etcd.endpoints,
                           cfg->etcd.cacert,
                           cfg->etcd.cert,
                           cfg->etcd.key,
                           cfg->etcd.user,
                           cfg->etcd.password,
                           cfg->job,
                           cfg->node_id,
                           cfg->addr ? cfg->addr : "",
                           cfg->install_id};
    for (int i = 0; i < 10; i++) {
        r->strs[i] = dup_or_null(src[i]);
        if (src[i] && !r->strs[i]) return RDZV_ERR_NOMEM;
    }
    r->cfg.etcd = (rdzv_etcd){r->strs[0], r->strs[1], r->strs[2],          r->strs[3],
                              r->strs[4], r->strs[5], cfg->etcd.timeout_ms};
    r->cfg.job = r->strs[6];
    r->cfg.node_id = r->strs[7];
    r->cfg.addr = r->strs[8];
    r->cfg.install_id = r->strs[9];
    if (r->cfg.join_timeout_ms == 0) r->cfg.join_timeout_ms = 600000;
    r->etcd = r->cfg.etcd;
    snprintf(r->node, sizeof(r->node), "%s", r->cfg.node_id);
    /* A bad DUCTILE_LOG_LEVEL is the agent's to report; here it only means
     * no debug traces. */
    char why[RDZV_MSG_MAX];
    dlog_init(&r->log, "rdzv", r->node, 1, why, sizeof(why));
    const char *dbg = getenv("DUCTILE_RDZV_DEBUG");
    if (dbg && *dbg && strcmp(dbg, "0") != 0) r->log.level = DLOG_DEBUG;
    return RDZV_OK;
}

/* The caller's events' eventfd, and the handle's four etcd clients: the
 * caller's calls, its reports, the driver's and the keep-alive's. */
static rdzv_err connect_clients(rdzv *r, char *msg)
{
    r->efd = eventfd(0, EFD_SEMAPHORE | EFD_NONBLOCK | EFD_CLOEXEC);
    if (r->efd < 0) {
        snprintf(msg, RDZV_MSG_MAX, "eventfd: %s", strerror(errno));
        return RDZV_ERR_NOMEM;
    }
    rdzv_err err;
    if ((err = rdzv_etcd_connect(&r->etcd, &r->api, msg)) != RDZV_OK) return err;
    if ((err = rdzv_etcd_connect(&r->etcd, &r->rep, msg)) != RDZV_OK) return err;
    if ((err = rdzv_etcd_connect(&r->etcd, &r->dc, msg)) != RDZV_OK) return err;
    if ((err = rdzv_etcd_connect(&r->etcd, &r->kac, msg)) != RDZV_OK) return err;
    /* Failpoints name the client: etcd.api.txn is one of the caller's own
     * calls once open (report, finish, leave), never the driver's; the two
     * clients share the name, and so its count. rdzv_open's own requests
     * (the lease; the registration txn, which reads the job's state and
     * round too) go over the driver's connection, which has nothing to do
     * before the driver starts: an agent's form opens one connection
     * fewer. */
    etcd_client_set_name(r->api, "api");
    etcd_client_set_name(r->rep, "api");
    etcd_client_set_name(r->dc, "driver");
    etcd_client_set_name(r->kac, "keepalive");
    etcd_client *mine[] = {r->api, r->rep, r->dc, r->kac};
    for (size_t i = 0; i < sizeof(mine) / sizeof(mine[0]); i++)
        etcd_client_count_into(mine[i], &r->counts.etcd);
    return RDZV_OK;
}

/* The threads of the protocol: the watches, the sentinel, the keep-alive
 * and the driver. On failure the ones started are stopped again. */
static rdzv_err start_threads(rdzv *r, int64_t reg_rev, char *msg)
{
    rdzv_err err;
    if ((err = rdzv_watch_round(r, reg_rev + 1)) != RDZV_OK) {
        snprintf(msg, RDZV_MSG_MAX, "cannot start watch threads");
        goto err;
    }
    if ((err = rdzv_sentinel_start(r)) != RDZV_OK) goto err;
    r->seek_start_ms = mono_now_ms();
    r->deadline_ms = r->seek_start_ms + r->cfg.join_timeout_ms;
    if (pthread_create(&r->keepalive, NULL, rdzv_keepalive_main, r) != 0) {
        err = RDZV_ERR_NOMEM;
        goto err;
    }
    r->keepalive_started = 1;
    if (pthread_create(&r->driver, NULL, rdzv_driver_main, r) != 0) {
        err = RDZV_ERR_NOMEM;
        goto err;
    }
    r->driver_started = 1;
    return RDZV_OK;

err:
    pthread_mutex_lock(&r->mu);
    r->stop = 1;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    if (r->keepalive_started) pthread_join(r->keepalive, NULL);
    rdzv_watchers_join(r);
    rdzv_sentinel_stop(r);
    return err;
}

rdzv_err rdzv_open(const rdzv_config *cfg, rdzv **out, char *msg)
{
    char scratch[RDZV_MSG_MAX];
    if (!msg) msg = scratch;
    msg[0] = '\0';
    if (!cfg || !out) {
        snprintf(msg, RDZV_MSG_MAX, "no configuration");
        return RDZV_ERR_ARG;
    }
    *out = NULL;
    rdzv_err err = check_config(cfg, msg);
    if (err != RDZV_OK) return err;

    rdzv *r = calloc(1, sizeof(*r));
    if (!r) return RDZV_ERR_NOMEM;
    r->efd = -1;
    if ((err = handle_init(r, cfg)) != RDZV_OK) goto err;
    if ((err = connect_clients(r, msg)) != RDZV_OK) goto err;

    if ((err = rdzv_probe_start(r->cfg.addr, r->node, &r->probe)) != RDZV_OK) {
        snprintf(msg, RDZV_MSG_MAX, "cannot start the liveness probe");
        goto err;
    }
    etcd_err e = etcd_lease_grant(r->dc, r->cfg.lease_ttl_s, &r->lease);
    if (e != ETCD_OK) {
        snprintf(msg, RDZV_MSG_MAX, "etcd at %s: lease grant: %s", r->etcd.endpoints,
                 etcd_last_error(r->dc)[0] ? etcd_last_error(r->dc) : etcd_strerror(e));
        err = RDZV_ERR_ETCD;
        goto err;
    }

    int64_t reg_rev = 0;
    if ((err = register_self(r, &reg_rev, msg)) != RDZV_OK) goto err_lease;
    if ((err = start_threads(r, reg_rev, msg)) != RDZV_OK) goto err_lease;
    *out = r;
    return RDZV_OK;

err_lease:
    etcd_lease_revoke(r->dc, r->lease);
err:
    rdzv_free(r);
    return err;
}

static void stop_threads(rdzv *r)
{
    pthread_mutex_lock(&r->mu);
    r->stop = 1;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    if (r->driver_started) pthread_join(r->driver, NULL);
    if (r->keepalive_started) pthread_join(r->keepalive, NULL);
    r->driver_started = r->keepalive_started = 0;
    rdzv_watchers_join(r);
    rdzv_sentinel_stop(r);
}

rdzv_err rdzv_leave(rdzv *r)
{
    if (!r) return RDZV_ERR_ARG;
    pthread_mutex_lock(&r->api_mu);
    if (r->closed) {
        pthread_mutex_unlock(&r->api_mu);
        return RDZV_ERR_CLOSED;
    }
    /* Stop acting first, so this node does not react to its own leave. */
    pthread_mutex_lock(&r->mu);
    r->closed = 1;
    r->stop = 1;
    int64_t round = r->member_round;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    int t = r->etcd.timeout_ms ? r->etcd.timeout_ms : 5000;
    etcd_set_timeout(r->api, t / 2 > 0 ? t / 2 : 1);
    rdzv_err err = RDZV_OK;
    if (round > 0) {
        /* The marker outlives the lease, so peers that see the node key
         * vanish can tell a leave from a crash. */
        char key[RDZV_KEY_MAX], joined[RDZV_KEY_MAX];
        rdzv_key(key, sizeof(key), r->cfg.job, "rounds/%lld/left/%s", (long long)round, r->node);
        rdzv_key(joined, sizeof(joined), r->cfg.job, "rounds/%lld/joined/%s", (long long)round,
                 r->node);
        /* Only while round's keys are still there: once rounds/<round>/ has
         * been collected, a marker written now would never be deleted. */
        etcd_cmp cmp = {.key = joined, .target = ETCD_CMP_VERSION, .op = ETCD_CMP_GREATER};
        etcd_op put = {.type = ETCD_OP_PUT, .key = key, .value = "1", .value_len = 1};
        if (etcd_txn(r->api, &cmp, 1, &put, 1, NULL, 0, NULL) != ETCD_OK) err = RDZV_ERR_ETCD;
    }
    etcd_err e = etcd_lease_revoke(r->api, r->lease);
    if (e != ETCD_OK && e != ETCD_ERR_NOT_FOUND) err = RDZV_ERR_ETCD;
    etcd_set_timeout(r->api, 0);
    pthread_mutex_unlock(&r->api_mu);
    stop_threads(r);
    return err;
}

void rdzv_close(rdzv *r)
{
    if (!r) return;
    stop_threads(r);
    pthread_mutex_lock(&r->mu);
    r->close_called = 1;
    int last = r->holds == 0;
    pthread_mutex_unlock(&r->mu);
    if (last) rdzv_free(r);
}

void rdzv_hold(rdzv *r)
{
    pthread_mutex_lock(&r->mu);
    r->holds++;
    pthread_mutex_unlock(&r->mu);
}

void rdzv_release(rdzv *r)
{
    if (!r) return;
    pthread_mutex_lock(&r->mu);
    int last = --r->holds == 0 && r->close_called;
    pthread_mutex_unlock(&r->mu);
    if (last) rdzv_free(r);
}

double rdzv_seconds_in_rendezvous(const rdzv *r)
{
    rdzv *m = (rdzv *)r; /* the lock is not part of the logical state */
    pthread_mutex_lock(&m->mu);
    double s = r->seconds_in_rdzv;
    if (r->seek_start_ms) s += (mono_now_ms() - r->seek_start_ms) / 1000.0;
    pthread_mutex_unlock(&m->mu);
    return s;
}

void rdzv_get_counts(rdzv *r, rdzv_counts *out)
{
    etcd_counts_read(&r->counts.etcd, &out->etcd);
    out->steps = __atomic_load_n(&r->counts.steps, __ATOMIC_RELAXED);
    out->moved = __atomic_load_n(&r->counts.moved, __ATOMIC_RELAXED);
}
