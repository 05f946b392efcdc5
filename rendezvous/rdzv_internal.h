/* rdzv_internal.h: private to rdzv.c, store.c, status.c and record.c.
 *
 * The key layout under /ductile/<job>/ and the round record, the one JSON
 * value (`round`) that every agent watches. Keeping both in one place means
 * the protocol, the store and the status reader cannot disagree on a name.
 *
 *   nodes/<node>               registration {addr, lws}, bound to the lease
 *   waiting/<node>             a node waiting for a round with room (lease)
 *   round                      the round record (below); txn-guarded
 *   epoch                      decimal round number, written with `round`
 *   restarts                   decimal job-wide restart count
 *   state                      {"state": running|done|failed, "reason"}
 *   rounds/<N>/joined/<node>   a joiner of open round N (lease, create-only)
 *   rounds/<N>/left/<node>     a member of round N that left cleanly
 *   rounds/<N>/store/<key>     the round store, fenced on `epoch`
 */
#ifndef DUCTILE_RDZV_INTERNAL_H
#define DUCTILE_RDZV_INTERNAL_H

#include "ductile/etcd.h"
#include "ductile/rdzv.h"

#include <stddef.h>
#include <stdint.h>

#define RDZV_KEY_MAX 512

/* One member as the round record lists it. lease is the lease of the
 * member's registration when it joined: a node key under another lease is
 * a restarted node, not the member. */
typedef struct rdzv_rec_member {
    char *node;
    char *addr;
    int lws;
    int64_t lease;
} rdzv_rec_member;

typedef struct rdzv_record {
    int64_t number;
    int frozen; /* 0: open, 1: frozen */
    int nmembers;
    rdzv_rec_member *members; /* frozen: by rank */
    int nprev;
    char **prev; /* node order of the last frozen round, kept for ranks */
    int64_t restarts;
    int max_restarts;
    int min_nodes, max_nodes; /* the job's --nnodes, set by the first agent (0: not kept) */
    int64_t counted;          /* newest round whose first-hand failure was counted */
    uint64_t peer_lost_of;    /* members hash of the round that ended by a lost peer */
    char job[16];             /* running, done, failed */
    char cause[32];           /* why the previous round ended (rdzv_cause_name) */
    char cause_node[129];
    char reason[RDZV_MSG_MAX];
} rdzv_record;

/* "/ductile/<job>/" + suffix; returns 0, or -1 when it does not fit. */
int rdzv_key(char *buf, size_t len, const char *job, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));


/* JSON <-> record. parse returns RDZV_ERR_PROTOCOL on anything malformed. */
char *rdzv_record_json(const rdzv_record *rec);
rdzv_err rdzv_record_parse(const char *json, size_t len, rdzv_record *out);
void rdzv_record_free(rdzv_record *rec);
/* Copies what every record carries from one round to the next: restart
 * count and budget, the job's node limits, the counted round and the
 * lost-peer hash. */
void rdzv_record_carry(const rdzv_record *from, rdzv_record *to);
/* Order-independent hash of the members (node id and lease). */
uint64_t rdzv_record_members_hash(const rdzv_record *rec);
/* Deep copy of the prev / member order used for ranks of the next round. */
rdzv_err rdzv_record_copy_order(const rdzv_record *from, rdzv_record *to);
int rdzv_record_member_index(const rdzv_record *rec, const char *node);
/* The public view of a frozen record, for node `me` (may be NULL). */
rdzv_err rdzv_record_to_round(const rdzv_record *rec, const char *me, rdzv_round *out);

rdzv_cause rdzv_cause_from_name(const char *name);

/* etcd connection from the public config; errors mapped to rdzv_err. */
rdzv_err rdzv_etcd_connect(const rdzv_etcd *cfg, etcd_client **out, char *msg);
rdzv_err rdzv_from_etcd(etcd_err err);

int64_t rdzv_now_ms(void);

#endif
