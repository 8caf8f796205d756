/* SPDX-License-Identifier: Apache-2.0 */
/*
 * gpu_tool: the C side of devshare's real-GPU test suite (tests/gpu, driven by gpu_cases.py).
 *
 * Uses only devshare.h and the few CUDA driver calls it needs for its own work, loaded with
 * dlopen ($DEVSHARE_CUDA_LIBRARY if set, else "libcuda.so.1"), so it builds without the CUDA
 * toolkit. Every tensor it handles is float32, 1-D and contiguous; element values are small
 * integers, so comparisons are exact.
 *
 *   gpu_tool consume <text-handle> <nfloats-to-check> <expect-start> <write-value>
 *       Import the handle with devshare_import_text (options with a stream this tool created, so
 *       an event the handle carries is waited on with cuStreamWaitEvent; the text also carries a
 *       segment table too long for the handle struct), copy the tensor to the host, check that
 *       element i == expect-start + i for i < nfloats-to-check, write write-value into every
 *       element, synchronise, release. Prints
 *           OK sum=<sum of the checked elements> numel=<n> import_us=<t> release_us=<t>
 *       or FAIL <why> (exit 1).
 *
 *   gpu_tool consume-many
 *       Reads lines "<text-handle> <nfloats-to-check> <expect-start> <write-value>" from stdin
 *       until EOF; imports all of them (holding every import, so handles of one allocation
 *       share one mapping), checks and writes each, then releases all. Prints
 *           OK <i> sum=<...>   or   FAIL <i> <why>     per line, then
 *           DONE ok=<k> fail=<m> import_total_us=<t>
 *       Exit 0 when every line passed.
 *
 *   gpu_tool produce <nfloats> <start> <timeout-ms> [sync|event]
 *       cuMemAlloc nfloats + 64 floats, fill the first 64 with -1 and element i of the rest with
 *       start + i, export the rest (device 0; the handle carries the 256-byte offset) and share
 *       it as a float32 1-D tensor: "sync" (default) synchronises before sharing, "event" sends
 *       an IPC event recorded on a stream this tool created (DEVSHARE_SHARE_EVENT). Prints
 *           HANDLE <text>
 *           TORCH <device> <handle_hex> <size> <offset> <refname_hex|-> <slot> <event_hex> <sync>
 *       then waits up to timeout-ms (negative: forever) for the reference to come back and
 *       prints RELEASED outstanding=0 or TIMEOUT outstanding=<k>, then
 *           AFTER first=<element 0> last=<element n-1> pad=<element -1>
 *       (what the consumer left), closes the exporter, frees, exits 0 (1 on TIMEOUT).
 *
 *   gpu_tool serve
 *       Prints READY once CUDA is initialised, then for every stdin line holding a handle:
 *       import (with a stream), synchronise it, read element 0, release, and answer
 *           OK <element 0>   or   FAIL <why>
 *       until EOF.
 *
 *   gpu_tool bench-import <text-handle> <iterations>
 *       Cold: import + release of a copy of the handle without its ref-counter reference (so
 *       it can be repeated: every round opens and closes the CUDA IPC mapping), the first round
 *       and then <iterations> rounds. Cached: hold one import of the real handle, then import +
 *       release it <iterations> times (the mapping stays cached), then release the held one,
 *       which returns the reference. Prints
 *           FIRST_US <t>
 *           COLD_US n=<k> p50=<t> min=<t> max=<t>
 *           CACHED_US n=<k> p50=<t> min=<t> max=<t>
 *           RELEASED
 *
 *   gpu_tool produce-vmm <nsegments> <nfloats> <offset-bytes> <start> <timeout-ms> [options]
 *       A C VMM producer, as PyTorch's expandable segments are made: cuMemCreate nsegments
 *       physical allocations of 2 MiB (POSIX-fd shareable; "fabric": fabric handles), reserve
 *       nsegments x 2 MiB of address space, cuMemMap them back to back, cuMemSetAccess
 *       read-write, fill every float with -1 and the nfloats from offset-bytes on with start + i,
 *       export them with devshare_export_segments and share that window as a float32 1-D tensor
 *       (devshare_exporter_share_encoded: the encoding carries a segment table too long for the
 *       handle struct). Options: "fabric"; "allow-ptrace" calls devshare_allow_ptrace(-1) (any
 *       process may take this producer's fds under Yama ptrace_scope 1; without it only an
 *       ancestor may). Prints
 *           SEGMENTS count=<n> segment_size=<bytes> kind=<fd|fabric> table=<inline|external>
 *           HANDLE <text>
 *           TORCH <device> <handle_hex> <size> <offset> <refname_hex|-> <slot> <event_hex> <sync>
 *       (the TORCH handle is the 'e' form of the consumer's torch, see torch_format), then,
 *       as produce: RELEASED / TIMEOUT, then
 *           AFTER first=<element 0> last=<element n-1> pad=<float before the window or -1>
 *       closes the exporter, unmaps, releases and frees the address range, exits 0 (1 on TIMEOUT).
 *
 *   gpu_tool produce-pool <cuda|vmm|host> <address> <slots> <slot-floats> <items> <timeout-ms>
 *       A pool producer over a channel. Allocates slots x slot-floats float32 — cuda: cuMemAlloc +
 *       devshare_export; vmm: 2 MiB cuMemCreate segments mapped back to back +
 *       devshare_export_segments (a slot may span segments); host: devshare_channel_host_alloc,
 *       no CUDA — listens on <address> (a path or "@name"), makes a pool of <slots> slots
 *       (devshare_pool_create) and prints
 *           READY kind=<k> pool=<id> slots=<n> slot_bytes=<b> base=<address here> segments=<n>
 *       then waits for one consumer and sends it <items> items: item i acquires a slot (checked to
 *       lie at base + slot x slot_bytes), writes element j = (i % 4096) + (j % 1024) * 4096 (exact
 *       in float32) into it, synchronises and sends it as float32 [slot-floats]. Once every slot
 *       is back it closes the pool, waits for the consumer to detach or hang up, and prints
 *           DONE items=<n> uses=<items per slot, comma-separated> FILL_US n=<k> p50=<t> min=<t> max=<t>
 *       (exit 0), or FAIL <why> (exit 1) when a step fails or a wait passes <timeout-ms>.
 *
 *   gpu_tool consume-pool <address> <items> <timeout-ms> [host|touch]
 *       Connects to a produce-pool channel and receives <items> items (cuda imports unless
 *       "host"), each a slot of one pool: checks that every element (with "touch": the first and
 *       the last only, a benchmark's consumer) holds produce-pool's value for that item number, that a slot's address never changes and that every slot lies at one
 *       base + slot x slot bytes (one mapping of the allocation), releases it. Prints
 *           OK items=<n> pool=<id> base=<address here> slots=<slot>:<address>x<items> ...
 *       or FAIL <why> (exit 1), then hangs up.
 *
 *   gpu_tool describe <text-handle>     parse (no CUDA) and print the handle's fields; for a
 *                                       segmented handle also segments=<n>x<size>/<kind>/<where>
 *   gpu_tool layout                     print sizeof, alignment and every field's offset and size
 *                                       of every struct, and every macro and status code
 *                                       (tests/c/abi_fields.h's lines)
 *
 * Exit status: 0 success, 1 failure (FAIL line on stdout, details on stderr), 2 usage.
 */
#define _POSIX_C_SOURCE 200809L

#define HARNESS_NAME "gpu_tool"
#include "../c/harness.h"
#include "../c/abi_fields.h"

#include <dlfcn.h>
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* --- The CUDA driver calls this tool makes (declared here; no cuda.h needed) ------------------ */

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;
/* VMM (cuMemCreate & co.), as in cuda.h (x86-64 layouts). */
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct {
    int type; /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
    int id;
} CUmemLocation;
typedef struct {
    int type;                 /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
    int requestedHandleTypes; /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1, FABRIC = 8 */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;
typedef struct {
    CUmemLocation location;
    int flags; /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 */
} CUmemAccessDesc;

static struct {
    void *lib;
    CUresult (*cuInit)(unsigned int);
    CUresult (*cuDeviceGet)(CUdevice *, int);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*cuCtxSetCurrent)(CUcontext);
    CUresult (*cuCtxSynchronize)(void);
    CUresult (*cuMemAlloc_v2)(CUdeviceptr *, size_t);
    CUresult (*cuMemFree_v2)(CUdeviceptr);
    CUresult (*cuMemcpyHtoD_v2)(CUdeviceptr, const void *, size_t);
    CUresult (*cuMemcpyDtoH_v2)(void *, CUdeviceptr, size_t);
    CUresult (*cuStreamCreate)(CUstream *, unsigned int);
    CUresult (*cuStreamSynchronize)(CUstream);
    CUresult (*cuGetErrorName)(CUresult, const char **); /* optional */
    /* VMM, for produce-vmm only (optional when loading) */
    CUresult (*cuMemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, int);
    CUresult (*cuMemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                            unsigned long long);
    CUresult (*cuMemRelease)(CUmemGenericAllocationHandle);
    CUresult (*cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*cuMemAddressFree)(CUdeviceptr, size_t);
    CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                         unsigned long long);
    CUresult (*cuMemUnmap)(CUdeviceptr, size_t);
    CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
} cu;

