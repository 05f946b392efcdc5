/* loop.c: the agent's one poll() loop and its deadlines.
 *
 * Everything the agent reacts to is a file descriptor in one poll(): a
 * signalfd (SIGTERM, SIGINT, SIGCHLD), the rendezvous library's event fd,
 * the answers of the tasks that talk to etcd (task.h: the MASTER_PORT
 * publish or wait, the failure report, the job's completion), and each
 * worker's stdout, stderr and control socket. Nothing blocks the loop:
 * every etcd call but the leave at exit runs on a task's thread, and every
 * wait has a deadline (the SIGKILL after a grace, the shutdown budget, a
 * hung worker, the warm spares' start), kept in the agent and turned into
 * the poll timeout here. Each pass ends with the deadlines checked and the
 * HTTP snapshot published.
 */
#include "agent_internal.h"

#include "ductile/clock.h"
#include "ductile/log.h"
#include "ductile/rdzv.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void on_signalfd(agent *a)
{
    struct signalfd_siginfo si;
    while (read(a->sigfd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
        if (si.ssi_signo == SIGTERM) begin_shutdown(a, "SIGTERM");
        if (si.ssi_signo == SIGINT) begin_shutdown(a, "SIGINT");
    }
    /* SIGCHLD coalesces: reap everything that has ended. */
    for (;;) {
        int st;
        pid_t pid = waitpid(-1, &st, WNOHANG);
        if (pid <= 0) break;
        on_reaped(a, pid, st);
    }
}

/* The progress watchdog: while workers train (or, in place, wait for a
 * round), a hung one is killed; its reaping ends the round as this node's
 * failure. */
static int watching(const agent *a)
{
    return a->state == AGENT_RUNNING || (a->state == AGENT_RDZV && a->o->inplace);
}

static void check_hung(agent *a, double now)
{
    if (!watching(a)) return;
    for (int i = 0; a->ws.w && i < a->ws.n; i++)
        if (agent_watchdog_hung(&a->wd, &a->ws.w[i], now))
            agent_watchdog_kill(&a->wd, &a->ws.w[i], &a->lg);
}

static void check_deadlines(agent *a)
{
    double now = mono_now_s();
    check_hung(a, now);
    if (a->kill_at > 0 && now >= a->kill_at) {
        a->kill_at = 0;
        if (workers_alive(a)) {
            for (int i = 0; i < a->ws.n; i++)
                if (!a->ws.w[i].exited)
                    dlog_warn(&a->lg, "worker_killed",
                              "worker rank %d did not stop in time: SIGKILL", a->ws.w[i].rank);
            agent_workers_signal(&a->ws, SIGKILL);
            a->give_up_at = now + 5.0;
        }
    }
    if (a->give_up_at > 0 && now >= a->give_up_at) {
        a->give_up_at = 0;
        if (a->state == AGENT_DRAINING && workers_alive(a)) {
            dlog_warn(&a->lg, "drain_timeout",
                      "workers still running after the job completed: "
                      "stopping them");
            stop_workers(a, a->o->stop_grace_ms);
        } else if (workers_alive(a)) {
            dlog_error(&a->lg, "workers_stuck", "%d workers did not exit after SIGKILL",
                       workers_alive(a));
            a->ws.alive = 0;
            on_workers_gone(a);
        }
    }
}

void publish(agent *a)
{
    if (!a->http) return;
    agent_snapshot s;
    memset(&s, 0, sizeof(s));
    s.round = a->round.number;
    s.members = a->in_round ? a->round.nmembers : 0;
    s.world_size = a->in_round ? a->round.world_size : 0;
    s.restarts = a->restarts;
    s.workers_running = workers_alive(a);
    s.rdzv_seconds = a->rz ? rdzv_seconds_in_rendezvous(a->rz) : 0;
    memcpy(s.changes, a->changes, sizeof(s.changes));
    s.ready = a->state == AGENT_RUNNING && a->in_round && workers_alive(a) == a->o->nproc;
    s.heartbeat = mono_now_s();
    s.hangs = a->wd.hangs;
    /* Prometheus wants wall-clock timestamps: the monotonic times of progress
     * are turned into Unix times here, for the page alone. */
    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    double unix_now = (double)wall.tv_sec + wall.tv_nsec / 1e9;
    for (int i = 0; a->ws.w && i < a->ws.n && s.nworkers < AGENT_SNAPSHOT_WORKERS; i++) {
        const agent_worker *w = &a->ws.w[i];
        if (w->exited) continue;
        agent_worker_snapshot *ws = &s.workers[s.nworkers++];
        ws->rank = w->rank;
        ws->local_rank = w->local_rank;
        ws->step = w->step;
        ws->progress_unix = w->progress_at > 0 ? unix_now - (s.heartbeat - w->progress_at) : 0;
        ws->step_unix = w->prog.step_at > 0 ? unix_now - (s.heartbeat - w->prog.step_at) : 0;
        ws->samples_total = w->prog.samples_total;
        ws->samples_per_second = agent_progress_rate(&w->prog, s.heartbeat);
        ws->has_loss = w->prog.has_loss;
        ws->loss = w->prog.loss;
        snprintf(ws->phase, sizeof(ws->phase), "%s", w->phase);
    }
    agent_http_publish(a->http, &s);
}

/* The loop's fixed poll slots; the workers' fds follow. */
enum { SLOT_SIGNAL, SLOT_RDZV, SLOT_MASTER, SLOT_REPORT, SLOT_FINISH, SLOT_WORKERS };

/* The tasks' answers, first: nothing handled before them in a pass can
 * have replaced the task a slot was polled for. */
static void on_task_answers(agent *a, const struct pollfd *pfd)
{
    if (pfd[SLOT_REPORT].revents && pfd[SLOT_REPORT].fd == a->report.fd && !a->done) on_report(a);
    if (pfd[SLOT_FINISH].revents && pfd[SLOT_FINISH].fd == a->finish.fd && !a->done) on_finish(a);
    if (pfd[SLOT_MASTER].revents && pfd[SLOT_MASTER].fd == a->master.task.fd && !a->done)
        on_master(a);
}

/* The fixed slots, always (fd -1 is ignored by poll), then every open fd
 * of every worker, whose owner[] it is; returns how many. */
static int poll_fill(agent *a, struct pollfd *pfd, agent_worker **owner)
{
    int n = 0;
    pfd[n++] = (struct pollfd){.fd = a->sigfd, .events = POLLIN};
    pfd[n++] = (struct pollfd){.fd = rdzv_fd(a->rz), .events = POLLIN};
    pfd[n++] = (struct pollfd){.fd = a->master.task.fd, .events = POLLIN};
    pfd[n++] = (struct pollfd){.fd = a->report.fd, .events = POLLIN};
    pfd[n++] = (struct pollfd){.fd = a->finish.fd, .events = POLLIN};
    for (int i = 0; a->ws.w && i < a->ws.n; i++) {
        agent_worker *w = &a->ws.w[i];
        int fds[3] = {w->out_fd, w->err_fd, w->ctl_fd};
        for (int j = 0; j < 3; j++) {
            if (fds[j] < 0) continue;
            owner[n] = w;
            pfd[n++] = (struct pollfd){.fd = fds[j], .events = POLLIN};
        }
    }
    return n;
}

/* The poll timeout in ms: up to the nearest deadline, a second at most. */
static int poll_timeout(const agent *a)
{
    double now = mono_now_s(), next = now + 1.0;
    if (a->kill_at > 0 && a->kill_at < next) next = a->kill_at;
    if (a->warm_at > 0 && a->warm_at < next) next = a->warm_at;
    if (a->give_up_at > 0 && a->give_up_at < next) next = a->give_up_at;
    double hang_at = watching(a) ? agent_watchdog_next(&a->wd, &a->ws) : 0;
    if (hang_at > 0 && hang_at < next) next = hang_at;
    return next > now ? (int)((next - now) * 1000.0) + 1 : 0;
}

/* The workers' readable fds, until something replaces the workers (gen,
 * taken before anything in this pass could) and owner[] goes stale. */
static void on_worker_fds(agent *a, const struct pollfd *pfd, agent_worker **owner, int n,
                          unsigned gen)
{
    for (int i = SLOT_WORKERS; i < n && !a->done; i++) {
        if (a->ws_gen != gen || !a->ws.w) break; /* owner[] is stale */
        if (!pfd[i].revents) continue;
        agent_worker *w = owner[i];
        if (pfd[i].fd == w->ctl_fd)
            agent_ctl_read(w, &a->lg, on_ctl, a);
        else if (pfd[i].fd == w->out_fd || pfd[i].fd == w->err_fd)
            agent_workers_read_output(&a->ws, w, pfd[i].fd);
        if (a->done) break;
    }
}

/* Every rendezvous event waiting; a driver that stopped ends the agent. */
static void on_rdzv_events(agent *a)
{
    rdzv_event ev;
    rdzv_err err = RDZV_OK;
    while (!a->done && (err = rdzv_next_event(a->rz, 0, &ev)) == RDZV_OK) {
        on_event(a, &ev);
        rdzv_event_free(&ev);
    }
    if (!a->done && err != RDZV_ERR_TIMEOUT) {
        /* The driver stopped without saying why: nothing more will come. */
        snprintf(a->why, sizeof(a->why), "rendezvous stopped: %s", rdzv_strerror(err));
        dlog_error(&a->lg, "rdzv_error", "%s", a->why);
        a->exit_after_stop = 1;
        if (a->state != AGENT_SHUTDOWN) a->state = AGENT_STOPPING;
        stop_workers(a, a->o->stop_grace_ms);
        if (!workers_alive(a)) agent_finish(a, 1, a->why);
    }
}

void run_loop(agent *a)
{
    int maxfds = SLOT_WORKERS + 3 * a->o->nproc;
    struct pollfd *pfd = calloc((size_t)maxfds, sizeof(*pfd));
    agent_worker **owner = calloc((size_t)maxfds, sizeof(*owner));
    if (!pfd || !owner) {
        free(pfd);
        free(owner);
        agent_finish(a, 1, "out of memory");
        return;
    }
    while (!a->done) {
        int n = poll_fill(a, pfd, owner);
        int got = poll(pfd, (nfds_t)n, poll_timeout(a));
        if (got < 0 && errno != EINTR) {
            agent_finish(a, 1, "poll failed");
            break;
        }
        if (a->warm_at > 0 && mono_now_s() >= a->warm_at) {
            a->warm_at = 0;
            if (spares_wanted(a)) agent_warm_fill(&a->warm, &a->lg);
        }
        if (got > 0) {
            unsigned gen = a->ws_gen; /* before anything may replace the workers */
            on_task_answers(a, pfd);
            on_worker_fds(a, pfd, owner, n, gen);
            if (pfd[SLOT_SIGNAL].revents) on_signalfd(a);
            if (pfd[SLOT_RDZV].revents) on_rdzv_events(a);
        }
        if (!a->done) check_deadlines(a);
        publish(a);
    }
    free(pfd);
    free(owner);
}
