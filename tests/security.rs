//! The security suite (docs/security.md, "Attacks and the tests that prove
//! them"): forged and replayed region tokens, another instance's region, a
//! location outside one's own regions, another layout's key, oversized
//! keys, batches and frames, protocol-version mismatches, a wrong TCP
//! secret, and a peer whose kernel-given identity (`SO_PEERCRED`) differs
//! from the identity it claims. Each is refused with its own error code and
//! leaves the directory's state as it was (`state_of` before and after, and
//! the victim's keys looked up again).
//!
//! Requests the client library would refuse to build are sent as raw
//! protocol messages (`common::Raw`) or raw frames. Cases already proven
//! elsewhere are not repeated: the basic oversized key/batch, wrong frame
//! version and TCP `Hello` cases are in `server_bad_input.rs`, the pool
//! manager's own token checks in `controlplane/tests/pool_security.rs`.

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::*;
use cxlkv::server::{Server, ServerConfig, ServerHandle};
use cxlkv_controlplane::directory::OpKind;
use cxlkv_controlplane::frame::{FrameHeader, HEADER_BYTES, MAX_PAYLOAD_BYTES, frame_len};
use cxlkv_controlplane::proto::{
    self, DeleteOutcome, ErrorCode, ErrorReply, Kind, Layout, RegisterOutcome, RejectReason,
    UnpinOutcome,
};
use cxlkv_controlplane::transport::Endpoint;

/// The directory's state (`common::state_of`) without the instances'
/// reply caches: a refused mutating request's answer is kept there for a
/// retry of the same sequence number, by design (exactly-once answers).
fn state(server: &ServerHandle) -> String {
    let mut s = server.directory_stats().unwrap();
    for i in &mut s.per_instance {
        i.cached_replies = 0;
        i.cached_reply_bytes = 0;
    }
    state_of(&s)
}

/// Runs `bad` and checks that the directory's state is the same after.
fn unchanged<T>(server: &ServerHandle, what: &str, bad: impl FnOnce() -> T) -> T {
    let before = state(server);
    let r = bad();
    let after = state(server);
    assert_eq!(before, after, "{what} changed the directory's state");
    r
}

/// A second layout: same page size, another model.
const OTHER_LAYOUT: Layout = Layout {
    page_size_bytes: LAYOUT.page_size_bytes,
    fingerprint: 0xbad,
};

fn forged(g: &proto::RegionGranted) -> proto::OwnedRegion {
    let mut token = g.token.0;
    token[0] ^= 1;
    proto::OwnedRegion {
        token: proto::RegionToken(token),
        ..owned(g)
    }
}

/// Removes the pool file and its state directory when dropped, also when
/// the test fails before the last server removed them.
struct RemoveOnDrop(Vec<std::path::PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
            let _ = std::fs::remove_dir_all(p);
        }
    }
}

/// The victim's key `k` is still there, at `at`.
#[track_caller]
fn still_there(c: &mut Raw, at: proto::Location) {
    let found = c.lookup(&[b"k"], 0).unwrap();
    assert_eq!(found.locations, vec![Some(at)]);
}

