/* etcd_watch.c: the watch stream (see etcd.h).
 *
 * A watch is one long POST read incrementally through a curl multi handle, so
 * etcd_watch_next can wait with a deadline and be woken from another thread
 * (curl_multi_poll + curl_multi_wakeup). Messages are split on newlines and
 * parsed one by one; the watch remembers the revision after the last event it
 * queued, reconnects from there when the stream breaks, and drops any event
 * older than that, so a resume never loses or repeats one.
 *
 * A set (etcd_watch_open_set) is one stream whose request body holds one
 * create_request per key: etcd answers "created" for each, in order, with
 * the watch_id it gave it (0 is left out of the JSON), and tags every
 * event message with it. Each key keeps its own resume revision.
 *
 * A watch owns a copy of its client's connection (endpoints, credentials,
 * token), so it can fail over and log in again without touching the client,
 * which another thread may be using.
 */
#include "etcd_internal.h"

#include "ductile/clock.h"

#include <curl/curl.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum { W_DOWN, W_CONNECTING, W_LIVE, W_DEAD } watch_state;

/* One key of the stream. */
typedef struct wkey {
    char *key;
    int prefix;
    int64_t next_rev; /* first revision not yet queued; 0 before the first "created" */
    int64_t id;       /* etcd's watch_id on the current stream */
} wkey;

struct etcd_watch {
    etcd_conn k;
    int timeout_ms;
    wkey keys[ETCD_WATCH_MAX_KEYS];
    size_t nkeys;
    size_t ncreated; /* keys the current stream has answered "created" for */
    CURLM *multi;
    CURL *stream; /* non-NULL while a stream is in the multi handle */
    struct curl_slist *hdrs;
    long status; /* HTTP status of the current stream, 0 until known */
    etcd_buf in; /* bytes of the stream not yet split into messages */
    size_t scanned;
    int64_t last_rev; /* etcd_watch_revision */
    etcd_event *queue;
    size_t nqueue, capqueue;
    watch_state state;
    etcd_err pending; /* error to report once the queue is drained */
    etcd_err dead_err;
    int64_t retry_at;   /* W_DOWN: when to reconnect */
    int64_t down_since; /* when the stream was last not live; 0 while live */
    int tries;          /* failed connects in a row, for backoff */
    int64_t live_since; /* when the current stream was created */
    int reauthed;
    int created_once;
    char curlerr[CURL_ERROR_SIZE];
    atomic_int woken;
};

static size_t stream_write(void *data, size_t size, size_t n, void *user)
{
    etcd_watch *w = user;
    if (w->status == 0) {
        curl_easy_getinfo(w->stream, CURLINFO_RESPONSE_CODE, &w->status);
        /* an error answer is small; a stream is capped per message below */
        if (w->status != 200) w->in.limit = ETCD_MAX_SMALL_ANSWER;
    }
    return etcd_buf_append(&w->in, data, size * n) == 0 ? size * n : 0;
}

static void stream_stop(etcd_watch *w)
{
    if (w->stream) {
        curl_multi_remove_handle(w->multi, w->stream);
        curl_easy_cleanup(w->stream);
        w->stream = NULL;
    }
    curl_slist_free_all(w->hdrs);
    w->hdrs = NULL;
}

static void watch_die(etcd_watch *w, etcd_err e)
{
    stream_stop(w);
    w->state = W_DEAD;
    w->dead_err = e;
}

/* The stream broke or could not start: try the next endpoint after a
 * backoff (no wait before the first retry of a stream that was live). */
static void watch_down(etcd_watch *w)
{
    int was_live = w->state == W_LIVE;
    stream_stop(w);
    w->state = W_DOWN;
    int64_t now = mono_now_ms();
    if (!w->down_since) w->down_since = now;
    w->k.cur = (w->k.cur + 1) % w->k.nendpoints;
    /* a stream that lived a while starts over without waiting; one that
     * breaks right after "created" keeps backing off (no reconnect storm) */
    if (was_live && now - w->live_since >= 1000) w->tries = 0;
    int64_t d = 0;
    if (w->tries > 0) {
        int r = w->tries - 1 < 6 ? w->tries - 1 : 6;
        d = ETCD_BACKOFF_FIRST_MS << r;
        if (d > ETCD_BACKOFF_MAX_MS) d = ETCD_BACKOFF_MAX_MS;
        d = d / 2 + (int64_t)(etcd_conn_rand(&w->k) % (uint64_t)(d / 2 + 1));
    }
    w->tries++;
    w->retry_at = now + d;
}

