//! Channels, leases and pools, in one process (threads on both ends) and against hand-made
//! peers that speak the wire protocol wrongly on purpose: a hostile producer must never make a
//! consumer map memory it should not, or outside what was exported; a hostile consumer must
//! never corrupt the producer's slots or leases. (Cross-process and crash cases are in
//! tests/c/test_channel.c and tests/c/channel_crash.c.)

mod common;

use devshare::channel::{Channel, Connection};
use devshare::export::{Exporter, TensorDesc};
use devshare::handle::DEVSHARE_HANDLE_FLAG_CHANNEL;
use devshare::{Error, Status};
use rustix::net::{AddressFamily, SocketFlags, SocketType};
use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const T: Option<Duration> = Some(Duration::from_secs(10));

fn address(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!("@devshare-test-{}-{tag}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

fn status<T>(r: Result<T, Error>) -> Status {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.status(),
    }
}

/// A producer serving in the background of the test (the library itself runs no threads).
fn serve(ch: Arc<Channel>, stop: Arc<std::sync::atomic::AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            let _ = ch.service(Some(Duration::from_millis(5)));
        }
    })
}

#[test]
fn pool_slots_keep_one_address_per_slot_and_carry_the_data() {
    let addr = address("pool");
    let ch = Channel::listen(&addr).unwrap();
    let consumer = std::thread::spawn({
        let addr = addr.clone();
        move || {
            let c = Connection::connect(&addr, T).unwrap();
            let mut seen: Vec<usize> = vec![0; 4];
            for i in 0..2000u32 {
                let imp = c.recv(T).unwrap();
                let (_, slot) = imp.pool_slot().expect("a pool item");
                let v = imp.view();
                let a = v.data as usize;
                if seen[slot as usize] == 0 {
                    seen[slot as usize] = a;
                }
                assert_eq!(seen[slot as usize], a, "slot {slot} moved at item {i}");
                // SAFETY: the item is 4096 bytes of u32 (checked by the producer's send).
                let first = unsafe { *(v.data as *const u32) };
                assert_eq!(first, i);
                assert_eq!(imp.handle().shape[0], 1024);
                imp.release();
            }
            seen
        }
    });
    ch.wait_peers(1, T).unwrap();
    let peer = ch.peer_ids().unwrap()[0];
    let exp = Arc::new(Exporter::channel_host_alloc(4 * 4096).unwrap());
    let pool = ch.pool(exp.clone(), 4096, 4).unwrap();
    let dtype = devshare::dtype::DevshareDType::new(devshare::dtype::code::UINT, 32, 1);
    for i in 0..2000u32 {
        let (slot, p) = pool.acquire(T).unwrap();
        // SAFETY: the slot is 4096 writable bytes.
        unsafe { *(p as *mut u32) = i };
        pool.send(slot, peer, &TensorDesc { dtype, shape: &[1024], ..Default::default() }).unwrap();
    }
    let seen = consumer.join().unwrap();
    assert!(seen.iter().all(|&a| a != 0), "every slot was used");
    // The consumer's thread ended but its connection object dropped with it: everything is back.
    let deadline = Instant::now() + Duration::from_secs(10);
    while pool.info().unwrap().2 != 4 && Instant::now() < deadline {
        ch.service(Some(Duration::from_millis(10))).unwrap();
    }
    assert_eq!(pool.info().unwrap(), (4096, 4, 4));
    exp.wait(T).unwrap();
}

#[test]
fn a_leased_send_counts_until_the_import_is_released_and_wait_serves_the_channel() {
    let addr = address("lease");
    let ch = Channel::listen(&addr).unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let consumer = std::thread::spawn({
        let addr = addr.clone();
        move || {
            let c = Connection::connect(&addr, T).unwrap();
            let imp = c.recv(T).unwrap();
            assert_ne!(imp.handle().flags & DEVSHARE_HANDLE_FLAG_CHANNEL, 0);
            assert!(imp.pool_slot().is_none());
            // SAFETY: 64 readable bytes.
            assert_eq!(unsafe { *imp.view().data }, 7);
            rx.recv().unwrap(); // held until the producer counted it
            imp.release();
            c
        }
    });
    ch.wait_peers(1, T).unwrap();
    let peer = ch.peer_ids().unwrap()[0];
    let exp = Exporter::channel_host_alloc(64).unwrap();
    // SAFETY: 64 writable bytes.
    unsafe { *exp.ptr() = 7 };
    ch.send(peer, &exp, &TensorDesc { shape: &[64], ..Default::default() }).unwrap();
    assert_eq!(exp.outstanding().unwrap(), 1);
    assert_eq!(ch.peer_info(peer).unwrap().leases, 1);
    assert_eq!(status(exp.wait(Some(Duration::from_millis(50)))), Status::Timeout);
    tx.send(()).unwrap();
    exp.wait(T).unwrap(); // nobody else serves the channel: wait does
    assert_eq!(exp.outstanding().unwrap(), 0);
    drop(consumer.join().unwrap());
}

#[test]
fn a_closed_connection_gives_its_leases_and_slots_back_at_once() {
    let addr = address("hangup");
    let ch = Channel::listen(&addr).unwrap();
    let c = std::thread::spawn({
        let addr = addr.clone();
        move || Connection::connect(&addr, T).unwrap()
    });
    ch.wait_peers(1, T).unwrap();
    let c = c.join().unwrap();
    let peer = ch.peer_ids().unwrap()[0];
    let exp = Arc::new(Exporter::channel_host_alloc(8192).unwrap());
    ch.send(peer, &exp, &TensorDesc { shape: &[16], ..Default::default() }).unwrap();
    let pool = ch.pool(exp.clone(), 4096, 2).unwrap();
    for _ in 0..2 {
        let (s, _) = pool.acquire(T).unwrap();
        pool.send(s, peer, &TensorDesc { shape: &[4096], ..Default::default() }).unwrap();
    }
    let held: Vec<_> = (0..3).map(|_| c.recv(T).unwrap()).collect();
    assert_eq!(exp.outstanding().unwrap(), 2, "one lease and one pool attachment");
    let info = ch.peer_info(peer).unwrap();
    assert_eq!((info.leases, info.slots), (2, 2), "peer_info: a lease and the pool; both slots held");
    assert_eq!(status(pool.acquire(Some(Duration::from_millis(20)))), Status::Timeout, "backpressure");
    let t0 = Instant::now();
    drop(c); // closes the connection while the imports are still held
    exp.wait(T).unwrap();
    let (s, _) = pool.acquire(T).unwrap();
    eprintln!("leases and slots back {:?} after the close", t0.elapsed());
    pool.release(s).unwrap();
    assert_eq!(pool.info().unwrap().2, 2);
    // The consumer's mappings stay valid; releasing sends nothing.
    for imp in held {
        // SAFETY: mapped until released.
        let _ = unsafe { std::ptr::read_volatile(imp.view().data) };
        imp.release();
    }
}

#[test]
fn when_the_producer_closes_consumers_get_closed_and_keep_their_imports() {
    let addr = address("producer-gone");
    let ch = Channel::listen(&addr).unwrap();
    let c = std::thread::spawn({
        let addr = addr.clone();
        move || Connection::connect(&addr, T).unwrap()
    });
    ch.wait_peers(1, T).unwrap();
    let c = c.join().unwrap();
    let exp = Exporter::channel_host_alloc(4096).unwrap();
    // SAFETY: 4096 writable bytes.
    unsafe { std::ptr::write_bytes(exp.ptr(), 0x5a, 4096) };
    ch.send(ch.peer_ids().unwrap()[0], &exp, &TensorDesc { shape: &[4096], ..Default::default() }).unwrap();
    let imp = c.recv(T).unwrap();
    ch.close();
    drop(exp);
    assert_eq!(status(c.recv(T)), Status::Closed);
    assert_eq!(status(c.recv(Some(Duration::ZERO))), Status::Closed, "and stays closed");
    // SAFETY: the import maps 4096 bytes until released.
    let bytes = unsafe { std::slice::from_raw_parts(imp.view().data, 4096) };
    assert!(bytes.iter().all(|&b| b == 0x5a));
    imp.release();
}

#[test]
fn channel_memory_is_a_sealed_memfd_with_no_name_that_nobody_can_shrink() {
    let before = shm_names();
    let exp = Exporter::channel_host_alloc(1 << 20).unwrap();
    assert_eq!(shm_names(), before, "nothing appears in /dev/shm");
    let fd = memfd_of(exp.ptr()).expect("the export's memfd is open in this process");
    assert_eq!(rustix::fs::ftruncate(&fd, 0), Err(rustix::io::Errno::PERM), "F_SEAL_SHRINK");
    assert_eq!(rustix::fs::ftruncate(&fd, 2 << 20), Err(rustix::io::Errno::PERM), "F_SEAL_GROW");
    let seals = rustix::fs::fcntl_get_seals(&fd).unwrap();
    assert!(seals.contains(rustix::fs::SealFlags::SHRINK | rustix::fs::SealFlags::SEAL));
    // Its handles cannot be made or imported outside a channel.
    assert_eq!(status(exp.share_bytes()), Status::Unsupported);
    let mut h = devshare::handle::DevshareHandle {
        backend: devshare::handle::DEVSHARE_BACKEND_HOST,
        flags: DEVSHARE_HANDLE_FLAG_CHANNEL,
        alloc_size: 4096,
        storage_size: 4096,
        ndim: 1,
        dtype: devshare::dtype::DevshareDType::new(devshare::dtype::code::UINT, 8, 1),
        ..Default::default()
    };
    h.shape[0] = 4096;
    h.strides[0] = 1;
    assert_eq!(status(devshare::import::import(&h, Default::default())), Status::Unsupported);
}

fn shm_names() -> Vec<String> {
    let me = format!("_{}_", std::process::id());
    let mut v: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.retain(|n| n.contains(&me));
    v.sort();
    v
}

/// The memfd in /proc/self/fd whose mapping contains `p` (found through /proc/self/maps' inode).
fn memfd_of(p: *mut u8) -> Option<OwnedFd> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let ino = maps.lines().find_map(|l| {
        let mut f = l.split_whitespace();
        let range = f.next()?;
        let (a, b) = range.split_once('-')?;
        let (a, b) = (usize::from_str_radix(a, 16).ok()?, usize::from_str_radix(b, 16).ok()?);
        ((a..b).contains(&(p as usize))).then(|| f.nth(3).and_then(|i| i.parse::<u64>().ok()))?
    })?;
    for e in std::fs::read_dir("/proc/self/fd").ok()?.flatten() {
        let path = e.path();
        if let Ok(f) = std::fs::OpenOptions::new().read(true).write(true).open(&path) {
            if rustix::fs::fstat(&f).is_ok_and(|st| st.st_ino == ino)
                && std::fs::read_link(&path).is_ok_and(|l| l.to_string_lossy().starts_with("/memfd:"))
            {
                return Some(f.into());
            }
        }
    }
    None
}

#[test]
fn uids_and_pids_not_admitted_are_refused_with_the_reason() {
    let addr = address("restrict");
    let ch = Arc::new(Channel::listen(&addr).unwrap());
    ch.restrict(&[], &[1]).unwrap(); // only pid 1
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let server = serve(ch.clone(), stop.clone());
    let Err(err) = Connection::connect(&addr, T) else { panic!("admitted") };
    assert_eq!(err.status(), Status::Untrusted, "{err}");
    assert!(err.to_string().contains("may not connect"), "{err}");
    ch.restrict(&[rustix::process::geteuid().as_raw() + 1], &[std::process::id() as i32]).unwrap();
    let Err(err) = Connection::connect(&addr, T) else { panic!("admitted") };
    assert!(err.to_string().contains("uid"), "{err}");
    ch.restrict(&[rustix::process::geteuid().as_raw()], &[std::process::id() as i32]).unwrap();
    Connection::connect(&addr, T).unwrap();
    assert_eq!(status(ch.restrict(&[], &[0])), Status::InvalidArgument);
    stop.store(true, Ordering::Relaxed);
    server.join().unwrap();
}

#[test]
fn a_path_channel_creates_a_private_socket_file_and_removes_only_its_own() {
    let dir = std::env::temp_dir().join(format!("devshare-channel-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sock");
    let p = path.to_str().unwrap();
    let ch = Channel::listen(p).unwrap();
    let st = rustix::fs::stat(&path).unwrap();
    assert_eq!(st.st_mode & 0o777, 0o600);
    assert_eq!(status(Channel::listen(p)), Status::Busy, "never replaces an existing file");
    ch.close();
    assert!(!path.exists(), "its own socket file is removed");
    std::fs::write(&path, b"not ours").unwrap();
    assert_eq!(status(Channel::listen(p)), Status::Busy);
    assert_eq!(std::fs::read(&path).unwrap(), b"not ours", "someone else's file stays");
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(status(Channel::listen("")), Status::InvalidArgument);
    assert_eq!(status(Channel::listen(&"x".repeat(200))), Status::InvalidArgument);
    assert_eq!(status(Connection::connect(&address("nobody"), T)), Status::NotFound);
}

#[test]
fn several_consumers_on_threads_share_one_pool() {
    const CONSUMERS: usize = 4;
    const ITEMS: usize = 500;
    let addr = address("threads");
    let ch = Channel::listen(&addr).unwrap();
    let consumers: Vec<_> = (0..CONSUMERS)
        .map(|_| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let c = Connection::connect(&addr, T).unwrap();
                let mut sum = 0u64;
                for _ in 0..ITEMS {
                    let imp = c.recv(T).unwrap();
                    // SAFETY: each item is at least 8 readable bytes.
                    sum += unsafe { *(imp.view().data as *const u64) };
                    // Release on another thread sometimes: imports are released on any thread.
                    if sum % 3 == 0 {
                        std::thread::spawn(move || imp.release()).join().unwrap();
                    } else {
                        imp.release();
                    }
                }
                sum
            })
        })
        .collect();
    ch.wait_peers(CONSUMERS, T).unwrap();
    let peers = ch.peer_ids().unwrap();
    let exp = Arc::new(Exporter::channel_host_alloc(8 * 256).unwrap());
    let pool = Arc::new(ch.pool(exp.clone(), 256, 8).unwrap());
    // Two producer threads send to alternate peers.
    let producers: Vec<_> = (0..2)
        .map(|t| {
            let (pool, peers) = (pool.clone(), peers.clone());
            std::thread::spawn(move || {
                for i in 0..(CONSUMERS * ITEMS / 2) {
                    let (s, p) = pool.acquire(T).unwrap();
                    // SAFETY: 256 writable bytes.
                    unsafe { *(p as *mut u64) = 1 };
                    let peer = peers[(i * 2 + t) % CONSUMERS];
                    pool.send(s, peer, &TensorDesc { shape: &[256], ..Default::default() }).unwrap();
                }
            })
        })
        .collect();
    for p in producers {
        p.join().unwrap();
    }
    let total: u64 = consumers.into_iter().map(|c| c.join().unwrap()).sum();
    assert_eq!(total, (CONSUMERS * ITEMS) as u64);
    exp.wait(T).unwrap();
}

// --- Hand-made peers -------------------------------------------------------------------------

const MAGIC: u32 = u32::from_le_bytes(*b"DSCH");

fn seqpacket() -> OwnedFd {
    rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None).unwrap()
}

fn send_raw(fd: BorrowedFd<'_>, msg: &[u8], fds: &[BorrowedFd<'_>]) {
    assert!(try_send_raw(fd, msg, fds), "the kernel refused descriptors to this socket");
}

/// [`send_raw`]; false when the receiving socket refuses descriptors (`SO_PASSRIGHTS` off, as
/// a producer's sockets are where the kernel has it): nothing was sent.
fn try_send_raw(fd: BorrowedFd<'_>, msg: &[u8], fds: &[BorrowedFd<'_>]) -> bool {
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = rustix::net::SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        assert!(control.push(rustix::net::SendAncillaryMessage::ScmRights(fds)));
    }
    match rustix::net::sendmsg(fd, &[IoSlice::new(msg)], &mut control, rustix::net::SendFlags::NOSIGNAL) {
        Ok(_) => true,
        Err(rustix::io::Errno::PERM) if !fds.is_empty() => false,
        Err(e) => panic!("sendmsg: {e}"),
    }
}

fn recv_raw(fd: BorrowedFd<'_>) -> Vec<u8> {
    let mut buf = vec![0u8; 1 << 17];
    let n = rustix::io::read(fd, &mut buf).unwrap();
    buf.truncate(n);
    buf
}

