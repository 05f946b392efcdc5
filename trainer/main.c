/* main.c: ductile-train, data-parallel training of Fashion-MNIST on CPU.
 *
 * Alone (no RANK in the environment) it is one process; under ductile-agent
 * it reads RANK, WORLD_SIZE and the DUCTILE_* variables, opens the round's
 * store and builds a TCP ring with its peers. Either way the loop is the
 * same: every optimizer step takes `accumulate` global batches at the
 * epoch's sample position, backward feeds the DDP reducer, the optimizer
 * steps, and rank 0 checkpoints. The stop decision travels with the last
 * gradient bucket, so all ranks stop after the same step; SIGTERM finishes
 * the step, saves and exits 0.
 *
 * --device cuda (or auto with a device present) runs the same loop on the
 * GPU with NCCL between ranks: gpu_attach() moves the model there and the
 * model, optimizer and reducer calls dispatch to gpu_cuda.c; parameters are
 * copied back to the host only to checkpoint, dump or broadcast them.
 *
 * Under ductile-agent with a control channel (elastic.c) a failed step is
 * discarded and the group rebuilt in place; the agent hears `peer_lost`
 * when a peer vanished and `failed` when this process failed. Failpoint
 * train.step (DUCTILE_FAILPOINTS, rendezvous/failpoint.h) slows or fails a
 * step on purpose, for the tests of those paths.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cJSON.h>
#include <cblas.h>

#include "ductile/ckpt.h"
#include "ductile/comm.h"
#include "ductile/control.h" /* the agent-worker contract: CTL_ENV, the lost-peer exit status */
#include "ductile/data.h"
#include "ductile/ddp.h"
#include "ductile/elastic.h"
#include "ductile/failpoint.h"
#include "gpu.h"
#include "ductile/model.h"
#include "ductile/optim.h"
#include "ductile/rdzv.h"

static volatile sig_atomic_t stop_signal;

static void on_signal(int sig)
{
    stop_signal = sig;
}

/* ---- options: flags, each also from DUCTILE_TRAIN_<NAME> ---- */

typedef struct options {
    model_config cfg;
    int epochs, batch, accumulate, threads, log_every, overlap, cosine;
    int64_t max_steps, warmup, checkpoint_every;
    int limit_train, limit_test, comm_timeout_ms;
    float lr, momentum, weight_decay;
    int optimizer;
    double bucket_cap_mb;
    uint64_t seed;
    const char *data, *summary, *checkpoint_dir, *record, *dump_params, *host;
    int device; /* DEVICE_* */
    int gpu;    /* CUDA ordinal when device is DEVICE_CUDA */
} options;

enum { DEVICE_AUTO = -1, DEVICE_CPU = 0, DEVICE_CUDA = 1 };

static const struct option long_opts[] = {
    {"model", 1, 0, 'm'},
    {"hidden", 1, 0, 'H'},
    {"conv", 1, 0, 'C'},
    {"kernel", 1, 0, 'K'},
    {"epochs", 1, 0, 'e'},
    {"batch-size", 1, 0, 'b'},
    {"lr", 1, 0, 'l'},
    {"optimizer", 1, 0, 'o'},
    {"momentum", 1, 0, 'M'},
    {"weight-decay", 1, 0, 'w'},
    {"warmup-steps", 1, 0, 'W'},
    {"schedule", 1, 0, 'S'},
    {"seed", 1, 0, 's'},
    {"data", 1, 0, 'd'},
    {"max-steps", 1, 0, 'n'},
    {"summary", 1, 0, 'j'},
    {"bucket-cap-mb", 1, 0, 'B'},
    {"accumulate", 1, 0, 'a'},
    {"checkpoint-dir", 1, 0, 'c'},
    {"checkpoint-every", 1, 0, 'E'},
    {"limit-train", 1, 0, 'L'},
    {"limit-test", 1, 0, 'T'},
    {"record-samples", 1, 0, 'r'},
    {"dump-params", 1, 0, 'D'},
    {"no-overlap", 0, 0, 'O'},
    {"threads", 1, 0, 't'},
    {"log-every", 1, 0, 'g'},
    {"host", 1, 0, 'h'},
    {"comm-timeout-ms", 1, 0, 'x'},
    {"device", 1, 0, 'G'},
    {"help", 0, 0, '?'},
    {0, 0, 0, 0},
};

