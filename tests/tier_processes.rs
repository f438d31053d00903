//! Two processes, each with its own L1 tier on the same pool. The parent
//! (process A) runs the server and a writer tier; the child (process B,
//! this test binary started again as role `reader`) runs a reader tier and
//! talks to the parent in `@@` lines (see `client_support`). Built with
//! `harness = false`.
//!
//! - A writes and finishes keys; B reserves reads of them: zero-copy (B's
//!   views name the very pages A wrote, and hold A's bytes) and pinned. A's
//!   `delete` is refused while B holds them and succeeds right after B's
//!   `finish_read` returns — no wait, no retry: B's unpins were answered
//!   inside its `finish_read`.
//! - B is SIGKILLed while holding reads: its session dies with it, the
//!   directory drops its pins, and A's delete succeeds afterwards.

mod client_support;

use std::time::Duration;

use client_support::*;
use cxlkv::client::Client;
use cxlkv::tier::{Holds, L1Tier, TierCode, TierConfig, WriteMode};

fn main() -> std::process::ExitCode {
    main_with(
        &[
            (
                "a_peer_tier_reads_in_place_and_its_finish_read_unblocks_delete",
                a_peer_tier_reads_in_place_and_its_finish_read_unblocks_delete,
            ),
            (
                "a_reader_tier_killed_while_holding_reads_blocks_nothing",
                a_reader_tier_killed_while_holding_reads_blocks_nothing,
            ),
        ],
        &[("reader", role_reader)],
    )
}

const KEYS: u64 = 16;
const HOLDS: i64 = 2;

fn tier_key(round: u64, i: u64) -> Vec<u8> {
    format!("tier-{round}-{i:04}").into_bytes()
}

fn chunk_len(i: u64) -> usize {
    5000 + i as usize * 13
}

/// Process B: waits for `read <round>`, reserves the round's keys (two
/// holds each), checks the bytes in place and reports the locations;
/// `finish` releases them; `exit` closes.
fn role_reader() {
    let client = Client::connect(child_client_config()).unwrap();
    let layout = client.layout(PAGE, FINGERPRINT).unwrap();
    let tier = L1Tier::new(layout, TierConfig::default()).unwrap();
    say("ready");
    let mut held: Vec<Vec<u8>> = Vec::new();
    loop {
        let line = hear();
        let mut words = line.split_whitespace();
        match words.next() {
            Some("read") => {
                let round: u64 = words.next().unwrap().parse().unwrap();
                held = (0..KEYS).map(|i| tier_key(round, i)).collect();
                let r = tier.reserve_read(&held, Holds::total(HOLDS)).unwrap();
                let mut locations = Vec::new();
                for (i, p) in r.iter().enumerate() {
                    assert_eq!(p.code, TierCode::Success, "key {i}");
                    let page = p.page.as_ref().unwrap();
                    // SAFETY: held by this reservation; registered pages are
                    // never written while pinned.
                    let bytes = unsafe { page.as_slice() };
                    assert_eq!(bytes, chunk(i as u64, chunk_len(i as u64)).as_slice());
                    let l = page.location();
                    locations.push(format!("{}:{}:{}", l.region, l.page, l.generation));
                }
                say(&format!("held {}", locations.join(",")));
            }
            Some("finish") => {
                let codes = tier.finish_read(&held, Holds::total(HOLDS)).unwrap();
                assert!(codes.iter().all(|c| *c == TierCode::Success));
                say("finished");
            }
            Some("exit") | None => break,
            Some(other) => panic!("unknown command {other:?}"),
        }
    }
    tier.close().unwrap();
    client.close().unwrap();
}

