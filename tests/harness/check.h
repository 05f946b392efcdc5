/* check.h: the checks every C test makes (a table of cases: th_scenario.h).
 *
 * A failed check prints "FAIL file:line: condition: message" to stderr; the
 * three forms differ only in what happens next:
 *
 *   CHECK(cond, ...)            counts the failure and carries on, so one run
 *                               shows every broken case (main returns
 *                               check_finish() or check_failures() != 0);
 *   CHECK_OR_RETURN(cond, ...)  returns 1 from the function (a scenario or a
 *                               rank that cannot go on);
 *   CHECK_OR_EXIT(cond, ...)    exits the process with 1.
 *
 * The message is optional: CHECK(x) and CHECK(x, "got %d", y) both work, by
 * gluing ": " in front of whatever format is given, so a missing one is
 * still a valid (non-empty) format and printf checking stays on.
 *
 * The failure count lives in a static inside a function, so including this
 * header costs a program nothing it does not use. Header only.
 */
#ifndef DUCTILE_TEST_CHECK_H
#define DUCTILE_TEST_CHECK_H

#include "ductile/clock.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The failures counted so far in this process. */
static inline int *check_counter(void)
{
    static int failures;
    return &failures;
}

static inline int check_failures(void)
{
    return *check_counter();
}

/* Counts a failure the caller has reported itself. */
static inline void check_fail(void)
{
    (*check_counter())++;
}

/* Prints one failed check; fmt starts with ": " (see above). */
__attribute__((format(printf, 4, 5))) static inline void
check_report(const char *file, int line, const char *cond, const char *fmt, ...)
{
    fprintf(stderr, "FAIL %s:%d: %s", file, line, cond);
    if (strcmp(fmt, ": ") != 0) {
        va_list ap;
        va_start(ap, fmt);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
    }
    fputc('\n', stderr);
}

/* The three forms, by what follows a report. The condition is made text
 * here, before it passes to another macro, so it reads as written. */
#define CHECK_THEN_(cond, text, then, ...)                                                         \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            check_report(__FILE__, __LINE__, text, ": " __VA_ARGS__);                              \
            then;                                                                                  \
        }                                                                                          \
    } while (0)

#define CHECK(cond, ...) CHECK_THEN_(cond, #cond, check_fail(), __VA_ARGS__)
#define CHECK_OR_RETURN(cond, ...) CHECK_THEN_(cond, #cond, return 1, __VA_ARGS__)
#define CHECK_OR_EXIT(cond, ...) CHECK_THEN_(cond, #cond, exit(1), __VA_ARGS__)

/* Says how the checks went; the exit status for main (0: all passed). */
static inline int check_finish(const char *name)
{
    if (check_failures())
        fprintf(stderr, "%s: %d checks failed\n", name, check_failures());
    else
        printf("%s: all checks passed\n", name);
    return check_failures() != 0;
}

#endif
