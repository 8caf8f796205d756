/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_acl: the acl backend between separate processes, over the strict ACL stand-in runtime
 * (tests/standin/acl), which records every documented rule a caller breaks.
 *
 * The parent allocates device memory with aclrtMalloc, fills it (float i at element i of the
 * allocation), exports it with devshare and hands handles to consumer children. A consumer is
 * this program re-executed with "--child": it prints its pid (devshare_local_pid, the bare
 * tgid on Ascend) and then serves commands, one line each:
 *   import <device|-1> <flags> <hold 0|1> <handle text>  -> "OK <numel>" / "ERR <status> <msg>"
 *   tuple <handle hex> <size> <offset> <ref|-> <slot> <event hex|-> <sync> <numel>
 *                                                       -> devshare_import_torch of an 8-tuple
 *   npu_event <64-byte hex>                              -> torch_npu's consumer steps on an event
 *   release                                               -> "OK <n released>"
 *   quit
 * It reads every imported tensor back through aclrtMemcpy (D2D into its own memory first when
 * the import is on another device) and checks element k == data offset / 4 + k.
 *
 * Cases: small and misaligned ranges are refused before ACL is called; pid whitelist (refused,
 * then allowed; getpid() instead of the bare tgid is refused); several tensors packed in one
 * allocation read back at the right offsets; closes == imports; the exporter cannot close while
 * a consumer holds a reference (memory intact) and can after the release; cross-device import
 * with the import flag, with the explicit peer-access call, and refused without peer access;
 * an IPC event recorded on a stream and waited on by the consumer; torch_npu v26 8-tuples (a
 * raw ACL_EVENT_IPC event in slot 6, slot 7 True: waited on exactly once before the reference
 * goes back), pre-v26 ones (8 garbage event bytes, False: ignored), and a devshare event in the
 * v26 form opened by torch_npu's own consumer steps (open, stream wait, destroy); a duplicate arrival and a
 * duplicate import each return exactly one reference; an export without pid validation.
 * At the end the stand-in's violation log must be empty.
 *
 * Needs DEVSHARE_ACL_LIBRARY pointing at the stand-in (CTest sets it).
 */
#define _GNU_SOURCE

#include "acl_standin.h"
#define HARNESS_NAME "test_acl"
#include "device_harness.h"

