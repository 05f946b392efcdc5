/* workers.c: spawn, watch and stop the worker processes of one node.
 *
 * Each worker is a child in its own process group (so a signal reaches a
 * shell wrapper's children too) with three channels to the agent: its stdout
 * and stderr pipes, passed through line by line with a "[rank] " prefix (and
 * written to torchrun's per-rank files, logs.h, when asked), and one end of a
 * socketpair as DUCTILE_CONTROL_FD. A warm spare (warm.c) is
 * started the same way, with a go pipe besides, and a launch may adopt it
 * as a rank's worker instead of forking one, through the agent_adopt it is
 * given: this file knows nothing of the spares. Children die with the agent
 * (PR_SET_PDEATHSIG), as they would with the pod. Everything a child needs is
 * built before fork(): between fork and exec only async-signal-safe calls run,
 * because the agent has other threads (rendezvous driver, HTTP server).
 */
#include "workers.h"

#include "ductile/control.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

/* Names the agent sets (control.h); inherited values of these are dropped. */
#define AGENT_ENV_NAME(name, what) name,
static const char *const agent_env_names[] = {CTL_ENV_VARS(AGENT_ENV_NAME) NULL};
#undef AGENT_ENV_NAME

/* 1 when entry is NAME=... */
static int env_named(const char *entry, const char *name)
{
    size_t n = strlen(name);
    return strncmp(entry, name, n) == 0 && entry[n] == '=';
}

static int env_is_ours(const char *entry)
{
    for (int i = 0; agent_env_names[i]; i++)
        if (env_named(entry, agent_env_names[i])) return 1;
    return 0;
}

static int env_has(char **env, int n, const char *name)
{
    for (int i = 0; i < n; i++)
        if (env_named(env[i], name)) return 1;
    return 0;
}

static int env_add(char **env, int *n, const char *name, const char *fmt, ...)
    __attribute__((format(printf, 3, 0)));

static int env_add(char **env, int *n, const char *name, const char *fmt, ...)
{
    char value[1024];
    va_list ap;
    va_start(ap, fmt);
    int len = vsnprintf(value, sizeof(value), fmt, ap);
    va_end(ap);
    if (len < 0 || (size_t)len >= sizeof(value)) return -1;
    char *e = malloc(strlen(name) + (size_t)len + 2);
    if (!e) return -1;
    sprintf(e, "%s=%s", name, value);
    env[(*n)++] = e;
    return 0;
}

static void env_free(char **env)
{
    if (!env) return;
    for (char **p = env; *p; p++)
        free(*p);
    free(env);
}

/* The agent's own environment minus the names above, with room for extra
 * more entries; *n is how many it holds. */
static char **env_inherit(int extra, int *n)
{
    int inherited = 0;
    while (environ[inherited])
        inherited++;
    char **env = calloc((size_t)inherited + (size_t)extra + 1, sizeof(char *));
    if (!env) return NULL;
    *n = 0;
    for (int i = 0; i < inherited; i++) {
        if (env_is_ours(environ[i])) continue;
        if (!(env[*n] = strdup(environ[i]))) {
            env_free(env);
            return NULL;
        }
        (*n)++;
    }
    return env;
}

/* One thread per worker unless the user chose: K workers share the node.
 * A warm spare gets it too: a library reads it when it is loaded. */
static int env_add_threads(char **env, int *n, int local_world_size)
{
    if (local_world_size > 1 && !env_has(env, *n, "OMP_NUM_THREADS"))
        return env_add(env, n, "OMP_NUM_THREADS", "1");
    return 0;
}

/* The environment of local rank lr: the agent's own, minus the names above,
 * plus the round's values. */
