/* SPDX-License-Identifier: Apache-2.0 */
/*
 * sync_cost: what each way of telling a consumer process "the producer's stream has written the
 * data" costs on this GPU, and whether each is correct when the producer's stream is busy. It
 * decides between the interprocess event a device send carries today and a flag word written on
 * the producer's stream (cuStreamWriteValue64) and waited on by the consumer's stream
 * (cuStreamWaitValue64), the two ways issue "share once, lease many" asks to be measured.
 *
 *     sync_cost [--rounds N] [--checks K] [--busy-mib M] [--busy-ms T] [--no-control]
 *
 * Two processes (forked before any CUDA call), a Unix socket between them for the messages a
 * channel would send, and one shared page of host memory. The producer owns a 1 MiB buffer the
 * consumer opens with CUDA IPC. One round: the producer writes a new marker into 4 KiB of the
 * buffer on its stream (cuMemsetD32Async), makes the marker known by the mechanism under test,
 * sends a message; the consumer waits by that mechanism, copies the last word on its own stream,
 * synchronises it and answers with what it read. Mechanisms:
 *
 *   event-stream   cuEventRecord of one reused interprocess event; the consumer opened it once
 *                  and makes its stream wait (cuStreamWaitEvent). What devshare does for a pool
 *                  item or a registered tensor's lease after Connection.set_stream (1.19: the
 *                  consumer keeps its producer's events open).
 *   event-host     the same event; the consumer waits on the host (cuEventSynchronize). What a
 *                  receive does without a stream.
 *   event-open     the same event, which the consumer opens (cuIpcOpenEventHandle), makes its
 *                  stream wait on and destroys every round: what a share's event costs (the first
 *                  send of a tensor), and what every item and lease cost before 1.19.
 *   flag-stream    cuStreamWriteValue64 of the round's sequence number into a word of the shared
 *                  host page, registered (cuMemHostRegister, DEVICEMAP) in both processes; the
 *                  consumer's stream waits for it (cuStreamWaitValue64, GEQ).
 *   flag-device    the same into a word of device memory the consumer opened with CUDA IPC.
 *   flag-poll      the host-page word again; the consumer polls it on the CPU, no CUDA call.
 *   host-sync      the producer synchronises its stream before sending; the consumer does not
 *                  wait (what a send without an event does).
 *
 * Then the correctness check, K times per mechanism: the producer's stream is first kept busy
 * for about T ms (cuMemsetD32Async over an M MiB buffer, repeated), then writes the marker; the
 * consumer must read the new marker. "none" (no wait at all) runs the same check as the control:
 * on a GPU it must read stale data at least once, or the check proves nothing (the stand-in runs
 * every stream's work at once, so there it cannot).
 *
 * Prints, per mechanism,
 *     ROUND <name> n=<N> roundtrip_us p50=<t> p90=<t> producer_us p50=<t> consumer_call_us p50=<t>
 *           consumer_us p50=<t> stale=<k>
 *     CHECK <name> fresh=<k>/<K>
 * (producer_us: its work and signal calls; consumer_call_us: the wait call alone, which for
 * a stream wait only queues it; consumer_us: from the wait call until its copy was synchronised,
 * the wait itself included), or UNSUPPORTED <name> <why> (the driver or device cannot), or
 * FAILED <name> <why>; then CHECK none stale=<k>/<K>, the control; INCONCLUSIVE when the control
 * read no stale data (the checks then prove nothing; --no-control, for the stand-in, waives it);
 * and, when the control bit,
 *     FASTEST <name>
 * the quickest stream wait (event-stream, flag-stream, flag-device) that was fresh in every
 * round and check. Exits 0 when every mechanism that ran was, and the control read stale data;
 * 1 otherwise; 2 on bad arguments. A consumer that does not answer within 10 s (a stream that
 * never completes) ends the run: it is killed, and what was measured so far stays printed. The
 * driver is dlopen()ed ($DEVSHARE_CUDA_LIBRARY, else libcuda.so.1): no CUDA toolkit is needed to
 * build it.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <sys/prctl.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef unsigned long long CUdeviceptr;
typedef struct {
    char reserved[64];
} CUipcHandle; /* CUipcMemHandle and CUipcEventHandle: 64 bytes, passed by value */

