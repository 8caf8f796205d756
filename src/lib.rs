//! devshare: open tensors that PyTorch (CPU, CUDA, torch_npu) exported, from C and C++, and hand
//! buffers back, without Python.
//!
//! - [`handle`]: the one handle format — a fixed-size C struct, its byte encoding and text form,
//!   and the validation every decode goes through.
//! - [`backend`]: where memory comes from and how it is mapped: host shared memory, Ascend NPU
//!   memory through the ACL runtime, NVIDIA GPU memory through the CUDA driver (both loaded at
//!   run time), single allocations and segmented (VMM) ones.
//! - [`export`] / [`import`]: the producer and consumer sides, the per-process import registry,
//!   and PyTorch's ref-counter protocol ([`refcounter`]).
//! - [`torch`]: PyTorch's and torch_npu's tuple dialect, to and from handles; [`dlpack`]: DLPack.
//! - [`channel`]: devshare-to-devshare handoff, over a Unix socket on one host (credentials,
//!   sealed memfds, a shared-memory ring) or a key-authenticated TCP connection across hosts:
//!   leases returned when a connection closes, pools of fixed-address slots.
//! - [`capi`]: the C ABI (`include/devshare.h`), a thin layer over the above.

#![deny(clippy::undocumented_unsafe_blocks)]

pub mod backend;
pub mod capi;
pub mod channel;
pub mod dlpack;
pub mod dtype;
pub mod error;
pub mod export;
mod fds;
mod fork;
pub mod handle;
pub mod hostid;
pub mod import;
mod loader;
pub mod refcounter;
mod shm;
pub mod torch;

pub use error::{Error, Result, Status};
