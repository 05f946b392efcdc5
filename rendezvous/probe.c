/* probe.c: the liveness probe of a node's registration (docs/design.md,
 * "Rounds", restarts).
 *
 * A node's registration names a TCP port on its address where its agent
 * answers every connection with one line, "ductile-probe NODE INCARNATION",
 * and closes. A new agent that finds its node id registered asks that port
 * whether the registered incarnation still lives. The one idea: only a
 * process holding the port can answer for it, and the kernel refuses or
 * resets a connection to a port nobody holds, so "refused" means that
 * incarnation is gone, while silence proves nothing (a stopped process, a
 * partition, a slow machine) and is answered by waiting for its lease.
 *
 * The responder is a thread of the rendezvous handle, like the lease's
 * keep-alive: it answers while the process lives, whatever its main loop
 * is doing. It listens on the wildcard address of the node address's
 * family, on a port the kernel picks.
 *
 * The responder keeps each connection open after its line until the
 * prober closes it (up to PROBE_HELD_MAX at once; past that it closes at
 * once, as a one-shot probe needs no more). A peer's sentinel
 * (rdzv_sentinel.c) holds one: when this process dies the kernel closes
 * it, and the peer learns of the death at once instead of a lease TTL
 * later.
 */
#include "rdzv_internal.h"

#include "ductile/clock.h"
#include "ductile/failpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#define PROBE_LINE_MAX (RDZV_NODE_ID_MAX + 64)
#define PROBE_HELD_MAX 32

struct rdzv_probe {
    int lfd, stopfd;
    int port;
    char node[RDZV_NODE_ID_MAX + 1];
    _Atomic int64_t incarnation;
    pthread_t th;
    int started;
};

static int probe_line(char *buf, size_t len, const char *node, int64_t inc)
{
    return snprintf(buf, len, "ductile-probe %s %" PRId64 "\n", node, inc);
}

/* Answers every connection with this incarnation's line and holds it
 * until the prober closes it (or closes it at once when PROBE_HELD_MAX are
 * held); a prober that does not read in time loses the line, never this
 * thread. */
static void *responder_main(void *arg)
{
    rdzv_probe *p = arg;
    pthread_setname_np(pthread_self(), "rdzv-probe");
    struct pollfd fds[2 + PROBE_HELD_MAX];
    int held = 0;
    fds[0] = (struct pollfd){.fd = p->lfd, .events = POLLIN};
    fds[1] = (struct pollfd){.fd = p->stopfd, .events = POLLIN};
    for (;;) {
        if (poll(fds, (nfds_t)(2 + held), -1) < 0) {
            if (errno == EINTR) continue;
            break;
        }
        if (fds[1].revents) break;
        /* A held connection that is readable or hung up: its prober is done
         * (it never sends; whatever it sent is discarded with it). */
        for (int i = 0; i < held;) {
            if (fds[2 + i].revents) {
                close(fds[2 + i].fd);
                fds[2 + i] = fds[2 + --held];
            } else {
                i++;
            }
        }
        if (!(fds[0].revents & POLLIN)) continue;
        int c = accept4(p->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (c < 0) continue; /* gone before accepted, or out of fds: the prober times out */
        char line[PROBE_LINE_MAX];
        int n = probe_line(line, sizeof(line), p->node, atomic_load(&p->incarnation));
        ssize_t w = send(c, line, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w == n && held < PROBE_HELD_MAX)
            fds[2 + held++] = (struct pollfd){.fd = c, .events = POLLIN};
        else
            close(c);
    }
    for (int i = 0; i < held; i++)
        close(fds[2 + i].fd);
    return NULL;
}

/* A listening socket on the wildcard address of addr's family. */
static int listen_like(const char *addr, int *port)
{
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *ai = NULL;
    if (!addr || !*addr || getaddrinfo(addr, NULL, &hints, &ai) != 0) return -1;
    int family = ai->ai_family;
    freeaddrinfo(ai);
    int fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_storage ss;
    socklen_t sl;
    memset(&ss, 0, sizeof(ss));
    if (family == AF_INET6) {
        ((struct sockaddr_in6 *)&ss)->sin6_family = AF_INET6;
        ((struct sockaddr_in6 *)&ss)->sin6_addr = in6addr_any;
        sl = sizeof(struct sockaddr_in6);
    } else {
        ((struct sockaddr_in *)&ss)->sin_family = AF_INET;
        ((struct sockaddr_in *)&ss)->sin_addr.s_addr = htonl(INADDR_ANY);
        sl = sizeof(struct sockaddr_in);
    }
    if (bind(fd, (struct sockaddr *)&ss, sl) != 0 || listen(fd, 16) != 0 ||
        getsockname(fd, (struct sockaddr *)&ss, &sl) != 0) {
        close(fd);
        return -1;
    }
    *port = ntohs(family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                     : ((struct sockaddr_in *)&ss)->sin_port);
    return fd;
}

rdzv_err rdzv_probe_start(const char *addr, const char *node, rdzv_probe **out)
{
    *out = NULL;
    rdzv_probe *p = calloc(1, sizeof(*p));
    if (!p) return RDZV_ERR_NOMEM;
    snprintf(p->node, sizeof(p->node), "%s", node);
    p->stopfd = -1;
    p->lfd = listen_like(addr, &p->port);
    if (p->lfd < 0) { /* no address to listen on: this node is never taken over */
        free(p);
        return RDZV_OK;
    }
    p->stopfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (p->stopfd < 0 || pthread_create(&p->th, NULL, responder_main, p) != 0) {
        rdzv_probe_stop(p);
        return RDZV_ERR_NOMEM;
    }
    p->started = 1;
    *out = p;
    return RDZV_OK;
}

int rdzv_probe_port(const rdzv_probe *p)
{
    return p ? p->port : 0;
}

void rdzv_probe_set_incarnation(rdzv_probe *p, int64_t inc)
{
    if (p) atomic_store(&p->incarnation, inc);
}

void rdzv_probe_stop(rdzv_probe *p)
{
    if (!p) return;
    if (p->started) {
        uint64_t one = 1;
        ssize_t w = write(p->stopfd, &one, sizeof(one));
        (void)w;
        pthread_join(p->th, NULL);
    }
    if (p->stopfd >= 0) close(p->stopfd);
    if (p->lfd >= 0) close(p->lfd);
    free(p);
}

/* ---- the prober ---- */

/* Waits for events on fd until deadline; 1 when ready, 0 on timeout. */
static int wait_fd(int fd, short events, int64_t deadline)
{
    for (;;) {
        int64_t left = deadline - mono_now_ms();
        if (left <= 0) return 0;
        struct pollfd p = {.fd = fd, .events = events};
        int n = poll(&p, 1, (int)left);
        if (n > 0) return 1;
        if (n < 0 && errno != EINTR) return 0;
    }
}

/* Connects to addr:port before deadline: the socket, or -1 with *verdict
 * set (refused or reset: DEAD; anything else: UNKNOWN). */
static int probe_connect(const char *addr, int port, int64_t deadline, rdzv_probe_verdict *verdict,
                         char *why, size_t len)
{
    char svc[16];
    snprintf(svc, sizeof(svc), "%d", port);
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *ai = NULL;
    *verdict = RDZV_PROBE_UNKNOWN;
    int gai = getaddrinfo(addr, svc, &hints, &ai);
    if (gai != 0) {
        snprintf(why, len, "cannot resolve %.100s: %s", addr, gai_strerror(gai));
        return -1;
    }
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int err = fd < 0 ? errno : 0;
    if (fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
        err = errno;
        if (err == EINPROGRESS) {
            socklen_t sl = sizeof(err);
            err = ETIMEDOUT;
            if (wait_fd(fd, POLLOUT, deadline) && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &sl))
                err = errno;
        }
    }
    freeaddrinfo(ai);
    if (err == 0) return fd;
    if (fd >= 0) close(fd);
    if (err == ECONNREFUSED || err == ECONNRESET) *verdict = RDZV_PROBE_DEAD;
    snprintf(why, len, "connect to %.100s:%d: %s", addr, port, strerror(err));
    return -1;
}

