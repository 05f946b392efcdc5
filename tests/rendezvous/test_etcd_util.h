/* test_etcd_util.h: small helpers shared by the etcd client tests.
 *
 * The etcd client tests are plain programs that exit non-zero on the first
 * failed check: CHECK_OR_EXIT (check.h), and CHECK_OK / CHECK_ERR for an
 * etcd call, which also print the client's last error.
 */
#ifndef DUCTILE_TEST_ETCD_UTIL_H
#define DUCTILE_TEST_ETCD_UTIL_H

#include "check.h"
#include "ductile/clock.h"
#include "ductile/etcd.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* An etcd call that must succeed. */
#define CHECK_OK(c, call)                                                                          \
    do {                                                                                           \
        etcd_err e_ = (call);                                                                      \
        if (e_ != ETCD_OK) {                                                                       \
            fprintf(stderr, "%s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #call, etcd_strerror(e_),  \
                    etcd_last_error(c));                                                           \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* An etcd call that must fail with err. */
#define CHECK_ERR(c, err, call)                                                                    \
    do {                                                                                           \
        etcd_err e_ = (call);                                                                      \
        if (e_ != (err)) {                                                                         \
            fprintf(stderr, "%s:%d: %s: got %s, want %s (%s)\n", __FILE__, __LINE__, #call,        \
                    etcd_strerror(e_), etcd_strerror(err), etcd_last_error(c));                    \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* A client that must be made. */
static inline etcd_client *test_client_cfg(const etcd_config *cfg)
{
    etcd_client *c = NULL;
    char err[256];
    if (etcd_client_new_err(cfg, &c, err, sizeof(err)) != ETCD_OK) {
        fprintf(stderr, "etcd_client_new(%s): %s\n", cfg->endpoints, err);
        exit(1);
    }
    return c;
}

static inline etcd_client *test_client(const char *endpoints, int timeout_ms)
{
    etcd_config cfg = {.endpoints = endpoints, .timeout_ms = timeout_ms};
    return test_client_cfg(&cfg);
}

/* Collect watch events until n have arrived or timeout_ms passed; returns
 * how many arrived (the caller frees *out with etcd_events_free). */
static inline size_t test_watch_collect(etcd_watch *w, size_t n, int timeout_ms, etcd_event **out,
                                        etcd_err *last)
{
    etcd_event *all = NULL;
    size_t got = 0;
    int64_t end = mono_now_ms() + timeout_ms;
    *last = ETCD_OK;
    while (got < n && mono_now_ms() < end) {
        etcd_event *ev;
        size_t k;
        etcd_err e = etcd_watch_next(w, (int)(end - mono_now_ms()), &ev, &k);
        if (e != ETCD_OK && e != ETCD_ERR_UNAVAILABLE) {
            *last = e;
            break;
        }
        if (!k) continue;
        etcd_event *p = realloc(all, (got + k) * sizeof(*p));
        CHECK_OR_EXIT(p);
        all = p;
        memcpy(all + got, ev, k * sizeof(*ev));
        got += k;
        free(ev);
    }
    *out = all;
    return got;
}

/* The mod revision of the one event a watch gives within timeout_ms, or -1
 * when none or more came. */
static inline int64_t test_watch_one_rev(etcd_watch *w, int timeout_ms)
{
    etcd_event *ev;
    etcd_err last;
    size_t got = test_watch_collect(w, 1, timeout_ms, &ev, &last);
    int64_t rev = got == 1 ? ev[0].kv.mod_revision : -1;
    etcd_events_free(ev, got);
    return rev;
}

/* The watch's events so far (all, n) were all there was: nothing more
 * comes within quiet_ms. Frees them and closes the watch. */
static inline void test_watch_end_quiet(etcd_client *c, etcd_watch *w, etcd_event *all, size_t n,
                                        int quiet_ms)
{
    etcd_events_free(all, n);
    etcd_event *more;
    size_t k;
    CHECK_OK(c, etcd_watch_next(w, quiet_ms, &more, &k));
    CHECK_OR_EXIT(k == 0);
    etcd_watch_close(w);
}

#endif
