//! Descriptors from another process (`SCM_RIGHTS` on a channel, `pidfd_getfd` from a producer):
//! which kinds this library keeps, and the threads that close the others.
//!
//! A peer chooses what a descriptor it sends refers to, and some files make whoever touches them
//! wait for as long as the sender likes:
//!
//! - a socket, whose close lingers over unsent data (`SO_LINGER`), or a Unix socket whose receive
//!   queue holds the last reference to such a socket;
//! - a file on a FUSE or network file system, whose `fstat` asks the file system's server for
//!   fresh attributes and whose close asks it to flush: a server the sender runs (any user may
//!   mount a FUSE file system) need never answer.
//!
//! So a received descriptor is first classified without any file system's help
//! (`statx` with `AT_STATX_DONT_SYNC`, which takes the cached attributes, `F_GET_SEALS`, which
//! only shared memory answers, and `fstatfs` of that), and only three kinds are kept: shared memory (a memfd, a tmpfs
//! file), a character device (the NVIDIA driver's exported memory) and an anonymous inode (an
//! eventfd). No honest message carries anything else; the rest are closed on a thread of their
//! own ([`close_elsewhere`]), never by the caller.
//!
//! A device node is kept whatever file system holds it. One on a FUSE mount opens as its device
//! only where the mount is not `nodev`, which takes the initial namespace's root (`fusermount`
//! and mounts in a user namespace are always `nodev`; what else is sent of them is an `O_PATH`
//! descriptor, never kept): its `fstat` waits for the server, so this library never asks one
//! (a ring reads its seals first), but a driver given such a descriptor as device memory may,
//! and its close may wait (as may a CUSE device's, whose server is a process; creating one
//! takes root too).
//!
//! Shared memory is tmpfs's only: a hugetlbfs memfd answers `F_GET_SEALS` too, but its sender
//! can punch out a page under a reader (`fallocate`), whose next touch dies of `SIGBUS` once no
//! huge page is free.

use rustix::fs::{AtFlags, FileType, StatxFlags};
use std::os::fd::{AsFd, OwnedFd};

/// What a received descriptor refers to, as far as what may be done with it goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A shared-memory file (memfd, tmpfs): `fstat`, `mmap` and close never leave this kernel.
    SharedMemory,
    /// A character device (the NVIDIA driver's exported memory is its control device).
    Device,
    /// An anonymous inode (eventfd and its kind).
    Anonymous,
    /// A socket: its close may wait for its data to drain.
    Socket,
    /// A hugetlbfs file (a `MFD_HUGETLB` memfd): sealed like shared memory, but a page its
    /// sender punches out (`fallocate`) is faulted in again only while a huge page is free, and
    /// a reader of it dies of `SIGBUS` when none is.
    HugePages,
    /// Anything else: a file on a disk, FUSE or network file system (whose `fstat` and close
    /// may wait for its server), a directory, a pipe, a block device.
    Other,
}

impl Kind {
    /// What a message names the kind by, in a refusal.
    fn what(self) -> &'static str {
        match self {
            Kind::SharedMemory => "shared memory",
            Kind::Device => "a character device",
            Kind::Anonymous => "an anonymous inode",
            Kind::Socket => "a socket",
            Kind::HugePages => "a hugetlbfs file (its sender could leave holes that kill its readers with SIGBUS)",
            Kind::Other => "a file that is not shared memory",
        }
    }
}

