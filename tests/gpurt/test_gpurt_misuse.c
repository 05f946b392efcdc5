/* test_gpurt_misuse.c: the host GPU test runtime stops what a real GPU only
 * crashes on or silently gets wrong, and keeps what the real one does.
 *
 *   test_gpurt_misuse [CASE...]
 *
 * A misuse runs in a forked child (alarm(30) its deadline) with its stderr
 * on a pipe: the child must die by SIGABRT, saying "gpurt:", the call's
 * name and what was wrong. Each misuse has a twin, the same code used
 * right, which must run to the end in a child too (exit 0, its own checks
 * passed), so a runtime that aborted on everything would fail here:
 *   host_pointer   a malloc'd pointer to kern_fill;
 *   pinned_gemm    cudaMallocHost memory as cublasSgemm's C (twin: a 2x2
 *                  product checked for cuBLAS's column-major layout);
 *   past_end       kern_scale over one float more than the cudaMalloc block;
 *   race           a kernel on stream B reads what one on stream A wrote,
 *                  no event between (twin: cudaEventRecord + cudaStreamWaitEvent);
 *   free_queued    cudaFree of a block a queued kernel still writes (twin: the
 *                  stream synchronised first).
 *   unsettled      a cudaMemcpyAsync queued on a non-blocking comm's stream
 *                  right after its ncclAllReduce answered ncclInProgress
 *                  (twin: the comm polled to ncclSuccess first); a second
 *                  call before that is refused with ncclInvalidArgument.
 *   other_device   a kernel on device 0 writes device 1's memory (twin: its
 *                  own device's; and a launch on device 1's stream while
 *                  device 0 is current fails with cudaErrorInvalidResourceHandle).
 * Cases that hold no death, each checking CUDA's own semantics:
 *   sticky         after a launch failure (the async failpoint) every later
 *                  call answers it: malloc, free, streams, events, copies,
 *                  device queries;
 *   free_syncs     cudaFree waits for the whole device: a copy queued on
 *                  another stream has landed when it returns (and the free
 *                  is counted as a host sync); stale (a host read of a cudaMemcpyAsync
 * destination before cudaStreamSynchronize sees the old value, after it the
 * new one: the lazy queue's semantics) and gemm_invalid (sizes and leading
 * dimensions cuBLAS refuses give CUBLAS_STATUS_INVALID_VALUE, and no work).
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include "rt.h"
#include "th_proc.h"
#include "th_scenario.h"
#include "kernels.h"

#define N 64
#define CHILD_DEADLINE_S 30

/* ---- children ---- */

typedef struct child {
    int status;     /* waitpid's */
    char err[8192]; /* the start of what it wrote on stderr */
} child;

/* Runs fn in a child whose stderr comes back in c->err; 0, or -1 when no
 * child could be started. The child exits 0 when fn returns with its own
 * checks passed; by _exit, so no leak report runs for what a case leaves. */
static int run_child(void (*fn)(void), child *c)
{
    int fd[2];
    if (pipe(fd) != 0) return -1;
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        close(fd[0]);
        close(fd[1]);
        return -1;
    }
    if (pid == 0) {
        int before = check_failures(); /* the parent's, inherited */
        alarm(CHILD_DEADLINE_S);
        dup2(fd[1], STDERR_FILENO);
        close(fd[0]);
        close(fd[1]);
        fn();
        fflush(NULL);
        _exit(check_failures() > before ? 1 : 0);
    }
    close(fd[1]);
    size_t len = 0;
    char sink[512];
    for (;;) { /* to EOF: the child dies or exits by its alarm at the latest */
        size_t room = sizeof(c->err) - 1 - len;
        ssize_t r = read(fd[0], room ? c->err + len : sink, room ? room : sizeof(sink));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        if (room) len += (size_t)r;
    }
    c->err[len] = '\0';
    close(fd[0]);
    if (th_wait(&pid, CHILD_DEADLINE_S * 1000, &c->status) != 1) th_kill(&pid);
    return 0;
}

