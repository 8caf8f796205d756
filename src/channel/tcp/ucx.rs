//! UCX's UCP API (`libucp.so.0`, which brings `libucs.so.0`), loaded at run time, as safe types:
//! [`Context`], [`Worker`], [`Endpoint`], [`MemRegion`], [`RemoteKey`], and [`probe`].
//!
//! `Ucp` is the only caller of UCX's raw symbols: one method per UCP call, named after it
//! (`ucp_put_nbx` → `Ucp::put_nbx`); every status that is not `UCS_OK` becomes an
//! [`Error::Vendor`] naming the call and saying what `ucs_status_string` says. It is loaded once
//! per process (`OnDemand`, as the vendor runtimes of `backend/` are) from
//! `DEVSHARE_UCX_LIBRARY` (the full path of a `libucp.so.0`, e.g. the one the `libucx-cu12`
//! wheel puts in `site-packages/libucx/lib/`), else by the loader's search for `libucp.so.0`,
//! then `libucp.so`.
//!
//! # Versions
//!
//! The structs below are written out with the layout of the UCX 1.13 headers, and every one has
//! a `field_mask` (`op_attr_mask`) in which only the fields devshare fills are set: UCX reads no
//! field whose bit is clear, which is what lets a struct of 1.13's size work with any later UCX
//! (1.22 has grown `ucp_params_t`, `ucp_mem_map_params_t` and `ucp_request_param_t` at their
//! ends). `ucp_init_version` only *warns* when the library is older than the API version asked
//! for, so [`Context::new`] checks `ucp_get_version` itself and refuses anything before 1.13.
//! `ucs_status_t` is a packed enum: one signed byte, in arguments and return values.
//! `tests/remote_ucx.rs` compares [`c_layout`] with `offsetof` in the real headers.
//!
//! # Threads
//!
//! The context is made with `mt_workers_shared` (its memory registrations may be made and
//! packed from any thread), so [`Context`] and [`MemRegion`] are `Send + Sync`. Workers are made
//! with `UCS_THREAD_MODE_SERIALIZED`: a pool's data path is driven by one thread at a time, so
//! [`Worker`] is `Send` but not `Sync`, and its endpoints and remote keys borrow it (they cannot
//! leave the thread that holds it). `SINGLE` would tie the worker to the thread that made it,
//! which Rust cannot express for a `Send` type; `MULTI` would take a lock in every call for
//! sharing that the types rule out.
//!
//! # Waiting
//!
//! Nothing here spins. A wait (a put, a flush, a close) progresses the worker until
//! `ucp_worker_progress` returns 0, arms it, and sleeps in `poll` on its event fd, for at most
//! the endpoint's time limit. A consumer drives its own worker the same way with
//! [`Worker::progress`], [`Worker::arm`] and [`Worker::efd`], next to its other descriptors.
//! Software transports (`tcp`) need the *target* to progress too: a put or flush towards a
//! consumer that does not progress its worker does not complete.

use crate::error::{Error, Result};
use crate::loader::{c_text, vendor_error, OnDemand, Symbols};
use static_assertions::const_assert_eq;
use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint, c_ulong, c_void, CString};
use std::mem::{offset_of, size_of};
use std::os::fd::{BorrowedFd, RawFd};
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicI8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The environment variable naming the `libucp.so.0` to load.
pub const LIBRARY_ENV: &str = "DEVSHARE_UCX_LIBRARY";

/// The oldest UCX devshare speaks (the layouts below are 1.13's).
const MIN_VERSION: (u32, u32) = (1, 13);

/// How long a put, flush or close waits by default ([`Endpoint::set_timeout`]).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest single sleep in `poll` while waiting, so that a lost wake-up costs a second and
/// not the whole time limit.
const MAX_SLEEP: Duration = Duration::from_secs(1);

// ---------------------------------------------------------------------------------------------
// The C types, with the layout of the UCX 1.13 headers (LP64)

/// `ucs_status_t`: `UCS_S_PACKED`, so one signed byte.
type Status = i8;
/// `ucs_status_ptr_t`: NULL (done), an error code cast to a pointer, or a request.
type StatusPtr = *mut c_void;
/// `ucp_config_t *`, `ucp_context_h`, `ucp_worker_h`, `ucp_ep_h`, `ucp_mem_h`, `ucp_rkey_h`:
/// opaque handles.
type Handle = *mut c_void;

const UCS_OK: Status = 0;
const UCS_INPROGRESS: Status = 1;
const UCS_ERR_IO_ERROR: Status = -3;
const UCS_ERR_UNREACHABLE: Status = -6;
const UCS_ERR_BUSY: Status = -15;
const UCS_ERR_CANCELED: Status = -16;
const UCS_ERR_CONNECTION_RESET: Status = -25;
const UCS_ERR_ENDPOINT_TIMEOUT: Status = -80;
/// `UCS_ERR_LAST`: a status pointer at or above `(uintptr_t)UCS_ERR_LAST` is an error code.
const UCS_ERR_LAST: isize = -100;

const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
const UCP_PARAM_FIELD_MT_WORKERS_SHARED: u64 = 1 << 5;
const UCP_PARAM_FIELD_NAME: u64 = 1 << 8;
const UCP_FEATURE_RMA: u64 = 1 << 1;
const UCP_FEATURE_WAKEUP: u64 = 1 << 4;

const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
/// `UCS_THREAD_MODE_SERIALIZED` (`SINGLE` is 0, `MULTI` 2).
const UCS_THREAD_MODE_SERIALIZED: c_int = 1;
const UCP_WORKER_ATTR_FIELD_ADDRESS: u64 = 1 << 1;

const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
const UCP_ERR_HANDLING_MODE_PEER: c_int = 1;

const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;

const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;

/// `ucp_params_t` (1.22 adds `node_local_id` at the end).
#[repr(C)]
struct UcpParams {
    field_mask: u64,
    features: u64,
    request_size: usize,
    request_init: *mut c_void,
    request_cleanup: *mut c_void,
    tag_sender_mask: u64,
    mt_workers_shared: c_int,
    estimated_num_eps: usize,
    estimated_num_ppn: usize,
    name: *const c_char,
}

/// The `unsigned long`s of a `ucs_cpu_set_t` (`UCS_CPU_SETSIZE`: 1024 bits).
const CPU_SET_WORDS: usize = 1024 / c_ulong::BITS as usize;

/// `ucp_worker_params_t`.
#[repr(C)]
struct WorkerParams {
    field_mask: u64,
    thread_mode: c_int,
    /// `ucs_cpu_set_t`.
    cpu_mask: [c_ulong; CPU_SET_WORDS],
    events: c_uint,
    user_data: *mut c_void,
    event_fd: c_int,
    flags: u64,
    name: *const c_char,
    am_alignment: usize,
    client_id: u64,
}

/// `ucp_worker_attr_t`.
#[repr(C)]
struct WorkerAttr {
    field_mask: u64,
    thread_mode: c_int,
    address_flags: u32,
    address: *mut c_void,
    address_length: usize,
    max_am_header: usize,
    /// `UCP_ENTITY_NAME_MAX`.
    name: [c_char; 32],
    max_debug_string: usize,
}

/// `ucp_err_handler_cb_t`.
type ErrHandlerCb = unsafe extern "C" fn(arg: *mut c_void, ep: Handle, status: Status);

/// `ucp_err_handler_t`.
#[repr(C)]
struct ErrHandler {
    cb: Option<ErrHandlerCb>,
    arg: *mut c_void,
}

