/* rt_cuda.c: the CUDA runtime of the host test runtime: its lock, its failpoints, its devices and
 * its errors (see rt.h, rt_cuda.h).
 *
 * The one lock every queue and the registry sit under, rt_die, the
 * failpoint check every call starts with (rt_call, and rt_fail_next's
 * armed call), the devices a process sees (DUCTILE_GPURT_DEVICES and
 * CUDA_VISIBLE_DEVICES), the host-sync counter, and the calls that answer
 * about devices and errors (cudaSetDevice, cudaGetLastError, ...).
 */
#include "rt_cuda.h"

pthread_mutex_t rt_mu = PTHREAD_MUTEX_INITIALIZER;

cudaError_t rt_sticky_err = cudaSuccess;
static __thread cudaError_t last_error = cudaSuccess;
__thread int rt_current_device;

static atomic_long host_syncs; /* rt_host_syncs: a test-only counter, like the failpoint table */

long rt_host_syncs(void)
{
    return atomic_load(&host_syncs);
}

static void syncs_write(void)
{
    const char *path = getenv("DUCTILE_GPURT_SYNCS");
    FILE *f = path && *path ? fopen(path, "we") : NULL;
    if (!f) return;
    fprintf(f, "syncs %ld\n", rt_host_syncs());
    fclose(f);
}

__attribute__((constructor)) static void syncs_at_exit(void)
{
    const char *path = getenv("DUCTILE_GPURT_SYNCS");
    if (path && *path) atexit(syncs_write);
}

void rt_host_synced(void)
{
    atomic_fetch_add(&host_syncs, 1);
}

void rt_lock(void)
{
    pthread_mutex_lock(&rt_mu);
}

void rt_unlock(void)
{
    pthread_mutex_unlock(&rt_mu);
}

void rt_die(const char *fmt, ...)
{
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    fprintf(stderr, "gpurt: %s\n", line);
    fflush(stderr);
    abort();
}

void rt_pause_briefly(void)
{
    struct timespec ts = {0, RT_WAIT_NS};
    nanosleep(&ts, NULL);
}

/* Remembers a failed call's error for cudaGetLastError; returns it. */
cudaError_t rt_ret(cudaError_t e)
{
    if (e != cudaSuccess) last_error = e;
    return e;
}

static pthread_mutex_t armed_mu = PTHREAD_MUTEX_INITIALIZER;
static char armed[64];        /* rt_fail_next's call name, "" when none */
static char armed_action[32]; /* and its action */

void rt_fail_next(const char *spec)
{
    pthread_mutex_lock(&armed_mu);
    const char *colon = strchr(spec, ':');
    snprintf(armed, sizeof(armed), "%.*s", colon ? (int)(colon - spec) : (int)strlen(spec), spec);
    snprintf(armed_action, sizeof(armed_action), "%s", colon ? colon + 1 : "error");
    pthread_mutex_unlock(&armed_mu);
}

const char *rt_call(const char *family, const char *name)
{
    static __thread char fired[32];
    pthread_mutex_lock(&armed_mu);
    int fire = armed[0] && strcmp(armed, name) == 0;
    if (fire) {
        armed[0] = '\0';
        memcpy(fired, armed_action, sizeof(fired));
    }
    pthread_mutex_unlock(&armed_mu);
    if (fire) return fired;
    char full[128];
    snprintf(full, sizeof(full), "gpurt.%s", family);
    const char *any = failpoint(full);
    snprintf(full, sizeof(full), "gpurt.%s.%s", family, name);
    const char *one = failpoint(full);
    return one ? one : any;
}

int rt_is_action(const char *a, const char *want)
{
    return a && strncmp(a, want, strlen(want)) == 0;
}

/* ---- devices ---- */

/* The machine has DUCTILE_GPURT_DEVICES GPUs; this process sees those
 * CUDA_VISIBLE_DEVICES lists, renumbered from 0, as CUDA does (an entry
 * that is not a device there ends the list, as CUDA's parsing does). */
static int visible[64], nvisible = -1;
static pthread_once_t devices_once = PTHREAD_ONCE_INIT;

