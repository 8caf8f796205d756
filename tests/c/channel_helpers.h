/* SPDX-License-Identifier: Apache-2.0 */
/*
 * channel_helpers.h: the machinery of test_channel.c, which then holds only its cases: the
 * consumer child, the producer child of the producer-death case, the parent's side of both
 * (spawning, commands and answers, /dev/shm tracking), the pool and peer helpers the cases share,
 * and the CUDA stand-in helpers (VMM buffers, a consumer's driver state, live IPC events).
 *
 * A consumer child (test_channel re-executed with "--child host|acl|cuda": a fresh process
 * image, only the pipes are inherited) prints "PID <pid>" and then answers one line per command
 * on its stdout, always starting with "R":
 *   connect <address> <timeout>   -> R <status> <message>
 *   recv <n> <hold 0|1> <timeout> -> R <got> <pool items> <leases> <address changes>
 *                                      <bad data> <bad order> <failed releases> <status>
 *                                      <slots seen> <odd kinds> <events> <events waited once>
 *        (every item: its kind from devshare_import_pool_slot, the data pointer of each pool
 *         slot compared with the one recorded on its first arrival, the pool's base, the data
 *         read back over the whole storage (device memory through aclrtMemcpy / cuMemcpyDtoH),
 *         and for a handle with an interprocess event: the event opened again from its bytes
 *         and the stand-in's count of waits on it read, which devshare_connection_recv must
 *         have made exactly 1; then held or released)
 *   cuda_state  -> R <reservations> <mappings> <handle refs> <imported handles> <allocations>
 *                    <open fds> <violations> <IPC events opened and not destroyed>
 *                    (the CUDA stand-in's state of the consumer)
 *   lease_opens -> R <live IPC opens of the last lease's cuMemAlloc allocation, all processes>
 *   getfd <pid> <fd> -> R <0 | errno>   (pidfd_getfd of another process's fd, tried here)
 *   release <k> / release_later <ms> <k> / read / close / memfds / import <text> /
 *   exit_holding / quit
 * A cuda consumer drops CAP_SYS_PTRACE first, so the kernel's ordinary ptrace rules apply to
 * it even when the tests run as root.
 *
 * Include in test_channel.c only (everything here is static), after defining _GNU_SOURCE and
 * HARNESS_NAME.
 */
#ifndef DEVSHARE_TEST_CHANNEL_HELPERS_H
#define DEVSHARE_TEST_CHANNEL_HELPERS_H

#include "channel_harness.h"

#include "acl_standin.h"
#include "cuda_standin.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <linux/capability.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum {
    IO_MS = 20000,         /* bound on every wait for a peer or a child's answer */
    CHILD_IDLE_MS = 120000, /* a child with no command for this long exits */
    MAX_TRACKED = 64,
};

/* ---------------------------------------------------------------------------------------- */
/* Text */

/* `text` into buf, cut to fit. */
static void copy_text(char *buf, size_t cap, const char *text) {
    size_t n = strlen(text);
    if (n >= cap) {
        n = cap - 1;
    }
    memcpy(buf, text, n);
    buf[n] = '\0';
}

/* ---------------------------------------------------------------------------------------- */
/* Items (channel_harness.h), in host or device memory */

static int g_acl; /* this process reads and writes device memory through ACL */

static void acl_or_die(aclError rc, const char *what) {
    if (rc != ACL_SUCCESS) {
        fprintf(stderr, "test_channel: %s = %d (%s)\n", what, rc, aclGetRecentErrMsg());
        exit(2);
    }
}

static int g_cuda; /* this process reads and writes device memory through the CUDA driver */

static void cu_or_die(CUresult rc, const char *what) {
    if (rc != CUDA_SUCCESS) {
        fprintf(stderr, "test_channel: %s = %d\n", what, (int)rc);
        exit(2);
    }
}

