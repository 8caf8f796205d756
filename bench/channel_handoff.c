/* SPDX-License-Identifier: Apache-2.0 */
/*
 * channel_handoff: per-item handoff between two processes, C producer and C consumer.
 *
 *   pool        one sealed-memfd allocation (devshare_channel_host_alloc) cut into slots
 *               (devshare_pool_create): the producer acquires a slot and sends it
 *               (devshare_pool_send); the consumer takes it with devshare_connection_recv,
 *               touches it and gives it back with devshare_import_release; the producer's next
 *               devshare_pool_acquire gets it back.
 *   user        the pool again, with the producer writing each item as a user does: its first
 *               8 bytes (the item's sequence number) written after the acquire and before the
 *               send, inside the timed region (bench/user_pays.py).
 *   lease       devshare_channel_send of one region of a sealed-memfd allocation per item (a
 *               leased reference); the producer waits for it with devshare_exporter_wait.
 *   handle      today's handle-per-item path: devshare_exporter_share_encoded on one of several
 *               devshare_host_alloc allocations, the encoding over a pipe,
 *               devshare_import_encoded + devshare_import_release in the consumer, an ack back.
 *   pipe-floor  the same pipe and processes with no tensor at all: 8 bytes out, an ack back:
 *               what any pipe-based handoff between these two processes costs at least.
 *   socket-floor  the floor again over one SOCK_SEQPACKET socket pair, the kind of socket a
 *               channel is: what the transport itself costs.
 *   remote      the pool on a tcp://127.0.0.1 channel (a remote channel over loopback): the
 *               item's bytes travel on the authenticated connection into the consumer's own
 *               copy of the slot; the round trip ends when its release is back.
 *   tcp-copy    the item's bytes over a loopback TCP connection (TCP_NODELAY) into the
 *               consumer's buffer, then an ack back: the baseline of the remote method.
 *   pipe-copy   the item's bytes themselves through the pipe into the consumer's buffer, then
 *               an ack back (sizes below 1 MiB only).
 *   breakdown   the pool and lease again, with the consumer waiting in poll(2) on
 *               devshare_connection_fd and then calling devshare_connection_recv without
 *               blocking, so that each step can be timed on its own (see below).
 *
 * Latency: one item in flight. From just before the producer hands the item (pool: the slot
 * is already acquired) until the consumer has touched it (read its first and last byte), both
 * sides reading CLOCK_MONOTONIC; the round trip runs until the producer has the item back
 * (pool: devshare_pool_acquire returns the slot; lease: devshare_exporter_wait returns; pipes:
 * the ack was read). For the pool the other slots stay acquired, so exactly one slot cycles.
 * Throughput: N items handed back to back (pool: as fast as slots come back; lease: at most as
 * many in flight as the pool has slots; pipes: as the pipe takes them), N / (last consumer
 * touch - first hand). Every item lies in memory written before timing, and every process is
 * started and warmed up (each slot or buffer handed out twice) before timing.
 *
 * Breakdown steps (medians over the one-at-a-time items), which follow one item through both
 * processes and add up to its round trip: woken (from just before the producer's send until
 * poll returns in the consumer), recv, info (devshare_import_info), touch, release
 * (devshare_import_release, which sends the release message), back (from the release's return
 * until the producer's acquire / wait returns). hand is the producer's send call alone.
 *
 * Usage:
 *   channel_handoff run [--count N] [--large-count N] [--sizes 4096,67108864]
 *                       [--slots N] [--large-slots N] [--cpus any|one|two] [--spin US]
 *                       [--methods pool,user,lease,handle,pipe-floor,socket-floor,pipe-copy,remote,tcp-copy,breakdown]
 *                       [--consumer CMD]
 *   channel_handoff consume ADDRESS [--poll]
 *   channel_handoff syscalls [N]
 *   channel_handoff loop [N]
 *
 * `run` prints one JSON object per measurement on stdout (bench/channel_handoff.py reads
 * them) and a readable line on stderr. --count is the number of items per measurement for
 * sizes below 1 MiB, --large-count above; --slots / --large-slots the pool's slot count (and
 * the number of buffers the other methods hand out round-robin) for the same two classes.
 * --cpus places the two processes: any (the scheduler decides, the default), one (both pinned
 * to one CPU: every handoff is a context switch) or two (pinned to two different CPUs: every
 * handoff wakes the other CPU). Where the scheduler puts them moves the figures by several
 * microseconds on a small machine, so comparisons are made within one placement.
 *
 * --consumer CMD runs the channel consumer of the pool, user and lease methods as
 * `/bin/sh -c 'exec CMD "$@"' sh consume ADDRESS [--poll]` instead of this program (a consumer in
 * another language that prints the same records, such as `bench/user_pays.py consume`).
 *
 * `consume` is the channel consumer (bench/channel_handoff.py also runs it behind a Python
 * producer): it connects to ADDRESS, takes items until the channel closes, then prints the
 * number of items and one line per item with six CLOCK_MONOTONIC times in ns: before recv,
 * poll returned, recv returned, info returned, touched, released. Without --poll (every run but
 * the breakdown) only the touch is read, the other five are 0: four clock reads an item would
 * otherwise add to the consumer's side of every figure.
 * The pipe consumers are internal modes (handle-consume, pipe-consume SIZE).
 *
 * `syscalls` times, N times each in a loop (default 100000) with nobody waiting on the other
 * end, the system calls these handoffs are made of (getpid, accept4 with nothing pending,
 * recvmsg with nothing queued, send and recvmsg of a 64-byte SOCK_SEQPACKET message, a pipe's
 * 8-byte write + read, epoll_wait and ppoll on a ready descriptor): one JSON object per call on
 * stdout, a readable line on stderr.
 *
 * `loop` measures the library's own work per pool item with no wake-up in it: producer and
 * consumer in one process and thread, N items (default 20000) per round, 21 rounds, with 1 and
 * with 8 slots; the median ns per item as one JSON object per pool on stdout.
 */
#define _GNU_SOURCE

#include "devshare.h"
#define BENCH_NAME "channel_handoff"
/* die() and OK() from here; its µs timer and stats() are not used (percentiles in ns below). */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include "bench_common.h"
#pragma GCC diagnostic pop

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define LARGE ((uint64_t)1 << 20)

static char self_exe[4096];
/* --cpus: "any" (the scheduler places both processes), "one" (both on one CPU), "two" (the
 * producer on one CPU, the consumer on another). */
static const char *cpus_mode = "any";
/* run --spin: how long both ends of the pool and lease methods spin before sleeping (µs). */
static uint32_t spin_us = 0;
/* run --consumer: the channel consumer's command (a shell word list), NULL for this program. */
static const char *consumer_cmd = NULL;
static int consumer_cpu = -1; /* "two": the CPU the consumer is pinned to before its exec */
static volatile unsigned sink; /* what the consumers' touches read, so that no read is optimised away */

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static unsigned touch_bytes(const void *data, uint64_t n) {
    const volatile unsigned char *p = data;
    return n ? (unsigned)p[0] + (unsigned)p[n - 1] : 0;
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (p == NULL) {
        die("malloc", (long)n);
    }
    return p;
}

/* ------------------------------------------------------------------------------- consumers */

typedef struct {
    int64_t wait, wake, recv, info, touch, release;
} ConsRec;

typedef struct {
    int64_t seq, t1;
} Ack;

