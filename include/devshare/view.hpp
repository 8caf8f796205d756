/* SPDX-License-Identifier: Apache-2.0 */

// devshare/view.hpp: TensorView<T>, a strided view of an imported tensor (Import::as<T>) whose
// element access is checked in every build and fails cleanly once the Import was released, and
// std::mdspan of it where the standard library has one.

#ifndef DEVSHARE_VIEW_HPP
#define DEVSHARE_VIEW_HPP

#include "dtype.hpp"
#include "error.hpp"
#include "owner.hpp"

#include <array>
#include <cassert>
#include <string>

#if defined(__cpp_lib_mdspan)
#include <mdspan>
#endif

namespace devshare {

class Import;

// A strided view of a tensor: its first element, shape and strides (in elements), copied from the
// handle (at most DEVSHARE_MAX_NDIM dimensions). The pointer is what the import's data pointer
// is: for device backends a device address, not to be dereferenced on the host.
//
// Element access is checked in every build, NDEBUG or not: v(i, j) and at({i, j}) need one index
// per dimension (DEVSHARE_STATUS_BAD_NDIM), each inside its extent (INVALID_ARGUMENT), a view that
// is not empty (NULL_ARGUMENT) and an Import that was not released (ALREADY_RELEASED). A failed
// check throws the devshare::Error; built without exceptions it is printed and the program aborts,
// as value() of a failed Result does. try_at({i, j}) returns the Error instead; unchecked(i, j)
// checks nothing (an assert in debug builds), for loops that have checked their bounds.
//
// A view made by Import::as<T> knows whether its Import still holds the memory: once the Import
// is released, destroyed or assigned over, every checked access, flat() and mdspan() fail with
// ALREADY_RELEASED and data() is nullptr (a move of the Import keeps its views valid). What they
// returned before (a T&, a pointer, a Span, an mdspan) is as invalid as the memory: do not keep
// them past the release. A view made from a pointer (the public constructor) tracks nothing.
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

    // False once the Import this view was made from released its memory (see the class comment).
    [[nodiscard]] bool valid() const noexcept { return alive_.alive(); }
    // The first element; nullptr once the Import was released.
    [[nodiscard]] T* data() const noexcept { return alive_.alive() ? data_ : nullptr; }
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

    // Element [i0][i1]...: exactly ndim() indices, checked (see the class comment).
    template <typename... I, typename = std::enable_if_t<(std::is_integral<I>::value && ...)>>
    [[nodiscard]] T& operator()(I... index) const {
        const int64_t ix[sizeof...(I) + 1] = {static_cast<int64_t>(index)..., 0};
        int64_t offset = 0;
        const int32_t s = locate(ix, sizeof...(I), &offset);
        if (s != DEVSHARE_STATUS_OK) {
            detail::fail(problem(s, "operator()", ix, sizeof...(I)), "a checked access failed");
        }
        return data_[offset];
    }
    // Element at an index list of ndim() entries, checked alike.
    [[nodiscard]] T& at(Dims index) const {
        int64_t offset = 0;
        const int32_t s = locate(index.data(), index.size(), &offset);
        if (s != DEVSHARE_STATUS_OK) {
            detail::fail(problem(s, "at", index.data(), index.size()), "a checked access failed");
        }
        return data_[offset];
    }
    // The address of the element at an index list, or the Error at() would throw.
    [[nodiscard]] Result<T*> try_at(Dims index) const {
        int64_t offset = 0;
        const int32_t s = locate(index.data(), index.size(), &offset);
        if (s != DEVSHARE_STATUS_OK) {
            return detail::failure(problem(s, "at", index.data(), index.size()));
        }
        return data_ + offset;
    }
    // Element [i0][i1]... with no check at all (rank, range and release only assert()ed in debug
    // builds): for loops whose bounds come from shape() of a view known to be valid().
    template <typename... I, typename = std::enable_if_t<(std::is_integral<I>::value && ...)>>
    [[nodiscard]] T& unchecked(I... index) const noexcept {
        assert(sizeof...(I) == ndim_ && "devshare::TensorView::unchecked: one index per dimension");
        assert(alive_.alive() && "devshare::TensorView::unchecked: the Import was released");
        const int64_t ix[sizeof...(I) + 1] = {static_cast<int64_t>(index)..., 0};
        int64_t offset = 0;
        for (size_t k = 0; k != sizeof...(I); k++) {
            assert(ix[k] >= 0 && ix[k] < shape_[k] && "devshare::TensorView::unchecked: index out of range");
            offset += ix[k] * strides_[k];
        }
        return data_[offset];
    }

