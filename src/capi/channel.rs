//! Channels, leases and pools (see `crate::channel`): the producer's channel and pools, the
//! consumer's connection.

use super::abi::{init, sized_struct, write_output};
use super::export::{tensor_desc_from_c, DevshareExporter, DevshareTensorDesc};
use super::import::DevshareImport;
use super::{address, arg, arg_mut, arg_slice, boundary, boundary_value, timeout};
use crate::channel::{Channel, Connection};
use crate::error::{Error, Result};
use crate::export::{Exporter, TensorDesc};
use std::ffi::{c_char, c_void};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Mutex;

/// The producer end of a channel (opaque). Thread-safe: every function may be called from
/// several threads at once, except `devshare_channel_close`, which must not race with them.
pub struct DevshareChannel(pub(crate) Channel);

/// The consumer end of a channel (opaque). Thread-safe like `DevshareChannel`; items received
/// from it are ordinary imports, released on any thread.
pub struct DevshareConnection(Connection, Mutex<LayoutIds>);

/// The `layout_id`s `devshare_connection_recv_item` reports for a connection's pool items: one
/// per distinct pool, slot, address, extent, device, backend, read-only flag, dtype, shape and
/// strides, counted up from 1 and never given twice, so that a binding can key what it builds
/// for an item (a tensor view over its memory) by one integer instead of the whole description.
/// Bounded: past [`MAX_LAYOUT_IDS`] descriptions the table starts afresh (with new ids), so a
/// producer that sends endless layouts costs a few KiB here, not memory without end.
#[derive(Default)]
struct LayoutIds {
    ids: rustc_hash::FxHashMap<LayoutKey, u64>,
    last: u64,
}

/// A pool item's description but its import: [`DevshareItem`] from `pool` on (the shape and
/// strides beyond `ndim` are 0).
#[derive(PartialEq, Eq, Hash)]
struct LayoutKey {
    pool: u32,
    slot: u32,
    device: i32,
    backend: u16,
    read_only: u16,
    ndim: u32,
    dtype: (u8, u8, u16),
    data: usize,
    nbytes: u64,
    shape: [i64; crate::handle::DEVSHARE_MAX_NDIM],
    strides: [i64; crate::handle::DEVSHARE_MAX_NDIM],
}

const MAX_LAYOUT_IDS: usize = 4096;

impl LayoutIds {
    /// The id of `item`'s description (0 for an item that is not a pool slot).
    fn of(&mut self, item: &DevshareItem) -> u64 {
        if item.pool == 0 {
            return 0;
        }
        let key = LayoutKey {
            pool: item.pool,
            slot: item.slot,
            device: item.device,
            backend: item.backend,
            read_only: item.read_only,
            ndim: item.ndim,
            dtype: (item.dtype.code, item.dtype.bits, item.dtype.lanes),
            data: item.data as usize,
            nbytes: item.nbytes,
            shape: item.shape,
            strides: item.strides,
        };
        if let Some(&id) = self.ids.get(&key) {
            return id;
        }
        if self.ids.len() >= MAX_LAYOUT_IDS {
            self.ids.clear();
        }
        self.last += 1;
        self.ids.insert(key, self.last);
        self.last
    }
}

/// What the producer knows about a connected peer (`devshare_channel_peer_info`). Initialise
/// with `devshare_peer_info_init(&info, sizeof info)`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DevsharePeerInfo {
    /// Size of this struct in the caller's header; on return, the bytes the library filled in.
    pub struct_size: u32,
    /// The peer's process id from `SO_PEERCRED`, as this process's pid namespace sees it.
    pub pid: i32,
    /// The peer's user and group ids, from `SO_PEERCRED`.
    pub uid: u32,
    pub gid: u32,
    /// The peer's id on this channel (what `devshare_channel_send` and `devshare_pool_send` take).
    pub id: u64,
    /// The pid the peer announced in the handshake (its bare tgid): what ACL exports sent to it
    /// are whitelisted for.
    pub tgid: i32,
    /// Always 0.
    pub reserved: u32,
    /// References leased to the peer and pools it attached, not yet given back.
    pub leases: u64,
    /// Messages from the peer that were refused (returning a slot or lease it does not hold ...).
    pub protocol_errors: u64,
    /// How items reach the peer (1.9): `DEVSHARE_TRANSPORT_UNIX` (shared memory over a Unix
    /// channel), `DEVSHARE_TRANSPORT_STREAM` (a remote channel's authenticated connection) or
    /// `DEVSHARE_TRANSPORT_UCX` (UCX, where both ends chose it). Absent from a 1.8 caller's struct.
    pub transport: u32,
    /// Always 0.
    pub reserved2: u32,
    /// Pool slots the peer holds now: items sent to it and not given back (1.9; `leases` counts
    /// the pools it attached, not their slots). Absent from a 1.8 caller's struct.
    pub slots: u64,
}

