/* SPDX-License-Identifier: Apache-2.0 */

// devshare/handle.hpp: Handle (one shared tensor's handle, a value type), TensorDesc and the
// describe(...) functions (the one way to say which tensor to share or send), and the
// library-wide calls: version, probe, local_pid, allow_ptrace.

#ifndef DEVSHARE_HANDLE_HPP
#define DEVSHARE_HANDLE_HPP

#include "dtype.hpp"
#include "error.hpp"

#include <cstring>
#include <vector>

namespace devshare {

// The linked library's version, (major << 16) | (minor << 8) | patch.
[[nodiscard]] inline uint32_t version() noexcept { return devshare_version(); }

// Whether `backend` (DEVSHARE_BACKEND_*) is usable in this process, and why not (an unusable
// backend is a success with usable == 0). Unknown backend ids are an error.
[[nodiscard]] inline Result<DevshareBackendInfo> try_probe(uint16_t backend) {
    DevshareBackendInfo info{};
    (void)devshare_backend_info_init(&info, sizeof info);  // cannot fail: non-NULL, sizeof
    return detail::get<DevshareBackendInfo>([&](DevshareBackendInfo* i) { return devshare_probe(backend, i); }, info);
}

// The pid an exporter must allow (Exporter::allow_pid) for this process to import on `backend`
// and `device` (devshare_local_pid: the bare tgid on Ascend, getpid() elsewhere).
[[nodiscard]] inline Result<int32_t> try_local_pid(uint16_t backend, int32_t device = 0) {
    return detail::get<int32_t>([&](int32_t* pid) { return devshare_local_pid(backend, device, pid); });
}

// Let process `pid` take this process's file descriptors with pidfd_getfd under Yama
// ptrace_scope 1 (-1: any process, 0: nobody again); see devshare_allow_ptrace.
[[nodiscard]] inline Result<void> try_allow_ptrace(int32_t pid) { return detail::call(devshare_allow_ptrace(pid)); }

#if DEVSHARE_HPP_EXCEPTIONS
[[nodiscard]] inline DevshareBackendInfo probe(uint16_t backend) { return detail::value(try_probe(backend)); }
[[nodiscard]] inline int32_t local_pid(uint16_t backend, int32_t device = 0) {
    return detail::value(try_local_pid(backend, device));
}
inline void allow_ptrace(int32_t pid) { detail::value(try_allow_ptrace(pid)); }
#endif

namespace detail {

// Calls `c_call(buf, cap, &len)` with a buffer of `guess` bytes and, when the C function says
// BUFFER_TOO_SMALL with the length it needs, once more with that length.
template <typename F>
Result<std::vector<uint8_t>> read_bytes(size_t guess, F&& c_call) {
    std::vector<uint8_t> buf(guess);
    size_t len = 0;
    int32_t s = c_call(buf.data(), buf.size(), &len);
    if (s == DEVSHARE_STATUS_BUFFER_TOO_SMALL && len > buf.size()) {
        buf.assign(len, 0);
        s = c_call(buf.data(), buf.size(), &len);
    }
    if (s != DEVSHARE_STATUS_OK) {
        return failure(Error::from_last(s));
    }
    buf.resize(len);
    return buf;
}

}  // namespace detail

// One shared tensor's handle: plain data (616 bytes, no heap), copy it freely. A handle produced
// by Exporter::share() is one reference owed to the exporter: import it (the import's release
// returns it) or discard() it; give each consumer its own (copies of one handle are the same
// reference, returned once).
class Handle {
public:
    // An empty handle of this library's layout (devshare_handle_init); not valid until filled.
    Handle() noexcept { (void)devshare_handle_init(&raw_); }
    // Wrap a C handle (copied; not validated: call try_validate()).
    explicit Handle(const DevshareHandle& raw) noexcept : raw_(raw) {}

    // The C struct, for passing to C code or reading fields without an accessor.
    [[nodiscard]] const DevshareHandle& raw() const noexcept { return raw_; }
    [[nodiscard]] DevshareHandle& raw() noexcept { return raw_; }

