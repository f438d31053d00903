//! # cxlkv
//!
//! A KV-cache storage engine on shared memory. LLM inference instances —
//! processes on one host, or hosts attached to one CXL memory pool — write
//! KV-cache chunks once into a shared pool and read each other's chunks in
//! place; only metadata crosses the control plane ("don't move data, share the
//! memory").
//!
//! This crate is the facade: the client library, the engine-facing L1 tier,
//! the server assembly and the `cxlkv` command line. The layers below it are
//! [`cxlkv_dataplane`] (devices, mapping, page allocation, visibility, copies).
//! The architecture is described in `docs/architecture.md`; using the
//! client from Rust, with a runnable walk-through, in `docs/rust.md`
//! (`examples/quickstart.rs`).

// The `cxlkv` command line's own parts: public for the binary and its
// integration tests, not an API (hidden from the documentation).
#[doc(hidden)]
pub mod bench;
#[doc(hidden)]
pub mod chaos;
#[doc(hidden)]
pub mod cli;
#[doc(hidden)]
pub mod demo;

pub mod client;
pub mod config;
pub mod server;
pub mod tier;

pub use client::Client;

pub use cxlkv_dataplane as dataplane;
