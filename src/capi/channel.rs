//! The producer's end of a channel (`crate::channel::Channel`): listen, admit and serve
//! consumers, send them leased references, disconnect them; and the host memory made to travel
//! over channels. Its pools are in `pool.rs`, the consumer's end in `connection.rs`.

use super::abi::{init, sized_struct, write_output};
use super::export::{tensor_desc_from_c, DevshareExporter, DevshareTensorDesc};
use super::{address, arg, arg_mut, arg_slice, boundary, boundary_value, timeout};
use crate::channel::Channel;
use crate::error::Error;
use crate::export::{Exporter, TensorDesc};
use std::ffi::{c_char, c_void};
use std::os::fd::AsRawFd;

/// The producer end of a channel (opaque). Thread-safe: every function may be called from
/// several threads at once, except `devshare_channel_close`, which must not race with them.
pub struct DevshareChannel(pub(crate) Channel);

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
            return Err(Error::BufferTooSmall { needed: all.len(), given: cap, unit: "ids" });
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
/// is kept until the lease comes back, then kept by the channel for that peer (at most 128 per
/// peer and device; a send past them synchronises its stream instead) and recorded again for a
/// later send. `DEVSHARE_SHARE_INFLIGHT` does not apply to leases. The peer receives it
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
/// exactly as `devshare_channel_send` sends one, except that one interprocess event (or one
/// synchronisation) covers every tensor of the batch on the same device and stream: the
/// consumer waits on it once. The consumer receives them as `count` imports,
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
        // SAFETY: devshare_channel_send_batch's contract is send_items' (names: none).
        unsafe { send_items(channel, peer, exporters, descs, std::ptr::null(), count) }
    })
}

/// `devshare_channel_send_batch` with a name for each lease (1.11): `names` NULL (no names) or
/// `count` pointers, each NULL (that lease has none) or a NUL-terminated UTF-8 string of at most
/// `DEVSHARE_MAX_NAME_LEN` bytes (a state dict's keys, say). A consumer reads a lease's name with
/// `devshare_import_name` (1.11 and later consumers; an older one gets the leases without). A
/// name that is too long or not UTF-8 is `DEVSHARE_STATUS_INVALID_ARGUMENT` naming its index,
/// and nothing is sent. The names travel in a message of their own right before the leases.
#[no_mangle]
pub unsafe extern "C" fn devshare_channel_send_named(
    channel: *mut DevshareChannel,
    peer: u64,
    exporters: *const *const DevshareExporter,
    descs: *const *const DevshareTensorDesc,
    names: *const *const c_char,
    count: usize,
) -> i32 {
    boundary("devshare_channel_send_named", || {
        // SAFETY: devshare_channel_send_named's contract is send_items'.
        unsafe { send_items(channel, peer, exporters, descs, names, count) }
    })
}

/// The work of `devshare_channel_send_batch` and `devshare_channel_send_named`.
///
/// # Safety
/// `exporters` and `descs` are NULL or point to `count` pointers each; `names` is NULL or points
/// to `count` pointers, each NULL or to a NUL-terminated string.
unsafe fn send_items(
    channel: *mut DevshareChannel,
    peer: u64,
    exporters: *const *const DevshareExporter,
    descs: *const *const DevshareTensorDesc,
    names: *const *const c_char,
    count: usize,
) -> crate::error::Result<()> {
    let ch = &ffi!(arg(channel, "channel"))?.0;
    let exps = ffi!(super::arg_slice(exporters, count, "exporters"))?;
    let ds = ffi!(super::arg_slice(descs, count, "descs"))?;
    let ns = if names.is_null() { &[][..] } else { ffi!(super::arg_slice(names, count, "names"))? };
    let mut texts: Vec<Option<&str>> = Vec::new();
    texts.try_reserve_exact(ns.len()).map_err(|_| Error::bad_size("count", format!("{count} names")))?;
    for (i, &n) in ns.iter().enumerate() {
        // SAFETY: the caller passes NULL or a NUL-terminated string (contract).
        texts.push(unsafe { name_at(n, i) }?);
    }
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
    ch.send_named(peer, &items, &texts)
}

