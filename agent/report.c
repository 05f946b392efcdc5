/* report.c: the failure reports: the failure-counting rule's agent side.
 *
 * A round ends for this node when one of its workers fails or loses a
 * peer; the node then tells etcd why, once a round (rdzv.h, the counting
 * rule): first hand, a crash of its own worker, counted against the job's
 * restart limit; else a lost peer, a membership change. The write runs on
 * a task (report_main) and the loop goes on; report_done takes the answer.
 * The one idea: a worker's error exit may be a peer's death seen from
 * here, so such a report first asks whether one of the round's other
 * agents is gone, and is then made as a lost peer, not counted.
 */
#include "agent_internal.h"

#include "ductile/control.h"
#include "ductile/log.h"
#include "ductile/rdzv.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

/* The node ids of the round's other members, for the job's check. */
static int rz_job_others(rz_job *j, const rdzv_round *r)
{
    j->others = calloc((size_t)r->nmembers + 1, sizeof(char *));
    if (!j->others) return -1;
    for (int i = 0; i < r->nmembers; i++) {
        if (i == r->my_rank || !r->members[i].node_id) continue;
        j->others[j->nothers] = strdup(r->members[i].node_id);
        if (!j->others[j->nothers]) return -1;
        j->nothers++;
    }
    return 0;
}

/* The report's answer: "ERR RESTARTS COUNTED GONE NAMES". A worker's error
 * exit is first checked against the round's other members: if one of
 * their agents is gone (a pod lost), the exit was its loss, reported as a
 * lost peer. A lost peer is reported first and checked after: the report
 * ends the round at once, the check (revoking a dead member's lease) lets
 * the next one freeze without waiting for that member. */
static void report_main(void *arg, char *answer, size_t len)
{
    rz_job *j = arg;
    int64_t restarts = j->restarts;
    int gone = 0;
    char names[300] = "";
    const char *const *others = (const char *const *)j->others;
    if (j->suspect)
        (void)rdzv_check_members(j->rz, others, j->nothers, RDZV_PROBE_TIMEOUT_MS, &gone, names,
                                 sizeof(names));
    int first_hand = j->first_hand && gone == 0;
    int counted = first_hand;
    rdzv_err err = first_hand ? rdzv_report_failure(j->rz, j->reason, &restarts)
                              : rdzv_report_peer_lost(j->rz, j->reason, &restarts, &counted);
    if (!j->first_hand)
        (void)rdzv_check_members(j->rz, others, j->nothers, RDZV_PROBE_TIMEOUT_MS, &gone, names,
                                 sizeof(names));
    snprintf(answer, len, "%d %lld %d %d %s", (int)err, (long long)restarts, counted, gone, names);
}

/* The JobFailed Event, once, from node rank 0 of the last round: it learns
 * of the failure from its own report or from etcd, whichever comes first
 * (an agent can exit on either without the other). */
void post_job_failed(agent *a)
{
    if (a->job_failed_posted || a->round.number == 0 || a->round.my_rank != 0) return;
    a->job_failed_posted = 1;
    agent_events_post(a->events, 1, "JobFailed", "%s", a->why);
}

/* What the report of a->report_round came back with. A report that cannot
 * be made ends the agent, whatever round it is in by then: it must not
 * idle, healthy-looking, in a round nobody else knows is broken. */