static void devices_load(void)
{
    const char *v = getenv("DUCTILE_GPURT_DEVICES");
    long x = 0;
    if (v && *v) {
        char *end;
        errno = 0;
        x = strtol(v, &end, 10);
        if (errno || *end || x < 0 || x > 64)
            rt_die("DUCTILE_GPURT_DEVICES='%s' is not a device count in 0..64", v);
    }
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    nvisible = 0;
    if (!cvd) {
        for (int i = 0; i < x; i++)
            visible[nvisible++] = i;
        return;
    }
    for (const char *p = cvd; *p && nvisible < 64;) {
        char *end;
        long d = strtol(p, &end, 10);
        if (end == p || d < 0 || d >= x) break;
        visible[nvisible++] = (int)d;
        p = *end == ',' ? end + 1 : end;
        if (*end != ',') break;
    }
}

int rt_device_count(void)
{
    pthread_once(&devices_once, devices_load);
    return nvisible;
}

int rt_device_physical(int device)
{
    return device >= 0 && device < rt_device_count() ? visible[device] : -1;
}

/* ---- devices and errors ---- */

cudaError_t cudaGetDeviceCount(int *count)
{
    if (!count) return rt_ret(cudaErrorInvalidValue);
    const char *a = rt_call("cuda", "cudaGetDeviceCount");
    if (rt_sticky_err) return rt_ret(rt_sticky_err);
    *count = rt_is_action(a, "error") ? 0 : rt_device_count();
    return *count ? cudaSuccess : rt_ret(cudaErrorNoDevice);
}

cudaError_t cudaSetDevice(int device)
{
    const char *a = rt_call("cuda", "cudaSetDevice");
    if (rt_sticky_err) return rt_ret(rt_sticky_err);
    if (rt_is_action(a, "error")) return rt_ret(cudaErrorInitializationError);
    if (device < 0 || device >= rt_device_count()) return rt_ret(cudaErrorInvalidDevice);
    rt_current_device = device;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device)
{
    if (!device) return rt_ret(cudaErrorInvalidValue);
    *device = rt_current_device;
    return rt_ret(rt_sticky_err);
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int device)
{
    if (!p || device < 0 || device >= rt_device_count()) return rt_ret(cudaErrorInvalidDevice);
    memset(p, 0, sizeof(*p));
    snprintf(p->name, sizeof(p->name), "ductile host test runtime %d", rt_device_physical(device));
    p->totalGlobalMem = (size_t)1 << 30;
    p->multiProcessorCount = 1;
    p->major = 9;
    p->pciBusID = rt_device_physical(device);
    return cudaSuccess;
}

cudaError_t cudaGetLastError(void)
{
    cudaError_t e = rt_sticky_err ? rt_sticky_err : last_error;
    last_error = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError(void)
{
    return rt_sticky_err ? rt_sticky_err : last_error;
}

const char *cudaGetErrorName(cudaError_t e)
{
    switch (e) {
    case cudaSuccess:
        return "cudaSuccess";
    case cudaErrorInvalidValue:
        return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
        return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError:
        return "cudaErrorInitializationError";
    case cudaErrorLaunchFailure:
        return "cudaErrorLaunchFailure";
    case cudaErrorNoDevice:
        return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice:
        return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle:
        return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady:
        return "cudaErrorNotReady";
    case cudaErrorIllegalAddress:
        return "cudaErrorIllegalAddress";
    case cudaErrorLaunchTimeout:
        return "cudaErrorLaunchTimeout";
    case cudaErrorUnknown:
        return "cudaErrorUnknown";
    }
    return "cudaErrorUnknown";
}

const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess:
        return "no error";
    case cudaErrorInvalidValue:
        return "invalid argument";
    case cudaErrorMemoryAllocation:
        return "out of memory";
    case cudaErrorInitializationError:
        return "initialization error";
    case cudaErrorLaunchFailure:
        return "unspecified launch failure";
    case cudaErrorNoDevice:
        return "no CUDA-capable device is detected (host test runtime: DUCTILE_GPURT_DEVICES=0)";
    case cudaErrorInvalidDevice:
        return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
        return "invalid resource handle";
    case cudaErrorNotReady:
        return "device not ready";
    case cudaErrorIllegalAddress:
        return "an illegal memory access was encountered";
    case cudaErrorLaunchTimeout:
        return "the launch timed out and was terminated";
    case cudaErrorUnknown:
        return "unknown error";
    }
    return "unknown error";
}
