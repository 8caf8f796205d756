/*
 * acl_standin.c - TEST-ONLY stand-in for Huawei's Ascend ACL runtime (libascendcl.so).
 *
 * No Ascend hardware is needed: "device memory" is host POSIX shared memory, so IPC between
 * processes really works. The stand-in is STRICT: every documented rule a caller breaks returns
 * the runtime's error code AND is recorded as a violation (one line appended to
 * $DEVSHARE_STANDIN_LOG, one line on stderr, an in-process counter). Failures marked "error only"
 * below are legitimate outcomes a correct caller must handle (wrong pid, missing peer access...),
 * so they return the error without recording a violation.
 *
 * Rules follow the CANN runtime reference for the IPC and VMM calls. See tests/standin/README.md.
 *
 * Build: gcc -std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -Werror -shared -fPIC -pthread \
 *            -o libascendcl.so tests/standin/acl/acl_standin.c -lrt
 */
#include "acl_standin.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

#define HUGE_PAGE ((size_t)2 << 20) /* 2 MiB */
#define SMALL_PAGE ((size_t)4096)   /* 4 KiB */
#define SMALL_SKEW 512              /* small pooled blocks start 512 B past a 4 KiB boundary */
#define KEY_LEN ACL_IPC_MEM_KEY_LEN /* 65 */
#define WL_MAX 64                   /* whitelist capacity (bare tgids) */
#define MAX_DEV 64
#define NAME_LEN 48                 /* shm object names ("/aclsi_..._<pid>_<n>") */

#define VMM_GRAN HUGE_PAGE              /* VMM allocation granularity (2 MiB) */
#define VMM_GRAN_1G ((size_t)1 << 30)  /* ... of the *_HUGE1G memory attributes */
#define SHAREABLE_TAG 0xA5C1ull        /* bits 63..48 of a stand-in shareable handle */

#define META_MAGIC 0x4d495341u /* "ASIM" */
#define VMETA_MAGIC 0x56495341u /* "ASIV" */
#define EVSH_MAGIC 0x45495341u /* "ASIE" */
static const char EVH_TAG[8] = {'A', 'C', 'L', 'S', 'I', 'E', 'V', 'T'};

/* ------------------------------------------------------------------------------------------ */
/* Shared objects (live in /dev/shm, read by several processes; fields used with __atomic).     */

/* Meta object of an export key: shm "/<key>", created by aclrtIpcMemGetExportKey. */
struct meta {
    uint32_t magic;
    int32_t exporter_pid;
    int32_t exporter_tgid;
    int32_t exporter_dev;
    char data_name[NAME_LEN]; /* shm object holding the exporter's allocation */
    uint64_t offset;          /* offset of the exported range inside data_name */
    uint64_t size;            /* size of the exported range */
    int32_t pid_validation;   /* export flags == 0 */
    int32_t wl_count;         /* whitelist entries (bare tgids) */
    int32_t whitelist[WL_MAX];
    int32_t open_imports;     /* open imports across all processes */
    int32_t closed;           /* exporter closed the key */
};

/* Shared state of an IPC event: shm "/aclsi_e_<pid>_<n>". */
struct evshm {
    uint32_t magic;
    int32_t creator_pid;
    int32_t records;
    int32_t waits;
};

/* Layout of the 64 bytes of aclrtIpcEventHandle written by the stand-in. */
struct evh {
    char name[NAME_LEN];
    int32_t pid;
    int32_t pad;
    char tag[8];
};
_Static_assert(sizeof(struct evh) == sizeof(aclrtIpcEventHandle), "event handle is 64 bytes");

/* Per-process key registry "/aclsi_p_<pid>": the next key number and the next shareable-handle
 * number. Lets any process tell a key (or shareable handle) that was issued and then closed /
 * freed (meta unlinked) from one that never existed. */
struct registry {
    uint32_t next_key;
    uint32_t next_vmm;
};

/* Meta object of a VMM shareable handle: shm "/aclsi_s_<pid>_<n>", created by
 * aclrtMemExportToShareableHandle, unlinked when the exporter frees the physical handle. */
struct vmeta {
    uint32_t magic;
    int32_t exporter_pid;
    int32_t exporter_tgid;
    int32_t exporter_dev;
    char data_name[NAME_LEN]; /* shm object holding the physical memory */
    uint64_t size;            /* size of the physical allocation */
    uint64_t gran;            /* its granularity */
    int32_t pid_validation;   /* export flags == 0 */
    int32_t wl_count;
    int32_t whitelist[WL_MAX];
    int32_t open_imports;     /* live imported handles across all processes */
    int32_t freed;            /* the exporter freed the physical handle */
};

/* ------------------------------------------------------------------------------------------ */
/* Process tables (guarded by g.mu).                                                           */

typedef struct alloc {
    struct alloc *next;
    char *map;       /* start of the mapping of the data object */
    size_t map_len;
    char *ptr;       /* device pointer handed out */
    size_t size;     /* requested size (memcpy bounds) */
    size_t rounded;  /* size rounded to the page (export bounds) */
    size_t page;     /* 2 MiB (huge) or 4 KiB */
    size_t shm_off;  /* offset of ptr inside the data object */
    int dev;
    char shm[NAME_LEN];
} alloc_t;

typedef struct xport { /* an open key exported by this process */
    struct xport *next;
    char key[KEY_LEN];
    alloc_t *a;        /* NULL once the allocation was freed (with the key still open) */
    char *p;
    size_t size;
    struct meta *m;
} xport_t;

typedef struct import { /* one open import (the same key may appear several times) */
    struct import *next;
    char key[KEY_LEN];
    char *p;
    size_t size;
    int exp_dev;
    struct meta *m;
} import_t;

typedef struct stream {
    struct stream *next;
    int dev;
} stream_t;

typedef struct event {
    struct event *next;
    int dev;
    int ipc;    /* created with ACL_EVENT_IPC (producer side) */
    int opened; /* returned by aclrtIpcOpenEventHandle (consumer side) */
    int waited; /* opened event was waited on / synchronized */
    char shm[NAME_LEN];
    struct evshm *sh;
} event_t;

/* VMM: a physical memory handle (aclrtDrvMemHandle points to one), from aclrtMallocPhysical
 * (local) or aclrtMemImportFromShareableHandle (imported). The memory is a shm object, kept open
 * by fd so an imported handle outlives the exporter's free. */
typedef struct vphys {
    struct vphys *next;
    int imported;
    int dev;            /* device the handle belongs to (location.id / import deviceId) */
    int mem_dev;        /* device the memory lives on (the exporter's) */
    size_t size, gran;
    int fd;
    char shm[NAME_LEN]; /* data object */
    int nmaps;          /* live mappings of this handle in this process */
    int exported;       /* local: exported (once) */
    uint64_t shareable; /* local: exported as; imported: imported from */
    struct vmeta *m;    /* meta of that shareable handle */
} vphys_t;

typedef struct vresv { /* aclrtReserveMemAddress: PROT_NONE address space */
    struct vresv *next;
    char *base;
    size_t size;
    int nmaps;
} vresv_t;

typedef struct vmap { /* aclrtMapMem: the handle's shm object mapped MAP_FIXED in a reservation */
    struct vmap *next;
    char *va;
    size_t size;
    vphys_t *p;
    vresv_t *r;
} vmap_t;

static struct {
    pthread_mutex_t mu;
    int inited;
    unsigned next_obj; /* numbers shm objects of this process */
    alloc_t *allocs;
    xport_t *xports;
    import_t *imports;
    stream_t *streams;
    event_t *events;
    vphys_t *phys;
    vresv_t *resvs;
    vmap_t *maps;
    unsigned char peer[MAX_DEV][MAX_DEV]; /* peer[cur][peer]: EnablePeerAccess was called */
    struct registry *reg;
    char reg_name[NAME_LEN];
} g = {.mu = PTHREAD_MUTEX_INITIALIZER};

static int g_violations;
static __thread int t_dev = -1;     /* per-thread context: device bound by aclrtSetDevice */
static __thread char t_err[640];    /* aclGetRecentErrMsg */

/* ------------------------------------------------------------------------------------------ */
/* Reporting                                                                                    */

/* One violation: a single write(2) of "acl pid=<pid>: <text>\n" to $DEVSHARE_STANDIN_LOG
 * (O_APPEND, so lines of concurrent processes never interleave) and to stderr. */
static void report(const char *text) {
    char line[768];
    int n = snprintf(line, sizeof line, "acl pid=%d: %.600s\n", (int)getpid(), text);
    if (n < 0) return;
    if ((size_t)n >= sizeof line) n = (int)sizeof line - 1;
    __atomic_add_fetch(&g_violations, 1, __ATOMIC_SEQ_CST);
    const char *path = getenv("DEVSHARE_STANDIN_LOG");
    if (path && *path) {
        int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
        if (fd >= 0) {
            if (write(fd, line, (size_t)n) < 0) { /* nothing better to do */ }
            close(fd);
        }
    }
    char err[800];
    int m = snprintf(err, sizeof err, "[acl stand-in] %s", line);
    if (m > 0 && write(2, err, (size_t)m < sizeof err ? (size_t)m : sizeof err - 1) < 0) { }
}

/* Every failure sets the thread's recent error message; violation != 0 also reports it. */
__attribute__((format(printf, 3, 4)))
static aclError fail(aclError code, int violation, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t_err, sizeof t_err, fmt, ap);
    va_end(ap);
    if (violation) report(t_err);
    return code;
}
#define VIOLATION 1
#define ERROR_ONLY 0

/* Rule: every call except aclInit / aclrtGetVersion / aclGetRecentErrMsg needs aclInit first.
 * Rule: contexts are per thread; memory/IPC/event/stream/sync/peer calls need a device bound
 * on THIS thread by aclrtSetDevice. */
static aclError enter(const char *fn, int need_dev) {
    if (!__atomic_load_n(&g.inited, __ATOMIC_SEQ_CST))
        return fail(ACL_ERROR_UNINITIALIZE, VIOLATION, "%s called before aclInit", fn);
    if (need_dev && t_dev < 0)
        return fail(ACL_ERROR_RT_CONTEXT_NULL, VIOLATION,
                    "%s: no device bound on this thread: call aclrtSetDevice first", fn);
    return ACL_SUCCESS;
}
#define ENTER(need_dev)                                   \
    do {                                                  \
        aclError e_ = enter(__func__, (need_dev));        \
        if (e_ != ACL_SUCCESS) return e_;                 \
    } while (0)

static void lock(void) { pthread_mutex_lock(&g.mu); }
static void unlock(void) { pthread_mutex_unlock(&g.mu); }
/* Run expr (a *_locked implementation) under the table lock and return its result. */
#define LOCKED(expr)                 \
    do {                             \
        lock();                      \
        aclError r_ = (expr);        \
        unlock();                    \
        return r_;                   \
    } while (0)

static int device_count(void) {
    const char *s = getenv("ACL_STANDIN_DEVICES");
    int n = s && *s ? atoi(s) : 2;
    return n < 1 ? 1 : n > MAX_DEV ? MAX_DEV : n;
}

