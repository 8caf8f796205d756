//! Segmented (VMM) acl memory imported from many threads of one process, over the ACL stand-in
//! runtime (built by build.rs). CANN does not support importing in the exporting process, so
//! the producer is this test binary run again as a child (`DEVSHARE_ACL_VMM_ROLE`): it
//! allocates 8 physical segments, maps them, exports five overlapping windows of them and
//! prints one encoded handle per line. The consumer's threads import and release those handles
//! concurrently — cold (every page imported and freed under contention) and warm (one import
//! holds every page) — and each shareable handle is imported at most once at any time: after
//! the release nothing is imported, reserved or mapped, every reference came back, and neither
//! process recorded a rule violation.
//!
//! A second child shows that re-exporting a physical handle after its exporters closed gives
//! its cached shareable handle back (CANN refuses a second export of a live handle).

mod common;

use devshare::backend::{ExportOptions, ImportRequest, SegmentedMemory};
use devshare::export::{Exporter, TensorDesc};
use devshare::handle::encode::{decode_full, encode_full_into};
use devshare::handle::DEVSHARE_BACKEND_ACL;
use devshare::import::import_full;
use std::ffi::{c_char, c_int, c_void};
use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;
use std::time::Duration;

const SEG: usize = 2 << 20;
const SEGMENTS: usize = 8;
/// (first segment, count) of each exported window: pages shared between windows.
const WINDOWS: [(usize, usize); 5] = [(0, 4), (2, 4), (4, 4), (1, 6), (0, 8)];
const ROUNDS: usize = 64;
const THREADS: usize = 8;
const ROLE: &str = "DEVSHARE_ACL_VMM_ROLE";

/// `aclrtPhysicalMemProp`.
#[repr(C)]
struct PhysicalMemProp {
    handle_type: c_int,
    allocation_type: c_int,
    mem_attr: c_int,
    location_id: u32,
    location_type: c_int,
    reserve: u64,
}

type Query = unsafe extern "C" fn() -> c_int;

struct Runtime {
    _lib: libloading::Library,
    set_device: unsafe extern "C" fn(i32) -> c_int,
    memcpy: unsafe extern "C" fn(*mut c_void, usize, *const c_void, usize, c_int) -> c_int,
    malloc_physical: unsafe extern "C" fn(*mut *mut c_void, usize, *const PhysicalMemProp, u64) -> c_int,
    free_physical: unsafe extern "C" fn(*mut c_void) -> c_int,
    reserve: unsafe extern "C" fn(*mut *mut c_void, usize, usize, *mut c_void, u64) -> c_int,
    release: unsafe extern "C" fn(*mut c_void) -> c_int,
    map: unsafe extern "C" fn(*mut c_void, usize, usize, *mut c_void, u64) -> c_int,
    unmap: unsafe extern "C" fn(*mut c_void) -> c_int,
    violations: Query,
    reservations: Query,
    mappings: Query,
    imported_handles: Query,
}

fn runtime(log_tag: &str) -> Runtime {
    let lib = common::load(common::StandIn::Acl, log_tag);
    // SAFETY: the stand-in is a plain C library; the symbols have these C signatures
    // (tests/standin/acl/acl_standin.h).
    unsafe {
        let init: unsafe extern "C" fn(*const c_char) -> c_int = *lib.get(b"aclInit").unwrap();
        init(std::ptr::null());
        Runtime {
            set_device: *lib.get(b"aclrtSetDevice").unwrap(),
            memcpy: *lib.get(b"aclrtMemcpy").unwrap(),
            malloc_physical: *lib.get(b"aclrtMallocPhysical").unwrap(),
            free_physical: *lib.get(b"aclrtFreePhysical").unwrap(),
            reserve: *lib.get(b"aclrtReserveMemAddress").unwrap(),
            release: *lib.get(b"aclrtReleaseMemAddress").unwrap(),
            map: *lib.get(b"aclrtMapMem").unwrap(),
            unmap: *lib.get(b"aclrtUnmapMem").unwrap(),
            violations: *lib.get(b"aclsi_violation_count").unwrap(),
            reservations: *lib.get(b"aclsi_vmm_reservations").unwrap(),
            mappings: *lib.get(b"aclsi_vmm_mappings").unwrap(),
            imported_handles: *lib.get(b"aclsi_vmm_imported_handles").unwrap(),
            _lib: lib,
        }
    }
}

