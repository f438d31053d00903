//! Status codes: what every fallible entry point returns.
//!
//! One flat enumeration with explicit, stable numbers — a number is never
//! renumbered and never reused; new conditions get new numbers. Ranges:
//!
//! - `0`: success;
//! - `1..=99`: the call's own arguments and the library (bad pointer, bad
//!   handle, a limit, the client's own checks, the connection);
//! - `100..=199`: the server refused the request: `100 + ` the wire
//!   [`ErrorCode`] (itself stable, DESIGN §6), so the C number of a server
//!   code is known without a table; `100` itself is a server code this
//!   library does not know (a newer server: the message names the number);
//! - `200..=299`: the L1 tier's call-level errors (per-key results are
//!   `cxlkv_tier_result`s, not statuses).
//!
//! [`FfiError`] carries a status and the message that `cxlkv_last_error`
//! hands back; every error of the layers below converts into one, its
//! message stating the causes the error's own text leaves out
//! ([`ErrorChain`]: `"cannot open pool /dev/dax0.0: Permission denied (os
//! error 13)"`, not the bare first half).

use std::ffi::c_char;
use std::fmt;

use cxlkv::client::{ClientError, ErrorChain};
use cxlkv::tier::TierError;
use cxlkv_controlplane::proto::ErrorCode;