/* consume ADDRESS [--poll]: the channel consumer (pool slots and leases alike). */
static int consume_channel(const char *address, int use_poll) {
    DevshareConnection *c = NULL;
    OK(devshare_channel_connect(address, 60000, &c));
    const char *spin = getenv("DEVSHARE_BENCH_SPIN_US"); /* set by run --spin */
    if (spin != NULL) {
        OK(devshare_connection_set_spin(c, (uint32_t)strtoul(spin, NULL, 10)));
    }
    size_t cap = 4096, n = 0;
    ConsRec *recs = xmalloc(cap * sizeof *recs);
    DevshareImportInfo info;
    devshare_import_info_init(&info, sizeof info);
    /* Only an event loop takes the descriptor: once taken, each item that arrives while the
     * consumer is outside recv costs the producer a wake-up (devshare_connection_fd). */
    const int fd = use_poll ? devshare_connection_fd(c) : -1;
    /* Only the breakdown (which polls) reads every stamp; the other runs use an item's touch
     * alone, so they take that one and leave out four clock reads per item. */
    const int stamps = use_poll;
    for (;;) {
        ConsRec r = {0};
        DevshareImport *imp = NULL;
        int32_t st;
        if (stamps) {
            r.wait = now_ns();
        }
        if (use_poll) {
            struct pollfd pfd = {.fd = fd, .events = POLLIN};
            if (poll(&pfd, 1, -1) < 0) {
                if (errno == EINTR) {
                    continue;
                }
                die("poll", errno);
            }
            r.wake = now_ns();
            st = devshare_connection_recv(c, 0, &imp);
            if (st == DEVSHARE_STATUS_TIMEOUT) {
                continue; /* woken by something that is not an item */
            }
        } else {
            st = devshare_connection_recv(c, -1, &imp);
        }
        if (st == DEVSHARE_STATUS_CLOSED) {
            break;
        }
        if (st != DEVSHARE_STATUS_OK) {
            die("devshare_connection_recv", st);
        }
        if (stamps) {
            r.recv = now_ns();
        }
        OK(devshare_import_info(imp, &info));
        if (stamps) {
            r.info = now_ns();
        }
        sink += touch_bytes(info.data, info.numel * info.element_size);
        r.touch = now_ns();
        OK(devshare_import_release(imp));
        if (stamps) {
            r.release = now_ns();
        }
        if (n == cap) {
            cap *= 2;
            recs = realloc(recs, cap * sizeof *recs);
            if (recs == NULL) {
                die("realloc", (long)cap);
            }
        }
        recs[n++] = r;
    }
    OK(devshare_connection_close(c));
    printf("%zu\n", n);
    for (size_t i = 0; i < n; i++) {
        printf("%" PRId64 " %" PRId64 " %" PRId64 " %" PRId64 " %" PRId64 " %" PRId64 "\n", recs[i].wait,
               recs[i].wake, recs[i].recv, recs[i].info, recs[i].touch, recs[i].release);
    }
    free(recs);
    return fflush(stdout) == 0 ? 0 : 1;
}

/* Reads n bytes from stdin: 1, or 0 at a clean end of input; dies on a partial message. */
static int read_msg(void *buf, size_t n) {
    const size_t got = fread(buf, 1, n, stdin);
    if (got == n) {
        return 1;
    }
    if (got == 0 && feof(stdin)) {
        return 0;
    }
    die("read (partial message)", (long)got);
    return 0;
}

static void ack(int64_t seq) {
    const Ack a = {seq, now_ns()};
    if (fwrite(&a, sizeof a, 1, stdout) != 1 || fflush(stdout) != 0) {
        die("write ack", errno);
    }
}

/* handle-consume: messages <u32 length><encoding> on stdin, one ack per handle on stdout. */
static int consume_handles(void) {
    static unsigned char buf[1 << 16];
    DevshareImportInfo info;
    devshare_import_info_init(&info, sizeof info);
    for (int64_t seq = 0;; seq++) {
        uint32_t len = 0;
        if (!read_msg(&len, sizeof len)) {
            return 0;
        }
        if (len > sizeof buf || !read_msg(buf, len)) {
            die("handle message", (long)len);
        }
        DevshareImport *imp = NULL;
        OK(devshare_import_encoded(buf, len, NULL, &imp));
        OK(devshare_import_info(imp, &info));
        sink += touch_bytes(info.data, info.numel * info.element_size);
        const int64_t t1 = now_ns();
        OK(devshare_import_release(imp));
        const Ack a = {seq, t1};
        if (fwrite(&a, sizeof a, 1, stdout) != 1 || fflush(stdout) != 0) {
            die("write ack", errno);
        }
    }
}

/* pipe-consume SIZE: SIZE 0 reads 8-byte messages (the floor); otherwise SIZE bytes of payload,
 * touched like an item. One ack per message. */
static int consume_pipe(uint64_t size) {
    const size_t n = size ? (size_t)size : 8;
    unsigned char *buf = xmalloc(n);
    for (int64_t seq = 0;; seq++) {
        if (!read_msg(buf, n)) {
            free(buf);
            return 0;
        }
        if (size) {
            sink += touch_bytes(buf, size);
        }
        ack(seq);
    }
}

/* ------------------------------------------------------------------------------- producers */

typedef struct {
    pid_t pid;
    int to;   /* the child's stdin, or -1 */
    int from; /* the child's stdout */
} Child;

enum { NO_STDIN, PIPES, SOCKET, TCP };

/* A connected pair of loopback TCP sockets (TCP_NODELAY on both): what a plain TCP copy uses. */
static void tcp_pair(int fds[2]) {
    const int l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof a) != 0 || listen(l, 1) != 0 ||
        getsockname(l, (struct sockaddr *)&a, &len) != 0) {
        die("tcp listen", errno);
    }
    fds[1] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fds[1] < 0 || connect(fds[1], (struct sockaddr *)&a, sizeof a) != 0) {
        die("tcp connect", errno);
    }
    fds[0] = accept4(l, NULL, NULL, SOCK_CLOEXEC);
    if (fds[0] < 0) {
        die("tcp accept", errno);
    }
    close(l);
    const int one = 1;
    for (int k = 0; k < 2; k++) {
        if (setsockopt(fds[k], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0) {
            die("TCP_NODELAY", errno);
        }
    }
}

/* This program again as the consumer: stdout a pipe (NO_STDIN), or stdin and stdout pipes
 * (PIPES), or both one end of a SOCK_SEQPACKET socket pair (SOCKET: to == from). */
static Child spawn(const char *mode, const char *arg1, const char *arg2, int io) {
    int in[2] = {-1, -1}, out[2];
    if (io == SOCKET) {
        if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, out) != 0) {
            die("socketpair", errno);
        }
    } else if (io == TCP) {
        tcp_pair(out);
    } else if ((io == PIPES && pipe2(in, O_CLOEXEC) != 0) || pipe2(out, O_CLOEXEC) != 0) {
        die("pipe2", errno);
    }
    fflush(NULL);
    const pid_t pid = fork();
    if (pid < 0) {
        die("fork", errno);
    }
    if (pid == 0) {
        if (consumer_cpu >= 0) {
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET(consumer_cpu, &set);
            if (sched_setaffinity(0, sizeof set, &set) != 0) {
                _exit(126);
            }
        }
        if ((io == PIPES && dup2(in[0], 0) < 0) || ((io == SOCKET || io == TCP) && dup2(out[1], 0) < 0) ||
            dup2(out[1], 1) < 0) {
            _exit(127);
        }
        if (consumer_cmd != NULL && strcmp(mode, "consume") == 0) {
            char script[4200];
            snprintf(script, sizeof script, "exec %s \"$@\"", consumer_cmd);
            char *sh[] = {(char *)"/bin/sh", (char *)"-c", script, (char *)"sh", (char *)mode, (char *)arg1,
                          (char *)arg2, NULL};
            execv("/bin/sh", sh);
            _exit(127);
        }
        char *argv[] = {(char *)"channel_handoff", (char *)mode, (char *)arg1, (char *)arg2, NULL};
        execv(self_exe, argv);
        _exit(127);
    }
    if (io == PIPES) {
        close(in[0]);
    }
    close(out[1]);
    return (Child){pid, io == PIPES ? in[1] : (io == SOCKET || io == TCP ? out[0] : -1), out[0]};
}

