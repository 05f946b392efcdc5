/* events.c: Kubernetes Events on the agent's Job.
 *
 * The loop calls agent_events_post(), which only takes a lock, applies the
 * rate limit and the dedupe, and queues; a thread of its own posts each
 * Event with libcurl (core/v1: POST /api/v1/namespaces/NS/events, the
 * service account's bearer token, read again for each post because
 * Kubernetes rotates it). So the API server can be slow, wrong or away
 * without the loop, or training, ever waiting on it. Events are a view,
 * not state: one that cannot be posted is dropped, and the first failure
 * is logged (once: a broken setup would otherwise log every few seconds).
 */
#include "events.h"

#include "ductile/clock.h"

#include <cJSON.h>
#include <curl/curl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SA_DIR "/var/run/secrets/kubernetes.io/serviceaccount"
#define EVENTS_QUEUE 8
#define EVENTS_HTTP_TIMEOUT_MS 3000L
#define EVENTS_REASON_MAX 64
#define EVENTS_MESSAGE_MAX 600
#define EVENTS_RECENT 16

typedef struct queued_event {
    int warning;
    char reason[EVENTS_REASON_MAX];
    char message[EVENTS_MESSAGE_MAX];
    time_t at;
} queued_event;

struct agent_events {
    const dlog *lg;
    char api[512], token_file[512], ca_file[512], ns[254], job[254], uid[128], node[254];
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    queued_event q[EVENTS_QUEUE];
    int head, n;
    int quit;
    double flush_until; /* once quit: posting stops at this mono_now_s() */
    double tokens, refilled_at;
    struct {
        char key[EVENTS_REASON_MAX + EVENTS_MESSAGE_MAX];
        double at;
    } recent[EVENTS_RECENT]; /* what was queued lately, for the dedupe */
    int next_recent;
    int failed_logged; /* the thread's own */
};

/* Copies a variable, or def when unset or empty; -1 when neither fits. */
static int env_or(char *dst, size_t len, const char *name, const char *def)
{
    const char *v = getenv(name);
    if (!v || !*v) v = def;
    if (!v || strlen(v) >= len) return -1;
    memcpy(dst, v, strlen(v) + 1);
    return 0;
}

/* The first line of a small file into dst; -1 when it cannot be read. */
static int read_line(const char *path, char *dst, size_t len)
{
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    int ok = fgets(dst, (int)len, f) != NULL;
    fclose(f);
    if (!ok) return -1;
    dst[strcspn(dst, "\r\n")] = 0;
    return dst[0] ? 0 : -1;
}

static void *events_main(void *arg);

agent_events *agent_events_start(const dlog *lg, const char *node, char *msg, size_t msglen)
{
    agent_events *e = calloc(1, sizeof(*e));
    if (!e) {
        snprintf(msg, msglen, "out of memory");
        return NULL;
    }
    e->lg = lg;
    snprintf(e->node, sizeof(e->node), "%s", node);
    char in_cluster[300] = "";
    const char *host = getenv("KUBERNETES_SERVICE_HOST"), *port = getenv("KUBERNETES_SERVICE_PORT");
    if (host && *host)
        snprintf(in_cluster, sizeof(in_cluster), "https://%s%s%s:%s", strchr(host, ':') ? "[" : "",
                 host, strchr(host, ':') ? "]" : "", port && *port ? port : "443");
    if (env_or(e->api, sizeof(e->api), "DUCTILE_K8S_API", in_cluster[0] ? in_cluster : NULL)) {
        snprintf(msg, msglen,
                 "no API server: set DUCTILE_K8S_API or run in a pod "
                 "(KUBERNETES_SERVICE_HOST)");
        goto err;
    }
    env_or(e->token_file, sizeof(e->token_file), "DUCTILE_K8S_TOKEN_FILE", SA_DIR "/token");
    env_or(e->ca_file, sizeof(e->ca_file), "DUCTILE_K8S_CA_FILE", SA_DIR "/ca.crt");
    if (env_or(e->ns, sizeof(e->ns), "DUCTILE_K8S_NAMESPACE", NULL) &&
        read_line(SA_DIR "/namespace", e->ns, sizeof(e->ns))) {
        snprintf(msg, msglen, "no namespace: set DUCTILE_K8S_NAMESPACE");
        goto err;
    }
    if (env_or(e->job, sizeof(e->job), "DUCTILE_K8S_JOB_NAME", NULL)) {
        snprintf(msg, msglen, "no Job to post on: set DUCTILE_K8S_JOB_NAME");
        goto err;
    }
    env_or(e->uid, sizeof(e->uid), "DUCTILE_K8S_JOB_UID", "");
    e->tokens = AGENT_EVENTS_PER_MIN;
    e->refilled_at = mono_now_s();
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    if (pthread_create(&e->thread, NULL, events_main, e) != 0) {
        snprintf(msg, msglen, "cannot start the events thread");
        pthread_cond_destroy(&e->cv);
        pthread_mutex_destroy(&e->mu);
        goto err;
    }
    return e;
err:
    free(e);
    return NULL;
}

