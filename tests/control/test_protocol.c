/* test_protocol.c: the control protocol of ductile/control.h, line by line.
 *
 * Every message survives format -> parse unchanged, and every malformed line
 * (bad numbers, ranks out of range, missing or extra words, overlong lines)
 * is refused rather than half-read.
 */
#include "check.h"
#include "ductile/control.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>

static void roundtrip(const ctl_msg *m)
{
    char line[CTL_MAX_LINE + 2];
    int n = ctl_format(m, line, sizeof(line));
    CHECK(n > 0 && line[n - 1] == '\n' && (size_t)n == strlen(line));
    ctl_msg back;
    CHECK(ctl_parse(line, &back) == 0);
    CHECK(back.type == m->type);
    CHECK(back.round == m->round && back.rank == m->rank && back.world_size == m->world_size);
    CHECK(back.local_rank == m->local_rank && back.group_rank == m->group_rank);
    CHECK(back.group_world_size == m->group_world_size && back.restarts == m->restarts);
    CHECK(strcmp(back.master_addr, m->master_addr) == 0 && back.master_port == m->master_port);
    CHECK(strcmp(back.store_prefix, m->store_prefix) == 0 && back.step == m->step);
    CHECK(strcmp(back.reason, m->reason) == 0 && back.graceful == m->graceful);
    CHECK(back.has_samples == m->has_samples && back.samples == m->samples);
    CHECK(back.has_loss == m->has_loss && back.loss == m->loss);
    CHECK(back.version == m->version && back.mode == m->mode);
}