static void usage(FILE *f)
{
    fputs(
        "usage: ductile-train [options]\n"
        "  --model mlp|cnn        model (mlp)\n"
        "  --hidden N,N,...       fully connected hidden sizes (mlp 256,128; cnn 128)\n"
        "  --conv C1,C2           cnn: channels of the two conv blocks (16,32)\n"
        "  --kernel K             cnn: odd kernel size (5)\n"
        "  --epochs E             epochs (10)\n"
        "  --batch-size B         samples per rank per micro-batch (64)\n"
        "  --lr LR                peak learning rate (sgd 0.05, adamw 0.001)\n"
        "  --optimizer sgd|adamw  (sgd)\n"
        "  --momentum M           sgd momentum (0.9)\n"
        "  --weight-decay WD      (sgd 0, adamw 0.01)\n"
        "  --warmup-steps N       linear warm-up steps (100)\n"
        "  --schedule cosine|constant  after warm-up (cosine)\n"
        "  --seed S               initialisation and shuffling seed (1)\n"
        "  --data DIR             Fashion-MNIST IDX files (/usr/share/datasets/fashion-mnist)\n"
        "  --max-steps N          stop after N optimizer steps (0: no limit)\n"
        "  --summary FILE         write a JSON summary at the end (rank 0)\n"
        "  --bucket-cap-mb MB     gradient bucket size (25)\n"
        "  --accumulate N         micro-batches per step; N-1 without sync (1)\n"
        "  --checkpoint-dir DIR   resume from and save checkpoints there\n"
        "  --checkpoint-every N   steps between checkpoints (0: only at the end)\n"
        "  --limit-train N        train on the first N samples only\n"
        "  --limit-test N         evaluate on the first N test samples only\n"
        "  --record-samples FILE  test mode: append 'epoch sample step rank' per committed sample\n"
        "                         (under ductile-agent: 'epoch sample step rank round' per sample\n"
        "                         trained, written before its gradients leave)\n"
        "  --dump-params FILE     test mode: rank 0 writes the final parameters as raw floats\n"
        "  --no-overlap           all-reduce after backward instead of during it\n"
        "  --threads N            BLAS threads (cores / LOCAL_WORLD_SIZE)\n"
        "  --log-every N          steps between log lines (100)\n"
        "  --host ADDR            address the ring listens on and publishes\n"
        "                         (DUCTILE_NODE_ADDR, else 127.0.0.1)\n"
        "  --comm-timeout-ms MS   deadline for a silent peer (30000)\n"
        "  --device auto|cpu|cuda where to train, on GPU number LOCAL_RANK; auto: CUDA when\n"
        "                         there is a GPU for each of LOCAL_WORLD_SIZE ranks (auto)\n"
        "Every option can also be set as DUCTILE_TRAIN_<NAME> (--batch-size: "
        "DUCTILE_TRAIN_BATCH_SIZE).\n"
        "Under ductile-agent: RANK, WORLD_SIZE, LOCAL_RANK, DUCTILE_ETCD_ENDPOINTS,\n"
        "DUCTILE_JOB, DUCTILE_ROUND (and DUCTILE_ETCD_CACERT/CERT/KEY/USER/PASSWORD).\n",
        f);
}

static int bad_value(const char *name, const char *v, const char *want)
{
    fprintf(stderr, "ductile-train: --%s: bad value '%s' (%s; see --help)\n", name, v, want);
    return -1;
}

static int parse_int(const char *name, const char *v, long long lo, long long hi, long long *out)
{
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi) {
        char want[96];
        snprintf(want, sizeof(want), "an integer in %lld..%lld", lo, hi);
        return bad_value(name, v, want);
    }
    *out = x;
    return 0;
}

static int parse_float(const char *name, const char *v, double lo, double hi, double *out)
{
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (errno || end == v || *end || !(x >= lo && x <= hi)) {
        char want[96];
        snprintf(want, sizeof(want), "a number in %g..%g", lo, hi);
        return bad_value(name, v, want);
    }
    *out = x;
    return 0;
}

/* "256,128" -> sizes; returns the count or -1. */
static int parse_list(const char *name, const char *v, int *out, int max, int lo, int hi)
{
    int n = 0;
    const char *p = v;
    if (*v == '\0') return 0;
    for (;;) {
        char *end;
        errno = 0;
        long x = strtol(p, &end, 10);
        if (errno || end == p || x < lo || x > hi || n == max || (*end && *end != ','))
            return bad_value(name, v, "comma-separated sizes");
        out[n++] = (int)x;
        if (!*end) return n;
        p = end + 1;
    }
}