#[test]
fn forged_and_replayed_region_tokens_claim_nothing_before_or_after_a_restart() {
    let mut cfg = ServerConfig::ephemeral("sec-token");
    cfg.remove_pool_on_shutdown = false;
    let _cleanup = RemoveOnDrop(vec![
        cfg.pool_path.clone(),
        std::path::PathBuf::from(format!("{}.state", cfg.pool_path.display())),
    ]);
    cfg.directory.instance_grace = Duration::from_secs(30);
    cfg.tick_ms = 20;
    let server = Server::start(cfg.clone()).unwrap();

    let mut victim = Raw::connect_unix(server.socket_path());
    let welcome = victim.hello("victim").0.unwrap();
    let kept = victim.request_region(0).unwrap();
    victim
        .register(vec![(b"k".to_vec(), loc(kept.desc.region, 0))])
        .unwrap();
    // A region the victim gave back: its token is a replay from now on.
    let returned = victim.request_region(0).unwrap();
    let meta = victim.rw();
    let _: proto::RegionReturned = victim
        .call(&proto::ReturnRegion {
            meta,
            region: returned.desc.region,
        })
        .unwrap();
    let mut thief = Raw::connect_unix(server.socket_path());
    let thief_welcome = thief.hello("thief").0.unwrap();
    let thief_region = thief.request_region(0).unwrap();

    // While the directory knows the victim: a guessed instance secret is
    // refused before any token is looked at...
    unchanged(&server, "a guessed instance secret", || {
        let c = Raw::connect_unix(server.socket_path());
        let e = expect_code(
            c.call::<_, proto::Reattached>(&reattach_msg(
                "victim",
                proto::InstanceSecret([7; 32]),
                vec![owned(&kept)],
                1,
            )),
            ErrorCode::AuthenticationFailed,
        );
        assert!(e.message.contains("victim"), "{e:?}");
    });
    // ... and the thief, resuming its own instance, cannot move the
    // victim's region (real token: a replay by another instance), a forged
    // token of its own region, or the returned region (a previous region's
    // token) to itself.
    let c = Raw::connect_unix(server.socket_path());
    let back: proto::Reattached = c
        .call(&reattach_msg(
            "thief",
            thief_welcome.instance_secret,
            vec![owned(&kept), forged(&thief_region), owned(&returned)],
            thief.next_seq,
        ))
        .unwrap();
    assert!(back.resumed);
    assert!(back.accepted.is_empty(), "{back:?}");
    let refused: Vec<(u64, Option<ErrorCode>)> = back
        .refused
        .iter()
        .map(|r| (r.region, ErrorCode::from_u16(r.code)))
        .collect();
    assert_eq!(
        refused,
        vec![
            (kept.desc.region, Some(ErrorCode::NotOwner)),
            (thief_region.desc.region, Some(ErrorCode::NotOwner)),
            (returned.desc.region, Some(ErrorCode::NotOwner)),
        ]
    );
    // The thief registering into the victim's region is refused too.
    let r = unchanged(&server, "a register into the victim's region", || {
        c.call::<_, proto::RegisterReply>(&proto::Register {
            meta: proto::RequestMeta {
                seq: thief.next_seq,
                ..proto::RequestMeta::default()
            },
            layout: LAYOUT,
            entries: vec![proto::RegisterEntry {
                key: b"k2".to_vec(),
                location: loc(kept.desc.region, 1),
            }],
        })
        .unwrap()
    });
    assert_eq!(
        r.outcomes,
        vec![RegisterOutcome::Rejected(RejectReason::NotOwner)]
    );
    drop((c, thief));
    still_there(&mut victim, loc(kept.desc.region, 0));
    drop(victim);
    server.shutdown().unwrap();

    // After a restart the directory has no instance secrets: ownership of
    // a recovered region is proven by its token alone. Every attempt
    // without a valid token is refused with its own code,
    // `OwnershipNotProven` (an honest client holding no token waits out the
    // grace period on it; one with a wrong secret could not), and claims
    // nothing.
    cfg.remove_pool_on_shutdown = true;
    let server = Server::start(cfg).unwrap();
    unchanged(
        &server,
        "a Hello taking the recovered instance's name",
        || {
            let c = Raw::connect_unix(server.socket_path());
            expect_code(c.hello("victim").0, ErrorCode::InstanceInUse);
        },
    );
    for (what, presented) in [
        ("a forged token", vec![forged(&kept)]),
        ("a previous region's token", vec![owned(&returned)]),
        ("another instance's token", vec![owned(&thief_region)]),
        ("no token at all", vec![]),
    ] {
        unchanged(&server, what, || {
            let c = Raw::connect_unix(server.socket_path());
            let e = expect_code(
                c.call::<_, proto::Reattached>(&reattach_msg(
                    "victim",
                    proto::InstanceSecret([9; 32]),
                    presented,
                    1,
                )),
                ErrorCode::OwnershipNotProven,
            );
            assert!(e.message.contains("victim"), "{what}: {e:?}");
        });
    }
    // The owner, with the real token, still gets its region back.
    let mut owner = Raw::connect_unix(server.socket_path());
    let back: proto::Reattached = owner
        .call(&reattach_msg(
            "victim",
            welcome.instance_secret,
            vec![owned(&kept)],
            100,
        ))
        .unwrap();
    assert_eq!(back.accepted, vec![kept.desc.region]);
    owner.next_seq = 100;
    let again = owner
        .register(vec![(b"k".to_vec(), loc(kept.desc.region, 0))])
        .unwrap();
    assert_eq!(again.outcomes, vec![RegisterOutcome::Inserted]);
    server.shutdown().unwrap();
}

/// A server never binds its socket where another local user could swap it
/// for their own (and hand local clients their pool descriptors): a
/// directory writable by group or others without the sticky bit, or one
/// owned by another user, is refused at start, naming why; nothing is left
/// listening. Nor does the pool daemon (the same check,
/// `transport::check_socket_dir`).
#[test]
fn a_socket_directory_another_user_could_write_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ServerConfig::ephemeral("sec-sockdir");
    cfg.socket_path = dir.path().join("cxlkv.sock");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = Server::start(cfg.clone())
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("writable by group or others"), "{e}");
    assert!(!cfg.socket_path.exists(), "nothing bound");
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::chown(dir.path(), Some(4242), None).unwrap();
        let e = Server::start(cfg.clone())
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(e.contains("belongs to uid 4242"), "{e}");
        std::os::unix::fs::chown(dir.path(), Some(0), None).unwrap();
    } else {
        eprintln!("not root: the other-owner case is checked by the unit test only");
    }
    // The same directory made safe: the server starts in it.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let server = Server::start(cfg).unwrap();
    drop(server);
}

