//! The protocol's own checks, run on every archived message after rkyv's
//! structural validation: limits (key length, batch length, string length,
//! pins), consistency between fields (parallel lists, bitmap words), and the
//! sequence-number rule (mutating requests carry a non-zero `seq`, read-only
//! ones `seq` 0). A message that passes can be used without further checks
//! on these points; semantic checks that need state (does the region exist,
//! is the token right) belong to the directory and the pool manager.

use rkyv::string::ArchivedString;
use rkyv::vec::ArchivedVec;

use super::codec::ArchivedRequest;
use super::common::*;
use super::directory::*;
use super::error::{ArchivedErrorReply, ProtoError};
use super::pool::*;
use super::stats::*;
use super::*;

/// Protocol checks on an archived message, after rkyv's checked access.
pub trait Validate {
    /// `kind` is the message's kind, for error reports.
    fn validate(&self, kind: Kind) -> Result<(), ProtoError>;
}

fn check_len(
    kind: Kind,
    field: &'static str,
    len: usize,
    limit: &'static str,
    max: usize,
) -> Result<(), ProtoError> {
    if len > max {
        return Err(ProtoError::BatchTooLarge {
            kind,
            field,
            len,
            limit,
            max,
        });
    }
    Ok(())
}

fn check_bytes(
    kind: Kind,
    field: &'static str,
    len_bytes: usize,
    limit: &'static str,
    max: usize,
) -> Result<(), ProtoError> {
    if len_bytes > max {
        return Err(ProtoError::FieldTooLong {
            kind,
            field,
            len_bytes,
            limit,
            max,
        });
    }
    Ok(())
}

fn check_name(kind: Kind, field: &'static str, s: &ArchivedString) -> Result<(), ProtoError> {
    check_bytes(kind, field, s.len(), "MAX_NAME_BYTES", MAX_NAME_BYTES)
}

fn check_secret(
    kind: Kind,
    field: &'static str,
    secret: &rkyv::option::ArchivedOption<ArchivedVec<u8>>,
) -> Result<(), ProtoError> {
    match secret.as_ref() {
        Some(s) => check_bytes(kind, field, s.len(), "MAX_SECRET_BYTES", MAX_SECRET_BYTES),
        None => Ok(()),
    }
}

fn check_keys(kind: Kind, keys: &ArchivedVec<ArchivedVec<u8>>) -> Result<(), ProtoError> {
    check_len(kind, "keys", keys.len(), "MAX_BATCH", MAX_BATCH)?;
    for (index, key) in keys.iter().enumerate() {
        check_key(kind, index, key)?;
    }
    Ok(())
}

fn check_key(kind: Kind, index: usize, key: &ArchivedVec<u8>) -> Result<(), ProtoError> {
    if key.len() > MAX_KEY_BYTES {
        return Err(ProtoError::KeyTooLong {
            kind,
            index,
            len_bytes: key.len(),
            max: MAX_KEY_BYTES,
        });
    }
    Ok(())
}

fn invalid(
    kind: Kind,
    field: &'static str,
    value: u64,
    reason: &'static str,
    limit: u64,
) -> ProtoError {
    ProtoError::InvalidValue {
        kind,
        field,
        value,
        reason,
        limit,
    }
}

fn check_layout(kind: Kind, layout: &ArchivedLayout) -> Result<(), ProtoError> {
    let page = layout.page_size_bytes.to_native();
    if page == 0 || !page.is_multiple_of(PAGE_QUANTUM_BYTES) {
        return Err(invalid(
            kind,
            "layout.page_size_bytes",
            page,
            "must be a non-zero multiple of PAGE_QUANTUM_BYTES",
            PAGE_QUANTUM_BYTES,
        ));
    }
    if page > MAX_PAGE_BYTES {
        return Err(invalid(
            kind,
            "layout.page_size_bytes",
            page,
            "over MAX_PAGE_BYTES",
            MAX_PAGE_BYTES,
        ));
    }
    Ok(())
}

