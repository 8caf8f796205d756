/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_cuda_vmm: segmented (VMM, PyTorch "expandable segments") CUDA memory between separate
 * processes, over the strict CUDA driver stand-in (tests/standin/cuda), whose
 * cuMemExportToShareableHandle returns real memfd file descriptors, so consumers really take them
 * with pidfd_open + pidfd_getfd, and whose mapped memory stays PROT_NONE until cuMemSetAccess.
 *
 * The parent is a C producer: it builds buffers with cuMemCreate (requestedHandleTypes POSIX fd,
 * or fabric too), reserves, maps, sets access, fills element i (uint32) with i, and exports them
 * with devshare_export_segments. Consumers are this program re-executed with "--child": the
 * producer's CHILDREN, so under Yama ptrace_scope = 1 they may take its fds only once the
 * producer names them with devshare_allow_ptrace (done before every request). Commands, one line
 * each:
 *   import text|enc|torch <import flags> <write 0|1> <hold 0|1> <bias> <payload> -> "OK <numel> <device> <access>"
 *     text: handle text (devshare_import); enc: hex of the byte encoding (devshare_import_encoded);
 *     torch: "<device> <rows> <cols> <tensor offset> <storage size> <storage offset> <slot>
 *     <ref name> <hex 'e' storage handle>" (devshare_import_torch, as PyTorch's tuple carries it).
 *     The consumer checks every element through cuMemcpyDtoH: the k-th is bias + first + k, where
 *     first is the tensor's element offset in the mapping (bias: the element index of the
 *     mapping's start in the producer's buffer); with write 1 it then writes the complements.
 *   state   -> "OK <reservations> <mappings> <handle refs> <imported handles> <allocations> <open fds> <violations>"
 *   release -> "OK <n released>"
 *   quit
 *
 * When the test runs with CAP_SYS_PTRACE (as root), every process drops it first, so the
 * kernel's ordinary ptrace rules apply (same uid, dumpable producer) and the non-dumpable
 * producer is really refused. At the end the stand-in's violation log must be empty.
 *
 * Needs DEVSHARE_CUDA_LIBRARY pointing at the stand-in (CTest sets it).
 */
#define _GNU_SOURCE

#include "cuda_standin.h"
#define HARNESS_NAME "test_cuda_vmm"
#include "device_harness.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <sys/prctl.h>
#include <sys/syscall.h>

