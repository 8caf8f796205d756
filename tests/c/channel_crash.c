/* SPDX-License-Identifier: Apache-2.0 */
/*
 * channel_crash: the channel crash matrix across real processes.
 *
 * Each iteration runs a producer and a consumer, both this program re-executed ("--producer",
 * "--consumer"; nothing inherited but pipes), over an abstract address carrying this test's
 * pid. The producer has a host memfd pool (8 slots) and a second memfd export whose regions it
 * leases with devshare_channel_send; it sends ITEMS items, pool slots and leases alternating.
 * In half of each victim's iterations the leased export is registered with the channel
 * (devshare_channel_register), so its leases are kept mapped by the consumer between leases and
 * travel as ring records once it pinned the export's window: what a kill leaves behind then
 * includes kept mappings and a pinned window.
 * The consumer checks every item's data, holds a few (a random number) and releases the rest.
 * One of the two is SIGKILLed at a random point: either by this process after a random delay
 * from the consumer's start (which lands in exec, connect, handshake, sends, imports, reads
 * and releases alike), or by itself at a random item and step ("connected", "received",
 * "reading", "released" for the consumer; "listening", "accepted", "acquired", "writing",
 * "sent" for the producer). ITERATIONS iterations kill the consumer, ITERATIONS the producer.
 *
 * After each iteration:
 *  - a killed consumer's references come back: the producer's devshare_exporter_wait(..., 2000)
 *    returns OK for the leased export and for the pool's (whose attachment the consumer held),
 *    nothing is outstanding, every pool slot is free and no peer is left; the time from the
 *    kill to that point is recorded (its maximum is printed with the 100 ms target, which is
 *    reported, not asserted);
 *  - a killed producer: the surviving consumer's connect either succeeded or failed with an
 *    error (not TIMEOUT); its recv ends with DEVSHARE_STATUS_CLOSED; the imports it holds are
 *    still readable and release;
 *  - no wait hangs: every wait has a timeout and a TIMEOUT status is a failure;
 *  - no /dev/shm entry carrying the pid of either process is left that was not there when the
 *    process was started (only names carrying those pids are looked at).
 *
 * DEVSHARE_CRASH_SEED=<n> repeats a run (the seed is printed). Prints "ok - ..." / "FAIL - ..."
 * lines; exit status 0 when all passed.
 */
#define _GNU_SOURCE

#define HARNESS_NAME "channel_crash"
#include "channel_harness.h"

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
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum {
    ITERATIONS = 100,      /* per victim */
    ITEMS = 400,           /* items a producer sends (pool slots and leases alternating) */
    SLOT = 16384,          /* pool slot size */
    SLOTS = 8,             /* pool slots */
    LEASE_REGION = 8192,   /* leased tensor size */
    LEASE_REGIONS = 8,     /* leased regions, written once */
    LEASE_SEQ = 1000000,   /* a leased region's seq is LEASE_SEQ + its index */
    WAIT_MS = 2000,        /* bound on every devshare wait in the children */
    IO_MS = 10000,         /* bound on every wait for a child */
    EXT_DELAY_US = 20000,  /* external kills land within this long of the consumer's start */
    EARLY_DELAY_US = 3000, /* ... half of them within this long */
    TARGET_MS = 100,       /* the issue's target for a dead consumer's references to come back */
};

/* Kill ourselves at a chosen point, telling the test when. */
static void self_kill(void) {
    say("X %" PRId64, now_ns());
    raise(SIGKILL);
}

static uint64_t rng_state;

static uint64_t rnd(void) {
    uint64_t x = rng_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    rng_state = x;
    return x;
}

/* ---------------------------------------------------------------------------------------- */
/* Producer */

