/* bench_allreduce: bus bandwidth of the CPU allreduce on this machine.
 *
 *   bench_allreduce --ranks W [--shm] [--min-bytes B] [--max-bytes B] [--chunk-bytes B]
 *   bench_allreduce --memcpy
 *
 * Forks W ranks joined by loopback TCP connections (the same sockets and
 * options the store bootstrap makes), or with --shm by a shared memfd
 * segment and liveness socket pairs (what the shm bootstrap hands out); the
 * store itself is left out so the figure is the data path alone. It times
 * allreduce at sizes doubling
 * from min to max bytes. Rank 0 prints one line per size:
 *   bytes  seconds_per_op  algbw_GBps  busbw_GBps
 * with busbw = algbw * 2(W-1)/W, the figure that is comparable across
 * world sizes (nccl-tests' definition). --memcpy prints this machine's
 * single-thread memcpy bandwidth (64 MiB buffers, best of several) as the
 * ceiling the figures are read against.
 */
#include "comm_impl.h"
#include "ductile/clock.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int memcpy_bench(void)
{
    size_t n = 64u << 20;
    char *a = malloc(n), *b = malloc(n);
    if (!a || !b) return 1;
    memset(a, 1, n);
    memset(b, 2, n);
    double best = 1e9;
    for (int i = 0; i < 8; i++) {
        double t0 = mono_now_s();
        memcpy(i % 2 ? a : b, i % 2 ? b : a, n);
        double dt = mono_now_s() - t0;
        if (dt < best) best = dt;
    }
    /* Keep the copies observable so they are not optimised away. */
    printf("memcpy_GBps %.3f %d\n", (double)n / best / 1e9, a[n / 2] + b[n / 3]);
    free(a);
    free(b);
    return 0;
}

/* The whole run of one world size: sizes up to 1 GiB at the slowest
 * figures seen here take well under this. */
#define RANKS_DEADLINE_S 900.0

/* Reaps the W ranks by the deadline; a rank still running then is killed
 * (and reaped), so the bench never waits forever on a stuck rank. Returns
 * how many did not exit 0. */
static int reap_ranks(pid_t *pids, int world, double deadline)
{
    int bad = 0, left = world;
    while (left > 0) {
        for (int r = 0; r < world; r++) {
            int st = 0;
            if (pids[r] <= 0) continue;
            pid_t got = waitpid(pids[r], &st, WNOHANG);
            if (got == 0) continue;
            if (got < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) bad++;
            pids[r] = 0;
            left--;
        }
        if (left == 0) break;
        if (mono_now_s() > deadline) {
            fprintf(stderr, "bench_allreduce: %d of %d ranks still running after %.0f s; killed\n",
                    left, world, RANKS_DEADLINE_S);
            for (int r = 0; r < world; r++)
                if (pids[r] > 0) {
                    kill(pids[r], SIGKILL);
                    waitpid(pids[r], NULL, 0); /* SIGKILL: the reap is prompt */
                }
            return bad + left;
        }
        struct timespec ts = {0, 10 * 1000000};
        nanosleep(&ts, NULL);
    }
    return bad;
}

