/* rdzv.h: the whole public interface of libductile-rdzv.
 *
 * Agents meet in etcd under /ductile/<job>/ and agree, round by round, on
 * which nodes are in the job and which rank each holds (docs/design.md,
 * "Rounds"). Round numbers only grow and are the fencing epoch: anything
 * written for round N is refused once round N+1 exists.
 *
 * The interface is event-driven so that an agent can keep one poll() loop:
 * rdzv_open() starts a driver thread that keeps the node's lease alive,
 * watches etcd, joins rounds and opens new ones; what happens comes back as
 * events, and rdzv_fd() becomes readable whenever rdzv_next_event() has one.
 * The round store (rdzv_store_*) is separate and light so that trainer
 * processes can use it with just the etcd endpoints, the job and the round.
 *
 * DUCTILE_RDZV_DEBUG=1 (or DUCTILE_LOG_LEVEL=debug) in the environment logs
 * each protocol step (join, freeze, new round, retries) to stderr through
 * the shared logger (log.h, tag "rdzv"); the library is silent otherwise.
 */
#ifndef DUCTILE_RDZV_H
#define DUCTILE_RDZV_H

#include "ductile/etcd.h"

#include <stddef.h>
#include <stdint.h>

typedef enum {
    RDZV_OK = 0,
    RDZV_ERR_ARG, /* invalid argument or configuration */
    RDZV_ERR_NOMEM,
    RDZV_ERR_ETCD,       /* etcd failed or could not be reached (detail in the message) */
    RDZV_ERR_TIMEOUT,    /* a deadline passed */
    RDZV_ERR_FENCED,     /* the round is no longer the current one: write refused */
    RDZV_ERR_NOT_FOUND,  /* no such key in the store */
    RDZV_ERR_LEASE_LOST, /* this node's lease expired: it is out of the job */
    RDZV_ERR_JOB_DONE,   /* the job has completed */
    RDZV_ERR_JOB_FAILED, /* the job has failed (restart limit reached) */
    RDZV_ERR_DUPLICATE,  /* this node id is registered by an agent that is (or may be) alive */
    RDZV_ERR_CLOSED,     /* the handle is leaving or closed */
    RDZV_ERR_PROTOCOL,   /* malformed data found under the job's keys */
    RDZV_ERR_JOB_ENDED_ELSEWHERE, /* the job ended in an earlier install (another install id) */
} rdzv_err;

const char *rdzv_strerror(rdzv_err err);

/* How to reach etcd: endpoints "http://127.0.0.1:2379,..." (bare host:port
 * means http), optional TLS files and user/password. */
typedef struct rdzv_etcd {
    const char *endpoints;
    const char *cacert;
    const char *cert;
    const char *key;
    const char *user;
    const char *password;
    int timeout_ms; /* deadline of one etcd call; 0 means 5000 */
} rdzv_etcd;

/* The size of a msg buffer that rdzv_* functions fill with a one-line reason. */
#define RDZV_MSG_MAX 256

/* Job ids: [a-z0-9][a-z0-9-]{0,62}. Returns 1 when valid. */
int rdzv_job_id_valid(const char *job);
/* Install ids: [A-Za-z0-9-]{1,64}. Returns 1 when valid. */
int rdzv_install_id_valid(const char *id);
#define RDZV_INSTALL_ID_MAX 64
/* Node ids: [A-Za-z0-9._-]{1,128}. Returns 1 when valid. */
int rdzv_node_id_valid(const char *node);
#define RDZV_NODE_ID_MAX 128

/* The etcd prefix of round's store (what workers get as
 * DUCTILE_STORE_PREFIX): "/ductile/<job>/rounds/<round>/store/". Returns its
 * length, or -1 when it does not fit in len or job is not a job id. */
int rdzv_store_prefix(const char *job, int64_t round, char *out, size_t len);

/* The most workers one node may run: a join above it is refused by
 * rdzv_open (and skipped if one is found in etcd), so a world size always
 * fits an int. */
#define RDZV_MAX_LOCAL_WORLD 1024

