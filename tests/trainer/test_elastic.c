/* test_elastic.c: the trainer's side of the in-place rebuild protocol.
 *
 *   test_elastic [CASE...]
 *
 * The control-channel cases drive elastic.c the way the agent does, over a
 * socketpair, with a real (socketpair) ring attached, and check what the
 * thread did to it: how a round ends is the agent's word (graceful or
 * lost), never a clock's, so a graceful ending leaves the communicator alone
 * however long it waits, even past the next `round` line, and a lost one
 * aborts it. Checks are on states; waits are deadlines for a state to show,
 * except the few that prove nothing happens (a graceful ending is still
 * intact seconds later: longer than any grace period the trainer ever had).
 *
 * The share cases run elastic_share() on three real processes joined by a
 * socketpair ring, break it between or inside the broadcasts (the ring's
 * failpoint, or the sending rank dying), and check that every receiving
 * rank's state is exactly what it was: a half-received state never becomes
 * a claim in the next agreement.
 */
#include "test_comm_launch.h"
#include "th_scenario.h"
#include "trainer_test.h"

#include "comm_impl.h"
#include "ductile/control.h"
#include "ductile/elastic.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define DEADLINE_MS 10000
/* The old trainer aborted a graceful step after 750 ms; this is well past. */
#define STILL_MS 2000

/* ---- a trainer's control channel with a communicator attached ---- */

typedef struct fixture {
    elastic *e;
    int agent;  /* the agent's end of the channel */
    comm *c;    /* rank 0 of a ring of two over socketpairs */
    int far[2]; /* rank 1's ends, kept open so nothing closes under c */
    comm *c2;   /* a second one, for a later round */
    int far2[2];
} fixture;

static comm *pair_comm(int far[2])
{
    int left[2], right[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, left) != 0) return NULL;
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, right) != 0) {
        close(left[0]);
        close(left[1]);
        return NULL;
    }
    comm_config cfg = {.rank = 0, .world_size = 2, .timeout_ms = 30000};
    comm *c = NULL;
    far[0] = left[1];
    far[1] = right[1];
    if (comm_ring_from_fds(&cfg, left[0], right[0], &c) != COMM_OK) return NULL;
    return c;
}

/* Opens the fixture; one that cannot be made counts as a failed check. */
static int fx_open(fixture *f, int64_t round)
{
    memset(f, 0, sizeof(*f));
    f->far[0] = f->far[1] = f->far2[0] = f->far2[1] = -1;
    int ch[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ch) == 0) {
        f->agent = ch[1];
        f->c = pair_comm(f->far);
        f->c2 = pair_comm(f->far2);
        if (f->c && f->c2 && elastic_open(ch[0], round, &f->e) == ELASTIC_OK) return 0;
    }
    fprintf(stderr, "fixture setup failed\n");
    check_fail();
    return -1;
}

static void fx_close(fixture *f)
{
    elastic_close(f->e); /* first: its thread may abort the communicators */
    comm_free(f->c);
    comm_free(f->c2);
    for (int i = 0; i < 2; i++) {
        if (f->far[i] >= 0) close(f->far[i]);
        if (f->far2[i] >= 0) close(f->far2[i]);
    }
    if (f->agent >= 0) close(f->agent);
}

/* The agent writes one line. */
static void say(fixture *f, const char *line)
{
    size_t n = strlen(line);
    CHECK(write(f->agent, line, n) == (ssize_t)n, "writing '%s': %s", line, strerror(errno));
}

static void say_round(fixture *f, int64_t round)
{
    ctl_msg m = {.type = CTL_ROUND,
                 .round = round,
                 .rank = 0,
                 .world_size = 2,
                 .group_world_size = 1,
                 .master_port = 29500};
    snprintf(m.master_addr, sizeof(m.master_addr), "127.0.0.1");
    snprintf(m.store_prefix, sizeof(m.store_prefix), "/ductile/j/rounds/%lld/store/",
             (long long)round);
    char line[CTL_MAX_LINE + 1];
    CHECK(ctl_format(&m, line, sizeof(line)) > 0, "formatting round %lld", (long long)round);
    say(f, line);
}

/* Waits (until a deadline) for comm_is_aborted(c) to become `want`. */
static int aborted_within(comm *c, int ms)
{
    int64_t deadline = mono_now_ms() + ms;
    while (!comm_is_aborted(c) && mono_now_ms() < deadline)
        th_sleep_ms(5);
    return comm_is_aborted(c);
}

/* Waits for the thread to have read an `abort` of the current round. */
static int ending_within(elastic *e, int ms)
{
    int64_t deadline = mono_now_ms() + ms;
    while (!elastic_ending(e) && mono_now_ms() < deadline)
        th_sleep_ms(5);
    return elastic_ending(e);
}