/// The embedded default pool and its state directory live in the shared
/// `/dev/shm`: another local user can create their names first. A state
/// directory others can write (or own), a `lock` symlink planted in it, a
/// pool file or symlink of another user: each is refused at start, and
/// nothing is written through them (the lock file used to be opened
/// through a symlink and truncated: any file the server could write).
#[test]
fn a_planted_state_directory_lock_or_pool_file_is_refused_and_nothing_is_written_through_it() {
    let mut cfg = ServerConfig::ephemeral("sec-planted");
    // A failed start would remove them: they are the test's to look at.
    cfg.remove_pool_on_shutdown = false;
    let mut state = cfg.pool_path.clone().into_os_string();
    state.push(".state");
    let state = std::path::PathBuf::from(state);
    let victim_dir = tempfile::tempdir().unwrap();
    let victim = victim_dir.path().join("victim.txt");
    std::fs::write(&victim, "precious").unwrap();
    let start_err = |cfg: &ServerConfig| {
        Server::start(cfg.clone())
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let cleanup = || {
        let _ = std::fs::remove_dir_all(&state);
        let _ = std::fs::remove_file(&cfg.pool_path);
    };

    std::fs::create_dir(&state).unwrap();
    std::os::unix::fs::symlink(&victim, state.join("lock")).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = start_err(&cfg);
    assert!(e.contains("writable by others"), "{e}");
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");

    // Ours, but with the symlink in it: not followed.
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).unwrap();
    let e = start_err(&cfg);
    assert!(e.contains("lock"), "{e}");
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    std::fs::remove_file(state.join("lock")).unwrap();

    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        std::os::unix::fs::chown(&state, Some(4242), None).unwrap();
        let e = start_err(&cfg);
        assert!(e.contains("belongs to uid 4242"), "{e}");
        std::os::unix::fs::chown(&state, Some(0), None).unwrap();

        std::fs::write(&cfg.pool_path, b"").unwrap();
        std::os::unix::fs::chown(&cfg.pool_path, Some(4242), None).unwrap();
        let e = start_err(&cfg);
        assert!(e.contains("is a file of uid 4242"), "{e}");
        std::fs::remove_file(&cfg.pool_path).unwrap();

        std::os::unix::fs::symlink(&victim, &cfg.pool_path).unwrap();
        std::os::unix::fs::lchown(&cfg.pool_path, Some(4242), None).unwrap();
        let e = start_err(&cfg);
        assert!(e.contains("is a symlink of uid 4242"), "{e}");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        std::fs::remove_file(&cfg.pool_path).unwrap();
    } else {
        eprintln!("not root: the other-owner cases are not checked here");
    }

    // Made safe, the server starts and uses it.
    let started = Server::start(cfg.clone()).map(drop);
    cleanup();
    started.unwrap();
}

#[test]
fn locations_outside_ones_own_regions_are_rejected_key_by_key() {
    let server = Server::start(ServerConfig::ephemeral("sec-loc")).unwrap();
    let (mut victim, theirs) = session_with_region(&server, "victim");
    victim
        .register(vec![(b"k".to_vec(), loc(theirs, 0))])
        .unwrap();
    let (mut other, mine) = session_with_region(&server, "other");
    let pages = (4u64 << 20) / LAYOUT.page_size_bytes;
    let at = |page: u32, len_bytes: u32| proto::Location {
        region: mine,
        page,
        generation: 1,
        len_bytes,
    };
    let r = unchanged(&server, "locations outside the caller's regions", || {
        other
            .register(vec![
                (b"theirs".to_vec(), loc(theirs, 1)),
                (b"past-end".to_vec(), at(pages as u32, 1)),
                (b"empty".to_vec(), at(1, 0)),
                (
                    b"too-long".to_vec(),
                    at(1, LAYOUT.page_size_bytes as u32 + 1),
                ),
            ])
            .unwrap()
    });
    let reasons: Vec<_> = r
        .outcomes
        .iter()
        .map(|o| match o {
            RegisterOutcome::Rejected(why) => (*why, why.code()),
            other => panic!("accepted: {other:?}"),
        })
        .collect();
    assert_eq!(
        reasons,
        vec![
            (RejectReason::NotOwner, ErrorCode::NotOwner),
            (RejectReason::PageOutOfRange, ErrorCode::InvalidArgument),
            (RejectReason::BadLength, ErrorCode::InvalidArgument),
            (RejectReason::BadLength, ErrorCode::InvalidArgument),
        ]
    );
    // A page of one's own region that holds another key is not taken over.
    other.register(vec![(b"mine".to_vec(), at(2, 1))]).unwrap();
    let r = unchanged(&server, "a second key on a registered page", || {
        other.register(vec![(b"mine2".to_vec(), at(2, 1))]).unwrap()
    });
    assert_eq!(
        r.outcomes,
        vec![RegisterOutcome::Rejected(RejectReason::PageInUse)]
    );
    // Returning another instance's region, or one that does not exist.
    for (region, code) in [
        (theirs, ErrorCode::NotOwner),
        (987_654, ErrorCode::UnknownRegion),
    ] {
        unchanged(&server, "returning a region one does not own", || {
            let meta = other.rw();
            expect_code(
                other.call::<_, proto::RegionReturned>(&proto::ReturnRegion { meta, region }),
                code,
            );
        });
    }
    still_there(&mut victim, loc(theirs, 0));
    server.shutdown().unwrap();
}

