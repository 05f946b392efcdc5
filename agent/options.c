/* options.c: the agent's options: flags, DUCTILE_* variables, defaults.
 *
 * One table lists every option once: its flag, its variable, its default
 * and its help line. --help prints the table (options_help.c); parsing
 * (options_parse.c) applies the defaults, then the environment, then the
 * command line, each value through the same agent_opt_set()
 * (options_set.c), so a flag and its variable are checked alike and a bad
 * value is one line naming where it came from. This file holds the table
 * and the look-ups in it.
 *
 * torchrun's flags are in the table too, so that a torchrun command line
 * runs unchanged: with their PET_* variables (torchrun reads PET_<FLAG> as a
 * flag's default), its -m/-r/-t, and its command form (the first argument
 * that is not an option is the script, run as PYTHON -u SCRIPT ARGS). A
 * flag with no meaning here says so once in the log ("ignored"), checked
 * as torchrun checks it.
 */
#include "options_table.h"

#include <ctype.h>
#include <string.h>

void agent_opt_pet_name(const agent_opt *t, char *out, size_t len)
{
    snprintf(out, len, "PET_%s", t->flag);
    for (char *p = out + 4; *p; p++)
        *p = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
}

const agent_opt agent_opt_table[OPT_COUNT] = {
    [OPT_NNODES] = {"nnodes", "DUCTILE_NNODES", "N|MIN:MAX", "1:1",
                    "nodes in the job; the job runs with MIN and grows to MAX", 1},
    [OPT_NPROC] = {"nproc-per-node", "DUCTILE_NPROC_PER_NODE", "K|auto|cpu|gpu", "1",
                   "workers on this node: K, one per GPU, per CPU, or auto (GPUs if any)", 1},
    [OPT_ENDPOINT] = {"rdzv-endpoint", "DUCTILE_RDZV_ENDPOINT", "URL[,URL...]", NULL,
                      "etcd endpoints (required unless --standalone)", 1},
    [OPT_ID] = {"rdzv-id", "DUCTILE_RDZV_ID", "JOB", NULL,
                "job id [a-z0-9][a-z0-9-]{0,62} (required unless --standalone)", 1},
    [OPT_MAX_RESTARTS] = {"max-restarts", "DUCTILE_MAX_RESTARTS", "N", "0",
                          "restarts after failures allowed for the whole job (kept in etcd)", 1},
    [OPT_NODE_ID] = {"node-id", "DUCTILE_NODE_ID", "ID", "the host name",
                     "unique node name [A-Za-z0-9._-]{1,128}"},
    [OPT_NODE_ADDR] = {"node-addr", "DUCTILE_NODE_ADDR", "ADDR",
                       "first non-loopback IPv4, else 127.0.0.1",
                       "address peers use to reach this node (MASTER_ADDR on node rank 0)"},
    [OPT_LEASE_TTL] = {"lease-ttl", "DUCTILE_LEASE_TTL", "SECONDS", "10",
                       "node lease TTL: worst-case time to notice a silent death (2..3600)"},
    [OPT_LAST_CALL] = {"last-call", "DUCTILE_LAST_CALL", "SECONDS", "5",
                       "with MIN nodes joined, freeze this long after the last join"},
    [OPT_JOIN_TIMEOUT] = {"join-timeout", "DUCTILE_JOIN_TIMEOUT", "SECONDS", "600",
                          "a round must form within this, else the agent exits 6 (too few "
                          "nodes came: a wait, not a failure)"},
    [OPT_SHUTDOWN_TIMEOUT] = {"shutdown-timeout", "DUCTILE_SHUTDOWN_TIMEOUT", "SECONDS", "20",
                              "on SIGTERM/SIGINT: stop workers, leave and exit within this", 1},
    [OPT_STOP_GRACE] = {"stop-grace", "DUCTILE_STOP_GRACE", "SECONDS", "5",
                        "between SIGTERM and SIGKILL when stopping workers for a new round (a "
                        "graceful change gives them --shutdown-timeout to finish the step)"},
    [OPT_HANG_TIMEOUT] = {"hang-timeout", "DUCTILE_HANG_TIMEOUT", "SECONDS|auto", "auto",
                          "kill a worker that reported a step and then makes no progress in "
                          "local work, or falls silent, this long (waits on peers are bounded "
                          "by the worker's own timeouts); auto: 10x the longest local stretch "
                          "seen on this node, at least 120 (1..86400)"},
    [OPT_REBUILD] = {"rebuild", "DUCTILE_REBUILD", "restart|inplace", "restart",
                     "restart: relaunch workers each round; inplace: keep the workers that "
                     "say `hello 1 inplace` on DUCTILE_CONTROL_FD (ductile-train, a PyTorch "
                     "script using the ductile.torch helper) and send them each round there; "
                     "a node's workers that do not all say it are restarted"},
    [OPT_STANDALONE] = {"standalone", "DUCTILE_STANDALONE", NULL, "off",
                        "run a private etcd on a free loopback port (one-machine runs)", 1},
    [OPT_HTTP_PORT] = {"http-port", "DUCTILE_HTTP_PORT", "PORT", "0 (off)",
                       "serve /healthz, /readyz and /metrics on this port"},
    [OPT_K8S_EVENTS] = {"k8s-events", "DUCTILE_K8S_EVENTS", NULL, "off",
                        "post Kubernetes Events on this pod's Job (round changes, failures); "
                        "the API and Job come from DUCTILE_K8S_* (docs/design.md)"},
    [OPT_LOG_FORMAT] = {"log-format", "DUCTILE_LOG_FORMAT", "text|json", "text",
                        "one log line per event, as text or JSON"},
    [OPT_LEAVE_EXIT_CODE] = {"leave-exit-code", "DUCTILE_LEAVE_EXIT_CODE", "CODE", "0",
                             "exit status after leaving a job that is still running on "
                             "SIGTERM/SIGINT (5 under a Kubernetes Job: the pod is replaced, "
                             "not complete)"},
    [OPT_ROLE] = {"role", "DUCTILE_ROLE", "NAME", "default", "ROLE_NAME given to workers", 1},
    [OPT_PRELOAD] =
        {"preload", "DUCTILE_PRELOAD", "auto|none|MODULES", "auto",
         "keep a warm spare Python per local worker with these modules (comma "
         "list) imported, adopted by the next launch so a restart skips the "
         "import; auto: torch and torch._dynamo when the command is python SCRIPT or python -m "
         "MODULE (restart mode); none: no spares. Each spare holds the memory of "
         "an interpreter with its modules (about 0.5 GB resident with torch)"},
    [OPT_CACERT] = {"etcd-cacert", "DUCTILE_ETCD_CACERT", "FILE", NULL,
                    "CA certificate to verify etcd (PEM)"},
    [OPT_CERT] = {"etcd-cert", "DUCTILE_ETCD_CERT", "FILE", NULL, "client certificate (PEM)"},
    [OPT_KEY] = {"etcd-key", "DUCTILE_ETCD_KEY", "FILE", NULL, "client key (PEM)"},
    [OPT_USER] = {"etcd-user", "DUCTILE_ETCD_USER", "NAME", NULL, "etcd user name"},
    [OPT_PASSWORD] = {"etcd-password", "DUCTILE_ETCD_PASSWORD", "PASSWORD", NULL, "etcd password"},
    [OPT_INSTALL_ID] = {"install-id", "DUCTILE_INSTALL_ID", "ID", NULL,
                        "this install of the job [A-Za-z0-9-]{1,64} (the chart's, per release): "
                        "recorded with the job's end; a job that ended under another install "
                        "id is refused with exit 2"},
    [OPT_START_OVER] = {"start-over", "DUCTILE_START_OVER", NULL, "off",
                        "a job that ended under another --install-id: delete its keys and "
                        "train it again"},
    [OPT_RDZV_BACKEND] = {"rdzv-backend", NULL, "NAME", "static",
                          "etcd-v2, etcd, c10d or static: the rendezvous is always etcd (v3 "
                          "API) at --rdzv-endpoint, which for c10d and static too must name an "
                          "etcd",
                          1},
    [OPT_RDZV_CONF] = {"rdzv-conf", NULL, "KEY=VALUE,...", NULL,
                       "timeout, join_timeout: --join-timeout; last_call_timeout: --last-call; "
                       "keep_alive_interval x keep_alive_max_attempt (5 x 3): --lease-ttl; "
                       "cacert, cert, key: --etcd-*; protocol=https: https endpoints; "
                       "read_timeout, close_timeout, is_host, use_libuv: ignored",
                       1},
    [OPT_MODULE] = {"module", NULL, NULL, "off", "run the command as PYTHON -u -m MODULE ARGS", 1,
                    'm'},
    [OPT_NO_PYTHON] = {"no-python", NULL, NULL, "off", "run the command itself, as after --", 1},
    [OPT_RUN_PATH] = {"run-path", NULL, NULL, "off",
                      "run the script as PYTHON -u SCRIPT ARGS (what torchrun's runpy does in "
                      "one interpreter); wins over --no-python",
                      1},
    [OPT_LOG_DIR] = {"log-dir", NULL, "DIR", NULL,
                     "per-worker files in DIR/JOB_XXXXXX/attempt_RESTARTS/LOCAL_RANK/ "
                     "(stdout.log, stderr.log, error.json); the rounds of one attempt append",
                     1},
    [OPT_REDIRECTS] = {"redirects", NULL, "N|LR:N,...", "0",
                       "streams sent to the files only: 1 stdout, 2 stderr, 3 both, for all or "
                       "per local rank (0:1,1:2)",
                       1, 'r'},
    [OPT_TEE] = {"tee", NULL, "N|LR:N,...", "0", "streams sent to the files and the console", 1,
                 't'},
    [OPT_LOCAL_RANKS_FILTER] = {"local-ranks-filter", NULL, "LR,...", NULL,
                                "only these local ranks' output on the console (files keep all)",
                                1},
    [OPT_LOCAL_ADDR] = {"local-addr", NULL, "ADDR", NULL, "as --node-addr", 1},
    [OPT_MONITOR_INTERVAL] = {"monitor-interval", NULL, "SECONDS", NULL, "ignored", 1, 0,
                              "the agent is event driven: it wakes on a worker's exit or output, "
                              "not on a poll"},
    [OPT_START_METHOD] = {"start-method", NULL, "METHOD", NULL, "ignored", 1, 0,
                          "each worker is a fresh process (fork and exec of the command)"},
    [OPT_EVENT_LOG_HANDLER] = {"event-log-handler", NULL, "NAME", NULL, "ignored", 1, 0,
                               "events are the agent's log lines (--log-format json)"},
    [OPT_LOG_LINE_PREFIX_TEMPLATE] = {"log-line-prefix-template", NULL, "TEMPLATE", NULL, "ignored",
                                      1, 0, "console lines are prefixed [RANK]"},
    [OPT_DUPLICATE_STDOUT_FILTERS] = {"duplicate-stdout-filters", NULL, "WORDS", NULL, "ignored", 1,
                                      0, "use --log-dir with --tee and grep the files"},
    [OPT_DUPLICATE_STDERR_FILTERS] = {"duplicate-stderr-filters", NULL, "WORDS", NULL, "ignored", 1,
                                      0, "use --log-dir with --tee and grep the files"},
    [OPT_NODE_RANK] = {"node-rank", NULL, "N", NULL,
                       "ignored: node ranks come from the etcd rendezvous", 1, 0,
                       "node ranks come from the etcd rendezvous (torchrun uses it for its "
                       "static rendezvous only)"},
    [OPT_MASTER_ADDR] = {"master-addr", NULL, "ADDR", NULL,
                         "ignored: MASTER_ADDR is node rank 0's --node-addr", 1, 0,
                         "MASTER_ADDR is node rank 0's --node-addr, MASTER_PORT a free port it "
                         "publishes each round (the etcd rendezvous replaces torchrun's static "
                         "one)"},
    [OPT_MASTER_PORT] = {"master-port", NULL, "PORT", NULL,
                         "ignored: MASTER_PORT is a free port node rank 0 publishes", 1, 0,
                         "MASTER_PORT is a free port node rank 0 publishes each round"},
    [OPT_LOGS_SPECS] = {"logs-specs", NULL, "NAME", NULL, "ignored", 1, 0,
                        "a Python entry point: the files are --log-dir's"},
    [OPT_NUMA_BINDING] = {"numa-binding", NULL, "MODE", NULL, "ignored", 1, 0,
                          "bind workers with numactl in the command"},
    [OPT_SIGNALS_TO_HANDLE] = {"signals-to-handle", NULL, "SIGNALS", NULL, "ignored", 1, 0,
                               "SIGTERM and SIGINT stop the workers gracefully; other signals "
                               "keep their default action"},
    [OPT_VIRTUAL_LOCAL_RANK] = {"virtual-local-rank", NULL, NULL, NULL, "ignored", 1, 0,
                                "LOCAL_RANK is each worker's own"},
    [OPT_PRINT_COMPLETION] = {"print-completion", NULL, "SHELL", NULL, "ignored", 1, 0,
                              "no shell completion"},
};

/* Finds a flag by its name; torchrun's underscore spellings are accepted.
 * A name of one letter is a short flag (-m, -r, -t). */
int agent_opt_find(const char *name, size_t n)
{
    if (n == 1) {
        for (int i = 0; i < OPT_COUNT; i++)
            if (agent_opt_table[i].letter == name[0]) return i;
        return -1;
    }
    char norm[64];
    if (n >= sizeof(norm)) return -1;
    for (size_t i = 0; i < n; i++)
        norm[i] = name[i] == '_' ? '-' : name[i];
    norm[n] = 0;
    for (int i = 0; i < OPT_COUNT; i++)
        if (strcmp(norm, agent_opt_table[i].flag) == 0) return i;
    return -1;
}
