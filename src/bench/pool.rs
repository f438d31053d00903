//! `cxlkv bench pool`: allocation + free round trips through the pool
//! service, against the same operations on the pool-manager state machine
//! in process, measured in the same run.
//!
//! **Ours**: a real `cxlkv pool` daemon *process* (this binary, started with
//! `pool …`), and `clients` threads of one directory, each on its own Unix
//! connection, each looping `AllocRegion` then `FreeRegion` (one region of
//! the pool alignment). A separate process because that is what `cxlkv pool`
//! is, and because a server thread inside the bench would share the
//! client's process, allocator and scheduler accounting (as in `bench rtt`).
//! Every request is journaled and synced under the case's policy before its
//! reply — that is what is being measured.
//!
//! **Baseline**: one thread drives a `PoolManager` and a `PoolStore` with the
//! same sync policy and checkpoint interval directly, no transport and no
//! threads: per-record commits after every request; group commits after
//! every `clients` requests (the group that `clients` concurrent requesters
//! can form at best). It is what the service costs on top of the state
//! machine and the journal, so `ratio` (ours ÷ baseline, in pairs/s) is
//! expected below 1; the interesting number is how far.
//!
//! **Only the operations are timed**, on both sides: each client's
//! connection and `PoolHello` are made once per case, before the warm-up;
//! each repetition's client threads are spawned and wait at a barrier, and
//! the clock starts when they are released and stops when the last one has
//! finished its pairs.
//!
//! Journals go to temporary directories under `/dev/shm` by default (so
//! `fdatasync` is nearly free and the figures show the service path);
//! `--state-dir DIR` puts them on a real file system to include the sync.
//! The daemon serves `--pool` when given (its header block is zeroed first,
//! see `pool_target`), else a temporary `/dev/shm` file (`pool`, `dest`).
//! The multi-client cases use `--threads` (or `CXLKV_BENCH_THREADS`)
//! clients when set (else 4, 2 with `--quick`; echoed as `threads`).
//! Fields: `ops_per_s` (alloc+free pairs per second, all clients), `p50_us`,
//! `p99_us` (one pair's latency), and the baseline's.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use cxlkv_controlplane::frame::Frame;
use cxlkv_controlplane::pool::header::{self, BlockState};
use cxlkv_controlplane::pool::liveness;
use cxlkv_controlplane::pool::{
    AllocTag, Caller, DirectoryId, InstanceId, ManagerConfig, MonotonicMs, PoolIdentity, PoolStore,
    PoolTarget, PoolUuid, Reply, Request, StoreConfig, SyncPolicy,
};
use cxlkv_controlplane::proto::{
    self, AllocRegion, FreeRegion, Message, OwnerLabel, PoolHello, PoolWelcome, RegionAllocated,
    RegionFreed, RequestMeta,
};
use cxlkv_controlplane::transport::{ClientConfig, Endpoint, RpcClient};
use parking_lot::Mutex;

use super::pool_target::{BENCH_LEASE_MS, BenchPool};
use super::{Better, Record, Reporter, median, percentile};
use crate::cli::BenchArgs;

const SCENARIO: &str = "pool";
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Bound on the daemon's start.
const START_TIMEOUT: Duration = Duration::from_secs(60);
const REGION_BYTES: u64 = 2 << 20;
const POOL_BYTES: u64 = 256 << 20;
const DIRECTORY: &str = "bench-dir";

#[derive(Debug, Clone, Copy)]
struct Case {
    sync: &'static str,
    clients: usize,
}

impl Case {
    fn name(&self) -> String {
        format!("sync={},clients={}", self.sync, self.clients)
    }

    fn policy(&self) -> SyncPolicy {
        match self.sync {
            "group" => SyncPolicy::Group {
                max_batch_records: 256,
            },
            _ => SyncPolicy::PerRecord,
        }
    }
}

