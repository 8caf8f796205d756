// SPDX-License-Identifier: Apache-2.0
//
// test_raii_channel: devshare.hpp's channels, connections and pools (Channel, Connection, Pool,
// Slot, Import::pool_slot, Exporter::channel_host_alloc), built with exceptions. The parent is
// the producer; each case forks its consumer before the producer's channel exists (so the child
// holds none of the producer's descriptors), drives it over a pipe and records the checks it
// reports.
//
//  - type traits: Channel, Connection, Pool and Slot are move-only with noexcept moves and
//    destructors;
//  - in one process: errors are devshare::Error with the library's status and message (a socket
//    path that exists: BUSY; nothing listening: NOT_FOUND; slots beyond the export and count 0:
//    INVALID_ARGUMENT; share(bytes()) of a channel_host_alloc export: UNSUPPORTED; an unknown
//    peer: NOT_FOUND); the try_ forms return them; the socket file is mode 0600 and ~Channel
//    removes it; wait_peers without a consumer is false, not an error; Channel::send of an
//    address outside the exporter's range or of a description with too many dimensions is
//    refused by the header, naming Channel::send (and the range);
//  - Slot: ~Slot gives an acquired, unsent slot back (free count back up), so does a move
//    assignment over it; Pool::release; with every slot out acquire gives an empty Slot; a send
//    of an empty Slot, of another pool's Slot, of an address outside the slot, of a misaligned
//    offset or of too many dimensions is refused by the header (naming Pool::send), a send to an
//    unknown peer by the library, and the Slot stays acquired; disown() hands the index to the C
//    API; Import::pool_slot of other imports is refused;
//  - pool round trip: 1000 items through 4 slots, producer and consumer in separate processes;
//    on both sides each slot keeps one address (slot k at base + k * slot_size), the data
//    written by the producer arrives in order, every slot comes home;
//  - lease: Channel::send(peer, exp, describe(p, {2, 8})) of a float tensor: exporter outstanding 1 (peer_info leases 1) while
//    the consumer holds the Import, 0 once it destroyed it (Exporter::wait serves the channel);
//    the Import is not a pool item; recv(0ms) with nothing queued is an empty Import;
//  - a consumer that drops its Connection while it holds two pool slots and a lease: the
//    producer gets the slots and the lease back, the peer is gone, the consumer's Imports still
//    read;
//  - producer close: the consumer still receives what was queued, then recv throws
//    devshare::Error with DEVSHARE_STATUS_CLOSED and try_recv returns that status; the Import
//    stays readable; the closed channel's lease no longer counts; a Pool outliving its Channel
//    answers CLOSED.
//
// Sends are spelled the one way: ch.send(peer, exp, desc) / pool.send(slot, peer, desc) with desc
// from devshare::describe(...), describe_at<T>(...) or bytes(). Builds as C++17 and as C++23
// (Result is then std::expected: r.error() is read only after a failure). Prints "ok - ..." /
// "FAIL - ..." per case (the consumer's checks prefixed "consumer:"); exit status 0 when all
// passed.

#include "devshare.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using std::chrono::milliseconds;

int n_cases = 0;
int n_failed = 0;

bool check(bool ok, const std::string& what) {
    n_cases++;
    std::printf("%s - %s\n", ok ? "ok" : "FAIL", what.c_str());
    std::fflush(stdout);
    if (!ok) {
        n_failed++;
    }
    return ok;
}

// Runs `f`, which must throw devshare::Error with `status` and a message starting with `prefix`.
template <typename F>
void expect_message(int32_t status, const std::string& prefix, const std::string& what, F&& f) {
    try {
        f();
        check(false, what + ": no exception");
    } catch (const devshare::Error& e) {
        const std::string msg = e.what();
        const bool ok = e.status() == status && msg.rfind(prefix, 0) == 0;
        check(ok, what + " throws devshare::Error(" + devshare_status_str(status) + ")");
        if (!ok) {
            std::printf("    got status %d: %s\n", static_cast<int>(e.status()), e.what());
        }
    } catch (const std::exception& e) {
        check(false, what + ": unexpected exception " + e.what());
    }
}

// Runs `f`, which must throw devshare::Error with `status` and a message starting with
// `function` + ":".
template <typename F>
void expect_error(int32_t status, const char* function, const std::string& what, F&& f) {
    expect_message(status, std::string(function) + ":", what, std::forward<F>(f));
}

// `r` failed with `status` (error() is read only after a failure: with std::expected it has no
// Error otherwise).
template <typename R>
bool failed_with(const R& r, int32_t status) {
    return !r.has_value() && r.error().status() == status;
}

// The bound on every wait for the other process (a failure, not a measurement, when reached).
constexpr milliseconds kWait{20000};

// An abstract socket name carrying this process's pid.
std::string address(const char* what) {
    return "@devshare_test_raii_channel_" + std::to_string(getpid()) + "_" + what;
}

// Serve `ch` until `done()` holds; false when kWait passed first.
template <typename P>
bool serve_until(devshare::Channel& ch, P&& done) {
    const auto deadline = std::chrono::steady_clock::now() + kWait;
    while (!done()) {
        if (std::chrono::steady_clock::now() >= deadline) {
            return false;
        }
        ch.service(milliseconds(50));
    }
    return true;
}

// The consumer's side of the pipes: commands come as single bytes, checks go back as
// "1 what" / "0 what" lines; "." ends a report.
class Consumer {
public:
    Consumer(int cmd, int rep) : cmd_(cmd), rep_(rep) {}

