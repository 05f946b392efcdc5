/* comm_ring.h: what the two halves of the TCP ring share (private to trainer/).
 *
 * comm_ring.c is the ring: its state, the transfer engine, the collectives
 * and construction from two connected sockets. comm_ring_boot.c finds the
 * neighbours through the round store and connects those sockets. The seam
 * is small: the bootstrap makes a ring with ring_new(), fills left_fd and
 * right_fd, and hands them over with ring_ready_fds().
 */
#ifndef DUCTILE_COMM_RING_H
#define DUCTILE_COMM_RING_H

#include <stddef.h>
#include <stdint.h>

#include "comm_impl.h"

typedef struct ring {
    comm base;    /* first: comm.c sees the same pointer */
    int left_fd;  /* receives from rank-1; closed only by ring_destroy */
    int right_fd; /* sends to rank+1 */
    int abort_fd; /* eventfd written by comm_abort() */
    int timeout_ms;
    size_t chunk; /* bytes, a multiple of 4 */
    float *stage; /* one chunk: incoming floats before they are added */
    uint64_t seq; /* collectives so far */
} ring;

/* A ring for cfg with no connections yet (both fds -1); *out is NULL on failure. */
comm_err ring_new(const comm_config *cfg, ring **out);

/* comm_ops.destroy: closes the fds the ring owns and frees it. */
void ring_destroy(comm *c);

/* Readies left_fd and right_fd for the transfer engine (non-blocking, big
 * buffers, no Nagle). */
comm_err ring_ready_fds(ring *g);

/* Large kernel buffers keep the pipeline full; set before connect/listen so
 * the TCP window scale is chosen for them. Capped by net.core.[rw]mem_max. */
void ring_set_bufs(int fd);

/* 1 when failpoint `name` fires with `action` on this call. Another action
 * never fires (failpoint.h: a typo shows up as a test that fails; the
 * library does not print). */
int ring_failpoint(const char *name, const char *action);

/* Milliseconds from now to deadline (mono_now_ms() time), for poll():
 * 0 once past, capped at 1000000. */
int ring_ms_left(int64_t deadline);

/* Waits for events on fd until the deadline (mono_now_ms() time): 1 ready,
 * 0 timed out, -1 error (errno). The shared-memory bootstrap uses it too. */
int ring_wait_fd(int fd, short events, int64_t deadline);

/* The neighbours' ranks. */
int ring_left_rank(const ring *g);
int ring_right_rank(const ring *g);

#endif
