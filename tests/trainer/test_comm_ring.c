/* test_comm_ring.c: the CPU collectives, one real process per rank.
 *
 *   test_comm_ring [--pairs|--shm|--hier] [CASE...]
 *
 * By default every ring is bootstrapped through the round store of a real
 * etcd (DUCTILE_TEST_ETCD, or a private one started here) over 127.0.0.1;
 * --pairs builds the rings over socketpairs instead, to test the ring core
 * alone; --shm runs the same cases over shared memory (comm_cpu_init with
 * every rank on this host), plus its own: a rebuild in a new round with
 * fewer ranks, and a segment that never touches /dev/shm; --hier runs them
 * with rank r saying it is on host r % 2 (comm_config.host_id): shared
 * memory on each "host", the ring between them (two ranks: the ring). Inputs are small integers, so
 * float sums are exact and results are compared bit for bit. Failure cases kill (SIGKILL), stop
 * (SIGSTOP) or abort a rank and check what every other rank gets back, and how soon.
 */
#include "test_comm_launch.h"
#include "test_etcd.h"
#include "th_scenario.h"

#include "ductile/comm.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <stddef.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *g_etcd; /* NULL: socketpairs */
static int g_shm;          /* --shm or --hier */
static int g_hosts;        /* --hier: 2 */

/* A group for one case: a job of its own, round 1 current. A group that
 * cannot be made counts as a failed check. */
static int group_open(tc_group *g, int world)
{
    if (tc_group_open(g, world, g_etcd, "comm-test") == 0) {
        g->shm = g_shm;
        g->hosts = g_hosts;
        return 0;
    }
    check_fail();
    return -1;
}

/* ---- allreduce ---- */

static float input(int rank, size_t i)
{
    return (float)((int)((i * 7 + (size_t)rank * 13) % 61) - 30);
}

typedef struct sizes {
    const size_t *n;
    int count;
} sizes;

static int rank_allreduce(tc_group *g, int rank, void *arg)
{
    const sizes *sz = arg;
    comm *c = tc_connect_or_exit(g, rank);
    CHECK_OR_RETURN(comm_rank(c) == rank && comm_world_size(c) == g->world, "identity");
    int rc = 0;
    for (int k = 0; k < sz->count && rc == 0; k++) {
        size_t n = sz->n[k];
        float *buf = malloc(n * sizeof(float));
        CHECK_OR_RETURN(buf, "malloc");
        for (size_t i = 0; i < n; i++)
            buf[i] = input(rank, i);
        comm_err err = comm_allreduce_sum_f32(c, buf, n);
        if (err != COMM_OK) {
            fprintf(stderr, "FAIL rank %d: allreduce n=%zu: %s (%s)\n", rank, n, comm_strerror(err),
                    comm_last_error(c));
            rc = 1;
        }
        for (size_t i = 0; i < n && rc == 0; i++) {
            float want = 0;
            for (int r = 0; r < g->world; r++)
                want += input(r, i);
            if (buf[i] != want) {
                fprintf(stderr, "FAIL rank %d: allreduce n=%zu W=%d: [%zu] = %g, want %g\n", rank,
                        n, g->world, i, (double)buf[i], (double)want);
                rc = 1;
            }
        }
        free(buf);
    }
    comm_free(c);
    return rc;
}

static void test_allreduce(void)
{
    static const size_t small[] = {1, 2, 3, 7, 97, 1000, 65537, 1u << 20};
    static const size_t big[] = {1, 2, 3, 7, 97, 1000, 65537, 1u << 20, 10000019};
    for (int w = 2; w <= 8; w++) {
        /* The ~10M prime only at two world sizes: it is slow under ASan. */
        int with_big = w == 2 || w == 5;
        sizes sz = {with_big ? big : small, with_big ? 9 : 8};
        tc_group g;
        if (group_open(&g, w) != 0) continue;
        /* Odd world sizes also run with the smallest chunk: many chunks per
         * step, uneven last chunks. */
        if (w % 2) g.chunk_bytes = 4096;
        int bad = tc_run(&g, rank_allreduce, &sz, 240);
        CHECK(bad == 0, "allreduce W=%d: %d ranks failed", w, bad);
        tc_group_free(&g);
    }
}

/* ---- broadcast, allgather, barrier ---- */

static unsigned char pattern(size_t i, int who)
{
    return (unsigned char)(i * 131 + (size_t)who * 7 + 1);
}

