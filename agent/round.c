/* round.c: the round state machine: what happens to the agent turned into
 * actions.
 *
 * Each handler here takes one thing that happened (a rendezvous event, a
 * worker's control message, the MASTER_PORT task's answer, a reaped
 * child, a signal), moves a->state (agent_internal.h draws the machine)
 * and starts what follows: a launch or a stop (launch.c), a report
 * (report.c), the finish (finish.c). The one idea: an answer may come
 * after its round has moved on, so each handler first checks what still
 * stands (the round number, the state) and drops what is old news.
 */
#include "agent_internal.h"

#include "ductile/clock.h"
#include "ductile/control.h"
#include "ductile/log.h"
#include "ductile/rdzv.h"

#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>

static void start_round(agent *a, rdzv_round *r);

/* Every worker is reaped: decide what comes next. */
void on_workers_gone(agent *a)
{
    if (a->ws.w) agent_workers_free(&a->ws);
    a->ws_gen++;
    a->kill_at = a->give_up_at = 0;
    switch (a->state) {
    case AGENT_SHUTDOWN:
        /* The job goes on without this node: under a Kubernetes Job its pod
         * must not count as a completed index (--leave-exit-code). */
        if (a->job_done)
            agent_finish(a, AGENT_EXIT_OK, "stopped by signal; the job is complete");
        else
            agent_finish(a, a->o->leave_exit_code, "stopped by signal; left the job");
        return;
    case AGENT_DRAINING:
        agent_finish(a, 0, "job complete");
        return;
    case AGENT_STOPPING:
        if (a->exit_after_stop >= 0) {
            agent_finish(a, a->exit_after_stop, a->why);
            return;
        }
        if (a->job_done) { /* the job completed while these workers stopped */
            agent_finish(a, AGENT_EXIT_OK, "job complete");
            return;
        }
        a->state = AGENT_RDZV;
        if (a->have_pending) {
            rdzv_round r = a->pending;
            a->have_pending = 0;
            start_round(a, &r);
        }
        return;
    default:
        a->state = AGENT_RDZV;
        return;
    }
}

/* A worker of this node failed (exited non-zero, was killed, or reported a
 * failure or a lost peer in restart mode): stop the rest and end the round,
 * as a failure when first_hand. */
static void worker_failed(agent *a, const char *reason, int first_hand, int suspect)
{
    dlog_warn(&a->lg, "worker_failed", "round %lld: %s; stopping the other workers",
              (long long)a->round.number, reason);
    if (a->state != AGENT_SHUTDOWN) {
        a->state = AGENT_STOPPING;
        if (a->exit_after_stop < 0) snprintf(a->why, sizeof(a->why), "failure: %s", reason);
    }
    stop_workers(a, a->o->stop_grace_ms);
    a->in_round = 0;
    report_start(a, reason, first_hand, suspect);
    if (!workers_alive(a) && !a->done) on_workers_gone(a);
}

/* A worker's `hello`: the first one says what it can do; every one is
 * answered with this agent's version and rebuild mode. */
static void on_hello(agent *a, agent_worker *w, const ctl_msg *m)
{
    if (w->version) {
        dlog_warn(&a->lg, "control_invalid", "worker rank %d said hello again: the first stands",
                  w->rank);
    } else {
        w->version = m->version;
        w->inplace = m->version == CTL_VERSION && m->mode == CTL_MODE_INPLACE;
        if (m->version != CTL_VERSION)
            dlog_warn(&a->lg, "control_version",
                      "worker rank %d speaks control protocol version %d, this agent version "
                      "%d%s",
                      w->rank, m->version, CTL_VERSION,
                      a->o->inplace ? ": it is restarted, not kept in place, at a round's end"
                                    : "");
    }
    ctl_msg r = {.type = CTL_HELLO,
                 .version = CTL_VERSION,
                 .mode = a->o->inplace ? CTL_MODE_INPLACE : CTL_MODE_RESTART};
    if (agent_ctl_send(w, &r) != 0)
        dlog_warn(&a->lg, "control_failed", "cannot answer the hello of worker rank %d", w->rank);
}

