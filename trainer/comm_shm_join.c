/* comm_shm_join.c: the join handshake, by which one host's ranks come to
 * share a segment (comm_shm.c).
 *
 * The host's leader (its lowest rank) makes the segment, listens on an
 * abstract AF_UNIX socket (a random name, so rounds and jobs never collide;
 * abstract names vanish with the process) and publishes it with a nonce as
 * "shm/<host>"; each other rank of the host connects, proves it read the
 * store by echoing the nonce, and gets back by SCM_RIGHTS the memfd and its
 * ends of the socket pairs. The connection to the leader is that pair's
 * liveness socket. comm_host_id says which ranks share a host this way.
 */
#include "comm_ring.h"
#include "comm_shm.h"
#include "ductile/clock.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define SHM_HELLO_MS 2000
#define SHM_HELLO_MAGIC 0x4f4c4c45484d4853ull  /* "SHMHELLO" */
#define SHM_ANSWER_MAGIC 0x5245575341484d53ull /* "SHMASWER" */

typedef struct shm_hello {
    uint64_t magic;
    uint32_t rank, world;
    uint64_t nonce;
} shm_hello;

typedef struct shm_answer {
    uint64_t magic;
    uint32_t world, slot;
    uint64_t seg_bytes;
} shm_answer;

/* "BOOTID-NETNS": ranks with the same one share a kernel and an abstract
 * socket namespace, so they can pass a memfd. 0 or -1. */
int comm_host_id(char *out, size_t len)
{
    char boot[64] = "";
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "re");
    if (!f) return -1;
    int ok = fgets(boot, sizeof(boot), f) != NULL;
    fclose(f);
    struct stat st;
    if (!ok || stat("/proc/self/ns/net", &st) < 0) return -1;
    boot[strcspn(boot, "\n")] = '\0';
    snprintf(out, len, "%s-%llx-%llx", boot, (unsigned long long)st.st_dev,
             (unsigned long long)st.st_ino);
    return 0;
}

