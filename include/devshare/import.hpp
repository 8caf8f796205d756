/* SPDX-License-Identifier: Apache-2.0 */

// devshare/import.hpp: Import, the owner of one import of a handle (or of a channel item), with
// typed views (as<T>, DLPack).

#ifndef DEVSHARE_IMPORT_HPP
#define DEVSHARE_IMPORT_HPP

#include <string_view>

#include "dlpack.hpp"
#include "handle.hpp"
#include "owner.hpp"
#include "view.hpp"

namespace devshare {

// Import options with the given DEVSHARE_IMPORT_* flags, device and stream (defaults:
// read-write, the handle's device, no stream: event waits block).
[[nodiscard]] inline DevshareImportOptions import_options(uint32_t flags = 0,
                                                          int32_t device = DEVSHARE_DEVICE_FROM_HANDLE,
                                                          void* stream = nullptr) noexcept {
    DevshareImportOptions o{};
    (void)devshare_import_options_init(&o, sizeof o);  // cannot fail for a non-NULL pointer and sizeof
    o.flags = flags;
    o.device = device;
    o.stream = stream;
    return o;
}

// Which pool slot an Import received from a channel is (Import::pool_slot): the pool's id on
// that channel (> 0) and the slot's index.
struct PoolSlot {
    uint32_t pool = 0;
    uint32_t slot = 0;
};

// Owns one import of a handle (DevshareImport). Move-only and two pointers in size (a move
// copies no handle); a moved-from or default-constructed Import is empty: data() is nullptr and
// destroying or releasing it does nothing. Destroying a non-empty Import releases it (errors are
// ignored); the reference goes back to the exporter when this was the process's last import of
// that handle. The import's info and handle are read once, at construction, into one heap block,
// which also tells the views made by as<T> whether this Import still holds the memory.
class Import {
public:
    Import() noexcept = default;

    // Import `handle` (options nullptr: read-write, the handle's device). The handle is not kept.
    [[nodiscard]] static Result<Import> try_from(const Handle& handle, const DevshareImportOptions* options = nullptr) {
        DevshareImport* raw = nullptr;
        const int32_t s = devshare_import(&handle.raw(), options, &raw);
        return made(s, raw);
    }
    // Import a handle's byte encoding (devshare_import_encoded: also segmented handles whose
    // table travels in the encoding).
    [[nodiscard]] static Result<Import> try_from_encoded(Span<const uint8_t> bytes,
                                                         const DevshareImportOptions* options = nullptr) {
        DevshareImport* raw = nullptr;
        const int32_t s = devshare_import_encoded(bytes.data(), bytes.size(), options, &raw);
        return made(s, raw);
    }
    // Import handle text (devshare_import_text).
    [[nodiscard]] static Result<Import> try_from_text(const char* text, const DevshareImportOptions* options = nullptr) {
        DevshareImport* raw = nullptr;
        const int32_t s = devshare_import_text(text, options, &raw);
        return made(s, raw);
    }
    [[nodiscard]] static Result<Import> try_from_text(const std::string& text,
                                                      const DevshareImportOptions* options = nullptr) {
        return try_from_text(text.c_str(), options);
    }
    // Import the storage a PyTorch (cuda) or torch_npu (acl) tuple names (devshare_import_torch).
    [[nodiscard]] static Result<Import> try_from_torch(const DevshareTorchArgs& args,
                                                       const DevshareImportOptions* options = nullptr) {
        DevshareImport* raw = nullptr;
        const int32_t s = devshare_import_torch(&args, options, &raw);
        return made(s, raw);
    }
    // The same four with options by reference.
    [[nodiscard]] static Result<Import> try_from(const Handle& h, const DevshareImportOptions& o) { return try_from(h, &o); }
    [[nodiscard]] static Result<Import> try_from_encoded(Span<const uint8_t> b, const DevshareImportOptions& o) {
        return try_from_encoded(b, &o);
    }
    [[nodiscard]] static Result<Import> try_from_text(const std::string& t, const DevshareImportOptions& o) {
        return try_from_text(t.c_str(), &o);
    }
    [[nodiscard]] static Result<Import> try_from_torch(const DevshareTorchArgs& a, const DevshareImportOptions& o) {
        return try_from_torch(a, &o);
    }

