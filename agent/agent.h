/* agent.h: what the agent's files share (private to agent/).
 *
 * main.c owns the options, the poll() loop and the round state machine;
 * workers.c spawns, reads and stops the worker processes; http.c serves
 * probes and metrics from a snapshot main publishes; standalone.c runs a
 * private etcd; status.c is the `status` subcommand; control.c talks the
 * control protocol of control.h to workers.
 */
#ifndef DUCTILE_AGENT_H
#define DUCTILE_AGENT_H

#include "ductile/control.h"
#include "ductile/rdzv.h"

#include <stdint.h>
#include <sys/types.h>

/* ---- exit codes: what a pod's end means (a Job's podFailurePolicy keys on them) ---- */

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
};

/* ---- logging: one line per event, text or JSON, to stderr ---- */

typedef struct agent_logger {
    const char *node;
    int json;
} agent_logger;

void agent_log(const agent_logger *lg, const char *event, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

double agent_now(void); /* monotonic seconds */

/* ---- workers ---- */

/* Accumulates bytes into lines; a line longer than the buffer is cut. */
typedef struct agent_linebuf {
    char buf[CTL_MAX_LINE + 1];
    size_t len;
} agent_linebuf;

typedef struct agent_worker {
    pid_t pid; /* 0 once reaped */
    int local_rank;
    int rank;   /* global rank in the current round */
    int out_fd; /* read ends; -1 once closed */
    int err_fd;
    int ctl_fd;
    agent_linebuf out, err, ctl;
    int exited; /* reaped */
    int status; /* waitpid status once exited */
    int64_t step;
    int ready;
    int failed_reported; /* sent "failed" in this round */
    int signalled;       /* the agent sent it a signal: its death is not first-hand */
    char failed_reason[256];
} agent_worker;

typedef struct agent_workers {
    int n;
    agent_worker *w;
    int alive; /* spawned and not yet reaped */
} agent_workers;

/* What one round gives every worker in its environment. */
typedef struct agent_round_env {
    int64_t round;
    int world_size;
    int group_rank;
    int group_world_size;
    int first_rank;
    int local_world_size;
    const char *master_addr;
    int master_port;
    const char *node_addr; /* this node's address: workers listen there */
    int64_t restarts;
    int max_restarts;
    const char *job;
    const char *role;
    const char *endpoints;
    const char *store_prefix;
    const char *cacert, *cert, *key, *user, *password;
} agent_round_env;

/* Starts env->local_world_size workers running argv. 0 on success; on
 * failure msg says why and nothing is left running. */
int agent_workers_spawn(agent_workers *ws, const agent_round_env *env, char *const argv[],
                        char *msg, size_t msglen);
/* Sends sig to every live worker's process group. */
void agent_workers_signal(agent_workers *ws, int sig);
/* Records the exit of pid; returns the worker or NULL if not ours. */
agent_worker *agent_workers_reaped(agent_workers *ws, pid_t pid, int status);
/* Reads what is readable on fd (a worker's out/err pipe) and passes whole
 * lines through with a "[rank] " prefix; closes the fd at EOF. */
void agent_workers_read_output(agent_workers *ws, agent_worker *w, int fd);
/* Closes every fd and frees the array (workers must all be reaped). */
void agent_workers_free(agent_workers *ws);
/* Describes how a worker ended ("exited with code 1", "killed by SIGSEGV"). */
void agent_worker_describe(const agent_worker *w, char *out, size_t len);

/* ---- control channel (control.c) ---- */

/* Sends one message to a worker; -1 when its channel is gone. */
int agent_ctl_send(agent_worker *w, const ctl_msg *m);
/* Reads what is readable on w->ctl_fd; each whole message goes to on_msg.
 * Closes the fd at EOF. Malformed lines are logged and dropped. */
void agent_ctl_read(agent_worker *w, const agent_logger *lg,
                    void (*on_msg)(void *ctx, agent_worker *w, const ctl_msg *m), void *ctx);

/* ---- HTTP endpoint (http.c) ---- */

typedef struct agent_snapshot {
    int64_t round;
    int members;
    int world_size;
    int64_t restarts;
    int workers_running;
    double rdzv_seconds;
    int64_t changes[RDZV_CAUSE_COUNT]; /* by rdzv_cause */
    int ready;
    double heartbeat; /* agent_now() of the loop's last pass */
} agent_snapshot;

typedef struct agent_http agent_http;

/* Serves on 0.0.0.0:port in its own thread. NULL and msg on failure. */
agent_http *agent_http_start(int port, char *msg, size_t msglen);
void agent_http_publish(agent_http *h, const agent_snapshot *s);
void agent_http_stop(agent_http *h);

/* ---- private etcd for --standalone (standalone.c) ---- */

typedef struct agent_standalone {
    pid_t pid;
    char dir[256];
    char endpoint[64];
} agent_standalone;

int agent_standalone_start(agent_standalone *s, char *msg, size_t msglen);
/* Stops the server (SIGTERM, then SIGKILL) and removes its data dir. Safe
 * to call twice. */
void agent_standalone_stop(agent_standalone *s);

/* ---- `ductile-agent status` (status.c) ---- */

int agent_status_main(int argc, char **argv);

#endif
