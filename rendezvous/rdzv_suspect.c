/* rdzv_suspect.c: whose loss is it, when a worker's peer vanishes.
 *
 * A pod that dies takes its agent and its workers at once; its peers'
 * workers see their connections reset within milliseconds, long before its
 * lease ends. Their agents ask (rdzv_check_members) whether a member's
 * agent is gone: its registration is missing or another incarnation's, or
 * its liveness probe (probe.c) is refused, which only happens when no
 * process holds the port any more. Such a member's lease is revoked: every
 * agent sees it lost now, not a lease TTL later, and the surviving worker's
 * error is a membership change, not a failure. Silence proves nothing (a
 * stopped agent, a partition): a member that does not answer is left to
 * its lease, so a live node is never cut off by a guess.
 */
#include "rdzv_internal.h"

#include "ductile/clock.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

/* One member's verdict: 1 gone (its lease, if any, in *lease), 0 not. */
static int member_gone(rdzv *r, const char *node, int64_t deadline, int64_t *lease, char *why,
                       size_t len)
{
    char key[RDZV_KEY_MAX];
    *lease = 0;
    if (rdzv_key(key, sizeof(key), r->cfg.job, "nodes/%s", node) != 0) return 0;
    etcd_kv kv;
    pthread_mutex_lock(&r->rep_mu);
    etcd_err e = etcd_get(r->rep, key, &kv);
    pthread_mutex_unlock(&r->rep_mu);
    if (e == ETCD_ERR_NOT_FOUND) {
        snprintf(why, len, "its registration is gone");
        return 1;
    }
    if (e != ETCD_OK) return 0; /* etcd cannot say: nothing is judged */
    rdzv_reg reg;
    rdzv_reg_parse(&kv, &reg);
    *lease = kv.lease;
    etcd_kv_free(&kv);
    int64_t left = deadline - mono_now_ms();
    if (left <= 0) return 0;
    rdzv_probe_verdict v =
        rdzv_probe_check(reg.addr, reg.probe, node, reg.inc, (int)left, why, len);
    return v == RDZV_PROBE_DEAD;
}

int rdzv_check_member(rdzv *r, const char *node, int64_t deadline, int *revoked, char *why,
                      size_t len)
{
    int64_t lease;
    if (revoked) *revoked = 0;
    if (!member_gone(r, node, deadline, &lease, why, len)) return 0;
    if (lease) {
        if (revoked) *revoked = 1;
        pthread_mutex_lock(&r->rep_mu);
        etcd_err e = etcd_lease_revoke(r->rep, lease);
        pthread_mutex_unlock(&r->rep_mu);
        dlog_debug(&r->log, NULL, "member %s is gone (%s): lease %lld revoked: %s", node, why,
                   (long long)lease, etcd_strerror(e));
    }
    return 1;
}

rdzv_err rdzv_check_members(rdzv *r, const char *const *nodes, int n, int timeout_ms, int *gone,
                            char *names, size_t len)
{
    *gone = 0;
    if (names && len) names[0] = '\0';
    pthread_mutex_lock(&r->mu);
    int closed = r->closed;
    pthread_mutex_unlock(&r->mu);
    if (closed) return RDZV_ERR_CLOSED;
    int64_t deadline = mono_now_ms() + timeout_ms;
    size_t used = 0;
    for (int i = 0; i < n; i++) {
        char why[RDZV_MSG_MAX] = "";
        if (!rdzv_check_member(r, nodes[i], deadline, NULL, why, sizeof(why))) continue;
        (*gone)++;
        if (names && used < len) {
            int w =
                snprintf(names + used, len - used, "%s%s (%s)", used ? ", " : "", nodes[i], why);
            if (w > 0) used += (size_t)w;
        }
    }
    return RDZV_OK;
}