fn le(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

/// A fake producer: accepts one consumer, answers its handshake, then sends what the test says.
struct FakeProducer {
    conn: OwnedFd,
}

fn fake_producer(tag: &str) -> (String, OwnedFd) {
    let addr = address(tag);
    let l = seqpacket();
    let name = addr.strip_prefix('@').unwrap();
    rustix::net::bind(&l, &rustix::net::SocketAddrUnix::new_abstract_name(name.as_bytes()).unwrap()).unwrap();
    rustix::net::listen(&l, 4).unwrap();
    (addr, l)
}

impl FakeProducer {
    /// Accept one consumer and answer its handshake, the `WELCOME` announcing `features` (what
    /// this producer reads).
    fn accept_with(l: &OwnedFd, features: u16) -> FakeProducer {
        let conn = rustix::net::accept(l).unwrap();
        let hello = recv_raw(conn.as_fd());
        assert_eq!(&hello[..8], &le(&[&1u32.to_le_bytes(), &MAGIC.to_le_bytes()])[..]);
        let welcome = le(&[
            &2u32.to_le_bytes(),
            &MAGIC.to_le_bytes(),
            &1u16.to_le_bytes(),
            &features.to_le_bytes(),
            &9u64.to_le_bytes(),
            &(std::process::id() as i32).to_le_bytes(),
            &0u32.to_le_bytes(),
        ]);
        send_raw(conn.as_fd(), &welcome, &[]);
        FakeProducer { conn }
    }

    fn send(&self, msg: &[u8], fds: &[BorrowedFd<'_>]) {
        send_raw(self.conn.as_fd(), msg, fds);
    }
}

/// A consumer connected to a fake producer whose `WELCOME` announces `features`.
fn fake_connection(tag: &str, features: u16) -> (Connection, FakeProducer) {
    let (addr, l) = fake_producer(tag);
    let server = std::thread::spawn(move || FakeProducer::accept_with(&l, features));
    let c = Connection::connect(&addr, T).unwrap();
    (c, server.join().unwrap())
}

/// The byte encoding of a channel (memfd) handle of `alloc` bytes, viewed as `view` bytes at 0.
fn memfd_handle(alloc: u64, view: u64) -> Vec<u8> {
    let mut h = devshare::handle::DevshareHandle {
        backend: devshare::handle::DEVSHARE_BACKEND_HOST,
        flags: DEVSHARE_HANDLE_FLAG_CHANNEL,
        alloc_size: alloc,
        storage_size: view,
        ndim: 1,
        dtype: devshare::dtype::DevshareDType::new(devshare::dtype::code::UINT, 8, 1),
        ..Default::default()
    };
    h.shape[0] = view as i64;
    h.strides[0] = 1;
    devshare::handle::encode::encode(&h).unwrap()
}

fn share_msg(lease: u64, enc: &[u8]) -> Vec<u8> {
    le(&[&4u32.to_le_bytes(), &0u32.to_le_bytes(), &lease.to_le_bytes(), enc])
}

fn attach_msg(pool: u32, slot_size: u64, count: u32, enc: &[u8]) -> Vec<u8> {
    le(&[&6u32.to_le_bytes(), &pool.to_le_bytes(), &slot_size.to_le_bytes(), &count.to_le_bytes(), &[0; 4], enc])
}

fn item_msg(pool: u32, slot: u32, offset: u64, size: u64) -> Vec<u8> {
    le(&[&7u32.to_le_bytes(), &pool.to_le_bytes(), &slot.to_le_bytes(), &byte_layout(offset, size)])
}

/// An `ITEM`'s (or a `LEASE`'s) fields from `ndim` on: 1-D `uint8` bytes `offset..+size`, no
/// event.
fn byte_layout(offset: u64, size: u64) -> Vec<u8> {
    le(&[
        &1u32.to_le_bytes(),
        &[1, 8, 1, 0],
        &[0; 4],
        &offset.to_le_bytes(),
        &size.to_le_bytes(),
        &0i64.to_le_bytes(),
        &(size as i64).to_le_bytes(),
        &1i64.to_le_bytes(),
    ])
}

fn sealed_memfd(size: u64) -> OwnedFd {
    use rustix::fs::{MemfdFlags, SealFlags};
    let fd = rustix::fs::memfd_create("fake", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&fd, size).unwrap();
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).unwrap();
    fd
}

#[test]
fn a_hostile_producer_cannot_make_a_consumer_map_what_it_should_not() {
    let (c, p) = fake_connection("hostile-producer", 0);
    let expect = |want: Status, what: &str| {
        let Err(err) = c.recv(T) else { panic!("{what}: accepted") };
        assert_eq!(err.status(), want, "{what}: {err}");
    };

    // A memfd that can shrink under the reader.
    let unsealed = rustix::fs::memfd_create("u", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&unsealed, 4096).unwrap();
    p.send(&share_msg(1, &memfd_handle(4096, 4096)), &[unsealed.as_fd()]);
    expect(Status::Untrusted, "an unsealed memfd");
    // A regular file of the producer's choosing.
    let file = std::fs::File::open("/proc/self/exe").unwrap();
    p.send(&share_msg(2, &memfd_handle(4096, 4096)), &[file.as_fd()]);
    expect(Status::Untrusted, "a regular file instead of a memfd");
    // A memfd smaller than the handle says.
    let small = sealed_memfd(4096);
    p.send(&share_msg(3, &memfd_handle(8192, 8192)), &[small.as_fd()]);
    expect(Status::Mismatch, "a memfd smaller than alloc_size");
    // A sealed, sparse memfd far larger than its handle: refused, not mapped (165 of these cost
    // a consumer all its address space when it mapped whole files).
    let huge = sealed_memfd(1 << 40);
    p.send(&share_msg(7, &memfd_handle(4096, 4096)), &[huge.as_fd()]);
    expect(Status::Untrusted, "a 1 TiB memfd behind a 4 KiB handle");
    drop(huge);
    // No descriptor at all, or two.
    p.send(&share_msg(4, &memfd_handle(4096, 4096)), &[]);
    expect(Status::Untrusted, "a memfd handle without its descriptor");
    p.send(&share_msg(5, &memfd_handle(4096, 4096)), &[small.as_fd(), small.as_fd()]);
    expect(Status::Untrusted, "two descriptors");
    // A handle encoding that does not decode (a view beyond its allocation cannot even be
    // encoded; decoding validates every field).
    p.send(&share_msg(6, &[0x44; 40]), &[small.as_fd()]);
    expect(Status::BadMagic, "bytes that are no handle");
    // Pool items: for a pool never attached, outside the slots, outside a slot.
    p.send(&item_msg(1, 0, 0, 16), &[]);
    expect(Status::Untrusted, "an item of a pool never attached");
    let pool_fd = sealed_memfd(4 * 4096);
    p.send(&attach_msg(1, 4096, 4, &memfd_handle(4 * 4096, 4 * 4096)), &[pool_fd.as_fd()]);
    p.send(&item_msg(1, 4, 0, 16), &[]);
    expect(Status::Untrusted, "slot 4 of 4");
    p.send(&item_msg(1, 3, 4000, 200), &[]);
    expect(Status::Untrusted, "bytes beyond the slot");
    p.send(&item_msg(1, 0, u64::MAX - 8, 16), &[]);
    expect(Status::Untrusted, "an overflowing offset");
    let mut bad_dtype = item_msg(1, 0, 0, 16);
    bad_dtype[16] = 99;
    p.send(&bad_dtype, &[]);
    expect(Status::BadDtype, "an unknown dtype");
    p.send(&attach_msg(2, 4096, 8, &memfd_handle(4 * 4096, 4 * 4096)), &[pool_fd.as_fd()]);
    expect(Status::Untrusted, "a pool larger than its allocation");
    // Garbage.
    p.send(&[0xff; 3], &[]);
    expect(Status::Untrusted, "a 3-byte message");
    p.send(&99u32.to_le_bytes(), &[]);
    expect(Status::Untrusted, "an unknown message type");
    // After all that, a good item still arrives, at the right place.
    p.send(&item_msg(1, 2, 16, 32), &[]);
    let imp = c.recv(T).unwrap();
    assert_eq!(imp.pool_slot(), Some((1, 2)));
    assert_eq!(imp.view().data as usize - imp.view().base as usize, 2 * 4096 + 16);
    imp.release();
    // The consumer gave back each refused share and the good item (nothing else).
    drop(c);
    let mut returned = Vec::new();
    loop {
        let m = recv_raw(p.conn.as_fd());
        if m.is_empty() {
            break;
        }
        returned.push(u32::from_le_bytes(m[..4].try_into().unwrap()));
    }
    // Every refused SHARE is given back, the undecodable one too (a newer producer's handle
    // form this library refuses must not stay outstanding at the producer) — but for the one
    // that came with a file that is not shared memory: like a message with a socket, no honest
    // producer sends one, and it is refused whole at the receive (1.18.3), before its file is
    // looked at any further.
    assert_eq!(returned.iter().filter(|&&t| t == 5).count(), 6, "one RELEASE per refused share: {returned:?}");
    // One RETURN for the refused item (unknown dtype) and one for the good one; one DETACH for
    // the refused attachment (too many slots): nothing else, and nothing for pool 1 after the
    // connection closed.
    assert_eq!(returned.iter().filter(|&&t| t == 8).count(), 2, "RETURNs: {returned:?}");
    assert_eq!(returned.iter().filter(|&&t| t == 10).count(), 1, "DETACHes: {returned:?}");
    assert_eq!(returned.len(), 9, "{returned:?}");
}

/// A hand-made consumer of the channel at `addr`: connected, its `HELLO` (announcing the
/// `FEATURE_*` bits `features`) sent; the producer admits it once it serves the channel.
fn raw_consumer(addr: &str, features: u16) -> OwnedFd {
    let raw = seqpacket();
    let name = addr.strip_prefix('@').unwrap();
    rustix::net::connect(&raw, &rustix::net::SocketAddrUnix::new_abstract_name(name.as_bytes()).unwrap()).unwrap();
    let hello = le(&[
        &1u32.to_le_bytes(),
        &MAGIC.to_le_bytes(),
        &1u16.to_le_bytes(),
        &features.to_le_bytes(),
        &(std::process::id() as i32).to_le_bytes(),
    ]);
    send_raw(raw.as_fd(), &hello, &[]);
    raw
}

#[test]
fn a_hostile_consumer_cannot_return_what_it_does_not_hold() {
    let addr = address("hostile-consumer");
    let ch = Channel::listen(&addr).unwrap();
    let raw = raw_consumer(&addr, 0);
    ch.wait_peers(1, T).unwrap();
    let peer = ch.peer_ids().unwrap()[0];
    let exp = Arc::new(Exporter::channel_host_alloc(4096 * 2).unwrap());
    let pool = ch.pool(exp.clone(), 4096, 2).unwrap();
    let (s, _) = pool.acquire(T).unwrap();
    pool.send(s, peer, &TensorDesc { shape: &[4096], ..Default::default() }).unwrap();
    let (held, _) = pool.acquire(T).unwrap(); // the producer's own
    let ret = |pool: u32, slot: u32| le(&[&8u32.to_le_bytes(), &pool.to_le_bytes(), &slot.to_le_bytes(), &[0; 4]]);
    send_raw(raw.as_fd(), &ret(1, held), &[]); // a slot the producer holds
    send_raw(raw.as_fd(), &ret(1, 7), &[]); // no such slot
    send_raw(raw.as_fd(), &le(&[&5u32.to_le_bytes(), &[0; 4], &77u64.to_le_bytes()]), &[]); // no such lease
    send_raw(raw.as_fd(), &le(&[&10u32.to_le_bytes(), &5u32.to_le_bytes()]), &[]); // not attached
                                                                                   // With a descriptor: refused by the kernel where the producer's socket refuses them
                                                                                   // (SO_PASSRIGHTS, Linux 6.16), else by the producer.
    let fd_sent = try_send_raw(raw.as_fd(), &ret(1, s), &[exp_fd(&exp).as_fd()]);
    send_raw(raw.as_fd(), &le(&[&2u32.to_le_bytes()]), &[]); // a producer's message type
    let refused = if fd_sent { 6 } else { 5 };
    let deadline = Instant::now() + Duration::from_secs(10);
    while ch.peer_info(peer).unwrap().protocol_errors < refused && Instant::now() < deadline {
        ch.service(Some(Duration::from_millis(10))).unwrap();
    }
    assert_eq!(ch.peer_info(peer).unwrap().protocol_errors, refused);
    assert_eq!(pool.info().unwrap().2, 0, "nothing came back: the producer still holds one, the peer one");
    assert_eq!(status(pool.send(held + 5, peer, &TensorDesc::default())), Status::InvalidArgument);
    // The one real return works once; a second is an error, not a second free slot.
    send_raw(raw.as_fd(), &ret(1, s), &[]);
    send_raw(raw.as_fd(), &ret(1, s), &[]);
    while ch.peer_info(peer).unwrap().protocol_errors < refused + 1 && Instant::now() < deadline {
        ch.service(Some(Duration::from_millis(10))).unwrap();
    }
    assert_eq!(pool.info().unwrap().2, 1);
    assert_eq!(ch.peer_info(peer).unwrap().protocol_errors, refused + 1);
    pool.release(held).unwrap();
    assert_eq!(status(pool.release(held)), Status::InvalidArgument, "released twice");
    assert_eq!(pool.info().unwrap().2, 2);
}

fn exp_fd(_exp: &Exporter) -> OwnedFd {
    rustix::fs::memfd_create("extra", rustix::fs::MemfdFlags::CLOEXEC).unwrap()
}

#[test]
fn a_handshake_of_another_protocol_is_refused_by_name() {
    let addr = address("bad-hello");
    let ch = Arc::new(Channel::listen(&addr).unwrap());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let server = serve(ch.clone(), stop.clone());
    let raw = seqpacket();
    let name = addr.strip_prefix('@').unwrap();
    rustix::net::connect(&raw, &rustix::net::SocketAddrUnix::new_abstract_name(name.as_bytes()).unwrap()).unwrap();
    let hello =
        le(&[&1u32.to_le_bytes(), &MAGIC.to_le_bytes(), &9u16.to_le_bytes(), &0u16.to_le_bytes(), &1i32.to_le_bytes()]);
    send_raw(raw.as_fd(), &hello, &[]);
    let answer = recv_raw(raw.as_fd());
    assert_eq!(u32::from_le_bytes(answer[..4].try_into().unwrap()), 3, "REFUSED");
    assert!(String::from_utf8_lossy(&answer[4..]).contains("version 9"));
    stop.store(true, Ordering::Relaxed);
    server.join().unwrap();
    assert!(ch.peer_ids().unwrap().is_empty());
}

#[test]
fn a_zero_timeout_takes_what_already_arrived() {
    let addr = address("zero");
    let ch = Channel::listen(&addr).unwrap();
    let c = std::thread::spawn({
        let addr = addr.clone();
        move || Connection::connect(&addr, T)
    });
    // The connection is queued; nobody served the channel yet: a zero-timeout wait takes it.
    let deadline = Instant::now() + Duration::from_secs(10);
    while ch.wait_peers(1, Some(Duration::ZERO)).is_err() {
        assert!(Instant::now() < deadline, "wait_peers(0) never took the pending connection");
        std::thread::sleep(Duration::from_millis(1));
    }
    let c = c.join().unwrap().unwrap();
    let exp = Arc::new(Exporter::channel_host_alloc(4096).unwrap());
    let pool = ch.pool(exp, 4096, 1).unwrap();
    let (s, _) = pool.acquire(Some(Duration::ZERO)).unwrap();
    pool.send(s, ch.peer_ids().unwrap()[0], &TensorDesc { shape: &[4096], ..Default::default() }).unwrap();
    assert_eq!(status(pool.acquire(Some(Duration::ZERO))), Status::Timeout);
    c.recv(T).unwrap().release(); // the return is queued at the producer now
    let deadline = Instant::now() + Duration::from_secs(10);
    while pool.acquire(Some(Duration::ZERO)).is_err() {
        assert!(Instant::now() < deadline, "acquire(0) never took the queued return");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_receive_without_a_time_limit_waits_in_the_kernel_and_close_wakes_it() {
    let addr = address("blocking");
    let ch = Channel::listen(&addr).unwrap();
    let c = std::thread::spawn({
        let addr = addr.clone();
        move || Connection::connect(&addr, T).unwrap()
    });
    ch.wait_peers(1, T).unwrap();
    let c = Arc::new(c.join().unwrap());
    let peer = ch.peer_ids().unwrap()[0];
    let exp = Exporter::channel_host_alloc(64).unwrap();
    // An item arrives to a receive that waits without a limit.
    let waiting = std::thread::spawn({
        let c = c.clone();
        move || c.recv(None).map(|imp| imp.release())
    });
    std::thread::sleep(Duration::from_millis(20));
    ch.send(peer, &exp, &TensorDesc { shape: &[64], ..Default::default() }).unwrap();
    assert!(waiting.join().unwrap().is_ok());
    // Closing the connection from another thread wakes a receive that waits without a limit.
    let waiting = std::thread::spawn({
        let c = c.clone();
        move || status(c.recv(None))
    });
    std::thread::sleep(Duration::from_millis(20));
    c.close();
    assert_eq!(waiting.join().unwrap(), Status::Closed);
    exp.wait(T).unwrap();
}

/// Run `f` on a thread of its own and wait at most 10 s for its answer (a thread that never
/// wakes fails the test instead of hanging it).
fn within_10s<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> impl FnOnce() -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    move || rx.recv_timeout(Duration::from_secs(10)).expect("the waiting thread woke within 10 s")
}

#[test]
fn an_acquire_without_a_time_limit_waits_without_a_timer_and_what_other_threads_do_wakes_it() {
    let (ch, c, peer) = connected(&address("untimed"));
    let ch = Arc::new(ch);
    let exp = Arc::new(Exporter::channel_host_alloc(4096).unwrap());
    let pool = Arc::new(ch.pool(exp.clone(), 4096, 1).unwrap());
    let asleep = || std::thread::sleep(Duration::from_millis(50));
    let acquire_forever = |pool: &Arc<devshare::channel::Pool>| {
        let pool = pool.clone();
        within_10s(move || pool.acquire(None).map(|(s, _)| s))
    };

    // A slot another thread releases.
    let (slot, _) = pool.acquire(T).unwrap();
    let waiter = acquire_forever(&pool);
    asleep();
    pool.release(slot).unwrap();
    assert_eq!(waiter().unwrap(), slot);

    // Two threads waiting without a limit (only one of them without a timer): each gets the
    // slot in turn.
    let hand_on = |pool: &Arc<devshare::channel::Pool>| {
        let pool = pool.clone();
        within_10s(move || {
            let (s, _) = pool.acquire(None)?;
            std::thread::sleep(Duration::from_millis(20));
            pool.release(s)
        })
    };
    let (w1, w2) = (hand_on(&pool), hand_on(&pool));
    asleep();
    pool.release(slot).unwrap();
    w1().unwrap();
    w2().unwrap();

    // A return that another thread's service takes (it may take the ring's wake-up itself).
    let (slot, _) = pool.acquire(T).unwrap();
    pool.send(slot, peer, &TensorDesc { shape: &[4096], ..Default::default() }).unwrap();
    let imp = c.recv(T).unwrap();
    let waiter = acquire_forever(&pool);
    asleep();
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        imp.release();
    });
    ch.service(Some(Duration::from_millis(200))).unwrap();
    releaser.join().unwrap();
    assert_eq!(waiter().unwrap(), slot);

    // A close from another thread.
    let waiter = acquire_forever(&pool);
    asleep();
    ch.close();
    assert_eq!(status(waiter()), Status::Closed);
    drop(c);
}

// --- The shared-memory ring ---------------------------------------------------------------------

#[test]
fn pool_items_through_the_ring_and_leases_over_the_socket_arrive_in_the_order_they_were_sent() {
    let (ch, c, peer) = connected(&address("ring-order"));
    let exp = Arc::new(Exporter::channel_host_alloc(8 * 1024).unwrap());
    let pool = ch.pool(exp.clone(), 1024, 8).unwrap();
    let leased = Exporter::channel_host_alloc(4096).unwrap();
    // item, item, lease, item, lease, item: the items go through the ring, the leases and the
    // pool's attachment over the socket.
    let mut want = Vec::new();
    for step in 0..6u64 {
        if step == 2 || step == 4 {
            ch.send(peer, &leased, &TensorDesc { shape: &[8], storage_offset: 8 * step, ..Default::default() })
                .unwrap();
            want.push(format!("lease {}", 8 * step));
        } else {
            let (slot, ptr) = pool.acquire(T).unwrap();
            unsafe { *ptr = step as u8 };
            pool.send(slot, peer, &TensorDesc { shape: &[16], ..Default::default() }).unwrap();
            want.push(format!("item {step}"));
        }
    }
    let mut got = Vec::new();
    let mut held = Vec::new();
    for _ in 0..6 {
        let imp = c.recv(T).unwrap();
        let v = imp.view();
        got.push(match imp.pool_slot() {
            Some(_) => format!("item {}", unsafe { *(v.data as *const u8) }),
            None => format!("lease {}", v.data as usize - v.base as usize),
        });
        held.push(imp);
    }
    assert_eq!(got, want);
    drop(held);
    assert!(serve_until(&ch, || pool.info().unwrap().2 == 8), "every slot came back (through the ring)");
    let _ = exp;
    assert_eq!(leased.outstanding().unwrap(), 0);
}

/// Serve `ch` until `done` holds (at most 10 s).
fn serve_until(ch: &Channel, done: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        if Instant::now() > deadline {
            return false;
        }
        ch.service(Some(Duration::from_millis(10))).unwrap();
    }
    true
}

// The ring's layout (src/channel/unix/ring.rs): header words, then 1024 item records of 256 bytes,
// then 1024 returns of 8 bytes.
const RING_CAPACITY: usize = 1024;
const RING_SIZE: usize = 4096 + RING_CAPACITY * (256 + 8);
const ITEM_TAIL: usize = 64;
const ITEM_HEAD: usize = 128;
const RET_TAIL: usize = 256;
const RET_HEAD: usize = 320;
const C_PENDING: usize = 192;
const P_PENDING: usize = 384;

/// A ring's memory mapped in this process, to play the other side by hand.
struct RawRing(*mut u8);
// SAFETY: shared memory, read and written through atomics and volatile accesses only.
unsafe impl Send for RawRing {}
unsafe impl Sync for RawRing {}

impl RawRing {
    fn map(fd: BorrowedFd<'_>) -> RawRing {
        use std::os::fd::AsRawFd;
        // SAFETY: a shared mapping of a file at least RING_SIZE bytes large.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                RING_SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        RawRing(p.cast())
    }

    fn word(&self, offset: usize) -> &std::sync::atomic::AtomicU64 {
        // SAFETY: 8-aligned, inside the mapping (which lives as long as the test).
        unsafe { &*self.0.add(offset).cast() }
    }

    fn ret(&self, index: usize) -> &std::sync::atomic::AtomicU64 {
        self.word(4096 + RING_CAPACITY * 256 + (index % RING_CAPACITY) * 8)
    }

    /// Write item record `index`: the socket messages before it, and an ITEM message.
    fn put_item(&self, index: usize, socket_messages: u64, item: &[u8], len: u64) {
        let rec = 4096 + (index % RING_CAPACITY) * 256;
        self.word(rec).store(socket_messages, Ordering::Relaxed);
        self.word(rec + 8).store(len, Ordering::Relaxed);
        for (i, chunk) in item.chunks(8).enumerate() {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.word(rec + 16 + 8 * i).store(u64::from_le_bytes(w), Ordering::Relaxed);
        }
    }
}

/// Receive one message on a raw socket with its descriptors.
fn recv_with_fds(fd: BorrowedFd<'_>) -> (Vec<u8>, Vec<OwnedFd>) {
    let mut buf = vec![0u8; 1 << 17];
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(8))];
    let mut control = rustix::net::RecvAncillaryBuffer::new(&mut space);
    let mut iov = [std::io::IoSliceMut::new(&mut buf)];
    let m = rustix::net::recvmsg(fd, &mut iov, &mut control, rustix::net::RecvFlags::CMSG_CLOEXEC).unwrap();
    let mut fds = Vec::new();
    for a in control.drain() {
        if let rustix::net::RecvAncillaryMessage::ScmRights(r) = a {
            fds.extend(r);
        }
    }
    buf.truncate(m.bytes);
    (buf, fds)
}

fn wake(fd: &OwnedFd) {
    rustix::io::write(fd, &1u64.to_ne_bytes()).unwrap();
}

#[test]
fn a_hostile_consumer_writing_into_its_ring_cannot_free_a_slot_twice_or_crash_the_producer() {
    let addr = address("ring-hostile-consumer");
    let ch = Channel::listen(&addr).unwrap();
    let raw = raw_consumer(&addr, 1 | 2); // several shares per message, and the ring
    ch.wait_peers(1, T).unwrap();
    let peer = ch.peer_ids().unwrap()[0];
    let _welcome = recv_raw(raw.as_fd());
    let exp = Arc::new(Exporter::channel_host_alloc(4096 * 4).unwrap());
    let pool = ch.pool(exp.clone(), 4096, 4).unwrap();
    let (sent, _) = pool.acquire(T).unwrap();
    pool.send(sent, peer, &TensorDesc { shape: &[4096], ..Default::default() }).unwrap();
    let (held, _) = pool.acquire(T).unwrap(); // the producer's own
    let (attach, fds) = recv_with_fds(raw.as_fd());
    assert_eq!((u32::from_le_bytes(attach[..4].try_into().unwrap()), fds.len()), (6, 1), "ATTACH first");
    let (ring_msg, fds) = recv_with_fds(raw.as_fd());
    assert_eq!(&ring_msg[..], &le(&[&12u32.to_le_bytes(), &1024u32.to_le_bytes(), &256u32.to_le_bytes()])[..]);
    assert_eq!(fds.len(), 3, "RING carries its memory and two eventfds");
    let ring = RawRing::map(fds[0].as_fd());
    let p_efd = &fds[2];
    assert_eq!(ring.word(ITEM_TAIL).load(Ordering::SeqCst), 1, "the item travelled in the ring");
    assert_eq!(ring.word(4096).load(Ordering::SeqCst), 2, "after two socket messages (ATTACH, RING)");
    ring.word(ITEM_HEAD).store(1, Ordering::SeqCst);
    assert_eq!(pool.info().unwrap().2, 2);

    // Returns of a slot the producer holds, of no such slot, of a closed pool's slot, of the
    // sent slot twice: one slot comes back, three protocol errors, nothing freed twice.
    let put = |i: usize, pool: u32, slot: u32| {
        ring.ret(i).store(u64::from(pool) | (u64::from(slot) << 32), Ordering::Relaxed)
    };
    put(0, 1, held);
    put(1, 1, 99);
    put(2, 77, 0);
    put(3, 1, sent);
    put(4, 1, sent);
    ring.word(RET_TAIL).store(5, Ordering::SeqCst);
    wake(p_efd);
    assert!(serve_until(&ch, || ch.peer_info(peer).unwrap().protocol_errors == 3));
    assert_eq!(pool.info().unwrap().2, 3, "the sent slot came back once");
    assert_eq!(ring.word(RET_HEAD).load(Ordering::SeqCst), 5, "the producer took the five records");
    pool.release(held).expect("its own slot is still acquired, and released once");

    // A return tail more than a ring ahead of what the producer read: the peer has broken its
    // ring and is disconnected; its slot comes back.
    let (again, _) = pool.acquire(T).unwrap();
    pool.send(again, peer, &TensorDesc { shape: &[16], ..Default::default() }).unwrap();
    ring.word(RET_TAIL).store(5 + RING_CAPACITY as u64 + 1, Ordering::SeqCst);
    wake(p_efd);
    assert!(serve_until(&ch, || ch.peer_ids().unwrap().is_empty()), "the peer is disconnected");
    assert_eq!(pool.info().unwrap().2, 4, "every slot is free again, none twice");
    assert!(recv_raw(raw.as_fd()).is_empty() || recv_raw(raw.as_fd()).is_empty(), "the socket hangs up");
}

