//! A client does not cross `fork` (`src/client/fork.rs`): a child forked
//! from a process holding a client, a layout, a pinned view and a lease (or
//! an L1 tier holding a read) gets `ClientError::Forked` from every call
//! (the tier's `ClientFailed`, naming the fork), sends nothing, writes no
//! leased page, and drops its copies promptly — without touching the
//! parent's session: the parent's view stays pinned (a peer's delete
//! answers `Pinned`) and its client and tier keep working.

mod client_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use client_support::*;
use cxlkv::client::{Client, ClientError, DeleteOutcome};

/// Bound on the child's run: its calls fail at once and its drops do
/// nothing, so a child still running after this hung.
const CHILD_TIMEOUT: Duration = Duration::from_secs(20);

/// The child's verdict, as its exit status (0: as documented; 99: it
/// panicked).
fn child_body(
    client: Client,
    layout: cxlkv::client::LayoutHandle,
    view: cxlkv::client::ReadGuard,
    mut lease: cxlkv::client::PageLease,
) -> i32 {
    let forked =
        |r: Result<(), ClientError>| matches!(r, Err(ClientError::Forked { pid }) if pid > 0);
    if view.bytes() != chunk(1, 4096).as_slice() {
        return 10; // the view's bytes are still readable in the child's copy
    }
    if !forked(layout.get(key(1)).map(drop)) {
        return 11;
    }
    if !forked(layout.put(key(2), &chunk(2, 4096)).map(drop)) {
        return 12;
    }
    if !forked(layout.exists(key(1)).map(drop)) {
        return 13;
    }
    if !forked(client.flush_unpins()) {
        return 14;
    }
    if !forked(client.directory_stats(0).map(drop)) {
        return 15;
    }
    // The parent's lease may write its page too: the child's copy must not.
    if !forked(lease.bytes_mut().map(drop)) || !forked(lease.write(b"child").map(drop)) {
        return 17;
    }
    if !forked(layout.alloc().map(drop)) {
        return 18;
    }
    drop(lease);
    drop(view); // must release nothing: the pin is the parent's
    drop(layout);
    if !forked(client.clone().close()) {
        return 16;
    }
    drop(client); // the last handle: must not wait for the parent's maintenance thread
    0
}

/// In the forked child: runs `body` and ends the process with its verdict
/// (99 if it panicked: a panic must not unwind into the child's copy of
/// the test harness), running no other code.
fn exit_child(body: impl FnOnce() -> i32) -> ! {
    let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).unwrap_or(99);
    // SAFETY: ends the child at once, running no destructor of the
    // parent's objects and no code of the test harness's.
    unsafe { libc::_exit(code) }
}

/// In the parent: child `pid` exited 0 (every check of its body held).
fn expect_child_ok(pid: libc::pid_t) {
    let status = wait_for_child(pid);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child's check {} failed (status {status:#x}; see its body)",
        libc::WEXITSTATUS(status)
    );
}

/// A peer's delete of `key(1)` answers `Pinned { pins: 1 }`: the parent's
/// `what` kept its pin through the child's run. Returns the peer.
fn peer_finds_key_1_pinned(
    server: &cxlkv::server::ServerHandle,
    what: &str,
) -> (Client, cxlkv::client::LayoutHandle) {
    let peer = Client::connect(client_config(server)).expect("peer connects");
    let peer_layout = small_region_layout(&peer);
    assert_eq!(
        peer_layout.delete(key(1)).expect("delete"),
        DeleteOutcome::Pinned { pins: 1 },
        "the parent's {what} lost its pin to the child"
    );
    (peer, peer_layout)
}

/// A private server, a client and its layout, with `key(1)` registered.
fn server_with_key_1(
    tag: &str,
) -> (
    cxlkv::server::ServerHandle,
    Client,
    cxlkv::client::LayoutHandle,
) {
    let server = start_server(tag);
    let client = Client::connect(client_config(&server)).expect("connect");
    let layout = small_region_layout(&client);
    layout.put(key(1), &chunk(1, 4096)).expect("put");
    (server, client, layout)
}

