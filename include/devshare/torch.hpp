/* SPDX-License-Identifier: Apache-2.0 */

// devshare/torch.hpp: PyTorch and torch_npu tuples. TorchStorage (the storage 8-tuple their
// rebuild functions take), torch_args (a received tuple for the C calls), handles from and to
// tuples, storage-handle formats by torch version and the version bridge.

#ifndef DEVSHARE_TORCH_HPP
#define DEVSHARE_TORCH_HPP

#include "handle.hpp"

#include <array>

namespace devshare {

// The storage 8-tuple (device, handle, storage_size_bytes, storage_offset_bytes, ref_counter_name,
// ref_counter_slot, event_handle, event_sync_required) that PyTorch's _new_shared_cuda and
// torch_npu's _new_shared_npu rebuild a storage from (handle_to_torch). Pass each byte field as a
// Python bytes object.
struct TorchStorage {
    int32_t device = 0;
    std::vector<uint8_t> handle;  // the complete storage handle (also when longer than the C struct holds)
    uint64_t storage_size = 0;
    uint64_t storage_offset = 0;
    std::string ref_name;  // with its leading '/'; empty: none (send b"")
    uint64_t ref_slot = 0;
    std::array<uint8_t, DEVSHARE_EVENT_HANDLE_SIZE> event_handle{};
    bool event_sync_required = false;
    DevshareTorchStorage raw{};  // what devshare_handle_to_torch wrote
};

// DevshareTorchArgs of this header's size, all zero but `backend` (DEVSHARE_BACKEND_CUDA for
// PyTorch, DEVSHARE_BACKEND_ACL for torch_npu). Fill in the tuple's fields.
[[nodiscard]] inline DevshareTorchArgs torch_args(uint16_t backend = 0) noexcept {
    DevshareTorchArgs a{};
    (void)devshare_torch_args_init(&a, sizeof a);  // cannot fail for a non-NULL pointer and sizeof
    a.backend = backend;
    return a;
}

// DevshareTorchArgs for a tuple received as `storage` plus the tensor part (dtype, shape,
// strides, tensor offset), for handle_from_torch, Import::from_torch and torch_discard. The
// result points into `storage`, `shape` and `strides`: they must outlive its use.
[[nodiscard]] inline DevshareTorchArgs torch_args(uint16_t backend, const TorchStorage& storage, DevshareDType dtype,
                                                  Dims shape, Dims strides = {}, int64_t tensor_offset = 0) noexcept {
    DevshareTorchArgs a = torch_args(backend);
    a.dtype = dtype;
    a.ndim = static_cast<uint32_t>(shape.size());
    a.shape = shape.empty() ? nullptr : shape.data();
    a.strides = strides.empty() ? nullptr : strides.data();
    a.tensor_offset = tensor_offset;
    a.device = storage.device;
    a.handle = storage.handle.data();
    a.handle_len = storage.handle.size();
    a.storage_size = storage.storage_size;
    a.storage_offset = storage.storage_offset;
    a.ref_name = reinterpret_cast<const uint8_t*>(storage.ref_name.data());
    a.ref_name_len = storage.ref_name.size();
    a.ref_slot = storage.ref_slot;
    a.event_handle = storage.event_handle.data();
    a.event_handle_len = storage.event_handle.size();
    a.event_sync_required = storage.event_sync_required ? 1u : 0u;
    return a;
}

// A handle from a PyTorch (cuda) or torch_npu (acl) tuple (devshare_handle_from_torch).
[[nodiscard]] inline Result<Handle> try_handle_from_torch(const DevshareTorchArgs& args) {
    return detail::get<Handle>([&](Handle* h) { return devshare_handle_from_torch(&args, &h->raw()); });
}

// The same as the handle's byte encoding, which also carries a long segment table
// (devshare_handle_from_torch_encoded); import it with Import::from_encoded.
[[nodiscard]] inline Result<std::vector<uint8_t>> try_handle_from_torch_encoded(const DevshareTorchArgs& args) {
    return detail::read_bytes(DEVSHARE_HANDLE_MAX_ENCODED_SIZE, [&](uint8_t* buf, size_t cap, size_t* len) {
        return devshare_handle_from_torch_encoded(&args, buf, cap, len);
    });
}

// The storage handle bytes (tuple item 1) of a device handle (devshare_torch_storage_handle, or
// devshare_torch_storage_handle_as for another `format` than DEVSHARE_TORCH_FORMAT_DEFAULT: the
// consumer's format, e.g. from torch_format_for_version). `table`: the exporter's segment table
// (Exporter::segment_table()) for a segmented handle whose table is not inline; empty otherwise.
[[nodiscard]] inline Result<std::vector<uint8_t>> try_torch_storage_handle(
    const Handle& handle, Span<const uint8_t> table = {}, uint32_t format = DEVSHARE_TORCH_FORMAT_DEFAULT) {
    const uint8_t* t = table.empty() ? nullptr : table.data();
    return detail::read_bytes(DEVSHARE_TORCH_HANDLE_CAPACITY, [&](uint8_t* buf, size_t cap, size_t* len) {
        return format == DEVSHARE_TORCH_FORMAT_DEFAULT
                   ? devshare_torch_storage_handle(&handle.raw(), t, table.size(), buf, cap, len)
                   : devshare_torch_storage_handle_as(&handle.raw(), t, table.size(), format, buf, cap, len);
    });
}

// The storage-handle format (DEVSHARE_TORCH_FORMAT_*) a consumer running this torch version reads
// (devshare_torch_format_for_version): e.g. "2.11.0+cu128" -> _V2, "2.13.0" -> _V3.
[[nodiscard]] inline Result<uint32_t> try_torch_format_for_version(uint16_t backend, const char* torch_version) {
    return detail::get<uint32_t>(
        [&](uint32_t* f) { return devshare_torch_format_for_version(backend, torch_version, f); });
}

// The version bridge (devshare_torch_handle_convert): a PyTorch / torch_npu storage handle
// rewritten in `format`, for a consumer of another torch version.
[[nodiscard]] inline Result<std::vector<uint8_t>> try_torch_handle_convert(uint16_t backend,
                                                                           Span<const uint8_t> storage_handle,
                                                                           uint32_t format) {
    return detail::read_bytes(storage_handle.size() + 8, [&](uint8_t* buf, size_t cap, size_t* len) {
        return devshare_torch_handle_convert(backend, storage_handle.data(), storage_handle.size(), format, buf, cap,
                                             len);
    });
}

// The storage 8-tuple a stock PyTorch / torch_npu consumer opens, for a device handle
// (devshare_handle_to_torch, or devshare_handle_to_torch_as for another `format`; the storage
// handle completed with try_torch_storage_handle when it is longer than the C struct holds,
// using `table` as there).
[[nodiscard]] inline Result<TorchStorage> try_handle_to_torch(const Handle& handle, Span<const uint8_t> table = {},
                                                              uint32_t format = DEVSHARE_TORCH_FORMAT_DEFAULT) {
    TorchStorage t;
    (void)devshare_torch_storage_init(&t.raw, sizeof t.raw);  // cannot fail: non-NULL, sizeof
    const int32_t s = format == DEVSHARE_TORCH_FORMAT_DEFAULT ? devshare_handle_to_torch(&handle.raw(), &t.raw)
                                                              : devshare_handle_to_torch_as(&handle.raw(), format, &t.raw);
    if (s != DEVSHARE_STATUS_OK) {
        return detail::failure(Error::from_last(s));
    }
    if (t.raw.handle_len <= DEVSHARE_TORCH_HANDLE_CAPACITY) {
        t.handle.assign(t.raw.handle, t.raw.handle + t.raw.handle_len);
    } else {
        Result<std::vector<uint8_t>> bytes = try_torch_storage_handle(handle, table, format);
        if (!bytes) {
            return detail::failure(bytes.error());
        }
        t.handle = std::move(*bytes);
    }
    t.device = t.raw.device;
    t.storage_size = t.raw.storage_size;
    t.storage_offset = t.raw.storage_offset;
    const size_t name_len = t.raw.ref_name_len < sizeof t.raw.ref_name ? t.raw.ref_name_len : sizeof t.raw.ref_name;
    t.ref_name.assign(reinterpret_cast<const char*>(t.raw.ref_name), name_len);
    t.ref_slot = t.raw.ref_slot;
    std::memcpy(t.event_handle.data(), t.raw.event_handle, t.event_handle.size());
    t.event_sync_required = t.raw.event_sync_required != 0;
    return t;
}

// Return the reference a PyTorch tuple carries without importing it (devshare_torch_discard).
[[nodiscard]] inline Result<void> try_torch_discard(const DevshareTorchArgs& args) {
    return detail::call(devshare_torch_discard(&args));
}

#if DEVSHARE_HPP_EXCEPTIONS
[[nodiscard]] inline Handle handle_from_torch(const DevshareTorchArgs& args) {
    return detail::value(try_handle_from_torch(args));
}
[[nodiscard]] inline std::vector<uint8_t> handle_from_torch_encoded(const DevshareTorchArgs& args) {
    return detail::value(try_handle_from_torch_encoded(args));
}
[[nodiscard]] inline std::vector<uint8_t> torch_storage_handle(const Handle& handle, Span<const uint8_t> table = {},
                                                               uint32_t format = DEVSHARE_TORCH_FORMAT_DEFAULT) {
    return detail::value(try_torch_storage_handle(handle, table, format));
}
[[nodiscard]] inline TorchStorage handle_to_torch(const Handle& handle, Span<const uint8_t> table = {},
                                                 uint32_t format = DEVSHARE_TORCH_FORMAT_DEFAULT) {
    return detail::value(try_handle_to_torch(handle, table, format));
}
[[nodiscard]] inline uint32_t torch_format_for_version(uint16_t backend, const char* torch_version) {
    return detail::value(try_torch_format_for_version(backend, torch_version));
}
[[nodiscard]] inline std::vector<uint8_t> torch_handle_convert(uint16_t backend, Span<const uint8_t> storage_handle,
                                                               uint32_t format) {
    return detail::value(try_torch_handle_convert(backend, storage_handle, format));
}
inline void torch_discard(const DevshareTorchArgs& args) { detail::value(try_torch_discard(args)); }
#endif

}  // namespace devshare

#endif  // DEVSHARE_TORCH_HPP
