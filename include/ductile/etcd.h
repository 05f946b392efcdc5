/* etcd.h: a small etcd v3 client over the HTTP/JSON gateway (/v3/...).
 *
 * Every call is one HTTP POST made with libcurl; bodies are JSON (cJSON),
 * keys and values travel base64-encoded, and 64-bit fields (revisions, lease
 * ids) arrive as JSON strings and are parsed as integers, never as doubles.
 * A client holds several endpoints and fails over between them; every call
 * has a deadline, and only transient errors (connection refused or reset,
 * 5xx, "unavailable") are retried, with backoff, until that deadline. A put,
 * delete or writing txn whose connection broke after it was sent, or that
 * etcd timed out after proposing it, is not sent again (it may have been
 * applied): it returns ETCD_ERR_UNAVAILABLE ("may have been applied" in
 * etcd_last_error) and the caller re-reads before deciding.
 *
 * Every call, unary or watch, requires a leader (clientv3's
 * WithRequireLeader): a member cut off from its peers answers "no leader"
 * at once, before acting, instead of serving a stale read or holding a
 * write until it times out, and the call goes on to the next endpoint
 * (safe for a write too: it was never proposed).
 *
 * A client is used by one thread at a time. A watch is its own object with
 * its own connection, so one thread can block on a watch while another uses
 * the client.
 */
#ifndef DUCTILE_ETCD_H
#define DUCTILE_ETCD_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    ETCD_OK = 0,
    ETCD_ERR_ARG,         /* invalid argument (bad endpoint URL, empty key, ...) */
    ETCD_ERR_NOMEM,       /* out of memory */
    ETCD_ERR_UNAVAILABLE, /* no endpoint could be reached before the deadline */
    ETCD_ERR_TIMEOUT,     /* the deadline passed while a request was in flight */
    ETCD_ERR_PROTOCOL,    /* the answer was not what the gateway sends (malformed) */
    ETCD_ERR_TOO_LARGE,   /* request or answer over the size limit */
    ETCD_ERR_SERVER,      /* etcd answered with an error (see etcd_last_error) */
    ETCD_ERR_AUTH,        /* authentication failed or permission denied */
    ETCD_ERR_NOT_FOUND,   /* lease not found (expired or revoked) */
    ETCD_ERR_COMPACTED,   /* a watch's start revision has been compacted away */
    ETCD_ERR_CANCELED,    /* a watch was canceled (by the server or etcd_watch_wakeup) */
    ETCD_ERR_TLS,         /* TLS setup or handshake failed */
} etcd_err;

const char *etcd_strerror(etcd_err err);

/* The longest message the client keeps, NUL included: etcd_last_error and
 * etcd_watch_last_error are at most this long, and an err buffer of this
 * size holds etcd_client_new_err's reason whole. */
#define ETCD_MSG_MAX 512

typedef struct etcd_config {
    const char *endpoints; /* "http://127.0.0.1:2379,https://h:2379"; bare host:port means http */
    const char *cacert;    /* PEM file to verify the server, or NULL */
    const char *cert;      /* client certificate (PEM), or NULL */
    const char *key;       /* client key (PEM), or NULL */
    const char *user;      /* user name for etcd auth, or NULL */
    const char *password;
    int timeout_ms; /* deadline of one call, retries included; 0 means 5000 */
} etcd_config;

typedef struct etcd_client etcd_client;

/* libcurl's global initialisation, as the client needs it: call it before
 * starting threads when the process also uses libcurl itself (it pairs with
 * curl_global_cleanup); etcd_client_new calls it once otherwise.
 * ETCD_ERR_NOMEM when libcurl cannot initialise. */
etcd_err etcd_global_init(void);

etcd_err etcd_client_new(const etcd_config *cfg, etcd_client **out);
/* The same, and on failure writes a one-line reason into err (may be NULL). */
etcd_err etcd_client_new_err(const etcd_config *cfg, etcd_client **out, char *err, size_t errlen);
void etcd_client_free(etcd_client *c);
/* Detail of the last failed call on this client, for logs ("" if none). */
const char *etcd_last_error(const etcd_client *c);
/* Change the deadline of later calls (0 restores the configured one). */
void etcd_set_timeout(etcd_client *c, int timeout_ms);
/* Names the client for failpoints (failpoint.h): each call that gets past
 * its argument checks counts once (not once per retry) as failpoint
 * etcd.<name>.<op>, op one of range (etcd_get too), put, delete, txn,
 * lease_grant, keepalive, lease_revoke, watch (etcd_watch_open; a watch
 * takes its client's name). "unavailable" fails the call unsent;
 * "ambiguous" sends it and drops the answer (ETCD_ERR_UNAVAILABLE, "may
 * have been applied (failpoint)"). NULL or "" means "client", the default. */
