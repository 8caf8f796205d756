// SPDX-License-Identifier: Apache-2.0
//
// consumer (C++): the same as consumer.c, written with devshare.hpp.
//
//   consumer_cpp <handle-text>
//
// Imports a 2-D float32 tensor (R x C, R >= 2, rows 0..R-2 holding v[i][j] = i*100 + j), checks
// it through a TensorView (Import::as<float>: the dtype checked, indexing through the handle's
// strides), writes the column sums into row R-1, and releases the import (the Import's
// destructor would too). Exit status: 0 on success, 1 on failure, 2 on a usage error.

#include "devshare.hpp"

#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <exception>

namespace {

int run(const char* text) {
    const long pid = static_cast<long>(getpid());
    devshare::Import imp = devshare::Import::from_text(text);
    // as<float>() checks the element type: a tensor of another dtype is an error, not a
    // reinterpretation.
    devshare::Result<devshare::TensorView<float>> view = imp.try_as<float>();
    if (!view) {
        std::fprintf(stderr, "consumer_cpp: expected float32: %s\n", view.error().what());
        return 1;
    }
    const devshare::TensorView<float>& t = *view;
    if (t.ndim() != 2 || t.extent(0) < 2 || t.extent(1) < 1) {
        std::fprintf(stderr, "consumer_cpp: expected a 2-D tensor with at least 2 rows, got ndim %u\n",
                     unsigned{t.ndim()});
        return 1;
    }
    const int64_t rows = t.extent(0);
    const int64_t cols = t.extent(1);
    for (int64_t i = 0; i + 1 < rows; i++) {
        for (int64_t j = 0; j < cols; j++) {
            const float want = static_cast<float>(i * 100 + j);
            if (t(i, j) != want) {
                std::fprintf(stderr, "consumer_cpp: pattern broken at [%" PRId64 "][%" PRId64 "]: %g, expected %g\n",
                             i, j, static_cast<double>(t(i, j)), static_cast<double>(want));
                return 1;
            }
        }
    }
    const devshare::Handle& h = imp.handle();
    std::printf("consumer_cpp[%ld]: %" PRId64 "x%" PRId64 " %s, strides {%" PRId64 ", %" PRId64
                "}, storage offset %" PRIu64 " bytes, tensor offset %" PRId64 " elements: pattern ok\n",
                pid, rows, cols, devshare::dtype_name(h.dtype()).c_str(), t.stride(0), t.stride(1),
                h.storage_offset(), h.tensor_offset());
    std::printf("consumer_cpp[%ld]: wrote column sums into row %" PRId64 ":", pid, rows - 1);
    for (int64_t j = 0; j < cols; j++) {
        float sum = 0.0f;
        for (int64_t i = 0; i + 1 < rows; i++) {
            sum += t(i, j);
        }
        t(rows - 1, j) = sum;
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