/* The gateway (grpc-gateway under Go's net/http) reads the first
 * create_request before it answers, and the others from a goroutine while
 * it answers; once its answer has begun, Go discards whatever of the body
 * is still unread, and the keys in it are never created. What the first
 * read took is safe: Go's JSON decoder reads 512 bytes, then 1024 more,
 * then 2048, ..., until the first request is whole. So the first request
 * is padded with blanks to end past the last of those reads that does not
 * already take the whole body: the reads that bring it in bring the rest
 * too. (Should a key still go missing, the open waits for its "created"
 * only until its deadline, and fails.) */
#define GO_JSON_MIN_READ 512 /* encoding/json's minRead: its buffer grows to 2 * cap + this */

static char *pad_first(char *body, size_t len, size_t first_len)
{
    if (len <= GO_JSON_MIN_READ) return body; /* the first read takes it all */
    size_t rest = len - first_len, prev = GO_JSON_MIN_READ, want = first_len;
    size_t cap = 3 * GO_JSON_MIN_READ;
    for (; cap < ETCD_MAX_SMALL_ANSWER; prev = cap, cap = 2 * cap + GO_JSON_MIN_READ) {
        want = first_len > prev ? first_len : prev + 1; /* ends in the read up to cap */
        if (want + rest <= cap) break;
    }
    size_t pad = want - first_len;
    if (pad == 0) return body;
    char *grown = realloc(body, len + pad + 1);
    if (!grown) {
        free(body);
        return NULL;
    }
    /* the blanks go before the first request's closing brace */
    memmove(grown + first_len - 1 + pad, grown + first_len - 1, len - first_len + 2);
    memset(grown + first_len - 1, ' ', pad);
    return grown;
}

/* The stream's request: one create_request per key, one after another. */
static char *request_body(const etcd_watch *w)
{
    char *body = NULL;
    size_t len = 0, first_len = 0;
    for (size_t i = 0; i < w->nkeys; i++) {
        const wkey *k = &w->keys[i];
        char *one = etcd_build_watch_create(k->key, k->prefix, k->next_rev);
        char *grown = one ? realloc(body, len + strlen(one) + 1) : NULL;
        if (!grown) {
            free(one);
            free(body);
            return NULL;
        }
        body = grown;
        memcpy(body + len, one, strlen(one) + 1);
        len += strlen(one);
        if (i == 0) first_len = len;
        free(one);
    }
    return pad_first(body, len, first_len);
}

static etcd_err stream_start(etcd_watch *w)
{
    char *body = request_body(w);
    if (!body) return ETCD_ERR_NOMEM;
    w->stream = curl_easy_init();
    etcd_err e =
        w->stream ? etcd_conn_setup(&w->k, w->stream, "/v3/watch", &w->hdrs) : ETCD_ERR_NOMEM;
    /* The setup requires a leader (clientv3's WithRequireLeader): a member
     * that has none refuses the watch, or cancels it once it has lost its
     * leader for three election timeouts (cut off from its peers, it would
     * otherwise keep the stream open and silent, while the others move on). */
    if (e != ETCD_OK) {
        free(body);
        stream_stop(w);
        return e;
    }
    curl_easy_setopt(w->stream, CURLOPT_COPYPOSTFIELDS, body);
    free(body);
    curl_easy_setopt(w->stream, CURLOPT_WRITEFUNCTION, stream_write);
    curl_easy_setopt(w->stream, CURLOPT_WRITEDATA, w);
    curl_easy_setopt(w->stream, CURLOPT_CONNECTTIMEOUT_MS, (long)ETCD_CONNECT_TIMEOUT_MS);
    w->curlerr[0] = 0;
    curl_easy_setopt(w->stream, CURLOPT_ERRORBUFFER, w->curlerr);
    w->status = 0;
    w->ncreated = 0;
    etcd_buf_reset(&w->in, ETCD_MAX_BIG_ANSWER);
    w->scanned = 0;
    if (curl_multi_add_handle(w->multi, w->stream) != CURLM_OK) {
        stream_stop(w);
        return ETCD_ERR_NOMEM;
    }
    w->state = W_CONNECTING;
    return ETCD_OK;
}

/* Events of one revision (a txn) share its number and always come in one
 * message, so what was seen before a resume is told apart by the revision
 * the stream resumed from, not by the event before. */
