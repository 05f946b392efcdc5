/* workers.h: this node's worker processes (workers.c) and the control
 * channel to each of them (control.c).
 *
 * A worker is a child process with three file descriptors the agent reads:
 * its stdout and stderr, passed through line by line, and its end of the
 * control channel (control.h). The agent's loop polls them; these functions
 * do the reading, the spawning, the signalling and the reaping.
 */
#ifndef DUCTILE_AGENT_WORKERS_H
#define DUCTILE_AGENT_WORKERS_H

#include "logs.h"
#include "progress.h"

#include "ductile/control.h"
#include "ductile/log.h"
#include "ductile/rdzv.h"

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

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
    agent_progress prog; /* samples, rate and loss from its `step` lines */
    int ready;
    int version; /* control protocol version of its `hello`; 0 before one */
    int inplace; /* said `hello CTL_VERSION inplace`: it may be kept across rounds */
    /* The progress watchdog's view (watchdog.c); times are mono_now_s(). */
    int watched;               /* said `step`: the watchdog bounds it */
    int beats;                 /* says `phase`, so repeats it (CTL_HEARTBEAT_MS) */
    char phase[CTL_PHASE_MAX]; /* last `phase`, "" before the first */
    double progress_at;        /* last new step or change of phase */
    double heard_at;           /* last message of any kind */
    char hung[200];            /* why the watchdog killed it; "" if it did not */
    int failed_reported;       /* sent "failed" in this round */
    unsigned sent;             /* bit 1u << sig for each signal the agent sent it */
    /* torchrun's files (logs.h): -1 when a stream has none. */
    int out_log, err_log;
    unsigned console; /* AGENT_STD_* bits of the streams shown on the console */
    char *error_file; /* TORCHELASTIC_ERROR_FILE; NULL without logs */
} agent_worker;

typedef struct agent_workers {
    int n;
    agent_worker *w;
    int alive; /* spawned and not yet reaped */
} agent_workers;

/* What one round gives every worker in its environment (CTL_ENV_VARS). */
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
    const char *node_id;   /* --node-id */
    int64_t restarts;
    int max_restarts;
    const char *job;
    const char *role;
    const char *store_prefix;
    rdzv_etcd etcd;         /* endpoints, and the credentials passed on (CTL_ENV_CREDENTIALS) */
    const agent_logs *logs; /* its attempt directory made; NULL: no files */
} agent_round_env;

/* Where a launch may find a rank's worker ready-made instead of forking
 * one (the warm spares give one: agent_warm_adopt, warm.h). take makes w
 * local rank lr's worker in the round env describes, error_file its
 * TORCHELASTIC_ERROR_FILE or NULL, and returns 0; or returns -1 when it
 * has none for lr. Workers know nothing else of where it came from. */
typedef struct agent_adopt {
    int (*take)(void *ctx, int lr, const agent_round_env *env, const char *error_file,
                agent_worker *w);
    void *ctx;
} agent_adopt;

/* Starts env->local_world_size workers running argv; a local rank that
 * adopt (may be NULL) has a worker for takes it instead, and *adopted
 * counts those. 0 on success; on failure msg says why and nothing is left
 * running. */
int agent_workers_spawn(agent_workers *ws, const agent_round_env *env, char *const argv[],
                        const agent_adopt *adopt, int *adopted, char *msg, size_t msglen);
/* Starts one child running argv with envp, wired as a worker is (stdout,
 * stderr, the control channel at fd 3, its own process group, killed with
 * the agent) into w (zeroed first). With go_w, also a pipe whose read end
 * the child holds at fd 4 and whose non-blocking write end *go_w gets: a
 * warm spare's go pipe. 0 on success; else msg says why. */
int agent_child_start(agent_worker *w, char *const argv[], char **envp, int *go_w, char *msg,
                      size_t msglen);
/* A warm spare's environment: the agent's own minus the names it sets for
 * workers, with the workers' OMP_NUM_THREADS rule and name=value. NULL when
 * out of memory; agent_env_free frees it. */
char **agent_spare_env(int local_world_size, const char *name, const char *value);
void agent_env_free(char **env);
/* Local rank lr's whole worker environment (error_file: its
 * TORCHELASTIC_ERROR_FILE, or NULL) as NUL-terminated KEY=VALUE entries, one after another (*len
 * bytes in all); malloc'd, NULL when out of memory. */
char *agent_round_env_block(const agent_round_env *r, int lr, const char *error_file, size_t *len);
/* Sends sig to every live worker's process group. A worker that has already
 * ended (not yet reaped) is not sent it: its end stays its own. */
void agent_workers_signal(agent_workers *ws, int sig);
/* 1 when a reaped worker's end is its own failure (the failure-counting
 * rule's first-hand): killed by the watchdog as hung, killed by a signal
 * the agent did not send it, or
 * exited non-zero, other than CTL_EXIT_PEER_LOST, before the agent sent it
 * any signal. Which way a reap and a round's end race does not change it. */
int agent_worker_first_hand(const agent_worker *w);
/* Records the exit of pid; returns the worker or NULL if not ours. */
agent_worker *agent_workers_reaped(agent_workers *ws, pid_t pid, int status);
/* Reads what is readable on fd (a worker's out/err pipe) and passes whole
 * lines through with a "[rank] " prefix, and as they are to the stream's
 * log file if it has one; closes the fd at EOF. */
void agent_workers_read_output(agent_workers *ws, agent_worker *w, int fd);
/* Closes every fd and frees the array (workers must all be reaped). */
void agent_workers_free(agent_workers *ws);
/* Describes how a worker ended ("exited with code 1", "killed by SIGSEGV"),
 * with the first line of its error file's message after a failure. */
void agent_worker_describe(const agent_worker *w, char *out, size_t len);

/* ---- the control channel (control.c) ---- */

/* Sends one message to a worker; -1 when its channel is gone. */
int agent_ctl_send(agent_worker *w, const ctl_msg *m);
/* Reads what is readable on w->ctl_fd; each whole message goes to on_msg.
 * Closes the fd at EOF. Malformed lines are logged and dropped. */
void agent_ctl_read(agent_worker *w, const dlog *lg,
                    void (*on_msg)(void *ctx, agent_worker *w, const ctl_msg *m), void *ctx);

#endif
