/* launch.c: starting and stopping a round's workers.
 *
 * A round's workers start once its MASTER_PORT is known: fresh processes
 * (workers.c), a warm spare adopted for a rank that has one (warm.c), or,
 * under --rebuild inplace, the workers of the last round kept and sent the
 * new round on their control channels. Stopping is SIGTERM, then SIGKILL
 * once the grace runs out (the deadline, a->kill_at, is the loop's). The
 * one idea of keeping: a node's workers are kept all together, when every
 * live one said it can be, or restarted all together.
 */
#include "agent_internal.h"

#include "ductile/clock.h"
#include "ductile/control.h"
#include "ductile/log.h"
#include "ductile/rdzv.h"

#include <signal.h>
#include <stdio.h>

int workers_alive(const agent *a)
{
    return a->ws.w ? a->ws.alive : 0;
}

/* One control message to every live worker. */
void send_all(agent *a, const ctl_msg *m)
{
    for (int i = 0; i < a->ws.n; i++)
        if (!a->ws.w[i].exited) agent_ctl_send(&a->ws.w[i], m);
}

/* SIGTERM to every worker, SIGKILL after grace_ms. */
void stop_workers(agent *a, int grace_ms)
{
    if (!workers_alive(a)) return;
    agent_workers_signal(&a->ws, SIGTERM);
    a->kill_at = mono_now_s() + grace_ms / 1000.0;
    a->give_up_at = 0;
}

/* Whether this node's workers are kept at a round's end: --rebuild inplace
 * and every live one said `hello CTL_VERSION inplace`. All or nothing: a
 * node's workers are kept together or restarted together; other nodes
 * decide for themselves (a fresh worker gets its round on the channel too). */
int keep_in_place(const agent *a)
{
    if (!a->o->inplace) return 0;
    for (int i = 0; a->ws.w && i < a->ws.n; i++)
        if (!a->ws.w[i].exited && !a->ws.w[i].inplace) return 0;
    return 1;
}

/* keep_in_place() where a round ends; when --rebuild inplace cannot keep the
 * workers, says so once, naming the first worker that did not say it can
 * be kept, and the caller restarts them as restart mode does. */
int keep_at_end(agent *a, int64_t round)
{
    if (!a->o->inplace || keep_in_place(a)) return a->o->inplace;
    const agent_worker *w = NULL;
    for (int i = 0; i < a->ws.n && !w; i++)
        if (!a->ws.w[i].exited && !a->ws.w[i].inplace) w = &a->ws.w[i];
    char why[160];
    if (w->version == 0)
        snprintf(why, sizeof(why),
                 "did not say \"hello %d inplace\" on its control channel (a script without "
                 "the in-place helper)",
                 CTL_VERSION);
    else if (w->version != CTL_VERSION)
        snprintf(why, sizeof(why), "speaks control protocol version %d, not %d", w->version,
                 CTL_VERSION);
    else
        snprintf(why, sizeof(why), "said \"hello %d\" without inplace", CTL_VERSION);
    dlog_warn(&a->lg, "inplace_fallback",
              "round %lld: worker rank %d %s: restarting this node's workers instead of keeping "
              "them",
              (long long)round, w->rank, why);
    return 0;
}

/* Inplace: sends every worker the round, with its rank in it, on its control channel. */
static void send_round(agent *a, const rdzv_member *me, const char *maddr, int mport,
                       const char *prefix)
{
    const rdzv_round *r = &a->round;
    for (int i = 0; i < a->ws.n; i++) {
        agent_worker *w = &a->ws.w[i];
        w->rank = me->first_global_rank + w->local_rank;
        w->failed_reported = 0;
        w->ready = 0;
        ctl_msg m = {.type = CTL_ROUND,
                     .round = r->number,
                     .rank = w->rank,
                     .world_size = r->world_size,
                     .local_rank = w->local_rank,
                     .group_rank = r->my_rank,
                     .group_world_size = r->nmembers,
                     .restarts = r->restarts,
                     .master_port = mport};
        snprintf(m.master_addr, sizeof(m.master_addr), "%s", maddr);
        snprintf(m.store_prefix, sizeof(m.store_prefix), "%s", prefix);
        if (!w->exited && agent_ctl_send(w, &m) != 0)
            dlog_warn(&a->lg, "control_failed", "cannot send round %lld to worker rank %d",
                      (long long)r->number, w->rank);
    }
}

