/* SPDX-License-Identifier: Apache-2.0 */
/* cuda_standin.c - a STRICT, test-only stand-in for the CUDA driver API (libcuda.so.1).
 *
 * No GPU is involved: "device memory" is POSIX shared memory on the host, so devshare's cuda
 * backend can be tested across processes in CI. The stand-in enforces the driver's documented
 * rules (and how PyTorch uses IPC handles and events) and records
 * every rule a caller breaks as a "violation": one line `cuda pid=<pid>: <text>` appended to
 * $DEVSHARE_STANDIN_LOG (single O_APPEND write) and echoed on stderr. Checks marked "error
 * only" return the driver's error code without a violation (they are legitimate outcomes).
 *
 * Build: gcc -std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -Werror -shared -fPIC -pthread
 *        -Wl,-soname,libcuda.so.1 -o libcuda.so.1 tests/standin/cuda/cuda_standin.c -lrt
 *
 * Environment:
 *   CUDA_STANDIN_DEVICES  physical devices (default 2, at most 16)
 *   CUDA_STANDIN_VISIBLE  like CUDA_VISIBLE_DEVICES: "1,0" makes ordinal 0 physical device 1
 *   CUDA_STANDIN_NO_HOST_ACCESS=1  device addresses are PROT_NONE, as on a GPU: host code that
 *                         dereferences a CUdeviceptr gets SIGSEGV (copies still work)
 *   CUDA_STANDIN_NO_FABRIC=1  no fabric support: cuMemCreate with CU_MEM_HANDLE_TYPE_FABRIC
 *                         requested returns CUDA_ERROR_NOT_SUPPORTED (as on most machines)
 *   DEVSHARE_STANDIN_LOG  file that receives one line per violation
 */
#define CUSI_IMPLEMENTATION
#include "cuda_standin.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MAX_DEV 16
#define DEV_ALIGN ((uintptr_t)2 << 20) /* device allocations are 2 MiB aligned */
#define OPEN_SLOTS 128                 /* processes that may hold one handle open at once */
#define POISON 0xA5                    /* cuMemAlloc does not clear memory */
#define VMM_GRAN ((size_t)2 << 20)     /* VMM allocation granularity (minimum = recommended) */
#define VMM_ID_TAG 0xC051000000000000ull /* CUmemGenericAllocationHandle values: tag | number */

/* ==== Shared objects and handle bytes =============================================== */

/* Common header of every shared object; `rnd` is repeated in the handle, so a handle whose
 * name was reused by a later object does not match. */
struct shhdr {
    char magic[8];
    unsigned char rnd[16];
    int32_t pid;  /* exporter / creator */
    int32_t phys; /* physical device */
};

/* /cusi_h_<pid>_<n>: one per exported allocation, created on the first cuIpcGetMemHandle. */
struct meta {
    struct shhdr h;       /* magic "CUSIMETA" */
    uint64_t size;        /* allocation size in bytes */
    char data_name[48];   /* /cusi_m_<pid>_<n>: the data */
    /* pid of each process that holds the allocation open, 0 = free slot. The live-open count
     * is the number of slots naming a living process: a consumer that died without closing
     * no longer counts (the real driver tears its mappings down too). */
    _Atomic int32_t openers[OPEN_SLOTS];
};

/* /cusi_e_<pid>_<n>: one per interprocess event. */
struct evshm {
    struct shhdr h;       /* magic "CUSIEVSH" */
    _Atomic uint32_t records;
    _Atomic uint32_t waits;
};

/* The 64 handle bytes (CUipcMemHandle and CUipcEventHandle). */
struct wire {
    char magic[8];        /* "CUSIMEMH" / "CUSIEVTH" */
    char name[40];        /* NUL-terminated name of the shared object */
    unsigned char rnd[16];
};
_Static_assert(sizeof(struct wire) == 64, "handle layout");
_Static_assert(sizeof(CUipcMemHandle) == 64 && sizeof(CUipcEventHandle) == 64, "handle size");

/* ==== Process tables (all guarded by g_mu) ========================================== */

struct CUctx_st {
    int ordinal; /* this process's numbering */
    int phys;
    int refs;    /* primary-context retain count */
};

enum kind { K_ALLOC, K_POOL, K_IPC, K_VMM };

/* VMM: a physical allocation (cuMemCreate, or imported from a shareable handle). Its memory is
 * a memfd, or a named shm object when fabric export was requested (a fabric handle must find it
 * by name). The allocation lives while a handle reference or a mapping of it remains. */
struct vmm_alloc {
    struct vmm_alloc *next;
    CUmemGenericAllocationHandle id; /* the handle value */
    int refs;      /* handle references: create / import / retain +1, cuMemRelease -1 */
    int maps;      /* live mappings in this process */
    int fd;
    size_t size;
    int phys;      /* physical device the memory lives on */
    unsigned types;/* shareable types it can be exported as */
    int imported;  /* 0: cuMemCreate; else the handle type it was imported from */
    char name[40]; /* named (fabric-capable) memory: its shm name, else "" */
};

/* cuMemAddressReserve: PROT_NONE address space, plus a shadow of the same size where the
 * stand-in maps the same memory read-write for its own copies (the reservation itself stays
 * PROT_NONE until cuMemSetAccess, and always with CUDA_STANDIN_NO_HOST_ACCESS). */
struct vmm_resv {
    struct vmm_resv *next;
    uintptr_t base;
    size_t size;
    unsigned char *shadow;
    int maps;
};

struct region {
    struct region *next;
    enum kind kind;      /* cuMemAlloc / cuMemAllocAsync / cuIpcOpenMemHandle */
    uintptr_t base;      /* the CUdeviceptr */
    unsigned char *host; /* where the stand-in copies (== base unless NO_HOST_ACCESS) */
    size_t size, maplen;
    int phys;            /* physical device the memory lives on */
    CUcontext ctx;       /* context it was allocated / opened in */
    char name[48];       /* K_ALLOC: data shm name */
    int fetches;         /* K_ALLOC: cuIpcGetMemHandle calls */
    struct meta *meta;   /* K_ALLOC once exported; K_IPC: the exporter's meta */
    struct wire handle;  /* K_ALLOC once exported; K_IPC: the handle it was opened from */
    int slot;            /* K_IPC: our entry in meta->openers */
    struct vmm_alloc *va;  /* K_VMM: the allocation mapped here (one region per cuMemMap) */
    struct vmm_resv *resv; /* K_VMM: the reservation it is in */
    unsigned char access[MAX_DEV]; /* K_VMM: CUmemAccess_flags per physical device */
};

struct CUstream_st {
    struct CUstream_st *next;
    CUcontext ctx;
};

