//! The channel's interprocess events: one per stream of a send, reused, not made per share.
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
//! would then hold up whoever waits on that event next — only itself. The pool keeps at most
//! [`IDLE_EVENTS`] events per consumer and device and destroys the rest; a consumer's go when
//! it disconnects, and the channel's close destroys what it holds.

use crate::backend::IpcEvent;
use crate::error::Result;
use crate::export::Exporter;
use crate::handle::DEVSHARE_EVENT_HANDLE_SIZE;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, Weak};

/// Idle events the pool keeps per (consumer, backend, device): as many as sends whose leases
/// are out at once on a busy channel; beyond that an event that comes back is destroyed.
pub(super) const IDLE_EVENTS: usize = 64;

/// What an event belongs to: the consumer (peer id) it is sent to, and the backend and device
/// of the allocations it was recorded for.
type Key = (u64, u16, i32);

/// The channel's idle events.
#[derive(Default)]
pub(crate) struct EventPool {
    idle: Mutex<Vec<(Key, Box<dyn IpcEvent>)>>,
}

impl EventPool {
    /// An event for shares of `exp` made now for consumer `peer`, recorded on `stream`: an idle
    /// one of that consumer and device recorded again, or a new one.
    pub(super) fn record(
        self: &Arc<Self>,
        peer: u64,
        exp: &Exporter,
        stream: *mut c_void,
    ) -> Result<Arc<ChannelEvent>> {
        let (backend, device) = exp.event_key();
        let key = (peer, backend, device);
        let idle = {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            idle.iter().rposition(|(k, _)| *k == key).map(|i| idle.swap_remove(i).1)
        };
        let event = match idle {
            // A failed record destroys the event (it is dropped here).
            Some(ev) => ev.record_again(stream).map(|()| ev)?,
            None => exp.record_event(stream)?,
        };
        Ok(Arc::new(ChannelEvent { event: Some(event), key, pool: Arc::downgrade(self) }))
    }

    /// Destroy the idle events of consumer `peer` (it disconnected).
    pub(super) fn forget(&self, peer: u64) {
        let gone: Vec<_> = {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            let (gone, kept) = std::mem::take(&mut *idle).into_iter().partition(|(k, _)| k.0 == peer);
            *idle = kept;
            gone
        };
        drop(gone); // (destroyed outside the pool's lock)
    }

    /// Destroy every idle event (the channel closes).
    pub(super) fn clear(&self) {
        let idle = std::mem::take(&mut *self.idle.lock().unwrap_or_else(|p| p.into_inner()));
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
        let mut idle = pool.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.iter().filter(|(k, _)| *k == self.key).count() < IDLE_EVENTS {
            idle.push((self.key, event));
        }
    }
}
