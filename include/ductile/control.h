/* control.h: the contract between ductile-agent and its workers: the
 * environment it starts them with, and the control channel it keeps to them.
 * It sits below both the agent and the trainer; neither includes the other.
 *
 * ---- the control channel ----
 *
 * The agent gives each worker one end of a SOCK_STREAM socketpair as file
 * descriptor DUCTILE_CONTROL_FD. Both sides speak text lines: one message per
 * line, ended by '\n', at most CTL_MAX_LINE bytes, words separated by
 * single spaces. Text keeps the channel usable from any language (a Python
 * worker can read it with socket.fromfd(...).makefile()).
 *
 * agent -> worker
 *   round N RANK WORLD LOCAL_RANK GROUP_RANK GROUP_WORLD RESTARTS ADDR PORT PREFIX
 *         round N froze and this worker holds global rank RANK of WORLD;
 *         MASTER_ADDR/MASTER_PORT of the round are ADDR and PORT, its store
 *         prefix is PREFIX (/ductile/<job>/rounds/<N>/store/). In inplace
 *         mode this is how a kept worker learns its next round; the worker's
 *         environment only describes the round it was started in.
 *   abort N KIND
 *         round N ended; keep the process and its state, and wait for the
 *         next `round` line. KIND says how to end the step in flight:
 *         graceful (a node is waiting with room, a member leaves cleanly):
 *           every member is alive, so let the step finish however long it
 *           takes (bounded only by the collective timeout) and stop at its
 *           boundary: no step is lost;
 *         lost (a member's lease ended, a peer failed, the round was
 *           superseded): a peer is gone, abandon the collectives now.
 *         `abort N` without KIND means lost.
 *   stop
 *         the agent is shutting down (SIGTERM): finish the current step,
 *         save, exit 0. The worker also receives SIGTERM.
 *   hello VERSION MODE
 *         the agent's answer to every `hello`: it speaks control protocol
 *         VERSION (CTL_VERSION) and its --rebuild is MODE, inplace or
 *         restart.
 *
 * worker -> agent (all optional; a worker that never writes is fine)
 *   hello VERSION [inplace]
 *                   the worker speaks control protocol VERSION (a decimal
 *                   integer >= 1); inplace: it keeps its process across
 *                   rounds (reads `round` and `abort` lines and rebuilds its
 *                   group itself). Sent once, at start (before or after
 *                   `ready`). In inplace mode the agent keeps a node's
 *                   workers at a round's end only when every one of them
 *                   said `hello CTL_VERSION inplace`; otherwise it restarts
 *                   them all (a worker that never says it, an unmodified
 *                   PyTorch script, could not learn its new round).
 *   ready           set up for the current round
 *   step K [samples N] [loss L]
 *                   finished step K; the next step's local work begins.
 *                   The optional fields, in either order, each at most once:
 *                   samples N, the samples this worker has processed in all
 *                   (its own share, an integer that only grows while the
 *                   process lives: the agent uses differences, so a worker
 *                   that skips reporting a step loses nothing), and loss L,
 *                   the worker's training loss of step K (a finite decimal
 *                   number). A bad field makes the whole line invalid.
 *   phase NAME      what the worker does now, one word [a-z_]{1,31}: comm
 *                   (waiting on peers in a collective) and rebuild (building
 *                   the next round's group, agreeing on state, waiting for a
 *                   round) wait on other processes and are bounded by the
 *                   worker's own deadlines; every other name (compute, eval,
 *                   save, data, ...) is local work. A worker that says
 *                   `phase` says it again at least every CTL_HEARTBEAT_MS
 *                   while it lives (from a thread of its own, so a long
 *                   local step still shows the process is there).
 *                   The progress watchdog (--hang-timeout BOUND): once a
 *                   worker has said `step`, its agent kills it, as this
 *                   node's first-hand failure, when it stays in one local
 *                   phase with no new step for BOUND, or says nothing at
 *                   all for BOUND; and, in inplace mode, when a new round
 *                   would keep a worker that says `phase` but has been
 *                   silent for CTL_SILENT_MS (a stopped or wedged process is
 *                   never carried into the next round). A worker that never
 *                   says `step` is not watched.
 *   failed REASON   this worker failed first-hand (not because a peer went
 *                   away); REASON is the rest of the line. The agent ends the
 *                   round as a failure, which counts against --max-restarts,
 *                   and, in inplace mode, keeps the process.
 *   peer_lost N REASON
 *                   in round N a peer vanished under a collective (its
 *                   connection closed or it timed out), or round N's group
 *                   could not be built. The agent ends round N as a
 *                   membership change that does not count against
 *                   --max-restarts (see docs: the failure-counting rule).
 *                   Ignored when the agent is no longer in round N.
 *
 * ---- the environment ----
 *
 * CTL_ENV_VARS lists every variable the agent sets for a worker (inherited
 * values of these are dropped first): the torchrun names, so a PyTorch
 * script runs unchanged, and DUCTILE_* for what ductile-train needs to
 * rebuild its group. The agent also passes on its etcd credentials
 * (CTL_ENV_CREDENTIALS) and DUCTILE_WORKER_FAILPOINTS as DUCTILE_FAILPOINTS.
 *
 * The line parser and formatter are libductile-control (control/): a C
 * worker links it; python/ductile/control.py speaks the same lines, and
 * tests/control/wire_cases.txt is the wire format both sides are tested on.
 */