static void reap(Child *c) {
    if (c->to >= 0 && c->to != c->from) {
        close(c->to);
    }
    close(c->from);
    int status = 0;
    if (waitpid(c->pid, &status, 0) < 0) {
        die("waitpid", errno);
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        die("consumer exit status", status);
    }
}

static void write_all(int fd, const void *p, size_t n) {
    const char *c = p;
    while (n > 0) {
        const ssize_t w = write(fd, c, n);
        if (w < 0 && errno == EINTR) {
            continue;
        }
        if (w <= 0) {
            die("write", errno);
        }
        c += w;
        n -= (size_t)w;
    }
}

static void read_exact(int fd, void *p, size_t n) {
    char *c = p;
    while (n > 0) {
        const ssize_t r = read(fd, c, n);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            die("read (consumer gone?)", r < 0 ? errno : 0);
        }
        c += r;
        n -= (size_t)r;
    }
}

/* The channel consumer's records, read from its stdout until it exits. */
static ConsRec *collect_records(Child *c, size_t expect) {
    size_t cap = 1 << 16, len = 0;
    char *text = xmalloc(cap + 1);
    for (;;) {
        if (len == cap) {
            cap *= 2;
            text = realloc(text, cap + 1);
            if (text == NULL) {
                die("realloc", (long)cap);
            }
        }
        const ssize_t r = read(c->from, text + len, cap - len);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r < 0) {
            die("read records", errno);
        }
        if (r == 0) {
            break;
        }
        len += (size_t)r;
    }
    text[len] = '\0';
    reap(c);
    char *p = text, *end = NULL;
    const unsigned long long n = strtoull(p, &end, 10);
    if (end == p || n != expect) {
        fprintf(stderr, BENCH_NAME ": the consumer reported %llu items, expected %zu\n", n, expect);
        exit(2);
    }
    ConsRec *recs = xmalloc(expect * sizeof *recs);
    for (size_t i = 0; i < expect; i++) {
        int64_t f[6];
        for (int k = 0; k < 6; k++) {
            p = end;
            f[k] = strtoll(p, &end, 10);
            if (end == p) {
                die("malformed consumer records", (long)i);
            }
        }
        recs[i] = (ConsRec){f[0], f[1], f[2], f[3], f[4], f[5]};
    }
    free(text);
    return recs;
}

