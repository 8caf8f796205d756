/* SPDX-License-Identifier: Apache-2.0 */
/*
 * npu_producer: share an Ascend NPU tensor with another process (acl backend) and check what
 * the consumer writes into it.
 *
 *   npu_producer <consumer-command>
 *
 * The producer allocates 2 MiB of device memory (aclrtMalloc with a HUGE policy: ACL exports
 * whole pages only) and copies a (R+1) x C = 257 x 256 float32 tensor into it, 64 KiB into the
 * allocation: rows 0..R-1 hold v[i][j] = i*1000 + j, row R is the result row (zeros). Every
 * other byte of the allocation holds a sentinel, so stray writes are caught.
 *
 * It exports the allocation with pid validation on (the default), so only processes on the
 * key's whitelist may import. Then it runs the consumer command (split at spaces, no quoting,
 * e.g. `npu_producer "valgrind -q ./npu_consumer"`) as a child whose stdin and stdout are pipes:
 *   1. the consumer prints `PID <n>`: its pid as Ascend knows it (devshare_local_pid, the bare
 *      tgid, which differs from getpid() inside containers);
 *   2. the producer whitelists that pid (devshare_exporter_allow_pid) and shares the tensor with
 *      DEVSHARE_SHARE_EVENT on a stream it created: instead of synchronising, devshare records
 *      an IPC event there, and the consumer's import makes the consumer's stream wait on it;
 *   3. the producer sends the handle text as one line;
 *   4. the consumer checks the data, writes the column sums of rows 0..R-1 into row R and
 *      releases its import, which hands the reference back; the producer waits for that
 *      (devshare_exporter_wait), reads the whole allocation back and checks it.
 * The consumer's own messages go to stderr, straight to the terminal.
 *
 * Run it by hand from the build directory, over the test stand-in runtime (no NPU needed):
 *
 *   DEVSHARE_ACL_LIBRARY=$PWD/cargo/release/standin/acl/libascendcl.so \
 *       c_examples/device/npu_producer c_examples/device/npu_consumer
 *
 * With CANN installed, the same source builds against the real acl/acl.h and libascendcl.so
 * (CMake does so when $ASCEND_HOME_PATH has them, defining DEVSHARE_EXAMPLE_REAL_ACL); then run
 * it without DEVSHARE_ACL_LIBRARY.
 *
 * Exit status: 0 when the consumer succeeded, the reference came back, the result row holds the
 * column sums and nothing else changed; 1 otherwise; 2 on a usage error.
 */
#define _GNU_SOURCE /* pipe2 */

#if defined(DEVSHARE_EXAMPLE_REAL_ACL)
#include <acl/acl.h>
#else
#include "acl_standin.h" /* the test stand-in's copy of the ACL declarations */
#endif
#include "devshare.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

enum {
    ROWS = 256,                  /* data rows; the tensor has ROWS + 1 rows, the last is the result */
    COLS = 256,
    DEVICE = 0,                  /* both processes use device 0 */
    STORAGE_OFFSET = 64 * 1024,  /* bytes from the allocation start to the tensor */
    ALLOC_SIZE = 2 * 1024 * 1024,
    SENTINEL = 0xA5,             /* every byte of the allocation that is not a tensor element */
    IO_TIMEOUT_MS = 30000,       /* for the consumer's PID line */
    WAIT_MS = 60000,             /* for the release */
    GRACE_MS = 3000,             /* for the release once the consumer has exited */
};
#define TENSOR_BYTES ((size_t)(ROWS + 1) * COLS * sizeof(float))

static void report(const char *what, int32_t status) {
    char msg[1024];
    devshare_last_error(msg, sizeof msg);
    fprintf(stderr, "npu_producer: %s failed: %s (%d): %s\n", what, devshare_status_str(status),
            (int)status, msg);
}

/* 1 (and a message) when an ACL call failed. */
static int acl_failed(const char *what, aclError rc) {
    if (rc == ACL_SUCCESS) {
        return 0;
    }
    const char *msg = aclGetRecentErrMsg();
    fprintf(stderr, "npu_producer: %s failed: ACL error %d: %s\n", what, (int)rc, msg ? msg : "");
    return 1;
}

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Element (i, j) of the tensor in a host image of the whole allocation. */
static float *element(unsigned char *image, int i, int j) {
    return (float *)(void *)(image + STORAGE_OFFSET + ((size_t)i * COLS + (size_t)j) * sizeof(float));
}