#define CU_OK(call)                                                                                               \
    do {                                                                                                          \
        CUresult rc_ = (call);                                                                                    \
        if (rc_ != CUDA_SUCCESS) {                                                                                \
            fprintf(stderr, "test_cuda_vmm: %s = %d\n", #call, (int)rc_);                                         \
            exit(2);                                                                                              \
        }                                                                                                         \
    } while (0)

#define SEG ((size_t)DEVSHARE_SEGMENT_GRANULARITY) /* 2 MiB segments */
enum { LINE_MAX_LEN = 1 << 16, MAX_SEGS = 64 };

/* ---------------------------------------------------------------------------------------- */
/* Shared by both sides */

static void make_current(int ordinal) {
    static CUcontext ctx[8];
    if (!ctx[ordinal]) {
        CUdevice dev;
        CU_OK(cuDeviceGet(&dev, ordinal));
        CU_OK(cuDevicePrimaryCtxRetain(&ctx[ordinal], dev));
    }
    CU_OK(cuCtxSetCurrent(ctx[ordinal]));
}

/* ---------------------------------------------------------------------------------------- */
/* Child: a consumer serving commands */

static int child_check(DevshareImport *imp, int write, uint64_t bias, char *why, size_t cap, DevshareImportInfo *info) {
    DS_OK(devshare_import_info_init(info, sizeof *info));
    DS_OK(devshare_import_info(imp, info));
    const uint64_t n = info->numel;
    uint32_t *host = malloc(n ? n * 4u : 4u);
    make_current(info->device);
    const CUdeviceptr data = (CUdeviceptr)(uintptr_t)info->data;
    if (n && cuMemcpyDtoH(host, data, n * 4u) != CUDA_SUCCESS) {
        snprintf(why, cap, "cuMemcpyDtoH of the tensor failed");
        free(host);
        return 0;
    }
    const uint64_t first = bias + (uint64_t)((char *)info->data - (char *)info->base) / 4u;
    for (uint64_t k = 0; k < n; k++) {
        if (host[k] != (uint32_t)(first + k)) {
            snprintf(why, cap, "element %" PRIu64 " is %u, expected %" PRIu64, k, host[k], first + k);
            free(host);
            return 0;
        }
    }
    if (write) {
        for (uint64_t k = 0; k < n; k++) {
            host[k] = ~(uint32_t)(first + k);
        }
        if (cuMemcpyHtoD(data, host, n * 4u) != CUDA_SUCCESS) {
            snprintf(why, cap, "cuMemcpyHtoD into the tensor failed");
            free(host);
            return 0;
        }
    }
    free(host);
    return 1;
}

static int32_t child_import_torch(const char *p, const DevshareImportOptions *o, DevshareImport **imp) {
    int device = 0, used = 0;
    long long rows = 0, cols = 0, toff = 0;
    unsigned long long ssize = 0, soff = 0, slot = 0;
    char ref[128];
    if (sscanf(p, "%d %lld %lld %lld %llu %llu %llu %127s %n", &device, &rows, &cols, &toff, &ssize, &soff, &slot, ref,
               &used) != 8) {
        return DEVSHARE_STATUS_INVALID_ARGUMENT;
    }
    static uint8_t bytes[LINE_MAX_LEN / 2];
    const int len = hex_decode(p + used, bytes, sizeof bytes);
    if (len < 0) {
        return DEVSHARE_STATUS_INVALID_ARGUMENT;
    }
    const int64_t shape[2] = {rows, cols};
    DevshareTorchArgs a;
    DS_OK(devshare_torch_args_init(&a, sizeof a));
    a.backend = DEVSHARE_BACKEND_CUDA;
    a.dtype.code = DEVSHARE_DTYPE_UINT;
    a.dtype.bits = 32;
    a.dtype.lanes = 1;
    a.ndim = 2;
    a.shape = shape;
    a.tensor_offset = toff;
    a.device = device;
    a.handle = bytes;
    a.handle_len = len;
    a.storage_size = ssize;
    a.storage_offset = soff;
    a.ref_name = (const uint8_t *)ref;
    a.ref_name_len = strlen(ref);
    a.ref_slot = slot;
    return devshare_import_torch(&a, o, imp);
}

static int child_main(void) {
    drop_ptrace_capability();
    CU_OK(cuInit(0));
    make_current(0);
    printf("PID %d %d\n", (int)getpid(), (int)getpid());
    fflush(stdout);
    DevshareImport *held[64];
    int n_held = 0;
    static char line[LINE_MAX_LEN];
    static uint8_t enc[LINE_MAX_LEN / 2];
    while (read_line_fd(0, line, sizeof line, IO_TIMEOUT_MS) > 0) {
        if (strncmp(line, "import ", 7) == 0) {
            char how[8];
            unsigned flags = 0;
            int write = 0, hold = 0, used = 0;
            unsigned long long bias = 0;
            if (sscanf(line + 7, "%7s %u %d %d %llu %n", how, &flags, &write, &hold, &bias, &used) != 5) {
                printf("ERR 0 bad command\n");
                fflush(stdout);
                continue;
            }
            const char *payload = line + 7 + used;
            DevshareImportOptions o;
            DS_OK(devshare_import_options_init(&o, sizeof o));
            o.flags = flags;
            DevshareImport *imp = NULL;
            int32_t st;
            if (strcmp(how, "text") == 0) {
                DevshareHandle h;
                st = devshare_handle_from_text(payload, &h);
                if (st == DEVSHARE_STATUS_OK) {
                    st = devshare_import(&h, &o, &imp);
                }
            } else if (strcmp(how, "enc") == 0) {
                const int n = hex_decode(payload, enc, sizeof enc);
                st = n < 0 ? DEVSHARE_STATUS_INVALID_ARGUMENT : devshare_import_encoded(enc, (size_t)n, &o, &imp);
            } else {
                st = child_import_torch(payload, &o, &imp);
            }
            if (st != DEVSHARE_STATUS_OK) {
                printf("ERR %d %s\n", st, last_error());
            } else {
                char why[256] = "";
                DevshareImportInfo info;
                if (!child_check(imp, write, bias, why, sizeof why, &info)) {
                    printf("ERR 0 data: %s\n", why);
                } else {
                    printf("OK %" PRIu64 " %d %d\n", info.numel, info.device,
                           cusi_vmm_access((CUdeviceptr)(uintptr_t)info.data, info.device));
                }
                if (hold && n_held < 64) {
                    held[n_held++] = imp;
                } else {
                    DS_OK(devshare_import_release(imp));
                }
            }
        } else if (strcmp(line, "state") == 0) {
            printf("OK %d %d %d %d %d %d %d\n", cusi_vmm_reservations(), cusi_vmm_mappings(), cusi_vmm_handles(),
                   cusi_vmm_imported_handles(), cusi_vmm_allocations(), open_fds(), cusi_violation_count());
        } else if (strcmp(line, "release") == 0) {
            for (int i = 0; i < n_held; i++) {
                DS_OK(devshare_import_release(held[i]));
            }
            printf("OK %d\n", n_held);
            n_held = 0;
        } else if (strcmp(line, "quit") == 0) {
            break;
        }
        fflush(stdout);
    }
    for (int i = 0; i < n_held; i++) {
        devshare_import_release(held[i]);
    }
    /* The exit code tells the parent whether this process broke a driver rule. */
    return cusi_violation_count() == 0 ? 0 : 3;
}

/* ---------------------------------------------------------------------------------------- */
/* Parent: the producer */

/* A VMM buffer of the producer: n segments of SEG bytes mapped back to back. */
typedef struct {
    CUdeviceptr va;
    size_t n;
    uint64_t h[MAX_SEGS]; /* CUmemGenericAllocationHandle, as devshare_export_segments takes them */
} Vmm;

/* cuMemCreate + reserve + map + read-write access, element i (uint32) = i. 0 when the driver
 * does not support the requested handle types. */
static int vmm_create(Vmm *v, size_t n, unsigned handle_types) {
    memset(v, 0, sizeof *v);
    v->n = n;
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = (CUmemAllocationHandleType)handle_types;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    size_t gran = 0;
    CU_OK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    if (SEG % gran) {
        die("granularity", (long)gran);
    }
    for (size_t i = 0; i < n; i++) {
        CUmemGenericAllocationHandle h = 0;
        const CUresult rc = cuMemCreate(&h, SEG, &prop, 0);
        if (rc == CUDA_ERROR_NOT_SUPPORTED && i == 0) {
            return 0;
        }
        CU_OK(rc);
        v->h[i] = h;
    }
    CU_OK(cuMemAddressReserve(&v->va, n * SEG, 0, 0, 0));
    for (size_t i = 0; i < n; i++) {
        CU_OK(cuMemMap(v->va + i * SEG, SEG, 0, v->h[i], 0));
    }
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof acc);
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = 0;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CU_OK(cuMemSetAccess(v->va, n * SEG, &acc, 1));
    const size_t words = n * SEG / 4;
    uint32_t *host = malloc(n * SEG);
    for (size_t i = 0; i < words; i++) {
        host[i] = (uint32_t)i;
    }
    CU_OK(cuMemcpyHtoD(v->va, host, n * SEG));
    free(host);
    return 1;
}

