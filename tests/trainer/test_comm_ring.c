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
#include "comm_ring.h"

const char *g_etcd; /* NULL: socketpairs */
int g_shm;          /* --shm or --hier */
int g_hosts;        /* --hier: 2 */

int group_open(tc_group *g, int world)
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
