/* warm.c: warm spare interpreters: a Python per local rank with the
 * worker's libraries imported, adopted as the worker by the next launch.
 *
 * A spare runs `PYTHON [the command's interpreter flags] -c STUB MODE
 * TARGET ARGS...`. The one idea: the next round's environment is not known
 * when the spare starts, so the spare waits for it on its go pipe (fd 4)
 * and installs it before running the worker's code, which then sees just
 * what a fresh `python SCRIPT` would. Everything else is a worker's: the
 * spare is started by agent_child_start with a worker's pipes, and once
 * adopted the agent treats it as one. The spares use workers.h, never the
 * other way round: a launch adopts them through agent_warm_adopt.
 */
#include "warm.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* The spare's program. Imports the modules (a failed import is the
 * worker's to meet later, so it is ignored here), waits for the go pipe's
 * data (none: the agent discarded it or died), takes its environment from
 * it, and runs the target with sys.argv and sys.path[0] as Python itself
 * sets them (not at all under -I). Exceptions and SystemExit propagate:
 * the exit status is the plain run's. */
static const char agent_warm_stub[] =
    "import os, runpy, sys\n"
    "for name in os.environ.get('DUCTILE_PRELOAD_MODULES', '').split(','):\n"
    "    try:\n"
    "        __import__(name)\n"
    "    except BaseException:\n"
    "        pass\n"
    "chunks = []\n"
    "while True:\n"
    "    chunk = os.read(4, 65536)\n"
    "    if not chunk:\n"
    "        break\n"
    "    chunks.append(chunk)\n"
    "os.close(4)\n"
    "if not chunks:\n"
    "    os._exit(0)\n"
    "os.environb.clear()\n"
    "os.environb.update(e.split(b'=', 1) for e in b''.join(chunks).split(b'\\0') if b'=' in e)\n"
    "mode, target = sys.argv[1:3]\n"
    "sys.argv = sys.argv[2:]\n"
    "set_path0 = not (sys.flags.isolated or getattr(sys.flags, 'safe_path', False))\n"
    "if mode == 'module':\n"
    "    if set_path0:\n"
    "        sys.path[0] = os.getcwd()\n"
    "    runpy.run_module(target, run_name='__main__', alter_sys=True)\n"
    "else:\n"
    "    try:\n"
    "        open(target, 'rb').close()\n"
    "    except OSError as e:\n"
    "        sys.stderr.write(\"%s: can't open file %r: [Errno %d] %s\\n\" %\n"
    "                         (sys.executable, os.path.abspath(target), e.errno, e.strerror))\n"
    "        sys.exit(2)\n"
    "    if set_path0:\n"
    "        sys.path[0] = os.path.dirname(os.path.realpath(target))\n"
    "    runpy.run_path(target, run_name='__main__')\n";

/* What a PyTorch script spends its start on: torch, and torch._dynamo,
 * which torch imports lazily when the first optimizer is made (seconds of
 * its own). Neither starts a thread pool or a process at import. */
#define PRELOAD_AUTO "torch,torch._dynamo"
#define PRELOAD_ENV "DUCTILE_PRELOAD_MODULES"

static int python_basename(const char *argv0)
{
    const char *base = strrchr(argv0, '/');
    base = base ? base + 1 : argv0;
    if (strncmp(base, "python", 6) != 0) return 0;
    for (const char *p = base + 6; *p; p++)
        if (!isdigit((unsigned char)*p) && *p != '.') return 0;
    return 1;
}

/* An interpreter flag that changes nothing the stub relies on. */
static int python_flag(const char *a)
{
    static const char *const flags[] = {"-u", "-B", "-O", "-OO", "-E", "-s",
                                        "-S", "-I", "-b", "-bb", "-q", "-v"};
    for (size_t i = 0; i < sizeof(flags) / sizeof(flags[0]); i++)
        if (strcmp(a, flags[i]) == 0) return 1;
    return 0;
}