static int rank_broadcast(tc_group *g, int rank, void *arg)
{
    (void)arg;
    static const size_t bytes[] = {1, 4099, (1u << 20) + 7};
    comm *c = tc_connect_or_exit(g, rank);
    for (int root = 0; root < g->world; root++)
        for (int k = 0; k < 3; k++) {
            size_t n = bytes[k];
            unsigned char *buf = malloc(n);
            CHECK_OR_RETURN(buf, "malloc");
            for (size_t i = 0; i < n; i++)
                buf[i] = rank == root ? pattern(i, root) : 0xee;
            comm_err err = comm_broadcast(c, buf, n, root);
            CHECK_OR_RETURN(err == COMM_OK, "broadcast root %d: %s", root, comm_last_error(c));
            for (size_t i = 0; i < n; i++)
                CHECK_OR_RETURN(buf[i] == pattern(i, root), "broadcast root %d bytes %zu: [%zu]",
                                root, n, i);
            free(buf);
        }
    comm_free(c);
    return 0;
}

static int rank_allgather(tc_group *g, int rank, void *arg)
{
    (void)arg;
    static const size_t bytes[] = {1, 13, 100003};
    comm *c = tc_connect_or_exit(g, rank);
    for (int k = 0; k < 3; k++) {
        size_t n = bytes[k];
        unsigned char *send = malloc(n), *recv = malloc(n * (size_t)g->world);
        CHECK_OR_RETURN(send && recv, "malloc");
        for (size_t i = 0; i < n; i++)
            send[i] = pattern(i, rank);
        memset(recv, 0xee, n * (size_t)g->world);
        comm_err err = comm_allgather(c, send, n, recv);
        CHECK_OR_RETURN(err == COMM_OK, "allgather: %s", comm_last_error(c));
        for (int r = 0; r < g->world; r++)
            for (size_t i = 0; i < n; i++)
                CHECK_OR_RETURN(recv[(size_t)r * n + i] == pattern(i, r),
                                "allgather bytes %zu: block %d [%zu]", n, r, i);
        /* In place: the rank's own block already sits in recv. */
        memset(recv, 0xee, n * (size_t)g->world);
        memcpy(recv + (size_t)rank * n, send, n);
        err = comm_allgather(c, recv + (size_t)rank * n, n, recv);
        CHECK_OR_RETURN(err == COMM_OK, "allgather in place: %s", comm_last_error(c));
        for (int r = 0; r < g->world; r++)
            for (size_t i = 0; i < n; i++)
                CHECK_OR_RETURN(recv[(size_t)r * n + i] == pattern(i, r),
                                "allgather in place bytes %zu: block %d [%zu]", n, r, i);
        free(send);
        free(recv);
    }
    comm_free(c);
    return 0;
}

static int rank_barrier(tc_group *g, int rank, void *arg)
{
    (void)arg;
    comm *c = tc_connect_or_exit(g, rank);
    for (int round = 1; round <= 3; round++) {
        /* Late arrivals: no rank may leave the barrier before the last came. */
        th_sleep_ms(((rank + round) % g->world) * 60);
        __atomic_add_fetch(&g->shared->arrived, 1, __ATOMIC_SEQ_CST);
        comm_err err = comm_barrier(c);
        CHECK_OR_RETURN(err == COMM_OK, "barrier: %s", comm_last_error(c));
        int seen = __atomic_load_n(&g->shared->arrived, __ATOMIC_SEQ_CST);
        CHECK_OR_RETURN(seen >= round * g->world, "left barrier %d with %d arrivals", round, seen);
        /* Keep the next round's arrivals from being counted early. */
        err = comm_barrier(c);
        CHECK_OR_RETURN(err == COMM_OK, "barrier: %s", comm_last_error(c));
    }
    comm_free(c);
    return 0;
}

static void test_small_collectives(void)
{
    for (int w = 2; w <= 5; w++) {
        tc_group g;
        if (group_open(&g, w) != 0) continue;
        if (w == 3) g.chunk_bytes = 4096;
        CHECK(tc_run(&g, rank_broadcast, NULL, 120) == 0, "broadcast W=%d", w);
        tc_group_free(&g);
        if (group_open(&g, w) != 0) continue;
        CHECK(tc_run(&g, rank_allgather, NULL, 120) == 0, "allgather W=%d", w);
        tc_group_free(&g);
    }
    tc_group g;
    if (group_open(&g, 4) == 0) {
        CHECK(tc_run(&g, rank_barrier, NULL, 120) == 0, "barrier W=4");
        tc_group_free(&g);
    }
}

