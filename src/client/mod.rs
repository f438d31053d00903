//! The client library: what an inference engine links to share KV chunks
//! with other engines through the pool (DESIGN §1, §3, §4, §8).
//!
//! # Shape
//!
//! [`Client::connect`] opens a session with the directory (Unix socket: the
//! pool descriptors arrive with `Welcome`; TCP: the pools are opened by path
//! and recognised by UUID) and starts one maintenance thread. An engine then
//! asks for a [`LayoutHandle`] per model (`client.layout(page_size,
//! fingerprint)`), which owns regions of the pool and a key space of its
//! own:
//!
//! - **write**: [`LayoutHandle::alloc`] / [`batch_alloc`](LayoutHandle::batch_alloc)
//!   give [`PageLease`]s (writable pages, lock-free allocation), written in
//!   place and registered with [`batch_register`](LayoutHandle::batch_register)
//!   — one round trip per batch; or [`batch_put`](LayoutHandle::batch_put)
//!   does allocate + copy + publish + register;
//! - **read**: [`batch_get`](LayoutHandle::batch_get) — one round trip — gives
//!   [`ReadGuard`]s: pinned views of the chunks where they lie in the pool;
//! - [`batch_exists`](LayoutHandle::batch_exists), [`batch_delete`](LayoutHandle::batch_delete).
//!
//! Everything is batch-native and thread-safe: a `Client` (and its layout
//! handles) are cheap clones shared by many threads; requests from several
//! threads are pipelined on one connection.
//!
//! # What the client guarantees
//!
//! - A key is registered only after its bytes are written and published
//!   (leases are consumed by registration; publication precedes the send).
//! - A page is written only by the holder of its allocator grant and read
//!   only under a pin; pages come back to the allocator exactly once: on
//!   abort, on a `Duplicate`/`Rejected` answer, or through a freed-page
//!   notice after anyone deleted the key (stale generations ignored).
//! - A client always observes its own releases: unpins queued by dropped
//!   guards are sent before its next request.
//! - Retried requests keep their sequence number (exactly-once effects);
//!   broken connections are reattached with backoff; after a directory
//!   restart the instance registers its keys again. A registration whose
//!   outcome is unknown keeps its pages until it is resolved.
//! - Every handle keeps the session: a [`Client`], a [`LayoutHandle`], a
//!   [`ReadGuard`] and a [`PageLease`] each hold the client alive, so the
//!   session ends (and with it the pins, and later the instance and its
//!   regions) only when the last of them is dropped — a view that outlives
//!   every `Client` handle is still pinned, a lease still writes a region
//!   of a live instance — or on an explicit [`Client::close`], which ends
//!   it at once whatever is still alive. Nothing the client keeps for
//!   itself (parked registrations, the maintenance thread) holds it alive.
//! - A client works only in the process that connected it: in a child
//!   made by `fork` every call fails with [`ClientError::Forked`] before it
//!   sends anything, and dropping the child's copies (views included)
//!   leaves the parent's session and pins alone (`fork`).
//!
//! Module map: `config` (settings), `error`, `pools` (opening the pools),
//! `regions` (owned and peer mappings), `layout` (layouts, allocation,
//! regions), `lease` (writable pages), `write` (register, put), `lookup`
//! (get, exists, delete), `read` (guards, unpin batching), `index` (owned
//! keys, for re-registration), `seq` (sequence window), `rpc` (one request:
//! retries, unpins first, notices), `session` (hello, reconnect, reattach),
//! `maintenance` (the background thread), `fork` (clients do not cross
//! `fork`), `stats`.

mod config;
mod error;
mod fork;
mod index;
mod layout;
mod lease;
mod lookup;
mod maintenance;
pub(crate) mod pools;
mod read;
mod regions;
mod rpc;
mod seq;
mod session;
mod shared;
pub(crate) mod staged;
mod stats;
mod write;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;

use cxlkv_controlplane::proto::{self, MapRegion, RegionMap, Stats, StatsReply, sections};
use cxlkv_dataplane::map::MapObservers;
use parking_lot::Mutex;

