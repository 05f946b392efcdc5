/* rdzv_watch.c: what wakes the rendezvous driver.
 *
 * Watches (all on one stream, read by one thread, feeding the driver's
 * inbox) are what wake the driver; there is no polling. Every agent
 * watches `round`, from its first frozen round on `nodes/`, and from its
 * first round with room that it is a member of `waiting/`; only the
 * earliest joiner of an open round watches the joins, the others watch
 * just the join key before theirs (the etcd election recipe), so a freezer
 * that dies is replaced at once. A watch only sets a bit in the inbox: the
 * driver reads the state itself, so a watch that breaks or misses events
 * costs a re-read (RDZV_TAG_RESYNC), never a wrong belief. The set is
 * fixed per stream (etcd's gateway takes no new watch on an open stream),
 * so a driver step that changes it has the thread open the stream again,
 * each key resuming from its own revision.
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

/* The watch set: round, the join watch, nodes/, waiting/. */
enum { WS_ROUND, WS_JOIN, WS_NODES, WS_WAITING, WS_N };

typedef struct ws_key {
    int on;
    char key[RDZV_KEY_MAX];
    int prefix;
    int64_t next_rev; /* where it starts or resumes (0: from now) */
} ws_key;

static const unsigned ws_tag[WS_N] = {RDZV_TAG_ROUND, RDZV_TAG_JOIN, RDZV_TAG_NODES,
                                      RDZV_TAG_WAITING};

