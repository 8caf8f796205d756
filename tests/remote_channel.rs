//! Remote channels (`tcp://HOST:PORT`): pools across hosts, over loopback here. Items travel on
//! the authenticated connection by default; the tests of the UCX path (`DEVSHARE_REMOTE_DATA=ucx`,
//! `UCX_TLS=tcp`) are skipped, with a line saying why, when no UCX library loads. The tests from
//! an attacker's side (no key, a wrong proof, a relay, a flood) are at the end.

mod common;

use devshare::channel::{Channel, Connection};
use devshare::export::{Exporter, TensorDesc};
use devshare::Status;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

const T: Option<Duration> = Some(Duration::from_secs(20));
const ROLE: &str = "DEVSHARE_REMOTE_ROLE";
const KEY_ENV: &str = "DEVSHARE_CHANNEL_KEY_FILE";

/// A key file of `bytes`, mode 0600, in a directory of this test process.
fn key_file(name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("devshare-remote-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p
}

/// This process's key (and UCX over TCP, for the tests that choose UCX); always `true`: the
/// stream path needs no UCX.
fn setup() -> bool {
    ucx_setup();
    true
}

/// As [`setup`]; `false` (the UCX test is skipped) without UCX.
fn ucx_setup() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| {
        std::env::set_var("UCX_TLS", "tcp");
        std::env::set_var("UCX_WARN_UNUSED_ENV_VARS", "n");
        // The killed peers below make UCX log its lost connections: expected here.
        std::env::set_var("UCX_LOG_LEVEL", "fatal");
        if std::env::var_os(KEY_ENV).is_none() {
            std::env::set_var(KEY_ENV, key_file("channel.key", b"a key shared by both ends, 41 bytes long"));
        }
        match devshare::channel::ucx::probe() {
            Ok(_) => true,
            Err(e) => {
                eprintln!("SKIPPED: no UCX library: {e}");
                false
            }
        }
    })
}

fn listen() -> (Channel, String) {
    let ch = Channel::listen("tcp://127.0.0.1:0").unwrap();
    let addr = format!("tcp://{}", ch.tcp_address().unwrap().unwrap());
    (ch, addr)
}

fn pattern(seq: u64, i: usize) -> u8 {
    (seq as usize * 31 + i * 7 + 1) as u8
}

#[test]
fn items_arrive_byte_exact_in_slots_that_keep_their_address_and_wait_for_the_consumers_slots() {
    setup();
    assert_eq!(byte_exact(), 1, "items travel on the authenticated connection by default");
}

#[test]
fn on_the_ucx_path_items_arrive_byte_exact_too_when_both_ends_choose_it() {
    if !ucx_setup() {
        return;
    }
    // The data path is chosen per process (DEVSHARE_REMOTE_DATA): both ends in a child.
    let (ok, text) = in_child("byte_exact", Some("ucx"));
    assert!(ok && text.contains("said: byte exact on 2"), "{text}");
}

/// Run `role` of this test binary in a child process (with `DEVSHARE_REMOTE_DATA=data` when
/// given): whether it succeeded, and what it printed.
fn in_child(role: &str, data: Option<&str>) -> (bool, String) {
    let mut c = common::role("remote_child", &[(ROLE, role.as_ref()), ("DEVSHARE_REMOTE_ADDRESS", "".as_ref())]);
    if let Some(d) = data {
        c.env("DEVSHARE_REMOTE_DATA", d);
    }
    let out = c.output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned())
}

/// One producer and one consumer (a thread) in this process: 4 KiB items at an odd offset,
/// backpressure, then 64 MiB items, every byte checked; returns the data path the consumer took.
fn byte_exact() -> u32 {
    const BIG: u64 = 64 << 20;
    let (ch, addr) = listen();
    let released = Arc::new(AtomicBool::new(false));
    let r2 = released.clone();
    let consumer = std::thread::spawn(move || {
        let c = Connection::connect(&addr, T).unwrap();
        let path = c.transport();
        let mut bases = std::collections::HashMap::new();
        // 4 KiB at an odd offset, six times through two slots: byte-exact, one address per slot.
        for seq in 0..6u64 {
            let imp = c.recv(T).unwrap();
            let (pool, slot) = imp.pool_slot().unwrap();
            assert_eq!(pool, 1);
            let v = imp.view();
            let data = v.data as *const u8;
            // SAFETY: the item's 4096 bytes are mapped while `imp` lives.
            let bytes = unsafe { std::slice::from_raw_parts(data, 4096) };
            assert!(bytes.iter().enumerate().all(|(i, &b)| b == pattern(seq, i)), "item {seq} is byte-exact");
            let base = v.data as usize - 13;
            assert_eq!(*bases.entry(slot).or_insert(base), base, "slot {slot} keeps its address");
            imp.release();
        }
        // Backpressure: both of this consumer's slots held; the producer's next send waits.
        let a = c.recv(T).unwrap();
        let b = c.recv(T).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        r2.store(true, Ordering::SeqCst);
        drop(a);
        // The third item, then 64 MiB items byte-exact.
        let third = c.recv(T).unwrap();
        drop(third);
        drop(b);
        for seq in 0..3u64 {
            let imp = c.recv(T).unwrap();
            let v = imp.view();
            // SAFETY: the item's bytes are mapped while `imp` lives.
            let bytes = unsafe { std::slice::from_raw_parts(v.data as *const u8, BIG as usize) };
            let wrong = bytes.iter().enumerate().position(|(i, &b)| b != pattern(100 + seq, i));
            assert_eq!(wrong, None, "64 MiB item {seq}");
            imp.release();
        }
        assert_eq!(c.recv(T).err().map(|e| e.status()), Some(Status::Closed));
        path
    });
    ch.wait_peers(1, T).unwrap();
    let peer = ch.peer_ids().unwrap()[0];
    let exp = Arc::new(Exporter::channel_host_alloc(2 * BIG).unwrap());
    let pool = ch.pool(exp.clone(), BIG, 2).unwrap();
    let send = |seq: u64, offset: u64, len: u64| {
        let (slot, ptr) = pool.acquire(T).unwrap();
        for i in 0..len as usize {
            // SAFETY: inside the acquired slot.
            unsafe { *ptr.add(offset as usize + i) = pattern(seq, i) };
        }
        let shape = [len as i64];
        pool.send(slot, peer, &TensorDesc { shape: &shape, storage_offset: offset, ..Default::default() }).unwrap();
    };
    for seq in 0..6 {
        send(seq, 13, 4096);
    }
    assert_eq!(pool.info().unwrap().2, 2, "the producer's slots come back once the put completed");
    send(6, 13, 4096);
    send(7, 13, 4096);
    send(8, 13, 4096); // waits until the consumer gives a slot back
    assert!(released.load(Ordering::SeqCst), "the send waited for a slot of the consumer");
    for seq in 0..3 {
        send(100 + seq, 0, BIG);
    }
    let info = ch.peer_info(peer).unwrap();
    assert_eq!(info.protocol_errors, 0);
    drop(pool);
    ch.close();
    assert_eq!(consumer.join().unwrap(), info.transport, "both ends name the same path");
    info.transport
}

#[test]
fn what_a_remote_channel_does_not_carry_is_refused_by_name() {
    if !setup() {
        return;
    }
    let (ch, _) = listen();
    assert_eq!(ch.restrict(&[0], &[]).unwrap_err().status(), Status::Unsupported);
    let dev = Arc::new(Exporter::channel_host_alloc(4096).unwrap());
    assert_eq!(ch.send(1, &dev, &TensorDesc::default()).unwrap_err().status(), Status::Unsupported);
    let pool = ch.pool(dev, 1024, 4).unwrap();
    assert_eq!(pool.set_spin(Duration::from_micros(10)).unwrap_err().status(), Status::Unsupported);
    assert_eq!(ch.set_spin(Duration::from_micros(10)).unwrap_err().status(), Status::Unsupported);
    assert_eq!(Channel::listen("tcp://127.0.0.1").err().unwrap().status(), Status::InvalidArgument);
    assert_eq!(Connection::connect("tcp://127.0.0.1:1", T).err().unwrap().status(), Status::NotFound);
}

