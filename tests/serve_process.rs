//! `cxlkv serve` as a process: it starts with no arguments, prints where it
//! listens, serves, and shuts down cleanly on SIGTERM, SIGINT or SIGHUP
//! (exit 0, socket file removed, the pool manager's state kept), and a
//! second start finds the region granted before the signal (the instance
//! reattaches with its token). On both transport backends (`CXLKV_IO`).
//!
//! The environment points the socket and the pool at private paths (same
//! 2 GiB default size), so that the test never meets a real server or pool
//! manager of this host; there are no flags. What the defaults themselves
//! resolve to, with nothing set, is read from `--print-config` (starting on
//! them would meet this host's real server). The pool manager's journal is
//! synced per record by default and in groups when configured
//! (`CXLKV_POOL_SYNC=group`); both must leave the region granted before
//! the signal for the next start.
//!
//! Then what the operator meets around it: SIGINT and SIGHUP left ignored
//! when `serve` or `pool` started with them ignored (`nohup`),
//! `--print-config` failing for a configuration that could not start,
//! `--pool`/`--state-dir` refused beside a pool daemon, the systemd
//! readiness notification (`READY=1` once listening, `STOPPING=1`) of
//! `serve` and `pool`, and the defaults each
//! shipped unit resolves (as a user that is not root, with the unit's
//! environment) landing in that unit's own directories.

mod child_guard;
mod common;

use child_guard::Guard;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use cxlkv_controlplane::proto::{self, RegisterOutcome};

const START_TIMEOUT: Duration = Duration::from_secs(60);
const STOP_TIMEOUT: Duration = Duration::from_secs(60);