    // Accessors (of the fields as they are: validate a handle you did not get from devshare).
    [[nodiscard]] DevshareDType dtype() const noexcept { return raw_.dtype; }
    [[nodiscard]] uint32_t ndim() const noexcept { return raw_.ndim; }
    // Sizes and strides in elements, ndim() entries (pointing into this Handle).
    [[nodiscard]] Dims shape() const noexcept { return Dims(raw_.shape, clamped_ndim()); }
    [[nodiscard]] Dims strides() const noexcept { return Dims(raw_.strides, clamped_ndim()); }
    // Number of elements (1 for ndim 0).
    [[nodiscard]] int64_t numel() const noexcept {
        int64_t n = 1;
        for (const int64_t d : shape()) {
            n *= d;
        }
        return n;
    }
    [[nodiscard]] uint64_t element_size() const noexcept { return devshare::element_size(raw_.dtype); }
    [[nodiscard]] uint16_t backend() const noexcept { return raw_.backend; }  // DEVSHARE_BACKEND_*
    // Device index as numbered in the exporting process (0 for host).
    [[nodiscard]] int32_t device() const noexcept { return raw_.device_index; }
    // Byte offset of the storage in the allocation, its size, the allocation's size.
    [[nodiscard]] uint64_t storage_offset() const noexcept { return raw_.storage_offset; }
    [[nodiscard]] uint64_t storage_size() const noexcept { return raw_.storage_size; }
    [[nodiscard]] uint64_t alloc_size() const noexcept { return raw_.alloc_size; }
    // Element offset of the tensor's first element in the storage.
    [[nodiscard]] int64_t tensor_offset() const noexcept { return raw_.tensor_offset; }
    [[nodiscard]] uint32_t flags() const noexcept { return raw_.flags; }  // DEVSHARE_HANDLE_FLAG_*
    // A segmented (VMM, expandable-segment) allocation (DEVSHARE_HANDLE_FLAG_SEGMENTED).
    [[nodiscard]] bool segmented() const noexcept { return (raw_.flags & DEVSHARE_HANDLE_FLAG_SEGMENTED) != 0; }
    // The consumer waits on an interprocess event before use (DEVSHARE_HANDLE_FLAG_EVENT).
    [[nodiscard]] bool has_event() const noexcept { return (raw_.flags & DEVSHARE_HANDLE_FLAG_EVENT) != 0; }
    // Process id of the exporter (0 when unknown).
    [[nodiscard]] int32_t producer_pid() const noexcept { return raw_.producer_pid; }
    // Whether the element type is T's.
    template <typename T>
    [[nodiscard]] bool is() const noexcept {
        return same_dtype(raw_.dtype, dtype_of<T>());
    }

    // Check every field (the error names the first invalid one).
    [[nodiscard]] Result<void> try_validate() const { return detail::call(devshare_handle_validate(&raw_)); }

    // Text form ("devshare1:..."), safe for command lines, environment variables and JSON.
    [[nodiscard]] Result<std::string> try_to_text() const {
        Result<std::vector<uint8_t>> t = detail::read_bytes(DEVSHARE_HANDLE_MAX_TEXT_SIZE, [&](uint8_t* b, size_t n, size_t* len) {
            const int32_t s = devshare_handle_to_text(&raw_, reinterpret_cast<char*>(b), n, len);
            *len += s == DEVSHARE_STATUS_BUFFER_TOO_SMALL ? 1 : 0;  // room for the terminating NUL
            return s;
        });
        if (!t) {
            return detail::failure(t.error());
        }
        return std::string(t->begin(), t->end());
    }

    // Parse and validate handle text (surrounding whitespace is ignored).
    [[nodiscard]] static Result<Handle> try_from_text(const char* text) {
        return detail::get<Handle>([&](Handle* h) { return devshare_handle_from_text(text, &h->raw_); });
    }
    [[nodiscard]] static Result<Handle> try_from_text(const std::string& text) { return try_from_text(text.c_str()); }

    // Canonical byte encoding.
    [[nodiscard]] Result<std::vector<uint8_t>> try_encode() const {
        return detail::read_bytes(DEVSHARE_HANDLE_MAX_ENCODED_SIZE, [&](uint8_t* buf, size_t cap, size_t* len) {
            return devshare_handle_encode(&raw_, buf, cap, len);
        });
    }

