/* test_rdzv_procs.h: run rdzv_participant processes and read what they say.
 *
 * Each participant is a child with a pipe on stdin (commands) and one on
 * stdout (one event per line). Lines are kept per process; an expectation
 * takes the first line not yet taken whose first word matches, reading more
 * until a deadline, so the order in which a test asks does not have to be
 * the order in which lines came. Every FROZEN line of every process is also
 * kept, so that a scenario can check that no two participants ever believed
 * in different memberships for the same round number.
 *
 * tp_main() is the whole main of a scenario test: a table of named
 * scenarios, one run per invocation against its own etcd.
 */
#ifndef DUCTILE_TEST_RDZV_PROCS_H
#define DUCTILE_TEST_RDZV_PROCS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "ductile/clock.h"
#include "test_etcd.h"

typedef struct tp_proc {
    pid_t pid;
    int in_fd, out_fd;
    char node[64];
    char job[64];
    char buf[8192];
    size_t len;
    char **lines;
    char *taken;
    size_t nlines, cap;
    int eof;
} tp_proc;

typedef struct tp_frozen {
    char job[64];
    int64_t round;
    char node[64];
    char members[2048];
} tp_frozen;

typedef struct tp_set {
    const char *exe; /* rdzv_participant */
    char endpoint[128];
    char job[64];
    tp_proc *procs;
    int nprocs, cap;
    tp_frozen *frozen;
    size_t nfrozen, frozen_cap;
    test_etcd *etcd; /* the server, under tp_main (a scenario may restart it) */
} tp_set;

void tp_init(tp_set *s, const char *exe, const char *endpoint, const char *job);
/* Starts a participant; extra is space-separated options. Returns its index
 * or -1. */
int tp_spawn(tp_set *s, const char *node, const char *extra);
int tp_send(tp_set *s, int i, const char *line);
/* Waits for a line whose first word is `word` from process i; copies it to
 * out. 0 on success, -1 on timeout or EOF (prints what it saw). */
int tp_expect(tp_set *s, int i, const char *word, int timeout_ms, char *out, size_t outlen);
/* Value of "key=" in a line ("" if absent), and as an integer (-1). */
void tp_field(const char *line, const char *key, char *out, size_t outlen);
long long tp_ifield(const char *line, const char *key);
void tp_kill(tp_set *s, int i, int sig);
/* Reads whatever is pending from every process without waiting. */
void tp_drain(tp_set *s, int timeout_ms);
/* 0 when every round number maps to one membership across all processes. */
int tp_check_agreement(tp_set *s);
/* Kills and reaps every process, frees everything. */
void tp_free(tp_set *s);

typedef struct tp_scenario {
    const char *name;
    int (*fn)(tp_set *s); /* 0, or 1 after saying what failed */
} tp_scenario;

/* `PROG SCENARIO`: starts an etcd, runs the named scenario with exe as the
 * participant program and job "job", and ends by checking agreement. Says
 * "ok SCENARIO" and returns 0; 1 on a failure, 2 on a bad command line. */
int tp_main(int argc, char **argv, const char *exe, const tp_scenario *scenarios, size_t n);

#endif
