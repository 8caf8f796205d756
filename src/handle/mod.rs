//! The handle: one fixed-size, plain-data struct that describes one shared tensor.
//!
//! The struct ([`DevshareHandle`]) can be copied with `memcpy`; its layout is pinned below with
//! `static_assertions`. For transports there is a canonical byte encoding ([`encode`]) and a text
//! form ([`text`]); both validate every field on the way in ([`validate`]).

mod acl_key;
pub mod encode;
pub mod segments;
pub mod text;
mod validate;

pub(crate) use acl_key::{check_acl_key, AclKey, ACL_KEY_LEN};
pub(crate) use validate::is_shm_name;
pub use validate::{ext_records, validate, ExtRecord, Validated};
pub(crate) use validate::{relayout, same, validate_layout, validate_written_layout, Layout};

use crate::dtype::DevshareDType;
use static_assertions::{assert_eq_align, assert_eq_size, const_assert_eq};
use std::mem::offset_of;

/// Maximum number of dimensions of a shared tensor.
pub const DEVSHARE_MAX_NDIM: usize = 8;
/// Capacity of the inline export key (ACL: 65 bytes; CUDA: 64; host: a shm name).
pub const DEVSHARE_KEY_CAPACITY: usize = 128;
/// Capacity of the inline ref-counter shm name, including its leading `/`.
pub const DEVSHARE_REF_NAME_CAPACITY: usize = 64;
/// Size of an interprocess event handle (`cudaIpcEventHandle_t`, `aclrtIpcEventHandle`).
pub const DEVSHARE_EVENT_HANDLE_SIZE: usize = 64;
/// Capacity of the handle's extension area (`ext`), in bytes.
pub const DEVSHARE_HANDLE_EXT_CAPACITY: usize = 112;
/// Layout (major) version of `DevshareHandle` written and read by this library. A reader refuses
/// any other major version.
pub const DEVSHARE_HANDLE_LAYOUT_VERSION: u16 = 1;
/// Layout minor version written by this library. A reader accepts every minor version of its
/// major: what a later minor adds is either skippable ("may ignore" flags and extension records)
/// or announced by a "must understand" flag or record that an older reader refuses by name.
pub const DEVSHARE_HANDLE_LAYOUT_MINOR: u16 = 0;
/// Number of slots in a PyTorch-compatible ref-counter object.
pub const DEVSHARE_REF_SLOTS: u64 = 10_000;

/// Backend: POSIX shared memory on the host (PyTorch's `file_system` layout).
pub const DEVSHARE_BACKEND_HOST: u16 = 1;
/// Backend: Ascend NPU memory exported with an ACL IPC key.
pub const DEVSHARE_BACKEND_ACL: u16 = 2;
/// Backend: NVIDIA GPU memory exported with a CUDA IPC memory handle.
pub const DEVSHARE_BACKEND_CUDA: u16 = 3;

/// Handle flag: `event_handle` holds a valid IPC event the consumer must wait on before use.
pub const DEVSHARE_HANDLE_FLAG_EVENT: u32 = 1;
/// Handle flag (host only): the object's header count holds one in-flight reference for this
/// handle, which its first import takes over (PyTorch's `file_system` protocol: the sender
/// counts the receiver in before sending, so the object cannot vanish while the handle travels).
pub const DEVSHARE_HANDLE_FLAG_INFLIGHT: u32 = 2;
/// Handle flag (host only): the allocation is a sealed memfd that travels with the handle over
/// a devshare channel (`SCM_RIGHTS`), not a name: the key is empty and the handle cannot be
/// imported on its own — only `devshare_connection_recv`, which receives the descriptor with it,
/// opens it. Such handles carry no ref-counter: their reference is leased to the connection.
pub const DEVSHARE_HANDLE_FLAG_CHANNEL: u32 = 8;
/// Handle flags in this range (bits 0..15) change how a handle must be read or used: a reader
/// that does not know a set bit refuses the handle with `DEVSHARE_STATUS_UNSUPPORTED_VERSION`,
/// naming the bit.
pub const DEVSHARE_HANDLE_FLAGS_MUST_UNDERSTAND: u32 = 0x0000_ffff;
/// Handle flags in this range (bits 16..31) are hints: a reader that does not know a set bit
/// ignores it (and keeps it when it re-encodes the handle).
pub const DEVSHARE_HANDLE_FLAGS_MAY_IGNORE: u32 = 0xffff_0000;
/// All "must understand" handle flags this library knows.
pub const DEVSHARE_HANDLE_KNOWN_FLAGS: u32 = DEVSHARE_HANDLE_FLAG_EVENT
    | DEVSHARE_HANDLE_FLAG_INFLIGHT
    | segments::DEVSHARE_HANDLE_FLAG_SEGMENTED
    | DEVSHARE_HANDLE_FLAG_CHANNEL;