/* Waits for the thread to have read `round want`. */
static int saw_round(elastic *e, int64_t want)
{
    elastic_round rd;
    elastic_err err = elastic_wait_round(e, NULL, DEADLINE_MS, &rd);
    return err == ELASTIC_OK && rd.round == want;
}

/* abort 1 graceful, then round 2: the step in flight is never cut short;
 * a lost abort of the same round then drops it at once. */
static void test_graceful_then_round(void)
{
    fixture f;
    if (fx_open(&f, 1) != 0) return;
    elastic_attach(f.e, f.c, 1);
    say(&f, "abort 1 graceful\n");
    CHECK(ending_within(f.e, DEADLINE_MS), "abort 1 graceful not seen");
    CHECK(!comm_is_aborted(f.c), "a graceful abort aborted the communicator");
    say_round(&f, 2);
    CHECK(saw_round(f.e, 2), "round 2 not seen");
    /* The round line was handled under the lock that would abort: no wait. */
    CHECK(!comm_is_aborted(f.c), "round 2 aborted a gracefully ending round");
    th_sleep_ms(STILL_MS);
    CHECK(!comm_is_aborted(f.c), "a gracefully ending round was aborted after %d ms", STILL_MS);
    CHECK(elastic_ending(f.e), "the round no longer ends");
    say(&f, "abort 1 lost\n");
    CHECK(aborted_within(f.c, DEADLINE_MS), "abort 1 lost after graceful did not abort");
    fx_close(&f);
}

/* abort 1 graceful, round 2, abort 2 lost: a member died since; abort. */
static void test_graceful_then_later_lost(void)
{
    fixture f;
    if (fx_open(&f, 1) != 0) return;
    elastic_attach(f.e, f.c, 1);
    say(&f, "abort 1 graceful\n");
    say_round(&f, 2);
    CHECK(saw_round(f.e, 2), "round 2 not seen");
    CHECK(!comm_is_aborted(f.c), "aborted before the lost abort");
    say(&f, "abort 2 lost\n");
    CHECK(aborted_within(f.c, DEADLINE_MS), "abort 2 lost did not abort round 1's comm");
    fx_close(&f);
}

/* `abort 1` (no kind means lost) and `abort 1 lost`: aborted at once. */
static void test_lost(void)
{
    const char *lines[] = {"abort 1\n", "abort 1 lost\n"};
    for (int i = 0; i < 2; i++) {
        fixture f;
        if (fx_open(&f, 1) != 0) return;
        elastic_attach(f.e, f.c, 1);
        say(&f, lines[i]);
        CHECK(aborted_within(f.c, DEADLINE_MS), "'%.12s' did not abort", lines[i]);
        CHECK(elastic_ending(f.e), "'%.12s': the round does not end", lines[i]);
        fx_close(&f);
    }
}

/* A newer round with no abort before it: treated as lost. */
static void test_round_without_abort(void)
{
    fixture f;
    if (fx_open(&f, 1) != 0) return;
    elastic_attach(f.e, f.c, 1);
    say_round(&f, 2);
    CHECK(saw_round(f.e, 2), "round 2 not seen");
    CHECK(comm_is_aborted(f.c), "round 2 with no abort left round 1's comm alone");
    CHECK(elastic_ending(f.e), "round 1 does not end");
    fx_close(&f);
}

/* A trainer of round 1 rebuilding into round 2: it has read `round 2` and
 * has no communicator of round 2 yet. */
static int fx_open_rebuilding(fixture *f)
{
    if (fx_open(f, 1) != 0) return -1;
    say_round(f, 2);
    CHECK(saw_round(f->e, 2), "round 2 not seen");
    elastic_attach(f->e, NULL, 2);
    return 0;
}

/* A lost abort of an older round, or an abort for the current round that
 * came before its group formed (as in a rebuild). */
