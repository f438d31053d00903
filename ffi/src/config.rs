//! `cxlkv_config` and `cxlkv_layout_options`: the versioned structs C fills
//! to connect and to open a layout, and their translation into the client's
//! [`ClientConfig`] and [`LayoutOptions`].
//!
//! Callers initialise them with `cxlkv_config_init` /
//! `cxlkv_layout_options_init` (which fill in the library's defaults and
//! set `size`), then change the fields they care about. Every field holds
//! a plain value — no "0 means default" — so what the caller sees after
//! init is what is used. Unknown flag bits and enumeration values are
//! refused.

use std::ffi::{CStr, OsStr};
use std::ffi::{c_char, c_void};
use std::mem::size_of;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use cxlkv::client::{ClientConfig, LayoutOptions};
use cxlkv_dataplane::visibility::Visibility;

use crate::args::{self, Out, Versioned};
use crate::status::FfiError;

/// Map the regions of other instances at connect (the first 2048 the
/// directory lists, as `cxlkv_map_all_regions`), so that first reads of
/// them do not map.
pub const CXLKV_CONFIG_EAGER_MAP: u32 = 1 << 0;
/// Layouts do not take new regions when full: allocations fail with
/// `CXLKV_STATUS_OUT_OF_MEMORY` instead. Also a `cxlkv_layout_options` flag.
pub const CXLKV_CONFIG_NO_AUTO_EXPAND: u32 = 1 << 1;

const KNOWN_CONFIG_FLAGS: u32 = CXLKV_CONFIG_EAGER_MAP | CXLKV_CONFIG_NO_AUTO_EXPAND;
const KNOWN_LAYOUT_FLAGS: u32 = CXLKV_CONFIG_NO_AUTO_EXPAND;

/// Most entries of `cxlkv_config.pool_paths`.
pub const CXLKV_MAX_POOL_PATHS: usize = 64;
/// Longest `cxlkv_config.client_secret` accepted at the boundary (the
/// protocol's own limit, 256, is checked by the client with its message).
const MAX_SECRET_BYTES_AT_BOUNDARY: usize = 4096;

/// Which visibility mode the client applies to the pools.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum cxlkv_visibility {
    /// The mode the server announces for each pool.
    CXLKV_VISIBILITY_SERVER = 0,
    /// Fences only: correct on one host (or with hardware coherence).
    CXLKV_VISIBILITY_COHERENT = 1,
    /// Write back before publishing, invalidate before reading: always safe.
    CXLKV_VISIBILITY_FLUSH = 2,
}

/// What a region map/unmap callback is told.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_camel_case_types)]
pub struct cxlkv_map_info {
    /// The region's id (globally unique, never reused).
    pub region_id: u64,
    /// The region's offset in its pool.
    pub offset_bytes: u64,
    /// The first mapped byte: valid from `on_map` until `before_unmap`
    /// returns (e.g. for `cudaHostRegister` / `cudaHostUnregister`).
    pub base: *mut c_void,
    pub len_bytes: u64,
    /// True for a peer's region, mapped read-only (`PROT_READ`): a write
    /// into it faults. A device registration must say so (with CUDA,
    /// `cudaHostRegisterReadOnly`). False for the client's own regions.
    pub read_only: bool,
}

/// A region map or unmap callback. Runs on whichever thread maps or unmaps
/// (a caller's, or the client's maintenance thread), must return quickly,
/// must not call back into cxlkv, and must not unwind (no C++ exception may
/// leave it).
#[allow(non_camel_case_types)]
pub type cxlkv_map_fn =
    Option<unsafe extern "C" fn(user_data: *mut c_void, info: *const cxlkv_map_info)>;

/// Region map/unmap callbacks and their user data (passed back untouched).
/// Either callback may be NULL. `user_data` is used from any thread.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_camel_case_types)]
pub struct cxlkv_map_callbacks {
    /// Called once per region after it is mapped, before any view of it.
    pub on_map: cxlkv_map_fn,
    /// Called once per region before it is unmapped, after its last view.
    pub before_unmap: cxlkv_map_fn,
    pub user_data: *mut c_void,
}

