//! A restarted server is a restarted directory: it recovers its regions
//! from the embedded pool manager's journal, a live instance reattaches with
//! its region tokens and registers its keys again, and the regions of an
//! instance that does not come back are freed after the grace period.

mod common;

use std::time::Duration;

use common::*;
use cxlkv::server::{Server, ServerConfig};
use cxlkv_controlplane::proto::{self, RegisterOutcome};

#[test]
fn a_restarted_server_recovers_regions_for_instances_that_reattach() {
    let mut cfg = ServerConfig::ephemeral("restart");
    cfg.remove_pool_on_shutdown = false;
    cfg.directory.instance_grace = Duration::from_millis(500);
    cfg.tick_ms = 20;

    let server = Server::start(cfg.clone()).unwrap();
    let mut a = Raw::connect_unix(server.socket_path());
    let welcome = a.hello("alive").0.unwrap();
    let granted = a.request_region(0).unwrap();
    let region = granted.desc.region;
    a.register(vec![(b"k".to_vec(), loc(region, 0))]).unwrap();
    let mut b = Raw::connect_unix(server.socket_path());
    b.hello("departed").0.unwrap();
    let lost = b.request_region(0).unwrap().desc.region;
    drop((a.rpc, b));
    server.shutdown().unwrap();

    cfg.remove_pool_on_shutdown = true;
    let server = Server::start(cfg).unwrap();
    let before = server.directory_stats().unwrap();
    assert_eq!(before.keys, 0, "keys do not survive a restart");
    assert!(
        before.per_instance.iter().all(|i| i.awaiting_reattach),
        "{:?}",
        before.per_instance
    );
    let mut a2 = Raw::connect_unix(server.socket_path());
    a2.next_seq = 100;
    let back: proto::Reattached = a2
        .call(&reattach_msg(
            "alive",
            welcome.instance_secret,
            vec![owned(&granted)],
            a2.next_seq,
        ))
        .unwrap();
    assert!(!back.resumed, "a restart is not a resume");
    assert_eq!(back.accepted, vec![region]);
    assert_eq!(back.oldest_accepted_seq, 100);
    assert_ne!(back.welcome.directory_epoch, welcome.directory_epoch);
    let again = a2.register(vec![(b"k".to_vec(), loc(region, 0))]).unwrap();
    assert_eq!(again.outcomes, vec![RegisterOutcome::Inserted]);
    assert!(
        wait_until(Duration::from_secs(10), || {
            a2.heartbeat().unwrap();
            server.directory_stats().unwrap().outcomes.regions_freed == 1
        }),
        "the departed instance's region {lost} is freed after the grace period"
    );
    let found = a2.lookup(&[b"k"], 0).unwrap();
    assert_eq!(found.locations, vec![Some(loc(region, 0))]);
    let report = server.shutdown().unwrap();
    assert_eq!(report.frees_unconfirmed, 0);
}