/// The "must understand" extension record types this library knows.
pub(crate) const KNOWN_EXT_TYPES: [u16; 1] = [segments::DEVSHARE_EXT_SEGMENTS];
/// Extension record types with this bit set must be understood: a reader that does not know
/// the type refuses the handle with `DEVSHARE_STATUS_UNSUPPORTED_VERSION`, naming it. Types
/// without it are skipped by readers that do not know them. Type 0 is invalid.
pub const DEVSHARE_EXT_MUST_UNDERSTAND: u16 = 0x8000;

/// One shared tensor: where its allocation lives, which part of it is the storage, how the tensor
/// is laid out in the storage, and how its lifetime is tracked.
///
/// Plain data, fixed size (616 bytes), 8-byte aligned, copyable with `memcpy`. Initialise one
/// with `devshare_handle_init` before filling it by hand. Unused bytes (dimensions beyond `ndim`,
/// key and name bytes beyond their lengths, the event when not flagged, `ext` beyond `ext_len`,
/// the reserved fields) must be zero. The size never changes: the layout grows through
/// `layout_minor`, flags and extension records (see the evolution rules at the top of this header).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DevshareHandle {
    /// `sizeof(DevshareHandle)`; set by `devshare_handle_init`.
    pub struct_size: u32,
    /// `DEVSHARE_HANDLE_LAYOUT_VERSION`; set by `devshare_handle_init`.
    pub layout_version: u16,
    /// Which backend exported the allocation (`DEVSHARE_BACKEND_*`).
    pub backend: u16,
    /// `DEVSHARE_HANDLE_FLAG_*` bits.
    pub flags: u32,
    /// Device index as numbered in the exporting process (0 for host).
    pub device_index: i32,
    /// Device UUID when known (CUDA), all zero otherwise.
    pub device_uuid: [u8; 16],
    /// Identity of the exporting machine (its boot id); all zero when unknown.
    pub host_id: [u8; 16],
    /// Process id of the exporter; 0 when unknown (a PyTorch tuple whose ref-counter name does
    /// not carry it).
    pub producer_pid: i32,
    /// Number of dimensions, 0..=`DEVSHARE_MAX_NDIM`.
    pub ndim: u32,
    /// Size in bytes of the exported allocation.
    pub alloc_size: u64,
    /// Byte offset of the storage inside the allocation.
    pub storage_offset: u64,
    /// Size in bytes of the storage.
    pub storage_size: u64,
    /// Element offset of the tensor's first element inside the storage.
    pub tensor_offset: i64,
    /// Element type.
    pub dtype: DevshareDType,
    /// Number of meaningful bytes in `key`.
    pub key_len: u32,
    /// Shape in elements; entries at and beyond `ndim` are 0.
    pub shape: [i64; DEVSHARE_MAX_NDIM],
    /// Strides in elements; entries at and beyond `ndim` are 0.
    pub strides: [i64; DEVSHARE_MAX_NDIM],
    /// Export key: host shm name (with leading '/'), 65-byte ACL key, or 64-byte CUDA handle.
    pub key: [u8; DEVSHARE_KEY_CAPACITY],
    /// Ref-counter slot owed one decrement by the consumer (meaningful when `ref_name_len > 0`).
    pub ref_slot: u64,
    /// Number of meaningful bytes in `ref_name`; 0 when the handle carries no ref-counter.
    pub ref_name_len: u32,
    /// Reserved, zero.
    pub reserved0: u32,
    /// Ref-counter shm name (PyTorch layout), with its leading '/', not NUL-terminated.
    pub ref_name: [u8; DEVSHARE_REF_NAME_CAPACITY],
    /// Interprocess event handle, valid when `DEVSHARE_HANDLE_FLAG_EVENT` is set.
    pub event_handle: [u8; DEVSHARE_EVENT_HANDLE_SIZE],
    /// `DEVSHARE_HANDLE_LAYOUT_MINOR` of the writer; set by `devshare_handle_init`. Readers accept
    /// any value (see the evolution rules at the top of this header).
    pub layout_minor: u16,
    /// Number of bytes of `ext` in use, 0..=`DEVSHARE_HANDLE_EXT_CAPACITY`.
    pub ext_len: u16,
    /// Reserved, zero.
    pub reserved1: u32,
    /// Extension records, back to back: `{uint16_t type; uint16_t len; uint8_t data[len]}`
    /// (little-endian). Types with `DEVSHARE_EXT_MUST_UNDERSTAND` must be known to the reader;
    /// others are skipped. Bytes beyond `ext_len` are zero. This version defines one type:
    /// `DEVSHARE_EXT_SEGMENTS` (a segmented allocation's description).
    pub ext: [u8; DEVSHARE_HANDLE_EXT_CAPACITY],
}

