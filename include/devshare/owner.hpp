/* SPDX-License-Identifier: Apache-2.0 */

// devshare/owner.hpp (detail): the one way this API owns a C object. Every owner class holds a
// detail::unique_c<T, Deleter> (closed_by<T, close> for a plain C close function), so its moves,
// move assignment (which closes what was held) and destruction are this template's alone, and
// a moved-from owner is empty. What an owner caches about its object is a detail::cleared<T>,
// reset by a move, so a moved-from owner reports nothing. What outlives an owner for the views of
// its memory is a detail::liveness: the views ask it whether the memory is still there.

#ifndef DEVSHARE_OWNER_HPP
#define DEVSHARE_OWNER_HPP

#include <atomic>
#include <cstddef>
#include <cstdint>
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

// Whether an owner's memory is still there, shared by the owner and the views of that memory
// (TensorView): the owner holds one reference and calls end() when it releases the memory; each
// view holds one more, so a view that outlives its owner finds alive() false instead of reading
// unmapped memory. Deleted with its last reference. The count is atomic, so views may be copied
// and dropped on any thread; a release racing a read on another thread is the caller's to order.
class liveness {
public:
    liveness() noexcept = default;
    liveness(const liveness&) = delete;
    liveness& operator=(const liveness&) = delete;

    [[nodiscard]] bool alive() const noexcept { return alive_.load(std::memory_order_acquire); }
    void end() noexcept { alive_.store(false, std::memory_order_release); }
    void retain() noexcept { refs_.fetch_add(1, std::memory_order_relaxed); }
    void drop() noexcept {
        if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
            delete this;
        }
    }

protected:
    virtual ~liveness() = default;  // the owner's block derives from it (Import's Meta)

private:
    std::atomic<uint32_t> refs_{1};
    std::atomic<bool> alive_{true};
};

// One counted reference to a liveness (what a view holds); nullptr: memory no owner tracks.
class liveness_ref {
public:
    liveness_ref() noexcept = default;
    explicit liveness_ref(liveness* l) noexcept : l_(l) {
        if (l_ != nullptr) {
            l_->retain();
        }
    }
    liveness_ref(const liveness_ref& other) noexcept : liveness_ref(other.l_) {}
    liveness_ref(liveness_ref&& other) noexcept : l_(std::exchange(other.l_, nullptr)) {}
    liveness_ref& operator=(liveness_ref other) noexcept {
        std::swap(l_, other.l_);
        return *this;
    }
    ~liveness_ref() {
        if (l_ != nullptr) {
            l_->drop();
        }
    }
    // False once the owner released the memory (true when no owner is tracked).
    [[nodiscard]] bool alive() const noexcept { return l_ == nullptr || l_->alive(); }

private:
    liveness* l_ = nullptr;
};

}  // namespace detail
}  // namespace devshare

#endif  // DEVSHARE_OWNER_HPP