struct CUevent_st {
    struct CUevent_st *next;
    CUcontext ctx;
    unsigned flags;
    int opened;          /* from cuIpcOpenEventHandle */
    int waited;          /* opened event: waited on at least once */
    struct evshm *sh;    /* interprocess events only */
    struct wire handle;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_inited;       /* cuInit succeeded in this process */
static int g_forked;       /* this process is a fork() child of an initialised process */
static int g_protect;      /* CUDA_STANDIN_NO_HOST_ACCESS */
static int g_nphys, g_nvis, g_vis[MAX_DEV];
static struct CUctx_st g_ctx[MAX_DEV];
static struct region *g_regions;
static struct CUstream_st *g_streams;
static struct CUevent_st *g_events;
static struct vmm_alloc *g_vmm_allocs;
static struct vmm_resv *g_vmm_resvs;
static unsigned long long g_vmm_seq;
static int g_no_fabric;    /* CUDA_STANDIN_NO_FABRIC */
static unsigned g_seq;
static atomic_int g_violations;
/* Test hooks (cusi_set_delay): milliseconds some calls sleep before they act, outside g_mu. */
enum { DELAY_OPEN, DELAY_CLOSE, DELAY_SYNC, DELAY_RECORD, DELAY_COUNT };
static atomic_uint g_delay_ms[DELAY_COUNT];
static _Thread_local CUcontext t_cur; /* the current context is per thread */

/* ==== Reporting ===================================================================== */

/* Records one violation and returns `code`, so checks read `return viol(CODE, ...)`. */
__attribute__((format(printf, 2, 3)))
static CUresult viol(CUresult code, const char *fmt, ...) {
    char line[600];
    int n = snprintf(line, sizeof line, "cuda pid=%d: ", (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = strlen(line);
    line[len++] = '\n';
    atomic_fetch_add(&g_violations, 1);
    const char *log = getenv("DEVSHARE_STANDIN_LOG");
    if (log && *log) {
        int fd = open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
        if (fd >= 0) {
            ssize_t w = write(fd, line, len); /* one write: lines of processes never mix */
            (void)w;
            close(fd);
        }
    }
    char err[640];
    int m = snprintf(err, sizeof err, "[cuda stand-in] %.*s", (int)len, line);
    ssize_t w = write(2, err, (size_t)m < sizeof err ? (size_t)m : sizeof err - 1);
    (void)w;
    return code;
}

/* Sleep the delay set for `which` (none by default); the caller holds no lock. */
static void delay(int which) {
    unsigned ms = atomic_load(&g_delay_ms[which]);
    if (!ms) return;
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static CUresult done(CUresult r) {
    pthread_mutex_unlock(&g_mu);
    return r;
}

/* Rules every call obeys; caller holds g_mu. */
static CUresult check(const char *fn, int need_ctx) {
    /* The driver does not survive fork(): a child of an initialised process cannot use it. */
    if (g_forked)
        return viol(CUDA_ERROR_NOT_INITIALIZED, "%s: CUDA used in a child fork()ed after cuInit "
                    "in the parent (the driver does not survive fork; exec, or fork first)", fn);
    /* Nothing but cuDriverGetVersion works before cuInit. */
    if (!g_inited) return viol(CUDA_ERROR_NOT_INITIALIZED, "%s: called before cuInit", fn);
    if (need_ctx) {
        /* Memory, IPC, stream, event and sync calls act on the calling thread's context. */
        if (!t_cur)
            return viol(CUDA_ERROR_INVALID_CONTEXT,
                        "%s: no current context on this thread (cuCtxSetCurrent)", fn);
        /* A primary context released to 0 is destroyed; its handle is dead until retained. */
        if (t_cur->refs <= 0)
            return viol(CUDA_ERROR_INVALID_CONTEXT, "%s: the current context is a primary "
                        "context released to refcount 0 (destroyed)", fn);
    }
    return CUDA_SUCCESS;
}

/* Locks and applies check(); on failure unlocks and returns its code. */
#define ENTER(need_ctx)                                                    \
    do {                                                                   \
        pthread_mutex_lock(&g_mu);                                         \
        CUresult e_ = check(__func__, (need_ctx));                         \
        if (e_ != CUDA_SUCCESS)                                            \
            return done(e_);                                               \
    } while (0)

/* A required out-pointer is NULL: CUDA_ERROR_INVALID_VALUE. */
#define NEED(ptr)                                                                          \
    do {                                                                                   \
        if (!(ptr)) return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: " #ptr " is NULL", __func__)); \
    } while (0)

/* ==== Helpers: shared memory, mappings, lookups ===================================== */

/* Puts x at the front of the singly linked list `head`; removes x from it. */
#define PUSH(head, x) ((x)->next = (head), (head) = (x))
#define UNLINK(type, head, x)                                           \
    for (type **pp_ = &(head); *pp_; pp_ = &(*pp_)->next)               \
        if (*pp_ == (x)) { *pp_ = (x)->next; break; }

static size_t page_round(size_t n) {
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    return (n + pg - 1) / pg * pg;
}

/* Creates a fresh shm object /cusi_<tag>_<pid>_<n> (0600) of `size` bytes, committed up front
 * (a device allocation either succeeds or fails now, never SIGBUS later); returns its fd. */
static int shm_create(char *name, size_t cap, const char *tag, size_t size) {
    for (int tries = 0; tries < 100; tries++) {
        snprintf(name, cap, "/cusi_%s_%d_%u", tag, (int)getpid(), ++g_seq);
        int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd < 0 && errno == EEXIST)
            continue; /* stale object of an earlier process with our pid */
        if (fd < 0) return -1;
        if (ftruncate(fd, (off_t)size) == 0 && posix_fallocate(fd, 0, (off_t)size) == 0) return fd;
        close(fd);
        shm_unlink(name);
        return -1;
    }
    return -1;
}

/* Maps `len` bytes of fd at a DEV_ALIGN-aligned address with protection `prot`. */
static void *map_aligned(int fd, size_t len, int prot) {
    size_t span = len + DEV_ALIGN;
    char *raw = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) return NULL;
    char *a = (char *)(((uintptr_t)raw + DEV_ALIGN - 1) & ~(DEV_ALIGN - 1));
    if (mmap(a, len, prot, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
        munmap(raw, span);
        return NULL;
    }
    if (a > raw) munmap(raw, (size_t)(a - raw));
    if (raw + span > a + len) munmap(a + len, (size_t)(raw + span - (a + len)));
    return a;
}

/* Gives region r its device address (and the stand-in's own view of the bytes). */
static int map_region(struct region *r, int fd, size_t size) {
    size_t len = page_round(size);
    void *dev = map_aligned(fd, len, g_protect ? PROT_NONE : PROT_READ | PROT_WRITE);
    if (!dev) return -1;
    void *host = dev;
    if (g_protect) {
        host = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (host == MAP_FAILED) {
            munmap(dev, len);
            return -1;
        }
    }
    r->base = (uintptr_t)dev;
    r->host = host;
    r->size = size;
    r->maplen = len;
    return 0;
}

static void unmap_region(struct region *r) {
    munmap((void *)r->base, r->maplen);
    if ((uintptr_t)r->host != r->base) munmap(r->host, r->maplen);
}

/* Opens an existing shared object and checks its header against the handle. */
static void *open_shared(const struct wire *w, size_t size, const char *magic) {
    int fd = shm_open(w->name, O_RDWR | O_CLOEXEC, 0);
    if (fd < 0) return NULL;
    struct stat st;
    void *p = NULL;
    if (fstat(fd, &st) == 0 && (size_t)st.st_size >= size) {
        p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) p = NULL;
    }
    close(fd);
    if (p) {
        const struct shhdr *h = p;
        if (memcmp(h->magic, magic, 8) || memcmp(h->rnd, w->rnd, 16)) {
            munmap(p, size);
            p = NULL;
        }
    }
    return p;
}

/* Handle bytes -> wire, or -1 if they were not made by this stand-in. */
static int wire_parse(const char raw[64], const char *magic, const char *prefix, struct wire *w) {
    memcpy(w, raw, sizeof *w);
    if (memcmp(w->magic, magic, 8) || !memchr(w->name, 0, sizeof w->name)) return -1;
    return strncmp(w->name, prefix, strlen(prefix)) ? -1 : 0;
}

static void wire_make(struct wire *w, const char *magic, const char *name, const struct shhdr *h) {
    memset(w, 0, sizeof *w);
    memcpy(w->magic, magic, 8);
    snprintf(w->name, sizeof w->name, "%s", name);
    memcpy(w->rnd, h->rnd, 16);
}

static void fill_random(unsigned char *p, size_t n) {
    if (getrandom(p, n, 0) != (ssize_t)n)
        for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(rand() ^ getpid() ^ (int)i);
}

/* Creates a shared object /cusi_<tag>_<pid>_<n> of `size` bytes with its header filled in and
 * the handle `w` naming it; NULL if it cannot be created. */
static void *shared_create(const char *tag, size_t size, const char *magic, const char *wmagic,
                           struct wire *w) {
    char name[40];
    int fd = shm_create(name, sizeof name, tag, size);
    if (fd < 0) return NULL;
    struct shhdr *h = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (h == MAP_FAILED) {
        shm_unlink(name);
        return NULL;
    }
    memcpy(h->magic, magic, 8);
    fill_random(h->rnd, sizeof h->rnd);
    h->pid = (int32_t)getpid();
    h->phys = t_cur->phys;
    wire_make(w, wmagic, name, h);
    return h;
}

/* A process counts as alive unless it is gone or a zombie. */
static int pid_alive(int pid) {
    if (kill(pid, 0) != 0 && errno == ESRCH) return 0;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 1;
    buf[n] = 0;
    const char *s = strrchr(buf, ')');
    return !(s && s[1] == ' ' && (s[2] == 'Z' || s[2] == 'X'));
}

/* Live opens of an exported allocation over all processes; dead openers' slots are freed. */
static int live_opens(struct meta *m) {
    int n = 0;
    for (int i = 0; i < OPEN_SLOTS; i++) {
        int32_t pid = atomic_load(&m->openers[i]);
        if (!pid) continue;
        if (pid_alive(pid)) n++;
        else atomic_compare_exchange_strong(&m->openers[i], &pid, 0);
    }
    return n;
}

/* The region (allocation or IPC mapping) containing p. */
static struct region *find_region(CUdeviceptr p) {
    for (struct region *r = g_regions; r; r = r->next)
        if (p >= r->base && p - r->base < r->size) return r;
    return NULL;
}

static int ordinal_of(int phys) {
    for (int i = 0; i < g_nvis; i++)
        if (g_vis[i] == phys) return i;
    return -1;
}

/* A VMM range may span adjacent mappings of one reservation (the addresses are contiguous);
 * each must grant the current device access: read for a source, read-write for a
 * destination. On a GPU a missing cuMemSetAccess faults the access. */
static CUresult vmm_range(const char *fn, const char *what, struct region *r, CUdeviceptr p,
                          size_t n, unsigned char **out) {
    struct vmm_resv *v = r->resv;
    int write = !strcmp(what, "destination");
    if (n > v->base + v->size - p)
        return viol(CUDA_ERROR_INVALID_VALUE, "%s: %s range [0x%llx, +%zu) is out of bounds of "
                    "its VMM reservation", fn, what, p, n);
    for (CUdeviceptr cur = p; cur < p + n;) {
        struct region *m = find_region(cur);
        if (!m || m->kind != K_VMM || m->resv != v)
            return viol(CUDA_ERROR_INVALID_VALUE, "%s: %s range [0x%llx, +%zu) is out of bounds "
                        "(0x%llx is reserved but not mapped)", fn, what, p, n, cur);
        int acc = m->access[t_cur->phys];
        if (acc != CU_MEM_ACCESS_FLAGS_PROT_READWRITE &&
            (write || acc != CU_MEM_ACCESS_FLAGS_PROT_READ))
            return viol(CUDA_ERROR_ILLEGAL_ADDRESS, "%s: %s range [0x%llx, +%zu) is mapped but "
                        "device %d has no %s access: cuMemSetAccess after cuMemMap", fn, what, p,
                        n, t_cur->ordinal, write ? "read-write" : "read");
        cur = m->base + m->size;
    }
    *out = v->shadow + (p - v->base);
    return CUDA_SUCCESS;
}

/* Device range [p, p+n) must lie inside one allocation or live mapping (VMM: see vmm_range);
 * on success *out is the stand-in's view of p, else the violation is recorded. */
static CUresult dev_range(const char *fn, const char *what, CUdeviceptr p, size_t n,
                          unsigned char **out) {
    struct region *r = find_region(p);
    if (r && r->kind == K_VMM) return vmm_range(fn, what, r, p, n, out);
    if (!r || n > r->base + r->size - p)
        return viol(CUDA_ERROR_INVALID_VALUE, "%s: %s range [0x%llx, +%zu) is out of bounds of "
                    "every allocation and IPC mapping", fn, what, p, n);
    *out = r->host + (p - r->base);
    return CUDA_SUCCESS;
}

/* Host range of a copy must be host memory: on a GPU a device address is not a host buffer. */
static CUresult host_range(const char *fn, const void *h, size_t n) {
    uintptr_t a = (uintptr_t)h;
    if (!h) return viol(CUDA_ERROR_INVALID_VALUE, "%s: host pointer is NULL", fn);
    for (struct region *r = g_regions; r; r = r->next)
        if (a < r->base + r->maplen && r->base < a + n)
            return viol(CUDA_ERROR_INVALID_VALUE, "%s: host pointer %p is device memory (use "
                        "cuMemcpyDtoD)", fn, h);
    for (struct vmm_resv *v = g_vmm_resvs; v; v = v->next)
        if (a < v->base + v->size && v->base < a + n)
            return viol(CUDA_ERROR_INVALID_VALUE, "%s: host pointer %p is in a VMM reservation "
                        "(device address space)", fn, h);
    return CUDA_SUCCESS;
}

/* Streams: NULL, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD name the current context's default
 * stream; any other handle must be a live stream of this process. */
static CUresult stream_check(const char *fn, CUstream s, CUcontext *ctx) {
    CUcontext c = t_cur;
    int ok = s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD;
    for (struct CUstream_st *x = g_streams; x && !ok; x = x->next)
        if (x == s) ok = 1, c = x->ctx;
    if (ctx) *ctx = c;
    if (ok) return CUDA_SUCCESS;
    return viol(CUDA_ERROR_INVALID_HANDLE, "%s: unknown or destroyed stream %p", fn, (void *)s);
}

static CUresult event_check(const char *fn, CUevent e) {
    for (struct CUevent_st *x = g_events; x; x = x->next)
        if (x == e) return CUDA_SUCCESS;
    return viol(CUDA_ERROR_INVALID_HANDLE, "%s: unknown or destroyed event %p", fn, (void *)e);
}

/* ==== Initialisation, devices, errors =============================================== */

/* CUDA_STANDIN_DEVICES physical devices; CUDA_STANDIN_VISIBLE lists the visible ones in
 * ordinal order. As with CUDA_VISIBLE_DEVICES, the list ends at the first invalid entry. */
static void parse_devices(void) {
    const char *d = getenv("CUDA_STANDIN_DEVICES");
    char *end;
    long n = d ? strtol(d, &end, 10) : 2;
    g_nphys = (d && (*end || n < 0 || n > MAX_DEV)) ? 2 : (int)n;
    const char *v = getenv("CUDA_STANDIN_VISIBLE");
    g_nvis = 0;
    if (!v) {
        for (int i = 0; i < g_nphys; i++) g_vis[g_nvis++] = i;
        return;
    }
    while (*v && g_nvis < MAX_DEV) {
        long p = strtol(v, &end, 10);
        if (end == v || (*end && *end != ',') || p < 0 || p >= g_nphys || ordinal_of((int)p) >= 0)
            break;
        g_vis[g_nvis++] = (int)p;
        v = *end ? end + 1 : end;
    }
}

CUresult cuInit(unsigned int flags) {
    pthread_mutex_lock(&g_mu);
    if (g_forked) return done(check(__func__, 0));
    if (flags != 0) /* "Flags: Initialization flag for CUDA. Currently must be 0." */
        return done(viol(CUDA_ERROR_INVALID_VALUE, "cuInit: flags must be 0, got %u", flags));
    if (!g_inited) {
        parse_devices();
        if (g_nvis == 0)
            return done(CUDA_ERROR_NO_DEVICE); /* error only */
        const char *p = getenv("CUDA_STANDIN_NO_HOST_ACCESS");
        g_protect = p && *p && strcmp(p, "0") != 0;
        const char *nf = getenv("CUDA_STANDIN_NO_FABRIC");
        g_no_fabric = nf && *nf && strcmp(nf, "0") != 0;
        for (int i = 0; i < g_nvis; i++)
            g_ctx[i] = (struct CUctx_st){.ordinal = i, .phys = g_vis[i], .refs = 0};
        g_inited = 1;
    }
    return done(CUDA_SUCCESS);
}

CUresult cuDriverGetVersion(int *driverVersion) {
    if (!driverVersion)
        return viol(CUDA_ERROR_INVALID_VALUE, "cuDriverGetVersion: driverVersion is NULL");
    *driverVersion = 12040;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    ENTER(0);
    NEED(count);
    *count = g_nvis;
    return done(CUDA_SUCCESS);
}

/* Bad ordinals are error only: probing for a device is legitimate. */
#define DEVICE_OK(dev) \
    do { if ((dev) < 0 || (dev) >= g_nvis) return done(CUDA_ERROR_INVALID_DEVICE); } while (0)

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    ENTER(0);
    NEED(device);
    DEVICE_OK(ordinal);
    *device = ordinal;
    return done(CUDA_SUCCESS);
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    ENTER(0);
    NEED(name);
    if (len <= 0) return done(viol(CUDA_ERROR_INVALID_VALUE, "cuDeviceGetName: len %d <= 0", len));
    DEVICE_OK(dev);
    snprintf(name, (size_t)len, "devshare stand-in GPU %d", g_vis[dev]);
    return done(CUDA_SUCCESS);
}

/* The UUID names the PHYSICAL device: the same card has the same UUID in every process,
 * whatever CUDA_STANDIN_VISIBLE says. */
CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) {
    ENTER(0);
    NEED(uuid);
    DEVICE_OK(dev);
    char tmp[17];
    memset(uuid->bytes, 0, sizeof uuid->bytes);
    snprintf(tmp, sizeof tmp, "SIGPU-%02d", g_vis[dev]);
    memcpy(uuid->bytes, tmp, strlen(tmp));
    return done(CUDA_SUCCESS);
}

static const struct {
    CUresult code;
    const char *name, *text;
} g_errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_ALREADY_MAPPED, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
    {CUDA_ERROR_NOT_MAPPED, "CUDA_ERROR_NOT_MAPPED", "resource not mapped"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS",
     "an illegal memory access was encountered"},
    {CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
     "peer access has not been enabled"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
};

static CUresult error_text(CUresult error, const char **pStr, int name) {
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof g_errors / sizeof g_errors[0]; i++)
        if (g_errors[i].code == error) {
            *pStr = name ? g_errors[i].name : g_errors[i].text;
            return CUDA_SUCCESS;
        }
    *pStr = NULL; /* as the driver does for an unknown code */
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorName(CUresult error, const char **pStr) { return error_text(error, pStr, 1); }
CUresult cuGetErrorString(CUresult error, const char **pStr) { return error_text(error, pStr, 0); }

/* ==== Contexts ====================================================================== */

/* One primary context per device per process, refcounted. */
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    ENTER(0);
    NEED(pctx);
    DEVICE_OK(dev);
    g_ctx[dev].refs++;
    *pctx = &g_ctx[dev];
    return done(CUDA_SUCCESS);
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    ENTER(0);
    DEVICE_OK(dev);
    struct CUctx_st *c = &g_ctx[dev];
    /* Release must pair with a Retain. */
    if (c->refs <= 0)
        return done(viol(CUDA_ERROR_INVALID_CONTEXT, "%s: primary context of device %d "
                         "released more often than retained", __func__, dev));
    if (--c->refs == 0) {
        /* Dropping the last reference destroys the context and everything in it. */
        int mem = 0, streams = 0, events = 0;
        for (struct region *r = g_regions; r; r = r->next) mem += r->ctx == c && r->kind != K_VMM;
        for (struct CUstream_st *s = g_streams; s; s = s->next) streams += s->ctx == c;
        for (struct CUevent_st *e = g_events; e; e = e->next) events += e->ctx == c;
        if (mem + streams + events)
            viol(0, "%s: primary context of device %d released to 0 while %d allocations/IPC "
                 "mappings, %d streams and %d events of it are live (the driver destroys them)",
                 __func__, dev, mem, streams, events);
    }
    return done(CUDA_SUCCESS);
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    ENTER(0);
    if (ctx) {
        uintptr_t c = (uintptr_t)ctx, lo = (uintptr_t)&g_ctx[0], hi = (uintptr_t)&g_ctx[g_nvis];
        if (c < lo || c >= hi || (c - lo) % sizeof g_ctx[0])
            return done(viol(CUDA_ERROR_INVALID_CONTEXT, "%s: %p is not a context of this "
                             "process (cuDevicePrimaryCtxRetain)", __func__, (void *)ctx));
        /* A released (destroyed) primary context cannot be made current. */
        if (ctx->refs <= 0)
            return done(viol(CUDA_ERROR_INVALID_CONTEXT, "%s: primary context of device %d is "
                             "released (refcount 0): retain it first", __func__, ctx->ordinal));
    }
    t_cur = ctx;
    return done(CUDA_SUCCESS);
}

