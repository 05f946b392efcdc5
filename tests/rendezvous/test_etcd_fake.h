/* test_etcd_fake.h: a tiny HTTP server that answers with canned bytes.
 *
 * Only for injecting answers a real etcd never gives (malformed, truncated,
 * oversized, a stream that breaks mid-message). It runs in a thread on a free
 * loopback port and serves one connection at a time: the i-th request gets
 * the i-th reply of the script (the last one repeats), written verbatim, so
 * a reply can lie about its length or stop in the middle. libmicrohttpd is
 * not used here because it will not send a broken response on purpose.
 */
#ifndef DUCTILE_TEST_ETCD_FAKE_H
#define DUCTILE_TEST_ETCD_FAKE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>

typedef struct fake_reply {
    const char *data; /* raw bytes: status line, headers, body */
    size_t len;       /* 0 means strlen(data) */
    int hold_ms;      /* keep the connection open this long after writing (a stream) */
    int silent;       /* read the request, then say nothing until the client gives up */
} fake_reply;

typedef struct fake_server {
    int fd;
    int port;
    char endpoint[64];
    pthread_t thread;
    pthread_mutex_t mu;
    const fake_reply *script;
    size_t nscript;
    int requests;         /* requests read so far */
    char last_body[4096]; /* body of the latest request */
    atomic_int stop;
} fake_server;

int fake_start(fake_server *s);
/* Replace the script and reset the request count; replies must outlive it. */
void fake_script(fake_server *s, const fake_reply *replies, size_t n);
int fake_requests(fake_server *s);
/* Copy of the latest request body. */
void fake_last_body(fake_server *s, char *out, size_t n);
void fake_stop(fake_server *s);

/* A complete response with Content-Length and "Connection: close"; the
 * caller frees it. */
char *fake_http(int status, const char *body);

#endif
