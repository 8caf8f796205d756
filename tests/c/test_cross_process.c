/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_cross_process: sharing between real, separate processes.
 *
 * The parent exports a host buffer; consumers are children that re-execute this program with
 * "--child <role>" (a fresh process image: nothing is inherited but the pipes), read the handle
 * text from a pipe on stdin and answer line by line on stdout.
 *
 * The cases, in the order they run (the letter tags their output lines):
 *  (a) test_a_consumer_process_reads_writes_and_releases_a_host_buffer: a child imports, checks
 *      the pattern, writes the column sums, releases: the parent sees the write and the
 *      outstanding count drop to 0;
 *  (b) test_two_consumers_hold_one_buffer_and_release_it_one_after_the_other: two children hold
 *      one buffer at the same time, each with its own handle; they release one after the other
 *      on the parent's word and the parent sees 2 -> 1 -> 0;
 *  (c) test_a_consumers_mapping_outlives_the_exporters_close: the exporter closes while a child
 *      still holds the buffer: the child's mapping stays valid (it reads the pattern and writes
 *      after the close), it releases, and afterwards neither the data object nor the
 *      ref-counter exists in /dev/shm;
 *  (d) test_a_write_through_a_read_only_import_faults_and_changes_nothing: a write through a
 *      read-only import kills the child with SIGSEGV and does not reach the buffer; the
 *      exporter closes with DEVSHARE_CLOSE_UNLINK and nothing is left in /dev/shm;
 *  (e) test_a_consumer_that_exits_holding_keeps_its_reference_outstanding: a child that exits
 *      without releasing: its reference stays outstanding for good, so devshare_exporter_wait
 *      times out (DEVSHARE_STATUS_TIMEOUT); a plain close then leaves the data object in
 *      /dev/shm (the dead child's mapping count keeps it, as PyTorch's protocol does) but not
 *      the ref-counter; the test removes the object itself.
 *
 * At the end, /dev/shm must hold no devshare_<pid>_* or devshare_rc_<pid>_* object of any
 * process this test created. Prints "ok - ..." / "FAIL - ..." per case; exit 0 when all passed.
 */
#define _POSIX_C_SOURCE 200809L

#define HARNESS_NAME "test_cross_process"
#include "harness.h"

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
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* The shared tensor: ROWS x COLS float32, rows ROW_PITCH elements apart, TENSOR_OFFSET elements
 * into a storage that starts STORAGE_OFFSET bytes into the allocation. Rows 0..ROWS-2 hold
 * i*100 + j, the last row is for results. */
enum {
    ROWS = 5,
    COLS = 8,
    ROW_PITCH = 10,
    TENSOR_OFFSET = 3,
    STORAGE_OFFSET = 256,
    ALLOC_SIZE = 1024,
    IO_TIMEOUT_MS = 10000,
};

/* ---------------------------------------------------------------------------------------- */
/* Reporting (harness.h) */

/* A devshare status, checked: a failed case naming `what` unless it is OK. */
static int ok_status(int32_t st, const char *what) {
    if (st != DEVSHARE_STATUS_OK) {
        CHECK(0, "%s: %s: %s", what, devshare_status_str(st), last_error());
        return 0;
    }
    return 1;
}

/* ---------------------------------------------------------------------------------------- */
/* Tensor layout, shared by parent and children */

static float *element(void *data, const DevshareHandle *h, int64_t i, int64_t j) {
    return (float *)data + i * h->strides[0] + j * h->strides[1];
}

static float pattern(int64_t i, int64_t j) { return (float)(i * 100 + j); }

static float column_sum(int64_t j) {
    float s = 0.0f;
    for (int64_t i = 0; i + 1 < ROWS; i++) {
        s += pattern(i, j);
    }
    return s;
}

static int pattern_intact(void *data, const DevshareHandle *h) {
    for (int64_t i = 0; i + 1 < h->shape[0]; i++) {
        for (int64_t j = 0; j < h->shape[1]; j++) {
            if (*element(data, h, i, j) != pattern(i, j)) {
                return 0;
            }
        }
    }
    return 1;
}

/* ---------------------------------------------------------------------------------------- */
/* Children */

__attribute__((noreturn)) static void child_fail(const char *what, int32_t st) {
    fprintf(stderr, "child %ld: %s: %s: %s\n", (long)getpid(), what, devshare_status_str(st), last_error());
    printf("error %s\n", what);
    fflush(stdout);
    exit(1);
}

