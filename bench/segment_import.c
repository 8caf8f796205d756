/* SPDX-License-Identifier: Apache-2.0 */
/*
 * segment_import: what importing a segmented (expandable-segment, VMM) allocation costs, next
 * to a plain allocation ('c' handle), per segment count.
 *
 *   segment_import acl|cuda [iterations] [segment counts...]     (default counts: 1 16 256)
 *
 * For each segment count n a producer child (this program re-executed with "--producer")
 * builds n x 2 MiB of VMM memory (aclrtMallocPhysical / cuMemCreate, reserve, map), exports it
 * with devshare_export_segments and writes one byte encoding per iteration (each its own
 * reference; devshare_exporter_share_encoded, which carries tables longer than the handle
 * struct holds). A plain 2 MiB allocation (aclrtMalloc / cuMemAlloc, devshare_export) is the
 * 'c' row. The parent is the consumer and measures per handle:
 *   cold   devshare_import_encoded + devshare_import_release with nothing cached: decoding,
 *          validation, the ref-counter check, importing every segment (cuda: pidfd_getfd of
 *          each fd first), reserving and mapping, then the teardown and the slot decrement;
 *   warm   the same while another import of the allocation is held: a registry hit.
 * It prints the median and mean of each in microseconds.
 *
 * Against the stand-in runtimes this measures devshare's own work plus the stand-ins' (an
 * shm_open or memfd + mmap per segment), not a real driver; on hardware it measures the real
 * thing.
 */
#define _GNU_SOURCE

#include "acl_standin.h"
#include "cuda_standin.h"
#include "devshare.h"
#define BENCH_NAME "segment_import"
#include "bench_common.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define SEG ((size_t)2 << 20)


static void runtime_init(int acl) {
    if (acl) {
        aclError rc = aclInit(NULL);
        if (rc != 0 && rc != ACL_ERROR_REPEAT_INITIALIZE) {
            die("aclInit", rc);
        }
        OK(aclrtSetDevice(0));
    } else {
        CUdevice dev;
        CUcontext ctx;
        OK(cuInit(0));
        OK(cuDeviceGet(&dev, 0));
        OK(cuDevicePrimaryCtxRetain(&ctx, dev));
        OK(cuCtxSetCurrent(ctx));
    }
}

static void write_all(const void *p, size_t n) {
    const char *c = p;
    while (n > 0) {
        ssize_t w = write(1, c, n);
        if (w <= 0) {
            die("write", errno);
        }
        c += w;
        n -= (size_t)w;
    }
}

static int read_all(FILE *in, void *p, size_t n) {
    return fread(p, 1, n, in) == n;
}

