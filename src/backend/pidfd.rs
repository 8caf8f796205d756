//! Taking another process's file descriptor (`pidfd_open` + `pidfd_getfd`), as PyTorch's CUDA
//! expandable segments require of their consumers, and letting a named process do it to us
//! (`PR_SET_PTRACER`). Every way this is refused gets its own message naming the cause and the
//! fix, because the kernel reports most of them as a bare EPERM.

use crate::error::{Error, Result};
use rustix::io::Errno;
use rustix::process::{pidfd_getfd, pidfd_open, set_ptracer, PTracer, Pid, PidfdFlags, PidfdGetfdFlags};
use std::os::fd::OwnedFd;

/// Yama's `kernel.yama.ptrace_scope`, when Yama is there.
fn ptrace_scope() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").ok()?.trim().parse().ok()
}

/// The real uid of `pid` (from `/proc/<pid>/status`) and the owner of `/proc/<pid>`, which is
/// root for a non-dumpable process.
fn proc_ids(pid: i32) -> Option<(u32, u32)> {
    use std::os::unix::fs::MetadataExt;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let uid = status.lines().find_map(|l| l.strip_prefix("Uid:"))?.split_whitespace().next()?.parse().ok()?;
    let owner = std::fs::metadata(format!("/proc/{pid}")).ok()?.uid();
    Some((uid, owner))
}

/// `CAP_SYS_PTRACE`'s bit in the `Cap*` masks of `/proc/<pid>/status`.
const CAP_SYS_PTRACE: u64 = 1 << 19;

/// A capability mask (`CapEff:`, `CapPrm:`) of `who` (`self` or a pid) from `/proc/<who>/status`.
fn caps(who: &str, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{who}/status")).ok()?;
    u64::from_str_radix(status.lines().find_map(|l| l.strip_prefix(field))?.trim(), 16).ok()
}

const NOT_DUMPABLE: &str = "the producer is not dumpable (it called prctl(PR_SET_DUMPABLE, 0), or changed its \
                            credentials, e.g. setuid): nothing but CAP_SYS_PTRACE may take its fds; keep the \
                            producer dumpable";

/// Why `pidfd_getfd` on `pid` was refused with EPERM, and what fixes it.
fn eperm_cause(pid: i32) -> String {
    let me = rustix::process::getuid().as_raw();
    if let Some((uid, owner)) = proc_ids(pid) {
        if uid != me && me != 0 {
            return format!(
                "the producer runs as uid {uid} and this process as uid {me}: taking its fds needs the same \
                 uid or CAP_SYS_PTRACE (run both as one user)"
            );
        }
        if owner == 0 && uid != 0 {
            return NOT_DUMPABLE.into();
        }
        // Same uid (root included, whose /proc entries are root's either way) and no
        // CAP_SYS_PTRACE: the kernel also wants the producer's capabilities to be a subset of
        // ours, and the producer dumpable. Yama restricts only attaching, so when even reading the
        // producer's /proc/<pid>/exe (ptrace read access) is refused, Yama is not the cause.
        let lacks_ptrace = caps("self", "CapEff:").is_some_and(|c| c & CAP_SYS_PTRACE == 0);
        if uid == me && lacks_ptrace {
            if let (Some(mine), Some(theirs)) = (caps("self", "CapPrm:"), caps(&pid.to_string(), "CapPrm:")) {
                if theirs & !mine != 0 {
                    return format!(
                        "the producer holds capabilities this process lacks (CapPrm {theirs:#x}, this process \
                         {mine:#x}): taking its fds needs CAP_SYS_PTRACE, or a consumer with at least the \
                         producer's capabilities"
                    );
                }
            }
            let read = std::fs::read_link(format!("/proc/{pid}/exe"));
            if read.is_err_and(|e| e.kind() == std::io::ErrorKind::PermissionDenied) {
                return NOT_DUMPABLE.into();
            }
        }
    }
    match ptrace_scope() {
        Some(1) => format!(
            "Yama ptrace_scope is 1, so only an ancestor of process {pid} may take its fds: have the producer \
             call devshare_allow_ptrace(<this pid>) (PR_SET_PTRACER), start this consumer from the producer, \
             or set kernel.yama.ptrace_scope=0"
        ),
        Some(2) => "Yama ptrace_scope is 2: taking another process's fds needs CAP_SYS_PTRACE \
                    (or kernel.yama.ptrace_scope <= 1)"
            .into(),
        Some(3) => "Yama ptrace_scope is 3: no process may take another's fds until reboot; share through a \
                    devshare channel (fds passed over a socket) or plain allocations instead"
            .into(),
        _ => "the kernel's ptrace-attach check refused it; in a container, the default seccomp profile blocks \
              pidfd_getfd without CAP_SYS_PTRACE (docker --cap-add SYS_PTRACE)"
            .into(),
    }
}