/* ---- ranks that disagree ---- */

static int rank_mismatch(tc_group *g, int rank, void *arg)
{
    (void)arg;
    comm *c = tc_connect_or_exit(g, rank);
    float buf[11] = {0};
    int64_t t0 = mono_now_ms();
    comm_err err = comm_allreduce_sum_f32(c, buf, rank == 0 ? 10 : 11);
    CHECK_OR_RETURN(err == COMM_ERR_PEER, "mismatched sizes gave %s", comm_strerror(err));
    CHECK_OR_RETURN(mono_now_ms() - t0 < 5000, "mismatch took %lld ms",
                    (long long)(mono_now_ms() - t0));
    /* The first to see the other's header says why; its neighbour sees it go. */
    if (strstr(comm_last_error(c), "mismatch")) g->shared->progress[rank] = 1;
    /* Dead now: the next call fails at once, with the same error. */
    CHECK_OR_RETURN(comm_barrier(c) == COMM_ERR_PEER, "dead comm still works");
    comm_free(c);
    return 0;
}

static void test_mismatch(void)
{
    tc_group g;
    if (group_open(&g, 2) != 0) return;
    CHECK(tc_run(&g, rank_mismatch, NULL, 60) == 0, "mismatched allreduce");
    CHECK(g.shared->progress[0] + g.shared->progress[1] >= 1, "no rank named the mismatch");
    tc_group_free(&g);
}

/* ---- a rank killed or stopped mid-allreduce ---- */

typedef struct loop_arg {
    size_t n;
} loop_arg;

/* Allreduce until something fails; report what and when. */
static int rank_loop(tc_group *g, int rank, void *arg)
{
    const loop_arg *la = arg;
    comm *c = tc_connect_or_exit(g, rank);
    float *buf = malloc(la->n * sizeof(float));
    CHECK_OR_RETURN(buf, "malloc");
    for (size_t i = 0; i < la->n; i++)
        buf[i] = 1.0f;
    comm_err err;
    for (;;) {
        err = comm_allreduce_sum_f32(c, buf, la->n);
        if (err != COMM_OK) break;
        g->shared->progress[rank]++;
    }
    g->shared->t_err[rank] = mono_now_ms();
    g->shared->err[rank] = err;
    fprintf(stderr, "rank %d: %s\n", rank, comm_last_error(c));
    int64_t t0 = mono_now_ms();
    comm_err again = comm_allreduce_sum_f32(c, buf, la->n);
    CHECK_OR_RETURN(again == err, "a dead comm answered %s, first %s", comm_strerror(again),
                    comm_strerror(err));
    CHECK_OR_RETURN(mono_now_ms() - t0 < 100, "a dead comm took %lld ms",
                    (long long)(mono_now_ms() - t0));
    free(buf);
    comm_free(c);
    return 0;
}

/* Waits until every rank finished at least one allreduce. */
static int wait_progress(tc_group *g, int timeout_s)
{
    int64_t deadline = mono_now_ms() + (int64_t)timeout_s * 1000;
    for (;;) {
        int all = 1;
        for (int r = 0; r < g->world; r++)
            if (g->shared->progress[r] < 1) all = 0;
        if (all) return 0;
        if (mono_now_ms() > deadline) return -1;
        th_sleep_ms(5);
    }
}

static void test_kill(void)
{
    const int w = 4, victim = 2;
    tc_group g;
    if (group_open(&g, w) != 0) return;
    /* Default 30 s deadline: only the closed connection can explain a
     * prompt error. 32 MiB per rank keeps every rank mid-transfer. */
    loop_arg la = {8u << 20};
    if (tc_spawn(&g, rank_loop, &la) != 0) {
        check_fail();
        return;
    }
    CHECK(wait_progress(&g, 120) == 0, "ranks never finished an allreduce");
    th_sleep_ms(20);
    g.shared->t_event = mono_now_ms();
    kill(g.pids[victim], SIGKILL);
    int status[TC_MAX_RANKS] = {0};
    tc_wait(&g, 60, status);
    for (int r = 0; r < w; r++) {
        if (r == victim) {
            CHECK(WIFSIGNALED(status[r]) && WTERMSIG(status[r]) == SIGKILL, "victim status");
            continue;
        }
        CHECK(WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0, "rank %d status %d", r,
              status[r]);
        int err = g.shared->err[r];
        int64_t dt = g.shared->t_err[r] - g.shared->t_event;
        CHECK(err == COMM_ERR_PEER || err == COMM_ERR_TIMEOUT, "rank %d got %s", r,
              comm_strerror((comm_err)err));
        CHECK(dt < 5000, "rank %d noticed the kill after %lld ms", r, (long long)dt);
        fprintf(stderr, "kill: rank %d: %s after %lld ms\n", r, comm_strerror((comm_err)err),
                (long long)dt);
    }
    tc_group_free(&g);
}

