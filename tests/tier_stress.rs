//! Several threads drive one L1 tier with random mixes of every operation
//! over a small key space (so they collide: overlapping reads, writes racing
//! reads, deletes racing holds, promotes, clears, sweeps), while a peer
//! client registers, reads and deletes the same keys. Every call must
//! answer (never an error but the documented ones), the invariants must
//! hold throughout, and after `close` nothing leaks: the directory holds no
//! pin, once the keys are deleted every page of the tier's layout is back
//! in its allocator, none freed twice, and once the clients leave every
//! pool's free bytes equal its total.

mod client_support;

use std::sync::Arc;
use std::time::Duration;

use client_support::*;
use cxlkv::client::{Client, LayoutOptions};
use cxlkv::tier::{Holds, L1Tier, Listener, ManualClock, TierCode, TierConfig, WriteMode};

const THREADS: u64 = 4;
const OPS_PER_THREAD: u64 = 2500;
const KEYS: u64 = 24;
const CHUNK: usize = 3000;

/// xorshift64*: deterministic per thread, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn stress_key(i: u64) -> Vec<u8> {
    format!("stress-{i:04}").into_bytes()
}

/// Counts callbacks (and checks lists never repeat a key).
#[derive(Default)]
struct Counting(std::sync::atomic::AtomicU64);

