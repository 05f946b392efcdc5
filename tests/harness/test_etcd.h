/* test_etcd.h: a real etcd server for tests.
 *
 * Starts Debian's etcd on free loopback ports with its own data dir, waits
 * until it answers, and always stops it (and removes the data dir) in
 * test_etcd_stop(). A server can be killed and started again on the same
 * ports and data, to test what survives an etcd restart.
 */
#ifndef DUCTILE_TEST_ETCD_H
#define DUCTILE_TEST_ETCD_H

#include <sys/types.h>

typedef struct test_etcd {
    int client_port;
    int peer_port;
    char endpoint[64]; /* "http://127.0.0.1:PORT" */
    char data_dir[256];
    char log_path[300];
    pid_t pid; /* 0 when not running */
} test_etcd;

/* 0 on success; on failure prints why to stderr and returns -1. */
int test_etcd_start(test_etcd *e);
/* The etcd a test runs against: the one DUCTILE_TEST_ETCD names (e is then
 * left unstarted), or a private one started in e. Its endpoint, or NULL when
 * none could be started; test_etcd_stop(e) afterwards in both cases. */
const char *test_etcd_shared_or_start(test_etcd *e);
/* SIGKILL the server, keep its data and ports. */
void test_etcd_kill(test_etcd *e);
/* Start it again on the same ports and data (after test_etcd_kill). */
int test_etcd_restart(test_etcd *e);
/* Stop it and remove the data dir. Safe to call twice. */
void test_etcd_stop(test_etcd *e);
/* A loopback port that was free a moment ago. */
int test_free_port(void);

#endif
