/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_channel: channels, leases and pools between separate processes.
 *
 * The parent is the producer (except in the producer-death case, where it is the consumer);
 * consumers are this program re-executed with "--child host|acl|cuda" (a fresh process image: only
 * the pipes are inherited). A consumer prints "PID <pid>" and then answers one line per
 * command on its stdout, always starting with "R":
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
 *                    <open fds> <violations>   (the CUDA stand-in's VMM state of the consumer)
 *   lease_opens -> R <live IPC opens of the last lease's cuMemAlloc allocation, all processes>
 *   getfd <pid> <fd> -> R <0 | errno>   (pidfd_getfd of another process's fd, tried here)
 *   release <k> / release_later <ms> <k> / read / close / memfds / import <text> /
 *   exit_holding / quit
 * A cuda consumer drops CAP_SYS_PTRACE first, so the kernel's ordinary ptrace rules apply to
 * it even when the tests run as root.
 *
 * Cases (each named by the behaviour it checks):
 *  - bad inputs return statuses (NULL and empty addresses, over-long paths and names, an
 *    existing path, slot_size 0, count 0, slots beyond the export, unknown peer ids ...);
 *  - host memfd pool: 10,000 items through 8 slots; each slot keeps one address in the
 *    consumer, the data written by the producer is read back, every slot comes home;
 *  - backpressure: 2 slots held by the consumer -> devshare_pool_acquire times out; a blocking
 *    acquire resumes when the consumer releases one;
 *  - two consumers on one pool;
 *  - slot misuse is an error, not corruption (producer releases of slots not acquired, double
 *    release, sends of slots not acquired); slots held by a consumer that disconnects or exits
 *    come back;
 *  - leases: devshare_channel_send of a tensor in a memfd export is outstanding until released;
 *    a consumer SIGKILLed while holding gives it back (devshare_exporter_wait(1000) is OK);
 *  - producer death: the consumer's recv says DEVSHARE_STATUS_CLOSED, its imports stay readable
 *    and release;
 *  - sealed memfd: the producer's memfd cannot be shrunk or grown (EPERM), the consumer reads
 *    whole slots without SIGBUS;
 *  - a peer with another uid is refused (run as root only; otherwise SKIP);
 *  - devshare_channel_restrict with pid and uid lists that leave the consumer out refuses it;
 *  - ACL (over the stand-in runtime): a pool of an ACL export reaches a channel consumer
 *    without devshare_exporter_allow_pid; a plain handle of that export imported without the
 *    channel is refused by the pid whitelist;
 *  - ACL lease with DEVSHARE_SHARE_EVENT: the consumer, whitelisted through the handshake,
 *    reads the lease; recv waited on the event; the producer keeps the event until the lease
 *    comes back, then destroys it;
 *  - CUDA pool (over the stand-in driver): 4 cuMemCreate segments of 2 MiB exported with
 *    devshare_export_segments, one slot per segment. The producer is made non-dumpable (and
 *    neither side has CAP_SYS_PTRACE), so the consumer's pidfd_getfd of producer fds fails
 *    with EPERM (checked by the consumer itself; without the switch it succeeds where Yama
 *    does not forbid it): the consumer still imports, because the segment fds travel over the
 *    channel. The allocation is imported once (1 reservation, 4 mappings), each slot keeps its
 *    address, cuMemcpyDtoH reads what the producer wrote. The same pool with
 *    DEVSHARE_SHARE_EVENT items (on a stream or NULL): recv waited on each event, the producer
 *    holds one live event per slot out and destroys it when the slot comes back. After
 *    devshare_pool_close the consumer detaches on its next recv: nothing reserved, mapped or
 *    imported is left in it, and once its connection closes it has its first fd count again;
 *  - CUDA lease with DEVSHARE_SHARE_EVENT (cuMemAlloc + devshare_export, on a stream and with
 *    NULL): recv waited on the event, one live IPC open while held and none after the release,
 *    the event kept until the lease comes back;
 *  - afterwards no /dev/shm object carries the pid of this process or of a host or CUDA
 *    consumer, and neither stand-in recorded a rule violation (in any process: at exit they
 *    also check that every opened IPC event and mapping was closed).
 *
 * Needs DEVSHARE_ACL_LIBRARY and DEVSHARE_CUDA_LIBRARY pointing at the stand-ins
 * (libascendcl.so, libcuda.so.1; CTest sets them).
 * Prints "ok - ..." / "FAIL - ..." per case; exit status 0 when all passed.
 */
#define _GNU_SOURCE

#define HARNESS_NAME "test_channel"
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

/* How often the interprocess event in `bytes` (a handle's event_handle) has been waited on: the
 * event is opened again here, its count read from the stand-in, then waited on and destroyed as
 * the driver's rules ask. -1 when it cannot be opened (the producer destroyed it). */
static int event_waits(const uint8_t *bytes) {
    int n = -1;
    if (g_cuda) {
        CUipcEventHandle eh;
        memcpy(eh.reserved, bytes, sizeof eh.reserved);
        CUevent e = NULL;
        if (cuIpcOpenEventHandle(&e, eh) == CUDA_SUCCESS) {
            n = cusi_event_waits(e);
            cu_or_die(cuEventSynchronize(e), "cuEventSynchronize");
            cu_or_die(cuEventDestroy(e), "cuEventDestroy");
        }
    } else if (g_acl) {
        aclrtIpcEventHandle eh;
        memcpy(eh.reserved, bytes, sizeof eh.reserved);
        aclrtEvent e = NULL;
        if (aclrtIpcOpenEventHandle(eh, &e) == ACL_SUCCESS) {
            n = aclsi_event_waits(e);
            acl_or_die(aclrtSynchronizeEvent(e), "aclrtSynchronizeEvent");
            acl_or_die(aclrtDestroyEvent(e), "aclrtDestroyEvent");
        }
    }
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
    char line[4096], msg[1024];
    while (read_line_fd(0, line, sizeof line, CHILD_IDLE_MS) >= 0) {
        char arg[512];
        int a = 0, b = 0, c = 0;
        if (sscanf(line, "connect %511s %d", arg, &a) == 2) {
            const int32_t st = devshare_channel_connect(arg, a, &conn);
            say("R %d %s", (int)st, st ? last_error() : "");
        } else if (sscanf(line, "recv %d %d %d", &a, &b, &c) == 3) {
            const RecvResult r = consume(conn, a, b, c, msg, sizeof msg);
            say("R %d %d %d %d %d %d %d %d %d %d %d %d %s", r.got, r.pool, r.lease, r.addr_bad, r.data_bad,
                r.order_bad, r.rel_bad, r.st, r.slots, r.kind_bad, r.events, r.waited, msg);
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
            say("R %d %d %d %d %d %d %d", cusi_vmm_reservations(), cusi_vmm_mappings(), cusi_vmm_handles(),
                cusi_vmm_imported_handles(), cusi_vmm_allocations(), open_fds(), cusi_violation_count());
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
            const int32_t st = conn ? devshare_connection_close(conn) : 0;
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
static char **stale; /* names that carried a tracked pid before its process ran (pid reuse) */
static size_t n_stale;

static int is_stale(const char *name) {
    for (size_t i = 0; i < n_stale; i++) {
        if (strcmp(stale[i], name) == 0) {
            return 1;
        }
    }
    return 0;
}

/* /dev/shm names carrying `pid` between '_' and '_' or the end (the stand-in's aclsi_* aside).
 * With `record`, they are remembered as left by an earlier process that had the same pid and
 * not counted; otherwise the names not remembered are printed and counted. */
static int shm_names_of(pid_t pid, int record) {
    DIR *d = opendir("/dev/shm");
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d)) != NULL;) {
        if (strncmp(e->d_name, "aclsi_", 6) == 0 || is_stale(e->d_name) || !shm_name_has_pid(e->d_name, (long)pid)) {
            continue;
        }
        if (record) {
            char **grown = realloc(stale, (n_stale + 1) * sizeof *stale);
            char *name = strdup(e->d_name);
            if (!grown || !name) {
                die("remembering /dev/shm names", errno);
            }
            stale = grown;
            stale[n_stale++] = name;
        } else {
            printf("    left over: /dev/shm/%s\n", e->d_name);
            n++;
        }
    }
    if (d) {
        closedir(d);
    }
    return n;
}

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
    long v[12] = {0};
    RecvResult r = {0};
    if (ints(ans, v, 12) != 12) {
        printf("    unexpected answer: %s\n", ans);
        r.st = -1000;
        return r;
    }
    r.got = (int)v[0], r.pool = (int)v[1], r.lease = (int)v[2], r.addr_bad = (int)v[3], r.data_bad = (int)v[4];
    r.order_bad = (int)v[5], r.rel_bad = (int)v[6], r.st = (int)v[7], r.slots = (int)v[8], r.kind_bad = (int)v[9];
    r.events = (int)v[10], r.waited = (int)v[11];
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

/* ---------------------------------------------------------------------------------------- */
/* Cases */

static void test_bad_inputs(void) {
    DevshareChannel *ch = NULL;
    EXPECT_ERROR(devshare_channel_listen(NULL, &ch), "devshare_channel_listen", "NULL address");
    EXPECT_ERROR(devshare_channel_listen("", &ch), "devshare_channel_listen", "empty address");
    EXPECT_ERROR(devshare_channel_listen("@", &ch), "devshare_channel_listen", "abstract address with no name");
    char longer[400];
    snprintf(longer, sizeof longer, "/tmp/devshare_test_channel_%ld_%0200d", (long)getpid(), 0);
    EXPECT_ERROR(devshare_channel_listen(longer, &ch), "devshare_channel_listen", "path longer than sun_path");
    longer[0] = '@';
    EXPECT_ERROR(devshare_channel_listen(longer, &ch), "devshare_channel_listen", "abstract name longer than sun_path");
    char path[128];
    snprintf(path, sizeof path, "/tmp/devshare_test_channel_%ld.sock", (long)getpid());
    unlink(path);
    const int fd = open(path, O_CREAT | O_WRONLY | O_EXCL, 0600);
    close(fd);
    int32_t st = devshare_channel_listen(path, &ch);
    EXPECT_ERROR(st, "devshare_channel_listen", "a path that exists");
    struct stat sb;
    CHECK(st == DEVSHARE_STATUS_BUSY && stat(path, &sb) == 0 && S_ISREG(sb.st_mode),
          "devshare_channel_listen never replaces an existing file: DEVSHARE_STATUS_BUSY (%s), the file is still there",
          devshare_status_str(st));
    unlink(path);
    st = devshare_channel_listen(path, &ch);
    memset(&sb, 0, sizeof sb);
    const int mode_ok = stat(path, &sb) == 0 && S_ISSOCK(sb.st_mode) && (sb.st_mode & 0777) == 0600;
    CHECK(st == DEVSHARE_STATUS_OK && mode_ok,
          "devshare_channel_listen on a free path makes a socket of mode 0600 (%s, mode %o)", devshare_status_str(st),
          (unsigned)(sb.st_mode & 0777));
    if (st == DEVSHARE_STATUS_OK) {
        st = devshare_channel_close(ch);
        CHECK(st == DEVSHARE_STATUS_OK && stat(path, &sb) != 0 && errno == ENOENT,
              "devshare_channel_close removes the socket file (%s)", devshare_status_str(st));
    }
    unlink(path);
    ch = NULL;

    DevshareConnection *conn = NULL;
    EXPECT_ERROR(devshare_channel_connect(NULL, 1000, &conn), "devshare_channel_connect", "NULL address");
    EXPECT_ERROR(devshare_channel_connect("", 1000, &conn), "devshare_channel_connect", "empty address");
    char nobody[128];
    make_address(nobody, sizeof nobody, "nobody_listens");
    EXPECT_ERROR(devshare_channel_connect(nobody, 1000, &conn), "devshare_channel_connect",
                 "an abstract address nobody listens on");

    DevshareExporter *exp = NULL;
    /* One rule with devshare_host_alloc: size 0 is an empty allocation; more than /dev/shm can
     * hold is ENOSPC (a sparse memfd would otherwise be created, and SIGBUS its users later). */
    CHECK(devshare_channel_host_alloc(0, &exp, NULL) == DEVSHARE_STATUS_OK &&
              devshare_exporter_close(exp, 0) == DEVSHARE_STATUS_OK,
          "devshare_channel_host_alloc(0) is an empty allocation (%s)", last_error());
    CHECK(devshare_host_alloc(0, &exp, NULL) == DEVSHARE_STATUS_OK && devshare_exporter_close(exp, 0) == DEVSHARE_STATUS_OK,
          "devshare_host_alloc(0) too: one rule");
    int32_t big = devshare_channel_host_alloc((uint64_t)1 << 40, &exp, NULL);
    CHECK(big == DEVSHARE_STATUS_OS && strstr(last_error(), "/dev/shm") != NULL,
          "devshare_channel_host_alloc(1 TiB) is refused naming /dev/shm's room (%s)", last_error());
    big = devshare_host_alloc((uint64_t)1 << 40, &exp, NULL);
    CHECK(big == DEVSHARE_STATUS_OS, "devshare_host_alloc(1 TiB) is refused the same way (%d)", (int)big);
    EXPECT_ERROR(devshare_channel_host_alloc(4096, NULL, NULL), "devshare_channel_host_alloc", "NULL out");
    EXPECT_ERROR(devshare_channel_host_alloc(UINT64_MAX, &exp, NULL), "devshare_channel_host_alloc", "size UINT64_MAX");

    char address[128];
    make_address(address, sizeof address, "bad");
    DS_OK(devshare_channel_listen(address, &ch));
    DevshareChannel *ch2 = NULL;
    EXPECT_ERROR(devshare_channel_listen(address, &ch2), "devshare_channel_listen", "an abstract name in use");
    DS_OK(devshare_channel_host_alloc(16384, &exp, NULL));
    DevsharePool *pool = NULL;
    EXPECT_ERROR(devshare_pool_create(ch, exp, 0, 4, &pool), "devshare_pool_create", "slot_size 0");
    EXPECT_ERROR(devshare_pool_create(ch, exp, 4096, 0, &pool), "devshare_pool_create", "count 0");
    EXPECT_ERROR(devshare_pool_create(ch, exp, 4096, 5, &pool), "devshare_pool_create",
                 "slot_size * count beyond the export (5 x 4096 in 16384)");
    EXPECT_ERROR(devshare_pool_create(ch, exp, UINT64_C(1) << 63, 2, &pool), "devshare_pool_create",
                 "slot_size * count overflows");
    EXPECT_ERROR(devshare_pool_create(NULL, exp, 4096, 4, &pool), "devshare_pool_create", "NULL channel");
    EXPECT_ERROR(devshare_pool_create(ch, NULL, 4096, 4, &pool), "devshare_pool_create", "NULL exporter");
    EXPECT_ERROR(devshare_pool_create(ch, exp, 4096, 4, NULL), "devshare_pool_create", "NULL out");

    const int64_t len = 4096;
    const DevshareTensorDesc d = bytes_desc(0, &len);
    EXPECT_ERROR(devshare_channel_send(ch, 999999, exp, &d), "devshare_channel_send", "unknown peer id");
    EXPECT_ERROR(devshare_channel_send(ch, 0, exp, &d), "devshare_channel_send", "peer id 0");
    EXPECT_ERROR(devshare_channel_send(NULL, 1, exp, &d), "devshare_channel_send", "NULL channel");
    EXPECT_ERROR(devshare_channel_send(ch, 1, NULL, &d), "devshare_channel_send", "NULL exporter");
    uint64_t outstanding = 99;
    DS_OK(devshare_exporter_outstanding(exp, &outstanding));
    CHECK(outstanding == 0, "bad input: refused sends leave no reference outstanding (%" PRIu64 ")", outstanding);

    DevsharePeerInfo info;
    DS_OK(devshare_peer_info_init(&info, sizeof info));
    st = devshare_channel_peer_info(ch, 999999, &info);
    EXPECT_ERROR(st, "devshare_channel_peer_info", "unknown peer id");
    CHECK(st == DEVSHARE_STATUS_NOT_FOUND, "devshare_channel_peer_info of an unknown peer: NOT_FOUND (%s)",
          devshare_status_str(st));
    size_t n = 99;
    CHECK(devshare_channel_peer_ids(ch, NULL, 0, &n) == DEVSHARE_STATUS_OK && n == 0,
          "devshare_channel_peer_ids with no peer: OK and count 0 (%zu)", n);
    const int32_t wst = devshare_channel_wait_peers(ch, 1, 0);
    CHECK(wst == DEVSHARE_STATUS_TIMEOUT, "devshare_channel_wait_peers(1, timeout 0) with no peer: TIMEOUT (%s)",
          devshare_status_str(wst));
    const int32_t pids[1] = {1};
    EXPECT_ERROR(devshare_channel_restrict(ch, NULL, 0, NULL, 1), "devshare_channel_restrict",
                 "NULL pids with n_pids 1");
    EXPECT_ERROR(devshare_channel_restrict(ch, NULL, 1, pids, 1), "devshare_channel_restrict",
                 "NULL uids with n_uids 1");
    EXPECT_ERROR(devshare_channel_service(NULL, 0), "devshare_channel_service", "NULL channel");
    CHECK(devshare_channel_fd(NULL) < 0, "devshare_channel_fd(NULL) is negative");
    CHECK(devshare_channel_fd(ch) >= 0, "devshare_channel_fd gives a descriptor");
    CHECK(devshare_connection_fd(NULL) < 0, "devshare_connection_fd(NULL) is negative");
    DevshareImport *imp = NULL;
    EXPECT_ERROR(devshare_connection_recv(NULL, 0, &imp), "devshare_connection_recv", "NULL connection");
    uint32_t pid_ = 0, slot_ = 0;
    EXPECT_ERROR(devshare_import_pool_slot(NULL, &pid_, &slot_), "devshare_import_pool_slot", "NULL import");
    EXPECT_ERROR(devshare_import_describe(NULL, NULL, NULL, &pid_, &slot_), "devshare_import_describe", "NULL import");
    DevshareItem item_;
    EXPECT_ERROR(devshare_item_init(&item_, 8), "devshare_item_init", "a size below the struct's");
    devshare_item_init(&item_, sizeof item_);
    EXPECT_ERROR(devshare_connection_recv_item(NULL, 0, NULL, &item_), "devshare_connection_recv_item",
                 "NULL connection");
    DevshareRecvArgs args_;
    EXPECT_ERROR(devshare_recv_args_init(&args_, 16), "devshare_recv_args_init", "a size below the struct's");
    EXPECT_ERROR(devshare_recv_args_init(NULL, sizeof args_), "devshare_recv_args_init", "NULL args");
    DS_OK(devshare_recv_args_init(&args_, sizeof args_));
    CHECK(args_.struct_size == sizeof args_ && args_.timeout_ms < 0 && args_.conn == NULL && args_.release == NULL &&
              args_.item.struct_size == sizeof args_.item,
          "devshare_recv_args_init: its size, no limit, no connection, no release, the item set up");
    EXPECT_ERROR(devshare_connection_recv_args(NULL), "devshare_connection_recv_args", "NULL args");
    EXPECT_ERROR(devshare_connection_recv_args(&args_), "devshare_connection_recv_args", "NULL connection");
    args_.item.struct_size = sizeof args_.item + 8;
    EXPECT_ERROR(devshare_connection_recv_args(&args_), "devshare_connection_recv_args",
                 "an item size beyond the args");
    CHECK(strstr(last_error(), "args.item.struct_size") != NULL, "the message names args.item.struct_size");
    args_.struct_size = 8;
    EXPECT_ERROR(devshare_connection_recv_args(&args_), "devshare_connection_recv_args", "a size below the struct's");

    DS_OK(devshare_pool_create(ch, exp, 4096, 4, &pool));
    uint32_t slot = 99;
    void *ptr = NULL;
    EXPECT_ERROR(devshare_pool_acquire(NULL, 0, &slot, &ptr), "devshare_pool_acquire", "NULL pool");
    EXPECT_ERROR(devshare_pool_acquire(pool, 0, NULL, &ptr), "devshare_pool_acquire", "NULL slot");
    DS_OK(devshare_pool_acquire(pool, 0, &slot, &ptr));
    EXPECT_ERROR(devshare_pool_send(pool, slot, 999999, NULL), "devshare_pool_send", "unknown peer id");
    EXPECT_ERROR(devshare_pool_send(NULL, slot, 1, NULL), "devshare_pool_send", "NULL pool");
    const int32_t rst = devshare_pool_release(pool, slot);
    CHECK(rst == DEVSHARE_STATUS_OK && free_slots(pool) == 4,
          "a slot whose send to an unknown peer was refused is still the producer's: it releases (%s)",
          devshare_status_str(rst));
    EXPECT_ERROR(devshare_pool_info(NULL, NULL, NULL, NULL), "devshare_pool_info", "NULL pool");
    EXPECT_ERROR(devshare_pool_set_spin(NULL, 10), "devshare_pool_set_spin", "NULL pool");
    EXPECT_ERROR(devshare_pool_set_spin(pool, DEVSHARE_MAX_SPIN_US + 1), "devshare_pool_set_spin",
                 "a spin above DEVSHARE_MAX_SPIN_US");
    DS_OK(devshare_pool_set_spin(pool, DEVSHARE_MAX_SPIN_US));
    DS_OK(devshare_pool_set_spin(pool, 0));
    EXPECT_ERROR(devshare_connection_set_spin(NULL, 10), "devshare_connection_set_spin", "NULL connection");
    close_all(pool, exp, ch, "bad input");
}

static void test_host_pool(void) {
    enum { SLOT = 4096, COUNT = 8, ITEMS = 10000 };
    char address[128];
    make_address(address, sizeof address, "pool");
    DevshareChannel *ch = NULL;
    DevshareExporter *exp = NULL;
    DevsharePool *pool = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    void *base = NULL, *alloc_ptr = NULL;
    DS_OK(devshare_channel_host_alloc(SLOT * COUNT, &exp, &alloc_ptr));
    uint64_t size = 0;
    DS_OK(devshare_exporter_memory(exp, &base, &size));
    CHECK(base != NULL && base == alloc_ptr && size >= SLOT * COUNT,
          "host pool: a memfd allocation has an address (ptr_out and devshare_exporter_memory agree) and the size "
          "asked (%" PRIu64 ")", size);
    DS_OK(devshare_pool_create(ch, exp, SLOT, COUNT, &pool));
    uint64_t ss = 0;
    uint32_t cnt = 0, fr = 0;
    DS_OK(devshare_pool_info(pool, &ss, &cnt, &fr));
    CHECK(ss == SLOT && cnt == COUNT && fr == COUNT,
          "host pool: devshare_pool_info says %u slots of %u bytes, all free",
          COUNT, SLOT);

    Child a = spawn_child("host", "");
    const uint64_t peer = connect_child(ch, &a, address, "host pool");
    /* Both ends spin (opt-in) before they sleep: the same 10,000 items, the same checks. */
    DS_OK(devshare_pool_set_spin(pool, 50));
    tell(&a, "spin 50");
    CHECK(strcmp(reply(&a, ch), "R 0") == 0, "host pool: the consumer spins up to 50 us per receive");
    tell(&a, "recv %d 0 %d", ITEMS, IO_MS);
    int send_ok = peer != 0, ptr_bad = 0;
    const int64_t t0 = now_ns();
    for (uint64_t seq = 1; seq <= ITEMS && send_ok; seq++) {
        uint32_t slot = 0;
        void *ptr = NULL;
        int32_t st = devshare_pool_acquire(pool, IO_MS, &slot, &ptr);
        if (st == DEVSHARE_STATUS_OK) {
            ptr_bad += slot >= COUNT || ptr != (uint8_t *)base + (size_t)slot * SLOT;
            item_fill(ptr, SLOT, seq);
            st = devshare_pool_send(pool, slot, peer, NULL);
        }
        if (st != DEVSHARE_STATUS_OK) {
            printf("    item %" PRIu64 ": %s: %s\n", seq, devshare_status_str(st), last_error());
            send_ok = 0;
        }
    }
    const RecvResult r = recv_result(reply(&a, ch));
    const double secs = (double)(now_ns() - t0) / 1e9;
    CHECK(send_ok, "host pool: the producer acquires, fills and sends %d items through %d slots (%.2f s)", ITEMS, COUNT,
          secs);
    CHECK(ptr_bad == 0, "host pool: devshare_pool_acquire gives slot i at base + i * slot_size");
    CHECK(r.got == ITEMS && r.pool == ITEMS && r.st == 0 && r.kind_bad == 0,
          "host pool: the consumer receives all %d items as pool items (%d)", ITEMS, r.got);
    CHECK(r.addr_bad == 0 && r.slots >= 1 && r.slots <= COUNT,
          "host pool: each slot's data pointer in the consumer is the same on every arrival "
          "(%d slots seen, %d changes)",
          r.slots, r.addr_bad);
    CHECK(r.data_bad == 0 && r.order_bad == 0,
          "host pool: the consumer reads back what the producer wrote, in order (%d bad, %d out of order)", r.data_bad,
          r.order_bad);
    CHECK(r.rel_bad == 0, "host pool: the consumer's releases succeed");
    check_all_slots_return(pool, COUNT, "host pool");
    CHECK(finish(&a, ch), "host pool: the consumer exits cleanly");
    close_all(pool, exp, ch, "host pool");
}

static void on_alarm(int sig) {
    (void)sig;
    static const char m[] = "FAIL - backpressure: a blocking devshare_pool_acquire did not resume within 60 s\n";
    if (write(1, m, sizeof m - 1) < 0) {
        _exit(1);
    }
    _exit(1);
}

static void test_backpressure(void) {
    char address[128];
    make_address(address, sizeof address, "backpressure");
    DevshareChannel *ch = NULL;
    DevshareExporter *exp = NULL;
    DevsharePool *pool = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    DS_OK(devshare_channel_host_alloc(8192, &exp, NULL));
    DS_OK(devshare_pool_create(ch, exp, 4096, 2, &pool));
    Child b = spawn_child("host", "");
    const uint64_t peer = connect_child(ch, &b, address, "backpressure");
    for (uint64_t seq = 1; seq <= 2; seq++) {
        uint32_t slot;
        void *ptr;
        DS_OK(devshare_pool_acquire(pool, 0, &slot, &ptr));
        item_fill(ptr, 4096, seq);
        DS_OK(devshare_pool_send(pool, slot, peer, NULL));
    }
    tell(&b, "recv 2 1 %d", IO_MS);
    const RecvResult r = recv_result(reply(&b, ch));
    CHECK(r.got == 2 && r.data_bad == 0, "backpressure: the consumer receives and holds both slots");
    CHECK(free_slots(pool) == 0, "backpressure: no slot is free while the consumer holds both");
    uint32_t slot = 99;
    void *ptr = NULL;
    int32_t st = devshare_pool_acquire(pool, 200, &slot, &ptr);
    CHECK(st == DEVSHARE_STATUS_TIMEOUT,
          "backpressure: devshare_pool_acquire(200 ms) with every slot held returns DEVSHARE_STATUS_TIMEOUT (%s)",
          devshare_status_str(st));
    if (st == DEVSHARE_STATUS_OK) {
        devshare_pool_release(pool, slot);
    }
    st = devshare_pool_acquire(pool, 0, &slot, &ptr);
    CHECK(st == DEVSHARE_STATUS_TIMEOUT, "backpressure: devshare_pool_acquire(0) does not block: TIMEOUT (%s)",
          devshare_status_str(st));
    if (st == DEVSHARE_STATUS_OK) {
        devshare_pool_release(pool, slot);
    }
    tell(&b, "release_later 300 1");
    const char *a = reply(&b, NULL);
    signal(SIGALRM, on_alarm);
    alarm(60);
    const int64_t t0 = now_ns();
    st = devshare_pool_acquire(pool, -1, &slot, &ptr);
    const double ms = (double)(now_ns() - t0) / 1e6;
    alarm(0);
    signal(SIGALRM, SIG_DFL);
    CHECK(strncmp(a, "R 0", 3) == 0 && st == DEVSHARE_STATUS_OK && slot < 2,
          "backpressure: a blocking devshare_pool_acquire (timeout -1) resumes when the consumer releases a slot "
          "(blocked %.0f ms)", ms);
    if (st == DEVSHARE_STATUS_OK) {
        DS_OK(devshare_pool_release(pool, slot));
    }
    tell(&b, "release 1");
    const char *rel = reply(&b, ch);
    CHECK(strncmp(rel, "R 1 0", 5) == 0, "backpressure: the consumer releases the other slot (%s)", rel);
    check_all_slots_return(pool, 2, "backpressure");
    CHECK(finish(&b, ch), "backpressure: the consumer exits cleanly");
    close_all(pool, exp, ch, "backpressure");
}

static void test_two_consumers(void) {
    enum { SLOT = 4096, COUNT = 4, EACH = 1000 };
    char address[128];
    make_address(address, sizeof address, "two");
    DevshareChannel *ch = NULL;
    DevshareExporter *exp = NULL;
    DevsharePool *pool = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    DS_OK(devshare_channel_host_alloc(SLOT * COUNT, &exp, NULL));
    DS_OK(devshare_pool_create(ch, exp, SLOT, COUNT, &pool));
    Child c[2] = {spawn_child("host", ""), spawn_child("host", "")};
    uint64_t peer[2];
    peer[0] = connect_child(ch, &c[0], address, "two consumers (first)");
    peer[1] = connect_child(ch, &c[1], address, "two consumers (second)");
    uint64_t ids[4];
    const size_t n = peer_count(ch, ids, 4);
    CHECK(n == 2 && ids[0] == peer[0] && ids[1] == peer[1] && peer[0] != peer[1],
          "two consumers: devshare_channel_peer_ids lists both, oldest first");
    tell(&c[0], "recv %d 0 %d", EACH, IO_MS);
    tell(&c[1], "recv %d 0 %d", EACH, IO_MS);
    int send_ok = peer[0] && peer[1];
    for (uint64_t seq = 1; seq <= 2 * EACH && send_ok; seq++) {
        uint32_t slot;
        void *ptr;
        int32_t st = devshare_pool_acquire(pool, IO_MS, &slot, &ptr);
        if (st == DEVSHARE_STATUS_OK) {
            item_fill(ptr, SLOT, seq);
            st = devshare_pool_send(pool, slot, peer[seq % 2], NULL);
        }
        if (st != DEVSHARE_STATUS_OK) {
            printf("    item %" PRIu64 ": %s: %s\n", seq, devshare_status_str(st), last_error());
            send_ok = 0;
        }
    }
    CHECK(send_ok, "two consumers: the producer sends %d items to each, alternating", EACH);
    for (int i = 0; i < 2; i++) {
        const RecvResult r = recv_result(reply(&c[i], ch));
        CHECK(r.got == EACH && r.pool == EACH && r.data_bad == 0 && r.order_bad == 0 && r.rel_bad == 0,
              "two consumers: consumer %d receives its %d items and reads them back", i + 1, EACH);
        CHECK(r.addr_bad == 0 && r.slots >= 1 && r.slots <= COUNT,
              "two consumers: consumer %d sees each slot at one address (%d slots seen)", i + 1, r.slots);
    }
    check_all_slots_return(pool, COUNT, "two consumers");
    CHECK(finish(&c[0], ch) && finish(&c[1], ch), "two consumers: both exit cleanly");
    close_all(pool, exp, ch, "two consumers");
}

static void test_slot_misuse(void) {
    enum { SLOT = 4096, COUNT = 4 };
    char address[128];
    make_address(address, sizeof address, "misuse");
    DevshareChannel *ch = NULL;
    DevshareExporter *exp = NULL;
    DevsharePool *pool = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    DS_OK(devshare_channel_host_alloc(SLOT * COUNT, &exp, NULL));
    DS_OK(devshare_pool_create(ch, exp, SLOT, COUNT, &pool));
    Child e = spawn_child("host", "");
    const uint64_t peer = connect_child(ch, &e, address, "slot misuse");

    int32_t st = devshare_pool_release(pool, 0);
    CHECK(st == DEVSHARE_STATUS_INVALID_ARGUMENT,
          "slot misuse: the producer cannot release a slot it never acquired (%s)",
          devshare_status_str(st));
    st = devshare_pool_release(pool, COUNT);
    CHECK(st < 0, "slot misuse: releasing slot index == count is refused (%s)", devshare_status_str(st));
    CHECK(free_slots(pool) == COUNT, "slot misuse: refused releases leave the free count alone");
    uint32_t s;
    void *ptr;
    DS_OK(devshare_pool_acquire(pool, 0, &s, &ptr));
    st = devshare_pool_release(pool, s);
    const int32_t st2 = devshare_pool_release(pool, s);
    CHECK(st == DEVSHARE_STATUS_OK && st2 == DEVSHARE_STATUS_INVALID_ARGUMENT && free_slots(pool) == COUNT,
          "slot misuse: a second devshare_pool_release of the same slot is refused (%s) and counts nothing twice",
          devshare_status_str(st2));
    st = devshare_pool_send(pool, s, peer, NULL);
    CHECK(st == DEVSHARE_STATUS_INVALID_ARGUMENT,
          "slot misuse: devshare_pool_send of a slot that is not acquired is refused (%s)",
          devshare_status_str(st));
    st = devshare_pool_send(pool, COUNT, peer, NULL);
    CHECK(st < 0, "slot misuse: devshare_pool_send of slot index == count is refused (%s)", devshare_status_str(st));
    CHECK(free_slots(pool) == COUNT, "slot misuse: refused sends leave the free count alone");

    uint32_t s1, s2;
    DS_OK(devshare_pool_acquire(pool, 0, &s1, &ptr));
    item_fill(ptr, SLOT, 1);
    DS_OK(devshare_pool_send(pool, s1, peer, NULL));
    st = devshare_pool_send(pool, s1, peer, NULL);
    CHECK(st == DEVSHARE_STATUS_INVALID_ARGUMENT, "slot misuse: a slot already sent cannot be sent again (%s)",
          devshare_status_str(st));
    st = devshare_pool_release(pool, s1);
    CHECK(st == DEVSHARE_STATUS_INVALID_ARGUMENT,
          "slot misuse: the producer cannot release a slot the consumer holds (%s)",
          devshare_status_str(st));
    DS_OK(devshare_pool_acquire(pool, 0, &s2, &ptr));
    item_fill(ptr, SLOT, 2);
    DS_OK(devshare_pool_send(pool, s2, peer, NULL));
    tell(&e, "recv 2 1 %d", IO_MS);
    RecvResult r = recv_result(reply(&e, ch));
    CHECK(r.got == 2 && r.data_bad == 0 && r.order_bad == 0,
          "slot misuse: the consumer receives each sent slot once, intact");
    CHECK(free_slots(pool) == COUNT - 2, "slot misuse: two slots are out while the consumer holds them");

    tell(&e, "close");
    const char *a = reply(&e, ch);
    CHECK(strncmp(a, "R 0", 3) == 0, "slot misuse: the consumer closes its connection while holding two slots (%s)", a);
    int back = wait_free(ch, pool, COUNT);
    CHECK(back, "slot misuse: slots held by a consumer that disconnects come back (free %u of %u)", free_slots(pool),
          (unsigned)COUNT);
    tell(&e, "read");
    a = reply(&e, ch);
    CHECK(strcmp(a,
          "R 2 0") == 0, "slot misuse: the consumer's imports stay readable after its connection closed (%s)", a);
    tell(&e, "release 2");
    a = reply(&e, ch);
    CHECK(strcmp(a, "R 2 0") == 0, "slot misuse: the imports release after the connection closed (%s)", a);
    CHECK(finish(&e, ch), "slot misuse: the consumer exits cleanly");

    Child f = spawn_child("host", "");
    const uint64_t peer_f = connect_child(ch, &f, address, "slot misuse (second consumer)");
    for (uint64_t seq = 3; seq <= 4 && peer_f; seq++) {
        DS_OK(devshare_pool_acquire(pool, IO_MS, &s, &ptr));
        item_fill(ptr, SLOT, seq);
        DS_OK(devshare_pool_send(pool, s, peer_f, NULL));
    }
    tell(&f, "recv 2 1 %d", IO_MS);
    r = recv_result(reply(&f, ch));
    tell(&f, "exit_holding");
    a = reply(&f, ch);
    close(f.to);
    close(f.from);
    const int exited = reap(f.pid);
    CHECK(r.got == 2 && exited, "slot misuse: a consumer process exits holding two slots");
    back = wait_free(ch, pool, COUNT);
    CHECK(back, "slot misuse: slots held by a consumer that exited come back (free %u of %u)", free_slots(pool),
          (unsigned)COUNT);
    uint64_t ids[4];
    CHECK(peer_count(ch, ids, 4) == 0, "slot misuse: the producer has no peer left");
    check_all_slots_return(pool, COUNT, "slot misuse");
    close_all(pool, exp, ch, "slot misuse");
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

static void test_leases(void) {
    char address[128];
    make_address(address, sizeof address, "leases");
    DevshareChannel *ch = NULL;
    DevshareExporter *exp = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    DS_OK(devshare_channel_host_alloc(65536, &exp, NULL));
    void *base = NULL;
    DS_OK(devshare_exporter_memory(exp, &base, NULL));
    DevshareHandle h;
    int32_t st = devshare_exporter_share(exp, NULL, &h);
    CHECK(st == DEVSHARE_STATUS_UNSUPPORTED, "leases: devshare_exporter_share refuses a channel-only memfd export (%s)",
          devshare_status_str(st));
    CHECK(outstanding_of(exp) == 0, "leases: the refused share left nothing outstanding");

    Child g = spawn_child("host", "");
    const uint64_t peer = connect_child(ch, &g, address, "leases");
    const int64_t len = 8192;
    const DevshareTensorDesc d = bytes_desc(4096, &len);
    item_fill_host((uint8_t *)base + 4096, 8192, 777, NULL);
    st = devshare_channel_send(ch, peer, exp, &d);
    CHECK(st == DEVSHARE_STATUS_OK,
          "leases: devshare_channel_send of a tensor in a memfd export (%s)", devshare_status_str(st));
    CHECK(outstanding_of(exp) == 1 && peer_leases(ch, peer) == 1,
          "leases: the lease is outstanding as soon as it is sent (exporter 1, peer info 1)");
    tell(&g, "recv 1 1 %d", IO_MS);
    RecvResult r = recv_result(reply(&g, ch));
    CHECK(r.got == 1 && r.lease == 1 && r.pool == 0 && r.kind_bad == 0,
          "leases: the consumer receives it as a lease (devshare_import_pool_slot says INVALID_ARGUMENT)");
    CHECK(r.data_bad == 0, "leases: the consumer reads back the tensor the producer wrote");
    devshare_channel_service(ch, 0);
    CHECK(outstanding_of(exp) == 1, "leases: still outstanding while the consumer holds the import");
    tell(&g, "release 1");
    const char *a = reply(&g, ch);
    st = devshare_exporter_wait(exp, IO_MS);
    CHECK(strcmp(a, "R 1 0") == 0 && st == DEVSHARE_STATUS_OK && outstanding_of(exp) == 0 && peer_leases(ch, peer) == 0,
          "leases: the consumer's release brings it to 0 (devshare_exporter_wait %s)", devshare_status_str(st));

    /* devshare_channel_send_batch: three leases in one call (one SHARES message), received in
     * order, each its own import; refusals send nothing. */
    const int64_t l4k = 4096;
    const DevshareTensorDesc bd[3] = {bytes_desc(0, &l4k), bytes_desc(4096, &l4k), bytes_desc(8192, &l4k)};
    const DevshareTensorDesc *bdp[3] = {&bd[0], &bd[1], &bd[2]};
    const DevshareExporter *bep[3] = {exp, exp, exp};
    for (int i = 0; i < 3; i++)
        item_fill_host((uint8_t *)base + 4096 * (size_t)i, 4096, 900 + (uint64_t)i, NULL);
    const DevshareTensorDesc far = bytes_desc(65536, &l4k);
    const DevshareTensorDesc *fp[2] = {&bd[0], &far};
    EXPECT_ERROR(devshare_channel_send_batch(ch, peer, bep, fp, 2), "devshare_channel_send_batch",
                 "leases: a batch with a description beyond the export");
    const DevshareExporter *np[2] = {exp, NULL};
    EXPECT_ERROR(devshare_channel_send_batch(ch, peer, np, bdp, 2), "devshare_channel_send_batch",
                 "leases: a batch with a NULL exporter");
    EXPECT_ERROR(devshare_channel_send_batch(ch, peer, NULL, bdp, 3), "devshare_channel_send_batch",
                 "leases: a batch with NULL exporters");
    CHECK(outstanding_of(exp) == 0, "leases: refused batches sent nothing");
    DS_OK(devshare_channel_send_batch(ch, peer, bep, bdp, 0));
    st = devshare_channel_send_batch(ch, peer, bep, bdp, 3);
    CHECK(st == DEVSHARE_STATUS_OK && outstanding_of(exp) == 3 && peer_leases(ch, peer) == 3,
          "leases: devshare_channel_send_batch of 3 leases (%s), all outstanding at once", devshare_status_str(st));
    tell(&g, "recv 3 1 %d", IO_MS);
    r = recv_result(reply(&g, ch));
    CHECK(r.got == 3 && r.lease == 3 && r.data_bad == 0 && r.kind_bad == 0,
          "leases: the consumer receives the batch as 3 leases, one per recv, data intact");
    tell(&g, "release 3");
    a = reply(&g, ch);
    st = devshare_exporter_wait(exp, IO_MS);
    CHECK(strcmp(a, "R 3 0") == 0 && st == DEVSHARE_STATUS_OK && outstanding_of(exp) == 0,
          "leases: releasing the batch's 3 imports returns its 3 leases (%s)", devshare_status_str(st));

    item_fill_host((uint8_t *)base + 4096, 8192, 778, NULL);
    DS_OK(devshare_channel_send(ch, peer, exp, &d));
    tell(&g, "recv 1 1 %d", IO_MS);
    r = recv_result(reply(&g, ch));
    CHECK(r.got == 1 && r.data_bad == 0 && outstanding_of(exp) == 1,
          "leases: a second lease is received and held (outstanding 1)");
    kill_child(&g);
    const int64_t t0 = now_ns();
    st = devshare_exporter_wait(exp, 1000);
    const double ms = (double)(now_ns() - t0) / 1e6;
    CHECK(st == DEVSHARE_STATUS_OK && outstanding_of(exp) == 0,
          "leases: after the consumer is SIGKILLed while holding, devshare_exporter_wait(1000) returns OK (%s, took "
          "%.2f ms after the consumer was reaped) and nothing is outstanding", devshare_status_str(st), ms);
    uint64_t ids[4];
    devshare_channel_service(ch, 0);
    CHECK(peer_count(ch, ids, 4) == 0, "leases: the killed consumer is no longer a peer");
    close_all(NULL, exp, ch, "leases");
}

static void test_producer_death(void) {
    char address[128];
    make_address(address, sizeof address, "death");
    Child p = spawn_child("producer", address);
    char line[1024];
    if (read_line_fd(p.from, line, sizeof line, IO_MS) < 0 || strcmp(line, "READY") != 0) {
        CHECK(0, "producer death: the producer child starts (%s)", line);
        kill_child(&p);
        return;
    }
    DevshareConnection *conn = NULL;
    int32_t st = devshare_channel_connect(address, IO_MS, &conn);
    if (!CHECK(st == DEVSHARE_STATUS_OK, "producer death: the consumer connects to the producer child (%s: %s)",
               devshare_status_str(st), st ? last_error() : "")) {
        kill_child(&p);
        return;
    }
    CHECK(devshare_connection_fd(conn) >= 0, "producer death: devshare_connection_fd gives a descriptor");
    const int sent = read_line_fd(p.from, line, sizeof line, IO_MS) >= 0 && strcmp(line, "SENT") == 0;
    CHECK(sent, "producer death: the producer sent a pool slot and a lease (%s)", line);
    char msg[1024];
    const RecvResult r = consume(conn, 2, 1, IO_MS, msg, sizeof msg);
    CHECK(r.got == 2 && r.pool == 1 && r.lease == 1 && r.data_bad == 0,
          "producer death: the consumer receives and holds a pool slot and a lease, intact (%s)", msg);
    kill_child(&p);
    DevshareImport *imp = NULL;
    st = devshare_connection_recv(conn, IO_MS, &imp);
    CHECK(st == DEVSHARE_STATUS_CLOSED,
          "producer death: after the producer is SIGKILLed, devshare_connection_recv returns DEVSHARE_STATUS_CLOSED "
          "(%s)",
          devshare_status_str(st));
    if (st == DEVSHARE_STATUS_OK) {
        devshare_import_release(imp);
    }
    int readable = n_held == 2;
    for (int i = 0; i < n_held; i++) {
        readable = readable && import_readable(held[i]);
    }
    CHECK(readable, "producer death: both imports are still readable after the producer died");
    const int fails = release_held(n_held);
    CHECK(fails == 0, "producer death: both imports release after the producer died");
    st = devshare_connection_recv(conn, 0, &imp);
    CHECK(st == DEVSHARE_STATUS_CLOSED, "producer death: a later recv still says CLOSED (%s)", devshare_status_str(st));
    st = devshare_connection_close(conn);
    CHECK(st == DEVSHARE_STATUS_OK, "producer death: the connection closes (%s)", devshare_status_str(st));
}

/* memfd descriptors open in this process, as a bit set over fd numbers below 1024. */
static void memfd_set(unsigned char *set) {
    memset(set, 0, 1024);
    DIR *d = opendir("/proc/self/fd");
    for (struct dirent *e; d && (e = readdir(d)) != NULL;) {
        char path[300], target[256];
        snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
        const ssize_t n = readlink(path, target, sizeof target - 1);
        const int fd = atoi(e->d_name);
        if (n > 7 && fd >= 0 && fd < 1024 && strncmp(target, "/memfd:", 7) == 0) {
            set[fd] = 1;
        }
    }
    if (d) {
        closedir(d);
    }
}

static void test_sealed_memfd(void) {
    enum { SLOT = 32768, SIZE = 2 * SLOT };
    unsigned char before[1024], after[1024];
    memfd_set(before);
    DevshareExporter *exp = NULL;
    DS_OK(devshare_channel_host_alloc(SIZE, &exp, NULL));
    memfd_set(after);
    int found = 0, shrink_refused = 0, grow_refused = 0, sealed = 0;
    for (int fd = 0; fd < 1024; fd++) {
        if (!after[fd] || before[fd]) {
            continue;
        }
        found++;
        errno = 0;
        shrink_refused += ftruncate(fd, 0) != 0 && errno == EPERM;
        errno = 0;
        grow_refused += ftruncate(fd, (off_t)SIZE * 4) != 0 && errno == EPERM;
        const int seals = fcntl(fd, F_GET_SEALS);
        const int want = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
        sealed += seals >= 0 && (seals & want) == want;
    }
    CHECK(found >= 1, "sealed memfd: devshare_channel_host_alloc makes a memfd (%d new)", found);
    CHECK(found >= 1 && shrink_refused == found, "sealed memfd: ftruncate(fd, 0) on it fails with EPERM");
    CHECK(found >= 1 && grow_refused == found, "sealed memfd: growing it fails with EPERM");
    CHECK(found >= 1 && sealed == found, "sealed memfd: F_GET_SEALS shows F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL");

    char address[128];
    make_address(address, sizeof address, "sealed");
    DevshareChannel *ch = NULL;
    DevsharePool *pool = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    DS_OK(devshare_pool_create(ch, exp, SLOT, 2, &pool));
    Child c = spawn_child("host", "");
    const uint64_t peer = connect_child(ch, &c, address, "sealed memfd");
    for (uint64_t seq = 1; seq <= 2 && peer; seq++) {
        uint32_t slot;
        void *ptr;
        DS_OK(devshare_pool_acquire(pool, IO_MS, &slot, &ptr));
        item_fill(ptr, SLOT, seq);
        DS_OK(devshare_pool_send(pool, slot, peer, NULL));
    }
    tell(&c, "recv 2 1 %d", IO_MS);
    const RecvResult r = recv_result(reply(&c, ch));
    CHECK(r.got == 2 && r.data_bad == 0, "sealed memfd: the consumer reads both whole slots without SIGBUS");
    tell(&c, "memfds");
    const char *a = reply(&c, ch);
    long v[2] = {0};
    CHECK(ints(a, v, 2) == 2 && v[0] == v[1],
          "sealed memfd: a memfd the consumer keeps open refuses ftruncate(fd, 0) with EPERM too "
          "(%ld open, %ld refused)",
          v[0], v[1]);
    tell(&c, "read");
    a = reply(&c, ch);
    CHECK(strcmp(a, "R 2 0") == 0, "sealed memfd: the consumer reads both slots again afterwards (%s)", a);
    CHECK(finish(&c, ch), "sealed memfd: the consumer exits cleanly");
    check_all_slots_return(pool, 2, "sealed memfd");
    close_all(pool, exp, ch, "sealed memfd");
}

/* Service `ch` until the pipe has a line (bounded). */
static int read_servicing(int fd, DevshareChannel *ch, char *buf, size_t cap) {
    const int64_t deadline = now_ms() + IO_MS;
    while (now_ms() < deadline) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 0) > 0) {
            return read_line_fd(fd, buf, cap, IO_MS);
        }
        devshare_channel_service(ch, 20);
    }
    return -1;
}

