/* comm_ring_boot.c: the ring's bootstrap over TCP, through the round store.
 *
 * Every rank listens on an ephemeral port, publishes "ring/<rank>" =
 * "host:port/nonce" in the round store, connects to its right neighbour and
 * accepts from its left; the connector must echo the listener's nonce, so a
 * stray connection (another round, another job, a port scanner) is refused.
 * Each rank connects and says hello first, then accepts from the left, then
 * reads the right's answer, so no rank waits on another in a cycle. The two
 * connected sockets go to the ring (comm_ring.c) through ring_ready_fds().
 *
 * Failpoint (ductile/failpoint.h), for tests of the fault paths:
 * ring.connect (counted per bootstrap of a ring of two or more) with action
 * fail makes the bootstrap fail at once as if the left neighbour never
 * showed up (COMM_ERR_TIMEOUT, nothing published).
 */
#include "comm_ring.h"
#include "ductile/clock.h"

#include <errno.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define RING_HELLO_MAGIC 0x474e495254435544ull /* "DUCTRING" */
#define RING_ACK_MAGIC 0x4b43415254435544ull   /* "DUCTRACK" */
/* A connection that does not finish its hello within this is dropped. */
#define RING_HELLO_MS 2000

typedef struct ring_hello {
    uint64_t magic;
    uint32_t rank;
    uint32_t world;
    uint64_t nonce;
} ring_hello;

int ring_wait_fd(int fd, short events, int64_t deadline)
{
    for (;;) {
        struct pollfd pfd = {fd, events, 0};
        int n = poll(&pfd, 1, ring_ms_left(deadline));
        if (n > 0) return 1;
        if (n == 0) return 0;
        if (errno != EINTR) return -1;
    }
}

/* Moves exactly len bytes on a non-blocking socket before the deadline:
 * 0 done, else an errno (ETIMEDOUT on the deadline, ECONNRESET on EOF). */
static int io_all(int fd, void *buf, size_t len, int writing, int64_t deadline)
{
    char *p = buf;
    while (len > 0) {
        ssize_t k = writing ? send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT)
                            : recv(fd, p, len, MSG_DONTWAIT);
        if (k > 0) {
            p += k;
            len -= (size_t)k;
            continue;
        }
        if (k == 0) return ECONNRESET;
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return errno;
        int w = ring_wait_fd(fd, writing ? POLLOUT : POLLIN, deadline);
        if (w == 0) return ETIMEDOUT;
        if (w < 0) return errno;
    }
    return 0;
}

static comm_err listen_on(ring *g, const char *host, int *lfd, int *port)
{
    struct addrinfo hints = {0}, *ai = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    int rc = getaddrinfo(host, "0", &hints, &ai);
    if (rc != 0)
        return comm_fail(&g->base, COMM_ERR_ARG, "cannot resolve %s: %s", host, gai_strerror(rc));
    int fd = -1, last = 0;
    for (struct addrinfo *a = ai; a; a = a->ai_next) {
        fd = socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) {
            last = errno;
            continue;
        }
        ring_set_bufs(fd);
        if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 16) == 0) break;
        last = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(ai);
    if (fd < 0)
        return comm_fail(&g->base, COMM_ERR_SYS, "cannot listen on %s: %s", host, strerror(last));
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) < 0) {
        close(fd);
        return comm_fail(&g->base, COMM_ERR_SYS, "getsockname: %s", strerror(errno));
    }
    *port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                           : ((struct sockaddr_in *)&ss)->sin_port);
    *lfd = fd;
    return COMM_OK;
}

/* "host:port/nonce" (IPv6 hosts in brackets). */
static int parse_addr(char *v, char **host, char **port, uint64_t *nonce)
{
    char *slash = strrchr(v, '/');
    if (!slash) return -1;
    *slash = '\0';
    char *end;
    errno = 0;
    *nonce = strtoull(slash + 1, &end, 16);
    if (errno || *end || end == slash + 1) return -1;
    char *colon = strrchr(v, ':');
    if (!colon || colon == v || !colon[1]) return -1;
    *colon = '\0';
    *port = colon + 1;
    *host = v;
    size_t hl = strlen(v);
    if (hl >= 2 && v[0] == '[' && v[hl - 1] == ']') {
        v[hl - 1] = '\0';
        *host = v + 1;
    }
    return 0;
}

