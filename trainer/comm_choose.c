/* comm_choose.c: how a round's ranks meet, decided once, by rank 0.
 *
 * Every rank of a round of world >= 2, on CUDA or the CPU, publishes how it can join as
 * "host/<rank>" in the round store: "KIND NODE HOST", where KIND is
 * "cuda" (NCCL), "cpu" (shared memory or the ring, rank 0 chooses), "shm"
 * (--comm shm: shared memory or nothing) or "ring" (--comm ring), NODE is
 * the agent's node id and HOST says which kernel and network namespace the
 * rank runs in (the boot id and the namespace's inode: ranks with one HOST
 * can share memory). A CPU rank 0 reads them all and publishes
 * "transport"; a CUDA rank 0 publishes "nccl NODE" at once, with the NCCL
 * id, and reads nothing (its peers' NCCL bootstrap waits as before):
 *   "nccl NODE"              rank 0 is on CUDA: a CPU rank that reads this
 *                            fails at once, naming itself, and its agent's
 *                            failure report ends the round for everyone;
 *   "hosts H0 H1 ..."        the CPU, each rank's host index (in order of
 *                            first appearance): shared memory within a
 *                            host, the ring among hosts (comm_cpu.c);
 *   "ring"                   the CPU, the ring alone (a rank forced to it
 *                            sits on a host of its own, or a host has more
 *                            ranks than a segment takes);
 *   "refused REASON"         the round cannot work: a CPU rank among CUDA
 *                            ranks (a node whose --device auto found no
 *                            GPU), or --comm shm where the ranks span
 *                            hosts. Every rank fails with that one line at
 *                            once instead of waiting out its peers'
 *                            bootstrap, which never comes: a CPU rank 0
 *                            that finds a CUDA rank writes the line as the
 *                            NCCL id too, which the CUDA ranks wait for.
 * So ranks given different devices or --comm agree, or all stop, before
 * any of them starts a bootstrap the others would not join.
 */
#include "comm_impl.h"
#include "comm_ring.h"
#include "ductile/control.h" /* DUCTILE_NODE_ID */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define REFUSED "refused "
#define HOST_VALUE_MAX 304 /* a published "KIND NODE HOST": the fields below and two blanks */

/* One published "KIND NODE HOST", split in place. */
typedef struct {
    char kind[8];
    char node[128];
    char host[160];
} choose_entry;

static int entry_parse(const char *v, size_t len, choose_entry *e)
{
    char fmt[32];
    if (len >= HOST_VALUE_MAX || memchr(v, '\0', len)) return -1;
    char buf[HOST_VALUE_MAX];
    memcpy(buf, v, len);
    buf[len] = '\0';
    snprintf(fmt, sizeof(fmt), "%%%zus %%%zus %%%zus", sizeof(e->kind) - 1, sizeof(e->node) - 1,
             sizeof(e->host) - 1);
    int k = 0;
    if (sscanf(buf, fmt, e->kind, e->node, e->host) != 3) return -1;
    if (sscanf(buf, "%*s %*s %*s %n", &k) < 0 || buf[k] != '\0') return -1;
    return strcmp(e->kind, "cuda") && strcmp(e->kind, "cpu") && strcmp(e->kind, "shm") &&
                   strcmp(e->kind, "ring")
               ? -1
               : 0;
}

/* The line of a round with a CPU rank among CUDA ranks, into v (len). */
static void mixed_line(char *v, size_t len, int cpu, const char *cpu_node, int cuda,
                       const char *cuda_node)
{
    snprintf(v, len,
             "rank %d (node %.40s) has no CUDA device and trains on the CPU, rank %d (node "
             "%.40s) on CUDA: a round's ranks must share one device",
             cpu, cpu_node, cuda, cuda_node);
}

/* Rank 0: the verdict for the round from every rank's entry, into v
 * (COMM_MSG_MAX + 12 * world bytes). */