#define ACL_OK(call)                                                                                              \
    do {                                                                                                          \
        aclError rc_ = (call);                                                                                    \
        if (rc_ != ACL_SUCCESS) {                                                                                 \
            fprintf(stderr, "test_acl: %s = %d (%s)\n", #call, rc_, aclGetRecentErrMsg());                        \
            exit(2);                                                                                              \
        }                                                                                                         \
    } while (0)

/* ---------------------------------------------------------------------------------------- */
/* Child: a consumer serving commands */

/* Read a contiguous float32 tensor of an import back to the host and check its values. */
static int child_verify(DevshareImport *imp, int32_t exporter_device, char *why, size_t cap) {
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
            ACL_OK(aclrtMalloc(&local, 2 * MIB, ACL_MEM_MALLOC_HUGE_FIRST));
            ACL_OK(aclrtMemcpy(local, 2 * MIB, info.data, bytes, ACL_MEMCPY_DEVICE_TO_DEVICE));
            ACL_OK(aclrtMemcpy(host, bytes, local, bytes, ACL_MEMCPY_DEVICE_TO_HOST));
            ACL_OK(aclrtFree(local));
        }
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

/* "tuple <handle hex> <storage_size> <storage_offset> <ref name|-> <ref slot> <event hex|-> <sync>
 * <numel>": a torch_npu _share_npu_ 8-tuple of a float32 vector, imported with
 * devshare_import_torch (which waits on the event when sync is 1), checked, released. */
static void child_tuple(const char *args) {
    char handle_hex[512], ref[80], event_hex[512];
    unsigned long long size = 0, offset = 0, slot = 0;
    int sync = 0;
    long long numel = 0;
    uint8_t handle[256], event[256];
    if (sscanf(args, "%511s %llu %llu %79s %llu %511s %d %lld", handle_hex, &size, &offset, ref, &slot, event_hex,
               &sync, &numel) != 8) {
        printf("ERR 0 bad tuple command\n");
        return;
    }
    const int handle_len = hex_decode(handle_hex, handle, sizeof handle);
    const int event_len = hex_decode(event_hex, event, sizeof event);
    DevshareTorchArgs a;
    DS_OK(devshare_torch_args_init(&a, sizeof a));
    const int64_t shape[1] = {numel};
    a.backend = DEVSHARE_BACKEND_ACL;
    a.dtype = (DevshareDType){DEVSHARE_DTYPE_FLOAT, 32, 1};
    a.ndim = 1;
    a.shape = shape;
    a.handle = handle;
    a.handle_len = handle_len < 0 ? 0 : (size_t)handle_len;
    a.storage_size = size;
    a.storage_offset = offset;
    a.ref_name = (const uint8_t *)(strcmp(ref, "-") ? ref : "");
    a.ref_name_len = strcmp(ref, "-") ? strlen(ref) : 0;
    a.ref_slot = slot;
    a.event_handle = event;
    a.event_handle_len = event_len < 0 ? 0 : (size_t)event_len;
    a.event_sync_required = (uint32_t)sync;
    DevshareImport *imp = NULL;
    const int32_t st = devshare_import_torch(&a, NULL, &imp);
    if (st != DEVSHARE_STATUS_OK) {
        printf("ERR %d %s\n", st, last_error());
        return;
    }
    char why[256] = "";
    if (!child_verify(imp, 0, why, sizeof why)) {
        printf("ERR 0 data: %s\n", why);
    } else {
        printf("OK %lld\n", numel);
    }
    DS_OK(devshare_import_release(imp));
}

/* "npu_event <64-byte hex>": what a stock torch_npu v26 consumer does with slot 6 when slot 7 is
 * True — aclrtIpcOpenEventHandle (by value), aclrtStreamWaitEvent on its stream, aclrtDestroyEvent. */
static void child_npu_event(const char *hex) {
    aclrtIpcEventHandle h;
    if (hex_decode(hex, (uint8_t *)&h, sizeof h) != (int)sizeof h) {
        printf("ERR 0 not 64 bytes\n");
        return;
    }
    aclrtEvent ev = NULL;
    aclrtStream stream = NULL;
    aclError rc = aclrtIpcOpenEventHandle(h, &ev);
    if (rc == ACL_SUCCESS) {
        ACL_OK(aclrtCreateStream(&stream));
        rc = aclrtStreamWaitEvent(stream, ev);
        const aclError d = aclrtDestroyEvent(ev);
        rc = rc != ACL_SUCCESS ? rc : d;
        ACL_OK(aclrtDestroyStream(stream));
    }
    if (rc != ACL_SUCCESS) {
        printf("ERR %d %s\n", (int)rc, aclGetRecentErrMsg());
    } else {
        printf("OK\n");
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
    char line[2048];
    while (read_line_fd(0, line, sizeof line, IO_TIMEOUT_MS) > 0) {
        if (strncmp(line, "import ", 7) == 0) {
            int device = 0, hold = 0;
            unsigned flags = 0;
            int used = 0;
            if (sscanf(line + 7, "%d %u %d %n", &device, &flags, &hold, &used) != 3) {
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
                st = devshare_import(&h, &o, &imp);
            }
            if (st != DEVSHARE_STATUS_OK) {
                printf("ERR %d %s\n", st, last_error());
            } else {
                char why[256] = "";
                DevshareImportInfo info;
                DS_OK(devshare_import_info_init(&info, sizeof info));
                DS_OK(devshare_import_info(imp, &info));
                if (!child_verify(imp, h.device_index, why, sizeof why)) {
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
        } else if (strncmp(line, "tuple ", 6) == 0) {
            child_tuple(line + 6);
        } else if (strncmp(line, "npu_event ", 10) == 0) {
            child_npu_event(line + 10);
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
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Parent side of a child */

static const char *import_cmd(Child *c, const DevshareHandle *h, int device, unsigned flags, int hold) {
    char text[DEVSHARE_HANDLE_MAX_TEXT_SIZE];
    DS_OK(devshare_handle_to_text(h, text, sizeof text, NULL));
    return ask(c, "import %d %u %d %s", device, flags, hold, text);
}

static int ts_same_key(const DevshareHandle *a, const DevshareHandle *b) {
    return a->key_len == b->key_len && memcmp(a->key, b->key, a->key_len) == 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--child") == 0) {
        return child_main();
    }
    if (!getenv("DEVSHARE_ACL_LIBRARY")) {
        fprintf(stderr, "test_acl: set DEVSHARE_ACL_LIBRARY to the stand-in libascendcl.so\n");
        return 2;
    }
    harness_start("test_acl");

    DevshareBackendInfo bi;
    DS_OK(devshare_backend_info_init(&bi, sizeof bi));
    DS_OK(devshare_probe(DEVSHARE_BACKEND_ACL, &bi));
    CHECK(bi.usable == 1, "probe: acl usable over the stand-in (%s)", bi.detail);

    const aclError init = aclInit(NULL); /* devshare's probe initialised ACL already */
    CHECK(init == ACL_ERROR_REPEAT_INITIALIZE, "devshare called aclInit once (a second call reports %d)", init);
    ACL_OK(aclrtSetDevice(0));

    /* Refusals before ACL is called. */
    void *small = NULL;
    ACL_OK(aclrtMalloc(&small, 4096, ACL_MEM_MALLOC_HUGE_FIRST));
    DevshareExporter *e = NULL;
    int32_t st = devshare_export(DEVSHARE_BACKEND_ACL, 0, small, 4096, 0, &e);
    CHECK(st == DEVSHARE_STATUS_INVALID_ARGUMENT && strstr(last_error(), "2 MiB") && strstr(last_error(), "HUGE"),
          "a small pooled buffer is refused, saying to allocate >= 2 MiB with a HUGE policy (%s)", last_error());
    ACL_OK(aclrtFree(small));

    /* One 2 MiB allocation, float i at element i. */
    const size_t size = 2 * MIB;
    void *dev = NULL;
    ACL_OK(aclrtMalloc(&dev, size, ACL_MEM_MALLOC_HUGE_FIRST));
    float *host = malloc(size);
    for (size_t i = 0; i < size / 4; i++) {
        host[i] = (float)i;
    }
    ACL_OK(aclrtMemcpy(dev, size, host, size, ACL_MEMCPY_HOST_TO_DEVICE));
    st = devshare_export(DEVSHARE_BACKEND_ACL, 0, (char *)dev + 512, size - 4096, 0, &e);
    CHECK(st == DEVSHARE_STATUS_INVALID_ARGUMENT && strstr(last_error(), "aligned"),
          "a misaligned range is refused naming page alignment");
    DS_OK(devshare_export(DEVSHARE_BACKEND_ACL, 0, dev, size, 0, &e));
    DevshareExporter *e_again = NULL;
    DS_OK(devshare_export(DEVSHARE_BACKEND_ACL, 0, dev, size, 0, &e_again));
    DevshareHandle h_again;
    DS_OK(devshare_exporter_share(e_again, NULL, &h_again));
    DevshareHandle h1 = share_f32(e, 0, 4096, 16, 64, 0, 0, NULL);
    CHECK(memcmp(h_again.key, h1.key, sizeof h1.key) == 0, "exporting the same range twice reuses its key");
    DS_OK(devshare_exporter_close(e_again, DEVSHARE_CLOSE_FORCE)); /* its reference was never sent */

    /* Pid whitelist. */
    Child c1 = spawn(NULL, NULL);
    CHECK(c1.bare_tgid != c1.os_pid, "the consumer's bare tgid (%d) differs from getpid (%d) in the stand-in",
          c1.bare_tgid, c1.os_pid);
    const char *a = import_cmd(&c1, &h1, -1, 0, 0);
    CHECK(strncmp(a, "ERR -34", 7) == 0 && strstr(a, "207006") && strstr(a, "devshare_exporter_allow_pid"),
          "a consumer not on the whitelist is refused with the vendor code and what to do (%s)", a);
    Child c2 = spawn(NULL, NULL);
    DS_OK(devshare_exporter_allow_pid(e, c2.os_pid));
    a = import_cmd(&c2, &h1, -1, 0, 0);
    CHECK(strncmp(a, "ERR -34", 7) == 0, "whitelisting getpid() instead of the bare tgid does not let it in");
    CHECK(finish(&c2), "second consumer exits cleanly");
    DS_OK(devshare_exporter_allow_pid(e, c1.bare_tgid));
    a = import_cmd(&c1, &h1, -1, 0, 0);
    CHECK(strncmp(a, "OK 1024", 7) == 0, "the whitelisted consumer imports and reads the data (%s)", a);
    CHECK(outstanding(e) == 0, "the refused imports kept nothing and the release returned the reference");

    /* Several tensors packed in one allocation. */
    DevshareHandle h2 = share_f32(e, 8192, 8192, 4, 100, 7, 0, NULL);
    DevshareHandle h3 = share_f32(e, MIB + 4096, MIB - 4096, 3, 33, 1000, 0, NULL);
    a = import_cmd(&c1, &h2, -1, 0, 1);
    CHECK(strncmp(a, "OK 400", 6) == 0, "tensor 2 (storage 8192, tensor offset 7) reads back right (%s)", a);
    a = import_cmd(&c1, &h3, -1, 0, 1);
    CHECK(strncmp(a, "OK 99", 5) == 0, "tensor 3 (storage 1 MiB + 4 KiB, tensor offset 1000) reads back right (%s)", a);
    char key[DEVSHARE_KEY_CAPACITY + 1] = {0};
    memcpy(key, h1.key, 65);
    CHECK(aclsi_open_imports(key) == 1, "two live imports of one key are one ACL import (%d)", aclsi_open_imports(key));
    CHECK(outstanding(e) == 2, "two references outstanding while held");

    /* Close order. */
    st = devshare_exporter_close(e, 0);
    CHECK(st == DEVSHARE_STATUS_BUSY, "the exporter cannot close while references are outstanding (%s)",
          devshare_status_str(st));
    a = import_cmd(&c1, &h3, -1, 0, 0);
    CHECK(strncmp(a, "ERR -37", 7) != 0 && strncmp(a, "OK", 2) == 0,
          "the memory is intact after the refused close (the held handle imports again)");
    a = ask(&c1, "release");
    CHECK(strcmp(a, "OK 2") == 0, "the consumer releases both");
    CHECK(outstanding(e) == 0 && aclsi_open_imports(key) == 0, "closes == imports: no reference and no ACL import left");

    /* torch_npu tuples: each tells only where its own storage ends (alloc_size), so a later
     * storage of the same key lies beyond what the first import of the key was told. */
    DevshareHandle ta, tb;
    {
        const DevshareHandle src[2] = {share_f32(e, 0, 4096, 4, 256, 0, 0, NULL),
                                       share_f32(e, MIB, 4096, 2, 512, 0, 0, NULL)};
        DevshareHandle *dst[2] = {&ta, &tb};
        for (int i = 0; i < 2; i++) {
            DevshareTorchStorage ts;
            DS_OK(devshare_torch_storage_init(&ts, sizeof ts));
            DS_OK(devshare_handle_to_torch(&src[i], &ts));
            DevshareTorchArgs targs;
            DS_OK(devshare_torch_args_init(&targs, sizeof targs));
            targs.backend = DEVSHARE_BACKEND_ACL;
            targs.dtype = src[i].dtype;
            targs.ndim = src[i].ndim;
            targs.shape = src[i].shape;
            targs.device = ts.device;
            targs.handle = ts.handle;
            targs.handle_len = ts.handle_len;
            targs.storage_size = ts.storage_size;
            targs.storage_offset = ts.storage_offset;
            targs.ref_name = ts.ref_name;
            targs.ref_name_len = ts.ref_name_len;
            targs.ref_slot = ts.ref_slot;
            DS_OK(devshare_handle_from_torch(&targs, dst[i]));
        }
    }
    CHECK(ta.alloc_size == 4096 && tb.alloc_size == MIB + 4096 && ts_same_key(&ta, &tb),
          "two torch_npu-style handles of one key know only their own storage's end");
    a = import_cmd(&c1, &ta, -1, 0, 1);
    CHECK(strncmp(a, "OK 1024", 7) == 0, "the first storage of the key imports (%s)", a);
    a = import_cmd(&c1, &tb, -1, 0, 1);
    CHECK(strncmp(a, "OK 1024", 7) == 0, "a later storage beyond the first one's end imports from the cached key (%s)", a);
    a = ask(&c1, "release");
    CHECK(strcmp(a, "OK 2") == 0, "both torch_npu-style imports release");

    /* Cross-device. */
    DevshareHandle hx = share_f32(e, 0, 4096, 8, 8, 0, 0, NULL);
    a = import_cmd(&c1, &hx, 1, DEVSHARE_IMPORT_NO_PEER_ACCESS, 0);
    CHECK(strncmp(a, "ERR -34", 7) == 0 && strstr(a, "507899"),
          "an import on device 1 without peer access fails with the driver error (%s)", a);
    a = import_cmd(&c1, &hx, 1, 0, 0);
    CHECK(strncmp(a, "OK 64 1", 7) == 0, "an import on device 1 with the enable-peer-access flag reads right (%s)", a);
    DevshareHandle hy = share_f32(e, 0, 4096, 8, 8, 0, 0, NULL);
    a = import_cmd(&c1, &hy, 1, DEVSHARE_IMPORT_PEER_ACCESS_CALL, 0);
    CHECK(strncmp(a, "OK 64 1", 7) == 0, "an import on device 1 after aclrtDeviceEnablePeerAccess reads right (%s)", a);

    /* Events: the data is produced on a stream, the consumer waits on the recorded event. */
    aclrtStream stream = NULL;
    ACL_OK(aclrtCreateStream(&stream));
    DevshareHandle he = share_f32(e, 4096, 4096, 32, 32, 0, DEVSHARE_SHARE_EVENT, stream);
    CHECK((he.flags & DEVSHARE_HANDLE_FLAG_EVENT) != 0, "a share with DEVSHARE_SHARE_EVENT carries an event");
    a = import_cmd(&c1, &he, -1, 0, 0);
    CHECK(strncmp(a, "OK 1024", 7) == 0, "the consumer waits on the event and reads right (%s)", a);

    /* torch_npu v26 tuples (interop.md section 5): slot 6 a real 64-byte aclrtIpcEventHandle and
     * slot 7 True. A torch_npu producer makes it with raw ACL calls: an ACL_EVENT_IPC event,
     * recorded on its stream, aclrtIpcGetEventHandle. The devshare consumer opens it, makes its
     * stream wait, destroys it, before returning the reference (the stand-in checks the order). */
    {
        DevshareHandle hv = share_f32(e, 8192, 4096, 32, 32, 0, 0, NULL);
        DevshareTorchStorage ts;
        DS_OK(devshare_torch_storage_init(&ts, sizeof ts));
        DS_OK(devshare_handle_to_torch_as(&hv, DEVSHARE_TORCH_FORMAT_V1, &ts));
        aclrtEvent ev = NULL;
        ACL_OK(aclrtCreateEventExWithFlag(&ev, ACL_EVENT_IPC));
        ACL_OK(aclrtRecordEvent(ev, stream));
        aclrtIpcEventHandle eh;
        ACL_OK(aclrtIpcGetEventHandle(ev, &eh));
        char hhex[2 * 256 + 1], ehex[2 * 64 + 1];
        hex_encode(ts.handle, ts.handle_len, hhex);
        hex_encode((const uint8_t *)&eh, sizeof eh, ehex);
        char ref[80];
        memcpy(ref, ts.ref_name, ts.ref_name_len);
        ref[ts.ref_name_len] = 0;
        const int waits = aclsi_event_waits(ev);
        a = ask(&c1, "tuple %s %llu %llu %s %llu %s 1 1024", hhex, (unsigned long long)ts.storage_size,
                (unsigned long long)ts.storage_offset, ref, (unsigned long long)ts.ref_slot, ehex);
        CHECK(strncmp(a, "OK 1024", 7) == 0, "a torch_npu v26 tuple with an event imports and reads right (%s)", a);
        CHECK(aclsi_event_waits(ev) == waits + 1, "the consumer waited on the producer's event exactly once (%d -> %d)",
              waits, aclsi_event_waits(ev));
        CHECK(slot_value(&hv) == 0, "and returned the tuple's reference after the wait");
        ACL_OK(aclrtDestroyEvent(ev));

        /* Pre-v26: slot 6 is sizeof(aclrtNotify) uninitialised bytes, slot 7 False: ignored
         * whatever their length (the stand-in would flag any open of them). */
        DevshareHandle hp = share_f32(e, 8192, 4096, 32, 32, 0, 0, NULL);
        DS_OK(devshare_handle_to_torch_as(&hp, DEVSHARE_TORCH_FORMAT_V1, &ts));
        hex_encode(ts.handle, ts.handle_len, hhex);
        memcpy(ref, ts.ref_name, ts.ref_name_len);
        ref[ts.ref_name_len] = 0;
        a = ask(&c1, "tuple %s %llu %llu %s %llu %s 0 1024", hhex, (unsigned long long)ts.storage_size,
                (unsigned long long)ts.storage_offset, ref, (unsigned long long)ts.ref_slot, "deadbeefdeadbeef");
        CHECK(strncmp(a, "OK 1024", 7) == 0, "a pre-v26 tuple with 8 garbage event bytes and False imports (%s)", a);
        CHECK(slot_value(&hp) == 0, "and returns its reference");

        /* The other direction: a devshare producer sends a real event (DEVSHARE_SHARE_EVENT) in
         * the v26 form, which a stock torch_npu consumer opens and waits on; without the flag it
         * synchronised instead and slot 7 is False with zero bytes. */
        DevshareHandle hd = share_f32(e, 8192, 4096, 32, 32, 0, DEVSHARE_SHARE_EVENT, stream);
        DS_OK(devshare_handle_to_torch_as(&hd, DEVSHARE_TORCH_FORMAT_V1, &ts));
        CHECK(ts.event_sync_required == 1 && memcmp(ts.event_handle, hd.event_handle, 64) == 0,
              "a devshare share with an event gives slot 7 True and its 64-byte event in slot 6");
        hex_encode(ts.event_handle, 64, ehex);
        a = ask(&c1, "npu_event %s", ehex);
        CHECK(strcmp(a, "OK") == 0, "torch_npu's consumer steps (open, stream wait, destroy) accept it (%s)", a);
        DevshareHandle hs = share_f32(e, 8192, 4096, 32, 32, 0, 0, NULL);
        DS_OK(devshare_handle_to_torch_as(&hs, DEVSHARE_TORCH_FORMAT_V1, &ts));
        int zero = 1;
        for (int i = 0; i < 64; i++) {
            zero &= ts.event_handle[i] == 0;
        }
        CHECK(ts.event_sync_required == 0 && zero, "a share without an event: slot 7 False, slot 6 zero");
        /* Hand the two tuples' references back: no consumer opens them. */
        DS_OK(devshare_handle_discard(&hd));
        DS_OK(devshare_handle_discard(&hs));
    }

    /* Duplicate arrival: two handles for one storage, and one handle imported twice. */
    DevshareHandle d1 = share_f32(e, 0, 4096, 4, 4, 0, 0, NULL);
    DevshareHandle d2 = share_f32(e, 0, 4096, 4, 4, 0, 0, NULL);
    import_cmd(&c1, &d1, -1, 0, 1);
    import_cmd(&c1, &d2, -1, 0, 1);
    import_cmd(&c1, &d2, -1, 0, 1);
    CHECK(outstanding(e) == 2, "a duplicate import of one handle holds its single reference");
    CHECK(slot_value(&d1) == 1 && slot_value(&d2) == 1, "both slots are 1 while held");
    ask(&c1, "release");
    CHECK(outstanding(e) == 0 && slot_value(&d1) == 0 && slot_value(&d2) == 0,
          "each arrival returned exactly once: both slots exactly 0, not below (%" PRId64 ", %" PRId64 ")",
          slot_value(&d1), slot_value(&d2));

    /* No pid validation: anyone may import. */
    void *dev2 = NULL;
    ACL_OK(aclrtMalloc(&dev2, size, ACL_MEM_MALLOC_HUGE_FIRST));
    ACL_OK(aclrtMemcpy(dev2, size, host, size, ACL_MEMCPY_HOST_TO_DEVICE));
    DevshareExporter *open_e = NULL;
    DS_OK(devshare_export(DEVSHARE_BACKEND_ACL, 0, dev2, size, DEVSHARE_EXPORT_NO_PID_CHECK, &open_e));
    DevshareHandle ho = share_f32(open_e, 0, 4096, 2, 2, 0, 0, NULL);
    Child c3 = spawn(NULL, NULL);
    a = import_cmd(&c3, &ho, -1, 0, 0);
    CHECK(strncmp(a, "OK 4", 4) == 0, "without pid validation an unlisted consumer imports (%s)", a);
    CHECK(finish(&c3), "third consumer exits cleanly");

    CHECK(finish(&c1), "first consumer exits cleanly");
    DS_OK(devshare_exporter_close(e, 0));
    DS_OK(devshare_exporter_close(open_e, 0));
    CHECK(aclsi_key_closed(key) != 0 || aclsi_open_imports(key) < 0, "closing the last exporter closed the key");
    ACL_OK(aclrtFree(dev));
    ACL_OK(aclrtFree(dev2));
    free(host);

    CHECK(aclsi_set_device_calls() <= 2,
          "devshare made device 0's default context once, then switched contexts (%d aclrtSetDevice calls, "
          "one of them the test's)", aclsi_set_device_calls());
    harness_check_log(aclsi_violation_count(), "the ACL stand-in");
    return harness_done();
}
