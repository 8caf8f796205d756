//! POSIX shared memory: create, open, map, unlink, unguessable names, and the checks every
//! object passes before devshare writes to it.
//!
//! **Which objects devshare opens.** Only names of the two families it speaks (see
//! [`is_family`]): its own `/devshare_<pid>_<32 hex>` (data) and `/devshare_rc_<pid>_<32 hex>`
//! (ref-counters), and PyTorch's `/torch_<pid>_<digits>[_<digits>...]`. After `shm_open` and
//! before anything is mapped writable, written, counted or unlinked, the opened descriptor must
//! be a regular file owned by this process's effective uid with no group or other permission
//! bits ([`open_trusted`]); callers then check the size their layout needs. A refusal is
//! [`Error::Untrusted`] and leaves the object exactly as it was. Every open is non-blocking
//! (a FIFO under a name must not hang the caller: see `shm_open`).
//!
//! **fork.** A host mapping or object made in one fork generation gives nothing back in another
//! (the rule and its generation counter live in [`crate::fork`]).

use crate::error::{Error, Result};
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicI32, AtomicU64};

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
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len.max(1), prot, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
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

    /// The unsigned 8-byte atomic at `offset` (must be 8-aligned and inside the map).
    pub(crate) fn atomic_u64(&self, offset: usize) -> &AtomicU64 {
        assert!(offset % 8 == 0 && offset + 8 <= self.len);
        // SAFETY: as for atomic_i32.
        unsafe { &*self.ptr.add(offset).cast::<AtomicU64>() }
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

/// `shm_open` with the flags every open of a name takes: `O_NOFOLLOW` (no symbolic link is
/// followed), `O_CLOEXEC`, and `O_NONBLOCK`, because the names come from handles and peers: a
/// FIFO put under one would otherwise block `open(2)` until a writer came, hanging an import or
/// a release past any timeout. Nothing opened here is read through the descriptor's blocking
/// mode (regular files are mapped or `pread`), and what is not a regular file is refused after
/// `fstat` ([`open_trusted`]) or left alone ([`unlink_if_same`]).
fn shm_open(name: &[u8], flags: libc::c_int, call: &str) -> Result<OwnedFd> {
    let c = c_name(name)?;
    let flags = flags | libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_NONBLOCK;
    // SAFETY: c is a valid NUL-terminated string.
    let fd = unsafe { libc::shm_open(c.as_ptr(), flags, 0o600) };
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

/// Create a new shm object (mode 0600, must not exist) of `size` bytes, after checking that
/// `/dev/shm` can hold it ([`ensure_capacity`]): nothing is created when it cannot.
pub(crate) fn create(name: &[u8], size: u64) -> Result<OwnedFd> {
    let size =
        libc::off_t::try_from(size).map_err(|_| Error::InvalidArgument(format!("shm size {size} is too large")))?;
    ensure_capacity(size as u64)?;
    let fd = shm_open(name, libc::O_CREAT | libc::O_EXCL | libc::O_RDWR, "shm_open(O_CREAT)")?;
    // SAFETY: valid fd.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
        let e = Error::last_os(format!("ftruncate({}, {size})", String::from_utf8_lossy(name)));
        unlink(name);
        return Err(e);
    }
    Ok(fd)
}

/// Where `shm_open` puts its objects on Linux (glibc and musl).
const SHM_DIR: &std::ffi::CStr = c"/dev/shm";

/// Refuse `size` bytes that the shm filesystem cannot hold now (`fstatvfs` on `/dev/shm`:
/// blocks available to unprivileged users). tmpfs objects are sparse, so without this check an
/// oversized allocation succeeds and its users die of `SIGBUS` once the filesystem fills.
/// The check is a snapshot: other processes may fill the filesystem later (see the README).
/// When `/dev/shm` cannot be examined the check is skipped (`shm_open` reports what is wrong).
pub(crate) fn ensure_capacity(size: u64) -> Result<()> {
    // SAFETY: SHM_DIR is NUL-terminated; the descriptor is checked and owned below.
    let dir = unsafe { libc::open(SHM_DIR.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC) };
    if dir < 0 {
        return Ok(());
    }
    // SAFETY: dir is a freshly opened descriptor we own.
    let dir = unsafe { OwnedFd::from_raw_fd(dir) };
    // SAFETY: a zeroed statvfs is a valid out-parameter.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: dir is open and st a valid out-parameter.
    if unsafe { libc::fstatvfs(dir.as_raw_fd(), &mut st) } != 0 {
        return Ok(());
    }
    let unit = st.f_frsize as u64;
    let free = (st.f_bavail as u64).saturating_mul(unit);
    let total = (st.f_blocks as u64).saturating_mul(unit);
    // Whole pages: a partly used last page still takes one.
    let need = size.div_ceil(unit.max(1)).saturating_mul(unit.max(1));
    if need > free {
        return Err(Error::Os {
            call: "the /dev/shm capacity check (fstatvfs)".into(),
            errno: libc::ENOSPC,
            message: format!(
                "an object of {size} bytes does not fit in /dev/shm: {free} of its {total} bytes \
                 are free (a tmpfs object is sparse, so it would be created and its users would die \
                 of SIGBUS once the filesystem filled); allocate less, free shared memory, or give \
                 /dev/shm more room (mount -o remount,size=...; docker --shm-size)"
            ),
        });
    }
    Ok(())
}

/// What a shared memory object is used as: each has its own name family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A host allocation (64-byte header, then data).
    Data,
    /// A ref-counter (64-byte header, then 10000 `int64` slots).
    RefCounter,
}

