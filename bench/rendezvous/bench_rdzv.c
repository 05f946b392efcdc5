/* bench_rdzv: how long the rendezvous takes, next to what etcd itself costs.
 *
 *   bench_rdzv [N ...]      (default 8 64 256)
 *
 * Participants are light processes (rdzv_participant, one rdzv handle each)
 * against one private etcd on this machine. Figures:
 *   - form N: from the first participant started to the last one holding its
 *     rank (min = max = N). Baseline: N sequential puts by one client, the
 *     raw etcd round trips a join has to pay at least once per node.
 *   - kill: SIGKILL of one of 8 members to the last survivor holding its
 *     rank in the next round. Baseline: the lease TTL, the bound on noticing
 *     a silent death.
 *   - leave: a clean leave to the survivors' next round. Baseline: one put
 *     seen through a watch (txn + watch notification).
 * Each change is timed twice: until every survivor has noticed (ROUND_ENDED)
 * and until every survivor holds its rank in the next round (FROZEN).
 * Times use CLOCK_MONOTONIC stamps printed by the participants themselves,
 * so reading their pipes late does not count.
 */
#include "ductile/clock.h"
#include "ductile/etcd.h"
#include "test_etcd.h"
#include "test_rdzv_procs.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#ifndef RDZV_PARTICIPANT
#error "RDZV_PARTICIPANT must name the participant program"
#endif

#define KILL_TTL 3
#define LINE 8192

static etcd_client *connect_etcd(const char *endpoint)
{
    etcd_config cfg = {.endpoints = endpoint};
    etcd_client *c = NULL;
    if (etcd_client_new(&cfg, &c) != ETCD_OK) return NULL;
    return c;
}

/* Seconds for n sequential puts. */
static double baseline_puts(etcd_client *c, int n)
{
    char key[64];
    double t0 = mono_now_s();
    for (int i = 0; i < n; i++) {
        snprintf(key, sizeof(key), "/bench/put/%d", i);
        if (etcd_put(c, key, "x", 1, 0, NULL) != ETCD_OK) return -1;
    }
    return mono_now_s() - t0;
}

/* Seconds from a put to its event arriving on a watch (median of 5). */
static double baseline_notify(etcd_client *c, const char *endpoint)
{
    etcd_client *wc = connect_etcd(endpoint);
    etcd_watch *w = NULL;
    double best[5];
    int n = 0;
    if (!wc || etcd_watch_open(wc, "/bench/notify", 0, 0, &w) != ETCD_OK) goto out;
    for (int i = 0; i < 5; i++) {
        double t0 = mono_now_s();
        if (etcd_put(c, "/bench/notify", "x", 1, 0, NULL) != ETCD_OK) break;
        etcd_event *evs = NULL;
        size_t k = 0;
        if (etcd_watch_next(w, 5000, &evs, &k) != ETCD_OK || k == 0) break;
        etcd_events_free(evs, k);
        best[n++] = mono_now_s() - t0;
    }
out:
    if (w) etcd_watch_close(w);
    etcd_client_free(wc);
    if (n == 0) return -1;
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && best[j] < best[j - 1]; j--) {
            double t = best[j];
            best[j] = best[j - 1];
            best[j - 1] = t;
        }
    return best[n / 2];
}

/* Latest "t=" over the next `word` line of each listed process, or -1. */
static double last_line(tp_set *s, const int *ids, int n, const char *word, int timeout_ms)
{
    double latest = 0;
    char line[LINE];
    for (int k = 0; k < n; k++) {
        if (tp_expect(s, ids[k], word, timeout_ms, line, sizeof(line)) != 0) return -1;
        char t[64];
        tp_field(line, "t", t, sizeof(t));
        double v = atof(t);
        if (v > latest) latest = v;
    }
    return latest;
}

static void row(const char *what, double ours, const char *base_name, double base)
{
    if (ours < 0 || base <= 0) {
        printf("| %-30s | %10s | %-34s | %10s | %7s |\n", what, "FAILED", base_name, "-", "-");
        return;
    }
    printf("| %-30s | %8.3f s | %-34s | %8.3f s | %6.1fx |\n", what, ours, base_name, base,
           ours / base);
}