/// The daemon process; killed and reaped on drop.
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the daemon on `pool`. On the operator's `--pool` (`short_lease`)
/// its lease is the bench's short one, as the bench's servers' are: the
/// daemon is killed after each case, and the next scenario on the pool
/// waits out the lease it leaves (10 s by default).
fn start_daemon(
    case: &Case,
    pool: &Path,
    state: &Path,
    socket: &Path,
    short_lease: bool,
) -> anyhow::Result<Daemon> {
    let exe = std::env::current_exe().context("locate the cxlkv binary")?;
    let mut command = super::command_ending_with_bench(exe)?;
    let mut child = command
        .arg("pool")
        .arg("--pool")
        .arg(format!("{},size={POOL_BYTES}", pool.display()))
        .arg("--state-dir")
        .arg(state)
        .arg("--socket")
        .arg(socket)
        .arg("--sync")
        .arg(case.sync)
        .arg("--group-max-records")
        .arg("256")
        .args(
            short_lease
                .then(|| ["--lease-ms".to_owned(), BENCH_LEASE_MS.to_string()])
                .into_iter()
                .flatten(),
        )
        .env("CXLKV_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("start the cxlkv pool daemon")?;
    let stdout = child.stdout.take().context("the daemon's stdout")?;
    let daemon = Daemon(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line.starts_with("listening ") {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(START_TIMEOUT)
        .context("the cxlkv pool daemon did not start")?;
    Ok(daemon)
}

/// Reads a typed reply; the pool manager's error, if any, becomes an error.
fn reply<R: Message>(reply: cxlkv_controlplane::transport::Reply) -> anyhow::Result<R> {
    let frame = Frame {
        header: reply.header,
        payload: reply.payload(),
    };
    match proto::access_reply::<R>(frame)? {
        Ok(a) => Ok(proto::deserialize::<R>(a)?),
        Err(e) => anyhow::bail!("the pool manager refused: {} ({})", e.message(), e.code()),
    }
}

fn payload<M: Message>(msg: &M, buf: &mut Vec<u8>) -> anyhow::Result<()> {
    buf.clear();
    proto::encode(0, msg, buf)?;
    Ok(())
}

/// Sends a mutating request with the directory's next `seq`. The number is
/// taken and the request sent under one lock, as a directory does: the
/// daemon's reply cache is a window over a directory's latest `seq`s, and a
/// number taken but sent late could fall out of it.
fn send_numbered<M: Message>(
    c: &RpcClient,
    seqs: &Mutex<u64>,
    msg: impl FnOnce(u64) -> M,
    buf: &mut Vec<u8>,
) -> anyhow::Result<cxlkv_controlplane::transport::PendingCall> {
    let mut next = seqs.lock();
    payload(&msg(*next), buf)?;
    let call = c.start(M::KIND.as_u16(), &buf[24..], CALL_TIMEOUT)?;
    *next += 1;
    Ok(call)
}

/// A client connection of the directory, its session opened (`PoolHello`).
fn connect_client(socket: &Path) -> anyhow::Result<RpcClient> {
    let c = RpcClient::connect(&Endpoint::Unix(socket.to_owned()), ClientConfig::default())?;
    let mut buf = Vec::new();
    payload(
        &PoolHello {
            meta: RequestMeta::default(),
            protocol_min: 1,
            protocol_max: 1,
            directory_id: DIRECTORY.into(),
            secret: None,
        },
        &mut buf,
    )?;
    let _: PoolWelcome = reply(c.call(PoolHello::KIND.as_u16(), &buf[24..], CALL_TIMEOUT)?)?;
    Ok(c)
}

/// One client thread's work: `pairs` alloc+free round trips on `c`;
/// returns each pair's latency in µs.
fn client_pairs(c: &RpcClient, seqs: &Mutex<u64>, pairs: usize) -> anyhow::Result<Vec<f64>> {
    let mut buf = Vec::new();
    let mut out = Vec::with_capacity(pairs);
    for _ in 0..pairs {
        let t = Instant::now();
        let alloc = |seq| AllocRegion {
            meta: RequestMeta {
                seq,
                ..RequestMeta::default()
            },
            pool: None,
            len_bytes: REGION_BYTES,
            owner: OwnerLabel {
                directory_id: DIRECTORY.into(),
                instance_id: "bench".into(),
            },
        };
        let a: RegionAllocated = reply(send_numbered(c, seqs, alloc, &mut buf)?.wait()?)?;
        let free = |seq| FreeRegion {
            meta: RequestMeta {
                seq,
                ..RequestMeta::default()
            },
            region: a.handle.region,
            token: a.handle.token,
        };
        let _: RegionFreed = reply(send_numbered(c, seqs, free, &mut buf)?.wait()?)?;
        out.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(out)
}

/// One repetition through the daemon, one thread per connection of
/// `clients`: (pairs/s, latencies µs). The clock runs from the first
/// thread's start, all released together, until the last has finished, as
/// the threads read it ([`super::timed_together`]).
fn ours_rep(
    clients: &[RpcClient],
    seqs: &Mutex<u64>,
    pairs: usize,
) -> anyhow::Result<(f64, Vec<f64>)> {
    let per_client = pairs / clients.len();
    let (wall, results) = super::timed_together(
        clients.len(),
        |_| Ok(()),
        |i, ()| client_pairs(&clients[i], seqs, per_client),
    )?;
    let lat: Vec<f64> = results.into_iter().flatten().collect();
    Ok((lat.len() as f64 / wall.as_secs_f64(), lat))
}

/// The state machine and journal driven in process (the baseline).
struct Baseline {
    store: PoolStore,
    manager: cxlkv_controlplane::pool::PoolManager,
    caller: Caller,
    group: usize,
}

impl Baseline {
    fn open(state: &Path, case: &Case) -> anyhow::Result<Self> {
        let r = PoolStore::open(
            state,
            StoreConfig {
                sync: case.policy(),
                checkpoint_every_records: 4096,
            },
            ManagerConfig::default(),
            MonotonicMs(0),
        )?;
        let (mut store, mut manager) = (r.store, r.manager);
        // A pool known only by its header (the state machine never maps it).
        let mut block = vec![0u8; 4096];
        header::encode_identity(
            &mut block,
            &PoolIdentity {
                uuid: PoolUuid([0xb5; 16]),
                size_bytes: POOL_BYTES,
                alignment_bytes: REGION_BYTES,
            },
        )?;
        let BlockState::Initialised(h) = header::decode(&block)? else {
            anyhow::bail!("a header was just written");
        };
        let opened = manager.open_pool(&h, store.journal())?;
        store.commit()?;
        manager.mark_online(opened.pool, opened.epoch)?;
        let me = liveness::identify(std::process::id())?.context("this process exists")?;
        let caller = Caller::Local(me);
        manager.handle(
            &caller,
            Request::Attach {
                directory: DirectoryId(1),
                handles: &[],
            },
            MonotonicMs(0),
            store.journal(),
        )?;
        Ok(Self {
            store,
            manager,
            caller,
            group: case.clients,
        })
    }

    fn rep(&mut self, pairs: usize) -> anyhow::Result<(f64, Vec<f64>)> {
        let mut lat = Vec::with_capacity(pairs);
        let mut requests = 0usize;
        let t = Instant::now();
        for _ in 0..pairs {
            let p = Instant::now();
            let Reply::Allocated(handle) = self.manager.handle(
                &self.caller,
                Request::Alloc {
                    target: PoolTarget::Any,
                    len_bytes: REGION_BYTES,
                    instance: InstanceId(1),
                    tag: AllocTag::NONE,
                },
                MonotonicMs(0),
                self.store.journal(),
            )?
            else {
                anyhow::bail!("an allocation answers Allocated");
            };
            requests += 1;
            self.commit_if(requests)?;
            self.manager.handle(
                &self.caller,
                Request::Free { handle },
                MonotonicMs(0),
                self.store.journal(),
            )?;
            requests += 1;
            self.commit_if(requests)?;
            lat.push(p.elapsed().as_secs_f64() * 1e6);
        }
        self.store.commit()?;
        Ok((pairs as f64 / t.elapsed().as_secs_f64(), lat))
    }

    /// Per-record: after every request; group: after every `group` requests.
    fn commit_if(&mut self, requests: usize) -> anyhow::Result<()> {
        let due = match self.store.config().sync {
            SyncPolicy::PerRecord => true,
            SyncPolicy::Group { .. } => requests.is_multiple_of(self.group),
        };
        if due {
            self.store.commit()?;
            if self.store.checkpoint_due() {
                self.store.checkpoint(&self.manager)?;
            }
        }
        Ok(())
    }
}

fn temp_dir(base: &Path, tag: &str) -> anyhow::Result<tempfile::TempDir> {
    tempfile::Builder::new()
        // Named after this process, as every entry of the bench's: what a
        // killed bench left is removed by the next one (`stale`).
        .prefix(&format!("cxlkv-bench-pool-{}-{tag}-", std::process::id()))
        .tempdir_in(base)
        .with_context(|| format!("create a temporary directory in {}", base.display()))
}

/// Where a run keeps its files: the daemon's state directory is shared by
/// the cases (a pool served once is foreign to any other state directory),
/// the baselines get one each.
struct Places {
    shm: tempfile::TempDir,
    states: tempfile::TempDir,
    state_base: PathBuf,
    pool: PathBuf,
    target: BenchPool,
}

fn run_case(
    args: &BenchArgs,
    r: &mut Reporter,
    places: &Places,
    case: &Case,
    threads: Option<usize>,
) -> anyhow::Result<()> {
    let pairs = if args.quick { 1_000 } else { 10_000 };
    // At least ten pairs per client in the warm-up (a tenth), all clients
    // the same number.
    let pairs = pairs.max(100 * case.clients);
    let pairs = pairs - pairs % case.clients;
    let socket = places.shm.path().join("pool.sock");
    let states = places.states.path();
    let pool = &places.pool;
    let state_base = &places.state_base;
    let daemon = start_daemon(
        case,
        pool,
        &states.join("daemon"),
        &socket,
        places.target.path().is_some(),
    )?;
    let mut baseline = Baseline::open(
        &states.join(format!("baseline-{}-{}", case.sync, case.clients)),
        case,
    )?;
    let seqs = Mutex::new(1u64);
    // Connected afresh before each of our reps, outside its clock: while
    // the baseline's rep runs (tens of seconds on a slow disk) they would
    // sit silent past the daemon's idle timeout (`IDLE_TIMEOUT_MS`, for
    // directories, which ping), and be closed under the next rep.
    let connect = || {
        (0..case.clients)
            .map(|_| connect_client(&socket))
            .collect::<anyhow::Result<Vec<_>>>()
    };
    // Warm-up, not measured.
    ours_rep(&connect()?, &seqs, pairs / 10)?;
    baseline.rep(pairs / 10)?;
    let (mut ours_rate, mut base_rate) = (Vec::new(), Vec::new());
    let (mut ours_p50, mut ours_p99, mut base_p50, mut base_p99) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.reps {
        let (rate, mut lat) = baseline.rep(pairs)?;
        base_rate.push(rate);
        base_p50.push(percentile(&mut lat, 50.0));
        base_p99.push(percentile(&mut lat, 99.0));
        let (rate, mut lat) = ours_rep(&connect()?, &seqs, pairs)?;
        ours_rate.push(rate);
        ours_p50.push(percentile(&mut lat, 50.0));
        ours_p99.push(percentile(&mut lat, 99.0));
    }
    drop(daemon);
    let (ours, base) = (median(&mut ours_rate), median(&mut base_rate));
    let rec = Record::new(SCENARIO, case.name(), ours, base, "pairs/s", Better::Higher)
        .with("ops_per_s", ours)
        .with("p50_us", median(&mut ours_p50))
        .with("p99_us", median(&mut ours_p99))
        .with("baseline_ops_per_s", base)
        .with("baseline_p50_us", median(&mut base_p50))
        .with("baseline_p99_us", median(&mut base_p99))
        .with("clients", case.clients as u64)
        .with("pairs_per_rep", pairs as u64)
        .with("reps", args.reps as u64)
        .with("service", "cxlkv pool daemon process, Unix socket")
        .with(
            "baseline_is",
            "PoolManager + PoolStore in process, same sync policy",
        )
        .with("state_dir", state_base.display().to_string());
    let rec = match threads {
        Some(n) => rec.with("threads", n as u64),
        None => rec,
    };
    r.emit(&places.target.tag(rec))?;
    Ok(())
}

/// Entry point (registered in `cli::SCENARIOS`).
pub fn run(args: &BenchArgs, r: &mut Reporter) -> anyhow::Result<()> {
    let threads = super::threads(args)?;
    let clients = threads.unwrap_or(if args.quick { 2 } else { 4 });
    let mut cases = vec![
        Case {
            sync: "per-record",
            clients: 1,
        },
        Case {
            sync: "group",
            clients: 1,
        },
    ];
    if clients > 1 {
        cases.push(Case {
            sync: "per-record",
            clients,
        });
        cases.push(Case {
            sync: "group",
            clients,
        });
    }
    let state_base = args
        .state_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from("/dev/shm"));
    let target = BenchPool::from_args(args)?;
    // The daemon's state directory is new: the pool must look fresh to it.
    target.prepare(POOL_BYTES)?;
    let shm = temp_dir(Path::new("/dev/shm"), "run")?;
    let pool = match target.path() {
        Some(p) => p.to_owned(),
        None => shm.path().join("pool"),
    };
    let places = Places {
        states: temp_dir(&state_base, "state")?,
        shm,
        state_base,
        pool,
        target,
    };
    for case in &cases {
        r.note(&format!("pool: {}", case.name()));
        run_case(args, r, &places, case, threads)?;
    }
    Ok(())
}