/* Device 0's primary context, current on this thread. */
static void cuda_make_current(void) {
    static CUcontext ctx;
    if (!ctx) {
        CUdevice dev;
        cu_or_die(cuDeviceGet(&dev, 0), "cuDeviceGet(0)");
        cu_or_die(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    }
    cu_or_die(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
}

static void item_fill(void *p, uint64_t size, uint64_t seq) {
    if (!g_acl && !g_cuda) {
        item_fill_host(p, size, seq, NULL);
        return;
    }
    uint8_t *staging = malloc((size_t)size);
    item_fill_host(staging, size, seq, NULL);
    if (g_cuda) {
        cu_or_die(cuMemcpyHtoD((CUdeviceptr)(uintptr_t)p, staging, (size_t)size), "cuMemcpyHtoD");
    } else {
        acl_or_die(aclrtMemcpy(p, (size_t)size, staging, (size_t)size, ACL_MEMCPY_HOST_TO_DEVICE), "aclrtMemcpy H2D");
    }
    free(staging);
}

static int item_check(const void *p, uint64_t size, uint64_t *seq_out) {
    if (!g_acl && !g_cuda) {
        return item_check_host(p, size, seq_out, NULL);
    }
    uint8_t *staging = malloc((size_t)size);
    if (g_cuda) {
        cu_or_die(cuMemcpyDtoH(staging, (CUdeviceptr)(uintptr_t)p, (size_t)size), "cuMemcpyDtoH");
    } else {
        acl_or_die(aclrtMemcpy(staging, (size_t)size, p, (size_t)size, ACL_MEMCPY_DEVICE_TO_HOST), "aclrtMemcpy D2H");
    }
    const int ok = item_check_host(staging, size, seq_out, NULL);
    free(staging);
    return ok;
}

/* How often the consumer waited on the latest record of the interprocess event in `bytes` (a
 * handle's event_handle): the event is opened again here, its counts read from the stand-in,
 * then waited on and destroyed as the driver's rules ask. A producer reuses events (one per
 * stream of a send, recorded again for a later one), so the stand-in's counters are the
 * event's whole life: the waits this helper made itself are taken off, and so is one wait
 * for each earlier record (each checked here to have had its one). -1 when it cannot be opened
 * (the producer destroyed it). */
static int event_waits(const uint8_t *bytes) {
    static struct {
        uint8_t bytes[64];
        int own; /* waits this helper made on it */
    } seen[256];
    static int n_seen;
    int i = 0;
    while (i < n_seen && memcmp(seen[i].bytes, bytes, 64) != 0) {
        i++;
    }
    if (i == n_seen && n_seen < (int)(sizeof seen / sizeof seen[0])) {
        memcpy(seen[n_seen++].bytes, bytes, 64);
    }
    int n = -1, records = -1;
    if (g_cuda) {
        CUipcEventHandle eh;
        memcpy(eh.reserved, bytes, sizeof eh.reserved);
        CUevent e = NULL;
        if (cuIpcOpenEventHandle(&e, eh) == CUDA_SUCCESS) {
            n = cusi_event_waits(e);
            records = cusi_event_records(e);
            cu_or_die(cuEventSynchronize(e), "cuEventSynchronize");
            cu_or_die(cuEventDestroy(e), "cuEventDestroy");
        }
    } else if (g_acl) {
        aclrtIpcEventHandle eh;
        memcpy(eh.reserved, bytes, sizeof eh.reserved);
        aclrtEvent e = NULL;
        if (aclrtIpcOpenEventHandle(eh, &e) == ACL_SUCCESS) {
            n = aclsi_event_waits(e);
            records = aclsi_event_records(e);
            acl_or_die(aclrtSynchronizeEvent(e), "aclrtSynchronizeEvent");
            acl_or_die(aclrtDestroyEvent(e), "aclrtDestroyEvent");
        }
    }
    if (n < 0 || i >= n_seen) {
        return n;
    }
    n -= seen[i].own + (records > 1 ? records - 1 : 0);
    seen[i].own++;
    return n;
}

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

/* Whether this process can take descriptor `fd` of process `pid` with pidfd_getfd (what a
 * segmented import falls back to when the fds do not travel with the item): 0, or the errno
 * that refused it. */
static int pidfd_getfd_errno(pid_t pid, int fd) {
    const int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    if (pidfd < 0) {
        return errno;
    }
    const int got = (int)syscall(SYS_pidfd_getfd, pidfd, fd, 0);
    const int err = got < 0 ? errno : 0;
    if (got >= 0) {
        close(got);
    }
    close(pidfd);
    return err;
}

/* A 1-D uint8 tensor of n bytes at `offset` in the allocation. */
static DevshareTensorDesc bytes_desc(uint64_t offset, const int64_t *n) {
    DevshareTensorDesc d;
    DS_OK(devshare_tensor_desc_init(&d, sizeof d));
    d.dtype.code = DEVSHARE_DTYPE_UINT;
    d.dtype.bits = 8;
    d.dtype.lanes = 1;
    d.ndim = 1;
    d.shape = n;
    d.storage_offset = offset;
    d.storage_size = (uint64_t)*n;
    return d;
}

/* ---------------------------------------------------------------------------------------- */
/* The consumer child */

typedef struct {
    uint32_t pool, slot;
    void *data;
} SlotSeen;

static SlotSeen seen[1024];
static int n_seen;
static struct {
    uint32_t pool;
    void *base;
} bases[64];
static int n_bases;

static DevshareImport *held[4096];
static int n_held;

/* Record a pool item's data pointer and base; 0 when either differs from an earlier item. */
static int note_slot(uint32_t pool, uint32_t slot, void *data, void *base) {
    int ok = 1, found = 0;
    for (int i = 0; i < n_seen; i++) {
        if (seen[i].pool == pool && seen[i].slot == slot) {
            found = 1;
            ok = ok && seen[i].data == data;
        } else if (seen[i].data == data) {
            ok = 0; /* two slots at one address */
        }
    }
    if (!found && n_seen < (int)(sizeof seen / sizeof seen[0])) {
        seen[n_seen++] = (SlotSeen){pool, slot, data};
    }
    found = 0;
    for (int i = 0; i < n_bases; i++) {
        if (bases[i].pool == pool) {
            found = 1;
            ok = ok && bases[i].base == base;
        }
    }
    if (!found && n_bases < (int)(sizeof bases / sizeof bases[0])) {
        bases[n_bases].pool = pool;
        bases[n_bases].base = base;
        n_bases++;
    }
    return ok;
}

static int import_readable(DevshareImport *imp) {
    DevshareImportInfo info;
    if (devshare_import_info_init(&info, sizeof info) != 0 || devshare_import_info(imp, &info) != 0) {
        return 0;
    }
    uint64_t seq;
    return item_check(info.storage, info.storage_size, &seq);
}

typedef struct {
    int got, pool, lease, addr_bad, data_bad, order_bad, rel_bad, st, slots, kind_bad;
    int events; /* items whose handle carries an interprocess event */
    int waited; /* ... that had been waited on exactly once when recv returned */
    long seq_sum; /* the sum of the sequence numbers the items read carried (item_fill) */
} RecvResult;

static DevshareHandle last_lease; /* the handle of the last lease received */

/* The layout_id of each pool item description seen (the DevshareItem with its import and
 * struct_size cleared): one description, one id; one id, one description. */
static struct {
    DevshareItem desc;
    uint64_t id;
} layouts[256];
static int n_layouts;

/* Whether item's layout_id agrees with every earlier one: the same id as the same description
 * had before, or an id no other description had. 0 for a lease, never for a pool item. */
static int layout_id_agrees(const DevshareItem *item) {
    if (item->pool == 0) {
        return item->layout_id == 0;
    }
    if (item->layout_id == 0) {
        return 0;
    }
    DevshareItem desc = *item;
    desc.struct_size = 0;
    desc.import = NULL;
    desc.layout_id = 0;
    for (int k = 0; k < n_layouts; k++) {
        const int same_desc = memcmp(&layouts[k].desc, &desc, sizeof desc) == 0;
        if (same_desc != (layouts[k].id == item->layout_id)) {
            return 0;
        }
        if (same_desc) {
            return 1;
        }
    }
    if (n_layouts < (int)(sizeof layouts / sizeof layouts[0])) {
        layouts[n_layouts].desc = desc;
        layouts[n_layouts].id = item->layout_id;
        n_layouts++;
    }
    return 1;
}

/* Receive n items (holding them or releasing each at once); also used by the parent. */
static RecvResult consume(DevshareConnection *conn, int n, int hold, int timeout_ms, char *msg, size_t msg_cap) {
    RecvResult r = {0};
    uint64_t last_seq = 0;
    msg[0] = '\0';
    /* Every other item comes through devshare_connection_recv_item or (in turn)
     * devshare_connection_recv_args, which also release the import before it (given back at
     * once, released by the next receive). */
    DevshareImport *given_back = NULL;
    DevshareRecvArgs args;
    devshare_recv_args_init(&args, sizeof args);
    args.conn = conn;
    for (int i = 0; i < n; i++) {
        DevshareImport *imp = NULL;
        DevshareItem item;
        const int as_item = i % 2 == 1;
        /* Every eighth item, a 1.7 caller's DevshareItem, which ends before layout_id. */
        const int old_caller = i % 8 == 1;
        const uint32_t item_size = old_caller ? (uint32_t)offsetof(DevshareItem, layout_id) : (uint32_t)sizeof item;
        int32_t st;
        if (as_item && i % 4 == 3) {
            args.timeout_ms = timeout_ms;
            args.release = given_back;
            st = devshare_connection_recv_args(&args);
            r.rel_bad += args.release != NULL; /* the call takes it (released, whatever it did) */
            given_back = NULL;
            item = args.item;
            imp = item.import;
        } else if (as_item) {
            devshare_item_init(&item, item_size);
            item.layout_id = 77; /* beyond a 1.7 caller's struct: never written there */
            st = devshare_connection_recv_item(conn, timeout_ms, given_back, &item);
            given_back = NULL; /* released, whatever the receive did */
            imp = item.import;
        } else {
            st = devshare_connection_recv(conn, timeout_ms, &imp);
        }
        if (st != DEVSHARE_STATUS_OK) {
            r.st = st;
            copy_text(msg, msg_cap, last_error());
            break;
        }
        r.got++;
        DevshareImportInfo info;
        if (devshare_import_info_init(&info, sizeof info) != 0 || devshare_import_info(imp, &info) != 0) {
            r.data_bad++;
            continue;
        }
        uint32_t pool = 0, slot = 0;
        const int32_t ps = devshare_import_pool_slot(imp, &pool, &slot);
        if (ps == DEVSHARE_STATUS_OK && pool > 0) {
            r.pool++;
            r.addr_bad += !note_slot(pool, slot, info.data, info.base);
        } else if (ps == DEVSHARE_STATUS_INVALID_ARGUMENT) {
            r.lease++;
        } else {
            r.kind_bad++;
        }
        uint64_t seq = 0;
        if (!item_check(info.storage, info.storage_size, &seq)) {
            r.data_bad++;
        } else {
            r.order_bad += seq <= last_seq;
            last_seq = seq;
            r.seq_sum += (long)seq;
        }
        DevshareHandle h;
        const int32_t hs = devshare_import_handle(imp, &h);
        /* devshare_import_describe reports the same in one call (pool 0 for a lease). */
        DevshareImportInfo info2;
        DevshareHandle h2;
        uint32_t dpool = 99, dslot = 99;
        devshare_import_info_init(&info2, sizeof info2);
        if (devshare_import_describe(imp, &info2, &h2, &dpool, &dslot) != DEVSHARE_STATUS_OK ||
            info2.data != info.data || info2.storage_size != info.storage_size || info2.numel != info.numel ||
            (ps == DEVSHARE_STATUS_OK ? dpool != pool || dslot != slot : dpool != 0 || dslot != 0) ||
            (hs == DEVSHARE_STATUS_OK && memcmp(&h, &h2, sizeof h) != 0)) {
            r.kind_bad++;
        }
        /* ... and so does devshare_connection_recv_item. */
        if (as_item &&
            (item.struct_size != item_size || item.data != info.data || item.device != info.device ||
             item.backend != info.backend || item.read_only != info.read_only ||
             item.nbytes != (uint64_t)((char *)info.storage + info.storage_size - (char *)info.data) ||
             (ps == DEVSHARE_STATUS_OK ? item.pool != pool || item.slot != slot : item.pool != 0 || item.slot != 0) ||
             hs != DEVSHARE_STATUS_OK || item.ndim != h.ndim || memcmp(&item.dtype, &h.dtype, sizeof h.dtype) != 0 ||
             memcmp(item.shape, h.shape, sizeof h.shape) != 0 || memcmp(item.strides, h.strides, sizeof h.strides) != 0 ||
             (old_caller ? item.layout_id != 77 : !layout_id_agrees(&item)))) {
            r.kind_bad++;
        }
        if (hs == DEVSHARE_STATUS_OK) {
            if (h.flags & DEVSHARE_HANDLE_FLAG_EVENT) {
                r.events++;
                r.waited += event_waits(h.event_handle) == 1;
            }
            if (ps == DEVSHARE_STATUS_INVALID_ARGUMENT) {
                last_lease = h;
            }
        }
        if (hold && n_held < (int)(sizeof held / sizeof held[0])) {
            held[n_held++] = imp;
        } else if (i + 1 < n && i % 2 == 0) {
            /* Back to the producer now; the next receive (recv_item) releases it. */
            if (devshare_import_give_back(imp) != DEVSHARE_STATUS_OK) {
                r.rel_bad++;
            }
            given_back = imp;
        } else if (devshare_import_release(imp) != DEVSHARE_STATUS_OK) {
            r.rel_bad++;
        }
    }
    if (given_back && devshare_import_release(given_back) != DEVSHARE_STATUS_OK) {
        r.rel_bad++;
    }
    r.slots = n_seen;
    return r;
}

static int release_held(int k) {
    int fails = 0, done = 0;
    for (; done < k && done < n_held; done++) {
        fails += devshare_import_release(held[done]) != DEVSHARE_STATUS_OK;
    }
    memmove(held, held + done, (size_t)(n_held - done) * sizeof held[0]);
    n_held -= done;
    return fails;
}

/* Open memfds of this process: how many, and how many refuse ftruncate(fd, 0) with EPERM. */
static void own_memfds(int *count, int *refused) {
    *count = 0;
    *refused = 0;
    DIR *d = opendir("/proc/self/fd");
    if (!d) {
        return;
    }
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        char path[300], target[256];
        snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
        const ssize_t n = readlink(path, target, sizeof target - 1);
        if (n <= 0) {
            continue;
        }
        target[n] = '\0';
        if (strncmp(target, "/memfd:", 7) == 0) {
            const int fd = atoi(e->d_name);
            (*count)++;
            *refused += ftruncate(fd, 0) != 0 && errno == EPERM;
        }
    }
    closedir(d);
}

static int consumer_child(void) {
    if (g_cuda) {
        drop_ptrace_capability();
        cu_or_die(cuInit(0), "cuInit");
        cuda_make_current();
    }
    if (g_acl) {
        const aclError init = aclInit(NULL);
        if (init != ACL_SUCCESS && init != ACL_ERROR_REPEAT_INITIALIZE) {
            acl_or_die(init, "aclInit");
        }
        acl_or_die(aclrtSetDevice(0), "aclrtSetDevice(0)");
    }
    int32_t tgid = (int32_t)getpid();
    if (g_acl && devshare_local_pid(DEVSHARE_BACKEND_ACL, 0, &tgid) != DEVSHARE_STATUS_OK) {
        tgid = -1;
    }
    say("PID %d %d", (int)getpid(), (int)tgid);
    DevshareConnection *conn = NULL;
    DevshareConnection *conn2 = NULL; /* a second connection of this process ("connect2", "recv2") */
    char line[4096], msg[1024];
    while (read_line_fd(0, line, sizeof line, CHILD_IDLE_MS) >= 0) {
        char arg[512];
        int a = 0, b = 0, c = 0;
        if (sscanf(line, "connect %511s %d", arg, &a) == 2) {
            const int32_t st = devshare_channel_connect(arg, a, &conn);
            say("R %d %s", (int)st, st ? last_error() : "");
        } else if (sscanf(line, "connect2 %511s %d", arg, &a) == 2) {
            const int32_t st = devshare_channel_connect(arg, a, &conn2);
            say("R %d %s", (int)st, st ? last_error() : "");
        } else if (sscanf(line, "recv2 %d %d %d", &a, &b, &c) == 3 || sscanf(line, "recv %d %d %d", &a, &b, &c) == 3) {
            /* (recv2 first: "recv %d" would read its 2 as the count.) */
            const RecvResult r = consume(strncmp(line, "recv2", 5) == 0 ? conn2 : conn, a, b, c, msg, sizeof msg);
            say("R %d %d %d %d %d %d %d %d %d %d %d %d %ld %s", r.got, r.pool, r.lease, r.addr_bad, r.data_bad,
                r.order_bad, r.rel_bad, r.st, r.slots, r.kind_bad, r.events, r.waited, r.seq_sum, msg);
        } else if (sscanf(line, "spin %d", &a) == 1) {
            const int32_t st = devshare_connection_set_spin(conn, (uint32_t)a);
            say("R %d", (int)st);
        } else if (sscanf(line, "release_later %d %d", &a, &b) == 2) {
            say("R 0");
            usleep((useconds_t)a * 1000u);
            release_held(b);
        } else if (sscanf(line, "release %d", &a) == 1) {
            const int before = n_held;
            const int fails = release_held(a);
            say("R %d %d", before - n_held, fails);
        } else if (strcmp(line, "read") == 0) {
            int bad = 0;
            for (int i = 0; i < n_held; i++) {
                bad += !import_readable(held[i]);
            }
            say("R %d %d", n_held, bad);
        } else if (strcmp(line, "close") == 0) {
            const int32_t st = devshare_connection_close(conn);
            conn = NULL;
            say("R %d %s", (int)st, st ? last_error() : "");
        } else if (strcmp(line, "cuda_state") == 0) {
            say("R %d %d %d %d %d %d %d %d", cusi_vmm_reservations(), cusi_vmm_mappings(), cusi_vmm_handles(),
                cusi_vmm_imported_handles(), cusi_vmm_allocations(), open_fds(), cusi_violation_count(),
                cusi_opened_events());
        } else if (strcmp(line, "lease_opens") == 0) {
            CUipcMemHandle ih;
            memcpy(ih.reserved, last_lease.key, sizeof ih.reserved);
            say("R %d", cusi_live_opens(ih));
        } else if (sscanf(line, "getfd %d %d", &a, &b) == 2) {
            const int err = pidfd_getfd_errno((pid_t)a, b);
            say("R %d %s", err, err ? strerror(err) : "taken");
        } else if (strcmp(line, "memfds") == 0) {
            int count, refused;
            own_memfds(&count, &refused);
            say("R %d %d", count, refused);
        } else if (strncmp(line, "import ", 7) == 0) {
            DevshareHandle h;
            int32_t st = devshare_handle_from_text(line + 7, &h);
            DevshareImport *imp = NULL;
            if (st == DEVSHARE_STATUS_OK) {
                st = devshare_import(&h, NULL, &imp);
                if (st == DEVSHARE_STATUS_OK) {
                    say("R 0 imported");
                    devshare_import_release(imp);
                } else {
                    say("R %d %s", (int)st, last_error());
                    devshare_handle_discard(&h); /* give the refused handle's reference back */
                }
            } else {
                say("R %d %s", (int)st, last_error());
            }
        } else if (strcmp(line, "exit_holding") == 0) {
            say("R 0");
            _exit(0);
        } else if (strcmp(line, "quit") == 0) {
            const int fails = release_held(n_held);
            int32_t st = conn ? devshare_connection_close(conn) : 0;
            const int32_t st2 = conn2 ? devshare_connection_close(conn2) : 0;
            st = st ? st : st2;
            say("R %d %d", fails, (int)st);
            return fails || st ? 1 : 0;
        } else if (line[0] != '\0') {
            say("R -1 unknown command");
        }
    }
    return 0;
}

/* A producer child for the producer-death case: listens, sends one pool slot (seq 41) and one
 * lease (seq 42) to its first peer, says SENT and waits to be killed. */
static int producer_child(const char *address) {
    say("PID %d", (int)getpid());
    DevshareChannel *ch = NULL;
    DevshareExporter *pool_exp = NULL, *lease_exp = NULL;
    DevsharePool *pool = NULL;
    int32_t st;
    if ((st = devshare_channel_listen(address, &ch)) || (st = devshare_channel_host_alloc(65536, &pool_exp, NULL)) ||
        (st = devshare_channel_host_alloc(65536, &lease_exp, NULL)) ||
        (st = devshare_pool_create(ch, pool_exp, 16384, 2, &pool))) {
        say("ERR setup %d %s", (int)st, last_error());
        return 1;
    }
    say("READY");
    uint64_t peer = 0;
    size_t n = 0;
    if ((st = devshare_channel_wait_peers(ch, 1, IO_MS)) || (st = devshare_channel_peer_ids(ch, &peer, 1, &n))) {
        say("ERR peer %d %s", (int)st, last_error());
        return 1;
    }
    uint32_t slot;
    void *ptr;
    if ((st = devshare_pool_acquire(pool, IO_MS, &slot, &ptr))) {
        say("ERR acquire %d %s", (int)st, last_error());
        return 1;
    }
    item_fill(ptr, 16384, 41);
    if ((st = devshare_pool_send(pool, slot, peer, NULL))) {
        say("ERR pool send %d %s", (int)st, last_error());
        return 1;
    }
    void *lease_base = NULL;
    const int64_t len = 8192;
    const DevshareTensorDesc d = bytes_desc(4096, &len);
    if ((st = devshare_exporter_memory(lease_exp, &lease_base, NULL))) {
        say("ERR memory %d %s", (int)st, last_error());
        return 1;
    }
    item_fill((uint8_t *)lease_base + 4096, 8192, 42);
    if ((st = devshare_channel_send(ch, peer, lease_exp, &d))) {
        say("ERR lease send %d %s", (int)st, last_error());
        return 1;
    }
    say("SENT");
    read_line_fd(0, (char[8]){0}, 8, CHILD_IDLE_MS); /* until killed */
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* The parent's side of children */

typedef struct {
    pid_t pid;
    int to, from;
    int32_t tgid; /* the pid it announces (ACL: its bare tgid) */
} Child;

static pid_t tracked[MAX_TRACKED]; /* processes whose /dev/shm names are checked at the end */
static int n_tracked;

/* Check `pid`'s /dev/shm names at the end; call before its process creates any. */
static void track(pid_t pid) {
    if (n_tracked < MAX_TRACKED) {
        tracked[n_tracked++] = pid;
        shm_names_of(pid, 1);
    }
}

static Child spawn_child(const char *mode, const char *arg) {
    Child c = {0};
    char *argv[] = {self_path, "--child", (char *)mode, (char *)arg, NULL};
    /* Gated: its /dev/shm names are looked at before it runs. */
    c.pid = spawn_piped(argv, &(SpawnOptions){.gated = 1}, &c.to, &c.from);
    if (strcmp(mode, "acl") != 0) {
        track(c.pid);
    }
    open_gate(c.to);
    char line[128];
    int pid = 0, tgid = 0;
    if (read_line_fd(c.from, line, sizeof line, IO_MS) <= 0 || sscanf(line, "PID %d %d", &pid, &tgid) < 1 ||
        pid != c.pid) {
        printf("FAIL - setup: the %s child did not start\n", mode);
        exit(1);
    }
    c.tgid = tgid;
    return c;
}

__attribute__((format(printf, 2, 3))) static void tell(Child *c, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    if (vwrite_line_fd(c->to, fmt, ap) != 0) {
        printf("    (could not write to child %d: %s)\n", (int)c->pid, strerror(errno));
    }
    va_end(ap);
}

/* The child's next answer line; the producer's channel (if any) is serviced meanwhile. */
static const char *reply(Child *c, DevshareChannel *ch) {
    static char buf[8192];
    const int64_t deadline = now_ms() + IO_MS;
    for (;;) {
        const int64_t left = deadline - now_ms();
        if (left <= 0) {
            snprintf(buf, sizeof buf, "X no answer from the child within %d ms", IO_MS);
            return buf;
        }
        struct pollfd p[2] = {{.fd = c->from, .events = POLLIN},
                              {.fd = ch ? devshare_channel_fd(ch) : -1, .events = POLLIN}};
        const int r = poll(p, 2, left > 50 ? 50 : (int)left);
        if (r < 0 && errno != EINTR) {
            snprintf(buf, sizeof buf, "X poll: %s", strerror(errno));
            return buf;
        }
        if (ch) {
            const int32_t st = devshare_channel_service(ch, 0);
            if (st != DEVSHARE_STATUS_OK) {
                printf("    # devshare_channel_service: %s: %s\n", devshare_status_str(st), last_error());
            }
        }
        if (r > 0 && (p[0].revents & (POLLIN | POLLHUP))) {
            if (read_line_fd(c->from, buf, sizeof buf, IO_MS) < 0) {
                snprintf(buf, sizeof buf, "X the child closed its output");
            }
            return buf;
        }
    }
}

/* The integers after "R" (up to max); returns how many. */
static int ints(const char *ans, long *v, int max) {
    if (ans[0] != 'R') {
        return 0;
    }
    const char *p = ans + 1;
    int n = 0;
    while (n < max) {
        char *end;
        const long x = strtol(p, &end, 10);
        if (end == p) {
            break;
        }
        v[n++] = x;
        p = end;
    }
    return n;
}

static RecvResult recv_result(const char *ans) {
    long v[13] = {0};
    RecvResult r = {0};
    if (ints(ans, v, 13) != 13) {
        printf("    unexpected answer: %s\n", ans);
        r.st = -1000;
        return r;
    }
    r.got = (int)v[0], r.pool = (int)v[1], r.lease = (int)v[2], r.addr_bad = (int)v[3], r.data_bad = (int)v[4];
    r.order_bad = (int)v[5], r.rel_bad = (int)v[6], r.st = (int)v[7], r.slots = (int)v[8], r.kind_bad = (int)v[9];
    r.events = (int)v[10], r.waited = (int)v[11], r.seq_sum = v[12];
    if (r.st != 0) {
        printf("    consumer: %s\n", ans);
    }
    return r;
}

/* Wait for a child to exit (bounded; SIGKILL after IO_MS). 1 when it exited with status 0. */
static int reap(pid_t pid) {
    const int status = wait_exit(pid, IO_MS);
    if (status == -1) {
        printf("    child %d did not exit: killed\n", (int)pid);
    }
    return exited_zero(status);
}

static int finish(Child *c, DevshareChannel *ch) {
    tell(c, "quit");
    const char *a = reply(c, ch);
    const int answered = strncmp(a, "R 0 0", 5) == 0;
    if (!answered) {
        printf("    quit: %s\n", a);
    }
    close(c->to);
    close(c->from);
    return reap(c->pid) && answered;
}

static void kill_child(Child *c) {
    kill(c->pid, SIGKILL);
    int status;
    waitpid(c->pid, &status, 0);
    close(c->to);
    close(c->from);
}

/* ---------------------------------------------------------------------------------------- */
/* Producer helpers */

static void make_address(char *buf, size_t cap, const char *tag) {
    snprintf(buf, cap, "@devshare_test_channel_%ld_%s", (long)getpid(), tag);
}

static size_t peer_count(DevshareChannel *ch, uint64_t *ids, size_t cap) {
    size_t n = 0;
    const int32_t st = devshare_channel_peer_ids(ch, ids, cap, &n);
    if (st != DEVSHARE_STATUS_OK && st != DEVSHARE_STATUS_BUFFER_TOO_SMALL) {
        printf("    devshare_channel_peer_ids: %s: %s\n", devshare_status_str(st), last_error());
    }
    return n;
}

/* Have the child connect; returns the new peer's id (0 when it failed, with a FAIL line). */
static uint64_t connect_child(DevshareChannel *ch, Child *c, const char *address, const char *label) {
    uint64_t ids[16];
    const size_t before = peer_count(ch, ids, 16);
    tell(c, "connect %s %d", address, IO_MS);
    const int32_t st = devshare_channel_wait_peers(ch, before + 1, IO_MS);
    const char *a = reply(c, ch);
    const size_t n = peer_count(ch, ids, 16);
    uint64_t id = st == DEVSHARE_STATUS_OK && strncmp(a, "R 0", 3) == 0 && n == before + 1 ? ids[n - 1] : 0;
    DevsharePeerInfo info;
    memset(&info, 0, sizeof info);
    int32_t ist = DEVSHARE_STATUS_INVALID_ARGUMENT;
    if (id) {
        DS_OK(devshare_peer_info_init(&info, sizeof info));
        ist = devshare_channel_peer_info(ch, id, &info);
    }
    if (!CHECK(id != 0 && ist == DEVSHARE_STATUS_OK && info.pid == c->pid && info.uid == geteuid() && info.id == id &&
                   info.leases == 0,
               "%s: a consumer connects; the producer sees it as a new peer with its pid and uid", label)) {
        printf("    wait_peers: %s (%s); consumer: %s; peers %zu -> %zu\n", devshare_status_str(st), last_error(), a,
               before, n);
        return 0;
    }
    return id;
}

static uint32_t free_slots(DevsharePool *pool) {
    uint64_t slot_size = 0;
    uint32_t count = 0, free_n = UINT32_MAX;
    DS_OK(devshare_pool_info(pool, &slot_size, &count, &free_n));
    return free_n;
}

/* Service the channel until the pool has `want` free slots (bounded by IO_MS). */
static int wait_free(DevshareChannel *ch, DevsharePool *pool, uint32_t want) {
    const int64_t deadline = now_ms() + IO_MS;
    while (free_slots(pool) != want && now_ms() < deadline) {
        devshare_channel_service(ch, 50);
    }
    return free_slots(pool) == want;
}

/* Every slot comes home: `count` acquires succeed (distinct slots), then release them. */
static void check_all_slots_return(DevsharePool *pool, uint32_t count, const char *label) {
    uint32_t got[64];
    uint32_t n = 0;
    int distinct = 1;
    for (; n < count; n++) {
        void *ptr;
        const int32_t st = devshare_pool_acquire(pool, IO_MS, &got[n], &ptr);
        if (st != DEVSHARE_STATUS_OK) {
            printf("    acquire %u of %u: %s: %s\n", n + 1, count, devshare_status_str(st), last_error());
            break;
        }
        for (uint32_t j = 0; j < n; j++) {
            distinct = distinct && got[j] != got[n];
        }
    }
    int released = 1;
    for (uint32_t j = 0; j < n; j++) {
        released = released && devshare_pool_release(pool, got[j]) == DEVSHARE_STATUS_OK;
    }
    CHECK(n == count && distinct && released && free_slots(pool) == count,
          "%s: every slot comes back to the producer (%u of %u acquired again, then released)", label, n, count);
}

static void close_all(DevsharePool *pool, DevshareExporter *exp, DevshareChannel *ch, const char *label) {
    const int32_t a = pool ? devshare_pool_close(pool) : 0;
    const int32_t b = exp ? devshare_exporter_close(exp, 0) : 0;
    const int32_t c = ch ? devshare_channel_close(ch) : 0;
    if (!CHECK(a == 0 && b == 0 && c == 0, "%s: pool, exporter and channel close", label)) {
        printf("    pool %s, exporter %s, channel %s: %s\n", devshare_status_str(a), devshare_status_str(b),
               devshare_status_str(c), last_error());
    }
}

static uint64_t outstanding_of(const DevshareExporter *exp) {
    uint64_t n = UINT64_MAX;
    DS_OK(devshare_exporter_outstanding(exp, &n));
    return n;
}

static uint64_t peer_leases(DevshareChannel *ch, uint64_t peer) {
    DevsharePeerInfo info;
    DS_OK(devshare_peer_info_init(&info, sizeof info));
    if (devshare_channel_peer_info(ch, peer, &info) != DEVSHARE_STATUS_OK) {
        return UINT64_MAX;
    }
    return info.leases;
}

/* ---------------------------------------------------------------------------------------- */
/* CUDA (over the stand-in driver) */

#define SEG ((size_t)DEVSHARE_SEGMENT_GRANULARITY) /* 2 MiB segments */

static void cuda_start(void) {
    static int started;
    if (!started) {
        cu_or_die(cuInit(0), "cuInit");
        started = 1;
    }
    cuda_make_current();
}

/* A VMM buffer: n segments from cuMemCreate (exportable as POSIX fds), mapped back to back,
 * read-write for device 0. */
typedef struct {
    CUdeviceptr va;
    size_t n;
    uint64_t h[8]; /* CUmemGenericAllocationHandle, as devshare_export_segments takes them */
} Vmm;

static void vmm_create(Vmm *v, size_t n) {
    memset(v, 0, sizeof *v);
    v->n = n;
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    size_t gran = 0;
    cu_or_die(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
              "cuMemGetAllocationGranularity");
    if (gran == 0 || SEG % gran) {
        fprintf(stderr, "test_channel: VMM granularity %zu does not divide the segment size\n", gran);
        exit(2);
    }
    for (size_t i = 0; i < n; i++) {
        CUmemGenericAllocationHandle h = 0;
        cu_or_die(cuMemCreate(&h, SEG, &prop, 0), "cuMemCreate");
        v->h[i] = h;
    }
    cu_or_die(cuMemAddressReserve(&v->va, n * SEG, 0, 0, 0), "cuMemAddressReserve");
    for (size_t i = 0; i < n; i++) {
        cu_or_die(cuMemMap(v->va + i * SEG, SEG, 0, v->h[i], 0), "cuMemMap");
    }
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof acc);
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = 0;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    cu_or_die(cuMemSetAccess(v->va, n * SEG, &acc, 1), "cuMemSetAccess");
}

static void vmm_destroy(Vmm *v) {
    for (size_t i = 0; i < v->n; i++) {
        cu_or_die(cuMemUnmap(v->va + i * SEG, SEG), "cuMemUnmap");
        cu_or_die(cuMemRelease(v->h[i]), "cuMemRelease");
    }
    cu_or_die(cuMemAddressFree(v->va, v->n * SEG), "cuMemAddressFree");
}

/* What the stand-in driver holds in a CUDA consumer, and its open descriptors. */
typedef struct {
    int resv, maps, handles, imported, allocs, fds, violations;
    int opened; /* interprocess events it opened and has not destroyed */
} CudaState;

static CudaState cuda_state(Child *c, DevshareChannel *ch) {
    tell(c, "cuda_state");
    const char *a = reply(c, ch);
    long v[8];
    CudaState s = {-1, -1, -1, -1, -1, -1, -1, -1};
    if (ints(a, v, 8) == 8) {
        s = (CudaState){(int)v[0], (int)v[1], (int)v[2], (int)v[3], (int)v[4], (int)v[5], (int)v[6], (int)v[7]};
    } else {
        printf("    unexpected answer: %s\n", a);
    }
    return s;
}

static void show_cuda_state(const char *what, CudaState s) {
    printf("    # %s: %d reservations, %d mappings, %d handle refs, %d imported, %d allocations, %d fds, %d "
           "violations\n",
           what, s.resv, s.maps, s.handles, s.imported, s.allocs, s.fds, s.violations);
}

/* Interprocess events this process created and has not destroyed: the stand-ins keep each in a
 * shared object /dev/shm/<prefix><pid>_<n> ("cusi_e_", "aclsi_e_") until its creator destroys
 * it. */
static int live_events(const char *prefix) {
    char token[64];
    const int tl = snprintf(token, sizeof token, "%s%ld_", prefix, (long)getpid());
    DIR *d = opendir("/dev/shm");
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d)) != NULL;) {
        n += strncmp(e->d_name, token, (size_t)tl) == 0;
    }
    if (d) {
        closedir(d);
    }
    return n;
}

/* The names of this process's live interprocess events (as live_events counts them), sorted and
 * joined with spaces into buf: an event recorded again keeps its name, a new one has another. */
static void live_event_names(const char *prefix, char *buf, size_t cap) {
    char token[64];
    const int tl = snprintf(token, sizeof token, "%s%ld_", prefix, (long)getpid());
    struct dirent **names = NULL;
    const int n = scandir("/dev/shm", &names, NULL, alphasort);
    size_t used = 0;
    buf[0] = '\0';
    for (int i = 0; i < n; i++) {
        if (strncmp(names[i]->d_name, token, (size_t)tl) == 0 && used < cap) {
            used += (size_t)snprintf(buf + used, cap - used, "%s ", names[i]->d_name);
        }
        free(names[i]);
    }
    free(names);
}

#endif /* DEVSHARE_TEST_CHANNEL_HELPERS_H */