    // Decode and validate encoded bytes; each kind of damage has its own status.
    [[nodiscard]] static Result<Handle> try_decode(Span<const uint8_t> bytes) {
        return detail::get<Handle>(
            [&](Handle* h) { return devshare_handle_decode(bytes.data(), bytes.size(), &h->raw_); });
    }
    [[nodiscard]] static Result<Handle> try_decode(const uint8_t* bytes, size_t len) {
        return try_decode(Span<const uint8_t>(bytes, len));
    }

    // Return this handle's reference without importing it (devshare_handle_discard): for a
    // consumer that received a handle it will not use. BUSY while an import in this process
    // holds the reference, ALREADY_RELEASED when it was returned already.
    [[nodiscard]] Result<void> try_discard() const { return detail::call(devshare_handle_discard(&raw_)); }

#if DEVSHARE_HPP_EXCEPTIONS
    void validate() const { detail::value(try_validate()); }
    [[nodiscard]] std::string to_text() const { return detail::value(try_to_text()); }
    [[nodiscard]] static Handle from_text(const char* text) { return detail::value(try_from_text(text)); }
    [[nodiscard]] static Handle from_text(const std::string& text) { return detail::value(try_from_text(text)); }
    [[nodiscard]] std::vector<uint8_t> encode() const { return detail::value(try_encode()); }
    [[nodiscard]] static Handle decode(Span<const uint8_t> bytes) { return detail::value(try_decode(bytes)); }
    [[nodiscard]] static Handle decode(const uint8_t* bytes, size_t len) {
        return detail::value(try_decode(bytes, len));
    }
    void discard() const { detail::value(try_discard()); }
#endif

    // Byte-wise equality (every unused byte of a valid handle is zero).
    friend bool operator==(const Handle& a, const Handle& b) noexcept {
        return std::memcmp(&a.raw_, &b.raw_, sizeof(DevshareHandle)) == 0;
    }
    friend bool operator!=(const Handle& a, const Handle& b) noexcept { return !(a == b); }

private:
    size_t clamped_ndim() const noexcept { return raw_.ndim < DEVSHARE_MAX_NDIM ? raw_.ndim : DEVSHARE_MAX_NDIM; }

    DevshareHandle raw_;
};

// A DevshareTensorDesc of this header's size with the defaults (devshare_tensor_desc_init:
// struct_size set, storage_size DEVSHARE_STORAGE_TO_END, everything else zero), and optionally
// its element type and layout (`shape` and `strides`, ndim entries each, must outlive its use;
// strides nullptr: C-contiguous). A struct you fill yourself needs the same start.
[[nodiscard]] inline DevshareTensorDesc tensor_desc(DevshareDType dtype = {}, uint32_t ndim = 0,
                                                    const int64_t* shape = nullptr,
                                                    const int64_t* strides = nullptr) noexcept {
    DevshareTensorDesc d{};
    (void)devshare_tensor_desc_init(&d, sizeof d);  // cannot fail for a non-NULL pointer and sizeof
    d.dtype = dtype;
    d.ndim = ndim;
    d.shape = shape;
    d.strides = strides;
    return d;
}

// The options of a described tensor.
struct ShareOptions {
    uint32_t flags = 0;                              // DEVSHARE_SHARE_*
    void* stream = nullptr;                          // device work that produced the data
    uint64_t storage_offset = 0;                     // storage start in the range, bytes
    uint64_t storage_size = DEVSHARE_STORAGE_TO_END;  // storage size in bytes
};

// Which tensor to share (Exporter::share) or send (Channel::send, Pool::send): element type,
// shape and strides in elements (has_strides false: C-contiguous), its storage in the range
// (the exporter's allocation, or the pool slot) and where its first element is. Make one with
//     describe(p, {rows, cols})            first element at address p (T from p's type)
//     describe<float>(void_ptr, {n})       the same, the element type named
//     describe(kBFloat16, p, {n})          an element type without a C++ type
//     describe_at<float>(byte_offset, {n}) first element at a byte offset in the range
//     bytes()                              the whole range as 1-D uint8
//     TensorDesc::make(dtype, shape)       first element at tensor_offset elements into the storage
// or pass a C DevshareTensorDesc where a TensorDesc is taken (it converts, copied; start it from
// tensor_desc()). A problem found while describing (too many dimensions, ...) is reported
// by the call that takes the description. The fields may be changed before that call.
struct TensorDesc {
    // Where the first element is: tensor_offset elements into the storage, `address`, byte
    // `offset` of the range, the whole range as bytes, or whatever the C desc `c` says.
    enum class First : uint8_t { storage, address, offset, whole_range, c_desc };

