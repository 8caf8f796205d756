//! The evolution rules for structs that cross the C boundary, written once.
//!
//! Every such struct starts with `uint32_t struct_size`, the size the caller's header gave it.
//! - Inputs ([`read_input`]): any size >= the first released size is accepted; fields the caller
//!   does not have read as zero; bytes beyond what this library knows must be zero (a newer
//!   caller that set a newer field is refused with `UnsupportedVersion`, naming the bytes).
//! - Outputs ([`write_output`]): the caller sets `struct_size` (with the struct's `*_init`);
//!   the library writes `min(caller's size, library's size)` bytes and stores that number in
//!   `struct_size`, so a newer caller sees how much an older library filled in.
//! - `*_init(ptr, size)` ([`init`]): writes the defaults into `size` bytes (zero beyond what
//!   this library knows) and sets `struct_size = size`; never writes past `size`.

use crate::error::{Error, Result};
use std::mem::size_of;

/// Sizes above this are refused as corrupt rather than read (no struct will grow this large): a
/// caller that forgot `*_init` leaves garbage in `struct_size`, and this bounds the damage.
const MAX_STRUCT_SIZE: usize = 4096;

/// A `#[repr(C)]` struct of the C surface that starts with `struct_size: u32`.
///
/// # Safety
/// Implementors are `#[repr(C)]`, start with a `u32` size field, have no padding bytes, and
/// every bit pattern (all zeros included) is a valid value.
pub(crate) unsafe trait SizedStruct: Copy {
    /// The C type name, for messages.
    const NAME: &'static str;
    /// `sizeof` in the first release that had this struct with `struct_size` (devshare 1.0).
    const FIRST_SIZE: usize;
    /// The defaults `*_init` writes.
    fn defaults() -> Self;
}

/// `size` as a caller's `struct_size` of `T`: at least its first size, at most
/// [`MAX_STRUCT_SIZE`].
pub(crate) fn check_size<T: SizedStruct>(size: u32, param: &str) -> Result<usize> {
    let size = size as usize;
    if size < T::FIRST_SIZE {
        return Err(Error::InvalidArgument(format!(
            "{param}.struct_size {size} is smaller than sizeof({}) = {} (set it with the \
             struct's *_init function, or to sizeof)",
            T::NAME,
            T::FIRST_SIZE
        )));
    }
    if size > MAX_STRUCT_SIZE {
        return Err(Error::InvalidArgument(format!(
            "{param}.struct_size {size} is not a plausible size of {}",
            T::NAME
        )));
    }
    Ok(size)
}

/// Read an input struct of the caller's size (see the module documentation).
///
/// # Safety
/// `p` is NULL or points to at least `(*p).struct_size` readable bytes.
pub(crate) unsafe fn read_input<T: SizedStruct>(p: *const T, param: &'static str) -> Result<T> {
    if p.is_null() {
        return Err(Error::NullArgument(param));
    }
    // SAFETY: p is non-null and, by the contract, points to at least 4 readable bytes.
    let size = check_size::<T>(unsafe { p.cast::<u32>().read_unaligned() }, param)?;
    // SAFETY: p points to `size` readable bytes (contract).
    let bytes = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), size) };
    let ours = size_of::<T>();
    if let Some(at) = bytes.get(ours..).and_then(|tail| tail.iter().position(|&b| b != 0)) {
        return Err(Error::UnsupportedVersion(format!(
            "{param}: byte {} of the caller's {size}-byte {} is set, but this library's {} \
             ends at byte {ours}: the caller uses a field of a newer devshare",
            ours + at,
            T::NAME,
            T::NAME
        )));
    }
    let mut v = std::mem::MaybeUninit::<T>::zeroed();
    let n = size.min(ours);
    // SAFETY: both ranges are n <= size_of::<T>() bytes, valid and disjoint; a zeroed T with
    // any prefix of bytes copied in is a valid T (trait contract).
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), v.as_mut_ptr().cast::<u8>(), n);
        let mut v = v.assume_init();
        v.as_bytes_mut()[..4].copy_from_slice(&(ours as u32).to_ne_bytes());
        Ok(v)
    }
}

