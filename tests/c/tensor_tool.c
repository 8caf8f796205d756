/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tensor_tool: the C side of the cross-language tests (tests/python).
 *
 *   tensor_tool open <handle-text> [<hex>]
 *       Import the handle and print
 *           info code=C bits=B lanes=L ndim=N shape=a,b,... strides=x,y,... numel=K
 *           data <hex of every element's bytes, in logical row-major order>
 *       then, if <hex> is given (numel * element size bytes), write those element bytes in the
 *       same order, release the import, print "released" and exit 0.
 *
 *   tensor_tool export <code> <bits> <shape-csv|scalar> <strides-csv|-> <storage_offset_bytes>
 *                      <tensor_offset_elems> <alloc_bytes> <hex>
 *       Allocate <alloc_bytes> of shareable host memory, describe a tensor in it (strides "-":
 *       C-contiguous; shape "scalar": 0-d), write <hex> as its elements in logical order, print
 *       "handle <text>", wait up to 30 s for the consumer to release its reference, then print
 *       "released" and "data <hex>" (the elements as the consumer left them), close, exit 0.
 *
 * "Logical row-major order" walks the index space of the shape, last index fastest; element
 * (i0, i1, ...) lies at data + (i0*s0 + i1*s1 + ...) * element_size, with data the tensor's first
 * element (storage offset and tensor offset included). Exit status 1 on any failure (timeout
 * included) with the devshare status and devshare_last_error on stderr, 2 on a usage error.
 */
#define _POSIX_C_SOURCE 200809L

#define HARNESS_NAME "tensor_tool"
#include "harness.h"

#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { WAIT_MS = 30000 };

static void report(const char *what, int32_t status) {
    char msg[2048];
    fprintf(stderr, "tensor_tool: %s\n", ds_error(msg, sizeof msg, what, status));
}

static int usage(void) {
    fprintf(stderr,
            "usage: tensor_tool open <handle-text> [<hex>]\n"
            "       tensor_tool export <code> <bits> <shape-csv|scalar> <strides-csv|-> "
            "<storage_offset_bytes> <tensor_offset_elems> <alloc_bytes> <hex>\n");
    return 2;
}

/* Comma-separated int64 list into out[DEVSHARE_MAX_NDIM]; the count in *n. 0 on success. */
static int parse_csv(const char *s, int64_t *out, uint32_t *n) {
    char buf[512];
    if (strlen(s) >= sizeof buf) {
        return -1;
    }
    strcpy(buf, s);
    *n = 0;
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok != NULL; tok = strtok_r(NULL, ",", &save)) {
        if (*n >= DEVSHARE_MAX_NDIM || parse_i64(tok, &out[*n]) != 0) {
            return -1;
        }
        (*n)++;
    }
    return *n > 0 ? 0 : -1;
}

/* Decode exactly `len` bytes of hex into a fresh buffer (NULL on a length or digit error). */
static uint8_t *parse_hex(const char *hex, uint64_t len) {
    uint8_t *out = malloc(len > 0 ? (size_t)len : 1);
    if (out == NULL) {
        return NULL;
    }
    const int n = hex_decode(hex, out, (size_t)len);
    if (n < 0 || (uint64_t)n != len) {
        fprintf(stderr, "tensor_tool: %zu characters of text are not %" PRIu64 " bytes of hex\n", strlen(hex), len);
        free(out);
        return NULL;
    }
    return out;
}

/* Walks the elements of a tensor in logical row-major order. */
typedef struct {
    uint32_t ndim;
    const int64_t *shape;
    const int64_t *strides;
    int64_t index[DEVSHARE_MAX_NDIM];
    uint64_t numel;
} Walk;

static uint64_t numel_of(uint32_t ndim, const int64_t *shape) {
    uint64_t n = 1;
    for (uint32_t i = 0; i < ndim; i++) {
        n *= (uint64_t)shape[i];
    }
    return n;
}

static void walk_init(Walk *w, uint32_t ndim, const int64_t *shape, const int64_t *strides) {
    memset(w, 0, sizeof *w);
    w->ndim = ndim;
    w->shape = shape;
    w->strides = strides;
    w->numel = numel_of(ndim, shape);
}

/* Element offset (in elements) of the current index. */
static int64_t walk_offset(const Walk *w) {
    int64_t off = 0;
    for (uint32_t i = 0; i < w->ndim; i++) {
        off += w->index[i] * w->strides[i];
    }
    return off;
}

static void walk_next(Walk *w) {
    for (uint32_t i = w->ndim; i-- > 0;) {
        if (++w->index[i] < w->shape[i]) {
            return;
        }
        w->index[i] = 0;
    }
}

/* Print "data <hex>" of the elements at `data`. */
static void print_data(uint8_t *data, uint64_t esize, uint32_t ndim, const int64_t *shape,
                       const int64_t *strides) {
    Walk w;
    walk_init(&w, ndim, shape, strides);
    printf("data ");
    for (uint64_t k = 0; k < w.numel; k++, walk_next(&w)) {
        const uint8_t *e = data + walk_offset(&w) * (int64_t)esize;
        for (uint64_t b = 0; b < esize; b++) {
            printf("%02x", e[b]);
        }
    }
    printf("\n");
}

/* Copy element bytes (logical order) into the tensor at `data`. */
static void write_data(uint8_t *data, uint64_t esize, uint32_t ndim, const int64_t *shape,
                       const int64_t *strides, const uint8_t *bytes) {
    Walk w;
    walk_init(&w, ndim, shape, strides);
    for (uint64_t k = 0; k < w.numel; k++, walk_next(&w)) {
        memcpy(data + walk_offset(&w) * (int64_t)esize, bytes + k * esize, (size_t)esize);
    }
}

