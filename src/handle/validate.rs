//! Field-by-field validation of a [`DevshareHandle`]. Every decode and every import goes through
//! [`validate`]; nothing downstream trusts a handle that has not passed it.

use super::*;
use crate::error::{Error, Result};

/// What validation derives from a handle, so callers do not recompute it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Validated {
    /// Bytes per element.
    pub element_size: u64,
    /// Number of elements (product of the shape).
    pub numel: u64,
    /// Byte offset of the tensor's first element from the start of the allocation.
    pub data_offset: u64,
}

const MAX_SIZE: u64 = i64::MAX as u64;

fn check_size(field: &'static str, v: u64) -> Result<()> {
    if v > MAX_SIZE {
        return Err(Error::bad_size(field, format!("{v} is negative or above 2^63-1")));
    }
    Ok(())
}

fn zero_tail(field: &'static str, bytes: &[u8]) -> Result<()> {
    if bytes.iter().any(|&b| b != 0) {
        return Err(Error::invalid(field, "bytes beyond the used length must be 0"));
    }
    Ok(())
}

/// True for a POSIX shm name devshare accepts: a leading '/', then 1..=n characters from
/// `[A-Za-z0-9_.-]` (no further '/', no NUL, nothing a shell or a path could misread).
pub(crate) fn is_shm_name(name: &[u8]) -> bool {
    name.len() >= 2
        && name[0] == b'/'
        && name[1..].iter().all(|&c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-' || c == b'.')
        && name != b"/."
        && name != b"/.."
}

fn check_key(h: &DevshareHandle) -> Result<()> {
    let len = h.key_len as usize;
    if len > DEVSHARE_KEY_CAPACITY {
        return Err(Error::BadKey(format!("key_len {len} exceeds the capacity of {DEVSHARE_KEY_CAPACITY} bytes")));
    }
    let key = &h.key[..len];
    match h.backend {
        DEVSHARE_BACKEND_HOST if h.flags & DEVSHARE_HANDLE_FLAG_CHANNEL != 0 => {
            if len != 0 {
                return Err(Error::BadKey(format!(
                    "a channel (memfd) handle has no key, but key_len is {len}: its memory travels \
                     as a descriptor next to the handle"
                )));
            }
        }
        DEVSHARE_BACKEND_HOST => {
            if !is_shm_name(key) {
                return Err(Error::BadKey(format!(
                    "host key {:?} is not a shm name ('/' then 1..=126 of [A-Za-z0-9_.-])",
                    String::from_utf8_lossy(key)
                )));
            }
        }
        DEVSHARE_BACKEND_ACL => check_acl_key(key)?,
        DEVSHARE_BACKEND_CUDA => {
            if len != 64 {
                return Err(Error::BadKey(format!("CUDA IPC memory handle must be 64 bytes, got {len}")));
            }
        }
        _ => unreachable!("backend checked before the key"),
    }
    zero_tail("key", &h.key[len..])
}

fn check_ref(h: &DevshareHandle) -> Result<()> {
    let len = h.ref_name_len as usize;
    if len > DEVSHARE_REF_NAME_CAPACITY {
        return Err(Error::invalid(
            "ref_name_len",
            format!("{len} exceeds the capacity of {DEVSHARE_REF_NAME_CAPACITY} bytes"),
        ));
    }
    zero_tail("ref_name", &h.ref_name[len..])?;
    if len == 0 {
        if h.ref_slot != 0 {
            return Err(Error::invalid("ref_slot", "must be 0 when there is no ref-counter name"));
        }
        return Ok(());
    }
    if !is_shm_name(&h.ref_name[..len]) {
        return Err(Error::invalid(
            "ref_name",
            format!("{:?} is not a shm name ('/' then [A-Za-z0-9_.-])", String::from_utf8_lossy(&h.ref_name[..len])),
        ));
    }
    if h.ref_slot >= DEVSHARE_REF_SLOTS {
        return Err(Error::invalid(
            "ref_slot",
            format!("{} is beyond the {DEVSHARE_REF_SLOTS} slots of a ref-counter", h.ref_slot),
        ));
    }
    Ok(())
}

fn check_tensor(h: &DevshareHandle, element_size: u64) -> Result<(u64, u64)> {
    let ndim = h.ndim as usize;
    let overflow = |field: &'static str| Error::bad_size(field, "arithmetic overflows 2^63-1");
    let mut numel: u64 = 1;
    let mut last: u64 = u64::try_from(h.tensor_offset)
        .map_err(|_| Error::bad_size("tensor_offset", format!("{} is negative", h.tensor_offset)))?;
    let first = last;
    for i in 0..ndim {
        let (dim, stride) = (h.shape[i], h.strides[i]);
        let dim =
            u64::try_from(dim).map_err(|_| Error::bad_size("shape", format!("shape[{i}] = {dim} is negative")))?;
        let stride = u64::try_from(stride)
            .map_err(|_| Error::bad_size("strides", format!("strides[{i}] = {stride} is negative")))?;
        numel = numel.checked_mul(dim).filter(|&n| n <= MAX_SIZE).ok_or_else(|| overflow("shape"))?;
        if dim > 0 {
            let reach = (dim - 1).checked_mul(stride).ok_or_else(|| overflow("strides"))?;
            last = last.checked_add(reach).filter(|&n| n <= MAX_SIZE).ok_or_else(|| overflow("strides"))?;
        }
    }
    let first_byte = first.checked_mul(element_size).ok_or_else(|| overflow("tensor_offset"))?;
    let end_byte = if numel == 0 {
        first_byte
    } else {
        last.checked_add(1).and_then(|n| n.checked_mul(element_size)).ok_or_else(|| overflow("strides"))?
    };
    if end_byte > h.storage_size {
        return Err(Error::TensorOutOfBounds(format!(
            "tensor_offset {} with shape {:?} and strides {:?} reaches byte {end_byte} of a \
             {}-byte storage",
            h.tensor_offset,
            h.dims(),
            h.stride_dims(),
            h.storage_size
        )));
    }
    Ok((numel, first_byte))
}

/// Unknown "must understand" flags are refused by name; unknown "may ignore" flags pass.
fn check_flags(h: &DevshareHandle) -> Result<()> {
    let unknown = h.flags & DEVSHARE_HANDLE_FLAGS_MUST_UNDERSTAND & !DEVSHARE_HANDLE_KNOWN_FLAGS;
    if unknown != 0 {
        let bit = unknown.trailing_zeros();
        return Err(Error::UnsupportedVersion(format!(
            "the handle (layout {}.{}) needs feature flag bit {bit} ({:#x}), which this library \
             (layout {DEVSHARE_HANDLE_LAYOUT_VERSION}.{DEVSHARE_HANDLE_LAYOUT_MINOR}) does not \
             understand; update devshare on the receiving side",
            h.layout_version,
            h.layout_minor,
            1u32 << bit
        )));
    }
    Ok(())
}

/// One extension record: `{type: u16 LE, len: u16 LE, data[len]}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExtRecord<'a> {
    /// Record type; `DEVSHARE_EXT_MUST_UNDERSTAND` marks types a reader must know.
    pub kind: u16,
    /// Record payload.
    pub data: &'a [u8],
}