static void report_done(agent *a, rdzv_err err, int64_t restarts, int counted, int gone,
                        const char *names)
{
    const char *reason = a->report_reason;
    if (gone > 0)
        dlog_info(&a->lg, "members_gone", "round %lld: %d member%s gone, lease revoked: %s%s",
                  (long long)a->report_round, gone, gone == 1 ? "" : "s", names,
                  a->report_suspect ? "; the worker's exit was a lost peer" : "");
    if (err == RDZV_OK) {
        if (restarts > a->restarts) a->restarts = restarts; /* the job-wide count only grows */
        if (counted) {
            dlog_warn(&a->lg, "failure_reported",
                      "failure recorded: job-wide restarts now %lld of %d", (long long)restarts,
                      a->round.max_restarts);
            agent_events_post(a->events, 1, "RestartCounted",
                              "round %lld: failure on node %s, job-wide restarts now %lld of %d: "
                              "%.400s",
                              (long long)a->report_round, a->o->node_id, (long long)restarts,
                              a->round.max_restarts, reason);
        } else
            dlog_info(&a->lg, "peer_lost_reported",
                      "lost peer recorded as a membership change (restarts stay %lld of %d)",
                      (long long)restarts, a->round.max_restarts);
    } else if (err == RDZV_ERR_JOB_FAILED) {
        if (restarts > a->restarts) a->restarts = restarts;
        snprintf(a->why, sizeof(a->why), "job failed: restart limit %d reached (last: %.340s)",
                 a->round.max_restarts, reason);
        a->exit_after_stop = AGENT_EXIT_JOB_FAILED;
        post_job_failed(a);
        /* Workers already gone (the loop went on meanwhile): nothing is
         * left to stop. */
        if (!workers_alive(a) && a->state != AGENT_SHUTDOWN)
            agent_finish(a, a->exit_after_stop, a->why);
    } else if (err != RDZV_ERR_JOB_DONE && err != RDZV_ERR_CLOSED) {
        snprintf(a->why, sizeof(a->why),
                 "could not record in etcd that the round ended (%.340s): %s", reason,
                 rdzv_strerror(err));
        dlog_error(&a->lg, "failure_report_failed", "%s; exiting", a->why);
        a->exit_after_stop = 1;
        a->in_round = 0;
        if (a->state != AGENT_SHUTDOWN) a->state = AGENT_STOPPING;
        stop_workers(a, a->o->stop_grace_ms);
        if (!workers_alive(a)) agent_finish(a, 1, a->why);
    }
}

/* Tells etcd why the round ends (see rdzv.h, the failure-counting rule):
 * first_hand for a crash of this node's worker, else a lost peer. Once a
 * round, on a task: the loop goes on and report_done takes the answer. A
 * newer round's report makes the loop forget an older one's answer (its
 * thread still makes its write). */
void report_start(agent *a, const char *reason, int first_hand, int suspect)
{
    if (a->failure_reported) return;
    a->failure_reported = 1;
    a->report_round = a->round.number;
    a->report_suspect = suspect && first_hand;
    snprintf(a->report_reason, sizeof(a->report_reason), "%s", reason);
    rz_job *j = rz_job_new(a);
    if (j) {
        j->first_hand = first_hand;
        j->suspect = suspect && first_hand;
        j->restarts = a->restarts;
        snprintf(j->reason, sizeof(j->reason), "%s", reason);
        if (rz_job_others(j, &a->round) != 0) {
            rz_job_free(j);
            j = NULL;
        }
    }
    if (!j || agent_task_start(&a->report, report_main, j, rz_job_free) != 0)
        report_done(a, RDZV_ERR_NOMEM, a->restarts, 0, 0, "");
}

void report_failure(agent *a, const char *reason, int first_hand)
{
    report_start(a, reason, first_hand, 0);
}

/* 1 when a reaped worker's end may be a peer's death seen from here: an
 * error exit of its own (a PyTorch script whose collective raised), not a
 * signal, a hang, or a crash the agent caused. The report then asks whose
 * loss it was (report_main). */
int exit_may_be_peer(const agent *a, const agent_worker *w)
{
    if (a->round.nmembers < 2 || w->hung[0] || !WIFEXITED(w->status)) return 0;
    int code = WEXITSTATUS(w->status);
    return code != 0 && code != CTL_EXIT_PEER_LOST;
}

void on_report(agent *a)
{
    char line[AGENT_TASK_ANSWER_MAX];
    int e = RDZV_ERR_NOMEM, counted = 0, gone = 0, at = 0;
    long long restarts = a->restarts;
    if (agent_task_read(&a->report, line, sizeof(line)) != 0 ||
        sscanf(line, "%d %lld %d %d %n", &e, &restarts, &counted, &gone, &at) != 4) {
        e = RDZV_ERR_NOMEM; /* the thread could not even answer */
        gone = at = 0;
        line[0] = '\0';
    }
    report_done(a, (rdzv_err)e, restarts, counted, gone, line + at);
}
