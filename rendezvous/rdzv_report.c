/* rdzv_report.c: failures and the end of the job, from any thread.
 *
 * A report is a read-decide-write loop on the round record: read it, decide
 * by the failure-counting rule (rdzv.h) whether this report opens the next
 * round, counts a restart or fails the job, and write that in a txn guarded
 * by the record's mod_revision. A lost race, or an etcd error that may or
 * may not have applied the write, just reads again: the record itself says
 * whether the write landed, so one failure is never counted twice.
 *
 * Reports use a client and a lock of their own (rep, rep_mu), not the
 * caller's (api, api_mu): an agent makes them on a thread of its own, and
 * one stalled on etcd must not hold up its leave.
 */
#include "rdzv_internal.h"

#include "ductile/clock.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* How long a report or finish keeps trying: past the lease TTL this node
 * is out of the job anyway, and the rejoin path takes over. */
static int64_t report_deadline(const rdzv *r)
{
    int64_t t = r->etcd.timeout_ms ? r->etcd.timeout_ms : 5000;
    int64_t ttl = (int64_t)r->cfg.lease_ttl_s * 1000;
    return mono_now_ms() + (ttl > t ? ttl : t);
}

/* After an etcd error: 1 to try again (after a pause), 0 when the deadline
 * has passed. */
