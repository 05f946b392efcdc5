/* rt_nccl_boot.c: the host runtime's NCCL bootstrap (see rt_nccl.h).
 *
 * Sockets whose every wait is a poll that also watches the comm's eventfd
 * (so ncclCommAbort ends it), the unique id with the root's address and a
 * nonce, the root thread ncclGetUniqueId starts, and each rank's part on
 * its comm thread: register with the root, get the address table, refuse
 * two ranks on one GPU, connect to each lower rank, accept each higher one.
 */
#include "rt_nccl.h"

/* DUCTILE_GPURT_ADDR, or loopback; 0 or -1 (not an IPv4 address). */
int nc_env_addr(uint32_t *addr)
{
    const char *s = getenv("DUCTILE_GPURT_ADDR");
    struct in_addr a;
    if (inet_pton(AF_INET, s && *s ? s : "127.0.0.1", &a) != 1) return -1;
    *addr = a.s_addr;
    return 0;
}

/* ---- sockets: every wait is a poll that also watches `wake` ---- */

/* Waits until fd has `events`, wake (-1: none) is readable (NC_IO_STOP) or
 * the monotonic deadline_ms passes (-1: never). */
static nc_io nc_wait(int fd, short events, int wake, int64_t deadline_ms)
{
    struct pollfd p[2] = {{.fd = fd, .events = events}, {.fd = wake, .events = POLLIN}};
    for (;;) {
        int timeout = -1;
        if (deadline_ms >= 0) {
            int64_t left = deadline_ms - mono_now_ms();
            if (left <= 0) return NC_IO_TIMEOUT;
            timeout = left > INT_MAX ? INT_MAX : (int)left;
        }
        int n = poll(p, 2, timeout);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return NC_IO_ERROR;
        if (p[1].revents) return NC_IO_STOP;
        if (p[0].revents) return NC_IO_OK;
    }
}

/* Moves all n bytes over the non-blocking fd (out: send, else receive). */
static nc_io nc_xfer(int fd, void *buf, size_t n, int out, int wake, int64_t deadline_ms)
{
    char *p = buf;
    while (n > 0) {
        ssize_t k = out ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k == 0) return NC_IO_CLOSED;
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return NC_IO_ERROR;
        nc_io io = nc_wait(fd, out ? POLLOUT : POLLIN, wake, deadline_ms);
        if (io != NC_IO_OK) return io;
    }
    return NC_IO_OK;
}

static void nc_close_keep_errno(int fd)
{
    int e = errno;
    close(fd);
    errno = e;
}

/* A non-blocking listener on addr and an ephemeral port (network order). */
static int nc_listen(uint32_t addr, uint16_t *port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = addr};
    socklen_t len = sizeof(sa);
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0 || listen(fd, SOMAXCONN) != 0 ||
        getsockname(fd, (struct sockaddr *)&sa, &len) != 0) {
        nc_close_keep_errno(fd);
        return -1;
    }
    *port = sa.sin_port;
    return fd;
}

static void nc_nodelay(int fd)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

/* Connects a non-blocking socket to addr:port (network order). */
static nc_io nc_dial(uint32_t addr, uint16_t port, int wake, int64_t deadline_ms, int *out)
{
    *out = -1;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return NC_IO_ERROR;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = addr, .sin_port = port};
    nc_io io = NC_IO_OK;
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        io = errno == EINPROGRESS || errno == EINTR ? nc_wait(fd, POLLOUT, wake, deadline_ms)
                                                    : NC_IO_ERROR;
        int err = 0;
        socklen_t len = sizeof(err);
        if (io == NC_IO_OK && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err) {
            errno = err;
            io = NC_IO_ERROR;
        }
    }
    if (io != NC_IO_OK) {
        nc_close_keep_errno(fd);
        return io;
    }
    nc_nodelay(fd);
    *out = fd;
    return NC_IO_OK;
}

void nc_drain(int fd)
{
    uint64_t v;
    ssize_t k = read(fd, &v, sizeof(v));
    (void)k; /* an eventfd: empty (EAGAIN) is as good as drained */
}

/* ---- the unique id and the bootstrap messages ---- */

const char nc_id_magic[8] = "gpurtid";

static const char *nc_why_text(int why)
{
    return why == NC_WHY_DUP ? "another process registered that rank"
                             : "another rank registered a different number of ranks";
}

/* ---- the bootstrap root: one detached thread per ncclGetUniqueId ---- */