static void test_rounds_and_attach(void)
{
    fixture f;
    if (fx_open(&f, 2) != 0) return;
    elastic_attach(f.e, f.c, 2);
    say(&f, "abort 1 lost\n");     /* old news */
    say(&f, "abort 2 graceful\n"); /* read after it: a sync point */
    CHECK(ending_within(f.e, DEADLINE_MS), "abort 2 not seen");
    CHECK(!comm_is_aborted(f.c), "a lost abort of an older round aborted round 2");
    fx_close(&f);

    /* Rebuilding into round 2: the agent already ended it as lost. */
    if (fx_open_rebuilding(&f) != 0) return;
    say(&f, "abort 2 lost\n");
    CHECK(ending_within(f.e, DEADLINE_MS), "abort 2 not seen");
    elastic_attach(f.e, f.c, 2);
    CHECK(comm_is_aborted(f.c), "a comm attached to a lost round was not aborted");
    fx_close(&f);

    /* ... or as graceful, and round 3 is known too: the new group may still
     * agree and finish a step; nothing aborts it. */
    if (fx_open_rebuilding(&f) != 0) return;
    say(&f, "abort 2 graceful\n");
    CHECK(ending_within(f.e, DEADLINE_MS), "abort 2 not seen");
    say_round(&f, 3);
    CHECK(saw_round(f.e, 3), "round 3 not seen");
    elastic_attach(f.e, f.c, 2);
    CHECK(!comm_is_aborted(f.c), "a comm attached to a gracefully ending round was aborted");
    th_sleep_ms(STILL_MS);
    CHECK(!comm_is_aborted(f.c), "aborted after %d ms", STILL_MS);
    /* Detached, then round 3's comm: a fresh round, not ending. */
    elastic_attach(f.e, NULL, 2);
    elastic_attach(f.e, f.c2, 3);
    CHECK(!comm_is_aborted(f.c2) && !elastic_ending(f.e), "round 3 starts aborted or ending");
    say(&f, "abort 3\n");
    CHECK(aborted_within(f.c2, DEADLINE_MS), "abort 3 did not abort round 3's comm");
    CHECK(!comm_is_aborted(f.c), "round 2's detached comm was aborted");
    fx_close(&f);
}

/* The agent closing the channel: nothing will answer a collective. */
static void test_closed(void)
{
    fixture f;
    if (fx_open(&f, 1) != 0) return;
    elastic_attach(f.e, f.c, 1);
    close(f.agent);
    f.agent = -1;
    CHECK(aborted_within(f.c, DEADLINE_MS), "a closed channel did not abort");
    elastic_round rd;
    CHECK(elastic_wait_round(f.e, NULL, DEADLINE_MS, &rd) == ELASTIC_ERR_CLOSED, "wait_round");
    fx_close(&f);
}

/* Reads one line from the worker (until a deadline). */
static int read_line(int fd, char *line, size_t len)
{
    size_t n = 0;
    int64_t deadline = mono_now_ms() + DEADLINE_MS;
    while (n + 1 < len) {
        struct pollfd p = {fd, POLLIN, 0};
        int left = (int)(deadline - mono_now_ms());
        if (left <= 0 || poll(&p, 1, left) <= 0) return -1;
        if (read(fd, line + n, 1) != 1) return -1;
        if (line[n++] == '\n') break;
    }
    line[n] = '\0';
    return 0;
}

/* The next message from the trainer, whatever it is. */
static int read_line_msg(fixture *f, ctl_msg *m)
{
    char line[CTL_MAX_LINE + 2];
    return read_line(f->agent, line, sizeof(line)) == 0 && ctl_parse(line, m) == 0 ? 0 : -1;
}

/* The next message from the trainer that is not a `phase` line (those come
 * from its control thread at any time); the last phase seen goes to
 * *phase (may be NULL). 0, or -1 when none came. */
static int read_msg(fixture *f, ctl_msg *m, char *phase, size_t len)
{
    char line[CTL_MAX_LINE + 2];
    for (;;) {
        if (read_line(f->agent, line, sizeof(line)) != 0 || ctl_parse(line, m) != 0) return -1;
        if (m->type != CTL_PHASE) return 0;
        if (phase) snprintf(phase, len, "%s", m->phase);
    }
}

/* What the trainer says: step (from its control thread, with the phase,
 * which it repeats every CTL_HEARTBEAT_MS), failed, peer_lost. */