/// Write an output struct into the caller's size (see the module documentation).
///
/// # Safety
/// `p` is NULL or points to at least `(*p).struct_size` writable bytes.
pub(crate) unsafe fn write_output<T: SizedStruct>(p: *mut T, mut v: T, param: &'static str) -> Result<()> {
    if p.is_null() {
        return Err(Error::NullArgument(param));
    }
    // SAFETY: p is non-null and points to at least 4 readable bytes (contract).
    let size = check_size::<T>(unsafe { p.cast::<u32>().read_unaligned() }, param)?;
    let n = size.min(size_of::<T>());
    v.as_bytes_mut()[..4].copy_from_slice(&(n as u32).to_ne_bytes());
    // SAFETY: p has `size` >= n writable bytes; v is a local of size_of::<T>() >= n bytes.
    unsafe { std::ptr::copy_nonoverlapping(v.as_bytes().as_ptr(), p.cast::<u8>(), n) };
    Ok(())
}

/// `*_init(p, size)`: defaults into `size` bytes, zero beyond what this library knows.
///
/// # Safety
/// `p` is NULL or points to at least `size` writable bytes.
pub(crate) unsafe fn init<T: SizedStruct>(p: *mut T, size: u32, param: &'static str) -> Result<()> {
    if p.is_null() {
        return Err(Error::NullArgument(param));
    }
    let size = check_size::<T>(size, param)?;
    let mut v = T::defaults();
    let n = size.min(size_of::<T>());
    v.as_bytes_mut()[..4].copy_from_slice(&(size as u32).to_ne_bytes());
    // SAFETY: p has `size` writable bytes (contract); n <= size and n <= size_of::<T>().
    unsafe {
        std::ptr::copy_nonoverlapping(v.as_bytes().as_ptr(), p.cast::<u8>(), n);
        std::ptr::write_bytes(p.cast::<u8>().add(n), 0, size - n);
    }
    Ok(())
}

/// Byte views of a [`SizedStruct`] (sound because it has no padding).
trait Bytes {
    fn as_bytes(&self) -> &[u8];
    fn as_bytes_mut(&mut self) -> &mut [u8];
}

impl<T: SizedStruct> Bytes for T {
    fn as_bytes(&self) -> &[u8] {
        // SAFETY: T has no padding (trait contract), so all size_of::<T>() bytes are initialised.
        unsafe { std::slice::from_raw_parts((self as *const T).cast::<u8>(), size_of::<T>()) }
    }
    fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and every bit pattern is a valid T, so any write keeps it valid.
        unsafe { std::slice::from_raw_parts_mut((self as *mut T).cast::<u8>(), size_of::<T>()) }
    }
}

/// Implement [`SizedStruct`] for a struct, with its defaults, and pin that it has no padding.
macro_rules! sized_struct {
    ($t:ty, $name:literal, first_size = $first:expr, sum = $sum:expr, defaults = $defaults:expr) => {
        // The fields add up to the size: no padding anywhere.
        static_assertions::const_assert_eq!(std::mem::size_of::<$t>(), $sum);
        static_assertions::const_assert_eq!(std::mem::offset_of!($t, struct_size), 0);
        static_assertions::const_assert!($first <= std::mem::size_of::<$t>());
        // SAFETY: repr(C), struct_size first, no padding (asserted above), only integers, byte
        // arrays and raw pointers, for which every bit pattern is valid.
        unsafe impl $crate::capi::abi::SizedStruct for $t {
            const NAME: &'static str = $name;
            const FIRST_SIZE: usize = $first;
            fn defaults() -> Self {
                $defaults
            }
        }
    };
}
pub(crate) use sized_struct;