/// Status of a call. Numbers are stable, never reused. Ranges: 0 success;
/// 1-99 the call's arguments, the library and the connection; 100-199 the
/// server refused (100 + the wire error code; 100 itself: a code this
/// library does not know); 200-299 the L1 tier's call-level errors.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum cxlkv_status {
    /// Success.
    CXLKV_STATUS_OK = 0,
    /// A required pointer is NULL, a flag or enumeration value is unknown,
    /// a versioned struct has a size this library cannot read, or a string
    /// is not UTF-8.
    CXLKV_STATUS_INVALID_ARGUMENT = 1,
    /// A handle is NULL, already freed, of another type, garbage, or
    /// inherited across `fork` (handles are valid only in the process that
    /// made them).
    CXLKV_STATUS_BAD_HANDLE = 2,
    /// A bug inside the library was caught at the boundary (a Rust panic);
    /// the message says where. The handles involved stay usable.
    CXLKV_STATUS_PANIC = 3,
    /// An output buffer is too small; the needed size was written.
    CXLKV_STATUS_BUFFER_TOO_SMALL = 4,
    /// The process holds the maximum number of live handles of one type.
    CXLKV_STATUS_TOO_MANY_HANDLES = 5,
    /// The client configuration is invalid (the message names the field).
    CXLKV_STATUS_CONFIG = 10,
    /// A key is empty or longer than the limit (the message names it).
    CXLKV_STATUS_KEY_LENGTH = 11,
    /// A batch is longer than the limit.
    CXLKV_STATUS_BATCH_TOO_LARGE = 12,
    /// A page size is not a non-zero multiple of 4096 within the limit.
    CXLKV_STATUS_INVALID_PAGE_SIZE = 13,
    /// A chunk is empty or larger than the layout's page size.
    CXLKV_STATUS_CHUNK_LENGTH = 14,
    /// A lease was registered through another layout than its own.
    CXLKV_STATUS_FOREIGN_LEASE = 15,
    /// The client already uses the maximum number of layouts.
    CXLKV_STATUS_TOO_MANY_LAYOUTS = 16,
    /// No free page, and the layout could not grow (auto-expand off, or no
    /// region could be had).
    CXLKV_STATUS_OUT_OF_MEMORY = 20,
    /// The client-side quota would be exceeded.
    CXLKV_STATUS_QUOTA_EXCEEDED = 21,
    /// A pool could not be opened or does not match what the server
    /// announced.
    CXLKV_STATUS_POOL = 30,
    /// A region could not be mapped, or the client's region tables are full.
    CXLKV_STATUS_MAP = 31,
    /// The lease's region is no longer this instance's (the directory
    /// refused it when the client reattached): its page cannot be written.
    CXLKV_STATUS_REGION_REVOKED = 32,
    /// The server's reply was malformed or of an unexpected kind.
    CXLKV_STATUS_PROTOCOL = 40,
    /// No answer after every retry.
    CXLKV_STATUS_UNANSWERED = 41,
    /// The request may or may not have taken effect; a registration's pages
    /// stay reserved until the client resolves it in the background.
    CXLKV_STATUS_INDETERMINATE = 42,
    /// The server could not be reached at connect.
    CXLKV_STATUS_CONNECT = 43,
    /// The connection broke and could not be re-established in time.
    CXLKV_STATUS_DISCONNECTED = 44,
    /// Too many requests in flight; retry later.
    CXLKV_STATUS_BUSY = 45,
    /// The client was closed.
    CXLKV_STATUS_CLOSED = 46,
    /// An error this library has no better number for (the message says).
    CXLKV_STATUS_OTHER = 99,
    /// The server refused with a code this library does not know.
    CXLKV_STATUS_SERVER_UNKNOWN = 100,
    CXLKV_STATUS_SERVER_MALFORMED = 101,
    CXLKV_STATUS_SERVER_UNSUPPORTED_VERSION = 102,
    CXLKV_STATUS_SERVER_FRAME_TOO_LARGE = 103,
    CXLKV_STATUS_SERVER_KEY_TOO_LONG = 104,
    CXLKV_STATUS_SERVER_BATCH_TOO_LARGE = 105,
    CXLKV_STATUS_SERVER_UNKNOWN_KIND = 106,
    CXLKV_STATUS_SERVER_UNKNOWN_REGION = 107,
    CXLKV_STATUS_SERVER_NOT_OWNER = 108,
    CXLKV_STATUS_SERVER_BAD_TOKEN = 109,
    CXLKV_STATUS_SERVER_WRONG_LAYOUT = 110,
    CXLKV_STATUS_SERVER_QUOTA_EXCEEDED = 111,
    CXLKV_STATUS_SERVER_OUT_OF_SPACE = 112,
    CXLKV_STATUS_SERVER_AUTHENTICATION_REQUIRED = 113,
    CXLKV_STATUS_SERVER_AUTHENTICATION_FAILED = 114,
    CXLKV_STATUS_SERVER_SESSION_ENDED = 115,
    CXLKV_STATUS_SERVER_BUSY = 116,
    CXLKV_STATUS_SERVER_TIMEOUT = 117,
    CXLKV_STATUS_SERVER_SEQUENCE_TOO_OLD = 118,
    CXLKV_STATUS_SERVER_INVALID_ARGUMENT = 119,
    CXLKV_STATUS_SERVER_INTERNAL = 120,
    CXLKV_STATUS_SERVER_HELLO_REQUIRED = 121,
    CXLKV_STATUS_SERVER_INSTANCE_IN_USE = 122,
    CXLKV_STATUS_SERVER_INSTANCE_GONE = 123,
    CXLKV_STATUS_SERVER_REPLY_EVICTED = 124,
    CXLKV_STATUS_SERVER_PINS_HELD_BY_OTHER_SESSION = 125,
    CXLKV_STATUS_SERVER_REGION_NOT_EMPTY = 126,
    CXLKV_STATUS_SERVER_OWNERSHIP_NOT_PROVEN = 127,
    /// A key appears twice in one tier call.
    CXLKV_STATUS_TIER_DUPLICATE_KEY = 200,
    /// Per-key argument arrays of different lengths.
    CXLKV_STATUS_TIER_LENGTH_MISMATCH = 201,
    /// A write mode other than `CXLKV_TIER_WRITE_NEW` (keys are
    /// write-once).
    CXLKV_STATUS_TIER_UNSUPPORTED_MODE = 202,
    /// A listener or event callback called back into its own tier.
    CXLKV_STATUS_TIER_REENTRANT = 203,
    /// The tier was closed.
    CXLKV_STATUS_TIER_CLOSED = 204,
    /// A tier invariant does not hold (a bug; the message names it).
    CXLKV_STATUS_TIER_INVARIANT = 205,
}

use cxlkv_status as S;

