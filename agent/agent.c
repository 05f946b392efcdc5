/* agent.c: agent_run: one node of the job, from start to end.
 *
 * Sets up what the loop needs (a private etcd with --standalone, the HTTP
 * endpoint, torchrun's log files, the Kubernetes Events, the warm spares),
 * joins the job (open_job: with --start-over, a job ended under another
 * install is started over), runs the poll loop (loop.c) until the job, or
 * this node's part in it, ends, and then leaves nothing running behind
 * it, whatever path got there. agent_internal.h says which file owns what.
 */
#include "agent_internal.h"

#include "ductile/etcd.h"
#include "ductile/log.h"
#include "ductile/rdzv.h"

#include <curl/curl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>

/* rdzv_open, and with --start-over, a job that ended under another install
 * id is started over (rdzv_start_over) and opened again. Of agents that
 * start together one deletes the old keys; the others find them gone, or
 * find it registered, and open the new job. *live: nodes found registered
 * under an old end, which then stays (the error, with a reason saying so). */
static rdzv_err open_job(agent *a, char *msg, int *live)
{
    rdzv_err err = rdzv_open(&a->cfg, &a->rz, msg);
    for (int i = 0; err == RDZV_ERR_JOB_ENDED_ELSEWHERE && a->o->start_over && i < 3; i++) {
        int64_t deleted = 0;
        char why[RDZV_MSG_MAX];
        rdzv_err e = rdzv_start_over(&a->etcd, a->o->job, a->o->install_id, live, &deleted, why);
        if (e != RDZV_OK) {
            snprintf(msg, RDZV_MSG_MAX, "starting job %s over: %.160s", a->o->job, why);
            return e;
        }
        if (deleted > 0)
            dlog_warn(&a->lg, "start_over", "job %s starts over: %s; deleted its %lld keys",
                      a->o->job, why, (long long)deleted);
        err = rdzv_open(&a->cfg, &a->rz, msg);
        if (err == RDZV_ERR_JOB_ENDED_ELSEWHERE && *live > 0)
            snprintf(msg, RDZV_MSG_MAX,
                     "job %s ended in an earlier install and %d of its nodes are still "
                     "registered: it starts over once they leave",
                     a->o->job, *live);
    }
    return err;
}

/* a as the loop starts it: no round, no workers, no task in flight. */
static void agent_init(agent *a, const agent_opts *o, const dlog *lg, int sigfd)
{
    memset(a, 0, sizeof(*a));
    a->o = o;
    a->lg = *lg;
    a->exit_after_stop = -1;
    a->sigfd = sigfd;
    a->wd.fixed_s = o->hang_timeout_ms / 1000.0;
    atomic_init(&a->tasks, 0);
    agent_master_init(&a->master, &a->tasks);
    agent_task_init(&a->report, &a->tasks);
    agent_task_init(&a->finish, &a->tasks);
    etcd_global_init(); /* before any thread; etcd_client_new reports a failure */

    a->etcd.endpoints = o->endpoint;
    a->etcd.cacert = o->cacert;
    a->etcd.cert = o->cert;
    a->etcd.key = o->key;
    a->etcd.user = o->user;
    a->etcd.password = o->password;
}

/* What the loop needs besides the rendezvous: the private etcd
 * (--standalone), the HTTP endpoint, torchrun's files, the Events. 0, or
 * -1 with a->exit_code set and the reason logged. */
static int start_services(agent *a)
{
    const agent_opts *o = a->o;
    char msg[RDZV_MSG_MAX] = "";
    if (o->standalone) {
        if (agent_standalone_start(&a->sa, msg, sizeof(msg)) != 0) {
            dlog_error(&a->lg, "standalone_failed", "--standalone: %s", msg);
            a->exit_code = AGENT_EXIT_ERROR;
            return -1;
        }
        a->etcd.endpoints = a->sa.endpoint;
        dlog_info(&a->lg, "standalone", "private etcd at %s", a->sa.endpoint);
    }
    if (o->http_port > 0) {
        a->http = agent_http_start(o->http_port, msg, sizeof(msg));
        if (!a->http) {
            dlog_error(&a->lg, "http_failed", "--http-port: %s", msg);
            a->exit_code = AGENT_EXIT_ERROR;
            return -1;
        }
    }
    a->logs.redirects = o->redirects;
    a->logs.tee = o->tee;
    a->logs.ranks_filter = o->ranks_filter;
    if (agent_logs_open(&a->logs, o->log_dir, o->job, msg, sizeof(msg)) != 0) {
        dlog_error(&a->lg, "log_dir_failed", "%s", msg);
        a->exit_code = o->log_dir ? AGENT_EXIT_USAGE : AGENT_EXIT_ERROR;
        return -1;
    }
    if (o->log_dir || o->redirects || o->tee)
        dlog_info(&a->lg, "log_dir", "worker files in %s", a->logs.run_dir);
    if (o->k8s_events) {
        a->events = agent_events_start(&a->lg, o->node_id, msg, sizeof(msg));
        if (!a->events) {
            dlog_error(&a->lg, "k8s_events_failed", "--k8s-events: %s", msg);
            a->exit_code = AGENT_EXIT_USAGE;
            return -1;
        }
    }
    return 0;
}

/* The warm spares, started to import while the rendezvous forms. 0, or -1
 * with a->exit_code set. */