static int32_t bare_tgid(void) {
    const char *s = getenv("ACL_STANDIN_TGID_OFFSET");
    long off = s && *s ? strtol(s, NULL, 10) : 3000000;
    return (int32_t)((long)getpid() + off);
}

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* Memory of each device: ACL_STANDIN_DEVICE_MEMORY bytes (default 64 GiB, a 910B's HBM). */
static uint64_t device_memory(void) {
    const char *s = getenv("ACL_STANDIN_DEVICE_MEMORY");
    unsigned long long n = s && *s ? strtoull(s, NULL, 10) : 0;
    return n ? (uint64_t)n : (uint64_t)64 << 30;
}

/* Bytes this process allocated on device dev (aclrtMalloc, aclrtMallocPhysical); g.mu held. */
static uint64_t device_used_locked(int dev);

/* Test hooks (aclsi_set_delay): milliseconds some calls sleep before they act, outside the
 * table lock, so that other threads' calls go on meanwhile. */
enum { DELAY_CLOSE, DELAY_IMPORT, DELAY_SYNC, DELAY_COUNT };
static unsigned g_delay_ms[DELAY_COUNT];

static void delay(int which) {
    unsigned ms = __atomic_load_n(&g_delay_ms[which], __ATOMIC_SEQ_CST);
    if (!ms) return;
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Shared memory helpers                                                                        */

/* Create (replacing a stale object of the same name) and size a 0600 shm object. */
static int shm_create(const char *name, size_t len) {
    shm_unlink(name);
    int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) return -1;
    if (ftruncate(fd, (off_t)len) != 0) {
        close(fd);
        shm_unlink(name);
        return -1;
    }
    return fd;
}

/* Map an existing shm object (read-write), checking it holds at least min_len bytes. */
static void *shm_map_existing(const char *name, size_t min_len, size_t len, off_t off) {
    int fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
    if (fd < 0) return NULL;
    struct stat st;
    void *p = MAP_FAILED;
    if (fstat(fd, &st) == 0 && (size_t)st.st_size >= min_len)
        p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, off);
    close(fd);
    return p == MAP_FAILED ? NULL : p;
}

/* Map len bytes of fd at an address aligned to align (>= 4 KiB). */
static char *map_aligned(int fd, size_t len, size_t align) {
    if (align <= SMALL_PAGE) {
        void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        return p == MAP_FAILED ? NULL : p;
    }
    char *res = mmap(NULL, len + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
    if (res == MAP_FAILED) return NULL;
    char *a = (char *)(((uintptr_t)res + align - 1) & ~(uintptr_t)(align - 1));
    if (a > res) munmap(res, (size_t)(a - res));
    if (res + len + align > a + len) munmap(a + len, (size_t)(res + len + align - (a + len)));
    void *p = mmap(a, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
    if (p == MAP_FAILED) {
        munmap(a, len);
        return NULL;
    }
    return p;
}

/* Key string of at most 64 chars + NUL inside 65 bytes: length, or -1 if no NUL in 65 bytes.
 * Rule (spec 2): keys are compared up to the NUL only; bytes after it are unspecified. */
static int key_strlen(const char *key) {
    size_t n = strnlen(key, KEY_LEN); /* never reads past the NUL */
    return n < KEY_LEN ? (int)n : -1;
}

/* Keys made by the stand-in: "aclsi_k_<pid>_<n>". Returns 1 and fills pid/n if key parses. */
static int key_parse(const char *key, int *pid, unsigned *n) {
    int used = 0;
    if (sscanf(key, "aclsi_k_%d_%u%n", pid, n, &used) != 2) return 0;
    return key[used] == '\0';
}

static void meta_name(char *out, const char *key) { snprintf(out, NAME_LEN + 32, "/%s", key); }

/* Map the meta object of a key; NULL if it is gone or not a stand-in key. */
static struct meta *meta_open(const char *key) {
    int pid;
    unsigned n;
    char name[NAME_LEN + 32];
    if (!key_parse(key, &pid, &n)) return NULL;
    meta_name(name, key);
    struct meta *m = shm_map_existing(name, sizeof(struct meta), sizeof(struct meta), 0);
    if (m && __atomic_load_n(&m->magic, __ATOMIC_ACQUIRE) != META_MAGIC) {
        munmap(m, sizeof *m);
        return NULL;
    }
    return m;
}

/* Was this key issued by a live exporter (whose registry says n < next)? Then a missing meta
 * object means the exporter closed it. */
static int key_was_issued(const char *key) {
    int pid;
    unsigned n;
    char name[NAME_LEN];
    if (!key_parse(key, &pid, &n)) return 0;
    snprintf(name, sizeof name, "/aclsi_p_%d", pid);
    struct registry *r = shm_map_existing(name, sizeof *r, sizeof *r, 0);
    if (!r) return 0;
    int issued = n < __atomic_load_n(&r->next_key, __ATOMIC_SEQ_CST);
    munmap(r, sizeof *r);
    return issued;
}

/* This process's registry "/aclsi_p_<pid>", created on first use (g.mu held); NULL on failure. */
static struct registry *registry_locked(void) {
    if (!g.reg) {
        snprintf(g.reg_name, sizeof g.reg_name, "/aclsi_p_%d", (int)getpid());
        int fd = shm_create(g.reg_name, sizeof(struct registry));
        void *r = fd >= 0 ? mmap(NULL, sizeof(struct registry), PROT_READ | PROT_WRITE,
                                 MAP_SHARED, fd, 0)
                          : MAP_FAILED;
        if (fd >= 0) close(fd);
        if (r == MAP_FAILED) {
            shm_unlink(g.reg_name);
            return NULL;
        }
        g.reg = r;
    }
    return g.reg;
}

/* Shareable handles made by the stand-in: bits 63..48 SHAREABLE_TAG, 47..24 the exporter's pid,
 * 23..0 its export number n. Meta object "/aclsi_s_<pid>_<n>". */
static uint64_t shareable_make(int pid, unsigned n) {
    return SHAREABLE_TAG << 48 | ((uint64_t)(uint32_t)pid & 0xFFFFFFu) << 24 | (n & 0xFFFFFFu);
}

static int shareable_parse(uint64_t s, int *pid, unsigned *n) {
    if (s >> 48 != SHAREABLE_TAG) return 0;
    *pid = (int)((s >> 24) & 0xFFFFFFu);
    *n = (unsigned)(s & 0xFFFFFFu);
    return *pid > 0;
}

static void vmeta_name(char *out, int pid, unsigned n) {
    snprintf(out, NAME_LEN, "/aclsi_s_%d_%u", pid, n);
}

/* Map the meta object of a shareable handle; NULL if it is gone or not a stand-in handle. */
static struct vmeta *vmeta_open(uint64_t s) {
    int pid;
    unsigned n;
    char name[NAME_LEN];
    if (!shareable_parse(s, &pid, &n)) return NULL;
    vmeta_name(name, pid, n);
    struct vmeta *m = shm_map_existing(name, sizeof *m, sizeof *m, 0);
    if (m && __atomic_load_n(&m->magic, __ATOMIC_ACQUIRE) != VMETA_MAGIC) {
        munmap(m, sizeof *m);
        return NULL;
    }
    return m;
}

/* Was this shareable handle issued by a live exporter? Then a missing meta object means the
 * exporter freed the physical handle. */
static int shareable_was_issued(uint64_t s) {
    int pid;
    unsigned n;
    char name[NAME_LEN];
    if (!shareable_parse(s, &pid, &n)) return 0;
    snprintf(name, sizeof name, "/aclsi_p_%d", pid);
    struct registry *r = shm_map_existing(name, sizeof *r, sizeof *r, 0);
    if (!r) return 0;
    int issued = n < __atomic_load_n(&r->next_vmm, __ATOMIC_SEQ_CST);
    munmap(r, sizeof *r);
    return issued;
}

/* ------------------------------------------------------------------------------------------ */
/* Table lookups (g.mu held)                                                                    */

static alloc_t *alloc_containing(const char *p, int use_rounded) {
    for (alloc_t *a = g.allocs; a; a = a->next)
        if (p >= a->ptr && p < a->ptr + (use_rounded ? a->rounded : a->size)) return a;
    return NULL;
}

/* VMM lookups. */
static vphys_t *phys_find(const void *h) {
    for (vphys_t *p = g.phys; p; p = p->next)
        if ((const void *)p == h) return p;
    return NULL;
}

static vresv_t *resv_overlapping(const char *p, size_t len) {
    for (vresv_t *r = g.resvs; r; r = r->next)
        if (p < r->base + r->size && p + len > r->base) return r;
    return NULL;
}

static vmap_t *map_overlapping(const char *p, size_t len) {
    for (vmap_t *m = g.maps; m; m = m->next)
        if (p < m->va + m->size && p + len > m->va) return m;
    return NULL;
}

/* [p, p+len) against VMM memory: 1 = inside one reservation and mapped throughout (possibly
 * by several adjacent mappings: the addresses are contiguous); *exp_dev = device of imported
 * memory in it, else -1. -1 = overlaps a reservation otherwise. 0 = no VMM memory. */
static int vmm_classify(const char *p, size_t len, int *exp_dev) {
    vresv_t *r = resv_overlapping(p, len);
    if (!r) return 0;
    if (p < r->base || p + len > r->base + r->size || p + len < p) return -1;
    int dev = -1;
    for (const char *cur = p; cur < p + len;) {
        vmap_t *m = map_overlapping(cur, 1);
        if (!m) return -1;
        if (m->p->imported && dev < 0) dev = m->p->mem_dev;
        cur = m->va + m->size;
    }
    *exp_dev = dev;
    return 1;
}

/* Classify [p, p+n): 1 = inside one allocation or live import (*dev_import = exporter device
 * for an import, -1 for an own allocation); 0 = touches no device memory (host);
 * -1 = overlaps device memory but is not inside one region (out of bounds). */
static int classify(const void *vp, size_t n, int *exp_dev) {
    const char *p = vp;
    size_t len = n ? n : 1;
    int overlap = 0;
    for (alloc_t *a = g.allocs; a; a = a->next) {
        if (p >= a->ptr && p + len <= a->ptr + a->size && p + len >= p) {
            *exp_dev = -1;
            return 1;
        }
        if (p < a->ptr + a->size && p + len > a->ptr) overlap = 1;
    }
    for (import_t *i = g.imports; i; i = i->next) {
        if (p >= i->p && p + len <= i->p + i->size && p + len >= p) {
            *exp_dev = i->exp_dev;
            return 1;
        }
        if (p < i->p + i->size && p + len > i->p) overlap = 1;
    }
    int v = vmm_classify(p, len, exp_dev);
    if (v == 1 && !overlap) return 1;
    return overlap || v ? -1 : 0;
}

static xport_t *xport_find(const char *key) {
    for (xport_t *x = g.xports; x; x = x->next)
        if (strcmp(x->key, key) == 0) return x;
    return NULL;
}

static event_t *event_find(aclrtEvent e) {
    for (event_t *v = g.events; v; v = v->next)
        if ((void *)v == e) return v;
    return NULL;
}

/* Rule: a stream must be a live stream of this process (NULL = default stream) and belong to
 * the current device. */
static aclError stream_check(const char *fn, aclrtStream s) {
    if (!s) return ACL_SUCCESS;
    for (stream_t *t = g.streams; t; t = t->next)
        if ((void *)t == s) {
            if (t->dev != t_dev)
                return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                            "%s: stream belongs to device %d but the current device is %d", fn,
                            t->dev, t_dev);
            return ACL_SUCCESS;
        }
    return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "%s: unknown or destroyed stream %p", fn, s);
}

