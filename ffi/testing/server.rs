//! `cxlkv-test-server`: a cxlkv server in its own process for the C, C++
//! and Python tests of the C ABI (`scripts/test-ffi.sh`, `python/tests`),
//! which need a real server process next to the processes they start.
//!
//! ```text
//! cxlkv-test-server --socket PATH --pool PATH [--pool-size-mib N]
//!                   [--session-lease-ms N] [--instance-grace-ms N]
//! ```
//!
//! Prints `ready <socket>` on stdout once it accepts connections, then
//! serves until SIGTERM or SIGINT, when it shuts down (sessions closed,
//! socket and pool file removed). It is the library's `Server::start` and
//! nothing else: `cxlkv serve` (issue #5) will replace it in the scripts.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use cxlkv::server::{Server, ServerConfig};

fn usage() -> ExitCode {
    eprintln!(
        "usage: cxlkv-test-server --socket PATH --pool PATH [--pool-size-mib N] [--session-lease-ms N] [--instance-grace-ms N]"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let mut cfg = ServerConfig::ephemeral("test-server");
    let (mut socket, mut pool) = (None, None);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let Some(value) = args.next() else {
            return usage();
        };
        let number = || value.parse::<u64>().ok();
        match flag.as_str() {
            "--socket" => socket = Some(PathBuf::from(&value)),
            "--pool" => pool = Some(PathBuf::from(&value)),
            "--pool-size-mib" => match number() {
                Some(n) => cfg.pool_size_bytes = n << 20,
                None => return usage(),
            },
            "--session-lease-ms" => match number() {
                Some(n) => cfg.directory.session_lease = Duration::from_millis(n),
                None => return usage(),
            },
            "--instance-grace-ms" => match number() {
                Some(n) => cfg.directory.instance_grace = Duration::from_millis(n),
                None => return usage(),
            },
            _ => return usage(),
        }
    }
    let (Some(socket), Some(pool)) = (socket, pool) else {
        return usage();
    };
    cfg.socket_path = socket;
    cfg.pool_path = pool;
    cfg.remove_pool_on_shutdown = true;

    // Block the stop signals in every thread (the server's threads inherit
    // the mask) so that only `sigwait` below sees them.
    // SAFETY: plain libc calls on a local, zero-initialised signal set.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    let server = match Server::start(cfg) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("cxlkv-test-server: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("ready {}", server.socket_path().display());
    let mut signal = 0;
    // SAFETY: `set` is an initialised signal set; `signal` a live int.
    unsafe { libc::sigwait(&set, &mut signal) };
    match server.shutdown() {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cxlkv-test-server: shutdown: {e}");
            ExitCode::FAILURE
        }
    }
}
