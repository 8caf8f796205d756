//! The trust boundary (issue 11): what a handle may make a consumer open, write or unlink.
//!
//! - items 1: only devshare's and PyTorch's name families, owned by this user, mode 0600, of a
//!   plausible size, checked on the opened descriptor before anything is written; a refused
//!   object is left byte for byte as it was, through import, discard and release;
//! - item 2: the in-flight flag is checked against the producer's record;
//! - item 4: corrupt ref-counter slots are reported, never summed;
//! - item 9: an allocation `/dev/shm` cannot hold is refused before anything is created;
//! - a name a handle gives is never opened in a way that can block (a FIFO put under a
//!   ref-counter's or a data object's name fails the import or is left at release, at once);
//! - adoption (`Exporter::adopt`, what `devshare_exporter_adopt` calls) passes on only the
//!   memory a tuple describes (an 'e' tuple's fds must be memory, not any open file or socket)
//!   and returns only a reference that is its own (not another exporter's slot).
//!
//! Every object a test makes itself carries this process's pid in its name and is removed by
//! that exact name; nothing is ever removed by prefix.

use devshare::backend::ImportRequest;
use devshare::dtype::DevshareDType;
use devshare::export::{Exporter, TensorDesc};
use devshare::handle::{DevshareHandle, DEVSHARE_HANDLE_FLAG_INFLIGHT};
use devshare::import::{discard, discard_handle, import};
use devshare::Status;
use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::Duration;

mod common;

/// The tests look at /dev/shm and header counts: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

const RC_SIZE: usize = 64 + 8 * 10000;

fn pid() -> u32 {
    std::process::id()
}

fn path(name: &[u8]) -> std::path::PathBuf {
    std::path::Path::new("/dev/shm").join(std::str::from_utf8(&name[1..]).unwrap())
}

fn header_count(name: &[u8]) -> Option<i32> {
    let bytes = std::fs::read(path(name)).ok()?;
    Some(i32::from_ne_bytes(bytes[..4].try_into().unwrap()))
}

/// A unique 32-hex-digit tail for names in devshare's own family.
fn hex32() -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    format!("{:032x}", (nanos << 20) ^ u128::from(N.fetch_add(1, Ordering::SeqCst)) ^ (u128::from(pid()) << 96))
}

/// A shm object this test made (mode, owner and bytes of its choosing); unlinked by its exact
/// name on drop.
struct Foreign {
    name: Vec<u8>,
}

impl Foreign {
    fn new(name: &str, mode: u32, bytes: &[u8]) -> Foreign {
        let c = CString::new(name).unwrap();
        // SAFETY: c is NUL-terminated; the descriptor is checked and closed below.
        let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_CREAT | libc::O_EXCL | libc::O_RDWR, 0o600) };
        assert!(fd >= 0, "shm_open({name}): {}", std::io::Error::last_os_error());
        // SAFETY: fd is open; bytes is a valid buffer of bytes.len() bytes.
        unsafe {
            assert_eq!(libc::fchmod(fd, mode), 0);
            assert_eq!(libc::write(fd, bytes.as_ptr().cast(), bytes.len()), bytes.len() as isize);
            libc::close(fd);
        }
        Foreign { name: name.as_bytes().to_vec() }
    }

    /// A data object in PyTorch's layout: header count 1, then `data` bytes of a pattern.
    fn data(name: &str, mode: u32, data: usize) -> Foreign {
        let mut b: Vec<u8> = (0..64 + data).map(|i| (i * 7 + 3) as u8).collect();
        b[..4].copy_from_slice(&1i32.to_ne_bytes());
        Foreign::new(name, mode, &b)
    }

    /// A ref-counter-like object of `size` bytes: header count 1, slot 0 = 1, the rest a pattern.
    fn rc(name: &str, mode: u32, size: usize) -> Foreign {
        let mut b: Vec<u8> = (0..size).map(|i| (i * 13 + 5) as u8).collect();
        b[..4].copy_from_slice(&1i32.to_ne_bytes());
        if size >= 72 {
            b[64..72].copy_from_slice(&1i64.to_ne_bytes());
        }
        Foreign::new(name, mode, &b)
    }

    fn chown(&self, uid: u32) {
        std::os::unix::fs::chown(path(&self.name), Some(uid), None).unwrap();
    }

    /// Bytes, mode and owner now.
    fn state(&self) -> (Vec<u8>, u32, u32) {
        let p = path(&self.name);
        let m = std::fs::metadata(&p).unwrap_or_else(|e| panic!("{} is gone: {e}", p.display()));
        (std::fs::read(&p).unwrap(), m.permissions().mode() & 0o7777, m.uid())
    }
}