/* ------------------------------------------------------------------------------------------ */
/* Init / device                                                                                */

EXPORT aclError aclInit(const char *configPath) {
    (void)configPath;
    int expected = 0;
    /* Rule: a repeat call returns 100002 (callers may ignore it). Error only. */
    if (!__atomic_compare_exchange_n(&g.inited, &expected, 1, 0, __ATOMIC_SEQ_CST,
                                     __ATOMIC_SEQ_CST))
        return fail(ACL_ERROR_REPEAT_INITIALIZE, ERROR_ONLY, "aclInit: already initialized");
    return ACL_SUCCESS;
}

EXPORT aclError aclFinalize(void) {
    ENTER(0);
    __atomic_store_n(&g.inited, 0, __ATOMIC_SEQ_CST);
    return ACL_SUCCESS;
}

EXPORT aclError aclrtGetVersion(int32_t *major, int32_t *minor, int32_t *patch) {
    if (!major || !minor || !patch)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "aclrtGetVersion: NULL argument");
    *major = 8;
    *minor = 3;
    *patch = 0;
    return ACL_SUCCESS;
}

EXPORT aclError aclrtGetDeviceCount(uint32_t *count) {
    ENTER(0);
    if (!count) return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "aclrtGetDeviceCount: NULL count");
    *count = (uint32_t)device_count();
    return ACL_SUCCESS;
}

/* Default contexts: aclrtSetDevice creates (once) the device's default context, shared by the
 * process's threads; aclrtGetCurrentContext / aclrtSetCurrentContext read and switch the
 * calling thread's current one. The stand-in models a context as its device. */
#define CTX_MAGIC 0x61636c63u /* "aclc" */
static struct aclsi_ctx {
    unsigned magic;
    int dev;
} g_ctx[MAX_DEV];
static int g_set_device_calls; /* aclrtSetDevice calls in this process, for tests */

EXPORT aclError aclrtSetDevice(int32_t dev) {
    ENTER(0);
    if (dev < 0 || dev >= device_count()) /* error only */
        return fail(ACL_ERROR_INVALID_PARAM, ERROR_ONLY,
                    "aclrtSetDevice: device %d out of range (count %d)", dev, device_count());
    __atomic_store_n(&g_ctx[dev].dev, dev, __ATOMIC_SEQ_CST);
    __atomic_store_n(&g_ctx[dev].magic, CTX_MAGIC, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&g_set_device_calls, 1, __ATOMIC_SEQ_CST);
    t_dev = dev;
    return ACL_SUCCESS;
}

EXPORT aclError aclrtGetCurrentContext(aclrtContext *ctx) {
    ENTER(0);
    if (!ctx) return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "aclrtGetCurrentContext: NULL argument");
    if (t_dev < 0) /* error only: a caller may ask whether the thread has a context */
        return fail(ACL_ERROR_RT_CONTEXT_NULL, ERROR_ONLY, "aclrtGetCurrentContext: no context on this thread");
    *ctx = &g_ctx[t_dev];
    return ACL_SUCCESS;
}

EXPORT aclError aclrtSetCurrentContext(aclrtContext ctx) {
    ENTER(0);
    struct aclsi_ctx *c = ctx;
    if (!c || c < g_ctx || c >= g_ctx + MAX_DEV || __atomic_load_n(&c->magic, __ATOMIC_SEQ_CST) != CTX_MAGIC)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtSetCurrentContext: %p is not a context of this process", ctx);
    t_dev = c->dev;
    return ACL_SUCCESS;
}

EXPORT int aclsi_set_device_calls(void) { return __atomic_load_n(&g_set_device_calls, __ATOMIC_SEQ_CST); }

EXPORT aclError aclrtGetDevice(int32_t *dev) {
    ENTER(0);
    if (!dev) return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "aclrtGetDevice: NULL argument");
    if (t_dev < 0) /* error only: a caller may legitimately ask whether a device is bound */
        return fail(ACL_ERROR_RT_CONTEXT_NULL, ERROR_ONLY,
                    "aclrtGetDevice: no device bound on this thread");
    *dev = t_dev;
    return ACL_SUCCESS;
}

EXPORT aclError aclrtResetDevice(int32_t dev) {
    ENTER(0);
    if (dev < 0 || dev >= device_count())
        return fail(ACL_ERROR_INVALID_PARAM, ERROR_ONLY,
                    "aclrtResetDevice: device %d out of range", dev);
    if (t_dev == dev) t_dev = -1; /* the thread's context is gone */
    return ACL_SUCCESS;
}

/* ------------------------------------------------------------------------------------------ */
/* Memory                                                                                       */

static uint64_t device_used_locked(int dev) {
    uint64_t n = 0;
    for (alloc_t *a = g.allocs; a; a = a->next)
        if (a->dev == dev) n += a->rounded;
    for (vphys_t *p = g.phys; p; p = p->next)
        if (!p->imported && p->dev == dev) n += p->size;
    return n;
}

/* The bound device's memory: every HBM kind (and the location-free ACL_MEM_* kinds) reports
 * the whole device, ACL_STANDIN_DEVICE_MEMORY; DDR kinds report 0 and 0, as the reference says
 * for a kind the hardware does not have. free = total - what this process allocated there. */
EXPORT aclError aclrtGetMemInfo(aclrtMemAttr attr, size_t *free_bytes, size_t *total_bytes) {
    ENTER(1);
    if (!free_bytes || !total_bytes)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "aclrtGetMemInfo: NULL free or total");
    if ((unsigned)attr > (unsigned)ACL_MEM_P2P_HUGE1G)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "aclrtGetMemInfo: unknown attr %d",
                    (int)attr);
    int ddr = attr == ACL_DDR_MEM || attr == ACL_DDR_MEM_HUGE || attr == ACL_DDR_MEM_NORMAL ||
              attr == ACL_DDR_MEM_P2P_HUGE || attr == ACL_DDR_MEM_P2P_NORMAL;
    if (ddr) {
        *free_bytes = 0;
        *total_bytes = 0;
        return ACL_SUCCESS;
    }
    lock();
    uint64_t used = device_used_locked(t_dev);
    unlock();
    uint64_t total = device_memory();
    *total_bytes = (size_t)total;
    *free_bytes = (size_t)(used > total ? 0 : total - used);
    return ACL_SUCCESS;
}

EXPORT aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy) {
    ENTER(1);
    int pol = (int)policy & ~0x300; /* 0x100/0x200: bandwidth type bits, accepted */
    if (!devPtr) return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "aclrtMalloc: NULL devPtr");
    if (size == 0) return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "aclrtMalloc: size 0");
    if (pol < 0 || pol > ACL_MEM_MALLOC_NORMAL_ONLY_P2P)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "aclrtMalloc: unknown policy %d",
                    (int)policy);
    int huge = pol == ACL_MEM_MALLOC_HUGE_FIRST || pol == ACL_MEM_MALLOC_HUGE_ONLY ||
               pol == ACL_MEM_MALLOC_HUGE_FIRST_P2P || pol == ACL_MEM_MALLOC_HUGE_ONLY_P2P;
    alloc_t *a = calloc(1, sizeof *a);
    if (!a) return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, ERROR_ONLY, "aclrtMalloc: out of memory");
    size_t obj_len;
    if (size < HUGE_PAGE) {
        /* Small blocks come from a pool: 512 B past a 4 KiB boundary, so not exportable. */
        a->page = SMALL_PAGE;
        a->rounded = size;
        a->shm_off = SMALL_SKEW;
        obj_len = round_up(SMALL_SKEW + size, SMALL_PAGE);
    } else {
        a->page = huge ? HUGE_PAGE : SMALL_PAGE;
        a->rounded = round_up(size, a->page);
        obj_len = a->rounded;
    }
    a->size = size;
    a->dev = t_dev;
    lock();
    uint64_t used = device_used_locked(a->dev), total = device_memory();
    if (used > total || a->rounded > total - used) { /* error only: the device is full */
        unlock();
        free(a);
        return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, ERROR_ONLY,
                    "aclrtMalloc: %zu bytes do not fit in device %d's free memory (%llu of %llu "
                    "bytes free, ACL_STANDIN_DEVICE_MEMORY)", size, t_dev,
                    (unsigned long long)(used > total ? 0 : total - used),
                    (unsigned long long)total);
    }
    snprintf(a->shm, sizeof a->shm, "/aclsi_m_%d_%u", (int)getpid(), g.next_obj++);
    unlock();
    int fd = shm_create(a->shm, obj_len);
    char *map = fd >= 0 ? map_aligned(fd, obj_len, size < HUGE_PAGE ? SMALL_PAGE : a->page) : NULL;
    if (fd >= 0) close(fd);
    if (!map) {
        shm_unlink(a->shm);
        free(a);
        return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, ERROR_ONLY,
                    "aclrtMalloc: cannot back %zu bytes with shared memory: %s", size,
                    strerror(errno));
    }
    a->map = map;
    a->map_len = obj_len;
    a->ptr = map + a->shm_off;
    lock();
    a->next = g.allocs;
    g.allocs = a;
    unlock();
    *devPtr = a->ptr;
    return ACL_SUCCESS;
}

static aclError free_locked(void *p) {
    alloc_t **pp = &g.allocs;
    while (*pp && (*pp)->ptr != (char *)p) pp = &(*pp)->next;
    if (!*pp) {
        /* Rule: only pointers returned by aclrtMalloc may be freed. */
        for (import_t *i = g.imports; i; i = i->next)
            if ((char *)p >= i->p && (char *)p < i->p + i->size)
                return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                            "aclrtFree(%p): imported memory (key %s): close the key instead", p,
                            i->key);
        if (alloc_containing(p, 1))
            return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                        "aclrtFree(%p): not the base of an allocation", p);
        if (resv_overlapping(p, 1))
            return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                        "aclrtFree(%p): VMM address (aclrtReserveMemAddress): release it with "
                        "aclrtUnmapMem / aclrtFreePhysical / aclrtReleaseMemAddress",
                        p);
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "aclrtFree(%p): unknown pointer", p);
    }
    alloc_t *a = *pp;
    /* Rule: the exporter closes every key (after all importers closed) before freeing. */
    for (xport_t *x = g.xports; x; x = x->next) {
        if (x->a != a) continue;
        int n = __atomic_load_n(&x->m->open_imports, __ATOMIC_SEQ_CST);
        fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
             "aclrtFree(%p): freed while exported/imported: key %s is still open (%d open "
             "imports); aclrtIpcMemClose it first",
             p, x->key, n);
        x->a = NULL;
    }
    *pp = a->next;
    munmap(a->map, a->map_len);
    shm_unlink(a->shm);
    free(a);
    return ACL_SUCCESS; /* still freed */
}

EXPORT aclError aclrtFree(void *devPtr) {
    ENTER(1);
    LOCKED(free_locked(devPtr));
}

static const char *kind_name(int k) {
    static const char *names[] = {"HOST_TO_HOST", "HOST_TO_DEVICE", "DEVICE_TO_HOST",
                                  "DEVICE_TO_DEVICE"};
    return k >= 0 && k < 4 ? names[k] : "?";
}