static char **env_build(const agent_round_env *r, int lr, const char *error_file)
{
    int n = 0;
    char **env = env_inherit(40, &n);
    if (!env) return NULL;
    int rank = r->first_rank + lr;
    int bad = 0;
    bad |= env_add(env, &n, "RANK", "%d", rank);
    bad |= env_add(env, &n, "LOCAL_RANK", "%d", lr);
    bad |= env_add(env, &n, "WORLD_SIZE", "%d", r->world_size);
    bad |= env_add(env, &n, "LOCAL_WORLD_SIZE", "%d", r->local_world_size);
    bad |= env_add(env, &n, "GROUP_RANK", "%d", r->group_rank);
    bad |= env_add(env, &n, "GROUP_WORLD_SIZE", "%d", r->group_world_size);
    bad |= env_add(env, &n, "ROLE_RANK", "%d", rank);
    bad |= env_add(env, &n, "ROLE_WORLD_SIZE", "%d", r->world_size);
    bad |= env_add(env, &n, "ROLE_NAME", "%s", r->role);
    bad |= env_add(env, &n, "MASTER_ADDR", "%s", r->master_addr);
    bad |= env_add(env, &n, "MASTER_PORT", "%d", r->master_port);
    bad |= env_add(env, &n, "TORCHELASTIC_RESTART_COUNT", "%lld", (long long)r->restarts);
    bad |= env_add(env, &n, "TORCHELASTIC_MAX_RESTARTS", "%d", r->max_restarts);
    bad |= env_add(env, &n, "TORCHELASTIC_RUN_ID", "%s", r->job);
    if (error_file) bad |= env_add(env, &n, "TORCHELASTIC_ERROR_FILE", "%s", error_file);
    bad |= env_add(env, &n, CTL_ENV_ENDPOINTS, "%s", r->etcd.endpoints);
    bad |= env_add(env, &n, CTL_ENV_JOB, "%s", r->job);
    bad |= env_add(env, &n, CTL_ENV_ROUND, "%lld", (long long)r->round);
    bad |= env_add(env, &n, CTL_ENV_STORE_PREFIX, "%s", r->store_prefix);
    bad |= env_add(env, &n, CTL_ENV, "3");
    if (r->node_addr) bad |= env_add(env, &n, CTL_ENV_NODE_ADDR, "%s", r->node_addr);
    if (r->node_id) bad |= env_add(env, &n, CTL_ENV_NODE_ID, "%s", r->node_id);
    const char *fp = getenv("DUCTILE_WORKER_FAILPOINTS");
    if (fp && *fp) bad |= env_add(env, &n, CTL_ENV_FAILPOINTS, "%s", fp);
    bad |= env_add_threads(env, &n, r->local_world_size);
#define AGENT_ENV_CREDENTIAL(name, field)                                                          \
    if (r->etcd.field && !env_has(env, n, name)) bad |= env_add(env, &n, name, "%s", r->etcd.field);
    CTL_ENV_CREDENTIALS(AGENT_ENV_CREDENTIAL) /* the store needs the agent's etcd credentials */
#undef AGENT_ENV_CREDENTIAL
    env[n] = NULL;
    if (bad) goto err;
    return env;
err:
    env[n] = NULL;
    env_free(env);
    return NULL;
}

char **agent_spare_env(int local_world_size, const char *name, const char *value)
{
    int n = 0;
    char **env = env_inherit(2, &n);
    if (!env) return NULL;
    /* name is the agent's to set: an inherited value goes. */
    for (int i = 0; i < n; i++) {
        if (!env_named(env[i], name)) continue;
        free(env[i]);
        env[i--] = env[--n];
        env[n] = NULL;
    }
    int bad = env_add_threads(env, &n, local_world_size);
    bad |= env_add(env, &n, name, "%s", value);
    env[n] = NULL;
    if (!bad) return env;
    env_free(env);
    return NULL;
}

void agent_env_free(char **env)
{
    env_free(env);
}

char *agent_round_env_block(const agent_round_env *r, int lr, const char *error_file, size_t *len)
{
    char **env = env_build(r, lr, error_file);
    if (!env) return NULL;
    size_t total = 0;
    for (char **p = env; *p; p++)
        total += strlen(*p) + 1;
    char *block = malloc(total ? total : 1);
    if (block) {
        char *at = block;
        for (char **p = env; *p; p++) {
            size_t n = strlen(*p) + 1;
            memcpy(at, *p, n); /* with its NUL: the entries' separator */
            at += n;
        }
        *len = total;
    }
    env_free(env);
    return block;
}

