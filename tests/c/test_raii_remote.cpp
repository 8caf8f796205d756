// SPDX-License-Identifier: Apache-2.0
//
// test_raii_remote: a remote channel (tcp://127.0.0.1:PORT) through devshare.hpp
// and the C ABI, producer and consumer in separate processes: the same Channel / Pool / Slot /
// Connection / Import calls as a Unix channel, with a tcp:// address.
//
//  - devshare_probe(DEVSHARE_PROBE_REMOTE, ...) names the data path, "stream" (items on the
//    authenticated connection: no UCX needed), usable; peer info says the same (transport);
//  - 200 items through 4 slots: the values arrive in order, each consumer slot keeps one
//    address, every producer slot comes back;
//  - leases over a tcp:// channel are refused by the library (UNSUPPORTED, naming the call);
//  - the producer's close ends the consumer's recv with DEVSHARE_STATUS_CLOSED.
//
// Both processes read the channel key from DEVSHARE_CHANNEL_KEY_FILE (a 0600 file made here).

#include "devshare.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>

namespace {

using std::chrono::milliseconds;

int n_failed = 0;

bool check(bool ok, const std::string& what) {
    std::printf("%s - %s\n", ok ? "ok" : "FAIL", what.c_str());
    std::fflush(stdout);
    n_failed += ok ? 0 : 1;
    return ok;
}

constexpr milliseconds kWait{20000};
constexpr int kItems = 200;

// A TCP port nobody listens on now (the system's choice for port 0).
int free_port() {
    const int s = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (s < 0 || bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
        getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
        std::perror("free_port");
        std::exit(1);
    }
    close(s);
    return ntohs(a.sin_port);
}

// The consumer: connect (the producer may not listen yet), take kItems items, then CLOSED.
int consume(const std::string& addr) {
    devshare::Result<devshare::Connection> conn = devshare::Connection::try_connect(addr, kWait);
    for (int i = 0; i < 200 && !conn.has_value(); i++) {
        std::this_thread::sleep_for(milliseconds(50));
        conn = devshare::Connection::try_connect(addr, kWait);
    }
    if (!check(conn.has_value(), "consumer: Connection::try_connect(tcp://...)")) {
        return 1;
    }
    std::map<uint32_t, const void*> where;
    bool in_order = true, one_address = true;
    for (int i = 0; i < kItems; i++) {
        const devshare::Import item = conn->recv(kWait);
        const devshare::PoolSlot ps = item.pool_slot();
        in_order = in_order && item.as<const int32_t>()(0) == i && item.as<const int32_t>()(255) == -i;
        const void* p = item.data();
        one_address = one_address && where.emplace(ps.slot, p).first->second == p;
    }
    check(in_order, "consumer: 200 items arrive in order, byte-exact");
    check(one_address && where.size() == 4, "consumer: each of the 4 slots keeps one address");
    const devshare::Result<devshare::Import> end = conn->try_recv(kWait);
    check(!end.has_value() && end.error().status() == DEVSHARE_STATUS_CLOSED,
          "consumer: after the producer's close, recv is DEVSHARE_STATUS_CLOSED");
    return n_failed == 0 ? 0 : 1;
}

}  // namespace

int main() {
    DevshareBackendInfo info;
    devshare_backend_info_init(&info, sizeof info);
    unsetenv("DEVSHARE_REMOTE_DATA");
    const int32_t rc = devshare_probe(DEVSHARE_PROBE_REMOTE, &info);
    check(rc == DEVSHARE_STATUS_OK && std::strcmp(info.name, "stream") == 0 && info.usable,
          "devshare_probe(DEVSHARE_PROBE_REMOTE) answers: the stream path, usable");
    const std::string key = "/tmp/devshare_test_raii_remote_" + std::to_string(getpid()) + ".key";
    FILE* f = std::fopen(key.c_str(), "w");
    if (f == nullptr || std::fputs("a channel key for this test, 40 bytes..", f) < 0 || std::fclose(f) != 0 ||
        chmod(key.c_str(), 0600) != 0) {
        std::perror("key file");
        return 1;
    }
    setenv("DEVSHARE_CHANNEL_KEY_FILE", key.c_str(), 1);
    setenv("UCX_TLS", "tcp", 1);
    const std::string addr = "tcp://127.0.0.1:" + std::to_string(free_port());

    std::fflush(stdout);
    const pid_t child = fork();  // before any channel exists: the child holds none of it
    if (child == 0) {
        std::_Exit(consume(addr));
    }
    {
        devshare::Channel ch = devshare::Channel::listen(addr);
        check(ch.wait_peers(1, kWait), "producer: a consumer proved the key and connected");
        const uint64_t peer = ch.peers().at(0);
        check(ch.peer_info(peer).transport == DEVSHARE_TRANSPORT_STREAM,
              "producer: the peer's items travel on the authenticated connection");
        devshare::Exporter exp = devshare::Exporter::channel_host_alloc(4 * 1024);
        devshare::Pool pool = devshare::Pool::create(ch, exp, 1024, 4);
        for (int32_t i = 0; i < kItems; i++) {
            devshare::Slot s = pool.acquire(kWait);
            s.data<int32_t>()[0] = i;
            s.data<int32_t>()[255] = -i;
            pool.send(s, peer, devshare::describe_at<int32_t>(0, {256}));
        }
        check(pool.info().free_slots == 4, "producer: every slot is back once its put completed");
        devshare::Exporter leased = devshare::Exporter::channel_host_alloc(256);
        const devshare::Result<void> lease = ch.try_send(peer, leased, devshare::bytes());
        check(!lease.has_value() && lease.error().status() == DEVSHARE_STATUS_UNSUPPORTED &&
                  std::string(lease.error().what()).find("remote") != std::string::npos,
              "producer: a lease over a tcp:// channel is UNSUPPORTED, naming the remote channel");
        // Serve until the consumer took every item (its slots come back), then close.
        for (int i = 0; i < 400 && ch.peer_info(peer).slots > 0; i++) {
            (void)ch.try_service(milliseconds(10));
        }
    }
    int status = 0;
    waitpid(child, &status, 0);
    check(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the consumer exited normally");
    unlink(key.c_str());
    return n_failed == 0 ? 0 : 1;
}
