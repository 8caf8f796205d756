//! UCX as the data path of remote pools (`src/channel/tcp/ucx/`), over loopback TCP: every context
//! here is made with `Context::new(&[("TLS", "tcp")])`, which is `UCX_TLS=tcp` without touching
//! the environment.
//!
//! - Two processes: this test (the consumer) maps a 64 MiB region and sends its worker address
//!   and packed key to a producer child (this binary run again, `DEVSHARE_UCX_ROLE`) over its
//!   stdin, the stand-in for the TCP control channel. The producer puts 4 KiB at an odd offset,
//!   flushes and says so on its stdout; then 64 MiB over the whole region. The consumer
//!   progresses its worker only through its event fd (progress until 0, arm, poll on the efd
//!   and the child's stdout), and checks every byte after each round.
//! - A put towards a worker that never progresses times out and force-closes its endpoint.
//! - Puts outside the remote region are refused before UCX sees them.
//! - A library that is not UCX (`DEVSHARE_UCX_LIBRARY=libc.so.6`, in a child: UCX loads once per
//!   process) gives `BackendUnavailable` naming the missing symbol.
//! - The struct layouts and constants in `src/channel/tcp/ucx/ffi.rs` match `offsetof` / `sizeof` in the
//!   UCX headers found (`/usr/include`, `/usr/local/include`, `$DEVSHARE_UCX_INCLUDE`, and the
//!   `include/` next to `$DEVSHARE_UCX_LIBRARY`'s `lib/`), compiled with `cc`.
//!
//! Without a loadable UCX (or headers, or `cc`) a test prints a `SKIPPED` line saying why, and
//! passes. Run: `cargo test --release --test remote_ucx -- --nocapture`; with the PyPI wheel's
//! UCX: `DEVSHARE_UCX_LIBRARY=<venv>/lib/python3.X/site-packages/libucx/lib/libucp.so.0`; with
//! another UCX for the producer only (two versions on the wire):
//! `DEVSHARE_UCX_PRODUCER_LIBRARY=<its libucp.so.0>`.

mod common;

use devshare::channel::ucx::{self, Arm, Context, Endpoint, MemRegion, Worker};
use devshare::Error;
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use std::io::{BufRead, Read, Write};
use std::os::fd::AsFd;
use std::process::Stdio;
use std::time::{Duration, Instant};

const ROLE: &str = "DEVSHARE_UCX_ROLE";
const TCP: &[(&str, &str)] = &[("TLS", "tcp")];
const REGION: usize = 64 << 20;
const SMALL: usize = 4096;
const ODD_OFFSET: usize = 1_234_567;

