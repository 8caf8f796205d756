/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_channel: channels, leases and pools between separate processes.
 *
 * The parent is the producer (except in the producer-death case, where it is the consumer);
 * consumers are this program re-executed with "--child host|acl|cuda". Their line protocol, the
 * children and every helper the cases share are in channel_helpers.h.
 *
 * Cases, in the order they run (each named by the behaviour it checks):
 *  - test_channel_calls_refuse_null_and_out_of_range_arguments: NULL and empty addresses,
 *    over-long paths and names, slot_size 0, count 0, slots beyond the export, unknown peer
 *    ids ... return statuses; listen never replaces an existing file and makes a 0600 socket
 *    that close removes; a 1 TiB host allocation is refused naming /dev/shm;
 *  - test_a_host_pool_carries_10000_items_through_8_slots_at_fixed_addresses: both ends
 *    spinning; each slot keeps one address in the consumer, the data written by the producer is
 *    read back, every slot comes home;
 *  - test_pool_acquire_times_out_or_blocks_until_the_consumer_gives_a_slot_back: 2 slots held
 *    by the consumer -> devshare_pool_acquire times out; a blocking acquire resumes when the
 *    consumer releases one;
 *  - test_one_pool_serves_two_consumers_each_its_own_items;
 *  - test_slot_misuse_is_refused_and_a_departed_consumers_slots_come_back: producer releases
 *    of slots not acquired, double release, sends of slots not acquired are errors, not
 *    corruption; slots held by a consumer that disconnects or exits come back;
 *  - test_leases_stay_outstanding_until_released_or_their_holder_is_killed:
 *    devshare_channel_send of a tensor in a memfd export, and a devshare_channel_send_batch of
 *    3 (refused batches send nothing), are outstanding until released; a consumer SIGKILLed
 *    while holding gives its lease back (devshare_exporter_wait(1000) is OK);
 *  - test_a_killed_producer_closes_the_connection_and_imports_stay_readable: the consumer's
 *    recv says DEVSHARE_STATUS_CLOSED, its imports stay readable and release;
 *  - test_a_channel_host_allocation_is_a_sealed_memfd_that_cannot_be_resized: shrinking or
 *    growing it fails with EPERM, the consumer reads whole slots without SIGBUS;
 *  - test_a_consumer_running_as_another_uid_is_refused (run as root only; otherwise SKIP);
 *  - test_restrict_refuses_a_consumer_left_off_its_pid_or_uid_list: devshare_channel_restrict
 *    with pid and uid lists that leave the consumer out refuses it, lists naming it admit it;
 *  - test_an_acl_pool_reaches_its_channel_consumer_but_not_a_process_outside_the_channel (over
 *    the stand-in runtime): a pool of an ACL export reaches a channel consumer without
 *    devshare_exporter_allow_pid; a plain handle of that export imported without the channel
 *    is refused by the pid whitelist;
 *  - test_an_acl_lease_event_is_waited_on_and_kept_until_the_lease_returns: an ACL lease with
 *    DEVSHARE_SHARE_EVENT; the consumer, whitelisted through the handshake, reads the lease;
 *    recv waited on the event; the producer keeps the event until the lease comes back, then
 *    destroys it;
 *  - test_a_cuda_segment_pool_passes_its_fds_over_the_channel_and_detaches_on_close (over the
 *    stand-in driver): 4 cuMemCreate segments of 2 MiB exported with devshare_export_segments,
 *    one slot per segment. The producer is made non-dumpable (and neither side has
 *    CAP_SYS_PTRACE), so the consumer's pidfd_getfd of producer fds fails with EPERM (checked
 *    by the consumer itself; without the switch it succeeds where Yama does not forbid it):
 *    the consumer still imports, because the segment fds travel over the channel. The
 *    allocation is imported once (1 reservation, 4 mappings), each slot keeps its address,
 *    cuMemcpyDtoH reads what the producer wrote. The same pool with DEVSHARE_SHARE_EVENT items
 *    (on a stream or NULL): recv waited on each event, the producer holds one live event per
 *    slot out and takes it back into the channel's pool of events when the slot comes back (the
 *    next round records the same events again). After devshare_pool_close the consumer
 *    detaches on its next recv: nothing reserved, mapped or imported is left in it, and once
 *    its connection closes it has its first fd count again;
 *  - test_a_cuda_lease_event_is_waited_on_once_and_kept_until_the_lease_returns: a CUDA lease
 *    with DEVSHARE_SHARE_EVENT (cuMemAlloc + devshare_export, on a stream and with NULL): recv
 *    waited on the event, one live IPC open while held and none after the release, the event
 *    kept until the lease comes back, then in the channel's pool until it closes;
 *  - test_a_cuda_batch_records_one_event_per_stream_and_the_next_batch_reuses_it: 32 leases in
 *    one devshare_channel_send_batch carry one event per stream, waited on once by the
 *    consumer; the next batch records the pooled event again;
 *  - afterwards no /dev/shm object carries the pid of this process or of a host or CUDA
 *    consumer, and neither stand-in recorded a rule violation (in any process: at exit they
 *    also check that every opened IPC event and mapping was closed).
 *
 * Needs DEVSHARE_ACL_LIBRARY and DEVSHARE_CUDA_LIBRARY pointing at the stand-ins
 * (libascendcl.so, libcuda.so.1; CTest sets them).
 * Prints "ok - ..." / "FAIL - ..." per case; exit status 0 when all passed.
 */
#define _GNU_SOURCE

#define HARNESS_NAME "test_channel"
#include "channel_helpers.h"

#include <pthread.h>

/* ---------------------------------------------------------------------------------------- */
/* Cases */

static void test_channel_calls_refuse_null_and_out_of_range_arguments(void) {
    DevshareChannel *ch = NULL;
    EXPECT_ERROR(devshare_channel_listen(NULL, &ch), "devshare_channel_listen", "NULL address");
    EXPECT_ERROR(devshare_channel_listen("", &ch), "devshare_channel_listen", "empty address");
    EXPECT_ERROR(devshare_channel_listen("@", &ch), "devshare_channel_listen", "abstract address with no name");
    char longer[400];
    snprintf(longer, sizeof longer, "/tmp/devshare_test_channel_%ld_%0200d", (long)getpid(), 0);
    EXPECT_ERROR(devshare_channel_listen(longer, &ch), "devshare_channel_listen", "path longer than sun_path");
    longer[0] = '@';
    EXPECT_ERROR(devshare_channel_listen(longer, &ch), "devshare_channel_listen", "abstract name longer than sun_path");
    char path[128];
    snprintf(path, sizeof path, "/tmp/devshare_test_channel_%ld.sock", (long)getpid());
    unlink(path);
    const int fd = open(path, O_CREAT | O_WRONLY | O_EXCL, 0600);
    close(fd);
    int32_t st = devshare_channel_listen(path, &ch);
    EXPECT_ERROR(st, "devshare_channel_listen", "a path that exists");
    struct stat sb;
    CHECK(st == DEVSHARE_STATUS_BUSY && stat(path, &sb) == 0 && S_ISREG(sb.st_mode),
          "devshare_channel_listen never replaces an existing file: DEVSHARE_STATUS_BUSY (%s), the file is still there",
          devshare_status_str(st));
    unlink(path);
    st = devshare_channel_listen(path, &ch);
    memset(&sb, 0, sizeof sb);
    const int mode_ok = stat(path, &sb) == 0 && S_ISSOCK(sb.st_mode) && (sb.st_mode & 0777) == 0600;
    CHECK(st == DEVSHARE_STATUS_OK && mode_ok,
          "devshare_channel_listen on a free path makes a socket of mode 0600 (%s, mode %o)", devshare_status_str(st),
          (unsigned)(sb.st_mode & 0777));
    if (st == DEVSHARE_STATUS_OK) {
        st = devshare_channel_close(ch);
        CHECK(st == DEVSHARE_STATUS_OK && stat(path, &sb) != 0 && errno == ENOENT,
              "devshare_channel_close removes the socket file (%s)", devshare_status_str(st));
    }
    unlink(path);
    ch = NULL;

    DevshareConnection *conn = NULL;
    EXPECT_ERROR(devshare_channel_connect(NULL, 1000, &conn), "devshare_channel_connect", "NULL address");
    EXPECT_ERROR(devshare_channel_connect("", 1000, &conn), "devshare_channel_connect", "empty address");
    char nobody[128];
    make_address(nobody, sizeof nobody, "nobody_listens");
    EXPECT_ERROR(devshare_channel_connect(nobody, 1000, &conn), "devshare_channel_connect",
                 "an abstract address nobody listens on");

    DevshareExporter *exp = NULL;
    /* One rule with devshare_host_alloc: size 0 is an empty allocation; more than /dev/shm can
     * hold is ENOSPC (a sparse memfd would otherwise be created, and SIGBUS its users later). */
    CHECK(devshare_channel_host_alloc(0, &exp, NULL) == DEVSHARE_STATUS_OK &&
              devshare_exporter_close(exp, 0) == DEVSHARE_STATUS_OK,
          "devshare_channel_host_alloc(0) is an empty allocation (%s)", last_error());
    CHECK(devshare_host_alloc(0, &exp, NULL) == DEVSHARE_STATUS_OK && devshare_exporter_close(exp, 0) == DEVSHARE_STATUS_OK,
          "devshare_host_alloc(0) too: one rule");
    int32_t big = devshare_channel_host_alloc((uint64_t)1 << 40, &exp, NULL);
    CHECK(big == DEVSHARE_STATUS_OS && strstr(last_error(), "/dev/shm") != NULL,
          "devshare_channel_host_alloc(1 TiB) is refused naming /dev/shm's room (%s)", last_error());
    big = devshare_host_alloc((uint64_t)1 << 40, &exp, NULL);
    CHECK(big == DEVSHARE_STATUS_OS, "devshare_host_alloc(1 TiB) is refused the same way (%d)", (int)big);
    EXPECT_ERROR(devshare_channel_host_alloc(4096, NULL, NULL), "devshare_channel_host_alloc", "NULL out");
    EXPECT_ERROR(devshare_channel_host_alloc(UINT64_MAX, &exp, NULL), "devshare_channel_host_alloc", "size UINT64_MAX");

    char address[128];
    make_address(address, sizeof address, "bad");
    DS_OK(devshare_channel_listen(address, &ch));
    DevshareChannel *ch2 = NULL;
    EXPECT_ERROR(devshare_channel_listen(address, &ch2), "devshare_channel_listen", "an abstract name in use");
    DS_OK(devshare_channel_host_alloc(16384, &exp, NULL));
    DevsharePool *pool = NULL;
    EXPECT_ERROR(devshare_pool_create(ch, exp, 0, 4, &pool), "devshare_pool_create", "slot_size 0");
    EXPECT_ERROR(devshare_pool_create(ch, exp, 4096, 0, &pool), "devshare_pool_create", "count 0");
    EXPECT_ERROR(devshare_pool_create(ch, exp, 4096, 5, &pool), "devshare_pool_create",
                 "slot_size * count beyond the export (5 x 4096 in 16384)");
    EXPECT_ERROR(devshare_pool_create(ch, exp, UINT64_C(1) << 63, 2, &pool), "devshare_pool_create",
                 "slot_size * count overflows");
    EXPECT_ERROR(devshare_pool_create(NULL, exp, 4096, 4, &pool), "devshare_pool_create", "NULL channel");
    EXPECT_ERROR(devshare_pool_create(ch, NULL, 4096, 4, &pool), "devshare_pool_create", "NULL exporter");
    EXPECT_ERROR(devshare_pool_create(ch, exp, 4096, 4, NULL), "devshare_pool_create", "NULL out");

    const int64_t len = 4096;
    const DevshareTensorDesc d = bytes_desc(0, &len);
    EXPECT_ERROR(devshare_channel_send(ch, 999999, exp, &d), "devshare_channel_send", "unknown peer id");
    EXPECT_ERROR(devshare_channel_send(ch, 0, exp, &d), "devshare_channel_send", "peer id 0");
    EXPECT_ERROR(devshare_channel_send(NULL, 1, exp, &d), "devshare_channel_send", "NULL channel");
    EXPECT_ERROR(devshare_channel_send(ch, 1, NULL, &d), "devshare_channel_send", "NULL exporter");
    uint64_t outstanding = 99;
    DS_OK(devshare_exporter_outstanding(exp, &outstanding));
    CHECK(outstanding == 0, "bad input: refused sends leave no reference outstanding (%" PRIu64 ")", outstanding);

    DevsharePeerInfo info;
    DS_OK(devshare_peer_info_init(&info, sizeof info));
    st = devshare_channel_peer_info(ch, 999999, &info);
    EXPECT_ERROR(st, "devshare_channel_peer_info", "unknown peer id");
    CHECK(st == DEVSHARE_STATUS_NOT_FOUND, "devshare_channel_peer_info of an unknown peer: NOT_FOUND (%s)",
          devshare_status_str(st));
    size_t n = 99;
    CHECK(devshare_channel_peer_ids(ch, NULL, 0, &n) == DEVSHARE_STATUS_OK && n == 0,
          "devshare_channel_peer_ids with no peer: OK and count 0 (%zu)", n);
    const int32_t wst = devshare_channel_wait_peers(ch, 1, 0);
    CHECK(wst == DEVSHARE_STATUS_TIMEOUT, "devshare_channel_wait_peers(1, timeout 0) with no peer: TIMEOUT (%s)",
          devshare_status_str(wst));
    const int32_t pids[1] = {1};
    EXPECT_ERROR(devshare_channel_restrict(ch, NULL, 0, NULL, 1), "devshare_channel_restrict",
                 "NULL pids with n_pids 1");
    EXPECT_ERROR(devshare_channel_restrict(ch, NULL, 1, pids, 1), "devshare_channel_restrict",
                 "NULL uids with n_uids 1");
    EXPECT_ERROR(devshare_channel_service(NULL, 0), "devshare_channel_service", "NULL channel");
    CHECK(devshare_channel_fd(NULL) < 0, "devshare_channel_fd(NULL) is negative");
    CHECK(devshare_channel_fd(ch) >= 0, "devshare_channel_fd gives a descriptor");
    CHECK(devshare_connection_fd(NULL) < 0, "devshare_connection_fd(NULL) is negative");
    DevshareImport *imp = NULL;
    EXPECT_ERROR(devshare_connection_recv(NULL, 0, &imp), "devshare_connection_recv", "NULL connection");
    uint32_t pid_ = 0, slot_ = 0;
    EXPECT_ERROR(devshare_import_pool_slot(NULL, &pid_, &slot_), "devshare_import_pool_slot", "NULL import");
    EXPECT_ERROR(devshare_import_describe(NULL, NULL, NULL, &pid_, &slot_), "devshare_import_describe", "NULL import");
    DevshareItem item_;
    EXPECT_ERROR(devshare_item_init(&item_, 8), "devshare_item_init", "a size below the struct's");
    devshare_item_init(&item_, sizeof item_);
    EXPECT_ERROR(devshare_connection_recv_item(NULL, 0, NULL, &item_), "devshare_connection_recv_item",
                 "NULL connection");
    DevshareRecvArgs args_;
    EXPECT_ERROR(devshare_recv_args_init(&args_, 16), "devshare_recv_args_init", "a size below the struct's");
    EXPECT_ERROR(devshare_recv_args_init(NULL, sizeof args_), "devshare_recv_args_init", "NULL args");
    DS_OK(devshare_recv_args_init(&args_, sizeof args_));
    CHECK(args_.struct_size == sizeof args_ && args_.timeout_ms < 0 && args_.conn == NULL && args_.release == NULL &&
              args_.item.struct_size == sizeof args_.item,
          "devshare_recv_args_init: its size, no limit, no connection, no release, the item set up");
    EXPECT_ERROR(devshare_connection_recv_args(NULL), "devshare_connection_recv_args", "NULL args");
    EXPECT_ERROR(devshare_connection_recv_args(&args_), "devshare_connection_recv_args", "NULL connection");
    args_.item.struct_size = sizeof args_.item + 8;
    EXPECT_ERROR(devshare_connection_recv_args(&args_), "devshare_connection_recv_args",
                 "an item size beyond the args");
    CHECK(strstr(last_error(), "args.item.struct_size") != NULL, "the message names args.item.struct_size");
    args_.struct_size = 8;
    EXPECT_ERROR(devshare_connection_recv_args(&args_), "devshare_connection_recv_args", "a size below the struct's");

    DS_OK(devshare_pool_create(ch, exp, 4096, 4, &pool));
    uint32_t slot = 99;
    void *ptr = NULL;
    EXPECT_ERROR(devshare_pool_acquire(NULL, 0, &slot, &ptr), "devshare_pool_acquire", "NULL pool");
    EXPECT_ERROR(devshare_pool_acquire(pool, 0, NULL, &ptr), "devshare_pool_acquire", "NULL slot");
    DS_OK(devshare_pool_acquire(pool, 0, &slot, &ptr));
    EXPECT_ERROR(devshare_pool_send(pool, slot, 999999, NULL), "devshare_pool_send", "unknown peer id");
    EXPECT_ERROR(devshare_pool_send(NULL, slot, 1, NULL), "devshare_pool_send", "NULL pool");
    const int32_t rst = devshare_pool_release(pool, slot);
    CHECK(rst == DEVSHARE_STATUS_OK && free_slots(pool) == 4,
          "a slot whose send to an unknown peer was refused is still the producer's: it releases (%s)",
          devshare_status_str(rst));
    EXPECT_ERROR(devshare_pool_info(NULL, NULL, NULL, NULL), "devshare_pool_info", "NULL pool");
    EXPECT_ERROR(devshare_pool_set_spin(NULL, 10), "devshare_pool_set_spin", "NULL pool");
    EXPECT_ERROR(devshare_pool_set_spin(pool, DEVSHARE_MAX_SPIN_US + 1), "devshare_pool_set_spin",
                 "a spin above DEVSHARE_MAX_SPIN_US");
    DS_OK(devshare_pool_set_spin(pool, DEVSHARE_MAX_SPIN_US));
    DS_OK(devshare_pool_set_spin(pool, 0));
    EXPECT_ERROR(devshare_connection_set_spin(NULL, 10), "devshare_connection_set_spin", "NULL connection");
    EXPECT_ERROR(devshare_channel_set_spin(NULL, 10), "devshare_channel_set_spin", "NULL channel");
    EXPECT_ERROR(devshare_channel_set_spin(ch, DEVSHARE_MAX_SPIN_US + 1), "devshare_channel_set_spin",
                 "a spin above DEVSHARE_MAX_SPIN_US");
    DS_OK(devshare_channel_set_spin(ch, DEVSHARE_MAX_SPIN_US));
    DS_OK(devshare_channel_set_spin(ch, 0));
    close_all(pool, exp, ch, "bad input");
}

