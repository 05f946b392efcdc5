/* test_etcd_fake.c: the canned-answer HTTP server of test_etcd_fake.h.
 *
 * Every socket wait is a poll with a short timeout that also checks the stop
 * flag, so fake_stop never waits on a client.
 */
#include "test_etcd_fake.h"

#include "ductile/clock.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* Wait for fd to be readable; 1 readable, 0 timeout or stop. */
static int wait_readable(fake_server *s, int fd, int ms)
{
    long long end = mono_now_ms() + ms;
    while (!atomic_load(&s->stop)) {
        long long left = end - mono_now_ms();
        if (left <= 0) return 0;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int r = poll(&p, 1, left < 50 ? (int)left : 50);
        if (r > 0) return 1;
        if (r < 0 && errno != EINTR) return 0;
    }
    return 0;
}

/* Read one request (headers and Content-Length body); 0 on success. */
static int read_request(fake_server *s, int fd, char *body, size_t bodycap)
{
    char buf[65536];
    size_t len = 0;
    char *hdr_end = NULL;
    size_t want = 0;
    for (;;) {
        if (hdr_end && len >= want) break;
        if (len == sizeof(buf) - 1 || !wait_readable(s, fd, 2000)) return -1;
        ssize_t n = read(fd, buf + len, sizeof(buf) - 1 - len);
        if (n <= 0) return -1;
        len += (size_t)n;
        buf[len] = 0;
        if (!hdr_end && (hdr_end = strstr(buf, "\r\n\r\n"))) {
            const char *cl = strcasestr(buf, "Content-Length:");
            size_t clen = cl && cl < hdr_end ? strtoul(cl + 15, NULL, 10) : 0;
            want = (size_t)(hdr_end + 4 - buf) + clen;
            if (want > sizeof(buf) - 1) want = sizeof(buf) - 1;
        }
    }
    snprintf(body, bodycap, "%s", hdr_end + 4);
    return 0;
}

static void write_all(int fd, const char *p, size_t len)
{
    while (len > 0) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n <= 0) {
            if (n < 0 && errno == EINTR) continue;
            return; /* the client gave up (e.g. an answer over its limit) */
        }
        p += n;
        len -= (size_t)n;
    }
}

static void serve(fake_server *s, int fd)
{
    char body[4096];
    if (read_request(s, fd, body, sizeof(body)) != 0) return;
    pthread_mutex_lock(&s->mu);
    fake_reply r = {0};
    if (s->nscript)
        r = s->script[(size_t)s->requests < s->nscript ? (size_t)s->requests : s->nscript - 1];
    s->requests++;
    snprintf(s->last_body, sizeof(s->last_body), "%s", body);
    /* a copy: the test may free its reply as soon as the client has read it,
     * while this thread is still inside send() */
    char *copy = NULL;
    if (r.data) {
        if (!r.len) r.len = strlen(r.data);
        copy = malloc(r.len);
        if (!copy) abort();
        memcpy(copy, r.data, r.len);
        r.data = copy;
    }
    pthread_mutex_unlock(&s->mu);
    if (r.silent) {
        /* until the client closes (its deadline) or the test ends */
        char c;
        while (wait_readable(s, fd, 100000) && read(fd, &c, 1) > 0) {
        }
        free(copy);
        return;
    }
    if (r.data) write_all(fd, r.data, r.len);
    free(copy);
    if (r.hold_ms) {
        char c;
        while (wait_readable(s, fd, r.hold_ms) && read(fd, &c, 1) > 0) {
        }
    }
}

static void *loop(void *arg)
{
    fake_server *s = arg;
    while (!atomic_load(&s->stop)) {
        if (!wait_readable(s, s->fd, 100)) continue;
        int fd = accept(s->fd, NULL, NULL);
        if (fd < 0) continue;
        serve(s, fd);
        close(fd);
    }
    return NULL;
}

int fake_start(fake_server *s)
{
    memset(s, 0, sizeof(*s));
    atomic_init(&s->stop, 0);
    pthread_mutex_init(&s->mu, NULL);
    s->fd = socket(AF_INET, SOCK_STREAM, 0);
    if (s->fd < 0) return -1;
    int one = 1;
    setsockopt(s->fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t alen = sizeof(a);
    if (bind(s->fd, (struct sockaddr *)&a, sizeof(a)) != 0 || listen(s->fd, 16) != 0 ||
        getsockname(s->fd, (struct sockaddr *)&a, &alen) != 0) {
        close(s->fd);
        return -1;
    }
    s->port = ntohs(a.sin_port);
    snprintf(s->endpoint, sizeof(s->endpoint), "http://127.0.0.1:%d", s->port);
    if (pthread_create(&s->thread, NULL, loop, s) != 0) {
        close(s->fd);
        return -1;
    }
    return 0;
}

void fake_script(fake_server *s, const fake_reply *replies, size_t n)
{
    pthread_mutex_lock(&s->mu);
    s->script = replies;
    s->nscript = n;
    s->requests = 0;
    s->last_body[0] = 0;
    pthread_mutex_unlock(&s->mu);
}

int fake_requests(fake_server *s)
{
    pthread_mutex_lock(&s->mu);
    int n = s->requests;
    pthread_mutex_unlock(&s->mu);
    return n;
}

void fake_last_body(fake_server *s, char *out, size_t n)
{
    pthread_mutex_lock(&s->mu);
    snprintf(out, n, "%s", s->last_body);
    pthread_mutex_unlock(&s->mu);
}

void fake_stop(fake_server *s)
{
    atomic_store(&s->stop, 1);
    pthread_join(s->thread, NULL);
    close(s->fd);
    pthread_mutex_destroy(&s->mu);
}

char *fake_http(int status, const char *body)
{
    size_t n = strlen(body) + 256;
    char *r = malloc(n);
    if (!r) abort();
    snprintf(r, n,
             "HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
             "Connection: close\r\n\r\n%s",
             status, strlen(body), body);
    return r;
}
