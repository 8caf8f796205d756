/* SPDX-License-Identifier: Apache-2.0 */

// devshare.hpp: a header-only C++17 API over the devshare C API (devshare.h).
//
// Types
//   devshare::Error       a failed call: DEVSHARE_STATUS_* code + the library's message; also what
//                         the throwing API throws (it is a std::runtime_error), and a
//                         std::error_code through code() (category devshare::error_category()).
//   devshare::Result<T>  value or Error (expected-like): has_value(), *r, r->, error(), code(),
//                         value() (throws the Error; aborts under -fno-exceptions), value_or().
//   devshare::Span<T>    a pointer and a count (shape, strides, bytes); std::span-like, C++17.
//   devshare::Handle     a value type around DevshareHandle (copyable, 616 bytes, no heap) with
//                         accessors: dtype, ndim, shape, strides, backend, device, offsets, ...
//   devshare::TensorDesc a tensor to share, owning its shape and strides (raw() for the C struct).
//   devshare::Exporter   owns one DevshareExporter (move-only); typed share<T>(); see
//                         "Destruction" below.
//   devshare::Import     owns one DevshareImport (move-only); as<T>() checks the dtype and gives a
//                         TensorView<T>; DLPack views.
//   devshare::TensorView<T>  a strided view (data, shape, strides) with operator()(i, j, ...);
//                         mdspan<Rank>() when the standard library has std::mdspan.
//   devshare::DLPackVersioned / DLPackLegacy  own a DLManagedTensorVersioned / DLManagedTensor
//                         (run its deleter when destroyed unless release()d to a framework).
//   devshare::TorchStorage   the 8-tuple PyTorch / torch_npu rebuild a storage from.
//   devshare::Channel    owns a channel's producer end (DevshareChannel, move-only): listen,
//                         serve, leased sends of an Exporter's tensors to its peers.
//   devshare::Connection owns a consumer end (DevshareConnection, move-only): recv() gives each
//                         item as an Import, whose release gives it back to the producer.
//   devshare::Pool       owns a pool of fixed-address slots on a channel (DevsharePool,
//                         move-only); devshare::Slot, one acquired slot (move-only, given back
//                         unsent when destroyed). See "Channels, connections and pools" below
//                         the Import class: nothing runs in background threads, and pool slots
//                         keep one address in the consumer for the pool's life.
//
// Two forms of every call that can fail
//   try_name(...) returns Result<T> (Result<void> for calls without a value) and never throws.
//   name(...)     returns T and throws devshare::Error; it is try_name(...).value(). The
//                 throwing forms (and the throwing constructors) exist only when exceptions are
//                 enabled: DEVSHARE_HPP_EXCEPTIONS is 1 when the compiler has them (and
//                 DEVSHARE_HPP_NO_EXCEPTIONS is not defined), 0 otherwise; with 0 the header
//                 builds with -fno-exceptions and offers only the try_ forms. Build every
//                 translation unit of one program with the same setting.
//   Functions marked noexcept never fail. Every function that returns something is
//   [[nodiscard]], and so is Result: a handle dropped on the floor is a reference never returned.
//
// The C functions and their wrappers
//   devshare_host_alloc / host_adopt / export / export_segments / channel_host_alloc
//                                     Exporter::host_alloc / host_adopt / export_memory / export_segments /
//                                     channel_host_alloc
//   devshare_exporter_share           Exporter::share<T>(first, shape, strides), share_at<T>(byte
//                                     offset, ...), share(DevshareDType, ...), share(desc), share_bytes()
//   devshare_exporter_share_encoded   Exporter::share_encoded(desc)
//   devshare_exporter_segment_table   Exporter::segment_table()
//   devshare_exporter_{allow_pid,outstanding,wait,close}   Exporter::allow_pid / outstanding / wait / close
//   devshare_import / import_encoded / import_text / import_torch
//                                     Import(handle) / Import::from(handle) / from_encoded / from_text / from_torch
//   devshare_import_info / import_handle     cached by Import: info(), handle(), dtype(), shape(), ...
//   devshare_import_to_dlpack_versioned / _to_dlpack   Import::to_dlpack_versioned / to_dlpack
//   devshare_handle_{validate,encode,decode,to_text,from_text,discard}   Handle members
//   devshare_handle_from_torch / _from_torch_encoded / _to_torch, devshare_torch_storage_handle,
//   devshare_torch_discard            handle_from_torch / handle_from_torch_encoded / handle_to_torch /
//                                     torch_storage_handle / torch_discard (free functions)
//   devshare_handle_to_torch_as, devshare_torch_storage_handle_as
//                                     handle_to_torch / torch_storage_handle with a format argument
//   devshare_torch_handle_convert, devshare_torch_format_for_version
//                                     torch_handle_convert / torch_format_for_version
//   devshare_probe / local_pid / allow_ptrace / version      probe / local_pid / allow_ptrace / version
//   devshare_channel_{listen,restrict,fd,service,wait_peers,peer_ids,peer_info,send,close}
//                                     Channel::listen / restrict / fd / service / wait_peers / peers /
//                                     peer_info / send<T>, send_at<T>, send(desc), send_bytes / close
//   devshare_channel_connect, devshare_connection_{fd,info,recv,close}
//                                     Connection::connect / fd / peer_id, producer_pid / recv / close
//   devshare_import_pool_slot         Import::pool_slot
//   devshare_pool_{create,id,acquire,send,release,info,close}
//                                     Pool::create / acquire (a Slot) / send<T>, send_at<T>, send(desc),
//                                     send_bytes / release / info / close
//
// Destruction
//   ~Import releases (errors ignored: a release cannot usefully fail).
//   ~Exporter never closes with DEVSHARE_CLOSE_FORCE unless asked. It follows the exporter's
//   OnDestroy policy (set_on_destroy, or the constructor argument):
//     OnDestroy::close (default)  close without flags. Host memory always closes (importers keep
//                                 their mapping until they release). A device export with
//                                 references outstanding is refused (DEVSHARE_STATUS_BUSY): the
//                                 export is then NOT closed but left open (leaked) so that no
//                                 consumer loses its memory, and the exporter-leak handler is
//                                 called with it (default: one line on stderr). Keep the device
//                                 memory allocated in that case; close explicitly to avoid it.
//     OnDestroy::wait_then_close  wait up to the policy's timeout for outstanding references
//                                 (devshare_exporter_wait), then as OnDestroy::close.
//     OnDestroy::force            close with DEVSHARE_CLOSE_FORCE: device importers lose the memory.
//   The same applies to what a move assignment replaces. Call close() / try_close() yourself to
//   handle a refusal (try_close(Close::force) forces).
//   ~Channel, ~Connection and ~Pool close; ~Slot gives an acquired, unsent slot back to its pool
//   (see "Channels, connections and pools").
//
// Costs: each function is one call into the C library (an Import's construction: three, for
// its info and handle, which it caches; Connection::recv one more), plus at most one std::string
// or std::vector for results that are text or bytes (or peer ids). Exporter caches its address
// and size, Pool its slot size and count, Slot its index, address and size. Nothing else is
// cached.
//
// Threading follows devshare.h: an Exporter, a Channel, a Connection or a Pool may be used from
// several threads except for close() and destruction; an Import is released once, by whoever
// owns it; a Slot is one thread's at a time.
//
// Structs that cross the C boundary start with struct_size (see "Versions and evolution" in
// devshare.h). The helpers here (tensor_desc, import_options, torch_args, TensorDesc::raw, probe,
// Import) initialise them with the C *_init functions and this header's sizeof; a struct you
// fill yourself needs the same: value-initialise it and call its *_init function.

#ifndef DEVSHARE_HPP
#define DEVSHARE_HPP

#include "devshare.h"

#include <array>
#include <atomic>
#include <cassert>
#include <chrono>
#include <complex>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#if defined(__has_include)
#if __has_include(<version>)
#include <version>
#endif
#endif
#if defined(__cpp_lib_mdspan)
#include <mdspan>
#endif
#if defined(__STDCPP_FLOAT16_T__) || defined(__STDCPP_BFLOAT16_T__)
#include <stdfloat>
#endif

#if !defined(DEVSHARE_HPP_EXCEPTIONS)
#if (defined(__cpp_exceptions) || defined(__EXCEPTIONS) || defined(_CPPUNWIND)) && \
    !defined(DEVSHARE_HPP_NO_EXCEPTIONS)
#define DEVSHARE_HPP_EXCEPTIONS 1
#else
#define DEVSHARE_HPP_EXCEPTIONS 0
#endif
#endif

namespace devshare {

// ---------------------------------------------------------------------------------------------
// Errors

// The error category of devshare status codes: value() is the DEVSHARE_STATUS_* code, message()
// its fixed text. Equivalent std::errc conditions: invalid_argument (NULL_ARGUMENT,
// INVALID_ARGUMENT), no_buffer_space (BUFFER_TOO_SMALL), not_supported (UNSUPPORTED,
// BACKEND_UNAVAILABLE), no_such_file_or_directory (NOT_FOUND), timed_out (TIMEOUT),
// device_or_resource_busy (BUSY), permission_denied (UNTRUSTED).
class ErrorCategory final : public std::error_category {
public:
    const char* name() const noexcept override { return "devshare"; }
    std::string message(int status) const override { return devshare_status_str(status); }
    std::error_condition default_error_condition(int status) const noexcept override {
        switch (status) {
        case DEVSHARE_STATUS_NULL_ARGUMENT:
        case DEVSHARE_STATUS_INVALID_ARGUMENT:
            return std::make_error_condition(std::errc::invalid_argument);
        case DEVSHARE_STATUS_BUFFER_TOO_SMALL:
            return std::make_error_condition(std::errc::no_buffer_space);
        case DEVSHARE_STATUS_UNSUPPORTED:
        case DEVSHARE_STATUS_BACKEND_UNAVAILABLE:
            return std::make_error_condition(std::errc::not_supported);
        case DEVSHARE_STATUS_NOT_FOUND:
            return std::make_error_condition(std::errc::no_such_file_or_directory);
        case DEVSHARE_STATUS_TIMEOUT:
            return std::make_error_condition(std::errc::timed_out);
        case DEVSHARE_STATUS_BUSY:
            return std::make_error_condition(std::errc::device_or_resource_busy);
        case DEVSHARE_STATUS_UNTRUSTED:
            return std::make_error_condition(std::errc::permission_denied);
        default:
            return std::error_condition(status, *this);
        }
    }
};

// The one devshare error category (one instance per program).
[[nodiscard]] inline const std::error_category& error_category() noexcept {
    static const ErrorCategory category;
    return category;
}

// A std::error_code for a DEVSHARE_STATUS_* code (OK gives the empty code, value 0).
[[nodiscard]] inline std::error_code make_error_code(int32_t status) noexcept {
    return std::error_code(static_cast<int>(status), error_category());
}

// A failed devshare call: status() is the DEVSHARE_STATUS_* code (negative); what() / message()
// the library's message (devshare_last_error: the function that failed and why), or, for checks
// made by this header, "devshare::<function>: why". A value type (copy it, keep it, return it in
// a Result); with exceptions it is also what the throwing API throws.
class Error : public std::runtime_error {
public:
    Error(int32_t status, const std::string& message) : std::runtime_error(message), status_(status) {}
    Error(int32_t status, const char* message) : std::runtime_error(message), status_(status) {}

    // The DEVSHARE_STATUS_* code.
    [[nodiscard]] int32_t status() const noexcept { return status_; }

    // Fixed name of the status (devshare_status_str); static storage, never freed.
    [[nodiscard]] const char* status_name() const noexcept { return devshare_status_str(status_); }

    // The message (the same as what()).
    [[nodiscard]] const char* message() const noexcept { return what(); }

    // The status as a std::error_code of devshare::error_category().
    [[nodiscard]] std::error_code code() const noexcept { return make_error_code(status_); }

    // An Error for `status` with the calling thread's devshare_last_error text (the status name
    // when there is none). Call it right after the failing C function, before any other devshare
    // call on this thread.
    [[nodiscard]] static Error from_last(int32_t status) {
        const size_t len = devshare_last_error(nullptr, 0);
        if (len == 0) {
            return Error(status, devshare_status_str(status));
        }
        std::string buf(len + 1, '\0');
        (void)devshare_last_error(&buf[0], buf.size());
        buf.resize(len);
        return Error(status, buf);
    }

private:
    int32_t status_;
};

namespace detail {

[[noreturn]] inline void fail(const Error& e) {
#if DEVSHARE_HPP_EXCEPTIONS
    throw e;
#else
    std::fprintf(stderr, "devshare: value() of a failed Result: %s (%d): %s\n", e.status_name(),
                 static_cast<int>(e.status()), e.what());
    std::abort();
#endif
}

// The Error a Result holds when it holds none (error() of a successful Result).
inline const Error& no_error() noexcept {
    static const Error e(DEVSHARE_STATUS_OK, "no error");
    return e;
}

}  // namespace detail

// A value of type T or the Error that prevented it (like C++23 std::expected<T, Error>).
// Test with has_value() / operator bool; read with *r or r->; error() and code() say why it
// failed. value() returns the value or, on failure, throws the Error (with exceptions) or
// prints it and aborts (without).
template <typename T>
class [[nodiscard]] Result {
public:
    using value_type = T;
    using error_type = Error;

    Result(const T& value) : v_(std::in_place_index<0>, value) {}
    Result(T&& value) : v_(std::in_place_index<0>, std::move(value)) {}
    Result(Error error) : v_(std::in_place_index<1>, std::move(error)) {}

    [[nodiscard]] bool has_value() const noexcept { return v_.index() == 0; }
    explicit operator bool() const noexcept { return has_value(); }

    // The value; precondition: has_value().
    [[nodiscard]] T& operator*() & noexcept { return *std::get_if<0>(&v_); }
    [[nodiscard]] const T& operator*() const& noexcept { return *std::get_if<0>(&v_); }
    [[nodiscard]] T operator*() && noexcept(std::is_nothrow_move_constructible<T>::value) {
        return std::move(*std::get_if<0>(&v_));
    }
    [[nodiscard]] T* operator->() noexcept { return std::get_if<0>(&v_); }
    [[nodiscard]] const T* operator->() const noexcept { return std::get_if<0>(&v_); }

    // The error; an Error with status DEVSHARE_STATUS_OK when there is a value.
    [[nodiscard]] const Error& error() const noexcept {
        const Error* e = std::get_if<1>(&v_);
        return e != nullptr ? *e : detail::no_error();
    }
    // DEVSHARE_STATUS_OK or the error's status.
    [[nodiscard]] int32_t status() const noexcept { return error().status(); }
    // The empty error_code or the error's.
    [[nodiscard]] std::error_code code() const noexcept {
        return has_value() ? std::error_code() : error().code();
    }

    // The value, or the error thrown (exceptions) / reported with abort() (no exceptions).
    [[nodiscard]] T& value() & {
        if (!has_value()) {
            detail::fail(error());
        }
        return **this;
    }
    [[nodiscard]] const T& value() const& {
        if (!has_value()) {
            detail::fail(error());
        }
        return **this;
    }
    [[nodiscard]] T value() && {
        if (!has_value()) {
            detail::fail(error());
        }
        return std::move(**this);
    }

    // The value, or `fallback` when there is none.
    template <typename U>
    [[nodiscard]] T value_or(U&& fallback) const& {
        return has_value() ? **this : static_cast<T>(std::forward<U>(fallback));
    }
    template <typename U>
    [[nodiscard]] T value_or(U&& fallback) && {
        return has_value() ? std::move(**this) : static_cast<T>(std::forward<U>(fallback));
    }

private:
    std::variant<T, Error> v_;
};

// Success or the Error of a call that returns nothing.
template <>
class [[nodiscard]] Result<void> {
public:
    using value_type = void;
    using error_type = Error;

