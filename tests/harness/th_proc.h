/* th_proc.h: child processes for tests, and the small things around them.
 *
 * A test starts real processes (etcd, participants, ranks) and must never
 * hang on one or leave one behind: th_spawn() children die with the test
 * when asked (PR_SET_PDEATHSIG), and every wait here takes a deadline after
 * which the child is SIGKILLed and reaped.
 *
 * Also here: a printf-formatted shell command, a free loopback port, and a
 * sleep that signals do not cut short.
 */
#ifndef DUCTILE_TEST_TH_PROC_H
#define DUCTILE_TEST_TH_PROC_H

#include <sys/types.h>

/* How th_spawn() sets the child up; {0} (or NULL) inherits everything. */
typedef struct th_spawn_opts {
    int in_fd;           /* becomes stdin when > 0 */
    int out_fd;          /* becomes stdout when > 0 */
    const char *log;     /* stdout and stderr appended to this file, when set */
    int die_with_parent; /* SIGKILL the child when the test exits */
} th_spawn_opts;

/* Forks and execs argv (PATH searched); the child's pid, or -1. A child that
 * cannot exec exits 127. */
pid_t th_spawn(char *const argv[], const th_spawn_opts *o);
/* In a forked child: stdout and stderr appended to path. 0 or -1. */
int th_redirect(const char *path);

/* Waits up to timeout_ms (< 0: without a deadline, for a child that is
 * bounded by someone else's) for pid; 1 when it ended (*status, may be
 * NULL, gets the wait status, and *pid is set to 0), 0 when it still runs,
 * -1 on an error. */
int th_wait(pid_t *pid, int timeout_ms, int *status);
/* SIGKILLs *pid and reaps it; *pid becomes 0. Nothing when *pid <= 0. */
void th_kill(pid_t *pid);
/* SIGTERM, up to grace_ms for it to exit, then th_kill(). */
void th_stop(pid_t *pid, int grace_ms);
/* Waits for the n children pids[i] (0: none) up to timeout_ms; the ones
 * still running then are SIGKILLed (late[i] = 1, may be NULL) and reaped,
 * for up to 10 s more. Each one reaped gets status[i] (may be NULL) and
 * pids[i] = 0. The number that did not exit 0. */
int th_wait_all(pid_t *pids, int n, int timeout_ms, int *status, int *late);
/* The shell's view of a wait status: the exit code, or 128 + the signal. */
int th_exit_code(int status);

/* Runs a printf-formatted shell command; system()'s status (0: it worked). */
int th_sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* A loopback port that was free a moment ago. */
int th_free_port(void);
/* A loopback port where nothing listens for as long as *fd stays open (it
 * is bound, never listening: a connection is refused, and no other process
 * can take the port meanwhile, as one can a th_free_port()). -1 on error. */
int th_dead_port(int *fd);
/* Sleeps ms milliseconds, through signals. */
void th_sleep_ms(int ms);

#endif
