/* test_rdzv_protocol: the rendezvous protocol, end to end.
 *
 *   test_rdzv_protocol SCENARIO
 *
 * Each scenario starts its own etcd and real participant processes
 * (rdzv_participant), drives them (start, SIGKILL, leave, report a failure,
 * finish, restart etcd) and checks what every one of them reports. Every
 * scenario ends by checking agreement: no two participants ever saw
 * different memberships for the same round number. Time bounds here are
 * correctness bounds (e.g. "before the lease TTL"), kept generous.
 */
#include "check.h"
#include "ductile/etcd.h"
#include "test_etcd.h"
#include "test_rdzv_procs.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef RDZV_PARTICIPANT
#error "RDZV_PARTICIPANT must name the participant program"
#endif

#define LINE 4096

/* Waits for FROZEN from each of procs[0..n-1]; fills lines; checks they
 * agree on round and members, that ranks are dense and unique and that the
 * world size is the sum of local world sizes (lws each). */
static int check_round(tp_set *s, const int *procs, int n, int lws, char lines[][LINE]);

static int expect_round(tp_set *s, const int *procs, int n, int lws, int timeout_ms,
                        char lines[][LINE])
{
    for (int k = 0; k < n; k++)
        CHECK_OR_RETURN(tp_expect(s, procs[k], "FROZEN", timeout_ms, lines[k], LINE) == 0,
                        "process %d did not report a frozen round", procs[k]);
    return check_round(s, procs, n, lws, lines);
}

/* Like expect_round, for processes started together: when a slow starter
 * missed the first round (last call ran out first), a later round takes it
 * in; wait for the round that holds all n, taking the ENDED lines of the
 * rounds before it. */
static int settle_round(tp_set *s, const int *procs, int n, int timeout_ms, char lines[][LINE])
{
    for (int k = 0; k < n; k++)
        CHECK_OR_RETURN(tp_expect(s, procs[k], "FROZEN", timeout_ms, lines[k], LINE) == 0,
                        "process %d did not report a frozen round", procs[k]);
    for (int pass = 0; pass < 8; pass++) {
        long long maxr = 0;
        for (int k = 0; k < n; k++)
            if (tp_ifield(lines[k], "round") > maxr) maxr = tp_ifield(lines[k], "round");
        int settled = 1;
        for (int k = 0; k < n; k++) {
            if (tp_ifield(lines[k], "round") == maxr && tp_ifield(lines[k], "nmembers") == n)
                continue;
            settled = 0;
            char ended[LINE];
            CHECK_OR_RETURN(tp_expect(s, procs[k], "ENDED", timeout_ms, ended, LINE) == 0,
                            "no end");
            CHECK_OR_RETURN(tp_expect(s, procs[k], "FROZEN", timeout_ms, lines[k], LINE) == 0,
                            "process %d did not report the next round", procs[k]);
        }
        if (settled) return check_round(s, procs, n, 1, lines);
    }
    CHECK_OR_RETURN(0, "participants never settled in one round");
}

static int check_round(tp_set *s, const int *procs, int n, int lws, char lines[][LINE])
{
    (void)s;
    (void)procs;
    char *seen = calloc((size_t)n, 1);
    CHECK_OR_RETURN(seen, "calloc");
    char members0[LINE];
    tp_field(lines[0], "members", members0, sizeof(members0));
    long long round0 = tp_ifield(lines[0], "round");
    int bad = 0;
    for (int k = 0; k < n; k++) {
        char members[LINE];
        tp_field(lines[k], "members", members, sizeof(members));
        long long rank = tp_ifield(lines[k], "rank");
        if (tp_ifield(lines[k], "round") != round0 || strcmp(members, members0) != 0) bad = 1;
        if (tp_ifield(lines[k], "nmembers") != n ||
            tp_ifield(lines[k], "world") != (long long)n * lws)
            bad = 2;
        if (rank < 0 || rank >= n || seen[rank])
            bad = 3;
        else
            seen[rank] = 1;
        if (tp_ifield(lines[k], "first") != rank * lws) bad = 4;
    }
    free(seen);
    if (bad) {
        for (int k = 0; k < n; k++)
            fprintf(stderr, "    %s\n", lines[k]);
        CHECK_OR_RETURN(0, "inconsistent round (reason %d)", bad);
    }
    return 0;
}

static char (*lines_alloc(void))[LINE]
{
    return calloc(32, LINE);
}

