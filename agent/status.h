/* status.h: `ductile-agent status` (status.c): what etcd says about a job. */
#ifndef DUCTILE_AGENT_STATUS_H
#define DUCTILE_AGENT_STATUS_H

/* argv[0] is "status". Returns the exit code: 0 read, 1 etcd unreadable,
 * 2 bad flags. */
int agent_status_main(int argc, char **argv);

#endif
