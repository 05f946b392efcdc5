/* rdzv.c: the rendezvous protocol (docs/design.md, "Rounds").
 *
 * One driver thread per handle is level-triggered: whatever woke it (a
 * watch event, the last-call timer, a retry), it reads one consistent
 * snapshot of the job (the round record, then in one txn guarded by the
 * record's mod_revision: node keys, waiting keys, the round's joins and
 * leave markers) and takes the one step that snapshot calls for: join,
 * freeze, open the next round, or report what happened. Every write is a
 * txn guarded by the record's mod_revision, so two agents acting on the same
 * snapshot cannot both win; the loser simply reads again. Because each step
 * starts from etcd's state rather than from the events, a lost event or an
 * etcd restart costs a re-read, never a wrong belief.
 *
 * Watches (each on its own thread, feeding the driver's inbox) are what
 * wake the driver; there is no polling. Every agent watches `round`, and
 * from its first frozen round on `nodes/` and `waiting/`; only the earliest
 * joiner of an open round watches the joins, the others watch just the join
 * key before theirs (the etcd election recipe), so a freezer that dies is
 * replaced at once. A keep-alive
 * thread renews the lease at TTL/3 on its own connection so that a slow
 * protocol step can never starve it.
 */
#include "rdzv_internal.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

enum {
    TAG_ROUND = 1,
    TAG_NODES = 2,
    TAG_WAITING = 4,
    TAG_JOIN = 8,
    TAG_RESYNC = 16,
};

/* What a step returns besides rdzv_err: the snapshot moved, read again. */
#define STEP_AGAIN (-1)

typedef struct watcher {
    struct rdzv *r;
    pthread_t th;
    char key[RDZV_KEY_MAX];
    int prefix;
    int64_t start_rev;
    int tag;
    pthread_mutex_t mu;
    int stop;
    etcd_watch *w;
    struct watcher *next; /* on the retired list */
} watcher;

typedef struct ev_node {
    rdzv_event ev;
    struct ev_node *next;
} ev_node;

struct rdzv {
    /* configuration, deep-copied */
    rdzv_config cfg;
    rdzv_etcd etcd;
    char *strs[9];
    char node[129];
    int debug;

    etcd_client *api; /* calls made from the caller's thread */
    pthread_mutex_t api_mu;
    int64_t lease;
    int closed;

    /* events to the caller */
    pthread_mutex_t ev_mu;
    ev_node *ev_head, *ev_tail;
    int efd;

    /* the driver's inbox and what the caller's thread may read */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop;
    unsigned dirty;
    int lease_lost;
    int64_t member_round; /* the last round this node was frozen into */
    char *round_cache;    /* the round record as the last watch event had it */
    size_t round_cache_len;
    int64_t round_cache_mod;
    double seconds_in_rdzv;
    int64_t seek_start_ms;

    pthread_t driver, keepalive;
    int driver_started, keepalive_started;
    etcd_client *dc, *kac;
    watcher *w_round, *w_nodes, *w_waiting, *w_join, *retired;

    /* driver-only state */
    int64_t in_round;     /* frozen round this node is in, not yet ended */
    int64_t reported;     /* newest round reported FROZEN: never again, nor older */
    int64_t spare_round;  /* round for which SPARE was reported */
    int waiting_written;  /* waiting/<node> exists */
    int64_t deadline_ms;  /* join deadline, 0 when none runs */
    int64_t last_call_at; /* freeze timer, 0 when none */
    int64_t retry_at;     /* retry timer after an etcd error, 0 when none */
    int64_t backoff_ms;
    int terminal;
    int64_t fz_round, fz_count, fz_maxrev, fz_last_join;
    char join_target[RDZV_KEY_MAX + 2];
};

