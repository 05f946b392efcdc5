/* test_rdzv_faults: the fault paths of the rendezvous protocol.
 *
 *   test_rdzv_faults SCENARIO
 *
 * counting      the failure-counting rule: a lost peer is a membership
 *               change; the same members losing a peer twice in a row count;
 *               a crash reported after a peer already ended the round still
 *               counts, once
 * report-retry  a failure report and a finish whose etcd answers are lost
 *               (failpoints: ambiguous, unavailable) are made exactly once
 * leave-late    a leave marker for a round whose keys were collected is not
 *               written (it would never be deleted)
 * limits        --nnodes is job-wide; an absurd local world size is refused
 * stale         an old round record seen again is never reported again
 *
 * Real etcd, real participant processes (rdzv_participant); as in
 * test_rdzv_protocol, every scenario ends with the agreement check.
 */
#include "check.h"
#include "ductile/etcd.h"
#include "ductile/rdzv.h"
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
#define T 30000 /* generous deadline of one expectation, ms */

/* Waits for a FROZEN line from each of ids[0..n-1] with `members` members;
 * returns the round number they agree on (checked), or -1. */
static long long frozen_all(tp_set *s, const int *ids, int n, int members, long long restarts)
{
    char line[LINE];
    long long round = -1;
    for (int k = 0; k < n; k++) {
        if (tp_expect(s, ids[k], "FROZEN", T, line, sizeof(line)) != 0) return -1;
        long long r = tp_ifield(line, "round");
        if ((round >= 0 && r != round) || tp_ifield(line, "nmembers") != members ||
            (restarts >= 0 && tp_ifield(line, "restarts") != restarts)) {
            fprintf(stderr, "unexpected round (want %d members, restarts %lld): %s\n", members,
                    restarts, line);
            return -1;
        }
        round = r;
    }
    return round;
}

/* Every one of ids reports the end of its round with `cause`. */
static int ended_all(tp_set *s, const int *ids, int n, const char *cause)
{
    char line[LINE], c[64];
    for (int k = 0; k < n; k++) {
        CHECK_OR_RETURN(tp_expect(s, ids[k], "ENDED", T, line, sizeof(line)) == 0, "no end");
        tp_field(line, "cause", c, sizeof(c));
        CHECK_OR_RETURN(strcmp(c, cause) == 0, "want cause %s: %s", cause, line);
    }
    return 0;
}

/* Sends cmd to process i and checks its REPORTED line. */
static int report(tp_set *s, int i, const char *cmd, long long restarts, int counted)
{
    char line[LINE];
    CHECK_OR_RETURN(tp_send(s, i, cmd) == 0, "send");
    CHECK_OR_RETURN(tp_expect(s, i, "REPORTED", T, line, sizeof(line)) == 0, "no REPORTED");
    CHECK_OR_RETURN(strstr(line, "rc=ok") && tp_ifield(line, "restarts") == restarts &&
                        (counted < 0 || tp_ifield(line, "counted") == counted),
                    "want restarts=%lld counted=%d: %s", restarts, counted, line);
    return 0;
}

static int spawn_all(tp_set *s, int n, const char *opts, int *ids)
{
    char node[16];
    for (int i = 0; i < n; i++) {
        snprintf(node, sizeof(node), "p%d", i);
        ids[i] = tp_spawn(s, node, opts);
        CHECK_OR_RETURN(ids[i] >= 0, "spawn");
    }
    return 0;
}