static socklen_t shm_sockaddr(const char *name, struct sockaddr_un *sa)
{
    memset(sa, 0, sizeof(*sa));
    sa->sun_family = AF_UNIX;
    size_t n = strlen(name);
    memcpy(sa->sun_path + 1, name, n); /* abstract: a leading NUL */
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

/* Reads exactly len bytes (and, when fds is set, up to nfds descriptors
 * with them) before the deadline: 0 or an errno. */
static int recv_msg(int fd, void *buf, size_t len, int *fds, int nfds, int64_t deadline)
{
    for (;;) {
        int w = ring_wait_fd(fd, POLLIN, deadline);
        if (w == 0) return ETIMEDOUT;
        if (w < 0) return errno;
        union {
            char b[CMSG_SPACE(sizeof(int) * SHM_MAX_RANKS)];
            struct cmsghdr align;
        } ctl;
        struct iovec iov = {buf, len};
        struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
        if (fds) {
            m.msg_control = ctl.b;
            m.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
        }
        ssize_t k = recvmsg(fd, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (k < 0) return errno;
        int got = 0;
        for (struct cmsghdr *cm = fds ? CMSG_FIRSTHDR(&m) : NULL; cm; cm = CMSG_NXTHDR(&m, cm))
            if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
                int n = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
                for (int i = 0; i < n; i++) {
                    int x;
                    memcpy(&x, CMSG_DATA(cm) + (size_t)i * sizeof(int), sizeof(int));
                    if (got < nfds)
                        fds[got++] = x;
                    else
                        close(x);
                }
            }
        if ((size_t)k != len || (fds && (got != nfds || (m.msg_flags & MSG_CTRUNC)))) {
            for (int i = 0; i < got; i++)
                close(fds[i]);
            return k == 0 ? ECONNRESET : EPROTO;
        }
        return 0;
    }
}

static int send_msg(int fd, const void *buf, size_t len, const int *fds, int nfds)
{
    union {
        char b[CMSG_SPACE(sizeof(int) * SHM_MAX_RANKS)];
        struct cmsghdr align;
    } ctl;
    struct iovec iov = {(void *)buf, len};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
    if (nfds > 0) {
        memset(&ctl, 0, sizeof(ctl));
        m.msg_control = ctl.b;
        m.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
        struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
        memcpy(CMSG_DATA(cm), fds, sizeof(int) * (size_t)nfds);
    }
    ssize_t k;
    do
        k = sendmsg(fd, &m, MSG_NOSIGNAL);
    while (k < 0 && errno == EINTR);
    if (k < 0) return errno;
    return (size_t)k == len ? 0 : EPROTO;
}

/* Rank 0: makes the segment and the liveness pairs, and hands each rank
 * its share as it connects. */
static comm_err shm_serve(shm *g, int lfd, uint64_t nonce, int64_t deadline)
{
    int w = g->base.world_size;
    comm_err err = COMM_OK;
    int memfd = memfd_create("ductile-shm", MFD_CLOEXEC);
    if (memfd < 0) return shm_fail(g, COMM_ERR_SYS, "memfd_create: %s", strerror(errno));
    size_t bytes = shm_seg_bytes(w);
    /* pair[i][j] (i < j, both > 0): [0] is i's end, [1] j's. */
    int(*pair)[SHM_MAX_RANKS][2] = calloc(SHM_MAX_RANKS, sizeof(*pair));
    if (!pair) {
        close(memfd);
        return shm_fail(g, COMM_ERR_NOMEM, "out of memory");
    }
    for (int i = 0; i < w; i++)
        for (int j = 0; j < w; j++)
            pair[i][j][0] = pair[i][j][1] = -1;
    if (ftruncate(memfd, (off_t)bytes) < 0) {
        err = shm_fail(g, COMM_ERR_SYS, "sizing the segment: %s", strerror(errno));
        goto out;
    }
    if ((err = shm_map(g, memfd, bytes)) != COMM_OK) goto out;
    for (int i = 1; i < w; i++)
        for (int j = i + 1; j < w; j++)
            if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, pair[i][j]) <
                0) {
                err = shm_fail(g, COMM_ERR_SYS, "socketpair: %s", strerror(errno));
                goto out;
            }
    int joined = 0, rejected = 0;
    while (joined < w - 1) {
        int x = ring_wait_fd(lfd, POLLIN, deadline);
        if (x <= 0) {
            err = shm_fail(g, x == 0 ? COMM_ERR_TIMEOUT : COMM_ERR_SYS,
                           "%d of %d local ranks connected (%d stray connections refused)", joined,
                           w - 1, rejected);
            goto out;
        }
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) continue;
        struct ucred cred;
        socklen_t cl = sizeof(cred);
        shm_hello hi;
        int64_t hd = mono_now_ms() + SHM_HELLO_MS;
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) < 0 || cred.uid != getuid() ||
            recv_msg(fd, &hi, sizeof(hi), NULL, 0, hd < deadline ? hd : deadline) != 0 ||
            hi.magic != SHM_HELLO_MAGIC || hi.nonce != nonce || hi.world != (uint32_t)w ||
            hi.rank == 0 || hi.rank >= (uint32_t)w || g->peer_fd[hi.rank] >= 0) {
            close(fd);
            rejected++;
            continue;
        }
        int r = (int)hi.rank, fds[SHM_MAX_RANKS], n = 0;
        fds[n++] = memfd;
        for (int j = 1; j < w; j++)
            if (j != r) fds[n++] = r < j ? pair[r][j][0] : pair[j][r][1];
        shm_answer an = {SHM_ANSWER_MAGIC, (uint32_t)w, SHM_SLOT, bytes};
        int e = send_msg(fd, &an, sizeof(an), fds, n);
        if (e != 0) {
            close(fd);
            err = shm_fail(g, COMM_ERR_PEER, "handing rank %d the segment: %s", shm_job_rank(g, r),
                           strerror(e));
            goto out;
        }
        for (int j = 1; j < w; j++) { /* r holds its ends now */
            int *end = r < j ? &pair[r][j][0] : &pair[j][r][1];
            if (j != r && *end >= 0) close(*end), *end = -1;
        }
        shm_add_peer(g, r, fd);
        joined++;
    }
out:
    for (int i = 0; i < w; i++)
        for (int j = 0; j < w; j++)
            for (int s = 0; s < 2; s++)
                if (pair[i][j][s] >= 0) close(pair[i][j][s]);
    free(pair);
    close(memfd);
    return err;
}

