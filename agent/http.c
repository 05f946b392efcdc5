/* http.c: /healthz, /readyz and /metrics, served by libmicrohttpd.
 *
 * The server runs in its own thread and never touches the agent's state: the
 * main loop publishes a snapshot under a mutex once per pass, and a request
 * reads a copy of it. /healthz fails when that snapshot goes stale, which is
 * what a liveness probe should catch: a loop that no longer turns.
 */
#include "http.h"
#include "progress.h"

#include "ductile/clock.h"
#include "ductile/rdzv.h"

#include <microhttpd.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A loop pass takes at most about a second; this much silence means stuck. */
#define AGENT_HTTP_STALE_S 30.0

struct agent_http {
    struct MHD_Daemon *daemon;
    pthread_mutex_t mu;
    agent_snapshot snap;
};

static enum MHD_Result reply(struct MHD_Connection *c, unsigned code, const char *type,
                             const char *body)
{
    struct MHD_Response *r =
        MHD_create_response_from_buffer(strlen(body), (void *)body, MHD_RESPMEM_MUST_COPY);
    if (!r) return MHD_NO;
    MHD_add_response_header(r, "Content-Type", type);
    enum MHD_Result ok = MHD_queue_response(c, code, r);
    MHD_destroy_response(r);
    return ok;
}

/* The labels every per-worker series carries. */
#define WORKER_LABELS "rank=\"%d\",local_rank=\"%d\""