/// `DevsharePeerInfo.transport`: a Unix channel's peer (items in shared memory).
pub const DEVSHARE_TRANSPORT_UNIX: u32 = 0;
/// `DevsharePeerInfo.transport`: a remote channel's peer whose items travel on the
/// authenticated connection (the default).
pub const DEVSHARE_TRANSPORT_STREAM: u32 = 1;
/// `DevsharePeerInfo.transport`: a remote channel's peer whose items are UCX puts (both ends
/// set `DEVSHARE_REMOTE_DATA=ucx`).
pub const DEVSHARE_TRANSPORT_UCX: u32 = 2;

sized_struct!(
    DevsharePeerInfo,
    "DevsharePeerInfo",
    first_size = 48,
    sum = 4 * 8 + 8 * 4,
    defaults = DevsharePeerInfo {
        struct_size: 0,
        pid: 0,
        uid: 0,
        gid: 0,
        id: 0,
        tgid: 0,
        reserved: 0,
        leases: 0,
        protocol_errors: 0,
        transport: 0,
        reserved2: 0,
        slots: 0
    }
);

/// Initialise a `DevsharePeerInfo` of `size` bytes (pass `sizeof *info`).
#[no_mangle]
pub unsafe extern "C" fn devshare_peer_info_init(info: *mut DevsharePeerInfo, size: u32) -> i32 {
    boundary("devshare_peer_info_init", || ffi!(init(info, size, "info")))
}

/// Listen for consumers on `address`: a file-system path (the socket file is created with mode
/// 0600 and removed by `devshare_channel_close`; an existing file is never replaced:
/// `DEVSHARE_STATUS_BUSY`) or `"@name"`, a Linux abstract socket name. By default only processes
/// of this process's effective uid may connect (checked with `SO_PEERCRED`); see
/// `devshare_channel_restrict`.
///
/// Or `"tcp://HOST:PORT"` (1.5): a remote channel for consumers on other hosts, listening only
/// on that address. Its peers prove knowledge of the channel key file (`DEVSHARE_CHANNEL_KEY_FILE`,
/// else `~/.config/devshare/channel.key`: the same bytes on both hosts, mode 0600, owned by the
/// user); before that nothing exists for them, and the proofs cover the whole handshake. It
/// carries pools of host memory and (1.6) of CUDA memory, whose items cross through host memory
/// at both ends into each consumer's own device memory (leases, `_restrict`, spinning, ACL
/// pools: `DEVSHARE_STATUS_UNSUPPORTED`). Items travel on the authenticated connection (1.9),
/// read straight into the consumer's slots; where both ends set `DEVSHARE_REMOTE_DATA=ucx` they
/// are UCX puts instead (`libucp.so.0`, loaded at run time: `DEVSHARE_STATUS_BACKEND_UNAVAILABLE`
/// without it; `devshare_probe(DEVSHARE_PROBE_REMOTE)` says which path and why). The data and
/// messages travel unencrypted: use it on a network you trust, or in a tunnel.
///
/// Nothing runs in the background: connections are accepted, releases taken and hang-ups
/// noticed only inside `devshare_channel_service` and the calls that wait (`_wait_peers`,
/// `devshare_pool_acquire`, and `devshare_exporter_wait` on exports sent over the channel), so
/// serve the channel from your loop (poll `devshare_channel_fd`).
#[no_mangle]
pub unsafe extern "C" fn devshare_channel_listen(address_: *const c_char, out: *mut *mut DevshareChannel) -> i32 {
    boundary("devshare_channel_listen", || {
        let out = ffi!(arg_mut(out, "out"))?;
        let ch = Channel::listen(ffi!(address(address_))?)?;
        *out = Box::into_raw(Box::new(DevshareChannel(ch)));
        Ok(())
    })
}

/// Who may connect from now on: `n_uids > 0` replaces the allowed uids (default: this
/// process's effective uid alone; listing another uid is how a caller trusts it), `n_pids > 0`
/// admits only those pids. Peers already connected stay.
#[no_mangle]
pub unsafe extern "C" fn devshare_channel_restrict(
    channel: *mut DevshareChannel,
    uids: *const u32,
    n_uids: usize,
    pids: *const i32,
    n_pids: usize,
) -> i32 {
    boundary("devshare_channel_restrict", || {
        let ch = &ffi!(arg(channel, "channel"))?.0;
        ch.restrict(ffi!(arg_slice(uids, n_uids, "uids"))?, ffi!(arg_slice(pids, n_pids, "pids"))?)
    })
}

/// The descriptor to poll (for reading) in your event loop: readable when
/// `devshare_channel_service` has work (a connection, a message, a hang-up). -1 for NULL.
#[no_mangle]
pub unsafe extern "C" fn devshare_channel_fd(channel: *const DevshareChannel) -> i32 {
    boundary_value("devshare_channel_fd", -1, || match ffi!(channel.as_ref()) {
        Some(c) => c.0.fd().as_raw_fd(),
        None => -1,
    })
}

/// Accept new peers (credentials checked, handshake), take their releases and returned slots,
/// and notice the ones that hung up — their leases and slots come back at once. Waits at most
/// `timeout_ms` for something to happen (0: do not wait; negative: until something does), and
/// returns `DEVSHARE_STATUS_OK` whether or not anything did. Until a call serves the channel, a
/// released lease still counts in `devshare_exporter_outstanding` (`devshare_exporter_wait`
/// serves the channels itself).
#[no_mangle]
pub unsafe extern "C" fn devshare_channel_service(channel: *mut DevshareChannel, timeout_ms: i32) -> i32 {
    boundary("devshare_channel_service", || ffi!(arg(channel, "channel"))?.0.service(timeout(timeout_ms)))
}

