//! Client configuration: where the server is, how the client authenticates,
//! how it finds its pools, how much memory its layouts take, and every
//! timeout, retry and queue bound.
//!
//! Every field has a default ([`ClientConfig::unix`] / [`ClientConfig::tcp`]
//! fill in the server address); [`ClientConfig::validate`] checks the ranges
//! before anything connects, and names the field that is wrong.

use std::net::SocketAddr;
use std::path::PathBuf;

use cxlkv_controlplane::proto::{MAX_NAME_BYTES, MAX_SECRET_BYTES};
use cxlkv_controlplane::transport;
use cxlkv_dataplane::visibility::Visibility;

use super::error::ClientError;

/// Default size of one region taken when a layout expands: 64 MiB (DESIGN
/// §3; raised to one page for layouts with larger pages, and rounded up to
/// the pool alignment).
pub const DEFAULT_REGION_SIZE_BYTES: u64 = 64 << 20;
/// Longest a dropped read guard's unpin may wait to be batched with others.
pub const MAX_UNPIN_DELAY_US: u32 = 1000;
/// Most retries of one request (each with its own deadline).
pub const MAX_RETRIES_CEILING: u32 = 64;
/// Most regions one client can map for its peers at once.
pub const MAX_PEER_MAPPINGS_CEILING: usize = cxlkv_dataplane::table::MAX_TABLE_REGIONS;
/// Most layouts one client can use.
pub const MAX_LAYOUTS: usize = 256;

/// Where the directory listens.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ServerAddr {
    /// A local server: the pool descriptors arrive over the socket
    /// (`SCM_RIGHTS`), so no filesystem permission on the device is needed.
    Unix(PathBuf),
    /// A remote (or simulated remote) server: the pools are opened by their
    /// local paths ([`ClientConfig::pool_paths`], else the server's path) and
    /// recognised by the UUID in their identity header.
    Tcp(SocketAddr),
}

impl ServerAddr {
    pub(crate) fn endpoint(&self) -> transport::Endpoint {
        match self {
            ServerAddr::Unix(p) => transport::Endpoint::Unix(p.clone()),
            ServerAddr::Tcp(a) => transport::Endpoint::Tcp(*a),
        }
    }
}

/// How a layout takes memory. Defaults come from [`ClientConfig::layout`];
/// [`crate::Client::layout_with`] overrides them for one layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayoutOptions {
    /// Bytes of regions taken when the layout is created (rounded up to whole
    /// regions); these regions are kept for the client's lifetime. 0: none
    /// until the first allocation.
    pub initial_reservation_bytes: u64,
    /// Bytes per region taken on each expansion; 0: the default, max(64 MiB,
    /// one page). Always rounded up to the pool alignment.
    pub region_size_bytes: u64,
    /// Take a new region when every region of the layout is full. Off: an
    /// allocation that finds no free page fails with `OutOfMemory`.
    pub auto_expand: bool,
}

impl Default for LayoutOptions {
    fn default() -> Self {
        Self {
            initial_reservation_bytes: 0,
            region_size_bytes: 0,
            auto_expand: true,
        }
    }
}

