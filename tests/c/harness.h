/* SPDX-License-Identifier: Apache-2.0 */
/*
 * harness.h: what the C test programs share, once (the programs of tests/c, and gpu_tool of
 * tests/gpu; the topic headers device_harness.h and channel_harness.h include it and add their
 * own).
 *
 *  - Reporting, TAP style: CHECK(cond, fmt, ...) prints "ok - <what>", or "FAIL - <what>  (line N)"
 *    and counts a failure; EXPECT_ERROR(status, fn, what): an error status whose last error
 *    names `fn`; harness_done() prints the plan and the tally and gives the exit status.
 *  - Fatal setup errors (later cases would only cascade): DS_OK(call), a devshare call that must
 *    return DEVSHARE_STATUS_OK; die(what, code); both print to stderr and exit 2. ds_error()
 *    words a failed devshare call, last_error() is devshare_last_error's text.
 *  - Clocks (CLOCK_MONOTONIC): now_ns(), now_ms(), now_us(); sleep_ms().
 *  - Parsing: parse_i64() (a whole decimal number), hex_encode() / hex_decode() (bytes as hex
 *    text, "-" for none: how the tests put byte fields on a command line).
 *  - Children on pipes and their line protocol: harness_start() (finds this program, which
 *    children re-execute; optionally a fresh stand-in violation log for every process),
 *    spawn_piped() (a child with its stdin and stdout on pipes), write_line_fd() (one command
 *    line of any length), read_line_fd() (one line within a deadline), say() (one line on
 *    stdout in one write), wait_exit() (a bounded wait for a child's exit), exited_zero().
 *  - The stand-ins' violation log: harness_check_log() (the final check of a device test).
 *  - This process: open_fds(), read_ptrace_scope(), and with _GNU_SOURCE drop_ptrace_capability().
 *
 * Define HARNESS_NAME (the program's name, for messages) and a feature-test macro
 * (_POSIX_C_SOURCE 200809L or _GNU_SOURCE) before including it, in one program: everything here
 * is static (functions static inline, so that a program may leave any of them unused).
 */
#ifndef DEVSHARE_TEST_HARNESS_H
#define DEVSHARE_TEST_HARNESS_H

#ifndef HARNESS_NAME
#error "define HARNESS_NAME (the program's name, used in messages) before including harness.h"
#endif

#include "devshare.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ---------------------------------------------------------------------------------------- */
/* devshare's errors */

static inline const char *last_error(void) {
    static char msg[2048];
    devshare_last_error(msg, sizeof msg);
    return msg;
}

/* The last error message starts with "<fn>:". */
static inline int last_error_names(const char *fn) {
    const char *msg = last_error();
    const size_t n = strlen(fn);
    return strncmp(msg, fn, n) == 0 && msg[n] == ':';
}

/* "<call> failed: <status name> (<code>): <devshare_last_error>" into buf; returns buf. */
static inline const char *ds_error(char *buf, size_t cap, const char *call, int32_t status) {
    const char *name = devshare_status_str(status);
    if (snprintf(buf, cap, "%s failed: %s (%d): %s", call, name, (int)status, last_error()) < 0) {
        buf[0] = '\0';
    }
    return buf; /* cut to fit */
}

/* A setup step failed: say so on stderr (a child's stdout is its parent's pipe) and exit 2. */
__attribute__((noreturn)) static inline void die(const char *what, long code) {
    fflush(stdout);
    fprintf(stderr, HARNESS_NAME ": %s failed (%ld): %s\n", what, code, last_error());
    exit(2);
}

__attribute__((noreturn)) static inline void harness_ds_fail(int line, const char *call, int32_t status) {
    char msg[4096];
    fflush(stdout);
    fprintf(stderr, HARNESS_NAME ": line %d: %s\n", line, ds_error(msg, sizeof msg, call, status));
    exit(2);
}

