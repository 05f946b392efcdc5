/* test_worker.c: a worker for the agent's tests.
 *
 * It reports what the agent gave it and does what the test tells it, so a
 * test can check the environment contract and drive every way a worker ends.
 *
 *   $AGENT_TEST_DIR/w.<pid>.env   its environment (KEY=VALUE lines), written
 *                                 once at start (temp file + rename)
 *   $AGENT_TEST_DIR/w.<pid>.log   one line per thing that happened: start,
 *                                 round/abort/stop/hello messages from the
 *                                 control channel, term, term-ignored,
 *                                 peer-lost
 *   $AGENT_TEST_DIR/cmd.<pid>     a command for this worker, or
 *   $AGENT_TEST_DIR/cmd.all       one for every worker (checked every 50 ms):
 *       exit N | segv | abort | hang | ignore-term | fail REASON | peer-lost
 *       | segv-on-term (crash when the agent's SIGTERM comes)
 *       | bad-step (send one invalid `step` line)
 * Every 0.5 s it says `step K samples 32K loss 2/K` (stall: `phase` alone).
 *
 * After `ready` it says `hello 1 inplace` (it keeps its process across rounds
 * and reads them from the channel), unless AGENT_TEST_HELLO says otherwise:
 * `none` sends no hello (a script that knows nothing of the protocol), a
 * number V sends `hello V inplace`.
 *
 * AGENT_TEST_IGNORE_TERM=1 ignores SIGTERM from the start. AGENT_TEST_MESH=1
 * links the workers of a round: rank 0 listens on MASTER_PORT, the others
 * connect, and any side that sees its peer's connection close reports
 * `peer_lost ROUND` on the control channel and exits 1 (as the trainer does
 * when a collective loses a peer). It also prints "hello from rank R" on
 * stdout and "stderr of rank R" on stderr.
 */
#include "ductile/clock.h"
#include "ductile/control.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static volatile sig_atomic_t got_term;

static void on_term(int sig)
{
    (void)sig;
    got_term = 1;
}

static void say(const char *dir, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void say(const char *dir, const char *fmt, ...)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/w.%d.log", dir, (int)getpid());
    FILE *f = fopen(path, "a");
    if (!f) return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(f, fmt, ap);
    va_end(ap);
    fputc('\n', f);
    fclose(f);
}

static void write_env(const char *dir)
{
    extern char **environ;
    char path[512], tmp[520];
    snprintf(path, sizeof(path), "%s/w.%d.env", dir, (int)getpid());
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) exit(3);
    for (char **e = environ; *e; e++)
        fprintf(f, "%s\n", *e);
    const char *cfd = getenv(CTL_ENV);
    int ok = cfd && fcntl(atoi(cfd), F_GETFD) >= 0;
    fprintf(f, "TEST_CONTROL_FD_OPEN=%d\nTEST_PID=%d\nTEST_PPID=%d\n", ok, (int)getpid(),
            (int)getppid());
    fclose(f);
    rename(tmp, path);
}

static int read_cmd(const char *dir, char *cmd, size_t len)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/cmd.%d", dir, (int)getpid());
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(path, sizeof(path), "%s/cmd.all", dir);
        f = fopen(path, "r");
    }
    if (!f) return 0;
    int ok = fgets(cmd, (int)len, f) != NULL;
    fclose(f);
    if (!ok) return 0;
    cmd[strcspn(cmd, "\n")] = 0;
    return 1;
}

/* Mesh: returns the listening socket (rank 0) or a connected one, or -1. */
static int mesh_open(int rank)
{
    const char *addr = getenv("MASTER_ADDR"), *port = getenv("MASTER_PORT");
    if (!addr || !port) return -1;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(port))};
    inet_pton(AF_INET, addr, &sa.sin_addr);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (rank == 0) {
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0 || listen(fd, 64) != 0) return -1;
        return fd;
    }
    double deadline = mono_now_s() + 15;
    while (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        close(fd);
        if (mono_now_s() > deadline) return -1;
        usleep(100 * 1000);
        fd = socket(AF_INET, SOCK_STREAM, 0);
    }
    return fd;
}

