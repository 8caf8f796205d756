//! Channels, leases and pools: devshare-to-devshare handoff over a Unix domain socket.
//!
//! - **Channel.** A producer listens on a `SOCK_SEQPACKET` Unix socket (a path, created mode
//!   0600, or a Linux abstract name `@name`). Each consumer's credentials come from
//!   `SO_PEERCRED`: by default only this process's effective uid may connect; the producer may
//!   replace the uid set and name the pids it admits. A consumer sends its bare tgid in the
//!   handshake and the producer whitelists it on every ACL export it sends it, so the pid check
//!   stays on without a manual step. The consumer in turn accepts only a producer of its own uid
//!   (or root).
//! - **No hidden threads.** Nothing runs in the background: the producer's work (accepting,
//!   taking releases and returns, noticing hang-ups) happens in [`Channel::service`] and in the
//!   calls that block for it ([`Pool::acquire`], [`Channel::wait_peers`], and
//!   [`crate::export::Exporter::wait`], which serves the channels its export was sent over).
//!   The descriptors ([`Channel::fd`], an epoll set; [`Connection::fd`], the socket) fit a
//!   caller's own poll/epoll/asio loop.
//! - **Host memory** sent over a channel is a sealed memfd ([`memfd`]) passed with
//!   `SCM_RIGHTS`: no name in `/dev/shm`, nothing to guess or leave behind.
//! - **Leases.** Every reference sent over a connection belongs to it: released by the
//!   consumer, or returned at once when the connection closes for any reason (the producer sees
//!   the hang-up the moment the consumer's process dies). The export counts leases in its
//!   outstanding references. When the producer dies, consumers get `Closed` from the channel and
//!   keep their mappings until they release them.
//! - **Pools.** `count` slots of `slot_size` bytes in one export. A consumer imports the whole
//!   allocation once, on its first item (the `ATTACH` message), so every slot keeps one address
//!   for the pool's life — what captured device graphs replay on. Per item only a small message
//!   travels each way (`ITEM`, `RETURN`); when every slot is out, `acquire` waits (backpressure).
//!
//! Thread safety: a channel, a pool and a connection may be used from several threads; their
//! state is behind one mutex each. The import of an item is an ordinary import, released on any
//! thread.

pub mod consumer;
pub(crate) mod memfd;
pub mod producer;
pub(crate) mod wire;

pub use consumer::Connection;
pub use producer::{Channel, PeerInfo, Pool};

use producer::ChannelShared;
use std::cell::RefCell;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// The channel leases of one export: how many are out, and the channels to serve while waiting
/// for them.
#[derive(Default)]
pub struct LeaseBook {
    count: AtomicU64,
    channels: Mutex<Vec<Weak<ChannelShared>>>,
}

impl LeaseBook {
    /// References leased and not returned.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Acquire)
    }

    pub(crate) fn add(&self, ch: &Arc<ChannelShared>) {
        self.count.fetch_add(1, Ordering::AcqRel);
        let mut chans = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        chans.retain(|w| w.strong_count() > 0);
        if !chans.iter().any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(ch))) {
            chans.push(Arc::downgrade(ch));
        }
    }

    pub(crate) fn sub(&self, n: u64) {
        self.count.fetch_sub(n, Ordering::AcqRel);
    }

    /// Serve the channels this export was sent over, waiting at most `pause` on the first;
    /// false when there are none (the caller sleeps instead).
    pub(crate) fn serve_channels(&self, pause: Duration) -> bool {
        let live: Vec<Arc<ChannelShared>> = {
            let chans = self.channels.lock().unwrap_or_else(|p| p.into_inner());
            chans.iter().filter_map(Weak::upgrade).collect()
        };
        let mut served = false;
        for (i, ch) in live.iter().enumerate() {
            served |= ch.service(Some(if i == 0 { pause } else { Duration::ZERO })).is_ok();
        }
        served
    }
}

thread_local! {
    /// Segment fds that arrived over a channel next to the handle being imported on this thread:
    /// (producer pid, the producer's fd number) -> our descriptor.
    static PASSED_FDS: RefCell<Vec<((i32, i32), OwnedFd)>> = const { RefCell::new(Vec::new()) };
}

/// The descriptor passed over a channel for the producer's fd `fd`, if the import under way on
/// this thread received one (the backend imports it instead of taking it with `pidfd_getfd`).
pub(crate) fn passed_fd(pid: i32, fd: i32) -> Option<OwnedFd> {
    PASSED_FDS.with(|p| {
        let mut p = p.borrow_mut();
        let i = p.iter().position(|(k, _)| *k == (pid, fd))?;
        Some(p.swap_remove(i).1)
    })
}

/// Run `f` with `fds` available to [`passed_fd`]; whatever it did not take is closed after.
pub(crate) fn with_passed_fds<T>(fds: Vec<((i32, i32), OwnedFd)>, f: impl FnOnce() -> T) -> T {
    struct Clear;
    impl Drop for Clear {
        fn drop(&mut self) {
            PASSED_FDS.with(|p| p.borrow_mut().clear());
        }
    }
    PASSED_FDS.with(|p| *p.borrow_mut() = fds);
    let _clear = Clear;
    f()
}