impl Drop for Foreign {
    fn drop(&mut self) {
        let c = CString::new(self.name.clone()).unwrap();
        // SAFETY: c is NUL-terminated.
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }
}

fn desc(inflight: bool) -> TensorDesc<'static> {
    TensorDesc { dtype: DevshareDType::new(1, 8, 1), shape: &[4096], inflight, ..Default::default() }
}

fn with_key(h: &DevshareHandle, key: &[u8]) -> DevshareHandle {
    let mut h = *h;
    h.key = [0; devshare::handle::DEVSHARE_KEY_CAPACITY];
    h.key[..key.len()].copy_from_slice(key);
    h.key_len = key.len() as u32;
    h
}

fn with_ref(h: &DevshareHandle, name: &[u8], slot: u64) -> DevshareHandle {
    let mut h = *h;
    h.ref_name = [0; devshare::handle::DEVSHARE_REF_NAME_CAPACITY];
    h.ref_name[..name.len()].copy_from_slice(name);
    h.ref_name_len = name.len() as u32;
    h.ref_slot = slot;
    h
}

fn status<T>(r: devshare::Result<T>) -> Status {
    match r {
        Ok(_) => Status::Ok,
        Err(e) => e.status(),
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Item 1, data objects: a handle naming anything but a checked object of devshare's or
/// PyTorch's family is refused before the object is mapped or counted, through import and
/// through discard (an in-flight handle's discard imports it), and the object is untouched.
#[test]
fn host_keys_outside_the_families_or_not_ours_are_refused_and_left_untouched() {
    let _g = lock();
    let exp = Exporter::host_alloc(4096).unwrap();
    let genuine = exp.share(&desc(true)).unwrap();
    let p = pid();

    // Names that are never opened at all (they need not exist: refused before shm_open).
    for name in [
        format!("/.hidden_{p}"),
        format!("/..x{p}"),
        format!("/trust_{p}_nothing"),
        format!("/devshare_{p}_short"),
        format!("/torch_{p}"),
        format!("/torch_{p}_x1"),
    ] {
        let h = with_key(&genuine, name.as_bytes());
        assert_eq!(status(import(&h, ImportRequest::default())), Status::Untrusted, "{name}");
        assert_eq!(status(discard_handle(&h)), Status::Untrusted, "{name}");
    }

    let mut cases = vec![
        (
            "an existing object outside the families",
            Foreign::data(&format!("/trust_{p}_data"), 0o600, 4096),
            Status::Untrusted,
        ),
        (
            "a devshare name, mode 0644",
            Foreign::data(&format!("/devshare_{p}_{}", hex32()), 0o644, 4096),
            Status::Untrusted,
        ),
        (
            "a devshare name, mode 0640",
            Foreign::data(&format!("/devshare_{p}_{}", hex32()), 0o640, 4096),
            Status::Untrusted,
        ),
        ("a PyTorch name, mode 0604", Foreign::data(&format!("/torch_{p}_77_0"), 0o604, 4096), Status::Untrusted),
        (
            "a devshare name, too small for the handle",
            Foreign::data(&format!("/devshare_{p}_{}", hex32()), 0o600, 100),
            Status::Mismatch,
        ),
    ];
    if is_root() {
        // A root consumer ignores mode bits: ownership is what keeps other users' objects out.
        let f = Foreign::data(&format!("/devshare_{p}_{}", hex32()), 0o600, 4096);
        f.chown(65534);
        cases.push(("a devshare name owned by another user", f, Status::Untrusted));
    }
    for (what, f, want) in &cases {
        let before = f.state();
        let h = with_key(&genuine, &f.name);
        assert_eq!(status(import(&h, ImportRequest::default())), *want, "import of {what}");
        let ro = ImportRequest { read_only: true, ..Default::default() };
        assert_eq!(status(import(&h, ro)), *want, "read-only import of {what}");
        assert_eq!(status(discard_handle(&h)), *want, "discard of {what}");
        assert!(f.state() == before, "{what} was changed");
    }
    drop(cases);

    // The refusals claimed nothing: the genuine handle still takes its in-flight reference over.
    let name = genuine.key_bytes().to_vec();
    assert_eq!(header_count(&name), Some(2), "exporter + in flight");
    let imp = import(&genuine, ImportRequest::default()).unwrap();
    assert_eq!(header_count(&name), Some(2), "mapped and took the in-flight count over");
    imp.release();
    assert_eq!(exp.outstanding().unwrap(), 0);
    drop(exp);
    assert_eq!(header_count(&name), None);
}

/// Item 1, ref-counters: a name outside the families, group/other bits, a size other than
/// PyTorch's 80064 bytes, another owner, or a devshare name without devshare's header is
/// refused through import, handle discard and tuple discard; neither it nor the handle's data
/// object is touched.
#[test]
fn ref_counters_outside_the_families_or_not_ours_are_refused_and_left_untouched() {
    let _g = lock();
    let exp = Exporter::host_alloc(4096).unwrap();
    let genuine = exp.share(&desc(false)).unwrap();
    let data = genuine.key_bytes().to_vec();
    let p = pid();

    for name in [format!("/.hidden_rc_{p}"), format!("/trust_{p}_nothing"), format!("/devshare_{p}_{}", hex32())] {
        let h = with_ref(&genuine, name.as_bytes(), 0);
        assert_eq!(status(import(&h, ImportRequest::default())), Status::Untrusted, "{name}");
        assert_eq!(status(discard_handle(&h)), Status::Untrusted, "{name}");
        assert_eq!(status(discard(name.as_bytes(), 0)), Status::Untrusted, "{name}");
    }

    let mut cases = vec![
        ("an existing object outside the families", Foreign::rc(&format!("/trust_{p}_rc"), 0o600, RC_SIZE)),
        ("a devshare name, mode 0644", Foreign::rc(&format!("/devshare_rc_{p}_{}", hex32()), 0o644, RC_SIZE)),
        ("a devshare name, 4096 bytes", Foreign::rc(&format!("/devshare_rc_{p}_{}", hex32()), 0o600, 4096)),
        ("a devshare name, one slot short", Foreign::rc(&format!("/devshare_rc_{p}_{}", hex32()), 0o600, RC_SIZE - 8)),
        (
            "a devshare name without devshare's header",
            Foreign::rc(&format!("/devshare_rc_{p}_{}", hex32()), 0o600, RC_SIZE),
        ),
        ("a PyTorch name, 80000 bytes", Foreign::rc(&format!("/torch_{p}_5_1"), 0o600, 80000)),
        ("a PyTorch name, mode 0660", Foreign::rc(&format!("/torch_{p}_5_2"), 0o660, RC_SIZE)),
    ];
    if is_root() {
        let f = Foreign::rc(&format!("/torch_{p}_5_3"), 0o600, RC_SIZE);
        f.chown(65534);
        cases.push(("a PyTorch name owned by another user", f));
    }
    for (what, f) in &cases {
        let before = f.state();
        let h = with_ref(&genuine, &f.name, 0);
        assert_eq!(status(import(&h, ImportRequest::default())), Status::Untrusted, "import with {what}");
        assert_eq!(status(discard_handle(&h)), Status::Untrusted, "discard with {what}");
        assert_eq!(status(discard(&f.name, 0)), Status::Untrusted, "tuple discard with {what}");
        assert!(f.state() == before, "{what} was changed");
        assert_eq!(header_count(&data), Some(1), "the data object was not counted ({what})");
    }
    drop(cases);

    // A checked PyTorch-family ref-counter is used as before.
    let torch = Foreign::rc(&format!("/torch_{p}_5_9"), 0o600, RC_SIZE);
    let imp = import(&with_ref(&genuine, &torch.name, 0), ImportRequest::default()).unwrap();
    imp.release();
    assert_eq!(i64::from_ne_bytes(torch.state().0[64..72].try_into().unwrap()), 0, "its slot was returned");
    drop(torch);

    assert_eq!(exp.outstanding().unwrap(), 1, "the genuine reference is untouched");
    discard_handle(&genuine).unwrap();
    assert_eq!(exp.outstanding().unwrap(), 0);
}

/// A host export's handle and its import, after the exporter removed its names and closed: the
/// import is the last holder, and the names are free for others to take.
fn import_of_a_closed_export() -> (DevshareHandle, devshare::import::Import) {
    let exp = Exporter::host_alloc(4096).unwrap();
    let h = exp.share(&desc(false)).unwrap();
    let imp = import(&h, ImportRequest::default()).unwrap();
    exp.prepare_close(false, true).unwrap();
    drop(exp);
    (h, imp)
}

/// Item 1, release: the last holder unlinks a name only while it still stands for the object
/// it mapped. Here the exporter removed both names and closed, and other objects took them,
/// before the consumer's release: the release leaves them alone.
#[test]
fn release_never_unlinks_an_object_that_took_a_removed_name() {
    let _g = lock();
    let (h, imp) = import_of_a_closed_export();
    let (data, rc) = (h.key_bytes().to_vec(), h.ref_name_bytes().to_vec());
    assert_eq!(header_count(&data), None);
    assert_eq!(header_count(&rc), None);
    let d = Foreign::data(std::str::from_utf8(&data).unwrap(), 0o600, 4096);
    let r = Foreign::rc(std::str::from_utf8(&rc).unwrap(), 0o600, RC_SIZE);
    let (d0, r0) = (d.state(), r.state());
    imp.release();
    assert!(d.state() == d0, "the new data object was changed or removed");
    assert!(r.state() == r0, "the new ref-counter was changed or removed");
}

/// Item 2: flipping the in-flight flag on a genuine handle (either way) is refused through
/// import and discard, and the producer's object survives for the honest consumer.
#[test]
fn an_inflight_flag_the_producer_did_not_record_is_refused() {
    let _g = lock();
    let exp = Exporter::host_alloc(4096).unwrap();
    let name;
    {
        // Sent without; the flag added on the way.
        let h = exp.share(&desc(false)).unwrap();
        name = h.key_bytes().to_vec();
        let mut forged = h;
        forged.flags |= DEVSHARE_HANDLE_FLAG_INFLIGHT;
        for _ in 0..3 {
            assert_eq!(status(import(&forged, ImportRequest::default())), Status::Untrusted);
            assert_eq!(status(discard_handle(&forged)), Status::Untrusted);
        }
        assert_eq!(header_count(&name), Some(1), "nothing taken over");
        assert_eq!(exp.slot_value(&h), Some(1));
        let honest = import(&h, ImportRequest::default()).unwrap();
        assert_eq!(header_count(&name), Some(2));
        // While the honest import holds it, a flipped copy in this process is refused too.
        assert_eq!(status(import(&forged, ImportRequest::default())), Status::Untrusted);
        honest.release();
        assert_eq!(header_count(&name), Some(1));
    }
    {
        // Sent in flight; the flag removed on the way (the in-flight count would leak).
        let h = exp.share(&desc(true)).unwrap();
        assert_eq!(header_count(&name), Some(2));
        let mut forged = h;
        forged.flags &= !DEVSHARE_HANDLE_FLAG_INFLIGHT;
        assert_eq!(status(import(&forged, ImportRequest::default())), Status::Untrusted);
        assert_eq!(status(discard_handle(&forged)), Status::Untrusted);
        assert_eq!(status(discard(h.ref_name_bytes(), h.ref_slot)), Status::Untrusted);
        // ...and the same with no ref-counter at all: nothing to check the flag against.
        let stripped = with_ref(&h, b"", 0);
        assert_eq!(status(import(&stripped, ImportRequest::default())), Status::Untrusted);
        assert_eq!(header_count(&name), Some(2));
        let honest = import(&h, ImportRequest::default()).unwrap();
        assert_eq!(header_count(&name), Some(2), "mapped and took the in-flight count over");
        honest.release();
    }
    assert_eq!(exp.outstanding().unwrap(), 0);
    assert_eq!(header_count(&name), Some(1));
    drop(exp);
    assert_eq!(header_count(&name), None);
}

/// Item 2: an in-flight handle sent after the exporter closed still opens (the record outlives
/// the exporter while an in-flight share is pending), and its reference is taken over once.
#[test]
fn the_inflight_record_outlives_the_exporter_until_taken_over() {
    let _g = lock();
    let exp = Exporter::host_alloc(4096).unwrap();
    let h = exp.share(&desc(true)).unwrap();
    let (data, rc) = (h.key_bytes().to_vec(), h.ref_name_bytes().to_vec());
    drop(exp);
    assert_eq!(header_count(&data), Some(1), "the in-flight count keeps the data object");
    assert_eq!(header_count(&rc), Some(1), "the in-flight count keeps the record");
    let imp = import(&h, ImportRequest::default()).unwrap();
    assert_eq!(header_count(&rc), None, "taken over: the last count of the ref-counter went");
    imp.release();
    assert_eq!(header_count(&data), None);
}

/// Item 4: slots holding {INT64_MAX, INT64_MAX, 2} used to sum to 0 (wait returned at once);
/// they are corruption, reported naming the slot.
#[test]
fn corrupt_ref_counter_slots_are_reported_not_summed() {
    let _g = lock();
    let exp = Exporter::host_alloc(4096).unwrap();
    let hs: Vec<_> = (0..3).map(|_| exp.share(&desc(false)).unwrap()).collect();
    let rc = hs[0].ref_name_bytes().to_vec();
    assert_eq!(exp.outstanding().unwrap(), 3);
    let write = |slot: u64, v: i64| {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(path(&rc)).unwrap();
        f.write_all_at(&v.to_ne_bytes(), 64 + 8 * slot).unwrap();
    };
    for (h, v) in hs.iter().zip([i64::MAX, i64::MAX, 2]) {
        write(h.ref_slot, v);
    }
    let err = exp.outstanding().unwrap_err();
    assert_eq!(err.status(), Status::Untrusted, "{err}");
    assert!(err.to_string().contains(&format!("slot {}", hs[0].ref_slot)), "{err}");
    let err = exp.wait(Some(Duration::ZERO)).unwrap_err();
    assert_eq!(err.status(), Status::Untrusted, "wait(0) must not succeed: {err}");
    assert_eq!(exp.wait(Some(Duration::from_millis(5))).unwrap_err().status(), Status::Untrusted);
    // Negative values are corruption too; a consumer refuses a corrupt slot of devshare's.
    write(hs[0].ref_slot, -1);
    write(hs[1].ref_slot, 1);
    write(hs[2].ref_slot, 1);
    assert_eq!(exp.outstanding().unwrap_err().status(), Status::Untrusted);
    write(hs[0].ref_slot, 1);
    write(hs[1].ref_slot, 2);
    assert_eq!(status(import(&hs[1], ImportRequest::default())), Status::Untrusted);
    write(hs[1].ref_slot, 1);
    assert_eq!(exp.outstanding().unwrap(), 3);
    for h in &hs {
        discard_handle(h).unwrap();
    }
    exp.wait(Some(Duration::ZERO)).unwrap();
}

fn own_names() -> Vec<String> {
    let prefixes = [format!("devshare_{}_", pid()), format!("devshare_rc_{}_", pid())];
    let mut v: Vec<String> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| prefixes.iter().any(|p| n.starts_with(p.as_str())))
        .collect();
    v.sort();
    v
}

/// Item 9: an allocation larger than /dev/shm's free space is refused (DEVSHARE_STATUS_OS,
/// errno ENOSPC) before anything is created.
#[test]
fn an_allocation_dev_shm_cannot_hold_is_refused_and_leaves_nothing() {
    let _g = lock();
    // SAFETY: a zeroed statvfs is a valid out-parameter; the path is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::statvfs(c"/dev/shm".as_ptr(), &mut st) }, 0);
    let free = st.f_bavail as u64 * st.f_frsize as u64;
    let before = own_names();
    for size in [free + (1 << 30), free.saturating_mul(4), 1 << 50] {
        let err = Exporter::host_alloc(size).err().expect("refused");
        assert_eq!(err.status(), Status::Os, "{err}");
        assert_eq!(err.vendor_code(), i64::from(libc::ENOSPC), "{err}");
        assert!(err.to_string().contains("/dev/shm"), "{err}");
        assert_eq!(own_names(), before, "something was created for {size} bytes");
    }
    // What fits is still allocated.
    let ok = Exporter::host_alloc(1 << 20).unwrap();
    drop(ok);
    assert_eq!(own_names(), before);
}

/// Run `f` on a thread and give its result, or `None` when it has not returned within `secs`
/// (the thread is then left blocked: the caller unblocks it before failing).
fn within<R: Send + 'static>(secs: u64, f: impl FnOnce() -> R + Send + 'static) -> Option<R> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs)).ok()
}