/// `n` physical segments on device 0 mapped back to back, byte i of the allocation = i % 251.
fn allocate(rt: &Runtime, n: usize) -> (*mut u8, Vec<*mut c_void>) {
    let prop = PhysicalMemProp {
        handle_type: 0,     // ACL_MEM_HANDLE_TYPE_NONE
        allocation_type: 0, // ACL_MEM_ALLOCATION_TYPE_PINNED
        mem_attr: 4,        // ACL_HBM_MEM_HUGE
        location_id: 0,
        location_type: 1, // ACL_MEM_LOCATION_TYPE_DEVICE
        reserve: 0,
    };
    let pattern: Vec<u8> = (0..n * SEG).map(|i| (i % 251) as u8).collect();
    let mut base: *mut c_void = std::ptr::null_mut();
    let mut phys = vec![std::ptr::null_mut(); n];
    // SAFETY: stand-in calls with valid out pointers; every address is inside the reservation.
    unsafe {
        assert_eq!((rt.set_device)(0), 0);
        assert_eq!((rt.reserve)(&mut base, n * SEG, 0, std::ptr::null_mut(), 0), 0);
        for (i, p) in phys.iter_mut().enumerate() {
            assert_eq!((rt.malloc_physical)(p, SEG, &prop, 0), 0, "aclrtMallocPhysical");
            assert_eq!((rt.map)(base.cast::<u8>().add(i * SEG).cast(), SEG, 0, *p, 0), 0, "aclrtMapMem");
        }
        assert_eq!((rt.memcpy)(base, n * SEG, pattern.as_ptr().cast(), n * SEG, 1), 0, "aclrtMemcpy H2D");
    }
    (base.cast(), phys)
}

/// Unmap, free the physical memory, release the range (the reference order).
fn free(rt: &Runtime, base: *mut u8, phys: &[*mut c_void]) {
    // SAFETY: stand-in calls on what `allocate` made.
    unsafe {
        for i in 0..phys.len() {
            assert_eq!((rt.unmap)(base.add(i * SEG).cast()), 0);
        }
        for &p in phys {
            assert_eq!((rt.free_physical)(p), 0);
        }
        assert_eq!((rt.release)(base.cast()), 0);
    }
}