static int cmp_i64(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The q-th percentile of v[0..n) in µs, nearest rank as bench/handoff.py computes it (sorts v). */
static double pct_us(int64_t *v, int n, double q) {
    qsort(v, (size_t)n, sizeof *v, cmp_i64);
    long i = (long)(q / 100.0 * (n - 1) + 0.5);
    i = i < 0 ? 0 : (i >= n ? n - 1 : i);
    return (double)v[i] / 1e3;
}

/* Median of b[i] - a[i] in µs. */
static double median_diff_us(const int64_t *a, const int64_t *b, int n) {
    int64_t *d = xmalloc((size_t)n * sizeof *d);
    for (int i = 0; i < n; i++) {
        d[i] = b[i] - a[i];
    }
    const double m = pct_us(d, n, 50);
    free(d);
    return m;
}

/* One measurement: latency from t0 to t1 (touched) and t2 (back), throughput from start to
 * the last of the throughput items' touches. */
static void report(const char *method, uint64_t size, int lat, const int64_t *t0, const int64_t *t1,
                   const int64_t *t2, int tput, int64_t start, int64_t last) {
    int64_t *one = xmalloc((size_t)lat * sizeof *one), *rt = xmalloc((size_t)lat * sizeof *rt);
    for (int i = 0; i < lat; i++) {
        one[i] = t1[i] - t0[i];
        rt[i] = t2[i] - t0[i];
        if (one[i] < 0 || rt[i] < one[i]) {
            die("timestamps out of order", (long)i);
        }
    }
    const double p50 = pct_us(one, lat, 50), p99 = pct_us(one, lat, 99);
    const double rt50 = pct_us(rt, lat, 50), rt99 = pct_us(rt, lat, 99);
    const double per_s = tput / ((double)(last - start) / 1e9);
    printf("{\"method\": \"%s\", \"path\": \"C->C\", \"cpus\": \"%s\", \"size\": %" PRIu64 ", \"p50_us\": %.2f, "
           "\"p99_us\": %.2f, \"rt_p50_us\": %.2f, \"rt_p99_us\": %.2f, \"per_s\": %.0f, \"latency_items\": %d, "
           "\"throughput_items\": %d}\n",
           method, cpus_mode, size, p50, p99, rt50, rt99, per_s, lat, tput);
    fflush(stdout);
    fprintf(stderr,
            "%10" PRIu64 " B  %-12s C->C   cpus %-3s  p50 %8.1f us  p99 %8.1f us  round trip p50 %8.1f us  "
            "%9.0f items/s\n",
            size, method, cpus_mode, p50, p99, rt50, per_s);
    free(one);
    free(rt);
}

/* The breakdown of the one-at-a-time items of a channel method (consumer in poll mode): the
 * median of each step. The steps follow one item through both processes and add up to its
 * round trip: woken (from just before the producer's send until the consumer's poll returns),
 * recv, info, touch, release (the consumer's calls), back (from the release's return until the
 * producer's acquire / wait returns). hand is the producer's send call on its own; when both
 * processes share a CPU it includes the consumer's turn (the wake-up preempts the sender). */
static void report_breakdown(const char *method, uint64_t size, int lat, const int64_t *t0, const int64_t *ts,
                             const int64_t *t2, const ConsRec *r) {
    int64_t *a = xmalloc((size_t)lat * 5 * sizeof *a);
    int64_t *wake = a, *recv = a + lat, *info = a + 2 * lat, *touch = a + 3 * lat, *rel = a + 4 * lat;
    for (int i = 0; i < lat; i++) {
        wake[i] = r[i].wake;
        recv[i] = r[i].recv;
        info[i] = r[i].info;
        touch[i] = r[i].touch;
        rel[i] = r[i].release;
    }
    const double hand = median_diff_us(t0, ts, lat), w = median_diff_us(t0, wake, lat),
                 rv = median_diff_us(wake, recv, lat), inf = median_diff_us(recv, info, lat),
                 tch = median_diff_us(info, touch, lat), rl = median_diff_us(touch, rel, lat),
                 back = median_diff_us(rel, t2, lat), p50 = median_diff_us(t0, touch, lat),
                 rt50 = median_diff_us(t0, t2, lat);
    printf("{\"breakdown\": \"%s\", \"path\": \"C->C\", \"cpus\": \"%s\", \"size\": %" PRIu64 ", "
           "\"hand_us\": %.2f, \"woken_us\": %.2f, \"recv_us\": %.2f, \"info_us\": %.2f, \"touch_us\": %.2f, "
           "\"release_us\": %.2f, \"back_us\": %.2f, \"p50_us\": %.2f, \"rt_p50_us\": %.2f, "
           "\"latency_items\": %d}\n",
           method, cpus_mode, size, hand, w, rv, inf, tch, rl, back, p50, rt50, lat);
    fflush(stdout);
    fprintf(stderr,
            "%10" PRIu64 " B  %-12s C->C   cpus %-3s  breakdown (p50 us): woken %.1f, recv %.1f, info %.1f, "
            "touch %.1f, release %.1f, back %.1f (hand %.1f); handoff p50 %.1f, round trip p50 %.1f\n",
            size, method, cpus_mode, w, rv, inf, tch, rl, back, hand, p50, rt50);
    free(a);
}

static unsigned address_seq;

static void make_address(char *buf, size_t cap) {
    snprintf(buf, cap, "@devshare-bench-channel-handoff-%d-%u", (int)getpid(), address_seq++);
}

static uint64_t wait_peer(DevshareChannel *ch) {
    OK(devshare_channel_wait_peers(ch, 1, 120000));
    uint64_t id = 0;
    size_t n = 0;
    OK(devshare_channel_peer_ids(ch, &id, 1, &n));
    if (n != 1 || id == 0) {
        die("devshare_channel_peer_ids: peer count", (long)n);
    }
    return id;
}

typedef struct {
    uint64_t size;
    uint32_t slots;
    int warm, lat, tput;
} Plan;

/* The producer's write of item seq into a slot (user method): its first 8 bytes. */
static void write_item(void *ptr, uint64_t size, int64_t seq) {
    if (size >= sizeof seq) {
        memcpy(ptr, &seq, sizeof seq);
    } else {
        memset(ptr, (int)seq, (size_t)size);
    }
}

/* The consumer's records of a run (warm-up, latency and throughput items, in order): each
 * latency item's touch time into t1, and the last throughput item's touch into *last. */
static ConsRec *consumer_touches(Child *c, const Plan *pl, int64_t *t1, int64_t *last) {
    ConsRec *r = collect_records(c, (size_t)(pl->warm + pl->lat + pl->tput));
    const ConsRec *rl = r + pl->warm, *rt = r + pl->warm + pl->lat;
    for (int i = 0; i < pl->lat; i++) {
        t1[i] = rl[i].touch;
    }
    for (int i = 0; i < pl->tput; i++) {
        *last = rt[i].touch > *last ? rt[i].touch : *last;
    }
    return r;
}

/* pool: acquire, send; the consumer receives, touches, releases; acquire again. write (the
 * user method): the producer writes each item between its acquire and its send. */
static void run_pool(const Plan *pl, int breakdown, int write) {
    char addr[128];
    make_address(addr, sizeof addr);
    DevshareChannel *ch = NULL;
    OK(devshare_channel_listen(addr, &ch));
    DevshareExporter *exp = NULL;
    void *base = NULL;
    OK(devshare_channel_host_alloc(pl->size * pl->slots, &exp, &base));
    for (uint32_t k = 0; k < pl->slots; k++) {
        memset((char *)base + k * pl->size, (int)(k + 1), pl->size);
    }
    DevsharePool *pool = NULL;
    OK(devshare_pool_create(ch, exp, pl->size, pl->slots, &pool));
    OK(devshare_pool_set_spin(pool, spin_us));
    Child c = spawn("consume", addr, breakdown ? "--poll" : NULL, NO_STDIN);
    const uint64_t peer = wait_peer(ch);

    uint32_t slot = 0;
    void *ptr = NULL;
    int64_t seq = 0;
    for (int i = 0; i < pl->warm; i++, seq++) {
        OK(devshare_pool_acquire(pool, -1, &slot, &ptr));
        if (write) {
            write_item(ptr, pl->size, seq);
        }
        OK(devshare_pool_send(pool, slot, peer, NULL));
    }
    /* Every slot back; all but one stay acquired, so that exactly one cycles. */
    uint32_t *held = xmalloc(pl->slots * sizeof *held);
    void *held_ptr = NULL;
    for (uint32_t k = 0; k < pl->slots; k++) {
        OK(devshare_pool_acquire(pool, -1, &held[k], &ptr));
        if (k == 0) {
            held_ptr = ptr;
        }
    }
    slot = held[0];
    ptr = held_ptr;
    int64_t *t = xmalloc((size_t)pl->lat * 4 * sizeof *t);
    int64_t *t0 = t, *ts = t + pl->lat, *t1 = t + 2 * pl->lat, *t2 = t + 3 * pl->lat;
    for (int i = 0; i < pl->lat; i++, seq++) {
        t0[i] = now_ns();
        if (write) {
            write_item(ptr, pl->size, seq);
        }
        OK(devshare_pool_send(pool, slot, peer, NULL));
        ts[i] = now_ns();
        OK(devshare_pool_acquire(pool, -1, &slot, &ptr));
        t2[i] = now_ns();
    }
    held[0] = slot;
    for (uint32_t k = 0; k < pl->slots; k++) {
        OK(devshare_pool_release(pool, held[k]));
    }
    const int64_t start = now_ns();
    for (int i = 0; i < pl->tput; i++, seq++) {
        OK(devshare_pool_acquire(pool, -1, &slot, &ptr));
        if (write) {
            write_item(ptr, pl->size, seq);
        }
        OK(devshare_pool_send(pool, slot, peer, NULL));
    }
    for (uint32_t k = 0; k < pl->slots; k++) {
        OK(devshare_pool_acquire(pool, -1, &held[k], &ptr));
    }
    for (uint32_t k = 0; k < pl->slots; k++) {
        OK(devshare_pool_release(pool, held[k]));
    }
    OK(devshare_pool_close(pool));
    OK(devshare_channel_close(ch));
    int64_t last = 0;
    ConsRec *r = consumer_touches(&c, pl, t1, &last);
    const ConsRec *rl = r + pl->warm;
    if (breakdown) {
        report_breakdown("pool", pl->size, pl->lat, t0, ts, t2, rl);
    } else {
        report(write ? "user" : "pool", pl->size, pl->lat, t0, t1, t2, pl->tput, start, last);
    }
    OK(devshare_exporter_close(exp, 0));
    free(r);
    free(t);
    free(held);
}

/* Services the channel until fewer than limit leases of exp are out. */
static void bound_leases(DevshareChannel *ch, DevshareExporter *exp, uint64_t limit) {
    for (;;) {
        uint64_t n = 0;
        OK(devshare_exporter_outstanding(exp, &n));
        if (n < limit) {
            return;
        }
        const int32_t st = devshare_channel_service(ch, 1000);
        if (st != DEVSHARE_STATUS_OK && st != DEVSHARE_STATUS_TIMEOUT) {
            die("devshare_channel_service", st);
        }
    }
}

/* lease: devshare_channel_send of region i % slots; the consumer receives, touches, releases;
 * devshare_exporter_wait sees it back. */
static void run_lease(const Plan *pl, int breakdown) {
    char addr[128];
    make_address(addr, sizeof addr);
    DevshareChannel *ch = NULL;
    OK(devshare_channel_listen(addr, &ch));
    DevshareExporter *exp = NULL;
    void *base = NULL;
    OK(devshare_channel_host_alloc(pl->size * pl->slots, &exp, &base));
    for (uint32_t k = 0; k < pl->slots; k++) {
        memset((char *)base + k * pl->size, (int)(k + 1), pl->size);
    }
    OK(devshare_channel_set_spin(ch, spin_us)); /* devshare_exporter_wait spins before it sleeps */
    Child c = spawn("consume", addr, breakdown ? "--poll" : NULL, NO_STDIN);
    const uint64_t peer = wait_peer(ch);
    DevshareTensorDesc d;
    OK(devshare_tensor_desc_init(&d, sizeof d));
    const int64_t shape[1] = {(int64_t)pl->size};
    d.dtype = (DevshareDType){DEVSHARE_DTYPE_UINT, 8, 1};
    d.ndim = 1;
    d.shape = shape;
    d.storage_size = pl->size;
#define LEASE(i)                                                                                                  \
    do {                                                                                                          \
        d.storage_offset = (uint64_t)((i) % (int)pl->slots) * pl->size;                                           \
        OK(devshare_channel_send(ch, peer, exp, &d));                                                             \
    } while (0)

    for (int i = 0; i < pl->warm; i++) {
        bound_leases(ch, exp, pl->slots);
        LEASE(i);
    }
    OK(devshare_exporter_wait(exp, -1));
    int64_t *t = xmalloc((size_t)pl->lat * 4 * sizeof *t);
    int64_t *t0 = t, *ts = t + pl->lat, *t1 = t + 2 * pl->lat, *t2 = t + 3 * pl->lat;
    for (int i = 0; i < pl->lat; i++) {
        t0[i] = now_ns();
        LEASE(i);
        ts[i] = now_ns();
        OK(devshare_exporter_wait(exp, -1));
        t2[i] = now_ns();
    }
    const int64_t start = now_ns();
    for (int i = 0; i < pl->tput; i++) {
        bound_leases(ch, exp, pl->slots);
        LEASE(i);
    }
    OK(devshare_exporter_wait(exp, -1));
#undef LEASE
    OK(devshare_channel_close(ch));
    int64_t last = 0;
    ConsRec *r = consumer_touches(&c, pl, t1, &last);
    const ConsRec *rl = r + pl->warm;
    if (breakdown) {
        report_breakdown("lease", pl->size, pl->lat, t0, ts, t2, rl);
    } else {
        report("lease", pl->size, pl->lat, t0, t1, t2, pl->tput, start, last);
    }
    OK(devshare_exporter_close(exp, 0));
    free(r);
    free(t);
}

/* A pipe method's message for item i: a pointer to len bytes (scratch may hold them). */
typedef const void *(*MakeMsg)(void *ctx, int i, unsigned char *scratch, size_t cap, size_t *len);

typedef struct {
    DevshareExporter **exp;
    uint32_t n;
} HandleCtx;

static const void *handle_msg(void *ctx, int i, unsigned char *scratch, size_t cap, size_t *len) {
    const HandleCtx *h = ctx;
    size_t n = 0;
    OK(devshare_exporter_share_encoded(h->exp[(uint32_t)i % h->n], NULL, scratch + 4, cap - 4, &n));
    const uint32_t l = (uint32_t)n;
    memcpy(scratch, &l, sizeof l);
    *len = n + 4;
    return scratch;
}

static const void *floor_msg(void *ctx, int i, unsigned char *scratch, size_t cap, size_t *len) {
    (void)ctx;
    (void)cap;
    const int64_t seq = i;
    memcpy(scratch, &seq, sizeof seq);
    *len = sizeof seq;
    return scratch;
}

typedef struct {
    unsigned char **buf;
    uint32_t n;
    uint64_t size;
} CopyCtx;

static const void *copy_msg(void *ctx, int i, unsigned char *scratch, size_t cap, size_t *len) {
    const CopyCtx *c = ctx;
    (void)scratch;
    (void)cap;
    *len = c->size;
    return c->buf[(uint32_t)i % c->n];
}

static void check_ack(const Ack *a, int64_t seq) {
    if (a->seq != seq) {
        die("ack out of order", (long)a->seq);
    }
}

/* A pipe method: messages out on the consumer's stdin, acks back on its stdout (pipes, or one
 * SOCK_SEQPACKET socket for the socket floor). */
static void run_pipe(const char *method, const Plan *pl, int io, const char *mode, const char *mode_arg, MakeMsg make,
                     void *ctx) {
    Child c = spawn(mode, mode_arg, NULL, io);
    static unsigned char scratch[1 << 16];
    Ack a;
    int64_t seq = 0;
    for (int i = 0; i < pl->warm; i++, seq++) {
        size_t len = 0;
        const void *m = make(ctx, (int)seq, scratch, sizeof scratch, &len);
        write_all(c.to, m, len);
        read_exact(c.from, &a, sizeof a);
        check_ack(&a, seq);
    }
    int64_t *t = xmalloc((size_t)pl->lat * 3 * sizeof *t);
    int64_t *t0 = t, *t1 = t + pl->lat, *t2 = t + 2 * pl->lat;
    for (int i = 0; i < pl->lat; i++, seq++) {
        t0[i] = now_ns();
        size_t len = 0;
        const void *m = make(ctx, (int)seq, scratch, sizeof scratch, &len);
        write_all(c.to, m, len);
        read_exact(c.from, &a, sizeof a);
        t2[i] = now_ns();
        check_ack(&a, seq);
        t1[i] = a.t1;
    }
    /* Throughput: write whenever the pipe takes more, read acks whenever they come. */
    if (fcntl(c.to, F_SETFL, fcntl(c.to, F_GETFL) | O_NONBLOCK) != 0) {
        die("fcntl", errno);
    }
    const int64_t start = now_ns();
    int64_t last = 0;
    int sent = 0, acked = 0;
    const unsigned char *m = NULL;
    size_t len = 0, off = 0;
    unsigned char abuf[sizeof(Ack) * 256];
    size_t afill = 0;
    while (acked < pl->tput) {
        if (m == NULL && sent < pl->tput) {
            m = make(ctx, (int)(seq + sent), scratch, sizeof scratch, &len);
            off = 0;
        }
        struct pollfd fds[2] = {{.fd = c.from, .events = POLLIN}, {.fd = m ? c.to : -1, .events = POLLOUT}};
        if (poll(fds, 2, -1) < 0) {
            if (errno == EINTR) {
                continue;
            }
            die("poll", errno);
        }
        if (m != NULL && (fds[1].revents & (POLLOUT | POLLERR | POLLHUP))) {
            const ssize_t w = write(c.to, m + off, len - off);
            if (w > 0) {
                off += (size_t)w;
                if (off == len) {
                    m = NULL;
                    sent++;
                }
            } else if (w < 0 && errno != EAGAIN && errno != EINTR) {
                die("write", errno);
            }
        }
        if (fds[0].revents & (POLLIN | POLLHUP | POLLERR)) {
            const ssize_t r = read(c.from, abuf + afill, sizeof abuf - afill);
            if (r <= 0) {
                die("read acks (consumer gone?)", r < 0 ? errno : 0);
            }
            afill += (size_t)r;
            size_t used = 0;
            for (; afill - used >= sizeof a; used += sizeof a) {
                memcpy(&a, abuf + used, sizeof a);
                check_ack(&a, seq + acked);
                last = a.t1 > last ? a.t1 : last;
                acked++;
            }
            memmove(abuf, abuf + used, afill - used);
            afill -= used;
        }
    }
    reap(&c);
    report(method, pl->size, pl->lat, t0, t1, t2, pl->tput, start, last);
    free(t);
}

static void run_handle(const Plan *pl) {
    HandleCtx h = {xmalloc(pl->slots * sizeof *h.exp), pl->slots};
    for (uint32_t k = 0; k < pl->slots; k++) {
        void *p = NULL;
        OK(devshare_host_alloc(pl->size, &h.exp[k], &p));
        memset(p, (int)(k + 1), pl->size);
    }
    run_pipe("handle", pl, PIPES, "handle-consume", NULL, handle_msg, &h);
    for (uint32_t k = 0; k < pl->slots; k++) {
        OK(devshare_exporter_wait(h.exp[k], 60000));
        OK(devshare_exporter_close(h.exp[k], 0));
    }
    free(h.exp);
}

static void run_pipe_floor(const Plan *pl) {
    run_pipe("pipe-floor", pl, PIPES, "pipe-consume", "0", floor_msg, NULL);
}

static void run_socket_floor(const Plan *pl) {
    run_pipe("socket-floor", pl, SOCKET, "pipe-consume", "0", floor_msg, NULL);
}

static void run_copy(const Plan *pl, const char *method, int io) {
    CopyCtx c = {xmalloc(pl->slots * sizeof *c.buf), pl->slots, pl->size};
    for (uint32_t k = 0; k < pl->slots; k++) {
        c.buf[k] = xmalloc(pl->size);
        memset(c.buf[k], (int)(k + 1), pl->size);
    }
    char arg[32];
    snprintf(arg, sizeof arg, "%" PRIu64, pl->size);
    run_pipe(method, pl, io, "pipe-consume", arg, copy_msg, &c);
    for (uint32_t k = 0; k < pl->slots; k++) {
        free(c.buf[k]);
    }
    free(c.buf);
}

static void run_pipe_copy(const Plan *pl) {
    run_copy(pl, "pipe-copy", PIPES);
}

/* tcp-copy: the item's bytes over a loopback TCP connection into the consumer's buffer, a
 * 16-byte ack back: what a remote channel's item costs at least. */
static void run_tcp_copy(const Plan *pl) {
    run_copy(pl, "tcp-copy", TCP);
}

/* A key file for remote channels when none is named (DEVSHARE_CHANNEL_KEY_FILE, inherited by
 * the consumer): 32 random bytes, mode 0600, removed at exit. */
static char key_path[64];

static void remove_key(void) {
    unlink(key_path);
}

static void ensure_key(void) {
    if (getenv("DEVSHARE_CHANNEL_KEY_FILE") != NULL || key_path[0] != '\0') {
        return;
    }
    snprintf(key_path, sizeof key_path, "/tmp/devshare-bench-key-XXXXXX");
    const int fd = mkstemp(key_path);
    unsigned char key[32];
    FILE *r = fopen("/dev/urandom", "rb");
    if (fd < 0 || r == NULL || fread(key, 1, sizeof key, r) != sizeof key || fchmod(fd, 0600) != 0) {
        die("channel key file", errno);
    }
    fclose(r);
    write_all(fd, key, sizeof key);
    close(fd);
    atexit(remove_key);
    setenv("DEVSHARE_CHANNEL_KEY_FILE", key_path, 1);
}

/* A tcp://127.0.0.1:PORT address whose port was free a moment ago. */
static void tcp_address(char *buf, size_t cap) {
    const int l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof a) != 0 || getsockname(l, (struct sockaddr *)&a, &len) != 0) {
        die("free port", errno);
    }
    snprintf(buf, cap, "tcp://127.0.0.1:%u", (unsigned)ntohs(a.sin_port));
    close(l);
}

