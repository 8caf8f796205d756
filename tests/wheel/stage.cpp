// A C++ pipeline stage between two Python (torch) stages, built against the devshare wheel's
// CMake package: reads handle text (argv[1]) of a float32 tensor, writes y = 2*x + 1 into a new
// shared host buffer, prints y's handle text on stdout, and waits (up to 60 s) until the consumer
// has released it.
#include "devshare.hpp"

#include <chrono>
#include <cstdio>
#include <exception>
#include <vector>

int main(int argc, char** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s HANDLE_TEXT\n", argv[0]);
        return 2;
    }
    try {
        std::vector<int64_t> shape;
        devshare::Exporter out;
        devshare::Handle h;
        {
            devshare::Import in = devshare::Import::from_text(argv[1]);
            const devshare::TensorView<float> x = in.as<float>();  // a dtype mismatch throws
            int64_t n = 1;
            for (uint32_t d = 0; d < x.ndim(); d++) {
                shape.push_back(x.extent(d));
                n *= x.extent(d);
            }
            if (x.ndim() != 2) {
                std::fprintf(stderr, "stage: expected a 2-D tensor, got %u dimensions\n", unsigned{x.ndim()});
                return 1;
            }
            out = devshare::Exporter::host_alloc(static_cast<uint64_t>(n) * sizeof(float));
            float* y = static_cast<float*>(out.data());
            for (int64_t i = 0; i < shape[0]; i++) {
                for (int64_t j = 0; j < shape[1]; j++) {
                    y[i * shape[1] + j] = 2.0f * x(i, j) + 1.0f;  // x may be strided
                }
            }
            h = out.share(devshare::describe<float>(y, shape));
        }  // the input's import is released here: the producer sees outstanding() == 0
        std::printf("%s\n", h.to_text().c_str());
        std::fflush(stdout);
        if (!out.wait(std::chrono::milliseconds(60000))) {
            std::fprintf(stderr, "stage: the consumer did not release the output within 60 s\n");
            return 1;
        }
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "stage: %s\n", e.what());
        return 1;
    }
}