/* Read the handle text from stdin, import it (read-only if asked), check dtype and pattern. */
static DevshareImport *child_import(int read_only, DevshareHandle *h, DevshareImportInfo *info) {
    char text[DEVSHARE_HANDLE_MAX_TEXT_SIZE + 8];
    if (read_line_fd(0, text, sizeof text, IO_TIMEOUT_MS) <= 0) {
        child_fail("no handle text on stdin", DEVSHARE_STATUS_OK);
    }
    DevshareHandle parsed;
    int32_t st = devshare_handle_from_text(text, &parsed);
    if (st != DEVSHARE_STATUS_OK) {
        child_fail("devshare_handle_from_text", st);
    }
    DevshareImportOptions o;
    if ((st = devshare_import_options_init(&o, sizeof o)) != DEVSHARE_STATUS_OK) {
        child_fail("devshare_import_options_init", st);
    }
    o.flags = read_only ? DEVSHARE_IMPORT_READ_ONLY : 0;
    DevshareImport *imp = NULL;
    if ((st = devshare_import(&parsed, &o, &imp)) != DEVSHARE_STATUS_OK) {
        child_fail("devshare_import", st);
    }
    if ((st = devshare_import_info_init(info, sizeof *info)) != DEVSHARE_STATUS_OK) {
        child_fail("devshare_import_info_init", st);
    }
    if ((st = devshare_import_info(imp, info)) != DEVSHARE_STATUS_OK) {
        child_fail("devshare_import_info", st);
    }
    if ((st = devshare_import_handle(imp, h)) != DEVSHARE_STATUS_OK) {
        child_fail("devshare_import_handle", st);
    }
    if (h->dtype.code != DEVSHARE_DTYPE_FLOAT || h->dtype.bits != 32 || h->ndim != 2 || h->shape[0] != ROWS ||
        h->shape[1] != COLS || info->element_size != 4 || (info->read_only != 0) != (read_only != 0)) {
        child_fail("unexpected tensor description", DEVSHARE_STATUS_OK);
    }
    if (!pattern_intact(info->data, h)) {
        child_fail("pattern broken on import", DEVSHARE_STATUS_OK);
    }
    return imp;
}

static void child_release(DevshareImport *imp) {
    const int32_t st = devshare_import_release(imp);
    if (st != DEVSHARE_STATUS_OK) {
        child_fail("devshare_import_release", st);
    }
}

static void child_wait_for(const char *word) {
    char line[64];
    if (read_line_fd(0, line, sizeof line, 4 * IO_TIMEOUT_MS) < 0 || strcmp(line, word) != 0) {
        child_fail("no word from the parent", DEVSHARE_STATUS_OK);
    }
}

/* Roles:
 *   consume          import, write the column sums into the last row, release: "done"
 *   hold <col>       import: "imported"; on "release": check the pattern, write 1000+col into
 *                    [last][col] and read it back, release: "released"
 *   readonly-write   import read-only: "read ok"; then write through the pointer (must fault)
 *   exit-holding     import: "imported"; exit(0) without releasing */
static int child_main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *role = argv[2];
    DevshareHandle h;
    DevshareImportInfo info;
    if (strcmp(role, "consume") == 0) {
        DevshareImport *imp = child_import(0, &h, &info);
        for (int64_t j = 0; j < COLS; j++) {
            float s = 0.0f;
            for (int64_t i = 0; i + 1 < ROWS; i++) {
                s += *element(info.data, &h, i, j);
            }
            *element(info.data, &h, ROWS - 1, j) = s;
        }
        child_release(imp);
        say("done");
        return 0;
    }
    if (strcmp(role, "hold") == 0 && argc > 3) {
        const int col = atoi(argv[3]);
        DevshareImport *imp = child_import(0, &h, &info);
        say("imported");
        child_wait_for("release");
        if (!pattern_intact(info.data, &h)) {
            child_fail("pattern broken before release", DEVSHARE_STATUS_OK);
        }
        float *cell = element(info.data, &h, ROWS - 1, col);
        *cell = 1000.0f + (float)col;
        if (*cell != 1000.0f + (float)col) {
            child_fail("write did not stick", DEVSHARE_STATUS_OK);
        }
        child_release(imp);
        say("released");
        return 0;
    }
    if (strcmp(role, "readonly-write") == 0) {
        child_import(1, &h, &info);
        say("read ok");
        const struct rlimit no_core = {0, 0};
        setrlimit(RLIMIT_CORE, &no_core);
        signal(SIGSEGV, SIG_DFL); /* no handler (a sanitizer's, say) may turn the fault into an exit */
        volatile float *cell = element(info.data, &h, ROWS - 1, 0);
        *cell = 12345.0f; /* must raise SIGSEGV */
        say("write succeeded");
        return 3;
    }
    if (strcmp(role, "exit-holding") == 0) {
        /* Kept reachable until exit (leak checkers do not flag it), never released. */
        static DevshareImport *held;
        held = child_import(0, &h, &info);
        say("imported");
        exit(held != NULL ? 0 : 1); /* a normal exit, without devshare_import_release */
    }
    fprintf(stderr, "unknown child role %s\n", role);
    return 2;
}