/* Services the channel until the peer holds none of the pool's slots. */
static void until_returned(DevshareChannel *ch, uint64_t peer) {
    DevsharePeerInfo info;
    for (;;) {
        OK(devshare_peer_info_init(&info, sizeof info));
        OK(devshare_channel_peer_info(ch, peer, &info));
        if (info.slots == 0) {
            return;
        }
        const int32_t st = devshare_channel_service(ch, 1000);
        if (st != DEVSHARE_STATUS_OK && st != DEVSHARE_STATUS_TIMEOUT) {
            die("devshare_channel_service", st);
        }
    }
}

/* remote: a pool on a tcp:// channel (the consumer the same as the pool method's). The
 * producer's slot is free once the item's bytes are in the socket; the round trip ends when the
 * consumer's release came back (its slot of its copy of the pool). Throughput: up to `slots`
 * items in flight (the consumer's slots are the backpressure). */
static void run_remote(const Plan *pl) {
    ensure_key();
    char addr[128];
    DevshareChannel *ch = NULL;
    int32_t st = DEVSHARE_STATUS_BUSY;
    for (int tries = 0; tries < 20 && st == DEVSHARE_STATUS_BUSY; tries++) {
        tcp_address(addr, sizeof addr);
        st = devshare_channel_listen(addr, &ch);
    }
    OK(st);
    DevshareExporter *exp = NULL;
    void *base = NULL;
    OK(devshare_channel_host_alloc(pl->size * pl->slots, &exp, &base));
    for (uint32_t k = 0; k < pl->slots; k++) {
        memset((char *)base + k * pl->size, (int)(k + 1), pl->size);
    }
    DevsharePool *pool = NULL;
    OK(devshare_pool_create(ch, exp, pl->size, pl->slots, &pool));
    Child c = spawn("consume", addr, NULL, NO_STDIN);
    const uint64_t peer = wait_peer(ch);
    uint32_t slot = 0;
    void *ptr = NULL;
    for (int i = 0; i < pl->warm; i++) {
        OK(devshare_pool_acquire(pool, -1, &slot, &ptr));
        OK(devshare_pool_send(pool, slot, peer, NULL));
    }
    until_returned(ch, peer);
    int64_t *t = xmalloc((size_t)pl->lat * 3 * sizeof *t);
    int64_t *t0 = t, *t1 = t + pl->lat, *t2 = t + 2 * pl->lat;
    for (int i = 0; i < pl->lat; i++) {
        t0[i] = now_ns();
        OK(devshare_pool_acquire(pool, -1, &slot, &ptr));
        OK(devshare_pool_send(pool, slot, peer, NULL));
        until_returned(ch, peer);
        t2[i] = now_ns();
    }
    const int64_t start = now_ns();
    for (int i = 0; i < pl->tput; i++) {
        OK(devshare_pool_acquire(pool, -1, &slot, &ptr));
        OK(devshare_pool_send(pool, slot, peer, NULL));
    }
    until_returned(ch, peer);
    OK(devshare_pool_close(pool));
    OK(devshare_channel_close(ch));
    int64_t last = 0;
    ConsRec *r = consumer_touches(&c, pl, t1, &last);
    report("remote", pl->size, pl->lat, t0, t1, t2, pl->tput, start, last);
    OK(devshare_exporter_close(exp, 0));
    free(r);
    free(t);
}