/* The line of s that says "gpurt:", for the log. */
static void print_gpurt_line(const char *s)
{
    const char *p = strstr(s, "gpurt:");
    if (!p) return;
    const char *end = strchr(p, '\n');
    printf("  %.*s\n", end ? (int)(end - p) : (int)strlen(p), p);
}

/* fn must abort with "gpurt:", call and word in its stderr. */
static void expect_death(void (*fn)(void), const char *call, const char *word)
{
    child c;
    CHECK_OR_EXIT(run_child(fn, &c) == 0, "fork: %s", strerror(errno));
    int aborted = WIFSIGNALED(c.status) && WTERMSIG(c.status) == SIGABRT;
    int said = strstr(c.err, "gpurt:") && strstr(c.err, call) && strstr(c.err, word);
    CHECK(aborted && said,
          "%s: wanted SIGABRT and \"gpurt:\", \"%s\", \"%s\" on stderr; got %s %d, stderr:\n%s",
          call, call, word, WIFSIGNALED(c.status) ? "signal" : "exit",
          WIFSIGNALED(c.status) ? WTERMSIG(c.status) : WEXITSTATUS(c.status), c.err);
    print_gpurt_line(c.err);
}

/* fn, misuse-free, must run to the end with its checks passed. */
static void expect_clean(void (*fn)(void), const char *what)
{
    child c;
    CHECK_OR_EXIT(run_child(fn, &c) == 0, "fork: %s", strerror(errno));
    CHECK(WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0, "%s: %s %d, stderr:\n%s", what,
          WIFSIGNALED(c.status) ? "killed by signal" : "exit status",
          WIFSIGNALED(c.status) ? WTERMSIG(c.status) : WEXITSTATUS(c.status), c.err);
}

/* ---- helpers (in a child: a failure exits it, and the parent reports it) ---- */

static float *dev_floats(size_t n)
{
    float *d = NULL;
    CHECK_OR_EXIT(cudaMalloc((void **)&d, sizeof(float) * n) == cudaSuccess, "cudaMalloc");
    return d;
}

static cudaStream_t new_stream(void)
{
    cudaStream_t s = NULL;
    CHECK_OR_EXIT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess,
                  "cudaStreamCreateWithFlags");
    return s;
}

/* n floats of d, read back after the device is idle. */
static void download(float *host, const float *d, size_t n)
{
    CHECK_OR_EXIT(cudaDeviceSynchronize() == cudaSuccess, "cudaDeviceSynchronize");
    CHECK_OR_EXIT(cudaMemcpy(host, d, sizeof(float) * n, cudaMemcpyDeviceToHost) == cudaSuccess,
                  "cudaMemcpy");
}

/* ---- a host pointer to a kernel ---- */

static void host_pointer_bad(void)
{
    float *x = malloc(sizeof(float) * N);
    kern_fill(x, N, 1.0f, NULL);
    free(x);
}

static void host_pointer_good(void)
{
    float *d = dev_floats(N), got[N];
    CHECK(kern_fill(d, N, 1.5f, NULL) == 0, "kern_fill");
    download(got, d, N);
    CHECK(got[0] == 1.5f && got[N - 1] == 1.5f, "filled %g .. %g", got[0], got[N - 1]);
    cudaFree(d);
}

static void test_host_pointer(void)
{
    expect_death(host_pointer_bad, "kern_fill", "pageable host memory");
    expect_clean(host_pointer_good, "kern_fill on cudaMalloc memory");
}

/* ---- pinned host memory to cuBLAS ---- */

