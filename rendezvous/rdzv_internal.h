/* rdzv_internal.h: private to the rendezvous library (rendezvous/rdzv*.c,
 * record.c, store.c, status.c).
 *
 * The key layout under /ductile/<job>/ and the round record, the one JSON
 * value (`round`) that every agent watches. Keeping both in one place means
 * the protocol, the store and the status reader cannot disagree on a name.
 *
 *   nodes/<node>               registration {addr, lws, inc, probe}, bound to the lease
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
#include "ductile/log.h"
#include "ductile/rdzv.h"

#include <pthread.h>
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
    char cause_node[RDZV_NODE_ID_MAX + 1];
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
/* The ring of a frozen round, in rank order: each member is watched by the
 * RDZV_RING_PEERS members before it (the sentinel holds their probes, the
 * driver checks their registrations). Fills out with the ranks after me
 * (me < 0, a node not in the round: ranks 0, 1, ...) among n members, never
 * me itself; returns how many. */
#define RDZV_RING_PEERS 2
int rdzv_ring_next(int me, int n, int out[RDZV_RING_PEERS]);
/* The public view of a frozen record, for node `me` (may be NULL). */
rdzv_err rdzv_record_to_round(const rdzv_record *rec, const char *me, rdzv_round *out);

rdzv_cause rdzv_cause_from_name(const char *name);

/* etcd connection from the public config; errors mapped to rdzv_err. */
rdzv_err rdzv_etcd_connect(const rdzv_etcd *cfg, etcd_client **out, char *msg);
rdzv_err rdzv_from_etcd(etcd_err err);

/* ---- the handle (rdzv.c, rdzv_driver.c, rdzv_watch.c, rdzv_report.c) ----
 *
 * Three kinds of thread share a handle: the caller's (rdzv_open and leave
 * under api_mu; reports and finish, from any thread, under rep_mu with a
 * client of their own, so a report stalled on etcd never holds up a leave),
 * the driver's (the protocol steps: it alone
 * touches the driver-only state), and the helpers that wake it (watches and
 * the keep-alive: they post to the driver's inbox under mu). */

/* What woke the driver: the dirty bits of its inbox. */
enum {
    RDZV_TAG_ROUND = 1,
    RDZV_TAG_NODES = 2,
    RDZV_TAG_WAITING = 4,
    RDZV_TAG_JOIN = 8,
    RDZV_TAG_RESYNC = 16,
};

typedef struct rdzv_watcher rdzv_watcher;   /* rdzv_watch.c */
typedef struct rdzv_probe rdzv_probe;       /* probe.c */
typedef struct rdzv_sentinel rdzv_sentinel; /* rdzv_sentinel.c */
typedef struct rdzv_ev_node rdzv_ev_node;   /* rdzv.c */

struct rdzv {
    /* configuration, deep-copied */
    rdzv_config cfg;
    rdzv_etcd etcd;
    char *strs[10];
    char node[RDZV_NODE_ID_MAX + 1];
    dlog log; /* debug traces of the protocol steps (tag "rdzv", this node) */

    etcd_client *api; /* open and leave, from the caller's thread */
    pthread_mutex_t api_mu;
    etcd_client *rep; /* reports and finish (failpoint name "api" too) */
    pthread_mutex_t rep_mu;
    int64_t lease;
    int64_t incarnation; /* of this node's registration (1, or one more than the one taken over) */
    int took_over;       /* the registration was taken over from a dead incarnation */
    rdzv_probe *probe;   /* the liveness responder; NULL when the address has none */
    rdzv_sentinel *sentinel; /* holds the next members' probe connections */
    int closed;              /* left: written under api_mu and mu, read under either */

    /* events to the caller */
    pthread_mutex_t ev_mu;
    rdzv_ev_node *ev_head, *ev_tail;
    int efd;

    /* the driver's inbox and what the caller's thread may read */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop;
    unsigned dirty;
    int lease_lost;
    int holds;            /* rdzv_hold calls not yet released */
    int close_called;     /* rdzv_close was called: the last release frees */
    int64_t member_round; /* the last round this node was frozen into */
    char *round_cache;    /* the round record as the last watch event had it */
    size_t round_cache_len;
    int64_t round_cache_mod;
    double seconds_in_rdzv;
    int64_t seek_start_ms;

    pthread_t driver, keepalive;
    int driver_started, keepalive_started;
    etcd_client *dc, *kac;
    rdzv_watcher *watcher; /* the one watch stream's thread (rdzv_watch.c) */

