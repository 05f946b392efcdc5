/* watchdog.h: the progress watchdog (watchdog.c).
 *
 * A worker that has said `step` is watched: it must either make progress in
 * local work (a new step, or a new phase) within the bound, or be waiting on
 * other processes (phase comm or rebuild), whose own deadlines bound it; and
 * it must not fall silent. A worker past the bound is hung: its agent logs
 * one line saying where it stood and kills it, and its end is this node's
 * first-hand failure (control.h, docs/design.md: the progress watchdog).
 */
#ifndef DUCTILE_AGENT_WATCHDOG_H
#define DUCTILE_AGENT_WATCHDOG_H

#include "workers.h"

#include <stddef.h>

/* The bound --hang-timeout auto starts from, and how many times the longest
 * local stretch seen it grows to. */
#define AGENT_HANG_FLOOR_S 120.0
#define AGENT_HANG_FACTOR 10.0

typedef struct agent_watchdog {
    double fixed_s;   /* --hang-timeout SECONDS; 0 for auto */
    double longest_s; /* longest local stretch any worker of this node took */
    int64_t hangs;    /* workers this node's watchdog killed */
} agent_watchdog;

/* The bound in force now. */
double agent_watchdog_bound(const agent_watchdog *wd);
/* Notes what a `step` or `phase` message says of the worker's progress;
 * every message, whatever its type, counts as heard. A worker is watched
 * from its first `step` on (a new worker's fields are all zero). */
void agent_watchdog_heard(agent_watchdog *wd, agent_worker *w, const ctl_msg *m, double now);
/* 1 when w is hung now, with why it is in w->hung. */
int agent_watchdog_hung(const agent_watchdog *wd, agent_worker *w, double now);
/* 1 when w must not be kept for a new round: it beats but has been silent
 * for CTL_SILENT_MS (stopped or wedged); why it is in w->hung. */
int agent_watchdog_silent(agent_worker *w, double now);
/* Logs where w stood (its phase, step, and the kernel's state of its
 * process) and SIGKILLs its process group. */
void agent_watchdog_kill(agent_watchdog *wd, agent_worker *w, const dlog *lg);
/* The earliest time a watched worker can become hung (0: none watched). */
double agent_watchdog_next(const agent_watchdog *wd, const agent_workers *ws);

#endif