static void test_stop(void)
{
    const int w = 3, victim = 1, timeout_ms = 2000;
    tc_group g;
    if (group_open(&g, w) != 0) return;
    g.timeout_ms = timeout_ms;
    loop_arg la = {1u << 20};
    if (tc_spawn(&g, rank_loop, &la) != 0) {
        check_fail();
        return;
    }
    CHECK(wait_progress(&g, 120) == 0, "ranks never finished an allreduce");
    g.shared->t_event = mono_now_ms();
    kill(g.pids[victim], SIGSTOP);
    /* Wait for the others to give up, then end the stopped one. */
    int64_t deadline = mono_now_ms() + 30000;
    for (;;) {
        int all = 1;
        for (int r = 0; r < w; r++)
            if (r != victim && g.shared->t_err[r] == 0) all = 0;
        if (all || mono_now_ms() > deadline) break;
        th_sleep_ms(10);
    }
    kill(g.pids[victim], SIGKILL);
    int status[TC_MAX_RANKS] = {0};
    tc_wait(&g, 60, status);
    int timeouts = 0;
    for (int r = 0; r < w; r++) {
        if (r == victim) continue;
        int err = g.shared->err[r];
        int64_t dt = g.shared->t_err[r] - g.shared->t_event;
        CHECK(g.shared->t_err[r] != 0, "rank %d never noticed the stopped peer", r);
        CHECK(err == COMM_ERR_PEER || err == COMM_ERR_TIMEOUT, "rank %d got %s", r,
              comm_strerror((comm_err)err));
        /* Not much later than the deadline, and never before the stop (the
         * deadline runs from the last byte that moved, which on a loaded
         * machine may be a little before the stop, so no tighter bound). */
        CHECK(dt < timeout_ms + 5000, "rank %d gave up after %lld ms", r, (long long)dt);
        if (err == COMM_ERR_TIMEOUT) {
            timeouts++;
            CHECK(dt >= 0, "rank %d timed out %lld ms before the peer stopped", r, (long long)-dt);
        }
        fprintf(stderr, "stop: rank %d: %s after %lld ms\n", r, comm_strerror((comm_err)err),
                (long long)dt);
    }
    CHECK(timeouts >= 1, "nobody reported a timeout");
    tc_group_free(&g);
}

/* ---- abort from another thread ---- */

typedef struct abort_arg {
    comm *c;
    int delay_ms;
} abort_arg;

static void *abort_later(void *p)
{
    abort_arg *a = p;
    th_sleep_ms(a->delay_ms);
    comm_abort(a->c);
    return NULL;
}

static int rank_abort(tc_group *g, int rank, void *arg)
{
    (void)arg;
    comm *c = tc_connect_or_exit(g, rank);
    float buf[1000] = {0};
    if (rank == 0) {
        /* Rank 1 joins late: rank 0 is stuck in the allreduce when aborted. */
        abort_arg a = {c, 300};
        pthread_t th;
        CHECK_OR_RETURN(pthread_create(&th, NULL, abort_later, &a) == 0, "pthread_create");
        int64_t t0 = mono_now_ms();
        comm_err err = comm_allreduce_sum_f32(c, buf, 1000);
        int64_t dt = mono_now_ms() - t0;
        pthread_join(th, NULL);
        CHECK_OR_RETURN(err == COMM_ERR_ABORTED, "got %s", comm_strerror(err));
        CHECK_OR_RETURN(dt >= 250 && dt < 5000, "aborted after %lld ms", (long long)dt);
        CHECK_OR_RETURN(comm_barrier(c) == COMM_ERR_ABORTED, "later call after abort");
    } else {
        th_sleep_ms(1500);
        /* The aborted rank dropped the group: the late one learns at once. */
        int64_t t0 = mono_now_ms();
        comm_err err = comm_allreduce_sum_f32(c, buf, 1000);
        CHECK_OR_RETURN(err == COMM_ERR_PEER, "late rank got %s", comm_strerror(err));
        CHECK_OR_RETURN(mono_now_ms() - t0 < 5000, "late rank took %lld ms",
                        (long long)(mono_now_ms() - t0));
    }
    comm_free(c);
    return 0;
}

