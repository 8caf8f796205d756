/* SPDX-License-Identifier: Apache-2.0 */

// devshare/exporter.hpp: Exporter, the owner of one exported allocation, and what its destructor
// does with references still out (DestroyPolicy, chosen at construction).
//
// Destruction. ~Exporter (and a move assignment replacing a live Exporter) closes the export.
// Host memory always closes at once: importers keep their mapping until they release, so no
// policy is needed. A device export whose references are still out is handled by the policy
// given when the Exporter was made (every factory takes one; set_on_destroy changes it):
//   OnDestroy::wait (default)    wait for the references -- serving the channels the export was
//                                sent over, so leases of consumers that die come back -- up to
//                                the policy's limit (default: no limit), then close. Past the
//                                limit, as leak_and_report.
//   OnDestroy::force             close with DEVSHARE_CLOSE_FORCE: importers lose the memory.
//   OnDestroy::leak_and_report   leave the export open (leaked) so that no consumer loses its
//                                memory, and hand it to the exporter-leak handler (default: one
//                                line on stderr; set_exporter_leak_handler).
// Why wait is the default: a device export's memory is the caller's, who typically frees it
// right after the Exporter goes; only waiting makes that safe for the consumers, the way a
// std::jthread joins in its destructor. A consumer that never lets go then shows as a wait at
// a known place (give the policy a limit where that must not block), never as a consumer reading
// freed memory (force) or an export that silently outlives its scope (leak_and_report).

#ifndef DEVSHARE_EXPORTER_HPP
#define DEVSHARE_EXPORTER_HPP

#include "compat.hpp"
#include "handle.hpp"
#include "owner.hpp"

#include <atomic>

namespace devshare {

// What ~Exporter does with a device export whose references are still out (see above).
enum class OnDestroy : uint8_t {
    wait,
    force,
    leak_and_report,
    close [[deprecated("devshare 1.3: OnDestroy::leak_and_report")]] = leak_and_report,
    wait_then_close [[deprecated("devshare 1.3: OnDestroy::wait (with a limit)")]] = wait,
};

// The destruction policy: the action and, for OnDestroy::wait, the longest wait (negative:
// kForever).
struct DestroyPolicy {
    OnDestroy action = OnDestroy::wait;
    std::chrono::milliseconds limit = kForever;

    DestroyPolicy() noexcept = default;
    DestroyPolicy(OnDestroy a, std::chrono::milliseconds l = kForever) noexcept  // NOLINT: implicit
        : action(a), limit(l) {}
};

// Flags of Exporter::close / try_close (DEVSHARE_CLOSE_*); combine with |.
enum class Close : uint32_t {
    normal = 0,
    force = DEVSHARE_CLOSE_FORCE,    // close even while references are outstanding
    unlink = DEVSHARE_CLOSE_UNLINK,  // remove the shm names now (host; see devshare.h)
};
[[nodiscard]] constexpr Close operator|(Close a, Close b) noexcept {
    return static_cast<Close>(static_cast<uint32_t>(a) | static_cast<uint32_t>(b));
}

// Called when ~Exporter leaves an export open (OnDestroy::leak_and_report, or wait past its
// limit), with the C exporter (now the handler's: close it later or let it live until exit), the
// status of the refused close and the library's message. It runs in a destructor: no throwing.
using ExporterLeakHandler = void (*)(DevshareExporter* exporter, int32_t status, const char* message);

namespace detail {

inline void default_leak_handler(DevshareExporter* exporter, int32_t status, const char* message) {
    uint64_t n = 0;
    const bool known = devshare_exporter_outstanding(exporter, &n) == DEVSHARE_STATUS_OK;
    std::fprintf(stderr,
                 "devshare: ~Exporter left the export %p open (%s: %s; references outstanding: %lld) so that no "
                 "consumer loses its memory. Close it before destruction or choose OnDestroy::wait or "
                 "OnDestroy::force.\n",
                 static_cast<void*>(exporter), devshare_status_str(status), message,
                 known ? static_cast<long long>(n) : -1LL);
}

inline std::atomic<ExporterLeakHandler>& leak_handler_slot() noexcept {
    static std::atomic<ExporterLeakHandler> slot{&default_leak_handler};
    return slot;
}

// The Exporter's deleter: closes by the policy.
struct ExporterCloser {
    DestroyPolicy policy;
    void operator()(DevshareExporter* e) const noexcept {
        int32_t s = devshare_exporter_close(e, policy.action == OnDestroy::force ? DEVSHARE_CLOSE_FORCE : 0u);
        if (s == DEVSHARE_STATUS_BUSY && policy.action == OnDestroy::wait) {
            (void)devshare_exporter_wait(e, static_cast<int64_t>(policy.limit.count()));
            s = devshare_exporter_close(e, 0);
        }
        if (s != DEVSHARE_STATUS_OK) {
            char message[512];
            (void)devshare_last_error(message, sizeof message);
            leak_handler_slot().load()(e, s, message);
        }
    }
};

}  // namespace detail

// Install the exporter-leak handler (process-wide); nullptr restores the default. Returns the
// previous handler.
inline ExporterLeakHandler set_exporter_leak_handler(ExporterLeakHandler handler) noexcept {
    return detail::leak_handler_slot().exchange(handler != nullptr ? handler : &detail::default_leak_handler);
}

// Owns one exported allocation (DevshareExporter). Move-only; a moved-from or default-constructed
// Exporter is empty: data() is nullptr, size() is 0, and destroying it does nothing.
class Exporter : public compat::Exporter1x<Exporter> {
public:
    using compat::Exporter1x<Exporter>::try_share;
#if DEVSHARE_HPP_EXCEPTIONS
    using compat::Exporter1x<Exporter>::share;
#endif