    // The parent's next command (0 when the parent is gone).
    char next() {
        char c = 0;
        ssize_t n;
        do {
            n = read(cmd_, &c, 1);
        } while (n < 0 && errno == EINTR);
        return n == 1 ? c : 0;
    }
    bool check(bool ok, const std::string& what) {
        pending_ += (ok ? "1 " : "0 ") + what + "\n";
        return ok;
    }
    void report() {
        pending_ += ".\n";
        size_t off = 0;
        while (off < pending_.size()) {
            const ssize_t n = write(rep_, pending_.data() + off, pending_.size() - off);
            if (n < 0 && errno == EINTR) {
                continue;
            }
            if (n <= 0) {
                break;
            }
            off += static_cast<size_t>(n);
        }
        pending_.clear();
    }

private:
    int cmd_;
    int rep_;
    std::string pending_;
};

// A forked consumer process running `body`.
class Child {
public:
    template <typename F>
    explicit Child(F&& body) {
        int cmd[2];
        int rep[2];
        if (pipe(cmd) != 0 || pipe(rep) != 0) {
            std::perror("pipe");
            std::exit(2);
        }
        std::fflush(stdout);
        std::fflush(stderr);
        pid_ = fork();
        if (pid_ < 0) {
            std::perror("fork");
            std::exit(2);
        }
        if (pid_ == 0) {
            close(cmd[1]);
            close(rep[0]);
            int rc = 0;
            {
                Consumer me(cmd[0], rep[1]);
                try {
                    body(me);
                } catch (const std::exception& e) {
                    me.check(false, std::string("unexpected exception: ") + e.what());
                    me.report();
                    rc = 1;
                }
            }
            _exit(rc);
        }
        close(cmd[0]);
        close(rep[1]);
        cmd_ = cmd[1];
        rep_ = fdopen(rep[0], "r");
    }
    Child(const Child&) = delete;
    Child& operator=(const Child&) = delete;
    ~Child() {
        (void)wait();
        if (rep_ != nullptr) {
            std::fclose(rep_);
        }
    }

    [[nodiscard]] pid_t pid() const { return pid_; }

    void tell(char c) {
        ssize_t n;
        do {
            n = write(cmd_, &c, 1);
        } while (n < 0 && errno == EINTR);
    }

    // Reads the consumer's next report and records its checks here; false when it ended first.
    bool take_report() {
        char line[1024];
        while (std::fgets(line, sizeof line, rep_) != nullptr) {
            std::string s(line);
            if (!s.empty() && s.back() == '\n') {
                s.pop_back();
            }
            if (s == ".") {
                return true;
            }
            check(s.size() > 2 && s[0] == '1', "consumer: " + (s.size() > 2 ? s.substr(2) : s));
        }
        return check(false, "consumer: ended before its report");
    }

    // Tells the consumer to finish (any command it waits for ends it), then waits for it: its
    // exit status (-1 when it did not exit normally).
    int wait() {
        if (pid_ <= 0) {
            return status_;
        }
        if (cmd_ >= 0) {
            close(cmd_);
            cmd_ = -1;
        }
        int st = 0;
        while (waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
        }
        pid_ = 0;
        status_ = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        return status_;
    }

private:
    pid_t pid_ = 0;
    int cmd_ = -1;
    FILE* rep_ = nullptr;
    int status_ = -1;
};

// ---------------------------------------------------------------------------------------------

static_assert(!std::is_copy_constructible<devshare::Channel>::value, "Channel is move-only");
static_assert(!std::is_copy_assignable<devshare::Channel>::value, "Channel is move-only");
static_assert(std::is_nothrow_move_constructible<devshare::Channel>::value, "Channel moves are noexcept");
static_assert(std::is_nothrow_move_assignable<devshare::Channel>::value, "Channel moves are noexcept");
static_assert(std::is_nothrow_destructible<devshare::Channel>::value, "~Channel never throws");
static_assert(!std::is_copy_constructible<devshare::Connection>::value, "Connection is move-only");
static_assert(std::is_nothrow_move_constructible<devshare::Connection>::value, "Connection moves are noexcept");
static_assert(std::is_nothrow_move_assignable<devshare::Connection>::value, "Connection moves are noexcept");
static_assert(std::is_nothrow_destructible<devshare::Connection>::value, "~Connection never throws");
static_assert(!std::is_copy_constructible<devshare::Pool>::value, "Pool is move-only");
static_assert(std::is_nothrow_move_constructible<devshare::Pool>::value, "Pool moves are noexcept");
static_assert(std::is_nothrow_move_assignable<devshare::Pool>::value, "Pool moves are noexcept");
static_assert(std::is_nothrow_destructible<devshare::Pool>::value, "~Pool never throws");
static_assert(!std::is_copy_constructible<devshare::Slot>::value, "Slot is move-only");
static_assert(!std::is_copy_assignable<devshare::Slot>::value, "Slot is move-only");
static_assert(std::is_nothrow_move_constructible<devshare::Slot>::value, "Slot moves are noexcept");
static_assert(std::is_nothrow_move_assignable<devshare::Slot>::value, "Slot moves are noexcept");
static_assert(std::is_nothrow_destructible<devshare::Slot>::value, "~Slot never throws");
static_assert(std::is_nothrow_default_constructible<devshare::Slot>::value, "an empty Slot is free");
static_assert(devshare::detail::timeout_ms(devshare::kForever) == -1 &&
                  devshare::detail::timeout_ms(milliseconds(-5)) == -1 &&
                  devshare::detail::timeout_ms(std::chrono::hours(24 * 365)) == INT32_MAX &&
                  devshare::detail::timeout_ms(std::chrono::seconds(2)) == 2000,
              "timeouts: negative is forever, longer than int32_t milliseconds is cut");

bool file_exists(const std::string& path) {
    struct stat st;
    return stat(path.c_str(), &st) == 0;
}