static aclError memcpy_locked(void *dst, size_t dstMax, const void *src, size_t n, int kind) {
    if (!dst || !src)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "aclrtMemcpy: NULL pointer");
    if (kind < ACL_MEMCPY_HOST_TO_HOST || kind > ACL_MEMCPY_DEVICE_TO_DEVICE)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "aclrtMemcpy: unknown kind %d", kind);
    /* Rule: count <= destMax. */
    if (n > dstMax)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "aclrtMemcpy: count %zu > destMax %zu",
                    n, dstMax);
    int dst_dev_side = kind == ACL_MEMCPY_HOST_TO_DEVICE || kind == ACL_MEMCPY_DEVICE_TO_DEVICE;
    int src_dev_side = kind == ACL_MEMCPY_DEVICE_TO_HOST || kind == ACL_MEMCPY_DEVICE_TO_DEVICE;
    int dst_exp = -1, src_exp = -1;
    int dc = classify(dst, n, &dst_exp), sc = classify(src, n, &src_exp);
    /* Rule: a device-side range lies inside one allocation or live import of this process. */
    if (dst_dev_side && dc != 1)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtMemcpy %s: destination [%p, +%zu) is out of bounds (not inside an "
                    "allocation or live import of this process)",
                    kind_name(kind), dst, n);
    if (src_dev_side && sc != 1)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtMemcpy %s: source [%p, +%zu) is out of bounds (not inside an "
                    "allocation or live import of this process)",
                    kind_name(kind), src, n);
    /* Rule: the kind matches the pointers: a host-side pointer is not device memory. */
    if ((!dst_dev_side && dc != 0) || (!src_dev_side && sc != 0))
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtMemcpy: kind %s does not match the pointers (%s is device memory)",
                    kind_name(kind), !dst_dev_side && dc != 0 ? "destination" : "source");
    /* Rule (spec 7): memory imported from another device: no H2D/D2H copies. */
    if ((kind == ACL_MEMCPY_HOST_TO_DEVICE && dst_exp >= 0 && dst_exp != t_dev) ||
        (kind == ACL_MEMCPY_DEVICE_TO_HOST && src_exp >= 0 && src_exp != t_dev))
        return fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, VIOLATION,
                    "aclrtMemcpy %s: no H2D/D2H copies to memory imported from another device "
                    "(exporter device %d, current device %d)",
                    kind_name(kind), kind == ACL_MEMCPY_HOST_TO_DEVICE ? dst_exp : src_exp,
                    t_dev);
    memmove(dst, src, n);
    return ACL_SUCCESS;
}

EXPORT aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count,
                            aclrtMemcpyKind kind) {
    ENTER(1);
    LOCKED(memcpy_locked(dst, destMax, src, count, (int)kind));
}

/* ------------------------------------------------------------------------------------------ */
/* IPC memory                                                                                   */

static aclError export_locked(char *p, size_t size, char *key, size_t len, uint64_t flags) {
    if (!p || !key)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "aclrtIpcMemGetExportKey: NULL argument");
    /* Rule: the key buffer is 65 bytes. */
    if (len != KEY_LEN)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtIpcMemGetExportKey: key buffer length %zu, must be 65", len);
    /* Rule: export flags are DEFAULT (0) or DISABLE_PID_VALIDATION (1). */
    if (flags > ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtIpcMemGetExportKey: unknown flags %#llx", (unsigned long long)flags);
    /* Rule: the range lies inside one aclrtMalloc allocation of this process made on the
     * current device. */
    alloc_t *a = alloc_containing(p, 1);
    if (!a || size == 0 || size > a->rounded || p + size > a->ptr + a->rounded)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtIpcMemGetExportKey: range [%p, +%zu) is not inside one aclrtMalloc "
                    "allocation of this process",
                    (void *)p, size);
    if (a->dev != t_dev)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtIpcMemGetExportKey: allocation is on device %d, current device is %d",
                    a->dev, t_dev);
    /* Rule (spec 7): the range must be page aligned (2 MiB huge / 4 KiB normal pages); small
     * pooled blocks never are. A careful caller checks this before calling. */
    if ((uintptr_t)p % a->page || size % a->page)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtIpcMemGetExportKey: export of a range that is not page aligned "
                    "([%p, +%zu), page %zu KiB%s)",
                    (void *)p, size, a->page >> 10,
                    a->size < HUGE_PAGE ? ", small pooled block: allocate >= 2 MiB HUGE" : "");
    /* Rule: export a range once and cache the key (still returns a fresh key). */
    for (xport_t *x = g.xports; x; x = x->next)
        if (x->a == a && x->p == p && x->size == size) {
            fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                 "aclrtIpcMemGetExportKey: same range exported twice (cache the key %s)",
                 x->key);
            break;
        }
    /* The key registry of this process (see key_was_issued). */
    if (!registry_locked())
        return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, ERROR_ONLY,
                    "aclrtIpcMemGetExportKey: cannot create key registry");
    xport_t *x = calloc(1, sizeof *x);
    if (!x) return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, ERROR_ONLY, "out of memory");
    unsigned n = __atomic_load_n(&g.reg->next_key, __ATOMIC_SEQ_CST);
    snprintf(x->key, sizeof x->key, "aclsi_k_%d_%u", (int)getpid(), n);
    char name[NAME_LEN + 32];
    meta_name(name, x->key);
    int fd = shm_create(name, sizeof(struct meta));
    void *m = fd >= 0 ? mmap(NULL, sizeof(struct meta), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                      : MAP_FAILED;
    if (fd >= 0) close(fd);
    if (m == MAP_FAILED) {
        shm_unlink(name);
        free(x);
        return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, ERROR_ONLY,
                    "aclrtIpcMemGetExportKey: cannot create meta object");
    }
    __atomic_store_n(&g.reg->next_key, n + 1, __ATOMIC_SEQ_CST);
    x->m = m;
    x->a = a;
    x->p = p;
    x->size = size;
    x->m->exporter_pid = (int32_t)getpid();
    x->m->exporter_tgid = bare_tgid();
    x->m->exporter_dev = a->dev;
    snprintf(x->m->data_name, sizeof x->m->data_name, "%s", a->shm);
    x->m->offset = a->shm_off + (size_t)(p - a->ptr);
    x->m->size = size;
    x->m->pid_validation = flags == ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT;
    __atomic_store_n(&x->m->magic, META_MAGIC, __ATOMIC_RELEASE);
    x->next = g.xports;
    g.xports = x;
    /* Rule (spec 2): bytes after the NUL are unspecified: fill them with garbage so callers
     * that compare or hash all 65 bytes are caught. */
    memset(key, 0xA5, KEY_LEN);
    memcpy(key, x->key, strlen(x->key) + 1);
    return ACL_SUCCESS;
}

EXPORT aclError aclrtIpcMemGetExportKey(void *devPtr, size_t size, char *key, size_t len,
                                        uint64_t flag) {
    ENTER(1);
    LOCKED(export_locked(devPtr, size, key, len, flag));
}

/* Validate a key argument (NUL within 65 bytes). */
static aclError key_check(const char *fn, const char *key) {
    if (!key) return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "%s: NULL key", fn);
    if (key_strlen(key) < 0)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "%s: key has no NUL within 65 bytes", fn);
    return ACL_SUCCESS;
}

static aclError setpid_locked(const char *key, int32_t *pids, size_t n) {
    aclError rc = key_check("aclrtIpcMemSetImportPid", key);
    if (rc) return rc;
    /* Rule: only the exporting process whitelists, on a key it holds open. */
    xport_t *x = xport_find(key);
    if (!x)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtIpcMemSetImportPid: key %s was not exported (or was closed) by this "
                    "process: only the exporter sets import pids",
                    key);
    if (!pids || n < 1 || n > WL_MAX)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtIpcMemSetImportPid: need 1..64 pids, got %zu%s", n,
                    pids ? "" : " (NULL array)");
    int have = x->m->wl_count;
    if ((size_t)have + n > WL_MAX)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtIpcMemSetImportPid: whitelist of key %s would exceed 64 pids", key);
    for (size_t i = 0; i < n; i++) {
        if (pids[i] <= 0)
            return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                        "aclrtIpcMemSetImportPid: invalid pid %d", pids[i]);
    }
    for (size_t i = 0; i < n; i++) x->m->whitelist[have + (int)i] = pids[i];
    __atomic_store_n(&x->m->wl_count, have + (int)n, __ATOMIC_RELEASE);
    return ACL_SUCCESS;
}

EXPORT aclError aclrtIpcMemSetImportPid(const char *key, int32_t *pid, size_t num) {
    ENTER(1);
    LOCKED(setpid_locked(key, pid, num));
}

static aclError import_locked(void **out, const char *key, uint64_t flags) {
    if (!out) return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "aclrtIpcMemImportByKey: NULL devPtr");
    aclError rc = key_check("aclrtIpcMemImportByKey", key);
    if (rc) return rc;
    /* Rule: import flags are DEFAULT (0) or ENABLE_PEER_ACCESS (1). */
    if (flags > ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtIpcMemImportByKey: unknown flags %#llx", (unsigned long long)flags);
    struct meta *m = meta_open(key);
    /* Rule: all importers import before the exporter closes the key. */
    if ((!m && key_was_issued(key)) || (m && __atomic_load_n(&m->closed, __ATOMIC_SEQ_CST))) {
        if (m) munmap(m, sizeof *m);
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtIpcMemImportByKey: import of key %s that the exporter already closed",
                    key);
    }
    if (!m) /* error only */
        return fail(ACL_ERROR_INVALID_PARAM, ERROR_ONLY, "aclrtIpcMemImportByKey: unknown key %s",
                    key);
    /* Pid validation (error only): the importer's bare tgid must be whitelisted. */
    if (m->pid_validation) {
        int32_t me = bare_tgid(), n = __atomic_load_n(&m->wl_count, __ATOMIC_ACQUIRE);
        int ok = 0, has_getpid = 0;
        for (int i = 0; i < n && i < WL_MAX; i++) {
            ok |= m->whitelist[i] == me;
            has_getpid |= m->whitelist[i] == (int32_t)getpid();
        }
        if (!ok) {
            munmap(m, sizeof *m);
            return fail(ACL_ERROR_RT_NO_PERMISSION, ERROR_ONLY,
                        "aclrtIpcMemImportByKey: pid %d is not in the key's whitelist "
                        "(aclrtIpcMemSetImportPid)%s",
                        me,
                        has_getpid ? "; the whitelist holds this process's getpid(), not its "
                                     "bare tgid (aclrtDeviceGetBareTgid)"
                                   : "");
        }
    }
    /* Cross-device (error only): needs import flag 1 or aclrtDeviceEnablePeerAccess. */
    int edev = m->exporter_dev;
    if (edev != t_dev && flags != ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS &&
        (edev < 0 || edev >= MAX_DEV || !g.peer[t_dev][edev])) {
        munmap(m, sizeof *m);
        return fail(ACL_ERROR_RT_DRV_INTERNAL_ERROR, ERROR_ONLY,
                    "aclrtIpcMemImportByKey: key %s was exported on device %d, importing on "
                    "device %d without peer access (aclrtDeviceEnablePeerAccess(%d, 0) or "
                    "import flag ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS)",
                    key, edev, t_dev, edev);
    }
    import_t *im = calloc(1, sizeof *im);
    char *p = im ? shm_map_existing(m->data_name, (size_t)(m->offset + m->size),
                                    (size_t)m->size, (off_t)m->offset)
                 : NULL;
    if (!p) {
        free(im);
        munmap(m, sizeof *m);
        return fail(ACL_ERROR_INVALID_PARAM, ERROR_ONLY,
                    "aclrtIpcMemImportByKey: memory of key %s is gone (exporter freed it)", key);
    }
    snprintf(im->key, sizeof im->key, "%s", key);
    im->p = p;
    im->size = (size_t)m->size;
    im->exp_dev = edev;
    im->m = m;
    __atomic_add_fetch(&m->open_imports, 1, __ATOMIC_SEQ_CST);
    im->next = g.imports; /* newest first: close pops the most recent */
    g.imports = im;
    *out = p;
    return ACL_SUCCESS;
}

