/* SPDX-License-Identifier: Apache-2.0 */
/*
 * cuda_producer: share an NVIDIA GPU tensor with another process (cuda backend, CUDA driver
 * API) and check what the consumer writes into it.
 *
 *   cuda_producer <consumer-command>
 *
 * The producer allocates 2 MiB of device memory (cuMemAlloc; legacy CUDA IPC cannot export
 * stream-ordered pool or VMM memory) and copies a (R+1) x C = 257 x 256 float32 tensor into it,
 * 64 KiB into the allocation: rows 0..R-1 hold v[i][j] = i*1000 + j, row R is the result row
 * (zeros). Every other byte of the allocation holds a sentinel, so stray writes are caught.
 *
 * It exports the allocation, then runs the consumer command (split at spaces, no quoting, e.g.
 * `cuda_producer "compute-sanitizer ./cuda_consumer"`) as a child whose stdin is a pipe. A CUDA
 * IPC handle cannot be opened in the process that exported it: the consumer must be another
 * process. CUDA has no pid whitelist, so unlike npu_producer there is no pid step:
 *   1. the producer shares the tensor with DEVSHARE_SHARE_EVENT on a stream it created: instead
 *      of synchronising, devshare records an interprocess event there, and the consumer's
 *      import makes the consumer's stream wait on it;
 *   2. the producer sends the handle text as one line;
 *   3. the consumer checks the data, writes the column sums of rows 0..R-1 into row R and
 *      releases its import, which hands the reference back; the producer waits for that
 *      (devshare_exporter_wait), copies the whole allocation back and checks it.
 * The consumer's messages go to stderr, straight to the terminal. Device memory is only ever
 * reached through cuMemcpy*: on a GPU a CUdeviceptr is not a host address.
 *
 * Run it by hand from the build directory, over the test stand-in driver (no GPU needed;
 * CUDA_STANDIN_NO_HOST_ACCESS=1 makes device addresses fault on host access, as on a GPU):
 *
 *   DEVSHARE_CUDA_LIBRARY=$PWD/cargo/release/standin/cuda/libcuda.so.1 CUDA_STANDIN_NO_HOST_ACCESS=1 \
 *       c_examples/device/cuda_producer c_examples/device/cuda_consumer
 *
 * With the CUDA toolkit installed, the same source builds against the real cuda.h and the
 * driver's libcuda.so.1 (CMake does so when find_package(CUDAToolkit) succeeds, defining
 * DEVSHARE_EXAMPLE_REAL_CUDA); then run it without DEVSHARE_CUDA_LIBRARY.
 *
 * Exit status: 0 when the consumer succeeded, the reference came back, the result row holds the
 * column sums and nothing else changed; 1 otherwise; 2 on a usage error.
 */
#define _GNU_SOURCE /* pipe2 */

#if defined(DEVSHARE_EXAMPLE_REAL_CUDA)
#include <cuda.h>
#else
#include "cuda_standin.h" /* the test stand-in's copy of the driver API declarations */
#endif
#include "devshare.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

enum {
    ROWS = 256,                  /* data rows; the tensor has ROWS + 1 rows, the last is the result */
    COLS = 256,
    DEVICE = 0,                  /* both processes use device 0 */
    STORAGE_OFFSET = 64 * 1024,  /* bytes from the allocation start to the tensor */
    ALLOC_SIZE = 2 * 1024 * 1024,
    SENTINEL = 0xA5,             /* every byte of the allocation that is not a tensor element */
    WAIT_MS = 60000,             /* for the release */
    GRACE_MS = 3000,             /* for the release once the consumer has exited */
    REAP_MS = 30000,             /* for the consumer's exit */
};
#define TENSOR_BYTES ((size_t)(ROWS + 1) * COLS * sizeof(float))

static void report(const char *what, int32_t status) {
    char msg[1024];
    devshare_last_error(msg, sizeof msg);
    fprintf(stderr, "cuda_producer: %s failed: %s (%d): %s\n", what, devshare_status_str(status),
            (int)status, msg);
}

