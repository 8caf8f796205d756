//! A FUSE file system whose server never answers some requests: what a hostile peer can run (any
//! user may mount one through `fusermount`; these tests mount it directly, which needs
//! `CAP_SYS_ADMIN` and `/dev/fuse`). It holds a file, `f`, that opens normally, and `c`, a device
//! node (1:3, what `/dev/null` is; the mount is not `nodev`, so it opens the real device, whose
//! inode is still the server's). Their `GETATTR` and `FLUSH` requests are never answered, so
//! `fstat` of a descriptor of either, and the close of `f`'s, wait until the server dies. The server runs in a
//! child process (the test binary's role that calls [`serve`]), so that what waits on it never
//! holds up its answers; it dies with the test process.

use std::io::BufRead;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::PathBuf;

/// The environment variable that hands the role its mount point.
const DIR_VAR: &str = "DEVSHARE_TEST_FUSE_DIR";

/// A mounted stalling file system (unmounted, and its server killed, when dropped).
pub struct Stalling {
    child: std::process::Child,
    dir: PathBuf,
    /// Descriptors of `f` opened here: closed only after the server is gone (their close would
    /// wait for a `FLUSH` answer until then).
    opened: std::sync::Mutex<Vec<OwnedFd>>,
}

impl Stalling {
    /// Mount it, its server the test binary's ignored test `role_test` (which calls [`serve`]).
    /// `None` where this machine cannot mount FUSE: the reason is printed.
    pub fn start(role_test: &str) -> Option<Stalling> {
        static MOUNTS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = MOUNTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("devshare-fuse-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut child = super::role(role_test, &[(DIR_VAR, dir.as_os_str())])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("the server's process");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                // (The test harness has printed the role's name on the same line.)
                if let Some(at) = line.find("devshare-fuse: ") {
                    let _ = tx.send(line[at + "devshare-fuse: ".len()..].to_string());
                }
            }
        });
        let said = rx.recv_timeout(std::time::Duration::from_secs(20));
        let s = Stalling { child, dir, opened: std::sync::Mutex::new(Vec::new()) };
        let said = said.expect("the FUSE server said neither ready nor unavailable within 20 s");
        if said == "ready" {
            return Some(s);
        }
        // Skipped where this process may not mount FUSE (no /dev/fuse, no permission: the
        // server says "unavailable"), unless DEVSHARE_REQUIRE_FUSE=1; any other failure (the
        // mount refusing its options) fails the test.
        let required = std::env::var_os("DEVSHARE_REQUIRE_FUSE").is_some_and(|v| v == "1");
        if required || !said.starts_with("unavailable") {
            panic!("the FUSE file system could not be mounted here: {said}");
        }
        eprintln!("SKIPPED: this machine cannot mount a FUSE file system ({said})");
        None
    }

    /// A descriptor of the file `f` (its `LOOKUP` and `OPEN` are answered), closed after the
    /// server is gone.
    pub fn open(&self) -> BorrowedFd<'_> {
        self.open_as("f", libc::O_RDWR)
    }

    /// Close the descriptors opened here now, each on a thread of its own (which waits for the
    /// server until it dies): they leave this process's table at once.
    pub fn let_go(&self) {
        for fd in std::mem::take(&mut *self.opened.lock().unwrap()) {
            std::thread::spawn(move || drop(fd));
        }
    }

    /// Wait (at most 10 s) until no descriptor of this file system is left in this process's
    /// table (their links in /proc name the mount point; reading them asks no server): a
    /// close on another thread takes its descriptor out of the table only once it begins.
    pub fn none_open(&self) -> bool {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let open = std::fs::read_dir("/proc/self/fd")
                .unwrap()
                .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .any(|l| l.starts_with(&self.dir));
            if !open {
                return true;
            }
            if std::time::Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// A descriptor of the device node `c`: opened (`O_PATH` false), or only named (`O_PATH`,
    /// which even a `nodev` mount allows). Closed after the server is gone.
    pub fn open_device(&self, o_path: bool) -> BorrowedFd<'_> {
        self.open_as("c", if o_path { libc::O_PATH } else { libc::O_RDWR })
    }

    /// `name` opened with `flags` (on a thread of its own: should the server not answer, the
    /// test fails after 10 s instead of waiting with it).
    fn open_as(&self, name: &str, flags: libc::c_int) -> BorrowedFd<'_> {
        let path = std::ffi::CString::new(self.dir.join(name).into_os_string().into_encoded_bytes()).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            // SAFETY: a NUL-terminated path; the descriptor is owned by the receiver.
            let fd = unsafe { libc::open(path.as_ptr(), flags | libc::O_CLOEXEC) };
            let _ = tx.send((fd, std::io::Error::last_os_error()));
        });
        let (fd, err) = rx.recv_timeout(std::time::Duration::from_secs(10)).expect("the FUSE server answered the open");
        assert!(fd >= 0, "open of the FUSE node {name}: {err}");
        // SAFETY: a descriptor just opened, owned by nothing else.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        self.opened.lock().unwrap().push(owned);
        // SAFETY: the descriptor lives in `opened` until `self` is dropped, after every borrow.
        unsafe { BorrowedFd::borrow_raw(fd) }
    }
}

