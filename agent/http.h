/* http.h: /healthz, /readyz and /metrics (http.c), served from a snapshot
 * of the agent's state that its loop publishes once per pass. */
#ifndef DUCTILE_AGENT_HTTP_H
#define DUCTILE_AGENT_HTTP_H

#include "ductile/rdzv.h"

#include <stddef.h>
#include <stdint.h>

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
} agent_snapshot;

typedef struct agent_http agent_http;

/* Serves on 0.0.0.0:port in its own thread. NULL and msg on failure. */
agent_http *agent_http_start(int port, char *msg, size_t msglen);
void agent_http_publish(agent_http *h, const agent_snapshot *s);
void agent_http_stop(agent_http *h);

#endif