void on_ctl(void *ctx, agent_worker *w, const ctl_msg *m)
{
    agent *a = ctx;
    agent_watchdog_heard(&a->wd, w, m, mono_now_s());
    switch (m->type) {
    case CTL_READY:
        w->ready = 1;
        break;
    case CTL_STEP:
        w->step = m->step;
        agent_progress_step(&w->prog, m, mono_now_s());
        break;
    case CTL_PHASE: /* the watchdog's alone */
        break;
    case CTL_HELLO:
        on_hello(a, w, m);
        break;
    case CTL_FAILED:
    case CTL_PEER_LOST: {
        int first_hand = m->type == CTL_FAILED;
        char reason[600];
        snprintf(reason, sizeof(reason), "worker rank %d %s: %s", w->rank,
                 first_hand ? "reported" : "lost a peer", m->reason);
        /* A lost peer of a round this node has left is old news. A kept
         * worker's own failure is not: it may come while the round it
         * happened in is being replaced (a peer saw its connections close
         * first), and it is counted all the same (rdzv_report_failure adds
         * it to the current round when that one ended uncounted). */
        if (!first_hand && (!a->in_round || m->round != a->round.number)) break;
        if (a->state != AGENT_RUNNING && !(first_hand && a->state == AGENT_RDZV && a->o->inplace))
            break;
        if (keep_at_end(a, a->round.number)) {
            /* The worker keeps its process; the round ends for everyone. */
            dlog_warn(&a->lg, first_hand ? "worker_reported_failure" : "worker_lost_peer",
                      "round %lld: %s", (long long)a->round.number, reason);
            report_failure(a, reason, first_hand);
        } else {
            worker_failed(a, reason, first_hand, 0);
        }
        break;
    }
    default:
        dlog_warn(&a->lg, "control_invalid", "worker rank %d sent an agent-only message", w->rank);
        break;
    }
}

/* Node rank 0 could not publish MASTER_PORT: etcd failed under us, the
 * round cannot start, and the others wait for a port that will not come,
 * so end it for everyone. */
static void publish_failed(agent *a, int64_t round, const char *why)
{
    dlog_warn(&a->lg, "master_port_failed", "round %lld: cannot publish MASTER_PORT: %s",
              (long long)round, why);
    report_failure(a, "node rank 0 could not publish MASTER_PORT", 0);
    a->in_round = 0;
}

/* A round froze with this node in it: take it, learn its MASTER_PORT (node
 * rank 0 publishes it, the others wait for it, each on a task) and run the
 * workers once it is known (on_master). */
static void start_round(agent *a, rdzv_round *r)
{
    agent_master_cancel(&a->master);
    rdzv_round_free(&a->round);
    a->round = *r;
    memset(r, 0, sizeof(*r));
    a->in_round = 1;
    a->failure_reported = 0;
    a->restarts = a->round.restarts;
    a->started = a->round.number;
    const rdzv_round *rd = &a->round;
    if (!rdzv_round_self(rd)) {
        dlog_error(&a->lg, "round_invalid", "round %lld froze without this node",
                   (long long)rd->number);
        a->in_round = 0;
        return;
    }
    dlog_info(&a->lg, "round_frozen",
              "round %lld frozen: %d nodes, world size %d, rank %d, restarts %lld of %d (%s)",
              (long long)rd->number, rd->nmembers, rd->world_size, rd->my_rank,
              (long long)rd->restarts, rd->max_restarts, a->why[0] ? a->why : "first round");
    /* Node rank 0 speaks for the round: one Event per change, not one per node. */
    if (rd->my_rank == 0)
        agent_events_post(a->events, 0, "RoundFormed",
                          "round %lld formed with %d nodes, world size %d, restarts %lld of %d "
                          "(%.400s)",
                          (long long)rd->number, rd->nmembers, rd->world_size,
                          (long long)rd->restarts, rd->max_restarts,
                          a->why[0] ? a->why : "first round");
    a->why[0] = 0;
    if (rd->my_rank == 0) {
        if (agent_master_publish_start(&a->master, &a->etcd, a->o->job, rd->number) != 0)
            publish_failed(a, rd->number, "no thread to publish it on");
        return;
    }
    /* Bounded by the lease TTL: node rank 0 publishes right after the
     * freeze, and if it died its lease ends the round (which ends this wait
     * at once: the store's wait fails when its round is superseded). */
    if (agent_master_wait_start(&a->master, &a->etcd, a->o->job, rd->number,
                                a->o->lease_ttl_s * 1000 + 5000) != 0) {
        report_failure(a, "cannot start waiting for MASTER_PORT", 1);
        a->in_round = 0;
    }
}

