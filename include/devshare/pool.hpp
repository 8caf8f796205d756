/* SPDX-License-Identifier: Apache-2.0 */

// devshare/pool.hpp: Pool, fixed-address slots on a Channel, and Slot, one acquired slot.
//
// Pool slots keep one address in the consumer for the pool's life: the consumer imports the
// whole pool allocation once, with its first item, and every later item of that pool is a slot
// of the same mapping. That is what captured device graphs (CUDA graphs, aclgraph) need: capture
// on the slots' addresses once, replay on whichever slot arrives.
//
//     devshare::Pool pool = devshare::Pool::create(ch, devshare::Exporter::channel_host_alloc(8 << 20), 1 << 20, 8);
//     devshare::Slot slot = pool.acquire(devshare::kForever);    // waits while all 8 are out
//     fill(slot.data<float>(), n);
//     pool.send(slot, peer, devshare::describe(slot.data<float>(), {n}));   // the consumer's recv() gets it
//
// ~Pool closes the pool (consumers keep their items until they release them); ~Slot gives back
// an acquired slot that was not sent. A Pool may outlive its Channel (its calls then fail with
// CLOSED); a Slot must not outlive its Pool. A Pool may be used from several threads at once,
// except for close() and destruction; a Slot is one thread's at a time.

#ifndef DEVSHARE_POOL_HPP
#define DEVSHARE_POOL_HPP

#include "channel.hpp"
#include "compat.hpp"
#include "owner.hpp"

namespace devshare {

// A pool's slot size, slot count and how many slots are free now (Pool::info).
struct PoolInfo {
    uint64_t slot_size = 0;
    uint32_t count = 0;
    uint32_t free_slots = 0;
};

// One acquired slot of a Pool (Pool::acquire): its index, its address in this process (for a
// device pool, a device address) and its size. Move-only; a moved-from, sent, released or
// default-constructed Slot is empty. Destroying a Slot that is still acquired gives it back to
// the pool unsent (devshare_pool_release; errors are ignored).
class Slot {
public:
    Slot() noexcept = default;

    // The slot's index in its pool (0 when empty).
    [[nodiscard]] uint32_t index() const noexcept { return pool_ ? pool_.get_deleter().index : 0; }
    // The slot's first byte in this process (nullptr when empty): the same address every time
    // this index is acquired.
    [[nodiscard]] void* data() const noexcept { return data_; }
    template <typename T>
    [[nodiscard]] T* data() const noexcept {
        return static_cast<T*>(data());
    }
    // The slot's size in bytes (0 when empty).
    [[nodiscard]] uint64_t size() const noexcept { return size_; }
    // The C pool the slot belongs to (nullptr when empty).
    [[nodiscard]] DevsharePool* pool() const noexcept { return pool_.get(); }
    explicit operator bool() const noexcept { return pool_ != nullptr; }

    // Give up ownership: the slot stays acquired, for devshare_pool_send or
    // devshare_pool_release on pool(). Returns its index and leaves this Slot empty.
    [[nodiscard]] uint32_t disown() noexcept {
        const uint32_t i = index();
        clear();
        return i;
    }

private:
    friend class Pool;
    struct GiveBack {  // the deleter: give the slot back unsent
        uint32_t index;
        void operator()(DevsharePool* p) const noexcept { (void)devshare_pool_release(p, index); }
    };

    Slot(DevsharePool* pool, uint32_t index, void* data, uint64_t size) noexcept
        : pool_(pool, GiveBack{index}), data_(data), size_(size) {}
    void clear() noexcept {
        (void)pool_.release();
        data_ = nullptr;
        size_ = 0;
    }

    detail::unique_c<DevsharePool, GiveBack> pool_;
    detail::cleared<void*> data_;
    detail::cleared<uint64_t> size_;
};

// A pool of fixed-address slots on a channel (DevsharePool). Move-only; a moved-from or
// default-constructed Pool is empty and destroying it does nothing. Destroying a non-empty Pool
// closes it: attached consumers are told, and each detaches once it released its items.
class Pool : public compat::Pool1x<Pool> {
public:
    using compat::Pool1x<Pool>::try_send;
#if DEVSHARE_HPP_EXCEPTIONS
    using compat::Pool1x<Pool>::send;
#endif

