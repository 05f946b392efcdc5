/* main.c: ductile-agent: options, logger and signals, then the agent.
 *
 *   ductile-agent [options] -- COMMAND ARGS...
 *   ductile-agent [torchrun's options] SCRIPT.py ARGS...   (or -m MODULE)
 *   ductile-agent status --rdzv-endpoint URL --rdzv-id JOB [--json]
 *   ductile-agent reset --rdzv-endpoint URL --rdzv-id JOB
 *
 * Everything here runs before the agent starts a thread: the signals the
 * agent handles are blocked now, so that every thread inherits the mask,
 * and arrive as events on a signalfd in the agent's poll() loop (loop.c).
 */
#include "agent.h"
#include "options.h"
#include "status.h"

#include "ductile/failpoint.h"
#include "ductile/log.h"

#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/signalfd.h>
#include <unistd.h>

static int agent_main(agent_opts *o);

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "status") == 0) return agent_status_main(argc - 1, argv + 1);
    if (argc > 1 && strcmp(argv[1], "reset") == 0) return agent_reset_main(argc - 1, argv + 1);
    agent_opts opts;
    int rc = agent_opts_parse(argc, argv, &opts);
    int code = rc != 0 ? (rc > 0 ? AGENT_EXIT_OK : AGENT_EXIT_USAGE) : agent_main(&opts);
    agent_opts_free(&opts);
    return code;
}

static int agent_main(agent_opts *o)
{
    char msg[AGENT_MSG_MAX];
    dlog lg;
    if (dlog_init(&lg, "agent", o->node_id, 1, msg, sizeof(msg)) != 0) {
        agent_early_error("%s", msg);
        return AGENT_EXIT_USAGE;
    }
    lg.json = o->json_log; /* --log-format wins over DUCTILE_LOG_FORMAT */
    if (failpoint_check_env(msg, sizeof(msg)) != 0) {
        agent_early_error("%s", msg);
        return AGENT_EXIT_USAGE;
    }
    for (int i = 0; i < AGENT_NOTES_MAX; i++)
        if (o->notes[i][0]) dlog_info(&lg, "torchrun_option", "%s", o->notes[i]);

    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGINT);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    signal(SIGPIPE, SIG_IGN);
    int sigfd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
    if (sigfd < 0) {
        agent_early_error("signalfd: %s", strerror(errno));
        return AGENT_EXIT_ERROR;
    }
    int code = agent_run(o, &lg, sigfd);
    close(sigfd);
    return code;
}