typedef struct rdzv_config {
    rdzv_etcd etcd;
    const char *job;      /* job id */
    const char *node_id;  /* unique per node: [A-Za-z0-9._-]{1,128} */
    const char *addr;     /* address peers use to reach this node */
    int local_world_size; /* workers on this node (1..RDZV_MAX_LOCAL_WORLD) */
    int min_nodes;        /* >= 1; job-wide: the first agent's value is kept */
    int max_nodes;        /* >= min_nodes; likewise */
    int last_call_ms;     /* after min_nodes joined, wait this long past the last join */
    int lease_ttl_s;      /* node lease TTL (>= 2) */
    int join_timeout_ms;  /* a round must freeze within this, else RDZV_EV_ERROR;
                             0 means 600000. A hot spare has no such deadline. */
    int max_restarts;     /* job-wide failure budget; the first agent's value is kept */
    int no_takeover;      /* 1: never take over a registration of this node id, even from a
                             dead incarnation (an agent registering again after losing its
                             own registration must not take it back) */
    /* NULL or "": none. Else [A-Za-z0-9-]{1,64}: which install of the job
     * this agent belongs to (a Helm release's, say). The job's end state
     * records it, and rdzv_open refuses a job that ended under another one
     * (RDZV_ERR_JOB_ENDED_ELSEWHERE). */
    const char *install_id;
} rdzv_config;

typedef struct rdzv_member {
    char *node_id;
    char *addr;
    int local_world_size;
    int rank;              /* node (group) rank */
    int first_global_rank; /* global ranks first_global_rank .. +local_world_size-1 */
} rdzv_member;

typedef struct rdzv_round {
    int64_t number;
    int nmembers;
    rdzv_member *members; /* sorted by rank */
    int my_rank;          /* this node's group rank, -1 if not a member */
    int world_size;       /* sum of the members' local world sizes */
    int64_t restarts;     /* job-wide restart count when the round froze */
    int max_restarts;     /* the job's restart budget */
} rdzv_round;

void rdzv_round_free(rdzv_round *r);
/* This node's entry of r (the member whose rank is r->my_rank), NULL if none. */
const rdzv_member *rdzv_round_self(const rdzv_round *r);

typedef enum {
    RDZV_CAUSE_NONE = 0,
    RDZV_CAUSE_MEMBER_LOST,  /* a member's node key vanished (lease expired) */
    RDZV_CAUSE_MEMBER_LEFT,  /* a member left cleanly (revoked its lease) */
    RDZV_CAUSE_NODE_WAITING, /* a node was waiting and the round had room */
    RDZV_CAUSE_FAILURE,      /* a member's worker failed first-hand (counted) */
    RDZV_CAUSE_PEER_LOST,    /* a member's worker lost a peer under a collective */
    RDZV_CAUSE_COUNT
} rdzv_cause;

const char *rdzv_cause_name(rdzv_cause cause); /* "member_lost", ... for metrics */

typedef enum {
    RDZV_EV_FROZEN,      /* a round with this node as a member froze: ev.round */
    RDZV_EV_ROUND_ENDED, /* the round this node was in ended: cause, node, reason */
    RDZV_EV_SPARE,       /* the round is full: this node waits as a hot spare */
    RDZV_EV_JOB_DONE,    /* the job completed; nothing more will happen */
    RDZV_EV_JOB_FAILED,  /* the job failed: reason */
    RDZV_EV_ERROR,       /* unrecoverable: err and reason (lease lost, join timeout, ...) */
} rdzv_event_type;

typedef struct rdzv_event {
    rdzv_event_type type;
    rdzv_round round;                /* FROZEN: the new round (caller frees with rdzv_event_free) */
    int64_t round_number;            /* ROUND_ENDED: the round that ended */
    rdzv_cause cause;                /* ROUND_ENDED */
    char node[RDZV_NODE_ID_MAX + 1]; /* ROUND_ENDED: the node that caused it, if known */
    char reason[RDZV_MSG_MAX];       /* ROUND_ENDED, JOB_FAILED, ERROR: one human-readable line */
    rdzv_err err;                    /* ERROR */
} rdzv_event;

void rdzv_event_free(rdzv_event *ev);

typedef struct rdzv rdzv;

/* Connects, registers nodes/<node_id> under a new lease and starts the driver,
 * which joins the current or next round at once. Fails with
 * RDZV_ERR_JOB_DONE / RDZV_ERR_JOB_FAILED when the job has already ended (in
 * this install, or where either side has no install id),
 * RDZV_ERR_JOB_ENDED_ELSEWHERE when it ended under another install id, and
 * RDZV_ERR_DUPLICATE when this node id is registered by an agent that
 * answers its liveness probe, or does not answer within RDZV_PROBE_TIMEOUT_MS
 * (its lease ends in at most its TTL). A registration whose agent is gone
 * (its probe port refuses) is taken over at once, unless cfg->no_takeover:
 * a restarted pod rejoins in the next round (docs/design.md, "Rounds").
 * msg (may be NULL, RDZV_MSG_MAX bytes) receives a one-line reason on
 * failure. */