/* The exact column sum of rows 0..ROWS-1 (an even integer below 2^25, so exact in float32). */
static float column_sum(int j) {
    double sum = 0.0;
    for (int i = 0; i < ROWS; i++) {
        sum += (double)i * 1000.0 + j;
    }
    return (float)sum;
}

static void fill(unsigned char *image) {
    memset(image, SENTINEL, ALLOC_SIZE);
    for (int i = 0; i <= ROWS; i++) {
        for (int j = 0; j < COLS; j++) {
            *element(image, i, j) = i < ROWS ? (float)(i * 1000 + j) : 0.0f;
        }
    }
}

/* 0 when the data rows are intact, the result row holds the column sums and no byte outside
 * the tensor changed. */
static int check(unsigned char *image) {
    for (int i = 0; i <= ROWS; i++) {
        for (int j = 0; j < COLS; j++) {
            const float want = i < ROWS ? (float)(i * 1000 + j) : column_sum(j);
            const float got = *element(image, i, j);
            if (got != want) {
                fprintf(stderr, "npu_producer: element [%d][%d] is %.1f, expected %.1f\n", i, j,
                        (double)got, (double)want);
                return 1;
            }
        }
    }
    for (size_t b = 0; b < ALLOC_SIZE; b++) {
        if ((b < STORAGE_OFFSET || b >= STORAGE_OFFSET + TENSOR_BYTES) && image[b] != SENTINEL) {
            fprintf(stderr, "npu_producer: byte %zu outside the tensor changed to 0x%02x\n", b, image[b]);
            return 1;
        }
    }
    printf("npu_producer: result row = %.0f %.0f %.0f ... %.0f: the column sums of rows 0..%d; "
           "data rows and the rest of the allocation unchanged\n",
           (double)*element(image, ROWS, 0), (double)*element(image, ROWS, 1),
           (double)*element(image, ROWS, 2), (double)*element(image, ROWS, COLS - 1), ROWS - 1);
    return 0;
}

/* ---- The consumer process ------------------------------------------------------------------- */

typedef struct {
    pid_t pid;
    int to;      /* its stdin */
    int from;    /* its stdout */
    int exited;  /* reaped; `status` is valid */
    int status;
} Child;

/* Start `cmd` (split at spaces) with pipes to its stdin and from its stdout; 0 on success. */
static int start_consumer(const char *cmd, Child *c) {
    char buf[4096];
    char *argv[64];
    int argc = 0;
    if (strlen(cmd) >= sizeof buf) {
        fprintf(stderr, "npu_producer: consumer command too long\n");
        return 1;
    }
    strcpy(buf, cmd);
    char *save = NULL;
    for (char *tok = strtok_r(buf, " \t", &save); tok && argc < 63; tok = strtok_r(NULL, " \t", &save)) {
        argv[argc++] = tok;
    }
    argv[argc] = NULL;
    if (argc == 0) {
        fprintf(stderr, "npu_producer: empty consumer command\n");
        return 1;
    }
    /* Close-on-exec everywhere: the child keeps only the two ends dup2'd onto its stdin/stdout,
     * so it sees EOF when we close our end, and we see EOF when it exits. */
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0) {
        perror("npu_producer: pipe2");
        return 1;
    }
    if (pipe2(out, O_CLOEXEC) != 0) {
        perror("npu_producer: pipe2");
        close(in[0]);
        close(in[1]);
        return 1;
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], STDIN_FILENO);
    posix_spawn_file_actions_adddup2(&fa, out[1], STDOUT_FILENO);
    /* We ignore SIGPIPE; the consumer gets the default back. */
    posix_spawnattr_t attr;
    sigset_t def;
    sigemptyset(&def);
    sigaddset(&def, SIGPIPE);
    posix_spawnattr_init(&attr);
    posix_spawnattr_setsigdefault(&attr, &def);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGDEF);
    fflush(stdout);
    fflush(stderr);
    const int err = posix_spawnp(&c->pid, argv[0], &fa, &attr, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    close(in[0]);
    close(out[1]);
    if (err != 0) {
        fprintf(stderr, "npu_producer: cannot start \"%s\": %s\n", cmd, strerror(err));
        close(in[1]);
        close(out[0]);
        return 1;
    }
    c->to = in[1];
    c->from = out[0];
    c->exited = 0;
    printf("npu_producer: started the consumer (pid %ld): %s\n", (long)c->pid, cmd);
    return 0;
}