/* Connects to host:port, retrying refused connections until the deadline. */
static comm_err connect_to(ring *g, const char *host, const char *port, int64_t deadline, int *out)
{
    struct addrinfo hints = {0}, *ai = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    int rc = getaddrinfo(host, port, &hints, &ai);
    if (rc != 0)
        return comm_fail(&g->base, COMM_ERR_PEER, "cannot resolve right neighbour %s: %s", host,
                         gai_strerror(rc));
    int last = 0;
    for (;;) {
        for (struct addrinfo *a = ai; a; a = a->ai_next) {
            int fd = socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
            if (fd < 0) {
                last = errno;
                continue;
            }
            ring_set_bufs(fd);
            int e = 0;
            if (connect(fd, a->ai_addr, a->ai_addrlen) < 0) {
                e = errno;
                if (e == EINPROGRESS || e == EINTR) {
                    int w = ring_wait_fd(fd, POLLOUT, deadline);
                    socklen_t el = sizeof(e);
                    if (w <= 0)
                        e = w == 0 ? ETIMEDOUT : errno;
                    else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el) < 0)
                        e = errno;
                }
            }
            if (e == 0) {
                freeaddrinfo(ai);
                *out = fd;
                return COMM_OK;
            }
            last = e;
            close(fd);
        }
        if (mono_now_ms() >= deadline) break;
        struct timespec pause = {0, 50 * 1000000};
        nanosleep(&pause, NULL);
    }
    freeaddrinfo(ai);
    return comm_fail(&g->base, last == ETIMEDOUT ? COMM_ERR_TIMEOUT : COMM_ERR_PEER,
                     "cannot connect to right neighbour (rank %d) at %s:%s: %s", ring_right_rank(g),
                     host, port, strerror(last));
}

/* Accepts the left neighbour: the first connection whose hello names the
 * right rank, world size and this rank's nonce. Others are closed. */
static comm_err accept_left(ring *g, int lfd, uint64_t nonce, int64_t deadline, int *out)
{
    int rejected = 0;
    for (;;) {
        int w = ring_wait_fd(lfd, POLLIN, deadline);
        if (w == 0)
            return comm_fail(&g->base, COMM_ERR_TIMEOUT,
                             "left neighbour (rank %d) did not connect (%d stray connections "
                             "refused)",
                             ring_left_rank(g), rejected);
        if (w < 0) return comm_fail(&g->base, COMM_ERR_SYS, "poll: %s", strerror(errno));
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNABORTED)
                continue;
            return comm_fail(&g->base, COMM_ERR_SYS, "accept: %s", strerror(errno));
        }
        ring_hello h;
        int64_t hd = mono_now_ms() + RING_HELLO_MS;
        int e = io_all(fd, &h, sizeof(h), 0, hd < deadline ? hd : deadline);
        if (e == 0 && h.magic == RING_HELLO_MAGIC && h.rank == (uint32_t)ring_left_rank(g) &&
            h.world == (uint32_t)g->base.world_size && h.nonce == nonce) {
            ring_hello ack = {RING_ACK_MAGIC, (uint32_t)g->base.rank, (uint32_t)g->base.world_size,
                              nonce};
            e = io_all(fd, &ack, sizeof(ack), 1, deadline);
            if (e == 0) {
                *out = fd;
                return COMM_OK;
            }
        }
        close(fd);
        rejected++;
    }
}

