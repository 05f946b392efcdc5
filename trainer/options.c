/* options.c: ductile-train's flags, --help and their parsing (options.h).
 *
 * The one idea: long_opts is the only list of flags. The parser walks it
 * twice, first for DUCTILE_TRAIN_<NAME> variables derived from each name,
 * then for the command line, and both feed the same set_option(), so a
 * value is checked the same way wherever it came from. A bad value is
 * logged once, in one line naming the flag and what it wants.
 */
#include "options.h"

#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "ductile/comm.h"    /* comm_transport */
#include "ductile/control.h" /* ctl_int: one integer parser */
#include "ductile/ddp.h"
#include "ductile/optim.h"

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
    {"overlap", 0, 0, 'V'},
    {"no-overlap", 0, 0, 'O'},
    {"threads", 1, 0, 't'},
    {"log-every", 1, 0, 'g'},
    {"host", 1, 0, 'h'},
    {"comm-timeout-ms", 1, 0, 'x'},
    {"comm", 1, 0, 'k'},
    {"device", 1, 0, 'G'},
    {"log-format", 1, 0, 'F'},
    {"help", 0, 0, '?'},
    {0, 0, 0, 0},
};

void options_usage(FILE *f)
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
        "                         ({rank} in FILE: every rank writes its own, as ROUND-RANK)\n"
        "  --overlap              all-reduce gradient buckets during backward, on a thread\n"
        "  --no-overlap           all-reduce them after backward\n"
        "                         (neither: auto, which overlaps on a GPU, and on the CPU only\n"
        "                         when the cores this process may use leave one for each local\n"
        "                         rank's communication thread beyond its --threads; the start\n"
        "                         line says which and why)\n"
        "  --threads N            BLAS threads (cores / LOCAL_WORLD_SIZE)\n"
        "  --log-every N          steps between log lines (100)\n"
        "  --host ADDR            address the ring listens on and publishes\n"
        "                         (DUCTILE_NODE_ADDR, else 127.0.0.1)\n"
        "  --comm-timeout-ms MS   deadline for a silent peer (30000)\n"
        "  --comm auto|ring|shm   CPU collectives: shared memory among ranks on one host, the\n"
        "                         TCP ring between hosts, both when a job spans hosts (auto);\n"
        "                         ring or shm forces one\n"
        "  --device auto|cpu|cuda where to train, on GPU number LOCAL_RANK; auto: CUDA when\n"
        "                         there is a GPU for each of LOCAL_WORLD_SIZE ranks (auto)\n"
        "  --log-format text|json error lines as text or one JSON object each\n"
        "                         (DUCTILE_LOG_FORMAT, else text; DUCTILE_LOG_LEVEL: "
        "error|warn|info|debug)\n"
        "Every option can also be set as DUCTILE_TRAIN_<NAME> (--batch-size: "
        "DUCTILE_TRAIN_BATCH_SIZE).\n"
        "Under ductile-agent: RANK, WORLD_SIZE, LOCAL_RANK, DUCTILE_ETCD_ENDPOINTS,\n"
        "DUCTILE_JOB, DUCTILE_ROUND (and DUCTILE_ETCD_CACERT/CERT/KEY/USER/PASSWORD).\n",
        f);
}

static int bad_value(const dlog *lg, const char *name, const char *v, const char *want)
{
    dlog_error(lg, NULL, "--%s: bad value '%s' (%s; see --help)", name, v, want);
    return -1;
}

static int parse_int(const dlog *lg, const char *name, const char *v, long long lo, long long hi,
                     long long *out)
{
    int64_t x;
    if (ctl_int(v, lo, hi, &x) != 0) {
        char want[96];
        snprintf(want, sizeof(want), "an integer in %lld..%lld", lo, hi);
        return bad_value(lg, name, v, want);
    }
    *out = x;
    return 0;
}

static int parse_float(const dlog *lg, const char *name, const char *v, double lo, double hi,
                       double *out)
{
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (errno || end == v || *end || !(x >= lo && x <= hi)) {
        char want[96];
        snprintf(want, sizeof(want), "a number in %g..%g", lo, hi);
        return bad_value(lg, name, v, want);
    }
    *out = x;
    return 0;
}

