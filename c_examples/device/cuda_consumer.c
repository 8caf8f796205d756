/* SPDX-License-Identifier: Apache-2.0 */
/*
 * cuda_consumer: import an NVIDIA GPU tensor shared by `cuda_producer`, check it, write a
 * result into it, release it.
 *
 *   cuda_consumer            (started by cuda_producer; reads the handle text from stdin)
 *
 * It reads one line from stdin, the handle text; its messages go to stderr. A CUDA IPC handle
 * opens only in a process other than the exporter's, and needs no pid whitelist.
 *
 * The tensor must be 2-D float32, R x C with R >= 2 and rows 0..R-2 holding v[i][j] =
 * i*1000 + j. The consumer imports it with a stream of its own (when the handle carries an IPC
 * event, the import makes that stream wait on it), copies it to the host, checks it, writes the
 * column sums of rows 0..R-2 into row R-1 and releases the import, which returns the handle's
 * reference to the producer. Device memory is only ever reached through cuMemcpy*: on a GPU
 * the imported pointer is not a host address.
 *
 * Run it through the producer (see cuda_producer.c). With the CUDA toolkit installed, the same source builds against the real cuda.h and
 * libcuda.so.1 (DEVSHARE_EXAMPLE_REAL_CUDA); over the test stand-in it needs
 * DEVSHARE_CUDA_LIBRARY.
 *
 * Exit status: 0 on success, 1 on any failure.
 */
#define _POSIX_C_SOURCE 200809L

#if defined(DEVSHARE_EXAMPLE_REAL_CUDA)
#include <cuda.h>
#else
#include "cuda_standin.h" /* the test stand-in's copy of the driver API declarations */
#endif
#include "devshare.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { DEVICE = 0 }; /* both processes use device 0 */

