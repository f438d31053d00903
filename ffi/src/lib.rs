//! # cxlkv-ffi: the C ABI of cxlkv
//!
//! Inference engines are C++ (and Python around them); they link cxlkv
//! through this library — `libcxlkv.so` / `libcxlkv.a`, header
//! `include/cxlkv.h` (generated from this crate by cbindgen and committed;
//! `scripts/check-header.sh` fails when it is stale). The surface is the
//! Rust client's ([`cxlkv::Client`]): connect, layouts, leases written in
//! place and registered, `put`, zero-copy `get` views, `exists`, `delete`,
//! statistics, region map/unmap callbacks — each batch-native, one round
//! trip per batch — and the L1 tier's ([`cxlkv::tier::L1Tier`]) 17
//! operations with per-key result arrays, listeners and events.
//!
//! ## Conventions (what every entry point does)
//!
//! - **Names**: `cxlkv_` for functions and types, `CXLKV_` for constants.
//! - **Status**: every fallible call returns a `cxlkv_status` ([`status`]:
//!   stable numbers, never reused; server refusals are `100 +` the wire
//!   code) and writes its outputs through caller-provided pointers;
//!   `cxlkv_last_error()` gives the calling thread's message
//!   ([`boundary`]).
//! - **No unwinding**: every body runs under `catch_unwind`; a panic is
//!   `CXLKV_STATUS_PANIC` plus a message, never an unwind into C.
//! - **Handles** are opaque tokens checked against a registry on every
//!   call ([`handle`]): NULL, freed, foreign-typed and garbage handles give
//!   `CXLKV_STATUS_BAD_HANDLE`, not undefined behaviour, and so do handles
//!   a forked child inherited (they name the parent's session). Functions that
//!   free a handle accept NULL as a no-op, like `free`.
//! - **Arguments**: NULL pointers, misalignment, and lengths over the
//!   protocol's limits are refused before any memory is touched
//!   ([`args`]); a batch of 0 entries is a no-op. What cannot be checked —
//!   that a non-NULL pointer really covers the length given — is each
//!   function's `# Safety` contract, restated in the header.
//! - **Memory**: batches use caller-owned arrays; the library never hands
//!   out memory for C to free. Views point into the shared pool and stay
//!   valid until released.
//! - **Versioned structs**: structs that may grow begin with `uint32_t
//!   size` ([`args`] explains how older and newer sizes are handled).
//! - **Threads**: every function may be called from any thread; handles
//!   are shareable between threads, except that one lease has one writer
//!   at a time and a view must not be read while it is being released.
//!   Each function's doc says so.
//!
//! ## Modules
//!
//! [`status`] (codes and error mapping), [`boundary`] (panics, last
//! error), [`handle`] (registry), [`args`] (checked arguments, versioned
//! structs), [`config`] (`cxlkv_config`, layout options), [`client`]
//! (connect, close, stats, map observers), [`layout`] (layouts, leases,
//! register, put), [`read`] (get, views, release, exists, delete),
//! [`tier`] (the L1 tier: every operation, listeners, events).
//!
//! ## The library's name
//!
//! The lib target is named `cxlkv` (so the files are `libcxlkv.so` and
//! `libcxlkv.a`), like the root crate's rlib. The two never collide on
//! disk, but their rustdoc output would (`target/doc/cxlkv/`), so this one
//! is built with `doc = false`; its reference is the header and
//! `docs/c-api.md`.

#![deny(unsafe_op_in_unsafe_fn)]

// Declared in the order the header lists their functions (rustfmt keeps
// groups separated by comments as they are).
mod status;
// The boundary: panics, last error.
mod boundary;
// Configuration structs and their defaults.
mod config;
// Sessions: connect, close, statistics, map observers.
mod client;
// Keys and chunks.
mod layout;
mod read;
// The L1 tier.
mod tier;
// Internals without entry points.
mod args;
mod handle;

#[cfg(test)]
mod tests;

use std::ffi::c_char;

pub use status::cxlkv_status;
// A constant only C reads (the header declares it).
pub use tier::CXLKV_TIER_MAX_HOLDS;

/// The ABI's version: bumped (major) when a function, struct or status
/// changes meaning or layout incompatibly; structs that grow keep the
/// major (see the `size` fields).
pub const CXLKV_ABI_VERSION_MAJOR: u32 = 0;
/// Bumped when functions, fields or statuses are added.
pub const CXLKV_ABI_VERSION_MINOR: u32 = 4;

/// The ABI version of the loaded library: `major << 16 | minor`. A program
/// built against a header whose `CXLKV_ABI_VERSION_MAJOR` differs must not
/// use the library.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub extern "C" fn cxlkv_abi_version() -> u32 {
    (CXLKV_ABI_VERSION_MAJOR << 16) | CXLKV_ABI_VERSION_MINOR
}

/// The library's version (`"0.1.0"`), a static string.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub extern "C" fn cxlkv_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}
