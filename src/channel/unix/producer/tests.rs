use super::*;
use rustix::net::{AddressFamily, SocketType};

#[test]
fn a_pool_counts_its_slots_out_through_sends_returns_and_a_consumer_gone() {
    const T: Option<Duration> = Some(Duration::from_secs(10));
    let (ch, c, peer) = connected("out");
    let pool = ch.pool(Arc::new(Exporter::channel_host_alloc(4 * 64).expect("alloc")), 64, 4).expect("pool");
    let out = || pool.shared.lock().expect("lock").pools[&pool.id].out;
    let serve_until = |want: u32| {
        let end = Instant::now() + Duration::from_secs(10);
        while out() != want && Instant::now() < end {
            ch.service(Some(Duration::from_millis(10))).expect("service");
        }
        out()
    };
    for _ in 0..3 {
        let (s, _) = pool.acquire(T).expect("acquire");
        pool.send(s, peer, &TensorDesc { shape: &[64], ..Default::default() }).expect("send");
    }
    let (kept, _) = pool.acquire(T).expect("acquire");
    assert_eq!(out(), 3, "three sent, one acquired");
    c.recv(T).expect("recv").release();
    c.recv(T).expect("recv").release();
    assert_eq!(serve_until(1), 1, "two came back");
    pool.release(kept).expect("release");
    let held = c.recv(T).expect("recv");
    drop(c); // the consumer goes with its item: the producer takes the slot back
    assert_eq!(serve_until(0), 0, "the last came back with its consumer gone");
    assert_eq!(pool.info().expect("info").2, 4);
    held.release();
}

/// A raw consumer that announces `tgid` in its handshake.
fn announce(addr: &str, tgid: i32) -> OwnedFd {
    announce_with(addr, tgid, 0)
}

/// A raw consumer that announces `tgid` and the `features` it reads.
fn announce_with(addr: &str, tgid: i32, features: u16) -> OwnedFd {
    let fd = rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)
        .expect("socket");
    let name = addr.strip_prefix('@').expect("abstract");
    rustix::net::connect(&fd, &rustix::net::SocketAddrUnix::new_abstract_name(name.as_bytes()).expect("name"))
        .expect("connect");
    let hello = Message::Hello { magic: wire::MAGIC, version: wire::VERSION, features, tgid }.encode();
    assert!(wire::try_send(fd.as_fd(), &hello, &[]).expect("send"));
    fd
}

/// The messages waiting on a raw consumer's socket after the WELCOME: (type, shares in it,
/// descriptors that came with it), reading until nothing arrives for 200 ms.
fn drain(ch: &LocalChannel, fd: &OwnedFd) -> Vec<(u32, usize, usize)> {
    let (mut buf, mut fds, mut out) = (Vec::new(), Vec::new(), Vec::new());
    while {
        let _ = ch.service(Some(Duration::ZERO)); // what waits in the peer's queue goes out
        true
    } && wire::wait_ready(fd.as_fd(), rustix::event::PollFlags::IN, Some(Duration::from_millis(200)))
        .expect("poll")
    {
        match wire::recv(fd.as_fd(), &mut buf, &mut fds).expect("recv") {
            wire::Received::Message(n) => {
                let m = Message::decode(&buf[..n]).expect("decode");
                let (ty, shares) = match m {
                    Message::Share { .. } => (wire::SHARE, 1),
                    Message::Shares { entries, .. } => (wire::SHARES, entries.len()),
                    Message::KeptShares { entries, .. } => (wire::KEPT_SHARES, entries.len()),
                    Message::Retire { .. } => (wire::RETIRE, 0),
                    Message::Welcome { .. } => continue,
                    other => panic!("unexpected {other:?}"),
                };
                out.push((ty, shares, fds.len()));
            }
            _ => break,
        }
    }
    out
}

