/* SPDX-License-Identifier: Apache-2.0 */

// devshare/dtype.hpp: Span (a pointer and a count; Dims for shapes and strides) and element
// types: DevshareDType helpers, dtype_traits<T> and dtype_of<T>().

#ifndef DEVSHARE_DTYPE_HPP
#define DEVSHARE_DTYPE_HPP

#include "../devshare.h"

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__STDCPP_FLOAT16_T__) || defined(__STDCPP_BFLOAT16_T__)
#include <stdfloat>
#endif

namespace devshare {

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
        // Appended piece by piece: GCC 12 at -O2 reports a false -Wrestrict overlap in the
        // inlined "x" + std::string (its insert at position 0).
        s += 'x';
        s += std::to_string(d.lanes);
    }
    return s;
}

namespace detail {
template <uint8_t Code, uint8_t Bits>
struct dtype_is {
    static constexpr bool known = true;
    static constexpr DevshareDType value = {Code, Bits, 1};
};
template <typename T>
using int_dtype = dtype_is<std::is_signed<T>::value ? uint8_t{DEVSHARE_DTYPE_INT} : uint8_t{DEVSHARE_DTYPE_UINT},
                           static_cast<uint8_t>(sizeof(T) * 8)>;
struct no_dtype {
    static constexpr bool known = false;
};
// std::complex<float> and std::complex<double> (any type laid out like them: value_type float or
// double, real() and imag() of that type, twice its size), without this header including <complex>.
template <typename T, typename = void>
struct complex_dtype : no_dtype {};
template <typename T>
struct complex_dtype<T, std::void_t<typename T::value_type, decltype(std::declval<const T&>().real()),
                                    decltype(std::declval<const T&>().imag())>>
    : std::conditional_t<(std::is_same<typename T::value_type, float>::value ||
                          std::is_same<typename T::value_type, double>::value) &&
                             std::is_same<decltype(std::declval<const T&>().real()), typename T::value_type>::value &&
                             std::is_same<decltype(std::declval<const T&>().imag()), typename T::value_type>::value &&
                             sizeof(T) == 2 * sizeof(typename T::value_type),
                         dtype_is<DEVSHARE_DTYPE_COMPLEX, static_cast<uint8_t>(sizeof(T) * 8)>, no_dtype> {};
}  // namespace detail

// dtype_traits<T>::value is T's DLPack dtype when `known`. Specialise it for your own types
// (e.g. a bfloat16 struct) to use them with describe, as<T> and dtype_of<T>.
template <typename T>
struct dtype_traits : detail::complex_dtype<T> {};

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

}  // namespace devshare

#endif  // DEVSHARE_DTYPE_HPP