/// A consumer in a child process: connects with the key its environment names and reports.
#[test]
#[ignore = "a role of the tests below, run in a child process"]
fn remote_child() {
    let Ok(role) = std::env::var(ROLE) else { return };
    let usable = ucx_setup();
    let ucx = std::env::var("DEVSHARE_REMOTE_DATA").as_deref() == Ok("ucx");
    assert!(usable || role == "nolib" || !ucx, "UCX loads in the child");
    let addr = std::env::var("DEVSHARE_REMOTE_ADDRESS").unwrap();
    let out = std::io::stdout();
    match role.as_str() {
        "connect" => {
            let r = Connection::connect(&addr, T);
            let mut o = out.lock();
            match r {
                Ok(_) => writeln!(o, "said: connected").unwrap(),
                Err(e) => writeln!(o, "said: refused {:?} {e}", e.status()).unwrap(),
            }
        }
        "stream" => {
            // Receive and release items as they come, saying so after the third, until killed.
            let c = Connection::connect(&addr, T).unwrap();
            for n in 1.. {
                c.recv(T).unwrap().release();
                if n == 3 {
                    writeln!(out.lock(), "said: streaming").unwrap();
                }
            }
        }
        "slow_reader" => {
            let said = slow_reader();
            writeln!(out.lock(), "said: {said}").unwrap();
        }
        "cuda_big" => {
            let said = cuda_big();
            writeln!(out.lock(), "said: {said}").unwrap();
        }
        "cuda_stall" => {
            let said = cuda_stall();
            writeln!(out.lock(), "said: {said}").unwrap();
        }
        "byte_exact" => {
            let path = byte_exact();
            writeln!(out.lock(), "said: byte exact on {path}").unwrap();
        }
        "listeners" => {
            // A producer and a consumer with an item between them, then the sockets listening.
            let (ch, addr) = listen();
            let c = std::thread::spawn(move || {
                let c = Connection::connect(&addr, T).unwrap();
                c.recv(T).unwrap().release();
                c
            });
            ch.wait_peers(1, T).unwrap();
            let exp = Arc::new(Exporter::channel_host_alloc(4096).unwrap());
            let pool = ch.pool(exp, 4096, 1).unwrap();
            let (slot, _) = pool.acquire(T).unwrap();
            pool.send(slot, ch.peer_ids().unwrap()[0], &TensorDesc { shape: &[16], ..Default::default() }).unwrap();
            let _c = c.join().unwrap();
            let own = ch.tcp_address().unwrap().unwrap().to_string();
            writeln!(out.lock(), "said: {own} {:?}", listening_sockets()).unwrap();
        }
        "nolib" => {
            // UCX named by DEVSHARE_UCX_LIBRARY is not UCX: listening and connecting say so.
            let l = Channel::listen("tcp://127.0.0.1:0").err().map(|e| e.status());
            let c = Connection::connect(&addr, T).err().map(|e| e.status());
            writeln!(out.lock(), "said: {l:?} {c:?}").unwrap();
        }
        "produce_big" => {
            // A producer streaming 64 MiB items to the first peer until killed.
            let ch = Channel::listen("tcp://127.0.0.1:0").unwrap();
            writeln!(out.lock(), "said: tcp://{}", ch.tcp_address().unwrap().unwrap()).unwrap();
            ch.wait_peers(1, T).unwrap();
            let peer = ch.peer_ids().unwrap()[0];
            let exp = Arc::new(Exporter::channel_host_alloc(2 << 26).unwrap());
            let pool = ch.pool(exp, 64 << 20, 2).unwrap();
            loop {
                let (slot, _) = pool.acquire(T).unwrap();
                if pool.send(slot, peer, &TensorDesc { shape: &[64 << 20], ..Default::default() }).is_err() {
                    break;
                }
            }
        }
        "one_device" => {
            // A consumer that sees one CUDA device (the stand-in's CUDA_STANDIN_VISIBLE=0):
            // a pool on device 1 is refused, and the connection ends.
            let _cu = Cu::new();
            let c = Connection::connect(&addr, T).unwrap();
            let e = c.recv(T).err().expect("a pool on a device this process does not see");
            let then = c.recv(T).err().map(|e| e.status());
            writeln!(out.lock(), "said: {:?} {then:?} {e}", e.status()).unwrap();
        }
        "hold" => {
            // Receive one item, say so, and hold it until killed.
            let c = Connection::connect(&addr, T).unwrap();
            let imp = c.recv(T).unwrap();
            writeln!(out.lock(), "said: holding {:?}", imp.pool_slot()).unwrap();
            std::thread::sleep(Duration::from_secs(60));
        }
        "produce" => {
            // A producer: one item to the first peer, then wait to be killed.
            let ch = Channel::listen("tcp://127.0.0.1:0").unwrap();
            writeln!(out.lock(), "said: tcp://{}", ch.tcp_address().unwrap().unwrap()).unwrap();
            ch.wait_peers(1, T).unwrap();
            let peer = ch.peer_ids().unwrap()[0];
            let exp = Arc::new(Exporter::channel_host_alloc(4096 * 2).unwrap());
            let pool = ch.pool(exp, 4096, 2).unwrap();
            let (slot, _) = pool.acquire(T).unwrap();
            pool.send(slot, peer, &TensorDesc { shape: &[16], ..Default::default() }).unwrap();
            writeln!(out.lock(), "said: sent").unwrap();
            loop {
                ch.service(Some(Duration::from_millis(100))).unwrap();
            }
        }
        r => panic!("unknown role {r}"),
    }
}

fn child(role: &str, addr: &str, key: Option<&std::path::Path>) -> std::process::Child {
    let mut c = common::role("remote_child", &[(ROLE, role.as_ref()), ("DEVSHARE_REMOTE_ADDRESS", addr.as_ref())]);
    match key {
        Some(k) => {
            c.env(KEY_ENV, k);
        }
        None => {
            c.env(KEY_ENV, "/nonexistent/devshare/channel.key");
        }
    }
    c.stdout(Stdio::piped()).spawn().unwrap()
}

/// A producer child in `role` with the key file `key`, and what it says (its `said:` lines).
fn producer_child(role: &str, key: &std::path::Path) -> (std::process::Child, impl Iterator<Item = String>) {
    let mut p = common::role("remote_child", &[(ROLE, role.as_ref()), ("DEVSHARE_REMOTE_ADDRESS", "".as_ref())])
        .env(KEY_ENV, key)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = BufReader::new(p.stdout.take().unwrap())
        .lines()
        .map_while(|l| l.ok())
        .filter_map(|l| l.split_once("said: ").map(|(_, r)| r.to_string()));
    (p, lines)
}

/// Serve `ch` while waiting for the child's first line.
fn first_line(ch: &Channel, child: &mut std::process::Child) -> String {
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // The first line the role says (the test harness prints lines of its own).
        let mut lines = BufReader::new(stdout).lines().map_while(|l| l.ok());
        let said = lines.by_ref().find_map(|l| l.split_once("said: ").map(|(_, r)| r.to_string()));
        let _ = tx.send(said.unwrap_or_default());
        lines.for_each(drop); // the rest, so that the child's harness can finish writing
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(l) = rx.try_recv() {
            return l;
        }
        assert!(Instant::now() < deadline, "the child said nothing");
        ch.service(Some(Duration::from_millis(10))).unwrap();
    }
}

/// Serve `ch` while reading what it says to the hand-made peer `raw`, until it drops the
/// connection (at most 10 s).
fn until_dropped(ch: &Channel, mut raw: std::net::TcpStream) -> Vec<u8> {
    raw.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut buf = Vec::new();
    loop {
        ch.service(Some(Duration::from_millis(10))).unwrap();
        let mut b = [0u8; 4096];
        match std::io::Read::read(&mut raw, &mut b) {
            Ok(0) => return buf,
            Ok(n) => buf.extend_from_slice(&b[..n]),
            Err(_) => {}
        }
        assert!(Instant::now() < deadline, "the connection was not dropped");
    }
}

#[test]
fn a_peer_with_the_wrong_key_no_key_or_garbage_is_refused_and_nothing_is_registered_for_it() {
    if !setup() {
        return;
    }
    let (ch, addr) = listen();
    let wrong = key_file("wrong.key", b"another key, of the right length at least");
    let mut c = child("connect", &addr, Some(&wrong));
    let said = first_line(&ch, &mut c);
    assert!(said.starts_with("refused Untrusted") && said.contains("key"), "{said}");
    c.wait().unwrap();
    let mut c = child("connect", &addr, None);
    let said = first_line(&ch, &mut c);
    assert!(said.starts_with("refused NotFound") && said.contains("channel.key"), "{said}");
    c.wait().unwrap();
    // Garbage instead of the handshake, and a silent connection: dropped, never a peer.
    let mut raw = std::net::TcpStream::connect(addr.strip_prefix("tcp://").unwrap()).unwrap();
    raw.write_all(&[8, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
    let buf = until_dropped(&ch, raw);
    assert!(String::from_utf8_lossy(&buf).contains("not one this devshare remote channel speaks"), "{buf:?}");
    assert!(ch.peer_ids().unwrap().is_empty(), "no peer was admitted");
    // The right key still gets in.
    let mut c = child("connect", &addr, Some(std::path::Path::new(&std::env::var_os(KEY_ENV).unwrap())));
    assert_eq!(first_line(&ch, &mut c), "connected");
    c.wait().unwrap();
}

#[test]
fn a_killed_consumer_costs_the_producer_nothing_and_a_killed_producer_ends_the_consumers_receive() {
    if !setup() {
        return;
    }
    let key = std::path::PathBuf::from(std::env::var_os(KEY_ENV).unwrap());
    // The consumer dies holding an item: the producer sees it gone and goes on.
    let (ch, addr) = listen();
    let mut c = child("hold", &addr, Some(&key));
    ch.wait_peers(1, T).unwrap();
    let peer = ch.peer_ids().unwrap()[0];
    let exp = Arc::new(Exporter::channel_host_alloc(4096 * 2).unwrap());
    let pool = ch.pool(exp, 4096, 2).unwrap();
    let (slot, _) = pool.acquire(T).unwrap();
    pool.send(slot, peer, &TensorDesc { shape: &[16], ..Default::default() }).unwrap();
    assert!(first_line(&ch, &mut c).starts_with("holding Some((1, 0))"));
    c.kill().unwrap();
    c.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ch.peer_ids().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "the dead consumer is still a peer");
        ch.service(Some(Duration::from_millis(10))).unwrap();
    }
    assert_eq!(pool.info().unwrap().2, 2, "every slot of the producer is free");
    let (slot, _) = pool.acquire(T).unwrap();
    let e = pool.send(slot, peer, &TensorDesc { shape: &[16], ..Default::default() }).unwrap_err();
    assert_eq!(e.status(), Status::NotFound, "{e}");
    pool.release(slot).unwrap();

    // The producer dies: the consumer's receive fails with CLOSED, at once.
    let (mut p, mut lines) = producer_child("produce", &key);
    let addr = lines.next().unwrap();
    let c = Connection::connect(&addr, T).unwrap();
    let item = c.recv(T).unwrap();
    assert_eq!(lines.next().unwrap(), "sent");
    std::thread::spawn(move || lines.for_each(drop));
    p.kill().unwrap();
    p.wait().unwrap();
    assert_eq!(c.recv(T).err().map(|e| e.status()), Some(Status::Closed), "CLOSED, not a timeout");
    // SAFETY: the item's 16 bytes stay mapped while it lives.
    let _ = unsafe { *(item.view().data as *const u8) };
    drop(item);
}