struct rdzv_watcher {
    struct rdzv *r;
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* with mu: the thread waits for its first set */
    ws_key want[WS_N]; /* the set the driver asks for (mu) */
    int moved;         /* want moved in the driver's step now (mu) */
    int changed;       /* a step that moved want has ended: open again (mu) */
    int ready;         /* the driver published its set: the stream may open (mu) */
    int stop;          /* (mu) */
    etcd_watch *w;     /* (mu for the pointer, so that a wakeup never meets a closed one) */
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

/* ---- the watch thread ---- */

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

/* Opens the stream for the set as asked now, each key from where it
 * resumes; set is what it carries, *idx maps a stream index to its slot.
 * The caller holds no lock. */
static etcd_err watcher_open(rdzv_watcher *w, etcd_client *c, ws_key *set, int *idx, size_t *n)
{
    pthread_mutex_lock(&w->mu);
    memcpy(set, w->want, sizeof(w->want));
    w->changed = 0;
    pthread_mutex_unlock(&w->mu);
    etcd_watch_key keys[WS_N];
    *n = 0;
    for (int i = 0; i < WS_N; i++) {
        if (!set[i].on) continue;
        keys[*n] = (etcd_watch_key){
            .key = set[i].key, .prefix = set[i].prefix, .start_revision = set[i].next_rev};
        idx[(*n)++] = i;
    }
    etcd_watch *ew = NULL;
    etcd_err e = *n ? etcd_watch_open_set(c, keys, *n, &ew) : ETCD_OK;
    pthread_mutex_lock(&w->mu);
    w->w = ew;
    /* a step that moved the set while this one opened could not wake it */
    if (ew && w->changed) etcd_watch_wakeup(ew);
    pthread_mutex_unlock(&w->mu);
    return e;
}

/* Closes the stream, keeping where each key of it resumes (a key the
 * driver has moved meanwhile keeps the start it was given). */
static void watcher_close(rdzv_watcher *w, const int *idx, size_t n, const ws_key *was)
{
    pthread_mutex_lock(&w->mu);
    etcd_watch *ew = w->w;
    w->w = NULL;
    for (size_t j = 0; ew && j < n; j++) {
        ws_key *k = &w->want[idx[j]];
        if (k->on && strcmp(k->key, was[idx[j]].key) == 0 && k->prefix == was[idx[j]].prefix)
            k->next_rev = etcd_watch_next_revision(ew, j);
    }
    pthread_mutex_unlock(&w->mu);
    etcd_watch_close(ew);
}

/* After compaction every key starts from now (the driver re-reads all). */
static void watcher_forget_revisions(rdzv_watcher *w)
{
    pthread_mutex_lock(&w->mu);
    for (int i = 0; i < WS_N; i++)
        w->want[i].next_rev = 0;
    pthread_mutex_unlock(&w->mu);
}

/* What a break tells the driver: re-read, and every key of the set. */
static unsigned resync_tags(const int *idx, size_t n)
{
    unsigned tags = RDZV_TAG_RESYNC;
    for (size_t j = 0; j < n; j++)
        tags |= ws_tag[idx[j]];
    return tags;
}

/* The events of one wait, to the driver: their keys' tags, and the newest
 * round record for its cache. */
static void deliver(rdzv *r, const int *idx, etcd_event *evs, size_t ne)
{
    unsigned tags = 0;
    const etcd_kv *round = NULL;
    int round_seen = 0;
    for (size_t i = 0; i < ne; i++) {
        int slot = idx[evs[i].watch];
        tags |= ws_tag[slot];
        if (slot == WS_ROUND) {
            round_seen = 1;
            round = evs[i].type == ETCD_EVENT_PUT ? &evs[i].kv : NULL;
        }
    }
    if (round_seen) rdzv_cache_round(r, round);
    if (tags) post(r, tags);
    etcd_events_free(evs, ne);
}

/* Opens the stream for the set the driver wants; 1 when it is open, 0
 * when the thread goes round again (after a pause or a wait). */
static int watcher_start(rdzv_watcher *w, etcd_client *c, ws_key *was, int *idx, size_t *n,
                         int *broke, int *backoff)
{
    rdzv *r = w->r;
    etcd_err e = watcher_open(w, c, was, idx, n);
    if (e == ETCD_ERR_COMPACTED) {
        watcher_forget_revisions(w);
        *broke = 1;
        return 0;
    }
    if (e != ETCD_OK) {
        dlog_debug(&r->log, NULL, "watch: %s", etcd_strerror(e));
        *broke = 1;
        watcher_pause(w, *backoff);
        *backoff = *backoff < 1000 ? *backoff * 2 : 1000;
        return 0;
    }
    if (*broke) {
        post(r, resync_tags(idx, *n));
        *broke = 0;
    }
    if (!w->w) { /* nothing to watch (never so: `round` always is) */
        pthread_mutex_lock(&w->mu);
        while (!w->stop && !w->changed)
            pthread_cond_wait(&w->cv, &w->mu);
        pthread_mutex_unlock(&w->mu);
        return 0;
    }
    return 1;
}

/* One thread, one stream: every watch of the handle on it. The set opens
 * once the driver has taken its first step (rdzv_watch_apply), and opens
 * again when a step changed it, each key resuming where it was; nothing
 * is missed in between, as every key starts from a revision the driver
 * read. A break or a bad message costs the driver a re-read
 * (RDZV_TAG_RESYNC), never a wrong belief. */
static void *watcher_main(void *arg)
{
    rdzv_watcher *w = arg;
    pthread_setname_np(pthread_self(), "rdzv-watch");
    rdzv *r = w->r;
    etcd_client *c = NULL;
    int backoff = 50, idx[WS_N], broke = 0;
    size_t n = 0;
    ws_key was[WS_N]; /* the set the stream carries */
    for (;;) {
        pthread_mutex_lock(&w->mu);
        while (!w->stop && !w->ready)
            pthread_cond_wait(&w->cv, &w->mu);
        int stop = w->stop, changed = w->changed;
        pthread_mutex_unlock(&w->mu);
        if (stop) break;
        if (!c && rdzv_etcd_connect(&r->etcd, &c, NULL) != RDZV_OK) {
            watcher_pause(w, 1000);
            continue;
        }
        etcd_client_set_name(c, "watch");
        etcd_client_count_into(c, &r->counts.etcd);
        if (w->w && changed) watcher_close(w, idx, n, was);
        if (!w->w && !watcher_start(w, c, was, idx, &n, &broke, &backoff)) continue;
        etcd_event *evs = NULL;
        size_t ne = 0;
        /* A stop request or a new set cuts this short (etcd_watch_wakeup is
         * never lost: it sets a flag the next wait sees); the timeout is
         * only a bound. */
        etcd_err e = etcd_watch_next(w->w, 30000, &evs, &ne);
        if (e == ETCD_OK) {
            deliver(r, idx, evs, ne);
            backoff = 50;
            continue;
        }
        if (watcher_stopped(w)) break;
        dlog_debug(&r->log, NULL, "watch broke: %s", etcd_strerror(e));
        /* Resume after the last event seen; after compaction start from now
         * and have the driver re-read everything (it may have missed some). */
        watcher_close(w, idx, n, was);
        if (e == ETCD_ERR_COMPACTED) watcher_forget_revisions(w);
        post(r, resync_tags(idx, n));
        broke = 1;
        watcher_pause(w, backoff);
        backoff = backoff < 1000 ? backoff * 2 : 1000;
    }
    pthread_mutex_lock(&w->mu);
    etcd_watch *ew = w->w;
    w->w = NULL;
    pthread_mutex_unlock(&w->mu);
    etcd_watch_close(ew);
    etcd_client_free(c);
    return NULL;
}

/* Sets slot i of the set as the driver asks (key NULL: off). */
static void want(rdzv *r, int i, const char *key, int prefix, int64_t start_rev)
{
    rdzv_watcher *w = r->watcher;
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    ws_key *k = &w->want[i];
    if (!key) {
        if (k->on) w->moved = 1;
        k->on = 0;
    } else if (!k->on || strcmp(k->key, key) != 0 || k->prefix != prefix) {
        k->on = 1;
        snprintf(k->key, sizeof(k->key), "%s", key);
        k->prefix = prefix;
        k->next_rev = start_rev;
        w->moved = 1;
    }
    pthread_mutex_unlock(&w->mu);
}

/* After each driver step: the set it asked for is the stream's now (one
 * stream opened again however many slots the step moved). */
void rdzv_watch_apply(rdzv *r)
{
    rdzv_watcher *w = r->watcher;
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    int wake = !w->ready || w->moved;
    if (w->moved) w->changed = 1;
    w->moved = 0;
    w->ready = 1;
    if (wake && w->w) etcd_watch_wakeup(w->w);
    if (wake) pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

void rdzv_watchers_join(rdzv *r)
{
    rdzv_watcher *w = r->watcher;
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    w->stop = 1;
    if (w->w) etcd_watch_wakeup(w->w);
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->th, NULL);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    free(w);
    r->watcher = NULL;
}

rdzv_err rdzv_watch_round(rdzv *r, int64_t start_rev)
{
    rdzv_watcher *w = calloc(1, sizeof(*w));
    if (!w) return RDZV_ERR_NOMEM;
    w->r = r;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    rdzv_key(w->want[WS_ROUND].key, sizeof(w->want[WS_ROUND].key), r->cfg.job, "round");
    w->want[WS_ROUND].on = 1;
    w->want[WS_ROUND].next_rev = start_rev;
    if (pthread_create(&w->th, NULL, watcher_main, w) != 0) {
        pthread_cond_destroy(&w->cv);
        pthread_mutex_destroy(&w->mu);
        free(w);
        return RDZV_ERR_NOMEM;
    }
    r->watcher = w;
    return RDZV_OK;
}

/* The driver's join watch: the whole joined/ prefix for the freezer, the
 * predecessor's key for the others, none outside an open round. */
void rdzv_set_join_watch(rdzv *r, const char *key, int prefix, int64_t start_rev)
{
    want(r, WS_JOIN, key, prefix, start_rev);
}

/* Node and waiting keys matter only once a round is frozen (to a member,
 * or to a spare): the watches start then, from the snapshot that was just
 * read, so a round of N joiners does not fan N registrations out to N
 * agents. Waiting keys matter only to a member of a round with room (a
 * full round takes nobody; a node outside the round is waiting itself):
 * that watch starts with the first such round. Once started they stay. */
void rdzv_start_member_watches(rdzv *r, int64_t from, int waiting)
{
    rdzv_watcher *w = r->watcher;
    if (!w) return;
    char key[RDZV_KEY_MAX];
    pthread_mutex_lock(&w->mu);
    int nodes_on = w->want[WS_NODES].on, waiting_on = w->want[WS_WAITING].on;
    pthread_mutex_unlock(&w->mu);
    if (!nodes_on) {
        rdzv_key(key, sizeof(key), r->cfg.job, "nodes/");
        want(r, WS_NODES, key, 1, from);
    }
    if (waiting && !waiting_on) {
        rdzv_key(key, sizeof(key), r->cfg.job, "waiting/");
        want(r, WS_WAITING, key, 1, from);
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
