//! The demo's instance processes, as the coordinator sees them: started,
//! commanded, listened to, and always stopped.
//!
//! Each instance runs in its own process group, so a Ctrl-C on the terminal
//! reaches only the coordinator, which then stops them in order: end of
//! input (the instance finishes its current request and exits), SIGTERM,
//! SIGKILL, each with a bounded wait. Whether anything survived is checked,
//! not assumed: every child is reaped with `waitpid`, and `kill(-pgid, 0)`
//! must find its process group empty.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::Context;

/// How long instances get to exit after the end of their input, then after
/// SIGTERM, then after SIGKILL.
const EXIT_WAIT: Duration = Duration::from_secs(3);
const TERM_WAIT: Duration = Duration::from_secs(2);
const KILL_WAIT: Duration = Duration::from_secs(2);

/// A line an instance printed (`None`: its output ended).
pub type Event = (usize, Option<String>);

/// The running instances.
#[derive(Debug)]
pub struct Fleet {
    members: Vec<Member>,
    events_tx: mpsc::Sender<Event>,
    events: mpsc::Receiver<Event>,
}

#[derive(Debug)]
struct Member {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Default for Fleet {
    fn default() -> Self {
        let (events_tx, events) = mpsc::channel();
        Self {
            members: Vec::new(),
            events_tx,
            events,
        }
    }
}

impl Fleet {
    /// Starts `exe args…` as the next instance, in a process group of its
    /// own, its standard output read line by line into the event channel.
    pub fn spawn(&mut self, exe: &Path, args: &[String]) -> anyhow::Result<()> {
        let index = self.members.len();
        let mut child = Command::new(exe)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting instance {index} ({})", exe.display()))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take();
        // Owned before anything can fail, so that it is always stopped.
        self.members.push(Member { child, stdin });
        let stdout = stdout.context("the instance's standard output is not piped")?;
        let tx = self.events_tx.clone();
        std::thread::Builder::new()
            .name(format!("demo-listen-{index}"))
            .spawn(move || {
                // Ends when the instance's output does: at its exit.
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if tx.send((index, Some(line))).is_err() {
                        return;
                    }
                }
                let _ = tx.send((index, None));
            })
            .context("starting a listener thread")?;
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Sends one command line to instance `index`.
    pub fn send(&mut self, index: usize, line: &str) -> anyhow::Result<()> {
        let stdin = self
            .members
            .get_mut(index)
            .and_then(|m| m.stdin.as_mut())
            .with_context(|| format!("instance {index} takes no more commands"))?;
        writeln!(stdin, "{line}")
            .and_then(|()| stdin.flush())
            .with_context(|| format!("commanding instance {index}"))
    }

    /// The next line any instance printed, waiting at most `timeout`.
    pub fn next_event(&self, timeout: Duration) -> Option<Event> {
        self.events.recv_timeout(timeout).ok()
    }

    /// Stops every instance (end of input, then SIGTERM, then SIGKILL, each
    /// with a bounded wait) and returns how many are still alive after all
    /// of it — 0 unless something is badly wrong.
    pub fn stop(&mut self) -> usize {
        for m in &mut self.members {
            drop(m.stdin.take());
        }
        self.reap_until(Instant::now() + EXIT_WAIT);
        for (signal, wait) in [(libc::SIGTERM, TERM_WAIT), (libc::SIGKILL, KILL_WAIT)] {
            let mut signalled = false;
            for m in &mut self.members {
                if m.alive() {
                    signal_group(&m.child, signal);
                    signalled = true;
                }
            }
            if signalled {
                self.reap_until(Instant::now() + wait);
            }
        }
        self.members
            .iter_mut()
            .map(Member::alive)
            .filter(|&alive| alive)
            .count()
    }

    /// Reaps exited instances until none is alive or `deadline` passes.
    fn reap_until(&mut self, deadline: Instant) {
        while self.members.iter_mut().any(Member::alive) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Member {
    /// Whether the instance, or anything in its process group, still runs.
    /// Reaps the instance if it has exited.
    fn alive(&mut self) -> bool {
        match self.child.try_wait() {
            Ok(None) => true,
            Ok(Some(_)) | Err(_) => group_alive(&self.child),
        }
    }
}

/// The instance's process id as a `pid_t` (its process group id as well:
/// it was started as a group leader).
fn pgid(child: &Child) -> libc::pid_t {
    libc::pid_t::try_from(child.id()).expect("invariant: Linux pids fit in pid_t")
}

/// Whether any process of the child's group exists (`kill(-pgid, 0)`).
/// Once the group is empty its id is free; a process that later gets the
/// same pid is counted only if it also leads a group of its own.
fn group_alive(child: &Child) -> bool {
    // SAFETY: kill with signal 0 only checks for existence and permission.
    let rc = unsafe { libc::kill(-pgid(child), 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

fn signal_group(child: &Child, signal: libc::c_int) {
    // SAFETY: sends a signal to the child's process group, which this
    // process created and has not let anyone else join.
    unsafe {
        libc::kill(-pgid(child), signal);
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        let left = self.stop();
        if left > 0 {
            tracing::error!(left, "demo instances still alive after SIGKILL");
        }
    }
}
