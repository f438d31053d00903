//! Gives the shared library the soname `libcxlkv.so.<ABI major>` so that
//! programs linked against it record the ABI they were built for; the
//! install script lays out `libcxlkv.so.<major>.<minor>.<patch>` with the
//! `libcxlkv.so.<major>` and `libcxlkv.so` links (docs/c-api.md).

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        let major = std::env::var("CARGO_PKG_VERSION_MAJOR").unwrap_or_else(|_| "0".into());
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcxlkv.so.{major}");
    }
}
