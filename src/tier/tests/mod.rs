//! Tests of the L1 tier against the real directory: each test starts a
//! private in-process server (real transport, real directory state
//! machine, real pool file under `/dev/shm`) and a real client; nothing is
//! faked. Directory failures are injected with the transport's fault hook
//! (`faults.rs`, feature `fault-injection`).
//!
//! - `conformance.rs`: the reference's shared conformance cases (§7.1).
//! - `scenarios.rs`: its given/when/then scenarios (§11 groups A–H) that do
//!   not need a fault; `faults.rs`: those that do.
//! - `decisions.rs`: the decisions of `l1-tier.md` (argument errors,
//!   re-entrancy, input order, usage without a round trip, close).
//!
//! Vocabulary of the reference, as these tests read it: "seed K" = a peer
//! client registers K; "pins" = the directory's pin count (its stats);
//! "freed" = the page is back in this client's allocator (free pages
//! counted, and `refused_frees` proves nothing was freed twice).

mod conformance;
mod decisions;
#[cfg(feature = "fault-injection")]
mod faults;
mod scenarios;

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::{
    EventSink, Holds, KeyPage, KeyStage, L1Tier, Listener, ManualClock, TierCode, TierConfig,
    TierEvent, TierPage, WriteMode,
};
use crate::client::{Client, ClientConfig, LayoutHandle, LayoutOptions, ReadGuard};
use crate::server::{Server, ServerConfig, ServerHandle};

/// Page size of the test layout.
pub(super) const PAGE: u64 = 64 << 10;
pub(super) const FINGERPRINT: u64 = 0x71E5;
/// Bytes of one test chunk.
pub(super) const CHUNK: usize = 4000;

pub(super) fn key(i: u64) -> Vec<u8> {
    format!("m@{i:08x}@0").into_bytes()
}

/// A server with short timers and a small pool.
pub(super) fn server_config(tag: &str) -> ServerConfig {
    let mut c = ServerConfig::ephemeral(tag);
    c.pool_size_bytes = 64 << 20;
    c.default_region_bytes = 4 << 20;
    c.directory.session_lease = Duration::from_secs(5);
    c.directory.instance_grace = Duration::from_millis(500);
    c.tick_ms = 20;
    c
}

pub(super) fn client_config(server: &ServerHandle) -> ClientConfig {
    let mut c = ClientConfig::unix(server.socket_path());
    c.layout = LayoutOptions {
        initial_reservation_bytes: 4 << 20,
        region_size_bytes: 4 << 20,
        auto_expand: true,
    };
    c
}