#[test]
fn another_layouts_keys_are_invisible_and_its_regions_refuse_the_layout() {
    let server = Server::start(ServerConfig::ephemeral("sec-layout")).unwrap();
    let (mut victim, region) = session_with_region(&server, "victim");
    victim
        .register(vec![(b"k".to_vec(), loc(region, 0))])
        .unwrap();
    let mut other = Raw::connect_unix(server.socket_path());
    other.hello("other-model").0.unwrap();
    let keys = vec![b"k".to_vec()];
    unchanged(
        &server,
        "another layout's lookup, exists, unpin, delete",
        || {
            let meta = other.rw();
            let found: proto::LookupReply = other
                .call(&proto::Lookup {
                    meta,
                    layout: OTHER_LAYOUT,
                    keys: keys.clone(),
                    pins: 1,
                })
                .unwrap();
            assert_eq!(found.locations, vec![None]);
            let present: proto::ExistsReply = other
                .call(&proto::Exists {
                    meta: other.ro(),
                    layout: OTHER_LAYOUT,
                    keys: keys.clone(),
                })
                .unwrap();
            assert_eq!(present.present.get(0), Some(false));
            let meta = other.rw();
            let unpinned: proto::UnpinReply = other
                .call(&proto::Unpin {
                    meta,
                    layout: OTHER_LAYOUT,
                    keys: keys.clone(),
                    counts: vec![1],
                })
                .unwrap();
            assert_eq!(unpinned.outcomes, vec![UnpinOutcome::NotPinned]);
            let meta = other.rw();
            let deleted: proto::DeleteReply = other
                .call(&proto::Delete {
                    meta,
                    layout: OTHER_LAYOUT,
                    keys: keys.clone(),
                })
                .unwrap();
            assert_eq!(deleted.outcomes, vec![DeleteOutcome::Missing]);
        },
    );
    // The owner itself cannot put a page of its region under another layout.
    let r = unchanged(&server, "a register under another layout", || {
        let meta = victim.rw();
        victim
            .call::<_, proto::RegisterReply>(&proto::Register {
                meta,
                layout: OTHER_LAYOUT,
                entries: vec![proto::RegisterEntry {
                    key: b"k".to_vec(),
                    location: loc(region, 1),
                }],
            })
            .unwrap()
    });
    assert_eq!(
        r.outcomes,
        vec![RegisterOutcome::Rejected(RejectReason::WrongLayout)]
    );
    assert_eq!(RejectReason::WrongLayout.code(), ErrorCode::WrongLayout);
    // A layout that is not one (page size not a multiple of 4 KiB).
    unchanged(&server, "an invalid layout", || {
        let e = expect_code(
            other.call::<_, proto::ExistsReply>(&proto::Exists {
                meta: other.ro(),
                layout: Layout {
                    page_size_bytes: 1000,
                    fingerprint: 1,
                },
                keys: keys.clone(),
            }),
            ErrorCode::InvalidArgument,
        );
        assert!(e.message.contains("1000"), "{e:?}");
    });
    still_there(&mut victim, loc(region, 0));
    server.shutdown().unwrap();
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
        return decode_error(header, &rest[..len]);
    }
}

fn decode_error(header: FrameHeader, payload: &[u8]) -> ErrorReply {
    // An 8-aligned copy for checked access.
    let mut words = vec![0u64; payload.len().div_ceil(8)];
    // SAFETY: `words` has room for `payload.len()` bytes; u64 accepts any
    // bytes; the copy and the slice stay within `words`.
    let aligned = unsafe {
        std::ptr::copy_nonoverlapping(
            payload.as_ptr(),
            words.as_mut_ptr().cast::<u8>(),
            payload.len(),
        );
        std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), payload.len())
    };
    let frame = cxlkv_controlplane::frame::Frame {
        header,
        payload: aligned,
    };
    let e = proto::access::<ErrorReply>(frame).unwrap();
    proto::deserialize::<ErrorReply>(e).unwrap()
}

