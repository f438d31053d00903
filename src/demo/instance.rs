//! One instance process of the demo: an inference engine's KV-cache traffic
//! against the shared pool, driven by the coordinator.
//!
//! The coordinator starts it as `cxlkv demo --instance <i> ...` (the same
//! binary) and talks to it in lines: it answers on standard output, the
//! coordinator commands on standard input.
//!
//! ```text
//! instance -> coordinator          coordinator -> instance
//! ready <tcp port>
//!                                  prefill            (instance 0)
//! prefilled <InstanceReport as JSON>
//!                                  run <port of instance 0> <port of 1> ...
//!                                                     (the peers: 1, 2, ...)
//! progress <requests> <hits> <misses>     (every PROGRESS_EVERY)
//! done <InstanceReport as JSON>
//!                                  exit               (or end of input)
//! ```
//!
//! A run is a loop of requests ([`workload::request`]): look the request's
//! keys up in one `batch_get`, read every hit in place and verify it against
//! its closed-form checksum, fetch the hits other instances wrote over TCP
//! from their writers as well (the baseline; every other request does it
//! first, so neither side always finds the caches warm), then `batch_put`
//! the misses. Shared hits are told apart from own ones by the owner of the
//! region the chunk lies in (the directory's region table, asked again only
//! when an unknown region shows up).
//!
//! The instance dies with the coordinator: it asks the kernel for SIGKILL
//! when its parent exits, and it stops at the end of its standard input.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use super::meter::{Meter, Op, OpRecord};
use super::tcp::{ChunkServer, Peers, Served};
use super::workload::{self, ChunkId, QUESTIONS_PER_DOCUMENT, Rng, checksum};
use crate::client::{Client, ClientConfig, LayoutHandle, LayoutOptions, RegisterOutcome};
use cxlkv_controlplane::proto::sections;

/// The layout fingerprint of the demo's "model".
pub const FINGERPRINT: u64 = 0xDE30_0001;
/// How often a running instance reports progress.
const PROGRESS_EVERY: Duration = Duration::from_millis(200);
/// How long a failed request waits for the coordinator's stop (the likely
/// reason a peer's chunk server went away) before it counts as a failure.
const STOP_NOTICE: Duration = Duration::from_secs(1);
/// Longest wait for the coordinator's next command, beyond the run itself.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(300);

/// What an instance needs to know (its flags).
#[derive(Debug, Clone)]
pub struct InstanceConfig {
    pub index: u32,
    pub instances: u32,
    pub socket: PathBuf,
    /// The coordinator's pid: the instance exits if it is not its parent.
    pub parent_pid: u32,
    pub chunk_size_bytes: usize,
    pub documents: u32,
    /// Bytes of each region the instance's layout takes.
    pub region_size_bytes: u64,
    pub duration: Duration,
}

/// An instance's counts and measurements, sent to the coordinator at the
/// end of its run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct InstanceReport {
    pub index: u32,
    pub requests: u64,
    /// Keys this instance inserted (prefill included).
    pub chunks_written: u64,
    /// Of which during the prefill.
    pub prefill_chunks: u64,
    /// Writes that lost a race to another instance's write of the same key
    /// (the page went back to the allocator).
    pub duplicate_writes: u64,
    pub hits: u64,
    /// Hits on chunks another instance wrote.
    pub shared_hits: u64,
    pub misses: u64,
    /// Hits whose bytes had the length and checksum their writer wrote.
    pub verified_reads: u64,
    pub corrupt_reads: u64,
    /// Chunks fetched over TCP whose bytes checked out.
    pub tcp_verified_reads: u64,
    pub tcp_corrupt_reads: u64,
    /// TCP requests for a key its writer had not published for serving yet
    /// (excluded from the baseline's figures).
    pub tcp_not_served: u64,
    pub ops: BTreeMap<String, OpRecord>,
}