/// Serve the channel until at least `n` peers are connected: `DEVSHARE_STATUS_TIMEOUT` after
/// `timeout_ms` (negative: wait forever).
#[no_mangle]
pub unsafe extern "C" fn devshare_channel_wait_peers(channel: *mut DevshareChannel, n: usize, timeout_ms: i32) -> i32 {
    boundary("devshare_channel_wait_peers", || ffi!(arg(channel, "channel"))?.0.wait_peers(n, timeout(timeout_ms)))
}

/// The ids of the connected peers, oldest first: `*count` receives how many are connected; up to
/// `cap` ids go to `ids` (`DEVSHARE_STATUS_BUFFER_TOO_SMALL` when `cap < *count`).
#[no_mangle]
pub unsafe extern "C" fn devshare_channel_peer_ids(
    channel: *const DevshareChannel,
    ids: *mut u64,
    cap: usize,
    count: *mut usize,
) -> i32 {
    boundary("devshare_channel_peer_ids", || {
        let ch = &ffi!(arg(channel, "channel"))?.0;
        let count = ffi!(arg_mut(count, "count"))?;
        let all = ch.peer_ids()?;
        *count = all.len();
        if cap > 0 {
            if ids.is_null() {
                return Err(Error::NullArgument("ids"));
            }
            let n = cap.min(all.len());
            // SAFETY: ids holds cap >= n elements (contract).
            unsafe { std::ptr::copy_nonoverlapping(all.as_ptr(), ids, n) };
        }
        if cap < all.len() {
            return Err(Error::BufferTooSmall { needed: all.len(), given: cap });
        }
        Ok(())
    })
}

/// What is known about connected peer `peer` (`DEVSHARE_STATUS_NOT_FOUND` when it is not).
#[no_mangle]
pub unsafe extern "C" fn devshare_channel_peer_info(
    channel: *const DevshareChannel,
    peer: u64,
    out: *mut DevsharePeerInfo,
) -> i32 {
    boundary("devshare_channel_peer_info", || {
        let ch = &ffi!(arg(channel, "channel"))?.0;
        let p = ch.peer_info(peer)?;
        let info = DevsharePeerInfo {
            struct_size: 0,
            pid: p.pid,
            uid: p.uid,
            gid: p.gid,
            id: p.id,
            tgid: p.tgid,
            reserved: 0,
            leases: p.leases,
            protocol_errors: p.protocol_errors,
            transport: p.transport,
            reserved2: 0,
            slots: p.slots,
        };
        ffi!(write_output(out, info, "out"))
    })
}

/// Send `peer` one leased reference to a tensor of `exporter` (`desc` NULL: the whole range as
/// bytes). `DEVSHARE_SHARE_EVENT` (device exports) records an interprocess event on
/// `desc->stream` that the consumer's receive waits on, instead of synchronising the stream; it
/// is kept until the lease comes back. `DEVSHARE_SHARE_INFLIGHT` does not apply to leases. The peer receives it
/// with `devshare_connection_recv`. `devshare_exporter_outstanding` counts it until the peer
/// releases its import or disconnects for any reason. ACL exports are whitelisted for the
/// peer's announced tgid first (once per export and peer). Host memory must come from
/// `devshare_channel_host_alloc` or name-based host exports (`devshare_host_alloc`).
///
/// No producer call waits for a peer, and none holds the channel while one could: a message the
/// peer's socket has no room for waits in that peer's queue and goes out as the peer reads. A
/// peer whose queue would pass `DEVSHARE_CHANNEL_SEND_QUEUE` messages (or
/// `DEVSHARE_CHANNEL_SEND_QUEUE_BYTES`, `DEVSHARE_CHANNEL_SEND_QUEUE_FDS`), or whose queue does
/// not move for `DEVSHARE_CHANNEL_SEND_PATIENCE_MS`, is disconnected as if it had died: its
/// leases and slots come back, and the send that found it so returns `DEVSHARE_STATUS_CLOSED`.
#[no_mangle]
pub unsafe extern "C" fn devshare_channel_send(
    channel: *mut DevshareChannel,
    peer: u64,
    exporter: *const DevshareExporter,
    desc: *const DevshareTensorDesc,
) -> i32 {
    boundary("devshare_channel_send", || {
        let ch = &ffi!(arg(channel, "channel"))?.0;
        let e = &ffi!(arg(exporter, "exporter"))?.0;
        match ffi!(desc.as_ref()) {
            None => {
                let shape = [e.size() as i64];
                ch.send(peer, e, &TensorDesc { shape: &shape, ..Default::default() })
            }
            Some(_) => {
                let d = ffi!(super::abi::read_input(desc, "desc"))?;
                ch.send(peer, e, &ffi!(tensor_desc_from_c(&d))?)
            }
        }
    })
}