/// One recorded callback: its name and its keys.
pub(super) type Call = (&'static str, Vec<Vec<u8>>);

/// Every callback, recorded in order.
#[derive(Default)]
pub(super) struct Recorder {
    calls: Mutex<Vec<Call>>,
}

impl Recorder {
    fn push(&self, name: &'static str, keys: &[&[u8]]) {
        self.calls
            .lock()
            .push((name, keys.iter().map(|k| k.to_vec()).collect()));
    }

    /// Every call, in order.
    pub fn all(&self) -> Vec<Call> {
        self.calls.lock().clone()
    }

    /// The key lists of callback `name`, in order.
    pub fn kinds(&self, name: &str) -> Vec<Vec<Vec<u8>>> {
        self.calls
            .lock()
            .iter()
            .filter(|(n, _)| *n == name)
            .map(|(_, k)| k.clone())
            .collect()
    }

    pub fn clear(&self) {
        self.calls.lock().clear();
    }
}

impl Listener for Recorder {
    fn reserved_read(&self, keys: &[&[u8]]) {
        self.push("reserved_read", keys);
    }
    fn read_finished(&self, keys: &[&[u8]]) {
        self.push("read_finished", keys);
    }
    fn reserved_write(&self, keys: &[&[u8]]) {
        self.push("reserved_write", keys);
    }
    fn write_finished(&self, keys: &[&[u8]]) {
        self.push("write_finished", keys);
    }
    fn finish_write_and_reserve_read(&self, keys: &[&[u8]]) {
        self.push("finish_write_and_reserve_read", keys);
    }
    fn deleted(&self, keys: &[&[u8]]) {
        self.push("deleted", keys);
    }
    fn accessed(&self, keys: &[&[u8]]) {
        self.push("accessed", keys);
    }
}

/// Every published event, in order.
#[derive(Default)]
pub(super) struct Bus {
    events: Mutex<Vec<(TierEvent, Vec<Vec<u8>>)>>,
}

impl Bus {
    pub fn all(&self) -> Vec<(TierEvent, Vec<Vec<u8>>)> {
        self.events.lock().clone()
    }

    pub fn of(&self, event: TierEvent) -> Vec<Vec<Vec<u8>>> {
        self.events
            .lock()
            .iter()
            .filter(|(e, _)| *e == event)
            .map(|(_, k)| k.clone())
            .collect()
    }

    pub fn clear(&self) {
        self.events.lock().clear();
    }
}

impl EventSink for Bus {
    fn publish(&self, event: TierEvent, keys: &[&[u8]]) {
        self.events
            .lock()
            .push((event, keys.iter().map(|k| k.to_vec()).collect()));
    }
}

/// A tier over a real client of a real in-process server, a peer client on
/// the same layout (for "seed" and peer pins), a manual clock, a recorder
/// (registered on demand, as the reference's tests do) and an event bus.
pub(super) struct Harness {
    pub tier: L1Tier,
    pub layout: LayoutHandle,
    pub client: Client,
    pub peer: LayoutHandle,
    pub peer_client: Client,
    pub clock: Arc<ManualClock>,
    pub rec: Arc<Recorder>,
    pub bus: Arc<Bus>,
    peer_guards: Mutex<Vec<ReadGuard>>,
    // Last: the clients close before the server stops.
    pub server: ServerHandle,
}

/// How to build a harness.
pub(super) struct Setup {
    pub server: ServerConfig,
    pub client: Box<dyn Fn(&ServerHandle) -> ClientConfig>,
    pub write_ttl: Duration,
    pub read_ttl: Duration,
    pub start: Box<dyn Fn(ServerConfig) -> ServerHandle>,
}

impl Setup {
    pub fn new(tag: &str) -> Setup {
        Setup {
            server: server_config(tag),
            client: Box::new(client_config),
            write_ttl: Duration::from_secs(600),
            read_ttl: Duration::from_secs(300),
            start: Box::new(|c| Server::start(c).expect("server starts")),
        }
    }

    pub fn build(self) -> Harness {
        let server = (self.start)(self.server);
        let client = Client::connect((self.client)(&server)).expect("client connects");
        let layout = client.layout(PAGE, FINGERPRINT).expect("layout");
        let peer_client = Client::connect(client_config(&server)).expect("peer client connects");
        let peer = peer_client.layout(PAGE, FINGERPRINT).expect("peer layout");
        let clock = Arc::new(ManualClock::new());
        let bus = Arc::new(Bus::default());
        let tier = L1Tier::new(
            layout.clone(),
            TierConfig {
                write_ttl: self.write_ttl,
                read_ttl: self.read_ttl,
                clock: Arc::clone(&clock) as Arc<dyn super::Clock>,
                events: Some(Arc::clone(&bus) as Arc<dyn EventSink>),
            },
        )
        .expect("tier");
        Harness {
            tier,
            layout,
            client,
            peer,
            peer_client,
            clock,
            rec: Arc::new(Recorder::default()),
            bus,
            peer_guards: Mutex::new(Vec::new()),
            server,
        }
    }
}

pub(super) fn harness(tag: &str) -> Harness {
    Setup::new(tag).build()
}

/// Deterministic chunk bytes for `key`.
pub(super) fn bytes_for(key: &[u8], len: usize) -> Vec<u8> {
    let mut x = key.iter().fold(0x9E37_79B9_7F4A_7C15u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01B3)
    }) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Fills a write view with the key's bytes.
pub(super) fn fill(page: &TierPage, key: &[u8]) {
    let mut page = page.clone();
    let src = bytes_for(key, page.len_bytes());
    // SAFETY: `page` is a write view just returned by `reserve_write` for
    // `key`, not finished yet; this is its only live slice.
    unsafe { page.as_mut_slice() }.copy_from_slice(&src);
}

/// The bytes of a read view.
pub(super) fn read_bytes(page: &TierPage) -> Vec<u8> {
    // SAFETY: the caller holds the reservation that returned `page`; no one
    // writes a registered page or a held private page.
    unsafe { page.as_slice() }.to_vec()
}

pub(super) fn codes(r: &[KeyPage]) -> Vec<TierCode> {
    r.iter().map(|p| p.code).collect()
}

