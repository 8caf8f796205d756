/* SPDX-License-Identifier: Apache-2.0 */
/*
 * device_harness.h: what the device tests (test_acl, test_acl_vmm, test_cuda, test_cuda_vmm)
 * share on top of harness.h. A producer (the test's parent) hands handles to consumer children:
 * this program re-executed with "--child", which first prints "PID <pid for the whitelist>
 * <getpid()>" and then answers one line per command on its stdout. Also: shares of float32
 * tensors, and reading a ref-counter slot straight from /dev/shm.
 *
 * Include in one test program (everything here is static), after defining HARNESS_NAME; call
 * harness_start("<tag>") first (it finds this program and starts the stand-in's log) and end with
 * harness_check_log(...) and harness_done().
 */
#ifndef DEVSHARE_TEST_DEVICE_HARNESS_H
#define DEVSHARE_TEST_DEVICE_HARNESS_H

#include "harness.h"

#define KIB 1024u
#define MIB (1024u * 1024u)
enum { IO_TIMEOUT_MS = 20000 };

/* ---------------------------------------------------------------------------------------- */
/* Consumer children */

typedef struct {
    pid_t pid;
    int to, from;
    int32_t bare_tgid, os_pid;
} Child;

/* Start a consumer child (with `env_name`=`env_value` in its environment when env_name is set). */
static inline Child spawn(const char *env_name, const char *env_value) {
    Child c = {0};
    char *argv[] = {self_path, "--child", NULL};
    const SpawnOptions opt = {.env_name = env_name, .env_value = env_value};
    c.pid = spawn_piped(argv, &opt, &c.to, &c.from);
    char line[256];
    if (read_line_fd(c.from, line, sizeof line, IO_TIMEOUT_MS) <= 0 ||
        sscanf(line, "PID %d %d", &c.bare_tgid, &c.os_pid) != 2) {
        die("child start", 0);
    }
    return c;
}

/* Send one command (any length), return the answer line (static buffer). */
static inline const char *vask(Child *c, const char *fmt, va_list ap) {
    static char answer[4096];
    if (vwrite_line_fd(c->to, fmt, ap) != 0) {
        die("write to child", errno);
    }
    if (read_line_fd(c->from, answer, sizeof answer, IO_TIMEOUT_MS) < 0) {
        snprintf(answer, sizeof answer, "ERR 0 no answer from the child");
    }
    return answer;
}

__attribute__((format(printf, 2, 3))) static inline const char *ask(Child *c, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    const char *answer = vask(c, fmt, ap);
    va_end(ap);
    return answer;
}

/* "quit", then a bounded wait: 1 when the child exited with status 0. */
static inline int finish(Child *c) {
    ask(c, "quit");
    close(c->to);
    close(c->from);
    return exited_zero(wait_exit(c->pid, IO_TIMEOUT_MS));
}

static inline DevshareHandle share_f32(DevshareExporter *e, uint64_t storage_offset, uint64_t storage_size,
                                       int64_t rows, int64_t cols, int64_t tensor_offset, uint32_t flags,
                                       void *stream) {
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
    d.flags = flags;
    d.stream = stream;
    DevshareHandle h;
    DS_OK(devshare_exporter_share(e, &d, &h));
    return h;
}

static inline uint64_t outstanding(DevshareExporter *e) {
    uint64_t n = 0;
    DS_OK(devshare_exporter_outstanding(e, &n));
    return n;
}

/* The value of a handle's ref-counter slot, read straight from the shm object (-999: unreadable). */
static inline int64_t slot_value(const DevshareHandle *h) {
    char path[128];
    snprintf(path, sizeof path, "/dev/shm/%.*s", (int)h->ref_name_len - 1, (const char *)h->ref_name + 1);
    FILE *f = fopen(path, "rb");
    int64_t v = -999;
    if (f && fseek(f, 64 + 8 * (long)h->ref_slot, SEEK_SET) == 0 && fread(&v, sizeof v, 1, f) != 1) {
        v = -999;
    }
    if (f) {
        fclose(f);
    }
    return v;
}

#endif /* DEVSHARE_TEST_DEVICE_HARNESS_H */