static void test_a_host_pool_carries_10000_items_through_8_slots_at_fixed_addresses(void) {
    enum { SLOT = 4096, COUNT = 8, ITEMS = 10000 };
    char address[128];
    make_address(address, sizeof address, "pool");
    DevshareChannel *ch = NULL;
    DevshareExporter *exp = NULL;
    DevsharePool *pool = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    void *base = NULL, *alloc_ptr = NULL;
    DS_OK(devshare_channel_host_alloc(SLOT * COUNT, &exp, &alloc_ptr));
    uint64_t size = 0;
    DS_OK(devshare_exporter_memory(exp, &base, &size));
    CHECK(base != NULL && base == alloc_ptr && size >= SLOT * COUNT,
          "host pool: a memfd allocation has an address (ptr_out and devshare_exporter_memory agree) and the size "
          "asked (%" PRIu64 ")", size);
    DS_OK(devshare_pool_create(ch, exp, SLOT, COUNT, &pool));
    uint64_t ss = 0;
    uint32_t cnt = 0, fr = 0;
    DS_OK(devshare_pool_info(pool, &ss, &cnt, &fr));
    CHECK(ss == SLOT && cnt == COUNT && fr == COUNT,
          "host pool: devshare_pool_info says %u slots of %u bytes, all free",
          COUNT, SLOT);

    Child a = spawn_child("host", "");
    const uint64_t peer = connect_child(ch, &a, address, "host pool");
    /* Both ends spin (opt-in) before they sleep: the same 10,000 items, the same checks. */
    DS_OK(devshare_pool_set_spin(pool, 50));
    tell(&a, "spin 50");
    CHECK(strcmp(reply(&a, ch), "R 0") == 0, "host pool: the consumer spins up to 50 us per receive");
    tell(&a, "recv %d 0 %d", ITEMS, IO_MS);
    int send_ok = peer != 0, ptr_bad = 0;
    const int64_t t0 = now_ns();
    for (uint64_t seq = 1; seq <= ITEMS && send_ok; seq++) {
        uint32_t slot = 0;
        void *ptr = NULL;
        int32_t st = devshare_pool_acquire(pool, IO_MS, &slot, &ptr);
        if (st == DEVSHARE_STATUS_OK) {
            ptr_bad += slot >= COUNT || ptr != (uint8_t *)base + (size_t)slot * SLOT;
            item_fill(ptr, SLOT, seq);
            st = devshare_pool_send(pool, slot, peer, NULL);
        }
        if (st != DEVSHARE_STATUS_OK) {
            printf("    item %" PRIu64 ": %s: %s\n", seq, devshare_status_str(st), last_error());
            send_ok = 0;
        }
    }
    const RecvResult r = recv_result(reply(&a, ch));
    const double secs = (double)(now_ns() - t0) / 1e9;
    CHECK(send_ok, "host pool: the producer acquires, fills and sends %d items through %d slots (%.2f s)", ITEMS, COUNT,
          secs);
    CHECK(ptr_bad == 0, "host pool: devshare_pool_acquire gives slot i at base + i * slot_size");
    CHECK(r.got == ITEMS && r.pool == ITEMS && r.st == 0 && r.kind_bad == 0,
          "host pool: the consumer receives all %d items as pool items (%d)", ITEMS, r.got);
    CHECK(r.addr_bad == 0 && r.slots >= 1 && r.slots <= COUNT,
          "host pool: each slot's data pointer in the consumer is the same on every arrival "
          "(%d slots seen, %d changes)",
          r.slots, r.addr_bad);
    CHECK(r.data_bad == 0 && r.order_bad == 0,
          "host pool: the consumer reads back what the producer wrote, in order (%d bad, %d out of order)", r.data_bad,
          r.order_bad);
    CHECK(r.rel_bad == 0, "host pool: the consumer's releases succeed");
    check_all_slots_return(pool, COUNT, "host pool");
    CHECK(finish(&a, ch), "host pool: the consumer exits cleanly");
    close_all(pool, exp, ch, "host pool");
}

static void on_alarm(int sig) {
    (void)sig;
    static const char m[] = "FAIL - backpressure: a blocking devshare_pool_acquire did not resume within 60 s\n";
    if (write(1, m, sizeof m - 1) < 0) {
        _exit(1);
    }
    _exit(1);
}

static void test_pool_acquire_times_out_or_blocks_until_the_consumer_gives_a_slot_back(void) {
    char address[128];
    make_address(address, sizeof address, "backpressure");
    DevshareChannel *ch = NULL;
    DevshareExporter *exp = NULL;
    DevsharePool *pool = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    DS_OK(devshare_channel_host_alloc(8192, &exp, NULL));
    DS_OK(devshare_pool_create(ch, exp, 4096, 2, &pool));
    Child b = spawn_child("host", "");
    const uint64_t peer = connect_child(ch, &b, address, "backpressure");
    for (uint64_t seq = 1; seq <= 2; seq++) {
        uint32_t slot;
        void *ptr;
        DS_OK(devshare_pool_acquire(pool, 0, &slot, &ptr));
        item_fill(ptr, 4096, seq);
        DS_OK(devshare_pool_send(pool, slot, peer, NULL));
    }
    tell(&b, "recv 2 1 %d", IO_MS);
    const RecvResult r = recv_result(reply(&b, ch));
    CHECK(r.got == 2 && r.data_bad == 0, "backpressure: the consumer receives and holds both slots");
    CHECK(free_slots(pool) == 0, "backpressure: no slot is free while the consumer holds both");
    uint32_t slot = 99;
    void *ptr = NULL;
    int32_t st = devshare_pool_acquire(pool, 200, &slot, &ptr);
    CHECK(st == DEVSHARE_STATUS_TIMEOUT,
          "backpressure: devshare_pool_acquire(200 ms) with every slot held returns DEVSHARE_STATUS_TIMEOUT (%s)",
          devshare_status_str(st));
    if (st == DEVSHARE_STATUS_OK) {
        devshare_pool_release(pool, slot);
    }
    st = devshare_pool_acquire(pool, 0, &slot, &ptr);
    CHECK(st == DEVSHARE_STATUS_TIMEOUT, "backpressure: devshare_pool_acquire(0) does not block: TIMEOUT (%s)",
          devshare_status_str(st));
    if (st == DEVSHARE_STATUS_OK) {
        devshare_pool_release(pool, slot);
    }
    tell(&b, "release_later 300 1");
    const char *a = reply(&b, NULL);
    signal(SIGALRM, on_alarm);
    alarm(60);
    const int64_t t0 = now_ns();
    st = devshare_pool_acquire(pool, -1, &slot, &ptr);
    const double ms = (double)(now_ns() - t0) / 1e6;
    alarm(0);
    signal(SIGALRM, SIG_DFL);
    CHECK(strncmp(a, "R 0", 3) == 0 && st == DEVSHARE_STATUS_OK && slot < 2,
          "backpressure: a blocking devshare_pool_acquire (timeout -1) resumes when the consumer releases a slot "
          "(blocked %.0f ms)", ms);
    if (st == DEVSHARE_STATUS_OK) {
        DS_OK(devshare_pool_release(pool, slot));
    }
    tell(&b, "release 1");
    const char *rel = reply(&b, ch);
    CHECK(strncmp(rel, "R 1 0", 5) == 0, "backpressure: the consumer releases the other slot (%s)", rel);
    check_all_slots_return(pool, 2, "backpressure");
    CHECK(finish(&b, ch), "backpressure: the consumer exits cleanly");
    close_all(pool, exp, ch, "backpressure");
}