/// `ucs_sock_addr_t`.
#[repr(C)]
struct SockAddr {
    addr: *const c_void,
    addrlen: u32,
}

/// `ucp_ep_params_t`.
#[repr(C)]
struct EpParams {
    field_mask: u64,
    address: *const c_void,
    err_mode: c_int,
    err_handler: ErrHandler,
    user_data: *mut c_void,
    flags: c_uint,
    sockaddr: SockAddr,
    conn_request: *mut c_void,
    name: *const c_char,
    local_sockaddr: SockAddr,
}

/// `ucp_mem_map_params_t` (1.22 adds `exported_memh_buffer` at the end).
#[repr(C)]
struct MemMapParams {
    field_mask: u64,
    address: *mut c_void,
    length: usize,
    flags: c_uint,
    prot: c_uint,
    memory_type: c_int,
}

/// `ucp_request_param_t` (1.22 adds `remote_datatype`, `remote`, `remote_count` at the end).
#[repr(C)]
struct RequestParam {
    op_attr_mask: u32,
    flags: u32,
    request: *mut c_void,
    /// A union of callback pointers; devshare sets none.
    cb: *mut c_void,
    datatype: u64,
    user_data: *mut c_void,
    reply_buffer: *mut c_void,
    memory_type: c_int,
    /// A union of pointers.
    recv_info: *mut c_void,
    memh: Handle,
}

const_assert_eq!(size_of::<Status>(), 1);
const_assert_eq!(size_of::<UcpParams>(), 80);
const_assert_eq!(offset_of!(UcpParams, features), 8);
const_assert_eq!(offset_of!(UcpParams, mt_workers_shared), 48);
const_assert_eq!(offset_of!(UcpParams, name), 72);
const_assert_eq!(size_of::<WorkerParams>(), 200);
const_assert_eq!(offset_of!(WorkerParams, thread_mode), 8);
const_assert_eq!(offset_of!(WorkerParams, cpu_mask), 16);
const_assert_eq!(offset_of!(WorkerParams, events), 144);
const_assert_eq!(offset_of!(WorkerParams, client_id), 192);
const_assert_eq!(size_of::<WorkerAttr>(), 80);
const_assert_eq!(offset_of!(WorkerAttr, address), 16);
const_assert_eq!(offset_of!(WorkerAttr, address_length), 24);
const_assert_eq!(offset_of!(WorkerAttr, max_debug_string), 72);
const_assert_eq!(size_of::<EpParams>(), 104);
const_assert_eq!(offset_of!(EpParams, err_mode), 16);
const_assert_eq!(offset_of!(EpParams, err_handler), 24);
const_assert_eq!(offset_of!(EpParams, flags), 48);
const_assert_eq!(offset_of!(EpParams, local_sockaddr), 88);
const_assert_eq!(size_of::<MemMapParams>(), 40);
const_assert_eq!(offset_of!(MemMapParams, length), 16);
const_assert_eq!(offset_of!(MemMapParams, prot), 28);
const_assert_eq!(offset_of!(MemMapParams, memory_type), 32);
const_assert_eq!(size_of::<RequestParam>(), 72);
const_assert_eq!(offset_of!(RequestParam, request), 8);
const_assert_eq!(offset_of!(RequestParam, memory_type), 48);
const_assert_eq!(offset_of!(RequestParam, memh), 64);

/// The layout devshare assumes, as `(name, value)` with the names a C program prints with
/// `offsetof` / `sizeof` against the real headers (`tests/remote_ucx.rs` does). Sizes are 1.13's:
/// a later header's struct may be larger, never different below them.
#[doc(hidden)]
pub fn c_layout() -> Vec<(&'static str, usize)> {
    macro_rules! o {
        ($t:ident, $c:literal, $f:ident) => {
            (concat!($c, ".", stringify!($f)), offset_of!($t, $f))
        };
    }
    vec![
        ("sizeof ucs_status_t", size_of::<Status>()),
        ("sizeof ucp_params_t", size_of::<UcpParams>()),
        o!(UcpParams, "ucp_params_t", field_mask),
        o!(UcpParams, "ucp_params_t", features),
        o!(UcpParams, "ucp_params_t", request_size),
        o!(UcpParams, "ucp_params_t", request_init),
        o!(UcpParams, "ucp_params_t", request_cleanup),
        o!(UcpParams, "ucp_params_t", tag_sender_mask),
        o!(UcpParams, "ucp_params_t", mt_workers_shared),
        o!(UcpParams, "ucp_params_t", estimated_num_eps),
        o!(UcpParams, "ucp_params_t", estimated_num_ppn),
        o!(UcpParams, "ucp_params_t", name),
        ("sizeof ucp_worker_params_t", size_of::<WorkerParams>()),
        o!(WorkerParams, "ucp_worker_params_t", field_mask),
        o!(WorkerParams, "ucp_worker_params_t", thread_mode),
        o!(WorkerParams, "ucp_worker_params_t", cpu_mask),
        o!(WorkerParams, "ucp_worker_params_t", events),
        o!(WorkerParams, "ucp_worker_params_t", user_data),
        o!(WorkerParams, "ucp_worker_params_t", event_fd),
        o!(WorkerParams, "ucp_worker_params_t", flags),
        o!(WorkerParams, "ucp_worker_params_t", name),
        o!(WorkerParams, "ucp_worker_params_t", am_alignment),
        o!(WorkerParams, "ucp_worker_params_t", client_id),
        ("sizeof ucp_worker_attr_t", size_of::<WorkerAttr>()),
        o!(WorkerAttr, "ucp_worker_attr_t", field_mask),
        o!(WorkerAttr, "ucp_worker_attr_t", thread_mode),
        o!(WorkerAttr, "ucp_worker_attr_t", address_flags),
        o!(WorkerAttr, "ucp_worker_attr_t", address),
        o!(WorkerAttr, "ucp_worker_attr_t", address_length),
        o!(WorkerAttr, "ucp_worker_attr_t", max_am_header),
        o!(WorkerAttr, "ucp_worker_attr_t", name),
        o!(WorkerAttr, "ucp_worker_attr_t", max_debug_string),
        ("sizeof ucp_err_handler_t", size_of::<ErrHandler>()),
        ("sizeof ucs_sock_addr_t", size_of::<SockAddr>()),
        ("sizeof ucp_ep_params_t", size_of::<EpParams>()),
        o!(EpParams, "ucp_ep_params_t", field_mask),
        o!(EpParams, "ucp_ep_params_t", address),
        o!(EpParams, "ucp_ep_params_t", err_mode),
        o!(EpParams, "ucp_ep_params_t", err_handler),
        o!(EpParams, "ucp_ep_params_t", user_data),
        o!(EpParams, "ucp_ep_params_t", flags),
        o!(EpParams, "ucp_ep_params_t", sockaddr),
        o!(EpParams, "ucp_ep_params_t", conn_request),
        o!(EpParams, "ucp_ep_params_t", name),
        o!(EpParams, "ucp_ep_params_t", local_sockaddr),
        ("sizeof ucp_mem_map_params_t", size_of::<MemMapParams>()),
        o!(MemMapParams, "ucp_mem_map_params_t", field_mask),
        o!(MemMapParams, "ucp_mem_map_params_t", address),
        o!(MemMapParams, "ucp_mem_map_params_t", length),
        o!(MemMapParams, "ucp_mem_map_params_t", flags),
        o!(MemMapParams, "ucp_mem_map_params_t", prot),
        o!(MemMapParams, "ucp_mem_map_params_t", memory_type),
        ("sizeof ucp_request_param_t", size_of::<RequestParam>()),
        o!(RequestParam, "ucp_request_param_t", op_attr_mask),
        o!(RequestParam, "ucp_request_param_t", flags),
        o!(RequestParam, "ucp_request_param_t", request),
        o!(RequestParam, "ucp_request_param_t", cb),
        o!(RequestParam, "ucp_request_param_t", datatype),
        o!(RequestParam, "ucp_request_param_t", user_data),
        o!(RequestParam, "ucp_request_param_t", reply_buffer),
        o!(RequestParam, "ucp_request_param_t", memory_type),
        o!(RequestParam, "ucp_request_param_t", recv_info),
        o!(RequestParam, "ucp_request_param_t", memh),
    ]
}

