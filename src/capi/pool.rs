//! Pools (`crate::channel::Pool`): fixed-address slots on a producer's channel, acquired,
//! filled and sent to a peer (or given back unsent) and returned by the consumer's release.

use super::channel::DevshareChannel;
use super::export::{tensor_desc_from_c, DevshareExporter, DevshareTensorDesc};
use super::{arg, arg_mut, boundary, timeout};
use crate::channel::Pool;
use crate::export::TensorDesc;
use std::ffi::c_void;

/// A pool of fixed-address slots on a channel (opaque). Thread-safe like `DevshareChannel`.
pub struct DevsharePool(Pool);

/// Make a pool of `count` slots of `slot_size` bytes, back to back from the start of
/// `exporter`'s range (one allocation: `devshare_channel_host_alloc`, or an ACL or CUDA export).
/// The pool keeps the export alive (closing the exporter is allowed; the memory goes with the
/// pool). A consumer imports the whole allocation once, with its first item, so **every slot
/// keeps one address in the consumer for the pool's life** — the fixed addresses that captured
/// device graphs (aclgraph, CUDA graphs) replay on. Each attached consumer counts as one
/// outstanding reference of the export until it detaches (after `devshare_pool_close`, once it
/// released its items) or disconnects. `count` is at most `DEVSHARE_POOL_MAX_SLOTS` (a larger
/// one is `DEVSHARE_STATUS_BAD_SIZE`); the slots' bookkeeping is allocated when the pool is
/// made, and a failure to get it is a status too.
#[no_mangle]
pub unsafe extern "C" fn devshare_pool_create(
    channel: *mut DevshareChannel,
    exporter: *const DevshareExporter,
    slot_size: u64,
    count: u32,
    out: *mut *mut DevsharePool,
) -> i32 {
    boundary("devshare_pool_create", || {
        let ch = &ffi!(arg(channel, "channel"))?.0;
        let e = ffi!(arg(exporter, "exporter"))?.0.clone();
        let out = ffi!(arg_mut(out, "out"))?;
        let pool = ch.pool(e, slot_size, count)?;
        *out = Box::into_raw(Box::new(DevsharePool(pool)));
        Ok(())
    })
}

/// Let `devshare_pool_acquire` poll for a returned slot for up to `spin_us` microseconds
/// before it sleeps: for a producer thread that owns a CPU core, a return is then taken within
/// about a microsecond instead of after the scheduler wakes the thread (which costs tens of
/// microseconds when producer and consumer run on different cores). It burns its core while it
/// spins. 0 (the default) adds no spin of its own: the acquire still polls for up to 50 µs
/// (`DEVSHARE_ADAPTIVE_SPIN_US`) while a consumer is awake on another CPU, less after such
/// polls found nothing (docs/channels.md, "The adaptive spin"); at most
/// `DEVSHARE_MAX_SPIN_US`.
#[no_mangle]
pub unsafe extern "C" fn devshare_pool_set_spin(pool: *mut DevsharePool, spin_us: u32) -> i32 {
    boundary("devshare_pool_set_spin", || {
        ffi!(arg(pool, "pool"))?.0.set_spin(std::time::Duration::from_micros(u64::from(spin_us)))
    })
}

/// The longest spin `devshare_pool_set_spin`, `devshare_connection_set_spin` and
/// `devshare_channel_set_spin` accept (1 s).
pub const DEVSHARE_MAX_SPIN_US: u32 = 1_000_000;

/// Take a free slot: `*slot` receives its index, `*ptr` (may be NULL) its address in this
/// process. While every slot is out, waits for one to come back, serving the channel
/// (backpressure): `DEVSHARE_STATUS_TIMEOUT` after `timeout_ms` (negative: wait forever).
/// Waiting forever, one thread of the channel at a time sleeps without a timer, woken by what
/// arrives and by what other threads of this process do to the channel (a slot released, a
/// pool or the channel closed); other threads waiting meanwhile look again every 5 ms.
#[no_mangle]
pub unsafe extern "C" fn devshare_pool_acquire(
    pool: *mut DevsharePool,
    timeout_ms: i32,
    slot: *mut u32,
    ptr: *mut *mut c_void,
) -> i32 {
    boundary("devshare_pool_acquire", || {
        let p = &ffi!(arg(pool, "pool"))?.0;
        let slot = ffi!(arg_mut(slot, "slot"))?;
        let (s, addr) = p.acquire(timeout(timeout_ms))?;
        *slot = s;
        if let Some(out) = ffi!(ptr.as_mut()) {
            *out = addr.cast();
        }
        Ok(())
    })
}

