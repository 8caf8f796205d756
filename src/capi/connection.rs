//! The consumer's end of a channel (`crate::channel::Connection`): connect, receive items (as an
//! import, as a `DevshareItem` with what a receive loop reads of it, or through
//! `DevshareRecvArgs`), close.

use super::abi::{init, sized_struct, write_output};
use super::import::DevshareImport;
use super::{address, arg, arg_mut, boundary, boundary_value, timeout};
use crate::channel::Connection;
use crate::error::{Error, Result};
use std::ffi::{c_char, c_void};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Mutex;

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
/// `devshare_connection_fd` and receives): a send waits for room at most 10 s, and a large
/// item, once begun, is cut off when this process reads nothing of it for 10 s or reads it
/// slower than the producer's `DEVSHARE_REMOTE_MIN_RATE` (docs/remote.md). Waits at most
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

/// Let `devshare_connection_recv` poll for an item for up to `spin_us` microseconds before it
/// sleeps (see `devshare_pool_set_spin`); 0 (the default) adds no spin of its own (the receive
/// still polls for up to 50 µs while the producer is awake on another CPU, as
/// `devshare_pool_set_spin` says); at most `DEVSHARE_MAX_SPIN_US`. A receive with a shorter
/// timeout spins only that long.
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
/// host until the event completed (so CUDA's legacy default stream, whose handle is also NULL,
/// is named `CU_STREAM_LEGACY` here). Host items are unaffected. A stream of another device
/// makes the receive of such an item fail with the runtime's error.
#[no_mangle]
pub unsafe extern "C" fn devshare_connection_set_stream(conn: *mut DevshareConnection, stream: *mut c_void) -> i32 {
    boundary("devshare_connection_set_stream", || {
        ffi!(arg(conn, "conn"))?.0.set_stream(stream)?;
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
    /// (1.15) The name the producer sent with this lease (`devshare_channel_send_named`): a
    /// NUL-terminated UTF-8 string valid until the import is released, or NULL (none, or a
    /// pool item), as `devshare_import_name` reports it, so that a batch's names cost no call
    /// each. Written only when the caller's struct has room for it.
    pub name: *const c_char,
    /// (1.15) The name's length in bytes, without the NUL (0 when `name` is NULL).
    pub name_len: u64,
}

sized_struct!(
    DevshareItem,
    "DevshareItem",
    first_size = 184,
    sum = 4 * 2 + 8 + 4 * 3 + 2 * 2 + 4 + 4 + 8 + 8 + 8 * 2 * crate::handle::DEVSHARE_MAX_NDIM + 8 + 8 + 8,
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
        layout_id: 0,
        name: std::ptr::null(),
        name_len: 0
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
        // Released where it lies (a pool item's box is kept for the slot's next item).
        // SAFETY: the caller hands over an import from Box::into_raw (devshare_import,
        // devshare_connection_recv ...), released once: here.
        crate::import::Import::release_boxed(unsafe { Box::from_raw(release) }.into_boxed_import());
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

/// Receive a batch (1.11): the next `n` items into `items[0..n]`, in the order they were sent (a
/// producer's `devshare_channel_send_batch` / `_send_named` of `n` tensors), each as
/// `devshare_connection_recv_item` writes one. Every element must be initialised with
/// `devshare_item_init(&items[i], sizeof items[i])` (the array's stride is `items[0].struct_size`;
/// an element with another `struct_size` is refused, 1.19, before anything is received).
/// `timeout_ms` bounds the whole batch (negative: no limit). On any failure (a timeout, the
/// producer gone, a refused item) the items received so far are released, their `import` set to
/// NULL, and the status says why (a timeout how many had arrived); none is lost (each went back
/// to the producer). Release a batch
/// with `devshare_items_release`. `n` 0 does nothing.
#[no_mangle]
pub unsafe extern "C" fn devshare_connection_recv_batch(
    conn: *mut DevshareConnection,
    timeout_ms: i32,
    items: *mut DevshareItem,
    n: usize,
) -> i32 {
    boundary("devshare_connection_recv_batch", || {
        ffi!(arg(conn, "conn"))?;
        if n == 0 {
            return Ok(());
        }
        // SAFETY: the caller passes n initialised items (contract).
        let stride = unsafe { item_stride(items, n) }?;
        // SAFETY: as just checked.
        unsafe { same_item_sizes(items, n, stride) }?;
        let deadline = timeout(timeout_ms).map(|t| std::time::Instant::now() + t);
        for i in 0..n {
            let left = match deadline {
                None => -1,
                Some(d) => {
                    d.saturating_duration_since(std::time::Instant::now()).as_millis().min(i32::MAX as u128) as i32
                }
            };
            // SAFETY: element i of n elements of `stride` bytes (item_stride checked the total).
            let item = unsafe { items.cast::<u8>().add(i * stride) }.cast::<DevshareItem>();
            // SAFETY: as devshare_connection_recv_item's contract, for element i.
            if let Err(e) = unsafe { recv_item(conn, left, std::ptr::null_mut(), item) } {
                // SAFETY: the first i elements hold what this call received.
                unsafe { release_items(items, i, stride) };
                return Err(match e {
                    Error::Timeout(why) if i > 0 => Error::Timeout(format!(
                        "{i} of the batch's {n} items arrived in time (given back, as the batch is), then {why}"
                    )),
                    e => e,
                });
            }
        }
        Ok(())
    })
}

/// Release the imports of `items[0..n]` (a batch from `devshare_connection_recv_batch`, or items
/// from `devshare_connection_recv_item`; 1.11) in one call, as `devshare_import_release` does
/// for each, and set each `import` to NULL (and, 1.15, its `name` to NULL and `name_len` to 0
/// where the struct has them); a NULL `import` is skipped, so releasing twice does nothing. The
/// array's stride is `items[0].struct_size`.
#[no_mangle]
pub unsafe extern "C" fn devshare_items_release(items: *mut DevshareItem, n: usize) -> i32 {
    boundary("devshare_items_release", || {
        if n == 0 {
            return Ok(());
        }
        // SAFETY: the caller passes n items (contract).
        let stride = unsafe { item_stride(items, n) }?;
        // SAFETY: as just checked.
        unsafe { release_items(items, n, stride) };
        Ok(())
    })
}

/// The stride of an array of `n` items: its first element's `struct_size`, checked.
///
/// # Safety
/// `items` is NULL or points to at least 4 readable bytes.
unsafe fn item_stride(items: *mut DevshareItem, n: usize) -> Result<usize> {
    if items.is_null() {
        return Err(Error::NullArgument("items"));
    }
    // SAFETY: non-NULL, at least 4 readable bytes (contract).
    let stride = unsafe { items.cast::<u32>().read_unaligned() } as usize;
    let first = <DevshareItem as super::abi::SizedStruct>::FIRST_SIZE;
    if stride < first || stride % 8 != 0 {
        return Err(Error::InvalidArgument(format!(
            "items[0].struct_size is {stride}: initialise every item with devshare_item_init(&items[i], sizeof items[i])"
        )));
    }
    if stride.checked_mul(n).map_or(true, |t| t > isize::MAX as usize) {
        return Err(Error::InvalidArgument(format!("{n} items of {stride} bytes is larger than any array")));
    }
    Ok(stride)
}

/// That every element of `items[0..n]` (stride `stride`) says `stride` is its `struct_size`: a
/// receive writes each element as its own `struct_size` says, so one that differs would be
/// written past its place in the array.
///
/// # Safety
/// `items` points to `n` elements of `stride` bytes ([`item_stride`] checked the total).
unsafe fn same_item_sizes(items: *mut DevshareItem, n: usize, stride: usize) -> Result<()> {
    for i in 1..n {
        // SAFETY: element i of n elements of `stride` bytes (contract), its first 4 bytes.
        let size = unsafe { items.cast::<u8>().add(i * stride).cast::<u32>().read_unaligned() } as usize;
        if size != stride {
            return Err(Error::InvalidArgument(format!(
                "items[{i}].struct_size is {size}, items[0].struct_size {stride}: initialise every item with \
                 devshare_item_init(&items[i], sizeof items[i])"
            )));
        }
    }
    Ok(())
}

/// Release `items[0..n]`'s imports (stride `stride`) and set them to NULL.
///
/// # Safety
/// `items` points to `n` writable elements of `stride` bytes, each an initialised DevshareItem
/// whose `import` is NULL or an import handed out by this library and not released.
unsafe fn release_items(items: *mut DevshareItem, n: usize, stride: usize) {
    // Given back first, all at once (the leases of a connection in as few messages as it
    // takes), then released one by one (which then sends nothing).
    let import_at = |i: usize| {
        // SAFETY: element i (contract); `import` is at the same offset in every caller's struct.
        unsafe {
            items
                .cast::<u8>()
                .add(i * stride + std::mem::offset_of!(DevshareItem, import))
                .cast::<*mut DevshareImport>()
        }
    };
    // SAFETY: as above; each non-NULL import is live until released below.
    let held = (0..n).filter_map(|i| unsafe { import_at(i).read_unaligned().as_ref() }.map(|imp| imp.inner()));
    crate::channel::Connection::give_back_all(held);
    let (name, len) = (std::mem::offset_of!(DevshareItem, name), std::mem::offset_of!(DevshareItem, name_len));
    for i in 0..n {
        let slot = import_at(i);
        // SAFETY: as above.
        let imp = unsafe { slot.read_unaligned() };
        if !imp.is_null() {
            // SAFETY: an import from Box::into_raw, released once, where it lies (a pool item's
            // box is kept for the slot's next item): here (the field is cleared).
            crate::import::Import::release_boxed(unsafe { Box::from_raw(imp) }.into_boxed_import());
            // SAFETY: as above.
            unsafe { slot.write_unaligned(std::ptr::null_mut()) };
            // The name lived in the lease: cleared too, where the caller's struct has it.
            if stride >= len + 8 {
                // SAFETY: element i has both fields (its stride covers them).
                unsafe {
                    let at = items.cast::<u8>().add(i * stride);
                    at.add(name).cast::<*const std::ffi::c_char>().write_unaligned(std::ptr::null());
                    at.add(len).cast::<u64>().write_unaligned(0);
                }
            }
        }
    }
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
                crate::import::Import::release_boxed(unsafe { Box::from_raw(release) }.into_boxed_import());
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
        name: i.name().map_or(std::ptr::null(), |n| n.as_ptr()),
        name_len: i.name().map_or(0, |n| n.to_bytes().len() as u64),
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
