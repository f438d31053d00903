//! The L1 tier ([`L1Tier`]): the engine-facing staged protocol — reserve
//! and finish reads and writes, promotes, temporaries, delete, clear, the
//! TTL sweeper, listeners and events — over one layout.
//!
//! Every key operation takes a caller-owned key array and writes one
//! result per key into a caller-owned array: a `cxlkv_tier_code` (the
//! reference's per-key results, stable numbers), plus for read-type
//! operations the page (`cxlkv_tier_page`: address and length in the
//! pool, zero copy). A call is refused as a whole — a status, nothing
//! changed — only for bad arguments (a key repeated within the call, an
//! unsupported write mode, lengths over the limits), a re-entrant call from
//! a listener, a closed tier (`CXLKV_STATUS_TIER_CLOSED`), or a closed
//! client (`CXLKV_STATUS_CLOSED`, as its layouts answer: every call but
//! `cxlkv_tier_close`).
//!
//! **Page addresses** stay valid while the tier holds the reservation that
//! returned them: until the matching finish, `delete`, `clear`,
//! `cxlkv_tier_close`, or the TTL sweeper reclaiming an expired one — and
//! never past `cxlkv_close` of the client (its read pins end with the
//! session, and after the server's grace period its regions, write pages
//! included, may go to another instance). A write page may be written
//! until its `finish_*`; a read page is read-only.
//!
//! **Mapping holds.** Once a reservation ends, its tier no longer keeps
//! the page's region mapped: a peer region may then be evicted from the
//! client's mapping cache, an own region returned, and an address kept
//! past the end faults rather than reading stale bytes. A caller that
//! cannot stop every use of an address at the reservation's end — one
//! that cannot stop the TTL sweeper (a language binding whose buffers
//! outlive the call) — opens the tier with `CXLKV_TIER_HOLD_MAPPINGS`:
//! every page a call returns then comes with a hold on its mapping, which
//! the caller gives back with `cxlkv_tier_release_page` (once per page
//! returned). While held, the address stays mapped — dereferenceable, its
//! bytes protected only while the reservation lasts.
//!
//! **Listeners and events** are C function pointers with a `void
//! *user_data`, called synchronously on the calling thread, in registration
//! order, and (except `accessed`) under the tier's lock: a callback must
//! not call back into the same tier (such a call fails with
//! `CXLKV_STATUS_TIER_REENTRANT`), must return quickly, and must not
//! unwind. The key arrays they receive are valid only during the call.

use std::collections::BTreeMap;
use std::ffi::{c_char, c_void};
use std::mem::size_of;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use cxlkv::tier::{
    EventSink, Holds, KeyPage, KeyStage, L1Tier, Listener, TierCode, TierConfig, TierError,
    TierEvent, TierPage, WriteMode,
};
use parking_lot::Mutex;

use crate::args::{self, Entries, Out, OutSlice, Versioned, cxlkv_bytes};
use crate::boundary::call;
use crate::handle::{Registry, Tag, to_ptr};
use crate::layout::{cxlkv_layout, cxlkv_location, layout};
use crate::status::{FfiError, cxlkv_status};

/// An L1 tier over one layout (opaque).
#[allow(non_camel_case_types)]
pub struct cxlkv_tier {
    _opaque: [u8; 0],
}

/// A tier as its handle holds it.
struct OpenTier {
    tier: L1Tier,
    /// `CXLKV_TIER_HOLD_MAPPINGS`: every page returned comes with a hold.
    hold_mappings: bool,
}

impl Deref for OpenTier {
    type Target = L1Tier;

    fn deref(&self) -> &L1Tier {
        &self.tier
    }
}

static TIERS: Registry<OpenTier> = Registry::new(Tag::Tier);

fn tier(handle: *const cxlkv_tier) -> Result<Arc<OpenTier>, FfiError> {
    TIERS.get(handle.addr(), "tier")
}

/// `cxlkv_tier_config.flags`: every page a call of the tier returns comes
/// with a hold on its mapping, given back with `cxlkv_tier_release_page`
/// (see that function).
pub const CXLKV_TIER_HOLD_MAPPINGS: u32 = 1 << 0;

const KNOWN_TIER_FLAGS: u32 = CXLKV_TIER_HOLD_MAPPINGS;

/// The mapping holds of tier pages, by page address: a clone of the page
/// (which keeps its region mapped), how many holds are outstanding, and
/// the process incarnation that took them (`cxlkv::client::process_incarnation`,
/// as handles record it: holds do not cross `fork` either).
/// An address names one page of one mapping for as long as it is held —
/// a held mapping is never unmapped, so no other can take its addresses —
/// so the map never holds more entries than the pages mapped in the
/// process, however many holds are taken.
static PAGE_HOLDS: Mutex<BTreeMap<usize, PageHold>> = Mutex::new(BTreeMap::new());

struct PageHold {
    page: TierPage,
    holds: u64,
    incarnation: u32,
}

/// Takes one mapping hold per page of `results`.
fn hold_pages(results: &[KeyPage]) {
    let mut holds = PAGE_HOLDS.lock();
    for page in results.iter().filter_map(|r| r.page.as_ref()) {
        holds
            .entry(page.as_ptr().addr())
            .and_modify(|h| h.holds += 1)
            .or_insert_with(|| PageHold {
                page: page.clone(),
                holds: 1,
                incarnation: cxlkv::client::process_incarnation(),
            });
    }
}

/// Most read holds one call takes or releases per key; larger counts are
/// clamped to it, and 0 to 1.
pub const CXLKV_TIER_MAX_HOLDS: u32 = 128;
// A literal above, so that cbindgen writes it into the header (it cannot
// evaluate `Holds::MAX`); this keeps the two equal.
const _: () = assert!(CXLKV_TIER_MAX_HOLDS == Holds::MAX);

