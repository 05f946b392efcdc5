/* step.c: one optimizer step of ductile-train, and the sample records.
 *
 * A step takes `accumulate` global batches at the epoch's sample position:
 * each micro-batch is gathered, forwarded and backpropagated, its
 * gradients go to the DDP reducer bucket by bucket, and the optimizer
 * updates once after the last. The stop decision (a signal, --max-steps,
 * the agent ending the round) travels with the last gradient bucket, so
 * every rank stops after the same step. With --record every sample trained
 * is written down, committed once checkpointed or finished.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ductile/failpoint.h"
#include "trainer.h"

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
void trainer_commit_records(trainer *t)
{
    if (!t->o.record || t->nrecords == 0) return;
    int fd = open(t->o.record, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0 || write(fd, t->records, t->nrecords) != (ssize_t)t->nrecords)
        trainer_error(t, "writing %s: %s", t->o.record, strerror(errno));
    if (fd >= 0) close(fd);
    t->nrecords = 0;
}

/* ---- one optimizer step ---- */

/* The stop vote ddp takes just before this rank's stop flag leaves: a
 * signal, or the agent ending the round, during the step's compute stops
 * the group at the boundary of the step in flight, not one step later. */
int trainer_late_vote(void *ctx)
{
    const trainer *t = ctx;
    return trainer_stop_signal != 0 || (t->el && elastic_ending(t->el));
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
int trainer_step(trainer *t, int want_stop, int *stop, int *epoch_ended)
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
        if (t->el) trainer_commit_records(t);
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
