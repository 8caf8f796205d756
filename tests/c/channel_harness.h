/* SPDX-License-Identifier: Apache-2.0 */
/*
 * channel_harness.h: what test_channel and channel_crash share on top of harness.h: the items
 * both write and check (a seq number in the first 8 bytes, a fill byte derived from it over the
 * middle, ~seq in the last 8), and which /dev/shm names carry a process's pid.
 *
 * Include in one test program (everything here is static), after defining HARNESS_NAME.
 */
#ifndef DEVSHARE_TEST_CHANNEL_HARNESS_H
#define DEVSHARE_TEST_CHANNEL_HARNESS_H

#include "harness.h"

/* `name` (a /dev/shm entry) carries `pid` between '_' and '_' or its end. */
static inline int shm_name_has_pid(const char *name, long pid) {
    char token[32];
    const int tl = snprintf(token, sizeof token, "_%ld", pid);
    for (const char *p = strstr(name, token); p; p = strstr(p + 1, token)) {
        if (p[tl] == '_' || p[tl] == '\0') {
            return 1;
        }
    }
    return 0;
}

static inline uint8_t fill_byte(uint64_t seq) { return (uint8_t)(seq % 251u + 1u); }

/* Write item `seq` over `size` (>= 16) bytes of host memory; `midway` (may be NULL) runs once
 * half of the middle is written. */
static inline void item_fill_host(uint8_t *p, uint64_t size, uint64_t seq, void (*midway)(void)) {
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
static inline int item_check_host(const uint8_t *p, uint64_t size, uint64_t *seq_out, void (*midway)(void)) {
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

#endif /* DEVSHARE_TEST_CHANNEL_HARNESS_H */