/// Per-key result of a tier operation (the reference's names; stable
/// numbers).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum cxlkv_tier_code {
    CXLKV_TIER_SUCCESS = 0,
    /// Not staged here, not in the directory, or not resolvable.
    CXLKV_TIER_KEY_NOT_EXIST = 1,
    /// Mid-write on this tier (or an idle private temporary).
    CXLKV_TIER_KEY_NOT_READABLE = 2,
    /// Already staged here, or already registered.
    CXLKV_TIER_KEY_NOT_WRITABLE = 3,
    /// Registration failed or its outcome is unknown; a promote of a
    /// read-staged key; a finish of an idle private temporary.
    CXLKV_TIER_KEY_IN_WRONG_STATE = 4,
    /// Delete refused: held here, pinned by someone, or unknown (retry).
    CXLKV_TIER_KEY_IS_LOCKED = 5,
    /// The allocator could not fit the whole batch.
    CXLKV_TIER_OUT_OF_MEMORY = 6,
    /// No result: the call failed (its status says what is known) and
    /// wrote no per-key code (header, "Outputs of a failed call"). Never
    /// returned by a call that succeeded.
    CXLKV_TIER_NOT_DONE = 7,
}

impl crate::args::Unset for cxlkv_tier_code {
    const UNSET: Self = cxlkv_tier_code::CXLKV_TIER_NOT_DONE;
}

fn tier_code(c: TierCode) -> cxlkv_tier_code {
    use cxlkv_tier_code as C;
    match c {
        TierCode::Success => C::CXLKV_TIER_SUCCESS,
        TierCode::KeyNotExist => C::CXLKV_TIER_KEY_NOT_EXIST,
        TierCode::KeyNotReadable => C::CXLKV_TIER_KEY_NOT_READABLE,
        TierCode::KeyNotWritable => C::CXLKV_TIER_KEY_NOT_WRITABLE,
        TierCode::KeyInWrongState => C::CXLKV_TIER_KEY_IN_WRONG_STATE,
        TierCode::KeyIsLocked => C::CXLKV_TIER_KEY_IS_LOCKED,
        TierCode::OutOfMemory => C::CXLKV_TIER_OUT_OF_MEMORY,
        // A code newer than this library: the closest meaning.
        _ => C::CXLKV_TIER_KEY_IN_WRONG_STATE,
    }
}

/// `reserve_write`'s mode; only `CXLKV_TIER_WRITE_NEW` is supported (keys
/// are write-once), the others are refused with
/// `CXLKV_STATUS_TIER_UNSUPPORTED_MODE`.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum cxlkv_tier_write_mode {
    CXLKV_TIER_WRITE_NEW = 0,
    CXLKV_TIER_WRITE_UPDATE = 1,
    CXLKV_TIER_WRITE_ALL = 2,
}

/// One key's result of a read-type operation: the code, and with
/// `CXLKV_TIER_SUCCESS` the page (else `data` is NULL and the sizes 0).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_camel_case_types)]
pub struct cxlkv_tier_page {
    pub code: cxlkv_tier_code,
    /// Always 0.
    pub reserved: u32,
    /// The chunk's first byte in this process's mapping of the pool:
    /// writable for `cxlkv_tier_reserve_write` results (until the key's
    /// finish), read-only otherwise; valid while the reservation lasts.
    pub data: *mut u8,
    pub len_bytes: u64,
    pub page_size_bytes: u64,
    pub location: cxlkv_location,
}

const NO_PAGE: cxlkv_tier_page = cxlkv_tier_page {
    code: cxlkv_tier_code::CXLKV_TIER_KEY_NOT_EXIST,
    reserved: 0,
    data: std::ptr::null_mut(),
    len_bytes: 0,
    page_size_bytes: 0,
    location: cxlkv_location {
        region_id: 0,
        page: 0,
        generation: 0,
        len_bytes: 0,
        reserved: 0,
    },
};

impl crate::args::Unset for cxlkv_tier_page {
    const UNSET: Self = cxlkv_tier_page {
        code: cxlkv_tier_code::CXLKV_TIER_NOT_DONE,
        ..NO_PAGE
    };
}

fn tier_page(kp: &KeyPage) -> cxlkv_tier_page {
    match &kp.page {
        Some(p) => cxlkv_tier_page {
            code: tier_code(kp.code),
            reserved: 0,
            data: p.as_mut_ptr(),
            len_bytes: p.len_bytes() as u64,
            page_size_bytes: p.page_size_bytes() as u64,
            location: p.location().into(),
        },
        None => cxlkv_tier_page {
            code: tier_code(kp.code),
            ..NO_PAGE
        },
    }
}

/// A listener callback: the keys concerned, in the call's input order
/// (`n` may be 0; the array lives only during the call).
#[allow(non_camel_case_types)]
pub type cxlkv_tier_keys_fn =
    Option<unsafe extern "C" fn(user_data: *mut c_void, keys: *const cxlkv_bytes, n: usize)>;

/// An observability event (the reference's `L1_*` names).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum cxlkv_tier_event {
    CXLKV_TIER_EVENT_READ_RESERVED = 1,
    CXLKV_TIER_EVENT_READ_FINISHED = 2,
    CXLKV_TIER_EVENT_WRITE_RESERVED = 3,
    CXLKV_TIER_EVENT_WRITE_FINISHED = 4,
    CXLKV_TIER_EVENT_WRITE_FINISHED_AND_READ_RESERVED = 5,
    CXLKV_TIER_EVENT_KEYS_EVICTED = 6,
}

/// An event callback (`event` is a `cxlkv_tier_event`).
#[allow(non_camel_case_types)]
pub type cxlkv_tier_event_fn = Option<
    unsafe extern "C" fn(user_data: *mut c_void, event: u32, keys: *const cxlkv_bytes, n: usize),
>;

/// A tier's settings. Initialise with `cxlkv_tier_config_init`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_camel_case_types)]
pub struct cxlkv_tier_config {
    /// `sizeof(cxlkv_tier_config)` as the caller's header declares it.
    pub size: u32,
    /// `CXLKV_TIER_HOLD_MAPPINGS` or 0 (unknown bits are refused,
    /// `INVALID_ARGUMENT`).
    pub flags: u32,
    /// How long a write reservation may stay unfinished before the sweeper
    /// reclaims it (1 ms ..= one year).
    pub write_ttl_ms: u64,
    /// How long a read staging may stay after its last reserve.
    pub read_ttl_ms: u64,
    /// Where events go (NULL: nowhere). Runs like a listener.
    pub on_event: cxlkv_tier_event_fn,
    pub event_user_data: *mut c_void,
}