/* The round's workers started on node rank 0's MASTER_PORT (members are
 * sorted by rank); a launch that failed is this node's failure. */
static void run_workers(agent *a, int port)
{
    char why[AGENT_MSG_MAX];
    if (launch_round(a, a->round.members[0].addr, port, why, sizeof(why)) != 0)
        report_failure(a, why, 1);
}

/* The MASTER_PORT publish or wait answered: go on with the round if it
 * still stands. */
void on_master(agent *a)
{
    int64_t round = a->master.round;
    int publishing = a->master.publishing;
    int port = 0;
    rdzv_err err = RDZV_OK;
    char why[AGENT_MSG_MAX];
    int rc = agent_master_read(&a->master, &port, &err, why, sizeof(why));
    if (!a->in_round || a->round.number != round) return;
    if (publishing) { /* as when it was made in place: whatever the state */
        if (rc == 0)
            run_workers(a, port);
        else
            publish_failed(a, round, why);
        return;
    }
    if (a->state != AGENT_RDZV) return;
    if (rc == 0) {
        run_workers(a, port);
        return;
    }
    dlog_warn(&a->lg, "master_port_failed", "round %lld: no MASTER_PORT: %s", (long long)round,
              why);
    /* Superseded: the round's end is on its way as an event. */
    if (err == RDZV_ERR_FENCED) return;
    /* Node rank 0 is alive (a dead one ends the round, and this wait with
     * it) but did not publish: a lost peer, counted if it happens again. */
    report_failure(a, "node rank 0 did not publish MASTER_PORT", 0);
    a->in_round = 0;
}

/* The Event for a round's end, by its cause (node rank 0 posts it). */
static void post_round_end(agent *a, const rdzv_event *ev, const char *what)
{
    static const char *const reasons[RDZV_CAUSE_COUNT] = {
        [RDZV_CAUSE_NONE] = "RoundEnded",      [RDZV_CAUSE_MEMBER_LOST] = "NodeLost",
        [RDZV_CAUSE_MEMBER_LEFT] = "NodeLeft", [RDZV_CAUSE_NODE_WAITING] = "NodeJoined",
        [RDZV_CAUSE_FAILURE] = "WorkerFailed", [RDZV_CAUSE_PEER_LOST] = "PeerLost"};
    int cause = ev->cause > 0 && ev->cause < RDZV_CAUSE_COUNT ? (int)ev->cause : 0;
    int warning = cause == RDZV_CAUSE_MEMBER_LOST || cause == RDZV_CAUSE_FAILURE;
    agent_events_post(a->events, warning, reasons[cause], "round %lld ended: %.500s",
                      (long long)ev->round_number, what);
}

static void describe_end(const rdzv_event *ev, char *out, size_t len)
{
    const char *node = ev->node[0] ? ev->node : "?";
    /* The library's reason usually names the node already: then it says it all. */
    if (ev->reason[0] && ev->node[0] && strstr(ev->reason, ev->node)) {
        snprintf(out, len, "%s", ev->reason);
        return;
    }
    const char *sep = ev->reason[0] ? ": " : "";
    switch (ev->cause) {
    case RDZV_CAUSE_MEMBER_LOST:
        snprintf(out, len, "member %s lost%s%s", node, sep, ev->reason);
        break;
    case RDZV_CAUSE_MEMBER_LEFT:
        snprintf(out, len, "member %s left%s%s", node, sep, ev->reason);
        break;
    case RDZV_CAUSE_NODE_WAITING:
        snprintf(out, len, "node %s waiting and the round has room", node);
        break;
    case RDZV_CAUSE_FAILURE:
        snprintf(out, len, "failure on %s%s%s", node, sep, ev->reason);
        break;
    default:
        snprintf(out, len, "%s", ev->reason[0] ? ev->reason : "unknown cause");
        break;
    }
}

