//! The invariant checker: after every chaos step it compares what the
//! ledgers say was acknowledged with what the server and the pool manager
//! hold now.
//!
//! It has a client of its own (instance `checker`, the workload's layout,
//! no regions) and a model of every key named in a ledger: intent,
//! acknowledgement (with length and checksum), delete intent, outcome. The
//! driver tells it which incarnations died when, and when the server was
//! restarted; from that it decides, per key, whether a missing key is
//! allowed to be missing (DESIGN §4, §8; `docs/operations.md`, "Restart"):
//!
//! - a delete of it was sent (a delete intent, or an outcome);
//! - its writer died and the directory restarted after that death (keys
//!   whose owner does not reattach are lost with a restart);
//! - its writer died and, after that death, the checker saw the
//!   directory's orphan-eviction counter rise (watermark eviction takes
//!   only keys whose owner is gone). The run keeps the pool far below the
//!   watermark, so this is reported (`orphan_evictions`,
//!   `keys_gone_by_eviction`) and `tests/chaos.rs` asserts it never
//!   happens in its run; an eviction excuses no key of a writer that died
//!   after it, and none of a live writer.
//!
//! Anything else missing is lost: `lost_keys` when its writer is alive,
//! `lost_orphan_keys` when the writer is dead (registered keys stay
//! readable after their writer dies). A present key whose bytes are not
//! its payload, or whose checksum differs from the ledger's, is corrupt. A
//! missing key is looked up again for [`SETTLE_MS`] before it is judged,
//! since live owners re-register their keys after a directory restart in
//! the background.
//!
//! The other invariants: the pins and sessions of dead incarnations are
//! gone ([`Checker::check_dead_pins`]); the regions the pool manager holds
//! for the directory match the directory's own count and bytes, pool by
//! pool, and its region rows ([`Checker::check_regions`]); the directory holds no more keys than the
//! ledgers can account for.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use cxlkv_controlplane::proto::{
    self, DirectoryTotals, PoolStats, PoolStatsReply, PoolUsage, RegionRow, RequestMeta, StatsReply,
};
use cxlkv_controlplane::transport::{self, Endpoint, RpcClient};

use super::instance::{self, client_config, layout_options};
use super::ledger::{self, LedgerTail, Record};
use super::payload::{self, KeyName};
use super::{DIRECTORY_ID, FINGERPRINT, PAGE_SIZE_BYTES, Role};
use crate::client::{Client, DeleteOutcome, LayoutHandle};

/// How long a missing key is looked up again before it is judged.
pub const SETTLE_MS: u64 = 15_000;
/// How long dead sessions' pins and the region counts may take to settle.
pub const PIN_SETTLE_MS: u64 = 10_000;
pub const REGION_SETTLE_MS: u64 = 10_000;
/// Keys per lookup or delete batch.
const BATCH_KEYS: usize = 256;
/// Most violation messages kept for the report.
pub const MAX_VIOLATIONS: usize = 50;
/// How long one call of the checker may take (connects included).
const CALL_TIMEOUT_MS: u64 = 60_000;
const POLL: Duration = Duration::from_millis(200);

/// Error kinds that follow from the chaos itself (a server or pool manager
/// being restarted under a call), not from a defect: counted apart, and
/// bounded ([`expected_errors_over_bound`]).
pub const EXPECTED_ERROR_KINDS: &[&str] = &[
    "unanswered",
    "indeterminate",
    "reconnect_failed",
    "tier:finish_write:KEY_IN_WRONG_STATE",
];

/// Most failed calls of one expected kind per instance slot and per
/// restart of the server or the pool manager. An instance has one call in
/// flight at a time, so a restart fails at most one of its calls under it;
/// the calls it starts while the daemon is down each wait out the client's
/// reconnect retries (seconds) before they fail, so only a few fit in one
/// restart. Without a restart none of these kinds may happen at all.
pub const EXPECTED_ERRORS_PER_RESTART_AND_INSTANCE: u64 = 4;

/// The expected error kinds whose count is over its bound —
/// [`EXPECTED_ERRORS_PER_RESTART_AND_INSTANCE`] × `instances` ×
/// `restarts` (server and pool-manager restarts of the run) — as
/// `(kind, count, bound)`.
pub fn expected_errors_over_bound(
    kinds: &BTreeMap<String, u64>,
    instances: u32,
    restarts: u64,
) -> Vec<(String, u64, u64)> {
    let bound = EXPECTED_ERRORS_PER_RESTART_AND_INSTANCE
        .saturating_mul(u64::from(instances))
        .saturating_mul(restarts);
    kinds
        .iter()
        .filter(|&(_, &n)| n > bound)
        .map(|(k, &n)| (k.clone(), n, bound))
        .collect()
}

#[derive(Debug, Clone, Default)]
struct KeyState {
    acked: Option<(usize, u64)>,
    /// A delete was sent (by some incarnation), outcome perhaps unknown.
    delete_sent_by: Vec<u32>,
    /// When a delete's outcome was recorded (`Deleted` or `Missing`).
    done_at: Option<u64>,
}

