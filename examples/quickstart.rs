//! cxlkv from Rust: two inference instances share KV chunks through the
//! pool. docs/rust.md walks through it.
//!
//! ```sh
//! cargo run --release -- serve &                    # a server on the default pool and socket
//! cargo run --release --example quickstart          # or: ... --example quickstart -- SOCKET
//! ```
//!
//! The *prefill* client writes two chunks — one copied in by `batch_put`,
//! one written in place through a page lease — and registers them; the
//! *decode* client, another instance, reads them where they lie (pinned
//! views into the pool, no copy), and a delete waits for its readers.
//! Exits non-zero, saying why, if anything is not as described.

use std::path::PathBuf;
use std::process::ExitCode;

use cxlkv::client::{Client, ClientConfig, DeleteOutcome, ErrorChain, RegisterOutcome};

/// The layout both instances use: one model's KV-chunk geometry. Instances
/// share chunks only within a layout (same page size and fingerprint).
const PAGE_SIZE: u64 = 256 << 10;
const MODEL_FINGERPRINT: u64 = 0x6c6c_616d_6133_2d38; // any u64 naming the model + cache geometry

fn main() -> ExitCode {
    let socket = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(cxlkv::server::default_socket_path);
    match run(socket) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("quickstart: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The whole walk-through against the server listening on `socket` (public
/// so that `tests/rust_example.rs` runs this very code).
pub fn run(socket: PathBuf) -> Result<(), String> {
    // Connecting opens a session; on a Unix socket the pool's descriptor
    // comes with the answer, so no permission on the device is needed.
    let connect = |name: &str| {
        let mut cfg = ClientConfig::unix(&socket);
        cfg.client_name = name.into();
        Client::connect(cfg)
            .map_err(|e| format!("{}; is `cxlkv serve` running there?", ErrorChain(&e)))
    };
    // Errors carry their causes; `ErrorChain` prints them all on one line.
    let fail = |what: &str, e: cxlkv::client::ClientError| format!("{what}: {}", ErrorChain(&e));

    let prefill = connect("quickstart-prefill")?;
    let decode = connect("quickstart-decode")?;
    let writer = prefill
        .layout(PAGE_SIZE, MODEL_FINGERPRINT)
        .map_err(|e| fail("layout", e))?;
    let reader = decode
        .layout(PAGE_SIZE, MODEL_FINGERPRINT)
        .map_err(|e| fail("layout", e))?;

    // Keys are opaque bytes (LMCache's object keys, hashes of token
    // prefixes, ...). A unique prefix keeps reruns against one server apart.
    let run_id = format!("{}-{}", std::process::id(), prefill.instance_id());
    let key_a = format!("quickstart/{run_id}/chunk-0").into_bytes();
    let key_b = format!("quickstart/{run_id}/chunk-1").into_bytes();
    let chunk_a: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();

    // Write 1: copy a buffer in. One allocation pass, the copies, one
    // registration round trip for the whole batch.
    let outcomes = writer
        .batch_put(&[(&key_a, &chunk_a)])
        .map_err(|e| fail("batch_put", e))?;
    expect_inserted(&outcomes, "batch_put")?;

    // Write 2: fill a page in place (a GPU copy engine or a kernel would
    // write here), set its length, register. The bytes are published
    // before the key is visible to anyone.
    let mut lease = writer.alloc().map_err(|e| fail("alloc", e))?;
    let len = 4096;
    {
        let mut page = lease.bytes_mut().map_err(|e| fail("bytes_mut", e))?;
        page[..len].fill(0x5a);
    }
    lease.set_len(len).map_err(|e| fail("set_len", e))?;
    let outcomes = writer
        .batch_register(vec![(&key_b, lease)])
        .map_err(|e| fail("batch_register", e))?;
    expect_inserted(&outcomes, "batch_register")?;
    println!("prefill: wrote 2 chunks ({} + {len} bytes)", chunk_a.len());

    // Read: one round trip pins both chunks; each guard is a view of the
    // chunk in the pool, in the writer's region, valid while it lives.
    let present = reader
        .batch_exists(&[&key_a, &key_b])
        .map_err(|e| fail("batch_exists", e))?;
    if present != [true, true] {
        return Err(format!(
            "batch_exists answered {present:?}, expected both present"
        ));
    }
    let views = reader
        .batch_get(&[&key_a, &key_b])
        .map_err(|e| fail("batch_get", e))?;
    let Ok([Some(view_a), Some(view_b)]) = <[_; 2]>::try_from(views) else {
        return Err("batch_get: a chunk the prefill instance registered is missing".into());
    };
    if view_a.bytes() != chunk_a.as_slice() || view_b.bytes() != vec![0x5a; len].as_slice() {
        return Err("decode read other bytes than prefill wrote".into());
    }
    let at = view_a.location();
    println!(
        "decode: read 2 chunks in place (region {}, page {}), bytes match",
        at.region, at.page
    );

    // A delete never frees a chunk under a reader: it answers `Pinned`
    // while a view lives, and succeeds once every view is released.
    match writer.delete(&key_a).map_err(|e| fail("delete", e))? {
        DeleteOutcome::Pinned { pins } => {
            println!("prefill: delete chunk-0 while read -> pinned ({pins})")
        }
        other => {
            return Err(format!(
                "delete under a reader answered {other:?}, expected Pinned"
            ));
        }
    }
    // Dropping a view releases it (`release` says so explicitly). Unpins
    // are batched for up to `unpin_delay_us` and always sent before this
    // client's next request; another instance's delete comes through its
    // own connection, so send them now.
    drop(view_a);
    view_b.release();
    decode.flush_unpins().map_err(|e| fail("flush_unpins", e))?;
    let outcomes = writer
        .batch_delete(&[&key_a, &key_b])
        .map_err(|e| fail("batch_delete", e))?;
    if outcomes != [DeleteOutcome::Deleted, DeleteOutcome::Deleted] {
        return Err(format!(
            "delete after the reads answered {outcomes:?}, expected Deleted twice"
        ));
    }
    println!("prefill: deleted both chunks once read (their pages go back to prefill's allocator)");

    // `close` ends the session at once (pins released, regions returned
    // after the grace period); dropping the last handle does the same.
    prefill.close().map_err(|e| fail("close", e))?;
    decode.close().map_err(|e| fail("close", e))?;
    Ok(())
}

fn expect_inserted(outcomes: &[RegisterOutcome], op: &str) -> Result<(), String> {
    match outcomes {
        [RegisterOutcome::Inserted] => Ok(()),
        other => Err(format!("{op} answered {other:?}, expected [Inserted]")),
    }
}