#[test]
fn a_batch_goes_in_few_messages_to_consumers_that_read_them_and_one_by_one_to_older_ones() {
    let addr = format!("@devshare-unit-batch-{}", std::process::id());
    let ch = LocalChannel::listen(&addr).expect("listen");
    let own = std::process::id() as i32;
    let new = announce_with(&addr, own, wire::FEATURE_SHARES);
    let old = announce(&addr, own);
    ch.wait_peers(2, Some(Duration::from_secs(10))).expect("two peers");
    let ids = ch.peer_ids().expect("ids");
    let memfd = Exporter::channel_host_alloc(1 << 16).expect("memfd");
    let named = Exporter::host_alloc(1 << 16).expect("shm");
    let shape = [16i64];
    let items: Vec<(&Exporter, TensorDesc<'_>)> = (0..300)
        .map(|i| {
            let e = if i % 3 == 0 { &memfd } else { &named };
            (
                e,
                TensorDesc {
                    shape: &shape,
                    storage_offset: 64 * i as u64,
                    storage_size: Some(64),
                    ..Default::default()
                },
            )
        })
        .collect();
    ch.send_batch(ids[0], &items).expect("batch to a 1.4 consumer");
    ch.send_batch(ids[1], &items).expect("batch to an older consumer");
    let got = drain(&ch, &new);
    assert!(got.iter().all(|&(ty, _, _)| ty == wire::SHARES), "{got:?}");
    assert_eq!(got.iter().map(|&(_, n, _)| n).sum::<usize>(), 300);
    assert!(got.len() <= 3, "300 shares of about 700 bytes in {} messages of 128 KiB", got.len());
    assert_eq!(got.iter().map(|&(_, _, f)| f).sum::<usize>(), 100, "one memfd per memfd share");
    let got = drain(&ch, &old);
    assert_eq!(got.len(), 300);
    assert!(got.iter().all(|&(ty, n, _)| ty == wire::SHARE && n == 1));
    assert_eq!(memfd.outstanding().unwrap() + named.outstanding().unwrap(), 600);
    let bad = [(&named, TensorDesc { shape: &shape, storage_offset: 1 << 20, ..Default::default() })];
    let before = named.outstanding().unwrap();
    assert!(ch.send_batch(ids[0], &[items[1].clone(), bad[0].clone()]).is_err());
    assert_eq!(named.outstanding().unwrap(), before, "a refused description sends nothing");
    ch.close();
}

#[test]
fn an_announced_pid_that_is_not_the_kernels_is_whitelisted_only_when_trusted() {
    let addr = format!("@devshare-unit-tgid-{}", std::process::id());
    let ch = LocalChannel::listen(&addr).expect("listen");
    let own = std::process::id() as i32;
    let _honest = announce(&addr, own);
    let _other = announce(&addr, own + 3_000_000); // a container's host pid, or a lie
    ch.wait_peers(2, Some(Duration::from_secs(10))).expect("two peers");
    let ids = ch.peer_ids().expect("ids");
    let pids = |ch: &LocalChannel| -> Vec<(i32, i32)> {
        let core = ch.shared.lock().expect("lock");
        ids.iter().map(|&id| core.peers.get(id).map(|p| (p.info.tgid, core.whitelist_pid(p))).expect("peer")).collect()
    };
    assert_eq!(pids(&ch), vec![(own, own), (own + 3_000_000, own)], "the kernel's pid, not the announced one");
    ch.trust_announced_pids(true).expect("trust");
    assert_eq!(pids(&ch), vec![(own, own), (own + 3_000_000, own + 3_000_000)]);
}

#[test]
fn a_repeated_item_description_is_described_once_per_slot_and_any_other_again() {
    let (s64, s32) = ([64i64], [32i64]);
    let (d64, d32) =
        (TensorDesc { shape: &s64, ..Default::default() }, TensorDesc { shape: &s32, ..Default::default() });
    let layout = |desc: &TensorDesc<'_>| {
        let h = crate::handle::DevshareHandle { ndim: 1, ..Default::default() };
        (pool::DescKey::of(desc).expect("a key"), ItemLayout::of(&h, 0, desc.shape[0] as u64))
    };
    let mut d = pool::Described::new(4).expect("described");
    let (k64, l64) = layout(&d64);
    let (k32, l32) = layout(&d32);
    assert!(d.get(0, &d64).is_none(), "nothing described yet");
    d.put(0, k64, l64);
    assert_eq!(d.get(0, &d64), Some(&l64));
    assert!(d.get(1, &d64).is_none(), "described for slot 0 only");
    assert!(d.get(0, &d32).is_none(), "another description");
    d.put(1, k32, l32);
    assert!(d.get(0, &d64).is_none() && d.get(0, &d32).is_none(), "slot 0 describes the new one again");
    assert_eq!(d.get(1, &d32), Some(&l32));
    assert!(d.get(9, &d32).is_none(), "no such slot");
    // Every field that describing reads is in the key.
    let shape = [4i64, 4];
    let base = TensorDesc { shape: &shape, ..Default::default() };
    let key = |d: &TensorDesc<'_>| pool::DescKey::of(d).expect("a key");
    let variants = [
        TensorDesc { dtype: crate::dtype::DevshareDType::new(2, 32, 1), ..base.clone() },
        TensorDesc { shape: &shape[..1], ..base.clone() },
        TensorDesc { strides: Some(&[4, 1]), ..base.clone() },
        TensorDesc { storage_offset: 8, ..base.clone() },
        TensorDesc { storage_size: Some(16), ..base.clone() },
        TensorDesc { tensor_offset: 1, ..base.clone() },
        TensorDesc { inflight: true, ..base.clone() },
        TensorDesc { event: true, ..base.clone() },
    ];
    for v in &variants {
        assert!(key(v) != key(&base), "{v:?}");
        assert!(!key(&base).matches(v) && !key(v).matches(&base) && key(v).matches(v), "{v:?}");
    }
    assert!(pool::DescKey::of(&TensorDesc { shape: &[1; 9], ..Default::default() }).is_none(), "9 dimensions");
}