fn check_versions(kind: Kind, min: u16, max: u16) -> Result<(), ProtoError> {
    if min == 0 || min > max {
        return Err(invalid(
            kind,
            "protocol_min",
            u64::from(min),
            "must be non-zero and at most protocol_max",
            u64::from(max),
        ));
    }
    Ok(())
}

/// The sequence-number rule (with `replies_received_below ≤ seq`, and 0 on
/// read-only requests), and `notice_ack` and `replies_received_below` 0 on
/// pool-manager requests.
fn check_request<R: ArchivedRequest>(kind: Kind, request: &R) -> Result<(), ProtoError> {
    let meta = request.meta();
    match (request.is_mutating(), meta.seq) {
        (true, 0) => return Err(ProtoError::SeqRequired { kind }),
        (false, seq) if seq != 0 => return Err(ProtoError::SeqNotAllowed { kind, seq }),
        _ => {}
    }
    let pool = kind.service() == Some(Service::PoolManager);
    if meta.replies_received_below > meta.seq || (pool && meta.replies_received_below != 0) {
        return Err(invalid(
            kind,
            "meta.replies_received_below",
            meta.replies_received_below,
            "at most seq (0 on read-only and pool-manager requests)",
            if pool { 0 } else { meta.seq },
        ));
    }
    if pool && meta.notice_ack != 0 {
        return Err(invalid(
            kind,
            "meta.notice_ack",
            meta.notice_ack,
            "pool-manager requests carry notice_ack 0",
            0,
        ));
    }
    Ok(())
}

fn check_reply_meta(kind: Kind, meta: &ArchivedReplyMeta) -> Result<(), ProtoError> {
    check_len(
        kind,
        "meta.notices",
        meta.notices.len(),
        "MAX_NOTICES_PER_REPLY",
        MAX_NOTICES_PER_REPLY,
    )
}

fn check_pools(
    kind: Kind,
    pools: &ArchivedVec<ArchivedPoolInfo>,
    fds_passed: u32,
) -> Result<(), ProtoError> {
    check_len(kind, "pools", pools.len(), "MAX_POOLS", MAX_POOLS)?;
    for pool in pools.iter() {
        check_bytes(
            kind,
            "pools.path",
            pool.path.len(),
            "MAX_PATH_BYTES",
            MAX_PATH_BYTES,
        )?;
    }
    if fds_passed != 0 && fds_passed as usize != pools.len() {
        return Err(invalid(
            kind,
            "fds_passed",
            u64::from(fds_passed),
            "must be 0 or one per pool",
            pools.len() as u64,
        ));
    }
    Ok(())
}

fn check_owner(kind: Kind, owner: &ArchivedOwnerLabel) -> Result<(), ProtoError> {
    check_name(kind, "owner.directory_id", &owner.directory_id)?;
    check_name(kind, "owner.instance_id", &owner.instance_id)
}

fn check_handles(
    kind: Kind,
    handles: &ArchivedVec<ArchivedRegionHandle>,
    limit: &'static str,
    max: usize,
) -> Result<(), ProtoError> {
    check_len(kind, "handles", handles.len(), limit, max)?;
    handles.iter().try_for_each(|h| check_owner(kind, &h.owner))
}

impl Validate for ArchivedHello {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_request(kind, self)?;
        check_versions(
            kind,
            self.protocol_min.to_native(),
            self.protocol_max.to_native(),
        )?;
        check_name(kind, "instance_id", &self.instance_id)?;
        check_name(kind, "client_name", &self.client_name)?;
        check_secret(kind, "client_secret", &self.client_secret)
    }
}

impl Validate for ArchivedWelcome {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_reply_meta(kind, &self.meta)?;
        check_name(kind, "instance_id", &self.instance_id)?;
        check_name(kind, "directory_id", &self.directory_id)?;
        check_pools(kind, &self.pools, self.fds_passed.to_native())
    }
}

