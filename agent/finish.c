/* finish.c: how the agent ends: the job marked complete, and the exit.
 *
 * When every worker of a round exits 0, this node marks the job complete
 * in etcd (rdzv_finish) on a task, so the loop goes on meanwhile; its
 * answer decides the exit code. agent_finish is the one way out of the
 * loop, whatever ends it: it leaves the job (the only etcd call made on
 * the loop's own thread), says the exit line, and sets a->done. The
 * rendezvous handle a task holds (rz_job), for the finish and for the
 * failure reports (report.c), is made and freed here, below both.
 */
#include "agent_internal.h"

#include "ductile/log.h"
#include "ductile/rdzv.h"

#include <stdio.h>
#include <stdlib.h>

/* ---- the handle a task holds (a report's or the finish's) ---- */

rz_job *rz_job_new(agent *a)
{
    rz_job *j = calloc(1, sizeof(*j));
    if (!j) return NULL;
    j->rz = a->rz;
    rdzv_hold(a->rz);
    return j;
}

void rz_job_free(void *p)
{
    rz_job *j = p;
    rdzv_release(j->rz);
    for (int i = 0; i < j->nothers; i++)
        free(j->others[i]);
    free(j->others);
    free(j);
}

/* ---- the exit ---- */

void agent_finish(agent *a, int code, const char *how)
{
    if (a->done) return;
    if (agent_task_pending(&a->report))
        dlog_warn(&a->lg, "report_abandoned",
                  "the report that round %lld ended is still waiting on etcd; exiting without "
                  "its answer",
                  (long long)a->report_round);
    if (a->rz) {
        rdzv_err err = rdzv_leave(a->rz);
        if (err != RDZV_OK && err != RDZV_ERR_CLOSED)
            dlog_warn(&a->lg, "leave_failed", "could not leave the job cleanly: %s",
                      rdzv_strerror(err));
    }
    dlog_write(&a->lg, code == 0 ? DLOG_INFO : DLOG_ERROR, code == 0 ? "exit" : "exit_failed",
               "exiting with code %d: %s", code, how);
    a->exit_code = code;
    a->done = 1;
}

static void finish_main(void *arg, char *answer, size_t len)
{
    rz_job *j = arg;
    snprintf(answer, len, "%d", (int)rdzv_finish(j->rz));
}

static void finish_done(agent *a, rdzv_err err)
{
    if (a->state != AGENT_FINISHING) return; /* a signal ended the agent meanwhile */
    if (err == RDZV_OK || err == RDZV_ERR_JOB_DONE) {
        agent_finish(a, 0, "job complete");
        return;
    }
    /* The others would wait for a round forever: say so, fail. */
    snprintf(a->why, sizeof(a->why),
             "workers finished but the job could not be marked complete in etcd: %s",
             rdzv_strerror(err));
    agent_finish(a, 1, a->why);
}

/* Every worker exited 0: mark the job complete, on a task. */
void start_finish(agent *a)
{
    a->state = AGENT_FINISHING;
    rz_job *j = rz_job_new(a);
    if (!j || agent_task_start(&a->finish, finish_main, j, rz_job_free) != 0)
        finish_done(a, RDZV_ERR_NOMEM);
}

void on_finish(agent *a)
{
    char line[AGENT_TASK_ANSWER_MAX];
    int e = RDZV_ERR_NOMEM;
    if (agent_task_read(&a->finish, line, sizeof(line)) != 0 || sscanf(line, "%d", &e) != 1)
        e = RDZV_ERR_NOMEM;
    finish_done(a, (rdzv_err)e);
}
