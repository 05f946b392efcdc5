/* http.h: /healthz, /readyz and /metrics (http.c), served from a snapshot
 * of the agent's state that its loop publishes once per pass. */
#ifndef DUCTILE_AGENT_HTTP_H
#define DUCTILE_AGENT_HTTP_H

#include "ductile/rdzv.h"

#include <stddef.h>
#include <stdint.h>

/* Workers of this node listed one by one in /metrics (the first ones). */
#define AGENT_SNAPSHOT_WORKERS 128

typedef struct agent_worker_snapshot {
    int rank, local_rank;
    int64_t step;              /* last step it reported, 0 before one */
    double progress_unix;      /* Unix time of its last progress (step or phase); 0: none yet */
    double step_unix;          /* Unix time of its last `step`; 0: none yet */
    int64_t samples_total;     /* samples it reported processing (progress.h) */
    double samples_per_second; /* over the last AGENT_RATE_WINDOW_S */
    int has_loss;
    double loss;    /* its last reported loss, when has_loss */
    char phase[32]; /* last phase it reported, "" before one */
} agent_worker_snapshot;

typedef struct agent_snapshot {
    int64_t round;
    int members;
    int world_size;
    int64_t restarts;
    int workers_running;
    double rdzv_seconds;
    int64_t changes[RDZV_CAUSE_COUNT]; /* by rdzv_cause */
    int ready;
    double heartbeat; /* mono_now_s() of the loop's last pass */
    int64_t hangs;    /* workers the progress watchdog killed */
    int nworkers;     /* running workers listed in workers[] */
    agent_worker_snapshot workers[AGENT_SNAPSHOT_WORKERS];
} agent_snapshot;

typedef struct agent_http agent_http;

/* Serves on 0.0.0.0:port in its own thread. NULL and msg on failure. */
agent_http *agent_http_start(int port, char *msg, size_t msglen);
void agent_http_publish(agent_http *h, const agent_snapshot *s);
void agent_http_stop(agent_http *h);

#endif
