//! Sessions: the first `Hello`, and the reconnect-and-reattach procedure
//! that keeps an instance alive across broken connections and directory
//! restarts (DESIGN §4, §8).
//!
//! **Reconnect.** The first request to see its connection break calls
//! [`Shared::reconnect`] with the connection's generation; the others find
//! a newer generation and just retry. Reconnecting retries with exponential
//! backoff (`reconnect_backoff_min_ms` doubling up to `…_max_ms`) for at most
//! `reconnect_timeout_ms`, then fails the request. Each attempt opens a
//! connection and sends `Reattach`: the instance's secret, every region it
//! owns with its token and layout (those out of their table on their way
//! back to the directory too: `layout::Away`), its next sequence number and
//! the highest notice it applied.
//!
//! **What a reattach restores.**
//! - *Resumed* (the directory still knew the instance): keys, notices and
//!   the reply cache are intact, so the requests that were in flight are
//!   retried with their numbers and answered exactly once.
//! - *Recovered* (the directory restarted): every ticket issued before is
//!   void and no longer holds the sequence window back ([`super::seq`]);
//!   regions it refuses are dropped (with their keys), and the instance
//!   registers every key of its index again — one fresh number per batch,
//!   as many batches as it takes — before the procedure returns; a flag
//!   keeps that pending across further broken attempts until it completes.
//! - In both cases the old session's pins are gone: the unpins still queued
//!   for it are dropped and the pins of live read guards are taken again
//!   (keys that cannot be pinned any more are counted as invalidated views).
//!
//! **A grant lost in a directory restart.** A `RequestRegion` the pool
//! manager granted but whose reply never arrived (the directory restarted
//! in between) leaves the restarted directory holding a region for this
//! instance that the client has no token for. The directory gives recovered
//! regions only to a reattach presenting one of their tokens, so it refuses
//! a client holding no token with `OwnershipNotProven`. Such a client owns
//! no region and therefore no key: it keeps retrying (a `Retry`, bounded by
//! `reconnect_timeout_ms` per call like any other). When the instance's
//! grace period expires the directory returns the unclaimed regions to the
//! pool and forgets the instance; the next reattach then creates it afresh
//! (`Recovered`, same secret, same sequence and notice numbers) and the
//! call that lost its grant asks again. The directory accepts nothing
//! without a token, so nobody else can claim or free the instance's regions
//! early (docs/security.md).
//!
//! **Fatal.** A reattach refused `InstanceGone` (which this directory
//! never answers to a reattach: it starts an expired instance afresh, as
//! above), a refused secret (`AuthenticationFailed`), the tokens of regions
//! the client holds all refused (`OwnershipNotProven`), or pools that
//! changed identity cannot be resumed: the client records the reason and
//! every later call fails with it.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cxlkv_controlplane::frame::Frame;
use cxlkv_controlplane::proto::{
    self, ErrorCode, Hello, Location, Lookup, LookupReply, Message, OwnedRegion as WireOwnedRegion,
    PROTOCOL_MAX, PROTOCOL_MIN, Reattach, Reattached, Register, RegisterEntry, RegisterOutcome,
    RegisterReply, RequestMeta, Welcome,
};
use cxlkv_controlplane::transport::{Reply, RpcClient};
use parking_lot::MutexGuard;

use super::config::{ClientConfig, ServerAddr};
use super::error::ClientError;
use super::index::IndexedKey;
use super::pools::{self, Pool};
use super::read::PinLedger;
use super::rpc::{Encoded, Fail, Mode};
use super::shared::{Conn, Identity, SettingUp, Shared};

/// Why one reattach attempt failed.
enum Attempt {
    /// Try again after a backoff.
    Retry(ClientError),
    /// The instance cannot be resumed.
    Fatal(ClientError),
}

/// The refusal of a reconnect on a thread that is exiting (see
/// [`SettingUp::enter`]): a call made there after the connection broke
/// fails at once, and a live thread's next call reconnects.
fn exiting_thread() -> ClientError {
    ClientError::ReconnectFailed {
        elapsed_ms: 0,
        last: "this thread is exiting (its thread-local storage is destroyed) and cannot set up \
               a session; a call from a live thread reconnects"
            .to_owned(),
        resumable: true,
    }
}