impl Kind {
    fn what(self) -> &'static str {
        match self {
            Kind::Data => "host object",
            Kind::RefCounter => "ref-counter",
        }
    }
}

/// Name prefix of devshare's host allocations: `/devshare_<pid>_<32 hex>`.
pub(crate) const DATA_PREFIX: &str = "devshare";
/// Name prefix of devshare's ref-counters: `/devshare_rc_<pid>_<32 hex>`.
pub(crate) const RC_PREFIX: &str = "devshare_rc";

/// `s` is 1 to `max` ASCII digits.
fn digits(s: &[u8], max: usize) -> bool {
    !s.is_empty() && s.len() <= max && s.iter().all(u8::is_ascii_digit)
}

/// `name` is `/<prefix>_<pid>_<32 lowercase hex digits>`, as [`random_name`] makes it.
pub(crate) fn is_devshare_name(name: &[u8], prefix: &str) -> bool {
    let Some(rest) = name.strip_prefix(b"/").and_then(|r| r.strip_prefix(prefix.as_bytes())) else {
        return false;
    };
    let Some(rest) = rest.strip_prefix(b"_") else { return false };
    let Some(us) = rest.iter().position(|&c| c == b'_') else { return false };
    let (pid, hex) = (&rest[..us], &rest[us + 1..]);
    digits(pid, 10) && hex.len() == 32 && hex.iter().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'))
}

/// `name` is PyTorch's `at::NewProcessWideShmHandle()` form: `/torch_<pid>_<digits>`, then any
/// number of `_<digits>` (PyTorch >= 1.x appends a per-process counter to the random number).
pub(crate) fn is_torch_name(name: &[u8]) -> bool {
    let Some(rest) = name.strip_prefix(b"/torch_") else { return false };
    let mut parts = rest.split(|&c| c == b'_');
    let pid_ok = parts.next().is_some_and(|p| digits(p, 10));
    let mut tail = 0;
    for p in parts {
        if !digits(p, 20) {
            return false;
        }
        tail += 1;
    }
    pid_ok && tail >= 1
}

/// The pid in a PyTorch name (`/torch_<pid>_...`): the process that created the object, as
/// `at::NewProcessWideShmHandle` names it. `None` for other names.
pub(crate) fn torch_name_pid(name: &[u8]) -> Option<u64> {
    if !is_torch_name(name) {
        return None;
    }
    let rest = &name[b"/torch_".len()..];
    let end = rest.iter().position(|&c| c == b'_')?;
    std::str::from_utf8(&rest[..end]).ok()?.parse().ok()
}

/// Whether devshare may open `name` as a `kind` object: devshare's own family for that kind, or
/// PyTorch's (whose data objects and ref-counters share one form).
pub(crate) fn is_family(name: &[u8], kind: Kind) -> bool {
    is_torch_name(name)
        || match kind {
            Kind::Data => is_devshare_name(name, DATA_PREFIX),
            Kind::RefCounter => is_devshare_name(name, RC_PREFIX),
        }
}

