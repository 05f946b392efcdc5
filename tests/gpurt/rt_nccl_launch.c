/* rt_nccl_launch.c: a non-blocking communicator's calls, launched later.
 *
 * As NCCL 2.28 does, a call on a non-blocking comm answers ncclInProgress
 * and is queued later from a launch thread of its own; until then the comm
 * takes no other call and its streams are held (rt_stream_hold), so CUDA
 * work queued on them is reported as the race it is. See rt_nccl.h.
 */
#include "rt_nccl.h"

/* ---- non-blocking calls: launched later, from the runtime's own thread ---- */

/* On a non-blocking communicator NCCL 2.28 answers every collective (and
 * every group) with ncclInProgress and queues its kernel later, from a
 * thread of its own; until ncclCommGetAsyncError says ncclSuccess the
 * communicator takes no other call and its stream must get no CUDA work.
 * So here: the call becomes a job on one launch thread, which queues it
 * only after the caller has asked the communicator's state at least once
 * (or NC_LAUNCH_LATE_MS have passed: NCCL's thread does not wait to be
 * asked); until then the job's streams are held (rt_stream_hold), and
 * CUDA work queued on them is reported as a race. */
#define NC_LAUNCH_LATE_MS 20

typedef struct nc_job {
    struct nc_job *next;
    nc_pending *item;
    int n;
    int64_t late_ms; /* launched by then even if nobody asks */
    int asked;       /* ncclCommGetAsyncError was called on one of its comms */
} nc_job;

static pthread_mutex_t nc_launch_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t nc_launch_cv;
static pthread_once_t nc_launch_once = PTHREAD_ONCE_INIT;
static nc_job *nc_jobs; /* in call order */
static int nc_launch_started;

/* Under nc_launch_mu: the job's comms point at it (job) or at nothing. */
static void nc_job_mark(nc_job *j, nc_job *to)
{
    for (int i = 0; i < j->n; i++) {
        nc_shared *sh = j->item[i].work.sh;
        if (!sh) continue;
        pthread_mutex_lock(&sh->mu);
        sh->job = to;
        pthread_mutex_unlock(&sh->mu);
    }
}

/* Under nc_launch_mu: item i will not be launched (its comm was torn down). */
static void nc_job_drop_item(nc_job *j, int i)
{
    nc_pending *it = &j->item[i];
    if (!it->work.sh) return;
    rt_stream_hold(it->stream, -1, NULL);
    pthread_mutex_lock(&it->work.sh->mu);
    it->work.sh->job = NULL;
    pthread_mutex_unlock(&it->work.sh->mu);
    nc_unref(it->work.sh);
    it->work.sh = NULL;
}

/* Under nc_launch_mu: queues the job's calls as the blocking path would,
 * then lets its streams and comms go. A failure to queue becomes the
 * comms' async error, as a failed launch does in NCCL. */
static void nc_job_launch(nc_job *j)
{
    int k = 0;
    for (int i = 0; i < j->n; i++)
        if (j->item[i].work.sh) j->item[k++] = j->item[i];
    j->n = k;
    /* The flush hands each item's reference on to its op; one more each
     * keeps the comms here until they are told the call settled. */
    for (int i = 0; i < k; i++)
        nc_ref(j->item[i].work.sh);
    rt_set_launcher(1);
    ncclResult_t r = k > 0 ? nc_group_flush(j->item, k) : ncclSuccess;
    rt_set_launcher(0);
    for (int i = 0; i < k; i++) {
        rt_stream_hold(j->item[i].stream, -1, NULL);
        if (r != ncclSuccess)
            nc_fail(j->item[i].work.sh, r, "launching %s: %s", j->item[0].name, nc_tls_reason);
    }
    nc_job_mark(j, NULL); /* settled: ncclCommGetAsyncError says so from now on */
    for (int i = 0; i < k; i++)
        nc_unref(j->item[i].work.sh);
}

static void *nc_launcher(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&nc_launch_mu);
    for (;;) {
        nc_job *j = nc_jobs;
        if (!j) {
            pthread_cond_wait(&nc_launch_cv, &nc_launch_mu);
            continue;
        }
        if (!j->asked && mono_now_ms() < j->late_ms) {
            struct timespec until = mono_deadline((int)(j->late_ms - mono_now_ms()));
            pthread_cond_timedwait(&nc_launch_cv, &nc_launch_mu, &until);
            continue;
        }
        nc_jobs = j->next;
        nc_job_launch(j);
        free(j->item);
        free(j);
    }
    return NULL;
}

static void nc_launch_init(void)
{
    pthread_t t;
    pthread_attr_t attr;
    if (mono_cond_init(&nc_launch_cv) != 0) rt_die("launch thread: condition variable");
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    nc_launch_started = pthread_create(&t, &attr, nc_launcher, NULL) == 0;
    pthread_attr_destroy(&attr);
}

/* A non-blocking call (one, or a group's): held until launched. */
ncclResult_t nc_defer(nc_pending *items, int n)
{
    if (n == 0) return ncclSuccess;
    pthread_once(&nc_launch_once, nc_launch_init);
    nc_job *j = calloc(1, sizeof(*j));
    nc_pending *copy = j ? malloc(sizeof(*copy) * (size_t)n) : NULL;
    if (!nc_launch_started || !copy) {
        free(j);
        for (int i = 0; i < n; i++)
            nc_unref(items[i].work.sh);
        return nc_fail_here(ncclSystemError, "%s: cannot start NCCL's launch thread",
                            items[0].name);
    }
    memcpy(copy, items, sizeof(*copy) * (size_t)n);
    *j = (nc_job){.item = copy, .n = n, .late_ms = mono_now_ms() + NC_LAUNCH_LATE_MS};
    for (int i = 0; i < n; i++)
        rt_stream_hold(items[i].stream, +1, items[i].name);
    pthread_mutex_lock(&nc_launch_mu);
    nc_job_mark(j, j);
    nc_job **tail = &nc_jobs;
    while (*tail)
        tail = &(*tail)->next;
    *tail = j;
    pthread_cond_broadcast(&nc_launch_cv);
    pthread_mutex_unlock(&nc_launch_mu);
    return ncclInProgress;
}

/* ncclCommGetAsyncError on a comm with a job: the job may go now. */
void nc_job_asked(nc_shared *sh)
{
    pthread_mutex_lock(&nc_launch_mu);
    for (nc_job *j = nc_jobs; j; j = j->next)
        for (int i = 0; i < j->n; i++)
            if (j->item[i].work.sh == sh) j->asked = 1;
    pthread_cond_broadcast(&nc_launch_cv);
    pthread_mutex_unlock(&nc_launch_mu);
}

/* A comm torn down: its calls that were never launched never will be. */
void nc_job_cancel(nc_shared *sh)
{
    pthread_mutex_lock(&nc_launch_mu);
    for (nc_job *j = nc_jobs; j; j = j->next)
        for (int i = 0; i < j->n; i++)
            if (j->item[i].work.sh == sh) nc_job_drop_item(j, i);
    pthread_mutex_unlock(&nc_launch_mu);
}