static comm_err ring_bootstrap(ring *g, const comm_config *cfg)
{
    if (ring_failpoint("ring.connect", "fail"))
        return comm_fail(&g->base, COMM_ERR_TIMEOUT,
                         "left neighbour (rank %d) did not connect (failpoint ring.connect)",
                         ring_left_rank(g));
    const char *host = cfg->host && cfg->host[0] ? cfg->host : "127.0.0.1";
    int64_t deadline = mono_now_ms() + g->timeout_ms;
    int lfd = -1, port = 0;
    void *val = NULL;
    comm_err err = listen_on(g, host, &lfd, &port);
    if (err != COMM_OK) return err;

    uint64_t nonce = 0;
    if (getrandom(&nonce, sizeof(nonce), 0) != (ssize_t)sizeof(nonce)) {
        err = comm_fail(&g->base, COMM_ERR_SYS, "getrandom: %s", strerror(errno));
        goto out;
    }
    char key[32], mine[320];
    int v6 = strchr(host, ':') != NULL;
    snprintf(mine, sizeof(mine), "%s%s%s:%d/%016" PRIx64, v6 ? "[" : "", host, v6 ? "]" : "", port,
             nonce);
    snprintf(key, sizeof(key), "ring/%d", g->base.rank);
    rdzv_err re = rdzv_store_set(cfg->store, key, mine, strlen(mine));
    if (re != RDZV_OK) {
        err = comm_store_error(&g->base, cfg->store, re, "publishing the ring address");
        goto out;
    }

    size_t len = 0;
    snprintf(key, sizeof(key), "ring/%d", ring_right_rank(g));
    re = rdzv_store_wait(cfg->store, key, ring_ms_left(deadline), &val, &len);
    if (re != RDZV_OK) {
        err =
            comm_store_error(&g->base, cfg->store, re, "waiting for the right neighbour's address");
        goto out;
    }
    char *rhost, *rport;
    uint64_t rnonce;
    if (strlen(val) != len || parse_addr(val, &rhost, &rport, &rnonce) < 0) {
        err = comm_fail(&g->base, COMM_ERR_STORE, "malformed ring address for rank %d",
                        ring_right_rank(g));
        goto out;
    }

    /* Connect and say hello first (never waits on the neighbour's code),
     * then accept from the left, then read the right's answer: no rank
     * waits on another in a cycle. */
    err = connect_to(g, rhost, rport, deadline, &g->right_fd);
    if (err != COMM_OK) goto out;
    ring_hello hello = {RING_HELLO_MAGIC, (uint32_t)g->base.rank, (uint32_t)g->base.world_size,
                        rnonce};
    int e = io_all(g->right_fd, &hello, sizeof(hello), 1, deadline);
    if (e != 0) {
        err = comm_fail(&g->base, e == ETIMEDOUT ? COMM_ERR_TIMEOUT : COMM_ERR_PEER,
                        "hello to right neighbour (rank %d): %s", ring_right_rank(g), strerror(e));
        goto out;
    }
    err = accept_left(g, lfd, nonce, deadline, &g->left_fd);
    if (err != COMM_OK) goto out;
    ring_hello ack;
    e = io_all(g->right_fd, &ack, sizeof(ack), 0, deadline);
    if (e != 0) {
        err = comm_fail(&g->base, e == ETIMEDOUT ? COMM_ERR_TIMEOUT : COMM_ERR_PEER,
                        "no answer from right neighbour (rank %d): %s", ring_right_rank(g),
                        strerror(e));
        goto out;
    }
    if (ack.magic != RING_ACK_MAGIC || ack.rank != (uint32_t)ring_right_rank(g) ||
        ack.world != (uint32_t)g->base.world_size || ack.nonce != rnonce) {
        err = comm_fail(&g->base, COMM_ERR_PEER, "right neighbour (rank %d) refused the ring",
                        ring_right_rank(g));
        goto out;
    }
    err = ring_ready_fds(g);
out:
    free(val);
    close(lfd);
    return err;
}

comm_err comm_ring_init(const comm_config *cfg, comm **out)
{
    if (!out) return COMM_ERR_ARG;
    *out = NULL;
    ring *g = NULL;
    comm_err err = ring_new(cfg, &g);
    if (err != COMM_OK) return comm_init_failed(cfg, err, NULL);
    if (cfg->world_size > 1) {
        if (!cfg->store) {
            err = COMM_ERR_ARG;
            goto err;
        }
        err = ring_bootstrap(g, cfg);
        if (err != COMM_OK) goto err;
    }
    *out = &g->base;
    return COMM_OK;
err:
    comm_init_failed(cfg, err, g->base.last_error);
    ring_destroy(&g->base);
    return err;
}