/* Where in cmd the target starts (at "-m" for a module), or -1 with why
 * set when cmd is not `python [flags] SCRIPT|-m MODULE ARGS...`. */
static int python_target(char *const cmd[], char *why, size_t len)
{
    if (!python_basename(cmd[0])) {
        snprintf(why, len, "the command (%s) is not a python interpreter", cmd[0]);
        return -1;
    }
    int i = 1;
    while (cmd[i] &&
           (python_flag(cmd[i]) || strcmp(cmd[i], "-X") == 0 || strcmp(cmd[i], "-W") == 0)) {
        if (!python_flag(cmd[i]) && !cmd[++i]) break; /* -X and -W take one more word */
        i++;
    }
    if (cmd[i] && strcmp(cmd[i], "-m") == 0 && cmd[i + 1]) return i;
    if (cmd[i] && cmd[i][0] != '-' && cmd[i][0]) return i;
    snprintf(why, len, "the command runs %s%s, not python SCRIPT or python -m MODULE",
             cmd[i] ? "python " : "python with no script", cmd[i] ? cmd[i] : "");
    return -1;
}

/* An empty slot, closing what it held when close_fds (else another owns it). */
static void spare_clear(agent_spare *sp, int close_fds)
{
    agent_worker *w = &sp->w;
    int *fds[] = {&w->out_fd, &w->err_fd, &w->ctl_fd, &sp->go_fd};
    for (size_t i = 0; i < sizeof(fds) / sizeof(fds[0]); i++) {
        if (close_fds && *fds[i] >= 0) close(*fds[i]);
        *fds[i] = -1;
    }
    w->pid = 0;
}

int agent_warm_init(agent_warm *wm, char *const cmd[], const char *preload, int inplace,
                    int local_world_size, char *why, size_t len)
{
    memset(wm, 0, sizeof(*wm));
    why[0] = 0;
    if (strcmp(preload, "none") == 0) {
        snprintf(why, len, "--preload none");
        return 0;
    }
    int auto_ = strcmp(preload, "auto") == 0;
    if (auto_ && inplace) {
        snprintf(why, len, "--rebuild inplace keeps the workers from round to round");
        return 0;
    }
    int t = python_target(cmd, why, len);
    if (t < 0) return 0;
    wm->modules = auto_ ? PRELOAD_AUTO : preload;
    int module = strcmp(cmd[t], "-m") == 0;
    int nargs = 0;
    while (cmd[t + module + 1 + nargs])
        nargs++;
    /* The interpreter and its flags, -c STUB MODE TARGET, the arguments. */
    int n = t + 4 + nargs;
    wm->argv = calloc((size_t)n + 1, sizeof(char *));
    wm->s = calloc((size_t)local_world_size, sizeof(agent_spare));
    if (!wm->argv || !wm->s) {
        agent_warm_free(wm);
        return -1;
    }
    int k = 0;
    for (int i = 0; i < t; i++)
        wm->argv[k++] = cmd[i];
    wm->argv[k++] = "-c";
    wm->argv[k++] = (char *)agent_warm_stub;
    wm->argv[k++] = module ? "module" : "script";
    for (int i = t + module; cmd[i]; i++)
        wm->argv[k++] = cmd[i];
    wm->local_world_size = local_world_size;
    wm->n = local_world_size;
    for (int i = 0; i < wm->n; i++)
        spare_clear(&wm->s[i], 0);
    return 0;
}

/* Kills a spare and its process group and waits for it: SIGKILL ends it
 * at once, so the wait is short. */
static void spare_discard(agent_spare *sp)
{
    if (sp->w.pid > 0) {
        kill(-sp->w.pid, SIGKILL);
        kill(sp->w.pid, SIGKILL);
        while (waitpid(sp->w.pid, NULL, 0) < 0 && errno == EINTR)
            ;
    }
    spare_clear(sp, 1);
}