/// The counters the report is made of.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    pub checks: u64,
    pub acknowledged_keys: u64,
    pub deleted_keys: u64,
    pub keys_verified: u64,
    pub reads_verified: u64,
    /// Held views not checked: their key's pin was lost and the key is no
    /// longer where they read.
    pub held_reads_skipped: u64,
    pub lost_keys: u64,
    pub lost_orphan_keys: u64,
    pub corrupt_keys: u64,
    pub keys_gone_by_restart: u64,
    /// Keys of dead writers missing after an orphan eviction that followed
    /// the writer's death.
    pub keys_gone_by_eviction: u64,
    pub torn_reads: u64,
    pub leaked_pins: u64,
    /// Dead incarnations still shown with a session (each counted once).
    pub dead_sessions: u64,
    /// Checks at which the pin total was not the sum over instances.
    pub pin_total_mismatches: u64,
    pub region_mismatches: u64,
    pub unaccounted_keys: u64,
    pub resurrected_keys: u64,
    pub orphan_evictions: u64,
    pub ledger_malformed_lines: u64,
    pub errors: BTreeMap<String, u64>,
    pub expected_errors: BTreeMap<String, u64>,
    pub violations: Vec<String>,
}

impl Tally {
    pub fn violation(&mut self, msg: String) {
        tracing::error!("chaos invariant violated: {msg}");
        if self.violations.len() < MAX_VIOLATIONS {
            self.violations.push(msg);
        }
    }

    /// Counts dead incarnations the directory still shows with sessions or
    /// pins once settled: `(instance id, pins, sessions)`. Each id is
    /// counted once per run (`reported`); a session without pins is a
    /// dead session just as much as one holding pins.
    fn dead_holders(&mut self, holding: Vec<(String, u64, u32)>, reported: &mut HashSet<String>) {
        for (id, pins, sessions) in holding {
            if !reported.insert(id.clone()) {
                continue;
            }
            self.leaked_pins += pins;
            if sessions > 0 {
                self.dead_sessions += 1;
            }
            self.violation(format!(
                "dead instance {id} still has {sessions} sessions and {pins} pins after {PIN_SETTLE_MS} ms"
            ));
        }
    }
}

/// What the driver knows about deaths and restarts.
#[derive(Debug, Default)]
pub struct History {
    /// Death time (ms since the epoch) of each dead incarnation, by
    /// `(slot, incarnation)`.
    pub deaths: HashMap<(u32, u32), u64>,
    /// When each server restart began (ms since the epoch).
    pub server_restarts: Vec<u64>,
}

impl History {
    /// Why the acknowledged key `name`, missing at `at_ms`, may be missing
    /// — judged by its own writer alone: that incarnation died, and then
    /// either the directory restarted (by `at_ms`: a dead owner's keys are
    /// lost with the restart) or the checker saw an orphan eviction
    /// (`last_orphan_eviction_at`, the time of the latest statistics that
    /// showed the counter rise; it comes after the eviction it shows, so
    /// the rule is never stricter than the directory's). `None`: it may
    /// not be. Another writer's death, or an eviction before this
    /// writer's death, excuses nothing.
    fn excuse(
        &self,
        name: &KeyName,
        at_ms: u64,
        last_orphan_eviction_at: Option<u64>,
    ) -> Option<Excuse> {
        let died = *self.deaths.get(&(name.slot, name.incarnation))?;
        if self.died_before_a_restart(name.slot, name.incarnation, at_ms) {
            Some(Excuse::WriterDiedBeforeARestart)
        } else if last_orphan_eviction_at.is_some_and(|e| died < e) {
            Some(Excuse::WriterDiedBeforeAnOrphanEviction)
        } else {
            None
        }
    }

    fn died_before_a_restart(&self, slot: u32, incarnation: u32, by_ms: u64) -> bool {
        self.deaths
            .get(&(slot, incarnation))
            .is_some_and(|d| self.server_restarts.iter().any(|r| *d < *r && *r <= by_ms))
    }

    fn is_dead(&self, slot: u32, incarnation: u32) -> bool {
        self.deaths.contains_key(&(slot, incarnation))
    }
}

/// The directory's name of the incarnation that wrote `name`.
fn writer_of(name: &KeyName) -> String {
    instance::instance_id(Role::of_slot(name.slot), name.slot, name.incarnation)
}

/// A documented rule that lets an acknowledged key be missing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Excuse {
    WriterDiedBeforeARestart,
    WriterDiedBeforeAnOrphanEviction,
}

pub struct Checker {
    socket: PathBuf,
    pool_socket: PathBuf,
    client: Option<(Client, LayoutHandle)>,
    tails: Vec<LedgerTail>,
    keys: HashMap<String, KeyState>,
    judged: HashSet<String>,
    /// Keys whose delete was answered `Deleted` since the last check.
    recently_deleted: Vec<String>,
    pins_reported: HashSet<String>,
    /// Highest `evictions_orphan` seen from the current server incarnation.
    evictions_seen: (u64, u64),
    /// When statistics last showed that counter rise (ms since the
    /// epoch).
    last_orphan_eviction_at: Option<u64>,
    pub tally: Tally,
}

