/* SPDX-License-Identifier: Apache-2.0 */
/*
 * device_import: what devshare's import path costs on top of the vendor runtime's own IPC calls.
 *
 *   device_import acl|cuda [iterations]
 *
 * A producer child (this program re-executed with "--producer") allocates device memory,
 * exports it with devshare and prints one handle per iteration (each its own reference). The
 * parent is the consumer and measures, per handle:
 *   cold   devshare_import + devshare_import_release with nothing cached: validation, the
 *          ref-counter check, the vendor open, then the vendor close and the slot decrement;
 *   warm   the same while another import of the allocation is held: the registry hit, the
 *          ref-counter check and decrement, no vendor call;
 *   raw    the vendor calls alone, as a hand-written consumer would make them
 *          (aclrtIpcMemImportByKey + aclrtIpcMemClose, or cuIpcOpenMemHandle + cuIpcCloseMemHandle).
 * It prints the median and mean of each in microseconds, and the ratios.
 *
 * Run against the stand-in runtimes (DEVSHARE_ACL_LIBRARY / DEVSHARE_CUDA_LIBRARY) it measures
 * devshare's own overhead only: the stand-ins' "driver" is a shm_open + mmap, nothing like a real
 * driver's 0.5-1.5 ms IPC open. On hardware, the same program measures the real thing.
 */
#define _GNU_SOURCE

#include "acl_standin.h"
#include "cuda_standin.h"
#include "devshare.h"
#define BENCH_NAME "device_import"
#include "bench_common.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>


/* ---------------------------------------------------------------------------------------- */

