//! Message kinds: the `kind` field of the frame header.

/// Which endpoint serves a request kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Service {
    /// Client ↔ directory.
    Directory,
    /// Directory ↔ pool manager.
    PoolManager,
}

/// Every message kind, with its stable number in the frame header.
///
/// Layout of the numbers: bit 15 clear for requests, set for replies; a
/// request's reply is `request | 0x8000`. The high byte of a request names
/// its service (`0x01` directory, `0x02` pool manager). `ErrorReply`
/// (`0xFFFF`) answers any request. Numbers are never changed or reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u16)]
pub enum Kind {
    Hello = 0x0101,
    Reattach = 0x0102,
    Heartbeat = 0x0103,
    RequestRegion = 0x0111,
    ReturnRegion = 0x0112,
    MapRegion = 0x0113,
    Register = 0x0121,
    Lookup = 0x0122,
    Exists = 0x0123,
    Unpin = 0x0124,
    Delete = 0x0125,
    Stats = 0x0131,
    EndSession = 0x0132,

    PoolHello = 0x0201,
    AllocRegion = 0x0211,
    FreeRegion = 0x0212,
    ReattachRegions = 0x0213,
    ListRegions = 0x0214,
    PoolStats = 0x0221,

    Welcome = 0x8101,
    Reattached = 0x8102,
    HeartbeatReply = 0x8103,
    RegionGranted = 0x8111,
    RegionReturned = 0x8112,
    RegionMap = 0x8113,
    RegisterReply = 0x8121,
    LookupReply = 0x8122,
    ExistsReply = 0x8123,
    UnpinReply = 0x8124,
    DeleteReply = 0x8125,
    StatsReply = 0x8131,
    SessionEnded = 0x8132,

    PoolWelcome = 0x8201,
    RegionAllocated = 0x8211,
    RegionFreed = 0x8212,
    RegionsReattached = 0x8213,
    RegionList = 0x8214,
    PoolStatsReply = 0x8221,

    ErrorReply = 0xFFFF,
}

const REPLY_BIT: u16 = 0x8000;

impl Kind {
    /// Every kind, requests first, in number order within each half.
    pub const ALL: [Kind; 39] = [
        Self::Hello,
        Self::Reattach,
        Self::Heartbeat,
        Self::RequestRegion,
        Self::ReturnRegion,
        Self::MapRegion,
        Self::Register,
        Self::Lookup,
        Self::Exists,
        Self::Unpin,
        Self::Delete,
        Self::Stats,
        Self::EndSession,
        Self::PoolHello,
        Self::AllocRegion,
        Self::FreeRegion,
        Self::ReattachRegions,
        Self::ListRegions,
        Self::PoolStats,
        Self::Welcome,
        Self::Reattached,
        Self::HeartbeatReply,
        Self::RegionGranted,
        Self::RegionReturned,
        Self::RegionMap,
        Self::RegisterReply,
        Self::LookupReply,
        Self::ExistsReply,
        Self::UnpinReply,
        Self::DeleteReply,
        Self::StatsReply,
        Self::SessionEnded,
        Self::PoolWelcome,
        Self::RegionAllocated,
        Self::RegionFreed,
        Self::RegionsReattached,
        Self::RegionList,
        Self::PoolStatsReply,
        Self::ErrorReply,
    ];

    pub const fn as_u16(self) -> u16 {
        self as u16
    }

    /// The kind with header number `n`, if any.
    pub fn from_u16(n: u16) -> Option<Self> {
        Self::ALL.iter().copied().find(|k| k.as_u16() == n)
    }

    pub const fn is_request(self) -> bool {
        self.as_u16() & REPLY_BIT == 0
    }

    pub const fn is_reply(self) -> bool {
        !self.is_request()
    }

    /// The reply kind of a request (`ErrorReply` may always come instead);
    /// `None` for a reply kind.
    pub fn reply(self) -> Option<Self> {
        if self.is_request() {
            Self::from_u16(self.as_u16() | REPLY_BIT)
        } else {
            None
        }
    }

    /// The request a reply kind answers; `None` for requests and
    /// `ErrorReply`.
    pub fn request(self) -> Option<Self> {
        match self {
            Self::ErrorReply => None,
            k if k.is_reply() => Self::from_u16(k.as_u16() & !REPLY_BIT),
            _ => None,
        }
    }

    /// The service a request or reply belongs to; `None` for `ErrorReply`.
    pub const fn service(self) -> Option<Service> {
        match (self.as_u16() & !REPLY_BIT) >> 8 {
            0x01 => Some(Service::Directory),
            0x02 => Some(Service::PoolManager),
            _ => None,
        }
    }

    /// True for request kinds that always change state and therefore always
    /// carry a non-zero `seq`. `Lookup` is mutating only when it takes pins
    /// (see [`AnyRequest::is_mutating`](super::AnyRequest::is_mutating)).
    pub const fn always_mutating(self) -> bool {
        matches!(
            self,
            Self::Register
                | Self::Unpin
                | Self::Delete
                | Self::RequestRegion
                | Self::ReturnRegion
                | Self::EndSession
                | Self::AllocRegion
                | Self::FreeRegion
        )
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?} ({:#06x})", self.as_u16())
    }
}
