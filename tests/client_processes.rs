//! The client across real processes. The parent runs an in-process server
//! (and sometimes a client of its own); children are this same test binary
//! started again with `CXLKV_TEST_ROLE` naming what they do, and report in
//! `@@` lines on stdout (see `client_support`). Built with `harness = false`:
//! `main` runs the roles or the tests.
//!
//! - A writes, B reads the same bytes in place (B's view lies inside B's
//!   mapping of A's region).
//! - Two writer processes race on the same keys: one `Inserted`, one
//!   `Duplicate` per key, and the losers' pages are reusable.
//! - A client SIGKILLed with unregistered pages and held pins leaks nothing:
//!   its pins go, its keys stay readable and deletable, its regions are
//!   freed once their keys are gone, and the pool is back to its baseline.
//! - The server restarts under live clients: each re-registers its keys and
//!   every acknowledged key reads back with the same bytes.

mod client_support;

use std::sync::Arc;
use std::time::Duration;

use client_support::*;
use cxlkv::client::{Client, DeleteOutcome, LayoutOptions, RegisterOutcome};
use cxlkv::server::Server;
use cxlkv_dataplane::ids::RegionId;
use cxlkv_dataplane::map::{MapInfo, MapObserver};
use parking_lot::Mutex;

fn main() -> std::process::ExitCode {
    main_with(
        &[
            (
                "writer_and_reader_processes_share_bytes_in_place",
                writer_and_reader_processes_share_bytes_in_place,
            ),
            (
                "two_writer_processes_race_on_one_key",
                two_writer_processes_race_on_one_key,
            ),
            (
                "a_client_killed_mid_write_and_mid_read_leaks_nothing",
                a_client_killed_mid_write_and_mid_read_leaks_nothing,
            ),
            (
                "live_clients_reregister_their_keys_after_a_server_restart",
                live_clients_reregister_their_keys_after_a_server_restart,
            ),
        ],
        &[
            ("writer", role_writer),
            ("racer", role_racer),
            ("victim", role_victim),
            ("owner", role_owner),
        ],
    )
}

const KEYS: u64 = 32;

fn socket_env(server: &cxlkv::server::ServerHandle) -> (&'static str, String) {
    (SOCKET_ENV, server.socket_path().display().to_string())
}

/// Writes `KEYS` chunks, reports its instance id, waits for "exit".
fn role_writer() {
    let client = Client::connect(child_client_config()).unwrap();
    let layout = client.layout(PAGE, FINGERPRINT).unwrap();
    let items: Vec<(Vec<u8>, Vec<u8>)> = (0..KEYS)
        .map(|i| (key(i), chunk(i, 10_000 + i as usize)))
        .collect();
    let outcomes = layout.batch_put(&items).unwrap();
    assert!(outcomes.iter().all(|o| *o == RegisterOutcome::Inserted));
    say(&format!("written {}", client.instance_id()));
    assert_eq!(hear(), "exit");
}

#[derive(Default)]
struct Recorder(Mutex<Vec<MapInfo>>);

impl MapObserver for Recorder {
    fn on_map(&self, info: &MapInfo) {
        self.0.lock().push(*info);
    }
    fn before_unmap(&self, _: &MapInfo) {}
}

fn writer_and_reader_processes_share_bytes_in_place() {
    let server = start_server("proc-share");
    let mut writer = ChildRole::spawn("writer", &[socket_env(&server)]);
    let writer_id = writer.expect("written");

    let recorder = Arc::new(Recorder::default());
    let reader = Client::connect_with_observers(
        client_config(&server),
        vec![recorder.clone() as Arc<dyn MapObserver>],
    )
    .unwrap();
    let layout = reader.layout(PAGE, FINGERPRINT).unwrap();
    let keys: Vec<Vec<u8>> = (0..KEYS).map(key).collect();
    let guards = layout.batch_get(&keys).unwrap();
    let stats = server.directory_stats().unwrap();
    let writer_regions: Vec<u64> = stats
        .per_instance
        .iter()
        .filter(|i| i.instance.as_str() == writer_id)
        .map(|i| i.regions as u64)
        .collect();
    assert_eq!(writer_regions, vec![1], "the writer owns one region");
    for (i, g) in guards.iter().enumerate() {
        let g = g.as_ref().expect("every key is found");
        assert_eq!(&g[..], &chunk(i as u64, 10_000 + i)[..]);
        let mapped = recorder.0.lock();
        let m = mapped
            .iter()
            .find(|m| m.region == RegionId(g.location().region))
            .expect("the reader mapped the writer's region");
        let addr = g.as_ptr() as usize;
        assert!(
            addr >= m.base_addr && addr + g.len() <= m.base_addr + m.len_bytes,
            "the view lies inside the reader's mapping of the writer's region"
        );
    }
    assert_eq!(reader.stats().peer_regions_mapped, 1);
    assert_eq!(layout.region_bytes(), 0, "the reader owns no region");
    writer.send("exit");
    writer.wait_success();
    // The writer is gone; its keys stay readable (the region is deferred).
    drop(guards);
    let g = layout.get(key(5)).unwrap().unwrap();
    assert_eq!(&g[..], &chunk(5, 10_005)[..]);
}