    DevshareDType dtype{};
    uint32_t ndim = 0;
    int64_t shape[DEVSHARE_MAX_NDIM] = {};
    int64_t strides[DEVSHARE_MAX_NDIM] = {};
    bool has_strides = false;
    uint32_t flags = 0;  // DEVSHARE_SHARE_*
    uint64_t storage_offset = 0;
    uint64_t storage_size = DEVSHARE_STORAGE_TO_END;
    int64_t tensor_offset = 0;
    void* stream = nullptr;
    First first = First::storage;
    const void* address = nullptr;
    uint64_t offset = 0;
    DevshareTensorDesc c{};  // a copy of the C desc (its shape and strides stay the caller's)
    int32_t problem = DEVSHARE_STATUS_OK;  // set by make/describe: reported by the call
    const char* problem_text = nullptr;

    TensorDesc() = default;
    // A C desc, used as it is (copied; its shape and strides must outlive the call).
    TensorDesc(const DevshareTensorDesc& desc) noexcept : first(First::c_desc), c(desc) {}  // NOLINT: implicit

    // A desc of `dtype` with `shape` and `strides` (empty: C-contiguous); the rest default. At
    // most DEVSHARE_MAX_NDIM dimensions; strides empty or as many as shape.
    [[nodiscard]] static TensorDesc make(DevshareDType dtype, Dims shape, Dims strides = {},
                                         const ShareOptions& options = {}) noexcept {
        TensorDesc d;
        d.dtype = dtype;
        d.flags = options.flags;
        d.stream = options.stream;
        d.storage_offset = options.storage_offset;
        d.storage_size = options.storage_size;
        if (shape.size() > DEVSHARE_MAX_NDIM) {
            d.problem = DEVSHARE_STATUS_BAD_NDIM;
            d.problem_text = "more dimensions than DEVSHARE_MAX_NDIM";
        } else if (!strides.empty() && strides.size() != shape.size()) {
            d.problem = DEVSHARE_STATUS_INVALID_ARGUMENT;
            d.problem_text = "strides given, but not one per dimension";
        } else {
            d.ndim = static_cast<uint32_t>(shape.size());
            d.has_strides = !strides.empty();
            for (size_t i = 0; i < shape.size(); i++) {
                d.shape[i] = shape[i];
                d.strides[i] = d.has_strides ? strides[i] : 0;
            }
        }
        return d;
    }
    // The same, refusing a problem at once.
    [[nodiscard]] static Result<TensorDesc> try_make(DevshareDType dtype, Dims shape, Dims strides = {}) {
        TensorDesc d = make(dtype, shape, strides);
        if (d.problem != DEVSHARE_STATUS_OK) {
            return detail::error(d.problem, std::string("devshare::TensorDesc: ") + d.problem_text + " (" +
                                                std::to_string(shape.size()) + " dimensions, " +
                                                std::to_string(strides.size()) + " strides)");
        }
        return d;
    }