/// The constants devshare passes, by their C names, for the same comparison.
#[doc(hidden)]
pub fn c_constants() -> Vec<(&'static str, i64)> {
    vec![
        ("UCS_INPROGRESS", UCS_INPROGRESS.into()),
        ("UCS_ERR_IO_ERROR", UCS_ERR_IO_ERROR.into()),
        ("UCS_ERR_UNREACHABLE", UCS_ERR_UNREACHABLE.into()),
        ("UCS_ERR_BUSY", UCS_ERR_BUSY.into()),
        ("UCS_ERR_CANCELED", UCS_ERR_CANCELED.into()),
        ("UCS_ERR_CONNECTION_RESET", UCS_ERR_CONNECTION_RESET.into()),
        ("UCS_ERR_ENDPOINT_TIMEOUT", UCS_ERR_ENDPOINT_TIMEOUT.into()),
        ("UCS_ERR_LAST", UCS_ERR_LAST as i64),
        ("UCP_PARAM_FIELD_FEATURES", UCP_PARAM_FIELD_FEATURES as i64),
        ("UCP_PARAM_FIELD_MT_WORKERS_SHARED", UCP_PARAM_FIELD_MT_WORKERS_SHARED as i64),
        ("UCP_PARAM_FIELD_NAME", UCP_PARAM_FIELD_NAME as i64),
        ("UCP_FEATURE_RMA", UCP_FEATURE_RMA as i64),
        ("UCP_FEATURE_WAKEUP", UCP_FEATURE_WAKEUP as i64),
        ("UCP_WORKER_PARAM_FIELD_THREAD_MODE", UCP_WORKER_PARAM_FIELD_THREAD_MODE as i64),
        ("UCS_THREAD_MODE_SERIALIZED", UCS_THREAD_MODE_SERIALIZED.into()),
        ("UCP_WORKER_ATTR_FIELD_ADDRESS", UCP_WORKER_ATTR_FIELD_ADDRESS as i64),
        ("UCP_EP_PARAM_FIELD_REMOTE_ADDRESS", UCP_EP_PARAM_FIELD_REMOTE_ADDRESS as i64),
        ("UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE", UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE as i64),
        ("UCP_EP_PARAM_FIELD_ERR_HANDLER", UCP_EP_PARAM_FIELD_ERR_HANDLER as i64),
        ("UCP_ERR_HANDLING_MODE_PEER", UCP_ERR_HANDLING_MODE_PEER.into()),
        ("UCP_MEM_MAP_PARAM_FIELD_ADDRESS", UCP_MEM_MAP_PARAM_FIELD_ADDRESS as i64),
        ("UCP_MEM_MAP_PARAM_FIELD_LENGTH", UCP_MEM_MAP_PARAM_FIELD_LENGTH as i64),
        ("UCP_OP_ATTR_FIELD_FLAGS", UCP_OP_ATTR_FIELD_FLAGS.into()),
        ("UCP_EP_CLOSE_FLAG_FORCE", UCP_EP_CLOSE_FLAG_FORCE.into()),
    ]
}

impl UcpParams {
    fn unset() -> UcpParams {
        UcpParams {
            field_mask: 0,
            features: 0,
            request_size: 0,
            request_init: null_mut(),
            request_cleanup: null_mut(),
            tag_sender_mask: 0,
            mt_workers_shared: 0,
            estimated_num_eps: 0,
            estimated_num_ppn: 0,
            name: null(),
        }
    }
}

impl WorkerParams {
    fn unset() -> WorkerParams {
        WorkerParams {
            field_mask: 0,
            thread_mode: 0,
            cpu_mask: [0; CPU_SET_WORDS],
            events: 0,
            user_data: null_mut(),
            event_fd: -1,
            flags: 0,
            name: null(),
            am_alignment: 0,
            client_id: 0,
        }
    }
}

impl WorkerAttr {
    fn unset() -> WorkerAttr {
        WorkerAttr {
            field_mask: 0,
            thread_mode: 0,
            address_flags: 0,
            address: null_mut(),
            address_length: 0,
            max_am_header: 0,
            name: [0; 32],
            max_debug_string: 0,
        }
    }
}

impl EpParams {
    fn unset() -> EpParams {
        EpParams {
            field_mask: 0,
            address: null(),
            err_mode: 0,
            err_handler: ErrHandler { cb: None, arg: null_mut() },
            user_data: null_mut(),
            flags: 0,
            sockaddr: SockAddr { addr: null(), addrlen: 0 },
            conn_request: null_mut(),
            name: null(),
            local_sockaddr: SockAddr { addr: null(), addrlen: 0 },
        }
    }
}

impl MemMapParams {
    fn unset() -> MemMapParams {
        MemMapParams { field_mask: 0, address: null_mut(), length: 0, flags: 0, prot: 0, memory_type: 0 }
    }
}