/* Ranks 1..W-1: connect to rank 0, get the segment and the pairs. */
static comm_err shm_join(shm *g, const char *name, uint64_t nonce, int64_t deadline)
{
    int w = g->base.world_size, r = g->base.rank;
    struct sockaddr_un sa;
    socklen_t sl = shm_sockaddr(name, &sa);
    int fd = -1, e = 0;
    for (;;) {
        /* Non-blocking: with rank 0's backlog full (strays) connect says
         * EAGAIN instead of blocking past the deadline. */
        fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) return shm_fail(g, COMM_ERR_SYS, "socket: %s", strerror(errno));
        if (connect(fd, (struct sockaddr *)&sa, sl) == 0) {
            fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
            break;
        }
        e = errno;
        close(fd);
        fd = -1;
        if ((e != ECONNREFUSED && e != EAGAIN && e != ENOENT) || mono_now_ms() >= deadline)
            return shm_fail(g, COMM_ERR_PEER, "cannot connect to rank 0's socket: %s", strerror(e));
        struct timespec pause = {0, 20 * 1000000};
        nanosleep(&pause, NULL);
    }
    shm_hello hi = {SHM_HELLO_MAGIC, (uint32_t)r, (uint32_t)w, nonce};
    shm_answer an;
    int fds[SHM_MAX_RANKS];
    e = send_msg(fd, &hi, sizeof(hi), NULL, 0);
    if (e == 0) e = recv_msg(fd, &an, sizeof(an), fds, w - 1, deadline);
    if (e != 0) {
        close(fd);
        return shm_fail(g, e == ETIMEDOUT ? COMM_ERR_TIMEOUT : COMM_ERR_PEER,
                        "no segment from rank 0: %s", strerror(e));
    }
    shm_add_peer(g, 0, fd);
    for (int j = 1, i = 1; j < w; j++)
        if (j != r) shm_add_peer(g, j, fds[i++]);
    comm_err err = COMM_OK;
    if (an.magic != SHM_ANSWER_MAGIC || an.world != (uint32_t)w || an.slot != SHM_SLOT ||
        an.seg_bytes != shm_seg_bytes(w))
        err = shm_fail(g, COMM_ERR_PEER, "rank 0 runs a different segment layout");
    else
        err = shm_map(g, fds[0], an.seg_bytes);
    close(fds[0]);
    return err;
}

/* The leader's half of a group's meeting: a random abstract socket, with
 * its name and nonce published as "shm/<host>". */
static comm_err shm_listen(shm *g, rdzv_store *store, int host, int *lfd, uint64_t *nonce)
{
    uint64_t rnd[2];
    if (getrandom(rnd, sizeof(rnd), 0) != (ssize_t)sizeof(rnd) ||
        getrandom(nonce, sizeof(*nonce), 0) != (ssize_t)sizeof(*nonce))
        return shm_fail(g, COMM_ERR_SYS, "getrandom: %s", strerror(errno));
    char name[64], key[32], v[128];
    snprintf(name, sizeof(name), "ductile-shm-%016" PRIx64 "%016" PRIx64, rnd[0], rnd[1]);
    struct sockaddr_un sa;
    socklen_t sl = shm_sockaddr(name, &sa);
    *lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (*lfd < 0 || bind(*lfd, (struct sockaddr *)&sa, sl) < 0 || listen(*lfd, 64) < 0)
        return shm_fail(g, COMM_ERR_SYS, "listening on an abstract socket: %s", strerror(errno));
    snprintf(key, sizeof(key), "shm/%d", host);
    snprintf(v, sizeof(v), "%s %016" PRIx64, name, *nonce);
    rdzv_err re = rdzv_store_set(store, key, v, strlen(v));
    if (re != RDZV_OK)
        return comm_store_error(&g->base, store, re, "publishing the segment's socket");
    return COMM_OK;
}

/* One host's ranks (lrank of lworld; the job's ranks r with host_of[r] ==
 * host) build their segment: the leader (lrank 0) serves it, the others
 * join. On failure *why says why. */
comm_err shm_group(const comm_config *cfg, const int *host_of, int lrank, int lworld, int host,
                   int64_t deadline, comm **out, char *why)
{
    shm *g = NULL;
    comm_err err = shm_new(cfg, lrank, lworld, &g);
    if (err != COMM_OK) return err;
    for (int r = 0, j = 0; r < cfg->world_size && j < SHM_MAX_RANKS; r++)
        if (host_of[r] == host) g->grank[j++] = r;
    if (lrank == 0) {
        int lfd = -1;
        uint64_t nonce = 0;
        err = shm_listen(g, cfg->store, host, &lfd, &nonce);
        if (err == COMM_OK) err = shm_serve(g, lfd, nonce, deadline);
        if (lfd >= 0) close(lfd);
    } else {
        char key[32], name[64];
        void *val = NULL;
        size_t len = 0;
        uint64_t nonce;
        snprintf(key, sizeof(key), "shm/%d", host);
        rdzv_err re = rdzv_store_wait(cfg->store, key, ring_ms_left(deadline), &val, &len);
        if (re != RDZV_OK)
            err = comm_store_error(&g->base, cfg->store, re, "waiting for the segment's socket");
        else if (sscanf(val, "%63s %" SCNx64, name, &nonce) != 2)
            err = comm_fail(&g->base, COMM_ERR_STORE, "malformed segment socket '%s'", (char *)val);
        else
            err = shm_join(g, name, nonce, deadline);
        free(val);
    }
    /* Every rank has its segment: the first barrier says all mapped it. */
    if (err == COMM_OK) err = shm_barrier_wait(g);
    if (err != COMM_OK) {
        snprintf(why, COMM_MSG_MAX, "%s", g->base.last_error);
        shm_destroy(&g->base);
        return err;
    }
    *out = &g->base;
    return COMM_OK;
}