#[test]
fn a_hostile_producer_writing_into_the_ring_gets_refused_records_not_a_crash() {
    let (c, p) = fake_connection("ring-hostile-producer", 0);
    let pool_fd = sealed_memfd(4 * 4096);
    p.send(&attach_msg(1, 4096, 4, &memfd_handle(4 * 4096, 4 * 4096)), &[pool_fd.as_fd()]);
    let mem = sealed_memfd(RING_SIZE as u64);
    let ring = RawRing::map(mem.as_fd());
    ring.word(0).store(u64::from_le_bytes(*b"DSRING01"), Ordering::SeqCst);
    let efd = || rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap();
    let (c_efd, p_efd) = (efd(), efd());
    let ring_msg = le(&[&12u32.to_le_bytes(), &1024u32.to_le_bytes(), &256u32.to_le_bytes()]);
    // A ring of another record size, or without its eventfds, is refused.
    p.send(
        &le(&[&12u32.to_le_bytes(), &1024u32.to_le_bytes(), &512u32.to_le_bytes()]),
        &[mem.as_fd(), c_efd.as_fd(), p_efd.as_fd()],
    );
    assert_eq!(status(c.recv(Some(Duration::from_millis(500)))), Status::Untrusted, "another record size");
    p.send(&ring_msg, &[mem.as_fd()]);
    assert_eq!(status(c.recv(Some(Duration::from_millis(500)))), Status::Untrusted, "one descriptor");
    p.send(&ring_msg, &[mem.as_fd(), c_efd.as_fd(), p_efd.as_fd()]);
    let sent_before = 4; // ATTACH and the three RING messages
    assert_eq!(status(c.recv(Some(Duration::from_millis(200)))), Status::Timeout);

    // A good item, an item outside the pool, then an item that waits for a socket message.
    ring.put_item(0, sent_before, &item_msg(1, 1, 0, 64), item_msg(1, 1, 0, 64).len() as u64);
    ring.put_item(1, sent_before, &item_msg(1, 9, 0, 64), item_msg(1, 9, 0, 64).len() as u64);
    ring.put_item(2, sent_before + 1, &item_msg(1, 2, 0, 64), item_msg(1, 2, 0, 64).len() as u64);
    ring.word(ITEM_TAIL).store(3, Ordering::SeqCst);
    wake(&c_efd);
    let good = c.recv(T).unwrap();
    assert_eq!(good.pool_slot(), Some((1, 1)));
    assert_eq!(status(c.recv(T)), Status::Untrusted, "slot 9 of 4");
    assert_eq!(
        status(c.recv(Some(Duration::from_millis(300)))),
        Status::Timeout,
        "the next record waits for its socket message"
    );
    let lease_mem = sealed_memfd(4096);
    p.send(&share_msg(1, &memfd_handle(4096, 4096)), &[lease_mem.as_fd()]);
    let first = c.recv(T).unwrap();
    assert_eq!(first.pool_slot(), None, "the socket message sent before the record comes first");
    let second = c.recv(T).unwrap();
    assert_eq!(second.pool_slot(), Some((1, 2)));
    assert_eq!(ring.word(ITEM_HEAD).load(Ordering::SeqCst), 3, "the consumer published its head");

    // Releasing a ring item returns it through the ring.
    good.release();
    assert_eq!(ring.word(RET_TAIL).load(Ordering::SeqCst), 1);
    assert_eq!(ring.ret(0).load(Ordering::SeqCst), 1 | (1 << 32));

    // A message refused whole (longer than any message) still counts as one socket message: a
    // record sent after it is taken once it was refused, not held back waiting for another.
    p.send(&vec![0u8; 128 * 1024 + 1], &[]);
    let third = item_msg(1, 3, 0, 64);
    ring.put_item(3, sent_before + 2, &third, third.len() as u64);
    ring.word(ITEM_TAIL).store(4, Ordering::SeqCst);
    wake(&c_efd);
    assert_eq!(status(c.recv(T)), Status::Untrusted, "a message longer than any");
    let third = c.recv(Some(Duration::from_millis(500))).expect("the record after the refused message");
    assert_eq!(third.pool_slot(), Some((1, 3)));
    drop(third);

    // A record longer than a record: refused, not read past its end; the ring is broken and
    // the connection ends (imports stay valid).
    ring.put_item(4, 0, b"", 1 << 40);
    ring.word(ITEM_TAIL).store(5, Ordering::SeqCst);
    wake(&c_efd);
    assert_eq!(status(c.recv(T)), Status::Untrusted, "a record of 2^40 bytes");
    assert_eq!(status(c.recv(T)), Status::Closed, "a broken ring ends the connection");
    assert_eq!(unsafe { *(second.view().data as *const u8) }, 0, "held imports stay readable");
    drop(first);
    drop(second);
    drop(p);
}

/// A channel at `addr` with one consumer connected (from another thread), and its peer id.
fn connected(addr: &str) -> (Channel, Connection, u64) {
    let ch = Channel::listen(addr).unwrap();
    let c = std::thread::scope(|s| {
        let c = s.spawn(|| Connection::connect(addr, T).unwrap());
        ch.wait_peers(1, T).unwrap();
        c.join().unwrap()
    });
    let peer = ch.peer_ids().unwrap()[0];
    (ch, c, peer)
}

/// Whether the connection's descriptor becomes readable within `ms` milliseconds.
fn readable_within(c: &Connection, ms: i32) -> bool {
    let fd = c.fd();
    let mut fds = [rustix::event::PollFd::new(&fd, rustix::event::PollFlags::IN)];
    let ts = rustix::event::Timespec { tv_sec: i64::from(ms / 1000), tv_nsec: i64::from(ms % 1000) * 1_000_000 };
    rustix::event::poll(&mut fds, Some(&ts)).unwrap() == 1
}

#[test]
fn the_connection_descriptor_stays_readable_while_ring_items_wait() {
    let (ch, c, peer) = connected(&address("ring-level"));
    let exp = Arc::new(Exporter::channel_host_alloc(8 * 1024).unwrap());
    let pool = ch.pool(exp, 1024, 8).unwrap();
    let readable = |ms: i32| readable_within(&c, ms);
    assert!(!readable(0), "nothing sent yet");
    // One item first: the ring exists from here on.
    let (slot, _) = pool.acquire(T).unwrap();
    pool.send(slot, peer, &TensorDesc { shape: &[16], ..Default::default() }).unwrap();
    c.recv(T).unwrap().release();
    let mut held = Vec::new();
    std::thread::scope(|s| {
        // The consumer sleeps in a receive (its wait takes the wake-ups) while three items come.
        let first = s.spawn(|| c.recv(T).unwrap());
        std::thread::sleep(Duration::from_millis(100));
        for _ in 0..3 {
            let (slot, _) = pool.acquire(T).unwrap();
            pool.send(slot, peer, &TensorDesc { shape: &[16], ..Default::default() }).unwrap();
        }
        held.push(first.join().unwrap());
    });
    // An event loop that takes one item per readable event still sees each of the others.
    for i in 0..2 {
        assert!(readable(1000), "item {} of 3 waits: the descriptor is readable", i + 2);
        held.push(c.recv(Some(Duration::ZERO)).unwrap());
    }
    assert!(!readable(100) || status(c.recv(Some(Duration::ZERO))) == Status::Timeout, "at most a spurious wake-up");
    assert!(!readable(100), "nothing waits: not readable");
    assert_eq!(held.len(), 3);
}

#[test]
fn an_event_loop_that_polls_after_a_blocking_receive_is_woken_by_the_next_item() {
    let (ch, c, peer) = connected(&address("ring-poll-after-recv"));
    let exp = Arc::new(Exporter::channel_host_alloc(8 * 1024).unwrap());
    let pool = ch.pool(exp, 1024, 8).unwrap();
    let send = || {
        let (slot, _) = pool.acquire(T).unwrap();
        pool.send(slot, peer, &TensorDesc { shape: &[16], ..Default::default() }).unwrap();
    };
    let readable = |ms: i32| readable_within(&c, ms);
    // One item first: the ring exists from here on.
    send();
    c.recv(T).unwrap().release();
    for round in 0..3 {
        // The consumer sleeps in a receive, whose wait takes the item's wake-up...
        std::thread::scope(|s| {
            let r = s.spawn(|| c.recv(T).unwrap());
            std::thread::sleep(Duration::from_millis(50));
            send();
            r.join().unwrap().release();
        });
        // ...then an event loop sleeps on the descriptor: the next item must wake it.
        while readable(0) {
            assert_eq!(status(c.recv(Some(Duration::ZERO))), Status::Timeout, "only a spurious wake-up");
        }
        send();
        assert!(readable(5000), "round {round}: the item after a blocking receive makes the descriptor readable");
        c.recv(Some(Duration::ZERO)).unwrap().release();
    }
}

/// The inode of the file mapped at `addr` in this process (from /proc/self/maps).
fn inode_at(addr: usize) -> u64 {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (range, inode) = (f.next().unwrap(), f.nth(3).unwrap());
        let (a, b) = range.split_once('-').unwrap();
        let (a, b) = (usize::from_str_radix(a, 16).unwrap(), usize::from_str_radix(b, 16).unwrap());
        if (a..b).contains(&addr) {
            return inode.parse().unwrap();
        }
    }
    panic!("nothing is mapped at {addr:#x}");
}

/// How many mappings of inode `ino` this process has.
fn mappings_of(ino: u64) -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines().filter(|l| l.split_whitespace().nth(4) == Some(&ino.to_string())).count()
}

#[test]
fn a_registered_export_stays_mapped_in_the_consumer_between_leases_until_it_is_retired() {
    let (ch, c, peer) = connected(&address("keep"));
    let exp = Exporter::channel_host_alloc(1 << 20).unwrap();
    let ino = inode_at(exp.ptr() as usize);
    let own = mappings_of(ino);
    let desc = TensorDesc { shape: &[4096], ..Default::default() };
    // Not registered: the consumer unmaps it with the release.
    ch.send(peer, &exp, &desc).unwrap();
    let imp = c.recv(T).unwrap();
    assert_eq!(mappings_of(ino), own + 1);
    imp.release();
    assert_eq!(mappings_of(ino), own, "an unregistered export is unmapped with its last release");
    // Registered: mapped once, kept between leases.
    ch.register(&exp).unwrap();
    for i in 0..3 {
        ch.send(peer, &exp, &desc).unwrap();
        let imp = c.recv(T).unwrap();
        assert_eq!(mappings_of(ino), own + 1, "lease {i}: the kept mapping, not a second one");
        imp.release();
        assert_eq!(mappings_of(ino), own + 1, "lease {i}: still mapped after its release");
        assert!(devshare::import::kept_idle().0 + devshare::import::pinned().0 >= 1, "counted as kept or pinned");
    }
    // Retired: the consumer unmaps it when it reads the retirement.
    ch.unregister(&exp).unwrap();
    assert_eq!(status(c.recv(Some(Duration::from_millis(100)))), Status::Timeout);
    assert_eq!(mappings_of(ino), own, "a retired export is unmapped");
    assert_eq!(status(ch.unregister(&exp)), Status::NotFound);
}

#[test]
fn a_kept_mapping_in_use_when_it_is_retired_goes_with_its_last_release_and_a_closed_connection_keeps_none() {
    let (ch, c, peer) = connected(&address("keep-retire-held"));
    let exp = Exporter::channel_host_alloc(1 << 16).unwrap();
    let ino = inode_at(exp.ptr() as usize);
    let own = mappings_of(ino);
    let desc = TensorDesc { shape: &[64], ..Default::default() };
    ch.register(&exp).unwrap();
    ch.send(peer, &exp, &desc).unwrap();
    let held = c.recv(T).unwrap();
    ch.unregister(&exp).unwrap();
    assert_eq!(status(c.recv(Some(Duration::from_millis(100)))), Status::Timeout);
    assert_eq!(mappings_of(ino), own + 1, "held: still mapped");
    held.release();
    assert_eq!(mappings_of(ino), own, "retired while held: unmapped with the release");
    // Kept, then the connection closes: nothing stays mapped for it.
    ch.register(&exp).unwrap();
    ch.send(peer, &exp, &desc).unwrap();
    c.recv(T).unwrap().release();
    assert_eq!(mappings_of(ino), own + 1);
    c.close();
    assert_eq!(mappings_of(ino), own, "a closed connection keeps nothing mapped");
    // And a producer that goes: the consumer lets go when it sees the channel closed.
    let (ch2, c2, peer2) = connected(&address("keep-producer-gone"));
    ch2.register(&exp).unwrap();
    ch2.send(peer2, &exp, &desc).unwrap();
    c2.recv(T).unwrap().release();
    assert_eq!(mappings_of(ino), own + 1);
    drop(ch2);
    assert_eq!(status(c2.recv(T)), Status::Closed);
    assert_eq!(mappings_of(ino), own, "a producer's kept allocations go when it does");
    drop(ch);
}

/// The type of a channel message.
fn msg_type(m: &[u8]) -> u32 {
    u32::from_le_bytes(m[..4].try_into().unwrap())
}

fn u64_at(m: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(m[at..at + 8].try_into().unwrap())
}

#[test]
fn a_registered_export_is_pinned_once_and_its_later_leases_travel_without_descriptors() {
    let addr = address("pin-protocol");
    let ch = Channel::listen(&addr).unwrap();
    // Reads SHARES, keeps registered exports, reads PIN_SHARES and LEASE; no ring: every message
    // is seen on the socket.
    let raw = raw_consumer(&addr, 1 | 4 | 16);
    ch.wait_peers(1, T).unwrap();
    let peer = ch.peer_ids().unwrap()[0];
    let welcome = recv_raw(raw.as_fd());
    assert_eq!(u16::from_le_bytes(welcome[10..12].try_into().unwrap()) & 2, 2, "the producer reads PINNED");
    let exp = Exporter::channel_host_alloc(1 << 16).unwrap();
    ch.register(&exp).unwrap();
    let desc = TensorDesc { shape: &[16], storage_offset: 4096, ..Default::default() };
    let pinned_msg = |export: u64, pin: u64| {
        le(&[&18u32.to_le_bytes(), &1u32.to_le_bytes(), &[0; 4], &export.to_le_bytes(), &pin.to_le_bytes()])
    };
    let serve = || {
        for _ in 0..5 {
            ch.service(Some(Duration::from_millis(10))).unwrap();
        }
    };
    // The first lease: a share with its descriptor, which also offers the export's window
    // (PIN_SHARES: count, first lease, then len, fds, export, pin, window offset and size).
    ch.send(peer, &exp, &desc).unwrap();
    let (share, fds) = recv_with_fds(raw.as_fd());
    assert_eq!((msg_type(&share), fds.len()), (17, 1), "PIN_SHARES with the export's descriptor");
    let (export, first_pin) = (u64_at(&share, 24), u64_at(&share, 32));
    assert!(first_pin != 0, "the window is offered");
    assert_eq!((u64_at(&share, 40), u64_at(&share, 48)), (0, 1 << 16), "the whole window");
    // Not answered yet: the next lease is a share again, and the offer is not repeated.
    ch.send(peer, &exp, &desc).unwrap();
    let (share, fds) = recv_with_fds(raw.as_fd());
    assert_eq!((msg_type(&share), fds.len(), u64_at(&share, 32)), (17, 1, 0), "a share, no second offer");
    // An answer to an offer never made changes nothing.
    send_raw(raw.as_fd(), &pinned_msg(export, first_pin + 100), &[]);
    send_raw(raw.as_fd(), &pinned_msg(export + 100, first_pin), &[]);
    serve();
    ch.send(peer, &exp, &desc).unwrap();
    assert_eq!(msg_type(&recv_with_fds(raw.as_fd()).0), 17, "still shares");
    // Taken: every later lease is one LEASE message without a descriptor, its bytes within the
    // window.
    send_raw(raw.as_fd(), &pinned_msg(export, first_pin), &[]);
    serve();
    for _ in 0..3 {
        ch.send(peer, &exp, &desc).unwrap();
        let (lease, fds) = recv_with_fds(raw.as_fd());
        assert_eq!((msg_type(&lease), fds.len()), (19, 0), "a LEASE without descriptors");
        assert_eq!(u64_at(&lease, 4), export);
        assert_eq!(u64_at(&lease, 32), 4096, "its storage offset within the window");
    }
    assert_eq!(exp.outstanding().unwrap(), 6);
    // Unregistered: retired, and the offer withdrawn; an answer to it now changes nothing.
    ch.unregister(&exp).unwrap();
    assert_eq!(msg_type(&recv_raw(raw.as_fd())), 14, "RETIRE");
    send_raw(raw.as_fd(), &pinned_msg(export, first_pin), &[]);
    serve();
    ch.send(peer, &exp, &desc).unwrap();
    let (share, fds) = recv_with_fds(raw.as_fd());
    assert_eq!((msg_type(&share), fds.len()), (4, 1), "an unregistered export's lease is a plain share again");
    // Registered again: offered again under a new number; the old number is not taken.
    ch.register(&exp).unwrap();
    ch.send(peer, &exp, &desc).unwrap();
    let share = recv_raw(raw.as_fd());
    let second_pin = u64_at(&share, 32);
    assert_eq!(msg_type(&share), 17);
    assert!(second_pin != 0 && second_pin != first_pin);
    send_raw(raw.as_fd(), &pinned_msg(export, first_pin), &[]);
    serve();
    ch.send(peer, &exp, &desc).unwrap();
    assert_eq!(msg_type(&recv_raw(raw.as_fd())), 17, "a withdrawn offer's number pins nothing");
    send_raw(raw.as_fd(), &pinned_msg(export, second_pin), &[]);
    serve();
    ch.send(peer, &exp, &desc).unwrap();
    assert_eq!(msg_type(&recv_raw(raw.as_fd())), 19);
    assert_eq!(ch.peer_info(peer).unwrap().protocol_errors, 0, "stale answers are not errors");
    // Its leases come back when it goes.
    drop(raw);
    exp.wait(T).unwrap();
}

#[test]
fn a_registered_state_dict_of_300_named_tensors_syncs_again_and_again_with_the_consumer_on_the_same_thread() {
    // The consumer reads only after the whole send: what the producer posts for a sync must fit
    // its socket and send queue. (Offering each window in a message of its own, with its
    // descriptor, overflowed the queue's descriptor bound at about 260 tensors; and a NAMES
    // message per lease later left the last leases' ring records waiting for names still queued.)
    let (ch, c, peer) = connected(&address("pin-state-dict"));
    let exps: Vec<Exporter> = (0..300).map(|_| Exporter::channel_host_alloc(4096).unwrap()).collect();
    for e in &exps {
        ch.register(e).unwrap();
    }
    let names: Vec<String> = (0..300).map(|i| format!("model.layers.{i}.weight")).collect();
    let desc = TensorDesc { shape: &[64], storage_offset: 128, ..Default::default() };
    let items: Vec<_> = exps.iter().map(|e| (e, desc.clone())).collect();
    let named: Vec<Option<&str>> = names.iter().map(|n| Some(n.as_str())).collect();
    for sync in 0..4u8 {
        for e in &exps {
            // SAFETY: the producer's own bytes, no lease out.
            unsafe { std::ptr::write_bytes(e.ptr().add(128), sync, 256) };
        }
        ch.send_named(peer, &items, &named).unwrap();
        let mut imps = Vec::new();
        for (i, name) in names.iter().enumerate() {
            let imp = c.recv(T).unwrap_or_else(|e| panic!("sync {sync}, tensor {i}: {e}"));
            assert_eq!(imp.name().map(|n| n.to_str().unwrap()), Some(name.as_str()));
            // SAFETY: 256 readable bytes.
            assert!(unsafe { std::slice::from_raw_parts(imp.view().data, 256) }.iter().all(|&b| b == sync));
            imps.push(imp);
        }
        // One message for the batch (one per lease would wait in the consumer's backlog for
        // its next call once the producer's socket is full: the producer reads only below).
        Connection::give_back_all(&imps);
        drop(imps);
        for (i, e) in exps.iter().enumerate() {
            e.wait(T).unwrap_or_else(|err| panic!("sync {sync}, tensor {i}: {err} {:?}", ch.peer_info(peer)));
        }
    }
    assert_eq!(ch.peer_info(peer).unwrap().protocol_errors, 0);
}

