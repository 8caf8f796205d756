/* SPDX-License-Identifier: Apache-2.0 */
/*
 * device_harness.h: what test_acl and test_cuda share. A producer (the test's parent) hands
 * handles to consumer children: this program re-executed with "--child", which first prints
 * "PID <pid for the whitelist> <getpid()>" and then answers one line per command on its stdout.
 * Also: tap-style checks, the stand-in's violation log, shares of float32 tensors, and reading
 * a ref-counter slot straight from /dev/shm.
 *
 * Include after devshare.h, in one test program (everything here is static). Define
 * HARNESS_NAME (used in fatal messages) before including it.
 */
#ifndef DEVSHARE_TEST_DEVICE_HARNESS_H
#define DEVSHARE_TEST_DEVICE_HARNESS_H

#include "devshare.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define KIB 1024u
#define MIB (1024u * 1024u)
enum { IO_TIMEOUT_MS = 20000 };

static int n_cases, n_failed;

__attribute__((format(printf, 2, 3))) static int check(int ok, const char *fmt, ...) {
    va_list ap;
    n_cases++;
    printf("%s - ", ok ? "ok" : "FAIL");
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
    fflush(stdout);
    if (!ok) {
        n_failed++;
    }
    return ok;
}

static const char *last_error(void) {
    static char msg[2048];
    devshare_last_error(msg, sizeof msg);
    return msg;
}

static void die(const char *what, long code) {
    fprintf(stderr, HARNESS_NAME ": %s failed (%ld): %s\n", what, code, last_error());
    exit(2);
}

#define DS_OK(call)                                                                                               \
    do {                                                                                                          \
        int32_t st_ = (call);                                                                                     \
        if (st_ != DEVSHARE_STATUS_OK) {                                                                          \
            die(#call, st_);                                                                                      \
        }                                                                                                         \
    } while (0)

static int read_line_fd(int fd, char *buf, size_t cap, int timeout_ms) {
    size_t n = 0;
    while (n + 1 < cap) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        const int r = poll(&p, 1, timeout_ms);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            return -1;
        }
        char c;
        const ssize_t got = read(fd, &c, 1);
        if (got < 0 && errno == EINTR) {
            continue;
        }
        if (got <= 0) {
            return n ? (int)n : -1;
        }
        if (c == '\n') {
            break;
        }
        buf[n++] = c;
    }
    buf[n] = '\0';
    return (int)n;
}

/* ---------------------------------------------------------------------------------------- */
/* Consumer children */

typedef struct {
    pid_t pid;
    int to, from;
    int32_t bare_tgid, os_pid;
} Child;

/* Bytes as hex text ("-" for none), and back: the bytes, or -1 for text that is not hex of at
 * most `cap` bytes. How the tests put byte fields on a command line. */
static inline void hex_encode(const uint8_t *b, size_t n, char *out) {
    for (size_t i = 0; i < n; i++) {
        sprintf(out + 2 * i, "%02x", b[i]);
    }
    out[2 * n] = '\0';
    if (n == 0) {
        strcpy(out, "-");
    }
}

static inline int hex_decode(const char *hex, uint8_t *out, size_t cap) {
    if (strcmp(hex, "-") == 0) {
        return 0;
    }
    size_t n = strlen(hex);
    if (n % 2 || n / 2 > cap) {
        return -1;
    }
    for (size_t i = 0; i < n / 2; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1) {
            return -1;
        }
        out[i] = (uint8_t)v;
    }
    return (int)(n / 2);
}

static char self_path[4096];

/* Start a consumer child, with `env_name`=`env_value` in its environment when env_name is set. */
static Child spawn(const char *env_name, const char *env_value) {
    int in[2], out[2];
    if (pipe(in) || pipe(out)) {
        die("pipe", errno);
    }
    Child c = {0};
    c.pid = fork();
    if (c.pid < 0) {
        die("fork", errno);
    }
    if (c.pid == 0) {
        dup2(in[0], 0);
        dup2(out[1], 1);
        close(in[0]);
        close(in[1]);
        close(out[0]);
        close(out[1]);
        if (env_name) {
            setenv(env_name, env_value, 1);
        }
        execl(self_path, self_path, "--child", (char *)NULL);
        _exit(127);
    }
    close(in[0]);
    close(out[1]);
    c.to = in[1];
    c.from = out[0];
    char line[256];
    if (read_line_fd(c.from, line, sizeof line, IO_TIMEOUT_MS) <= 0 ||
        sscanf(line, "PID %d %d", &c.bare_tgid, &c.os_pid) != 2) {
        die("child start", 0);
    }
    return c;
}

/* Send one command, return the answer line (static buffer). */
static const char *ask(Child *c, const char *fmt, ...) {
    static char answer[4096];
    char cmd[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    const size_t len = strlen(cmd);
    cmd[len] = '\n';
    if (write(c->to, cmd, len + 1) != (ssize_t)(len + 1)) {
        die("write to child", errno);
    }
    if (read_line_fd(c->from, answer, sizeof answer, IO_TIMEOUT_MS) < 0) {
        snprintf(answer, sizeof answer, "ERR 0 no answer from the child");
    }
    return answer;
}

static int finish(Child *c) {
    ask(c, "quit");
    close(c->to);
    close(c->from);
    int status = 0;
    waitpid(c->pid, &status, 0);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

static DevshareHandle share_f32(DevshareExporter *e, uint64_t storage_offset, uint64_t storage_size, int64_t rows,
                                int64_t cols, int64_t tensor_offset, uint32_t flags, void *stream) {
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

static uint64_t outstanding(DevshareExporter *e) {
    uint64_t n = 0;
    DS_OK(devshare_exporter_outstanding(e, &n));
    return n;
}

/* The value of a handle's ref-counter slot, read straight from the shm object (-999: unreadable). */
static int64_t slot_value(const DevshareHandle *h) {
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

/* ---------------------------------------------------------------------------------------- */
/* The stand-in's violation log */

static char log_path[256];

static int log_is_empty(void) {
    struct stat st;
    return stat(log_path, &st) != 0 || st.st_size == 0;
}

static void show_log(void) {
    FILE *f = fopen(log_path, "r");
    char line[512];
    while (f && fgets(line, sizeof line, f)) {
        printf("# stand-in: %s", line);
    }
    if (f) {
        fclose(f);
    }
}

/* Find this program (children re-execute it) and send every process's violations to a fresh log. */
static void harness_start(const char *log_tag) {
    ssize_t n = readlink("/proc/self/exe", self_path, sizeof self_path - 1);
    if (n <= 0) {
        die("readlink /proc/self/exe", errno);
    }
    self_path[n] = '\0';
    snprintf(log_path, sizeof log_path, "/tmp/devshare_%s_%ld.log", log_tag, (long)getpid());
    unlink(log_path);
    setenv("DEVSHARE_STANDIN_LOG", log_path, 1);
}

/* The final check: no stand-in rule broken in any process; prints the log otherwise. */
static void harness_check_log(int in_process_violations) {
    check(in_process_violations == 0 && log_is_empty(), "the stand-in recorded no rule violation in any process");
    if (!log_is_empty()) {
        show_log();
    }
    unlink(log_path);
}

#endif /* DEVSHARE_TEST_DEVICE_HARNESS_H */