pub use config::{
    ClientConfig, DEFAULT_REGION_SIZE_BYTES, LayoutOptions, MAX_LAYOUTS, MAX_UNPIN_DELAY_US,
    ServerAddr,
};
pub use cxlkv_controlplane::proto::{
    DeleteOutcome, ErrorCode, Location, PoolInfo, RegisterOutcome, RejectReason, Usage,
};
/// What [`Client::connect_with_observers`] takes: an engine's hooks on every
/// mapping of pool memory (e.g. `cudaHostRegister`), from the data plane.
pub use cxlkv_dataplane::map::{MapInfo, MapObserver};
pub use error::{ClientError, ErrorChain};
// For the C ABI's handle registry, which shares the counter.
#[doc(hidden)]
pub use fork::process_incarnation;
pub use layout::LayoutHandle;
pub use lease::PageLease;
pub use read::ReadGuard;
pub use stats::ClientStats;

use shared::Shared;

// Many threads share one client; views and leases move between threads.
const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Client>();
    assert_send_sync::<LayoutHandle>();
    assert_send_sync::<ReadGuard>();
    assert_send_sync::<PageLease>();
};

/// A connection to the cxlkv directory and the pools it serves. Cheap to
/// clone (clones share everything); the session ends when the last clone,
/// the last [`LayoutHandle`], the last [`ReadGuard`] and the last
/// [`PageLease`] are dropped (each holds a clone), or on [`Client::close`].
#[derive(Debug, Clone)]
pub struct Client {
    inner: Arc<ClientInner>,
}

/// What the handles share; dropping the last reference ends the session
/// ([`ClientInner::shutdown`]). Only handles the user owns hold one — never
/// [`Shared`] nor anything it keeps (that would be a cycle keeping the
/// client alive for good), and never the maintenance thread (the last
/// reference dropped there would make it join itself).
#[derive(Debug)]
struct ClientInner {
    shared: Arc<Shared>,
    maintenance: Mutex<Option<JoinHandle<()>>>,
}

impl Client {
    fn shared(&self) -> &Arc<Shared> {
        &self.inner.shared
    }

    /// Connects, opens a session and starts the maintenance thread.
    pub fn connect(cfg: ClientConfig) -> Result<Client, ClientError> {
        Self::connect_with_observers(cfg, Vec::new())
    }