int main(void)
{
    ctl_msg m = {.type = CTL_ROUND,
                 .round = 12,
                 .rank = 5,
                 .world_size = 6,
                 .local_rank = 1,
                 .group_rank = 2,
                 .group_world_size = 3,
                 .restarts = 4,
                 .master_addr = "10.0.0.7",
                 .master_port = 29500,
                 .store_prefix = "/ductile/job-1/rounds/12/store/"};
    roundtrip(&m);
    ctl_msg simple[] = {
        {.type = CTL_ABORT, .round = 9},
        {.type = CTL_ABORT, .round = 9, .graceful = 1},
        {.type = CTL_PEER_LOST, .round = 7, .reason = "allreduce: rank 2 closed"},
        {.type = CTL_PEER_LOST, .round = 0, .reason = ""},
        {.type = CTL_STOP},
        {.type = CTL_READY},
        {.type = CTL_STEP, .step = 123456789012LL},
        {.type = CTL_STEP, .step = 3, .has_samples = 1, .samples = 384},
        {.type = CTL_STEP, .step = 3, .has_loss = 1, .loss = 0.5},
        {.type = CTL_STEP, .step = 3, .has_samples = 1, .samples = 0, .has_loss = 1, .loss = -2.25},
        {.type = CTL_PHASE, .phase = "compute"},
        {.type = CTL_PHASE, .phase = "comm"},
        {.type = CTL_PHASE, .phase = "a_phase_name_of_thirtyone_lette"},
        {.type = CTL_FAILED, .reason = "allreduce: peer 3 closed the connection"},
        {.type = CTL_FAILED, .reason = ""},
        {.type = CTL_HELLO, .version = CTL_VERSION},
        {.type = CTL_HELLO, .version = CTL_VERSION, .mode = CTL_MODE_INPLACE},
        {.type = CTL_HELLO, .version = CTL_VERSION, .mode = CTL_MODE_RESTART},
        {.type = CTL_HELLO, .version = INT_MAX, .mode = CTL_MODE_INPLACE},
    };
    for (size_t i = 0; i < sizeof(simple) / sizeof(simple[0]); i++)
        roundtrip(&simple[i]);

    ctl_msg out;
    CHECK(ctl_parse("step 7\r\n", &out) == 0 && out.step == 7);
    CHECK(!out.has_samples && !out.has_loss);
    /* The optional fields come in either order. */
    CHECK(ctl_parse("step 7 loss 1.5e-3 samples 64\n", &out) == 0 && out.step == 7);
    CHECK(out.has_samples && out.samples == 64 && out.has_loss && out.loss == 1.5e-3);
    /* An abort without a kind is the old form: a peer is lost. */
    CHECK(ctl_parse("abort 4", &out) == 0 && out.round == 4 && !out.graceful);
    CHECK(ctl_parse("abort 4 graceful", &out) == 0 && out.graceful);
    CHECK(ctl_parse("peer_lost 5", &out) == 0 && out.round == 5 && !out.reason[0]);
    /* hello: any version parses (a mismatch is the reader's to judge). */
    CHECK(ctl_parse("hello 1 inplace\n", &out) == 0 && out.type == CTL_HELLO);
    CHECK(out.version == 1 && out.mode == CTL_MODE_INPLACE);
    CHECK(ctl_parse("hello 2", &out) == 0 && out.version == 2 && out.mode == CTL_MODE_NONE);
    CHECK(ctl_parse("hello 1 restart", &out) == 0 && out.mode == CTL_MODE_RESTART);
    const char *bad[] = {
        "",
        "\n",
        "hello",
        "step",
        "step -1",
        "step 1x",
        "step 1 2",
        "step 1 samples",
        "step 1 samples -5",
        "step 1 samples 1.5",
        "step 1 samples 2 samples 3",
        "step 1 loss nan",
        "step 1 loss inf",
        "step 1 loss 1e999",
        "step 1 loss 0.5x",
        "step 1 loss 1 loss 2",
        "step 1 speed 3",
        "abort",
        "abort x",
        "abort 3 maybe",
        "abort 3 graceful extra",
        "peer_lost",
        "peer_lost x reason",
        "peer_lost -2 reason",
        "stop now",
        "ready 1",
        "hello 0",
        "hello -1",
        "hello x",
        "hello 1x",
        "hello 2147483648", /* past INT_MAX */
        "hello 1 bogus",
        "hello 1 inplace extra",
        "hello inplace",
        "HELLO 1",
        "round 1 0 2 0 0 1 0 a 1",                        /* missing prefix */
        "round 1 2 2 0 0 1 0 a 1 /p/",                    /* rank == world size */
        "round 1 0 2 0 1 1 0 a 1 /p/",                    /* group rank == group world */
        "round 1 0 0 0 0 1 0 a 1 /p/",                    /* world size 0 */
        "round 1 0 2 0 0 1 0 a 70000 /p/",                /* port out of range */
        "round 1 0 2 0 0 1 0 a 1 /p/ extra",              /* extra word */
        "round 99999999999999999999 0 2 0 0 1 0 a 1 /p/", /* overflow */
        "ROUND 1 0 2 0 0 1 0 a 1 /p/",
        "phase",
        "phase COMM",
        "phase comm extra",
        "phase c0mm",
        "phase a_phase_name_of_thirtytwo_letter", /* one too long */
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        if (ctl_parse(bad[i], &out) == 0) {
            fprintf(stderr, "accepted a bad line: '%s'\n", bad[i]);
            check_fail();
        }
    }
    char longline[CTL_MAX_LINE + 10];
    memset(longline, 'x', sizeof(longline) - 1);
    memcpy(longline, "failed ", 7);
    longline[sizeof(longline) - 1] = 0;
    CHECK(ctl_parse(longline, &out) != 0);
    ctl_msg nl = {.type = CTL_FAILED, .reason = "two\nlines"};
    char buf[64];
    CHECK(ctl_format(&nl, buf, sizeof(buf)) < 0);
    CHECK(ctl_format(&m, buf, 8) < 0); /* does not fit */
    ctl_msg badphase = {.type = CTL_PHASE, .phase = "no spaces"};
    CHECK(ctl_format(&badphase, buf, sizeof(buf)) < 0);
    CHECK(ctl_phase_waits("comm") && ctl_phase_waits("rebuild") && !ctl_phase_waits("compute") &&
          !ctl_phase_waits("save"));
    ctl_msg hello0 = {.type = CTL_HELLO, .version = 0};
    CHECK(ctl_format(&hello0, buf, sizeof(buf)) < 0);
    ctl_msg hellomode = {.type = CTL_HELLO, .version = 1, .mode = 7};
    CHECK(ctl_format(&hellomode, buf, sizeof(buf)) < 0);
    ctl_msg hello1 = {.type = CTL_HELLO, .version = 1, .mode = CTL_MODE_INPLACE};
    CHECK(ctl_format(&hello1, buf, sizeof(buf)) > 0 && strcmp(buf, "hello 1 inplace\n") == 0);
    ctl_msg none = {.type = CTL_INVALID};
    CHECK(ctl_format(&none, buf, sizeof(buf)) < 0);
    if (check_failures()) return 1;
    printf("ok control protocol\n");
    return 0;
}
