/* data.c: IDX reader, shuffling and sharding.
 *
 * The idea (data.h says it in full): an epoch's position is one global
 * sample counter over a permutation that depends on (seed, epoch) alone, so
 * each rank finds its slice of a global batch by arithmetic, with no
 * coordination, and the ranks consume every sample once whatever the world
 * size.
 *
 * IDX files are a big-endian header (magic 0x0000080N where N is the number
 * of dimensions, then N 32-bit sizes) followed by unsigned bytes. zlib's
 * gzread reads .gz and plain files alike; every size is checked against the
 * header so a truncated or malformed file is an error, never a short read
 * that trains on garbage.
 */
#include "ductile/data.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <zlib.h>

const char *data_strerror(data_err err)
{
    switch (err) {
    case DATA_OK:
        return "ok";
    case DATA_ERR_OPEN:
        return "cannot open data file";
    case DATA_ERR_FORMAT:
        return "malformed data file";
    case DATA_ERR_TRUNCATED:
        return "truncated data file";
    case DATA_ERR_MISMATCH:
        return "images and labels do not match";
    case DATA_ERR_NOMEM:
        return "out of memory";
    }
    return "unknown data error";
}

/* Reads exactly len bytes or fails with a reason. */
static data_err gz_read_all(gzFile f, void *buf, size_t len, const char *path, char *msg)
{
    unsigned char *p = buf;
    while (len > 0) {
        unsigned chunk = len > (1u << 30) ? (1u << 30) : (unsigned)len;
        int got = gzread(f, p, chunk);
        if (got <= 0) {
            int zerr = 0;
            const char *zmsg = gzerror(f, &zerr);
            if (zerr) /* zlib's message already names the file */
                snprintf(msg, DATA_MSG_MAX, "%.200s", zmsg);
            else
                snprintf(msg, DATA_MSG_MAX, "%.160s: ends early", path);
            return DATA_ERR_TRUNCATED;
        }
        p += got;
        len -= (size_t)got;
    }
    return DATA_OK;
}

static uint32_t be32(const unsigned char *b)
{
    return (uint32_t)b[0] << 24 | (uint32_t)b[1] << 16 | (uint32_t)b[2] << 8 | b[3];
}

/* Opens DIR/NAME.gz, or DIR/NAME when the .gz is absent. */
static gzFile open_idx(const char *dir, const char *name, char *path, size_t pathlen)
{
    snprintf(path, pathlen, "%s/%s.gz", dir, name);
    if (access(path, F_OK) != 0) snprintf(path, pathlen, "%s/%s", dir, name);
    errno = 0;
    return gzopen(path, "rb");
}

/* Reads one IDX file of unsigned bytes with `ndim` dimensions into *data. */
static data_err read_idx(const char *dir, const char *name, int ndim, uint32_t *dims,
                         uint8_t **data, char *msg)
{
    char path[4096];
    gzFile f = open_idx(dir, name, path, sizeof(path));
    if (!f) {
        snprintf(msg, DATA_MSG_MAX, "%.160s: %s", path, errno ? strerror(errno) : "cannot open");
        return DATA_ERR_OPEN;
    }
    data_err err;
    unsigned char hdr[4 + 4 * 3];
    if ((err = gz_read_all(f, hdr, 4 + 4 * (size_t)ndim, path, msg)) != DATA_OK) goto out;
    uint32_t magic = be32(hdr);
    if (magic != (0x00000800u | (uint32_t)ndim)) {
        snprintf(msg, DATA_MSG_MAX, "%.160s: bad magic number 0x%08x (want 0x%08x)", path, magic,
                 0x00000800u | (uint32_t)ndim);
        err = DATA_ERR_FORMAT;
        goto out;
    }
    size_t total = 1;
    for (int i = 0; i < ndim; i++) {
        dims[i] = be32(hdr + 4 + 4 * i);
        /* Fashion-MNIST has 70000 samples of 28x28: anything far beyond is
         * a corrupt header, not a data set. */
        uint32_t limit = i == 0 ? 10000000u : 1024u;
        if (dims[i] == 0 || dims[i] > limit) {
            snprintf(msg, DATA_MSG_MAX, "%.160s: bad dimension %d = %u", path, i, dims[i]);
            err = DATA_ERR_FORMAT;
            goto out;
        }
        total *= dims[i];
    }
    *data = malloc(total);
    if (!*data) {
        snprintf(msg, DATA_MSG_MAX, "%.160s: out of memory for %zu bytes", path, total);
        err = DATA_ERR_NOMEM;
        goto out;
    }
    if ((err = gz_read_all(f, *data, total, path, msg)) != DATA_OK) goto out;
    /* The stream must end here, cleanly: reading on also checks gzip's CRC
     * and length trailer. */
    unsigned char extra;
    int more = gzread(f, &extra, 1), zerr = 0;
    const char *zmsg = gzerror(f, &zerr);
    if (more < 0 || (zerr != Z_OK && zerr != Z_STREAM_END)) {
        snprintf(msg, DATA_MSG_MAX, "%.200s (corrupt or truncated)", zmsg);
        err = DATA_ERR_TRUNCATED;
        goto out;
    }
    if (more > 0) {
        snprintf(msg, DATA_MSG_MAX, "%.160s: more bytes than the header's %zu", path, total);
        err = DATA_ERR_FORMAT;
        goto out;
    }
out:
    if (err != DATA_OK) {
        free(*data);
        *data = NULL;
    }
    gzclose(f);
    return err;
}

