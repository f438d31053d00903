//! Behaviour of the directory state machine, one property per test, driven
//! directly (no server): a small fake pool manager carries out the effects.

use std::collections::HashMap;
use std::time::Duration;

use cxlkv_controlplane::directory::{
    Caller, DeleteOutcome, Directory, DirectoryConfig, DirectoryError, Effect, EvictionConfig,
    Hello, InstanceId, Layout, Location, MAX_BATCH_CEILING, MAX_PINS_PER_KEY, MAX_SEQUENCE, OpKind,
    Peer, PresentedRegion, Reattach, ReattachKind, RecoveredRegion, RegionHandle, RegionReply,
    RegionStatus, RegionToken, RegisterEntry, RegisterOutcome, RejectReason, Reply, Sequence,
    SessionEndReason, SessionId, Time, UnpinEntry, UnpinOutcome,
};
use cxlkv_dataplane::ids::{Generation, PageIndex, PoolId, RegionId};

const L: Layout = Layout {
    page_size_bytes: 4096,
    fingerprint: 7,
};
const OTHER: Layout = Layout {
    page_size_bytes: 8192,
    fingerprint: 9,
};
const REGION_BYTES: u64 = 64 * 4096;
const UNIX: Peer = Peer::Unix {
    pid: 100,
    uid: 1000,
    gid: 1000,
};
const POOL: PoolId = PoolId(0);

fn secs(s: u64) -> Time {
    Time::from_nanos(s * 1_000_000_000)
}

/// The pool manager, reduced to what the directory needs from it.
#[derive(Default)]
struct FakePool {
    next_region: u64,
    live: HashMap<RegionId, RegionHandle>,
    freed: Vec<RegionId>,
    fail_next: bool,
    /// Grants are rounded up to this many bytes (0: granted as asked), as a
    /// pool manager rounds to its pool's alignment.
    round_to: u64,
}

impl FakePool {
    /// Carries out every queued effect; returns the completed deferred
    /// replies and the session-ended notices.
    fn service(
        &mut self,
        dir: &mut Directory,
    ) -> (
        Vec<cxlkv_controlplane::directory::Completion>,
        Vec<SessionId>,
    ) {
        let mut completions = Vec::new();
        let mut ended = Vec::new();
        loop {
            let effects: Vec<Effect> = dir.drain_effects().collect();
            if effects.is_empty() {
                return (completions, ended);
            }
            for effect in effects {
                match effect {
                    Effect::AllocateRegion {
                        request, len_bytes, ..
                    } => {
                        let result = if std::mem::take(&mut self.fail_next) {
                            Err("pool full".to_owned())
                        } else {
                            self.next_region += 1;
                            let id = RegionId(self.next_region);
                            let handle = RegionHandle {
                                region: id,
                                pool: POOL,
                                offset_bytes: self.next_region * (1 << 30),
                                len_bytes: match self.round_to {
                                    0 => len_bytes,
                                    a => len_bytes.next_multiple_of(a),
                                },
                                token: RegionToken([self.next_region as u8; 32]),
                            };
                            self.live.insert(id, handle);
                            Ok(handle)
                        };
                        completions.extend(dir.region_allocated(request, result));
                    }
                    Effect::FreeRegion { handle, .. } => {
                        let known = self.live.remove(&handle.region);
                        assert_eq!(known, Some(handle), "free of a region not allocated");
                        self.freed.push(handle.region);
                    }
                    Effect::SessionEnded { session, .. } => ended.push(session),
                    other => panic!("unexpected effect {other:?}"),
                }
            }
        }
    }
}

/// One client instance's bookkeeping.
#[derive(Clone)]
struct Client {
    name: String,
    session: SessionId,
    secret: cxlkv_controlplane::directory::InstanceSecret,
    next_seq: u64,
    notice_ack: u64,
    regions: Vec<PresentedRegion>,
}

impl Client {
    fn caller(&self) -> Caller {
        Caller {
            session: self.session,
            notice_ack: self.notice_ack,
        }
    }

    fn seq(&mut self) -> Sequence {
        let seq = self.next_seq;
        self.next_seq += 1;
        Sequence {
            seq,
            replies_received_below: 0,
        }
    }
}

struct World {
    dir: Directory,
    pool: FakePool,
    now: Time,
    /// Sessions that keep heart-beating while time advances.
    kept_alive: Vec<SessionId>,
}

impl World {
    fn new() -> Self {
        Self::with(DirectoryConfig::default())
    }

    fn with(config: DirectoryConfig) -> Self {
        Self {
            dir: Directory::new(config, [7; 32]).unwrap(),
            pool: FakePool::default(),
            now: secs(1),
            kept_alive: Vec::new(),
        }
    }

    fn hello(&mut self, name: &str) -> Client {
        let w = self
            .dir
            .hello(
                Hello {
                    instance: name,
                    quota_bytes: None,
                },
                UNIX,
                self.now,
            )
            .unwrap();
        Client {
            name: name.to_owned(),
            session: w.session,
            secret: w.secret,
            next_seq: 1,
            notice_ack: 0,
            regions: Vec::new(),
        }
    }

    fn region(&mut self, c: &mut Client, layout: Layout) -> RegionId {
        let handle = self.grant(c, layout, REGION_BYTES);
        c.regions.push(PresentedRegion { handle, layout });
        handle.region
    }

    /// Requests a region of `len_bytes` for `c` and serves the pool
    /// manager until it is granted.
    fn grant(&mut self, c: &mut Client, layout: Layout, len_bytes: u64) -> RegionHandle {
        let seq = c.seq();
        let reply = self
            .dir
            .request_region(&c.caller(), seq, layout, len_bytes, self.now)
            .unwrap();
        let RegionReply::Deferred(d) = reply.body else {
            panic!("a fresh request is deferred")
        };
        let (done, _) = self.pool.service(&mut self.dir);
        done.into_iter()
            .find(|c| c.deferred == d)
            .expect("completed")
            .result
            .unwrap()
            .body
            .handle
    }

    /// `c` reattaches as its client would: every region it knows, its next
    /// sequence number and notice acknowledgement.
    fn reattach_presenting_all(
        &mut self,
        c: &Client,
    ) -> Result<cxlkv_controlplane::directory::Reattached, DirectoryError> {
        self.dir.reattach(
            Reattach {
                instance: &c.name,
                secret: c.secret,
                regions: &c.regions,
                next_seq: c.next_seq,
                notice_ack: c.notice_ack,
                quota_bytes: None,
            },
            UNIX,
            self.now,
        )
    }

    /// Requests a region for `c` and answers it, as a pool manager would,
    /// with `handle` (whatever the directory knows of it); returns the
    /// completed replies.
    fn granted_as(
        &mut self,
        c: &mut Client,
        handle: RegionHandle,
    ) -> Vec<cxlkv_controlplane::directory::Completion> {
        let seq = c.seq();
        let reply = self
            .dir
            .request_region(&c.caller(), seq, L, REGION_BYTES, self.now)
            .unwrap();
        assert!(matches!(reply.body, RegionReply::Deferred(_)));
        let request = self
            .dir
            .drain_effects()
            .find_map(|e| match e {
                Effect::AllocateRegion { request, .. } => Some(request),
                _ => None,
            })
            .expect("the region request goes to the pool manager");
        self.dir.region_allocated(request, Ok(handle))
    }

    fn register(
        &mut self,
        c: &mut Client,
        entries: &[(&[u8], Location)],
    ) -> Result<Reply<Vec<RegisterOutcome>>, DirectoryError> {
        let seq = c.seq();
        self.register_seq(c, seq, L, entries)
    }

    fn register_seq(
        &mut self,
        c: &Client,
        seq: Sequence,
        layout: Layout,
        entries: &[(&[u8], Location)],
    ) -> Result<Reply<Vec<RegisterOutcome>>, DirectoryError> {
        self.dir.register(
            &c.caller(),
            seq,
            layout,
            entries
                .iter()
                .map(|&(key, location)| RegisterEntry { key, location }),
            self.now,
        )
    }

    fn put(&mut self, c: &mut Client, key: &[u8], loc: Location) {
        let r = self.register(c, &[(key, loc)]).unwrap();
        assert_eq!(r.body, vec![RegisterOutcome::Inserted], "{key:?}");
    }

    fn lookup_pin(&mut self, c: &mut Client, keys: &[&[u8]], pins: u32) -> Vec<Option<Location>> {
        let seq = c.seq();
        self.dir
            .lookup(
                &c.caller(),
                Some(seq),
                L,
                keys.iter().copied(),
                pins,
                self.now,
            )
            .unwrap()
            .body
            .locations
    }

    fn delete(&mut self, c: &mut Client, keys: &[&[u8]]) -> Vec<DeleteOutcome> {
        let seq = c.seq();
        self.dir
            .delete(&c.caller(), seq, L, keys.iter().copied(), self.now)
            .unwrap()
            .body
    }

    fn unpin(&mut self, c: &mut Client, keys: &[(&[u8], u32)]) -> Vec<UnpinOutcome> {
        let seq = c.seq();
        self.dir
            .unpin(
                &c.caller(),
                seq,
                L,
                keys.iter().map(|&(key, count)| UnpinEntry { key, count }),
                self.now,
            )
            .unwrap()
            .body
    }

    fn exists(&mut self, c: &Client, keys: &[&[u8]]) -> Vec<bool> {
        self.dir
            .exists(&c.caller(), L, keys.iter().copied(), self.now)
            .unwrap()
            .body
    }

    /// A new region of `c`'s, 62 of its 64 pages registered (> 95 % full):
    /// the keys, in page order.
    fn fill_a_region(&mut self, c: &mut Client) -> Vec<Vec<u8>> {
        let r = self.region(c, L);
        let keys: Vec<Vec<u8>> = (0..62u32).map(|i| i.to_le_bytes().to_vec()).collect();
        for (i, k) in keys.iter().enumerate() {
            self.put(c, k, loc(r, i as u32, 1));
        }
        keys
    }

    fn keep_alive(&mut self, c: &Client) {
        self.kept_alive.push(c.session);
    }

    /// Advances the clock in steps of at most a second, heart-beating the
    /// kept-alive sessions and ticking at each step.
    fn advance(&mut self, d: Duration) {
        let end = self.now.saturating_add(d);
        while self.now < end {
            let step = end.saturating_since(self.now).min(Duration::from_secs(1));
            self.now = self.now.saturating_add(step);
            for &session in &self.kept_alive {
                let caller = Caller {
                    session,
                    notice_ack: 0,
                };
                self.dir.heartbeat(&caller, self.now).unwrap();
            }
            self.dir.tick(self.now);
            self.pool.service(&mut self.dir);
            self.dir.check_invariants().unwrap();
        }
    }
}

fn loc(region: RegionId, page: u32, generation: u32) -> Location {
    Location {
        region,
        page: PageIndex(page),
        generation: Generation(generation),
        len_bytes: 100,
    }
}

// --- registry ---------------------------------------------------------------

#[test]
fn duplicate_registration_answers_the_winners_location() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let mut b = w.hello("b");
    let ra = w.region(&mut a, L);
    let rb = w.region(&mut b, L);
    w.put(&mut a, b"k", loc(ra, 0, 1));
    let r = w.register(&mut b, &[(b"k", loc(rb, 3, 1))]).unwrap();
    assert_eq!(r.body, vec![RegisterOutcome::Duplicate(loc(ra, 0, 1))]);
    // The loser's page is still free for another key.
    w.put(&mut b, b"other", loc(rb, 3, 1));
    // A repeat of the same key inside one batch: the second answers the first.
    let r = w
        .register(&mut a, &[(b"x", loc(ra, 1, 1)), (b"x", loc(ra, 2, 1))])
        .unwrap();
    assert_eq!(
        r.body,
        vec![
            RegisterOutcome::Inserted,
            RegisterOutcome::Duplicate(loc(ra, 1, 1))
        ]
    );
    w.dir.check_invariants().unwrap();
}

#[test]
fn delete_answers_deleted_pinned_and_missing_without_conflating_them() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let mut b = w.hello("b");
    let ra = w.region(&mut a, L);
    w.put(&mut a, b"free", loc(ra, 0, 1));
    w.put(&mut a, b"held", loc(ra, 1, 1));
    assert_eq!(w.lookup_pin(&mut b, &[b"held"], 1)[0], Some(loc(ra, 1, 1)));
    assert_eq!(
        w.delete(&mut b, &[b"free", b"held", b"never", b"free"]),
        vec![
            DeleteOutcome::Deleted,
            DeleteOutcome::Pinned { pins: 1 },
            DeleteOutcome::Missing,
            DeleteOutcome::Missing
        ]
    );
    assert_eq!(w.exists(&b, &[b"free", b"held"]), vec![false, true]);
    w.dir.check_invariants().unwrap();
}

#[test]
fn registration_is_rejected_outside_the_callers_regions_other_layouts_and_bad_pages() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let mut b = w.hello("b");
    let ra = w.region(&mut a, L);
    let rb = w.region(&mut b, L);
    let r_other = w.region(&mut a, OTHER);
    let mut short = loc(ra, 5, 1);
    short.len_bytes = 0;
    let mut long = loc(ra, 6, 1);
    long.len_bytes = 4097;
    let r = w
        .register(
            &mut a,
            &[
                (b"1", loc(rb, 0, 1)),
                (b"2", loc(r_other, 0, 1)),
                (b"3", loc(ra, 64, 1)),
                (b"4", short),
                (b"5", long),
            ],
        )
        .unwrap();
    assert_eq!(
        r.body,
        vec![
            RegisterOutcome::Rejected(RejectReason::NotOwner { region: rb }),
            RegisterOutcome::Rejected(RejectReason::WrongLayout { region: r_other }),
            RegisterOutcome::Rejected(RejectReason::PageOutOfRange {
                page: PageIndex(64),
                pages: 64
            }),
            RegisterOutcome::Rejected(RejectReason::BadLength {
                len_bytes: 0,
                page_size_bytes: 4096
            }),
            RegisterOutcome::Rejected(RejectReason::BadLength {
                len_bytes: 4097,
                page_size_bytes: 4096
            }),
        ]
    );
    assert_eq!(w.dir.stats(w.now).keys, 0);
}

#[test]
fn stale_generations_and_pages_in_use_are_rejected() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let ra = w.region(&mut a, L);
    w.put(&mut a, b"k1", loc(ra, 0, 5));
    let r = w.register(&mut a, &[(b"k2", loc(ra, 0, 6))]).unwrap();
    assert_eq!(
        r.body,
        vec![RegisterOutcome::Rejected(RejectReason::PageInUse {
            page: PageIndex(0)
        })]
    );
    assert_eq!(w.delete(&mut a, &[b"k1"]), vec![DeleteOutcome::Deleted]);
    for generation in [4, 5] {
        let r = w
            .register(&mut a, &[(b"k2", loc(ra, 0, generation))])
            .unwrap();
        assert_eq!(
            r.body,
            vec![RegisterOutcome::Rejected(RejectReason::StaleGeneration {
                generation: Generation(generation),
                newest_seen: Generation(5)
            })]
        );
    }
    w.put(&mut a, b"k2", loc(ra, 0, 6));
    assert_eq!(w.dir.stats(w.now).outcomes.stale_generation, 2);
}

#[test]
fn a_reader_of_one_layout_never_sees_a_key_of_another() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let r_other = w.region(&mut a, OTHER);
    let seq = a.seq();
    let r = w
        .register_seq(&a, seq, OTHER, &[(b"k", loc(r_other, 0, 1))])
        .unwrap();
    assert_eq!(r.body, vec![RegisterOutcome::Inserted]);
    assert_eq!(w.exists(&a, &[b"k"]), vec![false]);
    let found = w
        .dir
        .exists(&a.caller(), OTHER, [&b"k"[..]], w.now)
        .unwrap()
        .body;
    assert_eq!(found, vec![true]);
}

#[test]
fn lookup_pins_atomically_and_lists_each_region_once() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let mut b = w.hello("b");
    let r1 = w.region(&mut a, L);
    let r2 = w.region(&mut a, L);
    w.put(&mut a, b"x", loc(r1, 0, 1));
    w.put(&mut a, b"y", loc(r1, 1, 1));
    w.put(&mut a, b"z", loc(r2, 0, 1));
    let seq = b.seq();
    let reply = w
        .dir
        .lookup(
            &b.caller(),
            Some(seq),
            L,
            [&b"x"[..], b"nope", b"y", b"z"],
            2,
            w.now,
        )
        .unwrap()
        .body;
    assert_eq!(
        reply.locations,
        vec![
            Some(loc(r1, 0, 1)),
            None,
            Some(loc(r1, 1, 1)),
            Some(loc(r2, 0, 1))
        ]
    );
    let regions: Vec<RegionId> = reply.regions.iter().map(|d| d.region).collect();
    assert_eq!(regions, vec![r1, r2]);
    assert!(reply.regions.iter().all(|d| d.page_size_bytes == 4096));
    let stats = w.dir.stats(w.now);
    assert_eq!((stats.pins, stats.pinned_keys), (6, 3));
    w.dir.check_invariants().unwrap();
}

