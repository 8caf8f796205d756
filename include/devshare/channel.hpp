/* SPDX-License-Identifier: Apache-2.0 */

// devshare/channel.hpp: Channel (the producer end) and Connection (a consumer end).
//
// A producer listens on a Channel (a Unix SOCK_SEQPACKET socket: a file-system path or "@name");
// consumers connect to it (Connection) and receive items as ordinary Imports. An item is a
// leased reference to a tensor of an Exporter (Channel::send) or a slot of a Pool (pool.hpp).
// When the consumer's Import goes (destroyed or released), the reference or slot goes back to
// the producer; when the consumer closes its Connection, exits or dies, all of its leases and
// slots go back at once.
//
// Nothing runs in background threads. The producer's end moves (connections accepted, releases
// and returned slots taken, hang-ups noticed) only inside Channel::service and the calls that
// wait on it: Channel::wait_peers, Pool::acquire, and Exporter::wait of an export sent over the
// channel. Serve the channel from your own loop: poll Channel::fd() for reading and call
// service(0ms) when it is readable. A consumer's Connection::fd() is readable when an item or
// the producer's close arrives.
//
// Timeouts are std::chrono::milliseconds: 0 does not wait, a negative one (kForever) waits
// forever; the C API takes int32_t milliseconds, so longer ones are cut to about 24.8 days.
// Running out of time is an answer, not an error: wait_peers gives false, recv an empty Import,
// acquire an empty Slot. DEVSHARE_STATUS_CLOSED says the other end is gone (or the channel was
// closed): nothing more will arrive.
//
// Destruction: ~Channel closes the channel (every consumer's recv then says CLOSED, its pools
// are closed, the socket file is removed); ~Connection closes the connection (the producer takes
// back its leases and slots; Imports received from it stay valid until released).
//
// Threading follows devshare.h: a Channel or Connection may be used from several threads at
// once, except for close() and destruction.

#ifndef DEVSHARE_CHANNEL_HPP
#define DEVSHARE_CHANNEL_HPP

#include "compat.hpp"
#include "exporter.hpp"
#include "import.hpp"
#include "owner.hpp"

namespace devshare {

// The producer end of a channel (DevshareChannel). Move-only; a moved-from or
// default-constructed Channel is empty and destroying it does nothing.
class Channel : public compat::Channel1x<Channel> {
public:
    using compat::Channel1x<Channel>::try_send;
#if DEVSHARE_HPP_EXCEPTIONS
    using compat::Channel1x<Channel>::send;
#endif

    Channel() noexcept = default;

    // Listen on `address` (devshare_channel_listen): a file-system path (the socket file is
    // created with mode 0600 and removed by close; an existing file is never replaced:
    // DEVSHARE_STATUS_BUSY) or "@name", a Linux abstract socket. Only processes of this
    // process's effective uid may connect until restrict() says otherwise.
    [[nodiscard]] static Result<Channel> try_listen(const char* address) {
        DevshareChannel* c = nullptr;
        const int32_t s = devshare_channel_listen(address, &c);
        if (s != DEVSHARE_STATUS_OK) {
            return detail::failure(Error::from_last(s));
        }
        return adopt(c);
    }
    [[nodiscard]] static Result<Channel> try_listen(const std::string& address) { return try_listen(address.c_str()); }
    // Take ownership of a C channel (nullptr gives an empty Channel).
    [[nodiscard]] static Channel adopt(DevshareChannel* raw) noexcept {
        Channel c;
        c.ch_.reset(raw);
        return c;
    }

    // The C channel, still owned by this object (nullptr when empty).
    [[nodiscard]] DevshareChannel* get() const noexcept { return ch_.get(); }
    explicit operator bool() const noexcept { return ch_ != nullptr; }
    // Give up ownership: the caller must devshare_channel_close the result. Leaves this empty.
    [[nodiscard]] DevshareChannel* release() noexcept { return ch_.release(); }