static etcd_err queue_events(etcd_watch *w, etcd_watch_msg *m, size_t key)
{
    int64_t from = w->keys[key].next_rev;
    for (size_t i = 0; i < m->n; i++) {
        etcd_event *ev = &m->events[i];
        if (ev->kv.mod_revision < from) continue; /* seen before a resume */
        if (w->nqueue == w->capqueue) {
            size_t cap = w->capqueue ? 2 * w->capqueue : 16;
            etcd_event *q = realloc(w->queue, cap * sizeof(*q));
            if (!q) return ETCD_ERR_NOMEM;
            w->queue = q;
            w->capqueue = cap;
        }
        ev->watch = (int)key;
        w->queue[w->nqueue++] = *ev;
        memset(ev, 0, sizeof(*ev));
        w->keys[key].next_rev = w->queue[w->nqueue - 1].kv.mod_revision + 1;
    }
    return ETCD_OK;
}

/* The key of the current stream that etcd calls watch_id; -1 if none. */
static int key_of(const etcd_watch *w, int64_t id)
{
    for (size_t i = 0; i < w->ncreated; i++)
        if (w->keys[i].id == id) return (int)i;
    return -1;
}

/* A stream error: "unavailable" goes on to the next endpoint, an expired
 * token logs in again (once), anything else ends the watch. */
static void on_stream_error(etcd_watch *w, const etcd_watch_msg *m)
{
    etcd_conn_seterr(&w->k, "watch stream from %s: %s (code %d)", w->k.endpoints[w->k.cur],
                     m->reason, m->error_code);
    if (m->error_code == 14) {
        watch_down(w);
    } else if (w->k.user && etcd_is_token_error(m->error_code, m->reason) && !w->reauthed) {
        w->reauthed = 1;
        free(w->k.token);
        w->k.token = NULL;
        watch_down(w);
    } else {
        watch_die(w, etcd_map_grpc(m->error_code, m->reason, 200));
    }
}

static void on_canceled(etcd_watch *w, const etcd_watch_msg *m)
{
    int key = key_of(w, m->watch_id);
    if (m->compact_revision > 0) {
        etcd_conn_seterr(&w->k, "watch of %s from revision %" PRId64 ": compacted up to %" PRId64,
                         w->keys[key < 0 ? 0 : key].key, w->keys[key < 0 ? 0 : key].next_rev,
                         m->compact_revision);
        w->last_rev = m->compact_revision;
        watch_die(w, ETCD_ERR_COMPACTED);
    } else if (w->k.user && strstr(m->reason, "invalid auth token") && !w->reauthed) {
        /* an auth failure is a cancel with a reason: log in again, once */
        w->reauthed = 1;
        free(w->k.token);
        w->k.token = NULL;
        etcd_conn_seterr(&w->k, "watch canceled by etcd: %s", m->reason);
        watch_down(w);
    } else {
        etcd_conn_seterr(&w->k, "watch canceled by etcd: %s",
                         m->reason[0] ? m->reason : "(no reason)");
        int auth = strstr(m->reason, "Unauthenticated") || strstr(m->reason, "PermissionDenied") ||
                   strstr(m->reason, "permission denied") ||
                   strstr(m->reason, "user name is empty");
        watch_die(w, auth ? ETCD_ERR_AUTH : ETCD_ERR_CANCELED);
    }
}

/* etcd creates the watches in the order they were asked for. */
static void on_created(etcd_watch *w, const etcd_watch_msg *m)
{
    wkey *k = &w->keys[w->ncreated++];
    k->id = m->watch_id;
    if (k->next_rev == 0) {
        k->next_rev = m->header_revision + 1;
        if (w->nkeys == 1) w->last_rev = m->header_revision;
    }
    if (w->ncreated == w->nkeys) {
        w->state = W_LIVE;
        w->created_once = 1;
        w->down_since = 0;
        w->live_since = mono_now_ms();
        w->reauthed = 0;
    }
}

static void on_events(etcd_watch *w, etcd_watch_msg *m)
{
    int key = key_of(w, m->watch_id);
    etcd_err qe = ETCD_ERR_NOMEM;
    if (key < 0) {
        etcd_conn_seterr(
            &w->k, "watch stream from %s: events for watch %" PRId64 ", which it did not create",
            w->k.endpoints[w->k.cur], m->watch_id);
        qe = ETCD_ERR_PROTOCOL;
    } else {
        qe = queue_events(w, m, (size_t)key);
    }
    if (qe != ETCD_OK) {
        w->pending = qe;
        watch_down(w);
    }
}