const _: () = assert!(size_of::<cxlkv_tier_config>() == 40);

// SAFETY: repr(C), `size: u32` first, integers, a raw pointer and an
// optional function pointer; no padding (asserted).
unsafe impl Versioned for cxlkv_tier_config {
    const SIZES: &'static [usize] = &[size_of::<cxlkv_tier_config>()];
}

fn tier_config_defaults() -> cxlkv_tier_config {
    let d = TierConfig::default();
    cxlkv_tier_config {
        size: size_of::<cxlkv_tier_config>() as u32,
        flags: 0,
        write_ttl_ms: d.write_ttl.as_millis() as u64,
        read_ttl_ms: d.read_ttl.as_millis() as u64,
        on_event: None,
        event_user_data: std::ptr::null_mut(),
    }
}

/// Fills `config` with the tier defaults (write TTL 600 s, read TTL 300 s,
/// no events) for a struct of `size` bytes.
///
/// # Safety
///
/// `config` valid for writes of `size` bytes.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_tier_config_init(
    config: *mut cxlkv_tier_config,
    size: u32,
) -> cxlkv_status {
    call("cxlkv_tier_config_init", || {
        // SAFETY: passed on to the caller.
        unsafe { crate::config::init_versioned(config, size, tier_config_defaults(), "config") }
    })
}

/// Keys of a callback as C sees them (valid while `keys` is).
fn c_keys(keys: &[&[u8]]) -> Vec<cxlkv_bytes> {
    keys.iter()
        .map(|k| cxlkv_bytes {
            data: k.as_ptr(),
            len: k.len(),
        })
        .collect()
}

struct CEventSink {
    on_event: unsafe extern "C" fn(*mut c_void, u32, *const cxlkv_bytes, usize),
    user_data: *mut c_void,
}

// SAFETY: the callback and `user_data` are the caller's; the documented
// contract of `cxlkv_tier_config.on_event` is that they may be called from
// any thread.
unsafe impl Send for CEventSink {}
// SAFETY: as for Send; never mutated.
unsafe impl Sync for CEventSink {}

impl EventSink for CEventSink {
    fn publish(&self, event: TierEvent, keys: &[&[u8]]) {
        use cxlkv_tier_event as E;
        let e = match event {
            TierEvent::ReadReserved => E::CXLKV_TIER_EVENT_READ_RESERVED,
            TierEvent::ReadFinished => E::CXLKV_TIER_EVENT_READ_FINISHED,
            TierEvent::WriteReserved => E::CXLKV_TIER_EVENT_WRITE_RESERVED,
            TierEvent::WriteFinished => E::CXLKV_TIER_EVENT_WRITE_FINISHED,
            TierEvent::WriteFinishedAndReadReserved => {
                E::CXLKV_TIER_EVENT_WRITE_FINISHED_AND_READ_RESERVED
            }
            TierEvent::KeysEvicted => E::CXLKV_TIER_EVENT_KEYS_EVICTED,
            // An event newer than this library's ABI is not forwarded.
            _ => return,
        };
        let c = c_keys(keys);
        // SAFETY: the caller's callback, with its user data and an array
        // of `c.len()` keys alive for the call.
        unsafe { (self.on_event)(self.user_data, e as u32, c.as_ptr(), c.len()) }
    }
}

/// Opens a tier over `layout` (the reference's `register_kv_layout`: the
/// layout fixes page size and key space) and starts its TTL sweeper.
/// `config` NULL: the defaults. Close with `cxlkv_tier_close`.
///
/// # Safety
///
/// `config` NULL or valid for reads of `config->size` bytes; `out_tier`
/// valid for a write. `config->on_event` and its user data must stay
/// callable until `cxlkv_tier_close` returned.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_tier_open(
    layout: *const cxlkv_layout,
    config: *const cxlkv_tier_config,
    out_tier: *mut *mut cxlkv_tier,
) -> cxlkv_status {
    call("cxlkv_tier_open", || {
        // SAFETY: passed on to the caller.
        let mut out = unsafe { Out::unset(out_tier, "out_tier") }?;
        let c = if config.is_null() {
            tier_config_defaults()
        } else {
            // SAFETY: passed on to the caller.
            unsafe { args::read_versioned(config, tier_config_defaults(), "config") }?
        };
        if c.flags & !KNOWN_TIER_FLAGS != 0 {
            // A later version may give them a meaning this library cannot
            // honour: refused, never ignored.
            return Err(FfiError::invalid(format!(
                "`config->flags` has unknown bits {:#x}",
                c.flags & !KNOWN_TIER_FLAGS
            )));
        }
        let l = self::layout(layout)?;
        let mut cfg = TierConfig {
            write_ttl: Duration::from_millis(c.write_ttl_ms),
            read_ttl: Duration::from_millis(c.read_ttl_ms),
            ..TierConfig::default()
        };
        if let Some(on_event) = c.on_event {
            cfg.events = Some(Arc::new(CEventSink {
                on_event,
                user_data: c.event_user_data,
            }));
        }
        let t = OpenTier {
            tier: L1Tier::new(cxlkv::client::LayoutHandle::clone(&l), cfg)?,
            hold_mappings: c.flags & CXLKV_TIER_HOLD_MAPPINGS != 0,
        };
        out.write(to_ptr(TIERS.insert(t)?));
        Ok(())
    })
}

/// Closes the tier and frees its handle (NULL: nothing to do): stops and
/// joins the sweeper, then drains the staging without notifying — every
/// read pin released, every private temporary and write page reclaimed.
/// Page addresses the tier returned are invalid afterwards (a page still
/// held, `CXLKV_TIER_HOLD_MAPPINGS`, stays mapped until released, its
/// bytes no longer protected). The client and layout stay open. The
/// handle is freed even when the status reports a failure.
///
/// Thread safety: any thread, except from a listener of this tier
/// (`CXLKV_STATUS_TIER_REENTRANT`, and the handle stays valid).
#[unsafe(no_mangle)]
pub extern "C" fn cxlkv_tier_close(tier: *mut cxlkv_tier) -> cxlkv_status {
    call("cxlkv_tier_close", || {
        if tier.is_null() {
            return Ok(());
        }
        let t = self::tier(tier)?;
        let closed = t.close();
        // A close from a listener is refused and keeps the handle.
        if let Err(TierError::Reentrant { .. }) = &closed {
            return closed.map_err(FfiError::from);
        }
        TIERS.remove(tier.addr(), "tier")?;
        closed.map_err(FfiError::from)
    })
}