#[test]
fn a_send_after_a_refused_description_of_the_same_slot_is_described_again() {
    const T: Option<Duration> = Some(Duration::from_secs(10));
    let (ch, c, peer) = connected("described");
    let pool = ch.pool(Arc::new(Exporter::channel_host_alloc(64).expect("alloc")), 64, 1).expect("pool");
    for n in [64, 65, 64, 16, 64] {
        let (s, _) = pool.acquire(T).expect("acquire");
        let sent = pool.send(s, peer, &TensorDesc { shape: &[n], ..Default::default() });
        if n > 64 {
            assert!(sent.is_err(), "65 bytes in a 64-byte slot");
            pool.release(s).expect("release");
            continue;
        }
        sent.expect("send");
        let imp = c.recv(T).expect("recv");
        assert_eq!(imp.handle().shape[0], n);
        imp.release();
    }
}

/// A description, within and beyond what a key holds.
#[derive(Debug, Clone)]
struct Desc {
    dtype: (u8, u8, u16),
    shape: Vec<i64>,
    strides: Option<Vec<i64>>,
    storage_offset: u64,
    storage_size: Option<u64>,
    tensor_offset: i64,
    inflight: bool,
    event: bool,
}

impl Desc {
    fn desc(&self) -> TensorDesc<'_> {
        TensorDesc {
            dtype: crate::dtype::DevshareDType::new(self.dtype.0, self.dtype.1, self.dtype.2),
            shape: &self.shape,
            strides: self.strides.as_deref(),
            storage_offset: self.storage_offset,
            storage_size: self.storage_size,
            tensor_offset: self.tensor_offset,
            inflight: self.inflight,
            event: self.event,
            ..Default::default()
        }
    }
}

fn descs() -> impl proptest::strategy::Strategy<Value = Desc> {
    use proptest::prelude::*;
    // Few values per field, so that two draws are often equal or differ in one field only; up
    // to 9 dimensions (a key holds 8), strides of another length than the shape included.
    (
        (0u8..2, prop_oneof![Just(8u8), Just(32)], 1u16..3),
        prop::collection::vec(0i64..3, 0..=9),
        prop::option::of(prop::collection::vec(0i64..3, 0..=9)),
        (0u64..2, prop::option::of(0u64..2), -1i64..1),
        (any::<bool>(), any::<bool>()),
    )
        .prop_map(|(dtype, shape, strides, (storage_offset, storage_size, tensor_offset), (inflight, event))| {
            Desc { dtype, shape, strides, storage_offset, storage_size, tensor_offset, inflight, event }
        })
}

proptest::proptest! {
    /// The repeat check compares a description with the last key where it lies: its verdict is
    /// the full key's, made and compared, for any two descriptions.
    #[test]
    fn a_description_matches_a_key_exactly_when_its_own_key_is_that_key(a in descs(), b in descs()) {
        if let Some(k) = pool::DescKey::of(&a.desc()) {
            let full = pool::DescKey::of(&b.desc()) == Some(k);
            proptest::prop_assert_eq!(k.matches(&b.desc()), full);
            proptest::prop_assert!(k.matches(&a.desc()));
        }
    }
}

/// A channel with one connected consumer: the channel, the connection, the peer's id.
fn connected(name: &str) -> (LocalChannel, super::super::consumer::LocalConnection, u64) {
    const T: Option<Duration> = Some(Duration::from_secs(10));
    let addr = format!("@devshare-unit-{name}-{}", std::process::id());
    let ch = LocalChannel::listen(&addr).expect("listen");
    let c = std::thread::scope(|s| {
        let c = s.spawn(|| super::super::consumer::LocalConnection::connect(&addr, T));
        ch.wait_peers(1, T).expect("peers");
        c.join().expect("join").expect("connect")
    });
    let peer = ch.peer_ids().expect("ids")[0];
    (ch, c, peer)
}