    // Who may connect from now on (devshare_channel_restrict): a non-empty `uids` replaces the
    // allowed uids (default: this process's effective uid alone), a non-empty `pids` admits only
    // those processes. Peers already connected stay.
    [[nodiscard]] Result<void> try_restrict(Span<const uint32_t> uids, Span<const int32_t> pids = {}) {
        return detail::call(devshare_channel_restrict(get(), uids.data(), uids.size(), pids.data(), pids.size()));
    }
    // The descriptor to poll for reading in your event loop (-1 when empty).
    [[nodiscard]] int fd() const noexcept { return devshare_channel_fd(get()); }
    // Accept new peers, take their releases and returned slots, notice the ones that hung up
    // (devshare_channel_service). Waits at most `timeout` for something to happen.
    [[nodiscard]] Result<void> try_service(std::chrono::milliseconds timeout) {
        return detail::call(devshare_channel_service(get(), detail::timeout_ms(timeout)));
    }
    // Serve the channel until at least `n` peers are connected (devshare_channel_wait_peers):
    // true, or false when `timeout` passed first.
    [[nodiscard]] Result<bool> try_wait_peers(size_t n, std::chrono::milliseconds timeout) {
        const int32_t s = devshare_channel_wait_peers(get(), n, detail::timeout_ms(timeout));
        return s == DEVSHARE_STATUS_TIMEOUT ? Result<bool>(false) : detail::get<bool>([s](bool*) { return s; }, true);
    }
    // The connected peers' ids, oldest first (devshare_channel_peer_ids).
    [[nodiscard]] Result<std::vector<uint64_t>> try_peers() const {
        std::vector<uint64_t> ids(8);
        for (;;) {
            size_t count = 0;
            const int32_t s = devshare_channel_peer_ids(get(), ids.data(), ids.size(), &count);
            if (s == DEVSHARE_STATUS_BUFFER_TOO_SMALL && count > ids.size()) {
                ids.resize(count);  // more peers than room (or more connected meanwhile): ask again
                continue;
            }
            if (s != DEVSHARE_STATUS_OK) {
                return detail::failure(Error::from_last(s));
            }
            ids.resize(count);
            return ids;
        }
    }
    // What is known about connected peer `peer` (devshare_channel_peer_info): pid, uid and gid
    // from SO_PEERCRED, the tgid it announced, its leases and attached pools, refused messages.
    // DEVSHARE_STATUS_NOT_FOUND when it is not connected.
    [[nodiscard]] Result<DevsharePeerInfo> try_peer_info(uint64_t peer) const {
        DevsharePeerInfo info{};
        (void)devshare_peer_info_init(&info, sizeof info);  // cannot fail: non-NULL, sizeof
        return detail::get<DevsharePeerInfo>(
            [&](DevsharePeerInfo* i) { return devshare_channel_peer_info(get(), peer, i); }, info);
    }
    // Whitelist ACL exports for the pid a consumer announced even where it is not its kernel pid
    // (devshare_channel_trust_announced_pids): for consumers in containers.
    [[nodiscard]] Result<void> try_trust_announced_pids(bool trust) {
        return detail::call(devshare_channel_trust_announced_pids(get(), trust ? 1u : 0u));
    }
    // Register `exporter` with this channel (devshare_channel_register, 1.10): consumers keep its
    // allocation mapped between its leases, so the next lease of it is a lookup. Keep the
    // Exporter alive while it is registered; unregister_export (or closing the channel) lets the
    // consumers' mappings go. (`register` is a C++ keyword, hence the names.)
    [[nodiscard]] Result<void> try_register_export(const Exporter& exporter) {
        return detail::call(devshare_channel_register(get(), exporter.get()));
    }
    // Undo try_register_export (devshare_channel_unregister): DEVSHARE_STATUS_NOT_FOUND when it is
    // not registered with this channel.
    [[nodiscard]] Result<void> try_unregister_export(const Exporter& exporter) {
        return detail::call(devshare_channel_unregister(get(), exporter.get()));
    }
    // Let Exporter::wait on an export leased through this channel poll the consumers' returns
    // for up to `spin` before it sleeps (devshare_channel_set_spin, 1.16): for a producer with a
    // CPU core of its own. Zero (the default) sleeps at once.
    [[nodiscard]] Result<void> try_set_spin(std::chrono::microseconds spin) {
        if (spin.count() < 0 || spin.count() > DEVSHARE_MAX_SPIN_US) {
            return detail::failure(Error(DEVSHARE_STATUS_INVALID_ARGUMENT,
                                         "devshare::Channel::set_spin: 0 to DEVSHARE_MAX_SPIN_US microseconds"));
        }
        return detail::call(devshare_channel_set_spin(get(), static_cast<uint32_t>(spin.count())));
    }
    // Disconnect peer `peer` now, as if it had died (devshare_channel_disconnect): its leases
    // and slots come back at once. DEVSHARE_STATUS_NOT_FOUND when it is not connected.
    [[nodiscard]] Result<void> try_disconnect(uint64_t peer) { return detail::call(devshare_channel_disconnect(get(), peer)); }