#ifndef DUCTILE_CONTROL_H
#define DUCTILE_CONTROL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* The control protocol's version, in `hello`. */
#define CTL_VERSION 1
#define CTL_MAX_LINE 1024
/* The longest REASON of `failed` and `peer_lost`, with its NUL. */
#define CTL_REASON_MAX 512
/* The longest NAME of `phase`, with its NUL. */
#define CTL_PHASE_MAX 32
/* The phases that wait on other processes (not watched for progress). */
#define CTL_PHASE_COMM "comm"
#define CTL_PHASE_REBUILD "rebuild"
/* A worker that says `phase` repeats it at least this often. */
#define CTL_HEARTBEAT_MS 1000
/* Silence, from a worker that says `phase`, that keeps it out of a new round. */
#define CTL_SILENT_MS (5 * CTL_HEARTBEAT_MS)
/* The longest ADDR and PREFIX of `round`, with their NUL. */
#define CTL_ADDR_MAX 256
#define CTL_PREFIX_MAX 512

/* X(NAME, what the agent puts there) for every variable it sets. */
#define CTL_ENV_VARS(X)                                                                            \
    X(CTL_ENV_RANK, "global rank of this worker in the round")                                     \
    X(CTL_ENV_LOCAL_RANK, "rank among this node's workers")                                        \
    X(CTL_ENV_WORLD_SIZE, "workers in the round")                                                  \
    X(CTL_ENV_LOCAL_WORLD_SIZE, "workers on this node (--nproc-per-node)")                         \
    X("GROUP_RANK", "this node's rank in the round")                                               \
    X("GROUP_WORLD_SIZE", "nodes in the round")                                                    \
    X("ROLE_RANK", "as RANK (one role)")                                                           \
    X("ROLE_WORLD_SIZE", "as WORLD_SIZE (one role)")                                               \
    X("ROLE_NAME", "--role")                                                                       \
    X("MASTER_ADDR", "node rank 0's address")                                                      \
    X("MASTER_PORT", "a free port node rank 0 published for the round")                            \
    X("TORCHELASTIC_RESTART_COUNT", "failures counted so far")                                     \
    X("TORCHELASTIC_MAX_RESTARTS", "--max-restarts")                                               \
    X("TORCHELASTIC_RUN_ID", "--rdzv-id")                                                          \
    X("TORCHELASTIC_ERROR_FILE", "where torch's @record writes the worker's error")                \
    X(CTL_ENV_ENDPOINTS, "the etcd endpoints, comma-separated")                                    \
    X(CTL_ENV_JOB, "the job id (--rdzv-id)")                                                       \
    X(CTL_ENV_ROUND, "the round the worker was started in")                                        \
    X(CTL_ENV_STORE_PREFIX, "that round's store prefix in etcd")                                   \
    X(CTL_ENV, "the control channel's file descriptor")                                            \
    X(CTL_ENV_NODE_ADDR, "this node's address: workers listen there")                              \
    X(CTL_ENV_NODE_ID, "this node's id (--node-id): named in a refused round's line")              \
    X(CTL_ENV_FAILPOINTS, "the worker's failpoints (the agent's are not inherited)")