/* Act on one message of the stream. */
static void handle_msg(etcd_watch *w, const char *line, size_t len)
{
    etcd_watch_msg m;
    etcd_err e = etcd_parse_watch_msg(line, len, &m, w->k.err, sizeof(w->k.err));
    if (e == ETCD_ERR_NOMEM) {
        w->pending = e;
        watch_down(w);
        return;
    }
    if (e != ETCD_OK) {
        /* garbage: report it, then resume from the last good revision */
        char why[sizeof(w->k.err)];
        snprintf(why, sizeof(why), "%s", w->k.err);
        etcd_conn_seterr(&w->k, "watch stream from %s: %s", w->k.endpoints[w->k.cur], why);
        w->pending = ETCD_ERR_PROTOCOL;
        watch_down(w);
        return;
    }
    if (m.error_code)
        on_stream_error(w, &m);
    else if (m.canceled)
        on_canceled(w, &m);
    else if (m.created && w->state == W_CONNECTING && w->ncreated < w->nkeys)
        on_created(w, &m);
    else if (m.n > 0)
        on_events(w, &m);
    etcd_watch_msg_free(&m);
}

/* Split what arrived into messages. */
static void split_messages(etcd_watch *w)
{
    size_t start = 0;
    while (w->stream && w->status == 200) {
        char *nl = memchr(w->in.p + w->scanned, '\n', w->in.len - w->scanned);
        if (!nl) {
            w->scanned = w->in.len;
            break;
        }
        size_t end = (size_t)(nl - w->in.p);
        size_t s = start;
        while (s < end && (w->in.p[s] == ' ' || w->in.p[s] == '\r'))
            s++;
        if (s < end) handle_msg(w, w->in.p + s, end - s);
        start = end + 1;
        w->scanned = start;
    }
    if (!w->stream) return; /* handle_msg dropped the stream and its buffer */
    if (start > 0) {
        memmove(w->in.p, w->in.p + start, w->in.len - start);
        w->in.len -= start;
        w->in.p[w->in.len] = 0;
        w->scanned -= start;
    }
}

/* The stream's transfer ended: why, and what next. */
static void stream_done(etcd_watch *w, CURLcode cc)
{
    const char *ep = w->k.endpoints[w->k.cur];
    int code;
    char msg[ETCD_REASON_MAX];
    if (cc == CURLE_WRITE_ERROR && w->in.over) {
        etcd_conn_seterr(&w->k, "watch stream from %s: message larger than %zu bytes", ep,
                         w->in.limit);
        w->pending = ETCD_ERR_TOO_LARGE;
        watch_down(w);
        return;
    }
    if (etcd_is_tls_error(cc, w->curlerr)) {
        etcd_conn_seterr(&w->k, "watch %s: %s", ep,
                         w->curlerr[0] ? w->curlerr : curl_easy_strerror(cc));
        watch_die(w, ETCD_ERR_TLS);
        return;
    }
    if (cc == CURLE_OK && w->status != 200) {
        if (!etcd_parse_error(w->in.p ? w->in.p : "", w->in.len, &code, msg, sizeof(msg))) {
            code = -1;
            snprintf(msg, sizeof(msg), "HTTP %ld without an etcd error body", w->status);
        }
        etcd_conn_seterr(&w->k, "watch %s: %s (HTTP %ld, code %d)", ep, msg, w->status, code);
        if (w->k.user && etcd_is_token_error(code, msg) && !w->reauthed) {
            w->reauthed = 1;
            free(w->k.token);
            w->k.token = NULL;
        } else if (!(code == 14 || (code < 0 && w->status >= 500))) {
            watch_die(w, code < 0 ? ETCD_ERR_PROTOCOL : etcd_map_grpc(code, msg, (int)w->status));
            return;
        }
    } else if (cc == CURLE_OK && w->in.len &&
               etcd_parse_error(w->in.p, w->in.len, &code, msg, sizeof(msg))) {
        /* etcd ended the stream with an error (a member without a leader
         * cancels the watch: code 14, "etcdserver: no leader"), which the
         * gateway writes without the newline that ends other messages */
        handle_msg(w, w->in.p, w->in.len);
        if (!w->stream) return; /* down (14: on to the next endpoint) or over */
        etcd_conn_seterr(&w->k, "watch stream from %s ended after an error", ep);
    } else if (cc == CURLE_OK) {
        etcd_conn_seterr(&w->k, "watch stream from %s ended%s", ep,
                         w->in.len ? " in the middle of a message" : "");
    } else {
        etcd_conn_seterr(&w->k, "watch stream from %s: %s", ep,
                         w->curlerr[0] ? w->curlerr : curl_easy_strerror(cc));
    }
    watch_down(w); /* a resume sends what was lost with a partial message again */
}

