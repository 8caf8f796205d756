/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_api: the C API contract of devshare.h, checked from plain C in one process.
 *
 *  - every function given NULL for each pointer argument returns an error status, except the
 *    pointers the header documents as optional (ptr_out, size_out, len_out, options, desc, and
 *    devshare_last_error's buffer), and the last error message names the function;
 *  - out-of-range arguments (backend ids, close and import flags, options fields, tensor
 *    descriptions, handle fields) return the documented status;
 *  - status texts, version, last-error buffer handling;
 *  - encode / decode / text: buffer sizing, each kind of corruption, typos in the text;
 *  - probe results; imports of a removed object, of a released handle, read-only imports;
 *  - the struct_size rules: *_init writes exactly the size it is given (defaults, zero tail);
 *    a newer caller's larger input is read when its tail is zero and refused with
 *    UNSUPPORTED_VERSION otherwise; outputs are written up to the library's size, struct_size
 *    says how much, a larger caller's tail is left alone, a too-small struct_size is refused;
 *  - afterwards no shared-memory object of this process is left in /dev/shm.
 *
 * Prints "ok - <behaviour>" or "FAIL - <behaviour>" per case; exit status 0 when all passed.
 */
#define _POSIX_C_SOURCE 200809L

#define HARNESS_NAME "test_api"
#include "harness.h"

#include <dirent.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

/* `got` is the status `want`, and the last error names `fn`. */
static int expect_line(int line, int32_t got, int32_t want, const char *fn, const char *what) {
    const int ok = got == want && last_error_names(fn);
    harness_check(ok, line, "%s: %s -> %s", fn, what, devshare_status_str(want));
    if (!ok) {
        printf("    got %d (%s), last error: %s\n", (int)got, devshare_status_str(got), last_error());
    }
    return ok;
}
#define EXPECT(got, want, fn, what) expect_line(__LINE__, (got), (want), (fn), (what))

#define EXPECT_OK(got, what)                                                                         \
    do {                                                                                             \
        const int32_t st_ = (got);                                                                   \
        if (!CHECK(st_ == DEVSHARE_STATUS_OK, "%s", what)) {                                         \
            printf("    got %d (%s): %s\n", (int)st_, devshare_status_str(st_), last_error());      \
        }                                                                                            \
    } while (0)

static uint64_t outstanding(const DevshareExporter *exp) {
    uint64_t n = UINT64_MAX;
    DS_OK(devshare_exporter_outstanding(exp, &n));
    return n;
}

/* Names in /dev/shm carrying this process's pid (data objects and ref-counters): with `record`
 * (before anything is created), remembered as left by an earlier process that had the same pid;
 * otherwise the names not remembered are printed and counted. */
static char stale_shm[64][256];
static int n_stale_shm = -1; /* -1: more than fit, or not recorded */

static int own_shm(int record) {
    char p1[64], p2[64];
    snprintf(p1, sizeof p1, "devshare_%ld_", (long)getpid());
    snprintf(p2, sizeof p2, "devshare_rc_%ld_", (long)getpid());
    DIR *d = opendir("/dev/shm");
    if (d == NULL) {
        return -1;
    }
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (strncmp(e->d_name, p1, strlen(p1)) != 0 && strncmp(e->d_name, p2, strlen(p2)) != 0) {
            continue;
        }
        if (record) {
            if (n < 64) {
                snprintf(stale_shm[n], sizeof stale_shm[n], "%s", e->d_name);
            }
            n++;
            continue;
        }
        int stale = 0;
        for (int i = 0; i < n_stale_shm; i++) {
            stale = stale || strcmp(stale_shm[i], e->d_name) == 0;
        }
        if (!stale) {
            printf("    left over: /dev/shm/%s\n", e->d_name);
            n++;
        }
    }
    closedir(d);
    if (record) {
        n_stale_shm = n <= 64 ? n : -1;
    }
    return n;
}

/* The host key of a handle as a NUL-terminated shm name. */
static void key_name(const DevshareHandle *h, char *out, size_t cap) {
    size_t n = h->key_len < cap - 1 ? h->key_len : cap - 1;
    memcpy(out, h->key, n);
    out[n] = '\0';
}

/* Flag bits no release has assigned yet: the highest of each range (new flags are taken from the
 * bottom), so that the "unknown flag" cases keep testing unknown flags as flags are added. */
#define UNKNOWN_SHARE_FLAG 0x80000000u
#define UNKNOWN_IMPORT_FLAG 0x80000000u
#define UNKNOWN_MUST_UNDERSTAND_HANDLE_FLAG 0x8000u

/* A 4 x 6 float32 tensor at storage offset 128, tensor offset 2, in a 4096-byte allocation. */
enum { T_ROWS = 4, T_COLS = 6, T_STORAGE_OFFSET = 128, T_TENSOR_OFFSET = 2, ALLOC = 4096 };
static const int64_t t_shape[2] = {T_ROWS, T_COLS};

static DevshareTensorDesc float_desc(void) {
    DevshareTensorDesc d;
    DS_OK(devshare_tensor_desc_init(&d, sizeof d));
    d.dtype.code = DEVSHARE_DTYPE_FLOAT;
    d.dtype.bits = 32;
    d.dtype.lanes = 1;
    d.ndim = 2;
    d.shape = t_shape;
    d.strides = NULL;
    d.storage_offset = T_STORAGE_OFFSET;
    d.storage_size = DEVSHARE_STORAGE_TO_END;
    d.tensor_offset = T_TENSOR_OFFSET;
    return d;
}

static float *t_element(void *alloc_base, int i, int j) {
    return (float *)(void *)((char *)alloc_base + T_STORAGE_OFFSET) + T_TENSOR_OFFSET + i * T_COLS + j;
}

static void fill_pattern(void *base) {
    for (int i = 0; i < T_ROWS; i++) {
        for (int j = 0; j < T_COLS; j++) {
            *t_element(base, i, j) = (float)(i * 100 + j);
        }
    }
}

static int pattern_ok(const float *data, const DevshareHandle *h) {
    for (int64_t i = 0; i < h->shape[0]; i++) {
        for (int64_t j = 0; j < h->shape[1]; j++) {
            if (data[i * h->strides[0] + j * h->strides[1]] != (float)(i * 100 + j)) {
                return 0;
            }
        }
    }
    return 1;
}

/* ------------------------------------------------------------------------------------------ */

static void test_every_status_has_its_own_nonempty_text(void) {
    static const int32_t all[] = {
        DEVSHARE_STATUS_OK,
        DEVSHARE_STATUS_NULL_ARGUMENT,
        DEVSHARE_STATUS_INVALID_ARGUMENT,
        DEVSHARE_STATUS_BUFFER_TOO_SMALL,
        DEVSHARE_STATUS_TRUNCATED,
        DEVSHARE_STATUS_BAD_MAGIC,
        DEVSHARE_STATUS_UNSUPPORTED_VERSION,
        DEVSHARE_STATUS_CHECKSUM_MISMATCH,
        DEVSHARE_STATUS_BAD_TEXT,
        DEVSHARE_STATUS_BAD_LENGTH,
        DEVSHARE_STATUS_INVALID_HANDLE,
        DEVSHARE_STATUS_STORAGE_OUT_OF_BOUNDS,
        DEVSHARE_STATUS_TENSOR_OUT_OF_BOUNDS,
        DEVSHARE_STATUS_BAD_NDIM,
        DEVSHARE_STATUS_BAD_DTYPE,
        DEVSHARE_STATUS_BAD_KEY,
        DEVSHARE_STATUS_BAD_SIZE,
        DEVSHARE_STATUS_WRONG_HOST,
        DEVSHARE_STATUS_BACKEND_UNAVAILABLE,
        DEVSHARE_STATUS_UNSUPPORTED,
        DEVSHARE_STATUS_NOT_FOUND,
        DEVSHARE_STATUS_OS,
        DEVSHARE_STATUS_VENDOR,
        DEVSHARE_STATUS_TIMEOUT,
        DEVSHARE_STATUS_BUSY,
        DEVSHARE_STATUS_ALREADY_RELEASED,
        DEVSHARE_STATUS_MISMATCH,
        DEVSHARE_STATUS_UNTRUSTED,
        DEVSHARE_STATUS_INTERNAL,
    };
    enum { N = sizeof all / sizeof all[0] };
    const char *unknown = devshare_status_str(12345);
    int nonempty = 1, distinct = 1, not_unknown = 1;
    for (int i = 0; i < N; i++) {
        const char *s = devshare_status_str(all[i]);
        if (s == NULL || s[0] == '\0') {
            nonempty = 0;
            printf("    status %d has no text\n", (int)all[i]);
            continue;
        }
        if (unknown != NULL && strcmp(s, unknown) == 0) {
            not_unknown = 0;
            printf("    status %d reads like an unknown one: %s\n", (int)all[i], s);
        }
        for (int j = 0; j < i; j++) {
            const char *t = devshare_status_str(all[j]);
            if (t != NULL && strcmp(s, t) == 0) {
                distinct = 0;
                printf("    statuses %d and %d share the text \"%s\"\n", (int)all[j], (int)all[i], s);
            }
        }
    }
    CHECK(nonempty, "devshare_status_str: each of the %d statuses in the header has a non-empty text", N);
    CHECK(distinct, "devshare_status_str: the %d status texts are pairwise distinct", N);
    CHECK(not_unknown, "devshare_status_str: no known status reads as the unknown-status text");
    static const int32_t odd[] = {1, -4, -16, -100, 12345, INT32_MIN, INT32_MAX};
    int odd_ok = 1;
    for (size_t i = 0; i < sizeof odd / sizeof odd[0]; i++) {
        const char *s = devshare_status_str(odd[i]);
        if (s == NULL || s[0] == '\0' || (unknown != NULL && strcmp(s, unknown) != 0)) {
            odd_ok = 0;
            printf("    status %d: %s\n", (int)odd[i], s ? s : "(NULL)");
        }
    }
    CHECK(odd_ok && unknown != NULL && unknown[0] != '\0',
          "devshare_status_str: unknown codes (1, -4, -16, -100, 12345, INT32_MIN, INT32_MAX) get one fixed text (\"%s\")",
          unknown ? unknown : "(NULL)");
}

static void test_devshare_version_matches_the_header_macros(void) {
    const uint32_t v = devshare_version();
    CHECK(v == DEVSHARE_VERSION, "devshare_version() == DEVSHARE_VERSION (0x%06" PRIx32 ")", v);
    CHECK((v >> 16) == DEVSHARE_VERSION_MAJOR && ((v >> 8) & 0xff) == DEVSHARE_VERSION_MINOR &&
              (v & 0xff) == DEVSHARE_VERSION_PATCH,
          "devshare_version() is (MAJOR << 16) | (MINOR << 8) | PATCH of the header");
}