impl RequestParam {
    /// No field set: no callback, no user request, contiguous bytes, memory type detected.
    fn unset() -> RequestParam {
        RequestParam {
            op_attr_mask: 0,
            flags: 0,
            request: null_mut(),
            cb: null_mut(),
            datatype: 0,
            user_data: null_mut(),
            reply_buffer: null_mut(),
            memory_type: 0,
            recv_info: null_mut(),
            memh: null_mut(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The typed wrapper: the only caller of raw symbols

/// The UCP functions devshare calls, with their C signatures from `ucp.h` / `status.h`.
struct Fns {
    get_version: unsafe extern "C" fn(*mut c_uint, *mut c_uint, *mut c_uint),
    get_version_string: unsafe extern "C" fn() -> *const c_char,
    status_string: unsafe extern "C" fn(Status) -> *const c_char,
    config_read: unsafe extern "C" fn(*const c_char, *const c_char, *mut Handle) -> Status,
    config_modify: unsafe extern "C" fn(Handle, *const c_char, *const c_char) -> Status,
    config_release: unsafe extern "C" fn(Handle),
    init_version: unsafe extern "C" fn(c_uint, c_uint, *const UcpParams, Handle, *mut Handle) -> Status,
    cleanup: unsafe extern "C" fn(Handle),
    worker_create: unsafe extern "C" fn(Handle, *const WorkerParams, *mut Handle) -> Status,
    worker_destroy: unsafe extern "C" fn(Handle),
    worker_query: unsafe extern "C" fn(Handle, *mut WorkerAttr) -> Status,
    worker_release_address: unsafe extern "C" fn(Handle, *mut c_void),
    worker_progress: unsafe extern "C" fn(Handle) -> c_uint,
    worker_get_efd: unsafe extern "C" fn(Handle, *mut c_int) -> Status,
    worker_arm: unsafe extern "C" fn(Handle) -> Status,
    ep_create: unsafe extern "C" fn(Handle, *const EpParams, *mut Handle) -> Status,
    ep_close_nbx: unsafe extern "C" fn(Handle, *const RequestParam) -> StatusPtr,
    ep_flush_nbx: unsafe extern "C" fn(Handle, *const RequestParam) -> StatusPtr,
    put_nbx: unsafe extern "C" fn(Handle, *const c_void, usize, u64, Handle, *const RequestParam) -> StatusPtr,
    request_check_status: unsafe extern "C" fn(*mut c_void) -> Status,
    request_free: unsafe extern "C" fn(*mut c_void),
    mem_map: unsafe extern "C" fn(Handle, *const MemMapParams, *mut Handle) -> Status,
    mem_unmap: unsafe extern "C" fn(Handle, Handle) -> Status,
    rkey_pack: unsafe extern "C" fn(Handle, Handle, *mut *mut c_void, *mut usize) -> Status,
    rkey_buffer_release: unsafe extern "C" fn(*mut c_void),
    ep_rkey_unpack: unsafe extern "C" fn(Handle, *const c_void, *mut Handle) -> Status,
    rkey_destroy: unsafe extern "C" fn(Handle),
}

/// The loaded UCP library.
struct Ucp {
    fns: Fns,
    /// The file it was loaded from (`dladdr`), else the name it loaded by.
    path: String,
    /// `ucp_get_version_string`.
    version: String,
    /// Keeps the functions above loaded.
    _lib: libloading::Library,
}

/// What a non-blocking call started.
enum Started {
    /// Done already (`UCS_OK`).
    Done,
    /// A request to wait for, then free.
    Pending(*mut c_void),
}

static UCP: OnDemand<Ucp> = OnDemand::new(Ucp::load);

/// The UCP library, loaded on first use.
fn api() -> Result<&'static Ucp> {
    UCP.get()
}

impl Ucp {
    /// Load the library, read its symbols and check its version.
    fn load() -> Result<Ucp> {
        let lib = Symbols::open(LIBRARY_ENV, &["libucp.so.0".to_string(), "libucp.so".to_string()])?;
        // SAFETY: each field's type is the C signature of the symbol named next to it, from the
        // UCX 1.13 headers (unchanged through 1.22; `ucp_rkey_pack`, `ucp_rkey_buffer_release`
        // are deprecated there but exported). `ucs_status_string` is `libucs`'s, found through
        // `libucp`'s dependencies.
        let fns = unsafe {
            Fns {
                get_version: lib.required("ucp_get_version")?,
                get_version_string: lib.required("ucp_get_version_string")?,
                status_string: lib.required("ucs_status_string")?,
                config_read: lib.required("ucp_config_read")?,
                config_modify: lib.required("ucp_config_modify")?,
                config_release: lib.required("ucp_config_release")?,
                init_version: lib.required("ucp_init_version")?,
                cleanup: lib.required("ucp_cleanup")?,
                worker_create: lib.required("ucp_worker_create")?,
                worker_destroy: lib.required("ucp_worker_destroy")?,
                worker_query: lib.required("ucp_worker_query")?,
                worker_release_address: lib.required("ucp_worker_release_address")?,
                worker_progress: lib.required("ucp_worker_progress")?,
                worker_get_efd: lib.required("ucp_worker_get_efd")?,
                worker_arm: lib.required("ucp_worker_arm")?,
                ep_create: lib.required("ucp_ep_create")?,
                ep_close_nbx: lib.required("ucp_ep_close_nbx")?,
                ep_flush_nbx: lib.required("ucp_ep_flush_nbx")?,
                put_nbx: lib.required("ucp_put_nbx")?,
                request_check_status: lib.required("ucp_request_check_status")?,
                request_free: lib.required("ucp_request_free")?,
                mem_map: lib.required("ucp_mem_map")?,
                mem_unmap: lib.required("ucp_mem_unmap")?,
                rkey_pack: lib.required("ucp_rkey_pack")?,
                rkey_buffer_release: lib.required("ucp_rkey_buffer_release")?,
                ep_rkey_unpack: lib.required("ucp_ep_rkey_unpack")?,
                rkey_destroy: lib.required("ucp_rkey_destroy")?,
            }
        };
        let path = loaded_from(fns.get_version_string as *const c_void).unwrap_or_else(|| lib.name().to_string());
        let (mut major, mut minor, mut release) = (0, 0, 0);
        // SAFETY: three valid out pointers.
        unsafe { (fns.get_version)(&mut major, &mut minor, &mut release) };
        // SAFETY: no arguments; the result is a static string (or NULL, read as empty).
        let version = unsafe { c_text((fns.get_version_string)()) };
        if major != MIN_VERSION.0 || minor < MIN_VERSION.1 {
            return Err(Error::BackendUnavailable(format!(
                "{path} is UCX {major}.{minor}.{release}; devshare needs UCX {}.{} or a later 1.x",
                MIN_VERSION.0, MIN_VERSION.1
            )));
        }
        Ok(Ucp { fns, path, version, _lib: lib.into_library() })
    }

    /// The error for `call` failing with `status`.
    fn error(&self, call: &str, status: Status) -> Error {
        // SAFETY: `ucs_status_string` takes any value and returns a static string.
        let meaning = unsafe { c_text((self.fns.status_string)(status)) };
        let hint = match status {
            UCS_ERR_UNREACHABLE => {
                "no transport of this UCX reaches the peer's: compare UCX_TLS and UCX_NET_DEVICES on both hosts"
            }
            UCS_ERR_CONNECTION_RESET => "the peer closed its worker or its process exited",
            UCS_ERR_ENDPOINT_TIMEOUT => "the peer stopped answering",
            UCS_ERR_CANCELED => "the endpoint was closed",
            _ => "",
        };
        vendor_error(call, status.into(), &meaning, hint, "", "UCX")
    }

    fn check(&self, call: &str, status: Status) -> Result<()> {
        if status == UCS_OK {
            Ok(())
        } else {
            Err(self.error(call, status))
        }
    }

    /// Decode a `ucs_status_ptr_t` (`UCS_PTR_IS_ERR`, `UCS_PTR_IS_PTR`).
    fn started(&self, call: &str, p: StatusPtr) -> Result<Started> {
        if p.is_null() {
            Ok(Started::Done)
        } else if (p as usize) >= (UCS_ERR_LAST as usize) {
            Err(self.error(call, p as isize as Status))
        } else {
            Ok(Started::Pending(p))
        }
    }

    /// `ucp_config_read` (the `UCX_*` environment), `ucp_config_modify` with each setting,
    /// `ucp_init_version` for RMA with wake-ups, shared by workers of several threads.
    fn init(&self, settings: &[(&str, &str)]) -> Result<Handle> {
        let mut config: Handle = null_mut();
        // SAFETY: NULL prefix and file read the defaults and the `UCX_` environment; valid out
        // pointer.
        self.check("ucp_config_read", unsafe { (self.fns.config_read)(null(), null(), &mut config) })?;
        let release = Release(|| {
            // SAFETY: `config` came from `ucp_config_read` and is released once, here.
            unsafe { (self.fns.config_release)(config) }
        });
        for (name, value) in settings {
            let text = |s: &str| {
                CString::new(s).map_err(|_| Error::InvalidArgument(format!("UCX setting {name}={value}: contains NUL")))
            };
            let (n, v) = (text(name)?, text(value)?);
            // SAFETY: a live config and two NUL-terminated strings that UCX copies.
            let status = unsafe { (self.fns.config_modify)(config, n.as_ptr(), v.as_ptr()) };
            self.check(&format!("ucp_config_modify({name}={value})"), status)?;
        }
        let params = UcpParams {
            field_mask: UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME,
            features: UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP,
            mt_workers_shared: 1,
            name: c"devshare".as_ptr(),
            ..UcpParams::unset()
        };
        let mut context: Handle = null_mut();
        // SAFETY: `params` has 1.13's layout with only the fields in its mask set (the name is a
        // static string); the config is live; valid out pointer.
        let status = unsafe { (self.fns.init_version)(MIN_VERSION.0, MIN_VERSION.1, &params, config, &mut context) };
        drop(release);
        self.check("ucp_init_version", status)?;
        Ok(context)
    }

    /// `ucp_cleanup`.
    ///
    /// # Safety
    /// `context` is live, without workers or registrations, and not used again.
    unsafe fn cleanup(&self, context: Handle) {
        // SAFETY: the caller's promise.
        unsafe { (self.fns.cleanup)(context) }
    }

    /// `ucp_worker_create`, serialized.
    ///
    /// # Safety
    /// `context` is live.
    unsafe fn worker_create(&self, context: Handle) -> Result<Handle> {
        let params = WorkerParams {
            field_mask: UCP_WORKER_PARAM_FIELD_THREAD_MODE,
            thread_mode: UCS_THREAD_MODE_SERIALIZED,
            ..WorkerParams::unset()
        };
        let mut worker: Handle = null_mut();
        // SAFETY: live context (the caller's promise); `params` has 1.13's layout with only the
        // thread mode set; valid out pointer.
        self.check("ucp_worker_create", unsafe { (self.fns.worker_create)(context, &params, &mut worker) })?;
        Ok(worker)
    }

    /// `ucp_worker_destroy`.
    ///
    /// # Safety
    /// `worker` is live, without endpoints or remote keys, and not used again.
    unsafe fn worker_destroy(&self, worker: Handle) {
        // SAFETY: the caller's promise.
        unsafe { (self.fns.worker_destroy)(worker) }
    }

    /// `ucp_worker_query` for the address, copied, then `ucp_worker_release_address`.
    ///
    /// # Safety
    /// `worker` is live.
    unsafe fn worker_address(&self, worker: Handle) -> Result<Vec<u8>> {
        let mut attr = WorkerAttr { field_mask: UCP_WORKER_ATTR_FIELD_ADDRESS, ..WorkerAttr::unset() };
        // SAFETY: live worker; `attr` has 1.13's layout and asks only for the address.
        self.check("ucp_worker_query", unsafe { (self.fns.worker_query)(worker, &mut attr) })?;
        if attr.address.is_null() || attr.address_length == 0 {
            return Err(Error::Internal("ucp_worker_query returned no address".into()));
        }
        // SAFETY: UCX returned `address_length` bytes at `address`, ours until released below.
        let bytes = unsafe { std::slice::from_raw_parts(attr.address as *const u8, attr.address_length) }.to_vec();
        // SAFETY: the address this worker's query returned, released once.
        unsafe { (self.fns.worker_release_address)(worker, attr.address) };
        Ok(bytes)
    }

    /// `ucp_worker_progress`.
    ///
    /// # Safety
    /// `worker` is live and no other thread is in a call on it.
    unsafe fn worker_progress(&self, worker: Handle) -> u32 {
        // SAFETY: the caller's promise.
        unsafe { (self.fns.worker_progress)(worker) }
    }

    /// `ucp_worker_get_efd`.
    ///
    /// # Safety
    /// `worker` is live.
    unsafe fn worker_get_efd(&self, worker: Handle) -> Result<RawFd> {
        let mut fd: c_int = -1;
        // SAFETY: live worker; valid out pointer.
        self.check("ucp_worker_get_efd", unsafe { (self.fns.worker_get_efd)(worker, &mut fd) })?;
        Ok(fd)
    }

    /// `ucp_worker_arm`: `UCS_OK` is armed, `UCS_ERR_BUSY` has events to progress first.
    ///
    /// # Safety
    /// `worker` is live and no other thread is in a call on it.
    unsafe fn worker_arm(&self, worker: Handle) -> Result<Arm> {
        // SAFETY: the caller's promise.
        match unsafe { (self.fns.worker_arm)(worker) } {
            UCS_OK => Ok(Arm::Armed),
            UCS_ERR_BUSY => Ok(Arm::Busy),
            status => Err(self.error("ucp_worker_arm", status)),
        }
    }

    /// `ucp_ep_create` to the worker at `address`, with peer error handling: `failed` is set to
    /// the endpoint's error status when UCX reports one.
    ///
    /// # Safety
    /// `worker` is live; `address` is a whole worker address from `ucp_worker_query` of a
    /// compatible UCX (UCX reads it without a length); `failed` outlives the endpoint.
    unsafe fn ep_create(&self, worker: Handle, address: &[u8], failed: *const AtomicI8) -> Result<Handle> {
        let params = EpParams {
            field_mask: UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | UCP_EP_PARAM_FIELD_ERR_HANDLER,
            address: address.as_ptr().cast(),
            err_mode: UCP_ERR_HANDLING_MODE_PEER,
            err_handler: ErrHandler { cb: Some(on_endpoint_error), arg: failed as *mut c_void },
            ..EpParams::unset()
        };
        let mut ep: Handle = null_mut();
        // SAFETY: the caller's promises; `params` has 1.13's layout with only its mask's fields
        // set; valid out pointer.
        self.check("ucp_ep_create", unsafe { (self.fns.ep_create)(worker, &params, &mut ep) })?;
        Ok(ep)
    }

    /// `ucp_ep_close_nbx`: flushing first, or at once with `force` (outstanding requests then
    /// complete with `UCS_ERR_CANCELED`).
    ///
    /// # Safety
    /// `ep` is live; it is not used again.
    unsafe fn ep_close_nbx(&self, ep: Handle, force: bool) -> Result<Started> {
        let mut param = RequestParam::unset();
        if force {
            param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
            param.flags = UCP_EP_CLOSE_FLAG_FORCE;
        }
        // SAFETY: the caller's promise; `param` has 1.13's layout with only its mask's fields.
        self.started("ucp_ep_close_nbx", unsafe { (self.fns.ep_close_nbx)(ep, &param) })
    }

    /// `ucp_ep_flush_nbx`: completes when every operation on `ep` completed at the target.
    ///
    /// # Safety
    /// `ep` is live.
    unsafe fn ep_flush_nbx(&self, ep: Handle) -> Result<Started> {
        let param = RequestParam::unset();
        // SAFETY: the caller's promise; no field set.
        self.started("ucp_ep_flush_nbx", unsafe { (self.fns.ep_flush_nbx)(ep, &param) })
    }

    /// `ucp_put_nbx` of `len` bytes at `local` to `remote` in the region of `rkey`.
    ///
    /// # Safety
    /// `ep` and `rkey` (unpacked on `ep`) are live; `local..local + len` stays readable until the
    /// returned request completes.
    unsafe fn put_nbx(&self, ep: Handle, local: *const u8, len: usize, remote: u64, rkey: Handle) -> Result<Started> {
        let param = RequestParam::unset();
        // SAFETY: the caller's promises; no field set (contiguous bytes, no callback).
        self.started("ucp_put_nbx", unsafe { (self.fns.put_nbx)(ep, local.cast(), len, remote, rkey, &param) })
    }

    /// `ucp_request_check_status`.
    ///
    /// # Safety
    /// `request` came from a call above and was not freed.
    unsafe fn request_check_status(&self, request: *mut c_void) -> Status {
        // SAFETY: the caller's promise.
        unsafe { (self.fns.request_check_status)(request) }
    }

    /// `ucp_request_free` (a request still running is freed when it completes).
    ///
    /// # Safety
    /// `request` came from a call above and is not used again.
    unsafe fn request_free(&self, request: *mut c_void) {
        // SAFETY: the caller's promise.
        unsafe { (self.fns.request_free)(request) }
    }

    /// `ucp_mem_map` of an existing buffer (memory type detected by UCX).
    ///
    /// # Safety
    /// `context` is live; the buffer stays allocated until the memory handle is unmapped.
    unsafe fn mem_map(&self, context: Handle, address: *mut u8, len: usize) -> Result<Handle> {
        let params = MemMapParams {
            field_mask: UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
            address: address.cast(),
            length: len,
            ..MemMapParams::unset()
        };
        let mut memh: Handle = null_mut();
        // SAFETY: the caller's promises; `params` has 1.13's layout with only its mask's fields.
        self.check("ucp_mem_map", unsafe { (self.fns.mem_map)(context, &params, &mut memh) })?;
        Ok(memh)
    }

    /// `ucp_mem_unmap`.
    ///
    /// # Safety
    /// `context` and `memh` (mapped in it) are live; `memh` is not used again.
    unsafe fn mem_unmap(&self, context: Handle, memh: Handle) -> Result<()> {
        // SAFETY: the caller's promise.
        self.check("ucp_mem_unmap", unsafe { (self.fns.mem_unmap)(context, memh) })
    }

    /// `ucp_rkey_pack`, copied, then `ucp_rkey_buffer_release`.
    ///
    /// # Safety
    /// `context` and `memh` (mapped in it) are live.
    unsafe fn rkey_pack(&self, context: Handle, memh: Handle) -> Result<Vec<u8>> {
        let mut buffer: *mut c_void = null_mut();
        let mut len = 0usize;
        // SAFETY: the caller's promise; valid out pointers.
        self.check("ucp_rkey_pack", unsafe { (self.fns.rkey_pack)(context, memh, &mut buffer, &mut len) })?;
        let bytes = if buffer.is_null() {
            Vec::new()
        } else {
            // SAFETY: UCX returned `len` bytes at `buffer`, ours until released below.
            let b = unsafe { std::slice::from_raw_parts(buffer as *const u8, len) }.to_vec();
            // SAFETY: the buffer `ucp_rkey_pack` returned, released once.
            unsafe { (self.fns.rkey_buffer_release)(buffer) };
            b
        };
        if bytes.is_empty() {
            return Err(Error::Internal("ucp_rkey_pack returned an empty key".into()));
        }
        Ok(bytes)
    }

    /// `ucp_ep_rkey_unpack`.
    ///
    /// # Safety
    /// `ep` is live; `packed` is a whole key from `ucp_rkey_pack` of a compatible UCX (UCX reads
    /// it without a length).
    unsafe fn ep_rkey_unpack(&self, ep: Handle, packed: &[u8]) -> Result<Handle> {
        let mut rkey: Handle = null_mut();
        // SAFETY: the caller's promises; valid out pointer.
        self.check("ucp_ep_rkey_unpack", unsafe { (self.fns.ep_rkey_unpack)(ep, packed.as_ptr().cast(), &mut rkey) })?;
        Ok(rkey)
    }

    /// `ucp_rkey_destroy`.
    ///
    /// # Safety
    /// `rkey` is live, no operation using it is running, and it is not used again.
    unsafe fn rkey_destroy(&self, rkey: Handle) {
        // SAFETY: the caller's promise.
        unsafe { (self.fns.rkey_destroy)(rkey) }
    }
}

/// Runs its closure when dropped.
struct Release<F: FnMut()>(F);

impl<F: FnMut()> Drop for Release<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// The file the function at `f` was loaded from.
fn loaded_from(f: *const c_void) -> Option<String> {
    // SAFETY: `Dl_info` is plain data (pointers and integers): all-zero is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: `f` is the address of a function of a loaded library; valid out pointer.
    if unsafe { libc::dladdr(f, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: `dli_fname` is the library's NUL-terminated name, valid while it is loaded.
    Some(unsafe { c_text(info.dli_fname) })
}

/// The endpoint error handler: records the status in the endpoint's flag.
unsafe extern "C" fn on_endpoint_error(arg: *mut c_void, _ep: Handle, status: Status) {
    // SAFETY: `arg` is the endpoint's `failed` flag, which outlives the endpoint in UCX (it is
    // leaked when a close does not finish).
    if let Some(flag) = unsafe { (arg as *const AtomicI8).as_ref() } {
        flag.store(if status == UCS_OK { UCS_ERR_IO_ERROR } else { status }, Ordering::Release);
    }
}

// ---------------------------------------------------------------------------------------------
// The safe types

/// `"UCX <version> at <path>"` when a UCX devshare can use loads, else why not
/// ([`Error::BackendUnavailable`]: not found, not UCX, or older than 1.13).
pub fn probe() -> Result<String> {
    let api = api()?;
    Ok(format!("UCX {} at {}", api.version, api.path))
}

/// The loaded UCX's version (`ucp_get_version_string`), loading it if need be.
pub fn version() -> Result<String> {
    Ok(api()?.version.clone())
}

struct ContextInner {
    api: &'static Ucp,
    context: Handle,
    /// [`crate::fork::generation`] of the process that made it.
    generation: u64,
}

/// A UCP context for RMA with wake-ups (`ucp_init_version`), cleaned up when its last clone,
/// worker and registration are gone. Clones share it.
#[derive(Clone)]
pub struct Context(Arc<ContextInner>);

// SAFETY: the context is made with `mt_workers_shared`: UCX makes its calls on it (registrations,
// packing keys, cleanup) safe from any thread.
unsafe impl Send for ContextInner {}
// SAFETY: as for Send.
unsafe impl Sync for ContextInner {}

impl Context {
    /// Load UCX if need be and make a context. `settings` are UCX configuration entries by their
    /// names without the `UCX_` prefix, e.g. `[("TLS", "tcp")]`, applied over the `UCX_*`
    /// environment.
    pub fn new(settings: &[(&str, &str)]) -> Result<Context> {
        let api = api()?;
        let context = api.init(settings)?;
        Ok(Context(Arc::new(ContextInner { api, context, generation: crate::fork::generation() })))
    }

    /// `"UCX <version> at <path>"`, as [`probe`] says.
    pub fn describe(&self) -> String {
        format!("UCX {} at {}", self.0.api.version, self.0.api.path)
    }

    fn api(&self) -> &'static Ucp {
        self.0.api
    }

    fn handle(&self) -> Handle {
        self.0.context
    }

    /// Whether this process was forked from the one that made the context: then it must not
    /// touch it (UCX objects do not survive `fork`), only forget it.
    fn inherited(&self) -> bool {
        self.0.generation != crate::fork::generation()
    }

    fn live(&self) -> Result<()> {
        if self.inherited() {
            return Err(Error::Unsupported(
                "this UCX context was made before fork(): a forked child must make its own".into(),
            ));
        }
        Ok(())
    }
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        if self.generation == crate::fork::generation() {
            // SAFETY: the last owner: every worker and registration held a clone.
            unsafe { self.api.cleanup(self.context) }
        }
    }
}

/// Whether [`Worker::arm`] armed the event fd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arm {
    /// Armed: sleep on [`Worker::efd`] until it is readable, then progress.
    Armed,
    /// Events are pending (`UCS_ERR_BUSY`): progress, then arm again.
    Busy,
}

/// A UCP worker (`ucp_worker_create`, `UCS_THREAD_MODE_SERIALIZED`): the progress engine of
/// its endpoints. `Send` (one thread at a time), not `Sync`.
pub struct Worker {
    context: Context,
    worker: Handle,
    efd: RawFd,
}

// SAFETY: the worker is made serialized: any thread may call it, one at a time, which `!Sync`
// and the borrows of its endpoints and keys ensure.
unsafe impl Send for Worker {}

impl Worker {
    /// A worker of `context`, with its event fd.
    pub fn new(context: &Context) -> Result<Worker> {
        context.live()?;
        let api = context.api();
        // SAFETY: the context is live (held by the clone the worker keeps).
        let worker = unsafe { api.worker_create(context.handle()) }?;
        // SAFETY: the worker was just made.
        match unsafe { api.worker_get_efd(worker) } {
            Ok(efd) => Ok(Worker { context: context.clone(), worker, efd }),
            Err(e) => {
                // SAFETY: made above, nothing uses it.
                unsafe { api.worker_destroy(worker) };
                Err(e)
            }
        }
    }

    /// The bytes a peer connects to this worker by ([`Endpoint::connect`]).
    pub fn address(&self) -> Result<Vec<u8>> {
        self.context.live()?;
        // SAFETY: our live worker.
        unsafe { self.context.api().worker_address(self.worker) }
    }

    /// The worker's event fd (`ucp_worker_get_efd`): readable after [`Worker::arm`] returned
    /// [`Arm::Armed`] and something happened. Owned by the worker.
    pub fn efd(&self) -> BorrowedFd<'_> {
        // SAFETY: UCX keeps the fd open until the worker is destroyed, which the borrow outlives
        // not.
        unsafe { BorrowedFd::borrow_raw(self.efd) }
    }

    /// `ucp_worker_arm`: call after [`Worker::progress`] returned 0, before sleeping on the fd.
    pub fn arm(&self) -> Result<Arm> {
        self.context.live()?;
        // SAFETY: our live worker; `!Sync` keeps other threads out.
        unsafe { self.context.api().worker_arm(self.worker) }
    }

    /// `ucp_worker_progress`: the number of events it handled (0 in a forked child).
    pub fn progress(&self) -> u32 {
        if self.context.inherited() {
            return 0;
        }
        // SAFETY: our live worker; `!Sync` keeps other threads out.
        unsafe { self.context.api().worker_progress(self.worker) }
    }

    /// Progress until `done` or `deadline`, sleeping on the event fd between events. Whether
    /// `done` became true.
    fn drive(&self, deadline: Instant, mut done: impl FnMut() -> bool) -> Result<bool> {
        loop {
            if done() {
                return Ok(true);
            }
            if self.progress() > 0 {
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(done());
            }
            if self.arm()? == Arm::Armed {
                sleep_on(self.efd(), (deadline - now).min(MAX_SLEEP))?;
            }
        }
    }

    /// Wait for `request` to complete; its final status, or `None` at `deadline` (it is freed
    /// either way).
    fn finish(&self, request: *mut c_void, deadline: Instant) -> Result<Option<Status>> {
        let api = self.context.api();
        let mut status = UCS_INPROGRESS;
        let waited = self.drive(deadline, || {
            // SAFETY: a request of this worker, freed only below.
            status = unsafe { api.request_check_status(request) };
            status != UCS_INPROGRESS
        });
        // SAFETY: as above; not used after this (a running request is freed when it completes).
        unsafe { api.request_free(request) };
        Ok(if waited? { Some(status) } else { None })
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if !self.context.inherited() {
            // SAFETY: our worker; its endpoints and keys borrowed it, so they are gone.
            unsafe { self.context.api().worker_destroy(self.worker) }
        }
    }
}

/// Sleep until `fd` is readable or `timeout` passed.
fn sleep_on(fd: BorrowedFd<'_>, timeout: Duration) -> Result<()> {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let ts = Timespec { tv_sec: timeout.as_secs() as i64, tv_nsec: i64::from(timeout.subsec_nanos()) };
    let mut fds = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
    match poll(&mut fds, Some(&ts)) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(Error::Os { call: "poll".into(), errno: e.raw_os_error(), message: e.to_string() }),
    }
}

