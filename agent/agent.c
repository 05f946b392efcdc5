/* agent.c: one node's round state machine, run by one poll() loop.
 *
 * Everything the agent reacts to is a file descriptor in one poll(): a
 * signalfd (SIGTERM, SIGINT, SIGCHLD), the rendezvous library's event fd,
 * the answers of the tasks that talk to etcd (task.h: the MASTER_PORT
 * publish or wait, the failure report, the job's completion), and each
 * worker's stdout, stderr and control socket. Nothing blocks the loop:
 * every etcd call but the leave at exit runs on a task's thread, and every
 * wait has a deadline (the SIGKILL after a grace, the shutdown budget),
 * kept in the agent and turned into the poll timeout. A task's answer may
 * come after its round has moved on; each handler checks what still stands.
 * Warm spares (warm.c, --preload) are children too: a launch adopts them as
 * workers, and one that dies before that is reaped apart from the workers.
 * The round state machine:
 *
 *   RDZV --frozen--> RUNNING --round ended / worker failed--> STOPPING --all gone--> RDZV
 *     (inplace: a round end keeps the workers and goes straight back to RDZV,
 *      when every one of them said `hello 1 inplace`; see keep_in_place)
 *   RUNNING --all workers exited 0--> FINISHING --job marked complete--> exit 0
 *   any --SIGTERM--> SHUTDOWN --workers gone--> leave, exit 0
 */
#include "agent.h"
#include "events.h"
#include "http.h"
#include "master.h"
#include "options.h"
#include "standalone.h"
#include "task.h"
#include "warm.h"
#include "watchdog.h"
#include "workers.h"

#include "ductile/clock.h"
#include "ductile/control.h"
#include "ductile/etcd.h"
#include "ductile/log.h"
#include "ductile/rdzv.h"

#include <curl/curl.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef enum {
    AGENT_RDZV,      /* waiting for a round (inplace: workers may be alive and idle) */
    AGENT_RUNNING,   /* workers running in a frozen round */
    AGENT_STOPPING,  /* stopping workers; then the next round, or exit */
    AGENT_SHUTDOWN,  /* SIGTERM: workers finishing their step; then leave, exit 0 */
    AGENT_DRAINING,  /* the job completed elsewhere: let local workers finish */
    AGENT_FINISHING, /* every worker exited 0: marking the job complete */
} agent_state;

typedef struct agent {
    const agent_opts *o;
    dlog lg;
    rdzv_etcd etcd;
    rdzv_config cfg; /* kept to register again after a lost lease */
    rdzv *rz;
    agent_http *http;
    agent_events *events;  /* --k8s-events: Events on the Job, or NULL */
    int job_failed_posted; /* the JobFailed Event is queued */
    agent_standalone sa;
    int sigfd;
    agent_workers ws;
    agent_logs logs;   /* torchrun's per-worker files and error files */
    agent_warm warm;   /* warm spare interpreters for the next launch (--preload) */
    agent_watchdog wd; /* the progress watchdog (--hang-timeout) */
    rdzv_round round;  /* current or last round; number 0 = none yet */
    int in_round;      /* round is frozen and has not ended */
    rdzv_round pending;
    int have_pending;
    agent_state state;
    int exit_after_stop; /* -1: go on to the next round, else the exit code */
    int job_done;        /* the job completed (JOB_DONE seen, or marked by this agent) */
    double kill_at;      /* SIGKILL workers still alive at this time (0: none) */
    double warm_at;      /* start the next restart's spares at this time (0: none due) */
    double give_up_at;   /* stop waiting for workers at this time (0: none) */
    int failure_reported;
    int64_t restarts;
    int64_t changes[RDZV_CAUSE_COUNT];
    char why[400];       /* why the next round happens, for its "frozen" line */
    atomic_int tasks;    /* task threads still running (task.h) */
    agent_master master; /* MASTER_PORT: rank 0 publishes it, the others wait */
    agent_task report;   /* the failure report in flight */
    int64_t report_round;
    char report_reason[600];
    int report_suspect; /* the report is of a worker's error exit: checked for a peer's death */
    agent_task finish;  /* marking the job complete */
    int64_t started;    /* newest round taken: an older or equal FROZEN is stale */
    int done;
    int exit_code;
    int signals;
    unsigned ws_gen; /* bumped when the worker array is replaced or freed */
} agent;

static void agent_finish(agent *a, int code, const char *how)
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

static int workers_alive(const agent *a)
{
    return a->ws.w ? a->ws.alive : 0;
}

/* One control message to every live worker. */
static void send_all(agent *a, const ctl_msg *m)
{
    for (int i = 0; i < a->ws.n; i++)
        if (!a->ws.w[i].exited) agent_ctl_send(&a->ws.w[i], m);
}

/* SIGTERM to every worker, SIGKILL after grace_ms. */
static void stop_workers(agent *a, int grace_ms)
{
    if (!workers_alive(a)) return;
    agent_workers_signal(&a->ws, SIGTERM);
    a->kill_at = mono_now_s() + grace_ms / 1000.0;
    a->give_up_at = 0;
}

static void start_round(agent *a, rdzv_round *r);

/* Every worker is reaped: decide what comes next. */
static void on_workers_gone(agent *a)
{
    if (a->ws.w) agent_workers_free(&a->ws);
    a->ws_gen++;
    a->kill_at = a->give_up_at = 0;
    switch (a->state) {
    case AGENT_SHUTDOWN:
        /* The job goes on without this node: under a Kubernetes Job its pod
         * must not count as a completed index (--leave-exit-code). */
        if (a->job_done)
            agent_finish(a, AGENT_EXIT_OK, "stopped by signal; the job is complete");
        else
            agent_finish(a, a->o->leave_exit_code, "stopped by signal; left the job");
        return;
    case AGENT_DRAINING:
        agent_finish(a, 0, "job complete");
        return;
    case AGENT_STOPPING:
        if (a->exit_after_stop >= 0) {
            agent_finish(a, a->exit_after_stop, a->why);
            return;
        }
        if (a->job_done) { /* the job completed while these workers stopped */
            agent_finish(a, AGENT_EXIT_OK, "job complete");
            return;
        }
        a->state = AGENT_RDZV;
        if (a->have_pending) {
            rdzv_round r = a->pending;
            a->have_pending = 0;
            start_round(a, &r);
        }
        return;
    default:
        a->state = AGENT_RDZV;
        return;
    }
}

/* A report or the finish, made on a task's thread: it holds the handle, so
 * a rejoin or exit may close it meanwhile. */
typedef struct rz_job {
    rdzv *rz;
    int first_hand;
    int suspect; /* a worker's error exit, which a peer's death may have caused */
    int64_t restarts;
    char reason[600];
    int nothers; /* the round's other members, to check (rdzv_check_members) */
    char **others;
} rz_job;

static void rz_job_free(void *p)
{
    rz_job *j = p;
    rdzv_release(j->rz);
    for (int i = 0; i < j->nothers; i++)
        free(j->others[i]);
    free(j->others);
    free(j);
}

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

