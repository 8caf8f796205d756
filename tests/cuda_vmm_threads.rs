//! Segmented (VMM) cuda memory imported and released from many threads at once, over the CUDA
//! stand-in driver (built by build.rs). The driver allows importing in the exporting process,
//! so this process is both producer and consumer: it creates 8 physical segments (POSIX fd
//! exportable), maps them, exports five overlapping windows, and its threads import and release
//! handles of them concurrently, each import taking the exporter's fds with `pidfd_getfd` —
//! cold (every page imported and released under contention) and warm (one import holds every
//! page). The exporter holds one fd per physical segment however many windows name it, each
//! page is imported at most once while in use, and after the release nothing is imported,
//! reserved or mapped beyond the producer's own buffer, no taken fd is left open, every
//! reference came back, and no driver rule was broken.

mod common;

use devshare::backend::{ExportOptions, ImportRequest, SegmentedMemory};
use devshare::export::{Exporter, TensorDesc};
use devshare::handle::encode::{decode_full, encode_full_into, Decoded};
use devshare::handle::DEVSHARE_BACKEND_CUDA;
use devshare::import::import_full;
use std::ffi::{c_int, c_void};
use std::time::Duration;

const SEG: usize = 2 << 20;
const SEGMENTS: usize = 8;
/// (first segment, count) of each exported window: pages shared between windows.
const WINDOWS: [(usize, usize); 5] = [(0, 4), (2, 4), (4, 4), (1, 6), (0, 8)];
const ROUNDS: usize = 48;
const THREADS: usize = 8;

/// `CUmemAllocationProp` (cuda.h layout, 32 bytes).
#[repr(C)]
struct AllocationProp {
    kind: c_int,
    requested_handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
    win32_meta: *mut c_void,
    alloc_flags: [u8; 8],
}

/// `CUmemAccessDesc` (12 bytes).
#[repr(C)]
struct AccessDesc {
    location_type: c_int,
    location_id: c_int,
    flags: c_int,
}

type Query = unsafe extern "C" fn() -> c_int;

struct Driver {
    _lib: libloading::Library,
    ctx: *mut c_void,
    ctx_set_current: unsafe extern "C" fn(*mut c_void) -> c_int,
    mem_create: unsafe extern "C" fn(*mut u64, usize, *const AllocationProp, u64) -> c_int,
    release: unsafe extern "C" fn(u64) -> c_int,
    reserve: unsafe extern "C" fn(*mut u64, usize, usize, u64, u64) -> c_int,
    address_free: unsafe extern "C" fn(u64, usize) -> c_int,
    map: unsafe extern "C" fn(u64, usize, usize, u64, u64) -> c_int,
    unmap: unsafe extern "C" fn(u64, usize) -> c_int,
    set_access: unsafe extern "C" fn(u64, usize, *const AccessDesc, usize) -> c_int,
    htod: unsafe extern "C" fn(u64, *const c_void, usize) -> c_int,
    dtoh: unsafe extern "C" fn(*mut c_void, u64, usize) -> c_int,
    violations: Query,
    reservations: Query,
    mappings: Query,
    imported_handles: Query,
}

// SAFETY: the context is a process-wide token the driver lets any thread make current.
unsafe impl Sync for Driver {}

fn driver() -> Driver {
    let lib = common::load(common::StandIn::Cuda, "cuda_vmm_threads");
    // SAFETY: the stand-in is a plain C library; the symbols have these C signatures
    // (tests/standin/cuda/cuda_standin.h); the calls get valid out pointers.
    unsafe {
        let init: unsafe extern "C" fn(u32) -> c_int = *lib.get(b"cuInit").unwrap();
        let device_get: unsafe extern "C" fn(*mut c_int, c_int) -> c_int = *lib.get(b"cuDeviceGet").unwrap();
        let retain: unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int =
            *lib.get(b"cuDevicePrimaryCtxRetain").unwrap();
        assert_eq!(init(0), 0);
        let mut dev = 0;
        assert_eq!(device_get(&mut dev, 0), 0);
        let mut ctx = std::ptr::null_mut();
        assert_eq!(retain(&mut ctx, dev), 0);
        Driver {
            ctx,
            ctx_set_current: *lib.get(b"cuCtxSetCurrent").unwrap(),
            mem_create: *lib.get(b"cuMemCreate").unwrap(),
            release: *lib.get(b"cuMemRelease").unwrap(),
            reserve: *lib.get(b"cuMemAddressReserve").unwrap(),
            address_free: *lib.get(b"cuMemAddressFree").unwrap(),
            map: *lib.get(b"cuMemMap").unwrap(),
            unmap: *lib.get(b"cuMemUnmap").unwrap(),
            set_access: *lib.get(b"cuMemSetAccess").unwrap(),
            htod: *lib.get(b"cuMemcpyHtoD_v2").unwrap(),
            dtoh: *lib.get(b"cuMemcpyDtoH_v2").unwrap(),
            violations: *lib.get(b"cusi_violation_count").unwrap(),
            reservations: *lib.get(b"cusi_vmm_reservations").unwrap(),
            mappings: *lib.get(b"cusi_vmm_mappings").unwrap(),
            imported_handles: *lib.get(b"cusi_vmm_imported_handles").unwrap(),
            _lib: lib,
        }
    }
}