/// A connection to a remote worker (`ucp_ep_create`, peer error handling), for puts. Closed on
/// drop: flushed, or forced when it failed, within its time limit.
pub struct Endpoint<'w> {
    worker: &'w Worker,
    ep: Handle,
    /// Set by UCX's error handler to the endpoint's error status (0: none).
    failed: Box<AtomicI8>,
    /// `None` while open; once closed, whether UCX finished the close in time.
    closed: Cell<Option<bool>>,
    timeout: Duration,
}

impl<'w> Endpoint<'w> {
    /// Connect `worker` to the worker whose [`Worker::address`] is `remote_address`. Wire-up
    /// finishes as the workers progress.
    ///
    /// # Safety
    /// `remote_address` is a whole address from [`Worker::address`] of a UCX of the same 1.x
    /// family, unchanged: UCX parses it without a length (`ucp_ep_params_t` has none), so a
    /// truncated or forged address is undefined behaviour. Check its length and origin first.
    pub unsafe fn connect(worker: &'w Worker, remote_address: &[u8]) -> Result<Endpoint<'w>> {
        worker.context.live()?;
        if remote_address.is_empty() {
            return Err(Error::InvalidArgument("empty UCX worker address".into()));
        }
        let failed = Box::new(AtomicI8::new(0));
        // SAFETY: our live worker; the address is the caller's promise; the flag is boxed and
        // outlives the endpoint (freed after the close completes, else leaked).
        let ep = unsafe { worker.context.api().ep_create(worker.worker, remote_address, &*failed) }?;
        Ok(Endpoint { worker, ep, failed, closed: Cell::new(None), timeout: DEFAULT_TIMEOUT })
    }

    /// How long [`Endpoint::put`], [`Endpoint::flush`] and the close on drop wait.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Whether the endpoint was closed after a failure (every call then fails).
    pub fn is_closed(&self) -> bool {
        self.closed.get().is_some()
    }

    fn api(&self) -> &'static Ucp {
        self.worker.context.api()
    }

