/* SPDX-License-Identifier: Apache-2.0 */

// devshare/owner.hpp (detail): the one way this API owns a C object. Every owner class holds a
// detail::unique_c<T, Deleter> (closed_by<T, close> for a plain C close function), so its moves,
// move assignment (which closes what was held) and destruction are this template's alone, and
// a moved-from owner is empty. What an owner caches about its object is a detail::cleared<T>,
// reset by a move, so a moved-from owner reports nothing.

#ifndef DEVSHARE_OWNER_HPP
#define DEVSHARE_OWNER_HPP

#include <cstddef>
#include <utility>

namespace devshare {
namespace detail {

// Owns one C object: std::unique_ptr's owning part (move-only; a move assignment and the
// destructor hand what was held to the deleter D), without <memory>.
template <typename T, typename D>
class unique_c : private D {  // a stateless deleter takes no room (the empty base optimisation)
public:
    unique_c() noexcept = default;
    explicit unique_c(T* p, D d = D()) noexcept : D(d), p_(p) {}
    unique_c(unique_c&& other) noexcept : D(other.get_deleter()), p_(std::exchange(other.p_, nullptr)) {}
    unique_c& operator=(unique_c&& other) noexcept {
        if (this != &other) {
            reset(std::exchange(other.p_, nullptr));  // the old object goes to the old deleter
            get_deleter() = other.get_deleter();
        }
        return *this;
    }
    ~unique_c() { reset(); }

    [[nodiscard]] T* get() const noexcept { return p_; }
    T* operator->() const noexcept { return p_; }
    [[nodiscard]] T* release() noexcept { return std::exchange(p_, nullptr); }
    void reset(T* p = nullptr) noexcept {
        if (T* old = std::exchange(p_, p)) {
            get_deleter()(old);
        }
    }
    [[nodiscard]] D& get_deleter() noexcept { return *this; }
    [[nodiscard]] const D& get_deleter() const noexcept { return *this; }
    explicit operator bool() const noexcept { return p_ != nullptr; }
    friend bool operator==(const unique_c& a, std::nullptr_t) noexcept { return a.p_ == nullptr; }
    friend bool operator!=(const unique_c& a, std::nullptr_t) noexcept { return a.p_ != nullptr; }

private:
    T* p_ = nullptr;
};

// The deleter that calls the C close function `Close` (its status is ignored: a destructor
// cannot report it; each class offers try_close / try_release for callers who want it).
template <auto Close>
struct c_closer {
    template <typename T>
    void operator()(T* p) const noexcept {
        (void)Close(p);
    }
};

template <typename T, auto Close>
using closed_by = unique_c<T, c_closer<Close>>;

// A cached value that a move hands over and resets to T{} in the moved-from object.
template <typename T>
class cleared {
public:
    cleared() noexcept = default;
    cleared(T value) noexcept : v_(value) {}  // NOLINT: implicit by design
    cleared(cleared&& other) noexcept : v_(std::exchange(other.v_, T{})) {}
    cleared& operator=(cleared&& other) noexcept {
        v_ = std::exchange(other.v_, T{});
        return *this;
    }
    operator T() const noexcept { return v_; }  // NOLINT: implicit by design

private:
    T v_{};
};

}  // namespace detail
}  // namespace devshare

#endif  // DEVSHARE_OWNER_HPP
