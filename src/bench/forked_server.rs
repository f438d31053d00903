//! A cxlkv server in a forked child process, for benches whose client side
//! must not share a process (its scheduler accounting, its allocator) with
//! the server, as in a real deployment.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;

use super::pool_target::{BenchPool, PoolGuard};
use super::rtt::{Child, fork_child};
use crate::server::{PoolManagerConfig, Server, ServerConfig};

/// How long the child may take to listen.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// The running child; killed (and its socket, its pool file if temporary,
/// and its pool-manager state removed) on drop.
pub(super) struct ForkedServer {
    child: Option<Child>,
    socket: PathBuf,
    pool: PathBuf,
    /// False for the operator's `--pool`, which is never removed.
    remove_pool: bool,
    /// Keeps a `--pool` server's temporary state directory.
    _pool_guard: PoolGuard,
    /// The embedded pool manager's state (none with a remote one).
    state_dir: Option<PathBuf>,
    /// What the child reported once listening.
    backend: String,
    tcp_addr: Option<SocketAddr>,
}

impl ForkedServer {
    /// Forks a child that runs `Server::start(cfg)` on `target`'s pool
    /// ([`BenchPool::configure`]) until killed, and waits until its socket
    /// accepts connections. The calling process must be single-threaded
    /// (see `fork_child`).
    pub fn start(mut cfg: ServerConfig, target: &BenchPool) -> anyhow::Result<Self> {
        let pool_guard = target.configure(&mut cfg)?;
        let remove_pool = cfg.remove_pool_on_shutdown;
        let socket = cfg.socket_path.clone();
        let pool = cfg.pool_path.clone();
        let state_dir = match cfg.pool_manager_config() {
            PoolManagerConfig::Embedded(service) => Some(service.state_dir),
            _ => None,
        };
        // The child reports "<backend> <tcp address or ->" on this pipe once
        // it listens (or closes it having failed): the parent learns what it
        // cannot see from its side of the fork, such as a port picked by the
        // kernel.
        let (reader, mut writer) = std::io::pipe().context("pipe to the forked server")?;
        let child = fork_child(move || match Server::start(cfg) {
            Ok(running) => {
                let tcp = running
                    .tcp_addr()
                    .map_or_else(|| "-".to_owned(), |a| a.to_string());
                let _ = writeln!(writer, "{} {tcp}", running.backend());
                drop(writer);
                loop {
                    std::thread::sleep(Duration::from_secs(3600));
                }
            }
            Err(e) => eprintln!("forked server: {e}"),
        })?;
        let mut server = Self {
            child: Some(child),
            socket,
            pool,
            remove_pool,
            _pool_guard: pool_guard,
            state_dir,
            backend: String::new(),
            tcp_addr: None,
        };
        // The write end lives on in the child only (it was moved into the
        // closure, which this process dropped unrun): EOF means the child
        // exited without reporting.
        let mut line = String::new();
        let (tx, rx) = std::sync::mpsc::channel();
        // A reader thread bounds the wait; it is joined (by the channel's
        // close) before this function returns, so the bench is
        // single-threaded again for its next fork.
        let reading = std::thread::spawn(move || {
            let mut r = BufReader::new(reader);
            let n = r.read_line(&mut line);
            let _ = tx.send(n.map(|_| line));
        });
        let reported = rx.recv_timeout(START_TIMEOUT);
        if reported.is_err() {
            // Unblock the reader: killing the child closes the write end.
            drop(server.child.take());
        }
        let _ = reading.join();
        let line = reported
            .map_err(|_| {
                anyhow::anyhow!(
                    "the forked server did not start within {} s",
                    START_TIMEOUT.as_secs()
                )
            })?
            .context("read the forked server's report")?;
        let mut fields = line.split_whitespace();
        let (Some(backend), Some(tcp)) = (fields.next(), fields.next()) else {
            anyhow::bail!("the forked server failed to start (see its error above)");
        };
        server.backend = backend.to_owned();
        server.tcp_addr = match tcp {
            "-" => None,
            a => Some(a.parse().context("the forked server's TCP address")?),
        };
        Ok(server)
    }

    /// The transport backend the server runs on.
    pub fn backend(&self) -> &str {
        &self.backend
    }

    /// Where it listens on TCP, if it does.
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp_addr
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }
}

impl Drop for ForkedServer {
    fn drop(&mut self) {
        drop(self.child.take());
        let _ = std::fs::remove_file(&self.socket);
        if self.remove_pool {
            let _ = std::fs::remove_file(&self.pool);
        }
        if let Some(dir) = &self.state_dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// `ServerConfig::ephemeral` for a bench, with the directory's instance
/// grace shortened so closed clients' regions go back quickly.
pub(super) fn bench_config(tag: &str, pool_size_bytes: u64) -> ServerConfig {
    let mut cfg = ServerConfig::ephemeral(tag);
    cfg.pool_size_bytes = pool_size_bytes;
    cfg.directory.instance_grace = Duration::from_millis(500);
    cfg
}

/// Bound on waiting for a forked peer's message.
pub(super) const PEER_TIMEOUT: Duration = Duration::from_secs(60);

/// Checksum that reads every byte once: a wrapping sum of little-endian
/// words (the tail, if any, as one zero-padded word).
pub(crate) fn checksum(bytes: &[u8]) -> u64 {
    let words = bytes.chunks_exact(8);
    let tail = words.remainder();
    let mut sum = words.fold(0u64, |acc, w| {
        let mut b = [0u8; 8];
        b.copy_from_slice(w);
        acc.wrapping_add(u64::from_le_bytes(b))
    });
    if !tail.is_empty() {
        let mut b = [0u8; 8];
        b[..tail.len()].copy_from_slice(tail);
        sum = sum.wrapping_add(u64::from_le_bytes(b));
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::checksum;

    #[test]
    fn the_checksum_covers_every_byte_including_the_tail() {
        let a = vec![1u8; 17];
        let mut b = a.clone();
        b[16] = 2;
        assert_ne!(checksum(&a), checksum(&b));
        b[16] = 1;
        b[3] = 9;
        assert_ne!(checksum(&a), checksum(&b));
        assert_eq!(checksum(&[]), 0);
    }
}