    Result() noexcept = default;
    Result(Error error) : v_(std::in_place_index<1>, std::move(error)) {}

    [[nodiscard]] bool has_value() const noexcept { return v_.index() == 0; }
    explicit operator bool() const noexcept { return has_value(); }
    [[nodiscard]] const Error& error() const noexcept {
        const Error* e = std::get_if<1>(&v_);
        return e != nullptr ? *e : detail::no_error();
    }
    [[nodiscard]] int32_t status() const noexcept { return error().status(); }
    [[nodiscard]] std::error_code code() const noexcept {
        return has_value() ? std::error_code() : error().code();
    }
    // Nothing, or the error thrown (exceptions) / reported with abort() (no exceptions).
    void value() const {
        if (!has_value()) {
            detail::fail(error());
        }
    }

private:
    std::variant<std::monostate, Error> v_;
};

// Result<void> of a C status: OK, or the Error from the thread's last error message.
[[nodiscard]] inline Result<void> status_result(int32_t status) {
    if (status == DEVSHARE_STATUS_OK) {
        return Result<void>();
    }
    return Error::from_last(status);
}

#if DEVSHARE_HPP_EXCEPTIONS
// Throw devshare::Error unless `status` is DEVSHARE_STATUS_OK. Use right after a C call.
inline void check(int32_t status) {
    if (status != DEVSHARE_STATUS_OK) {
        throw Error::from_last(status);
    }
}
#endif

// ---------------------------------------------------------------------------------------------
// Span

// A pointer and a count, like C++20 std::span<T> (which C++17 lacks). It does not own anything:
// a Span made from a braced list ({3, 4}) or a temporary container lives until the end of the
// full expression, which is long enough for a call's arguments.
template <typename T>
class Span {
public:
    using element_type = T;
    using value_type = std::remove_cv_t<T>;
    using size_type = std::size_t;
    using iterator = T*;

    constexpr Span() noexcept = default;
    constexpr Span(T* data, std::size_t size) noexcept : data_(data), size_(size) {}
    template <std::size_t N>
    constexpr Span(T (&array)[N]) noexcept : data_(array), size_(N) {}
    // From a braced list of values (only for Span<const T>; the list lives until the end of the
    // full expression, so only as an argument).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 9
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winit-list-lifetime"
#endif
    template <typename U = T, typename = std::enable_if_t<std::is_const<U>::value>>
    constexpr Span(std::initializer_list<value_type> list) noexcept : data_(list.begin()), size_(list.size()) {}
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 9
#pragma GCC diagnostic pop
#endif
    // From a contiguous container with data() and size(): std::vector, std::array, std::string.
    template <typename C, typename D = std::remove_cv_t<std::remove_reference_t<C>>,
              typename = std::enable_if_t<
                  !std::is_same<D, Span>::value && !std::is_array<D>::value &&
                  std::is_convertible<decltype(std::declval<C&>().data()), T*>::value &&
                  std::is_convertible<decltype(std::declval<C&>().size()), std::size_t>::value>>
    constexpr Span(C&& container) noexcept : data_(container.data()), size_(container.size()) {}
    // Span<T> -> Span<const T>.
    template <typename U, typename = std::enable_if_t<std::is_convertible<U (*)[], T (*)[]>::value>>
    constexpr Span(const Span<U>& other) noexcept : data_(other.data()), size_(other.size()) {}

    [[nodiscard]] constexpr T* data() const noexcept { return data_; }
    [[nodiscard]] constexpr std::size_t size() const noexcept { return size_; }
    [[nodiscard]] constexpr bool empty() const noexcept { return size_ == 0; }
    [[nodiscard]] constexpr T& operator[](std::size_t i) const noexcept { return data_[i]; }
    [[nodiscard]] constexpr T* begin() const noexcept { return data_; }
    [[nodiscard]] constexpr T* end() const noexcept { return data_ + size_; }
    [[nodiscard]] std::vector<value_type> to_vector() const { return std::vector<value_type>(begin(), end()); }