/// Where a TCP client finds a pool locally, by the UUID in its header.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_camel_case_types)]
pub struct cxlkv_pool_path {
    pub uuid: [u8; 16],
    /// NUL-terminated path.
    pub path: *const c_char,
}

/// Everything `cxlkv_connect` needs. Initialise with `cxlkv_config_init`,
/// then set `socket_path` (or `tcp_addr`) and whatever else differs.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_camel_case_types)]
pub struct cxlkv_config {
    /// `sizeof(cxlkv_config)` as the caller's header declares it.
    pub size: u32,
    /// `CXLKV_CONFIG_*` bits.
    pub flags: u32,
    /// The server's Unix socket (NUL-terminated), or NULL with `tcp_addr`.
    pub socket_path: *const c_char,
    /// `"host:port"` of a TCP listener, or NULL with `socket_path`: an IP
    /// address (`"127.0.0.1:7411"`, `"[::1]:7411"`) or a host name
    /// (`"localhost:7411"`), resolved by `cxlkv_connect` to its first
    /// address (`CXLKV_STATUS_INVALID_ARGUMENT` if it does not resolve).
    pub tcp_addr: *const c_char,
    /// The TCP listener's pre-shared secret (NULL: none; at most 256 bytes):
    /// the contents of the server's `tcp_secret_file` without its one
    /// trailing newline, which the server ignores (read from the same
    /// file, drop it too, or the server answers
    /// `CXLKV_STATUS_SERVER_AUTHENTICATION_FAILED`). Not sent on a Unix
    /// socket.
    pub client_secret: *const u8,
    pub client_secret_len: usize,
    /// The instance's name (NULL or empty: the directory generates one).
    pub instance_id: *const c_char,
    /// Sent in the session's opening; the server logs it with the session
    /// (not shown in stats). NULL: `cxlkv-client-<pid>`.
    pub client_name: *const c_char,
    /// TCP only: local paths of pools, by UUID (at most
    /// `CXLKV_MAX_POOL_PATHS`).
    pub pool_paths: *const cxlkv_pool_path,
    pub pool_paths_len: usize,
    /// A `cxlkv_visibility`.
    pub visibility: u32,
    /// How long a released view's unpin may wait to be batched (≤ 1000;
    /// default 200).
    pub unpin_delay_us: u32,
    /// Attempts of one request after the first, on a timeout, a transient
    /// refusal or a broken connection (default 3).
    pub max_retries: u32,
    /// Most peer regions kept mapped; beyond it the least recently used one
    /// without a live view is unmapped (default 4096).
    pub max_peer_mappings: u32,
    /// Layout defaults: bytes of regions taken when a layout is opened.
    pub initial_reservation_bytes: u64,
    /// Layout defaults: bytes per region on expansion (0: max(64 MiB, one
    /// page)).
    pub region_size_bytes: u64,
    /// Client-side cap on region bytes (0: none).
    pub quota_bytes: u64,
    /// A region beyond a layout's initial reservation whose pages have all
    /// been free this long goes back to the pool (default 30000).
    pub idle_region_return_ms: u64,
    /// Deadline of one attempt of one request (≥ 1; default 5000). A
    /// request is attempted at most `1 + max_retries` times; a server that
    /// never answers fails the call with `CXLKV_STATUS_UNANSWERED` (or
    /// `DISCONNECTED`, once the connection is given up as broken), after
    /// the reconnects between attempts too (`reconnect_timeout_ms`).
    pub request_timeout_ms: u64,
    /// How long a call that finds the connection broken retries it (with
    /// backoff) before failing with `CXLKV_STATUS_DISCONNECTED` (default
    /// 30000), counting any wait for a reconnect another thread — the
    /// client's own heartbeat included — has under way (a call that waited
    /// it out makes one attempt of its own, then fails). While the server
    /// is gone, a call blocks about this long; a stopped server (accepting
    /// connections, answering nothing) adds its attempts' own deadlines.
    pub reconnect_timeout_ms: u64,
    /// The reconnect backoff's first pause (default 10).
    pub reconnect_backoff_min_ms: u64,
    /// The reconnect backoff's longest pause (default 1000).
    pub reconnect_backoff_max_ms: u64,
    /// Told of every region mapped and unmapped from connect on.
    pub map_callbacks: cxlkv_map_callbacks,
}