#[test]
fn a_key_at_the_pin_limit_refuses_a_lookup_naming_it_and_nothing_is_pinned() {
    let per_call = MAX_PINS_PER_KEY / MAX_BATCH_CEILING as u32;
    let mut w = World::with(DirectoryConfig {
        max_pins_per_call: per_call,
        ..DirectoryConfig::default()
    });
    let mut a = w.hello("a");
    let r = w.region(&mut a, L);
    w.put(&mut a, b"full", loc(r, 0, 1));
    w.put(&mut a, b"free", loc(r, 1, 1));
    // One key named 1024 times a call: 64 calls take it to the limit.
    let batch: Vec<&[u8]> = vec![b"full"; 1024];
    let calls = MAX_PINS_PER_KEY / (per_call * 1024);
    for _ in 0..calls {
        w.lookup_pin(&mut a, &batch, per_call);
    }
    assert_eq!(w.dir.stats(w.now).pins, u64::from(MAX_PINS_PER_KEY));
    // The total leaves no room, so each key is checked: `free` has room.
    assert_eq!(
        w.lookup_pin(&mut a, &[b"free"], 1),
        vec![Some(loc(r, 1, 1))]
    );
    let seq = a.seq();
    let err = w
        .dir
        .lookup(&a.caller(), Some(seq), L, [&b"free"[..], b"full"], 1, w.now)
        .unwrap_err();
    assert!(
        matches!(err, DirectoryError::PinLimit { index: 1, max } if max == MAX_PINS_PER_KEY),
        "{err:?}"
    );
    let stats = w.dir.stats(w.now);
    assert_eq!(
        stats.pins,
        u64::from(MAX_PINS_PER_KEY) + 1,
        "the refused lookup pinned nothing, not even the key before the full one"
    );
    w.dir.check_invariants().unwrap();
}

/// Found by a review of the directory: pin ledgers had no directory-wide
/// bound, only a per-session one (1 Mi keys by default, 32 MiB of ledger
/// each), so 4 096 sessions pinning the same keys could take 128 GiB. A
/// pinning lookup that could cross `max_pinned_entries` is refused whole,
/// as one crossing the session's own limit is, and changes nothing.
#[test]
fn a_pinning_lookup_crossing_the_directory_wide_pin_limit_is_refused_and_changes_nothing() {
    let mut w = World::with(DirectoryConfig {
        max_pinned_entries: 10,
        ..DirectoryConfig::default()
    });
    let mut a = w.hello("a");
    let mut b = w.hello("b");
    let mut c = w.hello("c");
    let r = w.region(&mut a, L);
    let keys: Vec<Vec<u8>> = (0..8u8).map(|i| vec![b'k', i]).collect();
    for (i, k) in keys.iter().enumerate() {
        w.put(&mut a, k, loc(r, i as u32, 1));
    }
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    // Eight (session, key) pairs: a and b pin two keys in common.
    w.lookup_pin(&mut a, &refs[..4], 1);
    w.lookup_pin(&mut b, &refs[2..6], 2);
    let pins_held = |w: &mut World| -> Vec<u64> {
        let now = w.now;
        w.dir
            .stats(now)
            .per_instance
            .iter()
            .map(|i| i.pins_held)
            .collect()
    };
    // One pin on each of `keys`, as `caller`'s request `seq`.
    let pin_one = |w: &mut World, caller: &Caller, seq, keys: &[&[u8]]| {
        let now = w.now;
        w.dir
            .lookup(caller, Some(seq), L, keys.iter().copied(), 1, now)
    };
    let (totals, digest, held) = (w.dir.totals(), w.dir.state_digest(), pins_held(&mut w));
    assert_eq!((totals.pins, held.clone()), (12, vec![4, 8, 0]));

    // c's three keys would make eleven pairs: refused, nothing pinned, not
    // even the two that would have fitted.
    let seq = c.seq();
    let err = pin_one(&mut w, &c.caller(), seq, &refs[5..8]).unwrap_err();
    assert_eq!(err, DirectoryError::PinnedEntryLimit { max: 10 });
    assert_eq!(w.dir.totals(), totals);
    assert_eq!(w.dir.state_digest(), digest, "every ledger as it was");
    assert_eq!(pins_held(&mut w), held);
    // A key a session already pins counts too: a second pin by a on one of
    // its own keys and two new ones is refused the same way.
    let seq_a = a.seq();
    let err = pin_one(&mut w, &a.caller(), seq_a, &[refs[0], refs[6], refs[7]]).unwrap_err();
    assert_eq!(err, DirectoryError::PinnedEntryLimit { max: 10 });
    assert_eq!(w.dir.state_digest(), digest);
    w.dir.check_invariants().unwrap();

    // Up to the limit is fine; pins released make room, and the refused
    // number was not consumed: c's retry of it runs.
    w.lookup_pin(&mut b, &refs[6..8], 1);
    assert_eq!(w.dir.totals().pins, 14);
    assert_eq!(
        w.unpin(&mut a, &[(refs[0], 1), (refs[1], 1)]),
        vec![UnpinOutcome::Unpinned; 2]
    );
    let err = pin_one(&mut w, &c.caller(), seq, &refs[5..8]).unwrap_err();
    assert_eq!(
        err,
        DirectoryError::PinnedEntryLimit { max: 10 },
        "8 + 3 > 10"
    );
    w.dir.session_closed(b.session, w.now);
    let found = pin_one(&mut w, &c.caller(), seq, &refs[5..8])
        .unwrap()
        .body
        .locations;
    assert!(found.iter().all(Option::is_some));
    assert_eq!(w.dir.totals().pins, 2 + 3, "a's two and c's three");
    w.dir.check_invariants().unwrap();
}

/// The directory-wide limit bounds the ledgers' memory, not only the pins
/// held: a ledger thinned out by unpins is rebuilt to fit once all ledgers
/// together are over their budget (2 buckets per pair the limit allows),
/// so sessions taking turns at pinning many keys cannot each keep a ledger
/// sized for their peak.
#[test]
fn sessions_taking_turns_at_many_pins_do_not_each_keep_a_ledger_sized_for_their_peak() {
    let mut w = World::with(DirectoryConfig {
        max_batch: 4096,
        // Room for one reader's 2 048 pins while seven others keep one.
        max_pinned_entries: 2048 + 7,
        ..DirectoryConfig::default()
    });
    let mut owner = w.hello("owner");
    let keys: Vec<Vec<u8>> = (0..2048u32).map(|i| i.to_le_bytes().to_vec()).collect();
    let mut region = w.region(&mut owner, L);
    for (i, k) in keys.iter().enumerate() {
        if i > 0 && i % 64 == 0 {
            region = w.region(&mut owner, L);
        }
        w.put(&mut owner, k, loc(region, (i % 64) as u32, 1));
    }
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    let mut readers: Vec<Client> = (0..8).map(|i| w.hello(&format!("r{i}"))).collect();
    for r in &mut readers {
        w.lookup_pin(r, &refs, 1);
        // All but one key back: each peak took 4 096 buckets (64 KiB).
        let back: Vec<(&[u8], u32)> = refs[1..].iter().map(|&k| (k, 1)).collect();
        assert!(
            w.unpin(r, &back)
                .iter()
                .all(|o| *o == UnpinOutcome::Unpinned)
        );
        w.dir.check_invariants().unwrap();
    }
    // Eight peaks of 4 096 buckets would be 32 768. The first reader's
    // stays (the ledgers were within their budget of 2 × 2 055 buckets),
    // the others' are rebuilt at 1 024.
    let stats = w.dir.stats(w.now);
    assert_eq!(stats.pins, 8);
    let ledger_bytes = w.dir.pin_ledger_bytes();
    assert!(
        ledger_bytes <= (4096 + 8 * 1024) * 16,
        "{ledger_bytes} bytes of pin ledgers"
    );
}

#[test]
fn unpin_never_underflows_and_reports_double_unpins() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let mut b = w.hello("b");
    let ra = w.region(&mut a, L);
    w.put(&mut a, b"k", loc(ra, 0, 1));
    w.lookup_pin(&mut b, &[b"k"], 2);
    w.lookup_pin(&mut a, &[b"k"], 1);
    assert_eq!(w.unpin(&mut b, &[(b"k", 3)]), vec![UnpinOutcome::NotPinned]);
    assert_eq!(
        w.unpin(&mut b, &[(b"k", 1), (b"k", 1), (b"k", 1), (b"missing", 1)]),
        vec![
            UnpinOutcome::Unpinned,
            UnpinOutcome::Unpinned,
            UnpinOutcome::NotPinned,
            UnpinOutcome::NotPinned
        ]
    );
    // a's pin is untouched by b's unpins.
    assert_eq!(
        w.delete(&mut b, &[b"k"]),
        vec![DeleteOutcome::Pinned { pins: 1 }]
    );
    assert_eq!(w.unpin(&mut a, &[(b"k", 1)]), vec![UnpinOutcome::Unpinned]);
    assert_eq!(w.delete(&mut b, &[b"k"]), vec![DeleteOutcome::Deleted]);
    let outcomes = w.dir.stats(w.now).outcomes;
    assert_eq!((outcomes.unpinned, outcomes.not_pinned), (3, 3));
    w.dir.check_invariants().unwrap();
}

// --- sessions, pins and regions across deaths -------------------------------

#[test]
fn session_death_releases_its_pins_and_defers_or_frees_its_regions() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let mut b = w.hello("b");
    let with_keys = w.region(&mut a, L);
    let empty = w.region(&mut a, L);
    w.put(&mut a, b"k1", loc(with_keys, 0, 1));
    w.put(&mut a, b"k2", loc(with_keys, 1, 1));
    w.lookup_pin(&mut a, &[b"k1"], 3);
    assert_eq!(
        w.delete(&mut b, &[b"k1"]),
        vec![DeleteOutcome::Pinned { pins: 3 }]
    );

    w.dir.session_closed(a.session, w.now);
    w.keep_alive(&b);
    w.dir.check_invariants().unwrap();
    assert_eq!(w.dir.stats(w.now).pins, 0, "pins die with the session");
    // Within the grace period nothing is freed.
    w.advance(Duration::from_secs(29));
    assert!(w.pool.freed.is_empty());
    // After it, the empty region is freed, the other deferred; keys readable.
    w.advance(Duration::from_secs(2));
    assert_eq!(w.pool.freed, vec![empty]);
    assert_eq!(w.exists(&b, &[b"k1", b"k2"]), vec![true, true]);
    let stats = w.dir.stats(w.now);
    assert_eq!((stats.orphaned_regions, stats.instances), (1, 1));
    // The deferred region goes with its last key.
    assert_eq!(w.delete(&mut b, &[b"k1"]), vec![DeleteOutcome::Deleted]);
    w.pool.service(&mut w.dir);
    assert_eq!(w.pool.freed, vec![empty]);
    assert_eq!(w.delete(&mut b, &[b"k2"]), vec![DeleteOutcome::Deleted]);
    w.pool.service(&mut w.dir);
    assert_eq!(w.pool.freed, vec![empty, with_keys]);
    assert!(w.pool.live.keys().all(|r| !w.pool.freed.contains(r)));
    w.dir.check_invariants().unwrap();
}

#[test]
fn an_idle_session_expires_with_its_lease_and_is_told_so() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let mut b = w.hello("b");
    let ra = w.region(&mut a, L);
    w.put(&mut a, b"k", loc(ra, 0, 1));
    w.lookup_pin(&mut b, &[b"k"], 1);
    for _ in 0..3 {
        w.now = w.now.saturating_add(Duration::from_secs(4));
        w.dir.heartbeat(&a.caller(), w.now).unwrap();
        w.dir.tick(w.now);
    }
    let (_, ended) = w.pool.service(&mut w.dir);
    assert_eq!(ended, vec![b.session], "b sent nothing for 12 s");
    assert_eq!(
        w.dir.heartbeat(&b.caller(), w.now),
        Err(DirectoryError::SessionEnded { session: b.session })
    );
    assert_eq!(w.delete(&mut a, &[b"k"]), vec![DeleteOutcome::Deleted]);
    w.dir.check_invariants().unwrap();
}

#[test]
fn admin_end_session_releases_pins_and_fails_the_next_call_clearly() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let ra = w.region(&mut a, L);
    w.put(&mut a, b"k", loc(ra, 0, 1));
    let mut reader = w.hello("reader");
    w.lookup_pin(&mut reader, &[b"k"], 4);
    let ended = w.dir.end_session(reader.session, w.now).unwrap();
    assert_eq!(ended.pins_released, 4);
    assert!(ended.instance_left_without_sessions);
    let (_, notified) = w.pool.service(&mut w.dir);
    assert_eq!(notified, vec![reader.session]);
    assert_eq!(
        w.dir.exists(&reader.caller(), L, [&b"k"[..]], w.now),
        Err(DirectoryError::SessionEnded {
            session: reader.session
        })
    );
    // Not `UnknownSession`: that speaks of the caller's own session.
    assert_eq!(
        w.dir.end_session(SessionId(999), w.now),
        Err(DirectoryError::NoSuchTarget {
            session: SessionId(999)
        })
    );
    assert_eq!(w.delete(&mut a, &[b"k"]), vec![DeleteOutcome::Deleted]);
}

#[test]
fn long_held_pins_are_reported_in_stats() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let ra = w.region(&mut a, L);
    w.put(&mut a, b"old", loc(ra, 0, 1));
    w.put(&mut a, b"new", loc(ra, 1, 1));
    w.lookup_pin(&mut a, &[b"old"], 2);
    w.now = w.now.saturating_add(Duration::from_secs(50));
    w.lookup_pin(&mut a, &[b"new"], 1);
    w.now = w.now.saturating_add(Duration::from_secs(20));
    let stats = w.dir.stats(w.now);
    assert_eq!(stats.long_held_pins.count, 1);
    assert_eq!(stats.long_held_pins.oldest[0].pins, 2);
    assert_eq!(
        stats.long_held_pins.oldest[0].held_for,
        Duration::from_secs(70)
    );
}

#[test]
fn stats_count_every_long_held_pin_and_list_the_oldest_first_up_to_the_limit() {
    let mut w = World::new();
    let mut owner = w.hello("owner");
    let r = w.region(&mut owner, L);
    let keys: Vec<Vec<u8>> = (0..40).map(|i| format!("k{i}").into_bytes()).collect();
    for (i, k) in keys.iter().enumerate() {
        w.put(&mut owner, k, loc(r, i as u32, 1));
    }
    let mut readers = [w.hello("r0"), w.hello("r1"), w.hello("r2")];
    // Key i is pinned at second i, by reader i % 3, with i % 3 + 1 pins.
    for (i, k) in keys.iter().enumerate() {
        w.lookup_pin(&mut readers[i % 3], &[k], (i % 3 + 1) as u32);
        w.now = w.now.saturating_add(Duration::from_secs(1));
    }
    let config = DirectoryConfig::default();
    assert_eq!(config.long_held_pin, Duration::from_secs(60));
    assert_eq!(config.long_held_pins_listed, 16);
    // Now second 89: key i's pin is 89 - i seconds old, long-held for
    // i <= 29.
    w.now = w.now.saturating_add(Duration::from_secs(49));
    let long = w.dir.stats(w.now).long_held_pins;
    assert_eq!(long.count, 30);
    let listed: Vec<(SessionId, &str, u32, u64)> = long
        .oldest
        .iter()
        .map(|p| (p.session, p.instance.as_str(), p.pins, p.held_for.as_secs()))
        .collect();
    let expected: Vec<(SessionId, &str, u32, u64)> = (0..16)
        .map(|i| {
            let reader = &readers[i % 3];
            (
                reader.session,
                reader.name.as_str(),
                (i % 3 + 1) as u32,
                89 - i as u64,
            )
        })
        .collect();
    assert_eq!(listed, expected);
}

