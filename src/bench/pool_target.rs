//! Which pool a scenario measures on: `--pool PATH`, or the embedded
//! default.
//!
//! Without `--pool`, every server a scenario starts gets the embedded
//! default of [`ServerConfig::ephemeral`]: a private temporary file under
//! `/dev/shm`, removed afterwards. With `--pool PATH` — a `/dev/daxX.Y`
//! device, or a file on hugetlbfs, tmpfs or a DAX file system — every server
//! (and pool daemon) a scenario starts serves that pool instead, so that a
//! run on a CXL device measures the device and not DRAM.
//!
//! **The bench owns the pool for the run** (`scripts/hwbench.sh` warns
//! about it). A pool manager refuses a pool that another state directory
//! has served, and each server here gets a fresh temporary state directory;
//! `bench copy` overwrites the first bytes outright. So before each server
//! starts, [`BenchPool::prepare`] zeroes the pool's header block (its first
//! alignment unit) and the server initialises it as a new pool. A pool
//! whose file lock is held — a running cxlkv pool manager on this host — is
//! refused. The pool is never removed or truncated: a file shorter than a
//! scenario needs is grown (as `cxlkv serve` does), a device too small is
//! refused with the sizes. Its pool manager's state directory is a
//! temporary directory under `/dev/shm` (a device's default, `<path>.state`,
//! would be under `/dev`).
//!
//! Every record says what it was measured on: `pool` (the path, or
//! `default`) and `dest` (`shm`, `hugetlb`, `devdax` or `file`, the same
//! names as the `copy` cases).

use std::path::{Path, PathBuf};

use anyhow::Context;
use cxlkv_controlplane::pool::fence::PoolFileLock;

use super::Record;
use crate::cli::BenchArgs;
use crate::dataplane::backing::{self, Backing, BackingKind, Extent, OpenOptions};
use crate::dataplane::ids::{PageIndex, RegionId};
use crate::dataplane::map::{MapObservers, MappedRegion, Populate};
use crate::dataplane::visibility::{self, Visibility};
use crate::server::{PoolManagerConfig, ServerConfig};

/// The `pool` field of records measured on the embedded default.
pub const DEFAULT_POOL_LABEL: &str = "default";

/// The `dest` name of a backing kind (also the `copy` cases' `dest=`).
pub fn dest_name(kind: BackingKind) -> &'static str {
    match kind {
        BackingKind::Tmpfs => "shm",
        BackingKind::Hugetlbfs => "hugetlb",
        other => other.as_str(),
    }
}

/// The pool a scenario measures on (module docs).
#[derive(Debug, Clone)]
pub struct BenchPool {
    /// `None`: the embedded default (a temporary `/dev/shm` file per server).
    path: Option<PathBuf>,
    kind: BackingKind,
}

/// Keeps what [`BenchPool::configure`] set up (the pool manager's
/// temporary state directory) until the server is gone.
#[derive(Debug)]
#[must_use = "the state directory is removed when this is dropped"]
pub struct PoolGuard {
    _state_dir: Option<tempfile::TempDir>,
}

impl BenchPool {
    /// `--pool` if given (opened once to learn its kind), else the default.
    pub fn from_args(args: &BenchArgs) -> anyhow::Result<Self> {
        match &args.pool {
            None => Ok(Self::embedded_default()),
            Some(path) => {
                // A file made with `touch` (or truncated to nothing) cannot
                // be opened as a pool to learn its kind: say how to size it.
                if let Ok(meta) = std::fs::metadata(path)
                    && meta.is_file()
                    && meta.len() == 0
                {
                    anyhow::bail!(
                        "--pool {0} is an empty file: give it a size first, e.g. \
                         `truncate -s 8G {0}` (on hugetlbfs, with that many 2 MiB huge pages \
                         reserved: scripts/setup-hugepages.sh reserve N)",
                        path.display()
                    );
                }
                let backing = backing::open(path, &OpenOptions::new())
                    .with_context(|| format!("opening --pool {}", path.display()))?;
                Ok(Self {
                    path: Some(path.clone()),
                    kind: backing.kind(),
                })
            }
        }
    }