    // Element-wise equality.
    friend bool operator==(Span a, Span b) noexcept {
        if (a.size_ != b.size_) {
            return false;
        }
        for (std::size_t i = 0; i < a.size_; i++) {
            if (!(a.data_[i] == b.data_[i])) {
                return false;
            }
        }
        return true;
    }
    friend bool operator!=(Span a, Span b) noexcept { return !(a == b); }

private:
    T* data_ = nullptr;
    std::size_t size_ = 0;
};

// Shapes and strides, in elements.
using Dims = Span<const int64_t>;

// ---------------------------------------------------------------------------------------------
// Element types

// A DevshareDType from its parts (lanes 1 by default).
[[nodiscard]] constexpr DevshareDType make_dtype(uint8_t code, uint8_t bits, uint16_t lanes = 1) noexcept {
    return DevshareDType{code, bits, lanes};
}

// Element types without a C++ type of their own in C++17: pass them as a DevshareDType.
constexpr DevshareDType kFloat16 = {DEVSHARE_DTYPE_FLOAT, 16, 1};
constexpr DevshareDType kBFloat16 = {DEVSHARE_DTYPE_BFLOAT, 16, 1};

// Whether two dtypes are the same (code, bits and lanes).
[[nodiscard]] constexpr bool same_dtype(DevshareDType a, DevshareDType b) noexcept {
    return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

// Bytes per element (bits * lanes / 8); 0 for sizes that are not whole bytes.
[[nodiscard]] constexpr uint64_t element_size(DevshareDType d) noexcept {
    return (uint64_t{d.bits} * d.lanes) % 8 == 0 ? uint64_t{d.bits} * d.lanes / 8 : 0;
}

// A readable name: "float32", "int64", "uint8", "bool", "bfloat16", "complex64",
// "float8(code 10)", with "x<lanes>" for vector types.
[[nodiscard]] inline std::string dtype_name(DevshareDType d) {
    std::string s;
    switch (d.code) {
    case DEVSHARE_DTYPE_INT:
        s = "int" + std::to_string(d.bits);
        break;
    case DEVSHARE_DTYPE_UINT:
        s = "uint" + std::to_string(d.bits);
        break;
    case DEVSHARE_DTYPE_FLOAT:
        s = "float" + std::to_string(d.bits);
        break;
    case DEVSHARE_DTYPE_BFLOAT:
        s = "bfloat" + std::to_string(d.bits);
        break;
    case DEVSHARE_DTYPE_COMPLEX:
        s = "complex" + std::to_string(d.bits);
        break;
    case DEVSHARE_DTYPE_BOOL:
        s = d.bits == 8 ? std::string("bool") : "bool" + std::to_string(d.bits);
        break;
    default:
        if (d.code >= DEVSHARE_DTYPE_FLOAT8_FIRST && d.code <= DEVSHARE_DTYPE_FLOAT8_LAST) {
            s = "float" + std::to_string(d.bits) + "(code " + std::to_string(d.code) + ")";
        } else {
            s = "dtype(code " + std::to_string(d.code) + ", " + std::to_string(d.bits) + " bits)";
        }
    }
    if (d.lanes != 1) {
        s += "x" + std::to_string(d.lanes);
    }
    return s;
}

// dtype_traits<T>::value is T's DLPack dtype when `known`. Specialise it for your own types
// (e.g. a bfloat16 struct) to use them with share<T>, as<T> and dtype_of<T>.
template <typename T>
struct dtype_traits {
    static constexpr bool known = false;
};

namespace detail {
template <uint8_t Code, uint8_t Bits>
struct dtype_is {
    static constexpr bool known = true;
    static constexpr DevshareDType value = {Code, Bits, 1};
};
template <typename T>
using int_dtype = dtype_is<std::is_signed<T>::value ? uint8_t{DEVSHARE_DTYPE_INT} : uint8_t{DEVSHARE_DTYPE_UINT},
                           static_cast<uint8_t>(sizeof(T) * 8)>;
}  // namespace detail

template <> struct dtype_traits<signed char> : detail::int_dtype<signed char> {};
template <> struct dtype_traits<unsigned char> : detail::int_dtype<unsigned char> {};
template <> struct dtype_traits<short> : detail::int_dtype<short> {};
template <> struct dtype_traits<unsigned short> : detail::int_dtype<unsigned short> {};
template <> struct dtype_traits<int> : detail::int_dtype<int> {};
template <> struct dtype_traits<unsigned int> : detail::int_dtype<unsigned int> {};
template <> struct dtype_traits<long> : detail::int_dtype<long> {};
template <> struct dtype_traits<unsigned long> : detail::int_dtype<unsigned long> {};
template <> struct dtype_traits<long long> : detail::int_dtype<long long> {};
template <> struct dtype_traits<unsigned long long> : detail::int_dtype<unsigned long long> {};
template <> struct dtype_traits<bool> : detail::dtype_is<DEVSHARE_DTYPE_BOOL, 8> {};
template <> struct dtype_traits<float> : detail::dtype_is<DEVSHARE_DTYPE_FLOAT, 32> {};
template <> struct dtype_traits<double> : detail::dtype_is<DEVSHARE_DTYPE_FLOAT, 64> {};
template <> struct dtype_traits<std::complex<float>> : detail::dtype_is<DEVSHARE_DTYPE_COMPLEX, 64> {};
template <> struct dtype_traits<std::complex<double>> : detail::dtype_is<DEVSHARE_DTYPE_COMPLEX, 128> {};
#if defined(__STDCPP_FLOAT16_T__)
template <> struct dtype_traits<std::float16_t> : detail::dtype_is<DEVSHARE_DTYPE_FLOAT, 16> {};
#elif defined(__FLT16_MAX__) && (defined(__GNUC__) || defined(__clang__))
template <> struct dtype_traits<_Float16> : detail::dtype_is<DEVSHARE_DTYPE_FLOAT, 16> {};
#endif
#if defined(__STDCPP_BFLOAT16_T__)
template <> struct dtype_traits<std::bfloat16_t> : detail::dtype_is<DEVSHARE_DTYPE_BFLOAT, 16> {};
#endif

static_assert(sizeof(bool) == 1, "devshare: bool must be one byte (DLPack bool is 8 bits)");
static_assert(std::numeric_limits<float>::is_iec559 && sizeof(float) == 4, "devshare: float must be IEEE binary32");
static_assert(std::numeric_limits<double>::is_iec559 && sizeof(double) == 8, "devshare: double must be IEEE binary64");

// Whether T (cv-qualifiers ignored) has a dtype: the integer types, bool, float, double,
// std::complex<float|double>, _Float16 / std::float16_t / std::bfloat16_t where the compiler has
// them, and whatever you specialise dtype_traits for. Plain char has none (signedness varies):
// use int8_t or uint8_t.
template <typename T>
constexpr bool has_dtype_v = dtype_traits<std::remove_cv_t<T>>::known;

// T's DLPack dtype: dtype_of<float>() is {DEVSHARE_DTYPE_FLOAT, 32, 1}.
template <typename T>
[[nodiscard]] constexpr DevshareDType dtype_of() noexcept {
    static_assert(has_dtype_v<T>, "devshare::dtype_of<T>: T has no DLPack dtype here; pass a DevshareDType "
                                  "(e.g. devshare::kBFloat16) or specialise devshare::dtype_traits<T>");
    return dtype_traits<std::remove_cv_t<T>>::value;
}

// ---------------------------------------------------------------------------------------------
// Library-wide helpers

// The linked library's version, (major << 16) | (minor << 8) | patch.
[[nodiscard]] inline uint32_t version() noexcept { return devshare_version(); }

// Whether `backend` (DEVSHARE_BACKEND_*) is usable in this process, and why not (an unusable
// backend is a success with usable == 0). Unknown backend ids are an error.
[[nodiscard]] inline Result<DevshareBackendInfo> try_probe(uint16_t backend) {
    DevshareBackendInfo info{};
    int32_t s = devshare_backend_info_init(&info, sizeof info);
    if (s == DEVSHARE_STATUS_OK) {
        s = devshare_probe(backend, &info);
    }
    if (s != DEVSHARE_STATUS_OK) {
        return Error::from_last(s);
    }
    return info;
}

// The pid an exporter must allow (Exporter::allow_pid) for this process to import on `backend`
// and `device` (devshare_local_pid: the bare tgid on Ascend, getpid() elsewhere).
[[nodiscard]] inline Result<int32_t> try_local_pid(uint16_t backend, int32_t device = 0) {
    int32_t pid = 0;
    const int32_t s = devshare_local_pid(backend, device, &pid);
    if (s != DEVSHARE_STATUS_OK) {
        return Error::from_last(s);
    }
    return pid;
}

// Let process `pid` take this process's file descriptors with pidfd_getfd under Yama
// ptrace_scope 1 (-1: any process, 0: nobody again); see devshare_allow_ptrace.
[[nodiscard]] inline Result<void> try_allow_ptrace(int32_t pid) { return status_result(devshare_allow_ptrace(pid)); }

#if DEVSHARE_HPP_EXCEPTIONS
[[nodiscard]] inline DevshareBackendInfo probe(uint16_t backend) { return try_probe(backend).value(); }
[[nodiscard]] inline int32_t local_pid(uint16_t backend, int32_t device = 0) {
    return try_local_pid(backend, device).value();
}
inline void allow_ptrace(int32_t pid) { try_allow_ptrace(pid).value(); }
#endif

// A DevshareTensorDesc of this header's size with the defaults (devshare_tensor_desc_init:
// struct_size set, storage_size DEVSHARE_STORAGE_TO_END, everything else zero). Set dtype, ndim
// and shape (and whatever else differs), then pass it to Exporter::share.
[[nodiscard]] inline DevshareTensorDesc tensor_desc() noexcept {
    DevshareTensorDesc d{};
    d.struct_size = sizeof d;
    d.storage_size = DEVSHARE_STORAGE_TO_END;
    (void)devshare_tensor_desc_init(&d, sizeof d);  // cannot fail for a non-NULL pointer and sizeof
    return d;
}

// The same with the element type and a C-contiguous (strides nullptr) or strided layout; `shape`
// and `strides` (ndim entries each) are read by Exporter::share, so they must outlive that call.
[[nodiscard]] inline DevshareTensorDesc tensor_desc(DevshareDType dtype, uint32_t ndim, const int64_t* shape,
                                                    const int64_t* strides = nullptr) noexcept {
    DevshareTensorDesc d = tensor_desc();
    d.dtype = dtype;
    d.ndim = ndim;
    d.shape = shape;
    d.strides = strides;
    return d;
}

// Import options with the given DEVSHARE_IMPORT_* flags, device and stream (defaults:
// read-write, the handle's device, no stream: event waits block).
[[nodiscard]] inline DevshareImportOptions import_options(uint32_t flags = 0,
                                                          int32_t device = DEVSHARE_DEVICE_FROM_HANDLE,
                                                          void* stream = nullptr) noexcept {
    DevshareImportOptions o{};
    o.struct_size = sizeof o;
    (void)devshare_import_options_init(&o, sizeof o);  // cannot fail for a non-NULL pointer and sizeof
    o.flags = flags;
    o.device = device;
    o.stream = stream;
    return o;
}

// DevshareTorchArgs of this header's size, all zero but `backend` (DEVSHARE_BACKEND_CUDA for
// PyTorch, DEVSHARE_BACKEND_ACL for torch_npu). Fill in the tuple's fields.
[[nodiscard]] inline DevshareTorchArgs torch_args(uint16_t backend = 0) noexcept {
    DevshareTorchArgs a{};
    a.struct_size = sizeof a;
    (void)devshare_torch_args_init(&a, sizeof a);  // cannot fail for a non-NULL pointer and sizeof
    a.backend = backend;
    return a;
}

// ---------------------------------------------------------------------------------------------
// Handle

// One shared tensor's handle: plain data, copy it freely. A handle produced by
// Exporter::share() is one reference owed to the exporter: import it (the import's release
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
    // Sizes in elements, ndim() entries (pointing into this Handle).
    [[nodiscard]] Dims shape() const noexcept { return Dims(raw_.shape, clamped_ndim()); }
    // Strides in elements, ndim() entries (pointing into this Handle).
    [[nodiscard]] Dims strides() const noexcept { return Dims(raw_.strides, clamped_ndim()); }
    // Number of elements (1 for ndim 0).
    [[nodiscard]] int64_t numel() const noexcept {
        int64_t n = 1;
        for (const int64_t d : shape()) {
            n *= d;
        }
        return n;
    }
    // Bytes per element.
    [[nodiscard]] uint64_t element_size() const noexcept { return devshare::element_size(raw_.dtype); }
    // DEVSHARE_BACKEND_*.
    [[nodiscard]] uint16_t backend() const noexcept { return raw_.backend; }
    // Device index as numbered in the exporting process (0 for host).
    [[nodiscard]] int32_t device() const noexcept { return raw_.device_index; }
    // Byte offset of the storage in the allocation.
    [[nodiscard]] uint64_t storage_offset() const noexcept { return raw_.storage_offset; }
    // Storage size in bytes.
    [[nodiscard]] uint64_t storage_size() const noexcept { return raw_.storage_size; }
    // Size of the exported allocation in bytes.
    [[nodiscard]] uint64_t alloc_size() const noexcept { return raw_.alloc_size; }
    // Element offset of the tensor's first element in the storage.
    [[nodiscard]] int64_t tensor_offset() const noexcept { return raw_.tensor_offset; }
    // DEVSHARE_HANDLE_FLAG_* bits.
    [[nodiscard]] uint32_t flags() const noexcept { return raw_.flags; }
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
    [[nodiscard]] Result<void> try_validate() const { return status_result(devshare_handle_validate(&raw_)); }

    // Text form ("devshare1:..."), safe for command lines, environment variables and JSON.
    [[nodiscard]] Result<std::string> try_to_text() const {
        std::string text(DEVSHARE_HANDLE_MAX_TEXT_SIZE, '\0');
        size_t len = 0;
        int32_t s = devshare_handle_to_text(&raw_, &text[0], text.size(), &len);
        if (s == DEVSHARE_STATUS_BUFFER_TOO_SMALL && len + 1 > text.size()) {  // a later, longer form
            text.assign(len + 1, '\0');
            s = devshare_handle_to_text(&raw_, &text[0], text.size(), &len);
        }
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        text.resize(len);
        return text;
    }

    // Parse and validate handle text (surrounding whitespace is ignored).
    [[nodiscard]] static Result<Handle> try_from_text(const char* text) {
        Handle h;
        const int32_t s = devshare_handle_from_text(text, &h.raw_);
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        return h;
    }
    [[nodiscard]] static Result<Handle> try_from_text(const std::string& text) { return try_from_text(text.c_str()); }

    // Canonical byte encoding.
    [[nodiscard]] Result<std::vector<uint8_t>> try_encode() const;

    // Decode and validate encoded bytes; each kind of damage has its own status.
    [[nodiscard]] static Result<Handle> try_decode(Span<const uint8_t> bytes) {
        Handle h;
        const int32_t s = devshare_handle_decode(bytes.data(), bytes.size(), &h.raw_);
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        return h;
    }
    [[nodiscard]] static Result<Handle> try_decode(const uint8_t* bytes, size_t len) {
        return try_decode(Span<const uint8_t>(bytes, len));
    }

    // Return this handle's reference without importing it (devshare_handle_discard): for a
    // consumer that received a handle it will not use. BUSY while an import in this process
    // holds the reference, ALREADY_RELEASED when it was returned already.
    [[nodiscard]] Result<void> try_discard() const { return status_result(devshare_handle_discard(&raw_)); }

#if DEVSHARE_HPP_EXCEPTIONS
    void validate() const { try_validate().value(); }
    [[nodiscard]] std::string to_text() const { return try_to_text().value(); }
    [[nodiscard]] static Handle from_text(const char* text) { return try_from_text(text).value(); }
    [[nodiscard]] static Handle from_text(const std::string& text) { return try_from_text(text).value(); }
    [[nodiscard]] std::vector<uint8_t> encode() const { return try_encode().value(); }
    [[nodiscard]] static Handle decode(Span<const uint8_t> bytes) { return try_decode(bytes).value(); }
    [[nodiscard]] static Handle decode(const uint8_t* bytes, size_t len) { return try_decode(bytes, len).value(); }
    void discard() const { try_discard().value(); }
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

namespace detail {

// Calls `call(buf, cap, &len)` with a buffer of `guess` bytes and, when the C function says
// BUFFER_TOO_SMALL with the length it needs, once more with that length.
template <typename F>
Result<std::vector<uint8_t>> read_bytes(size_t guess, F&& call) {
    std::vector<uint8_t> buf(guess);
    size_t len = 0;
    int32_t s = call(buf.data(), buf.size(), &len);
    if (s == DEVSHARE_STATUS_BUFFER_TOO_SMALL && len > buf.size()) {
        buf.assign(len, 0);
        s = call(buf.data(), buf.size(), &len);
    }
    if (s != DEVSHARE_STATUS_OK) {
        return Error::from_last(s);
    }
    buf.resize(len);
    return buf;
}

inline Error error(int32_t status, const std::string& message) { return Error(status, message); }

}  // namespace detail

inline Result<std::vector<uint8_t>> Handle::try_encode() const {
    return detail::read_bytes(DEVSHARE_HANDLE_MAX_ENCODED_SIZE, [this](uint8_t* buf, size_t cap, size_t* len) {
        return devshare_handle_encode(&raw_, buf, cap, len);
    });
}

// ---------------------------------------------------------------------------------------------
// TensorDesc

// What Exporter::share needs to know about a tensor in its allocation, owning its shape and
// strides (unlike DevshareTensorDesc, which points at them). raw() gives the C struct, pointing
// into this object.
struct TensorDesc {
    DevshareDType dtype{};
    uint32_t ndim = 0;
    int64_t shape[DEVSHARE_MAX_NDIM] = {};
    int64_t strides[DEVSHARE_MAX_NDIM] = {};
    bool has_strides = false;  // false: C-contiguous
    uint32_t flags = 0;        // DEVSHARE_SHARE_*
    uint64_t storage_offset = 0;
    uint64_t storage_size = DEVSHARE_STORAGE_TO_END;
    int64_t tensor_offset = 0;
    void* stream = nullptr;

    // A desc of `dtype` with `shape` and `strides` (empty: C-contiguous); the rest default.
    // At most DEVSHARE_MAX_NDIM dimensions; strides empty or as many as shape.
    [[nodiscard]] static Result<TensorDesc> try_make(DevshareDType dtype, Dims shape, Dims strides = {}) {
        if (shape.size() > DEVSHARE_MAX_NDIM) {
            return detail::error(DEVSHARE_STATUS_BAD_NDIM, "devshare::TensorDesc: " + std::to_string(shape.size()) +
                                                               " dimensions, at most " +
                                                               std::to_string(DEVSHARE_MAX_NDIM));
        }
        if (!strides.empty() && strides.size() != shape.size()) {
            return detail::error(DEVSHARE_STATUS_INVALID_ARGUMENT,
                                 "devshare::TensorDesc: " + std::to_string(strides.size()) + " strides for " +
                                     std::to_string(shape.size()) + " dimensions");
        }
        TensorDesc d;
        d.dtype = dtype;
        d.ndim = static_cast<uint32_t>(shape.size());
        for (size_t i = 0; i < shape.size(); i++) {
            d.shape[i] = shape[i];
            if (!strides.empty()) {
                d.strides[i] = strides[i];
            }
        }
        d.has_strides = !strides.empty();
        return d;
    }
#if DEVSHARE_HPP_EXCEPTIONS
    [[nodiscard]] static TensorDesc make(DevshareDType dtype, Dims shape, Dims strides = {}) {
        return try_make(dtype, shape, strides).value();
    }
#endif

    // The C struct (struct_size of this header), pointing at this object's shape and strides.
    [[nodiscard]] DevshareTensorDesc raw() const noexcept {
        DevshareTensorDesc d = tensor_desc(dtype, ndim, ndim > 0 ? shape : nullptr, has_strides ? strides : nullptr);
        d.flags = flags;
        d.storage_offset = storage_offset;
        d.storage_size = storage_size;
        d.tensor_offset = tensor_offset;
        d.stream = stream;
        return d;
    }
};

// Options of a typed share (Exporter::share<T> and friends).
struct ShareOptions {
    uint32_t flags = 0;                              // DEVSHARE_SHARE_*
    void* stream = nullptr;                          // device work that produced the data
    uint64_t storage_offset = 0;                     // storage start in the allocation, bytes
    uint64_t storage_size = DEVSHARE_STORAGE_TO_END;  // storage size in bytes
};

namespace detail {

// A TensorDesc for a tensor whose first element is at byte `offset` of a range (an allocation,
// or a pool slot), its storage as `options` say; `who` starts the error messages.
inline Result<TensorDesc> describe_at(const char* who, DevshareDType dtype, uint64_t offset, Dims shape, Dims strides,
                                      const ShareOptions& options) {
    const uint64_t esize = devshare::element_size(dtype);
    if (esize == 0) {
        return error(DEVSHARE_STATUS_BAD_DTYPE,
                     std::string(who) + ": " + dtype_name(dtype) + " is not a whole number of bytes");
    }
    if (offset < options.storage_offset || (offset - options.storage_offset) % esize != 0) {
        return error(DEVSHARE_STATUS_INVALID_ARGUMENT,
                     std::string(who) + ": the first element (byte " + std::to_string(offset) +
                         ") is not a whole number of " + std::to_string(esize) +
                         "-byte elements after the storage's start (byte " + std::to_string(options.storage_offset) +
                         ")");
    }
    Result<TensorDesc> d = TensorDesc::try_make(dtype, shape, strides);
    if (d) {
        d->flags = options.flags;
        d->stream = options.stream;
        d->storage_offset = options.storage_offset;
        d->storage_size = options.storage_size;
        d->tensor_offset = static_cast<int64_t>((offset - options.storage_offset) / esize);
    }
    return d;
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// PyTorch tuples

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

// DevshareTorchArgs for a tuple received as `storage` plus the tensor part (dtype, shape,
// strides, tensor offset), for handle_from_torch, import (Import::from_torch) and torch_discard.
// The result points into `storage`, `shape` and `strides`: they must outlive its use.
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
    Handle h;
    const int32_t s = devshare_handle_from_torch(&args, &h.raw());
    if (s != DEVSHARE_STATUS_OK) {
        return Error::from_last(s);
    }
    return h;
}

// The same as the handle's byte encoding, which also carries a long segment table
// (devshare_handle_from_torch_encoded); import it with Import::from_encoded.
[[nodiscard]] inline Result<std::vector<uint8_t>> try_handle_from_torch_encoded(const DevshareTorchArgs& args) {
    return detail::read_bytes(DEVSHARE_HANDLE_MAX_ENCODED_SIZE, [&args](uint8_t* buf, size_t cap, size_t* len) {
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
    uint32_t f = 0;
    const int32_t s = devshare_torch_format_for_version(backend, torch_version, &f);
    if (s != DEVSHARE_STATUS_OK) {
        return Error::from_last(s);
    }
    return f;
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
        return Error::from_last(s);
    }
    if (t.raw.handle_len <= DEVSHARE_TORCH_HANDLE_CAPACITY) {
        t.handle.assign(t.raw.handle, t.raw.handle + t.raw.handle_len);
    } else {
        Result<std::vector<uint8_t>> bytes = try_torch_storage_handle(handle, table, format);
        if (!bytes) {
            return bytes.error();
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
    return status_result(devshare_torch_discard(&args));
}

#if DEVSHARE_HPP_EXCEPTIONS
[[nodiscard]] inline Handle handle_from_torch(const DevshareTorchArgs& args) {
    return try_handle_from_torch(args).value();
}
[[nodiscard]] inline std::vector<uint8_t> handle_from_torch_encoded(const DevshareTorchArgs& args) {
    return try_handle_from_torch_encoded(args).value();
}
[[nodiscard]] inline std::vector<uint8_t> torch_storage_handle(const Handle& handle, Span<const uint8_t> table = {},
                                                               uint32_t format = DEVSHARE_TORCH_FORMAT_DEFAULT) {
    return try_torch_storage_handle(handle, table, format).value();
}
[[nodiscard]] inline TorchStorage handle_to_torch(const Handle& handle, Span<const uint8_t> table = {},
                                                 uint32_t format = DEVSHARE_TORCH_FORMAT_DEFAULT) {
    return try_handle_to_torch(handle, table, format).value();
}
[[nodiscard]] inline uint32_t torch_format_for_version(uint16_t backend, const char* torch_version) {
    return try_torch_format_for_version(backend, torch_version).value();
}
[[nodiscard]] inline std::vector<uint8_t> torch_handle_convert(uint16_t backend, Span<const uint8_t> storage_handle,
                                                               uint32_t format) {
    return try_torch_handle_convert(backend, storage_handle, format).value();
}
inline void torch_discard(const DevshareTorchArgs& args) { try_torch_discard(args).value(); }
#endif

// ---------------------------------------------------------------------------------------------
// Exporter

// How ~Exporter (and a move assignment replacing a live exporter) closes; see "Destruction" at
// the top of this header.
enum class OnDestroy : uint8_t {
    close,            // close without flags; refused (device references outstanding): leak + report
    wait_then_close,  // wait up to the policy's timeout for the references, then as `close`
    force,            // close with DEVSHARE_CLOSE_FORCE (device importers lose the memory)
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

// Called when an Exporter's destructor could not close its export (the export is left open).
// It receives the C exporter (now owned by the handler: close it later with
// devshare_exporter_close, or let it live until exit), the status of the refused close, and the
// library's message. It runs inside a destructor: it must not throw.
using ExporterLeakHandler = void (*)(DevshareExporter* exporter, int32_t status, const char* message);

namespace detail {

inline void default_leak_handler(DevshareExporter* exporter, int32_t status, const char* message) {
    uint64_t n = 0;
    if (devshare_exporter_outstanding(exporter, &n) != DEVSHARE_STATUS_OK) {
        n = UINT64_MAX;
    }
    std::fprintf(stderr,
                 "devshare: ~Exporter did not close the export %p (%s: %s; references outstanding: %lld); it stays "
                 "open (leaked) so that no consumer loses its memory. Close it before destruction "
                 "(Exporter::close, wait) or set OnDestroy::force or OnDestroy::wait_then_close.\n",
                 static_cast<void*>(exporter), devshare_status_str(status), message,
                 n == UINT64_MAX ? -1LL : static_cast<long long>(n));
}

inline std::atomic<ExporterLeakHandler>& leak_handler_slot() noexcept {
    static std::atomic<ExporterLeakHandler> slot{&default_leak_handler};
    return slot;
}

}  // namespace detail

// Install the exporter-leak handler (process-wide); nullptr restores the default (one line on
// stderr). Returns the previous handler.
inline ExporterLeakHandler set_exporter_leak_handler(ExporterLeakHandler handler) noexcept {
    return detail::leak_handler_slot().exchange(handler != nullptr ? handler : &detail::default_leak_handler);
}

// Owns one exported allocation (DevshareExporter). Move-only; a moved-from or default-constructed
// Exporter is empty: data() is nullptr, size() is 0, and destroying it does nothing.
class Exporter {
public:
    Exporter() noexcept = default;

    // Allocate `size` bytes of zero-filled shareable host memory (devshare_host_alloc).
    [[nodiscard]] static Result<Exporter> try_host_alloc(uint64_t size) {
        Exporter e;
        const int32_t s = devshare_host_alloc(size, &e.exp_, &e.data_);
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        e.size_ = size;
        return e;
    }

    // Allocate `size` bytes of zero-filled host memory for channels (devshare_channel_host_alloc):
    // a sealed memfd with no name in /dev/shm that travels over a channel (Channel::send,
    // Pool::create) and leaves nothing behind when any process dies. share() refuses it
    // (DEVSHARE_STATUS_UNSUPPORTED): it is for channels only.
    [[nodiscard]] static Result<Exporter> try_channel_host_alloc(uint64_t size) {
        Exporter e;
        const int32_t s = devshare_channel_host_alloc(size, &e.exp_, &e.data_);
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        e.size_ = size;
        return e;
    }

    // Export an existing host shared memory object in PyTorch's file_system layout, e.g. the
    // name storage._share_filename_cpu_() returned (devshare_host_adopt).
    [[nodiscard]] static Result<Exporter> try_host_adopt(const char* name, uint64_t size) {
        Exporter e;
        const int32_t s = devshare_host_adopt(name, size, &e.exp_, &e.data_);
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        e.size_ = size;
        return e;
    }
    [[nodiscard]] static Result<Exporter> try_host_adopt(const std::string& name, uint64_t size) {
        return try_host_adopt(name.c_str(), size);
    }

    // Export existing device memory [ptr, ptr + size) on `backend` and `device`
    // (devshare_export, DEVSHARE_EXPORT_* `flags`). The memory stays owned by the caller and
    // must outlive the export.
    [[nodiscard]] static Result<Exporter> try_export_memory(uint16_t backend, int32_t device, void* ptr, uint64_t size,
                                                            uint32_t flags = 0) {
        Exporter e;
        const int32_t s = devshare_export(backend, device, ptr, size, flags, &e.exp_);
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        e.data_ = ptr;
        e.size_ = size;
        return e;
    }

    // Export a segmented (VMM) allocation: physical.size() segments of `segment_size` bytes
    // mapped back to back from `base` (devshare_export_segments). The memory stays owned by the
    // caller and must outlive the export.
    [[nodiscard]] static Result<Exporter> try_export_segments(uint16_t backend, int32_t device, void* base,
                                                              Span<const uint64_t> physical, uint64_t segment_size,
                                                              uint32_t flags = 0) {
        DevshareExporter* raw = nullptr;
        const int32_t s = devshare_export_segments(backend, device, base, physical.data(), physical.size(),
                                                   segment_size, flags, &raw);
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        return try_adopt(raw);
    }

    // Take ownership of a C exporter (nullptr gives an empty Exporter). On failure (its memory
    // cannot be queried) the exporter stays the caller's.
    [[nodiscard]] static Result<Exporter> try_adopt(DevshareExporter* raw, OnDestroy policy = OnDestroy::close) {
        Exporter e;
        if (raw != nullptr) {
            const int32_t s = devshare_exporter_memory(raw, &e.data_, &e.size_);
            if (s != DEVSHARE_STATUS_OK) {
                return Error::from_last(s);
            }
            e.exp_ = raw;
        }
        e.policy_ = policy;
        return e;
    }

#if DEVSHARE_HPP_EXCEPTIONS
    // Take ownership of a C exporter (nullptr gives an empty Exporter); throws (leaving it to the
    // caller) if its memory cannot be queried.
    explicit Exporter(DevshareExporter* raw, OnDestroy policy = OnDestroy::close)
        : Exporter(try_adopt(raw, policy).value()) {}

    [[nodiscard]] static Exporter host_alloc(uint64_t size) { return try_host_alloc(size).value(); }
    [[nodiscard]] static Exporter channel_host_alloc(uint64_t size) { return try_channel_host_alloc(size).value(); }
    [[nodiscard]] static Exporter host_adopt(const char* name, uint64_t size) {
        return try_host_adopt(name, size).value();
    }
    [[nodiscard]] static Exporter host_adopt(const std::string& name, uint64_t size) {
        return try_host_adopt(name, size).value();
    }
    [[nodiscard]] static Exporter export_memory(uint16_t backend, int32_t device, void* ptr, uint64_t size,
                                                uint32_t flags = 0) {
        return try_export_memory(backend, device, ptr, size, flags).value();
    }
    [[nodiscard]] static Exporter export_segments(uint16_t backend, int32_t device, void* base,
                                                  Span<const uint64_t> physical, uint64_t segment_size,
                                                  uint32_t flags = 0) {
        return try_export_segments(backend, device, base, physical, segment_size, flags).value();
    }
#endif

    Exporter(const Exporter&) = delete;
    Exporter& operator=(const Exporter&) = delete;

    Exporter(Exporter&& other) noexcept
        : exp_(std::exchange(other.exp_, nullptr)),
          data_(std::exchange(other.data_, nullptr)),
          size_(std::exchange(other.size_, 0)),
          policy_(other.policy_),
          destroy_wait_ms_(other.destroy_wait_ms_) {}

    // Disposes of what this Exporter held (by its OnDestroy policy), then takes over `other`
    // (and its policy).
    Exporter& operator=(Exporter&& other) noexcept {
        if (this != &other) {
            dispose();
            exp_ = std::exchange(other.exp_, nullptr);
            data_ = std::exchange(other.data_, nullptr);
            size_ = std::exchange(other.size_, 0);
            policy_ = other.policy_;
            destroy_wait_ms_ = other.destroy_wait_ms_;
        }
        return *this;
    }

    // Closes by the OnDestroy policy (never FORCE unless the policy says so); see the top of
    // this header.
    ~Exporter() { dispose(); }

    // The destruction policy (OnDestroy::close by default); `wait` is the longest
    // OnDestroy::wait_then_close waits (negative: forever).
    void set_on_destroy(OnDestroy policy, std::chrono::milliseconds wait = std::chrono::milliseconds(0)) noexcept {
        policy_ = policy;
        destroy_wait_ms_ = static_cast<int64_t>(wait.count());
    }
    [[nodiscard]] OnDestroy on_destroy() const noexcept { return policy_; }

    // Address of the allocation in this process (valid until close), nullptr when empty.
    [[nodiscard]] void* data() const noexcept { return data_; }
    // Size of the allocation in bytes, 0 when empty.
    [[nodiscard]] uint64_t size() const noexcept { return size_; }
    // The C exporter, still owned by this object (nullptr when empty).
    [[nodiscard]] DevshareExporter* get() const noexcept { return exp_; }
    explicit operator bool() const noexcept { return exp_ != nullptr; }

    // Give up ownership: the caller must devshare_exporter_close the result. Leaves this empty.
    [[nodiscard]] DevshareExporter* release() noexcept {
        data_ = nullptr;
        size_ = 0;
        return std::exchange(exp_, nullptr);
    }

    // --- Describing a tensor in the allocation

    // A TensorDesc for a tensor whose first element is at byte `offset` of the allocation, with
    // `shape` and `strides` in elements (empty strides: C-contiguous). The storage is the whole
    // allocation unless `options` say otherwise; the tensor's offset in it is computed (the
    // first element must lie a whole number of elements after the storage's start).
    [[nodiscard]] Result<TensorDesc> try_describe_at(DevshareDType dtype, uint64_t offset, Dims shape,
                                                     Dims strides = {}, const ShareOptions& options = {}) const {
        return detail::describe_at("devshare::Exporter::share", dtype, offset, shape, strides, options);
    }

    // The same for a tensor whose first element is at `first`, an address in [data(), data() +
    // size()] (device exports: the device address).
    [[nodiscard]] Result<TensorDesc> try_describe(DevshareDType dtype, const void* first, Dims shape,
                                                  Dims strides = {}, const ShareOptions& options = {}) const {
        const uintptr_t p = reinterpret_cast<uintptr_t>(first);
        const uintptr_t b = reinterpret_cast<uintptr_t>(data_);
        if (exp_ == nullptr) {
            return detail::error(DEVSHARE_STATUS_NULL_ARGUMENT, "devshare::Exporter::share: the Exporter is empty");
        }
        if (first == nullptr || p < b || p - b > size_) {
            return detail::error(DEVSHARE_STATUS_INVALID_ARGUMENT,
                                 "devshare::Exporter::share: the first element's address is outside the allocation "
                                 "[data(), data() + " + std::to_string(size_) + ")");
        }
        return try_describe_at(dtype, static_cast<uint64_t>(p - b), shape, strides, options);
    }
    template <typename T>
    [[nodiscard]] Result<TensorDesc> try_describe(const T* first, Dims shape, Dims strides = {},
                                                  const ShareOptions& options = {}) const {
        return try_describe(dtype_of<T>(), static_cast<const void*>(first), shape, strides, options);
    }

    // --- Sharing: each success is one new reference (one handle), see Handle.

    // A handle for the tensor of element type T whose first element is at `first` (inside the
    // allocation), with `shape` and `strides` in elements (empty: C-contiguous):
    //     Handle h = exp.share(p, {rows, cols});          // float* p
    //     Handle h = exp.share<float>(exp.data(), {n});   // T named when `first` is void*
    template <typename T>
    [[nodiscard]] Result<Handle> try_share(const T* first, Dims shape, Dims strides = {},
                                           const ShareOptions& options = {}) const {
        static_assert(has_dtype_v<T>, "devshare::Exporter::share<T>: T has no dtype; pass a DevshareDType");
        return share_desc(try_describe(dtype_of<T>(), first, shape, strides, options));
    }
    template <typename T>
    [[nodiscard]] Result<Handle> try_share(const void* first, Dims shape, Dims strides = {},
                                           const ShareOptions& options = {}) const {
        static_assert(has_dtype_v<T>, "devshare::Exporter::share<T>: T has no dtype; pass a DevshareDType");
        return share_desc(try_describe(dtype_of<T>(), first, shape, strides, options));
    }
    // The same with an explicit dtype (kBFloat16, kFloat16, ...).
    [[nodiscard]] Result<Handle> try_share(DevshareDType dtype, const void* first, Dims shape, Dims strides = {},
                                           const ShareOptions& options = {}) const {
        return share_desc(try_describe(dtype, first, shape, strides, options));
    }
    // The same with the first element's byte offset in the allocation instead of its address.
    template <typename T>
    [[nodiscard]] Result<Handle> try_share_at(uint64_t offset, Dims shape, Dims strides = {},
                                              const ShareOptions& options = {}) const {
        static_assert(has_dtype_v<T>, "devshare::Exporter::share_at<T>: T has no dtype; pass a DevshareDType");
        return share_desc(try_describe_at(dtype_of<T>(), offset, shape, strides, options));
    }
    [[nodiscard]] Result<Handle> try_share_at(DevshareDType dtype, uint64_t offset, Dims shape, Dims strides = {},
                                              const ShareOptions& options = {}) const {
        return share_desc(try_describe_at(dtype, offset, shape, strides, options));
    }
    // A handle for a described tensor.
    [[nodiscard]] Result<Handle> try_share(const TensorDesc& desc) const {
        const DevshareTensorDesc d = desc.raw();
        return try_share(d);
    }
    // A handle for a C desc (start it from devshare::tensor_desc(): a desc without struct_size is
    // refused).
    [[nodiscard]] Result<Handle> try_share(const DevshareTensorDesc& desc) const { return share_raw(&desc); }
    // A handle for the whole allocation as a 1-D uint8 tensor.
    [[nodiscard]] Result<Handle> try_share_bytes() const { return share_raw(nullptr); }

    // A new handle's byte encoding (devshare_exporter_share_encoded): the form that also carries
    // a segmented export's long segment table. Import it with Import::from_encoded.
    [[nodiscard]] Result<std::vector<uint8_t>> try_share_encoded(const TensorDesc& desc) const {
        const DevshareTensorDesc d = desc.raw();
        return share_encoded_raw(&d);
    }
    [[nodiscard]] Result<std::vector<uint8_t>> try_share_encoded(const DevshareTensorDesc& desc) const {
        return share_encoded_raw(&desc);
    }
    // The whole allocation as 1-D uint8, encoded.
    [[nodiscard]] Result<std::vector<uint8_t>> try_share_bytes_encoded() const { return share_encoded_raw(nullptr); }

    // The segment table of a segmented export whose table does not fit a handle (empty for
    // other exports), for torch_storage_handle / handle_to_torch.
    [[nodiscard]] Result<std::vector<uint8_t>> try_segment_table() const {
        return detail::read_bytes(0, [this](uint8_t* buf, size_t cap, size_t* len) {
            return devshare_exporter_segment_table(exp_, cap == 0 ? nullptr : buf, cap, len);
        });
    }

    // Let the importer with this pid import (acl pid whitelist; devshare_exporter_allow_pid).
    // The importer learns its pid with devshare::local_pid().
    [[nodiscard]] Result<void> try_allow_pid(int32_t pid) const {
        return status_result(devshare_exporter_allow_pid(exp_, pid));
    }

    // References handed out and not yet released.
    [[nodiscard]] Result<uint64_t> try_outstanding() const {
        uint64_t n = 0;
        const int32_t s = devshare_exporter_outstanding(exp_, &n);
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        return n;
    }

    // Wait until every reference was released: true when they were, false when `timeout` passed
    // first (a negative timeout waits forever).
    [[nodiscard]] Result<bool> try_wait(std::chrono::milliseconds timeout) const {
        const int32_t s = devshare_exporter_wait(exp_, static_cast<int64_t>(timeout.count()));
        if (s == DEVSHARE_STATUS_TIMEOUT) {
            return false;
        }
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        return true;
    }

    // Close the export; afterwards this Exporter is empty. Without Close::force a device export
    // with outstanding references is refused (DEVSHARE_STATUS_BUSY) and this Exporter stays as
    // it was. Host memory closes at once: importers keep their mapping until they release. An
    // empty Exporter's close does nothing.
    [[nodiscard]] Result<void> try_close(Close flags = Close::normal) {
        if (exp_ == nullptr) {
            return Result<void>();
        }
        const int32_t s = devshare_exporter_close(exp_, static_cast<uint32_t>(flags));
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        exp_ = nullptr;
        data_ = nullptr;
        size_ = 0;
        return Result<void>();
    }

#if DEVSHARE_HPP_EXCEPTIONS
    template <typename T>
    [[nodiscard]] Handle share(const T* first, Dims shape, Dims strides = {}, const ShareOptions& options = {}) const {
        return try_share<T>(first, shape, strides, options).value();
    }
    template <typename T>
    [[nodiscard]] Handle share(const void* first, Dims shape, Dims strides = {},
                               const ShareOptions& options = {}) const {
        return try_share<T>(first, shape, strides, options).value();
    }
    [[nodiscard]] Handle share(DevshareDType dtype, const void* first, Dims shape, Dims strides = {},
                               const ShareOptions& options = {}) const {
        return try_share(dtype, first, shape, strides, options).value();
    }
    template <typename T>
    [[nodiscard]] Handle share_at(uint64_t offset, Dims shape, Dims strides = {},
                                  const ShareOptions& options = {}) const {
        return try_share_at<T>(offset, shape, strides, options).value();
    }
    [[nodiscard]] Handle share_at(DevshareDType dtype, uint64_t offset, Dims shape, Dims strides = {},
                                  const ShareOptions& options = {}) const {
        return try_share_at(dtype, offset, shape, strides, options).value();
    }
    [[nodiscard]] Handle share(const TensorDesc& desc) const { return try_share(desc).value(); }
    [[nodiscard]] Handle share(const DevshareTensorDesc& desc) const { return try_share(desc).value(); }
    [[nodiscard]] Handle share_bytes() const { return try_share_bytes().value(); }
    [[nodiscard]] std::vector<uint8_t> share_encoded(const TensorDesc& desc) const {
        return try_share_encoded(desc).value();
    }
    [[nodiscard]] std::vector<uint8_t> share_encoded(const DevshareTensorDesc& desc) const {
        return try_share_encoded(desc).value();
    }
    [[nodiscard]] std::vector<uint8_t> share_bytes_encoded() const { return try_share_bytes_encoded().value(); }
    template <typename T>
    [[nodiscard]] TensorDesc describe(const T* first, Dims shape, Dims strides = {},
                                      const ShareOptions& options = {}) const {
        return try_describe(first, shape, strides, options).value();
    }
    [[nodiscard]] TensorDesc describe(DevshareDType dtype, const void* first, Dims shape, Dims strides = {},
                                      const ShareOptions& options = {}) const {
        return try_describe(dtype, first, shape, strides, options).value();
    }
    [[nodiscard]] TensorDesc describe_at(DevshareDType dtype, uint64_t offset, Dims shape, Dims strides = {},
                                         const ShareOptions& options = {}) const {
        return try_describe_at(dtype, offset, shape, strides, options).value();
    }
    [[nodiscard]] std::vector<uint8_t> segment_table() const { return try_segment_table().value(); }
    void allow_pid(int32_t pid) const { try_allow_pid(pid).value(); }
    [[nodiscard]] uint64_t outstanding() const { return try_outstanding().value(); }
    [[nodiscard]] bool wait(std::chrono::milliseconds timeout) const { return try_wait(timeout).value(); }
    void close(Close flags = Close::normal) { try_close(flags).value(); }
#endif

private:
    Result<Handle> share_raw(const DevshareTensorDesc* desc) const {
        Handle h;
        const int32_t s = devshare_exporter_share(exp_, desc, &h.raw());
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        return h;
    }
    Result<Handle> share_desc(const Result<TensorDesc>& desc) const {
        if (!desc) {
            return desc.error();
        }
        return try_share(*desc);
    }
    Result<std::vector<uint8_t>> share_encoded_raw(const DevshareTensorDesc* desc) const {
        // BUFFER_TOO_SMALL shares nothing: the second call makes the one reference.
        return detail::read_bytes(DEVSHARE_HANDLE_MAX_ENCODED_SIZE, [&](uint8_t* buf, size_t cap, size_t* len) {
            return devshare_exporter_share_encoded(exp_, desc, buf, cap, len);
        });
    }

    // Close by the policy; what cannot be closed is handed to the leak handler.
    void dispose() noexcept {
        if (exp_ == nullptr) {
            return;
        }
        DevshareExporter* e = std::exchange(exp_, nullptr);
        data_ = nullptr;
        size_ = 0;
        if (policy_ == OnDestroy::wait_then_close) {
            (void)devshare_exporter_wait(e, destroy_wait_ms_);
        }
        const uint32_t flags = policy_ == OnDestroy::force ? DEVSHARE_CLOSE_FORCE : 0u;
        const int32_t s = devshare_exporter_close(e, flags);
        if (s != DEVSHARE_STATUS_OK) {
            char message[512];
            (void)devshare_last_error(message, sizeof message);
            detail::leak_handler_slot().load()(e, s, message);
        }
    }

    DevshareExporter* exp_ = nullptr;
    void* data_ = nullptr;
    uint64_t size_ = 0;
    OnDestroy policy_ = OnDestroy::close;
    int64_t destroy_wait_ms_ = 0;
};

// ---------------------------------------------------------------------------------------------
// TensorView

// A strided view of a tensor: its first element, shape and strides (in elements), copied from the
// handle (at most DEVSHARE_MAX_NDIM dimensions). v(i, j) is element [i][j] (checked with assert
// in debug builds). The pointer is what the import's data pointer is: for device backends a
// device address, not to be dereferenced on the host. Valid while the import is.
template <typename T>
class TensorView {
public:
    using element_type = T;

    TensorView() noexcept = default;
    TensorView(T* data, Dims shape, Dims strides) noexcept : data_(data) {
        ndim_ = static_cast<uint32_t>(shape.size() < DEVSHARE_MAX_NDIM ? shape.size() : DEVSHARE_MAX_NDIM);
        for (uint32_t i = 0; i < ndim_; i++) {
            shape_[i] = shape[i];
            strides_[i] = i < strides.size() ? strides[i] : 0;
        }
        if (strides.size() < ndim_) {  // no strides: C-contiguous
            int64_t s = 1;
            for (uint32_t i = ndim_; i-- > 0;) {
                strides_[i] = s;
                s *= shape_[i];
            }
        }
    }

    [[nodiscard]] T* data() const noexcept { return data_; }
    [[nodiscard]] uint32_t ndim() const noexcept { return ndim_; }
    [[nodiscard]] Dims shape() const noexcept { return Dims(shape_, ndim_); }
    [[nodiscard]] Dims strides() const noexcept { return Dims(strides_, ndim_); }
    [[nodiscard]] int64_t extent(uint32_t dim) const noexcept { return dim < ndim_ ? shape_[dim] : 1; }
    [[nodiscard]] int64_t stride(uint32_t dim) const noexcept { return dim < ndim_ ? strides_[dim] : 0; }
    [[nodiscard]] int64_t numel() const noexcept {
        int64_t n = 1;
        for (uint32_t i = 0; i < ndim_; i++) {
            n *= shape_[i];
        }
        return n;
    }
    // C-contiguous (row-major, no gaps; dimensions of size 1 may have any stride).
    [[nodiscard]] bool is_contiguous() const noexcept {
        int64_t expect = 1;
        for (uint32_t i = ndim_; i-- > 0;) {
            if (shape_[i] == 0) {
                return true;
            }
            if (shape_[i] != 1) {
                if (strides_[i] != expect) {
                    return false;
                }
                expect *= shape_[i];
            }
        }
        return true;
    }

    // Element [i0][i1]...: as many indices as ndim().
    template <typename... I, typename = std::enable_if_t<(std::is_integral<I>::value && ...)>>
    [[nodiscard]] T& operator()(I... index) const noexcept {
        assert(sizeof...(I) == ndim_ && "devshare::TensorView: one index per dimension");
        const int64_t ix[sizeof...(I) + 1] = {static_cast<int64_t>(index)..., 0};
        int64_t offset = 0;
        for (size_t k = 0; k != sizeof...(I); k++) {
            assert(ix[k] >= 0 && ix[k] < shape_[k] && "devshare::TensorView: index out of range");
            offset += ix[k] * strides_[k];
        }
        return data_[offset];
    }
    // Element at an index list of ndim() entries.
    [[nodiscard]] T& at(Dims index) const noexcept {
        assert(index.size() == ndim_ && "devshare::TensorView: one index per dimension");
        int64_t offset = 0;
        for (size_t k = 0; k < index.size() && k < ndim_; k++) {
            assert(index[k] >= 0 && index[k] < shape_[k] && "devshare::TensorView: index out of range");
            offset += index[k] * strides_[k];
        }
        return data_[offset];
    }

    // The elements as one contiguous Span (only for a C-contiguous view).
    [[nodiscard]] Result<Span<T>> try_flat() const {
        if (!is_contiguous()) {
            return detail::error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare::TensorView::flat: the view is not "
                                                                   "C-contiguous");
        }
        return Span<T>(data_, static_cast<size_t>(numel()));
    }
#if DEVSHARE_HPP_EXCEPTIONS
    [[nodiscard]] Span<T> flat() const { return try_flat().value(); }
#endif

#if defined(__cpp_lib_mdspan)
    // std::mdspan of rank Rank with layout_stride. Refused when ndim() != Rank or the layout is
    // not one layout_stride accepts (strides >= 1, no two elements at one address).
    template <std::size_t Rank>
    using mdspan_type = std::mdspan<T, std::dextents<int64_t, Rank>, std::layout_stride>;

    template <std::size_t Rank>
    [[nodiscard]] Result<mdspan_type<Rank>> try_mdspan() const {
        if (ndim_ != Rank) {
            return detail::error(DEVSHARE_STATUS_BAD_NDIM, "devshare::TensorView::mdspan<" + std::to_string(Rank) +
                                                               ">: the tensor has " + std::to_string(ndim_) +
                                                               " dimensions");
        }
        if (!unique_positive_layout()) {
            return detail::error(DEVSHARE_STATUS_INVALID_ARGUMENT,
                                 "devshare::TensorView::mdspan: std::layout_stride needs positive strides that map no "
                                 "two elements to one address");
        }
        std::array<int64_t, Rank> ext{};
        std::array<int64_t, Rank> str{};
        for (std::size_t i = 0; i < Rank; i++) {
            ext[i] = shape_[i];
            str[i] = strides_[i];
        }
        const std::dextents<int64_t, Rank> e(ext);
        return mdspan_type<Rank>(data_, std::layout_stride::mapping<std::dextents<int64_t, Rank>>(e, str));
    }
#if DEVSHARE_HPP_EXCEPTIONS
    template <std::size_t Rank>
    [[nodiscard]] mdspan_type<Rank> mdspan() const {
        return try_mdspan<Rank>().value();
    }
#endif
#endif

private:
#if defined(__cpp_lib_mdspan)
    bool unique_positive_layout() const noexcept {
        uint32_t order[DEVSHARE_MAX_NDIM];
        for (uint32_t i = 0; i < ndim_; i++) {
            if (strides_[i] < 1) {
                return false;
            }
            order[i] = i;
        }
        for (uint32_t i = 1; i < ndim_; i++) {  // insertion sort by (stride, extent)
            for (uint32_t j = i; j > 0; j--) {
                const uint32_t a = order[j - 1], b = order[j];
                if (strides_[a] > strides_[b] || (strides_[a] == strides_[b] && shape_[a] > shape_[b])) {
                    order[j - 1] = b;
                    order[j] = a;
                } else {
                    break;
                }
            }
        }
        for (uint32_t i = 1; i < ndim_; i++) {
            if (strides_[order[i]] < strides_[order[i - 1]] * shape_[order[i - 1]]) {
                return false;
            }
        }
        return true;
    }
#endif

    T* data_ = nullptr;
    uint32_t ndim_ = 0;
    int64_t shape_[DEVSHARE_MAX_NDIM] = {};
    int64_t strides_[DEVSHARE_MAX_NDIM] = {};
};

// ---------------------------------------------------------------------------------------------
// DLPack

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

public:
    DLPackTensor() noexcept = default;
    explicit DLPackTensor(M* managed) noexcept : p_(managed) {}
    DLPackTensor(const DLPackTensor&) = delete;
    DLPackTensor& operator=(const DLPackTensor&) = delete;
    DLPackTensor(DLPackTensor&& other) noexcept : p_(std::exchange(other.p_, nullptr)) {}
    DLPackTensor& operator=(DLPackTensor&& other) noexcept {
        if (this != &other) {
            reset();
            p_ = std::exchange(other.p_, nullptr);
        }
        return *this;
    }
    ~DLPackTensor() { reset(); }

    // Run the deleter now (nothing when empty).
    void reset() noexcept {
        if (p_ != nullptr) {
            Layout* l = layout();
            p_ = nullptr;
            if (l->deleter != nullptr) {
                l->deleter(l);
            }
        }
    }
    // Give up ownership: whoever takes the pointer runs its deleter.
    [[nodiscard]] M* release() noexcept { return std::exchange(p_, nullptr); }
    [[nodiscard]] M* get() const noexcept { return p_; }
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
    Layout* layout() const noexcept { return reinterpret_cast<Layout*>(p_); }
    const detail::DLTensorLayout& tensor() const noexcept { return layout()->dl_tensor; }

    M* p_ = nullptr;
};

using DLPackVersioned = DLPackTensor<DLManagedTensorVersioned>;
using DLPackLegacy = DLPackTensor<DLManagedTensor>;

// ---------------------------------------------------------------------------------------------
// Import

// Which pool slot an Import received from a channel is (Import::pool_slot): the pool's id on
// that channel (> 0) and the slot's index.
struct PoolSlot {
    uint32_t pool = 0;
    uint32_t slot = 0;
};

// Owns one import of a handle (DevshareImport). Move-only; a moved-from or default-constructed
// Import is empty: data() is nullptr and destroying or releasing it does nothing. Destroying a
// non-empty Import releases it (errors are ignored); the reference goes back to the exporter
// when this was the process's last import of that handle. The import's info and handle are
// read once, at construction.
class Import {
public:
    Import() noexcept = default;

    // Import `handle` (options nullptr: read-write, the handle's device). The handle is not kept.
    [[nodiscard]] static Result<Import> try_from(const Handle& handle, const DevshareImportOptions* options = nullptr) {
        DevshareImport* raw = nullptr;
        const int32_t s = devshare_import(&handle.raw(), options, &raw);
        return finish(s, raw);
    }
    [[nodiscard]] static Result<Import> try_from(const Handle& handle, const DevshareImportOptions& options) {
        return try_from(handle, &options);
    }

    // Import a handle's byte encoding (devshare_import_encoded: also segmented handles whose
    // table travels in the encoding).
    [[nodiscard]] static Result<Import> try_from_encoded(Span<const uint8_t> bytes,
                                                         const DevshareImportOptions* options = nullptr) {
        DevshareImport* raw = nullptr;
        const int32_t s = devshare_import_encoded(bytes.data(), bytes.size(), options, &raw);
        return finish(s, raw);
    }
    [[nodiscard]] static Result<Import> try_from_encoded(Span<const uint8_t> bytes,
                                                         const DevshareImportOptions& options) {
        return try_from_encoded(bytes, &options);
    }

    // Import handle text (devshare_import_text).
    [[nodiscard]] static Result<Import> try_from_text(const char* text, const DevshareImportOptions* options = nullptr) {
        DevshareImport* raw = nullptr;
        const int32_t s = devshare_import_text(text, options, &raw);
        return finish(s, raw);
    }
    [[nodiscard]] static Result<Import> try_from_text(const std::string& text,
                                                      const DevshareImportOptions* options = nullptr) {
        return try_from_text(text.c_str(), options);
    }
    [[nodiscard]] static Result<Import> try_from_text(const std::string& text, const DevshareImportOptions& options) {
        return try_from_text(text.c_str(), &options);
    }

    // Import the storage a PyTorch (cuda) or torch_npu (acl) tuple names (devshare_import_torch).
    [[nodiscard]] static Result<Import> try_from_torch(const DevshareTorchArgs& args,
                                                       const DevshareImportOptions* options = nullptr) {
        DevshareImport* raw = nullptr;
        const int32_t s = devshare_import_torch(&args, options, &raw);
        return finish(s, raw);
    }
    [[nodiscard]] static Result<Import> try_from_torch(const DevshareTorchArgs& args,
                                                       const DevshareImportOptions& options) {
        return try_from_torch(args, &options);
    }

    // Take ownership of a C import (nullptr: an empty Import). On failure (its info cannot be
    // read) the import stays the caller's.
    [[nodiscard]] static Result<Import> try_adopt(DevshareImport* raw) {
        Import imp;
        if (raw == nullptr) {
            return imp;
        }
        (void)devshare_import_info_init(&imp.info_, sizeof imp.info_);  // cannot fail: non-NULL, sizeof
        int32_t s = devshare_import_info(raw, &imp.info_);
        if (s == DEVSHARE_STATUS_OK) {
            s = devshare_import_handle(raw, &imp.handle_.raw());
        }
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        imp.imp_ = raw;
        return imp;
    }

#if DEVSHARE_HPP_EXCEPTIONS
    explicit Import(const Handle& handle, const DevshareImportOptions* options = nullptr)
        : Import(try_from(handle, options).value()) {}
    Import(const Handle& handle, const DevshareImportOptions& options) : Import(handle, &options) {}

    [[nodiscard]] static Import from(const Handle& handle, const DevshareImportOptions* options = nullptr) {
        return try_from(handle, options).value();
    }
    [[nodiscard]] static Import from_encoded(Span<const uint8_t> bytes, const DevshareImportOptions* options = nullptr) {
        return try_from_encoded(bytes, options).value();
    }
    [[nodiscard]] static Import from_text(const char* text, const DevshareImportOptions* options = nullptr) {
        return try_from_text(text, options).value();
    }
    [[nodiscard]] static Import from_text(const std::string& text, const DevshareImportOptions* options = nullptr) {
        return try_from_text(text, options).value();
    }
    [[nodiscard]] static Import from_torch(const DevshareTorchArgs& args,
                                           const DevshareImportOptions* options = nullptr) {
        return try_from_torch(args, options).value();
    }
#endif

    Import(const Import&) = delete;
    Import& operator=(const Import&) = delete;

    Import(Import&& other) noexcept
        : imp_(std::exchange(other.imp_, nullptr)),
          info_(std::exchange(other.info_, DevshareImportInfo{})),
          handle_(std::exchange(other.handle_, Handle())) {}

    // Releases what this Import held, then takes over `other`.
    Import& operator=(Import&& other) noexcept {
        if (this != &other) {
            release_quietly();
            imp_ = std::exchange(other.imp_, nullptr);
            info_ = std::exchange(other.info_, DevshareImportInfo{});
            handle_ = std::exchange(other.handle_, Handle());
        }
        return *this;
    }

    ~Import() { release_quietly(); }

    // The tensor's first element, unchecked (nullptr when empty). Valid until release.
    [[nodiscard]] void* data() const noexcept { return info_.data; }

    // The tensor's first element as T*, or nullptr when T is not the tensor's element type (or T
    // is not const and the import is read-only, or the Import is empty): as<T>() says why.
    // T = std::byte (or void) gives the bytes unchecked.
    template <typename T>
    [[nodiscard]] T* data() const noexcept {
        using U = std::remove_cv_t<T>;
        if constexpr (std::is_void<U>::value || std::is_same<U, std::byte>::value) {
            return static_cast<T*>(info_.data);
        } else {
            static_assert(has_dtype_v<U>, "devshare::Import::data<T>: T has no dtype; use data() or data<std::byte>()");
            if (!same_dtype(handle_.dtype(), dtype_of<U>()) || (!std::is_const<T>::value && info_.read_only != 0)) {
                return nullptr;
            }
            return static_cast<T*>(info_.data);
        }
    }

    // A strided view of the tensor as elements of type T. Refused (DEVSHARE_STATUS_BAD_DTYPE)
    // when T is not the tensor's element type: no reinterpretation. A read-only import needs a
    // const T (DEVSHARE_STATUS_INVALID_ARGUMENT otherwise).
    template <typename T>
    [[nodiscard]] Result<TensorView<T>> try_as() const {
        using U = std::remove_cv_t<T>;
        static_assert(has_dtype_v<U>, "devshare::Import::as<T>: T has no dtype");
        if (imp_ == nullptr) {
            return detail::error(DEVSHARE_STATUS_NULL_ARGUMENT, "devshare::Import::as: the Import is empty");
        }
        if (!same_dtype(handle_.dtype(), dtype_of<U>())) {
            return detail::error(DEVSHARE_STATUS_BAD_DTYPE, "devshare::Import::as<" + dtype_name(dtype_of<U>()) +
                                                                ">: the tensor's dtype is " +
                                                                dtype_name(handle_.dtype()));
        }
        if (!std::is_const<T>::value && info_.read_only != 0) {
            return detail::error(DEVSHARE_STATUS_INVALID_ARGUMENT,
                                 "devshare::Import::as<" + dtype_name(dtype_of<U>()) +
                                     ">: the import is read-only; ask for a const element type");
        }
        return TensorView<T>(static_cast<T*>(info_.data), handle_.shape(), handle_.strides());
    }

    // DLPack views of the import (each holds its own reference to it).
    [[nodiscard]] Result<DLPackVersioned> try_to_dlpack_versioned() const {
        DLManagedTensorVersioned* m = nullptr;
        const int32_t s = devshare_import_to_dlpack_versioned(imp_, &m);
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        return DLPackVersioned(m);
    }
    // The legacy DLManagedTensor (it cannot say read-only).
    [[nodiscard]] Result<DLPackLegacy> try_to_dlpack() const {
        DLManagedTensor* m = nullptr;
        const int32_t s = devshare_import_to_dlpack(imp_, &m);
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        return DLPackLegacy(m);
    }

#if DEVSHARE_HPP_EXCEPTIONS
    template <typename T>
    [[nodiscard]] TensorView<T> as() const {
        return try_as<T>().value();
    }
    [[nodiscard]] DLPackVersioned to_dlpack_versioned() const { return try_to_dlpack_versioned().value(); }
    [[nodiscard]] DLPackLegacy to_dlpack() const { return try_to_dlpack().value(); }
#endif

    // For an item received from a channel that is a pool slot (Connection::recv): the pool's id
    // and the slot's index (devshare_import_pool_slot). Any other import (a leased reference, an
    // import of a handle) is DEVSHARE_STATUS_INVALID_ARGUMENT; an empty Import NULL_ARGUMENT.
    [[nodiscard]] Result<PoolSlot> try_pool_slot() const {
        PoolSlot ps;
        const int32_t s = devshare_import_pool_slot(imp_, &ps.pool, &ps.slot);
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        return ps;
    }
#if DEVSHARE_HPP_EXCEPTIONS
    [[nodiscard]] PoolSlot pool_slot() const { return try_pool_slot().value(); }
#endif

    // For a channel item: give it back to the producer now (devshare_import_give_back) while
    // this Import stays mapped until it is released or destroyed; what is read meanwhile is
    // whatever the producer writes there next. Any other import: DEVSHARE_STATUS_INVALID_ARGUMENT.
    [[nodiscard]] Result<void> try_give_back() const { return status_result(devshare_import_give_back(imp_)); }
#if DEVSHARE_HPP_EXCEPTIONS
    void give_back() const { try_give_back().value(); }
#endif

    // Pointers and sizes of the import (all zero when empty).
    [[nodiscard]] const DevshareImportInfo& info() const noexcept { return info_; }
    // The handle this import was made from (an empty Handle when the Import is empty).
    [[nodiscard]] const Handle& handle() const noexcept { return handle_; }

    [[nodiscard]] DevshareDType dtype() const noexcept { return handle_.dtype(); }
    [[nodiscard]] uint32_t ndim() const noexcept { return handle_.ndim(); }
    [[nodiscard]] Dims shape() const noexcept { return handle_.shape(); }
    [[nodiscard]] Dims strides() const noexcept { return handle_.strides(); }
    [[nodiscard]] uint64_t numel() const noexcept { return info_.numel; }
    [[nodiscard]] uint64_t element_size() const noexcept { return info_.element_size; }
    [[nodiscard]] bool read_only() const noexcept { return info_.read_only != 0; }
    // Device the allocation was imported on (0 for host).
    [[nodiscard]] int32_t device() const noexcept { return info_.device; }
    [[nodiscard]] uint16_t backend() const noexcept { return info_.backend; }

    // The C import, still owned by this object (nullptr when empty).
    [[nodiscard]] DevshareImport* get() const noexcept { return imp_; }
    explicit operator bool() const noexcept { return imp_ != nullptr; }

    // Release now (see the class comment); afterwards this Import is empty and its pointers are
    // invalid. Releasing an empty Import does nothing.
    [[nodiscard]] Result<void> try_release() {
        if (imp_ == nullptr) {
            return Result<void>();
        }
        DevshareImport* imp = std::exchange(imp_, nullptr);
        info_ = DevshareImportInfo{};
        handle_ = Handle();
        return status_result(devshare_import_release(imp));
    }
#if DEVSHARE_HPP_EXCEPTIONS
    void release() { try_release().value(); }
#endif

private:
    static Result<Import> finish(int32_t status, DevshareImport* raw) {
        if (status != DEVSHARE_STATUS_OK) {
            return Error::from_last(status);
        }
        Result<Import> imp = try_adopt(raw);
        if (!imp) {
            (void)devshare_import_release(raw);
        }
        return imp;
    }

    void release_quietly() noexcept {
        if (imp_ != nullptr) {
            (void)devshare_import_release(std::exchange(imp_, nullptr));
            info_ = DevshareImportInfo{};
            handle_ = Handle();
        }
    }

    DevshareImport* imp_ = nullptr;
    DevshareImportInfo info_{};
    Handle handle_;
};

// ---------------------------------------------------------------------------------------------
// Channels, connections and pools
//
// A producer listens on a Channel (a Unix SOCK_SEQPACKET socket: a file-system path or "@name");
// consumers connect to it (Connection) and receive items as ordinary Imports. An item is a
// leased reference to a tensor of an Exporter (Channel::send) or a slot of a Pool (Pool::send).
// When the consumer's Import goes (destroyed or released), the reference or slot goes back to
// the producer; when the consumer closes its Connection, exits or dies, all of its leases and
// slots go back at once.
//
// Nothing runs in background threads. The producer's end moves (connections accepted, releases
// and returned slots taken, hang-ups noticed) only inside Channel::service and the calls that
// wait on it: Channel::wait_peers, Pool::acquire, and Exporter::wait of an export sent over the
// channel. Serve the channel from your own loop: poll Channel::fd() for reading and call
// service(0ms) when it is readable (or call service() regularly). A consumer's
// Connection::fd() is readable when an item or the producer's close arrives.
//
// Pool slots keep one address in the consumer for the pool's life: the consumer imports the
// whole pool allocation once, with its first item, and every later item of that pool is a slot
// of the same mapping. That is what captured device graphs (CUDA graphs, aclgraph) need: capture
// on the slots' addresses once, replay on whichever slot arrives.
//
// Timeouts are std::chrono::milliseconds: 0 does not wait, a negative one (kForever) waits
// forever; the C API takes int32_t milliseconds, so longer ones are cut to about 24.8 days. As
// with Exporter::wait, running out of time is an answer, not an error: wait_peers gives false,
// recv an empty Import, acquire an empty Slot. DEVSHARE_STATUS_CLOSED says the other end is gone
// (or the channel was closed): nothing more will arrive.
//
// Destruction: ~Channel closes the channel (every consumer's recv then says CLOSED, its pools
// are closed, the socket file is removed); ~Connection closes the connection (the producer takes
// back its leases and slots; Imports received from it stay valid until released); ~Pool closes
// the pool (consumers keep their items until they release them); ~Slot gives back an acquired
// slot that was not sent. A Pool may outlive its Channel (its calls then fail with CLOSED); a
// Slot must not outlive its Pool.
//
// Threading follows devshare.h: a Channel, Connection or Pool may be used from several threads
// at once, except for close() and destruction. A Slot is one thread's at a time.

// A timeout that waits forever (for Channel, Connection, Pool and Exporter::wait).
inline constexpr std::chrono::milliseconds kForever{-1};

namespace detail {

// A C timeout: milliseconds as int32_t, negative -> -1 (forever), longer ones cut to INT32_MAX.
[[nodiscard]] constexpr int32_t timeout_ms(std::chrono::milliseconds timeout) noexcept {
    return timeout.count() < 0 ? -1
           : timeout.count() > std::numeric_limits<int32_t>::max()
               ? std::numeric_limits<int32_t>::max()
               : static_cast<int32_t>(timeout.count());
}

}  // namespace detail

// The producer end of a channel (DevshareChannel). Move-only; a moved-from or
// default-constructed Channel is empty and destroying it does nothing. Destroying a non-empty
// Channel closes it (see "Channels, connections and pools" above).
class Channel {
public:
    Channel() noexcept = default;

    // Listen on `address` (devshare_channel_listen): a file-system path (the socket file is
    // created with mode 0600 and removed by close; an existing file is never replaced:
    // DEVSHARE_STATUS_BUSY) or "@name", a Linux abstract socket. Only processes of this
    // process's effective uid may connect until restrict() says otherwise.
    [[nodiscard]] static Result<Channel> try_listen(const char* address) {
        Channel c;
        const int32_t s = devshare_channel_listen(address, &c.ch_);
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        return c;
    }
    [[nodiscard]] static Result<Channel> try_listen(const std::string& address) { return try_listen(address.c_str()); }

    // Take ownership of a C channel (nullptr gives an empty Channel).
    [[nodiscard]] static Channel adopt(DevshareChannel* raw) noexcept {
        Channel c;
        c.ch_ = raw;
        return c;
    }

#if DEVSHARE_HPP_EXCEPTIONS
    [[nodiscard]] static Channel listen(const char* address) { return try_listen(address).value(); }
    [[nodiscard]] static Channel listen(const std::string& address) { return try_listen(address).value(); }
#endif

    Channel(const Channel&) = delete;
    Channel& operator=(const Channel&) = delete;
    Channel(Channel&& other) noexcept : ch_(std::exchange(other.ch_, nullptr)) {}
    // Closes what this Channel held, then takes over `other`.
    Channel& operator=(Channel&& other) noexcept {
        if (this != &other) {
            (void)devshare_channel_close(ch_);
            ch_ = std::exchange(other.ch_, nullptr);
        }
        return *this;
    }
    ~Channel() { (void)devshare_channel_close(ch_); }

    // The C channel, still owned by this object (nullptr when empty).
    [[nodiscard]] DevshareChannel* get() const noexcept { return ch_; }
    explicit operator bool() const noexcept { return ch_ != nullptr; }
    // Give up ownership: the caller must devshare_channel_close the result. Leaves this empty.
    [[nodiscard]] DevshareChannel* release() noexcept { return std::exchange(ch_, nullptr); }

    // Who may connect from now on (devshare_channel_restrict): a non-empty `uids` replaces the
    // allowed uids (default: this process's effective uid alone; listing another uid is how you
    // trust it), a non-empty `pids` admits only those processes. Peers already connected stay.
    //     ch.restrict({}, {consumer_pid});
    [[nodiscard]] Result<void> try_restrict(Span<const uint32_t> uids, Span<const int32_t> pids = {}) {
        return status_result(devshare_channel_restrict(ch_, uids.data(), uids.size(), pids.data(), pids.size()));
    }

    // The descriptor to poll for reading in your event loop: readable when service() has work
    // (a connection, a message, a hang-up). -1 when empty.
    [[nodiscard]] int fd() const noexcept { return devshare_channel_fd(ch_); }

    // Accept new peers (credentials checked, handshake), take their releases and returned slots,
    // notice the ones that hung up (their leases and slots come back at once)
    // (devshare_channel_service). Waits at most `timeout` for something to happen (0: does not
    // wait, negative: until something does).
    [[nodiscard]] Result<void> try_service(std::chrono::milliseconds timeout) {
        return status_result(devshare_channel_service(ch_, detail::timeout_ms(timeout)));
    }

    // Serve the channel until at least `n` peers are connected (devshare_channel_wait_peers):
    // true, or false when `timeout` passed first (negative: wait forever).
    [[nodiscard]] Result<bool> try_wait_peers(size_t n, std::chrono::milliseconds timeout) {
        const int32_t s = devshare_channel_wait_peers(ch_, n, detail::timeout_ms(timeout));
        if (s == DEVSHARE_STATUS_TIMEOUT) {
            return false;
        }
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        return true;
    }

    // The connected peers' ids, oldest first (devshare_channel_peer_ids).
    [[nodiscard]] Result<std::vector<uint64_t>> try_peers() const {
        std::vector<uint64_t> ids(8);
        for (;;) {
            size_t count = 0;
            const int32_t s = devshare_channel_peer_ids(ch_, ids.data(), ids.size(), &count);
            if (s == DEVSHARE_STATUS_BUFFER_TOO_SMALL && count > ids.size()) {
                ids.resize(count);  // more peers than room (or more connected meanwhile): ask again
                continue;
            }
            if (s != DEVSHARE_STATUS_OK) {
                return Error::from_last(s);
            }
            ids.resize(count);
            return ids;
        }
    }

    // Whitelist ACL exports for the pid a consumer announced even where it is not its kernel pid
    // (devshare_channel_trust_announced_pids): for consumers in containers.
    [[nodiscard]] Result<void> try_trust_announced_pids(bool trust) {
        return status_result(devshare_channel_trust_announced_pids(ch_, trust ? 1u : 0u));
    }

    // Disconnect peer `peer` now, as if it had died (devshare_channel_disconnect): its leases
    // and slots come back at once. DEVSHARE_STATUS_NOT_FOUND when it is not connected.
    [[nodiscard]] Result<void> try_disconnect(uint64_t peer) { return status_result(devshare_channel_disconnect(ch_, peer)); }

    // What is known about connected peer `peer` (devshare_channel_peer_info): pid, uid and gid
    // from SO_PEERCRED, the tgid it announced, its leases and attached pools, refused messages.
    // DEVSHARE_STATUS_NOT_FOUND when it is not connected.
    [[nodiscard]] Result<DevsharePeerInfo> try_peer_info(uint64_t peer) const {
        DevsharePeerInfo info{};
        int32_t s = devshare_peer_info_init(&info, sizeof info);
        if (s == DEVSHARE_STATUS_OK) {
            s = devshare_channel_peer_info(ch_, peer, &info);
        }
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        return info;
    }

    // --- Leases: each success sends `peer` one leased reference to a tensor of `exporter`
    // (devshare_channel_send), which the peer receives with Connection::recv.
    // exporter.outstanding() counts it until the channel learns (in service() or a call that
    // waits) that the peer released that Import or disconnected; exporter.wait() serves this
    // channel while it waits. The tensor is described as for
    // Exporter::share (addresses and offsets in the exporter's allocation); DEVSHARE_SHARE_*
    // flags are refused (a lease needs neither). Host memory must come from
    // Exporter::channel_host_alloc or host_alloc.

    // The tensor of element type T whose first element is at `first`:
    //     ch.send(peer, exp, p, {rows, cols});             // float* p
    template <typename T>
    [[nodiscard]] Result<void> try_send(uint64_t peer, const Exporter& exporter, const T* first, Dims shape,
                                        Dims strides = {}, const ShareOptions& options = {}) {
        static_assert(has_dtype_v<T>, "devshare::Channel::send<T>: T has no dtype; pass a DevshareDType");
        return send_desc(peer, exporter, exporter.try_describe(dtype_of<T>(), first, shape, strides, options));
    }
    template <typename T>
    [[nodiscard]] Result<void> try_send(uint64_t peer, const Exporter& exporter, const void* first, Dims shape,
                                        Dims strides = {}, const ShareOptions& options = {}) {
        static_assert(has_dtype_v<T>, "devshare::Channel::send<T>: T has no dtype; pass a DevshareDType");
        return send_desc(peer, exporter, exporter.try_describe(dtype_of<T>(), first, shape, strides, options));
    }
    // The same with an explicit dtype (kBFloat16, kFloat16, ...).
    [[nodiscard]] Result<void> try_send(uint64_t peer, const Exporter& exporter, DevshareDType dtype,
                                        const void* first, Dims shape, Dims strides = {},
                                        const ShareOptions& options = {}) {
        return send_desc(peer, exporter, exporter.try_describe(dtype, first, shape, strides, options));
    }
    // The same with the first element's byte offset in the allocation.
    template <typename T>
    [[nodiscard]] Result<void> try_send_at(uint64_t peer, const Exporter& exporter, uint64_t offset, Dims shape,
                                           Dims strides = {}, const ShareOptions& options = {}) {
        static_assert(has_dtype_v<T>, "devshare::Channel::send_at<T>: T has no dtype; pass a DevshareDType");
        return send_desc(peer, exporter, exporter.try_describe_at(dtype_of<T>(), offset, shape, strides, options));
    }
    [[nodiscard]] Result<void> try_send_at(uint64_t peer, const Exporter& exporter, DevshareDType dtype,
                                           uint64_t offset, Dims shape, Dims strides = {},
                                           const ShareOptions& options = {}) {
        return send_desc(peer, exporter, exporter.try_describe_at(dtype, offset, shape, strides, options));
    }
    // A described tensor.
    [[nodiscard]] Result<void> try_send(uint64_t peer, const Exporter& exporter, const TensorDesc& desc) {
        const DevshareTensorDesc d = desc.raw();
        return try_send(peer, exporter, d);
    }
    // A C desc (start it from devshare::tensor_desc()).
    [[nodiscard]] Result<void> try_send(uint64_t peer, const Exporter& exporter, const DevshareTensorDesc& desc) {
        return status_result(devshare_channel_send(ch_, peer, exporter.get(), &desc));
    }
    // The whole allocation as a 1-D uint8 tensor.
    [[nodiscard]] Result<void> try_send_bytes(uint64_t peer, const Exporter& exporter) {
        return status_result(devshare_channel_send(ch_, peer, exporter.get(), nullptr));
    }

    // Close the channel (devshare_channel_close): every peer is disconnected (its recv says
    // DEVSHARE_STATUS_CLOSED), their leases stop counting in their exports' outstanding
    // references (wait for them first: the producer can no longer learn when they let go), pools
    // on it are closed, the socket file is removed. Afterwards this Channel is empty; an empty
    // Channel's close does nothing.
    [[nodiscard]] Result<void> try_close() { return status_result(devshare_channel_close(std::exchange(ch_, nullptr))); }

#if DEVSHARE_HPP_EXCEPTIONS
    void restrict(Span<const uint32_t> uids, Span<const int32_t> pids = {}) { try_restrict(uids, pids).value(); }
    void service(std::chrono::milliseconds timeout) { try_service(timeout).value(); }
    [[nodiscard]] bool wait_peers(size_t n, std::chrono::milliseconds timeout) {
        return try_wait_peers(n, timeout).value();
    }
    [[nodiscard]] std::vector<uint64_t> peers() const { return try_peers().value(); }
    [[nodiscard]] DevsharePeerInfo peer_info(uint64_t peer) const { return try_peer_info(peer).value(); }
    void disconnect(uint64_t peer) { try_disconnect(peer).value(); }
    void trust_announced_pids(bool trust) { try_trust_announced_pids(trust).value(); }
    template <typename T>
    void send(uint64_t peer, const Exporter& exporter, const T* first, Dims shape, Dims strides = {},
              const ShareOptions& options = {}) {
        try_send<T>(peer, exporter, first, shape, strides, options).value();
    }
    template <typename T>
    void send(uint64_t peer, const Exporter& exporter, const void* first, Dims shape, Dims strides = {},
              const ShareOptions& options = {}) {
        try_send<T>(peer, exporter, first, shape, strides, options).value();
    }
    void send(uint64_t peer, const Exporter& exporter, DevshareDType dtype, const void* first, Dims shape,
              Dims strides = {}, const ShareOptions& options = {}) {
        try_send(peer, exporter, dtype, first, shape, strides, options).value();
    }
    template <typename T>
    void send_at(uint64_t peer, const Exporter& exporter, uint64_t offset, Dims shape, Dims strides = {},
                 const ShareOptions& options = {}) {
        try_send_at<T>(peer, exporter, offset, shape, strides, options).value();
    }
    void send_at(uint64_t peer, const Exporter& exporter, DevshareDType dtype, uint64_t offset, Dims shape,
                 Dims strides = {}, const ShareOptions& options = {}) {
        try_send_at(peer, exporter, dtype, offset, shape, strides, options).value();
    }
    void send(uint64_t peer, const Exporter& exporter, const TensorDesc& desc) {
        try_send(peer, exporter, desc).value();
    }
    void send(uint64_t peer, const Exporter& exporter, const DevshareTensorDesc& desc) {
        try_send(peer, exporter, desc).value();
    }
    void send_bytes(uint64_t peer, const Exporter& exporter) { try_send_bytes(peer, exporter).value(); }
    void close() { try_close().value(); }
#endif

private:
    Result<void> send_desc(uint64_t peer, const Exporter& exporter, const Result<TensorDesc>& desc) {
        if (!desc) {
            return desc.error();
        }
        return try_send(peer, exporter, *desc);
    }

    DevshareChannel* ch_ = nullptr;
};

// A pool's slot size, slot count and how many slots are free now (Pool::info).
struct PoolInfo {
    uint64_t slot_size = 0;
    uint32_t count = 0;
    uint32_t free_slots = 0;
};

// One acquired slot of a Pool (Pool::acquire): its index, its address in this process (for a
// device pool, a device address) and its size. Move-only; a moved-from, sent, released or
// default-constructed Slot is empty. Destroying a Slot that is still acquired gives it back to
// the pool unsent (devshare_pool_release; errors are ignored). A Slot must not outlive its Pool.
class Slot {
public:
    Slot() noexcept = default;
    Slot(const Slot&) = delete;
    Slot& operator=(const Slot&) = delete;
    Slot(Slot&& other) noexcept
        : pool_(std::exchange(other.pool_, nullptr)),
          index_(std::exchange(other.index_, 0)),
          data_(std::exchange(other.data_, nullptr)),
          size_(std::exchange(other.size_, 0)) {}
    // Gives back the slot this Slot held (unsent), then takes over `other`.
    Slot& operator=(Slot&& other) noexcept {
        if (this != &other) {
            give_back();
            pool_ = std::exchange(other.pool_, nullptr);
            index_ = std::exchange(other.index_, 0);
            data_ = std::exchange(other.data_, nullptr);
            size_ = std::exchange(other.size_, 0);
        }
        return *this;
    }
    ~Slot() { give_back(); }

    // The slot's index in its pool (0 when empty).
    [[nodiscard]] uint32_t index() const noexcept { return index_; }
    // The slot's first byte in this process (nullptr when empty): the same address every time
    // this index is acquired.
    [[nodiscard]] void* data() const noexcept { return data_; }
    template <typename T>
    [[nodiscard]] T* data() const noexcept {
        return static_cast<T*>(data_);
    }
    // The slot's size in bytes (0 when empty).
    [[nodiscard]] uint64_t size() const noexcept { return size_; }
    // The C pool the slot belongs to (nullptr when empty).
    [[nodiscard]] DevsharePool* pool() const noexcept { return pool_; }
    // Whether this Slot holds an acquired slot.
    explicit operator bool() const noexcept { return pool_ != nullptr; }

    // Give up ownership: the slot stays acquired, for devshare_pool_send or
    // devshare_pool_release on pool(). Returns its index and leaves this Slot empty.
    [[nodiscard]] uint32_t disown() noexcept {
        const uint32_t index = index_;
        clear();
        return index;
    }

private:
    friend class Pool;

    Slot(DevsharePool* pool, uint32_t index, void* data, uint64_t size) noexcept
        : pool_(pool), index_(index), data_(data), size_(size) {}

    void clear() noexcept {
        pool_ = nullptr;
        index_ = 0;
        data_ = nullptr;
        size_ = 0;
    }
    void give_back() noexcept {
        if (pool_ != nullptr) {
            (void)devshare_pool_release(pool_, index_);
            clear();
        }
    }

    DevsharePool* pool_ = nullptr;
    uint32_t index_ = 0;
    void* data_ = nullptr;
    uint64_t size_ = 0;
};

// A pool of fixed-address slots on a channel (DevsharePool). Move-only; a moved-from or
// default-constructed Pool is empty and destroying it does nothing. Destroying a non-empty Pool
// closes it: attached consumers are told, and each detaches once it released its items.
//
//     devshare::Pool pool = devshare::Pool::create(ch, devshare::Exporter::channel_host_alloc(8 << 20), 1 << 20, 8);
//     devshare::Slot slot = pool.acquire(devshare::kForever);    // waits while all 8 are out
//     fill(slot.data<float>(), n);
//     pool.send(slot, peer, slot.data<float>(), {n});             // the consumer's recv() gets it
class Pool {
public:
    Pool() noexcept = default;

    // Make a pool of `count` slots of `slot_size` bytes, back to back from the start of
    // `exporter`'s range, on `channel` (devshare_pool_create): one allocation
    // (Exporter::channel_host_alloc, or an ACL or CUDA export). The pool keeps the export alive:
    // the Exporter may be closed or destroyed first, its memory goes with the pool. Each
    // consumer the pool reaches counts as one outstanding reference of the export until it
    // detaches (after the pool's close, once it released its items) or disconnects.
    [[nodiscard]] static Result<Pool> try_create(Channel& channel, const Exporter& exporter, uint64_t slot_size,
                                                 uint32_t count) {
        Pool p;
        const int32_t s = devshare_pool_create(channel.get(), exporter.get(), slot_size, count, &p.pool_);
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        p.slot_size_ = slot_size;
        p.count_ = count;
        return p;
    }

    // Take ownership of a C pool (nullptr gives an empty Pool); its slot size is asked once.
    [[nodiscard]] static Result<Pool> try_adopt(DevsharePool* raw) {
        Pool p;
        if (raw != nullptr) {
            const int32_t s = devshare_pool_info(raw, &p.slot_size_, &p.count_, nullptr);
            if (s != DEVSHARE_STATUS_OK) {
                return Error::from_last(s);
            }
            p.pool_ = raw;
        }
        return p;
    }

#if DEVSHARE_HPP_EXCEPTIONS
    [[nodiscard]] static Pool create(Channel& channel, const Exporter& exporter, uint64_t slot_size, uint32_t count) {
        return try_create(channel, exporter, slot_size, count).value();
    }
#endif

    Pool(const Pool&) = delete;
    Pool& operator=(const Pool&) = delete;
    Pool(Pool&& other) noexcept
        : pool_(std::exchange(other.pool_, nullptr)),
          slot_size_(std::exchange(other.slot_size_, 0)),
          count_(std::exchange(other.count_, 0)) {}
    // Closes what this Pool held, then takes over `other`.
    Pool& operator=(Pool&& other) noexcept {
        if (this != &other) {
            (void)devshare_pool_close(pool_);
            pool_ = std::exchange(other.pool_, nullptr);
            slot_size_ = std::exchange(other.slot_size_, 0);
            count_ = std::exchange(other.count_, 0);
        }
        return *this;
    }
    ~Pool() { (void)devshare_pool_close(pool_); }

    // The C pool, still owned by this object (nullptr when empty).
    [[nodiscard]] DevsharePool* get() const noexcept { return pool_; }
    explicit operator bool() const noexcept { return pool_ != nullptr; }
    // Slot size in bytes and slot count (0 when empty).
    [[nodiscard]] uint64_t slot_size() const noexcept { return slot_size_; }
    [[nodiscard]] uint32_t count() const noexcept { return count_; }

    // The pool's id on its channel (devshare_pool_id, > 0): what Import::pool_slot() reports to
    // consumers for its items.
    [[nodiscard]] Result<uint32_t> try_id() const {
        uint32_t id = 0;
        const int32_t s = devshare_pool_id(pool_, &id);
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        return id;
    }
#if DEVSHARE_HPP_EXCEPTIONS
    [[nodiscard]] uint32_t id() const { return try_id().value(); }
#endif

    // A free slot (devshare_pool_acquire). While every slot is out, waits for one to come back,
    // serving the channel (backpressure): an empty Slot when `timeout` passed first (0: does not
    // wait, negative: waits forever).
    [[nodiscard]] Result<Slot> try_acquire(std::chrono::milliseconds timeout) {
        uint32_t index = 0;
        void* ptr = nullptr;
        const int32_t s = devshare_pool_acquire(pool_, detail::timeout_ms(timeout), &index, &ptr);
        if (s == DEVSHARE_STATUS_TIMEOUT) {
            return Slot();
        }
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        return Slot(pool_, index, ptr, slot_size_);
    }

    // --- Sending: hand acquired `slot` to `peer` (devshare_pool_send). On success `slot` becomes
    // empty: the slot is the peer's until it releases the item's Import or disconnects, and free
    // again once the channel learns of that (service(), acquire()). On failure `slot` stays
    // acquired (and yours). The tensor is described
    // relative to the slot: addresses lie in [slot.data(), slot.data() + slot.size()], offsets
    // and ShareOptions::storage_offset count from the slot's start, and the storage is the rest
    // of the slot unless the options say otherwise. Device work on the options' stream is
    // synchronised first. Only a small message travels; the first item to a peer also attaches
    // it to the pool (one import of the whole allocation).

    // The tensor of element type T whose first element is at `first`:
    //     pool.send(slot, peer, slot.data<float>(), {rows, cols});
    template <typename T>
    [[nodiscard]] Result<void> try_send(Slot& slot, uint64_t peer, const T* first, Dims shape, Dims strides = {},
                                        const ShareOptions& options = {}) {
        static_assert(has_dtype_v<T>, "devshare::Pool::send<T>: T has no dtype; pass a DevshareDType");
        return send_desc(slot, peer, describe(slot, dtype_of<T>(), first, shape, strides, options));
    }
    template <typename T>
    [[nodiscard]] Result<void> try_send(Slot& slot, uint64_t peer, const void* first, Dims shape, Dims strides = {},
                                        const ShareOptions& options = {}) {
        static_assert(has_dtype_v<T>, "devshare::Pool::send<T>: T has no dtype; pass a DevshareDType");
        return send_desc(slot, peer, describe(slot, dtype_of<T>(), first, shape, strides, options));
    }
    // The same with an explicit dtype (kBFloat16, kFloat16, ...).
    [[nodiscard]] Result<void> try_send(Slot& slot, uint64_t peer, DevshareDType dtype, const void* first,
                                        Dims shape, Dims strides = {}, const ShareOptions& options = {}) {
        return send_desc(slot, peer, describe(slot, dtype, first, shape, strides, options));
    }
    // The same with the first element's byte offset in the slot.
    template <typename T>
    [[nodiscard]] Result<void> try_send_at(Slot& slot, uint64_t peer, uint64_t offset, Dims shape,
                                           Dims strides = {}, const ShareOptions& options = {}) {
        static_assert(has_dtype_v<T>, "devshare::Pool::send_at<T>: T has no dtype; pass a DevshareDType");
        return send_desc(slot, peer, detail::describe_at(kWho, dtype_of<T>(), offset, shape, strides, options));
    }
    [[nodiscard]] Result<void> try_send_at(Slot& slot, uint64_t peer, DevshareDType dtype, uint64_t offset,
                                           Dims shape, Dims strides = {}, const ShareOptions& options = {}) {
        return send_desc(slot, peer, detail::describe_at(kWho, dtype, offset, shape, strides, options));
    }
    // A described tensor (offsets relative to the slot).
    [[nodiscard]] Result<void> try_send(Slot& slot, uint64_t peer, const TensorDesc& desc) {
        const DevshareTensorDesc d = desc.raw();
        return send_raw(slot, peer, &d);
    }
    // A C desc (start it from devshare::tensor_desc(); offsets relative to the slot).
    [[nodiscard]] Result<void> try_send(Slot& slot, uint64_t peer, const DevshareTensorDesc& desc) {
        return send_raw(slot, peer, &desc);
    }
    // The whole slot as a 1-D uint8 tensor.
    [[nodiscard]] Result<void> try_send_bytes(Slot& slot, uint64_t peer) { return send_raw(slot, peer, nullptr); }

    // Give back acquired `slot` without sending it (devshare_pool_release); afterwards it is
    // empty. Releasing an empty Slot does nothing; a Slot of another pool is
    // DEVSHARE_STATUS_INVALID_ARGUMENT.
    [[nodiscard]] Result<void> try_release(Slot& slot) {
        if (!slot) {
            return Result<void>();
        }
        Result<void> mine = check_slot(slot, "devshare::Pool::release");
        if (!mine) {
            return mine;
        }
        const int32_t s = devshare_pool_release(pool_, slot.index_);
        slot.clear();  // refused only when not acquired: then it is not this Slot's to give back
        return status_result(s);
    }

    // Slot size, slot count and how many slots are free now (devshare_pool_info).
    [[nodiscard]] Result<PoolInfo> try_info() const {
        PoolInfo info;
        const int32_t s = devshare_pool_info(pool_, &info.slot_size, &info.count, &info.free_slots);
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        return info;
    }

    // Close the pool (devshare_pool_close): attached consumers are told, each detaches once it
    // released its items. Afterwards this Pool is empty; an empty Pool's close does nothing.
    // Slots still acquired must not be used (nor destroyed) after it.
    [[nodiscard]] Result<void> try_close() {
        slot_size_ = 0;
        count_ = 0;
        return status_result(devshare_pool_close(std::exchange(pool_, nullptr)));
    }

#if DEVSHARE_HPP_EXCEPTIONS
    [[nodiscard]] Slot acquire(std::chrono::milliseconds timeout) { return try_acquire(timeout).value(); }
    template <typename T>
    void send(Slot& slot, uint64_t peer, const T* first, Dims shape, Dims strides = {},
              const ShareOptions& options = {}) {
        try_send<T>(slot, peer, first, shape, strides, options).value();
    }
    template <typename T>
    void send(Slot& slot, uint64_t peer, const void* first, Dims shape, Dims strides = {},
              const ShareOptions& options = {}) {
        try_send<T>(slot, peer, first, shape, strides, options).value();
    }
    void send(Slot& slot, uint64_t peer, DevshareDType dtype, const void* first, Dims shape, Dims strides = {},
              const ShareOptions& options = {}) {
        try_send(slot, peer, dtype, first, shape, strides, options).value();
    }
    template <typename T>
    void send_at(Slot& slot, uint64_t peer, uint64_t offset, Dims shape, Dims strides = {},
                 const ShareOptions& options = {}) {
        try_send_at<T>(slot, peer, offset, shape, strides, options).value();
    }
    void send_at(Slot& slot, uint64_t peer, DevshareDType dtype, uint64_t offset, Dims shape, Dims strides = {},
                 const ShareOptions& options = {}) {
        try_send_at(slot, peer, dtype, offset, shape, strides, options).value();
    }
    void send(Slot& slot, uint64_t peer, const TensorDesc& desc) { try_send(slot, peer, desc).value(); }
    void send(Slot& slot, uint64_t peer, const DevshareTensorDesc& desc) { try_send(slot, peer, desc).value(); }
    void send_bytes(Slot& slot, uint64_t peer) { try_send_bytes(slot, peer).value(); }
    void release(Slot& slot) { try_release(slot).value(); }
    [[nodiscard]] PoolInfo info() const { return try_info().value(); }
    void close() { try_close().value(); }
#endif

private:
    static constexpr const char* kWho = "devshare::Pool::send";

    // The slot must be acquired from this pool.
    Result<void> check_slot(const Slot& slot, const char* who) const {
        if (pool_ == nullptr) {
            return detail::error(DEVSHARE_STATUS_NULL_ARGUMENT, std::string(who) + ": the Pool is empty");
        }
        if (!slot) {
            return detail::error(DEVSHARE_STATUS_INVALID_ARGUMENT,
                                 std::string(who) + ": the Slot is empty (sent, released or moved from)");
        }
        if (slot.pool_ != pool_) {
            return detail::error(DEVSHARE_STATUS_INVALID_ARGUMENT,
                                 std::string(who) + ": slot " + std::to_string(slot.index_) +
                                     " belongs to another pool");
        }
        return Result<void>();
    }

    // A TensorDesc for the tensor whose first element is at `first`, inside the slot.
    Result<TensorDesc> describe(const Slot& slot, DevshareDType dtype, const void* first, Dims shape, Dims strides,
                                const ShareOptions& options) const {
        Result<void> mine = check_slot(slot, kWho);
        if (!mine) {
            return mine.error();
        }
        const uintptr_t p = reinterpret_cast<uintptr_t>(first);
        const uintptr_t b = reinterpret_cast<uintptr_t>(slot.data_);
        if (first == nullptr || p < b || p - b > slot.size_) {
            return detail::error(DEVSHARE_STATUS_INVALID_ARGUMENT,
                                 std::string(kWho) + ": the first element's address is outside slot " +
                                     std::to_string(slot.index_) + " [data(), data() + " +
                                     std::to_string(slot.size_) + ")");
        }
        return detail::describe_at(kWho, dtype, static_cast<uint64_t>(p - b), shape, strides, options);
    }

    Result<void> send_desc(Slot& slot, uint64_t peer, const Result<TensorDesc>& desc) {
        if (!desc) {
            return desc.error();
        }
        return try_send(slot, peer, *desc);
    }

    Result<void> send_raw(Slot& slot, uint64_t peer, const DevshareTensorDesc* desc) {
        Result<void> mine = check_slot(slot, kWho);
        if (!mine) {
            return mine;
        }
        const int32_t s = devshare_pool_send(pool_, slot.index_, peer, desc);
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        slot.clear();
        return Result<void>();
    }

    DevsharePool* pool_ = nullptr;
    uint64_t slot_size_ = 0;
    uint32_t count_ = 0;
};

// The consumer end of a channel (DevshareConnection). Move-only; a moved-from or
// default-constructed Connection is empty and destroying it does nothing. Destroying a
// non-empty Connection closes it: the producer takes back every lease and slot of it at once;
// Imports received from it stay valid until released (releasing them then sends nothing).
class Connection {
public:
    Connection() noexcept = default;

    // Connect to the channel at `address` (a path or "@name") and shake hands
    // (devshare_channel_connect), waiting at most `timeout` for the producer to serve the
    // handshake (it must be serving its channel: service, wait_peers, acquire, ...). This
    // process announces its pid, for which the producer whitelists the ACL exports it sends
    // here. The producer must run as this process's effective uid or as root, and must admit
    // this process (DEVSHARE_STATUS_UNTRUSTED otherwise). No channel there:
    // DEVSHARE_STATUS_NOT_FOUND; no handshake in time: DEVSHARE_STATUS_TIMEOUT.
    [[nodiscard]] static Result<Connection> try_connect(const char* address, std::chrono::milliseconds timeout) {
        Connection c;
        const int32_t s = devshare_channel_connect(address, detail::timeout_ms(timeout), &c.conn_);
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        return c;
    }
    [[nodiscard]] static Result<Connection> try_connect(const std::string& address,
                                                        std::chrono::milliseconds timeout) {
        return try_connect(address.c_str(), timeout);
    }

    // Take ownership of a C connection (nullptr gives an empty Connection).
    [[nodiscard]] static Connection adopt(DevshareConnection* raw) noexcept {
        Connection c;
        c.conn_ = raw;
        return c;
    }

#if DEVSHARE_HPP_EXCEPTIONS
    [[nodiscard]] static Connection connect(const char* address, std::chrono::milliseconds timeout) {
        return try_connect(address, timeout).value();
    }
    [[nodiscard]] static Connection connect(const std::string& address, std::chrono::milliseconds timeout) {
        return try_connect(address, timeout).value();
    }
#endif

    Connection(const Connection&) = delete;
    Connection& operator=(const Connection&) = delete;
    Connection(Connection&& other) noexcept : conn_(std::exchange(other.conn_, nullptr)) {}
    // Closes what this Connection held, then takes over `other`.
    Connection& operator=(Connection&& other) noexcept {
        if (this != &other) {
            (void)devshare_connection_close(conn_);
            conn_ = std::exchange(other.conn_, nullptr);
        }
        return *this;
    }
    ~Connection() { (void)devshare_connection_close(conn_); }

    // The C connection, still owned by this object (nullptr when empty).
    [[nodiscard]] DevshareConnection* get() const noexcept { return conn_; }
    explicit operator bool() const noexcept { return conn_ != nullptr; }
    // Give up ownership: the caller must devshare_connection_close the result. Leaves this empty.
    [[nodiscard]] DevshareConnection* release() noexcept { return std::exchange(conn_, nullptr); }

    // The socket to poll for reading in your event loop: readable when an item or the
    // producer's close arrives. -1 when empty.
    [[nodiscard]] int fd() const noexcept { return devshare_connection_fd(conn_); }

    // This consumer's id at the producer (what its Channel::peers() lists for it) and the
    // producer's pid as it reported it (devshare_connection_info).
    [[nodiscard]] Result<uint64_t> try_peer_id() const {
        uint64_t id = 0;
        const int32_t s = devshare_connection_info(conn_, &id, nullptr);
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        return id;
    }
    [[nodiscard]] Result<int32_t> try_producer_pid() const {
        int32_t pid = 0;
        const int32_t s = devshare_connection_info(conn_, nullptr, &pid);
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        return pid;
    }
#if DEVSHARE_HPP_EXCEPTIONS
    [[nodiscard]] uint64_t peer_id() const { return try_peer_id().value(); }
    [[nodiscard]] int32_t producer_pid() const { return try_producer_pid().value(); }
#endif

    // The next item -- a leased reference or a pool slot -- as an Import
    // (devshare_connection_recv). Destroying or releasing the Import gives the reference or slot
    // back to the producer: do so once this process's device work on it is finished. For a pool
    // item, Import::pool_slot() says which pool and slot it is; its data() is the same address
    // every time that slot arrives. Waits at most `timeout` (0: does not wait, negative: forever):
    // an empty Import when nothing arrived in time. DEVSHARE_STATUS_CLOSED once the producer
    // closed the channel or exited and nothing is queued: nothing more will come (Imports
    // received stay valid until released). A malformed item is refused and given back
    // (DEVSHARE_STATUS_UNTRUSTED or the handle's status).
    [[nodiscard]] Result<Import> try_recv(std::chrono::milliseconds timeout) {
        DevshareImport* raw = nullptr;
        const int32_t s = devshare_connection_recv(conn_, detail::timeout_ms(timeout), &raw);
        if (s == DEVSHARE_STATUS_TIMEOUT) {
            return Import();
        }
        if (s != DEVSHARE_STATUS_OK) {
            return Error::from_last(s);
        }
        Result<Import> imp = Import::try_adopt(raw);
        if (!imp) {
            (void)devshare_import_release(raw);
        }
        return imp;
    }

    // Close the connection (devshare_connection_close): the producer takes back every lease and
    // slot of it. Imports received stay valid until released. Afterwards this Connection is
    // empty; an empty Connection's close does nothing.
    [[nodiscard]] Result<void> try_close() {
        return status_result(devshare_connection_close(std::exchange(conn_, nullptr)));
    }

#if DEVSHARE_HPP_EXCEPTIONS
    [[nodiscard]] Import recv(std::chrono::milliseconds timeout) { return try_recv(timeout).value(); }
    void close() { try_close().value(); }
#endif

private:
    DevshareConnection* conn_ = nullptr;
};

}  // namespace devshare

#endif  // DEVSHARE_HPP
