//! The pool file under the pool service: what an existing file's header
//! allows at open (never resized once initialised, a lost header of a known
//! pool refused), and a file truncated while it is served (a client holds a
//! writable descriptor) taking that pool offline without stopping the
//! service.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

use cxlkv_controlplane::pool::header::{self, BlockState};
use cxlkv_controlplane::pool::service::pools::OpenError;
use cxlkv_controlplane::pool::service::{
    LocalPool, PoolCore, PoolReply, PoolRequest, PoolService, PoolSpec, ServiceConfig,
    ServiceError, TcpAuth,
};
use cxlkv_controlplane::pool::{StoreConfig, SyncPolicy};
use cxlkv_controlplane::proto::ErrorCode;

const TIMEOUT: Duration = Duration::from_secs(30);
/// Bound on every wait for something the service does on a timer.
const EVENTUALLY: Duration = Duration::from_secs(60);
const MIB: u64 = 1 << 20;
const ALIGN: u64 = 4096;

fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("cxlkv-poolfile-{name}-"))
        .tempdir_in("/dev/shm")
        .expect("a temporary directory under /dev/shm")
}

fn config(dir: &Path, size_bytes: Option<u64>, align_bytes: u64) -> ServiceConfig {
    ServiceConfig {
        pools: vec![PoolSpec {
            path: dir.join("pool"),
            create_size_bytes: size_bytes,
            align_bytes: Some(align_bytes),
            visibility: None,
        }],
        state_dir: dir.join("state"),
        store: StoreConfig {
            sync: SyncPolicy::PerRecord,
            checkpoint_every_records: 64,
        },
        grace_ms: 60_000,
        lease_ms: 10_000,
        pass_fds: false,
        tcp_auth: TcpAuth::Disabled,
        io_faults: Default::default(),
    }
}

fn alloc() -> PoolRequest {
    PoolRequest::Alloc {
        pool: None,
        len_bytes: 1,
        instance_id: "i".into(),
    }
}

fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < EVENTUALLY, "gave up waiting for: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Serves `cfg`, allocates one region, and stops cleanly.
fn serve_once(cfg: ServiceConfig) {
    let core = PoolCore::start(cfg).expect("the pool service starts");
    let (pool, _) = core.attach_local("dir-a", TIMEOUT).expect("attach");
    assert!(matches!(
        pool.call(alloc(), TIMEOUT),
        Ok(PoolReply::Allocated(_))
    ));
    drop(pool);
    core.shutdown().expect("clean shutdown");
}

fn open_error(cfg: ServiceConfig) -> OpenError {
    match PoolCore::start(cfg) {
        Err(ServiceError::Pool(e)) => e,
        Err(other) => panic!("expected a pool refusal, got {other}"),
        Ok(_) => panic!("expected a pool refusal, the service started"),
    }
}

/// Truncates the served `pool_path` to zero, as a client holding its
/// descriptor can: the pool goes offline (allocations answer
/// `OutOfSpace`) and, several renewal periods later, the core still runs.
fn truncate_and_see_the_pool_go_offline(core: &PoolCore, pool: &LocalPool, pool_path: &Path) {
    OpenOptions::new()
        .write(true)
        .open(pool_path)
        .and_then(|f| f.set_len(0))
        .expect("truncate the served pool file");
    eventually("the pool to go offline", || {
        pool.call(alloc(), TIMEOUT)
            .is_err_and(|e| e.error_code() == Some(ErrorCode::OutOfSpace))
    });
    std::thread::sleep(Duration::from_millis(400));
    assert!(core.is_running(), "the core did not stop");
}

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).expect("stat the pool file").len()
}

fn first_bytes(path: &Path) -> Vec<u8> {
    let mut b = vec![0u8; header::HEADER_BYTES];
    File::open(path)
        .and_then(|f| f.read_exact_at(&mut b, 0))
        .expect("read the pool header");
    b
}

