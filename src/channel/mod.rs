//! Channels, leases and pools: devshare-to-devshare handoff over a Unix domain socket
//! (`unix/`), or across hosts over a key-authenticated TCP connection (`tcp://HOST:PORT`,
//! `tcp/`). The two transports never name each other; what they share lives here: the types
//! callers use (`api.rs`), the typed messages (`wire.rs`), the limits (`limits.rs`), what a
//! producer knows of its peers (`peers.rs`), handshake places per source (`admission.rs`), and
//! what travels with an item and how its lease comes back (`item.rs`).
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
//!   The descriptors ([`Channel::fd`] and [`Connection::fd`], epoll sets) fit a caller's own
//!   poll/epoll/asio loop.
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
//!   Between peers that both read it, pool items and their returns travel in a
//!   shared-memory ring per peer instead of the socket ([`ring`]).
//!
//! Thread safety: a channel, a pool and a connection may be used from several threads; their
//! state is behind one mutex each. The import of an item is an ordinary import, released on any
//! thread.

mod admission;
mod api;
pub(crate) mod item;
pub mod limits;
mod peers;
mod tcp;
mod unix;
pub(crate) mod wire;

pub use api::{Channel, Connection, Pool};
pub use peers::PeerInfo;
pub use tcp::ucx;

/// How this process's remote channels move items: the path's name (`stream` or `ucx`), whether
/// it is usable here, and a line saying so (with what UCX is, or why it does not load).
pub fn remote_probe() -> (&'static str, bool, String) {
    let ucx = ucx::probe();
    let ucx_text = match &ucx {
        Ok(v) => format!("UCX puts where both ends set {}=ucx: {v}", tcp::DATA_VAR),
        Err(e) => format!("UCX puts where both ends set {}=ucx: not available ({e})", tcp::DATA_VAR),
    };
    match tcp::DataPath::from_env() {
        Ok(tcp::DataPath::Stream) => {
            ("stream", true, format!("items on the authenticated connection (this process); {ucx_text}"))
        }
        Ok(tcp::DataPath::Ucx) => ("ucx", ucx.is_ok(), format!("{ucx_text} (this process)")),
        Err(e) => ("stream", false, e.to_string()),
    }
}
