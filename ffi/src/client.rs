//! The client handle: connect, close, statistics, region map observers.
//!
//! A `cxlkv_client *` is a [`Client`]; layouts opened from it keep the
//! session alive (they hold clones), so `cxlkv_close` ends the session for
//! all of them: their later calls fail with `CXLKV_STATUS_CLOSED`, while
//! views and leases still alive keep their mappings until released (but
//! not their pins, nor leases their region: the session that held them has
//! ended). The regions stay mapped until the last handle made from the
//! client is freed.

use std::ffi::c_char;
use std::mem::size_of;
use std::sync::Arc;

use cxlkv::client::Client;
use cxlkv_dataplane::map::{MapInfo, MapObserver};

use crate::args::{self, Out, Versioned};
use crate::boundary::call;
use crate::config::{self, cxlkv_config, cxlkv_map_callbacks, cxlkv_map_info};
use crate::handle::{Registry, Tag, to_ptr};
use crate::status::{FfiError, cxlkv_status};

/// A connection to the cxlkv server (opaque).
#[allow(non_camel_case_types)]
pub struct cxlkv_client {
    _opaque: [u8; 0],
}

/// A map observer added with `cxlkv_add_map_observer` (opaque).
#[allow(non_camel_case_types)]
pub struct cxlkv_observer {
    _opaque: [u8; 0],
}

pub(crate) static CLIENTS: Registry<Client> = Registry::new(Tag::Client);

/// An added observer and the client it was added to.
pub(crate) struct ObserverEntry {
    client: Client,
    observer: Arc<dyn MapObserver>,
}

static OBSERVERS: Registry<ObserverEntry> = Registry::new(Tag::Observer);

/// The client a handle names.
pub(crate) fn client(handle: *const cxlkv_client) -> Result<Arc<Client>, FfiError> {
    CLIENTS.get(handle.addr(), "client")
}

/// C callbacks as a [`MapObserver`].
struct CMapObserver {
    callbacks: cxlkv_map_callbacks,
}

// SAFETY: the callbacks and `user_data` are the caller's; the documented
// contract of `cxlkv_config.map_callbacks` and `cxlkv_add_map_observer` is
// that they may be called from any thread, concurrently.
unsafe impl Send for CMapObserver {}
// SAFETY: as for Send; the struct itself is never mutated.
unsafe impl Sync for CMapObserver {}

impl CMapObserver {
    fn boxed(callbacks: cxlkv_map_callbacks) -> Option<Arc<dyn MapObserver>> {
        if callbacks.on_map.is_none() && callbacks.before_unmap.is_none() {
            return None;
        }
        Some(Arc::new(CMapObserver { callbacks }))
    }

    fn notify(&self, f: config::cxlkv_map_fn, info: &MapInfo) {
        let Some(f) = f else { return };
        let c = cxlkv_map_info {
            region_id: info.region.0,
            offset_bytes: info.extent.offset_bytes,
            base: std::ptr::without_provenance_mut(info.base_addr),
            len_bytes: info.len_bytes as u64,
            read_only: !info.writable,
        };
        // SAFETY: a callback the caller registered for exactly this call,
        // with its own user data and a pointer to a live info struct.
        unsafe { f(self.callbacks.user_data, &c) }
    }
}

impl MapObserver for CMapObserver {
    fn on_map(&self, info: &MapInfo) {
        self.notify(self.callbacks.on_map, info);
    }

    fn before_unmap(&self, info: &MapInfo) {
        self.notify(self.callbacks.before_unmap, info);
    }
}

/// Connects to the server `config` names and opens a session. On success
/// `*out_client` is the new handle (free it with `cxlkv_close`); on failure
/// it is NULL.
///
/// `config->map_callbacks` (if set) are told of every region this client
/// maps or unmaps, from the first one on; they must stay callable, and
/// their `user_data` valid, until `cxlkv_close` returned and every handle
/// made from the client (layouts, tiers, map observers, views, leases) was
/// freed and every tier page hold (`CXLKV_TIER_HOLD_MAPPINGS`) released:
/// the regions are unmapped when the last of them goes.
///
/// # Safety
///
/// `config` valid for reads of `config->size` bytes, its strings and arrays
/// as its field docs say; `out_client` valid for a write.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_connect(
    config: *const cxlkv_config,
    out_client: *mut *mut cxlkv_client,
) -> cxlkv_status {
    call("cxlkv_connect", || {
        // SAFETY: passed on to the caller.
        let mut out = unsafe { Out::unset(out_client, "out_client") }?;
        // SAFETY: passed on to the caller.
        let (cfg, callbacks) = unsafe { config::client_config(config) }?;
        let observers = CMapObserver::boxed(callbacks).into_iter().collect();
        let client = Client::connect_with_observers(cfg, observers)?;
        let token = CLIENTS.insert(client)?;
        out.write(to_ptr(token));
        Ok(())
    })
}

