//! One chaos instance: a process that runs a seeded random workload against
//! the server until it is killed, and keeps its slot's ledger.
//!
//! Three roles share one layout (so each reads the others' chunks):
//!
//! - **writer** (`Client` API): registers batches of new keys with
//!   `batch_put`, deletes its own keys and the keys its predecessors in the
//!   slot left behind (read from the slot's ledger at start), and reads its
//!   own keys back;
//! - **reader**: follows every slot's ledger, looks up random acknowledged
//!   keys with `batch_get`, checks every byte, and keeps some guards (pins)
//!   for a while, so that kills land while pins are held;
//! - **tier** (`L1Tier`): the same as a writer through the staged protocol
//!   (`reserve_write` → write in place → `finish_write`, `reserve_read` →
//!   check → `finish_read`, `delete`).
//!
//! The ledger rules (module [`super::ledger`]): an intent is durable before
//! its request is sent, an acknowledgement only after the directory's
//! answer. A read whose bytes are not the key's payload is recorded as torn.
//! A failed call is recorded by kind and the workload goes on; an instance
//! only exits on its own when its ledger cannot be written, or when it
//! could not reach the server for [`MAX_UNREACHABLE_MS`].

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::ledger::{self, Entry, Ledger, LedgerTail, Record};
use super::payload::{self, KeyName, SplitMix64};
use super::{FINGERPRINT, PAGE_SIZE_BYTES, REGION_SIZE_BYTES, Role};
use crate::client::{
    Client, ClientConfig, ClientError, DeleteOutcome, LayoutHandle, LayoutOptions, ReadGuard,
    RegisterOutcome,
};
use crate::tier::{Holds, L1Tier, TierCode, TierConfig, WriteMode};

/// Most keys in one batch of the workload.
const MAX_BATCH_KEYS: u64 = 8;
/// A writer deletes rather than writes once it owns this many keys.
const TARGET_OWNED_KEYS: usize = 96;
/// Most read guards a reader keeps at once, and how long it keeps one.
const MAX_HELD_GUARDS: usize = 24;
const MAX_HOLD_MS: u64 = 1500;
/// How often a reader re-reads the ledgers for new keys.
const KEY_REFRESH_MS: u64 = 300;
/// Pause between two steps of the workload (bounds the CPU it takes).
const MIN_PAUSE_MS: u64 = 2;
const MAX_PAUSE_MS: u64 = 15;
/// Pause after a failed call.
const ERROR_PAUSE_MS: u64 = 100;
/// An instance that could not connect, or whose every call failed, for
/// this long gives up (the driver counts it as a crash).
pub const MAX_UNREACHABLE_MS: u64 = 120_000;

/// What the driver tells an instance process.
#[derive(Debug, Clone)]
pub struct InstanceSpec {
    pub run_dir: PathBuf,
    pub socket: PathBuf,
    pub slots: u32,
    pub slot: u32,
    pub incarnation: u32,
    pub role: Role,
    pub seed: u64,
}

/// The directory's name for an incarnation (unique per run).
pub fn instance_id(role: Role, slot: u32, incarnation: u32) -> String {
    format!("{}{slot}.{incarnation}", role.letter())
}

/// The layout every instance and the checker use.
pub(crate) fn layout_options() -> LayoutOptions {
    LayoutOptions {
        initial_reservation_bytes: 0,
        region_size_bytes: REGION_SIZE_BYTES,
        auto_expand: true,
    }
}

/// The client settings of instances and the checker: short idle-region
/// return (exercises `ReturnRegion` under chaos), default retries.
pub(crate) fn client_config(socket: &std::path::Path, instance_id: &str) -> ClientConfig {
    let mut cfg = ClientConfig::unix(socket);
    cfg.instance_id = instance_id.to_owned();
    cfg.client_name = instance_id.to_owned();
    cfg.idle_region_return_ms = 2_000;
    cfg
}

