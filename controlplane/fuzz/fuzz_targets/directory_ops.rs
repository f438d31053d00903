//! The directory state machine driven by fuzzed operation sequences: every
//! entry point, with well-formed and malformed arguments mixed (known and
//! unknown sessions, real and forged secrets and tokens, keys of legal and
//! illegal lengths, fresh, repeated and ancient sequence numbers, pool
//! answers for known, unknown and repeated allocations, restarts recovering
//! from real and duplicated region lists), under a configuration with small
//! limits so that every limit is reached.
//!
//! After every operation:
//! - `Directory::check_invariants` passes;
//! - a refused request changed nothing (`state_digest` unchanged), when it
//!   carried no notice acknowledgement and no `replies_received_below` (the
//!   two things a refused request may still apply);
//! - a reply's notices are consecutive and at most `notices_per_response`.

#![no_main]

use std::time::Duration;

use cxlkv_controlplane::directory::{
    Caller, Directory, DirectoryConfig, DirectoryError, Effect, EvictionConfig, Hello,
    InstanceSecret, Layout, Location, Peer, PoolRequestId, PresentedRegion, Reattach,
    RecoveredRegion, RegionGrant, RegionHandle, RegionToken, RegisterEntry, Reply, Sequence,
    SessionId, Time, UnpinEntry,
};
use cxlkv_dataplane::ids::{Generation, PageIndex, PoolId, RegionId};
use libfuzzer_sys::arbitrary::{Result as AResult, Unstructured};
use libfuzzer_sys::fuzz_target;

const NAMES: [&str; 4] = ["alpha", "beta", "gamma", "bad name"];
const LAYOUTS: [Layout; 3] = [
    Layout {
        page_size_bytes: 4096,
        fingerprint: 1,
    },
    Layout {
        page_size_bytes: 8192,
        fingerprint: 2,
    },
    Layout {
        page_size_bytes: 1000,
        fingerprint: 3,
    },
];
const NOTICES_PER_RESPONSE: usize = 2;

struct World {
    dir: Directory,
    config: DirectoryConfig,
    now_ns: u64,
    sessions: Vec<SessionId>,
    secrets: Vec<(usize, InstanceSecret)>,
    grants: Vec<(usize, RegionGrant)>,
    pending: Vec<PoolRequestId>,
    next_region: u64,
    restarts: u64,
}

fn config(u: &mut Unstructured<'_>) -> AResult<DirectoryConfig> {
    Ok(DirectoryConfig {
        max_batch: 8,
        max_pins_per_call: 4,
        max_keys: 24,
        max_sessions: 6,
        max_sessions_per_instance: 3,
        max_instances: 3,
        max_layouts: 2,
        max_regions_per_instance: 4,
        max_pending_region_requests_per_instance: 2,
        max_region_bytes: 64 << 10,
        max_pinned_keys_per_session: 6,
        // Below sessions × keys per session, so that the fuzzer meets it.
        max_pinned_entries: 20,
        session_lease: Duration::from_millis(1000),
        instance_grace: Duration::from_millis(2000),
        reply_window: 64,
        reply_cache_bytes_per_instance: *u.choose(&[200usize, 1000, 1 << 20])?,
        notice_queue_limit: 8,
        notices_per_response: NOTICES_PER_RESPONSE,
        tcp_requires_secret: true,
        max_instance_quota_bytes: if u.arbitrary()? { Some(96 << 10) } else { None },
        long_held_pin: Duration::from_millis(500),
        long_held_pins_listed: 2,
        ended_sessions_remembered: 4,
        eviction: EvictionConfig {
            orphans: u.arbitrary()?,
            pool_high_watermark: 0.5,
            pool_low_watermark: 0.25,
            lru: u.arbitrary()?,
            lru_high_fill: 0.2,
            lru_low_fill: 0.1,
            max_evictions_per_tick: 3,
        },
    })
}

fn key(u: &mut Unstructured<'_>) -> AResult<Vec<u8>> {
    Ok(match u.int_in_range(0..=15u8)? {
        0 => Vec::new(),
        1 => vec![b'x'; 513],
        2 => u.arbitrary::<Vec<u8>>()?,
        k => vec![b'k', k % 6],
    })
}

fn keys(u: &mut Unstructured<'_>) -> AResult<Vec<Vec<u8>>> {
    let n = u.int_in_range(0..=9usize)?;
    (0..n).map(|_| key(u)).collect()
}

impl World {
    fn now(&self) -> Time {
        Time::from_nanos(self.now_ns)
    }

    fn session(&self, u: &mut Unstructured<'_>) -> AResult<SessionId> {
        if self.sessions.is_empty() || u.ratio(1, 8)? {
            return Ok(SessionId(u.int_in_range(0..=40u64)?));
        }
        Ok(*u.choose(&self.sessions)?)
    }