/// A handle to another process, for taking its fds.
pub struct Process {
    pid: i32,
    pidfd: OwnedFd,
}

impl Process {
    /// `pidfd_open(pid)`.
    ///
    /// The handle names the process, so it must be one of ours: a process of another user is
    /// refused (`Untrusted`) even when this one could take its fds (root, `CAP_SYS_PTRACE`), so
    /// that a handle cannot make a privileged consumer map a third user's exported memory.
    pub fn open(pid: i32) -> Result<Process> {
        let p = Pid::from_raw(pid)
            .ok_or_else(|| Error::InvalidArgument(format!("producer pid {pid} is not a process id")))?;
        let me = rustix::process::geteuid().as_raw();
        if let Some((uid, _)) = proc_ids(pid) {
            if uid != me {
                return Err(Error::Untrusted(format!(
                    "the handle's producer, process {pid}, runs as uid {uid}, this process as uid {me}: \
                     devshare takes segment fds only from processes of its own user"
                )));
            }
        }
        let pidfd = pidfd_open(p, PidfdFlags::empty()).map_err(|e| {
            let why = match e {
                Errno::SRCH => format!(
                    "process {pid} does not exist here: the producer exited (its segments went with it), or it \
                     runs in another pid namespace (containers must share the pid namespace, e.g. --pid=host)"
                ),
                Errno::NOSYS => "the kernel has no pidfd_open (Linux >= 5.3 is needed, >= 5.6 for pidfd_getfd)".into(),
                other => format!("{other}"),
            };
            Error::Os { call: format!("pidfd_open({pid})"), errno: e.raw_os_error(), message: why }
        })?;
        Ok(Process { pid, pidfd })
    }

    /// A duplicate of the process's file descriptor `fd` (close it when done): only shared
    /// memory, a device or an eventfd; anything else (a socket, a file of a FUSE or network file
    /// system, whose close could wait for its server as long as the producer liked) is closed on
    /// a thread of its own and refused (`fds::screened`).
    pub fn take_fd(&self, fd: i32) -> Result<OwnedFd> {
        TAKEN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let taken = pidfd_getfd(&self.pidfd, fd, PidfdGetfdFlags::empty()).map_err(|e| {
            let why = match e {
                Errno::PERM => eperm_cause(self.pid),
                Errno::BADF => format!(
                    "fd {fd} is not open in process {}: the producer freed the memory (and closed its fd), or the \
                     handle's records are not fd numbers",
                    self.pid
                ),
                Errno::SRCH => format!("process {} exited", self.pid),
                Errno::NOSYS => "the kernel has no pidfd_getfd (Linux >= 5.6 is needed)".into(),
                Errno::MFILE | Errno::NFILE => "too many open files in this process".into(),
                other => format!("{other}"),
            };
            Error::Os { call: format!("pidfd_getfd(pid {}, fd {fd})", self.pid), errno: e.raw_os_error(), message: why }
        })?;
        crate::fds::screened(taken, &format!("fd {fd} of process {}", self.pid))
    }
}

static TAKEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many fds this process tried to take from others with `pidfd_getfd` (imports of segments
/// passed over a channel take none).
pub fn fds_taken() -> u64 {
    TAKEN.load(std::sync::atomic::Ordering::Relaxed)
}

/// `prctl(PR_SET_PTRACER, pid)`: `-1` any process, `0` none.
pub fn allow_ptrace(pid: i32) -> Result<()> {
    let tracer = match pid {
        -1 => PTracer::Any,
        0 => PTracer::None,
        p => PTracer::ProcessID(
            Pid::from_raw(p).ok_or_else(|| Error::InvalidArgument(format!("pid {p} is not a process id")))?,
        ),
    };
    match set_ptracer(tracer) {
        Ok(()) => Ok(()),
        // Without Yama the call is refused with EINVAL and nothing is needed.
        Err(Errno::INVAL) if ptrace_scope().is_none() => Ok(()),
        Err(e) => Err(Error::Os {
            call: format!("prctl(PR_SET_PTRACER, {pid})"),
            errno: e.raw_os_error(),
            message: format!("{e}"),
        }),
    }
}
