/* test_etcd_fuzz.c: libFuzzer target for the etcd answer parsers.
 *
 * The first byte of an input picks the parser ('0'..'8' in the committed
 * corpus so its files stay readable), the rest is the answer's body. Every
 * parser must return a code and free what it made, whatever the bytes; base64
 * must also round-trip whatever it decodes. test_etcd_fuzz_replay.c runs the
 * same function over the corpus in builds without libFuzzer.
 */
#include "etcd_internal.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check(int cond)
{
    if (!cond) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0) return 0;
    unsigned sel = data[0] >= '0' && data[0] <= '8' ? (unsigned)(data[0] - '0') : data[0] % 9u;
    const char *body = (const char *)data + 1;
    size_t len = size - 1;
    char err[256];
    int64_t a, b;
    switch (sel) {
    case 0: {
        etcd_range_result r;
        if (etcd_parse_range(body, len, &r, err, sizeof(err)) == ETCD_OK) {
            for (size_t i = 0; i < r.n; i++)
                check(r.kvs[i].key && r.kvs[i].value);
            etcd_range_result_free(&r);
        }
        break;
    }
    case 1: {
        etcd_txn_result t;
        if (etcd_parse_txn(body, len, &t, err, sizeof(err)) == ETCD_OK) etcd_txn_result_free(&t);
        break;
    }
    case 2:
        etcd_parse_header(body, len, &a, &b, err, sizeof(err));
        break;
    case 3:
        etcd_parse_lease(body, len, 0, &a, &b, err, sizeof(err));
        break;
    case 4:
        etcd_parse_lease(body, len, 1, &a, &b, err, sizeof(err));
        break;
    case 5: {
        char *token = NULL;
        if (etcd_parse_token(body, len, &token, err, sizeof(err)) == ETCD_OK) {
            check(token && !strpbrk(token, "\r\n"));
            free(token);
        }
        break;
    }
    case 6: {
        etcd_watch_msg m;
        if (etcd_parse_watch_msg(body, len, &m, err, sizeof(err)) == ETCD_OK) {
            for (size_t i = 0; i < m.n; i++)
                check(m.events[i].kv.key != NULL);
            etcd_watch_msg_free(&m);
        }
        break;
    }
    case 7: {
        int code;
        char msg[200];
        etcd_parse_error(body, len, &code, msg, sizeof(msg));
        break;
    }
    default: {
        char *out;
        size_t outlen;
        if (etcd_b64_decode(body, len, &out, &outlen) == 0) {
            char *again = etcd_b64_encode(out, outlen);
            check(again && strlen(again) == len && memcmp(again, body, len) == 0);
            free(again);
            free(out);
        }
        break;
    }
    }
    return 0;
}
