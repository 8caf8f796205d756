//! The library's own work per pool item, with no wake-up in it: producer and consumer in this one
//! process and thread, each item acquired, sent, received, described and released through the C
//! ABI functions (`devshare_pool_acquire`, `devshare_pool_send`, `devshare_connection_recv`,
//! `devshare_import_info`, `devshare_import_release`). What a round trip between two processes
//! costs beyond this is the wake-up path. Prints figures; asserts nothing about time. Run with
//! `cargo bench --bench item`.

use devshare::capi::channel::*;
use devshare::capi::connection::*;
use devshare::capi::export::*;
use devshare::capi::import::*;
use devshare::capi::pool::*;
use devshare::dtype::DevshareDType;
use std::ffi::{c_void, CString};
use std::hint::black_box;
use std::mem::size_of;
use std::ptr::null_mut;
use std::time::Instant;

fn ok(status: i32) {
    assert_eq!(status, 0, "{}", devshare::error::last_error_message());
}

/// Median over `rounds` rounds of the per-iteration time of `f` run `iters` times, in ns.
fn median_ns(rounds: usize, iters: usize, mut f: impl FnMut()) -> f64 {
    let mut samples: Vec<f64> = (0..rounds)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            t.elapsed().as_nanos() as f64 / iters as f64
        })
        .collect();
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    samples[rounds / 2]
}

/// A 1-D float32 tensor of `shape` at the start of its storage.
unsafe fn float_row(shape: &[i64; 1]) -> DevshareTensorDesc {
    let mut desc = std::mem::MaybeUninit::<DevshareTensorDesc>::uninit();
    ok(devshare_tensor_desc_init(desc.as_mut_ptr(), size_of::<DevshareTensorDesc>() as u32));
    let mut desc = desc.assume_init();
    desc.dtype = DevshareDType::new(2, 32, 1);
    desc.ndim = 1;
    desc.shape = shape.as_ptr();
    desc
}

/// An initialised `DevshareImportInfo` to describe imports into.
unsafe fn import_info() -> DevshareImportInfo {
    let mut info = std::mem::MaybeUninit::<DevshareImportInfo>::uninit();
    ok(devshare_import_info_init(info.as_mut_ptr(), size_of::<DevshareImportInfo>() as u32));
    info.assume_init()
}

struct Send(*mut DevshareConnection);
// SAFETY: a connection may be used from any thread; it is handed over once.
unsafe impl std::marker::Send for Send {}

fn main() {
    unsafe { run() }
}

unsafe fn run() {
    println!("devshare item path, one process and thread (median of 21 rounds, ns per item)");
    let address = CString::new(format!("@devshare-bench-item-{}", std::process::id())).unwrap();
    let mut ch: *mut DevshareChannel = null_mut();
    ok(devshare_channel_listen(address.as_ptr(), &mut ch));
    let addr = address.clone();
    let connecting = std::thread::spawn(move || {
        let mut conn: *mut DevshareConnection = null_mut();
        ok(devshare_channel_connect(addr.as_ptr(), 10_000, &mut conn));
        Send(conn)
    });
    ok(devshare_channel_wait_peers(ch, 1, 10_000));
    let conn = connecting.join().unwrap().0;
    let mut peer = 0u64;
    let mut n = 0usize;
    ok(devshare_channel_peer_ids(ch, &mut peer, 1, &mut n));
    assert_eq!(n, 1);

    const SLOT: u64 = 4096;
    for slots in [1u32, 8] {
        let mut exp: *mut DevshareExporter = null_mut();
        ok(devshare_channel_host_alloc(SLOT * u64::from(slots), &mut exp, null_mut()));
        let mut pool: *mut DevsharePool = null_mut();
        ok(devshare_pool_create(ch, exp, SLOT, slots, &mut pool));
        ok(devshare_exporter_close(exp, 0));
        let shape = [1024i64];
        let desc = float_row(&shape);
        let mut info = import_info();
        let mut item = || {
            let mut slot = 0u32;
            let mut ptr: *mut c_void = null_mut();
            ok(devshare_pool_acquire(pool, -1, &mut slot, &mut ptr));
            ptr.cast::<u64>().write_volatile(u64::from(slot));
            ok(devshare_pool_send(pool, slot, peer, &desc));
            let mut imp: *mut DevshareImport = null_mut();
            ok(devshare_connection_recv(conn, -1, &mut imp));
            ok(devshare_import_info(imp, &mut info));
            black_box(info.data.cast::<u64>().read_volatile());
            ok(devshare_import_release(imp));
        };
        for _ in 0..2000 {
            item(); // the pool's attachment, the ring, warm caches
        }
        let t = median_ns(21, 20_000, &mut item);
        println!("  {slots} slot(s), 4 KiB: acquire + send + recv + info + release  {t:6.0} ns");
        ok(devshare_pool_close(pool));
    }
    // A registered export's lease (the share-once path of `Channel.register`): a view of the
    // export sent, received, described, released, and the producer's wait for its return.
    for kib in [4u64, 1024] {
        let mut exp: *mut DevshareExporter = null_mut();
        ok(devshare_channel_host_alloc(kib * 1024 * 16, &mut exp, null_mut()));
        ok(devshare_channel_register(ch, exp));
        let shape = [(kib * 256) as i64];
        let mut desc = float_row(&shape);
        desc.storage_offset = 3 * kib * 1024;
        let mut info = import_info();
        let mut lease = || {
            ok(devshare_channel_send(ch, peer, exp, &desc));
            let mut imp: *mut DevshareImport = null_mut();
            ok(devshare_connection_recv(conn, -1, &mut imp));
            ok(devshare_import_info(imp, &mut info));
            black_box(info.data.cast::<u64>().read_volatile());
            ok(devshare_import_release(imp));
            ok(devshare_exporter_wait(exp, -1));
        };
        for _ in 0..2000 {
            lease();
        }
        let t = median_ns(11, 2_000, &mut lease);
        println!("  registered export, {kib} KiB view: send + recv + info + release + wait  {t:6.0} ns");
        ok(devshare_channel_unregister(ch, exp));
        ok(devshare_exporter_close(exp, 0));
    }
    ok(devshare_connection_close(conn));
    ok(devshare_channel_close(ch));
}
