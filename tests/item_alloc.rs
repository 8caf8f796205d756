//! A pool item costs no heap allocation in the steady state, on either side: producer and
//! consumer in this one thread, every item acquired, sent, received, described and released
//! through the C ABI (`devshare_pool_acquire`, `devshare_pool_send`, `devshare_connection_recv`,
//! `devshare_import_info`, `devshare_import_release`), with a global allocator that counts this
//! thread's allocations.
//!
//! Its own test binary: the counting allocator is process-wide.

use devshare::capi::channel::*;
use devshare::capi::connection::*;
use devshare::capi::export::*;
use devshare::capi::import::*;
use devshare::capi::pool::*;
use devshare::dtype::DevshareDType;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::ffi::{c_void, CString};
use std::mem::size_of;
use std::ptr::null_mut;

struct Counting;

thread_local!(static ALLOCATIONS: Cell<u64> = const { Cell::new(0) });

// SAFETY: every call is passed to the system allocator unchanged; only a thread-local counter
// (const-initialised, no destructor, so it never allocates) is added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.with(|c| c.get())
}

fn ok(status: i32) {
    assert_eq!(status, 0, "{}", devshare::error::last_error_message());
}

struct SendConn(*mut DevshareConnection);
// SAFETY: a connection may be used from any thread; it is handed over once.
unsafe impl Send for SendConn {}

/// A channel at a fresh address, a connection to it (made on another thread while this one
/// serves the handshake) and the consumer's peer id.
///
/// # Safety
/// The caller closes both.
unsafe fn connected(tag: &str) -> (*mut DevshareChannel, *mut DevshareConnection, u64) {
    let address = CString::new(format!("@devshare-test-item-{tag}-{}", std::process::id())).unwrap();
    let mut ch: *mut DevshareChannel = null_mut();
    ok(devshare_channel_listen(address.as_ptr(), &mut ch));
    let connecting = std::thread::spawn(move || {
        let mut conn: *mut DevshareConnection = null_mut();
        ok(devshare_channel_connect(address.as_ptr(), 10_000, &mut conn));
        SendConn(conn)
    });
    ok(devshare_channel_wait_peers(ch, 1, 10_000));
    let conn = connecting.join().unwrap().0;
    let (mut peer, mut n) = (0u64, 0usize);
    ok(devshare_channel_peer_ids(ch, &mut peer, 1, &mut n));
    (ch, conn, peer)
}

#[test]
fn a_pool_item_allocates_nothing_in_the_steady_state() {
    // SAFETY: every pointer passed is valid or NULL where the header allows it; every object is
    // released once.
    unsafe {
        let (ch, conn, peer) = connected("alloc");
        for slots in [1u32, 8] {
            let mut exp: *mut DevshareExporter = null_mut();
            ok(devshare_channel_host_alloc(4096 * u64::from(slots), &mut exp, null_mut()));
            let mut pool: *mut DevsharePool = null_mut();
            ok(devshare_pool_create(ch, exp, 4096, slots, &mut pool));
            ok(devshare_exporter_close(exp, 0));
            let shape = [1024i64];
            let mut desc = std::mem::MaybeUninit::<DevshareTensorDesc>::uninit();
            ok(devshare_tensor_desc_init(desc.as_mut_ptr(), size_of::<DevshareTensorDesc>() as u32));
            let mut desc = desc.assume_init();
            desc.dtype = DevshareDType::new(2, 32, 1);
            desc.ndim = 1;
            desc.shape = shape.as_ptr();
            let mut info = std::mem::MaybeUninit::<DevshareImportInfo>::uninit();
            ok(devshare_import_info_init(info.as_mut_ptr(), size_of::<DevshareImportInfo>() as u32));
            let mut info = info.assume_init();
            let mut item = |i: u64| {
                let mut slot = 0u32;
                let mut ptr: *mut c_void = null_mut();
                ok(devshare_pool_acquire(pool, -1, &mut slot, &mut ptr));
                ptr.cast::<u64>().write(i);
                ok(devshare_pool_send(pool, slot, peer, &desc));
                let mut imp: *mut DevshareImport = null_mut();
                ok(devshare_connection_recv(conn, -1, &mut imp));
                ok(devshare_import_info(imp, &mut info));
                assert_eq!(info.data.cast::<u64>().read(), i);
                ok(devshare_import_release(imp));
            };
            // The first items attach the pool, make the ring, and fill every per-slot cache.
            for i in 0..100 {
                item(i);
            }
            let before = allocations();
            const ITEMS: u64 = 1000;
            for i in 0..ITEMS {
                item(i);
            }
            let per_item = (allocations() - before) as f64 / ITEMS as f64;
            assert_eq!(per_item, 0.0, "{slots} slot(s): {per_item} allocations per item");
            ok(devshare_pool_close(pool));
        }
        ok(devshare_connection_close(conn));
        ok(devshare_channel_close(ch));
    }
}

#[test]
fn a_slot_given_back_early_and_sent_again_while_held_comes_back_once_per_item() {
    // The slot's resting token and box are in use by the first item when the second arrives:
    // the second gets its own, and each item's release gives back exactly its own slot.
    // SAFETY: as above.
    unsafe {
        let (ch, conn, peer) = connected("early");
        let mut exp: *mut DevshareExporter = null_mut();
        ok(devshare_channel_host_alloc(4096, &mut exp, null_mut()));
        let mut pool: *mut DevsharePool = null_mut();
        ok(devshare_pool_create(ch, exp, 4096, 1, &mut pool));
        ok(devshare_exporter_close(exp, 0));
        let mut slot = 0u32;
        let send_one = |slot: &mut u32| {
            ok(devshare_pool_acquire(pool, 5_000, slot, null_mut()));
            ok(devshare_pool_send(pool, *slot, peer, std::ptr::null()));
            let mut imp: *mut DevshareImport = null_mut();
            ok(devshare_connection_recv(conn, 5_000, &mut imp));
            imp
        };
        for _ in 0..3 {
            let a = send_one(&mut slot);
            ok(devshare_import_give_back(a));
            let b = send_one(&mut slot); // the same slot, while `a` still holds its token
            ok(devshare_import_release(a)); // given back already: nothing more goes back
            ok(devshare_channel_service(ch, 0)); // takes whatever came back through the ring
            let mut free = (0u64, 0u32, 0u32);
            ok(devshare_pool_info(pool, &mut free.0, &mut free.1, &mut free.2));
            assert_eq!(free.2, 0, "the slot is out with `b`");
            ok(devshare_import_release(b));
            // `b`'s return frees the slot (an acquire that finds it proves it came back).
            let c = send_one(&mut slot);
            ok(devshare_import_release(c));
        }
        ok(devshare_pool_close(pool));
        ok(devshare_connection_close(conn));
        ok(devshare_channel_close(ch));
    }
}
