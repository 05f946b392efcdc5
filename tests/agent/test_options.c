/* test_options.c: the agent's options as agent_opts_parse() leaves them
 * (agent/options*.c), for what the command-line tests cannot see: which
 * field a value lands in.
 *
 * --rdzv-conf's TLS keys each set their own flag's field: cacert the CA,
 * cert the client certificate, key the client key.
 */
#include "check.h"
#include "options.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int parse(agent_opts *o, char **argv)
{
    int argc = 0;
    while (argv[argc])
        argc++;
    memset(o, 0, sizeof(*o));
    return agent_opts_parse(argc, argv, o);
}

static int same(const char *a, const char *b)
{
    return a && b && strcmp(a, b) == 0;
}

int main(void)
{
    agent_opts o;
    char *conf[] = {"ductile-agent",
                    "--rdzv-endpoint",
                    "127.0.0.1:2379",
                    "--rdzv-id",
                    "j",
                    "--rdzv-conf",
                    "cacert=/ca.pem,cert=/client.pem,key=/client.key",
                    "--",
                    "true",
                    NULL};
    CHECK(parse(&o, conf) == 0);
    CHECK(same(o.cacert, "/ca.pem"), "cacert %s", o.cacert ? o.cacert : "(none)");
    CHECK(same(o.cert, "/client.pem"), "cert %s", o.cert ? o.cert : "(none)");
    CHECK(same(o.key, "/client.key"), "key %s", o.key ? o.key : "(none)");
    agent_opts_free(&o);

    /* The flags themselves, for the same fields. */
    char *flags[] = {"ductile-agent",
                     "--rdzv-endpoint",
                     "127.0.0.1:2379",
                     "--rdzv-id",
                     "j",
                     "--etcd-cacert",
                     "/a",
                     "--etcd-cert",
                     "/b",
                     "--etcd-key",
                     "/c",
                     "--",
                     "true",
                     NULL};
    CHECK(parse(&o, flags) == 0);
    CHECK(same(o.cacert, "/a") && same(o.cert, "/b") && same(o.key, "/c"));
    agent_opts_free(&o);
    if (check_failures()) return 1;
    printf("ok options\n");
    return 0;
}
