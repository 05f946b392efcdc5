/* elastic.h: the trainer's side of the agent's in-place rebuild protocol.
 *
 * Under ductile-agent a trainer has a control channel (DUCTILE_CONTROL_FD,
 * ductile/control.h). A thread reads it. `abort N KIND` marks round N as
 * ending, so the trainer votes to stop after the step in flight (a clean
 * step boundary, no step lost). How the step in flight ends is KIND's,
 * never a clock's: graceful (every member is alive) lets it finish however
 * long it takes, bounded only by the collectives' own deadline; lost (a
 * peer is gone) aborts the communicator at once, the step fails and is
 * discarded. `round N ...` is the next round: the trainer rebuilds its ring
 * through round N's store (trainer/group.c) and the group agrees on the
 * most advanced state (ddp_sync_state, with the agreement below).
 * A newer round while the current one ends gracefully changes nothing for
 * the step in flight; a newer round with no `abort` before it counts as
 * lost.
 *
 * The agreement: every rank says (has state, round of that state, steps
 * done); the newest (round, step) wins, lowest rank on ties, and that rank
 * broadcasts the training position, parameters and optimizer state to all,
 * newcomers included. A rank cut off in an old round carries an old round
 * number, so it can never win over the job that went on without it; a rank
 * whose copy of the broadcast broke half-way keeps its old state and claim
 * (elastic_share), so a half-received state can never win either.
 *
 * Failures go back to the agent as one of two kinds (ductile/control.h):
 * `peer_lost N` when a peer vanished under a collective or round N's group
 * could not be built (a membership change), `failed` when this worker
 * failed first-hand (it counts against --max-restarts).
 */
#ifndef DUCTILE_ELASTIC_H
#define DUCTILE_ELASTIC_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>

#include "ductile/comm.h"

typedef enum {
    ELASTIC_OK = 0,
    ELASTIC_ERR_ARG,
    ELASTIC_ERR_NOMEM,
    ELASTIC_ERR_SYS,
    ELASTIC_ERR_CLOSED,  /* the agent closed the control channel */
    ELASTIC_ERR_TIMEOUT, /* no new round before the deadline */
    ELASTIC_ERR_STOP,    /* asked to stop (signal or `stop`) */
    ELASTIC_ERR_COMM,    /* a collective of the agreement failed */
} elastic_err;

const char *elastic_strerror(elastic_err err);

/* How long a kept trainer waits for the next round (the job may be below
 * its minimum size for a while) before giving up. */
#define ELASTIC_WAIT_MS (30 * 60 * 1000)

typedef struct elastic elastic;

/* The round the trainer was started in, as the agent announces it. */
typedef struct elastic_round {
    int64_t round;
    int rank, world, local_rank;
    char store_prefix[512];
} elastic_round;

/* Says `hello CTL_VERSION inplace` on control channel fd: this trainer
 * keeps its process across rounds. Under an agent, once, as soon as the
 * channel is known (before the first group forms), whatever the agent's
 * rebuild mode; the agent's own `hello` answer is read and ignored. An
 * agent in inplace mode restarts, rather than keeps, a worker that has not
 * said it. ELASTIC_ERR_SYS when the line cannot be written. */
elastic_err elastic_hello(int fd);

/* Starts reading control channel fd for a trainer started in `round`. */
elastic_err elastic_open(int fd, int64_t round, elastic **out);
void elastic_close(elastic *e);

/* The communicator a lost ending may abort (NULL: none). Call with NULL
 * before freeing a communicator. Also sets the trainer's current round; a
 * communicator attached to a round that already ended as lost (or that a
 * newer round superseded with no graceful `abort`) is aborted at once. */
void elastic_attach(elastic *e, comm *c, int64_t round);
/* 1 once the agent has sent a `round` line: it rebuilds in place. */
int elastic_inplace(elastic *e);
/* 1 when the collectives of the current round must be abandoned now (it
 * ended as lost, or a newer round came with no graceful `abort`): what
 * aborts an attached communicator, for a group still being built
 * (comm_config.cancelled; ctx is the elastic). */
int elastic_cancelled(void *ctx);
/* 1 when the current round has been told to end: vote to stop. */
int elastic_ending(elastic *e);
/* What the training loop does, for the agent's progress watchdog
 * (control.h: `phase`): local work, or a wait on other processes (comm,
 * rebuild) that the trainer's own deadlines bound. */
typedef enum {
    ELASTIC_PHASE_COMPUTE, /* forward, backward, the optimizer, the data */
    ELASTIC_PHASE_COMM,    /* waiting for a collective */
    ELASTIC_PHASE_REBUILD, /* between rounds: the next group, the state sync */
    ELASTIC_PHASE_EVAL,    /* scoring the test set */
    ELASTIC_PHASE_SAVE,    /* writing a checkpoint */
} elastic_phase;

/* Progress and failure reports to the agent (best effort). Step K finished
 * (the loop is computing again), with the samples this process has trained
 * on in all (-1: not reported) and the step's loss (NAN: not reported), and
 * the phase are only recorded: the control thread says
 * `step K samples N loss L` at once and `phase NAME` when it changes and
 * every CTL_HEARTBEAT_MS, from the first step on. `failed WHY` (a
 * first-hand failure) and `peer_lost ROUND WHY` (a peer vanished in ROUND,
 * or ROUND's group could not be built) are sent by the caller. Both setters
 * take NULL (no agent). */
void elastic_report_step(elastic *e, int64_t step, int64_t samples, double loss);
void elastic_set_phase(elastic *e, elastic_phase phase);
void elastic_report_failed(elastic *e, const char *why);
void elastic_report_peer_lost(elastic *e, int64_t round, const char *why);

/* Waits for a round newer than the current one; ELASTIC_ERR_STOP when
 * *stop becomes non-zero or the agent sends `stop`. */
elastic_err elastic_wait_round(elastic *e, volatile sig_atomic_t *stop, int timeout_ms,
                               elastic_round *out);

/* The agreement on c: *root is the rank whose state everyone takes. */
typedef struct elastic_claim {
    int64_t has_state; /* 0 for a fresh process without a checkpoint */
    int64_t round;     /* the round its state was made in */
    int64_t step;
} elastic_claim;
elastic_err elastic_agree(comm *c, const elastic_claim *mine, int *root, elastic_claim *best);

/* One piece of the state the agreement's winner sends to all: host
 * memory, or device memory with a device scratch buffer of the same size
 * (scratch set), which a receiver's broadcast goes into, device to device,
 * and which the caller adopts as the part once elastic_share succeeded. */
typedef struct elastic_part {
    void *data;
    size_t bytes;
    void *scratch; /* NULL: received into a host copy, then copied into data */
} elastic_part;

/* Broadcasts parts[0..n) from root. Every other rank receives them into
 * scratch memory (its own host copy, or the part's scratch) and copies
 * the host ones into its parts only after every broadcast succeeded: on any
 * error its parts are as they were, so its claim in the next agreement
 * still matches its state. ELASTIC_ERR_COMM when a broadcast failed
 * (comm_last_error says why), ELASTIC_ERR_NOMEM without scratch. */
elastic_err elastic_share(comm *c, int root, const elastic_part *parts, int n);
#endif