static CUstream g_stream;

/* Prints "FAIL <why>" on stdout (what the driver reads) and the same on stderr. */
__attribute__((format(printf, 1, 2)))
static int fail(const char *fmt, ...) {
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    printf("FAIL %s\n", msg);
    fflush(stdout);
    fprintf(stderr, "gpu_tool: %s\n", msg);
    return 1;
}

static const char *cu_error(char *buf, size_t cap, const char *call, CUresult rc) {
    const char *name = NULL;
    if (cu.cuGetErrorName == NULL || cu.cuGetErrorName(rc, &name) != 0 || name == NULL) {
        name = "?";
    }
    snprintf(buf, cap, "%s failed: CUDA error %d (%s)", call, rc, name);
    return buf;
}

#define CU_CHECK(call, args)                                                                  \
    do {                                                                                      \
        CUresult rc_ = cu.call args;                                                          \
        if (rc_ != 0) {                                                                       \
            char b_[256];                                                                     \
            return fail("%s", cu_error(b_, sizeof b_, #call, rc_));                           \
        }                                                                                     \
    } while (0)

static int load_sym(const char *name, void *slot, int required) {
    void *p = dlsym(cu.lib, name);
    if (p == NULL) {
        if (required) {
            return fail("%s has no symbol %s", "the CUDA driver library", name);
        }
        return 0;
    }
    memcpy(slot, &p, sizeof p); /* object pointer -> function pointer, without a cast */
    return 0;
}

/* dlopen the driver, cuInit, make device 0's primary context current, create a stream. */
static int cuda_setup(void) {
    const char *path = getenv("DEVSHARE_CUDA_LIBRARY");
    if (path == NULL || *path == '\0') {
        path = "libcuda.so.1";
    }
    cu.lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (cu.lib == NULL) {
        return fail("cannot load the CUDA driver (%s): %s", path, dlerror());
    }
    int bad = 0;
    bad |= load_sym("cuInit", &cu.cuInit, 1);
    bad |= load_sym("cuDeviceGet", &cu.cuDeviceGet, 1);
    bad |= load_sym("cuDevicePrimaryCtxRetain", &cu.cuDevicePrimaryCtxRetain, 1);
    bad |= load_sym("cuCtxSetCurrent", &cu.cuCtxSetCurrent, 1);
    bad |= load_sym("cuCtxSynchronize", &cu.cuCtxSynchronize, 1);
    bad |= load_sym("cuMemAlloc_v2", &cu.cuMemAlloc_v2, 1);
    bad |= load_sym("cuMemFree_v2", &cu.cuMemFree_v2, 1);
    bad |= load_sym("cuMemcpyHtoD_v2", &cu.cuMemcpyHtoD_v2, 1);
    bad |= load_sym("cuMemcpyDtoH_v2", &cu.cuMemcpyDtoH_v2, 1);
    bad |= load_sym("cuStreamCreate", &cu.cuStreamCreate, 1);
    bad |= load_sym("cuStreamSynchronize", &cu.cuStreamSynchronize, 1);
    bad |= load_sym("cuGetErrorName", &cu.cuGetErrorName, 0);
    bad |= load_sym("cuMemGetAllocationGranularity", &cu.cuMemGetAllocationGranularity, 0);
    bad |= load_sym("cuMemCreate", &cu.cuMemCreate, 0);
    bad |= load_sym("cuMemRelease", &cu.cuMemRelease, 0);
    bad |= load_sym("cuMemAddressReserve", &cu.cuMemAddressReserve, 0);
    bad |= load_sym("cuMemAddressFree", &cu.cuMemAddressFree, 0);
    bad |= load_sym("cuMemMap", &cu.cuMemMap, 0);
    bad |= load_sym("cuMemUnmap", &cu.cuMemUnmap, 0);
    bad |= load_sym("cuMemSetAccess", &cu.cuMemSetAccess, 0);
    if (bad) {
        return 1;
    }
    CU_CHECK(cuInit, (0));
    CUdevice dev = 0;
    CU_CHECK(cuDeviceGet, (&dev, 0));
    CUcontext ctx = NULL;
    CU_CHECK(cuDevicePrimaryCtxRetain, (&ctx, dev));
    CU_CHECK(cuCtxSetCurrent, (ctx));
    CU_CHECK(cuStreamCreate, (&g_stream, 0));
    return 0;
}

/* --- Small helpers ----------------------------------------------------------------------- */

static int parse_f64(const char *s, double *out) {
    if (s == NULL || *s == '\0') {
        return -1;
    }
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (errno != 0 || *end != '\0') {
        return -1;
    }
    *out = v;
    return 0;
}

/* The storage-handle format the consumer's torch reads: DEVSHARE_GPU_TORCH_VERSION (its
 * torch.__version__, set by gpu_cases.py) through devshare_torch_format_for_version; unset: the
 * default (version-2 'e' handles, what 1.1 wrote). */
static int32_t torch_format(uint32_t *fmt) {
    const char *v = getenv("DEVSHARE_GPU_TORCH_VERSION");
    *fmt = DEVSHARE_TORCH_FORMAT_DEFAULT;
    return v && *v ? devshare_torch_format_for_version(DEVSHARE_BACKEND_CUDA, v, fmt) : DEVSHARE_STATUS_OK;
}

static void print_hex(const uint8_t *p, size_t n) {
    char *hex = malloc(2 * n + 2);
    if (hex == NULL) {
        fputs("?", stdout);
        return;
    }
    fputs(hex_encode(p, n, hex), stdout);
    free(hex);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void print_stats(const char *label, double *v, size_t n) {
    if (n == 0) {
        printf("%s n=0\n", label);
        return;
    }
    qsort(v, n, sizeof *v, cmp_double);
    printf("%s n=%zu p50=%.1f min=%.1f max=%.1f\n", label, n, v[n / 2], v[0], v[n - 1]);
}

/* --- Importing and checking one float32 tensor ----------------------------------------- */

/* The tensor of an import, if it is float32 and C-contiguous: data pointer and element count. */
static int float_view(const DevshareImport *imp, CUdeviceptr *data, uint64_t *numel,
                      char *why, size_t cap) {
    DevshareImportInfo info;
    DevshareHandle h;
    devshare_import_info_init(&info, sizeof info);
    int32_t st = devshare_import_info(imp, &info);
    if (st != DEVSHARE_STATUS_OK) {
        ds_error(why, cap, "devshare_import_info", st);
        return -1;
    }
    st = devshare_import_handle(imp, &h);
    if (st != DEVSHARE_STATUS_OK) {
        ds_error(why, cap, "devshare_import_handle", st);
        return -1;
    }
    if (info.backend != DEVSHARE_BACKEND_CUDA) {
        snprintf(why, cap, "handle backend is %u, not cuda (%d)", info.backend,
                 DEVSHARE_BACKEND_CUDA);
        return -1;
    }
    if (h.dtype.code != DEVSHARE_DTYPE_FLOAT || h.dtype.bits != 32 || h.dtype.lanes != 1) {
        snprintf(why, cap, "dtype is code %u bits %u lanes %u, not float32", h.dtype.code,
                 h.dtype.bits, h.dtype.lanes);
        return -1;
    }
    int64_t expect = 1;
    for (int d = (int)h.ndim - 1; d >= 0; d--) {
        if (h.shape[d] != 1 && h.strides[d] != expect) {
            snprintf(why, cap, "tensor is not C-contiguous (dim %d: shape %" PRId64
                     " stride %" PRId64 ", expected %" PRId64 ")",
                     d, h.shape[d], h.strides[d], expect);
            return -1;
        }
        expect *= h.shape[d];
    }
    *data = (CUdeviceptr)(uintptr_t)info.data;
    *numel = info.numel;
    return 0;
}

/* Check element i == start + i for i < ncheck, then write `value` everywhere. */
static int check_and_write(CUdeviceptr data, uint64_t numel, uint64_t ncheck, double start,
                           double value, double *sum, char *why, size_t cap) {
    if (ncheck > numel) {
        snprintf(why, cap, "asked to check %" PRIu64 " elements but the tensor has %" PRIu64,
                 ncheck, numel);
        return -1;
    }
    size_t bytes = (size_t)numel * sizeof(float);
    float *buf = malloc(bytes > 0 ? bytes : 1);
    if (buf == NULL) {
        snprintf(why, cap, "out of host memory (%zu bytes)", bytes);
        return -1;
    }
    CUresult rc = cu.cuMemcpyDtoH_v2(buf, data, bytes);
    if (rc != 0) {
        cu_error(why, cap, "cuMemcpyDtoH_v2", rc);
        free(buf);
        return -1;
    }
    double s = 0;
    for (uint64_t i = 0; i < ncheck; i++) {
        float want = (float)(start + (double)i);
        if (buf[i] != want) {
            snprintf(why, cap, "element %" PRIu64 " is %.9g, expected %.9g (element 0 is %.9g)", i,
                     (double)buf[i], (double)want, (double)buf[0]);
            free(buf);
            return -1;
        }
        s += (double)buf[i];
    }
    for (uint64_t i = 0; i < numel; i++) {
        buf[i] = (float)value;
    }
    rc = cu.cuMemcpyHtoD_v2(data, buf, bytes);
    free(buf);
    if (rc == 0) {
        /* A pageable H2D copy may return before the DMA lands: finish it before releasing. */
        rc = cu.cuCtxSynchronize();
    }
    if (rc != 0) {
        cu_error(why, cap, "cuMemcpyHtoD_v2/cuCtxSynchronize", rc);
        return -1;
    }
    *sum = s;
    return 0;
}

/* Import text with this tool's stream and wait for the stream (and so the producer's event).
 * devshare_import_text rather than devshare_handle_from_text + devshare_import: the text of a
 * segmented handle may carry a segment table that the DevshareHandle struct cannot hold. */
static int import_text(const char *text, DevshareImport **imp, char *why, size_t cap) {
    DevshareImportOptions opt;
    devshare_import_options_init(&opt, sizeof opt);
    opt.stream = g_stream;
    int32_t st = devshare_import_text(text, &opt, imp);
    if (st != DEVSHARE_STATUS_OK) {
        ds_error(why, cap, "devshare_import_text", st);
        return -1;
    }
    CUresult rc = cu.cuStreamSynchronize(g_stream);
    if (rc != 0) {
        cu_error(why, cap, "cuStreamSynchronize", rc);
        devshare_import_release(*imp);
        *imp = NULL;
        return -1;
    }
    return 0;
}

/* --- Subcommands ----------------------------------------------------------------------- */

static int cmd_consume(char **argv) {
    int64_t ncheck = 0;
    double start = 0, value = 0;
    if (parse_i64(argv[1], &ncheck) != 0 || ncheck < 0 || parse_f64(argv[2], &start) != 0 ||
        parse_f64(argv[3], &value) != 0) {
        return fail("usage: consume <text-handle> <nfloats-to-check> <expect-start> <write-value>");
    }
    if (cuda_setup() != 0) {
        return 1;
    }
    char why[2048];
    DevshareImport *imp = NULL;
    double t0 = now_us();
    if (import_text(argv[0], &imp, why, sizeof why) != 0) {
        return fail("%s", why);
    }
    double t1 = now_us();
    CUdeviceptr data = 0;
    uint64_t numel = 0;
    double sum = 0;
    if (float_view(imp, &data, &numel, why, sizeof why) != 0 ||
        check_and_write(data, numel, (uint64_t)ncheck, start, value, &sum, why, sizeof why) != 0) {
        devshare_import_release(imp);
        return fail("%s", why);
    }
    double t2 = now_us();
    int32_t st = devshare_import_release(imp);
    double t3 = now_us();
    if (st != DEVSHARE_STATUS_OK) {
        return fail("%s", ds_error(why, sizeof why, "devshare_import_release", st));
    }
    printf("OK sum=%.1f numel=%" PRIu64 " import_us=%.1f release_us=%.1f\n", sum, numel, t1 - t0,
           t3 - t2);
    return 0;
}

enum { MANY_MAX = 4096 };

static int cmd_consume_many(void) {
    if (cuda_setup() != 0) {
        return 1;
    }
    static DevshareImport *imps[MANY_MAX];
    static double starts[MANY_MAX], values[MANY_MAX];
    static int64_t nchecks[MANY_MAX];
    static int okay[MANY_MAX];
    char *line = NULL;
    size_t cap = 0;
    int n = 0, nfail = 0;
    double import_total = 0;
    char why[2048];
    while (getline(&line, &cap, stdin) > 0) {
        char *save = NULL;
        char *text = strtok_r(line, " \t\r\n", &save);
        if (text == NULL) {
            continue;
        }
        if (n >= MANY_MAX) {
            free(line);
            return fail("more than %d handles", MANY_MAX);
        }
        char *a = strtok_r(NULL, " \t\r\n", &save), *b = strtok_r(NULL, " \t\r\n", &save),
             *c = strtok_r(NULL, " \t\r\n", &save);
        int i = n++;
        okay[i] = 0;
        imps[i] = NULL;
        if (parse_i64(a, &nchecks[i]) != 0 || nchecks[i] < 0 || parse_f64(b, &starts[i]) != 0 ||
            parse_f64(c, &values[i]) != 0) {
            printf("FAIL %d bad line (want: <text> <nfloats> <expect-start> <write-value>)\n", i);
            nfail++;
            continue;
        }
        double t0 = now_us();
        if (import_text(text, &imps[i], why, sizeof why) != 0) {
            printf("FAIL %d %s\n", i, why);
            nfail++;
            continue;
        }
        import_total += now_us() - t0;
        okay[i] = 1;
    }
    free(line);
    /* Every import is held now: check and write each, then release all. */
    for (int i = 0; i < n; i++) {
        if (!okay[i]) {
            continue;
        }
        CUdeviceptr data = 0;
        uint64_t numel = 0;
        double sum = 0;
        if (float_view(imps[i], &data, &numel, why, sizeof why) != 0 ||
            check_and_write(data, numel, (uint64_t)nchecks[i], starts[i], values[i], &sum, why,
                            sizeof why) != 0) {
            printf("FAIL %d %s\n", i, why);
            nfail++;
        } else {
            printf("OK %d sum=%.1f\n", i, sum);
        }
    }
    for (int i = 0; i < n; i++) {
        if (imps[i] != NULL) {
            int32_t st = devshare_import_release(imps[i]);
            if (st != DEVSHARE_STATUS_OK) {
                printf("FAIL %d %s\n", i, ds_error(why, sizeof why, "devshare_import_release", st));
                nfail++;
            }
        }
    }
    printf("DONE ok=%d fail=%d import_total_us=%.1f\n", n - nfail, nfail, import_total);
    return nfail == 0 && n > 0 ? 0 : 1;
}

enum { PAD_FLOATS = 64 };

static int cmd_produce(int argc, char **argv) {
    int64_t n = 0, timeout_ms = 0;
    double start = 0;
    int event = 0;
    if (parse_i64(argv[0], &n) != 0 || n <= 0 || parse_f64(argv[1], &start) != 0 ||
        parse_i64(argv[2], &timeout_ms) != 0) {
        return fail("usage: produce <nfloats> <start> <timeout-ms> [sync|event]");
    }
    if (argc >= 4) {
        if (strcmp(argv[3], "event") == 0) {
            event = 1;
        } else if (strcmp(argv[3], "sync") != 0) {
            return fail("produce: mode must be sync or event, not %s", argv[3]);
        }
    }
    if (cuda_setup() != 0) {
        return 1;
    }
    size_t total = ((size_t)n + PAD_FLOATS) * sizeof(float);
    float *host = malloc(total);
    if (host == NULL) {
        return fail("out of host memory");
    }
    for (size_t i = 0; i < PAD_FLOATS; i++) {
        host[i] = -1.0f;
    }
    for (int64_t i = 0; i < n; i++) {
        host[PAD_FLOATS + i] = (float)(start + (double)i);
    }
    CUdeviceptr base = 0;
    CUresult rc = cu.cuMemAlloc_v2(&base, total);
    if (rc == 0) {
        rc = cu.cuMemcpyHtoD_v2(base, host, total);
    }
    if (rc == 0) {
        rc = cu.cuCtxSynchronize();
    }
    char why[2048];
    if (rc != 0) {
        free(host);
        return fail("%s", cu_error(why, sizeof why, "cuMemAlloc/cuMemcpyHtoD", rc));
    }
    CUdeviceptr ptr = base + PAD_FLOATS * sizeof(float);
    DevshareExporter *ex = NULL;
    int32_t st = devshare_export(DEVSHARE_BACKEND_CUDA, 0, (void *)(uintptr_t)ptr,
                                 (uint64_t)n * sizeof(float), 0, &ex);
    if (st != DEVSHARE_STATUS_OK) {
        cu.cuMemFree_v2(base);
        free(host);
        return fail("%s", ds_error(why, sizeof why, "devshare_export", st));
    }
    int64_t shape[1] = {n};
    DevshareTensorDesc desc;
    devshare_tensor_desc_init(&desc, sizeof desc); /* storage to the end, the rest zero */
    desc.dtype.code = DEVSHARE_DTYPE_FLOAT;
    desc.dtype.bits = 32;
    desc.dtype.lanes = 1;
    desc.ndim = 1;
    desc.shape = shape;
    desc.flags = event ? DEVSHARE_SHARE_EVENT : 0;
    desc.stream = event ? g_stream : NULL;
    DevshareHandle h;
    DevshareTorchStorage ts;
    uint32_t fmt = DEVSHARE_TORCH_FORMAT_DEFAULT;
    devshare_torch_storage_init(&ts, sizeof ts);
    char text[DEVSHARE_HANDLE_MAX_TEXT_SIZE];
    const char *call = "devshare_exporter_share";
    st = devshare_exporter_share(ex, &desc, &h);
    if (st == DEVSHARE_STATUS_OK) {
        call = "devshare_handle_to_text";
        st = devshare_handle_to_text(&h, text, sizeof text, NULL);
    }
    if (st == DEVSHARE_STATUS_OK) {
        call = "devshare_handle_to_torch_as";
        st = torch_format(&fmt);
        if (st == DEVSHARE_STATUS_OK) {
            st = devshare_handle_to_torch_as(&h, fmt, &ts);
        }
    }
    if (st != DEVSHARE_STATUS_OK) {
        ds_error(why, sizeof why, call, st);
        devshare_exporter_close(ex, DEVSHARE_CLOSE_FORCE);
        cu.cuMemFree_v2(base);
        free(host);
        return fail("%s", why);
    }
    printf("HANDLE %s\n", text);
    printf("TORCH %d ", (int)ts.device);
    print_hex(ts.handle, ts.handle_len);
    printf(" %" PRIu64 " %" PRIu64 " ", ts.storage_size, ts.storage_offset);
    print_hex(ts.ref_name, ts.ref_name_len);
    printf(" %" PRIu64 " ", ts.ref_slot);
    print_hex(ts.event_handle, sizeof ts.event_handle);
    printf(" %u\n", (unsigned)ts.event_sync_required);
    fflush(stdout);

    st = devshare_exporter_wait(ex, timeout_ms);
    uint64_t left = 0;
    devshare_exporter_outstanding(ex, &left);
    int released = st == DEVSHARE_STATUS_OK;
    if (released) {
        printf("RELEASED outstanding=%" PRIu64 "\n", left);
    } else if (st == DEVSHARE_STATUS_TIMEOUT) {
        printf("TIMEOUT outstanding=%" PRIu64 "\n", left);
    } else {
        printf("FAIL %s\n", ds_error(why, sizeof why, "devshare_exporter_wait", st));
    }
    fflush(stdout);
    rc = cu.cuMemcpyDtoH_v2(host, base, total);
    if (rc == 0) {
        printf("AFTER first=%.9g last=%.9g pad=%.9g\n", (double)host[PAD_FLOATS],
               (double)host[PAD_FLOATS + n - 1], (double)host[PAD_FLOATS - 1]);
    } else {
        printf("FAIL %s\n", cu_error(why, sizeof why, "cuMemcpyDtoH_v2", rc));
        released = 0;
    }
    st = devshare_exporter_close(ex, released ? 0 : DEVSHARE_CLOSE_FORCE);
    if (st != DEVSHARE_STATUS_OK) {
        printf("FAIL %s\n", ds_error(why, sizeof why, "devshare_exporter_close", st));
        released = 0;
    }
    /* Memory a consumer may still map is leaked rather than freed under it. */
    if (left == 0) {
        cu.cuMemFree_v2(base);
    }
    free(host);
    fflush(stdout);
    return released ? 0 : 1;
}

/* "devshare1:" + unpadded URL-safe base64 of an encoded handle (the text form): the C API's
 * devshare_handle_to_text takes a DevshareHandle, which cannot hold a long segment table. */
static char *text_of_encoding(const uint8_t *p, size_t n) {
    static const char abc[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    static const char prefix[] = "devshare1:";
    char *out = malloc(sizeof prefix + (n + 2) / 3 * 4);
    if (out == NULL) {
        return NULL;
    }
    char *o = out + sizeof prefix - 1;
    memcpy(out, prefix, sizeof prefix - 1);
    size_t i = 0;
    for (; i + 3 <= n; i += 3) {
        uint32_t v = (uint32_t)p[i] << 16 | (uint32_t)p[i + 1] << 8 | p[i + 2];
        *o++ = abc[v >> 18];
        *o++ = abc[(v >> 12) & 63];
        *o++ = abc[(v >> 6) & 63];
        *o++ = abc[v & 63];
    }
    if (n - i == 1) {
        uint32_t v = (uint32_t)p[i] << 16;
        *o++ = abc[v >> 18];
        *o++ = abc[(v >> 12) & 63];
    } else if (n - i == 2) {
        uint32_t v = (uint32_t)p[i] << 16 | (uint32_t)p[i + 1] << 8;
        *o++ = abc[v >> 18];
        *o++ = abc[(v >> 12) & 63];
        *o++ = abc[(v >> 6) & 63];
    }
    *o = '\0';
    return out;
}

enum { VMM_SEGMENT = 2 << 20, VMM_MAX_SEGMENTS = 4096 };

/* What produce-vmm built, for teardown in reverse order. */
struct vmm {
    CUdeviceptr va;
    size_t count, mapped, created;
    CUmemGenericAllocationHandle phys[VMM_MAX_SEGMENTS];
};

static void vmm_free(struct vmm *m) {
    for (size_t i = 0; i < m->mapped; i++) {
        cu.cuMemUnmap(m->va + i * (CUdeviceptr)VMM_SEGMENT, VMM_SEGMENT);
    }
    for (size_t i = 0; i < m->created; i++) {
        cu.cuMemRelease(m->phys[i]);
    }
    if (m->va != 0) {
        cu.cuMemAddressFree(m->va, m->count * (size_t)VMM_SEGMENT);
    }
    m->mapped = m->created = 0;
    m->va = 0;
}

/* cuMemCreate + reserve + map + set access: count segments of VMM_SEGMENT on device 0. */
static int vmm_build(struct vmm *m, int fabric, char *why, size_t cap) {
    if (cu.cuMemCreate == NULL || cu.cuMemAddressReserve == NULL || cu.cuMemMap == NULL ||
        cu.cuMemSetAccess == NULL || cu.cuMemUnmap == NULL || cu.cuMemRelease == NULL ||
        cu.cuMemAddressFree == NULL || cu.cuMemGetAllocationGranularity == NULL) {
        snprintf(why, cap, "the CUDA driver library lacks the VMM calls (cuMemCreate & co.)");
        return -1;
    }
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = 1;                                /* CU_MEM_ALLOCATION_TYPE_PINNED */
    prop.requestedHandleTypes = fabric ? 8 : 1;   /* FABRIC : POSIX_FILE_DESCRIPTOR */
    prop.location.type = 1;                       /* CU_MEM_LOCATION_TYPE_DEVICE */
    prop.location.id = 0;
    size_t gran = 0;
    CUresult rc = cu.cuMemGetAllocationGranularity(&gran, &prop, 0);
    if (rc != 0) {
        cu_error(why, cap, "cuMemGetAllocationGranularity", rc);
        return -1;
    }
    if (gran == 0 || VMM_SEGMENT % gran != 0) {
        snprintf(why, cap, "the allocation granularity %zu does not divide the %d-byte segment", gran,
                 VMM_SEGMENT);
        return -1;
    }
    for (; m->created < m->count; m->created++) {
        rc = cu.cuMemCreate(&m->phys[m->created], VMM_SEGMENT, &prop, 0);
        if (rc != 0) {
            cu_error(why, cap, fabric ? "cuMemCreate (fabric)" : "cuMemCreate (POSIX fd)", rc);
            return -1;
        }
    }
    rc = cu.cuMemAddressReserve(&m->va, m->count * (size_t)VMM_SEGMENT, 0, 0, 0);
    if (rc != 0) {
        m->va = 0;
        cu_error(why, cap, "cuMemAddressReserve", rc);
        return -1;
    }
    for (; m->mapped < m->count; m->mapped++) {
        rc = cu.cuMemMap(m->va + m->mapped * (CUdeviceptr)VMM_SEGMENT, VMM_SEGMENT, 0,
                         m->phys[m->mapped], 0);
        if (rc != 0) {
            cu_error(why, cap, "cuMemMap", rc);
            return -1;
        }
    }
    CUmemAccessDesc access;
    memset(&access, 0, sizeof access);
    access.location.type = 1;
    access.location.id = 0;
    access.flags = 3; /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE */
    rc = cu.cuMemSetAccess(m->va, m->count * (size_t)VMM_SEGMENT, &access, 1);
    if (rc != 0) {
        cu_error(why, cap, "cuMemSetAccess", rc);
        return -1;
    }
    return 0;
}

static int cmd_produce_vmm(int argc, char **argv) {
    int64_t nseg = 0, n = 0, offset = 0, timeout_ms = 0;
    double start = 0;
    int fabric = 0, allow = 0;
    if (parse_i64(argv[0], &nseg) != 0 || nseg <= 0 || nseg > VMM_MAX_SEGMENTS ||
        parse_i64(argv[1], &n) != 0 || n <= 0 || parse_i64(argv[2], &offset) != 0 || offset < 0 ||
        offset % 4 != 0 || parse_f64(argv[3], &start) != 0 || parse_i64(argv[4], &timeout_ms) != 0) {
        return fail("usage: produce-vmm <nsegments 1..%d> <nfloats> <offset-bytes, a multiple of 4> "
                    "<start> <timeout-ms> [fabric] [allow-ptrace]", VMM_MAX_SEGMENTS);
    }
    for (int i = 5; i < argc; i++) {
        if (strcmp(argv[i], "fabric") == 0) {
            fabric = 1;
        } else if (strcmp(argv[i], "allow-ptrace") == 0) {
            allow = 1;
        } else {
            return fail("produce-vmm: unknown option %s (fabric, allow-ptrace)", argv[i]);
        }
    }
    size_t total = (size_t)nseg * VMM_SEGMENT;
    if ((uint64_t)offset + (uint64_t)n * 4 > total) {
        return fail("produce-vmm: %" PRId64 " floats at offset %" PRId64 " do not fit %" PRId64
                    " segments of %d bytes", n, offset, nseg, VMM_SEGMENT);
    }
    if (cuda_setup() != 0) {
        return 1;
    }
    char why[2048];
    static struct vmm m;
    m.count = (size_t)nseg;
    float *host = malloc(total);
    if (host == NULL) {
        return fail("out of host memory");
    }
    for (size_t i = 0; i < total / sizeof(float); i++) {
        host[i] = -1.0f;
    }
    float *win = host + offset / 4;
    for (int64_t i = 0; i < n; i++) {
        win[i] = (float)(start + (double)i);
    }
    if (vmm_build(&m, fabric, why, sizeof why) != 0) {
        vmm_free(&m);
        free(host);
        return fail("%s", why);
    }
    CUresult rc = cu.cuMemcpyHtoD_v2(m.va, host, total);
    if (rc == 0) {
        rc = cu.cuCtxSynchronize();
    }
    if (rc != 0) {
        vmm_free(&m);
        free(host);
        return fail("%s", cu_error(why, sizeof why, "cuMemcpyHtoD_v2 (VMM)", rc));
    }
    if (allow) {
        int32_t st = devshare_allow_ptrace(-1);
        if (st != DEVSHARE_STATUS_OK) {
            vmm_free(&m);
            free(host);
            return fail("%s", ds_error(why, sizeof why, "devshare_allow_ptrace(-1)", st));
        }
    }
    DevshareExporter *ex = NULL;
    uint64_t phys[VMM_MAX_SEGMENTS];
    for (size_t i = 0; i < m.count; i++) {
        phys[i] = m.phys[i];
    }
    int32_t st = devshare_export_segments(DEVSHARE_BACKEND_CUDA, 0, (void *)(uintptr_t)m.va, phys,
                                          m.count, VMM_SEGMENT, fabric ? DEVSHARE_EXPORT_FABRIC : 0,
                                          &ex);
    if (st != DEVSHARE_STATUS_OK) {
        vmm_free(&m);
        free(host);
        return fail("%s", ds_error(why, sizeof why, "devshare_export_segments", st));
    }
    int64_t shape[1] = {n};
    DevshareTensorDesc desc;
    devshare_tensor_desc_init(&desc, sizeof desc);
    desc.dtype.code = DEVSHARE_DTYPE_FLOAT;
    desc.dtype.bits = 32;
    desc.dtype.lanes = 1;
    desc.ndim = 1;
    desc.shape = shape;
    desc.storage_offset = (uint64_t)offset;
    desc.storage_size = (uint64_t)n * 4;
    /* The encoding (and its length) first, then the handle struct, the table and the 'e' bytes. */
    size_t enc_len = 0, table_len = 0, torch_len = 0;
    uint8_t *enc = NULL, *table = NULL, *torch = NULL;
    char *text = NULL;
    DevshareHandle h;
    const char *call = "devshare_exporter_share_encoded (length)";
    st = devshare_exporter_share_encoded(ex, &desc, NULL, 0, &enc_len);
    if (st == DEVSHARE_STATUS_BUFFER_TOO_SMALL && (enc = malloc(enc_len)) != NULL) {
        call = "devshare_exporter_share_encoded";
        st = devshare_exporter_share_encoded(ex, &desc, enc, enc_len, &enc_len);
    }
    if (st == DEVSHARE_STATUS_OK) {
        call = "devshare_handle_decode";
        st = devshare_handle_decode(enc, enc_len, &h);
    }
    if (st == DEVSHARE_STATUS_OK) {
        call = "devshare_exporter_segment_table";
        st = devshare_exporter_segment_table(ex, NULL, 0, &table_len);
        /* OK with length 0: the table is inline (the handle holds it) */
        if (st == DEVSHARE_STATUS_BUFFER_TOO_SMALL && (table = malloc(table_len)) != NULL) {
            st = devshare_exporter_segment_table(ex, table, table_len, &table_len);
        }
    }
    if (st == DEVSHARE_STATUS_OK) {
        call = "devshare_torch_storage_handle_as";
        uint32_t fmt = DEVSHARE_TORCH_FORMAT_DEFAULT;
        st = torch_format(&fmt);
        if (st == DEVSHARE_STATUS_OK) {
            st = devshare_torch_storage_handle_as(&h, table, table_len, fmt, NULL, 0, &torch_len);
        }
        if (st == DEVSHARE_STATUS_BUFFER_TOO_SMALL && (torch = malloc(torch_len)) != NULL) {
            st = devshare_torch_storage_handle_as(&h, table, table_len, fmt, torch, torch_len, &torch_len);
        }
    }
    if (st == DEVSHARE_STATUS_OK && (text = text_of_encoding(enc, enc_len)) == NULL) {
        call = "base64";
        st = DEVSHARE_STATUS_INTERNAL;
    }
    if (st != DEVSHARE_STATUS_OK) {
        ds_error(why, sizeof why, call, st);
        devshare_exporter_close(ex, DEVSHARE_CLOSE_FORCE);
        vmm_free(&m);
        free(host);
        free(enc);
        free(table);
        free(torch);
        return fail("%s", why);
    }
    printf("SEGMENTS count=%zu segment_size=%d kind=%s table=%s\n", m.count, VMM_SEGMENT,
           fabric ? "fabric" : "fd", table_len ? "external" : "inline");
    printf("HANDLE %s\n", text);
    printf("TORCH %d ", (int)h.device_index);
    print_hex(torch, torch_len);
    printf(" %" PRIu64 " %" PRIu64 " ", h.storage_size, h.storage_offset);
    print_hex(h.ref_name, h.ref_name_len);
    printf(" %" PRIu64 " ", h.ref_slot);
    static const uint8_t no_event[DEVSHARE_EVENT_HANDLE_SIZE];
    print_hex(no_event, sizeof no_event);
    printf(" 0\n");
    fflush(stdout);
    free(enc);
    free(table);
    free(torch);
    free(text);

    st = devshare_exporter_wait(ex, timeout_ms);
    uint64_t left = 0;
    devshare_exporter_outstanding(ex, &left);
    int released = st == DEVSHARE_STATUS_OK;
    if (released) {
        printf("RELEASED outstanding=%" PRIu64 "\n", left);
    } else if (st == DEVSHARE_STATUS_TIMEOUT) {
        printf("TIMEOUT outstanding=%" PRIu64 "\n", left);
    } else {
        printf("FAIL %s\n", ds_error(why, sizeof why, "devshare_exporter_wait", st));
    }
    fflush(stdout);
    rc = cu.cuMemcpyDtoH_v2(host, m.va, total);
    if (rc == 0) {
        printf("AFTER first=%.9g last=%.9g pad=%.9g\n", (double)win[0], (double)win[n - 1],
               offset >= 4 ? (double)win[-1] : -1.0);
    } else {
        printf("FAIL %s\n", cu_error(why, sizeof why, "cuMemcpyDtoH_v2", rc));
        released = 0;
    }
    /* Closing the exporter closes its fds; then unmap, release, free the range. */
    st = devshare_exporter_close(ex, released ? 0 : DEVSHARE_CLOSE_FORCE);
    if (st != DEVSHARE_STATUS_OK) {
        printf("FAIL %s\n", ds_error(why, sizeof why, "devshare_exporter_close", st));
        released = 0;
    }
    vmm_free(&m);
    free(host);
    fflush(stdout);
    return released ? 0 : 1;
}

/* --- Pools over a channel (produce-pool, consume-pool) ----------------------------------- */

enum { POOL_MAX_SLOTS = 64 };

/* The value produce-pool writes at element j of item i: exact in float32 (below 2^23, and so is
 * 2 * value + 1), different for consecutive items in every element, and for nearby elements. */
static float pool_value(int64_t item, uint64_t j) {
    return (float)((item % 4096) + (int64_t)(j % 1024) * 4096);
}

static void pool_fill(float *buf, uint64_t n, int64_t item) {
    for (uint64_t j = 0; j < n; j++) {
        buf[j] = pool_value(item, j);
    }
}

/* Elements of buf that differ from item `item`'s pattern: -1 when all match, else the first. */
static int64_t pool_mismatch(const float *buf, uint64_t n, int64_t item) {
    for (uint64_t j = 0; j < n; j++) {
        if (buf[j] != pool_value(item, j)) {
            return (int64_t)j;
        }
    }
    return -1;
}

static int cmd_produce_pool(char **argv) {
    const char *kind = argv[0], *address = argv[1];
    int64_t slots = 0, n = 0, items = 0, timeout_ms = 0;
    int is_cuda = strcmp(kind, "cuda") == 0, is_vmm = strcmp(kind, "vmm") == 0,
        is_host = strcmp(kind, "host") == 0;
    if (!(is_cuda || is_vmm || is_host) || parse_i64(argv[2], &slots) != 0 || slots < 1 ||
        slots > POOL_MAX_SLOTS || parse_i64(argv[3], &n) != 0 || n <= 0 || n > (INT64_C(1) << 32) ||
        parse_i64(argv[4], &items) != 0 || items < 0 || parse_i64(argv[5], &timeout_ms) != 0 ||
        timeout_ms <= 0 || timeout_ms > INT32_MAX) {
        return fail("usage: produce-pool <cuda|vmm|host> <address> <slots 1..%d> <slot-floats> <items> "
                    "<timeout-ms>", POOL_MAX_SLOTS);
    }
    const size_t slot_bytes = (size_t)n * sizeof(float), total = (size_t)slots * slot_bytes;
    if (!is_host && cuda_setup() != 0) {
        return 1;
    }
    char why[2048];
    float *buf = malloc(slot_bytes);
    double *fill_us = malloc(((size_t)items + 1) * sizeof *fill_us);
    if (buf == NULL || fill_us == NULL) {
        free(buf);
        free(fill_us);
        return fail("out of host memory");
    }
    static struct vmm m;
    CUdeviceptr dbase = 0;
    void *base = NULL;
    DevshareExporter *ex = NULL;
    DevshareChannel *ch = NULL;
    DevsharePool *pool = NULL;
    int32_t st = DEVSHARE_STATUS_OK;
    int ok = 0;
    const char *call = "";
    if (is_cuda) {
        CUresult rc = cu.cuMemAlloc_v2(&dbase, total);
        if (rc != 0) {
            dbase = 0;
            fail("%s", cu_error(why, sizeof why, "cuMemAlloc_v2", rc));
            goto out;
        }
        base = (void *)(uintptr_t)dbase;
        call = "devshare_export";
        st = devshare_export(DEVSHARE_BACKEND_CUDA, 0, base, total, 0, &ex);
    } else if (is_vmm) {
        m.count = (total + VMM_SEGMENT - 1) / VMM_SEGMENT;
        if (m.count > VMM_MAX_SEGMENTS) {
            fail("produce-pool: %zu bytes need more than %d segments", total, VMM_MAX_SEGMENTS);
            goto out;
        }
        if (vmm_build(&m, 0, why, sizeof why) != 0) {
            fail("%s", why);
            goto out;
        }
        base = (void *)(uintptr_t)m.va;
        static uint64_t phys[VMM_MAX_SEGMENTS];
        for (size_t i = 0; i < m.count; i++) {
            phys[i] = m.phys[i];
        }
        call = "devshare_export_segments";
        st = devshare_export_segments(DEVSHARE_BACKEND_CUDA, 0, base, phys, m.count, VMM_SEGMENT, 0, &ex);
    } else {
        call = "devshare_channel_host_alloc";
        st = devshare_channel_host_alloc(total, &ex, &base);
    }
    if (st == DEVSHARE_STATUS_OK) {
        call = "devshare_channel_listen";
        st = devshare_channel_listen(address, &ch);
    }
    if (st == DEVSHARE_STATUS_OK) {
        call = "devshare_pool_create";
        st = devshare_pool_create(ch, ex, slot_bytes, (uint32_t)slots, &pool);
    }
    uint32_t pool_id = 0;
    if (st == DEVSHARE_STATUS_OK) {
        call = "devshare_pool_id";
        st = devshare_pool_id(pool, &pool_id);
    }
    if (st != DEVSHARE_STATUS_OK) {
        fail("%s", ds_error(why, sizeof why, call, st));
        goto out;
    }
    printf("READY kind=%s pool=%u slots=%" PRId64 " slot_bytes=%zu base=0x%" PRIxPTR " segments=%zu\n", kind,
           pool_id, slots, slot_bytes, (uintptr_t)base, is_vmm ? m.count : (size_t)0);
    fflush(stdout);
    uint64_t peer = 0;
    size_t npeers = 0;
    st = devshare_channel_wait_peers(ch, 1, (int32_t)timeout_ms);
    if (st == DEVSHARE_STATUS_OK) {
        st = devshare_channel_peer_ids(ch, &peer, 1, &npeers);
    }
    if (st != DEVSHARE_STATUS_OK) {
        fail("%s", ds_error(why, sizeof why, "no consumer: devshare_channel_wait_peers", st));
        goto out;
    }
    int64_t shape[1] = {n};
    DevshareTensorDesc desc;
    devshare_tensor_desc_init(&desc, sizeof desc);
    desc.dtype.code = DEVSHARE_DTYPE_FLOAT;
    desc.dtype.bits = 32;
    desc.dtype.lanes = 1;
    desc.ndim = 1;
    desc.shape = shape;
    int64_t uses[POOL_MAX_SLOTS] = {0};
    for (int64_t i = 0; i < items; i++) {
        uint32_t slot = 0;
        void *p = NULL;
        st = devshare_pool_acquire(pool, (int32_t)timeout_ms, &slot, &p);
        if (st != DEVSHARE_STATUS_OK) {
            fail("item %" PRId64 ": %s", i, ds_error(why, sizeof why, "devshare_pool_acquire", st));
            goto out;
        }
        if (slot >= (uint32_t)slots || (char *)p != (char *)base + (size_t)slot * slot_bytes) {
            fail("item %" PRId64 ": slot %u at %p, expected base %p + slot x %zu", i, slot, p, base, slot_bytes);
            goto out;
        }
        double t0 = now_us();
        pool_fill(buf, (uint64_t)n, i);
        if (is_host) {
            memcpy(p, buf, slot_bytes);
        } else {
            /* A pageable copy may return before the DMA lands: synchronise before the send. */
            CUresult rc = cu.cuMemcpyHtoD_v2((CUdeviceptr)(uintptr_t)p, buf, slot_bytes);
            if (rc == 0) {
                rc = cu.cuCtxSynchronize();
            }
            if (rc != 0) {
                fail("item %" PRId64 ": %s", i, cu_error(why, sizeof why, "cuMemcpyHtoD_v2", rc));
                goto out;
            }
        }
        fill_us[i] = now_us() - t0;
        st = devshare_pool_send(pool, slot, peer, &desc);
        if (st != DEVSHARE_STATUS_OK) {
            fail("item %" PRId64 ": %s", i, ds_error(why, sizeof why, "devshare_pool_send", st));
            goto out;
        }
        uses[slot]++;
    }
    /* Every slot back (the consumer released every item), then close the pool and wait for the
     * consumer to detach (or hang up): its attachment counts as a reference of the export. */
    int64_t deadline = now_ms() + timeout_ms;
    uint32_t free_slots = 0;
    for (;;) {
        st = devshare_pool_info(pool, NULL, NULL, &free_slots);
        if (st != DEVSHARE_STATUS_OK || free_slots == (uint32_t)slots || now_ms() > deadline) {
            break;
        }
        devshare_channel_service(ch, 50);
    }
    if (st != DEVSHARE_STATUS_OK || free_slots != (uint32_t)slots) {
        fail("%u of %" PRId64 " slots came back within %" PRId64 " ms after the last item", free_slots, slots,
             timeout_ms);
        goto out;
    }
    devshare_pool_close(pool);
    pool = NULL;
    st = devshare_exporter_wait(ex, (int32_t)timeout_ms);
    if (st != DEVSHARE_STATUS_OK) {
        fail("%s", ds_error(why, sizeof why, "the consumer did not detach: devshare_exporter_wait", st));
        goto out;
    }
    printf("DONE items=%" PRId64 " uses=", items);
    for (int64_t s = 0; s < slots; s++) {
        printf("%s%" PRId64, s ? "," : "", uses[s]);
    }
    printf(" ");
    print_stats("FILL_US", fill_us, (size_t)items);
    ok = 1;
out:
    fflush(stdout);
    devshare_pool_close(pool);
    devshare_channel_close(ch);
    if (ex != NULL && (st = devshare_exporter_close(ex, ok ? 0 : DEVSHARE_CLOSE_FORCE)) != DEVSHARE_STATUS_OK) {
        if (ok) {
            fail("%s", ds_error(why, sizeof why, "devshare_exporter_close", st));
        }
        ok = 0;
        devshare_exporter_close(ex, DEVSHARE_CLOSE_FORCE);
    }
    if (is_vmm) {
        vmm_free(&m);
    } else if (is_cuda && dbase != 0 && ok) {
        cu.cuMemFree_v2(dbase); /* not freed under a consumer that may still map it */
    }
    free(buf);
    free(fill_us);
    fflush(stdout);
    return ok ? 0 : 1;
}

static int cmd_consume_pool(int argc, char **argv) {
    int64_t items = 0, timeout_ms = 0;
    int host = argc >= 4 && strcmp(argv[3], "host") == 0;
    int touch = argc >= 4 && strcmp(argv[3], "touch") == 0;
    if (parse_i64(argv[1], &items) != 0 || items <= 0 || parse_i64(argv[2], &timeout_ms) != 0 ||
        timeout_ms <= 0 || timeout_ms > INT32_MAX || (argc >= 4 && !host && !touch)) {
        return fail("usage: consume-pool <address> <items> <timeout-ms> [host|touch]");
    }
    if (!host && cuda_setup() != 0) {
        return 1;
    }
    char why[2048];
    DevshareConnection *conn = NULL;
    int32_t st = devshare_channel_connect(argv[0], (int32_t)timeout_ms, &conn);
    if (st != DEVSHARE_STATUS_OK) {
        return fail("%s", ds_error(why, sizeof why, "devshare_channel_connect", st));
    }
    uintptr_t slot_addr[POOL_MAX_SLOTS] = {0}, base = 0;
    int64_t seen[POOL_MAX_SLOTS] = {0};
    uint32_t pool_id = 0;
    float *buf = NULL;
    size_t cap = 0;
    int ok = 0;
    for (int64_t i = 0; i < items; i++) {
        DevshareImport *imp = NULL;
        st = devshare_connection_recv(conn, (int32_t)timeout_ms, &imp);
        if (st != DEVSHARE_STATUS_OK) {
            fail("item %" PRId64 ": %s", i, ds_error(why, sizeof why, "devshare_connection_recv", st));
            goto out;
        }
        uint32_t pid = 0, slot = 0;
        CUdeviceptr data = 0;
        uint64_t numel = 0;
        DevshareImportInfo info;
        devshare_import_info_init(&info, sizeof info);
        st = devshare_import_pool_slot(imp, &pid, &slot);
        if (st != DEVSHARE_STATUS_OK) {
            ds_error(why, sizeof why, "devshare_import_pool_slot (not a pool item?)", st);
        } else if ((st = devshare_import_info(imp, &info)) != DEVSHARE_STATUS_OK) {
            ds_error(why, sizeof why, "devshare_import_info", st);
        } else if (info.backend != (host ? DEVSHARE_BACKEND_HOST : DEVSHARE_BACKEND_CUDA)) {
            snprintf(why, sizeof why, "item backend %u", info.backend);
            st = DEVSHARE_STATUS_INVALID_ARGUMENT;
        } else if (host) {
            data = (CUdeviceptr)(uintptr_t)info.data;
            numel = info.numel;
        } else if (float_view(imp, &data, &numel, why, sizeof why) != 0) {
            st = DEVSHARE_STATUS_INVALID_ARGUMENT;
        }
        if (st == DEVSHARE_STATUS_OK && (slot >= POOL_MAX_SLOTS || (pool_id != 0 && pid != pool_id))) {
            snprintf(why, sizeof why, "pool %u slot %u (first item's pool %u)", pid, slot, pool_id);
            st = DEVSHARE_STATUS_INVALID_ARGUMENT;
        }
        size_t bytes = (size_t)numel * sizeof(float);
        if (st == DEVSHARE_STATUS_OK && bytes > cap) {
            free(buf);
            cap = bytes;
            if ((buf = malloc(cap)) == NULL) {
                snprintf(why, sizeof why, "out of host memory");
                st = DEVSHARE_STATUS_INVALID_ARGUMENT;
            }
        }
        if (st == DEVSHARE_STATUS_OK) {
            pool_id = pid;
            /* Fixed addresses: a slot's address never changes, and every slot lies in one
             * mapping of the whole allocation (slot k at base + k x slot bytes). */
            uintptr_t a = (uintptr_t)data, b = a - (uintptr_t)slot * bytes;
            if ((slot_addr[slot] != 0 && slot_addr[slot] != a) || (base != 0 && base != b)) {
                snprintf(why, sizeof why, "slot %u moved: 0x%" PRIxPTR " (before 0x%" PRIxPTR "), base 0x%" PRIxPTR
                         " (before 0x%" PRIxPTR ")", slot, a, slot_addr[slot], b, base);
                st = DEVSHARE_STATUS_INVALID_ARGUMENT;
            }
            slot_addr[slot] = a;
            base = b;
            seen[slot]++;
        }
        int64_t bad = -1;
        if (st == DEVSHARE_STATUS_OK && touch && numel > 0) {
            /* The first and the last element only (what a benchmark's consumer reads). */
            CUresult rc = cu.cuMemcpyDtoH_v2(&buf[0], data, sizeof(float));
            if (rc == 0) {
                rc = cu.cuMemcpyDtoH_v2(&buf[numel - 1], data + (numel - 1) * sizeof(float), sizeof(float));
            }
            if (rc != 0) {
                cu_error(why, sizeof why, "cuMemcpyDtoH_v2", rc);
                st = DEVSHARE_STATUS_INVALID_ARGUMENT;
            } else if (buf[0] != pool_value(i, 0)) {
                bad = 0;
            } else if (buf[numel - 1] != pool_value(i, numel - 1)) {
                bad = (int64_t)numel - 1;
            }
        } else if (st == DEVSHARE_STATUS_OK) {
            if (host) {
                memcpy(buf, (const void *)(uintptr_t)data, bytes);
            } else {
                CUresult rc = cu.cuMemcpyDtoH_v2(buf, data, bytes);
                if (rc != 0) {
                    cu_error(why, sizeof why, "cuMemcpyDtoH_v2", rc);
                    st = DEVSHARE_STATUS_INVALID_ARGUMENT;
                }
            }
            bad = st == DEVSHARE_STATUS_OK ? pool_mismatch(buf, numel, i) : -1;
        }
        if (bad >= 0) {
            snprintf(why, sizeof why, "item %" PRId64 " (slot %u) element %" PRId64 " is %.9g, expected %.9g", i, slot,
                     bad, (double)buf[bad], (double)pool_value(i, (uint64_t)bad));
            st = DEVSHARE_STATUS_INVALID_ARGUMENT;
        }
        int32_t rst = devshare_import_release(imp);
        if (st != DEVSHARE_STATUS_OK) {
            fail("item %" PRId64 ": %s", i, why);
            goto out;
        }
        if (rst != DEVSHARE_STATUS_OK) {
            fail("item %" PRId64 ": %s", i, ds_error(why, sizeof why, "devshare_import_release", rst));
            goto out;
        }
    }
    printf("OK items=%" PRId64 " pool=%u base=0x%" PRIxPTR " slots=", items, pool_id, base);
    for (int s = 0; s < POOL_MAX_SLOTS; s++) {
        if (seen[s]) {
            printf("%d:0x%" PRIxPTR "x%" PRId64 " ", s, slot_addr[s], seen[s]);
        }
    }
    printf("\n");
    ok = 1;
out:
    free(buf);
    devshare_connection_close(conn);
    fflush(stdout);
    return ok ? 0 : 1;
}

static int cmd_serve(void) {
    if (cuda_setup() != 0) {
        return 1;
    }
    printf("READY\n");
    fflush(stdout);
    char *line = NULL;
    size_t cap = 0;
    char why[2048];
    while (getline(&line, &cap, stdin) > 0) {
        char *save = NULL;
        char *text = strtok_r(line, " \t\r\n", &save);
        if (text == NULL) {
            continue;
        }
        DevshareImport *imp = NULL;
        CUdeviceptr data = 0;
        uint64_t numel = 0;
        float first = 0;
        if (import_text(text, &imp, why, sizeof why) != 0) {
            printf("FAIL %s\n", why);
        } else if (float_view(imp, &data, &numel, why, sizeof why) != 0) {
            devshare_import_release(imp);
            printf("FAIL %s\n", why);
        } else {
            CUresult rc = numel > 0 ? cu.cuMemcpyDtoH_v2(&first, data, sizeof first) : 0;
            int32_t st = devshare_import_release(imp);
            if (rc != 0) {
                printf("FAIL %s\n", cu_error(why, sizeof why, "cuMemcpyDtoH_v2", rc));
            } else if (st != DEVSHARE_STATUS_OK) {
                printf("FAIL %s\n", ds_error(why, sizeof why, "devshare_import_release", st));
            } else {
                printf("OK %.9g\n", (double)first);
            }
        }
        fflush(stdout);
    }
    free(line);
    return 0;
}

static int cmd_bench_import(char **argv) {
    int64_t iters = 0;
    if (parse_i64(argv[1], &iters) != 0 || iters <= 0 || iters > 1000000) {
        return fail("usage: bench-import <text-handle> <iterations>");
    }
    if (cuda_setup() != 0) {
        return 1;
    }
    char why[2048];
    DevshareHandle h, cold;
    int32_t st = devshare_handle_from_text(argv[0], &h);
    if (st != DEVSHARE_STATUS_OK) {
        return fail("%s", ds_error(why, sizeof why, "devshare_handle_from_text", st));
    }
    /* The same handle without its reference: importing and releasing it never returns the
     * producer's reference, so it can be repeated. */
    cold = h;
    cold.ref_name_len = 0;
    cold.ref_slot = 0;
    memset(cold.ref_name, 0, sizeof cold.ref_name);
    DevshareImportOptions opt;
    devshare_import_options_init(&opt, sizeof opt);
    opt.stream = g_stream;
    double *t = malloc((size_t)iters * sizeof *t);
    if (t == NULL) {
        return fail("out of host memory");
    }
    DevshareImport *imp = NULL;
    for (int64_t i = -1; i < iters; i++) {
        double t0 = now_us();
        st = devshare_import(&cold, &opt, &imp);
        if (st == DEVSHARE_STATUS_OK) {
            st = devshare_import_release(imp);
        }
        double dt = now_us() - t0;
        if (st != DEVSHARE_STATUS_OK) {
            free(t);
            return fail("cold round %" PRId64 ": %s", i,
                        ds_error(why, sizeof why, "devshare_import/release", st));
        }
        if (i < 0) {
            printf("FIRST_US %.1f\n", dt);
        } else {
            t[i] = dt;
        }
    }
    print_stats("COLD_US", t, (size_t)iters);
    DevshareImport *held = NULL;
    st = devshare_import(&h, &opt, &held);
    if (st != DEVSHARE_STATUS_OK) {
        free(t);
        return fail("%s", ds_error(why, sizeof why, "devshare_import (held)", st));
    }
    for (int64_t i = 0; i < iters; i++) {
        double t0 = now_us();
        st = devshare_import(&h, &opt, &imp);
        if (st == DEVSHARE_STATUS_OK) {
            st = devshare_import_release(imp);
        }
        t[i] = now_us() - t0;
        if (st != DEVSHARE_STATUS_OK) {
            devshare_import_release(held);
            free(t);
            return fail("cached round %" PRId64 ": %s", i,
                        ds_error(why, sizeof why, "devshare_import/release", st));
        }
    }
    print_stats("CACHED_US", t, (size_t)iters);
    free(t);
    st = devshare_import_release(held);
    if (st != DEVSHARE_STATUS_OK) {
        return fail("%s", ds_error(why, sizeof why, "devshare_import_release (held)", st));
    }
    printf("RELEASED\n");
    return 0;
}

static int cmd_describe(const char *text) {
    DevshareHandle h;
    char why[2048];
    int32_t st = devshare_handle_from_text(text, &h);
    if (st != DEVSHARE_STATUS_OK) {
        return fail("%s", ds_error(why, sizeof why, "devshare_handle_from_text", st));
    }
    printf("DESC backend=%u flags=%u device=%d pid=%d dtype=%u/%u/%u ndim=%u shape=", h.backend,
           h.flags, h.device_index, h.producer_pid, h.dtype.code, h.dtype.bits, h.dtype.lanes,
           h.ndim);
    for (uint32_t i = 0; i < h.ndim; i++) {
        printf("%s%" PRId64, i ? "," : "", h.shape[i]);
    }
    printf(" strides=");
    for (uint32_t i = 0; i < h.ndim; i++) {
        printf("%s%" PRId64, i ? "," : "", h.strides[i]);
    }
    printf(" alloc_size=%" PRIu64 " storage_offset=%" PRIu64 " storage_size=%" PRIu64
           " tensor_offset=%" PRId64 " key_len=%u key=",
           h.alloc_size, h.storage_offset, h.storage_size, h.tensor_offset, h.key_len);
    print_hex(h.key, h.key_len);
    printf(" ref_name=%.*s ref_slot=%" PRIu64 " event=", (int)h.ref_name_len,
           (const char *)h.ref_name, h.ref_slot);
    print_hex(h.event_handle, (h.flags & DEVSHARE_HANDLE_FLAG_EVENT) ? sizeof h.event_handle : 0);
    /* A segmented handle's description: the DEVSHARE_EXT_SEGMENTS record in ext,
     * {u64 segment_size; u32 count; u16 kind; u16 flags; u32 table_crc} (little-endian). */
    for (size_t i = 0; (h.flags & DEVSHARE_HANDLE_FLAG_SEGMENTED) && i + 4 <= h.ext_len;) {
        unsigned type = h.ext[i] | (unsigned)h.ext[i + 1] << 8;
        size_t len = h.ext[i + 2] | (size_t)h.ext[i + 3] << 8;
        const uint8_t *d = h.ext + i + 4;
        if (type == DEVSHARE_EXT_SEGMENTS && len == 20 && i + 4 + len <= h.ext_len) {
            uint64_t size = 0;
            uint32_t count = 0;
            for (int b = 7; b >= 0; b--) {
                size = size << 8 | d[b];
            }
            for (int b = 3; b >= 0; b--) {
                count = count << 8 | d[8 + b];
            }
            unsigned kind = d[12] | (unsigned)d[13] << 8, flags = d[14] | (unsigned)d[15] << 8;
            printf(" segments=%ux%" PRIu64 "/%s/%s", count, size,
                   kind == DEVSHARE_SEGMENTS_ACL       ? "acl"
                   : kind == DEVSHARE_SEGMENTS_CUDA_FD ? "fd"
                   : kind == DEVSHARE_SEGMENTS_CUDA_FABRIC ? "fabric"
                                                           : "?",
                   (flags & DEVSHARE_SEGMENTS_INLINE) ? "inline" : "external");
            break;
        }
        i += 4 + len;
    }
    printf("\n");
    return 0;
}

/* What the C compiler makes of every struct, field, macro and status code of devshare.h: the
 * lines of tests/c/abi_fields.h's abi_layout_print (the one list behind tests/c/layout_dump.c
 * too); the dry run checks them against the header and the ctypes mirrors. */
static int cmd_layout(void) {
    abi_layout_print(stdout);
    return 0;
}

static int usage(void) {
    fprintf(stderr,
            "usage: gpu_tool consume <text-handle> <nfloats-to-check> <expect-start> <write-value>\n"
            "       gpu_tool consume-many            (lines of the above arguments on stdin)\n"
            "       gpu_tool produce <nfloats> <start> <timeout-ms> [sync|event]\n"
            "       gpu_tool produce-vmm <nsegments> <nfloats> <offset-bytes> <start> <timeout-ms>\n"
            "                            [fabric] [allow-ptrace]\n"
            "       gpu_tool produce-pool <cuda|vmm|host> <address> <slots> <slot-floats> <items> <timeout-ms>\n"
            "       gpu_tool consume-pool <address> <items> <timeout-ms> [host|touch]\n"
            "       gpu_tool serve                   (handles on stdin, one per line)\n"
            "       gpu_tool bench-import <text-handle> <iterations>\n"
            "       gpu_tool describe <text-handle>\n"
            "       gpu_tool layout\n");
    return 2;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        return usage();
    }
    const char *cmd = argv[1];
    int rest = argc - 2;
    char **args = argv + 2;
    int rc;
    if (strcmp(cmd, "consume") == 0 && rest == 4) {
        rc = cmd_consume(args);
    } else if (strcmp(cmd, "consume-many") == 0 && rest == 0) {
        rc = cmd_consume_many();
    } else if (strcmp(cmd, "produce") == 0 && (rest == 3 || rest == 4)) {
        rc = cmd_produce(rest, args);
    } else if (strcmp(cmd, "produce-vmm") == 0 && rest >= 5 && rest <= 7) {
        rc = cmd_produce_vmm(rest, args);
    } else if (strcmp(cmd, "produce-pool") == 0 && rest == 6) {
        rc = cmd_produce_pool(args);
    } else if (strcmp(cmd, "consume-pool") == 0 && (rest == 3 || rest == 4)) {
        rc = cmd_consume_pool(rest, args);
    } else if (strcmp(cmd, "serve") == 0 && rest == 0) {
        rc = cmd_serve();
    } else if (strcmp(cmd, "bench-import") == 0 && rest == 2) {
        rc = cmd_bench_import(args);
    } else if (strcmp(cmd, "describe") == 0 && rest == 1) {
        rc = cmd_describe(args[0]);
    } else if (strcmp(cmd, "layout") == 0 && rest == 0) {
        rc = cmd_layout();
    } else {
        return usage();
    }
    fflush(stdout);
    return rc;
}