/// Gives back one mapping hold on the tier page at `data` — the
/// `cxlkv_tier_page.data` of a page returned by a tier opened with
/// `CXLKV_TIER_HOLD_MAPPINGS` (NULL: nothing to do). Each page a call of
/// such a tier returns (each result whose `data` is not NULL) is held
/// once (the same page returned twice is held twice) and stays mapped — dereferenceable, though its bytes are
/// protected only while its reservation lasts — until released, also
/// after the tier's or the client's close: its region is not unmapped
/// (nor `before_unmap` called for it) while a hold on one of its pages
/// lasts. An address with no hold left is `CXLKV_STATUS_BAD_HANDLE`, and
/// so is a hold taken before this process was forked (holds, like
/// handles, stay in the process that took them; the child releases
/// nothing).
///
/// Thread safety: any thread, also from a listener.
#[unsafe(no_mangle)]
pub extern "C" fn cxlkv_tier_release_page(data: *const u8) -> cxlkv_status {
    call("cxlkv_tier_release_page", || {
        if data.is_null() {
            return Ok(());
        }
        let last = {
            let mut holds = PAGE_HOLDS.lock();
            let Some(hold) = holds.get_mut(&data.addr()) else {
                return Err(FfiError::new(
                    cxlkv_status::CXLKV_STATUS_BAD_HANDLE,
                    format!(
                        "`data` ({data:p}) is not a held tier page: released already, or \
                         not returned by a tier opened with CXLKV_TIER_HOLD_MAPPINGS"
                    ),
                ));
            };
            // As a handle made before a fork (`handle.rs`): the child's copy
            // of the hold is never dropped, so no region is unmapped nor
            // `before_unmap` called in a process that did not map it.
            if hold.incarnation != cxlkv::client::process_incarnation() {
                return Err(FfiError::new(
                    cxlkv_status::CXLKV_STATUS_BAD_HANDLE,
                    format!(
                        "`data` ({data:p}) is a tier page held before this process was forked: \
                         a hold is given back only in the process that took it (nothing was \
                         released)"
                    ),
                ));
            }
            hold.holds -= 1;
            if hold.holds == 0 {
                holds.remove(&data.addr()).map(|h| h.page)
            } else {
                None
            }
        };
        // Outside the lock: dropping the last reference to a retired
        // mapping unmaps it (and calls `before_unmap`) on this thread.
        drop(last);
        Ok(())
    })
}

/// A listener: seven callbacks (any may be NULL) and their user data.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_camel_case_types)]
pub struct cxlkv_tier_listener {
    /// `sizeof(cxlkv_tier_listener)` as the caller's header declares it.
    pub size: u32,
    /// Always 0 (anything else is refused, `INVALID_ARGUMENT`).
    pub reserved: u32,
    /// `reserve_read` staged these keys (hits only).
    pub reserved_read: cxlkv_tier_keys_fn,
    /// `finish_read` released holds on these keys.
    pub read_finished: cxlkv_tier_keys_fn,
    /// `reserve_write` staged these keys.
    pub reserved_write: cxlkv_tier_keys_fn,
    /// `finish_write` registered these keys (never temporaries): the
    /// write-through trigger.
    pub write_finished: cxlkv_tier_keys_fn,
    /// A promote completed these keys and holds them for reading.
    pub finish_write_and_reserve_read: cxlkv_tier_keys_fn,
    /// These keys were removed: they leave the eviction policy.
    pub deleted: cxlkv_tier_keys_fn,
    /// `touch_keys` (recency only).
    pub accessed: cxlkv_tier_keys_fn,
    pub user_data: *mut c_void,
}

const _: () = assert!(size_of::<cxlkv_tier_listener>() == 8 + 8 * 8);

// SAFETY: repr(C), `size: u32` first, optional function pointers and a raw
// pointer; no padding (asserted).
unsafe impl Versioned for cxlkv_tier_listener {
    const SIZES: &'static [usize] = &[size_of::<cxlkv_tier_listener>()];
}

struct CListener(cxlkv_tier_listener);

// SAFETY: the callbacks and `user_data` are the caller's; the documented
// contract of `cxlkv_tier_register_listener` is that they may be called
// from any thread.
unsafe impl Send for CListener {}
// SAFETY: as for Send; never mutated.
unsafe impl Sync for CListener {}

impl CListener {
    fn call(&self, f: cxlkv_tier_keys_fn, keys: &[&[u8]]) {
        if let Some(f) = f {
            let c = c_keys(keys);
            // SAFETY: the caller's callback, with its user data and an
            // array of `c.len()` keys alive for the call.
            unsafe { f(self.0.user_data, c.as_ptr(), c.len()) }
        }
    }
}

impl Listener for CListener {
    fn reserved_read(&self, keys: &[&[u8]]) {
        self.call(self.0.reserved_read, keys);
    }
    fn read_finished(&self, keys: &[&[u8]]) {
        self.call(self.0.read_finished, keys);
    }
    fn reserved_write(&self, keys: &[&[u8]]) {
        self.call(self.0.reserved_write, keys);
    }
    fn write_finished(&self, keys: &[&[u8]]) {
        self.call(self.0.write_finished, keys);
    }
    fn finish_write_and_reserve_read(&self, keys: &[&[u8]]) {
        self.call(self.0.finish_write_and_reserve_read, keys);
    }
    fn deleted(&self, keys: &[&[u8]]) {
        self.call(self.0.deleted, keys);
    }
    fn accessed(&self, keys: &[&[u8]]) {
        self.call(self.0.accessed, keys);
    }
}