/// The pre-shared secret goes only to TCP listeners.
fn tcp_secret(cfg: &ClientConfig) -> Option<Vec<u8>> {
    match cfg.server {
        ServerAddr::Tcp(_) => cfg.client_secret.clone(),
        _ => None,
    }
}

/// Decodes the answer to an opening request (`Hello`/`Reattach`) into its
/// owned form; an `ErrorReply` becomes a server error.
fn decode_opening<M: Message>(reply: &Reply, op: &'static str) -> Result<M, ClientError> {
    let frame = Frame {
        header: reply.header,
        payload: reply.payload(),
    };
    match proto::access_reply::<M>(frame) {
        Ok(Ok(archived)) => {
            proto::deserialize::<M>(archived).map_err(|source| ClientError::BadReply { op, source })
        }
        Ok(Err(refusal)) => Err(ClientError::server(
            op,
            refusal.code.to_native(),
            refusal.message.as_str(),
            refusal.limit.to_native(),
        )),
        Err(source) => Err(ClientError::BadReply { op, source }),
    }
}

/// What `connect` hands to the client: the shared state, with a live
/// session.
pub(crate) fn connect(
    cfg: ClientConfig,
    observers: cxlkv_dataplane::map::MapObservers,
) -> Result<Arc<Shared>, ClientError> {
    cfg.validate()?;
    // Before the connection exists: a fork from here on is seen.
    let owner = super::fork::Owner::current();
    let timeout = Duration::from_millis(cfg.request_timeout_ms);
    let rpc = RpcClient::connect(&cfg.server.endpoint(), cfg.transport.clone())
        .map_err(ClientError::Connect)?;
    let hello = Hello {
        meta: RequestMeta::default(),
        protocol_min: PROTOCOL_MIN,
        protocol_max: PROTOCOL_MAX,
        instance_id: cfg.instance_id.clone(),
        client_name: cfg.client_name.clone(),
        client_secret: tcp_secret(&cfg),
    };
    let encoded = Encoded::new(&hello)?;
    let mut reply = rpc
        .call(Hello::KIND.as_u16(), encoded.payload(), timeout)
        .map_err(ClientError::Connect)?;
    let fds = std::mem::take(&mut reply.fds);
    let welcome: Welcome = decode_opening(&reply, "hello")?;
    // The pools' descriptors came with the welcome; nothing later carries
    // any, so replies are read with the cheaper `recv` from here on.
    rpc.decline_fds();
    let pools: Vec<Pool> = if welcome.fds_passed > 0 {
        pools::from_fds(&welcome.pools, fds, cfg.visibility)?
    } else {
        pools::open_by_path(&welcome.pools, &cfg.pool_paths, cfg.visibility)?
    };
    let conn = Conn {
        rpc,
        conn_no: 1,
        session_id: welcome.session_id,
        lease_ms: welcome.lease_ms,
        limits: welcome.limits,
        directory_epoch: welcome.directory_epoch,
        dead: AtomicBool::new(false),
    };
    let shared = Arc::new(Shared {
        owner,
        seqs: super::seq::SeqWindow::new(u64::from(welcome.limits.reply_cache_len)),
        identity: Identity {
            instance_id: welcome.instance_id.clone(),
            secret: welcome.instance_secret,
        },
        cfg,
        pools,
        observers,
        conn: parking_lot::Mutex::new(Some(Arc::new(conn))),
        reconnect_lock: Default::default(),
        reconnect_failure: Default::default(),
        notice_applied: Default::default(),
        notice_lock: Default::default(),
        layouts: Default::default(),
        peers: Default::default(),
        peer_lock: Default::default(),
        retired: Default::default(),
        index: Default::default(),
        unpins: Default::default(),
        live_pins: Default::default(),
        unresolved: Default::default(),
        unresolved_regions: Default::default(),
        reregister_pending: Default::default(),
        epoch_seen: AtomicU64::new(welcome.directory_epoch),
        #[cfg(test)]
        before_repin: Default::default(),
        #[cfg(test)]
        before_return: Default::default(),
        #[cfg(test)]
        before_put_back: Default::default(),
        #[cfg(test)]
        unpins_not_sent: Default::default(),
        fatal: Default::default(),
        has_fatal: Default::default(),
        owned_bytes: Default::default(),
        usage: Default::default(),
        stats: Default::default(),
        closing: Default::default(),
        wake: Default::default(),
        unpin_timer_armed: Default::default(),
        last_sent_ms: Default::default(),
        clock: Instant::now(),
        stamp: Default::default(),
    });
    shared.usage.store(welcome.meta.usage);
    shared.apply_notices(welcome.meta.notices.iter().copied());
    Ok(shared)
}

