/* parse.c: the receiving side of the control protocol (ductile/control.h):
 * one line in, one ctl_msg out, or a refusal.
 *
 * A line is read whole or not at all: every word is checked (numbers in
 * their range, ranks below their world, known words only) before a field is
 * kept, so a malformed line never half-updates a reader. The two messages
 * whose REASON is the rest of the line (`failed`, `peer_lost`) are taken
 * before the line is split into words; every other one is words separated
 * by spaces.
 */
#include "ductile/control.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The most words a message has (`round`: 11), and one to spare. */
#define CTL_MAX_WORDS 12

int ctl_int(const char *word, int64_t min, int64_t max, int64_t *out)
{
    if (!word || !*word) return -1;
    char *end = NULL;
    errno = 0;
    long long v = strtoll(word, &end, 10);
    if (errno || *end || v < min || v > max) return -1;
    *out = v;
    return 0;
}

/* Parses one finite decimal number word; 0 on success. */
static int ctl_double(const char *word, double *out)
{
    if (!word || !*word) return -1;
    char *end = NULL;
    errno = 0;
    double v = strtod(word, &end);
    if (errno || *end || !isfinite(v)) return -1;
    *out = v;
    return 0;
}

/* Copies src into dst[len]; -1 when it does not fit. */
static int ctl_copy(char *dst, size_t len, const char *src)
{
    size_t n = strlen(src);
    if (n >= len) return -1;
    memcpy(dst, src, n + 1);
    return 0;
}

int ctl_phase_valid(const char *name)
{
    size_t n = strlen(name);
    if (n == 0 || n >= CTL_PHASE_MAX) return 0;
    for (size_t i = 0; i < n; i++)
        if (!((name[i] >= 'a' && name[i] <= 'z') || name[i] == '_')) return 0;
    return 1;
}

/* Parses the optional fields of `step` (words w[0..nw)); 0 on success. */
static int ctl_step_fields(char **w, int nw, ctl_msg *m)
{
    if (nw % 2) return -1;
    for (int i = 0; i < nw; i += 2) {
        if (strcmp(w[i], "samples") == 0 && !m->has_samples) {
            if (ctl_int(w[i + 1], 0, INT64_MAX, &m->samples)) return -1;
            m->has_samples = 1;
        } else if (strcmp(w[i], "loss") == 0 && !m->has_loss) {
            if (ctl_double(w[i + 1], &m->loss)) return -1;
            m->has_loss = 1;
        } else {
            return -1;
        }
    }
    return 0;
}

/* `failed REASON` and `peer_lost N REASON`, whose REASON is the rest of the
 * line. Returns 1 when buf is neither, else 0 or -1 as ctl_parse. */
static int ctl_parse_reason(char *buf, ctl_msg *m)
{
    if (strncmp(buf, "failed", 6) == 0 && (buf[6] == ' ' || buf[6] == 0)) {
        m->type = CTL_FAILED;
        return ctl_copy(m->reason, sizeof(m->reason), buf[6] ? buf + 7 : "");
    }
    if (strncmp(buf, "peer_lost ", 10) == 0) {
        char *sp = strchr(buf + 10, ' ');
        if (sp) *sp = 0;
        if (ctl_int(buf + 10, 0, INT64_MAX, &m->round)) return -1;
        m->type = CTL_PEER_LOST;
        return ctl_copy(m->reason, sizeof(m->reason), sp ? sp + 1 : "");
    }
    return 1;
}

/* hello VERSION [inplace|restart] (w[0] is "hello", nw is 2 or 3). */
static int ctl_parse_hello(char **w, int nw, ctl_msg *m)
{
    int64_t v;
    /* Any version parses, so that a mismatch is told apart from noise. */
    if (ctl_int(w[1], 1, INT_MAX, &v)) return -1;
    if (nw == 3 && strcmp(w[2], "inplace") == 0)
        m->mode = CTL_MODE_INPLACE;
    else if (nw == 3 && strcmp(w[2], "restart") == 0)
        m->mode = CTL_MODE_RESTART;
    else if (nw == 3)
        return -1;
    m->version = (int)v;
    m->type = CTL_HELLO;
    return 0;
}