impl Counting {
    fn see(&self, keys: &[&[u8]]) {
        let mut seen = std::collections::HashSet::new();
        assert!(keys.iter().all(|k| seen.insert(*k)), "a key listed twice");
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Listener for Counting {
    fn reserved_read(&self, keys: &[&[u8]]) {
        self.see(keys);
    }
    fn read_finished(&self, keys: &[&[u8]]) {
        self.see(keys);
    }
    fn deleted(&self, keys: &[&[u8]]) {
        self.see(keys);
    }
    fn write_finished(&self, keys: &[&[u8]]) {
        self.see(keys);
    }
}

fn batch(rng: &mut Rng) -> Vec<Vec<u8>> {
    let n = 1 + rng.below(4);
    let mut keys: Vec<u64> = (0..n).map(|_| rng.below(KEYS)).collect();
    keys.sort_unstable();
    keys.dedup();
    keys.into_iter().map(stress_key).collect()
}

fn run_thread(tier: &L1Tier, clock: &ManualClock, seed: u64) {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    for _ in 0..OPS_PER_THREAD {
        let keys = batch(&mut rng);
        let holds = Holds::total(1 + rng.below(3) as i64);
        match rng.below(12) {
            0 | 1 => {
                let r = tier.reserve_read(&keys, holds).unwrap();
                for p in r.iter().filter_map(|p| p.page.as_ref()) {
                    // SAFETY: the reservation holds the page; nobody writes
                    // a held page.
                    let bytes = unsafe { p.as_slice() };
                    assert_eq!(bytes.len(), CHUNK);
                }
            }
            2 | 3 => {
                tier.finish_read(&keys, holds).unwrap();
            }
            4 => {
                let flags: Vec<bool> = keys.iter().map(|_| rng.below(2) == 0).collect();
                let r = tier
                    .reserve_write(&keys, &flags, CHUNK, WriteMode::New)
                    .unwrap();
                for (k, p) in keys.iter().zip(&r) {
                    if let Some(p) = &p.page {
                        let mut p = p.clone();
                        let src = chunk(k.len() as u64 + u64::from(k[k.len() - 1]), CHUNK);
                        // SAFETY: a fresh write view of this call, the only
                        // live slice of its page.
                        unsafe { p.as_mut_slice() }.copy_from_slice(&src);
                    }
                }
            }
            5 => {
                tier.finish_write(&keys).unwrap();
            }
            6 => {
                tier.finish_write_and_reserve_read(&keys, holds).unwrap();
            }
            7 => {
                let r = tier.delete(&keys, rng.below(2) == 0).unwrap();
                assert!(r.iter().all(|c| matches!(
                    c,
                    TierCode::Success | TierCode::KeyIsLocked | TierCode::KeyNotExist
                )));
            }
            8 => {
                tier.unsafe_read(&keys).unwrap();
                tier.touch_keys(&keys).unwrap();
                let _ = tier.is_key_evictable(&keys[0]);
            }
            9 => {
                if rng.below(8) == 0 {
                    tier.clear(false).unwrap();
                } else {
                    // Time moves only here, so expiry does not depend on
                    // how fast this machine runs the test.
                    clock.advance(Duration::from_millis(50));
                    tier.sweep_now().unwrap();
                }
            }
            10 => {
                let (used, total) = tier.get_memory_usage();
                assert!(used <= total);
                tier.report_status().unwrap();
            }
            _ => tier.check_invariants().unwrap(),
        }
    }
}

#[test]
fn threads_driving_one_tier_keep_the_invariants_and_leak_nothing() {
    let server = start_server("tier-stress");
    let mut cfg = client_config(&server);
    cfg.layout = LayoutOptions {
        initial_reservation_bytes: 8 << 20,
        region_size_bytes: 4 << 20,
        auto_expand: true,
    };
    let client = Client::connect(cfg).unwrap();
    let layout = client.layout(PAGE, FINGERPRINT).unwrap();
    let baseline_free = layout.free_pages();
    let peer_client = Client::connect(client_config(&server)).unwrap();
    let peer = peer_client.layout(PAGE, FINGERPRINT).unwrap();
    let clock = Arc::new(ManualClock::new());
    let tier = Arc::new(
        L1Tier::new(
            layout.clone(),
            TierConfig {
                // A few clock steps: sweeps find expired staging mid-run.
                write_ttl: Duration::from_millis(300),
                read_ttl: Duration::from_millis(200),
                clock: Arc::clone(&clock) as Arc<dyn cxlkv::tier::Clock>,
                ..TierConfig::default()
            },
        )
        .unwrap(),
    );
    let counting = Arc::new(Counting::default());
    tier.register_listener(Arc::clone(&counting) as Arc<dyn Listener>)
        .unwrap();

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let peer_thread = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut rng = Rng(0xFEED);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let k = stress_key(rng.below(KEYS));
                match rng.below(3) {
                    0 => {
                        let _ = peer.put(&k, &chunk(7, CHUNK)).unwrap();
                    }
                    1 => {
                        let g = peer.get(&k).unwrap();
                        drop(g);
                    }
                    _ => {
                        let _ = peer.delete(&k).unwrap();
                    }
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            peer
        })
    };
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let tier = Arc::clone(&tier);
            let clock = Arc::clone(&clock);
            std::thread::spawn(move || run_thread(&tier, &clock, t + 1))
        })
        .collect();
    for t in threads {
        t.join().expect("a driver thread panicked");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let peer = peer_thread.join().expect("the peer thread panicked");
    tier.check_invariants().unwrap();
    assert!(counting.0.load(std::sync::atomic::Ordering::Relaxed) > 0);
    let stats = tier.stats();
    eprintln!("{stats:?}");
    assert!(stats.lookups > 0 && stats.registers > 0 && stats.unpin_round_trips > 0);
    assert!(stats.swept > 0 && stats.temporaries_reclaimed > 0 && stats.deletes > 0);

    tier.close().unwrap();
    peer_client.flush_unpins().unwrap();
    assert_eq!(server.directory_stats().unwrap().pins, 0, "no pin leaked");
    let keys: Vec<Vec<u8>> = (0..KEYS).map(stress_key).collect();
    peer.batch_delete(&keys).unwrap();
    // A request of the tier's client brings back its freed-page notices.
    assert!(wait_until(Duration::from_secs(30), || {
        let _ = layout.exists(stress_key(0));
        layout.free_pages() == layout.region_bytes() / PAGE
    }));
    assert!(layout.free_pages() >= baseline_free, "every page is back");
    assert_eq!(layout.refused_frees(), 0, "none freed twice");
    assert_eq!(client.unresolved_registrations(), 0);
    let dir = server.directory_stats().unwrap();
    assert_eq!((dir.keys, dir.pins), (0, 0));

    // The pool level: once both clients leave, their regions go back to the
    // pool manager and every pool's free bytes equal its total again.
    let tier = Arc::into_inner(tier).expect("the driver threads are joined");
    drop(tier);
    drop((layout, peer));
    client.close().unwrap();
    peer_client.close().unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || {
            let s = server.directory_stats().unwrap();
            s.regions == 0 && s.instances == 0 && pool_is_free(&s)
        }),
        "every pool's free bytes are back to its total: {:?}",
        server.directory_stats().unwrap().per_pool
    );
}

/// Every pool of the server has all its bytes free (as its pool manager
/// reports them).
fn pool_is_free(s: &cxlkv_controlplane::directory::DirectoryStats) -> bool {
    !s.per_pool.is_empty()
        && s.per_pool
            .iter()
            .all(|p| p.reported_total_bytes > 0 && p.estimated_free_bytes == p.reported_total_bytes)
}
