/* comm_cpu.c: which CPU transport a round uses (comm_cpu_init), and
 * building it.
 *
 * Rank 0 chooses for the round from what every rank publishes
 * (comm_choose.c: its device, node and host, the boot id and network
 * namespace that say "same kernel, same abstract socket namespace"), and
 * every rank follows. One host: shared memory alone (comm_shm.c); a host
 * each: the ring (comm_ring.c); else both (comm_hier.c: shared memory on
 * each host, the ring among one leader per host). --comm forces the ring
 * or shared memory alone.
 *
 * Failpoint (ductile/failpoint.h): shm.connect (counted per comm_cpu_init
 * bootstrap of world >= 2 not forced to the ring) with action fail fails
 * it at once with a timeout, publishing nothing, so its peers time out too.
 */
#include "comm_ring.h"
#include "comm_shm.h"
#include "ductile/clock.h"

#include <stdlib.h>

/* Builds this rank's parts by host_of: the segment of its host (when it
 * shares the host), and on a host's leader (its lowest rank) the ring
 * among leaders; then the comm that joins them. */
static comm_err cpu_build(comm *c, const comm_config *cfg, const int *host_of, int64_t deadline,
                          comm **out, char *why)
{
    int w = cfg->world_size, me = cfg->rank, nhosts = 0, lrank = 0, lworld = 0;
    for (int r = 0; r < w; r++) {
        if (host_of[r] + 1 > nhosts) nhosts = host_of[r] + 1;
        if (host_of[r] == host_of[me]) {
            if (r < me) lrank++;
            lworld++;
        }
    }
    if (cfg->transport == COMM_TRANSPORT_SHM && nhosts > 1)
        return comm_fail(c, COMM_ERR_ARG, "--comm shm needs every rank on one host (%d hosts)",
                         nhosts);
    if (nhosts == w) return comm_ring_init(cfg, out); /* one rank per host */
    if (nhosts == 1) return shm_group(cfg, host_of, me, w, 0, deadline, out, why);
    comm *local = NULL, *leaders = NULL;
    comm_err err = COMM_OK;
    if (lworld > 1)
        err = shm_group(cfg, host_of, lrank, lworld, host_of[me], deadline, &local, why);
    if (err == COMM_OK && lrank == 0) {
        comm_config lc = *cfg;
        lc.rank = host_of[me];
        lc.world_size = nhosts;
        lc.msg = why;
        err = comm_ring_init(&lc, &leaders);
    }
    if (err == COMM_OK) err = comm_hier_new(cfg, host_of, local, leaders, out);
    if (err != COMM_OK) {
        comm_free(local);
        comm_free(leaders);
    }
    return err;
}

comm_err comm_cpu_init(const comm_config *cfg, comm **out)
{
    if (!out) return COMM_ERR_ARG;
    *out = NULL;
    if (!cfg || cfg->world_size < 1 || cfg->rank < 0 || cfg->rank >= cfg->world_size)
        return COMM_ERR_ARG;
    /* A rank forced to the ring still takes part in the decision (it
     * publishes a host of its own), so that ranks given different --comm
     * agree instead of waiting for each other's bootstrap. */
    if (cfg->world_size == 1 || (cfg->transport == COMM_TRANSPORT_RING && !cfg->store))
        return comm_ring_init(cfg, out);
    if (!cfg->store) return comm_init_failed(cfg, COMM_ERR_ARG, "no round store");
    /* A comm of its own for the bootstrap's errors: the one built may be
     * a ring, a segment or both. */
    shm *boot = NULL;
    comm_err err = shm_new(cfg, cfg->rank, cfg->world_size, &boot);
    if (err != COMM_OK) return comm_init_failed(cfg, err, NULL);
    char why[COMM_MSG_MAX] = "";
    int *host_of = NULL;
    int64_t deadline = mono_now_ms() + boot->timeout_ms;
    if (cfg->transport != COMM_TRANSPORT_RING && ring_failpoint("shm.connect", "fail"))
        err = comm_fail(&boot->base, COMM_ERR_TIMEOUT,
                        "the ranks did not meet (failpoint shm.connect)");
    else
        err = comm_choose(&boot->base, cfg, deadline, &host_of);
    if (err == COMM_OK && !host_of) {
        if (cfg->transport == COMM_TRANSPORT_SHM)
            err = comm_fail(&boot->base, COMM_ERR_ARG,
                            "--comm shm: rank 0 chose the ring (a host has over %d ranks)",
                            SHM_MAX_RANKS);
        else
            err = comm_ring_init(cfg, out); /* says why in cfg->msg itself */
    } else if (err == COMM_OK) {
        err = cpu_build(&boot->base, cfg, host_of, deadline, out, why);
    }
    if (err != COMM_OK && boot->base.last_error[0])
        comm_init_failed(cfg, err, boot->base.last_error);
    else if (err != COMM_OK && why[0])
        comm_init_failed(cfg, err, why);
    free(host_of);
    shm_destroy(&boot->base);
    return err;
}