static int form(const char *endpoint, int n, double *secs, double *after_reg)
{
    char job[32], opts[256], node[32];
    snprintf(job, sizeof(job), "form-%d", n);
    snprintf(opts, sizeof(opts),
             "--min %d --max %d --last-call-ms 60000 --ttl 30 "
             "--join-timeout-ms 300000 --etcd-timeout-ms 20000",
             n, n);
    tp_set s;
    tp_init(&s, RDZV_PARTICIPANT, endpoint, job);
    int *ids = calloc((size_t)n, sizeof(int));
    if (!ids) return -1;
    double t0 = mono_now_s();
    for (int i = 0; i < n; i++) {
        snprintf(node, sizeof(node), "n%03d", i);
        ids[i] = tp_spawn(&s, node, opts);
    }
    double treg = last_line(&s, ids, n, "OPEN", 300000);
    double t1 = last_line(&s, ids, n, "FROZEN", 300000);
    *secs = t1 > 0 ? t1 - t0 : -1;
    *after_reg = t1 > 0 && treg > 0 ? t1 - treg : -1;
    int ok = t1 > 0 && tp_check_agreement(&s) == 0;
    for (int i = 0; i < n; i++)
        tp_send(&s, ids[i], "close");
    tp_free(&s);
    free(ids);
    return ok ? 0 : -1;
}

/* 8 members; one dies (kill) or leaves; seconds to the survivors' round. */
static int change(const char *endpoint, int do_kill, double *noticed, double *secs)
{
    enum { N = 8 };
    char opts[256], node[32];
    snprintf(opts, sizeof(opts), "--min 2 --max %d --last-call-ms 100 --ttl %d", N,
             do_kill ? KILL_TTL : 30);
    tp_set s;
    tp_init(&s, RDZV_PARTICIPANT, endpoint, do_kill ? "kill" : "leave");
    int ids[N];
    for (int i = 0; i < N; i++) {
        snprintf(node, sizeof(node), "m%d", i);
        ids[i] = tp_spawn(&s, node, opts);
    }
    int rc = -1;
    *secs = *noticed = -1;
    if (last_line(&s, ids, N, "FROZEN", 60000) > 0) {
        double t0 = mono_now_s();
        if (do_kill)
            tp_kill(&s, ids[3], SIGKILL);
        else
            tp_send(&s, ids[3], "leave");
        int rest[N - 1], m = 0;
        for (int i = 0; i < N; i++)
            if (i != 3) rest[m++] = ids[i];
        double t1 = last_line(&s, rest, m, "ENDED", 60000);
        double t2 = last_line(&s, rest, m, "FROZEN", 60000);
        if (t1 > 0 && t2 > 0) {
            *noticed = t1 - t0;
            *secs = t2 - t0;
            rc = tp_check_agreement(&s);
        }
    }
    tp_free(&s);
    return rc;
}

int main(int argc, char **argv)
{
    int sizes[16] = {8, 64, 256}, nsizes = 3;
    if (argc > 1) {
        nsizes = 0;
        for (int i = 1; i < argc && nsizes < 16; i++)
            sizes[nsizes++] = atoi(argv[i]);
    }
    /* two pipes per participant */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    test_etcd e;
    if (test_etcd_start(&e) != 0) return 1;
    etcd_client *c = connect_etcd(e.endpoint);
    if (!c) {
        test_etcd_stop(&e);
        return 1;
    }
    int failed = 0;
    printf("rendezvous (participants are processes, one rdzv handle each; one etcd; "
           "this machine)\n");
    printf("| %-30s | %10s | %-34s | %10s | %7s |\n", "figure", "ours", "baseline", "baseline",
           "ratio");
    printf("|--------------------------------|------------|------------------------------------|"
           "------------|---------|\n");
    for (int i = 0; i < nsizes; i++) {
        int n = sizes[i];
        if (n < 1 || n > 256) continue;
        double secs = -1, after_reg = -1;
        failed |= form(e.endpoint, n, &secs, &after_reg) != 0;
        double base = baseline_puts(c, n);
        char what[64], bname[64];
        snprintf(what, sizeof(what), "form, N=%d", n);
        snprintf(bname, sizeof(bname), "%d sequential etcd puts", n);
        row(what, secs, bname, base);
        snprintf(what, sizeof(what), "  last register -> all, N=%d", n);
        row(what, after_reg, bname, base);
        fflush(stdout);
    }
    double noticed = -1, secs = -1;
    double notify = baseline_notify(c, e.endpoint);
    failed |= change(e.endpoint, 1, &noticed, &secs) != 0;
    char bname[64];
    snprintf(bname, sizeof(bname), "lease TTL (%d s)", KILL_TTL);
    row("SIGKILL -> all noticed, N=8", noticed, bname, (double)KILL_TTL);
    row("SIGKILL -> next round, N=8", secs, bname, (double)KILL_TTL);
    fflush(stdout);
    failed |= change(e.endpoint, 0, &noticed, &secs) != 0;
    row("leave -> all noticed, N=8", noticed, "put -> watch event (median of 5)", notify);
    row("leave -> next round, N=8", secs, "put -> watch event (median of 5)", notify);
    printf("(next round: survivors 7 < max 8, so it freezes after last call = 100 ms)\n");
    etcd_client_free(c);
    test_etcd_stop(&e);
    return failed ? 1 : 0;
}
