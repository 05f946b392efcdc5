/* say.c: how the trainer speaks (trainer.h): rank 0's progress lines on
 * stdout, any rank's errors on stderr, and a failure's reason kept for the
 * report to the agent. Every file of the trainer calls these; they call
 * nothing of the trainer's.
 */
#include <stdarg.h>
#include <stdio.h>

#include "trainer.h"

void trainer_say(const trainer *t, const char *fmt, ...)
{
    if (t->g.rank != 0) return;
    va_list ap;
    va_start(ap, fmt);
    dlog_vwrite(&t->out, DLOG_INFO, NULL, fmt, ap);
    va_end(ap);
}

int trainer_error(const trainer *t, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    dlog_vwrite(&t->log, DLOG_ERROR, NULL, fmt, ap);
    va_end(ap);
    return -1;
}

int trainer_fail(trainer *t, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->why, sizeof(t->why), fmt, ap);
    va_end(ap);
    return trainer_error(t, "%s", t->why);
}
