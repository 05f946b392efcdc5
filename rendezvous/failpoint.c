/* failpoint.c: DUCTILE_FAILPOINTS (see failpoint.h).
 *
 * The spec is parsed once, on the first call, into a small table; each
 * entry counts the calls of its name under one mutex. Knowingly simple: a
 * linear scan of a handful of entries, and only while the variable is set.
 */
#include "ductile/failpoint.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define FP_MAX 16

typedef struct fp_entry {
    char name[64];
    char action[32];
    long from, to; /* to < 0: no end */
    long calls;
} fp_entry;

typedef struct fp_table {
    pthread_once_t once;
    pthread_mutex_t mu;
    int n;
    fp_entry e[FP_MAX];
} fp_table;

/* The one table of the process: test-only configuration, read once. */
static fp_table fp = {.once = PTHREAD_ONCE_INIT, .mu = PTHREAD_MUTEX_INITIALIZER};

/* Parses one "NAME=WHEN:ACTION"; 0 on success. */
static int parse_entry(const char *s, size_t len, fp_entry *out, char *msg, size_t mlen)
{
    char buf[160];
    if (len >= sizeof(buf)) {
        snprintf(msg, mlen, "entry too long");
        return -1;
    }
    memcpy(buf, s, len);
    buf[len] = 0;
    char *eq = strchr(buf, '='), *colon = eq ? strchr(eq, ':') : NULL;
    if (!eq || !colon || eq == buf || colon[1] == 0) {
        snprintf(msg, mlen, "'%s' is not NAME=WHEN:ACTION", buf);
        return -1;
    }
    *eq = *colon = 0;
    if (strlen(buf) >= sizeof(out->name) || strlen(colon + 1) >= sizeof(out->action)) {
        snprintf(msg, mlen, "'%s': name or action too long", buf);
        return -1;
    }
    char *end = NULL;
    long from = strtol(eq + 1, &end, 10), to = from;
    if (end == eq + 1 || from < 1) goto bad_when;
    if (*end == '+') {
        to = -1;
        end++;
    } else if (*end == '-') {
        char *e2 = NULL;
        to = strtol(end + 1, &e2, 10);
        if (e2 == end + 1 || to < from) goto bad_when;
        end = e2;
    }
    if (*end) goto bad_when;
    memset(out, 0, sizeof(*out));
    memcpy(out->name, buf, strlen(buf) + 1); /* lengths checked above */
    memcpy(out->action, colon + 1, strlen(colon + 1) + 1);
    out->from = from;
    out->to = to;
    return 0;
bad_when:
    snprintf(msg, mlen, "'%s': WHEN must be N, N-M or N+ (calls count from 1)", eq + 1);
    return -1;
}

/* Parses spec into t (at most FP_MAX entries); 0 on success. */
static int parse_spec(const char *spec, fp_entry *t, int *n, char *msg, size_t mlen)
{
    *n = 0;
    const char *p = spec;
    while (*p) {
        size_t len = strcspn(p, ";,");
        if (len > 0) {
            if (*n == FP_MAX) {
                snprintf(msg, mlen, "more than %d entries", FP_MAX);
                return -1;
            }
            if (parse_entry(p, len, &t[*n], msg, mlen) != 0) return -1;
            (*n)++;
        }
        p += len;
        if (*p) p++;
    }
    return 0;
}

static void load(void)
{
    const char *spec = getenv(FAILPOINT_ENV);
    char msg[FAILPOINT_MSG_MAX];
    if (!spec || parse_spec(spec, fp.e, &fp.n, msg, sizeof(msg)) != 0) fp.n = 0;
}

const char *failpoint(const char *name)
{
    pthread_once(&fp.once, load);
    if (fp.n == 0) return NULL;
    const char *hit = NULL;
    pthread_mutex_lock(&fp.mu);
    /* Several entries may name one operation (different calls, different
     * actions): each counts every call, so their counts agree. */
    for (int i = 0; i < fp.n; i++) {
        fp_entry *e = &fp.e[i];
        if (strcmp(e->name, name) != 0) continue;
        long call = ++e->calls;
        if (!hit && call >= e->from && (e->to < 0 || call <= e->to)) hit = e->action;
    }
    pthread_mutex_unlock(&fp.mu);
    return hit;
}

int failpoint_sleep(const char *action)
{
    if (!action || strncmp(action, "sleep:", 6) != 0) return 0;
    char *end = NULL;
    long ms = strtol(action + 6, &end, 10);
    if (end == action + 6 || *end || ms < 0) return 0;
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0) {
    }
    return 1;
}

int failpoint_check_env(char *msg, size_t len)
{
    const char *spec = getenv(FAILPOINT_ENV);
    fp_entry t[FP_MAX];
    int n = 0;
    char why[FAILPOINT_MSG_MAX];
    if (!spec || parse_spec(spec, t, &n, why, sizeof(why)) == 0) return 0;
    snprintf(msg, len, "%s: %s", FAILPOINT_ENV, why);
    return -1;
}