void etcd_client_set_name(etcd_client *c, const char *name);

/* Requests sent, by kind: every HTTP request a client (and the watches
 * opened on it) sends, retries included, so the figure is what etcd
 * served. A watch counts once per stream opened (a resumed watch again). */
typedef enum {
    ETCD_REQ_RANGE,
    ETCD_REQ_PUT,
    ETCD_REQ_DELETE,
    ETCD_REQ_TXN,
    ETCD_REQ_LEASE_GRANT,
    ETCD_REQ_KEEPALIVE,
    ETCD_REQ_LEASE_REVOKE,
    ETCD_REQ_WATCH,
    ETCD_REQ_OTHER, /* auth, compaction, member list */
    ETCD_REQ_KINDS,
} etcd_req_kind;

typedef struct etcd_counts {
    uint64_t n[ETCD_REQ_KINDS];
    uint64_t answer_bytes; /* of the answers to unary calls (not watch streams) */
    uint64_t finished;     /* unary requests that got an answer or failed: the others
                            * but watches are still in flight */
} etcd_counts;

const char *etcd_req_kind_name(etcd_req_kind kind);
/* Adds every later request of c, and of the watches opened on it, to
 * *counts (atomically: clients of several threads may share one); NULL
 * stops counting. counts must outlive c and its watches. */
void etcd_client_count_into(etcd_client *c, etcd_counts *counts);
/* A consistent-enough copy of counts that other threads are adding to. */
void etcd_counts_read(const etcd_counts *counts, etcd_counts *out);
uint64_t etcd_counts_total(const etcd_counts *counts);

typedef struct etcd_kv {
    char *key;   /* NUL-terminated; keys here are text */
    char *value; /* NUL-terminated copy too, value_len excludes the NUL */
    size_t value_len;
    int64_t create_revision;
    int64_t mod_revision;
    int64_t version;
    int64_t lease;
} etcd_kv;

typedef struct etcd_range_result {
    etcd_kv *kvs;
    size_t n;
    int64_t count;    /* total matching keys (may exceed n when limited) */
    int more;         /* 1 when a limit cut the answer */
    int64_t revision; /* store revision at which the range was served */
} etcd_range_result;

void etcd_range_result_free(etcd_range_result *r);

/* Range: one key (prefix = 0) or every key starting with key (prefix = 1),
 * sorted by key. limit 0 means no limit. */
etcd_err etcd_range(etcd_client *c, const char *key, int prefix, int64_t limit,
                    etcd_range_result *out);
/* Convenience: one key's value; ETCD_ERR_NOT_FOUND if the key is absent. */
etcd_err etcd_get(etcd_client *c, const char *key, etcd_kv *out);
void etcd_kv_free(etcd_kv *kv);

/* Put with an optional lease (0 for none). *revision (may be NULL) is the
 * store revision after the put. */
etcd_err etcd_put(etcd_client *c, const char *key, const void *value, size_t len, int64_t lease,
                  int64_t *revision);
/* Delete one key or a prefix; *deleted (may be NULL) counts keys removed. */
etcd_err etcd_delete(etcd_client *c, const char *key, int prefix, int64_t *deleted);

typedef enum {
    ETCD_CMP_VERSION,
    ETCD_CMP_CREATE, /* create_revision */
    ETCD_CMP_MOD,    /* mod_revision */
    ETCD_CMP_VALUE,
    ETCD_CMP_LEASE,
} etcd_cmp_target;

typedef enum {
    ETCD_CMP_EQUAL,
    ETCD_CMP_GREATER,
    ETCD_CMP_LESS,
    ETCD_CMP_NOT_EQUAL,
} etcd_cmp_op;

typedef struct etcd_cmp {
    const char *key;
    etcd_cmp_target target;
    etcd_cmp_op op;
    int64_t number;    /* for VERSION / CREATE / MOD / LEASE */
    const void *value; /* for VALUE */
    size_t value_len;
} etcd_cmp;

typedef enum { ETCD_OP_RANGE, ETCD_OP_PUT, ETCD_OP_DELETE } etcd_op_type;

/* The order of a RANGE op's keys: by key (the default), or by
 * create_revision. */
typedef enum { ETCD_SORT_KEY, ETCD_SORT_CREATE_ASCEND, ETCD_SORT_CREATE_DESCEND } etcd_sort;

