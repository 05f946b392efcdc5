/* trainer_test.h: the few helpers the trainer's C tests share.
 *
 * CHECK records a failure with its line and carries on, so one run shows
 * every broken case; a test's main returns test_failures() != 0.
 */
#ifndef DUCTILE_TRAINER_TEST_H
#define DUCTILE_TRAINER_TEST_H

#include <math.h>
#include <stdio.h>

static int test_failed;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            test_failed++;                                                                         \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond);               \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
        }                                                                                          \
    } while (0)

/* |a - b| within atol + rtol * max(|a|, |b|). */
static inline int test_close(double a, double b, double atol, double rtol)
{
    double m = fabs(a) > fabs(b) ? fabs(a) : fabs(b);
    return fabs(a - b) <= atol + rtol * m;
}

static inline int test_finish(const char *name)
{
    if (test_failed)
        fprintf(stderr, "%s: %d checks failed\n", name, test_failed);
    else
        printf("%s: all checks passed\n", name);
    return test_failed != 0;
}

#endif
