/* failpoint.h: make the Nth call of a named operation fail, on purpose.
 *
 * Tests reach fault paths (a leader change under a write, a ring peer that
 * vanishes during bootstrap) deterministically, against the real etcd and
 * real processes, by naming the call to break in the environment:
 *
 *   DUCTILE_FAILPOINTS="NAME=WHEN:ACTION[;NAME=WHEN:ACTION...]"
 *
 * WHEN is N (the Nth call only), N-M (calls N to M) or N+ (call N and every
 * later one); calls are counted per name and per process from 1. ACTION is
 * a word the code at that point understands (see each name below); the
 * failpoint only says "this call fails, this way". Unknown names never
 * fire, nor do actions the code there does not know (ductile-train warns
 * of an unknown train.step action), so a typo shows up as a test that
 * fails, never as a crash.
 *
 * Names compiled in (always; a check is one relaxed load when unset):
 *   etcd.CLIENT.OP   CLIENT: api (the agent's own calls: register, report,
 *                    finish, leave; reports and finish have a client of
 *                    their own that shares the name and its count), driver,
 *                    keepalive, watch, store;
 *                    OP: range put delete txn lease_grant keepalive
 *                    lease_revoke watch. ACTION unavailable: fail before
 *                    sending, as if no endpoint answered; ambiguous: send it,
 *                    let etcd apply it, then report the answer as lost (the
 *                    "may have been applied" case of a leader change);
 *                    sleep:MS: stall the call that long, then make it.
 *   rdzv.probe       a new agent's liveness probe of the registered
 *                    incarnation of its node id (rdzv_open); ACTION dead:
 *                    judge it dead without asking, as a firewall that
 *                    rejects the probe would (the worst wrong verdict).
 *   rdzv.sentinel    each round the sentinel would watch (rdzv_sentinel.c);
 *                    ACTION off: it watches no member in that round, so
 *                    a dead member is found by other means (a takeover,
 *                    a worker's exit, its lease), as when its watchers
 *                    died with it; ACTION read: it takes no registration
 *                    from the driver's snapshot and reads each itself.
 *   ring.connect     a ring bootstrap of world >= 2 (the first and every
 *                    rebuild); ACTION fail: it fails at once with a timeout,
 *                    as if the left neighbour never connected, and publishes
 *                    nothing (its peers time out too).
 *   ring.collective  a collective that reaches the ring (world > 1, not
 *                    empty, comm alive); ACTION closed: it fails as a peer's
 *                    closed connection does, and the comm is dead after.
 *   shm.connect      a comm_cpu_init bootstrap of world >= 2 (shared
 *                    memory or auto); ACTION fail: it fails at once with a
 *                    timeout and publishes nothing (its peers time out too).
 *   shm.collective   a collective that reaches the shared segment; ACTION
 *                    closed: it fails as a dead peer does (COMM_ERR_PEER),
 *                    the other ranks fail at once, the comm is dead after.
 *   train.step       the start of every optimizer step of ductile-train;
 *                    ACTION sleep:MS (a slow step) or fail (a first-hand
 *                    error of this worker).
 *
 * ductile-agent passes DUCTILE_WORKER_FAILPOINTS to its workers as their
 * DUCTILE_FAILPOINTS (and never its own), so one test can break the agent
 * and the trainer separately.
 */
#ifndef DUCTILE_FAILPOINT_H
#define DUCTILE_FAILPOINT_H

#include <stddef.h>

#define FAILPOINT_ENV "DUCTILE_FAILPOINTS"

/* A buffer of this size holds failpoint_check_env's reason whole. */
#define FAILPOINT_MSG_MAX 256

/* The ACTION for this call of `name`, or NULL when it should not fail.
 * Counts the call. Thread-safe. */
const char *failpoint(const char *name);

/* 1 when action is "sleep:MS" (and sleeps MS milliseconds), else 0. */
int failpoint_sleep(const char *action);

/* Checks DUCTILE_FAILPOINTS; 0 when unset or valid, else -1 and a one-line
 * reason in msg. Programs call it at start so a bad spec is an error. */
int failpoint_check_env(char *msg, size_t len);

#endif