impl std::fmt::Debug for Checker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checker")
            .field("keys", &self.keys.len())
            .field("tally", &self.tally)
            .finish()
    }
}

enum Verdict {
    /// Intact, in this region.
    Intact(u64),
    Corrupt(String),
    Missing,
}

impl Checker {
    pub fn new(run_dir: &Path, slots: u32, socket: PathBuf, pool_socket: PathBuf) -> Self {
        Self {
            socket,
            pool_socket,
            client: None,
            tails: (0..slots)
                .map(|s| LedgerTail::new(ledger::path_of(run_dir, s)))
                .collect(),
            keys: HashMap::new(),
            judged: HashSet::new(),
            recently_deleted: Vec::new(),
            pins_reported: HashSet::new(),
            evictions_seen: (0, 0),
            last_orphan_eviction_at: None,
            tally: Tally::default(),
        }
    }

    /// The checker's client and layout, connecting (again) when needed.
    fn session(&mut self) -> anyhow::Result<(Client, LayoutHandle)> {
        if let Some(s) = &self.client {
            return Ok(s.clone());
        }
        let client = instance::connect(&client_config(&self.socket, "checker"), CALL_TIMEOUT_MS)?;
        let layout = client.layout_with(PAGE_SIZE_BYTES, FINGERPRINT, layout_options())?;
        self.client = Some((client.clone(), layout.clone()));
        Ok((client, layout))
    }

    /// Runs `f` on the checker's layout; on failure reconnects once (the
    /// server may have been restarted longer than the client's reconnect
    /// window ago).
    fn with_layout<T>(
        &mut self,
        what: &str,
        mut f: impl FnMut(&Client, &LayoutHandle) -> Result<T, crate::client::ClientError>,
    ) -> anyhow::Result<T> {
        let (client, layout) = self.session()?;
        match f(&client, &layout) {
            Ok(v) => Ok(v),
            Err(e) => {
                tracing::warn!(error = %e, "checker: {what} failed; reconnecting");
                self.close();
                let (client, layout) = self.session()?;
                f(&client, &layout).with_context(|| format!("checker: {what}"))
            }
        }
    }

    /// The directory's statistics (instances and regions tables).
    pub fn directory_stats(&mut self) -> anyhow::Result<StatsReply> {
        let stats = self.with_layout("stats", |c, _| {
            c.directory_stats(proto::sections::INSTANCES | proto::sections::REGIONS)
        })?;
        // Counters restart with the server: track the running maximum per
        // incarnation of the directory.
        let evictions = stats.totals.evictions_orphan;
        if self.evictions_seen.0 != stats.directory_epoch {
            self.evictions_seen = (stats.directory_epoch, 0);
        }
        if evictions > self.evictions_seen.1 {
            let new = evictions - self.evictions_seen.1;
            self.tally.orphan_evictions += new;
            self.evictions_seen.1 = evictions;
            // The pool is sized so that the workload stays far below the
            // eviction watermark (`tests/chaos.rs` asserts none); a run
            // that does reach it (`--server-restart-every 0`, a long
            // soak) is told so, and the dead writers' keys it took are
            // excused only if they died before this was seen.
            self.last_orphan_eviction_at = Some(ledger::now_ms());
            tracing::warn!(
                evicted = new,
                in_run = self.tally.orphan_evictions,
                "checker: the directory evicted orphaned keys (the {} MiB pool reached its watermark)",
                super::POOL_SIZE_BYTES >> 20
            );
        }
        Ok(stats)
    }

    /// The pool manager's occupancy (no session needed).
    pub fn pool_stats(&self) -> anyhow::Result<PoolStatsReply> {
        let rpc = RpcClient::connect(
            &Endpoint::Unix(self.pool_socket.clone()),
            transport::ClientConfig::default(),
        )
        .context("cannot connect to the pool manager")?;
        let mut frame = Vec::new();
        proto::encode(
            0,
            &PoolStats {
                meta: RequestMeta::default(),
            },
            &mut frame,
        )?;
        let payload = frame.split_off(cxlkv_controlplane::frame::HEADER_BYTES);
        let reply = rpc.call(
            <PoolStats as proto::Message>::KIND.as_u16(),
            &payload,
            Duration::from_millis(CALL_TIMEOUT_MS),
        )?;
        let frame = cxlkv_controlplane::frame::Frame {
            header: reply.header,
            payload: reply.payload(),
        };
        match proto::access_reply::<PoolStatsReply>(frame)? {
            Ok(a) => Ok(proto::deserialize::<PoolStatsReply>(a)?),
            Err(e) => anyhow::bail!("pool stats refused: {}", e.message()),
        }
    }