#[test]
fn a_pin_has_no_expiry_while_its_session_lives_and_eviction_never_takes_it() {
    // LRU eviction on and the pool above its high watermark: neither time
    // nor memory pressure takes a pin or the key it holds.
    let mut w = eviction_world(true);
    let mut a = w.hello("a");
    let keys = w.fill_a_region(&mut a);
    w.lookup_pin(&mut a, &[&keys[0]], 2);
    w.keep_alive(&a);
    w.dir.pool_usage(POOL, REGION_BYTES, 0);
    let held = DirectoryConfig::default().long_held_pin * 10;
    w.advance(held);
    let stats = w.dir.stats(w.now);
    assert!(stats.evictions.lru_keys > 0, "eviction ran meanwhile");
    assert_eq!(w.dir.inspect_key(&L, &keys[0]).unwrap().pins, 2);
    assert_eq!(stats.long_held_pins.count, 1);
    assert_eq!(stats.long_held_pins.oldest[0].held_for, held);
    assert_eq!(
        w.delete(&mut a, &[&keys[0]]),
        vec![DeleteOutcome::Pinned { pins: 2 }]
    );
    assert_eq!(
        w.unpin(&mut a, &[(&keys[0], 2)]),
        vec![UnpinOutcome::Unpinned]
    );
    assert_eq!(w.delete(&mut a, &[&keys[0]]), vec![DeleteOutcome::Deleted]);
    w.dir.check_invariants().unwrap();
}

/// A directory whose reply cache's byte limit is so small that only the
/// newest reply stays cached.
fn newest_reply_only() -> World {
    World::with(DirectoryConfig {
        reply_cache_bytes_per_instance: 1,
        ..DirectoryConfig::default()
    })
}

#[test]
fn a_retry_whose_reply_left_the_bounded_cache_is_refused_and_never_runs_again() {
    let mut w = newest_reply_only();
    let mut a = w.hello("a");
    let ra = w.region(&mut a, L);
    let first = a.seq();
    let first_entries = [(&b"k1"[..], loc(ra, 0, 1)), (&b"k2"[..], loc(ra, 1, 1))];
    let r1 = w.register_seq(&a, first, L, &first_entries).unwrap();
    assert_eq!(r1.body, vec![RegisterOutcome::Inserted; 2]);
    let second = a.seq();
    let second_entries = [(&b"k3"[..], loc(ra, 2, 1))];
    let r2 = w.register_seq(&a, second, L, &second_entries).unwrap();

    let before = w.dir.state_digest();
    assert_eq!(
        w.register_seq(&a, first, L, &first_entries).unwrap_err(),
        DirectoryError::ReplyEvicted { seq: first.seq }
    );
    assert_eq!(w.dir.state_digest(), before, "nothing ran again");
    let again = w.register_seq(&a, second, L, &second_entries).unwrap();
    assert_eq!(again.body, r2.body, "the newest reply is still cached");
    let o = w.dir.stats(w.now).outcomes;
    assert_eq!(
        (o.inserted, o.replies_evicted, o.retries_answered),
        (3, 1, 1)
    );
    w.dir.check_invariants().unwrap();
}

#[test]
fn hello_takes_over_an_instance_without_sessions_only_for_the_same_user() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let ra = w.region(&mut a, L);
    w.put(&mut a, b"k", loc(ra, 0, 1));
    assert!(matches!(
        w.dir.hello(
            Hello {
                instance: "a",
                quota_bytes: None
            },
            UNIX,
            w.now
        ),
        Err(DirectoryError::InstanceIdInUse { .. })
    ));
    w.dir.session_closed(a.session, w.now);
    let stranger = Peer::Unix {
        pid: 5,
        uid: 2000,
        gid: 2000,
    };
    assert!(matches!(
        w.dir.hello(
            Hello {
                instance: "a",
                quota_bytes: None
            },
            stranger,
            w.now
        ),
        Err(DirectoryError::InstanceIdInUse { .. })
    ));
    let a2 = w.hello("a");
    assert_ne!(a2.secret, a.secret);
    w.pool.service(&mut w.dir);
    // The old incarnation is gone: its region is orphaned, its key readable.
    assert_eq!(w.exists(&a2, &[b"k"]), vec![true]);
    assert_eq!(w.dir.stats(w.now).orphaned_regions, 1);
    w.dir.check_invariants().unwrap();
}

/// The probe a server installs says which processes may still run; here:
/// only pid 100 (`UNIX`'s).
fn only_pid_100_runs(pid: u32) -> bool {
    pid == 100
}

fn only_pid_200_runs(pid: u32) -> bool {
    pid == 200
}

fn nobody_runs(_pid: u32) -> bool {
    false
}

#[test]
fn with_a_holder_probe_hello_takes_over_only_once_every_other_holder_has_exited() {
    let hello = |w: &mut World, peer: Peer| {
        w.dir.hello(
            Hello {
                instance: "a",
                quota_bytes: None,
            },
            peer,
            w.now,
        )
    };
    let sibling = Peer::Unix {
        pid: 200,
        uid: 1000,
        gid: 1000,
    };
    // Held by pid 100, which still runs: its connection broke, but its
    // regions are mapped and its pages may still be written. Another
    // process of the same user is refused until the grace period ends.
    let mut w = World::new();
    w.dir.set_holder_probe(only_pid_100_runs);
    let mut a = w.hello("a");
    let ra = w.region(&mut a, L);
    w.put(&mut a, b"k", loc(ra, 0, 1));
    w.dir.session_closed(a.session, w.now);
    let before = w.dir.state_digest();
    assert!(matches!(
        hello(&mut w, sibling),
        Err(DirectoryError::InstanceIdInUse { .. })
    ));
    assert_eq!(w.dir.state_digest(), before, "refused, nothing changed");
    assert_eq!(w.pool.freed, vec![], "its region is not touched");
    // The holder itself may start over.
    let again = hello(&mut w, UNIX).expect("the holder's own process");
    assert_ne!(again.secret, a.secret);
    w.dir.check_invariants().unwrap();

    // Once every holder has exited, the sibling takes over at once.
    let mut w = World::new();
    w.dir.set_holder_probe(nobody_runs);
    let mut a = w.hello("a");
    w.region(&mut a, L);
    w.dir.session_closed(a.session, w.now);
    hello(&mut w, sibling).expect("the holder exited");
    w.pool.service(&mut w.dir);
    assert_eq!(w.dir.stats(w.now).orphaned_regions, 0, "returned, no keys");
    w.dir.check_invariants().unwrap();

    // Every process that held a session counts: pid 100 held it and
    // exited, 200 reattached and runs.
    let mut w = World::new();
    w.dir.set_holder_probe(only_pid_200_runs);
    let a = w.hello("a");
    let reattached = w
        .dir
        .reattach(
            Reattach {
                instance: "a",
                secret: a.secret,
                quota_bytes: None,
                next_seq: 1,
                notice_ack: 0,
                regions: &[],
            },
            sibling,
            w.now,
        )
        .unwrap();
    w.dir.session_closed(a.session, w.now);
    w.dir.session_closed(reattached.session, w.now);
    let third = Peer::Unix {
        pid: 300,
        uid: 1000,
        gid: 1000,
    };
    assert!(matches!(
        hello(&mut w, third),
        Err(DirectoryError::InstanceIdInUse { .. })
    ));
}

/// Pid 0 is what `SO_PEERCRED` reports for a peer in a pid namespace the
/// server cannot see: such a holder cannot be checked, and a requester
/// with pid 0 is not "the holder itself".
#[test]
fn with_a_holder_probe_a_holder_seen_as_pid_0_waits_out_its_grace_period() {
    let unseen = Peer::Unix {
        pid: 0,
        uid: 1000,
        gid: 1000,
    };
    let hello = |w: &mut World| {
        w.dir.hello(
            Hello {
                instance: "z",
                quota_bytes: None,
            },
            unseen,
            w.now,
        )
    };
    let mut w = World::new();
    w.dir.set_holder_probe(nobody_runs);
    let first = hello(&mut w).unwrap();
    w.dir.session_closed(first.session, w.now);
    assert!(matches!(
        hello(&mut w),
        Err(DirectoryError::InstanceIdInUse { .. })
    ));
    w.advance(Duration::from_secs(31));
    hello(&mut w).expect("a new instance after the grace period");
}

#[test]
fn with_a_holder_probe_an_instance_held_over_tcp_waits_out_its_grace_period() {
    let mut w = World::new();
    w.dir.set_holder_probe(nobody_runs);
    let tcp = Peer::Tcp {
        secret_matched: true,
    };
    let hello = |w: &mut World| {
        w.dir.hello(
            Hello {
                instance: "t",
                quota_bytes: None,
            },
            tcp,
            w.now,
        )
    };
    let first = hello(&mut w).unwrap();
    w.dir.session_closed(first.session, w.now);
    // No process to check on another host: refused within the grace period.
    assert!(matches!(
        hello(&mut w),
        Err(DirectoryError::InstanceIdInUse { .. })
    ));
    w.advance(Duration::from_secs(31));
    let second = hello(&mut w).expect("gone after its grace period: a new instance");
    assert_ne!(second.secret, first.secret);
    w.dir.check_invariants().unwrap();
}

#[test]
fn tcp_peers_need_the_client_secret_unless_disabled() {
    let mut w = World::new();
    let before = w.dir.state_digest();
    assert_eq!(
        w.dir
            .hello(
                Hello {
                    instance: "t",
                    quota_bytes: None
                },
                Peer::Tcp {
                    secret_matched: false
                },
                w.now
            )
            .unwrap_err(),
        DirectoryError::TcpSecretRequired
    );
    assert_eq!(w.dir.state_digest(), before);
    assert_eq!(w.dir.stats(w.now).sessions, 0);
    w.dir
        .hello(
            Hello {
                instance: "t",
                quota_bytes: None,
            },
            Peer::Tcp {
                secret_matched: true,
            },
            w.now,
        )
        .expect("a TCP peer with the secret is welcome");
    let stats = w.dir.stats(w.now);
    assert_eq!((stats.instances, stats.sessions), (1, 1));
    let mut open = World::with(DirectoryConfig {
        tcp_requires_secret: false,
        ..DirectoryConfig::default()
    });
    open.dir
        .hello(
            Hello {
                instance: "t",
                quota_bytes: None,
            },
            Peer::Tcp {
                secret_matched: false,
            },
            open.now,
        )
        .expect("with the requirement disabled, a TCP peer needs no secret");
    let stats = open.dir.stats(open.now);
    assert_eq!((stats.instances, stats.sessions), (1, 1));
}

// --- exactly-once -------------------------------------------------------------

#[test]
fn a_retried_request_gets_its_original_reply_without_running_again() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let mut b = w.hello("b");
    let ra = w.region(&mut a, L);

    // Register, reply dropped, retried: same reply, one key.
    let seq = a.seq();
    let first = w
        .register_seq(&a, seq, L, &[(b"k", loc(ra, 0, 1))])
        .unwrap();
    let again = w
        .register_seq(&a, seq, L, &[(b"k", loc(ra, 0, 1))])
        .unwrap();
    assert_eq!(first.body, again.body);
    assert_eq!(again.body, vec![RegisterOutcome::Inserted]);

    // A pinning lookup retried on its session: pins taken once.
    let seq = b.seq();
    let l1 = w
        .dir
        .lookup(&b.caller(), Some(seq), L, [&b"k"[..]], 1, w.now)
        .unwrap();
    let l2 = w
        .dir
        .lookup(&b.caller(), Some(seq), L, [&b"k"[..]], 1, w.now)
        .unwrap();
    assert_eq!(l1.body, l2.body);
    assert_eq!(w.dir.stats(w.now).pins, 1);

    // Unpin retried: released once (a second real unpin would say NotPinned).
    let seq = b.seq();
    let entries = [UnpinEntry {
        key: b"k",
        count: 1,
    }];
    let u1 = w.dir.unpin(&b.caller(), seq, L, entries, w.now).unwrap();
    let u2 = w.dir.unpin(&b.caller(), seq, L, entries, w.now).unwrap();
    assert_eq!(u1.body, vec![UnpinOutcome::Unpinned]);
    assert_eq!(u2.body, u1.body);

    // Delete retried after the key is gone: still "Deleted", not "Missing".
    let seq = b.seq();
    let d1 = w
        .dir
        .delete(&b.caller(), seq, L, [&b"k"[..]], w.now)
        .unwrap();
    let d2 = w
        .dir
        .delete(&b.caller(), seq, L, [&b"k"[..]], w.now)
        .unwrap();
    assert_eq!(d1.body, vec![DeleteOutcome::Deleted]);
    assert_eq!(d2.body, d1.body);
    assert_eq!(w.dir.stats(w.now).outcomes.retries_answered, 4);
    w.dir.check_invariants().unwrap();
}

#[test]
fn a_retry_after_reconnect_is_answered_on_the_new_session() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let ra = w.region(&mut a, L);
    let seq = a.seq();
    let first = w
        .register_seq(&a, seq, L, &[(b"k", loc(ra, 0, 1))])
        .unwrap();
    // The connection breaks before the reply arrives.
    w.dir.session_closed(a.session, w.now);
    let back = w
        .dir
        .reattach(
            Reattach {
                instance: "a",
                secret: a.secret,
                regions: &a.regions,
                next_seq: a.next_seq,
                notice_ack: 0,
                quota_bytes: None,
            },
            UNIX,
            w.now,
        )
        .unwrap();
    assert_eq!(back.kind, ReattachKind::Resumed);
    assert_eq!(back.regions, vec![RegionStatus::Confirmed]);
    a.session = back.session;
    let again = w
        .register_seq(&a, seq, L, &[(b"k", loc(ra, 0, 1))])
        .unwrap();
    assert_eq!(again.body, first.body);
    assert_eq!(w.dir.stats(w.now).keys, 1);
}

#[test]
fn a_region_request_retried_while_pending_or_after_the_grant_gets_the_same_region() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let seq = a.seq();
    let r1 = w
        .dir
        .request_region(&a.caller(), seq, L, REGION_BYTES, w.now)
        .unwrap();
    let r2 = w
        .dir
        .request_region(&a.caller(), seq, L, REGION_BYTES, w.now)
        .unwrap();
    let (RegionReply::Deferred(d1), RegionReply::Deferred(d2)) = (r1.body, r2.body) else {
        panic!("both deferred")
    };
    assert_ne!(d1, d2);
    let (done, _) = w.pool.service(&mut w.dir);
    assert_eq!(
        done.len(),
        2,
        "the original and its retry complete together"
    );
    let g = done[0].result.clone().unwrap().body;
    assert_eq!(done[1].result.clone().unwrap().body, g);
    let r3 = w
        .dir
        .request_region(&a.caller(), seq, L, REGION_BYTES, w.now)
        .unwrap();
    assert_eq!(r3.body, RegionReply::Granted(g));
    assert_eq!(w.pool.live.len(), 1, "one region allocated");
    assert_eq!(w.dir.stats(w.now).per_instance[0].owned_bytes, REGION_BYTES);
}

#[test]
fn a_pending_region_request_outlives_the_reply_cache_limit_so_its_grant_reaches_a_retry() {
    let mut w = newest_reply_only();
    let mut a = w.hello("a");
    let ra = w.region(&mut a, L);
    // A second region asked for; the pool manager has not answered yet.
    let pending = a.seq();
    let first = w
        .dir
        .request_region(&a.caller(), pending, L, REGION_BYTES, w.now)
        .unwrap();
    assert!(matches!(first.body, RegionReply::Deferred(_)));
    // Meanwhile the client pipelines registrations, whose replies overflow
    // the cache many times over.
    for page in 0..8u32 {
        let key = page.to_le_bytes();
        w.put(&mut a, &key, loc(ra, page, 1));
    }
    // The grant completes, but its reply is lost on the way (the completion
    // is dropped here, as a broken connection would).
    let (done, _) = w.pool.service(&mut w.dir);
    let granted = done[0].result.clone().unwrap().body;
    // The retry under the same number gets the region that was granted: no
    // `ReplyEvicted`, no region assigned that the client cannot name.
    let retry = w
        .dir
        .request_region(&a.caller(), pending, L, REGION_BYTES, w.now)
        .unwrap();
    assert_eq!(retry.body, RegionReply::Granted(granted));
    assert_eq!(w.pool.live.len(), 2, "no third region allocated");
    w.dir.check_invariants().unwrap();
}