/// The byte the producer writes at `i` in `round`.
fn pattern(round: u8, i: usize) -> u8 {
    ((i as u32).wrapping_mul(2_654_435_761) >> 24) as u8 ^ round.wrapping_mul(0x5b)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// The loaded UCX, or `None` after printing why the test is skipped.
fn ucx_or_skip(test: &str) -> Option<String> {
    match ucx::probe() {
        Ok(found) => {
            println!("{test}: {found}");
            Some(found)
        }
        Err(e) => {
            println!("SKIPPED {test}: no usable UCX ({e})");
            None
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Child roles

/// A child process of the tests below (run by them with `--ignored`; not a test of its own).
#[test]
#[ignore = "a child-process role of the tests below"]
fn ucx_child_process() {
    let role = std::env::var(ROLE).expect("run by the tests below, which set the role");
    // libtest printed "test ucx_child_process ... " without a newline.
    println!();
    match role.as_str() {
        "producer" => producer(),
        "not_ucx" => {
            println!("PROBE {}", ucx::probe().unwrap_err());
            let e = Context::new(TCP).err().expect("libc is not UCX");
            println!("CONTEXT {:?} {e}", e.status());
        }
        r => panic!("unknown role {r}"),
    }
}

/// Read stdin lines until one starts with `word`; the rest of it.
fn expect_line(input: &mut impl BufRead, word: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(input.read_line(&mut line).unwrap() > 0, "stdin closed before {word}");
        if let Some(rest) = line.trim_end().strip_prefix(word) {
            return rest.trim().to_string();
        }
    }
}

/// The producer: connects to the consumer's worker, puts round 1 (4 KiB at an odd offset) and
/// round 2 (the whole region), flushing after each and saying "DONE <round> <put ms> <flush ms>".
fn producer() {
    let context = Context::new(TCP).unwrap();
    println!("PRODUCER {}", context.describe());
    let worker = Worker::new(&context).unwrap();
    let mut input = std::io::stdin().lock();
    let address = unhex(&expect_line(&mut input, "ADDR"));
    let key = expect_line(&mut input, "RKEY");
    let mut fields = key.split(' ');
    let packed = unhex(fields.next().unwrap());
    let base: u64 = fields.next().unwrap().parse().unwrap();
    let len: usize = fields.next().unwrap().parse().unwrap();
    assert_eq!(len, REGION);

    let small: Vec<u8> = (0..SMALL).map(|i| pattern(1, ODD_OFFSET + i)).collect();
    let big: Vec<u8> = (0..REGION).map(|i| pattern(2, i)).collect();
    // SAFETY: the consumer's `Worker::address`, passed whole through the pipe.
    let mut ep = unsafe { Endpoint::connect(&worker, &address) }.unwrap();
    ep.set_timeout(Duration::from_secs(30));
    // SAFETY: the consumer's `MemRegion::pack_rkey`, passed whole.
    let rkey = unsafe { ep.unpack_rkey(&packed, base, len) }.unwrap();

    // Outside the region: refused before UCX is called, and the endpoint stays usable.
    for (addr, n) in [(base + (REGION - 100) as u64, SMALL), (base - 1, 2), (u64::MAX - 10, 100)] {
        // SAFETY: `small` is readable (and nothing is sent).
        let e = unsafe { ep.put(small.as_ptr(), n, addr, &rkey) }.unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    }
    assert!(!ep.is_closed());

    let mut out = std::io::stdout();
    for (round, src, at) in [(1u8, &small, ODD_OFFSET), (2, &big, 0)] {
        if round == 2 {
            expect_line(&mut input, "NEXT");
        }
        let t0 = Instant::now();
        // SAFETY: `src` outlives the endpoint.
        unsafe { ep.put(src.as_ptr(), src.len(), base + at as u64, &rkey) }.unwrap();
        let t1 = Instant::now();
        ep.flush().unwrap();
        let t2 = Instant::now();
        writeln!(out, "DONE {round} {:.1} {:.1}", ms(t1 - t0), ms(t2 - t1)).unwrap();
        out.flush().unwrap();
    }
    expect_line(&mut input, "BYE");
    drop(rkey);
    let t = Instant::now();
    drop(ep);
    writeln!(out, "CLOSED {:.1}", ms(t.elapsed())).unwrap();
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

// ---------------------------------------------------------------------------------------------
// Tests

/// Whether the `len` bytes at `at` of the region hold round `round`'s pattern, and every other
/// byte `rest` (a closure of the index).
///
/// # Safety
/// `base` points at `REGION` bytes that nobody writes during the call.
unsafe fn check_region(base: *const u8, round: u8, at: usize, len: usize, rest: impl Fn(usize) -> u8) {
    // SAFETY: the caller's promise.
    let region = unsafe { std::slice::from_raw_parts(base, REGION) };
    for (i, &b) in region.iter().enumerate() {
        let want = if (at..at + len).contains(&i) { pattern(round, i) } else { rest(i) };
        assert_eq!(b, want, "round {round}: byte {i}");
    }
}

#[test]
fn a_producer_process_puts_4k_at_an_odd_offset_then_64m_and_the_consumer_sees_every_byte() {
    if std::env::var_os(ROLE).is_some() {
        return;
    }
    let test = "remote_ucx two processes";
    if ucx_or_skip(test).is_none() {
        return;
    }
    let context = Context::new(TCP).unwrap();
    let worker = Worker::new(&context).unwrap();
    // The region: only touched through `base` (the producer writes it while we progress).
    let mut storage = vec![0u8; REGION];
    let base = storage.as_mut_ptr();
    // SAFETY: `storage` outlives `region`; we read it only between a "DONE" and the next
    // request, when the producer has flushed and writes nothing.
    let region = unsafe { MemRegion::map(&context, base, REGION) }.unwrap();
    assert_eq!((region.address(), region.len()), (base as u64, REGION));
    let packed = region.pack_rkey().unwrap();

    // DEVSHARE_UCX_PRODUCER_LIBRARY: another UCX for the producer (two versions on the wire).
    let mut envs = vec![(ROLE, std::ffi::OsString::from("producer"))];
    if let Some(other) = std::env::var_os("DEVSHARE_UCX_PRODUCER_LIBRARY") {
        envs.push((ucx::LIBRARY_ENV, other));
    }
    let envs: Vec<(&str, &std::ffi::OsStr)> = envs.iter().map(|(k, v)| (*k, v.as_os_str())).collect();
    let mut child =
        common::role("ucx_child_process", &envs).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut to_child = child.stdin.take().unwrap();
    let mut from_child = child.stdout.take().unwrap();
    writeln!(to_child, "ADDR {}", hex(&worker.address().unwrap())).unwrap();
    writeln!(to_child, "RKEY {} {} {}", hex(&packed), region.address(), region.len()).unwrap();
    to_child.flush().unwrap();

    let deadline = Instant::now() + Duration::from_secs(120);
    let (mut text, mut eof, mut rounds, mut sleeps, mut closed) = (Vec::new(), false, 0, 0u32, false);
    while !eof {
        assert!(Instant::now() < deadline, "the producer did not finish in time");
        // Progress until there is nothing left, then handle what the producer said.
        while worker.progress() > 0 {}
        while let Some(nl) = text.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = text.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line).trim().to_string();
            let words: Vec<&str> = line.split(' ').collect();
            match words[0] {
                "DONE" => {
                    let round: u8 = words[1].parse().unwrap();
                    println!("{test}: round {round}: put {} ms, flush {} ms", words[2], words[3]);
                    if round == 1 {
                        // SAFETY: the producer flushed round 1 and waits for NEXT.
                        unsafe { check_region(base, 1, ODD_OFFSET, SMALL, |_| 0) };
                        writeln!(to_child, "NEXT").unwrap();
                    } else {
                        // SAFETY: the producer flushed round 2 and waits for BYE.
                        unsafe { check_region(base, 2, 0, REGION, |_| 0) };
                        writeln!(to_child, "BYE").unwrap();
                    }
                    to_child.flush().unwrap();
                    rounds += 1;
                }
                "PRODUCER" => println!("{test}: producer: {}", &line["PRODUCER ".len()..]),
                "CLOSED" => {
                    println!("{test}: the producer's endpoint closed (flushed) in {} ms", words[1]);
                    closed = true;
                }
                _ => {}
            }
        }
        if worker.arm().unwrap() == Arm::Busy {
            continue;
        }
        // Armed: sleep until UCX or the producer has something.
        sleeps += 1;
        let mut fds = [
            PollFd::from_borrowed_fd(worker.efd(), PollFlags::IN),
            PollFd::from_borrowed_fd(from_child.as_fd(), PollFlags::IN),
        ];
        poll(&mut fds, Some(&Timespec { tv_sec: 5, tv_nsec: 0 })).unwrap();
        if !fds[1].revents().is_empty() {
            let mut buf = [0u8; 4096];
            let n = from_child.read(&mut buf).unwrap();
            eof = n == 0;
            text.extend_from_slice(&buf[..n]);
        }
    }
    let status = child.wait().unwrap();
    assert!(status.success(), "the producer failed: {status}");
    assert_eq!(rounds, 2, "both rounds arrived");
    assert!(closed, "the producer closed its endpoint");
    println!("{test}: the consumer slept on its event fd {sleeps} times");
    drop(region);
    drop(storage);
}

#[test]
fn a_put_to_a_worker_that_never_progresses_times_out_and_closes_the_endpoint() {
    if std::env::var_os(ROLE).is_some() {
        return;
    }
    let test = "remote_ucx timeout";
    if ucx_or_skip(test).is_none() {
        return;
    }
    let context = Context::new(TCP).unwrap();
    let idle = Worker::new(&context).unwrap();
    let mut storage = vec![0u8; 1 << 20];
    // SAFETY: `storage` outlives the region; nothing reads it.
    let region = unsafe { MemRegion::map(&context, storage.as_mut_ptr(), storage.len()) }.unwrap();
    let packed = region.pack_rkey().unwrap();

    let worker = Worker::new(&context).unwrap();
    // SAFETY: a whole address and key of this process's UCX.
    let mut ep = unsafe { Endpoint::connect(&worker, &idle.address().unwrap()) }.unwrap();
    ep.set_timeout(Duration::from_millis(500));
    // SAFETY: as above.
    let rkey = unsafe { ep.unpack_rkey(&packed, region.address(), region.len()) }.unwrap();
    let src = vec![7u8; 1 << 20];
    let t = Instant::now();
    // SAFETY: `src` outlives the endpoint. The flush needs the idle worker, which never
    // progresses (and the put may need it too, for the wire-up).
    let result = unsafe { ep.put(src.as_ptr(), src.len(), region.address(), &rkey) }.and_then(|()| ep.flush());
    let e = result.unwrap_err();
    println!("{test}: after {:?}: {e}", t.elapsed());
    assert!(matches!(e, Error::Timeout(_)), "{e}");
    assert!(ep.is_closed());
    let again = ep.flush().unwrap_err();
    assert!(matches!(again, Error::Closed(_)), "{again}");
    assert!(t.elapsed() < Duration::from_secs(10));
    drop(rkey);
    drop(ep);
    drop(worker);
    drop(region);
    drop(idle);
    drop(storage);
}

#[test]
fn a_library_that_is_not_ucx_gives_a_clean_error_naming_the_missing_symbol() {
    if std::env::var_os(ROLE).is_some() {
        return;
    }
    let out =
        common::role("ucx_child_process", &[(ROLE, "not_ucx".as_ref()), (ucx::LIBRARY_ENV, "libc.so.6".as_ref())])
            .stdout(Stdio::piped())
            .output()
            .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the child failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let probe = stdout.lines().find_map(|l| l.strip_prefix("PROBE ")).expect("a PROBE line");
    let context = stdout.lines().find_map(|l| l.strip_prefix("CONTEXT ")).expect("a CONTEXT line");
    println!("probe: {probe}\ncontext: {context}");
    assert!(probe.starts_with("backend unavailable: libc.so.6 has no ucp_get_version"), "{probe}");
    assert!(
        context.starts_with("BackendUnavailable backend unavailable: libc.so.6 has no ucp_get_version"),
        "{context}"
    );
}

/// The UCX include directories on this machine.
fn include_dirs() -> Vec<std::path::PathBuf> {
    let mut dirs: Vec<std::path::PathBuf> = vec!["/usr/include".into(), "/usr/local/include".into()];
    if let Some(d) = std::env::var_os("DEVSHARE_UCX_INCLUDE") {
        dirs.push(d.into());
    }
    if let Some(lib) = std::env::var_os(ucx::LIBRARY_ENV) {
        // The wheel's layout: libucx/lib/libucp.so.0 and libucx/include/ucp/api/ucp.h.
        if let Some(d) = std::path::Path::new(&lib).parent().and_then(|l| l.parent()) {
            dirs.push(d.join("include"));
        }
    }
    dirs.retain(|d| d.join("ucp/api/ucp.h").is_file());
    dirs.dedup();
    dirs
}

/// A C program that prints what `names` name: `sizeof T`, `T.field` offsets, and constants.
fn layout_program(layout: &[(&str, usize)], constants: &[(&str, i64)]) -> String {
    let mut c = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include <ucp/api/ucp.h>\nint main(void) {\n\
         printf(\"UCP_API %d.%d\\n\", UCP_API_MAJOR, UCP_API_MINOR);\n",
    );
    for (name, _) in layout {
        if let Some(t) = name.strip_prefix("sizeof ") {
            c.push_str(&format!("printf(\"{name} %zu\\n\", sizeof({t}));\n"));
        } else {
            let (t, f) = name.split_once('.').unwrap();
            c.push_str(&format!("printf(\"{name} %zu\\n\", offsetof({t}, {f}));\n"));
        }
    }
    for (name, _) in constants {
        c.push_str(&format!("printf(\"{name} %lld\\n\", (long long)({name}));\n"));
    }
    c.push_str("return 0;\n}\n");
    c
}

#[test]
fn the_struct_layouts_and_constants_match_the_ucx_headers() {
    let dirs = include_dirs();
    if dirs.is_empty() {
        println!("SKIPPED remote_ucx layouts: no ucp/api/ucp.h (install libucx-dev, or set DEVSHARE_UCX_INCLUDE)");
        return;
    }
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    if std::process::Command::new(&cc).arg("--version").output().is_err() {
        println!("SKIPPED remote_ucx layouts: no C compiler ({cc})");
        return;
    }
    let layout = ucx::c_layout();
    let constants = ucx::c_constants();
    let work = std::env::temp_dir().join(format!("devshare_ucx_layout_{}", std::process::id()));
    std::fs::create_dir_all(&work).unwrap();
    let source = work.join("layout.c");
    std::fs::write(&source, layout_program(&layout, &constants)).unwrap();
    // Structs UCX reads through a pointer may have grown at the end in later headers; the
    // types nested in them must be exactly as large.
    let may_grow =
        |name: &str| name.starts_with("sizeof ucp_") && name.ends_with("_t") && !name.contains("err_handler");
    for (n, dir) in dirs.iter().enumerate() {
        let exe = work.join(format!("layout{n}"));
        let built =
            std::process::Command::new(&cc).arg("-I").arg(dir).arg(&source).arg("-o").arg(&exe).output().unwrap();
        assert!(built.status.success(), "{cc} against {}: {}", dir.display(), String::from_utf8_lossy(&built.stderr));
        let out = std::process::Command::new(&exe).output().unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        let c: std::collections::HashMap<&str, i64> =
            text.lines().filter_map(|l| l.rsplit_once(' ')).filter_map(|(k, v)| Some((k, v.parse().ok()?))).collect();
        let api = text.lines().next().unwrap_or_default();
        let mut wrong = Vec::new();
        for (name, ours) in &layout {
            let theirs = c[name];
            let ok = if may_grow(name) { *ours as i64 <= theirs } else { *ours as i64 == theirs };
            if !ok {
                wrong.push(format!("{name}: devshare {ours}, header {theirs}"));
            }
        }
        for (name, ours) in &constants {
            if c[name] != *ours {
                wrong.push(format!("{name}: devshare {ours}, header {}", c[name]));
            }
        }
        assert!(wrong.is_empty(), "against {} ({api}):\n{}", dir.display(), wrong.join("\n"));
        println!("remote_ucx layouts: {} names match {} ({api})", layout.len() + constants.len(), dir.display());
    }
    let _ = std::fs::remove_dir_all(&work);
}