/// Connects, retrying while the server is (re)starting, for at most
/// `timeout_ms`.
pub(crate) fn connect(cfg: &ClientConfig, timeout_ms: u64) -> anyhow::Result<Client> {
    let start = Instant::now();
    loop {
        match Client::connect(cfg.clone()) {
            Ok(c) => return Ok(c),
            Err(e) if start.elapsed() < Duration::from_millis(timeout_ms) => {
                tracing::debug!(error = %e, "connect failed; retrying");
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(e).context("cannot connect to the chaos server"),
        }
    }
}

/// A short, stable name for a failed call (aggregated by the checker).
pub fn error_kind(e: &ClientError) -> String {
    match e {
        ClientError::Server { code_name, .. } => format!("server:{code_name}"),
        ClientError::Unanswered { .. } => "unanswered".into(),
        ClientError::Indeterminate { .. } => "indeterminate".into(),
        ClientError::ReconnectFailed { .. } => "reconnect_failed".into(),
        ClientError::TooManyInFlight { .. } => "too_many_in_flight".into(),
        ClientError::OutOfMemory { .. } => "out_of_memory".into(),
        ClientError::QuotaExceeded { .. } => "quota_exceeded".into(),
        ClientError::Connect(_) => "connect".into(),
        ClientError::Closed => "closed".into(),
        ClientError::RegionRevoked { .. } => "region_revoked".into(),
        ClientError::BadReply { .. } => "bad_reply".into(),
        ClientError::UnexpectedReply { .. } => "unexpected_reply".into(),
        ClientError::Map(_) => "map".into(),
        ClientError::Allocator(_) => "allocator".into(),
        ClientError::Backing(_) => "backing".into(),
        _ => "other".into(),
    }
}

/// Asks the kernel to SIGKILL this process when the driver dies, so that a
/// driver killed without its cleanup leaves no instance behind.
fn die_with_parent() -> anyhow::Result<()> {
    // SAFETY: prctl(PR_SET_PDEATHSIG) takes a signal number and changes
    // only this process's death signal.
    let rc = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    anyhow::ensure!(
        rc == 0,
        "prctl(PR_SET_PDEATHSIG): {}",
        std::io::Error::last_os_error()
    );
    // The driver may have died before the prctl: then we were reparented.
    // SAFETY: getppid has no preconditions.
    anyhow::ensure!(unsafe { libc::getppid() } != 1, "the chaos driver is gone");
    Ok(())
}

/// Acknowledged keys of every slot, not deleted or being deleted: what a
/// reader picks from. Random choice and removal are O(1).
#[derive(Debug, Default)]
struct KeyPool {
    keys: Vec<String>,
    index: HashMap<String, usize>,
}

impl KeyPool {
    fn insert(&mut self, key: String) {
        if !self.index.contains_key(&key) {
            self.index.insert(key.clone(), self.keys.len());
            self.keys.push(key);
        }
    }

    fn remove(&mut self, key: &str) {
        if let Some(i) = self.index.remove(key) {
            self.keys.swap_remove(i);
            if let Some(moved) = self.keys.get(i) {
                self.index.insert(moved.clone(), i);
            }
        }
    }

    fn apply(&mut self, entries: Vec<Entry>) {
        for e in entries {
            match e.record {
                Record::Ack { key, .. } => self.insert(key),
                Record::DeleteIntent(key) | Record::Deleted(key) | Record::Missing(key) => {
                    self.remove(&key)
                }
                _ => {}
            }
        }
    }

    fn pick(&self, rng: &mut SplitMix64, n: usize) -> Vec<String> {
        if self.keys.is_empty() {
            return Vec::new();
        }
        let mut out: Vec<String> = (0..n)
            .map(|_| self.keys[rng.below(self.keys.len() as u64) as usize].clone())
            .collect();
        out.sort();
        out.dedup();
        out
    }
}

/// Takes up to `n` random entries out of `from`.
fn take_random(from: &mut Vec<String>, rng: &mut SplitMix64, n: usize) -> Vec<String> {
    let n = n.min(from.len());
    (0..n)
        .map(|_| from.swap_remove(rng.below(from.len() as u64) as usize))
        .collect()
}

/// The keys acknowledged by earlier incarnations of the slot and not known
/// to be deleted: this incarnation deletes them.
fn inherited_keys(spec: &InstanceSpec) -> anyhow::Result<Vec<String>> {
    let mut tail = LedgerTail::new(ledger::path_of(&spec.run_dir, spec.slot));
    let mut alive: HashMap<String, ()> = HashMap::new();
    loop {
        let entries = tail.poll().context("cannot read the slot's ledger")?;
        if entries.is_empty() {
            break;
        }
        for e in entries {
            match e.record {
                Record::Ack { key, .. } => {
                    alive.insert(key, ());
                }
                Record::Deleted(key) | Record::Missing(key) => {
                    alive.remove(&key);
                }
                _ => {}
            }
        }
    }
    let mut keys: Vec<String> = alive.into_keys().collect();
    keys.sort();
    Ok(keys)
}

struct Workload {
    spec: InstanceSpec,
    ledger: Ledger,
    layout: LayoutHandle,
    tier: Option<L1Tier>,
    rng: SplitMix64,
    next_n: u64,
    owned: Vec<String>,
    inherited: Vec<String>,
    /// Guards a reader keeps: until when, and the client's
    /// `views_invalidated` when it was taken.
    held: VecDeque<(Instant, u64, ReadGuard)>,
    client: Client,
    pool: KeyPool,
    tails: Vec<LedgerTail>,
    last_refresh: Option<Instant>,
    /// When the last call succeeded (for [`MAX_UNREACHABLE_MS`]).
    last_success: Instant,
}

/// Runs the instance until it is killed (see the module essay).
pub fn run(spec: InstanceSpec) -> anyhow::Result<()> {
    die_with_parent()?;
    let id = instance_id(spec.role, spec.slot, spec.incarnation);
    let ledger = Ledger::open(&ledger::path_of(&spec.run_dir, spec.slot), spec.incarnation)
        .context("cannot open the ledger")?;
    let inherited = match spec.role {
        Role::Reader => Vec::new(),
        Role::Writer | Role::Tier => inherited_keys(&spec)?,
    };
    let client = connect(&client_config(&spec.socket, &id), MAX_UNREACHABLE_MS)?;
    let layout = client.layout_with(PAGE_SIZE_BYTES, FINGERPRINT, layout_options())?;
    let tier = match spec.role {
        Role::Tier => Some(L1Tier::new(layout.clone(), TierConfig::default())?),
        Role::Writer | Role::Reader => None,
    };
    let seed = spec.seed
        ^ (u64::from(spec.slot) << 48)
        ^ (u64::from(spec.incarnation) << 24)
        ^ 0x00c4_a05c;
    let tails = (0..spec.slots)
        .map(|s| LedgerTail::new(ledger::path_of(&spec.run_dir, s)))
        .collect();
    let mut w = Workload {
        client,
        spec,
        ledger,
        layout,
        tier,
        rng: SplitMix64::new(seed),
        next_n: 0,
        owned: Vec::new(),
        inherited,
        held: VecDeque::new(),
        pool: KeyPool::default(),
        tails,
        last_refresh: None,
        last_success: Instant::now(),
    };
    loop {
        w.step()?;
        anyhow::ensure!(
            w.last_success.elapsed() < Duration::from_millis(MAX_UNREACHABLE_MS),
            "no call succeeded for {MAX_UNREACHABLE_MS} ms"
        );
        let pause = w.rng.range(MIN_PAUSE_MS, MAX_PAUSE_MS);
        std::thread::sleep(Duration::from_millis(pause));
    }
}

impl Workload {
    fn step(&mut self) -> anyhow::Result<()> {
        match self.spec.role {
            Role::Reader => self.read_step(),
            Role::Writer | Role::Tier => {
                let r = self.rng.below(100);
                if !self.inherited.is_empty() && r < 40 {
                    let n = self.batch_len();
                    let keys = take_random(&mut self.inherited, &mut self.rng, n);
                    self.delete(keys, true)
                } else if self.owned.len() >= TARGET_OWNED_KEYS
                    || (!self.owned.is_empty() && r < 30)
                {
                    let n = self.batch_len();
                    let keys = take_random(&mut self.owned, &mut self.rng, n);
                    self.delete(keys, false)
                } else if r < 40 {
                    self.read_step()
                } else {
                    self.put()
                }
            }
        }
    }

    fn batch_len(&mut self) -> usize {
        self.rng.range(1, MAX_BATCH_KEYS) as usize
    }

    fn failed(&mut self, kind: String) -> anyhow::Result<()> {
        tracing::debug!(kind, "call failed");
        self.ledger.append(&[Record::Error(kind)])?;
        std::thread::sleep(Duration::from_millis(ERROR_PAUSE_MS));
        Ok(())
    }

    fn new_key(&mut self, len_bytes: usize) -> KeyName {
        self.next_n += 1;
        KeyName {
            slot: self.spec.slot,
            incarnation: self.spec.incarnation,
            n: self.next_n,
            len_bytes,
        }
    }

    fn put(&mut self) -> anyhow::Result<()> {
        let n = self.batch_len();
        let page = PAGE_SIZE_BYTES;
        if self.tier.is_some() {
            // The tier reserves one length for the whole call.
            let len = self.rng.range(1, page) as usize;
            let names: Vec<KeyName> = (0..n).map(|_| self.new_key(len)).collect();
            return self.tier_put(names);
        }
        let names: Vec<KeyName> = (0..n)
            .map(|_| {
                let len = self.rng.range(1, page) as usize;
                self.new_key(len)
            })
            .collect();
        let items: Vec<(String, Vec<u8>)> = names
            .iter()
            .map(|k| (k.render(), payload::payload(k)))
            .collect();
        let intents: Vec<Record> = items
            .iter()
            .map(|(k, _)| Record::Intent(k.clone()))
            .collect();
        self.ledger.append(&intents)?;
        match self.layout.batch_put(&items) {
            Ok(outcomes) => {
                self.last_success = Instant::now();
                let mut acks = Vec::new();
                for ((key, bytes), outcome) in items.into_iter().zip(outcomes) {
                    match outcome {
                        RegisterOutcome::Inserted => {
                            acks.push(Record::Ack {
                                key: key.clone(),
                                len_bytes: bytes.len(),
                                checksum: payload::checksum(&bytes),
                            });
                            self.owned.push(key);
                        }
                        other => {
                            acks.push(Record::Error(format!("register:{}", outcome_name(&other))))
                        }
                    }
                }
                self.ledger.append(&acks)?;
                Ok(())
            }
            Err(e) => self.failed(error_kind(&e)),
        }
    }

    fn tier_put(&mut self, names: Vec<KeyName>) -> anyhow::Result<()> {
        let Some(tier) = &self.tier else {
            return Ok(());
        };
        let keys: Vec<String> = names.iter().map(KeyName::render).collect();
        let len = names.first().map_or(1, |n| n.len_bytes);
        let pages = tier
            .reserve_write(&keys, &vec![false; keys.len()], len, WriteMode::New)
            .context("reserve_write refused its arguments")?;
        let mut staged = Vec::new();
        let mut errors = Vec::new();
        for ((key, name), kp) in keys.iter().zip(&names).zip(pages) {
            match kp.page {
                Some(mut page) => {
                    // SAFETY: `page` was just returned by `reserve_write`
                    // for `key`, which is not finished yet, and no other
                    // slice of it exists: this tier holds the page
                    // exclusively until `finish_write` below.
                    let bytes = unsafe { page.as_mut_slice() };
                    payload::fill(key.as_bytes(), bytes);
                    staged.push((key.clone(), *name));
                }
                None => errors.push(Record::Error(format!("tier:reserve:{}", kp.code.as_str()))),
            }
        }
        self.ledger.append(&errors)?;
        if staged.is_empty() {
            return Ok(());
        }
        let intents: Vec<Record> = staged
            .iter()
            .map(|(k, _)| Record::Intent(k.clone()))
            .collect();
        self.ledger.append(&intents)?;
        let staged_keys: Vec<&String> = staged.iter().map(|(k, _)| k).collect();
        let codes = tier
            .finish_write(&staged_keys)
            .context("finish_write refused its arguments")?;
        let mut acks = Vec::new();
        for ((key, name), code) in staged.into_iter().zip(codes) {
            if code == TierCode::Success {
                let expected = payload::payload(&name);
                acks.push(Record::Ack {
                    key: key.clone(),
                    len_bytes: expected.len(),
                    checksum: payload::checksum(&expected),
                });
                self.owned.push(key);
                self.last_success = Instant::now();
            } else {
                acks.push(Record::Error(format!(
                    "tier:finish_write:{}",
                    code.as_str()
                )));
            }
        }
        self.ledger.append(&acks)?;
        Ok(())
    }

    /// Deletes `keys` (own, or `inherited` from predecessors); keys the
    /// directory keeps (pinned, or the call failed) go back to their list.
    fn delete(&mut self, keys: Vec<String>, inherited: bool) -> anyhow::Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        let intents: Vec<Record> = keys
            .iter()
            .map(|k| Record::DeleteIntent(k.clone()))
            .collect();
        self.ledger.append(&intents)?;
        let outcomes: Result<Vec<Option<bool>>, String> = match &self.tier {
            Some(tier) => tier
                .delete(&keys, false)
                .context("delete refused its arguments")?
                .into_iter()
                .map(|c| {
                    Ok(match c {
                        TierCode::Success => Some(true),
                        TierCode::KeyNotExist => Some(false),
                        _ => None,
                    })
                })
                .collect(),
            None => self
                .layout
                .batch_delete(&keys)
                .map(|o| {
                    o.into_iter()
                        .map(|o| match o {
                            DeleteOutcome::Deleted => Some(true),
                            DeleteOutcome::Missing => Some(false),
                            DeleteOutcome::Pinned { .. } => None,
                        })
                        .collect()
                })
                .map_err(|e| error_kind(&e)),
        };
        let list = if inherited {
            &mut self.inherited
        } else {
            &mut self.owned
        };
        match outcomes {
            Ok(outcomes) => {
                self.last_success = Instant::now();
                let mut done = Vec::new();
                for (key, outcome) in keys.into_iter().zip(outcomes) {
                    match outcome {
                        Some(true) => done.push(Record::Deleted(key)),
                        Some(false) => done.push(Record::Missing(key)),
                        None => list.push(key),
                    }
                }
                self.ledger.append(&done)?;
                Ok(())
            }
            Err(kind) => {
                list.extend(keys);
                self.failed(kind)
            }
        }
    }

    fn refresh_pool(&mut self) -> anyhow::Result<()> {
        if self
            .last_refresh
            .is_some_and(|t| t.elapsed() < Duration::from_millis(KEY_REFRESH_MS))
        {
            return Ok(());
        }
        self.last_refresh = Some(Instant::now());
        for tail in &mut self.tails {
            let entries = tail.poll().context("cannot read a ledger")?;
            self.pool.apply(entries);
        }
        Ok(())
    }

    fn read_step(&mut self) -> anyhow::Result<()> {
        self.refresh_pool()?;
        let now = Instant::now();
        let mut records = Vec::new();
        let mut verified = 0u64;
        let invalidated = self.client.stats().views_invalidated;
        // Held views whose pins may have been lost since they were taken:
        // the client counts lost pins globally, not per view.
        let mut unsure = Vec::new();
        while self
            .held
            .front()
            .is_some_and(|(until, _, _)| *until <= now || self.held.len() > MAX_HELD_GUARDS)
        {
            let Some((_, invalidated_then, guard)) = self.held.pop_front() else {
                break;
            };
            // A pin keeps the bytes in place for as long as it is held,
            // unless a reconnect could not take it again (counted by the
            // client: the documented limit of views held across one). No
            // view lost its pin since this one was taken: it is checked.
            if invalidated == invalidated_then {
                self.check_held(&guard, &mut records, &mut verified);
            } else {
                unsure.push(guard);
            }
        }
        let skipped = self.check_unsure_held(unsure, &mut records, &mut verified);
        if skipped > 0 {
            records.push(Record::HeldSkipped(skipped));
        }
        let n = self.batch_len() * 2;
        let keys = self.pool.pick(&mut self.rng, n);
        match &self.tier {
            _ if keys.is_empty() => {}
            Some(tier) => {
                let pages = tier
                    .reserve_read(&keys, Holds::ONE)
                    .context("reserve_read refused its arguments")?;
                let mut hits = Vec::new();
                for (key, kp) in keys.iter().zip(&pages) {
                    if let Some(page) = &kp.page {
                        // SAFETY: the read reservation of `key` is held
                        // until the `finish_read` below, and a registered
                        // page is never written while pinned.
                        let bytes = unsafe { page.as_slice() };
                        let how = format!("tier read at {:?}", page.location());
                        check_bytes(key, bytes, &how, &mut records, &mut verified);
                        hits.push(key.clone());
                    }
                }
                if !hits.is_empty() {
                    tier.finish_read(&hits, Holds::ONE)
                        .context("finish_read refused its arguments")?;
                }
                self.last_success = Instant::now();
            }
            None => match self.layout.batch_get(&keys) {
                Ok(guards) => {
                    self.last_success = Instant::now();
                    for (key, guard) in keys.iter().zip(guards) {
                        let Some(guard) = guard else { continue };
                        let how = format!("fresh guard at {:?}", guard.location());
                        check_bytes(key, guard.bytes(), &how, &mut records, &mut verified);
                        if self.spec.role == Role::Reader && self.rng.chance(25) {
                            let hold = Duration::from_millis(self.rng.range(10, MAX_HOLD_MS));
                            self.held.push_back((now + hold, invalidated, guard));
                        }
                    }
                }
                Err(e) => records.push(Record::Error(error_kind(&e))),
            },
        }
        if verified > 0 {
            records.push(Record::Verified(verified));
        }
        self.ledger.append(&records)?;
        if records.iter().any(|r| matches!(r, Record::Error(_))) {
            std::thread::sleep(Duration::from_millis(ERROR_PAUSE_MS));
        }
        Ok(())
    }
}