CUresult cuCtxGetCurrent(CUcontext *pctx) {
    ENTER(0);
    NEED(pctx);
    *pctx = t_cur;
    return done(CUDA_SUCCESS);
}

CUresult cuCtxGetDevice(CUdevice *device) {
    ENTER(1);
    NEED(device);
    *device = t_cur->ordinal;
    return done(CUDA_SUCCESS);
}

CUresult cuCtxSynchronize(void) {
    delay(DELAY_SYNC);
    ENTER(1);
    return done(CUDA_SUCCESS); /* everything is synchronous here */
}

/* ==== Memory ======================================================================== */

/* A new allocation in the current context: its own shm object (cuMemAlloc) or an anonymous
 * memfd (pool memory, never shareable by name). Contents start as garbage, not zero. */
static CUresult new_region(int pool, size_t size, CUdeviceptr *out) {
    struct region *r = calloc(1, sizeof *r);
    if (!r) return CUDA_ERROR_OUT_OF_MEMORY;
    size_t len = page_round(size);
    int fd;
    if (pool) {
        fd = memfd_create("cusi_pool", MFD_CLOEXEC);
        if (fd >= 0 && (ftruncate(fd, (off_t)len) || posix_fallocate(fd, 0, (off_t)len))) {
            close(fd);
            fd = -1;
        }
    } else {
        fd = shm_create(r->name, sizeof r->name, "m", len);
    }
    if (fd < 0 || map_region(r, fd, size) != 0) {
        if (fd >= 0) close(fd);
        if (!pool && fd >= 0) shm_unlink(r->name);
        free(r);
        return CUDA_ERROR_OUT_OF_MEMORY; /* error only */
    }
    close(fd);
    memset(r->host, POISON, size);
    r->kind = pool ? K_POOL : K_ALLOC;
    r->phys = t_cur->phys;
    r->ctx = t_cur;
    PUSH(g_regions, r);
    *out = r->base;
    return CUDA_SUCCESS;
}

static void unlink_region(struct region *r) { UNLINK(struct region, g_regions, r); }

/* Frees a local allocation, as the driver does even when other processes still have it open;
 * returns how many opens were live. */
static int release_region(struct region *r) {
    int live = 0;
    if (r->meta) {
        live = live_opens(r->meta);
        shm_unlink(r->handle.name);
        munmap(r->meta, sizeof *r->meta);
    }
    if (r->kind == K_ALLOC) shm_unlink(r->name);
    unmap_region(r);
    unlink_region(r);
    free(r);
    return live;
}

/* The exporter must not free while importers still map it ("Calling cuMemFree on an exported
 * memory region before calling cuIpcCloseMemHandle in the importing context will result in
 * undefined behavior"; spec section 4: keep it alive until every consumer released it). */
static void free_region(const char *fn, struct region *r) {
    int n = release_region(r);
    if (n > 0) viol(0, "%s: cuMemFree while %d IPC opens are live", fn, n);
}

/* The allocation whose base is p, or NULL after recording why p cannot be freed. */
static struct region *freeable(const char *fn, CUdeviceptr p) {
    struct region *r = find_region(p);
    if (r && r->kind != K_IPC && r->kind != K_VMM && r->base == p) return r;
    if (!r) viol(0, "%s: 0x%llx is not a live allocation (double free, or never allocated)", fn, p);
    else if (r->kind == K_VMM)
        viol(0, "%s: 0x%llx is VMM-mapped memory: cuMemUnmap, cuMemRelease, cuMemAddressFree",
             fn, p);
    else if (r->kind == K_IPC)
        viol(0, "%s: 0x%llx is an IPC mapping: release it with cuIpcCloseMemHandle", fn, p);
    else
        viol(0, "%s: 0x%llx is inside an allocation, not its base 0x%llx", fn, p,
             (CUdeviceptr)r->base);
    return NULL;
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    ENTER(1);
    NEED(dptr);
    if (bytesize == 0) /* "If bytesize is 0, cuMemAlloc() returns CUDA_ERROR_INVALID_VALUE" */
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: bytesize is 0", __func__));
    return done(new_region(0, bytesize, dptr));
}

/* Frees cuMemAlloc memory, and (as documented) stream-ordered memory too. */
CUresult cuMemFree_v2(CUdeviceptr dptr) {
    ENTER(1);
    struct region *r = freeable(__func__, dptr);
    if (!r) return done(CUDA_ERROR_INVALID_VALUE);
    free_region(__func__, r);
    return done(CUDA_SUCCESS);
}

/* Stream-ordered (pool) memory: ordinary data memory, but not legacy-IPC capable. */
CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    ENTER(1);
    CUresult r = stream_check(__func__, hStream, NULL);
    if (r) return done(r);
    NEED(dptr);
    if (bytesize == 0) return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: bytesize is 0", __func__));
    return done(new_region(1, bytesize, dptr));
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    ENTER(1);
    CUresult rc = stream_check(__func__, hStream, NULL);
    if (rc) return done(rc);
    struct region *r = freeable(__func__, dptr);
    if (!r) return done(CUDA_ERROR_INVALID_VALUE);
    free_region(__func__, r);
    return done(CUDA_SUCCESS);
}

/* Any interior pointer of an allocation or IPC mapping -> its base and size. Both outputs are
 * optional. Unknown pointers are error only (probing is legitimate). */
CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr) {
    ENTER(1);
    struct region *r = find_region(dptr);
    if (!r) return done(CUDA_ERROR_NOT_FOUND);
    if (pbase) *pbase = r->base;
    if (psize) *psize = r->size;
    return done(CUDA_SUCCESS);
}

CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr) {
    ENTER(1);
    NEED(data);
    struct region *r = find_region(ptr);
    if (!r)
        return done(CUDA_ERROR_INVALID_VALUE); /* error only: not device memory */
    switch (attribute) {
    case CU_POINTER_ATTRIBUTE_CONTEXT:
        *(CUcontext *)data = r->ctx;
        break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: {
        /* The device the memory lives on, in this process's numbering; an IPC mapping of a
         * device this process cannot see reports the device it was opened on. */
        int o = ordinal_of(r->phys);
        *(int *)data = o >= 0 ? o : r->ctx->ordinal;
        break;
    }
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
        /* Only cuMemAlloc memory can be exported with cuIpcGetMemHandle. */
        *(int *)data = r->kind == K_ALLOC;
        break;
    default:
        return done(CUDA_ERROR_INVALID_VALUE); /* error only: attribute not modelled */
    }
    return done(CUDA_SUCCESS);
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount) {
    ENTER(1);
    if (ByteCount == 0) return done(CUDA_SUCCESS);
    if (host_range(__func__, srcHost, ByteCount)) return done(CUDA_ERROR_INVALID_VALUE);
    unsigned char *d = NULL;
    CUresult rc = dev_range(__func__, "destination", dstDevice, ByteCount, &d);
    if (rc) return done(rc);
    memcpy(d, srcHost, ByteCount);
    return done(CUDA_SUCCESS);
}

CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
    ENTER(1);
    if (ByteCount == 0) return done(CUDA_SUCCESS);
    if (host_range(__func__, dstHost, ByteCount)) return done(CUDA_ERROR_INVALID_VALUE);
    unsigned char *s = NULL;
    CUresult rc = dev_range(__func__, "source", srcDevice, ByteCount, &s);
    if (rc) return done(rc);
    memcpy(dstHost, s, ByteCount);
    return done(CUDA_SUCCESS);
}

/* Page-locked host ranges (cuMemHostRegister): the driver refuses an overlap with a range
 * already registered, and an unregister of anything but a registered range's start. */
struct pinned {
    struct pinned *next;
    uintptr_t base;
    size_t size;
    unsigned flags; /* CU_MEMHOSTREGISTER_* */
};
static struct pinned *g_pinned;

CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags) {
    ENTER(1);
    if (bytesize == 0) return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: bytesize is 0", __func__));
    if (Flags & ~0xfu) return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: unknown flags %#x", __func__, Flags));
    if (host_range(__func__, p, bytesize)) return done(CUDA_ERROR_INVALID_VALUE);
    const uintptr_t a = (uintptr_t)p;
    for (struct pinned *r = g_pinned; r; r = r->next)
        if (a < r->base + r->size && r->base < a + bytesize)
            return done(viol(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
                             "%s: %p..+%zu overlaps a registered range", __func__, p, bytesize));
    struct pinned *r = calloc(1, sizeof *r);
    if (!r) return done(CUDA_ERROR_OUT_OF_MEMORY);
    r->base = a;
    r->size = bytesize;
    r->flags = Flags;
    r->next = g_pinned;
    g_pinned = r;
    return done(CUDA_SUCCESS);
}

CUresult cuMemHostUnregister(void *p) {
    ENTER(1);
    for (struct pinned **pp = &g_pinned; *pp; pp = &(*pp)->next) {
        if ((*pp)->base == (uintptr_t)p) {
            struct pinned *r = *pp;
            *pp = r->next;
            free(r);
            return done(CUDA_SUCCESS);
        }
    }
    return done(viol(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "%s: %p is not the start of a registered range",
                     __func__, p));
}

/* The device address of registered host memory: only a range registered with
 * CU_MEMHOSTREGISTER_DEVICEMAP has one, and here (as under unified addressing) it is the host
 * address itself. */
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int Flags) {
    ENTER(1);
    NEED(pdptr);
    if (Flags != 0) return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: Flags must be 0, got %#x", __func__, Flags));
    for (struct pinned *r = g_pinned; r; r = r->next) {
        if ((uintptr_t)p >= r->base && (uintptr_t)p < r->base + r->size) {
            if (!(r->flags & CU_MEMHOSTREGISTER_DEVICEMAP))
                return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: %p was registered without "
                                 "CU_MEMHOSTREGISTER_DEVICEMAP", __func__, p));
            *pdptr = (CUdeviceptr)(uintptr_t)p;
            return done(CUDA_SUCCESS);
        }
    }
    return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: %p is not in a registered host range", __func__, p));
}

CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount) {
    ENTER(1);
    if (ByteCount == 0) return done(CUDA_SUCCESS);
    unsigned char *d = NULL, *s = NULL;
    CUresult rc = dev_range(__func__, "destination", dstDevice, ByteCount, &d);
    if (!rc) rc = dev_range(__func__, "source", srcDevice, ByteCount, &s);
    if (rc) return done(rc);
    memmove(d, s, ByteCount);
    return done(CUDA_SUCCESS);
}

CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N) {
    ENTER(1);
    if (N == 0) return done(CUDA_SUCCESS);
    unsigned char *d = NULL;
    CUresult rc = dev_range(__func__, "destination", dstDevice, N, &d);
    if (rc) return done(rc);
    memset(d, uc, N);
    return done(CUDA_SUCCESS);
}

/* ==== Legacy IPC of memory ========================================================== */

CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr) {
    ENTER(1);
    NEED(pHandle);
    struct region *r = find_region(dptr);
    if (!r)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: 0x%llx is not device memory of this "
                         "process", __func__, dptr));
    /* Only cuMemAlloc memory is legacy-IPC capable (spec section 8). */
    if (r->kind == K_POOL)
        return done(viol(CUDA_ERROR_NOT_SUPPORTED, "%s: stream-ordered pool memory is not "
                         "legacy-IPC capable (check CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_"
                         "CAPABLE first)", __func__));
    if (r->kind == K_VMM)
        return done(viol(CUDA_ERROR_NOT_SUPPORTED, "%s: cuMemCreate (VMM) memory is not "
                         "legacy-IPC capable (use cuMemExportToShareableHandle)", __func__));
    if (r->kind == K_IPC)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: 0x%llx is an IPC-opened mapping; only "
                         "the exporting process can export it", __func__, dptr));
    /* The handle names a whole allocation: pass its base, send the offset separately. */
    if (r->base != dptr)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: 0x%llx is inside an allocation; "
                         "cuIpcGetMemHandle needs the allocation base (cuMemGetAddressRange)",
                         __func__, dptr));
    if (!r->meta) { /* first export: create the meta object the handle names */
        struct meta *m = shared_create("h", sizeof *m, "CUSIMETA", "CUSIMEMH", &r->handle);
        if (!m) return done(CUDA_ERROR_OUT_OF_MEMORY);
        m->h.phys = r->phys;
        m->size = r->size;
        snprintf(m->data_name, sizeof m->data_name, "%s", r->name);
        r->meta = m;
    }
    memcpy(pHandle->reserved, &r->handle, 64); /* same bytes every time, as the driver */
    /* Each call costs a driver round trip and tempts callers to open it twice: cache it. */
    if (++r->fetches > 1)
        viol(0, "%s: handle fetched more than once (cache it): %d calls for allocation 0x%llx",
             __func__, r->fetches, dptr);
    return done(CUDA_SUCCESS);
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags) {
    delay(DELAY_OPEN);
    ENTER(1);
    NEED(pdptr);
    if (Flags & ~(unsigned)CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: Flags 0x%x: only 0 and "
                         "CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS are valid", __func__, Flags));
    struct wire w;
    if (wire_parse(handle.reserved, "CUSIMEMH", "/cusi_h_", &w) != 0)
        return done(CUDA_ERROR_INVALID_HANDLE); /* error only: not a handle */
    struct meta *m = open_shared(&w, sizeof *m, "CUSIMETA");
    if (!m)
        return done(CUDA_ERROR_INVALID_HANDLE); /* error only: allocation freed / unknown */
    CUresult rc = CUDA_SUCCESS;
    int fd = -1;
    struct region *r = NULL;
    if (m->h.pid == (int32_t)getpid()) {
        /* Spec section 8: a handle cannot be opened in the process that exported it. */
        rc = viol(CUDA_ERROR_INVALID_CONTEXT, "%s: a handle cannot be opened in the process "
                  "that exported it (use the original pointer)", __func__);
        goto fail;
    }
    for (struct region *x = g_regions; x; x = x->next)
        if (x->kind == K_IPC && !strcmp(x->handle.name, w.name) &&
            !memcmp(x->handle.rnd, w.rnd, 16)) {
            /* Spec section 8: opening one handle twice fails on older drivers. */
            rc = viol(CUDA_ERROR_ALREADY_MAPPED, "%s: same handle opened twice in one process "
                      "(older drivers refuse; cache opens)", __func__);
            goto fail;
        }
    if (!pid_alive(m->h.pid)) {
        rc = CUDA_ERROR_INVALID_HANDLE; /* error only: the exporter is gone */
        goto fail;
    }
    if (m->h.phys != t_cur->phys && !(Flags & CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)) {
        rc = CUDA_ERROR_PEER_ACCESS_NOT_ENABLED; /* error only: another device, no peer flag */
        goto fail;
    }
    fd = shm_open(m->data_name, O_RDWR | O_CLOEXEC, 0);
    r = calloc(1, sizeof *r);
    if (fd < 0 || !r || map_region(r, fd, m->size) != 0) {
        rc = fd < 0 ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_OUT_OF_MEMORY;
        goto fail;
    }
    close(fd);
    fd = -1;
    r->slot = -1;
    for (int pass = 0; pass < 2 && r->slot < 0; pass++) {
        if (pass)
            live_opens(m); /* frees the slots of dead openers */
        for (int i = 0; i < OPEN_SLOTS && r->slot < 0; i++) {
            int32_t zero = 0;
            if (atomic_compare_exchange_strong(&m->openers[i], &zero, (int32_t)getpid()))
                r->slot = i;
        }
    }
    if (r->slot < 0) {
        unmap_region(r);
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        goto fail;
    }
    r->kind = K_IPC;
    r->phys = m->h.phys;
    r->ctx = t_cur;
    r->meta = m;
    r->handle = w;
    PUSH(g_regions, r);
    *pdptr = r->base;
    return done(CUDA_SUCCESS);
fail:
    if (fd >= 0) close(fd);
    free(r);
    munmap(m, sizeof *m);
    return done(rc);
}

/* Unmaps an IPC mapping and gives up this process's open. */
static void close_mapping(struct region *r) {
    int32_t me = (int32_t)getpid();
    atomic_compare_exchange_strong(&r->meta->openers[r->slot], &me, 0);
    munmap(r->meta, sizeof *r->meta);
    unmap_region(r);
    unlink_region(r);
    free(r);
}

CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) {
    delay(DELAY_CLOSE);
    ENTER(1);
    struct region *r = find_region(dptr);
    /* Must be a base returned by cuIpcOpenMemHandle and still open. */
    if (!r || r->kind != K_IPC || r->base != dptr)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: 0x%llx is not a base returned by "
                         "cuIpcOpenMemHandle that is still open%s", __func__, dptr,
                         !r ? " (closed twice?)" : r->kind != K_IPC ? " (local allocation)"
                                                                     : " (interior pointer)"));
    close_mapping(r);
    return done(CUDA_SUCCESS);
}