static void test_abort(void)
{
    tc_group g;
    if (group_open(&g, 2) != 0) return;
    CHECK(tc_run(&g, rank_abort, NULL, 60) == 0, "abort");
    tc_group_free(&g);
}

/* ---- stray connections at bootstrap (store only) ---- */

/* The value of key in g's round store once it is there (malloc'd), or NULL. */
static char *store_value(tc_group *g, const char *key)
{
    rdzv_etcd e = {0};
    e.endpoints = g->etcd;
    rdzv_store *s = NULL;
    if (rdzv_store_open(&e, g->job, g->round, &s) != RDZV_OK) return NULL;
    void *val = NULL;
    size_t vlen = 0;
    rdzv_err re = rdzv_store_wait(s, key, 10000, &val, &vlen);
    rdzv_store_close(s);
    return re == RDZV_OK ? val : NULL;
}

/* Connects a stream socket to sa and sends `len` bytes: the fd, or -1. */
static int connect_send(const void *sa, socklen_t sl, const void *bytes, size_t len)
{
    int fd = socket(((const struct sockaddr *)sa)->sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, sa, sl) < 0 || send(fd, bytes, len, MSG_NOSIGNAL) != (ssize_t)len) {
        if (fd >= 0) close(fd);
        return -1;
    }
    return fd;
}

/* Connects to the address rank 1 published and sends `len` bytes. */
static int stray_connect(tc_group *g, const void *bytes, size_t len)
{
    char *val = store_value(g, "ring/1");
    if (!val) return -1;
    char *colon = strrchr(val, ':');
    int port = colon ? atoi(colon + 1) : 0;
    free(val);
    struct sockaddr_in sa = {0};
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return connect_send(&sa, sizeof(sa), bytes, len);
}

static int rank_stray(tc_group *g, int rank, void *arg)
{
    (void)arg;
    int strays[2] = {-1, -1};
    if (rank == 0) {
        /* Rank 0's own hello but with a wrong nonce (a connection from
         * another round), then plain garbage: rank 1 must refuse both and
         * still take the real one that follows. Layout: magic "DUCTRING",
         * rank, world, nonce. */
        struct {
            uint64_t magic;
            uint32_t rank, world;
            uint64_t nonce;
        } hello = {0x474e495254435544ull, 0, 2, 0x1234};
        strays[0] = stray_connect(g, &hello, sizeof(hello));
        static const char junk[24] = "GET / HTTP/1.0\r\n\r\n";
        strays[1] = stray_connect(g, junk, sizeof(junk));
        CHECK_OR_RETURN(strays[0] >= 0 && strays[1] >= 0, "stray connections");
    }
    comm *c = tc_connect_or_exit(g, rank);
    float buf[5] = {1, 2, 3, 4, 5};
    comm_err err = comm_allreduce_sum_f32(c, buf, 5);
    CHECK_OR_RETURN(err == COMM_OK, "allreduce after strays: %s", comm_last_error(c));
    CHECK_OR_RETURN(buf[0] == 2 && buf[4] == 10, "allreduce after strays: wrong sum");
    comm_free(c);
    for (int i = 0; i < 2; i++)
        if (strays[i] >= 0) close(strays[i]);
    return 0;
}

/* Shared memory: connects to the socket rank 0 published for the segment
 * and sends `len` bytes; the fd, or -1 once rank 0 no longer listens. */
static int shm_stray_connect(tc_group *g, const void *bytes, size_t len)
{
    char *val = store_value(g, "shm/0");
    if (!val) return -1;
    struct sockaddr_un sa = {0};
    sa.sun_family = AF_UNIX;
    size_t n = strcspn(val, " ");
    if (n >= sizeof(sa.sun_path) - 1) n = 0;
    memcpy(sa.sun_path + 1, val, n); /* abstract */
    free(val);
    return connect_send(&sa, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n), bytes,
                        len);
}

/* Ranks 0 and 1 of three; rank 2 only says where it is, and never comes,
 * so rank 0 is still taking connections when the strays arrive. */
