//! The transfer baseline: the chunks an instance reads in place, fetched
//! instead over loopback TCP from the instance that wrote them — what a
//! design without shared memory does (the writer sends its bytes, the
//! reader receives them into memory it owns).
//!
//! Every instance runs a [`ChunkServer`] that serves the chunks it wrote.
//! It serves them from its own pinned views of its pool pages (taken right
//! after writing, outside any timed section), so the sender copies the very
//! bytes the in-place readers read and no lookup is on the baseline's path.
//!
//! Wire format, per chunk: request `[u32 LE key length][key]`; answer
//! `[u64 LE length][bytes]`, length 0 when the server does not hold the key
//! (yet: a reader can learn a key from the directory a moment before its
//! writer publishes the view here). A reader pipelines all requests to one
//! writer, then reads the answers in order.

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use parking_lot::Mutex;

use crate::client::ReadGuard;
use cxlkv_controlplane::proto::MAX_KEY_BYTES;

/// Bound on one blocking socket read or write (and on connecting).
const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// The chunks an instance serves, by key: views of its own pool pages.
pub type Served = Arc<Mutex<HashMap<Vec<u8>, Arc<ReadGuard>>>>;

/// A listening chunk server (its threads live until the process exits).
#[derive(Debug)]
pub struct ChunkServer {
    port: u16,
}

impl ChunkServer {
    /// Listens on an ephemeral loopback port and serves up to
    /// `max_connections` connections (one per peer instance), each on its
    /// own thread.
    pub fn start(served: Served, max_connections: usize) -> anyhow::Result<Self> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("binding loopback")?;
        let port = listener.local_addr()?.port();
        std::thread::Builder::new()
            .name("demo-tcp-accept".into())
            .spawn(move || {
                for stream in listener.incoming().take(max_connections) {
                    let served = Arc::clone(&served);
                    let spawned = stream.map(|s| {
                        std::thread::Builder::new()
                            .name("demo-tcp-serve".into())
                            .spawn(move || {
                                if let Err(e) = serve_connection(s, &served) {
                                    tracing::warn!(error = %e, "demo chunk server: connection failed");
                                }
                            })
                    });
                    if let Err(e) = spawned {
                        tracing::warn!(error = %e, "demo chunk server: cannot accept");
                    }
                }
            })
            .context("starting the chunk server")?;
        Ok(Self { port })
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}

/// Answers requests until the peer closes the connection.
fn serve_connection(stream: TcpStream, served: &Served) -> anyhow::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut rx = BufReader::new(stream.try_clone()?);
    let mut tx = BufWriter::new(stream);
    let mut key = Vec::with_capacity(MAX_KEY_BYTES);
    loop {
        let mut len = [0u8; 4];
        match rx.read_exact(&mut len) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let len = u32::from_le_bytes(len) as usize;
        anyhow::ensure!(
            (1..=MAX_KEY_BYTES).contains(&len),
            "a request for a {len}-byte key (1..={MAX_KEY_BYTES})"
        );
        key.resize(len, 0);
        rx.read_exact(&mut key)?;
        let view = served.lock().get(&key).cloned();
        let bytes: &[u8] = view.as_deref().map_or(&[], |g| &g[..]);
        tx.write_all(&(bytes.len() as u64).to_le_bytes())?;
        tx.write_all(bytes)?;
        // Answer now unless the peer's next request is already here (it
        // pipelines a request's chunks): no answer waits behind a read.
        if rx.buffer().is_empty() {
            tx.flush()?;
        }
    }
}

/// A reader's connections to the other instances' chunk servers, opened on
/// first use.
#[derive(Debug)]
pub struct Peers {
    ports: Vec<u16>,
    conns: Vec<Option<(BufWriter<TcpStream>, TcpStream)>>,
}

impl Peers {
    /// `ports[i]`: instance `i`'s chunk server.
    pub fn new(ports: Vec<u16>) -> Self {
        let conns = ports.iter().map(|_| None).collect();
        Self { ports, conns }
    }

    /// Fetches `keys` from instance `owner` into consecutive `chunk_len`-
    /// byte slots of `buf`; returns each key's length (0: not served).
    pub fn fetch(
        &mut self,
        owner: usize,
        keys: &[&[u8]],
        buf: &mut [u8],
        chunk_len: usize,
    ) -> anyhow::Result<Vec<usize>> {
        anyhow::ensure!(
            buf.len() >= keys.len() * chunk_len,
            "a {}-byte buffer for {} chunks of {chunk_len} bytes",
            buf.len(),
            keys.len()
        );
        let (tx, rx) = self.connection(owner)?;
        for key in keys {
            tx.write_all(&(key.len() as u32).to_le_bytes())?;
            tx.write_all(key)?;
        }
        tx.flush()?;
        let mut lens = Vec::with_capacity(keys.len());
        for (key, slot) in keys.iter().zip(buf.chunks_exact_mut(chunk_len)) {
            let mut len = [0u8; 8];
            rx.read_exact(&mut len)?;
            let len = u64::from_le_bytes(len);
            anyhow::ensure!(
                len <= chunk_len as u64,
                "instance {owner} sent {len} bytes for {:?} (chunks are {chunk_len})",
                String::from_utf8_lossy(key)
            );
            let len = len as usize;
            rx.read_exact(&mut slot[..len])?;
            lens.push(len);
        }
        Ok(lens)
    }

    fn connection(
        &mut self,
        owner: usize,
    ) -> anyhow::Result<&mut (BufWriter<TcpStream>, TcpStream)> {
        let port = *self
            .ports
            .get(owner)
            .with_context(|| format!("no instance {owner}"))?;
        let slot = &mut self.conns[owner];
        if slot.is_none() {
            let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
            let s = TcpStream::connect_timeout(&addr, IO_TIMEOUT)
                .with_context(|| format!("connecting to instance {owner} at {addr}"))?;
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(IO_TIMEOUT))?;
            s.set_write_timeout(Some(IO_TIMEOUT))?;
            *slot = Some((BufWriter::new(s.try_clone()?), s));
        }
        Ok(slot.as_mut().expect("invariant: connected just above"))
    }
}
