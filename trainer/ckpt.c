/* ckpt.c: atomic, checksummed checkpoint files (see ckpt.h for the format).
 *
 * The idea: a checkpoint is written beside the old ones and renamed into
 * place, and a load walks the files newest first until one reads back whole,
 * so no crash or corruption costs more than the newest checkpoint.
 *
 * The header is written in the host's byte order with fixed-width fields
 * (checkpoints move between identical trainers, not architectures); the
 * CRC-32 (zlib) covers the header with its crc field zeroed and the payload.
 * A failed write (ENOSPC, EIO) removes the temporary file and touches
 * nothing else, so the previous checkpoints survive a full disk.
 */
#include "ductile/ckpt.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <zlib.h>

#define CKPT_MAGIC "DUCTCKPT"
#define CKPT_VERSION 1

typedef struct ckpt_header {
    char magic[8];
    uint32_t version;
    uint32_t header_bytes;
    uint64_t payload_bytes;
    uint32_t crc;
    uint32_t reserved;
    uint64_t nparams;
    uint64_t nopt;
    ckpt_state st;
} ckpt_header;

const char *ckpt_strerror(ckpt_err err)
{
    switch (err) {
    case CKPT_OK:
        return "ok";
    case CKPT_ERR_NONE:
        return "no checkpoint";
    case CKPT_ERR_INVALID:
        return "no usable checkpoint";
    case CKPT_ERR_WRITE:
        return "checkpoint write failed";
    case CKPT_ERR_DIR:
        return "checkpoint directory unusable";
    case CKPT_ERR_NOMEM:
        return "out of memory";
    }
    return "unknown checkpoint error";
}

static uint32_t crc_bytes(uint32_t crc, const void *p, size_t n)
{
    const unsigned char *b = p;
    while (n > 0) {
        uInt chunk = n > (1u << 30) ? (1u << 30) : (uInt)n;
        crc = (uint32_t)crc32(crc, b, chunk);
        b += chunk;
        n -= chunk;
    }
    return crc;
}

static uint32_t header_crc(const ckpt_header *h, const float *params, const float *opt)
{
    ckpt_header tmp = *h;
    tmp.crc = 0;
    uint32_t crc = crc_bytes((uint32_t)crc32(0, Z_NULL, 0), &tmp, sizeof(tmp));
    crc = crc_bytes(crc, params, h->nparams * sizeof(float));
    return crc_bytes(crc, opt, h->nopt * sizeof(float));
}

/* ckpt-r<round>-s<step>.bin -> 1 and (round, step); anything else -> 0. */
static int parse_name(const char *name, int64_t *round, int64_t *step)
{
    long long r, s;
    int end = 0;
    if (sscanf(name, "ckpt-r%lld-s%lld.bin%n", &r, &s, &end) != 2 || name[end] != '\0' || r < 0 ||
        s < 0)
        return 0;
    *round = r;
    *step = s;
    return 1;
}

typedef struct ckpt_file {
    int64_t round, step;
    char name[256];
} ckpt_file;

static int newest_first(const void *a, const void *b)
{
    const ckpt_file *x = a, *y = b;
    if (x->round != y->round) return x->round > y->round ? -1 : 1;
    if (x->step != y->step) return x->step > y->step ? -1 : 1;
    return 0;
}

/* The directory's checkpoints, newest first (*files malloc'd). -1 if unreadable. */
static int list_checkpoints(const char *dir, ckpt_file **files)
{
    DIR *d = opendir(dir);
    int n = 0, cap = 0;
    *files = NULL;
    if (!d) return errno == ENOENT ? 0 : -1;
    struct dirent *e;
    while ((e = readdir(d))) {
        ckpt_file f;
        if (strlen(e->d_name) >= sizeof(f.name) || !parse_name(e->d_name, &f.round, &f.step))
            continue;
        snprintf(f.name, sizeof(f.name), "%s", e->d_name);
        if (n == cap) {
            cap = cap ? 2 * cap : 8;
            ckpt_file *grown = realloc(*files, sizeof(ckpt_file) * cap);
            if (!grown) {
                closedir(d);
                free(*files);
                *files = NULL;
                return -1;
            }
            *files = grown;
        }
        (*files)[n++] = f;
    }
    closedir(d);
    if (n > 1) qsort(*files, n, sizeof(ckpt_file), newest_first);
    return n;
}

