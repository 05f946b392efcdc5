/* rdzv_participant: one rendezvous participant as a process, for tests,
 * the demo and the bench.
 *
 *   rdzv_participant --endpoints URL --job J --node N [--addr A] [--lws K]
 *       [--min N] [--max N] [--last-call-ms MS] [--ttl S] [--join-timeout-ms MS]
 *       [--max-restarts N] [--etcd-timeout-ms MS] [--exit-after-frozen N]
 *       [--no-takeover 0|1] [--failpoints SPEC] [--wait-go 0|1]
 *
 * Every event becomes one line on stdout ("WORD key=value ..."), flushed at
 * once, so a test can read what each participant believes. Commands on
 * stdin, one per line: watching (answers WATCHING n=K: rdzv_watching),
 * counts (answers COUNTS with the etcd requests so far, rdzv_get_counts),
 * leave, fail REASON (a first-hand failure), lost REASON (a lost peer), finish, close. EOF on stdin
 * closes the handle without leaving (peers then see the lease expire). --failpoints sets
 * DUCTILE_FAILPOINTS for this process (failpoint.h). --wait-go 1: the
 * process starts and initialises libcurl, says READY, and opens the handle
 * only when it reads the line "go" (the bench times the protocol apart from
 * starting processes).
 */
#include "ductile/clock.h"
#include "ductile/etcd.h"
#include "ductile/rdzv.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

static const char *err_name(rdzv_err e)
{
    static const char *names[] = {"ok",        "arg",       "nomem",      "etcd",     "timeout",
                                  "fenced",    "not_found", "lease_lost", "job_done", "job_failed",
                                  "duplicate", "closed",    "protocol"};
    if ((int)e < 0 || (size_t)e >= sizeof(names) / sizeof(names[0])) return "unknown";
    return names[e];
}

/* Replaces spaces so that a reason stays one field. */
static void one_field(char *s)
{
    for (; *s; s++)
        if (*s == ' ' || *s == '\n') *s = '_';
}

/* CPU seconds (user and system, every thread) this process has used. */
static double self_cpu(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return -1;
    return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec / 1e6;
}

/* Says READY and waits (at most 600 s) for the line "go" on stdin; 0 when
 * it came. Byte by byte, so nothing after it is taken from the main loop. */
static int wait_go(const char *node)
{
    printf("READY node=%s t=%.3f cpu=%.6f\n", node, mono_now_s(), self_cpu());
    char line[16];
    size_t len = 0;
    int64_t deadline = mono_now_ms() + 600000;
    for (;;) {
        int64_t left = deadline - mono_now_ms();
        struct pollfd p = {.fd = 0, .events = POLLIN};
        int rc = left > 0 ? poll(&p, 1, (int)left) : 0;
        if (rc < 0 && errno == EINTR) continue;
        if (rc <= 0) {
            fprintf(stderr, "rdzv_participant: no \"go\" within 600 s\n");
            return -1;
        }
        char c;
        if (read(0, &c, 1) != 1) return -1;
        if (c != '\n') {
            if (len < sizeof(line) - 1) line[len++] = c;
            continue;
        }
        line[len] = '\0';
        if (strcmp(line, "go") == 0) return 0;
        len = 0;
    }
}

static void usage(void)
{
    fprintf(stderr, "usage: rdzv_participant --endpoints URL --job J --node N [options]\n");
    exit(2);
}

static int int_arg(const char *v, const char *flag)
{
    char *end = NULL;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || !end || *end || x < 0 || x > 100000000) {
        fprintf(stderr, "rdzv_participant: %s: not a number: %s\n", flag, v);
        exit(2);
    }
    return (int)x;
}