static int sc_counting(tp_set *s)
{
    snprintf(s->job, sizeof(s->job), "counting");
    int ids[3];
    /* max 3 freezes round 1 at once; a 30 s TTL keeps a killed node's key
     * alive, so its peers' reports, not its lease, end the round */
    if (spawn_all(s, 3, "--min 2 --max 3 --ttl 30 --last-call-ms 300 --max-restarts 9", ids))
        return 1;
    CHECK_OR_RETURN(frozen_all(s, ids, 3, 3, 0) == 1, "round 1 with everyone");
    /* a lost peer: a membership change, no restart */
    if (report(s, ids[0], "lost ring: rank 2 closed", 0, 0)) return 1;
    if (ended_all(s, ids, 3, "peer_lost")) return 1;
    CHECK_OR_RETURN(frozen_all(s, ids, 3, 3, 0) == 2, "round 2, same members");
    /* the same members lose a peer again: nothing changed, so it counts */
    if (report(s, ids[1], "lost ring: rank 0 timed out", 1, 1)) return 1;
    if (ended_all(s, ids, 3, "failure")) return 1;
    CHECK_OR_RETURN(frozen_all(s, ids, 3, 3, 1) == 3, "round 3 after the counted loss");
    /* a pod killed: its peers see the ring break before its lease ends */
    tp_kill(s, ids[2], SIGKILL);
    if (report(s, ids[0], "lost ring: rank 2 closed", 1, 0)) return 1;
    if (ended_all(s, ids, 2, "peer_lost")) return 1;
    CHECK_OR_RETURN(frozen_all(s, ids, 2, 2, 1) == 4, "round 4 without the killed node");
    /* other members than the round that ended by a lost peer: not counted */
    if (report(s, ids[1], "lost ring: rank 0 closed", 1, 0)) return 1;
    if (ended_all(s, ids, 2, "peer_lost")) return 1;
    CHECK_OR_RETURN(frozen_all(s, ids, 2, 2, 1) == 5, "round 5");
    if (report(s, ids[0], "lost again", 2, 1)) return 1;
    if (ended_all(s, ids, 2, "failure")) return 1;
    CHECK_OR_RETURN(frozen_all(s, ids, 2, 2, 2) == 6, "round 6");
    return 0;
}

/* A crash that a peer saw first: the peer's report ends the round as a lost
 * peer; the crashed node's own report still counts, once. */
static int sc_counting_crash(tp_set *s)
{
    snprintf(s->job, sizeof(s->job), "counting-crash");
    int ids[3];
    /* an 8 s last call keeps round 2 open with two of three while p1
     * reports about round 1 (already ended); if the machine is so slow that
     * round 2 froze first, p1 reports about round 2: one count either way */
    if (spawn_all(s, 3, "--min 2 --max 3 --ttl 30 --last-call-ms 8000 --max-restarts 9", ids))
        return 1;
    CHECK_OR_RETURN(frozen_all(s, ids, 3, 3, 0) == 1, "round 1 with everyone");
    tp_kill(s, ids[2], SIGKILL);
    if (report(s, ids[0], "lost ring: rank 1 closed", 0, 0)) return 1;
    if (ended_all(s, ids, 2, "peer_lost")) return 1;
    char line[LINE];
    CHECK_OR_RETURN(tp_send(s, ids[1], "fail worker rank 1 was killed by SIGSEGV") == 0, "send");
    CHECK_OR_RETURN(tp_expect(s, ids[1], "REPORTED", T, line, sizeof(line)) == 0, "no REPORTED");
    CHECK_OR_RETURN(strstr(line, "rc=ok") && tp_ifield(line, "restarts") == 1, "counted: %s", line);
    /* a second first-hand report about the same round adds nothing */
    CHECK_OR_RETURN(tp_send(s, ids[0], "fail worker rank 0 exited with code 1") == 0, "send");
    CHECK_OR_RETURN(tp_expect(s, ids[0], "REPORTED", T, line, sizeof(line)) == 0, "no REPORTED");
    CHECK_OR_RETURN(strstr(line, "rc=ok") && tp_ifield(line, "restarts") == 1, "once: %s", line);
    /* the job's count, as `ductile-agent status` reads it */
    rdzv_etcd etcd = {.endpoints = s->endpoint};
    rdzv_status st;
    char msg[256];
    CHECK_OR_RETURN(rdzv_get_status(&etcd, s->job, &st, msg) == RDZV_OK, "%s", msg);
    long long restarts = st.restarts;
    rdzv_status_free(&st);
    CHECK_OR_RETURN(restarts == 1, "the job counted %lld restarts, want 1", restarts);
    CHECK_OR_RETURN(frozen_all(s, ids, 2, 2, -1) >= 2, "a round of the two carries on");
    return 0;
}

