/* test_rdzv_procs.c: participant processes for the rendezvous tests (see
 * test_rdzv_procs.h). Reading is poll() on the processes' stdout pipes with
 * a deadline; nothing here sleeps to wait for an outcome.
 */
#include "test_rdzv_procs.h"

#include "ductile/clock.h"
#include "th_scenario.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void tp_init(tp_set *s, const char *exe, const char *endpoint, const char *job)
{
    memset(s, 0, sizeof(*s));
    s->exe = exe;
    snprintf(s->endpoint, sizeof(s->endpoint), "%s", endpoint);
    snprintf(s->job, sizeof(s->job), "%s", job);
    signal(SIGPIPE, SIG_IGN);
}

int tp_spawn(tp_set *s, const char *node, const char *extra)
{
    if (s->nprocs == s->cap) {
        int cap = s->cap ? s->cap * 2 : 16;
        tp_proc *p = realloc(s->procs, (size_t)cap * sizeof(*p));
        if (!p) return -1;
        s->procs = p;
        s->cap = cap;
    }
    char *argv[64];
    int argc = 0;
    char copy[1024];
    snprintf(copy, sizeof(copy), "%s", extra ? extra : "");
    argv[argc++] = (char *)s->exe;
    argv[argc++] = "--endpoints";
    argv[argc++] = s->endpoint;
    argv[argc++] = "--job";
    argv[argc++] = s->job;
    argv[argc++] = "--node";
    argv[argc++] = (char *)node;
    char *save = NULL;
    for (char *t = strtok_r(copy, " ", &save); t && argc < 62; t = strtok_r(NULL, " ", &save))
        argv[argc++] = t;
    argv[argc] = NULL;
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0) return -1;
    if (pipe2(out, O_CLOEXEC) != 0) {
        close(in[0]);
        close(in[1]);
        return -1;
    }
    th_spawn_opts o = {.in_fd = in[0], .out_fd = out[1], .die_with_parent = 1};
    pid_t pid = th_spawn(argv, &o);
    close(in[0]);
    close(out[1]);
    if (pid < 0) {
        close(in[1]);
        close(out[0]);
        return -1;
    }
    tp_proc *p = &s->procs[s->nprocs];
    memset(p, 0, sizeof(*p));
    p->pid = pid;
    p->in_fd = in[1];
    p->out_fd = out[0];
    snprintf(p->node, sizeof(p->node), "%s", node);
    snprintf(p->job, sizeof(p->job), "%s", s->job);
    return s->nprocs++;
}

int tp_send(tp_set *s, int i, const char *line)
{
    tp_proc *p = &s->procs[i];
    char buf[512];
    int n = snprintf(buf, sizeof(buf), "%s\n", line);
    return write(p->in_fd, buf, (size_t)n) == n ? 0 : -1;
}

void tp_field(const char *line, const char *key, char *out, size_t outlen)
{
    out[0] = '\0';
    size_t kl = strlen(key);
    for (const char *p = line; (p = strstr(p, key)) != NULL; p += kl) {
        if ((p == line || p[-1] == ' ') && p[kl] == '=') {
            const char *v = p + kl + 1;
            size_t n = strcspn(v, " \n");
            if (n >= outlen) n = outlen - 1;
            memcpy(out, v, n);
            out[n] = '\0';
            return;
        }
    }
}

long long tp_ifield(const char *line, const char *key)
{
    char v[64];
    tp_field(line, key, v, sizeof(v));
    if (!v[0]) return -1;
    return strtoll(v, NULL, 10);
}

static void keep_line(tp_set *s, tp_proc *p, const char *line)
{
    if (p->nlines == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 32;
        char **l = realloc(p->lines, cap * sizeof(char *));
        char *t = realloc(p->taken, cap);
        if (l) p->lines = l;
        if (t) p->taken = t;
        if (!l || !t) return;
        p->cap = cap;
    }
    p->lines[p->nlines] = strdup(line);
    p->taken[p->nlines] = 0;
    p->nlines++;
    if (strncmp(line, "FROZEN ", 7) == 0) {
        if (s->nfrozen == s->frozen_cap) {
            size_t cap = s->frozen_cap ? s->frozen_cap * 2 : 64;
            tp_frozen *f = realloc(s->frozen, cap * sizeof(*f));
            if (!f) return;
            s->frozen = f;
            s->frozen_cap = cap;
        }
        tp_frozen *f = &s->frozen[s->nfrozen++];
        f->round = tp_ifield(line, "round");
        snprintf(f->job, sizeof(f->job), "%s", p->job);
        snprintf(f->node, sizeof(f->node), "%s", p->node);
        tp_field(line, "members", f->members, sizeof(f->members));
    }
}