static int rank_stray_shm(tc_group *g, int rank, void *arg)
{
    (void)arg;
    if (rank == 2) {
        rdzv_etcd e = {0};
        e.endpoints = g->etcd;
        rdzv_store *s = NULL;
        CHECK_OR_RETURN(rdzv_store_open(&e, g->job, g->round, &s) == RDZV_OK, "store");
        rdzv_err re = rdzv_store_set(s, "host/2", "cpu - test-host-0", strlen("cpu - test-host-0"));
        rdzv_store_close(s);
        CHECK_OR_RETURN(re == RDZV_OK, "host/2");
        return 0;
    }
    comm *c = NULL;
    comm_err err = tc_connect(g, rank, &c);
    /* Rank 0 waits out its deadline; rank 1 sees it give up, or waits too. */
    CHECK_OR_RETURN(!c && (err == COMM_ERR_TIMEOUT || (rank == 1 && err == COMM_ERR_PEER)),
                    "rank %d without rank 2: %s", rank, comm_strerror(err));
    return 0;
}

/* Strays at rank 0's segment socket (a hello with the wrong nonce, then
 * garbage) are closed without the segment. */
static void test_stray_shm(void)
{
    tc_group g;
    if (group_open(&g, 3) != 0) return;
    g.timeout_ms = 3000;
    g.hosts = 1; /* "test-host-0", which rank 2 names too */
    if (tc_spawn(&g, rank_stray_shm, NULL) != 0) {
        check_fail();
        return;
    }
    struct {
        uint64_t magic;
        uint32_t rank, world;
        uint64_t nonce;
    } hello = {0x4f4c4c45484d4853ull, 2, 3, 0x1234}; /* "SHMHELLO" */
    static const char junk[24] = "GET / HTTP/1.0\r\n\r\n";
    int strays[2] = {shm_stray_connect(&g, &hello, sizeof(hello)),
                     shm_stray_connect(&g, junk, sizeof(junk))};
    for (int i = 0; i < 2; i++) {
        CHECK(strays[i] >= 0, "stray %d could not connect", i);
        if (strays[i] < 0) continue;
        struct pollfd pfd = {strays[i], POLLIN, 0};
        CHECK(poll(&pfd, 1, 5000) == 1, "stray %d: rank 0 neither answered nor closed", i);
        char b[64], ctl[256];
        struct iovec iov = {b, sizeof(b)};
        struct msghdr m = {
            .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl, .msg_controllen = sizeof(ctl)};
        ssize_t k = recvmsg(strays[i], &m, MSG_DONTWAIT);
        CHECK(k <= 0 && m.msg_controllen == 0, "stray %d got %zd bytes, %zu of descriptors", i, k,
              (size_t)m.msg_controllen);
        close(strays[i]);
    }
    CHECK(tc_wait(&g, 60, NULL) == 0, "ranks without rank 2");
    tc_group_free(&g);
}

static void test_stray(void)
{
    if (g_etcd && g_shm && !g_hosts) test_stray_shm();
    if (!g_etcd || g_shm) return; /* the ring's TCP listener */
    tc_group g;
    if (group_open(&g, 2) != 0) return;
    g.timeout_ms = 5000;
    CHECK(tc_run(&g, rank_stray, NULL, 60) == 0, "stray connections at bootstrap");
    tc_group_free(&g);
}

/* A round that is no longer current: publishing the ring address is fenced. */
static void test_fenced(void)
{
    if (!g_etcd) return;
    tc_group g;
    if (group_open(&g, 2) != 0) return;
    CHECK(tc_make_round_current(g_etcd, g.job, 2) == 0, "epoch 2");
    comm *c = NULL;
    comm_err err = tc_connect(&g, 0, &c);
    CHECK(err == COMM_ERR_STORE && c == NULL, "bootstrap in a fenced round gave %s",
          comm_strerror(err));
    if (c) comm_free(c);
    tc_group_free(&g);
}

/* ---- world size 1 and bad arguments (in this process) ---- */