/// The pool's id on its channel (> 0): what `devshare_import_pool_slot` reports to consumers for
/// its items.
#[no_mangle]
pub unsafe extern "C" fn devshare_pool_id(pool: *const DevsharePool, id: *mut u32) -> i32 {
    boundary("devshare_pool_id", || {
        let p = &ffi!(arg(pool, "pool"))?.0;
        *ffi!(arg_mut(id, "id"))? = p.id();
        Ok(())
    })
}

/// Hand acquired slot `slot` to `peer`, describing the tensor in it: `desc->storage_offset` is
/// relative to the slot, `storage_size` `DEVSHARE_STORAGE_TO_END` means the rest of the slot;
/// `desc` NULL sends the whole slot as bytes. Device work on `desc->stream` is synchronised
/// first — or, with `DEVSHARE_SHARE_EVENT` (device pools), an interprocess event is recorded on
/// it and travels with the item (64 bytes more), and the consumer's `devshare_connection_recv`
/// waits on it; the event is kept until the slot comes back. Only a small message travels; the first item to a peer also attaches it (one import
/// of the whole allocation). The slot comes back when the peer releases the item's import or
/// disconnects. Sending a slot that is not acquired is `DEVSHARE_STATUS_INVALID_ARGUMENT`.
/// Like every producer send it never waits for the peer (see `devshare_channel_send`).
#[no_mangle]
pub unsafe extern "C" fn devshare_pool_send(
    pool: *mut DevsharePool,
    slot: u32,
    peer: u64,
    desc: *const DevshareTensorDesc,
) -> i32 {
    boundary("devshare_pool_send", || {
        let p = &ffi!(arg(pool, "pool"))?.0;
        match ffi!(desc.as_ref()) {
            None => {
                let shape = [p.slot_size()? as i64];
                p.send(slot, peer, &TensorDesc { shape: &shape, ..Default::default() })
            }
            Some(_) => {
                let d = ffi!(super::abi::read_input(desc, "desc"))?;
                p.send(slot, peer, &ffi!(tensor_desc_from_c(&d))?)
            }
        }
    })
}

/// Give back acquired slot `slot` without sending it. A slot that is not acquired (free, or out
/// with a consumer) is `DEVSHARE_STATUS_INVALID_ARGUMENT`, and nothing changes.
#[no_mangle]
pub unsafe extern "C" fn devshare_pool_release(pool: *mut DevsharePool, slot: u32) -> i32 {
    boundary("devshare_pool_release", || ffi!(arg(pool, "pool"))?.0.release(slot))
}

/// Slot size, slot count and how many slots are free now (each out-pointer may be NULL).
#[no_mangle]
pub unsafe extern "C" fn devshare_pool_info(
    pool: *const DevsharePool,
    slot_size: *mut u64,
    count: *mut u32,
    free_slots: *mut u32,
) -> i32 {
    boundary("devshare_pool_info", || {
        let (s, c, f) = ffi!(arg(pool, "pool"))?.0.info()?;
        if let Some(o) = ffi!(slot_size.as_mut()) {
            *o = s;
        }
        if let Some(o) = ffi!(count.as_mut()) {
            *o = c;
        }
        if let Some(o) = ffi!(free_slots.as_mut()) {
            *o = f;
        }
        Ok(())
    })
}

/// Close the pool and free it: attached consumers are told; each detaches once it released its
/// items. NULL is a no-op.
#[no_mangle]
pub unsafe extern "C" fn devshare_pool_close(pool: *mut DevsharePool) -> i32 {
    boundary("devshare_pool_close", || {
        if !pool.is_null() {
            // SAFETY: pool came from Box::into_raw in devshare_pool_create; the caller gives it up.
            drop(ffi!(Box::from_raw(pool)));
        }
        Ok(())
    })
}