static struct {
    CUresult (*cuInit)(unsigned);
    CUresult (*cuDeviceGet)(CUdevice *, int);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*cuDevicePrimaryCtxRelease_v2)(CUdevice);
    CUresult (*cuCtxSetCurrent)(CUcontext);
    CUresult (*cuMemAlloc_v2)(CUdeviceptr *, size_t);
    CUresult (*cuMemFree_v2)(CUdeviceptr);
    CUresult (*cuMemsetD32Async)(CUdeviceptr, unsigned, size_t, CUstream);
    CUresult (*cuMemcpyDtoHAsync_v2)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*cuMemHostRegister_v2)(void *, size_t, unsigned);
    CUresult (*cuMemHostUnregister)(void *);
    CUresult (*cuMemHostGetDevicePointer_v2)(CUdeviceptr *, void *, unsigned);
    CUresult (*cuIpcGetMemHandle)(CUipcHandle *, CUdeviceptr);
    CUresult (*cuIpcOpenMemHandle_v2)(CUdeviceptr *, CUipcHandle, unsigned);
    CUresult (*cuIpcCloseMemHandle)(CUdeviceptr);
    CUresult (*cuStreamCreate)(CUstream *, unsigned);
    CUresult (*cuStreamDestroy_v2)(CUstream);
    CUresult (*cuStreamSynchronize)(CUstream);
    CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned);
    CUresult (*cuEventCreate)(CUevent *, unsigned);
    CUresult (*cuEventRecord)(CUevent, CUstream);
    CUresult (*cuEventSynchronize)(CUevent);
    CUresult (*cuEventDestroy_v2)(CUevent);
    CUresult (*cuIpcGetEventHandle)(CUipcHandle *, CUevent);
    CUresult (*cuIpcOpenEventHandle)(CUevent *, CUipcHandle);
    CUresult (*write64)(CUstream, CUdeviceptr, uint64_t, unsigned); /* cuStreamWriteValue64(_v2) */
    CUresult (*wait64)(CUstream, CUdeviceptr, uint64_t, unsigned);  /* cuStreamWaitValue64(_v2) */
    CUresult (*cuGetErrorName)(CUresult, const char **);
} cu;

enum { EVENT_STREAM, EVENT_HOST, EVENT_OPEN, FLAG_STREAM, FLAG_DEVICE, FLAG_POLL, HOST_SYNC, NONE, NMECH };
static const char *const NAMES[NMECH] = {"event-stream", "event-host", "event-open", "flag-stream",
                                         "flag-device", "flag-poll", "host-sync", "none"};
#define CU_EVENT_DISABLE_TIMING 0x2
#define CU_EVENT_INTERPROCESS 0x4
#define CU_STREAM_NON_BLOCKING 0x1
#define CU_MEMHOSTREGISTER_PORTABLE 0x1
#define CU_MEMHOSTREGISTER_DEVICEMAP 0x2
#define CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 0x1
#define CU_STREAM_WAIT_VALUE_GEQ 0x0
#define DATA_BYTES (1u << 20)
#define MARK_WORDS 1024u /* the 4 KiB a round writes */
#define CUDA_ERROR_NOT_SUPPORTED 801
#define POLL_LIMIT_NS 5000000000ull /* flag-poll gives up after 5 s */
#define REPLY_LIMIT_S 10            /* the producer waits 10 s at most for an answer */

/* One message each way. */
struct msg {
    uint32_t mech;
    int32_t rc;       /* consumer: a CUDA error of its side, 0 if none */
    uint64_t seq;     /* the round's sequence number (the flag words' value) */
    uint32_t marker;  /* producer: what it wrote; consumer: what it read */
    uint32_t supported; /* setup: the mechanisms this side can run (bit per mechanism) */
    uint64_t call_ns; /* consumer: time in its wait call alone (a stream wait only queues) */
    uint64_t wait_ns; /* consumer: from its wait call until its copy was synchronised */
    CUipcHandle data, event, flag;
};

static char g_why[NMECH][160];