/// Appends a listener (copied; no de-duplication, no notification). Its
/// callbacks run synchronously on the calling thread of each operation,
/// under the tier's lock (except `accessed`); they and `user_data` must
/// stay valid until `cxlkv_tier_close` returned.
///
/// # Safety
///
/// `listener` valid for reads of `listener->size` bytes.
///
/// Thread safety: any thread; not from a listener of this tier.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_tier_register_listener(
    tier: *const cxlkv_tier,
    listener: *const cxlkv_tier_listener,
) -> cxlkv_status {
    call("cxlkv_tier_register_listener", || {
        let empty = cxlkv_tier_listener {
            size: size_of::<cxlkv_tier_listener>() as u32,
            reserved: 0,
            reserved_read: None,
            read_finished: None,
            reserved_write: None,
            write_finished: None,
            finish_write_and_reserve_read: None,
            deleted: None,
            accessed: None,
            user_data: std::ptr::null_mut(),
        };
        // SAFETY: passed on to the caller.
        let l = unsafe { args::read_versioned(listener, empty, "listener") }?;
        if l.reserved != 0 {
            // A later version may give it a meaning this library cannot
            // honour: refused, never ignored.
            return Err(FfiError::invalid("listener->reserved must be 0"));
        }
        Ok(self::tier(tier)?.register_listener(Arc::new(CListener(l)))?)
    })
}

/// `(tier, keys)` of a key operation, checked.
///
/// # Safety
///
/// As [`args::keys`].
unsafe fn tier_keys<'a>(
    tier: *const cxlkv_tier,
    keys: *const cxlkv_bytes,
    n: usize,
) -> Result<(Arc<OpenTier>, Vec<&'a [u8]>), FfiError> {
    // SAFETY: passed on to the caller.
    let keys = unsafe { args::keys(keys, n, Entries::Batch) }?;
    Ok((self::tier(tier)?, keys))
}

/// Writes read-type results, with a mapping hold per page if `t` hands
/// them out.
fn write_pages(t: &OpenTier, out: &mut OutSlice<cxlkv_tier_page>, results: &[KeyPage]) {
    if t.hold_mappings {
        hold_pages(results);
    }
    for (i, r) in results.iter().enumerate() {
        out.write(i, tier_page(r));
    }
}

fn write_codes(out: &mut OutSlice<cxlkv_tier_code>, codes: &[TierCode]) {
    for (i, c) in codes.iter().enumerate() {
        out.write(i, tier_code(*c));
    }
}

/// Takes `holds` read holds (a total: clamped to 1..=`CXLKV_TIER_MAX_HOLDS`)
/// on each key and returns its page (one pinning round trip for the keys
/// not staged here). Per key: write-staged here → `KEY_NOT_READABLE`;
/// found → `SUCCESS` with the page; else `KEY_NOT_EXIST`.
///
/// # Safety
///
/// `keys` valid for reads of `n` entries (each of its `len` bytes);
/// `out_pages` for writes of `n`.
///
/// Thread safety: any thread; not from a listener of this tier.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_tier_reserve_read(
    tier: *const cxlkv_tier,
    keys: *const cxlkv_bytes,
    n: usize,
    holds: u32,
    out_pages: *mut cxlkv_tier_page,
) -> cxlkv_status {
    call("cxlkv_tier_reserve_read", || {
        args::batch_len(n)?;
        // SAFETY: passed on to the caller.
        let mut out = unsafe { OutSlice::unset(out_pages, n, "out_pages") }?;
        // SAFETY: passed on to the caller.
        let (t, keys) = unsafe { tier_keys(tier, keys, n) }?;
        let r = t.reserve_read(&keys, Holds::total(i64::from(holds)))?;
        write_pages(&t, &mut out, &r);
        Ok(())
    })
}

/// The staged page of each key, with no new hold and no round trip (only
/// between `reserve_read` and its `finish_read`).
///
/// # Safety
///
/// As `cxlkv_tier_reserve_read`.
///
/// Thread safety: any thread; not from a listener of this tier.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_tier_unsafe_read(
    tier: *const cxlkv_tier,
    keys: *const cxlkv_bytes,
    n: usize,
    out_pages: *mut cxlkv_tier_page,
) -> cxlkv_status {
    call("cxlkv_tier_unsafe_read", || {
        args::batch_len(n)?;
        // SAFETY: passed on to the caller.
        let mut out = unsafe { OutSlice::unset(out_pages, n, "out_pages") }?;
        // SAFETY: passed on to the caller.
        let (t, keys) = unsafe { tier_keys(tier, keys, n) }?;
        let r = t.unsafe_read(&keys)?;
        write_pages(&t, &mut out, &r);
        Ok(())
    })
}

/// Releases up to `holds` holds (clamped as for `reserve_read`) of each key
/// and, inside this call, the directory pins behind them. A key reaching
/// zero holds leaves the tier (its page address is then invalid).
///
/// # Safety
///
/// `keys` as for `cxlkv_tier_reserve_read`; `out_codes` valid for writes of
/// `n`.
///
/// Thread safety: any thread; not from a listener of this tier.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_tier_finish_read(
    tier: *const cxlkv_tier,
    keys: *const cxlkv_bytes,
    n: usize,
    holds: u32,
    out_codes: *mut cxlkv_tier_code,
) -> cxlkv_status {
    call("cxlkv_tier_finish_read", || {
        args::batch_len(n)?;
        // SAFETY: passed on to the caller.
        let mut out = unsafe { OutSlice::unset(out_codes, n, "out_codes") }?;
        // SAFETY: passed on to the caller.
        let (t, keys) = unsafe { tier_keys(tier, keys, n) }?;
        let r = t.finish_read(&keys, Holds::total(i64::from(holds)))?;
        write_codes(&mut out, &r);
        Ok(())
    })
}