/* ==== Virtual memory management (VMM) =============================================== */
/*
 * cuMemCreate gives a physical allocation (a memfd, or a named shm object when fabric export
 * was requested) behind a CUmemGenericAllocationHandle; cuMemAddressReserve gives real PROT_NONE
 * address space; cuMemMap maps the memory MAP_FIXED over it, still PROT_NONE: as on a GPU the
 * range is inaccessible until cuMemSetAccess (then read-write, or read-only; never with
 * CUDA_STANDIN_NO_HOST_ACCESS). Handles and mappings are reference counted as the driver
 * documents: cuMemRelease of a mapped allocation is allowed, the memory lives until unmapped.
 * POSIX_FILE_DESCRIPTOR exports are real file descriptors (so pidfd_getfd works across
 * processes); a CUmemFabricHandle names the shm object.
 */

/* The 64 bytes of a CUmemFabricHandle made by the stand-in. */
struct fabric_wire {
    char magic[8]; /* "CUSIFABH" */
    char name[40]; /* "/cusi_f_<pid>_<n>_<phys>_<8 hex random>" */
    uint64_t size;
    int32_t phys;
    int32_t pid;   /* exporter */
};
_Static_assert(sizeof(struct fabric_wire) == sizeof(CUmemFabricHandle), "fabric handle layout");
_Static_assert(sizeof(CUmemAllocationProp) == 32 && sizeof(CUmemAccessDesc) == 12,
               "VMM struct layouts (x86-64)");

#define KNOWN_HANDLE_TYPES                                                                 \
    ((unsigned)(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_WIN32 |      \
                CU_MEM_HANDLE_TYPE_WIN32_KMT | CU_MEM_HANDLE_TYPE_FABRIC))
#define WIN32_TYPES ((unsigned)(CU_MEM_HANDLE_TYPE_WIN32 | CU_MEM_HANDLE_TYPE_WIN32_KMT))

/* A live handle value (at least one reference) of this process. */
static struct vmm_alloc *vmm_find(CUmemGenericAllocationHandle h) {
    for (struct vmm_alloc *a = g_vmm_allocs; a; a = a->next)
        if (a->id == h && a->refs > 0) return a;
    return NULL;
}

static struct vmm_resv *vmm_resv_of(CUdeviceptr p, size_t n) {
    for (struct vmm_resv *v = g_vmm_resvs; v; v = v->next)
        if (p >= v->base && p - v->base < v->size && n <= v->base + v->size - p) return v;
    return NULL;
}

/* The allocation is gone from this process once no handle reference and no mapping remain. */
static void vmm_maybe_destroy(struct vmm_alloc *a) {
    if (a->refs > 0 || a->maps > 0) return;
    close(a->fd);
    if (!a->imported && a->name[0]) shm_unlink(a->name); /* fabric handles stop resolving */
    UNLINK(struct vmm_alloc, g_vmm_allocs, a);
    free(a);
}

static struct vmm_alloc *vmm_new(int fd, size_t size, int phys) {
    struct vmm_alloc *a = calloc(1, sizeof *a);
    if (!a) return NULL;
    a->id = VMM_ID_TAG | ++g_vmm_seq;
    a->refs = 1;
    a->fd = fd;
    a->size = size;
    a->phys = phys;
    PUSH(g_vmm_allocs, a);
    return a;
}

/* Rules on CUmemAllocationProp (cuMemCreate, cuMemGetAllocationGranularity). */
static CUresult prop_check(const char *fn, const CUmemAllocationProp *prop) {
    if (!prop) return viol(CUDA_ERROR_INVALID_VALUE, "%s: prop is NULL", fn);
    if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED)
        return viol(CUDA_ERROR_INVALID_VALUE, "%s: prop->type %d, must be "
                    "CU_MEM_ALLOCATION_TYPE_PINNED", fn, (int)prop->type);
    if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return viol(CUDA_ERROR_INVALID_VALUE, "%s: prop->location.type %d: only "
                    "CU_MEM_LOCATION_TYPE_DEVICE is modelled", fn, (int)prop->location.type);
    if (prop->location.id < 0 || prop->location.id >= g_nvis)
        return CUDA_ERROR_INVALID_DEVICE; /* error only, like any probe of an ordinal */
    unsigned t = (unsigned)prop->requestedHandleTypes;
    if (t & ~KNOWN_HANDLE_TYPES)
        return viol(CUDA_ERROR_INVALID_VALUE, "%s: unknown requestedHandleTypes bits 0x%x", fn,
                    t & ~KNOWN_HANDLE_TYPES);
    if (t & WIN32_TYPES)
        return viol(CUDA_ERROR_NOT_SUPPORTED, "%s: Windows handle types requested (0x%x) on "
                    "Linux", fn, t & WIN32_TYPES);
    if (prop->win32HandleMetaData)
        return viol(CUDA_ERROR_INVALID_VALUE, "%s: win32HandleMetaData must be NULL unless a "
                    "Windows handle type is requested", fn);
    return CUDA_SUCCESS;
}

CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                       CUmemAllocationGranularity_flags option) {
    ENTER(1);
    NEED(granularity);
    CUresult rc = prop_check(__func__, prop);
    if (rc) return done(rc);
    if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: unknown option %d", __func__,
                         (int)option));
    *granularity = VMM_GRAN;
    return done(CUDA_SUCCESS);
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                     const CUmemAllocationProp *prop, unsigned long long flags) {
    ENTER(1);
    NEED(handle);
    CUresult rc = prop_check(__func__, prop);
    if (rc) return done(rc);
    if (flags != 0)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: flags must be 0, got 0x%llx", __func__,
                         flags));
    if (size == 0 || size % VMM_GRAN)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: size %zu is not a non-zero multiple of "
                         "the granularity %zu (cuMemGetAllocationGranularity)", __func__, size,
                         VMM_GRAN));
    unsigned types = (unsigned)prop->requestedHandleTypes;
    if ((types & CU_MEM_HANDLE_TYPE_FABRIC) && g_no_fabric)
        return done(CUDA_ERROR_NOT_SUPPORTED); /* error only: no fabric here; callers probe */
    int phys = g_vis[prop->location.id], fd = -1;
    char name[40] = "";
    if (types & CU_MEM_HANDLE_TYPE_FABRIC) {
        /* A fabric handle must find the memory from any process: a named object. */
        unsigned rnd = 0;
        fill_random((unsigned char *)&rnd, sizeof rnd);
        snprintf(name, sizeof name, "/cusi_f_%d_%u_%d_%08x", (int)getpid(), ++g_seq, phys, rnd);
        fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    } else {
        char mname[32];
        snprintf(mname, sizeof mname, "cusi_vmm_%d", phys); /* /memfd:cusi_vmm_<phys> */
        fd = memfd_create(mname, MFD_CLOEXEC);
    }
    void *p = MAP_FAILED;
    if (fd >= 0 && ftruncate(fd, (off_t)size) == 0 && posix_fallocate(fd, 0, (off_t)size) == 0)
        p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    struct vmm_alloc *a = p != MAP_FAILED ? vmm_new(fd, size, phys) : NULL;
    if (!a) {
        if (p != MAP_FAILED) munmap(p, size);
        if (fd >= 0) close(fd);
        if (name[0]) shm_unlink(name);
        return done(CUDA_ERROR_OUT_OF_MEMORY); /* error only */
    }
    memset(p, POISON, size); /* the driver does not clear memory */
    munmap(p, size);
    a->types = types;
    snprintf(a->name, sizeof a->name, "%s", name);
    *handle = a->id;
    return done(CUDA_SUCCESS);
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    ENTER(1);
    struct vmm_alloc *a = vmm_find(handle);
    if (!a)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: 0x%llx is not a live allocation handle "
                         "(released more often than created / imported / retained?)", __func__,
                         handle));
    a->refs--; /* mappings keep the memory alive (documented) */
    vmm_maybe_destroy(a);
    return done(CUDA_SUCCESS);
}

CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    ENTER(1);
    NEED(handle);
    struct region *r = find_region((CUdeviceptr)(uintptr_t)addr);
    if (!r || r->kind != K_VMM)
        return done(CUDA_ERROR_INVALID_VALUE); /* error only: not a mapped VMM address */
    r->va->refs++; /* pair it with a cuMemRelease */
    *handle = r->va->id;
    return done(CUDA_SUCCESS);
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
    ENTER(1);
    NEED(ptr);
    if (flags != 0)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: flags must be 0, got 0x%llx", __func__,
                         flags));
    if (size == 0 || size % VMM_GRAN)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: size %zu is not a non-zero multiple of "
                         "the granularity %zu", __func__, size, VMM_GRAN));
    if (alignment & (alignment - 1))
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: alignment %zu is not a power of two",
                         __func__, alignment));
    size_t align = alignment > VMM_GRAN ? alignment : VMM_GRAN;
    struct vmm_resv *v = calloc(1, sizeof *v);
    if (!v) return done(CUDA_ERROR_OUT_OF_MEMORY);
    char *a = MAP_FAILED;
    if (addr && addr % align == 0) { /* a hint: used when free, else ignored */
        a = mmap((void *)(uintptr_t)addr, size, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
        if (a != MAP_FAILED && (uintptr_t)a != addr) {
            munmap(a, size);
            a = MAP_FAILED;
        }
    }
    if (a == MAP_FAILED) {
        char *raw = mmap(NULL, size + align, PROT_NONE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (raw != MAP_FAILED) {
            a = (char *)(((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1));
            if (a > raw) munmap(raw, (size_t)(a - raw));
            if (raw + size + align > a + size)
                munmap(a + size, (size_t)(raw + size + align - (a + size)));
        }
    }
    void *shadow = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (a == MAP_FAILED || shadow == MAP_FAILED) {
        if (a != MAP_FAILED) munmap(a, size);
        if (shadow != MAP_FAILED) munmap(shadow, size);
        free(v);
        return done(CUDA_ERROR_OUT_OF_MEMORY); /* error only */
    }
    v->base = (uintptr_t)a;
    v->size = size;
    v->shadow = shadow;
    PUSH(g_vmm_resvs, v);
    *ptr = v->base;
    return done(CUDA_SUCCESS);
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    ENTER(1);
    struct vmm_resv *v = g_vmm_resvs;
    while (v && v->base != ptr) v = v->next;
    /* "The size must match what was given to memAddressReserve and the ptr given must match
     * what was returned from memAddressReserve." */
    if (!v)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: 0x%llx is not a reservation returned by "
                         "cuMemAddressReserve (freed twice?)", __func__, ptr));
    if (size != v->size)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: size %zu, the reservation at 0x%llx has "
                         "%zu", __func__, size, ptr, v->size));
    if (v->maps)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: %d mappings remain in the reservation at "
                         "0x%llx: cuMemUnmap them first", __func__, v->maps, ptr));
    munmap((void *)v->base, v->size);
    munmap(v->shadow, v->size);
    UNLINK(struct vmm_resv, g_vmm_resvs, v);
    free(v);
    return done(CUDA_SUCCESS);
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
    ENTER(1);
    if (flags != 0)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: flags must be 0, got 0x%llx", __func__,
                         flags));
    struct vmm_alloc *a = vmm_find(handle);
    if (!a)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: 0x%llx is not a live allocation handle "
                         "(released?)", __func__, handle));
    /* "ptr, size, and offset must be a multiple of the value given via
     * cuMemGetAllocationGranularity with the CU_MEM_ALLOC_GRANULARITY_MINIMUM flag" */
    if (size == 0 || ptr % VMM_GRAN || size % VMM_GRAN || offset % VMM_GRAN)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: ptr 0x%llx, size %zu and offset %zu must "
                         "be multiples of the granularity %zu", __func__, ptr, size, offset,
                         VMM_GRAN));
    if (offset > a->size || size > a->size - offset)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: offset %zu + size %zu exceed the "
                         "allocation's %zu bytes", __func__, offset, size, a->size));
    struct vmm_resv *v = vmm_resv_of(ptr, size);
    if (!v)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: [0x%llx, +%zu) is not inside one "
                         "reservation (cuMemAddressReserve)", __func__, ptr, size));
    for (struct region *r = g_regions; r; r = r->next)
        if (r->kind == K_VMM && r->base < ptr + size && ptr < r->base + r->size)
            return done(viol(CUDA_ERROR_ALREADY_MAPPED, "%s: [0x%llx, +%zu) overlaps the mapping "
                             "[0x%llx, +%zu) (double map; cuMemUnmap first)", __func__, ptr,
                             size, (CUdeviceptr)r->base, r->size));
    struct region *r = calloc(1, sizeof *r);
    unsigned char *host = v->shadow + (ptr - v->base);
    if (!r || mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd,
                   (off_t)offset) == MAP_FAILED) {
        free(r);
        return done(CUDA_ERROR_OUT_OF_MEMORY);
    }
    if (mmap(host, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, a->fd,
             (off_t)offset) == MAP_FAILED) {
        mmap((void *)(uintptr_t)ptr, size, PROT_NONE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
        free(r);
        return done(CUDA_ERROR_OUT_OF_MEMORY);
    }
    r->kind = K_VMM;
    r->base = ptr;
    r->host = host;
    r->size = r->maplen = size;
    r->phys = a->phys;
    r->ctx = t_cur;
    r->va = a;
    r->resv = v;
    a->maps++;
    v->maps++;
    PUSH(g_regions, r);
    return done(CUDA_SUCCESS);
}