/// Reliability entry 142: the grant's reply is lost and the client keeps
/// working before its retry gets through. It holds the request's number
/// back as its oldest unanswered one (`replies_received_below` stays at
/// it), so the replies of its later requests pile up behind the grant —
/// and the cache's byte limit used to evict the grant first, the oldest,
/// leaving the retry `ReplyEvicted` and the region the instance's with no
/// client knowing it.
#[test]
fn a_granted_region_reply_outlives_the_reply_cache_limit_until_the_client_has_it() {
    let mut w = newest_reply_only();
    let mut a = w.hello("a");
    let ra = w.region(&mut a, L);
    let asked = a.seq();
    let first = w
        .dir
        .request_region(&a.caller(), asked, L, REGION_BYTES, w.now)
        .unwrap();
    assert!(matches!(first.body, RegionReply::Deferred(_)));
    // Granted at once; the completion is dropped here, as a broken
    // connection would.
    let (done, _) = w.pool.service(&mut w.dir);
    let granted = done[0].result.clone().unwrap().body;
    // Then registrations, each saying it lacks the reply to `asked`.
    for page in 0..8u32 {
        let key = page.to_le_bytes();
        let seq = Sequence {
            replies_received_below: asked.seq,
            ..a.seq()
        };
        let r = w.register_seq(&a, seq, L, &[(&key, loc(ra, page, 1))]);
        assert_eq!(r.unwrap().body, vec![RegisterOutcome::Inserted]);
    }
    let retry = w
        .dir
        .request_region(&a.caller(), asked, L, REGION_BYTES, w.now)
        .unwrap();
    assert_eq!(retry.body, RegionReply::Granted(granted));
    assert_eq!(w.pool.live.len(), 2, "no third region allocated");
    // Once the client says it has the reply, the grant may go.
    let next = Sequence {
        replies_received_below: asked.seq + 1,
        ..a.seq()
    };
    let r = w.register_seq(&a, next, L, &[(&b"last"[..], loc(ra, 9, 1))]);
    assert_eq!(r.unwrap().body, vec![RegisterOutcome::Inserted]);
    assert_eq!(
        w.dir
            .request_region(&a.caller(), asked, L, REGION_BYTES, w.now)
            .unwrap_err(),
        DirectoryError::ReplyEvicted { seq: asked.seq }
    );
    w.dir.check_invariants().unwrap();
}

#[test]
fn a_failed_region_request_does_not_consume_its_sequence_number() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let seq = a.seq();
    w.pool.fail_next = true;
    w.dir
        .request_region(&a.caller(), seq, L, REGION_BYTES, w.now)
        .unwrap();
    let (done, _) = w.pool.service(&mut w.dir);
    assert!(matches!(
        done[0].result,
        Err(DirectoryError::RegionAllocationFailed { .. })
    ));
    let retry = w
        .dir
        .request_region(&a.caller(), seq, L, REGION_BYTES, w.now)
        .unwrap();
    assert!(matches!(retry.body, RegionReply::Deferred(_)));
    let (done, _) = w.pool.service(&mut w.dir);
    assert!(done[0].result.is_ok());
}

/// Found by a review of the directory: a region request's retry refused
/// because its request already had every waiter it may have was counted
/// in `retries_answered` all the same.
#[test]
fn a_region_request_retry_refused_for_want_of_waiters_is_not_counted_as_answered() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let seq = a.seq();
    let request = |w: &mut World, a: &Client| {
        w.dir
            .request_region(&a.caller(), seq, L, REGION_BYTES, w.now)
    };
    assert!(matches!(
        request(&mut w, &a).unwrap().body,
        RegionReply::Deferred(_)
    ));
    for _ in 0..7 {
        assert!(matches!(
            request(&mut w, &a).unwrap().body,
            RegionReply::Deferred(_)
        ));
    }
    assert_eq!(
        request(&mut w, &a).unwrap_err(),
        DirectoryError::TooManyPendingRegionRequests { max: 8 }
    );
    assert_eq!(w.dir.stats(w.now).outcomes.retries_answered, 7);
    let (done, _) = w.pool.service(&mut w.dir);
    assert_eq!(done.len(), 8, "the request and its seven retries");
    assert!(matches!(
        request(&mut w, &a).unwrap().body,
        RegionReply::Granted(_)
    ));
    assert_eq!(w.dir.stats(w.now).outcomes.retries_answered, 8);
}

#[test]
fn a_pinning_lookup_retried_on_another_session_is_refused() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let ra = w.region(&mut a, L);
    w.put(&mut a, b"k", loc(ra, 0, 1));
    let seq = a.seq();
    w.dir
        .lookup(&a.caller(), Some(seq), L, [&b"k"[..]], 1, w.now)
        .unwrap();
    let old = a.session;
    w.dir.session_closed(old, w.now);
    let back = w
        .dir
        .reattach(
            Reattach {
                instance: "a",
                secret: a.secret,
                regions: &a.regions,
                next_seq: a.next_seq,
                notice_ack: 0,
                quota_bytes: None,
            },
            UNIX,
            w.now,
        )
        .unwrap();
    a.session = back.session;
    assert_eq!(
        w.dir
            .lookup(&a.caller(), Some(seq), L, [&b"k"[..]], 1, w.now)
            .unwrap_err(),
        DirectoryError::PinsHeldByOtherSession {
            seq: seq.seq,
            original: old
        }
    );
    assert_eq!(w.dir.stats(w.now).pins, 0);
}

#[test]
fn sequence_numbers_out_of_the_window_or_reused_are_refused() {
    let mut w = World::with(DirectoryConfig {
        reply_window: 64,
        ..DirectoryConfig::default()
    });
    let mut a = w.hello("a");
    let ra = w.region(&mut a, L);
    let seq = Sequence {
        seq: 200,
        replies_received_below: 0,
    };
    w.register_seq(&a, seq, L, &[(b"k", loc(ra, 0, 1))])
        .unwrap();
    let before = w.dir.state_digest();
    let old = Sequence {
        seq: 100,
        replies_received_below: 0,
    };
    assert_eq!(
        w.register_seq(&a, old, L, &[(b"j", loc(ra, 1, 1))])
            .unwrap_err(),
        DirectoryError::SequenceTooOld {
            seq: 100,
            oldest_accepted: 137
        }
    );
    assert_eq!(
        w.register_seq(&a, seq, L, &[(b"j", loc(ra, 1, 1))])
            .unwrap_err(),
        DirectoryError::SequenceReused { seq: 200 }
    );
    // Out of order inside the window: runs.
    let late = Sequence {
        seq: 150,
        replies_received_below: 0,
    };
    assert_eq!(
        w.register_seq(&a, late, L, &[(b"j", loc(ra, 1, 1))])
            .unwrap()
            .body,
        vec![RegisterOutcome::Inserted]
    );
    assert_ne!(w.dir.state_digest(), before);
    let stats = w.dir.stats(w.now);
    assert_eq!(stats.outcomes.sequence_too_old, 1);
}

/// Found by the `directory_ops` fuzzer: a request numbered `u64::MAX` ran,
/// and the next request of the instance overflowed `high + 1` in the reply
/// window (a panic in debug builds, a wrapped window in release).
#[test]
fn sequence_numbers_beyond_the_range_are_refused_and_the_window_survives_the_top() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let ra = w.region(&mut a, L);
    let top = Sequence {
        seq: u64::MAX,
        replies_received_below: 0,
    };
    let before = w.dir.state_digest();
    assert_eq!(
        w.register_seq(&a, top, L, &[(b"k", loc(ra, 0, 1))])
            .unwrap_err(),
        DirectoryError::SequenceOutOfRange {
            field: "seq",
            value: u64::MAX,
            max: MAX_SEQUENCE
        }
    );
    assert_eq!(
        w.dir.state_digest(),
        before,
        "a refused request changes nothing"
    );
    let max = Sequence {
        seq: MAX_SEQUENCE,
        replies_received_below: 0,
    };
    let first = w
        .register_seq(&a, max, L, &[(b"k", loc(ra, 0, 1))])
        .unwrap();
    assert_eq!(first.body, vec![RegisterOutcome::Inserted]);
    let retry = w
        .register_seq(&a, max, L, &[(b"k", loc(ra, 0, 1))])
        .unwrap();
    assert_eq!(
        retry.body, first.body,
        "the top number is answered from the cache"
    );
    assert!(matches!(
        w.register_seq(&a, top, L, &[(b"j", loc(ra, 1, 1))]),
        Err(DirectoryError::SequenceOutOfRange { .. })
    ));
    w.dir.check_invariants().unwrap();

    w.dir.session_closed(a.session, w.now);
    for (next_seq, notice_ack, field) in [(u64::MAX, 0, "next_seq"), (1, u64::MAX, "notice_ack")] {
        let r = w.dir.reattach(
            Reattach {
                instance: "a",
                secret: a.secret,
                regions: &a.regions,
                next_seq,
                notice_ack,
                quota_bytes: None,
            },
            UNIX,
            w.now,
        );
        assert!(
            matches!(r, Err(DirectoryError::SequenceOutOfRange { field: f, .. }) if f == field),
            "{r:?}"
        );
    }
    w.dir.check_invariants().unwrap();
}

#[test]
fn mutations_without_a_sequence_number_are_refused() {
    let mut w = World::new();
    let a = w.hello("a");
    assert_eq!(
        w.dir
            .lookup(&a.caller(), None, L, [&b"k"[..]], 1, w.now)
            .unwrap_err(),
        DirectoryError::MissingSequence { op: OpKind::Lookup }
    );
    // Without pins a lookup is a plain read.
    w.dir
        .lookup(&a.caller(), None, L, [&b"k"[..]], 0, w.now)
        .unwrap();
}

// --- freed-page notices -------------------------------------------------------

#[test]
fn freed_page_notices_are_resent_until_acknowledged() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let mut b = w.hello("b");
    let ra = w.region(&mut a, L);
    w.put(&mut a, b"k1", loc(ra, 0, 1));
    w.put(&mut a, b"k2", loc(ra, 1, 3));
    // b deletes; its reply carries no notice for b (not the owner).
    let seq = b.seq();
    let r = w
        .dir
        .delete(&b.caller(), seq, L, [&b"k1"[..], b"k2"], w.now)
        .unwrap();
    assert!(r.notices.is_empty());
    // a's next reply carries both; the reply is "dropped"; the next one too.
    let first = w.dir.heartbeat(&a.caller(), w.now).unwrap().notices;
    let second = w.dir.heartbeat(&a.caller(), w.now).unwrap().notices;
    assert_eq!(first, second);
    let pages: Vec<(u64, u32, u32)> = first
        .iter()
        .map(|n| (n.seq, n.page.0, n.generation.0))
        .collect();
    assert_eq!(pages, vec![(1, 0, 1), (2, 1, 3)]);
    // a applies the first only and acknowledges it: the second stays.
    a.notice_ack = 1;
    let third = w.dir.heartbeat(&a.caller(), w.now).unwrap().notices;
    assert_eq!(third.iter().map(|n| n.seq).collect::<Vec<_>>(), vec![2]);
    a.notice_ack = 2;
    assert!(
        w.dir
            .heartbeat(&a.caller(), w.now)
            .unwrap()
            .notices
            .is_empty()
    );
    // An acknowledgement ahead of what was issued is refused.
    a.notice_ack = 3;
    assert_eq!(
        w.dir.heartbeat(&a.caller(), w.now).unwrap_err(),
        DirectoryError::NoticeAckAhead {
            ack: 3,
            highest_issued: 2
        }
    );
}

#[test]
fn notices_per_response_are_bounded_and_a_full_queue_refuses_deletes() {
    let mut w = World::with(DirectoryConfig {
        notices_per_response: 2,
        notice_queue_limit: 4,
        max_batch: 4,
        ..DirectoryConfig::default()
    });
    let mut a = w.hello("a");
    let mut b = w.hello("b");
    let ra = w.region(&mut a, L);
    let keys: Vec<Vec<u8>> = (0..6u8).map(|i| vec![b'k', i]).collect();
    for (i, k) in keys.iter().enumerate() {
        w.put(&mut a, k, loc(ra, i as u32, 1));
    }
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    assert_eq!(
        w.delete(&mut b, &refs[..3]),
        vec![DeleteOutcome::Deleted; 3]
    );
    assert_eq!(
        w.dir.heartbeat(&a.caller(), w.now).unwrap().notices.len(),
        2
    );
    let before = w.dir.state_digest();
    let seq = b.seq();
    assert!(matches!(
        w.dir
            .delete(&b.caller(), seq, L, refs[3..5].iter().copied(), w.now),
        Err(DirectoryError::NoticeBacklog {
            pending: 3,
            max: 4,
            ..
        })
    ));
    assert_eq!(w.dir.state_digest(), before);
    a.notice_ack = 3;
    w.dir.heartbeat(&a.caller(), w.now).unwrap();
    assert_eq!(
        w.delete(&mut b, &refs[3..5]),
        vec![DeleteOutcome::Deleted; 2]
    );
}

#[test]
fn a_gone_owner_gets_no_notices_and_its_pages_die_with_the_region() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let mut b = w.hello("b");
    let ra = w.region(&mut a, L);
    w.put(&mut a, b"k", loc(ra, 0, 1));
    w.dir.session_closed(a.session, w.now);
    w.keep_alive(&b);
    w.advance(Duration::from_secs(31));
    assert_eq!(w.delete(&mut b, &[b"k"]), vec![DeleteOutcome::Deleted]);
    assert_eq!(w.dir.stats(w.now).outcomes.notices_issued, 0);
    w.pool.service(&mut w.dir);
    assert_eq!(w.pool.freed, vec![ra]);
}

// --- capacity -------------------------------------------------------------------

#[test]
fn the_quota_counts_region_bytes_owned_and_pending() {
    let mut w = World::new();
    let h = w
        .dir
        .hello(
            Hello {
                instance: "q",
                quota_bytes: Some(REGION_BYTES * 2),
            },
            UNIX,
            w.now,
        )
        .unwrap();
    assert_eq!(h.quota_bytes, Some(REGION_BYTES * 2));
    let mut q = Client {
        name: "q".into(),
        session: h.session,
        secret: h.secret,
        next_seq: 1,
        notice_ack: 0,
        regions: Vec::new(),
    };
    w.region(&mut q, L);
    let seq = q.seq();
    // Pending (not yet granted) bytes count too.
    w.dir
        .request_region(&q.caller(), seq, L, REGION_BYTES, w.now)
        .unwrap();
    let refused = q.seq();
    let before = w.dir.state_digest();
    assert_eq!(
        w.dir
            .request_region(&q.caller(), refused, L, REGION_BYTES, w.now)
            .unwrap_err(),
        DirectoryError::QuotaExceeded {
            quota_bytes: REGION_BYTES * 2,
            owned_bytes: REGION_BYTES * 2,
            requested_bytes: REGION_BYTES
        }
    );
    assert_eq!(w.dir.state_digest(), before, "a refusal changes nothing");
    assert_eq!(
        w.pool.service(&mut w.dir).0.len(),
        1,
        "only the pending request reaches the pool manager"
    );
    let r = q.regions[0].handle.region;
    let seq = q.seq();
    w.dir.return_region(&q.caller(), seq, r, w.now).unwrap();
    w.pool.service(&mut w.dir);
    assert_eq!(w.pool.freed, vec![r]);
    // The refused number did not run: retried now that there is room, it runs.
    let reply = w
        .dir
        .request_region(&q.caller(), refused, L, REGION_BYTES, w.now)
        .unwrap();
    assert!(matches!(reply.body, RegionReply::Deferred(_)));
    let (done, _) = w.pool.service(&mut w.dir);
    assert!(done[0].result.is_ok());
    w.dir.check_invariants().unwrap();
}

/// The pool rounds a request up to its alignment: the quota is a hard
/// limit on what is granted, not on what was asked for, however many
/// requests were let through at their smaller size.
#[test]
fn a_grant_rounded_up_past_the_quota_is_given_back_and_refused() {
    let mut w = World::new();
    w.pool.round_to = 2 * REGION_BYTES;
    let h = w
        .dir
        .hello(
            Hello {
                instance: "q",
                quota_bytes: Some(REGION_BYTES * 3),
            },
            UNIX,
            w.now,
        )
        .unwrap();
    let mut q = Client {
        name: "q".into(),
        session: h.session,
        secret: h.secret,
        next_seq: 1,
        notice_ack: 0,
        regions: Vec::new(),
    };
    // Three requests of one region each pass the quota as asked...
    for _ in 0..3 {
        let seq = q.seq();
        let reply = w
            .dir
            .request_region(&q.caller(), seq, L, REGION_BYTES, w.now)
            .unwrap();
        assert!(matches!(reply.body, RegionReply::Deferred(_)));
    }
    // ... each is granted two: the first fits, the others would not.
    let (done, _) = w.pool.service(&mut w.dir);
    let results: Vec<_> = done.iter().map(|c| c.result.clone().map(|_| ())).collect();
    let over = Err(DirectoryError::QuotaExceeded {
        quota_bytes: REGION_BYTES * 3,
        owned_bytes: REGION_BYTES * 2,
        requested_bytes: REGION_BYTES * 2,
    });
    assert_eq!(results, vec![Ok(()), over.clone(), over]);
    let stats = w.dir.stats(w.now);
    assert_eq!(stats.per_instance[0].owned_bytes, REGION_BYTES * 2);
    assert_eq!(w.pool.live.len(), 1, "the refused grants went back");
    w.dir.check_invariants().unwrap();
}