const _: () = assert!(size_of::<cxlkv_config>() == 176);

// SAFETY: repr(C); `size: u32` first; fields are integers, raw pointers and
// optional function pointers (any bit pattern valid); laid out without
// padding (176 bytes, asserted above).
unsafe impl Versioned for cxlkv_config {
    const SIZES: &'static [usize] = &[size_of::<cxlkv_config>()];
}

/// Options of one layout (`cxlkv_layout_open`). Initialise with
/// `cxlkv_layout_options_init`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_camel_case_types)]
pub struct cxlkv_layout_options {
    /// `sizeof(cxlkv_layout_options)` as the caller's header declares it.
    pub size: u32,
    /// `CXLKV_CONFIG_NO_AUTO_EXPAND` or 0.
    pub flags: u32,
    pub initial_reservation_bytes: u64,
    /// 0: max(64 MiB, one page).
    pub region_size_bytes: u64,
}

const _: () = assert!(size_of::<cxlkv_layout_options>() == 24);

// SAFETY: repr(C); `size: u32` first; integers only; no padding.
unsafe impl Versioned for cxlkv_layout_options {
    const SIZES: &'static [usize] = &[size_of::<cxlkv_layout_options>()];
}

fn defaults() -> cxlkv_config {
    let d = ClientConfig::unix("");
    cxlkv_config {
        size: size_of::<cxlkv_config>() as u32,
        flags: if d.layout.auto_expand {
            0
        } else {
            CXLKV_CONFIG_NO_AUTO_EXPAND
        },
        socket_path: std::ptr::null(),
        tcp_addr: std::ptr::null(),
        client_secret: std::ptr::null(),
        client_secret_len: 0,
        instance_id: std::ptr::null(),
        client_name: std::ptr::null(),
        pool_paths: std::ptr::null(),
        pool_paths_len: 0,
        visibility: cxlkv_visibility::CXLKV_VISIBILITY_SERVER as u32,
        unpin_delay_us: d.unpin_delay_us,
        max_retries: d.max_retries,
        max_peer_mappings: d.max_peer_mappings.try_into().unwrap_or(u32::MAX),
        initial_reservation_bytes: d.layout.initial_reservation_bytes,
        region_size_bytes: d.layout.region_size_bytes,
        quota_bytes: d.quota_bytes.unwrap_or(0),
        idle_region_return_ms: d.idle_region_return_ms,
        request_timeout_ms: d.request_timeout_ms,
        reconnect_timeout_ms: d.reconnect_timeout_ms,
        reconnect_backoff_min_ms: d.reconnect_backoff_min_ms,
        reconnect_backoff_max_ms: d.reconnect_backoff_max_ms,
        map_callbacks: cxlkv_map_callbacks {
            on_map: None,
            before_unmap: None,
            user_data: std::ptr::null_mut(),
        },
    }
}

fn layout_defaults() -> cxlkv_layout_options {
    let d = LayoutOptions::default();
    cxlkv_layout_options {
        size: size_of::<cxlkv_layout_options>() as u32,
        flags: if d.auto_expand {
            0
        } else {
            CXLKV_CONFIG_NO_AUTO_EXPAND
        },
        initial_reservation_bytes: d.initial_reservation_bytes,
        region_size_bytes: d.region_size_bytes,
    }
}

/// Writes the defaults of a `T` of the caller's `size` into `ptr`: the
/// fields both sides know get the library's defaults, the rest zero.
///
/// # Safety
///
/// `ptr` valid for writes of `size` bytes.
pub(crate) unsafe fn init_versioned<T: Versioned>(
    ptr: *mut T,
    size: u32,
    value: T,
    arg: &str,
) -> Result<(), FfiError> {
    let size = size as usize;
    let ours = size_of::<T>();
    if size > args::MAX_VERSIONED_BYTES || (size <= ours && !T::SIZES.contains(&size)) {
        return Err(FfiError::invalid(format!(
            "`size` is {size}; this library initialises sizes {:?} or larger ones (pass sizeof as your header declares it)",
            T::SIZES
        )));
    }
    // SAFETY: passed on to the caller (only the NULL and alignment checks
    // are used; the bytes are written below).
    let _checked = unsafe { Out::new(ptr, arg) }?;
    // SAFETY: `size` bytes are writable at `ptr` (contract); `value` has
    // `ours` readable bytes and no padding (Versioned).
    unsafe {
        std::ptr::write_bytes(ptr.cast::<u8>(), 0, size);
        std::ptr::copy_nonoverlapping(
            (&raw const value).cast::<u8>(),
            ptr.cast::<u8>(),
            size.min(ours),
        );
        ptr.cast::<u32>().write(size as u32);
    }
    Ok(())
}