    Pool() noexcept = default;

    // Make a pool of `count` slots of `slot_size` bytes, back to back from the start of
    // `exporter`'s range, on `channel` (devshare_pool_create): one allocation
    // (Exporter::channel_host_alloc, or an ACL or CUDA export). The pool keeps the export alive:
    // the Exporter may be closed or destroyed first. Each consumer the pool reaches counts as
    // one outstanding reference of the export until it detaches or disconnects.
    [[nodiscard]] static Result<Pool> try_create(Channel& channel, const Exporter& exporter, uint64_t slot_size,
                                                 uint32_t count) {
        DevsharePool* p = nullptr;
        const int32_t s = devshare_pool_create(channel.get(), exporter.get(), slot_size, count, &p);
        if (s != DEVSHARE_STATUS_OK) {
            return detail::failure(Error::from_last(s));
        }
        return try_adopt(p);
    }
    // Take ownership of a C pool (nullptr gives an empty Pool); its slot size is asked once.
    [[nodiscard]] static Result<Pool> try_adopt(DevsharePool* raw) {
        Pool p;
        uint64_t slot_size = 0;
        uint32_t count = 0;
        if (raw != nullptr) {
            const int32_t s = devshare_pool_info(raw, &slot_size, &count, nullptr);
            if (s != DEVSHARE_STATUS_OK) {
                return detail::failure(Error::from_last(s));
            }
        }
        p.pool_.reset(raw);
        p.slot_size_ = slot_size;
        p.count_ = count;
        return p;
    }

    // The C pool, still owned by this object (nullptr when empty).
    [[nodiscard]] DevsharePool* get() const noexcept { return pool_.get(); }
    explicit operator bool() const noexcept { return pool_ != nullptr; }
    // Slot size in bytes and slot count (0 when empty).
    [[nodiscard]] uint64_t slot_size() const noexcept { return slot_size_; }
    [[nodiscard]] uint32_t count() const noexcept { return count_; }

    // The pool's id on its channel (devshare_pool_id, > 0): what Import::pool_slot() reports.
    [[nodiscard]] Result<uint32_t> try_id() const {
        return detail::get<uint32_t>([&](uint32_t* id) { return devshare_pool_id(get(), id); });
    }
    // A free slot (devshare_pool_acquire). While every slot is out, waits for one to come back,
    // serving the channel (backpressure): an empty Slot when `timeout` passed first.
    [[nodiscard]] Result<Slot> try_acquire(std::chrono::milliseconds timeout) {
        uint32_t index = 0;
        void* ptr = nullptr;
        const int32_t s = devshare_pool_acquire(get(), detail::timeout_ms(timeout), &index, &ptr);
        if (s == DEVSHARE_STATUS_TIMEOUT) {
            return Slot();
        }
        if (s != DEVSHARE_STATUS_OK) {
            return detail::failure(Error::from_last(s));
        }
        return Slot(get(), index, ptr, slot_size_);
    }