    /// Reads what the ledgers gained since the last call.
    fn poll_ledgers(&mut self, history: &History) -> anyhow::Result<()> {
        for slot in 0..self.tails.len() {
            let entries = self.tails[slot].poll().context("cannot read a ledger")?;
            for e in entries {
                self.apply(e, history);
            }
        }
        self.tally.ledger_malformed_lines = self.tails.iter().map(|t| t.malformed_lines).sum();
        Ok(())
    }

    fn apply(&mut self, e: ledger::Entry, history: &History) {
        match e.record {
            Record::Intent(key) => {
                self.keys.entry(key).or_default();
            }
            Record::Ack {
                key,
                len_bytes,
                checksum,
            } => {
                self.tally.acknowledged_keys += 1;
                self.keys.entry(key).or_default().acked = Some((len_bytes, checksum));
            }
            Record::DeleteIntent(key) => {
                self.keys
                    .entry(key)
                    .or_default()
                    .delete_sent_by
                    .push(e.incarnation);
            }
            Record::Deleted(key) => {
                self.tally.deleted_keys += 1;
                self.keys.entry(key.clone()).or_default().done_at = Some(e.t_ms);
                self.recently_deleted.push(key);
            }
            Record::Missing(key) => {
                let state = self.keys.entry(key.clone()).or_default();
                state.done_at = Some(e.t_ms);
                // An earlier delete whose outcome was never recorded (its
                // sender died, or its reply was lost) may have done it.
                let earlier_delete = state.delete_sent_by.len() > 1;
                if state.acked.is_some() && !earlier_delete {
                    self.judge_missing(&key, e.t_ms, history, "a delete found it missing");
                }
            }
            Record::Torn { key, detail } => {
                self.tally.torn_reads += 1;
                self.tally.violation(format!(
                    "torn read of {key} by incarnation {}: {detail}",
                    e.incarnation
                ));
            }
            Record::Error(kind) => {
                let map = if EXPECTED_ERROR_KINDS.contains(&kind.as_str()) {
                    &mut self.tally.expected_errors
                } else {
                    &mut self.tally.errors
                };
                *map.entry(kind).or_default() += 1;
            }
            Record::Verified(n) => self.tally.reads_verified += n,
            Record::HeldSkipped(n) => self.tally.held_reads_skipped += n,
        }
    }

    /// A missing acknowledged key: allowed by a documented rule, or lost.
    fn judge_missing(&mut self, key: &str, at_ms: u64, history: &History, how: &str) {
        if !self.judged.insert(key.to_owned()) {
            return;
        }
        let Some(name) = KeyName::parse(key.as_bytes()) else {
            self.tally.lost_keys += 1;
            self.tally
                .violation(format!("{key}: not a chaos key ({how})"));
            return;
        };
        let dead = history.is_dead(name.slot, name.incarnation);
        if dead
            && history
                .excuse(&name, at_ms, self.last_orphan_eviction_at)
                .is_none()
        {
            // An eviction since the last statistics would excuse it: look
            // once more before judging (the first refusal is the verdict
            // if the statistics cannot be had).
            if let Err(e) = self.directory_stats() {
                tracing::warn!(error = %e, "checker: no statistics before judging {key}");
            }
        }
        match history.excuse(&name, at_ms, self.last_orphan_eviction_at) {
            Some(Excuse::WriterDiedBeforeARestart) => self.tally.keys_gone_by_restart += 1,
            Some(Excuse::WriterDiedBeforeAnOrphanEviction) => self.tally.keys_gone_by_eviction += 1,
            None if dead => {
                self.tally.lost_orphan_keys += 1;
                self.tally.violation(format!(
                    "{key}: its writer is dead, no restart or orphan eviction since; {how}"
                ));
            }
            None => {
                self.tally.lost_keys += 1;
                self.tally
                    .violation(format!("{key}: its writer is alive; {how}"));
            }
        }
    }

    /// Looks `keys` up (pinning, then releasing at once) and checks bytes.
    fn lookup(&mut self, keys: &[String]) -> anyhow::Result<Vec<Verdict>> {
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(BATCH_KEYS) {
            let guards = self.with_layout("lookup", |_, l| l.batch_get(chunk))?;
            for (key, guard) in chunk.iter().zip(guards) {
                let verdict = match guard {
                    None => Verdict::Missing,
                    Some(g) => {
                        let bytes = g.bytes();
                        let expected = self.keys.get(key).and_then(|s| s.acked);
                        if !payload::is_intact(key.as_bytes(), bytes) {
                            Verdict::Corrupt(format!("{} bytes, not its payload", bytes.len()))
                        } else if let Some((len, sum)) = expected
                            && (len != bytes.len() || sum != payload::checksum(bytes))
                        {
                            Verdict::Corrupt("differs from the ledger's length or checksum".into())
                        } else {
                            Verdict::Intact(g.location().region)
                        }
                    }
                };
                out.push(verdict);
            }
        }
        if let Some((client, _)) = &self.client {
            // Our pins must not make the workload's deletes answer Pinned.
            let _ = client.flush_unpins();
        }
        Ok(out)
    }