/* 1 when this Event may be queued now: not seen lately, and a token left. */
static int admit(agent_events *e, const queued_event *ev, double now)
{
    char key[sizeof(e->recent[0].key)];
    snprintf(key, sizeof(key), "%s\n%s", ev->reason, ev->message);
    for (int i = 0; i < EVENTS_RECENT; i++)
        if (e->recent[i].at > 0 && now - e->recent[i].at < AGENT_EVENTS_DEDUPE_S &&
            strcmp(e->recent[i].key, key) == 0)
            return 0;
    e->tokens += (now - e->refilled_at) * AGENT_EVENTS_PER_MIN / 60.0;
    if (e->tokens > AGENT_EVENTS_PER_MIN) e->tokens = AGENT_EVENTS_PER_MIN;
    e->refilled_at = now;
    if (e->tokens < 1 || e->n == EVENTS_QUEUE) return 0;
    e->tokens -= 1;
    memcpy(e->recent[e->next_recent].key, key, sizeof(key));
    e->recent[e->next_recent].at = now;
    e->next_recent = (e->next_recent + 1) % EVENTS_RECENT;
    return 1;
}

void agent_events_post(agent_events *e, int warning, const char *reason, const char *fmt, ...)
{
    if (!e) return;
    queued_event ev = {.warning = warning, .at = time(NULL)};
    snprintf(ev.reason, sizeof(ev.reason), "%s", reason);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ev.message, sizeof(ev.message), fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&e->mu);
    if (!e->quit && admit(e, &ev, mono_now_s())) {
        e->q[(e->head + e->n) % EVENTS_QUEUE] = ev;
        e->n++;
        pthread_cond_signal(&e->cv);
    } else {
        dlog_debug(e->lg, "k8s_event_dropped", "event %s not posted (rate limit or repeat)",
                   reason);
    }
    pthread_mutex_unlock(&e->mu);
}

/* The Event's JSON (core/v1), or NULL. */
static char *event_json(const agent_events *e, const queued_event *ev)
{
    char stamp[32], name[300];
    struct tm tm;
    gmtime_r(&ev->at, &tm);
    strftime(stamp, sizeof(stamp), "%Y-%m-%dT%H:%M:%SZ", &tm);
    snprintf(name, sizeof(name), "%.240s.", e->job);
    cJSON *o = cJSON_CreateObject();
    cJSON *meta = cJSON_AddObjectToObject(o, "metadata");
    cJSON *obj = cJSON_AddObjectToObject(o, "involvedObject");
    cJSON *src = cJSON_AddObjectToObject(o, "source");
    if (!meta || !obj || !src) {
        cJSON_Delete(o);
        return NULL;
    }
    cJSON_AddStringToObject(o, "apiVersion", "v1");
    cJSON_AddStringToObject(o, "kind", "Event");
    cJSON_AddStringToObject(meta, "generateName", name);
    cJSON_AddStringToObject(meta, "namespace", e->ns);
    cJSON_AddStringToObject(obj, "apiVersion", "batch/v1");
    cJSON_AddStringToObject(obj, "kind", "Job");
    cJSON_AddStringToObject(obj, "name", e->job);
    cJSON_AddStringToObject(obj, "namespace", e->ns);
    if (e->uid[0]) cJSON_AddStringToObject(obj, "uid", e->uid);
    cJSON_AddStringToObject(o, "type", ev->warning ? "Warning" : "Normal");
    cJSON_AddStringToObject(o, "reason", ev->reason);
    cJSON_AddStringToObject(o, "message", ev->message);
    cJSON_AddStringToObject(o, "firstTimestamp", stamp);
    cJSON_AddStringToObject(o, "lastTimestamp", stamp);
    cJSON_AddNumberToObject(o, "count", 1);
    cJSON_AddStringToObject(src, "component", "ductile-agent");
    cJSON_AddStringToObject(src, "host", e->node);
    cJSON_AddStringToObject(o, "reportingComponent", "ductile-agent");
    cJSON_AddStringToObject(o, "reportingInstance", e->node);
    char *text = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return text;
}

