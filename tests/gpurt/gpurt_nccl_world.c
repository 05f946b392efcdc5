/* gpurt_nccl_world.c: test_gpurt_nccl's world of child processes and the ranks' helpers (see
 * gpurt_nccl_world.h).
 *
 * The parent's side: pipes, fork, a child per rank (alarm its deadline),
 * notes read back and go said, stderr captured, the exits judged. The
 * child's side: note, wait for go, device buffers, a comm brought up, and
 * waits with deadlines for a comm's state or a stream's drain.
 */
#include "gpurt_nccl_world.h"

static void close_fd(int *fd)
{
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

void nap(void)
{
    struct timespec ts = {0, NAP_NS};
    nanosleep(&ts, NULL);
}

/* Reads exactly n bytes within ms; 0 or -1. */
int read_within(int fd, void *buf, size_t n, int ms)
{
    char *p = buf;
    int64_t end = mono_now_ms() + ms;
    while (n > 0) {
        int left = (int)(end - mono_now_ms());
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        int r = left > 0 ? poll(&pf, 1, left) : 0;
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        ssize_t k = read(fd, p, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

int write_all(int fd, const void *buf, size_t n)
{
    const char *p = buf;
    while (n > 0) {
        ssize_t k = write(fd, p, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

/* In a child: keeps only its own pipe ends (rank 0 also every id pipe's
 * writing end). */
static void child_close(world_pipes *p, int n, int r)
{
    for (int k = 1; k < n; k++) {
        if (r != 0) close_fd(&p->id[k][1]);
        if (k != r) close_fd(&p->id[k][0]);
    }
    for (int k = 0; k < n; k++) {
        if (k == r) continue;
        close_fd(&p->note[k][0]);
        close_fd(&p->note[k][1]);
        close_fd(&p->go[k][0]);
        close_fd(&p->go[k][1]);
        close_fd(&p->err[k][0]);
        close_fd(&p->err[k][1]);
    }
    close_fd(&p->note[r][0]);
    close_fd(&p->go[r][1]);
    close_fd(&p->err[r][0]);
}

/* A child's life: environment, the id, the rank's body, exit(). */
static void child_main(const world_spec *sp, world_pipes *p, int r)
{
    *check_counter() = 0; /* the parent's count is not this rank's */
    alarm(CHILD_DEADLINE_S);
    child_close(p, sp->n, r);
    if (p->err[r][1] >= 0) {
        dup2(p->err[r][1], STDERR_FILENO);
        close_fd(&p->err[r][1]);
    }
    if (sp->failpoints[r])
        setenv("DUCTILE_FAILPOINTS", sp->failpoints[r], 1);
    else
        unsetenv("DUCTILE_FAILPOINTS");
    /* A GPU of its own, as on a real node: NCCL refuses two ranks of one
     * host on one device (these processes share a parent: one host). */
    if (cudaSetDevice(r) != cudaSuccess) {
        fprintf(stderr, "rank %d: cudaSetDevice(%d) failed: DUCTILE_GPURT_DEVICES too small\n", r,
                r);
        _exit(1);
    }
    if (sp->peer_error) setenv("DUCTILE_GPURT_PEER_ERROR", sp->peer_error, 1);
    rank_ctx c = {.rank = r, .nranks = sp->n, .note_fd = p->note[r][1], .go_fd = p->go[r][0]};
    if (r == 0) {
        ncclResult_t res = ncclGetUniqueId(&c.id);
        if (res != ncclSuccess) {
            fprintf(stderr, "ncclGetUniqueId: %s\n", ncclGetErrorString(res));
            exit(2);
        }
        for (int k = 1; k < sp->n; k++)
            if (write_all(p->id[k][1], &c.id, sizeof(c.id)) != 0) exit(2);
    } else if (read_within(p->id[r][0], &c.id, sizeof(c.id), WAIT_MS) != 0) {
        fprintf(stderr, "rank %d: no unique id from rank 0\n", r);
        exit(2);
    }
    int rc = sp->fn(&c);
    fflush(NULL);
    exit(rc != 0 ? rc : check_failures() != 0);
}

static int world_pipes_open(world_pipes *p, const world_spec *sp)
{
    memset(p, -1, sizeof(*p));
    for (int r = 0; r < sp->n; r++)
        if ((r > 0 && pipe(p->id[r]) != 0) || pipe(p->note[r]) != 0 || pipe(p->go[r]) != 0 ||
            (sp->capture && pipe(p->err[r]) != 0))
            return -1;
    return 0;
}

static void world_pipes_close(world_pipes *p)
{
    for (int r = 0; r < MAX_RANKS; r++)
        for (int e = 0; e < 2; e++) {
            close_fd(&p->id[r][e]);
            close_fd(&p->note[r][e]);
            close_fd(&p->go[r][e]);
            close_fd(&p->err[r][e]);
        }
}

/* Forks the ranks; 0, or -1 (said) when the world could not be made. */
int world_start(world *w, const world_spec *sp)
{
    world_pipes p;
    memset(w, 0, sizeof(*w));
    w->n = sp->n;
    for (int r = 0; r < MAX_RANKS; r++)
        w->note[r] = w->go[r] = w->errfd[r] = w->pid[r] = -1;
    if (world_pipes_open(&p, sp) != 0) {
        world_pipes_close(&p);
        fprintf(stderr, "pipe: %s\n", strerror(errno));
        return -1;
    }
    fflush(NULL);
    for (int r = 0; r < sp->n; r++) {
        w->pid[r] = fork();
        if (w->pid[r] == 0) child_main(sp, &p, r);
        if (w->pid[r] < 0) fprintf(stderr, "fork: %s\n", strerror(errno));
    }
    for (int r = 0; r < sp->n; r++) {
        w->note[r] = p.note[r][0];
        w->go[r] = p.go[r][1];
        w->errfd[r] = p.err[r][0];
        p.note[r][0] = p.go[r][1] = p.err[r][0] = -1;
    }
    world_pipes_close(&p);
    for (int r = 0; r < sp->n; r++)
        if (w->pid[r] < 0) return -1;
    return 0;
}

/* 1 when rank r notes `want` within WAIT_MS. */
int world_note(world *w, int r, char want)
{
    char c = 0;
    if (read_within(w->note[r], &c, 1, WAIT_MS) != 0) return 0;
    return c == want;
}

void world_go(world *w, int r)
{
    write_all(w->go[r], "g", 1);
}

/* Reads what the ranks write on stderr until each closes it. */
static void world_drain_stderr(world *w)
{
    int64_t end = mono_now_ms() + (CHILD_DEADLINE_S + 10) * 1000LL;
    for (;;) {
        struct pollfd pf[MAX_RANKS];
        int n = 0, who[MAX_RANKS];
        for (int r = 0; r < w->n; r++)
            if (w->errfd[r] >= 0) {
                pf[n] = (struct pollfd){.fd = w->errfd[r], .events = POLLIN};
                who[n++] = r;
            }
        int left = (int)(end - mono_now_ms());
        if (n == 0 || left <= 0 || (poll(pf, (nfds_t)n, left) < 0 && errno != EINTR)) return;
        for (int i = 0; i < n; i++) {
            int r = who[i];
            char sink[512];
            size_t room = sizeof(w->err[r]) - 1 - w->errlen[r];
            if (!pf[i].revents) continue;
            ssize_t k = read(w->errfd[r], room ? w->err[r] + w->errlen[r] : sink,
                             room ? room : sizeof(sink));
            if (k <= 0 && !(k < 0 && errno == EINTR)) close_fd(&w->errfd[r]);
            if (k > 0 && room) w->errlen[r] += (size_t)k;
            w->err[r][w->errlen[r]] = '\0';
        }
    }
}

/* Waits for every rank (a straggler past its own deadline is killed). */
void world_finish(world *w)
{
    world_drain_stderr(w);
    th_wait_all(w->pid, w->n, (CHILD_DEADLINE_S + 10) * 1000, w->status, NULL);
    for (int r = 0; r < w->n; r++) {
        close_fd(&w->note[r]);
        close_fd(&w->go[r]);
        close_fd(&w->errfd[r]);
    }
}

int exited(int status, int code)
{
    return WIFEXITED(status) && WEXITSTATUS(status) == code;
}

int died_by(int status, int sig)
{
    return WIFSIGNALED(status) && WTERMSIG(status) == sig;
}

/* "exit N" or "signal N", for messages. */
const char *how(int status)
{
    static char buf[4][32];
    static int i;
    char *b = buf[i++ % 4];
    if (WIFEXITED(status))
        snprintf(b, sizeof(buf[0]), "exit %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status))
        snprintf(b, sizeof(buf[0]), "signal %d", WTERMSIG(status));
    else
        snprintf(b, sizeof(buf[0]), "status %#x", status);
    return b;
}

/* Runs a world to the end; every rank must exit 0. */
void world_run_clean(const world_spec *sp)
{
    world w;
    CHECK(world_start(&w, sp) == 0);
    world_finish(&w);
    for (int r = 0; r < sp->n; r++)
        CHECK(exited(w.status[r], 0), "rank %d: %s", r, how(w.status[r]));
}

/* ---- the ranks' side ---- */

void note(rank_ctx *c, char what)
{
    write_all(c->note_fd, &what, 1);
}

/* Waits for the parent's go (the child's alarm bounds it). */
void wait_go(rank_ctx *c)
{
    char g;
    while (read(c->go_fd, &g, 1) < 0 && errno == EINTR) {
    }
}

void *dev_alloc(size_t bytes)
{
    void *p = NULL;
    return cudaMalloc(&p, bytes) == cudaSuccess ? p : NULL;
}

int to_dev(void *d, const void *h, size_t bytes)
{
    return cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice) == cudaSuccess ? 0 : -1;
}

int from_dev(void *h, const void *d, size_t bytes)
{
    return cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost) == cudaSuccess ? 0 : -1;
}

/* Polls the comm until it leaves ncclInProgress or ms pass; its state. */
ncclResult_t settle(ncclComm_t comm, int ms)
{
    int64_t end = mono_now_ms() + ms;
    ncclResult_t st = ncclInProgress;
    while (ncclCommGetAsyncError(comm, &st) == ncclSuccess && st == ncclInProgress &&
           mono_now_ms() < end)
        nap();
    return st;
}

/* A call's answer on a blocking or non-blocking comm: 1 once it is
 * queued (ncclSuccess, or ncclInProgress and then settled to ncclSuccess:
 * NCCL launches a non-blocking comm's call later, from its own thread). */
int issued(ncclComm_t comm, ncclResult_t r)
{
    return r == ncclSuccess || (r == ncclInProgress && settle(comm, WAIT_MS) == ncclSuccess);
}

/* Polls until the comm has an error (neither success nor in progress). */
ncclResult_t error_within(ncclComm_t comm, int ms)
{
    int64_t end = mono_now_ms() + ms;
    ncclResult_t st = ncclSuccess;
    while (ncclCommGetAsyncError(comm, &st) == ncclSuccess &&
           (st == ncclSuccess || st == ncclInProgress) && mono_now_ms() < end)
        nap();
    return st;
}

/* 1 when s drains within ms (polled: a pending collective never blocks). */
int drained_within(cudaStream_t s, int ms)
{
    int64_t end = mono_now_ms() + ms;
    for (;;) {
        cudaError_t e = cudaStreamQuery(s);
        if (e != cudaErrorNotReady) return e == cudaSuccess;
        if (mono_now_ms() >= end) return 0;
        nap();
    }
}

/* A comm of nranks as `rank`; NULL (said) when it does not come up. */
ncclComm_t comm_up(const rank_ctx *c, int nranks, int rank, int blocking)
{
    ncclComm_t comm = NULL;
    if (blocking) {
        ncclResult_t r = ncclCommInitRank(&comm, nranks, c->id, rank);
        CHECK(r == ncclSuccess, "rank %d: ncclCommInitRank: %s", rank, ncclGetErrorString(r));
        return r == ncclSuccess ? comm : NULL;
    }
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&comm, nranks, c->id, rank, &cfg);
    CHECK(r == ncclInProgress, "rank %d: ncclCommInitRankConfig: %s", rank, ncclGetErrorString(r));
    if (r != ncclInProgress) return NULL;
    r = settle(comm, WAIT_MS);
    CHECK(r == ncclSuccess, "rank %d: init: %s (%s)", rank, ncclGetErrorString(r),
          ncclGetLastError(comm));
    if (r == ncclSuccess) return comm;
    ncclCommAbort(comm);
    return NULL;
}