impl Shared {
    /// Re-establishes the session after connection generation `failed_conn_no`
    /// broke (see the module docs). Returns once a newer connection is up.
    pub fn reconnect(&self, failed_conn_no: u64) -> Result<(), ClientError> {
        let timeout = Duration::from_millis(self.cfg.reconnect_timeout_ms);
        // One deadline for the whole call, its wait for another thread's
        // reconnect included: a caller that waited out someone else's
        // failing attempts makes one attempt of its own and no more, so a
        // call gives up after about `reconnect_timeout_ms` (plus at most
        // one attempt), not after that wait and then a full timeout of
        // its own attempts.
        let start = Instant::now();
        // Not on a thread that is exiting (its thread-locals destroyed):
        // it could not set the session up, and would hold the reconnect
        // lock through its attempts while the other threads wait.
        if !SettingUp::possible() {
            return Err(exiting_thread());
        }
        let Some(_serial) = self.reconnect_lock.try_lock_for(timeout) else {
            let last = match self.reconnect_failure.lock().clone() {
                Some(why) => format!("{why} (another thread of this client is still reconnecting)"),
                None => "another thread of this client is still reconnecting \
                         (setting up a session: registering keys again after a \
                         directory restart can take longer; see reconnect_timeout_ms)"
                    .to_owned(),
            };
            return Err(ClientError::ReconnectFailed {
                elapsed_ms: start.elapsed().as_millis() as u64,
                last,
                resumable: true,
            });
        };
        if let Some(c) = self.conn.lock().as_ref()
            && (c.conn_no != failed_conn_no && c.usable())
        {
            return Ok(());
        }
        let mut backoff = Duration::from_millis(self.cfg.reconnect_backoff_min_ms);
        let max_backoff = Duration::from_millis(self.cfg.reconnect_backoff_max_ms);
        loop {
            self.check_open()?;
            match self.reattach_once() {
                Ok(()) => {
                    *self.reconnect_failure.lock() = None;
                    return Ok(());
                }
                Err(Attempt::Fatal(e)) => {
                    tracing::error!(error = %e.with_causes(), "the instance cannot be resumed");
                    self.set_fatal(e.with_causes().to_string());
                    return Err(e);
                }
                Err(Attempt::Retry(e)) => {
                    let last = e.with_causes().to_string();
                    *self.reconnect_failure.lock() = Some(last.clone());
                    let elapsed = start.elapsed();
                    if elapsed >= timeout {
                        return Err(ClientError::ReconnectFailed {
                            elapsed_ms: elapsed.as_millis() as u64,
                            last,
                            resumable: true,
                        });
                    }
                    tracing::debug!(error = %last, "reattach failed; backing off");
                    std::thread::sleep(backoff.min(timeout - elapsed));
                    backoff = (backoff * 2).min(max_backoff);
                }
            }
        }
    }

    /// Every owned region, as `Reattach` presents it — those away for
    /// return included (a restarted directory frees every recovered region
    /// nobody presents; see [`super::layout::Away`]) — and how many of them
    /// are in use (in a table, not away).
    fn owned_regions(&self) -> (Vec<WireOwnedRegion>, usize) {
        let mut out = Vec::new();
        let mut in_use = 0;
        for layout in self.layouts.read().iter() {
            // Under the away lock: a region moving between the table and
            // the away list is seen on one side.
            let away = layout.away.lock();
            let table = layout.regions.read();
            in_use += table.len();
            let away = away
                .iter()
                // Acquire: pairs with the Release that revokes it.
                .filter(|(_, r)| !r.revoked.load(Ordering::Acquire));
            for r in table.iter().map(|(_, r)| r).chain(away.map(|(_, r)| r)) {
                out.push(WireOwnedRegion {
                    desc: r.desc,
                    layout: r.layout,
                    token: r.token,
                });
            }
        }
        (out, in_use)
    }

