//! The fallback server backend: level-triggered epoll over non-blocking
//! sockets. It waits the same way the io_uring backend does — polls with a
//! zero timeout for `spin_us` after the last event, then blocks — so the two
//! differ only in the system calls they make.
//!
//! Level-triggered readiness repeats for as long as its condition holds, so
//! the driver watches only what it will act on: a connection's input only
//! while it is `Open` (a closing one reads nothing more, and its unread
//! input — or its end of stream — would wake the loop at every turn), its
//! writability only while a write is blocked, and a listener not while
//! accepting is paused (`AcceptPause`: the connection waiting in its
//! backlog would report it ready at once).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use super::{
    AcceptPause, ConnState, Core, DisconnectReason, Handler, Listener, Polled, PolledRead,
    RecvOnce, earliest, stop_requested,
};
use crate::transport::TransportError;
use crate::transport::spin::Spinner;
use crate::transport::sys;

/// epoll tokens: connection slots are small numbers; these sit at the top.
const WAKE_TOKEN: u64 = u64::MAX;
const LISTENER_TOKEN_BASE: u64 = u64::MAX - 1024;
/// Events taken per `epoll_wait`.
const MAX_EVENTS: usize = 256;
/// Bytes read from one connection per readiness event (fairness: one fast
/// sender cannot starve the others).
const READ_BUDGET_BYTES: usize = 256 << 10;
/// Bytes asked of the decoder per `recv`.
const READ_CHUNK_BYTES: usize = 64 << 10;
/// While a connection is polled, `epoll_wait` runs every this many turns.
const POLLED_WAIT_EVERY: u32 = 4;
/// Connections accepted per listener readiness event.
const ACCEPT_BATCH: usize = 64;

struct Epoll {
    fd: OwnedFd,
}