/// Runs the instance until the coordinator says `exit` or goes away.
pub fn run(cfg: InstanceConfig) -> anyhow::Result<()> {
    die_with_parent(cfg.parent_pid)?;
    let commands = spawn_command_reader()?;
    let client = Client::connect(ClientConfig {
        instance_id: format!("demo-{}", cfg.index),
        client_name: "cxlkv-demo".into(),
        ..ClientConfig::unix(&cfg.socket)
    })
    .with_context(|| format!("connecting to {}", cfg.socket.display()))?;
    let layout = client.layout_with(
        cfg.chunk_size_bytes as u64,
        FINGERPRINT,
        LayoutOptions {
            initial_reservation_bytes: cfg.region_size_bytes,
            region_size_bytes: cfg.region_size_bytes,
            auto_expand: true,
        },
    )?;
    let served = Served::default();
    let server = ChunkServer::start(Arc::clone(&served), cfg.instances as usize)?;
    say(&format!("ready {}", server.port()))?;
    let mut engine = Engine::new(cfg.clone(), client.clone(), layout, served);
    loop {
        let line = match commands.recv_timeout(COMMAND_TIMEOUT + cfg.duration) {
            Ok(Some(line)) => line,
            Ok(None) | Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => anyhow::bail!(
                "no command from the coordinator within {} s",
                (COMMAND_TIMEOUT + cfg.duration).as_secs()
            ),
        };
        let mut words = line.split_whitespace();
        match words.next() {
            Some("prefill") => {
                engine.prefill()?;
                let report = serde_json::to_string(&engine.report())?;
                say(&format!("prefilled {report}"))?;
            }
            Some("run") => {
                let ports = words
                    .map(str::parse::<u16>)
                    .collect::<Result<Vec<_>, _>>()
                    .with_context(|| format!("bad run command {line:?}"))?;
                anyhow::ensure!(
                    ports.len() == cfg.instances as usize,
                    "{} ports for {} instances",
                    ports.len(),
                    cfg.instances
                );
                if engine.run(Peers::new(ports), &commands)? == Ran::Stopped {
                    break;
                }
                let report = serde_json::to_string(&engine.report())?;
                say(&format!("done {report}"))?;
            }
            Some("exit") => break,
            _ => anyhow::bail!("unknown command {line:?}"),
        }
    }
    drop(engine);
    client.close()?;
    Ok(())
}

/// Asks for SIGKILL when the parent exits, and checks that the parent is
/// still the coordinator (it may have died before the request took effect).
fn die_with_parent(parent_pid: u32) -> anyhow::Result<()> {
    // SAFETY: prctl(PR_SET_PDEATHSIG) takes a signal number and touches no
    // memory of this process.
    let rc = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    anyhow::ensure!(
        rc == 0,
        "prctl(PR_SET_PDEATHSIG): {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: getppid has no preconditions and cannot fail.
    let ppid = unsafe { libc::getppid() };
    anyhow::ensure!(
        u32::try_from(ppid).ok() == Some(parent_pid),
        "the coordinator (pid {parent_pid}) is gone"
    );
    Ok(())
}

/// Standard input as lines on a channel; `None` at its end.
fn spawn_command_reader() -> anyhow::Result<mpsc::Receiver<Option<String>>> {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("demo-commands".into())
        .spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if tx.send(Some(line)).is_err() {
                    return;
                }
            }
            let _ = tx.send(None);
        })
        .context("starting the command reader")?;
    Ok(rx)
}

