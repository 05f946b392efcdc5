/* test_etcd_badinput.c: answers etcd never gives, from a fake server.
 *
 * Malformed JSON, wrong types, missing fields, bad base64, truncated and
 * oversized bodies, error bodies that must or must not be retried, a server
 * that never answers, and watch streams that send garbage or break in the
 * middle of a message. Each must end in a clear error code and message (or,
 * for a transient failure followed by a good answer, in success after a
 * retry), never a crash or a leak (this runs under ASan).
 */
#include "ductile/etcd.h"
#include "test_etcd_fake.h"
#include "test_etcd_util.h"

#include <cjson/cJSON.h>
#include <string.h>
#include <unistd.h>

static fake_server fk;
static etcd_client *c;

#define HDR "{\"header\":{\"revision\":\"7\"}"
#define EV(rev, val)                                                                               \
    "{\"kv\":{\"key\":\"L3cvaw==\",\"mod_revision\":\"" #rev "\",\"value\":\"" val "\"}}"

static const char *ok_range = HDR ",\"kvs\":[{\"key\":\"L2s=\",\"value\":\"dg==\","
                                  "\"mod_revision\":\"5\"}],\"count\":\"1\"}";

/* One range against a script; returns the error, *reqs the requests made. */
static etcd_err range_script(const fake_reply *r, size_t n, int *reqs)
{
    fake_script(&fk, r, n);
    etcd_range_result res;
    etcd_err e = etcd_range(c, "/k", 0, 0, &res);
    if (e == ETCD_OK) etcd_range_result_free(&res);
    *reqs = fake_requests(&fk);
    return e;
}

/* A range over the script: it succeeds, every answer asked for (retried). */
static void expect_range_retried(const fake_reply *r, size_t n)
{
    int reqs;
    CHECK_OK(c, range_script(r, n, &reqs));
    CHECK_OR_EXIT(reqs == (int)n);
}

/* A put over the script: it may have been applied, so it is not sent again. */
static void expect_put_not_resent(const fake_reply *r, size_t n)
{
    fake_script(&fk, r, n);
    CHECK_ERR(c, ETCD_ERR_UNAVAILABLE, etcd_put(c, "/k", "v", 1, 0, NULL));
    CHECK_OR_EXIT(fake_requests(&fk) == 1 && strstr(etcd_last_error(c), "may have been applied"));
}

/* A 200 answer with this body must give want and a message with hint. */
static void expect_range(const char *body, etcd_err want, const char *hint)
{
    char *http = fake_http(200, body);
    fake_reply r = {.data = http};
    int reqs;
    etcd_err e = range_script(&r, 1, &reqs);
    if (e != want || !strstr(etcd_last_error(c), hint) || reqs != 1) {
        fprintf(stderr, "body %.80s: got %s (%s) after %d requests, want %s with \"%s\"\n", body,
                etcd_strerror(e), etcd_last_error(c), reqs, etcd_strerror(want), hint);
        exit(1);
    }
    free(http);
}