static int fsync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd < 0) return -1;
    int rc = fsync(fd);
    close(fd);
    return rc;
}

static int write_all(int fd, const void *buf, size_t n)
{
    const char *p = buf;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Deletes every checkpoint but `keep` and the newest other one that verifies. */
static void prune(const char *dir, const char *keep)
{
    ckpt_file *files;
    int n = list_checkpoints(dir, &files);
    int kept_previous = 0;
    char path[CKPT_PATH_MAX], why[CKPT_MSG_MAX];
    for (int i = 0; i < n; i++) {
        if (strcmp(files[i].name, keep) == 0) continue;
        snprintf(path, sizeof(path), "%s/%s", dir, files[i].name);
        if (!kept_previous && ckpt_verify(path, why) == 0) {
            kept_previous = 1;
            continue;
        }
        unlink(path);
    }
    free(files);
}

ckpt_err ckpt_save(const char *dir, const ckpt_state *st, const float *params, size_t nparams,
                   const float *opt, size_t nopt, char *path, char *msg)
{
    char name[256], final[CKPT_PATH_MAX], tmp[CKPT_PATH_MAX];
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        snprintf(msg, CKPT_MSG_MAX, "cannot create %.160s: %s", dir, strerror(errno));
        return CKPT_ERR_DIR;
    }
    snprintf(name, sizeof(name), "ckpt-r%08lld-s%010lld.bin", (long long)st->round,
             (long long)st->step);
    snprintf(final, sizeof(final), "%s/%s", dir, name);
    snprintf(tmp, sizeof(tmp), "%s/.%s.tmp.%d", dir, name, (int)getpid());

    ckpt_header h;
    memset(&h, 0, sizeof(h));
    memcpy(h.magic, CKPT_MAGIC, 8);
    h.version = CKPT_VERSION;
    h.header_bytes = sizeof(h);
    h.nparams = nparams;
    h.nopt = nopt;
    h.payload_bytes = (nparams + nopt) * sizeof(float);
    h.st = *st;
    h.crc = header_crc(&h, params, opt);

    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        snprintf(msg, CKPT_MSG_MAX, "cannot create %.160s: %s", tmp, strerror(errno));
        return CKPT_ERR_WRITE;
    }
    if (write_all(fd, &h, sizeof(h)) != 0 || write_all(fd, params, nparams * sizeof(float)) != 0 ||
        write_all(fd, opt, nopt * sizeof(float)) != 0 || fsync(fd) != 0) {
        snprintf(msg, CKPT_MSG_MAX, "writing %.160s: %s (previous checkpoints kept)", tmp,
                 strerror(errno));
        close(fd);
        unlink(tmp);
        return CKPT_ERR_WRITE;
    }
    if (close(fd) != 0 || rename(tmp, final) != 0) {
        snprintf(msg, CKPT_MSG_MAX, "finishing %.160s: %s (previous checkpoints kept)", final,
                 strerror(errno));
        unlink(tmp);
        return CKPT_ERR_WRITE;
    }
    if (fsync_dir(dir) != 0) {
        snprintf(msg, CKPT_MSG_MAX, "fsync of %.160s: %s", dir, strerror(errno));
        return CKPT_ERR_WRITE;
    }
    if (path) snprintf(path, CKPT_PATH_MAX, "%s", final);
    prune(dir, name);
    return CKPT_OK;
}