impl Epoll {
    fn new() -> io::Result<Self> {
        // SAFETY: plain syscall; a non-negative result is a new descriptor.
        let raw = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` was just returned by epoll_create1; nobody else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(Self { fd })
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: `ev` is a valid epoll_event for the call's duration.
        if unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), op, fd, &mut ev) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn wait(
        &self,
        events: &mut [libc::epoll_event],
        timeout: Option<Duration>,
    ) -> io::Result<usize> {
        let ms = match timeout {
            None => -1,
            Some(d) => d.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int,
        };
        // SAFETY: `events` is writable for `len` entries.
        let n = unsafe {
            libc::epoll_wait(
                self.fd.as_raw_fd(),
                events.as_mut_ptr(),
                events.len() as libc::c_int,
                ms,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted {
                Ok(0)
            } else {
                Err(e)
            };
        }
        Ok(n as usize)
    }
}

fn accept(listener: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    // SAFETY: null address pointers are allowed; a non-negative result is a
    // new descriptor owned by us.
    let raw = unsafe {
        libc::accept4(
            listener.as_raw_fd(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    Ok(unsafe { sys::own_fd(raw) })
}

pub(crate) fn run<H: Handler>(
    core: &mut Core<H>,
    listeners: &[Listener],
) -> Result<(), TransportError> {
    let ep = Epoll::new().map_err(TransportError::Setup)?;
    for (i, l) in listeners.iter().enumerate() {
        ep.ctl(
            libc::EPOLL_CTL_ADD,
            l.fd().as_raw_fd(),
            libc::EPOLLIN as u32,
            LISTENER_TOKEN_BASE + i as u64,
        )
        .map_err(TransportError::Setup)?;
    }
    ep.ctl(
        libc::EPOLL_CTL_ADD,
        core.shared.eventfd.as_raw_fd(),
        libc::EPOLLIN as u32,
        WAKE_TOKEN,
    )
    .map_err(TransportError::Setup)?;
    let mut driver = Driver {
        ep,
        interest: Vec::new(),
        writable_wanted: Vec::new(),
        accept_pause: AcceptPause::default(),
        paused_listeners: Vec::new(),
        polled: Polled::default(),
        turns_without_wait: 0,
        // Only while the loop spins.
        spin_recv: core.cfg.io.spin_recv && core.cfg.io.spin_us > 0,
    };
    let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; MAX_EVENTS];
    let spin = Duration::from_micros(u64::from(core.cfg.io.spin_us));
    let mut last_activity = Instant::now();
    // The last turn did work: the spin window starts at this turn's clock
    // reading, after that work (a long request does not shorten it).
    let mut busy = false;
    let mut spinner = Spinner::default();
    loop {
        if stop_requested(&core.shared) {
            break;
        }
        let now = Instant::now();
        if busy {
            last_activity = now;
        }
        let idle = now.duration_since(last_activity) >= spin;
        if idle {
            // About to sleep: epoll's readiness wakes the loop for it.
            driver.polled.take();
        }
        // The polled connection first: its bytes are read without waiting
        // for epoll to report them (a `recv` instead of an `epoll_wait` and
        // a `recv`).
        let polled = match driver.polled.poll(core, now) {
            PolledRead::None | PolledRead::Empty => false,
            PolledRead::Read | PolledRead::Over => true,
            PolledRead::Idle => {
                driver.polled.take();
                false
            }
        };
        // While one is polled, epoll is asked only every
        // `POLLED_WAIT_EVERY` turns: every turn would halve how often the
        // polled connection is read. The others wait at most that many
        // turns (each a `recv` and a few hundred nanoseconds) longer.
        let skip_wait = driver.polled.id().is_some() && {
            driver.turns_without_wait += 1;
            driver.turns_without_wait < POLLED_WAIT_EVERY
        };
        let asleep = idle && core.prepare_sleep();
        let n = if skip_wait {
            0
        } else {
            driver.turns_without_wait = 0;
            let timeout = if asleep {
                earliest(core.next_timer(), driver.accept_pause.deadline())
                    .map(|t| t.saturating_duration_since(now))
            } else {
                Some(Duration::ZERO)
            };
            ep_wait(&driver.ep, &mut events, timeout)?
        };
        if asleep {
            core.woke_up();
        }
        let now = Instant::now();
        for ev in &events[..n] {
            let (token, flags) = (ev.u64, ev.events);
            if token == WAKE_TOKEN {
                sys::eventfd_drain(core.shared.eventfd.as_fd()).map_err(TransportError::Io)?;
            } else if token >= LISTENER_TOKEN_BASE {
                let index = (token - LISTENER_TOKEN_BASE) as usize;
                driver.accept_from(core, &listeners[index], index, now)?;
            } else {
                driver.on_conn_event(core, token as u32, flags, now);
            }
        }
        if driver.accept_pause.due(now) {
            driver.resume_accepting(listeners)?;
        }
        let had_work = core.has_work();
        core.run_completions(now);
        if core.timers_due(now) {
            core.run_timers(now);
        }
        let flushed = driver.flush_dirty(core);
        for slot in std::mem::take(&mut core.input_closed) {
            driver.update_interest(core, slot);
        }
        driver.teardown(core);
        busy = n > 0 || had_work || flushed || polled;
        if !busy && !asleep {
            spinner.pause(now);
        }
    }
    core.close_all();
    driver.teardown(core);
    Ok(())
}

fn ep_wait(
    ep: &Epoll,
    events: &mut [libc::epoll_event],
    timeout: Option<Duration>,
) -> Result<usize, TransportError> {
    ep.wait(events, timeout).map_err(TransportError::Io)
}

struct Driver {
    ep: Epoll,
    /// Per slot: the events registered for its socket.
    interest: Vec<u32>,
    /// Per slot: a write hit EAGAIN, EPOLLOUT is wanted.
    writable_wanted: Vec<bool>,
    accept_pause: AcceptPause,
    /// Listeners not watched while accepting is paused.
    paused_listeners: Vec<usize>,
    /// The connection read with plain `recv`s while the loop spins
    /// (`IoConfig::spin_recv`); it stays registered with epoll.
    polled: Polled,
    /// Turns since the last `epoll_wait` (while a connection is polled).
    turns_without_wait: u32,
    spin_recv: bool,
}

impl Driver {
    fn accept_from<H: Handler>(
        &mut self,
        core: &mut Core<H>,
        l: &Listener,
        index: usize,
        now: Instant,
    ) -> Result<(), TransportError> {
        for _ in 0..ACCEPT_BATCH {
            let fd = match accept(l.fd()) {
                Ok(fd) => fd,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                // The peer gave up before we accepted: that one connection
                // is lost, the next may be there.
                Err(e) if e.raw_os_error().is_some_and(AcceptPause::is_transient) => {
                    tracing::debug!(error = %e, "accept failed");
                    continue;
                }
                // Out of descriptors, say: it would fail again at once (and
                // the listener stays ready). Not watched until the pause ends.
                Err(e) => {
                    self.ep
                        .ctl(
                            libc::EPOLL_CTL_MOD,
                            l.fd().as_raw_fd(),
                            0,
                            LISTENER_TOKEN_BASE + index as u64,
                        )
                        .map_err(TransportError::Io)?;
                    self.paused_listeners.push(index);
                    self.accept_pause.pause(&e, now);
                    return Ok(());
                }
            };
            self.accept_pause.accepted();
            let peer = match l.peer_of(&fd) {
                Ok(p) => p,
                Err(e) => {
                    tracing::debug!(error = %e, "peer vanished during accept");
                    continue;
                }
            };
            let raw = fd.as_raw_fd();
            if let Some(slot) = core.admit(fd, peer) {
                if let Err(e) = self.ep.ctl(
                    libc::EPOLL_CTL_ADD,
                    raw,
                    libc::EPOLLIN as u32,
                    u64::from(slot),
                ) {
                    core.close(slot, DisconnectReason::Io(e.kind()));
                }
                if self.writable_wanted.len() <= slot as usize {
                    self.writable_wanted.resize(slot as usize + 1, false);
                    self.interest.resize(slot as usize + 1, 0);
                }
                self.writable_wanted[slot as usize] = false;
                self.interest[slot as usize] = libc::EPOLLIN as u32;
            }
        }
        Ok(())
    }

    /// The accept pause is over: watches the paused listeners again.
    fn resume_accepting(&mut self, listeners: &[Listener]) -> Result<(), TransportError> {
        for index in self.paused_listeners.drain(..) {
            self.ep
                .ctl(
                    libc::EPOLL_CTL_MOD,
                    listeners[index].fd().as_raw_fd(),
                    libc::EPOLLIN as u32,
                    LISTENER_TOKEN_BASE + index as u64,
                )
                .map_err(TransportError::Io)?;
        }
        Ok(())
    }

    fn on_conn_event<H: Handler>(
        &mut self,
        core: &mut Core<H>,
        slot: u32,
        flags: u32,
        now: Instant,
    ) {
        if flags & libc::EPOLLOUT as u32 != 0 {
            self.flush(core, slot);
        }
        let hangup = flags & (libc::EPOLLHUP | libc::EPOLLERR) as u32 != 0;
        match core.conn_mut(slot).map(|c| c.state) {
            Some(ConnState::Open) => {}
            // Closing, its input no longer watched; but a hangup or an error
            // is reported whatever is watched (and repeats): nobody will
            // take the rest of its replies.
            Some(ConnState::InputEnded | ConnState::Draining) if hangup => {
                core.close(slot, DisconnectReason::PeerClosed);
                return;
            }
            _ => return,
        }
        if flags & libc::EPOLLIN as u32 == 0 && !hangup {
            return;
        }
        let mut read = 0;
        while read < READ_BUDGET_BYTES {
            match core.recv_once(slot, now, READ_CHUNK_BYTES) {
                RecvOnce::Read { n, asked } => {
                    read += n;
                    if self.spin_recv
                        && let Some(id) = core.conn_mut(slot).map(|c| c.id)
                    {
                        // A request's bytes: read this connection without
                        // waiting for its readiness while the loop spins.
                        self.polled.offer(id, now);
                    }
                    if n < asked {
                        // Drained (a short read): skip the `recv` that would
                        // only say EAGAIN — it sits between the request and
                        // its reply. Level-triggered epoll reports bytes that
                        // arrive meanwhile.
                        return;
                    }
                }
                RecvOnce::Interrupted => {}
                RecvOnce::Empty | RecvOnce::Over => return,
            }
        }
    }

    /// Writes what each dirty connection has queued. True if anything was
    /// written.
    fn flush_dirty<H: Handler>(&mut self, core: &mut Core<H>) -> bool {
        let mut dirty = std::mem::take(&mut core.dirty);
        let any = !dirty.is_empty();
        dirty.sort_unstable();
        dirty.dedup();
        for &slot in &dirty {
            self.flush(core, slot);
        }
        dirty.clear();
        if core.dirty.is_empty() {
            core.dirty = dirty;
        }
        any
    }

    fn flush<H: Handler>(&mut self, core: &mut Core<H>, slot: u32) {
        let mut fds = Vec::new();
        loop {
            let Some(conn) = core.conn_mut(slot) else {
                return;
            };
            if conn.state == ConnState::Dead {
                return;
            }
            if conn.sendq.is_empty() {
                break;
            }
            let res = if let Some(bytes) = conn.sendq.lone_frame() {
                // The common reply: one frame, no descriptors, one `send`.
                sys::send(conn.fd.as_fd(), bytes)
            } else {
                let mut iov = Vec::with_capacity(8);
                conn.sendq.gather(&mut iov, &mut fds);
                if iov.is_empty() {
                    break;
                }
                sys::send_with_fds(conn.fd.as_fd(), &iov, &fds)
            };
            match res {
                Ok(n) => conn.sendq.advance(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.want_writable(core, slot, true);
                    return;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    core.write_failed(slot, e.kind());
                    return;
                }
            }
        }
        self.want_writable(core, slot, false);
        core.on_flushed(slot);
    }

    fn want_writable<H: Handler>(&mut self, core: &mut Core<H>, slot: u32, on: bool) {
        self.writable_wanted[slot as usize] = on;
        self.update_interest(core, slot);
    }

    /// Registers what the connection's socket should report: its input
    /// while it is `Open` (a connection that left `Open` reads nothing more,
    /// and level-triggered EPOLLIN would report its unread input, or its
    /// end of stream, at every turn), its writability while a write is
    /// blocked.
    fn update_interest<H: Handler>(&mut self, core: &mut Core<H>, slot: u32) {
        let Some(conn) = core.conn_mut(slot) else {
            return;
        };
        let readable = match conn.state {
            ConnState::Open => libc::EPOLLIN as u32,
            ConnState::InputEnded | ConnState::Draining => 0,
            ConnState::Dead => return,
        };
        let writable = if self.writable_wanted[slot as usize] {
            libc::EPOLLOUT as u32
        } else {
            0
        };
        let events = readable | writable;
        if self.interest[slot as usize] == events {
            return;
        }
        match self.ep.ctl(
            libc::EPOLL_CTL_MOD,
            conn.fd.as_raw_fd(),
            events,
            u64::from(slot),
        ) {
            Ok(()) => self.interest[slot as usize] = events,
            Err(e) => core.close(slot, DisconnectReason::Io(e.kind())),
        }
    }

    fn teardown<H: Handler>(&mut self, core: &mut Core<H>) {
        for slot in std::mem::take(&mut core.dead) {
            self.polled.forget_slot(slot);
            if let Some(fd) = core.release(slot) {
                // Closing the descriptor removes it from the epoll set.
                drop(fd);
            }
        }
    }
}