#[test]
fn a_send_of_thousands_of_pinned_leases_fits_the_socket_while_the_consumer_reads_nothing() {
    // 3,000 registered exports, pinned (their first leases sent 200 at a time), then sent in one
    // batch that the consumer reads only after the send: 1,024 leases fill its ring, the rest
    // go over the socket. One message each filled the socket and the send queue (1,024
    // messages), and the producer disconnected the consumer as one that does not read.
    const N: usize = 3000;
    let (ch, c, peer) = connected(&address("many-leases"));
    let exps: Vec<Exporter> = (0..N).map(|_| Exporter::channel_host_alloc(4096).unwrap()).collect();
    for e in &exps {
        ch.register(e).unwrap();
    }
    let desc = TensorDesc { shape: &[16], storage_offset: 64, ..Default::default() };
    let items: Vec<_> = exps.iter().map(|e| (e, desc.clone())).collect();
    for chunk in items.chunks(200) {
        ch.send_batch(peer, chunk).unwrap();
        let imps: Vec<_> = (0..chunk.len()).map(|_| c.recv(T).unwrap()).collect();
        Connection::give_back_all(&imps);
        drop(imps);
        for (e, _) in chunk {
            e.wait(T).unwrap();
        }
    }
    for sync in 1..=2u8 {
        for e in &exps {
            // SAFETY: the producer's own bytes, no lease out.
            unsafe { std::ptr::write_bytes(e.ptr().add(64), sync, 16) };
        }
        ch.send_batch(peer, &items).unwrap_or_else(|e| panic!("sync {sync}: {e}"));
        // Read in another thread while this one serves the channel (its wait).
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut imps = Vec::with_capacity(N);
                for i in 0..N {
                    let imp = c.recv(T).unwrap_or_else(|e| panic!("sync {sync}, lease {i}: {e}"));
                    // SAFETY: 16 readable bytes.
                    assert!(unsafe { std::slice::from_raw_parts(imp.view().data, 16) }.iter().all(|&b| b == sync));
                    imps.push(imp);
                }
                Connection::give_back_all(&imps);
            });
            for (i, e) in exps.iter().enumerate() {
                e.wait(T).unwrap_or_else(|err| panic!("sync {sync}, export {i}: {err}"));
            }
        });
    }
    let info = ch.peer_info(peer).unwrap();
    assert_eq!(info.protocol_errors, 0);
}

#[test]
fn ten_leases_of_a_pinned_export_read_its_current_values_through_one_mapping_and_come_back() {
    let (ch, c, peer) = connected(&address("pin-values"));
    let exp = Exporter::channel_host_alloc(1 << 16).unwrap();
    let ino = inode_at(exp.ptr() as usize);
    let own = mappings_of(ino);
    ch.register(&exp).unwrap();
    for round in 0..10u8 {
        // The producer changes the values in place between leases.
        // SAFETY: 64 KiB of the producer's own memory, no lease out.
        unsafe { std::ptr::write_bytes(exp.ptr(), round, 1 << 16) };
        let off = 4096 * u64::from(round % 4);
        let descs = [
            TensorDesc { shape: &[16], storage_offset: off, ..Default::default() },
            TensorDesc { shape: &[8, 8], storage_offset: off + 1024, ..Default::default() },
        ];
        ch.send_batch(peer, &[(&exp, descs[0].clone()), (&exp, descs[1].clone())]).unwrap();
        for d in &descs {
            let imp = c.recv(T).unwrap();
            let v = imp.view();
            // SAFETY: the view's bytes are readable while the import lives.
            let bytes = unsafe { std::slice::from_raw_parts(v.data, 64) };
            assert!(bytes.iter().all(|&b| b == round), "round {round}: the current values");
            // SAFETY: both point into the producer's and the consumer's maps of one memfd.
            assert_eq!(unsafe { *v.data }, unsafe { *exp.ptr().add(d.storage_offset as usize) });
            assert_eq!(mappings_of(ino), own + 1, "round {round}: one mapping of the allocation");
            imp.release();
        }
        exp.wait(T).unwrap();
    }
    // Retired while a lease is held: unmapped with its release.
    ch.send(peer, &exp, &TensorDesc { shape: &[16], ..Default::default() }).unwrap();
    let held = c.recv(T).unwrap();
    ch.unregister(&exp).unwrap();
    assert_eq!(status(c.recv(Some(Duration::from_millis(100)))), Status::Timeout);
    assert_eq!(mappings_of(ino), own + 1, "held: still mapped");
    held.release();
    exp.wait(T).unwrap();
    assert_eq!(mappings_of(ino), own, "retired: unmapped with the last release");
    // Pinned, then the connection closes: nothing stays mapped.
    ch.register(&exp).unwrap();
    for _ in 0..3 {
        ch.send(peer, &exp, &TensorDesc { shape: &[16], ..Default::default() }).unwrap();
        c.recv(T).unwrap().release();
        exp.wait(T).unwrap();
    }
    assert_eq!(mappings_of(ino), own + 1);
    c.close();
    assert_eq!(mappings_of(ino), own, "a closed connection keeps nothing pinned");
}

#[test]
fn an_export_closed_while_registered_is_retired_at_once() {
    let (ch, c, peer) = connected(&address("pin-closed"));
    let exp = Exporter::channel_host_alloc(1 << 16).unwrap();
    let ino = inode_at(exp.ptr() as usize);
    ch.register(&exp).unwrap();
    for _ in 0..3 {
        ch.send(peer, &exp, &TensorDesc { shape: &[16], ..Default::default() }).unwrap();
        c.recv(T).unwrap().release();
        exp.wait(T).unwrap();
    }
    drop(exp); // closed without unregistering: the consumer still maps it until it reads on
    assert_eq!(mappings_of(ino), 1);
    // Nothing else is sent or registered: the close itself told the consumer.
    assert_eq!(status(c.recv(Some(Duration::from_millis(100)))), Status::Timeout);
    assert_eq!(mappings_of(ino), 0, "retired when it was closed");
    drop(ch);
}

/// A `PIN_SHARES` message of one share (lease `lease`, one descriptor) of `export`, offering
/// bytes `offset..+size` of its allocation as the window under number `pin`.
fn pin_shares_msg(lease: u64, export: u64, pin: u64, offset: u64, size: u64, enc: &[u8]) -> Vec<u8> {
    le(&[
        &17u32.to_le_bytes(),
        &1u32.to_le_bytes(),
        &lease.to_le_bytes(),
        &(enc.len() as u32).to_le_bytes(),
        &1u32.to_le_bytes(),
        &export.to_le_bytes(),
        &pin.to_le_bytes(),
        &offset.to_le_bytes(),
        &size.to_le_bytes(),
        enc,
    ])
}

/// A `LEASE` message of 1-D `uint8` bytes `offset..+size` of `export`'s window.
fn lease_msg(export: u64, lease: u64, offset: u64, size: u64) -> Vec<u8> {
    le(&[&19u32.to_le_bytes(), &export.to_le_bytes(), &lease.to_le_bytes(), &byte_layout(offset, size)])
}

/// A consumer connected to a fake producer that reads `PINNED` and ring releases.
fn pinning_consumer(tag: &str) -> (Connection, FakeProducer) {
    fake_connection(tag, 2)
}

/// The fake producer's next message is the `RELEASE` of `lease`.
fn released(p: &FakeProducer, lease: u64) {
    let m = recv_raw(p.conn.as_fd());
    assert_eq!((msg_type(&m), u64_at(&m, 8)), (5, lease), "lease {lease} given back");
}

#[test]
fn a_hostile_producers_pins_and_leases_are_refused_and_given_back_and_map_nothing_outside_the_window() {
    let (c, p) = pinning_consumer("hostile-pin");
    // A lease of an export never pinned: refused, and given back.
    p.send(&lease_msg(5, 1, 0, 16), &[]);
    assert_eq!(status(c.recv(T)), Status::Untrusted);
    released(&p, 1);
    let enc = memfd_handle(8192, 4096);
    let fd = sealed_memfd(8192);
    rustix::io::pwrite(&fd, &[7u8; 64], 1024 + 64).unwrap();
    // A window past the allocation (or empty): the share itself arrives, the offer is refused
    // and nothing is pinned.
    for (lease, offset, size) in [(2, 4096, 8192), (3, 0, 0), (4, u64::MAX - 8, 16)] {
        p.send(&pin_shares_msg(lease, 5, 1, offset, size, &enc), &[fd.as_fd()]);
        assert!(c.recv(T).is_err(), "window {offset}..+{size} refused");
        c.recv(T).unwrap().release(); // the share, given back
        released(&p, lease);
    }
    p.send(&lease_msg(5, 5, 0, 16), &[]);
    assert_eq!(status(c.recv(T)), Status::Untrusted, "nothing was pinned");
    released(&p, 5);
    // A good window (bytes 1024..+4096 of the allocation): pinned, and the answer names the offer.
    p.send(&pin_shares_msg(6, 5, 1, 1024, 4096, &enc), &[fd.as_fd()]);
    c.recv(T).unwrap().release();
    let m = recv_raw(p.conn.as_fd());
    assert_eq!((msg_type(&m), u64_at(&m, 12), u64_at(&m, 20)), (18, 5, 1), "PINNED for export 5, offer 1");
    released(&p, 6);
    // The same export offered again: refused; the first stays.
    p.send(&pin_shares_msg(7, 5, 2, 1024, 4096, &enc), &[fd.as_fd()]);
    assert!(c.recv(T).is_err());
    c.recv(T).unwrap().release();
    released(&p, 7);
    // Bytes past the window (and a range that overflows): refused, given back.
    p.send(&lease_msg(5, 8, 4000, 200), &[]);
    assert_eq!(status(c.recv(T)), Status::Untrusted);
    released(&p, 8);
    p.send(&lease_msg(5, 9, u64::MAX - 8, 16), &[]);
    assert_eq!(status(c.recv(T)), Status::Untrusted);
    released(&p, 9);
    // A lease with a descriptor: refused.
    p.send(&lease_msg(5, 10, 0, 16), &[fd.as_fd()]);
    assert_eq!(status(c.recv(T)), Status::Untrusted);
    // A good lease: a view of the window (window-relative 64 is the allocation's 1088).
    p.send(&lease_msg(5, 11, 64, 16), &[]);
    let imp = c.recv(T).unwrap();
    // SAFETY: 16 readable bytes.
    assert_eq!(unsafe { std::slice::from_raw_parts(imp.view().data, 16) }, &[7u8; 16]);
    let ino = inode_at(imp.view().data as usize);
    // Retired while held: mapped until the release, then gone; a lease of it now is refused.
    p.send(&le(&[&14u32.to_le_bytes(), &5u64.to_le_bytes()]), &[]);
    assert_eq!(status(c.recv(Some(Duration::from_millis(100)))), Status::Timeout);
    assert_eq!(mappings_of(ino), 1);
    imp.release();
    released(&p, 11);
    assert_eq!(mappings_of(ino), 0, "retired: unmapped with the release");
    p.send(&lease_msg(5, 12, 64, 16), &[]);
    assert_eq!(status(c.recv(T)), Status::Untrusted);
    released(&p, 12);
}

/// A `LEASES` message of `LEASE` messages.
fn leases_msg(leases: &[Vec<u8>]) -> Vec<u8> {
    let mut m = le(&[&20u32.to_le_bytes(), &(leases.len() as u32).to_le_bytes(), &[0; 4]]);
    for l in leases {
        m.extend(le(&[&(l.len() as u32).to_le_bytes(), l]));
    }
    m
}

#[test]
fn a_hostile_producers_leases_messages_are_checked_lease_by_lease() {
    let (c, p) = pinning_consumer("hostile-leases");
    let enc = memfd_handle(8192, 4096);
    let fd = sealed_memfd(8192);
    rustix::io::pwrite(&fd, &[7u8; 64], 1024 + 64).unwrap();
    p.send(&pin_shares_msg(1, 5, 1, 1024, 4096, &enc), &[fd.as_fd()]);
    c.recv(T).unwrap().release();
    let m = recv_raw(p.conn.as_fd());
    assert_eq!((msg_type(&m), u64_at(&m, 12)), (18, 5), "PINNED for export 5");
    released(&p, 1);
    // Two good leases around one of an export never pinned and one past the window: the bad
    // ones are refused (the receive's error) and given back, the good ones arrive in order.
    p.send(
        &leases_msg(&[
            lease_msg(5, 2, 64, 16),
            lease_msg(9, 3, 0, 16),
            lease_msg(5, 4, 4000, 200),
            lease_msg(5, 5, 64, 8),
        ]),
        &[],
    );
    assert_eq!(status(c.recv(T)), Status::Untrusted);
    released(&p, 3);
    released(&p, 4);
    let (a, b) = (c.recv(T).unwrap(), c.recv(T).unwrap());
    // SAFETY: 16 and 8 readable bytes.
    assert_eq!(unsafe { std::slice::from_raw_parts(a.view().data, 16) }, &[7u8; 16]);
    assert_eq!(unsafe { std::slice::from_raw_parts(b.view().data, 8) }, &[7u8; 8]);
    a.release();
    released(&p, 2);
    b.release();
    released(&p, 5);
    // With a descriptor, or holding something that is not a lease: refused whole, nothing
    // arrives.
    p.send(&leases_msg(&[lease_msg(5, 6, 64, 16)]), &[fd.as_fd()]);
    assert_eq!(status(c.recv(T)), Status::Untrusted);
    p.send(&leases_msg(&[lease_msg(5, 7, 64, 16), item_msg(1, 0, 0, 16)]), &[]);
    assert_eq!(status(c.recv(T)), Status::Untrusted);
    assert_eq!(status(c.recv(Some(Duration::from_millis(100)))), Status::Timeout, "nothing else arrived");
}

/// A `LEASES` holding a `LEASES` holding ... as deep as one message allows (16 bytes a level:
/// about 8,000 levels), around one good `LEASE` of export 5.
fn nested_leases_msg() -> Vec<u8> {
    let mut m = lease_msg(5, 1, 64, 16);
    while m.len() + 16 <= 128 * 1024 {
        m = leases_msg(&[m]);
    }
    m
}