/// Split the extension area into records, checking their framing. Does not judge the types.
pub fn ext_records(ext: &[u8]) -> Result<Vec<ExtRecord<'_>>> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < ext.len() {
        let Some(head) = ext.get(pos..pos + 4) else {
            return Err(Error::invalid(
                "ext",
                format!("record at byte {pos} is cut off inside its 4-byte header (ext_len {})", ext.len()),
            ));
        };
        let kind = u16::from_le_bytes([head[0], head[1]]);
        let len = u16::from_le_bytes([head[2], head[3]]) as usize;
        if kind == 0 {
            return Err(Error::invalid("ext", format!("record at byte {pos} has type 0")));
        }
        let Some(data) = ext.get(pos + 4..pos + 4 + len) else {
            return Err(Error::invalid(
                "ext",
                format!(
                    "record {kind:#06x} at byte {pos} claims {len} bytes, only {} remain in ext_len {}",
                    ext.len() - pos - 4,
                    ext.len()
                ),
            ));
        };
        out.push(ExtRecord { kind, data });
        pos += 4 + len;
    }
    Ok(out)
}

/// The extension area: framing, zero tail, and no unknown "must understand" record.
fn check_ext(h: &DevshareHandle) -> Result<()> {
    let len = h.ext_len as usize;
    if len > DEVSHARE_HANDLE_EXT_CAPACITY {
        return Err(Error::invalid(
            "ext_len",
            format!("{len} exceeds the capacity of {DEVSHARE_HANDLE_EXT_CAPACITY} bytes"),
        ));
    }
    zero_tail("ext", &h.ext[len..])?;
    for r in ext_records(&h.ext[..len])? {
        // Known types are checked where they are used (segments: `segments::segments`); every
        // unknown "must understand" one is refused by name, every other one is skipped.
        if r.kind & DEVSHARE_EXT_MUST_UNDERSTAND != 0 && !KNOWN_EXT_TYPES.contains(&r.kind) {
            return Err(Error::UnsupportedVersion(format!(
                "the handle (layout {}.{}) carries extension record type {:#06x} that must be \
                 understood, which this library (layout {DEVSHARE_HANDLE_LAYOUT_VERSION}.\
                 {DEVSHARE_HANDLE_LAYOUT_MINOR}) does not know; update devshare on the receiving side",
                h.layout_version, h.layout_minor, r.kind
            )));
        }
    }
    Ok(())
}