/* "256,128" -> sizes; returns the count or -1. */
static int parse_list(const dlog *lg, const char *name, const char *v, int *out, int max, int lo,
                      int hi)
{
    int n = 0;
    const char *p = v;
    if (*v == '\0') return 0;
    for (;;) {
        char *end;
        errno = 0;
        long x = strtol(p, &end, 10);
        if (errno || end == p || x < lo || x > hi || n == max || (*end && *end != ','))
            return bad_value(lg, name, v, "comma-separated sizes");
        out[n++] = (int)x;
        if (!*end) return n;
        p = end + 1;
    }
}

/* A group's setter returns this for a flag of another group. */
enum { OPTION_NOT_MINE = 1 };

/* The model: its kind and its sizes. */
static int set_model(options *o, int id, const char *name, const char *v, const dlog *lg)
{
    long long i;
    int n;
    switch (id) {
    case 'm':
        if (strcmp(v, "mlp") && strcmp(v, "cnn")) return bad_value(lg, name, v, "mlp or cnn");
        o->cfg.kind = strcmp(v, "cnn") == 0 ? MODEL_CNN : MODEL_MLP;
        return 0;
    case 'H':
        if ((n = parse_list(lg, name, v, o->cfg.hidden, MODEL_MAX_HIDDEN, 1, 65536)) < 0) return -1;
        o->cfg.nhidden = n;
        return 0;
    case 'C':
        if (parse_list(lg, name, v, o->cfg.conv, 2, 1, 1024) != 2)
            return bad_value(lg, name, v, "two channel counts, e.g. 16,32");
        return 0;
    case 'K':
        if (parse_int(lg, name, v, 1, 9, &i) || i % 2 == 0)
            return bad_value(lg, name, v, "an odd kernel size 1..9");
        o->cfg.kernel = (int)i;
        return 0;
    }
    return OPTION_NOT_MINE;
}

/* The optimizer and its schedule. */
static int set_optim(options *o, int id, const char *name, const char *v, const dlog *lg)
{
    long long i;
    double f;
    switch (id) {
    case 'l':
        return parse_float(lg, name, v, 0, 100, &f) ? -1 : (o->lr = (float)f, 0);
    case 'o':
        if (strcmp(v, "sgd") && strcmp(v, "adamw")) return bad_value(lg, name, v, "sgd or adamw");
        o->optimizer = strcmp(v, "adamw") == 0 ? OPTIM_ADAMW : OPTIM_SGD;
        return 0;
    case 'M':
        return parse_float(lg, name, v, 0, 0.9999, &f) ? -1 : (o->momentum = (float)f, 0);
    case 'w':
        return parse_float(lg, name, v, 0, 10, &f) ? -1 : (o->weight_decay = (float)f, 0);
    case 'W':
        return parse_int(lg, name, v, 0, LLONG_MAX / 2, &i) ? -1 : (o->warmup = i, 0);
    case 'S':
        if (strcmp(v, "cosine") && strcmp(v, "constant"))
            return bad_value(lg, name, v, "cosine or constant");
        o->cosine = strcmp(v, "cosine") == 0;
        return 0;
    }
    return OPTION_NOT_MINE;
}

/* The run: epochs, batches, data, limits, checkpoints, test files, logs. */
static int set_run(options *o, int id, const char *name, const char *v, const dlog *lg)
{
    long long i;
    switch (id) {
    case 'e':
        return parse_int(lg, name, v, 1, 100000, &i) ? -1 : (o->epochs = (int)i, 0);
    case 'b':
        return parse_int(lg, name, v, 1, 65536, &i) ? -1 : (o->batch = (int)i, 0);
    case 's':
        return parse_int(lg, name, v, 0, LLONG_MAX, &i) ? -1 : (o->seed = (uint64_t)i, 0);
    case 'd':
        o->data = v;
        return 0;
    case 'n':
        return parse_int(lg, name, v, 0, LLONG_MAX / 2, &i) ? -1 : (o->max_steps = i, 0);
    case 'j':
        o->summary = v;
        return 0;
    case 'a':
        return parse_int(lg, name, v, 1, 65536, &i) ? -1 : (o->accumulate = (int)i, 0);
    case 'c':
        o->checkpoint_dir = v;
        return 0;
    case 'E':
        return parse_int(lg, name, v, 0, LLONG_MAX / 2, &i) ? -1 : (o->checkpoint_every = i, 0);
    case 'L':
        return parse_int(lg, name, v, 1, INT_MAX, &i) ? -1 : (o->limit_train = (int)i, 0);
    case 'T':
        return parse_int(lg, name, v, 1, INT_MAX, &i) ? -1 : (o->limit_test = (int)i, 0);
    case 'r':
        o->record = v;
        return 0;
    case 'D':
        o->dump_params = v;
        return 0;
    case 'g':
        return parse_int(lg, name, v, 1, INT_MAX, &i) ? -1 : (o->log_every = (int)i, 0);
    case 'F':
        return dlog_format_parse(v, &o->log_json) ? bad_value(lg, name, v, "text or json") : 0;
    }
    return OPTION_NOT_MINE;
}

