/* status.c: `ductile-agent status` and `ductile-agent reset`: a job in etcd.
 *
 *   ductile-agent status --rdzv-endpoint URL --rdzv-id JOB [--json]
 *   ductile-agent reset  --rdzv-endpoint URL --rdzv-id JOB
 *
 * status: one read through rdzv_get_status(); text for people, --json for
 * scripts (the object rdzv_status_json() makes). Exit 0 when the job was read
 * (even when it does not exist: state "none"), 1 when etcd could not be read,
 * 2 on bad flags.
 *
 * reset: deletes the job's keys (rdzv_reset()), so that its id starts over
 * as a new job: a job that ended (done or failed) keeps its state in etcd,
 * and agents started again under its id would find it ended at once. Exit 0
 * when the keys are gone (or there were none), 1 when etcd could not be
 * written, 2 on bad flags, 3 when an agent of the job is alive (nothing is
 * deleted then).
 */
#include "status.h"

#include "ductile/rdzv.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void status_usage(FILE *f, const char *cmd)
{
    fprintf(f,
            "usage: ductile-agent %s --rdzv-endpoint URL[,URL...] --rdzv-id JOB%s\n"
            "                     [--etcd-cacert F --etcd-cert F --etcd-key F]\n"
            "                     [--etcd-user U --etcd-password P]\n"
            "Flags also come from DUCTILE_RDZV_ENDPOINT, DUCTILE_RDZV_ID, DUCTILE_ETCD_*.\n",
            cmd, strcmp(cmd, "status") == 0 ? " [--json]" : "");
}

/* The flags status and reset share. Returns 0, 1 after --help, or 2 on a bad
 * flag (reported); *json is set by --json when json is not NULL. */
static int job_flags(int argc, char **argv, rdzv_etcd *etcd, const char **job, int *json)
{
    const char *cmd = argv[0];
    etcd->endpoints = getenv("DUCTILE_RDZV_ENDPOINT");
    etcd->cacert = getenv("DUCTILE_ETCD_CACERT");
    etcd->cert = getenv("DUCTILE_ETCD_CERT");
    etcd->key = getenv("DUCTILE_ETCD_KEY");
    etcd->user = getenv("DUCTILE_ETCD_USER");
    etcd->password = getenv("DUCTILE_ETCD_PASSWORD");
    *job = getenv("DUCTILE_RDZV_ID");
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            status_usage(stdout, cmd);
            return 1;
        }
        if (json && strcmp(a, "--json") == 0) {
            *json = 1;
            continue;
        }
        const char *names[] = {"--rdzv-endpoint", "--rdzv-id",   "--etcd-cacert",   "--etcd-cert",
                               "--etcd-key",      "--etcd-user", "--etcd-password", NULL};
        const char **dest[] = {&etcd->endpoints, job,         &etcd->cacert,  &etcd->cert,
                               &etcd->key,       &etcd->user, &etcd->password};
        int k = 0;
        const char *val = NULL;
        for (; names[k]; k++) {
            size_t n = strlen(names[k]);
            if (strncmp(a, names[k], n) == 0 && (a[n] == 0 || a[n] == '=')) {
                val = a[n] == '=' ? a + n + 1 : (i + 1 < argc ? argv[++i] : NULL);
                break;
            }
        }
        if (!names[k]) {
            fprintf(stderr, "ductile-agent %s: unknown flag '%s' (see --help)\n", cmd, a);
            return 2;
        }
        if (!val) {
            fprintf(stderr, "ductile-agent %s: %s needs a value\n", cmd, names[k]);
            return 2;
        }
        *dest[k] = val;
    }
    if (!etcd->endpoints || !*etcd->endpoints) {
        fprintf(stderr, "ductile-agent %s: --rdzv-endpoint is required\n", cmd);
        return 2;
    }
    if (!*job || !rdzv_job_id_valid(*job)) {
        fprintf(stderr, "ductile-agent %s: --rdzv-id must match [a-z0-9][a-z0-9-]{0,62}\n", cmd);
        return 2;
    }
    return 0;
}

static void print_text(const char *job, const rdzv_status *s)
{
    printf("job %s: %s\n", job, s->job_state);
    if (s->reason[0]) printf("reason: %s\n", s->reason);
    printf("round %lld (%s), %d members, restarts %lld of %d\n", (long long)s->round,
           s->round_state[0] ? s->round_state : "none", s->nmembers, (long long)s->restarts,
           s->max_restarts);
    for (int i = 0; i < s->nmembers; i++) {
        const rdzv_member *m = &s->members[i];
        printf("  rank %d  %-24s %-16s ranks %d..%d\n", m->rank, m->node_id, m->addr,
               m->first_global_rank, m->first_global_rank + m->local_world_size - 1);
    }
    printf("live nodes %d:", s->nnodes);
    for (int i = 0; i < s->nnodes; i++)
        printf(" %s", s->nodes[i]);
    printf("\nwaiting %d:", s->nwaiting);
    for (int i = 0; i < s->nwaiting; i++)
        printf(" %s", s->waiting[i]);
    printf("\n");
}

int agent_status_main(int argc, char **argv)
{
    rdzv_etcd etcd = {0};
    const char *job = NULL;
    int json = 0;
    int rc = job_flags(argc, argv, &etcd, &job, &json);
    if (rc != 0) return rc == 1 ? 0 : rc;
    rdzv_status st;
    memset(&st, 0, sizeof(st));
    char msg[RDZV_MSG_MAX] = "";
    rdzv_err err = rdzv_get_status(&etcd, job, &st, msg);
    if (err != RDZV_OK) {
        fprintf(stderr, "ductile-agent status: %s: %s\n", rdzv_strerror(err), msg);
        return 1;
    }
    if (json) {
        char *text = rdzv_status_json(&st);
        if (!text) {
            fprintf(stderr, "ductile-agent status: out of memory\n");
            rdzv_status_free(&st);
            return 1;
        }
        printf("%s\n", text);
        free(text);
    } else {
        print_text(job, &st);
    }
    rdzv_status_free(&st);
    return 0;
}

int agent_reset_main(int argc, char **argv)
{
    rdzv_etcd etcd = {0};
    const char *job = NULL;
    int rc = job_flags(argc, argv, &etcd, &job, NULL);
    if (rc != 0) return rc == 1 ? 0 : rc;
    char msg[RDZV_MSG_MAX] = "";
    int live = 0;
    int64_t deleted = 0;
    rdzv_err err = rdzv_reset(&etcd, job, &live, &deleted, msg);
    if (err != RDZV_OK) {
        fprintf(stderr, "ductile-agent reset: %s: %s\n", rdzv_strerror(err), msg);
        return 1;
    }
    if (live > 0) {
        fprintf(stderr,
                "ductile-agent reset: job %s has %d live node(s) registered: stop its agents "
                "first; nothing deleted\n",
                job, live);
        return 3;
    }
    printf("job %s: %" PRId64 " key(s) deleted\n", job, deleted);
    return 0;
}