fn remove(paths: &[&Path]) {
    for p in paths {
        if p.is_dir() {
            let _ = std::fs::remove_dir_all(p);
        } else {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Starts `cxlkv serve` with no arguments, its socket and pool pointed at
/// the test's paths by the environment; returns once it printed where it
/// listens.
fn start(io: &str, sync: &str, socket: &Path, pool: &Path) -> Guard {
    start_with(io, sync, socket, pool, "warn", Stdio::inherit(), &[], &[])
}

/// Has `cmd` start with the stop signals (SIGINT, SIGHUP, SIGTERM) in
/// `ignored` ignored, as `nohup` (SIGHUP) or a shell script's `cmd &`
/// (SIGINT) start it, and the others handled by default, as at a terminal:
/// a test run started in the background would otherwise pass its own
/// ignored SIGINT on, and the binary would rightly leave it ignored.
fn stop_signals_ignored(cmd: &mut Command, ignored: &[libc::c_int]) {
    use std::os::unix::process::CommandExt;
    let dispositions: Vec<(libc::c_int, libc::sighandler_t)> =
        [libc::SIGINT, libc::SIGHUP, libc::SIGTERM]
            .into_iter()
            .map(|sig| {
                let action = if ignored.contains(&sig) {
                    libc::SIG_IGN
                } else {
                    libc::SIG_DFL
                };
                (sig, action)
            })
            .collect();
    // SAFETY: signal(2) is async-signal-safe and the closure allocates
    // nothing (it reads the vector built before the fork), as code between
    // fork and exec must.
    unsafe {
        cmd.pre_exec(move || {
            for &(sig, action) in &dispositions {
                if libc::signal(sig, action) == libc::SIG_ERR {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

/// [`start`] with the log filter `log`, standard error going to `stderr`,
/// `env` set besides and the stop signals `ignored` ignored on entry.
#[allow(clippy::too_many_arguments)]
fn start_with(
    io: &str,
    sync: &str,
    socket: &Path,
    pool: &Path,
    log: &str,
    stderr: Stdio,
    env: &[(&str, &str)],
    ignored: &[libc::c_int],
) -> Guard {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cxlkv"));
    stop_signals_ignored(&mut cmd, ignored);
    let child = cmd
        .arg("serve")
        .envs(env.iter().copied())
        .env("CXLKV_SERVER_SOCKET", socket)
        .env("CXLKV_POOL_SYNC", sync)
        .env(
            "CXLKV_POOL_POOLS",
            format!("[{{path = \"{}\", size_bytes = \"2GiB\"}}]", pool.display()),
        )
        .env("CXLKV_IO", io)
        .env("CXLKV_LOG", log)
        .env_remove("CXLKV_CONFIG")
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("cxlkv serve starts");
    let mut guard = Guard(Some(child));
    let line = first_line(&mut guard);
    assert_eq!(line, format!("listening unix:{}", socket.display()), "{io}");
    guard
}

/// The first line the process of `guard` prints on its (piped) standard
/// output, waited for at most [`START_TIMEOUT`]; the rest is drained.
fn first_line(guard: &mut Guard) -> String {
    let stdout = guard.0.as_mut().unwrap().stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx.recv_timeout(START_TIMEOUT)
        .expect("a line on stdout")
        .unwrap()
}

/// Sends `signal` and waits (bounded) for a successful exit.
fn stop(mut guard: Guard, io: &str, signal: libc::c_int) {
    let pid = guard.0.as_ref().unwrap().id() as libc::pid_t;
    // SAFETY: `pid` is our child, not yet reaped (the guard owns it).
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
    let deadline = Instant::now() + STOP_TIMEOUT;
    let status = loop {
        if let Some(s) = guard.0.as_mut().unwrap().try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "{io}: no exit after signal {signal}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    guard.0 = None;
    assert!(status.success(), "{io}: exit status {status}");
}

fn serve_once(io: &str, sync: &str, signal: libc::c_int) {
    let unique = format!("serve-{io}-{sync}-{signal}-{}", std::process::id());
    let socket = std::env::temp_dir().join(format!("cxlkv-{unique}.sock"));
    let pool = PathBuf::from(format!("/dev/shm/cxlkv-{unique}.pool"));
    let state = PathBuf::from(format!("/dev/shm/cxlkv-{unique}.pool.state"));
    remove(&[&socket, &pool, &state]);
    let server = start(io, sync, &socket, &pool);

    let mut c = Raw::connect_unix(&socket);
    let (welcome, fds) = c.hello("proc");
    let welcome = welcome.unwrap();
    assert_eq!(fds.len(), 1, "{io}: the pool descriptor");
    assert_eq!(welcome.pools[0].size_bytes, 2 << 30);
    assert_eq!(Path::new(&welcome.pools[0].path), pool);
    let granted = c.request_region(0).unwrap();
    let region = granted.desc.region;
    let reply = c.register(vec![(b"k".to_vec(), loc(region, 0))]).unwrap();
    assert_eq!(reply.outcomes, vec![RegisterOutcome::Inserted]);

    stop(server, io, signal);
    assert!(wait_until(Duration::from_secs(5), || c.rpc.is_closed()
        || c.try_call::<_, proto::HeartbeatReply>(
            &proto::Heartbeat { meta: c.ro() },
            Duration::from_secs(1)
        )
        .is_none()));
    assert!(!socket.exists(), "{io}: the socket file is removed");
    assert!(pool.exists(), "{io}: the pool outlives the server");
    assert!(state.is_dir(), "{io}: the pool manager's state is kept");

    // What the pool manager committed before the signal is what the next
    // start finds: the instance reattaches with its region's token.
    let server = start(io, sync, &socket, &pool);
    let mut c = Raw::connect_unix(&socket);
    c.next_seq = 100;
    let back: proto::Reattached = c
        .call(&reattach_msg(
            "proc",
            welcome.instance_secret,
            vec![owned(&granted)],
            c.next_seq,
        ))
        .unwrap();
    assert!(!back.resumed, "{io}: a restart is not a resume");
    assert_eq!(back.accepted, vec![region], "{io}: the region survived");
    let again = c.register(vec![(b"k".to_vec(), loc(region, 0))]).unwrap();
    assert_eq!(again.outcomes, vec![RegisterOutcome::Inserted], "{io}");
    stop(server, io, libc::SIGTERM);
    remove(&[&socket, &pool, &state]);
}

#[test]
fn serve_starts_with_no_arguments_and_stops_cleanly_on_sigterm() {
    serve_once("auto", "per-record", libc::SIGTERM);
    serve_once("fallback", "per-record", libc::SIGTERM);
}

#[test]
fn serve_stops_cleanly_on_sigint_too() {
    serve_once("auto", "per-record", libc::SIGINT);
}

/// A closed terminal (session 23's server review: SIGHUP killed the server
/// without a graceful stop, its socket file left behind).
#[test]
fn serve_stops_cleanly_on_sighup_too() {
    serve_once("auto", "per-record", libc::SIGHUP);
}

/// Sends `signal` to the process of `guard` and checks, after a pause in
/// which a stop would have begun, that it still runs and `serves` (a check
/// that it answers).
fn survives(guard: &mut Guard, what: &str, signal: libc::c_int, serves: impl Fn()) {
    let pid = guard.0.as_ref().unwrap().id() as libc::pid_t;
    // SAFETY: `pid` is our child, not yet reaped (the guard owns it).
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
    // The main thread takes a pending stop signal at once; a stop would
    // also close the socket within this pause.
    std::thread::sleep(Duration::from_secs(2));
    let status = guard.0.as_mut().unwrap().try_wait().unwrap();
    assert!(
        status.is_none(),
        "{what}: signal {signal}, ignored on entry, stopped it ({status:?})"
    );
    serves();
}

/// `nohup cxlkv serve &` (SIGHUP ignored) and a shell script's `cxlkv serve
/// &` (SIGINT ignored) keep serving when the terminal hangs up or a Ctrl-C
/// reaches them: a stop signal ignored on entry stays ignored. SIGTERM, a
/// service manager's stop, still stops the server gracefully, even when it
/// too was ignored on entry. It used to block and wait for both
/// whatever their disposition, and stopped (reliability entry 155).
#[test]
fn serve_started_with_sighup_and_sigint_ignored_keeps_serving_them() {
    let unique = format!("serve-nohup-{}", std::process::id());
    let socket = std::env::temp_dir().join(format!("cxlkv-{unique}.sock"));
    let pool = PathBuf::from(format!("/dev/shm/cxlkv-{unique}.pool"));
    let state = PathBuf::from(format!("/dev/shm/cxlkv-{unique}.pool.state"));
    remove(&[&socket, &pool, &state]);
    let mut server = start_with(
        "auto",
        "per-record",
        &socket,
        &pool,
        "warn",
        Stdio::inherit(),
        &[],
        &[libc::SIGHUP, libc::SIGINT, libc::SIGTERM],
    );
    for signal in [libc::SIGHUP, libc::SIGINT] {
        survives(&mut server, "serve", signal, || {
            let c = Raw::connect_unix(&socket);
            let (welcome, _) = c.hello("after-signal");
            welcome.expect("a new session after the signal");
        });
    }
    stop(server, "auto", libc::SIGTERM);
    assert!(!socket.exists(), "the socket file is removed");
    remove(&[&socket, &pool, &state]);
}

/// `nohup cxlkv pool &`, the same: SIGHUP ignored on entry does not stop the
/// pool daemon, SIGTERM does (reliability entry 155).
#[test]
fn pool_started_with_sighup_ignored_keeps_serving() {
    let unique = format!("pool-nohup-{}", std::process::id());
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("pool.sock");
    let pool = PathBuf::from(format!("/dev/shm/cxlkv-{unique}.pool"));
    remove(&[&pool]);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cxlkv"));
    stop_signals_ignored(&mut cmd, &[libc::SIGHUP]);
    cmd.arg("pool")
        .arg("--pool")
        .arg(format!("{},size=64MiB", pool.display()))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--socket")
        .arg(&socket)
        .env("CXLKV_LOG", "warn")
        .env_remove("CXLKV_CONFIG")
        .stdout(Stdio::piped());
    let mut daemon = Guard(Some(cmd.spawn().expect("cxlkv pool starts")));
    let line = first_line(&mut daemon);
    assert!(line.starts_with("listening unix:"), "{line}");
    survives(&mut daemon, "pool", libc::SIGHUP, || {
        std::os::unix::net::UnixStream::connect(&socket)
            .expect("the pool daemon still listens after SIGHUP");
    });
    stop(daemon, "pool", libc::SIGTERM);
    remove(&[&pool]);
}

#[test]
fn serve_with_group_sync_keeps_what_it_granted_across_a_restart() {
    serve_once("auto", "group", libc::SIGTERM);
}

/// With no argument, no file and no `CXLKV_*` variable, `serve` resolves to
/// the embedded default: a 2 GiB pool file `/dev/shm/cxlkv.pool`, its pool
/// manager's state next to it, and the default socket (`/run/cxlkv` as
/// root, else under `$XDG_RUNTIME_DIR`).
#[test]
fn serve_with_nothing_set_resolves_to_the_embedded_default_pool_and_socket() {
    let runtime = tempfile::tempdir().expect("temporary directory");
    let xdg = runtime.path().to_str().expect("UTF-8 path");
    let (ok, text, err) = print_config(&[("XDG_RUNTIME_DIR", xdg)], &[]);
    assert!(ok, "{err}");
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let socket = if root {
        PathBuf::from("/run/cxlkv/cxlkv.sock")
    } else {
        runtime.path().join("cxlkv/cxlkv.sock")
    };
    // Compared without white space: `{:#?}` spreads a value over lines.
    let flat: String = text.split_whitespace().collect();
    for needle in [
        format!("socket_path:{:?}", socket.display().to_string()),
        "path:\"/dev/shm/cxlkv.pool\"".to_owned(),
        format!("create_size_bytes:Some({},)", 2u64 << 30),
        "state_dir:\"/dev/shm/cxlkv.pool.state\"".to_owned(),
        "tcp_listen:None".to_owned(),
    ] {
        assert!(flat.contains(&needle), "{needle} not in:\n{text}");
    }
}

/// `cxlkv serve --print-config` with no `CXLKV_*` variable but `env`, and
/// `args` after it: (exit status, stdout, stderr).
fn print_config(env: &[(&str, &str)], args: &[&str]) -> (bool, String, String) {
    print_config_of("serve", env, args)
}

/// [`print_config`] of the subcommand `command` (`serve` or `pool`).
fn print_config_of(command: &str, env: &[(&str, &str)], args: &[&str]) -> (bool, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cxlkv"));
    cmd.args([command, "--print-config"]).args(args);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("CXLKV_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().copied());
    let out = cmd.output().expect("cxlkv --print-config runs");
    let text = |b: Vec<u8>| String::from_utf8(b).expect("UTF-8");
    (out.status.success(), text(out.stdout), text(out.stderr))
}

/// A pool given without a size (a device, or a file that exists) has no
/// configured size: the printed configuration shows the pool manager's
/// pools only, not the embedded default's 2 GiB file it will not use.
#[test]
fn print_config_shows_the_pools_in_use_not_the_embedded_defaults() {
    let (ok, text, err) = print_config(&[], &["--pool", "/dev/dax9.9"]);
    assert!(ok, "{err}");
    assert!(text.contains("path: \"/dev/dax9.9\""), "{text}");
    assert!(text.contains("create_size_bytes: None"), "{text}");
    for absent in ["pool_size_bytes", "pool_path", "cxlkv.pool"] {
        assert!(!text.contains(absent), "{absent} in:\n{text}");
    }
}

/// `--print-config` makes the checks the server makes before it opens
/// anything: a configuration that could not start is printed, and the
/// command fails naming why.
#[test]
fn print_config_fails_for_a_configuration_that_could_not_start() {
    let (ok, text, err) = print_config(&[("CXLKV_SERVER_TICK_MS", "0")], &[]);
    assert!(!ok, "accepted:\n{text}");
    assert!(text.contains("tick_ms: 0"), "printed first:\n{text}");
    assert!(
        err.contains("would not start") && err.contains("tick_ms = 0"),
        "{err}"
    );
    // The embedded pool manager's own checks too (they used to run only
    // when it started).
    let (ok, text, err) = print_config(&[("CXLKV_POOL_LEASE_MS", "100")], &[]);
    assert!(
        !ok,
        "accepted:
{text}"
    );
    assert!(
        err.contains("would not start") && err.contains("lease_ms = 100"),
        "{err}"
    );
}

/// `--pool` and `--state-dir` configure the embedded pool manager: with a
/// pool daemon (`[server] pool_daemon`, from a flag or anywhere else) they
/// would be silently unused, so `serve` refuses them, naming them. `[pool]`
/// keys from a file or the environment (one shared with the daemon) are
/// only logged as unused.
#[test]
fn serve_refuses_pool_flags_a_pool_daemon_would_leave_unused() {
    let daemon = "unix:/nonexistent/cxlkv-pool.sock";
    let (ok, text, err) = print_config(
        &[],
        &[
            "--pool-daemon",
            daemon,
            "--pool",
            "/dev/shm/cxlkv-unused.pool",
            "--state-dir",
            "/tmp/cxlkv-unused.state",
        ],
    );
    assert!(!ok, "accepted:\n{text}");
    assert!(
        err.contains("--pool and --state-dir configure the embedded pool manager")
            && err.contains(daemon),
        "{err}"
    );
    let (ok, text, err) = print_config(
        &[("CXLKV_SERVER_POOL_DAEMON", daemon)],
        &["--pool", "/dev/shm/cxlkv-unused.pool"],
    );
    assert!(!ok, "accepted:\n{text}");
    assert!(err.contains("--pool configures"), "{err}");
    let (ok, text, err) = print_config(
        &[
            ("CXLKV_SERVER_POOL_DAEMON", daemon),
            ("CXLKV_POOL_GRACE_MS", "5000"),
        ],
        &[],
    );
    assert!(ok, "{err}");
    assert!(text.contains("Remote("), "{text}");
    assert!(err.contains("[pool] keys are set but unused"), "{err}");
}

/// `cxlkv pool --print-config` makes every check the daemon makes before it
/// opens anything, as `serve --print-config` does, and prints `[transport]`
/// too: both commands fail, naming the key, for a transport backend or a
/// pool lease the daemon refuses (`pool` used to print and exit 0).
#[test]
fn print_config_of_serve_and_pool_fails_naming_the_key_the_daemon_refuses() {
    for command in ["serve", "pool"] {
        let (ok, text, err) = print_config_of(command, &[], &["--pool", "/dev/dax9.9"]);
        assert!(ok, "{command}: {err}");
        assert!(
            text.contains("backend: Auto"),
            "{command} prints [transport]:\n{text}"
        );

        let (ok, text, err) = print_config_of(
            command,
            &[("CXLKV_TRANSPORT_BACKEND", "bogus")],
            &["--pool", "/dev/dax9.9"],
        );
        assert!(!ok, "{command} accepted backend = bogus:\n{text}");
        assert!(
            err.contains("[transport] backend") && err.contains("bogus"),
            "{command}: {err}"
        );

        let (ok, text, err) = print_config_of(
            command,
            &[("CXLKV_POOL_LEASE_MS", "1")],
            &["--pool", "/dev/dax9.9"],
        );
        assert!(!ok, "{command} accepted lease_ms = 1:\n{text}");
        assert!(
            err.contains("would not start") && err.contains("lease_ms = 1 "),
            "{command}: {err}"
        );

        // The transport reads `CXLKV_IO` at bind, under `backend = "auto"`.
        let (ok, text, err) = print_config_of(
            command,
            &[("CXLKV_IO", "bogus")],
            &["--pool", "/dev/dax9.9"],
        );
        assert!(!ok, "{command} accepted CXLKV_IO=bogus:\n{text}");
        assert!(err.contains("CXLKV_IO"), "{command}: {err}");
    }
    // The flag too.
    let (ok, text, err) =
        print_config_of("pool", &[], &["--pool", "/dev/dax9.9", "--lease-ms", "1"]);
    assert!(!ok, "accepted --lease-ms 1:\n{text}");
    assert!(err.contains("lease_ms = 1 "), "{err}");
}

/// A `serve` process on its own socket and pool (named after `tag`), its
/// standard error (log filter `filter`) going to `log`.
struct LoggedServer {
    server: Guard,
    log: tempfile::NamedTempFile,
    socket: PathBuf,
    pool: PathBuf,
    state: PathBuf,
}

fn logged_server(tag: &str, filter: &str, env: &[(&str, &str)]) -> LoggedServer {
    let unique = format!("{tag}-{}", std::process::id());
    let socket = std::env::temp_dir().join(format!("cxlkv-{unique}.sock"));
    let pool = PathBuf::from(format!("/dev/shm/cxlkv-{unique}.pool"));
    let state = PathBuf::from(format!("/dev/shm/cxlkv-{unique}.pool.state"));
    remove(&[&socket, &pool, &state]);
    let log = tempfile::NamedTempFile::new().expect("log file");
    let server = start_with(
        "auto",
        "per-record",
        &socket,
        &pool,
        filter,
        Stdio::from(log.reopen().expect("log file")),
        env,
        &[],
    );
    LoggedServer {
        server,
        log,
        socket,
        pool,
        state,
    }
}

/// `serve` logs with `tracing` to standard error (`CXLKV_LOG`): where it
/// serves, the signal that stops it, and a graceful end in which the
/// embedded pool manager checkpoints what its journal committed (a region
/// was granted, so there is something to checkpoint) before the server
/// reports itself stopped.
#[test]
fn serve_logs_its_start_the_signal_and_a_checkpointed_stop() {
    let LoggedServer {
        server,
        log,
        socket,
        pool,
        state,
    } = logged_server("serve-log", "info", &[]);
    let mut c = Raw::connect_unix(&socket);
    c.hello("logged").0.unwrap();
    c.request_region(0).unwrap();
    stop(server, "auto", libc::SIGTERM);
    let text = std::fs::read_to_string(log.path()).expect("read the log");
    // In order: each needle after the previous one.
    let mut rest = text.as_str();
    for needle in [
        "cxlkv serve: serving",
        "stopping signal=SIGTERM",
        "checkpointed=true",
        "pool manager stopped",
        "server stopped",
    ] {
        let at = rest
            .find(needle)
            .unwrap_or_else(|| panic!("{needle:?} not logged (in order) in:\n{text}"));
        rest = &rest[at + needle.len()..];
    }
    remove(&[&socket, &pool, &state]);
}

/// A pin held past `[directory] long_pin_ms` is logged as a warning (DESIGN
/// §4: long-held pins are reported in the stats and the log), naming the
/// oldest holder's instance; one held for less is not.
#[test]
fn serve_logs_pins_held_past_the_threshold() {
    let LoggedServer {
        server,
        log,
        socket,
        pool,
        state,
    } = logged_server(
        "serve-pinlog",
        "warn",
        &[("CXLKV_DIRECTORY_LONG_PIN_MS", "1500")],
    );
    const NEEDLE: &str = "keys pinned longer than the threshold";
    let mut c = Raw::connect_unix(&socket);
    c.hello("pin-holder").0.unwrap();
    let granted = c.request_region(0).unwrap();
    let r = c
        .register(vec![(b"held".to_vec(), loc(granted.desc.region, 0))])
        .unwrap();
    assert_eq!(r.outcomes, vec![RegisterOutcome::Inserted]);
    c.lookup(&[b"held"], 1).unwrap();
    let text = || std::fs::read_to_string(log.path()).expect("read the log");
    // Reports run every `long_pin_ms` from the start: the first one or two
    // come before the pin is old enough.
    std::thread::sleep(Duration::from_millis(1000));
    assert!(
        !text().contains(NEEDLE),
        "a young pin is not reported:\n{}",
        text()
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while !text().contains(NEEDLE) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let logged = text();
    let line = logged
        .lines()
        .find(|l| l.contains(NEEDLE))
        .unwrap_or_else(|| panic!("no long-held pin reported in:\n{logged}"));
    assert!(line.contains("oldest_instance=pin-holder"), "{line}");
    assert!(line.contains("pins=1"), "{line}");
    stop(server, "auto", libc::SIGTERM);
    remove(&[&socket, &pool, &state]);
}

/// Receives one datagram from `socket` within 10 s.
fn notified(socket: &std::os::unix::net::UnixDatagram) -> String {
    socket
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 256];
    let n = socket.recv(&mut buf).expect("a notification within 10 s");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// Under systemd (`Type=notify`, `$NOTIFY_SOCKET`) `cxlkv pool` and `cxlkv
/// serve` say `READY=1` once their socket accepts connections, and
/// `STOPPING=1` when a signal stops them. The shipped units used to be
/// `Type=exec`, ready as soon as executed: `cxlkv.service`, ordered after
/// `cxlkv-pool.service`, started before the daemon listened and failed
/// (reliability entry 149).
#[test]
fn serve_and_pool_tell_systemd_they_are_ready_once_they_listen() {
    let unique = format!("notify-{}", std::process::id());
    let dir = tempfile::tempdir().unwrap();
    let notify = dir.path().join("notify");
    let listener = std::os::unix::net::UnixDatagram::bind(&notify).unwrap();
    let notify_env = notify.to_str().unwrap();

    // The pool daemon.
    let pool_socket = dir.path().join("pool.sock");
    let pool = PathBuf::from(format!("/dev/shm/cxlkv-{unique}-daemon.pool"));
    let pool_state = dir.path().join("pool-state");
    remove(&[&pool]);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cxlkv"));
    cmd.arg("pool")
        .arg("--pool")
        .arg(format!("{},size=64MiB", pool.display()))
        .arg("--state-dir")
        .arg(&pool_state)
        .arg("--socket")
        .arg(&pool_socket)
        .env("NOTIFY_SOCKET", notify_env)
        .env("CXLKV_LOG", "warn")
        .env_remove("CXLKV_CONFIG")
        .stdout(Stdio::null());
    let daemon = Guard(Some(cmd.spawn().expect("cxlkv pool starts")));
    assert_eq!(notified(&listener), "READY=1", "pool");
    std::os::unix::net::UnixStream::connect(&pool_socket)
        .expect("the pool daemon listens when it says it is ready");

    // The server.
    let socket = dir.path().join("cxlkv.sock");
    let server_pool = PathBuf::from(format!("/dev/shm/cxlkv-{unique}.pool"));
    let server_state = PathBuf::from(format!("/dev/shm/cxlkv-{unique}.pool.state"));
    remove(&[&server_pool, &server_state]);
    // Not waiting for the `listening` line: the notification alone says
    // when to connect.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cxlkv"));
    cmd.arg("serve")
        .arg("--socket")
        .arg(&socket)
        .arg("--pool")
        .arg(format!("{},size=64MiB", server_pool.display()))
        .env("CXLKV_SERVER_DEFAULT_REGION_BYTES", "16MiB")
        .env("NOTIFY_SOCKET", notify_env)
        .env("CXLKV_LOG", "error")
        .env_remove("CXLKV_CONFIG")
        .stdout(Stdio::null());
    let server = Guard(Some(cmd.spawn().expect("cxlkv serve starts")));
    assert_eq!(notified(&listener), "READY=1", "serve");
    std::os::unix::net::UnixStream::connect(&socket).expect("serve listens when ready");
    stop(server, "auto", libc::SIGTERM);
    assert_eq!(notified(&listener), "STOPPING=1", "serve");
    stop(daemon, "pool", libc::SIGTERM);
    assert_eq!(notified(&listener), "STOPPING=1", "pool");
    remove(&[&pool, &server_pool, &server_state]);
}

/// The directives `key=` of a shipped unit file, every value of each.
fn unit_directives(unit: &str, key: &str) -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy/systemd")
        .join(unit);
    let text = std::fs::read_to_string(&path).expect("the unit file");
    let prefix = format!("{key}=");
    text.lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .flat_map(|v| v.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
        .collect()
}

/// What `command --print-config --pool /dev/dax9.9` resolves to when run
/// as the shipped `unit` runs it: as a user that is not root (nobody here,
/// `cxlkv` there), with the unit's `Environment=` and nothing else
/// (`HOME` pointing nowhere); `None` when this test is not root and cannot
/// become another user.
fn resolved_under_unit(command: &str, unit: &str) -> Option<String> {
    use std::os::unix::process::CommandExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to run the binary as another user");
        return None;
    }
    // A copy of the binary in a directory anyone may enter: the build's own
    // may sit under one only its owner can (a checkout in `mktemp -d`).
    let dir = tempfile::tempdir().expect("a scratch directory");
    let exe = dir.path().join("cxlkv");
    std::fs::copy(env!("CARGO_BIN_EXE_cxlkv"), &exe).expect("the binary copied");
    for (path, mode) in [(dir.path(), 0o755), (exe.as_path(), 0o755)] {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .expect("made readable by nobody");
    }
    let mut cmd = Command::new(&exe);
    cmd.args([command, "--print-config", "--pool", "/dev/dax9.9"])
        .env_clear()
        .env("HOME", "/nonexistent")
        .env("CXLKV_LOG", "error")
        .uid(65534)
        .gid(65534);
    for assignment in unit_directives(unit, "Environment") {
        let (k, v) = assignment.split_once('=').expect("KEY=VALUE");
        cmd.env(k, v);
    }
    let out = cmd.output().expect("cxlkv runs as nobody");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{unit}: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(text.split_whitespace().collect())
}

/// Under the shipped units (user `cxlkv`, a private `/tmp`, everything but
/// the unit's state and runtime directories read-only), the default socket
/// and state directory land in those directories: `cxlkv.service` listens
/// on `/run/cxlkv/cxlkv.sock`, where its clients look, with no `socket` in
/// its configuration. It used to resolve the socket of a user that is not
/// root, `/tmp/cxlkv-<uid>/cxlkv.sock`, inside the service's private
/// `/tmp`, which no client reaches (reliability entry 150).
#[test]
fn the_shipped_units_defaults_land_in_their_own_directories() {
    for (command, unit, socket_line) in [
        ("serve", "cxlkv.service", "socket_path:"),
        ("pool", "cxlkv-pool.service", "socket:"),
    ] {
        let Some(flat) = resolved_under_unit(command, unit) else {
            return;
        };
        let runtime = format!("/run/{}", unit_directives(unit, "RuntimeDirectory")[0]);
        let state = format!("/var/lib/{}", unit_directives(unit, "StateDirectory")[0]);
        let writable = unit_directives(unit, "ReadWritePaths");
        assert!(
            writable.contains(&runtime) && writable.contains(&state),
            "{unit}"
        );
        let quoted = |line: &str| -> String {
            let at = flat
                .find(line)
                .unwrap_or_else(|| panic!("{line} in {flat}"));
            flat[at + line.len()..]
                .split('"')
                .nth(1)
                .expect("a quoted path")
                .to_owned()
        };
        let socket = quoted(socket_line);
        assert!(
            socket.starts_with(&format!("{runtime}/")),
            "{unit}: the socket {socket} is not in {runtime}"
        );
        let state_dir = quoted("state_dir:");
        assert!(
            state_dir.starts_with(&format!("{state}/")),
            "{unit}: the state directory {state_dir} is not in {state}"
        );
        if unit == "cxlkv.service" {
            // Where clients look when they are root, and what the
            // documentation's examples name.
            assert_eq!(socket, "/run/cxlkv/cxlkv.sock");
            assert_eq!(state_dir, "/var/lib/cxlkv/pool");
        }
    }
}