#[test]
fn oversized_keys_batches_names_and_frames_are_refused_at_the_edge() {
    let mut cfg = ServerConfig::ephemeral("sec-size");
    cfg.directory.max_regions_per_instance = 8;
    let server = Server::start(cfg).unwrap();
    let (mut c, region) = session_with_region(&server, "client");
    c.register(vec![(b"k".to_vec(), loc(region, 0))]).unwrap();
    let long = vec![b'x'; proto::MAX_KEY_BYTES + 1];

    unchanged(
        &server,
        "an oversized key in exists, unpin and delete",
        || {
            let e = expect_code(c.exists(&[b"k", &long]), ErrorCode::KeyTooLong);
            assert_eq!(e.limit, proto::MAX_KEY_BYTES as u64);
            expect_code(c.unpin(&[&long]), ErrorCode::KeyTooLong);
            expect_code(c.delete(&[b"k", &long]), ErrorCode::KeyTooLong);
            expect_code(c.exists(&[b""]), ErrorCode::InvalidArgument);
        },
    );
    unchanged(
        &server,
        "a register batch over the protocol's limit",
        || {
            let entries = (0..proto::MAX_BATCH as u32 + 1)
                .map(|i| (i.to_le_bytes().to_vec(), loc(region, 1)))
                .collect();
            let e = expect_code(c.register(entries), ErrorCode::BatchTooLarge);
            assert_eq!(e.limit, proto::MAX_BATCH as u64);
        },
    );
    unchanged(&server, "more pins per key than allowed", || {
        let e = expect_code(
            c.lookup(&[b"k"], proto::MAX_PINS_PER_KEY as u32 + 1),
            ErrorCode::InvalidArgument,
        );
        assert!(e.limit > 0, "{e:?}");
    });
    unchanged(&server, "a reattach presenting too many regions", || {
        let other = Raw::connect_unix(server.socket_path());
        let fake = (0..9u64)
            .map(|i| proto::OwnedRegion {
                desc: proto::RegionDesc {
                    region: 1000 + i,
                    pool: 0,
                    offset_bytes: 0,
                    len_bytes: 4 << 20,
                    page_size_bytes: LAYOUT.page_size_bytes,
                },
                layout: LAYOUT,
                token: proto::RegionToken([0; 32]),
            })
            .collect();
        let e = expect_code(
            other.call::<_, proto::Reattached>(&reattach_msg(
                "newcomer",
                proto::InstanceSecret([1; 32]),
                fake,
                1,
            )),
            ErrorCode::BatchTooLarge,
        );
        assert_eq!(e.limit, 8);
    });
    unchanged(&server, "an instance name over MAX_NAME_BYTES", || {
        let other = Raw::connect_unix(server.socket_path());
        let name = "n".repeat(proto::MAX_NAME_BYTES + 1);
        let e = expect_code(other.hello(&name).0, ErrorCode::InvalidArgument);
        assert!(e.message.contains("instance_id"), "{e:?}");
        assert_eq!(e.limit, proto::MAX_NAME_BYTES as u64);
        // Refused at the edge: the connection has no session afterwards.
        expect_code(other.exists(&[b"k"]), ErrorCode::HelloRequired);
    });
    unchanged(
        &server,
        "a frame announcing more than the maximum payload",
        || {
            let mut s = UnixStream::connect(server.socket_path()).unwrap();
            s.set_read_timeout(Some(TIMEOUT)).unwrap();
            let mut h = FrameHeader::new(Kind::Exists.as_u16(), 5, 0).unwrap();
            h.payload_len = (MAX_PAYLOAD_BYTES + 8) as u32;
            s.write_all(&h.encode()).unwrap();
            let e = read_error(&mut s, 5);
            assert_eq!(e.error_code(), Some(ErrorCode::FrameTooLarge), "{e:?}");
            assert_eq!(e.limit, MAX_PAYLOAD_BYTES as u64);
        },
    );
    // The client library refuses to send what the server would refuse.
    let client =
        cxlkv::client::Client::connect(cxlkv::client::ClientConfig::unix(server.socket_path()))
            .unwrap();
    let layout = client
        .layout(LAYOUT.page_size_bytes, LAYOUT.fingerprint)
        .unwrap();
    let lookups = |s: &cxlkv_controlplane::directory::DirectoryStats| {
        s.ops
            .iter()
            .filter(|o| matches!(o.op, OpKind::Lookup | OpKind::Exists))
            .map(|o| o.counters.calls)
            .sum::<u64>()
    };
    let before = lookups(&server.directory_stats().unwrap());
    assert!(matches!(
        layout.get(&long),
        Err(cxlkv::client::ClientError::KeyLength { .. })
    ));
    assert!(matches!(
        layout.batch_exists(&vec![b"k".to_vec(); proto::MAX_BATCH + 1]),
        Err(cxlkv::client::ClientError::BatchTooLarge { .. })
    ));
    assert_eq!(
        lookups(&server.directory_stats().unwrap()),
        before,
        "nothing was sent"
    );
    still_there(&mut c, loc(region, 0));
    drop((layout, client));
    server.shutdown().unwrap();
}

#[test]
fn a_reattach_with_no_common_protocol_version_is_refused() {
    let server = Server::start(ServerConfig::ephemeral("sec-version")).unwrap();
    let mut victim = Raw::connect_unix(server.socket_path());
    let welcome = victim.hello("victim").0.unwrap();
    let region = victim.request_region(0).unwrap().desc.region;
    victim
        .register(vec![(b"k".to_vec(), loc(region, 0))])
        .unwrap();
    let newest = u64::from(proto::PROTOCOL_MAX);
    for (min, max, code, limit) in [
        (2, 9, ErrorCode::UnsupportedVersion, newest),
        (2, 2, ErrorCode::UnsupportedVersion, newest),
        // Not a range at all: refused at the edge.
        (0, 0, ErrorCode::InvalidArgument, 0),
        (3, 2, ErrorCode::InvalidArgument, 2),
    ] {
        unchanged(&server, "a reattach with no common version", || {
            let c = Raw::connect_unix(server.socket_path());
            let mut msg = reattach_msg("victim", welcome.instance_secret, vec![], 50);
            msg.protocol_min = min;
            msg.protocol_max = max;
            let e = expect_code(c.call::<_, proto::Reattached>(&msg), code);
            assert_eq!(e.limit, limit, "{min}..{max}: {e:?}");
            // The connection has no session: the victim's instance was not
            // resumed on it.
            expect_code(c.exists(&[b"k"]), ErrorCode::HelloRequired);
        });
    }
    still_there(&mut victim, loc(region, 0));
    server.shutdown().unwrap();
}