void test_channel_and_pool_misuse_is_refused_in_one_process() {
    const char* tmp = std::getenv("TMPDIR");
    const std::string path = std::string(tmp != nullptr && tmp[0] != '\0' ? tmp : "/tmp") +
                             "/devshare_test_raii_channel_" + std::to_string(getpid()) + ".sock";
    const int fd = open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY, 0600);
    check(fd >= 0, "a plain file at the socket path (made by this test)");
    if (fd >= 0) {
        close(fd);
        expect_error(DEVSHARE_STATUS_BUSY, "devshare_channel_listen", "Channel::listen on an existing file",
                     [&] { (void)devshare::Channel::listen(path); });
        (void)unlink(path.c_str());
    }
    {
        devshare::Channel ch = devshare::Channel::listen(path);
        struct stat st;
        check(stat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode) && (st.st_mode & 0777) == 0600 && ch.fd() >= 0,
              "Channel::listen(path): a socket file of mode 0600, fd() a descriptor");
        devshare::Channel moved = std::move(ch);
        check(!ch && moved && ch.get() == nullptr && ch.fd() == -1, "a moved-from Channel is empty (fd() -1)");
    }
    check(!file_exists(path), "~Channel removed its socket file");

    expect_error(DEVSHARE_STATUS_NOT_FOUND, "devshare_channel_connect", "Connection::connect where nothing listens",
                 [] { (void)devshare::Connection::connect(address("nothing"), milliseconds(0)); });
    const devshare::Result<devshare::Connection> none = devshare::Connection::try_connect(address("nothing"), kWait);
    check(failed_with(none, DEVSHARE_STATUS_NOT_FOUND), "Connection::try_connect: the same as a Result");

    devshare::Channel ch = devshare::Channel::listen(address("local"));
    check(ch.peers().empty() && !ch.wait_peers(1, milliseconds(0)) && ch.wait_peers(0, milliseconds(0)),
          "no consumer: peers() empty, wait_peers(1, 0ms) false (not an error), wait_peers(0) true");
    ch.service(milliseconds(0));
    ch.restrict({static_cast<uint32_t>(geteuid())}, {});
    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_channel_restrict", "restrict to pid 0",
                 [&] { ch.restrict({}, {0}); });
    expect_error(DEVSHARE_STATUS_NOT_FOUND, "devshare_channel_peer_info", "peer_info of an unknown peer",
                 [&] { (void)ch.peer_info(12345); });
    expect_error(DEVSHARE_STATUS_NOT_FOUND, "devshare_channel_disconnect", "disconnect of an unknown peer",
                 [&] { ch.disconnect(12345); });
    check(ch.try_trust_announced_pids(true) && ch.try_trust_announced_pids(false).has_value(),
          "trust_announced_pids(true / false) succeed");

    devshare::Exporter exp = devshare::Exporter::channel_host_alloc(4096);
    const unsigned char* bytes = static_cast<const unsigned char*>(exp.data());
    bool zero = bytes != nullptr;
    for (size_t i = 0; zero && i < 4096; i++) {
        zero = bytes[i] == 0;
    }
    check(zero && exp.size() == 4096, "Exporter::channel_host_alloc: 4096 zeroed bytes at data()");
    expect_error(DEVSHARE_STATUS_UNSUPPORTED, "devshare_exporter_share", "share(bytes()) of a channel_host_alloc export",
                 [&] { (void)exp.share(devshare::bytes()); });
    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_pool_create", "Pool::create of 5 x 1024 in 4096 bytes",
                 [&] { (void)devshare::Pool::create(ch, exp, 1024, 5); });
    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare_pool_create", "Pool::create with count 0",
                 [&] { (void)devshare::Pool::create(ch, exp, 1024, 0); });
    const devshare::Result<void> unknown = ch.try_send(777, exp, devshare::bytes());
    check(failed_with(unknown, DEVSHARE_STATUS_NOT_FOUND) &&
              std::strncmp(unknown.error().what(), "devshare_channel_send:", 22) == 0,
          "Channel::try_send(777, exp, bytes()) to an unknown peer: NOT_FOUND as a Result");
    expect_message(DEVSHARE_STATUS_INVALID_ARGUMENT,
                   "devshare::Channel::send: the first element's address is outside the range [data(), data() + 4096)",
                   "Channel::send of an address outside the exporter's range",
                   [&] { ch.send(1, exp, devshare::describe(static_cast<const float*>(exp.data()) + 5000, {4})); });
    expect_message(DEVSHARE_STATUS_BAD_NDIM,
                   "devshare::Channel::send: devshare::TensorDesc: more dimensions than DEVSHARE_MAX_NDIM",
                   "Channel::send of a 9-d description",
                   [&] { ch.send(1, exp, devshare::describe<float>(exp.data(), {1, 1, 1, 1, 1, 1, 1, 1, 1})); });
    check(exp.outstanding() == 0, "failed sends lease nothing");

    // Slots.
    devshare::Pool pool = devshare::Pool::create(ch, exp, 1024, 2);
    check(pool && pool.slot_size() == 1024 && pool.count() == 2 && pool.info().free_slots == 2 &&
              pool.info().slot_size == 1024 && pool.info().count == 2,
          "Pool::create: slot_size(), count() and info() say 2 free slots of 1024 bytes");
    {
        devshare::Slot s = pool.acquire(milliseconds(0));
        check(s && s.size() == 1024 && s.index() < 2 && s.pool() == pool.get() &&
                  s.data() == static_cast<char*>(exp.data()) + s.index() * 1024 && pool.info().free_slots == 1,
              "Pool::acquire: a Slot at data() + index * slot_size; one slot left free");
    }
    check(pool.info().free_slots == 2, "~Slot gives an acquired, unsent slot back (free_slots 1 -> 2)");
    devshare::Slot a = pool.acquire(milliseconds(0));
    devshare::Slot b = pool.acquire(milliseconds(0));
    check(a && b && a.index() != b.index() && pool.info().free_slots == 0, "two acquires take both slots");
    const devshare::Slot none_free = pool.acquire(milliseconds(0));
    const devshare::Result<devshare::Slot> later = pool.try_acquire(milliseconds(20));
    check(!none_free && later && !*later, "every slot out: acquire gives an empty Slot after the timeout (no error)");
    a = std::move(b);
    check(a && !b && pool.info().free_slots == 1, "a move assignment gives back the slot it replaces");
    pool.release(a);
    check(!a && pool.info().free_slots == 2, "Pool::release gives it back and empties the Slot");
    pool.release(a);  // an empty Slot: nothing
    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare::Pool::send", "Pool::send of an empty Slot",
                 [&] { pool.send(a, 1, devshare::bytes()); });

    devshare::Exporter exp2 = devshare::Exporter::channel_host_alloc(2048);
    devshare::Pool other = devshare::Pool::create(ch, exp2, 1024, 2);
    devshare::Slot foreign = other.acquire(milliseconds(0));
    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare::Pool::send", "Pool::send of another pool's Slot",
                 [&] { pool.send(foreign, 1, devshare::bytes()); });
    expect_error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare::Pool::release", "Pool::release of another pool's Slot",
                 [&] { pool.release(foreign); });
    check(foreign && other.info().free_slots == 1, "the other pool's Slot stays acquired");

    devshare::Slot s = pool.acquire(milliseconds(0));
    expect_message(DEVSHARE_STATUS_INVALID_ARGUMENT,
                   "devshare::Pool::send: the first element's address is outside the range [data(), data() + 1024)",
                   "Pool::send of an address outside the slot",
                   [&] { pool.send(s, 1, devshare::describe(s.data<float>() + 300, {4})); });
    expect_message(DEVSHARE_STATUS_INVALID_ARGUMENT,
                   "devshare::Pool::send: the first element (byte 2) is not a whole number of 4-byte elements",
                   "Pool::send of describe_at<float> a misaligned offset",
                   [&] { pool.send(s, 1, devshare::describe_at<float>(2, {4})); });
    expect_message(DEVSHARE_STATUS_BAD_NDIM,
                   "devshare::Pool::send: devshare::TensorDesc: more dimensions than DEVSHARE_MAX_NDIM",
                   "Pool::send of a 9-d description",
                   [&] { pool.send(s, 1, devshare::describe(s.data<float>(), {1, 1, 1, 1, 1, 1, 1, 1, 1})); });
    const devshare::Result<void> no_peer = pool.try_send(s, 777, devshare::describe(s.data<int32_t>(), {16}));
    check(failed_with(no_peer, DEVSHARE_STATUS_NOT_FOUND) && s && pool.info().free_slots == 1,
          "Pool::try_send to an unknown peer: NOT_FOUND, the Slot stays acquired");
    const uint32_t idx = s.disown();
    check(!s && devshare_pool_release(pool.get(), idx) == DEVSHARE_STATUS_OK && pool.info().free_slots == 2,
          "Slot::disown leaves the slot acquired for the C API");

    devshare::Exporter plain = devshare::Exporter::host_alloc(64);
    const devshare::Import imp = devshare::Import::from(plain.share(devshare::bytes()));
    const devshare::Result<devshare::PoolSlot> not_item = imp.try_pool_slot();
    check(failed_with(not_item, DEVSHARE_STATUS_INVALID_ARGUMENT) &&
              failed_with(devshare::Import().try_pool_slot(), DEVSHARE_STATUS_NULL_ARGUMENT),
          "Import::pool_slot of a handle's import: INVALID_ARGUMENT; of an empty Import: NULL_ARGUMENT");
}

