//! The examples in `docs/c-api.md`, `docs/python.md` and `docs/rust.md` are
//! the files the tests build and run: every code block preceded by a
//! `<!-- file: PATH -->` marker must equal that file byte for byte, and
//! each page must show the examples listed here.

use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("ffi/ has a parent")
        .to_path_buf()
}

/// `(path, block)` for every marked block of the page.
fn marked_blocks(page: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut lines = page.lines();
    while let Some(line) = lines.next() {
        let Some(path) = line
            .trim()
            .strip_prefix("<!-- file: ")
            .and_then(|r| r.strip_suffix(" -->"))
        else {
            continue;
        };
        let fence = lines.next().unwrap_or_default();
        assert!(
            fence.starts_with("```"),
            "{path}: the marker must be followed by a code block"
        );
        let mut block = String::new();
        for l in lines.by_ref() {
            if l == "```" {
                break;
            }
            block.push_str(l);
            block.push('\n');
        }
        out.push((path.to_owned(), block));
    }
    out
}

fn check_page(page: &str, required: &[&str]) {
    let root = repo();
    let text = std::fs::read_to_string(root.join(page)).unwrap_or_else(|e| panic!("{page}: {e}"));
    let blocks = marked_blocks(&text);
    for (path, block) in &blocks {
        let file = std::fs::read_to_string(root.join(path))
            .unwrap_or_else(|e| panic!("{page}: {path}: {e}"));
        assert!(
            *block == file,
            "{page}: the block marked {path} differs from the file; run scripts/sync-doc-examples.py"
        );
    }
    for r in required {
        assert!(
            blocks.iter().any(|(p, _)| p == r),
            "{page} does not show {r}"
        );
    }
}

#[test]
fn the_c_api_page_shows_the_example_files_verbatim() {
    check_page(
        "docs/c-api.md",
        &[
            "ffi/examples/c/producer.c",
            "ffi/examples/c/consumer.c",
            "ffi/examples/c/tier.c",
            "ffi/examples/cpp/cxlkv.hpp",
            "ffi/examples/cpp/producer.cpp",
            "ffi/examples/cpp/consumer.cpp",
        ],
    );
}

#[test]
fn the_python_page_shows_the_example_files_verbatim() {
    check_page(
        "docs/python.md",
        &[
            "python/examples/producer.py",
            "python/examples/consumer.py",
            "python/examples/tier.py",
        ],
    );
}

#[test]
fn the_rust_page_shows_the_example_file_verbatim() {
    check_page("docs/rust.md", &["examples/quickstart.rs"]);
}