    /// Every acknowledged key that no delete touched must be readable with
    /// its exact bytes (or be missing by a documented rule).
    pub fn check_keys(&mut self, history: &History) -> anyhow::Result<()> {
        self.tally.checks += 1;
        self.poll_ledgers(history)?;
        let expected = |k: &String, s: &KeyState, judged: &HashSet<String>| {
            s.acked.is_some() && s.done_at.is_none() && !judged.contains(k)
        };
        let candidates: Vec<String> = self
            .keys
            .iter()
            .filter(|(k, s)| expected(k, s, &self.judged))
            .map(|(k, _)| k.clone())
            .collect();
        let mut missing = Vec::new();
        let mut found = Vec::new();
        for (key, verdict) in candidates.iter().zip(self.lookup(&candidates)?) {
            match verdict {
                Verdict::Intact(region) => {
                    self.tally.keys_verified += 1;
                    found.push((key.clone(), region));
                }
                Verdict::Corrupt(why) => {
                    if self.judged.insert(key.clone()) {
                        self.tally.corrupt_keys += 1;
                        self.tally.violation(format!("{key}: corrupt: {why}"));
                    }
                }
                Verdict::Missing => missing.push(key.clone()),
            }
        }
        self.check_key_owners(&found)?;
        let deadline = Instant::now() + Duration::from_millis(SETTLE_MS);
        loop {
            // A delete may have been sent since the lookup.
            self.poll_ledgers(history)?;
            missing.retain(|k| {
                self.keys
                    .get(k)
                    .is_some_and(|s| s.delete_sent_by.is_empty() && s.done_at.is_none())
            });
            // Keys missing by a rule need no second look.
            let now = ledger::now_ms();
            let evicted_at = self.last_orphan_eviction_at;
            let (excused, rest): (Vec<String>, Vec<String>) = missing.into_iter().partition(|k| {
                KeyName::parse(k.as_bytes())
                    .is_some_and(|n| history.excuse(&n, now, evicted_at).is_some())
            });
            for k in excused {
                self.judge_missing(&k, now, history, "missing at a check");
            }
            missing = rest;
            if missing.is_empty() || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(POLL * 2);
            let verdicts = self.lookup(&missing)?;
            missing = missing
                .into_iter()
                .zip(verdicts)
                .filter_map(|(k, v)| matches!(v, Verdict::Missing).then_some(k))
                .collect();
        }
        let now = ledger::now_ms();
        for k in missing {
            self.judge_missing(
                &k,
                now,
                history,
                &format!("missing at a check for {SETTLE_MS} ms"),
            );
        }
        Ok(())
    }

    /// Each key found intact lies in a region of its own writer: the
    /// directory's row for the region it was found in names the key's
    /// writer incarnation as the region's owner. Region ids are never
    /// reused and a region's owner never changes, so a row listed after
    /// the lookup describes the region the key was found in; a region no
    /// longer listed (freed since) is not judged, nor are cut-short rows.
    fn check_key_owners(&mut self, found: &[(String, u64)]) -> anyhow::Result<()> {
        if found.is_empty() {
            return Ok(());
        }
        let stats = self.directory_stats()?;
        if stats.truncated {
            return Ok(());
        }
        let owners: HashMap<u64, &str> = stats
            .regions
            .iter()
            .map(|r| (r.region, r.owner_instance.as_str()))
            .collect();
        let mut wrong = Vec::new();
        for (key, region) in found {
            let Some(name) = KeyName::parse(key.as_bytes()) else {
                continue;
            };
            let writer = writer_of(&name);
            if let Some(&owner) = owners.get(region)
                && owner != writer
            {
                wrong.push(format!(
                    "{key}: found in region {region}, which the directory lists as {owner}'s, not its writer {writer}'s"
                ));
            }
        }
        for msg in wrong {
            self.tally.region_mismatches += 1;
            self.tally.violation(msg);
        }
        Ok(())
    }

    /// Deleted keys stay deleted: keys are never registered twice, so a
    /// key answered `Deleted` that exists again was registered again by
    /// someone (e.g. a stale re-registration) — and names a page that may
    /// hold another key's bytes by now.
    pub fn check_resurrected(&mut self, history: &History) -> anyhow::Result<()> {
        self.poll_ledgers(history)?;
        let keys = std::mem::take(&mut self.recently_deleted);
        for chunk in keys.chunks(BATCH_KEYS) {
            let present = self.with_layout("exists", |_, l| l.batch_exists(chunk))?;
            for (key, present) in chunk.iter().zip(present) {
                if present {
                    self.tally.resurrected_keys += 1;
                    self.tally
                        .violation(format!("{key}: exists again after it was deleted"));
                }
            }
        }
        Ok(())
    }

