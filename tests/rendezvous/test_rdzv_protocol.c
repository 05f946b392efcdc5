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
#include "rdzv_protocol.h"

#ifndef RDZV_PARTICIPANT
#error "RDZV_PARTICIPANT must name the participant program"
#endif

int expect_round(tp_set *s, const int *procs, int n, int lws, int timeout_ms, char lines[][LINE])
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

int check_round(tp_set *s, const int *procs, int n, int lws, char lines[][LINE])
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

char (*lines_alloc(void))[LINE]
{
    return calloc(32, LINE);
}

/* members list of a FROZEN line without `node`, as a string */
void without(const char *members, const char *node, char *out, size_t len)
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
            if (strcmp(evs[i].kv.key, key) == 0)
                found = 1;
            else if (strcmp(evs[i].kv.key, marker) == 0)
                found = 0;
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
int start_round(tp_set *s, int n, const char *opts, int *ids, char lines[][LINE])
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
int holder(char lines[][LINE], int n, int rank)
{
    for (int k = 0; k < n; k++)
        if (tp_ifield(lines[k], "rank") == rank) return k;
    return -1;
}

/* After member `gone` (index into ids) ended the round: the others report
 * the end with `cause`, then a round without it, old order kept. */
int expect_survivors(tp_set *s, int *ids, int n, int gone, const char *cause, char lines[][LINE],
                     double t0, double bound_s)
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
