//! Core benchmark: handle encode/decode, cached and cold imports, through the C ABI functions.
//! Prints figures; asserts nothing about time. Run with `cargo bench --bench core`.
//!
//! The cold import is compared, in the same run, with what a C program would otherwise write by
//! hand for the same object: shm_open + fstat + mmap + munmap + close.

use devshare::capi::export::*;
use devshare::capi::handle::*;
use devshare::capi::import::*;
use devshare::dtype::DevshareDType;
use devshare::handle::encode::DEVSHARE_HANDLE_MAX_ENCODED_SIZE;
use devshare::handle::text::DEVSHARE_HANDLE_MAX_TEXT_SIZE;
use devshare::handle::DevshareHandle;
use std::ffi::CString;
use std::hint::black_box;
use std::mem::size_of;
use std::ptr::{null, null_mut};
use std::time::Instant;

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

fn ok(status: i32) {
    assert_eq!(status, 0, "{}", devshare::error::last_error_message());
}

fn main() {
    unsafe { run() }
}

unsafe fn run() {
    println!("devshare core benchmark (median of rounds; ns or µs per operation)");
    let mut exp: *mut DevshareExporter = null_mut();
    ok(devshare_host_alloc(1 << 20, &mut exp, null_mut()));
    let shape = [2i64, 3, 64, 64];
    // What a C caller writes: devshare_tensor_desc_init(&desc, sizeof desc), then the fields.
    let mut desc = std::mem::MaybeUninit::<DevshareTensorDesc>::uninit();
    ok(devshare_tensor_desc_init(desc.as_mut_ptr(), size_of::<DevshareTensorDesc>() as u32));
    let mut desc = desc.assume_init();
    desc.dtype = DevshareDType::new(2, 32, 1);
    desc.ndim = 4;
    desc.shape = shape.as_ptr();
    desc.storage_offset = 4096;
    let mut h = DevshareHandle::default();
    ok(devshare_exporter_share(exp, &desc, &mut h));

    let mut buf = [0u8; DEVSHARE_HANDLE_MAX_ENCODED_SIZE];
    let mut len = 0usize;
    let enc = median_ns(21, 20_000, || {
        black_box(devshare_handle_encode(black_box(&h), buf.as_mut_ptr(), buf.len(), &mut len));
    });
    let mut out = DevshareHandle::default();
    let dec = median_ns(21, 20_000, || {
        black_box(devshare_handle_decode(black_box(buf.as_ptr()), len, &mut out));
    });
    assert_eq!(out, h);
    let mut text = [0 as std::ffi::c_char; DEVSHARE_HANDLE_MAX_TEXT_SIZE];
    let mut tlen = 0usize;
    let to_text = median_ns(21, 20_000, || {
        black_box(devshare_handle_to_text(black_box(&h), text.as_mut_ptr(), text.len(), &mut tlen));
    });
    let from_text = median_ns(21, 20_000, || {
        black_box(devshare_handle_from_text(black_box(text.as_ptr()), &mut out));
    });
    println!("handle (4-D float32, {len} bytes encoded, {tlen} chars as text):");
    println!("  encode                      {enc:8.0} ns");
    println!("  decode + validate           {dec:8.0} ns");
    println!("  to_text                     {to_text:8.0} ns");
    println!("  from_text (decode+validate) {from_text:8.0} ns");

    // Cache hit: the allocation is already imported (held by `anchor`).
    let mut anchor: *mut DevshareImport = null_mut();
    ok(devshare_import(&h, null(), &mut anchor));
    let hit = median_ns(21, 20_000, || {
        let mut imp: *mut DevshareImport = null_mut();
        devshare_import(black_box(&h), null(), &mut imp);
        devshare_import_release(black_box(imp));
    });
    ok(devshare_import_release(anchor));
    println!("import + release, cache hit   {hit:8.0} ns");

    // Cold: every import maps a 1 MiB object and returns its own handle's reference.
    const COLD: usize = 2000;
    let handles: Vec<DevshareHandle> = (0..COLD)
        .map(|_| {
            let mut h = DevshareHandle::default();
            ok(devshare_exporter_share(exp, null(), &mut h));
            h
        })
        .collect();
    let mut i = 0;
    let cold = median_ns(20, COLD / 20, || {
        let mut imp: *mut DevshareImport = null_mut();
        ok(devshare_import(&handles[i], null(), &mut imp));
        ok(devshare_import_release(imp));
        i += 1;
    });
    let name = CString::new(h.key_bytes()).unwrap();
    let raw = median_ns(20, COLD / 20, || {
        let fd = libc::shm_open(name.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0);
        assert!(fd >= 0);
        let mut st: libc::stat = std::mem::zeroed();
        libc::fstat(fd, &mut st);
        let p =
            libc::mmap(null_mut(), st.st_size as usize, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
        assert_ne!(p, libc::MAP_FAILED);
        libc::munmap(black_box(p), st.st_size as usize);
        libc::close(fd);
    });
    println!("cold host import + release, 1 MiB:");
    println!("  devshare (map + ref-counter check + release)  {:8.2} µs", cold / 1000.0);
    println!("  hand-written shm_open+fstat+mmap+munmap+close {:8.2} µs", raw / 1000.0);
    println!("  ratio devshare / hand-written                 {:8.2}x", cold / raw);
    let mut outstanding = 0u64;
    ok(devshare_exporter_outstanding(exp, &mut outstanding));
    assert_eq!(outstanding, 0, "every handle was imported and released");
    ok(devshare_exporter_close(exp, 0));
}
