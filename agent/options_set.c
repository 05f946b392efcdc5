/* options_set.c: one option's value, from text into agent_opts.
 *
 * agent_opt_set() is the one place a value is checked, whether it came from
 * a default, a variable or a flag; on error it writes why, and the caller
 * (options_parse.c) names where the value came from. The setters go by
 * group: the rendezvous and etcd, the workers and this agent, torchrun's
 * flags that mean something here (--rdzv-conf among them), and torchrun's
 * flags that are only checked (the table says why each is ignored).
 */
#include "options_table.h"
#include "logs.h"

#include "ductile/control.h" /* ctl_int: one integer parser */

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

/* A group's setter returns this for an option of another group. */
enum { OPT_NOT_MINE = 1 };

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

void agent_opt_note(agent_opts *o, int slot, const char *fmt, ...)
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

static int set_bool(const char *v, int *out, char *why, size_t len)
{
    if (parse_bool(v, out) == 0) return 0;
    snprintf(why, len, "'%s' is not true or false", v);
    return -1;
}
/* One KEY=VALUE of --rdzv-conf; a key with no use here is added to ignored. */
static int rdzv_conf_key(agent_opts *o, char *kv, char *val, char *ignored, size_t ignored_len,
                         char *why, size_t len)
{
    static const char *const unused[] = {"read_timeout", "close_timeout", "is_host", "use_libuv",
                                         NULL};
    char sub[200];
    int rc = 0;
    agent_opt_id target = OPT_COUNT;
    if (strcmp(kv, "timeout") == 0 || strcmp(kv, "join_timeout") == 0) {
        target = OPT_JOIN_TIMEOUT;
    } else if (strcmp(kv, "last_call_timeout") == 0) {
        target = OPT_LAST_CALL;
    } else if (strcmp(kv, "cacert") == 0 || strcmp(kv, "cert") == 0 || strcmp(kv, "key") == 0) {
        target = kv[0] == 'k' ? OPT_KEY : kv[1] == 'a' ? OPT_CACERT : OPT_CERT;
    } else if (strcmp(kv, "protocol") == 0) {
        if (strcmp(val, "http") != 0 && strcmp(val, "https") != 0) {
            snprintf(why, len, "protocol '%s' is not http or https", val);
            return -1;
        }
        o->https = strcmp(val, "https") == 0;
    } else if (strcmp(kv, "keep_alive_interval") == 0) {
        rc = parse_secs(val, 0.1, 3600, &o->keep_alive_ms);
    } else if (strcmp(kv, "keep_alive_max_attempt") == 0) {
        rc = agent_parse_int(val, 1, 1000, &o->keep_alive_attempts);
    } else if (one_of(kv, unused)) {
        size_t n = strlen(ignored);
        snprintf(ignored + n, ignored_len - n, "%s%s", n ? ", " : "", kv);
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
    if (target != OPT_COUNT && agent_opt_set(o, target, val, sub, sizeof(sub)) != 0) {
        snprintf(why, len, "%s: %s", kv, sub);
        return -1;
    }
    return 0;
}

/* torch declares a node dead after max_attempt missed keep-alives: that is
 * the lease TTL. */
static int rdzv_conf_lease_ttl(agent_opts *o, char *why, size_t len)
{
    long ttl = ((long)o->keep_alive_ms * o->keep_alive_attempts + 999) / 1000;
    if (ttl < 2 || ttl > 3600) {
        snprintf(why, len,
                 "keep_alive_interval x keep_alive_max_attempt is %ld s: the lease TTL "
                 "must be 2..3600",
                 ttl);
        return -1;
    }
    o->lease_ttl_s = (int)ttl;
    return 0;
}

/* --rdzv-conf torchrun's KEY=VALUE,...: the keys of its c10d and etcd
 * rendezvous that mean something here set that option; the others are
 * named in a note. An unknown key is an error. */
static int rdzv_conf_set(agent_opts *o, const char *v, char *why, size_t len)
{
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
        if (rdzv_conf_key(o, kv, val, ignored, sizeof(ignored), why, len) != 0) return -1;
        int ka =
            strcmp(kv, "keep_alive_interval") == 0 || strcmp(kv, "keep_alive_max_attempt") == 0;
        if (ka && rdzv_conf_lease_ttl(o, why, len) != 0) return -1;
    }
    if (ignored[0])
        agent_opt_note(o, OPT_RDZV_CONF,
                       "--rdzv-conf %s ignored: etcd holds the rendezvous (no node hosts a "
                       "store) and the etcd client keeps its own deadlines",
                       ignored);
    return 0;
}

/* --nnodes N or MIN:MAX. */
static int set_nnodes(agent_opts *o, const char *v, char *why, size_t len)
{
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

/* --nproc-per-node: torchrun's names: one worker per GPU, per CPU, or GPUs
 * if any. */
static int set_nproc(agent_opts *o, const char *v, char *why, size_t len)
{
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

/* The job, this node and the rendezvous: the nodes, etcd, the round's
 * timing. */
static int set_rdzv(agent_opts *o, agent_opt_id id, const char *v, char *why, size_t len)
{
    switch (id) {
    case OPT_NNODES:
        return set_nnodes(o, v, why, len);
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
    case OPT_STANDALONE:
        return set_bool(v, &o->standalone, why, len);
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
    default:
        return OPT_NOT_MINE;
    }
}

/* The workers and this agent: how many, how they are stopped and rebuilt,
 * what they are told; the agent's port, events and log. */
static int set_worker(agent_opts *o, agent_opt_id id, const char *v, char *why, size_t len)
{
    switch (id) {
    case OPT_NPROC:
        return set_nproc(o, v, why, len);
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
    default:
        return OPT_NOT_MINE;
    }
}

/* torchrun's flags that mean something here: its rendezvous, its command
 * forms, its log files. */
static int set_torchrun(agent_opts *o, agent_opt_id id, const char *v, char *why, size_t len)
{
    switch (id) {
    case OPT_RDZV_BACKEND: {
        static const char *const names[] = {"etcd-v2", "etcd", "c10d", "static", NULL};
        if (!one_of(v, names)) {
            snprintf(why, len, "'%s' is not etcd-v2, etcd, c10d or static", v);
            return -1;
        }
        agent_opt_note(o, id,
                       "--rdzv-backend %s: the rendezvous is etcd (v3 API) at --rdzv-endpoint%s", v,
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
        return agent_opt_set(o, OPT_NODE_ADDR, v, why, len);
    default:
        return OPT_NOT_MINE;
    }
}

/* torchrun's flags with no use here (the table says why): checked as
 * torchrun checks them, then dropped. */
static int set_ignored(agent_opt_id id, const char *v, char *why, size_t len)
{
    switch (id) {
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
        return OPT_NOT_MINE;
    }
}

int agent_opt_set(agent_opts *o, agent_opt_id id, const char *v, char *why, size_t len)
{
    int rc = set_rdzv(o, id, v, why, len);
    if (rc == OPT_NOT_MINE) rc = set_worker(o, id, v, why, len);
    if (rc == OPT_NOT_MINE) rc = set_torchrun(o, id, v, why, len);
    if (rc == OPT_NOT_MINE) rc = set_ignored(id, v, why, len);
    if (rc != OPT_NOT_MINE) return rc;
    snprintf(why, len, "unknown option");
    return -1;
}