    // Send `peer` one leased reference to the described tensor of `exporter`
    // (devshare_channel_send; addresses and offsets in the exporter's allocation):
    //     ch.send(peer, exp, devshare::describe(p, {rows, cols}));
    // The peer receives it with Connection::recv; exporter.outstanding() counts it until the
    // channel learns that the peer released it or disconnected. DEVSHARE_SHARE_* flags are
    // refused. Host memory must come from Exporter::channel_host_alloc or host_alloc.
    [[nodiscard]] Result<void> try_send(uint64_t peer, const Exporter& exporter, const TensorDesc& desc) {
        DevshareTensorDesc c;
        const Result<const DevshareTensorDesc*> d =
            detail::lower("devshare::Channel::send", desc, exporter.data(), exporter.size(), &c);
        if (!d) {
            return detail::failure(d.error());
        }
        return detail::call(devshare_channel_send(get(), peer, exporter.get(), *d));
    }

    // Send `peer` one leased reference to each descs[i] inside *exporters[i], in order, in as
    // few messages as the limits allow (devshare_channel_send_batch); the peer receives them
    // one per Connection::recv. Every description is checked first: when one is refused,
    // nothing is sent.
    //
    // With `names` (1.11; devshare_channel_send_named): each lease carries names[i] (a
    // NUL-terminated UTF-8 string of at most DEVSHARE_MAX_NAME_LEN bytes, or nullptr for none),
    // which the consumer reads with Import::name(). Empty `names`: none.
    [[nodiscard]] Result<void> try_send_batch(uint64_t peer, Span<const Exporter* const> exporters,
                                              Span<const TensorDesc> descs, Span<const char* const> names = {}) {
        if (exporters.size() != descs.size()) {
            return detail::failure(Error(DEVSHARE_STATUS_INVALID_ARGUMENT,
                                         "devshare::Channel::send_batch: as many exporters as descriptions"));
        }
        if (names.size() != 0 && names.size() != descs.size()) {
            return detail::failure(Error(DEVSHARE_STATUS_INVALID_ARGUMENT,
                                         "devshare::Channel::send_batch: as many names as descriptions"));
        }
        std::vector<DevshareTensorDesc> c(descs.size());
        std::vector<const DevshareTensorDesc*> cd(descs.size());
        std::vector<const DevshareExporter*> ce(descs.size());
        for (size_t i = 0; i < descs.size(); i++) {
            if (exporters[i] == nullptr) {
                return detail::failure(Error(DEVSHARE_STATUS_NULL_ARGUMENT, "devshare::Channel::send_batch: a null exporter"));
            }
            const Result<const DevshareTensorDesc*> d = detail::lower("devshare::Channel::send_batch", descs[i],
                                                                      exporters[i]->data(), exporters[i]->size(), &c[i]);
            if (!d) {
                return detail::failure(d.error());
            }
            cd[i] = *d;
            ce[i] = exporters[i]->get();
        }
        if (names.size() != 0) {
            return detail::call(devshare_channel_send_named(get(), peer, ce.data(), cd.data(), names.data(), ce.size()));
        }
        return detail::call(devshare_channel_send_batch(get(), peer, ce.data(), cd.data(), ce.size()));
    }

    // Close the channel (devshare_channel_close): every peer is disconnected, their leases stop
    // counting in their exports' outstanding references (wait for them first), pools on it are
    // closed, the socket file is removed. Afterwards this Channel is empty.
    [[nodiscard]] Result<void> try_close() { return detail::call(devshare_channel_close(ch_.release())); }

#if DEVSHARE_HPP_EXCEPTIONS
    [[nodiscard]] static Channel listen(const std::string& address) { return detail::value(try_listen(address)); }
    void restrict(Span<const uint32_t> uids, Span<const int32_t> pids = {}) {
        detail::value(try_restrict(uids, pids));
    }
    void service(std::chrono::milliseconds timeout) { detail::value(try_service(timeout)); }
    [[nodiscard]] bool wait_peers(size_t n, std::chrono::milliseconds timeout) {
        return detail::value(try_wait_peers(n, timeout));
    }
    [[nodiscard]] std::vector<uint64_t> peers() const { return detail::value(try_peers()); }
    [[nodiscard]] DevsharePeerInfo peer_info(uint64_t peer) const { return detail::value(try_peer_info(peer)); }
    void disconnect(uint64_t peer) { detail::value(try_disconnect(peer)); }
    void trust_announced_pids(bool trust) { detail::value(try_trust_announced_pids(trust)); }
    void register_export(const Exporter& exporter) { detail::value(try_register_export(exporter)); }
    void unregister_export(const Exporter& exporter) { detail::value(try_unregister_export(exporter)); }
    void set_spin(std::chrono::microseconds spin) { detail::value(try_set_spin(spin)); }
    void send(uint64_t peer, const Exporter& exporter, const TensorDesc& desc) {
        detail::value(try_send(peer, exporter, desc));
    }
    void send_batch(uint64_t peer, Span<const Exporter* const> exporters, Span<const TensorDesc> descs,
                    Span<const char* const> names = {}) {
        detail::value(try_send_batch(peer, exporters, descs, names));
    }
    void close() { detail::value(try_close()); }
#endif

private:
    detail::closed_by<DevshareChannel, &devshare_channel_close> ch_;
};

// The consumer end of a channel (DevshareConnection). Move-only; a moved-from or
// default-constructed Connection is empty and destroying it does nothing.
class Connection {
public:
    Connection() noexcept = default;

