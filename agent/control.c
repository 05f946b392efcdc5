/* control.c: the agent's side of the control channel (control.h): its
 * sockets, line buffers and log. The lines themselves are formatted and
 * parsed by libductile-control (control/), which ductile-train shares.
 *
 * The agent writes short lines to a non-blocking socket: a line is far below
 * the socket buffer, so a write either goes whole or the worker is not
 * reading at all, and then the line is dropped with a log rather than
 * blocking the agent's loop.
 */
#include "workers.h"

#include "ductile/control.h"
#include "ductile/log.h"

#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

int agent_ctl_send(agent_worker *w, const ctl_msg *m)
{
    char line[CTL_MAX_LINE + 2];
    int n = ctl_format(m, line, sizeof(line));
    if (n < 0 || w->ctl_fd < 0) return -1;
    ssize_t sent;
    do {
        sent = send(w->ctl_fd, line, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT);
    } while (sent < 0 && errno == EINTR);
    return sent == n ? 0 : -1;
}

void agent_ctl_read(agent_worker *w, const dlog *lg,
                    void (*on_msg)(void *ctx, agent_worker *w, const ctl_msg *m), void *ctx)
{
    char chunk[2048];
    for (int rounds = 0; rounds < 16 && w->ctl_fd >= 0; rounds++) {
        ssize_t got = recv(w->ctl_fd, chunk, sizeof(chunk), MSG_DONTWAIT);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (got <= 0) {
            close(w->ctl_fd);
            w->ctl_fd = -1;
            w->ctl.len = 0;
            return;
        }
        for (ssize_t i = 0; i < got; i++) {
            agent_linebuf *lb = &w->ctl;
            if (chunk[i] != '\n') {
                if (lb->len < CTL_MAX_LINE) lb->buf[lb->len] = chunk[i];
                lb->len++; /* counts past the limit so an overlong line is refused */
                continue;
            }
            ctl_msg m;
            if (lb->len <= CTL_MAX_LINE) {
                lb->buf[lb->len] = 0;
                if (ctl_parse(lb->buf, &m) == 0) {
                    on_msg(ctx, w, &m);
                } else {
                    dlog_warn(lg, "control_invalid", "worker rank %d sent an invalid control line",
                              w->rank);
                }
            } else {
                dlog_warn(lg, "control_invalid", "worker rank %d sent an overlong control line",
                          w->rank);
            }
            lb->len = 0;
        }
    }
}
