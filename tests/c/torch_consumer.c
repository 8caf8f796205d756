/* SPDX-License-Identifier: Apache-2.0 */
/*
 * torch_consumer: a plain C consumer of a channel, for the tests of PyTorch tensors sent over
 * channels (tests/python/test_torch_channel.py). Test-only: it reads float32 elements through
 * the import's data pointer, which is host memory for host items and for the device stand-ins
 * (whose device pointers are host addresses), never on real hardware.
 *
 *   torch_consumer <address> <n>          receive n items, print each, release each
 *   torch_consumer <address> <n> hold     receive n items, print each, keep them; then wait for
 *                                         the producer's end (CLOSED), read them again, release
 *   torch_consumer <address> <n> noptrace first drop CAP_SYS_PTRACE, and show that taking the
 *                                         producer's fd 0 with pidfd_getfd is refused
 *                                         ("PTRACE_DENIED"), then as the first form
 *   torch_consumer <address> <n> stream   as the first form, with device items read on a CUDA
 *                                         stream of its own (devshare_connection_set_stream;
 *                                         the driver is DEVSHARE_CUDA_LIBRARY, dlopen'ed)
 *   torch_consumer <address> <n> badstream  with a stream pointer that is no stream: the
 *                                         first receive fails ("RECV_FAILED ...")
 *
 * Lines on stdout: "CONNECTED <pid>", per item "ITEM <i> backend=<b> base=<hex> shape=<d0,d1,..>
 * sum=<sum of its elements>", then "DONE", or "HOLDING", "CLOSED", "STILL <i> sum=<...>" per
 * held item and "RELEASED". Exit status 0 when every call succeeded, 1 otherwise, 2 on a usage
 * error.
 */
#define _GNU_SOURCE

#define HARNESS_NAME "torch_consumer"
#include "harness.h"

#include <dlfcn.h>
#include <sys/syscall.h>

/* A CUDA stream of this process's device 0, made through the driver devshare also loads. */
static void *cuda_stream(void) {
    const char *path = getenv("DEVSHARE_CUDA_LIBRARY");
    void *cu = dlopen(path ? path : "libcuda.so.1", RTLD_NOW);
    if (cu == NULL)
        die("dlopen of the CUDA driver", 0);
    int (*init)(unsigned) = (int (*)(unsigned))dlsym(cu, "cuInit");
    int (*get)(int *, int) = (int (*)(int *, int))dlsym(cu, "cuDeviceGet");
    int (*retain)(void **, int) = (int (*)(void **, int))dlsym(cu, "cuDevicePrimaryCtxRetain");
    int (*current)(void *) = (int (*)(void *))dlsym(cu, "cuCtxSetCurrent");
    int (*create)(void **, unsigned) = (int (*)(void **, unsigned))dlsym(cu, "cuStreamCreate");
    int dev = 0;
    void *ctx = NULL, *stream = NULL;
    if (!init || !get || !retain || !current || !create || init(0) || get(&dev, 0) || retain(&ctx, dev) ||
        current(ctx) || create(&stream, 0))
        die("a CUDA stream", 0);
    return stream;
}

#define MAX_ITEMS 4096

/* Sum of a float32 tensor's elements, walking its shape and strides (elements, >= 0). */
static double tensor_sum(const DevshareImport *imp) {
    DevshareImportInfo info;
    DS_OK(devshare_import_info_init(&info, sizeof info));
    DS_OK(devshare_import_info(imp, &info));
    DevshareHandle h;
    DS_OK(devshare_import_handle(imp, &h));
    if (h.dtype.code != DEVSHARE_DTYPE_FLOAT || h.dtype.bits != 32 || h.dtype.lanes != 1)
        die("expected float32 items", 0);
    const float *data = (const float *)info.data;
    if (info.numel == 0)
        return 0.0;
    int64_t idx[DEVSHARE_MAX_NDIM] = {0};
    double sum = 0.0;
    for (uint64_t k = 0; k < info.numel; k++) {
        int64_t off = 0;
        for (uint32_t d = 0; d < h.ndim; d++)
            off += idx[d] * h.strides[d];
        sum += data[off];
        for (int d = (int)h.ndim - 1; d >= 0; d--) {
            if (++idx[d] < h.shape[d])
                break;
            idx[d] = 0;
        }
    }
    return sum;
}