/* Parent side of one child. */
struct child {
    pid_t pid;
    int to;   /* child's stdin */
    int from; /* child's stdout */
};

static pid_t created[64];
static int n_created;

static int spawn(struct child *c, const char *role, const char *arg) {
    char *argv[] = {self_path, "--child", (char *)role, (char *)arg, NULL};
    c->pid = spawn_piped(argv, NULL, &c->to, &c->from);
    if (n_created < (int)(sizeof created / sizeof created[0])) {
        created[n_created++] = c->pid;
    }
    return 0;
}

static int tell(struct child *c, const char *line) { return write_line_fd(c->to, "%s", line); }

/* The child's next line equals `want`. */
static int hear(struct child *c, const char *want) {
    char line[256];
    if (read_line_fd(c->from, line, sizeof line, IO_TIMEOUT_MS) < 0) {
        printf("    child %ld said nothing (wanted \"%s\")\n", (long)c->pid, want);
        return 0;
    }
    if (strcmp(line, want) != 0) {
        printf("    child %ld said \"%s\" (wanted \"%s\")\n", (long)c->pid, line, want);
        return 0;
    }
    return 1;
}

/* Wait for the child's exit (killing it after IO_TIMEOUT_MS); its wait status, or -1. */
static int reap(struct child *c) {
    const int status = wait_exit(c->pid, IO_TIMEOUT_MS);
    if (status == -1) {
        printf("    child %ld did not exit: killed\n", (long)c->pid);
    }
    close(c->to);
    close(c->from);
    return status;
}

/* ---------------------------------------------------------------------------------------- */
/* Parent helpers */

struct shared {
    DevshareExporter *exp;
    unsigned char *base;
};

static int make_shared(struct shared *s) {
    void *p = NULL;
    if (!ok_status(devshare_host_alloc(ALLOC_SIZE, &s->exp, &p), "devshare_host_alloc")) {
        return -1;
    }
    s->base = p;
    float *t = (float *)(void *)(s->base + STORAGE_OFFSET) + TENSOR_OFFSET;
    for (int i = 0; i < ROWS; i++) {
        for (int j = 0; j < COLS; j++) {
            t[i * ROW_PITCH + j] = i + 1 < ROWS ? pattern(i, j) : 0.0f;
        }
    }
    return 0;
}

/* A fresh handle (one reference) and its text. */
static int share(struct shared *s, DevshareHandle *h, char *text, size_t cap) {
    const int64_t shape[2] = {ROWS, COLS};
    const int64_t strides[2] = {ROW_PITCH, 1};
    DevshareTensorDesc d;
    if (!ok_status(devshare_tensor_desc_init(&d, sizeof d), "devshare_tensor_desc_init")) {
        return -1;
    }
    d.dtype.code = DEVSHARE_DTYPE_FLOAT;
    d.dtype.bits = 32;
    d.dtype.lanes = 1;
    d.ndim = 2;
    d.shape = shape;
    d.strides = strides;
    d.storage_offset = STORAGE_OFFSET;
    d.storage_size = DEVSHARE_STORAGE_TO_END;
    d.tensor_offset = TENSOR_OFFSET;
    return ok_status(devshare_exporter_share(s->exp, &d, h), "devshare_exporter_share") &&
                   ok_status(devshare_handle_to_text(h, text, cap, NULL), "devshare_handle_to_text")
               ? 0
               : -1;
}

static float *parent_element(struct shared *s, int i, int j) {
    return (float *)(void *)(s->base + STORAGE_OFFSET) + TENSOR_OFFSET + i * ROW_PITCH + j;
}

static uint64_t outstanding(struct shared *s) {
    uint64_t n = UINT64_MAX;
    if (devshare_exporter_outstanding(s->exp, &n) != DEVSHARE_STATUS_OK) {
        printf("    devshare_exporter_outstanding: %s\n", last_error());
    }
    return n;
}

