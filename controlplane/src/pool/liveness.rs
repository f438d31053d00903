//! Is a local directory process still the process it was? (I/O: reads
//! `/proc`.)
//!
//! A local caller is a [`ProcessIdentity`]: pid + start time (field 22 of
//! `/proc/<pid>/stat`, in clock ticks after boot). The driver reads it for a
//! connection's `SO_PEERCRED` pid when the connection opens, and probes it
//! periodically for every local caller ([`PoolManager::local_callers`]); when
//! [`probe`] says the process is gone, it calls
//! [`PoolManager::caller_gone`]. A pid that now belongs to another process —
//! same pid, different start time — counts as gone: pid reuse never keeps a
//! dead directory alive.
//!
//! Limits: `/proc` must be the pid namespace of the peers (`SO_PEERCRED`
//! translates pids into the receiver's namespace, so a manager in the same
//! container as its directories, or on the host, is right). A zombie (exited,
//! not yet waited for) counts as gone.
//!
//! [`PoolManager::local_callers`]: super::PoolManager::local_callers
//! [`PoolManager::caller_gone`]: super::PoolManager::caller_gone

use std::io;

use super::types::ProcessIdentity;

/// What became of a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    Alive,
    /// No such pid, or a zombie.
    Exited,
    /// The pid belongs to a process started at another time.
    Replaced {
        start_time_ticks: u64,
    },
}

/// Why a `/proc/<pid>/stat` line could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StatError {
    #[error("no ')' closing the command name")]
    NoCommEnd,
    #[error("only {fields} fields after the command name, the start time is field 22")]
    TooFewFields { fields: usize },
    #[error("start time field {0:?} is not a number")]
    BadStartTime(String),
}

/// What `/proc/<pid>/stat` says about a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatFields {
    /// Field 3 (`R`, `S`, `Z`, …).
    pub state: u8,
    /// Field 22.
    pub start_time_ticks: u64,
}

/// Parses a `/proc/<pid>/stat` line. The command name (field 2) may contain
/// spaces and parentheses, so fields are counted after its *last* `)`.
pub fn parse_stat(stat: &[u8]) -> Result<StatFields, StatError> {
    let close = stat
        .iter()
        .rposition(|&b| b == b')')
        .ok_or(StatError::NoCommEnd)?;
    let rest = &stat[close + 1..];
    let mut fields = rest
        .split(|b| b.is_ascii_whitespace())
        .filter(|f| !f.is_empty());
    // After the comm come field 3 (state) … field 22 (starttime): index 19.
    let state = fields.next().and_then(|f| f.first().copied());
    let start = fields.nth(18);
    let (Some(state), Some(start)) = (state, start) else {
        let n = rest
            .split(|b| b.is_ascii_whitespace())
            .filter(|f| !f.is_empty())
            .count();
        return Err(StatError::TooFewFields { fields: n });
    };
    let text = String::from_utf8_lossy(start);
    let start_time_ticks = text
        .parse()
        .map_err(|_| StatError::BadStartTime(text.into_owned()))?;
    Ok(StatFields {
        state,
        start_time_ticks,
    })
}

