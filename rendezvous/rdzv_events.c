/* rdzv_events.c: the events the rendezvous threads send the caller
 * (docs/design.md, "Rounds", events).
 *
 * The driver, the watch threads and the caller's own reports queue events
 * here; the caller takes them from its poll loop through the queue's
 * eventfd (rdzv_fd), so an agent keeps one loop. The sentinel is pointed at
 * the round in each event as it is queued.
 */
#include "rdzv_internal.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct rdzv_ev_node {
    rdzv_event ev;
    rdzv_ev_node *next;
};

/* Queues ev (taking its round) for the caller. */
void rdzv_emit(rdzv *r, rdzv_event *ev)
{
    rdzv_ev_node *n = calloc(1, sizeof(*n));
    if (!n) { /* nothing sensible to do; the caller's deadlines still hold */
        rdzv_event_free(ev);
        return;
    }
    /* The sentinel watches the round this node is in, and nothing else. */
    rdzv_sentinel_watch(r->sentinel, ev->type == RDZV_EV_FROZEN ? &ev->round : NULL);
    n->ev = *ev;
    pthread_mutex_lock(&r->ev_mu);
    if (r->ev_tail)
        r->ev_tail->next = n;
    else
        r->ev_head = n;
    r->ev_tail = n;
    uint64_t one = 1;
    ssize_t w = write(r->efd, &one, sizeof(one));
    (void)w;
    pthread_mutex_unlock(&r->ev_mu);
}

void rdzv_emit_simple(rdzv *r, rdzv_event_type type, rdzv_err err, const char *fmt, ...)
{
    rdzv_event ev;
    memset(&ev, 0, sizeof(ev));
    ev.type = type;
    ev.err = err;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ev.reason, sizeof(ev.reason), fmt, ap);
    va_end(ap);
    rdzv_emit(r, &ev);
}

int rdzv_fd(const rdzv *r)
{
    return r->efd;
}

rdzv_err rdzv_next_event(rdzv *r, int timeout_ms, rdzv_event *ev)
{
    if (!r || !ev) return RDZV_ERR_ARG;
    if (timeout_ms > 0) {
        struct pollfd p = {.fd = r->efd, .events = POLLIN};
        while (poll(&p, 1, timeout_ms) < 0 && errno == EINTR) {
        }
    }
    pthread_mutex_lock(&r->ev_mu);
    rdzv_ev_node *n = r->ev_head;
    if (n) {
        r->ev_head = n->next;
        if (!r->ev_head) r->ev_tail = NULL;
        uint64_t v;
        ssize_t rd = read(r->efd, &v, sizeof(v));
        (void)rd;
    }
    pthread_mutex_unlock(&r->ev_mu);
    if (!n) return RDZV_ERR_TIMEOUT;
    *ev = n->ev;
    free(n);
    return RDZV_OK;
}

void rdzv_event_free(rdzv_event *ev)
{
    if (ev) rdzv_round_free(&ev->round);
}

void rdzv_events_free(rdzv *r)
{
    while (r->ev_head) {
        rdzv_ev_node *n = r->ev_head;
        r->ev_head = n->next;
        rdzv_event_free(&n->ev);
        free(n);
    }
}