/// What `fd` refers to, asked without a round trip to any file system's server: `F_GET_SEALS`
/// first (only shared memory and hugetlbfs answer it, in this kernel; the common case), then
/// `fstatfs` to tell them apart (tmpfs's memory, whose holes read as zeros, is kept), else
/// `F_GETFL` and `statx` with `AT_STATX_DONT_SYNC` for the type (a FUSE file's cached
/// attributes, where `fstat` would ask its server).
pub(crate) fn kind(fd: impl AsFd) -> Kind {
    let fd = fd.as_fd();
    // (`fcntl` refuses `F_GET_SEALS` on an `O_PATH` descriptor: one that answers is opened.)
    if rustix::fs::fcntl_get_seals(fd).is_ok() {
        return if on_tmpfs(fd) { Kind::SharedMemory } else { Kind::HugePages };
    }
    // An `O_PATH` descriptor names a node without opening it, which a `nodev` mount does not
    // stop: a FUSE server can make such a node look like a device, and what is asked of it goes
    // to that server. No honest message carries one.
    if rustix::fs::fcntl_getfl(fd).map_or(true, |fl| fl.contains(rustix::fs::OFlags::PATH)) {
        return Kind::Other;
    }
    match rustix::fs::statx(fd, "", AtFlags::EMPTY_PATH | AtFlags::STATX_DONT_SYNC, StatxFlags::TYPE) {
        Ok(st) => match FileType::from_raw_mode(u32::from(st.stx_mode)) {
            // Some kernels give anonymous inodes a regular file's type; their name says what
            // they are (a link in /proc, which no file system's server is asked for).
            FileType::RegularFile if anonymous_by_name(fd) => Kind::Anonymous,
            FileType::CharacterDevice => Kind::Device,
            FileType::Socket => Kind::Socket,
            FileType::Unknown => Kind::Anonymous,
            _ => Kind::Other,
        },
        // No statx (a kernel before 4.11, a sandbox that forbids it): only what anonymous
        // inodes say of themselves is believed (a device is not: only `statx` can tell one
        // without asking its file system).
        Err(_) if anonymous_by_name(fd) => Kind::Anonymous,
        Err(_) => Kind::Other,
    }
}

/// Whether `fd`, which answered `F_GET_SEALS`, is tmpfs's (a memfd without `MFD_HUGETLB`, a
/// file in `/dev/shm`): `fstatfs` of it, or of a hugetlbfs file, never leaves this kernel.
fn on_tmpfs(fd: impl AsFd) -> bool {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    // (`f_type` is an i64 here, an i32 or u32 on some architectures.)
    #[allow(clippy::unnecessary_cast)]
    rustix::fs::fstatfs(fd).is_ok_and(|s| s.f_type as i64 == TMPFS_MAGIC)
}

/// Whether `fd`'s link in `/proc/self/fd` names an anonymous inode (`anon_inode:[eventfd]`).
fn anonymous_by_name(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    use std::os::fd::AsRawFd;
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .is_ok_and(|l| l.as_os_str().as_encoded_bytes().starts_with(b"anon_inode:"))
}

/// Whether a descriptor of this kind may be kept (and later closed by whoever holds it).
fn kept(k: Kind) -> bool {
    matches!(k, Kind::SharedMemory | Kind::Device | Kind::Anonymous)
}

/// Take out of `fds` every descriptor of a kind no honest message carries (sockets, files that
/// are not shared memory, see the module): each socket set to close at once (`SO_LINGER` 0,
/// which settles the plain case), and each closed on a thread of its own
/// ([`close_elsewhere`]). The kind of the first one taken, when any was: the message they came
/// with is to be refused.
pub(crate) fn take_unwanted(fds: &mut Vec<OwnedFd>) -> Option<&'static str> {
    // (Nothing is allocated while all are kept; a refused message's kinds are asked twice.)
    let first = fds.iter().map(kind).find(|&k| !kept(k))?;
    let (keep, unwanted): (Vec<OwnedFd>, Vec<OwnedFd>) = std::mem::take(fds).into_iter().partition(|fd| kept(kind(fd)));
    *fds = keep;
    for fd in &unwanted {
        // (On anything but a socket this fails at once, which is as good: a socket that
        // `statx` could not name is set too.)
        let _ = rustix::net::sockopt::set_socket_linger(fd, Some(std::time::Duration::ZERO));
    }
    close_elsewhere(unwanted);
    Some(first.what())
}

/// `fd`, taken from another process (`what` names it in the error), when it is of a kind kept
/// (see the module); else closed on a thread of its own and refused (`Untrusted`).
pub(crate) fn screened(fd: OwnedFd, what: &str) -> crate::error::Result<OwnedFd> {
    let k = kind(&fd);
    if kept(k) {
        return Ok(fd);
    }
    close_elsewhere(vec![fd]);
    Err(crate::error::Error::Untrusted(format!(
        "{what} is {}: only shared memory, a device or an eventfd is taken from another process",
        k.what()
    )))
}

/// Most closing threads at once; past it (closes that block for ever, and more keep coming)
/// descriptors are left open: never blocking a caller comes first, and every message that
/// brought one was refused, which counts against its sender.
const MAX_CLOSING: usize = 256;