#[test]
fn a_consumer_killed_in_the_middle_of_64_mib_transfers_fails_the_send_without_a_hang() {
    if !setup() {
        return;
    }
    const BIG: u64 = 64 << 20;
    let key = std::path::PathBuf::from(std::env::var_os(KEY_ENV).unwrap());
    let (ch, addr) = listen();
    let mut c = child("stream", &addr, Some(&key));
    ch.wait_peers(1, T).unwrap();
    let peer = ch.peer_ids().unwrap()[0];
    let exp = Arc::new(Exporter::channel_host_alloc(2 * BIG).unwrap());
    let pool = ch.pool(exp, BIG, 2).unwrap();
    let stdout = c.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines().map_while(|l| l.ok());
        if lines.by_ref().any(|l| l.contains("said: streaming")) {
            let _ = tx.send(());
        }
        lines.for_each(drop);
    });
    let mut killed = false;
    let mut failed = None;
    for _ in 0..200 {
        if !killed && rx.try_recv().is_ok() {
            c.kill().unwrap(); // its sockets close as it dies; reaped below
            killed = true;
        }
        let (slot, _) = pool.acquire(T).unwrap();
        match pool.send(slot, peer, &TensorDesc { shape: &[BIG as i64], ..Default::default() }) {
            Ok(()) => {}
            Err(e) => {
                pool.release(slot).unwrap(); // a failed send leaves the slot acquired
                failed = Some(e.status());
                break;
            }
        }
    }
    let _ = c.kill();
    c.wait().unwrap();
    assert!(killed, "the consumer streamed three items");
    let status = failed.expect("a send to the killed consumer failed");
    assert!(matches!(status, Status::Closed | Status::NotFound), "{status:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ch.peer_ids().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "the dead consumer is still a peer");
        ch.service(Some(Duration::from_millis(10))).unwrap();
    }
    assert_eq!(pool.info().unwrap().2, 2, "every slot of the producer is free");
}

/// Consumer A of the two tests around: a thread that connects to `addr`, takes one item (so its
/// copy of the pool is made), then reads nothing more until told to hang up. `first` runs on
/// the thread before anything else (what it returns lives until the hang-up).
fn consumer_that_stops_reading<G>(
    addr: &str,
    first: impl FnOnce() -> G + Send + 'static,
) -> (std::thread::JoinHandle<()>, std::sync::mpsc::Sender<()>) {
    let (hang_up, hang_up_rx) = std::sync::mpsc::channel::<()>();
    let addr = addr.to_string();
    let a = std::thread::spawn(move || {
        let _kept = first();
        let c = Connection::connect(&addr, T).unwrap();
        drop(c.recv(T).unwrap());
        hang_up_rx.recv().unwrap();
        drop(c);
    });
    (a, hang_up)
}

/// The same with a CUDA pool (the stand-in): a large item crosses through a chunk buffer of its
/// own, so the pool's other items (a small one through the pool's staging slot, a large one
/// through a second chunk buffer) go to B while A is stuck (they waited the 10 s before).
#[test]
fn a_consumer_stuck_in_a_large_cuda_item_holds_up_no_item_of_the_pool_to_another() {
    setup();
    let (ok, text) = in_child("cuda_stall", None);
    assert!(ok && text.contains("said: B's items arrived"), "{text}");
}

fn cuda_stall() -> String {
    const SLOT: usize = 32 << 20;
    let cu = Cu::new();
    let (ch, addr) = listen();
    let (a, hang_up) = consumer_that_stops_reading(&addr, Cu::new);
    ch.wait_peers(1, T).unwrap();
    let peer_a = ch.peer_ids().unwrap()[0];
    let b = std::thread::spawn(move || {
        let _cu = Cu::new();
        let c = Connection::connect(&addr, T).unwrap();
        for _ in 0..2 {
            c.recv(T).unwrap().release();
        }
    });
    ch.wait_peers(2, T).unwrap();
    let peer_b = *ch.peer_ids().unwrap().iter().find(|&&p| p != peer_a).unwrap();
    let (exp, dev) = cu.export(SLOT, 3);
    let pool = ch.pool(exp.clone(), SLOT as u64, 3).unwrap();
    let send = |peer, len: usize| {
        let (slot, _) = pool.acquire(T).unwrap();
        let r = pool.send(
            slot,
            peer,
            &TensorDesc { shape: &[len as i64], storage_size: Some(len as u64), ..Default::default() },
        );
        (slot, r)
    };
    send(peer_a, 4096).1.unwrap();
    let took = std::thread::scope(|s| {
        let to_a = s.spawn(|| send(peer_a, SLOT));
        std::thread::sleep(Duration::from_millis(500));
        assert!(!to_a.is_finished(), "the item to A, which does not read, is still on its way");
        let started = Instant::now();
        send(peer_b, 4096).1.unwrap();
        send(peer_b, 2 << 20).1.unwrap();
        let took = started.elapsed();
        hang_up.send(()).unwrap();
        let (slot, r) = to_a.join().unwrap();
        assert!(r.is_err(), "the item to A failed once A hung up");
        pool.release(slot).unwrap();
        took
    });
    a.join().unwrap();
    b.join().unwrap();
    drop(pool);
    ch.close();
    drop(exp);
    cu.free(dev);
    assert!(took < Duration::from_secs(5), "B's items took {took:?}: they waited behind the item to A");
    format!("B's items arrived in {} ms", took.as_millis())
}