/* One line from the agent, logged; 1 when it is `stop`. */
static int on_control(const char *dir, const char *line, long long *round)
{
    ctl_msg m;
    if (ctl_parse(line, &m) != 0) {
        say(dir, "control-invalid %s", line);
        return 0;
    }
    if (m.type == CTL_ROUND)
        say(dir,
            "round %lld rank %d world %d local %d group %d/%d restarts %lld "
            "master %s:%d prefix %s",
            (long long)m.round, m.rank, m.world_size, m.local_rank, m.group_rank,
            m.group_world_size, (long long)m.restarts, m.master_addr, m.master_port,
            m.store_prefix);
    if (m.type == CTL_ROUND) *round = m.round;
    if (m.type == CTL_HELLO)
        say(dir, "hello %d%s", m.version,
            m.mode == CTL_MODE_INPLACE   ? " inplace"
            : m.mode == CTL_MODE_RESTART ? " restart"
                                         : "");
    if (m.type == CTL_ABORT)
        say(dir, "abort %lld %s", (long long)m.round, m.graceful ? "graceful" : "lost");
    if (m.type == CTL_STOP) say(dir, "stop");
    return m.type == CTL_STOP;
}

/* Under ASan a SIGSEGV or abort() would become "exit 1"; the crash tests need
 * the worker to die by the signal itself, as it would in production. */
const char *__asan_default_options(void);
const char *__asan_default_options(void)
{
    return "handle_segv=0:handle_abort=0";
}

