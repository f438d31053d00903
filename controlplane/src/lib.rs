//! # cxlkv-controlplane
//!
//! (The crate essay is written with the control-plane issue, issue 3.)

pub mod directory;
pub mod frame;
pub mod pool;
pub mod proto;
#[cfg(feature = "sim")]
pub mod sim;
pub mod transport;
