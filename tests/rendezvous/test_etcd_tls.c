/* test_etcd_tls.c: the etcd client against a real etcd serving TLS.
 *
 * The test makes a CA, a server certificate for 127.0.0.1 and a client
 * certificate with openssl, starts etcd with client certificate auth on a
 * free port, and checks that calls and a watch work with the right files and
 * fail with ETCD_ERR_TLS (never a hang, never a silent plain-text fallback)
 * with a wrong CA or without a client certificate.
 */
#include "ductile/etcd.h"
#include "test_etcd.h"
#include "test_etcd_util.h"

#include <signal.h>
#include <unistd.h>

static char dir[256];
static pid_t etcd_pid;

/* A CA, another CA, and server and client certificates signed by the
 * first; 0 when openssl made them all. */
static int make_certs(void)
{
    const char *q = "2>/dev/null";
    if (th_sh("cd %s && openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem "
              "-days 2 -subj /CN=ductile-test-ca %s",
              dir, q) != 0 ||
        th_sh("cd %s && openssl req -x509 -newkey rsa:2048 -nodes -keyout other.key "
              "-out other.pem -days 2 -subj /CN=other-ca %s",
              dir, q) != 0 ||
        th_sh("cd %s && printf 'subjectAltName=IP:127.0.0.1\\nextendedKeyUsage=serverAuth,"
              "clientAuth\\n' > ext.cnf",
              dir) != 0)
        return -1;
    const char *names[] = {"server", "client"};
    for (int i = 0; i < 2; i++)
        if (th_sh("cd %s && openssl req -newkey rsa:2048 -nodes -keyout %s.key -out %s.csr "
                  "-subj /CN=%s %s && openssl x509 -req -in %s.csr -CA ca.pem -CAkey ca.key "
                  "-CAcreateserial -out %s.pem -days 2 -extfile ext.cnf %s",
                  dir, names[i], names[i], names[i], q, names[i], names[i], q) != 0)
            return -1;
    return 0;
}

static void start_etcd(int port, int peer)
{
    char client[64], peer_url[64], cluster[96], data[300], log[300], f[4][300];
    snprintf(client, sizeof(client), "https://127.0.0.1:%d", port);
    snprintf(peer_url, sizeof(peer_url), "http://127.0.0.1:%d", peer);
    snprintf(cluster, sizeof(cluster), "t=%s", peer_url);
    snprintf(data, sizeof(data), "%s/data", dir);
    snprintf(log, sizeof(log), "%s/etcd.log", dir);
    snprintf(f[0], sizeof(f[0]), "%s/server.pem", dir);
    snprintf(f[1], sizeof(f[1]), "%s/server.key", dir);
    snprintf(f[2], sizeof(f[2]), "%s/ca.pem", dir);
    /* one flag and its value a line */
    /* clang-format off */
    char *argv[] = {"etcd", "--name", "t",
                    "--data-dir", data,
                    "--listen-client-urls", client,
                    "--advertise-client-urls", client,
                    "--listen-peer-urls", peer_url,
                    "--initial-advertise-peer-urls", peer_url,
                    "--initial-cluster", cluster,
                    "--cert-file", f[0], "--key-file", f[1], "--trusted-ca-file", f[2],
                    "--client-cert-auth",
                    "--logger", "zap", "--log-level", "warn", NULL};
    /* clang-format on */
    th_spawn_opts o = {.log = log, .die_with_parent = 1};
    etcd_pid = th_spawn(argv, &o);
    CHECK_OR_EXIT(etcd_pid >= 0);
}

static void stop_etcd(void)
{
    th_kill(&etcd_pid);
    if (dir[0]) {
        if (th_sh("rm -rf '%s'", dir) != 0) fprintf(stderr, "could not remove %s\n", dir);
        dir[0] = 0;
    }
}

static etcd_client *tls_client(const char *ep, const char *ca, const char *cert, const char *key,
                               int timeout_ms)
{
    char paths[3][300];
    snprintf(paths[0], sizeof(paths[0]), "%s/%s", dir, ca ? ca : "");
    snprintf(paths[1], sizeof(paths[1]), "%s/%s", dir, cert ? cert : "");
    snprintf(paths[2], sizeof(paths[2]), "%s/%s", dir, key ? key : "");
    etcd_config cfg = {.endpoints = ep,
                       .cacert = ca ? paths[0] : NULL,
                       .cert = cert ? paths[1] : NULL,
                       .key = key ? paths[2] : NULL,
                       .timeout_ms = timeout_ms};
    return test_client_cfg(&cfg);
}

int main(void)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(dir, sizeof(dir), "%s/ductile-tls-XXXXXX", tmp ? tmp : "/tmp");
    CHECK_OR_EXIT(mkdtemp(dir));
    atexit(stop_etcd); /* a failed CHECK exits: still stop etcd and remove the files */
    CHECK_OR_EXIT(make_certs() == 0, "openssl could not make the certificates");
    int port = th_free_port(), peer = th_free_port();
    CHECK_OR_EXIT(port > 0 && peer > 0 && port != peer);
    start_etcd(port, peer);
    char ep[64];
    snprintf(ep, sizeof(ep), "https://127.0.0.1:%d", port);

    /* up within 15 s; the client's own retries absorb the start */
    etcd_client *c = tls_client(ep, "ca.pem", "client.pem", "client.key", 15000);
    int64_t rev;
    if (etcd_put(c, "/tls/k", "v", 1, 0, &rev) != ETCD_OK) {
        fprintf(stderr, "etcd over TLS did not answer: %s\n", etcd_last_error(c));
        stop_etcd();
        return 1;
    }
    etcd_set_timeout(c, 5000);
    etcd_kv kv;
    CHECK_OK(c, etcd_get(c, "/tls/k", &kv));
    CHECK_OR_EXIT(kv.mod_revision == rev && strcmp(kv.value, "v") == 0);
    etcd_kv_free(&kv);
    etcd_watch *w;
    CHECK_OK(c, etcd_watch_open(c, "/tls/", 1, 0, &w));
    CHECK_OK(c, etcd_put(c, "/tls/k2", "w", 1, 0, &rev));
    CHECK_OR_EXIT(test_watch_one_rev(w, 5000) == rev);
    etcd_watch_close(w);
    etcd_client_free(c);

    /* a CA that did not sign the server: verification fails, not retried */
    c = tls_client(ep, "other.pem", "client.pem", "client.key", 3000);
    int64_t t0 = mono_now_ms();
    CHECK_ERR(c, ETCD_ERR_TLS, etcd_get(c, "/tls/k", &kv));
    CHECK_OR_EXIT(mono_now_ms() - t0 < 2500);
    fprintf(stderr, "wrong CA: %s\n", etcd_last_error(c));
    CHECK_ERR(c, ETCD_ERR_TLS, etcd_watch_open(c, "/tls/", 1, 0, &w));
    etcd_client_free(c);

    /* no client certificate: etcd refuses the handshake */
    c = tls_client(ep, "ca.pem", NULL, NULL, 3000);
    CHECK_ERR(c, ETCD_ERR_TLS, etcd_get(c, "/tls/k", &kv));
    fprintf(stderr, "no client cert: %s\n", etcd_last_error(c));
    etcd_client_free(c);

    /* a key file that is not a key */
    c = tls_client(ep, "ca.pem", "client.pem", "ca.pem", 3000);
    CHECK_ERR(c, ETCD_ERR_TLS, etcd_get(c, "/tls/k", &kv));
    fprintf(stderr, "bad key: %s\n", etcd_last_error(c));
    etcd_client_free(c);

    stop_etcd();
    printf("test_etcd_tls: ok\n");
    return 0;
}
