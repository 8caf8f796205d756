// A C++ stage in a Python pipeline: receives float32 tensors from a Python producer's channel,
// computes y = 2 * x + 1 into a slot of its own pool and sends it on its own channel, back to
// Python.
//
//   cpp_stage IN_ADDRESS OUT_ADDRESS
//
// Channels are one-way (a producer's Channel, its consumers' Connections), so the answers travel
// on a second channel that this stage listens on. The order that cannot deadlock, on both sides:
// listen on your own channel first, then connect to the other's, and serve your channel (here:
// wait_peers) while the other side connects to it:
//
//   Python                          cpp_stage
//   listen IN                        .
//   start cpp_stage  --------------> listen OUT
//   IN.wait_peers(1)  <------------  connect IN     (Python serves the handshake)
//   connect OUT       ------------>  OUT.wait_peers(1) (the stage serves the handshake)
//
// A connect waits for the other side to serve its handshake, so two processes that each connect
// before serving their own channel would wait for each other.
//
// The stage ends when the Python side closes IN (recv says DEVSHARE_STATUS_CLOSED), once every
// answer it sent has come back.

#include "devshare.hpp"

#include <chrono>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

namespace {

using namespace std::chrono_literals;

constexpr uint64_t kSlotBytes = 1 << 20;  // the largest answer: 1 MiB (262144 floats)
constexpr uint32_t kSlots = 4;

int run(const std::string& in_address, const std::string& out_address) {
    // 1. Our own channel first, with a pool for the answers.
    devshare::Channel out = devshare::Channel::listen(out_address);
    devshare::Pool pool =
        devshare::Pool::create(out, devshare::Exporter::channel_host_alloc(kSlotBytes * kSlots), kSlotBytes, kSlots);
    // 2. Then the Python producer's channel (it serves our handshake in its wait_peers).
    devshare::Connection in = devshare::Connection::connect(in_address, 10s);
    // 3. Serve our channel until Python has connected to it.
    if (!out.wait_peers(1, 10s)) {
        std::fprintf(stderr, "cpp_stage: nobody connected to %s within 10 s\n", out_address.c_str());
        return 1;
    }
    const uint64_t python = out.peers().at(0);

    long items = 0;
    for (;;) {
        devshare::Result<devshare::Import> r = in.try_recv(10s);
        if (!r) {
            if (r.error().status() == DEVSHARE_STATUS_CLOSED) {
                break;  // Python closed its channel: no more input
            }
            throw r.error();
        }
        devshare::Import x_imp = std::move(*r);
        if (!x_imp) {
            std::fprintf(stderr, "cpp_stage: nothing arrived within 10 s\n");
            return 1;
        }
        const devshare::TensorView<float> x = x_imp.as<float>();  // throws unless float32
        if (x.ndim() != 2) {
            std::fprintf(stderr, "cpp_stage: expected a 2-D tensor, got %u dimensions\n", unsigned{x.ndim()});
            return 1;
        }
        const int64_t rows = x.extent(0);
        const int64_t cols = x.extent(1);
        if (static_cast<uint64_t>(rows * cols) * sizeof(float) > kSlotBytes) {
            std::fprintf(stderr, "cpp_stage: a %lldx%lld tensor does not fit a slot\n",
                         static_cast<long long>(rows), static_cast<long long>(cols));
            return 1;
        }
        // A free slot (waits, serving OUT, while all of them are out with Python).
        devshare::Slot slot = pool.acquire(10s);
        if (!slot) {
            std::fprintf(stderr, "cpp_stage: no slot came back within 10 s\n");
            return 1;
        }
        float* y = slot.data<float>();
        for (int64_t i = 0; i < rows; i++) {
            for (int64_t j = 0; j < cols; j++) {
                y[i * cols + j] = 2.0f * x(i, j) + 1.0f;  // x(i, j) follows x's strides
            }
        }
        x_imp.release();  // the input goes back to Python now
        pool.send(slot, python, devshare::describe(y, {rows, cols}));
        items++;
    }

    // Every answer home before the pool and channel close.
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (pool.info().free_slots < pool.count()) {
        if (std::chrono::steady_clock::now() > deadline) {
            std::fprintf(stderr, "cpp_stage: answers still out after 10 s\n");
            return 1;
        }
        out.service(100ms);
    }
    std::printf("cpp_stage: answered %ld tensors\n", items);
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: %s IN_ADDRESS OUT_ADDRESS\n", argc > 0 ? argv[0] : "cpp_stage");
        return 2;
    }
    try {
        return run(argv[1], argv[2]);
    } catch (const devshare::Error& e) {
        std::fprintf(stderr, "cpp_stage: %s: %s\n", e.status_name(), e.what());
    } catch (const std::exception& e) {
        std::fprintf(stderr, "cpp_stage: %s\n", e.what());
    }
    return 1;
}
