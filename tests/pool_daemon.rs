//! `cxlkv pool` as a process: the reaper against a real directory process,
//! one manager per pool and state directory, graceful shutdown, and bad
//! input through the service (forged and borrowed tokens, the wrong owner,
//! truncated and oversized frames) on both transport backends.

mod pool_support;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};

use cxlkv_controlplane::pool::journal::JOURNAL_HEADER_BYTES;
use cxlkv_controlplane::proto::{
    ErrorCode, FreeRegion, Heartbeat, Message, PoolStats, PoolStatsReply, RegionFreed,
    RegionHandle, RegionToken, RequestMeta,
};
use pool_support::{Daemon, DaemonSpec, EVENTUALLY, Raw, Wire, eventually, shm_dir};

const SOCKET_ENV: &str = "CXLKV_TEST_DIRECTORY_SOCKET";
const CHILD_REGIONS: u64 = 5;
const READY: &str = "cxlkv-directory-child-ready";

/// Not a test on its own: the directory process of
/// `a_directory_process_that_exits_loses_its_regions_after_the_grace_period`.
/// It attaches as `dir-child`, allocates, says so, and exits when its
/// standard input closes.
#[test]
#[ignore = "run as a child process by the reaper test"]
fn directory_child() {
    let Some(socket) = std::env::var_os(SOCKET_ENV) else {
        eprintln!("{SOCKET_ENV} not set: nothing to do");
        return;
    };
    let wire = Wire::unix(std::path::Path::new(&socket));
    wire.hello("dir-child");
    for seq in 1..=CHILD_REGIONS {
        wire.alloc("dir-child", seq).expect("the child allocates");
    }
    // libtest prints the test name without a newline first: the parent looks
    // for the marker anywhere in a line.
    println!("{READY}");
    std::io::stdout().flush().unwrap();
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
}

fn owner_regions(stats: &PoolStatsReply, directory: &str) -> u64 {
    stats.pools[0]
        .owners
        .iter()
        .find(|o| o.directory_id == directory)
        .map_or(0, |o| o.regions)
}

/// Starts [`directory_child`] against the daemon at `socket` and returns
/// once it attached as `dir-child` and allocated; it exits when its
/// standard input closes.
fn directory_child_process(socket: &std::path::Path) -> std::process::Child {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "directory_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(SOCKET_ENV, socket)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line.contains(READY) {
                let _ = tx.send(());
            }
        }
    });
    if rx.recv_timeout(EVENTUALLY).is_err() {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the directory child did not allocate");
    }
    child
}

#[test]
fn a_directory_process_that_exits_loses_its_regions_after_the_grace_period() {
    let dir = shm_dir("reaper");
    let mut spec = DaemonSpec::new(dir.path());
    spec.grace_ms = 300;
    let _daemon = Daemon::start(&spec);
    // This test process is a live directory too: its regions must stay.
    let me = Wire::unix(&spec.socket());
    me.hello("dir-parent");
    let mine = me.alloc("dir-parent", 1).unwrap();

    let mut child = directory_child_process(&spec.socket());
    // The child is alive (blocked on its stdin): its regions are held.
    assert_eq!(owner_regions(&me.stats(), "dir-child"), CHILD_REGIONS);
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    eventually("the exited directory's regions to be reclaimed", || {
        owner_regions(&me.stats(), "dir-child") == 0
    });
    assert_eq!(me.list(), vec![mine], "the live directory keeps its region");
}

/// The value of field `key` in a log line of the `fmt` subscriber
/// (`key=value`, the value without spaces here).
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let prefix = format!("{key}=");
    line.split_whitespace()
        .find_map(|t| t.strip_prefix(prefix.as_str()))
}