EXPORT aclError aclrtIpcMemImportByKey(void **devPtr, const char *key, uint64_t flag) {
    ENTER(1);
    delay(DELAY_IMPORT);
    LOCKED(import_locked(devPtr, key, flag));
}

/* Drop an export entry: unmap its meta (the key itself is already closed or dying). */
static void xport_release(xport_t *x) {
    munmap(x->m, sizeof *x->m);
    free(x);
}

static void import_release(import_t *im) {
    __atomic_sub_fetch(&im->m->open_imports, 1, __ATOMIC_SEQ_CST);
    munmap(im->p, im->size);
    munmap(im->m, sizeof *im->m);
    free(im);
}

static aclError close_locked(const char *key) {
    aclError rc = key_check("aclrtIpcMemClose", key);
    if (rc) return rc;
    /* Rule: in an importer, close ends one import (the most recent). */
    for (import_t **pp = &g.imports; *pp; pp = &(*pp)->next)
        if (strcmp((*pp)->key, key) == 0) {
            import_t *im = *pp;
            *pp = im->next;
            import_release(im);
            return ACL_SUCCESS;
        }
    /* Otherwise: exporter-side destroy. */
    for (xport_t **pp = &g.xports; *pp; pp = &(*pp)->next)
        if (strcmp((*pp)->key, key) == 0) {
            xport_t *x = *pp;
            int n = __atomic_load_n(&x->m->open_imports, __ATOMIC_SEQ_CST);
            /* Rule (spec 7): all importers close a key before the exporter closes it. */
            if (n > 0)
                fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                     "aclrtIpcMemClose: exporter closed key %s while %d imports are open (all "
                     "importers must close first)",
                     key, n);
            __atomic_store_n(&x->m->closed, 1, __ATOMIC_SEQ_CST);
            char name[NAME_LEN + 32];
            meta_name(name, key);
            shm_unlink(name);
            *pp = x->next;
            xport_release(x);
            return ACL_SUCCESS;
        }
    int pid;
    unsigned n;
    if (key_parse(key, &pid, &n) && pid == (int)getpid() && key_was_issued(key))
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtIpcMemClose: close of key %s that this process already closed "
                    "(more closes than exports)",
                    key);
    return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                "aclrtIpcMemClose: close of a key this process neither imported nor exported "
                "(%s), or more closes than imports",
                key);
}

EXPORT aclError aclrtIpcMemClose(const char *key) {
    ENTER(1);
    delay(DELAY_CLOSE);
    LOCKED(close_locked(key));
}

EXPORT aclError aclrtDeviceGetBareTgid(int32_t *pid) {
    ENTER(1);
    if (!pid) return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "aclrtDeviceGetBareTgid: NULL pid");
    *pid = bare_tgid(); /* models a container: the host tgid differs from getpid() */
    return ACL_SUCCESS;
}

EXPORT aclError aclrtDeviceEnablePeerAccess(int32_t peer, uint32_t flags) {
    ENTER(1);
    /* Rule: flags are reserved, must be 0. */
    if (flags != 0)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtDeviceEnablePeerAccess: flags must be 0, got %u", flags);
    if (peer < 0 || peer >= device_count() || peer == t_dev) /* error only */
        return fail(ACL_ERROR_INVALID_PARAM, ERROR_ONLY,
                    "aclrtDeviceEnablePeerAccess: invalid peer device %d (current %d)", peer,
                    t_dev);
    lock();
    g.peer[t_dev][peer] = 1;
    unlock();
    return ACL_SUCCESS;
}

/* ------------------------------------------------------------------------------------------ */
/* VMM (virtual memory management; what torch_npu's expandable segments use)                   */
/*                                                                                              */
/* A physical handle is a shm object "/aclsi_v_<pid>_<n>" of its size; a reservation is real   */
/* PROT_NONE address space; aclrtMapMem maps the object MAP_FIXED over it (read-write: ACL has  */
/* no access step on this path), aclrtUnmapMem puts PROT_NONE back. An exported handle gets a   */
/* meta object "/aclsi_s_<pid>_<n>" that any process reaches from the u64 shareable handle.    */

static int is_huge1g(int attr) {
    return attr == ACL_HBM_MEM_HUGE1G || attr == ACL_HBM_MEM_P2P_HUGE1G ||
           attr == ACL_MEM_HUGE1G || attr == ACL_MEM_P2P_HUGE1G;
}

/* Rule: the physical memory properties torch_npu and the reference use: handleType NONE,
 * allocationType PINNED, a known memAttr, a device location with a valid id. */
static aclError prop_check(const char *fn, const aclrtPhysicalMemProp *prop) {
    if (!prop) return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "%s: NULL prop", fn);
    if (prop->handleType != ACL_MEM_HANDLE_TYPE_NONE)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "%s: prop.handleType %d, must be ACL_MEM_HANDLE_TYPE_NONE", fn,
                    (int)prop->handleType);
    if (prop->allocationType != ACL_MEM_ALLOCATION_TYPE_PINNED)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "%s: prop.allocationType %d, must be ACL_MEM_ALLOCATION_TYPE_PINNED", fn,
                    (int)prop->allocationType);
    if ((unsigned)prop->memAttr > (unsigned)ACL_MEM_P2P_HUGE1G)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "%s: unknown prop.memAttr %d", fn,
                    (int)prop->memAttr);
    if (prop->location.type != ACL_MEM_LOCATION_TYPE_DEVICE) /* error only */
        return fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, ERROR_ONLY,
                    "%s: prop.location.type %d: only ACL_MEM_LOCATION_TYPE_DEVICE is modelled",
                    fn, (int)prop->location.type);
    if (prop->location.id >= (uint32_t)device_count()) /* error only */
        return fail(ACL_ERROR_INVALID_PARAM, ERROR_ONLY,
                    "%s: prop.location.id %u: device out of range (count %d)", fn,
                    prop->location.id, device_count());
    return ACL_SUCCESS;
}

EXPORT aclError aclrtMemGetAllocationGranularity(aclrtPhysicalMemProp *prop,
                                                 aclrtMemGranularityOptions option,
                                                 size_t *granularity) {
    ENTER(1);
    aclError rc = prop_check(__func__, prop);
    if (rc) return rc;
    if (!granularity)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "%s: NULL granularity", __func__);
    if (option != ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM &&
        option != ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "%s: unknown option %d", __func__,
                    (int)option);
    *granularity = is_huge1g(prop->memAttr) ? VMM_GRAN_1G : VMM_GRAN;
    return ACL_SUCCESS;
}

static aclError malloc_phys_locked(aclrtDrvMemHandle *h, size_t size,
                                   const aclrtPhysicalMemProp *prop, uint64_t flags) {
    const char *fn = "aclrtMallocPhysical";
    if (!h) return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "%s: NULL handle", fn);
    aclError rc = prop_check(fn, prop);
    if (rc) return rc;
    if (flags != 0)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "%s: flags are reserved, must be 0, got "
                    "%#llx", fn, (unsigned long long)flags);
    size_t gran = is_huge1g(prop->memAttr) ? VMM_GRAN_1G : VMM_GRAN;
    /* Rule: size is a non-zero multiple of the granularity (aclrtMapMem maps whole handles at
     * granularity-aligned addresses, so anything else could never be mapped). */
    if (size == 0 || size % gran)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "%s: size %zu is not a non-zero multiple of the allocation granularity %zu "
                    "(aclrtMemGetAllocationGranularity)", fn, size, gran);
    uint64_t used = device_used_locked((int)prop->location.id), total = device_memory();
    if (used > total || size > total - used) /* error only: the device is full */
        return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, ERROR_ONLY,
                    "%s: %zu bytes do not fit in device %u's free memory (%llu of %llu bytes "
                    "free, ACL_STANDIN_DEVICE_MEMORY)", fn, size, prop->location.id,
                    (unsigned long long)(used > total ? 0 : total - used),
                    (unsigned long long)total);
    vphys_t *p = calloc(1, sizeof *p);
    if (!p) return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, ERROR_ONLY, "%s: out of memory", fn);
    snprintf(p->shm, sizeof p->shm, "/aclsi_v_%d_%u", (int)getpid(), g.next_obj++);
    p->fd = shm_create(p->shm, size);
    if (p->fd < 0) {
        free(p);
        return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, ERROR_ONLY,
                    "%s: cannot back %zu bytes with shared memory: %s", fn, size, strerror(errno));
    }
    p->dev = p->mem_dev = (int)prop->location.id;
    p->size = size;
    p->gran = gran;
    p->next = g.phys;
    g.phys = p;
    *h = p;
    return ACL_SUCCESS;
}

EXPORT aclError aclrtMallocPhysical(aclrtDrvMemHandle *handle, size_t size,
                                    const aclrtPhysicalMemProp *prop, uint64_t flags) {
    ENTER(1);
    LOCKED(malloc_phys_locked(handle, size, prop, flags));
}

/* Drop a physical handle. owner: this process owns it (a free or its exit): end its import /
 * destroy its shareable handle and data object; otherwise (fork child) only forget it. */
static void phys_release(vphys_t *p, int owner) {
    if (p->m) {
        if (owner && p->imported) {
            __atomic_sub_fetch(&p->m->open_imports, 1, __ATOMIC_SEQ_CST);
        } else if (owner) {
            /* The exporter's free destroys the shareable handle: no new imports. Processes that
             * already imported keep their memory (the runtime defers the real free). */
            int pid;
            unsigned n;
            char name[NAME_LEN];
            __atomic_store_n(&p->m->freed, 1, __ATOMIC_SEQ_CST);
            if (shareable_parse(p->shareable, &pid, &n)) {
                vmeta_name(name, pid, n);
                shm_unlink(name);
            }
        }
        munmap(p->m, sizeof *p->m);
    }
    close(p->fd);
    if (owner && !p->imported) shm_unlink(p->shm);
    free(p);
}

static aclError free_phys_locked(aclrtDrvMemHandle h) {
    vphys_t **pp = &g.phys;
    while (*pp && (void *)*pp != h) pp = &(*pp)->next;
    if (!*pp)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtFreePhysical(%p): unknown physical handle (freed twice, or never "
                    "allocated / imported)", h);
    vphys_t *p = *pp;
    /* Rule (reference): unmap every mapping of the handle before freeing it. */
    if (p->nmaps)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtFreePhysical(%p): the handle is still mapped (%d mappings): "
                    "aclrtUnmapMem before aclrtFreePhysical", h, p->nmaps);
    *pp = p->next;
    phys_release(p, 1);
    return ACL_SUCCESS;
}

EXPORT aclError aclrtFreePhysical(aclrtDrvMemHandle handle) {
    ENTER(1);
    LOCKED(free_phys_locked(handle));
}

