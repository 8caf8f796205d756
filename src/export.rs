//! The exporter: one exported allocation, the handles handed out for tensors in it, and the
//! ref-counter that tells when their consumers let go.

use crate::backend::{self, host, Exported};
use crate::dtype::DevshareDType;
use crate::error::{Error, Result};
use crate::handle::{validate, DevshareHandle, DEVSHARE_MAX_NDIM};
use crate::refcounter::RefCounter;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A tensor inside an exported allocation, as the exporter describes it.
#[derive(Clone, Debug)]
pub struct TensorDesc<'a> {
    pub dtype: DevshareDType,
    /// Shape in elements (at most `DEVSHARE_MAX_NDIM` entries).
    pub shape: &'a [i64],
    /// Strides in elements; `None` for C-contiguous.
    pub strides: Option<&'a [i64]>,
    /// Byte offset of the storage in the allocation.
    pub storage_offset: u64,
    /// Storage size in bytes; `None` for "to the end of the allocation".
    pub storage_size: Option<u64>,
    /// Element offset of the tensor in the storage.
    pub tensor_offset: i64,
    /// Count the receiver in before the handle travels (host only; see
    /// `DEVSHARE_HANDLE_FLAG_INFLIGHT`).
    pub inflight: bool,
}

/// C-contiguous strides for a shape (saturating: validation rejects what overflows).
pub fn contiguous_strides(shape: &[i64]) -> Vec<i64> {
    let mut strides = vec![0i64; shape.len()];
    let mut acc: i64 = 1;
    for i in (0..shape.len()).rev() {
        strides[i] = acc;
        acc = acc.saturating_mul(shape[i].max(1));
    }
    strides
}

/// One exported allocation.
pub struct Exporter {
    alloc: Box<dyn Exported>,
    backend: u16,
    refs: Mutex<Vec<RefCounter>>,
}

impl Exporter {
    /// Allocate `size` bytes of shareable host memory and export it.
    pub fn host_alloc(size: u64) -> Result<Exporter> {
        Ok(Exporter {
            alloc: host::alloc(size)?,
            backend: crate::handle::DEVSHARE_BACKEND_HOST,
            refs: Mutex::new(Vec::new()),
        })
    }

    /// Export an existing host object in PyTorch's `file_system` layout (e.g. a PyTorch CPU
    /// storage shared with `_share_filename_cpu_`), `size` data bytes of it.
    pub fn host_adopt(name: &[u8], size: u64) -> Result<Exporter> {
        Ok(Exporter {
            alloc: host::adopt(name, size)?,
            backend: crate::handle::DEVSHARE_BACKEND_HOST,
            refs: Mutex::new(Vec::new()),
        })
    }

    /// Export existing memory on a backend.
    pub fn export(backend_id: u16, device: i32, ptr: *mut u8, size: u64) -> Result<Exporter> {
        let alloc = backend::get(backend_id)?.export(device, ptr, size)?;
        Ok(Exporter { alloc, backend: backend_id, refs: Mutex::new(Vec::new()) })
    }

    /// Start of the allocation in this process.
    pub fn ptr(&self) -> *mut u8 {
        self.alloc.ptr()
    }

    /// Size of the allocation in bytes.
    pub fn size(&self) -> u64 {
        self.alloc.size()
    }

