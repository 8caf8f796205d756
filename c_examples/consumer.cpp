// SPDX-License-Identifier: Apache-2.0
//
// consumer (C++): the same as consumer.c, written with devshare.hpp.
//
//   consumer_cpp <handle-text>
//
// Imports a 2-D float32 tensor (R x C, R >= 2, rows 0..R-2 holding v[i][j] = i*100 + j), checks
// it through the import's data pointer and the handle's strides, writes the column sums into
// row R-1, and releases the import (the Import's destructor would too). Exit status: 0 on
// success, 1 on failure, 2 on a usage error.

#include "devshare.hpp"

#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <exception>

namespace {

class Tensor2d {
public:
    Tensor2d(float* data, const DevshareHandle& h) noexcept : data_(data), h_(h) {}
    float& at(int64_t i, int64_t j) const noexcept { return data_[i * h_.strides[0] + j * h_.strides[1]]; }
    int64_t rows() const noexcept { return h_.shape[0]; }
    int64_t cols() const noexcept { return h_.shape[1]; }

private:
    float* data_;
    const DevshareHandle& h_;
};

int run(const char* text) {
    const long pid = static_cast<long>(getpid());
    devshare::Import imp(devshare::Handle::from_text(text));
    const devshare::Handle handle = imp.handle();
    const DevshareHandle& h = handle.raw();
    if (h.dtype.code != DEVSHARE_DTYPE_FLOAT || h.dtype.bits != 32 || h.dtype.lanes != 1 ||
        imp.info().element_size != sizeof(float)) {
        std::fprintf(stderr, "consumer_cpp: expected float32, got dtype code %u bits %u lanes %u\n",
                     unsigned{h.dtype.code}, unsigned{h.dtype.bits}, unsigned{h.dtype.lanes});
        return 1;
    }
    if (h.ndim != 2 || h.shape[0] < 2 || h.shape[1] < 1) {
        std::fprintf(stderr, "consumer_cpp: expected a 2-D tensor with at least 2 rows, got ndim %u\n",
                     unsigned{h.ndim});
        return 1;
    }
    const Tensor2d t(imp.data<float>(), h);
    for (int64_t i = 0; i + 1 < t.rows(); i++) {
        for (int64_t j = 0; j < t.cols(); j++) {
            const float want = static_cast<float>(i * 100 + j);
            if (t.at(i, j) != want) {
                std::fprintf(stderr, "consumer_cpp: pattern broken at [%" PRId64 "][%" PRId64 "]: %g, expected %g\n",
                             i, j, static_cast<double>(t.at(i, j)), static_cast<double>(want));
                return 1;
            }
        }
    }
    std::printf("consumer_cpp[%ld]: %" PRId64 "x%" PRId64 " float32, strides {%" PRId64 ", %" PRId64
                "}, storage offset %" PRIu64 " bytes, tensor offset %" PRId64 " elements: pattern ok\n",
                pid, t.rows(), t.cols(), h.strides[0], h.strides[1], h.storage_offset, h.tensor_offset);
    std::printf("consumer_cpp[%ld]: wrote column sums into row %" PRId64 ":", pid, t.rows() - 1);
    for (int64_t j = 0; j < t.cols(); j++) {
        float sum = 0.0f;
        for (int64_t i = 0; i + 1 < t.rows(); i++) {
            sum += t.at(i, j);
        }
        t.at(t.rows() - 1, j) = sum;
        std::printf(" %g", static_cast<double>(sum));
    }
    std::printf("\n");
    imp.release();
    std::printf("consumer_cpp[%ld]: released the import; done\n", pid);
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s <handle-text>\n", argc > 0 ? argv[0] : "consumer_cpp");
        return 2;
    }
    try {
        return run(argv[1]);
    } catch (const devshare::Error& e) {
        std::fprintf(stderr, "consumer_cpp: %s (%d): %s\n", e.status_name(), static_cast<int>(e.status()), e.what());
    } catch (const std::exception& e) {
        std::fprintf(stderr, "consumer_cpp: %s\n", e.what());
    }
    return 1;
}