/// Every line the pool manager logs about a directory names it the same
/// way, `directory_id=dir0x…` and `directory=<the name it attached with>`,
/// so that an operator can follow one directory from its attach through
/// its end to its regions' reclaim: a local process that exits (it
/// allocated, so the names file knows it) and a TCP connection that
/// closes without allocating (only its session knows the name). The
/// lines of a directory's end and reclaim used to carry only the id, as
/// `directory=dir0x…`, and the attach only the name (reliability entry
/// 156).
#[test]
fn the_pool_managers_log_lines_name_a_directory_alike() {
    let dir = shm_dir("dirlog");
    let mut spec = DaemonSpec::new(dir.path());
    spec.grace_ms = 300;
    spec.tcp = true;
    let log = dir.path().join("daemon.log");
    spec.log = Some(log.clone());
    let daemon = Daemon::start(&spec);

    let mut child = directory_child_process(&spec.socket());
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    let remote = Wire::connect(&daemon.tcp_endpoint());
    remote.hello("dir-tcp");
    drop(remote);

    const ATTACHED: &str = "directory attached";
    const GONE: &str = "local directory process is gone";
    const CLOSED: &str = "directory connection closed";
    const RECLAIMED: &str = "reclaimed a region of a gone directory";
    let text = || std::fs::read_to_string(&log).unwrap_or_default();
    eventually("the directories' ends and reclaims in the log", || {
        let t = text();
        t.contains(GONE)
            && t.contains(CLOSED)
            && t.lines().filter(|l| l.contains(RECLAIMED)).count() == CHILD_REGIONS as usize
    });
    let logged = text();
    let mut seen: Vec<(String, String, &str)> = Vec::new();
    for line in logged.lines() {
        let Some(message) = [ATTACHED, GONE, CLOSED, RECLAIMED]
            .into_iter()
            .find(|m| line.contains(m))
        else {
            continue;
        };
        let id = field(line, "directory_id").unwrap_or_else(|| panic!("no directory_id: {line}"));
        let name = field(line, "directory").unwrap_or_else(|| panic!("no directory: {line}"));
        assert!(id.starts_with("dir0x"), "{line}");
        seen.push((name.to_owned(), id.to_owned(), message));
    }
    for (name, messages) in [
        ("dir-child", &[ATTACHED, GONE, RECLAIMED][..]),
        ("dir-tcp", &[ATTACHED, CLOSED][..]),
    ] {
        let lines: Vec<_> = seen.iter().filter(|(n, _, _)| n == name).collect();
        for m in messages {
            assert!(
                lines.iter().any(|(_, _, message)| message == m),
                "no {m:?} line naming {name}:\n{logged}"
            );
        }
        let id = &lines[0].1;
        assert!(
            lines.iter().all(|(_, i, _)| i == id),
            "{name} shown with two ids:\n{logged}"
        );
        assert!(
            seen.iter().all(|(n, i, _)| i != id || n == name),
            "{id} shown with another name than {name}:\n{logged}"
        );
    }
}

