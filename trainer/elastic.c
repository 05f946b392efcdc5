/* elastic.c: the control-channel thread and the agreement on whose state
 * the group takes after a rebuild (see elastic.h).
 *
 * The thread owns the reading end of the channel: it turns `abort` into a
 * flag the training loop reads at every step and, when the round ended as
 * lost, into comm_abort() on the communicator the loop attached. There is
 * no timer: whether the step in flight may finish is the agent's word
 * (graceful or lost), so a slow step is never cut short and a dead peer is
 * never waited for. `round` lines are kept (the newest wins) for
 * elastic_wait_round(). All shared fields sit under one mutex; the
 * communicator is only aborted while attached, and the loop detaches it
 * before freeing it, so the thread never touches a freed one.
 */
#include "ductile/elastic.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ductile/clock.h"
#include "ductile/control.h" /* the agent-worker contract: the control protocol */

struct elastic {
    int fd;
    pthread_t thread;
    pthread_mutex_t mu, wmu;
    pthread_cond_t cv;
    int quit;
    int closed;      /* EOF or error on the channel */
    int inplace;     /* a `round` line was seen */
    int stop;        /* `stop` received */
    int64_t current; /* the round the trainer is in */
    int64_t ending;  /* newest round told to end, either way (-1: none) */
    int64_t lost;    /* newest round told to end as lost (-1: none) */
    comm *c;         /* communicator to abort, or NULL */
    int aborted;     /* comm_abort() done on c */
    int have_next;
    elastic_round next; /* the newest announced round */
    char buf[CTL_MAX_LINE + 1];
    size_t nbuf;
    /* Progress: the loop sets these; the thread tells the agent. */
    _Atomic int64_t step; /* last finished step, -1 before one */
    /* Stored before step, so the thread never pairs a step with older
     * figures (at worst with a later step's: samples only grow). */
    _Atomic int64_t samples; /* this process's samples in all, -1: not reported */
    _Atomic double loss;     /* the step's loss, NAN: not reported */
    _Atomic int phase;       /* elastic_phase */
    int64_t sent_step;       /* the thread's own: what it last said */
    int sent_phase;
    int64_t sent_at; /* mono_now_ms() of its last `phase` */
};

static const char *const phase_names[] = {
    [ELASTIC_PHASE_COMPUTE] = "compute",
    [ELASTIC_PHASE_COMM] = CTL_PHASE_COMM,
    [ELASTIC_PHASE_REBUILD] = CTL_PHASE_REBUILD,
    [ELASTIC_PHASE_EVAL] = "eval",
    [ELASTIC_PHASE_SAVE] = "save",
};

const char *elastic_strerror(elastic_err err)
{
    switch (err) {
    case ELASTIC_OK:
        return "ok";
    case ELASTIC_ERR_ARG:
        return "invalid argument";
    case ELASTIC_ERR_NOMEM:
        return "out of memory";
    case ELASTIC_ERR_SYS:
        return "system call failed";
    case ELASTIC_ERR_CLOSED:
        return "the agent closed the control channel";
    case ELASTIC_ERR_TIMEOUT:
        return "no new round before the deadline";
    case ELASTIC_ERR_STOP:
        return "asked to stop";
    case ELASTIC_ERR_COMM:
        return "agreement collective failed";
    }
    return "unknown elastic error";
}

/* Under e->mu: whether the collectives of the current round must be
 * abandoned now. A graceful ending keeps them (every member is alive, the
 * step in flight may finish) even when the next round is already known;
 * a lost one, a newer round that no `abort` announced, or a closed channel
 * (nothing will answer) does not. */
static int must_abort(const elastic *e)
{
    if (e->closed || e->lost >= e->current) return 1;
    return e->have_next && e->next.round > e->current && e->ending < e->current;
}

/* Under e->mu: aborts the attached communicator when the round says so. */
static void abort_if_needed(elastic *e)
{
    if (e->c && !e->aborted && must_abort(e)) {
        comm_abort(e->c);
        e->aborted = 1;
    }
}