int main(void)
{
    const char *dir = getenv("AGENT_TEST_DIR");
    if (!dir) {
        fprintf(stderr, "test_worker: AGENT_TEST_DIR is not set\n");
        return 3;
    }
    int rank = getenv("RANK") ? atoi(getenv("RANK")) : -1;
    int ignore_term = getenv("AGENT_TEST_IGNORE_TERM") != NULL;
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_term;
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    write_env(dir);
    say(dir, "start rank %d round %s", rank, getenv("DUCTILE_ROUND"));
    printf("hello from rank %d\n", rank);
    fflush(stdout);
    fprintf(stderr, "stderr of rank %d\n", rank);

    int ctl = getenv(CTL_ENV) ? atoi(getenv(CTL_ENV)) : -1;
    if (ctl >= 0 && write(ctl, "ready\n", 6) != 6) ctl = -1;
    const char *hello = getenv("AGENT_TEST_HELLO");
    int64_t version = CTL_VERSION;
    if (hello && strcmp(hello, "none") != 0 && ctl_int(hello, 1, INT_MAX, &version) != 0) {
        fprintf(stderr, "test_worker: AGENT_TEST_HELLO is '%s', not none or a version >= 1\n",
                hello);
        return 3;
    }
    if (ctl >= 0 && !(hello && strcmp(hello, "none") == 0)) {
        ctl_msg m = {.type = CTL_HELLO, .version = (int)version, .mode = CTL_MODE_INPLACE};
        char line[64];
        int len = ctl_format(&m, line, sizeof(line));
        if (len < 0 || write(ctl, line, (size_t)len) != len) ctl = -1;
    }
    int ctl_in = ctl >= 0 ? dup(ctl) : -1;
    char in[2 * CTL_MAX_LINE];
    size_t nin = 0;

    int mesh[65];
    int nmesh = 0;
    if (getenv("AGENT_TEST_MESH")) {
        int fd = mesh_open(rank);
        if (fd < 0) {
            say(dir, "mesh-failed");
            return 1;
        }
        mesh[nmesh++] = fd;
    }

    int hang = 0, stall = 0, segv_on_term = 0;
    long step = 0;
    long long round = getenv("DUCTILE_ROUND") ? atoll(getenv("DUCTILE_ROUND")) : 0;
    double next_step = mono_now_s() + 0.5;
    for (;;) {
        if (got_term) {
            got_term = 0;
            if (segv_on_term) {
                say(dir, "term-segv");
                raise(SIGSEGV);
            }
            if (ignore_term) {
                say(dir, "term-ignored");
            } else {
                say(dir, "term");
                return 0;
            }
        }
        char cmd[256];
        if (read_cmd(dir, cmd, sizeof(cmd))) {
            if (strncmp(cmd, "exit ", 5) == 0) {
                say(dir, "exit %d", atoi(cmd + 5));
                return atoi(cmd + 5);
            }
            if (strcmp(cmd, "segv") == 0) raise(SIGSEGV);
            if (strcmp(cmd, "abort") == 0) abort();
            if (strcmp(cmd, "ignore-term") == 0) ignore_term = 1;
            if (strcmp(cmd, "segv-on-term") == 0 && !segv_on_term) {
                segv_on_term = 1;
                say(dir, "segv-on-term");
            }
            if (strcmp(cmd, "stall") == 0 && !stall) { /* alive, beating, no progress */
                stall = 1;
                say(dir, "stall");
            }
            if (strcmp(cmd, "bad-step") == 0 && ctl >= 0) { /* once: the agent drops it */
                const char bad[] = "step 1 loss nan\n";
                if (write(ctl, bad, sizeof(bad) - 1) == (ssize_t)sizeof(bad) - 1)
                    say(dir, "sent-bad-step");
                char path[512];
                snprintf(path, sizeof(path), "%s/cmd.%d", dir, (int)getpid());
                unlink(path);
            }
            if (strcmp(cmd, "hang") == 0 && !hang) {
                hang = 1;
                ignore_term = 1;
                say(dir, "hang");
            }
            int peer_lost = strcmp(cmd, "peer-lost") == 0;
            if ((strncmp(cmd, "fail ", 5) == 0 || peer_lost) && ctl >= 0) {
                char line[300];
                int n = peer_lost ? snprintf(line, sizeof(line), "peer_lost %lld test\n", round)
                                  : snprintf(line, sizeof(line), "failed %s\n", cmd + 5);
                if (write(ctl, line, (size_t)n) == n)
                    say(dir, peer_lost ? "sent-peer-lost" : "sent-failed");
                char path[512]; /* once: the command file goes */
                snprintf(path, sizeof(path), "%s/cmd.%d", dir, (int)getpid());
                unlink(path);
            }
        }
        struct pollfd p[66];
        int n = 0;
        if (!hang && ctl_in >= 0) p[n++] = (struct pollfd){.fd = ctl_in, .events = POLLIN};
        for (int i = 0; i < nmesh; i++)
            p[n++] = (struct pollfd){.fd = mesh[i], .events = POLLIN};
        int got = poll(p, (nfds_t)n, 50);
        if (got < 0 && errno != EINTR) return 4;
        for (int i = 0; got > 0 && i < n; i++) {
            if (!p[i].revents) continue;
            if (p[i].fd == ctl_in) {
                /* Every whole line read, not one a wakeup: the agent's
                 * lines often come together (a fresh worker's round and
                 * its hello answer). */
                ssize_t got = read(ctl_in, in + nin, sizeof(in) - 1 - nin);
                if (got <= 0) {
                    say(dir, "control-closed");
                    close(ctl_in);
                    ctl_in = -1;
                    continue;
                }
                nin += (size_t)got;
                char *nl;
                while ((nl = memchr(in, '\n', nin)) != NULL) {
                    *nl = 0;
                    int stop = on_control(dir, in, &round);
                    nin -= (size_t)(nl + 1 - in);
                    memmove(in, nl + 1, nin);
                    if (stop && !ignore_term) return 0;
                }
                if (nin == sizeof(in) - 1) nin = 0; /* an overlong line: dropped */
            } else if (rank == 0 && p[i].fd == mesh[0]) {
                int c = accept(mesh[0], NULL, NULL);
                if (c >= 0 && nmesh < 65) mesh[nmesh++] = c;
            } else {
                char b[16];
                if (read(p[i].fd, b, sizeof(b)) <= 0) {
                    say(dir, "peer-lost");
                    /* A script that knows nothing of the agent: its
                     * collective raised, it exits 1. */
                    if (getenv("AGENT_TEST_MESH_EXIT")) return 1;
                    char line[128];
                    int len =
                        snprintf(line, sizeof(line), "peer_lost %lld mesh peer closed\n", round);
                    if (ctl >= 0 && write(ctl, line, (size_t)len) != len) ctl = -1;
                    return 1;
                }
            }
        }
        if (!hang && ctl >= 0 && mono_now_s() >= next_step) {
            char line[64];
            /* Each step is 32 samples of this worker's own; its loss falls. */
            if (!stall) step++;
            int len = stall ? snprintf(line, sizeof(line), "phase compute\n")
                            : snprintf(line, sizeof(line), "step %ld samples %ld loss %.4f\n", step,
                                       32 * step, 2.0 / (double)step);
            if (write(ctl, line, (size_t)len) != len) ctl = -1;
            next_step = mono_now_s() + 0.5;
        }
    }
}