    Exporter() noexcept = default;

    // Allocate `size` bytes of zero-filled shareable host memory (devshare_host_alloc).
    [[nodiscard]] static Result<Exporter> try_host_alloc(uint64_t size, DestroyPolicy policy = {}) {
        DevshareExporter* e = nullptr;
        void* data = nullptr;
        const int32_t s = devshare_host_alloc(size, &e, &data);
        return made(s, e, data, size, policy);
    }
    // Allocate `size` bytes of zero-filled host memory for channels (devshare_channel_host_alloc):
    // a sealed memfd with no name in /dev/shm that travels over a channel (Channel::send,
    // Pool::create). share() refuses it (DEVSHARE_STATUS_UNSUPPORTED): it is for channels only.
    [[nodiscard]] static Result<Exporter> try_channel_host_alloc(uint64_t size, DestroyPolicy policy = {}) {
        DevshareExporter* e = nullptr;
        void* data = nullptr;
        const int32_t s = devshare_channel_host_alloc(size, &e, &data);
        return made(s, e, data, size, policy);
    }
    // Export an existing host shared memory object in PyTorch's file_system layout, e.g. the
    // name storage._share_filename_cpu_() returned (devshare_host_adopt).
    [[nodiscard]] static Result<Exporter> try_host_adopt(const char* name, uint64_t size, DestroyPolicy policy = {}) {
        DevshareExporter* e = nullptr;
        void* data = nullptr;
        const int32_t s = devshare_host_adopt(name, size, &e, &data);
        return made(s, e, data, size, policy);
    }
    [[nodiscard]] static Result<Exporter> try_host_adopt(const std::string& name, uint64_t size,
                                                         DestroyPolicy policy = {}) {
        return try_host_adopt(name.c_str(), size, policy);
    }
    // Export existing device memory [ptr, ptr + size) on `backend` and `device` (devshare_export,
    // DEVSHARE_EXPORT_* `flags`). The memory stays the caller's and must outlive the export.
    [[nodiscard]] static Result<Exporter> try_export_memory(uint16_t backend, int32_t device, void* ptr, uint64_t size,
                                                            uint32_t flags = 0, DestroyPolicy policy = {}) {
        DevshareExporter* e = nullptr;
        const int32_t s = devshare_export(backend, device, ptr, size, flags, &e);
        return made(s, e, ptr, size, policy);
    }
    // Export a segmented (VMM) allocation: physical.size() segments of `segment_size` bytes
    // mapped back to back from `base` (devshare_export_segments). The memory stays the caller's.
    [[nodiscard]] static Result<Exporter> try_export_segments(uint16_t backend, int32_t device, void* base,
                                                              Span<const uint64_t> physical, uint64_t segment_size,
                                                              uint32_t flags = 0, DestroyPolicy policy = {}) {
        DevshareExporter* e = nullptr;
        const int32_t s = devshare_export_segments(backend, device, base, physical.data(), physical.size(),
                                                   segment_size, flags, &e);
        return s == DEVSHARE_STATUS_OK ? try_adopt(e, policy) : made(s, e, base, 0, policy);
    }
    // Adopt the one reference of a device handle that PyTorch's or torch_npu's allocator made in
    // this process (devshare_exporter_adopt; `table`: its segment table when it travels outside
    // the handle), so that the storage can be leased over channels. Descriptions count from the
    // adopted storage's first byte (describe_at); data() is nullptr (the address is the
    // allocator's). The reference goes back when the Exporter is closed or destroyed: keep the
    // storage alive until then.
    [[nodiscard]] static Result<Exporter> try_adopt_torch(const Handle& handle, Span<const uint8_t> table = {},
                                                          DestroyPolicy policy = {}) {
        DevshareExporter* e = nullptr;
        const int32_t s = devshare_exporter_adopt(&handle.raw(), table.data(), table.size(), 0, &e);
        return s == DEVSHARE_STATUS_OK ? try_adopt(e, policy) : made(s, e, nullptr, 0, policy);
    }
    // Take ownership of a C exporter (nullptr gives an empty Exporter). On failure (its memory
    // cannot be queried) the exporter stays the caller's.
    [[nodiscard]] static Result<Exporter> try_adopt(DevshareExporter* raw, DestroyPolicy policy = {}) {
        void* data = nullptr;
        uint64_t size = 0;
        const int32_t s = raw == nullptr ? DEVSHARE_STATUS_OK : devshare_exporter_memory(raw, &data, &size);
        if (s != DEVSHARE_STATUS_OK) {
            return detail::failure(Error::from_last(s));
        }
        return made(s, raw, data, size, policy);
    }

#if DEVSHARE_HPP_EXCEPTIONS
    // Take ownership of a C exporter; throws (leaving it to the caller) if its memory cannot be queried.
    explicit Exporter(DevshareExporter* raw, DestroyPolicy policy = {})
        : Exporter(detail::value(try_adopt(raw, policy))) {}
    [[nodiscard]] static Exporter host_alloc(uint64_t size, DestroyPolicy policy = {}) {
        return detail::value(try_host_alloc(size, policy));
    }
    [[nodiscard]] static Exporter channel_host_alloc(uint64_t size, DestroyPolicy policy = {}) {
        return detail::value(try_channel_host_alloc(size, policy));
    }
    [[nodiscard]] static Exporter host_adopt(const std::string& name, uint64_t size, DestroyPolicy policy = {}) {
        return detail::value(try_host_adopt(name, size, policy));
    }
    [[nodiscard]] static Exporter export_memory(uint16_t backend, int32_t device, void* ptr, uint64_t size,
                                                uint32_t flags = 0, DestroyPolicy policy = {}) {
        return detail::value(try_export_memory(backend, device, ptr, size, flags, policy));
    }
    [[nodiscard]] static Exporter export_segments(uint16_t backend, int32_t device, void* base,
                                                  Span<const uint64_t> physical, uint64_t segment_size,
                                                  uint32_t flags = 0, DestroyPolicy policy = {}) {
        return detail::value(try_export_segments(backend, device, base, physical, segment_size, flags, policy));
    }
    [[nodiscard]] static Exporter adopt_torch(const Handle& handle, Span<const uint8_t> table = {},
                                              DestroyPolicy policy = {}) {
        return detail::value(try_adopt_torch(handle, table, policy));
    }
#endif