/* The round this node was in is over: in place, the workers end their step
 * and wait for the next round (graceful: every member is alive, so the step
 * in flight finishes; else its collectives are abandoned now); by restart
 * (also in inplace mode for workers that cannot be kept), they are stopped. */
static void leave_round(agent *a, int64_t round_number, int graceful)
{
    a->in_round = 0;
    agent_master_cancel(&a->master);
    if (a->state != AGENT_RUNNING) return;
    if (keep_at_end(a, round_number)) {
        send_all(a, &(ctl_msg){.type = CTL_ABORT, .round = round_number, .graceful = graceful});
        a->state = AGENT_RDZV;
    } else {
        a->state = AGENT_STOPPING;
        a->exit_after_stop = -1;
        /* Graceful: every member is alive, so the step in flight finishes
         * however long it takes and is saved (`stop`, then SIGTERM), within
         * the budget a SIGTERM gives; a step cut there is redone, never
         * counted twice. Lost: the collectives fail at once anyway. */
        if (graceful) send_all(a, &(ctl_msg){.type = CTL_STOP});
        stop_workers(a, graceful ? a->o->shutdown_timeout_ms : a->o->stop_grace_ms);
        if (!workers_alive(a)) on_workers_gone(a);
    }
}

/* This node's lease expired (etcd was unreachable past the TTL, or the node
 * was stalled or cut off): the others have gone on without it, but the job
 * has not ended. Register again under a new lease and join the next round
 * as a newcomer; the old round is over for this node, and its workers never
 * write as that round again (the store and checkpoints are fenced). Returns
 * 0 when registering again fails, and the caller gives up as before. */
static int rejoin(agent *a, const rdzv_event *ev)
{
    if (a->state == AGENT_SHUTDOWN || a->state == AGENT_DRAINING || a->exit_after_stop >= 0 ||
        a->state == AGENT_FINISHING)
        return 0;
    rdzv *fresh = NULL;
    char msg[RDZV_MSG_MAX] = "";
    /* Never take the registration back: if another agent with this node id
     * holds it now, it took it over from this one, judged dead, and two
     * agents with one id must never both train (docs/design.md, "Rounds"). */
    a->cfg.no_takeover = 1;
    rdzv_err err = rdzv_open(&a->cfg, &fresh, msg);
    if (err != RDZV_OK) {
        dlog_error(&a->lg, "rejoin_failed", "lease lost (%s) and could not register again: %s%s%s",
                   ev->reason, rdzv_strerror(err), msg[0] ? ": " : "", msg);
        return 0;
    }
    rdzv_close(a->rz);
    a->rz = fresh;
    a->changes[RDZV_CAUSE_MEMBER_LOST]++;
    dlog_warn(&a->lg, "rejoin",
              "round %lld left: lease lost (%s); registered again, joining the next round",
              (long long)a->round.number, ev->reason);
    snprintf(a->why, sizeof(a->why), "this node's lease was lost and it joined again");
    leave_round(a, a->round.number, 0);
    return 1;
}

/* A round froze: take it, or keep it for when this node's workers are
 * gone; never a round already taken, nor an older one. */
static void on_frozen(agent *a, rdzv_event *ev)
{
    if (a->state == AGENT_SHUTDOWN || a->state == AGENT_DRAINING || a->exit_after_stop >= 0) return;
    if (ev->round.number <= a->started) {
        /* Never act on a round twice, nor go back to an older one. */
        dlog_warn(&a->lg, "round_stale", "round %lld reported again after round %lld: ignored",
                  (long long)ev->round.number, (long long)a->started);
        return;
    }
    if (a->state == AGENT_RUNNING && workers_alive(a) && !keep_at_end(a, a->round.number)) {
        /* A newer round without an end of ours first: ours is over too. */
        dlog_info(&a->lg, "round_superseded", "round %lld superseded by round %lld",
                  (long long)a->round.number, (long long)ev->round.number);
        a->state = AGENT_STOPPING;
        a->exit_after_stop = -1;
        a->in_round = 0;
        stop_workers(a, a->o->stop_grace_ms);
    }
    if (a->state == AGENT_STOPPING && workers_alive(a)) {
        if (a->have_pending) rdzv_round_free(&a->pending);
        a->pending = ev->round;
        a->have_pending = 1;
        memset(&ev->round, 0, sizeof(ev->round));
    } else {
        start_round(a, &ev->round);
    }
}

