/* SPDX-License-Identifier: Apache-2.0 */

// devshare/error.hpp: Error, Result<T> and the one helper that turns a C status into them.
//
// Two forms of every call that can fail: try_name(...) returns Result<T> and never throws;
// name(...) returns T and throws devshare::Error. The throwing forms exist only when exceptions
// are enabled (DEVSHARE_HPP_EXCEPTIONS: 1 when the compiler has them and
// DEVSHARE_HPP_NO_EXCEPTIONS is not defined). Build every translation unit of a program with
// the same setting, and the same C++ standard (Result<T> is std::expected<T, Error> where the
// standard library has it, this header's own class otherwise: see below).

#ifndef DEVSHARE_ERROR_HPP
#define DEVSHARE_ERROR_HPP

#include "../devshare.h"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>

#if defined(__has_include)
#if __has_include(<version>)
#include <version>
#endif
#endif

#if !defined(DEVSHARE_HPP_EXCEPTIONS)
#if (defined(__cpp_exceptions) || defined(__EXCEPTIONS) || defined(_CPPUNWIND)) && \
    !defined(DEVSHARE_HPP_NO_EXCEPTIONS)
#define DEVSHARE_HPP_EXCEPTIONS 1
#else
#define DEVSHARE_HPP_EXCEPTIONS 0
#endif
#endif

// Result<T> is std::expected<T, devshare::Error> where the standard library has it (C++23),
// unless DEVSHARE_HPP_OWN_RESULT is defined.
#if !defined(DEVSHARE_HPP_STD_EXPECTED)
#if defined(__cpp_lib_expected) && __cpp_lib_expected >= 202202L && !defined(DEVSHARE_HPP_OWN_RESULT)
#define DEVSHARE_HPP_STD_EXPECTED 1
#else
#define DEVSHARE_HPP_STD_EXPECTED 0
#endif
#endif
#if DEVSHARE_HPP_STD_EXPECTED
#include <expected>
#else
#include <variant>
#endif

namespace devshare {

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
        case DEVSHARE_STATUS_INVALID_ARGUMENT: return std::errc::invalid_argument;
        case DEVSHARE_STATUS_BUFFER_TOO_SMALL: return std::errc::no_buffer_space;
        case DEVSHARE_STATUS_UNSUPPORTED:
        case DEVSHARE_STATUS_BACKEND_UNAVAILABLE: return std::errc::not_supported;
        case DEVSHARE_STATUS_NOT_FOUND: return std::errc::no_such_file_or_directory;
        case DEVSHARE_STATUS_TIMEOUT: return std::errc::timed_out;
        case DEVSHARE_STATUS_BUSY: return std::errc::device_or_resource_busy;
        case DEVSHARE_STATUS_UNTRUSTED: return std::errc::permission_denied;
        default: return std::error_condition(status, *this);
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
// made by this header, "devshare::<function>: why". A value type; with exceptions it is also
// what the throwing API throws.
class Error : public std::runtime_error {
public:
    Error(int32_t status, const std::string& message) : std::runtime_error(message), status_(status) {}
    Error(int32_t status, const char* message) : std::runtime_error(message), status_(status) {}

    [[nodiscard]] int32_t status() const noexcept { return status_; }
    // Fixed name of the status (devshare_status_str); static storage.
    [[nodiscard]] const char* status_name() const noexcept { return devshare_status_str(status_); }
    [[nodiscard]] const char* message() const noexcept { return what(); }
    [[nodiscard]] std::error_code code() const noexcept { return make_error_code(status_); }

