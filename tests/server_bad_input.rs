//! Bad input gets its error code, with the limit involved, and changes no
//! state: unknown region, oversized key, batch over the limit, wrong
//! protocol version, missing or wrong TCP secret, requests before `Hello`.
//! On both transport backends.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::*;
use cxlkv::server::Server;
use cxlkv_controlplane::frame::{FrameHeader, HEADER_BYTES, encode_frame, frame_len};
use cxlkv_controlplane::proto::{self, ErrorCode, ErrorReply, Kind};
use cxlkv_controlplane::transport::Endpoint;

/// Runs `bad` and checks that the directory's state is the same after.
fn unchanged(server: &cxlkv::server::ServerHandle, what: &str, bad: impl FnOnce()) {
    let before = state_of(&server.directory_stats().unwrap());
    bad();
    let after = state_of(&server.directory_stats().unwrap());
    assert_eq!(before, after, "{what} changed the directory's state");
}

#[test]
fn bad_requests_get_their_code_and_change_nothing() {
    for backend in backends() {
        let mut cfg = config_on("bad", backend);
        cfg.directory.max_batch = 64;
        let server = Server::start(cfg).unwrap();
        let (mut c, region) = session_with_region(&server, "client");
        c.register(vec![(b"k".to_vec(), loc(region, 0))]).unwrap();
        c.lookup(&[b"k"], 1).unwrap();

        unchanged(&server, "an unknown region", || {
            let e = expect_code(
                c.register(vec![
                    (b"x".to_vec(), loc(region, 1)),
                    (b"y".to_vec(), loc(999_999, 0)),
                ]),
                ErrorCode::UnknownRegion,
            );
            assert!(e.message.contains("999999"), "{backend:?}: {e:?}");
        });
        unchanged(&server, "an oversized key", || {
            let long = vec![b'x'; proto::MAX_KEY_BYTES + 1];
            let e = expect_code(c.lookup(&[b"k", &long], 1), ErrorCode::KeyTooLong);
            assert_eq!(e.limit, proto::MAX_KEY_BYTES as u64);
            let e = expect_code(
                c.register(vec![(long.clone(), loc(region, 2))]),
                ErrorCode::KeyTooLong,
            );
            assert_eq!(e.limit, proto::MAX_KEY_BYTES as u64);
        });
        unchanged(&server, "a batch over the server's limit", || {
            let keys: Vec<Vec<u8>> = (0..65u32).map(|i| i.to_le_bytes().to_vec()).collect();
            let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
            let e = expect_code(c.exists(&refs), ErrorCode::BatchTooLarge);
            assert_eq!(e.limit, 64, "{backend:?}: the configured limit");
            let e = expect_code(c.delete(&refs), ErrorCode::BatchTooLarge);
            assert_eq!(e.limit, 64);
        });
        unchanged(&server, "a batch over the protocol's limit", || {
            let keys: Vec<Vec<u8>> = (0..proto::MAX_BATCH as u32 + 1)
                .map(|i| i.to_le_bytes().to_vec())
                .collect();
            let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
            let e = expect_code(c.lookup(&refs, 1), ErrorCode::BatchTooLarge);
            assert_eq!(e.limit, proto::MAX_BATCH as u64);
        });
        unchanged(&server, "a wrong frame version", || {
            let mut s = UnixStream::connect(server.socket_path()).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let hb = encode_payload(&proto::Heartbeat {
                meta: proto::RequestMeta::default(),
            });
            let mut frame = Vec::new();
            encode_frame(&mut frame, Kind::Heartbeat.as_u16(), 77, &hb).unwrap();
            frame[4..6].copy_from_slice(&2u16.to_le_bytes());
            s.write_all(&frame).unwrap();
            let e = read_error(&mut s, 77);
            assert_eq!(e.error_code(), Some(ErrorCode::UnsupportedVersion), "{e:?}");
            assert_eq!(e.limit, u64::from(proto::PROTOCOL_MAX));
            // The connection survives its bad frame.
            let mut frame = Vec::new();
            encode_frame(&mut frame, Kind::Heartbeat.as_u16(), 78, &hb).unwrap();
            s.write_all(&frame).unwrap();
            let e = read_error(&mut s, 78);
            assert_eq!(e.error_code(), Some(ErrorCode::HelloRequired), "{e:?}");
        });
        unchanged(&server, "a Hello with no common version", || {
            let other = Raw::connect_unix(server.socket_path());
            let e = expect_code(
                other.call::<_, proto::Welcome>(&proto::Hello {
                    meta: proto::RequestMeta::default(),
                    protocol_min: 2,
                    protocol_max: 3,
                    instance_id: "future".into(),
                    client_name: "test".into(),
                    client_secret: None,
                }),
                ErrorCode::UnsupportedVersion,
            );
            assert_eq!(e.limit, u64::from(proto::PROTOCOL_MAX));
        });
        unchanged(&server, "requests before Hello", || {
            let other = Raw::connect_unix(server.socket_path());
            expect_code(other.exists(&[b"k"]), ErrorCode::HelloRequired);
        });
        unchanged(&server, "a second Hello on a connection", || {
            expect_code(c.hello("again").0, ErrorCode::InvalidArgument);
        });
        server.shutdown().unwrap();
    }
}

