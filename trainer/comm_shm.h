/* comm_shm.h: what the shared-memory transport's files share (private to trainer/).
 *
 * comm_shm.c is the segment: its layout, the barrier every collective
 * steps through, the checks that end a wait, and making and freeing one
 * rank's view of it. comm_shm_coll.c runs the collectives over it and
 * holds the ops table; comm_shm_join.c is the join handshake by which a
 * host's ranks come to share one segment. comm_cpu.c, which chooses the CPU
 * transport, builds a host's segment with shm_group().
 */
#ifndef DUCTILE_COMM_SHM_H
#define DUCTILE_COMM_SHM_H

#include <poll.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "comm_impl.h"

#define SHM_SLOT (128u * 1024u) /* bytes per rank per chunk */

/* What a rank says it is doing: all must agree before data is used. */
typedef struct shm_desc {
    alignas(64) uint32_t op;
    uint32_t root;
    uint64_t seq;
    uint64_t size;
} shm_desc;

typedef struct shm_header {
    alignas(64) atomic_uint arrived; /* barrier arrivals so far, all ranks */
    alignas(64) atomic_uint gen;     /* barriers completed: the futex word */
    atomic_uint waiters;             /* ranks asleep (or about to be) on gen */
    alignas(64) atomic_uint dead;    /* rank+1 of the first rank that failed */
    /* By the collective's parity: a rank may start collective s+1 while a
     * slower one still reads collective s's descriptions. */
    alignas(64) shm_desc desc[2][SHM_MAX_RANKS];
} shm_header;

#define SHM_DATA_OFF (((sizeof(shm_header) + 4095) / 4096) * 4096)

typedef struct shm {
    comm base; /* first: comm.c sees the same pointer */
    shm_header *h;
    char *data; /* 2 sets of world+1 slots of SHM_SLOT bytes (the last: the result) */
    size_t seg_bytes;
    int timeout_ms;
    uint32_t nbar; /* barriers this rank has entered */
    uint64_t seq;
    int peer_fd[SHM_MAX_RANKS]; /* liveness: -1 for this rank */
    int grank[SHM_MAX_RANKS];   /* the job's rank of each (one host's ranks under comm_hier.c) */
    struct pollfd pfd[SHM_MAX_RANKS];
    int npfd;
} shm;

/* comm_shm_coll.c: the collectives comm.c calls. */
extern const comm_ops shm_ops;

/* ---- comm_shm.c: the segment ---- */

/* A rank's view of a segment of world ranks, not yet mapped, with no peers. */
comm_err shm_new(const comm_config *cfg, int rank, int world, shm **out);

/* comm_ops.destroy: unmaps the segment, closes the liveness sockets, frees. */
void shm_destroy(comm *c);

/* As a ring's abort shuts its sockets: every rank's collectives fail now,
 * and this rank's waiter wakes to see its flag. */
void shm_abort(comm *c);

/* The segment's size for world ranks: the header, then 2 sets of world+1 slots. */
size_t shm_seg_bytes(int world);

/* Maps the segment of memfd (bytes long; memfd stays the caller's). */
comm_err shm_map(shm *g, int memfd, size_t bytes);

/* Rank r's liveness socket (owned from now on). */
void shm_add_peer(shm *g, int r, int fd);

/* Poisons the segment (when mapped) and records the error as this rank's. */
comm_err shm_fail(shm *g, comm_err err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Arrives at the next barrier and waits for every rank to arrive. */
comm_err shm_barrier_wait(shm *g);

/* The job's rank of local rank r, for messages. */
static inline int shm_job_rank(const shm *g, int r)
{
    return r >= 0 && r < SHM_MAX_RANKS ? g->grank[r] : r;
}

/* ---- comm_shm_join.c: the join handshake ---- */

/* One host's ranks (lrank of lworld; the job's ranks r with host_of[r] ==
 * host) build their segment: the leader (lrank 0) serves it, the others
 * join. On failure *why says why. */
comm_err shm_group(const comm_config *cfg, const int *host_of, int lrank, int lworld, int host,
                   int64_t deadline, comm **out, char *why);

#endif
