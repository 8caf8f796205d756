/*
 * selftest.c - exercises every rule of the ACL stand-in (tests/standin/acl/acl_standin.c).
 *
 * Build and run (from the repository root):
 *   gcc -std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -Werror -shared -fPIC -pthread \
 *       -o libascendcl.so tests/standin/acl/acl_standin.c -lrt
 *   gcc -std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -Werror -pthread \
 *       -o acl_selftest tests/standin/acl/selftest.c -L. -lascendcl -Wl,-rpath,'$ORIGIN' -lrt
 *   ./acl_selftest            # exit 0 on success
 *
 * Two-process rules use fork(): a forked child is a fresh ACL process (aclInit, aclrtSetDevice)
 * and exits with 0 when all of its checks passed. Each scenario writes its own
 * DEVSHARE_STANDIN_LOG and checks the lines in it.
 */
#include "acl_standin.h"

#include <dirent.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MIB ((size_t)1 << 20)

static int failures;
static int expect_v; /* violations this process should have recorded so far */

#define CHECK(cond, ...)                                                      \
    do {                                                                      \
        if (!(cond)) {                                                        \
            fprintf(stderr, "FAIL pid=%d %s:%d: ", (int)getpid(), __FILE__,   \
                    __LINE__);                                                \
            fprintf(stderr, __VA_ARGS__);                                     \
            fprintf(stderr, " [%s] (recent: %s)\n", #cond, aclGetRecentErrMsg()); \
            failures++;                                                       \
        }                                                                     \
    } while (0)
#define CHECK_RC(call, want) \
    do { int rc_ = (call); CHECK(rc_ == (want), "%s returned %d, want %d", #call, rc_, (want)); } while (0)
/* Expect n new violations in this process. */
#define EXPECT_V(n) \
    do { expect_v += (n); CHECK(aclsi_violation_count() == expect_v, "violations %d, want %d", aclsi_violation_count(), expect_v); } while (0)
#define MSG_HAS(s) CHECK(strstr(aclGetRecentErrMsg(), (s)) != NULL, "message lacks \"%s\"", (s))

/* ---- scenario logs ---- */

static char log_path[256];

static void new_log(const char *tag) {
    snprintf(log_path, sizeof log_path, "/tmp/aclsi_selftest_%d_%s.log", (int)getpid(), tag);
    unlink(log_path);
    setenv("DEVSHARE_STANDIN_LOG", log_path, 1);
}

/* Lines of the current log containing needle (NULL: all lines). */
static int log_count(const char *needle) {
    FILE *f = fopen(log_path, "r");
    if (!f) return 0;
    char line[1024];
    int n = 0;
    while (fgets(line, sizeof line, f))
        if (!needle || strstr(line, needle)) n++;
    fclose(f);
    return n;
}

static void end_log(int want_lines) {
    CHECK(log_count(NULL) == want_lines, "log %s has %d lines, want %d", log_path,
          log_count(NULL), want_lines);
    unlink(log_path);
}

/* ---- children ---- */

typedef struct chan {
    int to[2], from[2];
} chan_t;

static chan_t ch;

static void send_int(int fd, int v) { CHECK(write(fd, &v, sizeof v) == sizeof v, "pipe write"); }
static int recv_int(int fd) {
    int v = -1;
    CHECK(read(fd, &v, sizeof v) == sizeof v, "pipe read");
    return v;
}

/* Child side: fresh ACL process on device dev. */
static void child_setup(int dev) {
    failures = 0;
    expect_v = 0;
    CHECK(aclsi_violation_count() == 0, "forked child starts with no violations");
    CHECK_RC(aclrtMalloc(&(void *){0}, 4096, ACL_MEM_MALLOC_HUGE_FIRST), ACL_ERROR_UNINITIALIZE);
    expect_v = 1; /* the call above: before aclInit (a fork child is a fresh process) */
    CHECK_RC(aclInit(NULL), 0);
    CHECK_RC(aclrtSetDevice(dev), 0);
}

/* Run fn in a forked child with a fresh channel; returns the child's pid. */
static pid_t spawn(void (*fn)(void *), void *arg) {
    CHECK(pipe(ch.to) == 0 && pipe(ch.from) == 0, "pipe");
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        close(ch.to[1]);
        close(ch.from[0]);
        fn(arg);
        exit(failures ? 1 : 0); /* exit(): the stand-in's exit checks run */
    }
    close(ch.to[0]);
    close(ch.from[1]);
    return pid;
}

static void join(pid_t pid, const char *what) {
    int st = 0;
    CHECK(waitpid(pid, &st, 0) == pid, "waitpid");
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child '%s' failed (status %#x)", what, st);
    close(ch.to[1]);
    close(ch.from[0]);
}

/* Shared state the children inherit through fork. */
static char g_key[ACL_IPC_MEM_KEY_LEN]; /* with the 0xA5 garbage after the NUL */
static const unsigned char PAT = 0x5c;
static size_t g_size;

typedef struct import_args {
    int dev;
    uint64_t flags;
    int want_rc;
    int peer; /* call aclrtDeviceEnablePeerAccess(0, 0) first */
} import_args_t;

/* Import g_key and check the result; on success verify the data, then close. */
static void child_import(void *vp) {
    import_args_t *a = vp;
    child_setup(a->dev);
    if (a->peer) CHECK_RC(aclrtDeviceEnablePeerAccess(0, 0), 0);
    void *p = NULL;
    CHECK_RC(aclrtIpcMemImportByKey(&p, g_key, a->flags), a->want_rc);
    if (a->want_rc == 0) {
        unsigned char buf[64];
        if (a->dev == 0) {
            CHECK_RC(aclrtMemcpy(buf, sizeof buf, p, sizeof buf, ACL_MEMCPY_DEVICE_TO_HOST), 0);
            CHECK(buf[0] == PAT && buf[63] == PAT, "importer reads the exporter's data");
        }
        CHECK_RC(aclrtIpcMemClose(g_key), 0);
    }
    EXPECT_V(0);
}

/* Whitelist handshake: send a pid (bare tgid or getpid()), wait, import, report, close. */
static void child_whitelisted(void *vp) {
    int use_getpid = *(int *)vp;
    child_setup(0);
    int32_t tgid = 0;
    CHECK_RC(aclrtDeviceGetBareTgid(&tgid), 0);
    CHECK(tgid == (int32_t)getpid() + 3000000, "bare tgid = getpid() + offset");
    send_int(ch.from[1], use_getpid ? (int)getpid() : tgid);
    recv_int(ch.to[0]);
    void *p = NULL;
    int rc = aclrtIpcMemImportByKey(&p, g_key, 0);
    if (use_getpid) {
        CHECK(rc == ACL_ERROR_RT_NO_PERMISSION, "getpid() whitelisted: refused, rc %d", rc);
        MSG_HAS("not in the key's whitelist");
        MSG_HAS("getpid()");
        send_int(ch.from[1], rc);
    } else {
        CHECK(rc == 0, "bare tgid whitelisted: import rc %d", rc);
        unsigned char buf[16] = {0};
        CHECK_RC(aclrtMemcpy(buf, sizeof buf, (char *)p + g_size - 16, 16,
                             ACL_MEMCPY_DEVICE_TO_HOST), 0);
        CHECK(buf[15] == PAT, "importer reads the exporter's data at the end of the range");
        send_int(ch.from[1], rc);
        recv_int(ch.to[0]);
        CHECK_RC(aclrtIpcMemClose(g_key), 0);
        send_int(ch.from[1], 0);
    }
    EXPECT_V(0);
}

/* Not the exporter: SetImportPid and a close without import are violations. */
static void child_misuse(void *vp) {
    (void)vp;
    child_setup(0);
    int32_t pid = 1234;
    CHECK_RC(aclrtIpcMemSetImportPid(g_key, &pid, 1), ACL_ERROR_INVALID_PARAM);
    EXPECT_V(1);
    CHECK_RC(aclrtIpcMemClose(g_key), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("neither imported nor exported");
    EXPECT_V(1);
}

/* Cross-device importer with peer access: D2H/H2D refused, D2D allowed. */
static void child_xdev_copies(void *vp) {
    (void)vp;
    child_setup(1);
    CHECK_RC(aclrtDeviceEnablePeerAccess(0, 0), 0);
    void *p = NULL;
    CHECK_RC(aclrtIpcMemImportByKey(&p, g_key, 0), 0);
    unsigned char buf[64];
    CHECK_RC(aclrtMemcpy(buf, sizeof buf, p, sizeof buf, ACL_MEMCPY_DEVICE_TO_HOST),
             ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    MSG_HAS("no H2D/D2H copies to memory imported from another device");
    EXPECT_V(1);
    CHECK_RC(aclrtMemcpy(p, 64, buf, sizeof buf, ACL_MEMCPY_HOST_TO_DEVICE),
             ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    EXPECT_V(1);
    void *mine = NULL;
    CHECK_RC(aclrtMalloc(&mine, 2 * MIB, ACL_MEM_MALLOC_HUGE_FIRST), 0);
    CHECK_RC(aclrtMemcpy(mine, 2 * MIB, p, 4096, ACL_MEMCPY_DEVICE_TO_DEVICE), 0);
    memset(buf, 0, sizeof buf);
    CHECK_RC(aclrtMemcpy(buf, sizeof buf, mine, sizeof buf, ACL_MEMCPY_DEVICE_TO_HOST), 0);
    CHECK(buf[0] == PAT && buf[63] == PAT, "D2D from the import carried the data");
    CHECK_RC(aclrtIpcMemClose(g_key), 0);
    CHECK_RC(aclrtFree(mine), 0);
    EXPECT_V(0);
}

/* The same key imported twice: two mappings, closes must equal imports. */
static void child_double_import(void *vp) {
    (void)vp;
    child_setup(0);
    void *p1 = NULL, *p2 = NULL;
    CHECK_RC(aclrtIpcMemImportByKey(&p1, g_key, 1), 0);
    CHECK_RC(aclrtIpcMemImportByKey(&p2, g_key, 1), 0);
    CHECK(p1 && p2 && p1 != p2, "two imports, two mappings");
    CHECK(aclsi_open_imports(g_key) == 2, "open imports 2, got %d", aclsi_open_imports(g_key));
    unsigned char v = 0x77, r = 0;
    CHECK_RC(aclrtMemcpy((char *)p1 + 100, 1, &v, 1, ACL_MEMCPY_HOST_TO_DEVICE), 0);
    CHECK_RC(aclrtMemcpy(&r, 1, (char *)p2 + 100, 1, ACL_MEMCPY_DEVICE_TO_HOST), 0);
    CHECK(r == 0x77, "both mappings see the same memory");
    CHECK_RC(aclrtIpcMemClose(g_key), 0);
    CHECK(aclsi_open_imports(g_key) == 1, "open imports 1");
    /* The first mapping is still live after closing the most recent import. */
    CHECK_RC(aclrtMemcpy(&r, 1, (char *)p1 + 100, 1, ACL_MEMCPY_DEVICE_TO_HOST), 0);
    CHECK_RC(aclrtIpcMemClose(g_key), 0);
    CHECK(aclsi_open_imports(g_key) == 0, "open imports 0");
    CHECK_RC(aclrtIpcMemClose(g_key), ACL_ERROR_INVALID_PARAM); /* a third close */
    EXPECT_V(1);
    /* The closed mapping is no longer device memory of this process. */
    CHECK_RC(aclrtMemcpy(&r, 1, (char *)p1 + 100, 1, ACL_MEMCPY_DEVICE_TO_HOST),
             ACL_ERROR_INVALID_PARAM);
    EXPECT_V(1);
}

/* Import, signal, wait while the exporter closes early, then close. */
static void child_hold_import(void *vp) {
    (void)vp;
    child_setup(0);
    void *p = NULL;
    CHECK_RC(aclrtIpcMemImportByKey(&p, g_key, 1), 0);
    send_int(ch.from[1], 0);
    recv_int(ch.to[0]);
    CHECK(aclsi_key_closed(g_key) == 1, "importer sees the exporter's close");
    CHECK_RC(aclrtIpcMemClose(g_key), 0);
    EXPECT_V(0);
}

static void child_import_closed(void *vp) {
    (void)vp;
    child_setup(0);
    void *p = NULL;
    CHECK_RC(aclrtIpcMemImportByKey(&p, g_key, 1), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("already closed");
    EXPECT_V(1);
}

/* Events: the producer's handle travels through fork memory. */
static aclrtIpcEventHandle g_evh;

static void child_event_wait(void *vp) {
    (void)vp;
    child_setup(0);
    aclrtStream s = NULL;
    aclrtEvent e = NULL;
    CHECK_RC(aclrtCreateStream(&s), 0);
    CHECK_RC(aclrtIpcOpenEventHandle(g_evh, &e), 0);
    CHECK(aclsi_event_records(e) == 1, "consumer sees the producer's record");
    CHECK_RC(aclrtStreamWaitEvent(s, e), 0);
    CHECK(aclsi_event_waits(e) == 1, "waits 1, got %d", aclsi_event_waits(e));
    CHECK_RC(aclrtSynchronizeEvent(e), 0);
    CHECK(aclsi_event_waits(e) == 2, "waits 2");
    CHECK_RC(aclrtRecordEvent(e, s), ACL_ERROR_INVALID_PARAM); /* consumer only waits */
    EXPECT_V(1);
    CHECK_RC(aclrtDestroyEvent(e), 0);
    CHECK_RC(aclrtSynchronizeStream(s), 0);
    CHECK_RC(aclrtDestroyStream(s), 0);
    EXPECT_V(0);
}

static void child_event_nowait(void *vp) {
    (void)vp;
    child_setup(0);
    aclrtEvent e = NULL;
    CHECK_RC(aclrtIpcOpenEventHandle(g_evh, &e), 0);
    CHECK_RC(aclrtDestroyEvent(e), 0);
    MSG_HAS("opened but never waited on");
    EXPECT_V(1);
    aclrtIpcEventHandle bad = g_evh;
    memset(bad.reserved + 8, 0, sizeof bad.reserved - 8); /* only 8 bytes survived */
    CHECK_RC(aclrtIpcOpenEventHandle(bad, &e), ACL_ERROR_INVALID_PARAM);
    EXPECT_V(1);
}

static void child_event_gone(void *vp) {
    (void)vp;
    child_setup(0);
    aclrtEvent e = NULL;
    CHECK_RC(aclrtIpcOpenEventHandle(g_evh, &e), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("gone");
    EXPECT_V(0);
}

/* Exit with an open import and an opened event: both recorded at exit. */
static void child_exit_open(void *vp) {
    (void)vp;
    child_setup(0);
    void *p = NULL;
    aclrtEvent e = NULL;
    CHECK_RC(aclrtIpcMemImportByKey(&p, g_key, 1), 0);
    CHECK_RC(aclrtIpcOpenEventHandle(g_evh, &e), 0);
    CHECK_RC(aclrtStreamWaitEvent(NULL, e), 0);
    EXPECT_V(0);
}

/* ---- scenarios ---- */

static void *thread_no_device(void *arg) {
    (void)arg;
    void *p = NULL;
    int rc = aclrtMalloc(&p, 4096, ACL_MEM_MALLOC_HUGE_FIRST);
    CHECK(rc == ACL_ERROR_RT_CONTEXT_NULL, "new thread without aclrtSetDevice: rc %d", rc);
    MSG_HAS("no device bound on this thread");
    CHECK_RC(aclrtSetDevice(1), 0);
    CHECK_RC(aclrtMalloc(&p, 4096, ACL_MEM_MALLOC_HUGE_FIRST), 0);
    CHECK_RC(aclrtFree(p), 0);
    return NULL;
}

static void garbage_after_nul(const char *key) {
    size_t n = strlen(key);
    CHECK(n > 0 && n < 64, "key length %zu", n);
    int ok = 1;
    for (size_t i = n + 1; i < ACL_IPC_MEM_KEY_LEN; i++) ok &= (unsigned char)key[i] == 0xA5;
    CHECK(ok, "bytes after the NUL are 0xA5 garbage");
}

static void scenario_basic(void) {
    new_log("basic");
    uint32_t count = 0;
    int32_t ma = 0, mi = 0, pa = 0;
    CHECK_RC(aclrtGetVersion(&ma, &mi, &pa), 0); /* allowed before aclInit */
    CHECK(ma == 8 && mi == 3 && pa == 0, "version 8.3.0");
    CHECK_RC(aclrtGetDeviceCount(&count), ACL_ERROR_UNINITIALIZE);
    MSG_HAS("called before aclInit");
    EXPECT_V(1);
    CHECK_RC(aclInit(NULL), 0);
    CHECK_RC(aclInit(NULL), ACL_ERROR_REPEAT_INITIALIZE);
    EXPECT_V(0);
    CHECK_RC(aclrtGetDeviceCount(&count), 0);
    CHECK(count == 2, "2 devices by default");
    void *p = NULL;
    CHECK_RC(aclrtMalloc(&p, 4096, ACL_MEM_MALLOC_HUGE_FIRST), ACL_ERROR_RT_CONTEXT_NULL);
    EXPECT_V(1);
    CHECK_RC(aclrtSetDevice(5), ACL_ERROR_INVALID_PARAM); /* error only */
    CHECK_RC(aclrtSetDevice(0), 0);
    EXPECT_V(0);
    pthread_t th;
    pthread_create(&th, NULL, thread_no_device, NULL);
    pthread_join(th, NULL);
    EXPECT_V(1);
    int32_t dev = -1;
    CHECK_RC(aclrtGetDevice(&dev), 0);
    CHECK(dev == 0, "the other thread's aclrtSetDevice did not change this thread");

    /* Alignment: small pooled blocks are never exportable. */
    char key[ACL_IPC_MEM_KEY_LEN], key2[ACL_IPC_MEM_KEY_LEN];
    void *small = NULL;
    CHECK_RC(aclrtMalloc(&small, 1000, ACL_MEM_MALLOC_HUGE_FIRST), 0);
    CHECK((uintptr_t)small % 4096 == 512, "small block 512 B past a page");
    CHECK_RC(aclrtIpcMemGetExportKey(small, 1000, key, sizeof key, 1), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("not page aligned");
    EXPECT_V(1);
    CHECK_RC(aclrtIpcMemGetExportKey((char *)small - 512, 4096, key, sizeof key, 1),
             ACL_ERROR_INVALID_PARAM); /* not inside the allocation */
    EXPECT_V(1);

    /* A >= 2 MiB HUGE allocation exports; misaligned ranges do not. */
    void *big = NULL;
    CHECK_RC(aclrtMalloc(&big, 4 * MIB, ACL_MEM_MALLOC_HUGE_FIRST), 0);
    CHECK((uintptr_t)big % (2 * MIB) == 0, "huge allocation 2 MiB aligned");
    CHECK_RC(aclrtIpcMemGetExportKey(big, 3 * MIB, key, sizeof key, 1), ACL_ERROR_INVALID_PARAM);
    CHECK_RC(aclrtIpcMemGetExportKey((char *)big + 4096, 2 * MIB, key, sizeof key, 1),
             ACL_ERROR_INVALID_PARAM);
    EXPECT_V(2);
    CHECK_RC(aclrtIpcMemGetExportKey(big, 6 * MIB, key, sizeof key, 1), ACL_ERROR_INVALID_PARAM);
    CHECK_RC(aclrtIpcMemGetExportKey(big, 4 * MIB, key, 64, 1), ACL_ERROR_INVALID_PARAM);
    CHECK_RC(aclrtIpcMemGetExportKey(big, 4 * MIB, key, sizeof key, 2), ACL_ERROR_INVALID_PARAM);
    EXPECT_V(3);
    CHECK_RC(aclrtSetDevice(1), 0); /* the allocation is on device 0 */
    CHECK_RC(aclrtIpcMemGetExportKey(big, 4 * MIB, key, sizeof key, 1), ACL_ERROR_INVALID_PARAM);
    EXPECT_V(1);
    CHECK_RC(aclrtSetDevice(0), 0);
    CHECK_RC(aclrtIpcMemGetExportKey(big, 4 * MIB, key, sizeof key, 1), 0);
    EXPECT_V(0);
    garbage_after_nul(key);
    CHECK(aclsi_open_imports(key) == 0 && aclsi_key_closed(key) == 0, "fresh key: open");
    CHECK_RC(aclrtIpcMemGetExportKey(big, 4 * MIB, key2, sizeof key2, 1), 0);
    MSG_HAS("same range exported twice");
    EXPECT_V(1);
    CHECK(strcmp(key, key2) != 0, "a fresh key all the same");
    CHECK_RC(aclrtIpcMemClose(key2), 0);
    CHECK_RC(aclrtIpcMemClose(key), 0);
    EXPECT_V(0);
    CHECK(aclsi_key_closed(key) == 1 && aclsi_open_imports(key) == -1, "closed key");
    CHECK_RC(aclrtIpcMemClose(key), ACL_ERROR_INVALID_PARAM); /* closed twice */
    MSG_HAS("already closed");
    EXPECT_V(1);

    /* HUGE rounds to 2 MiB pages: 3 MiB exports as 4 MiB. NORMAL >= 2 MiB: 4 KiB pages. */
    void *odd = NULL, *normal = NULL;
    CHECK_RC(aclrtMalloc(&odd, 3 * MIB, ACL_MEM_MALLOC_HUGE_ONLY), 0);
    CHECK_RC(aclrtIpcMemGetExportKey(odd, 4 * MIB, key, sizeof key, 0), 0);
    /* Free with the key open: violation, memory still freed, the close still works. */
    CHECK_RC(aclrtFree(odd), 0);
    MSG_HAS("freed while exported/imported");
    EXPECT_V(1);
    CHECK_RC(aclrtIpcMemClose(key), 0);
    CHECK_RC(aclrtMalloc(&normal, 3 * MIB, ACL_MEM_MALLOC_NORMAL_ONLY), 0);
    CHECK((uintptr_t)normal % 4096 == 0, "normal allocation 4 KiB aligned");
    CHECK_RC(aclrtIpcMemGetExportKey((char *)normal + 4096, 8192, key, sizeof key, 0), 0);
    CHECK_RC(aclrtIpcMemGetExportKey((char *)normal + 4096, 6000, key2, sizeof key2, 0),
             ACL_ERROR_INVALID_PARAM);
    EXPECT_V(1);
    int32_t who = 42;
    CHECK_RC(aclrtIpcMemSetImportPid(key, &who, 0), ACL_ERROR_INVALID_PARAM);
    CHECK_RC(aclrtIpcMemSetImportPid(key, &who, 65), ACL_ERROR_INVALID_PARAM);
    EXPECT_V(2);
    CHECK_RC(aclrtIpcMemSetImportPid(key, &who, 1), 0);
    CHECK_RC(aclrtIpcMemClose(key), 0);
    CHECK_RC(aclrtFree(normal), 0);
    EXPECT_V(0);

    /* Memcpy: bounds, destMax, kinds. */
    unsigned char host[64];
    memset(host, 0x11, sizeof host);
    CHECK_RC(aclrtMemcpy(big, 4 * MIB, host, sizeof host, ACL_MEMCPY_HOST_TO_DEVICE), 0);
    memset(host, 0, sizeof host);
    CHECK_RC(aclrtMemcpy(host, sizeof host, big, sizeof host, ACL_MEMCPY_DEVICE_TO_HOST), 0);
    CHECK(host[0] == 0x11 && host[63] == 0x11, "H2D then D2H round trip");
    CHECK_RC(aclrtMemcpy((char *)big + 4 * MIB - 8, 16, host, 16, ACL_MEMCPY_HOST_TO_DEVICE),
             ACL_ERROR_INVALID_PARAM);
    MSG_HAS("out of bounds");
    CHECK_RC(aclrtMemcpy(host, 8, big, 16, ACL_MEMCPY_DEVICE_TO_HOST), ACL_ERROR_INVALID_PARAM);
    CHECK_RC(aclrtMemcpy(host, sizeof host, big, 16, ACL_MEMCPY_HOST_TO_DEVICE),
             ACL_ERROR_INVALID_PARAM);
    CHECK_RC(aclrtMemcpy(big, 16, small, 16, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("does not match");
    CHECK_RC(aclrtMemcpy(host, 16, host + 16, 16, ACL_MEMCPY_HOST_TO_HOST), 0);
    CHECK_RC(aclrtMemcpy(big, 16, small, 16, ACL_MEMCPY_DEVICE_TO_DEVICE), 0);
    EXPECT_V(4);

    /* Free: unknown pointer, interior pointer. */
    CHECK_RC(aclrtFree(host), ACL_ERROR_INVALID_PARAM);
    CHECK_RC(aclrtFree((char *)big + 4096), ACL_ERROR_INVALID_PARAM);
    EXPECT_V(2);
    CHECK_RC(aclrtFree(big), 0);
    CHECK_RC(aclrtFree(small), 0);
    CHECK_RC(aclrtFree(big), ACL_ERROR_INVALID_PARAM); /* double free */
    EXPECT_V(1);

    /* Streams, peer access, bare tgid. */
    aclrtStream s = NULL;
    CHECK_RC(aclrtCreateStream(&s), 0);
    CHECK_RC(aclrtSynchronizeStream(s), 0);
    CHECK_RC(aclrtSynchronizeStream(NULL), 0);
    CHECK_RC(aclrtSynchronizeDevice(), 0);
    CHECK_RC(aclrtSetDevice(1), 0);
    CHECK_RC(aclrtSynchronizeStream(s), ACL_ERROR_INVALID_PARAM); /* stream of device 0 */
    EXPECT_V(1);
    CHECK_RC(aclrtDeviceEnablePeerAccess(0, 1), ACL_ERROR_INVALID_PARAM);
    EXPECT_V(1);
    CHECK_RC(aclrtDeviceEnablePeerAccess(1, 0), ACL_ERROR_INVALID_PARAM); /* self: error only */
    EXPECT_V(0);
    CHECK_RC(aclrtSetDevice(0), 0);
    CHECK_RC(aclrtDestroyStream(s), 0);
    CHECK_RC(aclrtDestroyStream(s), ACL_ERROR_INVALID_PARAM);
    EXPECT_V(1);
    int32_t tgid = 0;
    CHECK_RC(aclrtDeviceGetBareTgid(&tgid), 0);
    CHECK(tgid == (int32_t)getpid() + 3000000, "bare tgid");
    CHECK(aclGetRecentErrMsg() != NULL, "recent message never NULL");

    /* Keys: no NUL within 65 bytes; unknown key (error only). */
    char nonul[ACL_IPC_MEM_KEY_LEN];
    memset(nonul, 'a', sizeof nonul);
    CHECK_RC(aclrtIpcMemImportByKey(&p, nonul, 0), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("no NUL");
    EXPECT_V(1);
    CHECK_RC(aclrtIpcMemImportByKey(&p, "aclsi_k_1_999999", 0), ACL_ERROR_INVALID_PARAM);
    CHECK_RC(aclrtIpcMemImportByKey(&p, "torch_123_456", 0), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("unknown key");
    CHECK_RC(aclrtIpcMemImportByKey(&p, "aclsi_k_1_999999", 2), ACL_ERROR_INVALID_PARAM);
    EXPECT_V(1);
    end_log(expect_v);
}

/* Export g_size bytes on device 0 filled with PAT; returns the allocation. */
static void *export_pattern(uint64_t flags) {
    void *p = NULL;
    g_size = 2 * MIB;
    CHECK_RC(aclrtMalloc(&p, g_size, ACL_MEM_MALLOC_HUGE_FIRST), 0);
    unsigned char *host = malloc(g_size);
    memset(host, PAT, g_size);
    CHECK_RC(aclrtMemcpy(p, g_size, host, g_size, ACL_MEMCPY_HOST_TO_DEVICE), 0);
    free(host);
    CHECK_RC(aclrtIpcMemGetExportKey(p, g_size, g_key, sizeof g_key, flags), 0);
    return p;
}

static void unexport(void *p) {
    CHECK_RC(aclrtIpcMemClose(g_key), 0);
    CHECK_RC(aclrtFree(p), 0);
}

static void scenario_whitelist(void) {
    new_log("wl");
    int base = expect_v;
    void *p = export_pattern(ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT);
    import_args_t refused = {0, 0, ACL_ERROR_RT_NO_PERMISSION, 0};
    pid_t c = spawn(child_import, &refused);
    join(c, "import without whitelist");

    int use_getpid = 1; /* whitelist getpid() instead of the bare tgid: refused */
    c = spawn(child_whitelisted, &use_getpid);
    int32_t pid = recv_int(ch.from[0]);
    CHECK_RC(aclrtIpcMemSetImportPid(g_key, &pid, 1), 0);
    send_int(ch.to[1], 0);
    CHECK(recv_int(ch.from[0]) == ACL_ERROR_RT_NO_PERMISSION, "getpid() refused");
    join(c, "getpid whitelisted");

    use_getpid = 0; /* the bare tgid: allowed */
    c = spawn(child_whitelisted, &use_getpid);
    pid = recv_int(ch.from[0]);
    CHECK(pid == c + 3000000, "child sent its bare tgid");
    CHECK_RC(aclrtIpcMemSetImportPid(g_key, &pid, 1), 0);
    send_int(ch.to[1], 0);
    CHECK(recv_int(ch.from[0]) == 0, "tgid whitelisted: imported");
    CHECK(aclsi_open_imports(g_key) == 1, "one open import, got %d", aclsi_open_imports(g_key));
    send_int(ch.to[1], 0);
    recv_int(ch.from[0]);
    CHECK(aclsi_open_imports(g_key) == 0, "import closed");
    join(c, "tgid whitelisted");

    c = spawn(child_misuse, NULL);
    join(c, "misuse");
    char who[32];
    snprintf(who, sizeof who, "acl pid=%d:", (int)c);
    CHECK(log_count(who) == 3, "the misusing child logged 3 lines"); /* incl. pre-init call */
    unexport(p);

    /* DISABLE_PID_VALIDATION: anyone may import. */
    p = export_pattern(ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION);
    import_args_t anyone = {0, 0, 0, 0};
    c = spawn(child_import, &anyone);
    join(c, "import without validation");
    unexport(p);
    EXPECT_V(0);
    /* 5 children x 1 pre-init line + 2 misuse lines. */
    end_log(expect_v - base + 5 + 2);
}

static void scenario_cross_device(void) {
    new_log("xdev");
    void *p = export_pattern(1);
    import_args_t no_peer = {1, 0, ACL_ERROR_RT_DRV_INTERNAL_ERROR, 0};
    pid_t c = spawn(child_import, &no_peer);
    join(c, "cross-device without peer access");
    import_args_t flag1 = {1, 1, 0, 0};
    c = spawn(child_import, &flag1);
    join(c, "cross-device with flag 1");
    import_args_t peer = {1, 0, 0, 1};
    c = spawn(child_import, &peer);
    join(c, "cross-device after EnablePeerAccess");
    c = spawn(child_xdev_copies, NULL);
    join(c, "cross-device copies");
    CHECK(log_count("no H2D/D2H copies") == 2, "D2H and H2D on a cross-device import logged");
    /* Self-import in the exporting process (allowed). */
    void *q = NULL;
    CHECK_RC(aclrtIpcMemImportByKey(&q, g_key, 0), 0);
    CHECK(q != p && aclsi_open_imports(g_key) == 1, "self-import: a second mapping");
    CHECK_RC(aclrtIpcMemClose(g_key), 0); /* closes the import, not the key */
    CHECK(aclsi_open_imports(g_key) == 0 && aclsi_key_closed(g_key) == 0, "key still open");
    unexport(p);
    EXPECT_V(0);
    end_log(4 + 2);
}

static void scenario_closes(void) {
    new_log("closes");
    int base = expect_v;
    void *p = export_pattern(1);
    pid_t c = spawn(child_double_import, NULL);
    join(c, "double import");
    CHECK(aclsi_open_imports(g_key) == 0, "all imports closed");

    /* Exporter closes while an import is open: a violation. */
    c = spawn(child_hold_import, NULL);
    recv_int(ch.from[0]);
    CHECK(aclsi_open_imports(g_key) == 1, "child holds an import");
    CHECK_RC(aclrtIpcMemClose(g_key), 0);
    MSG_HAS("while 1 imports are open");
    EXPECT_V(1);
    CHECK(aclsi_key_closed(g_key) == 1, "key closed");
    send_int(ch.to[1], 0);
    join(c, "hold import");
    CHECK(log_count("exporter closed key") == 1, "early close logged once");

    c = spawn(child_import_closed, NULL);
    join(c, "import after close");
    CHECK_RC(aclrtFree(p), 0);
    EXPECT_V(0);
    end_log(expect_v - base + 3 + 2 + 1);
}

static void scenario_events(void) {
    new_log("ev");
    int base = expect_v;
    aclrtStream s = NULL;
    aclrtEvent ev = NULL, plain = NULL;
    CHECK_RC(aclrtCreateStream(&s), 0);
    CHECK_RC(aclrtCreateEventExWithFlag(&ev, ACL_EVENT_IPC), 0);
    CHECK_RC(aclrtCreateEvent(&plain), 0);
    CHECK_RC(aclrtRecordEvent(ev, s), 0);
    CHECK(aclsi_event_records(ev) == 1 && aclsi_event_waits(ev) == 0, "recorded once");
    aclrtIpcEventHandle h;
    CHECK_RC(aclrtIpcGetEventHandle(plain, &h), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("not created with ACL_EVENT_IPC");
    EXPECT_V(1);
    CHECK_RC(aclrtIpcGetEventHandle(ev, &g_evh), 0);
    pid_t c = spawn(child_event_wait, NULL);
    join(c, "event wait");
    CHECK(aclsi_event_waits(ev) == 2, "producer sees the consumer's waits, got %d",
          aclsi_event_waits(ev));
    c = spawn(child_event_nowait, NULL);
    join(c, "event without wait");
    CHECK(log_count("opened but never waited on") == 1, "logged");
    CHECK(aclsi_event_waits(plain) == -1, "plain event has no shared counters");
    CHECK_RC(aclrtSynchronizeEvent(plain), 0);
    CHECK_RC(aclrtDestroyEvent(plain), 0);
    CHECK_RC(aclrtDestroyEvent(plain), ACL_ERROR_INVALID_PARAM);
    EXPECT_V(1);
    CHECK_RC(aclrtDestroyEvent(ev), 0);
    c = spawn(child_event_gone, NULL);
    join(c, "event gone");
    CHECK_RC(aclrtDestroyStream(s), 0);
    EXPECT_V(0);
    end_log(expect_v - base + 3 + 1 + 2);
}

static void scenario_exit_open(void) {
    new_log("exit");
    void *p = export_pattern(1);
    aclrtEvent ev = NULL;
    CHECK_RC(aclrtCreateEventExWithFlag(&ev, ACL_EVENT_IPC), 0);
    CHECK_RC(aclrtIpcGetEventHandle(ev, &g_evh), 0);
    pid_t c = spawn(child_exit_open, NULL);
    join(c, "exit with open import");
    CHECK(log_count("1 imports never closed (closes must equal imports") == 1, "logged at exit");
    CHECK(log_count("IPC events opened but never destroyed") == 1, "logged at exit");
    CHECK(aclsi_open_imports(g_key) == 0, "the dead importer's import was released");
    CHECK(aclsi_event_waits(ev) == 1, "the child waited once");
    CHECK_RC(aclrtDestroyEvent(ev), 0);
    unexport(p);
    EXPECT_V(0);
    end_log(3);
}

/* ---- device memory (aclrtGetMemInfo) and the delay hooks ---- */

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void *thread_meminfo_no_device(void *arg) {
    (void)arg;
    size_t f = 0, t = 0;
    CHECK_RC(aclrtGetMemInfo(ACL_HBM_MEM, &f, &t), ACL_ERROR_RT_CONTEXT_NULL);
    return NULL;
}

static void *thread_close(void *key) {
    CHECK_RC(aclrtSetDevice(0), 0);
    CHECK_RC(aclrtIpcMemClose(key), 0);
    return NULL;
}

static void child_meminfo_delays(void *vp) {
    (void)vp;
    child_setup(0);
    size_t f = 0, t = 0;
    const size_t GIB = (size_t)1 << 30;
    CHECK_RC(aclrtGetMemInfo(ACL_HBM_MEM, NULL, &t), ACL_ERROR_INVALID_PARAM);
    CHECK_RC(aclrtGetMemInfo(ACL_HBM_MEM, &f, NULL), ACL_ERROR_INVALID_PARAM);
    CHECK_RC(aclrtGetMemInfo((aclrtMemAttr)99, &f, &t), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("unknown attr 99");
    EXPECT_V(3);
    pthread_t th;
    pthread_create(&th, NULL, thread_meminfo_no_device, NULL);
    pthread_join(th, NULL);
    EXPECT_V(1);
    CHECK_RC(aclrtGetMemInfo(ACL_HBM_MEM, &f, &t), 0);
    CHECK(t == 64 * GIB && f == t, "64 GiB by default, all free: %zu of %zu", f, t);
    CHECK_RC(aclrtGetMemInfo(ACL_DDR_MEM, &f, &t), 0);
    CHECK(t == 0 && f == 0, "no DDR on the modelled device");
    void *big = NULL;
    CHECK_RC(aclrtMalloc(&big, 4 * MIB, ACL_MEM_MALLOC_HUGE_FIRST), 0);
    CHECK_RC(aclrtGetMemInfo(ACL_HBM_MEM_HUGE, &f, &t), 0);
    CHECK(t == 64 * GIB && f == t - 4 * MIB, "free %zu", f);
    CHECK_RC(aclrtSetDevice(1), 0);
    CHECK_RC(aclrtGetMemInfo(ACL_HBM_MEM, &f, &t), 0);
    CHECK(f == t, "device 1 is all free");
    CHECK_RC(aclrtSetDevice(0), 0);
    setenv("ACL_STANDIN_DEVICE_MEMORY", "8388608", 1); /* 8 MiB */
    CHECK_RC(aclrtGetMemInfo(ACL_HBM_MEM, &f, &t), 0);
    CHECK(t == 8 * MIB && f == 4 * MIB, "8 MiB device, 4 MiB free: %zu of %zu", f, t);
    void *more = NULL;
    CHECK_RC(aclrtMalloc(&more, 6 * MIB, ACL_MEM_MALLOC_HUGE_FIRST), ACL_ERROR_RT_MEMORY_ALLOCATION);
    MSG_HAS("do not fit in device 0's free memory");
    aclrtPhysicalMemProp prop;
    memset(&prop, 0, sizeof prop);
    prop.memAttr = ACL_HBM_MEM_HUGE;
    prop.location.type = ACL_MEM_LOCATION_TYPE_DEVICE;
    aclrtDrvMemHandle ph = NULL;
    CHECK_RC(aclrtMallocPhysical(&ph, 6 * MIB, &prop, 0), ACL_ERROR_RT_MEMORY_ALLOCATION);
    CHECK_RC(aclrtMallocPhysical(&ph, 4 * MIB, &prop, 0), 0);
    CHECK_RC(aclrtGetMemInfo(ACL_HBM_MEM, &f, &t), 0);
    CHECK(f == 0, "full: %zu free", f);
    CHECK_RC(aclrtFreePhysical(ph), 0);
    EXPECT_V(0); /* a full device is an error only */
    unsetenv("ACL_STANDIN_DEVICE_MEMORY");

    /* Delays: unknown names refused; a delayed call sleeps before it acts, outside the lock. */
    CHECK(aclsi_set_delay("aclrtMalloc", 10) == -1, "only the listed calls can be delayed");
    CHECK(aclsi_set_delay(NULL, 10) == -1, "NULL name");
    char key[ACL_IPC_MEM_KEY_LEN];
    CHECK_RC(aclrtIpcMemGetExportKey(big, 4 * MIB, key, sizeof key, 1), 0);
    CHECK(aclsi_set_delay("aclrtIpcMemImportByKey", 200) == 0, "import delay");
    void *p = NULL;
    double t0 = now_ms();
    CHECK_RC(aclrtIpcMemImportByKey(&p, key, 0), 0); /* self-import without pid validation */
    CHECK(now_ms() - t0 >= 200, "the import slept %.0f ms", now_ms() - t0);
    CHECK(aclsi_set_delay("aclrtIpcMemImportByKey", 0) == 0, "import delay off");
    CHECK(aclsi_open_imports(key) == 1, "imported");
    CHECK(aclsi_set_delay("aclrtIpcMemClose", 400) == 0, "close delay");
    t0 = now_ms();
    pthread_create(&th, NULL, thread_close, key);
    usleep(100 * 1000);
    CHECK(aclsi_open_imports(key) == 1, "the close has not acted while it sleeps");
    void *q = NULL;
    double t1 = now_ms();
    CHECK_RC(aclrtMalloc(&q, 4096, ACL_MEM_MALLOC_HUGE_FIRST), 0);
    CHECK_RC(aclrtFree(q), 0);
    CHECK(now_ms() - t1 < 200, "other calls go on while a close sleeps (%.0f ms)", now_ms() - t1);
    pthread_join(th, NULL);
    CHECK(now_ms() - t0 >= 400, "the close slept %.0f ms", now_ms() - t0);
    CHECK(aclsi_open_imports(key) == 0, "then it closed the import");
    CHECK(aclsi_set_delay("aclrtIpcMemClose", 0) == 0, "close delay off");
    CHECK(aclsi_set_delay("aclrtSynchronizeDevice", 150) == 0, "sync delay");
    t0 = now_ms();
    CHECK_RC(aclrtSynchronizeDevice(), 0);
    CHECK(now_ms() - t0 >= 150, "the sync slept %.0f ms", now_ms() - t0);
    CHECK(aclsi_set_delay("aclrtSynchronizeDevice", 0) == 0, "sync delay off");
    t0 = now_ms();
    CHECK_RC(aclrtSynchronizeDevice(), 0);
    CHECK(now_ms() - t0 < 100, "no delay once turned off");
    CHECK_RC(aclrtIpcMemClose(key), 0);
    CHECK_RC(aclrtFree(big), 0);
    EXPECT_V(0);
}

static void scenario_meminfo_delays(void) {
    new_log("meminfo");
    pid_t c = spawn(child_meminfo_delays, NULL);
    join(c, "device memory and delays");
    end_log(1 + 3 + 1); /* before aclInit, 3 bad arguments, a thread without a device */
}

/* ---- VMM (expandable segments) ---- */

static aclrtPhysicalMemProp vmm_prop(int dev) {
    aclrtPhysicalMemProp p;
    memset(&p, 0, sizeof p);
    p.handleType = ACL_MEM_HANDLE_TYPE_NONE;
    p.allocationType = ACL_MEM_ALLOCATION_TYPE_PINNED;
    p.memAttr = ACL_HBM_MEM_HUGE;
    p.location.id = (uint32_t)dev;
    p.location.type = ACL_MEM_LOCATION_TYPE_DEVICE;
    return p;
}

/* Exported by the runner, inherited by the children through fork memory. */
static uint64_t g_sh[2];
static const unsigned char VPAT = 0x6b;

static void vmm_counts(int resv, int maps, int local, int imported) {
    CHECK(aclsi_vmm_reservations() == resv && aclsi_vmm_mappings() == maps &&
              aclsi_vmm_physical_handles() == local && aclsi_vmm_imported_handles() == imported,
          "vmm counts %d %d %d %d, want %d %d %d %d", aclsi_vmm_reservations(),
          aclsi_vmm_mappings(), aclsi_vmm_physical_handles(), aclsi_vmm_imported_handles(), resv,
          maps, local, imported);
}

/* Every local VMM rule, in one process. */
static void scenario_vmm_local(void) {
    new_log("vmm_local");
    int base = expect_v;
    aclrtPhysicalMemProp prop = vmm_prop(0), bad;
    size_t gran = 0;
    CHECK_RC(aclrtMemGetAllocationGranularity(&prop, ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM, &gran),
             0);
    CHECK(gran == 2 * MIB, "granularity 2 MiB, got %zu", gran);
    CHECK_RC(aclrtMemGetAllocationGranularity(&prop, ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                                              &gran), 0);
    CHECK(gran == 2 * MIB, "recommended granularity 2 MiB");
    bad = prop;
    bad.memAttr = ACL_HBM_MEM_HUGE1G;
    CHECK_RC(aclrtMemGetAllocationGranularity(&bad, ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM, &gran),
             0);
    CHECK(gran == 1024 * MIB, "HUGE1G granularity 1 GiB");
    CHECK_RC(aclrtMemGetAllocationGranularity(&prop, (aclrtMemGranularityOptions)7, &gran),
             ACL_ERROR_INVALID_PARAM);
    CHECK_RC(aclrtMemGetAllocationGranularity(&prop, ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM, NULL),
             ACL_ERROR_INVALID_PARAM);
    EXPECT_V(2);

    /* Physical handles. */
    aclrtDrvMemHandle h1 = NULL, h2 = NULL, hd1 = NULL, hx = NULL;
    CHECK_RC(aclrtMallocPhysical(&hx, 3 * MIB, &prop, 0), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("multiple of the allocation granularity");
    CHECK_RC(aclrtMallocPhysical(&hx, 2 * MIB, &prop, 1), ACL_ERROR_INVALID_PARAM);
    bad = prop;
    bad.allocationType = (aclrtMemAllocationType)1;
    CHECK_RC(aclrtMallocPhysical(&hx, 2 * MIB, &bad, 0), ACL_ERROR_INVALID_PARAM);
    bad = prop;
    bad.handleType = ACL_MEM_HANDLE_TYPE_POSIX;
    CHECK_RC(aclrtMallocPhysical(&hx, 2 * MIB, &bad, 0), ACL_ERROR_INVALID_PARAM);
    EXPECT_V(4);
    bad = prop; /* error only: not modelled / no such device */
    bad.location.type = ACL_MEM_LOCATION_TYPE_HOST;
    CHECK_RC(aclrtMallocPhysical(&hx, 2 * MIB, &bad, 0), ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    bad = prop;
    bad.location.id = 7;
    CHECK_RC(aclrtMallocPhysical(&hx, 2 * MIB, &bad, 0), ACL_ERROR_INVALID_PARAM);
    EXPECT_V(0);
    CHECK_RC(aclrtMallocPhysical(&h1, 2 * MIB, &prop, 0), 0);
    CHECK_RC(aclrtMallocPhysical(&h2, 4 * MIB, &prop, 0), 0);
    aclrtPhysicalMemProp prop1 = vmm_prop(1);
    CHECK_RC(aclrtMallocPhysical(&hd1, 2 * MIB, &prop1, 0), 0); /* memory of device 1 */
    vmm_counts(0, 0, 3, 0);

    /* Reservations. */
    void *va = NULL, *va2 = NULL;
    CHECK_RC(aclrtReserveMemAddress(&va, 3 * MIB, 0, NULL, 0), ACL_ERROR_INVALID_PARAM);
    CHECK_RC(aclrtReserveMemAddress(&va, 8 * MIB, 4096, NULL, 0), ACL_ERROR_INVALID_PARAM);
    CHECK_RC(aclrtReserveMemAddress(&va, 8 * MIB, 0, NULL, 2), ACL_ERROR_INVALID_PARAM);
    EXPECT_V(3);
    CHECK_RC(aclrtReserveMemAddress(&va, 8 * MIB, 0, (void *)(uintptr_t)0x100000000000ull, 0),
             ACL_ERROR_RT_FEATURE_NOT_SUPPORT); /* error only */
    EXPECT_V(0);
    CHECK_RC(aclrtReserveMemAddress(&va, 8 * MIB, 0, NULL, 0), 0);
    CHECK((uintptr_t)va % (2 * MIB) == 0, "reservation 2 MiB aligned");
    CHECK_RC(aclrtReserveMemAddress(&va2, 2 * MIB, 0, NULL, 1), 0);
    vmm_counts(2, 0, 3, 0);
    char *b = va;

    /* Mapping rules. */
    CHECK_RC(aclrtMapMem(b + 6 * MIB, 4 * MIB, 0, h2, 0), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("not inside one reservation");
    CHECK_RC(aclrtMapMem(b + 4096, 2 * MIB, 0, h1, 0), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("not a multiple of the granularity");
    CHECK_RC(aclrtMapMem(b, 4 * MIB, 0, h1, 0), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("must equal the physical handle's size");
    CHECK_RC(aclrtMapMem(b, 2 * MIB, 2 * MIB, h1, 0), ACL_ERROR_INVALID_PARAM);
    CHECK_RC(aclrtMapMem(b, 2 * MIB, 0, h1, 1), ACL_ERROR_INVALID_PARAM);
    CHECK_RC(aclrtMapMem(b, 2 * MIB, 0, (aclrtDrvMemHandle)&prop, 0), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("unknown physical handle");
    EXPECT_V(6);
    CHECK_RC(aclrtMapMem(b, 2 * MIB, 0, h1, 0), 0);
    CHECK_RC(aclrtMapMem(b + 2 * MIB, 4 * MIB, 0, h2, 0), 0);
    CHECK_RC(aclrtMapMem(b + 4 * MIB, 2 * MIB, 0, h1, 0), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("overlaps the mapping");
    CHECK_RC(aclrtMapMem(b + 6 * MIB, 2 * MIB, 0, hd1, 0), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("cannot also map memory of device 1");
    EXPECT_V(2);
    CHECK_RC(aclrtMapMem(b + 6 * MIB, 2 * MIB, 0, h1, 0), 0); /* a handle mapped twice */
    vmm_counts(2, 3, 3, 0);

    /* Copies may span adjacent mappings: the addresses are contiguous. */
    unsigned char hbuf[64], rbuf[64];
    memset(hbuf, 0x3c, sizeof hbuf);
    CHECK_RC(aclrtMemcpy(b + 2 * MIB - 32, 64, hbuf, 64, ACL_MEMCPY_HOST_TO_DEVICE), 0);
    CHECK((unsigned char)b[2 * MIB - 1] == 0x3c && (unsigned char)b[2 * MIB] == 0x3c,
          "both sides of the page boundary written");
    CHECK((unsigned char)b[8 * MIB - 1] == 0x3c, "the second mapping of h1 sees the bytes");
    memset(rbuf, 0, sizeof rbuf);
    CHECK_RC(aclrtMemcpy(rbuf, 32, b + 8 * MIB - 32, 32, ACL_MEMCPY_DEVICE_TO_HOST), 0);
    CHECK(rbuf[0] == 0x3c && rbuf[31] == 0x3c, "D2H through the second mapping");
    CHECK_RC(aclrtMemcpy(rbuf, 32, b + 8 * MIB - 16, 32, ACL_MEMCPY_DEVICE_TO_HOST),
             ACL_ERROR_INVALID_PARAM);
    MSG_HAS("out of bounds");
    EXPECT_V(1);

    /* Teardown order: unmap, free physical, release. */
    CHECK_RC(aclrtFreePhysical(h1), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("still mapped (2 mappings)");
    CHECK_RC(aclrtReleaseMemAddress(va), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("3 mappings are still in the reservation");
    CHECK_RC(aclrtReleaseMemAddress(b + 2 * MIB), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("not the start of a reservation");
    CHECK_RC(aclrtUnmapMem(b + 4096), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("not the start of a mapping");
    CHECK_RC(aclrtFree(b), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("VMM address");
    char k[ACL_IPC_MEM_KEY_LEN];
    CHECK_RC(aclrtIpcMemGetExportKey(b, 2 * MIB, k, sizeof k, 1), ACL_ERROR_INVALID_PARAM);
    EXPECT_V(6);
    CHECK_RC(aclrtUnmapMem(b + 6 * MIB), 0);
    CHECK_RC(aclrtUnmapMem(b), 0);
    CHECK_RC(aclrtUnmapMem(b), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("unmapped twice");
    CHECK_RC(aclrtMemcpy(rbuf, 16, b, 16, ACL_MEMCPY_DEVICE_TO_HOST), ACL_ERROR_INVALID_PARAM);
    EXPECT_V(2);
    CHECK_RC(aclrtFreePhysical(h1), 0);
    CHECK_RC(aclrtFreePhysical(h1), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("freed twice");
    EXPECT_V(1);

    /* Export rules. */
    uint64_t sh = 0, sh2 = 0;
    CHECK_RC(aclrtMemExportToShareableHandle(h2, ACL_MEM_HANDLE_TYPE_POSIX, 1, &sh),
             ACL_ERROR_INVALID_PARAM);
    CHECK_RC(aclrtMemExportToShareableHandle(h2, ACL_MEM_HANDLE_TYPE_NONE, 2, &sh),
             ACL_ERROR_INVALID_PARAM);
    CHECK_RC(aclrtMemExportToShareableHandle(h2, ACL_MEM_HANDLE_TYPE_NONE, 1, NULL),
             ACL_ERROR_INVALID_PARAM);
    EXPECT_V(3);
    CHECK_RC(aclrtMemExportToShareableHandle(h2, ACL_MEM_HANDLE_TYPE_NONE, 1, &sh), 0);
    CHECK(aclsi_vmm_freed(sh) == 0 && aclsi_vmm_open_imports(sh) == 0, "fresh shareable");
    CHECK_RC(aclrtMemExportToShareableHandle(h2, ACL_MEM_HANDLE_TYPE_NONE, 1, &sh2),
             ACL_ERROR_INVALID_PARAM);
    MSG_HAS("already exported");
    EXPECT_V(1);
    aclrtDrvMemHandle hi = NULL;
    CHECK_RC(aclrtMemImportFromShareableHandle(sh, 0, &hi), ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    MSG_HAS("import in the exporting process is not supported");
    EXPECT_V(1);
    CHECK_RC(aclrtMemImportFromShareableHandle(0x1234, 0, &hi), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("unknown shareable handle");
    CHECK_RC(aclrtMemImportFromShareableHandle(sh, 9, &hi), ACL_ERROR_INVALID_PARAM);
    EXPECT_V(0);
    int32_t pid = 5;
    CHECK_RC(aclrtMemSetPidToShareableHandle(sh, &pid, 1), 0);
    CHECK_RC(aclrtMemSetPidToShareableHandle(sh, &pid, 0), ACL_ERROR_INVALID_PARAM);
    CHECK_RC(aclrtMemSetPidToShareableHandle(sh + 1, &pid, 1), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("only the exporter sets pids");
    EXPECT_V(2);
    CHECK_RC(aclrtUnmapMem(b + 2 * MIB), 0);
    CHECK_RC(aclrtFreePhysical(h2), 0);
    CHECK(aclsi_vmm_freed(sh) == 1 && aclsi_vmm_open_imports(sh) == -1, "freed shareable");
    CHECK_RC(aclrtFreePhysical(hd1), 0);
    CHECK_RC(aclrtReleaseMemAddress(va), 0);
    CHECK_RC(aclrtReleaseMemAddress(va), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("released twice");
    EXPECT_V(1);
    CHECK_RC(aclrtReleaseMemAddress(va2), 0);
    vmm_counts(0, 0, 0, 0);
    end_log(expect_v - base);
}

/* Runner: two 2 MiB physical handles on device 0 mapped back to back, filled with VPAT,
 * exported into g_sh. */
typedef struct vmm_exp {
    aclrtDrvMemHandle h[2];
    char *va;
} vmm_exp_t;

static vmm_exp_t vmm_export(uint64_t flags) {
    vmm_exp_t e;
    aclrtPhysicalMemProp prop = vmm_prop(0);
    void *va = NULL;
    CHECK_RC(aclrtReserveMemAddress(&va, 4 * MIB, 0, NULL, 0), 0);
    e.va = va;
    for (int i = 0; i < 2; i++) {
        CHECK_RC(aclrtMallocPhysical(&e.h[i], 2 * MIB, &prop, 0), 0);
        CHECK_RC(aclrtMapMem(e.va + (size_t)i * 2 * MIB, 2 * MIB, 0, e.h[i], 0), 0);
        CHECK_RC(aclrtMemExportToShareableHandle(e.h[i], ACL_MEM_HANDLE_TYPE_NONE, flags,
                                                 &g_sh[i]), 0);
    }
    unsigned char *host = malloc(4 * MIB);
    memset(host, VPAT, 4 * MIB);
    CHECK_RC(aclrtMemcpy(e.va, 4 * MIB, host, 4 * MIB, ACL_MEMCPY_HOST_TO_DEVICE), 0);
    free(host);
    return e;
}

static void vmm_unexport(vmm_exp_t *e) {
    for (int i = 0; i < 2; i++) {
        CHECK_RC(aclrtUnmapMem(e->va + (size_t)i * 2 * MIB), 0);
        CHECK_RC(aclrtFreePhysical(e->h[i]), 0);
    }
    CHECK_RC(aclrtReleaseMemAddress(e->va), 0);
}

typedef struct vmm_args {
    int dev;
    int want_rc; /* of the first import */
    int peer;    /* aclrtDeviceEnablePeerAccess(0, 0) first */
} vmm_args_t;

/* Consumer as torch_npu does it: import every page, reserve, map back to back, read (across the
 * page boundary), write back, then unmap + free each page and release. */
static void child_vmm_import(void *vp) {
    vmm_args_t *a = vp;
    child_setup(a->dev);
    if (a->peer) CHECK_RC(aclrtDeviceEnablePeerAccess(0, 0), 0);
    aclrtDrvMemHandle h[2] = {NULL, NULL};
    CHECK_RC(aclrtMemImportFromShareableHandle(g_sh[0], a->dev, &h[0]), a->want_rc);
    if (a->want_rc != 0) {
        vmm_counts(0, 0, 0, 0);
        EXPECT_V(0);
        return;
    }
    CHECK_RC(aclrtMemImportFromShareableHandle(g_sh[1], a->dev, &h[1]), 0);
    CHECK(aclsi_vmm_open_imports(g_sh[0]) == 1, "one import of page 0, got %d",
          aclsi_vmm_open_imports(g_sh[0]));
    aclrtDrvMemHandle again = NULL; /* 1:1 per process */
    CHECK_RC(aclrtMemImportFromShareableHandle(g_sh[0], a->dev, &again), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("already imported in this process");
    EXPECT_V(1);
    void *va = NULL;
    CHECK_RC(aclrtReserveMemAddress(&va, 8 * MIB, 0, NULL, 0), 0); /* torch_npu: 2 x pages */
    char *b = va;
    for (int i = 0; i < 2; i++) CHECK_RC(aclrtMapMem(b + (size_t)i * 2 * MIB, 2 * MIB, 0, h[i], 0), 0);
    vmm_counts(1, 2, 0, 2);
    /* A reservation holds imported or local handles, not both. */
    aclrtPhysicalMemProp prop = vmm_prop(a->dev);
    aclrtDrvMemHandle mine = NULL;
    CHECK_RC(aclrtMallocPhysical(&mine, 2 * MIB, &prop, 0), 0);
    CHECK_RC(aclrtMapMem(b + 4 * MIB, 2 * MIB, 0, mine, 0), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("cannot also map local");
    EXPECT_V(1);
    CHECK_RC(aclrtFreePhysical(mine), 0);
    CHECK_RC(aclrtFreePhysical(h[0]), ACL_ERROR_INVALID_PARAM); /* still mapped */
    EXPECT_V(1);
    unsigned char buf[64];
    if (a->dev == 0) {
        CHECK_RC(aclrtMemcpy(buf, sizeof buf, b + 2 * MIB - 32, 64, ACL_MEMCPY_DEVICE_TO_HOST), 0);
        CHECK(buf[0] == VPAT && buf[63] == VPAT, "the consumer reads the producer's pages");
        unsigned char mark = 0xE1;
        CHECK_RC(aclrtMemcpy(b + 2 * MIB, 1, &mark, 1, ACL_MEMCPY_HOST_TO_DEVICE), 0);
    } else {
        /* Another device: no H2D/D2H on imported memory; D2D into own memory works. */
        CHECK_RC(aclrtMemcpy(buf, sizeof buf, b, 64, ACL_MEMCPY_DEVICE_TO_HOST),
                 ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
        EXPECT_V(1);
        void *own = NULL;
        CHECK_RC(aclrtMalloc(&own, 2 * MIB, ACL_MEM_MALLOC_HUGE_FIRST), 0);
        CHECK_RC(aclrtMemcpy(own, 64, b + 2 * MIB - 32, 64, ACL_MEMCPY_DEVICE_TO_DEVICE), 0);
        CHECK_RC(aclrtMemcpy(buf, sizeof buf, own, 64, ACL_MEMCPY_DEVICE_TO_HOST), 0);
        CHECK(buf[0] == VPAT && buf[63] == VPAT, "D2D from the imported pages");
        CHECK_RC(aclrtFree(own), 0);
    }
    for (int i = 0; i < 2; i++) {
        CHECK_RC(aclrtUnmapMem(b + (size_t)i * 2 * MIB), 0);
        CHECK_RC(aclrtFreePhysical(h[i]), 0);
    }
    CHECK_RC(aclrtReleaseMemAddress(va), 0);
    CHECK(aclsi_vmm_open_imports(g_sh[0]) == 0, "import of page 0 ended");
    vmm_counts(0, 0, 0, 0);
    EXPECT_V(0);
}

/* Pid whitelist (export flag 0): send a pid (bare tgid or getpid()), wait, import. */
static void child_vmm_whitelisted(void *vp) {
    int use_getpid = *(int *)vp;
    child_setup(0);
    int32_t tgid = 0;
    CHECK_RC(aclrtDeviceGetBareTgid(&tgid), 0);
    send_int(ch.from[1], use_getpid ? (int)getpid() : tgid);
    recv_int(ch.to[0]);
    aclrtDrvMemHandle h = NULL;
    int rc = aclrtMemImportFromShareableHandle(g_sh[0], 0, &h);
    if (use_getpid) {
        CHECK(rc == ACL_ERROR_RT_NO_PERMISSION, "getpid() whitelisted: refused, rc %d", rc);
        MSG_HAS("not in the shareable handle's whitelist");
        MSG_HAS("getpid()");
    } else {
        CHECK(rc == 0, "bare tgid whitelisted: import rc %d", rc);
        /* page 1 was not whitelisted */
        aclrtDrvMemHandle h1 = NULL;
        CHECK_RC(aclrtMemImportFromShareableHandle(g_sh[1], 0, &h1), ACL_ERROR_RT_NO_PERMISSION);
        CHECK_RC(aclrtFreePhysical(h), 0);
    }
    int32_t other = 77; /* only the exporter whitelists */
    CHECK_RC(aclrtMemSetPidToShareableHandle(g_sh[0], &other, 1), ACL_ERROR_INVALID_PARAM);
    EXPECT_V(1);
}

/* Import and map page 0; signal; after the exporter freed everything, the memory still works;
 * page 1 can no longer be imported. */
static void child_vmm_hold(void *vp) {
    (void)vp;
    child_setup(0);
    aclrtDrvMemHandle h = NULL, h1 = NULL;
    void *va = NULL;
    CHECK_RC(aclrtMemImportFromShareableHandle(g_sh[0], 0, &h), 0);
    CHECK_RC(aclrtReserveMemAddress(&va, 2 * MIB, 0, NULL, 0), 0);
    CHECK_RC(aclrtMapMem(va, 2 * MIB, 0, h, 0), 0);
    send_int(ch.from[1], 0);
    recv_int(ch.to[0]); /* the exporter freed its handles */
    CHECK(aclsi_vmm_freed(g_sh[0]) == 1, "the importer sees the exporter's free");
    CHECK(aclsi_vmm_open_imports(g_sh[0]) == 1, "its own import still counts");
    unsigned char v = 0;
    CHECK_RC(aclrtMemcpy(&v, 1, (char *)va + 2 * MIB - 1, 1, ACL_MEMCPY_DEVICE_TO_HOST), 0);
    CHECK(v == VPAT, "imported memory outlives the exporter's free");
    CHECK_RC(aclrtMemImportFromShareableHandle(g_sh[1], 0, &h1), ACL_ERROR_INVALID_PARAM);
    MSG_HAS("the exporter already freed");
    EXPECT_V(1);
    CHECK_RC(aclrtUnmapMem(va), 0);
    CHECK_RC(aclrtFreePhysical(h), 0);
    CHECK_RC(aclrtReleaseMemAddress(va), 0);
    EXPECT_V(0);
}

/* Exit with an imported handle mapped and never freed: recorded at exit. */
static void child_vmm_exit_open(void *vp) {
    (void)vp;
    child_setup(0);
    aclrtDrvMemHandle h = NULL;
    void *va = NULL;
    CHECK_RC(aclrtMemImportFromShareableHandle(g_sh[0], 0, &h), 0);
    CHECK_RC(aclrtReserveMemAddress(&va, 2 * MIB, 0, NULL, 0), 0);
    CHECK_RC(aclrtMapMem(va, 2 * MIB, 0, h, 0), 0);
    EXPECT_V(0);
}

static void scenario_vmm_ipc(void) {
    new_log("vmm_ipc");
    int base = expect_v, kids = 0;
    vmm_exp_t e = vmm_export(ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION);
    vmm_args_t same = {0, 0, 0};
    pid_t c = spawn(child_vmm_import, &same);
    join(c, "vmm import");
    kids++;
    CHECK((unsigned char)e.va[2 * MIB] == 0xE1, "the producer sees the consumer's write");
    CHECK((unsigned char)e.va[2 * MIB - 1] == VPAT, "and nothing else changed");
    CHECK(aclsi_vmm_open_imports(g_sh[0]) == 0, "no import left");
    vmm_args_t no_peer = {1, ACL_ERROR_RT_DRV_INTERNAL_ERROR, 0};
    c = spawn(child_vmm_import, &no_peer);
    join(c, "vmm cross-device without peer access");
    kids++;
    vmm_args_t peer = {1, 0, 1};
    c = spawn(child_vmm_import, &peer);
    join(c, "vmm cross-device with peer access");
    kids++;
    /* exit with an import open */
    c = spawn(child_vmm_exit_open, NULL);
    join(c, "vmm exit with an import");
    kids++;
    CHECK(log_count("1 imported physical handles never freed") == 1, "logged at exit");
    CHECK(aclsi_vmm_open_imports(g_sh[0]) == 0, "the dead importer's import was released");
    /* The exporter frees while an importer holds page 0: allowed, the memory lives on. */
    c = spawn(child_vmm_hold, NULL);
    recv_int(ch.from[0]);
    CHECK(aclsi_vmm_open_imports(g_sh[0]) == 1, "held import counted");
    vmm_unexport(&e);
    send_int(ch.to[1], 0);
    join(c, "vmm hold across the exporter's free");
    kids++;
    EXPECT_V(0);
    /* 5 children x 1 pre-init line; 2 importing children x (double import, mixed reservation,
     * free while mapped); the cross-device D2H; the exit report; the import after free. */
    end_log(expect_v - base + kids + 2 * 3 + 1 + 1 + 1);

    new_log("vmm_wl");
    base = expect_v;
    e = vmm_export(ACL_RT_VMM_EXPORT_FLAG_DEFAULT);
    vmm_args_t refused = {0, ACL_ERROR_RT_NO_PERMISSION, 0};
    c = spawn(child_vmm_import, &refused);
    join(c, "vmm import without whitelist");
    int use_getpid = 1;
    c = spawn(child_vmm_whitelisted, &use_getpid);
    int32_t pid = recv_int(ch.from[0]);
    CHECK_RC(aclrtMemSetPidToShareableHandle(g_sh[0], &pid, 1), 0);
    send_int(ch.to[1], 0);
    join(c, "vmm getpid whitelisted");
    use_getpid = 0;
    c = spawn(child_vmm_whitelisted, &use_getpid);
    pid = recv_int(ch.from[0]);
    CHECK(pid == c + 3000000, "child sent its bare tgid");
    CHECK_RC(aclrtMemSetPidToShareableHandle(g_sh[0], &pid, 1), 0);
    send_int(ch.to[1], 0);
    join(c, "vmm tgid whitelisted");
    vmm_unexport(&e);
    EXPECT_V(0);
    /* 3 children x 1 pre-init line; 2 SetPid by a non-exporter. */
    end_log(expect_v - base + 3 + 2);
}

/* Names of aclsi_ objects in /dev/shm, one per line, into buf. */
static void shm_names(char *buf, size_t len) {
    buf[0] = '\0';
    DIR *d = opendir("/dev/shm");
    if (!d) return;
    struct dirent *e;
    size_t used = 0;
    while ((e = readdir(d)))
        if (strncmp(e->d_name, "aclsi_", 6) == 0 && used + strlen(e->d_name) + 2 < len)
            used += (size_t)snprintf(buf + used, len - used, "%s\n", e->d_name);
    closedir(d);
}

static int contains_line(const char *list, const char *name) {
    size_t n = strlen(name);
    for (const char *l = list; *l;) {
        const char *nl = strchr(l, '\n');
        if ((size_t)(nl - l) == n && strncmp(l, name, n) == 0) return 1;
        l = nl + 1;
    }
    return 0;
}

int main(void) {
    unsetenv("ACL_STANDIN_DEVICES");
    unsetenv("ACL_STANDIN_TGID_OFFSET");
    unsetenv("ACL_STANDIN_DEVICE_MEMORY");
    static char before[1 << 16], after[1 << 16];
    shm_names(before, sizeof before);
    /* Run everything in a child so the leftovers check below sees its exit cleanup too. */
    fflush(NULL);
    pid_t runner = fork();
    if (runner == 0) {
        scenario_basic();
        scenario_whitelist();
        scenario_cross_device();
        scenario_closes();
        scenario_events();
        scenario_exit_open();
        scenario_meminfo_delays();
        scenario_vmm_local();
        scenario_vmm_ipc();
        exit(failures ? 1 : 0);
    }
    int st = 0;
    waitpid(runner, &st, 0);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "scenarios failed (status %#x)", st);
    shm_names(after, sizeof after);
    for (const char *l = after; *l;) {
        const char *nl = strchr(l, '\n');
        char name[256];
        snprintf(name, sizeof name, "%.*s", (int)(nl - l), l);
        CHECK(contains_line(before, name), "leaked /dev/shm/%s", name);
        l = nl + 1;
    }
    printf("acl stand-in selftest: %s\n", failures ? "FAILED" : "ok");
    return failures ? 1 : 0;
}