/// Every status, in number order (for names and tests).
pub(crate) const ALL_STATUSES: &[cxlkv_status] = &[
    S::CXLKV_STATUS_OK,
    S::CXLKV_STATUS_INVALID_ARGUMENT,
    S::CXLKV_STATUS_BAD_HANDLE,
    S::CXLKV_STATUS_PANIC,
    S::CXLKV_STATUS_BUFFER_TOO_SMALL,
    S::CXLKV_STATUS_TOO_MANY_HANDLES,
    S::CXLKV_STATUS_CONFIG,
    S::CXLKV_STATUS_KEY_LENGTH,
    S::CXLKV_STATUS_BATCH_TOO_LARGE,
    S::CXLKV_STATUS_INVALID_PAGE_SIZE,
    S::CXLKV_STATUS_CHUNK_LENGTH,
    S::CXLKV_STATUS_FOREIGN_LEASE,
    S::CXLKV_STATUS_TOO_MANY_LAYOUTS,
    S::CXLKV_STATUS_OUT_OF_MEMORY,
    S::CXLKV_STATUS_QUOTA_EXCEEDED,
    S::CXLKV_STATUS_POOL,
    S::CXLKV_STATUS_MAP,
    S::CXLKV_STATUS_REGION_REVOKED,
    S::CXLKV_STATUS_PROTOCOL,
    S::CXLKV_STATUS_UNANSWERED,
    S::CXLKV_STATUS_INDETERMINATE,
    S::CXLKV_STATUS_CONNECT,
    S::CXLKV_STATUS_DISCONNECTED,
    S::CXLKV_STATUS_BUSY,
    S::CXLKV_STATUS_CLOSED,
    S::CXLKV_STATUS_OTHER,
    S::CXLKV_STATUS_SERVER_UNKNOWN,
    S::CXLKV_STATUS_SERVER_MALFORMED,
    S::CXLKV_STATUS_SERVER_UNSUPPORTED_VERSION,
    S::CXLKV_STATUS_SERVER_FRAME_TOO_LARGE,
    S::CXLKV_STATUS_SERVER_KEY_TOO_LONG,
    S::CXLKV_STATUS_SERVER_BATCH_TOO_LARGE,
    S::CXLKV_STATUS_SERVER_UNKNOWN_KIND,
    S::CXLKV_STATUS_SERVER_UNKNOWN_REGION,
    S::CXLKV_STATUS_SERVER_NOT_OWNER,
    S::CXLKV_STATUS_SERVER_BAD_TOKEN,
    S::CXLKV_STATUS_SERVER_WRONG_LAYOUT,
    S::CXLKV_STATUS_SERVER_QUOTA_EXCEEDED,
    S::CXLKV_STATUS_SERVER_OUT_OF_SPACE,
    S::CXLKV_STATUS_SERVER_AUTHENTICATION_REQUIRED,
    S::CXLKV_STATUS_SERVER_AUTHENTICATION_FAILED,
    S::CXLKV_STATUS_SERVER_SESSION_ENDED,
    S::CXLKV_STATUS_SERVER_BUSY,
    S::CXLKV_STATUS_SERVER_TIMEOUT,
    S::CXLKV_STATUS_SERVER_SEQUENCE_TOO_OLD,
    S::CXLKV_STATUS_SERVER_INVALID_ARGUMENT,
    S::CXLKV_STATUS_SERVER_INTERNAL,
    S::CXLKV_STATUS_SERVER_HELLO_REQUIRED,
    S::CXLKV_STATUS_SERVER_INSTANCE_IN_USE,
    S::CXLKV_STATUS_SERVER_INSTANCE_GONE,
    S::CXLKV_STATUS_SERVER_REPLY_EVICTED,
    S::CXLKV_STATUS_SERVER_PINS_HELD_BY_OTHER_SESSION,
    S::CXLKV_STATUS_SERVER_REGION_NOT_EMPTY,
    S::CXLKV_STATUS_SERVER_OWNERSHIP_NOT_PROVEN,
    S::CXLKV_STATUS_TIER_DUPLICATE_KEY,
    S::CXLKV_STATUS_TIER_LENGTH_MISMATCH,
    S::CXLKV_STATUS_TIER_UNSUPPORTED_MODE,
    S::CXLKV_STATUS_TIER_REENTRANT,
    S::CXLKV_STATUS_TIER_CLOSED,
    S::CXLKV_STATUS_TIER_INVARIANT,
];

impl cxlkv_status {
    /// The status for a server refusal with wire code `code`.
    pub(crate) fn from_server_code(code: u16) -> cxlkv_status {
        let Some(code) = ErrorCode::from_u16(code) else {
            return S::CXLKV_STATUS_SERVER_UNKNOWN;
        };
        let wanted = 100 + i32::from(code.as_u16());
        ALL_STATUSES
            .iter()
            .copied()
            .find(|s| *s as i32 == wanted)
            .unwrap_or(S::CXLKV_STATUS_SERVER_UNKNOWN)
    }

