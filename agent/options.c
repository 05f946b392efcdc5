/* options.c: the agent's options: flags, DUCTILE_* variables, defaults.
 *
 * One table lists every option once: its flag, its variable, its default
 * and its help line. --help prints the table; parsing applies the defaults,
 * then the environment, then the command line, each value through the same
 * opt_set(), so a flag and its variable are checked alike and a bad value
 * is one line naming where it came from.
 *
 * torchrun's flags are in the table too, so that a torchrun command line
 * runs unchanged: with their PET_* variables (torchrun reads PET_<FLAG> as a
 * flag's default), its -m/-r/-t, and its command form (the first argument
 * that is not an option is the script, run as PYTHON -u SCRIPT ARGS). A
 * flag with no meaning here says so once in the log ("ignored"), checked
 * as torchrun checks it.
 */
#include "options.h"
#include "logs.h"

#include "ductile/control.h" /* ctl_int: one integer parser */

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <ifaddrs.h>
#include <math.h>
#include <net/if.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

typedef enum {
    OPT_NNODES,
    OPT_NPROC,
    OPT_ENDPOINT,
    OPT_ID,
    OPT_MAX_RESTARTS,
    OPT_NODE_ID,
    OPT_NODE_ADDR,
    OPT_LEASE_TTL,
    OPT_LAST_CALL,
    OPT_JOIN_TIMEOUT,
    OPT_SHUTDOWN_TIMEOUT,
    OPT_STOP_GRACE,
    OPT_HANG_TIMEOUT,
    OPT_REBUILD,
    OPT_STANDALONE,
    OPT_HTTP_PORT,
    OPT_K8S_EVENTS,
    OPT_LOG_FORMAT,
    OPT_LEAVE_EXIT_CODE,
    OPT_ROLE,
    OPT_PRELOAD,
    OPT_CACERT,
    OPT_CERT,
    OPT_KEY,
    OPT_USER,
    OPT_PASSWORD,
    OPT_INSTALL_ID,
    OPT_START_OVER,
    /* torchrun's own flags, those without a DUCTILE_* variable (--nnodes and
     * others above are torchrun's too) */
    OPT_RDZV_BACKEND,
    OPT_RDZV_CONF,
    OPT_MODULE,
    OPT_NO_PYTHON,
    OPT_RUN_PATH,
    OPT_LOG_DIR,
    OPT_REDIRECTS,
    OPT_TEE,
    OPT_LOCAL_RANKS_FILTER,
    OPT_LOCAL_ADDR,
    OPT_MONITOR_INTERVAL,
    OPT_START_METHOD,
    OPT_EVENT_LOG_HANDLER,
    OPT_LOG_LINE_PREFIX_TEMPLATE,
    OPT_DUPLICATE_STDOUT_FILTERS,
    OPT_DUPLICATE_STDERR_FILTERS,
    OPT_NODE_RANK,
    OPT_MASTER_ADDR,
    OPT_MASTER_PORT,
    OPT_LOGS_SPECS,
    OPT_NUMA_BINDING,
    OPT_SIGNALS_TO_HANDLE,
    OPT_VIRTUAL_LOCAL_RANK,
    OPT_PRINT_COMPLETION,
    OPT_COUNT
} agent_opt_id;

_Static_assert(OPT_COUNT <= AGENT_NOTES_MAX, "a note for each option");

typedef struct agent_opt {
    const char *flag; /* without the leading "--" */
    const char *env;  /* the DUCTILE_* variable; NULL: torchrun's PET_* only */
    const char *arg;  /* NULL for a switch */
    const char *def;  /* NULL: no default */
    const char *help;
    int pet;             /* torchrun's flag: PET_<FLAG> is read too */
    char letter;         /* torchrun's short form (-m, -r, -t), or 0 */
    const char *ignored; /* why the agent has no use for it; NULL: it has */
} agent_opt;

/* PET_<FLAG>: torchrun's variable for a flag (argparse's dest, upper case). */
static void pet_name(const agent_opt *t, char *out, size_t len)
{
    snprintf(out, len, "PET_%s", t->flag);
    for (char *p = out + 4; *p; p++)
        *p = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
}

