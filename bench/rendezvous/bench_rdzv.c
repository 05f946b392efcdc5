/* bench_rdzv: how long the rendezvous takes, what it costs etcd, next to
 * what etcd itself costs.
 *
 *   bench_rdzv [--go] [N ...]      (default 64 256 1024; at most 4096)
 *
 * Participants are light processes (rdzv_participant, one rdzv handle each)
 * against one private etcd on this machine. Figures:
 *   - form N: from the first participant started to the last one holding its
 *     rank (min = max = N). Baseline: N sequential puts by one client, the
 *     raw etcd round trips a join has to pay at least once per node.
 *     Split into what the harness costs and what the protocol costs:
 *     "spawn" is the bench forking N processes; "last open" is the last
 *     participant through rdzv_open (process start, exec, connect, lease,
 *     registration: on a machine with few cores, mostly process start);
 *     "last open -> all" is the protocol's part once every node is there.
 *     CPU seconds of the participants (all N together) and of etcd during
 *     the form say which of them the machine was busy with.
 *     With --go the participants start first (process, libcurl), each says
 *     READY and waits; the bench then tells all of them "go" at once, and
 *     "go -> all" is the protocol alone: N handles opened together (lease,
 *     registration, watches), joined, frozen, every one holding its rank;
 *     CPU is then counted from go: etcd's until the last one holds its
 *     rank, the participants' as each says its own (getrusage, every
 *     thread) at READY and when it holds its rank (/proc counts whole
 *     ticks per process, which rounds a participant's few ms away).
 *   - requests per participant (N = each size): every participant's etcd
 *     requests by kind from its start until all N hold their ranks and have
 *     taken their first step in the frozen round
 *     (rdzv_get_counts through the participant's "counts" command: every
 *     HTTP request of every connection of the handle, retries included;
 *     a watch counts once per stream), total / N, the most any one
 *     participant sent (the freezer), the driver's steps and its guards
 *     that failed (moved) per participant, and the KiB of answers to its
 *     unary calls (watch streams not included). The last line says whether the
 *     requests per join grow with N.
 *   - record to N watches (N = each size): etcd's CPU seconds to deliver one
 *     put of a value the size of a frozen round record of N members (64
 *     bytes a member) to N watches of its key, as every agent watches
 *     `round`. Baseline: the same N deliveries of a 64-byte value. What
 *     the record's size costs etcd per round, apart from the protocol.
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
#include <time.h>
#include <unistd.h>

#ifndef RDZV_PARTICIPANT
#error "RDZV_PARTICIPANT must name the participant program"
#endif

#define KILL_TTL 3
#define LINE 8192
#define MAX_N 4096
#define MAX_SIZES 16

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
static double last_line(tp_set *s, const int *ids, int n, const char *word, int timeout_ms,
                        double *cpu)
{
    double latest = 0;
    char line[LINE];
    if (cpu) *cpu = 0;
    for (int k = 0; k < n; k++) {
        if (tp_expect(s, ids[k], word, timeout_ms, line, sizeof(line)) != 0) return -1;
        char t[64];
        tp_field(line, "t", t, sizeof(t));
        double v = atof(t);
        if (v > latest) latest = v;
        if (cpu) {
            tp_field(line, "cpu", t, sizeof(t));
            *cpu += atof(t);
        }
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

/* What one form of N cost. */
typedef struct form_result {
    int n;
    double secs;       /* first spawn -> last FROZEN */
    double spawn;      /* the bench forking N processes */
    double last_open;  /* first spawn -> last OPEN */
    double after_open; /* last OPEN -> last FROZEN */
    double ready;      /* --go: first spawn -> last READY */
    double go_open;    /* --go: go -> last OPEN */
    double go_all;     /* --go: go -> last FROZEN */
    double cpu_procs;  /* CPU seconds of the participants */
    double cpu_etcd;   /* CPU seconds of etcd during the form */
    double cpu_settle; /* and until every one took its first step in the round */
    double base;       /* N sequential puts */
    uint64_t kinds[ETCD_REQ_KINDS];
    uint64_t total, most, steps, moved, bytes;
    uint64_t inflight; /* requests sent and not answered yet, when counted */
} form_result;

/* CPU seconds (user + system) that process pid has used, or -1. */
static double proc_cpu(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')');
    unsigned long long ut = 0, st = 0;
    /* after the command: state, then fields 4..13, then utime and stime */
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
        return -1;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

static double children_cpu(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_CHILDREN, &ru) != 0) return -1;
    return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec / 1e6;
}