/// Fills `config` with the library's defaults for a struct of `size` bytes
/// (pass `sizeof(cxlkv_config)`) and sets `config->size`. Fields this
/// library does not know (a newer header) are zeroed.
///
/// # Safety
///
/// `config` must be valid for writes of `size` bytes.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_config_init(
    config: *mut cxlkv_config,
    size: u32,
) -> crate::cxlkv_status {
    crate::boundary::call("cxlkv_config_init", || {
        // SAFETY: passed on to the caller.
        unsafe { init_versioned(config, size, defaults(), "config") }
    })
}

/// Fills `options` with the library's layout defaults for a struct of
/// `size` bytes (pass `sizeof(cxlkv_layout_options)`).
///
/// # Safety
///
/// `options` must be valid for writes of `size` bytes.
///
/// Thread safety: any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cxlkv_layout_options_init(
    options: *mut cxlkv_layout_options,
    size: u32,
) -> crate::cxlkv_status {
    crate::boundary::call("cxlkv_layout_options_init", || {
        // SAFETY: passed on to the caller.
        unsafe { init_versioned(options, size, layout_defaults(), "options") }
    })
}

fn check_flags(flags: u32, known: u32, arg: &str) -> Result<(), FfiError> {
    if flags & !known != 0 {
        return Err(FfiError::invalid(format!(
            "`{arg}` has unknown bits {:#x}",
            flags & !known
        )));
    }
    Ok(())
}