static void test_malformed_answers(void)
{
    expect_range(ok_range, ETCD_OK, "");
    expect_range("{not json", ETCD_ERR_PROTOCOL, "not valid JSON");
    expect_range("", ETCD_ERR_PROTOCOL, "not valid JSON");
    expect_range("[1,2]", ETCD_ERR_PROTOCOL, "not an object");
    expect_range("{\"kvs\":\"x\"}", ETCD_ERR_PROTOCOL, "\"kvs\" is not an array");
    expect_range("{\"kvs\":[5]}", ETCD_ERR_PROTOCOL, "not an object");
    expect_range("{\"kvs\":[{\"key\":5}]}", ETCD_ERR_PROTOCOL, "\"key\" is not a string");
    expect_range("{\"kvs\":[{\"key\":\"!!!!\"}]}", ETCD_ERR_PROTOCOL, "not valid base64");
    expect_range("{\"kvs\":[{\"key\":\"L2s\"}]}", ETCD_ERR_PROTOCOL, "not valid base64");
    expect_range("{\"kvs\":[{\"key\":\"L2s=\",\"value\":\"d===\"}]}", ETCD_ERR_PROTOCOL,
                 "not valid base64");
    expect_range("{\"count\":\"abc\"}", ETCD_ERR_PROTOCOL, "\"count\" is not a 64-bit integer");
    expect_range("{\"count\":\"99999999999999999999\"}", ETCD_ERR_PROTOCOL, "64-bit");
    expect_range("{\"count\":\" 5\"}", ETCD_ERR_PROTOCOL, "64-bit");
    expect_range("{\"count\":1.5}", ETCD_ERR_PROTOCOL, "exact integer");
    expect_range("{\"count\":1e300}", ETCD_ERR_PROTOCOL, "exact integer");
    expect_range("{\"count\":true}", ETCD_ERR_PROTOCOL, "wrong type");
    expect_range("{\"header\":[]}", ETCD_ERR_PROTOCOL, "\"header\" is not an object");
    expect_range("{\"more\":\"yes\"}", ETCD_ERR_PROTOCOL, "not a boolean");
    /* numbers are accepted where a double holds them exactly */
    expect_range("{\"header\":{\"revision\":12},\"count\":0}", ETCD_OK, "");
    /* int64 extremes as strings, never through a double */
    char *http = fake_http(200, "{\"header\":{\"revision\":\"9223372036854775807\"},"
                                "\"kvs\":[{\"key\":\"L2s=\",\"lease\":\"-9223372036854775808\"}]}");
    fake_reply r = {.data = http};
    fake_script(&fk, &r, 1);
    etcd_range_result res;
    CHECK_OK(c, etcd_range(c, "/k", 0, 0, &res));
    CHECK_OR_EXIT(res.revision == INT64_MAX && res.n == 1 && res.kvs[0].lease == INT64_MIN);
    CHECK_OR_EXIT(strcmp(res.kvs[0].key, "/k") == 0 && res.kvs[0].value_len == 0);
    etcd_range_result_free(&res);
    free(http);

    /* other calls' answers */
    struct {
        const char *body;
        etcd_err want;
    } lease_cases[] = {
        {"{}", ETCD_ERR_PROTOCOL},                           /* keep-alive without result */
        {"{\"result\":5}", ETCD_ERR_PROTOCOL},               /* result of the wrong type */
        {"{\"result\":{\"ID\":\"1\"}}", ETCD_ERR_NOT_FOUND}, /* no TTL: lease gone */
        {"{\"result\":{\"ID\":\"1\",\"TTL\":\"x\"}}", ETCD_ERR_PROTOCOL},
        {"{\"result\":{\"ID\":\"1\",\"TTL\":\"9\"}}", ETCD_OK},
    };
    for (size_t i = 0; i < sizeof(lease_cases) / sizeof(lease_cases[0]); i++) {
        http = fake_http(200, lease_cases[i].body);
        r = (fake_reply){.data = http};
        fake_script(&fk, &r, 1);
        int64_t ttl = 0;
        CHECK_ERR(c, lease_cases[i].want, etcd_lease_keepalive(c, 1, &ttl));
        CHECK_OR_EXIT(lease_cases[i].want != ETCD_OK || ttl == 9);
        free(http);
    }
    http = fake_http(200, "{\"header\":{}}"); /* grant without an ID */
    r = (fake_reply){.data = http};
    fake_script(&fk, &r, 1);
    int64_t id;
    CHECK_ERR(c, ETCD_ERR_PROTOCOL, etcd_lease_grant(c, 5, &id));
    free(http);
    http = fake_http(200, "[]");
    r = (fake_reply){.data = http};
    fake_script(&fk, &r, 1);
    CHECK_ERR(c, ETCD_ERR_PROTOCOL, etcd_put(c, "/k", "v", 1, 0, NULL));
    CHECK_ERR(c, ETCD_ERR_PROTOCOL, etcd_delete(c, "/k", 1, NULL));
    free(http);
    /* txn: answers that do not match the operations sent */
    etcd_op op = {.type = ETCD_OP_RANGE, .key = "/k"};
    etcd_txn_result t;
    const char *txn_bad[] = {
        "{\"succeeded\":true}",                                        /* no responses */
        "{\"succeeded\":true,\"responses\":[{},{}]}",                  /* two for one */
        "{\"succeeded\":true,\"responses\":{}}",                       /* not an array */
        "{\"succeeded\":true,\"responses\":[{\"response_range\":7}]}", /* wrong type */
        "{\"succeeded\":1,\"responses\":[{}]}",
    };
    for (size_t i = 0; i < sizeof(txn_bad) / sizeof(txn_bad[0]); i++) {
        http = fake_http(200, txn_bad[i]);
        r = (fake_reply){.data = http};
        fake_script(&fk, &r, 1);
        CHECK_ERR(c, ETCD_ERR_PROTOCOL, etcd_txn(c, NULL, 0, &op, 1, NULL, 0, &t));
        free(http);
    }
    http = fake_http(200, "{\"responses\":[{\"response_range\":{\"kvs\":[{\"key\":\"L2s=\"}]}}]}");
    r = (fake_reply){.data = http};
    fake_script(&fk, &r, 1);
    CHECK_OK(c, etcd_txn(c, NULL, 0, NULL, 0, &op, 1, &t)); /* no "succeeded": false */
    CHECK_OR_EXIT(!t.succeeded && t.n == 1 && t.ranges[0].n == 1);
    etcd_txn_result_free(&t);
    free(http);
}