/* C = A B, 2x2, column-major: A = [1 2; 3 4] is stored {1, 3, 2, 4}. */
static void gemm_2x2(int pinned_c)
{
    const float a[4] = {1, 3, 2, 4}, b[4] = {5, 7, 6, 8}, want[4] = {19, 43, 22, 50};
    const float one = 1.0f, zero = 0.0f;
    float *da = dev_floats(4), *db = dev_floats(4), *dc = NULL, got[4];
    if (pinned_c)
        CHECK_OR_EXIT(cudaMallocHost((void **)&dc, sizeof(float) * 4) == cudaSuccess,
                      "cudaMallocHost");
    else
        dc = dev_floats(4);
    CHECK_OR_EXIT(cudaMemcpy(da, a, sizeof(a), cudaMemcpyHostToDevice) == cudaSuccess &&
                      cudaMemcpy(db, b, sizeof(b), cudaMemcpyHostToDevice) == cudaSuccess,
                  "upload");
    cublasHandle_t h;
    CHECK_OR_EXIT(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS, "cublasCreate");
    CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &one, da, 2, db, 2, &zero, dc, 2) ==
              CUBLAS_STATUS_SUCCESS,
          "cublasSgemm");
    download(got, dc, 4);
    CHECK(memcmp(got, want, sizeof(want)) == 0, "C = {%g, %g, %g, %g}, want {19, 43, 22, 50}",
          got[0], got[1], got[2], got[3]);
    cublasDestroy(h);
    cudaFree(da);
    cudaFree(db);
    cudaFree(dc);
}

static void pinned_gemm_bad(void)
{
    gemm_2x2(1);
}

static void pinned_gemm_good(void)
{
    gemm_2x2(0);
}

static void test_pinned_gemm(void)
{
    expect_death(pinned_gemm_bad, "cublasSgemm", "C=");
    expect_clean(pinned_gemm_good, "cublasSgemm on cudaMalloc memory");
}

/* ---- a range past the end of its block ---- */

static void scale_n(size_t n)
{
    float *d = dev_floats(N);
    CHECK(kern_fill(d, N, 2.0f, NULL) == 0, "kern_fill");
    CHECK(kern_scale(d, n, 0.5f, NULL) == 0, "kern_scale");
    float got[N];
    download(got, d, N);
    CHECK(got[N - 1] == 1.0f, "scaled to %g", got[N - 1]);
    cudaFree(d);
}

static void past_end_bad(void)
{
    scale_n(N + 1);
}

static void past_end_good(void)
{
    scale_n(N);
}

static void test_past_end(void)
{
    expect_death(past_end_bad, "kern_scale", "past the end");
    expect_clean(past_end_good, "kern_scale over the whole block");
}

/* ---- a read on one stream of another stream's write ---- */

/* kern_fill writes d on stream A, kern_relu_forward reads it on stream B. */
static void two_streams(int ordered)
{
    cudaStream_t a = new_stream(), b = new_stream();
    cudaEvent_t written;
    CHECK_OR_EXIT(cudaEventCreateWithFlags(&written, cudaEventDisableTiming) == cudaSuccess,
                  "cudaEventCreate");
    float *d = dev_floats(N), *out = dev_floats(N), got[N];
    CHECK(kern_fill(d, N, 3.0f, a) == 0, "kern_fill");
    if (ordered)
        CHECK(cudaEventRecord(written, a) == cudaSuccess &&
                  cudaStreamWaitEvent(b, written, 0) == cudaSuccess,
              "event");
    CHECK(kern_relu_forward(out, d, N, b) == 0, "kern_relu_forward");
    CHECK_OR_EXIT(cudaStreamSynchronize(b) == cudaSuccess, "cudaStreamSynchronize");
    download(got, out, N);
    CHECK(got[0] == 3.0f, "read %g after the event", got[0]);
    cudaEventDestroy(written);
    cudaFree(d);
    cudaFree(out);
    cudaStreamDestroy(a);
    cudaStreamDestroy(b);
}

static void race_bad(void)
{
    two_streams(0);
}

static void race_good(void)
{
    two_streams(1);
}

static void test_race(void)
{
    expect_death(race_bad, "kern_relu_forward", "race");
    expect_clean(race_good, "the read after cudaStreamWaitEvent");
}

/* ---- a host read before the copy has run ---- */

/* ---- cudaFree under queued work ---- */

static void free_queued(int wait)
{
    cudaStream_t s = new_stream();
    float *d = dev_floats(N);
    CHECK_OR_EXIT(kern_fill(d, N, 2.0f, s) == 0, "kern_fill");
    if (wait) CHECK_OR_EXIT(cudaStreamSynchronize(s) == cudaSuccess, "cudaStreamSynchronize");
    cudaFree(d);
    cudaStreamDestroy(s);
}