/* 1 (and a message) when a driver call failed. */
static int cu_failed(const char *what, CUresult rc) {
    if (rc == CUDA_SUCCESS) {
        return 0;
    }
    const char *name = NULL;
    if (cuGetErrorName(rc, &name) != CUDA_SUCCESS) {
        name = NULL;
    }
    fprintf(stderr, "cuda_producer: %s failed: CUDA error %d (%s)\n", what, (int)rc, name ? name : "?");
    return 1;
}

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Element (i, j) of the tensor in a host image of the whole allocation. */
static float *element(unsigned char *image, int i, int j) {
    return (float *)(void *)(image + STORAGE_OFFSET + ((size_t)i * COLS + (size_t)j) * sizeof(float));
}

/* The exact column sum of rows 0..ROWS-1 (an even integer below 2^25, so exact in float32). */
static float column_sum(int j) {
    double sum = 0.0;
    for (int i = 0; i < ROWS; i++) {
        sum += (double)i * 1000.0 + j;
    }
    return (float)sum;
}

static void fill(unsigned char *image) {
    memset(image, SENTINEL, ALLOC_SIZE);
    for (int i = 0; i <= ROWS; i++) {
        for (int j = 0; j < COLS; j++) {
            *element(image, i, j) = i < ROWS ? (float)(i * 1000 + j) : 0.0f;
        }
    }
}

/* 0 when the data rows are intact, the result row holds the column sums and no byte outside
 * the tensor changed. */
static int check(unsigned char *image) {
    for (int i = 0; i <= ROWS; i++) {
        for (int j = 0; j < COLS; j++) {
            const float want = i < ROWS ? (float)(i * 1000 + j) : column_sum(j);
            const float got = *element(image, i, j);
            if (got != want) {
                fprintf(stderr, "cuda_producer: element [%d][%d] is %.1f, expected %.1f\n", i, j,
                        (double)got, (double)want);
                return 1;
            }
        }
    }
    for (size_t b = 0; b < ALLOC_SIZE; b++) {
        if ((b < STORAGE_OFFSET || b >= STORAGE_OFFSET + TENSOR_BYTES) && image[b] != SENTINEL) {
            fprintf(stderr, "cuda_producer: byte %zu outside the tensor changed to 0x%02x\n", b, image[b]);
            return 1;
        }
    }
    printf("cuda_producer: result row = %.0f %.0f %.0f ... %.0f: the column sums of rows 0..%d; "
           "data rows and the rest of the allocation unchanged\n",
           (double)*element(image, ROWS, 0), (double)*element(image, ROWS, 1),
           (double)*element(image, ROWS, 2), (double)*element(image, ROWS, COLS - 1), ROWS - 1);
    return 0;
}

/* ---- The consumer process ------------------------------------------------------------------- */

typedef struct {
    pid_t pid;
    int to;      /* its stdin */
    int exited;  /* reaped; `status` is valid */
    int status;
} Child;

/* Start `cmd` (split at spaces) with a pipe to its stdin; 0 on success. */
static int start_consumer(const char *cmd, Child *c) {
    char buf[4096];
    char *argv[64];
    int argc = 0;
    if (strlen(cmd) >= sizeof buf) {
        fprintf(stderr, "cuda_producer: consumer command too long\n");
        return 1;
    }
    strcpy(buf, cmd);
    char *save = NULL;
    for (char *tok = strtok_r(buf, " \t", &save); tok && argc < 63; tok = strtok_r(NULL, " \t", &save)) {
        argv[argc++] = tok;
    }
    argv[argc] = NULL;
    if (argc == 0) {
        fprintf(stderr, "cuda_producer: empty consumer command\n");
        return 1;
    }
    /* Close-on-exec: the child keeps only the read end dup2'd onto its stdin, so it sees EOF
     * when we close our end. */
    int in[2];
    if (pipe2(in, O_CLOEXEC) != 0) {
        perror("cuda_producer: pipe2");
        return 1;
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], STDIN_FILENO);
    /* We ignore SIGPIPE; the consumer gets the default back. */
    posix_spawnattr_t attr;
    sigset_t def;
    sigemptyset(&def);
    sigaddset(&def, SIGPIPE);
    posix_spawnattr_init(&attr);
    posix_spawnattr_setsigdefault(&attr, &def);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGDEF);
    fflush(stdout);
    fflush(stderr);
    /* posix_spawn execs at once: the child never runs the driver this process initialised
     * (CUDA does not survive fork). */
    const int err = posix_spawnp(&c->pid, argv[0], &fa, &attr, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    close(in[0]);
    if (err != 0) {
        fprintf(stderr, "cuda_producer: cannot start \"%s\": %s\n", cmd, strerror(err));
        close(in[1]);
        return 1;
    }
    c->to = in[1];
    c->exited = 0;
    printf("cuda_producer: started the consumer (pid %ld): %s\n", (long)c->pid, cmd);
    return 0;
}

