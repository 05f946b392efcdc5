/* master.h: a round's MASTER_PORT (private to agent/).
 *
 * MASTER_ADDR is node rank 0's address; MASTER_PORT a free port node rank 0
 * picks and publishes in the round store (agent_master_publish), which the
 * other nodes wait for. The wait runs on a thread of its own, so the
 * agent's loop goes on serving signals, reaping and output meanwhile: the
 * thread owns a copy of everything it uses and answers through a pipe the
 * loop polls, so the agent can forget a wait whose round is over without
 * waiting for it.
 */
#ifndef DUCTILE_AGENT_MASTER_H
#define DUCTILE_AGENT_MASTER_H

#include "ductile/rdzv.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

typedef struct agent_master {
    int fd;             /* the running wait's answer (poll it for POLLIN), or -1 */
    int64_t round;      /* the round it waits for */
    atomic_int threads; /* wait threads still running (a forgotten one ends by itself) */
} agent_master;

/* An idle agent_master (no wait). */
void agent_master_init(agent_master *m);

/* Node rank 0: picks a free port and publishes it in round's store. 0, or
 * -1 with a one-line reason in msg. */
int agent_master_publish(const rdzv_etcd *etcd, const char *job, int64_t round, int *port,
                         char *msg, size_t len);

/* Starts waiting, on a thread, for round's MASTER_PORT, at most timeout_ms;
 * forgets a wait already running. 0, or -1 when no thread could start. */
int agent_master_wait_start(agent_master *m, const rdzv_etcd *etcd, const char *job, int64_t round,
                            int timeout_ms);

/* Reads the answer once m->fd is readable and forgets the wait. 0 and *port;
 * or -1 with *err (RDZV_ERR_FENCED: the round was superseded) and a
 * one-line reason in why. */
int agent_master_wait_read(agent_master *m, int *port, rdzv_err *err, char *why, size_t len);

/* Forgets the running wait (its thread ends by itself). */
void agent_master_wait_cancel(agent_master *m);

#endif
