/* SPDX-License-Identifier: Apache-2.0 */
/* What the device benchmarks share: dying with devshare's last error, timing, medians. */
#ifndef DEVSHARE_BENCH_COMMON_H
#define DEVSHARE_BENCH_COMMON_H

#include "devshare.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#ifndef BENCH_NAME
#error "define BENCH_NAME (the program's name, for messages) before including bench_common.h"
#endif

static void die(const char *what, long code) {
    char msg[1024] = "";
    devshare_last_error(msg, sizeof msg);
    fprintf(stderr, BENCH_NAME ": %s failed (%ld) %s\n", what, code, msg);
    exit(2);
}

#define OK(call)                                                                                                  \
    do {                                                                                                          \
        long rc_ = (long)(call);                                                                                  \
        if (rc_ != 0) {                                                                                           \
            die(#call, rc_);                                                                                      \
        }                                                                                                         \
    } while (0)

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median and mean of v[0..n) (sorts v). */
static void stats(double *v, int n, double *median, double *mean) {
    double s = 0;
    for (int i = 0; i < n; i++) {
        s += v[i];
    }
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    *median = v[n / 2];
    *mean = s / n;
}

#endif
