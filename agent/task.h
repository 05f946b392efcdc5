/* task.h: one blocking call off the agent's loop (private to agent/).
 *
 * A task runs a function on a detached thread of its own, which owns its
 * argument, and answers with one line through a pipe the loop polls. The
 * loop can forget a task whose answer no longer matters (its round is
 * over): the thread ends by itself and its answer goes nowhere. Every
 * thread still running is counted in one counter the agent keeps, so that
 * it leaves libcurl's globals alone while one is. The MASTER_PORT wait and
 * publish (master.c), the failure reports (report.c) and the job's
 * completion (finish.c) are tasks.
 */
#ifndef DUCTILE_AGENT_TASK_H
#define DUCTILE_AGENT_TASK_H

#include <stdatomic.h>
#include <stddef.h>

/* An answer line, newline excluded, fits this (and a pipe writes it whole). */
#define AGENT_TASK_ANSWER_MAX 512

/* Runs on the task's thread: does the blocking work and writes its answer. */
typedef void (*agent_task_fn)(void *arg, char *answer, size_t len);

typedef struct agent_task {
    int fd;              /* the running task's answer (poll it for POLLIN), or -1 */
    atomic_int *threads; /* the agent's count of task threads still running */
} agent_task;

/* An idle task whose threads are counted in *threads. */
void agent_task_init(agent_task *t, atomic_int *threads);

/* Forgets a task already running, then runs fn(arg) on a thread; free_arg
 * (may be NULL) frees arg once fn has answered. 0, or -1 when no thread
 * could start (arg is freed then too). */
int agent_task_start(agent_task *t, agent_task_fn fn, void *arg, void (*free_arg)(void *));

/* 1 while a task runs whose answer the loop has not read. */
int agent_task_pending(const agent_task *t);

/* Reads the answer once t->fd is readable and forgets the task. 0, or -1
 * when the thread ended without one (answer is then empty). */
int agent_task_read(agent_task *t, char *answer, size_t len);

/* Forgets the running task (its thread ends by itself). */
void agent_task_cancel(agent_task *t);

#endif