typedef struct etcd_op {
    etcd_op_type type;
    const char *key;
    int prefix;                  /* RANGE and DELETE: whole prefix */
    int count_only;              /* RANGE: only the count of matching keys (no kvs) */
    int keys_only;               /* RANGE: kvs without their values */
    int64_t limit;               /* RANGE: at most this many keys after sorting (0: all) */
    etcd_sort sort;              /* RANGE */
    int64_t max_create_revision; /* RANGE: only keys created at or before it (0: any); the
                                  * count still counts every key of the range */
    const void *value;           /* PUT */
    size_t value_len;
    int64_t lease; /* PUT */
} etcd_op;

typedef struct etcd_txn_result {
    int succeeded;             /* 1 when every compare held and `then` ran */
    int64_t revision;          /* store revision after the txn */
    size_t n;                  /* one entry per op that ran */
    etcd_range_result *ranges; /* ranges[i] filled for RANGE ops, empty otherwise */
} etcd_txn_result;

void etcd_txn_result_free(etcd_txn_result *r);

/* At most 128 operations in all (etcd's limit). out may be NULL. */
etcd_err etcd_txn(etcd_client *c, const etcd_cmp *cmps, size_t ncmp, const etcd_op *then,
                  size_t nthen, const etcd_op *els, size_t nels, etcd_txn_result *out);

/* Leases. keepalive returns ETCD_ERR_NOT_FOUND once the lease is gone;
 * *ttl_left (may be NULL) is the TTL granted by that renewal. */
etcd_err etcd_lease_grant(etcd_client *c, int64_t ttl_s, int64_t *id);
etcd_err etcd_lease_keepalive(etcd_client *c, int64_t id, int64_t *ttl_left);
etcd_err etcd_lease_revoke(etcd_client *c, int64_t id);

/* Watch: one long-lived stream of events for a key or prefix (or for a
 * few of them at once: etcd_watch_open_set), in revision order for each.
 * start_revision 0 means "from now". A broken stream is resumed from the
 * revision after the last event seen of each key, on any endpoint;
 * compaction of that revision is reported as ETCD_ERR_COMPACTED
 * (etcd_watch_revision then tells the compact revision). Watches require a leader (clientv3's
 * WithRequireLeader): a member cut off from its peers cancels the stream
 * ("no leader") instead of going silent, and the watch resumes on the next
 * endpoint. */
typedef enum { ETCD_EVENT_PUT, ETCD_EVENT_DELETE } etcd_event_type;

typedef struct etcd_event {
    etcd_event_type type;
    etcd_kv kv; /* for DELETE: key and mod_revision only */
    int watch;  /* which key of the watch it is for: its index in etcd_watch_open_set */
} etcd_event;

typedef struct etcd_watch etcd_watch;

etcd_err etcd_watch_open(etcd_client *c, const char *key, int prefix, int64_t start_revision,
                         etcd_watch **out);
/* One key or prefix of a watch set. */
typedef struct etcd_watch_key {
    const char *key;
    int prefix;
    int64_t start_revision; /* 0: from now */
} etcd_watch_key;
#define ETCD_WATCH_MAX_KEYS 8
/* n (1 to ETCD_WATCH_MAX_KEYS) watches on one stream: one connection, one
 * "created" wait; each event's `watch` is the index of its key in keys.
 * Events of one key come in revision order; those of different keys in
 * the order etcd sent them. */
etcd_err etcd_watch_open_set(etcd_client *c, const etcd_watch_key *keys, size_t n,
                             etcd_watch **out);
/* The revision key i would resume from: the one after its last event
 * queued, or its start (0 while a watch "from now" is not yet created). */
int64_t etcd_watch_next_revision(const etcd_watch *w, size_t i);
/* Waits up to timeout_ms for events. ETCD_OK with *n == 0 means the time
 * passed with none. The caller frees *events with etcd_events_free.
 * ETCD_ERR_UNAVAILABLE: the stream has been down for longer than the
 * client's timeout (the watch keeps trying; call again). ETCD_ERR_PROTOCOL /
 * ETCD_ERR_TOO_LARGE: a bad message was dropped, the stream resumes after the
 * last good event. COMPACTED, CANCELED, AUTH, TLS: the watch is over. */
etcd_err etcd_watch_next(etcd_watch *w, int timeout_ms, etcd_event **events, size_t *n);
void etcd_events_free(etcd_event *events, size_t n);
/* Revision the watch will resume after (the last event's revision, of any
 * key, or the compact revision after ETCD_ERR_COMPACTED). */
int64_t etcd_watch_revision(const etcd_watch *w);
/* Thread-safe: makes a blocked etcd_watch_next return ETCD_OK with no events. */
void etcd_watch_wakeup(etcd_watch *w);
const char *etcd_watch_last_error(const etcd_watch *w);
void etcd_watch_close(etcd_watch *w);

#endif
