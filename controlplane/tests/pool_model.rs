//! The pool manager against a reference model, under random sequences of
//! attach (with handles, some foreign or forged), alloc (targeted, any, with
//! and without retry tags), free (by the owner, another directory, a stale or
//! forged handle), directory death, time passing (the reaper) and restarts.
//!
//! The model is deliberately naive: a sorted extent list per pool with a
//! linear first-fit scan, and maps for regions and deadlines. After every
//! step: the same answer (the whole `Result`), the same regions, the same
//! free space per pool, the same directory states, every invariant holds, a
//! failed request pushed no record, and replaying every record pushed so far
//! into an empty ledger gives the manager's state. Tags are drawn from a few
//! values, so tagged allocations are often copies of earlier ones: the model
//! remembers each directory's last tagged answers as the manager must.

mod pool_support;

use std::collections::{BTreeMap, VecDeque};

use cxlkv_controlplane::pool::ledger::Ledger;
use cxlkv_controlplane::pool::{
    AllocTag, Caller, DirectoryId, Handle, InstanceId, ManagerConfig, MonotonicMs, OwnerLabel,
    PoolError, PoolId, PoolManager, PoolTarget, Record, RegionId, Reply, Request, Secret,
    TAG_ANSWERS_PER_DIRECTORY, Token,
};
use pool_support::{KIB, fresh_header, online};
use proptest::prelude::*;

const GRACE_MS: u64 = 100;
const DIRS: usize = 3;
const UNIT: u64 = 64 * KIB;
/// (uuid byte, alignment, size): pool 0 has 63 usable 64 KiB blocks, pool 1
/// has 15 usable 128 KiB blocks.
const POOLS: [(u8, u64, u64); 2] = [(1, 64 * KIB, 64 * 64 * KIB), (2, 128 * KIB, 16 * 128 * KIB)];

#[derive(Debug, Clone)]
enum Op {
    Attach {
        dir: usize,
        new_connection: bool,
        present: Vec<usize>,
        forge: bool,
    },
    Alloc {
        dir: usize,
        target: Option<usize>,
        units: u64,
        instance: u64,
        tag: Option<u64>,
    },
    Free {
        pick: usize,
        as_dir: Option<usize>,
        forge: bool,
        stale: bool,
    },
    Gone {
        dir: usize,
    },
    Advance {
        ms: u64,
    },
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..DIRS, prop::bool::weighted(0.15), prop::collection::vec(any::<usize>(), 0..4), prop::bool::weighted(0.1))
            .prop_map(|(dir, new_connection, present, forge)| Op::Attach { dir, new_connection, present, forge }),
        6 => (0..DIRS, prop::option::of(0..2usize), 0u64..12, 0u64..2, prop::option::of(1u64..4))
            .prop_map(|(dir, target, units, instance, tag)| Op::Alloc { dir, target, units, instance, tag }),
        4 => (any::<usize>(), prop::option::weighted(0.15, 0..DIRS), prop::bool::weighted(0.1), prop::bool::weighted(0.1))
            .prop_map(|(pick, as_dir, forge, stale)| Op::Free { pick, as_dir, forge, stale }),
        1 => (0..DIRS).prop_map(|dir| Op::Gone { dir }),
        2 => (0u64..150).prop_map(|ms| Op::Advance { ms }),
        1 => Just(Op::Restart),
    ]
}

#[derive(Debug, Clone)]
struct MPool {
    alignment: u64,
    end: u64,
    /// Sorted, coalesced `(start, len)`.
    free: Vec<(u64, u64)>,
}

impl MPool {
    fn first_fit(&self, len: u64) -> Option<u64> {
        self.free.iter().find(|e| e.1 >= len).map(|e| e.0)
    }
    fn largest(&self) -> u64 {
        self.free.iter().map(|e| e.1).max().unwrap_or(0)
    }
    fn carve(&mut self, start: u64, len: u64) {
        let i = self
            .free
            .iter()
            .position(|&(s, l)| s <= start && start + len <= s + l)
            .unwrap();
        let (s, l) = self.free.remove(i);
        let mut at = i;
        if start > s {
            self.free.insert(at, (s, start - s));
            at += 1;
        }
        if s + l > start + len {
            self.free.insert(at, (start + len, s + l - start - len));
        }
    }
    fn release(&mut self, start: u64, len: u64) {
        self.free.push((start, len));
        self.free.sort_unstable();
        let mut out: Vec<(u64, u64)> = Vec::new();
        for &(s, l) in &self.free {
            match out.last_mut() {
                Some(last) if last.0 + last.1 == s => last.1 += l,
                _ => out.push((s, l)),
            }
        }
        self.free = out;
    }
}