static int start_spares(agent *a)
{
    const agent_opts *o = a->o;
    char why[AGENT_MSG_MAX];
    if (agent_warm_init(&a->warm, o->cmd, o->preload, o->inplace, o->nproc, why, sizeof(why)) !=
        0) {
        dlog_error(&a->lg, "spare_failed", "out of memory");
        a->exit_code = AGENT_EXIT_ERROR;
        return -1;
    }
    if (a->warm.argv)
        dlog_info(&a->lg, "spares",
                  "a warm interpreter per local worker imports %s ahead of each launch",
                  a->warm.modules);
    else if (strcmp(o->preload, "auto") == 0)
        dlog_debug(&a->lg, "no_spares", "no warm interpreters: %s", why);
    else if (strcmp(o->preload, "none") != 0)
        dlog_info(&a->lg, "no_spares", "no warm interpreters despite --preload %s: %s", o->preload,
                  why);
    agent_warm_fill(&a->warm, &a->lg);
    return 0;
}

/* Registers this node in the job (open_job). 0: the loop runs; -1: the
 * agent exits with a->exit_code (0 for a job already complete). */
static int join_job(agent *a)
{
    const agent_opts *o = a->o;
    char msg[RDZV_MSG_MAX] = "";
    int live = 0;
    rdzv_err err = open_job(a, msg, &live);
    if (err == RDZV_ERR_JOB_DONE) {
        dlog_info(&a->lg, "exit", "exiting with code 0: job %s is already complete", o->job);
        a->rz = NULL;
        a->exit_code = AGENT_EXIT_OK;
        return -1;
    }
    if (err != RDZV_OK) {
        /* Ended in an earlier install: retrying cannot help, unless old
         * agents were still registered when this one came to start over. */
        int again = err == RDZV_ERR_JOB_ENDED_ELSEWHERE && live > 0;
        a->exit_code = err == RDZV_ERR_JOB_FAILED                      ? AGENT_EXIT_JOB_FAILED
                       : err == RDZV_ERR_ARG                           ? AGENT_EXIT_USAGE
                       : err == RDZV_ERR_JOB_ENDED_ELSEWHERE && !again ? AGENT_EXIT_USAGE
                                                                       : AGENT_EXIT_ERROR;
        dlog_error(&a->lg, err == RDZV_ERR_JOB_FAILED ? "exit_failed" : "rdzv_error",
                   "exiting with code %d: %s%s%s", a->exit_code, rdzv_strerror(err),
                   msg[0] ? ": " : "", msg);
        a->rz = NULL;
        return -1;
    }
    int took_over = 0;
    int64_t inc = rdzv_incarnation(a->rz, &took_over);
    if (took_over)
        dlog_warn(&a->lg, "took_over",
                  "node id %s was registered by incarnation %lld, which is gone: took its place "
                  "as incarnation %lld",
                  o->node_id, (long long)(inc - 1), (long long)inc);
    return 0;
}

/* Whatever path got here, nothing is left running. */
static void agent_teardown(agent *a)
{
    if (a->ws.w) {
        agent_workers_signal(&a->ws, SIGKILL);
        for (int i = 0; i < a->ws.n; i++)
            if (!a->ws.w[i].exited && a->ws.w[i].pid > 0) waitpid(a->ws.w[i].pid, NULL, 0);
        agent_workers_free(&a->ws);
    }
    agent_warm_free(&a->warm);
    agent_master_cancel(&a->master);
    agent_task_cancel(&a->report);
    agent_task_cancel(&a->finish);
    agent_events_stop(a->events); /* what is queued (a failed job's Event) goes out first */
    if (a->rz) rdzv_close(a->rz); /* a task still running holds it: it frees it last */
    agent_http_stop(a->http);
    agent_standalone_stop(&a->sa);
    agent_logs_close(&a->logs);
    rdzv_round_free(&a->round);
    if (a->have_pending) rdzv_round_free(&a->pending);
    /* A task still blocked in libcurl: leave curl's globals be. */
    if (atomic_load(&a->tasks) == 0) curl_global_cleanup();
}

/* Sets up what the loop needs (a private etcd, the HTTP endpoint, the
 * rendezvous), runs the loop, and leaves nothing running behind it. */
int agent_run(const agent_opts *o, const dlog *lg, int sigfd)
{
    agent a;
    agent_init(&a, o, lg, sigfd);
    if (start_services(&a) != 0) goto out;
    publish(&a);

    a.cfg = (rdzv_config){.etcd = a.etcd,
                          .job = o->job,
                          .node_id = o->node_id,
                          .addr = o->node_addr,
                          .local_world_size = o->nproc,
                          .min_nodes = o->min_nodes,
                          .max_nodes = o->max_nodes,
                          .last_call_ms = o->last_call_ms,
                          .lease_ttl_s = o->lease_ttl_s,
                          .join_timeout_ms = o->join_timeout_ms,
                          .max_restarts = o->max_restarts,
                          .install_id = o->install_id};
    dlog_info(&a.lg, "start",
              "joining job %s at %s as node %s (%s), %d workers, nodes %d:%d, rebuild %s", o->job,
              a.etcd.endpoints, o->node_id, o->node_addr, o->nproc, o->min_nodes, o->max_nodes,
              o->inplace ? "inplace" : "restart");
    if (start_spares(&a) != 0) goto out;
    if (join_job(&a) == 0) run_loop(&a);
out:
    agent_teardown(&a);
    return a.exit_code;
}
