/* test_data.c: the IDX reader on real and malformed files, the permutation,
 * and sharding: for world sizes 1..4, and with the world size changing in
 * the middle of an epoch, every sample is trained exactly once per epoch.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <zlib.h>

#include "ductile/data.h"
#include "trainer_test.h"

/* ---- permutation and shards ---- */

static void test_permutation(void)
{
    int n = 1000;
    int32_t *a = malloc(sizeof(int32_t) * n), *b = malloc(sizeof(int32_t) * n);
    char *seen = calloc(n, 1);
    data_permutation(a, n, 42, 3);
    for (int i = 0; i < n; i++)
        if (a[i] >= 0 && a[i] < n) seen[a[i]]++;
    int ok = 1;
    for (int i = 0; i < n; i++)
        ok &= seen[i] == 1;
    CHECK(ok, "permutation of 0..n-1");
    data_permutation(b, n, 42, 3);
    CHECK(memcmp(a, b, sizeof(int32_t) * n) == 0, "same seed and epoch, same order");
    data_permutation(b, n, 42, 4);
    CHECK(memcmp(a, b, sizeof(int32_t) * n) != 0, "another epoch, another order");
    data_permutation(b, n, 43, 3);
    CHECK(memcmp(a, b, sizeof(int32_t) * n) != 0, "another seed, another order");
    free(a), free(b), free(seen);
}

/* Runs global batches from pos with `world` ranks until `batches` are done
 * (or the epoch ends), counting each sample position; returns the new pos. */
static int64_t run_batches(int n, int64_t pos, int world, int batch, int batches, int *count)
{
    for (int k = 0; k < batches && pos < n; k++) {
        int g = 0;
        int64_t next = pos;
        for (int r = 0; r < world; r++) {
            int64_t start;
            int c;
            g = data_shard(n, pos, world, batch, r, &start, &c);
            CHECK(start == next, "rank %d starts at %lld, want %lld (contiguous)", r,
                  (long long)start, (long long)next);
            if (g == world * batch)
                CHECK(start == pos + (int64_t)r * batch && c == batch, "full batch slice");
            for (int i = 0; i < c; i++)
                if (start + i < n) count[start + i]++;
            next = start + c;
        }
        CHECK(next == pos + g, "ranks cover the global batch (%lld vs %lld)", (long long)next,
              (long long)(pos + g));
        pos += g;
    }
    return pos;
}

static void check_once(const int *count, int n, const char *what)
{
    int bad = 0;
    for (int i = 0; i < n; i++)
        bad += count[i] != 1;
    CHECK(bad == 0, "%s: %d samples not seen exactly once", what, bad);
}

static void test_shards(void)
{
    int sizes[3] = {1000, 997, 5};
    int batches[3] = {7, 32, 1};
    for (int si = 0; si < 3; si++)
        for (int bi = 0; bi < 3; bi++)
            for (int w = 1; w <= 4; w++) {
                int n = sizes[si];
                int *count = calloc(n, sizeof(int));
                char what[64];
                snprintf(what, sizeof(what), "n=%d B=%d W=%d", n, batches[bi], w);
                int64_t pos = run_batches(n, 0, w, batches[bi], 1 << 30, count);
                CHECK(pos == n, "%s: epoch ends at %lld", what, (long long)pos);
                check_once(count, n, what);
                free(count);
            }
    /* World size changes mid-epoch (a resume at another W): 2 -> 3 -> 1 -> 4. */
    int n = 997, *count = calloc(n, sizeof(int));
    int64_t pos = run_batches(n, 0, 2, 16, 5, count);
    pos = run_batches(n, pos, 3, 16, 4, count);
    pos = run_batches(n, pos, 1, 16, 3, count);
    pos = run_batches(n, pos, 4, 16, 1 << 30, count);
    CHECK(pos == n, "resized epoch ends at %lld", (long long)pos);
    check_once(count, n, "W 2->3->1->4");
    free(count);
    /* A partial last batch smaller than the world: some ranks get nothing. */
    int64_t start;
    int c, g = data_shard(10, 8, 4, 5, 3, &start, &c);
    CHECK(g == 2 && c == 0 && start == 10, "tiny tail: g=%d c=%d start=%lld", g, c,
          (long long)start);
}