/// A FIFO under a shm name, made by the test (the hostile producer's object); removed by its
/// exact name on drop.
struct Fifo {
    name: Vec<u8>,
}

impl Fifo {
    fn new(name: &[u8]) -> Fifo {
        let c = CString::new(path(name).into_os_string().into_encoded_bytes()).unwrap();
        // SAFETY: c is NUL-terminated.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo: {}", std::io::Error::last_os_error());
        Fifo { name: name.to_vec() }
    }

    /// Let a reader blocked in open(2) go (a writer's non-blocking open succeeds once one waits).
    fn unblock(&self) {
        let c = CString::new(path(&self.name).into_os_string().into_encoded_bytes()).unwrap();
        // SAFETY: c is NUL-terminated; the descriptor, if any, is closed at once.
        unsafe {
            let fd = libc::open(c.as_ptr(), libc::O_WRONLY | libc::O_NONBLOCK | libc::O_CLOEXEC);
            if fd >= 0 {
                libc::close(fd);
            }
        }
    }
}

impl Drop for Fifo {
    fn drop(&mut self) {
        self.unblock();
        let _ = std::fs::remove_file(path(&self.name));
    }
}

/// The CUDA stand-in driver, loaded once for this process (before devshare first looks for a
/// CUDA runtime, under the tests' lock).
fn cuda() {
    static LIB: std::sync::OnceLock<libloading::Library> = std::sync::OnceLock::new();
    LIB.get_or_init(|| common::load(common::StandIn::Cuda, "trust"));
}