#[test]
fn a_server_maximum_caps_every_quota() {
    let mut w = World::with(DirectoryConfig {
        max_instance_quota_bytes: Some(REGION_BYTES),
        ..DirectoryConfig::default()
    });
    let greedy = w
        .dir
        .hello(
            Hello {
                instance: "g",
                quota_bytes: Some(u64::MAX),
            },
            UNIX,
            w.now,
        )
        .unwrap();
    assert_eq!(greedy.quota_bytes, Some(REGION_BYTES));
    let silent = w
        .dir
        .hello(
            Hello {
                instance: "s",
                quota_bytes: None,
            },
            UNIX,
            w.now,
        )
        .unwrap();
    assert_eq!(silent.quota_bytes, Some(REGION_BYTES));
}

#[test]
fn return_region_refuses_regions_with_keys_or_of_others() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let mut b = w.hello("b");
    let ra = w.region(&mut a, L);
    w.put(&mut a, b"k", loc(ra, 0, 1));
    let seq = a.seq();
    assert_eq!(
        w.dir
            .return_region(&a.caller(), seq, ra, w.now)
            .unwrap_err(),
        DirectoryError::RegionNotEmpty {
            region: ra,
            keys: 1
        }
    );
    let seq = b.seq();
    assert_eq!(
        w.dir
            .return_region(&b.caller(), seq, ra, w.now)
            .unwrap_err(),
        DirectoryError::NotRegionOwner { region: ra }
    );
    let seq = b.seq();
    assert_eq!(
        w.dir
            .return_region(&b.caller(), seq, RegionId(999), w.now)
            .unwrap_err(),
        DirectoryError::UnknownRegion {
            region: RegionId(999)
        }
    );
}

#[test]
fn max_layouts_bounds_the_layouts_in_use_and_a_layout_is_forgotten_with_its_last_region() {
    let layout = |fingerprint| Layout {
        page_size_bytes: 4096,
        fingerprint,
    };
    let mut w = World::with(DirectoryConfig {
        max_layouts: 2,
        ..DirectoryConfig::default()
    });
    let mut a = w.hello("a");
    let r1 = w.region(&mut a, layout(1));
    let r2 = w.region(&mut a, layout(2));
    let refused = |w: &mut World, a: &mut Client, l| {
        let seq = a.seq();
        w.dir
            .request_region(&a.caller(), seq, l, REGION_BYTES, w.now)
            .map(|_| ())
            .unwrap_err()
    };
    assert_eq!(
        refused(&mut w, &mut a, layout(3)),
        DirectoryError::TooManyLayouts { max: 2 }
    );
    let put = |w: &mut World, a: &mut Client, l, at| {
        let seq = a.seq();
        let r = w.register_seq(a, seq, l, &[(b"k", at)]).unwrap();
        assert_eq!(r.body, vec![RegisterOutcome::Inserted]);
    };
    put(&mut w, &mut a, layout(1), loc(r1, 0, 1));
    assert_eq!(w.dir.stats(w.now).layouts, 2);

    // Layout 2's only region goes back: the layout no longer counts.
    let seq = a.seq();
    w.dir.return_region(&a.caller(), seq, r2, w.now).unwrap();
    w.pool.service(&mut w.dir);
    assert_eq!(w.dir.stats(w.now).layouts, 1);
    w.dir.check_invariants().unwrap();
    let r3 = w.region(&mut a, layout(3));
    assert_eq!(w.dir.stats(w.now).layouts, 2);

    // A request the pool manager refuses releases its layout too.
    let seq = a.seq();
    w.dir.return_region(&a.caller(), seq, r3, w.now).unwrap();
    w.pool.fail_next = true;
    let seq = a.seq();
    w.dir
        .request_region(&a.caller(), seq, layout(4), REGION_BYTES, w.now)
        .unwrap();
    let (done, _) = w.pool.service(&mut w.dir);
    assert!(matches!(
        done[0].result,
        Err(DirectoryError::RegionAllocationFailed { .. })
    ));
    assert_eq!(w.dir.stats(w.now).layouts, 1);
    w.dir.check_invariants().unwrap();
    let r5 = w.region(&mut a, layout(5));

    // Reused indexes keep keys apart: layout 1's key is found under it
    // only, and a key under layout 5 is another key.
    put(&mut w, &mut a, layout(5), loc(r5, 0, 1));
    let found = |w: &mut World, l| {
        w.dir
            .exists(&a.caller(), l, [&b"k"[..]], w.now)
            .unwrap()
            .body
    };
    assert_eq!(found(&mut w, layout(1)), vec![true]);
    assert_eq!(found(&mut w, layout(2)), vec![false]);
    assert_eq!(found(&mut w, layout(5)), vec![true]);
    assert_eq!(w.dir.stats(w.now).keys, 2);
    w.dir.check_invariants().unwrap();
}

fn eviction_world(lru: bool) -> World {
    World::with(DirectoryConfig {
        eviction: EvictionConfig {
            lru,
            max_evictions_per_tick: 3,
            ..EvictionConfig::default()
        },
        ..DirectoryConfig::default()
    })
}

#[test]
fn orphaned_keys_are_evicted_above_the_watermark_but_never_from_a_region_with_a_pinned_key() {
    let mut w = eviction_world(false);
    let mut a = w.hello("a");
    let mut b = w.hello("b");
    let old = w.region(&mut a, L);
    let young = w.region(&mut a, L);
    for p in 0..4 {
        w.put(&mut a, &[b'o', p as u8], loc(old, p, 1));
        w.put(&mut a, &[b'y', p as u8], loc(young, p, 1));
    }
    w.lookup_pin(&mut b, &[b"o\x02"], 1);
    w.dir.session_closed(a.session, w.now);
    w.keep_alive(&b);
    w.advance(Duration::from_secs(31));
    assert_eq!(w.dir.stats(w.now).orphaned_regions, 2);
    // Below the watermark nothing is evicted.
    w.dir
        .pool_usage(POOL, 100 * REGION_BYTES, 50 * REGION_BYTES);
    w.advance(Duration::from_millis(100));
    assert_eq!(w.dir.stats(w.now).keys, 8);
    // Above it, keys go, 3 per tick, oldest orphan first; but the oldest
    // holds a pinned key, so none of its keys can free its bytes: it waits,
    // whole, and the younger region goes first.
    w.dir.pool_usage(POOL, 10 * REGION_BYTES, 0);
    w.advance(Duration::from_millis(100));
    assert_eq!(w.dir.stats(w.now).evictions.orphan_keys, 3);
    let olds: [&[u8]; 4] = [b"o\x00", b"o\x01", b"o\x02", b"o\x03"];
    assert_eq!(
        w.exists(&b, &olds),
        vec![true; 4],
        "a region with a pinned key keeps every key"
    );
    let youngs: [&[u8]; 4] = [b"y\x00", b"y\x01", b"y\x02", b"y\x03"];
    assert_eq!(
        w.exists(&b, &youngs).iter().filter(|&&k| k).count(),
        1,
        "three of the younger region's keys went"
    );
    w.advance(Duration::from_millis(100));
    w.advance(Duration::from_millis(100));
    let stats = w.dir.stats(w.now);
    assert_eq!(stats.keys, 4, "the pinned region's keys, all of them");
    assert_eq!(stats.evictions.orphan_keys, 4);
    assert_eq!(
        w.pool.freed,
        vec![young],
        "the region with a pinned key stays"
    );
    assert_eq!(
        w.unpin(&mut b, &[(b"o\x02", 1)]),
        vec![UnpinOutcome::Unpinned]
    );
    // Unpinned, it is an ordinary orphan again: 3 keys, then the last one
    // and the region.
    w.advance(Duration::from_millis(100));
    assert_eq!(w.dir.stats(w.now).keys, 1);
    w.advance(Duration::from_millis(100));
    assert_eq!(w.dir.stats(w.now).keys, 0);
    assert_eq!(w.pool.freed, vec![young, old]);
    w.dir.check_invariants().unwrap();
}

/// A region the pool manager refused for want of space starts orphan
/// eviction below the high watermark, as crossing it does: a pool whose
/// regions are large beside it (a 128 MiB pool of 16 MiB regions) cannot
/// fit one more at 88.9 % fill, under the 90 % mark, and new instances
/// were refused while orphaned keys held the space (found by a review
/// playing an SRE, session 34). Eviction still stops at the low mark.
#[test]
fn a_region_refused_for_want_of_space_starts_orphan_eviction_below_the_watermark() {
    let (mut w, b, regions) = orphaned_regions(3);
    // 85 % full: above the low mark, below the high one.
    w.dir.pool_usage(POOL, 20 * REGION_BYTES, 3 * REGION_BYTES);
    w.advance(Duration::from_millis(100));
    assert_eq!(w.dir.stats(w.now).keys, 3, "below the watermark: nothing");
    w.dir.region_refused_for_space();
    w.advance(Duration::from_millis(100));
    // One region freed brings it to 80 %, the low mark: eviction stops.
    assert_eq!(w.pool.freed, vec![regions[0]]);
    w.advance(Duration::from_millis(100));
    let keys: [&[u8]; 3] = [b"k\x00", b"k\x01", b"k\x02"];
    assert_eq!(w.exists(&b, &keys), vec![false, true, true]);
    assert_eq!(w.dir.stats(w.now).evictions.orphan_keys, 1);
    w.dir.check_invariants().unwrap();
}

/// An eviction world where instance "a" wrote `keys_each` keys (`x…` and
/// `y…`) into each of two regions, then went: both regions orphaned, the
/// first older. Returns the world, a live client "b" and the first region.
fn two_orphaned_regions(keys_each: u32) -> (World, Client, RegionId) {
    let mut w = eviction_world(false);
    let mut a = w.hello("a");
    let b = w.hello("b");
    let first = w.region(&mut a, L);
    let second = w.region(&mut a, L);
    for p in 0..keys_each {
        w.put(&mut a, &[b'x', p as u8], loc(first, p, 1));
        w.put(&mut a, &[b'y', p as u8], loc(second, p, 1));
    }
    w.dir.session_closed(a.session, w.now);
    w.keep_alive(&b);
    w.advance(Duration::from_secs(31));
    assert_eq!(w.dir.stats(w.now).orphaned_regions, 2);
    (w, b, first)
}

/// Found by a review of the directory (session 22): a periodic pool report
/// replaced the directory's count of the bytes it had freed since the last
/// one, including frees sent after the report was asked for — which the
/// report cannot know about. Until the next report the pools looked fuller
/// than they were, and orphan eviction went on below the low watermark,
/// evicting readable keys for nothing. A report now applies as of its
/// mark: the frees sent after it stay counted.
#[test]
fn a_pool_report_asked_for_before_a_free_does_not_undo_it() {
    let (mut w, b, first) = two_orphaned_regions(2);
    // 92 % full: one region freed brings it to 72 %, under the low mark.
    let (total, free) = (5 * REGION_BYTES, 2 * REGION_BYTES / 5);
    w.dir.pool_usage(POOL, total, free);
    // A report is asked for now; before its answer, a tick evicts the first
    // region and sends its free.
    let mark = w.dir.pool_report_mark();
    w.advance(Duration::from_millis(100));
    assert_eq!(w.pool.freed, vec![first]);
    // The answer counts the pool as it was when asked.
    w.dir.pool_usage_as_of(&mark, POOL, total, free);
    w.advance(Duration::from_millis(100));
    w.advance(Duration::from_millis(100));
    let seconds: [&[u8]; 2] = [b"y\x00", b"y\x01"];
    assert_eq!(
        w.exists(&b, &seconds),
        vec![true; 2],
        "nothing more is evicted: the free is still counted"
    );
    assert_eq!(w.pool.freed, vec![first]);
    // A report asked for after the free counts it itself.
    let mark = w.dir.pool_report_mark();
    w.dir
        .pool_usage_as_of(&mark, POOL, total, free + REGION_BYTES);
    w.advance(Duration::from_millis(100));
    assert_eq!(w.dir.stats(w.now).keys, 2);
    w.dir.check_invariants().unwrap();
}

/// A region whose keys outnumber a tick's budget is finished first on the
/// next tick: rotating to the next orphan instead would take a bite out of
/// every orphaned region (readable keys lost) before freeing any.
#[test]
fn orphan_eviction_finishes_the_region_it_started_before_touching_the_next() {
    let (mut w, b, first) = two_orphaned_regions(4);
    // 95 % full; one region freed brings it to 75 %, under the low mark.
    w.dir.pool_usage(POOL, 5 * REGION_BYTES, REGION_BYTES / 4);
    w.advance(Duration::from_millis(100));
    assert_eq!(w.dir.stats(w.now).evictions.orphan_keys, 3);
    w.advance(Duration::from_millis(100));
    assert_eq!(w.pool.freed, vec![first], "the started region is finished");
    let seconds: [&[u8]; 4] = [b"y\x00", b"y\x01", b"y\x02", b"y\x03"];
    assert_eq!(
        w.exists(&b, &seconds),
        vec![true; 4],
        "the next region keeps every key: freeing the first was enough"
    );
    let stats = w.dir.stats(w.now);
    assert_eq!((stats.evictions.orphan_keys, stats.keys), (4, 4));
    w.advance(Duration::from_millis(100));
    assert_eq!(
        w.dir.stats(w.now).keys,
        4,
        "under the low mark, eviction stops"
    );
    w.dir.check_invariants().unwrap();
}

/// An eviction world where instance "a" registered key `k<i>` in each of
/// `n` regions and is gone (its regions orphaned, oldest first); "b", kept
/// alive, is returned to act on them.
fn orphaned_regions(n: usize) -> (World, Client, Vec<RegionId>) {
    let mut w = eviction_world(false);
    let mut a = w.hello("a");
    let b = w.hello("b");
    let regions: Vec<RegionId> = (0..n).map(|_| w.region(&mut a, L)).collect();
    for (i, &r) in regions.iter().enumerate() {
        w.put(&mut a, &[b'k', i as u8], loc(r, 0, 1));
    }
    w.dir.session_closed(a.session, w.now);
    w.keep_alive(&b);
    w.advance(Duration::from_secs(31));
    (w, b, regions)
}

/// Orphaned regions emptied by deletes leave the others' eviction order as
/// it was (their queue entries are dropped lazily, never scanned for).
#[test]
fn orphaned_regions_freed_by_deletes_leave_the_eviction_order_of_the_others() {
    let (mut w, mut b, regions) = orphaned_regions(10);
    assert_eq!(w.dir.stats(w.now).orphaned_regions, 10);
    // Every other region emptied by a delete, and then two more: more
    // stale entries than live ones at the end, so the queue is compacted.
    for i in [0u8, 2, 4, 6, 8, 1, 3] {
        assert_eq!(
            w.delete(&mut b, &[&[b'k', i]]),
            vec![DeleteOutcome::Deleted]
        );
        w.dir.check_invariants().unwrap();
    }
    w.pool.service(&mut w.dir);
    let mut freed = [0, 2, 4, 6, 8, 1, 3].map(|i| regions[i]).to_vec();
    assert_eq!(w.pool.freed, freed);
    assert_eq!(w.dir.stats(w.now).orphaned_regions, 3);
    // Eviction takes what is left, oldest orphan first.
    w.dir.pool_usage(POOL, 100 * REGION_BYTES, 0);
    w.advance(Duration::from_millis(100));
    freed.extend([5, 7, 9].map(|i| regions[i]));
    assert_eq!(w.pool.freed, freed);
    w.dir.check_invariants().unwrap();
}

