/* rt_nccl_proxy.c: the comm thread once bootstrapped (see rt_nccl.h).
 *
 * It owns the peer sockets and never takes the runtime lock: it reads each
 * peer's frames into that peer's inbox, writes the outboxes the ops fill,
 * and turns a closed connection into the comm's async error (unless the
 * peer said goodbye first). It meets the ops only under the comm's mutex.
 */
#include "rt_nccl.h"

/* ---- the proxy: the comm thread once bootstrapped ---- */

/* Peer p is gone (err 0: EOF). An error unless it said goodbye, this comm
 * finished finalizing, or this comm is the one tearing down. */
static void nc_peer_lost(nc_shared *sh, int p, int err)
{
    char how[96];
    if (err)
        snprintf(how, sizeof(how), ": %s", strerror(err));
    else
        snprintf(how, sizeof(how), " closed");
    pthread_mutex_lock(&sh->mu);
    nc_peer *pe = &sh->peer[p];
    pe->closed = 1;
    if (!pe->bye && sh->finalize != NC_FIN_DONE && !sh->stopping)
        nc_fail_locked(sh, sh->peer_error, "connection to rank %d%s", p, how);
    pthread_mutex_unlock(&sh->mu);
}

/* The header of a frame from p is in: checks it and makes room for the
 * payload. A garbled header is a bug in this file, not a peer's fault. */
static int nc_rx_header(nc_shared *sh, int p)
{
    nc_peer *pe = &sh->peer[p];
    const nc_hdr *h = &pe->rx_hdr;
    if (h->magic != NC_FRAME_MAGIC || h->kind < NC_ALLREDUCE || h->kind > NC_BYE ||
        h->kind == NC_RECV)
        rt_die("rank %d: garbled frame from rank %d (magic %#x, kind %u)", sh->rank, p, h->magic,
               h->kind);
    pe->rx = h->bytes <= SIZE_MAX - sizeof(nc_msg) ? malloc(sizeof(nc_msg) + h->bytes) : NULL;
    if (!pe->rx) {
        pthread_mutex_lock(&sh->mu);
        pe->closed = 1; /* the rest of its stream cannot be read */
        nc_fail_locked(sh, ncclSystemError, "out of memory for %llu bytes from rank %d",
                       (unsigned long long)h->bytes, p);
        pthread_mutex_unlock(&sh->mu);
        return -1;
    }
    pe->rx->next = NULL;
    pe->rx->h = *h;
    pe->rx_got = 0;
    return 0;
}

/* A whole frame from p: into its inbox (a goodbye only marks p). */
static void nc_rx_deliver(nc_shared *sh, int p)
{
    nc_peer *pe = &sh->peer[p];
    nc_msg *m = pe->rx;
    pe->rx = NULL;
    pe->rx_got = 0;
    pthread_mutex_lock(&sh->mu);
    if (m->h.kind == NC_BYE) {
        pe->bye = 1;
        free(m);
    } else {
        if (pe->in_tail)
            pe->in_tail->next = m;
        else
            pe->in = m;
        pe->in_tail = m;
    }
    pthread_mutex_unlock(&sh->mu);
}

/* Reads what p has sent, frame by frame, without blocking; at most
 * NC_READ_BURST reads, so a peer streaming megabytes does not keep the
 * proxy from the others (poll calls again while there is more). */