impl Driver {
    fn bind(&self) {
        // SAFETY: a context the driver handed out.
        assert_eq!(unsafe { (self.ctx_set_current)(self.ctx) }, 0);
    }

    /// `n` physical segments on device 0 mapped back to back, read-write; u32 element i = i.
    fn allocate(&self, n: usize) -> (u64, Vec<u64>) {
        self.bind();
        let prop = AllocationProp {
            kind: 1,                   // CU_MEM_ALLOCATION_TYPE_PINNED
            requested_handle_types: 1, // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            location_type: 1,          // CU_MEM_LOCATION_TYPE_DEVICE
            location_id: 0,
            win32_meta: std::ptr::null_mut(),
            alloc_flags: [0; 8],
        };
        let access = AccessDesc { location_type: 1, location_id: 0, flags: 3 }; // PROT_READWRITE
        let pattern: Vec<u32> = (0..(n * SEG / 4) as u32).collect();
        let mut va = 0u64;
        let mut phys = vec![0u64; n];
        // SAFETY: stand-in calls with valid out pointers; every address is inside the reservation.
        unsafe {
            assert_eq!((self.reserve)(&mut va, n * SEG, 0, 0, 0), 0, "cuMemAddressReserve");
            for (i, p) in phys.iter_mut().enumerate() {
                assert_eq!((self.mem_create)(p, SEG, &prop, 0), 0, "cuMemCreate");
                assert_eq!((self.map)(va + (i * SEG) as u64, SEG, 0, *p, 0), 0, "cuMemMap");
            }
            assert_eq!((self.set_access)(va, n * SEG, &access, 1), 0, "cuMemSetAccess");
            assert_eq!((self.htod)(va, pattern.as_ptr().cast(), n * SEG), 0, "cuMemcpyHtoD");
        }
        (va, phys)
    }

    fn free(&self, va: u64, phys: &[u64]) {
        self.bind();
        // SAFETY: stand-in calls on what `allocate` made.
        unsafe {
            for (i, &p) in phys.iter().enumerate() {
                assert_eq!((self.unmap)(va + (i * SEG) as u64, SEG), 0);
                assert_eq!((self.release)(p), 0);
            }
            assert_eq!((self.address_free)(va, phys.len() * SEG), 0);
        }
    }

    fn counts(&self) -> (c_int, c_int, c_int) {
        // SAFETY: stand-in queries.
        unsafe { ((self.imported_handles)(), (self.reservations)(), (self.mappings)()) }
    }
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// The tests here count what the driver holds: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn threads_import_overlapping_segmented_handles_and_each_page_is_imported_once() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let drv = driver();
    let log = std::path::PathBuf::from(std::env::var_os("DEVSHARE_STANDIN_LOG").unwrap());
    let _ = std::fs::remove_file(&log);
    let (va, phys) = drv.allocate(SEGMENTS);
    let own = drv.counts();
    let fds_before = open_fds();
    let exporters: Vec<Exporter> = WINDOWS
        .iter()
        .map(|&(first, n)| {
            let mem = SegmentedMemory {
                base: (va + (first * SEG) as u64) as *mut u8,
                segment_size: SEG as u64,
                physical: &phys[first..first + n],
            };
            Exporter::export_segments(DEVSHARE_BACKEND_CUDA, 0, &mem, &ExportOptions::default()).unwrap()
        })
        .collect();
    assert_eq!(open_fds(), fds_before + SEGMENTS, "one exported fd per physical segment, however many windows");

    // 4 KiB tensors at offsets that cross page boundaries of their window, as encoded handles.
    let mut handles: Vec<(usize, Decoded)> = Vec::new();
    for r in 0..ROUNDS {
        for (w, e) in exporters.iter().enumerate() {
            let offset = ((r * 7919 + w * 104_729) % (WINDOWS[w].1 * SEG - 8192)) as u64 & !3;
            let h = e
                .share(&TensorDesc {
                    shape: &[8192],
                    storage_offset: offset,
                    storage_size: Some(8192),
                    ..Default::default()
                })
                .unwrap();
            let mut bytes = Vec::new();
            encode_full_into(&h, e.external_table(), &mut bytes).unwrap();
            handles.push((WINDOWS[w].0, decode_full(&bytes).unwrap()));
        }
    }
    let fds_shared = open_fds();
    let (cold, warm) = handles.split_at(handles.len() / 2);

