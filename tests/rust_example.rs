//! The Rust walk-through (`examples/quickstart.rs`, docs/rust.md) runs as
//! documented: this test compiles the example's own code as a module and
//! runs it against a private server, then checks that it left nothing
//! behind (no key, pin or session), and that a wrong socket is refused with
//! a hint at the cause.

use std::path::PathBuf;
use std::time::Duration;

use cxlkv::server::{Server, ServerConfig};

#[allow(dead_code)] // its `main` is the example binary's
#[path = "../examples/quickstart.rs"]
mod quickstart;

#[test]
fn the_rust_quickstart_shares_chunks_between_two_instances_and_cleans_up() {
    let server = Server::start(ServerConfig::ephemeral("quickstart")).expect("server starts");
    quickstart::run(server.socket_path().to_path_buf()).expect("the walk-through succeeds");
    // Run twice: its keys are unique per run, so a rerun against the same
    // server (as a user does) succeeds too.
    quickstart::run(server.socket_path().to_path_buf()).expect("a second run succeeds");

    // Both clients closed: their sessions end at once; nothing stays pinned
    // or registered.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let stats = loop {
        let s = server.directory_stats().expect("stats");
        if s.sessions == 0 || std::time::Instant::now() > deadline {
            break s;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(
        (stats.sessions, stats.keys, stats.pins),
        (0, 0, 0),
        "sessions, keys, pins left after the walk-through"
    );
    server.shutdown().expect("clean shutdown");
}

#[test]
fn the_rust_quickstart_says_where_it_looked_when_no_server_listens() {
    let missing = PathBuf::from(format!(
        "/tmp/cxlkv-quickstart-missing-{}.sock",
        std::process::id()
    ));
    let err = quickstart::run(missing.clone()).expect_err("nothing listens there");
    assert!(
        err.contains(&missing.display().to_string()) && err.contains("is `cxlkv serve` running"),
        "unhelpful error: {err}"
    );
}
