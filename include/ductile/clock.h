/* clock.h: the one monotonic clock of ductile (header only).
 *
 * Every deadline in the agent, the trainer and the libraries is measured on
 * CLOCK_MONOTONIC, so a wall-clock step (NTP, a VM resumed) never ends a
 * wait early or stretches it. Condition variables that wait with a deadline
 * are made with mono_cond_init() so pthread_cond_timedwait() reads the same
 * clock as mono_deadline().
 */
#ifndef DUCTILE_CLOCK_H
#define DUCTILE_CLOCK_H

#include <pthread.h>
#include <stdint.h>
#include <time.h>

/* Monotonic milliseconds (arbitrary origin). */
static inline int64_t mono_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Monotonic seconds, with nanosecond resolution, for durations and rates. */
static inline double mono_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* The absolute monotonic time ms from now, for pthread_cond_timedwait() on
 * a condition made by mono_cond_init(). */
static inline struct timespec mono_deadline(int64_t ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += (time_t)(ms / 1000);
    ts.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec += 1;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

/* A condition variable whose timed waits use the monotonic clock. */
static inline int mono_cond_init(pthread_cond_t *cv)
{
    pthread_condattr_t ca;
    if (pthread_condattr_init(&ca) != 0) return -1;
    int rc = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    if (rc == 0) rc = pthread_cond_init(cv, &ca);
    pthread_condattr_destroy(&ca);
    return rc == 0 ? 0 : -1;
}

#endif