static const agent_opt agent_opt_table[OPT_COUNT] = {
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

/* "  LEFT  HELP" with HELP wrapped at 80 columns under itself; a long LEFT
 * gets a line of its own. */
static void help_print(FILE *f, const char *left, const char *help)
{
    enum { COL = 37, WIDTH = 80 };
    int at = fprintf(f, "  %-34s ", left);
    if (at > COL) at = WIDTH; /* start the help on the next line */
    while (*help) {
        size_t word = strcspn(help, " ");
        if (at + (int)word > WIDTH && at > COL) at = fprintf(f, "\n%*s", COL, "") - 1;
        at += fprintf(f, "%s%.*s", at > COL ? " " : "", (int)word, help);
        help += word;
        help += strspn(help, " ");
    }
    fputc('\n', f);
}

static void usage(FILE *f)
{
    fprintf(f, "usage: ductile-agent [options] -- COMMAND ARGS...   (runs exactly COMMAND ARGS)\n"
               "       ductile-agent [options] SCRIPT.py ARGS...    (torchrun's form: PYTHON -u "
               "SCRIPT.py ARGS)\n"
               "       ductile-agent [options] -m MODULE ARGS...    (PYTHON -u -m MODULE ARGS)\n"
               "       ductile-agent [options] --no-python COMMAND ARGS...\n"
               "       ductile-agent status --rdzv-endpoint URL --rdzv-id JOB [--json]\n"
               "       ductile-agent reset --rdzv-endpoint URL --rdzv-id JOB\n\n"
               "Runs COMMAND as K workers per node of an elastic job whose nodes meet in\n"
               "etcd. Every option also comes from its environment variable; the command\n"
               "line wins, then DUCTILE_*, then torchrun's PET_* (for torchrun's flags), then\n"
               "the default. Without --, the first argument that is not an option ends\n"
               "them, as in torchrun; PYTHON is $DUCTILE_PYTHON, else $PYTHON_EXEC\n"
               "(torchrun's), else python3 on PATH. Durations are seconds and may have\n"
               "decimals. Worker output is passed through as \"[RANK] line\" (stdout to\n"
               "stdout, stderr to stderr); the agent's own log lines go to stderr, those at\n"
               "DUCTILE_LOG_LEVEL (error, warn, info or debug; default info) or more severe.\n\n");
    /* ductile's options (those with a DUCTILE_* variable), then torchrun's own */
    for (int k = 0; k < 2 * OPT_COUNT; k++) {
        const agent_opt *o = &agent_opt_table[k % OPT_COUNT];
        if (k == OPT_COUNT)
            fprintf(f,
                    "\ntorchrun's flags (also with underscores, and from PET_<FLAG>); an ignored "
                    "one is\nchecked as torchrun checks it and logged once:\n");
        if ((k < OPT_COUNT) != (o->env != NULL)) continue;
        char left[64], pet[64], vars[160];
        pet_name(o, pet, sizeof(pet));
        int n = o->letter ? snprintf(left, sizeof(left), "-%c, ", o->letter) : 0;
        snprintf(left + n, sizeof(left) - (size_t)n, "--%s%s%s", o->flag, o->arg ? " " : "",
                 o->arg ? o->arg : "");
        snprintf(vars, sizeof(vars), "%s%s%s%s%s", o->env ? o->env : "",
                 o->env && o->pet ? ", " : "", o->pet ? pet : "", o->def ? ", default " : "",
                 o->def ? o->def : "");
        char help[600];
        snprintf(help, sizeof(help), "%s%s", o->ignored ? "ignored: " : "",
                 o->ignored ? o->ignored : o->help);
        help_print(f, left, help);
        fprintf(f, "  %-34s [%s]\n", "", vars);
    }
    fprintf(f, "  %-34s %s\n", "-h, --help", "this text");
}

void agent_early_error(const char *fmt, ...)
{
    char *msg = NULL;
    va_list ap;
    va_start(ap, fmt);
    if (vasprintf(&msg, fmt, ap) < 0) msg = NULL;
    va_end(ap);
    fprintf(stderr, "ductile-agent: %s\n", msg ? msg : fmt); /* one line, one write */
    free(msg);
}

int agent_parse_int(const char *s, long min, long max, int *out)
{
    int64_t v;
    if (ctl_int(s, min, max, &v) != 0) return -1;
    *out = (int)v;
    return 0;
}

/* Seconds (decimals allowed) in [min_s, max_s] to milliseconds. */
static int parse_secs(const char *s, double min_s, double max_s, int *ms)
{
    if (!s || !*s) return -1;
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v) || v < min_s || v > max_s) return -1;
    *ms = (int)(v * 1000.0 + 0.5); /* v >= 0; not lround: the agent needs no libm */
    return 0;
}