/// The client configuration `config` describes, and its map callbacks.
///
/// # Safety
///
/// `config` valid for reads of `config->size` bytes; its pointers as the
/// field docs say.
pub(crate) unsafe fn client_config(
    config: *const cxlkv_config,
) -> Result<(ClientConfig, cxlkv_map_callbacks), FfiError> {
    // SAFETY: passed on to the caller.
    let c = unsafe { args::read_versioned(config, defaults(), "config") }?;
    check_flags(c.flags, KNOWN_CONFIG_FLAGS, "config.flags")?;
    // SAFETY: NUL-terminated or NULL, by the field's contract.
    let socket = unsafe { c_path(c.socket_path) };
    // SAFETY: NUL-terminated or NULL, by the field's contract.
    let tcp = unsafe { args::opt_str(c.tcp_addr, "config.tcp_addr") }?;
    let mut cfg = match (socket, tcp) {
        (Some(path), None) => ClientConfig::unix(path),
        (None, Some(addr)) => ClientConfig::tcp(
            cxlkv::config::host_port(addr)
                .map_err(|e| FfiError::invalid(format!("`config.tcp_addr` {e}")))?,
        ),
        (None, None) => {
            return Err(FfiError::invalid(
                "set one of `config.socket_path` and `config.tcp_addr`",
            ));
        }
        (Some(_), Some(_)) => {
            return Err(FfiError::invalid(
                "`config.socket_path` and `config.tcp_addr` are both set; set one",
            ));
        }
    };
    if c.client_secret_len > MAX_SECRET_BYTES_AT_BOUNDARY {
        return Err(FfiError::invalid(format!(
            "`config.client_secret_len` is {}; secrets are at most 256 bytes",
            c.client_secret_len
        )));
    }
    if c.client_secret.is_null() && c.client_secret_len > 0 {
        return Err(FfiError::invalid(format!(
            "`config.client_secret` is NULL but `config.client_secret_len` is {}",
            c.client_secret_len
        )));
    }
    if !c.client_secret.is_null() {
        // SAFETY: `client_secret_len` readable bytes by the field contract.
        let secret =
            unsafe { args::slice(c.client_secret, c.client_secret_len, "config.client_secret") }?;
        cfg.client_secret = Some(secret.to_vec());
    }
    // SAFETY: NUL-terminated or NULL, by the field's contract.
    if let Some(id) = unsafe { args::opt_str(c.instance_id, "config.instance_id") }? {
        cfg.instance_id = id.to_owned();
    }
    // SAFETY: NUL-terminated or NULL, by the field's contract.
    if let Some(name) = unsafe { args::opt_str(c.client_name, "config.client_name") }? {
        cfg.client_name = name.to_owned();
    }
    if c.pool_paths_len > CXLKV_MAX_POOL_PATHS {
        return Err(FfiError::invalid(format!(
            "`config.pool_paths_len` is {}, at most {CXLKV_MAX_POOL_PATHS}",
            c.pool_paths_len
        )));
    }
    // SAFETY: `pool_paths_len` readable entries by the field contract.
    let pools = unsafe { args::slice(c.pool_paths, c.pool_paths_len, "config.pool_paths") }?;
    for (i, p) in pools.iter().enumerate() {
        // SAFETY: NUL-terminated by the field contract.
        let path = unsafe { c_path(p.path) }
            .ok_or_else(|| FfiError::invalid(format!("`config.pool_paths[{i}].path` is NULL")))?;
        cfg.pool_paths.push((p.uuid, path));
    }
    cfg.visibility = match c.visibility {
        v if v == cxlkv_visibility::CXLKV_VISIBILITY_SERVER as u32 => None,
        v if v == cxlkv_visibility::CXLKV_VISIBILITY_COHERENT as u32 => Some(Visibility::Coherent),
        v if v == cxlkv_visibility::CXLKV_VISIBILITY_FLUSH as u32 => Some(Visibility::Flush),
        v => {
            return Err(FfiError::invalid(format!(
                "`config.visibility` is {v}, not a cxlkv_visibility"
            )));
        }
    };
    cfg.eager_map = c.flags & CXLKV_CONFIG_EAGER_MAP != 0;
    cfg.layout = LayoutOptions {
        initial_reservation_bytes: c.initial_reservation_bytes,
        region_size_bytes: c.region_size_bytes,
        auto_expand: c.flags & CXLKV_CONFIG_NO_AUTO_EXPAND == 0,
    };
    cfg.quota_bytes = (c.quota_bytes != 0).then_some(c.quota_bytes);
    cfg.idle_region_return_ms = c.idle_region_return_ms;
    cfg.request_timeout_ms = c.request_timeout_ms;
    cfg.max_retries = c.max_retries;
    cfg.reconnect_timeout_ms = c.reconnect_timeout_ms;
    cfg.reconnect_backoff_min_ms = c.reconnect_backoff_min_ms;
    cfg.reconnect_backoff_max_ms = c.reconnect_backoff_max_ms;
    cfg.unpin_delay_us = c.unpin_delay_us;
    cfg.max_peer_mappings = c.max_peer_mappings as usize;
    cfg.validate()?;
    Ok((cfg, c.map_callbacks))
}

/// The layout options `options` describes.
///
/// # Safety
///
/// `options` valid for reads of `options->size` bytes.
pub(crate) unsafe fn layout_options(
    options: *const cxlkv_layout_options,
) -> Result<LayoutOptions, FfiError> {
    // SAFETY: passed on to the caller.
    let o = unsafe { args::read_versioned(options, layout_defaults(), "options") }?;
    check_flags(o.flags, KNOWN_LAYOUT_FLAGS, "options.flags")?;
    Ok(LayoutOptions {
        initial_reservation_bytes: o.initial_reservation_bytes,
        region_size_bytes: o.region_size_bytes,
        auto_expand: o.flags & CXLKV_CONFIG_NO_AUTO_EXPAND == 0,
    })
}

