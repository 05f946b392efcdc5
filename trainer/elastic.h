/* elastic.h: the trainer's side of the agent's in-place rebuild protocol.
 *
 * Under ductile-agent a trainer has a control channel (DUCTILE_CONTROL_FD,
 * agent/control.h). A thread reads it: `abort N` marks round N as ending, so
 * the trainer votes to stop after the step in flight (a clean step boundary,
 * no step lost); if that step does not end within a short grace (a peer is
 * dead or silent), the thread aborts the communicator, the step fails and is
 * discarded. `round N ...` is the next round: the trainer rebuilds its ring
 * through round N's store and the group agrees on the most advanced state.
 *
 * The agreement: every rank says (has state, round of that state, steps
 * done); the newest (round, step) wins, lowest rank on ties, and that rank
 * broadcasts the training position, parameters and optimizer state to all,
 * newcomers included. A rank cut off in an old round carries an old round
 * number, so it can never win over the job that went on without it.
 */
#ifndef DUCTILE_ELASTIC_H
#define DUCTILE_ELASTIC_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>

#include "comm.h"

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
/* How long a step in flight may take to end after `abort` before the
 * communicator is aborted under it. */
#define ELASTIC_GRACE_MS 750

typedef struct elastic elastic;

/* The round the trainer was started in, as the agent announces it. */
typedef struct elastic_round {
    int64_t round;
    int rank, world, local_rank;
    char store_prefix[512];
} elastic_round;

/* Starts reading control channel fd for a trainer started in `round`. */
elastic_err elastic_open(int fd, int64_t round, elastic **out);
void elastic_close(elastic *e);

/* The communicator `abort` may abort (NULL: none). Call with NULL before
 * freeing a communicator. Also sets the trainer's current round. */
void elastic_attach(elastic *e, comm *c, int64_t round);
/* 1 once the agent has sent a `round` line: it rebuilds in place. */
int elastic_inplace(elastic *e);
/* 1 when the current round has been told to end: vote to stop. */
int elastic_ending(elastic *e);
/* Progress and failure reports to the agent (best effort). */
void elastic_report_step(elastic *e, int64_t step);
void elastic_report_failed(elastic *e, const char *why);

/* Waits for a round newer than the current one; ELASTIC_ERR_STOP when
 * *stop becomes non-zero or the agent sends `stop`. */
elastic_err elastic_wait_round(elastic *e, volatile sig_atomic_t *stop, int timeout_ms,
                               elastic_round *out);

/* Opens round rd's store and builds its communicator (base gives host,
 * timeout and device; NCCL when cuda). A world of one gets neither. msg
 * (256 bytes) says what failed. Needs DUCTILE_ETCD_ENDPOINTS and DUCTILE_JOB. */
elastic_err elastic_connect(const elastic_round *rd, const comm_config *base, int cuda,
                            rdzv_store **store, comm **c, char *msg);

/* The agreement on c: *root is the rank whose state everyone takes. */
typedef struct elastic_claim {
    int64_t has_state; /* 0 for a fresh process without a checkpoint */
    int64_t round;     /* the round its state was made in */
    int64_t step;
} elastic_claim;
elastic_err elastic_agree(comm *c, const elastic_claim *mine, int *root, elastic_claim *best);

#endif