static int parse_bool(const char *s, int *out)
{
    const char *yes[] = {"1", "true", "yes", "on"}, *no[] = {"0", "false", "no", "off", ""};
    for (size_t i = 0; i < 4; i++)
        if (strcasecmp(s, yes[i]) == 0) return *out = 1, 0;
    for (size_t i = 0; i < 5; i++)
        if (strcasecmp(s, no[i]) == 0) return *out = 0, 0;
    return -1;
}

#define PRELOAD_MAX 256 /* --preload's longest value */

/* A dotted Python name: identifiers joined by single dots. */
static int module_name_valid(const char *s, size_t n)
{
    int at_start = 1;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '.') {
            if (at_start) return 0;
            at_start = 1;
        } else if (isalpha(c) || c == '_' || (!at_start && isdigit(c))) {
            at_start = 0;
        } else {
            return 0;
        }
    }
    return n > 0 && !at_start;
}

/* auto, none, or MODULE[,MODULE...]. */
static int preload_valid(const char *preload)
{
    if (strcmp(preload, "auto") == 0 || strcmp(preload, "none") == 0) return 1;
    size_t len = strlen(preload);
    if (len == 0 || len > PRELOAD_MAX) return 0;
    for (const char *p = preload;;) {
        const char *comma = strchr(p, ',');
        size_t n = comma ? (size_t)(comma - p) : strlen(p);
        if (!module_name_valid(p, n)) return 0;
        if (!comma) return 1;
        p = comma + 1;
    }
}

/* GPUs on this node, as the NVIDIA driver's device files show them. */
static int count_gpus(void)
{
    int n = 0;
    for (int i = 0; i < 64; i++) {
        char path[32];
        snprintf(path, sizeof(path), "/dev/nvidia%d", i);
        if (access(path, F_OK) == 0) n++;
    }
    return n;
}

