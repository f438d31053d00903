//! Starts an operator gets wrong, as an SRE's review of the operator
//! surface (`cxlkv serve`, `cxlkv pool`) met them: each is refused, early,
//! with a message that says what to fix, and without a log line per retry
//! or a file left behind.
//!
//! - a second `cxlkv serve` under a live server's `directory_id` at a
//!   shared pool daemon;
//! - a pool alignment that is not a power of two, and a socket path longer
//!   than `sun_path` holds: `--print-config` passed both, and a real start
//!   refused them only after it had opened (or created) the pool.

mod child_guard;
mod pool_support;

use child_guard::Guard;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// `cxlkv` with none of the operator's `CXLKV_*` variables.
fn cxlkv() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cxlkv"));
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("CXLKV_") {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// Waits (bounded) for `child` to exit; its status and standard error,
/// read meanwhile (a child logging more than a pipe holds would otherwise
/// block on it until the deadline).
fn finish(mut child: Child, within: Duration) -> (std::process::ExitStatus, String) {
    let mut stderr = child.stderr.take().expect("stderr is piped");
    let reader = std::thread::spawn(move || {
        use std::io::Read;
        let mut err = String::new();
        let _ = stderr.read_to_string(&mut err);
        err
    });
    let deadline = Instant::now() + within;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("no exit within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status, reader.join().expect("the stderr reader"))
}

/// A `cxlkv serve` on the pool daemon at `daemon` under `directory_id`,
/// listening on `socket`; returns once it printed where it listens.
fn serve_on_daemon(daemon: &Path, directory_id: &str, socket: &Path) -> Guard {
    let mut child = cxlkv()
        .arg("serve")
        .arg("--pool-daemon")
        .arg(format!("unix:{}", daemon.display()))
        .arg("--directory-id")
        .arg(directory_id)
        .arg("--socket")
        .arg(socket)
        .env("CXLKV_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("cxlkv serve starts");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let guard = Guard(Some(child));
    let line = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("a line on stdout")
        .unwrap();
    assert!(line.starts_with("listening unix:"), "{line}");
    guard
}

/// Two servers sharing a pool daemon under one `directory_id` (a copied
/// configuration): the second waited out the daemon's binding for 10 s,
/// logging one `info` line every 50 ms — 200 lines — and then failed with
/// the daemon's words ("attached through another live caller; retry once
/// that caller is gone"), naming neither the directory id nor the key to
/// change. Now the wait is logged once, and the refusal names the id and
/// `[server] directory_id`.
#[test]
fn a_second_server_under_a_live_servers_directory_id_is_refused_naming_the_key_without_a_line_per_retry()
 {
    let dir = pool_support::shm_dir("dup-directory-id");
    let daemon = pool_support::Daemon::start(&pool_support::DaemonSpec::new(dir.path()));
    let id = format!("dup-id-{}", std::process::id());
    let first_socket = dir.path().join("first.sock");
    let _first = serve_on_daemon(&daemon.spec.socket(), &id, &first_socket);

    let second = cxlkv()
        .arg("serve")
        .arg("--pool-daemon")
        .arg(format!("unix:{}", daemon.spec.socket().display()))
        .arg("--directory-id")
        .arg(&id)
        .arg("--socket")
        .arg(dir.path().join("second.sock"))
        .env("CXLKV_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cxlkv serve starts");
    let (status, err) = finish(second, Duration::from_secs(60));
    assert!(!status.success(), "a second server was started:\n{err}");
    let retries = err.lines().filter(|l| l.contains("retrying")).count();
    assert!(
        retries <= 1,
        "{retries} lines about the retries (one is enough):\n{err}"
    );
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.contains(&format!("\"{id}\"")) && last.contains("[server] directory_id"),
        "the refusal names the id and the key to change: {last}"
    );
}

/// `--print-config` of `serve` and `pool`, with `args`: (success, stderr).
fn print_config(command: &str, args: &[&str]) -> (bool, String) {
    let out = cxlkv()
        .args([command, "--print-config"])
        .args(args)
        .output()
        .expect("cxlkv runs");
    (
        out.status.success(),
        String::from_utf8(out.stderr).expect("UTF-8"),
    )
}

/// A socket path of `len` bytes under the temporary directory.
fn long_socket(len: usize) -> PathBuf {
    let dir = std::env::temp_dir();
    let base = dir.as_os_str().len() + 1;
    assert!(len > base + 5, "the temporary directory's path is too long");
    dir.join(format!("{}.sock", "s".repeat(len - base - 5)))
}

/// An alignment that is not a power of two, and a socket path longer than
/// `sockaddr_un` holds (107 bytes and its NUL), are configuration errors:
/// `--print-config` passed both (exit 0), and a start refused them only
/// once it had opened the pool — creating the pool file and its state
/// directory when they were new, and leaving them behind.
#[test]
fn print_config_and_start_refuse_a_bad_alignment_and_a_socket_path_too_long_before_any_file_is_made()
 {
    let dir = pool_support::shm_dir("early-refusals");
    let pool = dir.path().join("p.pool");
    let state = dir.path().join("p.state");
    let spec = |align: &str| format!("{},size=128MiB{align}", pool.display());
    let good_socket = dir.path().join("s.sock");
    let too_long = long_socket(108);
    let longest = long_socket(107);

    for command in ["serve", "pool"] {
        let state_flag = ["--state-dir", state.to_str().unwrap()];
        let socket = |p: &Path| ["--socket".to_owned(), p.to_str().unwrap().to_owned()];

        let s = socket(&good_socket);
        let (ok, err) = print_config(
            command,
            &[
                &["--pool", &spec(",align=3000")][..],
                &state_flag,
                &[&s[0], &s[1]],
            ]
            .concat(),
        );
        assert!(!ok, "{command}: align=3000 accepted");
        assert!(
            err.contains("align_bytes") && err.contains("3000") && err.contains("power of two"),
            "{command}: {err}"
        );

        let s = socket(&too_long);
        let (ok, err) = print_config(
            command,
            &[&["--pool", &spec("")][..], &state_flag, &[&s[0], &s[1]]].concat(),
        );
        assert!(!ok, "{command}: a 108-byte socket path accepted");
        assert!(
            err.contains("socket") && err.contains("108 bytes") && err.contains("107"),
            "{command}: {err}"
        );
        let s = socket(&longest);
        let (ok, err) = print_config(
            command,
            &[&["--pool", &spec("")][..], &state_flag, &[&s[0], &s[1]]].concat(),
        );
        assert!(ok, "{command}: a 107-byte socket path refused: {err}");

        // A real start fails the same way, before it creates anything.
        for bad in [
            vec!["--pool".to_owned(), spec(",align=3000")],
            vec![
                "--pool".to_owned(),
                spec(""),
                "--socket".to_owned(),
                too_long.to_str().unwrap().to_owned(),
            ],
        ] {
            let mut cmd = cxlkv();
            cmd.arg(command).args(&bad).args(state_flag);
            if !bad.iter().any(|a| a == "--socket") {
                cmd.arg("--socket").arg(&good_socket);
            }
            let child = cmd
                .env("CXLKV_LOG", "warn")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("cxlkv starts");
            let (status, err) = finish(child, Duration::from_secs(60));
            assert!(!status.success(), "{command} {bad:?} started");
            assert!(
                !pool.exists() && !state.exists(),
                "{command} {bad:?} left a pool file or state directory behind: {err}"
            );
        }
    }
    assert!(!too_long.exists() && !longest.exists());
}

/// A second `cxlkv pool` pointed at a live daemon's socket (a copied
/// configuration with a new pool path) was refused only once it had
/// started its pool manager: it created its pool file — RAM under
/// `/dev/shm`, 2 GiB by default — and its state directory, and left both
/// behind. Now the socket is probed first, as `serve` probes its own.
#[test]
fn a_pool_daemon_on_a_live_daemons_socket_is_refused_before_it_creates_its_pool() {
    let dir = pool_support::shm_dir("pool-socket-in-use");
    let daemon = pool_support::Daemon::start(&pool_support::DaemonSpec::new(dir.path()));
    let pool = dir.path().join("second.pool");
    let state = dir.path().join("second.state");
    let child = cxlkv()
        .arg("pool")
        .arg("--pool")
        .arg(format!("{},size=64MiB", pool.display()))
        .arg("--state-dir")
        .arg(&state)
        .arg("--socket")
        .arg(daemon.spec.socket())
        .env("CXLKV_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cxlkv pool starts");
    let (status, err) = finish(child, Duration::from_secs(60));
    assert!(!status.success(), "a second daemon started on the socket");
    assert!(
        err.contains("in use") && err.contains(&daemon.spec.socket().display().to_string()),
        "{err}"
    );
    assert!(
        !pool.exists() && !state.exists(),
        "the refused daemon left its pool file or state directory behind: {err}"
    );
}