/* Reap the consumer if it has exited (or wait up to `timeout_ms` for it, then stop it). */
static void reap(Child *c, int timeout_ms) {
    const int64_t deadline = now_ms() + timeout_ms;
    while (!c->exited) {
        if (waitpid(c->pid, &c->status, WNOHANG) == c->pid) {
            c->exited = 1;
        } else if (now_ms() >= deadline) {
            if (timeout_ms > 0) {
                fprintf(stderr, "cuda_producer: stopping the consumer (pid %ld)\n", (long)c->pid);
                kill(c->pid, SIGTERM);
                c->exited = waitpid(c->pid, &c->status, 0) == c->pid;
            }
            return;
        } else {
            nanosleep(&(struct timespec){.tv_sec = 0, .tv_nsec = 10 * 1000 * 1000}, NULL);
        }
    }
}

/* Wait until the consumer released its reference. devshare_exporter_wait is called in short
 * slices so that a consumer that dies without releasing is noticed: its reference would never
 * come back, so after it exits we wait only GRACE_MS more. */
static int wait_release(DevshareExporter *exp, Child *c) {
    int64_t deadline = now_ms() + WAIT_MS;
    for (;;) {
        const int32_t st = devshare_exporter_wait(exp, 100);
        if (st == DEVSHARE_STATUS_OK) {
            printf("cuda_producer: the consumer released its reference\n");
            return 0;
        }
        if (st != DEVSHARE_STATUS_TIMEOUT) {
            report("devshare_exporter_wait", st);
            return 1;
        }
        if (!c->exited) {
            reap(c, 0);
            if (c->exited && now_ms() + GRACE_MS < deadline) {
                deadline = now_ms() + GRACE_MS;
            }
        }
        if (now_ms() > deadline) {
            fprintf(stderr, "cuda_producer: the reference did not come back\n");
            return 1;
        }
    }
}

/* Steps 1-3 of the top comment; 0 when the consumer released its reference and exited 0. */
static int run_consumer(DevshareExporter *exp, CUstream stream, const char *cmd) {
    Child c;
    if (start_consumer(cmd, &c) != 0) {
        return 1;
    }
    int failed = 1;
    int32_t st;
    DevshareHandle h;
    char text[DEVSHARE_HANDLE_MAX_TEXT_SIZE + 1];
    size_t len = 0;
    const int64_t shape[2] = {ROWS + 1, COLS};
    const int64_t strides[2] = {COLS, 1};
    DevshareTensorDesc desc;
    /* struct_size and the defaults (storage to the end of the allocation, everything else 0);
     * cannot fail for a non-NULL pointer and sizeof. */
    devshare_tensor_desc_init(&desc, sizeof desc);
    desc.dtype = (DevshareDType){.code = DEVSHARE_DTYPE_FLOAT, .bits = 32, .lanes = 1};
    desc.ndim = 2;
    desc.shape = shape;
    desc.strides = strides;
    desc.storage_offset = STORAGE_OFFSET;
    desc.storage_size = TENSOR_BYTES;
    desc.flags = DEVSHARE_SHARE_EVENT; /* record an IPC event on `stream`; do not synchronise */
    desc.stream = stream;

    if ((st = devshare_exporter_share(exp, &desc, &h)) != DEVSHARE_STATUS_OK) {
        report("devshare_exporter_share", st);
    } else if ((st = devshare_handle_to_text(&h, text, sizeof text - 1, &len)) != DEVSHARE_STATUS_OK) {
        report("devshare_handle_to_text", st);
    } else {
        printf("cuda_producer: handle (with an IPC event): %s\n", text);
        text[len++] = '\n';
        if (write(c.to, text, len) != (ssize_t)len) {
            perror("cuda_producer: sending the handle to the consumer");
        } else {
            failed = wait_release(exp, &c);
        }
    }
    close(c.to); /* EOF for a consumer still waiting for its handle */
    reap(&c, REAP_MS);
    if (c.exited && WIFEXITED(c.status)) {
        printf("cuda_producer: the consumer exited with status %d\n", WEXITSTATUS(c.status));
        failed |= WEXITSTATUS(c.status) != 0;
    } else {
        fprintf(stderr, "cuda_producer: the consumer was killed\n");
        failed = 1;
    }
    return failed;
}

