/* test_etcd.h: a real etcd server for tests.
 *
 * Starts Debian's etcd on free loopback ports with its own data dir, waits
 * until it answers, and always stops it (and removes the data dir) in
 * test_etcd_stop(). A server can be killed and started again on the same
 * ports and data, to test what survives an etcd restart.
 *
 * A test_cluster is several members of one cluster, for failover and
 * partition tests; its addresses are the test's to choose.
 */
#ifndef DUCTILE_TEST_ETCD_H
#define DUCTILE_TEST_ETCD_H

#include <stddef.h>
#include <sys/types.h>

#include "th_proc.h"

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
/* POSTs a JSON body to endpoint + path (the gateway: "/v3/kv/compaction",
 * calls the client has no need for); the HTTP status, or -1 without one. */
long test_etcd_post(const char *endpoint, const char *path, const char *body, long timeout_ms);

/* ---- a cluster of real etcd members ---- */

#define TEST_CLUSTER_MAX 5

/* n members named m0..m(n-1), with their data dirs and logs in one temp
 * dir. URLs start on loopback, on free ports; a test may change them (to put
 * a member behind links of its own) before it starts the members. Members
 * elect fast (heartbeat 50 ms, election 500 ms). */
typedef struct test_cluster {
    int n;
    char dir[256];
    int client_port[TEST_CLUSTER_MAX], peer_port[TEST_CLUSTER_MAX];
    char client_url[TEST_CLUSTER_MAX][64], peer_url[TEST_CLUSTER_MAX][64];
    pid_t pids[TEST_CLUSTER_MAX]; /* 0 when not running */
} test_cluster;

/* Makes the dir ("ductile-NAME-XXXXXX" under $TMPDIR) and picks the ports;
 * 0, or -1 (said on stderr). */
int test_cluster_init(test_cluster *c, int n, const char *name);
/* The client URLs, comma-separated: a client's endpoints. */
void test_cluster_endpoints(const test_cluster *c, char *buf, size_t len);
/* In a child: becomes member i (etcd, logging to the dir); never returns. */
void test_cluster_exec(const test_cluster *c, int i);
/* Forks member i, which dies with the test. 0 or -1. */
int test_cluster_start(test_cluster *c, int i);
/* SIGKILL member i and reap it. */
void test_cluster_kill(test_cluster *c, int i);
/* Kills every member and removes the dir. Safe to call twice. */
void test_cluster_stop(test_cluster *c);

#endif
