//! The channel's limits, one set for both transports: how many peers and handshakes a producer
//! holds, how long a handshake may take, what may wait for a slow peer and for how long, how many
//! refused messages a peer may send, and how many slots a pool may have. They are in the C
//! header as `DEVSHARE_CHANNEL_*` / `DEVSHARE_POOL_*`.

/// Most peers one channel serves at once (after their handshake); more are refused.
pub const DEVSHARE_CHANNEL_MAX_PEERS: usize = 1024;
/// Most connections one channel holds before their handshake (`HELLO`); more are refused at
/// once, so connections that never speak cannot lock consumers out.
pub const DEVSHARE_CHANNEL_MAX_PENDING: usize = 64;
/// Most of those connections one source may hold (a process on a Unix channel, an address over
/// TCP): more from it are refused at once, and when every place is taken a source with fewer
/// gets in by dropping the oldest connection of the source that holds the most.
pub const DEVSHARE_CHANNEL_MAX_PENDING_PER_SOURCE: usize = 8;
/// Milliseconds a new connection has to complete its handshake; then it is dropped.
pub const DEVSHARE_CHANNEL_HANDSHAKE_MS: u64 = 5000;
/// Messages that may wait for one peer whose socket buffer is full (beyond what the kernel
/// buffers, a few hundred small messages); one more disconnects the peer.
pub const DEVSHARE_CHANNEL_SEND_QUEUE: usize = 1024;
/// Bytes that may wait for one peer, likewise.
pub const DEVSHARE_CHANNEL_SEND_QUEUE_BYTES: usize = 4_194_304;
/// Descriptors that may wait for one peer (each queued message keeps duplicates of its fds).
pub const DEVSHARE_CHANNEL_SEND_QUEUE_FDS: usize = 256;
/// Milliseconds a peer may leave its waiting messages untouched (none of them taken by the
/// kernel) before it is disconnected: its leases and slots come back, as when it dies.
pub const DEVSHARE_CHANNEL_SEND_PATIENCE_MS: u64 = 10_000;
/// Refused messages (protocol errors) a peer may send; one more disconnects it.
pub const DEVSHARE_CHANNEL_ERROR_BUDGET: u64 = 64;
/// Most slots one pool may have. The producer keeps a few dozen bytes per slot, allocated when
/// the pool is made; a pool is a pipeline's depth, and 65536 items in flight at once is beyond
/// any pipeline (a larger batch belongs in a slot, not in more slots).
pub const DEVSHARE_POOL_MAX_SLOTS: u32 = 65536;
/// Most pools one consumer holds of one producer (attached on its connection at once). A
/// consumer refuses the attachment of one more and ends the connection (each pool costs it a
/// mapping, or its own memory over TCP, and bookkeeping per slot); a producer's send that would
/// attach one more to a peer fails with `DEVSHARE_STATUS_BUSY` instead. A pool is a pipeline's
/// depth, and producers make a few.
pub const DEVSHARE_CHANNEL_MAX_POOLS: usize = 64;
/// A producer's send that would attach one pool more to `peer`, which holds `attached` of this
/// channel's: `Busy` at [`DEVSHARE_CHANNEL_MAX_POOLS`].
pub(crate) fn room_for_a_pool(peer: u64, attached: usize) -> crate::error::Result<()> {
    if attached >= DEVSHARE_CHANNEL_MAX_POOLS {
        return Err(crate::error::Error::Busy(format!(
            "peer {peer} holds {DEVSHARE_CHANNEL_MAX_POOLS} pools of this channel already (DEVSHARE_CHANNEL_MAX_POOLS): \
             close one (its items back) before sending from another"
        )));
    }
    Ok(())
}

/// Longest name a lease may carry (`devshare_channel_send_named`), in bytes of UTF-8 without NUL.
pub const DEVSHARE_MAX_NAME_LEN: usize = 1024;
