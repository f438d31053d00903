//! Conversions between the directory's plain values and the wire messages:
//! archived request fields in, reply messages and error replies out.
//!
//! Everything here is a pure function; the handler (`handler.rs`) decides
//! what to call and where replies go.

use cxlkv_controlplane::directory::{
    self as dir, DeleteOutcome, DirectoryError, FreedPageNotice, RegisterOutcome, UnpinOutcome,
};
use cxlkv_controlplane::proto::{
    self, ArchivedLayout, ArchivedLocation, ErrorCode, ErrorReply, FreedPage, RegionDesc,
    ReplyMeta, Usage,
};
use cxlkv_dataplane::ids::{Generation, PageIndex, PoolId, RegionId};

pub(crate) fn layout(a: &ArchivedLayout) -> dir::Layout {
    dir::Layout {
        page_size_bytes: a.page_size_bytes.to_native(),
        fingerprint: a.fingerprint.to_native(),
    }
}

pub(crate) fn wire_layout(l: dir::Layout) -> proto::Layout {
    proto::Layout {
        page_size_bytes: l.page_size_bytes,
        fingerprint: l.fingerprint,
    }
}

pub(crate) fn location(a: &ArchivedLocation) -> dir::Location {
    dir::Location {
        region: RegionId(a.region.to_native()),
        page: PageIndex(a.page.to_native()),
        generation: Generation(a.generation.to_native()),
        len_bytes: a.len_bytes.to_native(),
    }
}

pub(crate) fn wire_location(l: &dir::Location) -> proto::Location {
    proto::Location {
        region: l.region.0,
        page: l.page.0,
        generation: l.generation.0,
        len_bytes: l.len_bytes,
    }
}

pub(crate) fn wire_desc(d: &dir::RegionDescriptor) -> RegionDesc {
    RegionDesc {
        region: d.region.0,
        pool: d.pool.0,
        offset_bytes: d.offset_bytes,
        len_bytes: d.len_bytes,
        page_size_bytes: d.page_size_bytes,
    }
}

/// The pool manager's handle as the directory keeps it (the owner label is
/// the directory's business, not the handle's).
pub(crate) fn dir_handle(h: &proto::RegionHandle) -> dir::RegionHandle {
    dir::RegionHandle {
        region: RegionId(h.region),
        pool: PoolId(h.pool),
        offset_bytes: h.offset_bytes,
        len_bytes: h.len_bytes,
        token: dir::RegionToken(h.token.0),
    }
}

/// What rides on every reply to an instance.
pub(crate) fn reply_meta(
    notices: &[FreedPageNotice],
    usage: &dir::Usage,
    quota_bytes: Option<u64>,
) -> ReplyMeta {
    ReplyMeta {
        notices: notices
            .iter()
            .map(|n| FreedPage {
                seq: n.seq,
                region: n.region.0,
                page: n.page.0,
                generation: n.generation.0,
            })
            .collect(),
        usage: Usage {
            instance_used_bytes: usage.used_bytes,
            instance_owned_bytes: usage.owned_bytes,
            instance_quota_bytes: quota_bytes.unwrap_or(0),
            pool_free_bytes: usage.pool_free_bytes,
        },
    }
}

/// A registration outcome on the wire; `None` for a rejection reason this
/// build cannot express (the whole request then fails with `Internal`).
pub(crate) fn register_outcome(o: &RegisterOutcome) -> Option<proto::RegisterOutcome> {
    use dir::RejectReason as D;
    use proto::RejectReason as W;
    Some(match o {
        RegisterOutcome::Inserted => proto::RegisterOutcome::Inserted,
        RegisterOutcome::Duplicate(l) => proto::RegisterOutcome::Duplicate(wire_location(l)),
        RegisterOutcome::Rejected(r) => proto::RegisterOutcome::Rejected(match r {
            D::NotOwner { .. } => W::NotOwner,
            D::WrongLayout { .. } => W::WrongLayout,
            D::PageOutOfRange { .. } => W::PageOutOfRange,
            D::BadLength { .. } => W::BadLength,
            D::PageInUse { .. } => W::PageInUse,
            D::StaleGeneration { .. } => W::StaleGeneration,
            _ => return None,
        }),
    })
}