/// Two consumers of one producer; A takes an item, then stops reading while a 32 MiB item to it
/// is on its way. The sends to B (small and large, from another thread) go on meanwhile: the
/// large item to A is written without the channel's lock (before 1.16.1 they waited up to the
/// 10 s send limit behind it). Once A hangs up, the send to it fails at once, its slot stays
/// acquired, and every slot comes back.
#[test]
fn a_consumer_that_stops_reading_in_the_middle_of_a_large_item_holds_up_no_send_to_another() {
    if !setup() {
        return;
    }
    const BIG: u64 = 32 << 20;
    const B_ITEMS: u64 = 12;
    let (ch, addr) = listen();
    let (a, hang_up) = consumer_that_stops_reading(&addr, || ());
    ch.wait_peers(1, T).unwrap();
    let peer_a = ch.peer_ids().unwrap()[0];
    let b = std::thread::spawn(move || {
        let c = Connection::connect(&addr, T).unwrap();
        for seq in 0..B_ITEMS {
            let imp = c.recv(T).unwrap();
            let v = imp.view();
            // SAFETY: the item's first 4096 bytes are mapped while `imp` lives.
            let bytes = unsafe { std::slice::from_raw_parts(v.data as *const u8, 4096) };
            assert!(bytes.iter().enumerate().all(|(i, &x)| x == pattern(seq, i)), "B's item {seq} is byte-exact");
            imp.release();
        }
    });
    ch.wait_peers(2, T).unwrap();
    let peer_b = *ch.peer_ids().unwrap().iter().find(|&&p| p != peer_a).unwrap();
    let exp = Arc::new(Exporter::channel_host_alloc(3 * BIG).unwrap());
    let pool = ch.pool(exp, BIG, 3).unwrap();
    let send = |peer: u64, seq: u64, len: u64| {
        let (slot, ptr) = pool.acquire(T).unwrap();
        for i in 0..4096 {
            // SAFETY: inside the acquired slot.
            unsafe { *ptr.add(i) = pattern(seq, i) };
        }
        let r =
            pool.send(slot, peer, &TensorDesc { shape: &[len as i64], storage_size: Some(len), ..Default::default() });
        (slot, r)
    };
    assert!(send(peer_a, 0, 4096).1.is_ok());
    std::thread::scope(|s| {
        let to_a = s.spawn(|| {
            let (slot, r) = send(peer_a, 1, BIG);
            let took = Instant::now();
            (slot, r, took)
        });
        // Until the item to A fills its socket and the kernel's buffers (and stays stuck there).
        std::thread::sleep(Duration::from_millis(500));
        assert!(!to_a.is_finished(), "the send to a consumer that does not read is still on its way");
        let started = Instant::now();
        for seq in 0..B_ITEMS {
            // Small items, and every fourth one larger than what is queued inline (1 MiB).
            let len = if seq % 4 == 3 { 1 << 20 } else { 4096 };
            let (_, r) = send(peer_b, seq, len);
            r.unwrap();
        }
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(5),
            "the sends to B took {took:?}: they waited behind the item to A, which does not read"
        );
        b.join().unwrap();
        assert!(!to_a.is_finished(), "the item to A is still stuck");
        let hung_up = Instant::now();
        hang_up.send(()).unwrap();
        a.join().unwrap();
        let (slot, r, ended) = to_a.join().unwrap();
        let status = r.expect_err("the send to A failed once A hung up").status();
        assert!(matches!(status, Status::Closed), "{status:?}");
        assert!(
            ended.duration_since(hung_up) < Duration::from_secs(5),
            "the send to A failed {:?} after A hung up",
            ended.duration_since(hung_up)
        );
        pool.release(slot).unwrap(); // a failed send leaves the slot acquired
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while ch.peer_ids().unwrap().contains(&peer_a) {
        assert!(Instant::now() < deadline, "A, which hung up, is still a peer");
        ch.service(Some(Duration::from_millis(10))).unwrap();
    }
    assert_eq!(pool.info().unwrap().2, 3, "every slot of the producer is free");
}

#[test]
fn without_ucx_the_ucx_path_is_backend_unavailable_and_the_stream_path_works() {
    if !ucx_setup() {
        return;
    }
    let key = std::path::PathBuf::from(std::env::var_os(KEY_ENV).unwrap());
    let mut c = common::role(
        "remote_child",
        &[
            (ROLE, "nolib".as_ref()),
            ("DEVSHARE_REMOTE_ADDRESS", "tcp://127.0.0.1:1".as_ref()),
            ("DEVSHARE_UCX_LIBRARY", "libm.so.6".as_ref()),
        ],
    )
    .env(KEY_ENV, &key)
    .env("DEVSHARE_REMOTE_DATA", "ucx")
    .stdout(Stdio::piped())
    .spawn()
    .unwrap();
    let mut lines = BufReader::new(c.stdout.take().unwrap()).lines().map_while(|l| l.ok());
    let said = lines.by_ref().find_map(|l| l.split_once("said: ").map(|(_, r)| r.to_string())).unwrap_or_default();
    lines.for_each(drop); // the rest, so that the child's harness can finish writing
    c.wait().unwrap();
    assert_eq!(said, "Some(BackendUnavailable) Some(BackendUnavailable)");
    // The same library setting without the UCX path: listening works, connecting finds nothing
    // at port 1.
    let mut c = common::role(
        "remote_child",
        &[
            (ROLE, "nolib".as_ref()),
            ("DEVSHARE_REMOTE_ADDRESS", "tcp://127.0.0.1:1".as_ref()),
            ("DEVSHARE_UCX_LIBRARY", "libm.so.6".as_ref()),
        ],
    )
    .env(KEY_ENV, &key)
    .stdout(Stdio::piped())
    .spawn()
    .unwrap();
    let mut lines = BufReader::new(c.stdout.take().unwrap()).lines().map_while(|l| l.ok());
    let said = lines.by_ref().find_map(|l| l.split_once("said: ").map(|(_, r)| r.to_string())).unwrap_or_default();
    lines.for_each(drop);
    c.wait().unwrap();
    assert_eq!(said, "None Some(NotFound)");
}

#[test]
fn a_producer_killed_in_the_middle_of_64_mib_transfers_ends_the_consumers_receive() {
    if !setup() {
        return;
    }
    let key = std::path::PathBuf::from(std::env::var_os(KEY_ENV).unwrap());
    let (mut p, mut lines) = producer_child("produce_big", &key);
    let addr = lines.next().unwrap();
    std::thread::spawn(move || lines.for_each(drop));
    let c = Connection::connect(&addr, T).unwrap();
    for _ in 0..2 {
        c.recv(T).unwrap().release();
    }
    // Killed while it puts the next items (the consumer is not receiving: they are in flight).
    p.kill().unwrap();
    p.wait().unwrap();
    let mut got = 0;
    let end = loop {
        match c.recv(T) {
            Ok(item) => {
                got += 1;
                item.release();
                assert!(got < 10, "items keep coming from a dead producer");
            }
            Err(e) => break e.status(),
        }
    };
    assert_eq!(end, Status::Closed, "CLOSED, not a timeout or a garbled item");
}

/// The CUDA stand-in's driver calls these tests make themselves, device 0 bound on the calling
/// thread.
struct Cu {
    lib: libloading::Library,
}

impl Cu {
    fn new() -> Cu {
        let cu = Cu { lib: common::load(common::StandIn::Cuda, "remote") };
        // SAFETY: the stand-in's functions, with their cuda.h signatures.
        unsafe {
            let init: libloading::Symbol<unsafe extern "C" fn(u32) -> i32> = cu.lib.get(b"cuInit").unwrap();
            assert_eq!(init(0), 0);
        }
        cu.bind();
        cu
    }

    fn bind(&self) {
        // SAFETY: as above.
        unsafe {
            let retain: libloading::Symbol<unsafe extern "C" fn(*mut *mut std::ffi::c_void, i32) -> i32> =
                self.lib.get(b"cuDevicePrimaryCtxRetain").unwrap();
            let set: libloading::Symbol<unsafe extern "C" fn(*mut std::ffi::c_void) -> i32> =
                self.lib.get(b"cuCtxSetCurrent").unwrap();
            let mut ctx = std::ptr::null_mut();
            assert_eq!(retain(&mut ctx, 0), 0);
            assert_eq!(set(ctx), 0);
        }
    }

    fn alloc(&self, len: usize) -> u64 {
        let mut p = 0u64;
        // SAFETY: as above.
        let rc = unsafe {
            self.lib.get::<unsafe extern "C" fn(*mut u64, usize) -> i32>(b"cuMemAlloc_v2").unwrap()(&mut p, len)
        };
        assert_eq!(rc, 0);
        p
    }

    fn free(&self, p: u64) {
        // SAFETY: as above; a block of `alloc`.
        assert_eq!(unsafe { self.lib.get::<unsafe extern "C" fn(u64) -> i32>(b"cuMemFree_v2").unwrap()(p) }, 0);
    }

    fn htod(&self, dst: u64, src: &[u8]) {
        // SAFETY: as above; the stand-in checks that `dst` is device memory.
        let f =
            unsafe { self.lib.get::<unsafe extern "C" fn(u64, *const u8, usize) -> i32>(b"cuMemcpyHtoD_v2").unwrap() };
        // SAFETY: as above.
        assert_eq!(unsafe { f(dst, src.as_ptr(), src.len()) }, 0);
    }

    fn dtoh(&self, dst: &mut [u8], src: u64) {
        // SAFETY: as above.
        let f =
            unsafe { self.lib.get::<unsafe extern "C" fn(*mut u8, u64, usize) -> i32>(b"cuMemcpyDtoH_v2").unwrap() };
        // SAFETY: as above; the stand-in checks that `src` is device memory.
        assert_eq!(unsafe { f(dst.as_mut_ptr(), src, dst.len()) }, 0);
    }

    /// A CUDA export of `slots` slots of `slot` bytes (device 0), and its device pointer.
    fn export(&self, slot: usize, slots: usize) -> (Arc<Exporter>, u64) {
        let p = self.alloc(slot * slots);
        let exp = Exporter::export(
            devshare::handle::DEVSHARE_BACKEND_CUDA,
            0,
            p as *mut u8,
            (slot * slots) as u64,
            &Default::default(),
        )
        .unwrap();
        (Arc::new(exp), p)
    }
}

#[test]
fn a_cuda_pool_arrives_in_the_consumers_own_device_memory_whose_slots_keep_their_address() {
    if !setup() {
        return;
    }
    let cu = Cu::new();
    let (ch, addr) = listen();
    let consumer = std::thread::spawn(move || {
        let cu = Cu::new();
        let c = Connection::connect(&addr, T).unwrap();
        let mut bases = std::collections::HashMap::new();
        for seq in 0..8u64 {
            let imp = c.recv(T).unwrap();
            assert_eq!(imp.handle().backend, devshare::handle::DEVSHARE_BACKEND_CUDA, "a CUDA item");
            let (_, slot) = imp.pool_slot().unwrap();
            let v = imp.view();
            let mut bytes = vec![0u8; 4096];
            cu.dtoh(&mut bytes, v.data as u64); // the stand-in refuses anything but device memory
            assert!(bytes.iter().enumerate().all(|(i, &b)| b == pattern(seq, i)), "item {seq} is byte-exact");
            let base = v.data as usize - 13;
            assert_eq!(*bases.entry(slot).or_insert(base), base, "slot {slot} keeps its address");
            imp.release();
        }
        assert_eq!(bases.len(), 2, "both slots were used");
        assert_eq!(c.recv(T).err().map(|e| e.status()), Some(Status::Closed));
    });
    ch.wait_peers(1, T).unwrap();
    let peer = ch.peer_ids().unwrap()[0];
    let (exp, dev) = cu.export(8192, 2);
    let pool = ch.pool(exp.clone(), 8192, 2).unwrap();
    for seq in 0..8u64 {
        let (slot, ptr) = pool.acquire(T).unwrap();
        assert_eq!(ptr as u64, dev + u64::from(slot) * 8192, "the producer's slot is its device memory");
        let bytes: Vec<u8> = (0..4096).map(|i| pattern(seq, i)).collect();
        cu.htod(ptr as u64 + 13, &bytes);
        let shape = [4096i64];
        pool.send(slot, peer, &TensorDesc { shape: &shape, storage_offset: 13, ..Default::default() }).unwrap();
    }
    assert_eq!(ch.peer_info(peer).unwrap().protocol_errors, 0);
    drop(pool);
    ch.close();
    consumer.join().unwrap();
    drop(exp);
    cu.free(dev);
    // SAFETY: the stand-in's test hook.
    let violations = unsafe { cu.lib.get::<unsafe extern "C" fn() -> i32>(b"cusi_violation_count").unwrap()() };
    assert_eq!(violations, 0, "the stand-in saw driver rules broken (see its log)");
}

#[test]
fn large_cuda_items_cross_in_chunks_through_pinned_host_memory_byte_exact() {
    // In a child process: the stand-in's count of pinned ranges is per process.
    setup();
    let (ok, text) = in_child("cuda_big", None);
    assert!(ok && text.contains("said: pinned 3 then 0, 3 items byte-exact"), "{text}");
}

/// Three items of 3 MiB + 5 bytes (past the chunk size, at an odd offset) from a CUDA pool to a
/// consumer thread; says how many host ranges were pinned while both ends lived (the pool's
/// staging slot, the chunk buffer its large items crossed through, the consumer's copy), and
/// after.
fn cuda_big() -> String {
    const SLOT: usize = 4 << 20;
    const LEN: usize = (3 << 20) + 5;
    let cu = Cu::new();
    let (ch, addr) = listen();
    let consumer = std::thread::spawn(move || {
        let cu = Cu::new();
        let c = Connection::connect(&addr, T).unwrap();
        for seq in 0..3u64 {
            let imp = c.recv(T).unwrap_or_else(|e| panic!("item {seq}: {e}"));
            let mut bytes = vec![0u8; LEN];
            cu.dtoh(&mut bytes, imp.view().data as u64);
            let wrong = bytes.iter().enumerate().position(|(i, &b)| b != pattern(seq, i));
            assert_eq!(wrong, None, "item {seq}");
            imp.release();
        }
        assert_eq!(c.recv(T).err().map(|e| e.status()), Some(Status::Closed));
    });
    ch.wait_peers(1, T).unwrap();
    let peer = ch.peer_ids().unwrap()[0];
    let (exp, dev) = cu.export(SLOT, 2);
    let pool = ch.pool(exp.clone(), SLOT as u64, 2).unwrap();
    for seq in 0..3u64 {
        let (slot, ptr) = pool.acquire(T).unwrap();
        let bytes: Vec<u8> = (0..LEN).map(|i| pattern(seq, i)).collect();
        cu.htod(ptr as u64 + 7, &bytes);
        let shape = [LEN as i64];
        pool.send(slot, peer, &TensorDesc { shape: &shape, storage_offset: 7, ..Default::default() }).unwrap();
    }
    // SAFETY: the stand-in's test hooks.
    let registered = unsafe { cu.lib.get::<unsafe extern "C" fn() -> i32>(b"cusi_host_registered").unwrap() };
    // SAFETY: as above.
    let during = unsafe { registered() };
    drop(pool);
    ch.close();
    consumer.join().unwrap();
    drop(exp);
    cu.free(dev);
    // SAFETY: as above.
    let after = unsafe { registered() };
    // SAFETY: as above.
    let violations = unsafe { cu.lib.get::<unsafe extern "C" fn() -> i32>(b"cusi_violation_count").unwrap()() };
    assert_eq!(violations, 0, "the stand-in saw driver rules broken (see its log)");
    format!("pinned {during} then {after}, 3 items byte-exact")
}

#[test]
fn a_consumer_that_cannot_hold_a_cuda_pool_says_why_and_hangs_up_so_the_send_fails_at_once() {
    if !setup() {
        return;
    }
    let cu = Cu::new();
    let (ch, addr) = listen();
    let mut c = common::role(
        "remote_child",
        &[
            (ROLE, "one_device".as_ref()),
            ("DEVSHARE_REMOTE_ADDRESS", addr.as_ref()),
            ("CUDA_STANDIN_VISIBLE", "0".as_ref()),
        ],
    );
    let mut kid = c.stdout(Stdio::piped()).spawn().unwrap();
    ch.wait_peers(1, T).unwrap();
    let peer = ch.peer_ids().unwrap()[0];
    // Device 1 of this process (the stand-in's default: two visible devices).
    let p = {
        let set: libloading::Symbol<unsafe extern "C" fn(*mut std::ffi::c_void) -> i32> =
            // SAFETY: the stand-in's functions, with their cuda.h signatures.
            unsafe { cu.lib.get(b"cuCtxSetCurrent").unwrap() };
        let retain: libloading::Symbol<unsafe extern "C" fn(*mut *mut std::ffi::c_void, i32) -> i32> =
            // SAFETY: as above.
            unsafe { cu.lib.get(b"cuDevicePrimaryCtxRetain").unwrap() };
        let mut ctx = std::ptr::null_mut();
        // SAFETY: as above.
        unsafe { assert_eq!(retain(&mut ctx, 1), 0) };
        // SAFETY: as above.
        unsafe { assert_eq!(set(ctx), 0) };
        cu.alloc(8192)
    };
    let exp = Arc::new(
        Exporter::export(devshare::handle::DEVSHARE_BACKEND_CUDA, 1, p as *mut u8, 8192, &Default::default()).unwrap(),
    );
    let pool = ch.pool(exp.clone(), 4096, 2).unwrap();
    let (slot, _) = pool.acquire(T).unwrap();
    let started = Instant::now();
    let e = pool.send(slot, peer, &TensorDesc { shape: &[16], ..Default::default() }).expect_err("the peer left");
    assert!(started.elapsed() < Duration::from_secs(5), "the send failed at once ({:?}): {e}", started.elapsed());
    let said = first_line(&ch, &mut kid);
    assert!(
        said.starts_with("InvalidArgument Some(Closed)") && said.contains("CUDA device 1: this process sees 1"),
        "{said}"
    );
    assert!(kid.wait().unwrap().success());
    drop(pool);
    drop(exp);
    cu.free(p);
}

// ---- From an attacker's side: hand-made peers, relays and floods. ----

/// Serve `ch` on a thread until the returned guard is dropped.
struct Server(Arc<AtomicBool>, Option<std::thread::JoinHandle<()>>);

impl Server {
    fn new(ch: &Arc<Channel>) -> Server {
        let stop = Arc::new(AtomicBool::new(false));
        let (ch, s) = (ch.clone(), stop.clone());
        let t = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let _ = ch.service(Some(Duration::from_millis(5)));
            }
        });
        Server(stop, Some(t))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
        let _ = self.1.take().unwrap().join();
    }
}

