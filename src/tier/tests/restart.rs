//! A server restart under a live tier: the directory comes back empty, the
//! tier's client reattaches, registers its keys again and takes its ledger
//! pins again (`client::session`), and the tier's staging — which lives in
//! this process — carries on as if nothing happened.

use std::time::{Duration, Instant};

use super::*;
use crate::client::DeleteOutcome;

fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every pool of the server has all its bytes free (as its pool manager
/// reports them).
fn pool_is_free(s: &cxlkv_controlplane::directory::DirectoryStats) -> bool {
    !s.per_pool.is_empty()
        && s.per_pool
            .iter()
            .all(|p| p.reported_total_bytes > 0 && p.estimated_free_bytes == p.reported_total_bytes)
}

#[test]
fn held_reads_and_finished_keys_survive_a_server_restart() {
    let mut cfg = server_config("tier-restart");
    cfg.remove_pool_on_shutdown = false;
    // Long enough that the instance is still awaited when it reattaches,
    // short enough that its regions are freed soon after it leaves.
    cfg.directory.instance_grace = Duration::from_secs(5);
    let server = Server::start(cfg.clone()).expect("server starts");
    let client = Client::connect(client_config(&server)).expect("client connects");
    let layout = client.layout(PAGE, FINGERPRINT).expect("layout");
    let baseline_free = layout.free_pages();
    let tier = L1Tier::new(layout.clone(), TierConfig::default()).expect("tier");

    // Finished (registered) keys, three of them held for reading with two
    // holds each; one retained write still staged; one private temporary
    // held.
    let finished: Vec<Vec<u8>> = (0..6).map(key).collect();
    let finished_refs: Vec<&[u8]> = finished.iter().map(Vec::as_slice).collect();
    let flags = vec![false; finished.len()];
    let r = tier
        .reserve_write(&finished_refs, &flags, CHUNK, WriteMode::New)
        .expect("reserve_write");
    for (k, p) in finished_refs.iter().zip(&r) {
        fill(&page(p), k);
    }
    assert_eq!(
        tier.finish_write(&finished_refs).expect("finish_write"),
        vec![TierCode::Success; finished.len()]
    );
    let held = &finished_refs[..3];
    let views: Vec<TierPage> = tier
        .reserve_read(held, Holds::total(2))
        .expect("reserve_read")
        .iter()
        .map(page)
        .collect();
    assert_eq!(server.directory_stats().expect("stats").pins, 6);
    let (staged, temp) = (key(100), key(101));
    let w = tier
        .reserve_write(&[&staged, &temp], &[false, true], CHUNK, WriteMode::New)
        .expect("reserve_write");
    fill(&page(&w[0]), &staged);
    fill(&page(&w[1]), &temp);
    let temp_view = page(
        &tier
            .finish_write_and_reserve_read(&[&temp], Holds::ONE)
            .expect("promote")[0],
    );
    let epoch = client.directory_epoch();

    server.shutdown().expect("shutdown");
    cfg.remove_pool_on_shutdown = true;
    let server = Server::start(cfg).expect("server restarts");
    assert_eq!(
        server.directory_stats().expect("stats").keys,
        0,
        "keys do not survive a restart"
    );

    // The client reattaches on its next request and registers its keys
    // again before that request is answered.
    eventually("the finished keys are registered again", || {
        layout
            .batch_exists(&finished_refs)
            .is_ok_and(|e| e.iter().all(|x| *x))
    });
    assert_ne!(client.directory_epoch(), epoch);
    assert_eq!(client.stats().directory_restarts, 1);
    // The held reads' pins were taken again on the new session: the pages
    // are still protected, from every client.
    eventually("the held reads are pinned again", || {
        server.directory_stats().is_ok_and(|s| s.pins == 6)
    });
    let peer_client = Client::connect(client_config(&server)).expect("peer connects");
    let peer = peer_client.layout(PAGE, FINGERPRINT).expect("peer layout");
    assert_eq!(
        peer.delete(held[0]).expect("peer delete"),
        DeleteOutcome::Pinned { pins: 2 }
    );
    // The held views still show the bytes written (the page never moved).
    for (k, v) in held.iter().zip(&views) {
        assert_eq!(read_bytes(v), bytes_for(k, CHUNK));
    }
    assert_eq!(read_bytes(&temp_view), bytes_for(&temp, CHUNK));
    tier.check_invariants()
        .expect("staging consistent after the restart");
    assert_eq!(
        tier.inspect(held[0]).expect("inspect"),
        KeyStage::ReadStaged {
            holds: 2,
            pinned: 2,
            temporary: false
        }
    );

    // finish_read answers as on any day (`Success`) and releases the pins
    // the new session holds, inside the call.
    assert_eq!(
        tier.finish_read(held, Holds::total(2))
            .expect("finish_read"),
        vec![TierCode::Success; held.len()]
    );
    assert_eq!(server.directory_stats().expect("stats").pins, 0);
    assert_eq!(
        tier.stats().pins_lost,
        0,
        "every pin was released, none lost"
    );
    assert_eq!(
        peer.delete(held[0]).expect("peer delete"),
        DeleteOutcome::Deleted
    );
    assert_eq!(
        tier.finish_read(&[&temp], Holds::ONE).expect("finish_read"),
        vec![TierCode::Success]
    );

    // Every finished key is readable with its exact bytes, here and by a
    // peer; the write staged across the restart registers in the new
    // directory.
    assert_eq!(
        tier.finish_write(&[&staged]).expect("finish_write"),
        vec![TierCode::Success]
    );
    let live: Vec<&[u8]> = finished_refs[1..]
        .iter()
        .copied()
        .chain([staged.as_slice()])
        .collect();
    let got = tier.reserve_read(&live, Holds::ONE).expect("reserve_read");
    for (k, p) in live.iter().zip(&got) {
        assert_eq!(read_bytes(&page(p)), bytes_for(k, CHUNK), "{k:?}");
        let g = peer
            .get(k)
            .expect("peer get")
            .expect("the key is registered");
        assert_eq!(&g[..], &bytes_for(k, CHUNK)[..]);
    }
    drop(got);
    peer_client.flush_unpins().expect("peer flush");
    assert_eq!(
        tier.finish_read(&live, Holds::ONE).expect("finish_read"),
        vec![TierCode::Success; live.len()]
    );
    tier.check_invariants().expect("invariants");

    // Nothing leaked: no pin, every page back once the keys are deleted,
    // none freed twice, and the pool whole once the clients leave.
    assert_eq!(
        tier.delete(&live, false).expect("delete"),
        vec![TierCode::Success; live.len()]
    );
    tier.close().expect("close");
    assert!(tier.memcheck(), "no page freed twice");
    let dir = server.directory_stats().expect("stats");
    assert_eq!((dir.keys, dir.pins), (0, 0));
    eventually("every page is back in the allocator", || {
        let _ = layout.exists(&staged);
        layout.free_pages() == layout.region_bytes() / PAGE
    });
    assert!(layout.free_pages() >= baseline_free);
    assert_eq!(layout.refused_frees(), 0);
    assert_eq!(client.unresolved_registrations(), 0);
    drop((tier, layout, peer));
    client.close().expect("client close");
    peer_client.close().expect("peer close");
    eventually("the pool is whole once the clients left", || {
        server
            .directory_stats()
            .is_ok_and(|s| s.regions == 0 && s.instances == 0 && s.keys == 0 && pool_is_free(&s))
    });
    server.shutdown().expect("shutdown");
}
