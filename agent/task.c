/* task.c: a blocking call on a detached thread, answered through a pipe.
 *
 * The thread writes one line, shorter than PIPE_BUF so the write is whole,
 * to the pipe's write end and closes it; the loop reads it in one read once
 * the read end polls readable. Closing the read end is all it takes to
 * forget a task: the thread's write then fails, and nothing waits for it.
 */
#include "task.h"

#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

_Static_assert(AGENT_TASK_ANSWER_MAX + 1 <= PIPE_BUF, "an answer is written whole");

/* What one thread owns. */
typedef struct task_run {
    int fd; /* write end */
    atomic_int *threads;
    agent_task_fn fn;
    void *arg;
    void (*free_arg)(void *);
} task_run;

static void *task_main(void *p)
{
    task_run *tr = p;
    pthread_setname_np(pthread_self(), "agent-task");
    char line[AGENT_TASK_ANSWER_MAX + 1];
    line[0] = 0;
    tr->fn(tr->arg, line, AGENT_TASK_ANSWER_MAX);
    line[strcspn(line, "\n")] = 0;
    size_t n = strlen(line);
    line[n++] = '\n';
    /* A closed read end (the task was forgotten) just fails the write; the
     * agent ignores SIGPIPE (its signals are a signalfd; see main.c). */
    ssize_t ignored = write(tr->fd, line, n);
    (void)ignored;
    close(tr->fd);
    if (tr->free_arg) tr->free_arg(tr->arg);
    atomic_int *threads = tr->threads;
    free(tr);
    atomic_fetch_sub(threads, 1);
    return NULL;
}

void agent_task_init(agent_task *t, atomic_int *threads)
{
    t->fd = -1;
    t->threads = threads;
}

void agent_task_cancel(agent_task *t)
{
    if (t->fd >= 0) close(t->fd);
    t->fd = -1;
}

int agent_task_pending(const agent_task *t)
{
    return t->fd >= 0;
}

int agent_task_start(agent_task *t, agent_task_fn fn, void *arg, void (*free_arg)(void *))
{
    agent_task_cancel(t);
    task_run *tr = calloc(1, sizeof(*tr));
    int p[2] = {-1, -1};
    if (!tr || pipe2(p, O_CLOEXEC) != 0) {
        free(tr);
        if (free_arg) free_arg(arg);
        return -1;
    }
    *tr = (task_run){.fd = p[1], .threads = t->threads, .fn = fn, .arg = arg, .free_arg = free_arg};
    pthread_t th;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    atomic_fetch_add(t->threads, 1);
    int rc = pthread_create(&th, &at, task_main, tr);
    pthread_attr_destroy(&at);
    if (rc != 0) {
        atomic_fetch_sub(t->threads, 1);
        close(p[0]);
        close(p[1]);
        free(tr);
        if (free_arg) free_arg(arg);
        return -1;
    }
    t->fd = p[0];
    return 0;
}

int agent_task_read(agent_task *t, char *answer, size_t len)
{
    char line[AGENT_TASK_ANSWER_MAX + 2];
    ssize_t n = read(t->fd, line, sizeof(line) - 1);
    agent_task_cancel(t);
    line[n > 0 ? n : 0] = 0;
    int got = strchr(line, '\n') != NULL;
    line[strcspn(line, "\n")] = 0;
    snprintf(answer, len, "%s", got ? line : "");
    return got ? 0 : -1;
}
