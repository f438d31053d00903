//! # cxlkv-controlplane
//!
//! Everything of cxlkv that moves metadata, never KV bytes: which key lives
//! where in the pool, who owns which region of it, and the wire between the
//! processes that need to know. The bytes themselves stay in shared memory
//! (`cxlkv-dataplane`); only locations, pins and region grants cross a
//! socket (DESIGN §1, §4–§6).
//!
//! ## Shape
//!
//! The two state machines are sans-IO: they take requests and a clock and
//! return replies plus *effects* (allocate a region, free one, end a
//! session) for the layer that drives them to carry out.
//!
//! - [`directory`]: `(layout, key) → location`, pins per session, regions
//!   per instance, freed-page notices, quotas and eviction, exactly-once
//!   replies (DESIGN §4).
//! - [`pool`]: the pool manager, which carves pools into regions, grants
//!   them to directories with unforgeable tokens, and keeps a journal so
//!   that no region is lost or granted twice across crashes (DESIGN §5).
//!   Its `service` module runs it embedded in the server or as a daemon.
//! - [`proto`]: the messages (rkyv archives, checked on receipt before
//!   anything reads them) and their limits.
//! - [`frame`]: how messages are delimited on a byte stream.
//! - [`transport`]: the event loop that owns the sockets (io_uring, or
//!   epoll where io_uring is unavailable) and the pipelined RPC client.
//! - `sim` (feature `sim`): a deterministic simulation of clients, a
//!   directory and a pool manager under injected faults.
//!
//! The `cxlkv` crate puts these together: `cxlkv serve` is a directory and
//! an embedded pool manager behind one transport server; the client library
//! speaks to it through [`transport::RpcClient`].

pub mod directory;
pub mod frame;
pub mod pool;
pub mod proto;
#[cfg(feature = "sim")]
pub mod sim;
pub mod transport;

/// Stands in for a secret in `Debug` output (`<redacted>`): configuration
/// structs that hold one print `tcp_secret: Some(<redacted>)`, so that a
/// printed configuration or a log line says whether a secret is set without
/// saying what it is.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Redacted;

impl std::fmt::Debug for Redacted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}