    /// A stable name: the enumerator without its `CXLKV_STATUS_` prefix,
    /// NUL-terminated for C.
    pub(crate) fn name_cstr(self) -> &'static [u8] {
        match self {
            S::CXLKV_STATUS_OK => b"OK\0",
            S::CXLKV_STATUS_INVALID_ARGUMENT => b"INVALID_ARGUMENT\0",
            S::CXLKV_STATUS_BAD_HANDLE => b"BAD_HANDLE\0",
            S::CXLKV_STATUS_PANIC => b"PANIC\0",
            S::CXLKV_STATUS_BUFFER_TOO_SMALL => b"BUFFER_TOO_SMALL\0",
            S::CXLKV_STATUS_TOO_MANY_HANDLES => b"TOO_MANY_HANDLES\0",
            S::CXLKV_STATUS_CONFIG => b"CONFIG\0",
            S::CXLKV_STATUS_KEY_LENGTH => b"KEY_LENGTH\0",
            S::CXLKV_STATUS_BATCH_TOO_LARGE => b"BATCH_TOO_LARGE\0",
            S::CXLKV_STATUS_INVALID_PAGE_SIZE => b"INVALID_PAGE_SIZE\0",
            S::CXLKV_STATUS_CHUNK_LENGTH => b"CHUNK_LENGTH\0",
            S::CXLKV_STATUS_FOREIGN_LEASE => b"FOREIGN_LEASE\0",
            S::CXLKV_STATUS_TOO_MANY_LAYOUTS => b"TOO_MANY_LAYOUTS\0",
            S::CXLKV_STATUS_OUT_OF_MEMORY => b"OUT_OF_MEMORY\0",
            S::CXLKV_STATUS_QUOTA_EXCEEDED => b"QUOTA_EXCEEDED\0",
            S::CXLKV_STATUS_POOL => b"POOL\0",
            S::CXLKV_STATUS_MAP => b"MAP\0",
            S::CXLKV_STATUS_REGION_REVOKED => b"REGION_REVOKED\0",
            S::CXLKV_STATUS_PROTOCOL => b"PROTOCOL\0",
            S::CXLKV_STATUS_UNANSWERED => b"UNANSWERED\0",
            S::CXLKV_STATUS_INDETERMINATE => b"INDETERMINATE\0",
            S::CXLKV_STATUS_CONNECT => b"CONNECT\0",
            S::CXLKV_STATUS_DISCONNECTED => b"DISCONNECTED\0",
            S::CXLKV_STATUS_BUSY => b"BUSY\0",
            S::CXLKV_STATUS_CLOSED => b"CLOSED\0",
            S::CXLKV_STATUS_OTHER => b"OTHER\0",
            S::CXLKV_STATUS_SERVER_UNKNOWN => b"SERVER_UNKNOWN\0",
            S::CXLKV_STATUS_SERVER_MALFORMED => b"SERVER_MALFORMED\0",
            S::CXLKV_STATUS_SERVER_UNSUPPORTED_VERSION => b"SERVER_UNSUPPORTED_VERSION\0",
            S::CXLKV_STATUS_SERVER_FRAME_TOO_LARGE => b"SERVER_FRAME_TOO_LARGE\0",
            S::CXLKV_STATUS_SERVER_KEY_TOO_LONG => b"SERVER_KEY_TOO_LONG\0",
            S::CXLKV_STATUS_SERVER_BATCH_TOO_LARGE => b"SERVER_BATCH_TOO_LARGE\0",
            S::CXLKV_STATUS_SERVER_UNKNOWN_KIND => b"SERVER_UNKNOWN_KIND\0",
            S::CXLKV_STATUS_SERVER_UNKNOWN_REGION => b"SERVER_UNKNOWN_REGION\0",
            S::CXLKV_STATUS_SERVER_NOT_OWNER => b"SERVER_NOT_OWNER\0",
            S::CXLKV_STATUS_SERVER_BAD_TOKEN => b"SERVER_BAD_TOKEN\0",
            S::CXLKV_STATUS_SERVER_WRONG_LAYOUT => b"SERVER_WRONG_LAYOUT\0",
            S::CXLKV_STATUS_SERVER_QUOTA_EXCEEDED => b"SERVER_QUOTA_EXCEEDED\0",
            S::CXLKV_STATUS_SERVER_OUT_OF_SPACE => b"SERVER_OUT_OF_SPACE\0",
            S::CXLKV_STATUS_SERVER_AUTHENTICATION_REQUIRED => b"SERVER_AUTHENTICATION_REQUIRED\0",
            S::CXLKV_STATUS_SERVER_AUTHENTICATION_FAILED => b"SERVER_AUTHENTICATION_FAILED\0",
            S::CXLKV_STATUS_SERVER_SESSION_ENDED => b"SERVER_SESSION_ENDED\0",
            S::CXLKV_STATUS_SERVER_BUSY => b"SERVER_BUSY\0",
            S::CXLKV_STATUS_SERVER_TIMEOUT => b"SERVER_TIMEOUT\0",
            S::CXLKV_STATUS_SERVER_SEQUENCE_TOO_OLD => b"SERVER_SEQUENCE_TOO_OLD\0",
            S::CXLKV_STATUS_SERVER_INVALID_ARGUMENT => b"SERVER_INVALID_ARGUMENT\0",
            S::CXLKV_STATUS_SERVER_INTERNAL => b"SERVER_INTERNAL\0",
            S::CXLKV_STATUS_SERVER_HELLO_REQUIRED => b"SERVER_HELLO_REQUIRED\0",
            S::CXLKV_STATUS_SERVER_INSTANCE_IN_USE => b"SERVER_INSTANCE_IN_USE\0",
            S::CXLKV_STATUS_SERVER_INSTANCE_GONE => b"SERVER_INSTANCE_GONE\0",
            S::CXLKV_STATUS_SERVER_REPLY_EVICTED => b"SERVER_REPLY_EVICTED\0",
            S::CXLKV_STATUS_SERVER_PINS_HELD_BY_OTHER_SESSION => {
                b"SERVER_PINS_HELD_BY_OTHER_SESSION\0"
            }
            S::CXLKV_STATUS_SERVER_REGION_NOT_EMPTY => b"SERVER_REGION_NOT_EMPTY\0",
            S::CXLKV_STATUS_SERVER_OWNERSHIP_NOT_PROVEN => b"SERVER_OWNERSHIP_NOT_PROVEN\0",
            S::CXLKV_STATUS_TIER_DUPLICATE_KEY => b"TIER_DUPLICATE_KEY\0",
            S::CXLKV_STATUS_TIER_LENGTH_MISMATCH => b"TIER_LENGTH_MISMATCH\0",
            S::CXLKV_STATUS_TIER_UNSUPPORTED_MODE => b"TIER_UNSUPPORTED_MODE\0",
            S::CXLKV_STATUS_TIER_REENTRANT => b"TIER_REENTRANT\0",
            S::CXLKV_STATUS_TIER_CLOSED => b"TIER_CLOSED\0",
            S::CXLKV_STATUS_TIER_INVARIANT => b"TIER_INVARIANT\0",
        }
    }
}

