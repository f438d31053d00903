//! Shared by the client tests: a private in-process server with short
//! timers, client configurations, deterministic chunk contents, and child
//! processes that run a role of the same test binary (selected by an
//! environment variable) and talk to the parent in `@@`-prefixed lines.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

use cxlkv::client::{Client, ClientConfig, LayoutHandle, LayoutOptions};
use cxlkv::server::{Server, ServerConfig, ServerHandle};

/// Environment variable naming the role a child process runs.
pub const ROLE_ENV: &str = "CXLKV_TEST_ROLE";
/// Environment variable carrying the server's socket path to a child.
pub const SOCKET_ENV: &str = "CXLKV_TEST_SOCKET";
/// Bound on every wait for a child's message.
pub const CHILD_TIMEOUT: Duration = Duration::from_secs(60);

/// Page size of the test layouts.
pub const PAGE: u64 = 64 << 10;
pub const FINGERPRINT: u64 = 0xC0FFEE;

/// Region size of [`small_region_layout`].
pub const SMALL_REGION_BYTES: u64 = 4 << 20;

/// The test layout in regions of [`SMALL_REGION_BYTES`] (64 pages), one
/// reserved up front, more taken as needed: a test fills a region in a
/// few puts.
pub fn small_region_layout(client: &Client) -> LayoutHandle {
    client
        .layout_with(
            PAGE,
            FINGERPRINT,
            LayoutOptions {
                initial_reservation_bytes: SMALL_REGION_BYTES,
                region_size_bytes: SMALL_REGION_BYTES,
                auto_expand: true,
            },
        )
        .unwrap()
}

/// A server with timers short enough for tests: a session dies 2 s after
/// its last request, an instance 300 ms after its last session.
pub fn server_config(tag: &str) -> ServerConfig {
    let mut c = ServerConfig::ephemeral(tag);
    c.directory.session_lease = Duration::from_secs(2);
    c.directory.instance_grace = Duration::from_millis(300);
    c.tick_ms = 20;
    c
}

pub fn start_server(tag: &str) -> ServerHandle {
    Server::start(server_config(tag)).expect("server starts")
}

pub fn client_config(server: &ServerHandle) -> ClientConfig {
    let mut c = ClientConfig::unix(server.socket_path());
    c.layout.region_size_bytes = 4 << 20;
    c
}

/// Deterministic chunk contents for `seed`.
pub fn chunk(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn key(i: u64) -> Vec<u8> {
    format!("key-{i:06}").into_bytes()
}

/// Polls `f` until it returns true or `timeout` passes.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs a closure as the calling thread exits, from a thread-local
/// destructor — as a C engine's `pthread_key_create` destructor would call
/// the library. Destructors run in the reverse order of registration, so
/// with [`at_exit::register_first`] called before the library makes its
/// own thread-locals on the thread, the closure runs after they are gone.
pub mod at_exit {
    use std::cell::RefCell;

    struct AtExit(Option<Box<dyn FnOnce()>>);

    impl Drop for AtExit {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f();
            }
        }
    }

    thread_local! {
        static AT_EXIT: RefCell<AtExit> = const { RefCell::new(AtExit(None)) };
    }

    /// Registers this thread's slot now (its destructor then runs after
    /// those of every thread-local made later on the thread).
    pub fn register_first() {
        AT_EXIT.with(|_| {});
    }

    /// What runs when the slot is destroyed, as the thread exits.
    pub fn set(f: impl FnOnce() + 'static) {
        AT_EXIT.with_borrow_mut(|a| a.0 = Some(Box::new(f)));
    }
}

/// Removes files and directories when dropped (also when a test panics).
pub struct RemoveOnDrop(pub Vec<std::path::PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
            let _ = std::fs::remove_dir_all(p);
        }
    }
}

/// What a server with this configuration leaves on disk: its socket, its
/// pool file and its embedded pool manager's state.
pub fn server_files(cfg: &ServerConfig) -> Vec<std::path::PathBuf> {
    let mut files = vec![cfg.socket_path.clone(), cfg.pool_path.clone()];
    if let cxlkv::server::PoolManagerConfig::Embedded(service) = cfg.pool_manager_config() {
        files.push(service.state_dir);
    }
    files
}

/// A child process running one role; killed on drop.
pub struct ChildRole {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    pub role: String,
}

