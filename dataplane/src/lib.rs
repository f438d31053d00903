//! # cxlkv-dataplane
//!
//! (The crate essay is written with the data-plane foundation, issue 2.)

pub mod ids;