static void test_one_pool_serves_two_consumers_each_its_own_items(void) {
    enum { SLOT = 4096, COUNT = 4, EACH = 1000 };
    char address[128];
    make_address(address, sizeof address, "two");
    DevshareChannel *ch = NULL;
    DevshareExporter *exp = NULL;
    DevsharePool *pool = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    DS_OK(devshare_channel_host_alloc(SLOT * COUNT, &exp, NULL));
    DS_OK(devshare_pool_create(ch, exp, SLOT, COUNT, &pool));
    Child c[2] = {spawn_child("host", ""), spawn_child("host", "")};
    uint64_t peer[2];
    peer[0] = connect_child(ch, &c[0], address, "two consumers (first)");
    peer[1] = connect_child(ch, &c[1], address, "two consumers (second)");
    uint64_t ids[4];
    const size_t n = peer_count(ch, ids, 4);
    CHECK(n == 2 && ids[0] == peer[0] && ids[1] == peer[1] && peer[0] != peer[1],
          "two consumers: devshare_channel_peer_ids lists both, oldest first");
    size_t needed = 0;
    const int32_t small = devshare_channel_peer_ids(ch, ids, 1, &needed);
    CHECK(small == DEVSHARE_STATUS_BUFFER_TOO_SMALL && needed == 2 && strstr(last_error(), "2 ids needed, 1 given"),
          "two consumers: devshare_channel_peer_ids into room for 1 says 2 ids are needed (%s)", last_error());
    tell(&c[0], "recv %d 0 %d", EACH, IO_MS);
    tell(&c[1], "recv %d 0 %d", EACH, IO_MS);
    int send_ok = peer[0] && peer[1];
    for (uint64_t seq = 1; seq <= 2 * EACH && send_ok; seq++) {
        uint32_t slot;
        void *ptr;
        int32_t st = devshare_pool_acquire(pool, IO_MS, &slot, &ptr);
        if (st == DEVSHARE_STATUS_OK) {
            item_fill(ptr, SLOT, seq);
            st = devshare_pool_send(pool, slot, peer[seq % 2], NULL);
        }
        if (st != DEVSHARE_STATUS_OK) {
            printf("    item %" PRIu64 ": %s: %s\n", seq, devshare_status_str(st), last_error());
            send_ok = 0;
        }
    }
    CHECK(send_ok, "two consumers: the producer sends %d items to each, alternating", EACH);
    for (int i = 0; i < 2; i++) {
        const RecvResult r = recv_result(reply(&c[i], ch));
        CHECK(r.got == EACH && r.pool == EACH && r.data_bad == 0 && r.order_bad == 0 && r.rel_bad == 0,
              "two consumers: consumer %d receives its %d items and reads them back", i + 1, EACH);
        CHECK(r.addr_bad == 0 && r.slots >= 1 && r.slots <= COUNT,
              "two consumers: consumer %d sees each slot at one address (%d slots seen)", i + 1, r.slots);
    }
    check_all_slots_return(pool, COUNT, "two consumers");
    CHECK(finish(&c[0], ch) && finish(&c[1], ch), "two consumers: both exit cleanly");
    close_all(pool, exp, ch, "two consumers");
}

static void test_slot_misuse_is_refused_and_a_departed_consumers_slots_come_back(void) {
    enum { SLOT = 4096, COUNT = 4 };
    char address[128];
    make_address(address, sizeof address, "misuse");
    DevshareChannel *ch = NULL;
    DevshareExporter *exp = NULL;
    DevsharePool *pool = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    DS_OK(devshare_channel_host_alloc(SLOT * COUNT, &exp, NULL));
    DS_OK(devshare_pool_create(ch, exp, SLOT, COUNT, &pool));
    Child e = spawn_child("host", "");
    const uint64_t peer = connect_child(ch, &e, address, "slot misuse");

    int32_t st = devshare_pool_release(pool, 0);
    CHECK(st == DEVSHARE_STATUS_INVALID_ARGUMENT,
          "slot misuse: the producer cannot release a slot it never acquired (%s)",
          devshare_status_str(st));
    st = devshare_pool_release(pool, COUNT);
    CHECK(st < 0, "slot misuse: releasing slot index == count is refused (%s)", devshare_status_str(st));
    CHECK(free_slots(pool) == COUNT, "slot misuse: refused releases leave the free count alone");
    uint32_t s;
    void *ptr;
    DS_OK(devshare_pool_acquire(pool, 0, &s, &ptr));
    st = devshare_pool_release(pool, s);
    const int32_t st2 = devshare_pool_release(pool, s);
    CHECK(st == DEVSHARE_STATUS_OK && st2 == DEVSHARE_STATUS_INVALID_ARGUMENT && free_slots(pool) == COUNT,
          "slot misuse: a second devshare_pool_release of the same slot is refused (%s) and counts nothing twice",
          devshare_status_str(st2));
    st = devshare_pool_send(pool, s, peer, NULL);
    CHECK(st == DEVSHARE_STATUS_INVALID_ARGUMENT,
          "slot misuse: devshare_pool_send of a slot that is not acquired is refused (%s)",
          devshare_status_str(st));
    st = devshare_pool_send(pool, COUNT, peer, NULL);
    CHECK(st < 0, "slot misuse: devshare_pool_send of slot index == count is refused (%s)", devshare_status_str(st));
    CHECK(free_slots(pool) == COUNT, "slot misuse: refused sends leave the free count alone");

    uint32_t s1, s2;
    DS_OK(devshare_pool_acquire(pool, 0, &s1, &ptr));
    item_fill(ptr, SLOT, 1);
    DS_OK(devshare_pool_send(pool, s1, peer, NULL));
    st = devshare_pool_send(pool, s1, peer, NULL);
    CHECK(st == DEVSHARE_STATUS_INVALID_ARGUMENT, "slot misuse: a slot already sent cannot be sent again (%s)",
          devshare_status_str(st));
    st = devshare_pool_release(pool, s1);
    CHECK(st == DEVSHARE_STATUS_INVALID_ARGUMENT,
          "slot misuse: the producer cannot release a slot the consumer holds (%s)",
          devshare_status_str(st));
    DS_OK(devshare_pool_acquire(pool, 0, &s2, &ptr));
    item_fill(ptr, SLOT, 2);
    DS_OK(devshare_pool_send(pool, s2, peer, NULL));
    tell(&e, "recv 2 1 %d", IO_MS);
    RecvResult r = recv_result(reply(&e, ch));
    CHECK(r.got == 2 && r.data_bad == 0 && r.order_bad == 0,
          "slot misuse: the consumer receives each sent slot once, intact");
    CHECK(free_slots(pool) == COUNT - 2, "slot misuse: two slots are out while the consumer holds them");

    tell(&e, "close");
    const char *a = reply(&e, ch);
    CHECK(strncmp(a, "R 0", 3) == 0, "slot misuse: the consumer closes its connection while holding two slots (%s)", a);
    int back = wait_free(ch, pool, COUNT);
    CHECK(back, "slot misuse: slots held by a consumer that disconnects come back (free %u of %u)", free_slots(pool),
          (unsigned)COUNT);
    tell(&e, "read");
    a = reply(&e, ch);
    CHECK(strcmp(a,
          "R 2 0") == 0, "slot misuse: the consumer's imports stay readable after its connection closed (%s)", a);
    tell(&e, "release 2");
    a = reply(&e, ch);
    CHECK(strcmp(a, "R 2 0") == 0, "slot misuse: the imports release after the connection closed (%s)", a);
    CHECK(finish(&e, ch), "slot misuse: the consumer exits cleanly");

    Child f = spawn_child("host", "");
    const uint64_t peer_f = connect_child(ch, &f, address, "slot misuse (second consumer)");
    for (uint64_t seq = 3; seq <= 4 && peer_f; seq++) {
        DS_OK(devshare_pool_acquire(pool, IO_MS, &s, &ptr));
        item_fill(ptr, SLOT, seq);
        DS_OK(devshare_pool_send(pool, s, peer_f, NULL));
    }
    tell(&f, "recv 2 1 %d", IO_MS);
    r = recv_result(reply(&f, ch));
    tell(&f, "exit_holding");
    a = reply(&f, ch);
    close(f.to);
    close(f.from);
    const int exited = reap(f.pid);
    CHECK(r.got == 2 && exited, "slot misuse: a consumer process exits holding two slots");
    back = wait_free(ch, pool, COUNT);
    CHECK(back, "slot misuse: slots held by a consumer that exited come back (free %u of %u)", free_slots(pool),
          (unsigned)COUNT);
    uint64_t ids[4];
    CHECK(peer_count(ch, ids, 4) == 0, "slot misuse: the producer has no peer left");
    check_all_slots_return(pool, COUNT, "slot misuse");
    close_all(pool, exp, ch, "slot misuse");
}

static void test_leases_stay_outstanding_until_released_or_their_holder_is_killed(void) {
    char address[128];
    make_address(address, sizeof address, "leases");
    DevshareChannel *ch = NULL;
    DevshareExporter *exp = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    DS_OK(devshare_channel_host_alloc(65536, &exp, NULL));
    void *base = NULL;
    DS_OK(devshare_exporter_memory(exp, &base, NULL));
    DevshareHandle h;
    int32_t st = devshare_exporter_share(exp, NULL, &h);
    CHECK(st == DEVSHARE_STATUS_UNSUPPORTED, "leases: devshare_exporter_share refuses a channel-only memfd export (%s)",
          devshare_status_str(st));
    CHECK(outstanding_of(exp) == 0, "leases: the refused share left nothing outstanding");

    Child g = spawn_child("host", "");
    const uint64_t peer = connect_child(ch, &g, address, "leases");
    const int64_t len = 8192;
    const DevshareTensorDesc d = bytes_desc(4096, &len);
    item_fill_host((uint8_t *)base + 4096, 8192, 777, NULL);
    st = devshare_channel_send(ch, peer, exp, &d);
    CHECK(st == DEVSHARE_STATUS_OK,
          "leases: devshare_channel_send of a tensor in a memfd export (%s)", devshare_status_str(st));
    CHECK(outstanding_of(exp) == 1 && peer_leases(ch, peer) == 1,
          "leases: the lease is outstanding as soon as it is sent (exporter 1, peer info 1)");
    tell(&g, "recv 1 1 %d", IO_MS);
    RecvResult r = recv_result(reply(&g, ch));
    CHECK(r.got == 1 && r.lease == 1 && r.pool == 0 && r.kind_bad == 0,
          "leases: the consumer receives it as a lease (devshare_import_pool_slot says INVALID_ARGUMENT)");
    CHECK(r.data_bad == 0, "leases: the consumer reads back the tensor the producer wrote");
    devshare_channel_service(ch, 0);
    CHECK(outstanding_of(exp) == 1, "leases: still outstanding while the consumer holds the import");
    tell(&g, "release 1");
    const char *a = reply(&g, ch);
    st = devshare_exporter_wait(exp, IO_MS);
    CHECK(strcmp(a, "R 1 0") == 0 && st == DEVSHARE_STATUS_OK && outstanding_of(exp) == 0 && peer_leases(ch, peer) == 0,
          "leases: the consumer's release brings it to 0 (devshare_exporter_wait %s)", devshare_status_str(st));

    /* devshare_channel_send_batch: three leases in one call (one SHARES message), received in
     * order, each its own import; refusals send nothing. */
    const int64_t l4k = 4096;
    const DevshareTensorDesc bd[3] = {bytes_desc(0, &l4k), bytes_desc(4096, &l4k), bytes_desc(8192, &l4k)};
    const DevshareTensorDesc *bdp[3] = {&bd[0], &bd[1], &bd[2]};
    const DevshareExporter *bep[3] = {exp, exp, exp};
    for (int i = 0; i < 3; i++)
        item_fill_host((uint8_t *)base + 4096 * (size_t)i, 4096, 900 + (uint64_t)i, NULL);
    const DevshareTensorDesc far = bytes_desc(65536, &l4k);
    const DevshareTensorDesc *fp[2] = {&bd[0], &far};
    EXPECT_ERROR(devshare_channel_send_batch(ch, peer, bep, fp, 2), "devshare_channel_send_batch",
                 "leases: a batch with a description beyond the export");
    const DevshareExporter *np[2] = {exp, NULL};
    EXPECT_ERROR(devshare_channel_send_batch(ch, peer, np, bdp, 2), "devshare_channel_send_batch",
                 "leases: a batch with a NULL exporter");
    EXPECT_ERROR(devshare_channel_send_batch(ch, peer, NULL, bdp, 3), "devshare_channel_send_batch",
                 "leases: a batch with NULL exporters");
    /* devshare_channel_send_named: a name longer than DEVSHARE_MAX_NAME_LEN (read no further than
     * one byte past the limit), or not UTF-8, is refused by its index. */
    char *too_long = malloc(DEVSHARE_MAX_NAME_LEN + 2);
    memset(too_long, 'n', DEVSHARE_MAX_NAME_LEN + 1);
    too_long[DEVSHARE_MAX_NAME_LEN + 1] = '\0';
    const char *bad_names[2][3] = {{"a", too_long, NULL}, {NULL, NULL, "\xff\xfe"}};
    for (int i = 0; i < 2; i++) {
        st = devshare_channel_send_named(ch, peer, bep, bdp, bad_names[i], 3);
        EXPECT_ERROR(st, "devshare_channel_send_named", i ? "leases: a name that is not UTF-8" : "leases: a name too long");
        CHECK(st == DEVSHARE_STATUS_INVALID_ARGUMENT && strstr(last_error(), i ? "names[2]" : "names[1]") != NULL,
              "leases: devshare_channel_send_named names the refused name's index (%s)", last_error());
    }
    free(too_long);
    CHECK(outstanding_of(exp) == 0, "leases: refused batches sent nothing");
    DS_OK(devshare_channel_send_batch(ch, peer, bep, bdp, 0));
    st = devshare_channel_send_batch(ch, peer, bep, bdp, 3);
    CHECK(st == DEVSHARE_STATUS_OK && outstanding_of(exp) == 3 && peer_leases(ch, peer) == 3,
          "leases: devshare_channel_send_batch of 3 leases (%s), all outstanding at once", devshare_status_str(st));
    tell(&g, "recv 3 1 %d", IO_MS);
    r = recv_result(reply(&g, ch));
    CHECK(r.got == 3 && r.lease == 3 && r.data_bad == 0 && r.kind_bad == 0,
          "leases: the consumer receives the batch as 3 leases, one per recv, data intact");
    tell(&g, "release 3");
    a = reply(&g, ch);
    st = devshare_exporter_wait(exp, IO_MS);
    CHECK(strcmp(a, "R 3 0") == 0 && st == DEVSHARE_STATUS_OK && outstanding_of(exp) == 0,
          "leases: releasing the batch's 3 imports returns its 3 leases (%s)", devshare_status_str(st));

    /* Ten syncs of a registered export to this C consumer: before each the producer rewrites the
     * three tensors in place; the consumer reads every value right each time and releases. */
    DS_OK(devshare_channel_register(ch, exp));
    int syncs_ok = 1;
    for (int sync = 0; sync < 10 && syncs_ok; sync++) {
        for (int i = 0; i < 3; i++)
            item_fill_host((uint8_t *)base + 4096 * (size_t)i, 4096, 2000 + 10 * (uint64_t)sync + (uint64_t)i, NULL);
        st = devshare_channel_send_batch(ch, peer, bep, bdp, 3);
        tell(&g, "recv 3 0 %d", IO_MS);
        r = recv_result(reply(&g, ch));
        /* Each tensor's bytes are a pattern of its sequence number (item_check reads every one):
         * this sync's three, not an earlier one's. */
        const long want = 3 * (2000 + 10 * sync) + 0 + 1 + 2;
        syncs_ok = st == DEVSHARE_STATUS_OK && r.got == 3 && r.data_bad == 0 && r.order_bad == 0 &&
                   r.seq_sum == want && devshare_exporter_wait(exp, IO_MS) == DEVSHARE_STATUS_OK &&
                   outstanding_of(exp) == 0;
        if (!syncs_ok) {
            printf("    sync %d: %s, got %d, bad data %d, bad order %d, sequence numbers' sum %ld (%ld wanted)\n",
                   sync, devshare_status_str(st), r.got, r.data_bad, r.order_bad, r.seq_sum, want);
        }
    }
    CHECK(syncs_ok, "leases: ten syncs of a registered export changed in place between them: the C consumer "
                    "reads every value right each time and every lease comes back");
    DS_OK(devshare_channel_unregister(ch, exp));

    item_fill_host((uint8_t *)base + 4096, 8192, 778, NULL);
    DS_OK(devshare_channel_send(ch, peer, exp, &d));
    tell(&g, "recv 1 1 %d", IO_MS);
    r = recv_result(reply(&g, ch));
    CHECK(r.got == 1 && r.data_bad == 0 && outstanding_of(exp) == 1,
          "leases: a second lease is received and held (outstanding 1)");
    kill_child(&g);
    const int64_t t0 = now_ns();
    st = devshare_exporter_wait(exp, 1000);
    const double ms = (double)(now_ns() - t0) / 1e6;
    CHECK(st == DEVSHARE_STATUS_OK && outstanding_of(exp) == 0,
          "leases: after the consumer is SIGKILLed while holding, devshare_exporter_wait(1000) returns OK (%s, took "
          "%.2f ms after the consumer was reaped) and nothing is outstanding", devshare_status_str(st), ms);
    uint64_t ids[4];
    devshare_channel_service(ch, 0);
    CHECK(peer_count(ch, ids, 4) == 0, "leases: the killed consumer is no longer a peer");
    close_all(NULL, exp, ch, "leases");
}

