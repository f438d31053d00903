//! One valid, non-trivial sample message of every kind (every list
//! non-empty, every option present, every enum variant used somewhere), for
//! round-trip tests, the fuzzer's seed corpus and examples. Compiled for
//! tests and with the `samples` feature only.

use super::*;

const LAYOUT: Layout = Layout {
    page_size_bytes: 2 << 20,
    fingerprint: 0x0123_4567_89ab_cdef,
};

const LOCATION: Location = Location {
    region: 7,
    page: 3,
    generation: 9,
    len_bytes: 1 << 20,
};

const DESC: RegionDesc = RegionDesc {
    region: 7,
    pool: 0,
    offset_bytes: 64 << 20,
    len_bytes: 64 << 20,
    page_size_bytes: 2 << 20,
};

fn request(seq: u64) -> RequestMeta {
    RequestMeta {
        seq,
        notice_ack: 4,
        replies_received_below: seq.saturating_sub(1),
    }
}

fn reply() -> ReplyMeta {
    ReplyMeta {
        notices: vec![FreedPage {
            seq: 5,
            region: 7,
            page: 11,
            generation: 2,
        }],
        usage: Usage {
            instance_used_bytes: 6 << 20,
            instance_owned_bytes: 128 << 20,
            instance_quota_bytes: 1 << 30,
            pool_free_bytes: 1 << 31,
        },
    }
}

fn keys() -> Vec<Vec<u8>> {
    vec![
        b"model-a/chunk/0".to_vec(),
        b"model-a/chunk/1".to_vec(),
        vec![0xff; 40],
    ]
}

fn pool_info() -> PoolInfo {
    PoolInfo {
        pool: 0,
        uuid: *b"0123456789abcdef",
        size_bytes: 2 << 30,
        align_bytes: 2 << 20,
        path: "/dev/shm/cxlkv-pool".into(),
        kind: BackingKind::File,
        visibility: VisibilityMode::Coherent,
    }
}

fn owner() -> OwnerLabel {
    OwnerLabel {
        directory_id: "dir-a".into(),
        instance_id: "vllm-0".into(),
    }
}

fn handle() -> RegionHandle {
    RegionHandle {
        region: 7,
        pool: 0,
        offset_bytes: 64 << 20,
        len_bytes: 64 << 20,
        owner: owner(),
        token: RegionToken([0x5a; 32]),
    }
}

pub fn hello() -> Hello {
    Hello {
        meta: request(0),
        protocol_min: 1,
        protocol_max: 1,
        instance_id: "vllm-0".into(),
        client_name: "vllm-worker-0".into(),
        client_secret: Some(b"pre-shared".to_vec()),
    }
}

pub fn welcome() -> Welcome {
    Welcome {
        meta: reply(),
        protocol_version: 1,
        instance_id: "vllm-0".into(),
        instance_secret: InstanceSecret([0x11; 32]),
        session_id: 42,
        directory_id: "dir-a".into(),
        directory_epoch: 3,
        limits: Limits::protocol(256, 1024),
        lease_ms: 10_000,
        pools: vec![pool_info()],
        fds_passed: 1,
    }
}

pub fn reattach() -> Reattach {
    Reattach {
        meta: request(0),
        protocol_min: 1,
        protocol_max: 1,
        instance_id: "vllm-0".into(),
        instance_secret: InstanceSecret([0x11; 32]),
        client_name: "vllm-worker-0".into(),
        client_secret: Some(b"pre-shared".to_vec()),
        regions: vec![OwnedRegion {
            desc: DESC,
            layout: LAYOUT,
            token: RegionToken([0x5a; 32]),
        }],
        next_seq: 17,
    }
}

pub fn reattached() -> Reattached {
    Reattached {
        welcome: welcome(),
        resumed: true,
        accepted: vec![7],
        refused: vec![RefusedRegion {
            region: 8,
            code: ErrorCode::BadToken.as_u16(),
        }],
        oldest_accepted_seq: 17,
    }
}

pub fn heartbeat() -> Heartbeat {
    Heartbeat { meta: request(0) }
}

pub fn heartbeat_reply() -> HeartbeatReply {
    HeartbeatReply {
        meta: reply(),
        lease_ms: 10_000,
    }
}

pub fn request_region() -> RequestRegion {
    RequestRegion {
        meta: request(1),
        layout: LAYOUT,
        len_bytes: 64 << 20,
    }
}

pub fn region_granted() -> RegionGranted {
    RegionGranted {
        meta: reply(),
        desc: DESC,
        layout: LAYOUT,
        token: RegionToken([0x5a; 32]),
    }
}

pub fn return_region() -> ReturnRegion {
    ReturnRegion {
        meta: request(2),
        region: 7,
    }
}

pub fn region_returned() -> RegionReturned {
    RegionReturned {
        meta: reply(),
        region: 7,
    }
}

