//! The server's request paths, as a review of `src/server/` (session 25)
//! found them wanting: configurations the server accepted and then did not
//! honour, connections that held a slot without ever opening a session,
//! retried replies that differed from the first, a shutdown that expired
//! instances, and answers missing from the latency counts.

mod common;

use cxlkv::server::{ServerConfig, ServerError};

/// A configuration `validate` must refuse, with a message containing each
/// of `needles`.
#[track_caller]
fn refused(cfg: &ServerConfig, needles: &[&str]) {
    let err = cfg.validate().expect_err("refused");
    let m = err.to_string();
    for n in needles {
        assert!(m.contains(n), "{n:?} not in {m:?}");
    }
}

/// A TCP secret with `tcp_insecure_no_secret` was accepted by the Rust
/// API, and the directory then asked TCP peers for no secret at all (the
/// configuration file already refused the pair).
#[test]
fn a_tcp_secret_with_insecure_no_secret_is_refused_not_silently_unenforced() {
    let mut cfg = ServerConfig::ephemeral("secret-and-insecure");
    cfg.tcp_listen = Some("127.0.0.1:0".parse().unwrap());
    cfg.tcp_secret = Some(b"sesame".to_vec());
    cfg.tcp_insecure_no_secret = true;
    refused(
        &cfg,
        &["tcp_secret", "tcp_insecure_no_secret", "not be enforced"],
    );
    let err = cxlkv::server::Server::start(cfg.clone())
        .map(drop)
        .unwrap_err();
    assert!(matches!(err, ServerError::Config(_)), "{err}");
    cfg.tcp_insecure_no_secret = false;
    cfg.validate().unwrap();
    cfg.tcp_secret = None;
    cfg.tcp_insecure_no_secret = true;
    cfg.validate().unwrap();
}

/// More notices per response than the protocol's maximum made every reply
/// to an owner with that long a backlog one its client refuses.
#[test]
fn notices_per_response_over_the_protocols_maximum_is_refused() {
    let max = cxlkv_controlplane::proto::MAX_NOTICES_PER_REPLY;
    let mut cfg = ServerConfig::ephemeral("notices-per-response");
    cfg.directory.notices_per_response = max + 1;
    refused(
        &cfg,
        &["notices_per_response = 1025", "MAX_NOTICES_PER_REPLY"],
    );
    assert!(cfg.directory.validate().is_err());
    cfg.directory.notices_per_response = max;
    cfg.validate().unwrap();
}