    /// The embedded default: a temporary `/dev/shm` file per server.
    pub fn embedded_default() -> Self {
        Self {
            path: None,
            kind: BackingKind::Tmpfs,
        }
    }

    /// The operator's pool, if `--pool` was given.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    pub fn dest(&self) -> &'static str {
        dest_name(self.kind)
    }

    /// The `pool` field: the path, or [`DEFAULT_POOL_LABEL`].
    pub fn label(&self) -> String {
        self.path.as_ref().map_or_else(
            || DEFAULT_POOL_LABEL.to_owned(),
            |p| p.display().to_string(),
        )
    }

    /// Adds the `pool` and `dest` fields.
    pub fn tag(&self, record: Record) -> Record {
        record.with("pool", self.label()).with("dest", self.dest())
    }

    /// Points `cfg` (whose `pool_size_bytes` is already what the scenario
    /// needs) at this pool: nothing to do for the default; for `--pool`, the
    /// pool prepared ([`Self::prepare`]), never removed on shutdown, and a
    /// temporary state directory, kept until the guard drops.
    pub fn configure(&self, cfg: &mut ServerConfig) -> anyhow::Result<PoolGuard> {
        let Some(path) = &self.path else {
            return Ok(PoolGuard { _state_dir: None });
        };
        self.prepare(cfg.pool_size_bytes)?;
        let state_dir = tempfile::Builder::new()
            // Named after this process, as every entry of the bench's: what
            // a killed bench left is removed by the next one (`stale`).
            .prefix(&format!("cxlkv-bench-state-{}-", std::process::id()))
            .tempdir_in(backing::DEFAULT_POOL_DIR)
            .context("creating a temporary pool-manager state directory")?;
        cfg.pool_path = path.clone();
        cfg.remove_pool_on_shutdown = false;
        let PoolManagerConfig::Embedded(mut service) = cfg.pool_manager_config() else {
            anyhow::bail!("a bench server embeds its pool manager");
        };
        service.state_dir = state_dir.path().to_owned();
        // A short lease: the next server on this pool (the next scenario's)
        // waits it out (`wait_out_lease`) rather than 10 s.
        service.lease_ms = BENCH_LEASE_MS;
        cfg.pool_manager = Some(PoolManagerConfig::Embedded(service));
        Ok(PoolGuard {
            _state_dir: Some(state_dir),
        })
    }

    /// Refuses the operator's pool if a pool manager on this host holds its
    /// file lock (it serves a live pool). The lock is taken and released at
    /// once: a server started later must be able to take it, and a forked
    /// child would inherit it.
    pub fn check_unused(&self) -> anyhow::Result<()> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        drop(PoolFileLock::acquire(path).with_context(|| {
            format!(
                "--pool {}: refusing to write into a pool in use",
                path.display()
            )
        })?);
        Ok(())
    }

    /// Makes the operator's pool ready for a new pool manager that needs
    /// `size_bytes`: refused if a pool manager on this host holds it or a
    /// device is too small; a file grown to `size_bytes` if shorter; its
    /// header block zeroed (module docs). Nothing to do for the default.
    pub fn prepare(&self, size_bytes: u64) -> anyhow::Result<()> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        // Held until the header is zeroed: a pool manager of this host
        // starting meanwhile waits for it (`check_unused` only looks).
        let _lock = PoolFileLock::acquire(path).with_context(|| {
            format!(
                "--pool {}: refusing to write into a pool in use",
                path.display()
            )
        })?;
        let mut options = OpenOptions::new();
        if self.kind != BackingKind::DevDax {
            options = options.create_size_bytes(size_bytes);
        }
        let pool = backing::open(path, &options)
            .with_context(|| format!("opening --pool {}", path.display()))?;
        anyhow::ensure!(
            pool.size_bytes() >= size_bytes,
            "--pool {} holds {} MiB; this scenario needs {} MiB",
            path.display(),
            pool.size_bytes() >> 20,
            size_bytes.div_ceil(1 << 20)
        );
        wait_out_lease(&*pool)?;
        zero_header_block(&*pool)
    }
}