data_err data_load(const char *dir, const char *prefix, data_set *out, char *msg)
{
    char name[64];
    uint32_t idims[3], ldims[1];
    memset(out, 0, sizeof(*out));
    snprintf(name, sizeof(name), "%s-images-idx3-ubyte", prefix);
    data_err err = read_idx(dir, name, 3, idims, &out->images, msg);
    if (err != DATA_OK) return err;
    snprintf(name, sizeof(name), "%s-labels-idx1-ubyte", prefix);
    if ((err = read_idx(dir, name, 1, ldims, &out->labels, msg)) != DATA_OK) goto err;
    if (idims[0] != ldims[0]) {
        snprintf(msg, DATA_MSG_MAX, "%.120s/%.40s: %u labels for %u images", dir, name, ldims[0],
                 idims[0]);
        err = DATA_ERR_MISMATCH;
        goto err;
    }
    for (uint32_t i = 0; i < ldims[0]; i++)
        if (out->labels[i] >= DATA_CLASSES) {
            snprintf(msg, DATA_MSG_MAX, "%.120s/%.40s: label %u of sample %u is not a class 0..9",
                     dir, name, out->labels[i], i);
            err = DATA_ERR_MISMATCH;
            goto err;
        }
    out->n = (int)idims[0];
    out->rows = (int)idims[1];
    out->cols = (int)idims[2];
    return DATA_OK;
err:
    data_free(out);
    return err;
}

void data_free(data_set *d)
{
    free(d->images);
    free(d->labels);
    memset(d, 0, sizeof(*d));
}

/* Fashion-MNIST's training-set pixel mean and standard deviation. */
#define PIXEL_MEAN 0.2860f
#define PIXEL_STD 0.3530f

void data_gather(const data_set *d, const int32_t *ids, int count, float *x, uint8_t *y)
{
    size_t px = (size_t)d->rows * d->cols;
    for (int i = 0; i < count; i++) {
        const uint8_t *img = d->images + (size_t)ids[i] * px;
        float *dst = x + (size_t)i * px;
        for (size_t j = 0; j < px; j++)
            dst[j] = (img[j] * (1.0f / 255.0f) - PIXEL_MEAN) * (1.0f / PIXEL_STD);
        y[i] = d->labels[ids[i]];
    }
}

uint64_t data_rng_next(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

float data_rng_uniform(uint64_t *state)
{
    return (float)(data_rng_next(state) >> 40) * (1.0f / 16777216.0f);
}

void data_permutation(int32_t *perm, int n, uint64_t seed, int64_t epoch)
{
    uint64_t s = seed ^ 0x5eed5eed5eed5eedull;
    s = data_rng_next(&s) ^ (uint64_t)epoch;
    for (int i = 0; i < n; i++)
        perm[i] = i;
    for (int i = n - 1; i > 0; i--) {
        int j = (int)(data_rng_next(&s) % (uint64_t)(i + 1));
        int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
}

int data_shard(int n, int64_t pos, int world, int batch, int rank, int64_t *start, int *count)
{
    int64_t left = n - pos;
    int64_t full = (int64_t)world * batch;
    int g = (int)(left < full ? left : full);
    if (g == full) {
        *start = pos + (int64_t)rank * batch;
        *count = batch;
    } else {
        int base = g / world, extra = g % world;
        *start = pos + (int64_t)rank * base + (rank < extra ? rank : extra);
        *count = base + (rank < extra ? 1 : 0);
    }
    return g;
}
