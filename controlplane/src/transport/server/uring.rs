//! The io_uring server backend.
//!
//! One ring on the loop thread. Listeners use multishot accept. Receives
//! ([`RecvMode`]): by default every connection has one receive at a time in
//! the kernel, straight into the spare bytes of its `FrameDecoder` (which
//! keeps them in place until the completion: `begin_receive`), re-armed
//! after each completion. The kernel's copy is the only one, as with the
//! epoll backend's `recv`; the re-arm is submitted after the turn's replies
//! are written, off the round trip. With `RecvMode::Provided`, every
//! connection has one multishot receive that takes buffers from a provided
//! buffer ring (`BufRing`) shared by all connections, and received bytes are
//! copied into the decoder (which needs them contiguous and 8-aligned)
//! before the buffer goes back to the ring: no re-arm, but a second copy,
//! and a large request spans several buffers and completions. Measured
//! against each other (`docs/benchmarks.md`, session 10), a 55 KB
//! request's round trip took 5–6 µs less with direct receives.
//! Sends are `SENDMSG` operations, at most one in flight per connection (that
//! keeps bytes in order), each owning the frames it writes until its
//! completion arrives — except a lone reply with no send in flight (one
//! request, one reply: the latency case), which is first written with one
//! non-blocking `send(2)`; only what the socket does not take goes through
//! the ring. The ring's send costs an `io_uring_enter` anyway (the loop
//! submits at once), plus a completion to reap and a turn of the loop, for
//! the same copy into the socket. A read on the wake eventfd is always
//! armed, so a `Completer` can wake a sleeping loop.
//!
//! Waiting: the loop reaps the completion queue without a system call;
//! with `COOP_TASKRUN | TASKRUN_FLAG` the kernel raises a flag in the
//! shared ring when receive work is pending and the loop enters the kernel
//! only then. After `spin_us` without events it blocks in `io_uring_enter`
//! with a timeout for the next timer.
//!
//! A provided buffer can hold more than the connection's decoder has room
//! for (the decoder grows to one maximum frame plus 64 KiB, a buffer may be
//! up to 16 MiB): its bytes are copied in as far as they fit, the frames
//! they complete are decoded (which makes room), and so on.
//!
//! Accepting: a multishot accept that fails for lack of descriptors ends,
//! and re-arming it at once would fail again at once (the connection stays
//! in the backlog); it is re-armed when the `AcceptPause` is over.
//!
//! Teardown of a connection: `shutdown(2)` (which ends its multishot
//! receive) plus a cancel; the slot and descriptor are released only when
//! no operation of the connection remains in the kernel, since the kernel
//! may still write into or read from memory those operations point at.
//!
//! End of the loop (`quiesce`): however the loop ends — asked to stop, an
//! error, a handler's panic unwinding — every connection's socket is shut
//! down, every operation cancelled (`IORING_REGISTER_SYNC_CANCEL`, any
//! request) and their completions reaped, within `QUIESCE_WAIT`, before the
//! ring, the send buffers, the provided buffers and (after `run` returns)
//! the decoders are freed. Closing a ring does not cancel its operations
//! synchronously: the kernel tears it down later, and until the kernel
//! made a closing ring's task work terminate (`io_should_terminate_tw`,
//! 6.17) a receive woken meanwhile could still run its task work and write
//! into memory that was freed (`taskrun = coop | interrupt`). Memory an
//! operation may still use after the wait is leaked, not freed, and the
//! leak is logged.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Mutex as StdMutex, OnceLock};
use std::time::{Duration, Instant};

use io_uring::{IoUring, cqueue, opcode, squeue, types};

use super::{
    AcceptPause, ConnState, Core, DisconnectReason, Handler, Listener, OutFrame, Polled,
    PolledRead, ServerStats, earliest, stop_requested,
};
use crate::transport::TransportError;
use crate::transport::config::{IoConfig, RecvMode, TaskRun};
use crate::transport::ring::{self, Role};
use crate::transport::spin::Spinner;
use crate::transport::sys::{self, CmsgBuf};

/// Bound on each wait of the io_uring probe.
const PROBE_WAIT: Duration = Duration::from_secs(1);

/// Bound on the wait, when the loop ends, for the kernel to finish every
/// operation (see `quiesce`).
const QUIESCE_WAIT: Duration = Duration::from_secs(2);

/// Buffer group id of the receive buffer ring.
const BGID: u16 = 1;

/// A direct receive asks the decoder for at least this much room (as the
/// epoll backend's reads do), so that a 512-key request arrives in one or
/// two completions.
const DIRECT_RECV_MIN_BYTES: usize = 64 << 10;

// user_data layout: op (8 bits) | generation (24 bits) | slot (32 bits).
const OP_ACCEPT: u64 = 1;
const OP_RECV: u64 = 2;
const OP_SEND: u64 = 3;
const OP_WAKE: u64 = 4;
const OP_CANCEL: u64 = 5;

fn user_data(op: u64, generation: u32, slot: u32) -> u64 {
    op << 56 | (u64::from(generation) & 0xFF_FFFF) << 32 | u64::from(slot)
}

fn split_user_data(ud: u64) -> (u64, u32, u32) {
    (ud >> 56, ((ud >> 32) & 0xFF_FFFF) as u32, ud as u32)
}

/// Probe results per (sqpoll, taskrun) flag set.
type ProbeCache = HashMap<(bool, TaskRun), Result<(), String>>;

/// Checks that this kernel (and any seccomp policy) gives us a ring with
/// the configured flags, a provided-buffer ring and multishot receive, by
/// doing one real multishot receive on a socket pair. Cached per flag set.
///
/// The probe runs on a short-lived thread of its own: the kernel delivers a
/// ring's leftover work to the thread that submitted it as a notification
/// that interrupts that thread's blocking calls with `EINTR` (seen on
/// sockets with a receive timeout), and the caller's thread must not get
/// one from a ring it never asked for.
pub(crate) fn probe(cfg: &IoConfig) -> io::Result<()> {
    static CACHE: OnceLock<StdMutex<ProbeCache>> = OnceLock::new();
    let key = (cfg.sqpoll, cfg.taskrun);
    let cache = CACHE.get_or_init(Default::default);
    if let Some(r) = cache.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return r.clone().map_err(io::Error::other);
    }
    let r = std::thread::scope(|s| {
        std::thread::Builder::new()
            .name("cxlkv-uring-probe".into())
            .spawn_scoped(s, || probe_uncached(cfg))
            .map_err(|e| e.to_string())?
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("the io_uring probe panicked")))
            .map_err(|e| e.to_string())
    });
    cache
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key, r.clone());
    r.map_err(io::Error::other)
}

