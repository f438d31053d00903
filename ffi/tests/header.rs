//! `include/cxlkv.h` is what cbindgen makes of the sources today: this test
//! regenerates it and fails when the committed header differs (a changed
//! signature, struct or status that was not regenerated). With
//! `CXLKV_WRITE_HEADER=1` it writes the header instead
//! (`scripts/check-header.sh --write`).

use std::path::Path;

#[test]
fn the_committed_header_is_what_cbindgen_generates() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml"))
        .expect("ffi/cbindgen.toml parses");
    let bindings = cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header");
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let path = crate_dir.join("include").join("cxlkv.h");
    if std::env::var_os("CXLKV_WRITE_HEADER").is_some() {
        std::fs::write(&path, &generated).expect("write include/cxlkv.h");
        return;
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    if committed != generated {
        let committed = String::from_utf8_lossy(&committed);
        let generated = String::from_utf8_lossy(&generated);
        let first = committed
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(committed.lines().count().min(generated.lines().count()));
        panic!(
            "ffi/include/cxlkv.h is stale (first difference at line {}: committed {:?}, generated {:?}); run scripts/check-header.sh --write",
            first + 1,
            committed.lines().nth(first).unwrap_or("<end>"),
            generated.lines().nth(first).unwrap_or("<end>"),
        );
    }
}