/// A PyTorch CUDA version-2 'e' storage handle: one record per segment (an fd number).
fn cuda_e(pid: u32, segment_size: u64, fds: &[i32]) -> Vec<u8> {
    let mut v = vec![2u8, b'e'];
    v.extend_from_slice(&(pid as i32).to_ne_bytes());
    v.extend_from_slice(&[0; 4]);
    v.extend_from_slice(&segment_size.to_ne_bytes());
    v.extend_from_slice(&(fds.len() as u64).to_ne_bytes());
    for fd in fds {
        v.extend_from_slice(&fd.to_ne_bytes());
    }
    v
}

/// The tuple fields of a CUDA storage: 1024 bytes at the start of the storage handle's memory,
/// made in this process, whose reference is slot `ref_slot` of `ref_name`.
fn cuda_args<'a>(handle: &'a [u8], ref_name: &'a [u8], ref_slot: u64) -> devshare::torch::TorchArgs<'a> {
    devshare::torch::TorchArgs {
        backend: devshare::handle::DEVSHARE_BACKEND_CUDA,
        dtype: DevshareDType::new(1, 8, 1),
        shape: &[1024],
        strides: None,
        tensor_offset: 0,
        device: 0,
        producer_pid: pid() as i32,
        handle,
        storage_size: 1024,
        storage_offset: 0,
        ref_name,
        ref_slot,
        event_handle: &[],
        event_sync_required: false,
    }
}

