//! Messages as values: what crosses the simulated network between clients
//! and the directory, and between the directory and the pool manager. They
//! carry exactly what the real protocol carries (`docs/protocol.md`), as the
//! state machines' own input and output types: the simulation tests the
//! state machines and the rules the drivers around them must follow, not
//! the byte encoding (the fuzzers do that).

use crate::directory::{
    DeleteOutcome, DirectoryError, InstanceSecret, Layout, Location, LookupReply, PresentedRegion,
    Reattached, RegionGrant, RegisterOutcome, Reply, Sequence, UnpinOutcome, Welcome,
};
use crate::pool::{AttachReport, Handle, PoolError};
use cxlkv_dataplane::ids::RegionId;

/// One client ↔ directory connection; never reused within a run.
pub(crate) type ConnId = u64;

/// A client's request. `ack` is `notice_ack`: the highest freed-page notice
/// the client applied.
#[derive(Debug, Clone)]
pub(crate) enum ClientRequest {
    Hello,
    Reattach {
        secret: InstanceSecret,
        regions: Vec<PresentedRegion>,
        next_seq: u64,
        notice_ack: u64,
    },
    Heartbeat {
        ack: u64,
    },
    Register {
        ack: u64,
        seq: Sequence,
        layout: Layout,
        entries: Vec<(Vec<u8>, Location)>,
    },
    Lookup {
        ack: u64,
        seq: Option<Sequence>,
        layout: Layout,
        keys: Vec<Vec<u8>>,
        pins: u32,
    },
    Exists {
        ack: u64,
        layout: Layout,
        keys: Vec<Vec<u8>>,
    },
    Unpin {
        ack: u64,
        seq: Sequence,
        layout: Layout,
        entries: Vec<(Vec<u8>, u32)>,
    },
    Delete {
        ack: u64,
        seq: Sequence,
        layout: Layout,
        keys: Vec<Vec<u8>>,
    },
    RequestRegion {
        ack: u64,
        seq: Sequence,
        layout: Layout,
        len_bytes: u64,
    },
    ReturnRegion {
        ack: u64,
        seq: Sequence,
        region: RegionId,
    },
}

/// The directory's answer to one request.
#[derive(Debug, Clone)]
pub(crate) enum ClientReply {
    Welcome(Welcome),
    Reattached(Reattached),
    Heartbeat(Reply<()>),
    Register(Reply<Vec<RegisterOutcome>>),
    Lookup(Reply<LookupReply>),
    Exists(Reply<Vec<bool>>),
    Unpin(Reply<Vec<UnpinOutcome>>),
    Delete(Reply<Vec<DeleteOutcome>>),
    Region(Reply<RegionGrant>),
    Returned(Reply<()>),
    Error(DirectoryError),
    /// A second `hello`/`reattach` on a connection that already has a
    /// session (a duplicated message): refused by the server, not the
    /// directory.
    AlreadyAttached,
}

/// A directory's request to the pool manager.
#[derive(Debug, Clone)]
pub(crate) enum PoolRequest {
    /// A starting directory: attach, list this directory's regions, keep
    /// them all (`PoolHello`, `ListRegions`, `ReattachRegions`).
    Rejoin,
    /// Attach again after the pool manager restarted, keeping these.
    Attach {
        handles: Vec<Handle>,
    },
    /// Mutating requests carry the directory's `seq`, which the pool
    /// service's reply cache answers retries by (and which tags an
    /// allocation, as the service tags it).
    Alloc {
        instance: u64,
        len_bytes: u64,
        seq: u64,
    },
    Free {
        handle: Handle,
        seq: u64,
    },
}

#[derive(Debug, Clone)]
pub(crate) enum PoolReplyBody {
    Rejoined(Vec<Handle>),
    Attached(AttachReport),
    Allocated(Handle),
    Freed,
}

/// The pool manager's answer, with the fill level the directory's usage
/// figures and eviction are fed from.
#[derive(Debug, Clone)]
pub(crate) struct PoolReply {
    pub result: Result<PoolReplyBody, PoolError>,
    pub capacity_bytes: u64,
    pub free_bytes: u64,
}

/// Something in flight.
#[derive(Debug, Clone)]
pub(crate) enum Message {
    ToDirectory {
        conn: ConnId,
        req_id: u64,
        request: ClientRequest,
    },
    ToClient {
        client: usize,
        conn: ConnId,
        req_id: u64,
        reply: ClientReply,
    },
    ToPool {
        directory_incarnation: u32,
        /// The pool-manager process the directory's connection leads to: a
        /// request dies with its connection, as on a real stream socket, so
        /// it never reaches a later incarnation.
        pool_incarnation: u32,
        /// The directory's connection to the pool manager (numbers are
        /// never reused): a message on a connection the directory has left
        /// is dropped, in both directions.
        pool_conn: u64,
        id: u64,
        request: PoolRequest,
    },
    FromPool {
        pool_incarnation: u32,
        directory_incarnation: u32,
        pool_conn: u64,
        id: u64,
        reply: PoolReply,
    },
}