/* A devshare call that must succeed (setting up a case): anything else ends the program. */
#define DS_OK(call)                                                                                                   \
    do {                                                                                                              \
        const int32_t ds_ok_st_ = (call);                                                                             \
        if (ds_ok_st_ != DEVSHARE_STATUS_OK) {                                                                        \
            harness_ds_fail(__LINE__, #call, ds_ok_st_);                                                              \
        }                                                                                                             \
    } while (0)

/* ---------------------------------------------------------------------------------------- */
/* Reporting */

static int n_cases, n_failed;

/* One case: "ok - <what>" or "FAIL - <what>", with "  (line N)" on a failure when line > 0.
 * Returns ok. Call it through CHECK. */
__attribute__((format(printf, 3, 4))) static inline int harness_check(int ok, int line, const char *fmt, ...) {
    va_list ap;
    n_cases++;
    printf("%s - ", ok ? "ok" : "FAIL");
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    if (!ok) {
        n_failed++;
        if (line > 0) {
            printf("  (line %d)", line);
        }
    }
    printf("\n");
    fflush(stdout);
    return ok;
}
#define CHECK(cond, ...) harness_check((cond) != 0, __LINE__, __VA_ARGS__)

/* `status` is an error (any non-OK status) and the last error names `fn`. */
static inline int harness_expect_error(int line, int32_t status, const char *fn, const char *what) {
    const int ok = status < 0 && last_error_names(fn);
    harness_check(ok, line, "%s: %s -> error (%s)", fn, what, devshare_status_str(status));
    if (!ok) {
        printf("    got %d, last error: %s\n", (int)status, last_error());
    }
    return ok;
}
#define EXPECT_ERROR(status, fn, what) harness_expect_error(__LINE__, (status), (fn), (what))

/* The plan and the tally; the program's exit status (0 when every case passed). */
static inline int harness_done(void) {
    printf("1..%d\n# %d passed, %d failed\n", n_cases, n_cases - n_failed, n_failed);
    fflush(stdout);
    return n_failed == 0 ? 0 : 1;
}

/* ---------------------------------------------------------------------------------------- */
/* Clocks */

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline int64_t now_ms(void) { return now_ns() / 1000000; }

static inline double now_us(void) { return (double)now_ns() / 1e3; }

static inline void sleep_ms(int64_t ms) {
    struct timespec ts = {.tv_sec = (time_t)(ms / 1000), .tv_nsec = (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Parsing */

/* A whole decimal int64 (no sign-only, empty or trailing text); 0 on success, -1 otherwise. */
static inline int parse_i64(const char *s, int64_t *out) {
    if (s == NULL || *s == '\0') {
        return -1;
    }
    char *end = NULL;
    errno = 0;
    const long long v = strtoll(s, &end, 10);
    if (errno != 0 || *end != '\0') {
        return -1;
    }
    *out = (int64_t)v;
    return 0;
}

/* `n` bytes as lowercase hex into out (room for 2 * n + 2 chars), "-" for none; returns out. */
static inline char *hex_encode(const uint8_t *b, size_t n, char *out) {
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[b[i] >> 4];
        out[2 * i + 1] = digits[b[i] & 15];
    }
    out[2 * n] = '\0';
    if (n == 0) {
        strcpy(out, "-");
    }
    return out;
}

static inline int hex_digit(char c) {
    if (c >= '0' && c <= '9') {
        return c - '0';
    }
    if (c >= 'a' && c <= 'f') {
        return c - 'a' + 10;
    }
    if (c >= 'A' && c <= 'F') {
        return c - 'A' + 10;
    }
    return -1;
}

/* Hex text ("-" or "" for none) into at most `cap` bytes: their count, or -1 for text that is
 * not hex of at most `cap` bytes. */
static inline int hex_decode(const char *hex, uint8_t *out, size_t cap) {
    if (strcmp(hex, "-") == 0) {
        return 0;
    }
    const size_t n = strlen(hex);
    if (n % 2 || n / 2 > cap) {
        return -1;
    }
    for (size_t i = 0; i < n / 2; i++) {
        const int hi = hex_digit(hex[2 * i]), lo = hex_digit(hex[2 * i + 1]);
        if (hi < 0 || lo < 0) {
            return -1;
        }
        out[i] = (uint8_t)(hi << 4 | lo);
    }
    return (int)(n / 2);
}

/* ---------------------------------------------------------------------------------------- */
/* Lines */

/* One line from `fd` without its newline, within `timeout_ms` in all: its length, or -1 on
 * timeout, error or end of file before a newline. A line longer than cap - 1 is returned in
 * pieces. */
static inline int read_line_fd(int fd, char *buf, size_t cap, int timeout_ms) {
    size_t n = 0;
    const int64_t deadline = now_ms() + timeout_ms;
    while (n + 1 < cap) {
        const int64_t left = deadline - now_ms();
        struct pollfd p = {.fd = fd, .events = POLLIN};
        const int r = poll(&p, 1, left > 0 ? (int)left : 0);
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
            return -1;
        }
        if (c == '\n') {
            break;
        }
        buf[n++] = c;
    }
    buf[n] = '\0';
    return (int)n;
}

/* The whole of `len` bytes to fd; 0, or -1 with errno set. */
static inline int write_all_fd(int fd, const char *p, size_t len) {
    while (len > 0) {
        const ssize_t w = write(fd, p, len);
        if (w < 0 && errno == EINTR) {
            continue;
        }
        if (w <= 0) {
            return -1;
        }
        p += w;
        len -= (size_t)w;
    }
    return 0;
}

/* One formatted line (any length; the newline is added) to fd in one write; 0, or -1 with errno. */
static inline int vwrite_line_fd(int fd, const char *fmt, va_list ap) {
    char small[4096];
    va_list again;
    va_copy(again, ap);
    const int n = vsnprintf(small, sizeof small - 1, fmt, ap);
    if (n < 0) {
        va_end(again);
        errno = EINVAL;
        return -1;
    }
    char *buf = small;
    if ((size_t)n >= sizeof small - 1) {
        buf = malloc((size_t)n + 2);
        if (buf == NULL) {
            va_end(again);
            errno = ENOMEM;
            return -1;
        }
        vsnprintf(buf, (size_t)n + 1, fmt, again);
    }
    va_end(again);
    buf[n] = '\n';
    const int rc = write_all_fd(fd, buf, (size_t)n + 1);
    const int err = errno;
    if (buf != small) {
        free(buf);
    }
    errno = err;
    return rc;
}

__attribute__((format(printf, 2, 3))) static inline int write_line_fd(int fd, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    const int rc = vwrite_line_fd(fd, fmt, ap);
    va_end(ap);
    return rc;
}

/* One line on stdout in one write (after anything buffered), so that a reader sees whole lines
 * even when this process is killed right after. A process that cannot write (its reader is
 * gone) exits 3. */
__attribute__((format(printf, 1, 2))) static inline void say(const char *fmt, ...) {
    va_list ap;
    fflush(stdout);
    va_start(ap, fmt);
    const int rc = vwrite_line_fd(1, fmt, ap);
    va_end(ap);
    if (rc != 0) {
        _exit(3);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Children */

/* This program's path (children re-execute it). */
static char self_path[4096];
/* The stand-ins' violation log of this run ("" when none). */
static char standin_log_path[256];

/* Find this program; with a tag, also send every process's stand-in rule violations (the
 * stand-ins read DEVSHARE_STANDIN_LOG, children inherit it) to a fresh log. */
static inline void harness_start(const char *standin_log_tag) {
    const ssize_t n = readlink("/proc/self/exe", self_path, sizeof self_path - 1);
    if (n <= 0) {
        die("readlink /proc/self/exe", errno);
    }
    self_path[n] = '\0';
    if (standin_log_tag) {
        snprintf(standin_log_path, sizeof standin_log_path, "/tmp/devshare_%s_%ld.log", standin_log_tag,
                 (long)getpid());
        unlink(standin_log_path);
        setenv("DEVSHARE_STANDIN_LOG", standin_log_path, 1);
    }
}

static inline int standin_log_is_empty(void) {
    struct stat st;
    return standin_log_path[0] == '\0' || stat(standin_log_path, &st) != 0 || st.st_size == 0;
}

/* The final check of a test over the stand-ins: `in_process_violations` (the stand-ins' counts
 * in this process) is 0 and no process logged a violation; prints the log otherwise, removes it.
 * `which` names the stand-ins ("the ACL stand-in"). */
static inline int harness_check_log(int in_process_violations, const char *which) {
    const int empty = standin_log_is_empty();
    const int ok = harness_check(in_process_violations == 0 && empty, 0,
                                 "%s recorded no rule violation in any process", which);
    if (!empty) {
        FILE *f = fopen(standin_log_path, "r");
        char line[512];
        while (f && fgets(line, sizeof line, f)) {
            printf("# stand-in: %s", line);
        }
        if (f) {
            fclose(f);
        }
    }
    if (standin_log_path[0]) {
        unlink(standin_log_path);
    }
    return ok;
}

/* How spawn_piped starts a child (every field optional). */
typedef struct {
    const char *env_name, *env_value; /* set in the child's environment */
    int gated; /* the child waits for one byte on its stdin (open_gate) before it execs */
} SpawnOptions;

/* Fork a child that execs argv (argv[0]: the program; NULL-terminated) with its stdin and stdout
 * on pipes: *to writes to its stdin, *from reads its stdout. SIGPIPE is default in the child.
 * Pipe or fork failures end this program. */
static inline pid_t spawn_piped(char *const argv[], const SpawnOptions *opt, int *to, int *from) {
    int in[2], out[2];
    if (pipe(in) != 0 || pipe(out) != 0) {
        die("pipe", errno);
    }
    fflush(stdout);
    fflush(stderr);
    const pid_t pid = fork();
    if (pid < 0) {
        die("fork", errno);
    }
    if (pid == 0) {
        signal(SIGPIPE, SIG_DFL);
        dup2(in[0], 0);
        dup2(out[1], 1);
        close(in[0]);
        close(in[1]);
        close(out[0]);
        close(out[1]);
        if (opt && opt->env_name) {
            setenv(opt->env_name, opt->env_value, 1);
        }
        char go;
        if (opt && opt->gated && read(0, &go, 1) != 1) {
            _exit(126);
        }
        execv(argv[0], argv);
        _exit(127);
    }
    close(in[0]);
    close(out[1]);
    *to = in[1];
    *from = out[0];
    return pid;
}

/* Let a gated child (SpawnOptions.gated) exec. */
static inline void open_gate(int to) {
    if (write(to, "g", 1) != 1) {
        die("opening a child's gate", errno);
    }
}

/* Wait up to `timeout_ms` for `pid` to end (then SIGKILL it): its wait status, or -1 when it
 * had to be killed or cannot be waited for. */
static inline int wait_exit(pid_t pid, int timeout_ms) {
    const int64_t deadline = now_ms() + timeout_ms;
    int64_t pause_us = 100;
    for (;;) {
        int status = 0;
        const pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid) {
            return status;
        }
        if (r < 0 && errno != EINTR) {
            return -1;
        }
        if (now_ms() > deadline) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            return -1;
        }
        struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)pause_us * 1000L};
        nanosleep(&ts, NULL);
        pause_us = pause_us < 10000 ? pause_us * 2 : pause_us;
    }
}