/// Ends the session and frees the handle (NULL: nothing to do). Pending
/// unpins are sent first; the directory releases the session's pins; the
/// instance's keys stay. Layouts of this client fail with
/// `CXLKV_STATUS_CLOSED` afterwards (free them with `cxlkv_layout_close`);
/// views and leases stay mapped until released, but views are no longer
/// pinned (another client may delete a view's key and its page be reused),
/// and leases can no longer be written through the API
/// (`cxlkv_lease_data`, `cxlkv_lease_write` fail; an address taken before
/// must not be written either: the region may be freed once the instance's
/// grace period ends). Release views and leases first, or copy out what
/// must outlive the close. The
/// handle is freed even when the status reports that the final unpins
/// could not be sent.
///
/// # Safety
///
/// None beyond passing a handle (any value is checked).
///
/// Thread safety: any thread; calls on this client still in progress in
/// other threads finish or fail with `CXLKV_STATUS_CLOSED`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_close(client: *mut cxlkv_client) -> cxlkv_status {
    call("cxlkv_close", || {
        if client.is_null() {
            return Ok(());
        }
        let c = CLIENTS.remove(client.addr(), "client")?;
        Client::clone(&c).close()?;
        Ok(())
    })
}

/// The client's counters (monotonic since connect). Set `out->size` to
/// `sizeof(cxlkv_client_stats)` first.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
#[allow(non_camel_case_types)]
pub struct cxlkv_client_stats {
    pub size: u32,
    /// Always 0.
    pub reserved: u32,
    /// Requests sent (every attempt counts).
    pub requests: u64,
    /// Attempts after the first, of any request.
    pub retries: u64,
    pub reconnects: u64,
    pub directory_restarts: u64,
    pub keys_reregistered: u64,
    pub keys_lost_with_regions: u64,
    pub regions_refused: u64,
    pub regions_acquired: u64,
    pub regions_returned: u64,
    pub peer_regions_mapped: u64,
    pub peer_regions_evicted: u64,
    pub pages_freed_by_notice: u64,
    pub stale_notices: u64,
    pub notices_unknown_region: u64,
    pub notice_gaps: u64,
    /// Registrations that lost to an earlier one.
    pub duplicates: u64,
    pub rejections: u64,
    pub unpin_batches: u64,
    pub unpins_not_held: u64,
    pub unpins_dropped: u64,
    /// Views whose pins could not be taken again after a reconnect.
    pub views_invalidated: u64,
    pub registers_unresolved: u64,
    pub heartbeats: u64,
}

const _: () = assert!(size_of::<cxlkv_client_stats>() == 8 + 23 * 8);

// SAFETY: repr(C), `size: u32` first, integers only, no padding (asserted).
unsafe impl Versioned for cxlkv_client_stats {
    const SIZES: &'static [usize] = &[size_of::<cxlkv_client_stats>()];
}

/// Writes the client's counters into `*out` (no round trip).
///
/// # Safety
///
/// `out` valid for reads of its size field and writes of `out->size` bytes.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_query_stats(
    client: *const cxlkv_client,
    out: *mut cxlkv_client_stats,
) -> cxlkv_status {
    call("cxlkv_query_stats", || {
        let s = self::client(client)?.stats();
        let v = cxlkv_client_stats {
            size: size_of::<cxlkv_client_stats>() as u32,
            reserved: 0,
            requests: s.requests,
            retries: s.retries,
            reconnects: s.reconnects,
            directory_restarts: s.directory_restarts,
            keys_reregistered: s.keys_reregistered,
            keys_lost_with_regions: s.keys_lost_with_regions,
            regions_refused: s.regions_refused,
            regions_acquired: s.regions_acquired,
            regions_returned: s.regions_returned,
            peer_regions_mapped: s.peer_regions_mapped,
            peer_regions_evicted: s.peer_regions_evicted,
            pages_freed_by_notice: s.pages_freed_by_notice,
            stale_notices: s.stale_notices,
            notices_unknown_region: s.notices_unknown_region,
            notice_gaps: s.notice_gaps,
            duplicates: s.duplicates,
            rejections: s.rejections,
            unpin_batches: s.unpin_batches,
            unpins_not_held: s.unpins_not_held,
            unpins_dropped: s.unpins_dropped,
            views_invalidated: s.views_invalidated,
            registers_unresolved: s.registers_unresolved,
            heartbeats: s.heartbeats,
        };
        // SAFETY: passed on to the caller.
        unsafe { args::write_versioned(out, &v, "out") }
    })
}

