/* agent.h: the agent proper: one node's round state machine (agent.c and
 * its rooms, listed in agent_internal.h).
 *
 * main.c parses the options, makes the logger and the signalfd, and hands
 * over to agent_run(), which joins the job, runs the workers round after
 * round, and returns what the process exits with: one of AGENT_EXIT_*.
 * The rooms (through agent_internal.h) are the files that include the
 * other modules' headers (options.h, workers.h, warm.h, http.h,
 * standalone.h); none of them includes this. warm.c uses workers.h (a
 * warm spare is started as a worker is) and never the other way round: a
 * launch adopts a spare through the agent_adopt agent_warm_adopt gives.
 */
#ifndef DUCTILE_AGENT_AGENT_H
#define DUCTILE_AGENT_AGENT_H

#include "options.h"

#include "ductile/log.h"

/* The longest one-line message (why something failed) the agent's modules
 * write for each other. */
#define AGENT_MSG_MAX 256

/* Exit codes: what a pod's end means (a Job's podFailurePolicy keys on them). */
enum {
    AGENT_EXIT_OK = 0,         /* the job completed, or this node left it cleanly (SIGTERM) */
    AGENT_EXIT_ERROR = 1,      /* this agent failed (a worker failure it could not record, a
                                  rendezvous error, etcd unreachable at start): counts */
    AGENT_EXIT_USAGE = 2,      /* bad flags, environment or job limits: retrying cannot help */
    AGENT_EXIT_JOB_FAILED = 3, /* the job failed: its restart budget is spent */
    AGENT_EXIT_DROPPED = 4,    /* this node was dropped through no fault of its own (its
                                  lease ended and it could not register again): not a
                                  failure of the pod */
    AGENT_EXIT_LEFT = 5,       /* left a still-running job on SIGTERM, when
                                  --leave-exit-code 5 asks (the chart's Job kind): the pod
                                  is replaced, its index not complete */
    AGENT_EXIT_NO_ROUND = 6,   /* no round could take this node within --join-timeout: too
                                  few nodes came (the scheduler has placed only part of the
                                  job). A wait, not a failure of the pod */
};

/* Runs this node of the job o describes until the job, or this node's part
 * in it, ends; returns the exit code. Signals (SIGTERM, SIGINT, SIGCHLD)
 * arrive on sigfd, which the caller blocked them for and still owns. */
int agent_run(const agent_opts *o, const dlog *lg, int sigfd);

#endif
