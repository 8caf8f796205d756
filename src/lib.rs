//! devshare: open tensors that PyTorch (CPU, CUDA, torch_npu) exported, from C and C++, and hand
//! buffers back, without Python.
//!
//! - [`handle`]: the one handle format — a fixed-size C struct, its byte encoding and text form,
//!   and the validation every decode goes through.
//! - [`backend`]: where memory comes from and how it is mapped (host shared memory today; ACL and
//!   CUDA modules plug into the same trait).
//! - [`export`] / [`import`]: the producer and consumer sides, the per-process import registry,
//!   and PyTorch's ref-counter protocol ([`refcounter`]).
//! - [`capi`]: the C ABI (`include/devshare.h`), a thin layer over the above.

pub mod backend;
pub mod capi;
pub mod dlpack;
pub mod dtype;
pub mod error;
pub mod export;
pub mod handle;
pub mod hostid;
pub mod import;
pub mod refcounter;
mod shm;
pub mod torch;

pub use error::{Error, Result, Status};