assert_eq_size!(DevshareHandle, [u8; 616]);
assert_eq_align!(DevshareHandle, u64);
const_assert_eq!(offset_of!(DevshareHandle, struct_size), 0);
const_assert_eq!(offset_of!(DevshareHandle, layout_version), 4);
const_assert_eq!(offset_of!(DevshareHandle, backend), 6);
const_assert_eq!(offset_of!(DevshareHandle, flags), 8);
const_assert_eq!(offset_of!(DevshareHandle, device_index), 12);
const_assert_eq!(offset_of!(DevshareHandle, device_uuid), 16);
const_assert_eq!(offset_of!(DevshareHandle, host_id), 32);
const_assert_eq!(offset_of!(DevshareHandle, producer_pid), 48);
const_assert_eq!(offset_of!(DevshareHandle, ndim), 52);
const_assert_eq!(offset_of!(DevshareHandle, alloc_size), 56);
const_assert_eq!(offset_of!(DevshareHandle, storage_offset), 64);
const_assert_eq!(offset_of!(DevshareHandle, storage_size), 72);
const_assert_eq!(offset_of!(DevshareHandle, tensor_offset), 80);
const_assert_eq!(offset_of!(DevshareHandle, dtype), 88);
const_assert_eq!(offset_of!(DevshareHandle, key_len), 92);
const_assert_eq!(offset_of!(DevshareHandle, shape), 96);
const_assert_eq!(offset_of!(DevshareHandle, strides), 160);
const_assert_eq!(offset_of!(DevshareHandle, key), 224);
const_assert_eq!(offset_of!(DevshareHandle, ref_slot), 352);
const_assert_eq!(offset_of!(DevshareHandle, ref_name_len), 360);
const_assert_eq!(offset_of!(DevshareHandle, reserved0), 364);
const_assert_eq!(offset_of!(DevshareHandle, ref_name), 368);
const_assert_eq!(offset_of!(DevshareHandle, event_handle), 432);
const_assert_eq!(offset_of!(DevshareHandle, layout_minor), 496);
const_assert_eq!(offset_of!(DevshareHandle, ext_len), 498);
const_assert_eq!(offset_of!(DevshareHandle, reserved1), 500);
const_assert_eq!(offset_of!(DevshareHandle, ext), 504);
assert_eq_size!(DevshareDType, u32);

/// Size of `DevshareHandle` in bytes.
pub const DEVSHARE_HANDLE_SIZE: usize = 616;
const_assert_eq!(DEVSHARE_HANDLE_SIZE, std::mem::size_of::<DevshareHandle>());

