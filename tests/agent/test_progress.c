/* test_progress.c: what the agent makes of `step` reports (agent/progress.c).
 *
 * The samples counter keeps only increases (a baseline first, a count that
 * went back is a new baseline), the rate is a difference over the reports
 * of the last AGENT_RATE_WINDOW_S, and the loss is the last one reported.
 */
#include "check.h"
#include "progress.h"

static ctl_msg step(int64_t k, int64_t samples, int has_loss, double loss)
{
    ctl_msg m = {.type = CTL_STEP, .step = k, .has_samples = samples >= 0, .samples = samples};
    m.has_loss = has_loss;
    m.loss = loss;
    return m;
}

int main(void)
{
    agent_progress p;
    agent_progress_init(&p);
    CHECK(agent_progress_rate(&p, 100) == 0 && p.samples_total == 0 && !p.has_loss);

    /* The first report is the baseline: a worker resumed at 5000 samples
     * has not processed them in this process. */
    ctl_msg m = step(1, 5000, 1, 2.5);
    agent_progress_step(&p, &m, 100);
    CHECK(p.samples_total == 0 && p.has_loss && p.loss == 2.5 && p.step_at == 100);
    CHECK(agent_progress_rate(&p, 100) == 0, "one report: no rate");

    /* 64 samples a second, reports skipped or not. */
    m = step(2, 5064, 0, 0);
    agent_progress_step(&p, &m, 101);
    m = step(5, 5256, 1, 1.5);
    agent_progress_step(&p, &m, 104);
    CHECK(p.samples_total == 256, "total %lld", (long long)p.samples_total);
    CHECK(agent_progress_rate(&p, 104.5) == 64.0, "rate %f", agent_progress_rate(&p, 104.5));
    CHECK(p.loss == 1.5, "a step without loss keeps the last one");

    /* A count that goes back (the worker restarted its own) adds nothing. */
    m = step(6, 100, 0, 0);
    agent_progress_step(&p, &m, 105);
    CHECK(p.samples_total == 256);
    m = step(7, 164, 0, 0);
    agent_progress_step(&p, &m, 106);
    CHECK(p.samples_total == 320);

    /* Reports out of the window do not count: a worker that stopped
     * stepping falls to 0. */
    CHECK(agent_progress_rate(&p, 106 + AGENT_RATE_WINDOW_S + 1) == 0);
    CHECK(agent_progress_rate(&p, 101 + AGENT_RATE_WINDOW_S) > 0);

    /* A step without samples moves the step time, not the counter. */
    m = step(8, -1, 0, 0);
    agent_progress_step(&p, &m, 107);
    CHECK(p.samples_total == 320 && p.step_at == 107);

    /* The ring keeps the last AGENT_RATE_POINTS reports: a report every
     * 0.1 s, one sample each, and a burst long ago that must not count. */
    agent_progress_init(&p);
    m = step(0, 0, 0, 0);
    agent_progress_step(&p, &m, 190);
    m = step(1, 1000000, 0, 0);
    agent_progress_step(&p, &m, 190.5);
    for (int i = 1; i <= 3 * AGENT_RATE_POINTS; i++) {
        m = step(1 + i, 1000000 + i, 0, 0);
        agent_progress_step(&p, &m, 200 + 0.1 * i);
    }
    double r = agent_progress_rate(&p, 205);
    CHECK(r > 9.99 && r < 10.01, "rate %f over the last %d reports", r, AGENT_RATE_POINTS);
    if (check_failures()) return 1;
    printf("ok progress\n");
    return 0;
}
