/* SPDX-License-Identifier: Apache-2.0 */
/*
 * selftest: exercises every rule of the CUDA stand-in (cuda_standin.c) with real processes.
 *
 * The orchestrator (main) never initialises CUDA: it fork()s the producer and consumer of each
 * scenario (the driver does not survive a fork after cuInit), points DEVSHARE_STANDIN_LOG at a
 * fresh file per scenario and, once the children have exited, checks which violations were
 * logged, that every child exited as planned, and that no /dev/shm/cusi_* object of a child is
 * left behind. Prints "ok - <scenario>" / "FAIL ..." and exits 0 when everything passed.
 *
 * Build (from the repository root):
 *   gcc -std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -Werror -shared -fPIC -pthread \
 *       -Wl,-soname,libcuda.so.1 -o libcuda.so.1 tests/standin/cuda/cuda_standin.c -lrt
 *   gcc -std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -Werror -pthread -o cuda_selftest \
 *       tests/standin/cuda/selftest.c ./libcuda.so.1 -Wl,-rpath,'$ORIGIN' -ldl
 */
#include "cuda_standin.h"

#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int failures;

static void fail(const char *file, int line, const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "FAIL %s:%d (pid %d): ", file, line, (int)getpid());
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    failures++;
}

#define CHECK(cond) do { if (!(cond)) fail(__FILE__, __LINE__, "%s", #cond); } while (0)
/* A driver call must return `want`. */
#define CU(want, call)                                                                 \
    do {                                                                               \
        CUresult r_ = (call);                                                          \
        if (r_ != (want)) {                                                            \
            const char *n_ = NULL;                                                     \
            cuGetErrorName(r_, &n_);                                                   \
            fail(__FILE__, __LINE__, "%s returned %d (%s), expected %d", #call, r_,    \
                 n_ ? n_ : "?", (want));                                               \
        }                                                                              \
    } while (0)
#define OK(call) CU(CUDA_SUCCESS, call)
/* ... and counts one more expected violation (`v` in the calling role). */
#define CUV(want, call) do { CU(want, call); v++; } while (0)

/* ---- pipes between the two children of a scenario ---- */

static void put(int fd, const void *p, size_t n) {
    const char *c = p;
    while (n) {
        ssize_t w = write(fd, c, n);
        if (w <= 0) { fail(__FILE__, __LINE__, "write to pipe failed"); return; }
        c += w, n -= (size_t)w;
    }
}

/* Reads exactly n bytes; 0 on end of file (the other side exited). */
static int get(int fd, void *p, size_t n) {
    char *c = p;
    while (n) {
        ssize_t r = read(fd, c, n);
        if (r <= 0) return 0;
        c += r, n -= (size_t)r;
    }
    return 1;
}

static void put_tok(int fd, char t) { put(fd, &t, 1); }
static void get_tok(int fd, char want) {
    char t = 0;
    if (!get(fd, &t, 1) || t != want) fail(__FILE__, __LINE__, "expected token '%c'", want);
}

/* ---- child helpers ---- */

static CUcontext setup(int ordinal) {
    CUcontext ctx = NULL;
    CUdevice dev = -1;
    OK(cuInit(0));
    OK(cuDeviceGet(&dev, ordinal));
    OK(cuDevicePrimaryCtxRetain(&ctx, dev));
    OK(cuCtxSetCurrent(ctx));
    return ctx;
}

static int attr_int(int attribute, CUdeviceptr p) {
    int v = -7;
    OK(cuPointerGetAttribute(&v, attribute, p));
    return v;
}

/* Child ends: exit() (not _exit) so that the stand-in's exit checks run. */
static void finish(int expected_violations) {
    if (cusi_violation_count() != expected_violations)
        fail(__FILE__, __LINE__, "violation count %d, expected %d", cusi_violation_count(),
             expected_violations);
    exit(failures ? 1 : 0);
}

/* ---- orchestrator helpers ---- */

static char g_log[256];
static pid_t g_kids[8];
static int g_nkids;
static int g_before; /* failures before the scenario began */

/* The stand-in's objects in /dev/shm when the scenario began: objects of earlier processes
 * (killed ones leave theirs) whose pid a child of this scenario may have again once pids wrap,
 * so not the children's leftovers. */
static char **g_stale;
static int g_nstale;

static void snapshot_stale(void) {
    for (int i = 0; i < g_nstale; i++) free(g_stale[i]);
    free(g_stale);
    g_stale = NULL;
    g_nstale = 0;
    DIR *d = opendir("/dev/shm");
    if (!d) return;
    int cap = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (strncmp(e->d_name, "cusi_", 5)) continue;
        if (g_nstale == cap) {
            cap = cap ? 2 * cap : 64;
            char **grown = realloc(g_stale, (size_t)cap * sizeof *grown);
            if (!grown) break;
            g_stale = grown;
        }
        if (!(g_stale[g_nstale] = strdup(e->d_name))) break;
        g_nstale++;
    }
    closedir(d);
}

static int was_stale(const char *name) {
    for (int i = 0; i < g_nstale; i++)
        if (!strcmp(g_stale[i], name)) return 1;
    return 0;
}

static void begin(const char *name) {
    snapshot_stale();
    snprintf(g_log, sizeof g_log, "/tmp/cusi_selftest_%d_%s.log", (int)getpid(), name);
    unlink(g_log);
    setenv("DEVSHARE_STANDIN_LOG", g_log, 1);
    g_nkids = 0;
    g_before = failures;
}

typedef void (*role_fn)(int in, int out);

/* Forks a child that runs role(in, out) and closes every other end of the scenario's pipes. */
static pid_t spawn(role_fn role, int in, int out, const int *all, int nall) {
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        failures = 0; /* the orchestrator's failures are not the child's */
        for (int i = 0; i < nall; i++)
            if (all[i] != in && all[i] != out) close(all[i]);
        role(in, out);
        exit(failures ? 1 : 0);
    }
    g_kids[g_nkids++] = pid;
    return pid;
}

/* Runs producer and consumer connected by two pipes. */
static void pair(role_fn producer, role_fn consumer) {
    int a[2], b[2]; /* a: producer -> consumer, b: consumer -> producer */
    if (pipe(a) || pipe(b)) { perror("pipe"); exit(2); }
    int all[4] = {a[0], a[1], b[0], b[1]};
    spawn(producer, b[0], a[1], all, 4);
    spawn(consumer, a[0], b[1], all, 4);
    for (int i = 0; i < 4; i++) close(all[i]);
}

/* Waits for every child; `signal_of[i]` != 0 means child i must die of that signal. */
static void reap(const int *signal_of) {
    for (int i = 0; i < g_nkids; i++) {
        int st = 0;
        waitpid(g_kids[i], &st, 0);
        int want_sig = signal_of ? signal_of[i] : 0;
        if (want_sig ? !(WIFSIGNALED(st) && WTERMSIG(st) == want_sig)
                     : !(WIFEXITED(st) && WEXITSTATUS(st) == 0))
            fail(__FILE__, __LINE__, "child %d (#%d) ended with status 0x%x", (int)g_kids[i], i,
                 st);
    }
}

/* Nothing of a scenario's children may be left in /dev/shm. */
static void no_leftovers(void) {
    DIR *d = opendir("/dev/shm");
    if (!d) return;
    for (struct dirent *e; (e = readdir(d));)
        for (int i = 0; i < g_nkids; i++) {
            char tag[32];
            snprintf(tag, sizeof tag, "_%d_", (int)g_kids[i]);
            if (!strncmp(e->d_name, "cusi_", 5) && strstr(e->d_name, tag) && !was_stale(e->d_name)) {
                fail(__FILE__, __LINE__, "left in /dev/shm: %s", e->d_name);
                char path[300];
                snprintf(path, sizeof path, "/dev/shm/%s", e->d_name);
                unlink(path);
            }
        }
    closedir(d);
}

static int count_in(const char *text, const char *needle) {
    int n = 0;
    for (const char *p = text; (p = strstr(p, needle)); p++) n++;
    return n;
}

/* The log must hold `total` lines, and each (substring, count) pair as given; NULL ends. */
static void expect_log(const char *scenario, int total, ...) {
    char buf[65536] = "";
    FILE *f = fopen(g_log, "r");
    if (f) {
        size_t n = fread(buf, 1, sizeof buf - 1, f);
        buf[n] = 0;
        fclose(f);
    }
    if (count_in(buf, "\n") != total)
        fail(__FILE__, __LINE__, "%s: %d violation lines, expected %d", scenario,
             count_in(buf, "\n"), total);
    if (count_in(buf, "cuda pid=") != count_in(buf, "\n"))
        fail(__FILE__, __LINE__, "%s: malformed log lines", scenario);
    va_list ap;
    va_start(ap, total);
    for (const char *s; (s = va_arg(ap, const char *));) {
        int want = va_arg(ap, int);
        if (count_in(buf, s) != want)
            fail(__FILE__, __LINE__, "%s: \"%s\" logged %d times, expected %d", scenario, s,
                 count_in(buf, s), want);
    }
    va_end(ap);
    no_leftovers();
    if (failures != g_before) fprintf(stderr, "---- %s log ----\n%s----\n", scenario, buf);
    printf("%s - %s\n", failures == g_before ? "ok" : "FAIL", scenario);
    unlink(g_log);
}

