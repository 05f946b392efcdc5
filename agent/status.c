/* status.c: `ductile-agent status` and `ductile-agent reset`: a job in etcd,
 * and what each member's agent says about its workers' progress.
 *
 *   ductile-agent status --rdzv-endpoint URL --rdzv-id JOB [--json]
 *                        [--metrics-port PORT]
 *   ductile-agent reset  --rdzv-endpoint URL --rdzv-id JOB
 *
 * status: one read through rdzv_get_status(); text for people, --json for
 * scripts (the object rdzv_status_json() makes). With --metrics-port (or
 * DUCTILE_HTTP_PORT), the /metrics page of every member of the round is
 * read at its address, all at once with a short timeout, and each node's
 * step, samples/s, loss and age of its last step are shown: progress is
 * asked of the agents when someone looks, never written to etcd (see
 * docs/design.md). Exit 0 when the job was read (even when it does not
 * exist: state "none"; an agent that does not answer is shown so), 1 when
 * etcd could not be read, 2 on bad flags.
 *
 * reset: deletes the job's keys (rdzv_reset()), so that its id starts over
 * as a new job: a job that ended (done or failed) keeps its state in etcd,
 * and agents started again under its id would find it ended at once. Exit 0
 * when the keys are gone (or there were none), 1 when etcd could not be
 * written, 2 on bad flags, 3 when an agent of the job is alive (nothing is
 * deleted then).
 */
#include "status.h"

#include "ductile/rdzv.h"

#include <cJSON.h>
#include <curl/curl.h>
#include <math.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* How long the whole progress read may take, and how many agents at once. */
#define STATUS_HTTP_TIMEOUT_MS 3000L
#define STATUS_HTTP_PARALLEL 64L
/* A /metrics page larger than this is cut (ample for AGENT_SNAPSHOT_WORKERS). */
#define STATUS_PAGE_MAX (1 << 20)

/* One node's progress, summed over its workers from its /metrics page. */
typedef struct node_progress {
    char *page;
    size_t len;
    char error[CURL_ERROR_SIZE];
    int read;         /* the page came back (HTTP 200) */
    int workers;      /* with a step reported */
    int64_t step;     /* the highest */
    double rate;      /* samples/s, summed */
    double loss;      /* mean over the workers that report one */
    int nloss;        /* how many do */
    double last_step; /* Unix time of the newest step, 0: none */
} node_progress;

static size_t page_write(char *data, size_t size, size_t n, void *arg)
{
    node_progress *p = arg;
    size_t len = size * n;
    if (p->len + len > STATUS_PAGE_MAX) return 0;
    char *grown = realloc(p->page, p->len + len + 1);
    if (!grown) return 0;
    memcpy(grown + p->len, data, len);
    p->page = grown;
    p->len += len;
    p->page[p->len] = 0;
    return len;
}

/* Sums the per-worker series of one page (http.c writes them). */
static void page_parse(node_progress *p)
{
    for (char *line = p->page, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        char *labels_end = strchr(line, '}');
        if (strncmp(line, "ductile_worker_", 15) != 0 || !labels_end) continue;
        double v = strtod(labels_end + 1, NULL);
        const char *name = line + 15;
        if (strncmp(name, "step{", 5) == 0) {
            if (p->workers == 0 || (int64_t)v > p->step) p->step = (int64_t)v;
            p->workers++;
        } else if (strncmp(name, "samples_per_second{", 19) == 0) {
            p->rate += v;
        } else if (strncmp(name, "loss{", 5) == 0) {
            p->loss += v;
            p->nloss++;
        } else if (strncmp(name, "last_step_timestamp_seconds{", 28) == 0 && v > p->last_step) {
            p->last_step = v;
        }
    }
    if (p->nloss) p->loss /= p->nloss;
}

/* Reads every member's /metrics at once; a node that does not answer keeps
 * its error. Knowingly simple: one pass over a multi handle, each transfer
 * bounded by STATUS_HTTP_TIMEOUT_MS. */