    // Take ownership of a C import (nullptr: an empty Import). On failure (its info cannot be
    // read) the import stays the caller's.
    [[nodiscard]] static Result<Import> try_adopt(DevshareImport* raw) {
        Import imp;
        if (raw == nullptr) {
            return imp;
        }
        detail::unique_c<Meta, DeleteMeta> meta(new Meta);
        (void)devshare_import_info_init(&meta->info, sizeof meta->info);  // cannot fail: non-NULL, sizeof
        int32_t s = devshare_import_info(raw, &meta->info);
        if (s == DEVSHARE_STATUS_OK) {
            s = devshare_import_handle(raw, &meta->handle.raw());
        }
        if (s != DEVSHARE_STATUS_OK) {
            return detail::failure(Error::from_last(s));
        }
        imp.imp_.reset(raw);
        imp.meta_.reset(meta.release());
        return imp;
    }

#if DEVSHARE_HPP_EXCEPTIONS
    explicit Import(const Handle& handle, const DevshareImportOptions* options = nullptr)
        : Import(detail::value(try_from(handle, options))) {}
    Import(const Handle& handle, const DevshareImportOptions& options) : Import(handle, &options) {}
    [[nodiscard]] static Import from(const Handle& handle, const DevshareImportOptions* options = nullptr) {
        return detail::value(try_from(handle, options));
    }
    [[nodiscard]] static Import from_encoded(Span<const uint8_t> bytes, const DevshareImportOptions* options = nullptr) {
        return detail::value(try_from_encoded(bytes, options));
    }
    [[nodiscard]] static Import from_text(const std::string& text, const DevshareImportOptions* options = nullptr) {
        return detail::value(try_from_text(text, options));
    }
    [[nodiscard]] static Import from_torch(const DevshareTorchArgs& args,
                                           const DevshareImportOptions* options = nullptr) {
        return detail::value(try_from_torch(args, options));
    }
#endif

    // The tensor's first element, unchecked (nullptr when empty). Valid until release.
    [[nodiscard]] void* data() const noexcept { return info().data; }

    // The tensor's first element as T*, checked in every build: T must be the tensor's element
    // type (DEVSHARE_STATUS_BAD_DTYPE: no reinterpretation), a const T for a read-only import
    // (INVALID_ARGUMENT), and the Import not empty (NULL_ARGUMENT). A failed check throws the
    // devshare::Error; built without exceptions it is printed and the program aborts, as value() of
    // a failed Result does. try_data<T>() returns the Error instead. T = std::byte (or void) gives
    // the bytes unchecked (nullptr when empty), as data() does.
    template <typename T>
    [[nodiscard]] T* data() const {
        using U = std::remove_cv_t<T>;
        if constexpr (std::is_void<U>::value || std::is_same<U, std::byte>::value) {
            return static_cast<T*>(data());
        } else {
            Result<T*> p = try_data<T>();
            if (!p) {
                detail::fail(p.error(), "a checked access failed");
            }
            return *p;
        }
    }
    template <typename T>
    [[nodiscard]] Result<T*> try_data() const {
        using U = std::remove_cv_t<T>;
        if constexpr (std::is_void<U>::value || std::is_same<U, std::byte>::value) {
            return static_cast<T*>(data());
        } else {
            static_assert(has_dtype_v<U>, "devshare::Import::data<T>: T has no dtype; use data() or data<std::byte>()");
            const int32_t s = typed(dtype_of<U>(), std::is_const<T>::value);
            if (s != DEVSHARE_STATUS_OK) {
                return detail::failure(refusal(s, "data", dtype_of<U>()));
            }
            return static_cast<T*>(data());
        }
    }

