/* th_scenario.h: a test program's cases, chosen by name on its command line.
 *
 * Two shapes, both a table of {name, ...} rows:
 *
 *   th_run_cases()  a table of th_case: runs the cases named in argv, or all
 *                   of them, in one process, counting failures with check.h;
 *   th_find()       any table whose rows start with `const char *name`: the
 *                   row argv names, for a program that runs one scenario per
 *                   invocation (each in a fresh process, against its own
 *                   etcd), with th_usage() for a bad command line.
 *
 * Header only, like check.h.
 */
#ifndef DUCTILE_TEST_TH_SCENARIO_H
#define DUCTILE_TEST_TH_SCENARIO_H

#include "check.h"

#include <stddef.h>
#include <stdio.h>
#include <string.h>

typedef struct th_case {
    const char *name;
    void (*fn)(void);
} th_case;

#define TH_COUNT(table) (sizeof(table) / sizeof((table)[0]))

/* Runs the cases named in argv[first..argc-1], or all of them when none is
 * named, each reported on stderr as "ok   NAME (T s)" or "FAIL NAME (T s)"
 * by whether it added to the failure count; `note` (may be NULL) is said
 * before the time, as "(NOTE, T s)". */
static inline void th_run_cases(const th_case *cases, size_t n, int argc, char **argv, int first,
                                const char *note)
{
    for (size_t i = 0; i < n; i++) {
        int run = first >= argc;
        for (int a = first; a < argc; a++)
            if (strcmp(argv[a], cases[i].name) == 0) run = 1;
        if (!run) continue;
        int before = check_failures();
        int64_t t0 = mono_now_ms();
        cases[i].fn();
        fprintf(stderr, "%s %s (%s%s%.1f s)\n", check_failures() == before ? "ok  " : "FAIL",
                cases[i].name, note ? note : "", note ? ", " : "", (mono_now_ms() - t0) / 1000.0);
    }
}

/* The row of `table` (n rows of `size` bytes, each starting with its name)
 * called `name`, or NULL. */
static inline const void *th_find(const void *table, size_t n, size_t size, const char *name)
{
    for (size_t i = 0; i < n; i++) {
        const void *row = (const char *)table + i * size;
        if (strcmp(*(const char *const *)row, name) == 0) return row;
    }
    return NULL;
}

/* Says "usage: PROG NAME1|NAME2|..." on stderr. */
static inline void th_usage(const char *prog, const void *table, size_t n, size_t size)
{
    fprintf(stderr, "usage: %s ", prog);
    for (size_t i = 0; i < n; i++)
        fprintf(stderr, "%s%s", i ? "|" : "",
                *(const char *const *)((const char *)table + i * size));
    fputc('\n', stderr);
}

#endif
