/* options.h: ductile-train's options (private to the executable).
 *
 * One flag table is the whole interface: each flag is also read from
 * DUCTILE_TRAIN_<NAME> (--batch-size: DUCTILE_TRAIN_BATCH_SIZE), so the
 * defaults, the environment and the command line are applied in that order
 * by one parser, and --help is written next to the table it describes.
 */
#ifndef DUCTILE_TRAIN_OPTIONS_H
#define DUCTILE_TRAIN_OPTIONS_H

#include <stdint.h>
#include <stdio.h>

#include "ductile/log.h"
#include "ductile/model.h"

enum { DEVICE_AUTO = -1, DEVICE_CPU = 0, DEVICE_CUDA = 1 };

typedef struct options {
    model_config cfg;
    int epochs, batch, accumulate, threads, log_every, cosine;
    int overlap; /* ddp_overlap_mode */
    int64_t max_steps, warmup, checkpoint_every;
    int limit_train, limit_test, comm_timeout_ms;
    float lr, momentum, weight_decay;
    int optimizer;
    double bucket_cap_mb;
    uint64_t seed;
    const char *data, *summary, *checkpoint_dir, *record, *dump_params, *host;
    int comm;     /* comm_transport: --comm */
    int device;   /* DEVICE_* */
    int gpu;      /* CUDA ordinal when device is DEVICE_CUDA */
    int log_json; /* --log-format: 1 json, 0 text, -1 as DUCTILE_LOG_FORMAT says */
} options;

/* Defaults, then DUCTILE_TRAIN_* variables, then flags. Returns 0, 1 for
 * --help, or -1 after logging the bad value in one line on lg. */
int options_parse(int argc, char **argv, options *o, const dlog *lg);
void options_usage(FILE *f);

#endif
