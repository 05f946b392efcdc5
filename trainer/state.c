/* state.c: the state every rank of ductile-train agrees on.
 *
 * Rank 0 saves checkpoints and resumes from the newest usable one; the
 * group's one state sync gives every rank the same position, parameters
 * and optimizer state (under an agent: the newest claim's, so survivors of
 * a rebuild, newcomers and a resumed rank 0 agree the same way). On a GPU
 * the state lives on the device from the first sync on.
 */
#include "ductile/clock.h"
#include "trainer.h"

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
    trainer_say(t, "checkpoint %s", path);
    return 0;
}

void trainer_save_checkpoint(trainer *t)
{
    if (!t->o.checkpoint_dir) return;
    elastic_set_phase(t->el, ELASTIC_PHASE_SAVE);
    if (t->g.rank != 0 || write_checkpoint(t) == 0) trainer_commit_records(t);
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
        trainer_say(t, "round %lld: state of rank %d (round %lld, step %lld) to %d ranks",
                    (long long)t->g.round, root, (long long)best.round, (long long)best.step,
                    t->g.world);
    t->st.round = t->g.round;
    t->has_state = 1;
    t->state_round = t->g.round;
    return 0;
}

/* Rank 0 resumes from the newest usable checkpoint (if any); then the
 * group syncs its state (sync_state). On a GPU the state lives on the
 * device from the first sync on: a fresh process's (or a resumed
 * checkpoint's) host state goes up once, and no rebuild copies it back. */
int trainer_resume_and_sync(trainer *t)
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
            trainer_say(t, "resumed from %s (round %lld): step %lld, epoch %lld, position %lld",
                        path, (long long)got.round, (long long)got.step, (long long)got.epoch,
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