/* Prints the event; returns 1 when it ends the participant. */
static int print_event(const char *node, rdzv_event *ev, int *frozen_count)
{
    char reason[256];
    snprintf(reason, sizeof(reason), "%s", ev->reason);
    one_field(reason);
    switch (ev->type) {
    case RDZV_EV_FROZEN: {
        rdzv_round *r = &ev->round;
        int first = r->my_rank >= 0 ? r->members[r->my_rank].first_global_rank : -1;
        printf("FROZEN node=%s t=%.3f cpu=%.6f round=%lld rank=%d nmembers=%d world=%d first=%d "
               "restarts=%lld members=",
               node, mono_now_s(), self_cpu(), (long long)r->number, r->my_rank, r->nmembers,
               r->world_size, first, (long long)r->restarts);
        for (int i = 0; i < r->nmembers; i++)
            printf("%s%s", i ? "," : "", r->members[i].node_id);
        printf("\n");
        (*frozen_count)++;
        return 0;
    }
    case RDZV_EV_ROUND_ENDED:
        printf("ENDED node=%s t=%.3f round=%lld cause=%s by=%s\n", node, mono_now_s(),
               (long long)ev->round_number, rdzv_cause_name(ev->cause),
               ev->node[0] ? ev->node : "-");
        return 0;
    case RDZV_EV_SPARE:
        printf("SPARE node=%s t=%.3f\n", node, mono_now_s());
        return 0;
    case RDZV_EV_JOB_DONE:
        printf("JOB_DONE node=%s\n", node);
        return 1;
    case RDZV_EV_JOB_FAILED:
        printf("JOB_FAILED node=%s reason=%s\n", node, reason);
        return 1;
    case RDZV_EV_ERROR:
        printf("ERROR node=%s err=%s reason=%s\n", node, err_name(ev->err), reason);
        return 1;
    }
    return 0;
}

/* COUNTS node=N total=T range=.. put=.. ... steps=S moved=M: what this
 * handle has cost etcd so far (rdzv_get_counts). */
static void print_counts(const char *node, rdzv *r)
{
    rdzv_counts c;
    rdzv_get_counts(r, &c);
    printf("COUNTS node=%s total=%llu", node, (unsigned long long)etcd_counts_total(&c.etcd));
    for (int k = 0; k < ETCD_REQ_KINDS; k++)
        printf(" %s=%llu", etcd_req_kind_name((etcd_req_kind)k), (unsigned long long)c.etcd.n[k]);
    uint64_t unary = etcd_counts_total(&c.etcd) - c.etcd.n[ETCD_REQ_WATCH];
    printf(" bytes=%llu steps=%llu moved=%llu inflight=%llu\n",
           (unsigned long long)c.etcd.answer_bytes, (unsigned long long)c.steps,
           (unsigned long long)c.moved, (unsigned long long)(unary - c.etcd.finished));
}