static void test_last_error_copies_or_truncates_and_reports_the_full_length(void) {
    DevshareBackendInfo info;
    DS_OK(devshare_backend_info_init(&info, sizeof info));
    const int32_t st = devshare_probe(0, &info);
    EXPECT(st, DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_probe", "backend id 0");
    const size_t full = devshare_last_error(NULL, 0);
    char big[2048];
    const size_t again = devshare_last_error(big, sizeof big);
    CHECK(full > 0 && full == again && strlen(big) == full,
          "devshare_last_error(NULL, 0) returns the message length (%zu) without writing", full);
    char small[8];
    memset(small, 'x', sizeof small);
    const size_t r = devshare_last_error(small, sizeof small);
    CHECK(r == full && small[7] == '\0' && strlen(small) == 7 && strncmp(small, big, 7) == 0,
          "devshare_last_error truncates to the buffer, NUL-terminates, returns the full length");
    memset(small, 'x', sizeof small);
    CHECK(devshare_last_error(small, 0) == full && small[0] == 'x',
          "devshare_last_error with cap 0 writes nothing and returns the full length");
    (void)devshare_version();
    (void)devshare_status_str(0);
    DevshareBackendInfo host;
    DS_OK(devshare_backend_info_init(&host, sizeof host));
    DS_OK(devshare_probe(DEVSHARE_BACKEND_HOST, &host));
    CHECK(last_error_names("devshare_probe") && strstr(last_error(), "backend 0") != NULL,
          "devshare_last_error: successful calls leave the last failure's message alone");
    CHECK(devshare_last_vendor_error() == 0,
          "devshare_last_vendor_error is 0 after a failure that has no errno");
}

/* NULL for each pointer argument of every function. */
static void test_every_function_refuses_null_except_the_documented_optional_pointers(void) {
    DevshareExporter *exp = NULL;
    void *ptr = NULL;
    DS_OK(devshare_host_alloc(ALLOC, &exp, &ptr));
    fill_pattern(ptr);
    const DevshareTensorDesc desc = float_desc();
    DevshareHandle h;
    DS_OK(devshare_exporter_share(exp, &desc, &h));
    uint8_t bytes[DEVSHARE_HANDLE_MAX_ENCODED_SIZE];
    size_t nbytes = 0;
    DS_OK(devshare_handle_encode(&h, bytes, sizeof bytes, &nbytes));
    char text[DEVSHARE_HANDLE_MAX_TEXT_SIZE];
    DS_OK(devshare_handle_to_text(&h, text, sizeof text, NULL));
    DevshareImport *imp = NULL;
    DS_OK(devshare_import(&h, NULL, &imp));

    /* devshare_last_error: buf is optional (size query). */
    CHECK(devshare_last_error(NULL, 0) > 0 && devshare_last_error(NULL, 16) > 0,
          "devshare_last_error(NULL, cap): allowed, returns the length");

    /* devshare_host_alloc: out required, ptr_out optional. */
    void *p = (void *)&p;
    EXPECT(devshare_host_alloc(64, NULL, &p), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_host_alloc", "out NULL");
    CHECK(p == (void *)&p, "devshare_host_alloc: out NULL leaves *ptr_out alone");
    DevshareExporter *e2 = NULL;
    EXPECT_OK(devshare_host_alloc(64, &e2, NULL), "devshare_host_alloc: ptr_out NULL is allowed");
    if (e2 != NULL) {
        void *m = NULL;
        uint64_t sz = 0;
        EXPECT_OK(devshare_exporter_memory(e2, &m, &sz), "devshare_exporter_memory after host_alloc without ptr_out");
        CHECK(m != NULL && sz == 64, "devshare_exporter_memory: the allocation is there (%" PRIu64 " bytes)", sz);
        EXPECT_OK(devshare_exporter_close(e2, 0), "devshare_exporter_close of an unshared exporter");
    }

    /* devshare_export: ptr and out required. */
    char local[64];
    DevshareExporter *e3 = NULL;
    EXPECT(devshare_export(DEVSHARE_BACKEND_CUDA, 0, NULL, 64, 0, &e3), DEVSHARE_STATUS_NULL_ARGUMENT,
           "devshare_export", "ptr NULL");
    EXPECT(devshare_export(DEVSHARE_BACKEND_CUDA, 0, local, 64, 0, NULL), DEVSHARE_STATUS_NULL_ARGUMENT,
           "devshare_export", "out NULL");
    CHECK(e3 == NULL, "devshare_export: failures leave *out alone");

    /* devshare_exporter_memory: exporter required, both outs optional. */
    void *m = NULL;
    uint64_t sz = 0;
    EXPECT(devshare_exporter_memory(NULL, &m, &sz), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_exporter_memory",
           "exporter NULL");
    EXPECT_OK(devshare_exporter_memory(exp, NULL, NULL), "devshare_exporter_memory: ptr_out and size_out NULL are allowed");
    EXPECT_OK(devshare_exporter_memory(exp, &m, NULL), "devshare_exporter_memory: size_out NULL is allowed");
    CHECK(m == ptr, "devshare_exporter_memory: ptr_out is the address devshare_host_alloc gave");
    EXPECT_OK(devshare_exporter_memory(exp, NULL, &sz), "devshare_exporter_memory: ptr_out NULL is allowed");
    CHECK(sz == ALLOC, "devshare_exporter_memory: size_out is the allocation size");

    /* devshare_exporter_share: exporter and out required; desc optional; desc.shape required
     * when ndim > 0. */
    const uint64_t before = outstanding(exp);
    DevshareHandle h2;
    EXPECT(devshare_exporter_share(NULL, &desc, &h2), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_exporter_share",
           "exporter NULL");
    EXPECT(devshare_exporter_share(exp, &desc, NULL), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_exporter_share",
           "out NULL");
    DevshareTensorDesc no_shape = desc;
    no_shape.shape = NULL;
    EXPECT(devshare_exporter_share(exp, &no_shape, &h2), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_exporter_share",
           "desc.shape NULL with ndim 2");
    CHECK(outstanding(exp) == before, "devshare_exporter_share: failed calls hand out no reference");
    EXPECT_OK(devshare_exporter_share(exp, NULL, &h2), "devshare_exporter_share: desc NULL is allowed");
    CHECK(h2.ndim == 1 && h2.shape[0] == ALLOC && h2.strides[0] == 1 && h2.dtype.code == DEVSHARE_DTYPE_UINT &&
              h2.dtype.bits == 8 && h2.storage_offset == 0 && h2.storage_size == ALLOC && h2.tensor_offset == 0,
          "devshare_exporter_share: desc NULL describes the whole allocation as 1-D uint8");
    DevshareTensorDesc scalar = desc;
    scalar.ndim = 0;
    scalar.shape = NULL;
    DevshareHandle h3;
    EXPECT_OK(devshare_exporter_share(exp, &scalar, &h3), "devshare_exporter_share: shape NULL with ndim 0 is allowed");
    DevshareTensorDesc contiguous = desc;
    contiguous.strides = NULL;
    DevshareHandle h4;
    EXPECT_OK(devshare_exporter_share(exp, &contiguous, &h4), "devshare_exporter_share: strides NULL is allowed");
    CHECK(h4.strides[0] == T_COLS && h4.strides[1] == 1 && h4.strides[2] == 0,
          "devshare_exporter_share: strides NULL means C-contiguous");
    CHECK(outstanding(exp) == before + 3, "devshare_exporter_share: each successful share is one more reference");

    /* devshare_exporter_outstanding / wait / close. */
    uint64_t n = 0;
    EXPECT(devshare_exporter_outstanding(NULL, &n), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_exporter_outstanding",
           "exporter NULL");
    EXPECT(devshare_exporter_outstanding(exp, NULL), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_exporter_outstanding",
           "count NULL");
    EXPECT(devshare_exporter_wait(NULL, 0), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_exporter_wait", "exporter NULL");
    EXPECT(devshare_exporter_wait(NULL, -1), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_exporter_wait",
           "exporter NULL with an endless timeout");
    EXPECT(devshare_exporter_close(NULL, 0), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_exporter_close", "exporter NULL");
    EXPECT(devshare_exporter_close(NULL, DEVSHARE_CLOSE_FORCE), DEVSHARE_STATUS_NULL_ARGUMENT,
           "devshare_exporter_close", "exporter NULL with DEVSHARE_CLOSE_FORCE");

    /* Handle functions. */
    EXPECT(devshare_handle_init(NULL), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_handle_init", "handle NULL");
    EXPECT(devshare_handle_validate(NULL), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_handle_validate", "handle NULL");
    size_t len = 0;
    EXPECT(devshare_handle_encode(NULL, bytes, sizeof bytes, &len), DEVSHARE_STATUS_NULL_ARGUMENT,
           "devshare_handle_encode", "handle NULL");
    len = 0;
    EXPECT(devshare_handle_encode(&h, NULL, 0, &len), DEVSHARE_STATUS_BUFFER_TOO_SMALL, "devshare_handle_encode",
           "buf NULL (size query)");
    CHECK(len == nbytes, "devshare_handle_encode: buf NULL still reports the encoded length (%zu)", len);
    EXPECT(devshare_handle_encode(&h, NULL, 1000, &len), DEVSHARE_STATUS_BUFFER_TOO_SMALL, "devshare_handle_encode",
           "buf NULL with a non-zero cap");
    uint8_t bytes2[DEVSHARE_HANDLE_MAX_ENCODED_SIZE];
    EXPECT_OK(devshare_handle_encode(&h, bytes2, sizeof bytes2, NULL), "devshare_handle_encode: len_out NULL is allowed");
    CHECK(memcmp(bytes, bytes2, nbytes) == 0, "devshare_handle_encode: the same handle encodes to the same bytes");
    DevshareHandle d;
    EXPECT(devshare_handle_decode(NULL, nbytes, &d), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_handle_decode", "buf NULL");
    EXPECT(devshare_handle_decode(NULL, 0, &d), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_handle_decode",
           "buf NULL with len 0");
    EXPECT(devshare_handle_decode(bytes, nbytes, NULL), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_handle_decode", "out NULL");
    EXPECT(devshare_handle_to_text(NULL, text, sizeof text, &len), DEVSHARE_STATUS_NULL_ARGUMENT,
           "devshare_handle_to_text", "handle NULL");
    len = 0;
    EXPECT(devshare_handle_to_text(&h, NULL, 0, &len), DEVSHARE_STATUS_BUFFER_TOO_SMALL, "devshare_handle_to_text",
           "buf NULL (size query)");
    CHECK(len == strlen(text), "devshare_handle_to_text: buf NULL still reports the text length (%zu)", len);
    char text2[DEVSHARE_HANDLE_MAX_TEXT_SIZE];
    EXPECT_OK(devshare_handle_to_text(&h, text2, sizeof text2, NULL), "devshare_handle_to_text: len_out NULL is allowed");
    CHECK(strcmp(text, text2) == 0, "devshare_handle_to_text: the same handle gives the same text");
    EXPECT(devshare_handle_from_text(NULL, &d), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_handle_from_text", "text NULL");
    EXPECT(devshare_handle_from_text(text, NULL), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_handle_from_text", "out NULL");

    /* The struct init functions. */
    EXPECT(devshare_tensor_desc_init(NULL, sizeof(DevshareTensorDesc)), DEVSHARE_STATUS_NULL_ARGUMENT,
           "devshare_tensor_desc_init", "desc NULL");
    EXPECT(devshare_import_options_init(NULL, sizeof(DevshareImportOptions)), DEVSHARE_STATUS_NULL_ARGUMENT,
           "devshare_import_options_init", "options NULL");
    EXPECT(devshare_import_info_init(NULL, sizeof(DevshareImportInfo)), DEVSHARE_STATUS_NULL_ARGUMENT,
           "devshare_import_info_init", "info NULL");
    EXPECT(devshare_backend_info_init(NULL, sizeof(DevshareBackendInfo)), DEVSHARE_STATUS_NULL_ARGUMENT,
           "devshare_backend_info_init", "info NULL");
    EXPECT(devshare_torch_args_init(NULL, sizeof(DevshareTorchArgs)), DEVSHARE_STATUS_NULL_ARGUMENT,
           "devshare_torch_args_init", "args NULL");
    EXPECT(devshare_torch_storage_init(NULL, sizeof(DevshareTorchStorage)), DEVSHARE_STATUS_NULL_ARGUMENT,
           "devshare_torch_storage_init", "storage NULL");

    /* Import functions. */
    DevshareImport *i2 = NULL;
    EXPECT(devshare_import(NULL, NULL, &i2), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_import", "handle NULL");
    EXPECT(devshare_import(&h2, NULL, NULL), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_import", "out NULL");
    CHECK(i2 == NULL, "devshare_import: failures leave *out alone");
    DevshareImportInfo info;
    DS_OK(devshare_import_info_init(&info, sizeof info));
    EXPECT(devshare_import_info(NULL, &info), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_import_info", "import NULL");
    EXPECT(devshare_import_info(imp, NULL), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_import_info", "out NULL");
    EXPECT(devshare_import_handle(NULL, &d), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_import_handle", "import NULL");
    EXPECT(devshare_import_handle(imp, NULL), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_import_handle", "out NULL");
    EXPECT(devshare_import_release(NULL), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_import_release", "import NULL");
    EXPECT(devshare_probe(DEVSHARE_BACKEND_HOST, NULL), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_probe", "out NULL");

    /* DLPack views: import and out required. */
    DLManagedTensorVersioned *mv = NULL;
    DLManagedTensor *ml = NULL;
    EXPECT(devshare_import_to_dlpack_versioned(NULL, &mv), DEVSHARE_STATUS_NULL_ARGUMENT,
           "devshare_import_to_dlpack_versioned", "import NULL");
    EXPECT(devshare_import_to_dlpack_versioned(imp, NULL), DEVSHARE_STATUS_NULL_ARGUMENT,
           "devshare_import_to_dlpack_versioned", "out NULL");
    EXPECT(devshare_import_to_dlpack(NULL, &ml), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_import_to_dlpack",
           "import NULL");
    EXPECT(devshare_import_to_dlpack(imp, NULL), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_import_to_dlpack",
           "out NULL");
    CHECK(mv == NULL && ml == NULL, "devshare_import_to_dlpack*: failures leave *out alone");

    /* devshare_host_adopt: name and out required, ptr_out optional; bad names and sizes refused. */
    char key[DEVSHARE_KEY_CAPACITY + 1];
    key_name(&h, key, sizeof key);
    DevshareExporter *ad = NULL;
    EXPECT(devshare_host_adopt(NULL, 64, &ad, NULL), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_host_adopt", "name NULL");
    EXPECT(devshare_host_adopt(key, 64, NULL, NULL), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_host_adopt", "out NULL");
    EXPECT(devshare_host_adopt("no-leading-slash", 64, &ad, NULL), DEVSHARE_STATUS_INVALID_ARGUMENT,
           "devshare_host_adopt", "a name that is not a shm name");
    EXPECT(devshare_host_adopt(key, ALLOC + 1, &ad, NULL), DEVSHARE_STATUS_MISMATCH, "devshare_host_adopt",
           "a size larger than the object");
    CHECK(ad == NULL, "devshare_host_adopt: failures leave *out alone");
    void *adp = NULL;
    EXPECT_OK(devshare_host_adopt(key, ALLOC, &ad, &adp), "devshare_host_adopt of an existing devshare object");
    if (ad != NULL) {
        CHECK(adp != NULL && memcmp(adp, ptr, ALLOC) == 0, "devshare_host_adopt: the adopted memory holds the same bytes");
        EXPECT_OK(devshare_exporter_close(ad, 0), "devshare_exporter_close of the adopting exporter");
    }

    /* options NULL means the defaults; the failed devshare_import(&h2, NULL, NULL) above did not
     * use up h2's reference. */
    EXPECT_OK(devshare_import(&h2, NULL, &i2), "devshare_import: options NULL is allowed (defaults), "
                                               "and an earlier failed import did not use up the reference");
    if (i2 != NULL) {
        EXPECT_OK(devshare_import_info(i2, &info), "devshare_import_info");
        CHECK(info.read_only == 0 && info.device == 0 && info.backend == DEVSHARE_BACKEND_HOST,
              "devshare_import: defaults are read-write, device 0 for host");
        EXPECT_OK(devshare_import_release(i2), "devshare_import_release");
    }

    EXPECT_OK(devshare_import_release(imp), "devshare_import_release of the fixture import");
    EXPECT_OK(devshare_exporter_close(exp, 0), "devshare_exporter_close with references outstanding (host)");
}

static void test_out_of_range_arguments_return_the_documented_status(void) {
    DevshareExporter *exp = NULL;
    void *ptr = NULL;
    DS_OK(devshare_host_alloc(ALLOC, &exp, &ptr));
    fill_pattern(ptr);
    char local[64];
    DevshareBackendInfo bi;
    DS_OK(devshare_backend_info_init(&bi, sizeof bi));
    DevshareExporter *e = NULL;

    /* Backend ids. */
    EXPECT(devshare_probe(0, &bi), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_probe", "backend id 0");
    EXPECT(devshare_probe(4, &bi), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_probe", "backend id 4");
    EXPECT(devshare_probe(UINT16_MAX, &bi), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_probe", "backend id 65535");
    EXPECT(devshare_export(0, 0, local, sizeof local, 0, &e), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_export",
           "backend id 0");
    EXPECT(devshare_export(99, 0, local, sizeof local, 0, &e), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_export",
           "backend id 99");
    EXPECT(devshare_export(DEVSHARE_BACKEND_HOST, 0, local, sizeof local, 0, &e), DEVSHARE_STATUS_UNSUPPORTED,
           "devshare_export", "host backend (process memory cannot be shared; use devshare_host_alloc)");
    DevshareBackendInfo cuda;
    DS_OK(devshare_backend_info_init(&cuda, sizeof cuda));
    DS_OK(devshare_probe(DEVSHARE_BACKEND_CUDA, &cuda));
    if (!cuda.usable) {
        EXPECT(devshare_export(DEVSHARE_BACKEND_CUDA, 0, local, sizeof local, 0, &e), DEVSHARE_STATUS_BACKEND_UNAVAILABLE,
               "devshare_export", "cuda backend where it is unusable");
        EXPECT(devshare_export(DEVSHARE_BACKEND_ACL, 0, local, sizeof local, 0, &e), DEVSHARE_STATUS_BACKEND_UNAVAILABLE,
               "devshare_export", "acl backend where it is unusable");
    }
    CHECK(e == NULL, "devshare_export: no exporter comes out of a failure");

    /* Sizes. */
    EXPECT(devshare_host_alloc(UINT64_MAX, &e, NULL), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_host_alloc",
           "size UINT64_MAX");
    EXPECT(devshare_host_alloc((uint64_t)INT64_MAX, &e, NULL), DEVSHARE_STATUS_INVALID_ARGUMENT,
           "devshare_host_alloc", "size INT64_MAX (header would overflow)");

    /* Close flags: refused, and the exporter stays usable. */
    EXPECT(devshare_exporter_close(exp, 4), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_exporter_close",
           "unknown flag 0x4");
    DevshareTensorDesc bad_flags = float_desc();
    DevshareHandle hf;
    bad_flags.flags = UNKNOWN_SHARE_FLAG;
    EXPECT(devshare_exporter_share(exp, &bad_flags, &hf), DEVSHARE_STATUS_UNSUPPORTED_VERSION,
           "devshare_exporter_share", "unknown desc.flags bit 0x80000000 (a newer library's flag)");
    bad_flags.flags = DEVSHARE_SHARE_EVENT;
    EXPECT(devshare_exporter_share(exp, &bad_flags, &hf), DEVSHARE_STATUS_UNSUPPORTED, "devshare_exporter_share",
           "DEVSHARE_SHARE_EVENT on host memory (no IPC events)");
    bad_flags.flags = 0;
    bad_flags.struct_size = 0;
    EXPECT(devshare_exporter_share(exp, &bad_flags, &hf), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_exporter_share",
           "desc.struct_size 0 (desc not initialised)");
    bad_flags.struct_size = sizeof bad_flags - 1;
    EXPECT(devshare_exporter_share(exp, &bad_flags, &hf), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_exporter_share",
           "desc.struct_size below the first released size");
    EXPECT(devshare_exporter_close(exp, 0x80000000u | DEVSHARE_CLOSE_FORCE), DEVSHARE_STATUS_INVALID_ARGUMENT,
           "devshare_exporter_close", "DEVSHARE_CLOSE_FORCE plus unknown flag 0x80000000");
    uint64_t n = UINT64_MAX;
    EXPECT_OK(devshare_exporter_outstanding(exp, &n), "devshare_exporter_close: a refused close leaves the exporter usable");

    /* Tensor descriptions. */
    const DevshareTensorDesc good = float_desc();
    DevshareHandle h;
    const uint64_t before = outstanding(exp);
    int64_t shape9[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    DevshareTensorDesc d = good;
    d.ndim = 9;
    d.shape = shape9;
    EXPECT(devshare_exporter_share(exp, &d, &h), DEVSHARE_STATUS_BAD_NDIM, "devshare_exporter_share", "desc.ndim 9");
    d.ndim = UINT32_MAX;
    EXPECT(devshare_exporter_share(exp, &d, &h), DEVSHARE_STATUS_BAD_NDIM, "devshare_exporter_share",
           "desc.ndim UINT32_MAX");
    d = good;
    const int64_t neg_shape[2] = {T_ROWS, -1};
    d.shape = neg_shape;
    EXPECT(devshare_exporter_share(exp, &d, &h), DEVSHARE_STATUS_BAD_SIZE, "devshare_exporter_share",
           "negative shape entry");
    d = good;
    const int64_t neg_strides[2] = {T_COLS, -1};
    d.strides = neg_strides;
    EXPECT(devshare_exporter_share(exp, &d, &h), DEVSHARE_STATUS_BAD_SIZE, "devshare_exporter_share",
           "negative stride");
    d = good;
    d.tensor_offset = -1;
    EXPECT(devshare_exporter_share(exp, &d, &h), DEVSHARE_STATUS_BAD_SIZE, "devshare_exporter_share",
           "negative tensor_offset");
    d = good;
    const int64_t huge_shape[2] = {1000, 1000};
    d.shape = huge_shape;
    EXPECT(devshare_exporter_share(exp, &d, &h), DEVSHARE_STATUS_TENSOR_OUT_OF_BOUNDS, "devshare_exporter_share",
           "tensor larger than its storage");
    d = good;
    const int64_t far_strides[2] = {1000, 1};
    d.strides = far_strides;
    EXPECT(devshare_exporter_share(exp, &d, &h), DEVSHARE_STATUS_TENSOR_OUT_OF_BOUNDS, "devshare_exporter_share",
           "strides that reach past the storage");
    d = good;
    d.tensor_offset = ALLOC;
    EXPECT(devshare_exporter_share(exp, &d, &h), DEVSHARE_STATUS_TENSOR_OUT_OF_BOUNDS, "devshare_exporter_share",
           "tensor_offset past the storage");
    d = good;
    const int64_t overflow_shape[2] = {INT64_MAX, 2};
    d.shape = overflow_shape;
    EXPECT_ERROR(devshare_exporter_share(exp, &d, &h), "devshare_exporter_share", "shape whose product overflows");
    d = good;
    d.storage_size = ALLOC;
    EXPECT(devshare_exporter_share(exp, &d, &h), DEVSHARE_STATUS_STORAGE_OUT_OF_BOUNDS, "devshare_exporter_share",
           "storage_offset + storage_size past the allocation");
    d = good;
    d.storage_offset = ALLOC + 8;
    EXPECT(devshare_exporter_share(exp, &d, &h), DEVSHARE_STATUS_STORAGE_OUT_OF_BOUNDS, "devshare_exporter_share",
           "storage_offset past the allocation with DEVSHARE_STORAGE_TO_END");
    d = good;
    d.storage_size = (uint64_t)INT64_MAX + 1;
    EXPECT_ERROR(devshare_exporter_share(exp, &d, &h), "devshare_exporter_share", "storage_size above 2^63-1");
    static const DevshareDType bad_dtypes[] = {
        {DEVSHARE_DTYPE_OPAQUE_HANDLE, 64, 1}, {DEVSHARE_DTYPE_FLOAT, 8, 1}, {DEVSHARE_DTYPE_FLOAT, 32, 0},
        {DEVSHARE_DTYPE_INT, 7, 1},            {99, 32, 1},                  {DEVSHARE_DTYPE_BOOL, 1, 1},
    };
    for (size_t i = 0; i < sizeof bad_dtypes / sizeof bad_dtypes[0]; i++) {
        char what[96];
        snprintf(what, sizeof what, "dtype code %u bits %u lanes %u", (unsigned)bad_dtypes[i].code,
                 (unsigned)bad_dtypes[i].bits, (unsigned)bad_dtypes[i].lanes);
        d = good;
        d.dtype = bad_dtypes[i];
        EXPECT(devshare_exporter_share(exp, &d, &h), DEVSHARE_STATUS_BAD_DTYPE, "devshare_exporter_share", what);
    }
    CHECK(outstanding(exp) == before, "devshare_exporter_share: refused descriptions hand out no reference");

    /* Handle fields: one valid handle, one field broken at a time. */
    DS_OK(devshare_exporter_share(exp, &good, &h));
    EXPECT_OK(devshare_handle_validate(&h), "devshare_handle_validate accepts a handle fresh from share");
    struct {
        const char *what;
        int32_t want;
        DevshareHandle h;
    } bad[32];
    int nb = 0;
#define BAD(desc_, status_, stmt_)                                                                   \
    do {                                                                                             \
        bad[nb].what = desc_;                                                                        \
        bad[nb].want = status_;                                                                      \
        bad[nb].h = h;                                                                               \
        DevshareHandle *x = &bad[nb].h;                                                              \
        stmt_;                                                                                       \
        nb++;                                                                                        \
    } while (0)
    BAD("struct_size 0", DEVSHARE_STATUS_UNSUPPORTED_VERSION, x->struct_size = 0);
    BAD("layout_version 2", DEVSHARE_STATUS_UNSUPPORTED_VERSION, x->layout_version = 2);
    BAD("backend 0", DEVSHARE_STATUS_INVALID_HANDLE, x->backend = 0);
    BAD("backend 4 (a newer library's backend)", DEVSHARE_STATUS_UNSUPPORTED_VERSION, x->backend = 4);
    BAD("unknown must-understand flag bit 0x8000", DEVSHARE_STATUS_UNSUPPORTED_VERSION,
        x->flags = UNKNOWN_MUST_UNDERSTAND_HANDLE_FLAG);
    BAD("the in-flight flag on a CUDA handle", DEVSHARE_STATUS_INVALID_HANDLE,
        (x->backend = DEVSHARE_BACKEND_CUDA, x->key_len = 64, memset(x->key, 0xab, 64), x->flags = DEVSHARE_HANDLE_FLAG_INFLIGHT));
    BAD("an IPC event on a host handle", DEVSHARE_STATUS_INVALID_HANDLE, x->flags = DEVSHARE_HANDLE_FLAG_EVENT);
    BAD("device_index 1 on a host handle", DEVSHARE_STATUS_INVALID_HANDLE, x->device_index = 1);
    BAD("device_index -1", DEVSHARE_STATUS_INVALID_HANDLE, x->device_index = -1);
    BAD("producer_pid -1 (0 means unknown)", DEVSHARE_STATUS_INVALID_HANDLE, x->producer_pid = -1);
    BAD("ndim 9", DEVSHARE_STATUS_BAD_NDIM, x->ndim = 9);
    BAD("a shape entry beyond ndim", DEVSHARE_STATUS_INVALID_HANDLE, x->shape[2] = 1);
    BAD("a stride entry beyond ndim (strides count differs from ndim)", DEVSHARE_STATUS_INVALID_HANDLE, x->strides[2] = 1);
    BAD("ndim 1 with two strides", DEVSHARE_STATUS_INVALID_HANDLE, (x->ndim = 1, x->shape[1] = 0));
    BAD("negative stride", DEVSHARE_STATUS_BAD_SIZE, x->strides[1] = -1);
    BAD("dtype bits 12", DEVSHARE_STATUS_BAD_DTYPE, x->dtype.bits = 12);
    BAD("storage past alloc_size", DEVSHARE_STATUS_STORAGE_OUT_OF_BOUNDS, x->alloc_size = T_STORAGE_OFFSET);
    BAD("tensor past storage_size", DEVSHARE_STATUS_TENSOR_OUT_OF_BOUNDS, x->storage_size = 8);
    BAD("key_len 200", DEVSHARE_STATUS_BAD_KEY, x->key_len = 200);
    BAD("key without its leading '/'", DEVSHARE_STATUS_BAD_KEY, x->key[0] = 'x');
    BAD("key with a '/' inside", DEVSHARE_STATUS_BAD_KEY, x->key[3] = '/');
    BAD("key bytes beyond key_len", DEVSHARE_STATUS_INVALID_HANDLE, x->key[DEVSHARE_KEY_CAPACITY - 1] = 'a');
    BAD("ref_slot 10000", DEVSHARE_STATUS_INVALID_HANDLE, x->ref_slot = DEVSHARE_REF_SLOTS);
    BAD("reserved0 1", DEVSHARE_STATUS_INVALID_HANDLE, x->reserved0 = 1);
    BAD("reserved1 1", DEVSHARE_STATUS_INVALID_HANDLE, x->reserved1 = 1);
    BAD("ext[111] 1 beyond ext_len 0", DEVSHARE_STATUS_INVALID_HANDLE, x->ext[DEVSHARE_HANDLE_EXT_CAPACITY - 1] = 1);
    BAD("ext_len 113 (above the capacity)", DEVSHARE_STATUS_INVALID_HANDLE, x->ext_len = DEVSHARE_HANDLE_EXT_CAPACITY + 1);
    BAD("a must-understand extension record this library does not know", DEVSHARE_STATUS_UNSUPPORTED_VERSION,
        (x->ext_len = 4, x->ext[0] = 0x42, x->ext[1] = 0x80, x->ext[2] = 0, x->ext[3] = 0));
#undef BAD
    for (int i = 0; i < nb; i++) {
        EXPECT(devshare_handle_validate(&bad[i].h), bad[i].want, "devshare_handle_validate", bad[i].what);
    }
    /* What a newer writer may add without breaking this reader. */
    DevshareHandle newer = h;
    newer.layout_minor = 7;
    newer.flags |= 0x80000000u; /* the highest may-ignore bit: unassigned */
    newer.ext_len = 6;
    newer.ext[0] = 0x42; /* type 0x0042: skippable */
    newer.ext[2] = 2;    /* len 2 */
    newer.ext[4] = 'h';
    newer.ext[5] = 'i';
    EXPECT_OK(devshare_handle_validate(&newer),
              "devshare_handle_validate accepts a newer writer's handle: layout_minor 7, a may-ignore flag "
              "(bit 31), a skippable extension record");
    /* Every consumer of handles validates: encode, text, import refuse the same. */
    int refused = 1;
    for (int i = 0; i < nb; i++) {
        uint8_t buf[DEVSHARE_HANDLE_MAX_ENCODED_SIZE];
        char txt[DEVSHARE_HANDLE_MAX_TEXT_SIZE];
        DevshareImport *imp = NULL;
        const int32_t a = devshare_handle_encode(&bad[i].h, buf, sizeof buf, NULL);
        const int32_t b = devshare_handle_to_text(&bad[i].h, txt, sizeof txt, NULL);
        const int32_t c = devshare_import(&bad[i].h, NULL, &imp);
        if (a != bad[i].want || b != bad[i].want || c != bad[i].want || imp != NULL) {
            refused = 0;
            printf("    %s: encode %d, to_text %d, import %d\n", bad[i].what, (int)a, (int)b, (int)c);
            if (imp != NULL) {
                devshare_import_release(imp);
            }
        }
    }
    CHECK(refused, "devshare_handle_encode, devshare_handle_to_text and devshare_import refuse each of "
                   "the %d broken handles with the same status",
          nb);
    DevshareHandle empty;
    DS_OK(devshare_handle_init(&empty));
    CHECK(empty.struct_size == sizeof(DevshareHandle) && empty.struct_size == DEVSHARE_HANDLE_SIZE &&
              empty.layout_version == DEVSHARE_HANDLE_LAYOUT_VERSION && empty.backend == 0 && empty.key_len == 0,
          "devshare_handle_init sets struct_size (%u) and layout_version, zeroes the rest",
          (unsigned)empty.struct_size);
    EXPECT(devshare_handle_validate(&empty), DEVSHARE_STATUS_INVALID_HANDLE, "devshare_handle_validate",
           "an empty handle from devshare_handle_init (backend 0)");

    /* Import options: refused, and the reference is not used up. */
    DevshareImportOptions o;
    DevshareImport *imp = NULL;
    DS_OK(devshare_import_options_init(&o, sizeof o));
    CHECK(o.struct_size == sizeof o && o.flags == 0 && o.device == DEVSHARE_DEVICE_FROM_HANDLE && o.reserved == 0 &&
              o.stream == NULL,
          "devshare_import_options_init: struct_size set, read-write, device from handle, no stream");
    DevshareImportOptions x = o;
    x.flags = UNKNOWN_IMPORT_FLAG;
    EXPECT(devshare_import(&h, &x, &imp), DEVSHARE_STATUS_UNSUPPORTED_VERSION, "devshare_import",
           "unknown import flag 0x80000000 (a newer library's flag)");
    x.flags = DEVSHARE_IMPORT_PEER_ACCESS_CALL | DEVSHARE_IMPORT_NO_PEER_ACCESS;
    EXPECT(devshare_import(&h, &x, &imp), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_import",
           "DEVSHARE_IMPORT_PEER_ACCESS_CALL with DEVSHARE_IMPORT_NO_PEER_ACCESS");
    x = o;
    x.flags = 0xffffffffu;
    EXPECT(devshare_import(&h, &x, &imp), DEVSHARE_STATUS_UNSUPPORTED_VERSION, "devshare_import",
           "import flags 0xffffffff");
    x = o;
    x.struct_size = 0;
    EXPECT(devshare_import(&h, &x, &imp), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_import", "options.struct_size 0");
    x.struct_size = sizeof o - 1;
    EXPECT(devshare_import(&h, &x, &imp), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_import",
           "options.struct_size sizeof - 1");
    x = o;
    x.device = -2;
    EXPECT(devshare_import(&h, &x, &imp), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_import", "options.device -2");
    x.device = INT32_MIN;
    EXPECT(devshare_import(&h, &x, &imp), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_import",
           "options.device INT32_MIN");
    x.device = 1;
    EXPECT(devshare_import(&h, &x, &imp), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_import",
           "options.device 1 for host memory");
    x = o;
    x.reserved = 1;
    EXPECT(devshare_import(&h, &x, &imp), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_import", "options.reserved 1");
    CHECK(imp == NULL && outstanding(exp) == before + 1,
          "devshare_import: refused options leave *out alone and the reference outstanding");
    x = o;
    x.device = 0;
    EXPECT_OK(devshare_import(&h, &x, &imp), "devshare_import: options.device 0 for host memory, after the refusals");
    if (imp != NULL) {
        DevshareImportInfo info;
        DS_OK(devshare_import_info_init(&info, sizeof info));
        EXPECT_OK(devshare_import_info(imp, &info), "devshare_import_info");
        CHECK(pattern_ok(info.data, &h), "devshare_import: the data is the exporter's pattern");
        EXPECT_OK(devshare_import_release(imp), "devshare_import_release");
    }
    CHECK(outstanding(exp) == before, "devshare_import_release returns the reference");
    EXPECT_OK(devshare_exporter_close(exp, 0), "devshare_exporter_close");
}

static void test_handles_round_trip_through_bytes_and_text_and_corruption_is_refused(void) {
    DevshareExporter *exp = NULL;
    void *ptr = NULL;
    DS_OK(devshare_host_alloc(ALLOC, &exp, &ptr));
    const DevshareTensorDesc desc = float_desc();
    DevshareHandle h;
    DS_OK(devshare_exporter_share(exp, &desc, &h));

    uint8_t full[DEVSHARE_HANDLE_MAX_ENCODED_SIZE];
    size_t n = 0;
    EXPECT_OK(devshare_handle_encode(&h, full, sizeof full, &n), "devshare_handle_encode");
    CHECK(n > 16 && n <= DEVSHARE_HANDLE_MAX_ENCODED_SIZE, "devshare_handle_encode: %zu bytes, within "
                                                            "DEVSHARE_HANDLE_MAX_ENCODED_SIZE (%d)",
          n, DEVSHARE_HANDLE_MAX_ENCODED_SIZE);
    DevshareHandle d;
    EXPECT_OK(devshare_handle_decode(full, n, &d), "devshare_handle_decode of fresh bytes");
    CHECK(memcmp(&d, &h, sizeof h) == 0, "devshare_handle_decode(devshare_handle_encode(h)) == h, byte for byte");

    /* Too small: the needed length comes back, nothing is written at or beyond cap. */
    uint8_t small[DEVSHARE_HANDLE_MAX_ENCODED_SIZE];
    memset(small, 0xEE, sizeof small);
    size_t need = 0;
    EXPECT(devshare_handle_encode(&h, small, 10, &need), DEVSHARE_STATUS_BUFFER_TOO_SMALL, "devshare_handle_encode",
           "cap 10");
    CHECK(need == n, "devshare_handle_encode: a too-small buffer reports the needed length (%zu)", need);
    int untouched = 1;
    for (size_t i = 10; i < sizeof small; i++) {
        untouched &= small[i] == 0xEE;
    }
    CHECK(untouched, "devshare_handle_encode: nothing is written past cap");
    need = 0;
    EXPECT(devshare_handle_encode(&h, small, n - 1, &need), DEVSHARE_STATUS_BUFFER_TOO_SMALL, "devshare_handle_encode",
           "cap one byte short");
    CHECK(need == n, "devshare_handle_encode: one byte short still reports %zu", n);
    EXPECT_OK(devshare_handle_encode(&h, small, n, &need), "devshare_handle_encode: cap exactly the length");

    /* Text: the NUL counts. */
    char text[DEVSHARE_HANDLE_MAX_TEXT_SIZE];
    size_t tl = 0;
    EXPECT_OK(devshare_handle_to_text(&h, text, sizeof text, &tl), "devshare_handle_to_text");
    CHECK(tl == strlen(text) && tl + 1 <= DEVSHARE_HANDLE_MAX_TEXT_SIZE && strncmp(text, "devshare1:", 10) == 0,
          "devshare_handle_to_text: \"devshare1:\" + base64, %zu characters, NUL-terminated", tl);
    char ts[DEVSHARE_HANDLE_MAX_TEXT_SIZE];
    memset(ts, 'Z', sizeof ts);
    need = 0;
    EXPECT(devshare_handle_to_text(&h, ts, tl, &need), DEVSHARE_STATUS_BUFFER_TOO_SMALL, "devshare_handle_to_text",
           "cap equal to the length (no room for the NUL)");
    CHECK(need == tl && ts[tl] == 'Z', "devshare_handle_to_text: reports the length (%zu) and writes nothing past cap", need);
    EXPECT_OK(devshare_handle_to_text(&h, ts, tl + 1, NULL), "devshare_handle_to_text: cap = length + 1");
    EXPECT_OK(devshare_handle_from_text(text, &d), "devshare_handle_from_text");
    CHECK(memcmp(&d, &h, sizeof h) == 0, "devshare_handle_from_text(devshare_handle_to_text(h)) == h");

    /* Damaged bytes. */
    uint8_t b[DEVSHARE_HANDLE_MAX_ENCODED_SIZE + 1];
    memcpy(b, full, n);
    b[40] ^= 0x01;
    EXPECT(devshare_handle_decode(b, n, &d), DEVSHARE_STATUS_CHECKSUM_MISMATCH, "devshare_handle_decode",
           "one bit flipped in the body (byte 40)");
    memcpy(b, full, n);
    b[n - 1] ^= 0xff;
    EXPECT(devshare_handle_decode(b, n, &d), DEVSHARE_STATUS_CHECKSUM_MISMATCH, "devshare_handle_decode",
           "last byte (checksum) changed");
    memcpy(b, full, n);
    b[0] ^= 0xff;
    EXPECT(devshare_handle_decode(b, n, &d), DEVSHARE_STATUS_BAD_MAGIC, "devshare_handle_decode", "first byte changed");
    memcpy(b, full, n);
    b[4] = 99;
    EXPECT(devshare_handle_decode(b, n, &d), DEVSHARE_STATUS_UNSUPPORTED_VERSION, "devshare_handle_decode",
           "encoding version 99");
    EXPECT(devshare_handle_decode(full, n - 1, &d), DEVSHARE_STATUS_TRUNCATED, "devshare_handle_decode",
           "cut short by one byte");
    EXPECT(devshare_handle_decode(full, n / 2, &d), DEVSHARE_STATUS_TRUNCATED, "devshare_handle_decode", "cut in half");
    EXPECT(devshare_handle_decode(full, 8, &d), DEVSHARE_STATUS_TRUNCATED, "devshare_handle_decode",
           "only 8 bytes (inside the header)");
    EXPECT(devshare_handle_decode(full, 0, &d), DEVSHARE_STATUS_TRUNCATED, "devshare_handle_decode", "zero bytes");
    memcpy(b, full, n);
    b[n] = 0;
    EXPECT(devshare_handle_decode(b, n + 1, &d), DEVSHARE_STATUS_BAD_LENGTH, "devshare_handle_decode",
           "one trailing byte");

    /* Typos in the text. */
    char t[DEVSHARE_HANDLE_MAX_TEXT_SIZE + 8];
    snprintf(t, sizeof t, "%s", text);
    t[7] = 'X'; /* "devshaXe1:" */
    EXPECT(devshare_handle_from_text(t, &d), DEVSHARE_STATUS_BAD_TEXT, "devshare_handle_from_text", "typo in the prefix");
    snprintf(t, sizeof t, "%s", text);
    t[8] = '2'; /* "devshare2:" */
    EXPECT(devshare_handle_from_text(t, &d), DEVSHARE_STATUS_BAD_TEXT, "devshare_handle_from_text",
           "prefix devshare2:");
    snprintf(t, sizeof t, "%s", text);
    t[30] = '!';
    EXPECT(devshare_handle_from_text(t, &d), DEVSHARE_STATUS_BAD_TEXT, "devshare_handle_from_text",
           "a character outside the base64 alphabet");
    snprintf(t, sizeof t, "%s", text);
    t[60] = t[60] == 'A' ? 'B' : 'A';
    EXPECT_ERROR(devshare_handle_from_text(t, &d), "devshare_handle_from_text",
                 "one base64 character changed to another");
    snprintf(t, sizeof t, "%s", text);
    t[tl - 4] = '\0';
    EXPECT_ERROR(devshare_handle_from_text(t, &d), "devshare_handle_from_text", "last 4 characters missing");
    EXPECT(devshare_handle_from_text("", &d), DEVSHARE_STATUS_BAD_TEXT, "devshare_handle_from_text", "empty text");
    EXPECT_ERROR(devshare_handle_from_text("devshare1:", &d), "devshare_handle_from_text", "prefix only");
    snprintf(t, sizeof t, "  %s\n", text);
    EXPECT_OK(devshare_handle_from_text(t, &d), "devshare_handle_from_text ignores surrounding whitespace");
    CHECK(memcmp(&d, &h, sizeof h) == 0, "devshare_handle_from_text with whitespace gives the same handle");

    EXPECT_OK(devshare_exporter_close(exp, 0), "devshare_exporter_close");
}

static void test_probe_fills_in_every_field_for_each_backend(void) {
    static const struct {
        uint16_t id;
        const char *name;
        int usable;
    } backends[] = {
        {DEVSHARE_BACKEND_HOST, "host", 1},
        {DEVSHARE_BACKEND_ACL, "acl", 0},
        {DEVSHARE_BACKEND_CUDA, "cuda", 0},
    };
    for (size_t i = 0; i < sizeof backends / sizeof backends[0]; i++) {
        /* Garbage everywhere but struct_size: the library fills in every byte it knows. */
        DevshareBackendInfo info;
        memset(&info, 0x55, sizeof info);
        info.struct_size = sizeof info;
        const int32_t st = devshare_probe(backends[i].id, &info);
        const int terminated = memchr(info.name, 0, sizeof info.name) != NULL &&
                               memchr(info.detail, 0, sizeof info.detail) != NULL;
        CHECK(st == DEVSHARE_STATUS_OK && terminated && info.backend == backends[i].id &&
                  info.usable == backends[i].usable && strcmp(info.name, backends[i].name) == 0 &&
                  info.detail[0] != '\0' && info.struct_size == sizeof info,
              "devshare_probe(%s): %s, detail: %.200s", backends[i].name, info.usable ? "usable" : "not usable",
              terminated ? info.detail : "(not terminated)");
    }
}

static void test_an_import_shares_the_memory_and_holds_its_reference_until_released(void) {
    DevshareExporter *exp = NULL;
    void *ptr = NULL;
    DS_OK(devshare_host_alloc(ALLOC, &exp, &ptr));
    int zero = 1;
    for (size_t i = 0; i < ALLOC; i++) {
        zero &= ((unsigned char *)ptr)[i] == 0;
    }
    CHECK(zero, "devshare_host_alloc: memory is zero-filled");
    fill_pattern(ptr);
    const DevshareTensorDesc desc = float_desc();
    DevshareHandle h;
    DS_OK(devshare_exporter_share(exp, &desc, &h));
    CHECK(outstanding(exp) == 1, "devshare_exporter_outstanding: 1 after one share");
    EXPECT(devshare_exporter_wait(exp, 0), DEVSHARE_STATUS_TIMEOUT, "devshare_exporter_wait",
           "timeout 0 with a reference outstanding");
    const int64_t t0 = now_ns();
    const int32_t wst = devshare_exporter_wait(exp, 50);
    const double waited = (double)(now_ns() - t0) / 1e6;
    EXPECT(wst, DEVSHARE_STATUS_TIMEOUT, "devshare_exporter_wait", "timeout 50 ms with a reference outstanding");
    CHECK(waited >= 45 && waited < 2000, "devshare_exporter_wait(50 ms) returned after %.1f ms", waited);

    /* Import: info is consistent with the handle. */
    DevshareImport *imp = NULL;
    EXPECT_OK(devshare_import(&h, NULL, &imp), "devshare_import");
    DevshareImportInfo info;
    DS_OK(devshare_import_info_init(&info, sizeof info));
    EXPECT_OK(devshare_import_info(imp, &info), "devshare_import_info");
    CHECK((char *)info.storage == (char *)info.base + T_STORAGE_OFFSET &&
              (char *)info.data == (char *)info.storage + T_TENSOR_OFFSET * sizeof(float),
          "devshare_import_info: storage = base + storage_offset, data = storage + tensor_offset * element_size");
    CHECK(info.alloc_size == ALLOC && info.storage_size == ALLOC - T_STORAGE_OFFSET &&
              info.numel == T_ROWS * T_COLS && info.element_size == 4 && info.backend == DEVSHARE_BACKEND_HOST &&
              info.read_only == 0 && info.device == 0,
          "devshare_import_info: sizes, numel %" PRIu64 ", element size, backend, access, device", info.numel);
    CHECK(pattern_ok(info.data, &h), "devshare_import: the importer reads the exporter's data");
    ((float *)info.data)[0] = 4242.0f;
    CHECK(*t_element(ptr, 0, 0) == 4242.0f, "devshare_import: a write through the import is seen by the exporter");
    *t_element(ptr, 0, 0) = 0.0f;
    DevshareHandle ih;
    EXPECT_OK(devshare_import_handle(imp, &ih), "devshare_import_handle");
    CHECK(memcmp(&ih, &h, sizeof h) == 0, "devshare_import_handle returns the handle imported, byte for byte");

    /* A second import of the same handle in this process shares the reference. */
    DevshareImport *imp2 = NULL;
    EXPECT_OK(devshare_import(&h, NULL, &imp2), "devshare_import of the same handle again in the same process");
    CHECK(outstanding(exp) == 1, "devshare_exporter_outstanding: still 1 with two imports of one handle");
    EXPECT_OK(devshare_import_release(imp), "devshare_import_release of the first import");
    CHECK(outstanding(exp) == 1, "devshare_exporter_outstanding: still 1 while the second import holds the handle");
    EXPECT_OK(devshare_import_release(imp2), "devshare_import_release of the second import");
    CHECK(outstanding(exp) == 0, "devshare_exporter_outstanding: 0 after the last import of the handle is released");
    EXPECT_OK(devshare_exporter_wait(exp, 0), "devshare_exporter_wait: returns at once when nothing is outstanding");
    EXPECT_OK(devshare_exporter_wait(exp, -1), "devshare_exporter_wait: endless timeout returns when nothing is outstanding");

    /* The reference was returned: the handle cannot be imported again. */
    imp = NULL;
    EXPECT(devshare_import(&h, NULL, &imp), DEVSHARE_STATUS_ALREADY_RELEASED, "devshare_import",
           "a handle whose reference was returned");
    CHECK(imp == NULL, "devshare_import: ALREADY_RELEASED gives no import");

    /* Read-only import. */
    DevshareHandle hr;
    DS_OK(devshare_exporter_share(exp, &desc, &hr));
    DevshareImportOptions o;
    DS_OK(devshare_import_options_init(&o, sizeof o));
    o.flags = DEVSHARE_IMPORT_READ_ONLY;
    EXPECT_OK(devshare_import(&hr, &o, &imp), "devshare_import with DEVSHARE_IMPORT_READ_ONLY");
    if (imp != NULL) {
        EXPECT_OK(devshare_import_info(imp, &info), "devshare_import_info of a read-only import");
        CHECK(info.read_only == 1, "devshare_import_info: read_only == 1");
        CHECK(pattern_ok(info.data, &hr), "read-only import: the data is readable and is the pattern");
        *t_element(ptr, 3, 5) = -1.5f;
        CHECK(((const float *)info.data)[3 * T_COLS + 5] == -1.5f,
              "read-only import: sees the exporter's later writes (shared, not a copy)");
        *t_element(ptr, 3, 5) = 305.0f;
        EXPECT_OK(devshare_import_release(imp), "devshare_import_release of a read-only import");
    }
    CHECK(outstanding(exp) == 0, "read-only import: release returns the reference");
    EXPECT_OK(devshare_exporter_close(exp, 0), "devshare_exporter_close");
}

/* Returning references without importing: handles and PyTorch tuples. */
static void test_discard_returns_an_unused_handles_reference_once_and_refuses_a_held_one(void) {
    EXPECT(devshare_handle_discard(NULL), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_handle_discard", "handle NULL");
    EXPECT(devshare_torch_discard(NULL), DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_torch_discard", "args NULL");
    DevshareExporter *exp = NULL;
    DS_OK(devshare_host_alloc(ALLOC, &exp, NULL));
    DevshareTensorDesc d = float_desc();
    DevshareHandle h, held;
    DS_OK(devshare_exporter_share(exp, &d, &h));
    DS_OK(devshare_exporter_share(exp, &d, &held));
    uint64_t n = 0;
    EXPECT_OK(devshare_handle_discard(&h), "devshare_handle_discard of an unused handle");
    DS_OK(devshare_exporter_outstanding(exp, &n));
    CHECK(n == 1, "devshare_handle_discard returned exactly that handle's reference (%" PRIu64 " left)", n);
    EXPECT(devshare_handle_discard(&h), DEVSHARE_STATUS_ALREADY_RELEASED, "devshare_handle_discard",
           "the same handle again");
    DevshareImport *imp = NULL;
    DS_OK(devshare_import(&held, NULL, &imp));
    EXPECT(devshare_handle_discard(&held), DEVSHARE_STATUS_BUSY, "devshare_handle_discard",
           "a handle an import in this process holds");
    DS_OK(devshare_import_release(imp));
    DS_OK(devshare_exporter_outstanding(exp, &n));
    CHECK(n == 0, "the refused discard left the reference to the release (%" PRIu64 " left)", n);

    /* The same through a PyTorch tuple's ref-counter fields. */
    DevshareHandle t;
    DS_OK(devshare_exporter_share(exp, &d, &t));
    DevshareTorchArgs a;
    DS_OK(devshare_torch_args_init(&a, sizeof a));
    a.struct_size = 0;
    EXPECT(devshare_torch_discard(&a), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_torch_discard", "struct_size 0");
    a.struct_size = sizeof a;
    a.ref_name = t.ref_name;
    a.ref_name_len = 3;
    a.ref_slot = t.ref_slot;
    const uint8_t bad_name[] = "no/slash";
    a.ref_name = bad_name;
    EXPECT(devshare_torch_discard(&a), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_torch_discard",
           "a ref-counter name that is not a shm name");
    a.ref_name = t.ref_name;
    a.ref_name_len = t.ref_name_len;
    a.ref_slot = DEVSHARE_REF_SLOTS;
    EXPECT(devshare_torch_discard(&a), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_torch_discard", "slot 10000");
    a.ref_slot = t.ref_slot;
    EXPECT_OK(devshare_torch_discard(&a), "devshare_torch_discard of a tuple's reference");
    DS_OK(devshare_exporter_outstanding(exp, &n));
    CHECK(n == 0, "devshare_torch_discard returned the tuple's reference (%" PRIu64 " left)", n);
    a.ref_name_len = 0;
    EXPECT_OK(devshare_torch_discard(&a), "devshare_torch_discard of a tuple without a ref-counter (nothing to do)");
    DS_OK(devshare_exporter_close(exp, 0));
}

static void test_importing_a_removed_object_is_not_found_and_leaves_the_reference(void) {
    DevshareExporter *exp = NULL;
    void *ptr = NULL;
    DS_OK(devshare_host_alloc(ALLOC, &exp, &ptr));
    DevshareHandle h;
    DS_OK(devshare_exporter_share(exp, NULL, &h));
    char name[DEVSHARE_KEY_CAPACITY + 1];
    key_name(&h, name, sizeof name);
    CHECK(shm_unlink(name) == 0, "shm_unlink(%s) removes the data object behind the exporter's back", name);
    DevshareImport *imp = NULL;
    EXPECT(devshare_import(&h, NULL, &imp), DEVSHARE_STATUS_NOT_FOUND, "devshare_import",
           "a host handle whose shm object was removed");
    CHECK(imp == NULL && outstanding(exp) == 1, "devshare_import: NOT_FOUND gives no import and leaves the reference");
    EXPECT_OK(devshare_exporter_close(exp, 0), "devshare_exporter_close after its object was removed");

    /* A handle shared by an exporter that is closed now. */
    DS_OK(devshare_host_alloc(ALLOC, &exp, &ptr));
    DS_OK(devshare_exporter_share(exp, NULL, &h));
    DS_OK(devshare_exporter_close(exp, 0));
    EXPECT(devshare_import(&h, NULL, &imp), DEVSHARE_STATUS_NOT_FOUND, "devshare_import",
           "a handle whose exporter closed before anyone imported it");
}

/* The DLPack 1.x layouts, as dlpack.h defines them (devshare.h only declares the managed
 * structs, so that dlpack.h itself can be included next to it). */
typedef struct {
    int32_t device_type;
    int32_t device_id;
} TestDLDevice;
typedef struct {
    void *data;
    TestDLDevice device;
    int32_t ndim;
    DevshareDType dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} TestDLTensor;
typedef struct TestDLManaged {
    TestDLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct TestDLManaged *);
} TestDLManaged;
typedef struct TestDLVersioned {
    uint32_t major, minor;
    void *manager_ctx;
    void (*deleter)(struct TestDLVersioned *);
    uint64_t flags;
    TestDLTensor dl_tensor;
} TestDLVersioned;

static void test_dlpack_views_hold_the_reference_until_their_deleters_run(void) {
    DevshareExporter *exp = NULL;
    void *ptr = NULL;
    DS_OK(devshare_host_alloc(ALLOC, &exp, &ptr));
    fill_pattern(ptr);
    const DevshareTensorDesc desc = float_desc();
    DevshareHandle h;
    DS_OK(devshare_exporter_share(exp, &desc, &h));
    DevshareImportOptions o;
    DS_OK(devshare_import_options_init(&o, sizeof o));
    o.flags = DEVSHARE_IMPORT_READ_ONLY;
    DevshareImport *imp = NULL;
    DS_OK(devshare_import(&h, &o, &imp));
    DevshareImportInfo info;
    DS_OK(devshare_import_info_init(&info, sizeof info));
    DS_OK(devshare_import_info(imp, &info));
    DLManagedTensorVersioned *mv = NULL;
    DLManagedTensor *ml = NULL;
    EXPECT_OK(devshare_import_to_dlpack_versioned(imp, &mv), "devshare_import_to_dlpack_versioned");
    EXPECT_OK(devshare_import_to_dlpack(imp, &ml), "devshare_import_to_dlpack");
    EXPECT_OK(devshare_import_release(imp), "devshare_import_release while DLPack views exist");
    CHECK(outstanding(exp) == 1, "the DLPack views keep the handle's reference after the import is released");
    TestDLVersioned *v = (TestDLVersioned *)(void *)mv;
    TestDLManaged *l = (TestDLManaged *)(void *)ml;
    CHECK(v->major == 1 && v->flags == 1 && v->manager_ctx != NULL && v->deleter != NULL,
          "DLManagedTensorVersioned: version 1.x, READ_ONLY flag for a read-only import, a deleter");
    const TestDLTensor *t = &v->dl_tensor;
    CHECK(t->data == info.data && t->byte_offset == 0 && t->device.device_type == 1 && t->device.device_id == 0,
          "DLTensor: data is the first element, byte_offset 0, device kDLCPU 0");
    CHECK(t->ndim == 2 && t->shape[0] == T_ROWS && t->shape[1] == T_COLS && t->strides[0] == T_COLS &&
              t->strides[1] == 1 && t->dtype.code == DEVSHARE_DTYPE_FLOAT && t->dtype.bits == 32 &&
              t->dtype.lanes == 1,
          "DLTensor: ndim, shape, strides (elements) and dtype of the handle");
    CHECK(l->dl_tensor.data == info.data && l->dl_tensor.ndim == 2 && l->dl_tensor.shape[1] == T_COLS &&
              l->deleter != NULL,
          "DLManagedTensor (legacy) describes the same tensor");
    CHECK(pattern_ok(t->data, &h), "DLTensor data holds the exporter's pattern");
    v->deleter(v);
    CHECK(outstanding(exp) == 1, "one deleter run: the legacy view still holds the reference");
    l->deleter(l);
    CHECK(outstanding(exp) == 0, "the last deleter returned the handle's reference");
    EXPECT_OK(devshare_exporter_close(exp, 0), "devshare_exporter_close");
}

/* ------------------------------------------------------------------------------------------ */
/* The struct_size rules of devshare.h ("Versions and evolution"). */

/* Extra bytes a newer caller's struct has beyond this library's, and a canary after them. */
enum { TAIL = 32, CANARY = 16 };

static int all_bytes(const unsigned char *p, size_t n, unsigned char v) {
    for (size_t i = 0; i < n; i++) {
        if (p[i] != v) {
            return 0;
        }
    }
    return 1;
}

/* Each *_init function, on a buffer of sizeof(T) + TAIL + CANARY bytes filled with 0xCD:
 *  - given sizeof(T) + TAIL: struct_size is that size, the TAIL bytes are zeroed, the canary is
 *    untouched, and the bytes it knows are the same defaults as with sizeof(T);
 *  - given sizeof(T): nothing after sizeof(T) is written;
 *  - given 0 or 4 (smaller than any released struct): INVALID_ARGUMENT, nothing written. */
#define INIT_CASE(T, fn, defaults_ok)                                                                   \
    do {                                                                                               \
        union {                                                                                        \
            T s;                                                                                       \
            uint64_t align;                                                                            \
            unsigned char b[sizeof(T) + TAIL + CANARY];                                                \
        } big_, exact_;                                                                                \
        memset(big_.b, 0xCD, sizeof big_.b);                                                           \
        memset(exact_.b, 0xCD, sizeof exact_.b);                                                       \
        const uint32_t size_ = (uint32_t)(sizeof(T) + TAIL);                                           \
        const int32_t st1_ = fn(&big_.s, size_);                                                       \
        const int32_t st2_ = fn(&exact_.s, (uint32_t)sizeof(T));                                       \
        const T *d_ = &exact_.s;                                                                       \
        CHECK(st1_ == DEVSHARE_STATUS_OK && big_.s.struct_size == size_ &&                             \
                  all_bytes(big_.b + sizeof(T), TAIL, 0) && all_bytes(big_.b + size_, CANARY, 0xCD) &&   \
                  memcmp(big_.b + 4, exact_.b + 4, sizeof(T) - 4) == 0,                                \
              "init_never_writes_past_size_and_zeroes_the_tail: " #fn                                 \
              "(p, sizeof + %d) sets struct_size %u, zeroes the %d bytes beyond sizeof(" #T            \
              "), leaves the canary after the buffer alone",                                          \
              TAIL, (unsigned)size_, TAIL);                                                            \
        CHECK(st2_ == DEVSHARE_STATUS_OK && exact_.s.struct_size == sizeof(T) &&                       \
                  all_bytes(exact_.b + sizeof(T), TAIL + CANARY, 0xCD) && (defaults_ok),               \
              "init_writes_the_defaults_within_its_size: " #fn "(p, sizeof(" #T                        \
              ")) writes the defaults and not one byte more");                                         \
        memset(big_.b, 0xCD, sizeof big_.b);                                                           \
        EXPECT(fn(&big_.s, 0), DEVSHARE_STATUS_INVALID_ARGUMENT, #fn, "init_refuses_a_size_too_small: size 0"); \
        EXPECT(fn(&big_.s, 4), DEVSHARE_STATUS_INVALID_ARGUMENT, #fn,                                  \
               "init_refuses_a_size_too_small: size 4 (only struct_size)");                            \
        CHECK(all_bytes(big_.b, sizeof big_.b, 0xCD),                                                  \
              "init_refuses_a_size_too_small: " #fn " writes nothing when it refuses the size");      \
        (void)d_;                                                                                      \
    } while (0)

static void test_init_functions_write_their_defaults_and_refuse_a_too_small_size(void) {
    INIT_CASE(DevshareTensorDesc, devshare_tensor_desc_init,
              d_->storage_size == DEVSHARE_STORAGE_TO_END && d_->ndim == 0 && d_->flags == 0 && d_->shape == NULL &&
                  d_->strides == NULL && d_->storage_offset == 0 && d_->tensor_offset == 0 && d_->stream == NULL &&
                  d_->dtype.code == 0 && d_->dtype.bits == 0 && d_->dtype.lanes == 0);
    INIT_CASE(DevshareImportOptions, devshare_import_options_init,
              d_->flags == 0 && d_->device == DEVSHARE_DEVICE_FROM_HANDLE && d_->reserved == 0 && d_->stream == NULL);
    INIT_CASE(DevshareImportInfo, devshare_import_info_init,
              all_bytes((const unsigned char *)d_ + 4, sizeof *d_ - 4, 0));
    INIT_CASE(DevshareBackendInfo, devshare_backend_info_init,
              all_bytes((const unsigned char *)d_ + 4, sizeof *d_ - 4, 0));
    INIT_CASE(DevshareTorchArgs, devshare_torch_args_init, all_bytes((const unsigned char *)d_ + 4, sizeof *d_ - 4, 0));
    INIT_CASE(DevshareTorchStorage, devshare_torch_storage_init,
              all_bytes((const unsigned char *)d_ + 4, sizeof *d_ - 4, 0));
}
#undef INIT_CASE

/* Inputs from a newer caller: a larger struct_size is read; a nonzero byte beyond what this
 * library knows (a newer field in use) is refused with UNSUPPORTED_VERSION. */
static void test_a_newer_callers_larger_input_is_read_unless_its_extra_bytes_are_set(void) {
    DevshareExporter *exp = NULL;
    void *ptr = NULL;
    DS_OK(devshare_host_alloc(ALLOC, &exp, &ptr));
    fill_pattern(ptr);
    const DevshareTensorDesc desc = float_desc();
    DevshareHandle h;
    DS_OK(devshare_exporter_share(exp, &desc, &h));

    /* DevshareImportOptions of a newer caller. */
    union {
        DevshareImportOptions s;
        uint64_t align;
        unsigned char b[sizeof(DevshareImportOptions) + TAIL];
    } o;
    DS_OK(devshare_import_options_init(&o.s, sizeof o.b));
    o.s.flags = DEVSHARE_IMPORT_READ_ONLY;
    DevshareImport *imp = NULL;
    o.b[sizeof(DevshareImportOptions)] = 1;
    EXPECT(devshare_import(&h, &o.s, &imp), DEVSHARE_STATUS_UNSUPPORTED_VERSION, "devshare_import",
           "future_input_with_a_nonzero_tail_is_refused: options.struct_size sizeof + 32, first tail byte 1");
    o.b[sizeof(DevshareImportOptions)] = 0;
    o.b[sizeof o.b - 1] = 0x80;
    EXPECT(devshare_import(&h, &o.s, &imp), DEVSHARE_STATUS_UNSUPPORTED_VERSION, "devshare_import",
           "future_input_with_a_nonzero_tail_is_refused: options.struct_size sizeof + 32, last tail byte 0x80");
    CHECK(imp == NULL && outstanding(exp) == 1,
          "future_input_with_a_nonzero_tail_is_refused: no import, the handle's reference still outstanding");
    o.b[sizeof o.b - 1] = 0;
    EXPECT_OK(devshare_import(&h, &o.s, &imp),
              "future_input_with_a_zero_tail_imports: options.struct_size sizeof + 32 with a zero tail");
    if (imp != NULL) {
        DevshareImportInfo info;
        DS_OK(devshare_import_info_init(&info, sizeof info));
        EXPECT_OK(devshare_import_info(imp, &info), "devshare_import_info");
        CHECK(info.read_only == 1 && pattern_ok(info.data, &h),
              "future_input_with_a_zero_tail_imports: the fields this library knows are read (read-only)");
        EXPECT_OK(devshare_import_release(imp), "devshare_import_release");
    }
    CHECK(outstanding(exp) == 0, "future_input_with_a_zero_tail_imports: the release returned the reference");

    /* DevshareTensorDesc of a newer caller. */
    union {
        DevshareTensorDesc s;
        uint64_t align;
        unsigned char b[sizeof(DevshareTensorDesc) + TAIL];
    } d;
    DS_OK(devshare_tensor_desc_init(&d.s, sizeof d.b));
    const uint32_t big_size = d.s.struct_size;
    memcpy(d.b, &desc, sizeof desc); /* this library's fields; the tail stays zero */
    d.s.struct_size = big_size;
    d.b[sizeof(DevshareTensorDesc) + 5] = 7;
    DevshareHandle h2;
    EXPECT(devshare_exporter_share(exp, &d.s, &h2), DEVSHARE_STATUS_UNSUPPORTED_VERSION, "devshare_exporter_share",
           "future_input_with_a_nonzero_tail_is_refused: desc.struct_size sizeof + 32, a tail byte 7");
    CHECK(outstanding(exp) == 0, "future_input_with_a_nonzero_tail_is_refused: the refused share handed out no reference");
    d.b[sizeof(DevshareTensorDesc) + 5] = 0;
    EXPECT_OK(devshare_exporter_share(exp, &d.s, &h2),
              "future_input_with_a_zero_tail_is_read: desc.struct_size sizeof + 32 with a zero tail");
    DevshareHandle h3;
    DS_OK(devshare_exporter_share(exp, &desc, &h3));
    CHECK(h2.ndim == h3.ndim && h2.shape[0] == T_ROWS && h2.shape[1] == T_COLS &&
              h2.storage_offset == h3.storage_offset && h2.storage_size == h3.storage_size &&
              h2.tensor_offset == h3.tensor_offset && h2.dtype.code == h3.dtype.code,
          "future_input_with_a_zero_tail_is_read: the handle is the one the library's own size gives");
    DS_OK(devshare_handle_discard(&h2));
    DS_OK(devshare_handle_discard(&h3));

    /* DevshareTorchArgs of a newer caller (a tuple without a ref-counter: nothing to return). */
    union {
        DevshareTorchArgs s;
        uint64_t align;
        unsigned char b[sizeof(DevshareTorchArgs) + TAIL];
    } a;
    DS_OK(devshare_torch_args_init(&a.s, sizeof a.b));
    EXPECT_OK(devshare_torch_discard(&a.s), "future_input_with_a_zero_tail_is_read: DevshareTorchArgs sizeof + 32");
    a.b[sizeof a.b - 1] = 1;
    EXPECT(devshare_torch_discard(&a.s), DEVSHARE_STATUS_UNSUPPORTED_VERSION, "devshare_torch_discard",
           "future_input_with_a_nonzero_tail_is_refused: DevshareTorchArgs sizeof + 32, last tail byte 1");
    EXPECT_OK(devshare_exporter_close(exp, 0), "devshare_exporter_close");
}

/* Outputs: the library writes min(struct_size, its size) bytes and stores that in struct_size;
 * a struct_size below the first released size is refused and nothing is written. */
static void test_outputs_are_written_up_to_the_librarys_size_and_no_further(void) {
    DevshareExporter *exp = NULL;
    void *ptr = NULL;
    DS_OK(devshare_host_alloc(ALLOC, &exp, &ptr));
    const DevshareTensorDesc desc = float_desc();
    DevshareHandle h;
    DS_OK(devshare_exporter_share(exp, &desc, &h));
    DevshareImport *imp = NULL;
    DS_OK(devshare_import(&h, NULL, &imp));
    DevshareImportInfo want;
    DS_OK(devshare_import_info_init(&want, sizeof want));
    DS_OK(devshare_import_info(imp, &want));

    /* A newer caller's larger DevshareImportInfo. */
    union {
        DevshareImportInfo s;
        uint64_t align;
        unsigned char b[sizeof(DevshareImportInfo) + TAIL];
    } big;
    DS_OK(devshare_import_info_init(&big.s, sizeof big.b));
    CHECK(big.s.struct_size == sizeof big.b && all_bytes(big.b + sizeof(DevshareImportInfo), TAIL, 0),
          "output_larger_than_the_library: devshare_import_info_init(sizeof + 32) zeroes the whole buffer");
    memset(big.b + sizeof(DevshareImportInfo), 0xAB, TAIL);
    EXPECT_OK(devshare_import_info(imp, &big.s), "output_larger_than_the_library: devshare_import_info into sizeof + 32");
    CHECK(big.s.struct_size == sizeof(DevshareImportInfo),
          "output_larger_than_the_library: struct_size comes back as sizeof(DevshareImportInfo) (%u), the bytes written",
          (unsigned)big.s.struct_size);
    CHECK(memcmp(&big.s, &want, sizeof want) == 0,
          "output_larger_than_the_library: the library's own bytes are the usual info");
    CHECK(all_bytes(big.b + sizeof(DevshareImportInfo), TAIL, 0xAB),
          "output_larger_than_the_library: the %d tail bytes (0xAB) are left untouched", TAIL);

    /* A struct_size too small: refused, nothing written. */
    union {
        DevshareImportInfo s;
        unsigned char b[sizeof(DevshareImportInfo)];
    } small;
    const uint32_t too_small[] = {0, 4, 8};
    for (size_t i = 0; i < sizeof too_small / sizeof too_small[0]; i++) {
        char what[160];
        snprintf(what, sizeof what, "output_too_small_is_refused: info.struct_size %u", (unsigned)too_small[i]);
        memset(small.b, 0xAB, sizeof small.b);
        small.s.struct_size = too_small[i];
        EXPECT(devshare_import_info(imp, &small.s), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_import_info", what);
        CHECK(small.s.struct_size == too_small[i] && all_bytes(small.b + 4, sizeof small.b - 4, 0xAB),
              "output_too_small_is_refused: nothing written for struct_size %u", (unsigned)too_small[i]);
    }
    DevshareImportInfo zeroed;
    memset(&zeroed, 0, sizeof zeroed);
    EXPECT(devshare_import_info(imp, &zeroed), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_import_info",
           "output_not_initialised_is_refused: a zeroed DevshareImportInfo (struct_size 0, no init call)");
    DevshareBackendInfo bi;
    memset(&bi, 0, sizeof bi);
    EXPECT(devshare_probe(DEVSHARE_BACKEND_HOST, &bi), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_probe",
           "output_not_initialised_is_refused: DevshareBackendInfo with struct_size 0");
    bi.struct_size = sizeof bi - 1;
    EXPECT(devshare_probe(DEVSHARE_BACKEND_HOST, &bi), DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_probe",
           "output_too_small_is_refused: DevshareBackendInfo with struct_size sizeof - 1");

    /* A larger DevshareBackendInfo, for the second output of the host-only API. */
    union {
        DevshareBackendInfo s;
        uint64_t align;
        unsigned char b[sizeof(DevshareBackendInfo) + TAIL];
    } bbig;
    DS_OK(devshare_backend_info_init(&bbig.s, sizeof bbig.b));
    memset(bbig.b + sizeof(DevshareBackendInfo), 0xAB, TAIL);
    EXPECT_OK(devshare_probe(DEVSHARE_BACKEND_HOST, &bbig.s), "output_larger_than_the_library: devshare_probe into sizeof + 32");
    CHECK(bbig.s.struct_size == sizeof(DevshareBackendInfo) && bbig.s.usable == 1 &&
              strcmp(bbig.s.name, "host") == 0 && all_bytes(bbig.b + sizeof(DevshareBackendInfo), TAIL, 0xAB),
          "output_larger_than_the_library: devshare_probe sets struct_size to sizeof(DevshareBackendInfo), fills it, "
          "leaves the tail alone");

    EXPECT_OK(devshare_import_release(imp), "devshare_import_release");
    EXPECT_OK(devshare_exporter_close(exp, 0), "devshare_exporter_close");
}

/* The 1.2 storage-handle format calls: the version bridge, a torch version's format, a C VMM
 * producer's handle written per format. A refused conversion leaves the output untouched. */
static void test_torch_handle_formats_convert_between_versions_and_refusals_write_nothing(void) {
    /* A PyTorch 2.13 'e' handle: [3]['e'][pid][pad][segment_size][n][handle_type][pad][2 fds]. */
    uint8_t v3[34 + 8];
    memset(v3, 0, sizeof v3);
    v3[0] = 3;
    v3[1] = 'e';
    const int32_t pid = 4321, type_fd = 1, fd0 = 17, fd1 = 18;
    const uint64_t seg = 2u << 20, n = 2;
    memcpy(v3 + 2, &pid, 4);
    memset(v3 + 6, 0xab, 4); /* padding PyTorch does not zero */
    memcpy(v3 + 10, &seg, 8);
    memcpy(v3 + 18, &n, 8);
    memcpy(v3 + 26, &type_fd, 4);
    memset(v3 + 30, 0xcd, 4);
    memcpy(v3 + 34, &fd0, 4);
    memcpy(v3 + 38, &fd1, 4);

    uint8_t out[64];
    size_t len = 0;
    EXPECT_OK(devshare_torch_handle_convert(DEVSHARE_BACKEND_CUDA, v3, sizeof v3, DEVSHARE_TORCH_FORMAT_V2, out,
                                            sizeof out, &len),
              "devshare_torch_handle_convert: a version-3 'e' handle to version 2");
    int32_t got_pid = 0, got_fd1 = 0;
    uint64_t got_seg = 0, got_n = 0;
    memcpy(&got_pid, out + 2, 4);
    memcpy(&got_seg, out + 10, 8);
    memcpy(&got_n, out + 18, 8);
    memcpy(&got_fd1, out + 30, 4);
    CHECK(len == 26 + 8 && out[0] == 2 && out[1] == 'e' && got_pid == pid && got_seg == seg && got_n == n &&
              got_fd1 == fd1 && all_bytes(out + 6, 4, 0),
          "bridge to version 2: the 24-byte header (pid, zero padding, segment size, count) and the same fds");
    uint8_t back[64];
    EXPECT_OK(devshare_torch_handle_convert(DEVSHARE_BACKEND_CUDA, out, len, DEVSHARE_TORCH_FORMAT_V3, back,
                                            sizeof back, &len),
              "devshare_torch_handle_convert: and back to version 3");
    CHECK(len == sizeof v3 && memcmp(back, v3, 6) == 0 && memcmp(back + 10, v3 + 10, 20) == 0 &&
              memcmp(back + 34, v3 + 34, 8) == 0 && all_bytes(back + 6, 4, 0) && all_bytes(back + 30, 4, 0),
          "bridge back to version 3: the original's fields, padding zeroed");

    /* Refusals leave the output untouched and name the problem. */
    memset(out, 0x5a, sizeof out);
    len = 12345;
    EXPECT(devshare_torch_handle_convert(DEVSHARE_BACKEND_CUDA, v3, sizeof v3, DEVSHARE_TORCH_FORMAT_UNVERSIONED, out,
                                         sizeof out, &len),
           DEVSHARE_STATUS_UNSUPPORTED, "devshare_torch_handle_convert", "an 'e' handle to the unversioned form");
    CHECK(all_bytes(out, sizeof out, 0x5a) && len == 12345, "a refused conversion writes neither buf nor len_out");
    CHECK(strstr(last_error(), "2.4 and earlier") != NULL, "the refusal says why (%s)", last_error());
    EXPECT(devshare_torch_handle_convert(DEVSHARE_BACKEND_CUDA, v3, sizeof v3, 7, out, sizeof out, &len),
           DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_torch_handle_convert", "format 7");
    v3[26] = 9;
    EXPECT(devshare_torch_handle_convert(DEVSHARE_BACKEND_CUDA, v3, sizeof v3, DEVSHARE_TORCH_FORMAT_V2, out,
                                         sizeof out, &len),
           DEVSHARE_STATUS_INVALID_HANDLE, "devshare_torch_handle_convert", "handle type 9");
    CHECK(all_bytes(out, sizeof out, 0x5a), "a malformed input writes nothing");
    v3[26] = 1;
    EXPECT(devshare_torch_handle_convert(DEVSHARE_BACKEND_CUDA, NULL, 10, DEVSHARE_TORCH_FORMAT_V2, out, sizeof out,
                                         &len),
           DEVSHARE_STATUS_NULL_ARGUMENT, "devshare_torch_handle_convert", "NULL handle");
    EXPECT(devshare_torch_handle_convert(DEVSHARE_BACKEND_CUDA, v3, sizeof v3, DEVSHARE_TORCH_FORMAT_V2, out, 10,
                                         &len),
           DEVSHARE_STATUS_BUFFER_TOO_SMALL, "devshare_torch_handle_convert", "a 10-byte buffer");
    CHECK(len == 34, "too small: len_out still says 34 (got %zu)", len);

    /* A torch 2.13 'c' handle for torch 2.11: the version byte that consumer accepts. */
    uint8_t c3[66], c2[66];
    c3[0] = 3;
    c3[1] = 'c';
    memset(c3 + 2, 0x77, 64);
    EXPECT_OK(devshare_torch_handle_convert(DEVSHARE_BACKEND_CUDA, c3, sizeof c3, DEVSHARE_TORCH_FORMAT_V2, c2,
                                            sizeof c2, &len),
              "devshare_torch_handle_convert: a version-3 'c' handle to version 2");
    CHECK(len == 66 && c2[0] == 2 && c2[1] == 'c' && memcmp(c2 + 2, c3 + 2, 64) == 0, "[2]['c'] + the same 64 bytes");

    uint32_t fmt = 99;
    EXPECT_OK(devshare_torch_format_for_version(DEVSHARE_BACKEND_CUDA, "2.11.0+cu128", &fmt), "format of 2.11");
    CHECK(fmt == DEVSHARE_TORCH_FORMAT_V2, "torch 2.11 reads version 2");
    EXPECT_OK(devshare_torch_format_for_version(DEVSHARE_BACKEND_CUDA, "2.15.0", &fmt), "format of 2.15");
    CHECK(fmt == DEVSHARE_TORCH_FORMAT_V3, "torch 2.15 reads version 3");
    EXPECT_OK(devshare_torch_format_for_version(DEVSHARE_BACKEND_CUDA, "2.4.1", &fmt), "format of 2.4");
    CHECK(fmt == DEVSHARE_TORCH_FORMAT_UNVERSIONED, "torch 2.4 reads the raw handle");
    EXPECT_OK(devshare_torch_format_for_version(DEVSHARE_BACKEND_ACL, "2.7.1.post2", &fmt), "torch_npu's format");
    CHECK(fmt == DEVSHARE_TORCH_FORMAT_V1, "torch_npu reads version 1");
    EXPECT(devshare_torch_format_for_version(DEVSHARE_BACKEND_CUDA, "latest", &fmt), DEVSHARE_STATUS_INVALID_ARGUMENT,
           "devshare_torch_format_for_version", "\"latest\"");
    EXPECT(devshare_torch_format_for_version(DEVSHARE_BACKEND_CUDA, NULL, &fmt), DEVSHARE_STATUS_NULL_ARGUMENT,
           "devshare_torch_format_for_version", "NULL version");
    EXPECT(devshare_torch_format_for_version(DEVSHARE_BACKEND_CUDA, "2.13", NULL), DEVSHARE_STATUS_NULL_ARGUMENT,
           "devshare_torch_format_for_version", "NULL format_out");

    /* A C producer's segmented handle (from the version-3 tuple) handed back per format. */
    DevshareTorchArgs a;
    DS_OK(devshare_torch_args_init(&a, sizeof a));
    const int64_t shape[1] = {256};
    a.backend = DEVSHARE_BACKEND_CUDA;
    a.dtype = (DevshareDType){DEVSHARE_DTYPE_FLOAT, 32, 1};
    a.ndim = 1;
    a.shape = shape;
    a.handle = v3;
    a.handle_len = sizeof v3;
    a.storage_size = 1024;
    DevshareHandle h;
    DS_OK(devshare_handle_from_torch(&a, &h));
    DevshareTorchStorage s;
    DS_OK(devshare_torch_storage_init(&s, sizeof s));
    EXPECT_OK(devshare_handle_to_torch_as(&h, DEVSHARE_TORCH_FORMAT_V3, &s), "devshare_handle_to_torch_as V3");
    CHECK(s.handle_len == 42 && s.handle[0] == 3 && memcmp(s.handle + 34, v3 + 34, 8) == 0,
          "handed back as version 3 (%u bytes)", s.handle_len);
    EXPECT_OK(devshare_handle_to_torch(&h, &s), "devshare_handle_to_torch (1.1 call)");
    CHECK(s.handle_len == 34 && s.handle[0] == 2, "the 1.1 call still writes version 2");
    memset(out, 0x5a, sizeof out);
    EXPECT(devshare_torch_storage_handle_as(&h, NULL, 0, DEVSHARE_TORCH_FORMAT_V1, out, sizeof out, &len),
           DEVSHARE_STATUS_UNSUPPORTED, "devshare_torch_storage_handle_as", "a CUDA 'e' handle as version 1");
    CHECK(all_bytes(out, sizeof out, 0x5a), "nothing written on refusal");
    EXPECT_OK(devshare_torch_storage_handle_as(&h, NULL, 0, DEVSHARE_TORCH_FORMAT_V3, out, sizeof out, &len),
              "devshare_torch_storage_handle_as V3");
    CHECK(len == 42 && out[0] == 3 && memcmp(out + 34, v3 + 34, 8) == 0, "the version-3 bytes with the same fds");
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    const int stale = own_shm(1); /* names an earlier process with this pid left */
    if (stale > 0) {
        printf("# %d /dev/shm name(s) carried this pid before the test began: set aside\n", stale);
    }
    test_every_status_has_its_own_nonempty_text();
    test_devshare_version_matches_the_header_macros();
    test_last_error_copies_or_truncates_and_reports_the_full_length();
    test_every_function_refuses_null_except_the_documented_optional_pointers();
    test_out_of_range_arguments_return_the_documented_status();
    test_handles_round_trip_through_bytes_and_text_and_corruption_is_refused();
    test_probe_fills_in_every_field_for_each_backend();
    test_an_import_shares_the_memory_and_holds_its_reference_until_released();
    test_dlpack_views_hold_the_reference_until_their_deleters_run();
    test_discard_returns_an_unused_handles_reference_once_and_refuses_a_held_one();
    test_importing_a_removed_object_is_not_found_and_leaves_the_reference();
    test_init_functions_write_their_defaults_and_refuse_a_too_small_size();
    test_a_newer_callers_larger_input_is_read_unless_its_extra_bytes_are_set();
    test_outputs_are_written_up_to_the_librarys_size_and_no_further();
    test_torch_handle_formats_convert_between_versions_and_refusals_write_nothing();
    const int left = own_shm(0);
    CHECK(n_stale_shm >= 0, "the names this pid carried before the test began were recorded (at most 64)");
    CHECK(left == 0, "no /dev/shm object of this process (devshare_%ld_*, devshare_rc_%ld_*) is left", (long)getpid(),
          (long)getpid());
    return harness_done();
}