// 1000 items through 4 slots between two processes.
void test_1000_pool_items_arrive_in_order_at_fixed_slot_addresses() {
    constexpr uint32_t kSlots = 4;
    constexpr uint64_t kSlotSize = 4096;
    constexpr int kItems = 1000;
    constexpr int kInts = 64;
    const std::string addr = address("pool");

    Child child([&](Consumer& me) {
        me.next();
        devshare::Connection conn = devshare::Connection::connect(addr, kWait);
        std::map<uint32_t, const void*> first_seen;
        uint32_t pool_id = 0;
        int got = 0, not_pool = 0, other_pool = 0, moved = 0, off_base = 0, bad_data = 0;
        uintptr_t base = 0;
        for (int i = 0; i < kItems; i++) {
            devshare::Import item = conn.recv(kWait);
            if (!item) {
                break;
            }
            got++;
            const devshare::Result<devshare::PoolSlot> ps = item.try_pool_slot();
            if (!ps) {
                not_pool++;
                continue;
            }
            if (pool_id == 0) {
                pool_id = ps->pool;
            }
            other_pool += ps->pool != pool_id;
            const uintptr_t at = reinterpret_cast<uintptr_t>(item.data());
            if (base == 0) {
                base = at - ps->slot * kSlotSize;
            }
            off_base += at != base + ps->slot * kSlotSize;
            auto seen = first_seen.emplace(ps->slot, item.data());
            moved += seen.first->second != item.data();
            const devshare::TensorView<const int32_t> v = item.as<const int32_t>();
            bool ok = v.shape().size() == 1 && v.shape()[0] == kInts;
            for (int k = 0; ok && k < kInts; k++) {
                ok = v(k) == i * 131 + k;
            }
            bad_data += !ok;
        }  // each Import destroyed here: its slot goes back
        me.check(got == kItems, "received " + std::to_string(got) + " of " + std::to_string(kItems) + " items");
        me.check(not_pool == 0 && other_pool == 0 && pool_id > 0,
                 "every item is a pool item of one pool (Import::pool_slot, pool id > 0)");
        me.check(first_seen.size() == kSlots, "all " + std::to_string(kSlots) + " slots arrived");
        me.check(moved == 0 && off_base == 0,
                 "each slot kept one address over 1000 items (slot k at base + k * slot_size)");
        me.check(bad_data == 0, "each item holds what the producer wrote, in order (int32 [64])");
        me.check(conn.producer_pid() == getppid() && conn.peer_id() > 0,
                 "Connection::producer_pid is the producer's pid, peer_id an id");
        me.report();
        me.next();
    });

    devshare::Channel ch = devshare::Channel::listen(addr);
    child.tell('g');
    check(ch.wait_peers(1, kWait), "pool: wait_peers(1) sees the consumer");
    const std::vector<uint64_t> peers = ch.peers();
    check(peers.size() == 1 && peers[0] > 0, "peers(): one id");
    if (peers.size() != 1) {
        return;
    }
    const uint64_t peer = peers[0];
    const DevsharePeerInfo info = ch.peer_info(peer);
    check(info.id == peer && info.pid == child.pid() && info.uid == geteuid() && info.leases == 0,
          "peer_info: the consumer's id, pid and uid, no leases yet");

    devshare::Exporter exp = devshare::Exporter::channel_host_alloc(kSlots * kSlotSize);
    devshare::Pool pool = devshare::Pool::create(ch, exp, kSlotSize, kSlots);
    check(pool.id() > 0 && failed_with(devshare::Pool().try_id(), DEVSHARE_STATUS_NULL_ARGUMENT),
          "Pool::id: an id; an empty Pool has none");
    char* const base = static_cast<char*>(exp.data());
    int sent = 0;
    int off_base = 0;
    int not_emptied = 0;
    for (int i = 0; i < kItems; i++) {
        devshare::Slot slot = pool.acquire(kWait);  // waits (serving the channel) while all 4 are out
        if (!slot) {
            break;
        }
        off_base += slot.data() != base + slot.index() * kSlotSize;
        int32_t* v = slot.data<int32_t>();
        for (int k = 0; k < kInts; k++) {
            v[k] = i * 131 + k;
        }
        pool.send(slot, peer, devshare::describe(v, {kInts}));
        not_emptied += static_cast<bool>(slot);
        sent++;
    }
    check(sent == kItems && off_base == 0 && not_emptied == 0,
          "1000 slots acquired and sent: each at data() + index * slot_size, the Slot empty after send");
    child.take_report();
    check(serve_until(ch, [&] { return pool.info().free_slots == kSlots; }),
          "every slot came home once the consumer destroyed its Imports (free_slots == count)");
    check(child.wait() == 0, "the consumer exited normally");
}