/* Drive the stream until something for the caller is ready or until. */
static etcd_err watch_pump(etcd_watch *w, int64_t until, int want_created)
{
    for (;;) {
        /* once created, even a cancel right after it is the caller's to read */
        if (want_created && w->created_once) return ETCD_OK;
        if (w->state == W_DEAD) return w->dead_err;
        if (want_created && w->pending != ETCD_OK) return w->pending;
        if (!want_created && (w->nqueue || w->pending != ETCD_OK)) return ETCD_OK;
        if (!want_created && atomic_exchange(&w->woken, 0)) return ETCD_OK;
        if (w->state == W_DOWN && mono_now_ms() >= w->retry_at) {
            if (w->k.user && !w->k.token) {
                /* log in again first: a short blocking call, bounded by the
                 * client's timeout (simpler than driving it through the
                 * multi handle, which would make it wakeable too) */
                etcd_err e = etcd_send_login(&w->k, mono_now_ms() + w->timeout_ms);
                if (e == ETCD_ERR_AUTH || e == ETCD_ERR_TLS || e == ETCD_ERR_NOMEM) {
                    watch_die(w, e);
                    continue;
                }
                if (e != ETCD_OK) {
                    watch_down(w);
                    if (mono_now_ms() >= until) return ETCD_OK;
                    continue;
                }
            }
            etcd_err e = stream_start(w);
            if (e != ETCD_OK) {
                watch_die(w, e);
                continue;
            }
        }
        /* at least one pass over the stream, even with no time to wait */
        int running = 0;
        curl_multi_perform(w->multi, &running);
        if (w->stream) split_messages(w);
        CURLMsg *msg;
        int left;
        while ((msg = curl_multi_info_read(w->multi, &left))) {
            if (msg->msg == CURLMSG_DONE && w->stream && msg->easy_handle == w->stream) {
                CURLcode cc = msg->data.result;
                split_messages(w);
                if (w->stream) stream_done(w, cc);
            }
        }
        /* anything that ends the wait is seen at the top, not after a poll;
         * events queued before every key is created (etcd sends a key's
         * history as soon as that key is created) do not end the open's */
        if (w->state == W_DEAD || w->pending != ETCD_OK ||
            (want_created ? w->created_once : w->nqueue != 0))
            continue;
        int64_t now = mono_now_ms();
        if (now >= until) return ETCD_OK;
        int64_t wait = until - now;
        if (w->state == W_DOWN) {
            if (w->retry_at <= now) continue;
            if (w->retry_at - now < wait) wait = w->retry_at - now;
        }
        int numfds;
        curl_multi_poll(w->multi, NULL, 0, (int)(wait > 1000 ? 1000 : wait), &numfds);
    }
}

etcd_err etcd_watch_open(etcd_client *c, const char *key, int prefix, int64_t start_revision,
                         etcd_watch **out)
{
    etcd_watch_key one = {.key = key, .prefix = prefix, .start_revision = start_revision};
    return etcd_watch_open_set(c, &one, 1, out);
}

