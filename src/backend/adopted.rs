//! Adopted exports: device memory that another exporter in this process shared — PyTorch's or
//! torch_npu's caching allocator (`reduce_tensor`, `_share_cuda_`, `_share_npu_`) — taken over
//! from its handle so that devshare can lease it over channels.
//!
//! The adopted handle names the allocation (a CUDA IPC handle, an ACL key, or a segment table)
//! and the storage inside it; an [`Adopted`] export hands out handles for tensors inside that
//! storage only ([`Exported::window`]). It owns nothing of the memory: the caller keeps the
//! storage alive while leases are out. What it owns are duplicates of the segment fds a CUDA
//! segmented handle lists (valid in this process, where the allocator exported them), so they
//! travel with `SCM_RIGHTS` and consumers never call `pidfd_getfd`.

use super::{Backend, Exported, IpcEvent};
use crate::error::{Error, Result};
use crate::handle::segments::{SegmentTable, DEVSHARE_SEGMENTS_CUDA_FD};
use crate::handle::DevshareHandle;
use std::ffi::c_void;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

/// What an adopted export needs from its runtime.
pub(crate) trait AdoptRuntime: Send + Sync {
    /// Record an interprocess event on `stream` (or synchronise it) on `device`, as the
    /// backend's own exports do before a handle travels.
    fn prepare_share(&self, device: i32, stream: *mut c_void, event: bool) -> Result<Option<Box<dyn IpcEvent>>>;
    /// Let `pid` import the adopted memory (ACL whitelist); a no-op where there is none.
    fn allow_pid(&self, _a: &Adopted, _pid: i32) -> Result<()> {
        Ok(())
    }
}

/// A handle's allocation, adopted (see the module doc).
pub(crate) struct Adopted {
    pub(crate) runtime: &'static dyn AdoptRuntime,
    /// The key as handles carry it (empty for segmented memory).
    pub(crate) key: Vec<u8>,
    /// Segment size, kind and table (fd records rewritten to `fds`' numbers).
    pub(crate) segments: Option<(u64, u16, Vec<u8>)>,
    /// Duplicates of the segment fds, each distinct fd once, in table order.
    fds: Vec<OwnedFd>,
    pub(crate) device: i32,
    uuid: [u8; 16],
    size: u64,
    window: (u64, u64),
}

impl Adopted {
    /// Adopt validated handle `h` (its segment table `segments`, when segmented). `uuid`: the
    /// device's UUID when the backend knows it.
    pub(crate) fn new(
        runtime: &'static dyn AdoptRuntime,
        h: &DevshareHandle,
        segments: Option<&SegmentTable<'_>>,
        uuid: [u8; 16],
    ) -> Result<Adopted> {
        let mut fds = Vec::new();
        let segments = match segments {
            None => None,
            Some(t) if t.seg.kind == DEVSHARE_SEGMENTS_CUDA_FD => {
                let me = std::process::id() as i32;
                if t.producer_pid != me {
                    return Err(Error::InvalidArgument(format!(
                        "the handle's segment fds are valid in process {}, not in this one ({me}): adopt a \
                         segmented CUDA handle in the process that shared it",
                        t.producer_pid
                    )));
                }
                let (table, owned) = duplicate_fds(t, t.seg.segment_size)?;
                fds = owned;
                Some((t.seg.segment_size, t.seg.kind, table))
            }
            Some(t) => Some((t.seg.segment_size, t.seg.kind, t.table.to_vec())),
        };
        Ok(Adopted {
            runtime,
            key: if segments.is_some() { Vec::new() } else { h.key_bytes().to_vec() },
            segments,
            fds,
            device: h.device_index,
            uuid: if h.device_uuid != [0; 16] { h.device_uuid } else { uuid },
            size: h.alloc_size,
            window: (h.storage_offset, h.storage_size),
        })
    }
}

/// Duplicate each distinct fd of an fd table (close-on-exec) and rewrite the table with the
/// duplicates' numbers. An fd that is not open here is refused by number, and one that is not
/// the memory of a segment of `segment_size` bytes by what it is ([`check_segment_fd`]).
fn duplicate_fds(t: &SegmentTable<'_>, segment_size: u64) -> Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut owned: Vec<(i32, OwnedFd)> = Vec::new();
    let mut table = Vec::with_capacity(t.table.len());
    for fd in t.fds() {
        let new = match owned.iter().find(|(old, _)| *old == fd) {
            Some((_, d)) => d.as_raw_fd(),
            None => {
                if fd < 0 {
                    return Err(Error::invalid("segment table", format!("fd {fd} is negative")));
                }
                // SAFETY: only borrowed for the duplicating call; fcntl fails with EBADF when
                // the number is not open, and nothing else is done with it.
                let b = unsafe { BorrowedFd::borrow_raw(fd) };
                let d = rustix::io::fcntl_dupfd_cloexec(b, 3).map_err(|e| {
                    Error::InvalidArgument(format!(
                        "segment fd {fd} of the handle is not open in this process ({e}): it was closed, or \
                         the handle was not shared here"
                    ))
                })?;
                check_segment_fd(&d, fd, segment_size)?;
                let n = d.as_raw_fd();
                owned.push((fd, d));
                n
            }
        };
        table.extend_from_slice(&new.to_le_bytes());
    }
    Ok((table, owned.into_iter().map(|(_, d)| d).collect()))
}