pub fn map_region() -> MapRegion {
    MapRegion {
        meta: request(0),
        regions: vec![7, 8],
    }
}

pub fn region_map() -> RegionMap {
    RegionMap {
        meta: reply(),
        descs: vec![Some(DESC), None],
    }
}

pub fn register() -> Register {
    Register {
        meta: request(3),
        layout: LAYOUT,
        entries: keys()
            .into_iter()
            .enumerate()
            .map(|(i, key)| RegisterEntry {
                key,
                location: Location {
                    page: i as u32,
                    ..LOCATION
                },
            })
            .collect(),
    }
}

pub fn register_reply() -> RegisterReply {
    RegisterReply {
        meta: reply(),
        outcomes: vec![
            RegisterOutcome::Inserted,
            RegisterOutcome::Duplicate(LOCATION),
            RegisterOutcome::Rejected(RejectReason::NotOwner),
        ],
    }
}

pub fn lookup() -> Lookup {
    Lookup {
        meta: request(4),
        layout: LAYOUT,
        keys: keys(),
        pins: 1,
    }
}

pub fn lookup_reply() -> LookupReply {
    LookupReply {
        meta: reply(),
        locations: vec![
            Some(LOCATION),
            None,
            Some(Location {
                page: 4,
                ..LOCATION
            }),
        ],
        regions: vec![DESC],
    }
}

pub fn exists() -> Exists {
    Exists {
        meta: request(0),
        layout: LAYOUT,
        keys: keys(),
    }
}

pub fn exists_reply() -> ExistsReply {
    ExistsReply {
        meta: reply(),
        present: [true, false, true].into_iter().collect(),
    }
}

pub fn unpin() -> Unpin {
    Unpin {
        meta: request(5),
        layout: LAYOUT,
        keys: keys(),
        counts: vec![1, 2, 1],
    }
}

pub fn unpin_reply() -> UnpinReply {
    UnpinReply {
        meta: reply(),
        outcomes: vec![
            UnpinOutcome::Unpinned,
            UnpinOutcome::NotPinned,
            UnpinOutcome::Unpinned,
        ],
    }
}

pub fn delete() -> Delete {
    Delete {
        meta: request(6),
        layout: LAYOUT,
        keys: keys(),
    }
}

pub fn delete_reply() -> DeleteReply {
    DeleteReply {
        meta: reply(),
        outcomes: vec![
            DeleteOutcome::Deleted,
            DeleteOutcome::Pinned { pins: 2 },
            DeleteOutcome::Missing,
        ],
    }
}

pub fn stats() -> Stats {
    Stats {
        meta: request(0),
        sections: sections::ALL,
        max_rows: 100,
    }
}

pub fn stats_reply() -> StatsReply {
    let latency = LatencySummary {
        count: 1000,
        p50_ns: 8_000,
        p99_ns: 20_000,
        max_ns: 90_000,
    };
    StatsReply {
        meta: reply(),
        directory_id: "dir-a".into(),
        directory_epoch: 3,
        uptime_ms: 3_600_000,
        totals: DirectoryTotals {
            keys: 10,
            pins: 2,
            sessions: 1,
            instances_live: 1,
            ..Default::default()
        },
        outcomes: OutcomeTotals {
            inserted: 10,
            lookup_hits: 16_000,
            ..Default::default()
        },
        ops: vec![OpStats {
            kind: Kind::Lookup.as_u16(),
            requests: 1000,
            items: 16_000,
            errors: 1,
            latency,
        }],
        pools: vec![PoolRow {
            pool: 0,
            size_bytes: 2 << 30,
            free_bytes: 1 << 30,
            regions: 4,
            region_bytes: 256 << 20,
            orphaned_regions: 0,
            keys: 3,
            used_bytes: 6 << 20,
        }],
        instances: vec![InstanceRow {
            instance_id: "vllm-0".into(),
            sessions: 1,
            awaiting_reattach: false,
            regions: 2,
            owned_bytes: 128 << 20,
            pending_region_bytes: 0,
            used_bytes: 6 << 20,
            quota_bytes: 0,
            keys: 3,
            pins: 2,
            notices_pending: 1,
            cached_replies: 4,
            cached_reply_bytes: 512,
        }],
        sessions: vec![SessionRow {
            session_id: 42,
            instance_id: "vllm-0".into(),
            transport: Transport::Unix,
            pid: 1234,
            uid: 1000,
            age_ms: 60_000,
            idle_ms: 5,
            requests: 1001,
        }],
        regions: vec![RegionRow {
            region: 7,
            pool: 0,
            layout: LAYOUT,
            len_bytes: 64 << 20,
            owner_instance: "vllm-0".into(),
            owner_present: true,
            keys: 3,
            used_bytes: 6 << 20,
            deferred: false,
        }],
        long_pins: vec![LongPinRow {
            session_id: 42,
            instance_id: "vllm-0".into(),
            pins: 1,
            held_ms: 120_000,
        }],
        long_pin_threshold_ms: 60_000,
        truncated: false,
    }
}

