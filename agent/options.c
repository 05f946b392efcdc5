/* options.c: the agent's options: flags, DUCTILE_* variables, defaults.
 *
 * One table lists every option once: its flag, its variable, its default
 * and its help line. --help prints the table; parsing applies the defaults,
 * then the environment, then the command line, each value through the same
 * opt_set(), so a flag and its variable are checked alike and a bad value
 * is one line naming where it came from.
 */
#include "options.h"

#include "ductile/control.h" /* ctl_int: one integer parser */

#include <arpa/inet.h>
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
    OPT_LOG_FORMAT,
    OPT_LEAVE_EXIT_CODE,
    OPT_ROLE,
    OPT_CACERT,
    OPT_CERT,
    OPT_KEY,
    OPT_USER,
    OPT_PASSWORD,
    OPT_COUNT
} agent_opt_id;

typedef struct agent_opt {
    const char *flag; /* without the leading "--" */
    const char *env;
    const char *arg; /* NULL for a switch */
    const char *def; /* NULL: no default */
    const char *help;
} agent_opt;

static const agent_opt agent_opt_table[OPT_COUNT] = {
    [OPT_NNODES] = {"nnodes", "DUCTILE_NNODES", "N|MIN:MAX", "1:1",
                    "nodes in the job; the job runs with MIN and grows to MAX"},
    [OPT_NPROC] = {"nproc-per-node", "DUCTILE_NPROC_PER_NODE", "K|auto|cpu|gpu", "1",
                   "workers on this node: K, one per GPU, per CPU, or auto (GPUs if any)"},
    [OPT_ENDPOINT] = {"rdzv-endpoint", "DUCTILE_RDZV_ENDPOINT", "URL[,URL...]", NULL,
                      "etcd endpoints (required unless --standalone)"},
    [OPT_ID] = {"rdzv-id", "DUCTILE_RDZV_ID", "JOB", NULL,
                "job id [a-z0-9][a-z0-9-]{0,62} (required unless --standalone)"},
    [OPT_MAX_RESTARTS] = {"max-restarts", "DUCTILE_MAX_RESTARTS", "N", "0",
                          "restarts after failures allowed for the whole job (kept in etcd)"},
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
                          "a round must form within this, else the agent exits 1"},
    [OPT_SHUTDOWN_TIMEOUT] = {"shutdown-timeout", "DUCTILE_SHUTDOWN_TIMEOUT", "SECONDS", "20",
                              "on SIGTERM/SIGINT: stop workers, leave and exit within this"},
    [OPT_STOP_GRACE] = {"stop-grace", "DUCTILE_STOP_GRACE", "SECONDS", "5",
                        "between SIGTERM and SIGKILL when stopping workers for a new round (a "
                        "graceful change gives them --shutdown-timeout to finish the step)"},
    [OPT_HANG_TIMEOUT] = {"hang-timeout", "DUCTILE_HANG_TIMEOUT", "SECONDS|auto", "auto",
                          "kill a worker that reported a step and then makes no progress in "
                          "local work, or falls silent, this long (waits on peers are bounded "
                          "by the worker's own timeouts); auto: 10x the longest local stretch "
                          "seen on this node, at least 120 (1..86400)"},
    [OPT_REBUILD] = {"rebuild", "DUCTILE_REBUILD", "restart|inplace", "restart",
                     "restart: relaunch workers each round; inplace: keep them, send "
                     "rounds on DUCTILE_CONTROL_FD"},
    [OPT_STANDALONE] = {"standalone", "DUCTILE_STANDALONE", NULL, "off",
                        "run a private etcd on a free loopback port (one-machine runs)"},
    [OPT_HTTP_PORT] = {"http-port", "DUCTILE_HTTP_PORT", "PORT", "0 (off)",
                       "serve /healthz, /readyz and /metrics on this port"},
    [OPT_LOG_FORMAT] = {"log-format", "DUCTILE_LOG_FORMAT", "text|json", "text",
                        "one log line per event, as text or JSON"},
    [OPT_LEAVE_EXIT_CODE] = {"leave-exit-code", "DUCTILE_LEAVE_EXIT_CODE", "CODE", "0",
                             "exit status after leaving a job that is still running on "
                             "SIGTERM/SIGINT (5 under a Kubernetes Job: the pod is replaced, "
                             "not complete)"},
    [OPT_ROLE] = {"role", "DUCTILE_ROLE", "NAME", "default", "ROLE_NAME given to workers"},
    [OPT_CACERT] = {"etcd-cacert", "DUCTILE_ETCD_CACERT", "FILE", NULL,
                    "CA certificate to verify etcd (PEM)"},
    [OPT_CERT] = {"etcd-cert", "DUCTILE_ETCD_CERT", "FILE", NULL, "client certificate (PEM)"},
    [OPT_KEY] = {"etcd-key", "DUCTILE_ETCD_KEY", "FILE", NULL, "client key (PEM)"},
    [OPT_USER] = {"etcd-user", "DUCTILE_ETCD_USER", "NAME", NULL, "etcd user name"},
    [OPT_PASSWORD] = {"etcd-password", "DUCTILE_ETCD_PASSWORD", "PASSWORD", NULL, "etcd password"},
};