int main(int argc, char **argv)
{
    rdzv_config cfg = {
        .local_world_size = 1,
        .min_nodes = 1,
        .max_nodes = 1,
        .last_call_ms = 500,
        .lease_ttl_s = 5,
        .join_timeout_ms = 60000,
        .max_restarts = 3,
    };
    int exit_after = 0, go = 0;
    for (int i = 1; i < argc; i++) {
        const char *f = argv[i];
        if (i + 1 >= argc) usage();
        const char *v = argv[++i];
        if (!strcmp(f, "--endpoints"))
            cfg.etcd.endpoints = v;
        else if (!strcmp(f, "--job"))
            cfg.job = v;
        else if (!strcmp(f, "--node"))
            cfg.node_id = v;
        else if (!strcmp(f, "--addr"))
            cfg.addr = v;
        else if (!strcmp(f, "--lws"))
            cfg.local_world_size = int_arg(v, f);
        else if (!strcmp(f, "--min"))
            cfg.min_nodes = int_arg(v, f);
        else if (!strcmp(f, "--max"))
            cfg.max_nodes = int_arg(v, f);
        else if (!strcmp(f, "--last-call-ms"))
            cfg.last_call_ms = int_arg(v, f);
        else if (!strcmp(f, "--ttl"))
            cfg.lease_ttl_s = int_arg(v, f);
        else if (!strcmp(f, "--join-timeout-ms"))
            cfg.join_timeout_ms = int_arg(v, f);
        else if (!strcmp(f, "--max-restarts"))
            cfg.max_restarts = int_arg(v, f);
        else if (!strcmp(f, "--etcd-timeout-ms"))
            cfg.etcd.timeout_ms = int_arg(v, f);
        else if (!strcmp(f, "--exit-after-frozen"))
            exit_after = int_arg(v, f);
        else if (!strcmp(f, "--no-takeover"))
            cfg.no_takeover = int_arg(v, f);
        else if (!strcmp(f, "--failpoints"))
            setenv("DUCTILE_FAILPOINTS", v, 1);
        else if (!strcmp(f, "--wait-go"))
            go = int_arg(v, f);
        else
            usage();
    }
    if (!cfg.etcd.endpoints || !cfg.job || !cfg.node_id) usage();
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (go && (etcd_global_init() != ETCD_OK || wait_go(cfg.node_id) != 0)) return 1;

    char msg[256];
    rdzv *r = NULL;
    rdzv_err err = rdzv_open(&cfg, &r, msg);
    if (err != RDZV_OK) {
        one_field(msg);
        printf("OPEN_ERR node=%s err=%s msg=%s\n", cfg.node_id, err_name(err), msg);
        return 1;
    }
    int took_over = 0;
    long long inc = (long long)rdzv_incarnation(r, &took_over);
    printf("OPEN ok node=%s t=%.3f inc=%lld took_over=%d\n", cfg.node_id, mono_now_s(), inc,
           took_over);

    int frozen = 0, done = 0, stdin_open = 1, left = 0;
    char line[512];
    size_t llen = 0;
    while (!done) {
        struct pollfd p[2] = {{.fd = rdzv_fd(r), .events = POLLIN},
                              {.fd = stdin_open ? 0 : -1, .events = POLLIN}};
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR) continue;
            break;
        }
        rdzv_event ev;
        while (!done && rdzv_next_event(r, 0, &ev) == RDZV_OK) {
            done = print_event(cfg.node_id, &ev, &frozen);
            rdzv_event_free(&ev);
            if (exit_after && frozen >= exit_after) done = 1;
        }
        if (done || !(p[1].revents & (POLLIN | POLLHUP))) continue;
        ssize_t n = read(0, line + llen, sizeof(line) - 1 - llen);
        if (n <= 0) {
            stdin_open = 0;
            done = 1;
            continue;
        }
        llen += (size_t)n;
        char *nl;
        while ((nl = memchr(line, '\n', llen)) != NULL) {
            *nl = '\0';
            if (!strcmp(line, "watching")) {
                printf("WATCHING node=%s n=%d\n", cfg.node_id, rdzv_watching(r));
            } else if (!strcmp(line, "counts")) {
                print_counts(cfg.node_id, r);
            } else if (!strcmp(line, "leave")) {
                err = rdzv_leave(r);
                printf("LEFT node=%s rc=%s\n", cfg.node_id, err_name(err));
                left = done = 1;
            } else if (!strncmp(line, "fail", 4)) {
                int64_t count = -1;
                err = rdzv_report_failure(r, line[4] ? line + 5 : "", &count);
                printf("REPORTED node=%s rc=%s restarts=%lld\n", cfg.node_id, err_name(err),
                       (long long)count);
            } else if (!strncmp(line, "lost", 4)) {
                int64_t count = -1;
                int counted = -1;
                err = rdzv_report_peer_lost(r, line[4] ? line + 5 : "", &count, &counted);
                printf("REPORTED node=%s rc=%s restarts=%lld counted=%d\n", cfg.node_id,
                       err_name(err), (long long)count, counted);
            } else if (!strcmp(line, "finish")) {
                err = rdzv_finish(r);
                printf("FINISHED node=%s rc=%s\n", cfg.node_id, err_name(err));
            } else if (!strcmp(line, "close")) {
                done = 1;
            }
            size_t used = (size_t)(nl - line) + 1;
            memmove(line, nl + 1, llen - used);
            llen -= used;
            if (done) break;
        }
        if (llen == sizeof(line) - 1) llen = 0; /* an over-long line is dropped */
    }
    (void)left;
    rdzv_close(r);
    printf("EXIT node=%s\n", cfg.node_id);
    return 0;
}