    // The elements as one contiguous Span (only for a C-contiguous view).
    [[nodiscard]] Result<Span<T>> try_flat() const {
        if (!alive_.alive()) {
            return detail::error(DEVSHARE_STATUS_ALREADY_RELEASED, std::string("devshare::TensorView::flat: ") + released);
        }
        if (!is_contiguous()) {
            return detail::error(DEVSHARE_STATUS_INVALID_ARGUMENT, "devshare::TensorView::flat: the view is not "
                                                                   "C-contiguous");
        }
        return Span<T>(data_, static_cast<size_t>(numel()));
    }
#if DEVSHARE_HPP_EXCEPTIONS
    [[nodiscard]] Span<T> flat() const { return detail::value(try_flat()); }
#endif

#if defined(__cpp_lib_mdspan)
    // std::mdspan of rank Rank with layout_stride. Refused when ndim() != Rank or the layout is
    // not one layout_stride accepts (strides >= 1, no two elements at one address).
    template <std::size_t Rank>
    using mdspan_type = std::mdspan<T, std::dextents<int64_t, Rank>, std::layout_stride>;

    template <std::size_t Rank>
    [[nodiscard]] Result<mdspan_type<Rank>> try_mdspan() const {
        if (!alive_.alive()) {
            return detail::error(DEVSHARE_STATUS_ALREADY_RELEASED, std::string("devshare::TensorView::mdspan: ") + released);
        }
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
        return detail::value(try_mdspan<Rank>());
    }
#endif
#endif

private:
    friend class Import;
    TensorView(T* data, Dims shape, Dims strides, detail::liveness_ref alive) noexcept
        : TensorView(data, shape, strides) {
        alive_ = std::move(alive);
    }

    static constexpr const char* released = "the Import this view was made from was released";

    // The element offset of an index list, or the status of the first check it fails.
    int32_t locate(const int64_t* ix, size_t n, int64_t* offset) const noexcept {
        if (!alive_.alive()) {
            return DEVSHARE_STATUS_ALREADY_RELEASED;
        }
        if (data_ == nullptr) {
            return DEVSHARE_STATUS_NULL_ARGUMENT;
        }
        if (n != ndim_) {
            return DEVSHARE_STATUS_BAD_NDIM;
        }
        int64_t off = 0;
        for (size_t k = 0; k < n; k++) {
            if (ix[k] < 0 || ix[k] >= shape_[k]) {
                return DEVSHARE_STATUS_INVALID_ARGUMENT;
            }
            off += ix[k] * strides_[k];
        }
        *offset = off;
        return DEVSHARE_STATUS_OK;
    }
    // The Error for a status locate() gave (only on the failing path).
    Error problem(int32_t status, const char* function, const int64_t* ix, size_t n) const {
        std::string m = std::string("devshare::TensorView::") + function + ": ";
        if (status == DEVSHARE_STATUS_ALREADY_RELEASED) {
            m += released;
        } else if (status == DEVSHARE_STATUS_NULL_ARGUMENT) {
            m += "the view is empty";
        } else if (status == DEVSHARE_STATUS_BAD_NDIM) {
            m += std::to_string(n) + " indices for a view of " + std::to_string(ndim_) + " dimensions";
        } else {
            for (size_t k = 0; k < n; k++) {
                if (ix[k] < 0 || ix[k] >= shape_[k]) {
                    m += "index " + std::to_string(ix[k]) + " of dimension " + std::to_string(k) + " is outside [0, " +
                         std::to_string(shape_[k]) + ")";
                    break;
                }
            }
        }
        return Error(status, m);
    }

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
    detail::liveness_ref alive_;
};

}  // namespace devshare

#endif  // DEVSHARE_VIEW_HPP