/// [`is_family`], as an [`Error::Untrusted`] naming the rule.
pub(crate) fn check_family(name: &[u8], kind: Kind) -> Result<()> {
    if is_family(name, kind) {
        return Ok(());
    }
    let own = match kind {
        Kind::Data => "/devshare_<pid>_<32 hex digits>",
        Kind::RefCounter => "/devshare_rc_<pid>_<32 hex digits>",
    };
    Err(Error::Untrusted(format!(
        "{} name {:?} is not one devshare opens: a {} is named {own} (devshare) or \
         /torch_<pid>_<digits>[_<digits>] (PyTorch); other shared memory objects are never opened",
        kind.what(),
        String::from_utf8_lossy(name),
        kind.what()
    )))
}

/// Which object a name stood for when devshare opened or created it (`st_dev`, `st_ino`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ObjectId {
    dev: u64,
    ino: u64,
}

impl ObjectId {
    // dev_t and ino_t are u64 on the 64-bit Linux targets, not on every target.
    #[allow(clippy::unnecessary_cast)]
    fn of(st: &libc::stat) -> ObjectId {
        ObjectId { dev: st.st_dev as u64, ino: st.st_ino as u64 }
    }
}

/// The identity of an open object.
pub(crate) fn id_of(fd: &OwnedFd, name: &[u8]) -> Result<ObjectId> {
    Ok(ObjectId::of(&fstat(fd, name)?))
}

/// An object opened by [`open_trusted`]: its descriptor, size and identity.
pub(crate) struct Opened {
    pub(crate) fd: OwnedFd,
    pub(crate) size: u64,
    pub(crate) id: ObjectId,
}

/// Open an existing object of the `kind` family (read-write or read-only) and check the opened
/// descriptor before the caller maps, writes, counts or unlinks anything: a regular file, owned
/// by this process's effective uid, no group/other permission bits. Returns the descriptor and
/// the object's size, which the caller checks against its layout. `NotFound` when it does not
/// exist; `Untrusted` (nothing touched) when a check fails.
pub(crate) fn open_trusted(name: &[u8], kind: Kind, writable: bool) -> Result<Opened> {
    check_family(name, kind)?;
    let fd = shm_open(name, if writable { libc::O_RDWR } else { libc::O_RDONLY }, "shm_open")?;
    let st = fstat(&fd, name)?;
    let shown = String::from_utf8_lossy(name);
    let what = kind.what();
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(Error::Untrusted(format!(
            "{what} {shown} is {}, not a regular file: devshare maps only regular shared memory \
             objects (mode {:o})",
            file_kind(st.st_mode),
            st.st_mode
        )));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if st.st_uid != euid {
        return Err(Error::Untrusted(format!(
            "{what} {shown} belongs to uid {}, not to this process's user (euid {euid}); devshare \
             opens only its own user's objects",
            st.st_uid
        )));
    }
    if st.st_mode & 0o077 != 0 {
        return Err(Error::Untrusted(format!(
            "{what} {shown} has mode {:04o}: group or others may access it, and devshare and \
             PyTorch create their objects 0600",
            st.st_mode & 0o7777
        )));
    }
    Ok(Opened { size: st.st_size as u64, id: ObjectId::of(&st), fd })
}

/// What a file of mode `mode` is, in words (for messages that say why it was refused).
pub(crate) fn file_kind(mode: libc::mode_t) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFREG => "a regular file",
        libc::S_IFDIR => "a directory",
        libc::S_IFIFO => "a FIFO (pipe)",
        libc::S_IFSOCK => "a socket",
        libc::S_IFCHR => "a character device",
        libc::S_IFBLK => "a block device",
        libc::S_IFLNK => "a symbolic link",
        _ => "an anonymous inode (eventfd, pidfd, epoll, dma-buf, ...)",
    }
}

fn fstat(fd: &OwnedFd, name: &[u8]) -> Result<libc::stat> {
    // SAFETY: zeroed stat is a valid out-parameter.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fd is an open descriptor and st a valid out-parameter.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(Error::last_os(format!("fstat({})", String::from_utf8_lossy(name))));
    }
    Ok(st)
}

/// Unlink `name` if it still stands for the object `id` (the one this process mapped): the
/// last holder of an object whose name was removed and then taken by another object must not
/// remove that other object. A name that is gone, or that this process cannot open, is left.
pub(crate) fn unlink_if_same(name: &[u8], id: ObjectId) {
    let Ok(fd) = shm_open(name, libc::O_RDONLY, "shm_open") else { return };
    if id_of(&fd, name).is_ok_and(|now| now == id) {
        unlink(name);
    }
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
