/* rdzv_protocol.h: what test_rdzv_protocol's files share (tests/rendezvous, private).
 *
 * The checks every scenario ends with (a round frozen alike on every
 * participant, the survivors of a loss) and the small helpers the
 * scenarios use; the membership scenarios are in test_rdzv_protocol.c, the
 * recovery ones (etcd restarted, a stall, all dead, a takeover, a restart,
 * a twin, errors, the ring) in rdzv_protocol_recovery.c.
 */
#ifndef DUCTILE_TEST_RDZV_PROTOCOL_H
#define DUCTILE_TEST_RDZV_PROTOCOL_H

#include "check.h"
#include "ductile/etcd.h"
#include "test_etcd.h"
#include "test_rdzv_procs.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define LINE 4096

/* test_rdzv_protocol.c: the checks and helpers */
/* Waits for FROZEN from each of procs[0..n-1]; fills lines; checks they
 * agree on round and members, that ranks are dense and unique and that the
 * world size is the sum of local world sizes (lws each). */
int expect_round(tp_set *s, const int *procs, int n, int lws, int timeout_ms, char lines[][LINE]);
int check_round(tp_set *s, const int *procs, int n, int lws, char lines[][LINE]);
char (*lines_alloc(void))[LINE];
void without(const char *members, const char *node, char *out, size_t len);
int start_round(tp_set *s, int n, const char *opts, int *ids, char lines[][LINE]);
int holder(char lines[][LINE], int n, int rank);
int expect_survivors(tp_set *s, int *ids, int n, int gone, const char *cause, char lines[][LINE],
                     double t0, double bound_s);

/* rdzv_protocol_recovery.c: the recovery scenarios */
int sc_etcd_restart(tp_set *s);
int sc_stall(tp_set *s);
int sc_all_dead(tp_set *s);
int sc_ring(tp_set *s);
int sc_takeover(tp_set *s);
int sc_restart(tp_set *s);
int sc_twin(tp_set *s);
int sc_errors(tp_set *s);

#endif
