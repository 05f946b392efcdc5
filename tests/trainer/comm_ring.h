/* comm_ring.h: what test_comm_ring's files share (tests/trainer, private).
 *
 * The transport the run chose (--pairs, --shm, --hier: the globals main
 * sets) and group_open, which makes a case's group on it; the collective
 * and failure cases are in test_comm_ring.c, the bootstrap, world-size-1
 * and shared-memory-only cases in comm_ring_boot.c.
 */
#ifndef DUCTILE_TEST_COMM_RING_H
#define DUCTILE_TEST_COMM_RING_H

#include "test_comm_launch.h"
#include "test_etcd.h"
#include "th_scenario.h"

#include "ductile/comm.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <stddef.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

extern const char *g_etcd; /* NULL: socketpairs */
extern int g_shm;          /* --shm or --hier */
extern int g_hosts;        /* --hier: 2 */

/* test_comm_ring.c */
/* A group for one case: a job of its own, round 1 current. A group that
 * cannot be made counts as a failed check. */
int group_open(tc_group *g, int world);

/* comm_ring_boot.c: the cases of bootstrap, world size 1 and shared memory only */
void test_stray(void);
void test_fenced(void);
void test_single(void);
void test_rebuild(void);
void test_mixed(void);
void test_shm_elsewhere(void);

#endif