static void read_progress(const rdzv_status *s, int port, node_progress *out)
{
    CURLM *multi = curl_multi_init();
    CURL **easy = calloc((size_t)s->nmembers, sizeof(CURL *));
    if (!multi || !easy) {
        for (int i = 0; i < s->nmembers; i++)
            snprintf(out[i].error, sizeof(out[i].error), "out of memory");
        goto done;
    }
    curl_multi_setopt(multi, CURLMOPT_MAX_TOTAL_CONNECTIONS, STATUS_HTTP_PARALLEL);
    for (int i = 0; i < s->nmembers; i++) {
        char url[400];
        const char *addr = s->members[i].addr;
        int v6 = strchr(addr, ':') != NULL;
        snprintf(url, sizeof(url), "http://%s%s%s:%d/metrics", v6 ? "[" : "", addr, v6 ? "]" : "",
                 port);
        easy[i] = curl_easy_init();
        if (!easy[i]) {
            snprintf(out[i].error, sizeof(out[i].error), "out of memory");
            continue;
        }
        curl_easy_setopt(easy[i], CURLOPT_URL, url);
        curl_easy_setopt(easy[i], CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(easy[i], CURLOPT_TIMEOUT_MS, STATUS_HTTP_TIMEOUT_MS);
        curl_easy_setopt(easy[i], CURLOPT_WRITEFUNCTION, page_write);
        curl_easy_setopt(easy[i], CURLOPT_WRITEDATA, &out[i]);
        curl_easy_setopt(easy[i], CURLOPT_ERRORBUFFER, out[i].error);
        curl_easy_setopt(easy[i], CURLOPT_PRIVATE, &out[i]);
        curl_multi_add_handle(multi, easy[i]);
    }
    int running = 1;
    while (running) {
        if (curl_multi_perform(multi, &running) != CURLM_OK) break;
        if (running && curl_multi_poll(multi, NULL, 0, 200, NULL) != CURLM_OK) break;
    }
    CURLMsg *m;
    int left;
    while ((m = curl_multi_info_read(multi, &left))) {
        node_progress *p = NULL;
        long code = 0;
        curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, (char **)&p);
        curl_easy_getinfo(m->easy_handle, CURLINFO_RESPONSE_CODE, &code);
        if (m->msg != CURLMSG_DONE || !p) continue;
        if (m->data.result != CURLE_OK) {
            if (!p->error[0])
                snprintf(p->error, sizeof(p->error), "%s", curl_easy_strerror(m->data.result));
        } else if (code != 200) {
            snprintf(p->error, sizeof(p->error), "HTTP %ld", code);
        } else {
            p->read = 1;
            page_parse(p);
        }
    }
done:
    for (int i = 0; easy && i < s->nmembers; i++) {
        if (!easy[i]) continue;
        curl_multi_remove_handle(multi, easy[i]);
        curl_easy_cleanup(easy[i]);
    }
    free(easy);
    if (multi) curl_multi_cleanup(multi);
}

static double unix_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (double)t.tv_sec + t.tv_nsec / 1e9;
}

/* One node's progress, for people. */
static void print_progress(const node_progress *p, double now)
{
    if (!p->read) {
        printf("      progress: not read (%s)\n", p->error[0] ? p->error : "no answer");
    } else if (!p->workers || p->last_step <= 0) {
        printf("      progress: no step yet\n");
    } else {
        char loss[32] = "-";
        if (p->nloss) snprintf(loss, sizeof(loss), "%.4g", p->loss);
        printf("      step %lld  %.1f samples/s  loss %s  last step %.1fs ago\n",
               (long long)p->step, p->rate, loss, now - p->last_step);
    }
}

static void status_usage(FILE *f, const char *cmd)
{
    int status = strcmp(cmd, "status") == 0;
    fprintf(f,
            "usage: ductile-agent %s --rdzv-endpoint URL[,URL...] --rdzv-id JOB%s\n"
            "                     [--etcd-cacert F --etcd-cert F --etcd-key F]\n"
            "                     [--etcd-user U --etcd-password P]\n"
            "%s"
            "Flags also come from DUCTILE_RDZV_ENDPOINT, DUCTILE_RDZV_ID, DUCTILE_ETCD_*%s.\n",
            cmd, status ? " [--json] [--metrics-port PORT]" : "",
            status ? "With --metrics-port, each member's /metrics at its address gives its\n"
                     "progress (step, samples/s, loss, age of the last step).\n"
                   : "",
            status ? ", DUCTILE_HTTP_PORT" : "");
}

