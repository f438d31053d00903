//! Shared by the server tests: a raw protocol client (the transport's
//! `RpcClient` plus `proto` encoding and checked decoding) and helpers that
//! open a session and get a region.

#![allow(dead_code)]

use std::os::fd::OwnedFd;
use std::path::Path;
use std::time::Duration;

use cxlkv_controlplane::frame::{Frame, HEADER_BYTES};
use cxlkv_controlplane::proto::{self, ErrorCode, ErrorReply, Layout, Message, RequestMeta};
use cxlkv_controlplane::transport::{ClientConfig, Endpoint, RpcClient};

pub const TIMEOUT: Duration = Duration::from_secs(10);

pub const LAYOUT: Layout = Layout {
    page_size_bytes: 64 << 10,
    fingerprint: 0xfeed,
};

/// A reply: the expected message, or the server's error.
pub type Answer<R> = Result<R, ErrorReply>;

/// A connection speaking the protocol by hand.
pub struct Raw {
    pub rpc: RpcClient,
    /// Next sequence number for mutating requests.
    pub next_seq: u64,
    /// Highest freed-page notice applied.
    pub notice_ack: u64,
}

pub fn encode_payload<M: Message>(msg: &M) -> Vec<u8> {
    let mut buf = Vec::new();
    proto::encode(0, msg, &mut buf).expect("test message encodes");
    let len = u32::from_le_bytes(buf[16..20].try_into().unwrap()) as usize;
    buf[HEADER_BYTES..HEADER_BYTES + len].to_vec()
}

impl Raw {
    pub fn connect_unix(path: &Path) -> Raw {
        Self::connect(&Endpoint::Unix(path.to_owned()))
    }

    pub fn connect(ep: &Endpoint) -> Raw {
        let rpc = RpcClient::connect(ep, ClientConfig::default()).expect("connect");
        Raw {
            rpc,
            next_seq: 1,
            notice_ack: 0,
        }
    }

    /// Sends `msg`, returns the decoded reply (owned) and its descriptors.
    pub fn call_fds<M: Message, R: Message>(&self, msg: &M) -> (Answer<R>, Vec<OwnedFd>) {
        let payload = encode_payload(msg);
        let reply = self
            .rpc
            .call(M::KIND.as_u16(), &payload, TIMEOUT)
            .expect("a reply within the timeout");
        let frame = Frame {
            header: reply.header,
            payload: reply.payload(),
        };
        let answer = match proto::access_reply::<R>(frame).expect("reply passes checked access") {
            Ok(r) => Ok(proto::deserialize::<R>(r).expect("deserializes")),
            Err(e) => Err(proto::deserialize::<ErrorReply>(e).expect("deserializes")),
        };
        let Reply { fds, .. } = reply;
        (answer, fds)
    }

    pub fn call<M: Message, R: Message>(&self, msg: &M) -> Answer<R> {
        self.call_fds(msg).0
    }

    /// Sends `msg` and waits at most `timeout`: `None` when no reply came
    /// (dropped by a fault plan), or the connection closed.
    pub fn try_call<M: Message, R: Message>(
        &self,
        msg: &M,
        timeout: Duration,
    ) -> Option<Answer<R>> {
        let payload = encode_payload(msg);
        let reply = self.rpc.call(M::KIND.as_u16(), &payload, timeout).ok()?;
        let frame = Frame {
            header: reply.header,
            payload: reply.payload(),
        };
        Some(
            match proto::access_reply::<R>(frame).expect("reply passes checked access") {
                Ok(r) => Ok(proto::deserialize::<R>(r).expect("deserializes")),
                Err(e) => Err(proto::deserialize::<ErrorReply>(e).expect("deserializes")),
            },
        )
    }

    /// A read-only request's meta.
    pub fn ro(&self) -> RequestMeta {
        RequestMeta {
            notice_ack: self.notice_ack,
            ..RequestMeta::default()
        }
    }

    /// A fresh sequence number's meta.
    pub fn rw(&mut self) -> RequestMeta {
        let seq = self.next_seq;
        self.next_seq += 1;
        RequestMeta {
            seq,
            notice_ack: self.notice_ack,
            replies_received_below: 0,
        }
    }

    pub fn hello(&self, instance: &str) -> (Answer<proto::Welcome>, Vec<OwnedFd>) {
        self.hello_with_secret(instance, None)
    }

    pub fn hello_with_secret(
        &self,
        instance: &str,
        secret: Option<&[u8]>,
    ) -> (Answer<proto::Welcome>, Vec<OwnedFd>) {
        self.call_fds(&proto::Hello {
            meta: RequestMeta::default(),
            protocol_min: 1,
            protocol_max: 1,
            instance_id: instance.into(),
            client_name: "test".into(),
            client_secret: secret.map(<[u8]>::to_vec),
        })
    }

    pub fn request_region(&mut self, len_bytes: u64) -> Answer<proto::RegionGranted> {
        let meta = self.rw();
        self.call(&proto::RequestRegion {
            meta,
            layout: LAYOUT,
            len_bytes,
        })
    }

    pub fn register(
        &mut self,
        entries: Vec<(Vec<u8>, proto::Location)>,
    ) -> Answer<proto::RegisterReply> {
        let meta = self.rw();
        self.call(&proto::Register {
            meta,
            layout: LAYOUT,
            entries: entries
                .into_iter()
                .map(|(key, location)| proto::RegisterEntry { key, location })
                .collect(),
        })
    }