/// A tier call refused as a forked child's: `ClientFailed`, naming the fork.
fn names_the_fork(r: Result<(), cxlkv::tier::TierError>) -> bool {
    match r {
        Err(cxlkv::tier::TierError::ClientFailed { reason, .. }) => reason.contains("forked"),
        _ => false,
    }
}

/// Once the parent released its hold, the peer's delete of `key(1)`
/// succeeds; then everything closes.
fn key_1_is_deleted_once_released(
    server: cxlkv::server::ServerHandle,
    client: Client,
    peer: Client,
    peer_layout: &cxlkv::client::LayoutHandle,
) {
    assert_eq!(
        peer_layout.delete(key(1)).expect("delete"),
        DeleteOutcome::Deleted
    );
    client.close().expect("close");
    peer.close().expect("close");
    server.shutdown().expect("shutdown");
}

/// The exit status of child `pid`, killing it (and failing) if it runs
/// past [`CHILD_TIMEOUT`].
fn wait_for_child(pid: libc::pid_t) -> libc::c_int {
    let started = Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: waits for our own child without blocking.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        assert!(r >= 0, "waitpid: {}", std::io::Error::last_os_error());
        if r == pid {
            return status;
        }
        if started.elapsed() > CHILD_TIMEOUT {
            // SAFETY: our own child, not yet reaped.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, std::ptr::null_mut(), 0);
            }
            panic!("the forked child hung (its calls or drops waited on the parent's client)");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_forked_child_is_refused_and_leaves_the_parents_session_and_pins_alone() {
    let (server, client, layout) = server_with_key_1("fork");
    let view = layout.get(key(1)).expect("get").expect("present");
    let mut lease = layout.alloc().expect("alloc");
    lease.write(&chunk(3, 4096)).expect("write");

    // SAFETY: the child runs only `child_body` — calls that fail before
    // taking a lock or sending, and drops that leave the copies alone —
    // then `_exit`s.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // The child's copies of the parent's handles, the last ones there:
        // dropping them is what a child that simply returns does.
        exit_child(|| child_body(client, layout, view, lease));
    }
    expect_child_ok(pid);

    // The parent's session: its view is still pinned, its client works.
    let (peer, peer_layout) = peer_finds_key_1_pinned(&server, "view");
    assert_eq!(view.bytes(), chunk(1, 4096).as_slice());
    assert!(
        layout
            .exists(key(1))
            .expect("the parent's client still works")
    );
    assert!(
        !layout.exists(key(2)).expect("exists"),
        "the child's put went through"
    );
    // The parent's lease is the parent's still: it registers the bytes the
    // parent wrote.
    assert_eq!(
        layout.register(key(3), lease).expect("register"),
        cxlkv::client::RegisterOutcome::Inserted
    );
    let written = peer_layout.get(key(3)).expect("get").expect("registered");
    assert_eq!(
        written.bytes(),
        chunk(3, 4096).as_slice(),
        "the child wrote into the parent's leased page"
    );
    drop(written);
    drop(view);
    client.flush_unpins().expect("flush");
    key_1_is_deleted_once_released(server, client, peer, &peer_layout);
}