static aclError reserve_locked(void **out, size_t size, size_t alignment, void *expect,
                               uint64_t flags) {
    const char *fn = "aclrtReserveMemAddress";
    if (!out) return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "%s: NULL virPtr", fn);
    if (size == 0 || size % VMM_GRAN)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "%s: size %zu is not a non-zero multiple of the granularity (2 MiB)", fn,
                    size);
    if (alignment != 0)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "%s: alignment is reserved, must be 0, got %zu", fn, alignment);
    if (flags > 1)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "%s: flags %#llx, must be 0 or 1", fn,
                    (unsigned long long)flags);
    if (expect) /* error only: a fixed address is an experimental feature, not modelled */
        return fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, ERROR_ONLY,
                    "%s: expectPtr %p: a fixed address is experimental and not modelled (pass "
                    "NULL)", fn, expect);
    size_t align = size >= VMM_GRAN_1G ? VMM_GRAN_1G : VMM_GRAN;
    vresv_t *r = calloc(1, sizeof *r);
    char *raw = r ? mmap(NULL, size + align, PROT_NONE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
                  : MAP_FAILED;
    if (raw == MAP_FAILED) {
        free(r);
        return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, ERROR_ONLY,
                    "%s: cannot reserve %zu bytes of address space", fn, size);
    }
    char *a = (char *)(((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1));
    if (a > raw) munmap(raw, (size_t)(a - raw));
    if (raw + size + align > a + size) munmap(a + size, (size_t)(raw + size + align - (a + size)));
    r->base = a;
    r->size = size;
    r->next = g.resvs;
    g.resvs = r;
    *out = a;
    return ACL_SUCCESS;
}

EXPORT aclError aclrtReserveMemAddress(void **virPtr, size_t size, size_t alignment,
                                       void *expectPtr, uint64_t flags) {
    ENTER(1);
    LOCKED(reserve_locked(virPtr, size, alignment, expectPtr, flags));
}

static aclError release_resv_locked(void *va) {
    vresv_t **pp = &g.resvs;
    while (*pp && (void *)(*pp)->base != va) pp = &(*pp)->next;
    if (!*pp)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtReleaseMemAddress(%p): %s", va,
                    resv_overlapping(va, 1) ? "not the start of a reservation"
                                            : "not a live reservation (released twice?)");
    vresv_t *r = *pp;
    /* Rule (reference order: unmap, free physical, release): release only an empty range. */
    if (r->nmaps)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtReleaseMemAddress(%p): %d mappings are still in the reservation: "
                    "aclrtUnmapMem each first", va, r->nmaps);
    *pp = r->next;
    munmap(r->base, r->size);
    free(r);
    return ACL_SUCCESS;
}

EXPORT aclError aclrtReleaseMemAddress(void *virPtr) {
    ENTER(1);
    LOCKED(release_resv_locked(virPtr));
}

static aclError map_locked(char *va, size_t size, size_t offset, aclrtDrvMemHandle h,
                           uint64_t flags) {
    const char *fn = "aclrtMapMem";
    if (!va) return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "%s: NULL virPtr", fn);
    vphys_t *p = phys_find(h);
    if (!p)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "%s: unknown physical handle %p (freed?)", fn, h);
    if (flags != 0)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "%s: flags are reserved, must be 0", fn);
    if (offset != 0)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "%s: offset %zu: the physical offset must currently be 0", fn, offset);
    /* Rule (reference): size equals the aclrtMallocPhysical size; the address is a multiple
     * of the granularity. */
    if (size != p->size)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "%s: size %zu must equal the physical handle's size %zu", fn, size, p->size);
    if ((uintptr_t)va % p->gran)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "%s: address %p is not a multiple of the granularity %zu", fn, (void *)va,
                    p->gran);
    /* Rule: map only inside one reservation, never over another mapping. */
    vresv_t *r = resv_overlapping(va, size);
    if (!r || va < r->base || va + size > r->base + r->size)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "%s: [%p, +%zu) is not inside one reservation (aclrtReserveMemAddress)", fn,
                    (void *)va, size);
    vmap_t *o = map_overlapping(va, size);
    if (o)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "%s: [%p, +%zu) overlaps the mapping [%p, +%zu) (aclrtUnmapMem it first)", fn,
                    (void *)va, size, (void *)o->va, o->size);
    /* Rule (reference): one reservation is not bound to physical memory of two devices, nor
     * to both aclrtMallocPhysical and aclrtMemImportFromShareableHandle handles. */
    for (vmap_t *m = g.maps; m; m = m->next) {
        if (m->r != r) continue;
        if (m->p->imported != p->imported)
            return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                        "%s: the reservation at %p already maps %s handles; it cannot also map "
                        "%s ones", fn, (void *)r->base, m->p->imported ? "imported" : "local",
                        p->imported ? "imported" : "local (aclrtMallocPhysical)");
        if (m->p->dev != p->dev)
            return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                        "%s: the reservation at %p already maps memory of device %d; it cannot "
                        "also map memory of device %d", fn, (void *)r->base, m->p->dev, p->dev);
        break;
    }
    vmap_t *m = calloc(1, sizeof *m);
    if (!m) return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, ERROR_ONLY, "%s: out of memory", fn);
    if (mmap(va, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, p->fd, 0) == MAP_FAILED) {
        free(m);
        return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, ERROR_ONLY, "%s: mmap failed: %s", fn,
                    strerror(errno));
    }
    m->va = va;
    m->size = size;
    m->p = p;
    m->r = r;
    p->nmaps++;
    r->nmaps++;
    m->next = g.maps;
    g.maps = m;
    return ACL_SUCCESS;
}

EXPORT aclError aclrtMapMem(void *virPtr, size_t size, size_t offset, aclrtDrvMemHandle handle,
                            uint64_t flags) {
    ENTER(1);
    LOCKED(map_locked(virPtr, size, offset, handle, flags));
}

static aclError unmap_locked(void *va) {
    vmap_t **pp = &g.maps;
    while (*pp && (void *)(*pp)->va != va) pp = &(*pp)->next;
    if (!*pp)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "aclrtUnmapMem(%p): %s", va,
                    map_overlapping(va, 1) ? "not the start of a mapping"
                                           : "nothing is mapped there (unmapped twice?)");
    vmap_t *m = *pp;
    /* Back to reserved, inaccessible address space. */
    mmap(m->va, m->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1,
         0);
    m->p->nmaps--;
    m->r->nmaps--;
    *pp = m->next;
    free(m);
    return ACL_SUCCESS;
}

EXPORT aclError aclrtUnmapMem(void *virPtr) {
    ENTER(1);
    LOCKED(unmap_locked(virPtr));
}

static aclError export_vmm_locked(aclrtDrvMemHandle h, int type, uint64_t flags, uint64_t *out) {
    const char *fn = "aclrtMemExportToShareableHandle";
    if (!out) return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "%s: NULL shareableHandle", fn);
    vphys_t *p = phys_find(h);
    if (!p)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "%s: unknown physical handle %p (freed?)", fn, h);
    if (p->imported)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "%s: handle %p was imported; only handles from aclrtMallocPhysical in this "
                    "process are exported", fn, h);
    if (type != ACL_MEM_HANDLE_TYPE_NONE)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "%s: handleType %d is reserved, must be ACL_MEM_HANDLE_TYPE_NONE", fn, type);
    if (flags > ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "%s: unknown flags %#llx", fn,
                    (unsigned long long)flags);
    /* Rule (reference): a physical handle and its shareable handle are 1:1 in a process;
     * exporting the same handle again fails. */
    if (p->exported)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "%s: handle %p was already exported as %#llx (a physical handle and its "
                    "shareable handle are 1:1: export once and cache it)", fn, h,
                    (unsigned long long)p->shareable);
    if (getpid() > 0xFFFFFF || !registry_locked())
        return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, ERROR_ONLY, "%s: cannot create registry", fn);
    unsigned n = __atomic_load_n(&g.reg->next_vmm, __ATOMIC_SEQ_CST);
    char name[NAME_LEN];
    vmeta_name(name, (int)getpid(), n);
    int fd = shm_create(name, sizeof(struct vmeta));
    struct vmeta *m = fd >= 0 ? mmap(NULL, sizeof *m, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                              : MAP_FAILED;
    if (fd >= 0) close(fd);
    if (m == MAP_FAILED) {
        shm_unlink(name);
        return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, ERROR_ONLY,
                    "%s: cannot create the shareable handle's meta object", fn);
    }
    __atomic_store_n(&g.reg->next_vmm, n + 1, __ATOMIC_SEQ_CST);
    m->exporter_pid = (int32_t)getpid();
    m->exporter_tgid = bare_tgid();
    m->exporter_dev = p->mem_dev;
    snprintf(m->data_name, sizeof m->data_name, "%s", p->shm);
    m->size = p->size;
    m->gran = p->gran;
    m->pid_validation = flags == ACL_RT_VMM_EXPORT_FLAG_DEFAULT;
    __atomic_store_n(&m->magic, VMETA_MAGIC, __ATOMIC_RELEASE);
    p->exported = 1;
    p->shareable = shareable_make((int)getpid(), n);
    p->m = m;
    *out = p->shareable;
    return ACL_SUCCESS;
}

EXPORT aclError aclrtMemExportToShareableHandle(aclrtDrvMemHandle handle,
                                                aclrtMemHandleType handleType, uint64_t flags,
                                                uint64_t *shareableHandle) {
    ENTER(1);
    LOCKED(export_vmm_locked(handle, (int)handleType, flags, shareableHandle));
}

static aclError setpid_vmm_locked(uint64_t s, int32_t *pids, size_t n) {
    const char *fn = "aclrtMemSetPidToShareableHandle";
    vphys_t *p = g.phys;
    while (p && !(p->exported && p->shareable == s)) p = p->next;
    /* Rule: only the exporter whitelists, while its physical handle is live. */
    if (!p)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "%s: shareable handle %#llx was not exported by this process (or its "
                    "physical handle was freed): only the exporter sets pids", fn,
                    (unsigned long long)s);
    if (!pids || n < 1 || n > WL_MAX)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "%s: need 1..64 pids, got %zu%s", fn, n,
                    pids ? "" : " (NULL array)");
    int have = p->m->wl_count;
    if ((size_t)have + n > WL_MAX)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "%s: whitelist of %#llx would exceed 64 pids", fn, (unsigned long long)s);
    for (size_t i = 0; i < n; i++)
        if (pids[i] <= 0)
            return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "%s: invalid pid %d", fn, pids[i]);
    for (size_t i = 0; i < n; i++) p->m->whitelist[have + (int)i] = pids[i];
    __atomic_store_n(&p->m->wl_count, have + (int)n, __ATOMIC_RELEASE);
    return ACL_SUCCESS;
}

EXPORT aclError aclrtMemSetPidToShareableHandle(uint64_t shareableHandle, int32_t *pid,
                                                size_t pidNum) {
    ENTER(1);
    LOCKED(setpid_vmm_locked(shareableHandle, pid, pidNum));
}

