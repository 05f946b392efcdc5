/* options_table.h: what the agent's options files share (options.c,
 * options_set.c, options_parse.c, options_help.c); not for the rest of the
 * agent, which sees options.h only.
 *
 * Each option has an id, and one entry in agent_opt_table (options.c): its
 * flag, its variable, its default and its help line.
 */
#ifndef DUCTILE_AGENT_OPTIONS_TABLE_H
#define DUCTILE_AGENT_OPTIONS_TABLE_H

#include "options.h"

#include <stddef.h>
#include <stdio.h>

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

/* Every option, indexed by its id (options.c). */
extern const agent_opt agent_opt_table[OPT_COUNT];

/* PET_<FLAG>: torchrun's variable for a flag (argparse's dest, upper case). */
void agent_opt_pet_name(const agent_opt *t, char *out, size_t len);

/* Finds a flag by its name (n characters); -1 if none. */
int agent_opt_find(const char *name, size_t n);

/* Sets one option from text; on error writes why (without the flag name)
 * and returns -1 (options_set.c). */
int agent_opt_set(agent_opts *o, agent_opt_id id, const char *v, char *why, size_t len);

/* Keeps one line for the log about option slot (the last one said wins). */
void agent_opt_note(agent_opts *o, int slot, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Prints --help: the usage, then the table (options_help.c). */
void agent_opts_usage(FILE *f);

#endif