/// A stale entry behind live ones: eviction freeing the live ones leaves
/// the queue to stale entries only, which are dropped (the queue holds at
/// most twice the orphaned regions) and end the eviction round.
#[test]
fn eviction_that_frees_the_live_orphans_drops_the_stale_entries_behind_them() {
    let (mut w, mut b, regions) = orphaned_regions(2);
    assert_eq!(w.delete(&mut b, &[b"k\x01"]), vec![DeleteOutcome::Deleted]);
    w.dir.check_invariants().unwrap();
    w.dir.pool_usage(POOL, 100 * REGION_BYTES, 0);
    w.advance(Duration::from_millis(100));
    w.dir.check_invariants().unwrap();
    assert_eq!(w.pool.freed, vec![regions[1], regions[0]]);
    assert_eq!(w.dir.stats(w.now).orphaned_regions, 0);
}

#[test]
fn lru_eviction_takes_the_least_recent_unpinned_keys_and_notifies_owners() {
    let mut w = eviction_world(true);
    let mut a = w.hello("a");
    let keys = w.fill_a_region(&mut a);
    // Key 0 is pinned, key 1 recently used: neither may go first.
    w.lookup_pin(&mut a, &[&keys[0]], 1);
    w.dir
        .lookup(&a.caller(), None, L, [&keys[1][..]], 0, w.now)
        .unwrap();
    w.dir.pool_usage(POOL, REGION_BYTES, 0);
    w.advance(Duration::from_millis(100));
    assert_eq!(w.dir.stats(w.now).evictions.lru_keys, 3);
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    let present = w.exists(&a, &refs);
    assert_eq!(&present[..5], &[true, true, false, false, false]);
    // Fill falls to 59/64 < 95 % but stays above 90 %: eviction continues.
    w.advance(Duration::from_millis(100));
    w.advance(Duration::from_millis(100));
    let stats = w.dir.stats(w.now);
    assert_eq!(stats.keys, 57, "down to 90 % (57.6 pages)");
    assert_eq!(w.exists(&a, &[&keys[0], &keys[1]]), vec![true, true]);
    let notices = w.dir.heartbeat(&a.caller(), w.now).unwrap().notices;
    assert_eq!(notices.len(), 5, "the owner gets its pages back");
    w.dir.check_invariants().unwrap();
}

/// Found by a review of the directory: once the LRU had started under pool
/// pressure it went on evicting live keys after the pressure was gone, down
/// to `lru_low_fill`, since only the regions' fill could stop it; orphan
/// eviction stops at the pools' low watermark. Both stop there now.
#[test]
fn lru_eviction_stops_once_the_pools_are_down_to_the_low_watermark() {
    let mut w = eviction_world(true);
    let mut a = w.hello("a");
    let keys = w.fill_a_region(&mut a);
    let keys_region = a.regions[0].handle.region;
    w.dir.pool_usage(POOL, REGION_BYTES, 0);
    w.advance(Duration::from_millis(100));
    assert_eq!(w.dir.stats(w.now).evictions.lru_keys, 3);
    // Another instance gave regions back: the pools are half empty. The
    // regions are still over 90 % full (59 of 64 pages), but nothing more
    // is evicted.
    w.dir.pool_usage(POOL, 10 * REGION_BYTES, 5 * REGION_BYTES);
    for _ in 0..3 {
        w.advance(Duration::from_millis(100));
    }
    let stats = w.dir.stats(w.now);
    assert_eq!((stats.evictions.lru_keys, stats.keys), (3, 59));
    // Pressure again, and the regions over 95 % again: the LRU starts
    // again and goes down to 90 %.
    w.dir.pool_usage(POOL, REGION_BYTES, 0);
    for page in 62..64u32 {
        w.put(&mut a, &page.to_le_bytes(), loc(keys_region, page, 1));
    }
    w.advance(Duration::from_millis(100));
    w.advance(Duration::from_millis(100));
    let stats = w.dir.stats(w.now);
    assert_eq!((stats.evictions.lru_keys, stats.keys), (7, 57));
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    let mut expected = vec![false; 7];
    expected.push(true);
    assert_eq!(w.exists(&a, &refs[..8]), expected);
    w.dir.check_invariants().unwrap();
}

impl World {
    /// A region of `len_bytes` for `layout`, granted to `c`.
    fn region_sized(&mut self, c: &mut Client, layout: Layout, len_bytes: u64) -> RegionId {
        let handle = self.grant(c, layout, len_bytes);
        assert_eq!(handle.len_bytes, len_bytes);
        handle.region
    }
}

/// Found by a review of the directory (session 26), the twin of entry 74:
/// the LRU's region fill divided the registered pages' bytes by the whole
/// length of the held regions, tails past their last whole page included,
/// which can never hold a key. The client sizes a region
/// `round_up(max(64 MiB, page), 2 MiB)`, so a region full of 14 MiB pages
/// (4 of them in 64 MiB) read 0.875 and one of a 36 MiB page 0.5625: under
/// the default `lru_high_fill` of 0.95, the LRU never started however full
/// the pools. The fill is now over the pages the regions can hold: full
/// regions read 1, the LRU starts, and it stops at `lru_low_fill`.
#[test]
fn lru_eviction_starts_and_stops_at_its_fills_when_the_page_size_does_not_divide_the_region() {
    for page_mib in [14u64, 36] {
        let layout = Layout {
            page_size_bytes: page_mib << 20,
            fingerprint: page_mib,
        };
        let region_bytes = 64 << 20;
        let per_region = region_bytes / layout.page_size_bytes;
        assert_ne!(region_bytes % layout.page_size_bytes, 0);
        let mut w = eviction_world(true);
        let mut a = w.hello("a");
        // 20 pages registered, every page the regions can hold.
        let regions: Vec<RegionId> = (0..20 / per_region)
            .map(|_| w.region_sized(&mut a, layout, region_bytes))
            .collect();
        let mut keys = Vec::new();
        for &r in &regions {
            for page in 0..per_region as u32 {
                let key = format!("{}-{page}", r.0).into_bytes();
                let seq = a.seq();
                let reply = w
                    .register_seq(&a, seq, layout, &[(&key, loc(r, page, 1))])
                    .unwrap();
                assert_eq!(reply.body, vec![RegisterOutcome::Inserted]);
                keys.push(key);
            }
        }
        assert_eq!(keys.len(), 20);
        // Pools full: evicting a live owner's key frees none of them, so
        // only the regions' fill stops the LRU.
        w.dir.pool_usage(POOL, 100 * region_bytes, 0);
        w.advance(Duration::from_millis(100));
        let stats = w.dir.stats(w.now);
        assert_eq!(
            (stats.evictions.lru_keys, stats.keys),
            (2, 18),
            "{page_mib} MiB pages: full regions start the LRU, which stops at 18 of 20 pages (lru_low_fill 0.90)"
        );
        let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
        let found = |w: &mut World| -> Vec<bool> {
            w.dir
                .exists(&a.caller(), layout, refs.iter().copied(), w.now)
                .unwrap()
                .body
        };
        let mut expected = vec![true; 20];
        expected[..2].fill(false);
        assert_eq!(found(&mut w), expected, "the two least recent went");
        w.advance(Duration::from_millis(100));
        assert_eq!(w.dir.stats(w.now).evictions.lru_keys, 2, "stopped");
        // One more page registered: 19 of 20 is `lru_high_fill` again.
        let seq = a.seq();
        let key = b"again".as_slice();
        let reply = w
            .register_seq(&a, seq, layout, &[(key, loc(regions[0], 0, 2))])
            .unwrap();
        assert_eq!(reply.body, vec![RegisterOutcome::Inserted]);
        w.advance(Duration::from_millis(100));
        w.advance(Duration::from_millis(100));
        let stats = w.dir.stats(w.now);
        assert_eq!((stats.evictions.lru_keys, stats.keys), (3, 18));
        w.dir.check_invariants().unwrap();
    }
}

/// Found by a review of the directory (session 26): an orphaned region
/// holding a pinned key went to the back of the queue at no cost to the
/// tick's budget, so a tick walked every such region — with many orphaned
/// regions each holding one pinned key, every 100 ms tick visited all of
/// them, for as long as the pins lasted. A tick now passes over at most
/// `max_evictions_per_tick` of them besides the first in line (which keeps
/// its place), and the next tick goes on from there.
#[test]
fn a_tick_passes_over_at_most_its_budget_of_orphaned_regions_holding_a_pin() {
    let (mut w, mut b, regions) = orphaned_regions(11);
    // Every region but the youngest holds a key pinned by b.
    for i in 0..10u8 {
        assert!(w.lookup_pin(&mut b, &[&[b'k', i]], 1)[0].is_some());
    }
    w.dir.pool_usage(POOL, 100 * REGION_BYTES, 0);
    // The first in line and 3 more a tick: the ten pinned regions take
    // three ticks (1 + 3 + 3 + 3), and the youngest comes up in the fourth.
    for tick in 1..=3 {
        w.advance(Duration::from_millis(100));
        assert!(
            w.pool.freed.is_empty(),
            "tick {tick} walked past more pinned regions than its budget"
        );
    }
    w.advance(Duration::from_millis(100));
    assert_eq!(w.pool.freed, vec![regions[10]]);
    assert_eq!(w.dir.stats(w.now).evictions.orphan_keys, 1);
    w.dir.check_invariants().unwrap();
}

/// Found by a review of the directory (session 26): a region whose
/// eviction the budget cut short stays first in line, but if one of its
/// keys was pinned before the next tick it went to the back of the queue,
/// behind every other orphaned region. The regions after it were evicted
/// in its stead, and once the pools were down to the low watermark it
/// stayed as it was: readable keys lost, its bytes never freed. It now
/// keeps its place while pinned (the tick goes on past it) and is finished
/// first once the pin goes.
#[test]
fn a_partly_evicted_region_pinned_between_ticks_is_finished_first_once_unpinned() {
    let mut w = eviction_world(false);
    let mut a = w.hello("a");
    let mut b = w.hello("b");
    let started = w.region(&mut a, L);
    let next = w.region(&mut a, L);
    let last = w.region(&mut a, L);
    for p in 0..4u8 {
        w.put(&mut a, &[b's', p], loc(started, u32::from(p), 1));
    }
    for p in 0..2u8 {
        w.put(&mut a, &[b'n', p], loc(next, u32::from(p), 1));
        w.put(&mut a, &[b'l', p], loc(last, u32::from(p), 1));
    }
    w.dir.session_closed(a.session, w.now);
    w.keep_alive(&b);
    w.advance(Duration::from_secs(31));
    assert_eq!(w.dir.stats(w.now).orphaned_regions, 3);
    // 95 % full; one region freed brings it to 75 %, under the low mark.
    let (total, free) = (5 * REGION_BYTES, REGION_BYTES / 4);
    w.dir.pool_usage(POOL, total, free);
    w.advance(Duration::from_millis(100));
    let starts: [&[u8]; 4] = [b"s\x00", b"s\x01", b"s\x02", b"s\x03"];
    let present = w.exists(&b, &starts);
    assert_eq!(present.iter().filter(|&&k| k).count(), 1, "3 evicted");
    let left = starts[present.iter().position(|&k| k).unwrap()];
    // A reader pins the started region's last key: its bytes cannot come
    // back, so the next region is evicted instead.
    assert!(w.lookup_pin(&mut b, &[left], 1)[0].is_some());
    w.advance(Duration::from_millis(100));
    assert_eq!(w.pool.freed, vec![next]);
    // The pin goes, and the pools fill again: the started region is
    // finished, and the last one keeps every key.
    assert_eq!(w.unpin(&mut b, &[(left, 1)]), vec![UnpinOutcome::Unpinned]);
    w.dir.pool_usage(POOL, total, free);
    w.advance(Duration::from_millis(100));
    assert_eq!(w.pool.freed, vec![next, started]);
    assert_eq!(w.exists(&b, &[b"l\x00", b"l\x01"]), vec![true, true]);
    assert_eq!(w.dir.stats(w.now).evictions.orphan_keys, 6);
    w.dir.check_invariants().unwrap();
}

impl World {
    /// `c` applies every freed-page notice queued for it and acknowledges
    /// them.
    fn ack_notices(&mut self, c: &mut Client) {
        let notices = self.dir.heartbeat(&c.caller(), self.now).unwrap().notices;
        if let Some(last) = notices.iter().map(|n| n.seq).max() {
            c.notice_ack = last;
        }
        let left = self.dir.heartbeat(&c.caller(), self.now).unwrap().notices;
        assert!(left.is_empty(), "more than one response's worth");
    }
}

/// Found by a review of the directory: a key the LRU passed over because
/// its owner's notice queue was full was moved to the most-recent end (and
/// cost a unit of the tick's budget), so a stalled owner's cold keys were
/// ranked above everyone's recently used ones. They keep their place now,
/// and the round goes on past them.
#[test]
fn keys_of_an_owner_whose_notice_queue_is_full_keep_their_lru_place() {
    let mut w = World::with(DirectoryConfig {
        max_batch: 8,
        notice_queue_limit: 8,
        eviction: EvictionConfig {
            lru: true,
            max_evictions_per_tick: 3,
            lru_high_fill: 0.14,
            lru_low_fill: 0.10,
            ..EvictionConfig::default()
        },
        ..DirectoryConfig::default()
    });
    let mut s = w.hello("stalled");
    let mut h = w.hello("healthy");
    let rs = w.region(&mut s, L);
    let rh = w.region(&mut h, L);
    let key = |c: u8, i: u8| vec![c, i];
    for i in 0..14u8 {
        w.put(&mut s, &key(b's', i), loc(rs, u32::from(i), 1));
    }
    for i in 0..12u8 {
        w.put(&mut h, &key(b'h', i), loc(rh, u32::from(i), 1));
    }
    // h deletes eight of s's keys: s's notice queue is full (s does not
    // acknowledge), and s's six coldest keys stay, more than a tick may
    // pass over.
    let gone: Vec<Vec<u8>> = (6..14).map(|i| key(b's', i)).collect();
    let gone: Vec<&[u8]> = gone.iter().map(|k| &k[..]).collect();
    assert!(
        w.delete(&mut h, &gone)
            .iter()
            .all(|o| *o == DeleteOutcome::Deleted)
    );
    // h uses four of its keys: least to most recent now s0..s5, h4..h11,
    // h0..h3 (18 keys of 128 pages: 14 %).
    let recent: Vec<Vec<u8>> = (0..4).map(|i| key(b'h', i)).collect();
    let recent: Vec<&[u8]> = recent.iter().map(|k| &k[..]).collect();
    w.dir
        .lookup(&h.caller(), None, L, recent.iter().copied(), 0, w.now)
        .unwrap();
    let s_keys: Vec<Vec<u8>> = (0..6).map(|i| key(b's', i)).collect();
    let s_keys: Vec<&[u8]> = s_keys.iter().map(|k| &k[..]).collect();

    // Round one: down to 10 % (12 keys). s's keys are passed over — three
    // a tick, the next tick going on from where the last stopped — and
    // h's least recent ones go.
    w.dir.pool_usage(POOL, 2 * REGION_BYTES, 0);
    w.advance(Duration::from_millis(100));
    let e = w.dir.stats(w.now).evictions;
    assert_eq!((e.lru_keys, e.lru_skipped), (0, 3));
    for _ in 0..5 {
        w.advance(Duration::from_millis(100));
    }
    let e = w.dir.stats(w.now).evictions;
    assert_eq!(e.lru_keys, 6);
    assert_eq!(e.lru_skipped, 6, "each passed over once");
    assert_eq!(w.exists(&h, &s_keys), vec![true; 6]);
    assert_eq!(w.exists(&h, &recent), vec![true; 4]);
    let cold: Vec<Vec<u8>> = (4..10).map(|i| key(b'h', i)).collect();
    let cold: Vec<&[u8]> = cold.iter().map(|k| &k[..]).collect();
    assert_eq!(w.exists(&h, &cold), vec![false; 6]);

    // s catches up; h writes six new keys (18 again). Round two takes the
    // six least recent: s's, which were never used after h's four.
    w.ack_notices(&mut s);
    w.ack_notices(&mut h);
    for i in 12..18u8 {
        w.put(&mut h, &key(b'h', i), loc(rh, u32::from(i), 1));
    }
    for _ in 0..3 {
        w.advance(Duration::from_millis(100));
    }
    let stats = w.dir.stats(w.now);
    assert_eq!((stats.evictions.lru_keys, stats.keys), (12, 12));
    assert_eq!(w.exists(&h, &s_keys), vec![false; 6]);
    assert_eq!(
        w.exists(&h, &recent),
        vec![true; 4],
        "h's recently used keys outrank s's cold ones"
    );
    w.dir.check_invariants().unwrap();
}

// --- restart --------------------------------------------------------------------

