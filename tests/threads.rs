//! The import registry under concurrency: 8 threads x 1000 import/release cycles.

use devshare::backend::ImportRequest;
use devshare::export::Exporter;
use devshare::import::{cached_allocations, import};
use std::sync::Barrier;

const THREADS: usize = 8;
const CYCLES: usize = 1000;

fn mappings_of(name: &[u8]) -> usize {
    let name = std::str::from_utf8(&name[1..]).unwrap();
    std::fs::read_to_string("/proc/self/maps").unwrap().lines().filter(|l| l.contains(name)).count()
}

#[test]
fn eight_threads_import_and_release_a_thousand_times_and_leave_no_mapping() {
    let exp = Exporter::host_alloc(1 << 20).unwrap();
    // One handle per thread, plus one shared handle every thread cycles on.
    let own: Vec<_> = (0..THREADS).map(|_| exp.share_bytes().unwrap()).collect();
    let shared = exp.share_bytes().unwrap();
    let name = shared.key_bytes().to_vec();
    let anchor = import(&shared, ImportRequest::default()).unwrap();
    let barrier = Barrier::new(THREADS);
    std::thread::scope(|s| {
        for (t, h) in own.iter().enumerate() {
            let (barrier, shared) = (&barrier, &shared);
            s.spawn(move || {
                let first = import(h, ImportRequest::default()).unwrap();
                barrier.wait();
                for i in 0..CYCLES {
                    let a = import(shared, ImportRequest::default()).unwrap();
                    let b = import(h, ImportRequest::default()).unwrap();
                    assert_eq!(a.view().base, b.view().base, "one mapping per allocation");
                    // Write a thread-specific byte and read it back through the other import.
                    let at = t * CYCLES + i;
                    unsafe { *a.view().data.add(at) = (t + 1) as u8 };
                    assert_eq!(unsafe { *b.view().data.add(at) }, (t + 1) as u8);
                    b.release();
                    a.release();
                }
                first.release();
            });
        }
    });
    assert_eq!(exp.outstanding().unwrap(), 1, "only the shared handle is still held");
    assert_eq!(cached_allocations(), 1);
    anchor.release();
    assert_eq!(exp.outstanding().unwrap(), 0);
    assert_eq!(cached_allocations(), 0);
    assert_eq!(mappings_of(&name), 1, "only the exporter's own mapping remains");
    let data = unsafe { std::slice::from_raw_parts(exp.ptr(), THREADS * CYCLES) };
    for (i, &b) in data.iter().enumerate() {
        assert_eq!(b as usize, i / CYCLES + 1, "byte {i}");
    }
    drop(exp);
    assert_eq!(mappings_of(&name), 0);
    assert!(!std::path::Path::new("/dev/shm").join(std::str::from_utf8(&name[1..]).unwrap()).exists());
}