    /* driver-only state */
    int64_t in_round;     /* frozen round this node is in, not yet ended */
    int64_t reported;     /* newest round reported FROZEN: never again, nor older */
    int64_t spare_round;  /* round for which SPARE was reported */
    int waiting_written;  /* waiting/<node> exists */
    int64_t deadline_ms;  /* join deadline, 0 when none runs */
    int64_t last_call_at; /* freeze timer, 0 when none */
    int64_t retry_at;     /* retry timer after an etcd error, 0 when none */
    int64_t backoff_ms;
    int terminal;
    int64_t fz_round, fz_count, fz_maxrev, fz_last_join;
    int64_t join_round, join_rev; /* this node's join: its round and create revision */
    int round_absent;             /* rdzv_open found no round: the first step creates it */
    int64_t join_tried;           /* the open round this driver last tried to join at once */
    /* the record of the last step that ended in RDZV_OK, kept for the next
     * step that no change of `round` woke (a join event, a timer): its
     * snapshot's guard tells if it moved meanwhile (reconcile) */
    rdzv_record last_rec;
    int64_t last_mod;
    int have_last;
    /* what the handle costs etcd (rdzv_get_counts): atomics, added to by
     * every connection of the handle and the driver */
    rdzv_counts counts;
};

/* rdzv_events.c: events to the caller. rdzv_emit takes ev's round. */
void rdzv_emit(rdzv *r, rdzv_event *ev);
void rdzv_emit_simple(rdzv *r, rdzv_event_type type, rdzv_err err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void rdzv_events_free(rdzv *r); /* the events never taken */

/* rdzv_driver.c: the driver thread. */
void *rdzv_driver_main(void *arg);

/* rdzv_keys.c: the reads and writes of the job's keys that the handle, the
 * driver and the reports share, each on its own connection. */
rdzv_err rdzv_read_round(rdzv *r, etcd_client *c, rdzv_record *rec, int64_t *mod, int *have);
rdzv_err rdzv_put_record(rdzv *r, etcd_client *c, const rdzv_record *next, int64_t mod,
                         int bump_epoch, const char *state_json, int *won);
/* The same, and what the record is now: won, seen->mod is the written
 * record's mod_revision; lost, seen->rec (seen->have: 1; the caller frees
 * it) and seen->mod are the record that is there instead, read in the same
 * txn (have 0 when there is none). */
typedef struct rdzv_seen {
    rdzv_record rec;
    int64_t mod;
    int have;
} rdzv_seen;
rdzv_err rdzv_put_record_seen(rdzv *r, etcd_client *c, const rdzv_record *next, int64_t mod,
                              int bump_epoch, const char *state_json, int *won, rdzv_seen *seen);
/* The job state key's value: {"state", "reason"} and, when the writer has
 * one, its "install" id. */
char *rdzv_state_json(const rdzv *r, const char *state, const char *reason);
typedef struct rdzv_job_state {
    char state[16]; /* "running", "done", "failed" */
    char reason[RDZV_MSG_MAX];
    char install[RDZV_INSTALL_ID_MAX + 1]; /* "" when none was recorded */
} rdzv_job_state;
/* Parses the state key's value; RDZV_ERR_PROTOCOL when it has no state. */
rdzv_err rdzv_state_parse(const char *value, size_t len, rdzv_job_state *out);
/* 1 when st is a job's end recorded under an install id, install (may be
 * NULL) is one too and they differ: the job ended in an earlier install. */
int rdzv_state_elsewhere(const rdzv_job_state *st, const char *install);
/* Creates key (a round's joined/<node>) holding this node's registration
 * value (address, local world size, incarnation, probe port; the value
 * rdzv_node_value makes) under its lease: create-only,
 * and only while nguards (at most 3) guards hold, with nalso (at most 2)
 * more ops in the same txn; its whole result in *out (may be NULL; the
 * caller frees it): ranges[1 + i] is also[i]'s. */
rdzv_err rdzv_register_txn(rdzv *r, etcd_client *c, const char *key, const etcd_cmp *guards,
                           size_t nguards, const etcd_op *also, size_t nalso, etcd_txn_result *out);

/* The value of this node's registration and joins: {addr, lws, inc,
 * probe} (malloc'd), probe being the port of its liveness responder. */
char *rdzv_node_value(const rdzv *r);

/* What a registration says of its incarnation: addr, inc, probe port
 * (zero when missing or malformed: such a registration is never judged
 * dead). */
typedef struct rdzv_reg {
    char addr[1025];
    int64_t inc;
    int probe;
} rdzv_reg;
void rdzv_reg_parse(const etcd_kv *kv, rdzv_reg *out);

/* probe.c: the liveness probe of a registration. */
typedef enum { RDZV_PROBE_DEAD, RDZV_PROBE_ALIVE, RDZV_PROBE_UNKNOWN } rdzv_probe_verdict;
/* Starts the responder on a port of addr's family. *out stays NULL (and
 * RDZV_OK) when addr names no usable address: such a node is never taken
 * over. */
rdzv_err rdzv_probe_start(const char *addr, const char *node, rdzv_probe **out);
int rdzv_probe_port(const rdzv_probe *p); /* 0 for NULL */
/* The incarnation the responder answers with; set before the registration
 * that names it is written. */
void rdzv_probe_set_incarnation(rdzv_probe *p, int64_t inc);
void rdzv_probe_stop(rdzv_probe *p);
/* Asks addr:port whether incarnation inc of node answers, within
 * timeout_ms: ALIVE (it does), DEAD (refused, reset, closed or another
 * answer: nobody of that incarnation holds the port), UNKNOWN (silence,
 * unreachable, no probe). why receives a one-line reason. */
rdzv_probe_verdict rdzv_probe_check(const char *addr, int port, const char *node, int64_t inc,
                                    int timeout_ms, char *why, size_t len);
/* The same check, keeping the connection: the socket when ALIVE (the
 * responder holds it open until this side closes it, so its end means the
 * responder's process ended), else -1 with *verdict and why set. */
int rdzv_probe_hold(const char *addr, int port, const char *node, int64_t inc, int timeout_ms,
                    rdzv_probe_verdict *verdict, char *why, size_t len);

/* rdzv_suspect.c: 1 when node's agent is gone (rdzv_check_members' test,
 * before deadline), its lease then revoked (*revoked, may be NULL: 1 when
 * this call revoked one; a node that left has none); why says how it was
 * judged. */
int rdzv_check_member(rdzv *r, const char *node, int64_t deadline, int *revoked, char *why,
                      size_t len);

/* rdzv_sentinel.c: each member watches the next RDZV_RING_PEERS members'
 * agents over a held probe connection; one that closes is checked at once
 * (rdzv_check_members). */
rdzv_err rdzv_sentinel_start(rdzv *r);
/* Watches round's next members after this node (NULL or a round without
 * it: none). */
void rdzv_sentinel_watch(rdzv_sentinel *s, const rdzv_round *round);
/* The registration of node (kv: its key and value) as the driver's snapshot
 * of the watched round read it: the sentinel uses it instead of reading the
 * key itself, once. */
void rdzv_sentinel_reg(rdzv_sentinel *s, const char *node, const etcd_kv *kv);
void rdzv_sentinel_stop(rdzv *r); /* joins the thread; again: nothing */
void rdzv_sentinel_free(rdzv *r);

/* rdzv_watch.c: what wakes the driver. */
/* Waits on r->cv until until_ms (0: forever) or stop; returns 1 on stop.
 * Called with r->mu held. */
int rdzv_wait_until(rdzv *r, int64_t until_ms);
void *rdzv_keepalive_main(void *arg);
/* Keeps kv (the `round` key as read or watched; NULL: none) for the
 * driver's next step (rdzv_take_cached_round). */
void rdzv_cache_round(rdzv *r, const etcd_kv *kv);
/* Starts the watch thread with `round` from start_rev in its set;
 * RDZV_ERR_NOMEM when no thread starts. Its stream opens once the driver
 * has taken its first step (rdzv_watch_apply). */
rdzv_err rdzv_watch_round(rdzv *r, int64_t start_rev);
/* After each driver step: the watch set as the step left it goes on the
 * stream (opened again only when the step changed it). */
void rdzv_watch_apply(rdzv *r);
/* The nodes/ watch, and (waiting: this node is a member of a round with
 * room) the waiting/ watch, from revision from, unless already running. */
void rdzv_start_member_watches(rdzv *r, int64_t from, int waiting);
void rdzv_set_join_watch(rdzv *r, const char *key, int prefix, int64_t start_rev);
/* Stops the watch thread and waits for it (the handle is closing). */
void rdzv_watchers_join(rdzv *r);
/* Takes the round record the last `round` event carried; 1 when *rec is
 * filled. */
int rdzv_take_cached_round(rdzv *r, rdzv_record *rec, int64_t *mod);

#endif
