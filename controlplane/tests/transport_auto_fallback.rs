//! `BackendChoice::Auto` falls back to the epoll backend, with one warning
//! line, when io_uring cannot be set up — here because a seccomp policy (what
//! container runtimes commonly apply) makes `io_uring_setup` fail with
//! `EPERM` — and the fallback then serves requests.
//!
//! Its own test binary on purpose: the io_uring probe's verdict is cached
//! per process, and the seccomp filter must be in place before the first
//! probe. The filter is installed on one thread and inherited only by the
//! threads it spawns (the probe's and the server's), so the rest of the
//! process is unaffected.
#![cfg(all(target_os = "linux", target_arch = "x86_64"))]

mod transport_common;

use std::io;

use cxlkv_controlplane::transport::{
    Backend, BackendChoice, IoConfig, RpcClient, ServerConfig, probe_uring,
};
use transport_common::*;

/// `io_uring_setup(2)` on x86_64.
const SYS_IO_URING_SETUP: u32 = 425;

/// Makes `io_uring_setup` fail with `EPERM` on the calling thread and the
/// threads it spawns from now on; every other system call is allowed.
fn deny_io_uring_setup_on_this_thread() -> io::Result<()> {
    let stmt = |code: u32, k: u32| libc::sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    };
    let filter = [
        // A = seccomp_data.nr (offset 0).
        stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0),
        // A == io_uring_setup ? fall through : skip the next instruction.
        libc::sock_filter {
            code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
            jt: 0,
            jf: 1,
            k: SYS_IO_URING_SETUP,
        },
        stmt(
            libc::BPF_RET | libc::BPF_K,
            libc::SECCOMP_RET_ERRNO | libc::EPERM as u32,
        ),
        stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ALLOW),
    ];
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_ptr().cast_mut(),
    };
    // SAFETY: PR_SET_NO_NEW_PRIVS takes integer arguments only; it affects
    // this thread (and threads it creates later).
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `prog` points at `filter`, both alive for the call; the kernel
    // copies the program. Without TSYNC the filter applies to this thread
    // and its future children only.
    let r = unsafe {
        libc::prctl(
            libc::PR_SET_SECCOMP,
            libc::SECCOMP_MODE_FILTER,
            &raw const prog,
            0,
            0,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[test]
fn auto_falls_back_to_epoll_with_one_warning_when_seccomp_forbids_io_uring() {
    let logs = Captured::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);
    let dispatch = tracing::dispatcher::get_default(Clone::clone);

    let served = std::thread::spawn(move || {
        let _log = tracing::dispatcher::set_default(&dispatch);
        deny_io_uring_setup_on_this_thread().expect("install the seccomp filter");
        let forced = probe_uring(&IoConfig {
            backend: BackendChoice::Uring,
            ..IoConfig::default()
        });
        assert!(
            forced.is_err(),
            "io_uring must be unavailable under the filter"
        );

        let mut backends_seen = Vec::new();
        for _ in 0..2 {
            let mut cfg = ServerConfig::default();
            cfg.io.backend = BackendChoice::Auto;
            let mut backend = None;
            let f = start_with(
                Backends::of(BackendChoice::Auto, BackendChoice::Fallback),
                cfg,
                |s| backend = Some(s.backend()),
            );
            backends_seen.push(backend.expect("bound"));
            for ep in f.endpoints() {
                let c: RpcClient = f.client(ep);
                let reply = c.call(ECHO, b"still served", LONG).expect("echo");
                assert_eq!(reply.payload(), b"still served");
            }
        }
        backends_seen
    })
    .join()
    .expect("the filtered thread does not panic");

    assert_eq!(served, vec![Backend::Fallback, Backend::Fallback]);
    let text =
        String::from_utf8_lossy(&logs.0.lock().unwrap_or_else(|p| p.into_inner())).into_owned();
    let warnings = text
        .lines()
        .filter(|l| l.contains("io_uring unavailable; using the epoll fallback"))
        .count();
    assert_eq!(warnings, 1, "one log line per process, got:\n{text}");
}
