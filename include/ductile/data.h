/* data.h: Fashion-MNIST from IDX files, the seeded per-epoch permutation and
 * each rank's share of a global batch.
 *
 * The position in an epoch is one global sample counter. A global batch is
 * the next min(W*B, n - pos) samples of the epoch's permutation; rank r takes
 * a contiguous slice of it (exactly [pos + r*B, pos + (r+1)*B) for a full
 * batch; a last partial batch is split as evenly as possible), so the ranks
 * together consume every sample of the epoch exactly once, whatever the world
 * size is and however often it changes between batches.
 */
#ifndef DUCTILE_DATA_H
#define DUCTILE_DATA_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    DATA_OK = 0,
    DATA_ERR_OPEN,      /* file missing or unreadable */
    DATA_ERR_FORMAT,    /* bad magic number or dimensions */
    DATA_ERR_TRUNCATED, /* fewer bytes than the header promises, or a broken gzip stream */
    DATA_ERR_MISMATCH,  /* images and labels disagree, or a label out of range */
    DATA_ERR_NOMEM,
} data_err;

const char *data_strerror(data_err err);

/* The size of the msg buffer data_load fills with a one-line reason. */
#define DATA_MSG_MAX 256

#define DATA_CLASSES 10

typedef struct data_set {
    int n;           /* samples */
    int rows, cols;  /* image size */
    uint8_t *images; /* n * rows * cols */
    uint8_t *labels; /* n, each < DATA_CLASSES */
} data_set;

/* Loads DIR/<prefix>-images-idx3-ubyte.gz and DIR/<prefix>-labels-idx1-ubyte.gz
 * (prefix "train" or "t10k"; the uncompressed names are tried when the .gz
 * ones are absent). msg (DATA_MSG_MAX bytes) receives one line naming the file. */
data_err data_load(const char *dir, const char *prefix, data_set *out, char *msg);
void data_free(data_set *d);

/* Normalised float pixels and labels of samples ids[0..count). */
void data_gather(const data_set *d, const int32_t *ids, int count, float *x, uint8_t *y);

/* ---- deterministic randomness ---- */

/* splitmix64: tiny, seedable, good enough for shuffles and initialisation. */
uint64_t data_rng_next(uint64_t *state);
/* Uniform in [0, 1). */
float data_rng_uniform(uint64_t *state);

/* perm[0..n) = the epoch's permutation of 0..n-1, a function of (seed, epoch) only. */
void data_permutation(int32_t *perm, int n, uint64_t seed, int64_t epoch);

/* The global batch at position pos of an n-sample epoch with `world` ranks of
 * `batch` samples each: returns its size and sets rank's [*start, *start+*count). */
int data_shard(int n, int64_t pos, int world, int batch, int rank, int64_t *start, int *count);

#endif