static void choose_verdict(const choose_entry *e, int w, int *host_of, int *count, char *v)
{
    int cuda = -1, cpu = -1, shm_only = -1, nhosts = 0, ring = 0;
    for (int r = 0; r < w; r++) {
        if (strcmp(e[r].kind, "cuda") == 0) {
            if (cuda < 0) cuda = r;
        } else if (cpu < 0) {
            cpu = r;
        }
    }
    if (cuda >= 0 && cpu >= 0) {
        strcpy(v, REFUSED);
        mixed_line(v + strlen(REFUSED), COMM_MSG_MAX - strlen(REFUSED), cpu, e[cpu].node, cuda,
                   e[cuda].node);
        return;
    }
    size_t k = (size_t)sprintf(v, "hosts");
    for (int r = 0; r < w; r++) {
        int j = 0;
        /* A rank forced to the ring is a host of its own. */
        while (j < r && (strcmp(e[j].host, e[r].host) != 0 || strcmp(e[r].kind, "ring") == 0 ||
                         strcmp(e[j].kind, "ring") == 0))
            j++;
        host_of[r] = j < r ? host_of[j] : nhosts++;
        if (++count[host_of[r]] > SHM_MAX_RANKS) ring = 1;
        if (shm_only < 0 && strcmp(e[r].kind, "shm") == 0) shm_only = r;
        k += (size_t)sprintf(v + k, " %d", host_of[r]);
    }
    if (ring) strcpy(v, "ring");
    if (shm_only >= 0 && ring)
        snprintf(v, COMM_MSG_MAX,
                 REFUSED "--comm shm (rank %d, node %.40s): a host has over %d ranks", shm_only,
                 e[shm_only].node, SHM_MAX_RANKS);
    else if (shm_only >= 0 && nhosts > 1)
        snprintf(v, COMM_MSG_MAX,
                 REFUSED "--comm shm (rank %d, node %.40s) needs every rank on one host; the "
                         "round's ranks are on %d hosts",
                 shm_only, e[shm_only].node, nhosts);
}

/* Rank 0: reads every rank's entry, publishes the verdict. */
static comm_err choose_decide(comm *c, const comm_config *cfg, const choose_entry *mine,
                              int64_t deadline)
{
    int w = cfg->world_size;
    choose_entry *e = calloc((size_t)w, sizeof(*e));
    int *host_of = calloc((size_t)w, sizeof(int)), *count = calloc((size_t)w, sizeof(int));
    char *v = malloc(COMM_MSG_MAX + 12 * (size_t)w);
    comm_err err = COMM_OK;
    if (!e || !host_of || !count || !v) {
        err = comm_fail(c, COMM_ERR_NOMEM, "out of memory");
        goto out;
    }
    e[0] = *mine;
    for (int r = 1; r < w; r++) {
        char key[32];
        void *val = NULL;
        size_t len = 0;
        snprintf(key, sizeof(key), "host/%d", r);
        rdzv_err re = rdzv_store_wait(cfg->store, key, ring_ms_left(deadline), &val, &len);
        if (re != RDZV_OK) {
            err = comm_store_error(c, cfg->store, re, "waiting for the ranks' hosts");
            goto out;
        }
        int bad = entry_parse(val, len, &e[r]);
        free(val);
        if (bad) {
            err = comm_fail(c, COMM_ERR_STORE, "malformed host/%d in the round store", r);
            goto out;
        }
    }
    choose_verdict(e, w, host_of, count, v);
    rdzv_err re = rdzv_store_set(cfg->store, "transport", v, strlen(v));
    if (re != RDZV_OK) err = comm_store_error(c, cfg->store, re, "publishing the transport");
    /* CUDA ranks wait for rank 0's NCCL id, not for the transport. */
    int cuda = 0;
    for (int r = 0; r < w; r++)
        cuda |= strcmp(e[r].kind, "cuda") == 0;
    if (err == COMM_OK && cuda) re = rdzv_store_set(cfg->store, "nccl/id", v, strlen(v));
    if (err == COMM_OK && re != RDZV_OK)
        err = comm_store_error(c, cfg->store, re, "publishing the refusal as the NCCL id");
out:
    free(e);
    free(host_of);
    free(count);
    free(v);
    return err;
}

/* "hosts H0 H1 ..." into host_of (world entries): 0 or -1. A host index
 * names a host seen before or the next one, and no host holds more ranks
 * than a segment takes: a forged value cannot size the segment's arrays. */
static int parse_hosts(const char *v, int w, int *host_of)
{
    if (strncmp(v, "hosts", 5) != 0) return -1;
    int *count = calloc((size_t)w, sizeof(int)), nhosts = 0, bad = 0;
    if (!count) return -1;
    const char *p = v + 5;
    for (int r = 0; r < w && !bad; r++) {
        char *end;
        long h = strtol(p, &end, 10);
        if (end == p || h < 0 || h > nhosts || ++count[h] > SHM_MAX_RANKS) {
            bad = 1;
            break;
        }
        if (h == nhosts) nhosts++;
        host_of[r] = (int)h;
        p = end;
    }
    free(count);
    return bad || *p ? -1 : 0;
}