    // A strided view of the tensor as elements of type T. Refused (DEVSHARE_STATUS_BAD_DTYPE)
    // when T is not the tensor's element type: no reinterpretation. A read-only import needs a
    // const T (DEVSHARE_STATUS_INVALID_ARGUMENT otherwise). The view knows when this Import is
    // released, destroyed or assigned over: its accessors then fail with ALREADY_RELEASED
    // (view.hpp).
    template <typename T>
    [[nodiscard]] Result<TensorView<T>> try_as() const {
        using U = std::remove_cv_t<T>;
        static_assert(has_dtype_v<U>, "devshare::Import::as<T>: T has no dtype");
        const int32_t s = typed(dtype_of<U>(), std::is_const<T>::value);
        if (s != DEVSHARE_STATUS_OK) {
            return detail::failure(refusal(s, "as", dtype_of<U>()));
        }
        return TensorView<T>(static_cast<T*>(data()), shape(), strides(), detail::liveness_ref(meta_.get()));
    }

    // DLPack views of the import (each holds its own reference to it); the legacy
    // DLManagedTensor cannot say read-only.
    [[nodiscard]] Result<DLPackVersioned> try_to_dlpack_versioned() const {
        return dlpack<DLPackVersioned>(&devshare_import_to_dlpack_versioned);
    }
    [[nodiscard]] Result<DLPackLegacy> try_to_dlpack() const { return dlpack<DLPackLegacy>(&devshare_import_to_dlpack); }

    // For an item received from a channel that is a pool slot (Connection::recv): the pool's id
    // and the slot's index (devshare_import_pool_slot). Any other import (a leased reference, an
    // import of a handle) is DEVSHARE_STATUS_INVALID_ARGUMENT; an empty Import NULL_ARGUMENT.
    [[nodiscard]] Result<PoolSlot> try_pool_slot() const {
        return detail::get<PoolSlot>(
            [&](PoolSlot* ps) { return devshare_import_pool_slot(imp_.get(), &ps->pool, &ps->slot); });
    }
    // The name the producer gave this lease (devshare_import_name, 1.11: a state dict's key sent
    // with devshare_channel_send_named or Python's send_batch of a dict): empty when it has none
    // (a pool item, an import of a handle, a lease sent without one). Valid while this Import
    // lives. An empty Import: DEVSHARE_STATUS_NULL_ARGUMENT.
    [[nodiscard]] Result<std::string_view> try_name() const {
        return detail::get<std::string_view>([&](std::string_view* out) {
            const char* text = nullptr;
            size_t len = 0;
            const int32_t st = devshare_import_name(imp_.get(), &text, &len);
            if (st == DEVSHARE_STATUS_OK && text != nullptr) {
                *out = std::string_view(text, len);
            }
            return st;
        });
    }
    // For a channel item: give it back to the producer now (devshare_import_give_back) while
    // this Import stays mapped until it is released or destroyed; what is read meanwhile is
    // whatever the producer writes there next. Any other import: DEVSHARE_STATUS_INVALID_ARGUMENT.
    [[nodiscard]] Result<void> try_give_back() const { return detail::call(devshare_import_give_back(imp_.get())); }

#if DEVSHARE_HPP_EXCEPTIONS
    template <typename T>
    [[nodiscard]] TensorView<T> as() const {
        return detail::value(try_as<T>());
    }
    [[nodiscard]] DLPackVersioned to_dlpack_versioned() const { return detail::value(try_to_dlpack_versioned()); }
    [[nodiscard]] DLPackLegacy to_dlpack() const { return detail::value(try_to_dlpack()); }
    [[nodiscard]] PoolSlot pool_slot() const { return detail::value(try_pool_slot()); }
    [[nodiscard]] std::string_view name() const { return detail::value(try_name()); }
    void give_back() const { detail::value(try_give_back()); }
#endif

