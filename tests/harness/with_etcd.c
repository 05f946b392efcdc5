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
    pid_t child = th_spawn(argv + first, NULL);
    int st = 0;
    signal(SIGINT, SIG_IGN);
    /* No deadline of its own: the command is bounded by ctest's timeout. */
    if (child < 0 || th_wait(&child, -1, &st) != 1) st = 127 << 8;
    test_etcd_stop(&e);
    return th_exit_code(st);
}