impl Validate for ArchivedReattach {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_request(kind, self)?;
        check_versions(
            kind,
            self.protocol_min.to_native(),
            self.protocol_max.to_native(),
        )?;
        check_name(kind, "instance_id", &self.instance_id)?;
        check_name(kind, "client_name", &self.client_name)?;
        check_secret(kind, "client_secret", &self.client_secret)?;
        let next_seq = self.next_seq.to_native();
        if next_seq == 0 {
            return Err(invalid(kind, "next_seq", 0, "must be at least 1", 1));
        }
        check_len(
            kind,
            "regions",
            self.regions.len(),
            "MAX_REATTACH_REGIONS",
            MAX_REATTACH_REGIONS,
        )?;
        self.regions
            .iter()
            .try_for_each(|r| check_layout(kind, &r.layout))
    }
}

impl Validate for ArchivedReattached {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        self.welcome.validate(kind)?;
        let answered = self.accepted.len() + self.refused.len();
        check_len(
            kind,
            "accepted + refused",
            answered,
            "MAX_REATTACH_REGIONS",
            MAX_REATTACH_REGIONS,
        )
    }
}

impl Validate for ArchivedHeartbeat {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_request(kind, self)
    }
}

impl Validate for ArchivedHeartbeatReply {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_reply_meta(kind, &self.meta)
    }
}

impl Validate for ArchivedRequestRegion {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_request(kind, self)?;
        check_layout(kind, &self.layout)
    }
}

impl Validate for ArchivedRegionGranted {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_reply_meta(kind, &self.meta)?;
        check_layout(kind, &self.layout)
    }
}

impl Validate for ArchivedReturnRegion {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_request(kind, self)
    }
}

impl Validate for ArchivedRegionReturned {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_reply_meta(kind, &self.meta)
    }
}

impl Validate for ArchivedMapRegion {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_request(kind, self)?;
        check_len(kind, "regions", self.regions.len(), "MAX_BATCH", MAX_BATCH)
    }
}

impl Validate for ArchivedRegionMap {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_reply_meta(kind, &self.meta)?;
        check_len(kind, "descs", self.descs.len(), "MAX_BATCH", MAX_BATCH)
    }
}

impl Validate for ArchivedRegister {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_request(kind, self)?;
        check_layout(kind, &self.layout)?;
        check_len(kind, "entries", self.entries.len(), "MAX_BATCH", MAX_BATCH)?;
        for (index, entry) in self.entries.iter().enumerate() {
            check_key(kind, index, &entry.key)?;
        }
        Ok(())
    }
}

impl Validate for ArchivedRegisterReply {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_reply_meta(kind, &self.meta)?;
        check_len(
            kind,
            "outcomes",
            self.outcomes.len(),
            "MAX_BATCH",
            MAX_BATCH,
        )
    }
}

impl Validate for ArchivedLookup {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        let pins = self.pins();
        if pins as usize > MAX_PINS_PER_KEY {
            return Err(invalid(
                kind,
                "pins",
                u64::from(pins),
                "over MAX_PINS_PER_KEY",
                MAX_PINS_PER_KEY as u64,
            ));
        }
        check_request(kind, self)?;
        check_layout(kind, &self.layout)?;
        check_keys(kind, &self.keys)
    }
}

impl Validate for ArchivedLookupReply {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_reply_meta(kind, &self.meta)?;
        check_len(
            kind,
            "locations",
            self.locations.len(),
            "MAX_BATCH",
            MAX_BATCH,
        )?;
        check_len(kind, "regions", self.regions.len(), "MAX_BATCH", MAX_BATCH)
    }
}

impl Validate for ArchivedExists {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_request(kind, self)?;
        check_layout(kind, &self.layout)?;
        check_keys(kind, &self.keys)
    }
}