/* Removes one VMM mapping: both views go back to reserved PROT_NONE address space. */
static void vmm_unmap_region(struct region *r) {
    int anon = MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE;
    mmap((void *)r->base, r->size, PROT_NONE, anon, -1, 0);
    mmap(r->host, r->size, PROT_NONE, anon, -1, 0);
    r->resv->maps--;
    r->va->maps--;
    struct vmm_alloc *a = r->va;
    unlink_region(r);
    free(r);
    vmm_maybe_destroy(a); /* released earlier: the last unmap frees the memory */
}

/* [ptr, ptr+size) must be made of whole VMM mappings of one reservation, back to back.
 * Returns the first mapping, or NULL after recording why not. */
static struct region *vmm_whole(const char *fn, CUdeviceptr ptr, size_t size) {
    struct region *first = find_region(ptr);
    if (!first || first->kind != K_VMM) {
        viol(CUDA_ERROR_INVALID_VALUE, "%s: nothing is mapped at 0x%llx (unmapped twice, or "
             "never cuMemMap'ped)", fn, ptr);
        return NULL;
    }
    if (size == 0 || first->base != ptr) {
        viol(CUDA_ERROR_INVALID_VALUE, "%s: [0x%llx, +%zu) is not the whole range of the mapping "
             "[0x%llx, +%zu) (a sub-range cannot be used)", fn, ptr, size,
             (CUdeviceptr)first->base, first->size);
        return NULL;
    }
    for (CUdeviceptr cur = ptr; cur < ptr + size;) {
        struct region *m = find_region(cur);
        if (!m || m->kind != K_VMM || m->base != cur || m->resv != first->resv ||
            m->size > ptr + size - cur) {
            viol(CUDA_ERROR_INVALID_VALUE, "%s: [0x%llx, +%zu) is not made of whole mappings "
                 "(at 0x%llx)", fn, ptr, size, cur);
            return NULL;
        }
        cur += m->size;
    }
    return first;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    ENTER(1);
    if (!vmm_whole(__func__, ptr, size)) return done(CUDA_ERROR_INVALID_VALUE);
    for (CUdeviceptr cur = ptr; cur < ptr + size;) {
        struct region *m = find_region(cur);
        cur += m->size;
        vmm_unmap_region(m);
    }
    return done(CUDA_SUCCESS);
}

/* The reservation's own protection follows the granted access (host code sees what the
 * devices may do); with CUDA_STANDIN_NO_HOST_ACCESS it stays PROT_NONE. */
static void vmm_protect(struct region *m) {
    int prot = PROT_NONE;
    for (int d = 0; d < MAX_DEV && !g_protect; d++) {
        if (m->access[d] == CU_MEM_ACCESS_FLAGS_PROT_READWRITE) prot = PROT_READ | PROT_WRITE;
        else if (m->access[d] == CU_MEM_ACCESS_FLAGS_PROT_READ && prot == PROT_NONE) prot = PROT_READ;
    }
    mprotect((void *)m->base, m->size, prot);
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    ENTER(1);
    if (!desc || count == 0)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: no access descriptors (desc %p, count "
                         "%zu)", __func__, (const void *)desc, count));
    for (size_t i = 0; i < count; i++) {
        const CUmemAccessDesc *d = &desc[i];
        if (d->location.type != CU_MEM_LOCATION_TYPE_DEVICE || d->location.id < 0 ||
            d->location.id >= g_nvis)
            return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: desc[%zu].location {type %d, id %d} "
                             "is not a visible device", __func__, i, (int)d->location.type,
                             d->location.id));
        if (d->flags != CU_MEM_ACCESS_FLAGS_PROT_NONE && d->flags != CU_MEM_ACCESS_FLAGS_PROT_READ &&
            d->flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: desc[%zu].flags %d unknown", __func__,
                             i, (int)d->flags));
    }
    /* "The range must be a fully mapped address range containing all allocations created by
     * cuMemMap / cuMemCreate." */
    if (!vmm_whole(__func__, ptr, size)) return done(CUDA_ERROR_INVALID_VALUE);
    for (CUdeviceptr cur = ptr; cur < ptr + size;) {
        struct region *m = find_region(cur);
        for (size_t i = 0; i < count; i++)
            m->access[g_vis[desc[i].location.id]] = (unsigned char)desc[i].flags;
        vmm_protect(m);
        cur += m->size;
    }
    return done(CUDA_SUCCESS);
}

CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                      CUmemAllocationHandleType handleType,
                                      unsigned long long flags) {
    ENTER(1);
    NEED(shareableHandle);
    struct vmm_alloc *a = vmm_find(handle);
    if (!a)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: 0x%llx is not a live allocation handle",
                         __func__, handle));
    if (flags != 0)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: flags must be 0, got 0x%llx", __func__,
                         flags));
    unsigned t = (unsigned)handleType;
    if (t & WIN32_TYPES)
        return done(viol(CUDA_ERROR_NOT_SUPPORTED, "%s: Windows handle type %u on Linux",
                         __func__, t));
    if (t != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR && t != CU_MEM_HANDLE_TYPE_FABRIC)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: handleType %u: export one of "
                         "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, CU_MEM_HANDLE_TYPE_FABRIC",
                         __func__, t));
    /* Only the types requested at creation (prop.requestedHandleTypes) can be exported. */
    if (!(a->types & t))
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: the allocation was %s without %s in "
                         "its handle types (prop.requestedHandleTypes)", __func__,
                         a->imported ? "imported" : "created",
                         t == CU_MEM_HANDLE_TYPE_FABRIC ? "CU_MEM_HANDLE_TYPE_FABRIC"
                                                        : "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"));
    if (t == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
        int fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 0); /* a new fd the caller owns and closes */
        if (fd < 0) return done(CUDA_ERROR_OUT_OF_MEMORY);
        *(int *)shareableHandle = fd;
    } else {
        struct fabric_wire w;
        memset(&w, 0, sizeof w);
        memcpy(w.magic, "CUSIFABH", 8);
        snprintf(w.name, sizeof w.name, "%s", a->name);
        w.size = a->size;
        w.phys = a->phys;
        w.pid = (int32_t)getpid();
        memcpy(shareableHandle, &w, sizeof w);
    }
    return done(CUDA_SUCCESS);
}

/* Identifies a stand-in memory fd from its /proc/self/fd link; 0 and *phys on success. */
static int vmm_fd_phys(int fd, int *phys, char *name, size_t cap) {
    char path[64], link[128];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(path, link, sizeof link - 1);
    if (n <= 0) return -1;
    link[n] = 0;
    int pid = 0;
    unsigned seq = 0;
    if (sscanf(link, "/memfd:cusi_vmm_%d", phys) == 1) return 0;
    if (sscanf(link, "/dev/shm/cusi_f_%d_%u_%d_", &pid, &seq, phys) == 3) {
        snprintf(name, cap, "%.*s", (int)strcspn(link + 8, " "), link + 8);
        return 0;
    }
    return -1;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                        CUmemAllocationHandleType shHandleType) {
    ENTER(1);
    NEED(handle);
    unsigned t = (unsigned)shHandleType;
    int fd = -1, phys = -1;
    size_t size = 0;
    char name[40] = "";
    if (t == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
        /* The fd travels in the pointer: (void *)(uintptr_t)fd. The driver keeps its own
         * reference; the caller may close its fd afterwards. */
        int in = (int)(intptr_t)osHandle;
        struct stat st;
        if (in < 0 || fcntl(in, F_GETFD) < 0)
            return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: %d is not an open file descriptor "
                             "(pass the fd itself as (void *)(uintptr_t)fd, valid in this "
                             "process: pidfd_getfd)", __func__, in));
        if (vmm_fd_phys(in, &phys, name, sizeof name) != 0 || fstat(in, &st) != 0 ||
            st.st_size <= 0 || (size_t)st.st_size % VMM_GRAN)
            return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: fd %d is not memory exported by "
                             "cuMemExportToShareableHandle", __func__, in));
        fd = fcntl(in, F_DUPFD_CLOEXEC, 0);
        size = (size_t)st.st_size;
    } else if (t == CU_MEM_HANDLE_TYPE_FABRIC) {
        if (!osHandle)
            return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: osHandle is NULL (pass a pointer "
                             "to the CUmemFabricHandle)", __func__));
        if (g_no_fabric) return done(CUDA_ERROR_NOT_SUPPORTED); /* error only */
        struct fabric_wire w;
        memcpy(&w, osHandle, sizeof w);
        if (memcmp(w.magic, "CUSIFABH", 8) || !memchr(w.name, 0, sizeof w.name) ||
            strncmp(w.name, "/cusi_f_", 8))
            return done(CUDA_ERROR_INVALID_HANDLE); /* error only: not a fabric handle */
        fd = shm_open(w.name, O_RDWR | O_CLOEXEC, 0);
        struct stat st;
        if (fd >= 0 && (fstat(fd, &st) != 0 || (uint64_t)st.st_size != w.size)) {
            close(fd);
            fd = -1;
        }
        if (fd < 0) return done(CUDA_ERROR_INVALID_HANDLE); /* error only: memory released */
        phys = w.phys;
        size = (size_t)w.size;
        snprintf(name, sizeof name, "%s", w.name);
    } else {
        return done(viol(t & WIN32_TYPES ? CUDA_ERROR_NOT_SUPPORTED : CUDA_ERROR_INVALID_VALUE,
                         "%s: shHandleType %u: import CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR "
                         "or CU_MEM_HANDLE_TYPE_FABRIC", __func__, t));
    }
    struct vmm_alloc *a = fd >= 0 ? vmm_new(fd, size, phys) : NULL;
    if (!a) {
        if (fd >= 0) close(fd);
        return done(CUDA_ERROR_OUT_OF_MEMORY);
    }
    a->imported = (int)t;
    a->types = t; /* re-exportable as what it was imported from */
    snprintf(a->name, sizeof a->name, "%s", name);
    *handle = a->id;
    return done(CUDA_SUCCESS);
}