    // Pointers and sizes of the import (all zero when empty).
    [[nodiscard]] const DevshareImportInfo& info() const noexcept { return meta_ ? meta_->info : empty().info; }
    // The handle this import was made from (an empty Handle when the Import is empty).
    [[nodiscard]] const Handle& handle() const noexcept { return meta_ ? meta_->handle : empty().handle; }
    [[nodiscard]] DevshareDType dtype() const noexcept { return handle().dtype(); }
    [[nodiscard]] uint32_t ndim() const noexcept { return handle().ndim(); }
    [[nodiscard]] Dims shape() const noexcept { return handle().shape(); }
    [[nodiscard]] Dims strides() const noexcept { return handle().strides(); }
    [[nodiscard]] uint64_t numel() const noexcept { return info().numel; }
    [[nodiscard]] uint64_t element_size() const noexcept { return info().element_size; }
    [[nodiscard]] bool read_only() const noexcept { return info().read_only != 0; }
    // Device the allocation was imported on (0 for host), and its backend.
    [[nodiscard]] int32_t device() const noexcept { return info().device; }
    [[nodiscard]] uint16_t backend() const noexcept { return info().backend; }

    // The C import, still owned by this object (nullptr when empty).
    [[nodiscard]] DevshareImport* get() const noexcept { return imp_.get(); }
    explicit operator bool() const noexcept { return imp_ != nullptr; }

    // Release now (see the class comment); afterwards this Import is empty, its pointers are
    // invalid and its views (as<T>) fail with ALREADY_RELEASED. Releasing an empty Import does
    // nothing.
    [[nodiscard]] Result<void> try_release() {
        if (imp_ == nullptr) {
            return {};
        }
        meta_.reset();
        return detail::call(devshare_import_release(imp_.release()));
    }
#if DEVSHARE_HPP_EXCEPTIONS
    void release() { detail::value(try_release()); }
#endif

private:
    // The info and handle read at construction, and the liveness the views of this import share:
    // released with the import, deleted with the last view.
    struct Meta final : detail::liveness {
        DevshareImportInfo info{};
        Handle handle;
    };
    struct DeleteMeta {
        void operator()(Meta* m) const noexcept {
            m->end();
            m->drop();
        }
    };
    static const Meta& empty() noexcept {
        static const Meta m;
        return m;
    }

    template <typename D, typename M>
    Result<D> dlpack(int32_t (*to_dlpack)(const DevshareImport*, M**)) const {
        M* m = nullptr;
        const int32_t s = to_dlpack(imp_.get(), &m);
        if (s != DEVSHARE_STATUS_OK) {
            return detail::failure(Error::from_last(s));
        }
        return D(m);
    }

    // The checks of data<T> and as<T>: OK, NULL_ARGUMENT (empty), BAD_DTYPE or INVALID_ARGUMENT
    // (a writable T of a read-only import).
    int32_t typed(DevshareDType want, bool const_t) const noexcept {
        if (imp_ == nullptr) {
            return DEVSHARE_STATUS_NULL_ARGUMENT;
        }
        if (!same_dtype(dtype(), want)) {
            return DEVSHARE_STATUS_BAD_DTYPE;
        }
        return !const_t && read_only() ? DEVSHARE_STATUS_INVALID_ARGUMENT : DEVSHARE_STATUS_OK;
    }
    Error refusal(int32_t status, const char* function, DevshareDType want) const {
        const std::string who = std::string("devshare::Import::") + function;
        if (status == DEVSHARE_STATUS_NULL_ARGUMENT) {
            return Error(status, who + ": the Import is empty");
        }
        const std::string typed_who = who + "<" + dtype_name(want) + ">: ";
        if (status == DEVSHARE_STATUS_BAD_DTYPE) {
            return Error(status, typed_who + "the tensor's dtype is " + dtype_name(dtype()));
        }
        return Error(status, typed_who + "the import is read-only; ask for a const element type");
    }

    static Result<Import> made(int32_t status, DevshareImport* raw) {
        if (status != DEVSHARE_STATUS_OK) {
            return detail::failure(Error::from_last(status));
        }
        Result<Import> imp = try_adopt(raw);
        if (!imp) {
            (void)devshare_import_release(raw);
        }
        return imp;
    }

    detail::closed_by<DevshareImport, &devshare_import_release> imp_;
    detail::unique_c<Meta, DeleteMeta> meta_;
};

}  // namespace devshare

#endif  // DEVSHARE_IMPORT_HPP