static int producer_main(const char *address, const char *point, int k, int registered) {
    const int victim = point[0] != '\0' && strcmp(point, "-") != 0;
    const int ext = strcmp(point, "ext") == 0;
    DevshareChannel *ch = NULL;
    DevshareExporter *pool_exp = NULL, *lease_exp = NULL;
    DevsharePool *pool = NULL;
    void *lease_mem = NULL;
    int32_t st;
    if ((st = devshare_channel_listen(address, &ch)) ||
        (st = devshare_channel_host_alloc(SLOT * SLOTS, &pool_exp, NULL)) ||
        (st = devshare_pool_create(ch, pool_exp, SLOT, SLOTS, &pool)) ||
        (st = devshare_channel_host_alloc(LEASE_REGION * LEASE_REGIONS, &lease_exp, &lease_mem))) {
        say("E setup: %s: %s", devshare_status_str(st), last_error());
        return 1;
    }
    if (registered && (st = devshare_channel_register(ch, lease_exp))) {
        say("E register: %s: %s", devshare_status_str(st), last_error());
        return 1;
    }
    uint8_t *const lease_base = lease_mem;
    for (int r = 0; r < LEASE_REGIONS; r++) {
        item_fill_host(lease_base + (size_t)r * LEASE_REGION, LEASE_REGION, LEASE_SEQ + (uint64_t)r, NULL);
    }
    say("L");
    if (strcmp(point, "listening") == 0) {
        self_kill();
    }

    int failure = 0;
    int64_t kill_ns = -1;
    char line[256];
    /* A peer, or word that the consumer is dead. */
    uint64_t peer = 0;
    size_t n_peers = 0;
    const int64_t deadline = now_ms() + IO_MS;
    while (peer == 0 && kill_ns < 0) {
        struct pollfd p[2] = {{.fd = devshare_channel_fd(ch), .events = POLLIN}, {.fd = 0, .events = POLLIN}};
        poll(p, 2, 20);
        if ((st = devshare_channel_service(ch, 0)) != DEVSHARE_STATUS_OK) {
            say("I service: %s: %s", devshare_status_str(st), last_error());
        }
        if ((st = devshare_channel_peer_ids(ch, &peer, 1, &n_peers)) && st != DEVSHARE_STATUS_BUFFER_TOO_SMALL) {
            say("E peer_ids: %s: %s", devshare_status_str(st), last_error());
            failure = 1;
            break;
        }
        if (n_peers == 0) {
            peer = 0;
        }
        if ((p[1].revents & (POLLIN | POLLHUP)) && read_line_fd(0, line, sizeof line, IO_MS) >= 0) {
            sscanf(line, "K %" SCNd64, &kill_ns);
        }
        if (now_ms() > deadline) {
            say("E no peer and no word from the test within %d ms", IO_MS);
            failure = 1;
            break;
        }
    }
    if (strcmp(point, "accepted") == 0) {
        self_kill();
    }

    int sent = 0;
    for (int i = 0; peer != 0 && i < ITEMS && !failure; i++) {
        if (i % 2 == 0) {
            uint32_t slot;
            void *ptr;
            st = devshare_pool_acquire(pool, WAIT_MS, &slot, &ptr);
            if (st != DEVSHARE_STATUS_OK) {
                say("E acquire of item %d: %s: %s", i, devshare_status_str(st), last_error());
                failure = 1;
                break;
            }
            if (i == k && strcmp(point, "acquired") == 0) {
                self_kill();
            }
            item_fill_host(ptr, SLOT, (uint64_t)i + 1, i == k && strcmp(point, "writing") == 0 ? self_kill : NULL);
            st = devshare_pool_send(pool, slot, peer, NULL);
            if (st != DEVSHARE_STATUS_OK) {
                /* the consumer is gone: the slot may still be ours */
                devshare_pool_release(pool, slot);
                break;
            }
        } else {
            const int64_t len = LEASE_REGION;
            DevshareTensorDesc d;
            devshare_tensor_desc_init(&d, sizeof d);
            d.dtype.code = DEVSHARE_DTYPE_UINT;
            d.dtype.bits = 8;
            d.dtype.lanes = 1;
            d.ndim = 1;
            d.shape = &len;
            d.storage_offset = (uint64_t)(rnd() % LEASE_REGIONS) * LEASE_REGION;
            d.storage_size = LEASE_REGION;
            if (devshare_channel_send(ch, peer, lease_exp, &d) != DEVSHARE_STATUS_OK) {
                break;
            }
        }
        sent++;
        if (i == k && strcmp(point, "sent") == 0) {
            self_kill();
        }
    }
    if (victim) {
        /* ext: wait for the kill (bounded) */
        read_line_fd(0, line, sizeof line, IO_MS);
        say("E the producer was not killed (%s)", ext ? "external" : point);
        return 1;
    }

    /* The consumer is dead (or dying): its references must come back. */
    size_t left = 1;
    const int64_t peers_deadline = now_ms() + WAIT_MS;
    for (;;) {
        if ((st = devshare_channel_peer_ids(ch, NULL, 0, &left)) && st != DEVSHARE_STATUS_BUFFER_TOO_SMALL) {
            left = 99;
        }
        if (left == 0 || now_ms() > peers_deadline) {
            break;
        }
        devshare_channel_service(ch, 10);
    }
    const int64_t t_peers = now_ns();
    /* the leases, and the pool's attachment (one reference of the pool's export) */
    int32_t wait_st = devshare_exporter_wait(lease_exp, WAIT_MS);
    if (wait_st == DEVSHARE_STATUS_OK) {
        wait_st = devshare_exporter_wait(pool_exp, WAIT_MS);
    }
    const int64_t t_wait = now_ns();
    uint64_t slot_size = 0;
    uint32_t count = 0, free_n = 0;
    const int64_t pool_deadline = now_ms() + WAIT_MS;
    for (;;) {
        devshare_pool_info(pool, &slot_size, &count, &free_n);
        if (free_n == count || now_ms() > pool_deadline) {
            break;
        }
        devshare_channel_service(ch, 10);
    }
    const int64_t t_pool = now_ns();
    uint64_t outstanding = UINT64_MAX, pool_outstanding = UINT64_MAX;
    devshare_exporter_outstanding(lease_exp, &outstanding);
    devshare_exporter_outstanding(pool_exp, &pool_outstanding);
    if (outstanding != UINT64_MAX && pool_outstanding != UINT64_MAX) {
        outstanding += pool_outstanding;
    } else {
        outstanding = UINT64_MAX;
    }
    if (kill_ns < 0) {
        if (read_line_fd(0, line, sizeof line, IO_MS) < 0 || sscanf(line, "K %" SCNd64, &kill_ns) != 1) {
            say("E no kill time from the test");
            failure = 1;
        }
    }
    int64_t back = t_peers > t_wait ? t_peers : t_wait;
    back = back > t_pool ? back : t_pool;
    int32_t close_st = devshare_pool_close(pool);
    close_st = close_st ? close_st : devshare_exporter_close(pool_exp, 0);
    close_st = close_st ? close_st : devshare_exporter_close(lease_exp, 0);
    close_st = close_st ? close_st : devshare_channel_close(ch);
    say("R %d %lld %lld %u %u %zu %d %d %d %s", (int)wait_st, kill_ns >= 0 ? (long long)(back - kill_ns) : -1LL,
        (long long)outstanding, free_n, count, left, sent, failure, (int)close_st, close_st ? last_error() : "");
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Consumer */

static int consumer_main(const char *address, const char *point, int k) {
    const int victim = point[0] != '\0' && strcmp(point, "-") != 0;
    DevshareConnection *conn = NULL;
    const int32_t cst = devshare_channel_connect(address, WAIT_MS * 2, &conn);
    if (cst != DEVSHARE_STATUS_OK) {
        say("R %d 0 0 0 0 0 0 0 0 0 0 %s", (int)cst, last_error());
        return 0;
    }
    if (strcmp(point, "connected") == 0) {
        self_kill();
    }
    DevshareImport *held[16];
    int n_held = 0;
    const int hold_limit = (int)(rnd() % 4); /* 0..3 items kept at once */
    int got = 0, pools = 0, leases = 0, data_bad = 0, order_bad = 0, rel_fails = 0;
    uint64_t last_pool_seq = 0;
    int32_t st;
    for (;;) {
        DevshareImport *imp = NULL;
        st = devshare_connection_recv(conn, WAIT_MS * 2, &imp);
        if (st != DEVSHARE_STATUS_OK) {
            break;
        }
        const int index = got++;
        if (index == k && strcmp(point, "received") == 0) {
            self_kill();
        }
        DevshareImportInfo info;
        devshare_import_info_init(&info, sizeof info);
        uint32_t pool = 0, slot = 0;
        uint64_t seq = 0;
        if (devshare_import_info(imp, &info) != DEVSHARE_STATUS_OK ||
            !item_check_host(info.storage, info.storage_size, &seq,
                            index == k && strcmp(point, "reading") == 0 ? self_kill : NULL)) {
            data_bad++;
        } else if (devshare_import_pool_slot(imp, &pool, &slot) == DEVSHARE_STATUS_OK) {
            pools++;
            order_bad += seq <= last_pool_seq || seq >= LEASE_SEQ;
            last_pool_seq = seq;
        } else {
            leases++;
            order_bad += seq < LEASE_SEQ || seq >= LEASE_SEQ + LEASE_REGIONS;
        }
        held[n_held++] = imp;
        while (n_held > hold_limit) {
            rel_fails += devshare_import_release(held[0]) != DEVSHARE_STATUS_OK;
            memmove(held, held + 1, (size_t)(n_held - 1) * sizeof held[0]);
            n_held--;
            if (index >= k && strcmp(point, "released") == 0) {
                self_kill();
            }
        }
    }
    if (victim) {
        /* wait for the kill (bounded) */
        char line[64];
        read_line_fd(0, line, sizeof line, IO_MS);
        say("E the consumer was not killed (%s; recv said %s)", point, devshare_status_str(st));
        return 1;
    }
    /* The receive's error, kept before the releases below overwrite it. */
    static char msg[2048];
    msg[0] = '\0';
    if (st != DEVSHARE_STATUS_CLOSED) memcpy(msg, last_error(), sizeof msg);
    int held_bad = 0;
    for (int i = 0; i < n_held; i++) {
        DevshareImportInfo info;
        uint64_t seq;
        devshare_import_info_init(&info, sizeof info);
        held_bad += devshare_import_info(held[i], &info) != DEVSHARE_STATUS_OK ||
                    !item_check_host(info.storage, info.storage_size, &seq, NULL);
        rel_fails += devshare_import_release(held[i]) != DEVSHARE_STATUS_OK;
    }
    const int32_t close_st = devshare_connection_close(conn);
    say("R %d %d %d %d %d %d %d %d %d %d %d %s", (int)cst, got, (int)st, pools, leases, data_bad, order_bad, n_held,
        held_bad, rel_fails, (int)close_st, msg);
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* The test */

static int n_failed_iterations;

typedef struct {
    pid_t pid;
    int to, from;
} Proc;

/* Names carrying the process's pid that were not there when it started (printed). */
static int shm_new(const Proc *p) { return shm_names_of(p->pid, 0); }

/* Fork a child; it execs only after the parent listed /dev/shm for its pid. */
static Proc spawn(const char *role, const char *address, const char *point, int k, uint64_t seed, int registered) {
    char ks[32], ss[32];
    snprintf(ks, sizeof ks, "%d", k);
    snprintf(ss, sizeof ss, "%" PRIu64, seed);
    char *argv[] = {self_path, (char *)role, (char *)address, (char *)point, ks, ss,
                    registered ? "registered" : "plain", NULL};
    Proc p = {0};
    p.pid = spawn_piped(argv, &(SpawnOptions){.gated = 1}, &p.to, &p.from);
    shm_names_of(p.pid, 1); /* an earlier process with this pid left them */
    open_gate(p.to);
    return p;
}

/* Wait (bounded) for a process to end; its wait status, or -1 when it had to be killed. */
static int reap(Proc *p) { return wait_exit(p->pid, IO_MS); }

static void describe_status(int status, char *buf, size_t cap) {
    if (status == -1) {
        snprintf(buf, cap, "hung (killed after %d ms)", IO_MS);
    } else if (WIFSIGNALED(status)) {
        snprintf(buf, cap, "killed by signal %d", WTERMSIG(status));
    } else {
        snprintf(buf, cap, "exit %d", WEXITSTATUS(status));
    }
}

/* Read lines until one starts with one of `want` (bounded); also echo E/I lines. */
static int read_report(Proc *p, const char *want, char *buf, size_t cap) {
    const int64_t deadline = now_ms() + IO_MS;
    while (now_ms() < deadline) {
        if (read_line_fd(p->from, buf, cap, (int)(deadline - now_ms())) < 0) {
            return 0;
        }
        if (strchr(want, buf[0])) {
            return 1;
        }
        if (buf[0] == 'E' || buf[0] == 'I') {
            printf("    process %d: %s\n", (int)p->pid, buf);
        }
    }
    return 0;
}

static const char *consumer_points[] = {"ext", "connected", "received", "reading", "released"};
static const char *producer_points[] = {"ext", "listening", "accepted", "acquired", "writing", "sent"};
enum { N_CONSUMER_POINTS = 5, N_PRODUCER_POINTS = 6 };

static int64_t max_back_ns = -1;
/* Where the kills landed: [0] before a connection, [1] mid-stream, [2] after the last item. */
static int landed[2][3];
static int consumer_refs_ok, producer_death_ok, shm_ok, no_timeouts = 1, n_timeouts;

__attribute__((format(printf, 2, 3))) static void iteration_failed(const char *label, const char *fmt, ...) {
    va_list ap;
    printf("FAIL - %s: ", label);
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
    fflush(stdout);
    n_failed_iterations++;
}

static int registered_runs;

static void run_iteration(int iter, int kill_consumer, int registered) {
    char address[128];
    snprintf(address, sizeof address, "@devshare_channel_crash_%ld_%d", (long)getpid(), iter);
    const int pi = kill_consumer ? (int)(rnd() % N_CONSUMER_POINTS) : (int)(rnd() % N_PRODUCER_POINTS);
    const char *point = kill_consumer ? consumer_points[pi] : producer_points[pi];
    const int ext = strcmp(point, "ext") == 0;
    /* consumer points count items received (all ITEMS); producer points count items sent, and
     * "acquired"/"writing" happen on pool items (even i) */
    int k = (int)(rnd() % ITEMS);
    if (!kill_consumer && (strcmp(point, "acquired") == 0 || strcmp(point, "writing") == 0)) {
        k &= ~1;
    }
    /* half of the external kills within 3 ms of the consumer's start: exec, connect, handshake */
    const int delay_us = (int)(rnd() % (rnd() % 2 ? EXT_DELAY_US : EARLY_DELAY_US));
    char label[160];
    snprintf(label, sizeof label, "iteration %d (kill the %s: %s, item %d, delay %d us%s)", iter,
             kill_consumer ? "consumer" : "producer", point, ext ? -1 : k, ext ? delay_us : -1,
             registered ? ", registered" : "");
    registered_runs += registered;

    Proc prod = spawn("--producer", address, kill_consumer ? "-" : point, k, rnd() | 1, registered);
    char line[2048];
    if (!read_report(&prod, "LX", line, sizeof line) || line[0] != 'L') {
        /* only a producer that kills itself right after listening says X here: never before L */
        char how[64];
        describe_status(reap(&prod), how, sizeof how);
        iteration_failed(label, "the producer did not start listening (%s; %s)", line, how);
        close(prod.to);
        close(prod.from);
        return;
    }
    Proc cons = spawn("--consumer", address, kill_consumer ? point : "-", k, rnd() | 1, registered);
    Proc *victim = kill_consumer ? &cons : &prod;
    Proc *survivor = kill_consumer ? &prod : &cons;
    const int64_t t_start = now_ns();
    int64_t kill_ns = -1;
    if (ext) {
        const int64_t at = t_start + (int64_t)delay_us * 1000;
        const struct timespec ts = {.tv_sec = (time_t)(at / 1000000000), .tv_nsec = (long)(at % 1000000000)};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
        }
        kill_ns = now_ns();
        kill(victim->pid, SIGKILL);
    } else if (read_report(victim, "X", line, sizeof line)) {
        sscanf(line, "X %" SCNd64, &kill_ns);
    }
    const int vstatus = reap(victim);
    if (vstatus == -1 || !WIFSIGNALED(vstatus) || WTERMSIG(vstatus) != SIGKILL || kill_ns < 0) {
        char how[64];
        describe_status(vstatus, how, sizeof how);
        iteration_failed(label, "the victim did not die of its SIGKILL (%s)", how);
        if (kill_ns < 0) {
            kill_ns = now_ns();
        }
    }
    if (kill_consumer) {
        char k_line[64];
        const int kl = snprintf(k_line, sizeof k_line, "K %" PRId64 "\n", kill_ns);
        if (write(prod.to, k_line, (size_t)kl) != kl) {
            /* the producer is gone; its report below says so */
        }
        long long v[9] = {0};
        const int got = read_report(&prod, "R", line, sizeof line) &&
                        sscanf(line, "R %lld %lld %lld %lld %lld %lld %lld %lld %lld", &v[0], &v[1], &v[2], &v[3],
                               &v[4], &v[5], &v[6], &v[7], &v[8]) == 9;
        if (!got) {
            iteration_failed(label, "no report from the producer (%s)", line);
        } else {
            const int32_t wait_st = (int32_t)v[0];
            if (wait_st == DEVSHARE_STATUS_TIMEOUT) {
                no_timeouts = 0;
                n_timeouts++;
            }
            if (wait_st != DEVSHARE_STATUS_OK || v[2] != 0 || v[3] != v[4] || v[5] != 0 || v[7] != 0 || v[8] != 0) {
                iteration_failed(label,
                                 "the dead consumer's references did not all come back: exporter_wait %s, "
                                 "outstanding %lld, free slots %lld of %lld, peers %lld, producer failure %lld, "
                                 "close %lld (%s)",
                                 devshare_status_str(wait_st), v[2], v[3], v[4], v[5], v[7], v[8], line);
            } else {
                consumer_refs_ok++;
                landed[0][v[6] == 0 ? 0 : v[6] < ITEMS ? 1 : 2]++;
                if (v[1] > max_back_ns) {
                    max_back_ns = v[1];
                }
            }
        }
    } else {
        long long v[11] = {0};
        const int got = read_report(&cons, "R", line, sizeof line) &&
                        sscanf(line, "R %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld", &v[0], &v[1], &v[2],
                               &v[3], &v[4], &v[5], &v[6], &v[7], &v[8], &v[9], &v[10]) == 11;
        if (!got) {
            iteration_failed(label, "no report from the consumer (%s)", line);
        } else {
            const int32_t connect_st = (int32_t)v[0], recv_st = (int32_t)v[2];
            if (connect_st == DEVSHARE_STATUS_TIMEOUT || recv_st == DEVSHARE_STATUS_TIMEOUT) {
                no_timeouts = 0;
                n_timeouts++;
            }
            const int connect_ok = connect_st == DEVSHARE_STATUS_OK;
            if (connect_st == DEVSHARE_STATUS_TIMEOUT ||
                (connect_ok && (recv_st != DEVSHARE_STATUS_CLOSED || v[5] != 0 || v[6] != 0 || v[8] != 0 || v[9] != 0 ||
                                v[10] != 0))) {
                iteration_failed(label,
                                 "the consumer did not end cleanly: connect %s, recv %s after %lld items, "
                                 "bad data %lld, bad order %lld, held %lld (unreadable %lld), failed releases %lld, "
                                 "close %lld (%s)",
                                 devshare_status_str(connect_st), devshare_status_str(recv_st), v[1], v[5], v[6], v[7],
                                 v[8], v[9], v[10], line);
            } else {
                producer_death_ok++;
                landed[1][connect_st != DEVSHARE_STATUS_OK || v[1] == 0 ? 0 : v[1] < ITEMS ? 1 : 2]++;
            }
        }
    }
    const int sstatus = reap(survivor);
    if (sstatus == -1 || !WIFEXITED(sstatus) || WEXITSTATUS(sstatus) != 0) {
        char how[64];
        describe_status(sstatus, how, sizeof how);
        iteration_failed(label, "the surviving %s did not exit cleanly (%s)", kill_consumer ? "producer" : "consumer",
                         how);
    }
    const int left = shm_new(&prod) + shm_new(&cons);
    if (left) {
        iteration_failed(label, "%d /dev/shm object(s) carrying the processes' pids were left", left);
    } else {
        shm_ok++;
    }
    close(prod.to);
    close(prod.from);
    close(cons.to);
    close(cons.from);
}

int main(int argc, char **argv) {
    if (argc >= 6 && (strcmp(argv[1], "--producer") == 0 || strcmp(argv[1], "--consumer") == 0)) {
        rng_state = strtoull(argv[5], NULL, 10) | 1;
        const int k = atoi(argv[4]);
        const int registered = argc >= 7 && strcmp(argv[6], "registered") == 0;
        return strcmp(argv[1], "--producer") == 0 ? producer_main(argv[2], argv[3], k, registered)
                                                   : consumer_main(argv[2], argv[3], k);
    }
    harness_start(NULL);
    signal(SIGPIPE, SIG_IGN);
    const char *seed_env = getenv("DEVSHARE_CRASH_SEED");
    const uint64_t seed = seed_env ? strtoull(seed_env, NULL, 10) : (uint64_t)now_ns() ^ (uint64_t)getpid();
    rng_state = seed | 1;
    printf("# seed %" PRIu64 " (DEVSHARE_CRASH_SEED repeats it)\n", seed);
    fflush(stdout);

    const int64_t t0 = now_ns();
    for (int i = 0; i < 2 * ITERATIONS; i++) {
        run_iteration(i, i % 2 == 0, i % 4 >= 2); /* each victim: every other time registered */
    }
    const double secs = (double)(now_ns() - t0) / 1e9;

    CHECK(consumer_refs_ok == ITERATIONS,
          "%d consumers SIGKILLed at random points: each one's leases and pool slots came back "
          "(devshare_exporter_wait(2000) OK, nothing outstanding, every slot free, no peer left) in %d",
          ITERATIONS, consumer_refs_ok);
    CHECK(producer_death_ok == ITERATIONS,
          "%d producers SIGKILLed at random points: the consumer's connect failed with an error or its recv ended "
          "with CLOSED, and its held imports stayed readable and released, in %d",
          ITERATIONS, producer_death_ok);
    CHECK(no_timeouts, "no wait timed out (%d TIMEOUT statuses)", n_timeouts);
    CHECK(shm_ok == 2 * ITERATIONS,
          "no /dev/shm object carrying a producer's or consumer's pid was left (%d of %d clean)",
          shm_ok, 2 * ITERATIONS);
    CHECK(n_failed_iterations == 0, "all %d iterations passed (%d failed; %d with the leased export registered) in %.1f s",
          2 * ITERATIONS, n_failed_iterations, registered_runs, secs);
    printf("# consumer kills: %d before the producer sent anything, %d mid-stream, %d after the last item\n",
           landed[0][0], landed[0][1], landed[0][2]);
    printf("# producer kills: %d before the consumer received anything, %d mid-stream, %d after the last item\n",
           landed[1][0], landed[1][1], landed[1][2]);
    if (max_back_ns >= 0) {
        printf("# a dead consumer's references came back at most %.2f ms after its SIGKILL: the %d ms target was %s\n",
               (double)max_back_ns / 1e6, TARGET_MS, max_back_ns <= (int64_t)TARGET_MS * 1000000 ? "met" : "NOT met");
    }
    return harness_done();
}