/* A loopback TCP connection: *out is the connecting end, *in the accepted. */
static int tcp_pair(int *out, int *in)
{
    struct sockaddr_in sa = {0};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t sl = sizeof(sa);
    int sz = 4 << 20;
    int l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (l < 0) return -1;
    setsockopt(l, SOL_SOCKET, SO_RCVBUF, &sz, sizeof(sz));
    setsockopt(l, SOL_SOCKET, SO_SNDBUF, &sz, sizeof(sz));
    if (bind(l, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(l, 1) < 0 ||
        getsockname(l, (struct sockaddr *)&sa, &sl) < 0)
        goto err;
    int c = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (c < 0) goto err;
    setsockopt(c, SOL_SOCKET, SO_RCVBUF, &sz, sizeof(sz));
    setsockopt(c, SOL_SOCKET, SO_SNDBUF, &sz, sizeof(sz));
    if (connect(c, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        close(c);
        goto err;
    }
    int a = accept4(l, NULL, NULL, SOCK_CLOEXEC);
    if (a < 0) {
        close(c);
        goto err;
    }
    close(l);
    *out = c;
    *in = a;
    return 0;
err:
    close(l);
    return -1;
}

/* How a rank joins: two ring sockets, or the segment and its peers. */
typedef struct rank_link {
    int left, right;
    int memfd;    /* >= 0: shared memory */
    int peer[64]; /* shared memory: liveness socket to each rank */
} rank_link;

static int run_rank(int rank, int world, rank_link *lk, size_t lo, size_t hi, size_t chunk)
{
    comm_config cfg = {0};
    cfg.chunk_bytes = chunk;
    cfg.rank = rank;
    cfg.world_size = world;
    cfg.timeout_ms = 60000;
    comm *c = NULL;
    comm_err err = lk->memfd >= 0 ? comm_shm_from_fds(&cfg, lk->memfd, lk->peer, &c)
                                  : comm_ring_from_fds(&cfg, lk->left, lk->right, &c);
    if (err != COMM_OK) {
        fprintf(stderr, "rank %d: %s\n", rank, comm_strerror(err));
        return 1;
    }
    float *buf = malloc(hi);
    if (!buf) return 1;
    for (size_t i = 0; i < hi / sizeof(float); i++)
        buf[i] = 1.0f;
    for (size_t bytes = lo; bytes <= hi; bytes *= 2) {
        size_t n = bytes / sizeof(float);
        /* About a second's worth of work per size, but at least a few ops. */
        int iters = (int)((size_t)(512u << 20) / bytes);
        if (iters > 200) iters = 200;
        if (iters < 5) iters = 5;
        for (int i = 0; i < 2; i++)
            err = comm_allreduce_sum_f32(c, buf, n);
        err = err != COMM_OK ? err : comm_barrier(c);
        double t0 = mono_now_s();
        for (int i = 0; i < iters && err == COMM_OK; i++)
            err = comm_allreduce_sum_f32(c, buf, n);
        err = err != COMM_OK ? err : comm_barrier(c);
        double dt = (mono_now_s() - t0) / iters;
        if (err != COMM_OK) {
            fprintf(stderr, "rank %d: %s\n", rank, comm_last_error(c));
            return 1;
        }
        double alg = (double)bytes / dt / 1e9;
        if (rank == 0)
            printf("%zu %.9f %.4f %.4f\n", bytes, dt, alg, alg * 2.0 * (world - 1) / world);
        fflush(stdout);
    }
    free(buf);
    comm_free(c);
    return 0;
}

int main(int argc, char **argv)
{
    int world = 0, shm = 0;
    size_t lo = 4096, hi = 64u << 20, chunk = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--memcpy") == 0) return memcpy_bench();
        if (strcmp(argv[i], "--shm") == 0) {
            shm = 1;
            continue;
        }
        if (i + 1 < argc && strcmp(argv[i], "--ranks") == 0)
            world = atoi(argv[++i]);
        else if (i + 1 < argc && strcmp(argv[i], "--min-bytes") == 0)
            lo = strtoull(argv[++i], NULL, 10);
        else if (i + 1 < argc && strcmp(argv[i], "--chunk-bytes") == 0)
            chunk = strtoull(argv[++i], NULL, 10);
        else if (i + 1 < argc && strcmp(argv[i], "--max-bytes") == 0)
            hi = strtoull(argv[++i], NULL, 10);
        else {
            fprintf(stderr,
                    "usage: bench_allreduce --ranks W [--shm] [--min-bytes B] [--max-bytes B]"
                    " [--chunk-bytes B]"
                    " | --memcpy\n");
            return 2;
        }
    }
    if (world < 2 || world > 64 || lo < 4 || hi < lo) {
        fprintf(stderr, "bench_allreduce: need --ranks 2..64 and 4 <= min <= max bytes\n");
        return 2;
    }
    int ends[64][2];  /* edge r: [0] rank r's right, [1] rank r+1's left */
    int pair[64][64]; /* shm: pair[i][j] is i's socket to j */
    int memfd = -1;
    for (int i = 0; i < world; i++)
        for (int j = 0; j < world; j++)
            pair[i][j] = -1;
    if (shm) {
        memfd = memfd_create("bench-allreduce", MFD_CLOEXEC);
        if (memfd < 0 || ftruncate(memfd, (off_t)comm_shm_bytes(world)) < 0) {
            perror("bench_allreduce: segment");
            return 1;
        }
        for (int i = 0; i < world; i++)
            for (int j = i + 1; j < world; j++) {
                int sv[2];
                if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) {
                    perror("bench_allreduce: socketpair");
                    return 1;
                }
                pair[i][j] = sv[0];
                pair[j][i] = sv[1];
            }
    } else {
        for (int r = 0; r < world; r++)
            if (tcp_pair(&ends[r][0], &ends[r][1]) < 0) {
                perror("bench_allreduce: loopback connection");
                return 1;
            }
    }
    fflush(stdout);
    pid_t pids[64];
    for (int r = 0; r < world; r++) {
        pids[r] = fork();
        if (pids[r] < 0) {
            perror("fork");
            return 1;
        }
        if (pids[r] == 0) {
            rank_link lk = {.left = -1, .right = -1, .memfd = memfd};
            if (!shm) {
                lk.left = ends[(r + world - 1) % world][1];
                lk.right = ends[r][0];
                for (int e = 0; e < world; e++)
                    for (int s = 0; s < 2; s++)
                        if (ends[e][s] != lk.left && ends[e][s] != lk.right) close(ends[e][s]);
            }
            for (int i = 0; i < world; i++)
                for (int j = 0; j < world; j++)
                    if (i != r && pair[i][j] >= 0) close(pair[i][j]);
            for (int j = 0; j < world; j++)
                lk.peer[j] = pair[r][j];
            _exit(run_rank(r, world, &lk, lo, hi, chunk));
        }
    }
    if (!shm)
        for (int e = 0; e < world; e++)
            for (int s = 0; s < 2; s++)
                close(ends[e][s]);
    for (int i = 0; i < world; i++)
        for (int j = 0; j < world; j++)
            if (pair[i][j] >= 0) close(pair[i][j]);
    if (memfd >= 0) close(memfd);
    return reap_ranks(pids, world, mono_now_s() + RANKS_DEADLINE_S) ? 1 : 0;
}