static int retry_pause(int64_t deadline, int *backoff_ms)
{
    if (mono_now_ms() + *backoff_ms > deadline) return 0;
    struct timespec ts = {.tv_sec = *backoff_ms / 1000, .tv_nsec = (*backoff_ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    *backoff_ms = *backoff_ms < 400 ? *backoff_ms * 2 : 500;
    return 1;
}

typedef enum { WRITE_NONE, WRITE_NEXT_ROUND, WRITE_SAME_ROUND } report_write;

/* Decides what one report does (see rdzv.h, the failure-counting rule).
 * WRITE_NONE: nothing to write (the round already ended, or was counted).
 * WRITE_SAME_ROUND: *rec itself was updated (a count added to the current
 * round, or the job failed). WRITE_NEXT_ROUND: *next is the next round.
 * *count is 1 when the report uses a restart. */
static report_write plan_report(const rdzv *r, int64_t mine, int first_hand, const char *reason,
                                rdzv_record *rec, rdzv_record *next, int *count)
{
    *count = 0;
    memset(next, 0, sizeof(*next));
    if (mine == 0 || rec->counted >= mine) return WRITE_NONE;
    int same = rec->number == mine;
    if (!first_hand && !same) return WRITE_NONE; /* whoever ended it decided */
    uint64_t members = rdzv_record_members_hash(rec);
    int again = !first_hand && strcmp(rec->cause, rdzv_cause_name(RDZV_CAUSE_PEER_LOST)) == 0 &&
                rec->peer_lost_of == members;
    *count = first_hand || again;
    if (*count && rec->restarts + 1 > rec->max_restarts) {
        /* Same round, job failed: every driver reports JOB_FAILED. */
        rec->restarts++;
        rec->counted = mine;
        snprintf(rec->job, sizeof(rec->job), "failed");
        snprintf(rec->reason, sizeof(rec->reason),
                 "restart limit reached (%lld > max_restarts %d); last failure on %s: %s",
                 (long long)rec->restarts, rec->max_restarts, r->node, reason);
        return WRITE_SAME_ROUND;
    }
    if (!same) {
        /* The round ended uncounted (a peer saw this crash first) before
         * this first-hand report came: the count goes on the current round. */
        rec->restarts++;
        rec->counted = mine;
        /* The lost peer that ended it was this crash, now counted: it is
         * no grounds to count the next lost peer of these members too. */
        rec->peer_lost_of = 0;
        return WRITE_SAME_ROUND;
    }
    next->number = rec->number + 1;
    rdzv_record_carry(rec, next);
    next->peer_lost_of = 0;
    if (*count) {
        next->restarts = rec->restarts + 1;
        next->counted = mine;
    } else {
        next->peer_lost_of = members;
    }
    rdzv_cause cause = *count ? RDZV_CAUSE_FAILURE : RDZV_CAUSE_PEER_LOST;
    snprintf(next->job, sizeof(next->job), "running");
    snprintf(next->cause, sizeof(next->cause), "%s", rdzv_cause_name(cause));
    snprintf(next->cause_node, sizeof(next->cause_node), "%s", r->node);
    if (again)
        snprintf(next->reason, sizeof(next->reason),
                 "peer lost again on %s with the same members (counted): %s", r->node, reason);
    else
        snprintf(next->reason, sizeof(next->reason), "%s on %s: %s",
                 first_hand ? "failure" : "peer lost", r->node, reason);
    return WRITE_NEXT_ROUND;
}

static rdzv_err report(rdzv *r, int first_hand, const char *reason, int64_t *restarts, int *counted)
{
    if (!r) return RDZV_ERR_ARG;
    if (!reason) reason = "";
    if (counted) *counted = 0;
    /* The round is the one this node is in when the report is asked for,
     * not when an earlier report stalled on etcd lets it through. */
    pthread_mutex_lock(&r->mu);
    int64_t mine = r->member_round;
    int closed = r->closed;
    pthread_mutex_unlock(&r->mu);
    pthread_mutex_lock(&r->rep_mu);
    rdzv_err err = RDZV_ERR_CLOSED;
    if (closed) goto out;
    int64_t deadline = report_deadline(r);
    int backoff = 50;
    for (;;) {
        rdzv_record rec, next;
        int64_t mod = 0;
        int have = 0, count = 0, won = 0;
        err = rdzv_read_round(r, r->rep, &rec, &mod, &have);
        if (err == RDZV_OK && !have) err = RDZV_ERR_PROTOCOL;
        if (err == RDZV_ERR_ETCD && retry_pause(deadline, &backoff)) continue;
        if (err != RDZV_OK) goto out;
        if (restarts) *restarts = rec.restarts;
        if (strcmp(rec.job, "running") != 0) {
            err = strcmp(rec.job, "done") == 0 ? RDZV_ERR_JOB_DONE : RDZV_ERR_JOB_FAILED;
            rdzv_record_free(&rec);
            goto out;
        }
        report_write w = plan_report(r, mine, first_hand, reason, &rec, &next, &count);
        char *st = NULL;
        if (w == WRITE_NEXT_ROUND) {
            err = rdzv_record_copy_order(&rec, &next);
            if (err == RDZV_OK) err = rdzv_put_record(r, r->rep, &next, mod, 1, NULL, &won);
        } else if (w == WRITE_SAME_ROUND) {
            int failed = strcmp(rec.job, "failed") == 0;
            if (failed && !(st = rdzv_state_json(r, "failed", rec.reason))) err = RDZV_ERR_NOMEM;
            if (err == RDZV_OK) err = rdzv_put_record(r, r->rep, &rec, mod, 0, st, &won);
        }
        int64_t total = w == WRITE_NEXT_ROUND ? next.restarts : rec.restarts;
        int job_failed = strcmp(rec.job, "failed") == 0;
        free(st);
        rdzv_record_free(&next);
        rdzv_record_free(&rec);
        if (w == WRITE_NONE) goto out; /* RDZV_OK: already ended, or already counted */
        /* Unavailable or ambiguous (it may have been applied): read again,
         * and the record says whether it was. */
        if (err == RDZV_ERR_ETCD && retry_pause(deadline, &backoff)) continue;
        if (err != RDZV_OK) goto out;
        if (won) {
            if (restarts) *restarts = total;
            if (counted) *counted = count;
            if (job_failed) err = RDZV_ERR_JOB_FAILED;
            goto out;
        }
        if (mono_now_ms() > deadline) {
            err = RDZV_ERR_TIMEOUT;
            goto out;
        }
    }
out:
    pthread_mutex_unlock(&r->rep_mu);
    return err;
}

rdzv_err rdzv_report_failure(rdzv *r, const char *reason, int64_t *restarts)
{
    return report(r, 1, reason, restarts, NULL);
}

rdzv_err rdzv_report_peer_lost(rdzv *r, const char *reason, int64_t *restarts, int *counted)
{
    return report(r, 0, reason, restarts, counted);
}

rdzv_err rdzv_finish(rdzv *r)
{
    if (!r) return RDZV_ERR_ARG;
    pthread_mutex_lock(&r->mu);
    int closed = r->closed;
    pthread_mutex_unlock(&r->mu);
    pthread_mutex_lock(&r->rep_mu);
    rdzv_err err = RDZV_ERR_CLOSED;
    if (closed) goto out;
    int64_t deadline = report_deadline(r);
    int backoff = 50;
    char *st = rdzv_state_json(r, "done", "");
    if (!st) {
        err = RDZV_ERR_NOMEM;
        goto out;
    }
    for (;;) {
        rdzv_record rec;
        int64_t mod = 0;
        int have = 0, won = 0;
        err = rdzv_read_round(r, r->rep, &rec, &mod, &have);
        if (err == RDZV_OK && !have) err = RDZV_ERR_PROTOCOL;
        if (err == RDZV_ERR_ETCD && retry_pause(deadline, &backoff)) continue;
        if (err != RDZV_OK) break;
        if (strcmp(rec.job, "running") != 0) {
            err = strcmp(rec.job, "done") == 0 ? RDZV_OK : RDZV_ERR_JOB_FAILED;
            rdzv_record_free(&rec);
            break;
        }
        snprintf(rec.job, sizeof(rec.job), "done");
        err = rdzv_put_record(r, r->rep, &rec, mod, 0, st, &won);
        rdzv_record_free(&rec);
        /* Ambiguous or unavailable: the next read says whether it landed. */
        if (err == RDZV_ERR_ETCD && retry_pause(deadline, &backoff)) continue;
        if (err != RDZV_OK || won) break;
        if (mono_now_ms() > deadline) {
            err = RDZV_ERR_TIMEOUT;
            break;
        }
    }
    free(st);
out:
    pthread_mutex_unlock(&r->rep_mu);
    return err;
}
