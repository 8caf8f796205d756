/* SPDX-License-Identifier: Apache-2.0 */
/*
 * producer: share a float32 tensor in host shared memory and check what consumers write.
 *
 *   producer [--wait-seconds N] [consumer-command ...]
 *
 * The tensor is R x C = 5 x 8 float32. Rows 0..3 hold v[i][j] = i*100 + j; row 4 is the
 * result row (zeros), which a consumer fills with the column sums of rows 0..3. The layout
 * exercises every offset a handle has: the storage starts 256 bytes into a 1024-byte
 * allocation, the tensor starts 3 elements into its storage, and rows are 10 elements apart
 * (2 padding elements after each row). Every byte that is not a tensor element is filled with
 * a sentinel, so stray writes are caught.
 *
 * With consumer commands: each argument is one command, split at spaces (no quoting), e.g.
 * `producer ./consumer "valgrind -q ./consumer"`. For each, the producer shares a fresh handle
 * (one reference per consumer), prints it, and runs the command as a separate process with
 * the handle text appended as its last argument. It then waits until every reference was
 * released, printing the outstanding count as it drops, and checks the result.
 *
 * Without commands: prints exactly one line, the handle text, on stdout, then waits up to N
 * seconds (default 60) for the reference to come back, so that `consumer <handle-text>` can be
 * run by hand. Progress goes to stderr in that mode.
 *
 * Exit status: 0 when every consumer succeeded, every reference came back and the result row
 * and the rest of the allocation are as expected; 1 otherwise; 2 on a usage error.
 */
#define _POSIX_C_SOURCE 200809L

#include "devshare.h"

#include <errno.h>
#include <inttypes.h>
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
    ROWS = 5,
    COLS = 8,
    ROW_PITCH = 10,       /* elements between the starts of two rows */
    TENSOR_OFFSET = 3,    /* elements from the storage start to element [0][0] */
    STORAGE_OFFSET = 256, /* bytes from the allocation start to the storage */
    STORAGE_SIZE = 512,   /* bytes */
    ALLOC_SIZE = 1024,    /* bytes */
    SENTINEL = 0xA5,      /* every byte that is not a tensor element */
    GRACE_MS = 3000,      /* how long references may stay out after every consumer exited */
};

/* Where informational messages go: stdout with consumer commands, stderr without (stdout then
 * carries nothing but the handle line). */
static FILE *out;

static void report(const char *what, int32_t status) {
    char msg[1024];
    devshare_last_error(msg, sizeof msg);
    fprintf(stderr, "producer: %s failed: %s (%d): %s\n", what, devshare_status_str(status),
            (int)status, msg);
}

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static size_t element_byte(int i, int j) {
    return STORAGE_OFFSET + ((size_t)TENSOR_OFFSET + (size_t)i * ROW_PITCH + (size_t)j) * sizeof(float);
}

static float *element(unsigned char *base, int i, int j) {
    return (float *)(void *)(base + element_byte(i, j));
}

static void fill(unsigned char *base) {
    memset(base, SENTINEL, ALLOC_SIZE);
    for (int i = 0; i < ROWS; i++) {
        for (int j = 0; j < COLS; j++) {
            *element(base, i, j) = i + 1 < ROWS ? (float)(i * 100 + j) : 0.0f;
        }
    }
}

/* 0 when the pattern is intact, the result row holds the column sums and no other byte changed. */
static int check_result(unsigned char *base) {
    int bad = 0;
    static unsigned char is_element[ALLOC_SIZE];
    memset(is_element, 0, sizeof is_element);
    for (int i = 0; i < ROWS; i++) {
        for (int j = 0; j < COLS; j++) {
            memset(is_element + element_byte(i, j), 1, sizeof(float));
            const float got = *element(base, i, j);
            float want = 0.0f;
            if (i + 1 < ROWS) {
                want = (float)(i * 100 + j);
            } else {
                for (int k = 0; k + 1 < ROWS; k++) {
                    want += (float)(k * 100 + j);
                }
            }
            if (got != want) {
                fprintf(stderr, "producer: element [%d][%d] is %g, expected %g\n", i, j, (double)got,
                        (double)want);
                bad = 1;
            }
        }
    }
    for (size_t b = 0; b < ALLOC_SIZE; b++) {
        if (!is_element[b] && base[b] != SENTINEL) {
            fprintf(stderr, "producer: byte %zu outside the tensor changed to 0x%02x\n", b, base[b]);
            bad = 1;
            break;
        }
    }
    if (!bad) {
        fprintf(out, "producer: result row =");
        for (int j = 0; j < COLS; j++) {
            fprintf(out, " %g", (double)*element(base, ROWS - 1, j));
        }
        fprintf(out, " (column sums of rows 0..%d); pattern and padding intact\n", ROWS - 2);
    }
    return bad;
}