rdzv_err rdzv_open(const rdzv_config *cfg, rdzv **out, char *msg);

/* How long rdzv_open waits for a registered incarnation to answer. */
#define RDZV_PROBE_TIMEOUT_MS 2000

/* The incarnation of this node's registration (1 for a node id nobody held);
 * *took_over (may be NULL) says whether it was taken over from a dead one. */
int64_t rdzv_incarnation(const rdzv *r, int *took_over);

/* Readable (poll POLLIN) while an event is pending. */
int rdzv_fd(const rdzv *r);

/* Takes the next event without blocking: RDZV_OK and *ev filled, or
 * RDZV_ERR_TIMEOUT when none is pending. With timeout_ms > 0 it waits up to
 * that long. */
rdzv_err rdzv_next_event(rdzv *r, int timeout_ms, rdzv_event *ev);

/* The failure-counting rule. A pod loss is a membership change, not a
 * failure: only a first-hand failure uses the job's restart budget.
 *
 * rdzv_report_failure: a worker of this node failed first-hand (exited
 * non-zero or by a signal its agent did not send, or said `failed`) in the
 * round this node was last frozen into. Counts one job-wide restart, once
 * per round whoever reports it: if the round is still current it ends
 * (cause FAILURE); if it already ended without a count (a peer saw the
 * crash first and reported a lost peer, a member was lost), the count is
 * added to the current round. Past max_restarts the job is marked failed
 * and every agent gets RDZV_EV_JOB_FAILED.
 *
 * rdzv_report_peer_lost: a worker of this node lost a peer (closed
 * connection, timeout) or could not build the round's group. Ends the
 * round (cause PEER_LOST) without counting, unless the round that ended
 * just before also ended by a lost peer with exactly the same members
 * (node ids and leases): then nothing changed and the same peer is still
 * there but not working (hung, cut off), so it counts as a failure. A node
 * that hangs therefore uses a restart every second round at most, and a
 * job cannot loop forever uncounted. Nothing happens when the round has
 * already ended.
 *
 * Both re-read and retry after an unavailable or ambiguous etcd answer (a
 * leader change) until the lease TTL has passed (past it this node is out
 * of the job anyway). *restarts (may be NULL) receives the job's count;
 * *counted (may be NULL) whether this report added one.
 *
 * Reports and rdzv_finish may be made from any thread (one at a time; the
 * report is about the round this node is in when it is called), and never
 * hold up rdzv_leave: a caller that keeps its own loop free makes them on a
 * thread, holding the handle (rdzv_hold) for as long as it runs. */
rdzv_err rdzv_report_failure(rdzv *r, const char *reason, int64_t *restarts);
rdzv_err rdzv_report_peer_lost(rdzv *r, const char *reason, int64_t *restarts, int *counted);

/* Whose loss is it? A worker of this node exited with an error, or lost a
 * peer: for each of nodes[0..n) (the other members of this node's round, as
 * the agent has it), its registration says whether its agent is gone
 * (the node key missing or held by another incarnation, or its liveness
 * probe refused: the process that held the port is dead). Each gone
 * member's lease is revoked, so the round ends as MEMBER_LOST at once and
 * the next round, which every registered node then joins, freezes without
 * waiting for it. A member that does not answer within timeout_ms in all
 * (a stopped or cut-off agent) is not judged: its lease decides. *gone
 * counts the members found gone; names (may be NULL) lists them, comma
 * separated. Counts nothing against the restart budget. Like the reports,
 * from any thread, holding the handle. */
rdzv_err rdzv_check_members(rdzv *r, const char *const *nodes, int n, int timeout_ms, int *gone,
                            char *names, size_t len);

/* The job completed: mark it done so that every agent, and any that starts
 * later, sees RDZV_EV_JOB_DONE / RDZV_ERR_JOB_DONE. Retries like the
 * reports above. */
rdzv_err rdzv_finish(rdzv *r);

/* Leaves cleanly: marks the leave and revokes the lease, so peers notice at
 * once (cause MEMBER_LEFT), then stops the driver. Bounded by the etcd
 * timeout. */
rdzv_err rdzv_leave(rdzv *r);

/* Stops the driver and frees everything; does not revoke the lease (a crash
 * is simulated by never calling leave: the lease then expires). With a
 * hold still out, the last rdzv_release frees instead. */
void rdzv_close(rdzv *r);

/* Keeps r's memory for a thread that reports on it (rdzv_report_*,
 * rdzv_finish) after its owner may have closed it; each hold is ended by
 * one rdzv_release. */
void rdzv_hold(rdzv *r);
void rdzv_release(rdzv *r);