/// Send `peer` one leased reference to each of `count` tensors, in order: tensor i is
/// `*descs[i]` inside `exporters[i]` (a NULL description: the whole export as bytes), each
/// exactly as `devshare_channel_send` sends one. The consumer receives them as `count` imports,
/// one per `devshare_connection_recv`, in this order. A 1.4 or later consumer gets them in as
/// few messages as the message size (an encoded handle is a few hundred bytes) and `SCM_RIGHTS`
/// limits allow; an older one, one message each. Every share is made first: a description
/// that is refused sends nothing. `count` 0 does nothing.
#[no_mangle]
pub unsafe extern "C" fn devshare_channel_send_batch(
    channel: *mut DevshareChannel,
    peer: u64,
    exporters: *const *const DevshareExporter,
    descs: *const *const DevshareTensorDesc,
    count: usize,
) -> i32 {
    boundary("devshare_channel_send_batch", || {
        let ch = &ffi!(arg(channel, "channel"))?.0;
        let exps = ffi!(super::arg_slice(exporters, count, "exporters"))?;
        let ds = ffi!(super::arg_slice(descs, count, "descs"))?;
        let mut read = Vec::new();
        read.try_reserve_exact(count).map_err(|_| Error::bad_size("count", format!("{count} tensors")))?;
        for (i, (&e, &d)) in exps.iter().zip(ds).enumerate() {
            let e = &ffi!(e.as_ref()).ok_or_else(|| Error::InvalidArgument(format!("exporters[{i}] is NULL")))?.0;
            let d = if d.is_null() { None } else { Some(ffi!(super::abi::read_input(d, "descs[i]"))?) };
            read.push((e, d, [e.size() as i64]));
        }
        let mut items = Vec::with_capacity(count);
        for (e, d, whole) in &read {
            let desc = match d {
                Some(d) => ffi!(tensor_desc_from_c(d))?,
                None => TensorDesc { shape: whole, ..Default::default() },
            };
            items.push((&***e, desc));
        }
        ch.send_batch(peer, &items)
    })
}

/// Let `devshare_connection_recv` poll for an item for up to `spin_us` microseconds before it
/// sleeps (see `devshare_pool_set_spin`); 0 (the default) sleeps at once; at most
/// `DEVSHARE_MAX_SPIN_US`. A receive with a shorter timeout spins only that long.
#[no_mangle]
pub unsafe extern "C" fn devshare_connection_set_spin(conn: *mut DevshareConnection, spin_us: u32) -> i32 {
    boundary("devshare_connection_set_spin", || {
        ffi!(arg(conn, "conn"))?.0.set_spin(std::time::Duration::from_micros(u64::from(spin_us)))
    })
}

/// Read the device items this connection receives on `stream` (`CUstream` / `aclrtStream`, of
/// the device they arrive on): an item's interprocess event (`DEVSHARE_SHARE_EVENT`) is then
/// waited for by that stream, on the device, and `devshare_connection_recv` returns without
/// waiting for the producer's work. NULL (the default): `devshare_connection_recv` waits on the
/// host until the event completed. Host items are unaffected. A stream of another device makes
/// the receive of such an item fail with the runtime's error.
#[no_mangle]
pub unsafe extern "C" fn devshare_connection_set_stream(conn: *mut DevshareConnection, stream: *mut c_void) -> i32 {
    boundary("devshare_connection_set_stream", || {
        ffi!(arg(conn, "conn"))?.0.set_stream(stream)?;
        Ok(())
    })
}

/// Whether ACL exports sent over this channel are whitelisted for the pid a consumer announced
/// in its handshake (its bare tgid) when that is not its pid as the kernel reports it
/// (`SO_PEERCRED`): `trust` nonzero yes, 0 (the default) no — the kernel's pid is whitelisted
/// instead. A consumer in another pid namespace (a container: Ascend reports host pids) announces
/// a pid this process cannot check; by default an admitted peer so cannot get ACL memory
/// whitelisted for a process `devshare_channel_restrict` did not admit. Turn it on for consumers
/// in containers, whose ACL imports otherwise fail the pid check (207006).
#[no_mangle]
pub unsafe extern "C" fn devshare_channel_trust_announced_pids(channel: *mut DevshareChannel, trust: u32) -> i32 {
    boundary("devshare_channel_trust_announced_pids", || {
        ffi!(arg(channel, "channel"))?.0.trust_announced_pids(trust != 0)
    })
}

/// Disconnect connected peer `peer` now, as if its process had died: its leases stop counting
/// in their exports' outstanding references, its pool slots are free again, and its
/// `devshare_connection_recv` returns `DEVSHARE_STATUS_CLOSED` once it has read what its socket
/// had taken (messages still queued for it are dropped). `DEVSHARE_STATUS_NOT_FOUND` when no such peer is connected. The channel does the
/// same on its own to a peer that does not read its messages (see
/// `DEVSHARE_CHANNEL_SEND_QUEUE` and `DEVSHARE_CHANNEL_SEND_PATIENCE_MS`), that does not
/// complete its handshake in `DEVSHARE_CHANNEL_HANDSHAKE_MS`, or that sends more than
/// `DEVSHARE_CHANNEL_ERROR_BUDGET` refused messages.
#[no_mangle]
pub unsafe extern "C" fn devshare_channel_disconnect(channel: *mut DevshareChannel, peer: u64) -> i32 {
    boundary("devshare_channel_disconnect", || ffi!(arg(channel, "channel"))?.0.disconnect(peer))
}