static void print_list(const char *label, uint32_t n, const int64_t *v) {
    printf(" %s=", label);
    for (uint32_t i = 0; i < n; i++) {
        printf("%s%" PRId64, i ? "," : "", v[i]);
    }
}

static int cmd_open(int argc, char **argv) {
    if (argc != 3 && argc != 4) {
        return usage();
    }
    DevshareHandle h;
    int32_t st = devshare_handle_from_text(argv[2], &h);
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_handle_from_text", st);
        return 1;
    }
    DevshareImport *imp = NULL;
    st = devshare_import(&h, NULL, &imp);
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_import", st);
        return 1;
    }
    DevshareImportInfo info;
    devshare_import_info_init(&info, sizeof info);
    st = devshare_import_info(imp, &info);
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_import_info", st);
        devshare_import_release(imp);
        return 1;
    }
    printf("info code=%u bits=%u lanes=%u ndim=%u", (unsigned)h.dtype.code,
           (unsigned)h.dtype.bits, (unsigned)h.dtype.lanes, (unsigned)h.ndim);
    print_list("shape", h.ndim, h.shape);
    print_list("strides", h.ndim, h.strides);
    printf(" numel=%" PRIu64 "\n", info.numel);
    print_data(info.data, info.element_size, h.ndim, h.shape, h.strides);
    int rc = 0;
    if (argc == 4) {
        uint8_t *bytes = parse_hex(argv[3], info.numel * info.element_size);
        if (bytes == NULL) {
            rc = 1;
        } else {
            write_data(info.data, info.element_size, h.ndim, h.shape, h.strides, bytes);
            free(bytes);
        }
    }
    st = devshare_import_release(imp);
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_import_release", st);
        return 1;
    }
    printf("released\n");
    fflush(stdout);
    return rc;
}

static int cmd_export(int argc, char **argv) {
    if (argc != 10) {
        return usage();
    }
    int64_t code, bits, storage_offset, tensor_offset, alloc_size;
    int64_t shape[DEVSHARE_MAX_NDIM] = {0}, strides[DEVSHARE_MAX_NDIM] = {0};
    uint32_t ndim = 0, nstrides = 0;
    if (parse_i64(argv[2], &code) != 0 || code < 0 || code > 255 ||
        parse_i64(argv[3], &bits) != 0 || bits < 0 || bits > 255 ||
        parse_i64(argv[6], &storage_offset) != 0 || storage_offset < 0 ||
        parse_i64(argv[7], &tensor_offset) != 0 ||
        parse_i64(argv[8], &alloc_size) != 0 || alloc_size < 0) {
        return usage();
    }
    if (strcmp(argv[4], "scalar") != 0 && parse_csv(argv[4], shape, &ndim) != 0) {
        return usage();
    }
    const int contiguous = strcmp(argv[5], "-") == 0;
    if (!contiguous && (parse_csv(argv[5], strides, &nstrides) != 0 || nstrides != ndim)) {
        fprintf(stderr, "tensor_tool: need %u strides or \"-\"\n", (unsigned)ndim);
        return usage();
    }

    DevshareExporter *exp = NULL;
    uint8_t *base = NULL;
    int32_t st = devshare_host_alloc((uint64_t)alloc_size, &exp, (void **)&base);
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_host_alloc", st);
        return 1;
    }
    DevshareTensorDesc desc;
    devshare_tensor_desc_init(&desc, sizeof desc); /* storage to the end of the allocation */
    desc.dtype = (DevshareDType){(uint8_t)code, (uint8_t)bits, 1};
    desc.ndim = ndim;
    desc.shape = shape;
    desc.strides = contiguous ? NULL : strides;
    desc.storage_offset = (uint64_t)storage_offset;
    desc.tensor_offset = tensor_offset;
    DevshareHandle h;
    st = devshare_exporter_share(exp, &desc, &h); /* validates the layout before any write */
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_exporter_share", st);
        devshare_exporter_close(exp, 0);
        return 1;
    }
    /* The element size and strides as the handle has them (strides filled in when "-"). */
    const uint64_t esize = (uint64_t)h.dtype.bits / 8 * h.dtype.lanes;
    uint8_t *data = base + h.storage_offset + (uint64_t)h.tensor_offset * esize;
    const uint64_t numel = numel_of(h.ndim, h.shape);
    uint8_t *bytes = parse_hex(argv[9], numel * esize);
    if (bytes == NULL) {
        devshare_exporter_close(exp, DEVSHARE_CLOSE_UNLINK);
        return 1;
    }
    write_data(data, esize, h.ndim, h.shape, h.strides, bytes);
    free(bytes);

    char text[DEVSHARE_HANDLE_MAX_TEXT_SIZE];
    st = devshare_handle_to_text(&h, text, sizeof text, NULL);
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_handle_to_text", st);
        devshare_exporter_close(exp, DEVSHARE_CLOSE_UNLINK);
        return 1;
    }
    printf("handle %s\n", text);
    fflush(stdout);

    st = devshare_exporter_wait(exp, WAIT_MS);
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_exporter_wait", st);
        devshare_exporter_close(exp, 0);
        return 1;
    }
    printf("released\n");
    print_data(data, esize, h.ndim, h.shape, h.strides);
    fflush(stdout);
    st = devshare_exporter_close(exp, 0);
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_exporter_close", st);
        return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "open") == 0) {
        return cmd_open(argc, argv);
    }
    if (argc >= 2 && strcmp(argv[1], "export") == 0) {
        return cmd_export(argc, argv);
    }
    return usage();
}