/// 1.15.0 decoded each record of a `LEASES` as a whole message, so records could nest as deep
/// as the bytes allow and one message overflowed the reader's stack: the process aborted,
/// producer or consumer alike, before any handshake. Now the first level is refused.
#[test]
fn leases_nested_in_leases_crash_neither_side_and_are_refused() {
    let nested = nested_leases_msg();
    // A hostile consumer, before its handshake and after it: the producer serves on, and an
    // honest consumer connects and receives afterwards.
    let addr = address("nested-leases");
    let ch = Channel::listen(&addr).unwrap();
    let early = seqpacket();
    let name = addr.strip_prefix('@').unwrap();
    rustix::net::connect(&early, &rustix::net::SocketAddrUnix::new_abstract_name(name.as_bytes()).unwrap()).unwrap();
    send_raw(early.as_fd(), &nested, &[]);
    let late = raw_consumer(&addr, 0);
    send_raw(late.as_fd(), &nested, &[]);
    for _ in 0..20 {
        ch.service(Some(Duration::from_millis(10))).unwrap();
    }
    let peers = ch.peer_ids().unwrap();
    assert_eq!(peers.len(), 1, "the early one was not admitted, the late one was");
    assert_eq!(ch.peer_info(peers[0]).unwrap().protocol_errors, 1, "the late one's message was refused");
    let c = std::thread::spawn({
        let addr = addr.clone();
        move || Connection::connect(&addr, T).unwrap()
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while !c.is_finished() && Instant::now() < deadline {
        ch.service(Some(Duration::from_millis(10))).unwrap();
    }
    let c = c.join().unwrap();
    let peer = *ch.peer_ids().unwrap().iter().max().unwrap();
    let exp = Exporter::channel_host_alloc(4096).unwrap();
    ch.send(peer, &exp, &TensorDesc { shape: &[16], ..Default::default() }).unwrap();
    c.recv(T).unwrap().release();
    // A hostile producer: the consumer's receive says Untrusted, and what comes next arrives.
    let (c, p) = pinning_consumer("nested-leases-producer");
    p.send(&nested, &[]);
    let Err(err) = c.recv(T) else { panic!("the nested message was accepted") };
    assert_eq!(err.status(), Status::Untrusted, "{err}");
    assert!(err.to_string().contains("not a lease"), "{err}");
    let enc = memfd_handle(4096, 4096);
    let fd = sealed_memfd(4096);
    p.send(&share_msg(2, &enc), &[fd.as_fd()]);
    c.recv(T).unwrap().release();
}

/// A producer may not attach a pool of more slots than any producer can make: the consumer
/// sizes a pool's bookkeeping by its slot count, and 2^32 one-byte slots of a sparse 4 GiB memfd
/// cost the producer nothing and the consumer 32 GiB (1.15.0 aborted). 65,537 is refused as
/// 2^32 - 1 is; the refusal gives the attachment back (DETACH) and the connection goes on.
#[test]
fn a_hostile_producers_pool_of_more_slots_than_any_pool_has_is_refused() {
    let (c, p) = fake_connection("hostile-slots", 0);
    let fd = sealed_memfd(1 << 20);
    p.send(&attach_msg(1, 1, 65537, &memfd_handle(1 << 20, 1 << 20)), &[fd.as_fd()]);
    let Err(err) = c.recv(T) else { panic!("a pool of 65,537 slots was attached") };
    assert_eq!(err.status(), Status::Untrusted, "{err}");
    assert!(err.to_string().contains("65537 slots (at most 65536"), "{err}");
    let m = recv_raw(p.conn.as_fd());
    assert_eq!((msg_type(&m), u32::from_le_bytes(m[4..8].try_into().unwrap())), (10, 1), "DETACH of pool 1");
    // The most a pool has is attached, and its items arrive.
    p.send(&attach_msg(2, 16, 65536, &memfd_handle(1 << 20, 1 << 20)), &[fd.as_fd()]);
    p.send(&item_msg(2, 65535, 0, 16), &[]);
    let imp = c.recv(T).unwrap();
    assert_eq!(imp.pool_slot(), Some((2, 65535)));
    imp.release();
}

fn kept_shares_msg(first_lease: u64, entries: &[(u32, u64, &[u8])]) -> Vec<u8> {
    let mut m = le(&[&13u32.to_le_bytes(), &(entries.len() as u32).to_le_bytes(), &first_lease.to_le_bytes()]);
    for (fds, export, enc) in entries {
        m.extend(le(&[&(enc.len() as u32).to_le_bytes(), &fds.to_le_bytes(), &export.to_le_bytes(), enc]));
    }
    m
}

#[test]
fn a_hostile_producers_kept_shares_and_retirements_are_checked_like_any_share() {
    let (c, p) = fake_connection("hostile-keep", 0);
    let enc = memfd_handle(4096, 4096);
    let fd = sealed_memfd(4096);
    // Retiring what it never sent: refused, saying so (nothing else changes).
    p.send(&le(&[&14u32.to_le_bytes(), &77u64.to_le_bytes()]), &[]);
    let Err(e) = c.recv(T) else { panic!("a retirement of an export never sent was taken") };
    assert_eq!(e.status(), Status::Untrusted, "{e}");
    assert!(e.to_string().contains("export 77, which it never sent"), "{e}");
    // Descriptor counts that do not match the descriptors.
    p.send(&kept_shares_msg(1, &[(1, 5, &enc), (1, 6, &enc)]), &[fd.as_fd()]);
    assert_eq!(status(c.recv(T)), Status::Untrusted);
    // An unsealed memfd is refused as in a plain share, kept or not.
    let unsealed = rustix::fs::memfd_create("u", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&unsealed, 4096).unwrap();
    p.send(&kept_shares_msg(3, &[(1, 5, &enc)]), &[unsealed.as_fd()]);
    assert_eq!(status(c.recv(T)), Status::Untrusted);
    // A good one is kept until retired; a retirement of another export leaves it.
    p.send(&kept_shares_msg(4, &[(1, 5, &enc)]), &[fd.as_fd()]);
    let imp = c.recv(T).unwrap();
    let ino = inode_at(imp.view().base as usize);
    imp.release();
    assert_eq!(mappings_of(ino), 1, "kept after its release");
    p.send(&le(&[&14u32.to_le_bytes(), &6u64.to_le_bytes()]), &[]);
    assert_eq!(status(c.recv(Some(Duration::from_millis(100)))), Status::Timeout);
    assert_eq!(mappings_of(ino), 1, "another export's retirement leaves it");
    p.send(&le(&[&14u32.to_le_bytes(), &5u64.to_le_bytes()]), &[]);
    assert_eq!(status(c.recv(Some(Duration::from_millis(100)))), Status::Timeout);
    assert_eq!(mappings_of(ino), 0, "retired: unmapped");
    // Once a message was refused unread (it may have announced exports), a retirement of one
    // never seen is let be: it may be that message's.
    p.send(&vec![0u8; 128 * 1024 + 1], &[]);
    assert_eq!(status(c.recv(T)), Status::Untrusted, "a message longer than any");
    p.send(&le(&[&14u32.to_le_bytes(), &78u64.to_le_bytes()]), &[]);
    assert_eq!(status(c.recv(Some(Duration::from_millis(100)))), Status::Timeout);
}

#[test]
fn names_travel_with_the_leases_they_name_and_bad_names_send_nothing() {
    let (ch, c, peer) = connected(&address("names"));
    let exp = Exporter::channel_host_alloc(4096).unwrap();
    let d = |off: u64| TensorDesc { shape: &[16], storage_offset: off, ..Default::default() };
    let items = [(&exp, d(0)), (&exp, d(64)), (&exp, d(128))];
    let name_of = |imp: &devshare::import::Import| imp.name().map(|n| n.to_str().unwrap().to_owned());
    ch.send_named(peer, &items, &[Some("model.layers.0.weight"), None, Some("ü.bias")]).unwrap();
    let got: Vec<_> = (0..3).map(|_| c.recv(T).unwrap()).collect();
    let names: Vec<_> = got.iter().map(name_of).collect();
    assert_eq!(names, [Some("model.layers.0.weight".into()), None, Some("ü.bias".into())]);
    // The next batch without names: none is left over from the last one.
    ch.send_batch(peer, &items[..2]).unwrap();
    for _ in 0..2 {
        assert_eq!(name_of(&c.recv(T).unwrap()), None);
    }
    // A name too long, or a count that does not match: refused by index, and nothing is sent.
    let long = "x".repeat(devshare::channel::limits::DEVSHARE_MAX_NAME_LEN + 1);
    let e = ch.send_named(peer, &items[..2], &[Some("a"), Some(&long)]).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.to_string().contains("names[1]"), "{e}");
    let e = ch.send_named(peer, &items, &[Some("a")]).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    assert_eq!(status(c.recv(Some(Duration::ZERO))), Status::Timeout, "nothing was sent");
    // The longest name goes through.
    let longest = "y".repeat(devshare::channel::limits::DEVSHARE_MAX_NAME_LEN);
    ch.send_named(peer, &items[..1], &[Some(&longest)]).unwrap();
    assert_eq!(name_of(&c.recv(T).unwrap()).as_deref(), Some(&longest[..]));
}

/// A `NAMES` message: `names` for leases `first_lease..`.
fn names_msg(first_lease: u64, names: &[&[u8]]) -> Vec<u8> {
    let mut m = le(&[&15u32.to_le_bytes(), &(names.len() as u32).to_le_bytes(), &first_lease.to_le_bytes()]);
    for n in names {
        m.extend_from_slice(&(n.len() as u16).to_le_bytes());
        m.extend_from_slice(n);
    }
    m
}

/// A `SHARES` message of one share (lease `lease`, one descriptor).
fn shares_msg(lease: u64, enc: &[u8]) -> Vec<u8> {
    le(&[
        &11u32.to_le_bytes(),
        &1u32.to_le_bytes(),
        &lease.to_le_bytes(),
        &(enc.len() as u32).to_le_bytes(),
        &1u32.to_le_bytes(),
        enc,
    ])
}

#[test]
fn a_hostile_producers_names_are_checked_bounded_and_never_name_another_lease() {
    let (c, p) = fake_connection("hostile-names", 0);
    let name_of = |imp: &devshare::import::Import| imp.name().map(|n| n.to_str().unwrap().to_owned());
    let mem = sealed_memfd(4096);
    let enc = memfd_handle(4096, 4096);
    // A name for lease 5, then the share of lease 1: lease 1 has no name, and lease 5 gets its
    // own when it comes.
    p.send(&names_msg(5, &[b"five"]), &[]);
    p.send(&shares_msg(1, &enc), &[mem.as_fd()]);
    assert_eq!(name_of(&c.recv(T).unwrap()), None);
    p.send(&shares_msg(5, &enc), &[mem.as_fd()]);
    assert_eq!(name_of(&c.recv(T).unwrap()).as_deref(), Some("five"));
    // Names of shares that never came are dropped once later shares arrive: three rounds of
    // 4096 such names (more than the consumer holds at once) and a later share each.
    let unused: Vec<&[u8]> = vec![b"never"; 4096];
    for round in 0..3u64 {
        let first = 10 + round * 10_000;
        p.send(&names_msg(first, &unused), &[]);
        p.send(&shares_msg(first + 5000, &enc), &[mem.as_fd()]);
        assert_eq!(name_of(&c.recv(T).unwrap()), None, "round {round}");
    }
    // Bad names: a NUL, not UTF-8, longer than the limit, with descriptors.
    let long = vec![b'x'; devshare::channel::limits::DEVSHARE_MAX_NAME_LEN + 1];
    for (what, msg, fds) in [
        ("a NUL", names_msg(8, &[b"a\0b"]), vec![]),
        ("not UTF-8", names_msg(8, &[b"\xff"]), vec![]),
        ("too long", names_msg(8, &[&long]), vec![]),
        ("descriptors", names_msg(8, &[b"a"]), vec![mem.as_fd()]),
    ] {
        p.send(&msg, &fds);
        assert_eq!(status(c.recv(T)), Status::Untrusted, "{what}");
    }
    // More names than two messages of shares hold, before any share: refused, not kept.
    let many: Vec<&[u8]> = vec![b"n"; 4096];
    for i in 0..3u64 {
        p.send(&names_msg(100 + i * 4096, &many), &[]);
    }
    assert_eq!(status(c.recv(T)), Status::Untrusted, "a flood of names");
    // The connection still takes good shares afterwards.
    p.send(&shares_msg(50_000, &enc), &[mem.as_fd()]);
    assert_eq!(name_of(&c.recv(T).unwrap()), None);
}

#[test]
fn a_hostile_consumer_cannot_disturb_a_registration_or_another_consumers_leases() {
    let addr = address("hostile-consumer-registered");
    let ch = Channel::listen(&addr).unwrap();
    // A consumer that says it reads several shares per message and keeps registered mappings.
    let raw = raw_consumer(&addr, 1 | 4);
    ch.wait_peers(1, T).unwrap();
    let hostile = ch.peer_ids().unwrap()[0];
    let exp = Exporter::channel_host_alloc(4096).unwrap();
    ch.register(&exp).unwrap();
    let desc = TensorDesc { shape: &[4096], ..Default::default() };
    ch.send(hostile, &exp, &desc).unwrap();
    ch.send(hostile, &exp, &desc).unwrap();
    assert_eq!(exp.outstanding().unwrap(), 2);
    // It releases lease 1 twice and a lease it was never given, and never releases lease 2.
    let release = |lease: u64| le(&[&5u32.to_le_bytes(), &[0; 4], &lease.to_le_bytes()]);
    for lease in [1, 1, 99] {
        send_raw(raw.as_fd(), &release(lease), &[]);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while ch.peer_info(hostile).unwrap().protocol_errors < 2 && Instant::now() < deadline {
        ch.service(Some(Duration::from_millis(10))).unwrap();
    }
    assert_eq!(ch.peer_info(hostile).unwrap().protocol_errors, 2, "the second release and the unknown lease");
    assert_eq!(exp.outstanding().unwrap(), 1, "lease 2 is still out with it; lease 1 came back once");
    // A well-behaved consumer gets the registered export as before, keeps it mapped, and its
    // release is counted; the registration is still there to undo.
    let good = std::thread::scope(|s| {
        let c = s.spawn(|| Connection::connect(&addr, T).unwrap());
        ch.wait_peers(2, T).unwrap();
        c.join().unwrap()
    });
    let peer = *ch.peer_ids().unwrap().iter().find(|&&p| p != hostile).unwrap();
    for _ in 0..3 {
        ch.send(peer, &exp, &desc).unwrap();
        let imp = good.recv(T).unwrap();
        // SAFETY: 4096 readable bytes.
        assert_eq!(unsafe { *imp.view().data }, unsafe { *exp.ptr() });
        imp.release();
        while exp.outstanding().unwrap() > 1 && Instant::now() < deadline {
            ch.service(Some(Duration::from_millis(10))).unwrap();
        }
        assert_eq!(exp.outstanding().unwrap(), 1, "the good consumer's lease came back");
    }
    assert!(
        devshare::import::kept_idle().0 + devshare::import::pinned().0 >= 1,
        "the good consumer keeps the registered allocation"
    );
    ch.unregister(&exp).unwrap();
    // The hostile consumer's lease comes back when it goes.
    drop(raw);
    while exp.outstanding().unwrap() > 0 && Instant::now() < deadline {
        ch.service(Some(Duration::from_millis(10))).unwrap();
    }
    assert_eq!(exp.outstanding().unwrap(), 0);
}

#[test]
fn a_thousand_leases_given_back_in_one_call_reach_a_producer_that_was_not_reading() {
    // One RELEASE per lease filled the producer's socket after a few hundred while it was not
    // reading, and the rest waited in the consumer's backlog for its next call: a consumer
    // that gave a big batch back and then did something else held the producer up.
    let addr = address("give-back-all");
    let (ch, c, peer) = connected(&addr);
    let exp = Exporter::channel_host_alloc(4096).unwrap();
    let batch: Vec<_> = (0..1000).map(|_| (&exp, TensorDesc { shape: &[16], ..Default::default() })).collect();
    ch.send_batch(peer, &batch).unwrap();
    let imps: Vec<_> = (0..1000).map(|_| c.recv(T).unwrap()).collect();
    assert_eq!(exp.outstanding().unwrap(), 1000);
    Connection::give_back_all(&imps);
    Connection::give_back_all(&imps); // given back already: nothing more is sent
                                      // The consumer makes no further call; serving the channel takes every lease back.
    exp.wait(Some(Duration::from_secs(3))).unwrap();
    assert_eq!(ch.peer_info(peer).unwrap().protocol_errors, 0);
    drop(imps); // unmapped; nothing is sent again
    ch.service(Some(Duration::from_millis(50))).unwrap();
    assert_eq!(ch.peer_info(peer).unwrap().protocol_errors, 0);
}

#[test]
fn a_hostile_consumers_releases_give_back_only_what_it_holds() {
    let addr = address("hostile-releases");
    let ch = Channel::listen(&addr).unwrap();
    let raw = raw_consumer(&addr, 1); // reads SHARES
    ch.wait_peers(1, T).unwrap();
    let peer = ch.peer_ids().unwrap()[0];
    let welcome = recv_raw(raw.as_fd());
    assert_eq!(u32::from_le_bytes(welcome[..4].try_into().unwrap()), 2);
    assert_eq!(u16::from_le_bytes(welcome[10..12].try_into().unwrap()) & 1, 1, "the producer reads RELEASES");
    let exp = Exporter::channel_host_alloc(4096).unwrap();
    let desc = TensorDesc { shape: &[16], ..Default::default() };
    ch.send_batch(peer, &[(&exp, desc.clone()), (&exp, desc.clone()), (&exp, desc)]).unwrap();
    let (shares, _fds) = recv_with_fds(raw.as_fd());
    assert_eq!(u32::from_le_bytes(shares[4..8].try_into().unwrap()), 3);
    let first = u64::from_le_bytes(shares[8..16].try_into().unwrap());
    let releases = |count: u32, leases: &[u64]| {
        let ids: Vec<u8> = leases.iter().flat_map(|l| l.to_le_bytes()).collect();
        le(&[&16u32.to_le_bytes(), &count.to_le_bytes(), &[0; 4], &ids])
    };
    send_raw(raw.as_fd(), &releases(2, &[first, first + 99]), &[]); // one never leased
    send_raw(raw.as_fd(), &releases(2, &[first + 1, first + 1]), &[]); // the same twice
    send_raw(raw.as_fd(), &releases(0, &[]), &[]); // none
    send_raw(raw.as_fd(), &releases(2, &[first + 2]), &[]); // fewer than it says
    send_raw(raw.as_fd(), &releases(8193, &[]), &[]); // more than a message may hold
    send_raw(raw.as_fd(), &releases(1, &[first + 2, first + 2]), &[]); // more than it says
    let deadline = Instant::now() + Duration::from_secs(10);
    while ch.peer_info(peer).unwrap().protocol_errors < 6 && Instant::now() < deadline {
        ch.service(Some(Duration::from_millis(10))).unwrap();
    }
    let info = ch.peer_info(peer).unwrap();
    assert_eq!(info.protocol_errors, 6);
    // What it held came back (once each); the malformed messages gave nothing back.
    assert_eq!((exp.outstanding().unwrap(), info.leases), (1, 1));
    send_raw(raw.as_fd(), &releases(1, &[first + 2]), &[]);
    exp.wait(T).unwrap();
}

#[test]
fn a_spinning_wait_takes_each_lease_back_and_sleeps_once_its_spin_or_its_timeout_is_over() {
    let (ch, c, peer) = connected(&address("spin-wait"));
    assert_eq!(status(ch.set_spin(Duration::from_micros(1_000_001))), Status::InvalidArgument);
    ch.set_spin(Duration::from_secs(1)).unwrap();
    let exp = Exporter::channel_host_alloc(4096).unwrap();
    ch.register(&exp).unwrap();
    let desc = TensorDesc { shape: &[64], storage_offset: 128, ..Default::default() };
    // The consumer takes each lease, checks its bytes, holds it as long as it is told, releases.
    let (tx, rx) = std::sync::mpsc::channel::<(u8, Duration)>();
    let consumer = std::thread::spawn(move || {
        for (value, hold) in rx {
            let imp = c.recv(T).unwrap();
            // SAFETY: 64 readable bytes.
            assert!(unsafe { std::slice::from_raw_parts(imp.view().data, 64) }.iter().all(|&b| b == value));
            std::thread::sleep(hold);
            imp.release();
        }
        c
    });
    let send = |value: u8, hold: Duration| {
        // SAFETY: the producer's own bytes, no lease out.
        unsafe { std::ptr::write_bytes(exp.ptr().add(128), value, 64) };
        ch.send(peer, &exp, &desc).unwrap();
        tx.send((value, hold)).unwrap();
    };
    // Within the spin: every lease comes back (after the first, through the consumer's ring).
    for round in 0..2000u32 {
        send((round % 251) as u8, Duration::ZERO);
        exp.wait(T).unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert_eq!(exp.outstanding().unwrap(), 0);
    }
    // Within a long spin the wait polls: it burns its CPU while the lease is held (the margin
    // is for a loaded machine, where a spinner runs part of the time; a sleeping wait uses a
    // few ms at most).
    let (t, cpu) = (Instant::now(), thread_cpu());
    send(3, Duration::from_millis(200));
    exp.wait(T).unwrap();
    let (held, spun) = (t.elapsed(), thread_cpu() - cpu);
    assert!(held >= Duration::from_millis(200), "the wait ended before the release");
    assert!(spun >= Duration::from_millis(40), "a 1 s spin used {spun:?} of CPU in a {held:?} wait");
    // Past a short spin the wait sleeps (no CPU to speak of), and the release still ends it.
    ch.set_spin(Duration::from_millis(1)).unwrap();
    let (t, cpu) = (Instant::now(), thread_cpu());
    send(1, Duration::from_millis(200));
    exp.wait(T).unwrap();
    let (held, spun) = (t.elapsed(), thread_cpu() - cpu);
    assert!(held >= Duration::from_millis(200), "the wait ended before the release");
    assert!(spun < Duration::from_millis(100), "a 1 ms spin used {spun:?} of CPU in a {held:?} wait");
    // A timeout shorter than the spin ends the spin: a lease held longer times the wait out.
    ch.set_spin(Duration::from_secs(1)).unwrap();
    send(2, Duration::from_millis(1500));
    let t = Instant::now();
    assert_eq!(status(exp.wait(Some(Duration::from_millis(50)))), Status::Timeout);
    assert!(t.elapsed() < Duration::from_millis(900), "a 50 ms wait spun for {:?}", t.elapsed());
    exp.wait(T).unwrap();
    drop(tx);
    drop(consumer.join().unwrap());
    assert_eq!(ch.peer_info(peer).unwrap().protocol_errors, 0);
}

#[test]
fn a_spinning_acquire_that_took_a_return_s_wake_up_leaves_the_channel_fd_to_wake_for_the_next_return() {
    // An event loop polls the channel's descriptor and serves it when it is readable
    // (docs/concepts.md). A spinning call that takes a ring's wake-up off the epoll set (its
    // look at the sockets, every 64th turn) must leave the ring armed: otherwise the consumer
    // finds its `pending` word still set by that wake-up, writes no other, and a later return
    // leaves the descriptor silent. (Waits for leases spin through the same serve.)
    let (ch, c, peer) = connected(&address("spin-rearm"));
    let exp = Arc::new(Exporter::channel_host_alloc(3 * 4096).unwrap());
    let pool = ch.pool(exp.clone(), 4096, 3).unwrap();
    pool.set_spin(Duration::from_secs(1)).unwrap();
    for _ in 0..3 {
        let (slot, _) = pool.acquire(T).unwrap();
        pool.send(slot, peer, &TensorDesc { shape: &[64], ..Default::default() }).unwrap();
    }
    let (released, first) = std::sync::mpsc::channel::<()>();
    let (go, last) = std::sync::mpsc::channel::<()>();
    let consumer = std::thread::spawn(move || {
        let mut imps: Vec<_> = (0..3).map(|_| c.recv(T).unwrap()).collect();
        let third = imps.pop().unwrap();
        let second = imps.pop().unwrap();
        imps.pop().unwrap().release(); // a wake-up: the ring is armed
        released.send(()).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        second.release(); // while the producer spins for it
        last.recv().unwrap();
        third.release(); // the event loop's
        c
    });
    ch.service(Some(Duration::ZERO)).unwrap(); // arms the ring, as an event loop's call does
    first.recv().unwrap();
    // The first slot is back (taken at once); the next acquire spins for the second, and its
    // 64th turn takes the first's wake-up off the epoll set.
    let (a, _) = pool.acquire(T).unwrap();
    let (b, _) = pool.acquire(T).unwrap();
    // The event loop's turn: it sleeps until the descriptor is readable.
    go.send(()).unwrap();
    let mut pfd = libc::pollfd { fd: ch.fd().as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    let ready = unsafe { libc::poll(&mut pfd, 1, 5_000) };
    assert_eq!(ready, 1, "a return after a spinning acquire did not make the channel's descriptor readable");
    drop(consumer.join().unwrap());
    pool.release(a).unwrap();
    pool.release(b).unwrap();
}

/// CPU time this thread has used.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to write.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[test]
fn a_wait_spinning_for_one_channel_takes_the_return_of_a_lease_out_on_another_channel() {
    // An export leased through a spinning channel A and a sleeping one B: B's consumer gives
    // its lease back after 20 ms, and the wait ends then, not after A's 1 s spin.
    let (a, ca, peer_a) = connected(&address("spin-a"));
    let (b, cb, peer_b) = connected(&address("spin-b"));
    a.set_spin(Duration::from_secs(1)).unwrap();
    let exp = Exporter::channel_host_alloc(4096).unwrap();
    let desc = TensorDesc { shape: &[64], ..Default::default() };
    a.send(peer_a, &exp, &desc).unwrap();
    b.send(peer_b, &exp, &desc).unwrap();
    let consumers = std::thread::spawn(move || {
        ca.recv(T).unwrap().release();
        let imp = cb.recv(T).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        imp.release();
        (ca, cb)
    });
    let t = Instant::now();
    exp.wait(T).unwrap();
    let waited = t.elapsed();
    drop(consumers.join().unwrap());
    assert!(waited < Duration::from_millis(600), "B's return waited for A's spin: {waited:?}");
    assert_eq!(exp.outstanding().unwrap(), 0);
}

/// What a peer that shares a ring eventfd's open file description can do to it: make it
/// blocking again and fill its counter, after which a write of 1 blocks until someone reads it.
fn jam(fd: &OwnedFd) {
    let fl = rustix::fs::fcntl_getfl(fd).unwrap();
    rustix::fs::fcntl_setfl(fd, fl - rustix::fs::OFlags::NONBLOCK).unwrap();
    let _ = rustix::io::read(fd, &mut [0u8; 8]);
    rustix::io::write(fd, &(u64::MAX - 1).to_ne_bytes()).unwrap();
}

#[test]
fn a_consumer_that_makes_its_ring_eventfd_blocking_and_full_cannot_stall_the_producer() {
    let addr = address("ring-jam-producer");
    let ch = Channel::listen(&addr).unwrap();
    let raw = raw_consumer(&addr, 1 | 64); // several shares per message, and the ring of 1.16
    ch.wait_peers(1, T).unwrap();
    let peer = ch.peer_ids().unwrap()[0];
    let _welcome = recv_raw(raw.as_fd());
    let exp = Arc::new(Exporter::channel_host_alloc(4096 * 4).unwrap());
    let pool = ch.pool(exp.clone(), 4096, 4).unwrap();
    let desc = TensorDesc { shape: &[4096], ..Default::default() };
    let (s, _) = pool.acquire(T).unwrap();
    pool.send(s, peer, &desc).unwrap();
    let (_attach, _) = recv_with_fds(raw.as_fd());
    let (_ring, fds) = recv_with_fds(raw.as_fd());
    assert_eq!(fds.len(), 3);
    let ring = RawRing::map(fds[0].as_fd());
    jam(&fds[1]); // the eventfd that wakes the consumer, which the producer writes
    ring.word(ITEM_HEAD).store(1, Ordering::SeqCst); // took the item
    ring.word(C_PENDING).store(0, Ordering::SeqCst); // asleep: wake me for the next one
                                                     // The producer's next item wakes the consumer (a write to the jammed eventfd, under the
                                                     // channel's lock); another thread's call on the channel waits for that lock.
    let (ch, pool) = (Arc::new(ch), Arc::new(pool));
    let sent = within_10s({
        let pool = pool.clone();
        move || {
            let (s, _) = pool.acquire(T).unwrap();
            pool.send(s, peer, &TensorDesc { shape: &[4096], ..Default::default() }).is_ok()
        }
    });
    let other = within_10s({
        let ch = ch.clone();
        move || ch.peer_ids().is_ok()
    });
    assert!(sent(), "the producer's send returned, its item in the ring");
    assert!(other(), "another thread's call on the channel returned");
    assert_eq!(ring.word(ITEM_TAIL).load(Ordering::SeqCst), 2, "the second item went into the ring");
    assert_ne!(ring.word(C_PENDING).load(Ordering::SeqCst), 0, "and the consumer was told");
}

/// A consumer whose producer sent it a ring (its memory and both eventfds kept by the test):
/// the fake producer, the ring's memory mapped, the consumer's and the producer's eventfds.
fn ring_consumer(tag: &str) -> (Connection, FakeProducer, RawRing, OwnedFd, OwnedFd, [OwnedFd; 2]) {
    let (c, p) = fake_connection(tag, 0);
    let pool_fd = sealed_memfd(4 * 4096);
    p.send(&attach_msg(1, 4096, 4, &memfd_handle(4 * 4096, 4 * 4096)), &[pool_fd.as_fd()]);
    let mem = sealed_memfd(RING_SIZE as u64);
    let ring = RawRing::map(mem.as_fd());
    ring.word(0).store(u64::from_le_bytes(*b"DSRING01"), Ordering::SeqCst);
    // As a producer of 1.16 makes them: a count of 1.
    let efd = || rustix::event::eventfd(1, rustix::event::EventfdFlags::CLOEXEC).unwrap();
    let (c_efd, p_efd) = (efd(), efd());
    let ring_msg = le(&[&12u32.to_le_bytes(), &1024u32.to_le_bytes(), &256u32.to_le_bytes()]);
    p.send(&ring_msg, &[mem.as_fd(), c_efd.as_fd(), p_efd.as_fd()]);
    assert_eq!(status(c.recv(Some(Duration::from_millis(200)))), Status::Timeout, "the ring is taken");
    (c, p, ring, c_efd, p_efd, [mem, pool_fd])
}

#[test]
fn a_producer_that_makes_the_ring_eventfds_blocking_and_full_cannot_stall_release_recv_fd_or_close() {
    // A release that wakes the producer (a write to the producer's jammed eventfd).
    let (c, p, ring, _c_efd, p_efd, _keep) = ring_consumer("ring-jam-release");
    p.send(&item_msg(1, 0, 0, 64), &[]);
    let item = c.recv(T).unwrap();
    assert_eq!(item.pool_slot(), Some((1, 0)));
    jam(&p_efd);
    assert_eq!(ring.word(P_PENDING).load(Ordering::SeqCst), 0, "the producer asleep: the return wakes it");
    let released = within_10s(move || {
        item.release();
        c
    });
    let c = released();
    assert_ne!(ring.word(P_PENDING).load(Ordering::SeqCst), 0, "the producer was told");
    assert_eq!(ring.word(RET_TAIL).load(Ordering::SeqCst), 1, "the slot went back through the ring");
    drop((c, p));
    // The consumer's own wake-ups (the descriptor an event loop polls, a receive that leaves
    // items behind) write the consumer's jammed eventfd; close waits for the receive's lock.
    let (c, p, ring, c_efd, _p_efd, _keep) = ring_consumer("ring-jam-recv");
    jam(&c_efd);
    let c = Arc::new(c);
    let fd = within_10s({
        let c = c.clone();
        move || std::os::fd::AsRawFd::as_raw_fd(&c.fd())
    });
    assert!(fd() >= 0, "fd() returned");
    for i in 0..2u32 {
        let m = item_msg(1, i, 0, 64);
        ring.put_item(i as usize, 2, &m, m.len() as u64); // after ATTACH and RING
    }
    ring.word(ITEM_TAIL).store(2, Ordering::SeqCst);
    let got = within_10s({
        let c = c.clone();
        move || c.recv(Some(Duration::from_secs(3))).map(|i| i.pool_slot())
    });
    assert_eq!(got().unwrap(), Some((1, 0)), "the receive returned the first item, the second left waiting");
    let closed = within_10s(move || c.close());
    closed();
    drop(p);
}

/// A TCP socket whose close blocks for `secs` seconds: its peer never reads, its buffers are
/// full, and it lingers over the unsent data.
fn lingering_socket(secs: i32) -> (OwnedFd, std::net::TcpStream) {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut cli = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (srv, _) = l.accept().unwrap();
    cli.set_nonblocking(true).unwrap();
    let chunk = vec![0u8; 1 << 16];
    while cli.write(&chunk).is_ok() {}
    cli.set_nonblocking(false).unwrap();
    let linger = libc::linger { l_onoff: 1, l_linger: secs };
    // SAFETY: a valid socket and an option value of its size.
    let rc = unsafe {
        libc::setsockopt(
            cli.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as u32,
        )
    };
    assert_eq!(rc, 0);
    (cli.into(), srv)
}

/// The other way round: a hostile producer sends its consumer, as a share's memory, a
/// descriptor whose close blocks: a socket lingering 10 s over unsent data, then a Unix socket
/// whose receive queue holds the only reference to such a socket (closing the outer one drops
/// the inner). Each share is refused and the receive still ends within its time limit; then a
/// right share with a socket beside it is refused too; the next share arrives (before 1.16.1
/// the consumer closed them inside the receive, which waited the 10 s; setting `SO_LINGER` 0 on
/// what arrives alone left the nested case waiting).
#[test]
fn a_descriptor_whose_close_blocks_costs_the_consumers_receive_no_time() {
    let (c, p) = fake_connection("linger-consumer", 0);
    for (lease, nested) in [(1u64, false), (2, true)] {
        let (sock, _srv) = lingering_socket(10);
        let sent = if nested {
            let (u0, u1) = rustix::net::socketpair(
                rustix::net::AddressFamily::UNIX,
                rustix::net::SocketType::STREAM,
                rustix::net::SocketFlags::CLOEXEC,
                None,
            )
            .unwrap();
            send_raw(u1.as_fd(), b"x", &[sock.as_fd()]);
            drop(sock); // the Unix socket's queue holds the only reference now
            u0
        } else {
            sock
        };
        p.send(&share_msg(lease, &memfd_handle(4096, 4096)), &[sent.as_fd()]);
        drop(sent);
        let t = Instant::now();
        let refused = c.recv(Some(Duration::from_secs(1))).err().map(|e| e.status());
        let took = t.elapsed();
        assert!(refused.is_some(), "a socket is no share's memory (nested: {nested})");
        assert!(took < Duration::from_secs(5), "the receive took {took:?} (nested: {nested}): it waited for the close");
    }
    // A right share with a socket beside its memfd: refused whole (taking the socket out must
    // not make it a valid message).
    let mfd = sealed_memfd(4096);
    let (sock, _srv) = lingering_socket(0);
    p.send(&share_msg(3, &memfd_handle(4096, 4096)), &[mfd.as_fd(), sock.as_fd()]);
    drop(sock);
    let status = c.recv(Some(Duration::from_secs(1))).err().map(|e| e.status());
    assert_eq!(status, Some(Status::Untrusted), "a share that came with a socket is refused");
    p.send(&share_msg(4, &memfd_handle(4096, 4096)), &[mfd.as_fd()]);
    let imp = c.recv(T).unwrap();
    assert!(!imp.view().data.is_null(), "the next share arrives");
}

/// A hostile producer sends its consumer, as a share's memory, a descriptor of a file on a
/// FUSE file system it serves and never answers (`common::fuse`): the `fstat` of it would wait
/// for the server's `GETATTR` answer, its close for the `FLUSH` answer, both for ever. The share is
/// refused at once (the kind of file is asked with `AT_STATX_DONT_SYNC`, and it is closed on a
/// thread of its own); the next share arrives; and a child still starts. (Before 1.18.3 the
/// receive's `fstat`, which looked for sockets, waited for as long as the server liked.)
#[test]
fn a_file_whose_server_never_answers_costs_the_consumers_receive_no_time() {
    let (c, p) = fake_connection("fuse-consumer", 0);
    let c = Arc::new(c);
    // Declared after the connection, so dropped (its server killed) before it: should the
    // receive wait for the server, the connection's close would otherwise wait with it.
    let Some(server) = common::fuse::Stalling::start("fuse_server_role") else { return };
    for lease in [1, 2] {
        p.send(&share_msg(lease, &memfd_handle(4096, 4096)), &[server.open()]);
        let refused = within_10s({
            let c = c.clone();
            move || c.recv(Some(Duration::from_secs(1))).err().map(|e| (e.status(), e.to_string()))
        });
        let (status, why) = refused().expect("a FUSE file is no share's memory");
        assert_eq!(status, Status::Untrusted, "{why}");
        assert!(why.contains("not shared memory"), "{why}");
    }
    let mfd = sealed_memfd(4096);
    p.send(&share_msg(3, &memfd_handle(4096, 4096)), &[mfd.as_fd()]);
    let next = within_10s({
        let c = c.clone();
        move || c.recv(T).map(|imp| !imp.view().data.is_null())
    });
    assert!(next().unwrap(), "the next share arrives");
    // The two refused files left this process's table (each close waits on a thread of its
    // own): a child's `exec`, which closes what is left, does not wait for the server. (Behind
    // one closing thread the second stayed in the table until 1.18.3's last change, and this
    // spawn waited for the server.)
    server.let_go();
    assert!(server.none_open(), "every descriptor of the FUSE file system left this process's table");
    let spawned = within_10s(|| std::process::Command::new("true").status().map(|s| s.success()));
    assert!(spawned().unwrap(), "a child started while the server still stalls");
}

/// The same server's node `c` is a device (the kind NVIDIA's exported memory is), whose inode
/// is still the server's: its `fstat` waits for the server's `GETATTR` answer. Sent as a ring's
/// memory (beside two good eventfds):
///
/// - named only (`O_PATH`, which even a `nodev` mount allows): refused at the receive, with the
///   message, as no honest message carries one (kept as a device, it came as far as the ring);
/// - opened: kept as a device, and the ring refuses it at once, its seals read before its
///   `fstat` (before 1.18.3 the `fstat` came first and waited for the server).
#[test]
fn a_device_node_of_such_a_file_system_sent_as_a_ring_costs_the_receive_no_time() {
    let (c, p) = fake_connection("fuse-ring", 0);
    let c = Arc::new(c);
    let Some(server) = common::fuse::Stalling::start("fuse_server_role") else { return };
    let efd = || rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap();
    let (c_efd, p_efd) = (efd(), efd());
    let ring_msg = le(&[&12u32.to_le_bytes(), &1024u32.to_le_bytes(), &256u32.to_le_bytes()]);
    for (o_path, said) in
        [(true, "came with a file that is not shared memory"), (false, "ring's memory is not a tmpfs memfd")]
    {
        p.send(&ring_msg, &[server.open_device(o_path), c_efd.as_fd(), p_efd.as_fd()]);
        let refused = within_10s({
            let c = c.clone();
            move || c.recv(Some(Duration::from_secs(1))).err().map(|e| (e.status(), e.to_string()))
        });
        let (status, why) = refused().expect("a device node of a FUSE mount is no ring");
        assert_eq!(status, Status::Untrusted, "O_PATH {o_path}: {why}");
        assert!(why.contains(said), "O_PATH {o_path}: {why}");
    }
}

/// The FUSE server of the two tests above, in its child process.
#[test]
#[ignore = "a role of the test above, run in a child process"]
fn fuse_server_role() {
    common::fuse::serve();
}

#[test]
fn a_descriptor_a_consumer_sends_is_closed_outside_the_channels_lock() {
    // Queued before the producer accepts the connection (so that it arrives on any kernel),
    // beside a RELEASE: a descriptor whose close blocks for 2 s. The producer counts the error
    // and closes it without holding the channel's lock: another thread's calls go on meanwhile.
    let addr = address("linger");
    let ch = Arc::new(Channel::listen(&addr).unwrap());
    let raw = raw_consumer(&addr, 1);
    let (sock, _srv) = lingering_socket(2);
    send_raw(raw.as_fd(), &le(&[&5u32.to_le_bytes(), &[0; 4], &1u64.to_le_bytes()]), &[sock.as_fd()]);
    drop(sock);
    let serving = std::thread::spawn({
        let ch = ch.clone();
        move || {
            ch.wait_peers(1, T).unwrap();
            for _ in 0..20 {
                let _ = ch.service(Some(Duration::from_millis(10)));
            }
        }
    });
    // Calls on the channel from this thread meanwhile: none waits for the close.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut longest = Duration::ZERO;
    let mut timed = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        f();
        longest = longest.max(t.elapsed());
        std::thread::sleep(Duration::from_millis(5));
    };
    let mut peer = None;
    while peer.is_none() {
        assert!(Instant::now() < deadline, "the consumer was not admitted");
        timed(&mut || peer = ch.peer_ids().unwrap().first().copied());
    }
    let peer = peer.unwrap();
    let mut errors = 0;
    while errors == 0 {
        assert!(Instant::now() < deadline, "the descriptor was not refused");
        timed(&mut || errors = ch.peer_info(peer).unwrap().protocol_errors);
    }
    for _ in 0..40 {
        // (The close would take 2 s; since 1.16.1 the socket is also made to close at once.)
        timed(&mut || errors = ch.peer_info(peer).unwrap().protocol_errors);
    }
    serving.join().unwrap();
    assert!(longest < Duration::from_millis(1000), "a call waited {longest:?} for the channel's lock");
    // From now on: where the kernel refuses descriptors on this socket (Linux 6.16), sending one
    // fails at the consumer; elsewhere it arrives and is refused like the first.
    let (sock, _srv) = lingering_socket(0);
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = rustix::net::SendAncillaryBuffer::new(&mut space);
    let fds = [sock.as_fd()];
    assert!(control.push(rustix::net::SendAncillaryMessage::ScmRights(&fds)));
    let msg = le(&[&5u32.to_le_bytes(), &[0; 4], &2u64.to_le_bytes()]);
    let sent = rustix::net::sendmsg(raw.as_fd(), &[IoSlice::new(&msg)], &mut control, rustix::net::SendFlags::NOSIGNAL);
    ch.service(Some(Duration::from_millis(100))).unwrap();
    let errors = ch.peer_info(peer).unwrap().protocol_errors;
    // Whether this kernel knows SO_PASSRIGHTS (83): a socket of its own answers for it.
    let probe = seqpacket();
    let mut on: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: a valid socket, an option value of the size given.
    let known = unsafe {
        libc::getsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&probe),
            libc::SOL_SOCKET,
            83,
            (&mut on as *mut libc::c_int).cast(),
            &mut len,
        )
    } == 0;
    if known {
        assert_eq!(sent.err(), Some(rustix::io::Errno::PERM), "refused by the kernel at the consumer's end");
    } else {
        assert_eq!(errors, 2, "refused by the producer");
    }
}

