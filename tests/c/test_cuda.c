/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_cuda: the cuda backend between separate processes, over the strict CUDA driver stand-in
 * (tests/standin/cuda), which records every driver rule a caller breaks.
 *
 * The parent allocates with cuMemAlloc, fills the block (float i at element i), exports a window
 * inside it with devshare and hands handles to consumer children. A consumer is this program
 * re-executed with "--child" (optionally with CUDA_STANDIN_VISIBLE reordering its devices, like
 * CUDA_VISIBLE_DEVICES); it serves commands, one line each:
 *   import <device|-1> <flags> <hold 0|1> <stream 0|1> <handle text> -> "OK <numel> <device>"
 *   release                                                           -> "OK <n released>"
 *   quit
 * and checks every imported tensor through cuMemcpyDtoH: element k == data offset / 4 + k.
 *
 * Cases: pool memory is refused before the driver is asked for a handle; an interior window
 * exports the whole block once (one cuIpcGetMemHandle for two exporters) and handles carry the
 * offset; importing in the exporting process is refused by devshare; one cuIpcOpenMemHandle per
 * handle per consumer however many imports; close order; import by device UUID under a
 * reordered device list; a device override with and without peer access; events waited on with
 * and without a consumer stream; duplicate arrivals; 8 consumer threads importing and releasing
 * concurrently; the raw 64-byte handle for PyTorch. At the
 * end the stand-in's violation log must be empty.
 *
 * Needs DEVSHARE_CUDA_LIBRARY pointing at the stand-in (CTest sets it).
 */
#define _GNU_SOURCE

#include "cuda_standin.h"
#define HARNESS_NAME "test_cuda"
#include "device_harness.h"

#include <pthread.h>