static void test_a_killed_producer_closes_the_connection_and_imports_stay_readable(void) {
    char address[128];
    make_address(address, sizeof address, "death");
    Child p = spawn_child("producer", address);
    char line[1024];
    if (read_line_fd(p.from, line, sizeof line, IO_MS) < 0 || strcmp(line, "READY") != 0) {
        CHECK(0, "producer death: the producer child starts (%s)", line);
        kill_child(&p);
        return;
    }
    DevshareConnection *conn = NULL;
    int32_t st = devshare_channel_connect(address, IO_MS, &conn);
    if (!CHECK(st == DEVSHARE_STATUS_OK, "producer death: the consumer connects to the producer child (%s: %s)",
               devshare_status_str(st), st ? last_error() : "")) {
        kill_child(&p);
        return;
    }
    CHECK(devshare_connection_fd(conn) >= 0, "producer death: devshare_connection_fd gives a descriptor");
    const int sent = read_line_fd(p.from, line, sizeof line, IO_MS) >= 0 && strcmp(line, "SENT") == 0;
    CHECK(sent, "producer death: the producer sent a pool slot and a lease (%s)", line);
    char msg[1024];
    const RecvResult r = consume(conn, 2, 1, IO_MS, msg, sizeof msg);
    CHECK(r.got == 2 && r.pool == 1 && r.lease == 1 && r.data_bad == 0,
          "producer death: the consumer receives and holds a pool slot and a lease, intact (%s)", msg);
    kill_child(&p);
    DevshareImport *imp = NULL;
    st = devshare_connection_recv(conn, IO_MS, &imp);
    CHECK(st == DEVSHARE_STATUS_CLOSED,
          "producer death: after the producer is SIGKILLed, devshare_connection_recv returns DEVSHARE_STATUS_CLOSED "
          "(%s)",
          devshare_status_str(st));
    if (st == DEVSHARE_STATUS_OK) {
        devshare_import_release(imp);
    }
    int readable = n_held == 2;
    for (int i = 0; i < n_held; i++) {
        readable = readable && import_readable(held[i]);
    }
    CHECK(readable, "producer death: both imports are still readable after the producer died");
    const int fails = release_held(n_held);
    CHECK(fails == 0, "producer death: both imports release after the producer died");
    st = devshare_connection_recv(conn, 0, &imp);
    CHECK(st == DEVSHARE_STATUS_CLOSED, "producer death: a later recv still says CLOSED (%s)", devshare_status_str(st));
    st = devshare_connection_close(conn);
    CHECK(st == DEVSHARE_STATUS_OK, "producer death: the connection closes (%s)", devshare_status_str(st));
}

/* memfd descriptors open in this process, as a bit set over fd numbers below 1024. */
static void memfd_set(unsigned char *set) {
    memset(set, 0, 1024);
    DIR *d = opendir("/proc/self/fd");
    for (struct dirent *e; d && (e = readdir(d)) != NULL;) {
        char path[300], target[256];
        snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
        const ssize_t n = readlink(path, target, sizeof target - 1);
        const int fd = atoi(e->d_name);
        if (n > 7 && fd >= 0 && fd < 1024 && strncmp(target, "/memfd:", 7) == 0) {
            set[fd] = 1;
        }
    }
    if (d) {
        closedir(d);
    }
}

static void test_a_channel_host_allocation_is_a_sealed_memfd_that_cannot_be_resized(void) {
    enum { SLOT = 32768, SIZE = 2 * SLOT };
    unsigned char before[1024], after[1024];
    memfd_set(before);
    DevshareExporter *exp = NULL;
    DS_OK(devshare_channel_host_alloc(SIZE, &exp, NULL));
    memfd_set(after);
    int found = 0, shrink_refused = 0, grow_refused = 0, sealed = 0;
    for (int fd = 0; fd < 1024; fd++) {
        if (!after[fd] || before[fd]) {
            continue;
        }
        found++;
        errno = 0;
        shrink_refused += ftruncate(fd, 0) != 0 && errno == EPERM;
        errno = 0;
        grow_refused += ftruncate(fd, (off_t)SIZE * 4) != 0 && errno == EPERM;
        const int seals = fcntl(fd, F_GET_SEALS);
        const int want = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
        sealed += seals >= 0 && (seals & want) == want;
    }
    CHECK(found >= 1, "sealed memfd: devshare_channel_host_alloc makes a memfd (%d new)", found);
    CHECK(found >= 1 && shrink_refused == found, "sealed memfd: ftruncate(fd, 0) on it fails with EPERM");
    CHECK(found >= 1 && grow_refused == found, "sealed memfd: growing it fails with EPERM");
    CHECK(found >= 1 && sealed == found, "sealed memfd: F_GET_SEALS shows F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL");

    char address[128];
    make_address(address, sizeof address, "sealed");
    DevshareChannel *ch = NULL;
    DevsharePool *pool = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    DS_OK(devshare_pool_create(ch, exp, SLOT, 2, &pool));
    Child c = spawn_child("host", "");
    const uint64_t peer = connect_child(ch, &c, address, "sealed memfd");
    for (uint64_t seq = 1; seq <= 2 && peer; seq++) {
        uint32_t slot;
        void *ptr;
        DS_OK(devshare_pool_acquire(pool, IO_MS, &slot, &ptr));
        item_fill(ptr, SLOT, seq);
        DS_OK(devshare_pool_send(pool, slot, peer, NULL));
    }
    tell(&c, "recv 2 1 %d", IO_MS);
    const RecvResult r = recv_result(reply(&c, ch));
    CHECK(r.got == 2 && r.data_bad == 0, "sealed memfd: the consumer reads both whole slots without SIGBUS");
    tell(&c, "memfds");
    const char *a = reply(&c, ch);
    long v[2] = {0};
    CHECK(ints(a, v, 2) == 2 && v[0] == v[1],
          "sealed memfd: a memfd the consumer keeps open refuses ftruncate(fd, 0) with EPERM too "
          "(%ld open, %ld refused)",
          v[0], v[1]);
    tell(&c, "read");
    a = reply(&c, ch);
    CHECK(strcmp(a, "R 2 0") == 0, "sealed memfd: the consumer reads both slots again afterwards (%s)", a);
    CHECK(finish(&c, ch), "sealed memfd: the consumer exits cleanly");
    check_all_slots_return(pool, 2, "sealed memfd");
    close_all(pool, exp, ch, "sealed memfd");
}

/* Service `ch` until the pipe has a line (bounded). */
static int read_servicing(int fd, DevshareChannel *ch, char *buf, size_t cap) {
    const int64_t deadline = now_ms() + IO_MS;
    while (now_ms() < deadline) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 0) > 0) {
            return read_line_fd(fd, buf, cap, IO_MS);
        }
        devshare_channel_service(ch, 20);
    }
    return -1;
}

static void test_a_consumer_running_as_another_uid_is_refused(void) {
    if (geteuid() != 0) {
        printf("SKIP: peer with another uid: tests do not run as root\n");
        return;
    }
    char address[128];
    make_address(address, sizeof address, "uid");
    DevshareChannel *ch = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    int pfd[2];
    if (pipe(pfd)) {
        perror("pipe");
        exit(2);
    }
    fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) {
        close(pfd[0]);
        char out[1200];
        if (setgroups(0, NULL) != 0 || setgid(65534) != 0 || setuid(65534) != 0 || geteuid() != 65534) {
            snprintf(out, sizeof out, "E could not become uid 65534: %s\n", strerror(errno));
        } else {
            DevshareConnection *conn = NULL;
            const int32_t st = devshare_channel_connect(address, 5000, &conn);
            snprintf(out, sizeof out, "R %d %.1000s\n", (int)st, st ? last_error() : "connected");
            if (st == DEVSHARE_STATUS_OK) {
                devshare_connection_close(conn);
            }
        }
        if (write(pfd[1], out, strlen(out)) < 0) {
            _exit(2);
        }
        _exit(0);
    }
    close(pfd[1]);
    char line[1200] = "";
    const int got = read_servicing(pfd[0], ch, line, sizeof line);
    close(pfd[0]);
    reap(pid);
    long v[1] = {0};
    const int parsed = got >= 0 && ints(line, v, 1) == 1;
    CHECK(parsed && v[0] == DEVSHARE_STATUS_UNTRUSTED,
          "peer with another uid: a consumer running as uid 65534 is refused by the root producer: UNTRUSTED (%s)",
          line);
    devshare_channel_service(ch, 0);
    uint64_t ids[4];
    CHECK(peer_count(ch, ids, 4) == 0, "peer with another uid: the producer kept no peer");
    close_all(NULL, NULL, ch, "peer with another uid");
}

