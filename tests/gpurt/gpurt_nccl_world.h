/* gpurt_nccl_world.h: test_gpurt_nccl's world of child processes, one per rank (private).
 *
 * The parent forks a world (world_start), each child runs a rank_fn with
 * the unique id rank 0 made; the child notes how far it got and waits to be
 * told go, so the parent can kill or stop a rank in between; its exit
 * status says whether its checks passed. Also the ranks' small helpers:
 * device buffers, a comm brought up, a state waited for with a deadline.
 */
#ifndef DUCTILE_TEST_GPURT_NCCL_WORLD_H
#define DUCTILE_TEST_GPURT_NCCL_WORLD_H

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include "th_proc.h"
#include "th_scenario.h"
#include "rt.h"

#define MAX_RANKS 4
#define CHILD_DEADLINE_S 60
#define WAIT_MS 10000 /* for a state that must show up */
#define STILL_MS 1000 /* for one that must not */
#define NAP_NS 2000000L

/* CHECK_OR_RETURN for functions that return nothing. */
#define CHECK_OR_RETURN_VOID(cond, ...) CHECK_THEN_(cond, #cond, check_fail(); return, __VA_ARGS__)

/* ---- the parent's side: a world of child processes ---- */

typedef struct rank_ctx {
    int rank, nranks; /* this process's index and the process count */
    ncclUniqueId id;
    int note_fd, go_fd;
} rank_ctx;

/* A rank's body; returns 0 when its checks passed. */
typedef int (*rank_fn)(rank_ctx *c);

typedef struct world_spec {
    int n;
    rank_fn fn;
    const char *failpoints[MAX_RANKS]; /* DUCTILE_FAILPOINTS of each rank, or NULL */
    const char *peer_error;            /* DUCTILE_GPURT_PEER_ERROR of every rank, or NULL */
    int capture;                       /* stderr comes back in err[] */
} world_spec;

typedef struct world {
    int n;
    pid_t pid[MAX_RANKS];
    int note[MAX_RANKS], go[MAX_RANKS], errfd[MAX_RANKS]; /* the parent's ends, or -1 */
    int status[MAX_RANKS];
    char err[MAX_RANKS][4096];
    size_t errlen[MAX_RANKS];
} world;

typedef struct world_pipes {
    int id[MAX_RANKS][2], note[MAX_RANKS][2], go[MAX_RANKS][2], err[MAX_RANKS][2];
} world_pipes;

/* gpurt_nccl_world.c: the world, and the ranks' helpers */
void nap(void);
int read_within(int fd, void *buf, size_t n, int ms);
int write_all(int fd, const void *buf, size_t n);
int world_start(world *w, const world_spec *sp);
int world_note(world *w, int r, char want);
void world_go(world *w, int r);
void world_finish(world *w);
int exited(int status, int code);
int died_by(int status, int sig);
const char *how(int status);
void world_run_clean(const world_spec *sp);
void note(rank_ctx *c, char what);
void wait_go(rank_ctx *c);
void *dev_alloc(size_t bytes);
int to_dev(void *d, const void *h, size_t bytes);
int from_dev(void *h, const void *d, size_t bytes);
ncclResult_t settle(ncclComm_t comm, int ms);
int issued(ncclComm_t comm, ncclResult_t r);
ncclResult_t error_within(ncclComm_t comm, int ms);
int drained_within(cudaStream_t s, int ms);
ncclComm_t comm_up(const rank_ctx *c, int nranks, int rank, int blocking);

/* gpurt_nccl_faults.c: the fault cases (a peer killed or stopped, misuse, failpoints, bootstrap
 * refusals) */
void test_killed(void);
void test_killed_system(void);
void test_stopped(void);
void test_host_pointer(void);
void test_mismatch(void);
void test_failpoint_async(void);
void test_failpoints(void);
void test_arguments(void);
void test_duplicate_rank(void);
void test_wrong_id(void);

#endif