static void test_errors_and_retries(void)
{
    char *unavail = fake_http(503, "{\"error\":\"etcdserver: no leader\",\"code\":14,"
                                   "\"message\":\"etcdserver: no leader\"}");
    char *bad_req = fake_http(400, "{\"error\":\"bad\",\"code\":3,\"message\":\"bad thing\"}");
    char *internal = fake_http(500, "{\"error\":\"x\",\"code\":2,\"message\":\"unknown thing\"}");
    char *proxy = fake_http(502, "<html>bad gateway</html>");
    char *notfound = fake_http(404, "{\"error\":\"x\",\"code\":5,\"message\":\"lease not found\"}");
    char *unauth =
        fake_http(401, "{\"error\":\"x\",\"code\":16,\"message\":\"invalid auth token\"}");
    char *compacted = fake_http(400, "{\"code\":11,\"message\":\"mvcc: required revision has been "
                                     "compacted\"}");
    char *ok = fake_http(200, ok_range);
    int reqs;
    /* transient: retried, then the good answer */
    fake_reply s1[] = {{.data = unavail}, {.data = proxy}, {.data = unavail}, {.data = ok}};
    expect_range_retried(s1, 4);
    /* a truncated answer to a range is a broken connection: retried */
    const char *trunc =
        "HTTP/1.1 200 X\r\nContent-Length: 100\r\nConnection: close\r\n\r\n{\"kvs\":[";
    fake_reply s2[] = {{.data = trunc}, {.data = ok}};
    expect_range_retried(s2, 2);
    /* ... but a put that may have been applied is not sent again */
    expect_put_not_resent(s2, 2);
    /* etcd's "request timed out" comes after proposing: a range is asked
     * again, a put is not (it may have been applied) */
    char *timedout = fake_http(503, "{\"error\":\"x\",\"code\":14,\"message\":\"etcdserver: "
                                    "request timed out\"}");
    fake_reply s2b[] = {{.data = timedout}, {.data = ok}};
    expect_range_retried(s2b, 2);
    expect_put_not_resent(s2b, 2);
    free(timedout);
    /* a put whose connection was refused before sending is retried (see
     * test_etcd_failure's failover); answers that are verdicts are not */
    struct {
        char *reply;
        etcd_err want;
        const char *hint;
    } final[] = {
        {bad_req, ETCD_ERR_ARG, "bad thing"},
        {internal, ETCD_ERR_SERVER, "unknown thing"},
        {notfound, ETCD_ERR_NOT_FOUND, "lease not found"},
        {unauth, ETCD_ERR_AUTH, "invalid auth token"},
        {compacted, ETCD_ERR_COMPACTED, "compacted"},
    };
    for (size_t i = 0; i < sizeof(final) / sizeof(final[0]); i++) {
        fake_reply s[] = {{.data = final[i].reply}, {.data = ok}};
        CHECK_ERR(c, final[i].want, range_script(s, 2, &reqs));
        CHECK_OR_EXIT(reqs == 1 && strstr(etcd_last_error(c), final[i].hint));
    }
    /* transient forever: UNAVAILABLE... at the deadline, with the last reason */
    etcd_set_timeout(c, 600);
    fake_reply s3[] = {{.data = unavail}};
    int64_t t0 = mono_now_ms();
    CHECK_ERR(c, ETCD_ERR_UNAVAILABLE, range_script(s3, 1, &reqs));
    int64_t took = mono_now_ms() - t0;
    CHECK_OR_EXIT(took >= 550 && took < 5000 && reqs >= 3 &&
                  strstr(etcd_last_error(c), "no leader"));
    /* a server that takes the request and never answers: TIMEOUT at the deadline */
    fake_reply s4[] = {{.silent = 1}};
    t0 = mono_now_ms();
    CHECK_ERR(c, ETCD_ERR_TIMEOUT, range_script(s4, 1, &reqs));
    took = mono_now_ms() - t0;
    CHECK_OR_EXIT(took >= 550 && took < 5000 && reqs == 1);
    etcd_set_timeout(c, 0);
    /* not HTTP at all */
    fake_reply s5[] = {{.data = "SSH-2.0-OpenSSH\r\n\r\n"}};
    CHECK_ERR(c, ETCD_ERR_PROTOCOL, range_script(s5, 1, &reqs));
    free(unavail);
    free(bad_req);
    free(internal);
    free(proxy);
    free(notfound);
    free(unauth);
    free(compacted);
    free(ok);
}