static void note(agent_opts *o, int slot, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Keeps one line for the log about option slot (the last one said wins). */
static void note(agent_opts *o, int slot, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(o->notes[slot], sizeof(o->notes[slot]), fmt, ap);
    va_end(ap);
}

static int one_of(const char *v, const char *const *names)
{
    for (; *names; names++)
        if (strcmp(v, *names) == 0) return 1;
    return 0;
}

static int opt_set(agent_opts *o, agent_opt_id id, const char *v, char *why, size_t len);

static int set_bool(const char *v, int *out, char *why, size_t len)
{
    if (parse_bool(v, out) == 0) return 0;
    snprintf(why, len, "'%s' is not true or false", v);
    return -1;
}

/* --rdzv-conf torchrun's KEY=VALUE,...: the keys of its c10d and etcd
 * rendezvous that mean something here set that option; the others are
 * named in a note. An unknown key is an error. */
static int rdzv_conf_set(agent_opts *o, const char *v, char *why, size_t len)
{
    static const char *const unused[] = {"read_timeout", "close_timeout", "is_host", "use_libuv",
                                         NULL};
    char ignored[256] = "";
    int k = 0;
    while (k < AGENT_CONF_MAX && o->conf_buf[k])
        k++;
    if (k == AGENT_CONF_MAX) {
        snprintf(why, len, "given more than %d times", AGENT_CONF_MAX);
        return -1;
    }
    char *buf = o->conf_buf[k] = strdup(v); /* the values point into it */
    if (!buf) {
        snprintf(why, len, "out of memory");
        return -1;
    }
    char *save = NULL;
    for (char *kv = strtok_r(buf, ",", &save); kv; kv = strtok_r(NULL, ",", &save)) {
        char *val = strchr(kv, '=');
        if (!val) {
            snprintf(why, len, "'%s' is not KEY=VALUE", kv);
            return -1;
        }
        *val++ = 0;
        char sub[200];
        int rc = 0, ka = 0;
        agent_opt_id target = OPT_COUNT;
        if (strcmp(kv, "timeout") == 0 || strcmp(kv, "join_timeout") == 0) {
            target = OPT_JOIN_TIMEOUT;
        } else if (strcmp(kv, "last_call_timeout") == 0) {
            target = OPT_LAST_CALL;
        } else if (strcmp(kv, "cacert") == 0 || strcmp(kv, "cert") == 0 || strcmp(kv, "key") == 0) {
            target = kv[1] == 'a' ? OPT_CACERT : kv[1] == 'e' ? OPT_CERT : OPT_KEY;
        } else if (strcmp(kv, "protocol") == 0) {
            if (strcmp(val, "http") != 0 && strcmp(val, "https") != 0) {
                snprintf(why, len, "protocol '%s' is not http or https", val);
                return -1;
            }
            o->https = strcmp(val, "https") == 0;
        } else if (strcmp(kv, "keep_alive_interval") == 0) {
            ka = 1;
            rc = parse_secs(val, 0.1, 3600, &o->keep_alive_ms);
        } else if (strcmp(kv, "keep_alive_max_attempt") == 0) {
            ka = 1;
            rc = agent_parse_int(val, 1, 1000, &o->keep_alive_attempts);
        } else if (one_of(kv, unused)) {
            size_t n = strlen(ignored);
            snprintf(ignored + n, sizeof(ignored) - n, "%s%s", n ? ", " : "", kv);
        } else {
            snprintf(why, len,
                     "unknown key '%s' (known: timeout, join_timeout, last_call_timeout, "
                     "keep_alive_interval, keep_alive_max_attempt, cacert, cert, key, protocol, "
                     "read_timeout, close_timeout, is_host, use_libuv)",
                     kv);
            return -1;
        }
        if (rc != 0) {
            snprintf(why, len, "%s: '%s' is not a number in range", kv, val);
            return -1;
        }
        if (target != OPT_COUNT && opt_set(o, target, val, sub, sizeof(sub)) != 0) {
            snprintf(why, len, "%s: %s", kv, sub);
            return -1;
        }
        if (ka) {
            /* torch declares a node dead after max_attempt missed keep-alives:
             * that is the lease TTL. */
            long ttl = ((long)o->keep_alive_ms * o->keep_alive_attempts + 999) / 1000;
            if (ttl < 2 || ttl > 3600) {
                snprintf(why, len,
                         "keep_alive_interval x keep_alive_max_attempt is %ld s: the lease TTL "
                         "must be 2..3600",
                         ttl);
                return -1;
            }
            o->lease_ttl_s = (int)ttl;
        }
    }
    if (ignored[0])
        note(o, OPT_RDZV_CONF,
             "--rdzv-conf %s ignored: etcd holds the rendezvous (no node hosts a store) and "
             "the etcd client keeps its own deadlines",
             ignored);
    return 0;
}

/* Sets one option from text; on error writes why (without the flag name). */
static int opt_set(agent_opts *o, agent_opt_id id, const char *v, char *why, size_t len)
{
    switch (id) {
    case OPT_NNODES: {
        const char *colon = strchr(v, ':');
        int a, b;
        if (colon) {
            char first[32];
            size_t n = (size_t)(colon - v);
            if (n >= sizeof(first)) goto bad_nnodes;
            memcpy(first, v, n);
            first[n] = 0;
            if (agent_parse_int(first, 1, 100000, &a) || agent_parse_int(colon + 1, 1, 100000, &b))
                goto bad_nnodes;
        } else {
            if (agent_parse_int(v, 1, 100000, &a)) goto bad_nnodes;
            b = a;
        }
        if (a > b) {
            snprintf(why, len, "'%s': MIN is larger than MAX", v);
            return -1;
        }
        o->min_nodes = a;
        o->max_nodes = b;
        return 0;
    bad_nnodes:
        snprintf(why, len, "'%s' is not N or MIN:MAX with 1 <= MIN <= MAX <= 100000", v);
        return -1;
    }
    case OPT_NPROC: {
        /* torchrun's names: one worker per GPU, per CPU, or GPUs if any. */
        int gpus = strcmp(v, "gpu") == 0 || strcmp(v, "auto") == 0 ? count_gpus() : 0;
        if (strcmp(v, "gpu") == 0 && gpus == 0) {
            snprintf(why, len, "'gpu' but no GPU (/dev/nvidiaN) is present");
            return -1;
        }
        if (gpus > 0) return o->nproc = gpus, 0;
        if (strcmp(v, "cpu") == 0 || strcmp(v, "auto") == 0) {
            long cpus = sysconf(_SC_NPROCESSORS_ONLN);
            o->nproc = cpus < 1 ? 1 : cpus > 1024 ? 1024 : (int)cpus;
            return 0;
        }
        if (agent_parse_int(v, 1, 1024, &o->nproc) == 0) return 0;
        snprintf(why, len, "'%s' is not 1..1024, auto, cpu or gpu", v);
        return -1;
    }
    case OPT_ENDPOINT:
        if (*v) return o->endpoint = v, 0;
        snprintf(why, len, "must not be empty");
        return -1;
    case OPT_ID:
        if (rdzv_job_id_valid(v)) return o->job = v, 0;
        snprintf(why, len, "'%s' is not a job id [a-z0-9][a-z0-9-]{0,62}", v);
        return -1;
    case OPT_MAX_RESTARTS:
        if (agent_parse_int(v, 0, 1000000, &o->max_restarts) == 0) return 0;
        snprintf(why, len, "'%s' is not a whole number in 0..1000000", v);
        return -1;
    case OPT_NODE_ID:
        if (rdzv_node_id_valid(v)) return o->node_id = v, 0;
        snprintf(why, len, "'%s' is not a node id [A-Za-z0-9._-]{1,128}", v);
        return -1;
    case OPT_NODE_ADDR:
        if (*v && strlen(v) < 256 && !strpbrk(v, " \t\n/")) return o->node_addr = v, 0;
        snprintf(why, len, "'%s' is not a host name or address", v);
        return -1;
    case OPT_LEASE_TTL:
        if (agent_parse_int(v, 2, 3600, &o->lease_ttl_s) == 0) return 0;
        snprintf(why, len, "'%s' is not a whole number of seconds in 2..3600", v);
        return -1;
    case OPT_LAST_CALL:
        if (parse_secs(v, 0, 3600, &o->last_call_ms) == 0) return 0;
        snprintf(why, len, "'%s' is not a number of seconds in 0..3600", v);
        return -1;
    case OPT_JOIN_TIMEOUT:
        if (parse_secs(v, 0.1, 86400, &o->join_timeout_ms) == 0) return 0;
        snprintf(why, len, "'%s' is not a number of seconds in 0.1..86400", v);
        return -1;
    case OPT_SHUTDOWN_TIMEOUT:
        if (parse_secs(v, 0.1, 3600, &o->shutdown_timeout_ms) == 0) return 0;
        snprintf(why, len, "'%s' is not a number of seconds in 0.1..3600", v);
        return -1;
    case OPT_STOP_GRACE:
        if (parse_secs(v, 0, 3600, &o->stop_grace_ms) == 0) return 0;
        snprintf(why, len, "'%s' is not a number of seconds in 0..3600", v);
        return -1;
    case OPT_HANG_TIMEOUT:
        if (strcmp(v, "auto") == 0) return o->hang_timeout_ms = 0, 0;
        if (parse_secs(v, 1, 86400, &o->hang_timeout_ms) == 0) return 0;
        snprintf(why, len, "'%s' is not auto or a number of seconds in 1..86400", v);
        return -1;
    case OPT_REBUILD:
        if (strcmp(v, "restart") == 0) return o->inplace = 0, 0;
        if (strcmp(v, "inplace") == 0) return o->inplace = 1, 0;
        snprintf(why, len, "'%s' is not restart or inplace", v);
        return -1;
    case OPT_STANDALONE:
        return set_bool(v, &o->standalone, why, len);
    case OPT_K8S_EVENTS:
        return set_bool(v, &o->k8s_events, why, len);
    case OPT_HTTP_PORT:
        if (agent_parse_int(v, 0, 65535, &o->http_port) == 0) return 0;
        snprintf(why, len, "'%s' is not a port in 0..65535", v);
        return -1;
    case OPT_LEAVE_EXIT_CODE:
        if (agent_parse_int(v, 0, 255, &o->leave_exit_code) == 0) return 0;
        snprintf(why, len, "'%s' is not an exit status in 0..255", v);
        return -1;
    case OPT_LOG_FORMAT:
        if (strcmp(v, "text") == 0) return o->json_log = 0, 0;
        if (strcmp(v, "json") == 0) return o->json_log = 1, 0;
        snprintf(why, len, "'%s' is not text or json", v);
        return -1;
    case OPT_ROLE:
        if (*v && !strpbrk(v, " \t\n")) return o->role = v, 0;
        snprintf(why, len, "'%s' is not a role name", v);
        return -1;
    case OPT_PRELOAD:
        if (preload_valid(v)) return o->preload = v, 0;
        snprintf(why, len,
                 "'%.100s' is not auto, none or a comma list of Python module names (at most "
                 "%d characters)",
                 v, PRELOAD_MAX);
        return -1;
    case OPT_CACERT:
        return o->cacert = v, 0;
    case OPT_CERT:
        return o->cert = v, 0;
    case OPT_KEY:
        return o->key = v, 0;
    case OPT_USER:
        return o->user = v, 0;
    case OPT_PASSWORD:
        return o->password = v, 0;
    case OPT_INSTALL_ID:
        if (!*v || rdzv_install_id_valid(v)) return o->install_id = *v ? v : NULL, 0;
        snprintf(why, len, "'%.80s' is not an install id [A-Za-z0-9-]{1,64}", v);
        return -1;
    case OPT_START_OVER:
        return set_bool(v, &o->start_over, why, len);
    case OPT_RDZV_BACKEND: {
        static const char *const names[] = {"etcd-v2", "etcd", "c10d", "static", NULL};
        if (!one_of(v, names)) {
            snprintf(why, len, "'%s' is not etcd-v2, etcd, c10d or static", v);
            return -1;
        }
        note(o, id, "--rdzv-backend %s: the rendezvous is etcd (v3 API) at --rdzv-endpoint%s", v,
             v[0] == 'e' ? "" : ", which must name an etcd, not a torch TCPStore");
        return 0;
    }
    case OPT_RDZV_CONF:
        return rdzv_conf_set(o, v, why, len);
    case OPT_MODULE:
        return set_bool(v, &o->module, why, len);
    case OPT_NO_PYTHON:
        return set_bool(v, &o->no_python, why, len);
    case OPT_RUN_PATH:
        return set_bool(v, &o->run_path, why, len);
    case OPT_LOG_DIR:
        if (*v) return o->log_dir = v, 0;
        snprintf(why, len, "must not be empty");
        return -1;
    case OPT_REDIRECTS:
    case OPT_TEE:
        if (agent_logs_std(v, -1) < 0) {
            snprintf(why, len, "'%s' is not N or LOCAL_RANK:N,... with N 0..3", v);
            return -1;
        }
        *(id == OPT_TEE ? &o->tee : &o->redirects) = v;
        return 0;
    case OPT_LOCAL_RANKS_FILTER:
        if (agent_logs_shown(v, -1) >= 0) return o->ranks_filter = *v ? v : NULL, 0;
        snprintf(why, len, "'%s' is not a comma-separated list of local ranks", v);
        return -1;
    case OPT_LOCAL_ADDR:
        return opt_set(o, OPT_NODE_ADDR, v, why, len);
    case OPT_MONITOR_INTERVAL: {
        int ms;
        if (parse_secs(v, 0, 86400, &ms) == 0) return 0;
        snprintf(why, len, "'%s' is not a number of seconds", v);
        return -1;
    }
    case OPT_START_METHOD: {
        static const char *const names[] = {"spawn", "fork", "forkserver", NULL};
        if (one_of(v, names)) return 0;
        snprintf(why, len, "'%s' is not spawn, fork or forkserver", v);
        return -1;
    }
    case OPT_NUMA_BINDING: {
        static const char *const names[] = {"node", "socket", "exclusive", "core-complex", NULL};
        if (one_of(v, names)) return 0;
        snprintf(why, len, "'%s' is not node, socket, exclusive or core-complex", v);
        return -1;
    }
    case OPT_NODE_RANK:
    case OPT_MASTER_PORT: {
        int n, port = id == OPT_MASTER_PORT;
        if (agent_parse_int(v, 0, port ? 65535 : 100000, &n) == 0) return 0;
        snprintf(why, len, "'%s' is not a %s", v, port ? "port in 0..65535" : "node rank");
        return -1;
    }
    case OPT_VIRTUAL_LOCAL_RANK: {
        int on;
        return set_bool(v, &on, why, len);
    }
    case OPT_EVENT_LOG_HANDLER:
    case OPT_LOG_LINE_PREFIX_TEMPLATE:
    case OPT_DUPLICATE_STDOUT_FILTERS:
    case OPT_DUPLICATE_STDERR_FILTERS:
    case OPT_MASTER_ADDR:
    case OPT_LOGS_SPECS:
    case OPT_SIGNALS_TO_HANDLE:
    case OPT_PRINT_COMPLETION:
        return 0;
    default:
        break;
    }
    snprintf(why, len, "unknown option");
    return -1;
}

/* Finds a flag by its name; torchrun's underscore spellings are accepted.
 * A name of one letter is a short flag (-m, -r, -t). */
static int opt_find(const char *name, size_t n)
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

static void default_node_addr(agent_opts *o)
{
    snprintf(o->node_addr_buf, sizeof(o->node_addr_buf), "127.0.0.1");
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs) == 0) {
        for (struct ifaddrs *i = ifs; i; i = i->ifa_next) {
            if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
            if ((i->ifa_flags & IFF_LOOPBACK) || !(i->ifa_flags & IFF_UP)) continue;
            struct sockaddr_in *sin = (struct sockaddr_in *)i->ifa_addr;
            inet_ntop(AF_INET, &sin->sin_addr, o->node_addr_buf, sizeof(o->node_addr_buf));
            break;
        }
        freeifaddrs(ifs);
    }
    o->node_addr = o->node_addr_buf;
}