typedef struct nc_root {
    int fd;
    uint64_t nonce;
    int nranks, joined; /* nranks 0 until the first registration */
    int *conn;          /* [nranks]: each registered rank's connection, or -1 */
    nc_where *where;    /* [nranks] */
} nc_root;

static void nc_root_free(nc_root *rt)
{
    for (int r = 0; r < rt->nranks; r++)
        if (rt->conn[r] >= 0) close(rt->conn[r]);
    close(rt->fd);
    free(rt->conn);
    free(rt->where);
    free(rt);
}

static int nc_root_size(nc_root *rt, int nranks)
{
    rt->conn = malloc((size_t)nranks * sizeof(*rt->conn));
    rt->where = calloc((size_t)nranks, sizeof(*rt->where));
    if (!rt->conn || !rt->where) {
        free(rt->conn);
        free(rt->where);
        rt->conn = NULL;
        rt->where = NULL;
        return -1;
    }
    for (int r = 0; r < nranks; r++)
        rt->conn[r] = -1;
    rt->nranks = nranks;
    return 0;
}

static void nc_root_refuse(int fd, nc_why why)
{
    nc_answer a = {NC_HELLO_MAGIC, ncclInvalidUsage, why, 0};
    nc_xfer(fd, &a, sizeof(a), 1, -1, mono_now_ms() + NC_ROOT_IO_MS);
    close(fd);
}

/* One new connection: a registration kept, refused (a duplicate rank, a
 * different nranks) or dropped (not a hello with our nonce). */
static void nc_root_take(nc_root *rt, int fd)
{
    nc_hello h;
    if (nc_xfer(fd, &h, sizeof(h), 0, -1, mono_now_ms() + NC_ROOT_IO_MS) != NC_IO_OK ||
        h.magic != NC_HELLO_MAGIC || h.nonce != rt->nonce || h.nranks < 1 ||
        h.nranks > NC_MAX_RANKS || h.rank < 0 || h.rank >= h.nranks ||
        (rt->nranks == 0 && nc_root_size(rt, h.nranks) != 0)) {
        close(fd);
        return;
    }
    if (h.nranks != rt->nranks) return nc_root_refuse(fd, NC_WHY_NRANKS);
    if (rt->conn[h.rank] >= 0) return nc_root_refuse(fd, NC_WHY_DUP);
    rt->conn[h.rank] = fd;
    rt->where[h.rank] =
        (nc_where){.addr = h.addr, .port = h.port, .host = h.host, .device = h.device};
    rt->joined++;
}

/* Everyone is in: the table to each. A rank that died since it registered
 * misses it; its peers find out when they dial it. */
static void nc_root_answer(nc_root *rt)
{
    nc_answer a = {NC_HELLO_MAGIC, ncclSuccess, NC_WHY_NONE, rt->nranks};
    for (int r = 0; r < rt->nranks; r++) {
        int64_t deadline = mono_now_ms() + NC_ROOT_IO_MS;
        if (nc_xfer(rt->conn[r], &a, sizeof(a), 1, -1, deadline) == NC_IO_OK)
            nc_xfer(rt->conn[r], rt->where, (size_t)rt->nranks * sizeof(*rt->where), 1, -1,
                    deadline);
    }
}

static void *nc_root_main(void *arg)
{
    nc_root *rt = arg;
    int64_t end = mono_now_ms() + NC_ROOT_LIFETIME_MS;
    while (rt->nranks == 0 || rt->joined < rt->nranks) {
        if (nc_wait(rt->fd, POLLIN, -1, end) != NC_IO_OK) break;
        int c = accept4(rt->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (c >= 0)
            nc_root_take(rt, c);
        else if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED)
            break;
    }
    if (rt->nranks > 0 && rt->joined == rt->nranks) nc_root_answer(rt);
    nc_root_free(rt);
    return NULL;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *out)
{
    const char *action = rt_call("nccl", "ncclGetUniqueId");
    if (!out) return nc_fail_here(ncclInvalidArgument, "ncclGetUniqueId: uniqueId is NULL");
    if (nc_action_is(action, "error"))
        return nc_fail_here(ncclSystemError, "ncclGetUniqueId: failpoint error");
    nc_id id = {.pad = 0};
    memcpy(id.magic, nc_id_magic, sizeof(id.magic));
    if (nc_env_addr(&id.addr) != 0)
        return nc_fail_here(ncclInvalidUsage, "DUCTILE_GPURT_ADDR is not an IPv4 address");
    if (getrandom(&id.nonce, sizeof(id.nonce), 0) != (ssize_t)sizeof(id.nonce))
        return nc_fail_here(ncclSystemError, "getrandom: %s", strerror(errno));
    nc_root *rt = calloc(1, sizeof(*rt));
    if (!rt) return nc_fail_here(ncclSystemError, "ncclGetUniqueId: out of memory");
    rt->nonce = id.nonce;
    rt->fd = nc_listen(id.addr, &id.port);
    if (rt->fd < 0) {
        free(rt);
        return nc_fail_here(ncclSystemError, "bootstrap root: listen: %s", strerror(errno));
    }
    pthread_attr_t attr;
    pthread_t t;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &attr, nc_root_main, rt);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        nc_root_free(rt);
        return nc_fail_here(ncclSystemError, "bootstrap root: pthread_create: %s", strerror(rc));
    }
    memset(out, 0, sizeof(*out));
    memcpy(out->internal, &id, sizeof(id));
    return ncclSuccess;
}