pub(super) fn page(r: &KeyPage) -> TierPage {
    r.page.clone().expect("a successful result carries a page")
}

impl Harness {
    /// Registers the recorder as a listener.
    pub fn listen(&self) {
        self.tier
            .register_listener(Arc::clone(&self.rec) as Arc<dyn Listener>)
            .expect("register listener");
    }

    /// A peer registers `key` with its bytes (without this tier).
    pub fn seed(&self, key: &[u8]) {
        let outcome = self
            .peer
            .put(key, &bytes_for(key, CHUNK))
            .expect("peer put");
        assert_eq!(outcome, crate::client::RegisterOutcome::Inserted);
    }

    /// The peer's location of a key it seeded (a plain lookup). The lookup's
    /// pin is released before returning: a dropped guard's unpin is otherwise
    /// deferred (up to `unpin_delay_us`), and the scenarios count pins.
    pub fn peer_location(&self, key: &[u8]) -> crate::client::Location {
        let location = self
            .peer
            .get(key)
            .expect("peer get")
            .expect("the key exists")
            .location();
        self.peer.client.flush_unpins().expect("peer flush unpins");
        location
    }

    /// The peer holds `n` more pins on `key` (for the rest of the test).
    pub fn peer_pin(&self, key: &[u8], n: usize) {
        let mut g = self.peer_guards.lock();
        for _ in 0..n {
            g.push(self.peer.get(key).expect("peer get").expect("key exists"));
        }
        drop(g);
    }

    /// The directory's total pin count.
    pub fn pins(&self) -> u64 {
        self.server.directory_stats().expect("stats").pins
    }

    /// The directory's stats.
    pub fn dir(&self) -> cxlkv_controlplane::directory::DirectoryStats {
        self.server.directory_stats().expect("stats")
    }

    /// Whether the directory has `key` (asked by the peer: no pin).
    pub fn in_directory(&self, key: &[u8]) -> bool {
        self.peer.exists(key).expect("peer exists")
    }

    /// Free pages of this tier's layout (a page coming back shows here).
    pub fn free_pages(&self) -> u64 {
        self.layout.free_pages()
    }

    /// `reserve_write(new)` of retained keys, each filled with its bytes.
    pub fn reserve(&self, keys: &[&[u8]], temporary: bool) -> Vec<KeyPage> {
        let flags = vec![temporary; keys.len()];
        let r = self
            .tier
            .reserve_write(keys, &flags, CHUNK, WriteMode::New)
            .expect("reserve_write");
        for (k, p) in keys.iter().zip(&r) {
            if let Some(p) = &p.page {
                fill(p, k);
            }
        }
        r
    }

    /// The reference's "write" helper: reserve (retained) then finish, both
    /// all `Success`.
    pub fn write(&self, keys: &[&[u8]]) {
        let r = self.reserve(keys, false);
        assert_eq!(codes(&r), vec![TierCode::Success; keys.len()]);
        let f = self.tier.finish_write(keys).expect("finish_write");
        assert_eq!(f, vec![TierCode::Success; keys.len()]);
    }

    pub fn reserve_read(&self, keys: &[&[u8]], holds: Holds) -> Vec<KeyPage> {
        self.tier.reserve_read(keys, holds).expect("reserve_read")
    }

    pub fn finish_read(&self, keys: &[&[u8]], holds: Holds) -> Vec<TierCode> {
        self.tier.finish_read(keys, holds).expect("finish_read")
    }

    pub fn unsafe_read(&self, keys: &[&[u8]]) -> Vec<KeyPage> {
        self.tier.unsafe_read(keys).expect("unsafe_read")
    }

    pub fn promote(&self, keys: &[&[u8]], holds: Holds) -> Vec<KeyPage> {
        self.tier
            .finish_write_and_reserve_read(keys, holds)
            .expect("promote")
    }

    pub fn delete(&self, keys: &[&[u8]]) -> Vec<TierCode> {
        self.tier.delete(keys, false).expect("delete")
    }

    pub fn stage(&self, key: &[u8]) -> KeyStage {
        self.tier.inspect(key).expect("inspect")
    }

    /// The invariants hold and nothing was freed twice.
    pub fn healthy(&self) {
        self.tier.check_invariants().expect("invariants hold");
        assert!(self.tier.memcheck(), "no page was freed twice");
    }
}