/// `ndim` within the maximum, `shape` and `strides` zero beyond it, and a known dtype: its
/// element size.
fn check_dims(h: &DevshareHandle) -> Result<u64> {
    if h.ndim as usize > DEVSHARE_MAX_NDIM {
        return Err(Error::BadNdim(format!("{} is above the maximum {DEVSHARE_MAX_NDIM}", h.ndim)));
    }
    let ndim = h.ndim as usize;
    if h.shape[ndim..].iter().any(|&d| d != 0) {
        return Err(Error::invalid("shape", "entries at and beyond ndim must be 0"));
    }
    if h.strides[ndim..].iter().any(|&d| d != 0) {
        return Err(Error::invalid("strides", "entries at and beyond ndim must be 0"));
    }
    let element_size = h.dtype.element_size()?;
    Ok(element_size)
}

/// The storage lies inside the allocation (`alloc_size` checked already), sizes below 2^63.
fn check_storage(h: &DevshareHandle) -> Result<()> {
    check_size("storage_offset", h.storage_offset)?;
    check_size("storage_size", h.storage_size)?;
    let storage_end = h.storage_offset + h.storage_size; // both < 2^63: no overflow
    if storage_end > h.alloc_size {
        return Err(Error::StorageOutOfBounds(format!(
            "storage_offset {} + storage_size {} = {storage_end} exceeds alloc_size {}",
            h.storage_offset, h.storage_size, h.alloc_size
        )));
    }
    Ok(())
}

/// [`validate`] for a handle that is `base` (which passed it) with another tensor in the same
/// storage range rules: only the layout fields (`dtype`, `ndim`, `shape`, `strides`,
/// `storage_offset`, `storage_size`, `tensor_offset`) may differ, and only they are checked. A
/// handle that differs anywhere else gets the full [`validate`]. This is the per-item check of
/// pool items, whose key, names, flags and segments are their pool's.
pub(crate) fn validate_layout(h: &DevshareHandle, base: &DevshareHandle) -> Result<Validated> {
    if !same_but_layout(h, base) {
        return validate(h);
    }
    check_layout(h)
}