/* ---- bootstrap, on the comm thread ---- */

/* Records an I/O failure of the bootstrap ("WHAT: closed" and the like) as
 * a lost peer; a stop (abort) is no failure worth a reason. */
__attribute__((format(printf, 3, 4))) static ncclResult_t nc_io_fail(nc_shared *sh, nc_io io,
                                                                     const char *fmt, ...)
{
    if (io == NC_IO_STOP) return ncclInternalError;
    char what[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    const char *how = io == NC_IO_CLOSED ? "connection closed" : strerror(errno);
    return nc_fail(sh, sh->peer_error, "%s: %s", what, how);
}

static nc_hello nc_hello_of(const nc_shared *sh)
{
    nc_hello h = {.magic = NC_HELLO_MAGIC,
                  .rank = sh->rank,
                  .nranks = sh->nranks,
                  .addr = sh->addr,
                  .nonce = sh->nonce,
                  .port = sh->peer[sh->rank].where.port,
                  .host = sh->host,
                  .device = sh->device};
    return h;
}

/* NCCL's check after it has every rank's peer info: two ranks of one
 * communicator on the same GPU of the same host are refused. */
static ncclResult_t nc_check_duplicate(nc_shared *sh)
{
    const nc_where *me = &sh->peer[sh->rank].where;
    for (int p = 0; p < sh->nranks; p++)
        if (p != sh->rank && sh->peer[p].where.host == me->host &&
            sh->peer[p].where.device == me->device)
            return nc_fail(sh, ncclInvalidUsage,
                           "Duplicate GPU detected : rank %d and rank %d both on CUDA device %x",
                           sh->rank, p, me->device);
    return ncclSuccess;
}

/* Reads the root's answer and the table of addresses into sh->peer. */
static ncclResult_t nc_read_table(nc_shared *sh, int fd)
{
    nc_answer a;
    nc_io io = nc_xfer(fd, &a, sizeof(a), 0, sh->wake, -1);
    if (io == NC_IO_CLOSED)
        return nc_fail(sh, sh->peer_error,
                       "the bootstrap root dropped the registration (a wrong nonce: an id it "
                       "did not make), or gave up waiting");
    if (io != NC_IO_OK) return nc_io_fail(sh, io, "registering with the bootstrap root");
    if (a.magic != NC_HELLO_MAGIC || (a.status == ncclSuccess && a.nranks != sh->nranks))
        return nc_fail(sh, ncclInternalError, "garbled answer from the bootstrap root");
    if (a.status != ncclSuccess)
        return nc_fail(sh, (ncclResult_t)a.status, "the bootstrap root refused rank %d of %d: %s",
                       sh->rank, sh->nranks, nc_why_text(a.why));
    nc_where *table = calloc((size_t)sh->nranks, sizeof(*table));
    if (!table) return nc_fail(sh, ncclSystemError, "out of memory for the address table");
    io = nc_xfer(fd, table, (size_t)sh->nranks * sizeof(*table), 0, sh->wake, -1);
    for (int p = 0; io == NC_IO_OK && p < sh->nranks; p++)
        sh->peer[p].where = table[p];
    free(table);
    return io == NC_IO_OK ? ncclSuccess : nc_io_fail(sh, io, "reading the address table");
}

/* Listens, registers (rank, nranks, address, host, device) with the root,
 * gets the table. */
static ncclResult_t nc_register(nc_shared *sh)
{
    sh->peer[sh->rank].where.addr = sh->addr;
    sh->peer[sh->rank].where.host = sh->host;
    sh->peer[sh->rank].where.device = sh->device;
    sh->listen_fd = nc_listen(sh->addr, &sh->peer[sh->rank].where.port);
    if (sh->listen_fd < 0) return nc_fail(sh, ncclSystemError, "listen: %s", strerror(errno));
    int fd;
    nc_io io = nc_dial(sh->root.addr, sh->root.port, sh->wake, -1, &fd);
    if (io != NC_IO_OK) return nc_io_fail(sh, io, "connecting to the bootstrap root");
    nc_hello h = nc_hello_of(sh);
    io = nc_xfer(fd, &h, sizeof(h), 1, sh->wake, -1);
    ncclResult_t r = io == NC_IO_OK ? nc_read_table(sh, fd)
                                    : nc_io_fail(sh, io, "registering with the bootstrap root");
    close(fd);
    return r;
}

static int nc_hello_ok(const nc_shared *sh, const nc_hello *h)
{
    return h->magic == NC_HELLO_MAGIC && h->nonce == sh->nonce && h->nranks == sh->nranks &&
           h->rank >= 0 && h->rank < sh->nranks;
}

/* Connects to lower rank j and checks that j answers. */
static ncclResult_t nc_mesh_dial(nc_shared *sh, int j)
{
    int fd;
    nc_io io = nc_dial(sh->peer[j].where.addr, sh->peer[j].where.port, sh->wake, -1, &fd);
    if (io != NC_IO_OK) return nc_io_fail(sh, io, "connecting to rank %d", j);
    nc_hello h = nc_hello_of(sh), a;
    io = nc_xfer(fd, &h, sizeof(h), 1, sh->wake, -1);
    if (io == NC_IO_OK) io = nc_xfer(fd, &a, sizeof(a), 0, sh->wake, -1);
    if (io != NC_IO_OK) {
        nc_close_keep_errno(fd);
        return nc_io_fail(sh, io, "handshake with rank %d", j);
    }
    if (!nc_hello_ok(sh, &a) || a.rank != j) {
        close(fd);
        return nc_fail(sh, ncclInternalError, "rank %d's address answered as someone else", j);
    }
    sh->peer[j].fd = fd;
    return ncclSuccess;
}

/* Takes one connection to this rank's listener: 1 when it is a higher rank
 * not yet connected (answered and kept), 0 when refused (a wrong nonce, a
 * duplicate, a stranger: closed), -1 when the comm is stopping. */
static int nc_mesh_greet(nc_shared *sh, int fd)
{
    nc_hello h;
    nc_io io = nc_xfer(fd, &h, sizeof(h), 0, sh->wake, -1);
    if (io != NC_IO_OK || !nc_hello_ok(sh, &h) || h.rank <= sh->rank || sh->peer[h.rank].fd >= 0) {
        close(fd);
        return io == NC_IO_STOP ? -1 : 0;
    }
    nc_hello a = nc_hello_of(sh);
    io = nc_xfer(fd, &a, sizeof(a), 1, sh->wake, -1);
    if (io != NC_IO_OK) {
        close(fd);
        return io == NC_IO_STOP ? -1 : 0;
    }
    nc_nodelay(fd);
    sh->peer[h.rank].fd = fd;
    return 1;
}

/* Accepts until every higher rank is connected. */
static ncclResult_t nc_mesh_accept(nc_shared *sh)
{
    int missing = sh->nranks - 1 - sh->rank;
    while (missing > 0) {
        nc_io io = nc_wait(sh->listen_fd, POLLIN, sh->wake, -1);
        if (io != NC_IO_OK) return nc_io_fail(sh, io, "waiting for higher ranks");
        int fd = accept4(sh->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0 && (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED)) continue;
        if (fd < 0) return nc_fail(sh, ncclSystemError, "accept: %s", strerror(errno));
        int took = nc_mesh_greet(sh, fd);
        if (took < 0) return ncclInternalError;
        missing -= took;
    }
    return ncclSuccess;
}

ncclResult_t nc_bootstrap(nc_shared *sh)
{
    ncclResult_t r = nc_register(sh);
    if (r == ncclSuccess) r = nc_check_duplicate(sh);
    for (int j = 0; r == ncclSuccess && j < sh->rank; j++)
        r = nc_mesh_dial(sh, j);
    if (r == ncclSuccess) r = nc_mesh_accept(sh);
    pthread_mutex_lock(&sh->mu);
    if (sh->listen_fd >= 0) close(sh->listen_fd);
    sh->listen_fd = -1;
    if (r == ncclSuccess) sh->ready = 1;
    pthread_cond_broadcast(&sh->ready_cv);
    pthread_mutex_unlock(&sh->mu);
    return r;
}