fn listen_shared() -> (Arc<Channel>, String) {
    let (ch, addr) = listen();
    (Arc::new(ch), addr)
}

/// HMAC-SHA256(key, label || first || second || bound), made here independently of the library.
fn mac(key: &[u8], consumer: bool, first: &[u8], second: &[u8], bound: &[u8]) -> Vec<u8> {
    use hmac::Mac;
    let mut m = hmac::Hmac::<sha2::Sha256>::new_from_slice(key).unwrap();
    let label: &[u8] = if consumer { b"devshare-channel consumer" } else { b"devshare-channel producer" };
    for part in [label, first, second, bound] {
        m.update(part);
    }
    m.finalize().into_bytes().to_vec()
}

/// A hello as the library's consumer sends it: type 20, magic "DSRC", version, data path, nonce.
fn hello_msg(version: u16, data: u16, nonce: &[u8; 32], ucx: &[u8]) -> Vec<u8> {
    let mut m = 20u32.to_le_bytes().to_vec();
    m.extend(u32::from_le_bytes(*b"DSRC").to_le_bytes());
    m.extend(version.to_le_bytes());
    m.extend(data.to_le_bytes());
    m.extend(nonce);
    m.extend(ucx);
    m
}

/// What the consumer's proof covers: the hello's length and bytes, then the worker address.
fn consumer_bound(hello: &[u8], worker: &[u8]) -> Vec<u8> {
    let mut b = (hello.len() as u64).to_le_bytes().to_vec();
    b.extend(hello);
    b.extend(worker);
    b
}

/// A hand-made peer of a remote channel that `ch`'s [`Server`] serves meanwhile.
struct Raw(std::net::TcpStream);

impl Raw {
    fn connect(addr: &str) -> Raw {
        let s = std::net::TcpStream::connect(addr.strip_prefix("tcp://").unwrap()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Raw(s)
    }

    /// A connection to `addr` from the loopback address `from` (127.0.0.0/8 is all this host).
    fn connect_from(addr: &str, from: std::net::Ipv4Addr) -> std::net::TcpStream {
        use rustix::net::{AddressFamily, SocketAddrV4, SocketType};
        let fd = rustix::net::socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
        rustix::net::bind(&fd, &SocketAddrV4::new(from, 0)).unwrap();
        let to: std::net::SocketAddr = addr.strip_prefix("tcp://").unwrap().parse().unwrap();
        rustix::net::connect(&fd, &to).unwrap();
        std::net::TcpStream::from(fd)
    }

    fn send(&mut self, msg: &[u8]) {
        let mut f = (msg.len() as u32).to_le_bytes().to_vec();
        f.extend(msg);
        self.0.write_all(&f).unwrap();
    }

    /// The next message (`None` once the producer hung up).
    fn next(&mut self) -> Option<Vec<u8>> {
        use std::io::Read;
        let mut len = [0u8; 4];
        self.0.read_exact(&mut len).ok()?;
        let mut m = vec![0u8; u32::from_le_bytes(len) as usize];
        self.0.read_exact(&mut m).ok()?;
        Some(m)
    }

    /// Raw bytes of the stream (an item's).
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        use std::io::Read;
        let mut b = vec![0u8; n];
        self.0.read_exact(&mut b).unwrap();
        b
    }

    /// Hello and proof with `key`, on the stream path; the challenge's nonce.
    fn handshake(&mut self, key: &[u8]) -> Option<Vec<u8>> {
        let mine = [0x42u8; 32];
        let hello = hello_msg(2, 0, &mine, b"");
        self.send(&hello);
        let ch = self.next()?;
        assert_eq!(u32::from_le_bytes(ch[..4].try_into().unwrap()), 21, "a challenge");
        assert_eq!(ch.len(), 4 + 32 + 32, "a challenge carries a nonce and a proof only");
        let theirs = &ch[4..36];
        let mut proof = 22u32.to_le_bytes().to_vec();
        proof.extend(mac(key, true, theirs, &mine, &consumer_bound(&hello, b"")));
        self.send(&proof);
        self.next()
    }
}

fn msg_type(m: &[u8]) -> u32 {
    u32::from_le_bytes(m[..4].try_into().unwrap())
}

/// The reason of a REFUSED message (type 3).
fn refusal(m: &[u8]) -> String {
    assert_eq!(msg_type(m), 3, "a refusal, not {m:?}");
    String::from_utf8_lossy(&m[4..]).into_owned()
}

fn the_key() -> Vec<u8> {
    std::fs::read(std::env::var_os(KEY_ENV).unwrap()).unwrap()
}

#[test]
fn a_peer_whose_proof_is_wrong_is_refused_never_listed_and_told_nothing_of_a_pool() {
    setup();
    let (ch, addr) = listen_shared();
    let exp = Arc::new(Exporter::channel_host_alloc(4096).unwrap());
    let _pool = ch.pool(exp, 4096, 1).unwrap();
    let _server = Server::new(&ch);
    // Random bytes, a proof made with another key, and the right key over another hello (what
    // a relay that changed a field would send): each refused, and the connection ends.
    // Each makes a proof from (the challenge's nonce, the hand-made peer's nonce, its hello).
    type MakeProof<'a> = &'a dyn Fn(&[u8], &[u8], &[u8]) -> Vec<u8>;
    let wrong: [MakeProof; 3] = [
        &|_, _, _| vec![0x5a; 32],
        &|theirs, mine, hello| {
            mac(b"not the channel's key, 34 bytes..", true, theirs, mine, &consumer_bound(hello, b""))
        },
        &|theirs, mine, _| {
            mac(&the_key(), true, theirs, mine, &consumer_bound(&hello_msg(2, 1, &[0x42; 32], b""), b""))
        },
    ];
    for make in wrong {
        let mut raw = Raw::connect(&addr);
        let mine = [0x42u8; 32];
        let hello = hello_msg(2, 0, &mine, b"");
        raw.send(&hello);
        let challenge = raw.next().expect("a challenge");
        let mut proof = 22u32.to_le_bytes().to_vec();
        proof.extend(make(&challenge[4..36], &mine, &hello));
        raw.send(&proof);
        let m = raw.next().expect("a refusal");
        assert!(refusal(&m).contains("did not prove"), "{}", refusal(&m));
        assert_eq!(raw.next(), None, "the connection ends after the refusal");
        assert!(ch.peer_ids().unwrap().is_empty(), "a peer without the key was listed");
    }
    // The library's own consumer, with the key, still gets in.
    let c = Connection::connect(&addr, T).unwrap();
    assert_eq!(ch.peer_ids().unwrap(), vec![c.peer_id()]);
}

