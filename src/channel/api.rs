//! The channel types callers use: one [`Channel`], [`Pool`] and [`Connection`] for both kinds
//! of address — a Unix socket (a path or `@name`: [`LocalChannel`] and friends) or a remote
//! channel (`tcp://HOST:PORT`, [`super::tcp`]). What a remote channel cannot do (leases of
//! arbitrary exports, uid/pid admission, spinning, device streams) is refused by name.

use super::peers::PeerInfo;
use super::tcp::{self, RemoteChannel, RemoteConnection, RemotePool};
use super::unix::{LocalChannel, LocalConnection, LocalPool};
use crate::error::{Error, Result};
use crate::export::{Exporter, TensorDesc};
use crate::import::Import;
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::time::Duration;

fn remote_cannot(what: &str) -> Error {
    Error::Unsupported(format!("{what} is not available on a remote (tcp://) channel: it carries pool items only"))
}

/// The producer end of a channel. Dropping it closes it.
pub struct Channel(Kind);

enum Kind {
    Local(LocalChannel),
    Remote(RemoteChannel),
}

impl Channel {
    /// Listen on `address`: a path or `@name` (a Unix socket on this host), or `tcp://HOST:PORT`
    /// (a remote channel: consumers on other hosts, authenticated by the channel key file).
    pub fn listen(address: &str) -> Result<Channel> {
        Ok(Channel(if tcp::is_remote(address) {
            Kind::Remote(RemoteChannel::listen(address)?)
        } else {
            Kind::Local(LocalChannel::listen(address)?)
        }))
    }

    /// The address a remote channel listens on (its port, when `tcp://HOST:0` let the system
    /// choose); `None` for a Unix channel.
    pub fn tcp_address(&self) -> Result<Option<std::net::SocketAddr>> {
        match &self.0 {
            Kind::Local(_) => Ok(None),
            Kind::Remote(r) => r.local_addr().map(Some),
        }
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        match &self.0 {
            Kind::Local(c) => c.fd(),
            Kind::Remote(r) => r.fd(),
        }
    }

    pub fn restrict(&self, uids: &[u32], pids: &[i32]) -> Result<()> {
        match &self.0 {
            Kind::Local(c) => c.restrict(uids, pids),
            Kind::Remote(_) => Err(remote_cannot("admitting uids and pids (peers prove the channel key instead)")),
        }
    }

    pub fn trust_announced_pids(&self, trust: bool) -> Result<()> {
        match &self.0 {
            Kind::Local(c) => c.trust_announced_pids(trust),
            Kind::Remote(_) => Err(remote_cannot("trusting announced pids")),
        }
    }

    /// See [`LocalChannel::register`].
    pub fn register(&self, exp: &Exporter) -> Result<()> {
        match &self.0 {
            Kind::Local(c) => c.register(exp),
            Kind::Remote(_) => Err(remote_cannot("registering an export")),
        }
    }

    /// See [`LocalChannel::unregister`].
    pub fn unregister(&self, exp: &Exporter) -> Result<()> {
        match &self.0 {
            Kind::Local(c) => c.unregister(exp),
            Kind::Remote(_) => Err(remote_cannot("registering an export")),
        }
    }

    pub fn service(&self, timeout: Option<Duration>) -> Result<()> {
        match &self.0 {
            Kind::Local(c) => c.service(timeout),
            Kind::Remote(r) => r.service(timeout),
        }
    }

    /// See [`LocalChannel::set_spin`].
    pub fn set_spin(&self, spin: Duration) -> Result<()> {
        match &self.0 {
            Kind::Local(c) => c.set_spin(spin),
            Kind::Remote(_) => Err(remote_cannot("spinning")),
        }
    }

    pub fn wait_peers(&self, n: usize, timeout: Option<Duration>) -> Result<()> {
        match &self.0 {
            Kind::Local(c) => c.wait_peers(n, timeout),
            Kind::Remote(r) => r.wait_peers(n, timeout),
        }
    }