static int set_option(options *o, int id, const char *name, const char *v)
{
    long long i;
    double f;
    int n;
    switch (id) {
    case 'm':
        if (strcmp(v, "mlp") && strcmp(v, "cnn")) return bad_value(name, v, "mlp or cnn");
        o->cfg.kind = strcmp(v, "cnn") == 0 ? MODEL_CNN : MODEL_MLP;
        return 0;
    case 'H':
        if ((n = parse_list(name, v, o->cfg.hidden, MODEL_MAX_HIDDEN, 1, 65536)) < 0) return -1;
        o->cfg.nhidden = n;
        return 0;
    case 'C':
        if (parse_list(name, v, o->cfg.conv, 2, 1, 1024) != 2)
            return bad_value(name, v, "two channel counts, e.g. 16,32");
        return 0;
    case 'K':
        if (parse_int(name, v, 1, 9, &i) || i % 2 == 0)
            return bad_value(name, v, "an odd kernel size 1..9");
        o->cfg.kernel = (int)i;
        return 0;
    case 'e':
        return parse_int(name, v, 1, 100000, &i) ? -1 : (o->epochs = (int)i, 0);
    case 'b':
        return parse_int(name, v, 1, 65536, &i) ? -1 : (o->batch = (int)i, 0);
    case 'l':
        return parse_float(name, v, 0, 100, &f) ? -1 : (o->lr = (float)f, 0);
    case 'o':
        if (strcmp(v, "sgd") && strcmp(v, "adamw")) return bad_value(name, v, "sgd or adamw");
        o->optimizer = strcmp(v, "adamw") == 0 ? OPTIM_ADAMW : OPTIM_SGD;
        return 0;
    case 'M':
        return parse_float(name, v, 0, 0.9999, &f) ? -1 : (o->momentum = (float)f, 0);
    case 'w':
        return parse_float(name, v, 0, 10, &f) ? -1 : (o->weight_decay = (float)f, 0);
    case 'W':
        return parse_int(name, v, 0, LLONG_MAX / 2, &i) ? -1 : (o->warmup = i, 0);
    case 'S':
        if (strcmp(v, "cosine") && strcmp(v, "constant"))
            return bad_value(name, v, "cosine or constant");
        o->cosine = strcmp(v, "cosine") == 0;
        return 0;
    case 's':
        return parse_int(name, v, 0, LLONG_MAX, &i) ? -1 : (o->seed = (uint64_t)i, 0);
    case 'd':
        o->data = v;
        return 0;
    case 'n':
        return parse_int(name, v, 0, LLONG_MAX / 2, &i) ? -1 : (o->max_steps = i, 0);
    case 'j':
        o->summary = v;
        return 0;
    case 'B':
        return parse_float(name, v, 0.0001, 4096, &f) ? -1 : (o->bucket_cap_mb = f, 0);
    case 'a':
        return parse_int(name, v, 1, 65536, &i) ? -1 : (o->accumulate = (int)i, 0);
    case 'c':
        o->checkpoint_dir = v;
        return 0;
    case 'E':
        return parse_int(name, v, 0, LLONG_MAX / 2, &i) ? -1 : (o->checkpoint_every = i, 0);
    case 'L':
        return parse_int(name, v, 1, INT_MAX, &i) ? -1 : (o->limit_train = (int)i, 0);
    case 'T':
        return parse_int(name, v, 1, INT_MAX, &i) ? -1 : (o->limit_test = (int)i, 0);
    case 'r':
        o->record = v;
        return 0;
    case 'D':
        o->dump_params = v;
        return 0;
    case 'O':
        o->overlap = 0;
        return 0;
    case 't':
        return parse_int(name, v, 0, 1024, &i) ? -1 : (o->threads = (int)i, 0);
    case 'g':
        return parse_int(name, v, 1, INT_MAX, &i) ? -1 : (o->log_every = (int)i, 0);
    case 'h':
        o->host = v;
        return 0;
    case 'x':
        return parse_int(name, v, 100, 3600000, &i) ? -1 : (o->comm_timeout_ms = (int)i, 0);
    case 'G':
        if (strcmp(v, "auto") && strcmp(v, "cpu") && strcmp(v, "cuda"))
            return bad_value(name, v, "auto, cpu or cuda");
        o->device = !strcmp(v, "cuda") ? DEVICE_CUDA : !strcmp(v, "cpu") ? DEVICE_CPU : DEVICE_AUTO;
        return 0;
    }
    return -1;
}

/* Defaults, then DUCTILE_TRAIN_* variables, then flags. 0 ok, 1 help, -1 bad. */
static int parse_options(int argc, char **argv, options *o)
{
    memset(o, 0, sizeof(*o));
    o->cfg.kind = MODEL_MLP;
    o->cfg.nhidden = -1;
    o->cfg.conv[0] = 16;
    o->cfg.conv[1] = 32;
    o->cfg.kernel = 5;
    o->epochs = 10;
    o->batch = 64;
    o->accumulate = 1;
    o->lr = -1;
    o->momentum = 0.9f;
    o->weight_decay = -1;
    o->warmup = 100;
    o->cosine = 1;
    o->seed = 1;
    o->data = "/usr/share/datasets/fashion-mnist";
    o->bucket_cap_mb = 25;
    o->overlap = 1;
    o->log_every = 100;
    o->comm_timeout_ms = 30000;
    o->device = DEVICE_AUTO;
    for (const struct option *lo = long_opts; lo->name; lo++) {
        char env[64];
        int n = snprintf(env, sizeof(env), "DUCTILE_TRAIN_");
        for (const char *p = lo->name; *p && n < (int)sizeof(env) - 1; p++)
            env[n++] = *p == '-' ? '_' : (char)(*p - ('a' <= *p && *p <= 'z' ? 32 : 0));
        env[n] = '\0';
        const char *v = getenv(env);
        if (!v || lo->val == '?') continue;
        if (lo->has_arg ? set_option(o, lo->val, lo->name, v) != 0
                        : (strcmp(v, "1") == 0 && set_option(o, lo->val, lo->name, v) != 0))
            return -1;
    }
    int c, idx;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "", long_opts, &idx)) != -1) {
        if (c == '?') {
            if (optopt == 0 && strcmp(argv[optind - 1], "--help") == 0) return 1;
            fprintf(stderr, "ductile-train: unknown or incomplete option '%s' (see --help)\n",
                    argv[optind - 1]);
            return -1;
        }
        if (set_option(o, c, long_opts[idx].name, optarg) != 0) return -1;
    }
    if (optind < argc) {
        fprintf(stderr, "ductile-train: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    if (o->cfg.nhidden < 0) {
        o->cfg.nhidden = o->cfg.kind == MODEL_CNN ? 1 : 2;
        o->cfg.hidden[0] = o->cfg.kind == MODEL_CNN ? 128 : 256;
        o->cfg.hidden[1] = o->cfg.kind == MODEL_CNN ? 0 : 128;
    }
    if (o->cfg.kind == MODEL_MLP) o->cfg.conv[0] = o->cfg.conv[1] = o->cfg.kernel = 0;
    if (o->lr < 0) o->lr = o->optimizer == OPTIM_ADAMW ? 0.001f : 0.05f;
    if (o->weight_decay < 0) o->weight_decay = o->optimizer == OPTIM_ADAMW ? 0.01f : 0.0f;
    return 0;
}