/* --producer acl|cuda <segments, 0 for a plain allocation> <handles> */
static int producer(int acl, size_t n, int count) {
    runtime_init(acl);
    const uint16_t backend = acl ? DEVSHARE_BACKEND_ACL : DEVSHARE_BACKEND_CUDA;
    DevshareExporter *e = NULL;
    void *plain = NULL;
    CUdeviceptr cu_plain = 0, cu_base = 0;
    void *acl_base = NULL;
    aclrtDrvMemHandle *acl_phys = NULL;
    CUmemGenericAllocationHandle *cu_phys = NULL;
    uint64_t *phys = calloc(n ? n : 1, sizeof *phys);
    if (n == 0) {
        if (acl) {
            OK(aclrtMalloc(&plain, SEG, ACL_MEM_MALLOC_HUGE_FIRST));
        } else {
            OK(cuMemAlloc(&cu_plain, SEG));
            plain = (void *)(uintptr_t)cu_plain;
        }
        OK(devshare_export(backend, 0, plain, SEG, DEVSHARE_EXPORT_NO_PID_CHECK, &e));
    } else if (acl) {
        aclrtPhysicalMemProp prop;
        memset(&prop, 0, sizeof prop);
        prop.handleType = ACL_MEM_HANDLE_TYPE_NONE;
        prop.allocationType = ACL_MEM_ALLOCATION_TYPE_PINNED;
        prop.memAttr = ACL_HBM_MEM_HUGE;
        prop.location.id = 0;
        prop.location.type = ACL_MEM_LOCATION_TYPE_DEVICE;
        acl_phys = calloc(n, sizeof *acl_phys);
        OK(aclrtReserveMemAddress(&acl_base, n * SEG, 0, NULL, 0));
        for (size_t i = 0; i < n; i++) {
            OK(aclrtMallocPhysical(&acl_phys[i], SEG, &prop, 0));
            OK(aclrtMapMem((char *)acl_base + i * SEG, SEG, 0, acl_phys[i], 0));
            phys[i] = (uint64_t)(uintptr_t)acl_phys[i];
        }
        OK(devshare_export_segments(backend, 0, acl_base, phys, n, SEG, DEVSHARE_EXPORT_NO_PID_CHECK, &e));
    } else {
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof prop);
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = 0;
        cu_phys = calloc(n, sizeof *cu_phys);
        OK(cuMemAddressReserve(&cu_base, n * SEG, 0, 0, 0));
        for (size_t i = 0; i < n; i++) {
            OK(cuMemCreate(&cu_phys[i], SEG, &prop, 0));
            OK(cuMemMap(cu_base + i * SEG, SEG, 0, cu_phys[i], 0));
            phys[i] = cu_phys[i];
        }
        CUmemAccessDesc access;
        memset(&access, 0, sizeof access);
        access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        access.location.id = 0;
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        OK(cuMemSetAccess(cu_base, n * SEG, &access, 1));
        OK(devshare_export_segments(backend, 0, (void *)(uintptr_t)cu_base, phys, n, SEG, 0, &e));
    }
    /* One tensor in the middle of the allocation: the last segment's first half. */
    const size_t total = n ? n * SEG : SEG;
    int64_t shape[1] = {(int64_t)(SEG / 2 / 4)};
    DevshareTensorDesc desc;
    OK(devshare_tensor_desc_init(&desc, sizeof desc));
    desc.dtype = (DevshareDType){DEVSHARE_DTYPE_FLOAT, 32, 1};
    desc.ndim = 1;
    desc.shape = shape;
    desc.storage_offset = total - SEG;
    desc.storage_size = SEG / 2;
    uint8_t *buf = NULL;
    size_t cap = 0;
    for (int i = 0; i < count; i++) {
        size_t len = 0;
        int32_t st = devshare_exporter_share_encoded(e, &desc, buf, cap, &len);
        if (st == DEVSHARE_STATUS_BUFFER_TOO_SMALL) {
            cap = len;
            buf = realloc(buf, cap);
            st = devshare_exporter_share_encoded(e, &desc, buf, cap, &len);
        }
        OK(st);
        const uint32_t l = (uint32_t)len;
        write_all(&l, sizeof l);
        write_all(buf, len);
    }
    free(buf);
    char c;
    while (read(0, &c, 1) > 0) { /* until the consumer is done */
    }
    OK(devshare_exporter_close(e, DEVSHARE_CLOSE_FORCE));
    if (n == 0) {
        if (acl) {
            OK(aclrtFree(plain));
        } else {
            OK(cuMemFree(cu_plain));
        }
    } else if (acl) {
        for (size_t i = 0; i < n; i++) {
            OK(aclrtUnmapMem((char *)acl_base + i * SEG));
            OK(aclrtFreePhysical(acl_phys[i]));
        }
        OK(aclrtReleaseMemAddress(acl_base));
    } else {
        for (size_t i = 0; i < n; i++) {
            OK(cuMemUnmap(cu_base + i * SEG, SEG));
            OK(cuMemRelease(cu_phys[i]));
        }
        OK(cuMemAddressFree(cu_base, n * SEG));
    }
    free(acl_phys);
    free(cu_phys);
    free(phys);
    return 0;
}

struct Encoded {
    uint8_t *bytes;
    size_t len;
};