/* Under e->mu: one message from the agent. */
static void on_message(elastic *e, const ctl_msg *m)
{
    switch (m->type) {
    case CTL_ROUND:
        e->inplace = 1;
        if (m->round <= e->current || (e->have_next && m->round <= e->next.round)) break;
        e->next.round = m->round;
        e->next.rank = m->rank;
        e->next.world = m->world_size;
        e->next.local_rank = m->local_rank;
        snprintf(e->next.store_prefix, sizeof(e->next.store_prefix), "%s", m->store_prefix);
        e->have_next = 1;
        break;
    case CTL_ABORT:
        if (m->round > e->ending) e->ending = m->round;
        if (!m->graceful && m->round > e->lost) e->lost = m->round;
        break;
    case CTL_STOP:
        e->stop = 1;
        break;
    case CTL_HELLO: /* the agent's answer to ours: nothing to do */
    default:
        break;
    }
    abort_if_needed(e);
    pthread_cond_broadcast(&e->cv);
}

/* Reads what is there; splits lines. Returns -1 on EOF or error. */
static int read_channel(elastic *e)
{
    char chunk[512];
    ssize_t n = read(e->fd, chunk, sizeof(chunk));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return 0;
    if (n <= 0) return -1;
    for (ssize_t i = 0; i < n; i++) {
        if (chunk[i] != '\n') {
            if (e->nbuf < CTL_MAX_LINE) e->buf[e->nbuf++] = chunk[i];
            continue;
        }
        e->buf[e->nbuf] = 0;
        ctl_msg m;
        if (ctl_parse(e->buf, &m) == 0) {
            pthread_mutex_lock(&e->mu);
            on_message(e, &m);
            pthread_mutex_unlock(&e->mu);
        }
        e->nbuf = 0;
    }
    return 0;
}

static void send_line(elastic *e, const ctl_msg *m);

/* Tells the agent what the loop does: a new step at once, the phase when it
 * changes and every CTL_HEARTBEAT_MS anyway (the agent's watchdog hears a
 * live process whatever its loop is doing). Only after the first step: a
 * trainer that never finished one is not watched. */
static void send_progress(elastic *e)
{
    int64_t step = atomic_load(&e->step);
    if (step < 0) return;
    int phase = atomic_load(&e->phase);
    int64_t now = mono_now_ms();
    if (step != e->sent_step) {
        ctl_msg m = {.type = CTL_STEP, .step = step};
        m.samples = atomic_load(&e->samples);
        m.has_samples = m.samples >= 0;
        m.loss = atomic_load(&e->loss);
        m.has_loss = isfinite(m.loss);
        send_line(e, &m);
        e->sent_step = step;
    }
    if (phase != e->sent_phase || now - e->sent_at >= CTL_HEARTBEAT_MS) {
        ctl_msg m = {.type = CTL_PHASE};
        snprintf(m.phase, sizeof(m.phase), "%s", phase_names[phase]);
        send_line(e, &m);
        e->sent_phase = phase;
        e->sent_at = now;
    }
}

static void *control_thread(void *arg)
{
    elastic *e = arg;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        int quit = e->quit, closed = e->closed;
        pthread_mutex_unlock(&e->mu);
        if (quit || closed) break;
        send_progress(e);
        /* The timeout only bounds how long elastic_close() waits for quit. */
        struct pollfd p = {.fd = e->fd, .events = POLLIN};
        int r = poll(&p, 1, 50);
        if (r > 0 && read_channel(e) != 0) {
            pthread_mutex_lock(&e->mu);
            e->closed = 1; /* the agent is gone: nothing will answer a collective now */
            abort_if_needed(e);
            pthread_cond_broadcast(&e->cv);
            pthread_mutex_unlock(&e->mu);
        }
    }
    return NULL;
}

