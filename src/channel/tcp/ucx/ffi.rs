//! UCX's C types, written out with the layout of the UCX 1.13 headers (LP64), their field masks
//! and constants, checked at compile time (`const_assert_eq!`) and against the real headers by
//! `tests/remote_ucx.rs` ([`c_layout`], [`c_constants`]).

use super::*;

// ---------------------------------------------------------------------------------------------
// The C types, with the layout of the UCX 1.13 headers (LP64)

/// `ucs_status_t`: `UCS_S_PACKED`, so one signed byte.
pub(super) type Status = i8;
/// `ucs_status_ptr_t`: NULL (done), an error code cast to a pointer, or a request.
pub(super) type StatusPtr = *mut c_void;
/// `ucp_config_t *`, `ucp_context_h`, `ucp_worker_h`, `ucp_ep_h`, `ucp_mem_h`, `ucp_rkey_h`:
/// opaque handles.
pub(super) type Handle = *mut c_void;

pub(super) const UCS_OK: Status = 0;
pub(super) const UCS_INPROGRESS: Status = 1;
pub(super) const UCS_ERR_IO_ERROR: Status = -3;
pub(super) const UCS_ERR_UNREACHABLE: Status = -6;
pub(super) const UCS_ERR_BUSY: Status = -15;
pub(super) const UCS_ERR_CANCELED: Status = -16;
pub(super) const UCS_ERR_CONNECTION_RESET: Status = -25;
pub(super) const UCS_ERR_ENDPOINT_TIMEOUT: Status = -80;
/// `UCS_ERR_LAST`: a status pointer at or above `(uintptr_t)UCS_ERR_LAST` is an error code.
pub(super) const UCS_ERR_LAST: isize = -100;

pub(super) const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub(super) const UCP_PARAM_FIELD_MT_WORKERS_SHARED: u64 = 1 << 5;
pub(super) const UCP_PARAM_FIELD_NAME: u64 = 1 << 8;
pub(super) const UCP_FEATURE_RMA: u64 = 1 << 1;
pub(super) const UCP_FEATURE_WAKEUP: u64 = 1 << 4;

pub(super) const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
/// `UCS_THREAD_MODE_SERIALIZED` (`SINGLE` is 0, `MULTI` 2).
pub(super) const UCS_THREAD_MODE_SERIALIZED: c_int = 1;
pub(super) const UCP_WORKER_ATTR_FIELD_ADDRESS: u64 = 1 << 1;

pub(super) const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub(super) const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub(super) const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
pub(super) const UCP_ERR_HANDLING_MODE_PEER: c_int = 1;

pub(super) const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
pub(super) const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;

pub(super) const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub(super) const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;

/// `ucp_params_t` (1.22 adds `node_local_id` at the end).
#[repr(C)]
pub(super) struct UcpParams {
    pub(super) field_mask: u64,
    pub(super) features: u64,
    pub(super) request_size: usize,
    pub(super) request_init: *mut c_void,
    pub(super) request_cleanup: *mut c_void,
    pub(super) tag_sender_mask: u64,
    pub(super) mt_workers_shared: c_int,
    pub(super) estimated_num_eps: usize,
    pub(super) estimated_num_ppn: usize,
    pub(super) name: *const c_char,
}

/// The `unsigned long`s of a `ucs_cpu_set_t` (`UCS_CPU_SETSIZE`: 1024 bits).
pub(super) const CPU_SET_WORDS: usize = 1024 / c_ulong::BITS as usize;

/// `ucp_worker_params_t`.
#[repr(C)]
pub(super) struct WorkerParams {
    pub(super) field_mask: u64,
    pub(super) thread_mode: c_int,
    /// `ucs_cpu_set_t`.
    pub(super) cpu_mask: [c_ulong; CPU_SET_WORDS],
    pub(super) events: c_uint,
    pub(super) user_data: *mut c_void,
    pub(super) event_fd: c_int,
    pub(super) flags: u64,
    pub(super) name: *const c_char,
    pub(super) am_alignment: usize,
    pub(super) client_id: u64,
}

/// `ucp_worker_attr_t`.
#[repr(C)]
pub(super) struct WorkerAttr {
    pub(super) field_mask: u64,
    pub(super) thread_mode: c_int,
    pub(super) address_flags: u32,
    pub(super) address: *mut c_void,
    pub(super) address_length: usize,
    pub(super) max_am_header: usize,
    /// `UCP_ENTITY_NAME_MAX`.
    pub(super) name: [c_char; 32],
    pub(super) max_debug_string: usize,
}

/// `ucp_err_handler_cb_t`.
pub(super) type ErrHandlerCb = unsafe extern "C" fn(arg: *mut c_void, ep: Handle, status: Status);

/// `ucp_err_handler_t`.
#[repr(C)]
pub(super) struct ErrHandler {
    pub(super) cb: Option<ErrHandlerCb>,
    pub(super) arg: *mut c_void,
}

/// `ucs_sock_addr_t`.
#[repr(C)]
pub(super) struct SockAddr {
    pub(super) addr: *const c_void,
    pub(super) addrlen: u32,
}

/// `ucp_ep_params_t`.
#[repr(C)]
pub(super) struct EpParams {
    pub(super) field_mask: u64,
    pub(super) address: *const c_void,
    pub(super) err_mode: c_int,
    pub(super) err_handler: ErrHandler,
    pub(super) user_data: *mut c_void,
    pub(super) flags: c_uint,
    pub(super) sockaddr: SockAddr,
    pub(super) conn_request: *mut c_void,
    pub(super) name: *const c_char,
    pub(super) local_sockaddr: SockAddr,
}

/// `ucp_mem_map_params_t` (1.22 adds `exported_memh_buffer` at the end).
#[repr(C)]
pub(super) struct MemMapParams {
    pub(super) field_mask: u64,
    pub(super) address: *mut c_void,
    pub(super) length: usize,
    pub(super) flags: c_uint,
    pub(super) prot: c_uint,
    pub(super) memory_type: c_int,
}

/// `ucp_request_param_t` (1.22 adds `remote_datatype`, `remote`, `remote_count` at the end).
#[repr(C)]
pub(super) struct RequestParam {
    pub(super) op_attr_mask: u32,
    pub(super) flags: u32,
    pub(super) request: *mut c_void,
    /// A union of callback pointers; devshare sets none.
    pub(super) cb: *mut c_void,
    pub(super) datatype: u64,
    pub(super) user_data: *mut c_void,
    pub(super) reply_buffer: *mut c_void,
    pub(super) memory_type: c_int,
    /// A union of pointers.
    pub(super) recv_info: *mut c_void,
    pub(super) memh: Handle,
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
    pub(super) fn unset() -> UcpParams {
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
    pub(super) fn unset() -> WorkerParams {
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
    pub(super) fn unset() -> WorkerAttr {
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
    pub(super) fn unset() -> EpParams {
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
    pub(super) fn unset() -> MemMapParams {
        MemMapParams { field_mask: 0, address: null_mut(), length: 0, flags: 0, prot: 0, memory_type: 0 }
    }
}

impl RequestParam {
    /// No field set: no callback, no user request, contiguous bytes, memory type detected.
    pub(super) fn unset() -> RequestParam {
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
