//! The chaos driver's child processes: the pool manager daemon, the server
//! and the instances, each a re-execution of the current binary.
//!
//! Every child runs in its own process group (a Ctrl-C at the terminal
//! reaches only the driver, which then stops them in order) and is killed
//! by the kernel if the driver dies without cleaning up
//! (`PR_SET_PDEATHSIG`; children are spawned from the driver's main thread,
//! whose exit is what triggers it). Standard error goes to a log file per
//! child under the run directory. Every wait is bounded.
//!
//! A child's environment is the driver's without any `CXLKV_*` variable
//! ([`child_env`]): the configuration layer reads `CXLKV_CONFIG` and every
//! `CXLKV_<SECTION>_<KEY>` (`src/config.rs`), and an operator's shell
//! setting one (a TCP listener, a lease, a pool path, a transport knob)
//! would change what the soak tests, or make it fail for reasons of its
//! own. What a child is meant to get — its log filter and the transport
//! backend of the run — is passed explicitly ([`ChildEnv`]).

use std::ffi::OsString;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::config::ENV_PREFIX;

/// How long a daemon may take to print its `listening` line.
pub const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a SIGTERMed child may take to exit before it is SIGKILLed.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a SIGKILLed child (or one whose standard output closed) may
/// take to be reaped.
const REAP_TIMEOUT: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(10);
/// Lines of a child's log quoted in an error or a violation.
pub const LOG_TAIL_LINES: usize = 8;
/// Bytes read from the end of a child's log to find those lines.
const LOG_TAIL_BYTES: u64 = 8 << 10;
/// The variable that names the children's log filter (their `CXLKV_LOG`).
pub const CHILD_LOG_ENV: &str = "CXLKV_CHAOS_CHILD_LOG";

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

    pub fn signal_name(self) -> &'static str {
        match self {
            Stop::Kill => "SIGKILL",
            Stop::Term => "SIGTERM",
        }
    }
}

/// How [`Proc::stop`] found the child.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// It had already exited by itself, with this status, before it was
    /// signalled: a crash, since no child of the run ends on its own.
    ExitedBefore(ExitStatus),
    /// It exited, with this status, after the signal.
    ByUs(ExitStatus),
    /// It could not be reaped within the timeouts (the caller reports it
    /// as left behind).
    NotReaped,
}