    /// Connects with map observers registered before the first region is
    /// mapped, so they see every mapping (e.g. to register host memory with
    /// a GPU). See [`MapObserver`].
    pub fn connect_with_observers(
        cfg: ClientConfig,
        observers: Vec<Arc<dyn MapObserver>>,
    ) -> Result<Client, ClientError> {
        let list = MapObservers::new();
        for o in observers {
            list.register(o)?;
        }
        let eager = cfg.eager_map;
        let shared = session::connect(cfg, list)?;
        let thread = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("cxlkv-client".into())
                .spawn(move || maintenance::run(shared))
                .map_err(|e| ClientError::Config {
                    field: "maintenance thread",
                    reason: e.to_string(),
                })?
        };
        let client = Client {
            inner: Arc::new(ClientInner {
                shared,
                maintenance: Mutex::new(Some(thread)),
            }),
        };
        if eager {
            client.map_all_regions()?;
        }
        Ok(client)
    }

    /// Adds an observer for regions mapped from now on (regions already
    /// mapped are not reported to it; use [`Client::connect_with_observers`]
    /// to see every mapping).
    pub fn add_map_observer(&self, observer: Arc<dyn MapObserver>) -> Result<(), ClientError> {
        Ok(self.inner.shared.observers.register(observer)?)
    }

    /// Removes an observer; regions it was told about still report their
    /// unmapping to it.
    pub fn remove_map_observer(&self, observer: &Arc<dyn MapObserver>) -> bool {
        self.inner.shared.observers.unregister(observer)
    }

    /// Maps every region the directory lists (up to `MAX_STATS_ROWS`) that
    /// this client does not own, so later first lookups do not map. Done at
    /// connect when `eager_map` is set. Returns how many were mapped.
    pub fn map_all_regions(&self) -> Result<usize, ClientError> {
        let shared = &self.inner.shared;
        let mut stats = Stats {
            meta: Default::default(),
            sections: sections::REGIONS,
            max_rows: proto::MAX_STATS_ROWS as u32,
        };
        let ids: Vec<u64> = shared.read_call::<_, StatsReply, _>("stats", &mut stats, |r| {
            Ok(r.regions.iter().map(|row| row.region.to_native()).collect())
        })?;
        let ids: Vec<u64> = ids
            .into_iter()
            .filter(|id| shared.find_owned(*id).is_none())
            .collect();
        let mut mapped = 0;
        for chunk in ids.chunks(proto::MAX_BATCH) {
            let mut req = MapRegion {
                meta: Default::default(),
                regions: chunk.to_vec(),
            };
            let descs: Vec<proto::RegionDesc> =
                shared.read_call::<_, RegionMap, _>("map_region", &mut req, |r| {
                    Ok(r.descs
                        .iter()
                        .filter_map(|d| d.as_ref().map(proto::RegionDesc::from))
                        .collect())
                })?;
            for desc in descs {
                let _serial = shared.peer_lock.lock();
                if shared.peers.len() >= shared.cfg.max_peer_mappings {
                    return Ok(mapped);
                }
                if shared.peers.with(desc.region_id(), |_| ()).is_some() {
                    continue;
                }
                let stamp = shared.stamp.fetch_add(1, Ordering::Relaxed);
                let peer = shared.map_peer(desc, stamp)?;
                shared.insert_peer(peer)?;
                mapped += 1;
            }
        }
        Ok(mapped)
    }

    /// Sends the unpins of dropped guards now (they are otherwise sent
    /// within `unpin_delay_us`, or before this client's next request) and
    /// waits until the directory has answered them, and any this client's
    /// other threads had sent: when it returns, every guard dropped before
    /// the call is released (or its unpin was given up: `unpins_dropped`).
    pub fn flush_unpins(&self) -> Result<(), ClientError> {
        self.inner.shared.flush_unpins_and_wait()
    }

    /// The directory's statistics (`sections`: bits of
    /// [`proto::sections`]), for tools and tests.
    pub fn directory_stats(&self, sections: u32) -> Result<StatsReply, ClientError> {
        let mut req = Stats {
            meta: Default::default(),
            sections,
            max_rows: proto::MAX_STATS_ROWS as u32,
        };
        self.inner
            .shared
            .read_call::<_, StatsReply, _>("stats", &mut req, |r| {
                proto::deserialize::<StatsReply>(r).map_err(|source| ClientError::BadReply {
                    op: "stats",
                    source,
                })
            })
    }

    /// The client's counters.
    pub fn stats(&self) -> ClientStats {
        self.inner.shared.stats.snapshot()
    }

    /// This instance's memory accounting, as of the latest reply (no round
    /// trip).
    pub fn usage(&self) -> Usage {
        self.inner.shared.usage.load()
    }

    /// The pools this client maps regions from, as the server announced
    /// them (index, UUID, size, alignment, path, visibility).
    pub fn pools(&self) -> Vec<proto::PoolInfo> {
        self.inner
            .shared
            .pools
            .iter()
            .map(|p| p.info.clone())
            .collect()
    }

    /// The visibility mode this client applies to pool `pool` (the server's,
    /// unless the configuration forces one).
    pub fn visibility(&self, pool: u32) -> Option<cxlkv_dataplane::visibility::Visibility> {
        self.inner
            .shared
            .pools
            .get(pool as usize)
            .map(|p| p.visibility)
    }

    /// The instance's id (configured, or generated by the directory).
    pub fn instance_id(&self) -> &str {
        &self.inner.shared.identity.instance_id
    }

    /// The current session's id.
    pub fn session_id(&self) -> Option<u64> {
        self.inner.shared.conn.lock().as_ref().map(|c| c.session_id)
    }

    /// The directory incarnation of the current session (changes when the
    /// directory restarts).
    pub fn directory_epoch(&self) -> Option<u64> {
        self.inner
            .shared
            .conn
            .lock()
            .as_ref()
            .map(|c| c.directory_epoch)
    }

    /// Keys this instance registered and that still exist (its local
    /// index).
    pub fn owned_keys(&self) -> usize {
        self.inner.shared.index.len()
    }

    /// Registrations whose outcome is still unknown (parked, retried in the
    /// background).
    pub fn unresolved_registrations(&self) -> usize {
        self.inner.shared.unresolved_batches()
    }

    /// Most keys one batch call may carry: the directory's limit, announced
    /// at the start of the session (the protocol's `MAX_BATCH` while
    /// disconnected). A longer batch is refused (`BatchTooLarge`).
    pub fn max_batch(&self) -> usize {
        (self.inner.shared.limits().max_batch as usize).clamp(1, proto::MAX_BATCH)
    }

    /// Longest key the directory accepts (as [`Client::max_batch`]).
    pub fn max_key_bytes(&self) -> usize {
        (self.inner.shared.limits().max_key_bytes as usize).min(proto::MAX_KEY_BYTES)
    }

    /// Region requests whose outcome is still unknown (kept, retried in the
    /// background; a late grant is adopted by its layout).
    pub fn unresolved_region_requests(&self) -> usize {
        self.inner.shared.unresolved_region_requests()
    }

    /// Ends the session now, whatever handles are still alive: sends pending
    /// unpins, stops the maintenance thread and closes the connection (the
    /// directory releases the session's pins; the instance's keys stay).
    /// Other clones of this client and its layouts fail with `Closed`
    /// afterwards. [`ReadGuard`]s still alive keep their mappings until they
    /// drop, but they are **no longer pinned**: another client may delete a
    /// view's key and its page be reused under it. Drop views first, or copy
    /// out what must outlive the close. [`PageLease`]s still alive can no
    /// longer be written (`RegionRevoked`): the instance's regions go back
    /// to the pool once its grace period ends. (Dropping every handle
    /// instead ends the session only when the last view and lease are gone.)
    pub fn close(self) -> Result<(), ClientError> {
        // In a forked child: nothing to end (the session is the parent's);
        // dropping `self` leaves the copy alone.
        self.inner.shared.check_process()?;
        let flushed = self.inner.shared.flush_unpins_and_wait();
        self.inner.shutdown();
        flushed
    }
}

