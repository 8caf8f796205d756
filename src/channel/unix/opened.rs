//! The interprocess events a connection keeps open: each opened once, then waited on again for
//! every record its producer makes, instead of an open and a destroy per wait.
//!
//! Only where the producer promised (`PRODUCER_KEEPS_EVENTS` in its `WELCOME`) that an event
//! an `ITEM` or a `LEASE` carries stays alive under its handle bytes until the connection ends:
//! then the bytes can only ever name that event, and a copy opened here waits on its latest
//! record like a fresh open. A producer that breaks the promise only misorders its own
//! items. At most [`MAX_OPEN`] are kept per connection, the least recently used destroyed
//! first (it is opened again if it comes back); all are destroyed with the connection.

use crate::backend::{ImportRequest, OpenedEvent};
use crate::error::Result;
use crate::handle::{DevshareHandle, DEVSHARE_EVENT_HANDLE_SIZE};
use rustc_hash::FxHashMap;

/// Most events one connection keeps open (the producer keeps up to 128 per device alive).
pub(crate) const MAX_OPEN: usize = 256;

/// Which event: backend, the device it is waited on, its handle bytes.
type Key = (u16, i32, [u8; DEVSHARE_EVENT_HANDLE_SIZE]);

/// One connection's open events.
pub(super) struct OpenEvents {
    open: FxHashMap<Key, (Box<dyn OpenedEvent>, u64)>,
    /// Counts waits: an entry's number is its last use.
    tick: u64,
    /// The fork generation that opened them: a forked child's copies were never opened in its
    /// driver state, and are not destroyed there.
    generation: crate::fork::Stamp,
}

impl OpenEvents {
    pub(super) fn new() -> Self {
        OpenEvents { open: FxHashMap::default(), tick: 0, generation: crate::fork::Stamp::now() }
    }

    /// What [`crate::import::wait_for_producer`] does for `h`, with its event kept open here
    /// for the next wait on it.
    pub(super) fn wait_for_producer(&mut self, h: &DevshareHandle, req: &ImportRequest) -> Result<()> {
        if !crate::import::carries_event(h)? {
            return Ok(());
        }
        self.wait(h, req, || crate::backend::get(h.backend)?.open_event(h, req))
    }

    /// Wait on `h`'s event, opened with `open` unless it is open here already.
    fn wait(
        &mut self,
        h: &DevshareHandle,
        req: &ImportRequest,
        open: impl FnOnce() -> Result<Box<dyn OpenedEvent>>,
    ) -> Result<()> {
        let key = (h.backend, req.device.unwrap_or(h.device_index), h.event_handle);
        self.tick += 1;
        if let Some((ev, used)) = self.open.get_mut(&key) {
            *used = self.tick;
            let waited = ev.wait(req.stream);
            if waited.is_err() {
                self.open.remove(&key); // (opened afresh next time)
            }
            return waited;
        }
        let ev = open()?;
        ev.wait(req.stream)?;
        if self.open.len() >= MAX_OPEN {
            if let Some(oldest) = self.open.iter().min_by_key(|(_, (_, used))| *used).map(|(k, _)| *k) {
                self.open.remove(&oldest);
            }
        }
        self.open.insert(key, (ev, self.tick));
        Ok(())
    }
}

impl Drop for OpenEvents {
    fn drop(&mut self) {
        if !self.generation.is_current() {
            std::mem::take(&mut self.open).into_values().for_each(std::mem::forget);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// (waits, destroyed, the ids destroyed in order)
    type Counts = Arc<(AtomicUsize, AtomicUsize, std::sync::Mutex<Vec<u16>>)>;
    /// An event that counts its waits and its destruction (its id; whether its waits fail).
    struct Counted(u16, bool, Counts);
    impl OpenedEvent for Counted {
        fn wait(&self, _stream: *mut std::ffi::c_void) -> Result<()> {
            self.2 .0.fetch_add(1, Ordering::Relaxed);
            if self.1 {
                return Err(crate::error::Error::Internal("the wait failed".into()));
            }
            Ok(())
        }
    }
    impl Drop for Counted {
        fn drop(&mut self) {
            self.2 .1.fetch_add(1, Ordering::Relaxed);
            self.2 .2.lock().unwrap().push(self.0);
        }
    }

    fn handle(id: u16) -> DevshareHandle {
        let mut h = DevshareHandle::default();
        h.event_handle[..2].copy_from_slice(&id.to_le_bytes());
        h
    }

    #[test]
    fn an_event_is_opened_once_waited_on_each_time_and_the_least_recently_used_goes_past_the_bound() {
        let counts = Arc::new((AtomicUsize::new(0), AtomicUsize::new(0), Default::default()));
        let mut events = OpenEvents::new();
        let req = ImportRequest { device: Some(0), ..Default::default() };
        let mut opens = 0;
        let mut wait = |events: &mut OpenEvents, id: u16| {
            events
                .wait(&handle(id), &req, || {
                    opens += 1;
                    Ok(Box::new(Counted(id, false, counts.clone())))
                })
                .unwrap();
        };
        // Event 0 waited on 10 times: opened once.
        for _ in 0..10 {
            wait(&mut events, 0);
        }
        // MAX_OPEN - 1 more fill the bound; event 0 used again keeps it the most recent.
        for id in 1..MAX_OPEN as u16 {
            wait(&mut events, id);
        }
        wait(&mut events, 0);
        assert_eq!(events.open.len(), MAX_OPEN);
        assert_eq!(counts.1.load(Ordering::Relaxed), 0, "none destroyed within the bound");
        // One more: the least recently used (event 1) is destroyed, event 0 stays open.
        wait(&mut events, 9999);
        assert_eq!(events.open.len(), MAX_OPEN);
        assert_eq!(*counts.2.lock().unwrap(), vec![1u16], "the least recently used went");
        let before = counts.0.load(Ordering::Relaxed);
        wait(&mut events, 0);
        assert_eq!(counts.0.load(Ordering::Relaxed), before + 1);
        assert_eq!(opens, MAX_OPEN + 1, "each event opened once (event 0 of 11 waits included)");
        // 10,000 distinct events from a producer: the bound holds.
        let mut many = OpenEvents::new();
        for id in 0..10_000u16 {
            many.wait(&handle(id), &req, || Ok(Box::new(Counted(id, false, counts.clone())))).unwrap();
            assert!(many.open.len() <= MAX_OPEN);
        }
        drop(many);
        drop(events);
        assert_eq!(counts.1.load(Ordering::Relaxed), 10_000 + MAX_OPEN + 1, "every open destroyed at the end");
    }

    #[test]
    fn an_event_whose_wait_failed_is_not_kept() {
        let counts = Arc::new((AtomicUsize::new(0), AtomicUsize::new(0), Default::default()));
        let mut events = OpenEvents::new();
        let req = ImportRequest::default();
        assert!(events.wait(&handle(7), &req, || Ok(Box::new(Counted(7, true, counts.clone())))).is_err());
        assert!(events.open.is_empty(), "a first wait that failed keeps nothing");
        assert_eq!(counts.1.load(Ordering::Relaxed), 1);
    }
}