/* Adds every participant's COUNTS line to res; 0 when all answered. */
static int collect_counts(tp_set *s, const int *ids, int n, form_result *res)
{
    char line[LINE], key[32];
    for (int i = 0; i < n; i++)
        if (tp_send(s, ids[i], "counts") != 0) return -1;
    for (int i = 0; i < n; i++) {
        if (tp_expect(s, ids[i], "COUNTS", 30000, line, sizeof(line)) != 0) return -1;
        uint64_t total = (uint64_t)tp_ifield(line, "total");
        res->total += total;
        if (total > res->most) res->most = total;
        for (int k = 0; k < ETCD_REQ_KINDS; k++) {
            snprintf(key, sizeof(key), "%s", etcd_req_kind_name((etcd_req_kind)k));
            res->kinds[k] += (uint64_t)tp_ifield(line, key);
        }
        res->steps += (uint64_t)tp_ifield(line, "steps");
        res->moved += (uint64_t)tp_ifield(line, "moved");
        res->bytes += (uint64_t)tp_ifield(line, "bytes");
        res->inflight += (uint64_t)tp_ifield(line, "inflight");
    }
    return 0;
}

/* The counts once they have settled: every participant has taken its
 * first step in the frozen round (its snapshot, its member watches), so
 * that they do not depend on how far each one got when the last one froze.
 * Collected every second until no request is in flight and the requests
 * but keep-alives, the steps and the answer bytes stop changing (at most
 * 60 s: then the last collection). */
static int settled_counts(tp_set *s, const int *ids, int n, form_result *res)
{
    uint64_t last = UINT64_MAX;
    for (int round = 0; round < 60; round++) {
        struct timespec ts = {.tv_sec = 1, .tv_nsec = 0};
        nanosleep(&ts, NULL);
        form_result now;
        memset(&now, 0, sizeof(now));
        if (collect_counts(s, ids, n, &now) != 0) return -1;
        /* requests count when sent, steps and bytes when answered */
        uint64_t work = now.total - now.kinds[ETCD_REQ_KEEPALIVE] + now.steps + now.bytes;
        memcpy(res->kinds, now.kinds, sizeof(now.kinds));
        res->total = now.total;
        res->most = now.most;
        res->steps = now.steps;
        res->moved = now.moved;
        res->bytes = now.bytes;
        if (work == last && now.inflight == 0) break;
        last = work;
    }
    return 0;
}

/* --go: waits for every READY, then says go to all; returns the time of
 * the go (-1 on failure) and counts the CPU from then on (the
 * participants' own, as each said it at READY). */
static double go_all(tp_set *s, const int *ids, int n, pid_t etcd_pid, form_result *res, double t0,
                     double *cpu0, double *etcd0)
{
    double tready = last_line(s, ids, n, "READY", 300000, cpu0);
    if (tready < 0) return -1;
    res->ready = tready - t0;
    *etcd0 = proc_cpu(etcd_pid);
    double tgo = mono_now_s();
    for (int i = 0; i < n; i++)
        if (tp_send(s, ids[i], "go") != 0) return -1;
    return tgo;
}

static int form(const char *endpoint, pid_t etcd_pid, int n, int go, form_result *res)
{
    /* A job of its own per form: the same N twice in one run must not meet
     * the last form's registrations (their leases outlive it by a TTL). */
    static int forms;
    char job[32], opts[256], node[32];
    snprintf(job, sizeof(job), "form-%d-%d", n, ++forms);
    snprintf(opts, sizeof(opts),
             "--min %d --max %d --last-call-ms 60000 --ttl 30 "
             "--join-timeout-ms 300000 --etcd-timeout-ms 20000%s",
             n, n, go ? " --wait-go 1" : "");
    memset(res, 0, sizeof(*res));
    res->n = n;
    res->secs = res->spawn = res->last_open = res->after_open = -1;
    res->ready = res->go_open = res->go_all = -1;
    tp_set s;
    tp_init(&s, RDZV_PARTICIPANT, endpoint, job);
    int *ids = calloc((size_t)n, sizeof(int));
    if (!ids) return -1;
    double cpu0 = children_cpu(), etcd0 = proc_cpu(etcd_pid);
    double t0 = mono_now_s();
    for (int i = 0; i < n; i++) {
        snprintf(node, sizeof(node), "n%03d", i);
        ids[i] = tp_spawn(&s, node, opts);
    }
    res->spawn = mono_now_s() - t0;
    double tgo = 0, gocpu0 = 0;
    if (go && (tgo = go_all(&s, ids, n, etcd_pid, res, t0, &gocpu0, &etcd0)) < 0) {
        tp_free(&s);
        free(ids);
        return -1;
    }
    double cpu1 = 0;
    double treg = last_line(&s, ids, n, "OPEN", 300000, NULL);
    double t1 = last_line(&s, ids, n, "FROZEN", 300000, &cpu1);
    res->cpu_etcd = proc_cpu(etcd_pid) - etcd0;
    if (go) res->cpu_procs = cpu1 - gocpu0;
    if (t1 > 0) res->secs = t1 - t0;
    if (treg > 0) res->last_open = treg - t0;
    if (t1 > 0 && treg > 0) res->after_open = t1 - treg;
    if (go && treg > 0) res->go_open = treg - tgo;
    if (go && t1 > 0) res->go_all = t1 - tgo;
    int ok = t1 > 0 && tp_check_agreement(&s) == 0 && settled_counts(&s, ids, n, res) == 0;
    res->cpu_settle = proc_cpu(etcd_pid) - etcd0;
    for (int i = 0; i < n; i++)
        tp_send(&s, ids[i], "close");
    tp_free(&s);
    if (!go) res->cpu_procs = children_cpu() - cpu0;
    free(ids);
    return ok ? 0 : -1;
}

