/* rt_nccl_fault.c: failures in the host runtime's NCCL (see rt_nccl.h).
 *
 * What a failpoint action asks of a NCCL call (error, async, async:remote,
 * async:system; "hang" is the stream's), and where a failure is kept: the
 * comm's async error with its "rank R: REASON" (the first one sticks), or
 * the calling thread's last error when there is no comm to hold it; and the
 * result codes as text.
 */
#include "rt_nccl.h"

/* ---- results and reasons ---- */

/* A failure with no communicator to hold it, for ncclGetLastError(NULL).
 * Per thread, as NCCL's own last error is: the one thread-local of these
 * files with the open group (rt_nccl_coll.c). */
_Thread_local char nc_tls_reason[NC_REASON_MAX];

__attribute__((format(printf, 2, 3))) ncclResult_t nc_fail_here(ncclResult_t r, const char *fmt,
                                                                ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(nc_tls_reason, sizeof(nc_tls_reason), fmt, ap);
    va_end(ap);
    return r;
}

const char *ncclGetErrorString(ncclResult_t r)
{
    switch (r) {
    case ncclSuccess:
        return "no error";
    case ncclUnhandledCudaError:
        return "unhandled cuda error";
    case ncclSystemError:
        return "unhandled system error";
    case ncclInternalError:
        return "internal error";
    case ncclInvalidArgument:
        return "invalid argument";
    case ncclInvalidUsage:
        return "invalid usage";
    case ncclRemoteError:
        return "remote process exited or there was a network error";
    case ncclInProgress:
        return "NCCL operation in progress";
    default:
        return "unknown result code";
    }
}

ncclResult_t ncclGetVersion(int *version)
{
    if (!version) return ncclInvalidArgument;
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}

int nc_action_is(const char *action, const char *word)
{
    return action && strcmp(action, word) == 0;
}

/* The async error a failpoint action asks for; ncclSuccess for none. Plain
 * "async" is what a lost peer gives. */
ncclResult_t nc_action_async(const char *action, ncclResult_t lost_peer)
{
    if (nc_action_is(action, "async:remote")) return ncclRemoteError;
    if (nc_action_is(action, "async:system")) return ncclSystemError;
    if (nc_action_is(action, "async")) return lost_peer;
    return ncclSuccess;
}

__attribute__((format(printf, 3, 0))) static void nc_vfail_locked(nc_shared *sh, ncclResult_t r,
                                                                  const char *fmt, va_list ap)
{
    if (sh->error != ncclSuccess) return;
    sh->error = r;
    int n = snprintf(sh->reason, sizeof(sh->reason), "rank %d: ", sh->rank);
    vsnprintf(sh->reason + n, sizeof(sh->reason) - (size_t)n, fmt, ap);
    pthread_cond_broadcast(&sh->ready_cv);
}

/* Gives the comm its async error (unless it has one): "rank R: REASON". */
__attribute__((format(printf, 3, 4))) ncclResult_t nc_fail(nc_shared *sh, ncclResult_t r,
                                                           const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&sh->mu);
    nc_vfail_locked(sh, r, fmt, ap);
    pthread_mutex_unlock(&sh->mu);
    va_end(ap);
    return r;
}

__attribute__((format(printf, 3, 4))) void nc_fail_locked(nc_shared *sh, ncclResult_t r,
                                                          const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    nc_vfail_locked(sh, r, fmt, ap);
    va_end(ap);
}

const char *ncclGetLastError(ncclComm_t comm)
{
    if (comm) {
        pthread_mutex_lock(&comm->sh->mu);
        int failed = comm->sh->error != ncclSuccess;
        if (failed) memcpy(comm->last, comm->sh->reason, sizeof(comm->last));
        pthread_mutex_unlock(&comm->sh->mu);
        if (failed) return comm->last;
    }
    return nc_tls_reason;
}