// One leased reference: outstanding 1 while the consumer holds it, 0 after.
void test_a_lease_is_outstanding_until_the_consumer_destroys_its_import() {
    const std::string addr = address("lease");
    constexpr int kRows = 2;
    constexpr int kCols = 8;
    constexpr int kFirst = 4;

    Child child([&](Consumer& me) {
        me.next();
        devshare::Connection conn = devshare::Connection::connect(addr, kWait);
        me.check(conn.fd() >= 0, "Connection::fd() is a descriptor");
        const devshare::Import nothing = conn.recv(milliseconds(0));
        me.check(!nothing, "recv(0ms) with nothing queued: an empty Import (a timeout is not an error)");
        me.report();
        me.next();
        devshare::Import item = conn.recv(kWait);
        me.check(static_cast<bool>(item), "received the leased item");
        if (item) {
            const devshare::Result<devshare::PoolSlot> ps = item.try_pool_slot();
            me.check(failed_with(ps, DEVSHARE_STATUS_INVALID_ARGUMENT),
                     "a lease is not a pool item (Import::try_pool_slot: INVALID_ARGUMENT)");
            const devshare::TensorView<const float> v = item.as<const float>();
            me.check(v.shape().size() == 2 && v.shape()[0] == kRows && v.shape()[1] == kCols && v(0, 0) == kFirst + 0.5f &&
                         v(1, 7) == kFirst + 15 + 0.5f,
                     "Import::as<const float>(): the [2, 8] tensor the producer sent");
        }
        me.report();
        me.next();
        item = devshare::Import();  // the move assignment releases the import: the lease goes back
        me.check(!item, "the Import destroyed");
        me.report();
        me.next();
    });

    devshare::Channel ch = devshare::Channel::listen(addr);
    child.tell('g');
    check(ch.wait_peers(1, kWait), "lease: wait_peers(1) sees the consumer");
    child.take_report();
    const uint64_t peer = ch.peers().at(0);

    devshare::Exporter exp = devshare::Exporter::channel_host_alloc(4096);
    float* t = static_cast<float*>(exp.data());
    for (int i = 0; i < 64; i++) {
        t[i] = static_cast<float>(i) + 0.5f;
    }
    ch.send(peer, exp, devshare::describe(t + kFirst, {kRows, kCols}));
    check(exp.outstanding() == 1 && ch.peer_info(peer).leases == 1,
          "Channel::send(peer, exp, describe(p, {2, 8})): one leased reference outstanding (peer_info leases 1)");
    child.tell('r');
    child.take_report();
    check(!exp.wait(milliseconds(0)) && exp.outstanding() == 1,
          "while the consumer holds the Import: wait(0ms) false, outstanding 1");
    child.tell('d');
    child.take_report();
    check(exp.wait(kWait) && exp.outstanding() == 0 && ch.peer_info(peer).leases == 0,
          "after the consumer's Import is destroyed: wait() (serving the channel) true, outstanding 0");
    check(child.wait() == 0, "the consumer exited normally");
}