    fn refs(&self) -> MutexGuard<'_, Vec<RefCounter>> {
        self.refs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Make a handle for a tensor in this allocation. The handle carries a fresh ref-counter
    /// slot set to 1: it is one reference, owed one release by one consumer.
    pub fn share(&self, desc: &TensorDesc<'_>) -> Result<DevshareHandle> {
        if desc.shape.len() > DEVSHARE_MAX_NDIM {
            return Err(Error::BadNdim(format!(
                "{} dimensions is above the maximum {DEVSHARE_MAX_NDIM}",
                desc.shape.len()
            )));
        }
        let mut h = DevshareHandle {
            backend: self.backend,
            device_index: self.alloc.device_index(),
            device_uuid: self.alloc.device_uuid(),
            host_id: crate::hostid::host_id(),
            producer_pid: std::process::id() as i32,
            ndim: desc.shape.len() as u32,
            alloc_size: self.alloc.size(),
            storage_offset: desc.storage_offset,
            tensor_offset: desc.tensor_offset,
            dtype: desc.dtype,
            ..Default::default()
        };
        h.storage_size = match desc.storage_size {
            Some(s) => s,
            None => self.alloc.size().checked_sub(desc.storage_offset).ok_or_else(|| {
                Error::StorageOutOfBounds(format!(
                    "storage_offset {} is beyond the {}-byte allocation",
                    desc.storage_offset,
                    self.alloc.size()
                ))
            })?,
        };
        h.shape[..desc.shape.len()].copy_from_slice(desc.shape);
        match desc.strides {
            Some(s) if s.len() != desc.shape.len() => {
                return Err(Error::InvalidArgument(format!(
                    "{} strides for {} dimensions",
                    s.len(),
                    desc.shape.len()
                )))
            }
            Some(s) => h.strides[..s.len()].copy_from_slice(s),
            None => {
                let s = contiguous_strides(desc.shape);
                h.strides[..s.len()].copy_from_slice(&s);
            }
        }
        h.set_key(self.alloc.key());
        if desc.inflight {
            h.flags |= crate::handle::DEVSHARE_HANDLE_FLAG_INFLIGHT;
        }
        validate(&h)?;

        let mut refs = self.refs();
        let slot = match refs.last_mut().and_then(RefCounter::take_slot) {
            Some(slot) => slot,
            None => {
                refs.push(RefCounter::create()?);
                refs.last_mut().and_then(RefCounter::take_slot).expect("fresh ref-counter has slots")
            }
        };
        let rc = refs.last().expect("just used");
        h.set_ref(rc.name(), slot);
        if desc.inflight {
            self.alloc.add_inflight()?;
        }
        Ok(h)
    }

    /// Share the whole allocation as a 1-D `uint8` tensor.
    pub fn share_bytes(&self) -> Result<DevshareHandle> {
        let shape = [self.alloc.size() as i64];
        self.share(&TensorDesc {
            dtype: DevshareDType::new(crate::dtype::code::UINT, 8, 1),
            shape: &shape,
            strides: None,
            storage_offset: 0,
            storage_size: None,
            tensor_offset: 0,
            inflight: false,
        })
    }

    /// References handed out and not yet released by their consumers.
    pub fn outstanding(&self) -> u64 {
        self.refs().iter().map(RefCounter::outstanding).sum()
    }

    /// Value of one handle's ref-counter slot (1 while held, 0 once released).
    pub fn slot_value(&self, h: &DevshareHandle) -> Option<i64> {
        self.refs()
            .iter()
            .find(|rc| rc.name() == h.ref_name_bytes())
            .map(|rc| rc.slot_value(h.ref_slot))
    }

    /// Wait until no reference is outstanding, or `timeout` passes (`None`: forever).
    pub fn wait(&self, timeout: Option<Duration>) -> Result<()> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(20);
        loop {
            let n = self.outstanding();
            if n == 0 {
                return Ok(());
            }
            if let Some(t) = timeout {
                let elapsed = start.elapsed();
                if elapsed >= t {
                    return Err(Error::Timeout(format!(
                        "{n} reference(s) still outstanding after {} ms",
                        t.as_millis()
                    )));
                }
                pause = pause.min(t - elapsed);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(2));
        }
    }

    /// Remove the shm names of the allocation (host) and of the ref-counters now, whoever still
    /// maps them. Never do this while a PyTorch process may map either: PyTorch aborts when a
    /// name it expects to unlink is gone.
    pub fn unlink_names(&self) {
        self.alloc.unlink();
        for rc in self.refs().iter() {
            rc.unlink();
        }
    }

    /// Whether the export may be closed now. Refused with `Busy` while references are
    /// outstanding on a backend whose importers cannot keep the memory alive, unless `force`.
    /// Closing is dropping the exporter.
    pub fn check_close(&self, force: bool) -> Result<()> {
        if !force && !self.alloc.survives_exporter_close() {
            let n = self.outstanding();
            if n > 0 {
                return Err(Error::Busy(format!(
                    "{n} reference(s) outstanding; wait for them or close with DEVSHARE_CLOSE_FORCE"
                )));
            }
        }
        Ok(())
    }
}