/// The checks of [`validate_layout`] for a handle that is its validated base but for the layout
/// fields.
fn check_layout(h: &DevshareHandle) -> Result<Validated> {
    let element_size = check_dims(h)?;
    check_storage(h)?;
    let (numel, tensor_byte) = check_tensor(h, element_size)?;
    Ok(Validated { element_size, numel, data_offset: h.storage_offset + tensor_byte })
}

/// [`validate_layout`] for `h`, a copy of `base` whose layout fields, `producer_pid` and
/// `flags` alone were written since (a leased share described from its export's template):
/// when the pid and flags are `base`'s too, nothing else can differ and only the layout is
/// checked, without comparing the rest.
pub(crate) fn validate_written_layout(h: &DevshareHandle, base: &DevshareHandle) -> Result<Validated> {
    if h.producer_pid == base.producer_pid && h.flags == base.flags {
        return check_layout(h);
    }
    validate_layout(h, base)
}

/// The layout fields of a handle: what a pool item sets on its pool's handle (and, relative to
/// its slot, what an `ITEM` message carries).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub dtype: DevshareDType,
    pub ndim: u32,
    /// `ndim` entries are used.
    pub shape: [i64; DEVSHARE_MAX_NDIM],
    /// `ndim` entries are used.
    pub strides: [i64; DEVSHARE_MAX_NDIM],
    /// In the allocation (in an `ITEM`: in the slot), in bytes.
    pub storage_offset: u64,
    pub storage_size: u64,
    /// In elements.
    pub tensor_offset: i64,
}

impl Layout {
    /// No dimensions, nothing in the storage (what a decode writes into).
    pub(crate) fn empty() -> Layout {
        Layout {
            dtype: DevshareDType::new(0, 0, 0),
            ndim: 0,
            shape: [0; DEVSHARE_MAX_NDIM],
            strides: [0; DEVSHARE_MAX_NDIM],
            storage_offset: 0,
            storage_size: 0,
            tensor_offset: 0,
        }
    }

    /// The layout of the tensor `h` describes, with `storage_offset` and `storage_size` given.
    pub(crate) fn of(h: &DevshareHandle, storage_offset: u64, storage_size: u64) -> Layout {
        Layout {
            dtype: h.dtype,
            ndim: h.ndim,
            shape: h.shape,
            strides: h.strides,
            storage_offset,
            storage_size,
            tensor_offset: h.tensor_offset,
        }
    }

    /// Whether `h` has exactly this layout (every layout field compared).
    pub(crate) fn is_of(&self, h: &DevshareHandle) -> bool {
        h.dtype == self.dtype
            && h.ndim == self.ndim
            && same(&h.shape, &self.shape)
            && same(&h.strides, &self.strides)
            && h.storage_offset == self.storage_offset
            && h.storage_size == self.storage_size
            && h.tensor_offset == self.tensor_offset
    }
}

/// Whether `a == b`, every element compared, folded without a branch or a call (`==` on arrays
/// calls `memcmp`, which costs more than the few words of a layout or an event handle).
#[inline]
pub(crate) fn same<
    T: Copy + std::ops::BitXor<Output = T> + std::ops::BitOr<Output = T> + Default + PartialEq,
    const N: usize,
>(
    a: &[T; N],
    b: &[T; N],
) -> bool {
    a.iter().zip(b).fold(T::default(), |d, (x, y)| d | (*x ^ *y)) == T::default()
}

/// Write `base` (a handle that passed [`validate`]) with the layout `l` (and the producer's
/// `event`, flagged, when there is one) into `h`, and validate it: the verdict of
/// [`validate_layout`]`(h, base)`. Without an event, the other fields are `base`'s by
/// construction and are not compared (a pool item's handle, written in place in its import).
pub(crate) fn relayout(
    base: &DevshareHandle,
    l: &Layout,
    event: Option<[u8; DEVSHARE_EVENT_HANDLE_SIZE]>,
    h: &mut DevshareHandle,
) -> Result<Validated> {
    *h = *base;
    h.dtype = l.dtype;
    h.ndim = l.ndim;
    h.shape = l.shape;
    h.strides = l.strides;
    h.storage_offset = l.storage_offset;
    h.storage_size = l.storage_size;
    h.tensor_offset = l.tensor_offset;
    match event {
        None => check_layout(h),
        Some(e) => {
            h.flags |= DEVSHARE_HANDLE_FLAG_EVENT;
            h.event_handle = e;
            validate_layout(h, base)
        }
    }
}