static aclError import_vmm_locked(uint64_t s, int32_t dev, aclrtDrvMemHandle *out) {
    const char *fn = "aclrtMemImportFromShareableHandle";
    unsigned long long su = (unsigned long long)s;
    if (!out) return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "%s: NULL handle", fn);
    if (dev < 0 || dev >= device_count()) /* error only */
        return fail(ACL_ERROR_INVALID_PARAM, ERROR_ONLY, "%s: device %d out of range (count %d)",
                    fn, dev, device_count());
    int pid;
    unsigned n;
    if (!shareable_parse(s, &pid, &n)) /* error only */
        return fail(ACL_ERROR_INVALID_PARAM, ERROR_ONLY, "%s: unknown shareable handle %#llx", fn,
                    su);
    /* Rule (reference): export and import in the same process is not supported. */
    if (pid == (int)getpid())
        return fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, VIOLATION,
                    "%s: shareable handle %#llx was exported by this process: import in the "
                    "exporting process is not supported (use the physical handle)", fn, su);
    /* Rule (reference): a handle and its shareable handle are 1:1 per process: no second
     * live import of the same shareable handle. */
    for (vphys_t *q = g.phys; q; q = q->next)
        if (q->imported && q->shareable == s)
            return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                        "%s: shareable handle %#llx is already imported in this process as %p "
                        "(handle and shareable handle are 1:1 per process: import once and "
                        "refcount)", fn, su, (void *)q);
    struct vmeta *m = vmeta_open(s);
    /* Rule (reference): the exporter keeps the physical memory until importers imported. */
    if ((!m && shareable_was_issued(s)) || (m && __atomic_load_n(&m->freed, __ATOMIC_SEQ_CST))) {
        if (m) munmap(m, sizeof *m);
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "%s: import of shareable handle %#llx whose physical memory the exporter "
                    "already freed (aclrtFreePhysical)", fn, su);
    }
    if (!m) /* error only */
        return fail(ACL_ERROR_INVALID_PARAM, ERROR_ONLY, "%s: unknown shareable handle %#llx", fn,
                    su);
    /* Pid validation (error only): the importer's bare tgid must be whitelisted. */
    if (m->pid_validation) {
        int32_t me = bare_tgid(), cnt = __atomic_load_n(&m->wl_count, __ATOMIC_ACQUIRE);
        int ok = 0, has_getpid = 0;
        for (int i = 0; i < cnt && i < WL_MAX; i++) {
            ok |= m->whitelist[i] == me;
            has_getpid |= m->whitelist[i] == (int32_t)getpid();
        }
        if (!ok) {
            munmap(m, sizeof *m);
            return fail(ACL_ERROR_RT_NO_PERMISSION, ERROR_ONLY,
                        "%s: pid %d is not in the shareable handle's whitelist "
                        "(aclrtMemSetPidToShareableHandle)%s", fn, me,
                        has_getpid ? "; the whitelist holds this process's getpid(), not its "
                                     "bare tgid (aclrtDeviceGetBareTgid)"
                                   : "");
        }
    }
    /* Cross-device (error only; a guess): needs aclrtDeviceEnablePeerAccess from the target
     * device to the exporter's. */
    int edev = m->exporter_dev;
    if (edev != dev && (edev < 0 || edev >= MAX_DEV || !g.peer[dev][edev])) {
        munmap(m, sizeof *m);
        return fail(ACL_ERROR_RT_DRV_INTERNAL_ERROR, ERROR_ONLY,
                    "%s: shareable handle %#llx holds memory of device %d, importing for device "
                    "%d without peer access (aclrtSetDevice(%d); aclrtDeviceEnablePeerAccess(%d, "
                    "0))", fn, su, edev, dev, dev, edev);
    }
    int fd = shm_open(m->data_name, O_RDWR | O_CLOEXEC, 0);
    struct stat st;
    vphys_t *p = fd >= 0 && fstat(fd, &st) == 0 && (uint64_t)st.st_size >= m->size
                     ? calloc(1, sizeof *p)
                     : NULL;
    if (!p) {
        if (fd >= 0) close(fd);
        munmap(m, sizeof *m);
        return fail(ACL_ERROR_INVALID_PARAM, ERROR_ONLY,
                    "%s: the memory of shareable handle %#llx is gone", fn, su);
    }
    p->imported = 1;
    p->dev = dev;
    p->mem_dev = edev;
    p->size = (size_t)m->size;
    p->gran = (size_t)m->gran;
    p->fd = fd;
    snprintf(p->shm, sizeof p->shm, "%s", m->data_name);
    p->shareable = s;
    p->m = m;
    __atomic_add_fetch(&m->open_imports, 1, __ATOMIC_SEQ_CST);
    p->next = g.phys;
    g.phys = p;
    *out = p;
    return ACL_SUCCESS;
}

EXPORT aclError aclrtMemImportFromShareableHandle(uint64_t shareableHandle, int32_t deviceId,
                                                  aclrtDrvMemHandle *handle) {
    ENTER(1);
    LOCKED(import_vmm_locked(shareableHandle, deviceId, handle));
}

/* ------------------------------------------------------------------------------------------ */
/* Streams                                                                                      */

EXPORT aclError aclrtCreateStream(aclrtStream *stream) {
    ENTER(1);
    if (!stream) return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "aclrtCreateStream: NULL stream");
    stream_t *s = calloc(1, sizeof *s);
    if (!s) return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, ERROR_ONLY, "out of memory");
    s->dev = t_dev;
    lock();
    s->next = g.streams;
    g.streams = s;
    unlock();
    *stream = s;
    return ACL_SUCCESS;
}

EXPORT aclError aclrtDestroyStream(aclrtStream stream) {
    ENTER(1);
    lock();
    for (stream_t **pp = &g.streams; *pp; pp = &(*pp)->next)
        if ((void *)*pp == stream) {
            stream_t *s = *pp;
            *pp = s->next;
            free(s);
            unlock();
            return ACL_SUCCESS;
        }
    unlock();
    return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                "aclrtDestroyStream: unknown or already destroyed stream %p", stream);
}

EXPORT aclError aclrtSynchronizeStream(aclrtStream stream) {
    ENTER(1);
    LOCKED(stream_check("aclrtSynchronizeStream", stream)); /* host memory: work is done */
}

EXPORT aclError aclrtSynchronizeDevice(void) {
    ENTER(1);
    delay(DELAY_SYNC);
    return ACL_SUCCESS;
}

/* ------------------------------------------------------------------------------------------ */
/* Events                                                                                       */

static aclError create_event(aclrtEvent *event, uint32_t flag) {
    if (!event) return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "create event: NULL event");
    uint32_t known = ACL_EVENT_SYNC | ACL_EVENT_CAPTURE_STREAM_PROGRESS | ACL_EVENT_TIME_LINE |
                     ACL_EVENT_IPC;
    if (flag & ~known)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtCreateEventExWithFlag: unknown flag bits %#x", flag & ~known);
    event_t *v = calloc(1, sizeof *v);
    if (!v) return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, ERROR_ONLY, "out of memory");
    v->dev = t_dev;
    lock();
    if (flag & ACL_EVENT_IPC) {
        /* IPC event: shared counters in "/aclsi_e_<pid>_<n>". */
        snprintf(v->shm, sizeof v->shm, "/aclsi_e_%d_%u", (int)getpid(), g.next_obj++);
        int fd = shm_create(v->shm, sizeof(struct evshm));
        void *sh = fd >= 0 ? mmap(NULL, sizeof(struct evshm), PROT_READ | PROT_WRITE, MAP_SHARED,
                                  fd, 0)
                           : MAP_FAILED;
        if (fd >= 0) close(fd);
        if (sh == MAP_FAILED) {
            unlock();
            shm_unlink(v->shm);
            free(v);
            return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, ERROR_ONLY,
                        "create event: cannot create IPC event object");
        }
        v->ipc = 1;
        v->sh = sh;
        v->sh->creator_pid = (int32_t)getpid();
        __atomic_store_n(&v->sh->magic, EVSH_MAGIC, __ATOMIC_RELEASE);
    }
    v->next = g.events;
    g.events = v;
    unlock();
    *event = v;
    return ACL_SUCCESS;
}

EXPORT aclError aclrtCreateEvent(aclrtEvent *event) {
    ENTER(1);
    return create_event(event, 0);
}

EXPORT aclError aclrtCreateEventExWithFlag(aclrtEvent *event, uint32_t flag) {
    ENTER(1);
    return create_event(event, flag);
}

static aclError record_locked(aclrtEvent e, aclrtStream s) {
    event_t *v = event_find(e);
    if (!v)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "aclrtRecordEvent: unknown event %p", e);
    aclError rc = stream_check("aclrtRecordEvent", s);
    if (rc) return rc;
    /* Rule (guess): an opened IPC event is only waited on by the consumer, never recorded. */
    if (v->opened)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtRecordEvent: event %p was opened from an IPC handle; the consumer "
                    "only waits on it",
                    e);
    if (v->sh) __atomic_add_fetch(&v->sh->records, 1, __ATOMIC_SEQ_CST);
    return ACL_SUCCESS;
}

EXPORT aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream) {
    ENTER(1);
    LOCKED(record_locked(event, stream));
}

/* Stream wait or synchronize on an event: an opened event counts as waited on. */
static aclError wait_locked(const char *fn, aclrtStream s, aclrtEvent e) {
    event_t *v = event_find(e);
    if (!v) return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "%s: unknown event %p", fn, e);
    aclError rc = stream_check(fn, s);
    if (rc) return rc;
    if (v->opened) {
        v->waited = 1;
        __atomic_add_fetch(&v->sh->waits, 1, __ATOMIC_SEQ_CST);
    }
    return ACL_SUCCESS;
}

EXPORT aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event) {
    ENTER(1);
    LOCKED(wait_locked("aclrtStreamWaitEvent", stream, event));
}

EXPORT aclError aclrtSynchronizeEvent(aclrtEvent event) {
    ENTER(1);
    LOCKED(wait_locked("aclrtSynchronizeEvent", NULL, event));
}

static void event_release(event_t *v) {
    if (v->sh) munmap(v->sh, sizeof *v->sh);
    free(v);
}

static aclError destroy_event_locked(aclrtEvent e) {
    for (event_t **pp = &g.events; *pp; pp = &(*pp)->next) {
        if ((void *)*pp != e) continue;
        event_t *v = *pp;
        *pp = v->next;
        /* Rule (spec 5): the consumer makes a stream wait on an opened event before dropping
         * it (and before releasing the memory). */
        if (v->opened && !v->waited)
            fail(ACL_SUCCESS, VIOLATION, /* still destroyed: returns success */
                 "aclrtDestroyEvent: IPC event opened but never waited on "
                 "(aclrtStreamWaitEvent before destroying)");
        if (v->ipc) shm_unlink(v->shm); /* producer side: the handle dies with the event */
        event_release(v);
        return ACL_SUCCESS;
    }
    return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                "aclrtDestroyEvent: unknown or already destroyed event %p", e);
}

EXPORT aclError aclrtDestroyEvent(aclrtEvent event) {
    ENTER(1);
    LOCKED(destroy_event_locked(event));
}

static aclError get_handle_locked(aclrtEvent e, aclrtIpcEventHandle *h) {
    if (!h) return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "aclrtIpcGetEventHandle: NULL handle");
    event_t *v = event_find(e);
    /* Rule: only events created with ACL_EVENT_IPC (in this process) have a handle. */
    if (!v || !v->ipc)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtIpcGetEventHandle: event %p was not created with ACL_EVENT_IPC%s", e,
                    v ? "" : " (unknown event)");
    struct evh eh;
    memset(&eh, 0, sizeof eh);
    snprintf(eh.name, sizeof eh.name, "%s", v->shm);
    eh.pid = (int32_t)getpid();
    memcpy(eh.tag, EVH_TAG, sizeof eh.tag);
    memcpy(h->reserved, &eh, sizeof eh);
    return ACL_SUCCESS;
}

