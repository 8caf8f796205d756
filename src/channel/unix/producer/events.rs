//! The channel's interprocess events: one per stream of a send, reused, not made per share, and
//! kept alive for as long as their consumer is connected.
//!
//! A device share tells its consumer what to wait for with an interprocess event recorded on
//! the producer's stream. Making one costs a create, a handle query and later a destroy; a
//! batch of 291 tensors on one stream needs only one record. So a send records one event per
//! (backend, device, stream) of its tensors, every lease of the send holds it
//! ([`ChannelEvent`], shared), and when the last of those leases comes back the event goes to
//! the channel's [`EventPool`] instead of being destroyed; the next send records it again.
//!
//! Why reuse is safe: an event goes back only when every lease that carried it came back, so
//! every consumer that was to wait on that record has waited (its receive waits before it
//! returns) or is gone. A consumer that gives a lease back without having received it can
//! only make its own waits early. An event is only ever reused for the consumer it was first
//! sent to: a consumer holds its events' handles and could record its own work on one, which
//! would then hold up whoever waits on that event next — only itself.
//!
//! Why they are kept (1.19): a consumer that opens an event once and waits on it again for each
//! later record saves an open and a destroy per wait, but only if the bytes it opened never name
//! another event while it holds them. So an event made for a consumer is never destroyed while
//! that consumer is connected (`WELCOME` says so: `PRODUCER_KEEPS_EVENTS`), and at most
//! [`KEPT_EVENTS`] exist per (consumer, backend, device): a send that needs one more while all
//! are out with their leases synchronises its stream instead. A consumer's events are destroyed
//! once it disconnected (and those still out when their leases come back), the channel's
//! when it closes.

use crate::backend::IpcEvent;
use crate::error::Result;
use crate::export::Exporter;
use crate::handle::DEVSHARE_EVENT_HANDLE_SIZE;
use rustc_hash::FxHashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, Weak};

/// Events that exist at once per (consumer, backend, device): as many sends with their leases
/// out at once, on one device, as a consumer is likely to hold; a send past them synchronises
/// its stream instead of recording an event.
pub(crate) const KEPT_EVENTS: usize = 128;

/// What an event belongs to: the consumer (peer id) it is sent to, and the backend and device
/// of the allocations it was recorded for.
type Key = (u64, u16, i32);

/// The channel's events: those idle, and how many exist per key.
#[derive(Default)]
pub(crate) struct EventPool {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    idle: Vec<(Key, Box<dyn IpcEvent>)>,
    /// Events that exist (idle or out) per key of a consumer still connected; a key not here is
    /// a consumer's that went, whose events are destroyed as they come back.
    made: FxHashMap<Key, usize>,
}

impl EventPool {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl EventPool {
    /// An event for shares of `exp` made now for consumer `peer`, recorded on `stream`: an idle
    /// one of that consumer and device recorded again, or a new one; `None` when that consumer
    /// already has [`KEPT_EVENTS`] out on that device (the caller synchronises instead).
    pub(super) fn record(
        self: &Arc<Self>,
        peer: u64,
        exp: &Exporter,
        stream: *mut c_void,
    ) -> Result<Option<Arc<ChannelEvent>>> {
        let (backend, device) = exp.event_key();
        let key = (peer, backend, device);
        let idle = {
            let mut inner = self.lock();
            match inner.idle.iter().rposition(|(k, _)| *k == key) {
                Some(i) => Some(inner.idle.swap_remove(i).1),
                None => {
                    let made = inner.made.entry(key).or_insert(0);
                    if *made >= KEPT_EVENTS {
                        return Ok(None);
                    }
                    *made += 1; // (taken back below if it cannot be made)
                    None
                }
            }
        };
        let event = match idle {
            Some(ev) => match ev.record_again(stream) {
                Ok(()) => ev,
                Err(e) => {
                    // Not destroyed: its consumer may hold it open, and a new event could get
                    // its bytes. It stays idle, as it was.
                    self.lock().idle.push((key, ev));
                    return Err(e);
                }
            },
            None => match exp.record_event(stream) {
                Ok(ev) => ev,
                Err(e) => {
                    if let Some(n) = self.lock().made.get_mut(&key) {
                        *n -= 1;
                    }
                    return Err(e);
                }
            },
        };
        Ok(Some(Arc::new(ChannelEvent { event: Some(event), key, pool: Arc::downgrade(self) })))
    }

    /// Destroy the idle events of consumer `peer` (it disconnected), and those still out as
    /// they come back.
    pub(super) fn forget(&self, peer: u64) {
        let gone: Vec<_> = {
            let mut inner = self.lock();
            inner.made.retain(|k, _| k.0 != peer);
            let (gone, kept) = std::mem::take(&mut inner.idle).into_iter().partition(|(k, _)| k.0 == peer);
            inner.idle = kept;
            gone
        };
        drop(gone); // (destroyed outside the pool's lock)
    }

    /// Destroy every idle event (the channel closes); those still out are destroyed as they
    /// come back.
    pub(super) fn clear(&self) {
        let idle = {
            let mut inner = self.lock();
            inner.made.clear();
            std::mem::take(&mut inner.idle)
        };
        drop(idle);
    }
}

/// One record of an event, held by every lease (or pool slot) whose share carries it; the last
/// holder gives the event back to its pool.
pub(crate) struct ChannelEvent {
    event: Option<Box<dyn IpcEvent>>,
    key: Key,
    pool: Weak<EventPool>,
}

impl ChannelEvent {
    /// The 64 handle bytes the shares carry.
    pub(super) fn handle(&self) -> [u8; DEVSHARE_EVENT_HANDLE_SIZE] {
        self.event.as_ref().map_or([0; DEVSHARE_EVENT_HANDLE_SIZE], |e| e.handle())
    }
}

impl Drop for ChannelEvent {
    fn drop(&mut self) {
        let (Some(event), Some(pool)) = (self.event.take(), self.pool.upgrade()) else {
            return; // the channel is gone: the event is destroyed
        };
        let mut inner = pool.lock();
        if inner.made.contains_key(&self.key) {
            inner.idle.push((self.key, event));
        } else {
            drop(inner);
            drop(event); // its consumer went: destroyed (outside the pool's lock)
        }
    }
}