#[test]
fn a_refusal_before_the_proof_tells_nothing_about_the_producer() {
    setup();
    let (ch, addr) = listen_shared();
    let _server = Server::new(&ch);
    // Another protocol version, an unknown data path, garbage: the same words, no versions.
    for hello in [hello_msg(1, 0, &[7; 32], b"1.99.0"), hello_msg(2, 9, &[7; 32], b""), b"\x14\0\0\0DSRC".to_vec()] {
        let mut raw = Raw::connect(&addr);
        raw.send(&hello);
        let text = refusal(&raw.next().expect("a refusal"));
        assert_eq!(text, "untrusted: the handshake is not one this devshare remote channel speaks");
    }
    // A hello that asks for UCX with a made-up UCX version gets a challenge that holds a nonce
    // and a proof only (no UCX version), and a wrong proof then learns nothing more.
    let mut raw = Raw::connect(&addr);
    raw.send(&hello_msg(2, 1, &[7; 32], b"1.99.0"));
    let challenge = raw.next().unwrap();
    assert_eq!(challenge.len(), 4 + 32 + 32);
    let mut proof = 22u32.to_le_bytes().to_vec();
    proof.extend([0u8; 32]);
    proof.extend(b"a guessed worker address");
    raw.send(&proof);
    let text = refusal(&raw.next().unwrap());
    assert!(!text.contains("UCX") && !text.contains("1."), "{text}");
}

/// A TCP relay to `upstream` for one connection; returns its address. The bytes of one side
/// (the client's when `client_edited`, else the producer's) go through `pass`, given the
/// stream it reads and the one it writes; the other side's pass as they are. When either
/// direction ends, the stream it was writing is shut down.
fn relay_with(
    upstream: &str,
    client_edited: bool,
    pass: impl FnOnce(&mut std::net::TcpStream, &mut std::net::TcpStream) + Send + 'static,
) -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = format!("tcp://{}", l.local_addr().unwrap());
    let up = upstream.strip_prefix("tcp://").unwrap().to_string();
    std::thread::spawn(move || {
        let (client, _) = l.accept().unwrap();
        let server = std::net::TcpStream::connect(up).unwrap();
        let (mut from, mut to) = if client_edited { (client, server) } else { (server, client) };
        let (mut back_from, mut back_to) = (to.try_clone().unwrap(), from.try_clone().unwrap());
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut back_from, &mut back_to);
            let _ = back_to.shutdown(std::net::Shutdown::Both);
        });
        pass(&mut from, &mut to);
        let _ = to.shutdown(std::net::Shutdown::Both);
    });
    addr
}

/// A TCP relay to `upstream` for one connection that passes the client's bytes as they come and
/// the producer's at `rate` bytes per second, 16 KiB at a time: a consumer that reads slowly.
fn throttled_relay(upstream: &str, rate: u64) -> String {
    relay_with(upstream, false, move |server, client| {
        use std::io::Read;
        let mut buf = vec![0u8; 16 << 10];
        loop {
            let n = match server.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if client.write_all(&buf[..n]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_secs_f64(n as f64 / rate as f64));
        }
    })
}

/// A producer (run with `DEVSHARE_REMOTE_MIN_RATE=4194304`) sends a 4 KiB item and then a 32
/// MiB one to a consumer behind a relay that passes 256 KiB/s, a little at a time: every write
/// takes something, so no stall ends it. Returns how the large send ended and after how long.
fn slow_reader() -> String {
    const BIG: u64 = 32 << 20;
    let (ch, addr) = listen();
    let relay = throttled_relay(&addr, 256 << 10);
    let c = std::thread::spawn(move || {
        let c = Connection::connect(&relay, T).unwrap();
        c.recv(T).unwrap().release();
        // The large item, cut off at 18 s (waiting longer than that, within the parent's 40 s).
        let _ = c.recv(Some(Duration::from_secs(30)));
    });
    ch.wait_peers(1, T).unwrap();
    let peer = ch.peer_ids().unwrap()[0];
    let pool = ch.pool(Arc::new(Exporter::channel_host_alloc(2 * BIG).unwrap()), BIG, 2).unwrap();
    let (slot, _) = pool.acquire(T).unwrap();
    pool.send(slot, peer, &TensorDesc { shape: &[1024], storage_size: Some(4096), ..Default::default() }).unwrap();
    let (slot, _) = pool.acquire(T).unwrap();
    let began = Instant::now();
    let r = pool.send(
        slot,
        peer,
        &TensorDesc { shape: &[(BIG / 4) as i64], storage_size: Some(BIG), ..Default::default() },
    );
    let took = began.elapsed().as_secs_f64();
    c.join().unwrap();
    match r {
        Ok(()) => format!("sent after {took:.1} s"),
        Err(e) => format!("failed {:?} after {took:.1} s: {e}", e.status()),
    }
}

/// A consumer with the key that reads a large item a little at a time, never stalling for the
/// 10 s that would cut it off, cannot hold the producer's send (and its thread) for as long as it
/// likes: the transfer has a time limit of 10 s and 1 s per DEVSHARE_REMOTE_MIN_RATE bytes
/// (here 4 MiB/s: 18 s for 32 MiB, where reading at 256 KiB/s would take two minutes). Fails
/// without the limit: the send is still on its way after 40 s.
#[test]
fn a_consumer_that_reads_a_large_item_a_little_at_a_time_cannot_hold_the_send_past_its_limit() {
    if !setup() {
        return;
    }
    let mut c =
        common::role("remote_child", &[(ROLE, "slow_reader".as_ref()), ("DEVSHARE_REMOTE_ADDRESS", "".as_ref())]);
    c.env("DEVSHARE_REMOTE_MIN_RATE", "4194304").stdout(Stdio::piped());
    let mut child = c.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(40);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the send to a consumer that reads 256 KiB/s was still on its way after 40 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut text = String::new();
    std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut text).unwrap();
    let said = text.lines().find_map(|l| l.split_once("said: ")).map(|(_, s)| s).unwrap_or_else(|| panic!("{text}"));
    assert!(said.starts_with("failed Closed after "), "{said}");
    assert!(said.contains("time limit passed") && said.contains("DEVSHARE_REMOTE_MIN_RATE"), "{said}");
    let took: f64 = said["failed Closed after ".len()..].split(' ').next().unwrap().parse().unwrap();
    assert!((17.0..30.0).contains(&took), "the send ended after {took} s, its limit is 18 s: {said}");
}

/// A TCP relay to `upstream` for one connection: the client's messages pass through `edit`
/// (by their index), the producer's bytes pass as they are; what the client sent is kept.
fn relay(
    upstream: &str,
    edit: impl Fn(usize, &mut Vec<u8>) + Send + 'static,
) -> (String, Arc<std::sync::Mutex<Vec<Vec<u8>>>>) {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = seen.clone();
    let addr = relay_with(upstream, true, move |client, server| {
        use std::io::Read;
        for i in 0.. {
            let mut len = [0u8; 4];
            if client.read_exact(&mut len).is_err() {
                break;
            }
            let mut m = vec![0u8; u32::from_le_bytes(len) as usize];
            if client.read_exact(&mut m).is_err() {
                break;
            }
            kept.lock().unwrap().push(m.clone());
            edit(i, &mut m);
            let mut f = (m.len() as u32).to_le_bytes().to_vec();
            f.extend(m);
            if server.write_all(&f).is_err() {
                break;
            }
        }
    });
    (addr, seen)
}

#[test]
fn a_relay_that_changes_any_handshake_field_is_caught_and_a_replayed_handshake_is_refused() {
    setup();
    let (ch, addr) = listen_shared();
    let _server = Server::new(&ch);
    // The hello's data path changed on the way (to ask for UCX): the consumer sees that the
    // producer's proof does not cover the hello it sent.
    let (via, _) = relay(&addr, |i, m| {
        if i == 0 {
            m[10] = 1;
        }
    });
    let e = Connection::connect(&via, T).err().expect("refused");
    assert_eq!(e.status(), Status::Untrusted, "{e}");
    assert!(e.to_string().contains("changed on the way"), "{e}");
    // A worker address appended to the proof (what once aborted a producer in UCX's address
    // parser): the producer's check of the proof fails, and both sides carry on.
    let (via, _) = relay(&addr, |i, m| {
        if i == 1 {
            m.extend(b"\xff\xff\xff\xff a forged UCX worker address");
        }
    });
    let e = Connection::connect(&via, T).err().expect("refused");
    assert!(e.to_string().contains("did not prove"), "{e}");
    // A real handshake, recorded, then replayed on a new connection: the producer's fresh nonce
    // makes the old proof worthless.
    let (via, seen) = relay(&addr, |_, _| {});
    let c = Connection::connect(&via, T).unwrap();
    let recorded = seen.lock().unwrap().clone();
    assert_eq!(recorded.len(), 2, "hello and proof");
    let mut raw = Raw::connect(&addr);
    raw.send(&recorded[0]);
    assert_eq!(msg_type(&raw.next().unwrap()), 21);
    raw.send(&recorded[1]);
    assert!(refusal(&raw.next().unwrap()).contains("did not prove"));
    assert_eq!(ch.peer_ids().unwrap(), vec![c.peer_id()], "only the real consumer is a peer");
}