/* This rank's entry: KIND NODE HOST. */
static void entry_of(const comm_config *cfg, int cuda, choose_entry *me)
{
    const char *node = getenv(CTL_ENV_NODE_ID);
    snprintf(me->kind, sizeof(me->kind), "%s",
             cuda                                    ? "cuda"
             : cfg->transport == COMM_TRANSPORT_RING ? "ring"
             : cfg->transport == COMM_TRANSPORT_SHM  ? "shm"
                                                     : "cpu");
    snprintf(me->node, sizeof(me->node), "%s",
             node && *node && !strpbrk(node, " \t\n") ? node : "-");
    if (cfg->host_id && *cfg->host_id && !strpbrk(cfg->host_id, " \t\n"))
        snprintf(me->host, sizeof(me->host), "%s", cfg->host_id);
    else if (comm_host_id(me->host, sizeof(me->host)) < 0)
        snprintf(me->host, sizeof(me->host), "unknown-%d", cfg->rank);
}

static comm_err publish_entry(comm *c, const comm_config *cfg, const choose_entry *me)
{
    char value[sizeof(me->kind) + sizeof(me->node) + sizeof(me->host)], key[32];
    snprintf(value, sizeof(value), "%s %s %s", me->kind, me->node, me->host);
    snprintf(key, sizeof(key), "host/%d", cfg->rank);
    rdzv_err re = rdzv_store_set(cfg->store, key, value, strlen(value));
    return re == RDZV_OK ? COMM_OK : comm_store_error(c, cfg->store, re, "publishing the host");
}

comm_err comm_choose_nccl(comm *c, const comm_config *cfg)
{
    choose_entry me;
    entry_of(cfg, 1, &me);
    comm_err err = publish_entry(c, cfg, &me);
    if (err != COMM_OK || cfg->rank != 0) return err;
    char v[sizeof(me.node) + 8];
    snprintf(v, sizeof(v), "nccl %s", me.node);
    rdzv_err re = rdzv_store_set(cfg->store, "transport", v, strlen(v));
    return re == RDZV_OK ? COMM_OK
                         : comm_store_error(c, cfg->store, re, "publishing the transport");
}

const char *comm_choose_refused(const char *v, size_t len)
{
    size_t k = strlen(REFUSED);
    return len >= k && strncmp(v, REFUSED, k) == 0 ? v + k : NULL;
}

comm_err comm_choose(comm *c, const comm_config *cfg, int64_t deadline, int **host_of)
{
    choose_entry me;
    *host_of = NULL;
    entry_of(cfg, 0, &me);
    comm_err err = publish_entry(c, cfg, &me);
    if (err != COMM_OK) return err;
    if (cfg->rank == 0 && (err = choose_decide(c, cfg, &me, deadline)) != COMM_OK) return err;
    void *val = NULL;
    size_t len = 0;
    rdzv_err re = rdzv_store_wait(cfg->store, "transport", ring_ms_left(deadline), &val, &len);
    if (re != RDZV_OK) return comm_store_error(c, cfg->store, re, "waiting for rank 0's transport");
    const char *v = val, *why = NULL;
    if (len > COMM_MSG_MAX + 12 * (size_t)cfg->world_size || memchr(v, '\0', len)) {
        err = comm_fail(c, COMM_ERR_STORE, "malformed transport in the round store");
    } else if ((why = comm_choose_refused(v, len))) {
        err = comm_fail(c, COMM_ERR_ARG, "%s", why);
    } else if (strncmp(v, "nccl ", 5) == 0) {
        char line[COMM_MSG_MAX];
        mixed_line(line, sizeof(line), cfg->rank, me.node, 0, v + 5);
        err = comm_fail(c, COMM_ERR_ARG, "%s", line);
    } else if (strcmp(v, "ring") != 0) {
        *host_of = malloc(sizeof(int) * (size_t)cfg->world_size);
        if (!*host_of)
            err = comm_fail(c, COMM_ERR_NOMEM, "out of memory");
        else if (parse_hosts(v, cfg->world_size, *host_of) < 0)
            err = comm_fail(c, COMM_ERR_STORE, "malformed transport '%.60s'", v);
    }
    if (err != COMM_OK) {
        free(*host_of);
        *host_of = NULL;
    }
    free(val);
    return err;
}