static void test_other_uid(void) {
    if (geteuid() != 0) {
        printf("SKIP: peer with another uid: tests do not run as root\n");
        return;
    }
    char address[128];
    make_address(address, sizeof address, "uid");
    DevshareChannel *ch = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    int pfd[2];
    if (pipe(pfd)) {
        perror("pipe");
        exit(2);
    }
    fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) {
        close(pfd[0]);
        char out[1200];
        if (setgroups(0, NULL) != 0 || setgid(65534) != 0 || setuid(65534) != 0 || geteuid() != 65534) {
            snprintf(out, sizeof out, "E could not become uid 65534: %s\n", strerror(errno));
        } else {
            DevshareConnection *conn = NULL;
            const int32_t st = devshare_channel_connect(address, 5000, &conn);
            snprintf(out, sizeof out, "R %d %.1000s\n", (int)st, st ? last_error() : "connected");
            if (st == DEVSHARE_STATUS_OK) {
                devshare_connection_close(conn);
            }
        }
        if (write(pfd[1], out, strlen(out)) < 0) {
            _exit(2);
        }
        _exit(0);
    }
    close(pfd[1]);
    char line[1200] = "";
    const int got = read_servicing(pfd[0], ch, line, sizeof line);
    close(pfd[0]);
    reap(pid);
    long v[1] = {0};
    const int parsed = got >= 0 && ints(line, v, 1) == 1;
    CHECK(parsed && v[0] == DEVSHARE_STATUS_UNTRUSTED,
          "peer with another uid: a consumer running as uid 65534 is refused by the root producer: UNTRUSTED (%s)",
          line);
    devshare_channel_service(ch, 0);
    uint64_t ids[4];
    CHECK(peer_count(ch, ids, 4) == 0, "peer with another uid: the producer kept no peer");
    close_all(NULL, NULL, ch, "peer with another uid");
}