#[test]
fn a_flood_of_keyless_connections_from_one_address_keeps_no_other_addresss_consumer_waiting() {
    setup();
    let (ch, addr) = listen_shared();
    let _server = Server::new(&ch);
    let flood_from = std::net::Ipv4Addr::new(127, 0, 0, 2);
    // 200 connections that never speak, and 50 that send a wrong proof, all from 127.0.0.2
    // (200 once took every place of the 64 waiting for a handshake, for 5 s at a time).
    let mut flood: Vec<std::net::TcpStream> = (0..200).map(|_| Raw::connect_from(&addr, flood_from)).collect();
    for _ in 0..50 {
        // (Most are refused at once, and their writes may fail: that is the point.)
        let mut s = Raw::connect_from(&addr, flood_from);
        let mut frame = |m: Vec<u8>| {
            let mut f = (m.len() as u32).to_le_bytes().to_vec();
            f.extend(m);
            let _ = s.write_all(&f);
        };
        frame(hello_msg(2, 0, &[1; 32], b""));
        let mut proof = 22u32.to_le_bytes().to_vec();
        proof.extend([3u8; 32]);
        frame(proof);
        flood.push(s);
    }
    // A consumer from 127.0.0.1 gets in at once, well within one handshake deadline.
    let started = Instant::now();
    let c = Connection::connect(&addr, Some(Duration::from_secs(3))).unwrap();
    assert!(started.elapsed() < Duration::from_secs(3));
    assert_eq!(ch.peer_ids().unwrap(), vec![c.peer_id()], "none of the flood is a peer");
    // At most one source's share of the flood is still waiting.
    std::thread::sleep(Duration::from_millis(300));
    let open = flood
        .iter()
        .filter(|s| {
            s.set_nonblocking(true).unwrap();
            let mut b = [0u8; 512];
            loop {
                match std::io::Read::read(&mut &**s, &mut b) {
                    Ok(0) => return false,
                    Ok(_) => continue,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
                    Err(_) => return false,
                }
            }
        })
        .count();
    assert!(open <= devshare::channel::limits::DEVSHARE_CHANNEL_MAX_PENDING_PER_SOURCE, "{open} still open");
}

#[test]
fn a_consumer_with_the_key_that_forges_a_registration_or_a_return_is_refused_and_its_slots_are_all_it_gets() {
    setup();
    let (ch, addr) = listen_shared();
    let server = Server::new(&ch);
    let mut raw = Raw::connect(&addr);
    let welcome = raw.handshake(&the_key()).expect("a welcome");
    assert_eq!(msg_type(&welcome), 2);
    drop(server);
    let peer = ch.peer_ids().unwrap()[0];
    assert_eq!(ch.peer_info(peer).unwrap().transport, 1, "the stream path");
    let exp = Arc::new(Exporter::channel_host_alloc(2 * 4096).unwrap());
    let pool = Arc::new(ch.pool(exp, 4096, 2).unwrap());
    let (slot, ptr) = pool.acquire(T).unwrap();
    // SAFETY: the acquired slot's 4096 bytes.
    unsafe { std::ptr::write_bytes(ptr, 0xab, 4096) };
    let sender = {
        let pool = pool.clone();
        std::thread::spawn(move || {
            pool.send(slot, peer, &TensorDesc { shape: &[100], storage_size: Some(100), ..Default::default() })
        })
    };
    let attach = raw.next().unwrap();
    assert_eq!(msg_type(&attach), 6, "ATTACH");
    let pool_msg = |len: u64, rkey: &[u8]| {
        let mut m = 23u32.to_le_bytes().to_vec();
        m.extend(1u32.to_le_bytes());
        m.extend(0u32.to_le_bytes());
        m.extend(0x7fff_0000_0000u64.to_le_bytes());
        m.extend(len.to_le_bytes());
        m.extend(rkey);
        m
    };
    raw.send(&pool_msg(1 << 40, b"")); // a size that is not the pool's
    raw.send(&pool_msg(2 * 4096, b"a forged UCX remote key")); // a key on the stream path
    raw.send(&pool_msg(2 * 4096, b"")); // the honest answer
    let data = raw.next().unwrap();
    assert_eq!(msg_type(&data), 24, "the item's bytes come first");
    let len = u64::from_le_bytes(data[20..28].try_into().unwrap());
    assert_eq!(len, 100, "only the item's bytes travel");
    assert!(raw.bytes(100).iter().all(|&b| b == 0xab));
    let item = raw.next().unwrap();
    assert_eq!(msg_type(&item), 7, "ITEM");
    sender.join().unwrap().unwrap();
    let ret = |pool: u32, slot: u32| {
        let mut m = 8u32.to_le_bytes().to_vec();
        m.extend(pool.to_le_bytes());
        m.extend(slot.to_le_bytes());
        m.extend(0u32.to_le_bytes());
        m
    };
    let held = u32::from_le_bytes(item[8..12].try_into().unwrap());
    raw.send(&ret(1, held ^ 1)); // a slot it does not hold
    raw.send(&ret(1, 9)); // a slot beyond the pool
    raw.send(&ret(1, held)); // its own
    let deadline = Instant::now() + Duration::from_secs(10);
    while ch.peer_info(peer).unwrap().protocol_errors < 4 {
        assert!(Instant::now() < deadline, "{:?}", ch.peer_info(peer).unwrap());
        ch.service(Some(Duration::from_millis(10))).unwrap();
    }
    ch.service(Some(Duration::from_millis(50))).unwrap();
    let info = ch.peer_info(peer).unwrap();
    assert_eq!(info.protocol_errors, 4, "two forged registrations and two forged returns");
    assert_eq!(info.leases, 1, "the pool it attached");
    assert_eq!(info.slots, 0, "the slot it returned is back");
}

#[test]
fn on_the_stream_path_nothing_listens_but_the_channels_own_address() {
    setup();
    let run = |data: &str| {
        let (_, text) = in_child("listeners", Some(data));
        text.lines().find_map(|l| l.split_once("said: ").map(|(_, r)| r.to_string())).unwrap_or(text)
    };
    let said = run("stream");
    let (channel, listening) = said.split_once(' ').unwrap();
    assert_eq!(listening, format!("[{channel:?}]"), "the process listens only where it was told");
    // The check sees what UCX's TCP transport opens when both ends choose UCX.
    if ucx_setup() {
        let said = run("ucx");
        let (_, listening) = said.split_once(' ').unwrap();
        assert!(listening.matches(':').count() > 1, "UCX listened nowhere else? {said}");
    }
}