#define CTL_ENV_RANK "RANK"
#define CTL_ENV_LOCAL_RANK "LOCAL_RANK"
#define CTL_ENV_WORLD_SIZE "WORLD_SIZE"
#define CTL_ENV_LOCAL_WORLD_SIZE "LOCAL_WORLD_SIZE"
#define CTL_ENV "DUCTILE_CONTROL_FD"
#define CTL_ENV_ENDPOINTS "DUCTILE_ETCD_ENDPOINTS"
#define CTL_ENV_JOB "DUCTILE_JOB"
#define CTL_ENV_ROUND "DUCTILE_ROUND"
#define CTL_ENV_STORE_PREFIX "DUCTILE_STORE_PREFIX"
#define CTL_ENV_NODE_ADDR "DUCTILE_NODE_ADDR"
#define CTL_ENV_NODE_ID "DUCTILE_NODE_ID"
#define CTL_ENV_FAILPOINTS "DUCTILE_FAILPOINTS"
/* X(NAME, rdzv_etcd field): the credentials, passed on only when set. */
#define CTL_ENV_CREDENTIALS(X)                                                                     \
    X("DUCTILE_ETCD_CACERT", cacert)                                                               \
    X("DUCTILE_ETCD_CERT", cert)                                                                   \
    X("DUCTILE_ETCD_KEY", key)                                                                     \
    X("DUCTILE_ETCD_USER", user)                                                                   \
    X("DUCTILE_ETCD_PASSWORD", password)
/* A worker that exits with this status (EX_TEMPFAIL) lost a peer, as if it
 * had said `peer_lost` for its round: for a worker that could not build its
 * group at all, or any program that can tell (a PyTorch script can
 * sys.exit(75) on a lost gloo/NCCL peer). Not counted against
 * --max-restarts. */
#define CTL_EXIT_PEER_LOST 75

typedef enum {
    CTL_INVALID = 0,
    CTL_ROUND,     /* agent -> worker */
    CTL_ABORT,     /* agent -> worker */
    CTL_STOP,      /* agent -> worker */
    CTL_READY,     /* worker -> agent */
    CTL_STEP,      /* worker -> agent */
    CTL_FAILED,    /* worker -> agent */
    CTL_PEER_LOST, /* worker -> agent */
    CTL_PHASE,     /* worker -> agent */
    CTL_HELLO,     /* both ways */
} ctl_type;

/* HELLO's MODE: none (a worker's `hello VERSION`), inplace or restart. */
enum { CTL_MODE_NONE = 0, CTL_MODE_INPLACE = 1, CTL_MODE_RESTART = 2 };

typedef struct ctl_msg {
    ctl_type type;
    int64_t round; /* ROUND, ABORT, PEER_LOST */
    int graceful;  /* ABORT: 1 graceful, 0 lost */
    int rank;      /* ROUND: global rank */
    int world_size;
    int local_rank;
    int group_rank;
    int group_world_size;
    int64_t restarts;
    char master_addr[CTL_ADDR_MAX];
    int master_port;
    char store_prefix[CTL_PREFIX_MAX];
    int64_t step;                /* STEP */
    int has_samples, has_loss;   /* STEP: which optional fields it carries */
    int64_t samples;             /* STEP: samples this worker processed in all */
    double loss;                 /* STEP: the step's loss, finite */
    char phase[CTL_PHASE_MAX];   /* PHASE */
    char reason[CTL_REASON_MAX]; /* FAILED, PEER_LOST */
    int version;                 /* HELLO: 1..INT_MAX */
    int mode;                    /* HELLO: CTL_MODE_* */
} ctl_msg;

/* Parses one decimal integer word in [min, max]; 0 on success. */
int ctl_int(const char *word, int64_t min, int64_t max, int64_t *out);

/* 1 when name is a valid phase name: [a-z_]{1,31}. */
int ctl_phase_valid(const char *name);

/* 1 when a worker in this phase waits on other processes (comm, rebuild). */
static inline int ctl_phase_waits(const char *name)
{
    return strcmp(name, CTL_PHASE_COMM) == 0 || strcmp(name, CTL_PHASE_REBUILD) == 0;
}

/* Parses one line (with or without its '\n'). Returns 0 and fills *m, or -1
 * when the line is not a valid message (control/parse.c). */
int ctl_parse(const char *line, ctl_msg *m);

/* Formats m as one line with its '\n'. Returns the length, or -1 when it
 * does not fit in len or the message is invalid (control/format.c). */
int ctl_format(const ctl_msg *m, char *out, size_t len);

#endif
