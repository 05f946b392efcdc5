/* setup.c: everything ductile-train needs before its first step, and
 * the teardown.
 *
 * The device (--device), the first group and the control channel, the
 * compute threads and the overlap choice, then data, model, optimizer, the
 * DDP reducer and the first state sync; trainer_free() undoes any part of
 * it.
 */
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cblas.h>

#include "trainer.h"

/* --device: the trainer's GPU. A process that sees one device uses it,
 * device 0, whatever its LOCAL_RANK (CUDA_VISIBLE_DEVICES set per process,
 * or a device plugin that gives each container one GPU); one that sees at
 * least a device per local rank uses its LOCAL_RANK-th. auto is CUDA in
 * both cases, else the CPU: NCCL refuses two ranks of one communicator on
 * one GPU. A CPU rank in a round of CUDA ranks is refused for the whole
 * round at once (comm_choose.c), not timed out. */
int trainer_pick_device(trainer *t)
{
    char why[TRAINER_MSG_MAX];
    options *o = &t->o;
    int lws = t->env.local_world;
    if (o->device == DEVICE_CPU) return 0;
    int n = gpu_device_count(why);
    if (n == 0 && o->device == DEVICE_CUDA) return trainer_error(t, "--device cuda: %s", why);
    int fits = n == 1 || n >= lws;
    if (n > 0 && !fits && o->device == DEVICE_CUDA)
        return trainer_error(
            t, "--device cuda: %d local ranks but %d CUDA devices (one each needed)", lws, n);
    o->device = n > 0 && fits ? DEVICE_CUDA : DEVICE_CPU;
    o->gpu = n == 1 ? 0 : t->env.local_rank;
    return 0;
}

/* How this process joins a group: the options' address, deadline and device. */
group_link trainer_link(trainer *t)
{
    const options *o = &t->o;
    return (group_link){.host = o->host,
                        .timeout_ms = o->comm_timeout_ms,
                        .cuda = o->device == DEVICE_CUDA,
                        .transport = (comm_transport)o->comm,
                        .device = o->gpu,
                        .failed_here = trainer_comm_failed_here,
                        .failed_ctx = t};
}

/* The first group: rank, world and round as the environment says. */
int trainer_join(trainer *t)
{
    char msg[GROUP_MSG_MAX];
    t->g = (group){.rank = t->env.rank,
                   .world = t->env.world,
                   .local_world = t->env.local_world,
                   .round = t->env.round};
    group_link link = trainer_link(t);
    group_err e = group_connect(&t->g, &t->env, &link, msg);
    if (e == GROUP_OK) return 0;
    t->lost = e == GROUP_ERR_PEER;
    return trainer_error(t, "rank %d: %s", t->g.rank, msg);
}

/* Under an agent: the control channel, whatever the rebuild mode. */
int trainer_control_open(trainer *t)
{
    int fd = t->env.control_fd;
    if (fd < 0) return 0;
    elastic_err e = elastic_open(fd, t->g.round, &t->el);
    if (e != ELASTIC_OK)
        return trainer_error(t, "control channel fd %d: %s", fd, elastic_strerror(e));
    elastic_attach(t->el, t->g.comm, t->g.round);
    return 0;
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
void trainer_threads(trainer *t)
{
    int cores = usable_cores(), lw = t->g.local_world > 0 ? t->g.local_world : 1;
    int threads = t->o.threads > 0 ? t->o.threads : cores / lw > 0 ? cores / lw : 1;
    openblas_set_num_threads(threads);
    t->overlap = ddp_overlap_choose(t->o.overlap, t->o.device == DEVICE_CUDA, cores, lw, threads,
                                    t->overlap_why, sizeof(t->overlap_why));
}

int trainer_setup(trainer *t)
{
    char msg[TRAINER_MSG_MAX];
    data_err de;
    if ((de = data_load(t->o.data, "train", &t->train, msg)) != DATA_OK ||
        (de = data_load(t->o.data, "t10k", &t->test, msg)) != DATA_OK)
        return trainer_error(t, "%s: %s", data_strerror(de), msg);
    if (t->train.rows != t->test.rows || t->train.cols != t->test.cols)
        return trainer_error(t, "training images are %dx%d but test images %dx%d", t->train.rows,
                             t->train.cols, t->test.rows, t->test.cols);
    if (t->o.limit_train && t->o.limit_train < t->train.n) t->train.n = t->o.limit_train;
    t->o.cfg.in_c = 1;
    t->o.cfg.in_h = t->train.rows;
    t->o.cfg.in_w = t->train.cols;
    t->o.cfg.classes = DATA_CLASSES;
    int max_batch = t->o.batch > 256 ? t->o.batch : 256;
    if (model_create(&t->o.cfg, max_batch, &t->m, msg) != 0) return trainer_error(t, "%s", msg);
    model_init_params(t->m, t->o.seed);
    if (t->o.device == DEVICE_CUDA && gpu_attach(t->m, t->o.gpu, msg) != 0)
        return trainer_error(t, "--device cuda: %s", msg);
    optim_config oc = {.kind = t->o.optimizer,
                       .momentum = t->o.momentum,
                       .weight_decay = t->o.weight_decay,
                       .beta1 = 0.9f,
                       .beta2 = 0.999f,
                       .eps = 1e-8f};
    t->perm = malloc(sizeof(int32_t) * t->train.n);
    if (!t->perm || optim_create(&oc, t->m->nfloats, &t->opt) != 0)
        return trainer_error(t, "out of memory");
    t->perm_epoch = -1;
    if (trainer_reducer_create(t) != 0) return -1;
    memset(&t->st, 0, sizeof(t->st));
    t->st.round = t->g.round;
    t->st.seed = t->o.seed;
    t->st.rng = t->o.seed;
    t->st.optim_kind = t->o.optimizer;
    t->st.optim_nstate = t->opt->nstate;
    t->st.cfg = t->o.cfg;
    if (trainer_resume_and_sync(t) != 0) return -1;
    return 0;
}

/* The DDP reducer over the group's communicator, with the trainer's late vote. */
int trainer_reducer_create(trainer *t)
{
    ddp_err e = ddp_reducer_create(t->m, t->g.comm, (size_t)(t->o.bucket_cap_mb * 1048576.0),
                                   t->overlap, &t->r);
    if (e != DDP_OK) return trainer_error(t, "rank %d: reducer: %s", t->g.rank, ddp_strerror(e));
    ddp_set_vote(t->r, trainer_late_vote, t);
    return 0;
}

void trainer_free(trainer *t)
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