    /// A caller, and whether it acknowledges nothing (then a refusal must
    /// leave the digest unchanged).
    fn caller(&self, u: &mut Unstructured<'_>) -> AResult<(Caller, bool)> {
        let session = self.session(u)?;
        let notice_ack = if u.ratio(1, 3)? {
            u.int_in_range(0..=12u64)?
        } else {
            0
        };
        Ok((
            Caller {
                session,
                notice_ack,
            },
            notice_ack == 0,
        ))
    }

    fn seq(&self, u: &mut Unstructured<'_>) -> AResult<(Sequence, bool)> {
        let seq = match u.int_in_range(0..=9u8)? {
            0 => u.arbitrary()?,
            1 => 0,
            _ => u.int_in_range(1..=90u64)?,
        };
        let below = if u.ratio(1, 4)? {
            u.int_in_range(0..=90u64)?
        } else {
            0
        };
        Ok((
            Sequence {
                seq,
                replies_received_below: below,
            },
            below <= 1,
        ))
    }

    fn layout(&self, u: &mut Unstructured<'_>) -> AResult<Layout> {
        let mut l = *u.choose(&LAYOUTS)?;
        if u.ratio(1, 16)? {
            l.fingerprint = u.arbitrary()?;
        }
        Ok(l)
    }

    fn location(&self, u: &mut Unstructured<'_>) -> AResult<Location> {
        let region = if self.grants.is_empty() || u.ratio(1, 10)? {
            RegionId(u.int_in_range(0..=20u64)?)
        } else {
            u.choose(&self.grants)?.1.handle.region
        };
        Ok(Location {
            region,
            page: PageIndex(u.int_in_range(0..=17u32)?),
            generation: Generation(u.int_in_range(0..=5u32)?),
            len_bytes: *u.choose(&[0u32, 1, 4096, 4097, 8192, u32::MAX])?,
        })
    }

    fn check<T>(&self, r: &Result<Reply<T>, DirectoryError>) {
        if let Ok(reply) = r {
            assert!(reply.notices.len() <= NOTICES_PER_RESPONSE);
            for w in reply.notices.windows(2) {
                assert_eq!(w[1].seq, w[0].seq + 1, "notices are consecutive");
            }
        }
    }

    fn drain(&mut self) {
        let effects: Vec<Effect> = self.dir.drain_effects().collect();
        for e in effects {
            match e {
                Effect::AllocateRegion { request, .. } => self.pending.push(request),
                Effect::FreeRegion { handle, .. } => self
                    .grants
                    .retain(|(_, g)| g.handle.region != handle.region),
                _ => {}
            }
        }
    }