static int metrics_text(const agent_snapshot *s, char *out, size_t len)
{
    size_t n = 0;
#define EMIT(...)                                                                                  \
    do {                                                                                           \
        int w_ = snprintf(out + n, len - n, __VA_ARGS__);                                          \
        if (w_ < 0 || (size_t)w_ >= len - n) return -1;                                            \
        n += (size_t)w_;                                                                           \
    } while (0)
    EMIT("# HELP ductile_round Current rendezvous round of this node (0 before the first).\n"
         "# TYPE ductile_round gauge\nductile_round %lld\n",
         (long long)s->round);
    EMIT("# HELP ductile_members Nodes in the current round.\n"
         "# TYPE ductile_members gauge\nductile_members %d\n",
         s->members);
    EMIT("# HELP ductile_world_size Workers in the current round, all nodes.\n"
         "# TYPE ductile_world_size gauge\nductile_world_size %d\n",
         s->world_size);
    EMIT("# HELP ductile_restarts_total Job-wide restarts after failures.\n"
         "# TYPE ductile_restarts_total counter\nductile_restarts_total %lld\n",
         (long long)s->restarts);
    EMIT("# HELP ductile_workers_running Worker processes of this node that are running.\n"
         "# TYPE ductile_workers_running gauge\nductile_workers_running %d\n",
         s->workers_running);
    EMIT("# HELP ductile_rendezvous_seconds_total Seconds spent waiting for rounds to form.\n"
         "# TYPE ductile_rendezvous_seconds_total counter\n"
         "ductile_rendezvous_seconds_total %.3f\n",
         s->rdzv_seconds);
    EMIT("# HELP ductile_membership_changes_total Rounds this node saw end, by cause.\n"
         "# TYPE ductile_membership_changes_total counter\n");
    for (int c = 1; c < RDZV_CAUSE_COUNT; c++)
        EMIT("ductile_membership_changes_total{cause=\"%s\"} %lld\n", rdzv_cause_name(c),
             (long long)s->changes[c]);
    EMIT("# HELP ductile_worker_hangs_total Workers of this node the progress watchdog killed.\n"
         "# TYPE ductile_worker_hangs_total counter\nductile_worker_hangs_total %lld\n",
         (long long)s->hangs);
/* One series per running worker w (when cond): name{rank,local_rank} value. */
#define EMIT_WORKERS(name, cond, fmt, value)                                                       \
    for (int i = 0; i < s->nworkers; i++) {                                                        \
        const agent_worker_snapshot *w = &s->workers[i];                                           \
        if (cond) EMIT(name "{" WORKER_LABELS "} " fmt "\n", w->rank, w->local_rank, value);       \
    }
    EMIT("# HELP ductile_worker_step Last step a running worker reported.\n"
         "# TYPE ductile_worker_step gauge\n");
    EMIT_WORKERS("ductile_worker_step", 1, "%lld", (long long)w->step);
    EMIT("# HELP ductile_worker_last_progress_timestamp_seconds Unix time of a running worker's "
         "last progress (a new step or phase; 0 before any).\n"
         "# TYPE ductile_worker_last_progress_timestamp_seconds gauge\n");
    for (int i = 0; i < s->nworkers; i++)
        EMIT("ductile_worker_last_progress_timestamp_seconds{rank=\"%d\",local_rank=\"%d\","
             "phase=\"%s\"} %.3f\n",
             s->workers[i].rank, s->workers[i].local_rank, s->workers[i].phase,
             s->workers[i].progress_unix);
    EMIT("# HELP ductile_worker_last_step_timestamp_seconds Unix time of a running worker's last "
         "`step` report (0 before one).\n"
         "# TYPE ductile_worker_last_step_timestamp_seconds gauge\n");
    EMIT_WORKERS("ductile_worker_last_step_timestamp_seconds", 1, "%.3f", w->step_unix);
    EMIT("# HELP ductile_worker_samples_total Samples a running worker reported processing (its "
         "own share; sum over workers for the job), since this process of it started.\n"
         "# TYPE ductile_worker_samples_total counter\n");
    EMIT_WORKERS("ductile_worker_samples_total", 1, "%lld", (long long)w->samples_total);
    EMIT("# HELP ductile_worker_samples_per_second Samples per second of a running worker, from "
         "its step reports of the last %.0f s (at most the last %d): the samples between the "
         "oldest and the newest over the time between them; 0 with fewer than two.\n"
         "# TYPE ductile_worker_samples_per_second gauge\n",
         AGENT_RATE_WINDOW_S, AGENT_RATE_POINTS);
    EMIT_WORKERS("ductile_worker_samples_per_second", 1, "%.3f", w->samples_per_second);
    EMIT("# HELP ductile_worker_loss Training loss a running worker reported with its last step "
         "(absent for a worker that reports none).\n"
         "# TYPE ductile_worker_loss gauge\n");
    EMIT_WORKERS("ductile_worker_loss", w->has_loss, "%.9g", w->loss);
#undef EMIT_WORKERS
#undef EMIT
    return 0;
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *c, const char *url,
                              const char *method, const char *version, const char *data,
                              size_t *data_size, void **state)
{
    (void)version;
    (void)data;
    (void)data_size;
    (void)state;
    agent_http *h = cls;
    if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0)
        return reply(c, MHD_HTTP_METHOD_NOT_ALLOWED, "text/plain", "method not allowed\n");
    agent_snapshot s;
    pthread_mutex_lock(&h->mu);
    s = h->snap;
    pthread_mutex_unlock(&h->mu);
    if (strcmp(url, "/healthz") == 0) {
        if (mono_now_s() - s.heartbeat > AGENT_HTTP_STALE_S)
            return reply(c, MHD_HTTP_SERVICE_UNAVAILABLE, "text/plain", "agent loop stalled\n");
        return reply(c, MHD_HTTP_OK, "text/plain", "ok\n");
    }
    if (strcmp(url, "/readyz") == 0) {
        if (!s.ready)
            return reply(c, MHD_HTTP_SERVICE_UNAVAILABLE, "text/plain",
                         "not ready: no frozen round with workers running\n");
        return reply(c, MHD_HTTP_OK, "text/plain", "ready\n");
    }
    if (strcmp(url, "/metrics") == 0) {
        size_t cap = 8192 + 1024 * (size_t)s.nworkers;
        char *body = malloc(cap);
        if (!body || metrics_text(&s, body, cap) != 0) {
            free(body);
            return reply(c, MHD_HTTP_INTERNAL_SERVER_ERROR, "text/plain", "metrics too large\n");
        }
        enum MHD_Result r = reply(c, MHD_HTTP_OK, "text/plain; version=0.0.4", body);
        free(body);
        return r;
    }
    return reply(c, MHD_HTTP_NOT_FOUND, "text/plain", "not found\n");
}

agent_http *agent_http_start(int port, char *msg, size_t msglen)
{
    agent_http *h = calloc(1, sizeof(*h));
    if (!h) {
        snprintf(msg, msglen, "out of memory");
        return NULL;
    }
    pthread_mutex_init(&h->mu, NULL);
    h->snap.heartbeat = mono_now_s();
    h->daemon = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG,
                                 (uint16_t)port, NULL, NULL, handle, h,
                                 MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)10, MHD_OPTION_END);
    if (!h->daemon) {
        snprintf(msg, msglen, "cannot serve HTTP on port %d (in use?)", port);
        pthread_mutex_destroy(&h->mu);
        free(h);
        return NULL;
    }
    return h;
}

void agent_http_publish(agent_http *h, const agent_snapshot *s)
{
    if (!h) return;
    pthread_mutex_lock(&h->mu);
    h->snap = *s;
    pthread_mutex_unlock(&h->mu);
}

void agent_http_stop(agent_http *h)
{
    if (!h) return;
    MHD_stop_daemon(h->daemon);
    pthread_mutex_destroy(&h->mu);
    free(h);
}