/* etcd's CPU seconds to deliver one put of `size` bytes to each of n
 * watches (one connection each, opened beforehand), or -1: the mean over
 * enough puts for a thousand deliveries (CPU time is counted in ticks). */
static double fanout_cpu(const char *endpoint, pid_t etcd_pid, int n, size_t size, int round)
{
    etcd_client **cs = calloc((size_t)n, sizeof(*cs));
    etcd_watch **ws = calloc((size_t)n, sizeof(*ws));
    char *value = malloc(size);
    char key[64];
    snprintf(key, sizeof(key), "/bench/fanout/%d", round);
    double secs = -1;
    etcd_client *c = connect_etcd(endpoint);
    if (!cs || !ws || !value || !c) goto out;
    memset(value, 'r', size);
    for (int i = 0; i < n; i++)
        if (!(cs[i] = connect_etcd(endpoint)) ||
            etcd_watch_open(cs[i], key, 0, 0, &ws[i]) != ETCD_OK)
            goto out;
    int puts = n < 1024 ? 1024 / n : 1;
    double cpu0 = proc_cpu(etcd_pid);
    for (int p = 0; p < puts; p++) {
        if (etcd_put(c, key, value, size, 0, NULL) != ETCD_OK) goto out;
        for (int i = 0; i < n; i++) {
            etcd_event *evs = NULL;
            size_t k = 0;
            if (etcd_watch_next(ws[i], 30000, &evs, &k) != ETCD_OK || k != 1) goto out;
            etcd_events_free(evs, k);
        }
    }
    secs = (proc_cpu(etcd_pid) - cpu0) / puts;
out:
    for (int i = 0; cs && i < n; i++) {
        if (ws && ws[i]) etcd_watch_close(ws[i]);
        etcd_client_free(cs[i]);
    }
    etcd_client_free(c);
    free(value);
    free(ws);
    free(cs);
    return secs;
}