    // Change the destruction policy (normally given at construction).
    void set_on_destroy(DestroyPolicy policy) noexcept { exp_.get_deleter().policy = policy; }
    void set_on_destroy(OnDestroy action, std::chrono::milliseconds limit) noexcept {
        set_on_destroy(DestroyPolicy(action, limit));
    }
    [[nodiscard]] OnDestroy on_destroy() const noexcept { return exp_.get_deleter().policy.action; }
    [[nodiscard]] DestroyPolicy destroy_policy() const noexcept { return exp_.get_deleter().policy; }

    // Address of the allocation in this process (valid until close), nullptr when empty.
    [[nodiscard]] void* data() const noexcept { return data_; }
    template <typename T>
    [[nodiscard]] T* data() const noexcept {
        return static_cast<T*>(data());
    }
    // Size of the allocation in bytes, 0 when empty.
    [[nodiscard]] uint64_t size() const noexcept { return size_; }
    // The C exporter, still owned by this object (nullptr when empty).
    [[nodiscard]] DevshareExporter* get() const noexcept { return exp_.get(); }
    explicit operator bool() const noexcept { return exp_ != nullptr; }
    // Give up ownership: the caller must devshare_exporter_close the result. Leaves this empty.
    [[nodiscard]] DevshareExporter* release() noexcept {
        data_ = nullptr;
        size_ = 0;
        return exp_.release();
    }

    // A handle for the described tensor (describe(...) with addresses and offsets in this
    // allocation, bytes(), a TensorDesc or a C desc). Each success is one new reference.
    //     Handle h = exp.share(devshare::describe(p, {rows, cols}));   // float* p
    [[nodiscard]] Result<Handle> try_share(const TensorDesc& desc) const {
        DevshareTensorDesc c;
        const Result<const DevshareTensorDesc*> d = lower(desc, &c);
        if (!d) {
            return detail::failure(d.error());
        }
        return detail::get<Handle>([&](Handle* h) { return devshare_exporter_share(exp_.get(), *d, &h->raw()); });
    }
    // The same as a handle's byte encoding (devshare_exporter_share_encoded): the form that also
    // carries a segmented export's long segment table. Import it with Import::from_encoded.
    [[nodiscard]] Result<std::vector<uint8_t>> try_share_encoded(const TensorDesc& desc) const {
        DevshareTensorDesc c;
        const Result<const DevshareTensorDesc*> d = lower(desc, &c);
        if (!d) {
            return detail::failure(d.error());
        }
        // BUFFER_TOO_SMALL shares nothing: the second call makes the one reference.
        return detail::read_bytes(DEVSHARE_HANDLE_MAX_ENCODED_SIZE, [&](uint8_t* buf, size_t cap, size_t* len) {
            return devshare_exporter_share_encoded(exp_.get(), *d, buf, cap, len);
        });
    }