    pub fn peer_ids(&self) -> Result<Vec<u64>> {
        match &self.0 {
            Kind::Local(c) => c.peer_ids(),
            Kind::Remote(r) => r.peer_ids(),
        }
    }

    /// What is known about a connected peer (a remote peer has no pid, uid or gid here: 0).
    pub fn peer_info(&self, id: u64) -> Result<PeerInfo> {
        match &self.0 {
            Kind::Local(c) => c.peer_info(id),
            Kind::Remote(r) => r.peer_info(id),
        }
    }

    pub fn send(&self, peer: u64, exp: &Exporter, desc: &TensorDesc<'_>) -> Result<()> {
        match &self.0 {
            Kind::Local(c) => c.send(peer, exp, desc),
            Kind::Remote(_) => Err(remote_cannot("a leased reference (devshare_channel_send)")),
        }
    }

    pub fn send_batch(&self, peer: u64, items: &[(&Exporter, TensorDesc<'_>)]) -> Result<()> {
        self.send_named(peer, items, &[])
    }

    /// [`Self::send_batch`] with a name for each lease (`names` empty, or one per item; `None`:
    /// that lease has none); consumers (1.11 and later) read them with the leases.
    pub fn send_named(&self, peer: u64, items: &[(&Exporter, TensorDesc<'_>)], names: &[Option<&str>]) -> Result<()> {
        match &self.0 {
            Kind::Local(c) => c.send_named(peer, items, names),
            Kind::Remote(_) => Err(remote_cannot("a batch of leased references")),
        }
    }

    pub fn disconnect(&self, peer: u64) -> Result<()> {
        match &self.0 {
            Kind::Local(c) => c.disconnect(peer),
            Kind::Remote(r) => r.disconnect(peer),
        }
    }

    pub fn close(&self) {
        match &self.0 {
            Kind::Local(c) => c.close(),
            Kind::Remote(r) => r.close(),
        }
    }

    /// A pool of `count` slots of `slot_size` bytes at the start of `exp`'s range.
    pub fn pool(&self, exp: Arc<Exporter>, slot_size: u64, count: u32) -> Result<Pool> {
        Ok(Pool(match &self.0 {
            Kind::Local(c) => PoolKind::Local(c.pool(exp, slot_size, count)?),
            Kind::Remote(r) => PoolKind::Remote(r.pool(exp, slot_size, count)?),
        }))
    }
}

/// A pool of fixed-address slots on a channel.
pub struct Pool(PoolKind);

enum PoolKind {
    Local(LocalPool),
    Remote(RemotePool),
}

impl Pool {
    pub fn acquire(&self, timeout: Option<Duration>) -> Result<(u32, *mut u8)> {
        match &self.0 {
            PoolKind::Local(p) => p.acquire(timeout),
            PoolKind::Remote(p) => p.acquire(timeout),
        }
    }

    pub fn set_spin(&self, spin: Duration) -> Result<()> {
        match &self.0 {
            PoolKind::Local(p) => p.set_spin(spin),
            PoolKind::Remote(_) => Err(remote_cannot("spinning")),
        }
    }

    pub fn release(&self, slot: u32) -> Result<()> {
        match &self.0 {
            PoolKind::Local(p) => p.release(slot),
            PoolKind::Remote(p) => p.release(slot),
        }
    }

    pub fn send(&self, slot: u32, peer: u64, desc: &TensorDesc<'_>) -> Result<()> {
        match &self.0 {
            PoolKind::Local(p) => p.send(slot, peer, desc),
            PoolKind::Remote(p) => p.send(slot, peer, desc),
        }
    }

    pub fn id(&self) -> u32 {
        match &self.0 {
            PoolKind::Local(p) => p.id(),
            PoolKind::Remote(p) => p.id(),
        }
    }

    pub fn info(&self) -> Result<(u64, u32, u32)> {
        match &self.0 {
            PoolKind::Local(p) => p.info(),
            PoolKind::Remote(p) => p.info(),
        }
    }

    /// Bytes per slot.
    pub fn slot_size(&self) -> Result<u64> {
        match &self.0 {
            PoolKind::Local(p) => Ok(p.slot_size()),
            PoolKind::Remote(p) => p.info().map(|(s, ..)| s),
        }
    }

    /// Close the pool (attached consumers are told).
    pub fn close(self) {}
}

/// The consumer end of a channel.
pub struct Connection(ConnKind);

enum ConnKind {
    Local(LocalConnection),
    Remote(RemoteConnection),
}

impl Connection {
    /// Connect to the channel at `address` (a path, `@name` or `tcp://HOST:PORT`).
    pub fn connect(address: &str, timeout: Option<Duration>) -> Result<Connection> {
        Ok(Connection(if tcp::is_remote(address) {
            ConnKind::Remote(RemoteConnection::connect(address, timeout)?)
        } else {
            ConnKind::Local(LocalConnection::connect(address, timeout)?)
        }))
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        match &self.0 {
            ConnKind::Local(c) => c.fd(),
            ConnKind::Remote(c) => c.fd(),
        }
    }

    pub fn peer_id(&self) -> u64 {
        match &self.0 {
            ConnKind::Local(c) => c.peer_id(),
            ConnKind::Remote(c) => c.peer_id(),
        }
    }

    pub fn producer_pid(&self) -> i32 {
        match &self.0 {
            ConnKind::Local(c) => c.producer_pid(),
            ConnKind::Remote(c) => c.producer_pid(),
        }
    }

    /// How items reach this connection, as [`PeerInfo::transport`] numbers it: 0 a Unix
    /// channel, 1 a remote channel's authenticated connection, 2 UCX.
    pub fn transport(&self) -> u32 {
        match &self.0 {
            ConnKind::Local(_) => 0,
            ConnKind::Remote(c) => c.data_path().reported(),
        }
    }

    pub fn set_spin(&self, spin: Duration) -> Result<()> {
        match &self.0 {
            ConnKind::Local(c) => c.set_spin(spin),
            ConnKind::Remote(_) => Err(remote_cannot("spinning")),
        }
    }

    pub fn set_stream(&self, stream: *mut std::ffi::c_void) -> Result<()> {
        match &self.0 {
            ConnKind::Local(c) => {
                c.set_stream(stream);
                Ok(())
            }
            ConnKind::Remote(_) => Err(remote_cannot("a device stream")),
        }
    }

    pub fn recv(&self, timeout: Option<Duration>) -> Result<Import> {
        match &self.0 {
            ConnKind::Local(c) => c.recv(timeout),
            ConnKind::Remote(c) => c.recv(timeout),
        }
    }

    /// Give back the leases of `imports` (received on any connection) in one call: a
    /// connection's leases go to its producer in as few messages as it reads (one per 8192 to a
    /// 1.12 producer), so that a batch of any size fits its socket while it is not reading. Pool
    /// items go back as [`Import::give_back`] does; imports that did not come over a channel,
    /// and what was given back before, are skipped. The imports stay mapped until released.
    pub fn give_back_all<'a>(imports: impl IntoIterator<Item = &'a Import>) {
        super::item::give_back_all(imports)
    }

    /// [`Self::recv`], boxed (what the C API hands out).
    pub(crate) fn recv_boxed(&self, timeout: Option<Duration>) -> Result<Box<Import>> {
        match &self.0 {
            ConnKind::Local(c) => c.recv_boxed(timeout),
            ConnKind::Remote(c) => c.recv(timeout).map(Box::new),
        }
    }

    pub fn close(&self) {
        match &self.0 {
            ConnKind::Local(c) => c.close(),
            ConnKind::Remote(c) => c.close(),
        }
    }
}
