/* logs.c: torchrun's per-worker log files and error files (logs.h).
 *
 * The specs are torchrun's: --redirects and --tee are "N" for every local
 * rank or "LR:N,LR:N" per rank, N a bit set of stdout (1) and stderr (2).
 * The files are opened by the worker spawner (workers.c); this file owns the
 * directories and reads the error file torch's @record writes.
 */
#include "logs.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* A whole number in 0..max at s, up to a ',' or the end; -1 if not. */
static long spec_num(const char *s, const char **end, long max)
{
    long v = 0;
    const char *p = s;
    while (*p >= '0' && *p <= '9' && v <= max)
        v = v * 10 + (*p++ - '0');
    if (p == s || v > max) return -1;
    *end = p;
    return v;
}

int agent_logs_std(const char *spec, int lr)
{
    if (!spec || !*spec) return 0;
    const char *p = spec;
    long v = spec_num(p, &p, 3);
    if (v >= 0 && !*p) return (int)v; /* one value for every rank */
    int found = 0;
    p = spec;
    for (;;) {
        long r = spec_num(p, &p, 1000000);
        if (r < 0 || *p++ != ':') return -1;
        v = spec_num(p, &p, 3);
        if (v < 0) return -1;
        if (r == lr) found = (int)v;
        if (!*p) return found;
        if (*p++ != ',') return -1;
    }
}

int agent_logs_shown(const char *filter, int lr)
{
    if (!filter || !*filter) return 1;
    const char *p = filter;
    int shown = 0;
    for (;;) {
        long r = spec_num(p, &p, 1000000);
        if (r < 0) return -1;
        if (r == lr) shown = 1;
        if (!*p) return shown;
        if (*p++ != ',') return -1;
    }
}

int agent_logs_open(agent_logs *l, const char *log_dir, const char *job, char *msg, size_t len)
{
    char path[4096];
    const char *tmp = getenv("TMPDIR");
    const char *base = log_dir ? log_dir : tmp && *tmp ? tmp : "/tmp";
    if (log_dir && mkdir(log_dir, 0755) != 0 && errno != EEXIST) {
        snprintf(msg, len, "--log-dir %s: %s", log_dir, strerror(errno));
        return -1;
    }
    int n = snprintf(path, sizeof(path), "%s/%s%s_XXXXXX", base, log_dir ? "" : "ductile_", job);
    if (n < 0 || (size_t)n >= sizeof(path)) {
        snprintf(msg, len, "log directory %s: path too long", base);
        return -1;
    }
    if (!mkdtemp(path) || !(l->run_dir = strdup(path))) {
        snprintf(msg, len, "cannot make a log directory in %s: %s", base, strerror(errno));
        return -1;
    }
    l->private_dir = !log_dir;
    return 0;
}

int agent_logs_attempt(agent_logs *l, int64_t restarts, char *msg, size_t len)
{
    int n = snprintf(l->attempt_dir, sizeof(l->attempt_dir), "%s/attempt_%lld", l->run_dir,
                     (long long)restarts);
    if (n < 0 || (size_t)n >= sizeof(l->attempt_dir) - 32) {
        snprintf(msg, len, "log directory path too long");
        return -1;
    }
    if (mkdir(l->attempt_dir, 0755) != 0 && errno != EEXIST) {
        snprintf(msg, len, "%s: %s", l->attempt_dir, strerror(errno));
        return -1;
    }
    return 0;
}

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st, (void)flag, (void)ftw;
    remove(path);
    return 0;
}

void agent_logs_close(agent_logs *l)
{
    /* Streams sent to files there are the user's: the directory stays. */
    int kept = agent_logs_std(l->redirects, -1) > 0 || agent_logs_std(l->tee, -1) > 0;
    if (l->run_dir && l->private_dir && !kept)
        nftw(l->run_dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    free(l->run_dir);
    l->run_dir = NULL;
}

int agent_logs_error_message(const char *path, char *out, size_t len)
{
    FILE *f = path ? fopen(path, "re") : NULL;
    if (!f) return -1;
    char buf[65536];
    size_t got = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[got] = 0;
    cJSON *root = cJSON_Parse(buf);
    /* @record: {"message": {"message": "...", "extraInfo": {...}}}; a
     * plain {"message": "..."} is read too (torch's C++ handler). */
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(root, "message");
    if (cJSON_IsObject(m)) m = cJSON_GetObjectItemCaseSensitive(m, "message");
    int rc = -1;
    if (cJSON_IsString(m) && m->valuestring[0]) {
        size_t n = strcspn(m->valuestring, "\r\n");
        snprintf(out, len, "%.*s", (int)n, m->valuestring);
        rc = 0;
    }
    cJSON_Delete(root);
    return rc;
}