static void test_restrict(void) {
    char address[128];
    make_address(address, sizeof address, "restrict");
    DevshareChannel *ch = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    Child c = spawn_child("host", "");
    const int32_t me = (int32_t)getpid();
    DS_OK(devshare_channel_restrict(ch, NULL, 0, &me, 1));
    tell(&c, "connect %s 5000", address);
    const char *a = reply(&c, ch);
    long v[1] = {0};
    uint64_t ids[4];
    CHECK(ints(a, v, 1) == 1 && v[0] == DEVSHARE_STATUS_UNTRUSTED && peer_count(ch, ids, 4) == 0,
          "restrict: a pid list without the consumer's pid refuses it (%s)", a);

    const uint32_t other_uid = geteuid() == 12345 ? 12346 : 12345;
    DS_OK(devshare_channel_restrict(ch, &other_uid, 1, NULL, 0));
    tell(&c, "connect %s 5000", address);
    a = reply(&c, ch);
    CHECK(ints(a, v, 1) == 1 && v[0] == DEVSHARE_STATUS_UNTRUSTED && peer_count(ch, ids, 4) == 0,
          "restrict: a uid list without the consumer's uid refuses it (%s)", a);

    const int32_t its_pid = (int32_t)c.pid;
    const uint32_t my_uid = geteuid();
    DS_OK(devshare_channel_restrict(ch, &my_uid, 1, &its_pid, 1));
    const uint64_t peer = connect_child(ch, &c, address, "restrict (the consumer's own pid and uid)");
    CHECK(peer != 0, "restrict: the consumer is accepted once the lists name it");
    CHECK(finish(&c, ch), "restrict: the consumer exits cleanly");
    close_all(NULL, NULL, ch, "restrict");
}

