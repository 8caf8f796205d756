/* SPDX-License-Identifier: Apache-2.0 */

// devshare/owner.hpp (detail): the one way this API owns a C object. Every owner class holds a
// detail::unique_c (std::unique_ptr with a deleter calling the C close function), so moves,
// move assignment (which closes what was held) and destruction are the standard library's, and
// a moved-from owner is empty. What an owner caches about its object is a detail::cleared<T>,
// reset by a move, so a moved-from owner reports nothing.

#ifndef DEVSHARE_OWNER_HPP
#define DEVSHARE_OWNER_HPP

#include <memory>
#include <utility>

namespace devshare {
namespace detail {

// Calls the C close function `Close` (its status is ignored: a destructor cannot report it;
// each class offers try_close / try_release for callers who want it).
template <auto Close>
struct c_closer {
    template <typename T>
    void operator()(T* p) const noexcept {
        (void)Close(p);
    }
};

template <typename T, auto Close>
using unique_c = std::unique_ptr<T, c_closer<Close>>;

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