/// Everything [`crate::Client::connect`] needs. Its `Debug` form says
/// whether a client secret is set, never what it is.
#[derive(Clone)]
pub struct ClientConfig {
    /// Where the directory listens (set by [`ClientConfig::unix`] /
    /// [`ClientConfig::tcp`]).
    pub server: ServerAddr,
    /// The TCP listener's pre-shared secret (at most 256 bytes; not sent on
    /// Unix sockets, where `SO_PEERCRED` identifies the peer).
    pub client_secret: Option<Vec<u8>>,
    /// The instance's name; empty: the directory generates one. A configured
    /// name must not be in use by a live instance.
    pub instance_id: String,
    /// Sent in the session's opening; the server logs it with the session
    /// (it is not shown in stats).
    pub client_name: String,
    /// TCP only: the local path of each pool, by the UUID in its identity
    /// header. A pool not listed is opened by the path the server announces.
    /// Either way its header's UUID is checked before anything is mapped. An
    /// entry for a UUID the server does not announce is not used, and a
    /// warning names it (with the UUIDs announced).
    pub pool_paths: Vec<([u8; 16], PathBuf)>,
    /// Force a visibility mode for every pool (e.g. `Flush` for a client on a
    /// host without coherence). `None`: the mode the server announces.
    /// Forcing `Flush` costs speed, never correctness, for this client's
    /// own reads and writes — but a reader only sees what writers wrote back,
    /// so on a non-coherent pool every writer must run `Flush` too. Forcing
    /// `Coherent` is only correct on one host (or a coherent platform).
    pub visibility: Option<Visibility>,
    /// Map every current peer region at connect (lists regions with `Stats`,
    /// at most `MAX_STATS_ROWS`), so first lookups do not map.
    pub eager_map: bool,
    /// Defaults for every layout.
    pub layout: LayoutOptions,
    /// Per-instance cap on region bytes, checked here before a region is
    /// requested (and by the directory, when it enforces quotas). `None`: no
    /// client-side cap.
    pub quota_bytes: Option<u64>,
    /// A region beyond a layout's initial reservation whose pages have all
    /// been free this long is returned to the pool.
    pub idle_region_return_ms: u64,
    /// Deadline of one attempt of one request.
    pub request_timeout_ms: u64,
    /// Attempts of one request after the first (same sequence number), on a
    /// timeout, a transient error or a broken connection.
    pub max_retries: u32,
    /// How long a broken connection is retried (with exponential backoff)
    /// before requests fail.
    pub reconnect_timeout_ms: u64,
    /// First pause between two reconnect attempts (≥ 1), doubled after each
    /// failure up to `reconnect_backoff_max_ms`.
    pub reconnect_backoff_min_ms: u64,
    /// Longest pause between two reconnect attempts.
    pub reconnect_backoff_max_ms: u64,
    /// How long a dropped read guard's unpin may wait to be batched with
    /// others (≤ 1000). Unpins are always sent before this client's next
    /// request, whatever the delay.
    pub unpin_delay_us: u32,
    /// Most peer regions kept mapped; beyond it the least recently used is
    /// unmapped (once no view of it is alive).
    pub max_peer_mappings: usize,
    /// The transport's own knobs (spin time, in-flight bound, connect
    /// timeout).
    pub transport: transport::ClientConfig,
}

impl std::fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Destructured whole, so that a new field cannot be left out.
        let Self {
            server,
            client_secret,
            instance_id,
            client_name,
            pool_paths,
            visibility,
            eager_map,
            layout,
            quota_bytes,
            idle_region_return_ms,
            request_timeout_ms,
            max_retries,
            reconnect_timeout_ms,
            reconnect_backoff_min_ms,
            reconnect_backoff_max_ms,
            unpin_delay_us,
            max_peer_mappings,
            transport,
        } = self;
        f.debug_struct("ClientConfig")
            .field("server", server)
            .field(
                "client_secret",
                &client_secret.as_ref().map(|_| cxlkv_controlplane::Redacted),
            )
            .field("instance_id", instance_id)
            .field("client_name", client_name)
            .field("pool_paths", pool_paths)
            .field("visibility", visibility)
            .field("eager_map", eager_map)
            .field("layout", layout)
            .field("quota_bytes", quota_bytes)
            .field("idle_region_return_ms", idle_region_return_ms)
            .field("request_timeout_ms", request_timeout_ms)
            .field("max_retries", max_retries)
            .field("reconnect_timeout_ms", reconnect_timeout_ms)
            .field("reconnect_backoff_min_ms", reconnect_backoff_min_ms)
            .field("reconnect_backoff_max_ms", reconnect_backoff_max_ms)
            .field("unpin_delay_us", unpin_delay_us)
            .field("max_peer_mappings", max_peer_mappings)
            .field("transport", transport)
            .finish()
    }
}

impl ClientConfig {
    /// Defaults for a local server at `socket`.
    pub fn unix(socket: impl Into<PathBuf>) -> Self {
        Self::with_server(ServerAddr::Unix(socket.into()))
    }

    /// Defaults for a TCP server at `addr` (set
    /// [`client_secret`](Self::client_secret) unless the listener disabled it).
    pub fn tcp(addr: SocketAddr) -> Self {
        Self::with_server(ServerAddr::Tcp(addr))
    }

    fn with_server(server: ServerAddr) -> Self {
        Self {
            server,
            client_secret: None,
            instance_id: String::new(),
            client_name: format!("cxlkv-client-{}", std::process::id()),
            pool_paths: Vec::new(),
            visibility: None,
            eager_map: false,
            layout: LayoutOptions::default(),
            quota_bytes: None,
            idle_region_return_ms: 30_000,
            request_timeout_ms: 5_000,
            max_retries: 3,
            reconnect_timeout_ms: 30_000,
            reconnect_backoff_min_ms: 10,
            reconnect_backoff_max_ms: 1_000,
            unpin_delay_us: 200,
            max_peer_mappings: 4096,
            transport: transport::ClientConfig::default(),
        }
    }