/// One line to the coordinator.
fn say(line: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()?;
    Ok(())
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ran {
    /// Its duration is over.
    Completed,
    /// The coordinator said `exit` or went away.
    Stopped,
}

/// The engine's state across requests.
struct Engine {
    cfg: InstanceConfig,
    client: Client,
    layout: LayoutHandle,
    served: Served,
    report: InstanceReport,
    meters: [Meter; 4],
    /// Source buffers of chunks about to be stored (the engine's KV output).
    sources: Vec<Vec<u8>>,
    /// Where TCP transfers land: memory this instance owns, prefaulted.
    landing: Vec<u8>,
    /// Region id → writing instance, from the directory's region table.
    region_owner: HashMap<u64, u32>,
    /// Shared chunks seen so far → their writer, for TCP-first requests.
    chunk_owner: HashMap<ChunkId, u32>,
}

impl Engine {
    fn new(cfg: InstanceConfig, client: Client, layout: LayoutHandle, served: Served) -> Self {
        let chunk = cfg.chunk_size_bytes;
        let sources = (0..workload::CHUNKS_PER_REQUEST)
            .map(|_| vec![0u8; chunk])
            .collect();
        let landing = vec![1u8; chunk * workload::CHUNKS_PER_REQUEST];
        let report = InstanceReport {
            index: cfg.index,
            ..InstanceReport::default()
        };
        Self {
            cfg,
            client,
            layout,
            served,
            report,
            meters: Default::default(),
            sources,
            landing,
            region_owner: HashMap::new(),
            chunk_owner: HashMap::new(),
        }
    }

    fn meter(&mut self, op: Op) -> &mut Meter {
        &mut self.meters[op as usize]
    }

    fn report(&self) -> InstanceReport {
        let mut r = self.report.clone();
        r.ops = Op::ALL
            .iter()
            .map(|&op| (op.name().to_owned(), self.meters[op as usize].to_record()))
            .collect();
        r
    }

    /// Writes every document's prefix (instance 0, before the peers run;
    /// it then only serves its chunks over TCP until it is told to exit).
    fn prefill(&mut self) -> anyhow::Result<()> {
        for document in 0..self.cfg.documents {
            let chunks: Vec<ChunkId> = workload::prefix(document).collect();
            self.store(&chunks)?;
        }
        self.report.prefill_chunks = self.report.chunks_written;
        Ok(())
    }

    /// Requests until the run's duration is over or the coordinator stops it.
    fn run(
        &mut self,
        mut peers: Peers,
        commands: &mpsc::Receiver<Option<String>>,
    ) -> anyhow::Result<Ran> {
        let mut rng = Rng::new(0xC0FFEE ^ (u64::from(self.cfg.index) << 32));
        let start = Instant::now();
        let mut last_progress = start;
        let mut n: u64 = 0;
        while start.elapsed() < self.cfg.duration {
            if let Ok(cmd) = commands.try_recv() {
                anyhow::ensure!(
                    cmd.is_none() || cmd.as_deref() == Some("exit"),
                    "unexpected command {cmd:?} during a run"
                );
                return Ok(Ran::Stopped);
            }
            let document = rng.below(self.cfg.documents);
            let question = rng.below(QUESTIONS_PER_DOCUMENT);
            let chunks = workload::request(document, question);
            if let Err(e) = self.request(&chunks, n % 2 == 1, &mut peers) {
                // Stopping instances close their chunk servers under the
                // peers still fetching: not a failure once the stop is here.
                return match commands.recv_timeout(STOP_NOTICE) {
                    Ok(None) | Err(mpsc::RecvTimeoutError::Disconnected) => Ok(Ran::Stopped),
                    Ok(Some(cmd)) if cmd == "exit" => Ok(Ran::Stopped),
                    _ => Err(e),
                };
            }
            n += 1;
            self.report.requests = n;
            if last_progress.elapsed() >= PROGRESS_EVERY {
                last_progress = Instant::now();
                let r = &self.report;
                say(&format!("progress {} {} {}", r.requests, r.hits, r.misses))?;
            }
        }
        Ok(Ran::Completed)
    }

    /// One request: in-place and TCP reads (in the given order), then the
    /// misses stored.
    fn request(
        &mut self,
        chunks: &[ChunkId],
        tcp_first: bool,
        peers: &mut Peers,
    ) -> anyhow::Result<()> {
        if tcp_first {
            self.tcp_read(chunks, peers)?;
        }
        let misses = self.pool_read(chunks)?;
        if !tcp_first {
            self.tcp_read(chunks, peers)?;
        }
        if !misses.is_empty() {
            self.store(&misses)?;
        }
        Ok(())
    }

    /// Reads a request's chunks in place; returns the misses.
    fn pool_read(&mut self, chunks: &[ChunkId]) -> anyhow::Result<Vec<ChunkId>> {
        let keys: Vec<Vec<u8>> = chunks.iter().map(ChunkId::key).collect();
        let chunk_len = self.cfg.chunk_size_bytes;
        let t = Instant::now();
        let guards = self.layout.batch_get(&keys)?;
        let lookup = t.elapsed();
        let (mut verified, mut corrupt, mut bytes) = (0u64, 0u64, 0u64);
        for (id, g) in chunks.iter().zip(&guards) {
            if let Some(g) = g {
                if g.len() == chunk_len && checksum(g) == id.expected_checksum(chunk_len) {
                    verified += 1;
                } else {
                    corrupt += 1;
                }
                bytes += g.len() as u64;
            }
        }
        let read = t.elapsed();
        self.meter(Op::Lookup).record(0, lookup);
        if verified + corrupt > 0 {
            self.meter(Op::Read).record(bytes, read);
        }
        let regions: Vec<(ChunkId, u64)> = chunks
            .iter()
            .zip(&guards)
            .filter_map(|(id, g)| g.as_ref().map(|g| (*id, g.location().region)))
            .collect();
        let misses: Vec<ChunkId> = chunks
            .iter()
            .zip(&guards)
            .filter(|(_, g)| g.is_none())
            .map(|(id, _)| *id)
            .collect();
        drop(guards);
        let r = &mut self.report;
        r.verified_reads += verified;
        r.corrupt_reads += corrupt;
        r.hits += regions.len() as u64;
        r.misses += misses.len() as u64;
        for (id, region) in regions {
            match self.owner_of(region)? {
                Some(owner) if owner == self.cfg.index => {}
                Some(owner) => {
                    self.report.shared_hits += 1;
                    self.chunk_owner.insert(id, owner);
                }
                // A region no demo instance owns: shared, but nobody to ask
                // over TCP.
                None => self.report.shared_hits += 1,
            }
        }
        Ok(misses)
    }

    /// The instance that owns `region`, from the directory's region table
    /// (asked again when the region is not in the cached copy).
    fn owner_of(&mut self, region: u64) -> anyhow::Result<Option<u32>> {
        if let Some(&owner) = self.region_owner.get(&region) {
            return Ok(Some(owner));
        }
        let table = self.client.directory_stats(sections::REGIONS)?;
        for row in &table.regions {
            if let Some(i) = row
                .owner_instance
                .strip_prefix("demo-")
                .and_then(|i| i.parse::<u32>().ok())
            {
                self.region_owner.insert(row.region, i);
            }
        }
        Ok(self.region_owner.get(&region).copied())
    }

    /// Fetches the request's chunks that other instances wrote (as far as
    /// this instance has seen them) from their writers over TCP, and
    /// verifies them like in-place reads.
    fn tcp_read(&mut self, chunks: &[ChunkId], peers: &mut Peers) -> anyhow::Result<()> {
        let mut by_owner: BTreeMap<u32, Vec<ChunkId>> = BTreeMap::new();
        for id in chunks {
            if let Some(&owner) = self.chunk_owner.get(id) {
                by_owner.entry(owner).or_default().push(*id);
            }
        }
        if by_owner.is_empty() {
            return Ok(());
        }
        let chunk_len = self.cfg.chunk_size_bytes;
        let (mut verified, mut corrupt, mut not_served, mut bytes) = (0u64, 0u64, 0u64, 0u64);
        let t = Instant::now();
        for (owner, ids) in &by_owner {
            let keys: Vec<Vec<u8>> = ids.iter().map(ChunkId::key).collect();
            let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
            let lens = peers.fetch(*owner as usize, &key_refs, &mut self.landing, chunk_len)?;
            for ((id, len), slot) in ids
                .iter()
                .zip(lens)
                .zip(self.landing.chunks_exact(chunk_len))
            {
                if len == 0 {
                    not_served += 1;
                } else if len == chunk_len && checksum(slot) == id.expected_checksum(chunk_len) {
                    verified += 1;
                    bytes += len as u64;
                } else {
                    corrupt += 1;
                    bytes += len as u64;
                }
            }
        }
        let took = t.elapsed();
        if verified + corrupt > 0 {
            self.meter(Op::TcpRead).record(bytes, took);
        }
        let r = &mut self.report;
        r.tcp_verified_reads += verified;
        r.tcp_corrupt_reads += corrupt;
        r.tcp_not_served += not_served;
        Ok(())
    }

    /// Produces and stores `chunks` (one `batch_put`), then publishes views
    /// of the inserted ones to this instance's chunk server.
    fn store(&mut self, chunks: &[ChunkId]) -> anyhow::Result<()> {
        anyhow::ensure!(
            chunks.len() <= self.sources.len(),
            "{} chunks in one store (at most {})",
            chunks.len(),
            self.sources.len()
        );
        for (id, buf) in chunks.iter().zip(&mut self.sources) {
            id.fill(buf);
        }
        let keys: Vec<Vec<u8>> = chunks.iter().map(ChunkId::key).collect();
        let items: Vec<(&[u8], &[u8])> = keys
            .iter()
            .map(Vec::as_slice)
            .zip(self.sources.iter().map(Vec::as_slice))
            .collect();
        let bytes = (items.len() * self.cfg.chunk_size_bytes) as u64;
        let t = Instant::now();
        let outcomes = self.layout.batch_put(&items)?;
        let took = t.elapsed();
        self.meter(Op::Store).record(bytes, took);
        let mut inserted = Vec::new();
        for (key, outcome) in keys.iter().zip(outcomes) {
            match outcome {
                RegisterOutcome::Inserted => inserted.push(key.clone()),
                RegisterOutcome::Duplicate(_) => self.report.duplicate_writes += 1,
                other => anyhow::bail!(
                    "the directory refused chunk {:?}: {other:?}",
                    String::from_utf8_lossy(key)
                ),
            }
        }
        self.report.chunks_written += inserted.len() as u64;
        let views = self.layout.batch_get(&inserted)?;
        let mut served = self.served.lock();
        for (key, view) in inserted.into_iter().zip(views) {
            let view = view.with_context(|| {
                format!(
                    "chunk {:?} is missing right after this instance inserted it",
                    String::from_utf8_lossy(&key)
                )
            })?;
            served.insert(key, Arc::new(view));
        }
        Ok(())
    }
}
