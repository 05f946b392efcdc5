/* recover.c: ductile-train's in-place rebuilds (elastic mode, under
 * ductile-agent).
 *
 * A failed step is discarded (main.c), the agent is told why (`peer_lost`
 * when a peer went away, `failed` when this process failed first-hand),
 * the group is dropped and rebuilt for the agent's next round, and the
 * group's newest state taken; at a round's end on a step boundary the same
 * rebuild follows a checkpoint. A sticky CUDA error exits instead.
 */
#include <stdatomic.h>
#include <stdio.h>

#include "ductile/comm.h"
#include "trainer.h"

/* The communicator failed by this process's own NCCL error, on whatever
 * thread found it, before its teardown: under an agent the failure goes on
 * the control channel now, so it is on record before any peer sees the
 * connections close (and report_failure does not say it again). */
void trainer_comm_failed_here(void *ctx, const char *why)
{
    trainer *t = ctx;
    if (!t->el) return;
    atomic_store(&t->said_failed, t->g.round);
    elastic_report_failed(t->el, why);
}

/* Tells the agent why the current round failed here: `peer_lost` when a
 * peer went away (peer), `failed` when this process failed first-hand.
 * Nothing when the agent already told this trainer that the round ends:
 * its abort is the cause, not the failure it caused. */
static void report_failure(trainer *t, int peer, const char *why)
{
    if (elastic_ending(t->el)) return;
    if (!peer && atomic_load(&t->said_failed) == t->g.round)
        return; /* trainer_comm_failed_here said it */
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
    trainer_error(t, "rank %d: %s: exiting, so that the agent starts a fresh process", t->g.rank,
                  msg);
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
    group_link link = trainer_link(t);
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
        elastic_err e = elastic_wait_round(t->el, &trainer_stop_signal, ELASTIC_WAIT_MS, &rd);
        if (e == ELASTIC_ERR_STOP) return LOOP_LEFT;
        if (e != ELASTIC_OK) {
            trainer_error(t, "rank %d: after round %lld: %s", t->g.rank, (long long)t->g.round,
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
            trainer_error(t, "rank %d: %s; waiting for the next round", t->g.rank, msg);
            report_failure(t, ge == GROUP_ERR_PEER, msg);
            continue;
        }
        elastic_attach(t->el, t->g.comm, t->g.round);
        if (trainer_reducer_create(t) != 0) return LOOP_FAILED;
        t->why[0] = '\0';
        if (trainer_resume_and_sync(t) != 0) {
            if (context_poisoned(t)) return LOOP_FAILED;
            report_failure(t, peer_gone(t),
                           t->why[0] ? t->why : "agreeing on the group's state failed");
            continue;
        }
        t->start_step = start_step;
        t->start_samples = start_samples;
        trainer_say(t,
                    "round %lld: world %d, rebuilt in place (%s), at step %lld epoch %lld, "
                    "collectives over %s",
                    (long long)t->g.round, t->g.world, why, (long long)t->st.step,
                    (long long)t->st.epoch, comm_backend(t->g.comm));
        elastic_set_phase(t->el, ELASTIC_PHASE_COMPUTE);
        return LOOP_TRAIN;
    }
}

/* Elastic mode, after a failed step (already discarded) or evaluation: tell
 * the agent what failed, then rebuild. Returns trainer_regroup's answer. */
loop_state trainer_recover(trainer *t, const char *what)
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
loop_state trainer_boundary(trainer *t, int64_t *evaluated, int rebuilt)
{
    if (t->st.epoch >= t->o.epochs || (t->o.max_steps && t->st.step >= t->o.max_steps))
        return LOOP_DONE;
    if (trainer_stop_signal) {
        *evaluated = t->st.step;
        return LOOP_DONE;
    }
    if (rebuilt) return LOOP_TRAIN;
    trainer_save_checkpoint(t);
    return trainer_regroup(t, "at a step boundary");
}