/* Whether /dev/shm holds the object named by `len` bytes of `name` (with its leading '/'). */
static int shm_exists(const uint8_t *name, uint32_t len) {
    char path[256];
    snprintf(path, sizeof path, "/dev/shm%.*s", (int)len, (const char *)name);
    struct stat st;
    return stat(path, &st) == 0;
}

static int names_gone(const DevshareHandle *h) {
    const int data = shm_exists(h->key, h->key_len), rc = shm_exists(h->ref_name, h->ref_name_len);
    if (data) {
        printf("    still in /dev/shm: %.*s\n", (int)h->key_len, (const char *)h->key);
    }
    if (rc) {
        printf("    still in /dev/shm: %.*s\n", (int)h->ref_name_len, (const char *)h->ref_name);
    }
    return !data && !rc;
}

/* ---------------------------------------------------------------------------------------- */
/* Cases */

static void test_a_consumer_process_reads_writes_and_releases_a_host_buffer(void) {
    struct shared s;
    DevshareHandle h;
    char text[DEVSHARE_HANDLE_MAX_TEXT_SIZE];
    struct child c;
    if (make_shared(&s) != 0) {
        return;
    }
    if (share(&s, &h, text, sizeof text) != 0 || spawn(&c, "consume", "") != 0) {
        devshare_exporter_close(s.exp, DEVSHARE_CLOSE_FORCE);
        return;
    }
    CHECK(outstanding(&s) == 1, "(a) one handle shared: 1 reference outstanding");
    tell(&c, text);
    CHECK(hear(&c, "done"), "(a) child %ld imported the handle text it read from a pipe, wrote, released",
          (long)c.pid);
    const int32_t st = devshare_exporter_wait(s.exp, 5000);
    CHECK(st == DEVSHARE_STATUS_OK && outstanding(&s) == 0,
          "(a) devshare_exporter_wait returns OK and outstanding drops to 0 (%s)", devshare_status_str(st));
    int sums = 1;
    for (int j = 0; j < COLS; j++) {
        sums &= *parent_element(&s, ROWS - 1, j) == column_sum(j);
    }
    CHECK(sums, "(a) the parent sees the child's write: last row = column sums (%g ... %g)",
          (double)*parent_element(&s, ROWS - 1, 0), (double)*parent_element(&s, ROWS - 1, COLS - 1));
    CHECK(pattern_intact(s.base + STORAGE_OFFSET + TENSOR_OFFSET * sizeof(float), &h),
          "(a) the pattern rows are intact");
    CHECK(exited_zero(reap(&c)), "(a) the child exited with status 0");
    ok_status(devshare_exporter_close(s.exp, 0), "(a) devshare_exporter_close");
    CHECK(names_gone(&h), "(a) after the close, neither the data object nor the ref-counter is in /dev/shm");
}

static void test_two_consumers_hold_one_buffer_and_release_it_one_after_the_other(void) {
    struct shared s;
    DevshareHandle h[2];
    char text[2][DEVSHARE_HANDLE_MAX_TEXT_SIZE];
    struct child c[2];
    if (make_shared(&s) != 0) {
        return;
    }
    for (int k = 0; k < 2; k++) {
        char col[8];
        snprintf(col, sizeof col, "%d", k);
        if (share(&s, &h[k], text[k], sizeof text[k]) != 0 || spawn(&c[k], "hold", col) != 0) {
            devshare_exporter_close(s.exp, DEVSHARE_CLOSE_FORCE);
            return;
        }
    }
    CHECK(h[0].ref_slot != h[1].ref_slot || memcmp(h[0].ref_name, h[1].ref_name, sizeof h[0].ref_name) != 0,
          "(b) the two handles carry different ref-counter slots (%" PRIu64 ", %" PRIu64 ")", h[0].ref_slot,
          h[1].ref_slot);
    tell(&c[0], text[0]);
    tell(&c[1], text[1]);
    const int both = hear(&c[0], "imported") & hear(&c[1], "imported");
    CHECK(both, "(b) both children hold the buffer at the same time");
    uint64_t n = outstanding(&s);
    CHECK(n == 2, "(b) outstanding = %" PRIu64 " while both hold it (want 2)", n);
    tell(&c[0], "release");
    CHECK(hear(&c[0], "released"), "(b) first child wrote and released");
    n = outstanding(&s);
    CHECK(n == 1, "(b) outstanding = %" PRIu64 " after the first release (want 1)", n);
    const int32_t st = devshare_exporter_wait(s.exp, 100);
    CHECK(st == DEVSHARE_STATUS_TIMEOUT, "(b) devshare_exporter_wait times out while the second child holds it (%s)",
          devshare_status_str(st));
    tell(&c[1], "release");
    CHECK(hear(&c[1], "released"), "(b) second child wrote and released");
    n = outstanding(&s);
    CHECK(n == 0, "(b) outstanding = %" PRIu64 " after the second release (want 0)", n);
    CHECK(devshare_exporter_wait(s.exp, 0) == DEVSHARE_STATUS_OK, "(b) devshare_exporter_wait returns OK");
    CHECK(*parent_element(&s, ROWS - 1, 0) == 1000.0f && *parent_element(&s, ROWS - 1, 1) == 1001.0f,
          "(b) the parent sees both children's writes (%g, %g)", (double)*parent_element(&s, ROWS - 1, 0),
          (double)*parent_element(&s, ROWS - 1, 1));
    const int s0 = reap(&c[0]), s1 = reap(&c[1]);
    CHECK(exited_zero(s0) && exited_zero(s1), "(b) both children exited with status 0");
    ok_status(devshare_exporter_close(s.exp, 0), "(b) devshare_exporter_close");
    CHECK(names_gone(&h[0]) && names_gone(&h[1]), "(b) after the close, nothing of it is left in /dev/shm");
}