/* abort N [graceful|lost] (w[0] is "abort", nw is 2 or 3). */
static int ctl_parse_abort(char **w, int nw, ctl_msg *m)
{
    if (ctl_int(w[1], 0, INT64_MAX, &m->round)) return -1;
    if (nw == 3 && strcmp(w[2], "graceful") == 0)
        m->graceful = 1;
    else if (nw == 3 && strcmp(w[2], "lost") != 0)
        return -1;
    m->type = CTL_ABORT;
    return 0;
}

/* round N RANK WORLD LOCAL_RANK GROUP_RANK GROUP_WORLD RESTARTS ADDR PORT
 * PREFIX (w[0] is "round", 11 words). */
static int ctl_parse_round(char **w, ctl_msg *m)
{
    int64_t v[8];
    if (ctl_int(w[1], 0, INT64_MAX, &v[0]) || ctl_int(w[2], 0, INT_MAX, &v[1]) ||
        ctl_int(w[3], 1, INT_MAX, &v[2]) || ctl_int(w[4], 0, INT_MAX, &v[3]) ||
        ctl_int(w[5], 0, INT_MAX, &v[4]) || ctl_int(w[6], 1, INT_MAX, &v[5]) ||
        ctl_int(w[7], 0, INT64_MAX, &v[6]) || ctl_int(w[9], 0, 65535, &v[7]))
        return -1;
    if (v[1] >= v[2] || v[4] >= v[5]) return -1;
    if (ctl_copy(m->master_addr, sizeof(m->master_addr), w[8]) ||
        ctl_copy(m->store_prefix, sizeof(m->store_prefix), w[10]))
        return -1;
    m->type = CTL_ROUND;
    m->round = v[0];
    m->rank = (int)v[1];
    m->world_size = (int)v[2];
    m->local_rank = (int)v[3];
    m->group_rank = (int)v[4];
    m->group_world_size = (int)v[5];
    m->restarts = v[6];
    m->master_port = (int)v[7];
    return 0;
}

/* A message of words w[0..nw), nw >= 1. */
static int ctl_parse_words(char **w, int nw, ctl_msg *m)
{
    if (strcmp(w[0], "ready") == 0 && nw == 1) {
        m->type = CTL_READY;
    } else if (strcmp(w[0], "stop") == 0 && nw == 1) {
        m->type = CTL_STOP;
    } else if (strcmp(w[0], "step") == 0 && nw >= 2) {
        if (ctl_int(w[1], 0, INT64_MAX, &m->step) || ctl_step_fields(w + 2, nw - 2, m)) return -1;
        m->type = CTL_STEP;
    } else if (strcmp(w[0], "phase") == 0 && nw == 2) {
        if (!ctl_phase_valid(w[1])) return -1;
        memcpy(m->phase, w[1], strlen(w[1]) + 1);
        m->type = CTL_PHASE;
    } else if (strcmp(w[0], "hello") == 0 && (nw == 2 || nw == 3)) {
        return ctl_parse_hello(w, nw, m);
    } else if (strcmp(w[0], "abort") == 0 && (nw == 2 || nw == 3)) {
        return ctl_parse_abort(w, nw, m);
    } else if (strcmp(w[0], "round") == 0 && nw == 11) {
        return ctl_parse_round(w, m);
    } else {
        return -1;
    }
    return 0;
}

int ctl_parse(const char *line, ctl_msg *m)
{
    memset(m, 0, sizeof(*m));
    char buf[CTL_MAX_LINE + 1];
    size_t n = strlen(line);
    if (n > CTL_MAX_LINE) return -1;
    memcpy(buf, line, n + 1);
    while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r'))
        buf[--n] = 0;
    int r = ctl_parse_reason(buf, m);
    if (r != 1) return r;
    char *w[CTL_MAX_WORDS];
    int nw = 0;
    char *save = NULL;
    for (char *t = strtok_r(buf, " ", &save); t; t = strtok_r(NULL, " ", &save)) {
        if (nw == CTL_MAX_WORDS) return -1;
        w[nw++] = t;
    }
    if (nw == 0) return -1;
    return ctl_parse_words(w, nw, m);
}