    /// Checks every range; the error names the field.
    pub fn validate(&self) -> Result<(), ClientError> {
        let bad = |field: &'static str, reason: String| Err(ClientError::Config { field, reason });
        if self.instance_id.len() > MAX_NAME_BYTES {
            return bad(
                "instance_id",
                format!("{} bytes, at most {MAX_NAME_BYTES}", self.instance_id.len()),
            );
        }
        if self.client_name.len() > MAX_NAME_BYTES {
            return bad(
                "client_name",
                format!("{} bytes, at most {MAX_NAME_BYTES}", self.client_name.len()),
            );
        }
        if let Some(s) = &self.client_secret
            && s.len() > MAX_SECRET_BYTES
        {
            return bad(
                "client_secret",
                format!("{} bytes, at most {MAX_SECRET_BYTES}", s.len()),
            );
        }
        if self.request_timeout_ms == 0 {
            return bad("request_timeout_ms", "must be at least 1".into());
        }
        if self.max_retries > MAX_RETRIES_CEILING {
            return bad(
                "max_retries",
                format!("{}, at most {MAX_RETRIES_CEILING}", self.max_retries),
            );
        }
        if self.reconnect_backoff_min_ms == 0
            || self.reconnect_backoff_min_ms > self.reconnect_backoff_max_ms
        {
            return bad(
                "reconnect_backoff_min_ms",
                "must be at least 1 and at most reconnect_backoff_max_ms".into(),
            );
        }
        if self.unpin_delay_us > MAX_UNPIN_DELAY_US {
            return bad(
                "unpin_delay_us",
                format!("{}, at most {MAX_UNPIN_DELAY_US}", self.unpin_delay_us),
            );
        }
        if self.max_peer_mappings == 0 || self.max_peer_mappings > MAX_PEER_MAPPINGS_CEILING {
            return bad(
                "max_peer_mappings",
                format!("must be in 1..={MAX_PEER_MAPPINGS_CEILING}"),
            );
        }
        if self.quota_bytes == Some(0) {
            return bad(
                "quota_bytes",
                "0 would forbid every region; use None".into(),
            );
        }
        Ok(())
    }
}

/// Round `bytes` up to a multiple of `align` (a power of two); `None` on
/// overflow.
pub(crate) fn round_up(bytes: u64, align: u64) -> Option<u64> {
    debug_assert!(align.is_power_of_two());
    bytes.checked_add(align - 1).map(|b| b & !(align - 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_each_bad_value_names_its_field() {
        let ok = ClientConfig::unix("/tmp/x.sock");
        ok.validate().unwrap();
        type Tweak = fn(&mut ClientConfig);
        let cases: Vec<(&str, Tweak)> = vec![
            ("instance_id", |c| c.instance_id = "x".repeat(200)),
            ("request_timeout_ms", |c| c.request_timeout_ms = 0),
            ("max_retries", |c| c.max_retries = 1000),
            ("unpin_delay_us", |c| c.unpin_delay_us = 5000),
            ("max_peer_mappings", |c| c.max_peer_mappings = 0),
            ("quota_bytes", |c| c.quota_bytes = Some(0)),
            ("reconnect_backoff_min_ms", |c| {
                c.reconnect_backoff_min_ms = 5_000
            }),
            ("client_secret", |c| c.client_secret = Some(vec![0; 300])),
        ];
        for (field, tweak) in cases {
            let mut c = ClientConfig::unix("/tmp/x.sock");
            tweak(&mut c);
            let err = c.validate().unwrap_err();
            assert!(err.to_string().contains(field), "{field}: {err}");
        }
    }

    #[test]
    fn debug_says_whether_a_client_secret_is_set_never_what_it_is() {
        let mut c = ClientConfig::tcp("127.0.0.1:7411".parse().unwrap());
        assert!(format!("{c:?}").contains("client_secret: None"));
        c.client_secret = Some(b"s3cret-bytes".to_vec());
        let text = format!("{c:?}");
        assert!(text.contains("client_secret: Some(<redacted>)"), "{text}");
        assert!(
            !text.contains("s3cret") && !text.contains("[115, 51"),
            "{text}"
        );
        assert!(text.contains("server: Tcp(127.0.0.1:7411)"), "{text}");
    }

    #[test]
    fn round_up_rounds_to_the_alignment_and_detects_overflow() {
        assert_eq!(round_up(1, 4096), Some(4096));
        assert_eq!(round_up(4096, 4096), Some(4096));
        assert_eq!(round_up(0, 4096), Some(0));
        assert_eq!(round_up(u64::MAX, 4096), None);
    }
}
