/* test_failpoint: DUCTILE_FAILPOINTS, checked and counted (failpoint.h).
 *
 * failpoint_check_env turns every malformed spec down with a reason and
 * takes the good ones; failpoint() counts the calls of each name from 1 and
 * fires on call N, calls N to M, or N and every later one. The table is read
 * once, on the first failpoint() call, so the spec is set before it.
 */
#include "check.h"
#include "ductile/failpoint.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int same(const char *a, const char *b)
{
    return a == b || (a && b && strcmp(a, b) == 0);
}

/* The actions of calls 1..n of name, each compared with want[i] (NULL: none). */
static void expect_calls(const char *name, const char *const *want, int n)
{
    for (int i = 0; i < n; i++) {
        const char *got = failpoint(name);
        CHECK_OR_EXIT(same(got, want[i]), "%s call %d: got %s, want %s", name, i + 1,
                      got ? got : "none", want[i] ? want[i] : "none");
    }
}

int main(void)
{
    const char *bad[] = {"x",   "a=0:b", "a=3-1:b", "a=1:",   "=1:b",
                         "a=1", "a=x:b", "a=1-:b",  "a=2+3:b"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        setenv(FAILPOINT_ENV, bad[i], 1);
        char msg[256] = "";
        CHECK_OR_EXIT(failpoint_check_env(msg, sizeof(msg)) == -1, "\"%s\" accepted", bad[i]);
        CHECK_OR_EXIT(strstr(msg, FAILPOINT_ENV) && strlen(msg) > strlen(FAILPOINT_ENV) + 2,
                      "\"%s\": no reason given (\"%s\")", bad[i], msg);
        printf("%-10s -> %s\n", bad[i], msg);
    }
    const char *good[] = {"", "a=1:b", "a=2-4:b;c=3+:d", "a=1:b;",
                          "etcd.api.put=2:ambiguous,etcd.store.txn=1-1:unavailable"};
    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
        setenv(FAILPOINT_ENV, good[i], 1);
        char msg[256] = "";
        CHECK_OR_EXIT(failpoint_check_env(msg, sizeof(msg)) == 0, "\"%s\" refused: %s", good[i],
                      msg);
    }
    unsetenv(FAILPOINT_ENV);
    char msg[256] = "";
    CHECK_OR_EXIT(failpoint_check_env(msg, sizeof(msg)) == 0, "unset refused: %s", msg);

    setenv(FAILPOINT_ENV, "a=2:x;b=2-3:y;c=3+:z", 1);
    const char *a[] = {NULL, "x", NULL, NULL};
    const char *b[] = {NULL, "y", "y", NULL, NULL};
    const char *c[] = {NULL, NULL, "z", "z", "z"};
    const char *none[] = {NULL, NULL};
    expect_calls("a", a, 4);
    expect_calls("b", b, 5);
    expect_calls("c", c, 5);
    expect_calls("d", none, 2);
    /* read once: a later change of the variable is not seen */
    setenv(FAILPOINT_ENV, "d=1+:w", 1);
    expect_calls("d", none, 2);
    printf("test_failpoint: ok\n");
    return 0;
}
