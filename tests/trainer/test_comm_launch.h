/* test_comm_launch.h: run one process per rank for the collectives tests.
 *
 * tc_spawn() forks `world` children, each running fn(rank, arg) and exiting
 * with its return value; tc_wait() collects them with a deadline
 * (th_wait_all: stragglers are killed, so a hanging collective fails the test instead of hanging
 * it); tc_run() is the two together. The ring is bootstrapped either through a real round store in
 * etcd (tc_group.etcd set) or, for tests of the ring core alone, over socketpairs made before the
 * fork. A tc_shared block in shared memory lets ranks report results and times back to the parent.
 */
#ifndef DUCTILE_TEST_COMM_LAUNCH_H
#define DUCTILE_TEST_COMM_LAUNCH_H

#include <stdint.h>
#include <sys/types.h>

#include "ductile/clock.h"
#include "ductile/comm.h"
#include "th_proc.h"

#define TC_MAX_RANKS 16

typedef struct tc_shared {
    volatile int progress[TC_MAX_RANKS];  /* collectives completed, per rank */
    volatile int err[TC_MAX_RANKS];       /* the error a rank ended with */
    volatile int64_t t_err[TC_MAX_RANKS]; /* when (mono_now_ms) it came back */
    volatile int64_t t_event;             /* when the parent killed/stopped a rank */
    volatile int arrived;                 /* barrier test counter */
} tc_shared;

typedef struct tc_group {
    int world;
    const char *etcd; /* endpoint of the store's etcd, or NULL for socketpairs */
    char job[64];
    int64_t round;
    int timeout_ms;
    size_t chunk_bytes;
    int nccl;  /* tc_connect builds NCCL communicators (device 0) instead of rings */
    int shm;   /* tc_connect builds shared-memory communicators (comm_cpu_init) */
    int hosts; /* with shm: rank r says it is on host r % hosts (comm_config.host_id) */
    unsigned ring_ranks; /* with shm: rank r forces the ring when bit r is set, the rest auto */
    unsigned shm_ranks;  /* with shm and hosts: rank r forces shm when bit r is set, the rest auto */
    char msg[COMM_MSG_MAX]; /* in a child: why its last tc_connect failed */
    pid_t pids[TC_MAX_RANKS];
    int pairs[TC_MAX_RANKS][2]; /* edge r: [0] is rank r's right, [1] rank r+1's left */
    tc_shared *shared;
} tc_group;

typedef int (*tc_rank_fn)(tc_group *g, int rank, void *arg);

/* Makes the shared block; 0 or -1. */
int tc_group_init(tc_group *g, int world, const char *etcd, const char *job, int64_t round);
/* tc_group_init for a job of its own, "PREFIX-PID-N" (N counts the groups
 * made in this process, so ring keys never collide), with round 1 made
 * current in etcd's store when etcd is set. 0 or -1 (said on stderr). */
int tc_group_open(tc_group *g, int world, const char *etcd, const char *prefix);
void tc_group_free(tc_group *g);

/* In a child: builds this rank's comm (store or socketpairs). */
comm_err tc_connect(tc_group *g, int rank, comm **out);
/* tc_connect, or the rank says why and exits with 2. */
comm *tc_connect_or_exit(tc_group *g, int rank);

int tc_spawn(tc_group *g, tc_rank_fn fn, void *arg);
/* Waits for all ranks; returns the number that did not exit 0 in time
 * (those are SIGKILLed). status[r] (may be NULL) gets the wait status. */
int tc_wait(tc_group *g, int timeout_s, int *status);
/* tc_spawn then tc_wait: the number of ranks that failed, all of them when
 * the spawn did. */
int tc_run(tc_group *g, tc_rank_fn fn, void *arg, int timeout_s);

/* Makes `round` the job's current round in the store's etcd (writes the
 * epoch key with etcdctl). 0 or -1. */
int tc_make_round_current(const char *etcd, const char *job, int64_t round);

#endif