#[derive(Debug, Clone, Copy)]
struct MRegion {
    handle: Handle,
    tag: u64,
}

struct Model {
    secret: Secret,
    pools: Vec<MPool>,
    regions: BTreeMap<u64, MRegion>,
    freed: Vec<Handle>,
    next_id: u64,
    /// Current caller per directory, when attached.
    callers: [Option<u64>; DIRS],
    pending: BTreeMap<u64, u64>,
    now: u64,
    next_connection: u64,
    /// Per directory, oldest first: (tag, region id allocated or refusal).
    answers: [VecDeque<(u64, Result<u64, PoolError>)>; DIRS],
}

impl Model {
    fn dir_regions(&self, dir: usize) -> impl Iterator<Item = &MRegion> {
        self.regions
            .values()
            .filter(move |r| r.handle.owner.directory == DirectoryId(dir as u64))
    }

    fn fresh_connection(&mut self) -> Caller {
        self.next_connection += 1;
        Caller::Remote {
            connection: self.next_connection,
        }
    }

    fn caller_of(&mut self, dir: usize) -> Caller {
        match self.callers[dir] {
            Some(c) => Caller::Remote { connection: c },
            None => self.fresh_connection(),
        }
    }

    fn check_handle(&self, h: &Handle) -> Result<(), PoolError> {
        if !self.secret.verify(h) {
            return Err(PoolError::BadToken { region: h.region });
        }
        if !self.regions.contains_key(&h.region.0) {
            return Err(PoolError::RegionAlreadyFreed { region: h.region });
        }
        Ok(())
    }

    fn remove(&mut self, id: u64) -> MRegion {
        let r = self.regions.remove(&id).unwrap();
        self.pending.remove(&id);
        self.pools[r.handle.pool.0 as usize].release(r.handle.offset_bytes, r.handle.len_bytes);
        self.freed.push(r.handle);
        r
    }

    /// A directory with no caller and no regions is forgotten, answers too.
    fn forget_untracked_directories(&mut self) {
        for dir in 0..DIRS {
            if self.callers[dir].is_none() && self.dir_regions(dir).next().is_none() {
                self.answers[dir].clear();
            }
        }
    }

    fn unconfirmed(&self, dir: usize) -> (u64, Option<u64>) {
        let mut n = 0;
        let mut first: Option<u64> = None;
        for r in self.dir_regions(dir) {
            if let Some(&d) = self.pending.get(&r.handle.region.0) {
                n += 1;
                first = Some(first.map_or(d, |f| f.min(d)));
            }
        }
        (n, first.map(|d| d.saturating_sub(self.now)))
    }
}

fn forged(h: &Handle) -> Handle {
    let mut t = h.token.0;
    t[7] ^= 0x40;
    Handle {
        token: Token(t),
        ..*h
    }
}

fn setup() -> (PoolManager, Model, Vec<Record>) {
    let secret = Secret::from_bytes([0x11; 32]);
    let mut m = PoolManager::new(secret.clone(), ManagerConfig { grace_ms: GRACE_MS });
    let mut records = Vec::new();
    let mut pools = Vec::new();
    for (uuid, alignment, size) in POOLS {
        online(&mut m, &mut records, &fresh_header(uuid, size, alignment));
        pools.push(MPool {
            alignment,
            end: size,
            free: vec![(alignment, size - alignment)],
        });
    }
    let model = Model {
        secret,
        pools,
        regions: BTreeMap::new(),
        freed: Vec::new(),
        next_id: 1,
        callers: [None; DIRS],
        pending: BTreeMap::new(),
        now: 0,
        next_connection: 0,
        answers: Default::default(),
    };
    (m, model, records)
}

