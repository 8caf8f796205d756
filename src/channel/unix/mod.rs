//! The Unix transport: a channel on a `SOCK_SEQPACKET` Unix socket (a path, created mode 0600,
//! or a Linux abstract name `@name`) between processes of one host.
//!
//! - `producer.rs`: the listening socket, its peers (admission by `SO_PEERCRED`, the handshake),
//!   the bounded send queue, leases, pools and the serve loop.
//! - `consumer.rs`: the connection, what arrives on it, and the backlog its releases wait in
//!   when the producer is not reading.
//! - `opened.rs`: the interprocess events a connection keeps open between waits.
//! - `ring.rs`: the shared-memory ring per peer that pool items and their returns travel in.
//! - `spin.rs`: the adaptive spin, a wait's poll before it sleeps while the peer is awake on
//!   another CPU.
//!
//! Host memory travels as sealed memfds with `SCM_RIGHTS`; the transport never names a vendor
//! (what a vendor needs, such as the pid an ACL exporter whitelists, comes from `crate::backend`).

/// The longest spin [`crate::channel::Pool::set_spin`], the connection's and the channel's
/// accept (one second).
pub const MAX_SPIN: std::time::Duration = std::time::Duration::from_secs(1);

/// `spin` in nanoseconds, refused above [`MAX_SPIN`] (what each `set_spin` stores).
fn spin_ns(spin: std::time::Duration) -> crate::error::Result<u64> {
    if spin > MAX_SPIN {
        return Err(crate::error::Error::InvalidArgument(format!(
            "a spin of {} us is above the maximum of {} us",
            spin.as_micros(),
            MAX_SPIN.as_micros()
        )));
    }
    Ok(spin.as_nanos() as u64)
}

/// A non-blocking, close-on-exec `SOCK_SEQPACKET` Unix socket: what both ends start from.
fn seqpacket_socket() -> crate::error::Result<std::os::fd::OwnedFd> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .map_err(|e| crate::channel::wire::os("socket(AF_UNIX, SOCK_SEQPACKET)", e))
}

mod consumer;
mod opened;
mod producer;
mod ring;
mod spin;

pub use consumer::LocalConnection;
pub use producer::{LocalChannel, LocalPool};