impl Validate for ArchivedExistsReply {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_reply_meta(kind, &self.meta)?;
        let bitmap = &self.present;
        let len = bitmap.len() as usize;
        check_len(kind, "present", len, "MAX_BATCH", MAX_BATCH)?;
        let words = len.div_ceil(64);
        if bitmap.words.len() != words {
            return Err(ProtoError::LengthMismatch {
                kind,
                field: "present.words",
                len: bitmap.words.len(),
                expected: words,
            });
        }
        // Bits past `len` must be zero so that equal answers are equal bytes.
        if let Some(last) = bitmap.words.last() {
            let used = len % 64;
            if used != 0 && last.to_native() >> used != 0 {
                return Err(invalid(
                    kind,
                    "present.words",
                    last.to_native(),
                    "bits past the last key must be zero",
                    len as u64,
                ));
            }
        }
        Ok(())
    }
}

impl Validate for ArchivedUnpin {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_request(kind, self)?;
        check_layout(kind, &self.layout)?;
        check_keys(kind, &self.keys)?;
        if self.counts.len() != self.keys.len() {
            return Err(ProtoError::LengthMismatch {
                kind,
                field: "counts",
                len: self.counts.len(),
                expected: self.keys.len(),
            });
        }
        for count in self.counts.iter() {
            let count = count.to_native();
            if count == 0 || count as usize > MAX_PINS_PER_KEY {
                return Err(invalid(
                    kind,
                    "counts",
                    u64::from(count),
                    "each count must be in 1..=MAX_PINS_PER_KEY",
                    MAX_PINS_PER_KEY as u64,
                ));
            }
        }
        Ok(())
    }
}

impl Validate for ArchivedUnpinReply {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_reply_meta(kind, &self.meta)?;
        check_len(
            kind,
            "outcomes",
            self.outcomes.len(),
            "MAX_BATCH",
            MAX_BATCH,
        )
    }
}

impl Validate for ArchivedDelete {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_request(kind, self)?;
        check_layout(kind, &self.layout)?;
        check_keys(kind, &self.keys)
    }
}

impl Validate for ArchivedDeleteReply {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_reply_meta(kind, &self.meta)?;
        check_len(
            kind,
            "outcomes",
            self.outcomes.len(),
            "MAX_BATCH",
            MAX_BATCH,
        )
    }
}

impl Validate for ArchivedStats {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_request(kind, self)?;
        let bits = self.sections.to_native();
        if bits & !sections::ALL != 0 {
            return Err(invalid(
                kind,
                "sections",
                u64::from(bits),
                "unknown section bits",
                u64::from(sections::ALL),
            ));
        }
        let rows = self.max_rows.to_native();
        if rows as usize > MAX_STATS_ROWS {
            return Err(invalid(
                kind,
                "max_rows",
                u64::from(rows),
                "over MAX_STATS_ROWS",
                MAX_STATS_ROWS as u64,
            ));
        }
        Ok(())
    }
}

impl Validate for ArchivedStatsReply {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_reply_meta(kind, &self.meta)?;
        check_name(kind, "directory_id", &self.directory_id)?;
        check_len(
            kind,
            "ops",
            self.ops.len(),
            "Kind::ALL.len()",
            Kind::ALL.len(),
        )?;
        check_len(kind, "pools", self.pools.len(), "MAX_POOLS", MAX_POOLS)?;
        check_len(
            kind,
            "instances",
            self.instances.len(),
            "MAX_STATS_ROWS",
            MAX_STATS_ROWS,
        )?;
        check_len(
            kind,
            "sessions",
            self.sessions.len(),
            "MAX_STATS_ROWS",
            MAX_STATS_ROWS,
        )?;
        check_len(
            kind,
            "regions",
            self.regions.len(),
            "MAX_STATS_ROWS",
            MAX_STATS_ROWS,
        )?;
        check_len(
            kind,
            "long_pins",
            self.long_pins.len(),
            "MAX_STATS_ROWS",
            MAX_STATS_ROWS,
        )?;
        for row in self.instances.iter() {
            check_name(kind, "instances.instance_id", &row.instance_id)?;
        }
        for row in self.sessions.iter() {
            check_name(kind, "sessions.instance_id", &row.instance_id)?;
        }
        for row in self.regions.iter() {
            check_name(kind, "regions.owner_instance", &row.owner_instance)?;
        }
        for row in self.long_pins.iter() {
            check_name(kind, "long_pins.instance_id", &row.instance_id)?;
        }
        Ok(())
    }
}

