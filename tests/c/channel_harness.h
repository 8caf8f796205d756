/* SPDX-License-Identifier: Apache-2.0 */
/*
 * channel_harness.h: what test_channel and channel_crash share on top of harness.h: the items
 * both write and check (a seq number in the first 8 bytes, a fill byte derived from it over the
 * middle, ~seq in the last 8), and which /dev/shm names carry a process's pid (those an earlier
 * process with the same pid left aside).
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

/* /dev/shm names that carried a checked pid before its process ran: an earlier process had the
 * same pid (the pid was reused) and left them; they are not counted against the new one. */
static char **shm_stale;
static size_t shm_n_stale;

static inline int shm_is_stale(const char *name) {
    for (size_t i = 0; i < shm_n_stale; i++) {
        if (strcmp(shm_stale[i], name) == 0) {
            return 1;
        }
    }
    return 0;
}

/* /dev/shm names carrying `pid` (the ACL stand-in's aclsi_* aside) that are not stale. With
 * `record` (before the process runs), every one is remembered as stale; otherwise each is printed
 * as left over. Returns how many there were. */
static inline int shm_names_of(pid_t pid, int record) {
    DIR *d = opendir("/dev/shm");
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d)) != NULL;) {
        if (strncmp(e->d_name, "aclsi_", 6) == 0 || shm_is_stale(e->d_name) ||
            !shm_name_has_pid(e->d_name, (long)pid)) {
            continue;
        }
        if (record) {
            char **grown = realloc(shm_stale, (shm_n_stale + 1) * sizeof *shm_stale);
            char *name = strdup(e->d_name);
            if (!grown || !name) {
                die("remembering /dev/shm names", errno);
            }
            shm_stale = grown;
            shm_stale[shm_n_stale++] = name;
        } else {
            printf("    left over: /dev/shm/%s\n", e->d_name);
        }
        n++;
    }
    if (d) {
        closedir(d);
    }
    return n;
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