/// Reserves a page per key for chunks of `len_bytes` (at most the page
/// size), to be written in place through `out_pages[i].data` and completed
/// by `cxlkv_tier_finish_write` (or a promote). `is_temporary[i]` non-zero
/// makes key `i` a private temporary (a promote/prefetch buffer never
/// shared). `mode` is a `cxlkv_tier_write_mode`.
///
/// # Safety
///
/// `keys` as for `cxlkv_tier_reserve_read`; `is_temporary` valid for reads
/// of `n` bytes; `out_pages` for writes of `n`.
///
/// Thread safety: any thread; not from a listener of this tier.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_tier_reserve_write(
    tier: *const cxlkv_tier,
    keys: *const cxlkv_bytes,
    is_temporary: *const u8,
    n: usize,
    len_bytes: u64,
    mode: u32,
    out_pages: *mut cxlkv_tier_page,
) -> cxlkv_status {
    call("cxlkv_tier_reserve_write", || {
        args::batch_len(n)?;
        // SAFETY: passed on to the caller.
        let mut out = unsafe { OutSlice::unset(out_pages, n, "out_pages") }?;
        // SAFETY: passed on to the caller.
        let (t, keys) = unsafe { tier_keys(tier, keys, n) }?;
        // SAFETY: passed on to the caller.
        let flags = unsafe { args::slice(is_temporary, n, "is_temporary") }?;
        let mode = match mode {
            m if m == cxlkv_tier_write_mode::CXLKV_TIER_WRITE_NEW as u32 => WriteMode::New,
            m if m == cxlkv_tier_write_mode::CXLKV_TIER_WRITE_UPDATE as u32 => WriteMode::Update,
            m if m == cxlkv_tier_write_mode::CXLKV_TIER_WRITE_ALL as u32 => WriteMode::All,
            m => {
                return Err(FfiError::invalid(format!(
                    "`mode` is {m}, not a cxlkv_tier_write_mode"
                )));
            }
        };
        let flags: Vec<bool> = flags.iter().map(|f| *f != 0).collect();
        let len = usize::try_from(len_bytes).unwrap_or(usize::MAX);
        let r = t.reserve_write(&keys, &flags, len, mode)?;
        write_pages(&t, &mut out, &r);
        Ok(())
    })
}

/// Completes writes: temporaries privately (never registered); retained
/// keys registered in one round trip.
///
/// # Safety
///
/// `keys` as for `cxlkv_tier_reserve_read`; `out_codes` valid for writes of
/// `n`.
///
/// Thread safety: any thread; not from a listener of this tier.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_tier_finish_write(
    tier: *const cxlkv_tier,
    keys: *const cxlkv_bytes,
    n: usize,
    out_codes: *mut cxlkv_tier_code,
) -> cxlkv_status {
    call("cxlkv_tier_finish_write", || {
        args::batch_len(n)?;
        // SAFETY: passed on to the caller.
        let mut out = unsafe { OutSlice::unset(out_codes, n, "out_codes") }?;
        // SAFETY: passed on to the caller.
        let (t, keys) = unsafe { tier_keys(tier, keys, n) }?;
        write_codes(&mut out, &t.finish_write(&keys)?);
        Ok(())
    })
}

/// The L2 → L1 promote: completes write-reserved keys and takes `holds`
/// read holds on each. A temporary's page is the one written; a retained
/// key's is the directory's (the winner's, if someone registered it
/// first).
///
/// # Safety
///
/// As `cxlkv_tier_reserve_read`.
///
/// Thread safety: any thread; not from a listener of this tier.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_tier_finish_write_and_reserve_read(
    tier: *const cxlkv_tier,
    keys: *const cxlkv_bytes,
    n: usize,
    holds: u32,
    out_pages: *mut cxlkv_tier_page,
) -> cxlkv_status {
    call("cxlkv_tier_finish_write_and_reserve_read", || {
        args::batch_len(n)?;
        // SAFETY: passed on to the caller.
        let mut out = unsafe { OutSlice::unset(out_pages, n, "out_pages") }?;
        // SAFETY: passed on to the caller.
        let (t, keys) = unsafe { tier_keys(tier, keys, n) }?;
        let r = t.finish_write_and_reserve_read(&keys, Holds::total(i64::from(holds)))?;
        write_pages(&t, &mut out, &r);
        Ok(())
    })
}

/// Deletes keys: an idle private temporary is reclaimed locally; a key
/// staged here is `KEY_IS_LOCKED`; the rest go to the directory in one
/// round trip (`SUCCESS`, `KEY_IS_LOCKED` while pinned, `KEY_NOT_EXIST`).
/// `force` is accepted and ignored, as in the reference.
///
/// # Safety
///
/// `keys` as for `cxlkv_tier_reserve_read`; `out_codes` valid for writes of
/// `n`.
///
/// Thread safety: any thread; not from a listener of this tier.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_tier_delete(
    tier: *const cxlkv_tier,
    keys: *const cxlkv_bytes,
    n: usize,
    force: bool,
    out_codes: *mut cxlkv_tier_code,
) -> cxlkv_status {
    call("cxlkv_tier_delete", || {
        args::batch_len(n)?;
        // SAFETY: passed on to the caller.
        let mut out = unsafe { OutSlice::unset(out_codes, n, "out_codes") }?;
        // SAFETY: passed on to the caller.
        let (t, keys) = unsafe { tier_keys(tier, keys, n) }?;
        write_codes(&mut out, &t.delete(&keys, force)?);
        Ok(())
    })
}

/// Tells the listeners `accessed(keys)` (recency only; no lock, no round
/// trip, no state change).
///
/// # Safety
///
/// `keys` as for `cxlkv_tier_reserve_read`.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_tier_touch_keys(
    tier: *const cxlkv_tier,
    keys: *const cxlkv_bytes,
    n: usize,
) -> cxlkv_status {
    call("cxlkv_tier_touch_keys", || {
        // SAFETY: passed on to the caller.
        let (t, keys) = unsafe { tier_keys(tier, keys, n) }?;
        Ok(t.touch_keys(&keys)?)
    })
}

/// Drops local staging (never shared data): without `force`, reclaims idle
/// private temporaries; with `force`, everything (pins released, pages
/// reclaimed — unsafe for operations in flight, as in the reference).
///
/// Thread safety: any thread; not from a listener of this tier.
#[unsafe(no_mangle)]
pub extern "C" fn cxlkv_tier_clear(tier: *const cxlkv_tier, force: bool) -> cxlkv_status {
    call("cxlkv_tier_clear", || Ok(self::tier(tier)?.clear(force)?))
}