static void close_fd(int *fd)
{
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

/* In the child: only async-signal-safe calls from here to exec. go_r, a
 * warm spare's go pipe (-1 for a worker), becomes fd 4; it was made after
 * the other three, so moving those first cannot clobber it. */
static void child_exec(pid_t parent, int out_w, int err_w, int ctl_w, int go_r, char *const argv[],
                       char **env)
{
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    struct sigaction dfl;
    memset(&dfl, 0, sizeof(dfl));
    dfl.sa_handler = SIG_DFL;
    sigaction(SIGPIPE, &dfl, NULL);
    if (dup2(out_w, 1) < 0 || dup2(err_w, 2) < 0) _exit(127);
    if (ctl_w == 3) {
        fcntl(3, F_SETFD, 0);
    } else if (dup2(ctl_w, 3) < 0) {
        _exit(127);
    }
    if (go_r == 4) {
        fcntl(4, F_SETFD, 0);
    } else if (go_r >= 0 && dup2(go_r, 4) < 0) {
        _exit(127);
    }
    close_range(go_r >= 0 ? 5 : 4, ~0U, 0);
    execvpe(argv[0], argv, env);
    static const char msg[] = "ductile-agent: cannot run the worker command\n";
    ssize_t ignored = write(2, msg, sizeof(msg) - 1);
    (void)ignored;
    _exit(127);
}

int agent_child_start(agent_worker *w, char *const argv[], char **envp, int *go_w, char *msg,
                      size_t msglen)
{
    int out[2] = {-1, -1}, errp[2] = {-1, -1}, ctl[2] = {-1, -1}, go[2] = {-1, -1};
    if (pipe2(out, O_CLOEXEC) || pipe2(errp, O_CLOEXEC) ||
        socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ctl) || (go_w && pipe2(go, O_CLOEXEC))) {
        snprintf(msg, msglen, "cannot create worker pipes: %s", strerror(errno));
        goto err;
    }
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        snprintf(msg, msglen, "fork: %s", strerror(errno));
        goto err;
    }
    if (pid == 0) child_exec(parent, out[1], errp[1], ctl[1], go[0], argv, envp);
    setpgid(pid, pid); /* also here, so a signal sent at once reaches the group */
    close(out[1]);
    close(errp[1]);
    close(ctl[1]);
    close_fd(&go[0]);
    memset(w, 0, sizeof(*w));
    w->pid = pid;
    w->out_fd = out[0];
    w->err_fd = errp[0];
    w->ctl_fd = ctl[0];
    agent_progress_init(&w->prog);
    fcntl(w->out_fd, F_SETFL, O_NONBLOCK);
    fcntl(w->err_fd, F_SETFL, O_NONBLOCK);
    fcntl(w->ctl_fd, F_SETFL, O_NONBLOCK);
    if (go_w) {
        /* The agent's loop must never wait on a spare that does not read. */
        fcntl(go[1], F_SETFL, O_NONBLOCK);
        *go_w = go[1];
    }
    return 0;
err:
    for (int i = 0; i < 2; i++) {
        close_fd(&out[i]);
        close_fd(&errp[i]);
        close_fd(&ctl[i]);
        close_fd(&go[i]);
    }
    return -1;
}

/* torchrun's files of local rank lr (logs.h): <attempt>/<lr>/ with the
 * error file (emptied) and the log file of each stream sent to one. */
static int logs_open(agent_worker *w, const agent_logs *l, int lr, char *msg, size_t msglen)
{
    char dir[4200], path[4300];
    snprintf(dir, sizeof(dir), "%s/%d", l->attempt_dir, lr);
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        snprintf(msg, msglen, "%s: %s", dir, strerror(errno));
        return -1;
    }
    snprintf(path, sizeof(path), "%s/error.json", dir);
    if (!(w->error_file = strdup(path))) {
        snprintf(msg, msglen, "out of memory");
        return -1;
    }
    unlink(path); /* a round's error is its own */
    int files = agent_logs_std(l->redirects, lr) | agent_logs_std(l->tee, lr);
    w->console = agent_logs_shown(l->ranks_filter, lr) == 1 ? AGENT_STD_OUT | AGENT_STD_ERR : 0;
    w->console &= ~(unsigned)agent_logs_std(l->redirects, lr); /* redirected: the file only */
    for (int s = AGENT_STD_OUT; s <= AGENT_STD_ERR; s++) {
        if (!(files & s)) continue;
        snprintf(path, sizeof(path), "%s/%s", dir,
                 s == AGENT_STD_OUT ? "stdout.log" : "stderr.log");
        int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (fd < 0) {
            snprintf(msg, msglen, "%s: %s", path, strerror(errno));
            return -1;
        }
        *(s == AGENT_STD_OUT ? &w->out_log : &w->err_log) = fd;
    }
    return 0;
}