/// Whether `a` and `b` agree in every field but the layout ones, field by field, without
/// copying either (a handle is 616 bytes and this runs twice per pool item). The destructuring
/// names every field: a field added to the struct fails to compile here until it is sorted in.
fn same_but_layout(a: &DevshareHandle, b: &DevshareHandle) -> bool {
    let DevshareHandle {
        struct_size,
        layout_version,
        backend,
        flags,
        device_index,
        device_uuid,
        host_id,
        producer_pid,
        ndim: _,
        alloc_size,
        storage_offset: _,
        storage_size: _,
        tensor_offset: _,
        dtype: _,
        key_len,
        shape: _,
        strides: _,
        key,
        ref_slot,
        ref_name_len,
        reserved0,
        ref_name,
        event_handle,
        layout_minor,
        ext_len,
        reserved1,
        ext,
    } = a;
    *struct_size == b.struct_size
        && *layout_version == b.layout_version
        && *backend == b.backend
        && *flags == b.flags
        && *device_index == b.device_index
        && *device_uuid == b.device_uuid
        && *host_id == b.host_id
        && *producer_pid == b.producer_pid
        && *alloc_size == b.alloc_size
        && *key_len == b.key_len
        && *key == b.key
        && *ref_slot == b.ref_slot
        && *ref_name_len == b.ref_name_len
        && *reserved0 == b.reserved0
        && *ref_name == b.ref_name
        && *event_handle == b.event_handle
        && *layout_minor == b.layout_minor
        && *ext_len == b.ext_len
        && *reserved1 == b.reserved1
        && *ext == b.ext
}