#[test]
fn after_a_restart_owners_reattach_with_tokens_and_reregister_and_strays_are_freed() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let mut gone = w.hello("gone");
    let ra1 = w.region(&mut a, L);
    let ra2 = w.region(&mut a, L);
    let rg = w.region(&mut gone, L);
    w.put(&mut a, b"k", loc(ra1, 0, 1));
    w.put(&mut gone, b"g", loc(rg, 0, 1));

    // The directory restarts; the pool manager still holds the regions.
    let recovered: Vec<RecoveredRegion> = [(&a, ra1), (&a, ra2), (&gone, rg)]
        .iter()
        .map(|(c, r)| RecoveredRegion {
            handle: w.pool.live[r],
            owner: InstanceId::new(&c.name).unwrap(),
        })
        .collect();
    w.dir = Directory::recover(DirectoryConfig::default(), [8; 32], w.now, recovered).unwrap();
    w.dir.check_invariants().unwrap();

    // Someone else cannot claim "a" with a name alone...
    assert!(matches!(
        w.dir.hello(
            Hello {
                instance: "a",
                quota_bytes: None
            },
            UNIX,
            w.now
        ),
        Err(DirectoryError::InstanceIdInUse { .. })
    ));
    let forged = PresentedRegion {
        handle: RegionHandle {
            token: RegionToken([0xEE; 32]),
            ..w.pool.live[&ra1]
        },
        layout: L,
    };
    assert!(matches!(
        w.dir.reattach(
            Reattach {
                instance: "a",
                secret: a.secret,
                regions: &[forged],
                next_seq: 1,
                notice_ack: 0,
                quota_bytes: None
            },
            UNIX,
            w.now
        ),
        Err(DirectoryError::OwnershipNotProven { .. })
    ));
    // ...but a presents its tokens (it kept only ra1 in mind).
    let back = w
        .dir
        .reattach(
            Reattach {
                instance: "a",
                secret: a.secret,
                regions: &a.regions[..1],
                next_seq: a.next_seq,
                notice_ack: a.notice_ack,
                quota_bytes: None,
            },
            UNIX,
            w.now,
        )
        .unwrap();
    assert_eq!(back.kind, ReattachKind::Recovered);
    assert_eq!(back.regions, vec![RegionStatus::Confirmed]);
    assert_eq!(back.oldest_accepted_seq, a.next_seq);
    a.session = back.session;
    w.keep_alive(&a);
    let (_, _) = w.pool.service(&mut w.dir);
    assert_eq!(
        w.pool.freed,
        vec![ra2],
        "the region a did not present is freed"
    );
    // Requests sent to the previous incarnation are void.
    let stale = Sequence {
        seq: a.next_seq - 1,
        replies_received_below: 0,
    };
    assert!(matches!(
        w.register_seq(&a, stale, L, &[(b"k", loc(ra1, 0, 1))]),
        Err(DirectoryError::SequenceTooOld { .. })
    ));
    w.put(&mut a, b"k", loc(ra1, 0, 1));
    assert_eq!(w.exists(&a, &[b"k", b"g"]), vec![true, false]);

    // "gone" never comes back: its region is freed after the grace period.
    w.advance(Duration::from_secs(31));
    assert_eq!(w.pool.freed, vec![ra2, rg]);
    w.dir.check_invariants().unwrap();
}

/// The rule the client relies on when a region grant's reply was lost in a
/// restart (docs/reliability.md, defect 4): holding no token, it cannot
/// claim the recovered region and nothing moves; once the grace period has
/// returned the region to the pool, the same token-less reattach starts the
/// instance afresh, owning nothing.
#[test]
fn a_token_less_reattach_is_refused_until_the_grace_period_frees_the_recovered_regions() {
    let mut w = World::new();
    let mut lost = w.hello("lost");
    let granted = w.region(&mut lost, L);
    // The grant's reply never reached the client: it knows no token.
    lost.regions.clear();
    let recovered = vec![RecoveredRegion {
        handle: w.pool.live[&granted],
        owner: InstanceId::new("lost").unwrap(),
    }];
    w.dir = Directory::recover(DirectoryConfig::default(), [8; 32], w.now, recovered).unwrap();
    let token_less = |w: &mut World| {
        w.dir.reattach(
            Reattach {
                instance: "lost",
                secret: lost.secret,
                regions: &[],
                next_seq: lost.next_seq,
                notice_ack: 0,
                quota_bytes: None,
            },
            UNIX,
            w.now,
        )
    };
    let before = w.dir.state_digest();
    assert!(matches!(
        token_less(&mut w),
        Err(DirectoryError::OwnershipNotProven { .. })
    ));
    assert_eq!(
        w.dir.state_digest(),
        before,
        "nothing claimed, nothing freed"
    );
    assert!(w.pool.freed.is_empty());

    w.advance(Duration::from_secs(31));
    assert_eq!(w.pool.freed, vec![granted], "the grace period freed it");
    let back = token_less(&mut w).unwrap();
    assert_eq!(back.kind, ReattachKind::Recovered);
    assert!(back.regions.is_empty());
    assert_eq!(back.oldest_accepted_seq, lost.next_seq);
    assert_eq!(back.usage.owned_bytes, 0);
    w.dir.check_invariants().unwrap();
}

/// Found by a review of the fuzz targets (session 31): after a restart, a
/// pool manager's grant of a region id that an instance still holds
/// unclaimed was accepted — the directory checked only the regions it had
/// recorded — so that instance's reattach then recorded the id a second
/// time (a debug assertion; in release, two records of one region). A real
/// pool manager never grants a live id twice, but the directory refuses a
/// grant it knows to be wrong: now such a grant is refused like one of an
/// assigned region, nothing is freed, and the owner still claims its region.
#[test]
fn a_grant_of_a_region_held_unclaimed_since_a_restart_is_refused_and_its_owner_keeps_it() {
    let mut w = World::new();
    let mut alpha = w.hello("alpha");
    let ra = w.region(&mut alpha, L);
    let handle = w.pool.live[&ra];
    let recovered = vec![RecoveredRegion {
        handle,
        owner: InstanceId::new("alpha").unwrap(),
    }];
    w.dir = Directory::recover(DirectoryConfig::default(), [8; 32], w.now, recovered).unwrap();

    // beta asks for a region; the (faulty) pool manager grants alpha's id.
    let mut beta = w.hello("beta");
    let done = w.granted_as(&mut beta, handle);
    assert_eq!(done.len(), 1);
    assert!(
        matches!(
            &done[0].result,
            Err(DirectoryError::RegionAllocationFailed { reason }) if reason.contains("already assigned")
        ),
        "{:?}",
        done[0].result
    );
    assert_eq!(
        w.dir.drain_effects().count(),
        0,
        "the id is alpha's: not freed"
    );
    w.dir.check_invariants().unwrap();

    let back = w.reattach_presenting_all(&alpha).unwrap();
    assert_eq!(back.kind, ReattachKind::Recovered);
    assert_eq!(back.regions, vec![RegionStatus::Confirmed]);
    w.dir.check_invariants().unwrap();
    // Claimed: a grant of the id is still refused (it is recorded now).
    let done = w.granted_as(&mut beta, handle);
    assert!(done[0].result.is_err());
    w.dir.check_invariants().unwrap();
}

/// Found by the same review as reliability entry 172 (session 31): the
/// directory refused a grant of a region id it holds, but not one whose
/// new id covers the bytes of a region it holds — what a pool manager that
/// reclaimed that region behind the directory's back grants next — so two
/// instances owned one extent. Now a grant overlapping a recorded region,
/// or one held unclaimed since a restart, is refused and not freed; one
/// beside them is granted.
#[test]
fn a_grant_overlapping_the_bytes_of_a_held_region_is_refused() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let ra = w.region(&mut a, L);
    w.put(&mut a, b"k", loc(ra, 0, 1));
    let held = w.pool.live[&ra];
    let mut b = w.hello("b");
    let with_id = |id: u64, offset_bytes: u64| RegionHandle {
        region: RegionId(id),
        token: RegionToken([id as u8; 32]),
        offset_bytes,
        ..held
    };
    let refused = |done: &[cxlkv_controlplane::directory::Completion]| {
        matches!(
            &done[0].result,
            Err(DirectoryError::RegionAllocationFailed { reason }) if reason.contains("overlaps region")
        )
    };
    // The same bytes, and a range starting inside them.
    for grant in [
        with_id(999, held.offset_bytes),
        with_id(998, held.offset_bytes + held.len_bytes / 2),
    ] {
        let done = w.granted_as(&mut b, grant);
        assert!(refused(&done), "{grant:?}: {:?}", done[0].result);
        assert_eq!(w.dir.drain_effects().count(), 0, "not freed");
        w.dir.check_invariants().unwrap();
    }
    // Right after them: granted.
    let beside = with_id(997, held.offset_bytes + held.len_bytes);
    w.pool.live.insert(beside.region, beside);
    assert!(w.granted_as(&mut b, beside)[0].result.is_ok());
    w.dir.check_invariants().unwrap();

    // After a restart, the bytes of a region held unclaimed.
    let recovered = vec![RecoveredRegion {
        handle: held,
        owner: InstanceId::new("a").unwrap(),
    }];
    w.dir = Directory::recover(DirectoryConfig::default(), [8; 32], w.now, recovered).unwrap();
    let mut c = w.hello("c");
    let done = w.granted_as(&mut c, with_id(996, held.offset_bytes));
    assert!(refused(&done), "{:?}", done[0].result);
    w.dir.check_invariants().unwrap();
}

/// A reattach that recovers an instance (it had expired, or the directory
/// restarted) answers `Recovered`; if that answer is lost, the client's next
/// reattach finds the instance and would be told `Resumed` — as if its keys,
/// regions and reply cache had survived. Until a session of the recovered
/// instance has made a request (proof that its client read a `Recovered`),
/// every reattach answers `Recovered` again; after one, `Resumed`.
#[test]
fn a_recovery_is_answered_as_one_again_until_a_session_of_the_instance_makes_a_request() {
    let reattach = |w: &mut World, c: &Client| w.reattach_presenting_all(c).unwrap();
    // Expired: the connection broke and the grace period passed.
    let mut w = World::new();
    let mut a = w.hello("a");
    let ra = w.region(&mut a, L);
    w.put(&mut a, b"k", loc(ra, 0, 1));
    w.dir.session_closed(a.session, w.now);
    w.advance(Duration::from_secs(31));
    let first = reattach(&mut w, &a);
    assert_eq!(first.kind, ReattachKind::Recovered);
    assert_eq!(first.regions, vec![RegionStatus::NotOwned]);
    // Its answer is lost with the connection; the client, not knowing,
    // has numbered a few more requests (none reached the directory).
    w.dir.session_closed(first.session, w.now);
    a.next_seq += 5;
    let again = reattach(&mut w, &a);
    assert_eq!(again.kind, ReattachKind::Recovered, "told again");
    assert_eq!(again.regions, vec![RegionStatus::NotOwned]);
    assert_eq!(
        again.oldest_accepted_seq, first.oldest_accepted_seq,
        "the first recovery's floor"
    );
    a.session = again.session;
    a.regions.clear();
    assert_eq!(w.exists(&a, &[b"k"]), vec![true], "the orphaned key stays");
    w.dir.session_closed(a.session, w.now);
    assert_eq!(reattach(&mut w, &a).kind, ReattachKind::Resumed);
    w.dir.check_invariants().unwrap();

    // Restarted: the first reattach claims the recovered region.
    let mut w = World::new();
    let mut b = w.hello("b");
    let rb = w.region(&mut b, L);
    let recovered = vec![RecoveredRegion {
        handle: w.pool.live[&rb],
        owner: InstanceId::new("b").unwrap(),
    }];
    w.dir = Directory::recover(DirectoryConfig::default(), [8; 32], w.now, recovered).unwrap();
    let first = reattach(&mut w, &b);
    assert_eq!(first.kind, ReattachKind::Recovered);
    assert_eq!(first.regions, vec![RegionStatus::Confirmed]);
    w.dir.session_closed(first.session, w.now);
    let again = reattach(&mut w, &b);
    assert_eq!(again.kind, ReattachKind::Recovered, "told again");
    assert_eq!(
        again.regions,
        vec![RegionStatus::Confirmed],
        "the region the lost answer confirmed is still the instance's"
    );
    b.session = again.session;
    w.dir
        .heartbeat(
            &Caller {
                session: b.session,
                notice_ack: 0,
            },
            w.now,
        )
        .unwrap();
    w.dir.session_closed(b.session, w.now);
    let resumed = reattach(&mut w, &b);
    assert_eq!(resumed.kind, ReattachKind::Resumed);
    assert_eq!(resumed.regions, vec![RegionStatus::Confirmed]);
    w.dir.check_invariants().unwrap();
}

#[test]
fn reattach_with_a_wrong_secret_is_refused_and_changes_nothing() {
    let mut w = World::new();
    let mut a = w.hello("a");
    w.region(&mut a, L);
    let before = w.dir.state_digest();
    let mut wrong = a.secret;
    wrong.0[0] ^= 1;
    assert!(matches!(
        w.dir.reattach(
            Reattach {
                instance: "a",
                secret: wrong,
                regions: &a.regions,
                next_seq: 1,
                notice_ack: 0,
                quota_bytes: None
            },
            UNIX,
            w.now
        ),
        Err(DirectoryError::SecretMismatch { .. })
    ));
    assert_eq!(w.dir.state_digest(), before);
}

// --- review findings on reattach (docs/security.md) -------------------------------

/// A peer of another user than `UNIX`'s.
const OTHER_USER: Peer = Peer::Unix {
    pid: 200,
    uid: 2000,
    gid: 2000,
};

/// A secret nobody was given.
const GUESSED: cxlkv_controlplane::directory::InstanceSecret =
    cxlkv_controlplane::directory::InstanceSecret([0x5a; 32]);

/// Review finding, not a defect: "a TCP `Reattach`'s region list is looked
/// at before the pre-shared client secret is checked". The peer is the
/// first thing checked: a list over the length bound, with a bad layout and
/// duplicates, naming a live instance with a bad `next_seq`, from a TCP
/// peer without the secret is refused `TcpSecretRequired` and changes
/// nothing; with the secret, the same list is refused for its length before
/// any region in it is looked at.
#[test]
fn an_unauthenticated_tcp_reattach_is_refused_before_its_region_list_is_looked_at() {
    let mut w = World::with(DirectoryConfig {
        max_regions_per_instance: 4,
        ..DirectoryConfig::default()
    });
    let mut a = w.hello("a");
    w.region(&mut a, L);
    let real = a.regions[0];
    let bad_layout = PresentedRegion {
        handle: real.handle,
        layout: Layout {
            page_size_bytes: 0,
            fingerprint: 0,
        },
    };
    let list = vec![bad_layout, real, real, real, real, real];
    let reattach = |w: &mut World, secret_matched| {
        w.dir.reattach(
            Reattach {
                instance: "a",
                secret: a.secret,
                regions: &list,
                next_seq: 0,
                notice_ack: u64::MAX,
                quota_bytes: None,
            },
            Peer::Tcp { secret_matched },
            w.now,
        )
    };
    let before = w.dir.state_digest();
    assert_eq!(
        reattach(&mut w, false).unwrap_err(),
        DirectoryError::TcpSecretRequired
    );
    assert_eq!(w.dir.state_digest(), before, "nothing changed");
    assert_eq!(
        reattach(&mut w, true).unwrap_err(),
        DirectoryError::TooManyReattachRegions { count: 6, max: 4 },
        "the list is bounded before its entries are looked at"
    );
    assert_eq!(w.dir.state_digest(), before);
    w.dir.check_invariants().unwrap();
}

