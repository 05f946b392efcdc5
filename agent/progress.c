/* progress.c: a worker's progress from its `step` lines (control.h).
 *
 * A worker says how many samples it has processed in all; the agent keeps
 * only the increases, so its counter never goes back (a worker that skips a
 * step loses nothing, a restarted one starts a new count from its first
 * report) and a rate is a difference over a short ring of recent reports.
 */
#include "progress.h"

#include <string.h>

void agent_progress_init(agent_progress *p)
{
    memset(p, 0, sizeof(*p));
    p->reported = -1;
}

void agent_progress_step(agent_progress *p, const ctl_msg *m, double now)
{
    p->step_at = now;
    if (m->has_loss) {
        p->has_loss = 1;
        p->loss = m->loss;
    }
    if (!m->has_samples) return;
    /* The first report is the baseline; a count that went back (a worker
     * that restarted its own) becomes the new baseline. */
    if (p->reported >= 0 && m->samples > p->reported) p->samples_total += m->samples - p->reported;
    p->reported = m->samples;
    p->points[p->next].at = now;
    p->points[p->next].total = p->samples_total;
    p->next = (p->next + 1) % AGENT_RATE_POINTS;
    if (p->npoints < AGENT_RATE_POINTS) p->npoints++;
}

double agent_progress_rate(const agent_progress *p, double now)
{
    int newest = -1, oldest = -1;
    for (int k = 0; k < p->npoints; k++) {
        int i = (p->next - 1 - k + 2 * AGENT_RATE_POINTS) % AGENT_RATE_POINTS;
        if (now - p->points[i].at > AGENT_RATE_WINDOW_S) break;
        if (newest < 0) newest = i;
        oldest = i;
    }
    if (newest < 0 || newest == oldest) return 0;
    double dt = p->points[newest].at - p->points[oldest].at;
    if (dt <= 0) return 0;
    return (double)(p->points[newest].total - p->points[oldest].total) / dt;
}