    pub fn lookup(&mut self, keys: &[&[u8]], pins: u32) -> Answer<proto::LookupReply> {
        let meta = if pins > 0 { self.rw() } else { self.ro() };
        self.call(&proto::Lookup {
            meta,
            layout: LAYOUT,
            keys: keys.iter().map(|k| k.to_vec()).collect(),
            pins,
        })
    }

    pub fn exists(&self, keys: &[&[u8]]) -> Answer<proto::ExistsReply> {
        self.call(&proto::Exists {
            meta: self.ro(),
            layout: LAYOUT,
            keys: keys.iter().map(|k| k.to_vec()).collect(),
        })
    }

    pub fn unpin(&mut self, keys: &[&[u8]]) -> Answer<proto::UnpinReply> {
        let meta = self.rw();
        self.call(&proto::Unpin {
            meta,
            layout: LAYOUT,
            keys: keys.iter().map(|k| k.to_vec()).collect(),
            counts: vec![1; keys.len()],
        })
    }

    pub fn delete(&mut self, keys: &[&[u8]]) -> Answer<proto::DeleteReply> {
        let meta = self.rw();
        self.call(&proto::Delete {
            meta,
            layout: LAYOUT,
            keys: keys.iter().map(|k| k.to_vec()).collect(),
        })
    }

    pub fn heartbeat(&self) -> Answer<proto::HeartbeatReply> {
        self.call(&proto::Heartbeat { meta: self.ro() })
    }
}

use cxlkv_controlplane::transport::Reply;

/// A location on page `page` of `region`, generation 1, one byte.
/// A `Reattach` of `instance` with its secret, presenting `regions`.
pub fn reattach_msg(
    instance: &str,
    secret: proto::InstanceSecret,
    regions: Vec<proto::OwnedRegion>,
    next_seq: u64,
) -> proto::Reattach {
    proto::Reattach {
        meta: proto::RequestMeta::default(),
        protocol_min: 1,
        protocol_max: 1,
        instance_id: instance.into(),
        instance_secret: secret,
        client_name: "test".into(),
        client_secret: None,
        regions,
        next_seq,
    }
}

/// A granted region as its owner presents it when reattaching.
pub fn owned(g: &proto::RegionGranted) -> proto::OwnedRegion {
    proto::OwnedRegion {
        desc: g.desc,
        layout: g.layout,
        token: g.token,
    }
}

pub fn loc(region: u64, page: u32) -> proto::Location {
    proto::Location {
        region,
        page,
        generation: 1,
        len_bytes: 1,
    }
}

/// Asserts an error reply with `code`.
#[track_caller]
pub fn expect_code<R: std::fmt::Debug>(a: Answer<R>, code: ErrorCode) -> ErrorReply {
    match a {
        Err(e) => {
            assert_eq!(e.error_code(), Some(code), "{e:?}");
            e
        }
        Ok(r) => panic!("expected {code}, got {r:?}"),
    }
}

/// The directory's state, without the counters and latencies that every
/// request (even a refused one) moves, and without the pool manager's fill
/// reports (they arrive on their own schedule): equal before and after a
/// request means the request changed nothing.
pub fn state_of(s: &cxlkv_controlplane::directory::DirectoryStats) -> String {
    format!(
        "keys={} page={} value={} key_bytes={} pins={} pinned={} sessions={} instances={} \
         regions={} region_bytes={} orphaned={} pending={} layouts={} per_instance={:?} per_pool={:?}",
        s.keys,
        s.page_bytes,
        s.value_bytes,
        s.key_bytes,
        s.pins,
        s.pinned_keys,
        s.sessions,
        s.instances,
        s.regions,
        s.region_bytes,
        s.orphaned_regions,
        s.pending_region_requests,
        s.layouts,
        s.per_instance,
        s.per_pool
            .iter()
            .map(|p| (
                p.pool,
                p.regions,
                p.region_bytes,
                p.orphaned_regions,
                p.keys,
                p.used_bytes
            ))
            .collect::<Vec<_>>()
    )
}

/// Polls `cond` every 10 ms until it holds or `timeout` passes.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A session with one region: (client, region id).
pub fn session_with_region(server: &cxlkv::server::ServerHandle, instance: &str) -> (Raw, u64) {
    let mut c = Raw::connect_unix(server.socket_path());
    c.hello(instance).0.expect("welcome");
    let region = c.request_region(0).expect("a region").desc.region;
    (c, region)
}

/// The transport backends every server test runs on: the default (io_uring
/// where the kernel allows it) and the epoll fallback.
pub fn backends() -> [cxlkv_controlplane::transport::BackendChoice; 2] {
    use cxlkv_controlplane::transport::BackendChoice;
    [BackendChoice::Auto, BackendChoice::Fallback]
}

/// An ephemeral server configuration on `backend`.
pub fn config_on(
    tag: &str,
    backend: cxlkv_controlplane::transport::BackendChoice,
) -> cxlkv::server::ServerConfig {
    let mut cfg = cxlkv::server::ServerConfig::ephemeral(tag);
    cfg.io.backend = backend;
    cfg
}
