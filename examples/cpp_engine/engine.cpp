// A C++ inference engine fed by a Python trainer: it receives the trainer's state dict once
// (allocating its own weights by name and shape), then every update after an optimiser step,
// copied into the same weights by name.
//
//   cpp_engine ADDRESS
//
// Each sync is the trainer's Channel.send_batch of a dict: one lease per tensor, each named by
// its key (Import::name), the registered storages shared once on the trainer's side; the last
// tensor is "meta": [step, number of weights, checksum]. The engine copies every weight (its
// own memory from here on), checks the sum against the checksum, and releases the batch: the
// trainer may step again. It ends when the trainer closes the channel.

#include "devshare.hpp"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <string>
#include <vector>

namespace {

using namespace std::chrono_literals;

// The engine's own weights, by name: made at the first sync, updated in place by the later ones.
struct Weight {
    std::vector<int64_t> shape;
    std::vector<float> values;
};

int run(const std::string& address) {
    devshare::Connection conn = devshare::Connection::connect(address, 10s);
    std::map<std::string, Weight> weights;
    long syncs = 0;
    for (;;) {
        // One sync: leases until "meta" (the trainer sends it last).
        std::vector<devshare::Import> batch;
        for (;;) {
            devshare::Result<devshare::Import> r = conn.try_recv(10s);
            if (!r && r.error().status() == DEVSHARE_STATUS_CLOSED && batch.empty()) {
                std::printf("cpp_engine: loaded %ld syncs of %zu weights, each checked\n", syncs, weights.size());
                return 0;  // the trainer is done
            }
            devshare::Import item = std::move(r).value();  // throws on any other error
            if (!item) {
                std::fprintf(stderr, "cpp_engine: nothing arrived within 10 s\n");
                return 1;
            }
            const bool last = item.name() == "meta";
            batch.push_back(std::move(item));
            if (last) {
                break;
            }
        }
        const devshare::TensorView<const double> meta = batch.back().as<const double>();
        const long step = std::lround(meta(0));
        const size_t count = static_cast<size_t>(std::lround(meta(1)));
        if (batch.size() != count + 1 || step != syncs + 1) {
            std::fprintf(stderr, "cpp_engine: sync %ld: %zu tensors for step %ld (%zu expected)\n", syncs + 1,
                         batch.size() - 1, step, count);
            return 1;
        }
        double total = 0;
        for (size_t i = 0; i < count; i++) {
            const std::string name(batch[i].name());
            const devshare::TensorView<const float> x = batch[i].as<const float>();  // throws unless float32
            const devshare::Span<const float> flat = x.flat();                      // throws unless contiguous
            Weight& w = weights[name];
            if (syncs == 0) {  // the first sync: the weights are made here, once
                w.shape.assign(x.shape().begin(), x.shape().end());
                w.values.resize(flat.size());
            } else if (w.values.size() != flat.size() ||
                       !std::equal(w.shape.begin(), w.shape.end(), x.shape().begin(), x.shape().end())) {
                std::fprintf(stderr, "cpp_engine: %s changed shape at step %ld\n", name.c_str(), step);
                return 1;
            }
            std::memcpy(w.values.data(), flat.data(), flat.size() * sizeof(float));
            for (float v : w.values) {
                total += v;
            }
        }
        if (std::fabs(total - meta(2)) > 1e-3 * (1 + std::fabs(meta(2)))) {
            std::fprintf(stderr, "cpp_engine: step %ld: the weights sum to %f, the trainer says %f\n", step, total,
                         meta(2));
            return 1;
        }
        devshare::Connection::give_back(batch);  // every lease back to the trainer in one message
        batch.clear();                            // unmapped (nothing more is sent)
        syncs++;
    }
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s ADDRESS\n", argc > 0 ? argv[0] : "cpp_engine");
        return 2;
    }
    try {
        return run(argv[1]);
    } catch (const devshare::Error& e) {
        std::fprintf(stderr, "cpp_engine: %s: %s\n", e.status_name(), e.what());
    } catch (const std::exception& e) {
        std::fprintf(stderr, "cpp_engine: %s\n", e.what());
    }
    return 1;
}