static int sc_report_retry(tp_set *s)
{
    snprintf(s->job, sizeof(s->job), "report-retry");
    /* p0's txns on its own calls (its registration goes over the driver's
     * connection): 1 is its first report (the answer is lost after etcd
     * applied it); 2 fails unapplied and 3 is lost after applying (the
     * second report); 4 is the finish, lost too */
    int ids[2];
    const char *opts = "--min 2 --max 2 --ttl 30 --max-restarts 5";
    ids[0] = tp_spawn(s, "p0",
                      "--min 2 --max 2 --ttl 30 --max-restarts 5 --failpoints "
                      "etcd.api.txn=1:ambiguous;etcd.api.txn=2:unavailable;"
                      "etcd.api.txn=3:ambiguous;etcd.api.txn=4:ambiguous");
    ids[1] = tp_spawn(s, "p1", opts);
    CHECK_OR_RETURN(ids[0] >= 0 && ids[1] >= 0, "spawn");
    CHECK_OR_RETURN(frozen_all(s, ids, 2, 2, 0) == 1, "round 1");
    if (report(s, ids[0], "fail worker exited with code 1", 1, -1)) return 1;
    if (ended_all(s, ids, 2, "failure")) return 1;
    CHECK_OR_RETURN(frozen_all(s, ids, 2, 2, 1) == 2, "one restart, not two");
    if (report(s, ids[0], "fail worker exited with code 2", 2, -1)) return 1;
    if (ended_all(s, ids, 2, "failure")) return 1;
    CHECK_OR_RETURN(frozen_all(s, ids, 2, 2, 2) == 3, "two restarts, not three");
    char line[LINE];
    CHECK_OR_RETURN(tp_send(s, ids[0], "finish") == 0, "send");
    CHECK_OR_RETURN(tp_expect(s, ids[0], "FINISHED", T, line, sizeof(line)) == 0, "no FINISHED");
    CHECK_OR_RETURN(strstr(line, "rc=ok"), "%s", line);
    for (int k = 0; k < 2; k++)
        CHECK_OR_RETURN(tp_expect(s, ids[k], "JOB_DONE", T, line, sizeof(line)) == 0,
                        "no JOB_DONE");
    return 0;
}

/* Keys under /ductile/<job>/<suffix> */
static long long count_keys(const char *endpoint, const char *job, const char *suffix)
{
    etcd_config cfg = {.endpoints = endpoint};
    etcd_client *c = NULL;
    if (etcd_client_new(&cfg, &c) != ETCD_OK) return -1;
    char key[256];
    snprintf(key, sizeof(key), "/ductile/%s/%s", job, suffix);
    etcd_range_result rr;
    long long n = -1;
    if (etcd_range(c, key, 1, 0, &rr) == ETCD_OK) {
        n = (long long)rr.n;
        etcd_range_result_free(&rr);
    }
    etcd_client_free(c);
    return n;
}

static int sc_leave_late(tp_set *s)
{
    snprintf(s->job, sizeof(s->job), "leave-late");
    const char *opts = "--min 1 --max 3 --ttl 30 --last-call-ms 300";
    int ids[4];
    char line[LINE];
    if (spawn_all(s, 3, opts, ids)) return 1;
    CHECK_OR_RETURN(frozen_all(s, ids, 3, 3, 0) == 1, "round 1 with three (max 3)");
    /* p2 stalls (its lease, 30 s, lives on); p1 leaves: round 2 is p0 */
    tp_kill(s, ids[2], SIGSTOP);
    CHECK_OR_RETURN(tp_send(s, ids[1], "leave") == 0, "send");
    CHECK_OR_RETURN(tp_expect(s, ids[1], "LEFT", T, line, sizeof(line)) == 0, "no LEFT");
    CHECK_OR_RETURN(frozen_all(s, ids, 1, 1, 0) == 2, "round 2: p0 alone");
    /* p3 waits and round 2 has room: opening round 3 collects rounds/1/ */
    ids[3] = tp_spawn(s, "p3", opts);
    CHECK_OR_RETURN(ids[3] >= 0, "spawn");
    int now[2] = {ids[0], ids[3]};
    CHECK_OR_RETURN(frozen_all(s, now, 2, 2, 0) == 3, "round 3: p0 and p3");
    CHECK_OR_RETURN(count_keys(s->endpoint, s->job, "rounds/1/") == 0, "round 1's keys collected");
    /* p2 wakes and leaves as a member of round 1, whose keys are gone */
    CHECK_OR_RETURN(tp_send(s, ids[2], "leave") == 0, "send");
    tp_kill(s, ids[2], SIGCONT);
    CHECK_OR_RETURN(tp_expect(s, ids[2], "LEFT", T, line, sizeof(line)) == 0, "no LEFT from p2");
    CHECK_OR_RETURN(count_keys(s->endpoint, s->job, "rounds/1/") == 0,
                    "no leave marker left behind under rounds/1/");
    return 0;
}