impl ChildRole {
    /// Starts this test binary again as `role`, with extra environment.
    pub fn spawn(role: &str, env: &[(&str, String)]) -> ChildRole {
        let exe = std::env::current_exe().expect("test binary path");
        let mut cmd = Command::new(exe);
        cmd.env(ROLE_ENV, role)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn child role");
        let stdout = child.stdout.take().expect("piped stdout");
        let stdin = child.stdin.take();
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(msg) = line.strip_prefix("@@")
                    && tx.send(msg.to_owned()).is_err()
                {
                    break;
                }
            }
        });
        ChildRole {
            child,
            stdin,
            lines: rx,
            role: role.to_owned(),
        }
    }

    /// The next message, which must start with `prefix`; returns the rest.
    pub fn expect(&self, prefix: &str) -> String {
        match self.lines.recv_timeout(CHILD_TIMEOUT) {
            Ok(msg) => msg
                .strip_prefix(prefix)
                .unwrap_or_else(|| panic!("{}: expected {prefix:?}, got {msg:?}", self.role))
                .trim()
                .to_owned(),
            Err(RecvTimeoutError::Timeout) => panic!("{}: no {prefix:?} in time", self.role),
            Err(RecvTimeoutError::Disconnected) => {
                panic!("{}: exited before saying {prefix:?}", self.role)
            }
        }
    }

    /// Sends one line to the child's standard input.
    pub fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("child stdin open");
        writeln!(stdin, "{line}").expect("write to child");
        stdin.flush().expect("flush to child");
    }

    /// SIGKILLs the child and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits (bounded) for the child to exit and checks it succeeded.
    pub fn wait_success(&mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + CHILD_TIMEOUT;
        loop {
            match self.child.try_wait().expect("wait child") {
                Some(status) => {
                    assert!(status.success(), "{} failed: {status}", self.role);
                    return;
                }
                None if Instant::now() >= deadline => {
                    self.kill();
                    panic!("{} did not exit in time", self.role);
                }
                None => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for ChildRole {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill();
        }
    }
}

/// In a child: says `msg` to the parent.
pub fn say(msg: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "@@{msg}").expect("stdout");
    out.flush().expect("stdout");
}

/// In a child: waits for the parent's next line.
pub fn hear() -> String {
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).expect("stdin");
    line.trim().to_owned()
}

/// In a child: the client configuration for the parent's server.
pub fn child_client_config() -> ClientConfig {
    let socket = std::env::var(SOCKET_ENV).expect("socket path in the environment");
    let mut c = ClientConfig::unix(socket);
    c.layout.region_size_bytes = 4 << 20;
    c
}

/// A minimal harness for test binaries built with `harness = false`: runs
/// the role named by [`ROLE_ENV`] if set, else every test whose name
/// contains the first command-line argument (all without one), each in
/// turn, and exits non-zero if any failed.
pub fn main_with(
    tests: &[(&'static str, fn())],
    roles: &[(&'static str, fn())],
) -> std::process::ExitCode {
    if let Ok(role) = std::env::var(ROLE_ENV) {
        let Some((_, run)) = roles.iter().find(|(name, _)| *name == role) else {
            eprintln!("unknown role {role:?}");
            return std::process::ExitCode::FAILURE;
        };
        run();
        return std::process::ExitCode::SUCCESS;
    }
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let mut failed = Vec::new();
    let mut ran = 0;
    for (name, test) in tests {
        if filter.as_deref().is_some_and(|f| !name.contains(f)) {
            continue;
        }
        ran += 1;
        eprintln!("test {name} ...");
        let start = Instant::now();
        match std::panic::catch_unwind(test) {
            Ok(()) => eprintln!(
                "test {name} ... ok ({:.1} s)",
                start.elapsed().as_secs_f64()
            ),
            Err(_) => {
                eprintln!("test {name} ... FAILED");
                failed.push(*name);
            }
        }
    }
    eprintln!("{ran} tests, {} failed {failed:?}", failed.len());
    if failed.is_empty() {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}

/// Runs the `cxlkv` binary with `args` (logging at `warn`) and returns
/// its output, after checking it succeeded.
pub fn cxlkv(args: &[&str]) -> std::process::Output {
    let out = Command::new(env!("CARGO_BIN_EXE_cxlkv"))
        .args(args)
        .env("CXLKV_LOG", "warn")
        .output()
        .expect("the cxlkv binary runs");
    assert!(
        out.status.success(),
        "cxlkv {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}