static void test_huge_answers(void)
{
    /* over 64 MiB for a range, over 1 MiB for a put: cut off, not buffered */
    size_t big = ((size_t)64 << 20) + 4096;
    char *resp = malloc(big + 256);
    CHECK_OR_EXIT(resp);
    int h = snprintf(resp, 256,
                     "HTTP/1.1 200 X\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n{\"kvs\":[",
                     big);
    memset(resp + h, ' ', big - 9);
    fake_reply r = {.data = resp, .len = (size_t)h + big - 9};
    int reqs;
    CHECK_ERR(c, ETCD_ERR_TOO_LARGE, range_script(&r, 1, &reqs));
    CHECK_OR_EXIT(reqs == 1 && strstr(etcd_last_error(c), "larger than"));
    h = snprintf(resp, 256, "HTTP/1.1 200 X\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n{",
                 (size_t)2 << 20);
    memset(resp + h, ' ', (size_t)2 << 20);
    r = (fake_reply){.data = resp, .len = (size_t)h + ((size_t)2 << 20)};
    fake_script(&fk, &r, 1);
    CHECK_ERR(c, ETCD_ERR_TOO_LARGE, etcd_put(c, "/k", "v", 1, 0, NULL));
    free(resp);

    /* and requests over etcd's limits are refused before sending */
    size_t vlen = ((size_t)3 << 19) + 1;
    char *v = calloc(1, vlen);
    CHECK_OR_EXIT(v);
    fake_script(&fk, NULL, 0);
    CHECK_ERR(c, ETCD_ERR_TOO_LARGE, etcd_put(c, "/k", v, vlen, 0, NULL));
    etcd_op op = {.type = ETCD_OP_PUT, .key = "/k", .value = v, .value_len = vlen};
    CHECK_ERR(c, ETCD_ERR_TOO_LARGE, etcd_txn(c, NULL, 0, &op, 1, NULL, 0, NULL));
    CHECK_OR_EXIT(fake_requests(&fk) == 0);
    free(v);
}

#define STREAM_HDR "HTTP/1.1 200 X\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
#define CREATED "{\"result\":{\"header\":{\"revision\":\"10\"},\"created\":true}}\n"