/// Close the channel and free it: every peer is disconnected (its `devshare_connection_recv`
/// returns `DEVSHARE_STATUS_CLOSED`), their leases stop counting in their exports'
/// outstanding references (the producer can no longer learn when they let go: wait for them
/// first), pools on it are closed, the socket file is removed. NULL is a no-op.
#[no_mangle]
pub unsafe extern "C" fn devshare_channel_close(channel: *mut DevshareChannel) -> i32 {
    boundary("devshare_channel_close", || {
        if !channel.is_null() {
            // SAFETY: channel came from Box::into_raw in devshare_channel_listen; the caller
            // gives it up here.
            let ch = ffi!(Box::from_raw(channel));
            ch.0.close();
        }
        Ok(())
    })
}

/// Allocate `size` bytes of zeroed host memory as a sealed memfd (`F_SEAL_SHRINK`,
/// `F_SEAL_GROW`, `F_SEAL_SEAL`: no process can shrink it under a reader) and export it for
/// channels. It has no name in /dev/shm: it travels next to its handles over a channel
/// (`devshare_channel_send`, `devshare_pool_create`) and nothing is left behind when any
/// process dies. `devshare_exporter_share` refuses it (`DEVSHARE_STATUS_UNSUPPORTED`).
/// `ptr_out` (may be NULL) receives its address; close with `devshare_exporter_close`. The rule
/// of `devshare_host_alloc` applies: a size larger than the free room of `/dev/shm` (the shared
/// memory budget a memfd draws on as well) is refused with `DEVSHARE_STATUS_OS` (`ENOSPC`), and
/// size 0 is an empty allocation.
#[no_mangle]
pub unsafe extern "C" fn devshare_channel_host_alloc(
    size: u64,
    out: *mut *mut DevshareExporter,
    ptr_out: *mut *mut c_void,
) -> i32 {
    boundary("devshare_channel_host_alloc", || {
        let out = ffi!(arg_mut(out, "out"))?;
        let e = Exporter::channel_host_alloc(size)?;
        if let Some(p) = ffi!(ptr_out.as_mut()) {
            *p = e.ptr().cast();
        }
        *out = Box::into_raw(Box::new(DevshareExporter(std::sync::Arc::new(e))));
        Ok(())
    })
}

/// Connect to the channel at `address` (a path or `"@name"`) and shake hands: this process
/// announces its pid (its bare tgid), for which the producer whitelists the ACL exports it sends
/// here. The producer must run as this process's effective uid, or as root
/// (`DEVSHARE_STATUS_UNTRUSTED` otherwise); a producer that refuses this process (uid or pid
/// rules) is `DEVSHARE_STATUS_UNTRUSTED` with its reason. Waits at most `timeout_ms`
/// (negative: forever) for the producer to serve the handshake.
///
/// `"tcp://HOST:PORT"` connects to a remote channel (see `devshare_channel_listen`): the
/// producer and this process prove the channel key to each other (the key never crosses the
/// wire; a producer without it, or with another UCX version, is refused here), then items of its
/// pools are put into this process's own copy of each pool (registered once: one address per
/// slot). Over TCP the producer's puts complete while this process receives (or polls
/// `devshare_connection_fd` and receives): a send waits for it at most 10 s. Waits at most
/// `timeout_ms` (negative: 10 s) for the connection and the handshake.
#[no_mangle]
pub unsafe extern "C" fn devshare_channel_connect(
    address_: *const c_char,
    timeout_ms: i32,
    out: *mut *mut DevshareConnection,
) -> i32 {
    boundary("devshare_channel_connect", || {
        let out = ffi!(arg_mut(out, "out"))?;
        let c = Connection::connect(ffi!(address(address_))?, timeout(timeout_ms))?;
        *out = Box::into_raw(Box::new(DevshareConnection(c, Mutex::default())));
        Ok(())
    })
}

/// The descriptor to poll (for reading) in your event loop — an epoll set of the connection's
/// socket and its ring's wake-up: readable when an item or the producer's close arrives, and
/// again after a receive that left another item waiting. Do not read or close it. -1 for NULL.
/// Once a program has taken it, each item that arrives while this consumer is outside
/// `devshare_connection_recv` costs the producer one system call (the wake-up an event loop
/// needs); a consumer that only receives never pays it.
#[no_mangle]
pub unsafe extern "C" fn devshare_connection_fd(conn: *const DevshareConnection) -> i32 {
    boundary_value("devshare_connection_fd", -1, || match ffi!(conn.as_ref()) {
        Some(c) => c.0.fd().as_fd().as_raw_fd(),
        None => -1,
    })
}

/// This consumer's peer id at the producer (what the producer's `devshare_channel_peer_ids`
/// lists for it) and the producer's pid as it reported it; either out-pointer may be NULL.
#[no_mangle]
pub unsafe extern "C" fn devshare_connection_info(
    conn: *const DevshareConnection,
    peer_id: *mut u64,
    producer_pid: *mut i32,
) -> i32 {
    boundary("devshare_connection_info", || {
        let c = &ffi!(arg(conn, "conn"))?.0;
        if let Some(o) = ffi!(peer_id.as_mut()) {
            *o = c.peer_id();
        }
        if let Some(o) = ffi!(producer_pid.as_mut()) {
            *o = c.producer_pid();
        }
        Ok(())
    })
}