static void vmm_destroy(Vmm *v) {
    for (size_t i = 0; i < v->n; i++) {
        CU_OK(cuMemUnmap(v->va + i * SEG, SEG));
        CU_OK(cuMemRelease(v->h[i]));
    }
    CU_OK(cuMemAddressFree(v->va, v->n * SEG));
}

/* Elements [first, first + count) of the buffer: 1 when each is ~i (written == 1) or i. */
static int vmm_holds(const Vmm *v, uint64_t first, uint64_t count, int written) {
    uint32_t *host = malloc(count * 4);
    CU_OK(cuMemcpyDtoH(host, v->va + first * 4, count * 4));
    int ok = 1;
    for (uint64_t k = 0; k < count && ok; k++) {
        const uint32_t want = (uint32_t)(first + k);
        ok = host[k] == (written ? ~want : want);
    }
    free(host);
    return ok;
}

static void vmm_refill(const Vmm *v, uint64_t first, uint64_t count) {
    uint32_t *host = malloc(count * 4);
    for (uint64_t k = 0; k < count; k++) {
        host[k] = (uint32_t)(first + k);
    }
    CU_OK(cuMemcpyHtoD(v->va + first * 4, host, count * 4));
    free(host);
}

static DevshareExporter *export_vmm(const Vmm *v, size_t first_seg, size_t count, uint32_t flags) {
    DevshareExporter *e = NULL;
    DS_OK(devshare_export_segments(DEVSHARE_BACKEND_CUDA, 0, (void *)(uintptr_t)(v->va + first_seg * SEG),
                                   v->h + first_seg, count, SEG, flags, &e));
    return e;
}

static DevshareTensorDesc desc_u32(const int64_t *shape, uint64_t storage_offset, uint64_t storage_size,
                                   int64_t tensor_offset) {
    DevshareTensorDesc d;
    DS_OK(devshare_tensor_desc_init(&d, sizeof d));
    d.dtype.code = DEVSHARE_DTYPE_UINT;
    d.dtype.bits = 32;
    d.dtype.lanes = 1;
    d.ndim = 2;
    d.shape = shape;
    d.storage_offset = storage_offset;
    d.storage_size = storage_size;
    d.tensor_offset = tensor_offset;
    return d;
}

static DevshareHandle share_u32(DevshareExporter *e, uint64_t storage_offset, uint64_t storage_size, int64_t rows,
                                int64_t cols, int64_t tensor_offset) {
    const int64_t shape[2] = {rows, cols};
    DevshareTensorDesc d = desc_u32(shape, storage_offset, storage_size, tensor_offset);
    DevshareHandle h;
    DS_OK(devshare_exporter_share(e, &d, &h));
    return h;
}

/* The byte encoding of a fresh share (carries a long segment table), hex in `hex`; the struct
 * (without a long table) in *h. */
static void share_encoded_hex(DevshareExporter *e, uint64_t storage_offset, uint64_t storage_size, int64_t rows,
                              int64_t cols, int64_t tensor_offset, char *hex, DevshareHandle *h) {
    const int64_t shape[2] = {rows, cols};
    DevshareTensorDesc d = desc_u32(shape, storage_offset, storage_size, tensor_offset);
    static uint8_t buf[LINE_MAX_LEN / 4];
    size_t len = 0;
    DS_OK(devshare_exporter_share_encoded(e, &d, buf, sizeof buf, &len));
    DS_OK(devshare_handle_decode(buf, len, h));
    hex_encode(buf, len, hex);
}

/* Ask a consumer child (allowed to take our fds first: devshare_allow_ptrace). */
__attribute__((format(printf, 2, 3))) static const char *ask_child(Child *c, const char *fmt, ...) {
    DS_OK(devshare_allow_ptrace(c->os_pid));
    va_list ap;
    va_start(ap, fmt);
    const char *answer = vask(c, fmt, ap);
    va_end(ap);
    return answer;
}

static const char *import_text_at(Child *c, const DevshareHandle *h, unsigned flags, int write, int hold,
                                  uint64_t bias) {
    char text[DEVSHARE_HANDLE_MAX_TEXT_SIZE];
    DS_OK(devshare_handle_to_text(h, text, sizeof text, NULL));
    return ask_child(c, "import text %u %d %d %" PRIu64 " %s", flags, write, hold, bias, text);
}

static const char *import_text(Child *c, const DevshareHandle *h, unsigned flags, int write, int hold) {
    return import_text_at(c, h, flags, write, hold, 0);
}

