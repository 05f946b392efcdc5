/* th_netns.c: a child in a network namespace of its own (see th_netns.h).
 *
 * The handshake is two pipes of one byte each: "up" says whether unshare()
 * worked, "go" that the veth pairs exist. Links are set with `ip`, through
 * the shell: simple, and what an engineer would type to debug it; netlink
 * would save the processes.
 */
#include "th_netns.h"

#include "th_proc.h"

#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <sys/prctl.h>
#include <unistd.h>

static void netns_child(int up_fd, int go_fd, void (*child)(void *), void *arg)
{
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* the namespace goes with the test */
    char ok = unshare(CLONE_NEWNET) == 0;
    if (write(up_fd, &ok, 1) != 1 || !ok) _exit(TH_SKIP);
    close(up_fd);
    if (read(go_fd, &ok, 1) != 1) _exit(1);
    close(go_fd);
    child(arg);
    _exit(127);
}

int th_netns_fork(th_netns *n, void (*child)(void *arg), void *arg)
{
    int up[2], go[2];
    n->pid = 0;
    n->go_fd = -1;
    if (pipe(up) != 0) return -1;
    if (pipe(go) != 0) {
        close(up[0]);
        close(up[1]);
        return -1;
    }
    fflush(NULL);
    n->pid = fork();
    if (n->pid == 0) {
        close(up[0]);
        close(go[1]);
        netns_child(up[1], go[0], child, arg);
    }
    close(up[1]);
    close(go[0]);
    char ok = 0;
    int got = n->pid > 0 ? (int)read(up[0], &ok, 1) : -1;
    close(up[0]);
    n->go_fd = go[1];
    if (got == 1 && ok) return 0;
    close(go[1]);
    n->go_fd = -1;
    if (n->pid < 0) {
        n->pid = 0;
        return -1;
    }
    fprintf(stderr, "cannot make a network namespace\n");
    th_kill(&n->pid);
    return TH_SKIP;
}

int th_netns_veth(const th_netns *n, const char *host, const char *peer, const char *host_cidr)
{
    if (th_sh("ip link add %s type veth peer name %s netns %d", host, peer, (int)n->pid) != 0 ||
        th_link_up(host, host_cidr) != 0) {
        fprintf(stderr, "cannot make veth pair %s-%s\n", host, peer);
        return TH_SKIP;
    }
    return 0;
}

int th_netns_go(th_netns *n)
{
    char ok = 1;
    int rc = n->go_fd >= 0 && write(n->go_fd, &ok, 1) == 1 ? 0 : -1;
    if (n->go_fd >= 0) close(n->go_fd);
    n->go_fd = -1;
    return rc;
}

void th_netns_kill(th_netns *n)
{
    if (n->go_fd >= 0) close(n->go_fd);
    n->go_fd = -1;
    th_kill(&n->pid);
}

int th_link_up(const char *dev, const char *cidr)
{
    return th_sh("ip addr add %s dev %s && ip link set %s up", cidr, dev, dev) == 0 ? 0 : -1;
}

void th_link_del(const char *dev)
{
    if (dev[0]) th_sh("ip link del %s 2>/dev/null", dev);
}

int th_netns_pick_net(const char *prefix)
{
    for (int k = 0; k < 250; k++) {
        int n = 1 + (getpid() + k) % 250;
        char cmd[96], line[256];
        snprintf(cmd, sizeof(cmd), "ip -o addr show to %s.%d.0/24", prefix, n);
        FILE *p = popen(cmd, "r");
        if (!p) return -1;
        int used = fgets(line, sizeof(line), p) != NULL;
        if (pclose(p) != 0) return -1;
        if (!used) return n;
    }
    return -1;
}