/// This instance's memory accounting, as of the latest reply. Set
/// `out->size` first.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
#[allow(non_camel_case_types)]
pub struct cxlkv_usage {
    pub size: u32,
    /// Always 0.
    pub reserved: u32,
    /// Page bytes of the keys this instance registered that still exist.
    pub instance_used_bytes: u64,
    /// Bytes of the regions assigned to this instance.
    pub instance_owned_bytes: u64,
    /// The instance's quota at the directory; 0: none.
    pub instance_quota_bytes: u64,
    /// Bytes left in the pools, not yet carved into regions.
    pub pool_free_bytes: u64,
}

const _: () = assert!(size_of::<cxlkv_usage>() == 40);

// SAFETY: repr(C), `size: u32` first, integers only, no padding (asserted).
unsafe impl Versioned for cxlkv_usage {
    const SIZES: &'static [usize] = &[size_of::<cxlkv_usage>()];
}

/// Writes the instance's memory accounting into `*out` (no round trip).
///
/// # Safety
///
/// As `cxlkv_query_stats`.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_query_usage(
    client: *const cxlkv_client,
    out: *mut cxlkv_usage,
) -> cxlkv_status {
    call("cxlkv_query_usage", || {
        let u = self::client(client)?.usage();
        let v = cxlkv_usage {
            size: size_of::<cxlkv_usage>() as u32,
            reserved: 0,
            instance_used_bytes: u.instance_used_bytes,
            instance_owned_bytes: u.instance_owned_bytes,
            instance_quota_bytes: u.instance_quota_bytes,
            pool_free_bytes: u.pool_free_bytes,
        };
        // SAFETY: passed on to the caller.
        unsafe { args::write_versioned(out, &v, "out") }
    })
}

/// The session as it stands. Set `out->size` first.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
#[allow(non_camel_case_types)]
pub struct cxlkv_session_info {
    pub size: u32,
    /// Always 0.
    pub reserved: u32,
    /// The id of the session the client opened last. Not a connection
    /// check: while the connection is broken it keeps the last session's
    /// id, until a reconnect opens a new session (calls fail meanwhile
    /// with `CXLKV_STATUS_DISCONNECTED` or `CXLKV_STATUS_UNANSWERED`).
    pub session_id: u64,
    /// The directory's incarnation as of that session (changes when the
    /// directory restarts and the client reconnects).
    pub directory_epoch: u64,
    /// Keys this instance registered that still exist.
    pub owned_keys: u64,
    /// Registrations whose outcome is still unknown.
    pub unresolved_registrations: u64,
    /// Most keys one batch call may carry (the directory's limit, as that
    /// session announced it): a longer batch is refused with
    /// `CXLKV_STATUS_BATCH_TOO_LARGE`. Since size 48.
    pub max_batch: u32,
    /// Longest key the directory accepts, in bytes. Since size 48.
    pub max_key_bytes: u32,
}

const _: () = assert!(size_of::<cxlkv_session_info>() == 48);

// SAFETY: repr(C), `size: u32` first, integers only, no padding (asserted).
unsafe impl Versioned for cxlkv_session_info {
    const SIZES: &'static [usize] = &[40, size_of::<cxlkv_session_info>()];
}

/// Writes the session's state into `*out` (no round trip).
///
/// # Safety
///
/// As `cxlkv_query_stats`.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_query_session(
    client: *const cxlkv_client,
    out: *mut cxlkv_session_info,
) -> cxlkv_status {
    call("cxlkv_query_session", || {
        let c = self::client(client)?;
        let v = cxlkv_session_info {
            size: size_of::<cxlkv_session_info>() as u32,
            reserved: 0,
            session_id: c.session_id().unwrap_or(0),
            directory_epoch: c.directory_epoch().unwrap_or(0),
            owned_keys: c.owned_keys() as u64,
            unresolved_registrations: c.unresolved_registrations() as u64,
            max_batch: c.max_batch() as u32,
            max_key_bytes: c.max_key_bytes() as u32,
        };
        // SAFETY: passed on to the caller.
        unsafe { args::write_versioned(out, &v, "out") }
    })
}