/* One row: n segments (0: the plain allocation), `iters` cold and `iters` warm imports. */
static void row(const char *self, const char *backend, size_t n, int iters) {
    const int total = 2 * iters + 1;
    int to[2], from[2];
    if (pipe(to) || pipe(from)) {
        die("pipe", errno);
    }
    char segs[32], count[32];
    snprintf(segs, sizeof segs, "%zu", n);
    snprintf(count, sizeof count, "%d", total);
    const pid_t child = fork();
    if (child == 0) {
        dup2(to[0], 0);
        dup2(from[1], 1);
        close(to[1]);
        close(from[0]);
        execl("/proc/self/exe", self, "--producer", backend, segs, count, (char *)NULL);
        _exit(127);
    }
    close(to[0]);
    close(from[1]);
    FILE *in = fdopen(from[0], "r");
    struct Encoded *hs = calloc((size_t)total, sizeof *hs);
    for (int i = 0; i < total; i++) {
        uint32_t l = 0;
        if (!read_all(in, &l, sizeof l) || l == 0 || l > (8u << 20)) {
            die("reading a handle from the producer", i);
        }
        hs[i].len = l;
        hs[i].bytes = malloc(l);
        if (!read_all(in, hs[i].bytes, l)) {
            die("reading a handle from the producer", i);
        }
    }
    double *cold = calloc((size_t)iters, sizeof(double)), *warm = calloc((size_t)iters, sizeof(double));
    for (int i = 0; i < iters; i++) {
        DevshareImport *imp = NULL;
        const double t0 = now_us();
        OK(devshare_import_encoded(hs[i].bytes, hs[i].len, NULL, &imp));
        OK(devshare_import_release(imp));
        cold[i] = now_us() - t0;
    }
    DevshareImport *held = NULL;
    OK(devshare_import_encoded(hs[iters].bytes, hs[iters].len, NULL, &held));
    for (int i = 0; i < iters; i++) {
        DevshareImport *imp = NULL;
        const double t0 = now_us();
        OK(devshare_import_encoded(hs[iters + 1 + i].bytes, hs[iters + 1 + i].len, NULL, &imp));
        OK(devshare_import_release(imp));
        warm[i] = now_us() - t0;
    }
    OK(devshare_import_release(held));
    close(to[1]);
    int status = 0;
    waitpid(child, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        die("the producer", status);
    }
    double cm, ca, wm, wa;
    stats(cold, iters, &cm, &ca);
    stats(warm, iters, &wm, &wa);
    char what[64];
    if (n == 0) {
        snprintf(what, sizeof what, "'c' 2 MiB allocation");
    } else {
        snprintf(what, sizeof what, "'e' %zu x 2 MiB segment%s", n, n == 1 ? "" : "s");
    }
    printf("%-30s %8zu %12.2f %12.2f %12.2f %12.2f\n", what, hs[0].len, cm, ca, wm, wa);
    fflush(stdout);
    for (int i = 0; i < total; i++) {
        free(hs[i].bytes);
    }
    free(hs);
    free(cold);
    free(warm);
    fclose(in);
}

int main(int argc, char **argv) {
    if (argc > 4 && strcmp(argv[1], "--producer") == 0) {
        return producer(strcmp(argv[2], "acl") == 0, (size_t)strtoul(argv[3], NULL, 10), atoi(argv[4]));
    }
    if (argc < 2 || (strcmp(argv[1], "acl") && strcmp(argv[1], "cuda"))) {
        fprintf(stderr, "usage: segment_import acl|cuda [iterations] [segment counts...]\n");
        return 2;
    }
    const int acl = strcmp(argv[1], "acl") == 0;
    const int iters = argc > 2 ? atoi(argv[2]) : 200;
    if (iters < 2) {
        fprintf(stderr, "segment_import: iterations must be >= 2\n");
        return 2;
    }
    runtime_init(acl);
    DevshareBackendInfo bi;
    OK(devshare_backend_info_init(&bi, sizeof bi));
    OK(devshare_probe(acl ? DEVSHARE_BACKEND_ACL : DEVSHARE_BACKEND_CUDA, &bi));
    printf("backend %s, %d iterations per row (%s)\n", argv[1], iters, bi.detail);
    printf("%-30s %8s %12s %12s %12s %12s\n", "allocation", "bytes", "cold med us", "cold mean us",
           "warm med us", "warm mean us");
    row(argv[0], argv[1], 0, iters);
    if (argc > 3) {
        for (int i = 3; i < argc; i++) {
            row(argv[0], argv[1], (size_t)strtoul(argv[i], NULL, 10), iters);
        }
    } else {
        const size_t counts[] = {1, 16, 256};
        for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++) {
            row(argv[0], argv[1], counts[i], iters);
        }
    }
    return 0;
}
