/* main.c: ductile-train, data-parallel training of Fashion-MNIST.
 *
 * Alone (no RANK in the environment) it is one process; under ductile-agent
 * it joins the round's group (group.c) with its peers. Either way the loop
 * is the same: every optimizer step takes `accumulate` global batches at
 * the epoch's sample position, backward feeds the DDP reducer, the
 * optimizer steps, and rank 0 checkpoints. The one idea: the stop decision
 * travels with the last gradient bucket, so all ranks stop after the same
 * step; SIGTERM finishes the step, saves and exits 0.
 *
 * --device cuda (or auto with a device present) runs the same loop on the
 * GPU with NCCL between ranks: gpu_attach() moves the model there and the
 * model, optimizer and reducer calls dispatch to gpu_cuda.c; parameters are
 * copied back to the host only to checkpoint, dump or share them.
 *
 * Under ductile-agent with a control channel (elastic.c) a failed step is
 * discarded and the group rebuilt in place; the agent hears `peer_lost`
 * when a peer vanished and `failed` when this process failed. Failpoint
 * train.step (DUCTILE_FAILPOINTS, ductile/failpoint.h) slows or fails a
 * step on purpose, for the tests of those paths. Options: options.c.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cJSON.h>
#include <cblas.h>

#include "ductile/ckpt.h"
#include "ductile/clock.h"
#include "ductile/comm.h"
#include "ductile/control.h" /* the agent-worker contract: the lost-peer exit status */
#include "ductile/data.h"
#include "ductile/ddp.h"
#include "ductile/elastic.h"
#include "ductile/failpoint.h"
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

static volatile sig_atomic_t stop_signal;

static void on_signal(int sig)
{
    stop_signal = sig;
}

/* ---- the trainer's state ---- */

/* Why every rank stopped: the summary's stopped_by. */
typedef enum {
    STOP_EPOCHS,    /* every epoch trained */
    STOP_MAX_STEPS, /* --max-steps reached */
    STOP_SIGNAL,    /* SIGTERM or SIGINT (or the agent's `stop`) */
    STOP_PEER,      /* another rank asked everyone to stop */
} stop_reason;

static const char *stop_reason_name(stop_reason why)
{
    switch (why) {
    case STOP_EPOCHS:
        return "epochs";
    case STOP_MAX_STEPS:
        return "max_steps";
    case STOP_SIGNAL:
        return "signal";
    case STOP_PEER:
        return "peer";
    }
    return "unknown";
}

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

/* Rank 0's progress lines, at info level on stdout (scripts read them there;
 * a clean run leaves stderr empty), in the log's format. */
