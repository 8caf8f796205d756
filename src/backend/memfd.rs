//! Host memory that travels as a descriptor: a sealed `memfd` (an allocation kind next to the
//! named shared memory of [`super::host`]; the channel passes its descriptor).
//!
//! The producer creates an anonymous memfd, sizes it and seals it with `F_SEAL_SHRINK`,
//! `F_SEAL_GROW` and `F_SEAL_SEAL`: nobody — not the producer, not a consumer that received the
//! descriptor — can shrink it under a reader (which would turn its reads into SIGBUS) or change
//! the seals. It has no name in `/dev/shm`, so there is nothing to guess, open or leave behind:
//! the memory goes away when the last process holding the descriptor or a mapping does, however
//! it exits.
//!
//! A consumer maps a received descriptor only after checking it on the descriptor itself: a
//! regular file carrying at least `F_SEAL_SHRINK`, at least as large as the handle says. The
//! import registry caches the mapping by the file's identity (device and inode, from `fstat`),
//! never by anything the handle or the sender claims.

use crate::backend::{Exported, Mapping};
use crate::error::{Error, Result};
use crate::shm::Map;
use rustix::fs::{fcntl_add_seals, fcntl_get_seals, fstat, ftruncate, memfd_create, FileType, MemfdFlags, SealFlags};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

fn os(call: &str, e: rustix::io::Errno) -> Error {
    Error::Os { call: call.into(), errno: e.raw_os_error(), message: std::io::Error::from(e).to_string() }
}

/// The seals a channel memfd carries; a received one must carry at least `F_SEAL_SHRINK`.
const SEALS: SealFlags = SealFlags::SHRINK.union(SealFlags::GROW).union(SealFlags::SEAL);

/// An exported sealed memfd, mapped read-write in the producer.
struct Memfd {
    // Drop order: the mapping, then the descriptor.
    map: Map,
    fd: OwnedFd,
    size: u64,
}

/// Allocate `size` bytes as a sealed memfd (zero-filled). The same rule as a named host
/// allocation: refused (`ENOSPC`, nothing created) when larger than the free room of the shared
/// memory filesystem `/dev/shm` — the machine's (or container's) budget for shared memory; a
/// memfd draws on the same memory, and being sparse it would otherwise be created and its users
/// killed by `SIGBUS` once memory ran out. Size 0 is an empty allocation (a 1-byte file, so
/// that it can be mapped and sent).
pub(crate) fn alloc(size: u64) -> Result<Box<dyn Exported>> {
    let file_size = size.max(1);
    let len = usize::try_from(file_size)
        .ok()
        .filter(|&l| l <= isize::MAX as usize)
        .ok_or_else(|| Error::bad_size("size", format!("{size} bytes cannot be mapped")))?;
    crate::shm::ensure_capacity(file_size)?;
    let fd = memfd_create("devshare-channel", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .map_err(|e| os("memfd_create", e))?;
    ftruncate(&fd, file_size).map_err(|e| os(&format!("ftruncate of a memfd to {file_size} bytes"), e))?;
    fcntl_add_seals(&fd, SEALS).map_err(|e| os("fcntl(F_ADD_SEALS)", e))?;
    let map = Map::new(&fd, len, true, "a channel memfd")?;
    Ok(Box::new(Memfd { map, fd, size }))
}

impl Exported for Memfd {
    fn ptr(&self) -> *mut u8 {
        self.map.ptr()
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn key(&self) -> &[u8] {
        &[]
    }
    fn device_index(&self) -> i32 {
        0
    }
    fn survives_exporter_close(&self) -> bool {
        // Consumers hold the file through their mappings.
        true
    }
    fn channel_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.fd.as_fd())
    }
}

/// A received memfd, mapped in the consumer.
struct Received {
    map: Map,
    size: u64,
}

impl Mapping for Received {
    fn base(&self) -> *mut u8 {
        self.map.ptr()
    }
    fn size(&self) -> u64 {
        self.size
    }
}

/// The seals of a received descriptor, which only shared memory has (`F_GET_SEALS` asks no file
/// system's server); anything else is `Untrusted`.
fn seals_of_received(fd: &OwnedFd) -> Result<SealFlags> {
    // (A hugetlbfs memfd has seals too: the receive's screen, `fds::kind`, refused it.)
    fcntl_get_seals(fd).map_err(|_| {
        Error::Untrusted("the descriptor received with a channel handle is not a memfd (it has no seals)".into())
    })
}

/// The registry key of a received descriptor: its file's identity, from `fstat` — asked only
/// of shared memory (`F_GET_SEALS` first): a file of a FUSE or network file system is refused
/// before its `fstat` could wait for its server.
pub(crate) fn identity(fd: &OwnedFd) -> Result<[u8; 22]> {
    seals_of_received(fd)?;
    let st = fstat(fd).map_err(|e| os("fstat of a received memfd", e))?;
    let mut key = [0u8; 22];
    key[..6].copy_from_slice(b"memfd:");
    key[6..14].copy_from_slice(&st.st_dev.to_le_bytes());
    key[14..22].copy_from_slice(&st.st_ino.to_le_bytes());
    Ok(key)
}

/// Map a received descriptor for a handle of `alloc_size` bytes, after checking it: a regular
/// file, sealed against shrinking, at least `alloc_size` bytes and not larger than `alloc_size`
/// rounded up to whole pages (a channel memfd is exactly as large as its allocation). A larger
/// file is refused: mapping it would cost this process address space for memory the handle does
/// not name (a sealed, sparse 1 TiB memfd behind a 4 KiB handle). Maps the file, that is, what
/// the handle needs.
pub(crate) fn open_received(fd: &OwnedFd, alloc_size: u64, read_only: bool) -> Result<Box<dyn Mapping>> {
    // The seals first: only shared memory has them, and its `fstat` never leaves this kernel.
    let seals = seals_of_received(fd)?;
    let st = fstat(fd).map_err(|e| os("fstat of a received memfd", e))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(Error::Untrusted("the descriptor received with a channel handle is not a regular file".into()));
    }
    if !seals.contains(SealFlags::SHRINK) {
        return Err(Error::Untrusted(
            "the memfd received with a channel handle is not sealed against shrinking (F_SEAL_SHRINK): \
             its sender could shrink it under this process's reads"
                .into(),
        ));
    }
    let size = u64::try_from(st.st_size).unwrap_or(0);
    if size < alloc_size {
        return Err(Error::Mismatch(format!(
            "the received memfd is {size} bytes but the handle's alloc_size is {alloc_size}"
        )));
    }
    // SAFETY: sysconf has no preconditions.
    let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok().filter(|&p| p > 0).unwrap_or(4096);
    let needed = alloc_size.max(1).div_ceil(page).saturating_mul(page);
    if size > needed {
        return Err(Error::Untrusted(format!(
            "the received memfd is {size} bytes but its handle names {alloc_size} ({needed} in whole pages): \
             refused rather than map memory the handle does not name"
        )));
    }
    let len = usize::try_from(size)
        .ok()
        .filter(|&l| l <= isize::MAX as usize)
        .ok_or_else(|| Error::bad_size("alloc_size", format!("{size} bytes cannot be mapped")))?;
    let map = Map::new(fd, len, !read_only, "a received channel memfd")?;
    Ok(Box::new(Received { map, size }))
}
