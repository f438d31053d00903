//! A cxlkv server in a forked child process, for benches whose client side
//! must not share a process (its scheduler accounting, its allocator) with
//! the server, as in a real deployment.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::rtt::{Child, fork_child};
use crate::server::{PoolManagerConfig, Server, ServerConfig};

/// How long the child may take to listen.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// The running child; killed (and its socket, pool file and pool-manager
/// state removed) on drop.
pub(super) struct ForkedServer {
    child: Option<Child>,
    socket: PathBuf,
    pool: PathBuf,
    /// The embedded pool manager's state (none with a remote one).
    state_dir: Option<PathBuf>,
}

impl ForkedServer {
    /// Forks a child that runs `Server::start(cfg)` until killed, and waits
    /// until its socket accepts connections. The calling process must be
    /// single-threaded (see `fork_child`).
    pub fn start(cfg: ServerConfig) -> anyhow::Result<Self> {
        let socket = cfg.socket_path.clone();
        let pool = cfg.pool_path.clone();
        let state_dir = match cfg.pool_manager_config() {
            PoolManagerConfig::Embedded(service) => Some(service.state_dir),
            _ => None,
        };
        let child = fork_child(move || match Server::start(cfg) {
            Ok(_running) => loop {
                std::thread::sleep(Duration::from_secs(3600));
            },
            Err(e) => eprintln!("forked server: {e}"),
        })?;
        let server = Self {
            child: Some(child),
            socket,
            pool,
            state_dir,
        };
        let deadline = Instant::now() + START_TIMEOUT;
        while std::os::unix::net::UnixStream::connect(&server.socket).is_err() {
            anyhow::ensure!(
                Instant::now() < deadline,
                "the forked server did not listen on {} within {} s",
                server.socket.display(),
                START_TIMEOUT.as_secs()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(server)
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }
}

impl Drop for ForkedServer {
    fn drop(&mut self) {
        drop(self.child.take());
        let _ = std::fs::remove_file(&self.socket);
        let _ = std::fs::remove_file(&self.pool);
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