static void test_single(void)
{
    comm_config cfg = {0};
    cfg.rank = 0;
    cfg.world_size = 1;
    comm *c = NULL;
    CHECK(comm_ring_init(&cfg, &c) == COMM_OK, "world of one");
    if (!c) return;
    float f[3] = {1, 2, 3};
    CHECK(comm_allreduce_sum_f32(c, f, 3) == COMM_OK && f[0] == 1 && f[2] == 3, "allreduce");
    char b[4] = "abc", out[4] = "";
    CHECK(comm_allgather(c, b, 4, out) == COMM_OK && strcmp(out, "abc") == 0, "allgather");
    CHECK(comm_broadcast(c, b, 4, 0) == COMM_OK, "broadcast");
    CHECK(comm_broadcast(c, b, 4, 1) == COMM_ERR_ARG, "broadcast from a missing root");
    CHECK(comm_barrier(c) == COMM_OK, "barrier");
    CHECK(comm_allreduce_sum_f32(c, NULL, 3) == COMM_ERR_ARG, "NULL buffer");
    CHECK(comm_last_error(c)[0] == '\0', "no error yet: %s", comm_last_error(c));
    comm_abort(c);
    CHECK(comm_barrier(c) == COMM_ERR_ABORTED, "aborted");
    CHECK(comm_allreduce_sum_f32(c, f, 3) == COMM_ERR_ABORTED, "stays aborted");
    CHECK(strstr(comm_last_error(c), "abort") != NULL, "message: %s", comm_last_error(c));
    comm_free(c);

    cfg.world_size = 2;
    CHECK(comm_ring_init(&cfg, &c) == COMM_ERR_ARG && c == NULL, "no store");
    cfg.rank = 2;
    CHECK(comm_ring_init(&cfg, &c) == COMM_ERR_ARG, "rank past the world");
    CHECK(comm_ring_init(NULL, &c) == COMM_ERR_ARG, "no config");
    CHECK(comm_nccl_init(&cfg, &c) != COMM_OK && c == NULL, "nccl without a usable config");
    if (c) comm_free(c);
    for (int e = COMM_OK; e <= COMM_ERR_NCCL; e++)
        CHECK(strlen(comm_strerror((comm_err)e)) > 0, "strerror %d", e);
}

/* ---- shared memory only ---- */

/* 1 when a line of this process's memory map holds `what`. */
static int maps(const char *what)
{
    char line[512];
    FILE *f = fopen("/proc/self/maps", "re");
    if (!f) return -1;
    int found = 0;
    while (fgets(line, sizeof(line), f))
        if (strstr(line, what)) found = 1;
    fclose(f);
    return found;
}

static int rank_rebuild(tc_group *g, int rank, void *arg)
{
    (void)arg;
    comm *c = tc_connect_or_exit(g, rank);
    CHECK_OR_RETURN(maps("/memfd:ductile-shm") == 1, "rank %d: no memfd segment mapped", rank);
    CHECK_OR_RETURN(maps(" /dev/shm/") == 0, "rank %d: something under /dev/shm is mapped", rank);
    float buf[3] = {1, 2, 3};
    CHECK_OR_RETURN(comm_allreduce_sum_f32(c, buf, 3) == COMM_OK && buf[2] == 3.0f * 3,
                    "round 1 allreduce: %s", comm_last_error(c));
    /* Round 2 without rank 2: made current before anyone leaves round 1. */
    if (rank == 0) CHECK_OR_RETURN(tc_make_round_current(g->etcd, g->job, 2) == 0, "round 2");
    CHECK_OR_RETURN(comm_barrier(c) == COMM_OK, "barrier: %s", comm_last_error(c));
    comm_free(c);
    if (rank == 2) return 0;
    g->round = 2;
    g->world = 2;
    c = tc_connect_or_exit(g, rank);
    CHECK_OR_RETURN(comm_world_size(c) == 2, "round 2 world");
    buf[0] = (float)rank;
    CHECK_OR_RETURN(comm_allreduce_sum_f32(c, buf, 1) == COMM_OK && buf[0] == 1.0f,
                    "round 2 allreduce: %s (%g)", comm_last_error(c), (double)buf[0]);
    CHECK_OR_RETURN(maps(" /dev/shm/") == 0, "rank %d: something under /dev/shm is mapped", rank);
    comm_free(c);
    return 0;
}

static void test_rebuild(void)
{
    if (!g_shm || g_hosts) return;
    tc_group g;
    if (group_open(&g, 3) != 0) return;
    CHECK(tc_run(&g, rank_rebuild, NULL, 60) == 0, "rebuild in a new round");
    tc_group_free(&g);
}

/* Ranks given different --comm agree: rank 0 forced to the ring, the
 * others on auto. Rank 0 publishes a host of its own, so the round is
 * hierarchical (ranks 1 and 2 share a segment, rank 0 alone on the ring)
 * and nobody waits for a bootstrap that never comes. */
