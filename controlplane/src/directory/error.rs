//! Errors: whole-request failures ([`DirectoryError`]) and per-entry
//! registration rejections ([`RejectReason`]).
//!
//! A request answered with a `DirectoryError` changed nothing beyond renewing
//! its session's lease, applying its notice acknowledgement and — when it
//! got as far as the reply cache — its `replies_received_below` (dropping the
//! cached replies the client says it has received); its sequence number
//! was not consumed: a retry is evaluated afresh. Each variant maps to one
//! wire error code.

use cxlkv_dataplane::ids::{Generation, PageIndex, RegionId};

use super::types::{InstanceId, OpKind, SessionId};

/// Why a whole request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DirectoryError {
    // --- sessions and instances -------------------------------------------
    #[error("unknown session {session}")]
    UnknownSession { session: SessionId },
    #[error("session {session} has ended; reattach to continue")]
    SessionEnded { session: SessionId },
    /// `EndSession` named a session that is not live (never was, or ended
    /// before): the caller's own session is fine.
    #[error("no live session {session} to end")]
    NoSuchTarget { session: SessionId },
    #[error(
        "TCP peer did not present the pre-shared client secret: give the client the contents of the server's tcp_secret_file (without its trailing newline)"
    )]
    TcpSecretRequired,
    #[error("invalid instance id ({len_bytes} bytes): 1..={max_bytes} printable ASCII bytes")]
    InvalidInstanceId { len_bytes: usize, max_bytes: usize },
    #[error(
        "instance {instance} is attached (or awaiting its owner's reattach); reattach with its secret"
    )]
    InstanceIdInUse { instance: InstanceId },
    #[error("wrong secret for instance {instance}")]
    SecretMismatch { instance: InstanceId },
    #[error(
        "instance {instance} has regions awaiting reattach; present at least one of their tokens"
    )]
    OwnershipNotProven { instance: InstanceId },
    #[error("session limit reached ({max})")]
    TooManySessions { max: usize },
    #[error("instance {instance} has the maximum number of sessions ({max})")]
    TooManyInstanceSessions { instance: InstanceId, max: usize },
    #[error("instance limit reached ({max})")]
    TooManyInstances { max: usize },
    #[error("reattach presents {count} regions, more than the limit of {max}")]
    TooManyReattachRegions { count: usize, max: usize },
    #[error("reattach names region {region} twice")]
    DuplicateReattachRegion { region: RegionId },
    #[error("next_seq must be at least 1")]
    InvalidNextSeq,

    // --- request shape ----------------------------------------------------
    #[error("batch of {len} entries exceeds the limit of {max}")]
    BatchTooLarge { len: usize, max: usize },
    #[error("key {index} is {len_bytes} bytes; keys are 1..={max_bytes} bytes")]
    KeyLength {
        index: usize,
        len_bytes: usize,
        max_bytes: usize,
    },
    #[error(
        "invalid layout: page size {page_size_bytes} bytes (a non-zero multiple of 4096, at most {max_bytes})"
    )]
    InvalidLayout {
        page_size_bytes: u64,
        max_bytes: u64,
    },
    #[error("layout limit reached ({max})")]
    TooManyLayouts { max: usize },
    #[error("pin count {pins} out of range 0..={max}")]
    InvalidPinCount { pins: u32, max: u32 },
    #[error("unpin entry {index} releases 0 pins")]
    InvalidUnpinCount { index: usize },
    #[error("{op} needs a sequence number")]
    MissingSequence { op: OpKind },
    #[error(
        "notice acknowledgement {ack} is ahead of the highest notice issued ({highest_issued})"
    )]
    NoticeAckAhead { ack: u64, highest_issued: u64 },

    // --- exactly-once -----------------------------------------------------
    #[error("sequence number {seq} is too old (oldest accepted: {oldest_accepted})")]
    SequenceTooOld { seq: u64, oldest_accepted: u64 },
    #[error("{field} = {value} is beyond the largest sequence number, {max}")]
    SequenceOutOfRange {
        field: &'static str,
        value: u64,
        max: u64,
    },
    #[error("sequence number {seq} was already used by a different request")]
    SequenceReused { seq: u64 },
    #[error(
        "sequence number {seq} was executed but its cached reply was dropped (reply cache byte limit)"
    )]
    ReplyEvicted { seq: u64 },
    #[error(
        "pinning lookup {seq} ran on session {original}; its pins belong to that session (look up again with a new sequence number)"
    )]
    PinsHeldByOtherSession { seq: u64, original: SessionId },

    // --- regions ----------------------------------------------------------
    #[error("unknown region {region}")]
    UnknownRegion { region: RegionId },
    #[error("region {region} is not owned by the calling instance")]
    NotRegionOwner { region: RegionId },
    #[error("region {region} still has {keys} registered keys")]
    RegionNotEmpty { region: RegionId, keys: u32 },
    #[error(
        "region length {len_bytes} bytes invalid for page size {page_size_bytes} (at least one page, at most {max_bytes})"
    )]
    InvalidRegionLength {
        len_bytes: u64,
        page_size_bytes: u64,
        max_bytes: u64,
    },
    #[error(
        "quota exceeded: {owned_bytes} bytes owned or pending + {requested_bytes} requested > quota {quota_bytes}"
    )]
    QuotaExceeded {
        quota_bytes: u64,
        owned_bytes: u64,
        requested_bytes: u64,
    },
    #[error("instance owns the maximum number of regions ({max})")]
    TooManyRegions { max: usize },
    #[error("{max} region requests already pending for this instance")]
    TooManyPendingRegionRequests { max: usize },
    #[error("the pool manager could not allocate a region: {reason}")]
    RegionAllocationFailed { reason: String },
    #[error("the instance went away before its region arrived")]
    InstanceGone,

    // --- capacity of the directory itself ---------------------------------
    #[error("key {index} already holds the maximum of {max} pins")]
    PinLimit { index: usize, max: u32 },
    #[error("session would hold pins on more than {max} distinct keys")]
    SessionPinLimit { max: usize },
    /// All sessions together would hold pins on more than `max`
    /// (session, key) pairs (`max_pinned_entries`): a temporary refusal,
    /// gone as pins are released.
    #[error(
        "the directory's sessions would hold pins on more than {max} (session, key) pairs; retry once pins are released"
    )]
    PinnedEntryLimit { max: usize },
    #[error(
        "instance {instance} has {pending} unacknowledged freed-page notices; this delete would exceed the limit of {max}"
    )]
    NoticeBacklog {
        instance: InstanceId,
        pending: usize,
        max: usize,
    },
    #[error("the directory holds the maximum of {max} keys")]
    KeyLimit { max: usize },
}

/// Why one entry of a `register` batch was not registered (the rest of the
/// batch is unaffected).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
pub enum RejectReason {
    #[error("region {region} is not owned by the calling instance")]
    NotOwner { region: RegionId },
    #[error("region {region} belongs to another layout")]
    WrongLayout { region: RegionId },
    #[error("page {page} is beyond the region's {pages} pages")]
    PageOutOfRange { page: PageIndex, pages: u32 },
    #[error("length {len_bytes} not in 1..={page_size_bytes}")]
    BadLength {
        len_bytes: u32,
        page_size_bytes: u64,
    },
    #[error("page {page} is registered under another key")]
    PageInUse { page: PageIndex },
    #[error(
        "generation {generation} is not newer than {newest_seen}, already registered for this page"
    )]
    StaleGeneration {
        generation: Generation,
        newest_seen: Generation,
    },
}
