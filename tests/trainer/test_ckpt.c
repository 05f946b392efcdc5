/* test_ckpt.c: checkpoints survive everything but losing both files.
 *
 * Round trip; only the last two kept; a torn newest file (truncated), a
 * flipped byte in the payload or header, and a checkpoint for another model
 * all fall back to the previous checkpoint; pruning never deletes the last
 * good one; and on a full disk (a 64 KiB tmpfs, skipped when mounting is not
 * permitted) the write fails cleanly and the previous checkpoint stays whole.
 */
#include <dirent.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ductile/ckpt.h"
#include "trainer_test.h"

#define NP 1000
#define NO 2000

static char dir[] = "/tmp/ductile-test-ckpt-XXXXXX";

static ckpt_state state_at(int64_t step)
{
    ckpt_state st;
    memset(&st, 0, sizeof(st));
    st.round = 3;
    st.step = step;
    st.epoch = step / 10;
    st.pos = step * 64 % 600;
    st.samples = step * 64;
    st.seed = 99;
    st.rng = 0x1234567890abcdefull + (uint64_t)step;
    st.optim_t = step;
    st.optim_kind = 1;
    st.optim_nstate = 2;
    st.cfg.kind = MODEL_MLP;
    st.cfg.in_c = 1, st.cfg.in_h = 28, st.cfg.in_w = 28, st.cfg.classes = 10;
    st.cfg.nhidden = 1, st.cfg.hidden[0] = 32;
    return st;
}

static void fill(float *p, float *o, int64_t step)
{
    for (int i = 0; i < NP; i++)
        p[i] = (float)step + i * 0.001f;
    for (int i = 0; i < NO; i++)
        o[i] = -(float)step - i * 0.002f;
}

static int save_step(const char *d, int64_t step, char *msg)
{
    float p[NP], o[NO];
    ckpt_state st = state_at(step);
    fill(p, o, step);
    return ckpt_save(d, &st, p, NP, o, NO, NULL, msg);
}

/* Loads and checks it is exactly step `want`; returns the error. */
static ckpt_err load_expect(const char *d, int64_t want, const char *what)
{
    float p[NP], o[NO], ep[NP], eo[NO];
    char path[4096], msg[256];
    ckpt_state want_st = state_at(want), st;
    ckpt_err e = ckpt_load(d, &want_st, &st, p, NP, o, NO, path, msg);
    if (want < 0) return e;
    CHECK(e == CKPT_OK, "%s: load: %s (%s)", what, ckpt_strerror(e), msg);
    if (e != CKPT_OK) return e;
    fill(ep, eo, want);
    CHECK(st.step == want, "%s: loaded step %lld, want %lld", what, (long long)st.step,
          (long long)want);
    CHECK(memcmp(&st, &want_st, sizeof(st)) == 0, "%s: state fields", what);
    CHECK(memcmp(p, ep, sizeof(p)) == 0 && memcmp(o, eo, sizeof(o)) == 0, "%s: arrays", what);
    return e;
}

static int count_files(const char *d, const char *prefix)
{
    DIR *dd = opendir(d);
    int n = 0;
    struct dirent *e;
    while (dd && (e = readdir(dd)))
        n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
    if (dd) closedir(dd);
    return n;
}

static void path_of(char *buf, const char *d, int64_t step)
{
    snprintf(buf, 4096, "%s/ckpt-r%08d-s%010lld.bin", d, 3, (long long)step);
}

static void flip_byte(const char *path, long offset)
{
    FILE *f = fopen(path, "r+b");
    fseek(f, offset, SEEK_SET);
    int c = fgetc(f);
    fseek(f, offset, SEEK_SET);
    fputc(c ^ 0x40, f);
    fclose(f);
}