/* The 'e' storage handle stock PyTorch's rebuild_cuda_tensor receives, hex; the padding bytes
 * after the pid are garbage, as PyTorch leaves them. */
static size_t torch_e_hex(const DevshareHandle *h, const uint8_t *table, size_t table_len, char *hex,
                          uint8_t *raw_out) {
    static uint8_t e[LINE_MAX_LEN / 4];
    size_t len = 0;
    DS_OK(devshare_torch_storage_handle(h, table, table_len, e, sizeof e, &len));
    memset(e + 6, 0xEE, 4);
    if (raw_out) {
        memcpy(raw_out, e, len < 64 ? len : 64);
    }
    hex_encode(e, len, hex);
    return len;
}

static const char *import_torch(Child *c, const DevshareHandle *h, const uint8_t *table, size_t table_len,
                                int64_t rows, int64_t cols, int write, int hold) {
    static char hex[LINE_MAX_LEN / 2];
    torch_e_hex(h, table, table_len, hex, NULL);
    /* The tuple's other fields are the handle's (devshare_handle_to_torch gives the same). */
    return ask_child(c, "import torch 0 %d %d 0 %d %lld %lld %lld %" PRIu64 " %" PRIu64 " %" PRIu64 " %.*s %s", write,
                     hold, h->device_index, (long long)rows, (long long)cols, (long long)h->tensor_offset,
                     h->storage_size, h->storage_offset, h->ref_slot, (int)h->ref_name_len,
                     (const char *)h->ref_name, hex);
}

/* A consumer's VMM state and open fd count. */
typedef struct {
    int resv, maps, handles, imported, allocs, fds, violations;
} State;

static State state_of(Child *c) {
    State s = {-1, -1, -1, -1, -1, -1, -1};
    const char *a = ask_child(c, "state");
    if (sscanf(a, "OK %d %d %d %d %d %d %d", &s.resv, &s.maps, &s.handles, &s.imported, &s.allocs, &s.fds,
               &s.violations) != 7) {
        printf("# bad state answer: %s\n", a);
    }
    return s;
}

static int is_clean(State s, int fds_before) {
    return s.resv == 0 && s.maps == 0 && s.handles == 0 && s.imported == 0 && s.allocs == 0 && s.fds == fds_before &&
           s.violations == 0;
}

static void show_state(const char *what, State s) {
    printf("# %s: %d reservations, %d mappings, %d handle refs, %d imported, %d allocations, %d fds, %d violations\n",
           what, s.resv, s.maps, s.handles, s.imported, s.allocs, s.fds, s.violations);
}

/* Whether fd `fd` of this process is stand-in VMM memory. */
static int fd_is_vmm_memory(int fd) {
    char path[64], link[256];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    const ssize_t n = readlink(path, link, sizeof link - 1);
    if (n <= 0) {
        return 0;
    }
    link[n] = '\0';
    return strstr(link, "cusi_vmm") != NULL || strstr(link, "cusi_f_") != NULL;
}