    // Connect to the channel at `address` (a path or "@name") and shake hands
    // (devshare_channel_connect), waiting at most `timeout` for the producer to serve the
    // handshake. This process announces its pid, for which the producer whitelists the ACL
    // exports it sends here. The producer must run as this process's effective uid or as root,
    // and must admit this process (DEVSHARE_STATUS_UNTRUSTED otherwise). No channel there:
    // DEVSHARE_STATUS_NOT_FOUND; no handshake in time: DEVSHARE_STATUS_TIMEOUT.
    [[nodiscard]] static Result<Connection> try_connect(const char* address, std::chrono::milliseconds timeout) {
        DevshareConnection* c = nullptr;
        const int32_t s = devshare_channel_connect(address, detail::timeout_ms(timeout), &c);
        if (s != DEVSHARE_STATUS_OK) {
            return detail::failure(Error::from_last(s));
        }
        return adopt(c);
    }
    [[nodiscard]] static Result<Connection> try_connect(const std::string& address,
                                                        std::chrono::milliseconds timeout) {
        return try_connect(address.c_str(), timeout);
    }
    // Take ownership of a C connection (nullptr gives an empty Connection).
    [[nodiscard]] static Connection adopt(DevshareConnection* raw) noexcept {
        Connection c;
        c.conn_.reset(raw);
        return c;
    }

    // The C connection, still owned by this object (nullptr when empty).
    [[nodiscard]] DevshareConnection* get() const noexcept { return conn_.get(); }
    explicit operator bool() const noexcept { return conn_ != nullptr; }
    // Give up ownership: the caller must devshare_connection_close the result. Leaves this empty.
    [[nodiscard]] DevshareConnection* release() noexcept { return conn_.release(); }

    // The descriptor to poll for reading in your event loop (-1 when empty).
    [[nodiscard]] int fd() const noexcept { return devshare_connection_fd(get()); }
    // This consumer's id at the producer (what its Channel::peers() lists for it) and the
    // producer's pid as it reported it (devshare_connection_info).
    [[nodiscard]] Result<uint64_t> try_peer_id() const {
        return detail::get<uint64_t>([&](uint64_t* id) { return devshare_connection_info(get(), id, nullptr); });
    }
    [[nodiscard]] Result<int32_t> try_producer_pid() const {
        return detail::get<int32_t>([&](int32_t* pid) { return devshare_connection_info(get(), nullptr, pid); });
    }

    // The next item -- a leased reference or a pool slot -- as an Import
    // (devshare_connection_recv). Destroying or releasing the Import gives the reference or slot
    // back to the producer: do so once this process's device work on it is finished. For a pool
    // item, Import::pool_slot() says which pool and slot it is; its data() is the same address
    // every time that slot arrives. An empty Import when nothing arrived in time;
    // DEVSHARE_STATUS_CLOSED once the producer closed the channel or exited and nothing is
    // queued. A malformed item is refused and given back (DEVSHARE_STATUS_UNTRUSTED or the
    // handle's status).
    [[nodiscard]] Result<Import> try_recv(std::chrono::milliseconds timeout) {
        DevshareImport* raw = nullptr;
        const int32_t s = devshare_connection_recv(get(), detail::timeout_ms(timeout), &raw);
        if (s == DEVSHARE_STATUS_TIMEOUT) {
            return Import();
        }
        if (s != DEVSHARE_STATUS_OK) {
            return detail::failure(Error::from_last(s));
        }
        Result<Import> imp = Import::try_adopt(raw);
        if (!imp) {
            (void)devshare_import_release(raw);
        }
        return imp;
    }