static etcd_watch *open_watch(const fake_reply *r, size_t n)
{
    fake_script(&fk, r, n);
    etcd_watch *w;
    CHECK_OK(c, etcd_watch_open(c, "/w/", 1, 0, &w));
    return w;
}

static void test_watch_streams(void)
{
    etcd_event *ev;
    size_t n;
    etcd_err last;
    /* breaks in the middle of the second event; the resume repeats the first
     * (dropped as already seen), completes the second, adds a third */
    fake_reply s1[] = {
        {.data = STREAM_HDR CREATED
         "{\"result\":{\"events\":[" EV(11, "YQ==") "]}}\n{\"result\":{\"ev"},
        {STREAM_HDR CREATED "{\"result\":{\"events\":[" EV(11, "YQ==") "," EV(
             12, "Yg==") "]}}\n"
                         "{\"result\":{\"events\":[{\"type\":\"DELETE\",\"kv\":{\"key\":"
                         "\"L3cvaw==\",\"mod_revision\":\"13\"}}]}}\n",
         .hold_ms = 3000},
    };
    etcd_watch *w = open_watch(s1, 2);
    size_t got = test_watch_collect(w, 3, 5000, &ev, &last);
    CHECK_OR_EXIT(got == 3 && last == ETCD_OK);
    CHECK_OR_EXIT(ev[0].kv.mod_revision == 11 && strcmp(ev[0].kv.value, "a") == 0);
    CHECK_OR_EXIT(ev[1].kv.mod_revision == 12 && strcmp(ev[1].kv.value, "b") == 0);
    CHECK_OR_EXIT(ev[2].type == ETCD_EVENT_DELETE && ev[2].kv.mod_revision == 13);
    CHECK_OR_EXIT(strcmp(ev[2].kv.key, "/w/k") == 0);
    etcd_events_free(ev, got);
    CHECK_OR_EXIT(etcd_watch_revision(w) == 13);
    char body[4096];
    fake_last_body(&fk, body, sizeof(body));
    CHECK_OR_EXIT(strstr(body, "\"start_revision\":\"12\""));
    etcd_watch_close(w);

    /* garbage in the stream: reported once, then the stream resumes */
    fake_reply s2[] = {
        {.data = STREAM_HDR CREATED
         "{\"result\":{\"events\":[" EV(11, "YQ==") "]}}\nthis is not json\n"},
        {.data = STREAM_HDR CREATED "{\"result\":{\"events\":[" EV(12, "Yg==") "]}}\n",
         .hold_ms = 3000},
    };
    w = open_watch(s2, 2);
    CHECK_OK(c, etcd_watch_next(w, 3000, &ev, &n));
    CHECK_OR_EXIT(n == 1 && ev[0].kv.mod_revision == 11);
    etcd_events_free(ev, n);
    CHECK_OR_EXIT(etcd_watch_next(w, 3000, &ev, &n) == ETCD_ERR_PROTOCOL && n == 0);
    CHECK_OR_EXIT(strstr(etcd_watch_last_error(w), "not valid JSON"));
    got = test_watch_collect(w, 1, 3000, &ev, &last);
    CHECK_OR_EXIT(got == 1 && ev[0].kv.mod_revision == 12);
    etcd_events_free(ev, got);
    etcd_watch_close(w);

    /* wrong types inside a message; events out of order */
    const char *bad_msgs[] = {
        "{\"result\":{\"events\":[{\"type\":\"BOGUS\",\"kv\":{\"key\":\"L3c=\"}}]}}\n",
        "{\"result\":{\"events\":[{\"type\":\"PUT\"}]}}\n",
        "{\"result\":{\"events\":{}}}\n",
        "{\"result\":{\"events\":[{\"kv\":{\"key\":\"***\"}}]}}\n",
        "{\"result\":{\"events\":[" EV(15, "YQ==") "," EV(14, "YQ==") "]}}\n",
        "{\"result\":7}\n",
        "[]\n",
        /* events for a watch the stream never created */
        "{\"result\":{\"watch_id\":\"5\",\"events\":[" EV(15, "YQ==") "]}}\n",
        "{\"result\":{\"watch_id\":\"x\",\"events\":[" EV(15, "YQ==") "]}}\n",
    };
    char stream[1024];
    for (size_t i = 0; i < sizeof(bad_msgs) / sizeof(bad_msgs[0]); i++) {
        snprintf(stream, sizeof(stream), STREAM_HDR CREATED "%s", bad_msgs[i]);
        fake_reply s[] = {{.data = stream, .hold_ms = 2000}};
        w = open_watch(s, 1);
        etcd_err e = etcd_watch_next(w, 2000, &ev, &n);
        if (e != ETCD_ERR_PROTOCOL || n != 0) {
            fprintf(stderr, "message %s: got %s\n", bad_msgs[i], etcd_strerror(e));
            exit(1);
        }
        etcd_watch_close(w);
    }

    /* server verdicts inside the stream end the watch */
    struct {
        const char *msg;
        etcd_err want;
    } verdicts[] = {
        {"{\"error\":{\"grpc_code\":7,\"http_code\":403,\"message\":\"permission denied\"}}\n",
         ETCD_ERR_AUTH},
        {"{\"result\":{\"canceled\":true,\"cancel_reason\":\"going away\"}}\n", ETCD_ERR_CANCELED},
        {"{\"result\":{\"canceled\":true,\"compact_revision\":\"42\"}}\n", ETCD_ERR_COMPACTED},
    };
    for (size_t i = 0; i < sizeof(verdicts) / sizeof(verdicts[0]); i++) {
        snprintf(stream, sizeof(stream), STREAM_HDR CREATED "%s", verdicts[i].msg);
        fake_reply s[] = {{.data = stream, .hold_ms = 2000}};
        w = open_watch(s, 1);
        CHECK_OR_EXIT(etcd_watch_next(w, 2000, &ev, &n) == verdicts[i].want && n == 0);
        CHECK_OR_EXIT(etcd_watch_next(w, 10, &ev, &n) == verdicts[i].want);
        if (verdicts[i].want == ETCD_ERR_COMPACTED) CHECK_OR_EXIT(etcd_watch_revision(w) == 42);
        etcd_watch_close(w);
    }

    /* the gateway ends a stream that etcd closed with an error by writing
     * that error without a newline: a member without a leader (14) is left
     * for the next endpoint, the stream resuming after the last event; any
     * other verdict ends the watch */
    fake_reply s9[] = {
        {.data = STREAM_HDR CREATED "{\"result\":{\"events\":[" EV(
             11, "YQ==") "]}}\n"
                         "{\"error\":{\"grpc_code\":14,\"http_code\":503,\"message\":"
                         "\"etcdserver: no leader\",\"http_status\":\"Service "
                         "Unavailable\"}}"},
        {.data = STREAM_HDR CREATED "{\"result\":{\"events\":[" EV(12, "Yg==") "]}}\n",
         .hold_ms = 3000},
    };
    w = open_watch(s9, 2);
    got = test_watch_collect(w, 2, 5000, &ev, &last);
    CHECK_OR_EXIT(got == 2 && last == ETCD_OK && ev[1].kv.mod_revision == 12);
    etcd_events_free(ev, got);
    CHECK_OR_EXIT(strstr(etcd_watch_last_error(w), "etcdserver: no leader (code 14)"));
    fake_last_body(&fk, body, sizeof(body));
    CHECK_OR_EXIT(strstr(body, "\"start_revision\":\"12\""));
    etcd_watch_close(w);
    fake_reply s10[] = {{.data = STREAM_HDR CREATED
                         "{\"error\":{\"grpc_code\":7,\"message\":\"permission denied\"}}"}};
    w = open_watch(s10, 1);
    CHECK_OR_EXIT(etcd_watch_next(w, 2000, &ev, &n) == ETCD_ERR_AUTH && n == 0);
    etcd_watch_close(w);

    /* an open that never gets "created" or gets garbage first */
    etcd_set_timeout(c, 500);
    fake_reply s3[] = {{.data = STREAM_HDR "garbage\n", .hold_ms = 2000}};
    fake_script(&fk, s3, 1);
    etcd_watch *none = NULL;
    CHECK_ERR(c, ETCD_ERR_PROTOCOL, etcd_watch_open(c, "/w/", 1, 0, &none));
    CHECK_OR_EXIT(none == NULL);
    fake_reply s4[] = {{.data = STREAM_HDR, .hold_ms = 3000}};
    fake_script(&fk, s4, 1);
    CHECK_ERR(c, ETCD_ERR_UNAVAILABLE, etcd_watch_open(c, "/w/", 1, 0, &none));
    fake_reply s5[] = {{.data = "HTTP/1.1 400 X\r\nContent-Length: 40\r\nConnection: close\r\n\r\n"
                                "{\"code\":3,\"message\":\"bad watch range\"}  "}};
    fake_script(&fk, s5, 1);
    CHECK_ERR(c, ETCD_ERR_ARG, etcd_watch_open(c, "/w/", 1, 0, &none));
    CHECK_OR_EXIT(strstr(etcd_last_error(c), "bad watch range"));
    etcd_set_timeout(c, 0);

    /* a stream that keeps breaking: UNAVAILABLE after the client timeout,
     * and the watch keeps trying */
    etcd_set_timeout(c, 400);
    fake_reply s6[] = {{.data = STREAM_HDR CREATED}, {.data = NULL}};
    w = open_watch(s6, 2);
    int64_t t0 = mono_now_ms();
    etcd_err e = ETCD_OK;
    while (e == ETCD_OK && mono_now_ms() - t0 < 5000)
        e = etcd_watch_next(w, 100, &ev, &n);
    CHECK_OR_EXIT(e == ETCD_ERR_UNAVAILABLE && strstr(etcd_watch_last_error(w), "still trying"));
    etcd_watch_close(w);
    etcd_set_timeout(c, 0);

    /* a stream that always ends right after "created": reconnects back off
     * instead of hammering the server */
    fake_reply s7[] = {{.data = STREAM_HDR CREATED}};
    w = open_watch(s7, 1);
    t0 = mono_now_ms();
    while (mono_now_ms() - t0 < 1500) {
        e = etcd_watch_next(w, 100, &ev, &n);
        CHECK_OR_EXIT(e == ETCD_OK && n == 0);
    }
    int conns = fake_requests(&fk);
    CHECK_OR_EXIT(conns >= 3 && conns < 30);
    etcd_watch_close(w);
}