/* ==== Streams ======================================================================= */

CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags) {
    ENTER(1);
    NEED(phStream);
    if (Flags & ~(unsigned)CU_STREAM_NON_BLOCKING)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: Flags 0x%x: only CU_STREAM_DEFAULT and "
                         "CU_STREAM_NON_BLOCKING are valid", __func__, Flags));
    struct CUstream_st *s = calloc(1, sizeof *s);
    if (!s) return done(CUDA_ERROR_OUT_OF_MEMORY);
    s->ctx = t_cur;
    PUSH(g_streams, s);
    *phStream = s;
    return done(CUDA_SUCCESS);
}

CUresult cuStreamDestroy_v2(CUstream hStream) {
    ENTER(1);
    for (struct CUstream_st *x = g_streams; x; x = x->next)
        if (x == hStream) {
            UNLINK(struct CUstream_st, g_streams, x);
            free(x);
            return done(CUDA_SUCCESS);
        }
    return done(viol(CUDA_ERROR_INVALID_HANDLE, "%s: unknown or destroyed stream %p (only "
                     "streams from cuStreamCreate are destroyed)", __func__, (void *)hStream));
}

CUresult cuStreamSynchronize(CUstream hStream) {
    ENTER(1);
    return done(stream_check(__func__, hStream, NULL));
}

/* The waits counter is how a test sees that a consumer made its stream wait (spec section 5). */
static void note_wait(struct CUevent_st *e) {
    if (e->opened) {
        atomic_fetch_add(&e->sh->waits, 1);
        e->waited = 1;
    }
}

CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags) {
    ENTER(1);
    CUresult rc = stream_check(__func__, hStream, NULL);
    if (!rc) rc = event_check(__func__, hEvent);
    if (rc) return done(rc);
    if (Flags != 0) /* CU_EVENT_WAIT_DEFAULT; other flags are for graph capture */
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: Flags must be 0, got 0x%x", __func__,
                         Flags));
    note_wait(hEvent);
    return done(CUDA_SUCCESS);
}

/* ==== Stream memory operations and asynchronous copies ============================== */
/* Every stream's work is complete when the call that queued it returns (as everywhere in this
 * stand-in), so these act at once, in call order. */

/* The 64-bit word a stream memory operation names: 8-byte aligned, inside a device allocation or
 * mapping, or inside host memory registered with CU_MEMHOSTREGISTER_DEVICEMAP. */
static CUresult memop_word(const char *fn, CUdeviceptr addr, _Atomic uint64_t **out) {
    if (addr & 7)
        return viol(CUDA_ERROR_INVALID_VALUE, "%s: address 0x%llx is not 8-byte aligned", fn, addr);
    for (struct pinned *r = g_pinned; r; r = r->next) {
        if (addr >= r->base && addr - r->base + 8 <= r->size) {
            if (!(r->flags & CU_MEMHOSTREGISTER_DEVICEMAP))
                return viol(CUDA_ERROR_INVALID_VALUE, "%s: host address 0x%llx was registered "
                            "without CU_MEMHOSTREGISTER_DEVICEMAP", fn, addr);
            *out = (_Atomic uint64_t *)(uintptr_t)addr;
            return CUDA_SUCCESS;
        }
    }
    unsigned char *d = NULL;
    CUresult rc = dev_range(fn, "word", addr, 8, &d);
    if (!rc) *out = (_Atomic uint64_t *)d;
    return rc;
}

CUresult cuStreamWriteValue64_v2(CUstream stream, CUdeviceptr addr, uint64_t value, unsigned int flags) {
    ENTER(1);
    _Atomic uint64_t *w = NULL;
    CUresult rc = stream_check(__func__, stream, NULL);
    if (!rc && (flags & ~(unsigned)CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER))
        rc = viol(CUDA_ERROR_INVALID_VALUE, "%s: unknown flags %#x", __func__, flags);
    if (!rc) rc = memop_word(__func__, addr, &w);
    if (!rc) atomic_store_explicit(w, value, memory_order_release);
    return done(rc);
}

/* The condition of a wait holds for `have`. */
static int wait_holds(uint64_t have, uint64_t value, unsigned kind) {
    switch (kind) {
    case CU_STREAM_WAIT_VALUE_GEQ: return (int64_t)(have - value) >= 0; /* cyclic, as documented */
    case CU_STREAM_WAIT_VALUE_EQ: return have == value;
    case CU_STREAM_WAIT_VALUE_AND: return (have & value) != 0;
    default: return ~(have | value) != 0; /* NOR: some bit clear in both */
    }
}

/* On a GPU the stream waits, the call returns at once. Here the stream's work is done by its
 * return, so the call itself waits (not holding the stand-in's lock) for another process or
 * thread to satisfy the condition: up to 10 s, then a violation, since a GPU stream whose
 * condition never holds waits forever. */
CUresult cuStreamWaitValue64_v2(CUstream stream, CUdeviceptr addr, uint64_t value, unsigned int flags) {
    ENTER(1);
    _Atomic uint64_t *w = NULL;
    const unsigned kind = flags & ~(unsigned)CU_STREAM_WAIT_VALUE_FLUSH;
    CUresult rc = stream_check(__func__, stream, NULL);
    if (!rc && kind > CU_STREAM_WAIT_VALUE_NOR)
        rc = viol(CUDA_ERROR_INVALID_VALUE, "%s: unknown flags %#x", __func__, flags);
    if (!rc) rc = memop_word(__func__, addr, &w);
    if (rc) return done(rc);
    pthread_mutex_unlock(&g_mu);
    for (int i = 0; i < 100000; i++) {
        if (wait_holds(atomic_load_explicit(w, memory_order_acquire), value, kind)) return CUDA_SUCCESS;
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    pthread_mutex_lock(&g_mu);
    return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: the word at 0x%llx never met the condition "
                     "(%u, %llu) within 10 s: on a GPU this stream would wait forever", __func__,
                     addr, kind, (unsigned long long)value));
}

CUresult cuMemsetD32Async(CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream) {
    ENTER(1);
    CUresult rc = stream_check(__func__, hStream, NULL);
    if (rc || N == 0) return done(rc);
    if (dstDevice & 3)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: 0x%llx is not 4-byte aligned", __func__, dstDevice));
    unsigned char *d = NULL;
    if (N > SIZE_MAX / 4) return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: N %zu overflows", __func__, N));
    rc = dev_range(__func__, "destination", dstDevice, 4 * N, &d);
    if (rc) return done(rc);
    for (size_t i = 0; i < N; i++) memcpy(d + 4 * i, &ui, 4);
    return done(CUDA_SUCCESS);
}

CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream) {
    ENTER(1);
    CUresult rc = stream_check(__func__, hStream, NULL);
    if (rc || ByteCount == 0) return done(rc);
    if (host_range(__func__, dstHost, ByteCount)) return done(CUDA_ERROR_INVALID_VALUE);
    unsigned char *s = NULL;
    rc = dev_range(__func__, "source", srcDevice, ByteCount, &s);
    if (rc) return done(rc);
    memcpy(dstHost, s, ByteCount);
    return done(CUDA_SUCCESS);
}

/* ==== Events ======================================================================== */

CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags) {
    ENTER(1);
    NEED(phEvent);
    if (Flags & ~(unsigned)(CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING |
                            CU_EVENT_INTERPROCESS))
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: unknown Flags 0x%x", __func__, Flags));
    /* "CU_EVENT_INTERPROCESS ... CU_EVENT_DISABLE_TIMING flag also must be set" */
    if ((Flags & CU_EVENT_INTERPROCESS) && !(Flags & CU_EVENT_DISABLE_TIMING))
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: CU_EVENT_INTERPROCESS requires "
                         "CU_EVENT_DISABLE_TIMING", __func__));
    struct CUevent_st *e = calloc(1, sizeof *e);
    if (!e) return done(CUDA_ERROR_OUT_OF_MEMORY);
    if ((Flags & CU_EVENT_INTERPROCESS) &&
        !(e->sh = shared_create("e", sizeof *e->sh, "CUSIEVSH", "CUSIEVTH", &e->handle))) {
        free(e);
        return done(CUDA_ERROR_OUT_OF_MEMORY);
    }
    e->flags = Flags;
    e->ctx = t_cur;
    PUSH(g_events, e);
    *phEvent = e;
    return done(CUDA_SUCCESS);
}

CUresult cuEventRecord(CUevent hEvent, CUstream hStream) {
    delay(DELAY_RECORD);
    ENTER(1);
    CUcontext sctx = NULL;
    CUresult rc = event_check(__func__, hEvent);
    if (!rc) rc = stream_check(__func__, hStream, &sctx);
    if (rc) return done(rc);
    /* "hStream and hEvent must be from the same context" */
    if (sctx != hEvent->ctx)
        return done(viol(CUDA_ERROR_INVALID_HANDLE, "%s: event (device %d) and stream (device "
                         "%d) belong to different contexts", __func__, hEvent->ctx->ordinal,
                         sctx->ordinal));
    if (hEvent->sh) atomic_fetch_add(&hEvent->sh->records, 1);
    return done(CUDA_SUCCESS);
}

CUresult cuEventSynchronize(CUevent hEvent) {
    ENTER(1);
    CUresult rc = event_check(__func__, hEvent);
    if (rc) return done(rc);
    note_wait(hEvent);
    return done(CUDA_SUCCESS);
}

CUresult cuEventQuery(CUevent hEvent) {
    ENTER(1);
    return done(event_check(__func__, hEvent)); /* all work is complete at once */
}

static void free_event(struct CUevent_st *e) {
    if (e->sh) {
        munmap(e->sh, sizeof *e->sh);
        if (!e->opened)
            shm_unlink(e->handle.name); /* the creator's destroy ends the shared object */
    }
    UNLINK(struct CUevent_st, g_events, e);
    free(e);
}

CUresult cuEventDestroy_v2(CUevent hEvent) {
    ENTER(1);
    CUresult rc = event_check(__func__, hEvent);
    if (rc) return done(rc);
    /* Spec section 5: open, make the reading stream wait, then destroy. */
    if (hEvent->opened && !hEvent->waited)
        viol(0, "%s: IPC event opened but never waited on (cuStreamWaitEvent before "
             "cuEventDestroy)", __func__);
    free_event(hEvent);
    return done(CUDA_SUCCESS);
}

CUresult cuIpcGetEventHandle(CUipcEventHandle *pHandle, CUevent event) {
    ENTER(1);
    NEED(pHandle);
    CUresult rc = event_check(__func__, event);
    if (rc) return done(rc);
    if (!event->sh)
        return done(viol(CUDA_ERROR_INVALID_VALUE, "%s: event was not created with "
                         "CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING", __func__));
    memcpy(pHandle->reserved, &event->handle, 64);
    return done(CUDA_SUCCESS);
}