/* =========================================================================================
 * Scenario "clean": correct use end to end, both directions of data, events; no violation.
 * ========================================================================================= */

enum { SIZE = (3 << 20) + 100, OFF_P = 1000, OFF_C = 2000, N = 64 };

static void clean_producer(int in, int out) {
    CUcontext ctx = setup(0), c2 = NULL;
    int count = 0, v = 0;
    char name[64];
    CUuuid u0, u1;
    OK(cuDeviceGetCount(&count));
    CHECK(count == 2);
    OK(cuDeviceGetName(name, sizeof name, 0));
    CHECK(!strcmp(name, "devshare stand-in GPU 0"));
    OK(cuDeviceGetUuid(&u0, 0));
    OK(cuDeviceGetUuid_v2(&u1, 1));
    CHECK(memcmp(&u0, &u1, sizeof u0) != 0 && !memcmp(u0.bytes, "SIGPU-00", 9));
    OK(cuDriverGetVersion(&v));
    CHECK(v == 12040);
    OK(cuCtxGetCurrent(&c2));
    CHECK(c2 == ctx);
    OK(cuCtxGetDevice(&v));
    CHECK(v == 0);

    CUdeviceptr a = 0, base = 0;
    size_t size = 0;
    unsigned char buf[N], pat[N];
    OK(cuMemAlloc(&a, SIZE));
    CHECK(a % (2u << 20) == 0);
    OK(cuMemcpyDtoH(buf, a + 77, N)); /* fresh memory is garbage, not zero */
    CHECK(buf[0] == 0xA5 && buf[N - 1] == 0xA5);
    OK(cuMemsetD8(a, 0x11, SIZE));
    for (int i = 0; i < N; i++) pat[i] = (unsigned char)(i * 3 + 1);
    OK(cuMemcpyHtoD(a + OFF_P, pat, N));
    OK(cuMemGetAddressRange(&base, &size, a + SIZE - 1));
    CHECK(base == a && size == SIZE);
    OK(cuMemGetAddressRange(NULL, &size, a + 5000));
    CHECK(attr_int(CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, a) == 1);
    CHECK(attr_int(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, a + 9) == 0);
    OK(cuPointerGetAttribute(&c2, CU_POINTER_ATTRIBUTE_CONTEXT, a));
    CHECK(c2 == ctx);

    CUipcMemHandle h;
    OK(cuIpcGetMemHandle(&h, a));
    CHECK(cusi_handle_fetches(a) == 1 && cusi_live_opens(h) == 0);
    put(out, &h, sizeof h);

    CUstream s;
    CUevent e, plain;
    CUipcEventHandle eh;
    OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    OK(cuEventCreate(&plain, CU_EVENT_DEFAULT));
    OK(cuEventRecord(plain, s));
    OK(cuEventCreate(&e, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING));
    OK(cuEventRecord(e, s));
    OK(cuIpcGetEventHandle(&eh, e));
    put(out, &eh, sizeof eh);

    get_tok(in, 'o'); /* consumer opened */
    CHECK(cusi_live_opens(h) == 1);
    put_tok(out, 'g');
    get_tok(in, 'c'); /* consumer closed */
    CHECK(cusi_live_opens(h) == 0);
    CHECK(cusi_event_waits(e) == 1);
    OK(cuMemcpyDtoH(buf, a + OFF_C, N)); /* the consumer's write is visible here */
    for (int i = 0; i < N; i++) CHECK(buf[i] == (unsigned char)(255 - i));
    OK(cuMemcpyDtoH(buf, a + OFF_C + N, 1));
    CHECK(buf[0] == 0x11);

    OK(cuStreamSynchronize(s));
    OK(cuEventSynchronize(e));
    OK(cuEventQuery(plain));
    OK(cuCtxSynchronize());
    OK(cuEventDestroy(plain));
    OK(cuEventDestroy(e));
    OK(cuStreamDestroy(s));
    OK(cuMemFree(a));
    CHECK(cusi_live_opens(h) == -1); /* allocation gone */
    OK(cuDevicePrimaryCtxRelease(0));
    finish(0);
}