    /// `Ok` when the endpoint may be used for `call`.
    fn usable(&self, call: &str) -> Result<()> {
        self.worker.context.live()?;
        if self.closed.get().is_some() {
            return Err(Error::Closed(format!("{call}: the UCX endpoint was closed after an earlier failure")));
        }
        match self.failed.load(Ordering::Acquire) {
            UCS_OK => Ok(()),
            status => Err(self.api().error(&format!("{call} (the endpoint failed earlier)"), status)),
        }
    }

    /// Unpack the remote key a peer packed ([`MemRegion::pack_rkey`]) for its region of
    /// `remote_len` bytes at `remote_base`; puts through it are checked against that range.
    ///
    /// # Safety
    /// `packed` is a whole key from [`MemRegion::pack_rkey`] of a UCX of the same 1.x family,
    /// unchanged: UCX parses it without a length. Check its length and origin first.
    pub unsafe fn unpack_rkey(&self, packed: &[u8], remote_base: u64, remote_len: usize) -> Result<RemoteKey<'_>> {
        self.usable("ucp_ep_rkey_unpack")?;
        if packed.is_empty() {
            return Err(Error::InvalidArgument("empty UCX remote key".into()));
        }
        if remote_base.checked_add(remote_len as u64).is_none() {
            return Err(Error::InvalidArgument(format!(
                "remote region of {remote_len} bytes at {remote_base:#x} overflows"
            )));
        }
        // SAFETY: our live endpoint; the key is the caller's promise.
        let rkey = unsafe { self.api().ep_rkey_unpack(self.ep, packed) }?;
        Ok(RemoteKey { ep: self, rkey, base: remote_base, len: remote_len })
    }

    /// Put `len` bytes at `local` to `remote_addr` of the peer's region of `rkey`
    /// (`ucp_put_nbx`), and wait until the source may be reused (local completion; use
    /// [`Endpoint::flush`] for remote completion). On a timeout the endpoint is closed at once
    /// (forced), which cancels the put, and the call fails with [`Error::Timeout`].
    ///
    /// # Safety
    /// `local..local + len` is memory of this process (host, or device memory this UCX
    /// supports) that stays readable until this call returns, and, when it returns an error,
    /// until the endpoint is dropped.
    pub unsafe fn put(&self, local: *const u8, len: usize, remote_addr: u64, rkey: &RemoteKey<'_>) -> Result<()> {
        self.usable("ucp_put_nbx")?;
        if !std::ptr::eq(rkey.ep, self) {
            return Err(Error::InvalidArgument("the remote key was unpacked on another endpoint".into()));
        }
        rkey.check(remote_addr, len)?;
        if len == 0 {
            return Ok(());
        }
        if local.is_null() {
            return Err(Error::NullArgument("local"));
        }
        // SAFETY: our live endpoint and its live key; the source is the caller's promise, kept
        // until the request completed or the endpoint was force-closed (`complete`).
        let started = unsafe { self.api().put_nbx(self.ep, local, len, remote_addr, rkey.rkey) };
        self.complete("ucp_put_nbx", started)
    }

    /// Wait until every put on this endpoint completed at the target (`ucp_ep_flush_nbx`): after
    /// this, the bytes are in the peer's memory. Fails as [`Endpoint::put`] does.
    pub fn flush(&self) -> Result<()> {
        self.usable("ucp_ep_flush_nbx")?;
        // SAFETY: our live endpoint.
        let started = unsafe { self.api().ep_flush_nbx(self.ep) };
        self.complete("ucp_ep_flush_nbx", started)
    }

    /// Wait for what `call` started; on a failure or timeout, close the endpoint (forced).
    fn complete(&self, call: &str, started: Result<Started>) -> Result<()> {
        let request = match started {
            Ok(Started::Done) => return Ok(()),
            Ok(Started::Pending(r)) => r,
            Err(e) => {
                self.force_close();
                return Err(e);
            }
        };
        match self.worker.finish(request, Instant::now() + self.timeout) {
            Ok(Some(UCS_OK)) => Ok(()),
            Ok(Some(status)) => {
                self.force_close();
                Err(self.api().error(call, status))
            }
            Ok(None) => {
                self.force_close();
                Err(Error::Timeout(format!(
                    "{call} did not complete within {:?} (does the peer progress its worker?); the endpoint was closed",
                    self.timeout
                )))
            }
            Err(e) => {
                self.force_close();
                Err(e)
            }
        }
    }

    /// Close now, cancelling what is outstanding.
    fn force_close(&self) {
        self.close(true);
    }

    /// `ucp_ep_close_nbx` (flushing first, or forced) unless closed already, and wait for it
    /// within the time limit.
    fn close(&self, force: bool) {
        if self.closed.get().is_some() {
            return;
        }
        self.closed.set(Some(false));
        // SAFETY: our live endpoint, marked closed above so nothing uses it again.
        let finished = match unsafe { self.api().ep_close_nbx(self.ep, force) } {
            Ok(Started::Done) => true,
            Ok(Started::Pending(r)) => matches!(self.worker.finish(r, Instant::now() + self.timeout), Ok(Some(_))),
            Err(_) => false,
        };
        self.closed.set(Some(finished));
    }
}