/* ------------------------------------------------------------------------------------ main */

static long parse_num(const char *s, const char *what) {
    char *end = NULL;
    errno = 0;
    const long v = strtol(s, &end, 10);
    if (errno || end == s || *end != '\0' || v <= 0) {
        fprintf(stderr, BENCH_NAME ": %s must be a positive integer, not '%s'\n", what, s);
        exit(2);
    }
    return v;
}

static int has_method(const char *methods, const char *name) {
    const size_t n = strlen(name);
    for (const char *p = methods; *p;) {
        const char *e = strchr(p, ',');
        const size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len == n && strncmp(p, name, n) == 0) {
            return 1;
        }
        p += len + (e ? 1 : 0);
    }
    return 0;
}

/* ------------------------------------------------------------------------- system calls */

/* syscalls [N]: what the system calls a handoff is made of cost on this machine, each repeated
 * N times in a loop with nothing waiting on the other end (no wake-up). */
static void syscall_row(const char *name, int64_t t0, int n) {
    const double ns = (double)(now_ns() - t0) / n;
    printf("{\"syscall\": \"%s\", \"ns\": %.0f, \"calls\": %d}\n", name, ns, n);
    fprintf(stderr, "%-58s %7.0f ns\n", name, ns);
}

static int syscalls(int n) {
    int sv[2], p[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) != 0 || pipe2(p, O_CLOEXEC) != 0) {
        die("socketpair/pipe2", errno);
    }
    const int lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    const int len = snprintf(sa.sun_path + 1, sizeof sa.sun_path - 1, "devshare-bench-syscalls-%d", (int)getpid());
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, (socklen_t)(sizeof(sa_family_t) + 1 + (size_t)len)) != 0 ||
        listen(lfd, 8) != 0) {
        die("listen", errno);
    }
    static unsigned char buf[1 << 17];
    char name[128], control[256];
    struct iovec iov = {buf, sizeof buf};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
    int64_t t0 = now_ns();
    for (int i = 0; i < n; i++) {
        sink += (unsigned)syscall(SYS_getpid);
    }
    syscall_row("getpid", t0, n);
    t0 = now_ns();
    for (int i = 0; i < n; i++) {
        if (accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC) >= 0) {
            die("accept4: a connection", 0);
        }
    }
    syscall_row("accept4, nothing pending (EAGAIN)", t0, n);
    t0 = now_ns();
    for (int i = 0; i < n; i++) {
        m.msg_name = name;
        m.msg_namelen = sizeof name;
        m.msg_control = control;
        m.msg_controllen = sizeof control;
        if (recvmsg(sv[0], &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC) >= 0) {
            die("recvmsg: a message", 0);
        }
    }
    syscall_row("recvmsg, SOCK_SEQPACKET, nothing queued (EAGAIN)", t0, n);
    int64_t sent = 0, got = 0;
    for (int done = 0; done < n;) {
        int k = 0;
        int64_t t = now_ns();
        while (k < 64 && done + k < n && send(sv[1], buf, 64, 0) == 64) {
            k++;
        }
        sent += now_ns() - t;
        t = now_ns();
        for (int i = 0; i < k; i++) {
            m.msg_name = name;
            m.msg_namelen = sizeof name;
            m.msg_control = control;
            m.msg_controllen = sizeof control;
            if (recvmsg(sv[0], &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC) != 64) {
                die("recvmsg", errno);
            }
        }
        got += now_ns() - t;
        done += k;
    }
    printf("{\"syscall\": \"send, SOCK_SEQPACKET, 64 bytes\", \"ns\": %.0f, \"calls\": %d}\n", (double)sent / n, n);
    fprintf(stderr, "%-58s %7.0f ns\n", "send, SOCK_SEQPACKET, 64 bytes", (double)sent / n);
    printf("{\"syscall\": \"recvmsg, SOCK_SEQPACKET, a queued 64-byte message\", \"ns\": %.0f, \"calls\": %d}\n",
           (double)got / n, n);
    fprintf(stderr, "%-58s %7.0f ns\n", "recvmsg, SOCK_SEQPACKET, a queued 64-byte message", (double)got / n);
    t0 = now_ns();
    for (int i = 0; i < n; i++) {
        if (write(p[1], buf, 8) != 8 || read(p[0], buf, 8) != 8) {
            die("pipe write/read", errno);
        }
    }
    syscall_row("pipe: write 8 bytes + read 8 bytes", t0, n);
    if (send(sv[1], buf, 8, 0) != 8) {
        die("send", errno);
    }
    const int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN}, out[32];
    if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, sv[0], &ev) != 0) {
        die("epoll", errno);
    }
    t0 = now_ns();
    for (int i = 0; i < n; i++) {
        if (epoll_wait(ep, out, 32, 5) != 1) {
            die("epoll_wait", errno);
        }
    }
    syscall_row("epoll_wait, one descriptor ready", t0, n);
    t0 = now_ns();
    for (int i = 0; i < n; i++) {
        struct pollfd pfd = {.fd = sv[0], .events = POLLIN};
        if (ppoll(&pfd, 1, NULL, NULL) != 1) {
            die("ppoll", errno);
        }
    }
    syscall_row("ppoll, one descriptor ready", t0, n);
    close(ep);
    close(lfd);
    close(sv[0]);
    close(sv[1]);
    close(p[0]);
    close(p[1]);
    return 0;
}

