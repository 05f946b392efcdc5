/* eval.c: ductile-train's evaluation and the job's end.
 *
 * Test accuracy (each rank scores a slice of the test set, the counts are
 * summed), and once the job is done here: the last score, the final save,
 * and what the tests and the user read (the summary JSON, the parameter
 * dump, the "done" line).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cJSON.h>

#include "ductile/clock.h"
#include "trainer.h"

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

/* Test accuracy: each rank scores a slice of the test set, the counts are summed. */
int trainer_evaluate(trainer *t, double *accuracy)
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
        trainer_error(t, "writing %s: %s", t->o.summary, strerror(errno));
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
        trainer_error(t, "writing %s: %s", file, msg);
        return;
    }
    FILE *f = fopen(file, "wb");
    if (!f || fwrite(t->m->weights, sizeof(float), t->m->nfloats, f) != t->m->nfloats ||
        fclose(f) != 0)
        trainer_error(t, "writing %s: %s", file, strerror(errno));
}

/* The job is done here: score the last step if no evaluation did, save,
 * and write what the tests and the user read. LOOP_DONE or LOOP_FAILED. */
loop_state trainer_finish(trainer *t, loop *l)
{
    if (l->evaluated != t->st.step && trainer_evaluate(t, &l->acc) != 0) return LOOP_FAILED;
    double seconds = mono_now_s() - l->t0;
    trainer_save_checkpoint(t);
    trainer_commit_records(t);
    dump_params(t);
    write_summary(t, l->acc, seconds, l->why);
    trainer_say(t, "done: %lld steps, test_accuracy %.4f, %.1f s, %.0f samples/s (%s)",
                (long long)t->st.step, l->acc, seconds,
                (t->st.samples - t->start_samples) / seconds, stop_reason_name(l->why));
    return LOOP_DONE;
}