static void test_restrict_refuses_a_consumer_left_off_its_pid_or_uid_list(void) {
    char address[128];
    make_address(address, sizeof address, "restrict");
    DevshareChannel *ch = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    Child c = spawn_child("host", "");
    const int32_t me = (int32_t)getpid();
    DS_OK(devshare_channel_restrict(ch, NULL, 0, &me, 1));
    tell(&c, "connect %s 5000", address);
    const char *a = reply(&c, ch);
    long v[1] = {0};
    uint64_t ids[4];
    CHECK(ints(a, v, 1) == 1 && v[0] == DEVSHARE_STATUS_UNTRUSTED && peer_count(ch, ids, 4) == 0,
          "restrict: a pid list without the consumer's pid refuses it (%s)", a);

    const uint32_t other_uid = geteuid() == 12345 ? 12346 : 12345;
    DS_OK(devshare_channel_restrict(ch, &other_uid, 1, NULL, 0));
    tell(&c, "connect %s 5000", address);
    a = reply(&c, ch);
    CHECK(ints(a, v, 1) == 1 && v[0] == DEVSHARE_STATUS_UNTRUSTED && peer_count(ch, ids, 4) == 0,
          "restrict: a uid list without the consumer's uid refuses it (%s)", a);

    const int32_t its_pid = (int32_t)c.pid;
    const uint32_t my_uid = geteuid();
    DS_OK(devshare_channel_restrict(ch, &my_uid, 1, &its_pid, 1));
    const uint64_t peer = connect_child(ch, &c, address, "restrict (the consumer's own pid and uid)");
    CHECK(peer != 0, "restrict: the consumer is accepted once the lists name it");
    CHECK(finish(&c, ch), "restrict: the consumer exits cleanly");
    close_all(NULL, NULL, ch, "restrict");
}

static void test_an_acl_pool_reaches_its_channel_consumer_but_not_a_process_outside_the_channel(void) {
    enum { SLOT = 65536, COUNT = 4, ITEMS = 20 };
    const size_t size = 2u << 20;
    const aclError init = aclInit(NULL);
    if (init != ACL_SUCCESS && init != ACL_ERROR_REPEAT_INITIALIZE) {
        acl_or_die(init, "aclInit");
    }
    acl_or_die(aclrtSetDevice(0), "aclrtSetDevice(0)");
    void *dev = NULL;
    acl_or_die(aclrtMalloc(&dev, size, ACL_MEM_MALLOC_HUGE_FIRST), "aclrtMalloc");
    DevshareExporter *exp = NULL;
    DS_OK(devshare_export(DEVSHARE_BACKEND_ACL, 0, dev, size, 0, &exp));
    char address[128];
    make_address(address, sizeof address, "acl");
    DevshareChannel *ch = NULL;
    DevsharePool *pool = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    DS_OK(devshare_pool_create(ch, exp, SLOT, COUNT, &pool));
    /* The stand-in models a container (bare tgid != pid): whitelist the announced pid. Without
     * this the kernel's pid is whitelisted, which the import's pid check refuses. */
    DS_OK(devshare_channel_trust_announced_pids(ch, 1));
    g_acl = 1;
    Child k = spawn_child("acl", "");
    const uint64_t peer = connect_child(ch, &k, address, "acl pool");
    DevsharePeerInfo pinfo;
    memset(&pinfo, 0, sizeof pinfo);
    DS_OK(devshare_peer_info_init(&pinfo, sizeof pinfo));
    const int32_t pst = peer ? devshare_channel_peer_info(ch, peer, &pinfo) : DEVSHARE_STATUS_NOT_FOUND;
    CHECK(pst == DEVSHARE_STATUS_OK && pinfo.tgid == k.tgid && k.tgid != k.pid,
          "acl pool: the consumer announced its bare tgid in the handshake (%d; its pid is %d)", (int)pinfo.tgid,
          (int)k.pid);
    tell(&k, "recv %d 0 %d", ITEMS, IO_MS);
    int send_ok = peer != 0, ptr_bad = 0;
    for (uint64_t seq = 1; seq <= ITEMS && send_ok; seq++) {
        uint32_t slot;
        void *ptr;
        int32_t st = devshare_pool_acquire(pool, IO_MS, &slot, &ptr);
        if (st == DEVSHARE_STATUS_OK) {
            ptr_bad += slot >= COUNT || ptr != (uint8_t *)dev + (size_t)slot * SLOT;
            item_fill(ptr, SLOT, seq);
            st = devshare_pool_send(pool, slot, peer, NULL);
        }
        if (st != DEVSHARE_STATUS_OK) {
            printf("    item %" PRIu64 ": %s: %s\n", seq, devshare_status_str(st), last_error());
            send_ok = 0;
        }
    }
    const RecvResult r = recv_result(reply(&k, ch));
    CHECK(ptr_bad == 0, "acl pool: devshare_pool_acquire gives slot i at the device address base + i * slot_size");
    CHECK(send_ok && r.got == ITEMS && r.pool == ITEMS && r.data_bad == 0 && r.order_bad == 0 && r.rel_bad == 0,
          "acl pool: a channel consumer receives %d slots of an ACL export and reads them back, with no "
          "devshare_exporter_allow_pid call (%d received)", ITEMS, r.got);
    CHECK(r.addr_bad == 0 && r.slots >= 1 && r.slots <= COUNT,
          "acl pool: each slot keeps one device address in the consumer (%d slots seen)", r.slots);

    /* A plain handle of the same export, imported by a process that never connected. */
    DevshareHandle h;
    DS_OK(devshare_exporter_share(exp, NULL, &h));
    char text[DEVSHARE_HANDLE_MAX_TEXT_SIZE];
    DS_OK(devshare_handle_to_text(&h, text, sizeof text, NULL));
    Child l = spawn_child("acl", "");
    tell(&l, "import %s", text);
    const char *a = reply(&l, ch);
    CHECK(strncmp(a, "R -34", 5) == 0 && strstr(a, "207006") != NULL,
          "acl pool: a process that imports a plain handle of the export, without the channel, is refused by the "
          "pid whitelist (%s)", a);
    CHECK(finish(&l, ch), "acl pool: the refused process exits cleanly");
    CHECK(finish(&k, ch), "acl pool: the channel consumer exits cleanly");
    check_all_slots_return(pool, COUNT, "acl pool");
    const int32_t w = devshare_exporter_wait(exp, IO_MS);
    CHECK(w == DEVSHARE_STATUS_OK, "acl pool: the refused handle's reference came back (%s)", devshare_status_str(w));
    close_all(pool, exp, ch, "acl pool");
    acl_or_die(aclrtFree(dev), "aclrtFree");
    g_acl = 0;
}

/* A segmented CUDA export (4 cuMemCreate segments of 2 MiB, POSIX fds) as a pool of one slot
 * per segment, to a consumer that cannot take the producer's descriptors with pidfd_getfd:
 * the producer is not dumpable and the consumer has no CAP_SYS_PTRACE, as in test_cuda_vmm's
 * refusal case. The segment fds must travel over the channel. Then the same pool with
 * DEVSHARE_SHARE_EVENT items. */
static void test_a_cuda_segment_pool_passes_its_fds_over_the_channel_and_detaches_on_close(void) {
    enum { COUNT = 4, ROUNDS = 3 };
    /* Without CAP_SYS_PTRACE on either side (as root too), the kernel's ordinary ptrace rules
     * decide whether the consumer may take the producer's fds. */
    drop_ptrace_capability();
    cuda_start();
    Vmm v;
    vmm_create(&v, COUNT);
    DevshareExporter *exp = NULL;
    DS_OK(devshare_export_segments(DEVSHARE_BACKEND_CUDA, 0, (void *)(uintptr_t)v.va, v.h, COUNT, SEG, 0, &exp));
    char address[128];
    make_address(address, sizeof address, "cuda_pool");
    DevshareChannel *ch = NULL;
    DevsharePool *pool = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    DS_OK(devshare_pool_create(ch, exp, SEG, COUNT, &pool));
    g_cuda = 1;
    Child k = spawn_child("cuda", "");
    const CudaState s0 = cuda_state(&k, ch);

    /* pidfd_getfd of the producer's stderr: the consumer's own probe. */
    const int scope = read_ptrace_scope();
    tell(&k, "getfd %d 2", (int)getpid());
    const char *a = reply(&k, ch);
    long e[1] = {-1};
    if (scope <= 0) {
        CHECK(ints(a, e, 1) == 1 && e[0] == 0,
              "cuda pool: while the producer is dumpable, its consumer can take a producer fd with pidfd_getfd "
              "(%s)", a);
    } else {
        printf("    # Yama ptrace_scope %d: pidfd_getfd of a dumpable producer: %s\n", scope, a);
    }
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    tell(&k, "getfd %d 2", (int)getpid());
    a = reply(&k, ch);
    CHECK(ints(a, e, 1) == 1 && e[0] == EPERM,
          "cuda pool: with the producer not dumpable, the consumer (no CAP_SYS_PTRACE) cannot take its fds with "
          "pidfd_getfd: EPERM (%s)", a);

    const uint64_t peer = connect_child(ch, &k, address, "cuda pool");
    uint64_t seq = 0;
    int send_ok = peer != 0, ptr_bad = 0, recv_ok = 1, addr_ok = 1, held_ok = 1, rel_ok = 1, back_ok = 1;
    CudaState held_state = {0};
    for (int round = 0; round < ROUNDS && send_ok; round++) {
        for (int i = 0; i < COUNT && send_ok; i++) {
            uint32_t slot;
            void *ptr;
            int32_t st = devshare_pool_acquire(pool, IO_MS, &slot, &ptr);
            if (st == DEVSHARE_STATUS_OK) {
                ptr_bad += slot >= COUNT || (CUdeviceptr)(uintptr_t)ptr != v.va + slot * SEG;
                item_fill(ptr, SEG, ++seq);
                st = devshare_pool_send(pool, slot, peer, NULL);
            }
            if (st != DEVSHARE_STATUS_OK) {
                printf("    item %" PRIu64 ": %s: %s\n", seq, devshare_status_str(st), last_error());
                send_ok = 0;
            }
        }
        tell(&k, "recv %d 1 %d", COUNT, IO_MS);
        const RecvResult r = recv_result(reply(&k, ch));
        recv_ok = recv_ok && r.got == COUNT && r.pool == COUNT && r.data_bad == 0 && r.order_bad == 0 &&
                  r.kind_bad == 0 && r.events == 0;
        addr_ok = addr_ok && r.addr_bad == 0 && r.slots == COUNT;
        held_state = cuda_state(&k, ch);
        held_ok = held_ok && held_state.resv == 1 && held_state.maps == COUNT && held_state.imported == COUNT &&
                  held_state.violations == 0;
        tell(&k, "release %d", COUNT);
        a = reply(&k, ch);
        rel_ok = rel_ok && strcmp(a, "R 4 0") == 0;
        back_ok = back_ok && wait_free(ch, pool, COUNT);
    }
    CHECK(send_ok && ptr_bad == 0,
          "cuda pool: %d items through %d slots of a 4-segment cuMemCreate export; slot i is at base + i * 2 MiB",
          ROUNDS * COUNT, COUNT);
    CHECK(recv_ok,
          "cuda pool: the consumer imports every item although pidfd_getfd is refused (the segment fds came over "
          "the channel) and reads back what the producer wrote with cuMemcpyDtoH");
    CHECK(addr_ok, "cuda pool: each of the %d slots keeps one device address in the consumer over %d rounds", COUNT,
          ROUNDS);
    CHECK(held_ok,
          "cuda pool: the consumer imported the allocation once: 1 reservation, %d mappings, %d imported handles "
          "(no violation)", COUNT, COUNT);
    show_cuda_state("cuda consumer holding 4 slots", held_state);
    CHECK(rel_ok && back_ok, "cuda pool: the consumer's releases bring every slot back");

    /* The same pool, the same consumer: items carry an interprocess event instead of a sync. */
    CUstream stream = NULL;
    cu_or_die(cuStreamCreate(&stream, 0), "cuStreamCreate");
    int ev_send_ok = 1, ev_recv_ok = 1, ev_waited_ok = 1, kept_ok = 1, gone_ok = 1, ev_rel_ok = 1, open_ok = 1;
    int opened_held = -1, opened_back = -1;
    char first_events[512] = "", round_events[512];
    const int64_t slot_len = (int64_t)SEG;
    for (int round = 0; round < ROUNDS && ev_send_ok; round++) {
        for (int i = 0; i < COUNT && ev_send_ok; i++) {
            uint32_t slot;
            void *ptr;
            int32_t st = devshare_pool_acquire(pool, IO_MS, &slot, &ptr);
            if (st == DEVSHARE_STATUS_OK) {
                item_fill(ptr, SEG, ++seq);
                DevshareTensorDesc d = bytes_desc(0, &slot_len);
                d.flags = DEVSHARE_SHARE_EVENT;
                d.stream = seq % 2 ? stream : NULL; /* a stand-in stream, or all work on the device */
                st = devshare_pool_send(pool, slot, peer, &d);
            }
            if (st != DEVSHARE_STATUS_OK) {
                printf("    item %" PRIu64 ": %s: %s\n", seq, devshare_status_str(st), last_error());
                ev_send_ok = 0;
            }
        }
        kept_ok = kept_ok && live_events("cusi_e_") == COUNT;
        tell(&k, "recv %d 1 %d", COUNT, IO_MS);
        const RecvResult r = recv_result(reply(&k, ch));
        ev_recv_ok = ev_recv_ok && r.got == COUNT && r.pool == COUNT && r.data_bad == 0 && r.order_bad == 0 &&
                     r.addr_bad == 0 && r.slots == COUNT;
        ev_waited_ok = ev_waited_ok && r.events == COUNT && r.waited == COUNT;
        kept_ok = kept_ok && live_events("cusi_e_") == COUNT;
        opened_held = cuda_state(&k, ch).opened;
        tell(&k, "release %d", COUNT);
        a = reply(&k, ch);
        ev_rel_ok = ev_rel_ok && strcmp(a, "R 4 0") == 0 && wait_free(ch, pool, COUNT);
        opened_back = cuda_state(&k, ch).opened;
        open_ok = open_ok && opened_held == COUNT && opened_back == COUNT;
        /* Back in the channel's pool, and the next round records the same events again. */
        live_event_names("cusi_e_", round_events, sizeof round_events);
        if (round == 0) {
            memcpy(first_events, round_events, sizeof first_events);
        }
        gone_ok = gone_ok && live_events("cusi_e_") == COUNT && strcmp(round_events, first_events) == 0;
    }
    CHECK(ev_send_ok, "cuda pool events: %d items sent with DEVSHARE_SHARE_EVENT (a stream, or NULL)", ROUNDS * COUNT);
    CHECK(ev_recv_ok, "cuda pool events: the consumer reads every item back, each slot at its earlier address");
    CHECK(ev_waited_ok,
          "cuda pool events: every item carries an IPC event that devshare_connection_recv had waited on exactly "
          "once when it returned (cusi_event_waits)");
    CHECK(kept_ok, "cuda pool events: the producer keeps one live event per slot out with the consumer");
    CHECK(ev_rel_ok && gone_ok,
          "cuda pool events: each slot's event goes back to the channel's pool when the slot comes back, and every "
          "round records the same %d events again (%s)", COUNT, round_events);
    CHECK(open_ok,
          "cuda pool events: the consumer opens each of the producer's %d events once and keeps it open, over %d "
          "rounds, items held and given back (%d open while held, %d after the release)", COUNT, ROUNDS,
          opened_held, opened_back);
    const CudaState s1 = cuda_state(&k, ch);
    CHECK(s1.resv == 1 && s1.maps == COUNT && s1.imported == COUNT,
          "cuda pool events: still the one attachment (%d reservations, %d mappings, %d imported)", s1.resv, s1.maps,
          s1.imported);
    prctl(PR_SET_DUMPABLE, 1, 0, 0, 0);

    check_all_slots_return(pool, COUNT, "cuda pool");
    const int32_t pc = devshare_pool_close(pool);
    tell(&k, "recv 1 0 0");
    const RecvResult rc = recv_result(reply(&k, ch));
    const CudaState s2 = cuda_state(&k, ch);
    CHECK(pc == DEVSHARE_STATUS_OK && rc.got == 0 && rc.st == DEVSHARE_STATUS_TIMEOUT && s2.resv == 0 &&
              s2.maps == 0 && s2.handles == 0 && s2.imported == 0 && s2.allocs == 0 && s2.violations == 0,
          "cuda pool: after devshare_pool_close the consumer's next recv detaches: nothing reserved, mapped or "
          "imported is left in it");
    show_cuda_state("cuda consumer after the pool closed", s2);
    int32_t st = devshare_exporter_wait(exp, IO_MS);
    CHECK(st == DEVSHARE_STATUS_OK, "cuda pool: the consumer's detach reaches the producer (devshare_exporter_wait %s)",
          devshare_status_str(st));
    tell(&k, "close");
    a = reply(&k, ch);
    const CudaState s3 = cuda_state(&k, ch);
    CHECK(strncmp(a, "R 0", 3) == 0 && s3.fds == s0.fds,
          "cuda pool: once its connection is closed the consumer has as many fds open as before it connected "
          "(%d -> %d): every segment fd that came over the channel is closed", s0.fds, s3.fds);
    CHECK(s3.opened == 0 && s3.violations == 0,
          "cuda pool events: closing the connection destroys the events it kept open (%d open, %d violations)",
          s3.opened, s3.violations);
    CHECK(finish(&k, ch), "cuda pool: the consumer exits cleanly");
    close_all(NULL, exp, ch, "cuda pool");
    cu_or_die(cuStreamDestroy(stream), "cuStreamDestroy");
    vmm_destroy(&v);
    CHECK(cusi_vmm_reservations() == 0 && cusi_vmm_mappings() == 0 && cusi_vmm_handles() == 0 &&
              cusi_vmm_allocations() == 0,
          "cuda pool: the producer holds no VMM object afterwards");
    g_cuda = 0;
}