/// Receive the next item — a leased reference or a pool slot — as an ordinary import:
/// `devshare_import_info` gives its pointers, `devshare_import_release` gives it back to the
/// producer (after this process's device work on it is finished). Waits at most `timeout_ms`
/// (0: do not wait; negative: forever — `devshare_connection_close` from another thread would
/// free the connection under it: close only after it returned): `DEVSHARE_STATUS_TIMEOUT`. Once the producer is gone
/// and nothing is queued: `DEVSHARE_STATUS_CLOSED`. Imports stay valid after the producer died
/// or the connection closed, until released. A malformed or out-of-bounds item is refused
/// (`DEVSHARE_STATUS_UNTRUSTED` or the handle's status) and given back.
#[no_mangle]
pub unsafe extern "C" fn devshare_connection_recv(
    conn: *mut DevshareConnection,
    timeout_ms: i32,
    out: *mut *mut DevshareImport,
) -> i32 {
    boundary("devshare_connection_recv", || {
        let c = &ffi!(arg(conn, "conn"))?.0;
        let out = ffi!(arg_mut(out, "out"))?;
        *out = DevshareImport::into_raw(c.recv_boxed(timeout(timeout_ms))?);
        Ok(())
    })
}

/// One received item as `devshare_connection_recv_item` reports it: the import and everything a
/// receive loop reads of it. Initialise with `devshare_item_init(&item, sizeof item)`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DevshareItem {
    /// Size of this struct in the caller's header; on return, the bytes the library filled in.
    pub struct_size: u32,
    /// Reserved, zero.
    pub reserved: u32,
    /// The received import, the caller's to release (`devshare_import_release`, after
    /// `devshare_import_give_back` if it likes).
    pub import: *mut DevshareImport,
    /// The pool's id (> 0) and the slot for a pool item; 0 and 0 for a lease.
    pub pool: u32,
    pub slot: u32,
    /// Device the memory is on in this process (0 for host).
    pub device: i32,
    /// `DEVSHARE_BACKEND_*`.
    pub backend: u16,
    /// 1 when mapped read-only.
    pub read_only: u16,
    /// The tensor's number of dimensions, 0..=`DEVSHARE_MAX_NDIM`.
    pub ndim: u32,
    /// The tensor's element type.
    pub dtype: crate::dtype::DevshareDType,
    /// The tensor's first element in this process (valid until the import is released).
    pub data: *mut c_void,
    /// Bytes from `data` to the end of the item's storage: what the tensor may address.
    pub nbytes: u64,
    /// Shape and strides in elements; entries at and beyond `ndim` are 0.
    pub shape: [i64; crate::handle::DEVSHARE_MAX_NDIM],
    pub strides: [i64; crate::handle::DEVSHARE_MAX_NDIM],
    /// (1.8) For a pool item, an id of everything above but `import`: two items of one
    /// connection with the same id have the same pool, slot, device, backend, `read_only`,
    /// `ndim`, dtype, `data`, `nbytes`, shape and strides, and an id is never given to another
    /// description on that connection. Ids count up from 1; 0 for an item that is not a pool
    /// slot. What a binding keys a view it keeps per slot and layout by. Written only when the
    /// caller's struct has room for it (`struct_size` on return says so).
    pub layout_id: u64,
}

sized_struct!(
    DevshareItem,
    "DevshareItem",
    first_size = 184,
    sum = 4 * 2 + 8 + 4 * 3 + 2 * 2 + 4 + 4 + 8 + 8 + 8 * 2 * crate::handle::DEVSHARE_MAX_NDIM + 8,
    defaults = DevshareItem {
        struct_size: 0,
        reserved: 0,
        import: std::ptr::null_mut(),
        pool: 0,
        slot: 0,
        device: 0,
        backend: 0,
        read_only: 0,
        ndim: 0,
        dtype: crate::dtype::DevshareDType { code: 0, bits: 0, lanes: 0 },
        data: std::ptr::null_mut(),
        nbytes: 0,
        shape: [0; crate::handle::DEVSHARE_MAX_NDIM],
        strides: [0; crate::handle::DEVSHARE_MAX_NDIM],
        layout_id: 0
    }
);

/// Initialise a `DevshareItem` of `size` bytes (pass `sizeof *item`).
#[no_mangle]
pub unsafe extern "C" fn devshare_item_init(item: *mut DevshareItem, size: u32) -> i32 {
    boundary("devshare_item_init", || ffi!(init(item, size, "item")))
}

