/* test_comm_launch.c: one process per rank for the collectives tests (see
 * test_comm_launch.h). Every child closes every socket end that is not its
 * own, so killing a rank really closes its connections. */
#include "test_comm_launch.h"

#include "comm_impl.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

int tc_group_init(tc_group *g, int world, const char *etcd, const char *job, int64_t round)
{
    memset(g, 0, sizeof(*g));
    if (world < 1 || world > TC_MAX_RANKS) return -1;
    g->world = world;
    g->etcd = etcd;
    snprintf(g->job, sizeof(g->job), "%s", job ? job : "comm-test");
    g->round = round;
    g->timeout_ms = 30000;
    for (int r = 0; r < TC_MAX_RANKS; r++)
        g->pairs[r][0] = g->pairs[r][1] = -1;
    void *m =
        mmap(NULL, sizeof(tc_shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return -1;
    g->shared = m;
    memset(m, 0, sizeof(tc_shared));
    return 0;
}

int tc_group_open(tc_group *g, int world, const char *etcd, const char *prefix)
{
    static int groups; /* this process's groups so far: one job each */
    char job[64];
    snprintf(job, sizeof(job), "%s-%d-%d", prefix, (int)getpid(), ++groups);
    if (tc_group_init(g, world, etcd, job, 1) != 0) return -1;
    if (etcd && tc_make_round_current(etcd, job, 1) != 0) {
        fprintf(stderr, "cannot make round 1 of %s current\n", job);
        tc_group_free(g);
        return -1;
    }
    return 0;
}

static void close_pairs(tc_group *g, int keep_left, int keep_right)
{
    for (int e = 0; e < TC_MAX_RANKS; e++)
        for (int s = 0; s < 2; s++) {
            int fd = g->pairs[e][s];
            if (fd >= 0 && fd != keep_left && fd != keep_right) close(fd);
            g->pairs[e][s] = -1;
        }
}

/* In child r: keep only its own two ends, where tc_connect finds them. */
static void close_pairs_except(tc_group *g, int r)
{
    int w = g->world;
    int left = g->pairs[(r + w - 1) % w][1], right = g->pairs[r][0];
    close_pairs(g, left, right);
    g->pairs[(r + w - 1) % w][1] = left;
    g->pairs[r][0] = right;
}

void tc_group_free(tc_group *g)
{
    close_pairs(g, -1, -1);
    if (g->shared) munmap(g->shared, sizeof(tc_shared));
    g->shared = NULL;
}

comm_err tc_connect(tc_group *g, int rank, comm **out)
{
    comm_config cfg = {0};
    cfg.rank = rank;
    cfg.world_size = g->world;
    cfg.timeout_ms = g->timeout_ms;
    cfg.chunk_bytes = g->chunk_bytes;
    cfg.host = "127.0.0.1";
    cfg.device = rank; /* NCCL: a GPU each, as on a real node (two ranks on one are refused) */
    if (!g->etcd) {
        int w = g->world;
        int left = w > 1 ? g->pairs[(rank + w - 1) % w][1] : -1;
        int right = w > 1 ? g->pairs[rank][0] : -1;
        g->pairs[(rank + w - 1) % w][1] = -1;
        g->pairs[rank][0] = -1;
        return comm_ring_from_fds(&cfg, left, right, out);
    }
    rdzv_etcd e = {0};
    e.endpoints = g->etcd;
    rdzv_store *s = NULL;
    rdzv_err re = rdzv_store_open(&e, g->job, g->round, &s);
    if (re != RDZV_OK) {
        fprintf(stderr, "rank %d: store open: %s\n", rank, rdzv_strerror(re));
        return COMM_ERR_STORE;
    }
    cfg.store = s;
    cfg.transport = !g->shm    ? COMM_TRANSPORT_RING
                    : g->hosts ? COMM_TRANSPORT_AUTO
                               : COMM_TRANSPORT_SHM;
    if (g->shm && g->ring_ranks) /* the one rank forced to the ring, the others on auto */
        cfg.transport = rank < 32 && (g->ring_ranks >> rank & 1u) ? COMM_TRANSPORT_RING
                                                                   : COMM_TRANSPORT_AUTO;
    if (g->shm && g->shm_ranks) /* the ranks forced to shared memory, the others on auto */
        cfg.transport = rank < 32 && (g->shm_ranks >> rank & 1u) ? COMM_TRANSPORT_SHM
                                                                  : COMM_TRANSPORT_AUTO;
    g->msg[0] = '\0';
    cfg.msg = g->msg;
    char host_id[32];
    if (g->hosts > 0) {
        snprintf(host_id, sizeof(host_id), "test-host-%d", rank % g->hosts);
        cfg.host_id = host_id;
    }
    comm_err err = g->nccl  ? comm_nccl_init(&cfg, out)
                   : g->shm ? comm_cpu_init(&cfg, out)
                            : comm_ring_init(&cfg, out);
    rdzv_store_close(s);
    return err;
}

comm *tc_connect_or_exit(tc_group *g, int rank)
{
    comm *c = NULL;
    comm_err err = tc_connect(g, rank, &c);
    if (err != COMM_OK) {
        fprintf(stderr, "rank %d: connect: %s\n", rank, comm_strerror(err));
        _exit(2);
    }
    return c;
}

int tc_spawn(tc_group *g, tc_rank_fn fn, void *arg)
{
    int w = g->world;
    if (!g->etcd && w > 1)
        for (int r = 0; r < w; r++)
            if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, g->pairs[r]) < 0) return -1;
    fflush(NULL);
    for (int r = 0; r < w; r++) {
        pid_t pid = fork();
        if (pid < 0) return -1;
        if (pid == 0) {
            if (!g->etcd && w > 1) close_pairs_except(g, r);
            int rc = fn(g, r, arg);
            fflush(NULL);
            _exit(rc);
        }
        g->pids[r] = pid;
    }
    close_pairs(g, -1, -1);
    return 0;
}

int tc_wait(tc_group *g, int timeout_s, int *status)
{
    int st[TC_MAX_RANKS] = {0}, late[TC_MAX_RANKS];
    int bad = th_wait_all(g->pids, g->world, timeout_s * 1000, st, late);
    for (int r = 0; r < g->world; r++) {
        if (late[r]) fprintf(stderr, "rank %d did not finish in %d s: killed\n", r, timeout_s);
        if (WIFEXITED(st[r]) && WEXITSTATUS(st[r]) != 0) /* its checks said why */
            fprintf(stderr, "rank %d exited with %d\n", r, WEXITSTATUS(st[r]));
        if (status && g->pids[r] == 0) status[r] = st[r];
    }
    return bad;
}

int tc_run(tc_group *g, tc_rank_fn fn, void *arg, int timeout_s)
{
    if (tc_spawn(g, fn, arg) != 0) {
        fprintf(stderr, "spawn failed\n");
        return g->world;
    }
    return tc_wait(g, timeout_s, NULL);
}

int tc_make_round_current(const char *etcd, const char *job, int64_t round)
{
    char cmd[512];
    snprintf(cmd, sizeof(cmd),
             "ETCDCTL_API=3 etcdctl --endpoints=%s put /ductile/%s/epoch %lld >/dev/null", etcd,
             job, (long long)round);
    return system(cmd) == 0 ? 0 : -1;
}