/* What the CUDA lease tests start from: `size` bytes of cuMemAlloc memory exported, a channel at
 * an address made from `tag`, one CUDA consumer child connected to it, and a stream. */
typedef struct {
    CUdeviceptr dev;
    DevshareExporter *exp;
    DevshareChannel *ch;
    Child k;
    uint64_t peer;
    CUstream stream;
} CudaRig;

static CudaRig cuda_rig(size_t size, const char *tag, const char *label) {
    CudaRig rig = {0};
    cuda_start();
    cu_or_die(cuMemAlloc(&rig.dev, size), "cuMemAlloc");
    DS_OK(devshare_export(DEVSHARE_BACKEND_CUDA, 0, (void *)(uintptr_t)rig.dev, size, 0, &rig.exp));
    char address[128];
    make_address(address, sizeof address, tag);
    DS_OK(devshare_channel_listen(address, &rig.ch));
    g_cuda = 1;
    rig.k = spawn_child("cuda", "");
    rig.peer = connect_child(rig.ch, &rig.k, address, label);
    cu_or_die(cuStreamCreate(&rig.stream, 0), "cuStreamCreate");
    return rig;
}

/* The rig's stream and memory, once its channel and exporter are closed. */
static void cuda_rig_free(CudaRig *r) {
    cu_or_die(cuStreamDestroy(r->stream), "cuStreamDestroy");
    cu_or_die(cuMemFree(r->dev), "cuMemFree");
    g_cuda = 0;
}

/* A consumer that holds the leases of 128 sends with events on one device holds all the events a
 * channel keeps for it there (events are never destroyed while their consumer is connected, so
 * that it may keep them open): the next sends synchronise their stream instead, and once leases
 * come back their events are recorded again. */
static void test_past_128_events_out_with_one_consumer_a_cuda_send_synchronises_instead(void) {
    enum { KEPT = 128, OVER = 2 };
    const size_t size = 1u << 20;
    CudaRig rig = cuda_rig(size, "cuda_kept_events", "cuda kept events");
    const int64_t len = 4096;
    item_fill((void *)(uintptr_t)rig.dev, (uint64_t)len, 77);
    int sent = 0;
    for (int i = 0; i < KEPT + OVER && rig.peer; i++) {
        DevshareTensorDesc d = bytes_desc(0, &len);
        d.flags = DEVSHARE_SHARE_EVENT;
        d.stream = rig.stream;
        sent += devshare_channel_send(rig.ch, rig.peer, rig.exp, &d) == DEVSHARE_STATUS_OK;
    }
    CHECK(sent == KEPT + OVER && live_events("cusi_e_") == KEPT,
          "cuda kept events: %d sends with DEVSHARE_SHARE_EVENT to one consumer holding them all succeed, with %d "
          "events made (%d live)", sent, KEPT, live_events("cusi_e_"));
    tell(&rig.k, "recv %d 1 %d", KEPT + OVER, IO_MS);
    RecvResult r = recv_result(reply(&rig.k, rig.ch));
    CHECK(r.got == KEPT + OVER && r.data_bad == 0 && r.events == KEPT && r.waited == KEPT,
          "cuda kept events: the consumer reads every lease; %d carry an event it waited on once, the %d past them "
          "none (their stream was synchronised): %d got, %d events, %d waited once", KEPT, OVER, r.got, r.events,
          r.waited);
    tell(&rig.k, "release %d", KEPT + OVER);
    const char *a = reply(&rig.k, rig.ch);
    int32_t st = devshare_exporter_wait(rig.exp, IO_MS);
    CHECK(st == DEVSHARE_STATUS_OK && live_events("cusi_e_") == KEPT,
          "cuda kept events: with every lease back (%s, %s) the %d events stay alive for their consumer", a,
          devshare_status_str(st), KEPT);
    DevshareTensorDesc d = bytes_desc(0, &len);
    d.flags = DEVSHARE_SHARE_EVENT;
    d.stream = rig.stream;
    st = devshare_channel_send(rig.ch, rig.peer, rig.exp, &d);
    tell(&rig.k, "recv 1 0 %d", IO_MS);
    r = recv_result(reply(&rig.k, rig.ch));
    CHECK(st == DEVSHARE_STATUS_OK && r.got == 1 && r.events == 1 && r.waited == 1 && live_events("cusi_e_") == KEPT,
          "cuda kept events: the next send carries one of them, recorded again (%d events, %d live)", r.events,
          live_events("cusi_e_"));
    tell(&rig.k, "release 1");
    a = reply(&rig.k, rig.ch);
    st = devshare_exporter_wait(rig.exp, IO_MS);
    /* The same through a pool of 130 slots: its items take the same 128 events, the last 2 are
     * synchronised (outside the channel's lock), and the consumer keeps each event open once. */
    DevsharePool *pool = NULL;
    DS_OK(devshare_pool_create(rig.ch, rig.exp, 4096, KEPT + OVER, &pool));
    int pool_sent = 0;
    for (int i = 0; i < KEPT + OVER; i++) {
        uint32_t slot;
        void *ptr;
        if (devshare_pool_acquire(pool, IO_MS, &slot, &ptr) != DEVSHARE_STATUS_OK) {
            break;
        }
        DevshareTensorDesc pd = bytes_desc(0, &len);
        pd.flags = DEVSHARE_SHARE_EVENT;
        pd.stream = rig.stream;
        pool_sent += devshare_pool_send(pool, slot, rig.peer, &pd) == DEVSHARE_STATUS_OK;
    }
    tell(&rig.k, "recv %d 1 %d", KEPT + OVER, IO_MS);
    r = recv_result(reply(&rig.k, rig.ch));
    const CudaState held = cuda_state(&rig.k, rig.ch);
    CHECK(pool_sent == KEPT + OVER && r.got == KEPT + OVER && r.pool == KEPT + OVER && r.events == KEPT &&
              r.waited == KEPT && live_events("cusi_e_") == KEPT && held.opened == KEPT,
          "cuda kept events: %d pool items held by the consumer: %d carry one of its %d events, the rest were "
          "synchronised; it keeps each event open once (%d sent, %d got, %d events, %d waited once, %d open)",
          KEPT + OVER, KEPT, KEPT, pool_sent, r.got, r.events, r.waited, held.opened);
    tell(&rig.k, "release %d", KEPT + OVER);
    a = reply(&rig.k, rig.ch);
    CHECK(wait_free(rig.ch, pool, KEPT + OVER) && devshare_pool_close(pool) == DEVSHARE_STATUS_OK,
          "cuda kept events: every pool slot comes back (%s)", a);
    const CudaState s = cuda_state(&rig.k, rig.ch);
    CHECK(s.violations == 0 && s.opened <= KEPT,
          "cuda kept events: the consumer broke no driver rule (%d) and keeps at most %d open (%d)", s.violations,
          KEPT, s.opened);
    CHECK(finish(&rig.k, rig.ch), "cuda kept events: the consumer exits cleanly");
    for (int i = 0; i < 100 && live_events("cusi_e_") != 0; i++) {
        devshare_channel_service(rig.ch, 10);
    }
    CHECK(live_events("cusi_e_") == 0, "cuda kept events: once the consumer is gone its events are destroyed");
    close_all(NULL, rig.exp, rig.ch, "cuda kept events");
    cuda_rig_free(&rig);
}

/* A leased devshare_channel_send of a plain CUDA export (cuMemAlloc, legacy IPC handle) with
 * DEVSHARE_SHARE_EVENT. */
static void test_a_cuda_lease_event_is_waited_on_once_and_kept_until_the_lease_returns(void) {
    const size_t size = 1u << 20;
    CudaRig rig = cuda_rig(size, "cuda_lease", "cuda lease event");
    const int64_t len = 65536;
    for (int with_stream = 1; with_stream >= 0 && rig.peer; with_stream--) {
        const char *how = with_stream ? "recorded on a stream" : "recorded with a NULL stream";
        item_fill((void *)(uintptr_t)(rig.dev + 8192), (uint64_t)len, 900 + (uint64_t)with_stream);
        DevshareTensorDesc d = bytes_desc(8192, &len);
        d.flags = DEVSHARE_SHARE_EVENT;
        d.stream = with_stream ? rig.stream : NULL;
        int32_t st = devshare_channel_send(rig.ch, rig.peer, rig.exp, &d);
        CHECK(st == DEVSHARE_STATUS_OK && outstanding_of(rig.exp) == 1 && live_events("cusi_e_") == 1,
              "cuda lease event (%s): devshare_channel_send of a cuMemAlloc export with DEVSHARE_SHARE_EVENT; the "
              "lease is outstanding and the producer holds its event (%s)", how, devshare_status_str(st));
        tell(&rig.k, "recv 1 1 %d", IO_MS);
        const RecvResult r = recv_result(reply(&rig.k, rig.ch));
        CHECK(r.got == 1 && r.lease == 1 && r.data_bad == 0 && r.events == 1 && r.waited == 1,
              "cuda lease event (%s): the consumer receives the lease and reads it back; recv had waited on its "
              "IPC event exactly once (%d events, %d waited once)", how, r.events, r.waited);
        tell(&rig.k, "lease_opens");
        const char *a = reply(&rig.k, rig.ch);
        devshare_channel_service(rig.ch, 0);
        CHECK(strcmp(a, "R 1") == 0 && live_events("cusi_e_") == 1 && outstanding_of(rig.exp) == 1,
              "cuda lease event (%s): while the consumer holds it: one live IPC open of the allocation (%s), the "
              "event still kept", how, a);
        tell(&rig.k, "release 1");
        a = reply(&rig.k, rig.ch);
        st = devshare_exporter_wait(rig.exp, IO_MS);
        CHECK(strcmp(a, "R 1 0") == 0 && st == DEVSHARE_STATUS_OK && outstanding_of(rig.exp) == 0 &&
                  live_events("cusi_e_") == 1,
              "cuda lease event (%s): the release brings the lease back (devshare_exporter_wait %s) and the "
              "event goes back to the channel's pool, where the next send records it again (1 live event)", how,
              devshare_status_str(st));
        tell(&rig.k, "lease_opens");
        a = reply(&rig.k, rig.ch);
        CHECK(strcmp(a, "R 0") == 0, "cuda lease event (%s): the consumer closed its IPC mapping (%s)", how, a);
    }
    const CudaState s = cuda_state(&rig.k, rig.ch);
    CHECK(s.violations == 0, "cuda lease event: the consumer broke no driver rule (%d)", s.violations);
    CHECK(finish(&rig.k, rig.ch), "cuda lease event: the consumer exits cleanly");
    close_all(NULL, rig.exp, rig.ch, "cuda lease event");
    CHECK(live_events("cusi_e_") == 0, "cuda lease event: closing the channel destroys its pooled event");
    cuda_rig_free(&rig);
}