/// Closing threads of this process now running (set to 0 in a forked child, which has none).
static CLOSING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

struct ClosingFork;

impl crate::fork::ForkHook for ClosingFork {
    fn prepare(&self) {}
    fn parent(&self) {}
    fn child(&self) {
        CLOSING.store(0, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Close each of `fds` on a thread of its own, so that a close that blocks holds up no caller.
/// One thread per descriptor: the kernel takes a descriptor out of the table as its close
/// begins, so a close that waits for ever (a FUSE file's flush) holds only its own; behind one
/// thread, the others would stay in the table, and every `exec` of a child (which closes them)
/// would wait too. Never waits: when a thread cannot start, or [`MAX_CLOSING`] are running, the
/// descriptor is left open.
pub(crate) fn close_elsewhere(fds: Vec<OwnedFd>) {
    use std::os::fd::{FromRawFd, IntoRawFd};
    use std::sync::atomic::Ordering;
    static HOOK: std::sync::Once = std::sync::Once::new();
    if fds.is_empty() {
        return;
    }
    HOOK.call_once(|| crate::fork::register(&ClosingFork));
    for fd in fds {
        if CLOSING.fetch_add(1, Ordering::Relaxed) >= MAX_CLOSING {
            CLOSING.fetch_sub(1, Ordering::Relaxed);
            std::mem::forget(fd);
            continue;
        }
        // The number moves to the thread; should it not start, the descriptor stays open.
        let raw = fd.into_raw_fd();
        let started = std::thread::Builder::new().name("devshare-close".into()).stack_size(64 << 10).spawn(move || {
            // SAFETY: `raw` was an owned descriptor, handed to this thread alone.
            drop(unsafe { OwnedFd::from_raw_fd(raw) });
            CLOSING.fetch_sub(1, Ordering::Relaxed);
        });
        if started.is_err() {
            CLOSING.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_of_what_a_peer_may_send() {
        let mem =
            rustix::fs::memfd_create("kind", rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING)
                .unwrap();
        assert_eq!(kind(&mem), Kind::SharedMemory);
        let efd = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap();
        assert_eq!(kind(&efd), Kind::Anonymous);
        let null = std::fs::File::open("/dev/null").unwrap();
        assert_eq!(kind(&null), Kind::Device);
        let (a, _b) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::STREAM,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        assert_eq!(kind(&a), Kind::Socket);
        let dir = std::fs::File::open("/").unwrap();
        assert_eq!(kind(&dir), Kind::Other);
        let path_only = rustix::fs::open(
            "/dev/null",
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
        assert_eq!(kind(&path_only), Kind::Other, "an O_PATH descriptor, even of a device, is not kept");
        let proc_file = std::fs::File::open("/proc/self/status").unwrap();
        assert_eq!(kind(&proc_file), Kind::Other, "a file of a file system (here procfs) is not shared memory");

        let shm = format!("/dev/shm/devshare-fds-kind-{}", std::process::id());
        let tmpfs = std::fs::OpenOptions::new().create(true).truncate(true).write(true).open(&shm).unwrap();
        std::fs::remove_file(&shm).unwrap();
        assert_eq!(kind(&tmpfs), Kind::SharedMemory, "a tmpfs file is shared memory");

        let mut fds: Vec<OwnedFd> = vec![mem, OwnedFd::from(dir), efd];
        assert_eq!(take_unwanted(&mut fds), Some("a file that is not shared memory"));
        assert_eq!(fds.len(), 2, "the memfd and the eventfd stay, in order");
        assert_eq!(kind(&fds[0]), Kind::SharedMemory);
        assert_eq!(take_unwanted(&mut fds), None, "nothing else to take");
    }

    #[test]
    fn a_descriptor_taken_from_another_process_is_kept_only_when_of_a_kept_kind() {
        let mem = rustix::fs::memfd_create("screened", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        assert!(screened(mem, "fd 3 of process 1").is_ok(), "shared memory is kept");
        let proc_file = OwnedFd::from(std::fs::File::open("/proc/self/status").unwrap());
        let err = screened(proc_file, "fd 4 of process 1").unwrap_err();
        assert_eq!(err.status(), crate::error::Status::Untrusted);
        assert!(err.to_string().contains("fd 4 of process 1 is a file that is not shared memory"), "{err}");
    }
}
