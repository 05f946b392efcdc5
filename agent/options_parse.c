/* options_parse.c: the agent's options from the environment and argv.
 *
 * agent_opts_parse() fills agent_opts from the table's defaults, then the
 * DUCTILE_* variables (over torchrun's PET_*), then the flags, each value
 * through agent_opt_set() (options_set.c); a bad one is one line naming the
 * flag or variable it came from. Then the command (after --, or torchrun's
 * PYTHON -u [-m] SCRIPT ARGS) and what the options imply: the endpoints'
 * scheme, the job, this node's id and address.
 */
#include "options_table.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

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
    if (agent_opt_set(o, (agent_opt_id)id, v, why, sizeof(why)) != 0) {
        agent_early_error("%s: %s", origin, why);
        return -1;
    }
    if (agent_opt_table[id].ignored)
        agent_opt_note(o, id, "%s is ignored: %s", origin, agent_opt_table[id].ignored);
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

/* The table's defaults, and torch's c10d keep-alive (for --rdzv-conf). */
static void opts_defaults(agent_opts *o)
{
    char why[300];
    o->keep_alive_ms = 5000; /* torch's c10d keep-alive defaults */
    o->keep_alive_attempts = 3;
    for (int i = 0; i < OPT_COUNT; i++) {
        const agent_opt *t = &agent_opt_table[i];
        /* torchrun's own (no DUCTILE_* variable): their defaults are its, shown only */
        if (t->env && t->def && i != OPT_NODE_ID && i != OPT_NODE_ADDR && i != OPT_HTTP_PORT &&
            i != OPT_STANDALONE && agent_opt_set(o, (agent_opt_id)i, t->def, why, sizeof(why)) != 0)
            abort(); /* the table's defaults are valid */
    }
}

/* DUCTILE_* over PET_*: a variable set for ductile wins over torchrun's. */
static int opts_env(agent_opts *o)
{
    for (int i = 0; i < OPT_COUNT; i++) {
        const agent_opt *t = &agent_opt_table[i];
        char pet[64];
        agent_opt_pet_name(t, pet, sizeof(pet));
        const char *name = t->env && getenv(t->env) ? t->env : t->pet ? pet : NULL;
        const char *v = name ? getenv(name) : NULL;
        if (v && opt_apply(o, i, v, name) != 0) return -1;
    }
    return 0;
}

/* The option at argv[*i]: --flag, --flag=V, --flag V; -m; -r V, -rV, -r=V.
 * *i is left on the last argument it used. */
static int opts_flag(agent_opts *o, int argc, char **argv, int *i)
{
    const char *a = argv[*i];
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
    int id = agent_opt_find(name, n);
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
    } else if (*i + 1 < argc) {
        v = argv[++*i];
    } else {
        agent_early_error("--%s needs a value (%s)", t->flag, t->arg);
        return -1;
    }
    char origin[80];
    snprintf(origin, sizeof(origin), "--%s", t->flag);
    return opt_apply(o, id, v, origin);
}

/* The options on the command line, up to "--" or the first argument that
 * is not one (the command starts there, as in torchrun): *cmd is its
 * index. Returns 1 after printing --help. */
static int opts_argv(agent_opts *o, int argc, char **argv, int *cmd, int *dashdash)
{
    int i = 1;
    *dashdash = 0;
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--") == 0) {
            i++;
            *dashdash = 1;
            break;
        }
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            agent_opts_usage(stdout);
            return 1;
        }
        if (a[0] != '-' || !a[1]) break;
        if (opts_flag(o, argc, argv, &i) != 0) return -1;
    }
    *cmd = i;
    return 0;
}

/* What the options imply or require once all are read. */
static int opts_finish(agent_opts *o)
{
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

int agent_opts_parse(int argc, char **argv, agent_opts *o)
{
    memset(o, 0, sizeof(*o));
    opts_defaults(o);
    if (opts_env(o) != 0) return -1;
    int i, dashdash, rc = opts_argv(o, argc, argv, &i, &dashdash);
    if (rc != 0) return rc;
    if (i >= argc) {
        agent_early_error("no worker command given (ductile-agent [options] -- COMMAND ARGS..., "
                          "or SCRIPT.py ARGS... as with torchrun)");
        return -1;
    }
    if (command_build(o, argv + i, argc - i, dashdash) != 0) return -1;
    return opts_finish(o);
}