/* A devshare_channel_send_batch of 32 leases of one CUDA allocation with DEVSHARE_SHARE_EVENT: the
 * batch carries one interprocess event per stream (recorded once, waited on once by the consumer's
 * receive), the event goes back to the channel's pool when the leases return and the next batch
 * records it again instead of making another. */
static void test_a_cuda_batch_records_one_event_per_stream_and_the_next_batch_reuses_it(void) {
    /* Rounds 3 to 5 again with the export registered: round 3 pins its window in the consumer,
     * rounds 4 and 5 go as LEASE records (1.14), whose later leases of a stream say that they
     * carry the event record of its first. */
    enum { N = 32, ROUNDS = 6, REGISTERED = 3 };
    const int64_t len = 4096;
    const size_t size = (size_t)N * (size_t)len;
    CudaRig rig = cuda_rig(size, "cuda_batch", "cuda batch event");
    DevshareTensorDesc descs[N];
    const DevshareTensorDesc *dp[N];
    const DevshareExporter *ep[N];
    uint64_t seq = 2000;
    char names[2][512] = {"", ""};
    /* Rounds 0 and 1: every tensor on one rig.stream; then alternating between two. */
    for (int round = 0; round < ROUNDS && rig.peer; round++) {
        const int streams = round < 2 ? 1 : 2;
        if (round == REGISTERED) {
            DS_OK(devshare_channel_register(rig.ch, rig.exp));
        }
        for (int i = 0; i < N; i++) {
            item_fill((void *)(uintptr_t)(rig.dev + (CUdeviceptr)i * (CUdeviceptr)len), (uint64_t)len, ++seq);
            descs[i] = bytes_desc((uint64_t)i * (uint64_t)len, &len);
            descs[i].flags = DEVSHARE_SHARE_EVENT;
            descs[i].stream = streams == 2 && i % 2 ? NULL : rig.stream;
            dp[i] = &descs[i];
            ep[i] = rig.exp;
        }
        int32_t st = devshare_channel_send_batch(rig.ch, rig.peer, ep, dp, N);
        CHECK(st == DEVSHARE_STATUS_OK && outstanding_of(rig.exp) == N && live_events("cusi_e_") == streams,
              "cuda batch event, round %d: a batch of %d leases on %d stream(s) holds %d live event(s) (%d; %s)",
              round, N, streams, streams, live_events("cusi_e_"), devshare_status_str(st));
        if (round < 2) {
            live_event_names("cusi_e_", names[round], sizeof names[round]);
        }
        if (round == 1) {
            CHECK(names[0][0] != '\0' && strcmp(names[0], names[1]) == 0,
                  "cuda batch event, round 1: the batch reuses the first batch's event, recorded again (%s/ %s)",
                  names[0], names[1]);
        }
        tell(&rig.k, "recv %d 1 %d", N, IO_MS);
        const RecvResult r = recv_result(reply(&rig.k, rig.ch));
        CHECK(r.got == N && r.lease == N && r.data_bad == 0 && r.order_bad == 0,
              "cuda batch event, round %d: the consumer receives the %d leases in order and reads each back", round,
              N);
        CHECK(r.events == streams && r.waited == streams,
              "cuda batch event, round %d: the consumer's receive waited on each stream's event exactly once, and "
              "the other leases carry no second wait (%d with an event, %d waited once)", round, r.events, r.waited);
        tell(&rig.k, "release %d", N);
        const char *a = reply(&rig.k, rig.ch);
        st = devshare_exporter_wait(rig.exp, IO_MS);
        CHECK(st == DEVSHARE_STATUS_OK && outstanding_of(rig.exp) == 0 && live_events("cusi_e_") == streams,
              "cuda batch event, round %d: the leases come back (%s, %s) and the events stay in the channel's pool "
              "for the next batch (%d live)", round, a, devshare_status_str(st), live_events("cusi_e_"));
    }
    tell(&rig.k, "lease_opens");
    const char *pinned = reply(&rig.k, rig.ch);
    CHECK(strcmp(pinned, "R 1") == 0,
          "cuda batch event: the consumer keeps the registered allocation's window open between batches (%s)", pinned);
    DS_OK(devshare_channel_unregister(rig.ch, rig.exp));
    const CudaState s = cuda_state(&rig.k, rig.ch);
    CHECK(s.violations == 0, "cuda batch event: the consumer broke no driver rule (%d)", s.violations);
    CHECK(finish(&rig.k, rig.ch), "cuda batch event: the consumer exits cleanly");
    close_all(NULL, rig.exp, rig.ch, "cuda batch event");
    CHECK(live_events("cusi_e_") == 0, "cuda batch event: closing the channel destroys its pooled events");
    cuda_rig_free(&rig);
}

/* The channel's events are reused only for the consumer they were first sent to: a consumer
 * holds its events' handles and could record its own work on one, which would hold up whoever
 * waits on that event next. Two consumers, alternating sends: each gets its own event, reused
 * for it alone; a consumer that disconnects takes its idle events with it. */
static void test_a_cuda_event_is_reused_only_for_the_consumer_it_was_sent_to(void) {
    enum { N = 2 };
    const int64_t len = 4096;
    cuda_start();
    CUdeviceptr dev = 0;
    cu_or_die(cuMemAlloc(&dev, (size_t)N * (size_t)len), "cuMemAlloc");
    DevshareExporter *exp = NULL;
    DS_OK(devshare_export(DEVSHARE_BACKEND_CUDA, 0, (void *)(uintptr_t)dev, (size_t)N * (size_t)len, 0, &exp));
    char address[128];
    make_address(address, sizeof address, "cuda_event_peer");
    DevshareChannel *ch = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    g_cuda = 1;
    Child k[2] = {spawn_child("cuda", ""), spawn_child("cuda", "")};
    const uint64_t peer[2] = {connect_child(ch, &k[0], address, "cuda event per peer, consumer 0"),
                              connect_child(ch, &k[1], address, "cuda event per peer, consumer 1")};
    DevshareTensorDesc descs[N];
    const DevshareTensorDesc *dp[N];
    const DevshareExporter *ep[N];
    uint64_t seq = 7000;
    char first[512] = "";
    /* Rounds to consumers 0, 1, 0, 1: two events in all, each consumer's own. */
    for (int round = 0; round < 4 && peer[0] && peer[1]; round++) {
        const int who = round % 2;
        for (int i = 0; i < N; i++) {
            item_fill((void *)(uintptr_t)(dev + (CUdeviceptr)i * (CUdeviceptr)len), (uint64_t)len, ++seq);
            descs[i] = bytes_desc((uint64_t)i * (uint64_t)len, &len);
            descs[i].flags = DEVSHARE_SHARE_EVENT;
            dp[i] = &descs[i];
            ep[i] = exp;
        }
        const int32_t st = devshare_channel_send_batch(ch, peer[who], ep, dp, N);
        const int want = round == 0 ? 1 : 2;
        CHECK(st == DEVSHARE_STATUS_OK && live_events("cusi_e_") == want,
              "cuda event per peer, round %d: a batch to consumer %d makes %d live event(s) in all (%d; %s)", round,
              who, want, live_events("cusi_e_"), devshare_status_str(st));
        if (round == 0) {
            live_event_names("cusi_e_", first, sizeof first);
        }
        tell(&k[who], "recv %d 1 %d", N, IO_MS);
        const RecvResult r = recv_result(reply(&k[who], ch));
        CHECK(r.got == N && r.data_bad == 0 && r.events == 1 && r.waited == 1,
              "cuda event per peer, round %d: consumer %d receives its %d leases and waits on one event", round, who,
              N);
        tell(&k[who], "release %d", N);
        (void)reply(&k[who], ch);
        CHECK(devshare_exporter_wait(exp, IO_MS) == DEVSHARE_STATUS_OK,
              "cuda event per peer, round %d: the leases come back", round);
    }
    /* Consumer 1 goes: its idle event is destroyed; consumer 0's stays for its next batch. */
    CHECK(finish(&k[1], ch), "cuda event per peer: consumer 1 exits cleanly");
    for (int i = 0; i < 100 && live_events("cusi_e_") != 1; i++) {
        (void)devshare_channel_service(ch, 10);
    }
    char left[512] = "";
    live_event_names("cusi_e_", left, sizeof left);
    CHECK(live_events("cusi_e_") == 1 && strcmp(left, first) == 0,
          "cuda event per peer: a consumer that disconnects takes its idle event with it, the other's stays "
          "(%d live: %s, consumer 0's %s)", live_events("cusi_e_"), left, first);
    CHECK(finish(&k[0], ch), "cuda event per peer: consumer 0 exits cleanly");
    close_all(NULL, exp, ch, "cuda event per peer");
    CHECK(live_events("cusi_e_") == 0, "cuda event per peer: closing the channel destroys its pooled events");
    cu_or_die(cuMemFree(dev), "cuMemFree");
    g_cuda = 0;
}

/* One round of the fd-number reuse cases below: a 2-segment VMM buffer exported (and registered
 * when `registered`), its first 4096 bytes written as item `seq`, leased to `peer` and read by
 * the consumer with `recv_cmd` ("recv" or "recv2"); the lease back, then the export closed
 * without unregistering it and its memory freed. Returns the sequence number the consumer read;
 * `maps` (may be NULL): the consumer's VMM mappings once the lease was back. */
static long vmm_lease_round(DevshareChannel *ch, Child *k, uint64_t peer, const char *recv_cmd, int registered,
                            uint64_t seq, const char *what, int *maps) {
    enum { COUNT = 2 };
    const int64_t len = 4096;
    Vmm v;
    vmm_create(&v, COUNT);
    DevshareExporter *exp = NULL;
    DS_OK(devshare_export_segments(DEVSHARE_BACKEND_CUDA, 0, (void *)(uintptr_t)v.va, v.h, COUNT, SEG, 0, &exp));
    if (registered) {
        DS_OK(devshare_channel_register(ch, exp));
    }
    item_fill((void *)(uintptr_t)v.va, (uint64_t)len, seq);
    DevshareTensorDesc d = bytes_desc(0, &len);
    const int32_t st = devshare_channel_send(ch, peer, exp, &d);
    tell(k, "%s 1 0 %d", recv_cmd, IO_MS);
    const RecvResult r = recv_result(reply(k, ch));
    CHECK(st == DEVSHARE_STATUS_OK && r.got == 1 && r.data_bad == 0 && devshare_exporter_wait(exp, IO_MS) == 0,
          "%s reads its lease and gives it back (%s)", what, devshare_status_str(st));
    if (maps) {
        *maps = cuda_state(k, ch).maps;
    }
    CHECK(devshare_exporter_close(exp, 0) == DEVSHARE_STATUS_OK, "%s: the export closes", what);
    vmm_destroy(&v);
    return r.seq_sum;
}

/* A consumer keeps a registered export's allocation mapped between leases, and a segmented
 * CUDA export's mapping is known by its producer's pid and fd numbers. An export closed while
 * still registered (no devshare_channel_unregister) closes those fds, and the next export gets
 * the same numbers: the consumer must have let the old mapping go before a handle of the new
 * memory reaches it, or it would read the old memory under the new handle. The new export is
 * sent unregistered, so nothing but the close itself can have retired the old one. */
