/* rdzv_watch.c: what wakes the rendezvous driver.
 *
 * Watches (each on its own thread, feeding the driver's inbox) are what
 * wake the driver; there is no polling. Every agent watches `round`, and
 * from its first frozen round on `nodes/` and `waiting/`; only the earliest
 * joiner of an open round watches the joins, the others watch just the join
 * key before theirs (the etcd election recipe), so a freezer that dies is
 * replaced at once. A watch only sets a bit in the inbox: the driver reads
 * the state itself, so a watch that breaks or misses events costs a re-read
 * (RDZV_TAG_RESYNC), never a wrong belief.
 *
 * A keep-alive thread renews the lease at TTL/3 on its own connection so
 * that a slow protocol step can never starve it; a lease etcd no longer
 * knows wakes the driver too.
 */
#include "rdzv_internal.h"

#include "ductile/clock.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct rdzv_watcher {
    struct rdzv *r;
    pthread_t th;
    char key[RDZV_KEY_MAX];
    int prefix;
    int64_t start_rev;
    int tag;
    pthread_mutex_t mu;
    int stop;
    etcd_watch *w;
    rdzv_watcher *next; /* on the retired list */
};

/* ---- the driver's inbox ---- */

static void post(rdzv *r, unsigned tag)
{
    pthread_mutex_lock(&r->mu);
    r->dirty |= tag;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

/* Waits on r->cv until `until_ms` (0: forever) or stop; returns 1 on stop.
 * Called with r->mu held. r->cv runs on the monotonic clock (mono_cond_init),
 * the clock of until_ms. */
int rdzv_wait_until(rdzv *r, int64_t until_ms)
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

static int watcher_stopped(rdzv_watcher *w)
{
    pthread_mutex_lock(&w->mu);
    int s = w->stop;
    pthread_mutex_unlock(&w->mu);
    return s;
}

/* Sleeps ms unless the watcher is stopped first (a retry backoff). */
static void watcher_pause(rdzv_watcher *w, int ms)
{
    int64_t until = mono_now_ms() + ms;
    while (!watcher_stopped(w) && mono_now_ms() < until) {
        struct timespec ts = {0, 20 * 1000000};
        nanosleep(&ts, NULL);
    }
}

/* Keeps the round record from a watch event, so that the driver's next
 * step need not fetch it again (saves one request per agent when a round
 * of hundreds freezes). Safe even if stale: every step's snapshot is
 * guarded by the record's mod_revision, and a stale one just reads again. */
void rdzv_cache_round(rdzv *r, const etcd_kv *kv)
{
    char *copy = NULL;
    if (kv && (copy = malloc(kv->value_len + 1)) != NULL) {
        memcpy(copy, kv->value, kv->value_len);
        copy[kv->value_len] = '\0';
    }
    pthread_mutex_lock(&r->mu);
    free(r->round_cache);
    r->round_cache = copy;
    r->round_cache_len = copy ? kv->value_len : 0;
    r->round_cache_mod = copy ? kv->mod_revision : 0;
    pthread_mutex_unlock(&r->mu);
}

/* Takes the cached round record if there is one; 1 when *rec is filled. */
int rdzv_take_cached_round(rdzv *r, rdzv_record *rec, int64_t *mod)
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
    rdzv_watcher *w = arg;
    pthread_setname_np(pthread_self(), "rdzv-watch");
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
        etcd_client_count_into(c, &r->counts.etcd);
        if (!w->w) {
            etcd_watch *ew = NULL;
            etcd_err e = etcd_watch_open(c, w->key, w->prefix, next_rev, &ew);
            if (e == ETCD_ERR_COMPACTED) {
                next_rev = 0;
                continue;
            }
            if (e != ETCD_OK) {
                dlog_debug(&r->log, NULL, "watch %s: %s", w->key, etcd_strerror(e));
                watcher_pause(w, backoff);
                backoff = backoff < 1000 ? backoff * 2 : 1000;
                continue;
            }
            pthread_mutex_lock(&w->mu);
            w->w = ew;
            int stop = w->stop;
            pthread_mutex_unlock(&w->mu);
            if (stop) break;
            if (next_rev != w->start_rev) post(r, (unsigned)w->tag | RDZV_TAG_RESYNC);
        }
        etcd_event *evs = NULL;
        size_t n = 0;
        /* A stop request cuts this short (etcd_watch_wakeup is never lost:
         * it sets a flag the next wait sees); the timeout is only a bound. */
        etcd_err e = etcd_watch_next(w->w, 30000, &evs, &n);
        if (e == ETCD_OK) {
            if (n > 0) {
                if (w->tag == RDZV_TAG_ROUND)
                    rdzv_cache_round(r, evs[n - 1].type == ETCD_EVENT_PUT ? &evs[n - 1].kv : NULL);
                post(r, (unsigned)w->tag);
                next_rev = evs[n - 1].kv.mod_revision + 1;
            }
            etcd_events_free(evs, n);
            backoff = 50;
            continue;
        }
        if (watcher_stopped(w)) break;
        dlog_debug(&r->log, NULL, "watch %s broke: %s", w->key, etcd_strerror(e));
        /* Resume after the last event seen; after compaction start from now
         * and have the driver re-read everything (it may have missed some). */
        if (e == ETCD_ERR_COMPACTED) next_rev = 0;
        pthread_mutex_lock(&w->mu);
        etcd_watch_close(w->w);
        w->w = NULL;
        pthread_mutex_unlock(&w->mu);
        post(r, (unsigned)w->tag | RDZV_TAG_RESYNC);
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

static rdzv_watcher *watcher_start(rdzv *r, const char *key, int prefix, int64_t start_rev, int tag)
{
    rdzv_watcher *w = calloc(1, sizeof(*w));
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
static void watcher_retire(rdzv *r, rdzv_watcher *w)
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

void rdzv_watchers_join(rdzv *r)
{
    watcher_retire(r, r->w_round);
    watcher_retire(r, r->w_nodes);
    watcher_retire(r, r->w_waiting);
    watcher_retire(r, r->w_join);
    r->w_round = r->w_nodes = r->w_waiting = r->w_join = NULL;
    pthread_mutex_lock(&r->mu);
    rdzv_watcher *w = r->retired;
    r->retired = NULL;
    pthread_mutex_unlock(&r->mu);
    while (w) {
        rdzv_watcher *next = w->next;
        pthread_join(w->th, NULL);
        pthread_mutex_destroy(&w->mu);
        free(w);
        w = next;
    }
}

rdzv_err rdzv_watch_round(rdzv *r, int64_t start_rev)
{
    char key[RDZV_KEY_MAX];
    rdzv_key(key, sizeof(key), r->cfg.job, "round");
    r->w_round = watcher_start(r, key, 0, start_rev, RDZV_TAG_ROUND);
    return r->w_round ? RDZV_OK : RDZV_ERR_NOMEM;
}

/* The driver's join watch: the whole joined/ prefix for the freezer, the
 * predecessor's key for the others, none outside an open round. */
void rdzv_set_join_watch(rdzv *r, const char *key, int prefix, int64_t start_rev)
{
    char target[RDZV_KEY_MAX + 2];
    snprintf(target, sizeof(target), "%c%s", prefix ? 'P' : 'K', key ? key : "");
    if (key && r->w_join && strcmp(target, r->join_target) == 0) return;
    watcher_retire(r, r->w_join);
    r->w_join = NULL;
    r->join_target[0] = '\0';
    if (!key) return;
    r->w_join = watcher_start(r, key, prefix, start_rev, RDZV_TAG_JOIN);
    if (r->w_join) snprintf(r->join_target, sizeof(r->join_target), "%s", target);
}

/* Node and waiting keys matter only once a round is frozen (to a member,
 * or to a spare): the watches start then, from the snapshot that was just
 * read, so a round of N joiners does not fan N registrations out to N
 * agents. Waiting keys matter only to a member of a round with room (a
 * full round takes nobody; a node outside the round is waiting itself):
 * that watch starts with the first such round. Once started they stay. */
void rdzv_start_member_watches(rdzv *r, int64_t from, int waiting)
{
    char key[RDZV_KEY_MAX];
    if (!r->w_nodes) {
        rdzv_key(key, sizeof(key), r->cfg.job, "nodes/");
        r->w_nodes = watcher_start(r, key, 1, from, RDZV_TAG_NODES);
    }
    if (waiting && !r->w_waiting) {
        rdzv_key(key, sizeof(key), r->cfg.job, "waiting/");
        r->w_waiting = watcher_start(r, key, 1, from, RDZV_TAG_WAITING);
    }
}

/* ---- keep-alive ---- */

void *rdzv_keepalive_main(void *arg)
{
    rdzv *r = arg;
    pthread_setname_np(pthread_self(), "rdzv-keepalive");
    int64_t period = (int64_t)r->cfg.lease_ttl_s * 1000 / 3;
    int64_t next = mono_now_ms() + period;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!r->stop && mono_now_ms() < next)
            rdzv_wait_until(r, next);
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
        next = mono_now_ms() + (e == ETCD_OK ? period : 300);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}