/// The lease of the pool managers the bench starts on `--pool`.
pub(super) const BENCH_LEASE_MS: u64 = 1_000;

/// Longest lease [`wait_out_lease`] waits to expire (a bench server's,
/// 10 s by default, left by the scenario before).
const MAX_LEASE_WAIT_MS: u64 = 15_000;

/// Set to `1` to erase a pool whose header shows a live lease.
pub const DESTROY_POOL_ENV: &str = "CXLKV_BENCH_DESTROY_POOL";

/// Refuses a pool a pool manager serves, on this host or another (a device
/// shared over CXL holds no lock here): its header's lease is renewed. A
/// lease nobody renews — left by a server that stopped, such as the
/// previous scenario's — is waited out.
fn wait_out_lease(pool: &dyn Backing) -> anyhow::Result<()> {
    if std::env::var(DESTROY_POOL_ENV).is_ok_and(|v| v == "1") {
        return Ok(());
    }
    let mut waited_for: Option<u64> = None;
    loop {
        let Some(lease) = read_lease(pool)? else {
            return Ok(());
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        if now >= lease.expires_unix_ms {
            return Ok(());
        }
        let left = lease.expires_unix_ms - now;
        if waited_for.is_some_and(|seq| seq != lease.seq) || left > MAX_LEASE_WAIT_MS {
            anyhow::bail!(
                "--pool {}: a pool manager ({}, epoch {}) holds a lease on it, {} \
                 (expires in {left} ms): it is in use, perhaps from another host. Stop it \
                 first, or set {DESTROY_POOL_ENV}=1 to erase the pool anyway",
                pool.path().display(),
                lease.holder,
                lease.epoch,
                if waited_for.is_some() {
                    "renewed while the bench waited"
                } else {
                    "longer than the bench waits"
                }
            );
        }
        waited_for = Some(lease.seq);
        std::thread::sleep(std::time::Duration::from_millis(left + 50));
    }
}

/// The lease in `pool`'s header, if it holds a valid header with one (read
/// as a client reads a pool's identity header).
fn read_lease(
    pool: &dyn Backing,
) -> anyhow::Result<Option<cxlkv_controlplane::pool::ManagerLease>> {
    use cxlkv_controlplane::pool::header::{self, BlockState};
    let bytes = crate::client::pools::read_header_block(pool, Visibility::Flush)
        .with_context(|| format!("reading the header of {}", pool.path().display()))?;
    Ok(match header::decode(&bytes) {
        Ok(BlockState::Initialised(h)) => h.lease,
        // Fresh, or not a cxlkv header (`copy` overwrote it): no lease.
        _ => None,
    })
}

/// Zeroes the first alignment unit of `pool` (where a pool manager keeps
/// its header) and writes it back to memory.
fn zero_header_block(pool: &dyn Backing) -> anyhow::Result<()> {
    let align = pool.align_bytes();
    let len = usize::try_from(align).context("the pool alignment fits in memory")?;
    // SAFETY: the operator handed this pool to the bench (module docs) and
    // no pool manager holds it (its lock was free just now); this process
    // maps the header block once, here, and writes it through one view.
    let block = unsafe {
        MappedRegion::map(
            pool,
            RegionId(0),
            Extent::new(0, align),
            Populate::Lazy,
            &MapObservers::new(),
        )
    }
    .with_context(|| format!("mapping the header block of {}", pool.path().display()))?;
    // SAFETY: the only view of the block (see above).
    let mut view = unsafe { block.page_mut(len, PageIndex(0), len) }?;
    view.as_mut_bytes().fill(0);
    // Written back for a device another host may read without coherence,
    // as a pool manager's own header writes are.
    visibility::publish(Visibility::Flush, view.as_bytes());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool file whose header says manager `holder` leases it until
    /// `expires_unix_ms` (lease write `seq`).
    fn lease_in(path: &Path, seq: u64, expires_unix_ms: u64) {
        use cxlkv_controlplane::pool::header;
        use cxlkv_controlplane::pool::{ManagerId, ManagerLease, PoolIdentity, PoolUuid};
        let align = backing::DEFAULT_ALIGN_BYTES;
        let mut block = vec![0u8; align as usize];
        let identity = PoolIdentity {
            uuid: PoolUuid([7; 16]),
            size_bytes: 4 * align,
            alignment_bytes: align,
        };
        header::encode_identity(&mut block, &identity).unwrap();
        let lease = ManagerLease {
            seq,
            epoch: 1,
            expires_unix_ms,
            holder: ManagerId([9; 16]),
        };
        header::write_lease(&mut block, &lease).unwrap();
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        f.write_all_at(&block, 0).unwrap();
    }

    fn unix_ms() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    }

    /// A device shared over CXL holds no lock on this host: the header's
    /// lease tells whether a pool manager serves it. A lease left behind is
    /// waited out; one renewed meanwhile (or too long) is refused.
    #[test]
    fn a_pool_whose_lease_is_renewed_is_refused_and_one_left_behind_is_waited_out() {
        let dir = tempfile::tempdir_in(backing::DEFAULT_POOL_DIR).unwrap();
        let path = dir.path().join("pool");
        let size = 4 * backing::DEFAULT_ALIGN_BYTES;
        std::fs::write(&path, vec![0u8; size as usize]).unwrap();
        let target = BenchPool {
            path: Some(path.clone()),
            kind: BackingKind::Tmpfs,
        };
        lease_in(&path, 1, unix_ms() + 300);
        target
            .prepare(size)
            .expect("a lease nobody renews is waited out");

        lease_in(&path, 1, unix_ms() + 60_000);
        let e = target.prepare(size).unwrap_err().to_string();
        assert!(e.contains("longer than the bench waits"), "{e}");

        // Renewed well before the first lease expires (900 ms of slack).
        lease_in(&path, 1, unix_ms() + 1_000);
        let renewer = {
            let path = path.clone();
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(100));
                lease_in(&path, 2, unix_ms() + 5_000);
            })
        };
        let e = target.prepare(size).unwrap_err().to_string();
        renewer.join().unwrap();
        assert!(e.contains("renewed while the bench waited"), "{e}");
    }

    #[test]
    fn dest_names_match_the_copy_cases() {
        assert_eq!(dest_name(BackingKind::Tmpfs), "shm");
        assert_eq!(dest_name(BackingKind::Hugetlbfs), "hugetlb");
        assert_eq!(dest_name(BackingKind::DevDax), "devdax");
        assert_eq!(dest_name(BackingKind::OtherFile), "file");
    }

    #[test]
    fn a_served_pool_file_is_made_fresh_and_a_locked_one_is_refused() {
        let dir = tempfile::tempdir_in(backing::DEFAULT_POOL_DIR).unwrap();
        let path = dir.path().join("pool");
        let size = 4 * backing::DEFAULT_ALIGN_BYTES;
        std::fs::write(&path, vec![0xA5u8; size as usize]).unwrap();
        let target = BenchPool {
            path: Some(path.clone()),
            kind: BackingKind::Tmpfs,
        };
        target.prepare(size).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let align = backing::DEFAULT_ALIGN_BYTES as usize;
        assert!(
            bytes[..align].iter().all(|&b| b == 0),
            "header block zeroed"
        );
        assert!(
            bytes[align..].iter().all(|&b| b == 0xA5),
            "the rest untouched"
        );
        let held = PoolFileLock::acquire(&path).unwrap();
        assert!(target.prepare(size).is_err(), "a held pool is refused");
        drop(held);
        assert!(target.prepare(8 * size).is_ok(), "a short file is grown");
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 8 * size);
    }
}
