//! How a server refusal reads once the client renders it: the code's name
//! and number, the server's message, and the limit involved — each once.
//! A region the pool manager cannot place came back as
//! `…: region allocation failed: pool manager: no free extent … (code 12,
//! limit N) (limit N)`: the server copied the pool manager's whole error,
//! code and limit included, into its message, and the client appended the
//! limit again.

mod client_support;

use client_support::*;
use cxlkv::client::{Client, ClientError};
use cxlkv_controlplane::proto::ErrorCode;

#[test]
fn an_out_of_space_refusal_states_its_code_and_limit_once() {
    let server = start_server("error-text");
    let mut cfg = client_config(&server);
    // Twice the test pool (256 MiB): no free extent can hold it.
    cfg.layout.region_size_bytes = 512 << 20;
    let client = Client::connect(cfg).unwrap();
    let layout = client.layout(PAGE, FINGERPRINT).unwrap();
    let err = layout
        .put(key(0), &chunk(0, 100))
        .expect_err("a region larger than the pool is refused");
    let ClientError::Server { limit, .. } = &err else {
        panic!("not a server refusal: {err:?}");
    };
    assert_eq!(err.code(), Some(ErrorCode::OutOfSpace), "{err:?}");
    assert!(*limit > 0, "the largest free extent is reported: {err:?}");
    let text = err.with_causes().to_string();
    assert!(
        text.starts_with("request_region: server refused with out_of_space (12): "),
        "{text}"
    );
    assert_eq!(
        text.matches(&format!("limit {limit}")).count(),
        1,
        "the limit is stated once: {text}"
    );
    assert_eq!(text.matches("(12)").count(), 1, "{text}");
    assert!(!text.contains("code 12"), "the code is stated once: {text}");
    assert!(text.contains("no free extent of 536870912 bytes"), "{text}");
    // The server left the pool to the manager: said in words, not as a
    // Rust `Option`.
    assert!(text.contains("(any pool; largest free extent"), "{text}");
    assert!(!text.contains("None") && !text.contains("Some("), "{text}");
}

/// A TCP client without the listener's secret, or with a wrong one, is told
/// what to give it, not only that it was refused.
#[test]
fn a_tcp_client_without_the_right_secret_is_told_what_to_give() {
    let mut cfg = cxlkv::server::ServerConfig::ephemeral("error-text-tcp");
    cfg.tcp_listen = Some("127.0.0.1:0".parse().unwrap());
    cfg.tcp_secret = Some(b"correct horse".to_vec());
    let server = cxlkv::server::Server::start(cfg).unwrap();
    for (what, secret, code) in [
        ("no secret", None, ErrorCode::AuthenticationRequired),
        (
            "a wrong secret",
            Some(b"correct horse\n".to_vec()),
            ErrorCode::AuthenticationFailed,
        ),
    ] {
        let mut cfg = cxlkv::client::ClientConfig::tcp(server.tcp_addr().unwrap());
        cfg.client_secret = secret;
        let err = Client::connect(cfg).expect_err(what);
        let text = err.with_causes().to_string();
        assert!(text.contains(code.name()), "{what}: {text}");
        assert!(
            text.contains("give the client the contents of the server's tcp_secret_file (without its trailing newline)"),
            "{what}: {text}"
        );
    }
    server.shutdown().unwrap();
}