static void test_acl_pool(void) {
    enum { SLOT = 65536, COUNT = 4, ITEMS = 20 };
    const size_t size = 2u << 20;
    const aclError init = aclInit(NULL);
    if (init != ACL_SUCCESS && init != ACL_ERROR_REPEAT_INITIALIZE) {
        acl_or_die(init, "aclInit");
    }
    acl_or_die(aclrtSetDevice(0), "aclrtSetDevice(0)");
    void *dev = NULL;
    acl_or_die(aclrtMalloc(&dev, size, ACL_MEM_MALLOC_HUGE_FIRST), "aclrtMalloc");
    DevshareExporter *exp = NULL;
    DS_OK(devshare_export(DEVSHARE_BACKEND_ACL, 0, dev, size, 0, &exp));
    char address[128];
    make_address(address, sizeof address, "acl");
    DevshareChannel *ch = NULL;
    DevsharePool *pool = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    DS_OK(devshare_pool_create(ch, exp, SLOT, COUNT, &pool));
    /* The stand-in models a container (bare tgid != pid): whitelist the announced pid. Without
     * this the kernel's pid is whitelisted, which the import's pid check refuses. */
    DS_OK(devshare_channel_trust_announced_pids(ch, 1));
    g_acl = 1;
    Child k = spawn_child("acl", "");
    const uint64_t peer = connect_child(ch, &k, address, "acl pool");
    DevsharePeerInfo pinfo;
    memset(&pinfo, 0, sizeof pinfo);
    DS_OK(devshare_peer_info_init(&pinfo, sizeof pinfo));
    const int32_t pst = peer ? devshare_channel_peer_info(ch, peer, &pinfo) : DEVSHARE_STATUS_NOT_FOUND;
    CHECK(pst == DEVSHARE_STATUS_OK && pinfo.tgid == k.tgid && k.tgid != k.pid,
          "acl pool: the consumer announced its bare tgid in the handshake (%d; its pid is %d)", (int)pinfo.tgid,
          (int)k.pid);
    tell(&k, "recv %d 0 %d", ITEMS, IO_MS);
    int send_ok = peer != 0, ptr_bad = 0;
    for (uint64_t seq = 1; seq <= ITEMS && send_ok; seq++) {
        uint32_t slot;
        void *ptr;
        int32_t st = devshare_pool_acquire(pool, IO_MS, &slot, &ptr);
        if (st == DEVSHARE_STATUS_OK) {
            ptr_bad += slot >= COUNT || ptr != (uint8_t *)dev + (size_t)slot * SLOT;
            item_fill(ptr, SLOT, seq);
            st = devshare_pool_send(pool, slot, peer, NULL);
        }
        if (st != DEVSHARE_STATUS_OK) {
            printf("    item %" PRIu64 ": %s: %s\n", seq, devshare_status_str(st), last_error());
            send_ok = 0;
        }
    }
    const RecvResult r = recv_result(reply(&k, ch));
    CHECK(ptr_bad == 0, "acl pool: devshare_pool_acquire gives slot i at the device address base + i * slot_size");
    CHECK(send_ok && r.got == ITEMS && r.pool == ITEMS && r.data_bad == 0 && r.order_bad == 0 && r.rel_bad == 0,
          "acl pool: a channel consumer receives %d slots of an ACL export and reads them back, with no "
          "devshare_exporter_allow_pid call (%d received)", ITEMS, r.got);
    CHECK(r.addr_bad == 0 && r.slots >= 1 && r.slots <= COUNT,
          "acl pool: each slot keeps one device address in the consumer (%d slots seen)", r.slots);

    /* A plain handle of the same export, imported by a process that never connected. */
    DevshareHandle h;
    DS_OK(devshare_exporter_share(exp, NULL, &h));
    char text[DEVSHARE_HANDLE_MAX_TEXT_SIZE];
    DS_OK(devshare_handle_to_text(&h, text, sizeof text, NULL));
    Child l = spawn_child("acl", "");
    tell(&l, "import %s", text);
    const char *a = reply(&l, ch);
    CHECK(strncmp(a, "R -34", 5) == 0 && strstr(a, "207006") != NULL,
          "acl pool: a process that imports a plain handle of the export, without the channel, is refused by the "
          "pid whitelist (%s)", a);
    CHECK(finish(&l, ch), "acl pool: the refused process exits cleanly");
    CHECK(finish(&k, ch), "acl pool: the channel consumer exits cleanly");
    check_all_slots_return(pool, COUNT, "acl pool");
    const int32_t w = devshare_exporter_wait(exp, IO_MS);
    CHECK(w == DEVSHARE_STATUS_OK, "acl pool: the refused handle's reference came back (%s)", devshare_status_str(w));
    close_all(pool, exp, ch, "acl pool");
    acl_or_die(aclrtFree(dev), "aclrtFree");
    g_acl = 0;
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
} CudaState;

