/* th_netns.h: a child process in a network namespace of its own, wired to
 * the test's namespace by veth pairs, for partition tests.
 *
 * The namespace has no name: the child makes it (unshare), so it and the
 * veth pairs in it are gone when the child dies, which it does with the
 * test. The child waits on a pipe until the test has made the pairs (they
 * need its pid), then sets its own ends up and execs what it runs there.
 * Making namespaces and veth pairs needs root; where it cannot be done the
 * calls say TH_SKIP, for a test that then exits 77 (skipped).
 */
#ifndef DUCTILE_TEST_TH_NETNS_H
#define DUCTILE_TEST_TH_NETNS_H

#include <sys/types.h>

#define TH_SKIP 77

typedef struct th_netns {
    pid_t pid; /* the child in the namespace; 0 when there is none */
    int go_fd; /* the test's end of the pipe the child waits on; -1 once closed */
} th_netns;

/* Forks a child that enters a new network namespace and waits there for
 * th_netns_go(); then it runs child(arg), which does not return (it sets its
 * links up and execs). 0; TH_SKIP when no namespace could be made (the child
 * is reaped); -1 when the fork failed. */
int th_netns_fork(th_netns *n, void (*child)(void *arg), void *arg);
/* A veth pair: `host` in the test's namespace with address host_cidr
 * ("10.214.3.1/30"), up; `peer` moved into n's namespace, for the child to
 * set up. 0, or TH_SKIP when the pair cannot be made. */
int th_netns_veth(const th_netns *n, const char *host, const char *peer, const char *host_cidr);
/* Lets the child go on; 0 or -1. */
int th_netns_go(th_netns *n);
/* Kills the child (and so its namespace) instead. */
void th_netns_kill(th_netns *n);

/* Gives dev the address cidr and sets it up (from either side). 0 or -1. */
int th_link_up(const char *dev, const char *cidr);
/* Deletes a link that may be there; for a start that failed half-way. */
void th_link_del(const char *dev);
/* The third octet of a /24 in PREFIX.0.0/16 (prefix "10.214") that no
 * interface uses yet, or -1 (also without `ip`). */
int th_netns_pick_net(const char *prefix);

#endif
