/* master.h: a round's MASTER_PORT (private to agent/).
 *
 * MASTER_ADDR is node rank 0's address; MASTER_PORT a free port node rank 0
 * picks and publishes in the round store, which the other nodes wait for.
 * Both talk to etcd, so both run as a task (task.h): the agent's loop goes
 * on serving signals, reaping and output meanwhile. The task owns a copy
 * of everything it uses, so the agent can forget one whose round is over
 * without waiting for it.
 */
#ifndef DUCTILE_AGENT_MASTER_H
#define DUCTILE_AGENT_MASTER_H

#include "task.h"

#include "ductile/rdzv.h"

#include <stddef.h>
#include <stdint.h>

typedef struct agent_master {
    agent_task task; /* poll task.fd for POLLIN */
    int64_t round;   /* the round it publishes or waits for */
    int publishing;  /* node rank 0 publishing, else waiting */
} agent_master;

/* An idle agent_master (nothing running); its threads count in *threads. */
void agent_master_init(agent_master *m, atomic_int *threads);

/* Node rank 0: picks a free port and publishes it in round's store, on a
 * thread; forgets a task already running. 0, or -1 when no thread could
 * start. */
int agent_master_publish_start(agent_master *m, const rdzv_etcd *etcd, const char *job,
                               int64_t round);

/* Starts waiting, on a thread, for round's MASTER_PORT, at most timeout_ms;
 * forgets a task already running. 0, or -1 when no thread could start. */
int agent_master_wait_start(agent_master *m, const rdzv_etcd *etcd, const char *job, int64_t round,
                            int timeout_ms);

/* Reads the answer of either once m->task.fd is readable and forgets the
 * task. 0 and *port; or -1 with *err (RDZV_ERR_FENCED: the round was
 * superseded) and a one-line reason in why. */
int agent_master_read(agent_master *m, int *port, rdzv_err *err, char *why, size_t len);

/* Forgets the running task (its thread ends by itself). */
void agent_master_cancel(agent_master *m);

#endif