/* members list of a FROZEN line without `node`, as a string */
static void without(const char *members, const char *node, char *out, size_t len)
{
    char copy[LINE];
    snprintf(copy, sizeof(copy), "%s", members);
    out[0] = '\0';
    char *save = NULL;
    for (char *t = strtok_r(copy, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (strcmp(t, node) == 0) continue;
        size_t l = strlen(out);
        snprintf(out + l, len - l, "%s%s", l ? "," : "", t);
    }
}

/* The store's revision now (0 when etcd does not answer). */
static int64_t store_revision(tp_set *s)
{
    etcd_config cfg = {.endpoints = s->endpoint};
    etcd_client *c = NULL;
    etcd_range_result rr = {0};
    int64_t rev = 0;
    if (etcd_client_new(&cfg, &c) == ETCD_OK && etcd_range(c, "/", 0, 1, &rr) == ETCD_OK) {
        rev = rr.revision;
        etcd_range_result_free(&rr);
    }
    etcd_client_free(c);
    return rev;
}

/* 1 when node's registration key was written after revision from: the
 * job's events from there are read up to a marker put now, so the answer
 * waits on no clock (etcd replays the history in revision order). */
static int registered_since(tp_set *s, const char *node, int64_t from)
{
    char prefix[256], key[256], marker[256];
    snprintf(prefix, sizeof(prefix), "/ductile/%s/", s->job);
    snprintf(key, sizeof(key), "/ductile/%s/nodes/%s", s->job, node);
    snprintf(marker, sizeof(marker), "/ductile/%s/test-marker", s->job);
    etcd_config cfg = {.endpoints = s->endpoint};
    etcd_client *c = NULL;
    etcd_watch *w = NULL;
    int found = -1;
    if (etcd_client_new(&cfg, &c) != ETCD_OK || etcd_put(c, marker, "1", 1, 0, NULL) != ETCD_OK ||
        etcd_watch_open(c, prefix, 1, from + 1, &w) != ETCD_OK)
        goto out;
    double deadline = mono_now_s() + 30.0;
    while (found < 0 && mono_now_s() < deadline) {
        etcd_event *evs = NULL;
        size_t n = 0;
        if (etcd_watch_next(w, 1000, &evs, &n) != ETCD_OK) break;
        for (size_t i = 0; i < n && found < 0; i++) {
            if (strcmp(evs[i].kv.key, key) == 0) found = 1;
            else if (strcmp(evs[i].kv.key, marker) == 0) found = 0;
        }
        etcd_events_free(evs, n);
    }
out:
    if (w) etcd_watch_close(w);
    etcd_client_free(c);
    if (found < 0) fprintf(stderr, "  registered_since: no answer from etcd\n");
    return found;
}

/* ---- scenarios ---- */

static int sc_form(tp_set *s)
{
    char(*lines)[LINE] = lines_alloc();
    CHECK_OR_RETURN(lines, "calloc");
    int ids[32];
    char node[32];
    /* one participant, alone */
    snprintf(s->job, sizeof(s->job), "form-one");
    ids[0] = tp_spawn(s, "solo", "--min 1 --max 1 --lws 3");
    if (expect_round(s, ids, 1, 3, 20000, lines) != 0) return 1;
    CHECK_OR_RETURN(tp_ifield(lines[0], "round") == 1, "%s", lines[0]);

    /* sixteen, min = max = 16: frozen at once when the 16th joins */
    snprintf(s->job, sizeof(s->job), "form-sixteen");
    for (int i = 0; i < 16; i++) {
        snprintf(node, sizeof(node), "n%02d", i);
        ids[i] = tp_spawn(s, node, "--min 16 --max 16 --lws 2 --last-call-ms 60000");
    }
    if (expect_round(s, ids, 16, 2, 60000, lines) != 0) return 1;

    /* min 2, max 4, last call: three that start together all get in */
    snprintf(s->job, sizeof(s->job), "form-lastcall");
    for (int i = 0; i < 3; i++) {
        snprintf(node, sizeof(node), "lc%d", i);
        ids[i] = tp_spawn(s, node, "--min 2 --max 4 --last-call-ms 4000");
    }
    if (expect_round(s, ids, 3, 1, 30000, lines) != 0) return 1;

    /* below min nothing freezes, and the join timeout says so */
    snprintf(s->job, sizeof(s->job), "form-short");
    ids[0] = tp_spawn(s, "lonely", "--min 2 --max 2 --join-timeout-ms 1500");
    char line[LINE];
    CHECK_OR_RETURN(tp_expect(s, ids[0], "ERROR", 20000, line, sizeof(line)) == 0,
                    "no join timeout");
    char err[64];
    tp_field(line, "err", err, sizeof(err));
    CHECK_OR_RETURN(strcmp(err, "timeout") == 0, "%s", line);
    free(lines);
    return 0;
}

/* Starts n participants of one job and waits for their first round. */
static int start_round(tp_set *s, int n, const char *opts, int *ids, char lines[][LINE])
{
    char node[32];
    for (int i = 0; i < n; i++) {
        snprintf(node, sizeof(node), "p%d", i);
        ids[i] = tp_spawn(s, node, opts);
        CHECK_OR_RETURN(ids[i] >= 0, "spawn");
    }
    return settle_round(s, ids, n, 60000, lines);
}

/* Index (in ids) of the process holding `rank` in a set of FROZEN lines. */
static int holder(char lines[][LINE], int n, int rank)
{
    for (int k = 0; k < n; k++)
        if (tp_ifield(lines[k], "rank") == rank) return k;
    return -1;
}

/* After member `gone` (index into ids) ended the round: the others report
 * the end with `cause`, then a round without it, old order kept. */
static int expect_survivors(tp_set *s, int *ids, int n, int gone, const char *cause,
                            char lines[][LINE], double t0, double bound_s)
{
    char members[LINE], expect[LINE], line[LINE];
    tp_field(lines[0], "members", members, sizeof(members));
    without(members, s->procs[ids[gone]].node, expect, sizeof(expect));
    int rest[32], m = 0;
    for (int k = 0; k < n; k++)
        if (k != gone) rest[m++] = ids[k];
    for (int k = 0; k < m; k++) {
        CHECK_OR_RETURN(tp_expect(s, rest[k], "ENDED", (int)(bound_s * 1000), line, sizeof(line)) ==
                            0,
                        "no end of round");
        double dt = mono_now_s() - t0;
        char c[64], by[64];
        tp_field(line, "cause", c, sizeof(c));
        tp_field(line, "by", by, sizeof(by));
        CHECK_OR_RETURN(strcmp(c, cause) == 0 && strcmp(by, s->procs[ids[gone]].node) == 0, "%s",
                        line);
        CHECK_OR_RETURN(dt < bound_s, "noticed after %.1f s (bound %.1f s)", dt, bound_s);
    }
    char(*after)[LINE] = lines_alloc();
    CHECK_OR_RETURN(after, "calloc");
    if (expect_round(s, rest, m, 1, 30000, after) != 0) return 1;
    char now[LINE];
    tp_field(after[0], "members", now, sizeof(now));
    CHECK_OR_RETURN(strcmp(now, expect) == 0, "survivors' order changed: was %s, now %s", members,
                    now);
    for (int k = 0; k < m; k++)
        snprintf(lines[k], LINE, "%s", after[k]);
    free(after);
    return 0;
}

static int sc_kill(tp_set *s)
{
    snprintf(s->job, sizeof(s->job), "kill");
    char(*lines)[LINE] = lines_alloc();
    int ids[8];
    if (start_round(s, 4, "--min 2 --max 4 --ttl 3 --last-call-ms 300", ids, lines) != 0) return 1;
    int victim = holder(lines, 4, 1);
    CHECK_OR_RETURN(victim >= 0, "no rank 1");
    double t0 = mono_now_s();
    tp_kill(s, ids[victim], SIGKILL);
    /* the lease TTL (3 s) bounds the detection; etcd checks expiry at
     * intervals, so allow it a little more */
    int rc = expect_survivors(s, ids, 4, victim, "member_lost", lines, t0, 3.0 + 5.0);
    free(lines);
    return rc;
}

/* Waits until each of ids[0..n) watches `want` members (rdzv_watching). */
static int wait_watching(tp_set *s, const int *ids, int n, int want)
{
    char line[LINE];
    double deadline = mono_now_s() + 30.0;
    for (int k = 0; k < n; k++) {
        for (;;) {
            CHECK_OR_RETURN(tp_send(s, ids[k], "watching") == 0, "send");
            CHECK_OR_RETURN(tp_expect(s, ids[k], "WATCHING", 10000, line, sizeof(line)) == 0,
                            "no WATCHING answer");
            if (tp_ifield(line, "n") == want) break;
            CHECK_OR_RETURN(mono_now_s() < deadline, "%s never watched %d members", line, want);
            usleep(100 * 1000);
        }
    }
    return 0;
}

/* A member killed (its pod gone: the process and its sockets) is seen at
 * once by the members that watch it (rdzv_sentinel.c), not a lease TTL
 * later: the TTL is 60 s, the bound 30 s. A member that is stopped
 * (SIGSTOP: alive, silent, its sockets open) is not cut off: the round
 * goes on, and it is still in it when it wakes. Each member watches the
 * next two before the kill (a member never seen answering is not judged). */
static int sentinel_run(tp_set *s, const char *job, const char *opts)
{
    snprintf(s->job, sizeof(s->job), "%s", job);
    char(*lines)[LINE] = lines_alloc();
    char line[LINE];
    int ids[4];
    if (start_round(s, 4, opts, ids, lines) != 0) return 1;
    if (wait_watching(s, ids, 4, 2) != 0) return 1;
    int victim = holder(lines, 4, 1);
    CHECK_OR_RETURN(victim >= 0, "no rank 1");
    double t0 = mono_now_s();
    tp_kill(s, ids[victim], SIGKILL);
    if (expect_survivors(s, ids, 4, victim, "member_lost", lines, t0, 30.0) != 0) return 1;
    int rest[3], m = 0;
    for (int k = 0; k < 4; k++)
        if (k != victim) rest[m++] = ids[k];
    tp_kill(s, rest[0], SIGSTOP);
    for (int k = 1; k < m; k++)
        CHECK_OR_RETURN(tp_expect(s, rest[k], "ENDED", 3000, line, sizeof(line)) != 0,
                        "a stopped member was cut off: %s", line);
    tp_kill(s, rest[0], SIGCONT);
    tp_drain(s, 1000);
    for (int k = 0; k < m; k++) {
        CHECK_OR_RETURN(tp_expect(s, rest[k], "ENDED", 1, line, sizeof(line)) != 0, "%s", line);
        CHECK_OR_RETURN(tp_expect(s, rest[k], "ERROR", 1, line, sizeof(line)) != 0, "%s", line);
    }
    free(lines);
    return 0;
}

/* The sentinel takes each watched member's registration from the driver's
 * snapshot of the round (no read of its own)... */
static int sc_sentinel(tp_set *s)
{
    return sentinel_run(s, "sentinel",
                        "--min 2 --max 4 --ttl 60 --last-call-ms 300 --addr 127.0.0.1");
}

/* ...and where none comes (failpoint: the snapshot's are not taken), it
 * reads the registration itself and watches the same. */
static int sc_sentinel_read(tp_set *s)
{
    return sentinel_run(s, "sentinel-read",
                        "--min 2 --max 4 --ttl 60 --last-call-ms 300 --addr 127.0.0.1 "
                        "--failpoints rdzv.sentinel=1+:read");
}

static int sc_leave(tp_set *s)
{
    snprintf(s->job, sizeof(s->job), "leave");
    char(*lines)[LINE] = lines_alloc();
    int ids[8];
    /* TTL 30 s: a clean leave must be seen long before the lease could expire */
    if (start_round(s, 4, "--min 2 --max 4 --ttl 30 --last-call-ms 300", ids, lines) != 0) return 1;
    int who = holder(lines, 4, 2);
    CHECK_OR_RETURN(who >= 0, "no rank 2");
    double t0 = mono_now_s();
    CHECK_OR_RETURN(tp_send(s, ids[who], "leave") == 0, "send");
    char line[LINE];
    CHECK_OR_RETURN(tp_expect(s, ids[who], "LEFT", 10000, line, sizeof(line)) == 0, "no LEFT");
    CHECK_OR_RETURN(strstr(line, "rc=ok") != NULL, "%s", line);
    int rc = expect_survivors(s, ids, 4, who, "member_left", lines, t0, 10.0);
    free(lines);
    return rc;
}

static int sc_waiting(tp_set *s)
{
    snprintf(s->job, sizeof(s->job), "waiting");
    char(*lines)[LINE] = lines_alloc();
    char line[LINE], members[LINE];
    const char *opts = "--min 2 --max 3 --ttl 30 --last-call-ms 300";
    int ids[8];
    if (start_round(s, 2, opts, ids, lines) != 0) return 1;
    char first[LINE];
    tp_field(lines[0], "members", first, sizeof(first));

    /* a third node: there is room, so a new round opens and takes it in */
    ids[2] = tp_spawn(s, "p2", opts);
    for (int k = 0; k < 2; k++) {
        CHECK_OR_RETURN(tp_expect(s, ids[k], "ENDED", 20000, line, sizeof(line)) == 0, "no end");
        CHECK_OR_RETURN(strstr(line, "cause=node_waiting") && strstr(line, "by=p2"), "%s", line);
    }
    if (expect_round(s, ids, 3, 1, 30000, lines) != 0) return 1;
    tp_field(lines[0], "members", members, sizeof(members));
    char expect[LINE];
    snprintf(expect, sizeof(expect), "%.4000s,p2", first);
    CHECK_OR_RETURN(strcmp(members, expect) == 0, "old members keep their order, newcomer last: %s",
                    members);

    /* a fourth: the round is full, it is a hot spare */
    ids[3] = tp_spawn(s, "p3", opts);
    CHECK_OR_RETURN(tp_expect(s, ids[3], "SPARE", 20000, line, sizeof(line)) == 0, "no SPARE");

    /* a member leaves: the spare is in the next round at once */
    int who = holder(lines, 3, 0);
    CHECK_OR_RETURN(tp_send(s, ids[who], "leave") == 0, "send");
    int rest[3], m = 0;
    for (int k = 0; k < 4; k++)
        if (k != who) rest[m++] = ids[k];
    if (expect_round(s, rest, 3, 1, 30000, lines) != 0) return 1;
    tp_field(lines[0], "members", members, sizeof(members));
    char kept[LINE];
    without(expect, s->procs[ids[who]].node, kept, sizeof(kept));
    snprintf(expect, sizeof(expect), "%.4000s,p3", kept);
    CHECK_OR_RETURN(strcmp(members, expect) == 0, "expected %s, got %s", expect, members);
    free(lines);
    return 0;
}

static int sc_failure(tp_set *s)
{
    snprintf(s->job, sizeof(s->job), "failure");
    char(*lines)[LINE] = lines_alloc();
    char line[LINE];
    int ids[4];
    if (start_round(s, 3, "--min 3 --max 3 --ttl 30 --max-restarts 1", ids, lines) != 0) return 1;
    CHECK_OR_RETURN(tp_ifield(lines[0], "restarts") == 0, "%s", lines[0]);
    CHECK_OR_RETURN(tp_send(s, ids[0], "fail worker 3 exited with status 1") == 0, "send");
    CHECK_OR_RETURN(tp_expect(s, ids[0], "REPORTED", 10000, line, sizeof(line)) == 0,
                    "no REPORTED");
    CHECK_OR_RETURN(strstr(line, "rc=ok") && tp_ifield(line, "restarts") == 1, "%s", line);
    for (int k = 0; k < 3; k++) {
        CHECK_OR_RETURN(tp_expect(s, ids[k], "ENDED", 10000, line, sizeof(line)) == 0, "no end");
        CHECK_OR_RETURN(strstr(line, "cause=failure"), "%s", line);
    }
    if (expect_round(s, ids, 3, 1, 30000, lines) != 0) return 1;
    for (int k = 0; k < 3; k++)
        CHECK_OR_RETURN(tp_ifield(lines[k], "restarts") == 1, "%s", lines[k]);
    /* a second failure is past max_restarts = 1: the job fails everywhere */
    CHECK_OR_RETURN(tp_send(s, ids[1], "fail again") == 0, "send");
    for (int k = 0; k < 3; k++) {
        CHECK_OR_RETURN(tp_expect(s, ids[k], "JOB_FAILED", 10000, line, sizeof(line)) == 0,
                        "no JOB_FAILED");
        CHECK_OR_RETURN(strstr(line, "restart_limit"), "%s", line);
    }
    /* and a node that starts later is told so at once, without a
     * registration in the ended job (the registration txn's compare) */
    int64_t before = store_revision(s);
    int late = tp_spawn(s, "late", "--min 3 --max 3");
    CHECK_OR_RETURN(tp_expect(s, late, "OPEN_ERR", 10000, line, sizeof(line)) == 0, "late open");
    CHECK_OR_RETURN(strstr(line, "err=job_failed"), "%s", line);
    CHECK_OR_RETURN(before > 0 && registered_since(s, "late", before) == 0,
                    "the late node registered in the failed job");
    free(lines);
    return 0;
}

static int sc_finish(tp_set *s)
{
    snprintf(s->job, sizeof(s->job), "finish");
    char(*lines)[LINE] = lines_alloc();
    char line[LINE];
    int ids[4];
    if (start_round(s, 3, "--min 3 --max 3 --ttl 30", ids, lines) != 0) return 1;
    CHECK_OR_RETURN(tp_send(s, ids[2], "finish") == 0, "send");
    for (int k = 0; k < 3; k++)
        CHECK_OR_RETURN(tp_expect(s, ids[k], "JOB_DONE", 10000, line, sizeof(line)) == 0,
                        "no JOB_DONE");
    int64_t before = store_revision(s);
    int late = tp_spawn(s, "late", "--min 3 --max 3");
    CHECK_OR_RETURN(tp_expect(s, late, "OPEN_ERR", 10000, line, sizeof(line)) == 0, "late open");
    CHECK_OR_RETURN(strstr(line, "err=job_done"), "%s", line);
    CHECK_OR_RETURN(before > 0 && registered_since(s, "late", before) == 0,
                    "the late node registered in the completed job");
    free(lines);
    return 0;
}

static int sc_etcd_restart(tp_set *s)
{
    snprintf(s->job, sizeof(s->job), "etcd-restart");
    char(*lines)[LINE] = lines_alloc();
    char line[LINE];
    const char *opts = "--min 3 --max 3 --ttl 10 --join-timeout-ms 60000";
    int ids[3];
    ids[0] = tp_spawn(s, "p0", opts);
    ids[1] = tp_spawn(s, "p1", opts);
    for (int k = 0; k < 2; k++)
        CHECK_OR_RETURN(tp_expect(s, ids[k], "OPEN", 20000, line, sizeof(line)) == 0, "no OPEN");
    /* both have joined round 1 and wait for a third; etcd goes away */
    test_etcd_kill(s->etcd);
    usleep(1500 * 1000);
    CHECK_OR_RETURN(test_etcd_restart(s->etcd) == 0, "etcd restart");
    ids[2] = tp_spawn(s, "p2", opts);
    if (expect_round(s, ids, 3, 1, 60000, lines) != 0) return 1;
    /* etcd goes away again under a frozen round; once it is back, a leave
     * must still reach everyone (their watches resumed) */
    test_etcd_kill(s->etcd);
    usleep(1500 * 1000);
    CHECK_OR_RETURN(test_etcd_restart(s->etcd) == 0, "etcd restart");
    int who = holder(lines, 3, 1);
    CHECK_OR_RETURN(who >= 0, "no rank 1");
    CHECK_OR_RETURN(tp_send(s, ids[who], "leave") == 0, "send");
    char members[LINE], expect[LINE];
    tp_field(lines[0], "members", members, sizeof(members));
    without(members, s->procs[ids[who]].node, expect, sizeof(expect));
    int rest[3], m = 0;
    for (int k = 0; k < 3; k++) {
        if (k == who) continue;
        rest[m++] = ids[k];
        CHECK_OR_RETURN(tp_expect(s, ids[k], "ENDED", 20000, line, sizeof(line)) == 0, "no end");
        CHECK_OR_RETURN(strstr(line, "cause=member_left"), "%s", line);
    }
    /* min is 3: a newcomer completes the next round, after the survivors */
    rest[m++] = tp_spawn(s, "p3", opts);
    if (expect_round(s, rest, 3, 1, 60000, lines) != 0) return 1;
    tp_field(lines[0], "members", members, sizeof(members));
    size_t l = strlen(expect);
    snprintf(expect + l, sizeof(expect) - l, ",p3");
    CHECK_OR_RETURN(strcmp(members, expect) == 0, "expected %s, got %s", expect, members);
    free(lines);
    return 0;
}

/* A member stalls (SIGSTOP) past its lease TTL: the others go on without
 * it, and when it wakes it learns that it is out (lease lost). */
static int sc_stall(tp_set *s)
{
    snprintf(s->job, sizeof(s->job), "stall");
    char(*lines)[LINE] = lines_alloc();
    char line[LINE];
    int ids[4];
    if (start_round(s, 3, "--min 2 --max 3 --ttl 3 --last-call-ms 300", ids, lines) != 0) return 1;
    int who = holder(lines, 3, 0);
    CHECK_OR_RETURN(who >= 0, "no rank 0");
    double t0 = mono_now_s();
    tp_kill(s, ids[who], SIGSTOP);
    if (expect_survivors(s, ids, 3, who, "member_lost", lines, t0, 3.0 + 5.0) != 0) return 1;
    tp_kill(s, ids[who], SIGCONT);
    CHECK_OR_RETURN(tp_expect(s, ids[who], "ERROR", 15000, line, sizeof(line)) == 0,
                    "no error on wake");
    CHECK_OR_RETURN(strstr(line, "err=lease_lost"), "%s", line);
    free(lines);
    return 0;
}

/* Every member dies; nodes that come later must not wait forever as spares
 * of a dead round: they see the members gone and form the next one. */
static int sc_all_dead(tp_set *s)
{
    snprintf(s->job, sizeof(s->job), "all-dead");
    char(*lines)[LINE] = lines_alloc();
    const char *opts = "--min 2 --max 2 --ttl 3 --last-call-ms 300";
    int ids[4];
    if (start_round(s, 2, opts, ids, lines) != 0) return 1;
    tp_kill(s, ids[0], SIGKILL);
    tp_kill(s, ids[1], SIGKILL);
    int fresh[2];
    fresh[0] = tp_spawn(s, "q0", opts);
    fresh[1] = tp_spawn(s, "q1", opts);
    if (expect_round(s, fresh, 2, 1, 30000, lines) != 0) return 1;
    CHECK_OR_RETURN(tp_ifield(lines[0], "round") >= 2, "%s", lines[0]);
    free(lines);
    return 0;
}

/* A member whose registration is gone when its round freezes is still seen
 * lost: a frozen round's members check only the next members around the
 * ring (docs/design.md, "Rounds", End), so the one before it must. The
 * test joins round 1 itself as "ghost", last (rank 4 of 5), under a lease
 * of its own and with no registration at all: the round freezes with the
 * ghost in it, ends at once (member_lost, by the ghost, long before any
 * lease TTL) and the next round holds the four others. */
static int sc_ring(tp_set *s)
{
    snprintf(s->job, sizeof(s->job), "ring");
    char(*lines)[LINE] = lines_alloc();
    CHECK_OR_RETURN(lines, "calloc");
    char line[LINE], node[32], key[256];
    int ids[4];
    for (int i = 0; i < 4; i++) {
        snprintf(node, sizeof(node), "r%d", i);
        ids[i] = tp_spawn(s, node, "--min 2 --max 5 --ttl 60 --last-call-ms 60000");
        CHECK_OR_RETURN(ids[i] >= 0, "spawn");
    }
    etcd_config cfg = {.endpoints = s->endpoint};
    etcd_client *c = NULL;
    CHECK_OR_RETURN(etcd_client_new(&cfg, &c) == ETCD_OK, "etcd client");
    snprintf(key, sizeof(key), "/ductile/%s/rounds/1/joined/", s->job);
    double deadline = mono_now_s() + 30.0;
    for (;;) {
        etcd_range_result rr;
        CHECK_OR_RETURN(etcd_range(c, key, 1, 0, &rr) == ETCD_OK, "range joins");
        size_t n = rr.n;
        etcd_range_result_free(&rr);
        if (n == 4) break;
        CHECK_OR_RETURN(mono_now_s() < deadline, "only %zu joined round 1", n);
        usleep(50 * 1000);
    }
    int64_t lease = 0;
    CHECK_OR_RETURN(etcd_lease_grant(c, 60, &lease) == ETCD_OK, "lease grant");
    snprintf(key, sizeof(key), "/ductile/%s/rounds/1/joined/ghost", s->job);
    const char *val = "{\"addr\":\"127.0.0.1\",\"lws\":1,\"inc\":1,\"probe\":0}";
    CHECK_OR_RETURN(etcd_put(c, key, val, strlen(val), lease, NULL) == ETCD_OK, "ghost join");
    /* A member whose driver was slow may see round 1 only once the member
     * before the ghost has ended it: it then reports round 2 alone. */
    int saw = 0;
    for (int k = 0; k < 4; k++) {
        char members[LINE], cause[64], by[64];
        CHECK_OR_RETURN(tp_expect(s, ids[k], "FROZEN", 30000, lines[k], LINE) == 0,
                        "round 1 never froze");
        if (tp_ifield(lines[k], "round") != 1) continue;
        saw++;
        tp_field(lines[k], "members", members, sizeof(members));
        CHECK_OR_RETURN(tp_ifield(lines[k], "nmembers") == 5 && strstr(members, "ghost"), "%s",
                        lines[k]);
        CHECK_OR_RETURN(tp_expect(s, ids[k], "ENDED", 30000, line, sizeof(line)) == 0,
                        "the round with the ghost never ended");
        tp_field(line, "cause", cause, sizeof(cause));
        tp_field(line, "by", by, sizeof(by));
        CHECK_OR_RETURN(strcmp(cause, "member_lost") == 0 && strcmp(by, "ghost") == 0, "%s", line);
        CHECK_OR_RETURN(tp_expect(s, ids[k], "FROZEN", 30000, lines[k], LINE) == 0,
                        "no round after the ghost's");
    }
    CHECK_OR_RETURN(saw > 0, "nobody saw round 1 frozen with the ghost");
    if (check_round(s, ids, 4, 1, lines) != 0) return 1;
    CHECK_OR_RETURN(tp_ifield(lines[0], "round") == 2, "%s", lines[0]);
    CHECK_OR_RETURN(!strstr(lines[0], "ghost"), "%s", lines[0]);
    etcd_lease_revoke(c, lease);
    etcd_client_free(c);
    free(lines);
    return 0;
}

/* The earliest joiner (the one that freezes) dies while the round is open:
 * the next joiner, watching its key, takes over and freezes without it. */
static int sc_takeover(tp_set *s)
{
    snprintf(s->job, sizeof(s->job), "takeover");
    char(*lines)[LINE] = lines_alloc();
    char line[LINE];
    const char *opts = "--min 3 --max 3 --ttl 3";
    int first = tp_spawn(s, "a0", opts);
    CHECK_OR_RETURN(tp_expect(s, first, "OPEN", 20000, line, sizeof(line)) == 0, "a0 open");
    int ids[3];
    ids[0] = tp_spawn(s, "a1", opts);
    CHECK_OR_RETURN(tp_expect(s, ids[0], "OPEN", 20000, line, sizeof(line)) == 0, "a1 open");
    tp_kill(s, first, SIGKILL);
    ids[1] = tp_spawn(s, "a2", opts);
    ids[2] = tp_spawn(s, "a3", opts);
    if (expect_round(s, ids, 3, 1, 30000, lines) != 0) return 1;
    char members[LINE];
    tp_field(lines[0], "members", members, sizeof(members));
    CHECK_OR_RETURN(strstr(members, "a0") == NULL, "the dead freezer is a member: %s", members);
    free(lines);
    return 0;
}

/* The lease of nodes/<node> as etcd has it now; 0 when there is none. */
static int64_t node_lease(tp_set *s, const char *node)
{
    etcd_config cfg = {.endpoints = s->endpoint};
    etcd_client *c = NULL;
    if (etcd_client_new(&cfg, &c) != ETCD_OK) return 0;
    char key[256];
    snprintf(key, sizeof(key), "/ductile/%s/nodes/%s", s->job, node);
    etcd_kv kv;
    int64_t lease = 0;
    if (etcd_get(c, key, &kv) == ETCD_OK) {
        lease = kv.lease;
        etcd_kv_free(&kv);
    }
    etcd_client_free(c);
    return lease;
}

/* 1 while etcd still has the lease, 0 once it is gone, -1 on error. */
static int lease_alive(tp_set *s, int64_t lease)
{
    etcd_config cfg = {.endpoints = s->endpoint};
    etcd_client *c = NULL;
    if (etcd_client_new(&cfg, &c) != ETCD_OK) return -1;
    int64_t ttl = 0;
    etcd_err e = etcd_lease_keepalive(c, lease, &ttl);
    etcd_client_free(c);
    return e == ETCD_OK ? 1 : e == ETCD_ERR_NOT_FOUND ? 0 : -1;
}

/* FROZEN lines process i has printed so far. */
static int frozen_lines(tp_set *s, int i)
{
    int n = 0;
    for (size_t k = 0; k < s->procs[i].nlines; k++)
        n += strncmp(s->procs[i].lines[k], "FROZEN ", 7) == 0;
    return n;
}

/* A restarted node: SIGKILL, and a participant with the same node id at
 * once. It finds its id registered, probes the registered incarnation
 * (refused: dead), takes the registration over and revokes the old lease;
 * the others see the member under another lease and the next round holds
 * the new incarnation, in the old rank. The TTL is 30 s: the old lease was
 * alive when the new one came, and is gone because it was revoked. The
 * sentinels are off (failpoint), as when the dead node's watchers died
 * with it: they would revoke the old lease first, and the new one would
 * find no registration to take over. */
static int sc_restart(tp_set *s)
{
    snprintf(s->job, sizeof(s->job), "restart");
    char(*lines)[LINE] = lines_alloc();
    char line[LINE], members[LINE], now[LINE];
    const char *opts = "--min 3 --max 3 --ttl 30 --last-call-ms 300 --addr 127.0.0.1 "
                       "--failpoints rdzv.sentinel=1+:off";
    int ids[3];
    if (start_round(s, 3, opts, ids, lines) != 0) return 1;
    long long round = tp_ifield(lines[0], "round");
    tp_field(lines[0], "members", members, sizeof(members));
    int victim = holder(lines, 3, 1);
    CHECK_OR_RETURN(victim >= 0, "no rank 1");
    const char *node = s->procs[ids[victim]].node;
    int64_t old = node_lease(s, node);
    CHECK_OR_RETURN(old != 0, "no registration of %s", node);
    double t0 = mono_now_s();
    tp_kill(s, ids[victim], SIGKILL);
    CHECK_OR_RETURN(lease_alive(s, old) == 1, "the old lease is gone before the restart");
    int fresh = tp_spawn(s, node, opts);
    CHECK_OR_RETURN(tp_expect(s, fresh, "OPEN", 20000, line, sizeof(line)) == 0, "no open");
    CHECK_OR_RETURN(strstr(line, "OPEN ok") && tp_ifield(line, "took_over") == 1 &&
                        tp_ifield(line, "inc") == 2,
                    "%s", line);
    CHECK_OR_RETURN(lease_alive(s, old) == 0, "the old lease outlived the takeover");
    int all[3], m = 0;
    for (int k = 0; k < 3; k++) {
        if (k == victim) continue;
        all[m++] = ids[k];
        CHECK_OR_RETURN(tp_expect(s, ids[k], "ENDED", 20000, line, sizeof(line)) == 0, "no end");
        CHECK_OR_RETURN(strstr(line, "cause=member_lost") && tp_ifield(line, "round") == round,
                        "%s", line);
    }
    all[m++] = fresh;
    if (expect_round(s, all, 3, 1, 20000, lines) != 0) return 1;
    double dt = mono_now_s() - t0;
    tp_field(lines[0], "members", now, sizeof(now));
    CHECK_OR_RETURN(tp_ifield(lines[0], "round") == round + 1, "%s", lines[0]);
    CHECK_OR_RETURN(strcmp(now, members) == 0, "ranks changed: was %s, now %s", members, now);
    CHECK_OR_RETURN(node_lease(s, node) != old, "%s is still under the old lease", node);
    CHECK_OR_RETURN(dt < 15.0, "back after %.1f s; the old lease's TTL is 30 s", dt);
    free(lines);
    return 0;
}

/* Two live participants with one node id never both hold it. A second one
 * is refused while the first answers its probe, and while the first is
 * stopped (no answer: unknown, so its lease decides). One that takes over
 * the stopped first anyway (failpoint rdzv.probe=dead: the worst wrong
 * verdict, a probe rejected by a firewall) is the node from then on: the
 * first, woken, finds its registration gone and is out, in no later round. */
static int sc_twin(tp_set *s)
{
    snprintf(s->job, sizeof(s->job), "twin");
    char(*lines)[LINE] = lines_alloc();
    char line[LINE], opts_dead[256];
    const char *opts = "--min 2 --max 2 --ttl 30 --last-call-ms 300 --addr 127.0.0.1";
    snprintf(opts_dead, sizeof(opts_dead), "%s --failpoints rdzv.probe=1:dead", opts);
    int ids[2];
    if (start_round(s, 2, opts, ids, lines) != 0) return 1;
    long long round = tp_ifield(lines[0], "round");
    const char *node = s->procs[ids[1]].node;
    int64_t old = node_lease(s, node);

    int twin = tp_spawn(s, node, opts);
    CHECK_OR_RETURN(tp_expect(s, twin, "OPEN_ERR", 20000, line, sizeof(line)) == 0, "live twin");
    CHECK_OR_RETURN(strstr(line, "err=duplicate") && strstr(line, "by_a_live_agent"), "%s", line);

    tp_kill(s, ids[1], SIGSTOP);
    twin = tp_spawn(s, node, opts);
    CHECK_OR_RETURN(tp_expect(s, twin, "OPEN_ERR", 20000, line, sizeof(line)) == 0, "stopped twin");
    CHECK_OR_RETURN(strstr(line, "err=duplicate") && strstr(line, "did_not_answer"), "%s", line);
    CHECK_OR_RETURN(node_lease(s, node) == old && lease_alive(s, old) == 1,
                    "a refused twin touched the registration");

    int thief = tp_spawn(s, node, opts_dead);
    CHECK_OR_RETURN(tp_expect(s, thief, "OPEN", 20000, line, sizeof(line)) == 0, "no open");
    CHECK_OR_RETURN(strstr(line, "OPEN ok") && tp_ifield(line, "took_over") == 1, "%s", line);
    CHECK_OR_RETURN(tp_expect(s, ids[0], "ENDED", 20000, line, sizeof(line)) == 0, "no end");
    CHECK_OR_RETURN(strstr(line, "cause=member_lost"), "%s", line);
    int now[2] = {ids[0], thief};
    if (expect_round(s, now, 2, 1, 20000, lines) != 0) return 1;
    CHECK_OR_RETURN(tp_ifield(lines[0], "round") == round + 1, "%s", lines[0]);

    tp_kill(s, ids[1], SIGCONT);
    CHECK_OR_RETURN(tp_expect(s, ids[1], "ERROR", 20000, line, sizeof(line)) == 0,
                    "the woken first did not learn that it is out");
    CHECK_OR_RETURN(strstr(line, "err=lease_lost"), "%s", line);
    CHECK_OR_RETURN(tp_expect(s, ids[1], "EXIT", 20000, line, sizeof(line)) == 0, "no exit");
    CHECK_OR_RETURN(frozen_lines(s, ids[1]) == 1, "the woken first saw a later round");
    /* and the round it left behind goes on: nobody ended it again */
    tp_drain(s, 1000);
    CHECK_OR_RETURN(tp_expect(s, thief, "ENDED", 1, line, sizeof(line)) != 0, "%s", line);
    CHECK_OR_RETURN(node_lease(s, node) != old, "the first took its registration back");
    free(lines);
    return 0;
}

static int sc_errors(tp_set *s)
{
    char line[LINE], err[64];
    /* the same node id twice while the first is alive */
    snprintf(s->job, sizeof(s->job), "dup");
    int a = tp_spawn(s, "twin", "--min 2 --max 2");
    CHECK_OR_RETURN(tp_expect(s, a, "OPEN", 20000, line, sizeof(line)) == 0, "first open");
    int b = tp_spawn(s, "twin", "--min 2 --max 2");
    CHECK_OR_RETURN(tp_expect(s, b, "OPEN_ERR", 20000, line, sizeof(line)) == 0, "second open");
    tp_field(line, "err", err, sizeof(err));
    CHECK_OR_RETURN(strcmp(err, "duplicate") == 0, "%s", line);

    /* bad configuration: one clear line, no crash */
    int c = tp_spawn(s, "bad", "--min 3 --max 2");
    CHECK_OR_RETURN(tp_expect(s, c, "OPEN_ERR", 20000, line, sizeof(line)) == 0, "bad config");
    CHECK_OR_RETURN(strstr(line, "err=arg"), "%s", line);

    /* etcd not there at all: a clear error within the deadline */
    tp_set down;
    char ep[64];
    int dead_fd;
    int dead = th_dead_port(&dead_fd);
    CHECK_OR_RETURN(dead > 0, "no port");
    snprintf(ep, sizeof(ep), "http://127.0.0.1:%d", dead);
    tp_init(&down, s->exe, ep, "down");
    double t0 = mono_now_s();
    int d = tp_spawn(&down, "x", "--etcd-timeout-ms 2000");
    int got = tp_expect(&down, d, "OPEN_ERR", 20000, line, sizeof(line));
    double dt = mono_now_s() - t0;
    tp_free(&down);
    close(dead_fd);
    CHECK_OR_RETURN(got == 0, "no error with etcd down");
    tp_field(line, "err", err, sizeof(err));
    CHECK_OR_RETURN(strcmp(err, "etcd") == 0 && strstr(line, "127.0.0.1"), "%s", line);
    CHECK_OR_RETURN(dt < 12.0, "took %.1f s with a 2 s etcd deadline", dt);
    return 0;
}

int main(int argc, char **argv)
{
    static const tp_scenario scenarios[] = {
        {"form", sc_form},
        {"kill", sc_kill},
        {"sentinel", sc_sentinel},
        {"sentinel-read", sc_sentinel_read},
        {"leave", sc_leave},
        {"waiting", sc_waiting},
        {"failure", sc_failure},
        {"finish", sc_finish},
        {"etcd-restart", sc_etcd_restart},
        {"takeover", sc_takeover},
        {"restart", sc_restart},
        {"twin", sc_twin},
        {"stall", sc_stall},
        {"all-dead", sc_all_dead},
        {"errors", sc_errors},
        {"ring", sc_ring},
    };
    return tp_main(argc, argv, RDZV_PARTICIPANT, scenarios,
                   sizeof(scenarios) / sizeof(scenarios[0]));
}