    /// The sessions and pins of dead incarnations are gone (waits up to
    /// [`PIN_SETTLE_MS`] for the directory to notice a death), and the pin
    /// total equals the sum over instances.
    pub fn check_dead_pins(&mut self, dead_ids: &[String]) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_millis(PIN_SETTLE_MS);
        loop {
            let stats = self.directory_stats()?;
            let holding: Vec<(String, u64, u32)> = stats
                .instances
                .iter()
                .filter(|r| dead_ids.contains(&r.instance_id) && (r.pins > 0 || r.sessions > 0))
                .map(|r| (r.instance_id.clone(), r.pins, r.sessions))
                .collect();
            let sum: u64 = stats.instances.iter().map(|r| r.pins).sum();
            let consistent = stats.truncated || sum == stats.totals.pins;
            if holding.is_empty() && consistent {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.tally.dead_holders(holding, &mut self.pins_reported);
                if !consistent {
                    self.tally.pin_total_mismatches += 1;
                    self.tally.violation(format!(
                        "directory pins total {} but its instances hold {sum}",
                        stats.totals.pins
                    ));
                }
                return Ok(());
            }
            std::thread::sleep(POLL);
        }
    }

    /// The pool manager holds exactly the directory's regions (count and
    /// bytes, per pool; the directory's region rows are distinct and add up
    /// to its totals: `regions_differ`), and its own free space adds up;
    /// waits up to
    /// [`REGION_SETTLE_MS`] for requests in flight.
    pub fn check_regions(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_millis(REGION_SETTLE_MS);
        loop {
            let dir = self.directory_stats()?;
            let pool = self.pool_stats()?;
            let problem = region_mismatch(&dir, &pool);
            let Some(problem) = problem else {
                return Ok(());
            };
            if Instant::now() >= deadline {
                self.tally.region_mismatches += 1;
                self.tally.violation(problem);
                return Ok(());
            }
            std::thread::sleep(POLL);
        }
    }

    /// The directory holds no key that no ledger names as intended and not
    /// yet deleted (a page nobody can account for).
    pub fn check_unaccounted(&mut self, history: &History) -> anyhow::Result<()> {
        let asked_ms = ledger::now_ms();
        let dir = self.directory_stats()?;
        // Intents are written before registering, so reading the ledgers
        // after the stats makes the set of possible keys a superset; a
        // delete outcome counts only if it was recorded before the stats
        // were asked for (the directory had executed it by then).
        self.poll_ledgers(history)?;
        let possible = self
            .keys
            .values()
            .filter(|s| s.done_at.is_none_or(|t| t >= asked_ms))
            .count() as u64;
        if dir.totals.keys > possible {
            self.tally.unaccounted_keys =
                self.tally.unaccounted_keys.max(dir.totals.keys - possible);
            self.tally.violation(format!(
                "the directory holds {} keys; the ledgers account for at most {possible}",
                dir.totals.keys
            ));
        }
        Ok(())
    }

    /// Deletes every key any ledger names and no delete removed (the run's
    /// end: no instance is alive). Returns keys that stayed pinned.
    pub fn delete_all(&mut self, history: &History) -> anyhow::Result<u64> {
        self.poll_ledgers(history)?;
        let mut left: Vec<String> = self
            .keys
            .iter()
            .filter(|(_, s)| s.done_at.is_none())
            .map(|(k, _)| k.clone())
            .collect();
        left.sort();
        let deadline = Instant::now() + Duration::from_millis(PIN_SETTLE_MS);
        loop {
            let mut pinned = Vec::new();
            for chunk in left.chunks(BATCH_KEYS) {
                let outcomes = self.with_layout("delete", |_, l| l.batch_delete(chunk))?;
                for (key, o) in chunk.iter().zip(outcomes) {
                    match o {
                        DeleteOutcome::Deleted | DeleteOutcome::Missing => {
                            if o == DeleteOutcome::Deleted {
                                self.tally.deleted_keys += 1;
                            }
                            if let Some(s) = self.keys.get_mut(key) {
                                s.done_at = Some(ledger::now_ms());
                            }
                        }
                        DeleteOutcome::Pinned { .. } => pinned.push(key.clone()),
                    }
                }
            }
            if pinned.is_empty() || Instant::now() >= deadline {
                return Ok(pinned.len() as u64);
            }
            left = pinned;
            std::thread::sleep(POLL);
        }
    }

    /// Closes the checker's session.
    pub fn close(&mut self) {
        if let Some((client, layout)) = self.client.take() {
            drop(layout);
            let _ = client.close();
        }
    }
}

/// A description of how the pool manager's view of the directory's
/// regions differs from the directory's, if it does.
fn region_mismatch(dir: &StatsReply, pool: &PoolStatsReply) -> Option<String> {
    regions_differ(&dir.totals, &dir.regions, dir.truncated, &pool.pools)
}

