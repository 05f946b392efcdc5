/* test_rdzv_probe: the liveness probe's verdicts (probe.c), without etcd.
 *
 * Only "dead" lets a new agent take a registration over, so each way a
 * prober can see a port is checked for its verdict: the incarnation
 * answering (alive), another node id or incarnation answering, a port
 * closed without a line, a port nobody holds (dead), a port that accepts
 * but never answers, and a registration without a probe (unknown). White
 * box: it includes the library's private header.
 */
#include "check.h"
#include "rdzv_internal.h"
#include "th_proc.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define T 2000

static rdzv_probe_verdict ask(int port, const char *node, int64_t inc, int timeout_ms)
{
    char why[RDZV_MSG_MAX] = "";
    rdzv_probe_verdict v =
        rdzv_probe_check("127.0.0.1", port, node, inc, timeout_ms, why, sizeof(why));
    printf("port %d, %s incarnation %lld: %s (%s)\n", port, node, (long long)inc,
           v == RDZV_PROBE_ALIVE  ? "alive"
           : v == RDZV_PROBE_DEAD ? "dead"
                                  : "unknown",
           why);
    return v;
}

/* A loopback listener that never accepts; *port receives its port. */
static int silent_listener(int *port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof(sa);
    if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sl) != 0 || listen(fd, 4) != 0 ||
        getsockname(fd, (struct sockaddr *)&sa, &sl) != 0)
        return -1;
    *port = ntohs(sa.sin_port);
    return fd;
}

int main(void)
{
    rdzv_probe *p = NULL;
    CHECK_OR_EXIT(rdzv_probe_start("127.0.0.1", "node-a", &p) == RDZV_OK && p, "start");
    int port = rdzv_probe_port(p);
    CHECK_OR_EXIT(port > 0, "port %d", port);
    rdzv_probe_set_incarnation(p, 3);
    CHECK(ask(port, "node-a", 3, T) == RDZV_PROBE_ALIVE, "the incarnation answers");
    CHECK(ask(port, "node-a", 2, T) == RDZV_PROBE_DEAD, "an older incarnation is gone");
    CHECK(ask(port, "node-b", 3, T) == RDZV_PROBE_DEAD, "another node id holds the port");
    rdzv_probe_set_incarnation(p, 4);
    CHECK(ask(port, "node-a", 4, T) == RDZV_PROBE_ALIVE, "the new incarnation answers");
    rdzv_probe_stop(p);
    CHECK(ask(port, "node-a", 4, T) == RDZV_PROBE_DEAD, "a port nobody holds refuses");

    /* Accepted by the kernel, never answered: a stopped process. */
    int sport = 0;
    int sfd = silent_listener(&sport);
    CHECK_OR_EXIT(sfd >= 0, "listener");
    double t0 = mono_now_s();
    CHECK(ask(sport, "node-a", 1, 300) == RDZV_PROBE_UNKNOWN, "silence is not death");
    CHECK(mono_now_s() - t0 < 2.0, "the deadline holds");
    close(sfd);

    /* Closed without a line: whatever holds the port is not the node. */
    sfd = silent_listener(&sport);
    CHECK_OR_EXIT(sfd >= 0, "listener");
    pid_t child = fork();
    CHECK_OR_EXIT(child >= 0, "fork");
    if (child == 0) {
        int c = accept(sfd, NULL, NULL);
        if (c >= 0) close(c);
        _exit(0);
    }
    CHECK(ask(sport, "node-a", 1, T) == RDZV_PROBE_DEAD, "closed without a line");
    if (th_wait(&child, 5000, NULL) != 1) th_kill(&child);
    close(sfd);

    CHECK(ask(0, "node-a", 1, T) == RDZV_PROBE_UNKNOWN, "no probe port");
    char why[RDZV_MSG_MAX];
    CHECK(rdzv_probe_check("", 1, "node-a", 1, T, why, sizeof(why)) == RDZV_PROBE_UNKNOWN,
          "no address");
    /* No usable address: no responder, and no error either. */
    CHECK(rdzv_probe_start("", "node-a", &p) == RDZV_OK && p == NULL, "no address, no probe");
    return check_failures() != 0;
}