/// This process's virtual size and resident memory, in bytes.
fn vm_and_rss() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let field = |name: &str| -> u64 {
        let l = s.lines().find(|l| l.starts_with(name)).unwrap();
        l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
    };
    (field("VmSize:"), field("VmRSS:"))
}

#[test]
fn a_pinned_window_counts_the_whole_allocation_it_keeps_mapped_against_the_bounds() {
    // In a child process of its own: the process's pinned counts are read exactly.
    child_role_passes("pinned_counts_child", ("DEVSHARE_TEST_PINNED_COUNTS", "1"));
}

/// Run the ignored test `role` of this binary in a child process with `env` set, and check that
/// it ran and passed.
fn child_role_passes(role: &str, env: (&str, &str)) {
    let out = common::role(role, &[(env.0, env.1.as_ref())]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains(&format!("test {role} ... ok")) && text.contains("1 passed"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The test above, in its child process.
#[test]
#[ignore = "a role of the test above, run in a child process"]
fn pinned_counts_child() {
    if std::env::var_os("DEVSHARE_TEST_PINNED_COUNTS").is_none() {
        return;
    }
    // A hostile producer offers 4 KiB windows of sparse 1 TiB memfds: each pin would keep 1 TiB
    // of address space mapped. Counted as 1 TiB (past the 64 GiB bound), none is pinned, and
    // once released nothing of them stays mapped (128 of them would exhaust the address space).
    let (c, p) = pinning_consumer("pin-whole-allocation");
    const TIB: u64 = 1 << 40;
    let (vm0, _) = vm_and_rss();
    let enc = memfd_handle(TIB, 4096);
    for i in 1..=16u64 {
        let fd = sealed_memfd(TIB);
        p.send(&pin_shares_msg(i, 1000 + i, i, 0, 4096, &enc), &[fd.as_fd()]);
        c.recv(T).unwrap().release();
        released(&p, i); // (no PINNED before it: declined)
    }
    let (vm, _) = vm_and_rss();
    assert!(vm.saturating_sub(vm0) < 64 << 30, "{} GiB stayed mapped for the producer", (vm - vm0) >> 30);
    assert_eq!(devshare::import::pinned(), (0, 0), "nothing pinned");
    // Windows of one allocation count its bytes once: two pins of one 1 MiB memfd.
    let fd = sealed_memfd(1 << 20);
    let enc = memfd_handle(1 << 20, 4096);
    for (lease, export) in [(17u64, 2001u64), (18, 2002)] {
        p.send(&pin_shares_msg(lease, export, lease, 0, 4096, &enc), &[fd.as_fd()]);
        c.recv(T).unwrap().release();
        let m = recv_raw(p.conn.as_fd());
        assert_eq!(msg_type(&m), 18, "PINNED for export {export}");
        released(&p, lease);
    }
    assert_eq!(devshare::import::pinned(), (2, 1 << 20), "two windows, one allocation's bytes");
    p.send(&le(&[&14u32.to_le_bytes(), &2001u64.to_le_bytes()]), &[]); // RETIRE
    assert_eq!(status(c.recv(Some(Duration::from_millis(100)))), Status::Timeout);
    assert_eq!(devshare::import::pinned(), (1, 1 << 20), "the allocation still counts for the other window");
    p.send(&le(&[&14u32.to_le_bytes(), &2002u64.to_le_bytes()]), &[]);
    assert_eq!(status(c.recv(Some(Duration::from_millis(100)))), Status::Timeout);
    assert_eq!(devshare::import::pinned(), (0, 0));
}

#[test]
fn an_export_shared_again_from_another_allocation_retires_the_first() {
    let (c, p) = fake_connection("rebind", 0);
    let enc = memfd_handle(4096, 4096);
    let (a, b) = (sealed_memfd(4096), sealed_memfd(4096));
    p.send(&kept_shares_msg(1, &[(1, 5, &enc)]), &[a.as_fd()]);
    let imp = c.recv(T).unwrap();
    let ino_a = inode_at(imp.view().base as usize);
    imp.release();
    assert_eq!(mappings_of(ino_a), 1, "kept mapped after its release");
    p.send(&kept_shares_msg(2, &[(1, 5, &enc)]), &[b.as_fd()]);
    let imp = c.recv(T).unwrap();
    let ino_b = inode_at(imp.view().base as usize);
    assert_eq!(mappings_of(ino_a), 0, "export 5's first allocation is let go when it names another");
    imp.release();
    drop((a, b));
    p.send(&le(&[&14u32.to_le_bytes(), &5u64.to_le_bytes()]), &[]); // RETIRE
    assert_eq!(status(c.recv(Some(Duration::from_millis(200)))), Status::Timeout);
    assert_eq!(mappings_of(ino_b), 0, "the export's current allocation is unmapped");
}

#[test]
fn an_export_shared_again_from_another_allocation_lets_its_pinned_window_go_too() {
    let (c, p) = pinning_consumer("stale-pin");
    let enc = memfd_handle(4096, 4096);
    let (a, b) = (sealed_memfd(4096), sealed_memfd(4096));
    rustix::io::pwrite(&a, &[0xAA; 16], 0).unwrap();
    rustix::io::pwrite(&b, &[0xBB; 16], 0).unwrap();
    p.send(&pin_shares_msg(1, 5, 1, 0, 4096, &enc), &[a.as_fd()]);
    let imp = c.recv(T).unwrap();
    let ino_a = inode_at(imp.view().base as usize);
    imp.release();
    assert_eq!(msg_type(&recv_raw(p.conn.as_fd())), 18, "PINNED");
    released(&p, 1);
    p.send(&pin_shares_msg(2, 5, 0, 0, 0, &enc), &[b.as_fd()]); // export 5, now of B
    let imp = c.recv(T).unwrap();
    // SAFETY: 16 readable bytes.
    assert_eq!(unsafe { std::slice::from_raw_parts(imp.view().data, 16) }, &[0xBB; 16]);
    imp.release();
    released(&p, 2);
    // A lease of export 5 as if its window were still pinned: refused, never a view of A.
    p.send(&lease_msg(5, 3, 0, 16), &[]);
    let got = c.recv(T);
    assert_eq!(mappings_of(ino_a), 0, "export 5's first allocation, pinned window included, is let go");
    match got {
        Ok(imp) => panic!("a lease of export 5 read {:?} from a window let go", unsafe {
            // SAFETY: 16 readable bytes.
            std::slice::from_raw_parts(imp.view().data, 16)
        }),
        Err(e) => assert_eq!(e.status(), Status::Untrusted, "{e}"),
    }
}

#[test]
fn export_numbers_a_producer_makes_up_do_not_grow_the_consumer_without_bound() {
    let (c, p) = fake_connection("kept-ids", 0);
    // What the consumer sends back (releases) is read, so that nothing backs up.
    let reader = rustix::io::fcntl_dupfd_cloexec(&p.conn, 0).unwrap();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 17];
        while rustix::io::read(&reader, &mut buf).is_ok_and(|n| n > 0) {}
    });
    let enc = memfd_handle(4096, 4096);
    let fd = sealed_memfd(4096);
    const PER: usize = 250;
    let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(PER))];
    let fds: Vec<BorrowedFd<'_>> = (0..PER).map(|_| fd.as_fd()).collect();
    let mut lease = 1u64;
    // Every share of a new export number, never retired.
    let mut shares = |messages: usize| {
        for _ in 0..messages {
            let entries: Vec<(u32, u64, &[u8])> = (0..PER as u64).map(|j| (1u32, lease + j, &enc[..])).collect();
            let mut control = rustix::net::SendAncillaryBuffer::new(&mut space);
            assert!(control.push(rustix::net::SendAncillaryMessage::ScmRights(&fds)));
            let m = kept_shares_msg(lease, &entries);
            rustix::net::sendmsg(&p.conn, &[IoSlice::new(&m)], &mut control, rustix::net::SendFlags::NOSIGNAL).unwrap();
            for _ in 0..PER {
                c.recv(T).unwrap().release();
            }
            lease += PER as u64;
        }
    };
    shares(400); // 100,000 export numbers: past the bound
    let (_, rss0) = vm_and_rss();
    shares(400); // 100,000 more
    let (_, rss1) = vm_and_rss();
    // Unbounded, each number kept its allocation's key: about 20 MiB per 100,000.
    assert!(rss1.saturating_sub(rss0) < 4 << 20, "the consumer grew by {} KiB", (rss1 - rss0) >> 10);
}