pub(crate) fn unpin_outcome(o: &UnpinOutcome) -> proto::UnpinOutcome {
    match o {
        UnpinOutcome::Unpinned => proto::UnpinOutcome::Unpinned,
        UnpinOutcome::NotPinned => proto::UnpinOutcome::NotPinned,
    }
}

pub(crate) fn delete_outcome(o: &DeleteOutcome) -> proto::DeleteOutcome {
    match *o {
        DeleteOutcome::Deleted => proto::DeleteOutcome::Deleted,
        DeleteOutcome::Pinned { pins } => proto::DeleteOutcome::Pinned { pins },
        DeleteOutcome::Missing => proto::DeleteOutcome::Missing,
    }
}

/// The wire code and limit of a directory error (see `docs/protocol.md`,
/// error codes).
pub(crate) fn directory_error_code(e: &DirectoryError) -> (ErrorCode, u64) {
    use DirectoryError as D;
    use ErrorCode as C;
    let n = |x: usize| x as u64;
    match e {
        D::UnknownSession { .. } | D::SessionEnded { .. } => (C::SessionEnded, 0),
        // Not the caller's session: its own is fine.
        D::NoSuchTarget { .. } => (C::InvalidArgument, 0),
        D::TcpSecretRequired => (C::AuthenticationRequired, 0),
        D::InvalidInstanceId { max_bytes, .. } => (C::InvalidArgument, n(*max_bytes)),
        D::InstanceIdInUse { .. } => (C::InstanceInUse, 0),
        D::SecretMismatch { .. } => (C::AuthenticationFailed, 0),
        D::OwnershipNotProven { .. } => (C::OwnershipNotProven, 0),
        D::TooManySessions { max }
        | D::TooManyInstanceSessions { max, .. }
        | D::TooManyInstances { max } => (C::Busy, n(*max)),
        D::TooManyReattachRegions { max, .. } => (C::BatchTooLarge, n(*max)),
        D::DuplicateReattachRegion { .. } | D::InvalidNextSeq => (C::InvalidArgument, 0),
        D::BatchTooLarge { max, .. } => (C::BatchTooLarge, n(*max)),
        D::KeyLength {
            len_bytes,
            max_bytes,
            ..
        } if len_bytes > max_bytes => (C::KeyTooLong, n(*max_bytes)),
        D::KeyLength { max_bytes, .. } => (C::InvalidArgument, n(*max_bytes)),
        D::InvalidLayout { max_bytes, .. } => (C::InvalidArgument, *max_bytes),
        // A capacity limit of the directory, like `max_keys`: the request
        // is well formed, and the layouts in use are forgotten with their
        // last region.
        D::TooManyLayouts { max } => (C::OutOfSpace, n(*max)),
        D::InvalidPinCount { max, .. } => (C::InvalidArgument, u64::from(*max)),
        D::InvalidUnpinCount { .. } | D::MissingSequence { .. } | D::SequenceReused { .. } => {
            (C::InvalidArgument, 0)
        }
        D::NoticeAckAhead { highest_issued, .. } => (C::InvalidArgument, *highest_issued),
        D::SequenceOutOfRange { max, .. } => (C::InvalidArgument, *max),
        D::SequenceTooOld {
            oldest_accepted, ..
        } => (C::SequenceTooOld, *oldest_accepted),
        D::ReplyEvicted { .. } => (C::ReplyEvicted, 0),
        D::PinsHeldByOtherSession { .. } => (C::PinsHeldByOtherSession, 0),
        D::UnknownRegion { .. } => (C::UnknownRegion, 0),
        D::NotRegionOwner { .. } => (C::NotOwner, 0),
        D::RegionNotEmpty { keys, .. } => (C::RegionNotEmpty, u64::from(*keys)),
        D::InvalidRegionLength { max_bytes, .. } => (C::InvalidArgument, *max_bytes),
        D::QuotaExceeded { quota_bytes, .. } => (C::QuotaExceeded, *quota_bytes),
        D::TooManyRegions { max } => (C::QuotaExceeded, n(*max)),
        D::TooManyPendingRegionRequests { max } => (C::Busy, n(*max)),
        // The directory refused what the pool manager granted (a region
        // shorter than asked, or one already assigned): it knows no free
        // extent. A refusal by the pool manager itself reaches the client
        // with the manager's code and limit (`DirectoryHandler`).
        D::RegionAllocationFailed { .. } => (C::OutOfSpace, 0),
        D::InstanceGone => (C::InstanceGone, 0),
        D::PinLimit { max, .. } => (C::InvalidArgument, u64::from(*max)),
        D::SessionPinLimit { max } => (C::InvalidArgument, n(*max)),
        // Shared by every session, and gone as pins are released: a retry
        // may succeed.
        D::PinnedEntryLimit { max } => (C::Busy, n(*max)),
        D::NoticeBacklog { max, .. } => (C::Busy, n(*max)),
        D::KeyLimit { max } => (C::OutOfSpace, n(*max)),
        _ => (C::Internal, 0),
    }
}

