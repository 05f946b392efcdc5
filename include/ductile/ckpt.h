/* ckpt.h: training state on disk, atomically, with a checksum.
 *
 * A checkpoint is ckpt-r<round>-s<step>.bin in the checkpoint directory: a
 * fixed header (magic, version, sizes, CRC-32, the training position and the
 * model and optimizer configuration) followed by the parameters and the
 * optimizer state as flat floats. It is written to a temporary file,
 * fsync'd, renamed into place and the directory fsync'd, so a crash leaves
 * either the old set of files or the new one. The newest (round, step) that
 * reads back whole and matches the model is the one loaded; the last two good
 * ones are kept, so a torn or corrupt newest file falls back to the previous.
 */
#ifndef DUCTILE_CKPT_H
#define DUCTILE_CKPT_H

#include <stddef.h>
#include <stdint.h>

#include "ductile/model.h"

typedef enum {
    CKPT_OK = 0,
    CKPT_ERR_NONE,    /* no checkpoint in the directory */
    CKPT_ERR_INVALID, /* checkpoints exist but none is usable */
    CKPT_ERR_WRITE,   /* writing failed (the previous checkpoints are intact) */
    CKPT_ERR_DIR,     /* the directory cannot be created or read */
    CKPT_ERR_NOMEM,
} ckpt_err;

const char *ckpt_strerror(ckpt_err err);

/* The size of the msg buffer ckpt_* functions fill with a one-line reason. */
#define CKPT_MSG_MAX 256
/* The size of the path buffer ckpt_save and ckpt_load fill with the file's path. */
#define CKPT_PATH_MAX 4096

/* Everything but the float arrays. */
typedef struct ckpt_state {
    int64_t round;   /* the round it was made in */
    int64_t step;    /* optimizer steps done */
    int64_t epoch;   /* current epoch (0-based) */
    int64_t pos;     /* samples of this epoch already trained */
    int64_t samples; /* samples trained in the whole run */
    uint64_t seed;   /* data and initialisation seed */
    uint64_t rng;    /* the trainer's RNG state */
    int64_t optim_t; /* optimizer updates applied */
    int32_t optim_kind;
    int32_t optim_nstate;
    model_config cfg;
} ckpt_state;

/* Writes state, params[nparams] and opt[nopt] as the checkpoint for
 * (st->round, st->step), then deletes every other checkpoint but the newest
 * good one. path (may be NULL, CKPT_PATH_MAX bytes) receives the file
 * written; msg (CKPT_MSG_MAX bytes) one line on failure. */
ckpt_err ckpt_save(const char *dir, const ckpt_state *st, const float *params, size_t nparams,
                   const float *opt, size_t nopt, char *path, char *msg);

/* Loads the newest usable checkpoint whose model, optimizer and sizes match
 * `want` (cfg, optim_kind, optim_nstate) into *st, params and opt; path (may
 * be NULL, CKPT_PATH_MAX bytes) receives the file loaded. msg (CKPT_MSG_MAX
 * bytes) receives the reason on failure; on success it is "" or, when newer
 * files were unusable and skipped, a note naming the newest of them, for the
 * caller to warn about. */
ckpt_err ckpt_load(const char *dir, const ckpt_state *want, ckpt_state *st, float *params,
                   size_t nparams, float *opt, size_t nopt, char *path, char *msg);

/* 0 when the file is a whole, uncorrupted checkpoint; else -1 and a reason
 * in msg (CKPT_MSG_MAX bytes). */
int ckpt_verify(const char *path, char *msg);

#endif