static int sc_limits(tp_set *s)
{
    snprintf(s->job, sizeof(s->job), "limits");
    char line[LINE];
    int a = tp_spawn(s, "a", "--min 2 --max 3");
    CHECK_OR_RETURN(tp_expect(s, a, "OPEN", T, line, sizeof(line)) == 0, "a open");
    /* round 1 exists once a has joined; wait for its record */
    for (int i = 0; i < 100 && count_keys(s->endpoint, s->job, "round") < 1; i++)
        usleep(50000);
    int b = tp_spawn(s, "b", "--min 1 --max 3");
    CHECK_OR_RETURN(tp_expect(s, b, "OPEN_ERR", T, line, sizeof(line)) == 0, "b refused");
    CHECK_OR_RETURN(strstr(line, "err=arg") && strstr(line, "2:3") && strstr(line, "1:3"), "%s",
                    line);
    int c = tp_spawn(s, "c", "--min 2 --max 3 --lws 5000");
    CHECK_OR_RETURN(tp_expect(s, c, "OPEN_ERR", T, line, sizeof(line)) == 0, "c refused");
    CHECK_OR_RETURN(strstr(line, "err=arg") && strstr(line, "local_world_size"), "%s", line);
    int d = tp_spawn(s, "d", "--min 2 --max 3");
    int both[2] = {a, d};
    CHECK_OR_RETURN(frozen_all(s, both, 2, 2, 0) == 1, "the same limits join");
    return 0;
}

/* The round key as etcd has it now; *mod receives its mod_revision. */
static char *get_round(const char *endpoint, const char *job)
{
    etcd_config cfg = {.endpoints = endpoint};
    etcd_client *c = NULL;
    if (etcd_client_new(&cfg, &c) != ETCD_OK) return NULL;
    char key[256];
    snprintf(key, sizeof(key), "/ductile/%s/round", job);
    etcd_kv kv;
    char *out = NULL;
    if (etcd_get(c, key, &kv) == ETCD_OK) {
        out = strdup(kv.value);
        etcd_kv_free(&kv);
    }
    etcd_client_free(c);
    return out;
}

static int put_round(const char *endpoint, const char *job, const char *json)
{
    etcd_config cfg = {.endpoints = endpoint};
    etcd_client *c = NULL;
    if (etcd_client_new(&cfg, &c) != ETCD_OK) return -1;
    char key[256];
    snprintf(key, sizeof(key), "/ductile/%s/round", job);
    int rc = etcd_put(c, key, json, strlen(json), 0, NULL) == ETCD_OK ? 0 : -1;
    etcd_client_free(c);
    return rc;
}

static int sc_stale(tp_set *s)
{
    snprintf(s->job, sizeof(s->job), "stale");
    int ids[2];
    if (spawn_all(s, 2, "--min 2 --max 2 --ttl 30 --max-restarts 5", ids)) return 1;
    CHECK_OR_RETURN(frozen_all(s, ids, 2, 2, 0) == 1, "round 1");
    char *r1 = get_round(s->endpoint, s->job);
    CHECK_OR_RETURN(r1 && strstr(r1, "\"frozen\""), "round 1 record");
    if (report(s, ids[0], "lost ring closed", 0, 0)) return 1;
    if (ended_all(s, ids, 2, "peer_lost")) return 1;
    CHECK_OR_RETURN(frozen_all(s, ids, 2, 2, 0) == 2, "round 2");
    char *r2 = get_round(s->endpoint, s->job);
    CHECK_OR_RETURN(r2 && strstr(r2, "\"frozen\""), "round 2 record");
    /* The drivers see round 1's record again (as a stale watch cache would
     * show it), then round 2's again: neither is reported a second time. */
    CHECK_OR_RETURN(put_round(s->endpoint, s->job, r1) == 0, "put");
    usleep(500000);
    CHECK_OR_RETURN(put_round(s->endpoint, s->job, r2) == 0, "put");
    usleep(500000);
    free(r1);
    free(r2);
    /* the next event each one reports is the end of round 2, then round 3 */
    if (report(s, ids[1], "lost ring closed", 1, 1)) return 1;
    if (ended_all(s, ids, 2, "failure")) return 1;
    CHECK_OR_RETURN(frozen_all(s, ids, 2, 2, 1) == 3,
                    "round 3 is the next FROZEN, none in between");
    return 0;
}

int main(int argc, char **argv)
{
    static const tp_scenario scenarios[] = {
        {"counting", sc_counting},
        {"counting-crash", sc_counting_crash},
        {"report-retry", sc_report_retry},
        {"leave-late", sc_leave_late},
        {"limits", sc_limits},
        {"stale", sc_stale},
    };
    return tp_main(argc, argv, RDZV_PARTICIPANT, scenarios,
                   sizeof(scenarios) / sizeof(scenarios[0]));
}
