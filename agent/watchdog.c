/* watchdog.c: the progress watchdog (see watchdog.h).
 *
 * The agent already hears every worker on its control channel; the
 * watchdog only keeps two times per worker (last progress, last heard)
 * and compares them with one bound. Waiting on peers is not
 * watched: a collective or a rebuild has the worker's own deadline
 * (--comm-timeout-ms), and a peer that is hung is its own agent's to kill,
 * so the survivors are never blamed for it. A silent process (stopped,
 * wedged) is caught in any phase, since a worker that beats says something
 * every CTL_HEARTBEAT_MS whatever its main thread does.
 */
#include "watchdog.h"

#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>

double agent_watchdog_bound(const agent_watchdog *wd)
{
    if (wd->fixed_s > 0) return wd->fixed_s;
    double grown = AGENT_HANG_FACTOR * wd->longest_s;
    return grown > AGENT_HANG_FLOOR_S ? grown : AGENT_HANG_FLOOR_S;
}

static int local_phase(const agent_worker *w)
{
    return !ctl_phase_waits(w->phase);
}

/* A stretch of local work ended at now: the auto bound learns from it. */
static void stretch_ended(agent_watchdog *wd, const agent_worker *w, double now)
{
    if (!w->watched || !local_phase(w)) return;
    double s = now - w->progress_at;
    if (s > wd->longest_s) wd->longest_s = s;
}

void agent_watchdog_heard(agent_watchdog *wd, agent_worker *w, const ctl_msg *m, double now)
{
    w->heard_at = now;
    if (m->type == CTL_STEP) {
        if (w->watched && m->step == w->step) return;
        stretch_ended(wd, w, now);
        w->watched = 1;
        w->progress_at = now;
    } else if (m->type == CTL_PHASE) {
        w->beats = 1;
        if (strcmp(w->phase, m->phase) == 0) return; /* a heartbeat */
        stretch_ended(wd, w, now);
        snprintf(w->phase, sizeof(w->phase), "%s", m->phase);
        w->progress_at = now;
    }
}

int agent_watchdog_hung(const agent_watchdog *wd, agent_worker *w, double now)
{
    if (!w->watched || w->exited || w->hung[0]) return 0;
    double bound = agent_watchdog_bound(wd);
    const char *phase = w->phase[0] ? w->phase : "compute";
    if (now - w->heard_at > bound) {
        snprintf(w->hung, sizeof(w->hung),
                 "hung: silent for %.1f s (--hang-timeout %.0f s) in phase %s after step %lld",
                 now - w->heard_at, bound, phase, (long long)w->step);
        return 1;
    }
    if (local_phase(w) && now - w->progress_at > bound) {
        snprintf(w->hung, sizeof(w->hung),
                 "hung: no progress for %.1f s (--hang-timeout %.0f s) in phase %s after step "
                 "%lld",
                 now - w->progress_at, bound, phase, (long long)w->step);
        return 1;
    }
    return 0;
}

int agent_watchdog_silent(agent_worker *w, double now)
{
    if (!w->watched || !w->beats || w->exited || w->hung[0]) return 0;
    if ((now - w->heard_at) * 1000.0 <= CTL_SILENT_MS) return 0;
    snprintf(w->hung, sizeof(w->hung),
             "hung: silent for %.1f s (a worker that beats says something every %d ms) in "
             "phase %s after step %lld: not kept for the next round",
             now - w->heard_at, CTL_HEARTBEAT_MS, w->phase[0] ? w->phase : "compute",
             (long long)w->step);
    return 1;
}

/* The kernel's word on the process: its state letter and where it sleeps. */
static void proc_state(pid_t pid, char *out, size_t len)
{
    char path[64], buf[512] = "", wchan[64] = "";
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (f) {
        size_t n = fread(buf, 1, sizeof(buf) - 1, f);
        buf[n] = 0;
        fclose(f);
    }
    snprintf(path, sizeof(path), "/proc/%d/wchan", (int)pid);
    f = fopen(path, "r");
    if (f) {
        size_t n = fread(wchan, 1, sizeof(wchan) - 1, f);
        wchan[n] = 0;
        fclose(f);
    }
    const char *paren = strrchr(buf, ')'); /* the command name may hold anything */
    char state = paren && paren[1] == ' ' ? paren[2] : '?';
    snprintf(out, len, "process state %c%s%s", state, wchan[0] && strcmp(wchan, "0") ? ", in " : "",
             wchan[0] && strcmp(wchan, "0") ? wchan : "");
}

void agent_watchdog_kill(agent_watchdog *wd, agent_worker *w, const dlog *lg)
{
    char st[128];
    proc_state(w->pid, st, sizeof(st));
    dlog_warn(lg, "worker_hung", "worker rank %d (pid %d) %s; %s; killing it", w->rank, (int)w->pid,
              w->hung, st);
    wd->hangs++;
    w->sent |= 1u << SIGKILL;
    kill(-w->pid, SIGKILL);
}

double agent_watchdog_next(const agent_watchdog *wd, const agent_workers *ws)
{
    double bound = agent_watchdog_bound(wd), next = 0;
    for (int i = 0; ws->w && i < ws->n; i++) {
        const agent_worker *w = &ws->w[i];
        if (!w->watched || w->exited || w->hung[0]) continue;
        double t = w->heard_at + bound;
        if (local_phase(w) && w->progress_at + bound < t) t = w->progress_at + bound;
        if (next == 0 || t < next) next = t;
    }
    return next;
}