/* The flags status and reset share. Returns 0, 1 after --help, or 2 on a bad
 * flag (reported); status only (json and port not NULL): --json sets *json,
 * --metrics-port (or DUCTILE_HTTP_PORT) *port. */
static int job_flags(int argc, char **argv, rdzv_etcd *etcd, const char **job, int *json, int *port)
{
    const char *cmd = argv[0];
    const char *port_text = port ? getenv("DUCTILE_HTTP_PORT") : NULL;
    etcd->endpoints = getenv("DUCTILE_RDZV_ENDPOINT");
    etcd->cacert = getenv("DUCTILE_ETCD_CACERT");
    etcd->cert = getenv("DUCTILE_ETCD_CERT");
    etcd->key = getenv("DUCTILE_ETCD_KEY");
    etcd->user = getenv("DUCTILE_ETCD_USER");
    etcd->password = getenv("DUCTILE_ETCD_PASSWORD");
    *job = getenv("DUCTILE_RDZV_ID");
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            status_usage(stdout, cmd);
            return 1;
        }
        if (json && strcmp(a, "--json") == 0) {
            *json = 1;
            continue;
        }
        const char *names[] = {"--rdzv-endpoint", "--rdzv-id",      "--etcd-cacert",
                               "--etcd-cert",     "--etcd-key",     "--etcd-user",
                               "--etcd-password", "--metrics-port", NULL};
        const char **dest[] = {&etcd->endpoints, job,         &etcd->cacert,   &etcd->cert,
                               &etcd->key,       &etcd->user, &etcd->password, &port_text};
        int k = 0;
        const char *val = NULL;
        for (; names[k]; k++) {
            size_t n = strlen(names[k]);
            if (strncmp(a, names[k], n) == 0 && (a[n] == 0 || a[n] == '=')) {
                val = a[n] == '=' ? a + n + 1 : (i + 1 < argc ? argv[++i] : NULL);
                break;
            }
        }
        if (!names[k] || (!port && dest[k] == &port_text)) {
            fprintf(stderr, "ductile-agent %s: unknown flag '%s' (see --help)\n", cmd, a);
            return 2;
        }
        if (!val) {
            fprintf(stderr, "ductile-agent %s: %s needs a value\n", cmd, names[k]);
            return 2;
        }
        *dest[k] = val;
    }
    if (!etcd->endpoints || !*etcd->endpoints) {
        fprintf(stderr, "ductile-agent %s: --rdzv-endpoint is required\n", cmd);
        return 2;
    }
    if (!*job || !rdzv_job_id_valid(*job)) {
        fprintf(stderr, "ductile-agent %s: --rdzv-id must match [a-z0-9][a-z0-9-]{0,62}\n", cmd);
        return 2;
    }
    if (port && port_text && *port_text) {
        char *end = NULL;
        long v = strtol(port_text, &end, 10);
        if (*end || v < 0 || v > 65535) {
            fprintf(stderr, "ductile-agent %s: --metrics-port must be 0..65535, not '%s'\n", cmd,
                    port_text);
            return 2;
        }
        *port = (int)v;
    }
    return 0;
}

/* Adds each member's progress to the --json object (members[i].progress). */
static char *progress_json(char *text, const rdzv_status *s, const node_progress *p, double now)
{
    cJSON *root = cJSON_Parse(text);
    cJSON *members = cJSON_GetObjectItemCaseSensitive(root, "members");
    for (int i = 0; i < s->nmembers && cJSON_IsArray(members); i++) {
        cJSON *m = cJSON_GetArrayItem(members, i);
        cJSON *o = cJSON_CreateObject();
        if (!m || !o || !cJSON_AddItemToObject(m, "progress", o)) {
            cJSON_Delete(o);
            continue;
        }
        cJSON_AddBoolToObject(o, "read", p[i].read);
        if (!p[i].read) {
            cJSON_AddStringToObject(o, "error", p[i].error[0] ? p[i].error : "no answer");
            continue;
        }
        if (!p[i].workers || p[i].last_step <= 0) continue;
        cJSON_AddNumberToObject(o, "step", (double)p[i].step);
        cJSON_AddNumberToObject(o, "samples_per_second", p[i].rate);
        if (p[i].nloss) cJSON_AddNumberToObject(o, "loss", p[i].loss);
        cJSON_AddNumberToObject(o, "last_step_age_seconds", now - p[i].last_step);
    }
    char *out = root ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    if (!out) return text;
    free(text);
    return out;
}