static void usage(FILE *f)
{
    fprintf(f, "usage: ductile-agent [options] [--] COMMAND ARGS...\n"
               "       ductile-agent status --rdzv-endpoint URL --rdzv-id JOB [--json]\n"
               "       ductile-agent reset --rdzv-endpoint URL --rdzv-id JOB\n\n"
               "Runs COMMAND as K workers per node of an elastic job whose nodes meet in\n"
               "etcd. Every option also comes from its environment variable; the command\n"
               "line wins. Durations are seconds and may have decimals. Worker output is\n"
               "passed through as \"[RANK] line\" (stdout to stdout, stderr to stderr); the\n"
               "agent's own log lines go to stderr, those at DUCTILE_LOG_LEVEL (error, warn,\n"
               "info or debug; default info) or more severe.\n\n");
    for (int i = 0; i < OPT_COUNT; i++) {
        const agent_opt *o = &agent_opt_table[i];
        char left[64];
        snprintf(left, sizeof(left), "--%s%s%s", o->flag, o->arg ? " " : "", o->arg ? o->arg : "");
        fprintf(f, "  %-34s %s\n  %-34s [%s%s%s]\n", left, o->help, "", o->env,
                o->def ? ", default " : "", o->def ? o->def : "");
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
    *ms = (int)lround(v * 1000.0);
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
        if (parse_bool(v, &o->standalone) == 0) return 0;
        snprintf(why, len, "'%s' is not true or false", v);
        return -1;
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
    default:
        break;
    }
    snprintf(why, len, "unknown option");
    return -1;
}

/* Finds a flag by its name; torchrun's underscore spellings are accepted. */
static int opt_find(const char *name, size_t n)
{
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

int agent_opts_parse(int argc, char **argv, agent_opts *o)
{
    memset(o, 0, sizeof(*o));
    char why[300];
    for (int i = 0; i < OPT_COUNT; i++) {
        const agent_opt *t = &agent_opt_table[i];
        if (t->def && i != OPT_NODE_ID && i != OPT_NODE_ADDR && i != OPT_HTTP_PORT &&
            i != OPT_STANDALONE && opt_set(o, (agent_opt_id)i, t->def, why, sizeof(why)) != 0)
            abort(); /* the table's defaults are valid */
    }
    for (int i = 0; i < OPT_COUNT; i++) {
        const char *v = getenv(agent_opt_table[i].env);
        if (!v) continue;
        if (opt_set(o, (agent_opt_id)i, v, why, sizeof(why)) != 0) {
            agent_early_error("%s: %s", agent_opt_table[i].env, why);
            return -1;
        }
    }
    int i = 1;
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--") == 0) {
            i++;
            break;
        }
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            return 1;
        }
        if (strncmp(a, "--", 2) != 0) break; /* the command starts here */
        const char *name = a + 2;
        const char *eq = strchr(name, '=');
        size_t n = eq ? (size_t)(eq - name) : strlen(name);
        int id = opt_find(name, n);
        if (id < 0) {
            agent_early_error("unknown option '%s' (see --help)", a);
            return -1;
        }
        const agent_opt *t = &agent_opt_table[id];
        const char *v;
        if (!t->arg) {
            v = eq ? eq + 1 : "true";
        } else if (eq) {
            v = eq + 1;
        } else if (i + 1 < argc) {
            v = argv[++i];
        } else {
            agent_early_error("--%s needs a value (%s)", t->flag, t->arg);
            return -1;
        }
        if (opt_set(o, (agent_opt_id)id, v, why, sizeof(why)) != 0) {
            agent_early_error("--%s: %s", t->flag, why);
            return -1;
        }
    }
    if (i >= argc) {
        agent_early_error("no worker command given (ductile-agent [options] -- COMMAND ARGS...)");
        return -1;
    }
    o->cmd = argv + i;
    if (!o->standalone && !o->endpoint) {
        agent_early_error(
            "--rdzv-endpoint (DUCTILE_RDZV_ENDPOINT) is required unless --standalone");
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