/// Process A's writer tier: writes the round's keys through
/// `reserve_write` (filling the pages in place) and `finish_write`;
/// returns the written locations.
fn write_round(tier: &L1Tier, round: u64) -> Vec<String> {
    let keys: Vec<Vec<u8>> = (0..KEYS).map(|i| tier_key(round, i)).collect();
    let mut locations = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let len = chunk_len(i as u64);
        let r = tier
            .reserve_write(&[key], &[false], len, WriteMode::New)
            .unwrap();
        let mut page = r[0].page.clone().expect("reserved");
        // SAFETY: a fresh write view, the only live slice of its page.
        unsafe { page.as_mut_slice() }.copy_from_slice(&chunk(i as u64, len));
        let l = page.location();
        locations.push(format!("{}:{}:{}", l.region, l.page, l.generation));
    }
    let codes = tier.finish_write(&keys).unwrap();
    assert!(codes.iter().all(|c| *c == TierCode::Success));
    locations
}

fn round_keys(round: u64) -> Vec<Vec<u8>> {
    (0..KEYS).map(|i| tier_key(round, i)).collect()
}

fn a_peer_tier_reads_in_place_and_its_finish_read_unblocks_delete() {
    let server = start_server("tier-procs");
    let client = Client::connect(client_config(&server)).unwrap();
    let tier = L1Tier::new(
        client.layout(PAGE, FINGERPRINT).unwrap(),
        TierConfig::default(),
    )
    .unwrap();
    let written = write_round(&tier, 1);
    let mut b = ChildRole::spawn(
        "reader",
        &[(SOCKET_ENV, server.socket_path().display().to_string())],
    );
    b.expect("ready");
    b.send("read 1");
    let held = b.expect("held");
    assert_eq!(
        held.split(',').collect::<Vec<_>>(),
        written,
        "B's views are the pages A wrote (zero-copy)"
    );
    let keys = round_keys(1);
    assert_eq!(
        server.directory_stats().unwrap().pins,
        KEYS * HOLDS as u64,
        "B holds two pins per key"
    );
    assert_eq!(
        tier.delete(&keys, true).unwrap(),
        vec![TierCode::KeyIsLocked; KEYS as usize],
        "refused while B holds them, force or not"
    );
    b.send("finish");
    b.expect("finished");
    assert_eq!(
        tier.delete(&keys, false).unwrap(),
        vec![TierCode::Success; KEYS as usize],
        "right after B's finish_read returned"
    );
    b.send("exit");
    b.wait_success();
    tier.close().unwrap();
    client.close().unwrap();
}

fn a_reader_tier_killed_while_holding_reads_blocks_nothing() {
    let server = start_server("tier-kill");
    let client = Client::connect(client_config(&server)).unwrap();
    let layout = client.layout(PAGE, FINGERPRINT).unwrap();
    let tier = L1Tier::new(layout.clone(), TierConfig::default()).unwrap();
    write_round(&tier, 2);
    let mut b = ChildRole::spawn(
        "reader",
        &[(SOCKET_ENV, server.socket_path().display().to_string())],
    );
    b.expect("ready");
    b.send("read 2");
    b.expect("held");
    let keys = round_keys(2);
    assert_eq!(
        tier.delete(&keys, false).unwrap(),
        vec![TierCode::KeyIsLocked; KEYS as usize]
    );
    b.kill();
    let mut codes = Vec::new();
    let deleted = wait_until(Duration::from_secs(30), || {
        codes = tier.delete(&keys, false).unwrap();
        codes
            .iter()
            .all(|c| *c == TierCode::Success || *c == TierCode::KeyNotExist)
    });
    assert!(
        deleted,
        "the dead reader's pins went with its session: {codes:?}"
    );
    let dir = server.directory_stats().unwrap();
    assert_eq!((dir.keys, dir.pins), (0, 0));
    // Every page A wrote came back to A's allocator.
    assert!(wait_until(Duration::from_secs(10), || {
        let _ = layout.exists(b"any");
        layout.free_pages() == layout.region_bytes() / PAGE
    }));
    assert_eq!(layout.refused_frees(), 0);
    tier.close().unwrap();
    client.close().unwrap();
}