#[test]
fn a_wrong_tcp_secret_cannot_reattach_a_unix_instance() {
    let mut cfg = ServerConfig::ephemeral("sec-tcp");
    cfg.tcp_listen = Some("127.0.0.1:0".parse().unwrap());
    cfg.tcp_secret = Some(b"correct horse".to_vec());
    let server = Server::start(cfg).unwrap();
    let ep = Endpoint::Tcp(server.tcp_addr().unwrap());
    let mut victim = Raw::connect_unix(server.socket_path());
    let welcome = victim.hello("victim").0.unwrap();
    let granted = victim.request_region(0).unwrap();
    victim
        .register(vec![(b"k".to_vec(), loc(granted.desc.region, 0))])
        .unwrap();
    // Even with the instance secret and the region token, a TCP peer
    // without the listener's secret gets nothing.
    for (what, secret, code) in [
        ("no secret", None, ErrorCode::AuthenticationRequired),
        (
            "a wrong secret",
            Some(b"correct horsf".to_vec()),
            ErrorCode::AuthenticationFailed,
        ),
        (
            "a longer secret",
            Some(b"correct horse!".to_vec()),
            ErrorCode::AuthenticationFailed,
        ),
    ] {
        unchanged(&server, what, || {
            let c = Raw::connect(&ep);
            let mut msg = reattach_msg("victim", welcome.instance_secret, vec![owned(&granted)], 9);
            msg.client_secret = secret;
            let (answer, fds) = c.call_fds::<_, proto::Reattached>(&msg);
            expect_code(answer, code);
            assert!(fds.is_empty(), "{what}: no descriptors");
        });
    }
    still_there(&mut victim, loc(granted.desc.region, 0));
    server.shutdown().unwrap();
}

/// What a forked peer process did: its pid, and the replies it read, one
/// per frame it sent.
struct PeerRun {
    pid: u32,
    /// `Err(errno)` when the connect itself failed.
    replies: Result<Vec<(FrameHeader, Vec<u8>)>, i32>,
    /// Closed to let the child exit.
    release: std::os::fd::OwnedFd,
}

impl PeerRun {
    fn finish(self) {
        drop(self.release);
        let mut status = 0;
        // SAFETY: `pid` is our own child, reaped exactly once here.
        unsafe { libc::waitpid(self.pid as libc::pid_t, &mut status, 0) };
    }
}

/// Forks a child that (as `uid`, if given) connects to `socket`, sends each
/// of `frames` in turn, forwards every reply to the parent through a pipe,
/// and then holds its connection open until `PeerRun::finish`.
///
/// After `fork` in this multi-threaded test process the child only makes
/// raw system calls (async-signal-safe) on memory prepared before the fork,
/// and first closes every descriptor it inherited from other tests (so it
/// keeps no one else's connection open).
fn forked_peer(socket: &std::path::Path, uid: Option<u32>, frames: &[Vec<u8>]) -> PeerRun {
    use std::os::fd::{FromRawFd, OwnedFd};
    const REPORT_FD: i32 = 3;
    const RELEASE_FD: i32 = 4;
    const REPLY_BUF_BYTES: usize = 1 << 20;

    // SAFETY: sockaddr_un is plain data; zeroed is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let path = socket.as_os_str().as_encoded_bytes();
    assert!(path.len() < addr.sun_path.len(), "socket path too long");
    for (d, s) in addr.sun_path.iter_mut().zip(path) {
        *d = *s as libc::c_char;
    }
    let mut report = [0i32; 2];
    let mut release = [0i32; 2];
    // SAFETY: pipe2 writes two descriptors into each array.
    unsafe {
        assert_eq!(libc::pipe2(report.as_mut_ptr(), libc::O_CLOEXEC), 0);
        assert_eq!(libc::pipe2(release.as_mut_ptr(), libc::O_CLOEXEC), 0);
    }
    let mut buf = vec![0u8; REPLY_BUF_BYTES];
    // SAFETY: the child below only makes raw system calls on memory
    // allocated before the fork (no allocation, no locks) and ends with
    // `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: child side, raw system calls only (see above).
        unsafe {
            let w = libc::fcntl(report[1], libc::F_DUPFD, 500);
            let r = libc::fcntl(release[0], libc::F_DUPFD, 501);
            libc::dup2(w, REPORT_FD);
            libc::dup2(r, RELEASE_FD);
            libc::syscall(libc::SYS_close_range, 5u32, u32::MAX, 0u32);
            let send_all = |fd: i32, mut p: *const u8, mut n: usize| -> bool {
                while n > 0 {
                    let k = libc::write(fd, p.cast(), n);
                    if k <= 0 {
                        return false;
                    }
                    p = p.add(k as usize);
                    n -= k as usize;
                }
                true
            };
            let recv_all = |fd: i32, mut p: *mut u8, mut n: usize| -> bool {
                while n > 0 {
                    let k = libc::read(fd, p.cast(), n);
                    if k <= 0 {
                        return false;
                    }
                    p = p.add(k as usize);
                    n -= k as usize;
                }
                true
            };
            if let Some(uid) = uid {
                libc::syscall(libc::SYS_setresgid, uid, uid, uid);
                libc::syscall(libc::SYS_setresuid, uid, uid, uid);
            }
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
            let rc = libc::connect(
                fd,
                (&raw const addr).cast(),
                std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
            );
            let status: i32 = if rc == 0 {
                0
            } else {
                *libc::__errno_location()
            };
            send_all(REPORT_FD, (&raw const status).cast(), 4);
            if rc == 0 {
                for f in frames {
                    if !send_all(fd, f.as_ptr(), f.len())
                        || !recv_all(fd, buf.as_mut_ptr(), HEADER_BYTES)
                    {
                        libc::_exit(2);
                    }
                    let len = u32::from_le_bytes([buf[16], buf[17], buf[18], buf[19]]) as usize;
                    let total = HEADER_BYTES + len.div_ceil(8) * 8;
                    if total > buf.len()
                        || !recv_all(fd, buf.as_mut_ptr().add(HEADER_BYTES), total - HEADER_BYTES)
                    {
                        libc::_exit(3);
                    }
                    let n = total as u32;
                    send_all(REPORT_FD, (&raw const n).cast(), 4);
                    send_all(REPORT_FD, buf.as_ptr(), total);
                }
            }
            let mut byte = 0u8;
            libc::read(RELEASE_FD, (&raw mut byte).cast(), 1);
            libc::_exit(0);
        }
    }
    // SAFETY: the four descriptors are ours; each is wrapped exactly once.
    let (report_r, release_w) = unsafe {
        drop(OwnedFd::from_raw_fd(report[1]));
        drop(OwnedFd::from_raw_fd(release[0]));
        (
            std::fs::File::from(OwnedFd::from_raw_fd(report[0])),
            OwnedFd::from_raw_fd(release[1]),
        )
    };
    let mut report_r = report_r;
    let mut word = [0u8; 4];
    report_r.read_exact(&mut word).expect("the child reports");
    let errno = i32::from_le_bytes(word);
    let replies = if errno != 0 {
        Err(errno)
    } else {
        let mut out = Vec::new();
        for _ in frames {
            report_r
                .read_exact(&mut word)
                .expect("a reply from the child");
            let mut frame = vec![0u8; u32::from_le_bytes(word) as usize];
            report_r.read_exact(&mut frame).expect("the reply's bytes");
            let header = FrameHeader::decode(frame[..HEADER_BYTES].try_into().unwrap()).unwrap();
            let payload = frame[HEADER_BYTES..HEADER_BYTES + header.payload_len as usize].to_vec();
            out.push((header, payload));
        }
        Ok(out)
    };
    PeerRun {
        pid: pid as u32,
        replies,
        release: release_w,
    }
}

