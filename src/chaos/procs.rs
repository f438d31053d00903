//! The chaos driver's child processes: the pool manager daemon, the server
//! and the instances, each a re-execution of the current binary.
//!
//! Every child runs in its own process group (a Ctrl-C at the terminal
//! reaches only the driver, which then stops them in order) and is killed
//! by the kernel if the driver dies without cleaning up
//! (`PR_SET_PDEATHSIG`; children are spawned from the driver's main thread,
//! whose exit is what triggers it). Standard error goes to a log file per
//! child under the run directory. Every wait is bounded.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::Context;

/// How long a daemon may take to print its `listening` line.
pub const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a SIGTERMed child may take to exit before it is SIGKILLed.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a SIGKILLed child may take to be reaped.
const REAP_TIMEOUT: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(10);

/// How a child is stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    Kill,
    Term,
}

impl Stop {
    pub fn signal(self) -> i32 {
        match self {
            Stop::Kill => libc::SIGKILL,
            Stop::Term => libc::SIGTERM,
        }
    }
}

/// A running child.
#[derive(Debug)]
pub struct Proc {
    pub name: String,
    child: Child,
}

/// A command for the current binary with `args`, stderr to `log`.
pub fn command(args: &[String], log: &Path) -> anyhow::Result<Command> {
    let exe = std::env::current_exe().context("cannot find the current executable")?;
    let log = File::create(log).with_context(|| format!("cannot create {}", log.display()))?;
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::from(log))
        .env_remove("CXLKV_CONFIG")
        .env(
            "CXLKV_LOG",
            std::env::var("CXLKV_CHAOS_CHILD_LOG").unwrap_or("warn".into()),
        )
        .process_group(0);
    // SAFETY: the closure runs in the forked child before exec and calls
    // only prctl, which is async-signal-safe; it touches no memory of the
    // parent.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(cmd)
}

impl Proc {
    /// Starts a child that needs no readiness line (an instance).
    pub fn spawn(name: String, mut cmd: Command) -> anyhow::Result<Proc> {
        let child = cmd
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("cannot start {name}"))?;
        Ok(Proc { name, child })
    }

    /// Starts a daemon and waits (at most [`START_TIMEOUT`]) for its
    /// `listening …` line; a daemon that exits or stays silent is killed
    /// and reported.
    pub fn spawn_daemon(name: String, mut cmd: Command) -> anyhow::Result<Proc> {
        let mut child = cmd
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start {name}"))?;
        let stdout = child.stdout.take().context("the child's stdout is piped")?;
        let (tx, rx) = mpsc::channel();
        // Drains stdout for the child's lifetime; ends at its EOF.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if line.starts_with("listening ") {
                    let _ = tx.send(());
                }
            }
        });
        let mut proc = Proc { name, child };
        if rx.recv_timeout(START_TIMEOUT).is_err() {
            let status = proc.stop(Stop::Kill);
            anyhow::bail!(
                "{} did not start within {} s (exit: {status:?})",
                proc.name,
                START_TIMEOUT.as_secs()
            );
        }
        Ok(proc)
    }

    /// `Some(status)` when the child exited by itself (reaped).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Sends `how`'s signal and reaps the child: after SIGTERM it gets
    /// [`STOP_TIMEOUT`], then SIGKILL. `None` if it could not be reaped
    /// (reported as a leftover by the caller).
    pub fn stop(&mut self, how: Stop) -> Option<ExitStatus> {
        if let Some(status) = self.exited() {
            return Some(status);
        }
        self.signal(how.signal());
        if how == Stop::Term {
            if let Some(status) = self.wait_for(STOP_TIMEOUT) {
                return Some(status);
            }
            tracing::warn!(name = %self.name, "no exit after SIGTERM; killing");
            self.signal(libc::SIGKILL);
        }
        self.wait_for(REAP_TIMEOUT)
    }

    fn signal(&self, sig: i32) {
        let Ok(pid) = libc::pid_t::try_from(self.child.id()) else {
            return;
        };
        // SAFETY: kill(2) on our own child's pid; the child is not reaped
        // yet (only `exited`/`wait_for` reap it, and they returned None),
        // so the pid cannot have been reused.
        unsafe { libc::kill(pid, sig) };
    }

    fn wait_for(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.exited() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(POLL);
        }
    }
}

/// Processes other than this one whose command line mentions `run_dir`
/// (every child's does): what is left after the cleanup.
pub fn leftover_processes(run_dir: &Path) -> Vec<(u32, String)> {
    let me = std::process::id();
    let needle = run_dir.to_string_lossy().into_owned();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(raw) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&raw).replace('\0', " ");
        if cmdline.contains(&needle) {
            out.push((pid, cmdline.trim().to_owned()));
        }
    }
    out
}

/// A path as a command-line argument.
pub fn arg(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}
