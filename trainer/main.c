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
 * model, optimizer and reducer calls dispatch to gpu_cuda.c and
 * gpu_model_cuda.c; parameters are copied back to the host only to
 * checkpoint, dump or share them.
 *
 * Under ductile-agent with a control channel (elastic.c) a failed step is
 * discarded and the group rebuilt in place; the agent hears `peer_lost`
 * when a peer vanished and `failed` when this process failed. Failpoint
 * train.step (DUCTILE_FAILPOINTS, ductile/failpoint.h) slows or fails a
 * step on purpose, for the tests of those paths. Options: options.c.
 *
 * This file is the start and the loop; the rest of the trainer is in
 * trainer.h's files: step.c, eval.c, state.c, recover.c, setup.c, say.c.
 */
#include <signal.h>
#include <stdio.h>

#include "ductile/clock.h"
#include "ductile/comm.h"
#include "ductile/control.h" /* the agent-worker contract: the lost-peer exit status */
#include "ductile/failpoint.h"
#include "trainer.h"

/* The one global: the signal handler's flag. */
volatile sig_atomic_t trainer_stop_signal;

static void on_signal(int sig)
{
    trainer_stop_signal = sig;
}

/* Every --log-every steps: rank 0's loss and the global samples/s since the last line. */
static void log_progress(trainer *t)
{
    if (t->st.step % t->o.log_every != 0) return;
    double now = mono_now_s();
    trainer_say(t, "step %lld epoch %lld loss %.4f samples/s %.0f", (long long)t->st.step,
                (long long)t->st.epoch, t->loss_sum / t->loss_n,
                (t->st.samples - t->logged_samples) / (now - t->logged_at));
    t->loss_sum = t->loss_n = 0;
    t->logged_at = now;
    t->logged_samples = t->st.samples;
}

/* Why every rank agreed to stop after this step. */
static stop_reason stop_reason_of(const trainer *t)
{
    if (trainer_stop_signal) return STOP_SIGNAL;
    if (t->o.max_steps && t->st.step >= t->o.max_steps) return STOP_MAX_STEPS;
    return STOP_PEER; /* another rank asked everyone to stop */
}

/* ---- the training loop ---- */

/* One optimizer step and what follows it: the progress line, the epoch's
 * evaluation, the agreed stop, in elastic mode the rebuild after a failure
 * or at a round's end, and the periodic checkpoint. */
static loop_state loop_step(trainer *t, loop *l)
{
    int stop = 0, epoch_ended = 0, rebuilt = 0;
    int want = trainer_stop_signal != 0 || (t->o.max_steps && t->st.step + 1 >= t->o.max_steps);
    if (t->el && elastic_ending(t->el)) want = 1; /* the round ends after this step */
    ckpt_state before = t->st;
    if (trainer_step(t, want, &stop, &epoch_ended) != 0) {
        if (!t->el) return LOOP_FAILED;
        t->st = before; /* discard the partial step, rebuild, go on */
        return trainer_recover(t, "a step failed");
    }
    log_progress(t);
    if (epoch_ended) {
        int failed = trainer_evaluate(t, &l->acc) != 0;
        l->evaluated = t->st.step;
        if (failed && t->el) { /* the step stands: rebuild, score it at the end */
            loop_state s = trainer_recover(t, "evaluation failed");
            l->evaluated = -1;
            rebuilt = 1;
            if (s != LOOP_TRAIN) return s;
        }
        trainer_say(t, "epoch %lld test_accuracy %.4f at %.1f s", (long long)t->st.epoch, l->acc,
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
    if (t->o.checkpoint_every && t->st.step % t->o.checkpoint_every == 0)
        trainer_save_checkpoint(t);
    return LOOP_TRAIN;
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
        trainer_error(t, "%s", msg);
        *status = 2;
        return -1;
    }
    signal(SIGPIPE, SIG_IGN);
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    if (group_env_read(&t->env, msg) != 0) {
        trainer_error(t, "%s", msg);
        *status = 1;
        return -1;
    }
    /* First, so that a round ending while the first group forms keeps this
     * process in inplace mode, as every later one does. */
    elastic_err he = t->env.control_fd >= 0 ? elastic_hello(t->env.control_fd) : ELASTIC_OK;
    if (he != ELASTIC_OK) {
        trainer_error(t, "control channel fd %d: %s", t->env.control_fd, elastic_strerror(he));
        *status = 1;
        return -1;
    }
    if (trainer_pick_device(t) != 0 || trainer_join(t) != 0 || trainer_control_open(t) != 0 ||
        (trainer_threads(t), 0) || trainer_setup(t) != 0) {
        /* Under an agent, a group that could not form because a peer went
         * away is a lost peer, not this worker's failure: say so by the
         * exit status (the control channel may not be open yet). */
        int lost = t->lost || (t->g.comm && comm_err_is_peer(comm_error(t->g.comm)));
        *status = lost && t->env.control_fd >= 0 ? CTL_EXIT_PEER_LOST : 1;
        return -1;
    }
    char desc[256];
    model_describe(&t->o.cfg, desc, sizeof(desc));
    trainer_say(t,
                "%s, %zu parameters in %d buckets, %d samples, world %d, round %lld, %s, "
                "collectives over %s; all-reduce %s (%s)",
                desc, t->m->nfloats, ddp_bucket_count(t->r), t->train.n, t->g.world,
                (long long)t->g.round, t->m->dev ? "cuda" : "cpu", comm_backend(t->g.comm),
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