etcd_err etcd_watch_open_set(etcd_client *c, const etcd_watch_key *keys, size_t n, etcd_watch **out)
{
    *out = NULL;
    if (n < 1 || n > ETCD_WATCH_MAX_KEYS || !keys) {
        etcd_conn_seterr(&c->k, "a watch set holds 1 to %d keys, not %zu", ETCD_WATCH_MAX_KEYS, n);
        return ETCD_ERR_ARG;
    }
    for (size_t i = 0; i < n; i++) {
        etcd_err e = etcd_check_key(keys[i].key, keys[i].prefix, c->k.err, sizeof(c->k.err));
        if (e != ETCD_OK) return e;
        if (keys[i].start_revision < 0) {
            etcd_conn_seterr(&c->k, "negative watch start revision");
            return ETCD_ERR_ARG;
        }
    }
    c->k.err[0] = 0;
    etcd_err e;
    const char *fp = etcd_client_failpoint(c, "watch");
    if (fp && strcmp(fp, "unavailable") == 0) return etcd_failpoint_unavailable(c, "/v3/watch");
    etcd_watch *w = calloc(1, sizeof(*w));
    if (!w) return ETCD_ERR_NOMEM;
    atomic_init(&w->woken, 0);
    w->timeout_ms = c->timeout_ms;
    w->last_rev = n == 1 && keys[0].start_revision > 0 ? keys[0].start_revision - 1 : 0;
    w->state = W_DOWN;
    w->down_since = mono_now_ms();
    e = etcd_conn_copy(&w->k, &c->k);
    if (e != ETCD_OK) goto err;
    for (; w->nkeys < n; w->nkeys++) {
        wkey *k = &w->keys[w->nkeys];
        k->prefix = keys[w->nkeys].prefix;
        k->next_rev = keys[w->nkeys].start_revision;
        if (!(k->key = strdup(keys[w->nkeys].key))) break;
    }
    if (w->nkeys < n || !(w->multi = curl_multi_init())) {
        e = ETCD_ERR_NOMEM;
        goto err;
    }
    /* wait for "created", so that every change after open is seen */
    int64_t deadline = mono_now_ms() + c->timeout_ms;
    e = watch_pump(w, deadline, 1);
    if (e == ETCD_OK && !w->created_once) {
        e = ETCD_ERR_UNAVAILABLE;
        char why[sizeof(w->k.err)];
        snprintf(why, sizeof(why), "%s", w->k.err[0] ? w->k.err : "no answer");
        etcd_conn_seterr(&w->k, "watch %s%s: not created before the deadline; last: %s",
                         keys[0].key, n > 1 ? " (and more)" : "", why);
    }
    if (e != ETCD_OK) goto err;
    if (fp) {
        etcd_watch_close(w);
        return etcd_failpoint_ambiguous(c, "/v3/watch");
    }
    *out = w;
    return ETCD_OK;
err:
    snprintf(c->k.err, sizeof(c->k.err), "%s", w->k.err);
    etcd_watch_close(w);
    return e;
}

etcd_err etcd_watch_next(etcd_watch *w, int timeout_ms, etcd_event **events, size_t *n)
{
    *events = NULL;
    *n = 0;
    int64_t start = mono_now_ms();
    etcd_err e = watch_pump(w, start + (timeout_ms > 0 ? timeout_ms : 0), 0);
    if (w->nqueue) {
        *events = w->queue;
        *n = w->nqueue;
        w->last_rev = w->queue[w->nqueue - 1].kv.mod_revision;
        w->queue = NULL;
        w->nqueue = w->capqueue = 0;
        return ETCD_OK;
    }
    if (e != ETCD_OK) return e;
    if (w->pending != ETCD_OK) {
        e = w->pending;
        w->pending = ETCD_OK;
        return e;
    }
    if (w->state != W_LIVE && w->down_since && mono_now_ms() - w->down_since > w->timeout_ms) {
        char why[sizeof(w->k.err)];
        snprintf(why, sizeof(why), "%s", w->k.err);
        etcd_conn_seterr(&w->k, "watch: no endpoint for %" PRId64 " ms (still trying); last: %s",
                         mono_now_ms() - w->down_since, why);
        return ETCD_ERR_UNAVAILABLE;
    }
    return ETCD_OK;
}

int64_t etcd_watch_revision(const etcd_watch *w)
{
    return w->last_rev;
}

int64_t etcd_watch_next_revision(const etcd_watch *w, size_t i)
{
    return w && i < w->nkeys ? w->keys[i].next_rev : 0;
}

void etcd_watch_wakeup(etcd_watch *w)
{
    atomic_store(&w->woken, 1);
    curl_multi_wakeup(w->multi);
}

const char *etcd_watch_last_error(const etcd_watch *w)
{
    return w ? w->k.err : "";
}

void etcd_watch_close(etcd_watch *w)
{
    if (!w) return;
    stream_stop(w);
    if (w->multi) curl_multi_cleanup(w->multi);
    etcd_events_free(w->queue, w->nqueue);
    etcd_buf_free(&w->in);
    for (size_t i = 0; i < w->nkeys; i++)
        free(w->keys[i].key);
    etcd_conn_free(&w->k);
    free(w);
}
