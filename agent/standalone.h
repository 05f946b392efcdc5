/* standalone.h: a private etcd for one-machine runs (--standalone,
 * standalone.c). */
#ifndef DUCTILE_AGENT_STANDALONE_H
#define DUCTILE_AGENT_STANDALONE_H

#include <stddef.h>
#include <sys/types.h>

typedef struct agent_standalone {
    pid_t pid;
    char dir[256];
    char endpoint[64];
} agent_standalone;

/* Starts etcd and waits until it answers. 0 on success; on failure msg
 * says why and nothing is left running. */
int agent_standalone_start(agent_standalone *s, char *msg, size_t msglen);
/* Stops the server (SIGTERM, then SIGKILL) and removes its data dir. Safe
 * to call twice. */
void agent_standalone_stop(agent_standalone *s);

#endif