static void clean_consumer(int in, int out) {
    CUcontext ctx = setup(0), c2 = NULL;
    CUipcMemHandle h;
    CUipcEventHandle eh;
    CHECK(get(in, &h, sizeof h) && get(in, &eh, sizeof eh));
    CUdeviceptr p = 0, base = 0;
    size_t size = 0;
    unsigned char buf[N], pat[N];
    OK(cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
    CHECK(p % (2u << 20) == 0);
    OK(cuMemGetAddressRange(&base, &size, p + 4096)); /* interior pointer of the mapping */
    CHECK(base == p && size == SIZE);
    CHECK(attr_int(CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, p) == 0);
    CHECK(attr_int(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p) == 0);
    OK(cuPointerGetAttribute(&c2, CU_POINTER_ATTRIBUTE_CONTEXT, p + 1));
    CHECK(c2 == ctx);
    OK(cuMemcpyDtoH(buf, p + OFF_P, N)); /* the producer's data is visible here */
    for (int i = 0; i < N; i++) CHECK(buf[i] == (unsigned char)(i * 3 + 1));
    for (int i = 0; i < N; i++) pat[i] = (unsigned char)(255 - i);
    OK(cuMemcpyHtoD(p + OFF_C, pat, N));
    OK(cuMemcpyDtoD(p + SIZE - N, p + OFF_P, N));
    OK(cuMemcpyDtoH(buf, p + SIZE - N, N));
    CHECK(buf[5] == 16);
    put_tok(out, 'o');
    get_tok(in, 'g');

    /* Spec section 5: open the event, make the reading stream wait, destroy it. */
    CUevent e;
    CUstream s;
    OK(cuStreamCreate(&s, 0));
    OK(cuIpcOpenEventHandle(&e, eh));
    OK(cuStreamWaitEvent(s, e, 0));
    OK(cuEventDestroy(e));
    OK(cuStreamSynchronize(s));
    OK(cuStreamDestroy(s));
    OK(cuIpcCloseMemHandle(p));
    put_tok(out, 'c');
    OK(cuDevicePrimaryCtxRelease(0));
    finish(0);
}

/* =========================================================================================
 * Scenario "ipc-misuse": every memory-IPC rule broken once.
 * ========================================================================================= */

static void misuse_producer(int in, int out) {
    setup(0);
    CUdeviceptr a = 0, pool = 0, base = 0, x = 0;
    size_t size = 0;
    CUipcMemHandle h, h2, bad;
    OK(cuMemAlloc(&a, 1 << 20));
    /* interior pointer: refused for export, resolved by cuMemGetAddressRange */
    CU(CUDA_ERROR_INVALID_VALUE, cuIpcGetMemHandle(&h, a + 512));
    OK(cuMemGetAddressRange(&base, &size, a + 512));
    CHECK(base == a && size == 1 << 20);
    CU(CUDA_ERROR_NOT_FOUND, cuMemGetAddressRange(&base, &size, 0x1000)); /* error only */
    CU(CUDA_ERROR_INVALID_VALUE, cuPointerGetAttribute(&size, 1, 0x1000)); /* error only */
    /* pool memory: usable, not legacy-IPC capable */
    OK(cuMemAllocAsync(&pool, 4096, NULL));
    OK(cuMemsetD8(pool, 1, 4096));
    CHECK(attr_int(CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, pool) == 0);
    CU(CUDA_ERROR_NOT_SUPPORTED, cuIpcGetMemHandle(&h, pool));
    OK(cuMemFreeAsync(pool, NULL));
    /* fetched twice: same bytes, but a violation */
    OK(cuIpcGetMemHandle(&h, a));
    OK(cuIpcGetMemHandle(&h2, a));
    CHECK(!memcmp(&h, &h2, sizeof h) && cusi_handle_fetches(a) == 2);
    /* opened in the exporter */
    CU(CUDA_ERROR_INVALID_CONTEXT, cuIpcOpenMemHandle(&x, h, 0));
    /* foreign bytes: error only */
    memset(&bad, 0, sizeof bad);
    CU(CUDA_ERROR_INVALID_HANDLE, cuIpcOpenMemHandle(&x, bad, 0));
    bad = h;
    bad.reserved[63] ^= 1;
    CU(CUDA_ERROR_INVALID_HANDLE, cuIpcOpenMemHandle(&x, bad, 0));
    put(out, &h, sizeof h);

    get_tok(in, 'o');
    CU(CUDA_ERROR_INVALID_VALUE, cuMemFree(a + 512));
    OK(cuMemFree(a)); /* freed under a live open: a violation, still freed */
    CU(CUDA_ERROR_INVALID_VALUE, cuMemFree(a));
    CHECK(cusi_live_opens(h) == -1);
    put_tok(out, 'f');
    finish(7);
}

static void misuse_consumer(int in, int out) {
    setup(0);
    CUipcMemHandle h;
    CHECK(get(in, &h, sizeof h));
    CUdeviceptr p = 0, q = 0;
    unsigned char buf[16];
    CU(CUDA_ERROR_INVALID_VALUE, cuIpcOpenMemHandle(&p, h, 2));
    OK(cuIpcOpenMemHandle(&p, h, 0));
    CU(CUDA_ERROR_ALREADY_MAPPED, cuIpcOpenMemHandle(&q, h, 0));
    CHECK(cusi_live_opens(h) == 1);
    CU(CUDA_ERROR_INVALID_VALUE, cuMemcpyDtoH(buf, p + (1 << 20) - 4, 8)); /* out of bounds */
    CU(CUDA_ERROR_INVALID_VALUE, cuMemsetD8(p - 1, 0, 1));                 /* out of bounds */
    CU(CUDA_ERROR_INVALID_VALUE, cuMemcpyHtoD(p, (void *)(uintptr_t)p, 4)); /* device as host */
    CU(CUDA_ERROR_INVALID_VALUE, cuIpcCloseMemHandle(p + 64));
    CU(CUDA_ERROR_INVALID_VALUE, cuMemFree(p));
    CU(CUDA_ERROR_INVALID_VALUE, cuIpcGetMemHandle(&h, p)); /* re-export of a mapping */
    put_tok(out, 'o');
    get_tok(in, 'f');
    OK(cuMemcpyDtoH(buf, p, 16)); /* the mapping outlives the exporter's free */
    OK(cuIpcCloseMemHandle(p));
    CU(CUDA_ERROR_INVALID_VALUE, cuIpcCloseMemHandle(p)); /* closed twice */
    CU(CUDA_ERROR_INVALID_HANDLE, cuIpcOpenMemHandle(&p, h, 0)); /* freed: error only */
    finish(9);
}

/* =========================================================================================
 * Scenario "peer": the consumer sees the devices in another order (CUDA_STANDIN_VISIBLE=1,0).
 * ========================================================================================= */

static void peer_producer(int in, int out) {
    setup(0);
    CUdeviceptr a = 0;
    CUipcMemHandle h;
    CUuuid u;
    OK(cuMemAlloc(&a, 8192));
    OK(cuMemsetD8(a, 0x5A, 8192));
    OK(cuIpcGetMemHandle(&h, a));
    OK(cuDeviceGetUuid(&u, 0));
    put(out, &h, sizeof h);
    put(out, &u, sizeof u);
    get_tok(in, 'd');
    OK(cuMemFree(a));
    finish(0);
}

static void peer_consumer(int in, int out) {
    setenv("CUDA_STANDIN_VISIBLE", "1,0", 1);
    CUipcMemHandle h;
    CUuuid theirs, mine0, mine1;
    CHECK(get(in, &h, sizeof h) && get(in, &theirs, sizeof theirs));
    CUcontext c0 = setup(0), c1 = NULL;
    char name[64];
    OK(cuDeviceGetName(name, sizeof name, 0));
    CHECK(!strcmp(name, "devshare stand-in GPU 1"));
    OK(cuDeviceGetUuid(&mine0, 0));
    OK(cuDeviceGetUuid(&mine1, 1));
    CHECK(memcmp(&mine0, &theirs, sizeof theirs) != 0); /* same ordinal, other card */
    CHECK(memcmp(&mine1, &theirs, sizeof theirs) == 0); /* the UUID finds the card */

    CUdeviceptr p = 0;
    unsigned char b = 0;
    /* ordinal 0 here is physical 1: another device than the exporter's */
    CU(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, cuIpcOpenMemHandle(&p, h, 0)); /* error only */
    OK(cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
    CHECK(attr_int(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p) == 1); /* where the memory lives */
    OK(cuMemcpyDtoH(&b, p + 8191, 1));
    CHECK(b == 0x5A);
    OK(cuIpcCloseMemHandle(p));
    /* on the exporter's own card no peer access is needed */
    OK(cuDevicePrimaryCtxRetain(&c1, 1));
    OK(cuCtxSetCurrent(c1));
    OK(cuIpcOpenMemHandle(&p, h, 0));
    OK(cuIpcCloseMemHandle(p));
    OK(cuCtxSetCurrent(c0));
    put_tok(out, 'd');
    finish(0);
}

/* CUDA_STANDIN_DEVICES / CUDA_STANDIN_VISIBLE parsing: the list ends at the first bad entry. */
static void devices_role(int in, int out) {
    (void)in, (void)out;
    int n = -1;
    setenv("CUDA_STANDIN_DEVICES", "3", 1);
    setenv("CUDA_STANDIN_VISIBLE", "2,0,7,1", 1);
    OK(cuInit(0));
    OK(cuDeviceGetCount(&n));
    CHECK(n == 2);
    char name[64];
    OK(cuDeviceGetName(name, sizeof name, 0));
    CHECK(!strcmp(name, "devshare stand-in GPU 2"));
    CU(CUDA_ERROR_INVALID_DEVICE, cuDeviceGetName(name, sizeof name, 2)); /* error only */
    finish(0);
}

static void nodevice_role(int in, int out) {
    (void)in, (void)out;
    setenv("CUDA_STANDIN_VISIBLE", "", 1);
    CU(CUDA_ERROR_NO_DEVICE, cuInit(0)); /* error only */
    finish(0);
}

/* =========================================================================================
 * Scenario "host-register": page-locked host ranges.
 * ========================================================================================= */

static void host_register_role(int in, int out) {
    (void)in, (void)out;
    setup(0);
    static unsigned char buf[8192];
    CUdeviceptr d;
    OK(cuMemAlloc(&d, 4096));
    OK(cuMemHostRegister_v2(buf, 4096, 0));
    CU(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, cuMemHostRegister_v2(buf + 100, 100, 0));
    CU(CUDA_ERROR_INVALID_VALUE, cuMemHostRegister_v2(buf + 4096, 0, 0));
    CU(CUDA_ERROR_INVALID_VALUE, cuMemHostRegister_v2((void *)(uintptr_t)d, 4096, 0));
    OK(cuMemcpyDtoH(buf, d, 4096)); /* copies to and from a registered range work as before */
    CU(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, cuMemHostUnregister(buf + 1));
    if (cusi_host_registered() != 1) fail(__FILE__, __LINE__, "%d ranges registered, expected 1", cusi_host_registered());
    OK(cuMemHostUnregister(buf));
    if (cusi_host_registered() != 0) fail(__FILE__, __LINE__, "%d ranges registered, expected 0", cusi_host_registered());
    CU(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, cuMemHostUnregister(buf)); /* twice */
    OK(cuMemFree(d));
    finish(5);
}

/* =========================================================================================
 * Scenario "memops": stream memory operations (cuStreamWriteValue64 / cuStreamWaitValue64) on
 * device memory and on host memory registered with DEVICEMAP.
 * ========================================================================================= */

static void memops_role(int in, int out) {
    (void)in, (void)out;
    setup(0);
    static _Alignas(4096) uint64_t page[512], plain[512];
    CUdeviceptr d, hp, x;
    CUstream s;
    uint64_t got = 0;
    OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    OK(cuMemAlloc(&d, 4096));
    OK(cuMemHostRegister_v2(page, sizeof page, CU_MEMHOSTREGISTER_DEVICEMAP));
    OK(cuMemHostRegister_v2(plain, sizeof plain, 0));
    OK(cuMemHostGetDevicePointer_v2(&hp, page + 3, 0));
    CHECK(hp == (CUdeviceptr)(uintptr_t)(page + 3));
    CU(CUDA_ERROR_INVALID_VALUE, cuMemHostGetDevicePointer_v2(&x, plain, 0));   /* no DEVICEMAP */
    CU(CUDA_ERROR_INVALID_VALUE, cuMemHostGetDevicePointer_v2(&x, page, 1));    /* flags */
    /* writes land, in order, where they are aimed */
    OK(cuStreamWriteValue64_v2(s, hp, 41, CU_STREAM_WRITE_VALUE_DEFAULT));
    OK(cuStreamWriteValue64_v2(s, d + 8, 7, CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER));
    CHECK(page[3] == 41);
    OK(cuMemcpyDtoHAsync_v2(&got, d + 8, 8, s));
    CHECK(got == 7);
    OK(cuStreamWaitValue64_v2(s, hp, 40, CU_STREAM_WAIT_VALUE_GEQ));
    OK(cuStreamWaitValue64_v2(s, d + 8, 7, CU_STREAM_WAIT_VALUE_EQ | CU_STREAM_WAIT_VALUE_FLUSH));
    OK(cuStreamWaitValue64_v2(s, d + 8, 2, CU_STREAM_WAIT_VALUE_AND));    /* 7 & 2 */
    OK(cuStreamWaitValue64_v2(s, d + 8, 0, CU_STREAM_WAIT_VALUE_NOR));    /* ~(7 | 0) != 0 */
    OK(cuStreamWaitValue64_v2(s, hp, (uint64_t)-5, CU_STREAM_WAIT_VALUE_GEQ)); /* cyclic: 41 - (-5) >= 0 */
    OK(cuMemsetD32Async(d, 0x01020304u, 2, s));
    OK(cuMemcpyDtoHAsync_v2(&got, d, 8, s));
    CHECK(got == 0x0102030401020304ull);
    /* the rules */
    CU(CUDA_ERROR_INVALID_VALUE, cuStreamWriteValue64_v2(s, hp + 4, 1, 0));   /* unaligned */
    CU(CUDA_ERROR_INVALID_VALUE, cuStreamWriteValue64_v2(s, (CUdeviceptr)(uintptr_t)plain, 1, 0));
    CU(CUDA_ERROR_INVALID_VALUE, cuStreamWriteValue64_v2(s, d + 4096, 1, 0)); /* out of bounds */
    CU(CUDA_ERROR_INVALID_VALUE, cuStreamWriteValue64_v2(s, hp, 1, 2));       /* flags */
    CU(CUDA_ERROR_INVALID_VALUE, cuStreamWaitValue64_v2(s, hp, 1, 4));        /* flags */
    CU(CUDA_ERROR_INVALID_VALUE, cuMemsetD32Async(d + 2, 0, 1, s));           /* unaligned */
    OK(cuMemHostUnregister(plain));
    OK(cuMemHostUnregister(page));
    OK(cuMemFree(d));
    OK(cuStreamDestroy(s));
    finish(8);
}

/* =========================================================================================
 * Scenario "events": interprocess event rules.
 * ========================================================================================= */

static void events_producer(int in, int out) {
    CUcontext c0 = setup(0), c1 = NULL;
    CUevent e, plain, x;
    CUstream s1;
    CUipcEventHandle eh;
    int local = 0;
    CU(CUDA_ERROR_INVALID_VALUE, cuEventCreate(&x, CU_EVENT_INTERPROCESS));
    OK(cuEventCreate(&plain, CU_EVENT_DISABLE_TIMING));
    CU(CUDA_ERROR_INVALID_VALUE, cuIpcGetEventHandle(&eh, plain));
    OK(cuEventCreate(&e, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING));
    OK(cuEventRecord(e, NULL));
    OK(cuIpcGetEventHandle(&eh, e));
    CU(CUDA_ERROR_INVALID_CONTEXT, cuIpcOpenEventHandle(&x, eh));
    /* record needs the event's and the stream's context to match */
    OK(cuDevicePrimaryCtxRetain(&c1, 1));
    OK(cuCtxSetCurrent(c1));
    OK(cuStreamCreate(&s1, 0));
    OK(cuCtxSetCurrent(c0));
    CU(CUDA_ERROR_INVALID_HANDLE, cuEventRecord(e, s1));
    OK(cuStreamWaitEvent(s1, e, 0)); /* waiting across contexts is fine */
    CU(CUDA_ERROR_INVALID_HANDLE, cuStreamSynchronize((CUstream)&local));
    put(out, &eh, sizeof eh);
    get_tok(in, 'w');
    CHECK(cusi_event_waits(e) == 2);
    CHECK(cusi_event_waits(plain) == -1);
    OK(cuEventDestroy(e));
    CU(CUDA_ERROR_INVALID_HANDLE, cuEventDestroy(e));
    put_tok(out, 'x');
    get_tok(in, 'z');
    OK(cuEventDestroy(plain));
    OK(cuStreamDestroy(s1));
    CU(CUDA_ERROR_INVALID_HANDLE, cuStreamDestroy(s1));
    finish(7);
}

static void events_consumer(int in, int out) {
    setup(0);
    CUipcEventHandle eh, bad;
    CUevent e1, e2, e3, x;
    CHECK(get(in, &eh, sizeof eh));
    OK(cuIpcOpenEventHandle(&e1, eh));
    CU(CUDA_ERROR_INVALID_VALUE, cuStreamWaitEvent(NULL, e1, 1));
    OK(cuStreamWaitEvent(NULL, e1, 0));
    OK(cuEventSynchronize(e1));
    OK(cuEventRecord(e1, NULL)); /* recording an opened event is allowed */
    OK(cuEventDestroy(e1));
    OK(cuIpcOpenEventHandle(&e2, eh));
    OK(cuEventDestroy(e2)); /* never waited on */
    OK(cuIpcOpenEventHandle(&e3, eh)); /* never destroyed: reported at exit */
    memset(&bad, 0, sizeof bad);
    CU(CUDA_ERROR_INVALID_HANDLE, cuIpcOpenEventHandle(&x, bad)); /* error only */
    put_tok(out, 'w');
    get_tok(in, 'x');
    CU(CUDA_ERROR_INVALID_HANDLE, cuIpcOpenEventHandle(&x, eh)); /* destroyed: error only */
    put_tok(out, 'z');
    finish(2); /* + 1 at exit */
}

/* =========================================================================================
 * Scenario "context": initialisation, contexts, threads, legacy symbols, fork.
 * ========================================================================================= */

static void *thread_body(void *arg) {
    CUcontext ctx = arg;
    CUdeviceptr p = 0;
    CU(CUDA_ERROR_INVALID_CONTEXT, cuMemAlloc(&p, 64)); /* the new thread has no context */
    OK(cuCtxSetCurrent(ctx));
    OK(cuMemAlloc(&p, 64));
    OK(cuMemFree(p));
    return NULL;
}

static void context_role(int in, int out) {
    (void)in, (void)out;
    int n = 0;
    CUcontext ctx = NULL;
    CUdeviceptr a = 0;
    CU(CUDA_ERROR_NOT_INITIALIZED, cuDeviceGetCount(&n));
    OK(cuDriverGetVersion(&n)); /* works before cuInit */
    CU(CUDA_ERROR_INVALID_VALUE, cuInit(1));
    OK(cuInit(0));
    OK(cuInit(0)); /* repeated: fine */
    CU(CUDA_ERROR_INVALID_DEVICE, cuDeviceGet(&n, 5)); /* error only */
    CU(CUDA_ERROR_INVALID_CONTEXT, cuMemAlloc(&a, 64));
    CU(CUDA_ERROR_INVALID_CONTEXT, cuCtxSynchronize());
    OK(cuCtxGetCurrent(&ctx));
    CHECK(ctx == NULL);
    OK(cuDevicePrimaryCtxRetain(&ctx, 0));
    OK(cuCtxSetCurrent(ctx));
    CU(CUDA_ERROR_INVALID_VALUE, cuMemAlloc(&a, 0));
    OK(cuMemAlloc(&a, 4096));
    pthread_t t;
    pthread_create(&t, NULL, thread_body, ctx);
    pthread_join(t, NULL);

    /* un-suffixed memory symbols are the 32-bit ABI on a real driver */
    typedef CUresult (*alloc_v1)(unsigned *, unsigned);
    alloc_v1 legacy = (alloc_v1)dlsym(RTLD_DEFAULT, "cuMemAlloc");
    void *v2 = dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
    unsigned small = 0;
    CHECK(legacy && v2 && (void *)legacy != v2);
    if (legacy) CU(CUDA_ERROR_NOT_SUPPORTED, legacy(&small, 64));
    CHECK(dlsym(RTLD_DEFAULT, "cuIpcOpenMemHandle") && dlsym(RTLD_DEFAULT, "cuEventDestroy_v2"));

    /* fork after cuInit: the child cannot use CUDA */
    fflush(NULL);
    pid_t kid = fork();
    if (kid == 0) {
        failures = 0;
        CU(CUDA_ERROR_NOT_INITIALIZED, cuCtxSynchronize());
        CHECK(cusi_violation_count() == 1);
        exit(failures ? 1 : 0);
    }
    int st = 0;
    waitpid(kid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);

    /* primary context lifetime */
    OK(cuDevicePrimaryCtxRelease(0)); /* to 0 with `a` still allocated */
    CU(CUDA_ERROR_INVALID_CONTEXT, cuMemFree(a));
    CU(CUDA_ERROR_INVALID_CONTEXT, cuCtxSetCurrent(ctx));
    CU(CUDA_ERROR_INVALID_CONTEXT, cuDevicePrimaryCtxRelease(0));
    CU(CUDA_ERROR_INVALID_CONTEXT, cuCtxSetCurrent((CUcontext)&n));
    OK(cuDevicePrimaryCtxRetain(&ctx, 0));
    OK(cuCtxSetCurrent(ctx));
    OK(cuMemFree(a));
    CU(CUDA_ERROR_INVALID_VALUE, cuMemAlloc(NULL, 64));

    const char *s = NULL;
    OK(cuGetErrorName(CUDA_ERROR_ALREADY_MAPPED, &s));
    CHECK(s && !strcmp(s, "CUDA_ERROR_ALREADY_MAPPED"));
    OK(cuGetErrorString(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, &s));
    CHECK(s && strlen(s) > 0);
    CU(CUDA_ERROR_INVALID_VALUE, cuGetErrorName(12345, &s));
    CHECK(s == NULL);
    OK(cuCtxSetCurrent(NULL));
    OK(cuDevicePrimaryCtxRelease(0));
    finish(13);
}

/* =========================================================================================
 * Scenario "exit": consumers that exit without closing, crash, or outlive the exporter.
 * ========================================================================================= */

static int g_pipes[3][2][2]; /* consumer i: [0] producer -> consumer, [1] back */

static void exit_producer(int in, int out) {
    (void)in, (void)out;
    setup(0);
    CUdeviceptr a = 0;
    CUipcMemHandle h;
    OK(cuMemAlloc(&a, 4096));
    OK(cuMemsetD8(a, 7, 4096));
    OK(cuIpcGetMemHandle(&h, a));
    for (int i = 0; i < 3; i++) {
        put(g_pipes[i][0][1], &h, sizeof h);
        get_tok(g_pipes[i][1][0], 'o');
        if (i < 2) {
            char c;
            CHECK(!get(g_pipes[i][1][0], &c, 1)); /* EOF: consumer i is exiting */
            /* its open stops counting once it is gone; a killed process closes its pipes a
             * moment before it becomes a zombie, so allow it a little time */
            int n = 1;
            for (int t = 0; t < 500 && (n = cusi_live_opens(h)) != 0; t++) usleep(10000);
            CHECK(n == 0);
        } else {
            CHECK(cusi_live_opens(h) == 1);
        }
    }
    finish(0); /* exits with `a` allocated and consumer 2 still holding it: 1 violation */
}

static void exit_consumer(int i) {
    setup(0);
    CUipcMemHandle h;
    CUdeviceptr p = 0;
    unsigned char b = 0;
    CHECK(get(g_pipes[i][0][0], &h, sizeof h));
    OK(cuIpcOpenMemHandle(&p, h, 0));
    put_tok(g_pipes[i][1][1], 'o');
    if (i == 0) finish(0); /* exits with the mapping open: 1 violation at exit */
    if (i == 1) {
        fflush(NULL);
        kill(getpid(), SIGKILL); /* crashes: no exit checks */
    }
    char c;
    CHECK(!get(g_pipes[i][0][0], &c, 1)); /* the exporter exited */
    OK(cuMemcpyDtoH(&b, p + 4095, 1));
    CHECK(b == 7);
    OK(cuIpcCloseMemHandle(p));
    finish(0);
}

static void exit_c0(int in, int out) { (void)in, (void)out; exit_consumer(0); }
static void exit_c1(int in, int out) { (void)in, (void)out; exit_consumer(1); }
static void exit_c2(int in, int out) { (void)in, (void)out; exit_consumer(2); }

static void run_exit_scenario(void) {
    int all[12], k = 0;
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 2; j++) {
            if (pipe(g_pipes[i][j])) { perror("pipe"); exit(2); }
            all[k++] = g_pipes[i][j][0];
            all[k++] = g_pipes[i][j][1];
        }
    /* each child keeps only its own ends (spawn closes the rest) */
    fflush(NULL);
    role_fn roles[4] = {exit_producer, exit_c0, exit_c1, exit_c2};
    for (int r = 0; r < 4; r++) {
        pid_t pid = fork();
        if (pid == 0) {
            failures = 0;
            for (int i = 0; i < 3; i++)
                for (int j = 0; j < 2; j++) {
                    int mine_w = r == 0 ? (j == 0) : (r - 1 == i && j == 1);
                    int mine_r = r == 0 ? (j == 1) : (r - 1 == i && j == 0);
                    if (!mine_r) close(g_pipes[i][j][0]);
                    if (!mine_w) close(g_pipes[i][j][1]);
                }
            roles[r](-1, -1);
            exit(failures ? 1 : 0);
        }
        g_kids[g_nkids++] = pid;
    }
    for (int i = 0; i < k; i++) close(all[i]);
}

/* =========================================================================================
 * Scenario "no-host-access": device addresses are not host memory.
 * ========================================================================================= */

static void protect_role(int in, int out) {
    (void)in, (void)out;
    setenv("CUDA_STANDIN_NO_HOST_ACCESS", "1", 1);
    setup(0);
    CUdeviceptr a = 0;
    unsigned char b = 0;
    OK(cuMemAlloc(&a, 4096));
    OK(cuMemsetD8(a + 10, 42, 1));
    OK(cuMemcpyDtoH(&b, a + 10, 1));
    CHECK(b == 42);
    fflush(NULL);
    pid_t kid = fork();
    if (kid == 0) {
        signal(SIGSEGV, SIG_DFL);
        b = *(volatile unsigned char *)(uintptr_t)a; /* a host read of device memory */
        _exit(0);
    }
    int st = 0;
    waitpid(kid, &st, 0);
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV);
    OK(cuMemFree(a));
    finish(0);
}