/// Writes the instance's id, NUL-terminated, into `buf` (`cap` bytes) and
/// its length (without the NUL) into `*out_len`. If it does not fit:
/// `CXLKV_STATUS_BUFFER_TOO_SMALL`, with `*out_len` still set.
///
/// # Safety
///
/// `buf` valid for writes of `cap` bytes; `out_len` for a write.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_instance_id(
    client: *const cxlkv_client,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> cxlkv_status {
    call("cxlkv_instance_id", || {
        // SAFETY: passed on to the caller.
        unsafe { Out::unset(out_len, "out_len") }?;
        let c = self::client(client)?;
        // SAFETY: passed on to the caller.
        unsafe { args::write_text(c.instance_id(), buf, cap, out_len) }
    })
}

/// Sends the unpins of released views now (otherwise sent within the
/// configured `unpin_delay_us`, or before this client's next request).
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub extern "C" fn cxlkv_flush_unpins(client: *const cxlkv_client) -> cxlkv_status {
    call("cxlkv_flush_unpins", || {
        Ok(self::client(client)?.flush_unpins()?)
    })
}

/// Maps the regions of other instances the directory lists (its first 2048:
/// one statistics reply's rows), so that later first reads of them do not
/// map; `*out_mapped` is how many were mapped.
///
/// # Safety
///
/// `out_mapped` valid for a write.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_map_all_regions(
    client: *const cxlkv_client,
    out_mapped: *mut usize,
) -> cxlkv_status {
    call("cxlkv_map_all_regions", || {
        // SAFETY: passed on to the caller.
        let mut out = unsafe { Out::unset(out_mapped, "out_mapped") }?;
        out.write(self::client(client)?.map_all_regions()?);
        Ok(())
    })
}

/// The directory's totals (one round trip). Set `out->size` first.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
#[allow(non_camel_case_types)]
pub struct cxlkv_directory_stats {
    pub size: u32,
    /// Always 0.
    pub reserved: u32,
    pub uptime_ms: u64,
    pub directory_epoch: u64,
    /// Gauges.
    pub keys: u64,
    pub used_bytes: u64,
    pub value_bytes: u64,
    pub key_bytes: u64,
    pub owned_bytes: u64,
    pub regions: u64,
    pub deferred_regions: u64,
    pub pending_region_requests: u64,
    pub pins: u64,
    pub pinned_keys: u64,
    pub instances_live: u64,
    pub instances_absent: u64,
    pub sessions: u64,
    pub notices_pending: u64,
    pub layouts: u64,
    pub long_held_pins: u64,
    /// Counters since the directory started.
    pub evictions_orphan: u64,
    pub evictions_lru: u64,
    pub evictions_lru_skipped: u64,
    pub sessions_expired: u64,
    pub sessions_closed: u64,
    pub sessions_ended: u64,
    pub instances_gone: u64,
    pub regions_granted: u64,
    pub regions_returned: u64,
    pub regions_freed: u64,
    pub regions_deferred: u64,
    pub notices_issued: u64,
    pub inserted: u64,
    pub duplicate: u64,
    pub rejected: u64,
    pub stale_generation: u64,
    pub lookup_hits: u64,
    pub lookup_misses: u64,
    pub exists_hits: u64,
    pub exists_misses: u64,
    /// Gauge: (session, key) pairs with pins held, all sessions — what
    /// `max_pinned_entries` bounds (a pinning lookup that could cross it is
    /// refused `CXLKV_STATUS_SERVER_BUSY`). Not written for a caller whose
    /// `size` is that of the struct before these last three fields.
    pub pinned_entries: u64,
    /// The directory's `max_pinned_entries`.
    pub max_pinned_entries: u64,
    /// Gauge: bytes the sessions' pin ledgers hold.
    pub pin_ledger_bytes: u64,
}

/// The struct's size before `pinned_entries` was appended.
const DIRECTORY_STATS_V1_BYTES: usize = 8 + 38 * 8;
const _: () = assert!(size_of::<cxlkv_directory_stats>() == DIRECTORY_STATS_V1_BYTES + 3 * 8);

// SAFETY: repr(C), `size: u32` first, integers only, no padding (asserted).
unsafe impl Versioned for cxlkv_directory_stats {
    const SIZES: &'static [usize] = &[DIRECTORY_STATS_V1_BYTES, size_of::<cxlkv_directory_stats>()];
}