static void print_requests(const form_result *res, int nres)
{
    printf("\netcd requests per participant, from its start to all N holding their ranks "
           "(and one step in the round)\n");
    printf("| %5s | %7s | %6s", "N", "total/N", "most");
    for (int k = 0; k < ETCD_REQ_KINDS; k++)
        printf(" | %6.6s", etcd_req_kind_name((etcd_req_kind)k));
    printf(" | %6s | %6s | %8s | %10s | %8s |\n", "steps", "moved", "KiB", "N puts", "ratio");
    for (int i = 0; i < nres; i++) {
        const form_result *f = &res[i];
        if (f->total == 0) {
            printf("| %5d | FAILED\n", f->n);
            continue;
        }
        double per = (double)f->total / f->n;
        printf("| %5d | %7.2f | %6llu", f->n, per, (unsigned long long)f->most);
        for (int k = 0; k < ETCD_REQ_KINDS; k++)
            printf(" | %6.2f", (double)f->kinds[k] / f->n);
        printf(" | %6.2f | %6.2f | %8.1f | %8.3f s | %7.1fx |\n", (double)f->steps / f->n,
               (double)f->moved / f->n, (double)f->bytes / f->n / 1024, f->base,
               f->secs > 0 && f->base > 0 ? f->secs / f->base : 0);
    }
    /* grows: the largest N pays more than 10% per join over the smallest.
     * Keep-alives are left out: they follow the time the form took (one
     * per TTL/3), not the protocol. */
    const form_result *lo = NULL, *hi = NULL;
    for (int i = 0; i < nres; i++) {
        if (res[i].total == 0) continue;
        if (!lo || res[i].n < lo->n) lo = &res[i];
        if (!hi || res[i].n > hi->n) hi = &res[i];
    }
    if (lo && hi && lo != hi) {
        double a = (double)(lo->total - lo->kinds[ETCD_REQ_KEEPALIVE]) / lo->n;
        double b = (double)(hi->total - hi->kinds[ETCD_REQ_KEEPALIVE]) / hi->n;
        printf("requests per join (keep-alives left out) %s with N: %.2f at N=%d, %.2f at "
               "N=%d; the busiest participant sent %llu and %llu; KiB per join %.1f and %.1f\n",
               b > a * 1.1 ? "GROW" : "do not grow", a, lo->n, b, hi->n,
               (unsigned long long)lo->most, (unsigned long long)hi->most,
               (double)lo->bytes / lo->n / 1024, (double)hi->bytes / hi->n / 1024);
    }
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
    if (last_line(&s, ids, N, "FROZEN", 60000, NULL) > 0) {
        double t0 = mono_now_s();
        if (do_kill)
            tp_kill(&s, ids[3], SIGKILL);
        else
            tp_send(&s, ids[3], "leave");
        int rest[N - 1], m = 0;
        for (int i = 0; i < N; i++)
            if (i != 3) rest[m++] = ids[i];
        double t1 = last_line(&s, rest, m, "ENDED", 60000, NULL);
        double t2 = last_line(&s, rest, m, "FROZEN", 60000, NULL);
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
    int sizes[MAX_SIZES] = {64, 256, 1024}, nsizes = 3, go = 0, first = 1;
    if (argc > 1 && strcmp(argv[1], "--go") == 0) {
        go = 1;
        first = 2;
    }
    if (argc > first) {
        nsizes = 0;
        for (int i = first; i < argc && nsizes < MAX_SIZES; i++)
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
    form_result res[MAX_SIZES];
    int nres = 0;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    double load[3] = {0, 0, 0};
    getloadavg(load, 3);
    printf("rendezvous (participants are processes, one rdzv handle each; one etcd; "
           "this machine: %ld cores, load average %.2f at start)%s\n",
           cores, load[0],
           go ? "\n--go: every participant started and waiting before one go to all" : "");
    printf("| %-30s | %10s | %-34s | %10s | %7s |\n", "figure", "ours", "baseline", "baseline",
           "ratio");
    printf("|--------------------------------|------------|------------------------------------|"
           "------------|---------|\n");
    for (int i = 0; i < nsizes; i++) {
        int n = sizes[i];
        if (n < 1 || n > MAX_N) continue;
        form_result *f = &res[nres++];
        failed |= form(e.endpoint, e.pid, n, go, f) != 0;
        f->base = baseline_puts(c, n);
        char what[64], bname[64];
        snprintf(bname, sizeof(bname), "%d sequential etcd puts", n);
        const struct {
            const char *name;
            double secs;
            int go_only;
        } rows[] = {{"form", f->secs, 0},
                    {"  spawn (bench)", f->spawn, 0},
                    {"  last open", f->last_open, 0},
                    {"  last open -> all", f->after_open, 0},
                    {"  all started", f->ready, 1},
                    {"  go -> last open", f->go_open, 1},
                    {"  go -> all (protocol)", f->go_all, 1}};
        for (size_t k = 0; k < sizeof(rows) / sizeof(rows[0]); k++) {
            if (rows[k].go_only && !go) continue;
            snprintf(what, sizeof(what), "%s, N=%d", rows[k].name, n);
            row(what, rows[k].secs, bname, f->base);
        }
        snprintf(what, sizeof(what), "  CPU during form%s, N=%d", go ? " from go" : "", n);
        printf("| %-30s | participants %.2f s, etcd %.2f s (%.2f s until all took a step in "
               "the round)\n",
               what, f->cpu_procs, f->cpu_etcd, f->cpu_settle);
        fflush(stdout);
    }
    print_requests(res, nres);
    printf("\n");
    for (int i = 0; i < nres; i++) {
        int n = res[i].n;
        double rec = fanout_cpu(e.endpoint, e.pid, n, (size_t)n * 64, 2 * i);
        double small = fanout_cpu(e.endpoint, e.pid, n, 64, 2 * i + 1);
        failed |= rec < 0 || small < 0;
        char what[64], bname[64];
        snprintf(what, sizeof(what), "record (%d KiB) to N=%d watches", n * 64 / 1024, n);
        snprintf(bname, sizeof(bname), "64 B to the N watches (etcd CPU)");
        row(what, rec, bname, small);
        fflush(stdout);
    }
    printf("(etcd CPU seconds for one put delivered to every watch)\n\n");
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
    getloadavg(load, 3);
    printf("load average at the end: %.2f %.2f %.2f\n", load[0], load[1], load[2]);
    etcd_client_free(c);
    test_etcd_stop(&e);
    return failed ? 1 : 0;
}