impl Validate for ArchivedEndSession {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_request(kind, self)
    }
}

impl Validate for ArchivedSessionEnded {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_reply_meta(kind, &self.meta)
    }
}

impl Validate for ArchivedErrorReply {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_bytes(
            kind,
            "message",
            self.message.len(),
            "MAX_MESSAGE_BYTES",
            MAX_MESSAGE_BYTES,
        )
    }
}

impl Validate for ArchivedPoolHello {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_request(kind, self)?;
        check_versions(
            kind,
            self.protocol_min.to_native(),
            self.protocol_max.to_native(),
        )?;
        if self.directory_id.is_empty() {
            return Err(invalid(kind, "directory_id", 0, "must not be empty", 0));
        }
        check_name(kind, "directory_id", &self.directory_id)?;
        check_secret(kind, "secret", &self.secret)
    }
}

impl Validate for ArchivedPoolWelcome {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_pools(kind, &self.pools, self.fds_passed.to_native())
    }
}

impl Validate for ArchivedAllocRegion {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_request(kind, self)?;
        if self.len_bytes.to_native() == 0 {
            return Err(invalid(kind, "len_bytes", 0, "must not be zero", 0));
        }
        check_owner(kind, &self.owner)
    }
}

impl Validate for ArchivedRegionAllocated {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_owner(kind, &self.handle.owner)
    }
}

impl Validate for ArchivedFreeRegion {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_request(kind, self)
    }
}

impl Validate for ArchivedRegionFreed {
    fn validate(&self, _kind: Kind) -> Result<(), ProtoError> {
        Ok(())
    }
}

impl Validate for ArchivedReattachRegions {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_request(kind, self)?;
        check_handles(
            kind,
            &self.handles,
            "MAX_REATTACH_REGIONS",
            MAX_REATTACH_REGIONS,
        )
    }
}

impl Validate for ArchivedRegionsReattached {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        let answered = self.accepted.len() + self.refused.len();
        check_len(
            kind,
            "accepted + refused",
            answered,
            "MAX_REATTACH_REGIONS",
            MAX_REATTACH_REGIONS,
        )
    }
}

impl Validate for ArchivedListRegions {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_request(kind, self)?;
        let max = self.max_handles.to_native();
        if max == 0 || max as usize > MAX_LIST_REGIONS {
            return Err(invalid(
                kind,
                "max_handles",
                u64::from(max),
                "must be in 1..=MAX_LIST_REGIONS",
                MAX_LIST_REGIONS as u64,
            ));
        }
        Ok(())
    }
}

impl Validate for ArchivedRegionList {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_handles(kind, &self.handles, "MAX_LIST_REGIONS", MAX_LIST_REGIONS)
    }
}

impl Validate for ArchivedPoolStats {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_request(kind, self)
    }
}

impl Validate for ArchivedPoolStatsReply {
    fn validate(&self, kind: Kind) -> Result<(), ProtoError> {
        check_len(kind, "pools", self.pools.len(), "MAX_POOLS", MAX_POOLS)?;
        for pool in self.pools.iter() {
            check_len(
                kind,
                "pools.owners",
                pool.owners.len(),
                "MAX_POOL_OWNERS",
                MAX_POOL_OWNERS,
            )?;
            for owner in pool.owners.iter() {
                check_name(kind, "pools.owners.directory_id", &owner.directory_id)?;
            }
        }
        Ok(())
    }
}