static rz_job *rz_job_new(agent *a)
{
    rz_job *j = calloc(1, sizeof(*j));
    if (!j) return NULL;
    j->rz = a->rz;
    rdzv_hold(a->rz);
    return j;
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
static void post_job_failed(agent *a)
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
static void report_start(agent *a, const char *reason, int first_hand, int suspect)
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

static void report_failure(agent *a, const char *reason, int first_hand)
{
    report_start(a, reason, first_hand, 0);
}

/* 1 when a reaped worker's end may be a peer's death seen from here: an
 * error exit of its own (a PyTorch script whose collective raised), not a
 * signal, a hang, or a crash the agent caused. The report then asks whose
 * loss it was (report_main). */
static int exit_may_be_peer(const agent *a, const agent_worker *w)
{
    if (a->round.nmembers < 2 || w->hung[0] || !WIFEXITED(w->status)) return 0;
    int code = WEXITSTATUS(w->status);
    return code != 0 && code != CTL_EXIT_PEER_LOST;
}

static void on_report(agent *a)
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

/* A worker of this node failed (exited non-zero, was killed, or reported a
 * failure or a lost peer in restart mode): stop the rest and end the round,
 * as a failure when first_hand. */
static void worker_failed(agent *a, const char *reason, int first_hand, int suspect)
{
    dlog_warn(&a->lg, "worker_failed", "round %lld: %s; stopping the other workers",
              (long long)a->round.number, reason);
    if (a->state != AGENT_SHUTDOWN) {
        a->state = AGENT_STOPPING;
        if (a->exit_after_stop < 0) snprintf(a->why, sizeof(a->why), "failure: %s", reason);
    }
    stop_workers(a, a->o->stop_grace_ms);
    a->in_round = 0;
    report_start(a, reason, first_hand, suspect);
    if (!workers_alive(a) && !a->done) on_workers_gone(a);
}

/* Whether this node's workers are kept at a round's end: --rebuild inplace
 * and every live one said `hello CTL_VERSION inplace`. All or nothing: a
 * node's workers are kept together or restarted together; other nodes
 * decide for themselves (a fresh worker gets its round on the channel too). */
static int keep_in_place(const agent *a)
{
    if (!a->o->inplace) return 0;
    for (int i = 0; a->ws.w && i < a->ws.n; i++)
        if (!a->ws.w[i].exited && !a->ws.w[i].inplace) return 0;
    return 1;
}

/* keep_in_place() where a round ends; when --rebuild inplace cannot keep the
 * workers, says so once, naming the first worker that did not say it can
 * be kept, and the caller restarts them as restart mode does. */
static int keep_at_end(agent *a, int64_t round)
{
    if (!a->o->inplace || keep_in_place(a)) return a->o->inplace;
    const agent_worker *w = NULL;
    for (int i = 0; i < a->ws.n && !w; i++)
        if (!a->ws.w[i].exited && !a->ws.w[i].inplace) w = &a->ws.w[i];
    char why[160];
    if (w->version == 0)
        snprintf(why, sizeof(why),
                 "did not say \"hello %d inplace\" on its control channel (a script without "
                 "the in-place helper)",
                 CTL_VERSION);
    else if (w->version != CTL_VERSION)
        snprintf(why, sizeof(why), "speaks control protocol version %d, not %d", w->version,
                 CTL_VERSION);
    else
        snprintf(why, sizeof(why), "said \"hello %d\" without inplace", CTL_VERSION);
    dlog_warn(&a->lg, "inplace_fallback",
              "round %lld: worker rank %d %s: restarting this node's workers instead of keeping "
              "them",
              (long long)round, w->rank, why);
    return 0;
}

/* A worker's `hello`: the first one says what it can do; every one is
 * answered with this agent's version and rebuild mode. */
static void on_hello(agent *a, agent_worker *w, const ctl_msg *m)
{
    if (w->version) {
        dlog_warn(&a->lg, "control_invalid", "worker rank %d said hello again: the first stands",
                  w->rank);
    } else {
        w->version = m->version;
        w->inplace = m->version == CTL_VERSION && m->mode == CTL_MODE_INPLACE;
        if (m->version != CTL_VERSION)
            dlog_warn(&a->lg, "control_version",
                      "worker rank %d speaks control protocol version %d, this agent version "
                      "%d%s",
                      w->rank, m->version, CTL_VERSION,
                      a->o->inplace ? ": it is restarted, not kept in place, at a round's end"
                                    : "");
    }
    ctl_msg r = {.type = CTL_HELLO,
                 .version = CTL_VERSION,
                 .mode = a->o->inplace ? CTL_MODE_INPLACE : CTL_MODE_RESTART};
    if (agent_ctl_send(w, &r) != 0)
        dlog_warn(&a->lg, "control_failed", "cannot answer the hello of worker rank %d", w->rank);
}

static void on_ctl(void *ctx, agent_worker *w, const ctl_msg *m)
{
    agent *a = ctx;
    agent_watchdog_heard(&a->wd, w, m, mono_now_s());
    switch (m->type) {
    case CTL_READY:
        w->ready = 1;
        break;
    case CTL_STEP:
        w->step = m->step;
        agent_progress_step(&w->prog, m, mono_now_s());
        break;
    case CTL_PHASE: /* the watchdog's alone */
        break;
    case CTL_HELLO:
        on_hello(a, w, m);
        break;
    case CTL_FAILED:
    case CTL_PEER_LOST: {
        int first_hand = m->type == CTL_FAILED;
        char reason[600];
        snprintf(reason, sizeof(reason), "worker rank %d %s: %s", w->rank,
                 first_hand ? "reported" : "lost a peer", m->reason);
        /* A lost peer of a round this node has left is old news. A kept
         * worker's own failure is not: it may come while the round it
         * happened in is being replaced (a peer saw its connections close
         * first), and it is counted all the same (rdzv_report_failure adds
         * it to the current round when that one ended uncounted). */
        if (!first_hand && (!a->in_round || m->round != a->round.number)) break;
        if (a->state != AGENT_RUNNING && !(first_hand && a->state == AGENT_RDZV && a->o->inplace))
            break;
        if (keep_at_end(a, a->round.number)) {
            /* The worker keeps its process; the round ends for everyone. */
            dlog_warn(&a->lg, first_hand ? "worker_reported_failure" : "worker_lost_peer",
                      "round %lld: %s", (long long)a->round.number, reason);
            report_failure(a, reason, first_hand);
        } else {
            worker_failed(a, reason, first_hand, 0);
        }
        break;
    }
    default:
        dlog_warn(&a->lg, "control_invalid", "worker rank %d sent an agent-only message", w->rank);
        break;
    }
}

/* Inplace: sends every worker the round, with its rank in it, on its control channel. */
static void send_round(agent *a, const rdzv_member *me, const char *maddr, int mport,
                       const char *prefix)
{
    const rdzv_round *r = &a->round;
    for (int i = 0; i < a->ws.n; i++) {
        agent_worker *w = &a->ws.w[i];
        w->rank = me->first_global_rank + w->local_rank;
        w->failed_reported = 0;
        w->ready = 0;
        ctl_msg m = {.type = CTL_ROUND,
                     .round = r->number,
                     .rank = w->rank,
                     .world_size = r->world_size,
                     .local_rank = w->local_rank,
                     .group_rank = r->my_rank,
                     .group_world_size = r->nmembers,
                     .restarts = r->restarts,
                     .master_port = mport};
        snprintf(m.master_addr, sizeof(m.master_addr), "%s", maddr);
        snprintf(m.store_prefix, sizeof(m.store_prefix), "%s", prefix);
        if (!w->exited && agent_ctl_send(w, &m) != 0)
            dlog_warn(&a->lg, "control_failed", "cannot send round %lld to worker rank %d",
                      (long long)r->number, w->rank);
    }
}

static void launch_round(agent *a, const char *maddr, int mport);

/* Node rank 0 could not publish MASTER_PORT: etcd failed under us, the
 * round cannot start, and the others wait for a port that will not come,
 * so end it for everyone. */
static void publish_failed(agent *a, int64_t round, const char *why)
{
    dlog_warn(&a->lg, "master_port_failed", "round %lld: cannot publish MASTER_PORT: %s",
              (long long)round, why);
    report_failure(a, "node rank 0 could not publish MASTER_PORT", 0);
    a->in_round = 0;
}

/* A round froze with this node in it: take it, learn its MASTER_PORT (node
 * rank 0 publishes it, the others wait for it, each on a task) and run the
 * workers once it is known (on_master). */
static void start_round(agent *a, rdzv_round *r)
{
    agent_master_cancel(&a->master);
    rdzv_round_free(&a->round);
    a->round = *r;
    memset(r, 0, sizeof(*r));
    a->in_round = 1;
    a->failure_reported = 0;
    a->restarts = a->round.restarts;
    a->started = a->round.number;
    const rdzv_round *rd = &a->round;
    if (!rdzv_round_self(rd)) {
        dlog_error(&a->lg, "round_invalid", "round %lld froze without this node",
                   (long long)rd->number);
        a->in_round = 0;
        return;
    }
    dlog_info(&a->lg, "round_frozen",
              "round %lld frozen: %d nodes, world size %d, rank %d, restarts %lld of %d (%s)",
              (long long)rd->number, rd->nmembers, rd->world_size, rd->my_rank,
              (long long)rd->restarts, rd->max_restarts, a->why[0] ? a->why : "first round");
    /* Node rank 0 speaks for the round: one Event per change, not one per node. */
    if (rd->my_rank == 0)
        agent_events_post(a->events, 0, "RoundFormed",
                          "round %lld formed with %d nodes, world size %d, restarts %lld of %d "
                          "(%.400s)",
                          (long long)rd->number, rd->nmembers, rd->world_size,
                          (long long)rd->restarts, rd->max_restarts,
                          a->why[0] ? a->why : "first round");
    a->why[0] = 0;
    if (rd->my_rank == 0) {
        if (agent_master_publish_start(&a->master, &a->etcd, a->o->job, rd->number) != 0)
            publish_failed(a, rd->number, "no thread to publish it on");
        return;
    }
    /* Bounded by the lease TTL: node rank 0 publishes right after the
     * freeze, and if it died its lease ends the round (which ends this wait
     * at once: the store's wait fails when its round is superseded). */
    if (agent_master_wait_start(&a->master, &a->etcd, a->o->job, rd->number,
                                a->o->lease_ttl_s * 1000 + 5000) != 0) {
        report_failure(a, "cannot start waiting for MASTER_PORT", 1);
        a->in_round = 0;
    }
}

/* The MASTER_PORT publish or wait answered: go on with the round if it
 * still stands. */
static void on_master(agent *a)
{
    int64_t round = a->master.round;
    int publishing = a->master.publishing;
    int port = 0;
    rdzv_err err = RDZV_OK;
    char why[AGENT_MSG_MAX];
    int rc = agent_master_read(&a->master, &port, &err, why, sizeof(why));
    if (!a->in_round || a->round.number != round) return;
    if (publishing) { /* as when it was made in place: whatever the state */
        if (rc == 0)
            launch_round(a, a->round.members[0].addr, port);
        else
            publish_failed(a, round, why);
        return;
    }
    if (a->state != AGENT_RDZV) return;
    if (rc == 0) {
        launch_round(a, a->round.members[0].addr, port); /* members are sorted by rank */
        return;
    }
    dlog_warn(&a->lg, "master_port_failed", "round %lld: no MASTER_PORT: %s", (long long)round,
              why);
    /* Superseded: the round's end is on its way as an event. */
    if (err == RDZV_ERR_FENCED) return;
    /* Node rank 0 is alive (a dead one ends the round, and this wait with
     * it) but did not publish: a lost peer, counted if it happens again. */
    report_failure(a, "node rank 0 did not publish MASTER_PORT", 0);
    a->in_round = 0;
}

static void launch_round(agent *a, const char *maddr, int mport)
{
    const rdzv_round *rd = &a->round;
    const rdzv_member *me = rdzv_round_self(rd);
    char prefix[320];
    (void)rdzv_store_prefix(a->o->job, rd->number, prefix, sizeof(prefix)); /* job id checked */
    if (workers_alive(a) == a->o->nproc && keep_in_place(a)) {
        /* A stopped or wedged worker would fail the new round's group for
         * everyone: it ends here, as this node's failure, and the node's
         * workers start afresh. */
        double now = mono_now_s();
        for (int i = 0; i < a->ws.n; i++)
            if (agent_watchdog_silent(&a->ws.w[i], now))
                agent_watchdog_kill(&a->wd, &a->ws.w[i], &a->lg);
        send_round(a, me, maddr, mport, prefix);
        a->state = AGENT_RUNNING;
        dlog_info(&a->lg, "workers_kept", "round %lld: %d workers kept, ranks %d..%d",
                  (long long)rd->number, a->o->nproc, me->first_global_rank,
                  me->first_global_rank + a->o->nproc - 1);
        return;
    }
    agent_round_env env = {.round = rd->number,
                           .world_size = rd->world_size,
                           .group_rank = rd->my_rank,
                           .group_world_size = rd->nmembers,
                           .first_rank = me->first_global_rank,
                           .local_world_size = a->o->nproc,
                           .master_addr = maddr,
                           .master_port = mport,
                           .node_addr = a->o->node_addr,
                           .node_id = a->o->node_id,
                           .restarts = rd->restarts,
                           .max_restarts = rd->max_restarts,
                           .job = a->o->job,
                           .role = a->o->role,
                           .store_prefix = prefix,
                           .etcd = a->etcd,
                           .logs = &a->logs};
    char msg[AGENT_MSG_MAX];
    int warm = 0;
    if (agent_logs_attempt(&a->logs, rd->restarts, msg, sizeof(msg)) != 0 ||
        agent_workers_spawn(&a->ws, &env, a->o->cmd, &a->warm, &warm, msg, sizeof(msg)) != 0) {
        dlog_error(&a->lg, "spawn_failed", "round %lld: cannot start workers: %s",
                   (long long)rd->number, msg);
        a->state = AGENT_RDZV;
        a->in_round = 0;
        report_failure(a, msg, 1);
        return;
    }
    a->ws_gen++;
    a->state = AGENT_RUNNING;
    char how[160] = "";
    if (a->warm.argv)
        snprintf(how, sizeof(how), " (%d from a warm interpreter: %.100s preloaded)", warm,
                 a->warm.modules);
    dlog_info(&a->lg, "workers_started", "round %lld: started %d workers, ranks %d..%d%s",
              (long long)rd->number, a->o->nproc, me->first_global_rank,
              me->first_global_rank + a->o->nproc - 1, how);
    /* The next restart's spares import while this round trains, a little
     * after its workers' own start: an import of torch takes the cores the
     * new workers start on. Either way is safe: a restart before then
     * starts cold. */
    agent_warm_new_round(&a->warm);
    a->warm_at = mono_now_s() + AGENT_WARM_REFILL_S;
    /* In inplace mode a fresh worker also gets the round on its channel, so
     * a trainer reads its round the same way every time. */
    if (a->o->inplace) send_round(a, me, maddr, mport, prefix);
}

/* The Event for a round's end, by its cause (node rank 0 posts it). */
static void post_round_end(agent *a, const rdzv_event *ev, const char *what)
{
    static const char *const reasons[RDZV_CAUSE_COUNT] = {
        [RDZV_CAUSE_NONE] = "RoundEnded",      [RDZV_CAUSE_MEMBER_LOST] = "NodeLost",
        [RDZV_CAUSE_MEMBER_LEFT] = "NodeLeft", [RDZV_CAUSE_NODE_WAITING] = "NodeJoined",
        [RDZV_CAUSE_FAILURE] = "WorkerFailed", [RDZV_CAUSE_PEER_LOST] = "PeerLost"};
    int cause = ev->cause > 0 && ev->cause < RDZV_CAUSE_COUNT ? (int)ev->cause : 0;
    int warning = cause == RDZV_CAUSE_MEMBER_LOST || cause == RDZV_CAUSE_FAILURE;
    agent_events_post(a->events, warning, reasons[cause], "round %lld ended: %.500s",
                      (long long)ev->round_number, what);
}

static void describe_end(const rdzv_event *ev, char *out, size_t len)
{
    const char *node = ev->node[0] ? ev->node : "?";
    /* The library's reason usually names the node already: then it says it all. */
    if (ev->reason[0] && ev->node[0] && strstr(ev->reason, ev->node)) {
        snprintf(out, len, "%s", ev->reason);
        return;
    }
    const char *sep = ev->reason[0] ? ": " : "";
    switch (ev->cause) {
    case RDZV_CAUSE_MEMBER_LOST:
        snprintf(out, len, "member %s lost%s%s", node, sep, ev->reason);
        break;
    case RDZV_CAUSE_MEMBER_LEFT:
        snprintf(out, len, "member %s left%s%s", node, sep, ev->reason);
        break;
    case RDZV_CAUSE_NODE_WAITING:
        snprintf(out, len, "node %s waiting and the round has room", node);
        break;
    case RDZV_CAUSE_FAILURE:
        snprintf(out, len, "failure on %s%s%s", node, sep, ev->reason);
        break;
    default:
        snprintf(out, len, "%s", ev->reason[0] ? ev->reason : "unknown cause");
        break;
    }
}

/* The round this node was in is over: in place, the workers end their step
 * and wait for the next round (graceful: every member is alive, so the step
 * in flight finishes; else its collectives are abandoned now); by restart
 * (also in inplace mode for workers that cannot be kept), they are stopped. */
static void leave_round(agent *a, int64_t round_number, int graceful)
{
    a->in_round = 0;
    agent_master_cancel(&a->master);
    if (a->state != AGENT_RUNNING) return;
    if (keep_at_end(a, round_number)) {
        send_all(a, &(ctl_msg){.type = CTL_ABORT, .round = round_number, .graceful = graceful});
        a->state = AGENT_RDZV;
    } else {
        a->state = AGENT_STOPPING;
        a->exit_after_stop = -1;
        /* Graceful: every member is alive, so the step in flight finishes
         * however long it takes and is saved (`stop`, then SIGTERM), within
         * the budget a SIGTERM gives; a step cut there is redone, never
         * counted twice. Lost: the collectives fail at once anyway. */
        if (graceful) send_all(a, &(ctl_msg){.type = CTL_STOP});
        stop_workers(a, graceful ? a->o->shutdown_timeout_ms : a->o->stop_grace_ms);
        if (!workers_alive(a)) on_workers_gone(a);
    }
}

/* rdzv_open, and with --start-over, a job that ended under another install
 * id is started over (rdzv_start_over) and opened again. Of agents that
 * start together one deletes the old keys; the others find them gone, or
 * find it registered, and open the new job. *live: nodes found registered
 * under an old end, which then stays (the error, with a reason saying so). */
static rdzv_err open_job(agent *a, char *msg, int *live)
{
    rdzv_err err = rdzv_open(&a->cfg, &a->rz, msg);
    for (int i = 0; err == RDZV_ERR_JOB_ENDED_ELSEWHERE && a->o->start_over && i < 3; i++) {
        int64_t deleted = 0;
        char why[RDZV_MSG_MAX];
        rdzv_err e = rdzv_start_over(&a->etcd, a->o->job, a->o->install_id, live, &deleted, why);
        if (e != RDZV_OK) {
            snprintf(msg, RDZV_MSG_MAX, "starting job %s over: %.160s", a->o->job, why);
            return e;
        }
        if (deleted > 0)
            dlog_warn(&a->lg, "start_over", "job %s starts over: %s; deleted its %lld keys",
                      a->o->job, why, (long long)deleted);
        err = rdzv_open(&a->cfg, &a->rz, msg);
        if (err == RDZV_ERR_JOB_ENDED_ELSEWHERE && *live > 0)
            snprintf(msg, RDZV_MSG_MAX,
                     "job %s ended in an earlier install and %d of its nodes are still "
                     "registered: it starts over once they leave",
                     a->o->job, *live);
    }
    return err;
}

/* This node's lease expired (etcd was unreachable past the TTL, or the node
 * was stalled or cut off): the others have gone on without it, but the job
 * has not ended. Register again under a new lease and join the next round
 * as a newcomer; the old round is over for this node, and its workers never
 * write as that round again (the store and checkpoints are fenced). Returns
 * 0 when registering again fails, and the caller gives up as before. */
static int rejoin(agent *a, const rdzv_event *ev)
{
    if (a->state == AGENT_SHUTDOWN || a->state == AGENT_DRAINING || a->exit_after_stop >= 0 ||
        a->state == AGENT_FINISHING)
        return 0;
    rdzv *fresh = NULL;
    char msg[RDZV_MSG_MAX] = "";
    /* Never take the registration back: if another agent with this node id
     * holds it now, it took it over from this one, judged dead, and two
     * agents with one id must never both train (docs/design.md, "Rounds"). */
    a->cfg.no_takeover = 1;
    rdzv_err err = rdzv_open(&a->cfg, &fresh, msg);
    if (err != RDZV_OK) {
        dlog_error(&a->lg, "rejoin_failed", "lease lost (%s) and could not register again: %s%s%s",
                   ev->reason, rdzv_strerror(err), msg[0] ? ": " : "", msg);
        return 0;
    }
    rdzv_close(a->rz);
    a->rz = fresh;
    a->changes[RDZV_CAUSE_MEMBER_LOST]++;
    dlog_warn(&a->lg, "rejoin",
              "round %lld left: lease lost (%s); registered again, joining the next round",
              (long long)a->round.number, ev->reason);
    snprintf(a->why, sizeof(a->why), "this node's lease was lost and it joined again");
    leave_round(a, a->round.number, 0);
    return 1;
}

static void on_event(agent *a, rdzv_event *ev)
{
    char what[400];
    /* Marking the job complete: its answer decides how this agent ends
     * (as when the loop waited for it); only the job's end, which may be
     * that very write, is news. */
    if (a->state == AGENT_FINISHING && ev->type != RDZV_EV_JOB_DONE) return;
    switch (ev->type) {
    case RDZV_EV_FROZEN:
        if (a->state == AGENT_SHUTDOWN || a->state == AGENT_DRAINING || a->exit_after_stop >= 0)
            break;
        if (ev->round.number <= a->started) {
            /* Never act on a round twice, nor go back to an older one. */
            dlog_warn(&a->lg, "round_stale", "round %lld reported again after round %lld: ignored",
                      (long long)ev->round.number, (long long)a->started);
            break;
        }
        if (a->state == AGENT_RUNNING && workers_alive(a) && !keep_at_end(a, a->round.number)) {
            /* A newer round without an end of ours first: ours is over too. */
            dlog_info(&a->lg, "round_superseded", "round %lld superseded by round %lld",
                      (long long)a->round.number, (long long)ev->round.number);
            a->state = AGENT_STOPPING;
            a->exit_after_stop = -1;
            a->in_round = 0;
            stop_workers(a, a->o->stop_grace_ms);
        }
        if (a->state == AGENT_STOPPING && workers_alive(a)) {
            if (a->have_pending) rdzv_round_free(&a->pending);
            a->pending = ev->round;
            a->have_pending = 1;
            memset(&ev->round, 0, sizeof(ev->round));
        } else {
            start_round(a, &ev->round);
        }
        break;
    case RDZV_EV_ROUND_ENDED:
        if (ev->cause > 0 && ev->cause < RDZV_CAUSE_COUNT) a->changes[ev->cause]++;
        describe_end(ev, what, sizeof(what));
        dlog_info(&a->lg, "round_ended", "round %lld ended: %s", (long long)ev->round_number, what);
        if (a->round.number == ev->round_number && a->round.my_rank == 0)
            post_round_end(a, ev, what);
        snprintf(a->why, sizeof(a->why), "%s", what);
        leave_round(a, ev->round_number,
                    ev->cause == RDZV_CAUSE_NODE_WAITING || ev->cause == RDZV_CAUSE_MEMBER_LEFT);
        break;
    case RDZV_EV_SPARE:
        dlog_info(&a->lg, "spare", "the round is full: waiting as a hot spare");
        break;
    case RDZV_EV_JOB_DONE:
        a->job_done = 1;
        dlog_info(&a->lg, "job_done", "the job is complete");
        a->in_round = 0;
        if (workers_alive(a) && a->state != AGENT_SHUTDOWN && a->state != AGENT_STOPPING) {
            a->state = AGENT_DRAINING;
            a->give_up_at = mono_now_s() + a->o->shutdown_timeout_ms / 1000.0;
        } else if (!workers_alive(a)) {
            agent_finish(a, 0, "job complete");
        }
        break;
    case RDZV_EV_JOB_FAILED:
    case RDZV_EV_ERROR:
        if (ev->type == RDZV_EV_ERROR && ev->err == RDZV_ERR_LEASE_LOST && rejoin(a, ev)) break;
        if (ev->type == RDZV_EV_JOB_FAILED)
            snprintf(a->why, sizeof(a->why), "job failed: %s", ev->reason);
        else if (ev->err == RDZV_ERR_TIMEOUT)
            snprintf(a->why, sizeof(a->why), "%s: too few nodes came (a wait, not a failure)",
                     ev->reason);
        else
            snprintf(a->why, sizeof(a->why), "rendezvous error: %s: %s", rdzv_strerror(ev->err),
                     ev->reason);
        dlog_error(&a->lg, ev->type == RDZV_EV_JOB_FAILED ? "job_failed" : "rdzv_error", "%s",
                   a->why);
        if (ev->type == RDZV_EV_JOB_FAILED) post_job_failed(a);
        a->in_round = 0;
        if (a->state == AGENT_SHUTDOWN) break;
        a->exit_after_stop = ev->type == RDZV_EV_JOB_FAILED   ? AGENT_EXIT_JOB_FAILED
                             : ev->err == RDZV_ERR_LEASE_LOST ? AGENT_EXIT_DROPPED
                             : ev->err == RDZV_ERR_TIMEOUT    ? AGENT_EXIT_NO_ROUND
                                                              : AGENT_EXIT_ERROR;
        if (workers_alive(a)) {
            a->state = AGENT_STOPPING;
            stop_workers(a, a->o->stop_grace_ms);
        } else {
            agent_finish(a, a->exit_after_stop, a->why);
        }
        break;
    }
}

/* SIGTERM/SIGINT: workers finish their step and save, then leave, exit 0.
 * The workers get the shutdown budget less what leaving may take. */
static void begin_shutdown(agent *a, const char *sig)
{
    a->signals++;
    if (a->signals > 1) {
        dlog_info(&a->lg, "signal", "%s again: killing workers now", sig);
        agent_workers_signal(&a->ws, SIGKILL);
        return;
    }
    int budget = a->o->shutdown_timeout_ms;
    int reserve = budget / 4 < 5000 ? budget / 4 : 5000;
    dlog_info(&a->lg, "signal", "%s: stopping workers (they have %.1f s), then leaving", sig,
              (budget - reserve) / 1000.0);
    a->state = AGENT_SHUTDOWN;
    a->in_round = 0;
    agent_master_cancel(&a->master);
    if (a->have_pending) rdzv_round_free(&a->pending);
    a->have_pending = 0;
    send_all(a, &(ctl_msg){.type = CTL_STOP});
    stop_workers(a, budget - reserve);
    if (!workers_alive(a)) on_workers_gone(a);
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
static void start_finish(agent *a)
{
    a->state = AGENT_FINISHING;
    rz_job *j = rz_job_new(a);
    if (!j || agent_task_start(&a->finish, finish_main, j, rz_job_free) != 0)
        finish_done(a, RDZV_ERR_NOMEM);
}

static void on_finish(agent *a)
{
    char line[AGENT_TASK_ANSWER_MAX];
    int e = RDZV_ERR_NOMEM;
    if (agent_task_read(&a->finish, line, sizeof(line)) != 0 || sscanf(line, "%d", &e) != 1)
        e = RDZV_ERR_NOMEM;
    finish_done(a, (rdzv_err)e);
}

/* A spare that died is started again (once a round) while another launch
 * may still come. */
static int spares_wanted(const agent *a)
{
    return !a->done && a->exit_after_stop < 0 && a->state != AGENT_SHUTDOWN &&
           a->state != AGENT_DRAINING && a->state != AGENT_FINISHING;
}

static void on_reaped(agent *a, pid_t pid, int status)
{
    if (pid == a->sa.pid) {
        a->sa.pid = 0;
        snprintf(a->why, sizeof(a->why), "the private etcd exited (status %d)", status);
        dlog_error(&a->lg, "etcd_exited", "%s", a->why);
        a->exit_after_stop = 1;
        if (a->state != AGENT_SHUTDOWN) a->state = AGENT_STOPPING;
        stop_workers(a, a->o->stop_grace_ms);
        if (!workers_alive(a)) agent_finish(a, 1, a->why);
        return;
    }
    if (agent_warm_reaped(&a->warm, pid, status, &a->lg)) {
        if (spares_wanted(a)) agent_warm_fill(&a->warm, &a->lg);
        return;
    }
    if (!a->ws.w) return;
    agent_worker *w = agent_workers_reaped(&a->ws, pid, status);
    if (!w) return;
    char how[256], reason[320];
    agent_worker_describe(w, how, sizeof(how));
    snprintf(reason, sizeof(reason), "worker rank %d %s", w->rank, how);
    int ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (a->state == AGENT_RUNNING || (a->state == AGENT_RDZV && a->o->inplace)) {
        if (!ok) {
            int lost = WIFEXITED(status) && WEXITSTATUS(status) == CTL_EXIT_PEER_LOST;
            if (lost)
                snprintf(reason, sizeof(reason), "worker rank %d lost a peer (exit status %d)",
                         w->rank, CTL_EXIT_PEER_LOST);
            worker_failed(a, reason, agent_worker_first_hand(w), exit_may_be_peer(a, w));
            return;
        }
        if (workers_alive(a) == 0) {
            int all_ok = 1;
            for (int i = 0; i < a->ws.n; i++)
                all_ok &= WIFEXITED(a->ws.w[i].status) && WEXITSTATUS(a->ws.w[i].status) == 0;
            if (all_ok) {
                dlog_info(&a->lg, "workers_done", "round %lld: all %d workers exited 0",
                          (long long)a->round.number, a->ws.n);
                agent_workers_free(&a->ws);
                a->ws_gen++;
                a->in_round = 0;
                start_finish(a);
            }
        }
        return;
    }
    if (a->state == AGENT_STOPPING && agent_worker_first_hand(w)) {
        /* It crashed on its own while the round was ending for another
         * reason (its peers saw the crash first and reported a lost peer):
         * still one counted failure (report_failure reports once a round). */
        dlog_warn(&a->lg, "worker_failed", "round %lld: %s while stopping",
                  (long long)a->round.number, reason);
        report_start(a, reason, 1, exit_may_be_peer(a, w));
    } else if (a->state == AGENT_SHUTDOWN || a->state == AGENT_STOPPING) {
        dlog_info(&a->lg, "worker_stopped", "%s", reason);
    }
    if (workers_alive(a) == 0 && !a->done) on_workers_gone(a);
}

static void on_signalfd(agent *a)
{
    struct signalfd_siginfo si;
    while (read(a->sigfd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
        if (si.ssi_signo == SIGTERM) begin_shutdown(a, "SIGTERM");
        if (si.ssi_signo == SIGINT) begin_shutdown(a, "SIGINT");
    }
    /* SIGCHLD coalesces: reap everything that has ended. */
    for (;;) {
        int st;
        pid_t pid = waitpid(-1, &st, WNOHANG);
        if (pid <= 0) break;
        on_reaped(a, pid, st);
    }
}

/* The progress watchdog: while workers train (or, in place, wait for a
 * round), a hung one is killed; its reaping ends the round as this node's
 * failure. */
static int watching(const agent *a)
{
    return a->state == AGENT_RUNNING || (a->state == AGENT_RDZV && a->o->inplace);
}

static void check_hung(agent *a, double now)
{
    if (!watching(a)) return;
    for (int i = 0; a->ws.w && i < a->ws.n; i++)
        if (agent_watchdog_hung(&a->wd, &a->ws.w[i], now))
            agent_watchdog_kill(&a->wd, &a->ws.w[i], &a->lg);
}

static void check_deadlines(agent *a)
{
    double now = mono_now_s();
    check_hung(a, now);
    if (a->kill_at > 0 && now >= a->kill_at) {
        a->kill_at = 0;
        if (workers_alive(a)) {
            for (int i = 0; i < a->ws.n; i++)
                if (!a->ws.w[i].exited)
                    dlog_warn(&a->lg, "worker_killed",
                              "worker rank %d did not stop in time: SIGKILL", a->ws.w[i].rank);
            agent_workers_signal(&a->ws, SIGKILL);
            a->give_up_at = now + 5.0;
        }
    }
    if (a->give_up_at > 0 && now >= a->give_up_at) {
        a->give_up_at = 0;
        if (a->state == AGENT_DRAINING && workers_alive(a)) {
            dlog_warn(&a->lg, "drain_timeout",
                      "workers still running after the job completed: "
                      "stopping them");
            stop_workers(a, a->o->stop_grace_ms);
        } else if (workers_alive(a)) {
            dlog_error(&a->lg, "workers_stuck", "%d workers did not exit after SIGKILL",
                       workers_alive(a));
            a->ws.alive = 0;
            on_workers_gone(a);
        }
    }
}

static void publish(agent *a)
{
    if (!a->http) return;
    agent_snapshot s;
    memset(&s, 0, sizeof(s));
    s.round = a->round.number;
    s.members = a->in_round ? a->round.nmembers : 0;
    s.world_size = a->in_round ? a->round.world_size : 0;
    s.restarts = a->restarts;
    s.workers_running = workers_alive(a);
    s.rdzv_seconds = a->rz ? rdzv_seconds_in_rendezvous(a->rz) : 0;
    memcpy(s.changes, a->changes, sizeof(s.changes));
    s.ready = a->state == AGENT_RUNNING && a->in_round && workers_alive(a) == a->o->nproc;
    s.heartbeat = mono_now_s();
    s.hangs = a->wd.hangs;
    /* Prometheus wants wall-clock timestamps: the monotonic times of progress
     * are turned into Unix times here, for the page alone. */
    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    double unix_now = (double)wall.tv_sec + wall.tv_nsec / 1e9;
    for (int i = 0; a->ws.w && i < a->ws.n && s.nworkers < AGENT_SNAPSHOT_WORKERS; i++) {
        const agent_worker *w = &a->ws.w[i];
        if (w->exited) continue;
        agent_worker_snapshot *ws = &s.workers[s.nworkers++];
        ws->rank = w->rank;
        ws->local_rank = w->local_rank;
        ws->step = w->step;
        ws->progress_unix = w->progress_at > 0 ? unix_now - (s.heartbeat - w->progress_at) : 0;
        ws->step_unix = w->prog.step_at > 0 ? unix_now - (s.heartbeat - w->prog.step_at) : 0;
        ws->samples_total = w->prog.samples_total;
        ws->samples_per_second = agent_progress_rate(&w->prog, s.heartbeat);
        ws->has_loss = w->prog.has_loss;
        ws->loss = w->prog.loss;
        snprintf(ws->phase, sizeof(ws->phase), "%s", w->phase);
    }
    agent_http_publish(a->http, &s);
}

/* The loop's fixed poll slots; the workers' fds follow. */
enum { SLOT_SIGNAL, SLOT_RDZV, SLOT_MASTER, SLOT_REPORT, SLOT_FINISH, SLOT_WORKERS };

/* The tasks' answers, first: nothing handled before them in a pass can
 * have replaced the task a slot was polled for. */
static void on_task_answers(agent *a, const struct pollfd *pfd)
{
    if (pfd[SLOT_REPORT].revents && pfd[SLOT_REPORT].fd == a->report.fd && !a->done) on_report(a);
    if (pfd[SLOT_FINISH].revents && pfd[SLOT_FINISH].fd == a->finish.fd && !a->done) on_finish(a);
    if (pfd[SLOT_MASTER].revents && pfd[SLOT_MASTER].fd == a->master.task.fd && !a->done)
        on_master(a);
}

static void run_loop(agent *a)
{
    int maxfds = SLOT_WORKERS + 3 * a->o->nproc;
    struct pollfd *pfd = calloc((size_t)maxfds, sizeof(*pfd));
    agent_worker **owner = calloc((size_t)maxfds, sizeof(*owner));
    if (!pfd || !owner) {
        free(pfd);
        free(owner);
        agent_finish(a, 1, "out of memory");
        return;
    }
    while (!a->done) {
        int n = 0;
        /* The fixed slots, always (fd -1 is ignored by poll). */
        pfd[n++] = (struct pollfd){.fd = a->sigfd, .events = POLLIN};
        pfd[n++] = (struct pollfd){.fd = rdzv_fd(a->rz), .events = POLLIN};
        pfd[n++] = (struct pollfd){.fd = a->master.task.fd, .events = POLLIN};
        pfd[n++] = (struct pollfd){.fd = a->report.fd, .events = POLLIN};
        pfd[n++] = (struct pollfd){.fd = a->finish.fd, .events = POLLIN};
        for (int i = 0; a->ws.w && i < a->ws.n; i++) {
            agent_worker *w = &a->ws.w[i];
            int fds[3] = {w->out_fd, w->err_fd, w->ctl_fd};
            for (int j = 0; j < 3; j++) {
                if (fds[j] < 0) continue;
                owner[n] = w;
                pfd[n++] = (struct pollfd){.fd = fds[j], .events = POLLIN};
            }
        }
        double now = mono_now_s(), next = now + 1.0;
        if (a->kill_at > 0 && a->kill_at < next) next = a->kill_at;
        if (a->warm_at > 0 && a->warm_at < next) next = a->warm_at;
        if (a->give_up_at > 0 && a->give_up_at < next) next = a->give_up_at;
        double hang_at = watching(a) ? agent_watchdog_next(&a->wd, &a->ws) : 0;
        if (hang_at > 0 && hang_at < next) next = hang_at;
        int timeout = next > now ? (int)((next - now) * 1000.0) + 1 : 0;
        int got = poll(pfd, (nfds_t)n, timeout);
        if (got < 0 && errno != EINTR) {
            agent_finish(a, 1, "poll failed");
            break;
        }
        if (a->warm_at > 0 && mono_now_s() >= a->warm_at) {
            a->warm_at = 0;
            if (spares_wanted(a)) agent_warm_fill(&a->warm, &a->lg);
        }
        if (got > 0) {
            unsigned gen = a->ws_gen; /* before anything may replace the workers */
            on_task_answers(a, pfd);
            for (int i = SLOT_WORKERS; i < n && !a->done; i++) {
                if (a->ws_gen != gen || !a->ws.w) break; /* owner[] is stale */
                if (!pfd[i].revents) continue;
                agent_worker *w = owner[i];
                if (pfd[i].fd == w->ctl_fd)
                    agent_ctl_read(w, &a->lg, on_ctl, a);
                else if (pfd[i].fd == w->out_fd || pfd[i].fd == w->err_fd)
                    agent_workers_read_output(&a->ws, w, pfd[i].fd);
                if (a->done) break;
            }
            if (pfd[SLOT_SIGNAL].revents) on_signalfd(a);
            if (pfd[SLOT_RDZV].revents) {
                rdzv_event ev;
                rdzv_err err = RDZV_OK;
                while (!a->done && (err = rdzv_next_event(a->rz, 0, &ev)) == RDZV_OK) {
                    on_event(a, &ev);
                    rdzv_event_free(&ev);
                }
                if (!a->done && err != RDZV_ERR_TIMEOUT) {
                    /* The driver stopped without saying why: nothing more will come. */
                    snprintf(a->why, sizeof(a->why), "rendezvous stopped: %s", rdzv_strerror(err));
                    dlog_error(&a->lg, "rdzv_error", "%s", a->why);
                    a->exit_after_stop = 1;
                    if (a->state != AGENT_SHUTDOWN) a->state = AGENT_STOPPING;
                    stop_workers(a, a->o->stop_grace_ms);
                    if (!workers_alive(a)) agent_finish(a, 1, a->why);
                }
            }
        }
        if (!a->done) check_deadlines(a);
        publish(a);
    }
    free(pfd);
    free(owner);
}

/* Sets up what the loop needs (a private etcd, the HTTP endpoint, the
 * rendezvous), runs the loop, and leaves nothing running behind it. */
int agent_run(const agent_opts *o, const dlog *lg, int sigfd)
{
    agent a;
    memset(&a, 0, sizeof(a));
    a.o = o;
    a.lg = *lg;
    a.exit_after_stop = -1;
    a.sigfd = sigfd;
    a.wd.fixed_s = o->hang_timeout_ms / 1000.0;
    atomic_init(&a.tasks, 0);
    agent_master_init(&a.master, &a.tasks);
    agent_task_init(&a.report, &a.tasks);
    agent_task_init(&a.finish, &a.tasks);
    etcd_global_init(); /* before any thread; etcd_client_new reports a failure */

    char msg[RDZV_MSG_MAX] = "";
    a.etcd.endpoints = o->endpoint;
    a.etcd.cacert = o->cacert;
    a.etcd.cert = o->cert;
    a.etcd.key = o->key;
    a.etcd.user = o->user;
    a.etcd.password = o->password;
    if (o->standalone) {
        if (agent_standalone_start(&a.sa, msg, sizeof(msg)) != 0) {
            dlog_error(&a.lg, "standalone_failed", "--standalone: %s", msg);
            a.exit_code = AGENT_EXIT_ERROR;
            goto out;
        }
        a.etcd.endpoints = a.sa.endpoint;
        dlog_info(&a.lg, "standalone", "private etcd at %s", a.sa.endpoint);
    }
    if (o->http_port > 0) {
        a.http = agent_http_start(o->http_port, msg, sizeof(msg));
        if (!a.http) {
            dlog_error(&a.lg, "http_failed", "--http-port: %s", msg);
            a.exit_code = AGENT_EXIT_ERROR;
            goto out;
        }
    }
    a.logs.redirects = o->redirects;
    a.logs.tee = o->tee;
    a.logs.ranks_filter = o->ranks_filter;
    if (agent_logs_open(&a.logs, o->log_dir, o->job, msg, sizeof(msg)) != 0) {
        dlog_error(&a.lg, "log_dir_failed", "%s", msg);
        a.exit_code = o->log_dir ? AGENT_EXIT_USAGE : AGENT_EXIT_ERROR;
        goto out;
    }
    if (o->log_dir || o->redirects || o->tee)
        dlog_info(&a.lg, "log_dir", "worker files in %s", a.logs.run_dir);
    if (o->k8s_events) {
        a.events = agent_events_start(&a.lg, o->node_id, msg, sizeof(msg));
        if (!a.events) {
            dlog_error(&a.lg, "k8s_events_failed", "--k8s-events: %s", msg);
            a.exit_code = AGENT_EXIT_USAGE;
            goto out;
        }
    }
    publish(&a);

    a.cfg = (rdzv_config){.etcd = a.etcd,
                          .job = o->job,
                          .node_id = o->node_id,
                          .addr = o->node_addr,
                          .local_world_size = o->nproc,
                          .min_nodes = o->min_nodes,
                          .max_nodes = o->max_nodes,
                          .last_call_ms = o->last_call_ms,
                          .lease_ttl_s = o->lease_ttl_s,
                          .join_timeout_ms = o->join_timeout_ms,
                          .max_restarts = o->max_restarts,
                          .install_id = o->install_id};
    dlog_info(&a.lg, "start",
              "joining job %s at %s as node %s (%s), %d workers, nodes %d:%d, rebuild %s", o->job,
              a.etcd.endpoints, o->node_id, o->node_addr, o->nproc, o->min_nodes, o->max_nodes,
              o->inplace ? "inplace" : "restart");
    /* The spares import while the rendezvous forms. */
    char why[AGENT_MSG_MAX];
    if (agent_warm_init(&a.warm, o->cmd, o->preload, o->inplace, o->nproc, why, sizeof(why)) != 0) {
        dlog_error(&a.lg, "spare_failed", "out of memory");
        a.exit_code = AGENT_EXIT_ERROR;
        goto out;
    }
    if (a.warm.argv)
        dlog_info(&a.lg, "spares",
                  "a warm interpreter per local worker imports %s ahead of each launch",
                  a.warm.modules);
    else if (strcmp(o->preload, "auto") == 0)
        dlog_debug(&a.lg, "no_spares", "no warm interpreters: %s", why);
    else if (strcmp(o->preload, "none") != 0)
        dlog_info(&a.lg, "no_spares", "no warm interpreters despite --preload %s: %s", o->preload,
                  why);
    agent_warm_fill(&a.warm, &a.lg);
    msg[0] = 0;
    int live = 0;
    rdzv_err err = open_job(&a, msg, &live);
    if (err == RDZV_ERR_JOB_DONE) {
        dlog_info(&a.lg, "exit", "exiting with code 0: job %s is already complete", o->job);
        a.rz = NULL;
        a.exit_code = AGENT_EXIT_OK;
        goto out;
    }
    if (err != RDZV_OK) {
        /* Ended in an earlier install: retrying cannot help, unless old
         * agents were still registered when this one came to start over. */
        int again = err == RDZV_ERR_JOB_ENDED_ELSEWHERE && live > 0;
        a.exit_code = err == RDZV_ERR_JOB_FAILED                      ? AGENT_EXIT_JOB_FAILED
                      : err == RDZV_ERR_ARG                           ? AGENT_EXIT_USAGE
                      : err == RDZV_ERR_JOB_ENDED_ELSEWHERE && !again ? AGENT_EXIT_USAGE
                                                                      : AGENT_EXIT_ERROR;
        dlog_error(&a.lg, err == RDZV_ERR_JOB_FAILED ? "exit_failed" : "rdzv_error",
                   "exiting with code %d: %s%s%s", a.exit_code, rdzv_strerror(err),
                   msg[0] ? ": " : "", msg);
        a.rz = NULL;
        goto out;
    }
    int took_over = 0;
    int64_t inc = rdzv_incarnation(a.rz, &took_over);
    if (took_over)
        dlog_warn(&a.lg, "took_over",
                  "node id %s was registered by incarnation %lld, which is gone: took its place "
                  "as incarnation %lld",
                  o->node_id, (long long)(inc - 1), (long long)inc);
    run_loop(&a);

out:
    /* Whatever path got here, nothing is left running. */
    if (a.ws.w) {
        agent_workers_signal(&a.ws, SIGKILL);
        for (int i = 0; i < a.ws.n; i++)
            if (!a.ws.w[i].exited && a.ws.w[i].pid > 0) waitpid(a.ws.w[i].pid, NULL, 0);
        agent_workers_free(&a.ws);
    }
    agent_warm_free(&a.warm);
    agent_master_cancel(&a.master);
    agent_task_cancel(&a.report);
    agent_task_cancel(&a.finish);
    agent_events_stop(a.events); /* what is queued (a failed job's Event) goes out first */
    if (a.rz) rdzv_close(a.rz);  /* a task still running holds it: it frees it last */
    agent_http_stop(a.http);
    agent_standalone_stop(&a.sa);
    agent_logs_close(&a.logs);
    rdzv_round_free(&a.round);
    if (a.have_pending) rdzv_round_free(&a.pending);
    /* A task still blocked in libcurl: leave curl's globals be. */
    if (atomic_load(&a.tasks) == 0) curl_global_cleanup();
    return a.exit_code;
}