static void free_queued_bad(void)
{
    free_queued(0);
}

static void free_queued_good(void)
{
    free_queued(1);
}

static void test_free_queued(void)
{
    expect_death(free_queued_bad, "cudaFree", "still uses this memory");
    expect_clean(free_queued_good, "cudaFree after the stream's work is done");
}

/* ---- a sticky error poisons the context ---- */

static void sticky_child(void)
{
    float *d = dev_floats(N), *e = NULL;
    cudaStream_t s = new_stream(), t = NULL;
    rt_fail_next("kern_fill:async");
    CHECK_OR_EXIT(kern_fill(d, N, 1.0f, s) == 0, "the failing launch is queued fine");
    CHECK(cudaStreamSynchronize(s) == cudaErrorLaunchFailure, "the sync does not report it");
    CHECK(cudaMalloc((void **)&e, 16) == cudaErrorLaunchFailure, "cudaMalloc");
    CHECK(cudaStreamCreate(&t) == cudaErrorLaunchFailure, "cudaStreamCreate");
    int dev = -1, count = -1;
    CHECK(cudaGetDevice(&dev) == cudaErrorLaunchFailure, "cudaGetDevice");
    CHECK(cudaGetDeviceCount(&count) == cudaErrorLaunchFailure, "cudaGetDeviceCount");
    float h = 0;
    CHECK(cudaMemcpy(&h, d, sizeof(h), cudaMemcpyDeviceToHost) == cudaErrorLaunchFailure,
          "cudaMemcpy");
    CHECK(kern_fill(d, N, 2.0f, s) == (int)cudaErrorLaunchFailure, "a later launch");
    CHECK(cudaGetLastError() == cudaErrorLaunchFailure, "cudaGetLastError cleared it");
    CHECK(cudaGetLastError() == cudaErrorLaunchFailure, "cudaGetLastError cleared it twice");
    CHECK(cudaFree(d) == cudaErrorLaunchFailure, "cudaFree");
    CHECK(cudaStreamDestroy(s) == cudaErrorLaunchFailure, "cudaStreamDestroy");
    if (check_failures()) _exit(1);
}

static void test_sticky(void)
{
    expect_clean(sticky_child, "every call after a sticky error answers it");
}

/* ---- cudaFree waits for the device ---- */

static void free_syncs_child(void)
{
    cudaStream_t s = new_stream();
    float *d = dev_floats(N), *other = dev_floats(N), *pinned = NULL;
    CHECK_OR_EXIT(cudaMallocHost((void **)&pinned, sizeof(float) * N) == cudaSuccess, "pinned");
    pinned[0] = -1.0f;
    CHECK_OR_EXIT(kern_fill(d, N, 4.0f, s) == 0, "kern_fill");
    CHECK_OR_EXIT(cudaMemcpyAsync(pinned, d, sizeof(float) * N, cudaMemcpyDeviceToHost, s) ==
                      cudaSuccess,
                  "cudaMemcpyAsync");
    long before = rt_host_syncs();
    CHECK_OR_EXIT(cudaFree(other) == cudaSuccess, "cudaFree");
    CHECK(pinned[0] == 4.0f, "after cudaFree the queued copy had not landed: %g", pinned[0]);
    CHECK(rt_host_syncs() == before + 1, "cudaFree was not counted as a host sync");
    cudaFreeHost(pinned);
    cudaFree(d);
    cudaStreamDestroy(s);
    if (check_failures()) _exit(1);
}

static void test_free_syncs(void)
{
    expect_clean(free_syncs_child, "cudaFree waits for the whole device");
}

/* ---- devices own their streams and memory ---- */