static void on_round_ended(agent *a, const rdzv_event *ev)
{
    char what[400];
    if (ev->cause > 0 && ev->cause < RDZV_CAUSE_COUNT) a->changes[ev->cause]++;
    describe_end(ev, what, sizeof(what));
    dlog_info(&a->lg, "round_ended", "round %lld ended: %s", (long long)ev->round_number, what);
    if (a->round.number == ev->round_number && a->round.my_rank == 0) post_round_end(a, ev, what);
    snprintf(a->why, sizeof(a->why), "%s", what);
    leave_round(a, ev->round_number,
                ev->cause == RDZV_CAUSE_NODE_WAITING || ev->cause == RDZV_CAUSE_MEMBER_LEFT);
}

static void on_job_done(agent *a)
{
    a->job_done = 1;
    dlog_info(&a->lg, "job_done", "the job is complete");
    a->in_round = 0;
    if (workers_alive(a) && a->state != AGENT_SHUTDOWN && a->state != AGENT_STOPPING) {
        a->state = AGENT_DRAINING;
        a->give_up_at = mono_now_s() + a->o->shutdown_timeout_ms / 1000.0;
    } else if (!workers_alive(a)) {
        agent_finish(a, 0, "job complete");
    }
}

/* The job failed, or the rendezvous did (a lost lease this node could not
 * register again after, too few nodes within --join-timeout, an error):
 * this node's part ends, with the exit code that says which. */
static void on_job_ended(agent *a, const rdzv_event *ev)
{
    if (ev->type == RDZV_EV_ERROR && ev->err == RDZV_ERR_LEASE_LOST && rejoin(a, ev)) return;
    if (ev->type == RDZV_EV_JOB_FAILED)
        snprintf(a->why, sizeof(a->why), "job failed: %s", ev->reason);
    else if (ev->err == RDZV_ERR_TIMEOUT)
        snprintf(a->why, sizeof(a->why), "%s: too few nodes came (a wait, not a failure)",
                 ev->reason);
    else
        snprintf(a->why, sizeof(a->why), "rendezvous error: %s: %s", rdzv_strerror(ev->err),
                 ev->reason);
    dlog_error(&a->lg, ev->type == RDZV_EV_JOB_FAILED ? "job_failed" : "rdzv_error", "%s", a->why);
    if (ev->type == RDZV_EV_JOB_FAILED) post_job_failed(a);
    a->in_round = 0;
    if (a->state == AGENT_SHUTDOWN) return;
    a->exit_after_stop = ev->type == RDZV_EV_JOB_FAILED   ? AGENT_EXIT_JOB_FAILED
                         : ev->err == RDZV_ERR_LEASE_LOST ? AGENT_EXIT_DROPPED
                         : ev->err == RDZV_ERR_TIMEOUT    ? AGENT_EXIT_NO_ROUND
                                                          : AGENT_EXIT_ERROR;
    if (workers_alive(a)) {
        a->state = AGENT_STOPPING;
        stop_workers(a, a->o->stop_grace_ms);
    } else {
        agent_finish(a, a->exit_after_stop, a->why);
    }
}

void on_event(agent *a, rdzv_event *ev)
{
    /* Marking the job complete: its answer decides how this agent ends
     * (as when the loop waited for it); only the job's end, which may be
     * that very write, is news. */
    if (a->state == AGENT_FINISHING && ev->type != RDZV_EV_JOB_DONE) return;
    switch (ev->type) {
    case RDZV_EV_FROZEN:
        on_frozen(a, ev);
        break;
    case RDZV_EV_ROUND_ENDED:
        on_round_ended(a, ev);
        break;
    case RDZV_EV_SPARE:
        dlog_info(&a->lg, "spare", "the round is full: waiting as a hot spare");
        break;
    case RDZV_EV_JOB_DONE:
        on_job_done(a);
        break;
    case RDZV_EV_JOB_FAILED:
    case RDZV_EV_ERROR:
        on_job_ended(a, ev);
        break;
    }
}