fn expected_alloc(
    model: &mut Model,
    dir: usize,
    target: Option<usize>,
    len: u64,
    instance: u64,
    tag: Option<u64>,
) -> Result<Reply, PoolError> {
    if model.callers[dir].is_none() {
        unreachable!("the caller is bound before this is called");
    }
    let tagged = tag.and_then(|t| model.dir_regions(dir).find(|r| r.tag == t).copied());
    if let Some(t) = tag
        && let Some(r) = tagged
    {
        let same = r.handle.len_bytes == len
            && r.handle.owner.instance == InstanceId(instance)
            && target.is_none_or(|p| r.handle.pool == PoolId(p as u32));
        return if same {
            model.pending.remove(&r.handle.region.0);
            // Remembered unless it already is (after a restart only the
            // journal knew it): a copy after the free must not allocate.
            if !model.answers[dir].iter().any(|(x, _)| *x == t) {
                if model.answers[dir].len() == TAG_ANSWERS_PER_DIRECTORY {
                    model.answers[dir].pop_front();
                }
                model.answers[dir].push_back((t, Ok(r.handle.region.0)));
            }
            Ok(Reply::Allocated(r.handle))
        } else {
            Err(PoolError::TagReused {
                tag: AllocTag(t),
                region: r.handle.region,
            })
        };
    }
    let Some(t) = tag else {
        return expected_fresh_alloc(model, dir, target, len, instance, None);
    };
    if let Some((_, answer)) = model.answers[dir].iter().find(|(x, _)| *x == t) {
        return match answer {
            Ok(id) => Err(PoolError::RegionAlreadyFreed {
                region: RegionId(*id),
            }),
            Err(e) => Err(e.clone()),
        };
    }
    let result = expected_fresh_alloc(model, dir, target, len, instance, tag);
    if model.answers[dir].len() == TAG_ANSWERS_PER_DIRECTORY {
        model.answers[dir].pop_front();
    }
    let answer = match &result {
        Ok(Reply::Allocated(h)) => Ok(h.region.0),
        Ok(other) => unreachable!("an allocation answered {other:?}"),
        Err(e) => Err(e.clone()),
    };
    model.answers[dir].push_back((t, answer));
    result
}

fn expected_fresh_alloc(
    model: &mut Model,
    dir: usize,
    target: Option<usize>,
    len: u64,
    instance: u64,
    tag: Option<u64>,
) -> Result<Reply, PoolError> {
    if len == 0 {
        return Err(PoolError::ZeroLength);
    }
    let place = |p: usize, m: &Model| -> Result<u64, PoolError> {
        let pool = &m.pools[p];
        if !len.is_multiple_of(pool.alignment) {
            return Err(PoolError::LengthNotAligned {
                len_bytes: len,
                alignment_bytes: pool.alignment,
                pool: Some(PoolId(p as u32)),
            });
        }
        pool.first_fit(len).ok_or(PoolError::NoSpace {
            len_bytes: len,
            pool: Some(PoolId(p as u32)),
            largest_free_bytes: pool.largest(),
        })
    };
    let (pool, offset) = match target {
        Some(p) => (p, place(p, model)?),
        None => {
            let mut found = None;
            let mut largest: Option<u64> = None;
            for p in 0..model.pools.len() {
                match place(p, model) {
                    Ok(o) => {
                        found = Some((p, o));
                        break;
                    }
                    Err(PoolError::NoSpace {
                        largest_free_bytes, ..
                    }) => {
                        largest = Some(largest.unwrap_or(0).max(largest_free_bytes));
                    }
                    Err(_) => {}
                }
            }
            match (found, largest) {
                (Some(f), _) => f,
                (None, Some(largest_free_bytes)) => {
                    return Err(PoolError::NoSpace {
                        len_bytes: len,
                        pool: None,
                        largest_free_bytes,
                    });
                }
                (None, None) => {
                    let alignment_bytes = model.pools.iter().map(|p| p.alignment).min().unwrap();
                    return Err(PoolError::LengthNotAligned {
                        len_bytes: len,
                        alignment_bytes,
                        pool: None,
                    });
                }
            }
        }
    };
    let id = model.next_id;
    model.next_id += 1;
    model.pools[pool].carve(offset, len);
    let owner = OwnerLabel {
        directory: DirectoryId(dir as u64),
        instance: InstanceId(instance),
    };
    let region = RegionId(id);
    let handle = Handle {
        region,
        pool: PoolId(pool as u32),
        offset_bytes: offset,
        len_bytes: len,
        owner,
        token: model
            .secret
            .token(region, PoolId(pool as u32), offset, len, owner),
    };
    model.regions.insert(
        id,
        MRegion {
            handle,
            tag: tag.unwrap_or(0),
        },
    );
    Ok(Reply::Allocated(handle))
}