static void say(const trainer *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void say(const trainer *t, const char *fmt, ...)
{
    if (t->g.rank != 0) return;
    va_list ap;
    va_start(ap, fmt);
    dlog_vwrite(&t->out, DLOG_INFO, NULL, fmt, ap);
    va_end(ap);
}

/* An error, logged once where it is understood; returns -1 for the caller. */
static int fail(const trainer *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int fail(const trainer *t, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    dlog_vwrite(&t->log, DLOG_ERROR, NULL, fmt, ap);
    va_end(ap);
    return -1;
}

/* fail(), keeping the line in t->why: the report to the agent says the same. */
static int trainer_fail(trainer *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int trainer_fail(trainer *t, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->why, sizeof(t->why), fmt, ap);
    va_end(ap);
    return fail(t, "%s", t->why);
}

/* ---- data ---- */

static const int32_t *epoch_perm(trainer *t)
{
    if (t->perm_epoch != t->st.epoch) {
        data_permutation(t->perm, t->train.n, t->st.seed, t->st.epoch);
        t->perm_epoch = t->st.epoch;
    }
    return t->perm;
}

static int record_samples(trainer *t, const int32_t *ids, int count)
{
    if (!t->o.record) return 0;
    for (int i = 0; i < count; i++) {
        if (t->caprecords - t->nrecords < 96) {
            size_t cap = t->caprecords ? 2 * t->caprecords : 65536;
            char *grown = realloc(t->records, cap);
            if (!grown)
                return trainer_fail(t, "rank %d: out of memory recording samples", t->g.rank);
            t->records = grown;
            t->caprecords = cap;
        }
        /* Under an agent a fifth field, the round, tells which records a
         * later round's restart point voided (tests/e2e/accounting.py). */
        t->nrecords +=
            (size_t)(t->el ? snprintf(t->records + t->nrecords, 96, "%lld %d %lld %d %lld\n",
                                      (long long)t->st.epoch, ids[i], (long long)t->st.step,
                                      t->g.rank, (long long)t->g.round)
                           : snprintf(t->records + t->nrecords, 96, "%lld %d %lld %d\n",
                                      (long long)t->st.epoch, ids[i], (long long)t->st.step,
                                      t->g.rank));
    }
    return 0;
}

/* The samples trained so far are committed (checkpointed or finished). */
static void commit_records(trainer *t)
{
    if (!t->o.record || t->nrecords == 0) return;
    int fd = open(t->o.record, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0 || write(fd, t->records, t->nrecords) != (ssize_t)t->nrecords)
        fail(t, "writing %s: %s", t->o.record, strerror(errno));
    if (fd >= 0) close(fd);
    t->nrecords = 0;
}

/* ---- one optimizer step ---- */

/* The stop vote ddp takes just before this rank's stop flag leaves: a
 * signal, or the agent ending the round, during the step's compute stops
 * the group at the boundary of the step in flight, not one step later. */
static int late_vote(void *ctx)
{
    const trainer *t = ctx;
    return stop_signal != 0 || (t->el && elastic_ending(t->el));
}

/* Global samples in the next `accumulate` global batches (the loss scale). */
static int step_samples(const trainer *t)
{
    int64_t pos = t->st.pos, start;
    int total = 0, count;
    for (int a = 0; a < t->o.accumulate; a++) {
        int gb = data_shard(t->train.n, pos, t->g.world, t->o.batch, t->g.rank, &start, &count);
        total += gb;
        pos = pos + gb == t->train.n ? 0 : pos + gb;
    }
    return total;
}

/* Failpoint train.step (ductile/failpoint.h), at the start of every
 * optimizer step: sleep:MS makes this rank's step MS ms slower (a slow step,
 * which a graceful rebuild must wait for), fail makes it fail here, a
 * first-hand failure. Another action is a typo in a test: said, ignored. */
static int step_failpoint(trainer *t)
{
    const char *a = failpoint("train.step");
    if (!a || failpoint_sleep(a)) return 0;
    if (strcmp(a, "fail") == 0)
        return trainer_fail(t, "rank %d: step %lld: failpoint train.step", t->g.rank,
                            (long long)t->st.step);
    dlog_warn(&t->log, NULL, "failpoint train.step: unknown action '%s' ignored", a);
    return 0;
}

/* One micro-batch's mean loss into the running and the step's sums. */
static void add_loss(trainer *t, double loss, double *step_loss, int *step_loss_n)
{
    t->loss_sum += loss;
    t->loss_n++;
    *step_loss += loss;
    (*step_loss_n)++;
}

/* Forward, backward and reduction of `accumulate` micro-batches, then the
 * optimizer update. Sets *stop when any rank asked to stop after it. On a
 * GPU the step's losses are read after the step's one host sync (in
 * ddp_finish), not one sync per micro-batch. */
static int train_step(trainer *t, int want_stop, int *stop, int *epoch_ended)
{
    if (step_failpoint(t) != 0) return -1;
    float scale = (float)t->g.world / (float)step_samples(t);
    double step_loss = 0;
    int step_loss_n = 0, queued[GPU_LOSS_SLOTS], nqueued = 0;
    if (t->m->dev) gpu_loss_take(t->m, NULL, 0); /* a failed step's queued losses are dropped */
    for (int a = 0; a < t->o.accumulate; a++) {
        int64_t start;
        int count;
        const int32_t *perm = epoch_perm(t);
        int gb =
            data_shard(t->train.n, t->st.pos, t->g.world, t->o.batch, t->g.rank, &start, &count);
        /* Recorded before any gradient leaves: under an agent the records go
         * to the file at once, so a step that completes on other ranks after
         * this one died still has this rank's share on file. */
        if (record_samples(t, perm + start, count) != 0) return -1;
        if (t->el) commit_records(t);
        ddp_begin(t->r, a == t->o.accumulate - 1, want_stop);
        if (count > 0) {
            data_gather(&t->train, perm + start, count, t->m->x, t->m->y);
            model_forward(t->m, count);
            if (t->m->dev && nqueued < GPU_LOSS_SLOTS) {
                gpu_loss_queue(t->m, count);
                queued[nqueued++] = count;
            } else {
                add_loss(t, model_loss(t->m, count) / count, &step_loss, &step_loss_n);
            }
            t->own_samples += count;
            model_backward(t->m, count, scale, ddp_mark_ready, t->r);
        } else {
            for (int i = t->m->nparams - 1; i >= 0; i--) /* nothing to add: still ready */
                ddp_mark_ready(t->r, i);
        }
        t->st.samples += gb;
        t->st.pos += gb;
        if (t->st.pos == t->train.n) {
            t->st.epoch++;
            t->st.pos = 0;
            *epoch_ended = 1;
        }
        elastic_set_phase(t->el, ELASTIC_PHASE_COMM);
        ddp_err de = ddp_finish(t->r, stop);
        elastic_set_phase(t->el, ELASTIC_PHASE_COMPUTE);
        if (de != DDP_OK)
            return trainer_fail(t, "rank %d: step %lld: %s: %s", t->g.rank, (long long)t->st.step,
                                ddp_strerror(de), ddp_last_error(t->r));
        char msg[TRAINER_MSG_MAX];
        if (t->m->dev && gpu_error(t->m, msg) != 0)
            return trainer_fail(t, "rank %d: step %lld: %s", t->g.rank, (long long)t->st.step, msg);
    }
    if (nqueued > 0) { /* after ddp_finish's sync */
        double sums[GPU_LOSS_SLOTS];
        int n = gpu_loss_take(t->m, sums, nqueued);
        for (int i = 0; i < n; i++)
            add_loss(t, sums[i] / queued[i], &step_loss, &step_loss_n);
    }
    /* The schedule follows samples, not steps, so it survives a change of
     * world size; --max-steps does not change it, so a run cut short and
     * resumed follows the same curve as one that never stopped. */
    int64_t total = (int64_t)t->o.epochs * t->train.n;
    float lr =
        optim_lr(t->o.lr, t->st.step, t->o.warmup, (double)t->st.samples / total, t->o.cosine);
    optim_step(t->opt, t->m, lr);
    ddp_zero_grad(t->r);
    t->st.step++;
    elastic_report_step(t->el, t->st.step, t->own_samples,
                        step_loss_n ? step_loss / step_loss_n : NAN);
    return 0;
}

/* Test accuracy: each rank scores a slice of the test set, the counts are summed. */
static int evaluate(trainer *t, double *accuracy)
{
    int n = t->o.limit_test && t->o.limit_test < t->test.n ? t->o.limit_test : t->test.n;
    int lo = (int)((int64_t)n * t->g.rank / t->g.world);
    int hi = (int)((int64_t)n * (t->g.rank + 1) / t->g.world);
    float correct = 0;
    int32_t ids[1024];
    double t0 = mono_now_s();
    elastic_set_phase(t->el, ELASTIC_PHASE_EVAL);
    for (int i = lo; i < hi;) {
        int count = hi - i < t->m->max_batch ? hi - i : t->m->max_batch;
        count = count < 1024 ? count : 1024;
        for (int j = 0; j < count; j++)
            ids[j] = i + j;
        data_gather(&t->test, ids, count, t->m->x, t->m->y);
        model_forward(t->m, count);
        correct += (float)model_correct(t->m, count);
        i += count;
    }
    elastic_set_phase(t->el, ELASTIC_PHASE_COMM);
    ddp_err de = ddp_allreduce(t->r, &correct, 1);
    elastic_set_phase(t->el, ELASTIC_PHASE_COMPUTE);
    if (de != DDP_OK)
        return trainer_fail(t, "rank %d: evaluation: %s", t->g.rank, ddp_last_error(t->r));
    *accuracy = (double)correct / n;
    t->eval_seconds += mono_now_s() - t0;
    return 0;
}

/* ---- checkpoints ---- */

/* Rank 0 writes the state; a failure is said, training goes on, and -1
 * keeps the records since the last checkpoint uncommitted. */
static int write_checkpoint(trainer *t)
{
    char path[4096], msg[TRAINER_MSG_MAX];
    t->st.optim_t = t->opt->t;
    if (t->m->dev && gpu_download(t->m, t->opt, msg) != 0) {
        dlog_warn(&t->log, NULL, "checkpoint at step %lld not saved: %s", (long long)t->st.step,
                  msg);
        return -1;
    }
    ckpt_err e = ckpt_save(t->o.checkpoint_dir, &t->st, t->m->weights, t->m->nfloats, t->opt->state,
                           t->opt->n * t->opt->nstate, path, msg);
    if (e != CKPT_OK) {
        dlog_warn(&t->log, NULL, "checkpoint at step %lld not saved, training on: %s",
                  (long long)t->st.step, msg);
        return -1;
    }
    say(t, "checkpoint %s", path);
    return 0;
}

static void save_checkpoint(trainer *t)
{
    if (!t->o.checkpoint_dir) return;
    elastic_set_phase(t->el, ELASTIC_PHASE_SAVE);
    if (t->g.rank != 0 || write_checkpoint(t) == 0) commit_records(t);
    elastic_set_phase(t->el, ELASTIC_PHASE_COMPUTE);
}

/* The one state sync (ddp_sync_state): every rank takes the same position,
 * parameters and optimizer state. Under an agent (elastic mode) each rank
 * claims (has state, the round it was made in, steps done) and the newest
 * claim's state goes to all: survivors of a rebuild, newcomers and a rank 0
 * that resumed from a checkpoint agree the same way. Without one, rank 0's
 * goes out. A rank whose copy breaks half-way keeps its state and claim. */
static int sync_state(trainer *t)
{
    elastic_claim mine = {t->has_state, t->state_round, t->st.step}, best;
    elastic_part parts[3] = {
        {&t->st, sizeof(t->st), NULL},
        {t->m->weights, sizeof(float) * t->m->nfloats, NULL},
        {t->opt->state, sizeof(float) * t->opt->n * t->opt->nstate, NULL},
    };
    int root;
    char msg[TRAINER_MSG_MAX];
    t->st.optim_t = t->opt->t;
    /* On a GPU the parameters and optimizer state go device to device. */
    if (t->m->dev && t->g.comm && gpu_state_parts(t->m, t->opt, &parts[1], &parts[2], msg) != 0)
        return trainer_fail(t, "rank %d: --device cuda: %s", t->g.rank, msg);
    if (ddp_sync_state(t->r, t->el ? &mine : NULL, parts, 3, &root, &best) != DDP_OK)
        return trainer_fail(t, "rank %d: agreeing on the group's state: %s", t->g.rank,
                            ddp_last_error(t->r));
    if (t->m->dev && t->g.comm && root != t->g.rank) gpu_state_adopt(t->m);
    t->opt->t = t->st.optim_t;
    if (t->el && t->g.comm)
        say(t, "round %lld: state of rank %d (round %lld, step %lld) to %d ranks",
            (long long)t->g.round, root, (long long)best.round, (long long)best.step, t->g.world);
    t->st.round = t->g.round;
    t->has_state = 1;
    t->state_round = t->g.round;
    return 0;
}

/* Rank 0 resumes from the newest usable checkpoint (if any); then the
 * group syncs its state (sync_state). On a GPU the state lives on the
 * device from the first sync on: a fresh process's (or a resumed
 * checkpoint's) host state goes up once, and no rebuild copies it back. */
static int resume_and_sync(trainer *t)
{
    char path[4096], msg[TRAINER_MSG_MAX];
    if (t->g.rank == 0 && t->o.checkpoint_dir && !t->has_state) {
        ckpt_state want = t->st, got;
        ckpt_err e = ckpt_load(t->o.checkpoint_dir, &want, &got, t->m->weights, t->m->nfloats,
                               t->opt->state, t->opt->n * t->opt->nstate, path, msg);
        if (e == CKPT_OK) {
            if (msg[0]) dlog_warn(&t->log, NULL, "%s", msg); /* newer ones were unusable */
            int64_t round = t->st.round;
            t->st = got;
            t->st.round = round;
            t->opt->t = got.optim_t;
            t->has_state = 1;
            t->state_round = got.round;
            say(t, "resumed from %s (round %lld): step %lld, epoch %lld, position %lld", path,
                (long long)got.round, (long long)got.step, (long long)got.epoch,
                (long long)got.pos);
        } else if (e != CKPT_ERR_NONE) {
            dlog_warn(&t->log, NULL, "%s; starting from scratch", msg);
        }
    }
    if (t->m->dev && !t->dev_current) {
        if (gpu_upload(t->m, t->opt, msg) != 0)
            return trainer_fail(t, "rank %d: --device cuda: %s", t->g.rank, msg);
        t->dev_current = 1;
    }
    if (sync_state(t) != 0) return -1;
    t->start_step = t->st.step;
    t->start_samples = t->logged_samples = t->st.samples;
    t->logged_at = mono_now_s();
    return 0;
}

/* ---- setup, summary, teardown ---- */

/* The DDP reducer over the group's communicator, with the trainer's late vote. */
static int reducer_create(trainer *t)
{
    ddp_err e = ddp_reducer_create(t->m, t->g.comm, (size_t)(t->o.bucket_cap_mb * 1048576.0),
                                   t->overlap, &t->r);
    if (e != DDP_OK) return fail(t, "rank %d: reducer: %s", t->g.rank, ddp_strerror(e));
    ddp_set_vote(t->r, late_vote, t);
    return 0;
}

static int trainer_setup(trainer *t)
{
    char msg[TRAINER_MSG_MAX];
    data_err de;
    if ((de = data_load(t->o.data, "train", &t->train, msg)) != DATA_OK ||
        (de = data_load(t->o.data, "t10k", &t->test, msg)) != DATA_OK)
        return fail(t, "%s: %s", data_strerror(de), msg);
    if (t->train.rows != t->test.rows || t->train.cols != t->test.cols)
        return fail(t, "training images are %dx%d but test images %dx%d", t->train.rows,
                    t->train.cols, t->test.rows, t->test.cols);
    if (t->o.limit_train && t->o.limit_train < t->train.n) t->train.n = t->o.limit_train;
    t->o.cfg.in_c = 1;
    t->o.cfg.in_h = t->train.rows;
    t->o.cfg.in_w = t->train.cols;
    t->o.cfg.classes = DATA_CLASSES;
    int max_batch = t->o.batch > 256 ? t->o.batch : 256;
    if (model_create(&t->o.cfg, max_batch, &t->m, msg) != 0) return fail(t, "%s", msg);
    model_init_params(t->m, t->o.seed);
    if (t->o.device == DEVICE_CUDA && gpu_attach(t->m, t->o.gpu, msg) != 0)
        return fail(t, "--device cuda: %s", msg);
    optim_config oc = {.kind = t->o.optimizer,
                       .momentum = t->o.momentum,
                       .weight_decay = t->o.weight_decay,
                       .beta1 = 0.9f,
                       .beta2 = 0.999f,
                       .eps = 1e-8f};
    t->perm = malloc(sizeof(int32_t) * t->train.n);
    if (!t->perm || optim_create(&oc, t->m->nfloats, &t->opt) != 0) return fail(t, "out of memory");
    t->perm_epoch = -1;
    if (reducer_create(t) != 0) return -1;
    memset(&t->st, 0, sizeof(t->st));
    t->st.round = t->g.round;
    t->st.seed = t->o.seed;
    t->st.rng = t->o.seed;
    t->st.optim_kind = t->o.optimizer;
    t->st.optim_nstate = t->opt->nstate;
    t->st.cfg = t->o.cfg;
    if (resume_and_sync(t) != 0) return -1;
    return 0;
}

/* --device: the trainer's GPU. A process that sees one device uses it,
 * device 0, whatever its LOCAL_RANK (CUDA_VISIBLE_DEVICES set per process,
 * or a device plugin that gives each container one GPU); one that sees at
 * least a device per local rank uses its LOCAL_RANK-th. auto is CUDA in
 * both cases, else the CPU: NCCL refuses two ranks of one communicator on
 * one GPU. A CPU rank in a round of CUDA ranks is refused for the whole
 * round at once (comm_choose.c), not timed out. */
static int pick_device(trainer *t)
{
    char why[TRAINER_MSG_MAX];
    options *o = &t->o;
    int lws = t->env.local_world;
    if (o->device == DEVICE_CPU) return 0;
    int n = gpu_device_count(why);
    if (n == 0 && o->device == DEVICE_CUDA) return fail(t, "--device cuda: %s", why);
    int fits = n == 1 || n >= lws;
    if (n > 0 && !fits && o->device == DEVICE_CUDA)
        return fail(t, "--device cuda: %d local ranks but %d CUDA devices (one each needed)", lws,
                    n);
    o->device = n > 0 && fits ? DEVICE_CUDA : DEVICE_CPU;
    o->gpu = n == 1 ? 0 : t->env.local_rank;
    return 0;
}

/* The communicator failed by this process's own NCCL error, on whatever
 * thread found it, before its teardown: under an agent the failure goes on
 * the control channel now, so it is on record before any peer sees the
 * connections close (and report_failure does not say it again). */
static void comm_failed_here(void *ctx, const char *why)
{
    trainer *t = ctx;
    if (!t->el) return;
    atomic_store(&t->said_failed, t->g.round);
    elastic_report_failed(t->el, why);
}

/* How this process joins a group: the options' address, deadline and device. */
static group_link group_link_of(trainer *t)
{
    const options *o = &t->o;
    return (group_link){.host = o->host,
                        .timeout_ms = o->comm_timeout_ms,
                        .cuda = o->device == DEVICE_CUDA,
                        .transport = (comm_transport)o->comm,
                        .device = o->gpu,
                        .failed_here = comm_failed_here,
                        .failed_ctx = t};
}

/* The first group: rank, world and round as the environment says. */
static int group_join(trainer *t)
{
    char msg[GROUP_MSG_MAX];
    t->g = (group){.rank = t->env.rank,
                   .world = t->env.world,
                   .local_world = t->env.local_world,
                   .round = t->env.round};
    group_link link = group_link_of(t);
    group_err e = group_connect(&t->g, &t->env, &link, msg);
    if (e == GROUP_OK) return 0;
    t->lost = e == GROUP_ERR_PEER;
    return fail(t, "rank %d: %s", t->g.rank, msg);
}

static void write_summary(const trainer *t, double acc, double seconds, stop_reason why)
{
    char desc[256];
    if (!t->o.summary || t->g.rank != 0) return;
    model_describe(&t->o.cfg, desc, sizeof(desc));
    int64_t samples = t->st.samples - t->start_samples;
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "test_accuracy", acc);
    cJSON_AddNumberToObject(j, "steps", (double)t->st.step);
    cJSON_AddNumberToObject(j, "steps_this_run", (double)(t->st.step - t->start_step));
    cJSON_AddNumberToObject(j, "samples", (double)t->st.samples);
    cJSON_AddNumberToObject(j, "samples_this_run", (double)samples);
    cJSON_AddNumberToObject(j, "epochs", t->st.epoch + (double)t->st.pos / t->train.n);
    cJSON_AddNumberToObject(j, "seconds", seconds);
    double train_s = seconds - t->eval_seconds;
    cJSON_AddNumberToObject(j, "eval_seconds", t->eval_seconds);
    cJSON_AddNumberToObject(j, "samples_per_s", train_s > 0 ? samples / train_s : 0);
    cJSON_AddNumberToObject(j, "world_size", t->g.world);
    cJSON_AddNumberToObject(j, "round", (double)t->g.round);
    cJSON_AddStringToObject(j, "model", desc);
    cJSON_AddStringToObject(j, "device", t->m->dev ? "cuda" : "cpu");
    cJSON_AddStringToObject(j, "optimizer", t->o.optimizer == OPTIM_ADAMW ? "adamw" : "sgd");
    cJSON_AddNumberToObject(j, "batch_size", t->o.batch);
    cJSON_AddNumberToObject(j, "accumulate", t->o.accumulate);
    cJSON_AddNumberToObject(j, "global_batch", (double)t->o.batch * t->o.accumulate * t->g.world);
    cJSON_AddNumberToObject(j, "buckets", ddp_bucket_count(t->r));
    cJSON_AddBoolToObject(j, "overlap", t->overlap);
    cJSON_AddStringToObject(j, "overlap_why", t->overlap_why);
    cJSON_AddStringToObject(j, "stopped_by", stop_reason_name(why));
    char *text = cJSON_Print(j);
    FILE *f = fopen(t->o.summary, "w");
    if (!text || !f || fprintf(f, "%s\n", text) < 0 || fclose(f) != 0)
        fail(t, "writing %s: %s", t->o.summary, strerror(errno));
    else
        f = NULL;
    if (f) fclose(f);
    free(text);
    cJSON_Delete(j);
}

static void dump_params(trainer *t)
{
    char msg[TRAINER_MSG_MAX], file[4096];
    const char *path = t->o.dump_params, *tag = path ? strstr(path, "{rank}") : NULL;
    if (!path || (!tag && t->g.rank != 0)) return;
    /* {rank} in the name: every rank writes its own, named ROUND-RANK. */
    if (tag)
        snprintf(file, sizeof(file), "%.*s%lld-%d%s", (int)(tag - path), path,
                 (long long)t->g.round, t->g.rank, tag + strlen("{rank}"));
    else
        snprintf(file, sizeof(file), "%s", path);
    if (t->m->dev && gpu_download(t->m, NULL, msg) != 0) {
        fail(t, "writing %s: %s", file, msg);
        return;
    }
    FILE *f = fopen(file, "wb");
    if (!f || fwrite(t->m->weights, sizeof(float), t->m->nfloats, f) != t->m->nfloats ||
        fclose(f) != 0)
        fail(t, "writing %s: %s", file, strerror(errno));
}

static void trainer_free(trainer *t)
{
    elastic_close(t->el); /* first: its thread may abort the communicator */
    ddp_reducer_free(t->r);
    optim_free(t->opt);
    model_free(t->m);
    data_free(&t->train);
    data_free(&t->test);
    free(t->perm);
    free(t->records);
    group_leave(&t->g);
}

/* The cores this process may run on (its affinity mask, as taskset or a
 * container's cpuset leaves it), else the online count. */
static int usable_cores(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

/* BLAS threads (--threads, else this rank's share of the cores), then
 * whether the all-reduce overlaps backward (ddp_overlap_choose). Both are
 * settled once, before the first group's reducer exists. */
static void compute_threads(trainer *t)
{
    int cores = usable_cores(), lw = t->g.local_world > 0 ? t->g.local_world : 1;
    int threads = t->o.threads > 0 ? t->o.threads : cores / lw > 0 ? cores / lw : 1;
    openblas_set_num_threads(threads);
    t->overlap = ddp_overlap_choose(t->o.overlap, t->o.device == DEVICE_CUDA, cores, lw, threads,
                                    t->overlap_why, sizeof(t->overlap_why));
}

/* Every --log-every steps: rank 0's loss and the global samples/s since the last line. */
static void log_progress(trainer *t)
{
    if (t->st.step % t->o.log_every != 0) return;
    double now = mono_now_s();
    say(t, "step %lld epoch %lld loss %.4f samples/s %.0f", (long long)t->st.step,
        (long long)t->st.epoch, t->loss_sum / t->loss_n,
        (t->st.samples - t->logged_samples) / (now - t->logged_at));
    t->loss_sum = t->loss_n = 0;
    t->logged_at = now;
    t->logged_samples = t->st.samples;
}

/* Why every rank agreed to stop after this step. */
static stop_reason stop_reason_of(const trainer *t)
{
    if (stop_signal) return STOP_SIGNAL;
    if (t->o.max_steps && t->st.step >= t->o.max_steps) return STOP_MAX_STEPS;
    return STOP_PEER; /* another rank asked everyone to stop */
}

/* ---- in-place rebuilds (elastic mode, under ductile-agent) ---- */

/* Under an agent: the control channel, whatever the rebuild mode. */
static int elastic_start(trainer *t)
{
    int fd = t->env.control_fd;
    if (fd < 0) return 0;
    elastic_err e = elastic_open(fd, t->g.round, &t->el);
    if (e != ELASTIC_OK) return fail(t, "control channel fd %d: %s", fd, elastic_strerror(e));
    elastic_attach(t->el, t->g.comm, t->g.round);
    return 0;
}

/* Tells the agent why the current round failed here: `peer_lost` when a
 * peer went away (peer), `failed` when this process failed first-hand.
 * Nothing when the agent already told this trainer that the round ends:
 * its abort is the cause, not the failure it caused. */
static void report_failure(trainer *t, int peer, const char *why)
{
    if (elastic_ending(t->el)) return;
    if (!peer && atomic_load(&t->said_failed) == t->g.round) return; /* comm_failed_here said it */
    if (peer)
        elastic_report_peer_lost(t->el, t->g.round, why);
    else
        elastic_report_failed(t->el, why);
}

/* A sticky CUDA error poisons this process's context for good: every
 * later call answers it, so a rebuild in place would fail round after
 * round until the restart budget is spent. The process exits instead
 * (counted once, by its exit) and the agent starts a fresh one, which gets
 * the state from the survivors. A non-sticky error is cleared there and
 * the rebuild goes on. */
static int context_poisoned(trainer *t)
{
    char msg[GPU_MSG_MAX];
    if (!t->m || !t->m->dev || !gpu_poisoned(t->m, msg)) return 0;
    fail(t, "rank %d: %s: exiting, so that the agent starts a fresh process", t->g.rank, msg);
    return 1;
}

/* 1 when the group's communicator failed because a peer went away (it
 * closed, went silent, or the group was aborted); 0 when it still works or
 * failed here (a step that failed before or beside it is first-hand). */
static int peer_gone(const trainer *t)
{
    return comm_err_is_peer(comm_error(t->g.comm));
}

/* Drops the group, waits for the agent's next round, builds its ring and
 * takes the group's newest state; the partial step was already discarded.
 * A round whose group cannot be built or cannot agree is reported to the
 * agent at once, so that it forms a new one, which is then awaited.
 * Returns LOOP_TRAIN in the new round; LOOP_LEFT when asked to stop while
 * waiting (the caller exits 0 without saving: the round is over, a
 * checkpoint now would be the old round's); LOOP_FAILED on an error (the
 * caller exits 1 and the agent starts a fresh process, which gets the state
 * from the survivors). Never exits itself: exits are main's. */
static loop_state trainer_regroup(trainer *t, const char *why)
{
    char msg[TRAINER_MSG_MAX];
    group_link link = group_link_of(t);
    /* A rebuild gives up as soon as the agent says its round already ended. */
    link.cancelled = elastic_cancelled;
    link.cancel_ctx = t->el;
    int64_t start_step = t->start_step, start_samples = t->start_samples;
    elastic_set_phase(t->el, ELASTIC_PHASE_REBUILD);
    for (;;) {
        elastic_attach(t->el, NULL, t->g.round);
        ddp_reducer_free(t->r);
        t->r = NULL;
        group_leave(&t->g);
        elastic_round rd;
        elastic_err e = elastic_wait_round(t->el, &stop_signal, ELASTIC_WAIT_MS, &rd);
        if (e == ELASTIC_ERR_STOP) return LOOP_LEFT;
        if (e != ELASTIC_OK) {
            fail(t, "rank %d: after round %lld: %s", t->g.rank, (long long)t->g.round,
                 elastic_strerror(e));
            return LOOP_FAILED;
        }
        t->g.rank = rd.rank;
        t->g.world = rd.world;
        t->g.round = rd.round;
        elastic_attach(t->el, NULL, rd.round); /* from now on, what the agent says is about rd */
        group_err ge = group_connect(&t->g, &t->env, &link, msg);
        if (ge != GROUP_OK && context_poisoned(t)) return LOOP_FAILED;
        if (ge != GROUP_OK) {
            fail(t, "rank %d: %s; waiting for the next round", t->g.rank, msg);
            report_failure(t, ge == GROUP_ERR_PEER, msg);
            continue;
        }
        elastic_attach(t->el, t->g.comm, t->g.round);
        if (reducer_create(t) != 0) return LOOP_FAILED;
        t->why[0] = '\0';
        if (resume_and_sync(t) != 0) {
            if (context_poisoned(t)) return LOOP_FAILED;
            report_failure(t, peer_gone(t),
                           t->why[0] ? t->why : "agreeing on the group's state failed");
            continue;
        }
        t->start_step = start_step;
        t->start_samples = start_samples;
        say(t,
            "round %lld: world %d, rebuilt in place (%s), at step %lld epoch %lld, "
            "collectives over %s",
            (long long)t->g.round, t->g.world, why, (long long)t->st.step, (long long)t->st.epoch,
            comm_backend(t->g.comm));
        elastic_set_phase(t->el, ELASTIC_PHASE_COMPUTE);
        return LOOP_TRAIN;
    }
}

/* Elastic mode, after a failed step (already discarded) or evaluation: tell
 * the agent what failed, then rebuild. Returns trainer_regroup's answer. */
static loop_state trainer_recover(trainer *t, const char *what)
{
    char why[TRAINER_MSG_MAX + 64];
    snprintf(why, sizeof(why), "%s: %s", what, t->why[0] ? t->why : "no detail");
    if (context_poisoned(t)) return LOOP_FAILED;
    report_failure(t, peer_gone(t), why);
    return trainer_regroup(t, why);
}

/* Elastic mode, after a step every rank agreed to stop after. At the job's
 * end LOOP_DONE; a rank asked to leave goes without evaluating (the others
 * carry on): LOOP_DONE with the step counted as evaluated. Otherwise the
 * round ends at this step boundary (a peer leaves or a node joins):
 * checkpoint and rebuild (unless already rebuilt after this step), and the
 * rebuild's answer. */
static loop_state trainer_boundary(trainer *t, int64_t *evaluated, int rebuilt)
{
    if (t->st.epoch >= t->o.epochs || (t->o.max_steps && t->st.step >= t->o.max_steps))
        return LOOP_DONE;
    if (stop_signal) {
        *evaluated = t->st.step;
        return LOOP_DONE;
    }
    if (rebuilt) return LOOP_TRAIN;
    save_checkpoint(t);
    return trainer_regroup(t, "at a step boundary");
}

/* ---- the training loop ---- */

typedef struct loop {
    double t0, acc;
    int64_t evaluated; /* the step the last evaluation scored, or -1 */
    stop_reason why;
} loop;

/* One optimizer step and what follows it: the progress line, the epoch's
 * evaluation, the agreed stop, in elastic mode the rebuild after a failure
 * or at a round's end, and the periodic checkpoint. */
static loop_state loop_step(trainer *t, loop *l)
{
    int stop = 0, epoch_ended = 0, rebuilt = 0;
    int want = stop_signal != 0 || (t->o.max_steps && t->st.step + 1 >= t->o.max_steps);
    if (t->el && elastic_ending(t->el)) want = 1; /* the round ends after this step */
    ckpt_state before = t->st;
    if (train_step(t, want, &stop, &epoch_ended) != 0) {
        if (!t->el) return LOOP_FAILED;
        t->st = before; /* discard the partial step, rebuild, go on */
        return trainer_recover(t, "a step failed");
    }
    log_progress(t);
    if (epoch_ended) {
        int failed = evaluate(t, &l->acc) != 0;
        l->evaluated = t->st.step;
        if (failed && t->el) { /* the step stands: rebuild, score it at the end */
            loop_state s = trainer_recover(t, "evaluation failed");
            l->evaluated = -1;
            rebuilt = 1;
            if (s != LOOP_TRAIN) return s;
        }
        say(t, "epoch %lld test_accuracy %.4f at %.1f s", (long long)t->st.epoch, l->acc,
            mono_now_s() - l->t0);
        if (failed && !t->el) return LOOP_FAILED;
    }
    if (stop) {
        l->why = stop_reason_of(t);
        if (!t->el) return LOOP_DONE;
        loop_state s = trainer_boundary(t, &l->evaluated, rebuilt);
        if (s != LOOP_TRAIN) return s;
        l->why = STOP_EPOCHS; /* the round ended, the job goes on */
        return LOOP_TRAIN;
    }
    if (t->st.epoch >= t->o.epochs) return LOOP_DONE;
    if (t->o.checkpoint_every && t->st.step % t->o.checkpoint_every == 0) save_checkpoint(t);
    return LOOP_TRAIN;
}

/* The job is done here: score the last step if no evaluation did, save,
 * and write what the tests and the user read. LOOP_DONE or LOOP_FAILED. */
static loop_state trainer_finish(trainer *t, loop *l)
{
    if (l->evaluated != t->st.step && evaluate(t, &l->acc) != 0) return LOOP_FAILED;
    double seconds = mono_now_s() - l->t0;
    save_checkpoint(t);
    commit_records(t);
    dump_params(t);
    write_summary(t, l->acc, seconds, l->why);
    say(t, "done: %lld steps, test_accuracy %.4f, %.1f s, %.0f samples/s (%s)",
        (long long)t->st.step, l->acc, seconds, (t->st.samples - t->start_samples) / seconds,
        stop_reason_name(l->why));
    return LOOP_DONE;
}

/* ---- start ---- */

/* Everything before the first step: the logger, options, failpoints,
 * signals, the environment, the device, the first group, the control
 * channel, data, model and state. 0 to train; -1 to exit with *status: 2
 * for a usage error, 0 after --help, CTL_EXIT_PEER_LOST under an agent when
 * the group could not form for want of a peer, else 1. */
static int trainer_start(trainer *t, int argc, char **argv, int *status)
{
    char msg[DLOG_MSG_MAX];
    if (dlog_init(&t->log, "ductile-train", NULL, 0, msg, sizeof(msg)) != 0) {
        dlog_error(&t->log, NULL, "%s", msg);
        *status = 2;
        return -1;
    }
    int rc = options_parse(argc, argv, &t->o, &t->log);
    if (rc != 0) { /* the bad value was already named in one line */
        if (rc > 0) options_usage(stdout);
        *status = rc > 0 ? 0 : 2;
        return -1;
    }
    if (t->o.log_json >= 0) t->log.json = t->o.log_json;
    t->out = t->log;
    t->out.to_stdout = 1;
    if (failpoint_check_env(msg, sizeof(msg)) != 0) {
        fail(t, "%s", msg);
        *status = 2;
        return -1;
    }
    signal(SIGPIPE, SIG_IGN);
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    if (group_env_read(&t->env, msg) != 0) {
        fail(t, "%s", msg);
        *status = 1;
        return -1;
    }
    /* First, so that a round ending while the first group forms keeps this
     * process in inplace mode, as every later one does. */
    elastic_err he = t->env.control_fd >= 0 ? elastic_hello(t->env.control_fd) : ELASTIC_OK;
    if (he != ELASTIC_OK) {
        fail(t, "control channel fd %d: %s", t->env.control_fd, elastic_strerror(he));
        *status = 1;
        return -1;
    }
    if (pick_device(t) != 0 || group_join(t) != 0 || elastic_start(t) != 0 ||
        (compute_threads(t), 0) || trainer_setup(t) != 0) {
        /* Under an agent, a group that could not form because a peer went
         * away is a lost peer, not this worker's failure: say so by the
         * exit status (the control channel may not be open yet). */
        int lost = t->lost || (t->g.comm && comm_err_is_peer(comm_error(t->g.comm)));
        *status = lost && t->env.control_fd >= 0 ? CTL_EXIT_PEER_LOST : 1;
        return -1;
    }
    char desc[256];
    model_describe(&t->o.cfg, desc, sizeof(desc));
    say(t,
        "%s, %zu parameters in %d buckets, %d samples, world %d, round %lld, %s, "
        "collectives over %s; all-reduce %s (%s)",
        desc, t->m->nfloats, ddp_bucket_count(t->r), t->train.n, t->g.world, (long long)t->g.round,
        t->m->dev ? "cuda" : "cpu", comm_backend(t->g.comm),
        t->overlap ? "overlapped with backward" : "after backward", t->overlap_why);
    return 0;
}

int main(int argc, char **argv)
{
    static trainer t; /* large, and zero: trainer_free() works on any part of it */
    int status;
    if (trainer_start(&t, argc, argv, &status) != 0) {
        trainer_free(&t);
        return status;
    }
    loop l = {.t0 = mono_now_s(), .evaluated = -1, .why = STOP_EPOCHS};
    loop_state s = t.st.epoch >= t.o.epochs ? LOOP_DONE : LOOP_TRAIN;
    while (s == LOOP_TRAIN)
        s = loop_step(&t, &l);
    if (s == LOOP_DONE) s = trainer_finish(&t, &l);
    trainer_free(&t);
    return s == LOOP_FAILED ? 1 : 0;
}