    // An Error for `status` with the calling thread's devshare_last_error text (the status name
    // when there is none). Call it right after the failing C function.
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

// What a failed value() or checked accessor does: throw the Error (exceptions) or print it,
// saying what failed (`what`), and abort (none).
[[noreturn]] inline void fail(const Error& e, const char* what = "value() of a failed Result") {
#if DEVSHARE_HPP_EXCEPTIONS
    (void)what;
    throw e;
#else
    std::fprintf(stderr, "devshare: %s: %s (%d): %s\n", what, e.status_name(), static_cast<int>(e.status()),
                 e.what());
    std::abort();
#endif
}

}  // namespace detail

#if DEVSHARE_HPP_STD_EXPECTED

template <typename T>
using Result = std::expected<T, Error>;

namespace detail {
inline std::unexpected<Error> failure(Error e) { return std::unexpected<Error>(std::move(e)); }
}  // namespace detail

#else

namespace detail {
inline Error failure(Error e) { return e; }
}  // namespace detail

// A value of type T or the Error that prevented it: C++23's std::expected<T, Error> in C++17
// (has_value() / operator bool, *r, r->, error(), value(), value_or()). value() throws the Error
// itself (std::expected throws std::bad_expected_access<Error>; the throwing API of this header
// throws the Error in both). Read error() only after a failure. status() and code() are this
// class's only additions (with std::expected: r.error().status(), r.error().code()).
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
    [[nodiscard]] T& operator*() & noexcept { return *std::get_if<0>(&v_); }
    [[nodiscard]] const T& operator*() const& noexcept { return *std::get_if<0>(&v_); }
    [[nodiscard]] T&& operator*() && noexcept { return std::move(*std::get_if<0>(&v_)); }
    [[nodiscard]] T* operator->() noexcept { return std::get_if<0>(&v_); }
    [[nodiscard]] const T* operator->() const noexcept { return std::get_if<0>(&v_); }
    [[nodiscard]] const Error& error() const noexcept { return has_value() ? ok_error() : *std::get_if<1>(&v_); }
    [[nodiscard]] int32_t status() const noexcept { return error().status(); }
    [[nodiscard]] std::error_code code() const noexcept { return has_value() ? std::error_code() : error().code(); }
    [[nodiscard]] T& value() & { return has_value() ? **this : (detail::fail(error()), **this); }
    [[nodiscard]] const T& value() const& { return has_value() ? **this : (detail::fail(error()), **this); }
    [[nodiscard]] T&& value() && { return std::move(value()); }
    template <typename U>
    [[nodiscard]] T value_or(U&& fallback) const& {
        return has_value() ? **this : static_cast<T>(std::forward<U>(fallback));
    }
    template <typename U>
    [[nodiscard]] T value_or(U&& fallback) && {
        return has_value() ? std::move(**this) : static_cast<T>(std::forward<U>(fallback));
    }

    // The Error error() gives for a success.
    static const Error& ok_error() noexcept {
        static const Error e(DEVSHARE_STATUS_OK, "no error");
        return e;
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
    void operator*() const noexcept {}
    [[nodiscard]] const Error& error() const noexcept { return has_value() ? Result<int>::ok_error() : *std::get_if<1>(&v_); }
    [[nodiscard]] int32_t status() const noexcept { return error().status(); }
    [[nodiscard]] std::error_code code() const noexcept { return has_value() ? std::error_code() : error().code(); }
    void value() const {
        if (!has_value()) {
            detail::fail(error());
        }
    }

private:
    std::variant<std::monostate, Error> v_;
};

#endif

namespace detail {

// The one status-to-Result step: OK, or the calling thread's last error as an Error.
[[nodiscard]] inline Result<void> call(int32_t status) {
    if (status != DEVSHARE_STATUS_OK) {
        return failure(Error::from_last(status));
    }
    return {};
}

// The value a C call writes through its out-parameter: get<T>([&](T* out) { return c(.., out); }).
template <typename T, typename F>
[[nodiscard]] Result<T> get(F&& c_call, T value = T{}) {
    const int32_t s = c_call(&value);
    if (s != DEVSHARE_STATUS_OK) {
        return failure(Error::from_last(s));
    }
    return value;
}

// A failure for a check made by this header ("devshare::<function>: why"); converts to any Result.
[[nodiscard]] inline auto error(int32_t status, const std::string& message) { return failure(Error(status, message)); }

// The throwing forms: the value, or the Error thrown (also with std::expected, whose value()
// throws std::bad_expected_access<Error>).
template <typename T>
T value(Result<T>&& r) {
    if (!r.has_value()) {
        fail(r.error());
    }
    return std::move(*r);
}
inline void value(Result<void>&& r) {
    if (!r.has_value()) {
        fail(r.error());
    }
}

// A C timeout: milliseconds as int32_t, negative -> -1 (forever), longer ones cut to INT32_MAX.
[[nodiscard]] constexpr int32_t timeout_ms(std::chrono::milliseconds timeout) noexcept {
    return timeout.count() < 0 ? -1
           : timeout.count() > std::numeric_limits<int32_t>::max() ? std::numeric_limits<int32_t>::max()
                                                                    : static_cast<int32_t>(timeout.count());
}

}  // namespace detail

// Result<void> of a C status: OK, or the Error from the thread's last error message.
[[nodiscard]] inline Result<void> status_result(int32_t status) { return detail::call(status); }

#if DEVSHARE_HPP_EXCEPTIONS
// Throw devshare::Error unless `status` is DEVSHARE_STATUS_OK. Use right after a C call.
inline void check(int32_t status) { detail::value(detail::call(status)); }
#endif

// A timeout that waits forever (Exporter::wait, Channel, Connection, Pool).
inline constexpr std::chrono::milliseconds kForever{-1};

}  // namespace devshare

#endif  // DEVSHARE_ERROR_HPP