pub fn end_session() -> EndSession {
    EndSession {
        meta: request(7),
        session_id: 42,
    }
}

pub fn session_ended() -> SessionEnded {
    SessionEnded {
        meta: reply(),
        session_id: 42,
        pins_released: 2,
    }
}

pub fn error_reply() -> ErrorReply {
    ErrorReply::new(
        ErrorCode::KeyTooLong,
        "Lookup: key 0 is 600 bytes, over MAX_KEY_BYTES = 512",
        512,
    )
}

pub fn pool_hello() -> PoolHello {
    PoolHello {
        meta: RequestMeta::default(),
        protocol_min: 1,
        protocol_max: 1,
        directory_id: "dir-a".into(),
        secret: Some(b"pool-secret".to_vec()),
    }
}

pub fn pool_welcome() -> PoolWelcome {
    PoolWelcome {
        protocol_version: 1,
        manager_epoch: 5,
        pools: vec![pool_info()],
        fds_passed: 1,
        regions_held: 4,
        last_seq: 9,
    }
}

pub fn alloc_region() -> AllocRegion {
    AllocRegion {
        meta: RequestMeta {
            seq: 8,
            ..RequestMeta::default()
        },
        pool: Some(0),
        len_bytes: 64 << 20,
        owner: owner(),
    }
}

pub fn region_allocated() -> RegionAllocated {
    RegionAllocated { handle: handle() }
}

pub fn free_region() -> FreeRegion {
    FreeRegion {
        meta: RequestMeta {
            seq: 9,
            ..RequestMeta::default()
        },
        region: 7,
        token: RegionToken([0x5a; 32]),
    }
}

pub fn region_freed() -> RegionFreed {
    RegionFreed { region: 7 }
}

pub fn reattach_regions() -> ReattachRegions {
    ReattachRegions {
        meta: RequestMeta::default(),
        handles: vec![handle()],
    }
}

pub fn regions_reattached() -> RegionsReattached {
    RegionsReattached {
        accepted: vec![7],
        refused: vec![RefusedRegion {
            region: 8,
            code: ErrorCode::UnknownRegion.as_u16(),
        }],
    }
}

pub fn list_regions() -> ListRegions {
    ListRegions {
        meta: RequestMeta::default(),
        after_region: 0,
        max_handles: 100,
    }
}

pub fn region_list() -> RegionList {
    RegionList {
        handles: vec![handle()],
        more: false,
    }
}

pub fn pool_stats() -> PoolStats {
    PoolStats {
        meta: RequestMeta::default(),
    }
}

pub fn pool_stats_reply() -> PoolStatsReply {
    PoolStatsReply {
        manager_epoch: 5,
        pools: vec![PoolUsage {
            pool: 0,
            total_bytes: 2 << 30,
            free_bytes: 1 << 30,
            largest_free_bytes: 1 << 30,
            regions: 4,
            owners: vec![OwnerUsage {
                directory_id: "dir-a".into(),
                regions: 4,
                bytes: 256 << 20,
            }],
        }],
    }
}

/// One encoded frame per kind, in [`Kind::ALL`] order, request ids 1, 2, ….
pub fn frames() -> Vec<(Kind, Vec<u8>)> {
    fn frame<M: Message>(id: u64, msg: &M) -> (Kind, Vec<u8>) {
        let mut out = Vec::new();
        encode(id, msg, &mut out).expect("every sample message encodes");
        (M::KIND, out)
    }
    vec![
        frame(1, &hello()),
        frame(2, &reattach()),
        frame(3, &heartbeat()),
        frame(4, &request_region()),
        frame(5, &return_region()),
        frame(6, &map_region()),
        frame(7, &register()),
        frame(8, &lookup()),
        frame(9, &exists()),
        frame(10, &unpin()),
        frame(11, &delete()),
        frame(12, &stats()),
        frame(13, &end_session()),
        frame(14, &pool_hello()),
        frame(15, &alloc_region()),
        frame(16, &free_region()),
        frame(17, &reattach_regions()),
        frame(18, &list_regions()),
        frame(19, &pool_stats()),
        frame(20, &welcome()),
        frame(21, &reattached()),
        frame(22, &heartbeat_reply()),
        frame(23, &region_granted()),
        frame(24, &region_returned()),
        frame(25, &region_map()),
        frame(26, &register_reply()),
        frame(27, &lookup_reply()),
        frame(28, &exists_reply()),
        frame(29, &unpin_reply()),
        frame(30, &delete_reply()),
        frame(31, &stats_reply()),
        frame(32, &session_ended()),
        frame(33, &pool_welcome()),
        frame(34, &region_allocated()),
        frame(35, &region_freed()),
        frame(36, &regions_reattached()),
        frame(37, &region_list()),
        frame(38, &pool_stats_reply()),
        frame(39, &error_reply()),
    ]
}