/// Writes the directory's totals into `*out` (one round trip).
///
/// # Safety
///
/// As `cxlkv_query_stats`.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_query_directory(
    client: *const cxlkv_client,
    out: *mut cxlkv_directory_stats,
) -> cxlkv_status {
    call("cxlkv_query_directory", || {
        // No optional tables: the totals come with every reply.
        let r = self::client(client)?.directory_stats(0)?;
        let (t, o) = (r.totals, r.outcomes);
        let v = cxlkv_directory_stats {
            size: size_of::<cxlkv_directory_stats>() as u32,
            reserved: 0,
            uptime_ms: r.uptime_ms,
            directory_epoch: r.directory_epoch,
            keys: t.keys,
            used_bytes: t.used_bytes,
            value_bytes: t.value_bytes,
            key_bytes: t.key_bytes,
            owned_bytes: t.owned_bytes,
            regions: t.regions,
            deferred_regions: t.deferred_regions,
            pending_region_requests: t.pending_region_requests,
            pins: t.pins,
            pinned_keys: t.pinned_keys,
            instances_live: t.instances_live,
            instances_absent: t.instances_absent,
            sessions: t.sessions,
            notices_pending: t.notices_pending,
            layouts: t.layouts,
            long_held_pins: t.long_held_pins,
            evictions_orphan: t.evictions_orphan,
            evictions_lru: t.evictions_lru,
            evictions_lru_skipped: t.evictions_lru_skipped,
            sessions_expired: t.sessions_expired,
            sessions_closed: t.sessions_closed,
            sessions_ended: t.sessions_ended,
            instances_gone: t.instances_gone,
            regions_granted: t.regions_granted,
            regions_returned: t.regions_returned,
            regions_freed: t.regions_freed,
            regions_deferred: t.regions_deferred,
            notices_issued: t.notices_issued,
            inserted: o.inserted,
            duplicate: o.duplicate,
            rejected: o.rejected,
            stale_generation: o.stale_generation,
            lookup_hits: o.lookup_hits,
            lookup_misses: o.lookup_misses,
            exists_hits: o.exists_hits,
            exists_misses: o.exists_misses,
            pinned_entries: t.pinned_entries,
            max_pinned_entries: t.max_pinned_entries,
            pin_ledger_bytes: t.pin_ledger_bytes,
        };
        // SAFETY: passed on to the caller.
        unsafe { args::write_versioned(out, &v, "out") }
    })
}

/// Adds region map/unmap callbacks for regions mapped from now on (regions
/// already mapped are not reported; to see every mapping, set
/// `cxlkv_config.map_callbacks` at connect). `*out_observer` is the handle
/// to remove them with.
///
/// After `cxlkv_remove_map_observer`, regions the callbacks were told about
/// still report their unmapping to them, and a mapping another thread had
/// under way when it returned may still report itself (and later its
/// unmapping): they must stay callable, and `user_data` valid, until
/// `cxlkv_close` returned and every handle made from the client (layouts,
/// tiers, map observers, views, leases) was freed and every tier page hold
/// released — the regions are unmapped when the last of them goes.
///
/// At most 64 observers per client (then `CXLKV_STATUS_MAP`).
///
/// # Safety
///
/// `callbacks` valid for a read; `out_observer` for a write.
///
/// Thread safety: any thread. The callbacks run on any thread, possibly on
/// several at once for different regions, and must not call any `cxlkv_*`
/// function (they run under the client's mapping locks).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_add_map_observer(
    client: *const cxlkv_client,
    callbacks: *const cxlkv_map_callbacks,
    out_observer: *mut *mut cxlkv_observer,
) -> cxlkv_status {
    call("cxlkv_add_map_observer", || {
        // SAFETY: passed on to the caller.
        let mut out = unsafe { Out::unset(out_observer, "out_observer") }?;
        let c = self::client(client)?;
        // SAFETY: passed on to the caller (one readable struct).
        let cbs = unsafe { args::slice(callbacks, 1, "callbacks") }?[0];
        let observer =
            CMapObserver::boxed(cbs).ok_or_else(|| FfiError::invalid("both callbacks are NULL"))?;
        c.add_map_observer(Arc::clone(&observer))?;
        let entry = ObserverEntry {
            client: Client::clone(&c),
            observer: Arc::clone(&observer),
        };
        match OBSERVERS.insert(entry) {
            Ok(token) => {
                out.write(to_ptr(token));
                Ok(())
            }
            Err(e) => {
                c.remove_map_observer(&observer);
                Err(e)
            }
        }
    })
}

/// Stops telling the observer about new mappings and frees its handle
/// (NULL: nothing to do); see `cxlkv_add_map_observer` for the unmappings
/// it is still told about.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub extern "C" fn cxlkv_remove_map_observer(observer: *mut cxlkv_observer) -> cxlkv_status {
    call("cxlkv_remove_map_observer", || {
        if observer.is_null() {
            return Ok(());
        }
        let entry = OBSERVERS.remove(observer.addr(), "observer")?;
        entry.client.remove_map_observer(&entry.observer);
        Ok(())
    })
}
