/* rdzv_protocol_recovery.c: test_rdzv_protocol's recovery scenarios (see rdzv_protocol.h).
 *
 * etcd restarted under a formed round, a stalled participant, every one
 * dead, the ring of rounds, a takeover of a dead node's place, a restarted
 * participant, a twin of a live node refused, and the errors a participant
 * reports. Each ends by checking agreement, as test_rdzv_protocol.c says.
 */
#include "rdzv_protocol.h"

int sc_etcd_restart(tp_set *s)
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
int sc_stall(tp_set *s)
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
int sc_all_dead(tp_set *s)
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
int sc_ring(tp_set *s)
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
int sc_takeover(tp_set *s)
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
int sc_restart(tp_set *s)
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
int sc_twin(tp_set *s)
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

int sc_errors(tp_set *s)
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