static int spare_start(agent_warm *wm, agent_spare *sp, char *msg, size_t msglen)
{
    char **env = agent_spare_env(wm->local_world_size, PRELOAD_ENV, wm->modules);
    if (!env) {
        snprintf(msg, msglen, "out of memory");
        return -1;
    }
    int rc = agent_child_start(&sp->w, wm->argv, env, &sp->go_fd, msg, msglen);
    agent_env_free(env);
    return rc;
}

void agent_warm_fill(agent_warm *wm, const dlog *lg)
{
    for (int i = 0; wm->argv && i < wm->n; i++) {
        agent_spare *sp = &wm->s[i];
        if (sp->w.pid > 0 || sp->starts >= 2) continue;
        sp->starts++;
        char msg[256];
        if (spare_start(wm, sp, msg, sizeof(msg)) != 0) {
            /* Not a failure: the rank starts cold. */
            dlog_warn(lg, "spare_failed", "cannot start a warm interpreter for local rank %d: %s",
                      i, msg);
            continue;
        }
        dlog_debug(lg, "spare_started", "local rank %d: warm interpreter %d started (%s)", i,
                   (int)sp->w.pid, wm->modules);
    }
}

void agent_warm_new_round(agent_warm *wm)
{
    for (int i = 0; i < wm->n; i++)
        wm->s[i].starts = 0;
}

/* Writes all of data to a spare's go pipe, or fails: the pipe is empty and
 * as large as data (checked), so the write cannot wait on the spare; a
 * spare already gone gives EPIPE (the agent ignores SIGPIPE). */
static int go_write(int fd, const char *data, size_t len)
{
    int cap = fcntl(fd, F_GETPIPE_SZ);
    if (cap < 0 || len > (size_t)cap) return -1;
    size_t done = 0;
    while (done < len) {
        ssize_t n = write(fd, data + done, len - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        done += (size_t)n;
    }
    return 0;
}

/* agent_adopt's take (workers.h) for the spares of ctx. */
static int warm_take(void *ctx, int lr, const agent_round_env *env, const char *error_file,
                     agent_worker *w)
{
    agent_warm *wm = ctx;
    if (!wm->argv || lr >= wm->n || wm->s[lr].w.pid <= 0) return -1;
    agent_spare *sp = &wm->s[lr];
    size_t len = 0;
    char *block = agent_round_env_block(env, lr, error_file, &len);
    int rc = block && len > 0 ? go_write(sp->go_fd, block, len) : -1;
    free(block);
    if (rc != 0) {
        spare_discard(sp);
        return -1;
    }
    close(sp->go_fd); /* EOF: the spare has the whole environment */
    sp->go_fd = -1;
    *w = sp->w; /* its pipes are the worker's now */
    spare_clear(sp, 0);
    return 0;
}

agent_adopt agent_warm_adopt(agent_warm *wm)
{
    return (agent_adopt){.take = warm_take, .ctx = wm};
}

int agent_warm_reaped(agent_warm *wm, pid_t pid, int status, const dlog *lg)
{
    for (int i = 0; wm->argv && i < wm->n; i++) {
        agent_spare *sp = &wm->s[i];
        if (sp->w.pid != pid) continue;
        kill(-pid, SIGKILL); /* what it started goes with it */
        sp->w.exited = 1;
        sp->w.status = status;
        char how[128];
        agent_worker_describe(&sp->w, how, sizeof(how));
        /* What it printed is not a worker's: left unread. */
        spare_clear(sp, 1);
        dlog_info(lg, "spare_exited", "local rank %d: the warm interpreter %d %s", i, (int)pid,
                  how);
        return 1;
    }
    return 0;
}

void agent_warm_free(agent_warm *wm)
{
    for (int i = 0; wm->s && i < wm->n; i++)
        spare_discard(&wm->s[i]);
    free(wm->s);
    free(wm->argv);
    memset(wm, 0, sizeof(*wm));
}