    // Each import reads its storage: u32 element i of the whole buffer is i.
    let run = |batch: &[&(usize, Decoded)]| {
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let drv = &drv;
                s.spawn(move || {
                    // Half the threads never make a context current themselves.
                    let verify = t % 2 == 0;
                    if verify {
                        drv.bind();
                    }
                    for &&(first, ref d) in batch.iter().skip(t).step_by(THREADS) {
                        let imp = import_full(&d.handle, d.table.as_deref(), ImportRequest::default()).unwrap();
                        let again = imp.clone_ref();
                        if verify {
                            let mut got = [0u32; 2048];
                            let v = imp.view();
                            // SAFETY: 8192 bytes of the storage, to a host buffer of that size.
                            let rc = unsafe { (drv.dtoh)(got.as_mut_ptr().cast(), v.storage as u64, 8192) };
                            assert_eq!(rc, 0, "cuMemcpyDtoH");
                            let at = (first * SEG + d.handle.storage_offset as usize) / 4;
                            assert!(got.iter().enumerate().all(|(i, &x)| x as usize == at + i), "storage content");
                        }
                        again.release();
                        imp.release();
                    }
                });
            }
        });
    };
    // Cold: nothing held; pages are imported and released under contention.
    run(&cold.iter().collect::<Vec<_>>());
    assert_eq!(drv.counts(), own, "cold: nothing imported, reserved or mapped is left");
    assert_eq!(open_fds(), fds_shared, "cold: no taken fd is left open");
    // Warm: the whole buffer held, so every page is imported once and only mapped again.
    let w = warm.iter().position(|(f, d)| *f == 0 && d.handle.alloc_size == (SEGMENTS * SEG) as u64).unwrap();
    let whole = &warm[w].1;
    let held = import_full(&whole.handle, whole.table.as_deref(), ImportRequest::default()).unwrap();
    let rest: Vec<_> = warm.iter().enumerate().filter(|&(i, _)| i != w).map(|(_, x)| x).collect();
    assert_eq!(drv.counts().0, SEGMENTS as c_int, "each page imported once");
    run(&rest);
    assert_eq!(
        drv.counts(),
        (SEGMENTS as c_int, own.1 + 1, own.2 + SEGMENTS as c_int),
        "only the held mapping is left"
    );
    held.release();
    assert_eq!(drv.counts(), own, "nothing left");
    assert_eq!(open_fds(), fds_shared, "no taken fd is left open");

    for e in &exporters {
        e.wait(Some(Duration::from_secs(20))).expect("every reference came back");
        e.check_close(false).unwrap();
    }
    drop(exporters);
    assert_eq!(open_fds(), fds_before, "the exporters closed their fds");
    drv.free(va, &phys);
    // SAFETY: stand-in query.
    assert_eq!(unsafe { (drv.violations)() }, 0, "no stand-in rule broken");
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    assert!(log_text.is_empty(), "stand-in violations:\n{log_text}");
}