#[test]
fn a_slot_set_aside_for_the_next_acquire_is_free_to_everything_but_an_acquire() {
    const T: Option<Duration> = Some(Duration::from_secs(10));
    let (ch, c, peer) = connected("aside");
    let exp = Arc::new(Exporter::channel_host_alloc(3 * 64).expect("alloc"));
    let base = exp.ptr();
    let pool = ch.pool(exp, 64, 3).expect("pool");
    let desc = TensorDesc { shape: &[64], ..Default::default() };
    let aside = || pool.next.load(Ordering::SeqCst).checked_sub(1).map(|s| s as u32);
    let (s0, _) = pool.acquire(T).expect("acquire");
    assert_eq!(aside(), None, "an acquire sets nothing aside");
    pool.send(s0, peer, &desc).expect("send");
    let s1 = aside().expect("the send set a slot aside");
    assert_ne!(s1, s0);
    assert_eq!(pool.info().expect("info").2, 2, "a set-aside slot counts as free");
    // Not acquired: refused by send and release as a free slot is, and nothing changes.
    let e = pool.send(s1, peer, &desc).expect_err("a set-aside slot is not acquired");
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("free"), "{e}");
    let e = pool.release(s1).expect_err("a set-aside slot is not acquired");
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("free"), "{e}");
    assert_eq!(aside(), Some(s1));
    // The next acquire takes it (its address is the slot's), and then it is acquired.
    let (got, ptr) = pool.acquire(T).expect("acquire");
    assert_eq!((got, ptr), (s1, base.wrapping_add(64 * s1 as usize)));
    assert_eq!((aside(), pool.info().expect("info").2), (None, 1));
    pool.send(s1, peer, &desc).expect("an acquired set-aside slot is sent");
    // Sent twice: refused.
    assert!(matches!(pool.send(s1, peer, &desc), Err(Error::InvalidArgument(_))));
    let s2 = aside().expect("the third slot, set aside");
    // An acquire under the lock with nothing free takes the set-aside slot (a waiting thread
    // must not miss it), and it is acquired.
    let got = pool.take_free(&mut None).expect("look").map(|(s, _)| s);
    assert_eq!((got, aside()), (Some(s2), None));
    pool.release(s2).expect("release an acquired slot");
    // The items come back; a pool closed or a channel closed sets nothing aside any more.
    for _ in 0..2 {
        c.recv(T).expect("recv").release();
    }
    let (held, _) = pool.acquire(T).expect("acquire"); // s2, from the free list
    let (s, _) = pool.acquire(T).expect("acquire"); // the returns taken: one of two
    pool.send(s, peer, &desc).expect("send");
    assert!(aside().is_some_and(|a| a != held && a != s), "the other returned slot, set aside");
    ch.close();
    assert_eq!(aside(), None, "the channel's close takes the set-aside slot back");
    assert!(matches!(pool.acquire(T), Err(Error::Closed(_))));
}

#[test]
fn threads_that_acquire_one_pool_never_hold_the_same_slot() {
    const T: Option<Duration> = Some(Duration::from_secs(30));
    const ITEMS: usize = 2000;
    let (ch, c, peer) = connected("aside-threads");
    let pool = ch.pool(Arc::new(Exporter::channel_host_alloc(4 * 64).expect("alloc")), 64, 4).expect("pool");
    let held: Vec<std::sync::atomic::AtomicBool> = (0..4).map(|_| Default::default()).collect();
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                for _ in 0..ITEMS {
                    let (slot, _) = pool.acquire(T).expect("acquire");
                    assert!(!held[slot as usize].swap(true, Ordering::SeqCst), "slot {slot} acquired twice");
                    held[slot as usize].store(false, Ordering::SeqCst);
                    pool.send(slot, peer, &TensorDesc { shape: &[64], ..Default::default() }).expect("send");
                }
            });
        }
        for _ in 0..2 * ITEMS {
            c.recv(T).expect("recv").release();
        }
    });
}