const RACE_KEYS: u64 = 200;

/// Races the other racer on the same keys; reports its counts.
fn role_racer() {
    let seed: u64 = std::env::var("RACE_SEED").unwrap().parse().unwrap();
    let client = Client::connect(child_client_config()).unwrap();
    // One region of 256 pages, taken before the race.
    let layout = client
        .layout_with(
            PAGE,
            FINGERPRINT,
            LayoutOptions {
                initial_reservation_bytes: 16 << 20,
                region_size_bytes: 16 << 20,
                auto_expand: false,
            },
        )
        .unwrap();
    let total = layout.free_pages();
    assert_eq!(total, 256);
    say("ready");
    assert_eq!(hear(), "go");
    let (mut inserted, mut duplicate) = (0u64, 0u64);
    for i in 0..RACE_KEYS {
        match layout
            .put(key(i), &chunk(seed * 100_000 + i, 1000))
            .unwrap()
        {
            RegisterOutcome::Inserted => inserted += 1,
            RegisterOutcome::Duplicate(_) => duplicate += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    let free = layout.free_pages();
    assert_eq!(free, total - inserted, "every losing page is free again");
    // And usable: every free page can be allocated (then given back).
    let all = layout.batch_alloc(free as usize).unwrap();
    drop(all);
    say(&format!("{inserted} {duplicate}"));
    assert_eq!(hear(), "exit");
}

fn two_writer_processes_race_on_one_key() {
    let server = start_server("proc-race");
    let mut racers: Vec<ChildRole> = (1..=2)
        .map(|seed| {
            ChildRole::spawn(
                "racer",
                &[socket_env(&server), ("RACE_SEED", seed.to_string())],
            )
        })
        .collect();
    for r in &racers {
        r.expect("ready");
    }
    for r in &mut racers {
        r.send("go");
    }
    let counts: Vec<(u64, u64)> = racers
        .iter()
        .map(|r| {
            let line = r.expect("");
            let mut it = line.split(' ').map(|x| x.parse::<u64>().unwrap());
            (it.next().unwrap(), it.next().unwrap())
        })
        .collect();
    assert_eq!(counts[0].0 + counts[1].0, RACE_KEYS, "{counts:?}");
    assert_eq!(counts[0].1 + counts[1].1, RACE_KEYS, "{counts:?}");
    let reader = Client::connect(client_config(&server)).unwrap();
    let layout = reader.layout(PAGE, FINGERPRINT).unwrap();
    let keys: Vec<Vec<u8>> = (0..RACE_KEYS).map(key).collect();
    for (i, g) in layout.batch_get(&keys).unwrap().into_iter().enumerate() {
        let g = g.unwrap();
        let i = i as u64;
        assert!(
            g[..] == chunk(100_000 + i, 1000)[..] || g[..] == chunk(200_000 + i, 1000)[..],
            "key {i} holds one writer's bytes, whole"
        );
    }
    for r in &mut racers {
        r.send("exit");
        r.wait_success();
    }
}

/// Writes keys, holds pins, leaves allocated half-written pages, and waits
/// to be killed.
fn role_victim() {
    let client = Client::connect(child_client_config()).unwrap();
    let layout = client.layout(PAGE, FINGERPRINT).unwrap();
    let items: Vec<(Vec<u8>, Vec<u8>)> = (0..10).map(|i| (key(i), chunk(i, 5000))).collect();
    layout.batch_put(&items).unwrap();
    let mut leases = layout.batch_alloc(5).unwrap();
    for lease in &mut leases {
        lease.bytes_mut().unwrap()[..100].fill(0xAB);
    }
    let own = layout.batch_get(&[key(0), key(1), key(2)]).unwrap();
    let parents = layout.batch_get(&[b"parent-0", b"parent-1"]).unwrap();
    assert!(own.iter().chain(&parents).all(Option::is_some));
    say("ready");
    hear();
    drop((leases, own, parents));
}

fn a_client_killed_mid_write_and_mid_read_leaks_nothing() {
    let server = start_server("proc-kill");
    let baseline = server.directory_stats().unwrap();
    assert_eq!((baseline.regions, baseline.keys), (0, 0));
    // The pool's baseline: every byte free (as the pool manager reports it).
    let pool_is_free = |s: &cxlkv_controlplane::directory::DirectoryStats| {
        !s.per_pool.is_empty()
            && s.per_pool.iter().all(|p| {
                p.reported_total_bytes > 0 && p.estimated_free_bytes == p.reported_total_bytes
            })
    };
    let parent = Client::connect(client_config(&server)).unwrap();
    let layout = parent.layout(PAGE, FINGERPRINT).unwrap();
    layout
        .batch_put(&[(b"parent-0", chunk(100, 10)), (b"parent-1", chunk(101, 10))])
        .unwrap();

    let mut victim = ChildRole::spawn("victim", &[socket_env(&server)]);
    victim.expect("ready");
    let before = server.directory_stats().unwrap();
    assert_eq!(before.pins, 5);
    assert_eq!(before.keys, 12);
    assert_eq!(
        layout.delete(b"parent-0").unwrap(),
        DeleteOutcome::Pinned { pins: 1 }
    );
    victim.kill();

    assert!(
        wait_until(Duration::from_secs(10), || server
            .directory_stats()
            .unwrap()
            .pins
            == 0),
        "the dead client's pins are released"
    );
    // Its keys stayed readable; anyone may delete them.
    assert_eq!(
        &layout.get(key(3)).unwrap().unwrap()[..],
        &chunk(3, 5000)[..]
    );
    let keys: Vec<Vec<u8>> = (0..10).map(key).collect();
    let outcomes = layout.batch_delete(&keys).unwrap();
    assert!(
        outcomes.iter().all(|o| *o == DeleteOutcome::Deleted),
        "{outcomes:?}"
    );
    assert!(
        wait_until(Duration::from_secs(10), || {
            let s = server.directory_stats().unwrap();
            s.regions == 1 && s.instances == 1
        }),
        "the dead client's region is freed once its keys are gone"
    );
    let outcomes = layout.batch_delete(&[b"parent-0", b"parent-1"]).unwrap();
    assert_eq!(outcomes, vec![DeleteOutcome::Deleted; 2]);
    assert_eq!(layout.free_pages(), layout.region_bytes() / PAGE);
    parent.close().unwrap();
    drop(layout);
    assert!(
        wait_until(Duration::from_secs(10), || {
            let s = server.directory_stats().unwrap();
            s.regions == 0 && s.keys == 0 && s.instances == 0 && pool_is_free(&s)
        }),
        "the pool is back to its baseline: {:?}",
        server.directory_stats().unwrap().per_pool
    );
}

const OWNER_KEYS: u64 = 20;

/// Writes keys, then after the restart reads them back.
fn role_owner() {
    let client = Client::connect(child_client_config()).unwrap();
    let layout = client.layout(PAGE, FINGERPRINT).unwrap();
    let items: Vec<(Vec<u8>, Vec<u8>)> = (0..OWNER_KEYS)
        .map(|i| (key(1000 + i), chunk(1000 + i, 3000)))
        .collect();
    let outcomes = layout.batch_put(&items).unwrap();
    assert!(outcomes.iter().all(|o| *o == RegisterOutcome::Inserted));
    say("written");
    assert_eq!(hear(), "check");
    for (k, v) in &items {
        let g = layout.get(k).unwrap().expect("own key after the restart");
        assert_eq!(&g[..], &v[..]);
    }
    say(&format!("ok {}", client.stats().directory_restarts));
    assert_eq!(hear(), "exit");
}

fn live_clients_reregister_their_keys_after_a_server_restart() {
    let mut cfg = server_config("proc-restart");
    cfg.remove_pool_on_shutdown = false;
    cfg.directory.instance_grace = Duration::from_secs(10);
    let pool_path = cfg.pool_path.clone();
    let server = Server::start(cfg.clone()).unwrap();
    let mut owner = ChildRole::spawn("owner", &[socket_env(&server)]);
    owner.expect("written");
    let local = Client::connect(client_config(&server)).unwrap();
    let layout = local.layout(PAGE, FINGERPRINT).unwrap();
    let mine: Vec<(Vec<u8>, Vec<u8>)> = (0..5).map(|i| (key(i), chunk(i, 2000))).collect();
    layout.batch_put(&mine).unwrap();
    let epoch = local.directory_epoch();

    server.shutdown().unwrap();
    let server = Server::start(cfg).unwrap();
    let all: Vec<Vec<u8>> = (0..5)
        .map(key)
        .chain((0..OWNER_KEYS).map(|i| key(1000 + i)))
        .collect();
    assert!(
        wait_until(Duration::from_secs(20), || layout
            .batch_exists(&all)
            .map(|e| e.iter().all(|x| *x))
            .unwrap_or(false)),
        "every live instance's keys are registered again"
    );
    assert_ne!(local.directory_epoch(), epoch);
    assert_eq!(local.stats().directory_restarts, 1);
    for (k, v) in &mine {
        assert_eq!(&layout.get(k).unwrap().unwrap()[..], &v[..]);
    }
    for i in 0..OWNER_KEYS {
        let g = layout.get(key(1000 + i)).unwrap().unwrap();
        assert_eq!(&g[..], &chunk(1000 + i, 3000)[..]);
    }
    owner.send("check");
    assert_eq!(owner.expect("ok"), "1");
    owner.send("exit");
    owner.wait_success();
    drop(layout);
    drop(local);
    server.shutdown().unwrap();
    let _ = std::fs::remove_file(pool_path);
}
