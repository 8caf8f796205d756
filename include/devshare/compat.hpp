/* SPDX-License-Identifier: Apache-2.0 */

// devshare/compat.hpp: the devshare 1.0-1.2 spellings of sharing and sending, kept until 2.0 as
// [[deprecated]] one-line forwarders to the one form that takes a TensorDesc (describe(...)).
// Exporter, Channel and Pool inherit them; each line says its replacement (also in the README's
// changelog). Not to be included on its own: exporter.hpp, channel.hpp and pool.hpp include it.

#ifndef DEVSHARE_COMPAT_HPP
#define DEVSHARE_COMPAT_HPP

#include "handle.hpp"

#define DEVSHARE_1X(replacement) [[deprecated("devshare 1.3: use " replacement)]] [[nodiscard]]
#define DEVSHARE_1X_VOID(replacement) [[deprecated("devshare 1.3: use " replacement)]]

namespace devshare {

class Exporter;
class Slot;

namespace compat {

// Exporter::share(first, shape, ...), share_at, share_bytes, share_bytes_encoded, describe.
template <typename E>
class Exporter1x {
    const E& self() const noexcept { return static_cast<const E&>(*this); }

public:
    template <typename T = void, typename P>
    DEVSHARE_1X("try_share(devshare::describe<T>(first, shape, ...))")
    Result<Handle> try_share(const P* first, Dims shape, Dims strides = {}, const ShareOptions& o = {}) const {
        return self().try_share(devshare::describe<T>(first, shape, strides, o));
    }
    DEVSHARE_1X("try_share(devshare::describe(dtype, first, shape, ...))")
    Result<Handle> try_share(DevshareDType dtype, const void* first, Dims shape, Dims strides = {},
                             const ShareOptions& o = {}) const {
        return self().try_share(devshare::describe(dtype, first, shape, strides, o));
    }
    template <typename T>
    DEVSHARE_1X("try_share(devshare::describe_at<T>(offset, shape, ...))")
    Result<Handle> try_share_at(uint64_t offset, Dims shape, Dims strides = {}, const ShareOptions& o = {}) const {
        return self().try_share(devshare::describe_at<T>(offset, shape, strides, o));
    }
    DEVSHARE_1X("try_share(devshare::describe_at(dtype, offset, shape, ...))")
    Result<Handle> try_share_at(DevshareDType dtype, uint64_t offset, Dims shape, Dims strides = {},
                                const ShareOptions& o = {}) const {
        return self().try_share(devshare::describe_at(dtype, offset, shape, strides, o));
    }
    DEVSHARE_1X("try_share(devshare::bytes())")
    Result<Handle> try_share_bytes() const { return self().try_share(devshare::bytes()); }
    DEVSHARE_1X("try_share_encoded(devshare::bytes())")
    Result<std::vector<uint8_t>> try_share_bytes_encoded() const { return self().try_share_encoded(devshare::bytes()); }
    template <typename T = void, typename P>
    DEVSHARE_1X("devshare::describe<T>(first, shape, ...)")
    Result<TensorDesc> try_describe(const P* first, Dims shape, Dims strides = {}, const ShareOptions& o = {}) const {
        return devshare::describe<T>(first, shape, strides, o);
    }
    DEVSHARE_1X("devshare::describe(dtype, first, shape, ...)")
    Result<TensorDesc> try_describe(DevshareDType dtype, const void* first, Dims shape, Dims strides = {},
                                    const ShareOptions& o = {}) const {
        return devshare::describe(dtype, first, shape, strides, o);
    }
    DEVSHARE_1X("devshare::describe_at(dtype, offset, shape, ...)")
    Result<TensorDesc> try_describe_at(DevshareDType dtype, uint64_t offset, Dims shape, Dims strides = {},
                                       const ShareOptions& o = {}) const {
        return devshare::describe_at(dtype, offset, shape, strides, o);
    }
#if DEVSHARE_HPP_EXCEPTIONS
    template <typename T = void, typename P>
    DEVSHARE_1X("share(devshare::describe<T>(first, shape, ...))")
    Handle share(const P* first, Dims shape, Dims strides = {}, const ShareOptions& o = {}) const {
        return self().share(devshare::describe<T>(first, shape, strides, o));
    }
    DEVSHARE_1X("share(devshare::describe(dtype, first, shape, ...))")
    Handle share(DevshareDType dtype, const void* first, Dims shape, Dims strides = {},
                 const ShareOptions& o = {}) const {
        return self().share(devshare::describe(dtype, first, shape, strides, o));
    }
    template <typename T>
    DEVSHARE_1X("share(devshare::describe_at<T>(offset, shape, ...))")
    Handle share_at(uint64_t offset, Dims shape, Dims strides = {}, const ShareOptions& o = {}) const {
        return self().share(devshare::describe_at<T>(offset, shape, strides, o));
    }
    DEVSHARE_1X("share(devshare::describe_at(dtype, offset, shape, ...))")
    Handle share_at(DevshareDType dtype, uint64_t offset, Dims shape, Dims strides = {},
                    const ShareOptions& o = {}) const {
        return self().share(devshare::describe_at(dtype, offset, shape, strides, o));
    }
    DEVSHARE_1X("share(devshare::bytes())")
    Handle share_bytes() const { return self().share(devshare::bytes()); }
    DEVSHARE_1X("share_encoded(devshare::bytes())")
    std::vector<uint8_t> share_bytes_encoded() const { return self().share_encoded(devshare::bytes()); }
    template <typename T = void, typename P>
    DEVSHARE_1X("devshare::describe<T>(first, shape, ...)")
    TensorDesc describe(const P* first, Dims shape, Dims strides = {}, const ShareOptions& o = {}) const {
        return devshare::describe<T>(first, shape, strides, o);
    }
    DEVSHARE_1X("devshare::describe(dtype, first, shape, ...)")
    TensorDesc describe(DevshareDType dtype, const void* first, Dims shape, Dims strides = {},
                        const ShareOptions& o = {}) const {
        return devshare::describe(dtype, first, shape, strides, o);
    }
    DEVSHARE_1X("devshare::describe_at(dtype, offset, shape, ...)")
    TensorDesc describe_at(DevshareDType dtype, uint64_t offset, Dims shape, Dims strides = {},
                           const ShareOptions& o = {}) const {
        return devshare::describe_at(dtype, offset, shape, strides, o);
    }
#endif
};

// Channel::send(peer, exporter, first, shape, ...), send_at, send_bytes.
template <typename C>
class Channel1x {
    C& self() noexcept { return static_cast<C&>(*this); }

public:
    template <typename T = void, typename P>
    DEVSHARE_1X("try_send(peer, exporter, devshare::describe<T>(first, shape, ...))")
    Result<void> try_send(uint64_t peer, const Exporter& e, const P* first, Dims shape, Dims strides = {},
                          const ShareOptions& o = {}) {
        return self().try_send(peer, e, devshare::describe<T>(first, shape, strides, o));
    }
    DEVSHARE_1X("try_send(peer, exporter, devshare::describe(dtype, first, shape, ...))")
    Result<void> try_send(uint64_t peer, const Exporter& e, DevshareDType dtype, const void* first, Dims shape,
                          Dims strides = {}, const ShareOptions& o = {}) {
        return self().try_send(peer, e, devshare::describe(dtype, first, shape, strides, o));
    }
    template <typename T>
    DEVSHARE_1X("try_send(peer, exporter, devshare::describe_at<T>(offset, shape, ...))")
    Result<void> try_send_at(uint64_t peer, const Exporter& e, uint64_t offset, Dims shape, Dims strides = {},
                             const ShareOptions& o = {}) {
        return self().try_send(peer, e, devshare::describe_at<T>(offset, shape, strides, o));
    }
    DEVSHARE_1X("try_send(peer, exporter, devshare::describe_at(dtype, offset, shape, ...))")
    Result<void> try_send_at(uint64_t peer, const Exporter& e, DevshareDType dtype, uint64_t offset, Dims shape,
                             Dims strides = {}, const ShareOptions& o = {}) {
        return self().try_send(peer, e, devshare::describe_at(dtype, offset, shape, strides, o));
    }
    DEVSHARE_1X("try_send(peer, exporter, devshare::bytes())")
    Result<void> try_send_bytes(uint64_t peer, const Exporter& e) { return self().try_send(peer, e, devshare::bytes()); }
#if DEVSHARE_HPP_EXCEPTIONS
    template <typename T = void, typename P>
    DEVSHARE_1X_VOID("send(peer, exporter, devshare::describe<T>(first, shape, ...))")
    void send(uint64_t peer, const Exporter& e, const P* first, Dims shape, Dims strides = {},
              const ShareOptions& o = {}) {
        self().send(peer, e, devshare::describe<T>(first, shape, strides, o));
    }
    DEVSHARE_1X_VOID("send(peer, exporter, devshare::describe(dtype, first, shape, ...))")
    void send(uint64_t peer, const Exporter& e, DevshareDType dtype, const void* first, Dims shape, Dims strides = {},
              const ShareOptions& o = {}) {
        self().send(peer, e, devshare::describe(dtype, first, shape, strides, o));
    }
    template <typename T>
    DEVSHARE_1X_VOID("send(peer, exporter, devshare::describe_at<T>(offset, shape, ...))")
    void send_at(uint64_t peer, const Exporter& e, uint64_t offset, Dims shape, Dims strides = {},
                 const ShareOptions& o = {}) {
        self().send(peer, e, devshare::describe_at<T>(offset, shape, strides, o));
    }
    DEVSHARE_1X_VOID("send(peer, exporter, devshare::describe_at(dtype, offset, shape, ...))")
    void send_at(uint64_t peer, const Exporter& e, DevshareDType dtype, uint64_t offset, Dims shape,
                 Dims strides = {}, const ShareOptions& o = {}) {
        self().send(peer, e, devshare::describe_at(dtype, offset, shape, strides, o));
    }
    DEVSHARE_1X_VOID("send(peer, exporter, devshare::bytes())")
    void send_bytes(uint64_t peer, const Exporter& e) { self().send(peer, e, devshare::bytes()); }
#endif
};

// Pool::send(slot, peer, first, shape, ...), send_at, send_bytes.
template <typename P0>
class Pool1x {
    P0& self() noexcept { return static_cast<P0&>(*this); }

public:
    template <typename T = void, typename P>
    DEVSHARE_1X("try_send(slot, peer, devshare::describe<T>(first, shape, ...))")
    Result<void> try_send(Slot& slot, uint64_t peer, const P* first, Dims shape, Dims strides = {},
                          const ShareOptions& o = {}) {
        return self().try_send(slot, peer, devshare::describe<T>(first, shape, strides, o));
    }
    DEVSHARE_1X("try_send(slot, peer, devshare::describe(dtype, first, shape, ...))")
    Result<void> try_send(Slot& slot, uint64_t peer, DevshareDType dtype, const void* first, Dims shape,
                          Dims strides = {}, const ShareOptions& o = {}) {
        return self().try_send(slot, peer, devshare::describe(dtype, first, shape, strides, o));
    }
    template <typename T>
    DEVSHARE_1X("try_send(slot, peer, devshare::describe_at<T>(offset, shape, ...))")
    Result<void> try_send_at(Slot& slot, uint64_t peer, uint64_t offset, Dims shape, Dims strides = {},
                             const ShareOptions& o = {}) {
        return self().try_send(slot, peer, devshare::describe_at<T>(offset, shape, strides, o));
    }
    DEVSHARE_1X("try_send(slot, peer, devshare::describe_at(dtype, offset, shape, ...))")
    Result<void> try_send_at(Slot& slot, uint64_t peer, DevshareDType dtype, uint64_t offset, Dims shape,
                             Dims strides = {}, const ShareOptions& o = {}) {
        return self().try_send(slot, peer, devshare::describe_at(dtype, offset, shape, strides, o));
    }
    DEVSHARE_1X("try_send(slot, peer, devshare::bytes())")
    Result<void> try_send_bytes(Slot& slot, uint64_t peer) { return self().try_send(slot, peer, devshare::bytes()); }
#if DEVSHARE_HPP_EXCEPTIONS
    template <typename T = void, typename P>
    DEVSHARE_1X_VOID("send(slot, peer, devshare::describe<T>(first, shape, ...))")
    void send(Slot& slot, uint64_t peer, const P* first, Dims shape, Dims strides = {}, const ShareOptions& o = {}) {
        self().send(slot, peer, devshare::describe<T>(first, shape, strides, o));
    }
    DEVSHARE_1X_VOID("send(slot, peer, devshare::describe(dtype, first, shape, ...))")
    void send(Slot& slot, uint64_t peer, DevshareDType dtype, const void* first, Dims shape, Dims strides = {},
              const ShareOptions& o = {}) {
        self().send(slot, peer, devshare::describe(dtype, first, shape, strides, o));
    }
    template <typename T>
    DEVSHARE_1X_VOID("send(slot, peer, devshare::describe_at<T>(offset, shape, ...))")
    void send_at(Slot& slot, uint64_t peer, uint64_t offset, Dims shape, Dims strides = {},
                 const ShareOptions& o = {}) {
        self().send(slot, peer, devshare::describe_at<T>(offset, shape, strides, o));
    }
    DEVSHARE_1X_VOID("send(slot, peer, devshare::describe_at(dtype, offset, shape, ...))")
    void send_at(Slot& slot, uint64_t peer, DevshareDType dtype, uint64_t offset, Dims shape, Dims strides = {},
                 const ShareOptions& o = {}) {
        self().send(slot, peer, devshare::describe_at(dtype, offset, shape, strides, o));
    }
    DEVSHARE_1X_VOID("send(slot, peer, devshare::bytes())")
    void send_bytes(Slot& slot, uint64_t peer) { self().send(slot, peer, devshare::bytes()); }
#endif
};

}  // namespace compat
}  // namespace devshare

#undef DEVSHARE_1X
#undef DEVSHARE_1X_VOID

#endif  // DEVSHARE_COMPAT_HPP
