// SPDX-License-Identifier: Apache-2.0
//
// torch_consumer_cpp: the C++ consumer of a channel in the tests of PyTorch tensors sent over
// channels (tests/python/test_torch_channel.py), with devshare::Connection and devshare::Import.
// Test-only, like torch_consumer.c: it reads float32 elements through the import's data pointer
// (host memory, or a device stand-in's host-addressable memory).
//
//   torch_consumer_cpp <address> <n>
//
// Prints "CONNECTED <pid>", per item "ITEM <i> backend=<b> shape=<d0,d1,..> sum=<sum>" (each
// released when its Import goes out of scope), then "DONE". Exit status 0, or 1 with the
// error's text.
#include "devshare.hpp"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <unistd.h>

namespace {

double sum_of(const devshare::Import& imp) {
    const float* data = static_cast<const float*>(imp.data());
    auto shape = imp.shape();
    auto strides = imp.strides();
    const uint64_t numel = imp.info().numel;
    int64_t idx[DEVSHARE_MAX_NDIM] = {0};
    double sum = 0.0;
    for (uint64_t k = 0; k < numel; k++) {
        int64_t off = 0;
        for (size_t d = 0; d < shape.size(); d++) off += idx[d] * strides[d];
        sum += data[off];
        for (size_t d = shape.size(); d-- > 0;) {
            if (++idx[d] < shape[d]) break;
            idx[d] = 0;
        }
    }
    return sum;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: torch_consumer_cpp <address> <n>\n");
        return 2;
    }
    const long n = std::strtol(argv[2], nullptr, 10);
    try {
        using namespace std::chrono_literals;
        auto conn = devshare::Connection::connect(argv[1], 5000ms);
        std::printf("CONNECTED %d\n", static_cast<int>(getpid()));
        std::fflush(stdout);
        for (long i = 0; i < n; i++) {
            devshare::Import imp = conn.recv(30000ms);
            if (imp.dtype().code != DEVSHARE_DTYPE_FLOAT || imp.dtype().bits != 32) {
                std::fprintf(stderr, "torch_consumer_cpp: expected float32 items\n");
                return 1;
            }
            std::string shape;
            for (int64_t d : imp.shape()) shape += (shape.empty() ? "" : ",") + std::to_string(d);
            std::printf("ITEM %ld backend=%u shape=%s sum=%.1f\n", i, static_cast<unsigned>(imp.info().backend),
                        shape.c_str(), sum_of(imp));
            std::fflush(stdout);
        }
        std::printf("DONE\n");
        return 0;
    } catch (const devshare::Error& e) {
        std::fprintf(stderr, "torch_consumer_cpp: %s\n", e.what());
        return 1;
    }
}