/* `loop`: the library's own work per pool item, with no wake-up in it (what benches/item.rs
 * measures, here through the shared library as a C program calls it): producer and consumer in
 * this one process and thread, each 4 KiB item acquired, written, sent, received, described,
 * read and released. The connection is made by a second thread (the connect waits for the
 * producer's handshake); every item after it runs on the main thread. */
static char loop_address[128];
static DevshareConnection *loop_conn;

static void *loop_connect(void *unused) {
    (void)unused;
    OK(devshare_channel_connect(loop_address, 10000, &loop_conn));
    return NULL;
}

static int item_loop(int n) {
    snprintf(loop_address, sizeof loop_address, "@devshare-bench-loop-%d", (int)getpid());
    DevshareChannel *ch = NULL;
    OK(devshare_channel_listen(loop_address, &ch));
    pthread_t connector;
    const int err = pthread_create(&connector, NULL, loop_connect, NULL);
    if (err != 0) {
        fprintf(stderr, "channel_handoff: pthread_create failed: %s\n", strerror(err));
        return 2;
    }
    OK(devshare_channel_wait_peers(ch, 1, 10000));
    pthread_join(connector, NULL);
    uint64_t peer = 0;
    size_t peers = 0;
    OK(devshare_channel_peer_ids(ch, &peer, 1, &peers));
    enum { ROUNDS = 21 };
    const uint32_t slot_counts[] = {1, 8};
    for (size_t k = 0; k < sizeof slot_counts / sizeof slot_counts[0]; k++) {
        const uint32_t slots = slot_counts[k];
        DevshareExporter *exp = NULL;
        OK(devshare_channel_host_alloc(4096 * (uint64_t)slots, &exp, NULL));
        DevsharePool *pool = NULL;
        OK(devshare_pool_create(ch, exp, 4096, slots, &pool));
        OK(devshare_exporter_close(exp, 0));
        int64_t shape[1] = {1024};
        DevshareTensorDesc desc;
        OK(devshare_tensor_desc_init(&desc, sizeof desc));
        desc.dtype.code = DEVSHARE_DTYPE_FLOAT;
        desc.dtype.bits = 32;
        desc.dtype.lanes = 1;
        desc.ndim = 1;
        desc.shape = shape;
        DevshareImportInfo info;
        OK(devshare_import_info_init(&info, sizeof info));
        double ns[ROUNDS];
        /* Round -1 warms up: the pool's attachment, the ring, the caches. */
        for (int round = -1; round < ROUNDS; round++) {
            const int items = round < 0 ? 2000 : n;
            const int64_t t0 = now_ns();
            for (int i = 0; i < items; i++) {
                uint32_t slot = 0;
                void *ptr = NULL;
                OK(devshare_pool_acquire(pool, -1, &slot, &ptr));
                *(volatile uint64_t *)ptr = (uint64_t)i;
                OK(devshare_pool_send(pool, slot, peer, &desc));
                DevshareImport *imp = NULL;
                OK(devshare_connection_recv(loop_conn, -1, &imp));
                OK(devshare_import_info(imp, &info));
                sink += (unsigned)*(const volatile uint64_t *)info.data;
                OK(devshare_import_release(imp));
            }
            if (round >= 0) {
                ns[round] = (double)(now_ns() - t0) / items;
            }
        }
        qsort(ns, ROUNDS, sizeof ns[0], cmp_double);
        printf("{\"loop\": \"pool\", \"slots\": %u, \"bytes\": 4096, \"ns\": %.0f, \"items\": %d, \"rounds\": %d}\n",
               slots, ns[ROUNDS / 2], n, ROUNDS);
        fprintf(stderr, "in-process loop, %u slot(s), 4 KiB: acquire + send + recv + info + release  %6.0f ns "
                        "(median of %d rounds of %d)\n",
                slots, ns[ROUNDS / 2], ROUNDS, n);
        OK(devshare_pool_close(pool));
    }
    OK(devshare_connection_close(loop_conn));
    OK(devshare_channel_close(ch));
    return 0;
}

