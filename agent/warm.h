/* warm.h: warm spare interpreters for Python workers (warm.c).
 *
 * A Python worker run by restart spends seconds of every restart importing
 * its libraries (torch). A warm spare is a Python started ahead of time,
 * per local rank, that has already imported them and waits on a pipe (its
 * "go" pipe, fd 4) for the worker's environment. A launch that finds one
 * alive writes the round's environment to it and adopts its process and
 * pipes as that rank's worker; the stub then runs the script or module as
 * `python SCRIPT` or `python -m MODULE` would.
 */
#ifndef DUCTILE_AGENT_WARM_H
#define DUCTILE_AGENT_WARM_H

#include "workers.h"

#include "ductile/log.h"

#include <stddef.h>
#include <sys/types.h>

typedef struct agent_spare {
    agent_worker w; /* its process and pipes, as a worker's; w.pid 0: none */
    int go_fd;      /* the write end of its go pipe; -1 when none */
    int starts;     /* started since the last launch: one start, one restart */
} agent_spare;

typedef struct agent_warm {
    char **argv;         /* a spare's command; NULL: no spares */
    const char *modules; /* comma list to import */
    int local_world_size;
    int n; /* one slot per local rank */
    agent_spare *s;
} agent_warm;

/* Seconds after a launch before the next restart's spares start: the new
 * workers start without an import of torch beside them on their cores. */
#define AGENT_WARM_REFILL_S 3.0

/* Decides whether the worker command cmd gets spares (preload as
 * --preload takes it) and how they start. 0: wm is ready, with
 * wm->argv NULL and why saying why when there are none; -1: out of memory.
 * cmd and preload must outlive wm. */
int agent_warm_init(agent_warm *wm, char *const cmd[], const char *preload, int inplace,
                    int local_world_size, char *why, size_t len);
/* Starts a spare for every local rank that has none and has not used its
 * start and restart since the last launch. */
void agent_warm_fill(agent_warm *wm, const dlog *lg);
/* A round's workers were launched: every rank may start a spare again. */
void agent_warm_new_round(agent_warm *wm);
/* What a launch adopts the spares of wm through (agent_workers_spawn): its
 * take makes local rank lr's spare the worker w (zeroed, then its process
 * and pipes) of the round env describes: 0. -1 when it has none alive, or
 * the environment could not be handed over (the spare is then killed). */
agent_adopt agent_warm_adopt(agent_warm *wm);
/* 1 when pid was a spare (now reaped and its slot empty), else 0. */
int agent_warm_reaped(agent_warm *wm, pid_t pid, int status, const dlog *lg);
/* Kills and reaps every spare, closes their pipes, frees wm. */
void agent_warm_free(agent_warm *wm);

#endif