    // The C struct (struct_size of this header) of a First::storage desc, pointing into this object.
    [[nodiscard]] DevshareTensorDesc raw() const noexcept {
        DevshareTensorDesc d =
            tensor_desc(dtype, ndim, ndim > 0 ? shape : nullptr, has_strides && ndim > 0 ? strides : nullptr);
        d.flags = flags;
        d.storage_offset = storage_offset;
        d.storage_size = storage_size;
        d.tensor_offset = tensor_offset;
        d.stream = stream;
        return d;
    }
};

// The tensor of element type T (default: what `first` points to) whose first element is at
// `first`, with `shape` and `strides` in elements (empty: C-contiguous).
template <typename T = void, typename P>
[[nodiscard]] TensorDesc describe(const P* first, Dims shape, Dims strides = {},
                                  const ShareOptions& options = {}) noexcept {
    using E = std::conditional_t<std::is_void<T>::value, std::remove_cv_t<P>, T>;
    static_assert(!std::is_void<E>::value, "devshare::describe: name the element type: describe<float>(ptr, ...)");
    static_assert(has_dtype_v<E>, "devshare::describe: the element type has no dtype; pass a DevshareDType");
    TensorDesc d = TensorDesc::make(dtype_of<E>(), shape, strides, options);
    d.first = TensorDesc::First::address;
    d.address = first;
    return d;
}
// The same with an explicit element type (kBFloat16, kFloat16, ...).
[[nodiscard]] inline TensorDesc describe(DevshareDType dtype, const void* first, Dims shape, Dims strides = {},
                                         const ShareOptions& options = {}) noexcept {
    TensorDesc d = TensorDesc::make(dtype, shape, strides, options);
    d.first = TensorDesc::First::address;
    d.address = first;
    return d;
}
// The same with the first element's byte offset in the range instead of its address.
[[nodiscard]] inline TensorDesc describe_at(DevshareDType dtype, uint64_t offset, Dims shape, Dims strides = {},
                                            const ShareOptions& options = {}) noexcept {
    TensorDesc d = TensorDesc::make(dtype, shape, strides, options);
    d.first = TensorDesc::First::offset;
    d.offset = offset;
    return d;
}
template <typename T>
[[nodiscard]] TensorDesc describe_at(uint64_t offset, Dims shape, Dims strides = {},
                                     const ShareOptions& options = {}) noexcept {
    static_assert(has_dtype_v<T>, "devshare::describe_at<T>: T has no dtype; pass a DevshareDType");
    return describe_at(dtype_of<T>(), offset, shape, strides, options);
}
// The whole range (allocation or slot) as a 1-D uint8 tensor.
[[nodiscard]] inline TensorDesc bytes() noexcept {
    TensorDesc d;
    d.first = TensorDesc::First::whole_range;
    return d;
}

namespace detail {

// The C desc for `d` in the range [base, base + size) (an allocation, or a pool slot), written
// to `out` (nullptr for the whole range, or the caller's C desc); `who` starts the messages.
[[nodiscard]] inline Result<const DevshareTensorDesc*> lower(const char* who, const TensorDesc& d, const void* base,
                                                             uint64_t size, DevshareTensorDesc* out) {
    const std::string w = std::string(who) + ": ";
    if (d.problem != DEVSHARE_STATUS_OK) {
        return error(d.problem, w + "devshare::TensorDesc: " + d.problem_text);
    }
    uint64_t at = d.offset;
    switch (d.first) {
    case TensorDesc::First::c_desc: return &d.c;
    case TensorDesc::First::whole_range: return static_cast<const DevshareTensorDesc*>(nullptr);
    case TensorDesc::First::storage: *out = d.raw(); return static_cast<const DevshareTensorDesc*>(out);
    case TensorDesc::First::address: {
        const uintptr_t p = reinterpret_cast<uintptr_t>(d.address), b = reinterpret_cast<uintptr_t>(base);
        if (d.address == nullptr || p < b || p - b > size) {
            return error(DEVSHARE_STATUS_INVALID_ARGUMENT,
                         w + "the first element's address is outside the range [data(), data() + " +
                             std::to_string(size) + ")");
        }
        at = static_cast<uint64_t>(p - b);
        break;
    }
    case TensorDesc::First::offset: break;
    }
    const uint64_t esize = element_size(d.dtype);
    if (esize == 0) {
        return error(DEVSHARE_STATUS_BAD_DTYPE, w + dtype_name(d.dtype) + " is not a whole number of bytes");
    }
    if (at < d.storage_offset || (at - d.storage_offset) % esize != 0) {
        return error(DEVSHARE_STATUS_INVALID_ARGUMENT,
                     w + "the first element (byte " + std::to_string(at) + ") is not a whole number of " +
                         std::to_string(esize) + "-byte elements after the storage's start (byte " +
                         std::to_string(d.storage_offset) + ")");
    }
    *out = d.raw();
    out->tensor_offset = static_cast<int64_t>((at - d.storage_offset) / esize);
    return static_cast<const DevshareTensorDesc*>(out);
}

}  // namespace detail

}  // namespace devshare

#endif  // DEVSHARE_HANDLE_HPP
