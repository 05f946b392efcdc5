/* master.c: a round's MASTER_PORT: node rank 0 publishes it, the others
 * wait for it; each as a task (task.h) that answers in one line.
 *
 * The answer is "ok PORT", or "ERR REASON" with ERR an rdzv_err. A wait is
 * bounded by its own deadline, and ends at once when its round is
 * superseded (the store's wait fails FENCED); a publish by the store's
 * etcd deadline; so a forgotten thread never outlives its purpose by long.
 */
#include "master.h"
#include "options.h"

#include "ductile/control.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define MASTER_KEY "master_port"

/* What one task owns: copies, so the agent may forget it. */
typedef struct master_job {
    int timeout_ms; /* a wait's; 0 for a publish */
    int64_t round;
    char *job;
    rdzv_etcd etcd; /* every string its own copy */
} master_job;

static void master_job_free(void *p)
{
    master_job *mj = p;
    free(mj->job);
    free((char *)mj->etcd.endpoints);
#define FREE_CREDENTIAL(name, field) free((char *)mj->etcd.field);
    CTL_ENV_CREDENTIALS(FREE_CREDENTIAL)
#undef FREE_CREDENTIAL
    free(mj);
}

/* A copy of s (NULL stays NULL); sets *bad when out of memory. */
static char *dup_or_null(const char *s, int *bad)
{
    char *d = s ? strdup(s) : NULL;
    if (s && !d) *bad = 1;
    return d;
}

static master_job *master_job_new(const rdzv_etcd *etcd, const char *job, int64_t round,
                                  int timeout_ms)
{
    master_job *mj = calloc(1, sizeof(*mj));
    if (!mj) return NULL;
    mj->round = round;
    mj->timeout_ms = timeout_ms;
    int bad = 0;
    mj->job = dup_or_null(job, &bad);
    mj->etcd.endpoints = dup_or_null(etcd->endpoints, &bad);
    mj->etcd.timeout_ms = etcd->timeout_ms;
#define COPY_CREDENTIAL(name, field) mj->etcd.field = dup_or_null(etcd->field, &bad);
    CTL_ENV_CREDENTIALS(COPY_CREDENTIAL)
#undef COPY_CREDENTIAL
    if (!bad) return mj;
    master_job_free(mj);
    return NULL;
}

/* The answer line for err (and what the store said). */
static void answer_err(rdzv_err err, rdzv_store *st, char *answer, size_t len)
{
    snprintf(answer, len, "%d %s%s%s", (int)err, rdzv_strerror(err),
             st && rdzv_store_last_error(st)[0] ? ": " : "", st ? rdzv_store_last_error(st) : "");
}

static void master_wait_main(void *arg, char *answer, size_t len)
{
    master_job *mj = arg;
    rdzv_store *st = NULL;
    void *v = NULL;
    size_t vlen = 0;
    int port = 0;
    rdzv_err err = rdzv_store_open(&mj->etcd, mj->job, mj->round, &st);
    if (err == RDZV_OK) err = rdzv_store_wait(st, MASTER_KEY, mj->timeout_ms, &v, &vlen);
    if (err == RDZV_OK && agent_parse_int((const char *)v, 1, 65535, &port) != 0)
        err = RDZV_ERR_PROTOCOL;
    if (err == RDZV_OK)
        snprintf(answer, len, "ok %d", port);
    else
        answer_err(err, st, answer, len);
    free(v);
    rdzv_store_close(st);
}

/* A free port: bound, read back, closed; 0 when none could be had. */
static int pick_port(void)
{
    int port = 0;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_ANY)};
    socklen_t salen = sizeof(sa);
    if (fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0 &&
        getsockname(fd, (struct sockaddr *)&sa, &salen) == 0)
        port = ntohs(sa.sin_port);
    if (fd >= 0) close(fd);
    return port;
}

static void master_publish_main(void *arg, char *answer, size_t len)
{
    master_job *mj = arg;
    rdzv_store *st = NULL;
    int port = 0;
    rdzv_err err = rdzv_store_open(&mj->etcd, mj->job, mj->round, &st);
    if (err == RDZV_OK) {
        port = pick_port();
        char val[16];
        int n = snprintf(val, sizeof(val), "%d", port);
        err = rdzv_store_set(st, MASTER_KEY, val, (size_t)n);
    }
    if (err == RDZV_OK)
        snprintf(answer, len, "ok %d", port);
    else
        answer_err(err, st, answer, len);
    rdzv_store_close(st);
}

void agent_master_init(agent_master *m, atomic_int *threads)
{
    agent_task_init(&m->task, threads);
    m->round = 0;
    m->publishing = 0;
}

void agent_master_cancel(agent_master *m)
{
    agent_task_cancel(&m->task);
}

static int master_start(agent_master *m, agent_task_fn fn, const rdzv_etcd *etcd, const char *job,
                        int64_t round, int timeout_ms)
{
    agent_master_cancel(m);
    master_job *mj = master_job_new(etcd, job, round, timeout_ms);
    if (!mj || agent_task_start(&m->task, fn, mj, master_job_free) != 0) return -1;
    m->round = round;
    m->publishing = fn == master_publish_main;
    return 0;
}

int agent_master_publish_start(agent_master *m, const rdzv_etcd *etcd, const char *job,
                               int64_t round)
{
    return master_start(m, master_publish_main, etcd, job, round, 0);
}

int agent_master_wait_start(agent_master *m, const rdzv_etcd *etcd, const char *job, int64_t round,
                            int timeout_ms)
{
    return master_start(m, master_wait_main, etcd, job, round, timeout_ms);
}

int agent_master_read(agent_master *m, int *port, rdzv_err *err, char *why, size_t len)
{
    char line[AGENT_TASK_ANSWER_MAX];
    if (agent_task_read(&m->task, line, sizeof(line)) == 0 && strncmp(line, "ok ", 3) == 0 &&
        agent_parse_int(line + 3, 1, 65535, port) == 0)
        return 0;
    const char *sp = strchr(line, ' ');
    *err = line[0] ? (rdzv_err)atoi(line) : RDZV_ERR_CLOSED;
    snprintf(why, len, "%s", sp ? sp + 1 : "the task ended without an answer");
    return -1;
}