static void test_an_export_closed_while_registered_is_retired_before_its_fd_numbers_return(void) {
    cuda_start();
    char address[128];
    make_address(address, sizeof address, "cuda_retire_closed");
    DevshareChannel *ch = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    g_cuda = 1;
    Child k = spawn_child("cuda", "");
    const uint64_t peer = connect_child(ch, &k, address, "retire on close");
    long seen[2] = {0, 0};
    int idle[2] = {-1, -1};
    for (int round = 0; round < 2 && peer; round++) {
        char what[96];
        snprintf(what, sizeof what, "retire on close, round %d: the consumer of the %s export", round,
                 round == 0 ? "registered" : "unregistered");
        seen[round] = vmm_lease_round(ch, &k, peer, "recv", round == 0, 8000 + 1000 * (uint64_t)round, what,
                                      &idle[round]);
    }
    CHECK(idle[0] > 0, "retire on close: the consumer keeps the registered allocation mapped after its lease came "
                       "back (%d VMM mappings)", idle[0]);
    CHECK(seen[0] == 8000 && seen[1] == 9000,
          "retire on close: a lease of new memory, exported after a registered export was closed, shows the new "
          "values, not the old mapping's (%ld, then %ld)", seen[0], seen[1]);
    CHECK(finish(&k, ch), "retire on close: the consumer exits cleanly");
    close_all(NULL, NULL, ch, "retire on close");
    g_cuda = 0;
}

/* The same across two connections of one consumer process: the allocation a registered export
 * was is kept mapped for connection A; the export is closed (A is told, but has not read it
 * yet), and new memory that gets its fd numbers is sent to connection B. B must map what it
 * came with, not take A's kept mapping: nothing ordered A's news before B's share. */
static void test_a_mapping_kept_for_one_connection_is_not_taken_by_another_for_reused_fd_numbers(void) {
    cuda_start();
    char address[128];
    make_address(address, sizeof address, "cuda_kept_two_conns");
    DevshareChannel *ch = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    g_cuda = 1;
    Child k = spawn_child("cuda", "");
    const uint64_t peer_a = connect_child(ch, &k, address, "kept across connections");
    uint64_t ids[4];
    tell(&k, "connect2 %s %d", address, IO_MS);
    const char *a = reply(&k, ch);
    uint64_t peer_b = 0;
    for (int i = 0; i < 200 && peer_b == 0; i++) {
        (void)devshare_channel_service(ch, 10);
        const size_t n = peer_count(ch, ids, 4);
        for (size_t j = 0; j < n; j++) {
            if (ids[j] != peer_a) {
                peer_b = ids[j];
            }
        }
    }
    CHECK(peer_a && peer_b && strncmp(a, "R 0", 3) == 0,
          "kept across connections: one consumer process connects twice (%s)", a);
    long seen[2] = {0, 0};
    for (int round = 0; round < 2 && peer_a && peer_b; round++) {
        char what[96];
        snprintf(what, sizeof what, "kept across connections, round %d: connection %c", round, round == 0 ? 'A' : 'B');
        seen[round] = vmm_lease_round(ch, &k, round == 0 ? peer_a : peer_b, round == 0 ? "recv" : "recv2", round == 0,
                                      8000 + 1000 * (uint64_t)round, what, NULL);
    }
    CHECK(seen[0] == 8000 && seen[1] == 9000,
          "kept across connections: connection B, sent new memory under a closed registered export's fd numbers, "
          "reads the new values, not connection A's kept mapping (%ld, then %ld)", seen[0], seen[1]);
    CHECK(finish(&k, ch), "kept across connections: the consumer exits cleanly");
    close_all(NULL, NULL, ch, "kept across connections");
    g_cuda = 0;
}

/* A batch send of two tensors on two streams, run by another thread. */
typedef struct {
    DevshareChannel *ch;
    uint64_t peer;
    const DevshareExporter *ep[2];
    const DevshareTensorDesc *dp[2];
    int32_t st;
} RacingSend;

static void *racing_send(void *arg) {
    RacingSend *s = arg;
    cuda_make_current();
    s->st = devshare_channel_send_batch(s->ch, s->peer, s->ep, s->dp, 2);
    return NULL;
}

/* A consumer that goes while a send to it records its events (outside the channel's lock) must
 * not leave events behind: the channel destroys a gone consumer's events, but this send made its
 * second one after that, for a consumer no longer there. Each cuEventRecord is slowed to 300 ms;
 * the consumer is killed during the first, so the second event is made after the channel forgot
 * the consumer, and the failed send must destroy both, not keep them idle until the channel
 * closes. */
static void test_a_consumer_gone_while_its_send_records_events_leaves_no_event_behind(void) {
    const int64_t len = 4096;
    CudaRig rig = cuda_rig(2 * (size_t)len, "cuda_event_race", "cuda event race");
    CUstream second = NULL;
    cu_or_die(cuStreamCreate(&second, 0), "cuStreamCreate");
    DevshareTensorDesc d[2] = {bytes_desc(0, &len), bytes_desc((uint64_t)len, &len)};
    d[0].flags = d[1].flags = DEVSHARE_SHARE_EVENT;
    d[0].stream = rig.stream;
    d[1].stream = second;
    RacingSend s = {rig.ch, rig.peer, {rig.exp, rig.exp}, {&d[0], &d[1]}, DEVSHARE_STATUS_OK};
    CHECK(cusi_set_delay("cuEventRecord", 300) == 0, "cuda event race: the stand-in slows cuEventRecord");
    pthread_t t;
    CHECK(rig.peer && pthread_create(&t, NULL, racing_send, &s) == 0, "cuda event race: the sending thread starts");
    struct timespec nap = {0, 100 * 1000 * 1000};
    nanosleep(&nap, NULL); /* the send is in its first record */
    kill_child(&rig.k);
    uint64_t ids[4];
    for (int i = 0; i < 200 && peer_count(rig.ch, ids, 4) != 0; i++) {
        (void)devshare_channel_service(rig.ch, 10);
    }
    const size_t peers = peer_count(rig.ch, ids, 4);
    pthread_join(t, NULL);
    (void)cusi_set_delay("cuEventRecord", 0);
    CHECK(peers == 0 && s.st != DEVSHARE_STATUS_OK,
          "cuda event race: the consumer is gone before the send's events are made, and the send fails (%s, %zu "
          "peers)", devshare_status_str(s.st), peers);
    CHECK(live_events("cusi_e_") == 0,
          "cuda event race: the failed send leaves none of its events alive for the gone consumer (%d live)",
          live_events("cusi_e_"));
    CHECK(outstanding_of(rig.exp) == 0, "cuda event race: the failed send left no lease outstanding (%llu)",
          (unsigned long long)outstanding_of(rig.exp));
    close_all(NULL, rig.exp, rig.ch, "cuda event race");
    cu_or_die(cuStreamDestroy(second), "cuStreamDestroy");
    cuda_rig_free(&rig);
}

/* A leased devshare_channel_send of an ACL export with DEVSHARE_SHARE_EVENT: no
 * devshare_exporter_allow_pid call, the handshake whitelists the consumer. */
static void test_an_acl_lease_event_is_waited_on_and_kept_until_the_lease_returns(void) {
    const size_t size = 2u << 20;
    const aclError init = aclInit(NULL);
    if (init != ACL_SUCCESS && init != ACL_ERROR_REPEAT_INITIALIZE) {
        acl_or_die(init, "aclInit");
    }
    acl_or_die(aclrtSetDevice(0), "aclrtSetDevice(0)");
    void *dev = NULL;
    acl_or_die(aclrtMalloc(&dev, size, ACL_MEM_MALLOC_HUGE_FIRST), "aclrtMalloc");
    DevshareExporter *exp = NULL;
    DS_OK(devshare_export(DEVSHARE_BACKEND_ACL, 0, dev, size, 0, &exp));
    char address[128];
    make_address(address, sizeof address, "acl_event");
    DevshareChannel *ch = NULL;
    DS_OK(devshare_channel_listen(address, &ch));
    /* The stand-in models a container: a consumer's bare tgid is not its pid here. */
    DS_OK(devshare_channel_trust_announced_pids(ch, 1));
    g_acl = 1;
    Child k = spawn_child("acl", "");
    const uint64_t peer = connect_child(ch, &k, address, "acl lease event");
    aclrtStream stream = NULL;
    acl_or_die(aclrtCreateStream(&stream), "aclrtCreateStream");
    const int64_t len = 65536;
    item_fill((uint8_t *)dev + 4096, (uint64_t)len, 903);
    DevshareTensorDesc d = bytes_desc(4096, &len);
    d.flags = DEVSHARE_SHARE_EVENT;
    d.stream = stream;
    int32_t st = peer ? devshare_channel_send(ch, peer, exp, &d) : DEVSHARE_STATUS_NOT_FOUND;
    CHECK(st == DEVSHARE_STATUS_OK && outstanding_of(exp) == 1 && live_events("aclsi_e_") == 1,
          "acl lease event: devshare_channel_send of an ACL export with DEVSHARE_SHARE_EVENT; the lease is "
          "outstanding and the producer holds its event (%s)", devshare_status_str(st));
    tell(&k, "recv 1 1 %d", IO_MS);
    const RecvResult r = recv_result(reply(&k, ch));
    CHECK(r.got == 1 && r.lease == 1 && r.data_bad == 0,
          "acl lease event: the consumer, never named with devshare_exporter_allow_pid, imports the lease and reads "
          "it back (whitelisted through the handshake)");
    CHECK(r.events == 1 && r.waited == 1,
          "acl lease event: recv had waited on the lease's IPC event exactly once when it returned (%d events, %d "
          "waited once)", r.events, r.waited);
    devshare_channel_service(ch, 0);
    CHECK(live_events("aclsi_e_") == 1 && outstanding_of(exp) == 1,
          "acl lease event: the producer keeps the event while the consumer holds the lease");
    tell(&k, "release 1");
    const char *a = reply(&k, ch);
    st = devshare_exporter_wait(exp, IO_MS);
    CHECK(strcmp(a, "R 1 0") == 0 && st == DEVSHARE_STATUS_OK && outstanding_of(exp) == 0 &&
              live_events("aclsi_e_") == 1,
          "acl lease event: the release brings the lease back (devshare_exporter_wait %s) and the event goes back "
          "to the channel's pool (1 live event)", devshare_status_str(st));
    CHECK(finish(&k, ch), "acl lease event: the consumer exits cleanly");
    close_all(NULL, exp, ch, "acl lease event");
    CHECK(live_events("aclsi_e_") == 0, "acl lease event: closing the channel destroys its pooled event");
    acl_or_die(aclrtDestroyStream(stream), "aclrtDestroyStream");
    acl_or_die(aclrtFree(dev), "aclrtFree");
    g_acl = 0;
}

int main(int argc, char **argv) {
    if (argc > 2 && strcmp(argv[1], "--child") == 0) {
        if (strcmp(argv[2], "producer") == 0) {
            return producer_child(argc > 3 ? argv[3] : "");
        }
        g_acl = strcmp(argv[2], "acl") == 0;
        g_cuda = strcmp(argv[2], "cuda") == 0;
        return consumer_child();
    }
    if (!getenv("DEVSHARE_ACL_LIBRARY") || !getenv("DEVSHARE_CUDA_LIBRARY")) {
        fprintf(stderr, "test_channel: set DEVSHARE_ACL_LIBRARY and DEVSHARE_CUDA_LIBRARY to the stand-ins "
                        "(libascendcl.so, libcuda.so.1)\n");
        return 2;
    }
    harness_start("test_channel");
    signal(SIGPIPE, SIG_IGN); /* a write to a dead child's pipe is an error, not our death */
    track(getpid());

    test_channel_calls_refuse_null_and_out_of_range_arguments();
    test_a_host_pool_carries_10000_items_through_8_slots_at_fixed_addresses();
    test_pool_acquire_times_out_or_blocks_until_the_consumer_gives_a_slot_back();
    test_one_pool_serves_two_consumers_each_its_own_items();
    test_slot_misuse_is_refused_and_a_departed_consumers_slots_come_back();
    test_leases_stay_outstanding_until_released_or_their_holder_is_killed();
    test_a_killed_producer_closes_the_connection_and_imports_stay_readable();
    test_a_channel_host_allocation_is_a_sealed_memfd_that_cannot_be_resized();
    test_a_consumer_running_as_another_uid_is_refused();
    test_restrict_refuses_a_consumer_left_off_its_pid_or_uid_list();
    test_an_acl_pool_reaches_its_channel_consumer_but_not_a_process_outside_the_channel();
    test_an_acl_lease_event_is_waited_on_and_kept_until_the_lease_returns();
    test_a_cuda_segment_pool_passes_its_fds_over_the_channel_and_detaches_on_close();
    test_a_cuda_lease_event_is_waited_on_once_and_kept_until_the_lease_returns();
    test_past_128_events_out_with_one_consumer_a_cuda_send_synchronises_instead();
    test_a_cuda_batch_records_one_event_per_stream_and_the_next_batch_reuses_it();
    test_a_cuda_event_is_reused_only_for_the_consumer_it_was_sent_to();
    test_a_consumer_gone_while_its_send_records_events_leaves_no_event_behind();
    test_an_export_closed_while_registered_is_retired_before_its_fd_numbers_return();
    test_a_mapping_kept_for_one_connection_is_not_taken_by_another_for_reused_fd_numbers();

    int left = 0;
    for (int i = 0; i < n_tracked; i++) {
        left += shm_names_of(tracked[i], 0);
    }
    CHECK(left == 0, "no /dev/shm object carries the pid of this test or of a host or CUDA consumer (%d)", left);
    harness_check_log(aclsi_violation_count() + cusi_violation_count(), "the ACL and CUDA stand-ins");
    return harness_done();
}