static void test_round_trip_and_fallbacks(void)
{
    char msg[256], path[4096];
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    CHECK(load_expect(dir, -1, "empty") == CKPT_ERR_NONE, "empty dir: no checkpoint");

    CHECK(save_step(dir, 1, msg) == CKPT_OK, "save 1: %s", msg);
    load_expect(dir, 1, "round trip");
    CHECK(save_step(dir, 2, msg) == CKPT_OK, "save 2: %s", msg);
    CHECK(save_step(dir, 3, msg) == CKPT_OK, "save 3: %s", msg);
    CHECK(count_files(dir, "ckpt-") == 2, "%d checkpoints kept, want 2", count_files(dir, "ckpt-"));
    CHECK(count_files(dir, ".ckpt-") == 0, "no temporary files left");
    path_of(path, dir, 1);
    CHECK(access(path, F_OK) != 0, "oldest pruned");
    load_expect(dir, 3, "newest");

    /* Torn: the newest cut short -> the previous one. */
    path_of(path, dir, 3);
    struct stat sb;
    stat(path, &sb);
    CHECK(truncate(path, sb.st_size - 100) == 0, "truncate");
    load_expect(dir, 2, "torn newest");
    CHECK(truncate(path, 10) == 0, "truncate to 10 bytes");
    load_expect(dir, 2, "torn header");

    /* A new save after that keeps the good previous one and drops the torn. */
    CHECK(save_step(dir, 4, msg) == CKPT_OK, "save 4: %s", msg);
    path_of(path, dir, 2);
    CHECK(access(path, F_OK) == 0, "good previous checkpoint kept");
    path_of(path, dir, 3);
    CHECK(access(path, F_OK) != 0, "torn checkpoint pruned");

    /* One flipped bit in the payload, then in the header. */
    path_of(path, dir, 4);
    flip_byte(path, sb.st_size - 5);
    load_expect(dir, 2, "corrupt payload");
    CHECK(save_step(dir, 5, msg) == CKPT_OK, "save 5: %s", msg);
    path_of(path, dir, 5);
    flip_byte(path, 64); /* inside the state: only the CRC notices */
    load_expect(dir, 2, "corrupt header");

    /* Both gone: nothing usable, said so. */
    path_of(path, dir, 2);
    flip_byte(path, 100);
    CHECK(load_expect(dir, -1, "all corrupt") == CKPT_ERR_INVALID, "no usable checkpoint");

    /* A checkpoint of another model is not loaded into this one. */
    CHECK(save_step(dir, 6, msg) == CKPT_OK, "save 6: %s", msg);
    float p[NP], o[NO];
    ckpt_state want = state_at(6), st;
    want.cfg.hidden[0] = 64;
    CHECK(ckpt_load(dir, &want, &st, p, NP, o, NO, NULL, msg) == CKPT_ERR_INVALID,
          "mismatched model refused");
    want = state_at(6);
    want.optim_kind = 0;
    CHECK(ckpt_load(dir, &want, &st, p, NP, o, NO, NULL, msg) == CKPT_ERR_INVALID,
          "mismatched optimizer refused");
    want = state_at(6);
    CHECK(ckpt_load(dir, &want, &st, p, NP - 1, o, NO, NULL, msg) == CKPT_ERR_INVALID,
          "mismatched size refused");

    /* A newer round wins over a higher step of an older round. */
    float pp[NP], oo[NO];
    ckpt_state old = state_at(50);
    old.round = 2;
    fill(pp, oo, 50);
    CHECK(ckpt_save(dir, &old, pp, NP, oo, NO, NULL, msg) == CKPT_OK, "save old round");
    load_expect(dir, 6, "round beats step");

    char cmd[4200];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0, "cleanup");
}

static void test_disk_full(void)
{
    char mnt[] = "/tmp/ductile-test-ckpt-full-XXXXXX", msg[256] = "";
    CHECK(mkdtemp(mnt) != NULL, "mkdtemp");
    if (mount("tmpfs", mnt, "tmpfs", 0, "size=64k") != 0) {
        printf("SKIP disk-full case: cannot mount a tmpfs (%s); run as root to cover it\n",
               strerror(errno));
        rmdir(mnt);
        return;
    }
    /* 12 KB checkpoints: the first fits, then a 400 KB one cannot. */
    CHECK(save_step(mnt, 1, msg) == CKPT_OK, "small save: %s", msg);
    float *big = calloc(100000, sizeof(float));
    ckpt_state st = state_at(2);
    ckpt_err e = ckpt_save(mnt, &st, big, 100000, big, 0, NULL, msg);
    printf("disk full: %s: %s\n", ckpt_strerror(e), msg);
    CHECK(e == CKPT_ERR_WRITE, "full disk reported: %s", ckpt_strerror(e));
    CHECK(strstr(msg, "No space left") != NULL, "message names the cause: %s", msg);
    CHECK(count_files(mnt, ".ckpt-") == 0, "temporary file removed");
    load_expect(mnt, 1, "after disk full");
    /* Training goes on: a later save that fits still works. */
    CHECK(save_step(mnt, 3, msg) == CKPT_OK, "save after freeing: %s", msg);
    load_expect(mnt, 3, "after recovery");
    free(big);
    CHECK(umount2(mnt, MNT_DETACH) == 0, "umount: %s", strerror(errno));
    rmdir(mnt);
}

int main(void)
{
    test_round_trip_and_fallbacks();
    test_disk_full();
    return check_finish("test_ckpt");
}