static void test_config_errors(void)
{
    etcd_client *x = NULL;
    char err[256];
    struct {
        etcd_config cfg;
        etcd_err want;
        const char *hint;
    } cases[] = {
        {{.endpoints = ""}, ETCD_ERR_ARG, "no etcd endpoints"},
        {{.endpoints = " , "}, ETCD_ERR_ARG, "no etcd endpoints"},
        {{.endpoints = "ftp://127.0.0.1:1"}, ETCD_ERR_ARG, "only http"},
        {{.endpoints = "http://"}, ETCD_ERR_ARG, "scheme://host:port"},
        {{.endpoints = "127.0.0.1:1", .cacert = "/nonexistent/ca.pem"},
         ETCD_ERR_TLS,
         "/nonexistent/ca.pem"},
        {{.endpoints = "127.0.0.1:1", .cert = "/nonexistent/c.pem"}, ETCD_ERR_TLS, "certificate"},
        {{.endpoints = "127.0.0.1:1", .key = "/etc/hostname"}, ETCD_ERR_ARG, "client key"},
        {{.endpoints = "127.0.0.1:1", .user = "u"}, ETCD_ERR_ARG, "password"},
        {{.endpoints = "127.0.0.1:1", .timeout_ms = -1}, ETCD_ERR_ARG, "timeout"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        etcd_err e = etcd_client_new_err(&cases[i].cfg, &x, err, sizeof(err));
        if (e != cases[i].want || x || !strstr(err, cases[i].hint)) {
            fprintf(stderr, "config %zu: got %s (%s)\n", i, etcd_strerror(e), err);
            exit(1);
        }
    }
    CHECK_OR_EXIT(etcd_client_new(NULL, &x) == ETCD_ERR_ARG && x == NULL);

    /* a CA file that is not PEM: refused up front as TLS (GnuTLS would take
     * it as no CA and hang on this server, which never answers TLS) */
    char ca[] = "/tmp/ductile-badca-XXXXXX";
    int fd = mkstemp(ca);
    CHECK_OR_EXIT(fd >= 0 && write(fd, "not a certificate\n", 18) == 18);
    close(fd);
    char eps[128];
    snprintf(eps, sizeof(eps), "https://127.0.0.1:%d", fk.port);
    etcd_config cfg = {.endpoints = eps, .cacert = ca, .timeout_ms = 2000};
    CHECK_OR_EXIT(etcd_client_new_err(&cfg, &x, err, sizeof(err)) == ETCD_ERR_TLS && !x &&
                  strstr(err, "holds no PEM CERTIFICATE"));
    unlink(ca);
}

/* A set's keys are created one by one, and etcd may send a key's events
 * before it has created the next key: the open waits for every "created",
 * keeps those events, and still ends at its deadline when a key never comes.
 * The request's first create_request is padded to end past Go's first 512
 * bytes, so that the gateway has the whole body before it answers. */
static void test_watch_set_order(void)
{
    char k0[300], k1[300];
    memset(k0, 'a', sizeof(k0));
    memcpy(k0, "/w/", 3);
    k0[sizeof(k0) - 1] = 0;
    memcpy(k1, k0, sizeof(k1));
    k1[3] = 'b';
    etcd_watch_key keys[2] = {{.key = k0}, {.key = k1, .prefix = 1}};
    etcd_watch *w = NULL;
    fake_reply late[] = {{.data = STREAM_HDR CREATED "{\"result\":{\"events\":[" EV(
                              11, "YQ==") "]}}\n"
                                          "{\"result\":{\"watch_id\":\"1\",\"created\":true}}\n",
                          .hold_ms = 3000}};
    fake_script(&fk, late, 1);
    CHECK_OK(c, etcd_watch_open_set(c, keys, 2, &w));
    char body[4096];
    fake_last_body(&fk, body, sizeof(body));
    const char *end = NULL;
    cJSON *first = cJSON_ParseWithOpts(body, &end, 0);
    CHECK_OR_EXIT(first && cJSON_GetObjectItem(first, "create_request"));
    CHECK_OR_EXIT(end - body > 512 && strlen(body) <= 1536); /* in Go's second read */
    cJSON *second = cJSON_Parse(end);
    CHECK_OR_EXIT(second && cJSON_GetObjectItem(second, "create_request"));
    cJSON_Delete(first);
    cJSON_Delete(second);
    etcd_event *ev;
    size_t n;
    CHECK_OK(c, etcd_watch_next(w, 2000, &ev, &n)); /* the early event is kept */
    CHECK_OR_EXIT(n == 1 && ev[0].watch == 0 && ev[0].kv.mod_revision == 11);
    etcd_events_free(ev, n);
    etcd_watch_close(w);

    fake_reply never[] = {{.data = STREAM_HDR CREATED "{\"result\":{\"events\":[" EV(
                               11, "YQ==") "]}}\n",
                           .hold_ms = 30000}};
    fake_script(&fk, never, 1);
    w = NULL;
    CHECK_ERR(c, ETCD_ERR_UNAVAILABLE, etcd_watch_open_set(c, keys, 2, &w));
    CHECK_OR_EXIT(!w && strstr(etcd_last_error(c), "not created before the deadline"));
    /* it gave up at its deadline (2 s), not when the stream ended (30 s) */
    CHECK_OR_EXIT(fake_requests(&fk) == 1);
}

int main(void)
{
    CHECK_OR_EXIT(fake_start(&fk) == 0);
    c = test_client(fk.endpoint, 2000);
    test_malformed_answers();
    test_errors_and_retries();
    test_huge_answers();
    test_watch_streams();
    test_watch_set_order();
    test_config_errors();
    etcd_client_free(c);
    fake_stop(&fk);
    printf("test_etcd_badinput: ok\n");
    return 0;
}