/// The longest of this thread's `peer_ids()` calls while another thread serves the channel
/// for a while (20 services of up to 10 ms, and whatever closing what they took costs).
fn longest_call_while_serving(ch: &Arc<Channel>) -> Duration {
    let serving = std::thread::spawn({
        let ch = ch.clone();
        move || {
            for _ in 0..20 {
                let _ = ch.service(Some(Duration::from_millis(10)));
            }
        }
    });
    let mut longest = Duration::ZERO;
    let until = Instant::now() + Duration::from_millis(2500);
    while Instant::now() < until {
        let t = Instant::now();
        let _ = ch.peer_ids();
        longest = longest.max(t.elapsed());
        std::thread::sleep(Duration::from_millis(5));
    }
    serving.join().unwrap();
    longest
}

/// Send `msg` on `raw` with a descriptor whose close blocks for 2 s (our copy closed), then
/// check that no call on `ch` waits that long while another thread serves the channel.
fn a_lingering_descriptor_beside_stalls_no_caller(ch: &Arc<Channel>, raw: &OwnedFd, msg: &[u8]) {
    let (sock, _srv) = lingering_socket(2);
    send_raw(raw.as_fd(), msg, &[sock.as_fd()]);
    drop(sock);
    let longest = longest_call_while_serving(ch);
    assert!(longest < Duration::from_millis(1000), "a call waited {longest:?} for the channel's lock");
}

#[test]
fn a_refused_connections_queued_descriptor_is_closed_outside_the_channels_lock() {
    // A process the channel does not admit queues a descriptor whose close blocks for 2 s
    // before it is accepted: refusing it closes that too, after the lock.
    let addr = address("refused-linger");
    let ch = Arc::new(Channel::listen(&addr).unwrap());
    ch.restrict(&[], &[1]).unwrap(); // only pid 1: this process is refused
    let raw = seqpacket();
    let name = addr.strip_prefix('@').unwrap();
    rustix::net::connect(&raw, &rustix::net::SocketAddrUnix::new_abstract_name(name.as_bytes()).unwrap()).unwrap();
    a_lingering_descriptor_beside_stalls_no_caller(&ch, &raw, b"x");
}

#[test]
fn a_too_long_messages_descriptor_is_closed_outside_the_channels_lock() {
    // Longer than a message may be (128 KiB): refused whole, its descriptor with it.
    let addr = address("trunc-linger");
    let ch = Arc::new(Channel::listen(&addr).unwrap());
    let raw = raw_consumer(&addr, 1);
    a_lingering_descriptor_beside_stalls_no_caller(&ch, &raw, &vec![0u8; 150 * 1024]);
}

#[test]
fn descriptors_a_consumer_sends_do_not_pile_up_while_one_of_them_takes_long_to_close() {
    // Queued before the connection is accepted: one descriptor whose close blocks for 2 s, then
    // 40 messages of 253 descriptors each. The producer takes about one message's worth per
    // look at the channel, so what waits to be closed stays near that (it was all of them).
    let addr = address("pile");
    let ch = Arc::new(Channel::listen(&addr).unwrap());
    let raw = raw_consumer(&addr, 1);
    let (sock, _srv) = lingering_socket(2);
    let msg = le(&[&5u32.to_le_bytes(), &[0; 4], &1u64.to_le_bytes()]);
    send_raw(raw.as_fd(), &msg, &[sock.as_fd()]);
    drop(sock);
    let null = std::fs::File::open("/dev/null").unwrap();
    let many: Vec<BorrowedFd<'_>> = (0..253).map(|_| null.as_fd()).collect();
    let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(253))];
    for _ in 0..40 {
        let mut control = rustix::net::SendAncillaryBuffer::new(&mut space);
        assert!(control.push(rustix::net::SendAncillaryMessage::ScmRights(&many)));
        if rustix::net::sendmsg(raw.as_fd(), &[IoSlice::new(&msg)], &mut control, rustix::net::SendFlags::NOSIGNAL)
            .is_err()
        {
            break; // the socket's buffer is full: enough queued
        }
    }
    let open_fds = || std::fs::read_dir("/proc/self/fd").unwrap().count();
    let before = open_fds();
    let serving = std::thread::spawn({
        let ch = ch.clone();
        move || {
            for _ in 0..5 {
                let _ = ch.service(Some(Duration::from_millis(10)));
            }
        }
    });
    let mut peak = before;
    while !serving.is_finished() {
        peak = peak.max(open_fds());
        std::thread::sleep(Duration::from_millis(10));
    }
    serving.join().unwrap();
    // (Other tests run beside this one and open descriptors too.)
    assert!(peak < before + 1500, "{} descriptors waited to be closed at once", peak - before);
}

// --- Handing the CPU over (ring.rs, "Handing the CPU over") -------------------------------------

const P_HERE: usize = 512;
const C_HERE: usize = 576;
const P_AWAKE: usize = 640;

/// Pin the calling thread to `cpu`; the CPU it then runs on.
fn pin_thread(cpu: usize) -> usize {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET stays within it (cpu < CPU_SETSIZE).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        assert_eq!(libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set), 0);
        usize::try_from(libc::sched_getcpu()).unwrap()
    }
}

/// A CPU this thread may run on (the first of its affinity set).
fn some_allowed_cpu() -> usize {
    // SAFETY: sched_getaffinity writes at most size_of::<cpu_set_t>() bytes into the set.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set), 0);
        (0..libc::CPU_SETSIZE as usize).find(|&c| libc::CPU_ISSET(c, &set)).unwrap()
    }
}

/// This thread's voluntary context switches so far (its sleeps; a yield is not one).
fn thread_sleeps() -> u64 {
    let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("voluntary_ctxt_switches:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// A consumer thread on CPU `c_cpu` that, once told the producer is set up (a yield to a
/// producer busy setting up takes long, which pauses the consumer's yields for longer than the
/// run), receives `n` items or leases whose first u64 counts from 0, checks each and releases
/// it; it gives back its connection and how many times it slept while receiving. Returns the
/// thread and the sender that starts it.
fn counting_consumer(
    c: Connection,
    c_cpu: usize,
    n: u64,
    what: String,
) -> (std::thread::JoinHandle<(Connection, u64)>, std::sync::mpsc::Sender<()>) {
    let (ready, set_up) = std::sync::mpsc::channel::<()>();
    let consumer = std::thread::spawn(move || {
        pin_thread(c_cpu);
        set_up.recv().unwrap();
        let before = thread_sleeps();
        for i in 0..n {
            let imp = c.recv(T).unwrap();
            // SAFETY: every item or lease is at least 8 bytes, a u64 written before its send.
            assert_eq!(unsafe { *(imp.view().data as *const u64) }, i, "{what} {i}");
            imp.release();
        }
        (c, thread_sleeps() - before)
    });
    (consumer, ready)
}

/// `n` items through a pool of `slots` slots, the producer on CPU `p_cpu` and the consumer on
/// `c_cpu`, each item's value checked in order; how many times the consumer's thread slept.
fn items_between(p_cpu: usize, c_cpu: usize, slots: u32, n: u64) -> u64 {
    let (ch, c, peer) = connected(&address("placed"));
    let (consumer, ready) = counting_consumer(c, c_cpu, n, format!("item of {slots} slots, number"));
    pin_thread(p_cpu);
    let exp = Arc::new(Exporter::channel_host_alloc(64 * u64::from(slots)).unwrap());
    let pool = ch.pool(exp.clone(), 64, slots).unwrap();
    let dtype = devshare::dtype::DevshareDType::new(devshare::dtype::code::UINT, 64, 1);
    ready.send(()).unwrap();
    for i in 0..n {
        let (slot, p) = pool.acquire(T).unwrap();
        // SAFETY: the slot is 64 writable bytes.
        unsafe { *(p as *mut u64) = i };
        pool.send(slot, peer, &TensorDesc { dtype, shape: &[8], ..Default::default() }).unwrap();
    }
    let (c, sleeps) = consumer.join().unwrap();
    assert!(serve_until(&ch, || pool.info().unwrap().2 == slots), "every slot came back");
    assert_eq!(ch.peer_info(peer).unwrap().protocol_errors, 0);
    drop(c);
    pin_thread_to_all();
    sleeps
}

#[test]
fn a_producer_and_consumer_on_one_cpu_hand_it_over_without_losing_an_item_pipelined_or_one_at_a_time() {
    // Both threads on one CPU: each side that finds nothing to do yields to the other before
    // it sleeps. Every item must arrive, in order, with its value, and every slot come back —
    // with 8 slots in flight and with one slot cycling (a lost wake-up would stall a receive
    // without a time limit for good, and fail the test at the 10 s limit of `T`). And the
    // consumer must hardly ever sleep: one at a time, without the hand-over, it sleeps once
    // per item.
    // (Other tests' threads share the CPU too, and a yield that gives it to one of them
    // pauses the hand-over for a while: up to three tries.)
    let cpu = some_allowed_cpu();
    let n = 20_000;
    for slots in [8u32, 1] {
        let mut sleeps = Vec::new();
        while sleeps.len() < 3 && sleeps.last().map_or(true, |&s| s >= n / 4) {
            sleeps.push(items_between(cpu, cpu, slots, n));
        }
        assert!(
            sleeps.iter().any(|&s| s < n / 4),
            "with {slots} slots the consumer slept {sleeps:?} times for {n} items"
        );
    }
}

#[test]
fn a_producer_and_consumer_on_two_cpus_lose_no_item_while_polling_for_each_other() {
    // On two CPUs each side that finds nothing to do while the other is awake polls for a
    // while before it sleeps (spin.rs): the same items, in order, every slot back.
    // And the consumer hardly ever sleeps (without the poll it sleeps for nearly every item;
    // up to three tries, as on one CPU).
    let Some((a, b)) = two_allowed_cpus() else { return };
    let n = 20_000;
    for slots in [8u32, 1] {
        let mut sleeps = Vec::new();
        while sleeps.len() < 3 && sleeps.last().map_or(true, |&s| s >= n / 4) {
            sleeps.push(items_between(a, b, slots, n));
        }
        assert!(
            sleeps.iter().any(|&s| s < n / 4),
            "with {slots} slots the consumer slept {sleeps:?} times for {n} items"
        );
    }
}

/// `n` leases of a view of a registered export, each sent and waited for (the round trip of a
/// KV block), the producer on CPU `p_cpu` and the consumer on `c_cpu`, each lease's value
/// checked; how many times the producer's thread slept, and the consumer's.
fn leases_between(p_cpu: usize, c_cpu: usize, n: u64) -> (u64, u64) {
    let (ch, c, peer) = connected(&address("placed-leases"));
    let (consumer, ready) = counting_consumer(c, c_cpu, n, "lease".into());
    pin_thread(p_cpu);
    let exp = Exporter::channel_host_alloc(4096).unwrap();
    ch.register(&exp).unwrap();
    let dtype = devshare::dtype::DevshareDType::new(devshare::dtype::code::UINT, 64, 1);
    let desc = TensorDesc { dtype, shape: &[1], storage_offset: 64, ..Default::default() };
    ready.send(()).unwrap();
    let before = thread_sleeps();
    for i in 0..n {
        // SAFETY: the export's own bytes, no lease out.
        unsafe { *(exp.ptr().add(64) as *mut u64) = i };
        ch.send(peer, &exp, &desc).unwrap();
        exp.wait(T).unwrap_or_else(|e| panic!("lease {i}: {e}"));
    }
    let sleeps = thread_sleeps() - before;
    let (c, consumer_sleeps) = consumer.join().unwrap();
    drop(c);
    assert_eq!(ch.peer_info(peer).unwrap().protocol_errors, 0);
    pin_thread_to_all();
    (sleeps, consumer_sleeps)
}

#[test]
fn a_wait_for_a_lease_polls_for_a_consumer_awake_on_another_cpu_and_yields_to_one_on_its_own() {
    // A producer's wait for a lease's return, where its consumer is awake (it will release
    // soon): on another CPU the wait polls for the return a while before it sleeps (spin.rs),
    // on the same CPU it gives the consumer the CPU first (ring.rs, "Handing the CPU over").
    // Either way the producer hardly ever sleeps; without them it sleeps for nearly every
    // lease. Nor, on two CPUs, does the consumer, which polls for the next lease while the
    // producer is out of its wait. (On one CPU the consumer's own yields are the subject of
    // the pool test above; here they pause whenever another test's thread takes the CPU.)
    // (Up to three tries: other tests' threads share the CPUs.)
    let n = 5_000;
    let mut placements = vec![(some_allowed_cpu(), some_allowed_cpu(), "one CPU", false)];
    if let Some((a, b)) = two_allowed_cpus() {
        placements.push((a, b, "two CPUs", true));
    }
    for (p_cpu, c_cpu, tag, both) in placements {
        let mut sleeps = Vec::new();
        let few = |&(p, c): &(u64, u64)| p < n / 4 && (!both || c < n / 4);
        while sleeps.len() < 3 && !sleeps.last().is_some_and(few) {
            sleeps.push(leases_between(p_cpu, c_cpu, n));
        }
        assert!(sleeps.iter().any(few), "{tag}: (producer, consumer) slept {sleeps:?} times for {n} leases");
    }
}

#[test]
fn a_consumer_polls_for_a_producer_that_armed_its_ring_but_is_out_of_its_wait() {
    // A producer that serves its channel after each send (an event loop's callback) arms its
    // rings each time: its `pending` word says "wake me" although it is running, and a
    // consumer that holds its items (no return of its own sets the word again) would take it
    // for asleep. The consumer goes by the word that says whether the producer is in its wait
    // (ring.rs, `P_AWAKE`), so it polls for the next item, which comes every few microseconds,
    // instead of sleeping for each one. (Up to three tries: other tests share the CPUs.)
    let Some((a, b)) = two_allowed_cpus() else { return };
    let n = 2_000u32;
    let mut sleeps = Vec::new();
    while sleeps.len() < 3 && sleeps.last().map_or(true, |&s| s >= u64::from(n) / 8) {
        let (ch, c, peer) = connected(&address("served"));
        let consumer = std::thread::spawn(move || {
            pin_thread(b);
            let before = thread_sleeps();
            let held: Vec<_> = (0..n).map(|_| c.recv(T).unwrap()).collect();
            let sleeps = thread_sleeps() - before;
            drop(held);
            (c, sleeps)
        });
        pin_thread(a);
        let exp = Arc::new(Exporter::channel_host_alloc(64 * u64::from(n)).unwrap());
        let pool = ch.pool(exp.clone(), 64, n).unwrap();
        for _ in 0..n {
            let (slot, _) = pool.acquire(T).unwrap();
            pool.send(slot, peer, &TensorDesc { shape: &[64], ..Default::default() }).unwrap();
            ch.service(Some(Duration::ZERO)).unwrap();
            let t = Instant::now();
            while t.elapsed() < Duration::from_micros(5) {
                std::hint::spin_loop(); // the producer's own work between items
            }
        }
        let (c, slept) = consumer.join().unwrap();
        sleeps.push(slept);
        drop(c);
        pin_thread_to_all();
    }
    assert!(sleeps.iter().any(|&s| s < u64::from(n) / 8), "the consumer slept {sleeps:?} times for {n} items");
}

#[test]
fn adaptive_spin_us_0_turns_the_poll_between_cpus_off() {
    // DEVSHARE_ADAPTIVE_SPIN_US=0 (read once per process: a child process of its own) restores
    // the waits of 1.16 between CPUs: a consumer on another CPU than its producer sleeps for
    // nearly every item, where with the poll it hardly ever does (the tests above).
    if two_allowed_cpus().is_none() {
        return;
    }
    child_role_passes("adaptive_spin_off_child", ("DEVSHARE_ADAPTIVE_SPIN_US", "0"));
}

/// The test above, in its child process.
#[test]
#[ignore = "a role of the test above, run in a child process"]
fn adaptive_spin_off_child() {
    if std::env::var("DEVSHARE_ADAPTIVE_SPIN_US").as_deref() != Ok("0") {
        return;
    }
    let Some((a, b)) = two_allowed_cpus() else { return };
    let n = 5_000;
    let sleeps = items_between(a, b, 1, n);
    assert!(sleeps > n / 2, "with the poll off the consumer slept only {sleeps} times for {n} items");
    // And a consumer of leases waits for each one asleep (4,993-5,000 and 1,997-1,999 in six
    // runs here; with the poll on, under a quarter). (The producer's waits sleep 863-1,829
    // times of 2,000 then: a release may be back by the time its wait first looks.)
    let (_, consumer) = leases_between(a, b, 2_000);
    assert!(consumer > 1_000, "with the poll off the consumer slept only {consumer} times for 2,000 leases");
}

/// Two CPUs this thread may run on, when it may run on two.
fn two_allowed_cpus() -> Option<(usize, usize)> {
    // SAFETY: sched_getaffinity writes at most size_of::<cpu_set_t>() bytes into the set.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set), 0);
        let mut cpus = (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set));
        Some((cpus.next()?, cpus.next()?))
    }
}