static void nc_proxy_read(nc_shared *sh, int p)
{
    nc_peer *pe = &sh->peer[p];
    for (int burst = 0; !pe->closed && burst < NC_READ_BURST; burst++) {
        char *dst = pe->rx ? (char *)pe->rx->data + pe->rx_got : (char *)&pe->rx_hdr + pe->rx_got;
        size_t want = pe->rx ? pe->rx->h.bytes - pe->rx_got : sizeof(nc_hdr) - pe->rx_got;
        ssize_t k = recv(pe->fd, dst, want, 0); /* want > 0: empty frames are delivered at once */
        if (k == 0) return nc_peer_lost(sh, p, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (k < 0) return nc_peer_lost(sh, p, errno);
        pe->rx_got += (size_t)k;
        if (!pe->rx && pe->rx_got == sizeof(nc_hdr) && nc_rx_header(sh, p) != 0) return;
        if (pe->rx && pe->rx_got == pe->rx->h.bytes) nc_rx_deliver(sh, p);
    }
}

/* Writes p's queued frames until the socket is full. The head frame is the
 * proxy's to write and free; callers only append behind it. */
static void nc_proxy_write(nc_shared *sh, int p)
{
    nc_peer *pe = &sh->peer[p];
    while (!pe->closed) {
        pthread_mutex_lock(&sh->mu);
        nc_msg *m = pe->out;
        pthread_mutex_unlock(&sh->mu);
        if (!m) return;
        size_t total = sizeof(nc_hdr) + m->h.bytes;
        const char *from = (const char *)m + offsetof(nc_msg, h) + pe->out_off;
        ssize_t k = send(pe->fd, from, total - pe->out_off, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (k < 0) return nc_peer_lost(sh, p, errno);
        pe->out_off += (size_t)k;
        if (pe->out_off < total) continue;
        pthread_mutex_lock(&sh->mu);
        pe->out = m->next;
        if (!pe->out) pe->out_tail = NULL;
        pe->flushed++;
        pthread_mutex_unlock(&sh->mu);
        free(m);
        pe->out_off = 0;
    }
}

/* Fills the poll set: the eventfd, then each live peer (writable wanted
 * when it has frames queued). 0 when the comm is stopping. */
static int nc_proxy_fds(nc_shared *sh, struct pollfd *pfd, int *who, int *n)
{
    pthread_mutex_lock(&sh->mu);
    int stop = sh->stopping;
    pfd[0] = (struct pollfd){.fd = sh->wake, .events = POLLIN};
    *n = 1;
    for (int p = 0; p < sh->nranks; p++) {
        nc_peer *pe = &sh->peer[p];
        if (p == sh->rank || pe->closed) continue;
        pfd[*n] = (struct pollfd){.fd = pe->fd, .events = POLLIN | (pe->out ? POLLOUT : 0)};
        who[(*n)++] = p;
    }
    pthread_mutex_unlock(&sh->mu);
    return !stop;
}

/* Parks the thread until abort or destroy (the eventfd is drained first,
 * then the flag read, so a stop's write is never lost). */
static void nc_wait_stop(nc_shared *sh)
{
    while (!nc_stopping(sh)) {
        struct pollfd p = {.fd = sh->wake, .events = POLLIN};
        if (poll(&p, 1, -1) < 0 && errno != EINTR) return;
        nc_drain(sh->wake);
    }
}

static void nc_proxy(nc_shared *sh)
{
    struct pollfd *pfd = calloc((size_t)sh->nranks + 1, sizeof(*pfd));
    int *who = calloc((size_t)sh->nranks + 1, sizeof(*who));
    int n = 0;
    if (!pfd || !who) nc_fail(sh, ncclSystemError, "out of memory for the proxy");
    while (pfd && who && nc_proxy_fds(sh, pfd, who, &n)) {
        if (poll(pfd, (nfds_t)n, -1) < 0) {
            if (errno == EINTR) continue;
            nc_fail(sh, ncclSystemError, "poll: %s", strerror(errno));
            break;
        }
        if (pfd[0].revents) nc_drain(sh->wake);
        for (int i = 1; i < n; i++) {
            if (pfd[i].revents & (POLLIN | POLLHUP | POLLERR)) nc_proxy_read(sh, who[i]);
            if (pfd[i].revents & POLLOUT) nc_proxy_write(sh, who[i]);
        }
    }
    free(pfd);
    free(who);
    nc_wait_stop(sh);
}

void *nc_thread(void *arg)
{
    nc_shared *sh = arg;
    if (sh->idle)
        nc_wait_stop(sh);
    else if (nc_bootstrap(sh) == ncclSuccess)
        nc_proxy(sh);
    return NULL;
}