/* Seconds this handle has spent between asking for a round and holding it. */
double rdzv_seconds_in_rendezvous(const rdzv *r);
/* How many members of this node's round its sentinel watches now: the
 * connections to their liveness probes it holds (docs/design.md, "A pod
 * lost, seen by its peers' agents"). */
int rdzv_watching(rdzv *r);

/* What this handle has cost etcd so far (docs/design.md, "Requests"): the
 * requests of all its connections (driver, caller, reports, keep-alive,
 * watches) by kind, the protocol steps its driver took (each reads one
 * snapshot) and how many of them found the round record moved under them
 * (a guard that failed: read again). */
typedef struct rdzv_counts {
    etcd_counts etcd;
    uint64_t steps;
    uint64_t moved;
} rdzv_counts;
void rdzv_get_counts(rdzv *r, rdzv_counts *out);

/* ---- job status (for `ductile-agent status`) ---- */

typedef struct rdzv_status {
    int64_t round;        /* current round number, 0 if none yet */
    char round_state[16]; /* "open", "frozen" or "" */
    int nmembers;
    rdzv_member *members; /* of the current round, by rank */
    int nnodes;           /* live nodes (registered) */
    char **nodes;
    int nwaiting; /* nodes waiting for a round with room */
    char **waiting;
    int64_t restarts;
    int max_restarts;
    char job_state[16];        /* "running", "done", "failed" or "none" */
    char reason[RDZV_MSG_MAX]; /* why it failed, if it did */
    /* the install id the job's state records, or "" */
    char install[RDZV_INSTALL_ID_MAX + 1];
} rdzv_status;

rdzv_err rdzv_get_status(const rdzv_etcd *etcd, const char *job, rdzv_status *out, char *msg);
void rdzv_status_free(rdzv_status *s);
/* The status as one JSON object (malloc'd string). */
char *rdzv_status_json(const rdzv_status *s);

/* Deletes every key of job `job` (/ductile/<job>/): its record, state,
 * restart count and rounds, so that the id starts over as a new job. Nothing
 * is deleted while a node is registered (an agent of the job is alive):
 * then *live (may be NULL) is their number and the result RDZV_OK with
 * *deleted 0. *deleted (may be NULL) counts the keys removed. */
rdzv_err rdzv_reset(const rdzv_etcd *etcd, const char *job, int *live, int64_t *deleted, char *msg);

/* rdzv_reset() for an agent of a new install that meets the job's end from
 * an earlier one (RDZV_ERR_JOB_ENDED_ELSEWHERE): deletes the job's keys only
 * while its state still records an end under an install id other than
 * install_id, and no node is registered (*live counts them). The delete is
 * one txn guarded by the state key's revision, so of agents that start
 * together one deletes and the others delete nothing (they then find the
 * job new or running). *deleted counts the keys removed (0: nothing done);
 * msg says what the job's end was, when keys were deleted. */
rdzv_err rdzv_start_over(const rdzv_etcd *etcd, const char *job, const char *install_id, int *live,
                         int64_t *deleted, char *msg);

/* ---- the round store: /ductile/<job>/rounds/<N>/store/<key> ---- */

typedef struct rdzv_store rdzv_store;

rdzv_err rdzv_store_open(const rdzv_etcd *etcd, const char *job, int64_t round, rdzv_store **out);
void rdzv_store_close(rdzv_store *s);
/* Writes are fenced: they fail with RDZV_ERR_FENCED once a later round exists. */
rdzv_err rdzv_store_set(rdzv_store *s, const char *key, const void *value, size_t len);
/* *value is malloc'd (NUL-terminated beyond len); RDZV_ERR_NOT_FOUND if absent. */
rdzv_err rdzv_store_get(rdzv_store *s, const char *key, void **value, size_t *len);
/* Waits (watch, not polling) for the key to exist, up to timeout_ms. */
rdzv_err rdzv_store_wait(rdzv_store *s, const char *key, int timeout_ms, void **value, size_t *len);
/* Atomic add on a decimal counter (created at 0); *value is the result. */
rdzv_err rdzv_store_add(rdzv_store *s, const char *key, int64_t delta, int64_t *value);
/* Returns once `count` participants have entered barrier `name`, or times out. */
rdzv_err rdzv_store_barrier(rdzv_store *s, const char *name, int count, int timeout_ms);
/* RDZV_OK while the store's round is the job's current round, else FENCED. */
rdzv_err rdzv_store_check(rdzv_store *s);
/* Detail of the last error on this store ("" if none). */
const char *rdzv_store_last_error(const rdzv_store *s);

#endif