impl Drop for Endpoint<'_> {
    fn drop(&mut self) {
        if self.worker.context.inherited() {
            return;
        }
        self.close(self.failed.load(Ordering::Acquire) != UCS_OK);
        if self.closed.get() != Some(true) {
            // UCX may still call the error handler with the flag: leave it to UCX.
            let flag = std::mem::replace(&mut self.failed, Box::new(AtomicI8::new(0)));
            Box::leak(flag);
        }
    }
}

/// A peer's region as this endpoint may put into it (`ucp_ep_rkey_unpack`; `ucp_rkey_destroy`
/// on drop).
pub struct RemoteKey<'e> {
    ep: &'e Endpoint<'e>,
    rkey: Handle,
    base: u64,
    len: usize,
}

impl RemoteKey<'_> {
    /// The region's start in the peer's address space.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// The region's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `Ok` when `len` bytes at `addr` lie in the region.
    fn check(&self, addr: u64, len: usize) -> Result<()> {
        let inside =
            addr >= self.base && (addr - self.base).checked_add(len as u64).is_some_and(|end| end <= self.len as u64);
        if inside {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "a put of {len} bytes at {addr:#x} leaves the remote region of {} bytes at {:#x}",
                self.len, self.base
            )))
        }
    }
}

impl Drop for RemoteKey<'_> {
    fn drop(&mut self) {
        if !self.ep.worker.context.inherited() {
            // SAFETY: our key; puts through it waited for completion or were cancelled by a
            // forced close.
            unsafe { self.ep.api().rkey_destroy(self.rkey) }
        }
    }
}