impl Default for DevshareHandle {
    fn default() -> Self {
        DevshareHandle {
            struct_size: DEVSHARE_HANDLE_SIZE as u32,
            layout_version: DEVSHARE_HANDLE_LAYOUT_VERSION,
            backend: 0,
            flags: 0,
            device_index: 0,
            device_uuid: [0; 16],
            host_id: [0; 16],
            producer_pid: 0,
            ndim: 0,
            alloc_size: 0,
            storage_offset: 0,
            storage_size: 0,
            tensor_offset: 0,
            dtype: DevshareDType::default(),
            key_len: 0,
            shape: [0; DEVSHARE_MAX_NDIM],
            strides: [0; DEVSHARE_MAX_NDIM],
            key: [0; DEVSHARE_KEY_CAPACITY],
            ref_slot: 0,
            ref_name_len: 0,
            reserved0: 0,
            ref_name: [0; DEVSHARE_REF_NAME_CAPACITY],
            event_handle: [0; DEVSHARE_EVENT_HANDLE_SIZE],
            layout_minor: DEVSHARE_HANDLE_LAYOUT_MINOR,
            ext_len: 0,
            reserved1: 0,
            ext: [0; DEVSHARE_HANDLE_EXT_CAPACITY],
        }
    }
}

impl DevshareHandle {
    /// The meaningful bytes of the key. Clamped so that a corrupt length never reads past the
    /// array; `validate` reports such lengths.
    pub fn key_bytes(&self) -> &[u8] {
        &self.key[..(self.key_len as usize).min(DEVSHARE_KEY_CAPACITY)]
    }

    /// The meaningful bytes of the ref-counter name (clamped like [`Self::key_bytes`]).
    pub fn ref_name_bytes(&self) -> &[u8] {
        &self.ref_name[..(self.ref_name_len as usize).min(DEVSHARE_REF_NAME_CAPACITY)]
    }

    /// Shape entries in use (clamped to `DEVSHARE_MAX_NDIM`).
    pub fn dims(&self) -> &[i64] {
        &self.shape[..(self.ndim as usize).min(DEVSHARE_MAX_NDIM)]
    }

    /// Stride entries in use (clamped to `DEVSHARE_MAX_NDIM`).
    pub fn stride_dims(&self) -> &[i64] {
        &self.strides[..(self.ndim as usize).min(DEVSHARE_MAX_NDIM)]
    }

    /// Set the key bytes (panics if longer than the capacity: callers check first).
    pub(crate) fn set_key(&mut self, key: &[u8]) {
        self.key = [0; DEVSHARE_KEY_CAPACITY];
        self.key[..key.len()].copy_from_slice(key);
        self.key_len = key.len() as u32;
    }

    /// Set the ref-counter name and slot (panics if the name is too long: callers check first).
    pub(crate) fn set_ref(&mut self, name: &[u8], slot: u64) {
        self.ref_name = [0; DEVSHARE_REF_NAME_CAPACITY];
        self.ref_name[..name.len()].copy_from_slice(name);
        self.ref_name_len = name.len() as u32;
        self.ref_slot = slot;
    }

    /// The extension records in use (clamped like [`Self::key_bytes`]).
    pub fn ext_bytes(&self) -> &[u8] {
        &self.ext[..(self.ext_len as usize).min(DEVSHARE_HANDLE_EXT_CAPACITY)]
    }

    /// Human-readable name of the backend, for messages.
    pub fn backend_name(&self) -> &'static str {
        backend_name(self.backend)
    }
}

/// Human-readable name of a `DEVSHARE_BACKEND_*` value.
pub fn backend_name(backend: u16) -> &'static str {
    match backend {
        DEVSHARE_BACKEND_HOST => "host",
        DEVSHARE_BACKEND_ACL => "acl",
        DEVSHARE_BACKEND_CUDA => "cuda",
        _ => "unknown",
    }
}

/// C-contiguous strides for a shape, in elements (saturating: validation rejects what
/// overflows).
pub fn contiguous_strides(shape: &[i64]) -> Vec<i64> {
    let mut strides = vec![0i64; shape.len()];
    contiguous_strides_into(shape, &mut strides);
    strides
}

/// [`contiguous_strides`] into `strides` (as long as `shape`), allocating nothing.
pub(crate) fn contiguous_strides_into(shape: &[i64], strides: &mut [i64]) {
    let mut acc: i64 = 1;
    for i in (0..shape.len()).rev() {
        strides[i] = acc;
        acc = acc.saturating_mul(shape[i].max(1));
    }
}
