/* agent_internal.h: the agent's rooms and what they share (private to the
 * files of agent_run; main.c sees agent.h alone).
 *
 * One struct, the agent, holds one node's whole state; one thread, the
 * poll loop, changes it. The rooms are files, each one concern of it:
 *
 *   agent.c   agent_run: sets up what the loop needs, joins the job, runs
 *             the loop, and leaves nothing running behind it
 *   loop.c    the poll loop: what it polls, its timeout from the deadlines,
 *             and the deadlines themselves (SIGKILL, give up, hangs)
 *   round.c   the round state machine: rendezvous events, worker messages,
 *             reaped children and signals turned into actions
 *   launch.c  starting a round's workers (fresh, from warm spares, or kept
 *             in place) and stopping them
 *   report.c  telling etcd why a round ended: the failure-counting rule's
 *             agent side
 *   finish.c  the job marked complete, and the agent's exit; the handle a
 *             task holds (rz_job), for the finish and the reports
 *
 * Calls between the rooms go one way, down this order: agent.c, loop.c,
 * round.c, report.c, launch.c, finish.c; each calls only rooms after it (a
 * launch that fails is returned to round.c, which reports it).
 *
 * The round state machine:
 *
 *   RDZV --frozen--> RUNNING --round ended / worker failed--> STOPPING --all gone--> RDZV
 *     (inplace: a round end keeps the workers and goes straight back to RDZV,
 *      when every one of them said `hello 1 inplace`; see keep_in_place)
 *   RUNNING --all workers exited 0--> FINISHING --job marked complete--> exit 0
 *   any --SIGTERM--> SHUTDOWN --workers gone--> leave, exit 0
 */
#ifndef DUCTILE_AGENT_AGENT_INTERNAL_H
#define DUCTILE_AGENT_AGENT_INTERNAL_H

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

#include "ductile/control.h"
#include "ductile/etcd.h"
#include "ductile/log.h"
#include "ductile/rdzv.h"

#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

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

/* ---- loop.c ---- */

/* Polls until a->done. */
void run_loop(agent *a);
/* The HTTP endpoint's snapshot of a, when there is one. */
void publish(agent *a);

/* ---- round.c ---- */

/* One rendezvous event. */
void on_event(agent *a, rdzv_event *ev);
/* One control message of worker w (agent_ctl_read's on_msg; ctx is the agent). */
void on_ctl(void *ctx, agent_worker *w, const ctl_msg *m);
/* The MASTER_PORT publish or wait answered. */
void on_master(agent *a);
/* A child ended: the private etcd, a warm spare or a worker. */
void on_reaped(agent *a, pid_t pid, int status);
/* SIGTERM or SIGINT (sig names it). */
void begin_shutdown(agent *a, const char *sig);
/* Every worker is reaped: decide what comes next. */
void on_workers_gone(agent *a);

/* ---- launch.c ---- */

/* The workers not yet reaped. */
int workers_alive(const agent *a);
/* One control message to every live worker. */
void send_all(agent *a, const ctl_msg *m);
/* SIGTERM to every worker, SIGKILL after grace_ms. */
void stop_workers(agent *a, int grace_ms);
/* Whether every live worker may be kept at a round's end (--rebuild inplace). */
int keep_in_place(const agent *a);
/* keep_in_place() where round ends, saying once why not when it cannot. */
int keep_at_end(agent *a, int64_t round);
/* Runs the current round's workers, its MASTER_PORT known; -1 with why when
 * they cannot start (the caller reports this node's failure). */
int launch_round(agent *a, const char *maddr, int mport, char *why, size_t len);
/* Whether a spare that died is started again. */
int spares_wanted(const agent *a);

/* ---- report.c ---- */

/* Tells etcd why the round ends, once a round, on a task. */
void report_start(agent *a, const char *reason, int first_hand, int suspect);
void report_failure(agent *a, const char *reason, int first_hand);
/* The report's answer arrived. */
void on_report(agent *a);
/* Whether a reaped worker's end may be a peer's death seen from here. */
int exit_may_be_peer(const agent *a, const agent_worker *w);
/* The JobFailed Event, once, from node rank 0 of the last round. */
void post_job_failed(agent *a);

/* ---- finish.c ---- */

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

rz_job *rz_job_new(agent *a);
void rz_job_free(void *p);
/* Leaves the job and ends the loop with exit code code; how says why. */
void agent_finish(agent *a, int code, const char *how);
/* Every worker exited 0: mark the job complete, on a task. */
void start_finish(agent *a);
/* The finish's answer arrived. */
void on_finish(agent *a);

#endif