fn probe_uncached(cfg: &IoConfig) -> io::Result<()> {
    let mut ring = ring::build_ring(cfg, Role::Server, 8)?;
    if !ring.params().is_feature_ext_arg() {
        return Err(io::Error::other("kernel lacks IORING_FEAT_EXT_ARG"));
    }
    let bufs = BufRing::new(&ring, 2, 64)?;
    let (a, b) = std::os::unix::net::UnixStream::pair()?;
    let mut armed = false;
    let result = probe_receive(&mut ring, &a, &b, &mut armed);
    if armed {
        // Failed or timed out with the receive still in the kernel: end it
        // and wait (bounded) for its last completion.
        let _ = sys::shutdown(a.as_fd());
        let mut ended = false;
        armed = !cancel_and_reap(&mut ring, |cqe| {
            if let Some(cqe) = cqe {
                ended |= !cqueue::more(cqe.flags());
            }
            ended
        });
    }
    // The ring goes before the buffers its receive pointed into — on
    // every return, not only the successful one (locals drop in reverse
    // order of declaration, which would free `bufs` first).
    drop(ring);
    if armed {
        tracing::error!("the io_uring probe's receive did not end: its buffers are leaked");
        std::mem::forget(bufs);
    } else {
        drop(bufs);
    }
    result
}

/// The probe's receive: one byte, then end of stream. `armed` says whether
/// the multishot receive may still be in the kernel.
fn probe_receive(
    ring: &mut IoUring,
    a: &std::os::unix::net::UnixStream,
    b: &std::os::unix::net::UnixStream,
    armed: &mut bool,
) -> io::Result<()> {
    let recv = opcode::RecvMulti::new(types::Fd(a.as_raw_fd()), BGID)
        .build()
        .user_data(1);
    // SAFETY: the receive writes only into buffers of the probe's
    // `BufRing`, which is freed only after the receive ended or the ring
    // was dropped (`probe_uncached`).
    unsafe { ring.submission().push(&recv) }.map_err(|_| io::Error::other("probe ring full"))?;
    *armed = true;
    ring.submit()?;
    sys::send(b.as_fd(), b"x")?;
    // One byte, then end of stream: the multishot receive completes twice
    // and ends (no MORE flag), so no operation outlives the probe.
    let mut results = Vec::new();
    let until = Instant::now() + PROBE_WAIT;
    while *armed {
        let now = Instant::now();
        if now >= until {
            return Err(io::Error::other("multishot receive did not complete"));
        }
        ring::submit_and_wait(ring, Some(until - now))?;
        for cqe in ring.completion() {
            results.push(cqe.result());
            *armed &= cqueue::more(cqe.flags());
        }
        if !results.is_empty() && *armed {
            // The byte arrived: end the stream.
            sys::shutdown(b.as_fd())?;
        }
    }
    if results.first() != Some(&1) {
        return Err(io::Error::other(format!(
            "multishot receive failed: {:?}",
            results.first().map(|r| io::Error::from_raw_os_error(-r))
        )));
    }
    Ok(())
}

/// Cancels every operation of `ring` and reaps completions, handing each to
/// `retire` (`Some`), until `retire(None)` says no operation that matters
/// is left (true) or [`QUIESCE_WAIT`] passed (false). Operations not yet
/// submitted are submitted first (one never submitted would never
/// complete).
fn cancel_and_reap(
    ring: &mut IoUring,
    mut retire: impl FnMut(Option<&cqueue::Entry>) -> bool,
) -> bool {
    let _ = ring::submit(ring);
    let deadline = Instant::now() + QUIESCE_WAIT;
    match ring.submitter().register_sync_cancel(
        Some(types::Timespec::from(QUIESCE_WAIT)),
        types::CancelBuilder::any(),
    ) {
        // Cancelled (their completions are posted), or nothing in flight.
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            // Before 6.0 there is no synchronous cancel (EINVAL): an
            // asynchronous one of every request (5.19); the wait below is
            // bounded either way.
            tracing::debug!(error = %e, "io_uring synchronous cancel failed; cancelling asynchronously");
            let cancel = opcode::AsyncCancel2::new(types::CancelBuilder::any())
                .build()
                .user_data(user_data(OP_CANCEL, 0, 0));
            // SAFETY: a cancel points at no memory.
            if unsafe { ring.submission().push(&cancel) }.is_ok() {
                let _ = ring::submit(ring);
            }
        }
    }
    loop {
        for cqe in ring.completion() {
            retire(Some(&cqe));
        }
        if retire(None) {
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        if let Err(e) = ring::submit_and_wait(ring, Some(deadline - now)) {
            tracing::warn!(error = %e, "io_uring wait failed while ending the loop");
            return false;
        }
    }
}

/// Buffers a [`BufRing`] starts with (fewer if `recv_buffer_count` is
/// lower): 16 × 16 KiB stay in a core's L2 cache.
const INITIAL_LIVE_BUFFERS: u16 = 16;

/// A provided-buffer ring: up to `count` buffers of `size` bytes the kernel
/// picks from for multishot receives.
///
/// **Live set.** The kernel takes buffers from the ring's head in order and
/// we give each back at the tail as soon as its bytes are copied out, so
/// receives cycle through every buffer ever published. Publishing all
/// `count` at once (4 MiB by default) made every receive land in memory
/// not touched since many requests ago — cold lines that also push the
/// directory's index out of the core's cache. Measured on the 2-vCPU VM
/// (`cxlkv bench exists`, `floor_p50_us` of `batch=512`, a 55 KB request;
/// runs alternated): 33–37 µs with all 256 buffers against 28–30 µs with
/// 16 in one experiment, 29–36 against 27–32 µs in another; the spread
/// between runs is as large as the gain. So only `live` buffers circulate,
/// starting at [`INITIAL_LIVE_BUFFERS`]; a receive that finds none (one
/// turn of the loop received more than `live` buffers' worth before we
/// recycled them: many connections, or large frames) completes with
/// `ENOBUFS`, the set doubles (up to `count`) and the receive is re-armed.
/// The set never shrinks: a buffer is in the ring or being copied out at
/// any moment, so withdrawing one would need per-buffer state for a gain
/// that lasts only until the next burst.
struct BufRing {
    /// Page-aligned ring of `count` `BufRingEntry`s (mmap'd).
    entries: *mut types::BufRingEntry,
    ring_bytes: usize,
    bufs: Vec<u8>,
    size: usize,
    count: u16,
    /// Buffers `0..live` have been published; the rest never were (their
    /// memory is untouched, so it costs no resident pages).
    live: u16,
    tail: u16,
}

