//! A producer's consumers, for both transports: [`PeerInfo`] (one connected consumer as
//! `Channel::peer_info` and `devshare_channel_peer_info` report it), the peer set with its
//! lookups by id ([`PeerSet`]), and [`wait_peers`].

use super::admission::{self, Admission};
use crate::error::{Error, Result};
use std::time::{Duration, Instant};

/// What the library knows about one connected consumer.
#[derive(Clone, Debug, Default)]
pub struct PeerInfo {
    pub id: u64,
    /// The peer's process id, from `SO_PEERCRED` (as this process's pid namespace sees it).
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
    /// The pid the peer said it has (its bare tgid). ACL exports sent to it are whitelisted
    /// for it when it is the kernel's `pid`, or when the channel trusts announced pids
    /// ([`super::Channel::trust_announced_pids`]); otherwise for `pid`.
    pub tgid: i32,
    /// References leased to it and pools it attached, not yet returned.
    pub leases: u64,
    /// Pool slots it holds now (items sent to it and not given back).
    pub slots: u64,
    /// Messages from it that were refused (a slot it does not hold, a lease it was not given...).
    pub protocol_errors: u64,
    /// How items reach it: 0 a Unix channel (shared memory), 1 a remote channel's
    /// authenticated connection (the stream path), 2 UCX.
    pub transport: u32,
}

/// A producer's peer as [`PeerSet`] sees it: an id, and whether it is connected (its handshake
/// done, and, where the transport says so, not being disconnected).
pub(crate) trait Peer {
    /// Where a connection comes from, for the handshake places per source (a pid, an address).
    type Source: PartialEq + Copy;
    /// The group a source's waiting connections are also counted in (an IPv6 /64); by default
    /// the source itself.
    fn group(source: Self::Source) -> Self::Source {
        source
    }
    fn id(&self) -> u64;
    fn ready(&self) -> bool;
    /// Its source and when it was accepted, while it waits for its handshake (and is not being
    /// disconnected); `None` otherwise.
    fn waiting(&self) -> Option<(Self::Source, Instant)>;
}

/// A producer's peers, oldest first, for both transports: the list itself (a `Vec`, which it
/// derefs to) and the lookups by id that `peer_ids`, `peer_info`, `send` and `wait_peers` share.
pub(crate) struct PeerSet<P>(Vec<P>);

impl<P> Default for PeerSet<P> {
    fn default() -> Self {
        PeerSet(Vec::new())
    }
}

impl<P> std::ops::Deref for PeerSet<P> {
    type Target = Vec<P>;
    fn deref(&self) -> &Vec<P> {
        &self.0
    }
}

impl<P> std::ops::DerefMut for PeerSet<P> {
    fn deref_mut(&mut self) -> &mut Vec<P> {
        &mut self.0
    }
}

fn not_connected(id: u64) -> Error {
    Error::NotFound(format!("peer {id} is not connected to this channel"))
}

impl<P: Peer> PeerSet<P> {
    /// The connected peer `id`.
    pub(crate) fn get(&self, id: u64) -> Result<&P> {
        self.0.iter().find(|p| p.id() == id && p.ready()).ok_or_else(|| not_connected(id))
    }

    /// The index of the connected peer `id`.
    pub(crate) fn index(&self, id: u64) -> Result<usize> {
        self.0.iter().position(|p| p.id() == id && p.ready()).ok_or_else(|| not_connected(id))
    }

    /// How many peers are connected.
    pub(crate) fn ready_count(&self) -> usize {
        self.0.iter().filter(|p| p.ready()).count()
    }

    /// Whether a new connection from `source` gets a place to wait for its handshake
    /// ([`admission::admit`] over the peers that wait now).
    pub(crate) fn admit(&self, source: P::Source) -> Admission {
        admission::admit(
            self.0.iter().enumerate().filter_map(|(i, p)| p.waiting().map(|(s, t)| (i, s, t))),
            source,
            P::group,
        )
    }

    /// The ids of the connected peers, oldest first.
    pub(crate) fn ready_ids(&self) -> Vec<u64> {
        self.0.iter().filter(|p| p.ready()).map(|p| p.id()).collect()
    }
}

/// Serve a channel until `n` peers are connected, for both transports: `ready` counts them,
/// `service` serves the channel for at most the time given. Once the time is up, what already
/// arrived is served (without waiting) and the count looked at once more.
pub(crate) fn wait_peers(
    n: usize,
    timeout: Option<Duration>,
    mut ready: impl FnMut() -> Result<usize>,
    mut service: impl FnMut(Option<Duration>) -> Result<()>,
) -> Result<()> {
    let deadline = timeout.map(|t| Instant::now() + t);
    let mut last_look = false;
    loop {
        let ready = ready()?;
        if ready >= n {
            return Ok(());
        }
        if last_look {
            return Err(Error::Timeout(format!("{ready} of {n} peers connected")));
        }
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        last_look = left.is_some_and(|l| l.is_zero());
        service(left)?;
    }
}

/// How long a producer's serve pass may sleep in its epoll set, for both transports: the
/// caller's `timeout` (`None`: no limit), cut short at the next peer `deadline` (a handshake or
/// send-patience deadline), as epoll's time.
pub(crate) fn serve_wait(timeout: Option<Duration>, deadline: Option<Instant>) -> Option<rustix::event::Timespec> {
    let wait = match (timeout, deadline) {
        (t, None) => t,
        (t, Some(d)) => {
            let left = d.saturating_duration_since(Instant::now());
            Some(t.map_or(left, |t| t.min(left)))
        }
    };
    wait.map(|d| rustix::event::Timespec { tv_sec: d.as_secs() as i64, tv_nsec: i64::from(d.subsec_nanos()) })
}
