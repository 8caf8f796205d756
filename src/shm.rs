//! POSIX shared memory: create, open, map, unlink, and unguessable names.

use crate::error::{Error, Result};
use std::ffi::CString;
use std::os::fd::{FromRawFd, OwnedFd, AsRawFd};
use std::sync::atomic::AtomicI32;

/// A mapping of (part of) a shm object; unmapped on drop.
pub(crate) struct Map {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a Map is a plain address range; the memory is shared memory that any thread may touch,
// and unmapping happens once, on drop.
unsafe impl Send for Map {}
// SAFETY: as for Send: &Map only exposes the address range.
unsafe impl Sync for Map {}

impl Map {
    /// Map `len` bytes of `fd` from offset 0, shared, writable or read-only.
    pub(crate) fn new(fd: &OwnedFd, len: usize, writable: bool, what: &str) -> Result<Map> {
        let prot = if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
        // SAFETY: mmap with a null hint and a valid fd; the result is checked below.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len.max(1), prot, libc::MAP_SHARED, fd.as_raw_fd(), 0)
        };
        if p == libc::MAP_FAILED {
            return Err(Error::last_os(format!("mmap of {what} ({len} bytes)")));
        }
        Ok(Map { ptr: p.cast(), len: len.max(1) })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The 4-byte atomic at `offset` (must be 4-aligned and inside the map).
    pub(crate) fn atomic_i32(&self, offset: usize) -> &AtomicI32 {
        assert!(offset % 4 == 0 && offset + 4 <= self.len);
        // SAFETY: in bounds and aligned (mmap returns page-aligned memory); shared memory is
        // only ever accessed atomically at this offset by devshare and PyTorch.
        unsafe { &*self.ptr.add(offset).cast::<AtomicI32>() }
    }

    /// The 8-byte atomic at `offset` (must be 8-aligned and inside the map).
    pub(crate) fn atomic_i64(&self, offset: usize) -> &std::sync::atomic::AtomicI64 {
        assert!(offset % 8 == 0 && offset + 8 <= self.len);
        // SAFETY: as for atomic_i32.
        unsafe { &*self.ptr.add(offset).cast::<std::sync::atomic::AtomicI64>() }
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: ptr/len came from a successful mmap and are unmapped exactly once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn c_name(name: &[u8]) -> Result<CString> {
    CString::new(name).map_err(|_| Error::InvalidArgument("shm name contains a NUL byte".into()))
}

fn shm_open(name: &[u8], flags: libc::c_int, call: &str) -> Result<OwnedFd> {
    let c = c_name(name)?;
    // SAFETY: c is a valid NUL-terminated string.
    let fd = unsafe { libc::shm_open(c.as_ptr(), flags | libc::O_CLOEXEC, 0o600) };
    if fd < 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ENOENT) {
            return Err(Error::NotFound(format!(
                "shm object {} does not exist (its exporter closed it, or it lives on another \
                 host or in another /dev/shm)",
                String::from_utf8_lossy(name)
            )));
        }
        return Err(Error::Os {
            call: format!("{call}({})", String::from_utf8_lossy(name)),
            errno: err.raw_os_error().unwrap_or(0),
            message: err.to_string(),
        });
    }
    // SAFETY: fd is a freshly opened descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Create a new shm object (mode 0600, must not exist) of `size` bytes.
pub(crate) fn create(name: &[u8], size: u64) -> Result<OwnedFd> {
    let fd = shm_open(name, libc::O_CREAT | libc::O_EXCL | libc::O_RDWR, "shm_open(O_CREAT)")?;
    let size = libc::off_t::try_from(size)
        .map_err(|_| Error::InvalidArgument(format!("shm size {size} is too large")))?;
    // SAFETY: valid fd.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
        let e = Error::last_os(format!("ftruncate({}, {size})", String::from_utf8_lossy(name)));
        unlink(name);
        return Err(e);
    }
    Ok(fd)
}

/// Open an existing shm object read-only.
pub(crate) fn open_read(name: &[u8]) -> Result<OwnedFd> {
    shm_open(name, libc::O_RDONLY, "shm_open")
}

/// Open an existing shm object read-write.
pub(crate) fn open(name: &[u8]) -> Result<OwnedFd> {
    shm_open(name, libc::O_RDWR, "shm_open")
}

/// Size in bytes of an open shm object.
pub(crate) fn size_of(fd: &OwnedFd, name: &[u8]) -> Result<u64> {
    // SAFETY: zeroed stat is a valid out-parameter; fd is valid.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fd is an open descriptor and st a valid out-parameter.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(Error::last_os(format!("fstat({})", String::from_utf8_lossy(name))));
    }
    Ok(st.st_size as u64)
}

/// Unlink a shm name; a name that is already gone is not an error.
pub(crate) fn unlink(name: &[u8]) {
    if let Ok(c) = c_name(name) {
        // SAFETY: c is a valid NUL-terminated string.
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }
}

/// A fresh unguessable name: `/<prefix>_<pid>_<32 hex digits from getrandom>`.
pub(crate) fn random_name(prefix: &str) -> Result<Vec<u8>> {
    let mut r = [0u8; 16];
    let mut filled = 0;
    while filled < r.len() {
        // SAFETY: writes at most r.len() - filled bytes into r[filled..].
        let n = unsafe { libc::getrandom(r[filled..].as_mut_ptr().cast(), r.len() - filled, 0) };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(Error::last_os("getrandom"));
        }
        filled += n as usize;
    }
    let hex: String = r.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("/{prefix}_{}_{hex}", std::process::id()).into_bytes())
}