#define CU_OK(call)                                                                                               \
    do {                                                                                                          \
        CUresult rc_ = (call);                                                                                    \
        if (rc_ != CUDA_SUCCESS) {                                                                                \
            fprintf(stderr, "test_cuda: %s = %d\n", #call, (int)rc_);                                             \
            exit(2);                                                                                              \
        }                                                                                                         \
    } while (0)



/* ---------------------------------------------------------------------------------------- */
/* Child: a consumer serving commands */

/* Make the device's primary context current (retained once per device, for the process). */
static void make_current(int ordinal) {
    static CUcontext ctx[8];
    if (!ctx[ordinal]) {
        CUdevice dev;
        CU_OK(cuDeviceGet(&dev, ordinal));
        CU_OK(cuDevicePrimaryCtxRetain(&ctx[ordinal], dev));
    }
    CU_OK(cuCtxSetCurrent(ctx[ordinal]));
}

/* Read a contiguous float32 tensor of an import back to the host and check its values. */
static int child_verify(DevshareImport *imp, char *why, size_t cap) {
    DevshareImportInfo info;
    DS_OK(devshare_import_info_init(&info, sizeof info));
    DS_OK(devshare_import_info(imp, &info));
    const uint64_t n = info.numel;
    float *host = malloc(n ? n * 4u : 4u);
    make_current(info.device);
    if (n) {
        CU_OK(cuMemcpyDtoH(host, (CUdeviceptr)(uintptr_t)info.data, n * 4u));
    }
    const uint64_t first = (uint64_t)((char *)info.data - (char *)info.base) / 4u;
    for (uint64_t k = 0; k < n; k++) {
        if (host[k] != (float)(first + k)) {
            snprintf(why, cap, "element %" PRIu64 " is %g, expected %" PRIu64, k, (double)host[k], first + k);
            free(host);
            return 0;
        }
    }
    free(host);
    return 1;
}

/* Several threads that never made a context current import and release one handle (cache hits:
 * one of its imports is held meanwhile). */
typedef struct {
    const DevshareHandle *h;
    int rounds;
    int failures;
} ThreadJob;

static void *thread_imports(void *arg) {
    ThreadJob *job = arg;
    for (int r = 0; r < job->rounds; r++) {
        DevshareImport *imp = NULL;
        DevshareImportInfo info;
        if (devshare_import_info_init(&info, sizeof info) != DEVSHARE_STATUS_OK ||
            devshare_import(job->h, NULL, &imp) != DEVSHARE_STATUS_OK ||
            devshare_import_info(imp, &info) != DEVSHARE_STATUS_OK || info.numel == 0 ||
            devshare_import_release(imp) != DEVSHARE_STATUS_OK) {
            job->failures++;
        }
    }
    return NULL;
}

static void child_threads(const char *args) {
    int n = 0, rounds = 0, used = 0;
    DevshareHandle h;
    if (sscanf(args, "%d %d %n", &n, &rounds, &used) != 2 || n < 1 || n > 16 ||
        devshare_handle_from_text(args + used, &h) != DEVSHARE_STATUS_OK) {
        printf("ERR 0 bad threads command\n");
        return;
    }
    DevshareImport *held = NULL;
    int32_t st = devshare_import(&h, NULL, &held);
    if (st != DEVSHARE_STATUS_OK) {
        printf("ERR %d %s\n", st, last_error());
        return;
    }
    pthread_t tid[16];
    ThreadJob jobs[16];
    for (int i = 0; i < n; i++) {
        jobs[i] = (ThreadJob){.h = &h, .rounds = rounds, .failures = 0};
        pthread_create(&tid[i], NULL, thread_imports, &jobs[i]);
    }
    int failures = 0;
    for (int i = 0; i < n; i++) {
        pthread_join(tid[i], NULL);
        failures += jobs[i].failures;
    }
    DS_OK(devshare_import_release(held));
    printf("OK %d\n", failures);
}

static int child_main(void) {
    CU_OK(cuInit(0));
    make_current(0);
    CUstream stream = NULL;
    CU_OK(cuStreamCreate(&stream, 0));
    printf("PID %d %d\n", (int)getpid(), (int)getpid());
    fflush(stdout);
    DevshareImport *held[64];
    int n_held = 0;
    char line[2048];
    while (read_line_fd(0, line, sizeof line, IO_TIMEOUT_MS) > 0) {
        if (strncmp(line, "import ", 7) == 0) {
            int device = 0, hold = 0, use_stream = 0, used = 0;
            unsigned flags = 0;
            if (sscanf(line + 7, "%d %u %d %d %n", &device, &flags, &hold, &use_stream, &used) != 4) {
                printf("ERR 0 bad command\n");
                fflush(stdout);
                continue;
            }
            DevshareHandle h;
            int32_t st = devshare_handle_from_text(line + 7 + used, &h);
            DevshareImport *imp = NULL;
            if (st == DEVSHARE_STATUS_OK) {
                DevshareImportOptions o;
                DS_OK(devshare_import_options_init(&o, sizeof o));
                o.device = device;
                o.flags = flags;
                o.stream = use_stream ? (void *)stream : NULL;
                st = devshare_import(&h, &o, &imp);
            }
            if (st != DEVSHARE_STATUS_OK) {
                printf("ERR %d %s\n", st, last_error());
            } else {
                char why[256] = "";
                DevshareImportInfo info;
                DS_OK(devshare_import_info_init(&info, sizeof info));
                DS_OK(devshare_import_info(imp, &info));
                if (use_stream) {
                    make_current(0);
                    CU_OK(cuStreamSynchronize(stream));
                }
                if (!child_verify(imp, why, sizeof why)) {
                    printf("ERR 0 data: %s\n", why);
                } else {
                    printf("OK %" PRIu64 " %d\n", info.numel, info.device);
                }
                if (hold && n_held < 64) {
                    held[n_held++] = imp;
                } else {
                    DS_OK(devshare_import_release(imp));
                }
            }
        } else if (strncmp(line, "threads ", 8) == 0) {
            child_threads(line + 8);
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
    make_current(0);
    CU_OK(cuStreamDestroy(stream));
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Parent side of a child */

static const char *import_cmd(Child *c, const DevshareHandle *h, int device, unsigned flags, int hold, int stream) {
    char text[DEVSHARE_HANDLE_MAX_TEXT_SIZE];
    DS_OK(devshare_handle_to_text(h, text, sizeof text, NULL));
    return ask(c, "import %d %u %d %d %s", device, flags, hold, stream, text);
}

static CUipcMemHandle ipc_of(const DevshareHandle *h) {
    CUipcMemHandle m;
    memcpy(m.reserved, h->key, sizeof m.reserved);
    return m;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--child") == 0) {
        return child_main();
    }
    if (!getenv("DEVSHARE_CUDA_LIBRARY")) {
        fprintf(stderr, "test_cuda: set DEVSHARE_CUDA_LIBRARY to the stand-in libcuda.so.1\n");
        return 2;
    }
    harness_start("test_cuda");

    DevshareBackendInfo bi;
    DS_OK(devshare_backend_info_init(&bi, sizeof bi));
    DS_OK(devshare_probe(DEVSHARE_BACKEND_CUDA, &bi));
    CHECK(bi.usable == 1, "probe: cuda usable over the stand-in (%s)", bi.detail);

    CU_OK(cuInit(0));
    make_current(0);

    /* Stream-ordered pool memory cannot be exported with legacy IPC. */
    CUdeviceptr pool = 0;
    CU_OK(cuMemAllocAsync(&pool, 64 * KIB, NULL));
    DevshareExporter *e = NULL;
    int32_t st = devshare_export(DEVSHARE_BACKEND_CUDA, 0, (void *)(uintptr_t)pool, 64 * KIB, 0, &e);
    CHECK(st == DEVSHARE_STATUS_UNSUPPORTED && strstr(last_error(), "cudaMallocAsync"),
          "pool memory is refused, naming cudaMallocAsync and what to use instead");
    CU_OK(cuMemFreeAsync(pool, NULL));

    /* One 1 MiB block, float i at element i; export a window inside it. */
    const size_t size = MIB;
    CUdeviceptr base = 0;
    CU_OK(cuMemAlloc(&base, size));
    float *host = malloc(size);
    for (size_t i = 0; i < size / 4; i++) {
        host[i] = (float)i;
    }
    CU_OK(cuMemcpyHtoD(base, host, size));
    const uint64_t win = 64 * KIB;
    DS_OK(devshare_export(DEVSHARE_BACKEND_CUDA, 0, (void *)(uintptr_t)(base + win), 256 * KIB, 0, &e));
    void *mem = NULL;
    uint64_t mem_size = 0;
    DS_OK(devshare_exporter_memory(e, &mem, &mem_size));
    CHECK(mem == (void *)(uintptr_t)(base + win) && mem_size == 256 * KIB,
          "the exporter reports the caller's window, not the block");
    st = devshare_export(DEVSHARE_BACKEND_CUDA, 0, (void *)(uintptr_t)(base + win), size, 0, &e);
    CHECK(st == DEVSHARE_STATUS_INVALID_ARGUMENT, "a window running past its block is refused");
    DevshareExporter *e2 = NULL;
    DS_OK(devshare_export(DEVSHARE_BACKEND_CUDA, 0, (void *)(uintptr_t)(base + 512 * KIB), 4 * KIB, 0, &e2));
    CHECK(cusi_handle_fetches(base) == 1, "two exporters of one block fetch its IPC handle once (%d)",
          cusi_handle_fetches(base));
    DevshareHandle h1 = share_f32(e, 0, 4096, 16, 64, 0, 0, NULL);
    CHECK(h1.alloc_size == size && h1.storage_offset == win, "handles name the whole block and carry the window's offset");
    DevshareHandle hz = share_f32(e2, 0, 4096, 4, 4, 0, 0, NULL);
    CHECK(memcmp(hz.key, h1.key, 64) == 0 && hz.storage_offset == 512 * KIB, "both exporters' handles name one block");
    CHECK(memcmp(hz.device_uuid, (uint8_t[16]){0}, 16) != 0, "handles carry the device UUID");

    /* Not in the exporting process. */
    DevshareImport *self_imp = NULL;
    st = devshare_import(&h1, NULL, &self_imp);
    CHECK(st == DEVSHARE_STATUS_UNSUPPORTED && strstr(last_error(), "exported"),
          "importing in the exporting process is refused before the driver is asked (%s)", last_error());

    /* A consumer: data, offsets, one open per handle per process. */
    Child c1 = spawn(NULL, NULL);
    const char *a = import_cmd(&c1, &h1, -1, 0, 0, 0);
    CHECK(strncmp(a, "OK 1024 0", 9) == 0, "a consumer imports the window's first tensor and reads it right (%s)", a);
    a = import_cmd(&c1, &hz, -1, 0, 0, 0);
    CHECK(strncmp(a, "OK 16 0", 7) == 0, "the second exporter's tensor reads right (%s)", a);
    DevshareHandle h2 = share_f32(e, 8192, 8192, 4, 100, 7, 0, NULL);
    DevshareHandle h3 = share_f32(e, 128 * KIB, 128 * KIB, 3, 33, 1000, 0, NULL);
    a = import_cmd(&c1, &h2, -1, 0, 1, 0);
    CHECK(strncmp(a, "OK 400", 6) == 0, "tensor 2 (storage 8 KiB into the window, offset 7) reads right (%s)", a);
    a = import_cmd(&c1, &h3, -1, 0, 1, 0);
    CHECK(strncmp(a, "OK 99", 5) == 0, "tensor 3 (storage 128 KiB into the window, offset 1000) reads right (%s)", a);
    CHECK(cusi_live_opens(ipc_of(&h1)) == 1, "two held imports are one cuIpcOpenMemHandle (%d)",
          cusi_live_opens(ipc_of(&h1)));

    /* Close order. */
    st = devshare_exporter_close(e, 0);
    CHECK(st == DEVSHARE_STATUS_BUSY, "the exporter cannot close while references are outstanding");
    a = ask(&c1, "release");
    CHECK(strcmp(a, "OK 2") == 0, "the consumer releases both");
    CHECK(cusi_live_opens(ipc_of(&h1)) == 0, "the last release closed the IPC mapping");
    CHECK(outstanding(e) == 0, "no reference outstanding after the releases");

    /* Devices: by UUID under a reordered device list, and by override. */
    Child c2 = spawn("CUDA_STANDIN_VISIBLE", "1,0");
    DevshareHandle hr = share_f32(e, 0, 4096, 16, 64, 0, 0, NULL);
    a = import_cmd(&c2, &hr, -1, 0, 0, 0);
    CHECK(strncmp(a, "OK 1024 1", 9) == 0,
          "with devices reordered the consumer imports on the device with the handle's UUID (ordinal 1) (%s)", a);
    CHECK(finish(&c2), "reordered consumer exits cleanly");
    DevshareHandle hx = share_f32(e, 0, 4096, 8, 8, 0, 0, NULL);
    a = import_cmd(&c1, &hx, 1, DEVSHARE_IMPORT_NO_PEER_ACCESS, 0, 0);
    CHECK(strncmp(a, "ERR -34", 7) == 0 && strstr(a, "705"), "an override to device 1 without peer access fails (%s)", a);
    a = import_cmd(&c1, &hx, 1, 0, 0, 0);
    CHECK(strncmp(a, "OK 64 1", 7) == 0, "an override to device 1 with lazy peer access reads right (%s)", a);

    /* Events. */
    CUstream stream = NULL;
    CU_OK(cuStreamCreate(&stream, 0));
    DevshareHandle he = share_f32(e, 4096, 4096, 32, 32, 0, DEVSHARE_SHARE_EVENT, stream);
    CHECK((he.flags & DEVSHARE_HANDLE_FLAG_EVENT) != 0, "a share with DEVSHARE_SHARE_EVENT carries an event");
    a = import_cmd(&c1, &he, -1, 0, 0, 0);
    CHECK(strncmp(a, "OK 1024", 7) == 0, "without a stream the consumer blocks on the event, then reads (%s)", a);
    DevshareHandle he2 = share_f32(e, 4096, 4096, 32, 32, 0, DEVSHARE_SHARE_EVENT, stream);
    a = import_cmd(&c1, &he2, -1, 0, 0, 1);
    CHECK(strncmp(a, "OK 1024", 7) == 0, "with a stream the consumer's stream waits on the event (%s)", a);

    /* Duplicate arrival: two handles for one storage, one handle imported twice. */
    DevshareHandle d1 = share_f32(e, 0, 4096, 4, 4, 0, 0, NULL);
    DevshareHandle d2 = share_f32(e, 0, 4096, 4, 4, 0, 0, NULL);
    import_cmd(&c1, &d1, -1, 0, 1, 0);
    import_cmd(&c1, &d2, -1, 0, 1, 0);
    import_cmd(&c1, &d2, -1, 0, 1, 0);
    CHECK(outstanding(e) == 2, "a duplicate import of one handle holds its single reference");
    CHECK(slot_value(&d1) == 1 && slot_value(&d2) == 1, "both slots are 1 while held");
    ask(&c1, "release");
    CHECK(outstanding(e) == 0 && slot_value(&d1) == 0 && slot_value(&d2) == 0,
          "each arrival returned exactly once: both slots exactly 0, not below (%" PRId64 ", %" PRId64 ")",
          slot_value(&d1), slot_value(&d2));

    /* Threads: 8 threads of one consumer import and release one handle 200 times each. */
    DevshareHandle ht = share_f32(e, 0, 4096, 16, 64, 0, 0, NULL);
    char ttext[DEVSHARE_HANDLE_MAX_TEXT_SIZE];
    DS_OK(devshare_handle_to_text(&ht, ttext, sizeof ttext, NULL));
    a = ask(&c1, "threads 8 200 %s", ttext);
    CHECK(strcmp(a, "OK 0") == 0 && outstanding(e) == 0 && cusi_live_opens(ipc_of(&ht)) == 0,
          "8 threads without a current context import and release concurrently; one reference returned, "
          "the mapping closed (%s)", a);

    /* Hand back: the storage fields PyTorch's rebuild_cuda_tensor takes. */
    DevshareTorchStorage ts;
    DS_OK(devshare_torch_storage_init(&ts, sizeof ts));
    DS_OK(devshare_handle_to_torch(&h1, &ts));
    CHECK(ts.struct_size == sizeof ts && ts.handle_len == 64 && memcmp(ts.handle, h1.key, 64) == 0 &&
              ts.storage_offset == win && ts.storage_size == 4096 && ts.ref_name_len == h1.ref_name_len &&
              ts.ref_slot == h1.ref_slot && ts.event_sync_required == 0,
          "devshare_handle_to_torch gives the raw 64-byte handle, offsets and the ref-counter");
    /* The output rules of devshare.h on DevshareTorchStorage: a struct_size below the library's
     * is refused; a newer caller's larger struct gets the library's bytes and keeps its tail. */
    DevshareTorchStorage unset;
    memset(&unset, 0, sizeof unset);
    st = devshare_handle_to_torch(&h1, &unset);
    CHECK(st == DEVSHARE_STATUS_INVALID_ARGUMENT && strstr(last_error(), "struct_size") != NULL,
          "devshare_handle_to_torch refuses an output whose struct_size is 0 (not initialised): %s", last_error());
    union {
        DevshareTorchStorage s;
        uint64_t align;
        unsigned char b[sizeof(DevshareTorchStorage) + 32];
    } big;
    DS_OK(devshare_torch_storage_init(&big.s, sizeof big.b));
    memset(big.b + sizeof(DevshareTorchStorage), 0xAB, 32);
    DS_OK(devshare_handle_to_torch(&h1, &big.s));
    int tail_kept = 1;
    for (size_t i = sizeof(DevshareTorchStorage); i < sizeof big.b; i++) {
        tail_kept &= big.b[i] == 0xAB;
    }
    CHECK(big.s.struct_size == sizeof(DevshareTorchStorage) && memcmp(&big.s, &ts, sizeof ts) == 0 && tail_kept,
          "devshare_handle_to_torch into a larger DevshareTorchStorage: struct_size becomes the library's size, "
          "the same bytes, the tail untouched");

    CHECK(finish(&c1), "first consumer exits cleanly");
    DS_OK(devshare_exporter_close(e, 0));
    DS_OK(devshare_exporter_close(e2, DEVSHARE_CLOSE_FORCE)); /* hz's reference was released above */
    CU_OK(cuStreamDestroy(stream));
    CU_OK(cuMemFree(base));
    free(host);

    harness_check_log(cusi_violation_count(), "the CUDA stand-in");
    return harness_done();
}