fn frame_of<M: proto::Message>(request_id: u64, msg: &M) -> Vec<u8> {
    let mut buf = Vec::new();
    proto::encode(request_id, msg, &mut buf).unwrap();
    buf
}

fn hello_as(instance: &str, client_name: &str) -> proto::Hello {
    proto::Hello {
        meta: proto::RequestMeta::default(),
        protocol_min: 1,
        protocol_max: 1,
        instance_id: instance.into(),
        client_name: client_name.into(),
        client_secret: None,
    }
}

/// The error in a reply frame, `None` if the reply is not an error.
fn error_in(reply: &(FrameHeader, Vec<u8>)) -> Option<ErrorReply> {
    (reply.0.kind == Kind::ErrorReply.as_u16()).then(|| decode_error(reply.0, &reply.1))
}

fn sessions(c: &Raw) -> Vec<proto::SessionRow> {
    let reply: proto::StatsReply = c
        .call(&proto::Stats {
            meta: c.ro(),
            sections: proto::sections::SESSIONS,
            max_rows: 100,
        })
        .unwrap();
    reply.sessions
}

#[test]
fn identity_is_what_so_peercred_says_not_what_the_peer_claims() {
    let mut cfg = ServerConfig::ephemeral("sec-peer");
    cfg.directory.instance_grace = Duration::from_secs(60);
    cfg.tick_ms = 20;
    let server = Server::start(cfg).unwrap();
    let me = std::process::id();
    let (mut victim, region) = session_with_region(&server, "victim");
    victim
        .register(vec![(b"k".to_vec(), loc(region, 0))])
        .unwrap();
    let victim_session = sessions(&victim)
        .into_iter()
        .find(|s| s.instance_id == "victim")
        .unwrap();
    assert_eq!((victim_session.pid, victim_session.uid), (me, 0));

    // Another process claims the victim's name, and says in its client
    // name that it is the victim's process: refused while the victim lives.
    let claim = format!("pid={me} uid=0");
    let run = forked_peer(
        server.socket_path(),
        None,
        &[
            frame_of(1, &hello_as("victim", &claim)),
            frame_of(2, &hello_as("impostor", &claim)),
        ],
    );
    let replies = run.replies.as_ref().expect("the child connects");
    let e = error_in(&replies[0]).expect("the victim's name is refused");
    assert_eq!(e.error_code(), Some(ErrorCode::InstanceInUse), "{e:?}");
    assert!(error_in(&replies[1]).is_none(), "its own name is fine");
    let impostor = sessions(&victim)
        .into_iter()
        .find(|s| s.instance_id == "impostor")
        .expect("the impostor's session");
    assert_eq!(
        impostor.pid, run.pid,
        "the kernel's pid, not the claimed one"
    );
    assert_ne!(impostor.pid, me);
    run.finish();

    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("not root: skipping the other-user half of this test");
        server.shutdown().unwrap();
        return;
    }
    const NOBODY: u32 = 65534;
    // The socket file's permissions are the access boundary: a user who may
    // not write to it cannot connect (and never receives the pool's
    // descriptor).
    let socket = server.socket_path().to_owned();
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o755)).unwrap();
    let run = forked_peer(&socket, Some(NOBODY), &[frame_of(1, &hello_as("x", "x"))]);
    assert_eq!(run.replies.as_ref().err(), Some(&libc::EACCES));
    run.finish();

    // Let everyone in; the victim's instance loses its session and waits
    // in its grace period. Only its own user may take its name over.
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o777)).unwrap();
    let admin = Raw::connect_unix(server.socket_path());
    admin.hello("admin").0.unwrap();
    drop(victim);
    assert!(wait_until(Duration::from_secs(10), || {
        sessions(&admin).iter().all(|s| s.instance_id != "victim")
    }));
    let run = unchanged(&server, "another user's claim of the name", || {
        forked_peer(
            &socket,
            Some(NOBODY),
            &[frame_of(1, &hello_as("victim", &claim))],
        )
    });
    let replies = run.replies.as_ref().expect("connects with mode 0777");
    let e = error_in(&replies[0]).expect("refused");
    assert_eq!(e.error_code(), Some(ErrorCode::InstanceInUse), "{e:?}");
    run.finish();
    // With a session of its own, the other user cannot end the admin's.
    let admin_id = admin_session(&admin);
    let run = forked_peer(
        &socket,
        Some(NOBODY),
        &[
            frame_of(1, &hello_as("nobody", "nobody")),
            frame_of(
                2,
                &proto::EndSession {
                    meta: proto::RequestMeta {
                        seq: 1,
                        ..proto::RequestMeta::default()
                    },
                    session_id: admin_id,
                },
            ),
        ],
    );
    let replies = run.replies.as_ref().expect("connects with mode 0777");
    assert!(error_in(&replies[0]).is_none(), "its own name is fine");
    let e = error_in(&replies[1]).expect("EndSession is for the server's user");
    assert_eq!(
        e.error_code(),
        Some(ErrorCode::AuthenticationFailed),
        "{e:?}"
    );
    let rows = sessions(&admin);
    let row = rows
        .iter()
        .find(|s| s.instance_id == "nobody")
        .expect("the other user's own session");
    assert_eq!((row.pid, row.uid), (run.pid, NOBODY));
    assert!(rows.iter().any(|s| s.session_id == admin_id), "not ended");
    run.finish();
    // The victim's own user takes its instance over, keys intact.
    let mut back = Raw::connect_unix(server.socket_path());
    back.hello("victim").0.expect("same uid: takeover allowed");
    let found = back.lookup(&[b"k"], 0).unwrap();
    assert_eq!(found.locations, vec![Some(loc(region, 0))]);
    server.shutdown().unwrap();
}