impl Workload {
    /// Checks the bytes of a held view.
    fn check_held(&self, guard: &ReadGuard, records: &mut Vec<Record>, verified: &mut u64) {
        let key = String::from_utf8_lossy(guard.key()).into_owned();
        let st = self.client.stats();
        let how = format!(
            "held guard at {:?} (client: {} reconnects, {} directory restarts, {} views invalidated, {} unpins dropped)",
            guard.location(),
            st.reconnects,
            st.directory_restarts,
            st.views_invalidated,
            st.unpins_dropped
        );
        check_bytes(&key, guard.bytes(), &how, records, verified);
    }

    /// Judges held views taken before some view lost its pin, one by one:
    /// each key is looked up again (pinned), and a view of a key that is
    /// still registered at the view's location — same region, page and
    /// generation: the page was not reused since — reads the key's bytes
    /// and is checked under the fresh pin; a view whose key is gone or has
    /// moved is unprotected by design and is skipped. Returns how many were
    /// skipped (all of them if the lookup fails).
    fn check_unsure_held(
        &mut self,
        unsure: Vec<ReadGuard>,
        records: &mut Vec<Record>,
        verified: &mut u64,
    ) -> u64 {
        if unsure.is_empty() {
            return 0;
        }
        let keys: Vec<String> = unsure
            .iter()
            .map(|g| String::from_utf8_lossy(g.key()).into_owned())
            .collect();
        let fresh = match self.layout.batch_get(&keys) {
            Ok(fresh) => fresh,
            Err(e) => {
                records.push(Record::Error(error_kind(&e)));
                return unsure.len() as u64;
            }
        };
        self.last_success = Instant::now();
        let mut skipped = 0;
        for (held, fresh) in unsure.iter().zip(&fresh) {
            match fresh {
                Some(f) if f.location() == held.location() => {
                    self.check_held(held, records, verified)
                }
                _ => skipped += 1,
            }
        }
        skipped
    }
}

fn outcome_name(o: &RegisterOutcome) -> &'static str {
    match o {
        RegisterOutcome::Inserted => "inserted",
        RegisterOutcome::Duplicate(_) => "duplicate",
        RegisterOutcome::Rejected(_) => "rejected",
    }
}

/// Checks one read chunk against its key's payload; `how` says which read
/// it was (for the torn-read record).
fn check_bytes(key: &str, bytes: &[u8], how: &str, records: &mut Vec<Record>, verified: &mut u64) {
    if payload::is_intact(key.as_bytes(), bytes) {
        *verified += 1;
    } else {
        records.push(Record::Torn {
            key: key.to_owned(),
            detail: format!("{how}: {} bytes read", bytes.len()),
        });
    }
}