/// [`region_mismatch`] over its parts: the directory's totals and region
/// rows (`truncated`: the rows may be cut short), the pool manager's pools.
///
/// The pool manager tells only how many regions and bytes each directory
/// holds per pool (a region listing needs a connection bound to the
/// directory, which the server holds), so the regions are compared per
/// pool by count and bytes — the directory's rows against the pool
/// manager's count for [`DIRECTORY_ID`] in each pool — and the rows
/// themselves must be distinct regions adding up to the directory's
/// totals.
fn regions_differ(
    totals: &DirectoryTotals,
    rows: &[RegionRow],
    truncated: bool,
    pools: &[PoolUsage],
) -> Option<String> {
    let mut pool_regions = 0;
    let mut pool_bytes = 0;
    // Per pool: (regions, bytes) the pool manager holds for the directory.
    let mut pool_side: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    for p in pools {
        let owners_bytes: u64 = p.owners.iter().map(|o| o.bytes).sum();
        if p.total_bytes - p.free_bytes != owners_bytes {
            return Some(format!(
                "pool {}: {} bytes allocated but its owners hold {owners_bytes}",
                p.pool,
                p.total_bytes - p.free_bytes
            ));
        }
        for o in p.owners.iter().filter(|o| o.directory_id == DIRECTORY_ID) {
            pool_regions += o.regions;
            pool_bytes += o.bytes;
            let e = pool_side.entry(p.pool).or_default();
            e.0 += o.regions;
            e.1 += o.bytes;
        }
    }
    let t = totals;
    if t.pending_region_requests > 0 {
        return Some(format!(
            "{} region requests pending",
            t.pending_region_requests
        ));
    }
    if pool_regions != t.regions || pool_bytes != t.owned_bytes {
        return Some(format!(
            "the pool manager holds {pool_regions} regions ({pool_bytes} bytes) for the directory, which holds {} ({} bytes)",
            t.regions, t.owned_bytes
        ));
    }
    if truncated {
        return None;
    }
    let mut ids = HashSet::new();
    let mut dir_side: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    for r in rows {
        if !ids.insert(r.region) {
            return Some(format!("the directory lists region {} twice", r.region));
        }
        let e = dir_side.entry(r.pool).or_default();
        e.0 += 1;
        e.1 += r.len_bytes;
    }
    let (rows_regions, rows_bytes) = dir_side
        .values()
        .fold((0, 0), |(n, b), &(rn, rb)| (n + rn, b + rb));
    if rows_regions != t.regions || rows_bytes != t.owned_bytes {
        return Some(format!(
            "the directory lists {rows_regions} regions ({rows_bytes} bytes) but counts {} ({} bytes)",
            t.regions, t.owned_bytes
        ));
    }
    pool_side.retain(|_, v| *v != (0, 0));
    (dir_side != pool_side).then(|| {
        format!(
            "per pool, (regions, bytes) the directory lists {dir_side:?} differ from the pool manager's {pool_side:?}"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_writers_key_may_vanish_only_after_a_restart_that_followed_its_death() {
        let mut h = History::default();
        h.deaths.insert((0, 1), 1_000);
        h.server_restarts.push(500);
        assert!(h.is_dead(0, 1));
        assert!(!h.is_dead(0, 2), "its successor is alive");
        // The restart came before the death: the writer reattached.
        assert!(!h.died_before_a_restart(0, 1, 5_000));
        h.server_restarts.push(2_000);
        // Observed before that restart: no rule explains it yet.
        assert!(!h.died_before_a_restart(0, 1, 1_500));
        assert!(h.died_before_a_restart(0, 1, 2_000));
        assert!(!h.died_before_a_restart(0, 2, 9_000), "live writers never");
    }

    #[test]
    fn a_dead_instance_still_holding_a_session_without_pins_is_counted_once() {
        let mut tally = Tally::default();
        let mut reported = HashSet::new();
        tally.dead_holders(vec![("w0.1".into(), 0, 1)], &mut reported);
        assert_eq!(tally.dead_sessions, 1);
        assert_eq!(tally.leaked_pins, 0);
        assert_eq!(tally.violations.len(), 1, "{:?}", tally.violations);
        // Seen again at the next check: not counted twice.
        tally.dead_holders(vec![("w0.1".into(), 0, 1)], &mut reported);
        assert_eq!(tally.dead_sessions, 1);
        // Pins without a session (its session ended, its pins did not).
        tally.dead_holders(vec![("r1.1".into(), 3, 0)], &mut reported);
        assert_eq!((tally.dead_sessions, tally.leaked_pins), (1, 3));
    }

    fn name(slot: u32, incarnation: u32) -> KeyName {
        KeyName {
            slot,
            incarnation,
            n: 7,
            len_bytes: 1024,
        }
    }

    #[test]
    fn a_missing_key_is_excused_only_by_its_own_writers_death_before_a_restart() {
        let history = History {
            // Slot 0's first incarnation died at 100, slot 1's at 300.
            deaths: HashMap::from([((0, 1), 100), ((1, 1), 300)]),
            server_restarts: vec![200],
        };
        let restart = Some(Excuse::WriterDiedBeforeARestart);
        // Died at 100, restart at 200: excused from 200 on, not before.
        assert_eq!(history.excuse(&name(0, 1), 250, None), restart);
        assert_eq!(history.excuse(&name(0, 1), 150, None), None);
        // Died at 300, after the only restart: no excuse, although another
        // writer's keys are excused and the directory did restart.
        assert_eq!(history.excuse(&name(1, 1), 1000, None), None);
        // Alive (slot 0's second incarnation, slot 2): never excused.
        assert_eq!(history.excuse(&name(0, 2), 1000, None), None);
        assert_eq!(history.excuse(&name(2, 1), 1000, None), None);
        // No restart at all: no dead writer's key is excused.
        let no_restart = History {
            server_restarts: vec![],
            ..history
        };
        assert_eq!(no_restart.excuse(&name(0, 1), 1000, None), None);
        // An orphan eviction seen after a writer's death excuses its keys;
        // one seen before (at 250: slot 1's writer died at 300) excuses
        // none of its keys, and no eviction excuses a live writer's.
        let eviction = Some(Excuse::WriterDiedBeforeAnOrphanEviction);
        assert_eq!(no_restart.excuse(&name(0, 1), 1000, Some(250)), eviction);
        assert_eq!(no_restart.excuse(&name(1, 1), 1000, Some(250)), None);
        assert_eq!(no_restart.excuse(&name(1, 1), 1000, Some(400)), eviction);
        assert_eq!(no_restart.excuse(&name(0, 2), 1000, Some(400)), None);
        assert_eq!(no_restart.excuse(&name(2, 1), 1000, Some(400)), None);
    }

    #[test]
    fn expected_errors_are_bounded_per_kind_by_restarts_and_instances() {
        let kinds = BTreeMap::from([
            ("unanswered".to_string(), 33),
            ("reconnect_failed".to_string(), 32),
        ]);
        // 4 per restart and instance: 2 restarts × 4 instances allow 32.
        assert_eq!(
            expected_errors_over_bound(&kinds, 4, 2),
            vec![("unanswered".to_string(), 33, 32)]
        );
        assert!(expected_errors_over_bound(&kinds, 4, 3).is_empty());
        // Without a restart, none is expected.
        let one = BTreeMap::from([("indeterminate".to_string(), 1)]);
        assert_eq!(
            expected_errors_over_bound(&one, 4, 0),
            vec![("indeterminate".to_string(), 1, 0)]
        );
        assert!(expected_errors_over_bound(&BTreeMap::new(), 4, 0).is_empty());
    }

    fn row(region: u64, pool: u32, len_bytes: u64) -> RegionRow {
        RegionRow {
            region,
            pool,
            layout: proto::Layout {
                page_size_bytes: PAGE_SIZE_BYTES,
                fingerprint: FINGERPRINT,
            },
            len_bytes,
            owner_instance: "w0.1".into(),
            owner_present: true,
            keys: 1,
            used_bytes: PAGE_SIZE_BYTES,
            deferred: false,
        }
    }

    fn usage(pool: u32, regions: u64, bytes: u64) -> PoolUsage {
        PoolUsage {
            pool,
            total_bytes: 1 << 30,
            free_bytes: (1 << 30) - bytes,
            largest_free_bytes: (1 << 30) - bytes,
            regions,
            owners: vec![proto::OwnerUsage {
                directory_id: DIRECTORY_ID.into(),
                regions,
                bytes,
            }],
        }
    }

    #[test]
    fn regions_are_compared_per_pool_and_row_by_row_not_only_in_total() {
        let mb = 2 << 20;
        let totals = DirectoryTotals {
            regions: 2,
            owned_bytes: 2 * mb,
            ..DirectoryTotals::default()
        };
        let pools = [usage(0, 1, mb), usage(1, 1, mb)];
        let rows = [row(1, 0, mb), row(2, 1, mb)];
        assert_eq!(regions_differ(&totals, &rows, false, &pools), None);
        // Same totals, but both regions listed in pool 0.
        let moved = [row(1, 0, mb), row(2, 0, mb)];
        let why = regions_differ(&totals, &moved, false, &pools).expect("differs per pool");
        assert!(why.contains("per pool"), "{why}");
        // A region listed twice, totals unchanged.
        let twice = [row(1, 0, mb), row(1, 1, mb)];
        let why = regions_differ(&totals, &twice, false, &pools).expect("a duplicate row");
        assert!(why.contains("twice"), "{why}");
        // Rows that do not add up to the totals.
        let short = [row(1, 0, mb)];
        let why = regions_differ(&totals, &short, false, &pools).expect("rows short");
        assert!(why.contains("lists 1 regions"), "{why}");
        // Cut-short rows are not judged; the totals still are.
        assert_eq!(regions_differ(&totals, &short, true, &pools), None);
        let fewer = [usage(0, 1, mb)];
        assert!(regions_differ(&totals, &rows, true, &fewer).is_some());
    }
}