/// Undo [`pin_thread`]: this thread may run on every CPU again.
fn pin_thread_to_all() {
    // SAFETY: as in pin_thread; every CPU the process may use.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(libc::sched_getaffinity(libc::getpid(), std::mem::size_of::<libc::cpu_set_t>(), &mut set), 0);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

#[test]
fn a_consumer_that_claims_to_be_awake_costs_an_acquire_or_a_lease_wait_one_yield_or_one_short_poll_not_a_busy_wait() {
    // A hostile consumer holds every slot and writes its ring's words so that it looks awake
    // forever, on the producer's CPU (the producer yields to it) or on another (the producer
    // polls for its return, spin.rs). Either happens once per acquire, which then sleeps as
    // always: it times out on time and uses next to no CPU.
    for (claim, tag) in [(1u64, "this CPU"), (2, "another CPU")] {
        let addr = address("hand-over-consumer");
        let ch = Channel::listen(&addr).unwrap();
        let raw = raw_consumer(&addr, 1 | 2);
        ch.wait_peers(1, T).unwrap();
        let peer = ch.peer_ids().unwrap()[0];
        let _welcome = recv_raw(raw.as_fd());
        let cpu = pin_thread(some_allowed_cpu());
        let exp = Arc::new(Exporter::channel_host_alloc(4096 * 2).unwrap());
        let pool = ch.pool(exp.clone(), 4096, 2).unwrap();
        for _ in 0..2 {
            let (slot, _) = pool.acquire(T).unwrap();
            pool.send(slot, peer, &TensorDesc { shape: &[4096], ..Default::default() }).unwrap();
        }
        let _attach = recv_with_fds(raw.as_fd());
        let (_ring_msg, fds) = recv_with_fds(raw.as_fd());
        let ring = RawRing::map(fds[0].as_fd());
        ring.word(C_PENDING).store(1, Ordering::SeqCst);
        ring.word(C_HERE).store(cpu as u64 + claim, Ordering::SeqCst);
        for _ in 0..2 {
            let (t, cpu_before) = (Instant::now(), thread_cpu());
            assert_eq!(status(pool.acquire(Some(Duration::from_millis(400)))), Status::Timeout);
            let (took, used) = (t.elapsed(), thread_cpu() - cpu_before);
            assert!(took < Duration::from_secs(3), "{tag}: a 400 ms acquire took {took:?}");
            assert!(used < Duration::from_millis(30), "{tag}: a 400 ms acquire used {used:?} of CPU");
        }
        // A wait for a lease it never releases: likewise.
        let leased = Exporter::channel_host_alloc(4096).unwrap();
        ch.send(peer, &leased, &TensorDesc { shape: &[64], ..Default::default() }).unwrap();
        for _ in 0..2 {
            let (t, cpu_before) = (Instant::now(), thread_cpu());
            assert_eq!(status(leased.wait(Some(Duration::from_millis(400)))), Status::Timeout);
            let (took, used) = (t.elapsed(), thread_cpu() - cpu_before);
            assert!(took < Duration::from_secs(3), "{tag}: a 400 ms wait took {took:?}");
            assert!(used < Duration::from_millis(30), "{tag}: a 400 ms wait used {used:?} of CPU");
        }
        // Many short waits: the polls that find nothing back off (spin.rs), so 1,000 waits of
        // 1 ms poll about ten times for 50 µs, not 1,000 times.
        let cpu_before = thread_cpu();
        for _ in 0..1000 {
            assert_eq!(status(leased.wait(Some(Duration::from_millis(1)))), Status::Timeout);
        }
        let used = thread_cpu() - cpu_before;
        // (Without the backoff: 88-90 ms on the 2-CPU VM; with it 19-24 ms, most of it the
        // waits' own system calls.)
        assert!(used < Duration::from_millis(55), "{tag}: 1,000 waits of 1 ms used {used:?} of CPU");
        pin_thread_to_all();
    }
}

#[test]
fn a_producer_that_claims_to_be_awake_costs_a_receive_one_yield_or_one_short_poll_not_a_busy_wait() {
    // The same from the producer's side: a hostile producer's ring says it is awake, on the
    // consumer's CPU or on another, and it never sends. The receive yields or polls once, then
    // sleeps: it times out on time with next to no CPU, and an item sent afterwards still
    // wakes it.
    // (It claims so with its pending word, as a producer before 1.18 would, and with the
    // word that says it is out of its wait.)
    for (claim, word, tag) in [
        (1u64, P_PENDING, "this CPU"),
        (2, P_PENDING, "another CPU"),
        (1, P_AWAKE, "this CPU"),
        (2, P_AWAKE, "another CPU"),
    ] {
        let (c, _p, ring, c_efd, _p_efd, _mem) = ring_consumer("hand-over-producer");
        let cpu = pin_thread(some_allowed_cpu());
        ring.word(word).store(1, Ordering::SeqCst);
        ring.word(P_HERE).store(cpu as u64 + claim, Ordering::SeqCst);
        for _ in 0..2 {
            let (t, cpu_before) = (Instant::now(), thread_cpu());
            assert_eq!(status(c.recv(Some(Duration::from_millis(400)))), Status::Timeout);
            let (took, used) = (t.elapsed(), thread_cpu() - cpu_before);
            assert!(took < Duration::from_secs(3), "{tag}: a 400 ms receive took {took:?}");
            assert!(used < Duration::from_millis(30), "{tag}: a 400 ms receive used {used:?} of CPU");
        }
        // An item put in the ring now (after the ATTACH and RING messages) is received.
        ring.put_item(0, 2, &item_msg(1, 1, 0, 64), item_msg(1, 1, 0, 64).len() as u64);
        ring.word(ITEM_TAIL).store(1, Ordering::SeqCst);
        wake(&c_efd);
        assert_eq!(c.recv(T).unwrap().pool_slot(), Some((1, 1)), "{tag}");
        pin_thread_to_all();
    }
}

/// `vm.nr_hugepages` set to `n` for the guard's life (put back when dropped); `None` where this
/// process may not (not root) or the kernel keeps none.
struct HugePages(String);

impl HugePages {
    fn reserve(n: u32) -> Option<HugePages> {
        const KNOB: &str = "/proc/sys/vm/nr_hugepages";
        let was = std::fs::read_to_string(KNOB).ok()?;
        let guard = HugePages(was);
        std::fs::write(KNOB, n.to_string()).ok()?;
        let now: u32 = std::fs::read_to_string(KNOB).ok()?.trim().parse().ok()?;
        (now >= n).then_some(guard)
    }
}

impl Drop for HugePages {
    fn drop(&mut self) {
        let _ = std::fs::write("/proc/sys/vm/nr_hugepages", self.0.trim());
    }
}

/// A hostile producer's pool in a `MFD_HUGETLB` memfd, sealed like an honest one: its sender
/// could punch out the page under the consumer (`fallocate`) and let another file take the free
/// huge page, and the consumer's next read of its item would die of `SIGBUS` (shmem's holes
/// read as zeros, hugetlbfs's fault only while a huge page is free). Refused at the receive, as
/// a share's memory and as a ring's; an honest share still arrives. (Without the check the pool
/// was attached and its item received; skipped where no huge page can be reserved.)
#[test]
fn a_hugetlb_memfd_is_refused_as_a_pool_a_share_and_a_ring() {
    use rustix::fs::{MemfdFlags, SealFlags};
    const HUGE: u64 = 2 << 20;
    let Some(_pages) = HugePages::reserve(1) else {
        eprintln!("SKIPPED: no huge page can be reserved here");
        return;
    };
    let huge = || {
        let fd =
            rustix::fs::memfd_create("huge", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING | MemfdFlags::HUGETLB)
                .ok()?;
        rustix::fs::ftruncate(&fd, HUGE).ok()?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).ok()?;
        Some(fd)
    };
    let Some(fd) = huge() else {
        eprintln!("SKIPPED: this kernel makes no sealed hugetlb memfd");
        return;
    };
    let (c, p) = fake_connection("hugetlb", 0);
    let refused = |what: &str, said: &str| {
        let err = c.recv(T).err().unwrap_or_else(|| panic!("{what}: a hugetlb memfd was accepted"));
        assert_eq!(err.status(), Status::Untrusted, "{what}: {err}");
        assert!(err.to_string().contains(said), "{what}: {err}");
    };
    p.send(&attach_msg(1, HUGE, 1, &memfd_handle(HUGE, HUGE)), &[fd.as_fd()]);
    p.send(&item_msg(1, 0, 0, 16), &[]);
    refused("a pool", "hugetlbfs");
    let _ = c.recv(Some(Duration::from_millis(100))); // (the item of the refused pool)
    p.send(&share_msg(1, &memfd_handle(HUGE, HUGE)), &[fd.as_fd()]);
    refused("a share", "hugetlbfs");
    let efd = || rustix::event::eventfd(1, rustix::event::EventfdFlags::CLOEXEC).unwrap();
    let ring_msg = le(&[&12u32.to_le_bytes(), &1024u32.to_le_bytes(), &256u32.to_le_bytes()]);
    p.send(&ring_msg, &[fd.as_fd(), efd().as_fd(), efd().as_fd()]);
    refused("a ring", "hugetlbfs");
    let mfd = sealed_memfd(4096);
    p.send(&share_msg(2, &memfd_handle(4096, 4096)), &[mfd.as_fd()]);
    assert!(!c.recv(T).unwrap().view().data.is_null(), "an honest share still arrives");
}

/// A hostile producer attaches pool after pool (each a one-page memfd): the consumer mapped
/// every one until this process's mappings ran out (65,530, after which every `mmap`, the
/// runtime's own, failed and the process aborted). It holds `DEVSHARE_CHANNEL_MAX_POOLS` and
/// refuses the next, ending the connection.
#[test]
fn a_consumer_holds_a_bounded_number_of_one_producers_pools() {
    let most = devshare::channel::limits::DEVSHARE_CHANNEL_MAX_POOLS as u32;
    let (c, p) = fake_connection("many-pools", 0);
    let maps = || std::fs::read_to_string("/proc/self/maps").unwrap().lines().count();
    let before = maps();
    let enc = memfd_handle(4096, 4096);
    for pool in 1..=most + 10 {
        let fd = sealed_memfd(4096);
        p.send(&attach_msg(pool, 4096, 1, &enc), &[fd.as_fd()]);
    }
    let err = match c.recv(Some(Duration::from_secs(2))) {
        Err(e) if e.status() == Status::Timeout => panic!("{} pools attached and none refused", most + 10),
        Err(e) => e,
        Ok(_) => panic!("no item was sent"),
    };
    assert_eq!(err.status(), Status::Untrusted, "{err}");
    assert!(err.to_string().contains(&format!("attached {most} pools already")), "{err}");
    assert!(maps() <= before + most as usize + 8, "{} mappings more", maps() - before);
    let next = c.recv(T).err().expect("the connection ended");
    assert_eq!(next.status(), Status::Closed, "{next}");
}

/// The producer's side of the same bound: a send that would attach one pool more to a peer
/// fails with `BUSY`, naming the bound, and the consumer keeps receiving from the others.
#[test]
fn a_producer_cannot_attach_more_pools_to_a_peer_than_it_may_hold() {
    let most = devshare::channel::limits::DEVSHARE_CHANNEL_MAX_POOLS;
    let (ch, c, peer) = connected(&address("pool-bound"));
    let exp = Arc::new(Exporter::channel_host_alloc(4096 * (most as u64 + 1)).unwrap());
    let pools: Vec<_> = (0..=most).map(|_| ch.pool(exp.clone(), 4096, 1).unwrap()).collect();
    let desc = TensorDesc { shape: &[16], storage_size: Some(16), ..Default::default() };
    for pool in &pools[..most] {
        let (slot, _) = pool.acquire(T).unwrap();
        pool.send(slot, peer, &desc).unwrap();
        c.recv(T).unwrap().release();
    }
    let (slot, _) = pools[most].acquire(T).unwrap();
    let err = pools[most].send(slot, peer, &desc).unwrap_err();
    assert_eq!(err.status(), Status::Busy, "{err}");
    assert!(err.to_string().contains("DEVSHARE_CHANNEL_MAX_POOLS"), "{err}");
    let (slot, _) = pools[0].acquire(T).unwrap();
    pools[0].send(slot, peer, &desc).unwrap();
    c.recv(T).unwrap().release();
}

/// A hostile producer keeps its socket to the consumer full of messages that carry no item
/// (`NAMES`; retirements and attachments likewise): a receive handles at most 64 of them per
/// look and checks its time limit between looks. (Before, it left only when the socket was
/// empty: `recv(100 ms)` took 6-10 s here, for as long as the producer kept sending.)
#[test]
fn a_producer_that_floods_messages_without_items_keeps_no_receive_past_its_time_limit() {
    let (c, p) = fake_connection("names-flood", 0);
    // `NAMES` for leases 1..=1024 (the same ones every time: the consumer's pending names stay
    // within their bound and nothing is refused): about a thousand allocations for the
    // consumer, one send for the producer.
    let names: Vec<Vec<u8>> = (0..1024).map(|i| format!("model.layers.{i:06}.weight.xx").into_bytes()).collect();
    let m = names_msg(1, &names.iter().map(Vec::as_slice).collect::<Vec<_>>());
    // As many messages in flight as this process may have (wmem_max).
    let _ = rustix::net::sockopt::set_socket_send_buffer_size(&p.conn, 4 << 20);
    let sender = Flood::start(p, Duration::from_secs(10), move |conn| {
        rustix::net::send(conn, &m, rustix::net::SendFlags::NOSIGNAL | rustix::net::SendFlags::DONTWAIT).map(drop)
    });
    std::thread::sleep(Duration::from_millis(200)); // the socket full
    let mut worst = Duration::ZERO;
    for _ in 0..5 {
        let t = Instant::now();
        let r = c.recv(Some(Duration::from_millis(100)));
        worst = worst.max(t.elapsed());
        assert_eq!(r.err().map(|e| e.status()), Some(Status::Timeout));
    }
    drop(sender.end());
    assert!(worst < Duration::from_secs(1), "recv(100 ms) took {worst:?}");
}

/// A hostile producer's flood on a thread of its own: `send_one` (one non-blocking send on the
/// producer's socket) again and again, never reading, until [`Flood::end`], `within` passed, or
/// the consumer hung up; a full socket is waited on for room (at most 10 ms at a time).
struct Flood {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<FakeProducer>,
}

impl Flood {
    fn start(
        p: FakeProducer,
        within: Duration,
        send_one: impl Fn(BorrowedFd<'_>) -> rustix::io::Result<()> + Send + 'static,
    ) -> Flood {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let thread = std::thread::spawn({
            let stop = stop.clone();
            move || {
                let deadline = Instant::now() + within;
                while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                    match send_one(p.conn.as_fd()) {
                        Err(rustix::io::Errno::AGAIN) => {
                            let mut pfd = [rustix::event::PollFd::new(&p.conn, rustix::event::PollFlags::OUT)];
                            let ms = rustix::event::Timespec { tv_sec: 0, tv_nsec: 10_000_000 };
                            let _ = rustix::event::poll(&mut pfd, Some(&ms));
                        }
                        Err(_) => break, // the consumer ended the connection
                        Ok(()) => {}
                    }
                }
                p
            }
        });
        Flood { stop, thread }
    }

    /// Stop the flood; the producer, still connected.
    fn end(self) -> FakeProducer {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}

/// Receive with `recv(limit)` on a thread of its own until the connection says `CLOSED`, giving
/// each item to `got`; fails the test when a receive has not returned within 10 s, or the
/// connection has not ended within 90 s. The `CLOSED` error, the longest receive, the items.
fn receive_until_closed(
    c: Connection,
    limit: Duration,
    got: impl Fn(devshare::import::Import) + Send + 'static,
) -> (Error, Duration, u64) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut n = 0u64;
        loop {
            let t = Instant::now();
            let r = c.recv(Some(limit));
            let took = t.elapsed();
            let end = match r {
                Ok(imp) => {
                    n += 1;
                    got(imp);
                    None
                }
                Err(e) if e.status() == Status::Timeout => None,
                Err(e) => Some(e),
            };
            let done = end.is_some();
            if tx.send((took, end, n)).is_err() || done {
                return;
            }
        }
    });
    let started = Instant::now();
    let mut worst = Duration::ZERO;
    loop {
        let (took, end, n) = rx.recv_timeout(Duration::from_secs(10)).expect("a receive returned within 10 s");
        worst = worst.max(took);
        if let Some(e) = end {
            assert_eq!(e.status(), Status::Closed, "{e}");
            return (e, worst, n);
        }
        assert!(started.elapsed() < Duration::from_secs(90), "the connection never ended ({n} items)");
    }
}

/// A hostile producer that never reads its socket attaches pool 1 again and again: each
/// attachment replaced sends a `DETACH` from inside the consumer's receive. Once 65,536 waited
/// for the producer, the next made that receive wait up to 10 s for room, and the receive went
/// on to the next attachment: `recv(100 ms)` never returned. Now that bound ends the connection:
/// no receive takes long, and one soon says `CLOSED`, naming why.
#[test]
fn a_producer_that_never_reads_what_its_messages_make_the_consumer_send_loses_the_connection() {
    let (c, p) = fake_connection("reattach", 0);
    let fd = sealed_memfd(4096);
    let m = attach_msg(1, 4096, 1, &memfd_handle(4096, 4096));
    let sender = Flood::start(p, Duration::from_secs(120), move |conn| {
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = rustix::net::SendAncillaryBuffer::new(&mut space);
        let fds = [fd.as_fd()];
        control.push(rustix::net::SendAncillaryMessage::ScmRights(&fds));
        let flags = rustix::net::SendFlags::NOSIGNAL | rustix::net::SendFlags::DONTWAIT;
        rustix::net::sendmsg(conn, &[IoSlice::new(&m)], &mut control, flags).map(drop)
    });
    let (closed, worst, _) = receive_until_closed(c, Duration::from_millis(100), drop);
    drop(sender.end());
    assert!(worst < Duration::from_secs(2), "a recv(100 ms) took {worst:?}");
    assert!(closed.to_string().contains("did not read this connection"), "{closed}");
}

/// The same bound reached by releases: a producer sends item after item of a one-slot pool and
/// never reads; another thread releases each item as it comes. Before, once 65,536 returns
/// waited, each release waited up to 10 s for room holding the backlog's lock, and a receive on
/// this thread (which flushes the backlog first) waited with it: `recv(50 ms)` took 10 s, and
/// so on for ever. Now the connection ends at the bound.
#[test]
fn releases_past_the_backlog_bound_end_the_connection_and_hold_up_no_receive() {
    let (c, p) = fake_connection("backlog-bound", 0);
    let pool_fd = sealed_memfd(4096);
    p.send(&attach_msg(1, 4096, 1, &memfd_handle(4096, 4096)), &[pool_fd.as_fd()]);
    let m = item_msg(1, 0, 0, 16);
    let sender = Flood::start(p, Duration::from_secs(120), move |conn| {
        rustix::net::send(conn, &m, rustix::net::SendFlags::NOSIGNAL | rustix::net::SendFlags::DONTWAIT).map(drop)
    });
    let (tx, rx) = std::sync::mpsc::channel::<devshare::import::Import>();
    let releaser = std::thread::spawn(move || rx.into_iter().for_each(|imp| imp.release()));
    let (closed, worst, received) = receive_until_closed(c, Duration::from_millis(50), move |imp| {
        let _ = tx.send(imp);
    });
    drop(sender.end());
    releaser.join().unwrap();
    assert!(received > 65_536, "ended after {received} items");
    assert!(worst < Duration::from_secs(2), "a recv(50 ms) took {worst:?} (after {received} items)");
    assert!(closed.to_string().contains("did not read this connection"), "{closed}");
}

/// The byte encoding of a segmented CUDA handle (POSIX fds, 2 MiB segments) whose table lists
/// `fds`, one segment each, viewed whole.
fn cuda_fd_handle(fds: &[i32]) -> Vec<u8> {
    use devshare::handle::segments::{set_segments, DEVSHARE_SEGMENTS_CUDA_FD};
    const SEG: u64 = 2 << 20;
    let size = SEG * fds.len() as u64;
    let mut h = devshare::handle::DevshareHandle {
        backend: devshare::handle::DEVSHARE_BACKEND_CUDA,
        producer_pid: std::process::id() as i32,
        storage_size: size,
        ndim: 1,
        dtype: devshare::dtype::DevshareDType::new(devshare::dtype::code::UINT, 8, 1),
        ..Default::default()
    };
    h.shape[0] = size as i64;
    h.strides[0] = 1;
    let table: Vec<u8> = fds.iter().flat_map(|f| f.to_le_bytes()).collect();
    set_segments(&mut h, SEG, DEVSHARE_SEGMENTS_CUDA_FD, &table).unwrap();
    devshare::handle::encode::encode(&h).unwrap()
}

/// Descriptors that do not match what a share says it is are refused before anything is
/// opened or mapped: a segmented CUDA handle whose table names more (or fewer) distinct fds
/// than came with it (a repeated fd in the table counts once, so a duplicate descriptor is one
/// too many), a handle that names its memory by key yet came with descriptors, and a channel
/// memfd handle with two. Each refusal says what did not match, and the connection goes on.
#[test]
fn a_hostile_producers_descriptors_that_do_not_match_the_share_are_refused_before_any_mapping() {
    let (c, p) = fake_connection("hostile-fds", 0);
    let a = sealed_memfd(4096);
    let b = sealed_memfd(4096);
    let cases: Vec<(Vec<u8>, Vec<BorrowedFd<'_>>, &str)> = vec![
        (cuda_fd_handle(&[5, 6]), vec![a.as_fd()], "listing 2 distinct fds came with 1 descriptors"),
        (cuda_fd_handle(&[5, 5]), vec![a.as_fd(), a.as_fd()], "listing 1 distinct fds came with 2 descriptors"),
        (cuda_fd_handle(&[5, 6, 7]), vec![a.as_fd(), b.as_fd(), a.as_fd(), b.as_fd()], "3 distinct fds came with 4"),
        (
            {
                let mut h = devshare::handle::encode::decode(&memfd_handle(4096, 4096)).unwrap();
                h.flags &= !DEVSHARE_HANDLE_FLAG_CHANNEL;
                h.backend = devshare::handle::DEVSHARE_BACKEND_CUDA;
                h.key_len = 64;
                h.key[..64].fill(7);
                devshare::handle::encode::encode(&h).unwrap()
            },
            vec![a.as_fd()],
            "names its memory came with descriptors",
        ),
        (memfd_handle(4096, 4096), vec![a.as_fd(), b.as_fd()], "came with 2 descriptors instead of 1"),
    ];
    for (lease, (enc, fds, says)) in cases.iter().enumerate() {
        p.send(&share_msg(lease as u64 + 1, enc), fds);
        let Err(e) = c.recv(T) else { panic!("{says}: received") };
        assert_eq!(e.status(), Status::Untrusted, "{says}: {e}");
        assert!(e.to_string().contains(says), "{e} should say {says:?}");
    }
    // A view past its table's segments, with the right descriptors: refused as out of bounds.
    // (The encoder refuses to write one: the storage size is patched in the bytes, and the
    // checksum made again.)
    let mut h = devshare::handle::encode::decode(&cuda_fd_handle(&[5, 6])).unwrap();
    let (fits, past) = ((3u64 << 20) + 1, (5u64 << 20) + 1);
    h.storage_size = fits;
    h.shape[0] = 16;
    let mut enc = devshare::handle::encode::encode(&h).unwrap();
    let at = enc.windows(8).position(|w| w == fits.to_le_bytes()).expect("the storage size in the bytes");
    enc[at..at + 8].copy_from_slice(&past.to_le_bytes());
    let body = enc.len() - 4;
    let crc = crc32fast::hash(&enc[..body]);
    enc[body..].copy_from_slice(&crc.to_le_bytes());
    p.send(&share_msg(8, &enc), &[a.as_fd(), b.as_fd()]);
    let Err(refused) = c.recv(T) else { panic!("a view past the segments was received") };
    assert_eq!(refused.status(), Status::StorageOutOfBounds, "{refused}");
    // The connection goes on: a share that matches its descriptor arrives.
    p.send(&share_msg(9, &memfd_handle(4096, 4096)), &[a.as_fd()]);
    c.recv(T).unwrap().release();
}