/// Reads frames until the reply to `request_id`; returns its error.
fn read_error(s: &mut UnixStream, request_id: u64) -> ErrorReply {
    loop {
        let mut h = [0u8; HEADER_BYTES];
        s.read_exact(&mut h).unwrap();
        let header = FrameHeader::decode(&h).unwrap();
        let len = header.payload_len as usize;
        let mut rest = vec![0u8; frame_len(len) - HEADER_BYTES];
        s.read_exact(&mut rest).unwrap();
        if header.request_id != request_id {
            continue;
        }
        assert_eq!(header.kind, Kind::ErrorReply.as_u16());
        // An 8-aligned copy for checked access.
        let mut words = vec![0u64; len.div_ceil(8)];
        // SAFETY: `words` has room for `len` bytes; u64 accepts any bytes.
        let aligned = unsafe {
            std::ptr::copy_nonoverlapping(rest.as_ptr(), words.as_mut_ptr().cast::<u8>(), len);
            std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), len)
        };
        let frame = cxlkv_controlplane::frame::Frame {
            header,
            payload: aligned,
        };
        let e = proto::access::<ErrorReply>(frame).unwrap();
        return proto::deserialize::<ErrorReply>(e).unwrap();
    }
}

#[test]
fn tcp_clients_need_the_pre_shared_secret() {
    for backend in backends() {
        let mut cfg = config_on("tcp", backend);
        cfg.tcp_listen = Some("127.0.0.1:0".parse().unwrap());
        cfg.tcp_secret = Some(b"s3cret".to_vec());
        let server = Server::start(cfg).unwrap();
        let ep = Endpoint::Tcp(server.tcp_addr().unwrap());
        unchanged(&server, "a Hello without a secret", || {
            let c = Raw::connect(&ep);
            expect_code(c.hello("tcp-a").0, ErrorCode::AuthenticationRequired);
        });
        unchanged(&server, "a Hello with the wrong secret", || {
            let c = Raw::connect(&ep);
            expect_code(
                c.hello_with_secret("tcp-a", Some(b"guess")).0,
                ErrorCode::AuthenticationFailed,
            );
            assert!(
                wait_until(Duration::from_secs(10), || c.rpc.is_closed()
                    || c.try_call::<_, proto::HeartbeatReply>(
                        &proto::Heartbeat { meta: c.ro() },
                        Duration::from_secs(1)
                    )
                    .is_none()),
                "{backend:?}: the connection is closed after a failed authentication"
            );
        });
        let mut c = Raw::connect(&ep);
        let (welcome, fds) = c.hello_with_secret("tcp-a", Some(b"s3cret"));
        let welcome = welcome.unwrap();
        assert_eq!(
            welcome.fds_passed, 0,
            "{backend:?}: no descriptors over TCP"
        );
        assert!(fds.is_empty());
        assert_eq!(
            welcome.pools[0].path,
            server.pool_paths()[0].to_string_lossy()
        );
        let granted = c.request_region(0).unwrap();
        c.register(vec![(b"k".to_vec(), loc(granted.desc.region, 0))])
            .unwrap();
        assert_eq!(server.directory_stats().unwrap().keys, 1);
        server.shutdown().unwrap();
    }
}

#[test]
fn a_tcp_listener_without_a_secret_must_be_declared_insecure() {
    let mut cfg = config_on("tcpcfg", backends()[0]);
    cfg.tcp_listen = Some("127.0.0.1:0".parse().unwrap());
    let e = Server::start(cfg.clone()).unwrap_err();
    assert!(e.to_string().contains("insecure"), "{e}");
    cfg.tcp_insecure_no_secret = true;
    let server = Server::start(cfg).unwrap();
    let c = Raw::connect(&Endpoint::Tcp(server.tcp_addr().unwrap()));
    c.hello("open").0.unwrap();
    server.shutdown().unwrap();
}