CUresult cuIpcOpenEventHandle(CUevent *phEvent, CUipcEventHandle handle) {
    ENTER(1);
    NEED(phEvent);
    struct wire w;
    if (wire_parse(handle.reserved, "CUSIEVTH", "/cusi_e_", &w) != 0)
        return done(CUDA_ERROR_INVALID_HANDLE); /* error only */
    struct evshm *sh = open_shared(&w, sizeof *sh, "CUSIEVSH");
    if (!sh)
        return done(CUDA_ERROR_INVALID_HANDLE); /* error only: destroyed / unknown */
    CUresult rc = CUDA_SUCCESS;
    if (sh->h.pid == (int32_t)getpid())
        rc = viol(CUDA_ERROR_INVALID_CONTEXT, "%s: an event handle cannot be opened in the "
                  "process that created it (use the event itself)", __func__);
    else if (!pid_alive(sh->h.pid))
        rc = CUDA_ERROR_INVALID_HANDLE; /* error only: creator gone */
    struct CUevent_st *e = rc ? NULL : calloc(1, sizeof *e);
    if (!e) {
        munmap(sh, sizeof *sh);
        return done(rc ? rc : CUDA_ERROR_OUT_OF_MEMORY);
    }
    e->flags = CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING;
    e->opened = 1;
    e->sh = sh;
    e->handle = w;
    e->ctx = t_cur;
    PUSH(g_events, e);
    *phEvent = e;
    return done(CUDA_SUCCESS);
}

/* ==== `_v2` / legacy entry points =================================================== */

/* Same signature in both versions: the plain export is the `_v2` function. */
CUresult cuDeviceGetUuid(CUuuid *, CUdevice) __attribute__((alias("cuDeviceGetUuid_v2")));
CUresult cuDevicePrimaryCtxRelease(CUdevice) __attribute__((alias("cuDevicePrimaryCtxRelease_v2")));
CUresult cuIpcOpenMemHandle(CUdeviceptr *, CUipcMemHandle, unsigned int)
    __attribute__((alias("cuIpcOpenMemHandle_v2")));
CUresult cuStreamDestroy(CUstream) __attribute__((alias("cuStreamDestroy_v2")));
CUresult cuEventDestroy(CUevent) __attribute__((alias("cuEventDestroy_v2")));

/* The un-suffixed memory functions are the CUDA 3.1 ABI with 32-bit CUdeviceptr and sizes: a
 * program that dlsym()s "cuMemAlloc" instead of "cuMemAlloc_v2" gets truncated pointers on a
 * real driver. Refuse without touching the arguments. */
#define LEGACY(name)                                                                       \
    viol(CUDA_ERROR_NOT_SUPPORTED, "%s: legacy 32-bit entry point called; resolve %s_v2 "  \
         "(cuda.h #defines %s to it)", name, name, name)

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize) { return LEGACY("cuMemAlloc"); }
CUresult cuMemFree(CUdeviceptr_v1 dptr) { return LEGACY("cuMemFree"); }
CUresult cuMemGetAddressRange(CUdeviceptr_v1 *pbase, unsigned int *psize, CUdeviceptr_v1 dptr) {
    return LEGACY("cuMemGetAddressRange");
}
CUresult cuMemcpyHtoD(CUdeviceptr_v1 dstDevice, const void *srcHost, unsigned int ByteCount) {
    return LEGACY("cuMemcpyHtoD");
}
CUresult cuMemcpyDtoH(void *dstHost, CUdeviceptr_v1 srcDevice, unsigned int ByteCount) {
    return LEGACY("cuMemcpyDtoH");
}
CUresult cuMemcpyDtoD(CUdeviceptr_v1 dstDevice, CUdeviceptr_v1 srcDevice, unsigned int ByteCount) {
    return LEGACY("cuMemcpyDtoD");
}
CUresult cuMemsetD8(CUdeviceptr_v1 dstDevice, unsigned char uc, unsigned int N) {
    return LEGACY("cuMemsetD8");
}
#pragma GCC diagnostic pop

/* ==== Test-only queries ============================================================= */

int cusi_violation_count(void) {
    return atomic_load(&g_violations);
}

int cusi_live_opens(CUipcMemHandle h) {
    struct wire w;
    if (wire_parse(h.reserved, "CUSIMEMH", "/cusi_h_", &w) != 0) return -1;
    struct meta *m = open_shared(&w, sizeof *m, "CUSIMETA");
    if (!m) return -1;
    int n = live_opens(m);
    munmap(m, sizeof *m);
    return n;
}

int cusi_event_waits(CUevent e) {
    pthread_mutex_lock(&g_mu);
    int n = -1;
    for (struct CUevent_st *x = g_events; x; x = x->next)
        if (x == e && x->sh) n = (int)atomic_load(&x->sh->waits);
    pthread_mutex_unlock(&g_mu);
    return n;
}

int cusi_event_records(CUevent e) {
    pthread_mutex_lock(&g_mu);
    int n = -1;
    for (struct CUevent_st *x = g_events; x; x = x->next)
        if (x == e && x->sh) n = (int)atomic_load(&x->sh->records);
    pthread_mutex_unlock(&g_mu);
    return n;
}

int cusi_opened_events(void) {
    pthread_mutex_lock(&g_mu);
    int n = 0;
    for (struct CUevent_st *x = g_events; x; x = x->next)
        n += x->opened;
    pthread_mutex_unlock(&g_mu);
    return n;
}

int cusi_handle_fetches(CUdeviceptr base) {
    pthread_mutex_lock(&g_mu);
    struct region *r = find_region(base);
    int n = (r && r->kind == K_ALLOC && r->base == base) ? r->fetches : -1;
    pthread_mutex_unlock(&g_mu);
    return n;
}

/* VMM counts of this process. */
static int vmm_count(int what) {
    int n = 0;
    pthread_mutex_lock(&g_mu);
    if (what == 0)
        for (struct vmm_resv *v = g_vmm_resvs; v; v = v->next) n++;
    else if (what == 1)
        for (struct region *r = g_regions; r; r = r->next) n += r->kind == K_VMM;
    else
        for (struct vmm_alloc *a = g_vmm_allocs; a; a = a->next)
            n += what == 2 ? a->refs : what == 3 ? (a->imported ? a->refs : 0) : 1;
    pthread_mutex_unlock(&g_mu);
    return n;
}

int cusi_vmm_reservations(void) { return vmm_count(0); }
int cusi_vmm_mappings(void) { return vmm_count(1); }
int cusi_vmm_handles(void) { return vmm_count(2); }
int cusi_vmm_imported_handles(void) { return vmm_count(3); }
int cusi_vmm_allocations(void) { return vmm_count(4); }

int cusi_host_registered(void) {
    pthread_mutex_lock(&g_mu);
    int n = 0;
    for (struct pinned *r = g_pinned; r; r = r->next) n++;
    pthread_mutex_unlock(&g_mu);
    return n;
}

int cusi_vmm_access(CUdeviceptr p, int ordinal) {
    pthread_mutex_lock(&g_mu);
    struct region *r = find_region(p);
    int n = r && r->kind == K_VMM && ordinal >= 0 && ordinal < g_nvis ? r->access[g_vis[ordinal]]
                                                                      : -1;
    pthread_mutex_unlock(&g_mu);
    return n;
}

int cusi_set_delay(const char *call, unsigned ms) {
    static const char *const names[DELAY_COUNT] = {
        [DELAY_OPEN] = "cuIpcOpenMemHandle",
        [DELAY_CLOSE] = "cuIpcCloseMemHandle",
        [DELAY_SYNC] = "cuCtxSynchronize",
        [DELAY_RECORD] = "cuEventRecord",
    };
    for (int i = 0; call && i < DELAY_COUNT; i++)
        if (!strcmp(call, names[i])) {
            atomic_store(&g_delay_ms[i], ms);
            return 0;
        }
    return -1;
}

/* ==== fork() and process exit ======================================================= */

#define FREE_LIST(head) \
    while (head) { void *x_ = head; head = head->next; free(x_); }
static void drop_tables(void) {
    for (struct vmm_alloc *a = g_vmm_allocs; a; a = a->next) close(a->fd);
    FREE_LIST(g_vmm_allocs);
    FREE_LIST(g_vmm_resvs);
    FREE_LIST(g_regions);
    FREE_LIST(g_streams);
    FREE_LIST(g_events);
}

static void atfork_prepare(void) { pthread_mutex_lock(&g_mu); }
static void atfork_parent(void) { pthread_mutex_unlock(&g_mu); }

/* The child inherits copies of the parent's tables, which are not its own: forget them (the
 * parent still owns the shm objects) and refuse CUDA calls if the parent had initialised. */
static void atfork_child(void) {
    pthread_mutex_init(&g_mu, NULL);
    drop_tables();
    g_forked = g_inited;
    g_inited = 0;
    atomic_store(&g_violations, 0);
    t_cur = NULL;
}

__attribute__((constructor)) static void cusi_init(void) {
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

/* At exit the driver tears everything down; the stand-in checks what was left behind. */
__attribute__((destructor)) static void cusi_fini(void) {
    pthread_mutex_lock(&g_mu);
    int maps = 0, events = 0, exported_live = 0, vmm_handles = 0, vmm_maps = 0;
    for (struct vmm_alloc *a = g_vmm_allocs; a; a = a->next)
        if (a->imported) vmm_handles += a->refs;
    while (g_regions) {
        struct region *r = g_regions;
        if (r->kind == K_IPC) {
            maps++;
            close_mapping(r);
        } else if (r->kind == K_VMM) {
            vmm_maps += r->va->imported != 0;
            vmm_unmap_region(r);
        } else {
            exported_live += release_region(r);
        }
    }
    while (g_vmm_allocs) { /* local allocations simply end with the process */
        g_vmm_allocs->refs = 0;
        vmm_maybe_destroy(g_vmm_allocs);
    }
    while (g_vmm_resvs) {
        struct vmm_resv *v = g_vmm_resvs;
        munmap((void *)v->base, v->size);
        munmap(v->shadow, v->size);
        g_vmm_resvs = v->next;
        free(v);
    }
    while (g_events) {
        events += g_events->opened;
        free_event(g_events);
    }
    /* Every cuIpcOpenMemHandle needs its cuIpcCloseMemHandle before the consumer exits. */
    if (maps) viol(0, "exit: %d IPC mappings never closed (cuIpcCloseMemHandle)", maps);
    /* Every cuIpcOpenEventHandle needs its cuEventDestroy. */
    if (events) viol(0, "exit: %d IPC-opened events never destroyed (cuEventDestroy)", events);
    /* Exiting frees the exporter's memory under its importers (spec section 4). */
    if (exported_live)
        viol(0, "exit: the exporter exits (freeing its memory) while %d IPC opens of it are live "
             "in other processes", exported_live);
    /* Every cuMemImportFromShareableHandle needs its cuMemRelease, every cuMemMap of imported
     * memory its cuMemUnmap, before the consumer exits. */
    if (vmm_handles)
        viol(0, "exit: %d imported VMM allocation handles never released (cuMemRelease)",
             vmm_handles);
    if (vmm_maps)
        viol(0, "exit: %d VMM mappings of imported memory never unmapped (cuMemUnmap)", vmm_maps);
    drop_tables();
    pthread_mutex_unlock(&g_mu);
}