static void test_a_consumers_mapping_outlives_the_exporters_close(void) {
    struct shared s;
    DevshareHandle h;
    char text[DEVSHARE_HANDLE_MAX_TEXT_SIZE];
    struct child c;
    if (make_shared(&s) != 0) {
        return;
    }
    if (share(&s, &h, text, sizeof text) != 0 || spawn(&c, "hold", "2") != 0) {
        devshare_exporter_close(s.exp, DEVSHARE_CLOSE_FORCE);
        return;
    }
    tell(&c, text);
    CHECK(hear(&c, "imported"), "(c) the child holds the buffer");
    CHECK(outstanding(&s) == 1, "(c) 1 reference outstanding before the exporter closes");
    const int32_t st = devshare_exporter_close(s.exp, 0);
    CHECK(st == DEVSHARE_STATUS_OK, "(c) devshare_exporter_close succeeds (host) while the child holds the buffer (%s)",
          devshare_status_str(st));
    tell(&c, "release");
    CHECK(hear(&c, "released"), "(c) after the close, the child's mapping is still valid: it read the pattern, "
                                "wrote and read back, released");
    CHECK(exited_zero(reap(&c)), "(c) the child exited with status 0");
    CHECK(names_gone(&h), "(c) afterwards neither the data object nor the ref-counter is in /dev/shm");
}