/// The TCP sockets this process listens on, as `address:port` (from `/proc/net/tcp{,6}` and
/// this process's descriptors).
fn listening_sockets() -> Vec<String> {
    let mine: std::collections::HashSet<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']').map(str::to_string))
        .collect();
    let mut out = Vec::new();
    for (file, v6) in [("/proc/net/tcp", false), ("/proc/net/tcp6", true)] {
        let Ok(text) = std::fs::read_to_string(file) else { continue };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 || f[3] != "0A" || !mine.contains(f[9]) {
                continue;
            }
            let (ip, port) = f[1].split_once(':').unwrap();
            let port = u16::from_str_radix(port, 16).unwrap();
            let ip = if v6 {
                ip.to_string()
            } else {
                std::net::Ipv4Addr::from(u32::from_str_radix(ip, 16).unwrap().swap_bytes()).to_string()
            };
            out.push(format!("{ip}:{port}"));
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// A hostile producer that holds the key, against a library consumer.

/// A hand-made producer with the key: accepts one library consumer, answers its handshake
/// (challenge with a valid proof, then WELCOME), and hands back its raw stream and the
/// consumer's `Connection`.
fn fake_producer_with_the_key() -> (Raw, Connection) {
    setup();
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = format!("tcp://{}", l.local_addr().unwrap());
    let consumer = std::thread::spawn(move || Connection::connect(&addr, T).unwrap());
    let (s, _) = l.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut raw = Raw(s);
    let hello = raw.next().unwrap();
    assert_eq!(msg_type(&hello), 20);
    let cnonce = &hello[12..44];
    let pnonce = [0x55u8; 32];
    let mut ch = 21u32.to_le_bytes().to_vec();
    ch.extend(pnonce);
    ch.extend(mac(&the_key(), false, cnonce, &pnonce, &hello));
    raw.send(&ch);
    let proof = raw.next().unwrap();
    assert_eq!(msg_type(&proof), 22);
    let mut w = 2u32.to_le_bytes().to_vec();
    w.extend(u32::from_le_bytes(*b"DSCH").to_le_bytes());
    w.extend(2u16.to_le_bytes());
    w.extend(0u16.to_le_bytes());
    w.extend(1u64.to_le_bytes());
    w.extend(1234i32.to_le_bytes());
    w.extend(0u32.to_le_bytes());
    raw.send(&w);
    (raw, consumer.join().unwrap())
}

fn attach_msg(pool: u32, slot_size: u64, count: u32) -> Vec<u8> {
    let mut m = 6u32.to_le_bytes().to_vec();
    m.extend(pool.to_le_bytes());
    m.extend(slot_size.to_le_bytes());
    m.extend(count.to_le_bytes());
    m.extend(0u32.to_le_bytes());
    m
}

fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let l = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    l.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// A producer with the key that keeps sending control messages that are not items (here
/// POOL_CLOSED of a pool never attached, 12 bytes each) for 6 s: the consumer's `recv(200 ms)`
/// still ends at its limit (it returned only when the flood stopped).
#[test]
fn a_flood_of_messages_that_are_not_items_does_not_keep_recv_past_its_timeout() {
    let (raw, conn) = fake_producer_with_the_key();
    let mut w = raw.0.try_clone().unwrap();
    // (Once the receive gave up, nothing reads: the writer stops when the socket stays full.)
    w.set_write_timeout(Some(Duration::from_millis(500))).unwrap();
    let mut buf = Vec::new();
    for _ in 0..32768 {
        buf.extend(8u32.to_le_bytes());
        buf.extend(9u32.to_le_bytes()); // POOL_CLOSED
        buf.extend(77u32.to_le_bytes());
    }
    let flood_for = Duration::from_secs(6);
    let writer = std::thread::spawn(move || {
        let t0 = Instant::now();
        while t0.elapsed() < flood_for {
            if w.write_all(&buf).is_err() {
                break;
            }
        }
    });
    std::thread::sleep(Duration::from_millis(50));
    let t0 = Instant::now();
    let r = conn.recv(Some(Duration::from_millis(200)));
    let took = t0.elapsed();
    writer.join().unwrap();
    eprintln!("recv(200 ms) returned {:?} after {took:?}", r.as_ref().err().map(|e| e.status()));
    assert!(took < Duration::from_secs(2), "recv(200 ms) took {took:?}");
}

/// Each ATTACH (a 28-byte message) makes the consumer allocate bookkeeping sized by the
/// producer's count (65536 slots: 512 KiB) and a pool copy sized by the producer: a connection
/// holds at most 256 pools, and all of them together must fit where one must (512 pools and
/// three of 16 GiB were all accepted).
#[test]
fn a_producer_cannot_attach_pools_without_bound_on_their_number_or_total_size() {
    let (mut raw, conn) = fake_producer_with_the_key();
    let before = rss_kib();
    let n = 512u32;
    let mut buf = Vec::new();
    for pool in 1..=n {
        let m = attach_msg(pool, 1, 65536);
        buf.extend((m.len() as u32).to_le_bytes());
        buf.extend(m);
    }
    raw.0.write_all(&buf).unwrap();
    // The consumer takes them all inside one receive (which then times out).
    let r = conn.recv(Some(Duration::from_secs(3)));
    let after = rss_kib();
    let mut replies = 0;
    raw.0.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
    while let Some(m) = raw.next() {
        if msg_type(&m) == 23 {
            replies += 1;
        }
        if replies == n {
            break;
        }
    }
    eprintln!(
        "{n} ATTACH messages ({} bytes): recv {:?}, {replies} POOL replies, RSS {} -> {} KiB (+{} MiB)",
        buf.len(),
        r.as_ref().err().map(|e| e.status()),
        before,
        after,
        (after.saturating_sub(before)) / 1024
    );
    assert!(replies <= 64, "{replies} of {n} pools accepted, RSS +{} MiB", (after - before) / 1024);
    assert_eq!(r.err().map(|e| e.status()), Some(Status::Untrusted), "the pool past the bound is refused");
    // Total size, on a connection of its own: pools of 16 GiB each, three of them (48 GiB, more
    // than /dev/shm and RAM here).
    let (mut raw, conn) = fake_producer_with_the_key();
    raw.0.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
    let big = 16u64 << 30;
    for pool in n + 1..=n + 3 {
        let m = attach_msg(pool, big, 1);
        let mut f = (m.len() as u32).to_le_bytes().to_vec();
        f.extend(m);
        if raw.0.write_all(&f).is_err() {
            break; // refused: the consumer hung up
        }
    }
    let r = conn.recv(Some(Duration::from_secs(2)));
    let mut big_replies = 0;
    while let Some(m) = raw.next() {
        if msg_type(&m) == 23 && u64::from_le_bytes(m[20..28].try_into().unwrap()) == big {
            big_replies += 1;
        }
        if big_replies == 3 {
            break;
        }
    }
    eprintln!("three 16 GiB pools: recv {:?}, {big_replies} accepted", r.as_ref().err().map(|e| e.status()));
    assert!(big_replies < 3, "three 16 GiB pools accepted by one consumer");
}

/// A consumer (raw, with the key) that reads steadily, at about 8 MB/s, but more slowly than one
/// thread sends it 200 KiB items; a 600 KiB item to it from another thread waits for the
/// connection's queue to empty, and gets its turn: senders waiting for room go in order (a
/// first version of the unlocked write let the small items keep the queue filled, and the large
/// one timed out after 10 s).
#[test]
fn a_large_item_gets_its_turn_behind_a_stream_of_small_items_to_the_same_consumer() {
    setup();
    const SLOT: u64 = 1 << 20;
    const COUNT: u32 = 1024;
    let (ch, addr) = listen_shared();
    let server = Server::new(&ch);
    let mut raw = Raw::connect(&addr);
    assert_eq!(msg_type(&raw.handshake(&the_key()).expect("a welcome")), 2);
    drop(server);
    let peer = ch.peer_ids().unwrap()[0];
    let exp = Arc::new(Exporter::channel_host_alloc(SLOT * COUNT as u64).unwrap());
    let pool = Arc::new(ch.pool(exp, SLOT, COUNT).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    // The consumer: registers the pool, reads each item's bytes at about 8 MB/s, returns slots.
    let reader = {
        let stop = stop.clone();
        let mut w = raw.0.try_clone().unwrap();
        std::thread::spawn(move || {
            let mut big = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let Some(m) = raw.next() else { break };
                match msg_type(&m) {
                    6 => {
                        let pool = u32::from_le_bytes(m[4..8].try_into().unwrap());
                        let mut r = 23u32.to_le_bytes().to_vec();
                        r.extend(pool.to_le_bytes());
                        r.extend(0u32.to_le_bytes());
                        r.extend(0x7fff_0000_0000u64.to_le_bytes());
                        r.extend((SLOT * COUNT as u64).to_le_bytes());
                        let mut f = (r.len() as u32).to_le_bytes().to_vec();
                        f.extend(r);
                        w.write_all(&f).unwrap();
                    }
                    24 => {
                        let len = u64::from_le_bytes(m[20..28].try_into().unwrap()) as usize;
                        if len > 256 << 10 {
                            big += 1;
                        }
                        let mut left = len;
                        while left > 0 {
                            let n = left.min(32 << 10);
                            raw.bytes(n);
                            left -= n;
                            std::thread::sleep(Duration::from_millis(4));
                        }
                    }
                    7 => {
                        let mut r = 8u32.to_le_bytes().to_vec();
                        r.extend(m[4..12].iter());
                        r.extend(0u32.to_le_bytes());
                        let mut f = (r.len() as u32).to_le_bytes().to_vec();
                        f.extend(r);
                        w.write_all(&f).unwrap();
                    }
                    _ => {}
                }
            }
            big
        })
    };
    let small = {
        let (pool, stop) = (pool.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let (slot, _) = pool.acquire(T).unwrap();
                match pool.send(
                    slot,
                    peer,
                    &TensorDesc { shape: &[200 << 10], storage_size: Some(200 << 10), ..Default::default() },
                ) {
                    Ok(()) => n += 1,
                    Err(_) => break,
                }
            }
            n
        })
    };
    std::thread::sleep(Duration::from_secs(1));
    let (slot, _) = pool.acquire(T).unwrap();
    let t = Instant::now();
    let r =
        pool.send(slot, peer, &TensorDesc { shape: &[600 << 10], storage_size: Some(600 << 10), ..Default::default() });
    let took = t.elapsed();
    stop.store(true, Ordering::Relaxed);
    let n = small.join().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(r.is_ok(), "the large item failed after {took:?} while {n} small items to the same consumer went");
    let _ = reader.join();
}

/// A consumer (raw, with the key) that holds its slots for 9.5 s, then reads a 32 MiB item at
/// about 8 MB/s: the send waits for the slot, then writes for as long as the consumer reads (its
/// 10 s count time without progress). Before 1.16.1 the wait used up the write's time, and the
/// item was cut off with the connection.
#[test]
fn a_large_item_after_a_long_wait_for_a_slot_is_written_while_the_consumer_reads() {
    setup();
    const SLOT: u64 = 32 << 20;
    let (ch, addr) = listen_shared();
    let server = Server::new(&ch);
    let mut raw = Raw::connect(&addr);
    assert_eq!(msg_type(&raw.handshake(&the_key()).expect("a welcome")), 2);
    drop(server);
    let peer = ch.peer_ids().unwrap()[0];
    let exp = Arc::new(Exporter::channel_host_alloc(SLOT * 2).unwrap());
    let pool = Arc::new(ch.pool(exp, SLOT, 2).unwrap());
    let reader = std::thread::spawn(move || {
        let mut w = raw.0.try_clone().unwrap();
        let frame = |r: Vec<u8>| {
            let mut f = (r.len() as u32).to_le_bytes().to_vec();
            f.extend(r);
            f
        };
        let mut items = 0;
        loop {
            let Some(m) = raw.next() else { return format!("stream ended after {items} items") };
            match msg_type(&m) {
                6 => {
                    let pool = u32::from_le_bytes(m[4..8].try_into().unwrap());
                    let mut r = 23u32.to_le_bytes().to_vec();
                    r.extend(pool.to_le_bytes());
                    r.extend(0u32.to_le_bytes());
                    r.extend(0x7fff_0000_0000u64.to_le_bytes());
                    r.extend((SLOT * 2).to_le_bytes());
                    w.write_all(&frame(r)).unwrap();
                }
                24 => {
                    let len = u64::from_le_bytes(m[20..28].try_into().unwrap()) as usize;
                    let mut left = len;
                    while left > 0 {
                        let n = left.min(32 << 10);
                        use std::io::Read;
                        let mut b = vec![0u8; n];
                        if raw.0.read_exact(&mut b).is_err() {
                            return format!("cut in the middle of item {items}");
                        }
                        left -= n;
                        std::thread::sleep(Duration::from_millis(4));
                    }
                }
                7 => {
                    items += 1;
                    if items == 1 {
                        // Processing the first item (its slot held) for 9.5 s.
                        std::thread::sleep(Duration::from_millis(9500));
                    }
                    let mut r = 8u32.to_le_bytes().to_vec();
                    r.extend(m[4..12].iter());
                    r.extend(0u32.to_le_bytes());
                    w.write_all(&frame(r)).unwrap();
                }
                _ => {}
            }
        }
    });
    // The consumer's copy has two slots: two small items fill them, the large one waits.
    for _ in 0..2 {
        let (slot, _) = pool.acquire(T).unwrap();
        pool.send(slot, peer, &TensorDesc { shape: &[4096], storage_size: Some(4096), ..Default::default() }).unwrap();
    }
    let (slot, _) = pool.acquire(T).unwrap();
    let t = Instant::now();
    let r = pool.send(slot, peer, &TensorDesc { shape: &[32 << 20], ..Default::default() });
    let took = t.elapsed();
    let connected = ch.peer_ids().unwrap().contains(&peer);
    let seen = reader.join().unwrap_or_else(|_| "reader panicked".into());
    assert!(r.is_ok() && connected, "cut off after {took:?}: {r:?}; the consumer says: {seen}");
}