    // The segment table of a segmented export whose table does not fit a handle (empty for
    // other exports), for torch_storage_handle / handle_to_torch.
    [[nodiscard]] Result<std::vector<uint8_t>> try_segment_table() const {
        return detail::read_bytes(0, [this](uint8_t* buf, size_t cap, size_t* len) {
            return devshare_exporter_segment_table(exp_.get(), cap == 0 ? nullptr : buf, cap, len);
        });
    }
    // Let the importer with this pid import (acl pid whitelist; devshare_exporter_allow_pid).
    [[nodiscard]] Result<void> try_allow_pid(int32_t pid) const {
        return detail::call(devshare_exporter_allow_pid(exp_.get(), pid));
    }
    // References handed out and not yet released.
    [[nodiscard]] Result<uint64_t> try_outstanding() const {
        return detail::get<uint64_t>([&](uint64_t* n) { return devshare_exporter_outstanding(exp_.get(), n); });
    }
    // Wait until every reference was released: true when they were, false when `timeout` passed
    // first (kForever waits forever).
    [[nodiscard]] Result<bool> try_wait(std::chrono::milliseconds timeout) const {
        const int32_t s = devshare_exporter_wait(exp_.get(), static_cast<int64_t>(timeout.count()));
        if (s == DEVSHARE_STATUS_TIMEOUT) {
            return false;
        }
        return detail::get<bool>([s](bool*) { return s; }, true);
    }
    // Close the export; afterwards this Exporter is empty. Without Close::force a device export
    // with outstanding references is refused (DEVSHARE_STATUS_BUSY) and this Exporter stays as
    // it was. Host memory closes at once. An empty Exporter's close does nothing.
    [[nodiscard]] Result<void> try_close(Close flags = Close::normal) {
        if (exp_ == nullptr) {
            return {};
        }
        Result<void> r = detail::call(devshare_exporter_close(exp_.get(), static_cast<uint32_t>(flags)));
        if (r) {
            (void)release();
        }
        return r;
    }

#if DEVSHARE_HPP_EXCEPTIONS
    [[nodiscard]] Handle share(const TensorDesc& desc) const { return detail::value(try_share(desc)); }
    [[nodiscard]] std::vector<uint8_t> share_encoded(const TensorDesc& desc) const {
        return detail::value(try_share_encoded(desc));
    }
    [[nodiscard]] std::vector<uint8_t> segment_table() const { return detail::value(try_segment_table()); }
    void allow_pid(int32_t pid) const { detail::value(try_allow_pid(pid)); }
    [[nodiscard]] uint64_t outstanding() const { return detail::value(try_outstanding()); }
    [[nodiscard]] bool wait(std::chrono::milliseconds timeout) const { return detail::value(try_wait(timeout)); }
    void close(Close flags = Close::normal) { detail::value(try_close(flags)); }
#endif

private:
    static Result<Exporter> made(int32_t status, DevshareExporter* e, void* data, uint64_t size, DestroyPolicy p) {
        if (status != DEVSHARE_STATUS_OK) {
            return detail::failure(Error::from_last(status));
        }
        Exporter x;
        x.exp_ = detail::unique_c<DevshareExporter, detail::ExporterCloser>(e, detail::ExporterCloser{p});
        x.data_ = e != nullptr ? data : nullptr;
        x.size_ = e != nullptr ? size : 0;
        return x;
    }

    Result<const DevshareTensorDesc*> lower(const TensorDesc& desc, DevshareTensorDesc* c) const {
        if (exp_ == nullptr && desc.first == TensorDesc::First::address) {
            return detail::error(DEVSHARE_STATUS_NULL_ARGUMENT, "devshare::Exporter::share: the Exporter is empty");
        }
        return detail::lower("devshare::Exporter::share", desc, data_, size_, c);
    }

    detail::unique_c<DevshareExporter, detail::ExporterCloser> exp_;
    detail::cleared<void*> data_;
    detail::cleared<uint64_t> size_;
};

}  // namespace devshare

#endif  // DEVSHARE_EXPORTER_HPP