static void test_a_write_through_a_read_only_import_faults_and_changes_nothing(void) {
    struct shared s;
    DevshareHandle h;
    char text[DEVSHARE_HANDLE_MAX_TEXT_SIZE];
    struct child c;
    if (make_shared(&s) != 0) {
        return;
    }
    if (share(&s, &h, text, sizeof text) != 0 || spawn(&c, "readonly-write", "") != 0) {
        devshare_exporter_close(s.exp, DEVSHARE_CLOSE_FORCE);
        return;
    }
    tell(&c, text);
    CHECK(hear(&c, "read ok"), "(d) the child imported read-only and read the pattern");
    const int status = reap(&c);
    CHECK(status != -1 && WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV,
          "(d) a write through the read-only import killed the child with SIGSEGV (%s %d)",
          status != -1 && WIFSIGNALED(status) ? "signal" : "exit status",
          status == -1 ? -1 : WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
    CHECK(*parent_element(&s, ROWS - 1, 0) == 0.0f, "(d) the write did not reach the buffer");
    CHECK(outstanding(&s) == 1, "(d) the dead child's reference stays outstanding");
    ok_status(devshare_exporter_close(s.exp, DEVSHARE_CLOSE_UNLINK), "(d) devshare_exporter_close(DEVSHARE_CLOSE_UNLINK)");
    CHECK(names_gone(&h), "(d) after the close with DEVSHARE_CLOSE_UNLINK, nothing of it is left in /dev/shm");
}

static void test_a_consumer_that_exits_holding_keeps_its_reference_outstanding(void) {
    struct shared s;
    DevshareHandle h;
    char text[DEVSHARE_HANDLE_MAX_TEXT_SIZE];
    struct child c;
    if (make_shared(&s) != 0) {
        return;
    }
    if (share(&s, &h, text, sizeof text) != 0 || spawn(&c, "exit-holding", "") != 0) {
        devshare_exporter_close(s.exp, DEVSHARE_CLOSE_FORCE);
        return;
    }
    tell(&c, text);
    CHECK(hear(&c, "imported"), "(e) the child imported");
    CHECK(exited_zero(reap(&c)), "(e) the child exited (status 0) without releasing");
    /* Nothing returns a reference on a consumer's behalf: it stays outstanding. */
    CHECK(outstanding(&s) == 1, "(e) its reference stays outstanding after it exited");
    const int64_t t0 = now_ns();
    const int32_t st = devshare_exporter_wait(s.exp, 300);
    const double ms = (double)(now_ns() - t0) / 1e6;
    CHECK(st == DEVSHARE_STATUS_TIMEOUT && ms >= 290,
          "(e) devshare_exporter_wait(300 ms) returns DEVSHARE_STATUS_TIMEOUT after %.0f ms (%s)", ms,
          devshare_status_str(st));
    CHECK(outstanding(&s) == 1, "(e) still 1 outstanding after the wait");
    const int32_t cst = devshare_exporter_close(s.exp, 0);
    CHECK(cst == DEVSHARE_STATUS_OK, "(e) devshare_exporter_close succeeds (host) with the dead reference (%s)",
          devshare_status_str(cst));
    CHECK(shm_exists(h.key, h.key_len), "(e) the dead child's mapping count keeps the data object after a plain close");
    CHECK(!shm_exists(h.ref_name, h.ref_name_len), "(e) the ref-counter is gone (the dead child never held it open)");
    char name[DEVSHARE_KEY_CAPACITY + 1];
    snprintf(name, sizeof name, "%.*s", (int)h.key_len, (const char *)h.key);
    CHECK(shm_unlink(name) == 0, "(e) the test removes the leftover object itself");
    CHECK(names_gone(&h), "(e) afterwards nothing of it is left in /dev/shm");
}

/* When the test started (CLOCK_REALTIME): an object named for one of its pids but older than
 * that is another process's that had the same pid before (left by a process that died). */
static struct timespec test_start;

static int made_since_start(const char *name) {
    char path[300];
    struct stat st;
    snprintf(path, sizeof path, "/dev/shm/%s", name);
    if (stat(path, &st) != 0) {
        return 0; /* gone meanwhile */
    }
    return st.st_ctim.tv_sec > test_start.tv_sec ||
           (st.st_ctim.tv_sec == test_start.tv_sec && st.st_ctim.tv_nsec >= test_start.tv_nsec);
}

/* No devshare_<pid>_* / devshare_rc_<pid>_* object of this process or any child it made. */
static void check_dev_shm(void) {
    DIR *d = opendir("/dev/shm");
    if (d == NULL) {
        CHECK(0, "/dev/shm can be listed");
        return;
    }
    int left = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        for (int k = -1; k < n_created; k++) {
            const long pid = k < 0 ? (long)getpid() : (long)created[k];
            char p1[48], p2[48];
            snprintf(p1, sizeof p1, "devshare_%ld_", pid);
            snprintf(p2, sizeof p2, "devshare_rc_%ld_", pid);
            if ((strncmp(e->d_name, p1, strlen(p1)) == 0 || strncmp(e->d_name, p2, strlen(p2)) == 0) &&
                made_since_start(e->d_name)) {
                printf("    left over: /dev/shm/%s\n", e->d_name);
                left++;
            }
        }
    }
    closedir(d);
    CHECK(left == 0, "no /dev/shm object of this test's %d processes is left", n_created + 1);
}

int main(int argc, char **argv) {
    harness_start(NULL);
    clock_gettime(CLOCK_REALTIME, &test_start);
    if (argc > 2 && strcmp(argv[1], "--child") == 0) {
        return child_main(argc, argv);
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    signal(SIGPIPE, SIG_IGN);
    test_a_consumer_process_reads_writes_and_releases_a_host_buffer();
    test_two_consumers_hold_one_buffer_and_release_it_one_after_the_other();
    test_a_consumers_mapping_outlives_the_exporters_close();
    test_a_write_through_a_read_only_import_faults_and_changes_nothing();
    test_a_consumer_that_exits_holding_keeps_its_reference_outstanding();
    check_dev_shm();
    return harness_done();
}