/// A pool over a segmented CUDA export, handed over a channel: the segment fds travel with
/// `SCM_RIGHTS`, so the consumer imports without `pidfd_getfd` (no ptrace permission needed),
/// once for the pool's life, and every slot reads the producer's data at a fixed address.
#[test]
fn a_segmented_pool_travels_over_a_channel_without_pidfd_getfd() {
    use devshare::channel::{Channel, Connection};
    const SLOTS: usize = 4;
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let drv = driver();
    let (va, phys) = drv.allocate(SLOTS);
    let own = drv.counts();
    let mem = SegmentedMemory { base: va as *mut u8, segment_size: SEG as u64, physical: &phys };
    let exp = std::sync::Arc::new(
        Exporter::export_segments(DEVSHARE_BACKEND_CUDA, 0, &mem, &ExportOptions::default()).unwrap(),
    );
    let addr = format!("@devshare-test-{}-cuda-pool", std::process::id());
    let ch = Channel::listen(&addr).unwrap();
    let taken_before = devshare::backend::pidfd::fds_taken();
    let t = Some(Duration::from_secs(20));
    let consumer = std::thread::spawn({
        let addr = addr.clone();
        let drv = &drv as *const Driver as usize;
        move || {
            // SAFETY: the driver outlives this thread (joined below).
            let drv = unsafe { &*(drv as *const Driver) };
            drv.bind();
            let c = Connection::connect(&addr, t).unwrap();
            let mut addrs = [0usize; SLOTS];
            for round in 0..3 * SLOTS {
                let imp = c.recv(t).unwrap();
                let (_, slot) = imp.pool_slot().unwrap();
                let v = imp.view();
                if round < SLOTS {
                    addrs[slot as usize] = v.data as usize;
                }
                assert_eq!(addrs[slot as usize], v.data as usize, "slot {slot} keeps its address");
                let mut got = [0u32; 1024];
                // SAFETY: 4096 bytes of the item, to a host buffer of that size.
                assert_eq!(unsafe { (drv.dtoh)(got.as_mut_ptr().cast(), v.data as u64, 4096) }, 0);
                let at = slot as usize * SEG / 4 + 256;
                assert!(got.iter().enumerate().all(|(i, &x)| x as usize == at + i), "slot {slot} content");
                imp.release();
            }
            drop(c);
        }
    });
    ch.wait_peers(1, t).unwrap();
    let peer = ch.peer_ids().unwrap()[0];
    let pool = ch.pool(exp.clone(), SEG as u64, SLOTS as u32).unwrap();
    for _ in 0..3 * SLOTS {
        let (slot, _) = pool.acquire(t).unwrap();
        // 1024 u32 starting 1 KiB into the slot.
        pool.send(
            slot,
            peer,
            &TensorDesc {
                dtype: devshare::dtype::DevshareDType::new(1, 32, 1),
                shape: &[1024],
                storage_offset: 1024,
                storage_size: Some(4096),
                ..Default::default()
            },
        )
        .unwrap();
    }
    consumer.join().unwrap();
    assert_eq!(devshare::backend::pidfd::fds_taken(), taken_before, "no fd was taken with pidfd_getfd");
    exp.wait(t).expect("the consumer detached when its connection closed");
    drop(pool);
    drop(ch);
    assert_eq!(drv.counts(), own, "the consumer's import of the pool is gone");
    drop(exp);
    drv.free(va, &phys);
    // SAFETY: stand-in query.
    assert_eq!(unsafe { (drv.violations)() }, 0, "no stand-in rule broken");
}

/// A hostile producer's segmented handle names, as a segment's fd, a file of a FUSE file system
/// whose server never answers (`tests/common/fuse.rs`). The consumer takes it with `pidfd_getfd`
/// (here from this very process, which the stand-in allows) and must not hand it to the driver,
/// whose `fstat` of it would wait for the server for ever, nor close it where a caller waits:
/// the import is refused at once, naming the descriptor, and the taken copy leaves this
/// process's table.
#[test]
fn a_segment_fd_on_a_file_system_that_never_answers_is_refused_before_the_driver_sees_it() {
    use devshare::handle::segments::{set_segments, DEVSHARE_SEGMENTS_CUDA_FD};
    use std::os::fd::AsRawFd;
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(server) = common::fuse::Stalling::start("fuse_server_role") else { return };
    let drv = driver();
    let (va, phys) = drv.allocate(1);
    let own = drv.counts();
    let exp = Exporter::export_segments(
        DEVSHARE_BACKEND_CUDA,
        0,
        &SegmentedMemory { base: va as *mut u8, segment_size: SEG as u64, physical: &phys },
        &ExportOptions::default(),
    )
    .unwrap();
    let mut h = exp.share(&TensorDesc { shape: &[1024], storage_size: Some(4096), ..Default::default() }).unwrap();
    let honest = h;
    let fuse_fd = server.open().as_raw_fd();
    set_segments(&mut h, SEG as u64, DEVSHARE_SEGMENTS_CUDA_FD, &fuse_fd.to_le_bytes()).unwrap();
    let taken_before = devshare::backend::pidfd::fds_taken();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = import_full(&h, None, ImportRequest::default());
        let _ = tx.send(r.map(|imp| imp.release()).map_err(|e| (e.status(), e.to_string())));
    });
    let (status, why) = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the import came back within 10 s")
        .expect_err("a FUSE file is no segment of device memory");
    assert_eq!(devshare::backend::pidfd::fds_taken(), taken_before + 1, "the fd was taken with pidfd_getfd");
    assert_eq!(status, devshare::error::Status::Untrusted, "{why}");
    let named = format!("fd {fuse_fd} of process {} is a file that is not shared memory", std::process::id());
    assert!(why.contains(&named), "{why}");
    server.let_go();
    assert!(server.none_open(), "the taken copy left this process's table too");
    assert_eq!(drv.counts(), own, "nothing was imported");

    // The honest handle of the same memory still imports.
    let imp = import_full(&honest, None, ImportRequest::default()).unwrap();
    imp.release();
    exp.wait(Some(Duration::from_secs(20))).unwrap();
    drop(exp);
    drv.free(va, &phys);
    // SAFETY: stand-in query.
    assert_eq!(unsafe { (drv.violations)() }, 0, "no stand-in rule broken");
}

/// The FUSE server of the test above, in its child process.
#[test]
#[ignore = "a role of the test above, run in a child process"]
fn fuse_server_role() {
    common::fuse::serve();
}