/* ---- the group: world of one, or a ring through the round store ---- */

typedef struct group {
    int rank, world, local_world;
    int64_t round;
    rdzv_store *store;
    comm *comm;
    int lost; /* the group could not form because of a peer or the store, not us */
} group;

static int env_int(const char *name, long long lo, long long hi, long long dflt, long long *out)
{
    const char *v = getenv(name);
    char *end;
    if (!v) {
        *out = dflt;
        return 0;
    }
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi) {
        fprintf(stderr, "ductile-train: environment %s='%s' is not an integer in %lld..%lld\n",
                name, v, lo, hi);
        return -1;
    }
    *out = x;
    return 0;
}

static int group_join(group *g, const options *o)
{
    long long rank, world, lws, round;
    memset(g, 0, sizeof(*g));
    if (env_int("WORLD_SIZE", 1, 65536, 1, &world) || env_int("RANK", 0, world - 1, 0, &rank) ||
        env_int("LOCAL_WORLD_SIZE", 1, 65536, 1, &lws) ||
        env_int("DUCTILE_ROUND", 0, LLONG_MAX, 0, &round))
        return -1;
    g->rank = (int)rank;
    g->world = (int)world;
    g->local_world = (int)lws;
    g->round = round;
    if (world == 1) return 0;
    const char *endpoints = getenv("DUCTILE_ETCD_ENDPOINTS"), *job = getenv("DUCTILE_JOB");
    if (!endpoints || !job || !getenv("DUCTILE_ROUND")) {
        fprintf(stderr,
                "ductile-train: WORLD_SIZE=%lld needs DUCTILE_ETCD_ENDPOINTS, "
                "DUCTILE_JOB and DUCTILE_ROUND\n",
                world);
        return -1;
    }
    /* The agent hands its etcd credentials to workers under these names. */
    rdzv_etcd etcd = {.endpoints = endpoints,
                      .cacert = getenv("DUCTILE_ETCD_CACERT"),
                      .cert = getenv("DUCTILE_ETCD_CERT"),
                      .key = getenv("DUCTILE_ETCD_KEY"),
                      .user = getenv("DUCTILE_ETCD_USER"),
                      .password = getenv("DUCTILE_ETCD_PASSWORD")};
    rdzv_err re = rdzv_store_open(&etcd, job, round, &g->store);
    if (re != RDZV_OK) {
        fprintf(stderr, "ductile-train: round %lld store of job %s: %s\n", round, job,
                rdzv_strerror(re));
        g->lost = re != RDZV_ERR_ARG && re != RDZV_ERR_NOMEM;
        return -1;
    }
    comm_config cc = {.rank = g->rank,
                      .world_size = g->world,
                      .store = g->store,
                      /* The ring listens on, and publishes, this node's address. */
                      .host = o->host ? o->host : getenv("DUCTILE_NODE_ADDR"),
                      .timeout_ms = o->comm_timeout_ms,
                      .device = o->gpu};
    int cuda = o->device == DEVICE_CUDA;
    comm_err ce = cuda ? comm_nccl_init(&cc, &g->comm) : comm_ring_init(&cc, &g->comm);
    if (ce != COMM_OK) {
        fprintf(stderr, "ductile-train: rank %d: building the %s: %s: %s\n", g->rank,
                cuda ? "NCCL communicator" : "ring", comm_strerror(ce),
                rdzv_store_last_error(g->store));
        g->lost = comm_err_is_peer(ce);
        rdzv_store_close(g->store);
        g->store = NULL;
        return -1;
    }
    return 0;
}

static void group_leave(group *g)
{
    comm_free(g->comm);
    rdzv_store_close(g->store);
}

/* ---- the trainer's state ---- */

typedef struct trainer {
    options o;
    group g;
    data_set train, test;
    int32_t *perm;
    int64_t perm_epoch;
    model *m;
    optim *opt;
    ddp_reducer *r;
    ckpt_state st;
    int64_t start_step, start_samples;
    double loss_sum;     /* since the last log line */
    double eval_seconds; /* spent evaluating, left out of samples/s */
    double logged_at;    /* time and sample count of the last log line */
    int64_t logged_samples;
    int loss_n;
    char *records; /* sample records not yet committed */
    size_t nrecords, caprecords;
    elastic *el;         /* under ductile-agent: its control channel (elastic.c) */
    int has_state;       /* trained, synced or resumed: a claim in the agreement */
    int64_t state_round; /* the round that state was made in */
    char why[256];       /* the last failure of a step or an agreement, for the agent */
} trainer;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void say(const trainer *t, const char *fmt, ...)
{
    if (t->g.rank != 0) return;
    va_list ap;
    va_start(ap, fmt);
    printf("ductile-train: ");
    vprintf(fmt, ap);
    printf("\n");
    fflush(stdout);
    va_end(ap);
}

