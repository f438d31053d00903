//! # cxlkv-dataplane
//!
//! (The crate essay is written with the data-plane foundation, issue 2.)

pub mod alloc;
pub mod ids;
mod sync;
pub mod table;