static void print_item(const char *tag, size_t i, const DevshareImport *imp) {
    DevshareImportInfo info;
    DS_OK(devshare_import_info_init(&info, sizeof info));
    DS_OK(devshare_import_info(imp, &info));
    DevshareHandle h;
    DS_OK(devshare_import_handle(imp, &h));
    char shape[256] = "";
    size_t used = 0;
    for (uint32_t d = 0; d < h.ndim && used < sizeof shape; d++)
        used += (size_t)snprintf(shape + used, sizeof shape - used, "%s%" PRId64, d ? "," : "", h.shape[d]);
    printf("%s %zu backend=%u base=%p shape=%s sum=%.1f\n", tag, i, (unsigned)info.backend, info.base, shape,
           tensor_sum(imp));
    fflush(stdout);
}

int main(int argc, char **argv) {
    const char *mode = argc == 4 ? argv[3] : "";
    if (argc < 3 || argc > 4 ||
        (argc == 4 && strcmp(mode, "hold") && strcmp(mode, "noptrace") && strcmp(mode, "stream") &&
         strcmp(mode, "badstream"))) {
        fprintf(stderr, "usage: torch_consumer <address> <n> [hold|noptrace|stream|badstream]\n");
        return 2;
    }
    int64_t n = 0;
    if (parse_i64(argv[2], &n) != 0 || n < 0 || n > MAX_ITEMS) {
        fprintf(stderr, "torch_consumer: n must be 0..%d\n", MAX_ITEMS);
        return 2;
    }
    int hold = strcmp(mode, "hold") == 0;
    int noptrace = strcmp(mode, "noptrace") == 0;
    if (noptrace)
        drop_ptrace_capability();
    DevshareConnection *conn = NULL;
    DS_OK(devshare_channel_connect(argv[1], 5000, &conn));
    printf("CONNECTED %d\n", (int)getpid());
    if (strcmp(mode, "stream") == 0)
        DS_OK(devshare_connection_set_stream(conn, cuda_stream()));
    if (strcmp(mode, "badstream") == 0)
        DS_OK(devshare_connection_set_stream(conn, (void *)(uintptr_t)0x1000));
    if (noptrace) {
        /* The negative control: this process may not take the producer's descriptors. */
        uint64_t peer_id = 0;
        int32_t producer = 0;
        DS_OK(devshare_connection_info(conn, &peer_id, &producer));
        long pidfd = syscall(SYS_pidfd_open, producer, 0);
        long fd = pidfd < 0 ? -1 : syscall(SYS_pidfd_getfd, (int)pidfd, 0, 0);
        int err = errno;
        printf("%s\n", fd < 0 && (pidfd < 0 || err == EPERM) ? "PTRACE_DENIED" : "PTRACE_ALLOWED");
        if (fd >= 0)
            close((int)fd);
        if (pidfd >= 0)
            close((int)pidfd);
    }
    fflush(stdout);
    static DevshareImport *held[MAX_ITEMS];
    for (int64_t i = 0; i < n; i++) {
        DevshareImport *imp = NULL;
        int32_t st = devshare_connection_recv(conn, 30000, &imp);
        if (st != DEVSHARE_STATUS_OK) {
            printf("RECV_FAILED %s: %s\n", devshare_status_str(st), last_error());
            return 1;
        }
        print_item("ITEM", (size_t)i, imp);
        if (hold)
            held[i] = imp;
        else
            DS_OK(devshare_import_release(imp));
    }
    if (!hold) {
        printf("DONE\n");
        devshare_connection_close(conn);
        return 0;
    }
    printf("HOLDING\n");
    fflush(stdout);
    DevshareImport *more = NULL;
    int32_t st = devshare_connection_recv(conn, 60000, &more);
    printf("%s\n", st == DEVSHARE_STATUS_CLOSED ? "CLOSED" : devshare_status_str(st));
    fflush(stdout);
    for (int64_t i = 0; i < n; i++)
        print_item("STILL", (size_t)i, held[i]);
    for (int64_t i = 0; i < n; i++)
        DS_OK(devshare_import_release(held[i]));
    printf("RELEASED\n");
    devshare_connection_close(conn);
    return st == DEVSHARE_STATUS_CLOSED ? 0 : 1;
}