elastic_err elastic_hello(int fd)
{
    ctl_msg m = {.type = CTL_HELLO, .version = CTL_VERSION, .mode = CTL_MODE_INPLACE};
    char line[CTL_MAX_LINE + 1];
    int n = ctl_format(&m, line, sizeof(line));
    if (n <= 0 || fd < 0) return ELASTIC_ERR_ARG;
    ssize_t sent;
    do {
        sent = send(fd, line, (size_t)n, MSG_NOSIGNAL);
    } while (sent < 0 && errno == EINTR);
    return sent == n ? ELASTIC_OK : ELASTIC_ERR_SYS;
}

elastic_err elastic_open(int fd, int64_t round, elastic **out)
{
    *out = NULL;
    if (fd < 0) return ELASTIC_ERR_ARG;
    elastic *e = calloc(1, sizeof(*e));
    if (!e) return ELASTIC_ERR_NOMEM;
    e->fd = fd;
    e->current = round;
    e->ending = e->lost = -1;
    atomic_init(&e->step, -1);
    atomic_init(&e->samples, -1);
    atomic_init(&e->loss, NAN);
    atomic_init(&e->phase, ELASTIC_PHASE_COMPUTE);
    e->sent_step = -1;
    e->sent_phase = -1;
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->wmu, NULL);
    if (mono_cond_init(&e->cv) != 0) goto err_cond;
    (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
    if (pthread_create(&e->thread, NULL, control_thread, e) != 0) goto err;
    *out = e;
    return ELASTIC_OK;
err:
    pthread_cond_destroy(&e->cv);
err_cond:
    pthread_mutex_destroy(&e->mu);
    pthread_mutex_destroy(&e->wmu);
    free(e);
    return ELASTIC_ERR_SYS;
}

void elastic_close(elastic *e)
{
    if (!e) return;
    pthread_mutex_lock(&e->mu);
    e->quit = 1;
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->thread, NULL);
    pthread_mutex_destroy(&e->mu);
    pthread_mutex_destroy(&e->wmu);
    pthread_cond_destroy(&e->cv);
    close(e->fd);
    free(e);
}

void elastic_attach(elastic *e, comm *c, int64_t round)
{
    pthread_mutex_lock(&e->mu);
    e->c = c;
    e->aborted = 0;
    e->current = round;
    /* An `abort` of this round, or a newer round, that came before the
     * group formed still counts. */
    abort_if_needed(e);
    pthread_mutex_unlock(&e->mu);
}

int elastic_inplace(elastic *e)
{
    pthread_mutex_lock(&e->mu);
    int v = e->inplace;
    pthread_mutex_unlock(&e->mu);
    return v;
}

int elastic_cancelled(void *ctx)
{
    elastic *e = ctx;
    pthread_mutex_lock(&e->mu);
    int v = must_abort(e);
    pthread_mutex_unlock(&e->mu);
    return v;
}

int elastic_ending(elastic *e)
{
    pthread_mutex_lock(&e->mu);
    int v = e->ending >= e->current || e->closed || (e->have_next && e->next.round > e->current);
    pthread_mutex_unlock(&e->mu);
    return v;
}

static void send_line(elastic *e, const ctl_msg *m)
{
    char line[CTL_MAX_LINE + 1];
    int n = ctl_format(m, line, sizeof(line));
    if (n <= 0) return;
    pthread_mutex_lock(&e->wmu);
    /* Best effort: a full or closed channel only loses a progress report. */
    (void)send(e->fd, line, (size_t)n, MSG_DONTWAIT | MSG_NOSIGNAL);
    pthread_mutex_unlock(&e->wmu);
}

void elastic_report_step(elastic *e, int64_t step, int64_t samples, double loss)
{
    if (!e) return;
    atomic_store(&e->phase, ELASTIC_PHASE_COMPUTE);
    atomic_store(&e->samples, samples);
    atomic_store(&e->loss, loss);
    atomic_store(&e->step, step);
}

void elastic_set_phase(elastic *e, elastic_phase phase)
{
    if (e) atomic_store(&e->phase, phase);
}

