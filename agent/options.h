/* options.h: the agent's options (options.c).
 *
 * Every option is a flag and a DUCTILE_* variable with a default, listed
 * once in options.c's table, which --help prints: defaults first, then the
 * environment, then the command line wins.
 */
#ifndef DUCTILE_AGENT_OPTIONS_H
#define DUCTILE_AGENT_OPTIONS_H

#include "ductile/rdzv.h"

typedef struct agent_opts {
    int min_nodes, max_nodes;
    int nproc;
    const char *endpoint;
    const char *job;
    int max_restarts;
    const char *node_id;
    const char *node_addr;
    int lease_ttl_s;
    int last_call_ms;
    int join_timeout_ms;
    int shutdown_timeout_ms;
    int stop_grace_ms;
    int hang_timeout_ms; /* 0: auto */
    int inplace;
    int standalone;
    int http_port;
    int k8s_events;
    int json_log;
    int leave_exit_code;
    const char *role;
    const char *cacert, *cert, *key, *user, *password;
    char **cmd;
    char node_id_buf[RDZV_NODE_ID_MAX + 1];
    char node_addr_buf[64];
} agent_opts;

/* Fills o from defaults, then DUCTILE_* variables, then argv. Returns 0,
 * 1 when --help was printed, or -1 after printing a one-line error. */
int agent_opts_parse(int argc, char **argv, agent_opts *o);

/* Parses a whole decimal integer in [min, max]; 0 on success. */
int agent_parse_int(const char *s, long min, long max, int *out);

/* Prints "ductile-agent: MESSAGE" on stderr: the errors of flags and
 * settings, found before the logger exists. */
void agent_early_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