/* Runs the current round's workers once its MASTER_PORT is known: keeps
 * them in place when every one can be, else starts them afresh (a warm
 * spare adopted where one is ready). A launch that fails returns -1 with
 * why: this node's failure, for the caller to report. */
int launch_round(agent *a, const char *maddr, int mport, char *why, size_t len)
{
    const rdzv_round *rd = &a->round;
    const rdzv_member *me = rdzv_round_self(rd);
    char prefix[320];
    (void)rdzv_store_prefix(a->o->job, rd->number, prefix, sizeof(prefix)); /* job id checked */
    if (workers_alive(a) == a->o->nproc && keep_in_place(a)) {
        /* A stopped or wedged worker would fail the new round's group for
         * everyone: it ends here, as this node's failure, and the node's
         * workers start afresh. */
        double now = mono_now_s();
        for (int i = 0; i < a->ws.n; i++)
            if (agent_watchdog_silent(&a->ws.w[i], now))
                agent_watchdog_kill(&a->wd, &a->ws.w[i], &a->lg);
        send_round(a, me, maddr, mport, prefix);
        a->state = AGENT_RUNNING;
        dlog_info(&a->lg, "workers_kept", "round %lld: %d workers kept, ranks %d..%d",
                  (long long)rd->number, a->o->nproc, me->first_global_rank,
                  me->first_global_rank + a->o->nproc - 1);
        return 0;
    }
    agent_round_env env = {.round = rd->number,
                           .world_size = rd->world_size,
                           .group_rank = rd->my_rank,
                           .group_world_size = rd->nmembers,
                           .first_rank = me->first_global_rank,
                           .local_world_size = a->o->nproc,
                           .master_addr = maddr,
                           .master_port = mport,
                           .node_addr = a->o->node_addr,
                           .node_id = a->o->node_id,
                           .restarts = rd->restarts,
                           .max_restarts = rd->max_restarts,
                           .job = a->o->job,
                           .role = a->o->role,
                           .store_prefix = prefix,
                           .etcd = a->etcd,
                           .logs = &a->logs};
    int warm = 0;
    agent_adopt adopt = agent_warm_adopt(&a->warm);
    if (agent_logs_attempt(&a->logs, rd->restarts, why, len) != 0 ||
        agent_workers_spawn(&a->ws, &env, a->o->cmd, &adopt, &warm, why, len) != 0) {
        dlog_error(&a->lg, "spawn_failed", "round %lld: cannot start workers: %s",
                   (long long)rd->number, why);
        a->state = AGENT_RDZV;
        a->in_round = 0;
        return -1;
    }
    a->ws_gen++;
    a->state = AGENT_RUNNING;
    char how[160] = "";
    if (a->warm.argv)
        snprintf(how, sizeof(how), " (%d from a warm interpreter: %.100s preloaded)", warm,
                 a->warm.modules);
    dlog_info(&a->lg, "workers_started", "round %lld: started %d workers, ranks %d..%d%s",
              (long long)rd->number, a->o->nproc, me->first_global_rank,
              me->first_global_rank + a->o->nproc - 1, how);
    /* The next restart's spares import while this round trains, a little
     * after its workers' own start: an import of torch takes the cores the
     * new workers start on. Either way is safe: a restart before then
     * starts cold. */
    agent_warm_new_round(&a->warm);
    a->warm_at = mono_now_s() + AGENT_WARM_REFILL_S;
    /* In inplace mode a fresh worker also gets the round on its channel, so
     * a trainer reads its round the same way every time. */
    if (a->o->inplace) send_round(a, me, maddr, mport, prefix);
    return 0;
}

/* A spare that died is started again (once a round) while another launch
 * may still come. */
int spares_wanted(const agent *a)
{
    return !a->done && a->exit_after_stop < 0 && a->state != AGENT_SHUTDOWN &&
           a->state != AGENT_DRAINING && a->state != AGENT_FINISHING;
}