fn step(
    m: &mut PoolManager,
    model: &mut Model,
    records: &mut Vec<Record>,
    op: &Op,
) -> Result<(), TestCaseError> {
    let before = records.len();
    let now = MonotonicMs(model.now);
    let (got, want) = match op.clone() {
        Op::Attach {
            dir,
            new_connection,
            present,
            forge,
        } => {
            let caller = if new_connection {
                model.fresh_connection()
            } else {
                model.caller_of(dir)
            };
            let mut handles: Vec<Handle> = Vec::new();
            let live: Vec<Handle> = model.regions.values().map(|r| r.handle).collect();
            for i in present {
                let pool_of_handles = live.len() + model.freed.len();
                if pool_of_handles == 0 {
                    break;
                }
                let k = i % pool_of_handles;
                handles.push(if k < live.len() {
                    live[k]
                } else {
                    model.freed[k - live.len()]
                });
            }
            if forge && let Some(h) = handles.first().copied() {
                handles.push(forged(&h));
            }
            let got = m.handle(
                &caller,
                Request::Attach {
                    directory: DirectoryId(dir as u64),
                    handles: &handles,
                },
                now,
                records,
            );
            let Caller::Remote { connection } = caller else {
                unreachable!()
            };
            let want = match model.callers[dir] {
                Some(c) if c != connection => Err(PoolError::DirectoryAttachedElsewhere {
                    directory: DirectoryId(dir as u64),
                }),
                _ => {
                    model.callers[dir] = Some(connection);
                    let verdicts = handles
                        .iter()
                        .map(|h| {
                            model.check_handle(h)?;
                            if h.owner.directory != DirectoryId(dir as u64) {
                                return Err(PoolError::WrongOwner {
                                    region: h.region,
                                    owner: h.owner.directory,
                                    caller: DirectoryId(dir as u64),
                                });
                            }
                            model.pending.remove(&h.region.0);
                            Ok(())
                        })
                        .collect();
                    let (unconfirmed_regions, reclaim_in_ms) = model.unconfirmed(dir);
                    Ok(Reply::Attached(cxlkv_controlplane::pool::AttachReport {
                        directory: DirectoryId(dir as u64),
                        verdicts,
                        unconfirmed_regions,
                        reclaim_in_ms,
                    }))
                }
            };
            (got, want)
        }
        Op::Alloc {
            dir,
            target,
            units,
            instance,
            tag,
        } => {
            let caller = model.caller_of(dir);
            let request = Request::Alloc {
                target: target.map_or(PoolTarget::Any, |p| PoolTarget::Pool(PoolId(p as u32))),
                len_bytes: units * UNIT,
                instance: InstanceId(instance),
                tag: AllocTag(tag.unwrap_or(0)),
            };
            let got = m.handle(&caller, request, now, records);
            let want = if model.callers[dir].is_none() {
                Err(PoolError::NotAttached { caller })
            } else {
                expected_alloc(model, dir, target, units * UNIT, instance, tag)
            };
            (got, want)
        }
        Op::Free {
            pick,
            as_dir,
            forge,
            stale,
        } => {
            let h = if stale {
                if model.freed.is_empty() {
                    return Ok(());
                }
                model.freed[pick % model.freed.len()]
            } else {
                if model.regions.is_empty() {
                    return Ok(());
                }
                let v: Vec<Handle> = model.regions.values().map(|r| r.handle).collect();
                v[pick % v.len()]
            };
            let h = if forge { forged(&h) } else { h };
            let dir = as_dir.unwrap_or(h.owner.directory.0 as usize);
            let caller = model.caller_of(dir);
            let got = m.handle(&caller, Request::Free { handle: h }, now, records);
            let want = if model.callers[dir].is_none() {
                Err(PoolError::NotAttached { caller })
            } else {
                match model.check_handle(&h) {
                    Err(e) => Err(e),
                    Ok(()) if h.owner.directory != DirectoryId(dir as u64) => {
                        Err(PoolError::WrongOwner {
                            region: h.region,
                            owner: h.owner.directory,
                            caller: DirectoryId(dir as u64),
                        })
                    }
                    Ok(()) => {
                        model.remove(h.region.0);
                        Ok(Reply::Freed {
                            region: h.region,
                            len_bytes: h.len_bytes,
                        })
                    }
                }
            };
            (got, want)
        }
        Op::Gone { dir } => {
            let caller = model.caller_of(dir);
            let got = m.caller_gone(&caller, now);
            let want = model.callers[dir].take().map(|_| DirectoryId(dir as u64));
            if want.is_some() {
                let ids: Vec<u64> = model.dir_regions(dir).map(|r| r.handle.region.0).collect();
                for id in ids {
                    model.pending.entry(id).or_insert(model.now + GRACE_MS);
                }
            }
            prop_assert_eq!(got, want);
            prop_assert_eq!(
                records.len(),
                before,
                "a caller going away journals nothing"
            );
            return check(m, model, records);
        }
        Op::Advance { ms } => {
            model.now += ms;
            let report = m.tick(MonotonicMs(model.now), records);
            let mut due: Vec<(u64, u64)> = model
                .pending
                .iter()
                .filter(|(_, d)| **d <= model.now)
                .map(|(id, d)| (*d, *id))
                .collect();
            due.sort_unstable();
            for &(_, id) in &due {
                model.remove(id);
            }
            let got: Vec<u64> = report.reclaimed.iter().map(|r| r.id.0).collect();
            let want: Vec<u64> = due.iter().map(|&(_, id)| id).collect();
            prop_assert_eq!(got, want);
            prop_assert!(!report.more_due);
            prop_assert_eq!(records.len() - before, report.reclaimed.len());
            return check(m, model, records);
        }
        Op::Restart => {
            let secret = model.secret.clone();
            *m = PoolManager::restore(&m.snapshot(), secret, *m.config(), now).unwrap();
            for (uuid, alignment, size) in POOLS {
                online(m, records, &fresh_header(uuid, size, alignment));
            }
            model.callers = [None; DIRS];
            model.answers = Default::default();
            let ids: Vec<u64> = model.regions.keys().copied().collect();
            model.pending = ids
                .into_iter()
                .map(|id| (id, model.now + GRACE_MS))
                .collect();
            return check(m, model, records);
        }
    };
    prop_assert_eq!(&got, &want, "op {:?}", op);
    match &got {
        Ok(Reply::Allocated(_)) | Ok(Reply::Freed { .. }) => {}
        _ => prop_assert_eq!(
            records.len(),
            before,
            "only a new allocation or a free journals"
        ),
    }
    check(m, model, records)
}

