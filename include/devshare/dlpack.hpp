/* SPDX-License-Identifier: Apache-2.0 */

// devshare/dlpack.hpp: DLPackVersioned / DLPackLegacy, owners of the DLPack managed tensors an
// Import gives (Import::to_dlpack_versioned / to_dlpack). Include dlpack.h first to have the
// layouts checked against it.

#ifndef DEVSHARE_DLPACK_HPP
#define DEVSHARE_DLPACK_HPP

#include "dtype.hpp"
#include "owner.hpp"

#include <cstddef>

namespace devshare {

namespace detail {

// The DLPack 1.x layouts (devshare.h only declares the managed structs, so that dlpack.h can be
// included next to it). DLPack's ABI is stable; with dlpack.h included first they are checked.
struct DLDeviceLayout {
    int32_t device_type;
    int32_t device_id;
};
struct DLTensorLayout {
    void* data;
    DLDeviceLayout device;
    int32_t ndim;
    DevshareDType dtype;
    int64_t* shape;
    int64_t* strides;
    uint64_t byte_offset;
};
struct DLManagedLayout {
    DLTensorLayout dl_tensor;
    void* manager_ctx;
    void (*deleter)(DLManagedLayout*);
};
struct DLVersionedLayout {
    uint32_t major;
    uint32_t minor;
    void* manager_ctx;
    void (*deleter)(DLVersionedLayout*);
    uint64_t flags;
    DLTensorLayout dl_tensor;
};

template <typename M>
struct DLLayoutOf;
template <>
struct DLLayoutOf<DLManagedTensorVersioned> {
    using type = DLVersionedLayout;
};
template <>
struct DLLayoutOf<DLManagedTensor> {
    using type = DLManagedLayout;
};

}  // namespace detail

#if defined(DLPACK_MAJOR_VERSION)
static_assert(sizeof(DLTensor) == sizeof(detail::DLTensorLayout) &&
                  offsetof(DLTensor, byte_offset) == offsetof(detail::DLTensorLayout, byte_offset),
              "devshare.hpp: DLTensor layout");
static_assert(offsetof(DLManagedTensor, deleter) == offsetof(detail::DLManagedLayout, deleter),
              "devshare.hpp: DLManagedTensor layout");
#if DLPACK_MAJOR_VERSION >= 1
static_assert(offsetof(DLManagedTensorVersioned, deleter) == offsetof(detail::DLVersionedLayout, deleter) &&
                  offsetof(DLManagedTensorVersioned, dl_tensor) == offsetof(detail::DLVersionedLayout, dl_tensor),
              "devshare.hpp: DLManagedTensorVersioned layout");
#endif
#endif

// Owns one DLPack managed tensor made from an Import: the destructor (or reset()) runs its
// deleter; release() hands it to a framework (e.g. in a "dltensor_versioned" PyCapsule), which
// then runs the deleter. It holds its own reference to the import: the Import may be released
// first. Move-only.
template <typename M>
class DLPackTensor {
    using Layout = typename detail::DLLayoutOf<M>::type;
    struct RunDeleter {
        void operator()(M* m) const noexcept {
            Layout* l = reinterpret_cast<Layout*>(m);
            if (l->deleter != nullptr) {
                l->deleter(l);
            }
        }
    };

public:
    DLPackTensor() noexcept = default;
    explicit DLPackTensor(M* managed) noexcept : p_(managed) {}

    // Run the deleter now (nothing when empty).
    void reset() noexcept { p_.reset(); }
    // Give up ownership: whoever takes the pointer runs its deleter.
    [[nodiscard]] M* release() noexcept { return p_.release(); }
    [[nodiscard]] M* get() const noexcept { return p_.get(); }
    explicit operator bool() const noexcept { return p_ != nullptr; }

    // The DLTensor's fields (precondition: not empty).
    [[nodiscard]] void* data() const noexcept { return tensor().data; }
    [[nodiscard]] int32_t ndim() const noexcept { return tensor().ndim; }
    [[nodiscard]] Dims shape() const noexcept { return Dims(tensor().shape, static_cast<size_t>(tensor().ndim)); }
    [[nodiscard]] Dims strides() const noexcept {
        return tensor().strides == nullptr ? Dims() : Dims(tensor().strides, static_cast<size_t>(tensor().ndim));
    }
    [[nodiscard]] DevshareDType dtype() const noexcept { return tensor().dtype; }
    [[nodiscard]] uint64_t byte_offset() const noexcept { return tensor().byte_offset; }
    // DLDeviceType: kDLCPU 1 (host), kDLCUDA 2 (cuda), kDLExtDev 12 (acl).
    [[nodiscard]] int32_t device_type() const noexcept { return tensor().device.device_type; }
    [[nodiscard]] int32_t device_id() const noexcept { return tensor().device.device_id; }

    // DLManagedTensorVersioned only: its DLPack version and flags (bit 0: read-only).
    template <typename N = M, typename = std::enable_if_t<std::is_same<N, DLManagedTensorVersioned>::value>>
    [[nodiscard]] uint32_t version_major() const noexcept {
        return layout()->major;
    }
    template <typename N = M, typename = std::enable_if_t<std::is_same<N, DLManagedTensorVersioned>::value>>
    [[nodiscard]] uint32_t version_minor() const noexcept {
        return layout()->minor;
    }
    template <typename N = M, typename = std::enable_if_t<std::is_same<N, DLManagedTensorVersioned>::value>>
    [[nodiscard]] uint64_t flags() const noexcept {
        return layout()->flags;
    }
    template <typename N = M, typename = std::enable_if_t<std::is_same<N, DLManagedTensorVersioned>::value>>
    [[nodiscard]] bool read_only() const noexcept {
        return (layout()->flags & 1u) != 0;
    }

private:
    Layout* layout() const noexcept { return reinterpret_cast<Layout*>(p_.get()); }
    const detail::DLTensorLayout& tensor() const noexcept { return layout()->dl_tensor; }

    detail::unique_c<M, RunDeleter> p_;
};

using DLPackVersioned = DLPackTensor<DLManagedTensorVersioned>;
using DLPackLegacy = DLPackTensor<DLManagedTensor>;

}  // namespace devshare

#endif  // DEVSHARE_DLPACK_HPP