/// Whether `key` is staged in neither map (lock-free; an unknown key is
/// evictable — `delete` answers authoritatively).
///
/// # Safety
///
/// `key` valid for reads of `key_len` bytes; `out_evictable` for a write.
///
/// Thread safety: any thread, also from a listener.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_tier_is_key_evictable(
    tier: *const cxlkv_tier,
    key: *const u8,
    key_len: usize,
    out_evictable: *mut bool,
) -> cxlkv_status {
    call("cxlkv_tier_is_key_evictable", || {
        // SAFETY: passed on to the caller.
        let mut out = unsafe { Out::unset(out_evictable, "out_evictable") }?;
        // SAFETY: passed on to the caller.
        let key = unsafe { args::nonempty_key(key, key_len) }?;
        out.write(self::tier(tier)?.is_key_evictable(key));
        Ok(())
    })
}

/// `(used, total)` bytes for the eviction watermark, with no round trip.
///
/// # Safety
///
/// `out_used_bytes` and `out_total_bytes` valid for a write.
///
/// Thread safety: any thread, also from a listener.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_tier_get_memory_usage(
    tier: *const cxlkv_tier,
    out_used_bytes: *mut u64,
    out_total_bytes: *mut u64,
) -> cxlkv_status {
    call("cxlkv_tier_get_memory_usage", || {
        // SAFETY: passed on to the caller.
        let mut used = unsafe { Out::unset(out_used_bytes, "out_used_bytes") }?;
        // SAFETY: passed on to the caller.
        let mut total = unsafe { Out::unset(out_total_bytes, "out_total_bytes") }?;
        let (u, t) = self::tier(tier)?.get_memory_usage();
        used.write(u);
        total.write(t);
        Ok(())
    })
}

/// The reference's `get_l1_memory_desc`: the shared pool has no single
/// registrable region, so `*out_present` is always false (engines use the
/// region map/unmap callbacks instead).
///
/// # Safety
///
/// `out_present` valid for a write.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_tier_get_l1_memory_desc(
    tier: *const cxlkv_tier,
    out_present: *mut bool,
) -> cxlkv_status {
    call("cxlkv_tier_get_l1_memory_desc", || {
        // SAFETY: passed on to the caller.
        let mut out = unsafe { Out::unset(out_present, "out_present") }?;
        out.write(self::tier(tier)?.get_l1_memory_desc().is_some());
        Ok(())
    })
}

/// The reference's `get_object_state`: membership lives in the directory,
/// so `*out_present` is always false (see `cxlkv_tier_inspect`).
///
/// # Safety
///
/// `key` valid for reads of `key_len` bytes; `out_present` for a write.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_tier_get_object_state(
    tier: *const cxlkv_tier,
    key: *const u8,
    key_len: usize,
    out_present: *mut bool,
) -> cxlkv_status {
    call("cxlkv_tier_get_object_state", || {
        // SAFETY: passed on to the caller.
        let mut out = unsafe { Out::unset(out_present, "out_present") }?;
        // SAFETY: passed on to the caller.
        let key = unsafe { args::nonempty_key(key, key_len) }?;
        out.write(self::tier(tier)?.get_object_state(key).is_some());
        Ok(())
    })
}

/// Whether the layout's allocators never refused a free (lock-free).
///
/// # Safety
///
/// `out_healthy` valid for a write.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_tier_memcheck(
    tier: *const cxlkv_tier,
    out_healthy: *mut bool,
) -> cxlkv_status {
    call("cxlkv_tier_memcheck", || {
        // SAFETY: passed on to the caller.
        let mut out = unsafe { Out::unset(out_healthy, "out_healthy") }?;
        out.write(self::tier(tier)?.memcheck());
        Ok(())
    })
}

/// `report_status`: the stock keys plus `backend`. Set `out->size` first.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_camel_case_types)]
pub struct cxlkv_tier_status {
    pub size: u32,
    /// 1 when memcheck passes.
    pub is_healthy: u32,
    /// `"cxlkv"` (static).
    pub backend: *const c_char,
    /// Staged reads + staged writes.
    pub total_object_count: u64,
    pub write_locked_count: u64,
    /// Read stagings with at least one hold.
    pub read_locked_count: u64,
    pub temporary_count: u64,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    /// used / total (0 when total is 0).
    pub memory_usage_ratio: f64,
    pub write_ttl_seconds: f64,
    pub read_ttl_seconds: f64,
}

const _: () = assert!(size_of::<cxlkv_tier_status>() == 16 + 9 * 8);

// SAFETY: repr(C), `size: u32` first, integers, floats and a raw pointer;
// no padding (asserted).
unsafe impl Versioned for cxlkv_tier_status {
    const SIZES: &'static [usize] = &[size_of::<cxlkv_tier_status>()];
}

/// Writes the tier's status into `*out`.
///
/// # Safety
///
/// `out` valid for reads of its size field and writes of `out->size` bytes.
///
/// Thread safety: any thread; not from a listener of this tier.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_tier_report_status(
    tier: *const cxlkv_tier,
    out: *mut cxlkv_tier_status,
) -> cxlkv_status {
    call("cxlkv_tier_report_status", || {
        let s = self::tier(tier)?.report_status()?;
        let v = cxlkv_tier_status {
            size: size_of::<cxlkv_tier_status>() as u32,
            is_healthy: u32::from(s.is_healthy),
            backend: c"cxlkv".as_ptr(),
            total_object_count: s.total_object_count,
            write_locked_count: s.write_locked_count,
            read_locked_count: s.read_locked_count,
            temporary_count: s.temporary_count,
            memory_used_bytes: s.memory_used_bytes,
            memory_total_bytes: s.memory_total_bytes,
            memory_usage_ratio: s.memory_usage_ratio,
            write_ttl_seconds: s.write_ttl_seconds,
            read_ttl_seconds: s.read_ttl_seconds,
        };
        // SAFETY: passed on to the caller.
        unsafe { args::write_versioned(out, &v, "out") }
    })
}

/// Where a key stands on a tier (diagnostics). Set `size` first.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
#[allow(non_camel_case_types)]
pub struct cxlkv_tier_key_stage {
    pub size: u32,
    /// 0: untracked; 1: write-staged; 2: read-staged.
    pub stage: u32,
    /// 1 for a private temporary.
    pub temporary: u32,
    /// Always 0.
    pub reserved: u32,
    /// Read-staged: local holds (0: an idle completed temporary).
    pub holds: u64,
    /// Read-staged: directory pins behind the holds.
    pub pinned: u64,
}