static int usage(void) {
    fprintf(stderr, "usage: channel_handoff run [--count N] [--large-count N] [--sizes 4096,67108864]\n"
                    "                           [--slots N] [--large-slots N] [--cpus any|one|two] [--spin US]\n"
                    "                           [--methods pool,user,lease,handle,pipe-floor,socket-floor,pipe-copy,remote,tcp-copy,breakdown]\n"
                    "                           [--consumer CMD]\n"
                    "       channel_handoff consume ADDRESS [--poll]\n"
                    "       channel_handoff syscalls [N]\n"
                    "       channel_handoff loop [N]\n");
    return 2;
}

/* Pins this process (and so the consumers it starts) as --cpus says, to the first one or two
 * CPUs it may run on. */
static void place_processes(void) {
    if (strcmp(cpus_mode, "any") == 0) {
        return;
    }
    const int one = strcmp(cpus_mode, "one") == 0;
    if (!one && strcmp(cpus_mode, "two") != 0) {
        fprintf(stderr, BENCH_NAME ": --cpus takes any, one or two, not '%s'\n", cpus_mode);
        exit(2);
    }
    cpu_set_t allowed, set;
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) {
        die("sched_getaffinity", errno);
    }
    int cpu[2] = {-1, -1}, n = 0;
    for (int c = 0; c < CPU_SETSIZE && n < 2; c++) {
        if (CPU_ISSET(c, &allowed)) {
            cpu[n++] = c;
        }
    }
    if (n < (one ? 1 : 2)) {
        fprintf(stderr, BENCH_NAME ": --cpus %s needs %d CPUs, this process may use %d\n", cpus_mode, one ? 1 : 2, n);
        exit(2);
    }
    CPU_ZERO(&set);
    CPU_SET(cpu[0], &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) {
        die("sched_setaffinity", errno);
    }
    consumer_cpu = one ? -1 : cpu[1];
}

static int run(int argc, char **argv) {
    long count = 2000, large_count = 200, slots = 64, large_slots = 4;
    const char *sizes = "4096,67108864";
    const char *methods = "pool,lease,handle,pipe-floor,socket-floor,pipe-copy,remote,tcp-copy,breakdown";
    for (int i = 2; i < argc; i++) {
        if (i + 1 >= argc) {
            return usage();
        }
        const char *opt = argv[i], *val = argv[++i];
        if (strcmp(opt, "--count") == 0) {
            count = parse_num(val, opt);
        } else if (strcmp(opt, "--large-count") == 0) {
            large_count = parse_num(val, opt);
        } else if (strcmp(opt, "--slots") == 0) {
            slots = parse_num(val, opt);
        } else if (strcmp(opt, "--large-slots") == 0) {
            large_slots = parse_num(val, opt);
        } else if (strcmp(opt, "--sizes") == 0) {
            sizes = val;
        } else if (strcmp(opt, "--methods") == 0) {
            methods = val;
        } else if (strcmp(opt, "--consumer") == 0) {
            consumer_cmd = val;
        } else if (strcmp(opt, "--cpus") == 0) {
            cpus_mode = val;
        } else if (strcmp(opt, "--spin") == 0) {
            /* Both ends of the pool and lease methods spin up to this many µs (the consumer
             * inherits it through the environment). */
            spin_us = (uint32_t)parse_num(val, opt);
            setenv("DEVSHARE_BENCH_SPIN_US", val, 1);
        } else {
            return usage();
        }
    }
    place_processes();
    for (const char *p = sizes; *p;) {
        char *end = NULL;
        const unsigned long long size = strtoull(p, &end, 10);
        if (end == p || size == 0 || (*end != ',' && *end != '\0')) {
            fprintf(stderr, BENCH_NAME ": --sizes takes positive byte counts separated by commas\n");
            return 2;
        }
        p = *end ? end + 1 : end;
        const int large = size >= LARGE;
        Plan pl = {size, (uint32_t)(large ? large_slots : slots), 0, (int)(large ? large_count : count), 0};
        pl.tput = pl.lat;
        pl.warm = 2 * (int)pl.slots;
        if (has_method(methods, "pool")) {
            run_pool(&pl, 0, 0);
        }
        if (has_method(methods, "user")) {
            run_pool(&pl, 0, 1);
        }
        if (has_method(methods, "lease")) {
            run_lease(&pl, 0);
        }
        if (has_method(methods, "handle")) {
            run_handle(&pl);
        }
        if (has_method(methods, "pipe-floor")) {
            run_pipe_floor(&pl);
        }
        if (has_method(methods, "socket-floor")) {
            run_socket_floor(&pl);
        }
        if (has_method(methods, "pipe-copy") && !large) {
            run_pipe_copy(&pl);
        }
        if (has_method(methods, "remote")) {
            run_remote(&pl);
        }
        if (has_method(methods, "tcp-copy")) {
            run_tcp_copy(&pl);
        }
        if (has_method(methods, "breakdown")) {
            run_pool(&pl, 1, 0);
            run_lease(&pl, 1);
        }
    }
    return 0;
}

int main(int argc, char **argv) {
    signal(SIGPIPE, SIG_IGN);
    const ssize_t n = readlink("/proc/self/exe", self_exe, sizeof self_exe - 1);
    if (n <= 0) {
        die("readlink /proc/self/exe", errno);
    }
    self_exe[n] = '\0';
    if (argc >= 2 && strcmp(argv[1], "run") == 0) {
        return run(argc, argv);
    }
    if (argc >= 3 && strcmp(argv[1], "consume") == 0) {
        return consume_channel(argv[2], argc >= 4 && strcmp(argv[3], "--poll") == 0);
    }
    if (argc == 2 && strcmp(argv[1], "handle-consume") == 0) {
        return consume_handles();
    }
    if (argc >= 2 && strcmp(argv[1], "syscalls") == 0) {
        return syscalls(argc >= 3 ? (int)parse_num(argv[2], "syscalls N") : 100000);
    }
    if (argc >= 2 && strcmp(argv[1], "loop") == 0) {
        const long n = argc >= 3 ? parse_num(argv[2], "loop N") : 20000;
        if (n > INT_MAX) {
            fprintf(stderr, "channel_handoff: loop N is at most %d\n", INT_MAX);
            return 2;
        }
        return item_loop((int)n);
    }
    if (argc == 3 && strcmp(argv[1], "pipe-consume") == 0) {
        return consume_pipe(strtoull(argv[2], NULL, 10));
    }
    return usage();
}
