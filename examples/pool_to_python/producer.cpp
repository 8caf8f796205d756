// A C++ producer that fills the slots of a pool and hands them to a Python consumer.
//
//   pool_producer ADDRESS FRAMES
//
// Listens on ADDRESS, waits for one consumer, then sends FRAMES float32 frames of 64 x 128
// through a pool of 4 fixed slots: frame k holds k * 1000 + i * 128 + j at [i][j]. While all 4
// slots are out with the consumer, Pool::acquire waits for one to come back (backpressure).
// Closes once every slot is home; the consumer then sees the channel closed.

#include "devshare.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

namespace {

using namespace std::chrono_literals;

constexpr int64_t kRows = 64;
constexpr int64_t kCols = 128;
constexpr uint64_t kSlotBytes = kRows * kCols * sizeof(float);
constexpr uint32_t kSlots = 4;

int run(const std::string& address, long frames) {
    devshare::Channel ch = devshare::Channel::listen(address);
    // One allocation for all slots: the consumer maps it once, and slot k keeps its address.
    devshare::Pool pool =
        devshare::Pool::create(ch, devshare::Exporter::channel_host_alloc(kSlotBytes * kSlots), kSlotBytes, kSlots);
    if (!ch.wait_peers(1, 10s)) {
        std::fprintf(stderr, "pool_producer: no consumer connected within 10 s\n");
        return 1;
    }
    const uint64_t consumer = ch.peers().at(0);
    for (long k = 0; k < frames; k++) {
        devshare::Slot slot = pool.acquire(10s);  // serves the channel while it waits
        if (!slot) {
            std::fprintf(stderr, "pool_producer: no slot came back within 10 s\n");
            return 1;
        }
        float* f = slot.data<float>();
        for (int64_t i = 0; i < kRows; i++) {
            for (int64_t j = 0; j < kCols; j++) {
                f[i * kCols + j] = static_cast<float>(k * 1000 + i * kCols + j);
            }
        }
        pool.send(slot, consumer, devshare::describe(f, {kRows, kCols}));  // the slot is the consumer's now
    }
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (pool.info().free_slots < pool.count()) {
        if (std::chrono::steady_clock::now() > deadline) {
            std::fprintf(stderr, "pool_producer: slots still out after 10 s\n");
            return 1;
        }
        ch.service(100ms);
    }
    std::printf("pool_producer: sent %ld frames through %u slots\n", frames, kSlots);
    return 0;  // ~Pool, ~Channel: the consumer's next recv says the channel is closed
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: %s ADDRESS FRAMES\n", argc > 0 ? argv[0] : "pool_producer");
        return 2;
    }
    try {
        return run(argv[1], std::strtol(argv[2], nullptr, 10));
    } catch (const devshare::Error& e) {
        std::fprintf(stderr, "pool_producer: %s: %s\n", e.status_name(), e.what());
    } catch (const std::exception& e) {
        std::fprintf(stderr, "pool_producer: %s\n", e.what());
    }
    return 1;
}