static inline int exited_zero(int status) { return status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0; }

/* ---------------------------------------------------------------------------------------- */
/* This process */

/* Descriptors open in this process (-1: /proc/self/fd cannot be read). */
static inline int open_fds(void) {
    DIR *d = opendir("/proc/self/fd");
    if (d == NULL) {
        return -1;
    }
    int n = 0;
    while (readdir(d)) {
        n++;
    }
    closedir(d);
    return n;
}

/* Yama's ptrace_scope (-1: no Yama). */
static inline int read_ptrace_scope(void) {
    FILE *f = fopen("/proc/sys/kernel/yama/ptrace_scope", "r");
    int v = -1;
    if (f) {
        if (fscanf(f, "%d", &v) != 1) {
            v = -1;
        }
        fclose(f);
    }
    return v;
}

#ifdef _GNU_SOURCE
#include <linux/capability.h>
#include <sys/syscall.h>

/* Drop CAP_SYS_PTRACE from every set of this process (no-op without it), so that the kernel's
 * ordinary ptrace rules apply to it even when the tests run as root. */
static inline void drop_ptrace_capability(void) {
    struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
    struct __user_cap_data_struct data[2];
    if (syscall(SYS_capget, &hdr, data) != 0) {
        return;
    }
    const unsigned bit = 1u << CAP_SYS_PTRACE;
    if (!((data[0].effective | data[0].permitted | data[0].inheritable) & bit)) {
        return;
    }
    data[0].effective &= ~bit;
    data[0].permitted &= ~bit;
    data[0].inheritable &= ~bit;
    if (syscall(SYS_capset, &hdr, data) != 0) {
        die("capset (dropping CAP_SYS_PTRACE)", errno);
    }
}
#endif /* _GNU_SOURCE */

#endif /* DEVSHARE_TEST_HARNESS_H */