/// `devshare_connection_recv` and `devshare_import_describe` in one call, for bindings that pay
/// per call: receive the next item into `*out` (initialised with `devshare_item_init`), its
/// import in `out->import`. `release`: NULL, or an import the caller is done with (from any
/// source), released first as `devshare_import_release` does, whatever happens next — so a
/// loop that frees each item after the next receive makes one call per item. On failure
/// `*out` is left as it was. Waits and fails like `devshare_connection_recv`.
#[no_mangle]
pub unsafe extern "C" fn devshare_connection_recv_item(
    conn: *mut DevshareConnection,
    timeout_ms: i32,
    release: *mut DevshareImport,
    out: *mut DevshareItem,
) -> i32 {
    boundary("devshare_connection_recv_item", || {
        // SAFETY: the contract of devshare_connection_recv_item, which recv_item's is.
        unsafe { recv_item(conn, timeout_ms, release, out) }
    })
}

/// `devshare_connection_recv_item`'s work.
///
/// # Safety
/// `release` is NULL or an import from `Box::into_raw` that the caller hands over; `out` is
/// NULL or points to at least `(*out).struct_size` writable bytes.
unsafe fn recv_item(
    conn: *mut DevshareConnection,
    timeout_ms: i32,
    release: *mut DevshareImport,
    out: *mut DevshareItem,
) -> Result<()> {
    if !release.is_null() {
        // Dropping the box releases the import where it lies.
        // SAFETY: the caller hands over an import from Box::into_raw (devshare_import,
        // devshare_connection_recv ...), released once: here.
        drop(unsafe { Box::from_raw(release) });
    }
    let conn = ffi!(arg(conn, "conn"))?;
    if out.is_null() {
        return Err(Error::NullArgument("out"));
    }
    let imp = conn.0.recv_boxed(timeout(timeout_ms))?;
    let mut item = item_of(&imp);
    // Only for a caller whose struct has room for it (a 1.7 caller's has not).
    // SAFETY: out is non-NULL and points to at least 4 readable bytes (contract).
    let room = unsafe { out.cast::<u32>().read_unaligned() } as usize;
    if room >= std::mem::offset_of!(DevshareItem, layout_id) + 8 {
        item.layout_id = conn.1.lock().unwrap_or_else(|p| p.into_inner()).of(&item);
    }
    let boxed = DevshareImport::into_raw(imp);
    let written = ffi!(write_output(out, DevshareItem { import: boxed, ..item }, "out"));
    if written.is_err() {
        // SAFETY: boxed came from Box::into_raw just above and was handed to nobody.
        unsafe { Box::from_raw(boxed) }.into_inner().release();
    }
    written
}

/// `devshare_connection_recv_item`'s arguments in one struct, for
/// `devshare_connection_recv_args`: a binding whose every argument costs (Python's ctypes,
/// about 40 ns each) keeps one per connection, sets `release` (and `timeout_ms` when it
/// changes) and passes one pointer. Initialise with `devshare_recv_args_init(&args, sizeof
/// args)`, which also initialises `item`, then set `conn`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DevshareRecvArgs {
    /// Size of this struct in the caller's header (`item` included).
    pub struct_size: u32,
    /// As `devshare_connection_recv_item`'s (negative: wait without a limit; the default).
    pub timeout_ms: i32,
    /// The connection to receive from.
    pub conn: *mut DevshareConnection,
    /// NULL, or an import the caller is done with, released first whatever happens next (as
    /// `devshare_connection_recv_item`'s `release`); the call sets it back to NULL.
    pub release: *mut DevshareImport,
    /// The received item, as `devshare_connection_recv_item` writes it (its own `struct_size`,
    /// set by `devshare_recv_args_init`, fits in this struct's).
    pub item: DevshareItem,
}

sized_struct!(
    DevshareRecvArgs,
    "DevshareRecvArgs",
    first_size = 216,
    sum = 4 * 2 + 8 * 2 + std::mem::size_of::<DevshareItem>(),
    defaults = DevshareRecvArgs {
        struct_size: 0,
        timeout_ms: -1,
        conn: std::ptr::null_mut(),
        release: std::ptr::null_mut(),
        item: <DevshareItem as super::abi::SizedStruct>::defaults()
    }
);

/// Where `DevshareRecvArgs::item` starts.
const RECV_ARGS_ITEM: usize = std::mem::offset_of!(DevshareRecvArgs, item);

/// Initialise a `DevshareRecvArgs` of `size` bytes (pass `sizeof *args`): no connection, no
/// release, wait without a limit, and `item` initialised for the rest of the size.
#[no_mangle]
pub unsafe extern "C" fn devshare_recv_args_init(args: *mut DevshareRecvArgs, size: u32) -> i32 {
    boundary("devshare_recv_args_init", || {
        ffi!(init(args, size, "args"))?;
        // SAFETY: init checked args (non-NULL, `size` >= the struct's first size, writable).
        let item = unsafe { std::ptr::addr_of_mut!((*args).item) };
        ffi!(init(item, size - RECV_ARGS_ITEM as u32, "args.item"))
    })
}

