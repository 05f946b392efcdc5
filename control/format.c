/* format.c: the sending side of the control protocol (ductile/control.h):
 * one ctl_msg in, one line with its '\n' out.
 *
 * The formatter refuses what its parser (parse.c) would refuse rather than
 * put it on the wire: a bad phase name, a REASON with a line break, a
 * negative sample count, a loss that is not finite, a line too long.
 */
#include "ductile/control.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

/* `step K [samples N] [loss L]`; -1 when a field is invalid. */
static int ctl_format_step(const ctl_msg *m, char *out, size_t len)
{
    char samples[40] = "", loss[48] = "";
    if (m->has_samples) {
        if (m->samples < 0) return -1;
        snprintf(samples, sizeof(samples), " samples %" PRId64, m->samples);
    }
    if (m->has_loss) {
        if (!isfinite(m->loss)) return -1;
        snprintf(loss, sizeof(loss), " loss %.9g", m->loss);
    }
    return snprintf(out, len, "step %" PRId64 "%s%s\n", m->step, samples, loss);
}

/* `hello VERSION [inplace|restart]`; -1 when VERSION or the mode is invalid. */
static int ctl_format_hello(const ctl_msg *m, char *out, size_t len)
{
    static const char *const modes[] = {
        [CTL_MODE_NONE] = "", [CTL_MODE_INPLACE] = " inplace", [CTL_MODE_RESTART] = " restart"};
    if (m->version < 1 || m->mode < CTL_MODE_NONE || m->mode > CTL_MODE_RESTART) return -1;
    return snprintf(out, len, "hello %d%s\n", m->version, modes[m->mode]);
}

int ctl_format(const ctl_msg *m, char *out, size_t len)
{
    int n = -1;
    switch (m->type) {
    case CTL_ROUND:
        n = snprintf(out, len, "round %" PRId64 " %d %d %d %d %d %" PRId64 " %s %d %s\n", m->round,
                     m->rank, m->world_size, m->local_rank, m->group_rank, m->group_world_size,
                     m->restarts, m->master_addr, m->master_port, m->store_prefix);
        break;
    case CTL_ABORT:
        n = snprintf(out, len, "abort %" PRId64 " %s\n", m->round,
                     m->graceful ? "graceful" : "lost");
        break;
    case CTL_STOP:
        n = snprintf(out, len, "stop\n");
        break;
    case CTL_READY:
        n = snprintf(out, len, "ready\n");
        break;
    case CTL_HELLO:
        n = ctl_format_hello(m, out, len);
        break;
    case CTL_STEP:
        n = ctl_format_step(m, out, len);
        break;
    case CTL_PHASE:
        if (!ctl_phase_valid(m->phase)) return -1;
        n = snprintf(out, len, "phase %s\n", m->phase);
        break;
    case CTL_FAILED:
        if (strchr(m->reason, '\n')) return -1;
        n = snprintf(out, len, "failed %s\n", m->reason);
        break;
    case CTL_PEER_LOST:
        if (strchr(m->reason, '\n')) return -1;
        n = snprintf(out, len, "peer_lost %" PRId64 " %s\n", m->round, m->reason);
        break;
    default:
        return -1;
    }
    if (n < 0 || (size_t)n >= len || n > CTL_MAX_LINE) return -1;
    return n;
}
