//! What a producer knows about its consumers, for both transports: [`PeerInfo`], one connected
//! consumer as `Channel::peers` and `devshare_channel_peer_info` report it.

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