/// The stable name of `status` (e.g. `"BAD_HANDLE"`), or `"UNKNOWN"` for a
/// number this library does not define. The string is static.
///
/// Thread safety: any thread; does not touch `cxlkv_last_error`.
#[unsafe(no_mangle)]
pub extern "C" fn cxlkv_status_name(status: i32) -> *const c_char {
    let name: &'static [u8] = ALL_STATUSES
        .iter()
        .find(|s| **s as i32 == status)
        .map_or(b"UNKNOWN\0", |s| s.name_cstr());
    name.as_ptr().cast()
}

/// An error crossing the boundary: the status returned and the message
/// left for `cxlkv_last_error`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FfiError {
    pub status: cxlkv_status,
    pub message: String,
}

impl FfiError {
    pub fn new(status: cxlkv_status, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(S::CXLKV_STATUS_INVALID_ARGUMENT, message)
    }

    /// A required pointer argument was NULL.
    pub fn null(argument: &str) -> Self {
        Self::invalid(format!("`{argument}` is NULL"))
    }
}

impl fmt::Display for FfiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<ClientError> for FfiError {
    fn from(e: ClientError) -> Self {
        Self::new(client_status(&e), e.with_causes().to_string())
    }
}

impl From<TierError> for FfiError {
    fn from(e: TierError) -> Self {
        let status = match &e {
            TierError::DuplicateKey { .. } => S::CXLKV_STATUS_TIER_DUPLICATE_KEY,
            TierError::LengthMismatch { .. } => S::CXLKV_STATUS_TIER_LENGTH_MISMATCH,
            TierError::KeyLength { .. } => S::CXLKV_STATUS_KEY_LENGTH,
            TierError::BatchTooLarge { .. } => S::CXLKV_STATUS_BATCH_TOO_LARGE,
            TierError::UnsupportedMode { .. } => S::CXLKV_STATUS_TIER_UNSUPPORTED_MODE,
            TierError::ChunkLength { .. } => S::CXLKV_STATUS_CHUNK_LENGTH,
            TierError::Config { .. } => S::CXLKV_STATUS_CONFIG,
            TierError::Reentrant { .. } => S::CXLKV_STATUS_TIER_REENTRANT,
            TierError::Closed { .. } => S::CXLKV_STATUS_TIER_CLOSED,
            TierError::ClientClosed { .. } => S::CXLKV_STATUS_CLOSED,
            TierError::ClientFailed { .. } => S::CXLKV_STATUS_DISCONNECTED,
            TierError::Invariant(_) => S::CXLKV_STATUS_TIER_INVARIANT,
            _ => S::CXLKV_STATUS_OTHER,
        };
        Self::new(status, ErrorChain(&e).to_string())
    }
}