fn output_of(mut c: Command) -> (bool, String) {
    let out = c.stdin(Stdio::null()).output().expect("run cxlkv pool");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_second_daemon_on_the_same_state_dir_or_pool_is_refused_with_a_clear_message() {
    let dir = shm_dir("second");
    let spec = DaemonSpec::new(dir.path());
    let mut first = Daemon::start(&spec);
    let other_socket = dir.path().join("other.sock");
    let other_state = dir.path().join("other-state");

    let (ok, err) = output_of(spec.command(&spec.state_dir(), &spec.pool(), &other_socket));
    assert!(!ok);
    assert!(
        err.contains("refusing to start a second one")
            && err.contains(&spec.state_dir().display().to_string())
            && err.contains(&format!("pid {}", first.pid())),
        "{err}"
    );
    let (ok, err) = output_of(spec.command(&other_state, &spec.pool(), &other_socket));
    assert!(!ok);
    assert!(
        err.contains("served by another pool manager on this host")
            && err.contains(&spec.pool().display().to_string()),
        "{err}"
    );
    let (ok, err) =
        output_of(spec.command(&other_state, &dir.path().join("other-pool"), &spec.socket()));
    assert!(!ok);
    assert!(err.contains("is in use by another process"), "{err}");

    // A graceful stop checkpoints (the journal is back to its header) and
    // releases every lock: the same command starts again.
    let w = Wire::unix(&spec.socket());
    w.hello("dir-a");
    let h = w.alloc("dir-a", 1).unwrap();
    drop(w);
    assert!(first.terminate().success());
    let journal = std::fs::metadata(spec.state_dir().join("journal")).unwrap();
    assert_eq!(journal.len(), JOURNAL_HEADER_BYTES as u64);
    assert!(!spec.socket().exists(), "the socket file is removed");
    let _again = Daemon::start(&spec);
    let w = Wire::unix(&spec.socket());
    w.hello("dir-a");
    assert_eq!(w.list(), vec![h]);
}

fn free_msg(seq: u64, region: u64, token: RegionToken) -> FreeRegion {
    FreeRegion {
        meta: RequestMeta {
            seq,
            ..RequestMeta::default()
        },
        region,
        token,
    }
}

fn expect_code<R: std::fmt::Debug>(r: Result<R, (ErrorCode, String)>, code: ErrorCode) {
    match r {
        Err((c, _)) if c == code => {}
        other => panic!("expected {code}, got {other:?}"),
    }
}

/// Everything the daemon holds, for "state unchanged" checks.
fn state(w: &Wire) -> (Vec<RegionHandle>, PoolStatsReply) {
    (w.list(), w.stats())
}

fn bad_input_is_refused_with_its_code_and_changes_nothing(name: &str, io: Option<&'static str>) {
    let dir = shm_dir(name);
    let mut spec = DaemonSpec::new(dir.path());
    spec.io = io;
    spec.tcp = true;
    let daemon = Daemon::start(&spec);
    let a = Wire::unix(&spec.socket());
    a.hello("dir-a");
    let r1 = a.alloc("dir-a", 1).unwrap();
    let r2 = a.alloc("dir-a", 2).unwrap();
    // Another directory: over TCP, a caller of its own (this process's Unix
    // connections all speak for dir-a).
    let b = Wire::connect(&daemon.tcp_endpoint());
    b.hello("dir-b");
    let b_region = b.alloc("dir-b", 1).unwrap();
    let before = state(&a);
    let mut seq_b = 2;
    let mut b_still_served = || {
        let h = b.alloc("dir-b", seq_b).unwrap();
        seq_b += 1;
        b.call::<_, RegionFreed>(&free_msg(seq_b, h.region, h.token))
            .unwrap();
        seq_b += 1;
    };

    let mut forged = r1.token;
    forged.0[0] ^= 1;
    expect_code(
        a.call::<_, RegionFreed>(&free_msg(3, r1.region, forged)),
        ErrorCode::BadToken,
    );
    expect_code(
        a.call::<_, RegionFreed>(&free_msg(4, r1.region, r2.token)),
        ErrorCode::BadToken,
    );
    expect_code(
        b.call::<_, RegionFreed>(&free_msg(100, r1.region, r1.token)),
        ErrorCode::NotOwner,
    );
    expect_code(
        a.call::<_, RegionFreed>(&free_msg(5, b_region.region, b_region.token)),
        ErrorCode::NotOwner,
    );
    assert_eq!(state(&a), before);
    b_still_served();

    // Raw frames on a connection of dir-a's process.
    let mut raw = Raw::connect(&spec.socket());
    // Truncated: a valid FreeRegion frame whose payload lost its tail, the
    // header saying so (the stream stays framed).
    let full = Raw::frame(41, &free_msg(6, r1.region, r1.token));
    let payload_len = u32::from_le_bytes(full[16..20].try_into().unwrap()) as usize;
    let cut = payload_len - 16;
    let mut truncated = Raw::header(FreeRegion::KIND.as_u16(), 42, cut as u32).to_vec();
    truncated.extend_from_slice(&full[24..24 + cut]);
    truncated.resize(24 + cut.next_multiple_of(8), 0);
    raw.send(&truncated);
    let (id, r) = raw.recv::<RegionFreed>();
    assert_eq!(id, 42);
    expect_code(r, ErrorCode::Malformed);
    // Oversized: refused from its header; the payload is skipped as it comes.
    let max = cxlkv_controlplane::frame::MAX_PAYLOAD_BYTES;
    raw.send(&Raw::header(
        FreeRegion::KIND.as_u16(),
        43,
        (max + 8) as u32,
    ));
    let (id, r) = raw.recv::<RegionFreed>();
    assert_eq!(id, 43);
    match r {
        Err((ErrorCode::FrameTooLarge, _)) => {}
        other => panic!("expected frame_too_large, got {other:?}"),
    }
    raw.send(&vec![0u8; max + 8]);
    // Not a pool-manager request: a (valid) directory request.
    raw.send(&Raw::frame(
        44,
        &Heartbeat {
            meta: RequestMeta::default(),
        },
    ));
    let (id, r) = raw.recv::<RegionFreed>();
    assert_eq!(id, 44);
    expect_code(r, ErrorCode::UnknownKind);
    // The connection still works after all of that.
    raw.send(&Raw::frame(
        45,
        &PoolStats {
            meta: RequestMeta::default(),
        },
    ));
    let (id, r) = raw.recv::<PoolStatsReply>();
    assert_eq!(id, 45);
    assert_eq!(r.unwrap(), before.1);
    // Bad magic: only this connection is closed.
    raw.send(b"NOT A FRAME, NOT A FRAME");
    assert!(raw.closed_by_peer());

    assert_eq!(state(&a), before, "no refusal changed anything");
    b_still_served();
    // The right owner with the right token still frees.
    a.call::<_, RegionFreed>(&free_msg(7, r1.region, r1.token))
        .unwrap();
    assert_eq!(a.list(), vec![r2]);
}

#[test]
fn bad_input_through_the_service_is_refused_with_its_code_default_transport() {
    bad_input_is_refused_with_its_code_and_changes_nothing("bad-default", None);
}

#[test]
fn bad_input_through_the_service_is_refused_with_its_code_fallback_transport() {
    bad_input_is_refused_with_its_code_and_changes_nothing("bad-fallback", Some("fallback"));
}