/// `size=16MiB`, then `size=32MiB`: the second start used to grow the file
/// first and then refuse its header, leaving a pool no size could open.
/// Now it refuses before touching the file, naming both sizes, and the pool
/// opens again at its size, or with no size at all.
#[test]
fn an_initialised_pool_asked_to_grow_is_refused_and_left_as_it_is() {
    let dir = temp_dir("grow");
    let pool_path = dir.path().join("pool");
    serve_once(config(dir.path(), Some(16 * MIB), ALIGN));
    let before = first_bytes(&pool_path);

    let e = open_error(config(dir.path(), Some(32 * MIB), ALIGN));
    assert!(
        matches!(e, OpenError::SizeChanged { initialised_bytes, requested_bytes, .. }
            if initialised_bytes == 16 * MIB && requested_bytes == 32 * MIB),
        "{e}"
    );
    let msg = e.to_string();
    for needle in [
        "16777216",
        "33554432",
        "left as it is",
        "size_bytes = 16777216",
    ] {
        assert!(msg.contains(needle), "{needle:?} missing from: {msg}");
    }
    assert_eq!(file_len(&pool_path), 16 * MIB, "the file was not grown");
    assert_eq!(first_bytes(&pool_path), before, "nor written");

    // A larger alignment would round the size up: refused the same way.
    let e = open_error(config(dir.path(), Some(16 * MIB), 2 * MIB));
    assert!(
        matches!(e, OpenError::AlignmentChanged { initialised_bytes, requested_bytes, .. }
            if initialised_bytes == ALIGN && requested_bytes == 2 * MIB),
        "{e}"
    );
    assert_eq!(file_len(&pool_path), 16 * MIB);

    // Its own size, a smaller one (files are never shrunk) or none: served.
    serve_once(config(dir.path(), Some(16 * MIB), ALIGN));
    serve_once(config(dir.path(), Some(MIB), ALIGN));
    serve_once(config(dir.path(), None, ALIGN));
    assert_eq!(file_len(&pool_path), 16 * MIB);
}

/// A file grown after initialisation (by hand, or by an older build) is
/// refused with the `truncate` that puts it back; after it, it is served.
#[test]
fn a_file_grown_past_its_header_is_refused_with_the_truncate_that_fixes_it() {
    let dir = temp_dir("grown");
    let pool_path = dir.path().join("pool");
    serve_once(config(dir.path(), Some(16 * MIB), ALIGN));
    File::options()
        .write(true)
        .open(&pool_path)
        .and_then(|f| f.set_len(32 * MIB))
        .expect("grow the file by hand");
    let e = open_error(config(dir.path(), None, ALIGN));
    assert!(
        matches!(e, OpenError::FileGrown { initialised_bytes, file_bytes, .. }
            if initialised_bytes == 16 * MIB && file_bytes == 32 * MIB),
        "{e}"
    );
    let hint = format!("truncate -s {} {}", 16 * MIB, pool_path.display());
    assert!(e.to_string().contains(&hint), "{e}");
    File::options()
        .write(true)
        .open(&pool_path)
        .and_then(|f| f.set_len(16 * MIB))
        .expect("the advised truncate");
    serve_once(config(dir.path(), None, ALIGN));
}

/// A client holds the pool descriptor read-write and truncates the file
/// while it is served. The manager used to die of `SIGBUS` at the next
/// lease renewal (its header block was mapped); now the renewal's read
/// fails, the pool goes offline (allocations fail with `OutOfSpace`, as
/// after a lost lease) and the service keeps running and stops cleanly.
#[test]
fn a_truncated_pool_file_takes_the_pool_offline_and_the_service_survives() {
    let dir = temp_dir("truncate");
    let pool_path = dir.path().join("pool");
    let mut cfg = config(dir.path(), Some(16 * MIB), ALIGN);
    cfg.lease_ms = 300;
    let core = PoolCore::start(cfg).expect("the pool service starts");
    let (pool, _) = core.attach_local("dir-a", TIMEOUT).expect("attach");
    assert!(matches!(
        pool.call(alloc(), TIMEOUT),
        Ok(PoolReply::Allocated(_))
    ));
    truncate_and_see_the_pool_go_offline(&core, &pool, &pool_path);
    assert!(matches!(
        pool.call(PoolRequest::Stats, TIMEOUT),
        Ok(PoolReply::Stats(_))
    ));
    assert_eq!(file_len(&pool_path), 0, "the truncated file is not written");
    drop(pool);
    core.shutdown().expect("clean shutdown");
}