/// The status naming a client error.
pub(crate) fn client_status(e: &ClientError) -> cxlkv_status {
    match e {
        ClientError::Config { .. } => S::CXLKV_STATUS_CONFIG,
        ClientError::KeyLength { .. } => S::CXLKV_STATUS_KEY_LENGTH,
        ClientError::BatchTooLarge { .. } => S::CXLKV_STATUS_BATCH_TOO_LARGE,
        ClientError::InvalidPageSize { .. } => S::CXLKV_STATUS_INVALID_PAGE_SIZE,
        ClientError::ChunkLength { .. } => S::CXLKV_STATUS_CHUNK_LENGTH,
        ClientError::ForeignLease { .. } => S::CXLKV_STATUS_FOREIGN_LEASE,
        ClientError::TooManyLayouts { .. } => S::CXLKV_STATUS_TOO_MANY_LAYOUTS,
        ClientError::OutOfMemory { .. } => S::CXLKV_STATUS_OUT_OF_MEMORY,
        ClientError::QuotaExceeded { .. } => S::CXLKV_STATUS_QUOTA_EXCEEDED,
        ClientError::PoolDescriptors { .. }
        | ClientError::Pool { .. }
        | ClientError::UnknownPool { .. }
        | ClientError::Backing(_) => S::CXLKV_STATUS_POOL,
        ClientError::PageSizeMismatch { .. }
        | ClientError::Map(_)
        | ClientError::Allocator(_)
        | ClientError::RegionTableFull { .. } => S::CXLKV_STATUS_MAP,
        ClientError::RegionRevoked { .. } => S::CXLKV_STATUS_REGION_REVOKED,
        ClientError::Server { code, .. } => cxlkv_status::from_server_code(*code),
        ClientError::BadReply { .. } | ClientError::UnexpectedReply { .. } => {
            S::CXLKV_STATUS_PROTOCOL
        }
        ClientError::Unanswered { .. } => S::CXLKV_STATUS_UNANSWERED,
        ClientError::Indeterminate { .. } => S::CXLKV_STATUS_INDETERMINATE,
        ClientError::Connect(_) => S::CXLKV_STATUS_CONNECT,
        ClientError::ReconnectFailed { .. } => S::CXLKV_STATUS_DISCONNECTED,
        ClientError::TooManyInFlight { .. } => S::CXLKV_STATUS_BUSY,
        ClientError::Closed => S::CXLKV_STATUS_CLOSED,
        ClientError::Forked { .. } => S::CXLKV_STATUS_BAD_HANDLE,
        _ => S::CXLKV_STATUS_OTHER,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_listed_in_number_order_without_repeats() {
        for pair in ALL_STATUSES.windows(2) {
            assert!((pair[0] as i32) < (pair[1] as i32), "{pair:?}");
        }
    }

    /// A data-plane error keeps its `io::Error` as its source only; the
    /// message `cxlkv_last_error` returns used to stop at "cannot open pool
    /// /dev/dax0.0", without the `EACCES` that says why.
    #[test]
    fn a_pool_error_message_names_its_os_cause() {
        use cxlkv_dataplane::backing::BackingError;
        use cxlkv_dataplane::backing::Extent;
        use cxlkv_dataplane::ids::RegionId;
        use cxlkv_dataplane::map::MapError;
        use std::io;

        // EACCES, "Permission denied" on Linux.
        let eacces = || io::Error::from_raw_os_error(13);
        let e = FfiError::from(ClientError::Backing(BackingError::Open {
            path: "/dev/dax0.0".into(),
            source: eacces(),
        }));
        assert_eq!(e.status, S::CXLKV_STATUS_POOL);
        assert_eq!(
            e.message,
            format!("cannot open pool /dev/dax0.0: {}", eacces())
        );
        assert!(e.message.contains("Permission denied"), "{e}");

        let e = FfiError::from(ClientError::Map(MapError::Mmap {
            region: RegionId(7),
            extent: Extent::new(0, 2 << 20),
            path: "/dev/dax0.0".into(),
            source: io::Error::from_raw_os_error(12),
        }));
        assert_eq!(e.status, S::CXLKV_STATUS_MAP);
        assert!(
            e.message.contains("region r7")
                && e.message
                    .ends_with(&io::Error::from_raw_os_error(12).to_string()),
            "{e}"
        );
    }

    /// A cause the message already states is not appended again.
    #[test]
    fn a_cause_the_message_states_is_not_repeated() {
        let e = ClientError::Connect(cxlkv_controlplane::transport::ClientError::Connect {
            endpoint: "unix:/run/cxlkv/cxlkv.sock".into(),
            source: std::io::Error::from_raw_os_error(111),
        });
        let text = e.to_string();
        let e = FfiError::from(e);
        assert_eq!(e.message, text);
        assert_eq!(e.message.matches("(os error 111)").count(), 1, "{e}");
    }

    #[test]
    fn a_tier_of_a_closed_client_answers_closed_as_its_layouts_do() {
        let e = FfiError::from(TierError::ClientClosed { op: "delete" });
        assert_eq!(e.status, S::CXLKV_STATUS_CLOSED);
        let e = FfiError::from(TierError::Closed { op: "delete" });
        assert_eq!(e.status, S::CXLKV_STATUS_TIER_CLOSED);
        // One that cannot be resumed answers as its layouts do too.
        let e = FfiError::from(TierError::ClientFailed {
            op: "delete",
            reason: "ownership not proven".into(),
        });
        assert_eq!(e.status, S::CXLKV_STATUS_DISCONNECTED);
        assert!(e.message.contains("ownership not proven"), "{}", e.message);
    }

    #[test]
    fn a_lease_in_a_revoked_region_has_a_status_of_its_own() {
        let e = ClientError::RegionRevoked {
            region: cxlkv_dataplane::ids::RegionId(7),
        };
        assert_eq!(client_status(&e), S::CXLKV_STATUS_REGION_REVOKED);
    }

    #[test]
    fn every_server_code_maps_to_one_hundred_plus_its_number() {
        for code in ErrorCode::ALL {
            let status = cxlkv_status::from_server_code(code.as_u16());
            assert_eq!(status as i32, 100 + i32::from(code.as_u16()), "{code:?}");
        }
        assert_eq!(
            cxlkv_status::from_server_code(9999),
            S::CXLKV_STATUS_SERVER_UNKNOWN
        );
    }

    #[test]
    fn every_status_has_a_name_matching_its_enumerator() {
        for s in ALL_STATUSES {
            let name = s.name_cstr();
            assert_eq!(name.last(), Some(&0));
            let text = std::str::from_utf8(&name[..name.len() - 1]).unwrap();
            assert_eq!(format!("{s:?}"), format!("CXLKV_STATUS_{text}"));
        }
        // SAFETY: the returned pointer is a static NUL-terminated string.
        let unknown = unsafe { std::ffi::CStr::from_ptr(cxlkv_status_name(-7)) };
        assert_eq!(unknown.to_str().unwrap(), "UNKNOWN");
    }

    #[test]
    fn server_code_names_follow_the_wire_names() {
        for code in ErrorCode::ALL {
            let status = cxlkv_status::from_server_code(code.as_u16());
            let name = status.name_cstr();
            let text = std::str::from_utf8(&name[..name.len() - 1]).unwrap();
            assert_eq!(text, format!("SERVER_{}", code.name().to_uppercase()));
        }
    }
}
