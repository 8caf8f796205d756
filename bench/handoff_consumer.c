/* SPDX-License-Identifier: Apache-2.0 */
/*
 * handoff_consumer: the C consumer of bench/handoff.py.
 *
 * Reads lines "<seq> <t0_ns> <handle-text>" on stdin. For each: parse the handle, import it,
 * touch the tensor (read its first and last byte), take the time (CLOCK_MONOTONIC, the clock
 * Python's time.monotonic_ns() reads), release, and acknowledge with a line
 * "<seq> <t1_ns> <checksum>" (flushed). Prints "ready" first. A handle text of "-" carries no
 * tensor: the line is only timestamped and acknowledged (the benchmark's pipe-only floor).
 * Exits 0 at end of input, 1 at the first failure (with the library's message on stderr).
 */
#define _POSIX_C_SOURCE 200809L

#include "devshare.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int fail(const char *what, int32_t st) {
    char msg[512];
    devshare_last_error(msg, sizeof msg);
    fprintf(stderr, "handoff_consumer: %s: %s: %s\n", what, devshare_status_str(st), msg);
    return 1;
}

int main(void) {
    static char line[DEVSHARE_HANDLE_MAX_TEXT_SIZE + 64];
    printf("ready\n");
    fflush(stdout);
    while (fgets(line, sizeof line, stdin) != NULL) {
        long long seq = 0, t0 = 0;
        int consumed = 0;
        if (sscanf(line, "%lld %lld %n", &seq, &t0, &consumed) != 2) {
            fprintf(stderr, "handoff_consumer: malformed line\n");
            return 1;
        }
        if (line[consumed] == '-') {
            printf("%lld %" PRId64 " 0\n", seq, now_ns());
            fflush(stdout);
            continue;
        }
        DevshareHandle h;
        int32_t st = devshare_handle_from_text(line + consumed, &h);
        if (st != DEVSHARE_STATUS_OK) {
            return fail("devshare_handle_from_text", st);
        }
        DevshareImport *imp = NULL;
        st = devshare_import(&h, NULL, &imp);
        if (st != DEVSHARE_STATUS_OK) {
            return fail("devshare_import", st);
        }
        DevshareImportInfo info;
        devshare_import_info_init(&info, sizeof info);
        st = devshare_import_info(imp, &info);
        if (st != DEVSHARE_STATUS_OK) {
            return fail("devshare_import_info", st);
        }
        const volatile unsigned char *p = info.data;
        const uint64_t nbytes = info.numel * info.element_size;
        const unsigned checksum = nbytes ? (unsigned)p[0] + (unsigned)p[nbytes - 1] : 0;
        const int64_t t1 = now_ns();
        st = devshare_import_release(imp);
        if (st != DEVSHARE_STATUS_OK) {
            return fail("devshare_import_release", st);
        }
        printf("%lld %" PRId64 " %u\n", seq, t1, checksum);
        fflush(stdout);
        (void)t0;
    }
    return 0;
}