    fn reattach_once(&self) -> Result<(), Attempt> {
        let timeout = self.request_timeout();
        let rpc = RpcClient::connect(&self.cfg.server.endpoint(), self.cfg.transport.clone())
            .map_err(|e| Attempt::Retry(ClientError::Connect(e)))?;
        let (regions, in_use) = self.owned_regions();
        // Regions away for return may have been returned already (the
        // answer lost with the connection): they prove nothing.
        let holds_no_region = in_use == 0;
        if regions.len() > proto::MAX_REATTACH_REGIONS {
            return Err(Attempt::Fatal(ClientError::BatchTooLarge {
                len: regions.len(),
                max: proto::MAX_REATTACH_REGIONS,
            }));
        }
        let msg = Reattach {
            meta: RequestMeta {
                seq: 0,
                notice_ack: self.notice_ack(),
                replies_received_below: 0,
            },
            protocol_min: PROTOCOL_MIN,
            protocol_max: PROTOCOL_MAX,
            instance_id: self.identity.instance_id.clone(),
            instance_secret: self.identity.secret,
            client_name: self.cfg.client_name.clone(),
            client_secret: tcp_secret(&self.cfg),
            regions,
            next_seq: self.seqs.next(),
        };
        let encoded = Encoded::new(&msg).map_err(Attempt::Fatal)?;
        let reply = rpc
            .call(Reattach::KIND.as_u16(), encoded.payload(), timeout)
            .map_err(|e| Attempt::Retry(ClientError::Connect(e)))?;
        // New pool descriptors may ride along; the pools opened at connect
        // stay in use (their identity is checked below).
        let r: Reattached = decode_opening(&reply, "reattach").map_err(|e| match e.code() {
            Some(
                ErrorCode::InstanceGone
                | ErrorCode::AuthenticationFailed
                | ErrorCode::AuthenticationRequired
                | ErrorCode::UnsupportedVersion,
            ) => Attempt::Fatal(e),
            // The restarted directory holds regions for this instance that
            // it never told us about: a grant whose reply was lost. We own
            // no region, hence no key, so nothing here is ours to keep;
            // waiting until the instance's grace period returns those
            // regions to the pool turns the next reattach into a fresh
            // start (see the module docs). With regions of our own, their
            // tokens were all refused: they were freed under us, and that
            // is not something a retry explains. (Regions away for return
            // do not count: their return may have run, the answer lost.)
            Some(ErrorCode::OwnershipNotProven) if holds_no_region => {
                self.stats.bump(&self.stats.reattaches_awaiting_grace);
                Attempt::Retry(e)
            }
            Some(ErrorCode::OwnershipNotProven) => Attempt::Fatal(e),
            _ => Attempt::Retry(e),
        })?;
        // As after `Hello`: the opening reply was the last with descriptors.
        rpc.decline_fds();
        let same_pools = r.welcome.pools.len() == self.pools.len()
            && r.welcome
                .pools
                .iter()
                .zip(&self.pools)
                .all(|(a, b)| a.uuid == b.info.uuid && a.size_bytes == b.info.size_bytes);
        if !same_pools {
            return Err(Attempt::Fatal(ClientError::Pool {
                pool: 0,
                reason: "the server's pools changed across the reattach".into(),
            }));
        }
        let old_conn_no = self.conn.lock().as_ref().map_or(0, |c| c.conn_no);
        let conn = Arc::new(Conn {
            rpc,
            conn_no: old_conn_no + 1,
            session_id: r.welcome.session_id,
            lease_ms: r.welcome.lease_ms,
            limits: r.welcome.limits,
            directory_epoch: r.welcome.directory_epoch,
            dead: AtomicBool::new(false),
        });
        self.seqs
            .set_window(u64::from(r.welcome.limits.reply_cache_len));
        let refused: Vec<u64> = r.refused.iter().map(|x| x.region).collect();
        if !refused.is_empty() {
            tracing::warn!(regions = ?refused, "regions refused at reattach");
            self.drop_owned_regions(&refused);
        }
        // A directory that recovered the instance (after its own restart,
        // or after the instance expired) answers `resumed: false`, and
        // repeats it until a session of the instance makes a request, so a
        // lost answer is told again (docs/protocol.md). A new
        // `directory_epoch` (it changes on every start) is taken for a
        // restart too, whatever `resumed` says: a directory that answered
        // `resumed: false` only once would otherwise go unnoticed. The
        // epoch is compared with the last answer's, not the published
        // session's, so that the retry after a setup that failed does not
        // count the same restart again (`reregister_pending` carries its
        // work over).
        let last_epoch = self
            .epoch_seen
            .swap(r.welcome.directory_epoch, Ordering::Relaxed);
        let new_epoch = last_epoch != r.welcome.directory_epoch;
        if new_epoch || !r.resumed {
            if new_epoch || !self.reregister_pending.load(Ordering::Acquire) {
                tracing::info!(
                    "the directory recovered this instance (it restarted, or the instance \
                     expired); registering its keys again"
                );
                self.stats.bump(&self.stats.directory_restarts);
            }
            self.seqs.new_incarnation();
            self.reregister_pending.store(true, Ordering::Release);
        }
        self.usage.store(r.welcome.meta.usage);
        self.apply_notices(r.welcome.meta.notices.iter().copied());
        // The session is set up before anyone else may use it (`SettingUp`):
        // keys registered again, live views pinned again. If that fails,
        // the connection is dropped unpublished (the server ends its
        // session, and with it any pin taken) and the next attempt starts
        // over.
        {
            let Some(_setting_up) = SettingUp::enter(self, Arc::clone(&conn)) else {
                // `reconnect` refuses such a thread first.
                return Err(Attempt::Retry(exiting_thread()));
            };
            if self.reregister_pending.load(Ordering::Acquire) {
                self.reregister().map_err(Attempt::Retry)?;
                self.reregister_pending.store(false, Ordering::Release);
            }
            #[cfg(test)]
            if let Some(hook) = self.before_repin.take() {
                hook();
            }
            // Published under the ledger lock the re-pin took: a lookup
            // that counts its pins after the re-pin then finds the new
            // connection current, tells it was served by the old one, and
            // ends the session again (`lookup.rs`), instead of leaving
            // pins of a dying session in the ledger unnoticed.
            let ledger = self.repin().map_err(Attempt::Retry)?;
            let mut current = self.conn.lock();
            if current.is_none() {
                return Err(Attempt::Fatal(ClientError::Closed));
            }
            *current = Some(Arc::clone(&conn));
            drop(current);
            drop(ledger);
        }
        self.stats.bump(&self.stats.reconnects);
        Ok(())
    }