static void other_device(int wrong)
{
    CHECK_OR_EXIT(cudaSetDevice(1) == cudaSuccess, "cudaSetDevice(1)");
    float *d1 = dev_floats(N);
    cudaStream_t s1 = new_stream();
    CHECK_OR_EXIT(cudaSetDevice(0) == cudaSuccess, "cudaSetDevice(0)");
    float *d0 = dev_floats(N);
    cudaStream_t s0 = new_stream();
    CHECK(kern_fill(d1, N, 1.0f, s1) == (int)cudaErrorInvalidResourceHandle,
          "a launch on device 1's stream under device 0 was taken");
    CHECK_OR_EXIT(kern_fill(wrong ? d1 : d0, N, 1.0f, s0) == 0, "kern_fill");
    CHECK_OR_EXIT(cudaStreamSynchronize(s0) == cudaSuccess, "sync");
    cudaFree(d0);
    cudaFree(d1);
    cudaStreamDestroy(s0);
    cudaStreamDestroy(s1);
}

static void other_device_bad(void)
{
    other_device(1);
}

static void other_device_good(void)
{
    other_device(0);
}

static void test_other_device(void)
{
    expect_death(other_device_bad, "kern_fill", "device 1's memory");
    expect_clean(other_device_good, "a kernel on its own device's memory");
}

/* ---- CUDA work on a non-blocking comm's stream before it settled ---- */

static void unsettled(int settle)
{
    ncclUniqueId id;
    ncclComm_t comm = NULL;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    CHECK_OR_EXIT(ncclGetUniqueId(&id) == ncclSuccess, "ncclGetUniqueId");
    CHECK_OR_EXIT(ncclCommInitRankConfig(&comm, 1, id, 0, &cfg) == ncclInProgress, "init");
    ncclResult_t st = ncclInProgress;
    while (ncclCommGetAsyncError(comm, &st) == ncclSuccess && st == ncclInProgress)
        ;
    CHECK_OR_EXIT(st == ncclSuccess, "init: %s", ncclGetErrorString(st));
    cudaStream_t s = new_stream();
    float *d = dev_floats(N), *pinned = NULL, host[N];
    CHECK_OR_EXIT(cudaMallocHost((void **)&pinned, sizeof(float) * N) == cudaSuccess, "pinned");
    CHECK_OR_EXIT(kern_fill(d, N, 3.0f, s) == 0, "kern_fill");
    CHECK_OR_EXIT(ncclAllReduce(d, d, N, ncclFloat, ncclSum, comm, s) == ncclInProgress,
                  "a non-blocking allreduce must answer ncclInProgress");
    if (settle) {
        /* The comm takes no other call until it has settled. */
        CHECK(ncclAllReduce(d, d, N, ncclFloat, ncclSum, comm, s) == ncclInvalidArgument,
              "a second call before the first settled was taken");
        while (ncclCommGetAsyncError(comm, &st) == ncclSuccess && st == ncclInProgress)
            ;
        CHECK_OR_EXIT(st == ncclSuccess, "allreduce: %s", ncclGetErrorString(st));
    }
    CHECK_OR_EXIT(cudaMemcpyAsync(pinned, d, sizeof(float) * N, cudaMemcpyDeviceToHost, s) ==
                      cudaSuccess,
                  "cudaMemcpyAsync");
    CHECK_OR_EXIT(cudaStreamSynchronize(s) == cudaSuccess, "cudaStreamSynchronize");
    memcpy(host, pinned, sizeof(host));
    CHECK(host[0] == 3.0f && host[N - 1] == 3.0f, "the copy read %g, not the allreduce's 3",
          host[0]);
    ncclCommDestroy(comm);
    cudaFreeHost(pinned);
    cudaFree(d);
    cudaStreamDestroy(s);
}

static void unsettled_bad(void)
{
    unsettled(0);
}

static void unsettled_good(void)
{
    unsettled(1);
}

static void test_unsettled(void)
{
    expect_death(unsettled_bad, "cudaMemcpyAsync", "has not settled");
    expect_clean(unsettled_good, "the copy queued after the comm settled");
}