/* A failure report: REASON is the rest of the line, so no line breaks. */
static void send_failure(elastic *e, ctl_type type, int64_t round, const char *why)
{
    ctl_msg m = {.type = type, .round = round};
    snprintf(m.reason, sizeof(m.reason), "%s", why);
    for (char *p = m.reason; *p; p++)
        if (*p == '\n' || *p == '\r') *p = ' ';
    send_line(e, &m);
}

void elastic_report_failed(elastic *e, const char *why)
{
    send_failure(e, CTL_FAILED, 0, why);
}

void elastic_report_peer_lost(elastic *e, int64_t round, const char *why)
{
    send_failure(e, CTL_PEER_LOST, round, why);
}

elastic_err elastic_wait_round(elastic *e, volatile sig_atomic_t *stop, int timeout_ms,
                               elastic_round *out)
{
    int64_t deadline = mono_now_ms() + timeout_ms;
    elastic_err err = ELASTIC_OK;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        if (e->have_next && e->next.round > e->current) {
            *out = e->next;
            break;
        }
        if (e->stop || (stop && *stop)) {
            err = ELASTIC_ERR_STOP;
            break;
        }
        if (e->closed) {
            err = ELASTIC_ERR_CLOSED;
            break;
        }
        if (mono_now_ms() >= deadline) {
            err = ELASTIC_ERR_TIMEOUT;
            break;
        }
        /* Short slices: a signal sets *stop without waking the condition. */
        struct timespec ts = mono_deadline(50);
        pthread_cond_timedwait(&e->cv, &e->mu, &ts);
    }
    pthread_mutex_unlock(&e->mu);
    return err;
}

/* a is newer than b: has state first, then round, then step. */
static int claim_newer(const elastic_claim *a, const elastic_claim *b)
{
    if (a->has_state != b->has_state) return a->has_state > b->has_state;
    if (a->round != b->round) return a->round > b->round;
    return a->step > b->step;
}

elastic_err elastic_agree(comm *c, const elastic_claim *mine, int *root, elastic_claim *best)
{
    int world = comm_world_size(c);
    elastic_claim *all = calloc((size_t)world, sizeof(*all));
    if (!all) return ELASTIC_ERR_NOMEM;
    if (comm_allgather(c, mine, sizeof(*mine), all) != COMM_OK) {
        free(all);
        return ELASTIC_ERR_COMM;
    }
    int r = 0;
    for (int i = 1; i < world; i++)
        if (claim_newer(&all[i], &all[r])) r = i;
    *root = r;
    *best = all[r];
    free(all);
    return ELASTIC_OK;
}

elastic_err elastic_share(comm *c, int root, const elastic_part *parts, int n)
{
    if (!c || n < 0 || (n > 0 && !parts)) return ELASTIC_ERR_ARG;
    int receiving = comm_rank(c) != root;
    size_t total = 0;
    for (int i = 0; i < n; i++)
        if (!parts[i].scratch) total += parts[i].bytes;
    /* Knowingly simple: one scratch copy of the whole state (the model's
     * size again, for the moment of a rebuild); receiving straight into the
     * state and undoing on failure would need the same copy, kept first. */
    char *scratch = receiving && total > 0 ? malloc(total) : NULL;
    if (receiving && total > 0 && !scratch) return ELASTIC_ERR_NOMEM;
    elastic_err err = ELASTIC_OK;
    size_t off = 0;
    for (int i = 0; i < n && err == ELASTIC_OK; i++) {
        void *buf = !receiving         ? parts[i].data
                    : parts[i].scratch ? parts[i].scratch
                    : scratch          ? scratch + off
                                       : NULL;
        if (comm_broadcast(c, buf, parts[i].bytes, root) != COMM_OK) err = ELASTIC_ERR_COMM;
        if (!parts[i].scratch) off += parts[i].bytes;
    }
    off = 0;
    for (int i = 0; i < n && receiving && err == ELASTIC_OK; i++) {
        if (parts[i].scratch) continue; /* the caller adopts it */
        if (parts[i].bytes > 0) memcpy(parts[i].data, scratch + off, parts[i].bytes);
        off += parts[i].bytes;
    }
    free(scratch);
    return err;
}