static int fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "ductile-train: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
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
    return fail("%s", t->why);
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
        fail("writing %s: %s", t->o.record, strerror(errno));
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

/* Failpoint train.step (rendezvous/failpoint.h), at the start of every
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
    fprintf(stderr, "ductile-train: failpoint train.step: unknown action '%s' ignored\n", a);
    return 0;
}

/* Forward, backward and reduction of `accumulate` micro-batches, then the
 * optimizer update. Sets *stop when any rank asked to stop after it. */
static int train_step(trainer *t, int want_stop, int *stop, int *epoch_ended)
{
    if (step_failpoint(t) != 0) return -1;
    float scale = (float)t->g.world / (float)step_samples(t);
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
            t->loss_sum += model_loss(t->m, count) / count;
            t->loss_n++;
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
        ddp_err de = ddp_finish(t->r, stop);
        if (de != DDP_OK)
            return trainer_fail(t, "rank %d: step %lld: %s: %s", t->g.rank, (long long)t->st.step,
                                ddp_strerror(de), ddp_last_error(t->r));
        char msg[200];
        if (t->m->dev && gpu_status(t->m, msg) != 0)
            return trainer_fail(t, "rank %d: step %lld: %s", t->g.rank, (long long)t->st.step, msg);
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
    double t0 = now_s();
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
    if (ddp_allreduce(t->r, &correct, 1) != DDP_OK)
        return trainer_fail(t, "rank %d: evaluation: %s", t->g.rank, ddp_last_error(t->r));
    *accuracy = (double)correct / n;
    t->eval_seconds += now_s() - t0;
    return 0;
}

/* ---- checkpoints ---- */

static void save_checkpoint(trainer *t)
{
    char path[4096], msg[256];
    if (!t->o.checkpoint_dir) return;
    if (t->g.rank == 0) {
        t->st.optim_t = t->opt->t;
        if (t->m->dev && gpu_download(t->m, t->opt, msg) != 0) {
            fail("checkpoint at step %lld not saved: %s", (long long)t->st.step, msg);
            return;
        }
        ckpt_err e = ckpt_save(t->o.checkpoint_dir, &t->st, t->m->weights, t->m->nfloats,
                               t->opt->state, t->opt->n * t->opt->nstate, path, msg);
        if (e != CKPT_OK) {
            fail("checkpoint at step %lld not saved, training on: %s", (long long)t->st.step, msg);
            return;
        }
        say(t, "checkpoint %s", path);
    }
    commit_records(t);
}

/* Under an agent (elastic mode) every rank claims (has state, the round it
 * was made in, steps done) and the newest claim's rank sends the position,
 * parameters and optimizer state to all: survivors of a rebuild, newcomers
 * and a rank 0 that resumed from a checkpoint agree the same way. A rank
 * whose copy breaks half-way keeps its state and claim (elastic_share). */
static int agree_state(trainer *t)
{
    char msg[200];
    if (t->g.comm) {
        elastic_claim mine = {t->has_state, t->state_round, t->st.step}, best;
        int root = 0;
        if (t->m->dev && gpu_download(t->m, t->opt, msg) != 0)
            return trainer_fail(t, "rank %d: %s", t->g.rank, msg);
        t->st.optim_t = t->opt->t;
        elastic_part parts[3] = {
            {&t->st, sizeof(t->st)},
            {t->m->weights, sizeof(float) * t->m->nfloats},
            {t->opt->state, sizeof(float) * t->opt->n * t->opt->nstate},
        };
        elastic_err e = elastic_agree(t->g.comm, &mine, &root, &best);
        if (e == ELASTIC_OK) e = elastic_share(t->g.comm, root, parts, 3);
        if (e != ELASTIC_OK)
            return trainer_fail(t, "rank %d: agreeing on the group's state: %s", t->g.rank,
                                e == ELASTIC_ERR_COMM ? comm_last_error(t->g.comm)
                                                      : elastic_strerror(e));
        t->opt->t = t->st.optim_t;
        say(t, "round %lld: state of rank %d (round %lld, step %lld) to %d ranks",
            (long long)t->g.round, root, (long long)best.round, (long long)best.step, t->g.world);
    }
    t->st.round = t->g.round;
    t->has_state = 1;
    t->state_round = t->g.round;
    return 0;
}

/* Rank 0 resumes from the newest usable checkpoint (if any); then parameters,
 * optimizer state and position go from rank 0 to everyone (under an agent:
 * from the rank the agreement chose). */