/* Reads and checks one file; on success fills *h and malloc'd *payload. */
static int read_checkpoint(const char *path, ckpt_header *h, float **payload, char *msg)
{
    *payload = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(msg, CKPT_MSG_MAX, "%s", strerror(errno));
        return -1;
    }
    struct stat sb;
    int rc = -1;
    if (fstat(fileno(f), &sb) != 0 || fread(h, sizeof(*h), 1, f) != 1) {
        snprintf(msg, CKPT_MSG_MAX, "shorter than a header (torn write?)");
        goto out;
    }
    if (memcmp(h->magic, CKPT_MAGIC, 8) != 0 || h->version != CKPT_VERSION ||
        h->header_bytes != sizeof(*h)) {
        snprintf(msg, CKPT_MSG_MAX, "not a version %d checkpoint", CKPT_VERSION);
        goto out;
    }
    if (h->payload_bytes != (h->nparams + h->nopt) * sizeof(float) ||
        (uint64_t)sb.st_size != sizeof(*h) + h->payload_bytes) {
        snprintf(msg, CKPT_MSG_MAX, "%lld bytes, header promises %llu (torn write?)",
                 (long long)sb.st_size, (unsigned long long)(sizeof(*h) + h->payload_bytes));
        goto out;
    }
    *payload = malloc(h->payload_bytes ? h->payload_bytes : 1);
    if (!*payload) {
        snprintf(msg, CKPT_MSG_MAX, "out of memory");
        goto out;
    }
    if (h->payload_bytes && fread(*payload, h->payload_bytes, 1, f) != 1) {
        snprintf(msg, CKPT_MSG_MAX, "read failed");
        goto out;
    }
    if (header_crc(h, *payload, *payload + h->nparams) != h->crc) {
        snprintf(msg, CKPT_MSG_MAX, "checksum mismatch (corrupt)");
        goto out;
    }
    rc = 0;
out:
    if (rc != 0) {
        free(*payload);
        *payload = NULL;
    }
    fclose(f);
    return rc;
}

int ckpt_verify(const char *path, char *msg)
{
    ckpt_header h;
    float *payload;
    if (read_checkpoint(path, &h, &payload, msg) != 0) return -1;
    free(payload);
    return 0;
}

/* Loads one file into *st, params and opt if it reads back whole and
 * matches want; else -1 and why (CKPT_MSG_MAX bytes). */
static int load_one(const char *path, const ckpt_state *want, ckpt_state *st, float *params,
                    size_t nparams, float *opt, size_t nopt, char *why)
{
    ckpt_header h;
    float *payload;
    char reason[CKPT_MSG_MAX];
    if (read_checkpoint(path, &h, &payload, reason) != 0) {
        snprintf(why, CKPT_MSG_MAX, "unusable: %.200s", reason);
        return -1;
    }
    if (memcmp(&h.st.cfg, &want->cfg, sizeof(want->cfg)) != 0 ||
        h.st.optim_kind != want->optim_kind || h.nparams != nparams || h.nopt != nopt) {
        snprintf(why, CKPT_MSG_MAX, "is for another model or optimizer");
        free(payload);
        return -1;
    }
    *st = h.st;
    memcpy(params, payload, nparams * sizeof(float));
    memcpy(opt, payload + nparams, nopt * sizeof(float));
    free(payload);
    return 0;
}

ckpt_err ckpt_load(const char *dir, const ckpt_state *want, ckpt_state *st, float *params,
                   size_t nparams, float *opt, size_t nopt, char *path, char *msg)
{
    ckpt_file *files;
    int n = list_checkpoints(dir, &files);
    if (n < 0) {
        snprintf(msg, CKPT_MSG_MAX, "cannot read %.160s: %s", dir, strerror(errno));
        return CKPT_ERR_DIR;
    }
    if (n == 0) {
        snprintf(msg, CKPT_MSG_MAX, "no checkpoint in %.160s", dir);
        return CKPT_ERR_NONE;
    }
    /* Newest first: the first file that loads wins; the newest one skipped
     * is named in msg for the caller to warn about. */
    char full[CKPT_PATH_MAX], why[CKPT_MSG_MAX], newest[CKPT_MSG_MAX] = "";
    int i;
    for (i = 0; i < n; i++) {
        snprintf(full, sizeof(full), "%s/%s", dir, files[i].name);
        if (load_one(full, want, st, params, nparams, opt, nopt, why) == 0) break;
        if (i == 0) snprintf(newest, sizeof(newest), "%.40s %.200s", files[i].name, why);
    }
    ckpt_err err = i < n ? CKPT_OK : CKPT_ERR_INVALID;
    if (err == CKPT_OK && path) snprintf(path, CKPT_PATH_MAX, "%s", full);
    if (err != CKPT_OK)
        snprintf(msg, CKPT_MSG_MAX, "none of the %d checkpoints in %.60s is usable (newest: %.78s)",
                 n, dir, newest);
    else if (i > 0)
        snprintf(msg, CKPT_MSG_MAX, "%d newer checkpoint%s skipped (newest: %.140s)", i,
                 i > 1 ? "s" : "", newest);
    else
        msg[0] = '\0';
    free(files);
    return err;
}