    // The next `n` items, in the order they were sent (devshare_connection_recv_batch, 1.11): a
    // producer's send_batch of `n` tensors. `timeout` bounds the whole batch: when it runs out
    // first the result is DEVSHARE_STATUS_TIMEOUT and the items received so far went back to the
    // producer (so did they on any other failure). Releasing the vector (or each Import)
    // releases the batch.
    [[nodiscard]] Result<std::vector<Import>> try_recv_batch(size_t n, std::chrono::milliseconds timeout) {
        std::vector<DevshareItem> items(n);
        for (DevshareItem& item : items) {
            const int32_t s = devshare_item_init(&item, sizeof item);
            if (s != DEVSHARE_STATUS_OK) {
                return detail::failure(Error::from_last(s));
            }
        }
        const int32_t s = devshare_connection_recv_batch(get(), detail::timeout_ms(timeout), items.data(), n);
        if (s != DEVSHARE_STATUS_OK) {
            return detail::failure(Error::from_last(s));
        }
        std::vector<Import> out;
        out.reserve(n);
        for (size_t i = 0; i < n; i++) {
            Result<Import> imp = Import::try_adopt(items[i].import);
            if (!imp) {
                (void)devshare_items_release(items.data() + i, n - i);  // this one and the rest
                return detail::failure(imp.error());
            }
            items[i].import = nullptr;
            out.push_back(std::move(*imp));
        }
        return out;
    }

    // Give every Import of `batch` back to its producer in one call (devshare_imports_give_back,
    // 1.12): a connection's leases go in one message, which fits the producer's socket however
    // big the batch (one per Import, destroying the vector, fills it after a few hundred while
    // the producer is not reading, and the rest wait for this consumer's next call). Each
    // Import stays mapped until released; releasing it then sends nothing. Empty Imports are
    // skipped.
    [[nodiscard]] static Result<void> try_give_back(const std::vector<Import>& batch) {
        std::vector<const DevshareImport*> raw;
        raw.reserve(batch.size());
        for (const Import& imp : batch) {
            raw.push_back(imp.get());
        }
        return detail::call(devshare_imports_give_back(raw.data(), raw.size()));
    }

    // Let recv poll for up to `spin` before it sleeps (devshare_connection_set_spin): for a
    // consumer with a CPU core of its own. Zero (the default) adds no spin of its own (the
    // library's adaptive one still applies).
    [[nodiscard]] Result<void> try_set_spin(std::chrono::microseconds spin) {
        if (spin.count() < 0 || spin.count() > DEVSHARE_MAX_SPIN_US) {
            return detail::failure(Error(DEVSHARE_STATUS_INVALID_ARGUMENT,
                                         "devshare::Connection::set_spin: 0 to DEVSHARE_MAX_SPIN_US microseconds"));
        }
        return detail::call(devshare_connection_set_spin(get(), static_cast<uint32_t>(spin.count())));
    }
    // Read received device items on `stream` (CUstream / aclrtStream): their events are waited
    // for by that stream instead of by recv (devshare_connection_set_stream); nullptr: recv waits
    // (CUDA's legacy default stream: pass CU_STREAM_LEGACY, as its handle is also null).
    [[nodiscard]] Result<void> try_set_stream(void* stream) {
        return detail::call(devshare_connection_set_stream(get(), stream));
    }

    // Close the connection (devshare_connection_close): the producer takes back every lease and
    // slot of it. Imports received stay valid until released. Afterwards this Connection is empty.
    [[nodiscard]] Result<void> try_close() { return detail::call(devshare_connection_close(conn_.release())); }

#if DEVSHARE_HPP_EXCEPTIONS
    [[nodiscard]] static Connection connect(const std::string& address, std::chrono::milliseconds timeout) {
        return detail::value(try_connect(address, timeout));
    }
    [[nodiscard]] uint64_t peer_id() const { return detail::value(try_peer_id()); }
    [[nodiscard]] int32_t producer_pid() const { return detail::value(try_producer_pid()); }
    [[nodiscard]] Import recv(std::chrono::milliseconds timeout) { return detail::value(try_recv(timeout)); }
    [[nodiscard]] std::vector<Import> recv_batch(size_t n, std::chrono::milliseconds timeout) {
        return detail::value(try_recv_batch(n, timeout));
    }
    static void give_back(const std::vector<Import>& batch) { detail::value(try_give_back(batch)); }
    void set_spin(std::chrono::microseconds spin) { detail::value(try_set_spin(spin)); }
    void set_stream(void* stream) { detail::value(try_set_stream(stream)); }
    void close() { detail::value(try_close()); }
#endif

private:
    detail::closed_by<DevshareConnection, &devshare_connection_close> conn_;
};

}  // namespace devshare

#endif  // DEVSHARE_CHANNEL_HPP