static void report(const char *what, int32_t status) {
    char msg[1024];
    devshare_last_error(msg, sizeof msg);
    fprintf(stderr, "cuda_consumer: %s failed: %s (%d): %s\n", what, devshare_status_str(status),
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
    fprintf(stderr, "cuda_consumer: %s failed: CUDA error %d (%s)\n", what, (int)rc, name ? name : "?");
    return 1;
}

/* Copy the tensor to the host, check it, write the column sums into its last row; 0 on
 * success. Element (i, j) is at data + i * strides[0] + j (in elements): rows are contiguous
 * but may be padded, so one copy of the whole span brings every row over. */
static int consume(const DevshareHandle *h, const DevshareImportInfo *info, CUstream stream) {
    if (h->dtype.code != DEVSHARE_DTYPE_FLOAT || h->dtype.bits != 32 || h->dtype.lanes != 1) {
        fprintf(stderr, "cuda_consumer: expected float32\n");
        return 1;
    }
    if (h->ndim != 2 || h->shape[0] < 2 || h->shape[1] < 1 || h->strides[1] != 1 ||
        h->strides[0] < h->shape[1]) {
        fprintf(stderr, "cuda_consumer: expected a 2-D tensor of at least 2 contiguous rows\n");
        return 1;
    }
    const int64_t rows = h->shape[0], cols = h->shape[1], pitch = h->strides[0];
    const size_t span = (size_t)((rows - 1) * pitch + cols) * sizeof(float);
    /* A device address, carried in a void * by devshare. */
    const CUdeviceptr data = (CUdeviceptr)(uintptr_t)info->data;
    float *host = malloc(span);
    float *sums = malloc((size_t)cols * sizeof(float));
    int rc = 1;
    if (!host || !sums) {
        fprintf(stderr, "cuda_consumer: out of host memory\n");
        goto out;
    }
    if (cu_failed("cuMemcpyDtoH", cuMemcpyDtoH(host, data, span))) {
        goto out;
    }
    for (int64_t i = 0; i + 1 < rows; i++) {
        for (int64_t j = 0; j < cols; j++) {
            const float want = (float)(i * 1000 + j);
            if (host[i * pitch + j] != want) {
                fprintf(stderr, "cuda_consumer: pattern broken at [%" PRId64 "][%" PRId64 "]: %.1f, expected %.1f\n",
                        i, j, (double)host[i * pitch + j], (double)want);
                goto out;
            }
        }
    }
    fprintf(stderr, "cuda_consumer[%ld]: %" PRId64 "x%" PRId64 " float32 on GPU %d: data rows 0..%" PRId64
            " ok\n", (long)getpid(), rows, cols, (int)info->device, rows - 2);
    /* Sum in double: the sums are integers below 2^25, exact in float32 once summed exactly. */
    for (int64_t j = 0; j < cols; j++) {
        double sum = 0.0;
        for (int64_t i = 0; i + 1 < rows; i++) {
            sum += host[i * pitch + j];
        }
        sums[j] = (float)sum;
    }
    /* The result row is ours to write: row rows-1 of the shared tensor, on the device. */
    const CUdeviceptr result_row = data + (CUdeviceptr)((rows - 1) * pitch) * sizeof(float);
    if (cu_failed("cuMemcpyHtoD", cuMemcpyHtoD(result_row, sums, (size_t)cols * sizeof(float)))) {
        goto out;
    }
    /* cuMemcpyHtoD returns once the copy is done, but whatever this process queued on its
     * stream (a kernel computing the sums, in a real program) must be finished before the
     * release tells the producer that it may read. */
    if (cu_failed("cuStreamSynchronize", cuStreamSynchronize(stream))) {
        goto out;
    }
    fprintf(stderr, "cuda_consumer[%ld]: wrote the column sums into row %" PRId64 ": %.0f %.0f ... %.0f\n",
            (long)getpid(), rows - 1, (double)sums[0], (double)sums[cols > 1 ? 1 : 0],
            (double)sums[cols - 1]);
    rc = 0;
out:
    free(host);
    free(sums);
    return rc;
}

int main(void) {
    int rc = 1;
    int32_t st;
    CUdevice dev;
    CUcontext ctx = NULL;
    CUstream stream = NULL;
    DevshareImport *imp = NULL;

    /* The driver API works on the calling thread's current context: the device's primary
     * context (devshare retains and uses it too). */
    if (cu_failed("cuInit", cuInit(0)) || cu_failed("cuDeviceGet", cuDeviceGet(&dev, DEVICE)) ||
        cu_failed("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain(&ctx, dev))) {
        return 1;
    }
    if (cu_failed("cuCtxSetCurrent", cuCtxSetCurrent(ctx)) ||
        cu_failed("cuStreamCreate", cuStreamCreate(&stream, CU_STREAM_DEFAULT))) {
        goto release_ctx;
    }

    /* 1. Receive the handle. */
    char text[DEVSHARE_HANDLE_MAX_TEXT_SIZE + 2];
    if (!fgets(text, sizeof text, stdin)) {
        fprintf(stderr, "cuda_consumer: no handle on stdin\n");
        goto destroy_stream;
    }
    DevshareHandle h;
    if ((st = devshare_handle_from_text(text, &h)) != DEVSHARE_STATUS_OK) {
        report("devshare_handle_from_text", st);
        goto destroy_stream;
    }
    if (h.backend != DEVSHARE_BACKEND_CUDA) {
        fprintf(stderr, "cuda_consumer: the handle is not for the cuda backend (backend %u)\n",
                (unsigned)h.backend);
        goto destroy_stream;
    }

    /* 2. Import on our device with our stream: the producer's IPC event (if any) is waited on
     * by that stream, so work queued on it after the import sees the producer's data.
     * (DEVSHARE_DEVICE_FROM_HANDLE would pick the local device with the handle's UUID, which
     * then needs a stream of that device.) */
    DevshareImportOptions opts;
    devshare_import_options_init(&opts, sizeof opts); /* struct_size and the defaults */
    opts.device = DEVICE;
    opts.stream = stream;
    if ((st = devshare_import(&h, &opts, &imp)) != DEVSHARE_STATUS_OK) {
        report("devshare_import", st);
        goto destroy_stream;
    }
    fprintf(stderr, "cuda_consumer[%ld]: imported (event: %s)\n", (long)getpid(),
            (h.flags & DEVSHARE_HANDLE_FLAG_EVENT) ? "yes, our stream waits on it" : "no");
    DevshareImportInfo info;
    devshare_import_info_init(&info, sizeof info); /* struct_size: the room the library may fill */
    if ((st = devshare_import_info(imp, &info)) != DEVSHARE_STATUS_OK) {
        report("devshare_import_info", st);
    } else if (!cu_failed("cuStreamSynchronize", cuStreamSynchronize(stream))) {
        /* cuMemcpyDtoH is not ordered on our stream: synchronising it above finished the wait
         * on the producer's event before the first copy. */
        rc = consume(&h, &info, stream);
    }

    /* 3. Release: closes the IPC mapping, then hands the reference back to the producer.
     * Always release, also after a failure, or the producer waits in vain. */
    if ((st = devshare_import_release(imp)) != DEVSHARE_STATUS_OK) {
        report("devshare_import_release", st);
        rc = 1;
    } else {
        fprintf(stderr, "cuda_consumer[%ld]: released the import%s\n", (long)getpid(),
                rc == 0 ? "; done" : " after a failure");
    }

destroy_stream:
    if (cu_failed("cuStreamDestroy", cuStreamDestroy(stream))) {
        rc = 1;
    }
release_ctx:
    cuDevicePrimaryCtxRelease(dev);
    return rc;
}
