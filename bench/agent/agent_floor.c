/* agent_floor.c: the resident set of the agent's libraries alone.
 *
 *   agent-floor ETCD_ENDPOINT HTTP_PORT
 *
 * bench/agent's baseline for the agent's RSS: a process that loads what the
 * agent loads (libcurl with its dependencies, libssh2, cJSON,
 * libmicrohttpd), initialises them as the agent does (etcd_global_init, an
 * MHD daemon with its thread), makes one etcd call with the agent's client
 * (a range of one key: libcurl's transfer code, one connection) and then
 * waits on stdin, its pid on stdout. What the agent is above this is its
 * own: its threads, their connections, its heap, its code.
 */
#include "ductile/etcd.h"

#include <microhttpd.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static enum MHD_Result refuse(void *cls, struct MHD_Connection *conn, const char *url,
                              const char *method, const char *version, const char *data,
                              size_t *size, void **state)
{
    (void)cls, (void)conn, (void)url, (void)method, (void)version, (void)data, (void)size,
        (void)state;
    return MHD_NO;
}

int main(int argc, char **argv)
{
    int port = argc == 3 ? atoi(argv[2]) : 0;
    if (port <= 0 || port > 65535) {
        fprintf(stderr, "usage: agent-floor ETCD_ENDPOINT HTTP_PORT\n");
        return 2;
    }
    if (etcd_global_init() != ETCD_OK) {
        fprintf(stderr, "agent-floor: libcurl cannot initialise\n");
        return 1;
    }
    struct MHD_Daemon *d = MHD_start_daemon(
        MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG, (uint16_t)port, NULL, NULL, refuse,
        NULL, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)10, MHD_OPTION_END);
    etcd_config cfg = {.endpoints = argv[1]};
    etcd_client *c = NULL;
    char err[ETCD_MSG_MAX];
    etcd_range_result r;
    etcd_err e = d ? etcd_client_new_err(&cfg, &c, err, sizeof(err)) : ETCD_ERR_ARG;
    if (e == ETCD_OK) e = etcd_range(c, "/agent-floor", 0, 1, &r);
    if (e != ETCD_OK) {
        fprintf(stderr, "agent-floor: %s\n", !d ? "cannot start MHD" : c ? etcd_strerror(e) : err);
        etcd_client_free(c);
        if (d) MHD_stop_daemon(d);
        return 1;
    }
    etcd_range_result_free(&r);
    printf("%d\n", (int)getpid());
    fflush(stdout);
    char line[16];
    while (read(0, line, sizeof(line)) > 0)
        continue; /* until the bench closes stdin */
    etcd_client_free(c);
    MHD_stop_daemon(d);
    return 0;
}