/* Sets option id from text that came from origin (a flag or a variable). */
static int opt_apply(agent_opts *o, int id, const char *v, const char *origin)
{
    char why[400];
    if (opt_set(o, (agent_opt_id)id, v, why, sizeof(why)) != 0) {
        agent_early_error("%s: %s", origin, why);
        return -1;
    }
    if (agent_opt_table[id].ignored)
        note(o, id, "%s is ignored: %s", origin, agent_opt_table[id].ignored);
    return 0;
}

/* The command: exactly argv after "--" or with --no-python, else torchrun's
 * PYTHON -u [-m] SCRIPT ARGS. */
static int command_build(agent_opts *o, char **argv, int argc, int dashdash)
{
    if (o->module && (dashdash || (o->no_python && !o->run_path))) {
        agent_early_error(dashdash ? "-m: the module must come first, not after --"
                                   : "--no-python and -m cannot be used together (as in torchrun)");
        return -1;
    }
    if (dashdash || (o->no_python && !o->run_path)) return o->cmd = argv, 0;
    const char *py = getenv("DUCTILE_PYTHON");
    if (!py || !*py) py = getenv("PYTHON_EXEC");
    if (!py || !*py) py = "python3";
    if (!(o->cmd_buf = calloc((size_t)argc + 4, sizeof(char *)))) {
        agent_early_error("out of memory");
        return -1;
    }
    int n = 0;
    o->cmd_buf[n++] = (char *)py;
    o->cmd_buf[n++] = "-u"; /* as torchrun: unbuffered, so lines come as they are printed */
    if (o->module) o->cmd_buf[n++] = "-m";
    for (int i = 0; i < argc; i++)
        o->cmd_buf[n++] = argv[i];
    o->cmd = o->cmd_buf;
    return 0;
}