static int resume_and_sync(trainer *t)
{
    char path[4096], msg[200];
    /* On a GPU the current state is on the device: the host copy is what goes out. */
    if (t->m->dev && gpu_download(t->m, t->opt, msg) != 0)
        return trainer_fail(t, "rank %d: --device cuda: %s", t->g.rank, msg);
    if (t->g.rank == 0 && t->o.checkpoint_dir && !t->has_state) {
        ckpt_state want = t->st, got;
        ckpt_err e = ckpt_load(t->o.checkpoint_dir, &want, &got, t->m->weights, t->m->nfloats,
                               t->opt->state, t->opt->n * t->opt->nstate, path, msg);
        if (e == CKPT_OK) {
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
            fprintf(stderr, "ductile-train: %s; starting from scratch\n", msg);
        }
    }
    if (t->el) {
        /* The agreement leaves every rank with the chosen rank's state. */
        if (agree_state(t) != 0) return -1;
    } else {
        t->st.optim_t = t->opt->t;
        ckpt_state st = t->st;
        if (ddp_broadcast(t->r, &st, sizeof(st)) != DDP_OK ||
            ddp_broadcast(t->r, t->m->weights, sizeof(float) * t->m->nfloats) != DDP_OK ||
            ddp_broadcast(t->r, t->opt->state, sizeof(float) * t->opt->n * t->opt->nstate) !=
                DDP_OK)
            return fail("rank %d: syncing state from rank 0: %s", t->g.rank, ddp_last_error(t->r));
        st.round = t->st.round;
        t->st = st;
        t->opt->t = st.optim_t;
    }
    t->start_step = t->st.step;
    t->start_samples = t->logged_samples = t->st.samples;
    t->logged_at = now_s();
    return 0;
}

/* ---- setup, summary, teardown ---- */

static int trainer_setup(trainer *t)
{
    char msg[256];
    data_err de;
    if ((de = data_load(t->o.data, "train", &t->train, msg)) != DATA_OK ||
        (de = data_load(t->o.data, "t10k", &t->test, msg)) != DATA_OK)
        return fail("%s: %s", data_strerror(de), msg);
    if (t->train.rows != t->test.rows || t->train.cols != t->test.cols)
        return fail("training images are %dx%d but test images %dx%d", t->train.rows, t->train.cols,
                    t->test.rows, t->test.cols);
    if (t->o.limit_train && t->o.limit_train < t->train.n) t->train.n = t->o.limit_train;
    t->o.cfg.in_c = 1;
    t->o.cfg.in_h = t->train.rows;
    t->o.cfg.in_w = t->train.cols;
    t->o.cfg.classes = DATA_CLASSES;
    int max_batch = t->o.batch > 256 ? t->o.batch : 256;
    if (model_create(&t->o.cfg, max_batch, &t->m, msg) != 0) return fail("%s", msg);
    model_init_params(t->m, t->o.seed);
    if (t->o.device == DEVICE_CUDA && gpu_attach(t->m, t->o.gpu, msg) != 0)
        return fail("--device cuda: %s", msg);
    optim_config oc = {.kind = t->o.optimizer,
                       .momentum = t->o.momentum,
                       .weight_decay = t->o.weight_decay,
                       .beta1 = 0.9f,
                       .beta2 = 0.999f,
                       .eps = 1e-8f};
    t->perm = malloc(sizeof(int32_t) * t->train.n);
    if (!t->perm || optim_create(&oc, t->m->nfloats, &t->opt) != 0) return fail("out of memory");
    t->perm_epoch = -1;
    ddp_err e = ddp_reducer_create(t->m, t->g.comm, (size_t)(t->o.bucket_cap_mb * 1048576.0),
                                   t->o.overlap, &t->r);
    if (e != DDP_OK) return fail("reducer: %s", ddp_strerror(e));
    ddp_set_vote(t->r, late_vote, t);
    memset(&t->st, 0, sizeof(t->st));
    t->st.round = t->g.round;
    t->st.seed = t->o.seed;
    t->st.rng = t->o.seed;
    t->st.optim_kind = t->o.optimizer;
    t->st.optim_nstate = t->opt->nstate;
    t->st.cfg = t->o.cfg;
    if (resume_and_sync(t) != 0) return -1;
    if (t->m->dev && gpu_upload(t->m, t->opt, msg) != 0) return fail("--device cuda: %s", msg);
    return 0;
}

/* --device: the trainer on this node's LOCAL_RANK-th GPU. auto is CUDA when
 * every local rank can have a device of its own (NCCL cannot put two ranks
 * of one communicator on one GPU), else the CPU. */
static int pick_device(options *o)
{
    char why[256];
    long long local, lws;
    if (o->device == DEVICE_CPU) return 0;
    int n = gpu_device_count(why);
    if (n == 0 && o->device == DEVICE_CUDA) return fail("--device cuda: %s", why);
    if (n == 0) {
        o->device = DEVICE_CPU;
        return 0;
    }
    if (env_int("LOCAL_WORLD_SIZE", 1, 65536, 1, &lws) != 0 ||
        env_int("LOCAL_RANK", 0, lws - 1, 0, &local) != 0)
        return -1;
    if (n < lws && o->device == DEVICE_CUDA)
        return fail("--device cuda: %lld local ranks but %d CUDA devices (one each needed)", lws,
                    n);
    o->device = n >= lws ? DEVICE_CUDA : DEVICE_CPU;
    o->gpu = (int)local;
    return 0;
}

static void write_summary(const trainer *t, double acc, double seconds, const char *why)
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
    cJSON_AddBoolToObject(j, "overlap", t->o.overlap);
    cJSON_AddStringToObject(j, "stopped_by", why);
    char *text = cJSON_Print(j);
    FILE *f = fopen(t->o.summary, "w");
    if (!text || !f || fprintf(f, "%s\n", text) < 0 || fclose(f) != 0)
        fail("writing %s: %s", t->o.summary, strerror(errno));
    else
        f = NULL;
    if (f) fclose(f);
    free(text);
    cJSON_Delete(j);
}