/* Read one line (without its newline) from `fd`; its length, or -1 on EOF, error or timeout. */
static int read_line(int fd, char *buf, size_t cap, int timeout_ms) {
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
        char ch;
        const ssize_t got = read(fd, &ch, 1);
        if (got < 0 && errno == EINTR) {
            continue;
        }
        if (got <= 0) {
            return -1;
        }
        if (ch == '\n') {
            break;
        }
        buf[n++] = ch;
    }
    buf[n] = '\0';
    return (int)n;
}

/* Reap the consumer if it has exited (or wait up to `timeout_ms` for it, then stop it). */
static void reap(Child *c, int timeout_ms) {
    const int64_t deadline = now_ms() + timeout_ms;
    while (!c->exited) {
        if (waitpid(c->pid, &c->status, WNOHANG) == c->pid) {
            c->exited = 1;
        } else if (now_ms() >= deadline) {
            if (timeout_ms > 0) {
                fprintf(stderr, "npu_producer: stopping the consumer (pid %ld)\n", (long)c->pid);
                kill(c->pid, SIGTERM);
                c->exited = waitpid(c->pid, &c->status, 0) == c->pid;
            }
            return;
        } else {
            nanosleep(&(struct timespec){.tv_sec = 0, .tv_nsec = 10 * 1000 * 1000}, NULL);
        }
    }
}

/* Wait until the consumer released its reference. devshare_exporter_wait is called in short
 * slices so that a consumer that dies without releasing is noticed: its reference would never
 * come back, so after it exits we wait only GRACE_MS more. */
static int wait_release(DevshareExporter *exp, Child *c) {
    int64_t deadline = now_ms() + WAIT_MS;
    for (;;) {
        const int32_t st = devshare_exporter_wait(exp, 100);
        if (st == DEVSHARE_STATUS_OK) {
            printf("npu_producer: the consumer released its reference\n");
            return 0;
        }
        if (st != DEVSHARE_STATUS_TIMEOUT) {
            report("devshare_exporter_wait", st);
            return 1;
        }
        if (!c->exited) {
            reap(c, 0);
            if (c->exited && now_ms() + GRACE_MS < deadline) {
                deadline = now_ms() + GRACE_MS;
            }
        }
        if (now_ms() > deadline) {
            fprintf(stderr, "npu_producer: the reference did not come back\n");
            return 1;
        }
    }
}

/* Steps 1-4 of the top comment; 0 when the consumer released its reference and exited 0. */
static int run_consumer(DevshareExporter *exp, aclrtStream stream, const char *cmd) {
    Child c;
    if (start_consumer(cmd, &c) != 0) {
        return 1;
    }
    int failed = 1;
    char line[128];
    int pid = 0;
    int32_t st;
    DevshareHandle h;
    char text[DEVSHARE_HANDLE_MAX_TEXT_SIZE + 1];
    size_t len = 0;
    const int64_t shape[2] = {ROWS + 1, COLS};
    const int64_t strides[2] = {COLS, 1};
    DevshareTensorDesc desc;
    /* struct_size and the defaults (storage to the end of the allocation, everything else 0);
     * cannot fail for a non-NULL pointer and sizeof. */
    devshare_tensor_desc_init(&desc, sizeof desc);
    desc.dtype = (DevshareDType){.code = DEVSHARE_DTYPE_FLOAT, .bits = 32, .lanes = 1};
    desc.ndim = 2;
    desc.shape = shape;
    desc.strides = strides;
    desc.storage_offset = STORAGE_OFFSET;
    desc.storage_size = TENSOR_BYTES;
    desc.flags = DEVSHARE_SHARE_EVENT; /* record an IPC event on `stream`; do not synchronise */
    desc.stream = stream;

    if (read_line(c.from, line, sizeof line, IO_TIMEOUT_MS) < 0 || sscanf(line, "PID %d", &pid) != 1) {
        fprintf(stderr, "npu_producer: the consumer did not send its PID line\n");
    } else if ((st = devshare_exporter_allow_pid(exp, pid)) != DEVSHARE_STATUS_OK) {
        report("devshare_exporter_allow_pid", st);
    } else if ((st = devshare_exporter_share(exp, &desc, &h)) != DEVSHARE_STATUS_OK) {
        report("devshare_exporter_share", st);
    } else if ((st = devshare_handle_to_text(&h, text, sizeof text - 1, &len)) != DEVSHARE_STATUS_OK) {
        report("devshare_handle_to_text", st);
    } else {
        printf("npu_producer: allowed pid %d; handle (with an IPC event): %s\n", pid, text);
        fflush(stdout);
        text[len++] = '\n';
        if (write(c.to, text, len) != (ssize_t)len) {
            perror("npu_producer: sending the handle to the consumer");
        } else {
            failed = wait_release(exp, &c);
        }
    }
    close(c.to); /* EOF for a consumer still waiting for its handle */
    close(c.from);
    reap(&c, IO_TIMEOUT_MS);
    if (c.exited && WIFEXITED(c.status)) {
        printf("npu_producer: the consumer exited with status %d\n", WEXITSTATUS(c.status));
        failed |= WEXITSTATUS(c.status) != 0;
    } else {
        fprintf(stderr, "npu_producer: the consumer was killed\n");
        failed = 1;
    }
    return failed;
}