static int32_t table_fd(const DevshareHandle *h, size_t i) {
    int32_t fd;
    memcpy(&fd, h->key + 4 * i, 4);
    return fd;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--child") == 0) {
        return child_main();
    }
    if (!getenv("DEVSHARE_CUDA_LIBRARY")) {
        fprintf(stderr, "test_cuda_vmm: set DEVSHARE_CUDA_LIBRARY to the stand-in libcuda.so.1\n");
        return 2;
    }
    harness_start("test_cuda_vmm");
    (void)share_f32; /* the harness's float shares; here element i holds the uint32 i */
    drop_ptrace_capability();
    const int scope = read_ptrace_scope();
    printf("# Yama ptrace_scope: %d (-1: no Yama); uid %d\n", scope, (int)getuid());
    if (scope >= 2) {
        printf("ok - # SKIP Yama ptrace_scope %d: taking a producer's fds needs CAP_SYS_PTRACE here\n", scope);
        return 0;
    }

    DevshareBackendInfo bi;
    DS_OK(devshare_backend_info_init(&bi, sizeof bi));
    DS_OK(devshare_probe(DEVSHARE_BACKEND_CUDA, &bi));
    CHECK(bi.usable == 1, "probe: cuda usable over the stand-in (%s)", bi.detail);
    CU_OK(cuInit(0));
    make_current(0);
    const int parent_fds = open_fds();

    /* A 5-segment buffer (10 MiB), its handles exportable as POSIX fds. */
    Vmm a;
    vmm_create(&a, 5, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    const int a_fds = open_fds(); /* with the stand-in's own fd of each physical allocation */

    /* Export refusals, before any fd is made: physical handles out of order, non-VMM memory. */
    DevshareExporter *e = NULL;
    const uint64_t swapped[5] = {a.h[1], a.h[0], a.h[2], a.h[3], a.h[4]};
    int32_t st = devshare_export_segments(DEVSHARE_BACKEND_CUDA, 0, (void *)(uintptr_t)a.va, swapped, 5, SEG, 0, &e);
    CHECK(st == DEVSHARE_STATUS_INVALID_ARGUMENT && strstr(last_error(), "physical[0]"),
          "handles listed out of address order are refused, naming the segment (%s)", last_error());
    CUdeviceptr plain = 0;
    CU_OK(cuMemAlloc(&plain, 2 * SEG));
    st = devshare_export_segments(DEVSHARE_BACKEND_CUDA, 0, (void *)(uintptr_t)plain, a.h, 1, SEG, 0, &e);
    CHECK(st == DEVSHARE_STATUS_INVALID_ARGUMENT && strstr(last_error(), "not VMM memory"),
          "cuMemAlloc memory is refused as segments (%s)", last_error());
    CU_OK(cuMemFree(plain));
    CHECK(open_fds() == a_fds, "refused exports leave no fd open in the producer");

    /* The export: one fd per segment, kept open by the exporter, their numbers in the handle. */
    e = export_vmm(&a, 0, 5, 0);
    void *mem = NULL;
    uint64_t mem_size = 0;
    DS_OK(devshare_exporter_memory(e, &mem, &mem_size));
    CHECK(mem == (void *)(uintptr_t)a.va && mem_size == 5 * SEG, "the exporter reports the buffer (%p, %" PRIu64 ")",
          mem, mem_size);
    CHECK(open_fds() == a_fds + 5, "the exporter holds one fd per segment open (%d -> %d)", a_fds, open_fds());
    /* A tensor spanning three segments: storage from 4 KiB before the end of segment 0, tensor
     * offset 7 elements. */
    const uint64_t s_off = SEG - 4096, s_size = 2 * SEG + 8192;
    DevshareHandle h1 = share_u32(e, s_off, s_size, 1024, 1024, 7);
    int fds_ok = 1;
    for (size_t i = 0; i < 5; i++) {
        fds_ok &= fd_is_vmm_memory(table_fd(&h1, i));
    }
    CHECK((h1.flags & DEVSHARE_HANDLE_FLAG_SEGMENTED) && h1.producer_pid == getpid() && h1.alloc_size == 5 * SEG &&
              h1.key_len == 20 && h1.storage_offset == s_off && fds_ok &&
              memcmp(h1.device_uuid, (uint8_t[16]){0}, 16) != 0,
          "a segmented handle: the producer's pid, 5 x 2 MiB, an inline table of 5 open VMM fds, the device UUID");
    DevshareHandle h1b = share_u32(e, s_off, s_size, 1024, 1024, 7);
    CHECK(memcmp(h1b.key, h1.key, 20) == 0, "every share of an export carries the same fd numbers");

    /* Consumer 1: reads, overlapping storages, closes equal imports. */
    Child c1 = spawn(NULL, NULL);
    const int c1_fds = state_of(&c1).fds;
    const char *ans = import_text(&c1, &h1, 0, 0, 1);
    CHECK(strcmp(ans, "OK 1048576 0 3") == 0,
          "a consumer (the producer's child) imports a tensor spanning 3 segments and reads it right; its device "
          "has read-write access (%s)", ans);
    State s = state_of(&c1);
    CHECK(s.resv == 1 && s.maps == 5 && s.imported == 5 && s.handles == 5 && s.fds == c1_fds + 5 && s.violations == 0,
          "one reservation, 5 mappings, 5 imported handles; no stolen fd left open (only the driver's own)");
    show_state("consumer 1 after one import", s);
    DevshareHandle h2 = share_u32(e, 3 * SEG, SEG + 4096, 512, 512, 0); /* overlaps h1's storage */
    ans = import_text(&c1, &h2, 0, 0, 1);
    CHECK(strncmp(ans, "OK 262144 0", 11) == 0, "an overlapping storage of the same export reads right (%s)", ans);
    ans = import_text(&c1, &h1b, 0, 0, 1);
    CHECK(strncmp(ans, "OK 1048576 0", 12) == 0, "a second handle of the first storage reads right (%s)", ans);
    s = state_of(&c1);
    CHECK(s.resv == 1 && s.maps == 5 && s.imported == 5,
          "three imports of one export are one mapping (%d reservations, %d mappings)", s.resv, s.maps);

    /* A second exporter over segments 1..3 of the same buffer shares the producer's fds, so the
     * consumer imports each page once and maps the range again. */
    const int e2_fds = open_fds();
    DevshareExporter *e2 = export_vmm(&a, 1, 3, 0);
    CHECK(open_fds() == e2_fds, "a second export of the same pages opens no new fd (%d -> %d)", e2_fds, open_fds());
    DevshareHandle h3 = share_u32(e2, 0, 3 * SEG, 1536, 1024, 0);
    CHECK(memcmp(h3.key, h1.key + 4, 12) == 0, "its table holds the first export's fds of those pages");
    ans = import_text_at(&c1, &h3, 0, 0, 1, SEG / 4);
    CHECK(strncmp(ans, "OK 1572864 0", 12) == 0, "the overlapping export's tensor reads right (%s)", ans);
    s = state_of(&c1);
    CHECK(s.resv == 2 && s.maps == 8 && s.imported == 5 && s.allocs == 5,
          "two storages sharing pages: each page imported once (%d imported), mapped in both reservations (%d)",
          s.imported, s.maps);

    /* Writes reach the producer. */
    DevshareHandle hw = share_u32(e, SEG - 512, 1024, 1, 256, 0); /* crosses the segment 0/1 boundary */
    ans = import_text(&c1, &hw, 0, 1, 0);
    const uint64_t hw_first = (SEG - 512) / 4;
    CHECK(strncmp(ans, "OK 256 0", 8) == 0 && vmm_holds(&a, hw_first, 256, 1),
          "a consumer's writes across a segment boundary are the producer's bytes (%s)", ans);
    vmm_refill(&a, hw_first, 256);

    /* Read-only import: the device gets read access only. */
    DevshareHandle hr = share_u32(e, 0, 4096, 32, 32, 0);
    ans = import_text(&c1, &hr, DEVSHARE_IMPORT_READ_ONLY, 0, 0);
    CHECK(strcmp(ans, "OK 1024 0 1") == 0, "a read-only import maps with read access only (%s)", ans);

    /* Close order, then release: nothing stays mapped, reserved, imported or open. */
    CHECK(devshare_exporter_close(e, 0) == DEVSHARE_STATUS_BUSY, "the exporter cannot close while references are out");
    ans = ask_child(&c1, "release");
    CHECK(strcmp(ans, "OK 4") == 0, "the consumer releases its four imports (%s)", ans);
    s = state_of(&c1);
    CHECK(is_clean(s, c1_fds), "after release nothing is mapped, reserved or imported, and the consumer has as many "
                               "fds open as before its first import");
    show_state("consumer 1 after release", s);
    CHECK(outstanding(e) == 0 && outstanding(e2) == 0 && slot_value(&h1) == 0 && slot_value(&h3) == 0,
          "every reference came back (slots exactly 0)");

    /* The producer imports its own export (allowed for VMM memory) and sees its own bytes. */
    const int own_fds = open_fds();
    DevshareImport *own = NULL;
    DevshareHandle hs = share_u32(e, 3 * SEG, SEG + 4096, 512, 512, 0);
    st = devshare_import(&hs, NULL, &own);
    DevshareImportInfo oi;
    DS_OK(devshare_import_info_init(&oi, sizeof oi));
    if (st == DEVSHARE_STATUS_OK) {
        DS_OK(devshare_import_info(own, &oi));
    }
    CHECK(st == DEVSHARE_STATUS_OK && oi.base != mem && oi.numel == 262144, "the producer can import its own export (%s)",
          st ? last_error() : "ok");
    if (own) {
        uint32_t first = 0;
        CU_OK(cuMemcpyDtoH(&first, (CUdeviceptr)(uintptr_t)oi.data, 4));
        CHECK(first == 3 * SEG / 4, "through its own mapping (%u)", first);
        DS_OK(devshare_import_release(own));
    }
    CHECK(open_fds() == own_fds, "its stolen fds are closed (%d -> %d)", own_fds, open_fds());

    /* A table too long for the struct (40 segments = 160 bytes of fds): the byte encoding and
     * the PyTorch 'e' tuple carry it. */
    Vmm big;
    vmm_create(&big, 40, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    DevshareExporter *eb = export_vmm(&big, 0, 40, 0);
    static char hex[LINE_MAX_LEN / 2];
    DevshareHandle hb;
    share_encoded_hex(eb, 30 * SEG + 4096, 5 * SEG, 2048, 1024, 3, hex, &hb);
    CHECK(hb.key_len == 0 && (hb.flags & DEVSHARE_HANDLE_FLAG_SEGMENTED), "40 segments: the table is not inline");
    ans = ask_child(&c1, "import enc 0 0 1 0 %s", hex);
    CHECK(strncmp(ans, "OK 2097152 0 3", 14) == 0,
          "devshare_import_encoded maps all 40 segments and the tensor in segments 30..34 reads right (%s)", ans);
    s = state_of(&c1);
    CHECK(s.resv == 1 && s.maps == 40 && s.imported == 40, "40 mappings in one reservation of exactly 80 MiB");
    DevshareImport *none = NULL;
    st = devshare_import(&hb, NULL, &none);
    CHECK(st == DEVSHARE_STATUS_INVALID_ARGUMENT && strstr(last_error(), "devshare_import_encoded"),
          "the struct alone names where the table travels (%s)", last_error());
    /* Torch: what stock PyTorch's rebuild_cuda_tensor would receive. */
    static uint8_t table[40 * 4];
    size_t table_len = 0;
    DS_OK(devshare_exporter_segment_table(eb, table, sizeof table, &table_len));
    DevshareHandle ht;
    share_encoded_hex(eb, 2 * SEG, 3 * SEG, 1024, 1536, 0, hex, &ht);
    uint8_t raw[64];
    const size_t elen = torch_e_hex(&ht, table, table_len, hex, raw);
    int32_t e_pid = 0;
    memcpy(&e_pid, raw + 2, 4);
    CHECK(elen == 26 + 4 * 40 && raw[0] == 2 && raw[1] == 'e' && e_pid == getpid() && table_len == 160,
          "the 'e' storage handle: version 2, the producer's pid, 26 + 4 x 40 bytes");
    ans = import_torch(&c1, &ht, table, table_len, 1024, 1536, 1, 0);
    CHECK(strncmp(ans, "OK 1572864 0", 12) == 0 && vmm_holds(&big, 2 * SEG / 4, 1572864, 1),
          "devshare_import_torch of the 'e' bytes (garbage padding) reads and writes right (%s)", ans);
    vmm_refill(&big, 2 * SEG / 4, 1572864);
    DevshareHandle h5 = share_u32(e, 3 * SEG, SEG + 4096, 512, 512, 0);
    ans = import_torch(&c1, &h5, NULL, 0, 512, 512, 0, 0); /* inline table */
    CHECK(strncmp(ans, "OK 262144 0", 11) == 0, "the 'e' tuple of a 5-segment export reads right (%s)", ans);
    ans = ask_child(&c1, "release");
    CHECK(strcmp(ans, "OK 1") == 0, "the consumer releases the 40-segment import (%s)", ans);
    s = state_of(&c1);
    CHECK(is_clean(s, c1_fds), "released: nothing left");

    /* Part way: the producer closed segment 2's fd. The consumer imports segments 0 and 1, fails
     * on 2, and undoes everything. */
    Vmm m;
    vmm_create(&m, 5, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    DevshareExporter *em = export_vmm(&m, 0, 5, 0);
    DevshareHandle hm = share_u32(em, 0, 5 * SEG, 1024, 1024, 0);
    const int fd2 = table_fd(&hm, 2);
    close(fd2);
    ans = import_text(&c1, &hm, 0, 0, 0);
    char want[64];
    snprintf(want, sizeof want, "fd %d is not open", fd2);
    CHECK(strncmp(ans, "ERR -33", 7) == 0 && strstr(ans, want), "a closed fd fails the import, naming it (%s)", ans);
    s = state_of(&c1);
    CHECK(is_clean(s, c1_fds), "the two segments imported before it are unmapped and released, the address space "
                               "freed, the stolen fds closed");
    show_state("consumer 1 after the failed import", s);
    /* Give the number back to something, so the exporter's close of it closes nothing else. */
    const int nul = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (nul != fd2) {
        dup2(nul, fd2);
        close(nul);
    }

    /* Refused by pidfd_getfd. */
    if (scope == 1) {
        DS_OK(devshare_allow_ptrace(0));
        /* ask_child names the child again, so ask by hand. */
        char text[DEVSHARE_HANDLE_MAX_TEXT_SIZE];
        DevshareHandle hy = share_u32(e, 0, 4096, 32, 32, 0);
        DS_OK(devshare_handle_to_text(&hy, text, sizeof text, NULL));
        dprintf(c1.to, "import text 0 0 0 0 %s\n", text);
        char line[4096];
        if (read_line_fd(c1.from, line, sizeof line, IO_TIMEOUT_MS) < 0) {
            snprintf(line, sizeof line, "no answer");
        }
        CHECK(strncmp(line, "ERR -33", 7) == 0 && strstr(line, "ptrace_scope is 1") && strstr(line, "devshare_allow_ptrace"),
              "Yama ptrace_scope 1 without devshare_allow_ptrace: refused, naming the fix (%s)", line);
        CHECK(is_clean(state_of(&c1), c1_fds), "the refused import leaves nothing behind");
    } else {
        printf("ok - # SKIP no Yama ptrace_scope 1 here: its refusal is not observable\n");
    }
    DevshareHandle hd = share_u32(e, 0, 4096, 32, 32, 0);
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    ans = import_text(&c1, &hd, 0, 0, 0);
    prctl(PR_SET_DUMPABLE, 1, 0, 0, 0);
    CHECK(strncmp(ans, "ERR -33", 7) == 0 && strstr(ans, "pidfd_getfd") && strstr(ans, "dumpable"),
          "a non-dumpable producer: pidfd_getfd refused with the message naming it (%s)", ans);
    s = state_of(&c1);
    CHECK(is_clean(s, c1_fds), "the refused import leaves nothing mapped, reserved, imported or open");
    ans = import_text(&c1, &hd, 0, 0, 0);
    CHECK(strncmp(ans, "OK 1024 0", 9) == 0, "dumpable again, the same handle imports (%s)", ans);

    /* Fabric handles, when the driver has them. */
    Vmm f;
    if (vmm_create(&f, 3, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC)) {
        const int before = open_fds();
        DevshareExporter *ef = export_vmm(&f, 0, 3, DEVSHARE_EXPORT_FABRIC);
        CHECK(open_fds() == before, "a fabric export keeps no fd open");
        DevshareHandle hf;
        share_encoded_hex(ef, SEG / 2, 2 * SEG, 1024, 1024, 0, hex, &hf);
        ans = ask_child(&c1, "import enc 0 1 0 0 %s", hex);
        CHECK(strncmp(ans, "OK 1048576 0 3", 14) == 0 && vmm_holds(&f, SEG / 8, 1048576, 1),
              "3 fabric handles (192 bytes, in the encoding): imported, read and written right (%s)", ans);
        vmm_refill(&f, SEG / 8, 1048576);
        static uint8_t ftable[3 * 64];
        size_t ftable_len = 0;
        DS_OK(devshare_exporter_segment_table(ef, ftable, sizeof ftable, &ftable_len));
        DevshareHandle hf2;
        share_encoded_hex(ef, 0, 3 * SEG, 1024, 1536, 0, hex, &hf2);
        uint8_t fraw[64];
        const size_t flen = torch_e_hex(&hf2, ftable, ftable_len, hex, fraw);
        CHECK(flen == 26 + 64 * 3, "the fabric 'e' form is 26 + 64 x 3 bytes (%zu)", flen);
        ans = import_torch(&c1, &hf2, ftable, ftable_len, 1024, 1536, 0, 0);
        CHECK(strncmp(ans, "OK 1572864 0", 12) == 0, "the fabric 'e' tuple imports and reads right (%s)", ans);
        s = state_of(&c1);
        CHECK(is_clean(s, c1_fds), "fabric imports released: nothing left");
        Child nf = spawn("CUDA_STANDIN_NO_FABRIC", "1");
        const int nf_fds = state_of(&nf).fds;
        DevshareHandle hf3;
        share_encoded_hex(ef, 0, 4096, 32, 32, 0, hex, &hf3);
        ans = ask_child(&nf, "import enc 0 0 0 0 %s", hex);
        CHECK(strncmp(ans, "ERR -34", 7) == 0 && strstr(ans, "fabric"),
              "a consumer whose driver has no fabric support is refused, with the hint (%s)", ans);
        CHECK(is_clean(state_of(&nf), nf_fds), "and keeps nothing");
        CHECK(finish(&nf), "the consumer without fabric exits cleanly");
        DS_OK(devshare_exporter_close(ef, DEVSHARE_CLOSE_FORCE)); /* hf3's reference was not returned */
        vmm_destroy(&f);
    } else {
        printf("ok - # SKIP the driver has no fabric handles (CUDA_STANDIN_NO_FABRIC)\n");
    }

    CHECK(finish(&c1), "the consumer exits cleanly, with no rule broken (exit code)");
    DS_OK(devshare_exporter_close(em, DEVSHARE_CLOSE_FORCE)); /* hm's import failed: its reference stays out */
    DS_OK(devshare_exporter_close(eb, 0));
    DS_OK(devshare_exporter_close(e2, 0));
    /* devshare_exporter_adopt: a segmented handle shared in this process (as PyTorch shares an
     * expandable-segment storage) is adopted: its fds are duplicated, its shares count from the
     * adopted storage, and its one reference goes back exactly once, when the adopter closes. */
    {
        DevshareExporter *src = export_vmm(&a, 0, 2, 0);
        const DevshareHandle ha = share_u32(src, SEG - 2048, 4096, 4, 256, 0); /* spans 2 segments */
        const int fds_before = open_fds();
        DevshareExporter *ad = NULL;
        DS_OK(devshare_exporter_adopt(&ha, NULL, 0, 0, &ad));
        uint64_t n = 0;
        DS_OK(devshare_exporter_outstanding(src, &n));
        CHECK(n == 1 && open_fds() == fds_before + 2,
              "adopt: the handle's reference stays out and each segment fd is duplicated (%" PRIu64 ", +%d fds)", n,
              open_fds() - fds_before);
        const int64_t shape[2] = {2, 256};
        DevshareTensorDesc d = desc_u32(shape, 1024, DEVSHARE_STORAGE_TO_END, 0);
        DevshareHandle hb;
        DS_OK(devshare_exporter_share(ad, &d, &hb));
        CHECK(hb.storage_offset == ha.storage_offset + 1024 && hb.storage_size == 4096 - 1024 &&
                  hb.producer_pid == (int32_t)getpid(),
              "adopt: a share's storage counts from the adopted storage's first byte");
        d.storage_offset = 4096;
        d.storage_size = 4;
        EXPECT_ERROR(devshare_exporter_share(ad, &d, &hb), "devshare_exporter_share",
                     "adopt: a share beyond the adopted storage is refused");
        EXPECT_ERROR(devshare_exporter_close(ad, 0), "devshare_exporter_close",
                     "adopt: closing with a share outstanding is refused (BUSY)");
        DS_OK(devshare_handle_discard(&hb));
        DS_OK(devshare_exporter_close(ad, 0));
        DS_OK(devshare_exporter_outstanding(src, &n));
        CHECK(n == 0 && open_fds() == fds_before, "adopt: the close returned the reference once and closed its fds");

        DevshareHandle other = ha;
        other.producer_pid = (int32_t)getpid() + 1;
        EXPECT_ERROR(devshare_exporter_adopt(&other, NULL, 0, 0, &ad), "devshare_exporter_adopt",
                     "adopt: a segmented handle whose fds are another process's is refused");
        CHECK(strstr(last_error(), "valid in process") != NULL, "adopt: ... naming why (%s)", last_error());
        EXPECT_ERROR(devshare_exporter_adopt(&ha, NULL, 0, 1, &ad), "devshare_exporter_adopt",
                     "adopt: unknown flags are refused");
        EXPECT_ERROR(devshare_exporter_adopt(NULL, NULL, 0, 0, &ad), "devshare_exporter_adopt",
                     "adopt: a NULL handle is refused");
        EXPECT_ERROR(devshare_exporter_adopt(&ha, NULL, 0, 0, NULL), "devshare_exporter_adopt",
                     "adopt: a NULL out pointer is refused");
        DevshareHandle host;
        DS_OK(devshare_handle_init(&host));
        host.backend = DEVSHARE_BACKEND_HOST;
        EXPECT_ERROR(devshare_exporter_adopt(&host, NULL, 0, 0, &ad), "devshare_exporter_adopt",
                     "adopt: a handle that does not validate is refused");
        DS_OK(devshare_exporter_close(src, 0));
    }
    DS_OK(devshare_exporter_close(e, DEVSHARE_CLOSE_FORCE)); /* hy was never imported */
    vmm_destroy(&m);
    vmm_destroy(&big);
    vmm_destroy(&a);
    CHECK(open_fds() == parent_fds, "the closed exporters closed their fds");
    CHECK(cusi_vmm_reservations() == 0 && cusi_vmm_mappings() == 0 && cusi_vmm_handles() == 0 &&
              cusi_vmm_allocations() == 0,
          "the producer holds no VMM object");

    harness_check_log(cusi_violation_count(), "the CUDA stand-in");
    return harness_done();
}