static void logs_close(agent_worker *w)
{
    close_fd(&w->out_log);
    close_fd(&w->err_log);
    free(w->error_file);
    w->error_file = NULL;
}

/* Local rank lr's worker: the one adopt has for it (a warm spare), else a
 * fresh process. torchrun's files are opened first: the worker's
 * environment names its error file. */
static int spawn_one(agent_worker *w, const agent_round_env *env, int lr, char *const argv[],
                     const agent_adopt *adopt, int *adopted, char *msg, size_t msglen)
{
    agent_worker files;
    memset(&files, 0, sizeof(files));
    files.out_log = files.err_log = -1;
    files.console = AGENT_STD_OUT | AGENT_STD_ERR;
    if (env->logs && logs_open(&files, env->logs, lr, msg, msglen) != 0) goto err;
    if (adopt && adopt->take(adopt->ctx, lr, env, files.error_file, w) == 0) {
        (*adopted)++;
    } else {
        char **envp = env_build(env, lr, files.error_file);
        if (!envp) {
            snprintf(msg, msglen, "cannot build the worker environment");
            goto err;
        }
        int rc = agent_child_start(w, argv, envp, NULL, msg, msglen);
        env_free(envp);
        if (rc != 0) goto err;
    }
    w->local_rank = lr;
    w->rank = env->first_rank + lr;
    w->out_log = files.out_log;
    w->err_log = files.err_log;
    w->console = files.console;
    w->error_file = files.error_file;
    return 0;
err:
    logs_close(&files);
    return -1;
}

int agent_workers_spawn(agent_workers *ws, const agent_round_env *env, char *const argv[],
                        const agent_adopt *adopt, int *adopted, char *msg, size_t msglen)
{
    *adopted = 0;
    int k = env->local_world_size;
    memset(ws, 0, sizeof(*ws));
    ws->w = calloc((size_t)k, sizeof(agent_worker));
    if (!ws->w) {
        snprintf(msg, msglen, "out of memory");
        return -1;
    }
    for (int i = 0; i < k; i++) {
        if (spawn_one(&ws->w[i], env, i, argv, adopt, adopted, msg, msglen) != 0) {
            /* Take back the ones already started. */
            for (int j = 0; j < i; j++) {
                kill(-ws->w[j].pid, SIGKILL);
                waitpid(ws->w[j].pid, NULL, 0);
                ws->w[j].pid = 0;
                ws->w[j].exited = 1;
            }
            ws->n = i;
            agent_workers_free(ws);
            return -1;
        }
        ws->n = i + 1;
        ws->alive++;
    }
    return 0;
}

void agent_workers_signal(agent_workers *ws, int sig)
{
    for (int i = 0; i < ws->n; i++) {
        agent_worker *w = &ws->w[i];
        if (w->exited || w->pid <= 0) continue;
        siginfo_t si = {0};
        if (waitid(P_PID, (id_t)w->pid, &si, WEXITED | WNOHANG | WNOWAIT) == 0 && si.si_pid)
            continue; /* already ended: left for the reaper, its status its own */
        if (sig > 0 && sig < 32) w->sent |= 1u << sig;
        if (kill(-w->pid, sig) != 0) kill(w->pid, sig);
    }
}

int agent_worker_first_hand(const agent_worker *w)
{
    if (w->hung[0]) return 1; /* its agent's watchdog killed it: hung here */
    if (WIFSIGNALED(w->status)) {
        int sig = WTERMSIG(w->status);
        return sig <= 0 || sig >= 32 || !(w->sent & (1u << sig));
    }
    int code = WIFEXITED(w->status) ? WEXITSTATUS(w->status) : 0;
    return code != 0 && code != CTL_EXIT_PEER_LOST && !w->sent;
}