static void test_reports(void)
{
    fixture f;
    if (fx_open(&f, 4) != 0) return;
    ctl_msg m;
    char phase[CTL_PHASE_MAX] = "";
    elastic_set_phase(f.e, ELASTIC_PHASE_EVAL); /* before the first step: not said */
    elastic_report_step(f.e, 17, 2176, 0.25);
    CHECK(read_msg(&f, &m, phase, sizeof(phase)) == 0 && m.type == CTL_STEP && m.step == 17,
          "step line");
    CHECK(m.has_samples && m.samples == 2176 && m.has_loss && m.loss == 0.25,
          "step line's samples and loss");
    /* The phase a step leaves the loop in is compute: said with it, or right after. */
    ctl_msg p = {0};
    while (strcmp(phase, "compute") != 0 && read_line_msg(&f, &p) == 0 && p.type == CTL_PHASE)
        snprintf(phase, sizeof(phase), "%s", p.phase);
    CHECK(strcmp(phase, "compute") == 0, "phase after a step: '%s'", phase);
    elastic_set_phase(f.e, ELASTIC_PHASE_COMM);
    while (read_line_msg(&f, &p) == 0 && p.type == CTL_PHASE && strcmp(p.phase, "comm") != 0)
        ;
    CHECK(p.type == CTL_PHASE && strcmp(p.phase, "comm") == 0, "phase comm said");
    /* Unchanged, it is said again within a heartbeat or two. */
    CHECK(read_line_msg(&f, &p) == 0 && p.type == CTL_PHASE && strcmp(p.phase, "comm") == 0,
          "heartbeat");
    elastic_report_failed(f.e, "rank 1: out of\nmemory");
    elastic_report_peer_lost(f.e, 4, "a step failed: left neighbour (rank 0) closed\r\n");
    CHECK(read_msg(&f, &m, NULL, 0) == 0 && m.type == CTL_FAILED &&
              strcmp(m.reason, "rank 1: out of memory") == 0,
          "failed line");
    CHECK(read_msg(&f, &m, NULL, 0) == 0 && m.type == CTL_PEER_LOST && m.round == 4 &&
              strncmp(m.reason, "a step failed: left neighbour (rank 0) closed", 45) == 0,
          "peer_lost line");
    say(&f, "stop\n");
    elastic_round rd;
    CHECK(elastic_wait_round(f.e, NULL, DEADLINE_MS, &rd) == ELASTIC_ERR_STOP, "stop");
    fx_close(&f);
}

/* How failures are classified for the agent. */
static void test_classify(void)
{
    CHECK(comm_err_is_peer(COMM_ERR_PEER) && comm_err_is_peer(COMM_ERR_TIMEOUT) &&
              comm_err_is_peer(COMM_ERR_ABORTED) && comm_err_is_peer(COMM_ERR_STORE),
          "peer errors");
    CHECK(!comm_err_is_peer(COMM_OK) && !comm_err_is_peer(COMM_ERR_ARG) &&
              !comm_err_is_peer(COMM_ERR_NOMEM) && !comm_err_is_peer(COMM_ERR_SYS) &&
              !comm_err_is_peer(COMM_ERR_CUDA) && !comm_err_is_peer(COMM_ERR_NCCL),
          "first-hand errors");
    int far[2];
    comm *c = pair_comm(far);
    CHECK(c && comm_error(c) == COMM_OK, "a working comm has no error");
    if (!c) return;
    comm_abort(c);
    CHECK(comm_error(c) == COMM_ERR_ABORTED, "an aborted comm: %s", comm_strerror(comm_error(c)));
    float x = 1;
    CHECK(comm_allreduce_sum_f32(c, &x, 1) == COMM_ERR_ABORTED, "a call on it");
    CHECK(comm_error(c) == COMM_ERR_ABORTED, "after a call");
    comm_free(c);
    close(far[0]);
    close(far[1]);
    CHECK(comm_error(NULL) == COMM_OK, "no comm");
}

/* ---- elastic_share on three processes ---- */

#define SHARE_PARTS 3
static const size_t share_bytes[SHARE_PARTS] = {200, 4u << 20, (4u << 20) + 12};

/* Byte i of part p as rank `who` holds it. */
static unsigned char share_byte(int who, int p, size_t i)
{
    return (unsigned char)(i * 31 + (size_t)p * 7 + (size_t)who * 101 + 1);
}

typedef enum {
    SHARE_OK,       /* nothing breaks */
    SHARE_FP_ROOT2, /* the root's 2nd broadcast fails (ring.collective) */
    SHARE_FP_ROOT3, /* the root's 3rd */
    SHARE_FP_PEER3, /* rank 1 (a receiver, which forwards) breaks the 3rd */
    SHARE_ROOT_DIES /* the root sends two parts and exits */
} share_mode;

typedef struct share_arg {
    share_mode mode;
    int root;
} share_arg;

/* 1 when every byte of part p is who's. */
static int holds(unsigned char *buf, int who, int p)
{
    for (size_t i = 0; i < share_bytes[p]; i++)
        if (buf[i] != share_byte(who, p, i)) return 0;
    return 1;
}