/* ---- main ----------------------------------------------------------------------------------- */

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s <consumer-command>\n", argc > 0 ? argv[0] : "npu_producer");
        return 2;
    }
    /* A consumer that died early makes write() fail with EPIPE instead of killing us. */
    signal(SIGPIPE, SIG_IGN);
    /* Our lines and the consumer's (on stderr) stay in order even when stdout is a pipe. */
    setvbuf(stdout, NULL, _IOLBF, 0);

    int failed = 1;
    int32_t st;
    void *dev = NULL;
    aclrtStream stream = NULL;
    DevshareExporter *exp = NULL;
    unsigned char *image = malloc(ALLOC_SIZE);
    if (!image) {
        fprintf(stderr, "npu_producer: out of host memory\n");
        return 1;
    }

    /* devshare initialises ACL too; whoever comes second gets ACL_ERROR_REPEAT_INITIALIZE. */
    const aclError init = aclInit(NULL);
    if (init != ACL_ERROR_REPEAT_INITIALIZE && acl_failed("aclInit", init)) {
        free(image);
        return 1;
    }
    /* ACL binds devices per thread: every ACL call below runs on this thread. */
    if (acl_failed("aclrtSetDevice", aclrtSetDevice(DEVICE))) {
        goto finalize;
    }
    if (acl_failed("aclrtMalloc", aclrtMalloc(&dev, ALLOC_SIZE, ACL_MEM_MALLOC_HUGE_FIRST))) {
        goto reset;
    }
    fill(image);
    if (acl_failed("aclrtMemcpy (host to device)",
                   aclrtMemcpy(dev, ALLOC_SIZE, image, ALLOC_SIZE, ACL_MEMCPY_HOST_TO_DEVICE))) {
        goto free_dev;
    }
    printf("npu_producer[%ld]: %dx%d float32 (%d data rows + a result row) %d KiB into a %d MiB "
           "allocation on NPU %d\n",
           (long)getpid(), ROWS + 1, COLS, ROWS, STORAGE_OFFSET / 1024, ALLOC_SIZE / (1024 * 1024), DEVICE);

    /* Flags 0: pid validation on. Only whitelisted pids may import the key. */
    st = devshare_export(DEVSHARE_BACKEND_ACL, DEVICE, dev, ALLOC_SIZE, 0, &exp);
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_export", st);
        goto free_dev;
    }
    /* The stream whose work produced the data. Here the data came from a synchronous copy; in
     * a real program kernels on this stream would still be running when the handle is sent,
     * and the IPC event makes the consumer wait for them. */
    if (acl_failed("aclrtCreateStream", aclrtCreateStream(&stream))) {
        goto close_exp;
    }

    failed = run_consumer(exp, stream, argv[1]);

    /* Only read the result once the reference came back: until then the consumer may still be
     * writing. */
    if (!failed) {
        if (acl_failed("aclrtMemcpy (device to host)",
                       aclrtMemcpy(image, ALLOC_SIZE, dev, ALLOC_SIZE, ACL_MEMCPY_DEVICE_TO_HOST)) ||
            check(image) != 0) {
            failed = 1;
        }
    }

close_exp:
    /* Refused (BUSY) while a reference is outstanding, e.g. after a failed consumer: then force
     * it, which is only safe because that consumer is gone. */
    st = devshare_exporter_close(exp, 0);
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_exporter_close", st);
        devshare_exporter_close(exp, DEVSHARE_CLOSE_FORCE);
        failed = 1;
    }
    if (stream && acl_failed("aclrtDestroyStream", aclrtDestroyStream(stream))) {
        failed = 1;
    }
free_dev:
    /* Free only after the exporter closed: the memory must outlive every import. */
    if (acl_failed("aclrtFree", aclrtFree(dev))) {
        failed = 1;
    }
reset:
    aclrtResetDevice(DEVICE);
finalize:
    aclFinalize();
    free(image);
    printf("npu_producer: %s\n", failed ? "FAILED" : "success");
    return failed;
}