fn check(m: &PoolManager, model: &Model, records: &[Record]) -> Result<(), TestCaseError> {
    if let Err(e) = m.check_invariants() {
        prop_assert!(false, "{}", e);
    }
    let snap = m.snapshot();
    let got: Vec<Handle> = snap
        .regions
        .iter()
        .map(|r| Handle {
            region: r.id,
            pool: r.pool,
            offset_bytes: r.offset_bytes,
            len_bytes: r.len_bytes,
            owner: r.owner,
            token: model
                .secret
                .token(r.id, r.pool, r.offset_bytes, r.len_bytes, r.owner),
        })
        .collect();
    let want: Vec<Handle> = model.regions.values().map(|r| r.handle).collect();
    prop_assert_eq!(got, want);
    let tags: Vec<u64> = snap.regions.iter().map(|r| r.tag.0).collect();
    let want_tags: Vec<u64> = model.regions.values().map(|r| r.tag).collect();
    prop_assert_eq!(tags, want_tags);
    prop_assert_eq!(snap.next_region.0, model.next_id);
    let stats = m.stats();
    for (p, mp) in stats.pools.iter().zip(&model.pools) {
        let free: u64 = mp.free.iter().map(|e| e.1).sum();
        prop_assert_eq!(p.free_bytes, free);
        prop_assert_eq!(p.largest_free_bytes, mp.largest());
        prop_assert_eq!(p.free_extents, mp.free.len() as u64);
        prop_assert_eq!(p.capacity_bytes, mp.end - mp.alignment);
    }
    prop_assert_eq!(stats.regions_pending_reclaim, model.pending.len() as u64);
    for dir in 0..DIRS {
        let status = m.directory(DirectoryId(dir as u64), MonotonicMs(model.now));
        let has_regions = model.dir_regions(dir).next().is_some();
        match (status, model.callers[dir]) {
            (None, None) => prop_assert!(!has_regions, "dir {} has regions but no entry", dir),
            (None, Some(_)) => prop_assert!(false, "attached dir {} has no entry", dir),
            (Some(s), c) => {
                prop_assert_eq!(
                    s.attached_by,
                    c.map(|connection| Caller::Remote { connection })
                );
                let (n, first) = model.unconfirmed(dir);
                prop_assert_eq!((s.unconfirmed_regions, s.reclaim_in_ms), (n, first));
            }
        }
    }
    // Live and replay are the same code: replaying everything pushed so far
    // rebuilds the manager's durable state.
    let mut ledger = Ledger::new();
    for r in records {
        ledger
            .apply(r)
            .map_err(|e| TestCaseError::fail(format!("replay of {r:?}: {e}")))?;
    }
    prop_assert_eq!(ledger.snapshot(), snap);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn the_manager_matches_a_reference_model_under_random_operations(
        ops in prop::collection::vec(op(), 1..120)
    ) {
        let (mut m, mut model, mut records) = setup();
        for op in &ops {
            step(&mut m, &mut model, &mut records, op)?;
            model.forget_untracked_directories();
        }
    }
}