/// `devshare_connection_recv_item(args->conn, args->timeout_ms, args->release, &args->item)`
/// with one argument; `args->release` is NULL when it returns (that import was released,
/// whatever the receive did). An `args->struct_size` below `sizeof(DevshareRecvArgs)` of 1.8
/// is `DEVSHARE_STATUS_INVALID_ARGUMENT` before anything is read (nothing is released); an
/// `args->item.struct_size` larger than what `args->struct_size` leaves for it is too (the
/// release still happens).
#[no_mangle]
pub unsafe extern "C" fn devshare_connection_recv_args(args: *mut DevshareRecvArgs) -> i32 {
    boundary("devshare_connection_recv_args", || {
        if args.is_null() {
            return Err(Error::NullArgument("args"));
        }
        // Fields are read and written through the pointer (no reference to the caller's
        // struct, whose size is its own), and only once its size is known to hold them.
        // SAFETY: args is non-NULL and points to at least 4 readable bytes (contract).
        let size = super::abi::check_size::<DevshareRecvArgs>(unsafe { (*args).struct_size }, "args")?;
        // SAFETY: args holds the struct's first size (checked), which has every field.
        let (timeout_ms, conn, release, item_size) =
            unsafe { ((*args).timeout_ms, (*args).conn, (*args).release, (*args).item.struct_size) };
        // SAFETY: as above.
        unsafe { (*args).release = std::ptr::null_mut() };
        let room = size - RECV_ARGS_ITEM;
        let checked = if item_size as usize > room {
            Err(Error::InvalidArgument(format!(
                "args.item.struct_size {item_size} is more than the {room} bytes args.struct_size leaves for it"
            )))
        } else {
            Ok(())
        };
        if let Err(e) = checked {
            if !release.is_null() {
                // SAFETY: as in recv_item: the caller handed this import over.
                drop(unsafe { Box::from_raw(release) });
            }
            return Err(e);
        }
        // SAFETY: within the args (checked above).
        let item = unsafe { std::ptr::addr_of_mut!((*args).item) };
        // SAFETY: item points into *args with item.struct_size bytes of room (checked above);
        // release was handed over and is released there.
        unsafe { recv_item(conn, timeout_ms, release, item) }
    })
}

/// What `devshare_connection_recv_item` reports of an import (all but the import pointer).
fn item_of(i: &crate::import::Import) -> DevshareItem {
    let v = i.view();
    let h = i.handle();
    let (pool, slot) = i.pool_slot().unwrap_or((0, 0));
    let end = (v.storage as usize).wrapping_add(h.storage_size as usize);
    let nbytes = end.saturating_sub(v.data as usize) as u64;
    let n = (h.ndim as usize).min(crate::handle::DEVSHARE_MAX_NDIM);
    let mut shape = [0; crate::handle::DEVSHARE_MAX_NDIM];
    let mut strides = [0; crate::handle::DEVSHARE_MAX_NDIM];
    shape[..n].copy_from_slice(&h.shape[..n]);
    strides[..n].copy_from_slice(&h.strides[..n]);
    DevshareItem {
        struct_size: 0,
        reserved: 0,
        import: std::ptr::null_mut(),
        pool,
        slot,
        device: v.device,
        backend: h.backend,
        read_only: u16::from(v.read_only),
        ndim: n as u32,
        dtype: h.dtype,
        data: v.data.cast(),
        nbytes,
        shape,
        strides,
        layout_id: 0,
    }
}

/// Close the connection and free it: the producer takes back every lease and slot of it at once
/// (and sees it gone). Imports received from it stay mapped until released; releasing them then
/// sends nothing. NULL is a no-op.
#[no_mangle]
pub unsafe extern "C" fn devshare_connection_close(conn: *mut DevshareConnection) -> i32 {
    boundary("devshare_connection_close", || {
        if !conn.is_null() {
            // SAFETY: conn came from Box::into_raw in devshare_channel_connect; the caller gives
            // it up here.
            drop(ffi!(Box::from_raw(conn)));
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(pool: u32, slot: u32, shape0: i64) -> DevshareItem {
        let mut i = <DevshareItem as super::super::abi::SizedStruct>::defaults();
        (i.pool, i.slot, i.ndim, i.shape[0], i.strides[0]) = (pool, slot, 1, shape0, 1);
        i
    }

    #[test]
    fn layout_ids_name_one_description_each_and_are_never_given_twice_also_past_the_bound() {
        let mut ids = LayoutIds::default();
        assert_eq!(ids.of(&item(0, 0, 4)), 0, "a lease has no id");
        let a = ids.of(&item(1, 0, 4));
        assert_ne!(a, 0);
        assert_eq!(ids.of(&item(1, 0, 4)), a, "the same description, the same id");
        let b = ids.of(&item(1, 1, 4));
        let c = ids.of(&item(1, 0, 8));
        let mut d = item(1, 0, 4);
        d.data = 4096 as *mut c_void;
        let d = ids.of(&d);
        let all = [a, b, c, d];
        for (k, x) in all.iter().enumerate() {
            assert!(!all[k + 1..].contains(x), "another slot, shape or address, another id: {all:?}");
        }
        // A producer that sends endless layouts: the table stays bounded and starts afresh
        // with new ids, so the first description now gets an id it never had.
        for n in 0..2 * MAX_LAYOUT_IDS as i64 {
            ids.of(&item(2, 0, 100 + n));
        }
        assert!(ids.ids.len() <= MAX_LAYOUT_IDS);
        let again = ids.of(&item(1, 0, 4));
        assert!(again > d && !all.contains(&again), "{again} after {all:?}");
    }
}