static void test_stale(void)
{
    cudaStream_t s = new_stream();
    float *d = dev_floats(N), *h = NULL;
    CHECK_OR_EXIT(cudaMallocHost((void **)&h, sizeof(float) * N) == cudaSuccess, "cudaMallocHost");
    for (int i = 0; i < N; i++)
        h[i] = 7.0f;
    CHECK(kern_fill(d, N, 4.0f, s) == 0, "kern_fill");
    CHECK(cudaMemcpyAsync(h, d, sizeof(float) * N, cudaMemcpyDeviceToHost, s) == cudaSuccess,
          "cudaMemcpyAsync");
    float before = h[N - 1];
    CHECK(before == 7.0f, "before the sync: %g (want the old 7)", before);
    CHECK(cudaStreamSynchronize(s) == cudaSuccess, "cudaStreamSynchronize");
    CHECK(h[0] == 4.0f && h[N - 1] == 4.0f, "after the sync: %g (want 4)", h[N - 1]);
    printf("  host read of the copy: %g before cudaStreamSynchronize, %g after\n", before,
           h[N - 1]);
    cudaFreeHost(h);
    cudaFree(d);
    cudaStreamDestroy(s);
}

/* ---- what cuBLAS itself refuses ---- */

static void test_gemm_invalid(void)
{
    const float one = 1.0f;
    float *a = dev_floats(N), *b = dev_floats(N), *c = dev_floats(N), got[N];
    cublasHandle_t h;
    CHECK_OR_EXIT(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS, "cublasCreate");
    CHECK(kern_fill(c, N, 9.0f, NULL) == 0, "kern_fill");
    /* m 4, n 4, k 4, op(A) = A is 4 x 4: lda 3 is too small; then ldb, ldc;
     * then a negative size and a negative batch count. */
    struct {
        const char *what;
        int m, n, k, lda, ldb, ldc, count;
    } bad[] = {{"lda < m", 4, 4, 4, 3, 4, 4, 1}, {"ldb < k", 4, 4, 4, 4, 3, 4, 1},
               {"ldc < m", 4, 4, 4, 4, 4, 3, 1}, {"m < 0", -1, 4, 4, 4, 4, 4, 1},
               {"k < 0", 4, 4, -1, 4, 4, 4, 1},  {"batchCount < 0", 4, 4, 4, 4, 4, 4, -1}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cublasStatus_t st =
            bad[i].count == 1
                ? cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, bad[i].m, bad[i].n, bad[i].k, &one, a,
                              bad[i].lda, b, bad[i].ldb, &one, c, bad[i].ldc)
                : cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_N, bad[i].m, bad[i].n,
                                            bad[i].k, &one, a, bad[i].lda, 16, b, bad[i].ldb, 16,
                                            &one, c, bad[i].ldc, 16, bad[i].count);
        CHECK(st == CUBLAS_STATUS_INVALID_VALUE, "%s: %s", bad[i].what, cublasGetStatusString(st));
    }
    /* op(A) = A^T is m x k, so A is stored k x m: lda must cover k, not m. */
    CHECK(cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, 2, 4, 4, &one, a, 2, b, 4, &one, c, 4) ==
              CUBLAS_STATUS_INVALID_VALUE,
          "transposed A with lda < k");
    download(got, c, N);
    CHECK(got[0] == 9.0f && got[N - 1] == 9.0f, "a refused GEMM wrote C: %g", got[0]);
    printf("  %zu refused GEMMs: \"%s\", C untouched\n", sizeof(bad) / sizeof(bad[0]) + 1,
           cublasGetStatusString(CUBLAS_STATUS_INVALID_VALUE));
    cublasDestroy(h);
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
}

int main(int argc, char **argv)
{
    setenv("DUCTILE_GPURT_DEVICES", "2", 0); /* cuBLAS needs a device, other_device two */
    unsetenv("DUCTILE_FAILPOINTS");
    static const th_case cases[] = {
        {"host_pointer", test_host_pointer}, {"pinned_gemm", test_pinned_gemm},
        {"past_end", test_past_end},         {"race", test_race},
        {"free_queued", test_free_queued},   {"stale", test_stale},
        {"gemm_invalid", test_gemm_invalid}, {"unsettled", test_unsettled},
        {"other_device", test_other_device}, {"sticky", test_sticky},
        {"free_syncs", test_free_syncs},
    };
    th_run_cases(cases, TH_COUNT(cases), argc, argv, 1, NULL);
    return check_finish("test_gpurt_misuse");
}