/* SIGTERM/SIGINT: workers finish their step and save, then leave, exit 0.
 * The workers get the shutdown budget less what leaving may take. */
void begin_shutdown(agent *a, const char *sig)
{
    a->signals++;
    if (a->signals > 1) {
        dlog_info(&a->lg, "signal", "%s again: killing workers now", sig);
        agent_workers_signal(&a->ws, SIGKILL);
        return;
    }
    int budget = a->o->shutdown_timeout_ms;
    int reserve = budget / 4 < 5000 ? budget / 4 : 5000;
    dlog_info(&a->lg, "signal", "%s: stopping workers (they have %.1f s), then leaving", sig,
              (budget - reserve) / 1000.0);
    a->state = AGENT_SHUTDOWN;
    a->in_round = 0;
    agent_master_cancel(&a->master);
    if (a->have_pending) rdzv_round_free(&a->pending);
    a->have_pending = 0;
    send_all(a, &(ctl_msg){.type = CTL_STOP});
    stop_workers(a, budget - reserve);
    if (!workers_alive(a)) on_workers_gone(a);
}

void on_reaped(agent *a, pid_t pid, int status)
{
    if (pid == a->sa.pid) {
        a->sa.pid = 0;
        snprintf(a->why, sizeof(a->why), "the private etcd exited (status %d)", status);
        dlog_error(&a->lg, "etcd_exited", "%s", a->why);
        a->exit_after_stop = 1;
        if (a->state != AGENT_SHUTDOWN) a->state = AGENT_STOPPING;
        stop_workers(a, a->o->stop_grace_ms);
        if (!workers_alive(a)) agent_finish(a, 1, a->why);
        return;
    }
    if (agent_warm_reaped(&a->warm, pid, status, &a->lg)) {
        if (spares_wanted(a)) agent_warm_fill(&a->warm, &a->lg);
        return;
    }
    if (!a->ws.w) return;
    agent_worker *w = agent_workers_reaped(&a->ws, pid, status);
    if (!w) return;
    char how[256], reason[320];
    agent_worker_describe(w, how, sizeof(how));
    snprintf(reason, sizeof(reason), "worker rank %d %s", w->rank, how);
    int ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (a->state == AGENT_RUNNING || (a->state == AGENT_RDZV && a->o->inplace)) {
        if (!ok) {
            int lost = WIFEXITED(status) && WEXITSTATUS(status) == CTL_EXIT_PEER_LOST;
            if (lost)
                snprintf(reason, sizeof(reason), "worker rank %d lost a peer (exit status %d)",
                         w->rank, CTL_EXIT_PEER_LOST);
            worker_failed(a, reason, agent_worker_first_hand(w), exit_may_be_peer(a, w));
            return;
        }
        if (workers_alive(a) == 0) {
            int all_ok = 1;
            for (int i = 0; i < a->ws.n; i++)
                all_ok &= WIFEXITED(a->ws.w[i].status) && WEXITSTATUS(a->ws.w[i].status) == 0;
            if (all_ok) {
                dlog_info(&a->lg, "workers_done", "round %lld: all %d workers exited 0",
                          (long long)a->round.number, a->ws.n);
                agent_workers_free(&a->ws);
                a->ws_gen++;
                a->in_round = 0;
                start_finish(a);
            }
        }
        return;
    }
    if (a->state == AGENT_STOPPING && agent_worker_first_hand(w)) {
        /* It crashed on its own while the round was ending for another
         * reason (its peers saw the crash first and reported a lost peer):
         * still one counted failure (report_failure reports once a round). */
        dlog_warn(&a->lg, "worker_failed", "round %lld: %s while stopping",
                  (long long)a->round.number, reason);
        report_start(a, reason, 1, exit_may_be_peer(a, w));
    } else if (a->state == AGENT_SHUTDOWN || a->state == AGENT_STOPPING) {
        dlog_info(&a->lg, "worker_stopped", "%s", reason);
    }
    if (workers_alive(a) == 0 && !a->done) on_workers_gone(a);
}