const SEGMENT: u64 = 2 << 20;

/// An anonymous memfd of `size` bytes: what an expandable segment's fd is in the stand-in.
fn memfd(size: u64) -> OwnedFd {
    let fd = rustix::fs::memfd_create("trust-segment", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, size).unwrap();
    fd
}

/// A hostile producer replaces a ref-counter's name by a FIFO (whose open(2) waits for a
/// writer): an import of an event handle naming it (it checks the reference before waiting on
/// the event) must fail at once, naming the object, not hang.
#[test]
fn a_fifo_under_a_handle_s_ref_counter_name_fails_the_import_at_once() {
    let _g = lock();
    cuda();
    let fifo = Fifo::new(format!("/torch_{}_91_1", pid()).as_bytes());
    let raw = [7u8; 64];
    let event = [3u8; 64];
    let mut a = cuda_args(&raw, &fifo.name, 0);
    a.event_handle = &event;
    a.event_sync_required = true;
    let h = devshare::torch::handle_from_torch(&a).unwrap();
    let got = within(5, move || match import(&h, ImportRequest::default()) {
        Ok(i) => {
            i.release();
            (Status::Ok, String::new())
        }
        Err(e) => (e.status(), e.to_string()),
    });
    fifo.unblock();
    let (s, m) = got.expect("the import of a handle whose ref-counter is a FIFO hung");
    assert_eq!(s, Status::Untrusted, "{m}");
    assert!(m.contains("not a regular file") && m.contains(&String::from_utf8_lossy(&fifo.name).into_owned()), "{m}");
}

