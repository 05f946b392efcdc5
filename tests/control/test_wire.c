/* test_wire.c: the C side of the control protocol (libductile-control)
 * against tests/control/wire_cases.txt, the wire format that the Python side
 * (test_wire.py) is tested on too.
 *
 * The C library is both ends (the agent and ductile-train), so every case
 * of either direction is checked here except those marked @python: a `send`
 * formats its fields with ctl_format and must give the line exactly, then
 * parse back to the same message; an `accept` parses to the message its
 * fields describe, every field not named being zero; a `refuse` does not
 * parse. The cases file's grammar is at its top.
 */
#include "check.h"
#include "ductile/control.h"

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_TOKENS 16
#define TOKEN_MAX (CTL_MAX_LINE + 64)

/* One case line's words, quotes and escapes undone. */
typedef struct words {
    int n;
    char w[MAX_TOKENS][TOKEN_MAX];
} words;

/* Undoes one escape at *s (just past its '\') onto t[*len]; -1 when bad. */
static int unescape(const char **s, char *t, size_t *len)
{
    char c = **s;
    (*s)++;
    if (c == '(') { /* \(N): the character before stands N times in all */
        char *end = NULL;
        long n = strtol(*s, &end, 10);
        if (*len == 0 || end == *s || *end != ')' || n < 1 || *len + (size_t)n > TOKEN_MAX - 1)
            return -1;
        char prev = t[*len - 1];
        for (long i = 1; i < n; i++)
            t[(*len)++] = prev;
        *s = end + 1;
        return 0;
    }
    const char *from = "nrt\\\"", *to = "\n\r\t\\\"";
    const char *p = c ? strchr(from, c) : NULL;
    if (!p || *len >= TOKEN_MAX - 1) return -1;
    t[(*len)++] = to[p - from];
    return 0;
}

/* Splits a case line into words; -1 when it is malformed. */
static int split(const char *s, words *out)
{
    out->n = 0;
    while (*s) {
        while (*s == ' ')
            s++;
        if (!*s || *s == '\n') break;
        if (out->n == MAX_TOKENS) return -1;
        char *t = out->w[out->n++];
        size_t len = 0;
        int quoted = 0;
        while (*s && *s != '\n' && (quoted || *s != ' ')) {
            if (*s == '"') {
                quoted = !quoted;
                s++;
            } else if (quoted && *s == '\\') {
                s++;
                if (unescape(&s, t, &len)) return -1;
            } else {
                if (len >= TOKEN_MAX - 1) return -1;
                t[len++] = *s++;
            }
        }
        if (quoted) return -1;
        t[len] = 0;
    }
    return 0;
}

static const char *const kinds[] = {
    [CTL_ROUND] = "round",         [CTL_ABORT] = "abort", [CTL_STOP] = "stop",
    [CTL_READY] = "ready",         [CTL_STEP] = "step",   [CTL_FAILED] = "failed",
    [CTL_PEER_LOST] = "peer_lost", [CTL_PHASE] = "phase", [CTL_HELLO] = "hello",
};

enum field_kind { F_I64, F_INT, F_STR, F_DBL, F_MODE };
static const struct field {
    const char *name;
    enum field_kind kind;
    size_t off, size;
} fields[] = {
#define FIELD(name, kind)                                                                          \
    {                                                                                              \
#name, kind, offsetof(ctl_msg, name), sizeof(((ctl_msg *)0)->name)                         \
    }
    FIELD(round, F_I64),        FIELD(rank, F_INT),        FIELD(world_size, F_INT),
    FIELD(local_rank, F_INT),   FIELD(group_rank, F_INT),  FIELD(group_world_size, F_INT),
    FIELD(restarts, F_I64),     FIELD(master_addr, F_STR), FIELD(master_port, F_INT),
    FIELD(store_prefix, F_STR), FIELD(graceful, F_INT),    FIELD(step, F_I64),
    FIELD(samples, F_I64),      FIELD(loss, F_DBL),        FIELD(phase, F_STR),
    FIELD(reason, F_STR),       FIELD(version, F_INT),     FIELD(mode, F_MODE),
#undef FIELD
};

/* Sets one NAME=VALUE field of m; -1 when it names no field or is bad. */
static int set_field(ctl_msg *m, const char *word)
{
    const char *eq = strchr(word, '=');
    if (!eq) return -1;
    const char *v = eq + 1;
    for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++) {
        const struct field *f = &fields[i];
        if (strlen(f->name) != (size_t)(eq - word) || strncmp(f->name, word, eq - word)) continue;
        char *at = (char *)m + f->off, *end = NULL;
        errno = 0;
        if (f->kind == F_I64 || f->kind == F_INT) {
            long long x = strtoll(v, &end, 10);
            if (f->kind == F_I64)
                *(int64_t *)(void *)at = x;
            else
                *(int *)(void *)at = (int)x;
        } else if (f->kind == F_DBL) {
            *(double *)(void *)at = strtod(v, &end);
        } else if (f->kind == F_STR) {
            if (strlen(v) >= f->size) return -1;
            memcpy(at, v, strlen(v) + 1);
            return 0;
        } else {
            const char *modes[] = {"none", "inplace", "restart"};
            for (int k = 0; k < 3; k++)
                if (strcmp(v, modes[k]) == 0) m->mode = k, end = (char *)v + strlen(v);
        }
        if (!end || end == v || *end || errno) return -1;
        if (strcmp(f->name, "samples") == 0) m->has_samples = 1;
        if (strcmp(f->name, "loss") == 0) m->has_loss = 1;
        return 0;
    }
    return -1;
}

