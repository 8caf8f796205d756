/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_acl_vmm: segmented (VMM, "expandable segments") memory of the acl backend between
 * separate processes, over the strict ACL stand-in runtime (tests/standin/acl).
 *
 * The parent is a C producer: it allocates physical memory with aclrtMallocPhysical (2 MiB
 * granularity), reserves address space, maps the segments back to back, fills them (float i at
 * element i of the allocation) and exports them with devshare_export_segments. Consumers are
 * this program re-executed with "--child"; each prints its pid (devshare_local_pid, the bare
 * tgid on Ascend) and serves commands, one line each:
 *   import <device|-1> <flags> <hold> <write> <v0> <handle text>   devshare_import (inline table)
 *   importenc <device|-1> <flags> <hold> <write> <v0> <hex bytes>  devshare_import_encoded
 *   importtorch <hold> <write> <v0> <device> <storage_size> <storage_offset> <ref_slot>
 *               <ref_name> <rows> <cols> <tensor_offset> <hex 'e' bytes>
 *                                         devshare_import_torch, as a stock torch_npu consumer
 *                                         sends the tuple
 *   -> "OK <numel> <device>" / "ERR <status> <msg>"
 *   release   -> "OK <n released>"
 *   stats     -> "OK <reservations> <mappings> <imported handles> <violations>" (stand-in queries)
 *   quit
 * A consumer reads every imported tensor back through aclrtMemcpy (D2D into its own memory
 * first when it imported on another device) and checks element k == v0 + data offset / 4 + k
 * (v0: the value at the allocation's first element); with
 * <write> 1 it then writes -1 to the tensor's first element and -2 to its last, which the
 * producer reads back from its own mapping.
 *
 * Cases: a tensor spanning several segments with a non-zero storage offset (inline table,
 * text); pid validation (refused, then whitelisted on every segment); a failure part-way through
 * an import (the second segment is not whitelisted) leaves nothing imported, reserved or
 * mapped; a table of 20 segments (longer than the handle struct holds) through the byte
 * encoding and through the torch_npu 'e' bytes of devshare_torch_storage_handle; two storages
 * whose page lists overlap import each shared page once; cross-device import (peer access
 * enabled; refused without it); an import in the exporting process is refused before ACL is
 * called; the exporter cannot close while references are outstanding; after every release
 * nothing stays imported, reserved or mapped in any consumer, the ref-counter slots are back to
 * 0, and the stand-in recorded no rule violation in any process.
 *
 * Needs DEVSHARE_ACL_LIBRARY pointing at the stand-in (CTest sets it).
 */
#define _GNU_SOURCE

#include "acl_standin.h"
#define HARNESS_NAME "test_acl_vmm"
#include "device_harness.h"

#define ACL_OK(call)                                                                                              \
    do {                                                                                                          \
        aclError rc_ = (call);                                                                                    \
        if (rc_ != ACL_SUCCESS) {                                                                                 \
            fprintf(stderr, "test_acl_vmm: %s = %d (%s)\n", #call, rc_, aclGetRecentErrMsg());                    \
            exit(2);                                                                                              \
        }                                                                                                         \
    } while (0)

#define SEG ((size_t)2 * MIB)
enum { CMD_CAP = 1 << 16 };

/* ---------------------------------------------------------------------------------------- */
/* Child: a consumer serving commands */

/* Read a contiguous float32 tensor of an import back and check its values; with `write`, put
 * -1 into its first element and -2 into its last (same device only). */
static int child_verify(DevshareImport *imp, int32_t exporter_device, int write, uint64_t v0, char *why, size_t cap) {
    DevshareImportInfo info;
    DS_OK(devshare_import_info_init(&info, sizeof info));
    DS_OK(devshare_import_info(imp, &info));
    const uint64_t n = info.numel;
    const size_t bytes = (size_t)n * 4u;
    float *host = malloc(bytes ? bytes : 4);
    ACL_OK(aclrtSetDevice(info.device));
    if (bytes) {
        if (info.device == exporter_device) {
            ACL_OK(aclrtMemcpy(host, bytes, info.data, bytes, ACL_MEMCPY_DEVICE_TO_HOST));
        } else {
            /* No H2D/D2H with memory imported from another device: copy D2D into our own. */
            void *local = NULL;
            const size_t local_size = (bytes + SEG - 1) / SEG * SEG;
            ACL_OK(aclrtMalloc(&local, local_size, ACL_MEM_MALLOC_HUGE_FIRST));
            ACL_OK(aclrtMemcpy(local, local_size, info.data, bytes, ACL_MEMCPY_DEVICE_TO_DEVICE));
            ACL_OK(aclrtMemcpy(host, bytes, local, bytes, ACL_MEMCPY_DEVICE_TO_HOST));
            ACL_OK(aclrtFree(local));
        }
    }
    const uint64_t first = v0 + (uint64_t)((char *)info.data - (char *)info.base) / 4u;
    for (uint64_t k = 0; k < n; k++) {
        if (host[k] != (float)(first + k)) {
            snprintf(why, cap, "element %" PRIu64 " is %g, expected %" PRIu64, k, (double)host[k], first + k);
            free(host);
            return 0;
        }
    }
    free(host);
    if (write && n > 0 && info.device == exporter_device) {
        const float a = -1.0f, b = -2.0f;
        ACL_OK(aclrtMemcpy(info.data, 4, &a, 4, ACL_MEMCPY_HOST_TO_DEVICE));
        ACL_OK(aclrtMemcpy((char *)info.data + (n - 1) * 4, 4, &b, 4, ACL_MEMCPY_HOST_TO_DEVICE));
    }
    return 1;
}

/* Answer one import: verify, keep or release it. */
static void child_answer(int32_t st, DevshareImport *imp, int32_t exporter_device, int hold, int write, uint64_t v0,
                         DevshareImport **held, int *n_held) {
    if (st != DEVSHARE_STATUS_OK) {
        printf("ERR %d %s\n", st, last_error());
        return;
    }
    char why[256] = "";
    DevshareImportInfo info;
    DS_OK(devshare_import_info_init(&info, sizeof info));
    DS_OK(devshare_import_info(imp, &info));
    if (!child_verify(imp, exporter_device, write, v0, why, sizeof why)) {
        printf("ERR 0 data: %s\n", why);
    } else {
        printf("OK %" PRIu64 " %d\n", info.numel, info.device);
    }
    if (hold && *n_held < 64) {
        held[(*n_held)++] = imp;
    } else {
        DS_OK(devshare_import_release(imp));
    }
}

static int child_main(void) {
    ACL_OK(aclInit(NULL));
    ACL_OK(aclrtSetDevice(0));
    int32_t pid = 0;
    DS_OK(devshare_local_pid(DEVSHARE_BACKEND_ACL, 0, &pid));
    printf("PID %d %d\n", pid, (int)getpid());
    fflush(stdout);
    DevshareImport *held[64];
    int n_held = 0;
    char *line = malloc(CMD_CAP);
    uint8_t *bytes = malloc(CMD_CAP);
    while (read_line_fd(0, line, CMD_CAP, IO_TIMEOUT_MS) > 0) {
        int device = 0, hold = 0, write = 0, used = 0;
        unsigned flags = 0;
        uint64_t v0 = 0;
        if (strncmp(line, "import ", 7) == 0 || strncmp(line, "importenc ", 10) == 0) {
            const int enc = line[6] == 'e';
            const char *args = line + (enc ? 10 : 7);
            if (sscanf(args, "%d %u %d %d %" SCNu64 " %n", &device, &flags, &hold, &write, &v0, &used) != 5) {
                printf("ERR 0 bad command\n");
                fflush(stdout);
                continue;
            }
            DevshareImportOptions o;
            DS_OK(devshare_import_options_init(&o, sizeof o));
            o.device = device;
            o.flags = flags;
            DevshareImport *imp = NULL;
            DevshareHandle h;
            int32_t st;
            if (enc) {
                const int n = hex_decode(args + used, bytes, CMD_CAP);
                st = n < 0 ? DEVSHARE_STATUS_INVALID_ARGUMENT : devshare_import_encoded(bytes, (size_t)n, &o, &imp);
            } else {
                st = devshare_handle_from_text(args + used, &h);
                if (st == DEVSHARE_STATUS_OK) {
                    st = devshare_import(&h, &o, &imp);
                }
            }
            child_answer(st, imp, 0, hold, write, v0, held, &n_held);
        } else if (strncmp(line, "importtorch ", 12) == 0) {
            DevshareTorchArgs a;
            DS_OK(devshare_torch_args_init(&a, sizeof a));
            char ref_name[128];
            int64_t shape[2], tensor_offset = 0;
            uint64_t storage_size = 0, storage_offset = 0, ref_slot = 0;
            if (sscanf(line + 12,
                       "%d %d %" SCNu64 " %d %" SCNu64 " %" SCNu64 " %" SCNu64 " %127s %" SCNd64 " %" SCNd64 " %" SCNd64 " %n",
                       &hold, &write, &v0, &device, &storage_size, &storage_offset, &ref_slot, ref_name, &shape[0],
                       &shape[1], &tensor_offset, &used) != 11) {
                printf("ERR 0 bad command\n");
                fflush(stdout);
                continue;
            }
            const int n = hex_decode(line + 12 + used, bytes, CMD_CAP);
            a.backend = DEVSHARE_BACKEND_ACL;
            a.dtype.code = DEVSHARE_DTYPE_FLOAT;
            a.dtype.bits = 32;
            a.dtype.lanes = 1;
            a.ndim = 2;
            a.shape = shape;
            a.tensor_offset = tensor_offset;
            a.device = device;
            a.handle = bytes;
            a.handle_len = n < 0 ? 0 : (size_t)n;
            a.storage_size = storage_size;
            a.storage_offset = storage_offset;
            a.ref_name = (const uint8_t *)ref_name;
            a.ref_name_len = strlen(ref_name);
            a.ref_slot = ref_slot;
            DevshareImport *imp = NULL;
            const int32_t st = devshare_import_torch(&a, NULL, &imp);
            child_answer(st, imp, device, hold, write, v0, held, &n_held);
        } else if (strcmp(line, "release") == 0) {
            for (int i = 0; i < n_held; i++) {
                DS_OK(devshare_import_release(held[i]));
            }
            printf("OK %d\n", n_held);
            n_held = 0;
        } else if (strcmp(line, "stats") == 0) {
            printf("OK %d %d %d %d\n", aclsi_vmm_reservations(), aclsi_vmm_mappings(), aclsi_vmm_imported_handles(),
                   aclsi_violation_count());
        } else if (strcmp(line, "quit") == 0) {
            break;
        } else {
            printf("ERR 0 unknown command\n");
        }
        fflush(stdout);
    }
    for (int i = 0; i < n_held; i++) {
        devshare_import_release(held[i]);
    }
    free(line);
    free(bytes);
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Parent: a C VMM producer */

typedef struct {
    void *base;
    aclrtDrvMemHandle phys[32];
    uint64_t phys_u64[32];
    size_t n;
} VmmAlloc;

/* n segments of physical memory on device 0, mapped back to back in one reservation, holding
 * float (first_element + i) at element i. */
static VmmAlloc vmm_alloc(size_t n, uint64_t first_element) {
    VmmAlloc a = {0};
    a.n = n;
    aclrtPhysicalMemProp prop;
    memset(&prop, 0, sizeof prop);
    prop.handleType = ACL_MEM_HANDLE_TYPE_NONE;
    prop.allocationType = ACL_MEM_ALLOCATION_TYPE_PINNED;
    prop.memAttr = ACL_HBM_MEM_HUGE;
    prop.location.id = 0;
    prop.location.type = ACL_MEM_LOCATION_TYPE_DEVICE;
    size_t gran = 0;
    ACL_OK(aclrtMemGetAllocationGranularity(&prop, ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM, &gran));
    if (gran != SEG) {
        die("granularity is not 2 MiB", (long)gran);
    }
    ACL_OK(aclrtReserveMemAddress(&a.base, n * SEG, 0, NULL, 0));
    float *host = malloc(SEG);
    for (size_t i = 0; i < n; i++) {
        ACL_OK(aclrtMallocPhysical(&a.phys[i], SEG, &prop, 0));
        a.phys_u64[i] = (uint64_t)(uintptr_t)a.phys[i];
        char *va = (char *)a.base + i * SEG;
        ACL_OK(aclrtMapMem(va, SEG, 0, a.phys[i], 0));
        for (size_t k = 0; k < SEG / 4; k++) {
            host[k] = (float)(first_element + i * (SEG / 4) + k);
        }
        ACL_OK(aclrtMemcpy(va, SEG, host, SEG, ACL_MEMCPY_HOST_TO_DEVICE));
    }
    free(host);
    return a;
}

/* The reference order: unmap, free the physical memory, release the address range. */
static void vmm_free(VmmAlloc *a) {
    for (size_t i = 0; i < a->n; i++) {
        ACL_OK(aclrtUnmapMem((char *)a->base + i * SEG));
    }
    for (size_t i = 0; i < a->n; i++) {
        ACL_OK(aclrtFreePhysical(a->phys[i]));
    }
    ACL_OK(aclrtReleaseMemAddress(a->base));
}

static float read_f32(const void *dev) {
    float v = 0;
    ACL_OK(aclrtMemcpy(&v, 4, dev, 4, ACL_MEMCPY_DEVICE_TO_HOST));
    return v;
}

static void write_f32(void *dev, float v) {
    ACL_OK(aclrtMemcpy(dev, 4, &v, 4, ACL_MEMCPY_HOST_TO_DEVICE));
}

/* The consumer's writes (-1 first element, -2 last) arrived in the producer's memory: check,
 * then put the original values back. */
static int check_writes(void *base, const DevshareHandle *h, uint64_t first_element) {
    const uint64_t off = h->storage_offset + (uint64_t)h->tensor_offset * 4;
    const uint64_t numel = (uint64_t)h->shape[0] * (uint64_t)h->shape[1];
    char *first = (char *)base + off, *last = first + (numel - 1) * 4;
    const int ok = read_f32(first) == -1.0f && read_f32(last) == -2.0f;
    write_f32(first, (float)(first_element + off / 4));
    write_f32(last, (float)(first_element + off / 4 + numel - 1));
    return ok;
}

static const char *import_cmd(Child *c, const DevshareHandle *h, int device, unsigned flags, int hold, int write,
                              uint64_t v0) {
    char text[DEVSHARE_HANDLE_MAX_TEXT_SIZE];
    static char cmd[CMD_CAP];
    DS_OK(devshare_handle_to_text(h, text, sizeof text, NULL));
    snprintf(cmd, sizeof cmd, "import %d %u %d %d %" PRIu64 " %s", device, flags, hold, write, v0, text);
    return ask(c, "%s", cmd);
}

/* Share a float32 tensor through the byte encoding; the command that imports it. */
static const char *share_encoded_cmd(DevshareExporter *e, uint64_t storage_offset, uint64_t storage_size, int64_t rows,
                                     int64_t cols, int64_t tensor_offset, int hold, int write, uint64_t v0,
                                     DevshareHandle *h_out) {
    const int64_t shape[2] = {rows, cols};
    DevshareTensorDesc d;
    DS_OK(devshare_tensor_desc_init(&d, sizeof d));
    d.dtype.code = DEVSHARE_DTYPE_FLOAT;
    d.dtype.bits = 32;
    d.dtype.lanes = 1;
    d.ndim = 2;
    d.shape = shape;
    d.storage_offset = storage_offset;
    d.storage_size = storage_size;
    d.tensor_offset = tensor_offset;
    static uint8_t buf[CMD_CAP / 4];
    size_t len = 0;
    DS_OK(devshare_exporter_share_encoded(e, &d, buf, sizeof buf, &len));
    /* The struct decodes (without the table) for the test's own bookkeeping. */
    const int32_t st = devshare_handle_decode(buf, len, h_out);
    if (st != DEVSHARE_STATUS_OK) {
        die("devshare_handle_decode of a long segmented encoding", st);
    }
    static char cmd[CMD_CAP];
    int n = snprintf(cmd, sizeof cmd, "importenc -1 0 %d %d %" PRIu64 " ", hold, write, v0);
    hex_encode(buf, len, cmd + n);
    return cmd;
}

/* The torch_npu 8-tuple of a handle ('e' storage bytes), as a command for the consumer. */
static const char *torch_cmd(DevshareExporter *e, const DevshareHandle *h, int hold, int write, uint64_t v0,
                             size_t *e_len) {
    static uint8_t table[CMD_CAP / 4];
    size_t table_len = 0;
    DS_OK(devshare_exporter_segment_table(e, table, sizeof table, &table_len));
    DevshareTorchStorage ts;
    DS_OK(devshare_torch_storage_init(&ts, sizeof ts));
    if (table_len == 0) {
        DS_OK(devshare_handle_to_torch(h, &ts));
    } else {
        /* devshare_handle_to_torch wants the table inline: the tuple's fields are the handle's. */
        ts.device = h->device_index;
        ts.storage_size = h->storage_size;
        ts.storage_offset = h->storage_offset;
        ts.ref_slot = h->ref_slot;
        ts.ref_name_len = h->ref_name_len;
        memcpy(ts.ref_name, h->ref_name, h->ref_name_len);
    }
    static uint8_t ebytes[CMD_CAP / 4];
    size_t n = 0;
    DS_OK(devshare_torch_storage_handle(h, table_len ? table : NULL, table_len, ebytes, sizeof ebytes, &n));
    *e_len = n;
    static char cmd[CMD_CAP];
    int k = snprintf(cmd, sizeof cmd,
                     "importtorch %d %d %" PRIu64 " %d %" PRIu64 " %" PRIu64 " %" PRIu64 " %.*s %" PRId64 " %" PRId64
                     " %" PRId64 " ",
                     hold, write, v0, ts.device, ts.storage_size, ts.storage_offset, ts.ref_slot, (int)ts.ref_name_len,
                     (const char *)ts.ref_name, h->shape[0], h->shape[1], h->tensor_offset);
    hex_encode(ebytes, n, cmd + k);
    return cmd;
}

static int stats_are(Child *c, int res, int maps, int imported) {
    char expect[64];
    snprintf(expect, sizeof expect, "OK %d %d %d 0", res, maps, imported);
    const char *a = ask(c, "stats");
    if (strcmp(a, expect) != 0) {
        printf("# stats: %s, expected %s\n", a, expect);
        return 0;
    }
    return 1;
}

static uint64_t table_entry(const DevshareHandle *h, size_t i) {
    uint64_t s;
    memcpy(&s, h->key + 8 * i, 8);
    return s;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--child") == 0) {
        return child_main();
    }
    if (!getenv("DEVSHARE_ACL_LIBRARY")) {
        fprintf(stderr, "test_acl_vmm: set DEVSHARE_ACL_LIBRARY to the stand-in libascendcl.so\n");
        return 2;
    }
    harness_start("test_acl_vmm");

    DevshareBackendInfo bi;
    DS_OK(devshare_backend_info_init(&bi, sizeof bi));
    DS_OK(devshare_probe(DEVSHARE_BACKEND_ACL, &bi));
    CHECK(bi.usable == 1, "probe: acl usable over the stand-in (%s)", bi.detail);
    aclInit(NULL); /* devshare's probe initialised ACL already */
    ACL_OK(aclrtSetDevice(0));

    /* --- A: 4 segments, pid validation, a tensor spanning segments 0..2. --- */
    VmmAlloc A = vmm_alloc(4, 0);
    DevshareExporter *ea = NULL;
    DS_OK(devshare_export_segments(DEVSHARE_BACKEND_ACL, 0, A.base, A.phys_u64, A.n, SEG, 0, &ea));
    void *ptr = NULL;
    uint64_t size = 0;
    DS_OK(devshare_exporter_memory(ea, &ptr, &size));
    CHECK(ptr == A.base && size == 4 * SEG, "the exporter covers the 4 segments (%" PRIu64 " bytes)", size);
    const uint64_t a_off = MIB + 4096;
    DevshareHandle h1 = share_f32(ea, a_off, 5 * MIB, 1000, 1024, 100, 0, NULL);
    CHECK((h1.flags & 4u) != 0 && h1.key_len == 32 && h1.alloc_size == 4 * SEG,
          "the handle is segmented with its 4 shareable handles inline (key_len %u)", h1.key_len);

    DevshareImport *self_imp = NULL;
    int32_t st = devshare_import(&h1, NULL, &self_imp);
    CHECK(st == DEVSHARE_STATUS_UNSUPPORTED && strstr(last_error(), "exporting process"),
          "importing in the exporting process is refused before ACL is called (%s)", last_error());
    CHECK(aclsi_violation_count() == 0, "... and the stand-in saw no violation");

    Child c1 = spawn(NULL, NULL);
    const char *a = import_cmd(&c1, &h1, -1, 0, 0, 0, 0);
    CHECK(strncmp(a, "ERR -34", 7) == 0 && strstr(a, "207006") && strstr(a, "segment 0 of 4"),
          "a consumer not whitelisted is refused with the vendor code, naming the segment (%s)", a);
    CHECK(stats_are(&c1, 0, 0, 0), "the refused import left nothing imported, reserved or mapped");

    /* Part-way failure: only segment 0 whitelisted, so segment 1's import fails. */
    int32_t pids[1] = {c1.bare_tgid};
    ACL_OK(aclrtMemSetPidToShareableHandle(table_entry(&h1, 0), pids, 1));
    a = import_cmd(&c1, &h1, -1, 0, 0, 0, 0);
    CHECK(strncmp(a, "ERR -34", 7) == 0 && strstr(a, "segment 1 of 4"),
          "with only segment 0 whitelisted the import fails at segment 1 (%s)", a);
    CHECK(stats_are(&c1, 0, 0, 0), "the part-way failure undid segment 0's import: nothing imported, reserved or mapped");

    DS_OK(devshare_exporter_allow_pid(ea, c1.bare_tgid));
    DS_OK(devshare_exporter_allow_pid(ea, c1.bare_tgid)); /* once per handle and pid */
    a = import_cmd(&c1, &h1, -1, 0, 1, 1, 0);
    CHECK(strncmp(a, "OK 1024000 0", 12) == 0,
          "the whitelisted consumer reads a tensor spanning segments 0..2 at storage offset 1 MiB + 4 KiB (%s)", a);
    CHECK(stats_are(&c1, 1, 4, 4), "one reservation, 4 mappings, 4 imported handles while held");
    CHECK(aclsi_vmm_open_imports(table_entry(&h1, 3)) == 1, "each shareable handle is imported once (%d)",
          aclsi_vmm_open_imports(table_entry(&h1, 3)));
    CHECK(check_writes(A.base, &h1, 0), "the consumer's writes are in the producer's memory");
    CHECK(outstanding(ea) == 1, "one reference outstanding while held");
    st = devshare_exporter_close(ea, 0);
    CHECK(st == DEVSHARE_STATUS_BUSY, "the exporter cannot close while a reference is outstanding (%s)",
          devshare_status_str(st));

    /* A second storage of the same allocation shares the cached mapping. */
    DevshareHandle h2 = share_f32(ea, 3 * SEG, SEG, 16, 1024, 7, 0, NULL);
    a = import_cmd(&c1, &h2, -1, 0, 1, 0, 0);
    CHECK(strncmp(a, "OK 16384 0", 10) == 0, "a second storage in the last segment reads right (%s)", a);
    CHECK(stats_are(&c1, 1, 4, 4), "... from the same mapping");
    a = ask(&c1, "release");
    CHECK(strcmp(a, "OK 2") == 0, "the consumer releases both");
    CHECK(stats_are(&c1, 0, 0, 0), "after the release nothing stays imported, reserved or mapped");
    CHECK(outstanding(ea) == 0 && slot_value(&h1) == 0 && slot_value(&h2) == 0,
          "both references came back: slots exactly 0");
    CHECK(aclsi_vmm_open_imports(table_entry(&h1, 3)) == 0, "closes equal imports (open imports of segment 3: %d)",
          aclsi_vmm_open_imports(table_entry(&h1, 3)));

    /* The torch_npu 'e' form of an inline table. */
    size_t e_len = 0;
    DevshareHandle h3 = share_f32(ea, a_off, 5 * MIB, 1000, 1024, 100, 0, NULL);
    const char *cmd = torch_cmd(ea, &h3, 0, 0, 0, &e_len);
    CHECK(e_len == 18 + 8 * 4, "the torch_npu 'e' bytes of 4 segments are 18 + 8 x 4 long (%zu)", e_len);
    a = ask(&c1, "%s", cmd);
    CHECK(strncmp(a, "OK 1024000 0", 12) == 0, "devshare_import_torch of the 'e' tuple reads right (%s)", a);
    CHECK(outstanding(ea) == 0 && slot_value(&h3) == 0, "the torch-style consumer returned its reference");

    /* Cross-device: no peer access refused, then with it. */
    DevshareHandle hx = share_f32(ea, 0, SEG, 8, 8, 0, 0, NULL);
    a = import_cmd(&c1, &hx, 1, DEVSHARE_IMPORT_NO_PEER_ACCESS, 0, 0, 0);
    CHECK(strncmp(a, "ERR -34", 7) == 0 && strstr(a, "507899"),
          "an import on device 1 without peer access fails with the driver error (%s)", a);
    CHECK(stats_are(&c1, 0, 0, 0), "... and leaves nothing behind");
    a = import_cmd(&c1, &hx, 1, 0, 1, 0, 0);
    CHECK(strncmp(a, "OK 64 1", 7) == 0, "an import on device 1 (peer access enabled) reads right (%s)", a);
    CHECK(stats_are(&c1, 1, 4, 4), "held on device 1");
    DevshareHandle hy = share_f32(ea, SEG, SEG, 8, 8, 0, 0, NULL);
    a = import_cmd(&c1, &hy, 0, 0, 0, 0, 0);
    CHECK(strncmp(a, "ERR -31", 7) == 0 && strstr(a, "one import of a shareable handle per process"),
          "the same pages on device 0 while imported on device 1 are refused by name (%s)", a);
    CHECK(stats_are(&c1, 1, 4, 4), "... and that refusal left the held import as it was");
    a = ask(&c1, "release");
    CHECK(strcmp(a, "OK 1") == 0 && stats_are(&c1, 0, 0, 0), "the cross-device import released");
    CHECK(outstanding(ea) == 1, "the refused handle still holds its reference");
    DS_OK(devshare_handle_discard(&hy)); /* what a consumer that cannot open a handle does */
    CHECK(outstanding(ea) == 0, "no reference outstanding once it is discarded");
    CHECK(finish(&c1), "the first consumer exits cleanly");

    /* --- B: 20 segments (160 bytes of table: not inline), without pid validation. --- */
    const uint64_t b_first = 1000; /* element values distinct from A's */
    VmmAlloc B = vmm_alloc(20, b_first);
    DevshareExporter *eb = NULL;
    DS_OK(devshare_export_segments(DEVSHARE_BACKEND_ACL, 0, B.base, B.phys_u64, B.n, SEG,
                                   DEVSHARE_EXPORT_NO_PID_CHECK, &eb));
    size_t tlen = 0;
    st = devshare_exporter_segment_table(eb, NULL, 0, &tlen);
    CHECK(st == DEVSHARE_STATUS_BUFFER_TOO_SMALL && tlen == 160, "a 20-segment table travels outside the struct (%zu bytes)", tlen);
    Child c2 = spawn(NULL, NULL);
    DevshareHandle hb;
    /* Storage from segment 3 + 12 KiB over 14 segments; the tensor starts 5 elements in. */
    cmd = share_encoded_cmd(eb, 3 * SEG + 12288, 14 * SEG, 7000, 1024, 5, 1, 1, b_first, &hb);
    CHECK(hb.key_len == 0, "the struct form holds no table");
    DevshareImport *bad = NULL;
    st = devshare_import(&hb, NULL, &bad);
    CHECK(st == DEVSHARE_STATUS_INVALID_ARGUMENT && strstr(last_error(), "devshare_import_encoded"),
          "the struct alone is refused, naming the encodings that carry the table");
    a = ask(&c2, "%s", cmd);
    CHECK(strncmp(a, "OK 7168000 0", 12) == 0, "devshare_import_encoded of 20 segments reads right (%s)", a);
    CHECK(stats_are(&c2, 1, 20, 20), "one reservation of 20 segments held");
    /* Element values of B start at b_first. */
    CHECK(check_writes(B.base, &hb, b_first), "the consumer's writes to B are in the producer's memory");
    DevshareHandle hb2 = share_f32(eb, 19 * SEG, SEG, 2, 1024, 0, 0, NULL);
    cmd = torch_cmd(eb, &hb2, 1, 0, b_first, &e_len);
    CHECK(e_len == 18 + 8 * 20, "the torch_npu 'e' bytes of 20 segments are 178 long (%zu)", e_len);
    a = ask(&c2, "%s", cmd);
    CHECK(strncmp(a, "OK 2048 0", 9) == 0, "devshare_import_torch with the 20-segment 'e' bytes reads right (%s)", a);
    /* Shareable handles are global (no pid in the registry key): the tuple names the same pages
     * as the devshare handle, so it shares that import's mapping. */
    CHECK(stats_are(&c2, 1, 20, 20), "the torch_npu-style import of the same pages shares the mapping");
    a = ask(&c2, "release");
    CHECK(strcmp(a, "OK 2") == 0 && stats_are(&c2, 0, 0, 0), "released: nothing imported, reserved or mapped");
    CHECK(outstanding(eb) == 0, "both B references came back");

    /* --- C: 6 segments exported as two overlapping storages, [0..4) and [2..6). --- */
    const uint64_t c_first = 500;
    VmmAlloc C = vmm_alloc(6, c_first);
    DevshareExporter *ec1 = NULL, *ec2 = NULL;
    DS_OK(devshare_export_segments(DEVSHARE_BACKEND_ACL, 0, C.base, C.phys_u64, 4, SEG, DEVSHARE_EXPORT_NO_PID_CHECK,
                                   &ec1));
    DS_OK(devshare_export_segments(DEVSHARE_BACKEND_ACL, 0, (char *)C.base + 2 * SEG, C.phys_u64 + 2, 4, SEG,
                                   DEVSHARE_EXPORT_NO_PID_CHECK, &ec2));
    DevshareHandle hc1 = share_f32(ec1, 0, 4 * SEG, 2048, 1024, 0, 0, NULL);
    DevshareHandle hc2 = share_f32(ec2, 0, 4 * SEG, 2048, 1024, 0, 0, NULL);
    CHECK(table_entry(&hc1, 2) == table_entry(&hc2, 0) && table_entry(&hc1, 3) == table_entry(&hc2, 1),
          "a physical handle exported twice has one shareable handle (the export is cached)");
    a = import_cmd(&c2, &hc1, -1, 0, 1, 0, c_first);
    CHECK(strncmp(a, "OK 2097152 0", 12) == 0, "storage [0..4) reads right (%s)", a);
    a = import_cmd(&c2, &hc2, -1, 0, 1, 1, c_first + 2 * SEG / 4);
    CHECK(strncmp(a, "OK 2097152 0", 12) == 0, "storage [2..6) reads right (%s)", a);
    CHECK(check_writes((char *)C.base + 2 * SEG, &hc2, c_first + 2 * SEG / 4),
          "the consumer's writes through the second storage are in the producer's memory");
    CHECK(stats_are(&c2, 2, 8, 6), "two reservations, 8 mappings, but the 2 shared pages imported once: 6 handles");
    CHECK(aclsi_vmm_open_imports(table_entry(&hc2, 0)) == 1 && aclsi_vmm_open_imports(table_entry(&hc1, 0)) == 1,
          "a shared page has one live import in the consumer");
    a = ask(&c2, "release");
    CHECK(strcmp(a, "OK 2") == 0 && stats_are(&c2, 0, 0, 0), "both released: every page freed once");
    CHECK(outstanding(ec1) == 0 && outstanding(ec2) == 0, "both references came back");
    CHECK(finish(&c2), "the second consumer exits cleanly");

    DS_OK(devshare_exporter_close(ea, 0));
    DS_OK(devshare_exporter_close(eb, 0));
    DS_OK(devshare_exporter_close(ec1, 0));
    DS_OK(devshare_exporter_close(ec2, 0));
    CHECK(aclsi_vmm_physical_handles() == 4 + 20 + 6, "closing the exporters left the producer's memory alone");
    vmm_free(&A);
    vmm_free(&B);
    vmm_free(&C);
    CHECK(aclsi_vmm_physical_handles() == 0 && aclsi_vmm_mappings() == 0 && aclsi_vmm_reservations() == 0,
          "the producer freed everything");

    /* --- D: new physical memory after the frees. Handle values may be reused by the runtime;
     * devshare cannot see frees, so a retired physical handle is exported afresh when it can be
     * (a stale cached shareable handle would name freed memory). --- */
    VmmAlloc D = vmm_alloc(4, 77);
    int reused = 0;
    const VmmAlloc *before[3] = {&A, &B, &C};
    for (size_t i = 0; i < D.n; i++) {
        for (int k = 0; k < 3; k++) {
            for (size_t j = 0; j < before[k]->n; j++) {
                reused += D.phys_u64[i] == before[k]->phys_u64[j];
            }
        }
    }
    DevshareExporter *ed = NULL;
    DS_OK(devshare_export_segments(DEVSHARE_BACKEND_ACL, 0, D.base, D.phys_u64, D.n, SEG, DEVSHARE_EXPORT_NO_PID_CHECK,
                                   &ed));
    DevshareHandle hd = share_f32(ed, SEG + 4096, 2 * SEG, 512, 1024, 3, 0, NULL);
    CHECK(table_entry(&hd, 0) != table_entry(&h1, 0) && table_entry(&hd, 3) != table_entry(&h1, 3),
          "re-allocated physical memory gets new shareable handles (%d handle values reused)", reused);
    Child c3 = spawn(NULL, NULL);
    a = import_cmd(&c3, &hd, -1, 0, 0, 0, 77);
    CHECK(strncmp(a, "OK 524288 0", 11) == 0, "a consumer imports the re-allocated memory and reads it (%s)", a);
    CHECK(stats_are(&c3, 0, 0, 0), "... and releases it");
    CHECK(finish(&c3), "the third consumer exits cleanly");
    DS_OK(devshare_exporter_close(ed, 0));
    vmm_free(&D);

    harness_check_log(aclsi_violation_count(), "the ACL stand-in");
    return harness_done();
}