/// Major number of NVIDIA's character devices (`NV_MAJOR_DEVICE_NUMBER`: `/dev/nvidia<N>`,
/// `/dev/nvidiactl`).
const NVIDIA_MAJOR: u32 = 195;

/// Whether `fd` (number `number` in the handle) can be the memory of one segment of
/// `segment_size` bytes. The duplicate is passed with `SCM_RIGHTS` to every consumer of the
/// export, so an fd a forged tuple names — a private file, a socket, a pipe — would hand that
/// object to them, readable and writable. Only what `cuMemExportToShareableHandle` makes passes:
///
/// - the NVIDIA driver's fd, a character device of NVIDIA's major (its control device: the
///   driver's own import looks the fd up by that device and refuses any other);
/// - a memfd of at least `segment_size` bytes (what drivers that keep the memory in host pages
///   make, the CUDA stand-in among them): `F_GET_SEALS` succeeds only on shmem files, and a
///   memfd has no link in any directory and is named `/memfd:...` in `/proc/self/fd`, which
///   tells it from a file of a tmpfs directory.
///
/// Anything else is [`Error::Untrusted`], naming the fd and what it is.
fn check_segment_fd(d: &OwnedFd, number: i32, segment_size: u64) -> Result<()> {
    use rustix::fs::{fstat, FileType};
    let refuse = |what: String| {
        Err(Error::Untrusted(format!(
            "segment fd {number} of the handle is {what}, not the memory of a {segment_size}-byte \
             expandable segment (a memfd of at least that size, or an NVIDIA driver fd): it is \
             not adopted, so that it is never passed to consumers"
        )))
    };
    let st = fstat(d).map_err(|e| Error::Os {
        call: format!("fstat(segment fd {number})"),
        errno: e.raw_os_error(),
        message: e.to_string(),
    })?;
    match FileType::from_raw_mode(st.st_mode) {
        FileType::CharacterDevice => {
            let major = rustix::fs::major(st.st_rdev);
            if major == NVIDIA_MAJOR {
                return Ok(());
            }
            refuse(format!("a character device ({major}:{}) that is not NVIDIA's", rustix::fs::minor(st.st_rdev)))
        }
        FileType::RegularFile => {
            let link = std::fs::read_link(format!("/proc/self/fd/{}", d.as_raw_fd())).ok();
            let named_memfd = link.as_ref().map_or(true, |l| l.as_os_str().as_encoded_bytes().starts_with(b"/memfd:"));
            if rustix::fs::fcntl_get_seals(d).is_err() || st.st_nlink != 0 || !named_memfd {
                let shown = link.map_or_else(|| "a regular file".to_owned(), |l| format!("the file {}", l.display()));
                return refuse(format!("{shown}, a regular file and not a memfd"));
            }
            if (st.st_size as u64) < segment_size {
                return refuse(format!("a memfd of {} bytes", st.st_size));
            }
            Ok(())
        }
        _ => refuse(crate::shm::file_kind(st.st_mode as libc::mode_t).to_owned()),
    }
}

impl Exported for Adopted {
    /// The memory's address in this process is the allocator's business: not known here.
    fn ptr(&self) -> *mut u8 {
        std::ptr::null_mut()
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn key(&self) -> &[u8] {
        &self.key
    }
    fn device_index(&self) -> i32 {
        self.device
    }
    fn device_uuid(&self) -> [u8; 16] {
        self.uuid
    }
    /// The allocator frees the memory once its storage is gone: leases must come back first.
    fn survives_exporter_close(&self) -> bool {
        false
    }
    fn segments(&self) -> Option<(u64, u16, &[u8])> {
        self.segments.as_ref().map(|(s, k, t)| (*s, *k, t.as_slice()))
    }
    fn segment_fds(&self) -> Vec<BorrowedFd<'_>> {
        self.fds.iter().map(|f| f.as_fd()).collect()
    }
    fn window(&self) -> (u64, u64) {
        self.window
    }
    fn allow_pid(&self, pid: i32) -> Result<()> {
        self.runtime.allow_pid(self, pid)
    }
    fn prepare_share(&self, stream: *mut c_void, event: bool) -> Result<Option<Box<dyn IpcEvent>>> {
        self.runtime.prepare_share(self.device, stream, event)
    }
}

/// [`Backend::adopt`] for device backends: the checks every adoption shares.
pub(crate) fn check(backend: &dyn Backend, h: &DevshareHandle) -> Result<()> {
    use crate::handle::{DEVSHARE_HANDLE_FLAG_CHANNEL, DEVSHARE_HANDLE_FLAG_INFLIGHT};
    if h.backend != backend.id() {
        return Err(Error::Internal("adoption routed to another backend".into()));
    }
    if h.flags & (DEVSHARE_HANDLE_FLAG_CHANNEL | DEVSHARE_HANDLE_FLAG_INFLIGHT) != 0 {
        return Err(Error::InvalidArgument(
            "channel and in-flight handles are host handles: a device handle cannot carry them".into(),
        ));
    }
    Ok(())
}