    /// Registers every key of the index again (after a directory restart).
    fn reregister(&self) -> Result<(), ClientError> {
        let layouts: Vec<_> = self.layouts.read().clone();
        let max_batch = (self.limits().max_batch as usize).clamp(1, proto::MAX_BATCH);
        let mut by_layout: HashMap<u32, Vec<IndexedKey>> = HashMap::new();
        for k in self.index.snapshot() {
            by_layout.entry(k.layout_ix).or_default().push(k);
        }
        for (ix, keys) in by_layout {
            let Some(layout) = layouts.get(ix as usize) else {
                continue;
            };
            for batch in keys.chunks(max_batch) {
                let mut msg = Register {
                    meta: Default::default(),
                    layout: layout.layout,
                    entries: batch
                        .iter()
                        .map(|k| RegisterEntry {
                            key: k.key.clone(),
                            location: k.location,
                        })
                        .collect(),
                };
                let outcomes = self
                    .mutating_call::<_, RegisterReply, _>(
                        "register",
                        Mode::REATTACH,
                        &mut msg,
                        |reply| {
                            Ok(reply
                                .outcomes
                                .iter()
                                .map(RegisterOutcome::from)
                                .collect::<Vec<_>>())
                        },
                    )
                    .map_err(Fail::into_error)?;
                for (k, outcome) in batch.iter().zip(outcomes) {
                    let kept = match outcome {
                        RegisterOutcome::Inserted => true,
                        RegisterOutcome::Duplicate(w) => {
                            w.region == k.location.region
                                && w.page == k.location.page
                                && w.generation == k.location.generation
                        }
                        RegisterOutcome::Rejected(_) => false,
                    };
                    if kept {
                        self.stats.bump(&self.stats.keys_reregistered);
                        continue;
                    }
                    // Taken by another instance meanwhile, or refused: the
                    // key is not ours any more and its page is free.
                    let l = k.location;
                    let region = self.find_owned(l.region);
                    self.index.forget_freed(l.region, l.page, l.generation, || {
                        if let Some(r) = &region {
                            let _ = r.alloc.free(l.page_index(), l.page_generation());
                        }
                    });
                    self.stats.bump(&self.stats.keys_lost_with_regions);
                }
            }
        }
        Ok(())
    }