    // Hand acquired `slot` to `peer` with the described tensor in it (devshare_pool_send):
    //     pool.send(slot, peer, devshare::describe(slot.data<float>(), {rows, cols}));
    // Addresses lie in [slot.data(), slot.data() + slot.size()], offsets and storage_offset
    // count from the slot's start, and the storage is the rest of the slot unless the options
    // say otherwise; bytes() is the whole slot. On success `slot` becomes empty: the slot is the
    // peer's until it releases the item or disconnects. On failure `slot` stays acquired (and
    // yours). Device work on the options' stream is synchronised first.
    [[nodiscard]] Result<void> try_send(Slot& slot, uint64_t peer, const TensorDesc& desc) {
        Result<void> mine = check_slot(slot, "devshare::Pool::send");
        if (!mine) {
            return mine;
        }
        DevshareTensorDesc c;
        const Result<const DevshareTensorDesc*> d = detail::lower("devshare::Pool::send", desc, slot.data(), slot.size(), &c);
        if (!d) {
            return detail::failure(d.error());
        }
        Result<void> sent = detail::call(devshare_pool_send(get(), slot.index(), peer, *d));
        if (sent) {
            slot.clear();
        }
        return sent;
    }
    // Give back acquired `slot` without sending it (devshare_pool_release); afterwards it is
    // empty. Releasing an empty Slot does nothing; a Slot of another pool is
    // DEVSHARE_STATUS_INVALID_ARGUMENT.
    [[nodiscard]] Result<void> try_release(Slot& slot) {
        if (!slot) {
            return {};
        }
        Result<void> mine = check_slot(slot, "devshare::Pool::release");
        if (!mine) {
            return mine;
        }
        const int32_t s = devshare_pool_release(get(), slot.index());
        slot.clear();  // refused only when not acquired: then it is not this Slot's to give back
        return detail::call(s);
    }
    // Slot size, slot count and how many slots are free now (devshare_pool_info).
    [[nodiscard]] Result<PoolInfo> try_info() const {
        return detail::get<PoolInfo>(
            [&](PoolInfo* i) { return devshare_pool_info(get(), &i->slot_size, &i->count, &i->free_slots); });
    }
    // Let acquire poll for a returned slot for up to `spin` before it sleeps
    // (devshare_pool_set_spin): for a producer with a CPU core of its own. Zero (the default)
    // adds no spin of its own (the library's adaptive one still applies).
    [[nodiscard]] Result<void> try_set_spin(std::chrono::microseconds spin) {
        if (spin.count() < 0 || spin.count() > DEVSHARE_MAX_SPIN_US) {
            return detail::failure(Error(DEVSHARE_STATUS_INVALID_ARGUMENT,
                                         "devshare::Pool::set_spin: 0 to DEVSHARE_MAX_SPIN_US microseconds"));
        }
        return detail::call(devshare_pool_set_spin(get(), static_cast<uint32_t>(spin.count())));
    }

    // Close the pool (devshare_pool_close): attached consumers are told, each detaches once it
    // released its items. Afterwards this Pool is empty. Slots still acquired must not be used
    // (nor destroyed) after it.
    [[nodiscard]] Result<void> try_close() {
        slot_size_ = 0;
        count_ = 0;
        return detail::call(devshare_pool_close(pool_.release()));
    }

#if DEVSHARE_HPP_EXCEPTIONS
    [[nodiscard]] static Pool create(Channel& channel, const Exporter& exporter, uint64_t slot_size, uint32_t count) {
        return detail::value(try_create(channel, exporter, slot_size, count));
    }
    [[nodiscard]] uint32_t id() const { return detail::value(try_id()); }
    [[nodiscard]] Slot acquire(std::chrono::milliseconds timeout) { return detail::value(try_acquire(timeout)); }
    void set_spin(std::chrono::microseconds spin) { detail::value(try_set_spin(spin)); }
    void send(Slot& slot, uint64_t peer, const TensorDesc& desc) { detail::value(try_send(slot, peer, desc)); }
    void release(Slot& slot) { detail::value(try_release(slot)); }
    [[nodiscard]] PoolInfo info() const { return detail::value(try_info()); }
    void close() { detail::value(try_close()); }
#endif

private:
    // The slot must be acquired from this pool.
    Result<void> check_slot(const Slot& slot, const char* who) const {
        const std::string w = std::string(who) + ": ";
        if (pool_ == nullptr) {
            return detail::error(DEVSHARE_STATUS_NULL_ARGUMENT, w + "the Pool is empty");
        }
        if (!slot) {
            return detail::error(DEVSHARE_STATUS_INVALID_ARGUMENT, w + "the Slot is empty (sent, released or moved from)");
        }
        if (slot.pool() != get()) {
            return detail::error(DEVSHARE_STATUS_INVALID_ARGUMENT,
                                 w + "slot " + std::to_string(slot.index()) + " belongs to another pool");
        }
        return {};
    }

    detail::closed_by<DevsharePool, &devshare_pool_close> pool_;
    detail::cleared<uint64_t> slot_size_;
    detail::cleared<uint32_t> count_;
};

}  // namespace devshare

#endif  // DEVSHARE_POOL_HPP