// Channel::send_batch: three leases in one call (few messages), received in order by a
// consumer that spins (Connection::set_spin) and reads on no stream (set_stream(nullptr)).
void test_a_batch_of_3_leases_arrives_in_order_at_a_spinning_consumer() {
    const std::string addr = address("batch");
    Child child([&](Consumer& me) {
        me.next();
        devshare::Connection conn = devshare::Connection::connect(addr, kWait);
        conn.set_spin(std::chrono::microseconds(100));
        conn.set_stream(nullptr);
        me.check(failed_with(conn.try_set_spin(std::chrono::microseconds(DEVSHARE_MAX_SPIN_US + 1)),
                             DEVSHARE_STATUS_INVALID_ARGUMENT),
                 "Connection::try_set_spin above DEVSHARE_MAX_SPIN_US: INVALID_ARGUMENT");
        me.report();
        me.next();
        bool in_order = true;
        for (int i = 0; i < 3; i++) {
            const devshare::Import item = conn.recv(kWait);
            in_order = in_order && item && item.as<const float>()(0) == static_cast<float>(10 * i) + 0.5f;
            in_order = in_order && item.name().empty();
        }
        me.check(in_order, "received the batch's 3 leases, in order, each its own tensor, none named");
        me.report();
        me.next();
        // The same batch with names, taken in one call (Connection::recv_batch): Import::name()
        // of each, empty for the unnamed one.
        const char* want[3] = {"layers.0.weight", "", "layers.0.bias"};
        bool named = true;
        {
            const std::vector<devshare::Import> batch = conn.recv_batch(3, kWait);
            named = batch.size() == 3;
            for (size_t i = 0; named && i < 3; i++) {
                named = batch[i] && batch[i].name() == want[i] &&
                        batch[i].as<const float>()(0) == static_cast<float>(10 * i) + 0.5f;
            }
            devshare::Connection::give_back(batch);  // in one message; still mapped
            named = named && batch[2].as<const float>()(0) == 20.5f;
        }  // the batch is released here (nothing more is sent)
        me.check(named, "a named batch by Connection::recv_batch: in order, Import::name() is each lease's name "
                        "(empty: sent without one)");
        me.check(failed_with(devshare::Import().try_name(), DEVSHARE_STATUS_NULL_ARGUMENT),
                 "Import::try_name of an empty Import: NULL_ARGUMENT");
        // Misuse of the C call, and a batch that does not complete in time: what arrived goes back.
        DevshareItem bad[2] = {};
        me.check(devshare_connection_recv_batch(conn.get(), 0, nullptr, 2) == DEVSHARE_STATUS_NULL_ARGUMENT &&
                     devshare_connection_recv_batch(conn.get(), 0, bad, 2) == DEVSHARE_STATUS_INVALID_ARGUMENT,
                 "devshare_connection_recv_batch: NULL items, or items never initialised, are refused");
        // An element whose struct_size is not the array's stride (items[0]'s) would be written
        // past its place: refused before anything is received.
        DevshareItem mixed[2];
        (void)devshare_item_init(&mixed[0], sizeof mixed[0]);
        (void)devshare_item_init(&mixed[1], sizeof mixed[1]);
        mixed[1].struct_size += 8;
        const int32_t mixed_st = devshare_connection_recv_batch(conn.get(), 0, mixed, 2);
        const std::string mixed_why = devshare::Error::from_last(mixed_st).message();
        me.check(mixed_st == DEVSHARE_STATUS_INVALID_ARGUMENT &&
                     mixed_why.find("items[1].struct_size") != std::string::npos && mixed[0].import == nullptr &&
                     mixed[1].import == nullptr,
                 "devshare_connection_recv_batch refuses an item whose struct_size is not items[0]'s, before "
                 "receiving anything (" + mixed_why + ")");
        me.report();
        me.next();
        const auto short_batch = conn.try_recv_batch(3, std::chrono::milliseconds(300));
        const std::string short_why = short_batch.has_value() ? "" : short_batch.error().message();
        me.check(failed_with(short_batch, DEVSHARE_STATUS_TIMEOUT) &&
                     short_why.find("2 of the batch's 3 items arrived in time") != std::string::npos,
                 "Connection::try_recv_batch of 3 when 2 were sent: TIMEOUT, saying how many arrived (" + short_why +
                     ")");
        DevshareItem two[2];
        for (DevshareItem& item : two) {
            (void)devshare_item_init(&item, sizeof item);
        }
        me.report();
        me.next();
        me.check(devshare_connection_recv_batch(conn.get(), -1, two, 2) == DEVSHARE_STATUS_OK &&
                     two[0].import != nullptr && two[1].import != nullptr,
                 "devshare_connection_recv_batch of 2 fills both items");
        // (1.15) Each item's name in the item itself: no devshare_import_name per item.
        me.check(two[0].name != nullptr && two[0].name_len == 15 && std::strcmp(two[0].name, "layers.0.weight") == 0 &&
                     two[1].name == nullptr && two[1].name_len == 0,
                 "devshare_connection_recv_batch writes each lease's name and its length into its item (NULL, 0: "
                 "sent without one)");
        // Given back in one call first (NULL entries skipped; twice: the second sends nothing),
        // then released, which sends nothing more.
        const DevshareImport* given[3] = {two[0].import, nullptr, two[1].import};
        me.check(devshare_imports_give_back(nullptr, 2) == DEVSHARE_STATUS_NULL_ARGUMENT &&
                     devshare_imports_give_back(given, 3) == DEVSHARE_STATUS_OK &&
                     devshare_imports_give_back(given, 3) == DEVSHARE_STATUS_OK,
                 "devshare_imports_give_back gives the batch back in one call and a second call sends nothing; a "
                 "NULL array is refused");
        me.check(devshare_items_release(two, 2) == DEVSHARE_STATUS_OK && two[0].import == nullptr &&
                     two[0].name == nullptr && two[0].name_len == 0 &&
                     devshare_items_release(two, 2) == DEVSHARE_STATUS_OK,
                 "devshare_items_release releases the batch in one call, clears each import and its name (which "
                 "lived in the lease), and a second call does nothing");
        me.report();
        me.next();
    });

    devshare::Channel ch = devshare::Channel::listen(addr);
    child.tell('g');
    check(ch.wait_peers(1, kWait), "batch: wait_peers(1) sees the consumer");
    child.take_report();
    const uint64_t peer = ch.peers().at(0);
    devshare::Exporter exp = devshare::Exporter::channel_host_alloc(4096);
    float* t = static_cast<float*>(exp.data());
    for (int i = 0; i < 64; i++) {
        t[i] = static_cast<float>(i) + 0.5f;
    }
    const devshare::Exporter* exps[3] = {&exp, &exp, &exp};
    const devshare::TensorDesc descs[3] = {devshare::describe(t, {4}), devshare::describe(t + 10, {4}),
                                           devshare::describe(t + 20, {4})};
    const devshare::TensorDesc bad[2] = {devshare::describe(t, {4}), devshare::describe(t + 5000, {4})};
    check(!ch.try_send_batch(peer, exps, {bad, 2}) && exp.outstanding() == 0,
          "Channel::try_send_batch with one description beyond the export: an error, nothing sent");
    check(failed_with(ch.try_send_batch(peer, {exps, 2}, descs), DEVSHARE_STATUS_INVALID_ARGUMENT),
          "Channel::try_send_batch with 2 exporters for 3 descriptions: INVALID_ARGUMENT");
    ch.send_batch(peer, exps, descs);
    check(exp.outstanding() == 3, "Channel::send_batch: three leases outstanding");
    child.tell('r');
    child.take_report();
    check(exp.wait(kWait) && exp.outstanding() == 0, "the consumer's three releases bring it to 0");
    const char* names[3] = {"layers.0.weight", nullptr, "layers.0.bias"};
    check(failed_with(ch.try_send_batch(peer, exps, descs, {names, 2}), DEVSHARE_STATUS_INVALID_ARGUMENT),
          "Channel::try_send_batch with 2 names for 3 descriptions: INVALID_ARGUMENT");
    ch.register_export(exp);  // the named batch goes as leases of a registered export
    check(failed_with(ch.try_set_spin(std::chrono::microseconds(DEVSHARE_MAX_SPIN_US + 1)),
                      DEVSHARE_STATUS_INVALID_ARGUMENT),
          "Channel::try_set_spin above DEVSHARE_MAX_SPIN_US: INVALID_ARGUMENT");
    ch.set_spin(std::chrono::microseconds(200));  // the waits below spin before they sleep
    ch.send_batch(peer, exps, descs, names);
    child.tell('n');
    child.take_report();
    check(exp.wait(kWait) && exp.outstanding() == 0, "the named batch's leases come back too");
    ch.send_batch(peer, {exps, 2}, {descs, 2});
    child.tell('t');
    child.take_report();
    check(exp.wait(kWait) && exp.outstanding() == 0, "a batch that timed out gave back the 2 leases it had received");
    ch.send_batch(peer, {exps, 2}, {descs, 2}, {names, 2});
    child.tell('b');
    child.take_report();
    check(exp.wait(kWait) && exp.outstanding() == 0, "devshare_items_release gives back the batch's 2 leases");
    check(static_cast<bool>(ch.try_unregister_export(exp)), "Channel::unregister_export of the registered export");
    check(failed_with(ch.try_unregister_export(exp), DEVSHARE_STATUS_NOT_FOUND),
          "Channel::try_unregister_export of an export no longer registered: NOT_FOUND");
    check(child.wait() == 0, "the consumer exited normally");
}

