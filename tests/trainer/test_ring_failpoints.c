/* test_ring_failpoints.c: the ring's failpoints give the errors real faults do.
 *
 *   test_ring_failpoints [CASE...]
 *
 * One real process per rank, as in test_comm_ring. ring.connect=N:fail
 * (DUCTILE_FAILPOINTS, ductile/failpoint.h) makes a rank's Nth bootstrap
 * fail as if its left neighbour never showed up: COMM_ERR_TIMEOUT there,
 * and its peers, which never see its address or its connection, fail too;
 * the next bootstrap is unaffected. ring.collective=N:closed makes a
 * rank's Nth collective fail as a closed connection does: COMM_ERR_PEER on
 * that rank, its comm dead, and COMM_ERR_PEER on the others well before
 * their (long) deadline would give a timeout, because its sockets are shut.
 * Bootstraps go through the round store of a real etcd (DUCTILE_TEST_ETCD,
 * or a private one started here); collectives also run over socketpairs.
 *
 * Failpoints are read once per process, at the first call: only the rank
 * processes set them, and this parent never runs a ring of its own.
 */
#include "test_comm_launch.h"
#include "th_scenario.h"
#include "test_etcd.h"
#include "trainer_test.h"

#include "ductile/comm.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *g_etcd;
/* A group for one case: a job of its own, round 1 current. A group that
 * cannot be made counts as a failed check. */
static int group_open(tc_group *g, int world, const char *etcd)
{
    if (tc_group_open(g, world, etcd, "fp-test") == 0) return 0;
    check_fail();
    return -1;
}

/* ---- ring.connect ---- */

#define FP_RANK 1

typedef struct connect_arg {
    tc_group *again; /* a second group (another job) every rank joins after */
} connect_arg;

static int rank_connect(tc_group *g, int rank, void *arg)
{
    const connect_arg *a = arg;
    if (rank == FP_RANK) setenv("DUCTILE_FAILPOINTS", "ring.connect=1:fail", 1);
    comm *c = NULL;
    comm_err err = tc_connect(g, rank, &c);
    g->shared->err[rank] = err;
    int rc = 0;
    if (c) {
        fprintf(stderr, "FAIL rank %d: the first bootstrap succeeded\n", rank);
        comm_free(c);
        rc = 1;
    }
    /* Only the first call fails: the next bootstrap forms a ring. */
    err = tc_connect(a->again, rank, &c);
    if (err != COMM_OK) {
        fprintf(stderr, "FAIL rank %d: second bootstrap: %s\n", rank, comm_strerror(err));
        return 1;
    }
    float x = 1;
    if (comm_allreduce_sum_f32(c, &x, 1) != COMM_OK || x != (float)g->world) {
        fprintf(stderr, "FAIL rank %d: allreduce on the second ring: %s\n", rank,
                comm_last_error(c));
        rc = 1;
    }
    comm_free(c);
    return rc;
}

static void test_connect(void)
{
    const int w = 3;
    tc_group g, again;
    if (group_open(&g, w, g_etcd) != 0 || group_open(&again, w, g_etcd) != 0) return;
    g.timeout_ms = 3000; /* how long the others wait for the rank that never comes */
    connect_arg a = {&again};
    int bad = tc_run(&g, rank_connect, &a, 120);
    CHECK(bad == 0, "%d ranks failed", bad);
    /* The others wait for it and time out; one that reached a neighbour
     * which had already given up may find its port closed instead. */
    for (int r = 0; r < w; r++) {
        int e = g.shared->err[r];
        CHECK(e == COMM_ERR_TIMEOUT || (r != FP_RANK && e == COMM_ERR_PEER),
              "rank %d's first bootstrap gave %s", r, comm_strerror((comm_err)e));
    }
    tc_group_free(&g);
    tc_group_free(&again);
}

/* ---- ring.collective ---- */

#define LATE_MS 60000 /* a deadline no closed connection should wait out */

static int rank_collective(tc_group *g, int rank, void *arg)
{
    (void)arg;
    if (rank == FP_RANK) setenv("DUCTILE_FAILPOINTS", "ring.collective=3:closed", 1);
    comm *c = tc_connect_or_exit(g, rank);
    comm_err err;
    enum { N = 1 << 16 };
    static float buf[N];
    for (;;) {
        for (size_t i = 0; i < N; i++)
            buf[i] = 1.0f;
        err = comm_allreduce_sum_f32(c, buf, N);
        if (err != COMM_OK) break;
        g->shared->progress[rank]++;
    }
    g->shared->err[rank] = err;
    g->shared->t_err[rank] = mono_now_ms();
    fprintf(stderr, "rank %d: %s\n", rank, comm_last_error(c));
    int rc = 0;
    if (comm_barrier(c) != err) {
        fprintf(stderr, "FAIL rank %d: the comm is not dead after %s\n", rank, comm_strerror(err));
        rc = 1;
    }
    if (rank == FP_RANK && !strstr(comm_last_error(c), "failpoint ring.collective")) {
        fprintf(stderr, "FAIL rank %d: the error does not name the failpoint\n", rank);
        rc = 1;
    }
    comm_free(c);
    return rc;
}

static void test_collective(const char *etcd)
{
    const int w = 3;
    tc_group g;
    if (group_open(&g, w, etcd) != 0) return;
    g.timeout_ms = LATE_MS;
    int64_t t0 = mono_now_ms();
    int bad = tc_run(&g, rank_collective, NULL, 120);
    CHECK(bad == 0, "%d ranks failed", bad);
    for (int r = 0; r < w; r++) {
        CHECK(g.shared->err[r] == COMM_ERR_PEER, "rank %d got %s", r,
              comm_strerror((comm_err)g.shared->err[r]));
        /* Two allreduces done everywhere, the third failed everywhere. */
        CHECK(g.shared->progress[r] == 2, "rank %d finished %d allreduces", r,
              g.shared->progress[r]);
        /* Not a speed: only a closed connection, never the deadline, explains this. */
        CHECK(g.shared->t_err[r] - t0 < LATE_MS, "rank %d waited out its deadline", r);
    }
    tc_group_free(&g);
}

static void test_collective_pairs(void)
{
    test_collective(NULL);
}

static void test_collective_store(void)
{
    test_collective(g_etcd);
}

int main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_DFL); /* the ring must never raise it */
    unsetenv("DUCTILE_FAILPOINTS");
    test_etcd etcd;
    if (!(g_etcd = test_etcd_shared_or_start(&etcd))) return 1;
    static const th_case cases[] = {
        {"connect", test_connect},
        {"collective_pairs", test_collective_pairs},
        {"collective_store", test_collective_store},
    };
    th_run_cases(cases, TH_COUNT(cases), argc, argv, 1, NULL);
    test_etcd_stop(&etcd);
    return check_finish("test_ring_failpoints");
}