impl BufRing {
    fn new(ring: &IoUring, count: u16, size: u32) -> io::Result<Self> {
        if !count.is_power_of_two() || count > 32768 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "recv_buffer_count must be a power of two ≤ 32768",
            ));
        }
        let ring_bytes = usize::from(count) * std::mem::size_of::<types::BufRingEntry>();
        // SAFETY: anonymous private mapping; checked for MAP_FAILED below.
        let mem = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                ring_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if mem == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let mut this = Self {
            entries: mem.cast(),
            ring_bytes,
            bufs: vec![0u8; usize::from(count) * size as usize],
            size: size as usize,
            count,
            live: 0,
            tail: 0,
        };
        this.grow_to(INITIAL_LIVE_BUFFERS.min(count));
        // SAFETY: the ring memory is page-aligned (mmap), holds `count`
        // entries and stays mapped until after the ring is dropped (owners
        // drop the IoUring first).
        unsafe {
            ring.submitter()
                .register_buf_ring_with_flags(mem as u64, count, BGID, 0)?
        };
        Ok(this)
    }

    /// Publishes buffers `live..target` (never more than `count`).
    fn grow_to(&mut self, target: u16) {
        let target = target.min(self.count);
        for bid in self.live..target {
            self.recycle(bid);
        }
        self.live = self.live.max(target);
    }

    /// A receive found no buffer: doubles the live set (up to `count`).
    fn grow(&mut self) {
        self.grow_to(self.live.saturating_mul(2).max(1));
    }

    /// The first `len` bytes of buffer `bid`.
    fn get(&self, bid: u16, len: usize) -> &[u8] {
        let start = usize::from(bid) * self.size;
        &self.bufs[start..start + len.min(self.size)]
    }

    /// Gives buffer `bid` back to the kernel.
    fn recycle(&mut self, bid: u16) {
        let idx = usize::from(self.tail & (self.count - 1));
        let addr = self.bufs[usize::from(bid) * self.size..].as_mut_ptr() as u64;
        // SAFETY: `idx < count`, within the mapping; the kernel only reads
        // entries between its head and our published tail, and this one is
        // past the tail until the store below.
        unsafe {
            let e = &mut *self.entries.add(idx);
            e.set_addr(addr);
            e.set_len(self.size as u32);
            e.set_bid(bid);
        }
        self.tail = self.tail.wrapping_add(1);
        // SAFETY: the tail field overlays entry 0's reserved field and is
        // 2-aligned inside the mapping; the kernel reads it with an acquire
        // load, so Release publishes the entry written above.
        unsafe {
            let tail = types::BufRingEntry::tail(self.entries) as *mut u16;
            AtomicU16::from_ptr(tail).store(self.tail, Ordering::Release);
        }
    }
}