// Ten syncs of a registered "state dict" (three named tensors, views of one export) to a C++
// consumer: before each the producer rewrites every value in place; the consumer takes each
// sync with Connection::recv_batch and checks every value of every tensor is this sync's, and
// each name, then gives the batch back in one message.
void test_ten_syncs_of_a_registered_state_dict_reach_a_cpp_consumer_with_every_value_right() {
    constexpr int kSyncs = 10;
    constexpr int kLen = 256;
    const std::string addr = address("ten-syncs");
    const char* names[3] = {"embed.weight", "layers.0.weight", "norm.weight"};
    Child child([&](Consumer& me) {
        me.next();
        devshare::Connection conn = devshare::Connection::connect(addr, kWait);
        me.report();
        for (int sync = 0; sync < kSyncs; sync++) {
            if (me.next() != 's') {
                return;
            }
            const std::vector<devshare::Import> batch = conn.recv_batch(3, kWait);
            bool right = batch.size() == 3;
            for (size_t i = 0; right && i < 3; i++) {
                right = batch[i] && batch[i].name() == names[i];
                const auto x = batch[i].as<const float>().flat();
                right = right && x.size() == static_cast<size_t>(kLen);
                for (int j = 0; right && j < kLen; j++) {
                    right = x[static_cast<size_t>(j)] == static_cast<float>(1000 * sync + 100 * static_cast<int>(i) + j);
                }
            }
            devshare::Connection::give_back(batch);
            me.check(right, "sync " + std::to_string(sync) + ": every value of the three tensors is this sync's, "
                            "each under its name");
            me.report();
        }
    });

    devshare::Channel ch = devshare::Channel::listen(addr);
    child.tell('g');
    check(ch.wait_peers(1, kWait), "ten syncs: wait_peers(1) sees the consumer");
    child.take_report();
    const uint64_t peer = ch.peers().at(0);
    devshare::Exporter exp = devshare::Exporter::channel_host_alloc(3 * kLen * sizeof(float));
    float* t = static_cast<float*>(exp.data());
    const devshare::Exporter* exps[3] = {&exp, &exp, &exp};
    const devshare::TensorDesc descs[3] = {devshare::describe(t, {kLen}), devshare::describe(t + kLen, {kLen}),
                                           devshare::describe(t + 2 * kLen, {kLen})};
    ch.register_export(exp);
    bool back = true;
    for (int sync = 0; sync < kSyncs; sync++) {
        for (int i = 0; i < 3; i++) {
            for (int j = 0; j < kLen; j++) {
                t[i * kLen + j] = static_cast<float>(1000 * sync + 100 * i + j);  // in place
            }
        }
        ch.send_batch(peer, exps, descs, names);
        child.tell('s');
        child.take_report();
        back = back && exp.wait(kWait) && exp.outstanding() == 0;
    }
    check(back, "ten syncs: every sync's leases came back before the next");
    ch.unregister_export(exp);
    check(child.wait() == 0, "ten syncs: the consumer exited normally");
}