/// Reads the identity of `pid`; `Ok(None)` when no such process exists.
pub fn read_process(pid: u32) -> io::Result<Option<(ProcessIdentity, StatFields)>> {
    match std::fs::read(format!("/proc/{pid}/stat")) {
        Ok(bytes) => {
            let f =
                parse_stat(&bytes).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            Ok(Some((
                ProcessIdentity {
                    pid,
                    start_time_ticks: f.start_time_ticks,
                },
                f,
            )))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        // ESRCH: the process exited between open and read.
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The identity of a live process (for a new connection's peer pid).
pub fn identify(pid: u32) -> io::Result<Option<ProcessIdentity>> {
    Ok(read_process(pid)?.and_then(|(id, f)| is_running(f.state).then_some(id)))
}

/// Whether a process with `pid` may still run: `false` only when `/proc`
/// shows no such process, or a zombie. Pid 0 (what `SO_PEERCRED` reports
/// for a peer outside this pid namespace) and unreadable entries count as
/// running, and so does an unrelated process that reused the pid: callers
/// use it to decide that something is safe to take away, so every doubt
/// answers "may run". (The directory's `Directory::set_holder_probe`.)
pub fn may_run(pid: u32) -> bool {
    if pid == 0 {
        return true;
    }
    match read_process(pid) {
        Ok(Some((_, f))) => is_running(f.state),
        Ok(None) => false,
        Err(_) => true,
    }
}

fn is_running(state: u8) -> bool {
    !matches!(state, b'Z' | b'X' | b'x')
}

/// Judges `expected` against what `/proc` shows now (pure; see [`probe`]).
pub fn judge(expected: &ProcessIdentity, observed: Option<StatFields>) -> Liveness {
    match observed {
        None => Liveness::Exited,
        Some(f) if f.start_time_ticks != expected.start_time_ticks => Liveness::Replaced {
            start_time_ticks: f.start_time_ticks,
        },
        Some(f) if !is_running(f.state) => Liveness::Exited,
        Some(_) => Liveness::Alive,
    }
}

/// Is `expected` still running?
pub fn probe(expected: &ProcessIdentity) -> io::Result<Liveness> {
    Ok(judge(expected, read_process(expected.pid)?.map(|(_, f)| f)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat_line(comm: &str, state: char, start: u64) -> String {
        // pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt
        // majflt cmajflt utime stime cutime cstime priority nice threads
        // itrealvalue starttime vsize …
        format!("4242 ({comm}) {state} 1 2 3 4 5 6 7 8 9 10 11 12 13 14 20 0 1 0 {start} 999 88")
    }

    #[test]
    fn the_start_time_is_found_after_a_command_name_with_spaces_and_parens() {
        let f = parse_stat(stat_line("evil) S 1 (name", 'S', 123_456).as_bytes()).unwrap();
        assert_eq!(
            f,
            StatFields {
                state: b'S',
                start_time_ticks: 123_456
            }
        );
    }

    #[test]
    fn truncated_or_garbled_stat_lines_are_errors() {
        assert_eq!(parse_stat(b"4242 (x S 1 2"), Err(StatError::NoCommEnd));
        assert!(matches!(
            parse_stat(b"4242 (x) S 1 2 3"),
            Err(StatError::TooFewFields { .. })
        ));
        let bad = stat_line("x", 'S', 1).replace(" 1 999", " zz 999");
        assert!(matches!(
            parse_stat(bad.as_bytes()),
            Err(StatError::BadStartTime(_))
        ));
    }

    #[test]
    fn pid_reuse_is_detected_through_the_start_time() {
        let was = ProcessIdentity {
            pid: 4242,
            start_time_ticks: 1000,
        };
        let same = parse_stat(stat_line("dir", 'S', 1000).as_bytes()).unwrap();
        let reused = parse_stat(stat_line("dir", 'R', 5000).as_bytes()).unwrap();
        let zombie = parse_stat(stat_line("dir", 'Z', 1000).as_bytes()).unwrap();
        assert_eq!(judge(&was, Some(same)), Liveness::Alive);
        assert_eq!(
            judge(&was, Some(reused)),
            Liveness::Replaced {
                start_time_ticks: 5000
            }
        );
        assert_eq!(judge(&was, Some(zombie)), Liveness::Exited);
        assert_eq!(judge(&was, None), Liveness::Exited);
    }

    #[test]
    fn this_process_is_alive_and_a_wrong_start_time_is_not() {
        let me = identify(std::process::id())
            .unwrap()
            .expect("this process exists");
        assert_eq!(probe(&me).unwrap(), Liveness::Alive);
        let other = ProcessIdentity {
            start_time_ticks: me.start_time_ticks + 1,
            ..me
        };
        assert!(matches!(probe(&other).unwrap(), Liveness::Replaced { .. }));
    }

    #[test]
    fn may_run_is_false_only_for_a_process_known_to_be_gone() {
        assert!(may_run(std::process::id()));
        assert!(may_run(0), "a peer outside the pid namespace");
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        assert!(may_run(pid));
        child.kill().unwrap();
        // A zombie until waited for, then no process at all: gone either way.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while may_run(pid) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!may_run(pid), "a zombie");
        child.wait().unwrap();
        assert!(!may_run(pid), "reaped");
    }

    #[test]
    fn a_killed_child_is_alive_before_and_gone_after() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let id = identify(child.id())
            .unwrap()
            .expect("a sleeping child is running");
        assert_eq!(probe(&id).unwrap(), Liveness::Alive);
        child.kill().unwrap();
        // Wait for the exit without reaping (WNOWAIT): the child is now a zombie.
        // SAFETY: siginfo_t is plain data, valid when zeroed.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `info` is a valid out-pointer for the call; WNOWAIT leaves the
        // child waitable, so `child.wait()` below still reaps it.
        let rc = unsafe {
            libc::waitid(
                libc::P_PID,
                child.id(),
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        assert_eq!(rc, 0, "waitid: {}", io::Error::last_os_error());
        let zombie = probe(&id).unwrap();
        child.wait().unwrap();
        assert_eq!(
            zombie,
            Liveness::Exited,
            "killed, not yet reaped: a zombie is gone"
        );
        assert_ne!(probe(&id).unwrap(), Liveness::Alive);
    }
}