/// A hostile producer removes its names and puts FIFOs under them before its consumer's
/// release: the release (which, as the last holder, checks whether each name still stands
/// for the object it mapped before unlinking) returns at once and leaves the FIFOs.
#[test]
fn a_fifo_under_a_released_object_s_name_does_not_hang_the_release() {
    let _g = lock();
    let (h, imp) = import_of_a_closed_export();
    let data = Fifo::new(h.key_bytes());
    let rc = Fifo::new(h.ref_name_bytes());
    let done = within(5, move || imp.release());
    data.unblock();
    rc.unblock();
    assert!(done.is_some(), "the release hung on a FIFO put under a name it had mapped");
    assert!(path(&data.name).exists() && path(&rc.name).exists(), "the FIFOs were left alone");
}

/// Adopt an 'e' tuple whose one segment is fd `fd`, with no reference to take over.
fn adopt_segment_fd(fd: i32) -> devshare::Result<Exporter> {
    let bytes = cuda_e(pid(), SEGMENT, &[fd]);
    let d = devshare::torch::handle_from_torch_full(&cuda_args(&bytes, b"", 0))?;
    Exporter::adopt(&d.handle, d.table.as_deref())
}

/// A forged 'e' tuple names open descriptors of this process that are not the memory of an
/// expandable segment: a private file (read and written through the duplicate a channel would
/// pass), a socket, a pipe, a directory, a memfd smaller than a segment. Each is refused,
/// naming the fd and what it is; a memfd as large as a segment (what the CUDA stand-in's
/// segments are) is adopted.
#[test]
fn adoption_refuses_segment_fds_that_are_not_segment_memory() {
    let _g = lock();
    cuda();
    let file_path = std::env::temp_dir().join(format!("devshare_trust_{}_private", pid()));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&file_path)
        .unwrap();
    file.set_len(4 * SEGMENT).unwrap();
    /// Removes the file by its exact path, also when an assertion fails.
    struct Removed(std::path::PathBuf);
    impl Drop for Removed {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _removed = Removed(file_path.clone());
    // A shared memory object is a file of a tmpfs directory (whose seals F_GET_SEALS reads),
    // not a memfd.
    let shm = Foreign::data(&format!("/trust_{}_segment", pid()), 0o600, 4 * SEGMENT as usize);
    let shm_file = std::fs::OpenOptions::new().read(true).write(true).open(path(&shm.name)).unwrap();
    let (sock, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
    let (pipe_r, _pipe_w) = std::io::pipe().unwrap();
    let dir = std::fs::File::open(std::env::temp_dir()).unwrap();
    let null = std::fs::File::open("/dev/null").unwrap();
    let small = memfd(4096);
    let cases: [(&str, i32, &str); 7] = [
        ("a private regular file", file.as_raw_fd(), "memfd"),
        ("a shared memory object", shm_file.as_raw_fd(), "memfd"),
        ("a character device", null.as_raw_fd(), "character device (1:3)"),
        ("a socket", sock.as_raw_fd(), "socket"),
        ("a pipe", pipe_r.as_raw_fd(), "pipe"),
        ("a directory", dir.as_raw_fd(), "directory"),
        ("a memfd smaller than a segment", small.as_raw_fd(), "4096 bytes"),
    ];
    for (what, fd, says) in cases {
        let err = adopt_segment_fd(fd).err().unwrap_or_else(|| panic!("{what} (fd {fd}) was adopted"));
        let m = err.to_string();
        assert_eq!(err.status(), Status::Untrusted, "{what}: {m}");
        assert!(m.contains(&format!("fd {fd}")) && m.contains(says), "{what}: {m}");
    }
    let segment = memfd(SEGMENT);
    let adopted = adopt_segment_fd(segment.as_raw_fd()).unwrap();
    assert_eq!(adopted.outstanding().unwrap(), 0);
    drop(adopted);
}

/// The value of slot `slot` of a ref-counter object this test can read.
fn slot_of(name: &[u8], slot: u64) -> i64 {
    let bytes = std::fs::read(path(name)).unwrap();
    let at = 64 + 8 * slot as usize;
    i64::from_ne_bytes(bytes[at..at + 8].try_into().unwrap())
}

/// A forged tuple names another exporter's reference: the slot of a live devshare exporter's
/// share that its consumer holds, or a slot of another process's PyTorch ref-counter. Adopting
/// it is refused, naming the ref-counter, so no close can return (decrement) a reference the
/// adoption never held: the victim's consumer still imports and releases its share, and the
/// victim's count is right throughout. A PyTorch-style reference of this process's own is still
/// adopted and returned once; adopting it a second time while the first holds it is refused.
#[test]
fn adoption_returns_only_a_reference_of_its_own() {
    let _g = lock();
    cuda();
    let segment = memfd(SEGMENT);
    let bytes = cuda_e(pid(), SEGMENT, &[segment.as_raw_fd()]);
    let adopt = |name: &[u8], slot: u64| {
        let d = devshare::torch::handle_from_torch_full(&cuda_args(&bytes, name, slot)).unwrap();
        Exporter::adopt(&d.handle, d.table.as_deref())
    };

    // A live devshare exporter (of other memory) whose consumer holds its share's reference.
    let victim = Exporter::host_alloc(4096).unwrap();
    let hv = victim.share(&desc(false)).unwrap();
    match adopt(hv.ref_name_bytes(), hv.ref_slot) {
        Ok(a) => drop(a), // closing it must not have returned the victim's reference
        Err(e) => {
            assert_eq!(e.status(), Status::Untrusted, "{e}");
            assert!(e.to_string().contains(&String::from_utf8_lossy(hv.ref_name_bytes()).into_owned()), "{e}");
        }
    }
    assert_eq!(victim.outstanding().unwrap(), 1, "the victim's reference is still out");
    let imp = import(&hv, ImportRequest::default()).expect("the victim's consumer imports its share");
    // ...and while that consumer holds it in this process, adopting it is refused as well.
    assert!(adopt(hv.ref_name_bytes(), hv.ref_slot).is_err());
    imp.release();
    assert_eq!(victim.outstanding().unwrap(), 0, "the victim's consumer returned its reference, once");

    // Another process's PyTorch ref-counter: an adopted tuple is a share of this process's.
    let theirs = Foreign::rc(&format!("/torch_{}_{}_93", pid() + 1, pid()), 0o600, RC_SIZE);
    match adopt(&theirs.name, 0) {
        Ok(a) => drop(a),
        Err(e) => assert_eq!(e.status(), Status::Untrusted, "{e}"),
    }
    assert_eq!(slot_of(&theirs.name, 0), 1, "another process's reference was not returned");

    // This process's own PyTorch-style reference: adopted once, returned once on close.
    let ours = Foreign::rc(&format!("/torch_{}_94_1", pid()), 0o600, RC_SIZE);
    let a = adopt(&ours.name, 0).unwrap();
    let again = adopt(&ours.name, 0).err().expect("a reference an adoption holds is adopted again");
    assert_eq!(again.status(), Status::Busy, "{again}");
    assert_eq!(slot_of(&ours.name, 0), 1);
    drop(a);
    assert_eq!(slot_of(&ours.name, 0), 0, "the adoption returned its reference on close");

    // A reference an import in this process holds (its release returns it) is not adopted.
    let held = Foreign::rc(&format!("/torch_{}_94_2", pid()), 0o600, RC_SIZE);
    let host = Exporter::host_alloc(4096).unwrap();
    let genuine = host.share(&desc(false)).unwrap();
    let imp = import(&with_ref(&genuine, &held.name, 0), ImportRequest::default()).unwrap();
    let busy = adopt(&held.name, 0).err().expect("a reference an import holds was adopted");
    assert_eq!(busy.status(), Status::Busy, "{busy}");
    imp.release();
    assert_eq!(slot_of(&held.name, 0), 0, "the import returned it, once");
    discard_handle(&genuine).unwrap();
}
