/* SPDX-License-Identifier: Apache-2.0 */
/*
 * consumer: import a tensor shared by `producer`, check it, write a result into it, release it.
 *
 *   consumer <handle-text>
 *
 * The tensor must be 2-D float32, R x C with R >= 2, rows 0..R-2 holding v[i][j] = i*100 + j.
 * The consumer writes the column sums of those rows into row R-1, then releases its import,
 * which returns the handle's reference to the producer. Element addresses come from the
 * import's data pointer and the handle's strides only: no layout is assumed.
 *
 * Exit status: 0 on success, 1 on any failure (the message names the devshare status and the
 * library's error text), 2 on a usage error.
 */
#define _POSIX_C_SOURCE 200809L

#include "devshare.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void report(const char *what, int32_t status) {
    char msg[1024];
    devshare_last_error(msg, sizeof msg);
    fprintf(stderr, "consumer: %s failed: %s (%d): %s\n", what, devshare_status_str(status),
            (int)status, msg);
}

/* Address of element (i, j); strides are in elements and never negative (the handle was
 * validated on import). */
static float *element(float *data, const DevshareHandle *h, int64_t i, int64_t j) {
    return data + i * h->strides[0] + j * h->strides[1];
}

/* Check the tensor and write the column sums into its last row; 0 on success. */
static int consume(const DevshareHandle *h, const DevshareImportInfo *info) {
    if (h->dtype.code != DEVSHARE_DTYPE_FLOAT || h->dtype.bits != 32 || h->dtype.lanes != 1 ||
        info->element_size != sizeof(float)) {
        fprintf(stderr, "consumer: expected float32, got dtype code %u bits %u lanes %u\n",
                (unsigned)h->dtype.code, (unsigned)h->dtype.bits, (unsigned)h->dtype.lanes);
        return 1;
    }
    if (h->ndim != 2 || h->shape[0] < 2 || h->shape[1] < 1) {
        fprintf(stderr, "consumer: expected a 2-D tensor with at least 2 rows, got ndim %u\n",
                (unsigned)h->ndim);
        return 1;
    }
    const int64_t rows = h->shape[0], cols = h->shape[1];
    float *data = info->data;
    for (int64_t i = 0; i + 1 < rows; i++) {
        for (int64_t j = 0; j < cols; j++) {
            const float want = (float)(i * 100 + j);
            const float got = *element(data, h, i, j);
            if (got != want) {
                fprintf(stderr, "consumer: pattern broken at [%" PRId64 "][%" PRId64 "]: %g, expected %g\n",
                        i, j, (double)got, (double)want);
                return 1;
            }
        }
    }
    printf("consumer[%ld]: %" PRId64 "x%" PRId64 " float32, strides {%" PRId64 ", %" PRId64
           "}, storage offset %" PRIu64 " bytes, tensor offset %" PRId64 " elements: pattern ok\n",
           (long)getpid(), rows, cols, h->strides[0], h->strides[1], h->storage_offset,
           h->tensor_offset);
    printf("consumer[%ld]: wrote column sums into row %" PRId64 ":", (long)getpid(), rows - 1);
    for (int64_t j = 0; j < cols; j++) {
        float sum = 0.0f;
        for (int64_t i = 0; i + 1 < rows; i++) {
            sum += *element(data, h, i, j);
        }
        *element(data, h, rows - 1, j) = sum;
        printf(" %g", (double)sum);
    }
    printf("\n");
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s <handle-text>\n", argc > 0 ? argv[0] : "consumer");
        return 2;
    }
    DevshareHandle handle;
    int32_t st = devshare_handle_from_text(argv[1], &handle);
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_handle_from_text", st);
        return 1;
    }
    DevshareImport *imp = NULL;
    st = devshare_import(&handle, NULL, &imp);
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_import", st);
        return 1;
    }
    int rc = 1;
    DevshareImportInfo info;
    DevshareHandle imported;
    devshare_import_info_init(&info, sizeof info); /* struct_size: how much the caller has room for */
    st = devshare_import_info(imp, &info);
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_import_info", st);
    } else if ((st = devshare_import_handle(imp, &imported)) != DEVSHARE_STATUS_OK) {
        report("devshare_import_handle", st);
    } else {
        rc = consume(&imported, &info);
    }
    st = devshare_import_release(imp);
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_import_release", st);
        return 1;
    }
    printf("consumer[%ld]: released the import%s\n", (long)getpid(),
           rc == 0 ? "; done" : " after a failure");
    fflush(stdout);
    return rc;
}