fn export(base: *mut u8, phys: &[*mut c_void], first: usize, count: usize) -> devshare::Result<Exporter> {
    let physical: Vec<u64> = phys[first..first + count].iter().map(|&p| p as u64).collect();
    // SAFETY: the window lies inside the allocation.
    let mem = SegmentedMemory { base: unsafe { base.add(first * SEG) }, segment_size: SEG as u64, physical: &physical };
    Exporter::export_segments(
        DEVSHARE_BACKEND_ACL,
        0,
        &mem,
        &ExportOptions { no_pid_check: true, ..Default::default() },
    )
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// The producer process: exports the windows, prints "H <first segment> <hex>" per handle and
/// "END", waits for a line on stdin, then checks every reference came back and frees.
fn producer(rt: &Runtime) {
    let (base, phys) = allocate(rt, SEGMENTS);
    let exporters: Vec<Exporter> = WINDOWS.iter().map(|&(f, n)| export(base, &phys, f, n).unwrap()).collect();
    let mut out = std::io::stdout().lock();
    // libtest printed "test vmm_child_process ... " without a newline.
    writeln!(out).unwrap();
    for r in 0..ROUNDS {
        for (w, e) in exporters.iter().enumerate() {
            // 4 KiB storages at offsets that cross page boundaries of the window.
            let offset = ((r * 7919 + w * 104_729) % (WINDOWS[w].1 * SEG - 8192)) as u64;
            let h = e
                .share(&TensorDesc {
                    shape: &[4096],
                    storage_offset: offset,
                    storage_size: Some(8192),
                    ..Default::default()
                })
                .unwrap();
            let mut bytes = Vec::new();
            encode_full_into(&h, e.external_table(), &mut bytes).unwrap();
            writeln!(out, "H {} {}", WINDOWS[w].0, hex(&bytes)).unwrap();
        }
    }
    writeln!(out, "END").unwrap();
    out.flush().unwrap();
    drop(out);
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    for e in &exporters {
        e.wait(Some(Duration::from_secs(20))).expect("every consumer reference came back");
        e.check_close(false).unwrap();
    }
    drop(exporters);
    free(rt, base, &phys);
    // SAFETY: stand-in query.
    assert_eq!(unsafe { (rt.violations)() }, 0, "the producer broke no stand-in rule");
}

/// Re-export after close: the same live physical handle gives the same shareable handle.
fn reexporter(rt: &Runtime) {
    let (base, phys) = allocate(rt, 2);
    let first = export(base, &phys, 0, 2).unwrap();
    let table = first.share_bytes().unwrap().key_bytes().to_vec();
    first.check_close(true).unwrap();
    drop(first);
    let again = export(base, &phys, 0, 2).unwrap();
    let table2 = again.share_bytes().unwrap().key_bytes().to_vec();
    assert_eq!(table, table2, "a live physical handle keeps its shareable handle");
    drop(again);
    free(rt, base, &phys);
    println!("REEXPORT OK");
}

/// A child process of the tests below (run by them with `--ignored`; not a test of its own).
#[test]
#[ignore = "a child-process role of the tests below"]
fn vmm_child_process() {
    let role = std::env::var(ROLE).expect("run by the tests below, which set the role");
    let rt = runtime("acl_vmm_child");
    match role.as_str() {
        "producer" => producer(&rt),
        "reexport" => reexporter(&rt),
        r => panic!("unknown role {r}"),
    }
}

fn child(role: &str, log: &std::path::Path) -> std::process::Child {
    common::role("vmm_child_process", &[(ROLE, role.as_ref()), ("DEVSHARE_STANDIN_LOG", log.as_os_str())])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn threads_import_overlapping_segmented_handles_and_each_page_is_imported_once() {
    if std::env::var_os(ROLE).is_some() {
        return;
    }
    let rt = runtime("acl_vmm_threads");
    let log = std::env::temp_dir().join(format!("devshare_acl_vmm_threads_{}.log", std::process::id()));
    let _ = std::fs::remove_file(&log);
    let mut producer = child("producer", &log);
    let mut handles = Vec::new();
    let mut lines = BufReader::new(producer.stdout.take().unwrap()).lines();
    for line in lines.by_ref() {
        let line = line.unwrap();
        if line == "END" {
            break;
        }
        if let Some(rest) = line.strip_prefix("H ") {
            let (first, h) = rest.split_once(' ').unwrap();
            handles.push((first.parse::<usize>().unwrap(), decode_full(&unhex(h)).unwrap()));
        }
    }
    assert_eq!(handles.len(), ROUNDS * WINDOWS.len());
    let (cold, warm) = handles.split_at(handles.len() / 2);

    // Each import reads its storage: byte i of the whole allocation is i % 251.
    let run = |batch: &[&(usize, devshare::handle::encode::Decoded)]| {
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let rt = &rt;
                s.spawn(move || {
                    // Half the threads never bind a device themselves.
                    // SAFETY: stand-in call.
                    let bound = t % 2 == 0 && unsafe { (rt.set_device)(0) } == 0;
                    for &&(first, ref d) in batch.iter().skip(t).step_by(THREADS) {
                        let imp = import_full(&d.handle, d.table.as_deref(), ImportRequest::default()).unwrap();
                        let again = imp.clone_ref();
                        if bound {
                            let mut got = [0u8; 8192];
                            let v = imp.view();
                            // SAFETY: 8192 bytes of the storage, to a host buffer of that size.
                            let rc = unsafe { (rt.memcpy)(got.as_mut_ptr().cast(), 8192, v.storage.cast(), 8192, 2) };
                            assert_eq!(rc, 0, "aclrtMemcpy D2H");
                            let at = first * SEG + d.handle.storage_offset as usize;
                            assert!(
                                got.iter().enumerate().all(|(i, &b)| b == ((at + i) % 251) as u8),
                                "storage content"
                            );
                        }
                        again.release();
                        imp.release();
                    }
                });
            }
        });
    };
    // Cold: nothing held; pages are imported and freed under contention.
    run(&cold.iter().collect::<Vec<_>>());
    // SAFETY: stand-in queries.
    unsafe {
        assert_eq!(((rt.imported_handles)(), (rt.reservations)(), (rt.mappings)()), (0, 0, 0), "cold: nothing left");
    }
    // Warm: the whole allocation held, so every page is imported once and only mapped again.
    let w = warm.iter().position(|(f, d)| *f == 0 && d.handle.alloc_size == (SEGMENTS * SEG) as u64).unwrap();
    let whole = &warm[w].1;
    let held = import_full(&whole.handle, whole.table.as_deref(), ImportRequest::default()).unwrap();
    let rest: Vec<_> = warm.iter().enumerate().filter(|&(i, _)| i != w).map(|(_, x)| x).collect();
    // SAFETY: stand-in query.
    assert_eq!(unsafe { (rt.imported_handles)() }, SEGMENTS as c_int, "each page imported once");
    run(&rest);
    // SAFETY: stand-in queries.
    unsafe {
        assert_eq!((rt.imported_handles)(), SEGMENTS as c_int, "still each page once while held");
        assert_eq!(((rt.reservations)(), (rt.mappings)()), (1, SEGMENTS as c_int), "only the held mapping is left");
    }
    held.release();
    // SAFETY: stand-in queries.
    unsafe {
        assert_eq!(((rt.imported_handles)(), (rt.reservations)(), (rt.mappings)()), (0, 0, 0), "nothing left");
        assert_eq!((rt.violations)(), 0, "the consumer broke no stand-in rule");
    }
    producer.stdin.take().unwrap().write_all(b"done\n").unwrap();
    let tail: Vec<String> = lines.map_while(|l| l.ok()).collect();
    assert!(
        producer.wait().unwrap().success(),
        "the producer checked every reference and freed its memory:\n{}",
        tail.join("\n")
    );
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    assert!(log_text.is_empty(), "stand-in violations:\n{log_text}");
}

#[test]
fn a_live_physical_handle_exported_again_after_close_keeps_its_shareable_handle() {
    if std::env::var_os(ROLE).is_some() {
        return;
    }
    let log = std::env::temp_dir().join(format!("devshare_acl_vmm_reexport_{}.log", std::process::id()));
    let _ = std::fs::remove_file(&log);
    let out = child("reexport", &log).wait_with_output().unwrap();
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("REEXPORT OK"));
    // devshare cannot tell a live handle from a freed one whose value came back, so it tries
    // the export again; the stand-in records CANN's refusal of a second export, and nothing else.
    let lines: Vec<&str> = log_text.lines().collect();
    assert!(
        lines.len() == 2 && lines.iter().all(|l| l.contains("export once and cache it")),
        "expected exactly the two re-export refusals, got:\n{log_text}"
    );
}