EXPORT aclError aclrtIpcGetEventHandle(aclrtEvent event, aclrtIpcEventHandle *handle) {
    ENTER(1);
    LOCKED(get_handle_locked(event, handle));
}

EXPORT aclError aclrtIpcOpenEventHandle(aclrtIpcEventHandle handle, aclrtEvent *event) {
    ENTER(1);
    if (!event)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION, "aclrtIpcOpenEventHandle: NULL event");
    struct evh eh;
    memcpy(&eh, handle.reserved, sizeof eh);
    /* Rule (spec 5): the handle is 64 opaque bytes passed unchanged; garbage (e.g. the 8 bytes
     * old torch_npu sends with sync=False) must not be opened. */
    if (memcmp(eh.tag, EVH_TAG, sizeof eh.tag) != 0 || strnlen(eh.name, NAME_LEN) == NAME_LEN ||
        strncmp(eh.name, "/aclsi_e_", 9) != 0)
        return fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
                    "aclrtIpcOpenEventHandle: the 64 bytes are not an IPC event handle (pass "
                    "all 64 bytes unchanged; ignore the bytes when event_sync_required is "
                    "false)");
    struct evshm *sh = shm_map_existing(eh.name, sizeof *sh, sizeof *sh, 0);
    if (sh && __atomic_load_n(&sh->magic, __ATOMIC_ACQUIRE) != EVSH_MAGIC) {
        munmap(sh, sizeof *sh);
        sh = NULL;
    }
    if (!sh) /* error only: the producer destroyed the event or exited */
        return fail(ACL_ERROR_INVALID_PARAM, ERROR_ONLY,
                    "aclrtIpcOpenEventHandle: event %s is gone (destroyed or producer exited)",
                    eh.name);
    event_t *v = calloc(1, sizeof *v);
    if (!v) {
        munmap(sh, sizeof *sh);
        return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, ERROR_ONLY, "out of memory");
    }
    v->dev = t_dev;
    v->opened = 1;
    v->sh = sh;
    snprintf(v->shm, sizeof v->shm, "%s", eh.name);
    lock();
    v->next = g.events;
    g.events = v;
    unlock();
    *event = v;
    return ACL_SUCCESS;
}

EXPORT const char *aclGetRecentErrMsg(void) { return t_err; }

/* ------------------------------------------------------------------------------------------ */
/* Test-only queries                                                                            */

EXPORT int aclsi_violation_count(void) { return __atomic_load_n(&g_violations, __ATOMIC_SEQ_CST); }

/* Read a field of a key's meta: from a mapping this process holds, else from /dev/shm. */
static int meta_field(const char *key, int closed_field) {
    if (!key || key_strlen(key) < 0) return -1;
    int r = -2;
    lock();
    struct meta *m = NULL;
    for (import_t *i = g.imports; i && !m; i = i->next)
        if (strcmp(i->key, key) == 0) m = i->m;
    for (xport_t *x = g.xports; x && !m; x = x->next)
        if (strcmp(x->key, key) == 0) m = x->m;
    if (m)
        r = __atomic_load_n(closed_field ? &m->closed : &m->open_imports, __ATOMIC_SEQ_CST);
    unlock();
    if (r != -2) return r;
    m = meta_open(key);
    if (m) {
        r = __atomic_load_n(closed_field ? &m->closed : &m->open_imports, __ATOMIC_SEQ_CST);
        munmap(m, sizeof *m);
        return r;
    }
    return closed_field && key_was_issued(key) ? 1 : -1;
}

EXPORT int aclsi_open_imports(const char *key) { return meta_field(key, 0); }
EXPORT int aclsi_key_closed(const char *key) { return meta_field(key, 1); }

static int event_counter(aclrtEvent e, int waits) {
    lock();
    event_t *v = event_find(e);
    int r = v && v->sh ? __atomic_load_n(waits ? &v->sh->waits : &v->sh->records,
                                         __ATOMIC_SEQ_CST)
                       : -1;
    unlock();
    return r;
}

EXPORT int aclsi_event_waits(aclrtEvent event) { return event_counter(event, 1); }
EXPORT int aclsi_event_records(aclrtEvent event) { return event_counter(event, 0); }

/* VMM counts of this process. what: 0 reservations, 1 mappings, 2 local physical handles,
 * 3 imported handles. */
static int vmm_count(int what) {
    int n = 0;
    lock();
    if (what == 0)
        for (vresv_t *r = g.resvs; r; r = r->next) n++;
    else if (what == 1)
        for (vmap_t *m = g.maps; m; m = m->next) n++;
    else
        for (vphys_t *p = g.phys; p; p = p->next) n += p->imported == (what == 3);
    unlock();
    return n;
}

EXPORT int aclsi_vmm_reservations(void) { return vmm_count(0); }
EXPORT int aclsi_vmm_mappings(void) { return vmm_count(1); }
EXPORT int aclsi_vmm_physical_handles(void) { return vmm_count(2); }
EXPORT int aclsi_vmm_imported_handles(void) { return vmm_count(3); }

/* A field of a shareable handle's meta: from a mapping this process holds, else from
 * /dev/shm. freed_field: the "freed" flag (1 also when the meta is gone but was issued). */
static int vmeta_field(uint64_t s, int freed_field) {
    int r = -2;
    lock();
    for (vphys_t *p = g.phys; p && r == -2; p = p->next)
        if (p->m && p->shareable == s)
            r = __atomic_load_n(freed_field ? &p->m->freed : &p->m->open_imports,
                                __ATOMIC_SEQ_CST);
    unlock();
    if (r != -2) return r;
    struct vmeta *m = vmeta_open(s);
    if (m) {
        r = __atomic_load_n(freed_field ? &m->freed : &m->open_imports, __ATOMIC_SEQ_CST);
        munmap(m, sizeof *m);
        return r;
    }
    return freed_field && shareable_was_issued(s) ? 1 : -1;
}

EXPORT int aclsi_vmm_open_imports(uint64_t shareableHandle) {
    return vmeta_field(shareableHandle, 0);
}
EXPORT int aclsi_vmm_freed(uint64_t shareableHandle) { return vmeta_field(shareableHandle, 1); }

/* Test hook: make every later call of `call` in this process sleep `ms` milliseconds before it
 * acts (outside the stand-in's lock): "aclrtIpcMemClose", "aclrtIpcMemImportByKey" or
 * "aclrtSynchronizeDevice"; 0 ms turns it off. Returns 0, or -1 for another name. */
EXPORT int aclsi_set_delay(const char *call, unsigned ms) {
    static const char *const names[DELAY_COUNT] = {
        [DELAY_CLOSE] = "aclrtIpcMemClose",
        [DELAY_IMPORT] = "aclrtIpcMemImportByKey",
        [DELAY_SYNC] = "aclrtSynchronizeDevice",
    };
    for (int i = 0; call && i < DELAY_COUNT; i++)
        if (strcmp(call, names[i]) == 0) {
            __atomic_store_n(&g_delay_ms[i], ms, __ATOMIC_SEQ_CST);
            return 0;
        }
    return -1;
}

/* ------------------------------------------------------------------------------------------ */
/* Process lifetime                                                                             */

/* Drop every table entry. unlink_shared: this process is exiting and owns the objects (unlink
 * them, end its imports); otherwise (fork child) only forget the inherited entries. */
static void drop_tables(int unlink_shared) {
    while (g.maps) { /* the address space goes with its reservation */
        vmap_t *m = g.maps;
        g.maps = m->next;
        free(m);
    }
    while (g.resvs) {
        vresv_t *r = g.resvs;
        g.resvs = r->next;
        munmap(r->base, r->size);
        free(r);
    }
    while (g.phys) {
        vphys_t *p = g.phys;
        g.phys = p->next;
        phys_release(p, unlink_shared);
    }
    while (g.imports) {
        import_t *im = g.imports;
        g.imports = im->next;
        if (unlink_shared) {
            import_release(im); /* the runtime releases a dead process's imports */
        } else {
            munmap(im->p, im->size);
            munmap(im->m, sizeof *im->m);
            free(im);
        }
    }
    while (g.xports) {
        xport_t *x = g.xports;
        g.xports = x->next;
        if (unlink_shared) {
            char name[NAME_LEN + 32];
            __atomic_store_n(&x->m->closed, 1, __ATOMIC_SEQ_CST);
            meta_name(name, x->key);
            shm_unlink(name);
        }
        xport_release(x);
    }
    while (g.allocs) {
        alloc_t *a = g.allocs;
        g.allocs = a->next;
        munmap(a->map, a->map_len);
        if (unlink_shared) shm_unlink(a->shm);
        free(a);
    }
    while (g.events) {
        event_t *v = g.events;
        g.events = v->next;
        if (unlink_shared && v->ipc) shm_unlink(v->shm);
        event_release(v);
    }
    while (g.streams) {
        stream_t *s = g.streams;
        g.streams = s->next;
        free(s);
    }
    if (g.reg) {
        munmap(g.reg, sizeof *g.reg);
        if (unlink_shared) shm_unlink(g.reg_name);
        g.reg = NULL;
    }
    memset(g.peer, 0, sizeof g.peer);
}

static void atfork_prepare(void) { lock(); }
static void atfork_parent(void) { unlock(); }
/* A forked child is a fresh ACL process: it inherits no context, memory, keys or events and
 * must call aclInit and aclrtSetDevice itself (as on hardware, where the device context does
 * not survive fork). */
static void atfork_child(void) {
    drop_tables(0);
    g.inited = 0;
    g.next_obj = 0;
    g_violations = 0;
    t_dev = -1;
    t_err[0] = '\0';
    unlock();
}

__attribute__((constructor)) static void standin_init(void) {
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

/* Rules checked at exit: closes must equal imports; opened IPC events must be destroyed;
 * imported VMM physical handles must be freed. */
__attribute__((destructor)) static void standin_fini(void) {
    /* Do not hang at exit if another thread is stuck mid-call holding the lock. */
    for (int tries = 0; pthread_mutex_trylock(&g.mu) != 0; tries++) {
        if (tries == 200) return;
        usleep(1000);
    }
    int open_imports = 0, open_events = 0, open_vmm = 0;
    uint64_t vmm_example = 0;
    for (import_t *i = g.imports; i; i = i->next) open_imports++;
    for (vphys_t *p = g.phys; p; p = p->next)
        if (p->imported) {
            open_vmm++;
            vmm_example = p->shareable;
        }
    for (event_t *v = g.events; v; v = v->next) open_events += v->opened;
    if (open_imports)
        fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
             "at exit: %d imports never closed (closes must equal imports; e.g. key %s)",
             open_imports, g.imports->key);
    if (open_events)
        fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
             "at exit: %d IPC events opened but never destroyed (aclrtDestroyEvent)",
             open_events);
    /* Rule: every imported physical handle is freed (after unmapping) before exit. */
    if (open_vmm)
        fail(ACL_ERROR_INVALID_PARAM, VIOLATION,
             "at exit: %d imported physical handles never freed (aclrtUnmapMem + "
             "aclrtFreePhysical; e.g. shareable handle %#llx)",
             open_vmm, (unsigned long long)vmm_example);
    drop_tables(1);
    unlock();
}