/* Gradients between ranks, threads and the device. */
static int set_comm(options *o, int id, const char *name, const char *v, const dlog *lg)
{
    long long i;
    double f;
    switch (id) {
    case 'B':
        return parse_float(lg, name, v, 0.0001, 4096, &f) ? -1 : (o->bucket_cap_mb = f, 0);
    case 'O':
        o->overlap = DDP_OVERLAP_OFF;
        return 0;
    case 'V':
        o->overlap = DDP_OVERLAP_ON;
        return 0;
    case 't':
        return parse_int(lg, name, v, 0, 1024, &i) ? -1 : (o->threads = (int)i, 0);
    case 'h':
        o->host = v;
        return 0;
    case 'x':
        return parse_int(lg, name, v, 100, 3600000, &i) ? -1 : (o->comm_timeout_ms = (int)i, 0);
    case 'k':
        if (strcmp(v, "auto") && strcmp(v, "ring") && strcmp(v, "shm"))
            return bad_value(lg, name, v, "auto, ring or shm");
        o->comm = !strcmp(v, "ring")  ? COMM_TRANSPORT_RING
                  : !strcmp(v, "shm") ? COMM_TRANSPORT_SHM
                                      : COMM_TRANSPORT_AUTO;
        return 0;
    case 'G':
        if (strcmp(v, "auto") && strcmp(v, "cpu") && strcmp(v, "cuda"))
            return bad_value(lg, name, v, "auto, cpu or cuda");
        o->device = !strcmp(v, "cuda") ? DEVICE_CUDA : !strcmp(v, "cpu") ? DEVICE_CPU : DEVICE_AUTO;
        return 0;
    }
    return OPTION_NOT_MINE;
}

/* One flag's value (id: its long_opts val); -1 once the error is logged. */
static int set_option(options *o, int id, const char *name, const char *v, const dlog *lg)
{
    int rc = set_model(o, id, name, v, lg);
    if (rc == OPTION_NOT_MINE) rc = set_optim(o, id, name, v, lg);
    if (rc == OPTION_NOT_MINE) rc = set_run(o, id, name, v, lg);
    if (rc == OPTION_NOT_MINE) rc = set_comm(o, id, name, v, lg);
    return rc == OPTION_NOT_MINE ? -1 : rc;
}

/* Defaults, then DUCTILE_TRAIN_* variables, then flags. 0 ok, 1 help, -1 bad. */
int options_parse(int argc, char **argv, options *o, const dlog *lg)
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
    o->overlap = DDP_OVERLAP_AUTO;
    o->log_every = 100;
    o->comm_timeout_ms = 30000;
    o->device = DEVICE_AUTO;
    o->log_json = -1;
    for (const struct option *lo = long_opts; lo->name; lo++) {
        char env[64];
        int n = snprintf(env, sizeof(env), "DUCTILE_TRAIN_");
        for (const char *p = lo->name; *p && n < (int)sizeof(env) - 1; p++)
            env[n++] = *p == '-' ? '_' : (char)(*p - ('a' <= *p && *p <= 'z' ? 32 : 0));
        env[n] = '\0';
        const char *v = getenv(env);
        if (!v || lo->val == '?') continue;
        if (lo->has_arg ? set_option(o, lo->val, lo->name, v, lg) != 0
                        : (strcmp(v, "1") == 0 && set_option(o, lo->val, lo->name, v, lg) != 0))
            return -1;
    }
    int c, idx;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "", long_opts, &idx)) != -1) {
        if (c == '?') {
            if (optopt == 0 && strcmp(argv[optind - 1], "--help") == 0) return 1;
            dlog_error(lg, NULL, "unknown or incomplete option '%s' (see --help)",
                       argv[optind - 1]);
            return -1;
        }
        if (set_option(o, c, long_opts[idx].name, optarg, lg) != 0) return -1;
    }
    if (optind < argc) {
        dlog_error(lg, NULL, "unexpected argument '%s'", argv[optind]);
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