/// `names[i]` of `devshare_channel_send_named`: NULL (no name), or a string read up to its NUL
/// and never more than `DEVSHARE_MAX_NAME_LEN` + 1 bytes, checked UTF-8.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string.
unsafe fn name_at<'a>(p: *const c_char, i: usize) -> crate::error::Result<Option<&'a str>> {
    if p.is_null() {
        return Ok(None);
    }
    let limit = crate::channel::limits::DEVSHARE_MAX_NAME_LEN;
    let mut len = 0;
    // SAFETY: every byte read is at or before the string's NUL (the loop stops there).
    while unsafe { *p.add(len) } != 0 {
        len += 1;
        if len > limit {
            return Err(Error::InvalidArgument(format!("names[{i}] is longer than {limit} bytes")));
        }
    }
    // SAFETY: the len bytes before the NUL were just read.
    let bytes = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) };
    crate::channel::wire::check_name(bytes)
        .map(Some)
        .map_err(|why| Error::InvalidArgument(format!("names[{i}]: {why}")))
}

/// Register `exporter` with `channel` (1.10): the leases of it sent over the channel tell each
/// consumer (1.10 and later) that it may keep the allocation mapped once it released them, so
/// that the next lease of the same allocation is a lookup instead of an open and a map; a
/// consumer keeps at most `DEVSHARE_KEEP_MAPPINGS` allocations (4096) and
/// `DEVSHARE_KEEP_MAPPINGS_BYTES` bytes (64 GiB) mapped that way, least recently used first.
/// `devshare_channel_unregister`, closing the channel or the consumer's connection ending lets
/// the consumers' mappings go; so does closing the exporter (1.20): each consumer is told before
/// any handle sent after the close reaches it, since a later export may reuse the closed one's
/// descriptor numbers (a segmented CUDA export's mapping is known by them). A remote
/// (`tcp://`) channel: `DEVSHARE_STATUS_UNSUPPORTED`.
#[no_mangle]
pub unsafe extern "C" fn devshare_channel_register(
    channel: *mut DevshareChannel,
    exporter: *const DevshareExporter,
) -> i32 {
    boundary("devshare_channel_register", || {
        let ch = &ffi!(arg(channel, "channel"))?.0;
        ch.register(&ffi!(arg(exporter, "exporter"))?.0)
    })
}

/// Undo `devshare_channel_register` (1.10): every consumer that kept the allocation mapped is
/// told to unmap it once it holds no lease of it. `DEVSHARE_STATUS_NOT_FOUND` when it is not
/// registered with this channel.
#[no_mangle]
pub unsafe extern "C" fn devshare_channel_unregister(
    channel: *mut DevshareChannel,
    exporter: *const DevshareExporter,
) -> i32 {
    boundary("devshare_channel_unregister", || {
        let ch = &ffi!(arg(channel, "channel"))?.0;
        ch.unregister(&ffi!(arg(exporter, "exporter"))?.0)
    })
}

/// Let `devshare_exporter_wait` on an export leased through `channel` poll the consumers'
/// returns for up to `spin_us` microseconds before it sleeps (1.16; see
/// `devshare_pool_set_spin`): for a producer thread that owns a CPU core, a lease that comes
/// back through a consumer's ring is then taken within about a microsecond instead of after the
/// scheduler wakes the thread. It burns its core while it spins. 0 (the default) sleeps at
/// once; at most `DEVSHARE_MAX_SPIN_US`. A wait with a shorter timeout spins only that long; a
/// wait for an export leased through several channels polls them all, for the longest of their
/// spins. A remote (`tcp://`) channel: `DEVSHARE_STATUS_UNSUPPORTED`.
#[no_mangle]
pub unsafe extern "C" fn devshare_channel_set_spin(channel: *mut DevshareChannel, spin_us: u32) -> i32 {
    boundary("devshare_channel_set_spin", || {
        ffi!(arg(channel, "channel"))?.0.set_spin(std::time::Duration::from_micros(u64::from(spin_us)))
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
