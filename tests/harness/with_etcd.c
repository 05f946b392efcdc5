/* with-etcd: run a command beside a private etcd.
 *
 *   with-etcd [--] COMMAND ARGS...
 *
 * Starts etcd on free loopback ports, runs COMMAND with DUCTILE_TEST_ETCD set
 * to its endpoint (and DUCTILE_TEST_ETCD_PID to its pid, so a test can kill
 * it), stops etcd and exits with COMMAND's status. For scripted tests.
 */
#include "test_etcd.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    int first = 1;
    if (first < argc && strcmp(argv[first], "--") == 0) first++;
    if (first >= argc) {
        fprintf(stderr, "usage: with-etcd [--] COMMAND ARGS...\n");
        return 2;
    }
    test_etcd e;
    if (test_etcd_start(&e) != 0) return 1;
    char pid[32], data[300];
    snprintf(pid, sizeof(pid), "%d", (int)e.pid);
    snprintf(data, sizeof(data), "%s", e.data_dir);
    setenv("DUCTILE_TEST_ETCD", e.endpoint, 1);
    setenv("DUCTILE_TEST_ETCD_PID", pid, 1);
    setenv("DUCTILE_TEST_ETCD_DATA", data, 1);
    pid_t child = fork();
    if (child == 0) {
        execvp(argv[first], argv + first);
        fprintf(stderr, "with-etcd: %s: cannot run\n", argv[first]);
        _exit(127);
    }
    int st = 0;
    signal(SIGINT, SIG_IGN);
    while (waitpid(child, &st, 0) < 0) {
    }
    test_etcd_stop(&e);
    if (WIFEXITED(st)) return WEXITSTATUS(st);
    return 128 + WTERMSIG(st);
}