/// The same for an L1 tier (`cxlkv::tier`): in the child its calls fail
/// naming the fork, and dropping it neither joins the parent's sweeper
/// thread nor releases the reads it holds; in the parent the tier works on.
#[test]
fn a_forked_childs_tier_is_refused_and_leaves_the_parents_reads_alone() {
    use cxlkv::tier::{Holds, L1Tier, TierCode, TierConfig};

    let (server, client, layout) = server_with_key_1("fork-tier");
    let tier = L1Tier::new(layout, TierConfig::default()).expect("tier");
    let held = tier
        .reserve_read(&[key(1)], Holds::ONE)
        .expect("reserve_read");
    assert_eq!(held[0].code, TierCode::Success);

    // SAFETY: as in the test above: the child runs only calls that fail
    // before locking or sending, and drops that leave the copies alone.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        exit_child(|| {
            if !names_the_fork(tier.reserve_read(&[key(1)], Holds::ONE).map(drop)) {
                return 20;
            }
            if !names_the_fork(tier.finish_read(&[key(1)], Holds::ONE).map(drop)) {
                return 21;
            }
            if !names_the_fork(tier.close()) {
                return 22;
            }
            drop(held);
            drop(tier); // must not join the parent's sweeper thread
            drop(client);
            0
        });
    }
    expect_child_ok(pid);

    let (peer, peer_layout) = peer_finds_key_1_pinned(&server, "tier's read");
    assert_eq!(
        tier.finish_read(&[key(1)], Holds::ONE)
            .expect("finish_read"),
        [TierCode::Success]
    );
    drop(held);
    tier.close().expect("the parent's tier closes");
    key_1_is_deleted_once_released(server, client, peer, &peer_layout);
}

/// Blocks the first `reserved_read` notification (under the tier's lock)
/// until released: a parent thread that holds the tier's lock at the fork.
struct HoldsTheTierLock {
    entered: std::sync::Mutex<Option<std::sync::mpsc::Sender<()>>>,
    release: std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
}

impl cxlkv::tier::Listener for HoldsTheTierLock {
    fn reserved_read(&self, _keys: &[&[u8]]) {
        if let Some(entered) = self.entered.lock().unwrap().take() {
            entered.send(()).unwrap();
            let _ = self
                .release
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(30));
        }
    }
}

/// A tier call in the child is refused before it takes a lock: a thread of
/// the parent held the tier's lock at the fork (a listener running under
/// it), and the child's copy of that lock is never released. The child
/// also cannot make a tier over an inherited layout (it could only start a
/// sweeper thread there), and its copy of the parent's tier runs no
/// sweeper.
#[test]
fn a_forked_childs_tier_call_is_refused_before_any_lock_a_parent_thread_held() {
    use std::sync::mpsc;

    use cxlkv::tier::{Holds, L1Tier, TierConfig};

    let (server, client, layout) = server_with_key_1("fork-tier-lock");
    let tier = Arc::new(L1Tier::new(layout.clone(), TierConfig::default()).expect("tier"));
    let (entered_tx, entered) = mpsc::channel();
    let (release, release_rx) = mpsc::channel();
    tier.register_listener(Arc::new(HoldsTheTierLock {
        entered: std::sync::Mutex::new(Some(entered_tx)),
        release: std::sync::Mutex::new(release_rx),
    }))
    .expect("listener");
    let reader = {
        let tier = Arc::clone(&tier);
        std::thread::spawn(move || tier.reserve_read(&[key(1)], Holds::ONE).map(drop))
    };
    entered
        .recv_timeout(Duration::from_secs(10))
        .expect("the listener runs, under the tier's lock");

    // SAFETY: the child only makes calls that are refused before any lock,
    // then `_exit`s.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        exit_child(|| {
            if !names_the_fork(tier.report_status().map(drop)) {
                return 30;
            }
            if !names_the_fork(tier.reserve_read(&[key(2)], Holds::ONE).map(drop)) {
                return 31;
            }
            if !names_the_fork(tier.sweep_now().map(drop)) {
                return 32;
            }
            if tier.sweeper_running() {
                return 33;
            }
            if !names_the_fork(L1Tier::new(layout, TierConfig::default()).map(drop)) {
                return 34;
            }
            0
        });
    }
    let status = wait_for_child(pid);
    release.send(()).expect("release the listener");
    reader.join().expect("reader").expect("the parent's read");
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child's check {} failed (status {status:#x})",
        libc::WEXITSTATUS(status)
    );
    assert!(tier.sweeper_running(), "the parent's sweeper runs on");
    tier.close().expect("close");
    client.close().expect("close");
    server.shutdown().expect("shutdown");
}
