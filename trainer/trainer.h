/* trainer.h: what ductile-train's files share (private to trainer/).
 *
 * The trainer's state (struct trainer) and the files that act on it:
 * main.c starts the process and runs the training loop; step.c is one
 * optimizer step and the sample records; eval.c the test accuracy and the
 * job's end (the summary, the parameter dump); state.c the state every rank
 * agrees on (checkpoints, resume, the state sync); recover.c the in-place
 * rebuild after a failure or at a round's end (elastic mode, under
 * ductile-agent); setup.c everything the first step needs, and teardown;
 * say.c the messages every one of them writes.
 */
#ifndef DUCTILE_TRAINER_H
#define DUCTILE_TRAINER_H

#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>

#include "ductile/ckpt.h"
#include "ductile/data.h"
#include "ductile/ddp.h"
#include "ductile/elastic.h"
#include "ductile/log.h"
#include "ductile/model.h"
#include "ductile/optim.h"
#include "gpu.h"
#include "group.h"
#include "options.h"

/* Holds the one-line reasons model.h, data.h, ckpt.h, gpu.h and group.h write. */
#define TRAINER_MSG_MAX 512
_Static_assert(TRAINER_MSG_MAX >= MODEL_MSG_MAX && TRAINER_MSG_MAX >= DATA_MSG_MAX &&
                   TRAINER_MSG_MAX >= CKPT_MSG_MAX && TRAINER_MSG_MAX >= GPU_MSG_MAX &&
                   TRAINER_MSG_MAX >= GROUP_MSG_MAX,
               "TRAINER_MSG_MAX holds every library's reason");

/* SIGTERM or SIGINT, once caught (main.c): finish the step, save, exit 0. */
extern volatile sig_atomic_t trainer_stop_signal;

/* ---- the trainer's state ---- */

/* Why every rank stopped: the summary's stopped_by. */
typedef enum {
    STOP_EPOCHS,    /* every epoch trained */
    STOP_MAX_STEPS, /* --max-steps reached */
    STOP_SIGNAL,    /* SIGTERM or SIGINT (or the agent's `stop`) */
    STOP_PEER,      /* another rank asked everyone to stop */
} stop_reason;

/* Where the training loop stands after a step (or a rebuild). */
typedef enum {
    LOOP_TRAIN,  /* go on with the next step */
    LOOP_DONE,   /* the job is done here: evaluate, save, summarise, exit 0 */
    LOOP_FAILED, /* a step, an evaluation or a rebuild failed: exit 1 */
    LOOP_LEFT,   /* asked to stop while waiting for a round: exit 0, nothing saved */
} loop_state;

typedef struct trainer {
    dlog log; /* errors and warnings, on stderr */
    dlog out; /* progress (rank 0 only): as log, on stdout */
    options o;
    group_env env; /* what the agent said at start (control.h) */
    group g;
    data_set train, test;
    int32_t *perm;
    int64_t perm_epoch;
    model *m;
    optim *opt;
    ddp_reducer *r;
    int overlap;           /* buckets reduced during backward (1) or after it (0) */
    char overlap_why[160]; /* why, for the start line and the summary */
    ckpt_state st;
    int64_t start_step, start_samples;
    double loss_sum;     /* since the last log line */
    double eval_seconds; /* spent evaluating, left out of samples/s */
    double logged_at;    /* time and sample count of the last log line */
    int64_t logged_samples;
    int loss_n;
    int64_t own_samples; /* this process's share, in all: told to the agent */
    char *records;       /* sample records not yet committed */
    size_t nrecords, caprecords;
    int lost; /* the first group could not form for want of a peer or the store */
    _Atomic int64_t said_failed; /* the round whose own failure the comm already reported, or 0 */
    elastic *el;                 /* under ductile-agent: its control channel (elastic.c) */
    int has_state;               /* trained, synced or resumed: a claim in the agreement */
    int dev_current;             /* on a GPU: the device holds the state, the host copy is stale */
    int64_t state_round;         /* the round that state was made in */
    char why[TRAINER_MSG_MAX];   /* the last failure of a step or a sync, for the agent */
} trainer;

/* Where the loop stands across steps, for the job's end. */
typedef struct loop {
    double t0, acc;
    int64_t evaluated; /* the step the last evaluation scored, or -1 */
    stop_reason why;
} loop;

/* ---- say.c: messages ---- */

/* Rank 0's progress lines, at info level on stdout (scripts read them there;
 * a clean run leaves stderr empty), in the log's format. */
void trainer_say(const trainer *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* An error, logged once where it is understood; returns -1 for the caller. */
int trainer_error(const trainer *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* trainer_error(), keeping the line in t->why: the report to the agent says the same. */
int trainer_fail(trainer *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- step.c: one optimizer step ---- */

/* The samples trained so far are committed (checkpointed or finished). */
void trainer_commit_records(trainer *t);
/* ddp_set_vote's vote: a signal, or the agent ending the round. */
int trainer_late_vote(void *ctx);
/* Forward, backward and reduction of `accumulate` micro-batches, then the
 * optimizer update. Sets *stop when any rank asked to stop after it. */
int trainer_step(trainer *t, int want_stop, int *stop, int *epoch_ended);

/* ---- eval.c: evaluation and the job's end ---- */

/* Test accuracy: each rank scores a slice of the test set, the counts are summed. */
int trainer_evaluate(trainer *t, double *accuracy);
/* The job is done here: score the last step if no evaluation did, save,
 * and write what the tests and the user read. LOOP_DONE or LOOP_FAILED. */
loop_state trainer_finish(trainer *t, loop *l);

/* ---- state.c: checkpoints and the state sync ---- */

/* With --checkpoint-dir: rank 0 saves, and the records since the last
 * checkpoint are committed when it did. */
void trainer_save_checkpoint(trainer *t);
/* Rank 0 resumes from the newest usable checkpoint (if any); then the
 * group syncs its state. */
int trainer_resume_and_sync(trainer *t);

/* ---- recover.c: in-place rebuilds ---- */

/* group_link.failed_here: this process's own NCCL error, told to the agent at once. */
void trainer_comm_failed_here(void *ctx, const char *why);
/* Elastic mode, after a failed step (already discarded) or evaluation: tell
 * the agent what failed, then rebuild. Returns trainer_regroup's answer. */
loop_state trainer_recover(trainer *t, const char *what);
/* Elastic mode, after a step every rank agreed to stop after: LOOP_DONE
 * at the job's end or when asked to leave, else the round ends at this
 * step boundary: checkpoint and rebuild. */
loop_state trainer_boundary(trainer *t, int64_t *evaluated, int rebuilt);

/* ---- setup.c: before the first step, and teardown ---- */

/* Under an agent: the control channel, whatever the rebuild mode. */
int trainer_control_open(trainer *t);
/* --device: the trainer's GPU (or the CPU), settled into t->o. */
int trainer_pick_device(trainer *t);
/* How this process joins a group: the options' address, deadline and device. */
group_link trainer_link(trainer *t);
/* The first group: rank, world and round as the environment says. */
int trainer_join(trainer *t);
/* BLAS threads, then whether the all-reduce overlaps backward. */
void trainer_threads(trainer *t);
/* Data, model, optimizer, reducer and the first state sync. */
int trainer_setup(trainer *t);
/* The DDP reducer over the group's communicator, with the trainer's late vote. */
int trainer_reducer_create(trainer *t);
/* Frees whatever part of t was made (a zeroed trainer is fine). */
void trainer_free(trainer *t);

#endif