/* Reads what is available on p (one read), splitting it into lines. */
static void read_proc(tp_set *s, tp_proc *p)
{
    if (p->eof) return;
    ssize_t n = read(p->out_fd, p->buf + p->len, sizeof(p->buf) - 1 - p->len);
    if (n <= 0) {
        if (n == 0 || (errno != EINTR && errno != EAGAIN)) p->eof = 1;
        return;
    }
    p->len += (size_t)n;
    char *nl;
    while ((nl = memchr(p->buf, '\n', p->len)) != NULL) {
        *nl = '\0';
        keep_line(s, p, p->buf);
        size_t used = (size_t)(nl - p->buf) + 1;
        memmove(p->buf, nl + 1, p->len - used);
        p->len -= used;
    }
    if (p->len == sizeof(p->buf) - 1) p->len = 0;
}

void tp_drain(tp_set *s, int timeout_ms)
{
    double deadline = mono_now_s() + timeout_ms / 1000.0;
    for (;;) {
        struct pollfd pf[256];
        int n = 0;
        for (int i = 0; i < s->nprocs && n < 256; i++) {
            pf[n].fd = s->procs[i].eof ? -1 : s->procs[i].out_fd;
            pf[n].events = POLLIN;
            n++;
        }
        int left = (int)((deadline - mono_now_s()) * 1000);
        if (left < 0) left = 0;
        int rc = poll(pf, (nfds_t)n, left);
        if (rc <= 0) return;
        for (int i = 0; i < n; i++)
            if (pf[i].revents) read_proc(s, &s->procs[i]);
    }
}

static int first_word_is(const char *line, const char *word)
{
    size_t n = strlen(word);
    return strncmp(line, word, n) == 0 && (line[n] == ' ' || line[n] == '\0');
}

int tp_expect(tp_set *s, int i, const char *word, int timeout_ms, char *out, size_t outlen)
{
    tp_proc *p = &s->procs[i];
    double deadline = mono_now_s() + timeout_ms / 1000.0;
    for (;;) {
        for (size_t k = 0; k < p->nlines; k++) {
            if (!p->taken[k] && first_word_is(p->lines[k], word)) {
                p->taken[k] = 1;
                if (out) snprintf(out, outlen, "%s", p->lines[k]);
                return 0;
            }
        }
        double left = deadline - mono_now_s();
        if (left <= 0 || p->eof) break;
        struct pollfd pf = {.fd = p->out_fd, .events = POLLIN};
        if (poll(&pf, 1, (int)(left * 1000) + 1) > 0) read_proc(s, p);
    }
    fprintf(stderr, "  %s: no %s line within %d ms%s; it said:\n", p->node, word, timeout_ms,
            p->eof ? " (it exited)" : "");
    for (size_t k = 0; k < p->nlines; k++)
        fprintf(stderr, "    %s%s\n", p->taken[k] ? "(taken) " : "", p->lines[k]);
    return -1;
}

void tp_kill(tp_set *s, int i, int sig)
{
    if (s->procs[i].pid > 0) kill(s->procs[i].pid, sig);
}

int tp_check_agreement(tp_set *s)
{
    tp_drain(s, 0);
    int bad = 0;
    for (size_t a = 0; a < s->nfrozen; a++)
        for (size_t b = a + 1; b < s->nfrozen; b++)
            if (s->frozen[a].round == s->frozen[b].round &&
                strcmp(s->frozen[a].job, s->frozen[b].job) == 0 &&
                strcmp(s->frozen[a].members, s->frozen[b].members) != 0) {
                fprintf(stderr, "  disagreement on round %lld: %s says %s, %s says %s\n",
                        (long long)s->frozen[a].round, s->frozen[a].node, s->frozen[a].members,
                        s->frozen[b].node, s->frozen[b].members);
                bad = 1;
            }
    return bad ? -1 : 0;
}

void tp_free(tp_set *s)
{
    for (int i = 0; i < s->nprocs; i++) {
        tp_proc *p = &s->procs[i];
        th_kill(&p->pid);
        close(p->in_fd);
        close(p->out_fd);
        for (size_t k = 0; k < p->nlines; k++)
            free(p->lines[k]);
        free(p->lines);
        free(p->taken);
    }
    free(s->procs);
    free(s->frozen);
    memset(s, 0, sizeof(*s));
}

int tp_main(int argc, char **argv, const char *exe, const tp_scenario *scenarios, size_t n)
{
    if (argc != 2) {
        th_usage(argv[0], scenarios, n, sizeof(*scenarios));
        return 2;
    }
    const char *name = argv[1];
    const tp_scenario *sc = th_find(scenarios, n, sizeof(*scenarios), name);
    test_etcd e;
    if (test_etcd_start(&e) != 0) return 1;
    tp_set s;
    tp_init(&s, exe, e.endpoint, "job");
    s.etcd = &e;
    int rc;
    if (sc) {
        rc = sc->fn(&s);
    } else {
        fprintf(stderr, "unknown scenario %s\n", name);
        rc = 2;
    }
    if (rc == 0 && tp_check_agreement(&s) != 0) {
        fprintf(stderr, "FAIL: participants disagree on a round's membership\n");
        rc = 1;
    }
    tp_free(&s);
    test_etcd_stop(&e);
    if (rc == 0) printf("ok %s\n", name);
    return rc;
}