/* --rdzv-conf protocol=https: https:// for the endpoints given without a
 * scheme (torchrun's host:port form), which are otherwise http://. */
static int endpoints_https(agent_opts *o)
{
    size_t len = strlen(o->endpoint);
    if (!(o->endpoint_buf = malloc(len * 2 + 16))) return -1;
    char *out = o->endpoint_buf;
    for (const char *p = o->endpoint; *p;) {
        size_t n = strcspn(p, ",");
        const char *sep = strstr(p, "://");
        out += sprintf(out, "%s%.*s", sep && sep < p + n ? "" : "https://", (int)n, p);
        p += n;
        if (*p) *out++ = *p++;
    }
    *out = 0;
    o->endpoint = o->endpoint_buf;
    return 0;
}

void agent_opts_free(agent_opts *o)
{
    free(o->cmd_buf);
    free(o->endpoint_buf);
    for (int i = 0; i < AGENT_CONF_MAX; i++)
        free(o->conf_buf[i]);
    o->cmd_buf = NULL;
    o->endpoint_buf = NULL;
    memset(o->conf_buf, 0, sizeof(o->conf_buf));
}

int agent_opts_parse(int argc, char **argv, agent_opts *o)
{
    memset(o, 0, sizeof(*o));
    char why[300];
    o->keep_alive_ms = 5000; /* torch's c10d keep-alive defaults */
    o->keep_alive_attempts = 3;
    for (int i = 0; i < OPT_COUNT; i++) {
        const agent_opt *t = &agent_opt_table[i];
        /* torchrun's own (no DUCTILE_* variable): their defaults are its, shown only */
        if (t->env && t->def && i != OPT_NODE_ID && i != OPT_NODE_ADDR && i != OPT_HTTP_PORT &&
            i != OPT_STANDALONE && opt_set(o, (agent_opt_id)i, t->def, why, sizeof(why)) != 0)
            abort(); /* the table's defaults are valid */
    }
    /* DUCTILE_* over PET_*: a variable set for ductile wins over torchrun's. */
    for (int i = 0; i < OPT_COUNT; i++) {
        const agent_opt *t = &agent_opt_table[i];
        char pet[64];
        pet_name(t, pet, sizeof(pet));
        const char *name = t->env && getenv(t->env) ? t->env : t->pet ? pet : NULL;
        const char *v = name ? getenv(name) : NULL;
        if (v && opt_apply(o, i, v, name) != 0) return -1;
    }
    int i = 1, dashdash = 0;
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--") == 0) {
            i++;
            dashdash = 1;
            break;
        }
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            return 1;
        }
        if (a[0] != '-' || !a[1]) break; /* the command starts here, as in torchrun */
        /* --flag, --flag=V, --flag V; -m; -r V, -rV, -r=V */
        const char *name = a[1] == '-' ? a + 2 : a + 1;
        const char *inline_v = NULL;
        size_t n;
        if (a[1] == '-') {
            const char *eq = strchr(name, '=');
            n = eq ? (size_t)(eq - name) : strlen(name);
            inline_v = eq ? eq + 1 : NULL;
        } else {
            n = 1;
            inline_v = a[2] ? a + 2 + (a[2] == '=') : NULL;
        }
        int id = opt_find(name, n);
        if (id < 0 || (n == 1 && a[1] == '-')) {
            agent_early_error("unknown option '%s' (see --help)", a);
            return -1;
        }
        const agent_opt *t = &agent_opt_table[id];
        const char *v;
        if (!t->arg) {
            if (inline_v && a[1] != '-') {
                agent_early_error("unknown option '%s' (see --help)", a);
                return -1;
            }
            v = inline_v ? inline_v : "true";
        } else if (inline_v) {
            v = inline_v;
        } else if (i + 1 < argc) {
            v = argv[++i];
        } else {
            agent_early_error("--%s needs a value (%s)", t->flag, t->arg);
            return -1;
        }
        char origin[80];
        snprintf(origin, sizeof(origin), "--%s", t->flag);
        if (opt_apply(o, id, v, origin) != 0) return -1;
    }
    if (i >= argc) {
        agent_early_error("no worker command given (ductile-agent [options] -- COMMAND ARGS..., "
                          "or SCRIPT.py ARGS... as with torchrun)");
        return -1;
    }
    if (command_build(o, argv + i, argc - i, dashdash) != 0) return -1;
    if (!o->standalone && !o->endpoint) {
        agent_early_error(
            "--rdzv-endpoint (DUCTILE_RDZV_ENDPOINT) is required unless --standalone");
        return -1;
    }
    if (o->https && o->endpoint && endpoints_https(o) != 0) {
        agent_early_error("out of memory");
        return -1;
    }
    if (!o->job) {
        if (!o->standalone) {
            agent_early_error("--rdzv-id (DUCTILE_RDZV_ID) is required unless --standalone");
            return -1;
        }
        o->job = "standalone";
    }
    if (!o->node_id) {
        if (gethostname(o->node_id_buf, sizeof(o->node_id_buf) - 1) != 0 ||
            !rdzv_node_id_valid(o->node_id_buf)) {
            agent_early_error("the host name is not a usable node id: set --node-id");
            return -1;
        }
        o->node_id = o->node_id_buf;
    }
    if (!o->node_addr) default_node_addr(o);
    if (!o->role) o->role = "default";
    return 0;
}
