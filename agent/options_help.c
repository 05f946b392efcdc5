/* options_help.c: ductile-agent --help.
 *
 * The usage text, then one entry per option of the table (options.c):
 * ductile's own (those with a DUCTILE_* variable) first, then torchrun's,
 * each with its variables and default, the help wrapped at 80 columns.
 */
#include "options_table.h"

#include <stdio.h>
#include <string.h>

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

void agent_opts_usage(FILE *f)
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
        agent_opt_pet_name(o, pet, sizeof(pet));
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