// A consumer drops its Connection while it holds two slots and a lease.
void test_a_dropped_connection_gives_back_its_slots_and_lease() {
    const std::string addr = address("drop");

    Child child([&](Consumer& me) {
        me.next();
        devshare::Connection conn = devshare::Connection::connect(addr, kWait);
        me.next();
        const devshare::Import first = conn.recv(kWait);
        const devshare::Import second = conn.recv(kWait);
        const devshare::Import lease = conn.recv(kWait);
        const devshare::Result<devshare::PoolSlot> p1 = first.try_pool_slot();
        const devshare::Result<devshare::PoolSlot> p2 = second.try_pool_slot();
        me.check(p1 && p2 && p1->slot != p2->slot && lease && !lease.try_pool_slot(),
                 "holding two pool slots and a lease");
        me.report();
        me.next();
        {
            const devshare::Connection dropped = std::move(conn);
        }
        me.check(!conn, "the Connection dropped (moved out and destroyed)");
        const bool readable = first && second && lease && first.as<const int32_t>()(0) == 1 &&
                              second.as<const int32_t>()(0) == 2 &&
                              static_cast<const unsigned char*>(lease.data())[0] == 7;
        me.check(readable, "the Imports stay readable after the Connection is gone");
        me.report();
        me.next();
    });

    devshare::Channel ch = devshare::Channel::listen(addr);
    child.tell('g');
    check(ch.wait_peers(1, kWait), "drop: wait_peers(1) sees the consumer");
    const uint64_t peer = ch.peers().at(0);
    devshare::Exporter exp = devshare::Exporter::channel_host_alloc(3 * 1024);
    devshare::Pool pool = devshare::Pool::create(ch, exp, 1024, 3);
    for (int32_t i = 1; i <= 2; i++) {
        devshare::Slot s = pool.acquire(milliseconds(0));
        s.data<int32_t>()[0] = i;
        pool.send(s, peer, devshare::describe_at<int32_t>(0, {256}));
    }
    devshare::Exporter leased = devshare::Exporter::channel_host_alloc(256);
    static_cast<unsigned char*>(leased.data())[0] = 7;
    ch.send(peer, leased, devshare::bytes());
    child.tell('s');
    child.take_report();
    check(pool.info().free_slots == 1 && leased.outstanding() == 1 && exp.outstanding() == 1 &&
              ch.peer_info(peer).leases == 2,
          "the consumer holds two slots (one free), the lease, and is attached to the pool (peer_info leases 2)");
    child.tell('c');
    child.take_report();
    check(serve_until(ch, [&] { return pool.info().free_slots == 3; }),
          "the consumer's dropped Connection returns its slots (free_slots 1 -> 3) while it still holds the Imports");
    check(leased.outstanding() == 0 && exp.outstanding() == 0 && ch.peers().empty(),
          "and its lease and pool attachment; the peer is gone");
    check(child.wait() == 0, "the consumer exited normally");
}

// The producer closes its channel: queued items still arrive, then CLOSED.
void test_after_the_producer_closes_the_consumer_drains_then_sees_closed() {
    const std::string addr = address("close");

    Child child([&](Consumer& me) {
        me.next();
        devshare::Connection conn = devshare::Connection::connect(addr, kWait);
        me.next();
        const devshare::Import item = conn.recv(kWait);
        me.check(item && item.as<const float>()(0) == 3.5f, "the item sent before the close arrives");
        try {
            (void)conn.recv(kWait);
            me.check(false, "recv after the producer closed: no exception");
        } catch (const devshare::Error& e) {
            me.check(e.status() == DEVSHARE_STATUS_CLOSED &&
                         std::strncmp(e.what(), "devshare_connection_recv:", 25) == 0,
                     "recv after the producer closed throws devshare::Error(DEVSHARE_STATUS_CLOSED)");
        }
        const devshare::Result<devshare::Import> again = conn.try_recv(milliseconds(0));
        me.check(failed_with(again, DEVSHARE_STATUS_CLOSED), "try_recv: a Result with DEVSHARE_STATUS_CLOSED");
        me.check(item.as<const float>()(1) == 4.5f, "the received Import stays readable");
        me.report();
        me.next();
    });

    devshare::Channel ch = devshare::Channel::listen(addr);
    child.tell('g');
    check(ch.wait_peers(1, kWait), "close: wait_peers(1) sees the consumer");
    const uint64_t peer = ch.peers().at(0);
    devshare::Exporter exp = devshare::Exporter::channel_host_alloc(1024);
    float* t = static_cast<float*>(exp.data());
    t[0] = 3.5f;
    t[1] = 4.5f;
    ch.send(peer, exp, devshare::describe<float>(exp.data(), {2}));
    devshare::Exporter pool_exp = devshare::Exporter::channel_host_alloc(1024);
    devshare::Pool pool = devshare::Pool::create(ch, pool_exp, 512, 2);
    ch.close();
    check(!ch && exp.outstanding() == 0, "Channel::close empties it; its lease no longer counts");
    const devshare::Result<devshare::Slot> after = pool.try_acquire(milliseconds(0));
    check(failed_with(after, DEVSHARE_STATUS_CLOSED), "a Pool that outlives its Channel answers CLOSED");
    child.tell('s');
    child.take_report();
    check(child.wait() == 0, "the consumer exited normally");
}

}  // namespace

int main() {
    test_channel_and_pool_misuse_is_refused_in_one_process();
    test_1000_pool_items_arrive_in_order_at_fixed_slot_addresses();
    test_a_lease_is_outstanding_until_the_consumer_destroys_its_import();
    test_a_batch_of_3_leases_arrives_in_order_at_a_spinning_consumer();
    test_ten_syncs_of_a_registered_state_dict_reach_a_cpp_consumer_with_every_value_right();
    test_a_dropped_connection_gives_back_its_slots_and_lease();
    test_after_the_producer_closes_the_consumer_drains_then_sees_closed();
    std::printf("1..%d\n# %d passed, %d failed\n", n_cases, n_cases - n_failed, n_failed);
    return n_failed == 0 ? 0 : 1;
}