/// A child that could not be started, or did not come up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    #[error("cannot find the current executable: {0}")]
    CurrentExe(#[source] std::io::Error),
    #[error("cannot create the log file {}: {source}", path.display())]
    Log {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start {name}: {source}")]
    Spawn {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{name} exited during start-up ({status}); the end of its log {}:\n{tail}", log.display())]
    ExitedDuringStartUp {
        name: String,
        status: ExitStatus,
        log: PathBuf,
        tail: String,
    },
    #[error("{name} closed its standard output without a listening line and was killed; the end of its log {}:\n{tail}", log.display())]
    ClosedOutput {
        name: String,
        log: PathBuf,
        tail: String,
    },
    #[error("{name} printed no listening line within {} s and was killed; the end of its log {}:\n{tail}", timeout.as_secs(), log.display())]
    Silent {
        name: String,
        timeout: Duration,
        log: PathBuf,
        tail: String,
    },
}

/// What a child gets in its environment on top of the driver's, from
/// which every `CXLKV_*` variable is removed ([`child_env`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildEnv {
    /// The child's `CXLKV_LOG` (the driver's [`CHILD_LOG_ENV`], default
    /// `warn`).
    pub log_filter: String,
    /// The child's `CXLKV_IO`: the transport backend of the run, when the
    /// driver's `CXLKV_IO` chose one.
    pub io: Option<String>,
}

impl ChildEnv {
    /// The log filter from the driver's environment and the run's backend.
    pub fn new(io: Option<String>) -> Self {
        Self {
            log_filter: std::env::var(CHILD_LOG_ENV).unwrap_or_else(|_| "warn".into()),
            io,
        }
    }
}

/// The environment of a child: `parent`'s without any `CXLKV_*` variable
/// (the prefix of every variable the configuration layer reads, present
/// and future sections alike, and of `CXLKV_IO` and `CXLKV_LOG`), plus
/// what `env` sets explicitly.
pub fn child_env(
    parent: impl IntoIterator<Item = (OsString, OsString)>,
    env: &ChildEnv,
) -> Vec<(OsString, OsString)> {
    let mut out: Vec<(OsString, OsString)> = parent
        .into_iter()
        .filter(|(name, _)| !name.as_encoded_bytes().starts_with(ENV_PREFIX.as_bytes()))
        .collect();
    out.push(("CXLKV_LOG".into(), env.log_filter.clone().into()));
    if let Some(io) = &env.io {
        out.push((cxlkv_controlplane::transport::IO_ENV.into(), io.into()));
    }
    out
}

/// A child running `program` with `args`, stderr to `log`, in the
/// environment [`child_env`] makes of `parent_env`.
fn command_for(
    program: &Path,
    args: &[String],
    log: &Path,
    parent_env: impl IntoIterator<Item = (OsString, OsString)>,
    env: &ChildEnv,
) -> Result<Command, StartError> {
    let log_file = File::create(log).map_err(|source| StartError::Log {
        path: log.to_path_buf(),
        source,
    })?;
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::from(log_file))
        .env_clear()
        .envs(child_env(parent_env, env))
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

/// A command for the current binary with `args`, stderr to `log`, in the
/// driver's environment without its `CXLKV_*` variables plus `env`.
pub fn command(args: &[String], log: &Path, env: &ChildEnv) -> Result<Command, StartError> {
    let exe = std::env::current_exe().map_err(StartError::CurrentExe)?;
    command_for(&exe, args, log, std::env::vars_os(), env)
}

/// The last [`LOG_TAIL_LINES`] lines of the log at `path`, indented, or a
/// word on why there are none.
pub fn log_tail(path: &Path) -> String {
    let read = || -> std::io::Result<String> {
        let mut f = File::open(path)?;
        let len = f.metadata()?.len();
        f.seek(SeekFrom::Start(len.saturating_sub(LOG_TAIL_BYTES)))?;
        let mut raw = Vec::new();
        f.take(LOG_TAIL_BYTES).read_to_end(&mut raw)?;
        Ok(String::from_utf8_lossy(&raw).into_owned())
    };
    match read() {
        Ok(text) => {
            let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
            if lines.is_empty() {
                return "    (empty)".to_owned();
            }
            lines[lines.len().saturating_sub(LOG_TAIL_LINES)..]
                .iter()
                .map(|l| format!("    {l}"))
                .collect::<Vec<_>>()
                .join("\n")
        }
        Err(e) => format!("    (cannot read it: {e})"),
    }
}

/// A running child.
#[derive(Debug)]
pub struct Proc {
    pub name: String,
    /// Its standard error.
    pub log: PathBuf,
    child: Child,
}

impl Proc {
    /// Starts a child that needs no readiness line (an instance); `log` is
    /// where `cmd` sends its standard error.
    pub fn spawn(name: String, mut cmd: Command, log: PathBuf) -> Result<Proc, StartError> {
        let child = cmd
            .stdout(Stdio::null())
            .spawn()
            .map_err(|source| StartError::Spawn {
                name: name.clone(),
                source,
            })?;
        Ok(Proc { name, log, child })
    }

    /// Starts a daemon and waits (at most [`START_TIMEOUT`]) for its
    /// `listening …` line. A daemon that exits first is reported with its
    /// status, one that stays silent is killed; either error quotes the end
    /// of its log (`log`, where `cmd` sends its standard error).
    pub fn spawn_daemon(name: String, mut cmd: Command, log: PathBuf) -> Result<Proc, StartError> {
        let mut child = cmd
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|source| StartError::Spawn {
                name: name.clone(),
                source,
            })?;
        let stdout = child
            .stdout
            .take()
            .expect("the child's stdout was set to piped just above");
        let (tx, rx) = mpsc::channel();
        // Drains stdout for the child's lifetime; ends at its EOF, which
        // drops `tx` and so tells the wait below that no line will come.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if line.starts_with("listening ") {
                    let _ = tx.send(());
                }
            }
        });
        let mut proc = Proc { name, log, child };
        let waited = rx.recv_timeout(START_TIMEOUT);
        let status = match waited {
            Ok(()) => return Ok(proc),
            // Its standard output closed: almost always because it exited,
            // which it may not quite have done yet.
            Err(mpsc::RecvTimeoutError::Disconnected) => proc.wait_for(REAP_TIMEOUT),
            Err(mpsc::RecvTimeoutError::Timeout) => None,
        };
        // A child still running is killed; one that exited in the meantime
        // (its output held open by a grandchild) is reported as exited.
        let status = status.or_else(|| match proc.stop(Stop::Kill) {
            Stopped::ExitedBefore(status) => Some(status),
            Stopped::ByUs(_) | Stopped::NotReaped => None,
        });
        let tail = log_tail(&proc.log);
        let Proc { name, log, .. } = proc;
        Err(match (status, waited) {
            (Some(status), _) => StartError::ExitedDuringStartUp {
                name,
                status,
                log,
                tail,
            },
            (None, Err(mpsc::RecvTimeoutError::Disconnected)) => {
                StartError::ClosedOutput { name, log, tail }
            }
            (None, _) => StartError::Silent {
                name,
                timeout: START_TIMEOUT,
                log,
                tail,
            },
        })
    }

    /// `Some(status)` when the child exited by itself (reaped).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Sends `how`'s signal and reaps the child: after SIGTERM it gets
    /// [`STOP_TIMEOUT`], then SIGKILL. A child that had already exited is
    /// not signalled and is reported as [`Stopped::ExitedBefore`], so that
    /// the caller can count its crash.
    pub fn stop(&mut self, how: Stop) -> Stopped {
        if let Some(status) = self.exited() {
            return Stopped::ExitedBefore(status);
        }
        self.signal(how.signal());
        if how == Stop::Term {
            if let Some(status) = self.wait_for(STOP_TIMEOUT) {
                return Stopped::ByUs(status);
            }
            tracing::warn!(name = %self.name, "no exit after SIGTERM; killing");
            self.signal(libc::SIGKILL);
        }
        self.wait_for(REAP_TIMEOUT)
            .map_or(Stopped::NotReaped, Stopped::ByUs)
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

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    use super::*;

    /// Waits (at most 10 s) until `pid` is a zombie: exited, not reaped.
    fn wait_until_exited_unreaped(pid: u32) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("its stat");
            // The state follows the parenthesised command name.
            let state = stat
                .rsplit(')')
                .next()
                .and_then(|r| r.trim().chars().next());
            if state == Some('Z') {
                return;
            }
            assert!(Instant::now() < deadline, "{pid} did not exit: {stat}");
            std::thread::sleep(POLL);
        }
    }

    fn sh(script: &str, log: &Path) -> Command {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", script])
            .stdin(Stdio::null())
            .stderr(File::create(log).expect("a log file"));
        cmd
    }

    #[test]
    fn stopping_a_child_that_already_exited_reports_its_own_exit_and_status() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let log = dir.path().join("log");
        let mut p = Proc::spawn("crasher".into(), sh("exit 3", &log), log).expect("sh starts");
        wait_until_exited_unreaped(p.child.id());
        match p.stop(Stop::Kill) {
            Stopped::ExitedBefore(status) => assert_eq!(status.code(), Some(3)),
            other => panic!("not reported as exited by itself: {other:?}"),
        }
    }

    #[test]
    fn stopping_a_running_child_reports_the_signal_it_died_of() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let log = dir.path().join("log");
        let mut p =
            Proc::spawn("sleeper".into(), sh("exec sleep 30", &log), log).expect("sh starts");
        match p.stop(Stop::Term) {
            Stopped::ByUs(status) => assert_eq!(status.signal(), Some(libc::SIGTERM)),
            other => panic!("not reported as stopped by us: {other:?}"),
        }
    }

    #[test]
    fn a_daemon_that_exits_during_start_up_says_so_with_its_status_and_the_end_of_its_log() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let log = dir.path().join("log");
        let script =
            "echo 'starting' >&2; echo 'error: grace_ms = 50 ms is under 100 ms' >&2; exit 4";
        let started = Instant::now();
        let err = Proc::spawn_daemon("the server".into(), sh(script, &log), log.clone())
            .expect_err("it never listens");
        assert!(
            started.elapsed() < START_TIMEOUT / 2,
            "it waited for the start-up timeout"
        );
        match &err {
            StartError::ExitedDuringStartUp { status, .. } => assert_eq!(status.code(), Some(4)),
            other => panic!("not reported as exited: {other:?}"),
        }
        let msg = err.to_string();
        assert!(msg.contains("exited during start-up"), "{msg}");
        assert!(msg.contains("grace_ms = 50 ms is under 100 ms"), "{msg}");
        assert!(msg.contains(&log.display().to_string()), "{msg}");
        assert!(!msg.contains("within"), "{msg}");
    }

    #[test]
    fn a_childs_environment_has_no_cxlkv_configuration_even_when_the_parents_has() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let log = dir.path().join("log");
        let parent: Vec<(OsString, OsString)> = [
            (
                "PATH",
                std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".into()),
            ),
            ("KEEP_ME", "1".into()),
            ("CXLKV_CONFIG", "/etc/cxlkv.toml".into()),
            ("CXLKV_SERVER_TCP", "0.0.0.0:7000".into()),
            ("CXLKV_SERVER_DIRECTORY_ID", "prod".into()),
            ("CXLKV_POOL_GRACE_MS", "1".into()),
            ("CXLKV_POOL_POOLS", "[{path = \"/dev/dax0.0\"}]".into()),
            ("CXLKV_DIRECTORY_LEASE_MS", "100".into()),
            ("CXLKV_TRANSPORT_BACKEND", "uring".into()),
            ("CXLKV_IO", "uring".into()),
            ("CXLKV_LOG", "trace".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.into(), v.into()))
        .collect();
        let env = ChildEnv {
            log_filter: "warn".into(),
            io: Some("fallback".into()),
        };
        let out = command_for(Path::new("env"), &[], &log, parent, &env)
            .expect("a command")
            .output()
            .expect("env runs");
        assert!(out.status.success(), "{out:?}");
        let seen = String::from_utf8_lossy(&out.stdout);
        let mut cxlkv: Vec<&str> = seen.lines().filter(|l| l.starts_with("CXLKV_")).collect();
        cxlkv.sort_unstable();
        assert_eq!(cxlkv, ["CXLKV_IO=fallback", "CXLKV_LOG=warn"], "{seen}");
        assert!(seen.lines().any(|l| l == "KEEP_ME=1"), "{seen}");
    }
}