/// Review finding, not a defect: "a `Reattach` naming another instance —
/// another user's, or one it never held — takes it over or blocks its
/// name". Without the instance's secret, a reattach of a live instance or
/// of one in its grace period is `SecretMismatch` whoever sends it (another
/// user, the same user, an authenticated TCP peer) and changes nothing: no
/// session, no holder recorded, the grace period still running; the owner
/// resumes with everything. (The secret is the proof a reattach needs; a
/// name nobody holds is first come, as for `Hello`: docs/security.md.)
#[test]
fn a_reattach_without_the_instances_secret_neither_takes_over_nor_blocks_its_name() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let ra = w.region(&mut a, L);
    w.put(&mut a, b"k", loc(ra, 0, 1));
    let squat = |w: &mut World, peer| {
        w.dir.reattach(
            Reattach {
                instance: "a",
                secret: GUESSED,
                regions: &a.regions,
                next_seq: 1,
                notice_ack: 0,
                quota_bytes: None,
            },
            peer,
            w.now,
        )
    };
    for when in ["live", "in its grace period"] {
        if when != "live" {
            w.dir.session_closed(a.session, w.now);
        }
        for peer in [
            OTHER_USER,
            UNIX,
            Peer::Tcp {
                secret_matched: true,
            },
        ] {
            let before = w.dir.state_digest();
            assert!(
                matches!(
                    squat(&mut w, peer),
                    Err(DirectoryError::SecretMismatch { .. })
                ),
                "{when}, {peer:?}"
            );
            assert_eq!(w.dir.state_digest(), before, "{when}, {peer:?}");
        }
    }
    let back = w
        .dir
        .reattach(
            Reattach {
                instance: "a",
                secret: a.secret,
                regions: &a.regions,
                next_seq: a.next_seq,
                notice_ack: 0,
                quota_bytes: None,
            },
            UNIX,
            w.now,
        )
        .unwrap();
    assert_eq!(back.kind, ReattachKind::Resumed);
    assert_eq!(back.regions, vec![RegionStatus::Confirmed]);
    a.session = back.session;
    assert_eq!(w.exists(&a, &[b"k"]), vec![true]);
    w.dir.check_invariants().unwrap();
}

/// Review finding, not a defect: "after an instance expired, a `Reattach`
/// naming it with any secret resurrects it and claims its regions with
/// their tokens". It starts an instance of that name afresh (documented:
/// like a `Hello` of a name not in use) that owns nothing: the expired
/// instance's region, presented with its genuine token by another user, is
/// refused; it stays orphaned — its key readable, registering into it and
/// returning it refused — and is freed when its last key is deleted. The
/// old owner, back with its old secret, is refused (`SecretMismatch`): the
/// name went to whoever came first, as a `Hello` would have given it.
#[test]
fn a_reattach_of_an_expired_instances_name_with_any_secret_claims_none_of_its_regions() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let ra = w.region(&mut a, L);
    w.put(&mut a, b"k", loc(ra, 0, 1));
    w.dir.session_closed(a.session, w.now);
    w.advance(Duration::from_secs(31));
    assert_eq!(w.dir.stats(w.now).orphaned_regions, 1);
    let resurrect = |w: &mut World, secret, peer| {
        w.dir.reattach(
            Reattach {
                instance: "a",
                secret,
                regions: &a.regions,
                next_seq: 1,
                notice_ack: 0,
                quota_bytes: None,
            },
            peer,
            w.now,
        )
    };
    let r = resurrect(&mut w, GUESSED, OTHER_USER).unwrap();
    assert_eq!(r.kind, ReattachKind::Recovered);
    assert_eq!(
        r.regions,
        vec![RegionStatus::NotOwned],
        "the token claims nothing"
    );
    assert_eq!(r.usage.owned_bytes, 0);
    let mut s = Client {
        name: "a".to_owned(),
        session: r.session,
        secret: GUESSED,
        next_seq: 1,
        notice_ack: 0,
        regions: Vec::new(),
    };
    assert_eq!(w.dir.stats(w.now).orphaned_regions, 1, "still orphaned");
    let out = w.register(&mut s, &[(b"x", loc(ra, 1, 1))]).unwrap().body;
    assert_eq!(
        out,
        vec![RegisterOutcome::Rejected(RejectReason::NotOwner {
            region: ra
        })]
    );
    let seq = s.seq();
    assert!(matches!(
        w.dir.return_region(&s.caller(), seq, ra, w.now),
        Err(DirectoryError::NotRegionOwner { .. })
    ));
    assert_eq!(w.exists(&s, &[b"k"]), vec![true], "the orphaned key stays");
    assert!(matches!(
        resurrect(&mut w, a.secret, UNIX),
        Err(DirectoryError::SecretMismatch { .. })
    ));
    assert_eq!(w.delete(&mut s, &[b"k"]), vec![DeleteOutcome::Deleted]);
    w.pool.service(&mut w.dir);
    assert_eq!(w.pool.freed, vec![ra], "freed with its last key");
    w.dir.check_invariants().unwrap();
}

/// Review finding, not a defect: "a request parked on the pool manager
/// holds its instance's sequence window, so the instance's other mutating
/// requests are refused or stall". The window never waits: a region request
/// pending at the pool manager holds only its own number (and its cached
/// body, so that a retry gets the grant). The instance's other mutating
/// requests run meanwhile on any of its sessions, even past the window's
/// width (a client breaking its side of the contract: the pending number is
/// then too old to retry), and the late grant lands as the instance's
/// region without upsetting anything.
#[test]
fn a_region_request_pending_at_the_pool_manager_does_not_hold_the_sequence_window() {
    let mut w = World::with(DirectoryConfig {
        reply_window: 64,
        ..DirectoryConfig::default()
    });
    let mut a = w.hello("a");
    w.region(&mut a, L);
    let pending = a.seq();
    let first = w
        .dir
        .request_region(&a.caller(), pending, L, REGION_BYTES, w.now)
        .unwrap();
    assert!(matches!(first.body, RegionReply::Deferred(_)));
    // The pool manager does not answer yet.
    let held: Vec<Effect> = w.dir.drain_effects().collect();
    let [Effect::AllocateRegion { request, .. }] = held[..] else {
        panic!("one allocation asked for: {held:?}")
    };
    let second = w
        .dir
        .reattach(
            Reattach {
                instance: "a",
                secret: a.secret,
                regions: &a.regions,
                next_seq: a.next_seq,
                notice_ack: 0,
                quota_bytes: None,
            },
            UNIX,
            w.now,
        )
        .unwrap();
    let sessions = [a.session, second.session];
    let mutate = |w: &mut World, a: &mut Client, i: usize| {
        a.session = sessions[i % 2];
        assert_eq!(w.delete(a, &[b"absent"]), vec![DeleteOutcome::Missing]);
    };
    for i in 0..10 {
        mutate(&mut w, &mut a, i);
    }
    let retry = w
        .dir
        .request_region(&a.caller(), pending, L, REGION_BYTES, w.now)
        .unwrap();
    assert!(
        matches!(retry.body, RegionReply::Deferred(_)),
        "a retry inside the window joins the pending request"
    );
    for i in 10..2 * 64 {
        mutate(&mut w, &mut a, i);
    }
    assert!(matches!(
        w.dir
            .request_region(&a.caller(), pending, L, REGION_BYTES, w.now),
        Err(DirectoryError::SequenceTooOld { .. })
    ));
    let handle = RegionHandle {
        region: RegionId(99),
        pool: POOL,
        offset_bytes: 99 << 30,
        len_bytes: REGION_BYTES,
        token: RegionToken([99; 32]),
    };
    w.pool.live.insert(handle.region, handle);
    let done = w.dir.region_allocated(request, Ok(handle));
    assert_eq!(done.len(), 2, "the original and the retry that joined it");
    assert!(done.iter().all(|c| c.result.is_ok()));
    assert_eq!(
        w.dir.stats(w.now).per_instance[0].owned_bytes,
        2 * REGION_BYTES
    );
    mutate(&mut w, &mut a, 0);
    w.dir.check_invariants().unwrap();
}

// --- bad input --------------------------------------------------------------------

/// The bad-input tests' world: client "a" with a region under `L` and key
/// `k` registered in its page 0.
fn one_key_world(config: DirectoryConfig) -> (World, Client, RegionId) {
    let mut w = World::with(config);
    let mut a = w.hello("a");
    let ra = w.region(&mut a, L);
    w.put(&mut a, b"k", loc(ra, 0, 1));
    (w, a, ra)
}

/// `a`'s next sequence number, not consumed (a refused request must leave
/// it usable).
fn unused_seq(a: &Client) -> Sequence {
    Sequence {
        seq: a.next_seq,
        replies_received_below: 0,
    }
}

#[test]
fn bad_input_is_refused_with_its_error_and_changes_no_state() {
    let (mut w, a, ra) = one_key_world(DirectoryConfig {
        max_batch: 8,
        ..DirectoryConfig::default()
    });
    let before = w.dir.state_digest();
    let (c, s) = (a.caller(), unused_seq(&a));
    let long = vec![0u8; 513];
    let nine: Vec<&[u8]> = vec![b"k"; 9];
    let nine_keys: Vec<Vec<u8>> = (0..9).map(|i| format!("new-{i}").into_bytes()).collect();
    let bad_layout = Layout {
        page_size_bytes: 1000,
        fingerprint: 0,
    };
    let cases: Vec<(&str, DirectoryError, Result<(), DirectoryError>)> = vec![
        (
            "unknown region",
            DirectoryError::UnknownRegion {
                region: RegionId(77),
            },
            w.register_seq(
                &a,
                s,
                L,
                &[(b"n", loc(ra, 1, 1)), (b"m", loc(RegionId(77), 0, 1))],
            )
            .map(drop),
        ),
        (
            "oversized key",
            DirectoryError::KeyLength {
                index: 1,
                len_bytes: 513,
                max_bytes: 512,
            },
            w.dir
                .lookup(&c, Some(s), L, [&b"k"[..], &long], 1, w.now)
                .map(drop),
        ),
        (
            "empty key",
            DirectoryError::KeyLength {
                index: 0,
                len_bytes: 0,
                max_bytes: 512,
            },
            w.dir.delete(&c, s, L, [&b""[..]], w.now).map(drop),
        ),
        (
            "batch over limit",
            DirectoryError::BatchTooLarge { len: 9, max: 8 },
            w.dir.exists(&c, L, nine.iter().copied(), w.now).map(drop),
        ),
        // The same limit on the requests that change state: refused before
        // any entry is applied (a register of nine good entries, a pinning
        // lookup and a delete of nine keys, one of them registered).
        (
            "register batch over limit",
            DirectoryError::BatchTooLarge { len: 9, max: 8 },
            w.register_seq(
                &a,
                s,
                L,
                &nine_keys
                    .iter()
                    .enumerate()
                    .map(|(i, k)| (&k[..], loc(ra, i as u32 + 1, 1)))
                    .collect::<Vec<_>>(),
            )
            .map(drop),
        ),
        (
            "pinning lookup batch over limit",
            DirectoryError::BatchTooLarge { len: 9, max: 8 },
            w.dir
                .lookup(&c, Some(s), L, nine.iter().copied(), 1, w.now)
                .map(drop),
        ),
        (
            "delete batch over limit",
            DirectoryError::BatchTooLarge { len: 9, max: 8 },
            w.dir
                .delete(&c, s, L, nine.iter().copied(), w.now)
                .map(drop),
        ),
        (
            "invalid layout",
            DirectoryError::InvalidLayout {
                page_size_bytes: 1000,
                max_bytes: 1 << 30,
            },
            w.dir
                .delete(&c, s, bad_layout, [&b"k"[..]], w.now)
                .map(drop),
        ),
        (
            "too many pins",
            DirectoryError::InvalidPinCount {
                pins: 5000,
                max: 1024,
            },
            w.dir
                .lookup(&c, Some(s), L, [&b"k"[..]], 5000, w.now)
                .map(drop),
        ),
        (
            "unpin of zero",
            DirectoryError::InvalidUnpinCount { index: 0 },
            w.dir
                .unpin(
                    &c,
                    s,
                    L,
                    [UnpinEntry {
                        key: b"k",
                        count: 0,
                    }],
                    w.now,
                )
                .map(drop),
        ),
        (
            "unknown session",
            DirectoryError::UnknownSession {
                session: SessionId(4242),
            },
            w.dir
                .delete(
                    &Caller {
                        session: SessionId(4242),
                        notice_ack: 0,
                    },
                    s,
                    L,
                    [&b"k"[..]],
                    w.now,
                )
                .map(drop),
        ),
        (
            "region too small",
            DirectoryError::InvalidRegionLength {
                len_bytes: 100,
                page_size_bytes: 4096,
                max_bytes: 1 << 40,
            },
            w.dir.request_region(&c, s, L, 100, w.now).map(drop),
        ),
        (
            "bad instance id",
            DirectoryError::InvalidInstanceId {
                len_bytes: 0,
                max_bytes: 128,
            },
            w.dir
                .hello(
                    Hello {
                        instance: "",
                        quota_bytes: None,
                    },
                    UNIX,
                    w.now,
                )
                .map(drop),
        ),
    ];
    for (what, expected, got) in cases {
        assert_eq!(got, Err(expected), "{what}");
    }
    assert!(w.dir.drain_effects().next().is_none());
    assert_eq!(
        w.dir.state_digest(),
        before,
        "refused requests changed state"
    );
    // The sequence number was not consumed: it still works.
    assert_eq!(
        w.register_seq(&a, s, L, &[(b"n", loc(ra, 1, 1))])
            .unwrap()
            .body,
        vec![RegisterOutcome::Inserted]
    );
    let stats = w.dir.stats(w.now);
    let errors: u64 = stats.ops.iter().map(|o| o.counters.errors).sum();
    assert_eq!(errors, 13);
}

/// A key of bad length is found in the pass that hashes the keys, on every
/// path that takes keys: under a layout in use and one never used, with and
/// without pins. The error names the first bad key, and the keys before it
/// (good, one of them registered) leave no trace.
#[test]
fn a_bad_key_is_refused_on_every_key_path_naming_the_first_bad_one() {
    let (mut w, a, _) = one_key_world(DirectoryConfig::default());
    let before = w.dir.state_digest();
    let (c, s) = (a.caller(), unused_seq(&a));
    let long = vec![7u8; 513];
    let keys: [&[u8]; 4] = [b"k", b"j", &long, b""];
    let too_long = || DirectoryError::KeyLength {
        index: 2,
        len_bytes: 513,
        max_bytes: 512,
    };
    let unpins = keys.map(|key| UnpinEntry { key, count: 1 });
    for layout in [L, OTHER] {
        let d = &mut w.dir;
        let now = w.now;
        let got = [
            ("exists", d.exists(&c, layout, keys, now).map(drop)),
            ("lookup", d.lookup(&c, None, layout, keys, 0, now).map(drop)),
            (
                "pinned lookup",
                d.lookup(&c, Some(s), layout, keys, 1, now).map(drop),
            ),
            ("unpin", d.unpin(&c, s, layout, unpins, now).map(drop)),
            ("delete", d.delete(&c, s, layout, keys, now).map(drop)),
        ];
        for (what, got) in got {
            assert_eq!(got, Err(too_long()), "{what} under {layout:?}");
        }
    }
    assert!(w.dir.drain_effects().next().is_none());
    assert_eq!(
        w.dir.state_digest(),
        before,
        "a refused request changed state"
    );
    let r = w.dir.lookup(&c, None, L, [&b"k"[..]], 0, w.now).unwrap();
    assert!(
        r.body.locations[0].is_some(),
        "the registered key is intact"
    );
}

#[test]
fn every_reply_carries_the_callers_usage() {
    let mut w = World::new();
    let mut a = w.hello("a");
    let ra = w.region(&mut a, L);
    w.dir.pool_usage(POOL, 1 << 30, 1 << 29);
    let r = w.register(&mut a, &[(b"k", loc(ra, 0, 1))]).unwrap();
    assert_eq!(r.usage.owned_bytes, REGION_BYTES);
    assert_eq!(r.usage.used_bytes, 4096);
    assert_eq!(r.usage.pool_free_bytes, 1 << 29);
    // A region granted after the report is subtracted from the estimate.
    w.region(&mut a, L);
    let r = w.dir.heartbeat(&a.caller(), w.now).unwrap();
    assert_eq!(r.usage.pool_free_bytes, (1 << 29) - REGION_BYTES);
    assert_eq!(r.usage.owned_bytes, 2 * REGION_BYTES);
}

#[test]
fn latency_recorded_by_the_driver_appears_in_stats() {
    let mut w = World::new();
    for us in 1..=100 {
        w.dir
            .record_latency(OpKind::Lookup, Duration::from_micros(us));
    }
    let stats = w.dir.stats(w.now);
    let lookup = stats.ops.iter().find(|o| o.op == OpKind::Lookup).unwrap();
    assert_eq!(lookup.latency.count, 100);
    assert!((45_000..=57_000).contains(&lookup.latency.p50_ns));
    assert_eq!(lookup.latency.max_ns, 100_000);
}

#[test]
fn session_ended_effects_name_the_reason() {
    let mut w = World::new();
    let a = w.hello("a");
    w.dir.end_session(a.session, w.now).unwrap();
    let effects: Vec<Effect> = w.dir.drain_effects().collect();
    assert_eq!(
        effects,
        vec![Effect::SessionEnded {
            session: a.session,
            reason: SessionEndReason::EndedByAdmin
        }]
    );
}
