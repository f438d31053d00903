//! The modes of the files a server creates do not follow the process
//! umask: the Unix socket is 0660 (owner and group may connect, and with
//! the connection map the whole pool), the directory cxlkv creates for it
//! 0755, the embedded pool file 0600, the pool manager's state directory
//! 0700 and its files 0600 — with umask 0 (which used to leave the socket
//! 0777: any local user could connect and receive the pool's descriptor)
//! and with umask 077 (which used to leave the socket 0700 and its new
//! directory 0700, locking out the group the deployment grants access).
//!
//! The umask is process-wide, so each case runs in a child process: this
//! test binary re-executed on its one child test, which does the work only
//! when `CXLKV_FILE_MODES_UMASK` is set.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use cxlkv::server::{Server, ServerConfig};

const UMASK_ENV: &str = "CXLKV_FILE_MODES_UMASK";
const CHILD: &str = "child_starts_a_server_under_the_given_umask_and_checks_every_mode";

fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o7777
}

#[test]
fn socket_pool_and_state_modes_are_explicit_whatever_the_umask() {
    for umask in ["0", "077"] {
        let out = Command::new(std::env::current_exe().unwrap())
            .args([CHILD, "--exact", "--nocapture", "--test-threads=1"])
            .env(UMASK_ENV, umask)
            .env_remove("CXLKV_CONFIG")
            .output()
            .expect("the test binary re-executes");
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "umask {umask}: {said}");
        assert!(
            said.contains("1 passed") && said.contains("modes checked"),
            "umask {umask}: the child did not run its checks: {said}"
        );
    }
}

/// The child's half (a no-op unless re-executed by the test above).
#[test]
fn child_starts_a_server_under_the_given_umask_and_checks_every_mode() {
    let Ok(umask) = std::env::var(UMASK_ENV) else {
        return;
    };
    let umask = u32::from_str_radix(&umask, 8).expect("an octal umask");
    // SAFETY: umask only changes this process's file-creation mask; this
    // process runs this one test (`--exact`, one thread).
    unsafe { libc::umask(umask as libc::mode_t) };
    let socket_dir = tempfile::tempdir().unwrap();
    // tempfile's own directory follows the umask (0777 under umask 0,
    // which the server rightly refuses to put a socket under).
    std::fs::set_permissions(socket_dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let mut cfg = ServerConfig::ephemeral("file-modes");
    cfg.socket_path = socket_dir.path().join("created").join("server.sock");
    let mut state = cfg.pool_path.clone().into_os_string();
    state.push(".state");
    let state = std::path::PathBuf::from(state);
    let server = Server::start(cfg.clone()).expect("the server starts");
    let checks = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        assert_eq!(mode(&cfg.socket_path), 0o660, "socket, umask {umask:o}");
        assert_eq!(
            mode(cfg.socket_path.parent().unwrap()),
            0o755,
            "socket directory created by the server, umask {umask:o}"
        );
        assert_eq!(mode(&cfg.pool_path), 0o600, "pool file, umask {umask:o}");
        assert_eq!(mode(&state), 0o700, "state directory, umask {umask:o}");
        for entry in std::fs::read_dir(&state).unwrap() {
            let path = entry.unwrap().path();
            assert_eq!(
                mode(&path) & 0o077,
                0,
                "{} open to group or others, umask {umask:o}",
                path.display()
            );
        }
    }));
    server.shutdown().unwrap();
    if let Err(panic) = checks {
        std::panic::resume_unwind(panic);
    }
    println!("modes checked");
}

/// `[server] socket_mode` (here set in the server configuration it
/// becomes) decides the socket's mode; a mode the owner could not connect
/// through is refused before anything is created.
#[test]
fn a_configured_socket_mode_is_the_sockets_mode_and_one_locking_out_the_owner_is_refused() {
    let socket_dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(socket_dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let mut cfg = ServerConfig::ephemeral("socket-mode");
    cfg.socket_path = socket_dir.path().join("server.sock");
    cfg.socket_mode = 0o600;
    let server = Server::start(cfg.clone()).expect("the server starts");
    let seen = mode(&cfg.socket_path);
    server.shutdown().unwrap();
    assert_eq!(seen, 0o600, "the configured mode, not the default 0660");

    for bad in [0o060, 0o1660] {
        cfg.socket_mode = bad;
        let err = Server::start(cfg.clone())
            .map(drop)
            .expect_err("refused before it binds");
        assert!(err.to_string().contains("socket_mode"), "{bad:#o}: {err}");
        assert!(!cfg.socket_path.exists(), "{bad:#o}: nothing bound");
    }
}
