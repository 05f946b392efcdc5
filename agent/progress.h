/* progress.h: what a worker's `step` reports add up to (progress.c): its
 * samples counter, its samples per second and its last loss, for /metrics. */
#ifndef DUCTILE_AGENT_PROGRESS_H
#define DUCTILE_AGENT_PROGRESS_H

#include "ductile/control.h"

#include <stdint.h>

/* samples/s is taken over the step reports of the last AGENT_RATE_WINDOW_S
 * seconds, at most AGENT_RATE_POINTS of them. */
#define AGENT_RATE_WINDOW_S 30.0
#define AGENT_RATE_POINTS 16

typedef struct agent_progress {
    int64_t samples_total; /* increases of the reported samples, summed */
    int64_t reported;      /* the last reported samples, -1 before one */
    int has_loss;
    double loss;    /* the last reported loss */
    double step_at; /* mono_now_s() of the last new step, 0 before one */
    int npoints, next;
    struct {
        double at;
        int64_t total;
    } points[AGENT_RATE_POINTS]; /* a ring: (time, samples_total) per report */
} agent_progress;

void agent_progress_init(agent_progress *p);
/* Takes one `step` message heard at now (mono_now_s()). */
void agent_progress_step(agent_progress *p, const ctl_msg *m, double now);
/* Samples per second over the window ending at now; 0 with fewer than two
 * reports in it. */
double agent_progress_rate(const agent_progress *p, double now);

#endif