/* =========================================================================================
 * Scenarios "vmm-*": virtual memory management (PyTorch's expandable segments).
 * ========================================================================================= */

#define MB ((size_t)1 << 20)

static CUmemAllocationProp vprop(int ordinal, unsigned types) {
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.requestedHandleTypes = (CUmemAllocationHandleType)types;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = ordinal;
    return p;
}

static const CUmemAccessDesc RW0 = {{CU_MEM_LOCATION_TYPE_DEVICE, 0},
                                    CU_MEM_ACCESS_FLAGS_PROT_READWRITE};

static void vmm_counts(int resv, int maps, int handles, int imported, int allocs, int line) {
    if (cusi_vmm_reservations() != resv || cusi_vmm_mappings() != maps ||
        cusi_vmm_handles() != handles || cusi_vmm_imported_handles() != imported ||
        cusi_vmm_allocations() != allocs)
        fail(__FILE__, line, "vmm counts %d %d %d %d %d, expected %d %d %d %d %d",
             cusi_vmm_reservations(), cusi_vmm_mappings(), cusi_vmm_handles(),
             cusi_vmm_imported_handles(), cusi_vmm_allocations(), resv, maps, handles, imported,
             allocs);
}
#define VMM_COUNTS(...) vmm_counts(__VA_ARGS__, __LINE__)