/// Validate every field of `h`; on success return what was derived on the way.
///
/// A handle that passes describes a tensor that lies entirely inside its storage, which lies
/// entirely inside the exported allocation, all sizes below 2^63.
pub fn validate(h: &DevshareHandle) -> Result<Validated> {
    if h.struct_size as usize != DEVSHARE_HANDLE_SIZE {
        return Err(Error::UnsupportedVersion(format!(
            "struct_size {} is not sizeof(DevshareHandle) = {DEVSHARE_HANDLE_SIZE} \
             (call devshare_handle_init first)",
            h.struct_size
        )));
    }
    if h.layout_version != DEVSHARE_HANDLE_LAYOUT_VERSION {
        return Err(Error::UnsupportedVersion(format!(
            "layout_version {}.{} (this library reads layout {DEVSHARE_HANDLE_LAYOUT_VERSION}.x)",
            h.layout_version, h.layout_minor
        )));
    }
    check_flags(h)?;
    check_ext(h)?;
    if h.backend == 0 {
        return Err(Error::invalid("backend", "0 is not a backend"));
    }
    if h.backend > DEVSHARE_BACKEND_CUDA {
        return Err(Error::UnsupportedVersion(format!(
            "backend {} (from handle layout {}.{}) is unknown to this library, which knows \
             backends 1..=3 (host, acl, cuda)",
            h.backend, h.layout_version, h.layout_minor
        )));
    }
    if h.device_index < 0 || (h.backend == DEVSHARE_BACKEND_HOST && h.device_index != 0) {
        return Err(Error::invalid("device_index", format!("{} (must be >= 0, and 0 for host)", h.device_index)));
    }
    if h.producer_pid < 0 {
        return Err(Error::invalid("producer_pid", format!("{} is not a pid (0: unknown)", h.producer_pid)));
    }
    let element_size = check_dims(h)?;
    // The segment description (and an inline table) before the sizes: it defines alloc_size.
    let segmented = super::segments::segments(h)?;
    check_size("alloc_size", h.alloc_size)?;
    check_storage(h)?;
    if segmented.is_none() {
        check_key(h)?;
    } else {
        // The inline table (or nothing) is key_len bytes; the rest is zero, as for any key.
        zero_tail("key", &h.key[(h.key_len as usize).min(DEVSHARE_KEY_CAPACITY)..])?;
    }
    check_ref(h)?;
    if h.flags & DEVSHARE_HANDLE_FLAG_EVENT == 0 {
        zero_tail("event_handle", &h.event_handle)?;
    } else if h.backend == DEVSHARE_BACKEND_HOST {
        return Err(Error::invalid("flags", "host handles cannot carry an IPC event"));
    }
    if h.flags & DEVSHARE_HANDLE_FLAG_CHANNEL != 0 {
        if h.backend != DEVSHARE_BACKEND_HOST {
            return Err(Error::invalid("flags", "only host memory travels as a channel memfd"));
        }
        if h.ref_name_len != 0 || h.flags & DEVSHARE_HANDLE_FLAG_INFLIGHT != 0 {
            return Err(Error::invalid(
                "flags",
                "a channel (memfd) handle's reference is leased to its connection: it names no \
                 ref-counter and carries no in-flight reference",
            ));
        }
    }
    if h.flags & DEVSHARE_HANDLE_FLAG_INFLIGHT != 0 && h.backend != DEVSHARE_BACKEND_HOST {
        return Err(Error::invalid("flags", "only host handles carry an in-flight reference"));
    }
    if h.reserved0 != 0 {
        return Err(Error::invalid("reserved0", "must be 0"));
    }
    if h.reserved1 != 0 {
        return Err(Error::invalid("reserved1", "must be 0"));
    }
    let (numel, tensor_byte) = check_tensor(h, element_size)?;
    Ok(Validated { element_size, numel, data_offset: h.storage_offset + tensor_byte })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DevshareDType;
    use proptest::prelude::*;

    fn pool_base() -> DevshareHandle {
        let mut h = DevshareHandle {
            backend: crate::handle::DEVSHARE_BACKEND_HOST,
            producer_pid: 42,
            dtype: DevshareDType::new(1, 8, 1),
            ndim: 1,
            alloc_size: 1 << 16,
            storage_size: 1 << 16,
            ..Default::default()
        };
        h.shape[0] = 1 << 16;
        h.strides[0] = 1;
        let key = b"/devshare_42_pool";
        h.key[..key.len()].copy_from_slice(key);
        h.key_len = key.len() as u32;
        h
    }

    fn same_verdict(h: &DevshareHandle, base: &DevshareHandle) -> std::result::Result<(), TestCaseError> {
        let full = validate(h);
        let fast = validate_layout(h, base);
        prop_assert_eq!(full.is_ok(), fast.is_ok(), "full {:?}, layout-only {:?}", full, fast);
        if let (Ok(a), Ok(b)) = (&full, fast) {
            prop_assert_eq!(*a, b);
        }
        if same_but_layout(h, base) {
            // What a pool item's import does: the base's handle with the layout written in.
            let l = Layout::of(h, h.storage_offset, h.storage_size);
            let mut written = DevshareHandle::default();
            let relaid = relayout(base, &l, None, &mut written);
            prop_assert!(written == *h, "relayout writes the handle checked");
            prop_assert!(l.is_of(&written));
            prop_assert_eq!(full.is_ok(), relaid.is_ok(), "full {:?}, relayout {:?}", full, relaid);
            if let (Ok(a), Ok(b)) = (&full, relaid) {
                prop_assert_eq!(*a, b);
            }
            // What a producer's leased share does: the same layout written on the template.
            let written = validate_written_layout(h, base);
            prop_assert_eq!(full.is_ok(), written.is_ok(), "full {:?}, written {:?}", full, written);
            if let (Ok(a), Ok(b)) = (full, written) {
                prop_assert_eq!(a, b);
            }
        }
        Ok(())
    }

    #[test]
    fn a_pool_item_inside_its_pool_passes_the_layout_only_check_as_it_passes_validate() {
        let base = pool_base();
        let mut h = base;
        h.dtype = DevshareDType::new(2, 32, 1);
        h.storage_offset = 4096;
        h.storage_size = 4096;
        h.shape[0] = 1024;
        let v = validate_layout(&h, &base).unwrap();
        assert_eq!(v, validate(&h).unwrap());
        assert_eq!((v.element_size, v.numel, v.data_offset), (4, 1024, 4096));
        h.shape[0] = 1025; // one float past the storage
        assert!(matches!(validate_layout(&h, &base), Err(Error::TensorOutOfBounds(_))));
        h.shape[0] = 1024;
        h.storage_offset = (1 << 16) - 4095; // the storage past the allocation
        assert!(matches!(validate_layout(&h, &base), Err(Error::StorageOutOfBounds(_))));
    }

    proptest! {
        /// `same` is `==` for the arrays it compares (a layout's entries, an event handle),
        /// equal or differing anywhere.
        #[test]
        fn same_is_array_equality(
            a in proptest::array::uniform8(prop_oneof![-2i64..2, any::<i64>()]),
            flip in proptest::option::of((0usize..8, any::<i64>())),
            e in proptest::array::uniform32(0u8..3),
            at in 0usize..64,
            byte in any::<u8>(),
        ) {
            let mut b = a;
            if let Some((i, v)) = flip {
                b[i] = v;
            }
            prop_assert_eq!(same(&a, &b), a == b);
            let mut x = [0u8; 64];
            x[..32].copy_from_slice(&e);
            let mut y = x;
            y[at] = byte;
            prop_assert_eq!(same(&x, &y), x == y);
            prop_assert!(same(&x, &x));
        }

        /// A pool item's check (layout fields only, against its validated pool handle) accepts
        /// and refuses exactly what the full validation does, for any layout, and for a handle
        /// with any one byte changed elsewhere (which takes the full validation).
        #[test]
        fn the_layout_only_check_agrees_with_full_validation(
            dtype in (0u8..8, prop_oneof![Just(8u8), Just(16), Just(32), Just(64), any::<u8>()], 0u16..3),
            ndim in 0u32..10,
            dims in proptest::collection::vec(prop_oneof![-2i64..70000, any::<i64>()], 16),
            storage_offset in prop_oneof![0u64..70000, any::<u64>()],
            storage_size in prop_oneof![0u64..70000, any::<u64>()],
            tensor_offset in prop_oneof![-2i64..70000, any::<i64>()],
            flip in proptest::option::of((0usize..crate::handle::DEVSHARE_HANDLE_SIZE, any::<u8>())),
        ) {
            let base = pool_base();
            prop_assert!(validate(&base).is_ok());
            let mut h = base;
            h.dtype = DevshareDType::new(dtype.0, dtype.1, dtype.2);
            h.ndim = ndim;
            let n = crate::handle::DEVSHARE_MAX_NDIM;
            h.shape.copy_from_slice(&dims[..n]);
            h.strides.copy_from_slice(&dims[n..2 * n]);
            h.storage_offset = storage_offset;
            h.storage_size = storage_size;
            h.tensor_offset = tensor_offset;
            same_verdict(&h, &base)?;
            if let Some((at, byte)) = flip {
                // SAFETY: DevshareHandle is plain old data without padding (a C struct of
                // integers and byte arrays, sized DEVSHARE_HANDLE_SIZE).
                let bytes = unsafe {
                    std::slice::from_raw_parts_mut((&mut h as *mut DevshareHandle).cast::<u8>(), crate::handle::DEVSHARE_HANDLE_SIZE)
                };
                bytes[at] = byte;
                same_verdict(&h, &base)?;
            }
        }
    }
}
