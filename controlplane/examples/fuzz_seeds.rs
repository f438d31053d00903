//! Writes the fuzzer's seed corpus: one valid frame of every message kind
//! (`<Kind>.bin`) and all of them back to back (`all.bin`), into
//! `controlplane/fuzz/seeds/frame_decode/` (or the directory given as the
//! first argument).
//!
//! ```text
//! cargo run -p cxlkv-controlplane --features samples --example fuzz_seeds
//! ```
//!
//! A unit test (`committed_fuzz_seeds_are_the_current_sample_frames`) fails
//! when the committed seeds no longer match the encoder's output.

use std::path::PathBuf;

use cxlkv_controlplane::proto::samples;

fn main() -> std::io::Result<()> {
    let dir = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/frame_decode")
        });
    std::fs::create_dir_all(&dir)?;
    let mut all = Vec::new();
    for (kind, frame) in samples::frames() {
        std::fs::write(dir.join(format!("{kind:?}.bin")), &frame)?;
        all.extend_from_slice(&frame);
    }
    std::fs::write(dir.join("all.bin"), &all)?;
    println!(
        "wrote {} seeds to {}",
        samples::frames().len() + 1,
        dir.display()
    );
    Ok(())
}