impl Drop for BufRing {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new`; the ring that
        // knew about it is gone (see field order of `Driver`).
        unsafe { libc::munmap(self.entries.cast(), self.ring_bytes) };
    }
}

/// A send in the kernel: the frames it writes (their heap bytes are what
/// the iovecs point at) and the message header.
struct SendOp {
    frames: Vec<OutFrame>,
    iov: Vec<libc::iovec>,
    msg: libc::msghdr,
    cmsg: CmsgBuf,
    /// Bytes of `frames` already written by earlier completions.
    done: usize,
    total: usize,
}

impl SendOp {
    fn new() -> Box<Self> {
        Box::new(SendOp {
            frames: Vec::new(),
            iov: Vec::new(),
            // SAFETY: an all-zero msghdr is a valid empty message.
            msg: unsafe { std::mem::zeroed() },
            cmsg: CmsgBuf::default(),
            done: 0,
            total: 0,
        })
    }
}

#[derive(Default)]
struct ConnIo {
    recv_armed: bool,
    send: Option<Box<SendOp>>,
    /// A finished send's op, kept (emptied) for the next send: a reply then
    /// costs no allocation here.
    spare: Option<Box<SendOp>>,
    /// `shutdown` issued; waiting for operations to drain.
    closing: bool,
}

/// How the driver receives ([`RecvMode`]), with what that mode needs.
enum Receives {
    /// Straight into each connection's decoder.
    Direct,
    /// Multishot, from this ring of provided buffers.
    Provided(BufRing),
}

struct Driver {
    // Field order matters: the ring is dropped before the buffers its
    // operations point into (and `run` returns, dropping the ring, before
    // its caller drops the connections' decoders). Dropping the ring does
    // not end its operations, though: `quiesce` does, before.
    ring: IoUring,
    recv: Receives,
    io: Vec<ConnIo>,
    closing: Vec<u32>,
    wake_buf: Box<u64>,
    /// The read of the wake eventfd (into `wake_buf`) is in the kernel.
    wake_armed: bool,
    /// The completions of this turn, taken from the ring; `next_cqe` is
    /// the first not yet handled (a loop left by an error or a panic
    /// leaves the rest to `quiesce`).
    cqes: Vec<cqueue::Entry>,
    next_cqe: usize,
    listener_fds: Vec<i32>,
    accept_pause: AcceptPause,
    /// Listeners whose accept ended and waits for the pause to end.
    paused_listeners: Vec<u32>,
    /// The connection read with plain `recv`s while the loop spins
    /// (`IoConfig::spin_recv`): no receive of its own in the ring meanwhile.
    polled: Polled,
    spin_recv: bool,
}

#[cfg(test)]
thread_local! {
    /// Operations the last `Driver` dropped on this thread still counted
    /// in the kernel when it was dropped, their memory about to be freed
    /// (must be 0: `quiesce` ends them or leaks their memory).
    static FREED_WITH_OPS_IN_FLIGHT: std::cell::Cell<Option<usize>> =
        const { std::cell::Cell::new(None) };
    /// Operations `quiesce` gave up on (their memory leaked) on this thread.
    static LEAKED_OPS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl Drop for Driver {
    fn drop(&mut self) {
        let left = self.ops_in_flight();
        if left > 0 {
            // Not reached: every way out of `run` passes `quiesce`.
            tracing::error!(
                ops = left,
                "io_uring driver dropped with operations in flight"
            );
        }
        #[cfg(test)]
        FREED_WITH_OPS_IN_FLIGHT.with(|c| c.set(Some(left)));
    }
}

pub(crate) fn run<H: Handler>(
    core: &mut Core<H>,
    listeners: &[Listener],
) -> Result<(), TransportError> {
    let io_cfg = core.cfg.io.clone();
    let ring = ring::build_ring(&io_cfg, Role::Server, io_cfg.ring_entries)
        .map_err(TransportError::Setup)?;
    let recv = match io_cfg.recv {
        RecvMode::Direct => Receives::Direct,
        RecvMode::Provided => Receives::Provided(
            BufRing::new(&ring, io_cfg.recv_buffer_count, io_cfg.recv_buffer_bytes)
                .map_err(TransportError::Setup)?,
        ),
    };
    let mut d = Driver {
        ring,
        recv,
        io: Vec::new(),
        closing: Vec::new(),
        wake_buf: Box::new(0),
        wake_armed: false,
        cqes: Vec::with_capacity(io_cfg.ring_entries as usize * 2),
        next_cqe: 0,
        listener_fds: listeners.iter().map(|l| l.fd().as_raw_fd()).collect(),
        accept_pause: AcceptPause::default(),
        paused_listeners: Vec::new(),
        polled: Polled::default(),
        // Only while the loop spins, and only into a connection's own
        // decoder (a provided-buffer receive stays armed in the ring).
        spin_recv: io_cfg.spin_recv && io_cfg.spin_us > 0 && io_cfg.recv == RecvMode::Direct,
    };
    // Every way out of the loop — a stop, an error (`?`), a handler's panic
    // unwinding — passes `quiesce` before the ring and the buffers its
    // operations point into are freed (module docs).
    let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        serve(&mut d, core, listeners, &io_cfg)
    }));
    d.quiesce(core);
    match served {
        Ok(result) => result,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// The loop, until a stop or an error.
fn serve<H: Handler>(
    d: &mut Driver,
    core: &mut Core<H>,
    listeners: &[Listener],
    io_cfg: &IoConfig,
) -> Result<(), TransportError> {
    for i in 0..listeners.len() {
        d.arm_accept(i as u32)?;
    }
    d.arm_wake(core)?;
    let spin = Duration::from_micros(u64::from(io_cfg.spin_us));
    let mut last_activity = Instant::now();
    // The last turn did work: the spin window starts at this turn's clock
    // reading, after that work (a long request does not shorten it).
    let mut busy = false;
    let mut spinner = Spinner::default();
    loop {
        if stop_requested(&core.shared) {
            break;
        }
        d.cqes.clear();
        d.next_cqe = 0;
        let Driver { ring, cqes, .. } = &mut *d;
        cqes.extend(ring.completion());
        let now = Instant::now();
        if busy {
            last_activity = now;
        }
        while let Some(cqe) = d.cqes.get(d.next_cqe).cloned() {
            d.next_cqe += 1;
            d.on_cqe(core, listeners, &cqe, now)?;
        }
        if d.accept_pause.due(now) {
            for listener in std::mem::take(&mut d.paused_listeners) {
                d.arm_accept(listener)?;
            }
        }
        let polled = d.poll_polled(core, now)?;
        let had_work = core.has_work();
        core.run_completions(now);
        if core.timers_due(now) {
            core.run_timers(now);
        }
        let sent = d.flush_dirty(core)?;
        // A connection that left `Open` gets no new receive (`on_recv`);
        // nothing else to do here (that list is the epoll backend's).
        core.input_closed.clear();
        d.teardown(core)?;
        if !d.ring.submission().is_empty() {
            d.submit()?;
        }
        busy = !d.cqes.is_empty() || had_work || sent || polled;
        if busy {
            if polled {
                // The other connections' receive work, which a loop kept
                // busy by the polled connection alone would otherwise
                // never enter the kernel to run: its completions are
                // reaped next turn.
                d.poll_kernel()?;
            }
            continue;
        }
        if now.duration_since(last_activity) < spin {
            if !d.poll_kernel()? {
                spinner.pause(now);
            }
            continue;
        }
        // About to sleep: the polled connection's receive goes back into
        // the ring, which is what wakes the loop.
        d.stop_polling(core)?;
        if core.prepare_sleep() {
            let timeout = earliest(core.next_timer(), d.accept_pause.deadline())
                .map(|t| t.saturating_duration_since(Instant::now()));
            d.wait(timeout)?;
            core.woke_up();
        }
    }
    core.close_all();
    d.teardown(core)?;
    // What is still in the kernel is ended by `quiesce` (in `run`).
    Ok(())
}

impl Driver {
    /// Operations in the kernel that point into memory the driver or the
    /// core frees: receives, sends, the wake read. (A multishot accept
    /// points at none.)
    fn ops_in_flight(&self) -> usize {
        let conns: usize = self
            .io
            .iter()
            .map(|io| usize::from(io.recv_armed) + usize::from(io.send.is_some()))
            .sum();
        conns + usize::from(self.wake_armed)
    }

    /// Ends every operation before the loop's memory is freed (module
    /// docs): shuts every connection's socket down (its receive completes,
    /// its send fails), cancels everything, reaps the completions — those
    /// a loop left by an error or a panic had taken and not handled
    /// first — within [`QUIESCE_WAIT`]. Memory an operation may still use
    /// after that is leaked, and logged. Calls no handler: after a panic
    /// the handler's state is not to be trusted.
    fn quiesce<H: Handler>(&mut self, core: &mut Core<H>) {
        for conn in core.conns.iter().flatten() {
            let _ = sys::shutdown(conn.fd.as_fd());
        }
        let unhandled: Vec<cqueue::Entry> = self.cqes.drain(self.next_cqe..).collect();
        self.next_cqe = self.cqes.len();
        for cqe in &unhandled {
            self.retire(cqe);
        }
        // Always, even with nothing counted in flight: the listeners'
        // multishot accepts are cancelled too (one completing after the
        // ring closed would leave a descriptor nobody owns).
        let Driver {
            ring,
            io,
            wake_armed,
            ..
        } = self;
        cancel_and_reap(ring, |cqe| {
            if let Some(cqe) = cqe {
                retire(io, wake_armed, cqe);
            }
            io.iter().all(|c| !c.recv_armed && c.send.is_none()) && !*wake_armed
        });
        let left = self.ops_in_flight();
        if left > 0 {
            tracing::error!(
                ops = left,
                wait_ms = QUIESCE_WAIT.as_millis() as u64,
                "io_uring operations were still in the kernel when the loop ended: \
                 the memory they point into is leaked, not freed"
            );
            #[cfg(test)]
            LEAKED_OPS.with(|c| c.set(c.get() + left));
            self.leak_in_flight(core);
        }
    }

    /// Bookkeeping of a completion seen while ending the loop.
    fn retire(&mut self, cqe: &cqueue::Entry) {
        retire(&mut self.io, &mut self.wake_armed, cqe);
    }

    /// Gives up on operations still in the kernel: the memory each may use
    /// is leaked (never freed) instead of freed under it.
    fn leak_in_flight<H: Handler>(&mut self, core: &mut Core<H>) {
        let mut recv_armed = false;
        for (slot, io) in self.io.iter_mut().enumerate() {
            if let Some(op) = io.send.take() {
                std::mem::forget(op);
            }
            if io.recv_armed {
                io.recv_armed = false;
                recv_armed = true;
                if matches!(self.recv, Receives::Direct)
                    && let Some(conn) = core.conns.get_mut(slot).and_then(Option::as_mut)
                {
                    std::mem::forget(std::mem::take(&mut conn.decoder));
                }
            }
        }
        if recv_armed
            && let Receives::Provided(bufs) = std::mem::replace(&mut self.recv, Receives::Direct)
        {
            std::mem::forget(bufs);
        }
        if self.wake_armed {
            self.wake_armed = false;
            std::mem::forget(std::mem::replace(&mut self.wake_buf, Box::new(0)));
        }
    }

    fn push(&mut self, sqe: &squeue::Entry) -> Result<(), TransportError> {
        loop {
            // SAFETY: every entry built by this driver points only at memory
            // kept alive and in place until the operation's completion or
            // until the ring is dropped: send ops own their frames; a direct
            // receive writes into its connection's decoder, which
            // `begin_receive` keeps from moving those bytes and which the
            // core keeps until `teardown` has seen the receive complete (and
            // after the ring, which `run` drops first); a multishot receive
            // uses the provided buffers of `recv`; the wake read uses
            // `wake_buf`.
            if unsafe { self.ring.submission().push(sqe) }.is_ok() {
                return Ok(());
            }
            // Full: hand what is queued to the kernel, then retry.
            self.submit()?;
        }
    }

    fn submit(&mut self) -> Result<(), TransportError> {
        ring::submit(&self.ring).map_err(TransportError::Io)
    }

    /// While spinning: let the kernel run pending receive work when it says
    /// there is some (TASKRUN flag), without waiting. True if it did (the
    /// completions are then waiting to be reaped).
    fn poll_kernel(&mut self) -> Result<bool, TransportError> {
        if !ring::needs_task_run(&mut self.ring) {
            return Ok(false);
        }
        ring::run_task_work(&self.ring).map_err(TransportError::Io)?;
        Ok(true)
    }

    fn wait(&mut self, timeout: Option<Duration>) -> Result<(), TransportError> {
        ring::submit_and_wait(&self.ring, timeout).map_err(TransportError::Io)
    }

    fn arm_accept(&mut self, listener: u32) -> Result<(), TransportError> {
        let fd = self.listener_fds[listener as usize];
        let sqe = opcode::AcceptMulti::new(types::Fd(fd))
            .flags(libc::SOCK_CLOEXEC)
            .build()
            .user_data(user_data(OP_ACCEPT, 0, listener));
        self.push(&sqe)
    }

    fn arm_wake<H: Handler>(&mut self, core: &Core<H>) -> Result<(), TransportError> {
        let buf: *mut u64 = &mut *self.wake_buf;
        let sqe = opcode::Read::new(types::Fd(core.shared.eventfd.as_raw_fd()), buf.cast(), 8)
            .build()
            .user_data(user_data(OP_WAKE, 0, 0));
        // Armed once queued: a failed push queued nothing, and `quiesce`
        // must not wait for its completion.
        self.push(&sqe)?;
        self.wake_armed = true;
        Ok(())
    }

    /// Arms the connection's receive: a direct one into its decoder, or a
    /// multishot one from the provided buffers.
    fn arm_recv<H: Handler>(
        &mut self,
        core: &mut Core<H>,
        slot: u32,
        generation: u32,
    ) -> Result<(), TransportError> {
        let Some(conn) = core.conn_mut(slot) else {
            return Ok(());
        };
        let fd = types::Fd(conn.fd.as_raw_fd());
        let sqe = match self.recv {
            Receives::Direct => {
                let (at, len) = conn.decoder.begin_receive(DIRECT_RECV_MIN_BYTES);
                let len = u32::try_from(len).unwrap_or(u32::MAX);
                opcode::Recv::new(fd, at, len).build()
            }
            Receives::Provided(_) => opcode::RecvMulti::new(fd, BGID).build(),
        };
        let sqe = sqe.user_data(user_data(OP_RECV, generation, slot));
        // Armed once queued (see `arm_wake`).
        self.push(&sqe)?;
        self.io_mut(slot).recv_armed = true;
        Ok(())
    }

    fn io_mut(&mut self, slot: u32) -> &mut ConnIo {
        if self.io.len() <= slot as usize {
            self.io.resize_with(slot as usize + 1, ConnIo::default);
        }
        &mut self.io[slot as usize]
    }

    fn on_cqe<H: Handler>(
        &mut self,
        core: &mut Core<H>,
        listeners: &[Listener],
        cqe: &cqueue::Entry,
        now: Instant,
    ) -> Result<(), TransportError> {
        let (op, generation, slot) = split_user_data(cqe.user_data());
        let res = cqe.result();
        let more = cqueue::more(cqe.flags());
        match op {
            OP_WAKE => {
                // The eventfd counter was reset by the read; completions are
                // picked up by the loop right after.
                self.wake_armed = false;
                self.arm_wake(core)?;
            }
            OP_ACCEPT => {
                if res >= 0 {
                    self.accept_pause.accepted();
                    // SAFETY: a successful accept completion's result is a new
                    // descriptor owned by us.
                    let fd = unsafe { sys::own_fd(res) };
                    self.admit(core, &listeners[slot as usize], fd)?;
                } else if res != -libc::ECANCELED {
                    let e = io::Error::from_raw_os_error(-res);
                    if AcceptPause::is_transient(-res) {
                        tracing::debug!(error = %e, "accept failed");
                    } else {
                        self.accept_pause.pause(&e, now);
                        if !more {
                            // Out of descriptors, say: re-armed now, it
                            // would fail again at once. Re-armed after the
                            // pause.
                            self.paused_listeners.push(slot);
                            return Ok(());
                        }
                    }
                }
                if !more {
                    self.arm_accept(slot)?;
                }
            }
            OP_RECV => {
                if !more {
                    self.io_mut(slot).recv_armed = false;
                }
                self.on_recv(core, slot, generation, cqe, now)?;
            }
            OP_SEND => self.on_send(core, slot, res)?,
            _ => {} // OP_CANCEL: nothing to do either way.
        }
        Ok(())
    }

    fn admit<H: Handler>(
        &mut self,
        core: &mut Core<H>,
        l: &Listener,
        fd: std::os::fd::OwnedFd,
    ) -> Result<(), TransportError> {
        let peer = match l.peer_of(&fd) {
            Ok(p) => p,
            Err(e) => {
                tracing::debug!(error = %e, "peer vanished during accept");
                return Ok(());
            }
        };
        if let Some(slot) = core.admit(fd, peer) {
            let generation = core.conns[slot as usize]
                .as_ref()
                .map_or(0, |c| c.id.generation());
            let io = self.io_mut(slot);
            debug_assert!(!io.recv_armed && io.send.is_none());
            io.closing = false;
            self.arm_recv(core, slot, generation)?;
        }
        Ok(())
    }

    fn on_recv<H: Handler>(
        &mut self,
        core: &mut Core<H>,
        slot: u32,
        generation: u32,
        cqe: &cqueue::Entry,
        now: Instant,
    ) -> Result<(), TransportError> {
        let res = cqe.result();
        let current = core.conns.get(slot as usize).and_then(Option::as_ref);
        let ours = current.is_some_and(|c| c.id.generation() & 0xFF_FFFF == generation);
        match &mut self.recv {
            Receives::Direct => {
                // A direct receive: the connection keeps its slot (and its
                // decoder) until this completion, so it is always ours.
                debug_assert!(ours, "a direct receive outlived its connection");
                if ours && let Some(conn) = core.conn_mut(slot) {
                    conn.decoder.end_receive(usize::try_from(res).unwrap_or(0));
                    if res > 0 && conn.state == ConnState::Open {
                        core.process_input(slot, now);
                    }
                }
            }
            Receives::Provided(bufs) => {
                let bid = cqueue::buffer_select(cqe.flags());
                if res > 0 {
                    let bid = bid.expect("a successful provided-buffer receive names its buffer");
                    let mut data = bufs.get(bid, res as usize);
                    // More than the decoder has room for (a large buffer
                    // after most of a maximum frame): what fits, then decode
                    // the frames it completes, which makes room, and so on.
                    while ours
                        && !data.is_empty()
                        && let Some(conn) = core.conn_mut(slot)
                        && conn.state == ConnState::Open
                    {
                        let spare = conn.decoder.spare(data.len());
                        let n = spare.len().min(data.len());
                        if n == 0 {
                            // Cannot happen: the decoder holds no whole frame
                            // here (each piece is decoded before the next),
                            // so `spare` leaves it room. Were it wrong, only
                            // this connection would suffer.
                            debug_assert!(false, "a frame decoder without room after decoding");
                            core.close(slot, DisconnectReason::Io(io::ErrorKind::OutOfMemory));
                            break;
                        }
                        spare[..n].copy_from_slice(&data[..n]);
                        conn.decoder.filled(n);
                        data = &data[n..];
                        core.process_input(slot, now);
                    }
                    bufs.recycle(bid);
                } else if let Some(bid) = bid {
                    bufs.recycle(bid);
                }
            }
        }
        if !ours {
            return Ok(());
        }
        let armed = self.io[slot as usize].recv_armed;
        match res {
            0 => {
                // End of stream: the peer may still read its replies.
                let gone = core.conns[slot as usize]
                    .as_ref()
                    .is_some_and(|c| sys::peer_hung_up(c.fd.as_fd()));
                core.input_ended(slot, now, gone);
            }
            r if r == -libc::ENOBUFS => {
                // Every live buffer was in use; they are recycled by now,
                // and the live set grows so that the next burst fits.
                ServerStats::bump(&core.shared.stats.recv_buffers_exhausted);
                if let Receives::Provided(bufs) = &mut self.recv {
                    bufs.grow();
                }
                if !armed && !self.io[slot as usize].closing {
                    self.arm_recv(core, slot, generation)?;
                }
            }
            r if r < 0 && r != -libc::ECANCELED => core.close(
                slot,
                DisconnectReason::Io(io::Error::from_raw_os_error(-r).kind()),
            ),
            _ => {
                let open = core.conns[slot as usize]
                    .as_ref()
                    .is_some_and(|c| c.state == ConnState::Open);
                if !armed && open && !self.io[slot as usize].closing {
                    // A request's bytes: the loop may read this connection
                    // itself while it spins instead (`poll_polled`).
                    let id = core.conns[slot as usize].as_ref().map(|c| c.id);
                    let polled = res > 0
                        && self.spin_recv
                        && id.is_some_and(|id| self.polled.offer(id, now));
                    if !polled {
                        self.arm_recv(core, slot, generation)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// One plain `recv` from the polled connection (`IoConfig::spin_recv`);
    /// one that went idle gets its ring receive back. True if it read
    /// something or its input ended (the turn did work).
    fn poll_polled<H: Handler>(
        &mut self,
        core: &mut Core<H>,
        now: Instant,
    ) -> Result<bool, TransportError> {
        // The polled connection is the one in its slot (a released slot is
        // forgotten: `teardown`) and has no receive in the ring.
        debug_assert!(
            self.polled.id().is_none_or(|id| {
                core.conns
                    .get(id.slot() as usize)
                    .and_then(Option::as_ref)
                    .map(|c| c.id)
                    == Some(id)
                    && !self.io[id.slot() as usize].recv_armed
            }),
            "a polled connection with a receive in the ring: both would write into its decoder"
        );
        match self.polled.poll(core, now) {
            PolledRead::None | PolledRead::Empty => Ok(false),
            PolledRead::Read | PolledRead::Over => Ok(true),
            PolledRead::Idle => {
                self.stop_polling(core)?;
                Ok(false)
            }
        }
    }

    /// The polled connection, if any, is waited for through the ring again.
    fn stop_polling<H: Handler>(&mut self, core: &mut Core<H>) -> Result<(), TransportError> {
        let Some(id) = self.polled.take() else {
            return Ok(());
        };
        let slot = id.slot();
        let Some(conn) = core.conns.get(slot as usize).and_then(Option::as_ref) else {
            return Ok(());
        };
        let io = self.io_mut(slot);
        if conn.id == id && conn.state == ConnState::Open && !io.recv_armed && !io.closing {
            let generation = id.generation() & 0xFF_FFFF;
            self.arm_recv(core, slot, generation)?;
        }
        Ok(())
    }

    fn on_send<H: Handler>(
        &mut self,
        core: &mut Core<H>,
        slot: u32,
        res: i32,
    ) -> Result<(), TransportError> {
        let Some(mut op) = self.io_mut(slot).send.take() else {
            return Ok(());
        };
        let closing = self.io[slot as usize].closing;
        if closing {
            return Ok(()); // teardown drops `op` (its frames) now that the kernel is done
        }
        if res < 0 {
            core.write_failed(slot, io::Error::from_raw_os_error(-res).kind());
            return Ok(());
        }
        op.done += res as usize;
        if op.done < op.total {
            // Partial write: descriptors went with the first byte; send the rest.
            op.cmsg = CmsgBuf::default();
            self.start_send(core, slot, op)?;
            return Ok(());
        }
        // Sent: descriptors and bytes are the kernel's now. The next batch,
        // or (nothing left) `on_flushed`.
        op.frames.clear();
        self.io[slot as usize].spare = Some(op);
        self.flush(core, slot)
    }

    fn flush_dirty<H: Handler>(&mut self, core: &mut Core<H>) -> Result<bool, TransportError> {
        let mut dirty = std::mem::take(&mut core.dirty);
        let any = !dirty.is_empty();
        dirty.sort_unstable();
        dirty.dedup();
        for &slot in &dirty {
            self.flush(core, slot)?;
        }
        dirty.clear();
        if core.dirty.is_empty() {
            core.dirty = dirty;
        }
        Ok(any)
    }

    /// Starts a send of the queued frames unless one is in flight; with
    /// nothing queued and nothing being written, tells the core
    /// (`on_flushed`: a closing connection is done).
    fn flush<H: Handler>(&mut self, core: &mut Core<H>, slot: u32) -> Result<(), TransportError> {
        if self.io_mut(slot).send.is_some() || self.io[slot as usize].closing {
            return Ok(());
        }
        let Some(conn) = core.conn_mut(slot) else {
            return Ok(());
        };
        if conn.state == ConnState::Dead {
            return Ok(());
        }
        if conn.sendq.is_empty() {
            core.on_flushed(slot);
            return Ok(());
        }
        // A lone reply and no send in flight (the common case: one request,
        // one reply): one non-blocking `send` now. It completes inline
        // unless the socket buffer is full, and spares the submission, its
        // completion and a turn of the loop between the reply and the wire
        // (module docs). What it leaves goes through the ring.
        let mut done = 0;
        if let Some(bytes) = conn.sendq.lone_frame() {
            debug_assert_eq!(bytes.len(), conn.sendq.bytes(), "nothing partly written");
            match sys::send(conn.fd.as_fd(), bytes) {
                Ok(n) if n == bytes.len() => {
                    conn.sendq.advance(n);
                    core.on_flushed(slot);
                    return Ok(());
                }
                Ok(n) => done = n,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => {
                    core.write_failed(slot, e.kind());
                    return Ok(());
                }
            }
        }
        let mut op = self.io[slot as usize]
            .spare
            .take()
            .unwrap_or_else(SendOp::new);
        debug_assert!(op.frames.is_empty());
        conn.sendq.pop_batch(&mut op.frames);
        op.total = op.frames.iter().map(|f| f.bytes.len()).sum();
        op.done = done;
        self.start_send(core, slot, op)
    }

    /// Points `op`'s header at its unsent bytes and submits it.
    fn start_send<H: Handler>(
        &mut self,
        core: &mut Core<H>,
        slot: u32,
        mut op: Box<SendOp>,
    ) -> Result<(), TransportError> {
        let Some(conn) = core.conns.get(slot as usize).and_then(Option::as_ref) else {
            return Ok(());
        };
        let (fd, generation) = (conn.fd.as_raw_fd(), conn.id.generation());
        let ud = user_data(OP_SEND, generation, slot);
        if let [f] = op.frames.as_slice()
            && f.fds.is_empty()
        {
            // One frame, no descriptors (the common reply): a plain SEND
            // spares the kernel copying a message header.
            let rest = &f.bytes[op.done..];
            // Fits: a frame is at most MAX_FRAME_BYTES (8 MiB and a header).
            let sqe = opcode::Send::new(types::Fd(fd), rest.as_ptr(), rest.len() as u32)
                .flags(libc::MSG_NOSIGNAL)
                .build()
                .user_data(ud);
            // The box keeps the frame's bytes at a stable address until the
            // completion hands it back to `on_send`.
            self.io[slot as usize].send = Some(op);
            return self.push(&sqe);
        }
        let mut skip = op.done;
        let mut iov = std::mem::take(&mut op.iov);
        iov.clear();
        for f in &op.frames {
            if skip >= f.bytes.len() {
                skip -= f.bytes.len();
                continue;
            }
            let rest = &f.bytes[skip..];
            skip = 0;
            iov.push(libc::iovec {
                iov_base: rest.as_ptr() as *mut _,
                iov_len: rest.len(),
            });
        }
        op.iov = iov;
        let fds: Vec<i32> = if op.done == 0 {
            op.frames
                .iter()
                .flat_map(|f| f.fds.iter().map(AsRawFd::as_raw_fd))
                .collect()
        } else {
            Vec::new()
        };
        let slices: &[std::io::IoSlice<'_>] =
            // SAFETY: IoSlice is guaranteed ABI-compatible with iovec on Unix.
            unsafe { std::slice::from_raw_parts(op.iov.as_ptr().cast(), op.iov.len()) };
        op.msg = sys::msghdr_with_fds(slices, &fds, &mut op.cmsg).map_err(TransportError::Io)?;
        let sqe = opcode::SendMsg::new(types::Fd(fd), &op.msg)
            .flags(libc::MSG_NOSIGNAL as u32)
            .build()
            .user_data(ud);
        // The box keeps msg/iov/cmsg/frames at stable addresses until the
        // completion hands it back to `on_send`.
        self.io[slot as usize].send = Some(op);
        self.push(&sqe)
    }

    /// Tears down dead connections whose operations have all completed.
    fn teardown<H: Handler>(&mut self, core: &mut Core<H>) -> Result<(), TransportError> {
        for slot in std::mem::take(&mut core.dead) {
            let Some(fd) = core
                .conns
                .get(slot as usize)
                .and_then(Option::as_ref)
                .map(|c| c.fd.as_raw_fd())
            else {
                continue;
            };
            let generation = core.conns[slot as usize]
                .as_ref()
                .map_or(0, |c| c.id.generation());
            let io = self.io_mut(slot);
            io.closing = true;
            if io.recv_armed {
                if let Some(c) = core.conns[slot as usize].as_ref() {
                    // Ends the multishot receive (it completes with 0).
                    let _ = sys::shutdown(c.fd.as_fd());
                }
                let cancel = opcode::AsyncCancel::new(user_data(OP_RECV, generation, slot))
                    .build()
                    .user_data(user_data(OP_CANCEL, 0, slot));
                self.push(&cancel)?;
            } else if io.send.is_some()
                && let Some(c) = core.conns[slot as usize].as_ref()
            {
                let _ = sys::shutdown(c.fd.as_fd());
            }
            let _ = fd;
            self.closing.push(slot);
        }
        let mut i = 0;
        while i < self.closing.len() {
            let slot = self.closing[i];
            let io = &self.io[slot as usize];
            if io.recv_armed || io.send.is_some() {
                i += 1;
                continue;
            }
            self.closing.swap_remove(i);
            self.io[slot as usize].closing = false;
            self.polled.forget_slot(slot);
            drop(core.release(slot));
        }
        Ok(())
    }
}

/// What a completion seen while ending the loop (`Driver::quiesce`) ends:
/// a receive (unless more completions follow), a send (its frames are
/// dropped: the kernel is done with them), the wake read. A connection
/// accepted meanwhile is closed.
fn retire(io: &mut [ConnIo], wake_armed: &mut bool, cqe: &cqueue::Entry) {
    let (op, _, slot) = split_user_data(cqe.user_data());
    let more = cqueue::more(cqe.flags());
    match op {
        OP_RECV if !more => {
            if let Some(io) = io.get_mut(slot as usize) {
                io.recv_armed = false;
            }
        }
        OP_SEND => {
            if let Some(io) = io.get_mut(slot as usize) {
                io.send = None;
            }
        }
        OP_WAKE => *wake_armed = false,
        OP_ACCEPT if cqe.result() >= 0 => {
            // SAFETY: a successful accept completion's result is a new
            // descriptor owned by us; dropping it closes it.
            drop(unsafe { sys::own_fd(cqe.result()) });
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    use std::sync::mpsc;

    use super::*;
    use crate::frame::{Frame, FrameHeader, encode_frame};
    use crate::transport::config::{BackendChoice, Endpoint, ServerConfig};
    use crate::transport::{ConnId, Rejection, Replies, Server};

    const ECHO: u16 = 1;
    const PANIC: u16 = 9;

    /// Echoes, or panics on `PANIC` (a handler bug).
    struct PanicOn;

    impl Handler for PanicOn {
        fn on_frame(&mut self, conn: ConnId, frame: Frame<'_>, out: &mut Replies) {
            let h = frame.header;
            assert_ne!(h.kind, PANIC, "the test handler was asked to panic");
            out.send(conn, h.kind + 100, h.request_id, frame.payload)
                .unwrap();
        }

        fn on_rejected(&mut self, _: ConnId, _: FrameHeader, _: Rejection, _: &mut Replies) {}
    }

    fn request(kind: u16, id: u64) -> Vec<u8> {
        let mut v = Vec::new();
        encode_frame(&mut v, kind, id, b"ping").unwrap();
        v
    }

    /// A handler's panic unwinds out of the io_uring loop with receives
    /// armed (an idle connection's, in its decoder or in the provided
    /// buffers), the wake read armed, and — with `taskrun = interrupt` or
    /// `coop` — the kernel free to run a receive's task work on this thread
    /// after its ring was closed. In every task-run mode and both receive
    /// modes: The loop must end every operation before the
    /// driver frees its memory (it used to drop the ring and everything
    /// with them in flight). Runs the loop on a thread of the test's, so
    /// that the driver's record of what it dropped can be read there.
    #[test]
    fn a_handler_panic_ends_every_ring_operation_before_the_loop_frees_their_memory() {
        let modes = [TaskRun::Interrupt, TaskRun::Coop, TaskRun::Defer]
            .into_iter()
            .flat_map(|t| [(t, RecvMode::Direct), (t, RecvMode::Provided)]);
        for (taskrun, recv) in modes {
            let mut cfg = ServerConfig::default();
            cfg.io.backend = BackendChoice::Uring;
            cfg.io.taskrun = taskrun;
            cfg.io.recv = recv;
            if let Err(e) = probe(&cfg.io) {
                eprintln!("io_uring unavailable, nothing to test: {e}");
                return;
            }
            let path = std::env::temp_dir().join(format!(
                "cxlkv-uring-quiesce-{}-{taskrun:?}-{recv:?}.sock",
                std::process::id()
            ));
            let _ = std::fs::remove_file(&path);
            let server = Server::bind(cfg, &[Endpoint::Unix(path.clone())]).unwrap();
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                let run =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| server.run(PanicOn)));
                let freed = FREED_WITH_OPS_IN_FLIGHT.with(std::cell::Cell::take);
                let leaked = LEAKED_OPS.with(std::cell::Cell::take);
                let _ = tx.send((run.is_err(), freed, leaked));
            });
            let long = Duration::from_secs(20);
            // An idle connection with its receive armed: one round trip
            // proves it was accepted and its receive re-armed.
            let mut idle = UnixStream::connect(&path).unwrap();
            idle.set_read_timeout(Some(long)).unwrap();
            idle.write_all(&request(ECHO, 1)).unwrap();
            let mut reply = [0u8; 32];
            idle.read_exact(&mut reply).unwrap();
            let mut culprit = UnixStream::connect(&path).unwrap();
            culprit.write_all(&request(PANIC, 2)).unwrap();
            let (panicked, freed, leaked) = rx.recv_timeout(long).expect("the loop ended");
            assert!(
                panicked,
                "{taskrun:?} {recv:?}: the handler's panic reaches the caller"
            );
            assert_eq!(
                freed,
                Some(0),
                "{taskrun:?} {recv:?}: operations in flight when the driver freed its memory"
            );
            // And they ended: none had to be given up on (leaked).
            assert_eq!(
                leaked, 0,
                "{taskrun:?} {recv:?}: operations the kernel did not end"
            );
            // The idle peer was shut down: end of stream, not a hang.
            let mut rest = Vec::new();
            idle.read_to_end(&mut rest).unwrap();
            let _ = std::fs::remove_file(&path);
        }
    }
}