static size_t discard(char *data, size_t size, size_t n, void *arg)
{
    (void)data;
    (void)arg;
    return size * n;
}

/* Posts one Event; 0, or -1 with why. */
static int post(agent_events *e, const queued_event *ev, char *why, size_t len)
{
    char token[4096] = "", auth[4200], url[1100];
    if (read_line(e->token_file, token, sizeof(token)) != 0) {
        snprintf(why, len, "cannot read the token %s", e->token_file);
        return -1;
    }
    char *body = event_json(e, ev);
    CURL *h = curl_easy_init();
    struct curl_slist *hdr = NULL;
    int rc = -1;
    if (!body || !h) {
        snprintf(why, len, "out of memory");
        goto out;
    }
    snprintf(url, sizeof(url), "%s/api/v1/namespaces/%s/events", e->api, e->ns);
    snprintf(auth, sizeof(auth), "Authorization: Bearer %s", token);
    hdr = curl_slist_append(hdr, auth);
    hdr = curl_slist_append(hdr, "Content-Type: application/json");
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdr);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, EVENTS_HTTP_TIMEOUT_MS);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, discard);
    if (strncmp(e->api, "https://", 8) == 0) curl_easy_setopt(h, CURLOPT_CAINFO, e->ca_file);
    CURLcode c = curl_easy_perform(h);
    long code = 0;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
    if (c != CURLE_OK)
        snprintf(why, len, "%s: %s", url, curl_easy_strerror(c));
    else if (code != 201 && code != 200)
        snprintf(why, len, "%s: HTTP %ld", url, code);
    else
        rc = 0;
out:
    curl_slist_free_all(hdr);
    if (h) curl_easy_cleanup(h);
    free(body);
    return rc;
}

static void *events_main(void *arg)
{
    agent_events *e = arg;
    pthread_setname_np(pthread_self(), "k8s-events");
    pthread_mutex_lock(&e->mu);
    for (;;) {
        while (!e->n && !e->quit)
            pthread_cond_wait(&e->cv, &e->mu);
        if (!e->n || (e->quit && mono_now_s() > e->flush_until)) break;
        queued_event ev = e->q[e->head];
        e->head = (e->head + 1) % EVENTS_QUEUE;
        e->n--;
        pthread_mutex_unlock(&e->mu);
        char why[1300];
        if (post(e, &ev, why, sizeof(why)) != 0 && !e->failed_logged) {
            e->failed_logged = 1;
            dlog_warn(e->lg, "k8s_events_failed",
                      "cannot post Kubernetes Events (%s); training goes on, later failures "
                      "are not logged",
                      why);
        }
        pthread_mutex_lock(&e->mu);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

void agent_events_stop(agent_events *e)
{
    if (!e) return;
    pthread_mutex_lock(&e->mu);
    e->quit = 1;
    e->flush_until = mono_now_s() + AGENT_EVENTS_FLUSH_S;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->thread, NULL);
    pthread_cond_destroy(&e->cv);
    pthread_mutex_destroy(&e->mu);
    free(e);
}
