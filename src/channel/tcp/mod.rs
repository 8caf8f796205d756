//! The TCP transport: a remote channel (`tcp://HOST:PORT`) between hosts, carrying pool items
//! only.
//!
//! - `protocol.rs`: the wire protocol over the byte stream (framing, the handshake's messages,
//!   the data paths) and what is and is not protected.
//! - `auth.rs`: the shared key file and the challenge-response proofs.
//! - `producer.rs` / `consumer.rs`: the two ends; a consumer's pool lives in its own memory and
//!   the producer writes each item into it (on the connection, or as a UCX put).
//! - `ucx/`: the typed wrapper of UCX (`libucp`, loaded at run time), for the opt-in UCX data
//!   path.
//!
//! It never names the Unix transport or a vendor: what it shares with the Unix one (limits,
//! peers, admission, the item tokens) is in `crate::channel`.

mod auth;
mod consumer;
mod producer;
mod protocol;
pub mod ucx;

pub(crate) use consumer::RemoteConnection;
pub(crate) use producer::{RemoteChannel, RemotePool};
pub(crate) use protocol::{is_remote, DataPath, DATA_VAR};