/* ---- IDX files ---- */

static char dir[] = "/tmp/ductile-test-data-XXXXXX";

static void be32(unsigned char *p, uint32_t v)
{
    p[0] = v >> 24, p[1] = v >> 16, p[2] = v >> 8, p[3] = v;
}

/* Writes DIR/name(.gz) as an IDX file: magic, dims, then `bytes` of data. */
static void write_idx(const char *name, int gz, uint32_t magic, int ndim, const uint32_t *dims,
                      const unsigned char *data, size_t bytes)
{
    char path[256];
    unsigned char hdr[16];
    be32(hdr, magic);
    for (int i = 0; i < ndim; i++)
        be32(hdr + 4 + 4 * i, dims[i]);
    snprintf(path, sizeof(path), "%s/%s%s", dir, name, gz ? ".gz" : "");
    gzFile f = gzopen(path, gz ? "wb" : "wbT");
    gzwrite(f, hdr, 4 + 4 * ndim);
    if (bytes) gzwrite(f, data, (unsigned)bytes);
    gzclose(f);
}

static void clean_dir(void)
{
    const char *names[] = {"train-images-idx3-ubyte", "train-labels-idx1-ubyte"};
    char path[256];
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof(path), "%s/%s", dir, names[i]);
        unlink(path);
        snprintf(path, sizeof(path), "%s/%s.gz", dir, names[i]);
        unlink(path);
    }
}

/* A valid 5-image set, then one thing broken. */
static unsigned char pixels[5 * 28 * 28], labels[5] = {0, 1, 2, 3, 9};

static void write_valid(int gz)
{
    uint32_t idims[3] = {5, 28, 28}, ldims[1] = {5};
    write_idx("train-images-idx3-ubyte", gz, 0x803, 3, idims, pixels, sizeof(pixels));
    write_idx("train-labels-idx1-ubyte", gz, 0x801, 1, ldims, labels, sizeof(labels));
}

static void expect_load(data_err want, const char *what, const char *needle)
{
    data_set d;
    char msg[256] = "";
    data_err got = data_load(dir, "train", &d, msg);
    CHECK(got == want, "%s: got %s (%s), want %s", what, data_strerror(got), msg,
          data_strerror(want));
    if (want != DATA_OK)
        CHECK(strlen(msg) > 0 && strchr(msg, '\n') == NULL && (!needle || strstr(msg, needle)),
              "%s: message '%s' (want one line mentioning '%s')", what, msg, needle ? needle : "");
    if (got == DATA_OK) data_free(&d);
    printf("  %-28s -> %s: %s\n", what, data_strerror(got), msg);
}