impl Drop for Stalling {
    fn drop(&mut self) {
        // The server first: its death aborts the connection, and every request still waiting
        // for it (a `FLUSH`, a `GETATTR`) fails at once; only then the descriptors here close.
        let _ = self.child.kill();
        let _ = self.child.wait();
        drop(std::mem::take(&mut *self.opened.lock().unwrap_or_else(|p| p.into_inner())));
        let dir = std::ffi::CString::new(self.dir.clone().into_os_string().into_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        unsafe { libc::umount2(dir.as_ptr(), libc::MNT_DETACH) };
        let _ = std::fs::remove_dir(&self.dir);
    }
}

// FUSE opcodes (linux/fuse.h).
const LOOKUP: u32 = 1;
const FORGET: u32 = 2;
const GETATTR: u32 = 3;
const OPEN: u32 = 14;
const RELEASE: u32 = 18;
const FLUSH: u32 = 25;
const INIT: u32 = 26;
const INTERRUPT: u32 = 36;
const BATCH_FORGET: u32 = 42;

/// The server: mounts at `$DEVSHARE_TEST_FUSE_DIR`, says `devshare-fuse: ready` (or
/// `devshare-fuse: unavailable: why` where it may not, `broken: why` for any other failure) on
/// stdout, and serves until it is killed or unmounted.
pub fn serve() {
    let Some(dir) = std::env::var_os(DIR_VAR) else { return }; // run by hand: nothing to do
                                                               // SAFETY: prctl(PR_SET_PDEATHSIG) takes a signal number. The server dies with the test
                                                               // process, so a killed test leaves no server behind (its mount goes with it).
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    let say = |what: &str| {
        use std::io::Write;
        println!("devshare-fuse: {what}");
        let _ = std::io::stdout().flush();
    };
    // SAFETY: a NUL-terminated path.
    let dev = unsafe { libc::open(c"/dev/fuse".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    // What says "this process may not mount FUSE here" rather than "the mount is wrong".
    let unavailable = |e: &std::io::Error| {
        matches!(e.raw_os_error(), Some(libc::EPERM | libc::EACCES | libc::ENODEV | libc::ENOENT | libc::ENXIO))
    };
    if dev < 0 {
        let e = std::io::Error::last_os_error();
        return say(&format!("{}: /dev/fuse: {e}", if unavailable(&e) { "unavailable" } else { "broken" }));
    }
    // SAFETY: a descriptor just opened, owned by nothing else.
    let dev = unsafe { OwnedFd::from_raw_fd(dev) };
    // SAFETY: geteuid and getegid have no preconditions.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    let opts = std::ffi::CString::new(format!(
        "fd={},rootmode=40000,user_id={uid},group_id={gid}",
        std::os::fd::AsRawFd::as_raw_fd(&dev)
    ))
    .unwrap();
    let target = std::ffi::CString::new(std::path::PathBuf::from(dir).into_os_string().into_encoded_bytes()).unwrap();
    // SAFETY: NUL-terminated strings; the options name an open /dev/fuse descriptor.
    let rc = unsafe {
        libc::mount(
            c"devshare-test".as_ptr(),
            target.as_ptr(),
            c"fuse".as_ptr(),
            libc::MS_NOSUID | libc::MS_NOEXEC, // not `nodev`: `c` opens as a device
            opts.as_ptr().cast(),
        )
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return say(&format!("{}: mount: {e}", if unavailable(&e) { "unavailable" } else { "broken" }));
    }
    say("ready");
    let mut buf = vec![0u8; (1 << 20) + 4096];
    loop {
        // SAFETY: a buffer of its length.
        let n = unsafe { libc::read(std::os::fd::AsRawFd::as_raw_fd(&dev), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return; // unmounted
        }
        let req = &buf[..n as usize];
        if req.len() < 40 {
            continue;
        }
        let u32_at = |at: usize| u32::from_le_bytes(req[at..at + 4].try_into().unwrap());
        let u64_at = |at: usize| u64::from_le_bytes(req[at..at + 8].try_into().unwrap());
        let (opcode, unique, node) = (u32_at(4), u64_at(8), u64_at(16));
        let file = |ino: u64| attr(ino, 0o100_600, 1, 4096, 0, uid, gid);
        match opcode {
            INIT => {
                // major, minor, max_readahead, flags, max_background + congestion_threshold,
                // max_write, time_gran; the rest of the 64 bytes zero.
                let mut out = le32(&[7, 31, 0, 0, 0, 4096, 0]);
                out.resize(64, 0);
                reply(dev.as_fd(), unique, 0, &out);
            }
            LOOKUP => {
                // `c` is node 3, the character device 1:3; anything else is `f`, node 2.
                // Generation, entry and attribute validity 0 (always asked again).
                let device = req.get(40..42) == Some(&b"c\0"[..]);
                let ino = if device { 3 } else { 2 };
                let mut out = le64(&[ino, 0, 0, 0]);
                out.extend_from_slice(&[0; 8]);
                out.extend_from_slice(&if device { attr(3, 0o20_666, 1, 0, (1 << 8) | 3, uid, gid) } else { file(2) });
                reply(dev.as_fd(), unique, 0, &out);
            }
            GETATTR if node == 1 => {
                let mut out = vec![0u8; 16];
                out.extend_from_slice(&attr(1, 0o40_755, 2, 0, 0, uid, gid));
                reply(dev.as_fd(), unique, 0, &out);
            }
            GETATTR | FLUSH => {} // never answered
            OPEN => reply(dev.as_fd(), unique, 0, &le64(&[1, 0])),
            RELEASE => reply(dev.as_fd(), unique, 0, &[]),
            FORGET | BATCH_FORGET | INTERRUPT => {} // no answer is expected
            _ => reply(dev.as_fd(), unique, -libc::ENOSYS, &[]),
        }
    }
}

/// `struct fuse_attr` (88 bytes); `rdev` in the kernel's old 16-bit form (major << 8 | minor).
fn attr(ino: u64, mode: u32, nlink: u32, size: u64, rdev: u32, uid: u32, gid: u32) -> Vec<u8> {
    let mut a = le64(&[ino, size, 0, 0, 0, 0]);
    a.extend(le32(&[0, 0, 0, mode, nlink, uid, gid, rdev, 4096, 0]));
    a
}

fn le32(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn le64(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn reply(dev: BorrowedFd<'_>, unique: u64, error: i32, payload: &[u8]) {
    let mut out = Vec::with_capacity(16 + payload.len());
    out.extend_from_slice(&((16 + payload.len()) as u32).to_le_bytes());
    out.extend_from_slice(&error.to_le_bytes());
    out.extend_from_slice(&unique.to_le_bytes());
    out.extend_from_slice(payload);
    // SAFETY: a buffer of its length. (A refused answer only leaves its request waiting.)
    unsafe { libc::write(std::os::fd::AsRawFd::as_raw_fd(&dev), out.as_ptr().cast(), out.len()) };
}