    /// Takes again, on the new session, the pins live read guards hold;
    /// drops the unpins queued for the old session.
    /// Returns the ledger, still locked, for the caller to publish the
    /// session under it.
    fn repin(&self) -> Result<MutexGuard<'_, PinLedger>, ClientError> {
        let mut pins = self.live_pins.lock();
        {
            let mut queue = self.unpins.lock();
            let n = queue.len();
            queue.clear();
            self.unpins.sent(n, []);
            self.stats.add(&self.stats.unpins_dropped, n as u64);
        }
        if pins.is_empty() {
            pins.prune_locations();
            return Ok(pins);
        }
        let layouts: Vec<_> = self.layouts.read().clone();
        let max_batch = (self.limits().max_batch as usize).clamp(1, proto::MAX_BATCH);
        // The new session's limit, not the protocol's: a directory refuses
        // a lookup taking more pins per key than it announced. A count
        // above it is taken by several lookups of the key.
        let max_pins = super::rpc::max_pins_per_key(&self.limits());
        let mut groups: HashMap<(u32, u32), Vec<Vec<u8>>> = HashMap::new();
        for ((ix, key), &count) in pins.iter() {
            let mut left = count;
            while left > 0 {
                let take = left.min(max_pins);
                groups.entry((*ix, take)).or_default().push(key.to_vec());
                left -= take;
            }
        }
        for ((ix, count), keys) in groups {
            let Some(layout) = layouts.get(ix as usize) else {
                continue;
            };
            for batch in keys.chunks(max_batch) {
                let mut msg = Lookup {
                    meta: Default::default(),
                    layout: layout.layout,
                    keys: batch.to_vec(),
                    pins: count,
                };
                // Test fail point: the directory finds none of the keys
                // (and so takes no pin).
                #[cfg(test)]
                let finds_nothing = super::lookup::REPIN_FINDS_NOTHING.get();
                #[cfg(not(test))]
                let finds_nothing = false;
                let now: Vec<Option<Location>> = if finds_nothing {
                    vec![None; batch.len()]
                } else {
                    self.mutating_call::<_, LookupReply, _>(
                        "lookup",
                        Mode::REATTACH,
                        &mut msg,
                        |r| Ok(r.locations().collect()),
                    )
                    .map_err(Fail::into_error)?
                };
                for (key, now) in batch.iter().zip(now) {
                    let k = (ix, Box::<[u8]>::from(key.as_slice()));
                    // Between the old session's end and these pins the key
                    // may have been deleted, its page reused and the key
                    // written again elsewhere: then the views read a page
                    // that is no longer the key's, and the pins just taken
                    // on the new location protect nothing of theirs.
                    let moved = now.is_some() && pins.at.get(&k).is_some_and(|&at| now != Some(at));
                    if moved {
                        for _ in 0..count {
                            self.unpins.push(ix, k.1.clone());
                        }
                    }
                    // Views whose pins are not taken again stay readable but
                    // unprotected; their drops must not release pins they no
                    // longer hold — nor those of newer views of the key. (A
                    // key split over several lookups: the first that finds
                    // it missing or moved takes the whole count out of the
                    // ledger, and each lookup that took pins gives back its
                    // own.)
                    let lost = if now.is_none() || moved {
                        pins.remove(&k).unwrap_or(0)
                    } else {
                        0
                    };
                    if lost > 0 {
                        self.stats
                            .add(&self.stats.views_invalidated, u64::from(lost));
                        *pins.orphans.entry(k).or_insert(0) += lost;
                    }
                }
            }
        }
        pins.prune_locations();
        Ok(pins)
    }
}