impl ClientInner {
    fn shutdown(&self) {
        let shared = &self.shared;
        if shared.closing.swap(true, Ordering::AcqRel) {
            return;
        }
        shared.wake_maintenance();
        if let Some(thread) = self.maintenance.lock().take() {
            if thread.thread().id() == std::thread::current().id() {
                // The last handle dropped on the maintenance thread (which
                // owns none: see `ClientInner`). Joining would wait for
                // itself; it returns on its own once it sees `closing`.
                tracing::error!("the last client handle was dropped on its maintenance thread");
            } else if thread.join().is_err() {
                tracing::error!("the client maintenance thread panicked");
            }
        }
        // Dropping the connection closes it once in-flight calls are done.
        drop(shared.conn.lock().take());
        // The instance's regions go back to the pool when its grace period
        // ends: a lease still alive (after an explicit close) must not
        // write them any more.
        for layout in shared.layouts.read().iter() {
            let away = layout.away.lock();
            let table = layout.regions.read();
            // Those away for return too: one a lease found before it left
            // the table is still the lease's to write otherwise.
            for region in table
                .iter()
                .map(|(_, r)| r)
                .chain(away.iter().map(|(_, r)| r))
            {
                // Release: see `Shared::drop_owned_regions`.
                region.revoked.store(true, Ordering::Release);
            }
        }
        shared.retired.sweep();
    }
}

impl Drop for ClientInner {
    fn drop(&mut self) {
        if self.shared.owner.forked() {
            // A forked child's copy (`fork.rs`): its maintenance thread does
            // not exist here (joining it would wait for ever), and dropping
            // the connection would shut the parent's socket down. Leave both
            // be: the child's memory and descriptors go when it exits.
            if let Some(thread) = self.maintenance.get_mut().take() {
                std::mem::forget(thread);
            }
            std::mem::forget(Arc::clone(&self.shared));
            return;
        }
        self.shutdown();
    }
}
