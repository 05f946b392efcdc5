/* comm_ring_boot.c: test_comm_ring's cases of bootstrap, world size 1 and shared memory only.
 *
 * Stray connections at bootstrap (to the ring's listener and to the shared
 * memory's rendezvous socket) that the ranks must refuse, a fenced round,
 * a world of one and bad arguments in this process, and (--shm, --hier) a
 * rebuild with fewer ranks, a mixed round, a segment kept off /dev/shm.
 * See comm_ring.h.
 */
#include "comm_ring.h"

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

void test_stray(void)
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
void test_fenced(void)
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

void test_single(void)
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

void test_rebuild(void)
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

void test_mixed(void)
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

void test_shm_elsewhere(void)
{
    if (!g_hosts) return;
    tc_group g;
    if (group_open(&g, 3) != 0) return;
    g.shm_ranks = 1u << 1; /* rank 1 (host 1): --comm shm; ranks 0 and 2 (host 0): auto */
    g.timeout_ms = 60000;  /* a rank left waiting would come back with a timeout */
    CHECK(tc_run(&g, rank_shm_elsewhere, NULL, 120) == 0, "--comm shm across hosts refused");
    tc_group_free(&g);
}