static int rank_share(tc_group *g, int rank, void *arg)
{
    const share_arg *a = arg;
    /* Failpoints are read at the first call, in this process: set them now. */
    if (a->mode == SHARE_FP_ROOT2 && rank == a->root)
        setenv("DUCTILE_FAILPOINTS", "ring.collective=2:closed", 1);
    if (a->mode == SHARE_FP_ROOT3 && rank == a->root)
        setenv("DUCTILE_FAILPOINTS", "ring.collective=3:closed", 1);
    if (a->mode == SHARE_FP_PEER3 && rank == 1)
        setenv("DUCTILE_FAILPOINTS", "ring.collective=3:closed", 1);
    comm *c = tc_connect_or_exit(g, rank);
    unsigned char *buf[SHARE_PARTS];
    elastic_part parts[SHARE_PARTS];
    for (int p = 0; p < SHARE_PARTS; p++) {
        buf[p] = malloc(share_bytes[p]);
        if (!buf[p]) return 3;
        for (size_t i = 0; i < share_bytes[p]; i++)
            buf[p][i] = share_byte(rank, p, i);
        parts[p] = (elastic_part){buf[p], share_bytes[p], NULL};
    }
    if (a->mode == SHARE_ROOT_DIES && rank == a->root) {
        /* The same two broadcasts elastic_share starts with, then gone. */
        for (int p = 0; p < 2; p++)
            if (comm_broadcast(c, buf[p], share_bytes[p], a->root) != COMM_OK) return 4;
        _exit(0);
    }
    elastic_err err = elastic_share(c, a->root, parts, SHARE_PARTS);
    int rc = 0;
    /* Every receiver waits on a rank upstream of the break, so it fails
     * for sure; the root may have handed all it had to the kernel first
     * (its state is its own either way). */
    int ok = err == ELASTIC_OK, may_fail = a->mode != SHARE_OK;
    if ((err != ELASTIC_OK && err != ELASTIC_ERR_COMM) || (!may_fail && !ok) ||
        (may_fail && ok && rank != a->root)) {
        fprintf(stderr, "FAIL rank %d mode %d: elastic_share: %s (%s)\n", rank, a->mode,
                elastic_strerror(err), comm_last_error(c));
        rc = 1;
    }
    /* Everyone holds the root's state after a success, its own otherwise. */
    int who = err == ELASTIC_OK ? a->root : rank;
    for (int p = 0; p < SHARE_PARTS; p++)
        if (!holds(buf[p], who, p)) {
            fprintf(stderr, "FAIL rank %d mode %d: part %d is not rank %d's (%s)\n", rank, a->mode,
                    p, who, err == ELASTIC_OK ? "after success" : "after a failure");
            rc = 1;
        }
    for (int p = 0; p < SHARE_PARTS; p++)
        free(buf[p]);
    comm_free(c);
    return rc;
}

static void test_share(void)
{
    static const struct {
        share_mode mode;
        int root;
        const char *name;
    } cases[] = {
        {SHARE_OK, 1, "no failure"},
        {SHARE_FP_ROOT2, 1, "root's 2nd broadcast breaks"},
        {SHARE_FP_ROOT3, 0, "root's 3rd broadcast breaks"},
        {SHARE_FP_PEER3, 0, "a forwarding receiver breaks the 3rd"},
        {SHARE_ROOT_DIES, 1, "the root dies after two"},
    };
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        tc_group g;
        if (tc_group_init(&g, 3, NULL, "share", 1) != 0) {
            check_fail();
            return;
        }
        share_arg a = {cases[k].mode, cases[k].root};
        int bad = tc_run(&g, rank_share, &a, 120);
        CHECK(bad == 0, "share (%s): %d ranks failed", cases[k].name, bad);
        tc_group_free(&g);
    }
    /* Degenerate calls, in this process. */
    int far[2];
    comm *c = pair_comm(far);
    CHECK(c != NULL, "pair comm");
    if (!c) return;
    CHECK(elastic_share(NULL, 0, NULL, 0) == ELASTIC_ERR_ARG, "no comm");
    CHECK(elastic_share(c, 0, NULL, 0) == ELASTIC_OK, "nothing to share");
    comm_free(c);
    close(far[0]);
    close(far[1]);
}

int main(int argc, char **argv)
{
    /* The ring must never raise SIGPIPE; elastic.c sends with MSG_NOSIGNAL. */
    signal(SIGPIPE, SIG_DFL);
    unsetenv("DUCTILE_FAILPOINTS"); /* only the share cases' ranks set their own */
    static const th_case cases[] = {
        {"graceful_then_round", test_graceful_then_round},
        {"graceful_then_later_lost", test_graceful_then_later_lost},
        {"lost", test_lost},
        {"round_without_abort", test_round_without_abort},
        {"rounds_and_attach", test_rounds_and_attach},
        {"closed", test_closed},
        {"reports", test_reports},
        {"classify", test_classify},
        {"share", test_share},
    };
    th_run_cases(cases, TH_COUNT(cases), argc, argv, 1, NULL);
    return check_finish("test_elastic");
}