/// A path from a NUL-terminated string (any bytes: paths need not be UTF-8).
///
/// # Safety
///
/// If not NULL, `ptr` points at a NUL-terminated string.
unsafe fn c_path(ptr: *const c_char) -> Option<PathBuf> {
    if ptr.is_null() {
        return None;
    }
    // SAFETY: non-NULL and NUL-terminated by the caller's contract.
    let bytes = unsafe { CStr::from_ptr(ptr) }.to_bytes();
    Some(PathBuf::from(OsStr::from_bytes(bytes)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::cxlkv_status;

    fn init() -> cxlkv_config {
        let mut c = std::mem::MaybeUninit::<cxlkv_config>::uninit();
        // SAFETY: `c` has room for one cxlkv_config.
        let s = unsafe { cxlkv_config_init(c.as_mut_ptr(), size_of::<cxlkv_config>() as u32) };
        assert_eq!(s, cxlkv_status::CXLKV_STATUS_OK);
        // SAFETY: every byte was written by cxlkv_config_init.
        unsafe { c.assume_init() }
    }

    #[test]
    fn initialised_defaults_are_the_clients_defaults() {
        let mut c = init();
        c.socket_path = c"/tmp/x.sock".as_ptr();
        // SAFETY: `c` is a live, initialised config with valid strings.
        let (cfg, _) = unsafe { client_config(&c) }.unwrap();
        let d = ClientConfig::unix("/tmp/x.sock");
        assert_eq!(cfg.request_timeout_ms, d.request_timeout_ms);
        assert_eq!(cfg.max_retries, d.max_retries);
        assert_eq!(cfg.unpin_delay_us, d.unpin_delay_us);
        assert_eq!(cfg.layout, d.layout);
        assert_eq!(cfg.quota_bytes, None);
        assert_eq!(cfg.server, d.server);
    }

    #[test]
    fn the_defaults_the_header_states_are_cxlkv_config_init_s() {
        // The field comments of `cxlkv_config` say these numbers; a changed
        // default must change them too.
        let c = init();
        assert_eq!(c.unpin_delay_us, 200);
        assert_eq!(c.max_retries, 3);
        assert_eq!(c.max_peer_mappings, 4096);
        assert_eq!(c.idle_region_return_ms, 30_000);
        assert_eq!(c.request_timeout_ms, 5_000);
        assert_eq!(c.reconnect_timeout_ms, 30_000);
        assert_eq!(c.reconnect_backoff_min_ms, 10);
        assert_eq!(c.reconnect_backoff_max_ms, 1_000);
    }

    #[test]
    fn bad_fields_are_refused_with_their_names() {
        type Tweak = fn(&mut cxlkv_config);
        let cases: Vec<(&str, Tweak)> = vec![
            ("socket_path", |c| c.socket_path = std::ptr::null()),
            ("both set", |c| c.tcp_addr = c"127.0.0.1:1".as_ptr()),
            ("flags", |c| c.flags = 1 << 9),
            ("visibility", |c| c.visibility = 7),
            ("request_timeout_ms", |c| c.request_timeout_ms = 0),
            ("pool_paths_len", |c| c.pool_paths_len = 1000),
            ("client_secret_len", |c| c.client_secret_len = usize::MAX),
            ("client_secret` is NULL", |c| c.client_secret_len = 16),
            ("instance_id", |c| c.instance_id = c"\xff".as_ptr()),
        ];
        for (what, tweak) in cases {
            let mut c = init();
            c.socket_path = c"/tmp/x.sock".as_ptr();
            tweak(&mut c);
            // SAFETY: every pointer in `c` is NULL or a valid C string.
            let e = unsafe { client_config(&c) }.unwrap_err();
            assert!(e.message.contains(what), "{what}: {e}");
        }
    }

    #[test]
    fn tcp_addresses_are_parsed() {
        let mut c = init();
        c.tcp_addr = c"127.0.0.1:7070".as_ptr();
        // SAFETY: valid strings.
        let (cfg, _) = unsafe { client_config(&c) }.unwrap();
        assert!(matches!(cfg.server, cxlkv::client::ServerAddr::Tcp(a) if a.port() == 7070));
        c.tcp_addr = c"nowhere".as_ptr();
        // SAFETY: valid strings.
        assert!(unsafe { client_config(&c) }.is_err());
    }
}