/// An instance whose connection broke while its process still runs keeps
/// its name for its grace period: that process has the instance's regions
/// mapped and may still write their pages, so another process of the same
/// user is refused (`InstanceInUse`, nothing freed) until it exits; then
/// the takeover is immediate (a restarted engine reusing its configured
/// instance id). The kernel's pid decides (`SO_PEERCRED`, checked in
/// `/proc`), not anything the peer says.
#[test]
fn a_live_holder_keeps_its_instance_from_another_process_until_it_exits() {
    let mut cfg = ServerConfig::ephemeral("sec-holder");
    cfg.directory.instance_grace = Duration::from_secs(60);
    let server = Server::start(cfg).unwrap();
    let admin = Raw::connect_unix(server.socket_path());
    admin.hello("admin").0.unwrap();
    // A child process holds "held" and keeps running.
    let run = forked_peer(
        server.socket_path(),
        None,
        &[frame_of(1, &hello_as("held", "the holder"))],
    );
    let replies = run.replies.as_ref().expect("the child connects");
    assert!(error_in(&replies[0]).is_none(), "the child holds its name");
    // Its session ends (as when its connection breaks); it is in its grace
    // period, and its process lives.
    let held = sessions(&admin)
        .into_iter()
        .find(|s| s.instance_id == "held")
        .expect("the child's session");
    assert_eq!(held.pid, run.pid);
    let mut ender = Raw::connect_unix(server.socket_path());
    ender.hello("ender").0.unwrap();
    let meta = ender.rw();
    let _: proto::SessionEnded = ender
        .call(&proto::EndSession {
            meta,
            session_id: held.session_id,
        })
        .expect("the server's user may end a session");
    let claimant = Raw::connect_unix(server.socket_path());
    let e = unchanged(&server, "a claim while the holder runs", || {
        claimant.hello("held").0.unwrap_err()
    });
    assert_eq!(e.error_code(), Some(ErrorCode::InstanceInUse), "{e:?}");
    // The holder exits: the same claim takes the instance over at once.
    run.finish();
    let retry = Raw::connect_unix(server.socket_path());
    retry
        .hello("held")
        .0
        .expect("every holder exited: the takeover is immediate");
    server.shutdown().unwrap();
}

fn admin_session(admin: &Raw) -> u64 {
    sessions(admin)
        .into_iter()
        .find(|s| s.instance_id == "admin")
        .expect("the admin's session")
        .session_id
}