static int producer(int acl, int count) {
    void *ptr = NULL;
    CUdeviceptr cu = 0;
    const size_t size = 2u << 20;
    uint16_t backend;
    if (acl) {
        aclError rc = aclInit(NULL);
        if (rc != 0 && rc != ACL_ERROR_REPEAT_INITIALIZE) {
            die("aclInit", rc);
        }
        OK(aclrtSetDevice(0));
        OK(aclrtMalloc(&ptr, size, ACL_MEM_MALLOC_HUGE_FIRST));
        backend = DEVSHARE_BACKEND_ACL;
    } else {
        CUdevice dev;
        CUcontext ctx;
        OK(cuInit(0));
        OK(cuDeviceGet(&dev, 0));
        OK(cuDevicePrimaryCtxRetain(&ctx, dev));
        OK(cuCtxSetCurrent(ctx));
        OK(cuMemAlloc(&cu, size));
        ptr = (void *)(uintptr_t)cu;
        backend = DEVSHARE_BACKEND_CUDA;
    }
    DevshareExporter *e = NULL;
    OK(devshare_export(backend, 0, ptr, size, DEVSHARE_EXPORT_NO_PID_CHECK, &e));
    for (int i = 0; i < count; i++) {
        DevshareHandle h;
        char text[DEVSHARE_HANDLE_MAX_TEXT_SIZE];
        OK(devshare_exporter_share(e, NULL, &h));
        OK(devshare_handle_to_text(&h, text, sizeof text, NULL));
        printf("%s\n", text);
    }
    fflush(stdout);
    char c;
    while (read(0, &c, 1) > 0) { /* until the consumer is done */
    }
    OK(devshare_exporter_close(e, DEVSHARE_CLOSE_FORCE));
    if (acl) {
        OK(aclrtFree(ptr));
    } else {
        OK(cuMemFree(cu));
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */

int main(int argc, char **argv) {
    if (argc > 2 && strcmp(argv[1], "--producer") == 0) {
        return producer(strcmp(argv[2], "acl") == 0, atoi(argv[3]));
    }
    if (argc < 2 || (strcmp(argv[1], "acl") && strcmp(argv[1], "cuda"))) {
        fprintf(stderr, "usage: device_import acl|cuda [iterations]\n");
        return 2;
    }
    const int acl = strcmp(argv[1], "acl") == 0;
    const int n = argc > 2 ? atoi(argv[2]) : 2000;
    if (n < 2) {
        fprintf(stderr, "device_import: iterations must be >= 2\n");
        return 2;
    }
    /* Handles: n cold + 1 held + n warm. */
    const int total = 2 * n + 1;
    int to[2], from[2];
    if (pipe(to) || pipe(from)) {
        die("pipe", errno);
    }
    char count[32];
    snprintf(count, sizeof count, "%d", total);
    const pid_t child = fork();
    if (child == 0) {
        dup2(to[0], 0);
        dup2(from[1], 1);
        close(to[1]);
        close(from[0]);
        execl("/proc/self/exe", argv[0], "--producer", argv[1], count, (char *)NULL);
        _exit(127);
    }
    close(to[0]);
    close(from[1]);
    FILE *in = fdopen(from[0], "r");
    DevshareHandle *hs = calloc((size_t)total, sizeof *hs);
    char line[1024];
    for (int i = 0; i < total; i++) {
        if (!fgets(line, sizeof line, in)) {
            die("reading handles from the producer", i);
        }
        line[strcspn(line, "\n")] = '\0';
        OK(devshare_handle_from_text(line, &hs[i]));
    }
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
    double *cold = calloc((size_t)n, sizeof(double)), *warm = calloc((size_t)n, sizeof(double));
    double *raw = calloc((size_t)n, sizeof(double));
    for (int i = 0; i < n; i++) {
        DevshareImport *imp = NULL;
        const double t0 = now_us();
        OK(devshare_import(&hs[i], NULL, &imp));
        OK(devshare_import_release(imp));
        cold[i] = now_us() - t0;
    }
    DevshareImport *held = NULL;
    OK(devshare_import(&hs[n], NULL, &held));
    for (int i = 0; i < n; i++) {
        DevshareImport *imp = NULL;
        const double t0 = now_us();
        OK(devshare_import(&hs[n + 1 + i], NULL, &imp));
        OK(devshare_import_release(imp));
        warm[i] = now_us() - t0;
    }
    OK(devshare_import_release(held));
    for (int i = 0; i < n; i++) {
        const double t0 = now_us();
        if (acl) {
            void *p = NULL;
            OK(aclrtIpcMemImportByKey(&p, (const char *)hs[0].key, ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS));
            OK(aclrtIpcMemClose((const char *)hs[0].key));
        } else {
            CUipcMemHandle mh;
            CUdeviceptr p = 0;
            memcpy(mh.reserved, hs[0].key, sizeof mh.reserved);
            OK(cuIpcOpenMemHandle(&p, mh, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
            OK(cuIpcCloseMemHandle(p));
        }
        raw[i] = now_us() - t0;
    }
    close(to[1]);
    waitpid(child, NULL, 0);

    double cm, ca, wm, wa, rm, ra;
    stats(cold, n, &cm, &ca);
    stats(warm, n, &wm, &wa);
    stats(raw, n, &rm, &ra);
    DevshareBackendInfo bi;
    OK(devshare_backend_info_init(&bi, sizeof bi));
    OK(devshare_probe(acl ? DEVSHARE_BACKEND_ACL : DEVSHARE_BACKEND_CUDA, &bi));
    printf("backend %s, %d iterations each (%s)\n", argv[1], n, bi.detail);
    printf("%-44s %10s %10s\n", "operation", "median us", "mean us");
    printf("%-44s %10.2f %10.2f\n", "raw vendor open + close", rm, ra);
    printf("%-44s %10.2f %10.2f\n", "devshare cold import + release", cm, ca);
    printf("%-44s %10.2f %10.2f\n", "devshare warm import + release (cached)", wm, wa);
    printf("devshare cold overhead over raw: %+.2f us (median); warm / cold: %.2f\n", cm - rm, wm / cm);
    free(cold);
    free(warm);
    free(raw);
    free(hs);
    fclose(in);
    return 0;
}