#[test]
fn ring_releases_of_leases_a_consumer_does_not_hold_are_protocol_errors_that_give_back_nothing() {
    const T: Option<Duration> = Some(Duration::from_secs(10));
    let (ch, c, peer) = connected("ring-releases");
    let exp = Exporter::channel_host_alloc(1 << 16).expect("alloc");
    ch.register(&exp).expect("register");
    let desc = TensorDesc { shape: &[16], ..Default::default() };
    // The first lease pins the window; the next ones are LEASE records in the ring.
    for _ in 0..3 {
        ch.send(peer, &exp, &desc).expect("send");
        c.recv(T).expect("recv").release();
        exp.wait(T).expect("wait");
    }
    let ring = c.ring().expect("the leases made a ring");
    ch.send(peer, &exp, &desc).expect("send");
    let held = c.recv(T).expect("recv");
    let lease = 4; // the channel's fourth lease (leases are numbered from 1)
    let errors = || ch.peer_info(peer).expect("info").protocol_errors;
    // A lease never given, then the held one twice: the first of those counts, the second is
    // an error, and the lease never given is one.
    assert!(ring.push_release(lease + 1000));
    ch.service(Some(Duration::from_millis(10))).expect("service");
    assert_eq!((errors(), exp.outstanding().expect("n")), (1, 1), "a lease never given gives nothing back");
    assert!(ring.push_release(lease));
    assert!(ring.push_release(lease));
    ch.service(Some(Duration::from_millis(10))).expect("service");
    assert_eq!((errors(), exp.outstanding().expect("n")), (2, 0), "the held lease back once, the repeat refused");
    drop(held); // its own release now is one more refused release
    ch.service(Some(Duration::from_millis(10))).expect("service");
    assert_eq!((errors(), exp.outstanding().expect("n")), (3, 0));
}

#[test]
fn one_look_at_the_listener_takes_at_most_64_connections_and_the_next_looks_take_the_rest() {
    let addr = format!("@devshare-unit-accepts-{}", std::process::id());
    let ch = LocalChannel::listen(&addr).expect("listen");
    let name = addr.strip_prefix('@').expect("abstract");
    let to = rustix::net::SocketAddrUnix::new_abstract_name(name.as_bytes()).expect("name");
    // (Several processes' worth would be refused per process; these wait unaccepted, one pid.)
    let clients: Vec<OwnedFd> = (0..peers::ACCEPTS_PER_PASS + 6)
        .map(|_| {
            let fd = rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)
                .expect("socket");
            rustix::net::connect(&fd, &to).expect("connect");
            fd
        })
        .collect();
    let epfd = ch.shared.epoll.as_fd();
    let first = ch.shared.lock().expect("lock").accept_all(epfd);
    let second = ch.shared.lock().expect("lock").accept_all(epfd);
    let third = ch.shared.lock().expect("lock").accept_all(epfd);
    assert_eq!((first, second, third), (peers::ACCEPTS_PER_PASS, 6, 0), "{} waiting", clients.len());
}

/// A registered export dropped while the channel's lock is held (here: by this very thread, as
/// when a pool's export goes with the pool under the lock) cannot be retired at once; the
/// holder retires it as it lets the lock go, and its consumer is told. Dropped while the lock is
/// free, it is retired at once. Each time the consumer that kept it gets `RETIRE`.
#[test]
fn a_registered_export_dropped_is_retired_at_once_or_when_the_lock_is_let_go() {
    let addr = format!("@devshare-unit-retire-{}", std::process::id());
    let ch = LocalChannel::listen(&addr).expect("listen");
    let fd = announce_with(&addr, std::process::id() as i32, wire::FEATURE_SHARES | wire::FEATURE_KEEP);
    ch.wait_peers(1, Some(Duration::from_secs(10))).expect("a peer");
    let peer = ch.peer_ids().expect("ids")[0];
    let shape = [16i64];
    for held in [true, false] {
        let exp = Exporter::channel_host_alloc(1 << 12).expect("memfd");
        ch.register(&exp).expect("register");
        ch.send(peer, &exp, &TensorDesc { shape: &shape, ..Default::default() }).expect("send");
        let sent = drain(&ch, &fd);
        assert!(sent.iter().all(|&(ty, ..)| ty != wire::RETIRE) && !sent.is_empty(), "{sent:?}");
        let registered = || ch.shared.registered.load(Ordering::Acquire);
        if held {
            let guard = ch.shared.lock().expect("lock");
            drop(exp);
            assert_eq!(registered(), 1, "dropped under the lock: not retired yet");
            drop(guard);
            assert_eq!(registered(), 0, "retired as the lock was let go");
        } else {
            drop(exp);
            assert_eq!(registered(), 0, "dropped with the lock free: retired at once");
        }
        let told = drain(&ch, &fd); // (serves the channel first)
        assert_eq!(registered(), 0, "held {held}: retired");
        assert_eq!(told.iter().filter(|&&(ty, ..)| ty == wire::RETIRE).count(), 1, "held {held}: {told:?}");
    }
    ch.close();
}