/* The message of KIND and fields w[from..n); -1 when they are bad. */
static int message(const words *w, int from, ctl_msg *m)
{
    memset(m, 0, sizeof(*m));
    if (from >= w->n) return -1;
    for (int t = CTL_ROUND; t <= CTL_HELLO; t++)
        if (strcmp(w->w[from], kinds[t]) == 0) m->type = (ctl_type)t;
    if (m->type == CTL_INVALID) return -1;
    for (int i = from + 1; i < w->n; i++)
        if (set_field(m, w->w[i])) return -1;
    return 0;
}

static int same(const ctl_msg *a, const ctl_msg *b)
{
    return a->type == b->type && a->round == b->round && a->graceful == b->graceful &&
           a->rank == b->rank && a->world_size == b->world_size && a->local_rank == b->local_rank &&
           a->group_rank == b->group_rank && a->group_world_size == b->group_world_size &&
           a->restarts == b->restarts && strcmp(a->master_addr, b->master_addr) == 0 &&
           a->master_port == b->master_port && strcmp(a->store_prefix, b->store_prefix) == 0 &&
           a->step == b->step && a->has_samples == b->has_samples && a->samples == b->samples &&
           a->has_loss == b->has_loss && a->loss == b->loss && strcmp(a->phase, b->phase) == 0 &&
           strcmp(a->reason, b->reason) == 0 && a->version == b->version && a->mode == b->mode;
}

/* Checks one case (VERB DIR WIRE [KIND FIELDS]); 0 when it holds. */
static int run_case(const words *w, const char *verb, int lineno)
{
    ctl_msg want, got;
    const char *wire = w->w[2];
    int has_msg = w->n > 3;
    if (has_msg && message(w, 3, &want)) {
        fprintf(stderr, "wire_cases.txt:%d: a bad KIND or field\n", lineno);
        return -1;
    }
    if (strcmp(verb, "send") == 0 && has_msg) {
        char line[CTL_MAX_LINE + 2];
        int n = ctl_format(&want, line, sizeof(line));
        if (n < 0 || strcmp(line, wire) != 0) {
            fprintf(stderr, "wire_cases.txt:%d: formatted '%s'\n", lineno,
                    n < 0 ? "(refused)" : line);
            return -1;
        }
    }
    int parsed = ctl_parse(wire, &got) == 0;
    if (strcmp(verb, "refuse") == 0 && w->n == 3) {
        if (!parsed) return 0;
        fprintf(stderr, "wire_cases.txt:%d: accepted a line it must refuse\n", lineno);
        return -1;
    }
    if ((strcmp(verb, "send") == 0 || strcmp(verb, "accept") == 0) && has_msg) {
        if (parsed && same(&got, &want)) return 0;
        fprintf(stderr, "wire_cases.txt:%d: %s\n", lineno,
                parsed ? "parsed to other fields" : "refused a line it must accept");
        return -1;
    }
    fprintf(stderr, "wire_cases.txt:%d: not a case (VERB DIR \"WIRE\" [KIND FIELDS])\n", lineno);
    return -1;
}

int main(int argc, char **argv)
{
    FILE *f = argc == 2 ? fopen(argv[1], "r") : NULL;
    if (!f) {
        fprintf(stderr, "usage: test_wire wire_cases.txt\n");
        return 2;
    }
    static char text[4 * CTL_MAX_LINE];
    static words w;
    int lineno = 0, ran = 0, theirs = 0;
    while (fgets(text, sizeof(text), f)) {
        lineno++;
        if (text[0] == '#' || text[0] == '\n') continue;
        if (split(text, &w) || w.n < 3 || (strcmp(w.w[1], "a>w") && strcmp(w.w[1], "w>a"))) {
            fprintf(stderr, "wire_cases.txt:%d: not a case\n", lineno);
            check_fail();
            continue;
        }
        char *verb = w.w[0], *side = strchr(verb, '@');
        if (side) *side++ = 0;
        if (side && strcmp(side, "c") != 0 && strcmp(side, "python") != 0) {
            fprintf(stderr, "wire_cases.txt:%d: no side '%s' (c or python)\n", lineno, side);
            check_fail();
            continue;
        }
        if (side && strcmp(side, "python") == 0) {
            theirs++;
            continue;
        }
        ran++;
        if (run_case(&w, verb, lineno)) check_fail();
    }
    fclose(f);
    CHECK(ran > 0, "no cases read");
    if (check_failures()) return 1;
    printf("ok control wire (C): %d cases, %d for the Python side only\n", ran, theirs);
    return 0;
}