/// A buffer of this process registered with UCX (`ucp_mem_map`), so that peers holding its
/// packed key can put into it; unmapped on drop.
pub struct MemRegion {
    context: Context,
    memh: Handle,
    address: u64,
    len: usize,
}

// SAFETY: registrations belong to the context, which is made thread-safe (`mt_workers_shared`).
unsafe impl Send for MemRegion {}
// SAFETY: as for Send; the only call through `&self` is packing a key.
unsafe impl Sync for MemRegion {}

impl MemRegion {
    /// Register the `len` bytes at `address`.
    ///
    /// # Safety
    /// The memory stays allocated until the region is dropped. Peers holding its key write it
    /// whenever a worker of `context` progresses: no Rust reference to those bytes may be held
    /// across progress, and what arrived is known only from the control channel.
    pub unsafe fn map(context: &Context, address: *mut u8, len: usize) -> Result<MemRegion> {
        context.live()?;
        if address.is_null() {
            return Err(Error::NullArgument("address"));
        }
        if len == 0 {
            return Err(Error::InvalidArgument("an empty UCX memory region".into()));
        }
        // SAFETY: live context; the memory is the caller's promise.
        let memh = unsafe { context.api().mem_map(context.handle(), address, len) }?;
        Ok(MemRegion { context: context.clone(), memh, address: address as u64, len })
    }

    /// The key a peer unpacks to put into this region ([`Endpoint::unpack_rkey`]).
    pub fn pack_rkey(&self) -> Result<Vec<u8>> {
        self.context.live()?;
        // SAFETY: our live context and registration.
        unsafe { self.context.api().rkey_pack(self.context.handle(), self.memh) }
    }

    /// Where the region starts, as peers name it.
    pub fn address(&self) -> u64 {
        self.address
    }

    /// The region's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never: [`MemRegion::map`] refuses that).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for MemRegion {
    fn drop(&mut self) {
        if !self.context.inherited() {
            // SAFETY: our registration in our live context; nothing to do about a failure.
            let _ = unsafe { self.context.api().mem_unmap(self.context.handle(), self.memh) };
        }
    }
}
