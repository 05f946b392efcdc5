/* status.h: `ductile-agent status` and `reset` (status.c): a job in etcd. */
#ifndef DUCTILE_AGENT_STATUS_H
#define DUCTILE_AGENT_STATUS_H

/* argv[0] is "status". Returns the exit code: 0 read, 1 etcd unreadable,
 * 2 bad flags. */
int agent_status_main(int argc, char **argv);
/* argv[0] is "reset". Returns the exit code: 0 deleted, 1 etcd unwritable,
 * 2 bad flags, 3 an agent of the job is alive. */
int agent_reset_main(int argc, char **argv);

#endif