static const char *err_name(CUresult rc) {
    const char *n = NULL;
    if (cu.cuGetErrorName == NULL || cu.cuGetErrorName(rc, &n) != 0 || n == NULL) n = "?";
    return n;
}

static void *sym(void *lib, const char *a, const char *b) {
    void *p = dlsym(lib, a);
    return p != NULL || b == NULL ? p : dlsym(lib, b);
}

static const char *g_missing; /* the first required call the driver lacks */

/* Resolve `name` (else `alt`) into `field`; a required one that is missing is remembered. */
#define LOAD(field, name, alt, required)                                                      \
    do {                                                                                      \
        void *p_ = sym(lib, name, alt);                                                       \
        memcpy(&cu.field, &p_, sizeof p_);                                                    \
        if (p_ == NULL && (required) && g_missing == NULL) g_missing = name;                  \
    } while (0)

/* dlopen the driver and resolve every call; 0, or -1 with a message. */
static int load(void) {
    const char *path = getenv("DEVSHARE_CUDA_LIBRARY");
    if (path == NULL || *path == '\0') path = "libcuda.so.1";
    void *lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (lib == NULL) {
        fprintf(stderr, "sync_cost: cannot load the CUDA driver (%s): %s\n", path, dlerror());
        return -1;
    }
    LOAD(cuInit, "cuInit", NULL, 1);
    LOAD(cuDeviceGet, "cuDeviceGet", NULL, 1);
    LOAD(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", NULL, 1);
    LOAD(cuDevicePrimaryCtxRelease_v2, "cuDevicePrimaryCtxRelease_v2", NULL, 1);
    LOAD(cuCtxSetCurrent, "cuCtxSetCurrent", NULL, 1);
    LOAD(cuMemAlloc_v2, "cuMemAlloc_v2", NULL, 1);
    LOAD(cuMemFree_v2, "cuMemFree_v2", NULL, 1);
    LOAD(cuMemsetD32Async, "cuMemsetD32Async", NULL, 1);
    LOAD(cuMemcpyDtoHAsync_v2, "cuMemcpyDtoHAsync_v2", NULL, 1);
    LOAD(cuMemHostRegister_v2, "cuMemHostRegister_v2", NULL, 1);
    LOAD(cuMemHostUnregister, "cuMemHostUnregister", NULL, 1);
    LOAD(cuMemHostGetDevicePointer_v2, "cuMemHostGetDevicePointer_v2", NULL, 1);
    LOAD(cuIpcGetMemHandle, "cuIpcGetMemHandle", NULL, 1);
    LOAD(cuIpcOpenMemHandle_v2, "cuIpcOpenMemHandle_v2", NULL, 1);
    LOAD(cuIpcCloseMemHandle, "cuIpcCloseMemHandle", NULL, 1);
    LOAD(cuStreamCreate, "cuStreamCreate", NULL, 1);
    LOAD(cuStreamDestroy_v2, "cuStreamDestroy_v2", NULL, 1);
    LOAD(cuStreamSynchronize, "cuStreamSynchronize", NULL, 1);
    LOAD(cuStreamWaitEvent, "cuStreamWaitEvent", NULL, 1);
    LOAD(cuEventCreate, "cuEventCreate", NULL, 1);
    LOAD(cuEventRecord, "cuEventRecord", NULL, 1);
    LOAD(cuEventSynchronize, "cuEventSynchronize", NULL, 1);
    LOAD(cuEventDestroy_v2, "cuEventDestroy_v2", NULL, 1);
    LOAD(cuIpcGetEventHandle, "cuIpcGetEventHandle", NULL, 1);
    LOAD(cuIpcOpenEventHandle, "cuIpcOpenEventHandle", NULL, 1);
    /* Optional: without them the flag mechanisms are reported unsupported. */
    LOAD(write64, "cuStreamWriteValue64_v2", "cuStreamWriteValue64", 0);
    LOAD(wait64, "cuStreamWaitValue64_v2", "cuStreamWaitValue64", 0);
    LOAD(cuGetErrorName, "cuGetErrorName", NULL, 0);
    if (g_missing != NULL) {
        fprintf(stderr, "sync_cost: the CUDA driver (%s) has no %s\n", path, g_missing);
        return -1;
    }
    return 0;
}

/* A CUDA call that must work; on failure prints and returns from the function with -1. */
#define MUST(call)                                                                            \
    do {                                                                                      \
        CUresult rc_ = (call);                                                                \
        if (rc_ != 0) {                                                                       \
            fprintf(stderr, "sync_cost: %s failed: CUDA error %d (%s)\n", #call, rc_,         \
                    err_name(rc_));                                                           \
            return -1;                                                                        \
        }                                                                                     \
    } while (0)

static int setup_context(CUstream *stream) {
    CUdevice dev = 0;
    CUcontext ctx = NULL;
    MUST(cu.cuInit(0));
    MUST(cu.cuDeviceGet(&dev, 0));
    MUST(cu.cuDevicePrimaryCtxRetain(&ctx, dev));
    MUST(cu.cuCtxSetCurrent(ctx));
    MUST(cu.cuStreamCreate(stream, CU_STREAM_NON_BLOCKING));
    return 0;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int xfer(int fd, struct msg *m, int out) {
    ssize_t n;
    do {
        n = out ? send(fd, m, sizeof *m, MSG_NOSIGNAL) : recv(fd, m, sizeof *m, 0);
    } while (n < 0 && errno == EINTR);
    return n == (ssize_t)sizeof *m ? 0 : -1;
}

/* The shared page: word 0 the flag-stream / flag-poll word. */
static volatile uint64_t *g_page;

/* ---- The consumer ---------------------------------------------------------------------- */

static int consumer(int fd) {
    CUstream s = NULL;
    struct msg m;
    if (load() != 0 || setup_context(&s) != 0 || xfer(fd, &m, 0) != 0) return 1;
    CUdeviceptr data = 0, flag = 0, page = 0;
    CUevent ev = NULL;
    const CUipcHandle evh = m.event; /* (event-open opens it again each round) */
    uint32_t ok = m.supported;
    MUST(cu.cuIpcOpenMemHandle_v2(&data, m.data, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
    MUST(cu.cuIpcOpenEventHandle(&ev, m.event));
    if (cu.cuIpcOpenMemHandle_v2(&flag, m.flag, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) != 0) {
        ok &= ~(1u << FLAG_DEVICE);
    }
    int registered = cu.cuMemHostRegister_v2((void *)g_page, 4096,
                                             CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP) == 0;
    if (!registered || cu.cuMemHostGetDevicePointer_v2(&page, (void *)g_page, 0) != 0) {
        ok &= ~(1u << FLAG_STREAM);
    }
    if (cu.wait64 == NULL) ok &= ~((1u << FLAG_STREAM) | (1u << FLAG_DEVICE));
    m.supported = ok;
    if (xfer(fd, &m, 1) != 0) return 1;
    uint32_t *word = malloc(4);
    while (xfer(fd, &m, 0) == 0 && m.mech < NMECH) {
        CUresult rc = 0;
        uint64_t t0 = now_ns();
        switch (m.mech) {
        case EVENT_STREAM:
            /* (Opened again if an event-open round closed it: outside the timing's meaning,
             * once, as the product opens an event once per connection.) */
            if (ev == NULL) rc = cu.cuIpcOpenEventHandle(&ev, evh);
            if (rc == 0) rc = cu.cuStreamWaitEvent(s, ev, 0);
            break;
        case EVENT_HOST:
            if (ev == NULL) rc = cu.cuIpcOpenEventHandle(&ev, evh);
            if (rc == 0) rc = cu.cuEventSynchronize(ev);
            break;
        case EVENT_OPEN: {
            /* The event is never open twice in this process at once (whether a driver allows
             * that is not what this row measures): the kept one is closed first. */
            if (ev != NULL) {
                rc = cu.cuEventDestroy_v2(ev);
                ev = NULL;
                if (rc != 0) break;
            }
            CUevent once = NULL;
            rc = cu.cuIpcOpenEventHandle(&once, evh);
            if (rc == 0) rc = cu.cuStreamWaitEvent(s, once, 0);
            if (once != NULL) {
                CUresult d = cu.cuEventDestroy_v2(once);
                if (rc == 0) rc = d;
            }
            break;
        }
        case FLAG_STREAM: rc = cu.wait64(s, page, m.seq, CU_STREAM_WAIT_VALUE_GEQ); break;
        case FLAG_DEVICE: rc = cu.wait64(s, flag, m.seq, CU_STREAM_WAIT_VALUE_GEQ); break;
        case FLAG_POLL:
            /* Bounded: a producer stream that faulted never writes the word. */
            while ((int64_t)(__atomic_load_n(g_page, __ATOMIC_ACQUIRE) - m.seq) < 0) {
                if (now_ns() - t0 > POLL_LIMIT_NS) {
                    rc = -1;
                    break;
                }
            }
            break;
        default: break; /* host-sync, none */
        }
        m.call_ns = now_ns() - t0;
        if (rc == 0) rc = cu.cuMemcpyDtoHAsync_v2(word, data + 4 * (MARK_WORDS - 1), 4, s);
        if (rc == 0) rc = cu.cuStreamSynchronize(s);
        m.wait_ns = now_ns() - t0;
        m.rc = rc;
        m.marker = rc == 0 ? *word : 0;
        if (xfer(fd, &m, 1) != 0) return 1;
    }
    free(word);
    if (ev != NULL) MUST(cu.cuEventDestroy_v2(ev));
    MUST(cu.cuIpcCloseMemHandle(data));
    if (flag) MUST(cu.cuIpcCloseMemHandle(flag));
    if (registered) MUST(cu.cuMemHostUnregister((void *)g_page));
    MUST(cu.cuStreamDestroy_v2(s));
    MUST(cu.cuDevicePrimaryCtxRelease_v2(0));
    /* Done with the producer's memory and event: only now may it free them. */
    m.mech = NMECH;
    return xfer(fd, &m, 1) == 0 ? 0 : 1;
}

/* ---- The producer ---------------------------------------------------------------------- */

struct producer {
    int fd;
    CUstream s;
    CUdeviceptr data, flag, page, busy;
    size_t busy_words;
    unsigned busy_reps;
    CUevent ev;
    uint64_t seq;
    uint32_t marker;
    int lost; /* the consumer stopped answering: nothing more can run */
};

/* Queue the round's work, make it known by `mech`; returns the CUDA error of that. */
static CUresult publish(struct producer *p, int mech, unsigned busy_reps) {
    CUresult rc = 0;
    for (unsigned i = 0; i < busy_reps && rc == 0; i++) {
        rc = cu.cuMemsetD32Async(p->busy, i, p->busy_words, p->s);
    }
    if (rc == 0) rc = cu.cuMemsetD32Async(p->data, p->marker, MARK_WORDS, p->s);
    if (rc != 0) return rc;
    switch (mech) {
    case EVENT_STREAM:
    case EVENT_HOST:
    case EVENT_OPEN: return cu.cuEventRecord(p->ev, p->s);
    case FLAG_STREAM:
    case FLAG_POLL: return cu.write64(p->s, p->page, p->seq, 0);
    case FLAG_DEVICE: return cu.write64(p->s, p->flag, p->seq, 0);
    case HOST_SYNC: return cu.cuStreamSynchronize(p->s);
    default: return 0;
    }
}

/* One round: publish, send, wait for the answer. 0 fresh, 1 stale, -1 an error (in `why`;
 * -2: not supported by this driver or device). */
static int round_trip(struct producer *p, int mech, unsigned busy_reps, uint64_t *rt, uint64_t *prod,
                      uint64_t *call, uint64_t *cons) {
    struct msg m = {0};
    p->seq++;
    p->marker = (uint32_t)(p->seq * 2654435761u) | 1u;
    uint64_t t0 = now_ns();
    CUresult rc = publish(p, mech, busy_reps);
    uint64_t t1 = now_ns();
    if (rc != 0) {
        snprintf(g_why[mech], sizeof g_why[mech], "producer: CUDA error %d (%s)", rc, err_name(rc));
        return rc == CUDA_ERROR_NOT_SUPPORTED ? -2 : -1;
    }
    m.mech = (uint32_t)mech;
    m.seq = p->seq;
    if (xfer(p->fd, &m, 1) != 0 || xfer(p->fd, &m, 0) != 0) {
        snprintf(g_why[mech], sizeof g_why[mech], "the consumer did not answer within %d s (or is gone)",
                 REPLY_LIMIT_S);
        p->lost = 1;
        return -1;
    }
    uint64_t t2 = now_ns();
    if (m.rc == -1) {
        snprintf(g_why[mech], sizeof g_why[mech], "consumer: the flag word was not written within 5 s");
        return -1;
    }
    if (m.rc != 0) {
        snprintf(g_why[mech], sizeof g_why[mech], "consumer: CUDA error %d (%s)", m.rc, err_name(m.rc));
        return m.rc == CUDA_ERROR_NOT_SUPPORTED ? -2 : -1;
    }
    if (rt) *rt = t2 - t0;
    if (prod) *prod = t1 - t0;
    if (call) *call = m.call_ns;
    if (cons) *cons = m.wait_ns;
    return m.marker == p->marker ? 0 : 1;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static double pct_us(uint64_t *v, int n, int pct) {
    qsort(v, (size_t)n, sizeof *v, cmp_u64);
    return (double)v[(n - 1) * pct / 100] / 1000.0;
}

static int producer(int fd, int rounds, int checks, size_t busy_mib, double busy_ms, int control) {
    struct producer p = {.fd = fd};
    struct msg m = {0};
    if (load() != 0 || setup_context(&p.s) != 0) return 1;
    uint32_t ok = (1u << NMECH) - 1;
    MUST(cu.cuMemAlloc_v2(&p.data, DATA_BYTES));
    MUST(cu.cuMemsetD32Async(p.data, 0, DATA_BYTES / 4, p.s));
    MUST(cu.cuEventCreate(&p.ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING));
    MUST(cu.cuEventRecord(p.ev, p.s));
    MUST(cu.cuIpcGetMemHandle(&m.data, p.data));
    MUST(cu.cuIpcGetEventHandle(&m.event, p.ev));
    MUST(cu.cuMemAlloc_v2(&p.flag, 2u << 20));
    MUST(cu.cuMemsetD32Async(p.flag, 0, 2, p.s));
    MUST(cu.cuIpcGetMemHandle(&m.flag, p.flag));
    p.busy_words = busy_mib * (1u << 20) / 4;
    MUST(cu.cuMemAlloc_v2(&p.busy, p.busy_words * 4));
    int registered = cu.cuMemHostRegister_v2((void *)g_page, 4096,
                                             CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP) == 0;
    if (!registered || cu.cuMemHostGetDevicePointer_v2(&p.page, (void *)g_page, 0) != 0) {
        ok &= ~((1u << FLAG_STREAM) | (1u << FLAG_POLL));
        snprintf(g_why[FLAG_STREAM], sizeof g_why[0], "cuMemHostRegister(DEVICEMAP) of a shared page failed");
        snprintf(g_why[FLAG_POLL], sizeof g_why[0], "%s", g_why[FLAG_STREAM]);
    }
    if (cu.write64 == NULL || cu.wait64 == NULL) {
        ok &= ~((1u << FLAG_STREAM) | (1u << FLAG_DEVICE) | (1u << FLAG_POLL));
        for (int i = FLAG_STREAM; i <= FLAG_POLL; i++) {
            snprintf(g_why[i], sizeof g_why[0], "the driver has no cuStreamWriteValue64 / cuStreamWaitValue64");
        }
    }
    MUST(cu.cuStreamSynchronize(p.s));
    m.supported = ok;
    if (xfer(fd, &m, 1) != 0 || xfer(fd, &m, 0) != 0) return 1;
    for (int i = 0; i < NMECH; i++) {
        if ((ok & (1u << i)) && !(m.supported & (1u << i)) && !g_why[i][0]) {
            snprintf(g_why[i], sizeof g_why[i], "the consumer cannot (open or register failed)");
        }
    }
    ok &= m.supported;

    /* How many busy memsets make about busy_ms of work on the producer's stream: one to warm
     * up, then ten timed. */
    MUST(cu.cuMemsetD32Async(p.busy, 7, p.busy_words, p.s));
    MUST(cu.cuStreamSynchronize(p.s));
    uint64_t t0 = now_ns();
    for (int i = 0; i < 10; i++) MUST(cu.cuMemsetD32Async(p.busy, (unsigned)i, p.busy_words, p.s));
    MUST(cu.cuStreamSynchronize(p.s));
    double one_ms = (double)(now_ns() - t0) / 1e7;
    p.busy_reps = one_ms <= 0 ? 1 : (unsigned)(busy_ms / one_ms) + 1;
    if (p.busy_reps > 2000) p.busy_reps = 2000;
    printf("BUSY %zu MiB memset %.3f ms, %u per check (about %.1f ms)\n", busy_mib, one_ms,
           p.busy_reps, one_ms * p.busy_reps);

    uint64_t *rt = calloc((size_t)rounds, sizeof *rt), *pr = calloc((size_t)rounds, sizeof *pr),
             *ca = calloc((size_t)rounds, sizeof *ca), *co = calloc((size_t)rounds, sizeof *co);
    double p50[NMECH] = {0};
    int correct[NMECH] = {0}; /* ran, and fresh in every round and check */
    int bad = 0, control_stale = -1;
    for (int mech = 0; mech < NMECH && !p.lost; mech++) {
        if (!(ok & (1u << mech))) {
            printf("UNSUPPORTED %s %s\n", NAMES[mech], g_why[mech]);
            continue;
        }
        int err = 0, stale_rounds = 0;
        if (mech != NONE) {
            for (int i = -rounds / 10; i < rounds && !err; i++) { /* a tenth more to warm up */
                const int k = i < 0 ? 0 : i;
                int r = round_trip(&p, mech, 0, &rt[k], &pr[k], &ca[k], &co[k]);
                err = r < 0 ? r : 0;
                stale_rounds += r == 1;
            }
            if (!err) {
                p50[mech] = pct_us(rt, rounds, 50);
                printf("ROUND %s n=%d roundtrip_us p50=%.1f p90=%.1f producer_us p50=%.1f consumer_call_us "
                       "p50=%.1f consumer_us p50=%.1f stale=%d\n", NAMES[mech], rounds, p50[mech],
                       pct_us(rt, rounds, 90), pct_us(pr, rounds, 50), pct_us(ca, rounds, 50),
                       pct_us(co, rounds, 50), stale_rounds);
            }
        }
        int fresh = 0, stale = 0;
        for (int i = 0; i < checks && !err; i++) {
            int r = round_trip(&p, mech, p.busy_reps, NULL, NULL, NULL, NULL);
            err = r < 0 ? r : 0;
            fresh += r == 0;
            stale += r == 1;
            CUresult rc = cu.cuStreamSynchronize(p.s);
            if (!err && rc != 0) {
                snprintf(g_why[mech], sizeof g_why[mech], "producer: cuStreamSynchronize: CUDA error %d (%s)",
                         rc, err_name(rc));
                err = -1;
            }
        }
        if (err == -2) {
            printf("UNSUPPORTED %s %s\n", NAMES[mech], g_why[mech]);
        } else if (err) {
            printf("FAILED %s %s\n", NAMES[mech], g_why[mech]);
            bad = 1;
        } else if (mech == NONE) {
            control_stale = stale;
            printf("CHECK none stale=%d/%d (the control: a GPU must show stale data here)\n", stale, checks);
        } else {
            printf("CHECK %s fresh=%d/%d\n", NAMES[mech], fresh, checks);
            correct[mech] = fresh == checks && stale_rounds == 0;
            bad |= !correct[mech];
        }
        fflush(stdout);
    }
    /* Without stale data in the control, the checks could not have caught a missing wait. */
    int conclusive = !control || control_stale > 0;
    if (control && !p.lost && control_stale == 0) {
        printf("INCONCLUSIVE the control read no stale data: the checks prove nothing here\n");
        bad = 1;
    }
    int fastest = -1;
    for (int mech = 0; mech < NMECH; mech++) {
        const int stream_wait = mech == EVENT_STREAM || mech == FLAG_STREAM || mech == FLAG_DEVICE;
        if (stream_wait && correct[mech] && (fastest < 0 || p50[mech] < p50[fastest])) fastest = mech;
    }
    if (fastest >= 0 && conclusive) {
        printf("FASTEST %s (stream waits, correct in every round and check)\n", NAMES[fastest]);
    }
    free(rt), free(pr), free(ca), free(co);
    if (p.lost) return 1; /* the consumer may still use the memory: leave it to the exit */
    m.mech = NMECH; /* the end; the consumer answers once it closed what it opened */
    if (xfer(fd, &m, 1) != 0 || xfer(fd, &m, 0) != 0) return 1;
    MUST(cu.cuStreamSynchronize(p.s));
    MUST(cu.cuEventDestroy_v2(p.ev));
    if (registered) MUST(cu.cuMemHostUnregister((void *)g_page));
    MUST(cu.cuMemFree_v2(p.busy));
    MUST(cu.cuMemFree_v2(p.flag));
    MUST(cu.cuMemFree_v2(p.data));
    MUST(cu.cuStreamDestroy_v2(p.s));
    MUST(cu.cuDevicePrimaryCtxRelease_v2(0));
    return bad;
}

static int usage(void) {
    fprintf(stderr, "usage: sync_cost [--rounds N (1-1000000)] [--checks K (1-1000)] "
                    "[--busy-mib M (1-4096)] [--busy-ms T (0-10000)] [--no-control]\n");
    return 2;
}

int main(int argc, char **argv) {
    long rounds = 2000, checks = 20, busy_mib = 256;
    double busy_ms = 20;
    int control = 1;
    for (int i = 1; i < argc; i += 2) {
        if (strcmp(argv[i], "--no-control") == 0) {
            control = 0;
            i--;
            continue;
        }
        if (i + 1 >= argc) return usage();
        char *end = NULL;
        errno = 0;
        if (strcmp(argv[i], "--busy-ms") == 0) {
            busy_ms = strtod(argv[i + 1], &end);
            if (errno || *end || !(busy_ms >= 0 && busy_ms <= 10000)) return usage();
            continue;
        }
        long v = strtol(argv[i + 1], &end, 10);
        if (errno || *end || end == argv[i + 1]) return usage();
        if (strcmp(argv[i], "--rounds") == 0 && v >= 1 && v <= 1000000) rounds = v;
        else if (strcmp(argv[i], "--checks") == 0 && v >= 1 && v <= 1000) checks = v;
        else if (strcmp(argv[i], "--busy-mib") == 0 && v >= 1 && v <= 4096) busy_mib = v;
        else return usage();
    }
    setvbuf(stdout, NULL, _IOLBF, 0); /* each line out at once: a run cut short keeps them */
    g_page = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    int sv[2];
    if (g_page == MAP_FAILED || socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv) != 0) {
        perror("sync_cost: setup");
        return 1;
    }
    pid_t child = fork(); /* before any CUDA call: the driver does not survive fork */
    if (child < 0) {
        perror("sync_cost: fork");
        return 1;
    }
    if (child == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive the producer */
        close(sv[0]);
        _exit(consumer(sv[1]));
    }
    close(sv[1]);
    /* A consumer that stops answering (its stream stuck) ends the run, not hangs it. */
    struct timeval limit = {REPLY_LIMIT_S, 0};
    setsockopt(sv[0], SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
    int rc = producer(sv[0], (int)rounds, (int)checks, (size_t)busy_mib, busy_ms, control) != 0;
    fflush(stdout);
    close(sv[0]);
    int st = 0;
    if (rc) {
        kill(child, SIGKILL); /* after a failure it may be stuck in a wait */
    }
    while (waitpid(child, &st, 0) < 0 && errno == EINTR) {
    }
    if (!rc && (!WIFEXITED(st) || WEXITSTATUS(st) != 0)) {
        fprintf(stderr, "sync_cost: the consumer process failed (status %#x)\n", st);
        rc = 1;
    }
    return rc;
}