    fn step(&mut self, u: &mut Unstructured<'_>) -> AResult<()> {
        let before = self.dir.state_digest();
        // `Some(quiet)`: a request that may be refused; `quiet` says whether
        // a refusal must leave the state digest unchanged.
        let mut refused: Option<bool> = None;
        match u.int_in_range(0..=17u8)? {
            0 => {
                let name = *u.choose(&NAMES)?;
                let peer = match u.int_in_range(0..=3u8)? {
                    0 => Peer::Tcp {
                        secret_matched: u.arbitrary()?,
                    },
                    n => Peer::Unix {
                        pid: 7,
                        uid: u32::from(n),
                        gid: 0,
                    },
                };
                let quota_bytes = if u.arbitrary()? {
                    Some(u.int_in_range(0..=200u64)? << 10)
                } else {
                    None
                };
                match self.dir.hello(
                    Hello {
                        instance: name,
                        quota_bytes,
                    },
                    peer,
                    self.now(),
                ) {
                    Ok(w) => {
                        self.sessions.push(w.session);
                        let ix = NAMES.iter().position(|n| *n == name).unwrap_or(0);
                        self.secrets.push((ix, w.secret));
                    }
                    Err(_) => refused = Some(true),
                }
            }
            1 => {
                let ix = u.int_in_range(0..=NAMES.len() - 1)?;
                let secret = match self.secrets.iter().filter(|(i, _)| *i == ix).last() {
                    Some((_, s)) if !u.ratio(1, 8)? => *s,
                    _ => InstanceSecret(u.arbitrary()?),
                };
                let mut regions = Vec::new();
                for (owner, g) in &self.grants {
                    if (*owner == ix || u.ratio(1, 8)?) && u.ratio(3, 4)? {
                        let mut handle = g.handle;
                        if u.ratio(1, 10)? {
                            handle.token = RegionToken(u.arbitrary()?);
                        }
                        let layout = if u.ratio(1, 10)? {
                            self.layout(u)?
                        } else {
                            g.layout
                        };
                        regions.push(PresentedRegion { handle, layout });
                    }
                }
                if u.ratio(1, 16)? && !regions.is_empty() {
                    regions.push(regions[0]);
                }
                let notice_ack = match u.int_in_range(0..=7u8)? {
                    0 => u.arbitrary()?,
                    1..=3 => u.int_in_range(0..=12u64)?,
                    _ => 0,
                };
                let req = Reattach {
                    instance: NAMES[ix],
                    secret,
                    regions: &regions,
                    next_seq: if u.ratio(1, 8)? {
                        u.arbitrary()?
                    } else {
                        u.int_in_range(0..=100u64)?
                    },
                    notice_ack,
                    quota_bytes: None,
                };
                match self.dir.reattach(
                    req,
                    Peer::Unix {
                        pid: 7,
                        uid: 1,
                        gid: 0,
                    },
                    self.now(),
                ) {
                    Ok(r) => {
                        self.sessions.push(r.session);
                        self.secrets.push((ix, secret));
                    }
                    Err(_) => refused = Some(notice_ack == 0),
                }
            }
            2 => {
                let (caller, quiet) = self.caller(u)?;
                let r = self.dir.heartbeat(&caller, self.now());
                self.check(&r);
                if r.is_err() {
                    refused = Some(quiet);
                }
            }
            3 => {
                let s = self.session(u)?;
                self.dir.session_closed(s, self.now());
            }
            4 => {
                let s = self.session(u)?;
                if self.dir.end_session(s, self.now()).is_err() {
                    refused = Some(true);
                }
            }
            5 => {
                self.now_ns += u64::from(u.int_in_range(0..=3000u32)?) * 1_000_000;
                self.dir.tick(self.now());
            }
            6 => {
                let (caller, quiet) = self.caller(u)?;
                let (seq, quiet_seq) = self.seq(u)?;
                let layout = self.layout(u)?;
                let n = u.int_in_range(0..=9usize)?;
                let mut ks = Vec::with_capacity(n);
                let mut locs = Vec::with_capacity(n);
                for _ in 0..n {
                    ks.push(key(u)?);
                    locs.push(self.location(u)?);
                }
                let entries: Vec<RegisterEntry<'_>> = ks
                    .iter()
                    .zip(&locs)
                    .map(|(k, l)| RegisterEntry {
                        key: k,
                        location: *l,
                    })
                    .collect();
                let r =
                    self.dir
                        .register(&caller, seq, layout, entries.iter().copied(), self.now());
                self.check(&r);
                if r.is_err() {
                    refused = Some(quiet && quiet_seq);
                }
            }
            7 => {
                let (caller, quiet) = self.caller(u)?;
                let (seq, quiet_seq) = self.seq(u)?;
                let seq = if u.ratio(1, 4)? { None } else { Some(seq) };
                let layout = self.layout(u)?;
                let ks = keys(u)?;
                let pins = *u.choose(&[0u32, 0, 1, 2, 5])?;
                let r = self.dir.lookup(
                    &caller,
                    seq,
                    layout,
                    ks.iter().map(|k| k.as_slice()),
                    pins,
                    self.now(),
                );
                self.check(&r);
                if r.is_err() {
                    refused = Some(quiet && quiet_seq);
                }
            }
            8 => {
                let (caller, quiet) = self.caller(u)?;
                let layout = self.layout(u)?;
                let ks = keys(u)?;
                let r =
                    self.dir
                        .exists(&caller, layout, ks.iter().map(|k| k.as_slice()), self.now());
                self.check(&r);
                if r.is_err() {
                    refused = Some(quiet);
                }
            }
            9 => {
                let (caller, quiet) = self.caller(u)?;
                let (seq, quiet_seq) = self.seq(u)?;
                let layout = self.layout(u)?;
                let ks = keys(u)?;
                let mut counts = Vec::with_capacity(ks.len());
                for _ in &ks {
                    counts.push(u.int_in_range(0..=3u32)?);
                }
                let entries: Vec<UnpinEntry<'_>> = ks
                    .iter()
                    .zip(&counts)
                    .map(|(k, &count)| UnpinEntry { key: k, count })
                    .collect();
                let r = self
                    .dir
                    .unpin(&caller, seq, layout, entries.iter().copied(), self.now());
                self.check(&r);
                if r.is_err() {
                    refused = Some(quiet && quiet_seq);
                }
            }
            10 => {
                let (caller, quiet) = self.caller(u)?;
                let (seq, quiet_seq) = self.seq(u)?;
                let layout = self.layout(u)?;
                let ks = keys(u)?;
                let r = self.dir.delete(
                    &caller,
                    seq,
                    layout,
                    ks.iter().map(|k| k.as_slice()),
                    self.now(),
                );
                self.check(&r);
                if r.is_err() {
                    refused = Some(quiet && quiet_seq);
                }
            }
            11 => {
                let (caller, quiet) = self.caller(u)?;
                let (seq, quiet_seq) = self.seq(u)?;
                let layout = self.layout(u)?;
                let len_bytes = *u.choose(&[0u64, 4096, 8192, 16 << 10, 32 << 10, 1 << 20])?;
                let r = self
                    .dir
                    .request_region(&caller, seq, layout, len_bytes, self.now());
                self.check(&r);
                if r.is_err() {
                    refused = Some(quiet && quiet_seq);
                }
            }
            12 => {
                if self.pending.is_empty() && !u.ratio(1, 8)? {
                    return Ok(());
                }
                let request = if self.pending.is_empty() {
                    PoolRequestId(u.int_in_range(0..=10u64)?)
                } else {
                    let i = u.int_in_range(0..=self.pending.len() - 1)?;
                    if u.ratio(1, 8)? {
                        self.pending[i]
                    } else {
                        self.pending.swap_remove(i)
                    }
                };
                let result = if u.ratio(1, 6)? {
                    Err(String::from("no space"))
                } else {
                    let region = if u.ratio(1, 10)? {
                        RegionId(u.int_in_range(0..=self.next_region)?)
                    } else {
                        self.next_region += 1;
                        RegionId(self.next_region)
                    };
                    Ok(RegionHandle {
                        region,
                        pool: PoolId(0),
                        offset_bytes: region.0 << 16,
                        len_bytes: *u.choose(&[4096u64, 16 << 10, 32 << 10, 64 << 10])?,
                        token: RegionToken([region.0 as u8; 32]),
                    })
                };
                let completions = self.dir.region_allocated(request, result);
                for c in completions {
                    if let Ok(reply) = c.result {
                        let owner = self.secrets.last().map_or(0, |(ix, _)| *ix);
                        if !self
                            .grants
                            .iter()
                            .any(|(_, g)| g.handle.region == reply.body.handle.region)
                        {
                            self.grants.push((owner, reply.body));
                        }
                    }
                }
            }
            13 => {
                let (caller, quiet) = self.caller(u)?;
                let (seq, quiet_seq) = self.seq(u)?;
                let region = match self.grants.is_empty() || u.ratio(1, 8)? {
                    true => RegionId(u.int_in_range(0..=20u64)?),
                    false => u.choose(&self.grants)?.1.handle.region,
                };
                let r = self.dir.return_region(&caller, seq, region, self.now());
                self.check(&r);
                if r.is_err() {
                    refused = Some(quiet && quiet_seq);
                }
            }
            14 => {
                let total = u.int_in_range(0..=512u64)? << 10;
                let free = u.int_in_range(0..=600u64)? << 10;
                self.dir
                    .pool_usage(PoolId(u.int_in_range(0..=1u32)?), total, free);
            }
            15 => {
                let _ = self.dir.stats(self.now());
            }
            16 => {
                // A restart: recovered from the regions held (some listed
                // twice, some under another owner).
                let mut regions = Vec::new();
                for (owner, g) in &self.grants {
                    let owner = if u.ratio(1, 10)? {
                        u.int_in_range(0..=2usize)?
                    } else {
                        *owner
                    };
                    let Ok(owner) = cxlkv_controlplane::directory::InstanceId::new(NAMES[owner])
                    else {
                        continue;
                    };
                    let r = RecoveredRegion {
                        handle: g.handle,
                        owner,
                    };
                    if u.ratio(1, 10)? {
                        regions.push(r.clone());
                    }
                    regions.push(r);
                }
                self.restarts += 1;
                let mut seed = [0u8; 32];
                seed[..8].copy_from_slice(&self.restarts.to_le_bytes());
                self.dir = Directory::recover(self.config.clone(), seed, self.now(), regions)
                    .expect("the fuzz configuration is valid");
                self.sessions.clear();
                self.pending.clear();
                return Ok(());
            }
            _ => {
                let s = self.session(u)?;
                let _ = self.dir.end_session(s, self.now());
                self.now_ns += 1_000_000;
                self.dir.tick(self.now());
            }
        }
        if let Err(v) = self.dir.check_invariants() {
            panic!("{v}");
        }
        if refused == Some(true) {
            assert_eq!(
                self.dir.state_digest(),
                before,
                "a refused request changed the state"
            );
        }
        self.drain();
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let Ok(config) = config(&mut u) else {
        return;
    };
    let Ok(dir) = Directory::new(config.clone(), [7; 32]) else {
        panic!("the fuzz configuration is valid");
    };
    let mut world = World {
        dir,
        config,
        now_ns: 1,
        sessions: Vec::new(),
        secrets: Vec::new(),
        grants: Vec::new(),
        pending: Vec::new(),
        next_region: 0,
        restarts: 0,
    };
    for _ in 0..256 {
        if u.is_empty() || world.step(&mut u).is_err() {
            break;
        }
    }
});