static int rank_mixed(tc_group *g, int rank, void *arg)
{
    (void)arg;
    comm *c = tc_connect_or_exit(g, rank);
    const char *want = g->world == 2 ? "ring" : "hier";
    CHECK_OR_RETURN(strcmp(comm_backend(c), want) == 0, "rank %d: over %s, not %s", rank,
                    comm_backend(c), want);
    float buf[5];
    for (int i = 0; i < 5; i++)
        buf[i] = (float)(rank + i);
    comm_err err = comm_allreduce_sum_f32(c, buf, 5);
    comm_free(c);
    CHECK_OR_RETURN(err == COMM_OK, "rank %d: allreduce: %s", rank, comm_strerror(err));
    for (int i = 0; i < 5; i++) {
        float s = 0;
        for (int r = 0; r < g->world; r++)
            s += (float)(r + i);
        CHECK_OR_RETURN(buf[i] == s, "rank %d: element %d is %g, not %g", rank, i, (double)buf[i],
                        (double)s);
    }
    return 0;
}

static void test_mixed(void)
{
    if (!g_shm || g_hosts) return;
    for (int w = 2; w <= 3; w++) {
        tc_group g;
        if (group_open(&g, w) != 0) return;
        g.hosts = 0;
        g.ring_ranks = 1u; /* rank 0: --comm ring; the rest: --comm auto */
        CHECK(tc_run(&g, rank_mixed, NULL, 60) == 0, "world %d, rank 0 on the ring", w);
        tc_group_free(&g);
    }
}

/* A rank given --comm shm in a round whose ranks are on two hosts: rank
 * 0's decision refuses the round, so every rank fails with the same line
 * (COMM_ERR_ARG), none waits for it until the timeout (COMM_ERR_TIMEOUT). */
static int rank_shm_elsewhere(tc_group *g, int rank, void *arg)
{
    (void)arg;
    comm *c = NULL;
    comm_err err = tc_connect(g, rank, &c);
    if (c) comm_free(c);
    CHECK_OR_RETURN(err == COMM_ERR_ARG, "rank %d: %s, not a refusal (%s)", rank,
                    comm_strerror(err), g->msg);
    CHECK_OR_RETURN(strstr(g->msg, "--comm shm (rank 1, node -) needs every rank on one host") &&
                        strstr(g->msg, "2 hosts"),
                    "rank %d: message: %s", rank, g->msg);
    return 0;
}

static void test_shm_elsewhere(void)
{
    if (!g_hosts) return;
    tc_group g;
    if (group_open(&g, 3) != 0) return;
    g.shm_ranks = 1u << 1; /* rank 1 (host 1): --comm shm; ranks 0 and 2 (host 0): auto */
    g.timeout_ms = 60000;  /* a rank left waiting would come back with a timeout */
    CHECK(tc_run(&g, rank_shm_elsewhere, NULL, 120) == 0, "--comm shm across hosts refused");
    tc_group_free(&g);
}

int main(int argc, char **argv)
{
    int first = 1, pairs = 0;
    if (first < argc && strcmp(argv[first], "--pairs") == 0) {
        pairs = 1;
        first++;
    } else if (first < argc && strcmp(argv[first], "--shm") == 0) {
        g_shm = 1;
        first++;
    } else if (first < argc && strcmp(argv[first], "--hier") == 0) {
        g_shm = 1;
        g_hosts = 2;
        first++;
    }
    /* SIGPIPE stays at its default (fatal): the ring must never raise it. */
    signal(SIGPIPE, SIG_DFL);
    test_etcd etcd = {0};
    if (!pairs && !(g_etcd = test_etcd_shared_or_start(&etcd))) return 1;
    static const th_case cases[] = {
        {"single", test_single},
        {"allreduce", test_allreduce},
        {"small", test_small_collectives},
        {"mismatch", test_mismatch},
        {"abort", test_abort},
        {"kill", test_kill},
        {"stop", test_stop},
        {"stray", test_stray},
        {"fenced", test_fenced},
        {"rebuild", test_rebuild},
        {"mixed", test_mixed},
        {"shm_elsewhere", test_shm_elsewhere},
    };
    th_run_cases(cases, TH_COUNT(cases), argc, argv, first,
                 pairs     ? "socketpairs"
                 : g_hosts ? "hier"
                 : g_shm   ? "shm"
                           : "store");
    test_etcd_stop(&etcd);
    return check_finish("test_comm_ring");
}