/* Reads one line before deadline. Returns its length; 0 when the peer
 * closed or reset first; -1 on timeout or another error. */
static int probe_read_line(int fd, char *buf, size_t len, int64_t deadline)
{
    size_t got = 0;
    while (got + 1 < len) {
        if (!wait_fd(fd, POLLIN, deadline)) return -1;
        ssize_t n = recv(fd, buf + got, len - 1 - got, 0);
        if (n == 0 || (n < 0 && errno == ECONNRESET)) break;
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN) continue;
            return -1;
        }
        got += (size_t)n;
        if (memchr(buf, '\n', got)) break;
    }
    buf[got] = '\0';
    char *nl = strchr(buf, '\n');
    if (nl) *nl = '\0';
    return (int)strlen(buf);
}

int rdzv_probe_hold(const char *addr, int port, const char *node, int64_t inc, int timeout_ms,
                    rdzv_probe_verdict *verdict, char *why, size_t len)
{
    *verdict = RDZV_PROBE_UNKNOWN;
    const char *fp = failpoint("rdzv.probe");
    if (fp && strcmp(fp, "dead") == 0) {
        snprintf(why, len, "failpoint rdzv.probe=dead");
        *verdict = RDZV_PROBE_DEAD;
        return -1;
    }
    if (!addr || !*addr || port <= 0 || port > 65535) {
        snprintf(why, len, "it names no liveness probe");
        return -1;
    }
    int64_t deadline = mono_now_ms() + timeout_ms;
    int fd = probe_connect(addr, port, deadline, verdict, why, len);
    if (fd < 0) return -1;
    char line[PROBE_LINE_MAX], want[PROBE_LINE_MAX];
    int n = probe_read_line(fd, line, sizeof(line), deadline);
    if (n < 0) {
        close(fd);
        snprintf(why, len, "no answer from %.100s:%d within %d ms", addr, port, timeout_ms);
        return -1;
    }
    probe_line(want, sizeof(want), node, inc);
    want[strlen(want) - 1] = '\0';
    if (strcmp(line, want) == 0) {
        snprintf(why, len, "incarnation %" PRId64 " answers at %.100s:%d", inc, addr, port);
        *verdict = RDZV_PROBE_ALIVE;
        return fd;
    }
    close(fd);
    if (n == 0)
        snprintf(why, len, "%.100s:%d closed without an answer", addr, port);
    else
        snprintf(why, len, "%.100s:%d answers \"%.100s\", not incarnation %" PRId64, addr, port,
                 line, inc);
    *verdict = RDZV_PROBE_DEAD;
    return -1;
}

rdzv_probe_verdict rdzv_probe_check(const char *addr, int port, const char *node, int64_t inc,
                                    int timeout_ms, char *why, size_t len)
{
    rdzv_probe_verdict v;
    int fd = rdzv_probe_hold(addr, port, node, inc, timeout_ms, &v, why, len);
    if (fd >= 0) close(fd);
    return v;
}
