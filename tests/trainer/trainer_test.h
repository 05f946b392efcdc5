/* trainer_test.h: the few helpers the trainer's C tests share.
 *
 * CHECK (check.h) records a failure with its line and carries on, so one
 * run shows every broken case; a test's main returns check_finish().
 */
#ifndef DUCTILE_TRAINER_TEST_H
#define DUCTILE_TRAINER_TEST_H

#include "check.h"

#include <math.h>

/* |a - b| within atol + rtol * max(|a|, |b|). */
static inline int test_close(double a, double b, double atol, double rtol)
{
    double m = fabs(a) > fabs(b) ? fabs(a) : fabs(b);
    return fabs(a - b) <= atol + rtol * m;
}

#endif