const _: () = assert!(size_of::<cxlkv_tier_key_stage>() == 32);

// SAFETY: repr(C), `size: u32` first, integers only, no padding (asserted).
unsafe impl Versioned for cxlkv_tier_key_stage {
    const SIZES: &'static [usize] = &[size_of::<cxlkv_tier_key_stage>()];
}

/// Where `key` stands on this tier (locked; diagnostics and tests).
///
/// # Safety
///
/// `key` valid for reads of `key_len` bytes; `out` as for
/// `cxlkv_tier_report_status`.
///
/// Thread safety: any thread; not from a listener of this tier.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_tier_inspect(
    tier: *const cxlkv_tier,
    key: *const u8,
    key_len: usize,
    out: *mut cxlkv_tier_key_stage,
) -> cxlkv_status {
    call("cxlkv_tier_inspect", || {
        // SAFETY: passed on to the caller.
        let key = unsafe { args::nonempty_key(key, key_len) }?;
        let (stage, temporary, holds, pinned) = match self::tier(tier)?.inspect(key)? {
            KeyStage::WriteStaged { temporary } => (1, temporary, 0, 0),
            KeyStage::ReadStaged {
                holds,
                pinned,
                temporary,
            } => (2, temporary, holds, pinned),
            _ => (0, false, 0, 0),
        };
        let v = cxlkv_tier_key_stage {
            size: size_of::<cxlkv_tier_key_stage>() as u32,
            stage,
            temporary: u32::from(temporary),
            reserved: 0,
            holds,
            pinned,
        };
        // SAFETY: passed on to the caller.
        unsafe { args::write_versioned(out, &v, "out") }
    })
}

/// The tier's counters. Set `size` first.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
#[allow(non_camel_case_types)]
pub struct cxlkv_tier_stats {
    pub size: u32,
    /// Always 0.
    pub reserved: u32,
    pub lookups: u64,
    pub unpin_round_trips: u64,
    pub pins_released: u64,
    pub pins_lost: u64,
    pub registers: u64,
    pub registers_unresolved: u64,
    pub exists: u64,
    pub deletes: u64,
    pub temporaries_reclaimed: u64,
    /// Entries reclaimed by the TTL sweeper.
    pub swept: u64,
}

const _: () = assert!(size_of::<cxlkv_tier_stats>() == 8 + 10 * 8);

// SAFETY: repr(C), `size: u32` first, integers only, no padding (asserted).
unsafe impl Versioned for cxlkv_tier_stats {
    const SIZES: &'static [usize] = &[size_of::<cxlkv_tier_stats>()];
}

/// Writes the tier's counters into `*out`.
///
/// # Safety
///
/// As `cxlkv_tier_report_status`.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_tier_query_stats(
    tier: *const cxlkv_tier,
    out: *mut cxlkv_tier_stats,
) -> cxlkv_status {
    call("cxlkv_tier_query_stats", || {
        let s = self::tier(tier)?.stats();
        let v = cxlkv_tier_stats {
            size: size_of::<cxlkv_tier_stats>() as u32,
            reserved: 0,
            lookups: s.lookups,
            unpin_round_trips: s.unpin_round_trips,
            pins_released: s.pins_released,
            pins_lost: s.pins_lost,
            registers: s.registers,
            registers_unresolved: s.registers_unresolved,
            exists: s.exists,
            deletes: s.deletes,
            temporaries_reclaimed: s.temporaries_reclaimed,
            swept: s.swept,
        };
        // SAFETY: passed on to the caller.
        unsafe { args::write_versioned(out, &v, "out") }
    })
}

/// Runs one TTL sweep now (the sweeper does this every
/// max(1 s, min(TTLs)/4)); how many write and read stagings it reclaimed.
///
/// # Safety
///
/// `out_writes` and `out_reads` valid for a write.
///
/// Thread safety: any thread; not from a listener of this tier.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_tier_sweep_now(
    tier: *const cxlkv_tier,
    out_writes: *mut u64,
    out_reads: *mut u64,
) -> cxlkv_status {
    call("cxlkv_tier_sweep_now", || {
        // SAFETY: passed on to the caller.
        let mut writes = unsafe { Out::unset(out_writes, "out_writes") }?;
        // SAFETY: passed on to the caller.
        let mut reads = unsafe { Out::unset(out_reads, "out_reads") }?;
        let r = self::tier(tier)?.sweep_now()?;
        writes.write(r.writes);
        reads.write(r.reads);
        Ok(())
    })
}

/// Checks the tier's invariants (I1–I4 and the tier's mirrors of its
/// staged keys; in a debug build of the library, I7 too):
/// `CXLKV_STATUS_TIER_INVARIANT`, with the broken one in the message, if
/// one does not hold.
///
/// Thread safety: any thread; not from a listener of this tier.
#[unsafe(no_mangle)]
pub extern "C" fn cxlkv_tier_check_invariants(tier: *const cxlkv_tier) -> cxlkv_status {
    call("cxlkv_tier_check_invariants", || {
        Ok(self::tier(tier)?.check_invariants()?)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tier_codes_keep_the_tiers_numbers() {
        for (code, c) in [
            (TierCode::Success, cxlkv_tier_code::CXLKV_TIER_SUCCESS),
            (
                TierCode::KeyNotExist,
                cxlkv_tier_code::CXLKV_TIER_KEY_NOT_EXIST,
            ),
            (
                TierCode::KeyNotReadable,
                cxlkv_tier_code::CXLKV_TIER_KEY_NOT_READABLE,
            ),
            (
                TierCode::KeyNotWritable,
                cxlkv_tier_code::CXLKV_TIER_KEY_NOT_WRITABLE,
            ),
            (
                TierCode::KeyInWrongState,
                cxlkv_tier_code::CXLKV_TIER_KEY_IN_WRONG_STATE,
            ),
            (
                TierCode::KeyIsLocked,
                cxlkv_tier_code::CXLKV_TIER_KEY_IS_LOCKED,
            ),
            (
                TierCode::OutOfMemory,
                cxlkv_tier_code::CXLKV_TIER_OUT_OF_MEMORY,
            ),
        ] {
            assert_eq!(tier_code(code), c);
            assert_eq!(code as u32, c as u32);
        }
    }
}
