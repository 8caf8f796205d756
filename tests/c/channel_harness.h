/* SPDX-License-Identifier: Apache-2.0 */
/*
 * channel_harness.h: what test_channel and channel_crash share — a monotonic clock, the last
 * error, reading a child's line with a deadline, and the items both write and check: a seq
 * number in the first 8 bytes, a fill byte derived from it over the middle, ~seq in the last 8.
 *
 * Include after devshare.h, in one test program (everything here is static).
 */
#ifndef DEVSHARE_TEST_CHANNEL_HARNESS_H
#define DEVSHARE_TEST_CHANNEL_HARNESS_H

#include "devshare.h"

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int64_t now_ms(void) { return now_ns() / 1000000; }

static const char *last_error(void) {
    static char msg[2048];
    devshare_last_error(msg, sizeof msg);
    return msg;
}

/* One line from `fd` without its newline, within `timeout_ms` in all: its length, or -1 on
 * timeout, error or end of file. */
static int read_line_fd(int fd, char *buf, size_t cap, int timeout_ms) {
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

static uint8_t fill_byte(uint64_t seq) { return (uint8_t)(seq % 251u + 1u); }

/* Write item `seq` over `size` (>= 16) bytes of host memory; `midway` (may be NULL) runs once
 * half of the middle is written. */
static void item_fill_host(uint8_t *p, uint64_t size, uint64_t seq, void (*midway)(void)) {
    const uint64_t inv = ~seq;
    memcpy(p, &seq, 8);
    if (midway) {
        memset(p + 8, fill_byte(seq), (size_t)(size / 2));
        midway();
    }
    memset(p + 8, fill_byte(seq), (size_t)(size - 16));
    memcpy(p + size - 8, &inv, 8);
}

/* 1 when the bytes are one whole item; its seq in *seq_out. `midway` (may be NULL) runs once
 * half of the bytes are checked. */
static int item_check_host(const uint8_t *p, uint64_t size, uint64_t *seq_out, void (*midway)(void)) {
    if (size < 16) {
        return 0;
    }
    uint64_t seq, inv;
    memcpy(&seq, p, 8);
    memcpy(&inv, p + size - 8, 8);
    if (inv != ~seq) {
        return 0;
    }
    const uint8_t b = fill_byte(seq);
    for (uint64_t i = 8; i < size - 8; i++) {
        if (midway && i == size / 2) {
            midway();
        }
        if (p[i] != b) {
            return 0;
        }
    }
    *seq_out = seq;
    return 1;
}

#endif
