/* master.c: a round's MASTER_PORT: node rank 0 publishes it, the others
 * wait for it on a detached thread that answers through a pipe.
 *
 * The thread's answer is one line: "ok PORT", or "ERR REASON" with ERR an
 * rdzv_err. A wait is bounded by its own deadline, and ends at once when
 * its round is superseded (the store's wait fails FENCED), so a forgotten
 * thread never outlives its purpose by long; the agent counts the ones
 * still running so that it leaves libcurl's globals alone while one is.
 */
#include "master.h"
#include "options.h"

#include "ductile/control.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define MASTER_KEY "master_port"

/* What one wait thread owns: copies, so the agent may forget it. */
typedef struct master_wait {
    int fd;            /* write end */
    atomic_int *alive; /* the agent_master's count of running threads */
    int timeout_ms;
    int64_t round;
    char *job;
    rdzv_etcd etcd; /* every string its own copy */
} master_wait;

static void master_wait_free(master_wait *mw)
{
    if (mw->fd >= 0) close(mw->fd);
    free(mw->job);
    free((char *)mw->etcd.endpoints);
#define FREE_CREDENTIAL(name, field) free((char *)mw->etcd.field);
    CTL_ENV_CREDENTIALS(FREE_CREDENTIAL)
#undef FREE_CREDENTIAL
    free(mw);
}

/* A copy of s (NULL stays NULL); sets *bad when out of memory. */
static char *dup_or_null(const char *s, int *bad)
{
    char *d = s ? strdup(s) : NULL;
    if (s && !d) *bad = 1;
    return d;
}

static void *master_wait_main(void *arg)
{
    master_wait *mw = arg;
    rdzv_store *st = NULL;
    char line[400];
    void *v = NULL;
    size_t len = 0;
    int port = 0;
    rdzv_err err = rdzv_store_open(&mw->etcd, mw->job, mw->round, &st);
    if (err == RDZV_OK) err = rdzv_store_wait(st, MASTER_KEY, mw->timeout_ms, &v, &len);
    if (err == RDZV_OK && agent_parse_int((const char *)v, 1, 65535, &port) != 0)
        err = RDZV_ERR_PROTOCOL;
    if (err == RDZV_OK)
        snprintf(line, sizeof(line), "ok %d\n", port);
    else
        snprintf(line, sizeof(line), "%d %s%s%s\n", (int)err, rdzv_strerror(err),
                 st && rdzv_store_last_error(st)[0] ? ": " : "",
                 st ? rdzv_store_last_error(st) : "");
    free(v);
    rdzv_store_close(st);
    /* A closed read end (the round is over) just fails the write. */
    ssize_t ignored = write(mw->fd, line, strlen(line));
    (void)ignored;
    atomic_int *alive = mw->alive;
    master_wait_free(mw);
    atomic_fetch_sub(alive, 1);
    return NULL;
}

void agent_master_init(agent_master *m)
{
    m->fd = -1;
    m->round = 0;
    atomic_init(&m->threads, 0);
}

void agent_master_wait_cancel(agent_master *m)
{
    if (m->fd >= 0) close(m->fd);
    m->fd = -1;
}

int agent_master_wait_start(agent_master *m, const rdzv_etcd *etcd, const char *job, int64_t round,
                            int timeout_ms)
{
    agent_master_wait_cancel(m);
    master_wait *mw = calloc(1, sizeof(*mw));
    int p[2] = {-1, -1};
    if (!mw || pipe2(p, O_CLOEXEC) != 0) {
        free(mw);
        return -1;
    }
    mw->fd = p[1];
    mw->round = round;
    mw->timeout_ms = timeout_ms;
    int bad = 0;
    mw->job = dup_or_null(job, &bad);
    mw->etcd.endpoints = dup_or_null(etcd->endpoints, &bad);
    mw->etcd.timeout_ms = etcd->timeout_ms;
#define COPY_CREDENTIAL(name, field) mw->etcd.field = dup_or_null(etcd->field, &bad);
    CTL_ENV_CREDENTIALS(COPY_CREDENTIAL)
#undef COPY_CREDENTIAL
    pthread_t th;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    mw->alive = &m->threads;
    atomic_fetch_add(&m->threads, 1);
    if (bad || pthread_create(&th, &at, master_wait_main, mw) != 0) {
        atomic_fetch_sub(&m->threads, 1);
        pthread_attr_destroy(&at);
        close(p[0]);
        master_wait_free(mw);
        return -1;
    }
    pthread_attr_destroy(&at);
    m->fd = p[0];
    m->round = round;
    return 0;
}

int agent_master_wait_read(agent_master *m, int *port, rdzv_err *err, char *why, size_t len)
{
    char line[400];
    ssize_t n = read(m->fd, line, sizeof(line) - 1);
    agent_master_wait_cancel(m);
    line[n > 0 ? n : 0] = 0;
    line[strcspn(line, "\n")] = 0;
    if (strncmp(line, "ok ", 3) == 0 && agent_parse_int(line + 3, 1, 65535, port) == 0) return 0;
    const char *sp = strchr(line, ' ');
    *err = line[0] ? (rdzv_err)atoi(line) : RDZV_ERR_CLOSED;
    snprintf(why, len, "%s", sp ? sp + 1 : "the wait ended without an answer");
    return -1;
}

int agent_master_publish(const rdzv_etcd *etcd, const char *job, int64_t round, int *port,
                         char *msg, size_t len)
{
    rdzv_store *st = NULL;
    rdzv_err err = rdzv_store_open(etcd, job, round, &st);
    if (err == RDZV_OK) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_ANY)};
        socklen_t salen = sizeof(sa);
        if (fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0 &&
            getsockname(fd, (struct sockaddr *)&sa, &salen) == 0)
            *port = ntohs(sa.sin_port);
        if (fd >= 0) close(fd);
        char val[16];
        int n = snprintf(val, sizeof(val), "%d", *port);
        err = rdzv_store_set(st, MASTER_KEY, val, (size_t)n);
    }
    if (err != RDZV_OK)
        snprintf(msg, len, "%s%s%s", rdzv_strerror(err),
                 st && rdzv_store_last_error(st)[0] ? ": " : "",
                 st ? rdzv_store_last_error(st) : "");
    rdzv_store_close(st);
    return err == RDZV_OK ? 0 : -1;
}