static void test_malformed(void)
{
    for (size_t i = 0; i < sizeof(pixels); i++)
        pixels[i] = (unsigned char)(i * 13);
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    printf("malformed files\n");

    expect_load(DATA_ERR_OPEN, "missing files", "train-images");

    write_valid(1);
    expect_load(DATA_OK, "valid (gzip)", NULL);
    clean_dir();
    write_valid(0);
    expect_load(DATA_OK, "valid (uncompressed)", NULL);
    clean_dir();

    uint32_t idims[3] = {5, 28, 28}, ldims[1] = {5};
    write_valid(1);
    write_idx("train-images-idx3-ubyte", 1, 0x804, 3, idims, pixels, sizeof(pixels));
    expect_load(DATA_ERR_FORMAT, "bad magic", "magic");

    write_valid(1);
    write_idx("train-labels-idx1-ubyte", 1, 0x00080801, 1, ldims, labels, 5);
    expect_load(DATA_ERR_FORMAT, "bad label magic", "magic");

    write_valid(1);
    uint32_t zero[3] = {5, 0, 28};
    write_idx("train-images-idx3-ubyte", 1, 0x803, 3, zero, pixels, 0);
    expect_load(DATA_ERR_FORMAT, "zero dimension", "dimension");

    write_valid(1);
    uint32_t huge[3] = {5, 28, 100000};
    write_idx("train-images-idx3-ubyte", 1, 0x803, 3, huge, pixels, sizeof(pixels));
    expect_load(DATA_ERR_FORMAT, "absurd dimension", "dimension");

    write_valid(1);
    write_idx("train-images-idx3-ubyte", 1, 0x803, 3, idims, pixels, sizeof(pixels) - 100);
    expect_load(DATA_ERR_TRUNCATED, "fewer pixels than dims", "train-images");

    write_valid(1);
    uint32_t fewer[3] = {4, 28, 28};
    write_idx("train-images-idx3-ubyte", 1, 0x803, 3, fewer, pixels, sizeof(pixels));
    expect_load(DATA_ERR_FORMAT, "more bytes than dims", "more bytes");

    write_valid(1);
    uint32_t four[1] = {4};
    write_idx("train-labels-idx1-ubyte", 1, 0x801, 1, four, labels, 4);
    expect_load(DATA_ERR_MISMATCH, "4 labels for 5 images", "labels");

    write_valid(1);
    unsigned char bad_labels[5] = {0, 1, 12, 3, 4};
    write_idx("train-labels-idx1-ubyte", 1, 0x801, 1, ldims, bad_labels, 5);
    expect_load(DATA_ERR_MISMATCH, "label 12", "label 12");

    /* A gzip stream cut in half (a partial download). */
    write_valid(1);
    char path[256];
    snprintf(path, sizeof(path), "%s/train-images-idx3-ubyte.gz", dir);
    struct stat sb;
    stat(path, &sb);
    CHECK(truncate(path, sb.st_size / 2) == 0, "truncate");
    expect_load(DATA_ERR_TRUNCATED, "truncated gzip", "train-images");

    /* Garbage after a valid gzip header byte pair. */
    write_valid(1);
    FILE *f = fopen(path, "r+b");
    fseek(f, 20, SEEK_SET);
    for (int i = 0; i < 64; i++)
        fputc(0xA5, f);
    fclose(f);
    data_set d;
    char msg[256] = "";
    data_err e = data_load(dir, "train", &d, msg);
    CHECK(e != DATA_OK, "corrupt gzip body accepted");
    printf("  %-28s -> %s: %s\n", "corrupt gzip body", data_strerror(e), msg);
    if (e == DATA_OK) data_free(&d);

    clean_dir();
    rmdir(dir);
}

static void test_real(void)
{
    const char *dirp = getenv("FASHION_MNIST");
    data_set train, test;
    char msg[256];
    if (!dirp) dirp = "/usr/share/datasets/fashion-mnist";
    data_err e = data_load(dirp, "train", &train, msg);
    CHECK(e == DATA_OK, "train: %s", msg);
    if (e != DATA_OK) return;
    CHECK(train.n == 60000 && train.rows == 28 && train.cols == 28, "train %d x %dx%d", train.n,
          train.rows, train.cols);
    int per_class[10] = {0};
    for (int i = 0; i < train.n; i++)
        per_class[train.labels[i]]++;
    CHECK(per_class[0] == 6000 && per_class[9] == 6000, "6000 per class");
    float x[2 * 784];
    uint8_t y[2];
    int32_t ids[2] = {0, 59999};
    data_gather(&train, ids, 2, x, y);
    CHECK(y[0] == train.labels[0] && y[1] == train.labels[59999], "gathered labels");
    CHECK(x[0] < 0 && x[0] > -1, "normalised background pixel %f", x[0]);
    data_free(&train);
    CHECK(data_load(dirp, "t10k", &test, msg) == DATA_OK && test.n == 10000, "test set");
    data_free(&test);
}

int main(void)
{
    test_permutation();
    test_shards();
    test_malformed();
    test_real();
    return check_finish("test_data");
}
