//! Descriptors from another process (`SCM_RIGHTS` on a channel, `pidfd_getfd` from a producer):
//! which kinds this library keeps, and the thread that closes the others.
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
//! (`statx` with `AT_STATX_DONT_SYNC`, which takes the cached attributes, and `F_GET_SEALS`, which
//! only shared memory answers), and only three kinds are kept: shared memory (a memfd, a tmpfs
//! file), a character device (the NVIDIA driver's exported memory) and an anonymous inode (an
//! eventfd). No honest message carries anything else; the rest are closed on a thread of their
//! own ([`close_elsewhere`]), never by the caller.

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
            Kind::Other => "a file that is not shared memory",
        }
    }
}

/// What `fd` refers to, asked without a round trip to any file system's server: `statx` with
/// `AT_STATX_DONT_SYNC` for its type (a FUSE file's cached attributes, where `fstat` would ask
/// its server), `F_GET_SEALS` to tell shared memory from other regular files.
pub(crate) fn kind(fd: impl AsFd) -> Kind {
    let fd = fd.as_fd();
    // An `O_PATH` descriptor names a node without opening it, which a `nodev` mount does not
    // stop: a FUSE server can make such a node look like a device, and what is asked of it goes
    // to that server. No honest message carries one.
    if rustix::fs::fcntl_getfl(fd).map_or(true, |fl| fl.contains(rustix::fs::OFlags::PATH)) {
        return Kind::Other;
    }
    let shared_memory = || rustix::fs::fcntl_get_seals(fd).is_ok();
    match rustix::fs::statx(fd, "", AtFlags::EMPTY_PATH | AtFlags::STATX_DONT_SYNC, StatxFlags::TYPE) {
        Ok(st) => match FileType::from_raw_mode(u32::from(st.stx_mode)) {
            FileType::RegularFile if shared_memory() => Kind::SharedMemory,
            // Some kernels give anonymous inodes a regular file's type; their name says what
            // they are (a link in /proc, which no file system's server is asked for).
            FileType::RegularFile if anonymous_by_name(fd) => Kind::Anonymous,
            FileType::CharacterDevice => Kind::Device,
            FileType::Socket => Kind::Socket,
            FileType::Unknown => Kind::Anonymous,
            _ => Kind::Other,
        },
        // No statx (a kernel before 4.11, a sandbox that forbids it): only what shared memory
        // and anonymous inodes vouch for themselves is kept (a device is not: only `statx` can
        // tell one without asking its file system).
        Err(_) if shared_memory() => Kind::SharedMemory,
        Err(_) if anonymous_by_name(fd) => Kind::Anonymous,
        Err(_) => Kind::Other,
    }
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
/// which settles the plain case), and all of them closed on the closing thread
/// ([`close_elsewhere`]). The kind of the first one taken, when any was: the message they came
/// with is to be refused.
pub(crate) fn take_unwanted(fds: &mut Vec<OwnedFd>) -> Option<&'static str> {
    let kinds: Vec<Kind> = fds.iter().map(kind).collect();
    let first = kinds.iter().copied().find(|&k| !kept(k))?;
    let mut unwanted = Vec::new();
    for (fd, k) in std::mem::take(fds).into_iter().zip(kinds) {
        if kept(k) {
            fds.push(fd);
        } else {
            // (On anything but a socket this fails at once, which is as good: a socket that
            // `statx` could not name is set too.)
            let _ = rustix::net::sockopt::set_socket_linger(&fd, Some(std::time::Duration::ZERO));
            unwanted.push(fd);
        }
    }
    close_elsewhere(unwanted);
    Some(first.what())
}

/// `fd`, taken from another process (`what` names it in the error), when it is of a kind kept
/// (see the module); else closed on the closing thread and refused (`Untrusted`).
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

/// Most descriptors waiting for the closing thread at once; past it (a close that blocks for
/// ever, and more keep coming) they are left open: never blocking a caller comes first, and
/// every message that brought one was refused, which counts against its sender.
const MAX_PENDING_CLOSES: usize = 1024;

/// Close `fds` on the process's closing thread (started when first needed; again in a forked
/// child, which never touches the parent's), so that a close that blocks holds up no caller.
/// Never waits: when the thread cannot start, is busy being started by another thread, or has
/// [`MAX_PENDING_CLOSES`] waiting, the descriptors are left open.
pub(crate) fn close_elsewhere(fds: Vec<OwnedFd>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc::Sender;
    type Closer = Option<(crate::fork::Stamp, Sender<Vec<OwnedFd>>)>;
    static CLOSER: std::sync::Mutex<Closer> = std::sync::Mutex::new(None);
    static PENDING: AtomicUsize = AtomicUsize::new(0);
    if fds.is_empty() {
        return;
    }
    // (A lock held at a fork stays held in the child: try it, never wait for it.)
    let mut closer = match CLOSER.try_lock() {
        Ok(g) => g,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return std::mem::forget(fds),
    };
    if closer.as_ref().map_or(true, |(stamp, _)| !stamp.is_current()) {
        // A forked child's copy of the parent's channel is never dropped or used.
        if let Some(stale) = closer.take() {
            std::mem::forget(stale);
        }
        PENDING.store(0, Ordering::Relaxed);
        let (tx, rx) = std::sync::mpsc::channel::<Vec<OwnedFd>>();
        let started = std::thread::Builder::new().name("devshare-close".into()).spawn(move || {
            for batch in rx {
                let n = batch.len();
                drop(batch);
                PENDING.fetch_sub(n, Ordering::Relaxed);
            }
        });
        *closer = started.is_ok().then(|| (crate::fork::Stamp::now(), tx));
    }
    let n = fds.len();
    match closer.as_ref() {
        Some((_, tx)) if PENDING.load(Ordering::Relaxed) + n <= MAX_PENDING_CLOSES => {
            PENDING.fetch_add(n, Ordering::Relaxed);
            if let Err(unsent) = tx.send(fds) {
                PENDING.fetch_sub(n, Ordering::Relaxed);
                std::mem::forget(unsent.0);
            }
        }
        _ => std::mem::forget(fds),
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