static void print_text(const char *job, const rdzv_status *s, const node_progress *p)
{
    double now = unix_now();
    printf("job %s: %s\n", job, s->job_state);
    if (s->reason[0]) printf("reason: %s\n", s->reason);
    if (s->install[0]) printf("install: %s (the install id its state records)\n", s->install);
    printf("round %lld (%s), %d members, restarts %lld of %d\n", (long long)s->round,
           s->round_state[0] ? s->round_state : "none", s->nmembers, (long long)s->restarts,
           s->max_restarts);
    for (int i = 0; i < s->nmembers; i++) {
        const rdzv_member *m = &s->members[i];
        printf("  rank %d  %-24s %-16s ranks %d..%d\n", m->rank, m->node_id, m->addr,
               m->first_global_rank, m->first_global_rank + m->local_world_size - 1);
        if (p) print_progress(&p[i], now);
    }
    printf("live nodes %d:", s->nnodes);
    for (int i = 0; i < s->nnodes; i++)
        printf(" %s", s->nodes[i]);
    printf("\nwaiting %d:", s->nwaiting);
    for (int i = 0; i < s->nwaiting; i++)
        printf(" %s", s->waiting[i]);
    printf("\n");
}

int agent_status_main(int argc, char **argv)
{
    rdzv_etcd etcd = {0};
    const char *job = NULL;
    int json = 0, port = 0;
    int rc = job_flags(argc, argv, &etcd, &job, &json, &port);
    if (rc != 0) return rc == 1 ? 0 : rc;
    rdzv_status st;
    memset(&st, 0, sizeof(st));
    char msg[RDZV_MSG_MAX] = "";
    rdzv_err err = rdzv_get_status(&etcd, job, &st, msg);
    if (err != RDZV_OK) {
        fprintf(stderr, "ductile-agent status: %s: %s\n", rdzv_strerror(err), msg);
        return 1;
    }
    /* rdzv_get_status() has set libcurl's globals up: the reads below share them. */
    rc = 0;
    node_progress *progress = NULL;
    if (port > 0 && st.nmembers > 0) {
        progress = calloc((size_t)st.nmembers, sizeof(*progress));
        if (progress) read_progress(&st, port, progress);
    }
    if (json) {
        char *text = rdzv_status_json(&st);
        if (text && progress) text = progress_json(text, &st, progress, unix_now());
        if (text)
            printf("%s\n", text);
        else
            fprintf(stderr, "ductile-agent status: out of memory\n");
        rc = text ? 0 : 1;
        free(text);
    } else {
        print_text(job, &st, progress);
    }
    for (int i = 0; progress && i < st.nmembers; i++)
        free(progress[i].page);
    free(progress);
    rdzv_status_free(&st);
    return rc;
}

int agent_reset_main(int argc, char **argv)
{
    rdzv_etcd etcd = {0};
    const char *job = NULL;
    int rc = job_flags(argc, argv, &etcd, &job, NULL, NULL);
    if (rc != 0) return rc == 1 ? 0 : rc;
    char msg[RDZV_MSG_MAX] = "";
    int live = 0;
    int64_t deleted = 0;
    rdzv_err err = rdzv_reset(&etcd, job, &live, &deleted, msg);
    if (err != RDZV_OK) {
        fprintf(stderr, "ductile-agent reset: %s: %s\n", rdzv_strerror(err), msg);
        return 1;
    }
    if (live > 0) {
        fprintf(stderr,
                "ductile-agent reset: job %s has %d live node(s) registered: stop its agents "
                "first; nothing deleted\n",
                job, live);
        return 3;
    }
    printf("job %s: %" PRId64 " key(s) deleted\n", job, deleted);
    return 0;
}