static void dlog(const rdzv *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void dlog(const rdzv *r, const char *fmt, ...)
{
    if (!r->debug) return;
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    fprintf(stderr, "rdzv[%s] %.3f: %s\n", r->node, rdzv_now_ms() / 1000.0, buf);
}

/* ---- events to the caller ---- */

/* Queues ev (taking its round) for the caller. */
static void emit(rdzv *r, rdzv_event *ev)
{
    ev_node *n = calloc(1, sizeof(*n));
    if (!n) { /* nothing sensible to do; the caller's deadlines still hold */
        rdzv_event_free(ev);
        return;
    }
    n->ev = *ev;
    pthread_mutex_lock(&r->ev_mu);
    if (r->ev_tail)
        r->ev_tail->next = n;
    else
        r->ev_head = n;
    r->ev_tail = n;
    uint64_t one = 1;
    ssize_t w = write(r->efd, &one, sizeof(one));
    (void)w;
    pthread_mutex_unlock(&r->ev_mu);
}

static void emit_simple(rdzv *r, rdzv_event_type type, rdzv_err err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void emit_simple(rdzv *r, rdzv_event_type type, rdzv_err err, const char *fmt, ...)
{
    rdzv_event ev;
    memset(&ev, 0, sizeof(ev));
    ev.type = type;
    ev.err = err;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ev.reason, sizeof(ev.reason), fmt, ap);
    va_end(ap);
    emit(r, &ev);
}

int rdzv_fd(const rdzv *r)
{
    return r->efd;
}

rdzv_err rdzv_next_event(rdzv *r, int timeout_ms, rdzv_event *ev)
{
    if (!r || !ev) return RDZV_ERR_ARG;
    if (timeout_ms > 0) {
        struct pollfd p = {.fd = r->efd, .events = POLLIN};
        while (poll(&p, 1, timeout_ms) < 0 && errno == EINTR) {
        }
    }
    pthread_mutex_lock(&r->ev_mu);
    ev_node *n = r->ev_head;
    if (n) {
        r->ev_head = n->next;
        if (!r->ev_head) r->ev_tail = NULL;
        uint64_t v;
        ssize_t rd = read(r->efd, &v, sizeof(v));
        (void)rd;
    }
    pthread_mutex_unlock(&r->ev_mu);
    if (!n) return RDZV_ERR_TIMEOUT;
    *ev = n->ev;
    free(n);
    return RDZV_OK;
}

void rdzv_event_free(rdzv_event *ev)
{
    if (ev) rdzv_round_free(&ev->round);
}

/* ---- the driver's inbox ---- */

static void post(rdzv *r, unsigned tag)
{
    pthread_mutex_lock(&r->mu);
    r->dirty |= tag;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

/* Waits on r->cv until `until_ms` (0: forever) or stop; returns 1 on stop.
 * Called with r->mu held. */
static int wait_until(rdzv *r, int64_t until_ms)
{
    if (r->stop) return 1;
    if (until_ms == 0) {
        pthread_cond_wait(&r->cv, &r->mu);
    } else {
        struct timespec ts = {.tv_sec = until_ms / 1000, .tv_nsec = (until_ms % 1000) * 1000000};
        pthread_cond_timedwait(&r->cv, &r->mu, &ts);
    }
    return r->stop;
}

/* ---- watchers ---- */

static int watcher_stopped(watcher *w)
{
    pthread_mutex_lock(&w->mu);
    int s = w->stop;
    pthread_mutex_unlock(&w->mu);
    return s;
}

/* Sleeps ms unless the watcher is stopped first (a retry backoff). */
static void watcher_pause(watcher *w, int ms)
{
    int64_t until = rdzv_now_ms() + ms;
    while (!watcher_stopped(w) && rdzv_now_ms() < until) {
        struct timespec ts = {0, 20 * 1000000};
        nanosleep(&ts, NULL);
    }
}

/* Keeps the round record from a watch event, so that the driver's next
 * step need not fetch it again (saves one request per agent when a round
 * of hundreds freezes). Safe even if stale: every step's snapshot is
 * guarded by the record's mod_revision, and a stale one just reads again. */
static void cache_round(rdzv *r, const etcd_event *ev)
{
    char *copy = NULL;
    if (ev->type == ETCD_EVENT_PUT && (copy = malloc(ev->kv.value_len + 1)) != NULL) {
        memcpy(copy, ev->kv.value, ev->kv.value_len);
        copy[ev->kv.value_len] = '\0';
    }
    pthread_mutex_lock(&r->mu);
    free(r->round_cache);
    r->round_cache = copy;
    r->round_cache_len = copy ? ev->kv.value_len : 0;
    r->round_cache_mod = ev->kv.mod_revision;
    pthread_mutex_unlock(&r->mu);
}

/* Takes the cached round record if there is one; 1 when *rec is filled. */
static int take_cached_round(rdzv *r, rdzv_record *rec, int64_t *mod)
{
    pthread_mutex_lock(&r->mu);
    char *json = r->round_cache;
    size_t len = r->round_cache_len;
    *mod = r->round_cache_mod;
    r->round_cache = NULL;
    pthread_mutex_unlock(&r->mu);
    if (!json) return 0;
    int ok = rdzv_record_parse(json, len, rec) == RDZV_OK;
    free(json);
    return ok;
}

static void *watcher_main(void *arg)
{
    watcher *w = arg;
    rdzv *r = w->r;
    etcd_client *c = NULL;
    int64_t next_rev = w->start_rev;
    int backoff = 50;
    while (!watcher_stopped(w)) {
        if (!c && rdzv_etcd_connect(&r->etcd, &c, NULL) != RDZV_OK) {
            watcher_pause(w, 1000);
            continue;
        }
        etcd_client_set_name(c, "watch");
        if (!w->w) {
            etcd_watch *ew = NULL;
            etcd_err e = etcd_watch_open(c, w->key, w->prefix, next_rev, &ew);
            if (e == ETCD_ERR_COMPACTED) {
                next_rev = 0;
                continue;
            }
            if (e != ETCD_OK) {
                dlog(r, "watch %s: %s", w->key, etcd_strerror(e));
                watcher_pause(w, backoff);
                backoff = backoff < 1000 ? backoff * 2 : 1000;
                continue;
            }
            pthread_mutex_lock(&w->mu);
            w->w = ew;
            int stop = w->stop;
            pthread_mutex_unlock(&w->mu);
            if (stop) break;
            if (next_rev != w->start_rev) post(r, (unsigned)w->tag | TAG_RESYNC);
        }
        etcd_event *evs = NULL;
        size_t n = 0;
        /* A stop request cuts this short (etcd_watch_wakeup is never lost:
         * it sets a flag the next wait sees); the timeout is only a bound. */
        etcd_err e = etcd_watch_next(w->w, 30000, &evs, &n);
        if (e == ETCD_OK) {
            if (n > 0) {
                if (w->tag == TAG_ROUND) cache_round(r, &evs[n - 1]);
                post(r, (unsigned)w->tag);
                next_rev = evs[n - 1].kv.mod_revision + 1;
            }
            etcd_events_free(evs, n);
            backoff = 50;
            continue;
        }
        if (watcher_stopped(w)) break;
        dlog(r, "watch %s broke: %s", w->key, etcd_strerror(e));
        /* Resume after the last event seen; after compaction start from now
         * and have the driver re-read everything (it may have missed some). */
        if (e == ETCD_ERR_COMPACTED) next_rev = 0;
        pthread_mutex_lock(&w->mu);
        etcd_watch_close(w->w);
        w->w = NULL;
        pthread_mutex_unlock(&w->mu);
        post(r, (unsigned)w->tag | TAG_RESYNC);
        watcher_pause(w, backoff);
        backoff = backoff < 1000 ? backoff * 2 : 1000;
    }
    pthread_mutex_lock(&w->mu);
    if (w->w) etcd_watch_close(w->w);
    w->w = NULL;
    pthread_mutex_unlock(&w->mu);
    etcd_client_free(c);
    return NULL;
}

static watcher *watcher_start(rdzv *r, const char *key, int prefix, int64_t start_rev, int tag)
{
    watcher *w = calloc(1, sizeof(*w));
    if (!w) return NULL;
    w->r = r;
    snprintf(w->key, sizeof(w->key), "%s", key);
    w->prefix = prefix;
    w->start_rev = start_rev;
    w->tag = tag;
    pthread_mutex_init(&w->mu, NULL);
    if (pthread_create(&w->th, NULL, watcher_main, w) != 0) {
        pthread_mutex_destroy(&w->mu);
        free(w);
        return NULL;
    }
    return w;
}

/* Asks a watcher to stop without waiting for it: it goes on the retired
 * list and is joined when the handle closes. */
static void watcher_retire(rdzv *r, watcher *w)
{
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    w->stop = 1;
    if (w->w) etcd_watch_wakeup(w->w);
    pthread_mutex_unlock(&w->mu);
    pthread_mutex_lock(&r->mu);
    w->next = r->retired;
    r->retired = w;
    pthread_mutex_unlock(&r->mu);
}

static void watchers_join(rdzv *r)
{
    watcher_retire(r, r->w_round);
    watcher_retire(r, r->w_nodes);
    watcher_retire(r, r->w_waiting);
    watcher_retire(r, r->w_join);
    r->w_round = r->w_nodes = r->w_waiting = r->w_join = NULL;
    pthread_mutex_lock(&r->mu);
    watcher *w = r->retired;
    r->retired = NULL;
    pthread_mutex_unlock(&r->mu);
    while (w) {
        watcher *next = w->next;
        pthread_join(w->th, NULL);
        pthread_mutex_destroy(&w->mu);
        free(w);
        w = next;
    }
}

/* The driver's join watch: the whole joined/ prefix for the freezer, the
 * predecessor's key for the others, none outside an open round. */
static void set_join_watch(rdzv *r, const char *key, int prefix, int64_t start_rev)
{
    char target[RDZV_KEY_MAX + 2];
    snprintf(target, sizeof(target), "%c%s", prefix ? 'P' : 'K', key ? key : "");
    if (key && r->w_join && strcmp(target, r->join_target) == 0) return;
    watcher_retire(r, r->w_join);
    r->w_join = NULL;
    r->join_target[0] = '\0';
    if (!key) return;
    r->w_join = watcher_start(r, key, prefix, start_rev, TAG_JOIN);
    if (r->w_join) snprintf(r->join_target, sizeof(r->join_target), "%s", target);
}

/* ---- keep-alive ---- */

static void *keepalive_main(void *arg)
{
    rdzv *r = arg;
    int64_t period = (int64_t)r->cfg.lease_ttl_s * 1000 / 3;
    int64_t next = rdzv_now_ms() + period;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!r->stop && rdzv_now_ms() < next)
            wait_until(r, next);
        if (r->stop) break;
        pthread_mutex_unlock(&r->mu);
        int64_t ttl = 0;
        etcd_err e = etcd_lease_keepalive(r->kac, r->lease, &ttl);
        pthread_mutex_lock(&r->mu);
        if (e == ETCD_ERR_NOT_FOUND) {
            r->lease_lost = 1;
            pthread_cond_broadcast(&r->cv);
            break;
        }
        /* Transient: try again soon; the lease may well outlive an etcd
         * restart (etcd renews leases when it starts). */
        next = rdzv_now_ms() + (e == ETCD_OK ? period : 300);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

/* ---- reading a snapshot ---- */

typedef struct snapshot {
    etcd_txn_result txn;
    etcd_range_result *nodes, *waiting, *joined, *left;
    int64_t revision;
} snapshot;

static const etcd_kv *find_kv(const etcd_range_result *rr, const char *key)
{
    size_t lo = 0, hi = rr->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        int c = strcmp(rr->kvs[mid].key, key);
        if (c == 0) return &rr->kvs[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

static const char *key_suffix(const char *key)
{
    const char *s = strrchr(key, '/');
    return s ? s + 1 : key;
}

static rdzv_err read_round(rdzv *r, etcd_client *c, rdzv_record *rec, int64_t *mod, int *have)
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

/* The snapshot a step needs, read in one txn guarded by the round record's
 * mod_revision: for a frozen round the node keys, waiting keys and leave
 * markers; for an open round its joins and this node's own key. Reading
 * only what the state needs keeps a round of N agents at O(N) keys each. */
static rdzv_err read_snapshot(rdzv *r, const rdzv_record *rec, int64_t mod, snapshot *s, int *moved)
{
    char round[RDZV_KEY_MAX], nodes[RDZV_KEY_MAX], waiting[RDZV_KEY_MAX], joined[RDZV_KEY_MAX],
        left[RDZV_KEY_MAX];
    long long number = (long long)rec->number;
    rdzv_key(round, sizeof(round), r->cfg.job, "round");
    if (rec->frozen)
        rdzv_key(nodes, sizeof(nodes), r->cfg.job, "nodes/");
    else
        rdzv_key(nodes, sizeof(nodes), r->cfg.job, "nodes/%s", r->node);
    rdzv_key(waiting, sizeof(waiting), r->cfg.job, "waiting/");
    rdzv_key(joined, sizeof(joined), r->cfg.job, "rounds/%lld/joined/", number);
    rdzv_key(left, sizeof(left), r->cfg.job, "rounds/%lld/left/", number);
    etcd_cmp cmp = {.key = round, .target = ETCD_CMP_MOD, .op = ETCD_CMP_EQUAL, .number = mod};
    etcd_op ops[3];
    ops[0] = (etcd_op){.type = ETCD_OP_RANGE, .key = nodes, .prefix = rec->frozen};
    if (rec->frozen) {
        ops[1] = (etcd_op){.type = ETCD_OP_RANGE, .key = waiting, .prefix = 1};
        ops[2] = (etcd_op){.type = ETCD_OP_RANGE, .key = left, .prefix = 1};
    } else {
        ops[1] = (etcd_op){.type = ETCD_OP_RANGE, .key = joined, .prefix = 1};
    }
    size_t nops = rec->frozen ? 3 : 2;
    memset(s, 0, sizeof(*s));
    etcd_err e = etcd_txn(r->dc, &cmp, 1, ops, nops, NULL, 0, &s->txn);
    if (e != ETCD_OK) return RDZV_ERR_ETCD;
    *moved = !s->txn.succeeded;
    if (*moved) return RDZV_OK;
    if (s->txn.n != nops) return RDZV_ERR_PROTOCOL;
    s->nodes = &s->txn.ranges[0];
    if (rec->frozen) {
        s->waiting = &s->txn.ranges[1];
        s->left = &s->txn.ranges[2];
    } else {
        s->joined = &s->txn.ranges[1];
    }
    s->revision = s->txn.revision;
    return RDZV_OK;
}

/* ---- writes (each a txn guarded by the record's mod_revision) ---- */

static rdzv_err put_record(rdzv *r, etcd_client *c, const rdzv_record *next, int64_t mod,
                           int bump_epoch, const char *state_json, int *won)
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
    etcd_txn_result res;
    etcd_err e = etcd_txn(c, &cmp, 1, ops, n, NULL, 0, &res);
    free(json);
    if (e != ETCD_OK) return RDZV_ERR_ETCD;
    *won = res.succeeded;
    etcd_txn_result_free(&res);
    return RDZV_OK;
}

static char *state_json(const char *state, const char *reason)
{
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    cJSON_AddStringToObject(o, "state", state);
    cJSON_AddStringToObject(o, "reason", reason ? reason : "");
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

static rdzv_err create_first_round(rdzv *r)
{
    rdzv_record rec;
    memset(&rec, 0, sizeof(rec));
    rec.number = 1;
    rec.max_restarts = r->cfg.max_restarts;
    rec.min_nodes = r->cfg.min_nodes;
    rec.max_nodes = r->cfg.max_nodes;
    snprintf(rec.job, sizeof(rec.job), "running");
    char *st = state_json("running", "");
    if (!st) return RDZV_ERR_NOMEM;
    int won = 0;
    rdzv_err err = put_record(r, r->dc, &rec, 0, 1, st, &won);
    free(st);
    if (err == RDZV_OK && won) dlog(r, "created round 1");
    return err;
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
    if (err == RDZV_OK) err = put_record(r, r->dc, &next, mod, 1, NULL, &won);
    if (err == RDZV_OK && won)
        dlog(r, "opened round %lld: %s", (long long)next.number, next.reason);
    rdzv_record_free(&next);
    return err == RDZV_OK ? STEP_AGAIN : (int)err;
}

/* ---- one step ---- */

static void begin_seek(rdzv *r)
{
    int64_t now = rdzv_now_ms();
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
    if (r->seek_start_ms) r->seconds_in_rdzv += (rdzv_now_ms() - r->seek_start_ms) / 1000.0;
    r->seek_start_ms = 0;
    pthread_mutex_unlock(&r->mu);
    dlog(r, "round %lld frozen, rank %d of %d", (long long)rec->number, ev.round.my_rank,
         ev.round.nmembers);
    emit(r, &ev);
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
    emit(r, &ev);
    begin_seek(r);
}

/* Node and waiting keys matter only once a round is frozen (to a member,
 * or to a spare): the watches start then, from the snapshot that was just
 * read, so a round of N joiners does not fan N registrations out to N
 * agents. Once started they stay. */
static void start_member_watches(rdzv *r, int64_t from)
{
    char key[RDZV_KEY_MAX];
    if (!r->w_nodes) {
        rdzv_key(key, sizeof(key), r->cfg.job, "nodes/");
        r->w_nodes = watcher_start(r, key, 1, from, TAG_NODES);
    }
    if (!r->w_waiting) {
        rdzv_key(key, sizeof(key), r->cfg.job, "waiting/");
        r->w_waiting = watcher_start(r, key, 1, from, TAG_WAITING);
    }
}

static int frozen_step(rdzv *r, const rdzv_record *rec, int64_t mod, const snapshot *s)
{
    char key[RDZV_KEY_MAX];
    set_join_watch(r, NULL, 0, 0);
    start_member_watches(r, s->revision + 1);
    int me = rdzv_record_member_index(rec, r->node);
    /* Listed under an older lease: that was this node before it lost its
     * lease, and is a lost member like any other. */
    if (me >= 0 && rec->members[me].lease != r->lease) me = -1;
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
    /* Does the round end? A member gone or left, or a waiting node and
     * room. Spares check too: if every member died, only they can tell. */
    for (int i = 0; i < rec->nmembers; i++) {
        const rdzv_rec_member *m = &rec->members[i];
        if (i == me) continue;
        rdzv_key(key, sizeof(key), r->cfg.job, "rounds/%lld/left/%s", (long long)rec->number,
                 m->node);
        if (find_kv(s->left, key))
            return open_next(r, rec, mod, RDZV_CAUSE_MEMBER_LEFT, m->node, "node %s left", m->node);
        rdzv_key(key, sizeof(key), r->cfg.job, "nodes/%s", m->node);
        const etcd_kv *kv = find_kv(s->nodes, key);
        if (!kv || kv->lease != m->lease)
            return open_next(r, rec, mod, RDZV_CAUSE_MEMBER_LOST, m->node,
                             "node %s lost (its lease ended)", m->node);
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
        emit_simple(r, RDZV_EV_SPARE, RDZV_OK, "round %lld is full (%d nodes)",
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
            dlog(r, "skipping malformed join %s", order[i]->key);
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
    err = put_record(r, r->dc, &fz, mod, 0, NULL, &won);
    if (err == RDZV_OK && won)
        dlog(r, "froze round %lld with %d nodes", (long long)fz.number, fz.nmembers);
out:
    free(order);
    free(used);
    rdzv_record_free(&fz);
    return err == RDZV_OK ? STEP_AGAIN : (int)err;
}

static int open_step(rdzv *r, const rdzv_record *rec, int64_t mod, const snapshot *s)
{
    char key[RDZV_KEY_MAX], epoch[RDZV_KEY_MAX], waiting[RDZV_KEY_MAX];
    begin_seek(r);
    rdzv_key(key, sizeof(key), r->cfg.job, "rounds/%lld/joined/%s", (long long)rec->number,
             r->node);
    if (!find_kv(s->joined, key)) {
        /* Join: create-only, and only while the round is still current. */
        rdzv_key(epoch, sizeof(epoch), r->cfg.job, "epoch");
        rdzv_key(waiting, sizeof(waiting), r->cfg.job, "waiting/%s", r->node);
        char num[32];
        snprintf(num, sizeof(num), "%lld", (long long)rec->number);
        char *val = NULL;
        cJSON *o = cJSON_CreateObject();
        if (o) {
            cJSON_AddStringToObject(o, "addr", r->cfg.addr);
            cJSON_AddNumberToObject(o, "lws", r->cfg.local_world_size);
            val = cJSON_PrintUnformatted(o);
            cJSON_Delete(o);
        }
        if (!val) return RDZV_ERR_NOMEM;
        etcd_cmp cmps[2] = {
            {.key = epoch,
             .target = ETCD_CMP_VALUE,
             .op = ETCD_CMP_EQUAL,
             .value = num,
             .value_len = strlen(num)},
            {.key = key, .target = ETCD_CMP_VERSION, .op = ETCD_CMP_EQUAL, .number = 0},
        };
        etcd_op ops[2] = {
            {.type = ETCD_OP_PUT,
             .key = key,
             .value = val,
             .value_len = strlen(val),
             .lease = r->lease},
            {.type = ETCD_OP_DELETE, .key = waiting},
        };
        etcd_err e = etcd_txn(r->dc, cmps, 2, ops, 2, NULL, 0, NULL);
        free(val);
        if (e != ETCD_OK) return RDZV_ERR_ETCD;
        r->waiting_written = 0;
        r->spare_round = 0;
        dlog(r, "joined round %lld", (long long)rec->number);
        return STEP_AGAIN;
    }
    size_t n = s->joined->n;
    etcd_kv **joined = calloc(n, sizeof(*joined));
    if (!joined) return RDZV_ERR_NOMEM;
    int64_t maxrev = 0;
    for (size_t i = 0; i < n; i++) {
        joined[i] = &s->joined->kvs[i];
        if (joined[i]->create_revision > maxrev) maxrev = joined[i]->create_revision;
    }
    qsort(joined, n, sizeof(*joined), by_create_revision);
    size_t pos = 0;
    while (pos < n && strcmp(joined[pos]->key, key) != 0)
        pos++;
    int rc = RDZV_OK;
    if (pos > 0) {
        /* Not the freezer: watch the joiner just before this one. */
        set_join_watch(r, joined[pos - 1]->key, 0, s->revision + 1);
        r->fz_round = 0;
    } else {
        char prefix[RDZV_KEY_MAX];
        rdzv_key(prefix, sizeof(prefix), r->cfg.job, "rounds/%lld/joined/", (long long)rec->number);
        set_join_watch(r, prefix, 1, s->revision + 1);
        int64_t now = rdzv_now_ms();
        if (r->fz_round != rec->number || r->fz_count != (int64_t)n || r->fz_maxrev != maxrev) {
            r->fz_round = rec->number;
            r->fz_count = (int64_t)n;
            r->fz_maxrev = maxrev;
            r->fz_last_join = now;
        }
        if ((int64_t)n >= r->cfg.max_nodes ||
            ((int64_t)n >= r->cfg.min_nodes && now >= r->fz_last_join + r->cfg.last_call_ms))
            rc = freeze(r, rec, mod, joined, n);
        else if ((int64_t)n >= r->cfg.min_nodes)
            r->last_call_at = r->fz_last_join + r->cfg.last_call_ms;
    }
    free(joined);
    return rc;
}

/* Returns RDZV_OK, an error, or STEP_AGAIN. */
static int step(rdzv *r, const rdzv_record *rec, int64_t mod)
{
    if (strcmp(rec->job, "done") == 0) {
        emit_simple(r, RDZV_EV_JOB_DONE, RDZV_OK, "job done");
        r->terminal = 1;
        return RDZV_OK;
    }
    if (strcmp(rec->job, "failed") == 0) {
        emit_simple(r, RDZV_EV_JOB_FAILED, RDZV_ERR_JOB_FAILED, "%s", rec->reason);
        r->terminal = 1;
        return RDZV_OK;
    }
    if (r->in_round && rec->number > r->in_round) report_ended(r, rec);
    /* A frozen record never changes its members: report at once, then
     * check whether the round already has to end. */
    int me = rdzv_record_member_index(rec, r->node);
    if (rec->frozen && rec->number > r->reported && me >= 0 && rec->members[me].lease == r->lease)
        report_frozen(r, rec);

    snapshot s;
    int moved = 0;
    rdzv_err err = read_snapshot(r, rec, mod, &s, &moved);
    if (err != RDZV_OK || moved) {
        etcd_txn_result_free(&s.txn);
        return err != RDZV_OK ? (int)err : STEP_AGAIN;
    }
    char key[RDZV_KEY_MAX];
    rdzv_key(key, sizeof(key), r->cfg.job, "nodes/%s", r->node);
    const etcd_kv *mine = find_kv(s.nodes, key);
    int rc;
    if (!mine || mine->lease != r->lease) {
        emit_simple(r, RDZV_EV_ERROR, RDZV_ERR_LEASE_LOST,
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

static rdzv_err reconcile(rdzv *r)
{
    for (int attempt = 0; attempt < 100 && !r->terminal; attempt++) {
        rdzv_record rec;
        int64_t mod = 0;
        int have = 0;
        rdzv_err err = RDZV_OK;
        if (attempt == 0 && take_cached_round(r, &rec, &mod))
            have = 1;
        else
            err = read_round(r, r->dc, &rec, &mod, &have);
        if (err == RDZV_ERR_PROTOCOL) {
            emit_simple(r, RDZV_EV_ERROR, RDZV_ERR_PROTOCOL,
                        "malformed round record under /ductile/%s/round", r->cfg.job);
            r->terminal = 1;
            return err;
        }
        if (err != RDZV_OK) return err;
        if (!have) {
            err = create_first_round(r);
            if (err != RDZV_OK) return err;
            continue;
        }
        int rc = step(r, &rec, mod);
        rdzv_record_free(&rec);
        if (rc != STEP_AGAIN) return (rdzv_err)rc;
    }
    return RDZV_OK;
}

static void *driver_main(void *arg)
{
    rdzv *r = arg;
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
            if (wake && rdzv_now_ms() >= wake) break;
            wait_until(r, wake);
        }
        int stop = r->stop, lost = r->lease_lost;
        unsigned dirty = r->dirty;
        r->dirty = 0;
        pthread_mutex_unlock(&r->mu);
        if (stop) break;
        if (lost) {
            emit_simple(r, RDZV_EV_ERROR, RDZV_ERR_LEASE_LOST,
                        "node %s: lease %lld expired; this node is out of the job", r->node,
                        (long long)r->lease);
            break;
        }
        int64_t now = rdzv_now_ms();
        if (r->deadline_ms && now >= r->deadline_ms) {
            emit_simple(r, RDZV_EV_ERROR, RDZV_ERR_TIMEOUT,
                        "no round froze within the join timeout (%d ms)", r->cfg.join_timeout_ms);
            break;
        }
        int timer =
            (r->last_call_at && now >= r->last_call_at) || (r->retry_at && now >= r->retry_at);
        int relevant = need || timer || (dirty & (TAG_ROUND | TAG_JOIN | TAG_RESYNC)) ||
                       ((dirty & (TAG_NODES | TAG_WAITING)) && (r->in_round || r->spare_round));
        if (!relevant) continue;
        need = 0;
        r->last_call_at = 0;
        r->retry_at = 0;
        rdzv_err err = reconcile(r);
        if (r->terminal) break;
        if (err != RDZV_OK) {
            dlog(r, "step failed: %s (%s); retrying in %lld ms", rdzv_strerror(err),
                 etcd_last_error(r->dc), (long long)r->backoff_ms);
            r->retry_at = rdzv_now_ms() + r->backoff_ms;
            r->backoff_ms = r->backoff_ms < 2000 ? r->backoff_ms * 2 : 2000;
        } else {
            r->backoff_ms = 100;
        }
    }
    r->terminal = 1;
    return NULL;
}

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
    etcd_client_free(r->dc);
    etcd_client_free(r->kac);
    while (r->ev_head) {
        ev_node *n = r->ev_head;
        r->ev_head = n->next;
        rdzv_event_free(&n->ev);
        free(n);
    }
    if (r->efd >= 0) close(r->efd);
    free(r->round_cache);
    for (size_t i = 0; i < sizeof(r->strs) / sizeof(r->strs[0]); i++)
        free(r->strs[i]);
    pthread_mutex_destroy(&r->api_mu);
    pthread_mutex_destroy(&r->ev_mu);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r);
}

/* Reads the job state; RDZV_ERR_JOB_DONE / _FAILED when the job has ended. */
static rdzv_err check_job_state(rdzv *r, char *msg)
{
    char key[RDZV_KEY_MAX];
    rdzv_key(key, sizeof(key), r->cfg.job, "state");
    etcd_kv kv;
    etcd_err e = etcd_get(r->api, key, &kv);
    if (e == ETCD_ERR_NOT_FOUND) return RDZV_OK;
    if (e != ETCD_OK) {
        if (msg)
            snprintf(msg, RDZV_MSG_MAX, "cannot reach etcd at %s: %s", r->etcd.endpoints,
                     etcd_last_error(r->api)[0] ? etcd_last_error(r->api) : etcd_strerror(e));
        return RDZV_ERR_ETCD;
    }
    rdzv_err err = RDZV_OK;
    cJSON *o = cJSON_ParseWithLength(kv.value, kv.value_len);
    const cJSON *st = cJSON_GetObjectItemCaseSensitive(o, "state");
    const cJSON *why = cJSON_GetObjectItemCaseSensitive(o, "reason");
    if (!cJSON_IsString(st)) {
        err = RDZV_ERR_PROTOCOL;
        if (msg) snprintf(msg, RDZV_MSG_MAX, "malformed job state under %.200s", key);
    } else if (strcmp(st->valuestring, "done") == 0) {
        err = RDZV_ERR_JOB_DONE;
        if (msg) snprintf(msg, RDZV_MSG_MAX, "job %s has already completed", r->cfg.job);
    } else if (strcmp(st->valuestring, "failed") == 0) {
        err = RDZV_ERR_JOB_FAILED;
        if (msg)
            snprintf(msg, RDZV_MSG_MAX, "job %s has failed: %s", r->cfg.job,
                     cJSON_IsString(why) ? why->valuestring : "");
    }
    cJSON_Delete(o);
    etcd_kv_free(&kv);
    return err;
}

/* --nnodes is job-wide: the first agent's limits are in the round record,
 * and an agent given others is refused (it would keep opening rounds that
 * the others freeze by other rules). */
static rdzv_err check_job_limits(rdzv *r, char *msg)
{
    rdzv_record rec;
    int64_t mod = 0;
    int have = 0;
    rdzv_err err = read_round(r, r->api, &rec, &mod, &have);
    if (err == RDZV_ERR_PROTOCOL) {
        snprintf(msg, RDZV_MSG_MAX, "malformed round record under /ductile/%s/round", r->cfg.job);
        return err;
    }
    if (err != RDZV_OK) {
        snprintf(msg, RDZV_MSG_MAX, "cannot reach etcd at %s: %s", r->etcd.endpoints,
                 etcd_last_error(r->api));
        return err;
    }
    if (!have) return RDZV_OK;
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
    pthread_mutex_init(&r->api_mu, NULL);
    pthread_mutex_init(&r->ev_mu, NULL);
    pthread_mutex_init(&r->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&r->cv, &ca);
    pthread_condattr_destroy(&ca);

    r->cfg = *cfg;
    const char *src[9] = {cfg->etcd.endpoints,
                          cfg->etcd.cacert,
                          cfg->etcd.cert,
                          cfg->etcd.key,
                          cfg->etcd.user,
                          cfg->etcd.password,
                          cfg->job,
                          cfg->node_id,
                          cfg->addr ? cfg->addr : ""};
    for (int i = 0; i < 9; i++) {
        r->strs[i] = dup_or_null(src[i]);
        if (src[i] && !r->strs[i]) {
            err = RDZV_ERR_NOMEM;
            goto err;
        }
    }
    r->cfg.etcd = (rdzv_etcd){r->strs[0], r->strs[1], r->strs[2],          r->strs[3],
                              r->strs[4], r->strs[5], cfg->etcd.timeout_ms};
    r->cfg.job = r->strs[6];
    r->cfg.node_id = r->strs[7];
    r->cfg.addr = r->strs[8];
    if (r->cfg.join_timeout_ms == 0) r->cfg.join_timeout_ms = 600000;
    r->etcd = r->cfg.etcd;
    snprintf(r->node, sizeof(r->node), "%s", r->cfg.node_id);
    const char *dbg = getenv("DUCTILE_RDZV_DEBUG");
    r->debug = dbg && *dbg && strcmp(dbg, "0") != 0;

    r->efd = eventfd(0, EFD_SEMAPHORE | EFD_NONBLOCK | EFD_CLOEXEC);
    if (r->efd < 0) {
        snprintf(msg, RDZV_MSG_MAX, "eventfd: %s", strerror(errno));
        err = RDZV_ERR_NOMEM;
        goto err;
    }
    if ((err = rdzv_etcd_connect(&r->etcd, &r->api, msg)) != RDZV_OK) goto err;
    if ((err = rdzv_etcd_connect(&r->etcd, &r->dc, msg)) != RDZV_OK) goto err;
    if ((err = rdzv_etcd_connect(&r->etcd, &r->kac, msg)) != RDZV_OK) goto err;
    /* Failpoints name the client: etcd.api.txn is a call of the caller's
     * thread (register, report, finish, leave), never the driver's. */
    etcd_client_set_name(r->api, "api");
    etcd_client_set_name(r->dc, "driver");
    etcd_client_set_name(r->kac, "keepalive");
    if ((err = check_job_state(r, msg)) != RDZV_OK) goto err;
    if ((err = check_job_limits(r, msg)) != RDZV_OK) goto err;

    etcd_err e = etcd_lease_grant(r->api, r->cfg.lease_ttl_s, &r->lease);
    if (e != ETCD_OK) {
        snprintf(msg, RDZV_MSG_MAX, "etcd at %s: lease grant: %s", r->etcd.endpoints,
                 etcd_last_error(r->api)[0] ? etcd_last_error(r->api) : etcd_strerror(e));
        err = RDZV_ERR_ETCD;
        goto err;
    }

    /* Register: create-only, so a second live node with this id is refused. */
    char key[RDZV_KEY_MAX];
    rdzv_key(key, sizeof(key), r->cfg.job, "nodes/%s", r->node);
    char *val = NULL;
    cJSON *o = cJSON_CreateObject();
    if (o) {
        cJSON_AddStringToObject(o, "addr", r->cfg.addr);
        cJSON_AddNumberToObject(o, "lws", r->cfg.local_world_size);
        val = cJSON_PrintUnformatted(o);
        cJSON_Delete(o);
    }
    if (!val) {
        err = RDZV_ERR_NOMEM;
        goto err_lease;
    }
    etcd_cmp cmp = {.key = key, .target = ETCD_CMP_VERSION, .op = ETCD_CMP_EQUAL, .number = 0};
    etcd_op put = {
        .type = ETCD_OP_PUT, .key = key, .value = val, .value_len = strlen(val), .lease = r->lease};
    etcd_txn_result res;
    e = etcd_txn(r->api, &cmp, 1, &put, 1, NULL, 0, &res);
    free(val);
    if (e != ETCD_OK) {
        snprintf(msg, RDZV_MSG_MAX, "etcd at %s: register %s: %s", r->etcd.endpoints, r->node,
                 etcd_last_error(r->api));
        err = RDZV_ERR_ETCD;
        goto err_lease;
    }
    int won = res.succeeded;
    int64_t reg_rev = res.revision;
    etcd_txn_result_free(&res);
    if (!won) {
        snprintf(msg, RDZV_MSG_MAX, "node id %s is already registered by a live node in job %s",
                 r->node, r->cfg.job);
        err = RDZV_ERR_DUPLICATE;
        goto err_lease;
    }

    char wkey[RDZV_KEY_MAX];
    rdzv_key(wkey, sizeof(wkey), r->cfg.job, "round");
    r->w_round = watcher_start(r, wkey, 0, reg_rev + 1, TAG_ROUND);
    if (!r->w_round) {
        snprintf(msg, RDZV_MSG_MAX, "cannot start watch threads");
        err = RDZV_ERR_NOMEM;
        goto err_threads;
    }
    r->seek_start_ms = rdzv_now_ms();
    r->deadline_ms = r->seek_start_ms + r->cfg.join_timeout_ms;
    if (pthread_create(&r->keepalive, NULL, keepalive_main, r) != 0) {
        err = RDZV_ERR_NOMEM;
        goto err_threads;
    }
    r->keepalive_started = 1;
    if (pthread_create(&r->driver, NULL, driver_main, r) != 0) {
        err = RDZV_ERR_NOMEM;
        goto err_threads;
    }
    r->driver_started = 1;
    *out = r;
    return RDZV_OK;

err_threads:
    pthread_mutex_lock(&r->mu);
    r->stop = 1;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    if (r->keepalive_started) pthread_join(r->keepalive, NULL);
    watchers_join(r);
err_lease:
    etcd_lease_revoke(r->api, r->lease);
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
    watchers_join(r);
}

rdzv_err rdzv_leave(rdzv *r)
{
    if (!r) return RDZV_ERR_ARG;
    pthread_mutex_lock(&r->api_mu);
    if (r->closed) {
        pthread_mutex_unlock(&r->api_mu);
        return RDZV_ERR_CLOSED;
    }
    r->closed = 1;
    /* Stop acting first, so this node does not react to its own leave. */
    pthread_mutex_lock(&r->mu);
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
    rdzv_free(r);
}

double rdzv_seconds_in_rendezvous(const rdzv *r)
{
    rdzv *m = (rdzv *)r; /* the lock is not part of the logical state */
    pthread_mutex_lock(&m->mu);
    double s = r->seconds_in_rdzv;
    if (r->seek_start_ms) s += (rdzv_now_ms() - r->seek_start_ms) / 1000.0;
    pthread_mutex_unlock(&m->mu);
    return s;
}

/* ---- failures and the end of the job (caller's thread) ---- */

/* How long a report or finish keeps trying: past the lease TTL this node
 * is out of the job anyway, and the rejoin path takes over. */
static int64_t report_deadline(const rdzv *r)
{
    int64_t t = r->etcd.timeout_ms ? r->etcd.timeout_ms : 5000;
    int64_t ttl = (int64_t)r->cfg.lease_ttl_s * 1000;
    return rdzv_now_ms() + (ttl > t ? ttl : t);
}

/* After an etcd error: 1 to try again (after a pause), 0 when the deadline
 * has passed. */
static int retry_pause(int64_t deadline, int *backoff_ms)
{
    if (rdzv_now_ms() + *backoff_ms > deadline) return 0;
    struct timespec ts = {.tv_sec = *backoff_ms / 1000, .tv_nsec = (*backoff_ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    *backoff_ms = *backoff_ms < 400 ? *backoff_ms * 2 : 500;
    return 1;
}

typedef enum { WRITE_NONE, WRITE_NEXT_ROUND, WRITE_SAME_ROUND } report_write;

/* Decides what one report does (see rdzv.h, the failure-counting rule).
 * WRITE_NONE: nothing to write (the round already ended, or was counted).
 * WRITE_SAME_ROUND: *rec itself was updated (a count added to the current
 * round, or the job failed). WRITE_NEXT_ROUND: *next is the next round.
 * *count is 1 when the report uses a restart. */
static report_write plan_report(const rdzv *r, int64_t mine, int first_hand, const char *reason,
                                rdzv_record *rec, rdzv_record *next, int *count)
{
    *count = 0;
    memset(next, 0, sizeof(*next));
    if (mine == 0 || rec->counted >= mine) return WRITE_NONE;
    int same = rec->number == mine;
    if (!first_hand && !same) return WRITE_NONE; /* whoever ended it decided */
    uint64_t members = rdzv_record_members_hash(rec);
    int again = !first_hand && strcmp(rec->cause, rdzv_cause_name(RDZV_CAUSE_PEER_LOST)) == 0 &&
                rec->peer_lost_of == members;
    *count = first_hand || again;
    if (*count && rec->restarts + 1 > rec->max_restarts) {
        /* Same round, job failed: every driver reports JOB_FAILED. */
        rec->restarts++;
        rec->counted = mine;
        snprintf(rec->job, sizeof(rec->job), "failed");
        snprintf(rec->reason, sizeof(rec->reason),
                 "restart limit reached (%lld > max_restarts %d); last failure on %s: %s",
                 (long long)rec->restarts, rec->max_restarts, r->node, reason);
        return WRITE_SAME_ROUND;
    }
    if (!same) {
        /* The round ended uncounted (a peer saw this crash first) before
         * this first-hand report came: the count goes on the current round. */
        rec->restarts++;
        rec->counted = mine;
        /* The lost peer that ended it was this crash, now counted: it is
         * no grounds to count the next lost peer of these members too. */
        rec->peer_lost_of = 0;
        return WRITE_SAME_ROUND;
    }
    next->number = rec->number + 1;
    rdzv_record_carry(rec, next);
    next->peer_lost_of = 0;
    if (*count) {
        next->restarts = rec->restarts + 1;
        next->counted = mine;
    } else {
        next->peer_lost_of = members;
    }
    rdzv_cause cause = *count ? RDZV_CAUSE_FAILURE : RDZV_CAUSE_PEER_LOST;
    snprintf(next->job, sizeof(next->job), "running");
    snprintf(next->cause, sizeof(next->cause), "%s", rdzv_cause_name(cause));
    snprintf(next->cause_node, sizeof(next->cause_node), "%s", r->node);
    if (again)
        snprintf(next->reason, sizeof(next->reason),
                 "peer lost again on %s with the same members (counted): %s", r->node, reason);
    else
        snprintf(next->reason, sizeof(next->reason), "%s on %s: %s",
                 first_hand ? "failure" : "peer lost", r->node, reason);
    return WRITE_NEXT_ROUND;
}

static rdzv_err report(rdzv *r, int first_hand, const char *reason, int64_t *restarts, int *counted)
{
    if (!r) return RDZV_ERR_ARG;
    if (!reason) reason = "";
    if (counted) *counted = 0;
    pthread_mutex_lock(&r->api_mu);
    rdzv_err err = RDZV_ERR_CLOSED;
    if (r->closed) goto out;
    pthread_mutex_lock(&r->mu);
    int64_t mine = r->member_round;
    pthread_mutex_unlock(&r->mu);
    int64_t deadline = report_deadline(r);
    int backoff = 50;
    for (;;) {
        rdzv_record rec, next;
        int64_t mod = 0;
        int have = 0, count = 0, won = 0;
        err = read_round(r, r->api, &rec, &mod, &have);
        if (err == RDZV_OK && !have) err = RDZV_ERR_PROTOCOL;
        if (err == RDZV_ERR_ETCD && retry_pause(deadline, &backoff)) continue;
        if (err != RDZV_OK) goto out;
        if (restarts) *restarts = rec.restarts;
        if (strcmp(rec.job, "running") != 0) {
            err = strcmp(rec.job, "done") == 0 ? RDZV_ERR_JOB_DONE : RDZV_ERR_JOB_FAILED;
            rdzv_record_free(&rec);
            goto out;
        }
        report_write w = plan_report(r, mine, first_hand, reason, &rec, &next, &count);
        char *st = NULL;
        if (w == WRITE_NEXT_ROUND) {
            err = rdzv_record_copy_order(&rec, &next);
            if (err == RDZV_OK) err = put_record(r, r->api, &next, mod, 1, NULL, &won);
        } else if (w == WRITE_SAME_ROUND) {
            int failed = strcmp(rec.job, "failed") == 0;
            if (failed && !(st = state_json("failed", rec.reason))) err = RDZV_ERR_NOMEM;
            if (err == RDZV_OK) err = put_record(r, r->api, &rec, mod, 0, st, &won);
        }
        int64_t total = w == WRITE_NEXT_ROUND ? next.restarts : rec.restarts;
        int job_failed = strcmp(rec.job, "failed") == 0;
        free(st);
        rdzv_record_free(&next);
        rdzv_record_free(&rec);
        if (w == WRITE_NONE) goto out; /* RDZV_OK: already ended, or already counted */
        /* Unavailable or ambiguous (it may have been applied): read again,
         * and the record says whether it was. */
        if (err == RDZV_ERR_ETCD && retry_pause(deadline, &backoff)) continue;
        if (err != RDZV_OK) goto out;
        if (won) {
            if (restarts) *restarts = total;
            if (counted) *counted = count;
            if (job_failed) err = RDZV_ERR_JOB_FAILED;
            goto out;
        }
        if (rdzv_now_ms() > deadline) {
            err = RDZV_ERR_TIMEOUT;
            goto out;
        }
    }
out:
    pthread_mutex_unlock(&r->api_mu);
    return err;
}

rdzv_err rdzv_report_failure(rdzv *r, const char *reason, int64_t *restarts)
{
    return report(r, 1, reason, restarts, NULL);
}

rdzv_err rdzv_report_peer_lost(rdzv *r, const char *reason, int64_t *restarts, int *counted)
{
    return report(r, 0, reason, restarts, counted);
}

rdzv_err rdzv_finish(rdzv *r)
{
    if (!r) return RDZV_ERR_ARG;
    pthread_mutex_lock(&r->api_mu);
    rdzv_err err = RDZV_ERR_CLOSED;
    if (r->closed) goto out;
    int64_t deadline = report_deadline(r);
    int backoff = 50;
    char *st = state_json("done", "");
    if (!st) {
        err = RDZV_ERR_NOMEM;
        goto out;
    }
    for (;;) {
        rdzv_record rec;
        int64_t mod = 0;
        int have = 0, won = 0;
        err = read_round(r, r->api, &rec, &mod, &have);
        if (err == RDZV_OK && !have) err = RDZV_ERR_PROTOCOL;
        if (err == RDZV_ERR_ETCD && retry_pause(deadline, &backoff)) continue;
        if (err != RDZV_OK) break;
        if (strcmp(rec.job, "running") != 0) {
            err = strcmp(rec.job, "done") == 0 ? RDZV_OK : RDZV_ERR_JOB_FAILED;
            rdzv_record_free(&rec);
            break;
        }
        snprintf(rec.job, sizeof(rec.job), "done");
        err = put_record(r, r->api, &rec, mod, 0, st, &won);
        rdzv_record_free(&rec);
        /* Ambiguous or unavailable: the next read says whether it landed. */
        if (err == RDZV_ERR_ETCD && retry_pause(deadline, &backoff)) continue;
        if (err != RDZV_OK || won) break;
        if (rdzv_now_ms() > deadline) {
            err = RDZV_ERR_TIMEOUT;
            break;
        }
    }
    free(st);
out:
    pthread_mutex_unlock(&r->api_mu);
    return err;
}