static void dump_params(trainer *t)
{
    char msg[256];
    if (!t->o.dump_params || t->g.rank != 0) return;
    if (t->m->dev && gpu_download(t->m, NULL, msg) != 0) {
        fail("writing %s: %s", t->o.dump_params, msg);
        return;
    }
    FILE *f = fopen(t->o.dump_params, "wb");
    if (!f || fwrite(t->m->weights, sizeof(float), t->m->nfloats, f) != t->m->nfloats ||
        fclose(f) != 0)
        fail("writing %s: %s", t->o.dump_params, strerror(errno));
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

static int blas_threads(const options *o, const group *g)
{
    if (o->threads > 0) return o->threads;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int n = (int)(cores / g->local_world);
    return n > 0 ? n : 1;
}

/* Every --log-every steps: rank 0's loss and the global samples/s since the last line. */
static void log_progress(trainer *t)
{
    if (t->st.step % t->o.log_every != 0) return;
    double now = now_s();
    say(t, "step %lld epoch %lld loss %.4f samples/s %.0f", (long long)t->st.step,
        (long long)t->st.epoch, t->loss_sum / t->loss_n,
        (t->st.samples - t->logged_samples) / (now - t->logged_at));
    t->loss_sum = t->loss_n = 0;
    t->logged_at = now;
    t->logged_samples = t->st.samples;
}

/* Why every rank agreed to stop after this step. */
static const char *stop_reason(const trainer *t)
{
    if (stop_signal) return "signal";
    if (t->o.max_steps && t->st.step >= t->o.max_steps) return "max_steps";
    return "peer"; /* another rank asked everyone to stop */
}

/* ---- in-place rebuilds (elastic mode, under ductile-agent) ---- */

/* Under an agent: the control channel, whatever the rebuild mode. */
static int elastic_start(trainer *t)
{
    long long fd;
    if (!getenv("DUCTILE_CONTROL_FD")) return 0;
    if (env_int("DUCTILE_CONTROL_FD", 0, INT_MAX, 0, &fd) != 0) return -1;
    elastic_err e = elastic_open((int)fd, t->g.round, &t->el);
    if (e != ELASTIC_OK) return fail("control channel fd %lld: %s", fd, elastic_strerror(e));
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
    if (peer)
        elastic_report_peer_lost(t->el, t->g.round, why);
    else
        elastic_report_failed(t->el, why);
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
 * Returns 0 in the new round; 1 when asked to stop while waiting (the
 * caller exits 0 without saving: the round is over, a checkpoint now would
 * be the old round's); -1 on an error (the caller exits 1 and the agent
 * starts a fresh process, which gets the state from the survivors). */
static int trainer_regroup(trainer *t, const char *why)
{
    char msg[256];
    int64_t start_step = t->start_step, start_samples = t->start_samples;
    for (;;) {
        elastic_attach(t->el, NULL, t->g.round);
        ddp_reducer_free(t->r);
        t->r = NULL;
        group_leave(&t->g);
        t->g.comm = NULL;
        t->g.store = NULL;
        elastic_round rd;
        elastic_err e = elastic_wait_round(t->el, &stop_signal, ELASTIC_WAIT_MS, &rd);
        if (e == ELASTIC_ERR_STOP) return 1;
        if (e != ELASTIC_OK)
            return fail("rank %d: after round %lld: %s", t->g.rank, (long long)t->g.round,
                        elastic_strerror(e));
        t->g.rank = rd.rank;
        t->g.world = rd.world;
        t->g.round = rd.round;
        elastic_attach(t->el, NULL, rd.round); /* from now on, what the agent says is about rd */
        comm_config cc = {
            .host = t->o.host, .timeout_ms = t->o.comm_timeout_ms, .device = t->o.gpu};
        e = elastic_connect(&rd, &cc, t->o.device == DEVICE_CUDA, &t->g.store, &t->g.comm, msg);
        if (e != ELASTIC_OK) {
            fail("rank %d: %s; waiting for the next round", t->g.rank, msg);
            report_failure(t, e == ELASTIC_ERR_COMM, msg);
            continue;
        }
        elastic_attach(t->el, t->g.comm, t->g.round);
        if (ddp_reducer_create(t->m, t->g.comm, (size_t)(t->o.bucket_cap_mb * 1048576.0),
                               t->o.overlap, &t->r) != DDP_OK)
            return fail("rank %d: reducer: out of memory", t->g.rank);
        ddp_set_vote(t->r, late_vote, t);
        t->why[0] = '\0';
        if (resume_and_sync(t) != 0) {
            report_failure(t, peer_gone(t),
                           t->why[0] ? t->why : "agreeing on the group's state failed");
            continue;
        }
        if (t->m->dev && gpu_upload(t->m, t->opt, msg) != 0)
            return fail("rank %d: --device cuda: %s", t->g.rank, msg);
        t->start_step = start_step;
        t->start_samples = start_samples;
        say(t, "round %lld: world %d, rebuilt in place (%s), at step %lld epoch %lld",
            (long long)t->g.round, t->g.world, why, (long long)t->st.step, (long long)t->st.epoch);
        return 0;
    }
}

/* Elastic mode, after a failed step (already discarded) or evaluation: tell
 * the agent what failed, then rebuild. Returns trainer_regroup's answer. */
static int trainer_recover(trainer *t, const char *what)
{
    char why[400];
    snprintf(why, sizeof(why), "%s: %s", what, t->why[0] ? t->why : "no detail");
    report_failure(t, peer_gone(t), why);
    return trainer_regroup(t, why);
}

/* Elastic mode, after a step every rank agreed to stop after: at the job's
 * end, or for a rank asked to leave (it goes without evaluating: the
 * others carry on), 0; otherwise the round ends at this step boundary (a
 * peer leaves or a node joins): checkpoint, rebuild (unless already rebuilt
 * after this step), 1, with the rebuild's outcome (trainer_regroup) in
 * *left. */
static int trainer_boundary(trainer *t, int64_t *evaluated, int rebuilt, int *left)
{
    if (t->st.epoch >= t->o.epochs || (t->o.max_steps && t->st.step >= t->o.max_steps)) return 0;
    if (stop_signal) {
        *evaluated = t->st.step;
        return 0;
    }
    if (!rebuilt) {
        save_checkpoint(t);
        *left = trainer_regroup(t, "at a step boundary");
    }
    return 1;
}

int main(int argc, char **argv)
{
    static trainer t;
    int rc = parse_options(argc, argv, &t.o);
    if (rc != 0) { /* the bad value was already named in one line */
        if (rc > 0) usage(stdout);
        return rc > 0 ? 0 : 2;
    }
    char msg[256];
    if (failpoint_check_env(msg, sizeof(msg)) != 0) {
        fprintf(stderr, "ductile-train: %s\n", msg);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    if (pick_device(&t.o) != 0 || group_join(&t.g, &t.o) != 0 || elastic_start(&t) != 0 ||
        (openblas_set_num_threads(blas_threads(&t.o, &t.g)), 0) || trainer_setup(&t) != 0) {
        /* Under an agent, a group that could not form because a peer went
         * away is a lost peer, not this worker's failure: say so by the
         * exit status (the control channel may not be open yet). */
        int lost = t.g.lost || (t.g.comm && comm_err_is_peer(comm_error(t.g.comm)));
        trainer_free(&t);
        return lost && getenv(CTL_ENV) ? CTL_EXIT_PEER_LOST : 1;
    }
    char desc[256];
    model_describe(&t.o.cfg, desc, sizeof(desc));
    say(&t, "%s, %zu parameters in %d buckets, %d samples, world %d, round %lld, %s", desc,
        t.m->nfloats, ddp_bucket_count(t.r), t.train.n, t.g.world, (long long)t.g.round,
        t.m->dev ? "cuda" : "cpu");

    double t0 = now_s(), acc = 0;
    int64_t evaluated = -1;
    const char *why = "epochs";
    int stop = t.st.epoch >= t.o.epochs, failed = 0;
    int left = 0; /* a rebuild's 1 (stopped while waiting) or -1 (error): exit now */
    while (!stop && !failed && !left) {
        int epoch_ended = 0;
        int want = stop_signal != 0 || (t.o.max_steps && t.st.step + 1 >= t.o.max_steps);
        if (t.el && elastic_ending(t.el)) want = 1; /* the round ends after this step */
        ckpt_state before = t.st;
        if (train_step(&t, want, &stop, &epoch_ended) != 0) {
            if (t.el) { /* discard the partial step, rebuild, go on */
                t.st = before;
                left = trainer_recover(&t, "a step failed");
                continue;
            }
            failed = 1;
            break;
        }
        log_progress(&t);
        int rebuilt = 0;
        if (epoch_ended) {
            failed = evaluate(&t, &acc) != 0;
            evaluated = t.st.step;
            if (failed && t.el) { /* the step stands: rebuild, score it at the end */
                left = trainer_recover(&t, "evaluation failed");
                failed = 0;
                evaluated = -1;
                rebuilt = 1;
                if (left) break;
            }
            say(&t, "epoch %lld test_accuracy %.4f at %.1f s", (long long)t.st.epoch, acc,
                now_s() - t0);
        }
        if (stop) why = stop_reason(&t);
        if (stop && t.el && trainer_boundary(&t, &evaluated, rebuilt, &left)) {
            stop = 0;
            why = "epochs";
            continue;
        }
        stop = stop || t.st.epoch >= t.o.epochs;
        if (t.o.checkpoint_every && t.st.step % t.o.checkpoint_every == 0 && !stop && !failed)
            save_checkpoint(&t);
    }
    if (left) {
        trainer_free(&t);
        return left > 0 ? 0 : 1;
    }
    if (!failed && evaluated != t.st.step && evaluate(&t, &acc) != 0) failed = 1;
    double seconds = now_s() - t0;
    if (!failed) {
        save_checkpoint(&t);
        commit_records(&t);
        dump_params(&t);
        write_summary(&t, acc, seconds, why);
        say(&t, "done: %lld steps, test_accuracy %.4f, %.1f s, %.0f samples/s (%s)",
            (long long)t.st.step, acc, seconds, (t.st.samples - t.start_samples) / seconds, why);
    }
    trainer_free(&t);
    return failed ? 1 : 0;
}