static CudaState cuda_state(Child *c, DevshareChannel *ch) {
    tell(c, "cuda_state");
    const char *a = reply(c, ch);
    long v[7];
    CudaState s = {-1, -1, -1, -1, -1, -1, -1};
    if (ints(a, v, 7) == 7) {
        s = (CudaState){(int)v[0], (int)v[1], (int)v[2], (int)v[3], (int)v[4], (int)v[5], (int)v[6]};
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

/* A segmented CUDA export (4 cuMemCreate segments of 2 MiB, POSIX fds) as a pool of one slot
 * per segment, to a consumer that cannot take the producer's descriptors with pidfd_getfd:
 * the producer is not dumpable and the consumer has no CAP_SYS_PTRACE, as in test_cuda_vmm's
 * refusal case. The segment fds must travel over the channel. Then the same pool with
 * DEVSHARE_SHARE_EVENT items. */
static void test_cuda_pool(void) {
    enum { COUNT = 4, ROUNDS = 3 };
    /* Without CAP_SYS_PTRACE on either side (as root too), the kernel's ordinary ptrace rules
     * decide whether the consumer may take the producer's fds. */
    drop_ptrace_capability();
    cuda_start();
    Vmm v;
    vmm_create(&v, COUNT);
    DevshareExporter *exp = NULL;
    DS_OK(devshare_export_segments(DEVSHARE_BACKEND_CUDA, 0, (void *)(uintptr_t)v.va, v.h, COUNT, SEG, 0, &exp));
    char address[128];
    make_address(address, sizeof address, "cuda_pool");
    DevshareChannel *ch = NULL;
    DevsharePool *pool = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    DS_OK(devshare_pool_create(ch, exp, SEG, COUNT, &pool));
    g_cuda = 1;
    Child k = spawn_child("cuda", "");
    const CudaState s0 = cuda_state(&k, ch);

    /* pidfd_getfd of the producer's stderr: the consumer's own probe. */
    const int scope = read_ptrace_scope();
    tell(&k, "getfd %d 2", (int)getpid());
    const char *a = reply(&k, ch);
    long e[1] = {-1};
    if (scope <= 0) {
        CHECK(ints(a, e, 1) == 1 && e[0] == 0,
              "cuda pool: while the producer is dumpable, its consumer can take a producer fd with pidfd_getfd "
              "(%s)", a);
    } else {
        printf("    # Yama ptrace_scope %d: pidfd_getfd of a dumpable producer: %s\n", scope, a);
    }
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    tell(&k, "getfd %d 2", (int)getpid());
    a = reply(&k, ch);
    CHECK(ints(a, e, 1) == 1 && e[0] == EPERM,
          "cuda pool: with the producer not dumpable, the consumer (no CAP_SYS_PTRACE) cannot take its fds with "
          "pidfd_getfd: EPERM (%s)", a);

    const uint64_t peer = connect_child(ch, &k, address, "cuda pool");
    uint64_t seq = 0;
    int send_ok = peer != 0, ptr_bad = 0, recv_ok = 1, addr_ok = 1, held_ok = 1, rel_ok = 1, back_ok = 1;
    CudaState held_state = {0};
    for (int round = 0; round < ROUNDS && send_ok; round++) {
        for (int i = 0; i < COUNT && send_ok; i++) {
            uint32_t slot;
            void *ptr;
            int32_t st = devshare_pool_acquire(pool, IO_MS, &slot, &ptr);
            if (st == DEVSHARE_STATUS_OK) {
                ptr_bad += slot >= COUNT || (CUdeviceptr)(uintptr_t)ptr != v.va + slot * SEG;
                item_fill(ptr, SEG, ++seq);
                st = devshare_pool_send(pool, slot, peer, NULL);
            }
            if (st != DEVSHARE_STATUS_OK) {
                printf("    item %" PRIu64 ": %s: %s\n", seq, devshare_status_str(st), last_error());
                send_ok = 0;
            }
        }
        tell(&k, "recv %d 1 %d", COUNT, IO_MS);
        const RecvResult r = recv_result(reply(&k, ch));
        recv_ok = recv_ok && r.got == COUNT && r.pool == COUNT && r.data_bad == 0 && r.order_bad == 0 &&
                  r.kind_bad == 0 && r.events == 0;
        addr_ok = addr_ok && r.addr_bad == 0 && r.slots == COUNT;
        held_state = cuda_state(&k, ch);
        held_ok = held_ok && held_state.resv == 1 && held_state.maps == COUNT && held_state.imported == COUNT &&
                  held_state.violations == 0;
        tell(&k, "release %d", COUNT);
        a = reply(&k, ch);
        rel_ok = rel_ok && strcmp(a, "R 4 0") == 0;
        back_ok = back_ok && wait_free(ch, pool, COUNT);
    }
    CHECK(send_ok && ptr_bad == 0,
          "cuda pool: %d items through %d slots of a 4-segment cuMemCreate export; slot i is at base + i * 2 MiB",
          ROUNDS * COUNT, COUNT);
    CHECK(recv_ok,
          "cuda pool: the consumer imports every item although pidfd_getfd is refused (the segment fds came over "
          "the channel) and reads back what the producer wrote with cuMemcpyDtoH");
    CHECK(addr_ok, "cuda pool: each of the %d slots keeps one device address in the consumer over %d rounds", COUNT,
          ROUNDS);
    CHECK(held_ok,
          "cuda pool: the consumer imported the allocation once: 1 reservation, %d mappings, %d imported handles "
          "(no violation)", COUNT, COUNT);
    show_cuda_state("cuda consumer holding 4 slots", held_state);
    CHECK(rel_ok && back_ok, "cuda pool: the consumer's releases bring every slot back");

    /* The same pool, the same consumer: items carry an interprocess event instead of a sync. */
    CUstream stream = NULL;
    cu_or_die(cuStreamCreate(&stream, 0), "cuStreamCreate");
    int ev_send_ok = 1, ev_recv_ok = 1, ev_waited_ok = 1, kept_ok = 1, gone_ok = 1, ev_rel_ok = 1;
    const int64_t slot_len = (int64_t)SEG;
    for (int round = 0; round < ROUNDS && ev_send_ok; round++) {
        for (int i = 0; i < COUNT && ev_send_ok; i++) {
            uint32_t slot;
            void *ptr;
            int32_t st = devshare_pool_acquire(pool, IO_MS, &slot, &ptr);
            if (st == DEVSHARE_STATUS_OK) {
                item_fill(ptr, SEG, ++seq);
                DevshareTensorDesc d = bytes_desc(0, &slot_len);
                d.flags = DEVSHARE_SHARE_EVENT;
                d.stream = seq % 2 ? stream : NULL; /* a stand-in stream, or all work on the device */
                st = devshare_pool_send(pool, slot, peer, &d);
            }
            if (st != DEVSHARE_STATUS_OK) {
                printf("    item %" PRIu64 ": %s: %s\n", seq, devshare_status_str(st), last_error());
                ev_send_ok = 0;
            }
        }
        kept_ok = kept_ok && live_events("cusi_e_") == COUNT;
        tell(&k, "recv %d 1 %d", COUNT, IO_MS);
        const RecvResult r = recv_result(reply(&k, ch));
        ev_recv_ok = ev_recv_ok && r.got == COUNT && r.pool == COUNT && r.data_bad == 0 && r.order_bad == 0 &&
                     r.addr_bad == 0 && r.slots == COUNT;
        ev_waited_ok = ev_waited_ok && r.events == COUNT && r.waited == COUNT;
        kept_ok = kept_ok && live_events("cusi_e_") == COUNT;
        tell(&k, "release %d", COUNT);
        a = reply(&k, ch);
        ev_rel_ok = ev_rel_ok && strcmp(a, "R 4 0") == 0 && wait_free(ch, pool, COUNT);
        gone_ok = gone_ok && live_events("cusi_e_") == 0;
    }
    CHECK(ev_send_ok, "cuda pool events: %d items sent with DEVSHARE_SHARE_EVENT (a stream, or NULL)", ROUNDS * COUNT);
    CHECK(ev_recv_ok, "cuda pool events: the consumer reads every item back, each slot at its earlier address");
    CHECK(ev_waited_ok,
          "cuda pool events: every item carries an IPC event that devshare_connection_recv had waited on exactly "
          "once when it returned (cusi_event_waits)");
    CHECK(kept_ok, "cuda pool events: the producer keeps one live event per slot out with the consumer");
    CHECK(ev_rel_ok && gone_ok, "cuda pool events: each slot's event is destroyed when the slot comes back");
    const CudaState s1 = cuda_state(&k, ch);
    CHECK(s1.resv == 1 && s1.maps == COUNT && s1.imported == COUNT,
          "cuda pool events: still the one attachment (%d reservations, %d mappings, %d imported)", s1.resv, s1.maps,
          s1.imported);
    prctl(PR_SET_DUMPABLE, 1, 0, 0, 0);

    check_all_slots_return(pool, COUNT, "cuda pool");
    const int32_t pc = devshare_pool_close(pool);
    tell(&k, "recv 1 0 0");
    const RecvResult rc = recv_result(reply(&k, ch));
    const CudaState s2 = cuda_state(&k, ch);
    CHECK(pc == DEVSHARE_STATUS_OK && rc.got == 0 && rc.st == DEVSHARE_STATUS_TIMEOUT && s2.resv == 0 &&
              s2.maps == 0 && s2.handles == 0 && s2.imported == 0 && s2.allocs == 0 && s2.violations == 0,
          "cuda pool: after devshare_pool_close the consumer's next recv detaches: nothing reserved, mapped or "
          "imported is left in it");
    show_cuda_state("cuda consumer after the pool closed", s2);
    int32_t st = devshare_exporter_wait(exp, IO_MS);
    CHECK(st == DEVSHARE_STATUS_OK, "cuda pool: the consumer's detach reaches the producer (devshare_exporter_wait %s)",
          devshare_status_str(st));
    tell(&k, "close");
    a = reply(&k, ch);
    const CudaState s3 = cuda_state(&k, ch);
    CHECK(strncmp(a, "R 0", 3) == 0 && s3.fds == s0.fds,
          "cuda pool: once its connection is closed the consumer has as many fds open as before it connected "
          "(%d -> %d): every segment fd that came over the channel is closed", s0.fds, s3.fds);
    CHECK(finish(&k, ch), "cuda pool: the consumer exits cleanly");
    close_all(NULL, exp, ch, "cuda pool");
    cu_or_die(cuStreamDestroy(stream), "cuStreamDestroy");
    vmm_destroy(&v);
    CHECK(cusi_vmm_reservations() == 0 && cusi_vmm_mappings() == 0 && cusi_vmm_handles() == 0 &&
              cusi_vmm_allocations() == 0,
          "cuda pool: the producer holds no VMM object afterwards");
    g_cuda = 0;
}

/* A leased devshare_channel_send of a plain CUDA export (cuMemAlloc, legacy IPC handle) with
 * DEVSHARE_SHARE_EVENT. */
static void test_cuda_lease_event(void) {
    const size_t size = 1u << 20;
    cuda_start();
    CUdeviceptr dev = 0;
    cu_or_die(cuMemAlloc(&dev, size), "cuMemAlloc");
    DevshareExporter *exp = NULL;
    DS_OK(devshare_export(DEVSHARE_BACKEND_CUDA, 0, (void *)(uintptr_t)dev, size, 0, &exp));
    char address[128];
    make_address(address, sizeof address, "cuda_lease");
    DevshareChannel *ch = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    g_cuda = 1;
    Child k = spawn_child("cuda", "");
    const uint64_t peer = connect_child(ch, &k, address, "cuda lease event");
    CUstream stream = NULL;
    cu_or_die(cuStreamCreate(&stream, 0), "cuStreamCreate");
    const int64_t len = 65536;
    for (int with_stream = 1; with_stream >= 0 && peer; with_stream--) {
        const char *how = with_stream ? "recorded on a stream" : "recorded with a NULL stream";
        item_fill((void *)(uintptr_t)(dev + 8192), (uint64_t)len, 900 + (uint64_t)with_stream);
        DevshareTensorDesc d = bytes_desc(8192, &len);
        d.flags = DEVSHARE_SHARE_EVENT;
        d.stream = with_stream ? stream : NULL;
        int32_t st = devshare_channel_send(ch, peer, exp, &d);
        CHECK(st == DEVSHARE_STATUS_OK && outstanding_of(exp) == 1 && live_events("cusi_e_") == 1,
              "cuda lease event (%s): devshare_channel_send of a cuMemAlloc export with DEVSHARE_SHARE_EVENT; the "
              "lease is outstanding and the producer holds its event (%s)", how, devshare_status_str(st));
        tell(&k, "recv 1 1 %d", IO_MS);
        const RecvResult r = recv_result(reply(&k, ch));
        CHECK(r.got == 1 && r.lease == 1 && r.data_bad == 0 && r.events == 1 && r.waited == 1,
              "cuda lease event (%s): the consumer receives the lease and reads it back; recv had waited on its "
              "IPC event exactly once (%d events, %d waited once)", how, r.events, r.waited);
        tell(&k, "lease_opens");
        const char *a = reply(&k, ch);
        devshare_channel_service(ch, 0);
        CHECK(strcmp(a, "R 1") == 0 && live_events("cusi_e_") == 1 && outstanding_of(exp) == 1,
              "cuda lease event (%s): while the consumer holds it: one live IPC open of the allocation (%s), the "
              "event still kept", how, a);
        tell(&k, "release 1");
        a = reply(&k, ch);
        st = devshare_exporter_wait(exp, IO_MS);
        CHECK(strcmp(a, "R 1 0") == 0 && st == DEVSHARE_STATUS_OK && outstanding_of(exp) == 0 &&
                  live_events("cusi_e_") == 0,
              "cuda lease event (%s): the release brings the lease back (devshare_exporter_wait %s) and the "
              "producer destroys the event", how, devshare_status_str(st));
        tell(&k, "lease_opens");
        a = reply(&k, ch);
        CHECK(strcmp(a, "R 0") == 0, "cuda lease event (%s): the consumer closed its IPC mapping (%s)", how, a);
    }
    const CudaState s = cuda_state(&k, ch);
    CHECK(s.violations == 0, "cuda lease event: the consumer broke no driver rule (%d)", s.violations);
    CHECK(finish(&k, ch), "cuda lease event: the consumer exits cleanly");
    close_all(NULL, exp, ch, "cuda lease event");
    cu_or_die(cuStreamDestroy(stream), "cuStreamDestroy");
    cu_or_die(cuMemFree(dev), "cuMemFree");
    g_cuda = 0;
}

/* A leased devshare_channel_send of an ACL export with DEVSHARE_SHARE_EVENT: no
 * devshare_exporter_allow_pid call, the handshake whitelists the consumer. */
static void test_acl_lease_event(void) {
    const size_t size = 2u << 20;
    const aclError init = aclInit(NULL);
    if (init != ACL_SUCCESS && init != ACL_ERROR_REPEAT_INITIALIZE) {
        acl_or_die(init, "aclInit");
    }
    acl_or_die(aclrtSetDevice(0), "aclrtSetDevice(0)");
    void *dev = NULL;
    acl_or_die(aclrtMalloc(&dev, size, ACL_MEM_MALLOC_HUGE_FIRST), "aclrtMalloc");
    DevshareExporter *exp = NULL;
    DS_OK(devshare_export(DEVSHARE_BACKEND_ACL, 0, dev, size, 0, &exp));
    char address[128];
    make_address(address, sizeof address, "acl_event");
    DevshareChannel *ch = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    /* The stand-in models a container: a consumer's bare tgid is not its pid here. */
    DS_OK(devshare_channel_trust_announced_pids(ch, 1));
    g_acl = 1;
    Child k = spawn_child("acl", "");
    const uint64_t peer = connect_child(ch, &k, address, "acl lease event");
    aclrtStream stream = NULL;
    acl_or_die(aclrtCreateStream(&stream), "aclrtCreateStream");
    const int64_t len = 65536;
    item_fill((uint8_t *)dev + 4096, (uint64_t)len, 903);
    DevshareTensorDesc d = bytes_desc(4096, &len);
    d.flags = DEVSHARE_SHARE_EVENT;
    d.stream = stream;
    int32_t st = peer ? devshare_channel_send(ch, peer, exp, &d) : DEVSHARE_STATUS_NOT_FOUND;
    CHECK(st == DEVSHARE_STATUS_OK && outstanding_of(exp) == 1 && live_events("aclsi_e_") == 1,
          "acl lease event: devshare_channel_send of an ACL export with DEVSHARE_SHARE_EVENT; the lease is "
          "outstanding and the producer holds its event (%s)", devshare_status_str(st));
    tell(&k, "recv 1 1 %d", IO_MS);
    const RecvResult r = recv_result(reply(&k, ch));
    CHECK(r.got == 1 && r.lease == 1 && r.data_bad == 0,
          "acl lease event: the consumer, never named with devshare_exporter_allow_pid, imports the lease and reads "
          "it back (whitelisted through the handshake)");
    CHECK(r.events == 1 && r.waited == 1,
          "acl lease event: recv had waited on the lease's IPC event exactly once when it returned (%d events, %d "
          "waited once)", r.events, r.waited);
    devshare_channel_service(ch, 0);
    CHECK(live_events("aclsi_e_") == 1 && outstanding_of(exp) == 1,
          "acl lease event: the producer keeps the event while the consumer holds the lease");
    tell(&k, "release 1");
    const char *a = reply(&k, ch);
    st = devshare_exporter_wait(exp, IO_MS);
    CHECK(strcmp(a, "R 1 0") == 0 && st == DEVSHARE_STATUS_OK && outstanding_of(exp) == 0 &&
              live_events("aclsi_e_") == 0,
          "acl lease event: the release brings the lease back (devshare_exporter_wait %s) and the producer destroys "
          "the event", devshare_status_str(st));
    CHECK(finish(&k, ch), "acl lease event: the consumer exits cleanly");
    close_all(NULL, exp, ch, "acl lease event");
    acl_or_die(aclrtDestroyStream(stream), "aclrtDestroyStream");
    acl_or_die(aclrtFree(dev), "aclrtFree");
    g_acl = 0;
}

int main(int argc, char **argv) {
    if (argc > 2 && strcmp(argv[1], "--child") == 0) {
        if (strcmp(argv[2], "producer") == 0) {
            return producer_child(argc > 3 ? argv[3] : "");
        }
        g_acl = strcmp(argv[2], "acl") == 0;
        g_cuda = strcmp(argv[2], "cuda") == 0;
        return consumer_child();
    }
    if (!getenv("DEVSHARE_ACL_LIBRARY") || !getenv("DEVSHARE_CUDA_LIBRARY")) {
        fprintf(stderr, "test_channel: set DEVSHARE_ACL_LIBRARY and DEVSHARE_CUDA_LIBRARY to the stand-ins "
                        "(libascendcl.so, libcuda.so.1)\n");
        return 2;
    }
    harness_start("test_channel");
    signal(SIGPIPE, SIG_IGN); /* a write to a dead child's pipe is an error, not our death */
    track(getpid());

    test_bad_inputs();
    test_host_pool();
    test_backpressure();
    test_two_consumers();
    test_slot_misuse();
    test_leases();
    test_producer_death();
    test_sealed_memfd();
    test_other_uid();
    test_restrict();
    test_acl_pool();
    test_acl_lease_event();
    test_cuda_pool();
    test_cuda_lease_event();

    int left = 0;
    for (int i = 0; i < n_tracked; i++) {
        left += shm_names_of(tracked[i], 0);
    }
    CHECK(left == 0, "no /dev/shm object carries the pid of this test or of a host or CUDA consumer (%d)", left);
    harness_check_log(aclsi_violation_count() + cusi_violation_count(), "the ACL and CUDA stand-ins");
    return harness_done();
}