/* ---- main ----------------------------------------------------------------------------------- */

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s <consumer-command>\n", argc > 0 ? argv[0] : "cuda_producer");
        return 2;
    }
    /* A consumer that died early makes write() fail with EPIPE instead of killing us. */
    signal(SIGPIPE, SIG_IGN);
    /* Our lines and the consumer's (on stderr) stay in order even when stdout is a pipe. */
    setvbuf(stdout, NULL, _IOLBF, 0);

    int failed = 1;
    int32_t st;
    CUdevice dev;
    CUcontext ctx = NULL;
    CUdeviceptr mem = 0;
    CUstream stream = NULL;
    DevshareExporter *exp = NULL;
    unsigned char *image = malloc(ALLOC_SIZE);
    if (!image) {
        fprintf(stderr, "cuda_producer: out of host memory\n");
        return 1;
    }

    /* The driver API works on the calling thread's current context: the device's primary
     * context, the one the runtime API and PyTorch use (devshare retains it too). */
    if (cu_failed("cuInit", cuInit(0)) || cu_failed("cuDeviceGet", cuDeviceGet(&dev, DEVICE))) {
        free(image);
        return 1;
    }
    if (cu_failed("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain(&ctx, dev))) {
        free(image);
        return 1;
    }
    if (cu_failed("cuCtxSetCurrent", cuCtxSetCurrent(ctx)) ||
        cu_failed("cuMemAlloc", cuMemAlloc(&mem, ALLOC_SIZE))) {
        goto release_ctx;
    }
    fill(image);
    if (cu_failed("cuMemcpyHtoD", cuMemcpyHtoD(mem, image, ALLOC_SIZE))) {
        goto free_mem;
    }
    printf("cuda_producer[%ld]: %dx%d float32 (%d data rows + a result row) %d KiB into a %d MiB "
           "allocation on GPU %d\n",
           (long)getpid(), ROWS + 1, COLS, ROWS, STORAGE_OFFSET / 1024, ALLOC_SIZE / (1024 * 1024), DEVICE);

    st = devshare_export(DEVSHARE_BACKEND_CUDA, DEVICE, (void *)(uintptr_t)mem, ALLOC_SIZE, 0, &exp);
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_export", st);
        goto free_mem;
    }
    /* The stream whose work produced the data. Here the data came from a synchronous copy; in
     * a real program kernels on this stream would still be running when the handle is sent,
     * and the IPC event makes the consumer wait for them. */
    if (cu_failed("cuStreamCreate", cuStreamCreate(&stream, CU_STREAM_DEFAULT))) {
        goto close_exp;
    }

    failed = run_consumer(exp, stream, argv[1]);

    /* Only read the result once the reference came back: until then the consumer may still be
     * writing. */
    if (!failed) {
        if (cu_failed("cuMemcpyDtoH", cuMemcpyDtoH(image, mem, ALLOC_SIZE)) || check(image) != 0) {
            failed = 1;
        }
    }

close_exp:
    /* Refused (BUSY) while a reference is outstanding, e.g. after a failed consumer: then force
     * it, which is only safe because that consumer is gone. */
    st = devshare_exporter_close(exp, 0);
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_exporter_close", st);
        devshare_exporter_close(exp, DEVSHARE_CLOSE_FORCE);
        failed = 1;
    }
    if (stream && cu_failed("cuStreamDestroy", cuStreamDestroy(stream))) {
        failed = 1;
    }
free_mem:
    /* Free only after the exporter closed: the memory must outlive every import. */
    if (cu_failed("cuMemFree", cuMemFree(mem))) {
        failed = 1;
    }
release_ctx:
    cuDevicePrimaryCtxRelease(dev);
    free(image);
    printf("cuda_producer: %s\n", failed ? "FAILED" : "success");
    return failed;
}