static int share_text(DevshareExporter *exp, char *text, size_t cap) {
    const int64_t shape[2] = {ROWS, COLS};
    const int64_t strides[2] = {ROW_PITCH, 1};
    DevshareTensorDesc desc;
    int32_t st = devshare_tensor_desc_init(&desc, sizeof desc); /* struct_size and the defaults */
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_tensor_desc_init", st);
        return 1;
    }
    desc.dtype = (DevshareDType){.code = DEVSHARE_DTYPE_FLOAT, .bits = 32, .lanes = 1};
    desc.ndim = 2;
    desc.shape = shape;
    desc.strides = strides;
    desc.storage_offset = STORAGE_OFFSET;
    desc.storage_size = STORAGE_SIZE;
    desc.tensor_offset = TENSOR_OFFSET;
    DevshareHandle h;
    st = devshare_exporter_share(exp, &desc, &h);
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_exporter_share", st);
        return 1;
    }
    st = devshare_handle_to_text(&h, text, cap, NULL);
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_handle_to_text", st);
        return 1;
    }
    return 0;
}

/* Split `cmd` at spaces into argv (pointing into `buf`), append `last`; argc, or -1. */
static int split_command(const char *cmd, char *buf, size_t cap, char **argv, int max, char *last) {
    if (strlen(cmd) >= cap) {
        return -1;
    }
    strcpy(buf, cmd);
    int argc = 0;
    char *save = NULL;
    for (char *tok = strtok_r(buf, " \t", &save); tok != NULL; tok = strtok_r(NULL, " \t", &save)) {
        if (argc + 2 >= max) {
            return -1;
        }
        argv[argc++] = tok;
    }
    if (argc == 0) {
        return -1;
    }
    argv[argc++] = last;
    argv[argc] = NULL;
    return argc;
}

static void describe_exit(int k, pid_t pid, int status) {
    if (WIFEXITED(status)) {
        fprintf(out, "producer: consumer %d (pid %ld) exited with status %d\n", k, (long)pid,
                WEXITSTATUS(status));
    } else if (WIFSIGNALED(status)) {
        fprintf(out, "producer: consumer %d (pid %ld) was killed by signal %d (%s)\n", k, (long)pid,
                WTERMSIG(status), strsignal(WTERMSIG(status)));
    }
    fflush(out);
}

/* Interactive mode: one handle on stdout, wait for its release. */
static int run_interactive(DevshareExporter *exp, long wait_seconds) {
    char text[DEVSHARE_HANDLE_MAX_TEXT_SIZE];
    if (share_text(exp, text, sizeof text) != 0) {
        return 1;
    }
    printf("%s\n", text);
    fflush(stdout);
    fprintf(out, "producer: waiting up to %ld s for the consumer to release the handle "
                 "(run: consumer <the handle line above>)\n", wait_seconds);
    const int32_t st = devshare_exporter_wait(exp, (int64_t)wait_seconds * 1000);
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_exporter_wait", st);
        return 1;
    }
    fprintf(out, "producer: the reference came back\n");
    return 0;
}

enum { MAX_CONSUMERS = 64, MAX_ARGS = 64, CMD_CAP = 4096 };