pub(crate) fn directory_error(e: &DirectoryError) -> ErrorReply {
    let (code, limit) = directory_error_code(e);
    ErrorReply::new(code, e.to_string(), limit)
}

/// Compares a presented secret with the configured one in time independent
/// of where they differ (the length is not secret).
pub(crate) fn secret_matches(presented: &[u8], expected: &[u8]) -> bool {
    if presented.len() != expected.len() {
        return false;
    }
    let diff = presented
        .iter()
        .zip(expected)
        .fold(0u8, |acc, (a, b)| acc | (a ^ b));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rejection_reason_of_the_directory_has_a_wire_form() {
        use dir::RejectReason as D;
        let region = RegionId(1);
        for r in [
            D::NotOwner { region },
            D::WrongLayout { region },
            D::PageOutOfRange {
                page: PageIndex(9),
                pages: 4,
            },
            D::BadLength {
                len_bytes: 0,
                page_size_bytes: 4096,
            },
            D::PageInUse { page: PageIndex(1) },
            D::StaleGeneration {
                generation: Generation(1),
                newest_seen: Generation(2),
            },
        ] {
            assert!(
                register_outcome(&RegisterOutcome::Rejected(r)).is_some(),
                "{r:?}"
            );
        }
    }

    #[test]
    fn limits_travel_with_their_codes() {
        let (code, limit) = directory_error_code(&DirectoryError::KeyLength {
            index: 3,
            len_bytes: 600,
            max_bytes: 512,
        });
        assert_eq!((code, limit), (ErrorCode::KeyTooLong, 512));
        let (code, _) = directory_error_code(&DirectoryError::KeyLength {
            index: 0,
            len_bytes: 0,
            max_bytes: 512,
        });
        assert_eq!(code, ErrorCode::InvalidArgument);
        let (code, limit) = directory_error_code(&DirectoryError::SequenceTooOld {
            seq: 1,
            oldest_accepted: 70,
        });
        assert_eq!((code, limit), (ErrorCode::SequenceTooOld, 70));
        // A client's out-of-range sequence number is its error, not ours.
        let (code, limit) = directory_error_code(&DirectoryError::SequenceOutOfRange {
            field: "seq",
            value: u64::MAX,
            max: 1 << 62,
        });
        assert_eq!((code, limit), (ErrorCode::InvalidArgument, 1 << 62));
    }

    /// Found by a review of the directory: the layout limit,
    /// a capacity limit that frees up with the last region of a layout,
    /// went out as `invalid_argument`; the directory-wide pin limit is
    /// shared and temporary, so a client retries it.
    #[test]
    fn capacity_limits_go_out_as_capacity_codes_with_their_limit() {
        assert_eq!(
            directory_error_code(&DirectoryError::TooManyLayouts { max: 256 }),
            (ErrorCode::OutOfSpace, 256)
        );
        assert_eq!(
            directory_error_code(&DirectoryError::KeyLimit { max: 9 }),
            (ErrorCode::OutOfSpace, 9)
        );
        assert_eq!(
            directory_error_code(&DirectoryError::PinnedEntryLimit { max: 1 << 22 }),
            (ErrorCode::Busy, 1 << 22)
        );
    }

    #[test]
    fn secrets_compare_by_content_and_length() {
        assert!(secret_matches(b"abc", b"abc"));
        assert!(!secret_matches(b"abd", b"abc"));
        assert!(!secret_matches(b"ab", b"abc"));
        assert!(!secret_matches(b"", b"abc"));
    }
}