agent_worker *agent_workers_reaped(agent_workers *ws, pid_t pid, int status)
{
    for (int i = 0; i < ws->n; i++) {
        agent_worker *w = &ws->w[i];
        if (w->pid != pid || w->exited) continue;
        w->exited = 1;
        w->status = status;
        ws->alive--;
        /* Leftovers of the process group (a wrapper's children) go with it. */
        kill(-pid, SIGKILL);
        return w;
    }
    return NULL;
}

/* One line of stream s (AGENT_STD_*): to the console as "[rank] line",
 * to the stream's log file as it is. */
static void emit_line(const agent_worker *w, int s, const char *line, size_t len)
{
    char buf[CTL_MAX_LINE + 64];
    int n = snprintf(buf, sizeof(buf), "[%d] %.*s\n", w->rank, (int)len, line);
    if (n <= 0) return;
    if ((size_t)n >= sizeof(buf)) n = sizeof(buf) - 1;
    ssize_t ignored;
    if (w->console & (unsigned)s) ignored = write(s == AGENT_STD_OUT ? 1 : 2, buf, (size_t)n);
    int file = s == AGENT_STD_OUT ? w->out_log : w->err_log;
    char *raw = strchr(buf, ' ') + 1; /* the line and its newline */
    if (file >= 0) ignored = write(file, raw, (size_t)(buf + n - raw));
    (void)ignored;
}

static void linebuf_flush(agent_linebuf *lb, const agent_worker *w, int s)
{
    if (lb->len) emit_line(w, s, lb->buf, lb->len);
    lb->len = 0;
}

void agent_workers_read_output(agent_workers *ws, agent_worker *w, int fd)
{
    (void)ws;
    int is_out = fd == w->out_fd;
    agent_linebuf *lb = is_out ? &w->out : &w->err;
    int dest = is_out ? AGENT_STD_OUT : AGENT_STD_ERR;
    char chunk[4096];
    for (int rounds = 0; rounds < 16; rounds++) {
        ssize_t got = read(fd, chunk, sizeof(chunk));
        if (got < 0 && errno == EINTR) continue;
        if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (got <= 0) { /* EOF or error: the worker closed its end */
            linebuf_flush(lb, w, dest);
            if (is_out)
                close_fd(&w->out_fd);
            else
                close_fd(&w->err_fd);
            return;
        }
        for (ssize_t i = 0; i < got; i++) {
            char c = chunk[i];
            if (c == '\n') {
                emit_line(w, dest, lb->buf, lb->len);
                lb->len = 0;
            } else {
                if (lb->len == CTL_MAX_LINE) linebuf_flush(lb, w, dest);
                lb->buf[lb->len++] = c;
            }
        }
    }
}

void agent_workers_free(agent_workers *ws)
{
    for (int i = 0; i < ws->n; i++) {
        agent_worker *w = &ws->w[i];
        /* What is still in the pipes belongs in the log. */
        if (w->out_fd >= 0) agent_workers_read_output(ws, w, w->out_fd);
        if (w->err_fd >= 0) agent_workers_read_output(ws, w, w->err_fd);
        linebuf_flush(&w->out, w, AGENT_STD_OUT);
        linebuf_flush(&w->err, w, AGENT_STD_ERR);
        close_fd(&w->out_fd);
        close_fd(&w->err_fd);
        close_fd(&w->ctl_fd);
        logs_close(w);
    }
    free(ws->w);
    memset(ws, 0, sizeof(*ws));
}

void agent_worker_describe(const agent_worker *w, char *out, size_t len)
{
    if (w->hung[0]) {
        snprintf(out, len, "%s", w->hung);
    } else if (!w->exited) {
        snprintf(out, len, "is running");
    } else if (WIFEXITED(w->status)) {
        snprintf(out, len, "exited with code %d", WEXITSTATUS(w->status));
    } else if (WIFSIGNALED(w->status)) {
        int sig = WTERMSIG(w->status);
        const char *name = sigabbrev_np(sig);
        snprintf(out, len, "was killed by SIG%s", name ? name : "?");
    } else {
        snprintf(out, len, "ended with status %d", w->status);
    }
    char what[512];
    size_t used = strlen(out);
    int failed = w->exited && !(WIFEXITED(w->status) && WEXITSTATUS(w->status) == 0);
    if (failed && used < len && agent_logs_error_message(w->error_file, what, sizeof(what)) == 0)
        snprintf(out + used, len - used, ": %s", what);
}
