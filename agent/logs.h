/* logs.h: torchrun's per-worker files (logs.c): --log-dir, --redirects,
 * --tee, --local-ranks-filter and TORCHELASTIC_ERROR_FILE.
 *
 * Laid out as torchrun lays them out:
 *   <log-dir>/<job>_<random>/attempt_<restarts>/<local rank>/
 *       stdout.log  stderr.log  error.json
 * The run directory is made once per agent; without --log-dir it is a
 * private temporary one, removed when the agent ends unless a redirected or
 * tee'd stream wrote into it.
 */
#ifndef DUCTILE_AGENT_LOGS_H
#define DUCTILE_AGENT_LOGS_H

#include <stddef.h>
#include <stdint.h>

enum { AGENT_STD_OUT = 1, AGENT_STD_ERR = 2 }; /* torchrun's Std: 0 none, 1, 2, 3 both */

typedef struct agent_logs {
    char *run_dir;         /* NULL until agent_logs_open() */
    int private_dir;       /* a temporary one of ours: removed at the end */
    const char *redirects; /* torchrun's spec: "3" or "0:1,1:2"; NULL: none */
    const char *tee;
    const char *ranks_filter; /* "0,2": local ranks shown on the console; NULL: all */
    char attempt_dir[4096];   /* "" before agent_logs_attempt() */
} agent_logs;

/* The streams spec gives local rank lr (AGENT_STD_* bits); -1 when the spec
 * is not torchrun's N or LR:N,LR:N,... with N in 0..3. lr < 0 only checks. */
int agent_logs_std(const char *spec, int lr);
/* 1 when local rank lr is shown on the console (--local-ranks-filter). A
 * filter that is not a comma list of ranks returns -1 (lr < 0: only checks). */
int agent_logs_shown(const char *filter, int lr);
/* Makes the run directory: <log_dir>/<job>_XXXXXX, or a private one under
 * $TMPDIR when log_dir is NULL. 0, or -1 with msg. */
int agent_logs_open(agent_logs *l, const char *log_dir, const char *job, char *msg, size_t len);
/* Makes <run>/attempt_<restarts> (kept if it exists: the rounds of one
 * attempt append to its files). 0, or -1 with msg. */
int agent_logs_attempt(agent_logs *l, int64_t restarts, char *msg, size_t len);
/* Removes a private run directory (unless streams were written there). */
void agent_logs_close(agent_logs *l);
/* The first line of the message in a torch error file (what
 * torch.distributed.elastic's @record writes); 0, or -1 when there is no
 * such file or it is not one. */
int agent_logs_error_message(const char *path, char *out, size_t len);

#endif