/// After the truncation above, a restart used to find an all-zero header
/// and initialise a brand-new pool at that path, while the ledger still
/// held the old pool's regions. Now the path is known to belong to that
/// pool: a zeroed, truncated or missing file is refused, and not written.
#[test]
fn a_restart_on_a_lost_header_of_a_known_pool_is_refused() {
    let dir = temp_dir("lost");
    let pool_path = dir.path().join("pool");
    serve_once(config(dir.path(), Some(16 * MIB), ALIGN));

    // Zeroed in place.
    File::options()
        .write(true)
        .open(&pool_path)
        .and_then(|f| f.write_all_at(&vec![0u8; ALIGN as usize], 0))
        .expect("wipe the header block");
    let e = open_error(config(dir.path(), Some(16 * MIB), ALIGN));
    assert!(matches!(e, OpenError::KnownPoolLost { .. }), "{e}");
    assert!(e.to_string().contains("all zero"), "{e}");
    assert!(
        first_bytes(&pool_path).iter().all(|&b| b == 0),
        "no identity was written"
    );

    // Truncated to nothing: not grown back either.
    File::options()
        .write(true)
        .open(&pool_path)
        .and_then(|f| f.set_len(0))
        .expect("truncate");
    let e = open_error(config(dir.path(), Some(16 * MIB), ALIGN));
    assert!(matches!(e, OpenError::KnownPoolLost { .. }), "{e}");
    assert_eq!(file_len(&pool_path), 0, "the file was not sized");

    // Deleted: not created again.
    std::fs::remove_file(&pool_path).expect("delete the pool file");
    let e = open_error(config(dir.path(), Some(16 * MIB), ALIGN));
    assert!(
        matches!(e, OpenError::KnownPoolLost { what, .. } if what.contains("missing")),
        "{e}"
    );
    assert!(!pool_path.exists(), "the file was not created");
    assert!(e.to_string().contains("new state directory"), "{e}");

    // A new state directory starts afresh on a new file.
    let mut fresh = config(dir.path(), Some(16 * MIB), ALIGN);
    fresh.state_dir = dir.path().join("state2");
    serve_once(fresh);
    assert!(matches!(
        header::decode(&first_bytes(&pool_path)),
        Ok(BlockState::Initialised(_))
    ));
}

/// A hugetlbfs mount on a temporary directory, unmounted on drop.
struct HugetlbfsMount(tempfile::TempDir);

impl HugetlbfsMount {
    fn new() -> std::io::Result<Self> {
        let dir = tempfile::tempdir()?;
        let target = std::ffi::CString::new(dir.path().as_os_str().as_encoded_bytes())?;
        // SAFETY: all arguments are valid NUL-terminated strings for the
        // duration of the call.
        let rc = unsafe {
            libc::mount(
                c"none".as_ptr(),
                target.as_ptr(),
                c"hugetlbfs".as_ptr(),
                0,
                c"pagesize=2M".as_ptr().cast(),
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self(dir))
    }
}

impl Drop for HugetlbfsMount {
    fn drop(&mut self) {
        if let Ok(target) = std::ffi::CString::new(self.0.path().as_os_str().as_encoded_bytes()) {
            // SAFETY: `target` is a valid NUL-terminated string; a lazy
            // unmount of our own mount point affects nothing else.
            unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
        }
    }
}

/// The same on hugetlbfs, which refuses `write(2)`: the header is written
/// through a mapping there, by a kernel copy that fails instead of faulting.
#[test]
fn a_truncated_hugetlbfs_pool_takes_the_pool_offline_and_the_service_survives() {
    use cxlkv_dataplane::hugepages::HugePageReservation;
    // Declared first, dropped last: the pages go back after the unmount.
    let _reservation = match HugePageReservation::reserve(2, Duration::from_secs(60)) {
        Ok(r) => r,
        Err(err) => {
            eprintln!("skipping hugetlbfs test: no huge pages can be reserved: {err:?}");
            return;
        }
    };
    let mount = match HugetlbfsMount::new() {
        Ok(m) => m,
        Err(err) => {
            eprintln!("skipping hugetlbfs test: cannot mount hugetlbfs: {err}");
            return;
        }
    };
    let state = temp_dir("huge");
    let pool_path = mount.0.path().join("pool");
    let mut cfg = config(state.path(), Some(4 * MIB), 2 * MIB);
    cfg.pools[0].path = pool_path.clone();
    cfg.lease_ms = 300;
    let core = PoolCore::start(cfg).expect("the pool service starts on hugetlbfs");
    let (pool, _) = core.attach_local("dir-a", TIMEOUT).expect("attach");
    assert!(matches!(
        pool.call(alloc(), TIMEOUT),
        Ok(PoolReply::Allocated(_))
    ));
    eventually("a lease renewal", || {
        header::decode(&first_bytes(&pool_path))
            .ok()
            .and_then(|s| match s {
                BlockState::Initialised(h) => h.lease,
                BlockState::Fresh => None,
            })
            .is_some_and(|l| l.seq > 2)
    });
    truncate_and_see_the_pool_go_offline(&core, &pool, &pool_path);
    drop(pool);
    core.shutdown().expect("clean shutdown");
    std::fs::remove_file(&pool_path).expect("free the pool's huge pages");
    drop(mount);
}
