/* options.h: the agent's options (options.c: the table; options_parse.c,
 * options_set.c, options_help.c: parsing, values, --help).
 *
 * Every option is a flag and a DUCTILE_* variable with a default, listed
 * once in options.c's table, which --help prints: defaults first, then the
 * environment, then the command line wins. torchrun's flags are accepted
 * too, with its PET_* variables below the DUCTILE_* ones.
 */
#ifndef DUCTILE_AGENT_OPTIONS_H
#define DUCTILE_AGENT_OPTIONS_H

#include "ductile/rdzv.h"

#define AGENT_NOTES_MAX 64
#define AGENT_CONF_MAX 8 /* --rdzv-conf given this many times at most */

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
    const char *preload; /* --preload: auto, none or MODULE[,MODULE...] */
    const char *cacert, *cert, *key, *user, *password;
    const char *install_id; /* NULL: none */
    int start_over;
    /* torchrun's */
    int module, no_python, run_path;
    const char *log_dir;
    const char *redirects, *tee, *ranks_filter; /* logs.h's specs; NULL: none */
    int keep_alive_ms, keep_alive_attempts;     /* --rdzv-conf's, for --lease-ttl */
    int https;                                  /* --rdzv-conf protocol=https */
    char *conf_buf[AGENT_CONF_MAX];             /* --rdzv-conf's text: values point into it */
    char notes[AGENT_NOTES_MAX][240];           /* torchrun flags ignored or read differently,
                                                   logged once at the start; "" if none */
    char **cmd;
    char **cmd_buf;     /* PYTHON -u [-m] SCRIPT ARGS: the command built, or NULL */
    char *endpoint_buf; /* the endpoints with https:// added, or NULL */
    char node_id_buf[RDZV_NODE_ID_MAX + 1];
    char node_addr_buf[64];
} agent_opts;

/* Fills o from defaults, then DUCTILE_* variables, then argv. Returns 0,
 * 1 when --help was printed, or -1 after printing a one-line error. */
int agent_opts_parse(int argc, char **argv, agent_opts *o);

/* Frees what agent_opts_parse() allocated. */
void agent_opts_free(agent_opts *o);

/* Parses a whole decimal integer in [min, max]; 0 on success. */
int agent_parse_int(const char *s, long min, long max, int *out);

/* Prints "ductile-agent: MESSAGE" on stderr: the errors of flags and
 * settings, found before the logger exists. */
void agent_early_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