/* Command mode: one handle and one process per command, then wait for every release. */
static int run_consumers(DevshareExporter *exp, int ncmd, char **cmds, long wait_seconds) {
    if (ncmd > MAX_CONSUMERS) {
        fprintf(stderr, "producer: at most %d consumer commands\n", MAX_CONSUMERS);
        return 1;
    }
    static char texts[MAX_CONSUMERS][DEVSHARE_HANDLE_MAX_TEXT_SIZE];
    pid_t pids[MAX_CONSUMERS];
    int exited[MAX_CONSUMERS];
    int failed = 0, started = 0;
    /* One handle (one reference) per consumer, all shared before the first consumer starts. */
    int shared = 0;
    for (int k = 0; k < ncmd; k++) {
        if (share_text(exp, texts[k], sizeof texts[k]) != 0) {
            failed = 1;
            break;
        }
        shared++;
        fprintf(out, "producer: handle for consumer %d: %s\n", k, texts[k]);
    }
    fprintf(out, "producer: outstanding references: %d\n", shared);
    for (int k = 0; k < shared; k++) {
        char buf[CMD_CAP];
        char *argv[MAX_ARGS];
        if (split_command(cmds[k], buf, sizeof buf, argv, MAX_ARGS, texts[k]) < 0) {
            fprintf(stderr, "producer: cannot use consumer command \"%s\"\n", cmds[k]);
            failed = 1;
            break;
        }
        fflush(out);
        fflush(stderr);
        const int err = posix_spawnp(&pids[k], argv[0], NULL, NULL, argv, environ);
        if (err != 0) {
            fprintf(stderr, "producer: cannot start \"%s\": %s\n", cmds[k], strerror(err));
            failed = 1;
            break;
        }
        exited[k] = 0;
        started++;
        fprintf(out, "producer: started consumer %d (pid %ld): %s <handle>\n", k, (long)pids[k], cmds[k]);
        fflush(out);
    }

    /* While consumers run, poll: wait up to 100 ms for the references, print the outstanding
     * count when it changes, reap consumers that exited. A consumer that failed before its
     * release leaves its reference outstanding, so once every consumer exited, wait at most
     * GRACE_MS more. The whole wait ends at the deadline (--wait-seconds). */
    const int64_t deadline = now_ms() + (int64_t)wait_seconds * 1000;
    uint64_t shown = (uint64_t)shared;
    int reaped = 0;
    for (;;) {
        uint64_t n = 0;
        const int32_t ost = devshare_exporter_outstanding(exp, &n);
        if (ost != DEVSHARE_STATUS_OK) {
            report("devshare_exporter_outstanding", ost);
            failed = 1;
            break;
        }
        if (n != shown) {
            fprintf(out, "producer: outstanding references: %" PRIu64 "\n", n);
            fflush(out);
            shown = n;
        }
        for (int k = 0; k < started; k++) {
            int status;
            if (!exited[k] && waitpid(pids[k], &status, WNOHANG) == pids[k]) {
                exited[k] = 1;
                reaped++;
                describe_exit(k, pids[k], status);
                if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
                    failed = 1;
                }
            }
        }
        if (reaped == started) {
            break;
        }
        if (now_ms() > deadline) {
            fprintf(stderr, "producer: a consumer is still running after %ld s\n", wait_seconds);
            failed = 1;
            break;
        }
        const int32_t st = devshare_exporter_wait(exp, 100);
        if (st == DEVSHARE_STATUS_OK) {
            nanosleep(&(struct timespec){.tv_sec = 0, .tv_nsec = 10 * 1000 * 1000}, NULL);
        } else if (st != DEVSHARE_STATUS_TIMEOUT) {
            report("devshare_exporter_wait", st);
            failed = 1;
            break;
        }
    }
    for (int k = 0; k < started; k++) {
        if (!exited[k]) {
            int status;
            fprintf(stderr, "producer: stopping consumer %d (pid %ld)\n", k, (long)pids[k]);
            kill(pids[k], SIGTERM);
            if (waitpid(pids[k], &status, 0) == pids[k]) {
                describe_exit(k, pids[k], status);
            }
        }
    }
    /* Every consumer is gone: what they did not release by now never comes back. */
    const int32_t st = devshare_exporter_wait(exp, GRACE_MS);
    uint64_t n = 0;
    if (devshare_exporter_outstanding(exp, &n) == DEVSHARE_STATUS_OK && n != shown) {
        fprintf(out, "producer: outstanding references: %" PRIu64 "\n", n);
    }
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_exporter_wait", st);
        failed = 1;
    }
    return failed;
}

static void usage(const char *prog) {
    fprintf(stderr, "usage: %s [--wait-seconds N] [consumer-command ...]\n", prog);
}

int main(int argc, char **argv) {
    const char *prog = argc > 0 ? argv[0] : "producer";
    long wait_seconds = 60;
    int first = 1;
    while (first < argc && strncmp(argv[first], "--", 2) == 0) {
        if (strcmp(argv[first], "--") == 0) {
            first++;
            break;
        }
        if (strcmp(argv[first], "--wait-seconds") == 0 && first + 1 < argc) {
            char *end = NULL;
            errno = 0;
            wait_seconds = strtol(argv[first + 1], &end, 10);
            if (errno != 0 || end == argv[first + 1] || *end != '\0' || wait_seconds < 0 ||
                wait_seconds > 24L * 3600) {
                fprintf(stderr, "producer: --wait-seconds wants 0..86400, got \"%s\"\n", argv[first + 1]);
                return 2;
            }
            first += 2;
        } else {
            usage(prog);
            return strcmp(argv[first], "--help") == 0 ? 0 : 2;
        }
    }
    const int ncmd = argc - first;
    out = ncmd > 0 ? stdout : stderr;

    DevshareExporter *exp = NULL;
    void *ptr = NULL;
    int32_t st = devshare_host_alloc(ALLOC_SIZE, &exp, &ptr);
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_host_alloc", st);
        return 1;
    }
    unsigned char *base = ptr;
    fill(base);
    fprintf(out, "producer[%ld]: %dx%d float32 at storage offset %d, tensor offset %d, row pitch %d "
                 "in a %d-byte host allocation\n",
            (long)getpid(), ROWS, COLS, STORAGE_OFFSET, TENSOR_OFFSET, ROW_PITCH, ALLOC_SIZE);
    fflush(out);

    int failed = ncmd > 0 ? run_consumers(exp, ncmd, argv + first, wait_seconds)
                          : run_interactive(exp, wait_seconds);
    /* Only look at the result once every reference came back: until then a consumer may still
     * be writing. */
    if (!failed && check_result(base) != 0) {
        failed = 1;
    }
    st = devshare_exporter_close(exp, 0);
    if (st != DEVSHARE_STATUS_OK) {
        report("devshare_exporter_close", st);
        devshare_exporter_close(exp, DEVSHARE_CLOSE_FORCE);
        failed = 1;
    }
    fprintf(out, "producer: %s\n", failed ? "FAILED" : "success");
    return failed;
}