/* Would a host read (write) of p fault? The protection of its mapping in /proc/self/maps says
 * so without touching it (a real fault is what the no-host-access scenario shows; doing it here
 * too would only add valgrind reports). */
static int faults(CUdeviceptr p, int write) {
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512], perms[8] = "";
    unsigned long lo, hi;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) == 3 && p >= lo && p < hi) break;
        else perms[0] = 0;
    if (f) fclose(f);
    if (!perms[0]) return 1; /* not mapped at all */
    return perms[write ? 1 : 0] == '-';
}

static void vmm_local_role(int in, int out) {
    (void)in, (void)out;
    setup(0);
    int v = 0; /* violations expected so far */
    CUmemAllocationProp prop = vprop(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), bad;
    size_t g = 0;
    OK(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CHECK(g == 2 * MB);
    OK(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    CHECK(g == 2 * MB);
    CUV(CUDA_ERROR_INVALID_VALUE,
       cuMemGetAllocationGranularity(&g, &prop, (CUmemAllocationGranularity_flags)5));
    CUV(CUDA_ERROR_INVALID_VALUE,
       cuMemGetAllocationGranularity(&g, NULL, CU_MEM_ALLOC_GRANULARITY_MINIMUM));

    /* cuMemCreate */
    CUmemGenericAllocationHandle h = 0, h2 = 0, hx = 0;
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemCreate(&hx, 3 * MB, &prop, 0));
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemCreate(&hx, 2 * MB, &prop, 1));
    bad = prop;
    bad.type = CU_MEM_ALLOCATION_TYPE_INVALID;
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemCreate(&hx, 2 * MB, &bad, 0));
    bad = prop;
    bad.requestedHandleTypes = CU_MEM_HANDLE_TYPE_WIN32;
    CUV(CUDA_ERROR_NOT_SUPPORTED, cuMemCreate(&hx, 2 * MB, &bad, 0));
    bad = prop;
    bad.location.id = 7;
    CU(CUDA_ERROR_INVALID_DEVICE, cuMemCreate(&hx, 2 * MB, &bad, 0)); /* error only */
    OK(cuMemCreate(&h, 2 * MB, &prop, 0));
    OK(cuMemCreate(&h2, 4 * MB, &prop, 0));
    CHECK(h != h2);
    VMM_COUNTS(0, 0, 2, 0, 2);

    /* cuMemAddressReserve */
    CUdeviceptr va = 0, va2 = 0;
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemAddressReserve(&va, 3 * MB, 0, 0, 0));
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemAddressReserve(&va, 8 * MB, 3 * MB, 0, 0));
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemAddressReserve(&va, 8 * MB, 0, 0, 1));
    OK(cuMemAddressReserve(&va, 8 * MB, 0, 0, 0));
    CHECK(va % (2 * MB) == 0);
    OK(cuMemAddressReserve(&va2, 2 * MB, 0, 0, 0));
    VMM_COUNTS(2, 0, 2, 0, 2);

    /* cuMemMap */
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemMap(va + 6 * MB, 4 * MB, 0, h2, 0));
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemMap(va + 4096, 2 * MB, 0, h, 0));
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemMap(va, 4 * MB, 0, h, 0));
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemMap(va, 2 * MB, 0, h, 1));
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemMap(va, 2 * MB, 0, 12345, 0));
    OK(cuMemMap(va, 2 * MB, 0, h, 0));
    OK(cuMemMap(va + 2 * MB, 2 * MB, 2 * MB, h2, 0)); /* the second half of h2 */
    OK(cuMemMap(va + 4 * MB, 2 * MB, 0, h2, 0));      /* its first half */
    CUV(CUDA_ERROR_ALREADY_MAPPED, cuMemMap(va + 4 * MB, 2 * MB, 0, h, 0));
    VMM_COUNTS(2, 3, 2, 0, 2);

    /* Mapped but no access yet: device copies and host accesses fault. */
    unsigned char buf[64], pat[64];
    for (int i = 0; i < 64; i++) pat[i] = (unsigned char)(i + 1);
    CHECK(cusi_vmm_access(va, 0) == CU_MEM_ACCESS_FLAGS_PROT_NONE);
    CHECK(cusi_vmm_access(va + 6 * MB, 0) == -1);
    CUV(CUDA_ERROR_ILLEGAL_ADDRESS, cuMemcpyHtoD(va, pat, 64));
    CHECK(faults(va, 0));
    /* cuMemSetAccess */
    CUmemAccessDesc badd = RW0;
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemSetAccess(va, 8 * MB, &RW0, 1)); /* not all mapped */
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemSetAccess(va, 6 * MB, &RW0, 0));
    badd.location.id = 9;
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemSetAccess(va, 6 * MB, &badd, 1));
    badd = RW0;
    badd.flags = (CUmemAccess_flags)2;
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemSetAccess(va, 6 * MB, &badd, 1));
    OK(cuMemSetAccess(va, 6 * MB, &RW0, 1)); /* one call over three mappings */
    CHECK(cusi_vmm_access(va + 5 * MB, 0) == CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    CHECK(cusi_vmm_access(va, 1) == CU_MEM_ACCESS_FLAGS_PROT_NONE);
    CHECK(!faults(va, 1));

    /* Copies span adjacent mappings (contiguous addresses); fresh memory is garbage. */
    OK(cuMemcpyDtoH(buf, va + 4 * MB, 1));
    CHECK(buf[0] == 0xA5);
    OK(cuMemcpyHtoD(va + 2 * MB - 32, pat, 64));
    memset(buf, 0, sizeof buf);
    OK(cuMemcpyDtoH(buf, va + 2 * MB - 32, 64));
    CHECK(!memcmp(buf, pat, 64));
    CHECK(((volatile unsigned char *)(uintptr_t)va)[2 * MB] == pat[32]); /* host view too */
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemcpyDtoH(buf, va + 6 * MB - 32, 64)); /* unmapped */
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemcpyHtoD(va, (void *)(uintptr_t)(va + 6 * MB), 16));
    /* Read-only access: reads work, writes fault. */
    CUmemAccessDesc ro = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READ};
    OK(cuMemSetAccess(va + 4 * MB, 2 * MB, &ro, 1));
    OK(cuMemcpyDtoH(buf, va + 4 * MB, 16));
    CUV(CUDA_ERROR_ILLEGAL_ADDRESS, cuMemsetD8(va + 4 * MB, 1, 16));
    CHECK(!faults(va + 4 * MB, 0) && faults(va + 4 * MB, 1));

    /* cuMemGetAddressRange (VMM: the mapping), cuMemRetainAllocationHandle */
    CUdeviceptr base = 0, a = 0;
    size_t size = 0;
    OK(cuMemGetAddressRange(&base, &size, va + 2 * MB + 100));
    CHECK(base == va + 2 * MB && size == 2 * MB);
    CU(CUDA_ERROR_NOT_FOUND, cuMemGetAddressRange(&base, &size, va + 6 * MB)); /* error only */
    CUmemGenericAllocationHandle r = 0;
    OK(cuMemRetainAllocationHandle(&r, (void *)(uintptr_t)(va + 5 * MB)));
    CHECK(r == h2);
    CU(CUDA_ERROR_INVALID_VALUE, cuMemRetainAllocationHandle(&r, (void *)(uintptr_t)(va + 7 * MB)));
    OK(cuMemRelease(r));
    OK(cuMemAlloc(&a, 5000)); /* cuMemAlloc ranges are unchanged */
    OK(cuMemGetAddressRange(&base, &size, a + 4999));
    CHECK(base == a && size == 5000);
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemFree(va));
    CUipcMemHandle ih;
    CUV(CUDA_ERROR_NOT_SUPPORTED, cuIpcGetMemHandle(&ih, va));
    CHECK(attr_int(CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, va) == 0);
    OK(cuMemFree(a));

    /* cuMemRelease while mapped is allowed: the memory lives until unmapped. */
    OK(cuMemRelease(h2));
    VMM_COUNTS(2, 3, 1, 0, 2);
    OK(cuMemcpyDtoH(buf, va + 2 * MB, 32));
    CHECK(!memcmp(buf, pat + 32, 32));
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemRelease(h2));
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemMap(va2, 2 * MB, 0, h2, 0));

    /* Teardown order */
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemAddressFree(va, 8 * MB)); /* mappings remain */
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemAddressFree(va, 4 * MB)); /* not the reserved size */
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemUnmap(va + 2 * MB, 6 * MB)); /* not whole mappings */
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemUnmap(va, 1 * MB));          /* a sub-range */
    OK(cuMemUnmap(va + 2 * MB, 4 * MB)); /* two whole mappings at once: h2 is gone */
    VMM_COUNTS(2, 1, 1, 0, 1);
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemUnmap(va + 2 * MB, 2 * MB)); /* unmapped twice */
    OK(cuMemUnmap(va, 2 * MB));
    OK(cuMemRelease(h));
    OK(cuMemAddressFree(va, 8 * MB));
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemAddressFree(va, 8 * MB));
    OK(cuMemAddressFree(va2, 2 * MB));
    VMM_COUNTS(0, 0, 0, 0, 0);

    /* Export: only requested types; fds are real; importing in the same process works. */
    CUmemGenericAllocationHandle hn = 0, hf = 0, hi = 0, hz = 0;
    CUmemAllocationProp none = vprop(0, CU_MEM_HANDLE_TYPE_NONE);
    CUmemFabricHandle fh, zero;
    int fd = -1;
    OK(cuMemCreate(&hn, 2 * MB, &none, 0));
    CUV(CUDA_ERROR_INVALID_VALUE,
       cuMemExportToShareableHandle(&fd, hn, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    CUV(CUDA_ERROR_INVALID_VALUE,
       cuMemExportToShareableHandle(&fh, hn, CU_MEM_HANDLE_TYPE_FABRIC, 0));
    CUV(CUDA_ERROR_INVALID_VALUE, cuMemExportToShareableHandle(&fd, hn, CU_MEM_HANDLE_TYPE_NONE, 0));
    OK(cuMemCreate(&hf, 2 * MB, &prop, 0));
    CUV(CUDA_ERROR_INVALID_VALUE,
       cuMemExportToShareableHandle(&fd, hf, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 1));
    OK(cuMemExportToShareableHandle(&fd, hf, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    char path[64], link[128] = "";
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    CHECK(fd >= 0 && readlink(path, link, sizeof link - 1) > 0 && !strncmp(link, "/memfd:", 7));
    OK(cuMemImportFromShareableHandle(&hi, (void *)(uintptr_t)fd,
                                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    CHECK(hi != hf && cusi_vmm_imported_handles() == 1);
    close(fd); /* the driver keeps its own reference */
    CUV(CUDA_ERROR_INVALID_VALUE,
       cuMemImportFromShareableHandle(&hz, (void *)(uintptr_t)fd,
                                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    int devnull = open("/dev/null", O_RDWR);
    CUV(CUDA_ERROR_INVALID_VALUE,
       cuMemImportFromShareableHandle(&hz, (void *)(uintptr_t)devnull,
                                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    close(devnull);
    CUV(CUDA_ERROR_INVALID_VALUE,
       cuMemImportFromShareableHandle(&hz, NULL, CU_MEM_HANDLE_TYPE_FABRIC));
    memset(&zero, 0, sizeof zero);
    CU(CUDA_ERROR_INVALID_HANDLE,
       cuMemImportFromShareableHandle(&hz, &zero, CU_MEM_HANDLE_TYPE_FABRIC)); /* error only */
    OK(cuMemAddressReserve(&va, 4 * MB, 0, 0, 0));
    OK(cuMemMap(va, 2 * MB, 0, hf, 0));
    OK(cuMemMap(va + 2 * MB, 2 * MB, 0, hi, 0));
    OK(cuMemSetAccess(va, 4 * MB, &RW0, 1));
    OK(cuMemsetD8(va + 100, 0x42, 1));
    OK(cuMemcpyDtoH(buf, va + 2 * MB + 100, 1));
    CHECK(buf[0] == 0x42); /* one physical allocation behind both handles */
    OK(cuMemUnmap(va, 4 * MB));
    OK(cuMemAddressFree(va, 4 * MB));
    OK(cuMemRelease(hi));
    OK(cuMemRelease(hf));
    OK(cuMemRelease(hn));
    VMM_COUNTS(0, 0, 0, 0, 0);
    OK(cuDevicePrimaryCtxRelease(0));
    finish(v);
}

/* Fabric is not supported everywhere: callers probe and fall back. */
static void vmm_nofabric_role(int in, int out) {
    (void)in, (void)out;
    setenv("CUDA_STANDIN_NO_FABRIC", "1", 1);
    setup(0);
    CUmemGenericAllocationHandle h = 0;
    CUmemAllocationProp p =
        vprop(0, CU_MEM_HANDLE_TYPE_FABRIC | CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CU(CUDA_ERROR_NOT_SUPPORTED, cuMemCreate(&h, 2 * MB, &p, 0)); /* error only */
    p = vprop(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    OK(cuMemCreate(&h, 2 * MB, &p, 0));
    OK(cuMemRelease(h));
    finish(0);
}

/* --- POSIX fds across processes, as PyTorch does: the consumer steals the producer's fds with
 * pidfd_open + pidfd_getfd. The consumer is the producer's parent, so Yama ptrace_scope=1 (which
 * only lets an ancestor do it) allows it. --- */

struct fd_msg {
    int32_t pid;
    int32_t fds[2];
    uint64_t segment;
};

static void vmm_fd_producer(int in, int out) {
    setup(0);
    CUmemAllocationProp p = vprop(0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUmemGenericAllocationHandle h[2];
    CUdeviceptr va = 0;
    struct fd_msg m;
    memset(&m, 0, sizeof m); /* the padding travels through the pipe too */
    m.pid = (int32_t)getpid();
    m.segment = 2 * MB;
    OK(cuMemAddressReserve(&va, 4 * MB, 0, 0, 0));
    for (int i = 0; i < 2; i++) {
        OK(cuMemCreate(&h[i], 2 * MB, &p, 0));
        OK(cuMemMap(va + (size_t)i * 2 * MB, 2 * MB, 0, h[i], 0));
        OK(cuMemExportToShareableHandle(&m.fds[i], h[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                        0));
    }
    OK(cuMemSetAccess(va, 4 * MB, &RW0, 1));
    OK(cuMemsetD8(va, 0x5C, 4 * MB));
    put(out, &m, sizeof m);
    get_tok(in, 'd'); /* the consumer is done */
    unsigned char b = 0;
    OK(cuMemcpyDtoH(&b, va + 2 * MB, 1));
    CHECK(b == 0xC5); /* its write-back */
    OK(cuMemUnmap(va, 4 * MB));
    for (int i = 0; i < 2; i++) {
        OK(cuMemRelease(h[i]));
        close(m.fds[i]); /* PyTorch keeps the fds open until it unmaps */
    }
    OK(cuMemAddressFree(va, 4 * MB));
    finish(0);
}

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

/* The producer's fd `fd` as an fd of this process: pidfd_getfd, or (where the syscall is
 * missing, e.g. under an older valgrind) /proc/<pid>/fd/<fd>, the same open file. */
static int steal_fd(int pid, int fd) {
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    int got = pidfd >= 0 ? (int)syscall(SYS_pidfd_getfd, pidfd, fd, 0) : -1;
    int err = errno;
    if (pidfd >= 0) close(pidfd);
    if (got < 0 && err == ENOSYS) {
        char path[64];
        snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, fd);
        got = open(path, O_RDWR | O_CLOEXEC);
    }
    if (got < 0) fail(__FILE__, __LINE__, "pidfd_getfd(%d, %d): %s", pid, fd, strerror(err));
    return got;
}

static void vmm_fd_consumer(int in, int out) {
    /* fork the producer before cuInit: the driver does not survive fork */
    int a[2], b[2];
    if (pipe(a) || pipe(b)) { perror("pipe"); exit(2); }
    fflush(NULL);
    pid_t kid = fork();
    if (kid == 0) {
        failures = 0;
        close(a[0]), close(b[1]), close(in), close(out);
        vmm_fd_producer(b[0], a[1]);
        exit(failures ? 1 : 0);
    }
    close(a[1]), close(b[0]);
    in = a[0], out = b[1];
    setup(0);
    struct fd_msg m;
    CHECK(get(in, &m, sizeof m) && m.pid == kid && m.segment == 2 * MB);
    CUmemGenericAllocationHandle h[2];
    for (int i = 0; i < 2; i++) {
        int fd = steal_fd(m.pid, m.fds[i]);
        OK(cuMemImportFromShareableHandle(&h[i], (void *)(uintptr_t)fd,
                                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
        close(fd);
    }
    VMM_COUNTS(0, 0, 2, 2, 2);
    CUdeviceptr va = 0;
    OK(cuMemAddressReserve(&va, 4 * MB, 0, 0, 0));
    for (int i = 0; i < 2; i++) OK(cuMemMap(va + (size_t)i * 2 * MB, 2 * MB, 0, h[i], 0));
    unsigned char buf[64];
    CU(CUDA_ERROR_ILLEGAL_ADDRESS, cuMemcpyDtoH(buf, va, 1)); /* access not set yet */
    OK(cuMemSetAccess(va, 4 * MB, &RW0, 1));
    OK(cuMemcpyDtoH(buf, va + 2 * MB - 32, 64));
    CHECK(buf[0] == 0x5C && buf[63] == 0x5C);
    unsigned char mark = 0xC5;
    OK(cuMemcpyHtoD(va + 2 * MB, &mark, 1));
    OK(cuCtxSynchronize());
    OK(cuMemUnmap(va, 4 * MB));
    for (int i = 0; i < 2; i++) OK(cuMemRelease(h[i]));
    OK(cuMemAddressFree(va, 4 * MB));
    VMM_COUNTS(0, 0, 0, 0, 0);
    put_tok(out, 'd');
    int st = 0;
    waitpid(kid, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    finish(1); /* the copy before cuMemSetAccess */
}

/* --- Fabric handles between siblings; the consumer leaks one import at exit. --- */

static void vmm_fabric_producer(int in, int out) {
    setup(0);
    CUmemAllocationProp p =
        vprop(0, CU_MEM_HANDLE_TYPE_FABRIC | CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    CUmemGenericAllocationHandle h[2];
    CUmemFabricHandle fh[2];
    CUdeviceptr va = 0;
    OK(cuMemAddressReserve(&va, 4 * MB, 0, 0, 0));
    for (int i = 0; i < 2; i++) {
        OK(cuMemCreate(&h[i], 2 * MB, &p, 0));
        OK(cuMemMap(va + (size_t)i * 2 * MB, 2 * MB, 0, h[i], 0));
        OK(cuMemExportToShareableHandle(&fh[i], h[i], CU_MEM_HANDLE_TYPE_FABRIC, 0));
    }
    OK(cuMemSetAccess(va, 4 * MB, &RW0, 1));
    OK(cuMemsetD8(va, 0x3E, 4 * MB));
    put(out, fh, sizeof fh);
    get_tok(in, 'o');
    unsigned char b = 0;
    OK(cuMemcpyDtoH(&b, va + 4 * MB - 1, 1));
    CHECK(b == 0xE3);
    OK(cuMemUnmap(va, 4 * MB));
    for (int i = 0; i < 2; i++) OK(cuMemRelease(h[i]));
    OK(cuMemAddressFree(va, 4 * MB));
    VMM_COUNTS(0, 0, 0, 0, 0);
    put_tok(out, 'r'); /* released: the fabric handles no longer resolve */
    finish(0);
}

static void vmm_fabric_consumer(int in, int out) {
    setup(1); /* another device: VMM access is granted per device */
    CUmemFabricHandle fh[2];
    CHECK(get(in, fh, sizeof fh));
    CUmemGenericAllocationHandle h[2], x = 0;
    for (int i = 0; i < 2; i++)
        OK(cuMemImportFromShareableHandle(&h[i], &fh[i], CU_MEM_HANDLE_TYPE_FABRIC));
    CUdeviceptr va = 0;
    OK(cuMemAddressReserve(&va, 8 * MB, 0, 0, 0));
    for (int i = 0; i < 2; i++) OK(cuMemMap(va + (size_t)i * 2 * MB, 2 * MB, 0, h[i], 0));
    OK(cuMemSetAccess(va, 4 * MB, &RW0, 1)); /* device 0 only: not the current device */
    unsigned char b = 0;
    CU(CUDA_ERROR_ILLEGAL_ADDRESS, cuMemcpyDtoH(&b, va, 1));
    CUmemAccessDesc rw1 = {{CU_MEM_LOCATION_TYPE_DEVICE, 1}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    OK(cuMemSetAccess(va, 4 * MB, &rw1, 1));
    OK(cuMemcpyDtoH(&b, va + 3 * MB, 1));
    CHECK(b == 0x3E);
    CHECK(attr_int(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, va) == 0); /* where the memory lives */
    b = 0xE3;
    OK(cuMemcpyHtoD(va + 4 * MB - 1, &b, 1));
    /* an imported fabric allocation is re-exportable as fabric only */
    int fd = -1;
    CU(CUDA_ERROR_INVALID_VALUE,
       cuMemExportToShareableHandle(&fd, h[0], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    OK(cuMemUnmap(va, 2 * MB));
    OK(cuMemRelease(h[0])); /* page 1 stays imported and mapped: reported at exit */
    put_tok(out, 'o');
    get_tok(in, 'r');
    CU(CUDA_ERROR_INVALID_HANDLE,
       cuMemImportFromShareableHandle(&x, &fh[0], CU_MEM_HANDLE_TYPE_FABRIC)); /* error only */
    OK(cuMemcpyDtoH(&b, va + 2 * MB, 1)); /* our mapping keeps page 1 alive */
    CHECK(b == 0x3E);
    finish(2); /* + 2 at exit */
}

static void single(role_fn role) {
    int none[1] = {-1};
    spawn(role, -1, -1, none, 0);
}

/* =========================================================================================
 * Scenario "delays": the test hook cusi_set_delay makes opens, closes and synchronizes sleep
 * before they act, without holding the stand-in's lock.
 * ========================================================================================= */

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void delay_producer(int in, int out) {
    setup(0);
    CUdeviceptr a = 0;
    CUipcMemHandle h;
    OK(cuMemAlloc(&a, 2u << 20));
    OK(cuIpcGetMemHandle(&h, a));
    put(out, &h, sizeof h);
    get_tok(in, 'd'); /* consumer done */
    OK(cuMemFree(a));
    OK(cuDevicePrimaryCtxRelease(0));
    finish(0);
}

static CUcontext g_delay_ctx;
static CUdeviceptr g_delay_ptr;

static void *delayed_close(void *arg) {
    (void)arg;
    OK(cuCtxSetCurrent(g_delay_ctx));
    OK(cuIpcCloseMemHandle(g_delay_ptr));
    return NULL;
}

static void delay_consumer(int in, int out) {
    g_delay_ctx = setup(0);
    CUipcMemHandle h;
    CHECK(get(in, &h, sizeof h));
    CHECK(cusi_set_delay("cuMemAlloc", 5) == -1 && cusi_set_delay(NULL, 5) == -1);
    CHECK(cusi_set_delay("cuIpcOpenMemHandle", 200) == 0);
    double t0 = now_ms();
    OK(cuIpcOpenMemHandle(&g_delay_ptr, h, 0));
    CHECK(now_ms() - t0 >= 200);
    CHECK(cusi_set_delay("cuIpcOpenMemHandle", 0) == 0);
    CHECK(cusi_live_opens(h) == 1);
    CHECK(cusi_set_delay("cuIpcCloseMemHandle", 400) == 0);
    t0 = now_ms();
    pthread_t th;
    pthread_create(&th, NULL, delayed_close, NULL);
    usleep(100 * 1000);
    CHECK(cusi_live_opens(h) == 1); /* the close has not acted while it sleeps */
    CUdeviceptr q = 0;
    double t1 = now_ms();
    OK(cuMemAlloc(&q, 4096)); /* other calls go on meanwhile */
    OK(cuMemFree(q));
    CHECK(now_ms() - t1 < 200);
    pthread_join(th, NULL);
    CHECK(now_ms() - t0 >= 400);
    CHECK(cusi_live_opens(h) == 0);
    CHECK(cusi_set_delay("cuIpcCloseMemHandle", 0) == 0);
    CHECK(cusi_set_delay("cuCtxSynchronize", 150) == 0);
    t0 = now_ms();
    OK(cuCtxSynchronize());
    CHECK(now_ms() - t0 >= 150);
    CHECK(cusi_set_delay("cuCtxSynchronize", 0) == 0);
    t0 = now_ms();
    OK(cuCtxSynchronize());
    CHECK(now_ms() - t0 < 100);
    put_tok(out, 'd');
    OK(cuDevicePrimaryCtxRelease(0));
    finish(0);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);

    begin("clean");
    pair(clean_producer, clean_consumer);
    reap(NULL);
    expect_log("clean: export/open/close, data both ways, events", 0, NULL);

    begin("ipc-misuse");
    pair(misuse_producer, misuse_consumer);
    reap(NULL);
    expect_log("ipc-misuse: every memory-IPC rule", 16,
               "needs the allocation base (cuMemGetAddressRange)", 1,
               "stream-ordered pool memory is not legacy-IPC capable", 1,
               "handle fetched more than once (cache it)", 1,
               "a handle cannot be opened in the process that exported it", 1,
               "cuMemFree_v2: 0x", 3,
               "cuMemFree while 1 IPC opens are live", 1,
               "cuIpcOpenMemHandle_v2: Flags 0x2", 1,
               "same handle opened twice in one process (older drivers refuse; cache opens)", 1,
               "out of bounds", 2,
               "is device memory", 1,
               "not a base returned by cuIpcOpenMemHandle that is still open (interior", 1,
               "(closed twice?)", 1,
               "release it with cuIpcCloseMemHandle", 1,
               "is an IPC-opened mapping", 1, NULL);

    begin("peer");
    pair(peer_producer, peer_consumer);
    single(devices_role);
    single(nodevice_role);
    reap(NULL);
    expect_log("peer: CUDA_STANDIN_VISIBLE=1,0, UUIDs, LAZY_ENABLE_PEER_ACCESS", 0, NULL);

    begin("host-register");
    single(host_register_role);
    reap(NULL);
    expect_log("host-register: overlaps, empty and device ranges, unregister of a non-start or twice", 5,
               "overlaps a registered range", 1, "bytesize is 0", 1, "is device memory", 1,
               "is not the start of a registered range", 2, NULL);

    begin("memops");
    single(memops_role);
    reap(NULL);
    expect_log("memops: stream memory operations' alignment, DEVICEMAP and flags", 8,
               "registered without CU_MEMHOSTREGISTER_DEVICEMAP", 2, "Flags must be 0", 1,
               "is not 8-byte aligned", 1, "out of bounds", 1, "unknown flags", 2,
               "is not 4-byte aligned", 1, NULL);

    begin("events");
    pair(events_producer, events_consumer);
    reap(NULL);
    expect_log("events: interprocess event rules", 10,
               "CU_EVENT_INTERPROCESS requires CU_EVENT_DISABLE_TIMING", 1,
               "event was not created with CU_EVENT_INTERPROCESS", 1,
               "an event handle cannot be opened in the process that created it", 1,
               "belong to different contexts", 1,
               "unknown or destroyed stream", 2,
               "cuStreamWaitEvent: Flags must be 0", 1,
               "IPC event opened but never waited on", 1,
               "unknown or destroyed event", 1,
               "1 IPC-opened events never destroyed", 1, NULL);

    begin("context");
    single(context_role);
    reap(NULL);
    expect_log("context: init, contexts, threads, legacy symbols, fork", 14,
               "cuDeviceGetCount: called before cuInit", 1,
               "cuInit: flags must be 0", 1,
               "no current context on this thread (cuCtxSetCurrent)", 3,
               "bytesize is 0", 1,
               "cuMemAlloc: legacy 32-bit entry point called; resolve cuMemAlloc_v2", 1,
               "fork()ed after cuInit", 1,
               "released to 0 while 1 allocations", 1,
               "context released to refcount 0 (destroyed)", 1,
               "is released (refcount 0)", 1,
               "released more often than retained", 1,
               "is not a context of this process", 1,
               "cuMemAlloc_v2: dptr is NULL", 1, NULL);

    begin("exit");
    run_exit_scenario();
    int sigs[4] = {0, 0, SIGKILL, 0};
    reap(sigs);
    expect_log("exit: unclosed mapping, crashed consumer, exporter exits first", 2,
               "exit: 1 IPC mappings never closed", 1,
               "while 1 IPC opens of it are live", 1, NULL);

    begin("no-host-access");
    single(protect_role);
    reap(NULL);
    expect_log("no-host-access: a host read of a CUdeviceptr faults", 0, NULL);

    begin("vmm-local");
    single(vmm_local_role);
    single(vmm_nofabric_role);
    reap(NULL);
    expect_log("vmm-local: VMM rules in one process", 40,
               "cuMemGetAllocationGranularity: unknown option 5", 1,
               "is not a non-zero multiple of the granularity", 2,
               "cuMemCreate: flags must be 0", 1,
               "must be CU_MEM_ALLOCATION_TYPE_PINNED", 1,
               "Windows handle types requested", 1,
               "cuMemAddressReserve: alignment 3145728 is not a power of two", 1,
               "cuMemAddressReserve: flags must be 0", 1,
               "is not inside one reservation (cuMemAddressReserve)", 1,
               "must be multiples of the granularity", 1,
               "exceed the allocation's 2097152 bytes", 1,
               "is not a live allocation handle", 3,
               "(double map; cuMemUnmap first)", 1,
               "no read-write access: cuMemSetAccess after cuMemMap", 2,
               "is not made of whole mappings", 3,
               "no access descriptors", 1,
               "is not a visible device", 1,
               "flags 2 unknown", 1,
               "is out of bounds (0x", 1,
               "is in a VMM reservation", 1,
               "is VMM-mapped memory", 1,
               "not legacy-IPC capable (use cuMemExportToShareableHandle)", 1,
               "mappings remain in the reservation", 1,
               "the reservation at", 2,
               "nothing is mapped at", 1,
               "is not a reservation returned by cuMemAddressReserve", 1,
               "without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR", 1,
               "without CU_MEM_HANDLE_TYPE_FABRIC", 1,
               "handleType 0: export one of", 1,
               "cuMemExportToShareableHandle: flags must be 0", 1,
               "is not an open file descriptor", 1,
               "is not memory exported by cuMemExportToShareableHandle", 1,
               "osHandle is NULL", 1, NULL);

    begin("vmm-fd");
    single(vmm_fd_consumer);
    reap(NULL);
    expect_log("vmm-fd: POSIX fds stolen with pidfd_getfd, imported, mapped, written back", 1,
               "no read access: cuMemSetAccess after cuMemMap", 1, NULL);

    begin("vmm-fabric");
    pair(vmm_fabric_producer, vmm_fabric_consumer);
    reap(NULL);
    expect_log("vmm-fabric: fabric handles, per-device access, leaks at exit", 4,
               "device 1 has no read access", 1,
               "the allocation was imported without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR", 1,
               "exit: 1 imported VMM allocation handles never released (cuMemRelease)", 1,
               "exit: 1 VMM mappings of imported memory never unmapped (cuMemUnmap)", 1, NULL);

    begin("delays");
    pair(delay_producer, delay_consumer);
    reap(NULL);
    expect_log("delays: cusi_set_delay sleeps opens, closes and synchronizes outside the lock", 0,
               NULL);

    printf("%s\n", failures ? "FAILED" : "all passed");
    return failures ? 1 : 0;
}
