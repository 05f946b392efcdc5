/* log.c: the logger of log.h. Formats a whole line, then writes it once. */
#include "ductile/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

static const char *const level_names[] = {"error", "warn", "info", "debug"};

int dlog_level_parse(const char *s, dlog_level *out)
{
    for (int i = 0; i <= DLOG_DEBUG; i++)
        if (s && strcmp(s, level_names[i]) == 0) return *out = (dlog_level)i, 0;
    return -1;
}

int dlog_format_parse(const char *s, int *json)
{
    if (s && strcmp(s, "text") == 0) return *json = 0, 0;
    if (s && strcmp(s, "json") == 0) return *json = 1, 0;
    return -1;
}

int dlog_init(dlog *lg, const char *tag, const char *node, int stamp, char *why, size_t whylen)
{
    *lg = (dlog){.tag = tag, .node = node, .stamp = stamp, .level = DLOG_INFO};
    const char *lv = getenv("DUCTILE_LOG_LEVEL");
    if (lv && *lv && dlog_level_parse(lv, &lg->level) != 0) {
        snprintf(why, whylen, "DUCTILE_LOG_LEVEL='%s' is not error, warn, info or debug", lv);
        return -1;
    }
    const char *fmt = getenv("DUCTILE_LOG_FORMAT");
    if (fmt && *fmt && dlog_format_parse(fmt, &lg->json) != 0) {
        snprintf(why, whylen, "DUCTILE_LOG_FORMAT='%s' is not text or json", fmt);
        return -1;
    }
    return 0;
}

void dlog_vwrite(const dlog *lg, dlog_level level, const char *event, const char *fmt, va_list ap)
{
    if (!dlog_enabled(lg, level)) return;
    char msg[DLOG_MSG_MAX];
    vsnprintf(msg, sizeof(msg), fmt, ap);
    char ts[32];
    time_t t = time(NULL);
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(ts, sizeof(ts), "%Y-%m-%dT%H:%M:%SZ", &tm);
    char line[DLOG_MSG_MAX + 400];
    int n;
    if (lg->json) {
        cJSON *o = cJSON_CreateObject();
        char *text = NULL;
        if (o && cJSON_AddStringToObject(o, "time", ts) &&
            cJSON_AddStringToObject(o, "level", level_names[level]) &&
            cJSON_AddStringToObject(o, "tag", lg->tag) &&
            (!lg->node || cJSON_AddStringToObject(o, "node", lg->node)) &&
            (!event || cJSON_AddStringToObject(o, "event", event)) &&
            cJSON_AddStringToObject(o, "msg", msg))
            text = cJSON_PrintUnformatted(o);
        cJSON_Delete(o);
        if (!text) return;
        n = snprintf(line, sizeof(line), "%s\n", text);
        free(text);
    } else if (lg->node) {
        n = snprintf(line, sizeof(line), "%s%s%s[%s] %s\n", lg->stamp ? ts : "",
                     lg->stamp ? " " : "", lg->tag, lg->node, msg);
    } else {
        n = snprintf(line, sizeof(line), "%s%s%s: %s\n", lg->stamp ? ts : "", lg->stamp ? " " : "",
                     lg->tag, msg);
    }
    if (n <= 0) return;
    if ((size_t)n >= sizeof(line)) {
        n = sizeof(line) - 1;
        line[n - 1] = '\n';
    }
    /* one write: lines never interleave */
    ssize_t ignored = write(lg->to_stdout ? 1 : 2, line, (size_t)n);
    (void)ignored;
}

void dlog_write(const dlog *lg, dlog_level level, const char *event, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    dlog_vwrite(lg, level, event, fmt, ap);
    va_end(ap);
}
