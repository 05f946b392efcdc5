/* th_proc.c: child processes for tests (see th_proc.h).
 *
 * Waiting is waitpid(WNOHANG) polled every 5 ms against a deadline: simple,
 * and fast enough for tests; a pidfd and poll() would wake at once.
 */
#include "th_proc.h"

#include "ductile/clock.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define POLL_MS 5
#define REAP_MS 10000 /* after a SIGKILL: a child in D state may take a while */

int th_redirect(const char *path)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd < 0) return -1;
    int rc = dup2(fd, 1) < 0 || dup2(fd, 2) < 0 ? -1 : 0;
    close(fd);
    return rc;
}

/* In the child, between fork and exec. */
static void spawn_child(char *const argv[], const th_spawn_opts *o)
{
    if (o->die_with_parent) prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive the test */
    if (o->in_fd > 0) dup2(o->in_fd, 0);
    if (o->out_fd > 0) dup2(o->out_fd, 1);
    if (o->log && th_redirect(o->log) != 0) _exit(127);
    execvp(argv[0], argv);
    fprintf(stderr, "%s: cannot run: %s\n", argv[0], strerror(errno));
    _exit(127);
}

pid_t th_spawn(char *const argv[], const th_spawn_opts *o)
{
    static const th_spawn_opts none;
    fflush(NULL); /* or the child writes the parent's buffered output again */
    pid_t pid = fork();
    if (pid == 0) spawn_child(argv, o ? o : &none);
    return pid;
}

int th_wait(pid_t *pid, int timeout_ms, int *status)
{
    if (*pid <= 0) return -1;
    int64_t deadline = mono_now_ms() + timeout_ms;
    for (;;) {
        int st = 0;
        pid_t got = waitpid(*pid, &st, timeout_ms < 0 ? 0 : WNOHANG);
        if (got == *pid) {
            if (status) *status = st;
            *pid = 0;
            return 1;
        }
        if (got < 0 && errno != EINTR) return -1;
        if (timeout_ms >= 0 && mono_now_ms() >= deadline) return 0;
        if (got == 0) th_sleep_ms(POLL_MS);
    }
}

void th_kill(pid_t *pid)
{
    if (*pid <= 0) return;
    kill(*pid, SIGKILL);
    if (th_wait(pid, REAP_MS, NULL) != 1) {
        fprintf(stderr, "th_kill: %d not reaped in %d ms\n", (int)*pid, REAP_MS);
        *pid = 0;
    }
}

void th_stop(pid_t *pid, int grace_ms)
{
    if (*pid <= 0) return;
    kill(*pid, SIGTERM);
    if (th_wait(pid, grace_ms, NULL) != 1) th_kill(pid);
}

/* One pass over pids: reaps what has ended; the number still running. */
static int reap_ended(pid_t *pids, int n, int *status, int *bad)
{
    int left = 0;
    for (int i = 0; i < n; i++) {
        if (pids[i] <= 0) continue;
        int st = 0;
        int rc = th_wait(&pids[i], 0, &st);
        if (rc == 0) {
            left++;
            continue;
        }
        if (status) status[i] = st;
        if (rc < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) (*bad)++;
        pids[i] = 0;
    }
    return left;
}

int th_wait_all(pid_t *pids, int n, int timeout_ms, int *status, int *late)
{
    int bad = 0, killed = 0, left;
    int64_t deadline = mono_now_ms() + timeout_ms;
    if (late) memset(late, 0, (size_t)n * sizeof(*late));
    while ((left = reap_ended(pids, n, status, &bad)) > 0) {
        if (mono_now_ms() > deadline) {
            if (killed) return bad + left; /* not even SIGKILL ended them in REAP_MS */
            for (int i = 0; i < n; i++)
                if (pids[i] > 0) {
                    kill(pids[i], SIGKILL);
                    if (late) late[i] = 1;
                }
            killed = 1;
            deadline = mono_now_ms() + REAP_MS;
        }
        th_sleep_ms(POLL_MS);
    }
    return bad;
}

int th_exit_code(int status)
{
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    return 128 + WTERMSIG(status);
}

int th_sh(const char *fmt, ...)
{
    char cmd[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof(cmd), fmt, ap);
    va_end(ap);
    return system(cmd);
}

int th_dead_port(int *fd)
{
    *fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (*fd < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof(a);
    if (bind(*fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
        getsockname(*fd, (struct sockaddr *)&a, &len) == 0)
        return ntohs(a.sin_port);
    close(*fd);
    *fd = -1;
    return -1;
}

int th_free_port(void)
{
    int fd;
    int port = th_dead_port(&fd);
    if (fd >= 0) close(fd);
    return port;
}

void th_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    while (nanosleep(&ts, &ts) != 0) {
    }
}
