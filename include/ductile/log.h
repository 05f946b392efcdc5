/* log.h: the one logger of ductile: levelled, tagged, one line per event.
 *
 * A dlog says who writes (a tag such as "agent" or "ductile-train", and the
 * node or rank when there is one), in which format, and from which level
 * up. Each line leaves in one write(2) on stderr (on stdout for a dlog that
 * carries progress: to_stdout), so lines from the agent,
 * its workers and its library threads never interleave mid-line.
 *
 *   text:  [TIME ]TAG[WHO] MESSAGE      (TIME when stamped, UTC ISO 8601)
 *          [TIME ]TAG: MESSAGE          (no WHO)
 *   json:  {"time":..,"level":..,"tag":..,"node":..,"event":..,"msg":..}
 *
 * Settings come from the caller's flags or the environment:
 *   DUCTILE_LOG_LEVEL   error | warn | info (default) | debug
 *   DUCTILE_LOG_FORMAT  text (default) | json   (--log-format)
 *
 * Libraries do not log their errors: they return them, and the caller that
 * understands the error logs it once. A library logs only debug traces,
 * through a dlog its caller handed it (or made from the environment).
 */
#ifndef DUCTILE_LOG_H
#define DUCTILE_LOG_H

#include <stdarg.h>
#include <stddef.h>

/* The longest message a line carries; longer ones are cut. */
#define DLOG_MSG_MAX 1024

typedef enum { DLOG_ERROR = 0, DLOG_WARN, DLOG_INFO, DLOG_DEBUG } dlog_level;

typedef struct dlog {
    const char *tag;  /* subsystem: "agent", "ductile-train", "rdzv" */
    const char *node; /* node id, or NULL */
    int json;         /* 1: one JSON object per line */
    int stamp;        /* text lines start with the UTC time */
    dlog_level level; /* lines less severe than this are dropped */
    int to_stdout;    /* progress for a terminal or a pipe: stdout instead of stderr */
} dlog;

/* Fills lg for tag and node from DUCTILE_LOG_LEVEL and DUCTILE_LOG_FORMAT.
 * Returns 0, or -1 with why[] set when either variable has a bad value (lg
 * is then usable with the defaults: info, text). */
int dlog_init(dlog *lg, const char *tag, const char *node, int stamp, char *why, size_t whylen);

/* Parses "error", "warn", "info", "debug"; -1 when none. */
int dlog_level_parse(const char *s, dlog_level *out);
/* Parses "text" or "json" into *json; -1 when neither. */
int dlog_format_parse(const char *s, int *json);

/* 1 when a line at level would be written. */
static inline int dlog_enabled(const dlog *lg, dlog_level level)
{
    return lg && level <= lg->level;
}

/* Writes one line at level. event names the line for machines ("round_frozen");
 * NULL for none. */
void dlog_write(const dlog *lg, dlog_level level, const char *event, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void dlog_vwrite(const dlog *lg, dlog_level level, const char *event, const char *fmt, va_list ap);

#define dlog_error(lg, event, ...) dlog_write((lg), DLOG_ERROR, (event), __VA_ARGS__)
#define dlog_warn(lg, event, ...) dlog_write((lg), DLOG_WARN, (event), __VA_ARGS__)
#define dlog_info(lg, event, ...) dlog_write((lg), DLOG_INFO, (event), __VA_ARGS__)
#define dlog_debug(lg, event, ...)                                                                 \
    do {                                                                                           \
        if (dlog_enabled((lg), DLOG_DEBUG)) dlog_write((lg), DLOG_DEBUG, (event), __VA_ARGS__);    \
    } while (0)

#endif
