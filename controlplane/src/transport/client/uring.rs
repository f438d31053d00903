//! The client's io_uring wire: a small ring per connection with at most
//! one receive in flight, written straight into the decoder's free space
//! (`RECVMSG` with a control buffer on Unix sockets, for descriptors;
//! `RECV` on TCP).
//!
//! A leader arms a receive when it has none in flight and then polls the
//! completion queue in memory; when the ring's TASKRUN flag says the kernel
//! has receive work queued for this thread, one `io_uring_enter` runs it
//! and posts the completion. Past `spin_us` it sleeps in `io_uring_enter`
//! until a completion or its deadline. The receive is one-shot and never
//! outlives a leader's turn (`quiesce` cancels it and waits for its
//! completion): the kernel runs a receive's completion work in the thread
//! that submitted it (unless SQPOLL), and the next leader is usually
//! another thread.
//!
//! Invariant: while `armed`, the kernel may write into the decoder's spare
//! bytes and into `op`; nothing here touches them until the receive's
//! completion is reaped, and `decoder()` withholds the decoder meanwhile.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use io_uring::{IoUring, opcode, types};

use super::{READ_CHUNK_BYTES, Read};
use crate::frame::FrameDecoder;
use crate::transport::config::IoConfig;
use crate::transport::ring::{self, Role};
use crate::transport::sys::{self, CmsgBuf};

/// Submission entries of a client ring: a receive and its cancellation.
const RING_ENTRIES: u32 = 4;
const UD_RECV: u64 = 1;
const UD_CANCEL: u64 = 2;
/// `IORING_RECVSEND_POLL_FIRST` (not exported by the `io-uring` crate):
/// wait for readiness before trying the receive. A leader arms right after
/// sending, when the reply cannot be there yet, so the first try would only
/// fail (measured: ~0.2 µs off the round trip).
const IORING_RECVSEND_POLL_FIRST: u16 = 1;
/// How long ending a turn waits for a cancelled receive to complete (it
/// completes at once unless the kernel is wedged).
const CANCEL_WAIT: Duration = Duration::from_secs(1);

/// A `RECVMSG`'s header and the iovec and control buffer it points at, at
/// a stable (boxed) address while the receive is in flight.
struct RecvMsgOp {
    msg: libc::msghdr,
    iov: libc::iovec,
    cmsg: CmsgBuf,
}

// SAFETY: the raw pointers in `msg` and `iov` point into memory owned by the
// same `UringWire` (`iov`, `cmsg`, the decoder's buffer); the wire moves
// between threads only as a whole, under the client's reader lock.
unsafe impl Send for RecvMsgOp {}

pub(super) struct UringWire {
    // Field order matters: the ring is dropped first. Closing a ring kills
    // its context, and a receive that has not run yet is then cancelled
    // instead of run, so nothing writes into `op` or `decoder` once they
    // are freed.
    ring: IoUring,
    op: Box<RecvMsgOp>,
    decoder: FrameDecoder,
    fd: RawFd,
    with_fds: bool,
    /// The receive in flight (or last reaped) is a `RECVMSG` whose control
    /// buffer `finish` must read.
    armed_with_fds: bool,
    /// A receive is in the kernel (see the module invariant).
    armed: bool,
}

impl UringWire {
    /// A ring for reading `sock` (which must outlive the wire).
    pub(super) fn new(cfg: &IoConfig, sock: BorrowedFd<'_>, with_fds: bool) -> io::Result<Self> {
        let ring = ring::build_ring(cfg, Role::Client, RING_ENTRIES)?;
        if !ring.params().is_feature_ext_arg() {
            return Err(io::Error::other(
                "kernel lacks IORING_FEAT_EXT_ARG (timed waits)",
            ));
        }
        let op = Box::new(RecvMsgOp {
            // SAFETY: an all-zero msghdr is a valid empty message; `arm`
            // points it at the boxed iovec and control buffer.
            msg: unsafe { std::mem::zeroed() },
            iov: libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            },
            cmsg: CmsgBuf::default(),
        });
        Ok(Self {
            ring,
            op,
            decoder: FrameDecoder::new(),
            fd: sock.as_raw_fd(),
            with_fds,
            armed_with_fds: false,
            armed: false,
        })
    }

    /// The decoder, unless a receive into it is in flight.
    pub(super) fn decoder(&mut self) -> Option<&mut FrameDecoder> {
        (!self.armed).then_some(&mut self.decoder)
    }

    /// Reaps a finished receive, or arms one, or lets the kernel run the
    /// receive work it flagged; never sleeps.
    pub(super) fn read(&mut self, fds: &mut Vec<OwnedFd>, accept_fds: bool) -> Read {
        if let Some(r) = self.reap(fds) {
            return r;
        }
        let kicked = if !self.armed {
            // The submission tries the receive at once (data may be there).
            self.arm(accept_fds)
        } else if ring::needs_task_run(&mut self.ring) {
            ring::run_task_work(&self.ring)
        } else {
            return Read::Nothing;
        };
        if let Err(e) = kicked {
            return Read::Failed(e);
        }
        self.reap(fds).unwrap_or(Read::Nothing)
    }

    /// Sleeps until the receive completes, or `timeout`.
    pub(super) fn block(&mut self, timeout: Duration) -> io::Result<()> {
        if !self.armed {
            return Ok(());
        }
        ring::submit_and_wait(&self.ring, Some(timeout))
    }

    /// Cancels the receive in flight, if any, and waits (bounded) for its
    /// completion, which may still carry bytes.
    pub(super) fn quiesce(&mut self, fds: &mut Vec<OwnedFd>) -> Read {
        if let Some(r) = self.reap(fds) {
            return r;
        }
        if !self.armed {
            return Read::Nothing;
        }
        let cancel = opcode::AsyncCancel::new(UD_RECV)
            .build()
            .user_data(UD_CANCEL);
        // SAFETY: a cancellation points at no memory.
        if unsafe { self.ring.submission().push(&cancel) }.is_err() {
            return Read::Failed(io::Error::other("client ring full"));
        }
        let until = Instant::now() + CANCEL_WAIT;
        loop {
            if let Err(e) = ring::submit_and_wait(&self.ring, Some(CANCEL_WAIT)) {
                return Read::Failed(e);
            }
            if let Some(r) = self.reap(fds) {
                return r;
            }
            if Instant::now() >= until {
                return Read::Failed(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "a cancelled receive did not complete",
                ));
            }
        }
    }

    /// Submits a receive into the decoder's free space: a `RECVMSG` while
    /// descriptors are accepted, else a `RECV`.
    fn arm(&mut self, accept_fds: bool) -> io::Result<()> {
        debug_assert!(!self.armed);
        let spare = self.decoder.spare(READ_CHUNK_BYTES);
        let len = u32::try_from(spare.len()).unwrap_or(u32::MAX);
        let buf = spare.as_mut_ptr();
        let fd = types::Fd(self.fd);
        self.armed_with_fds = self.with_fds && accept_fds;
        let sqe = if self.armed_with_fds {
            let op = &mut *self.op;
            op.iov = libc::iovec {
                iov_base: buf.cast(),
                iov_len: len as usize,
            };
            // Zeroed so that a kernel that did not write the control length
            // back could not make us parse stale headers.
            op.cmsg = CmsgBuf::default();
            op.msg = sys::recv_msghdr(&mut op.iov, &mut op.cmsg);
            opcode::RecvMsg::new(fd, &mut op.msg)
                .flags(libc::MSG_CMSG_CLOEXEC as u32)
                .ioprio(IORING_RECVSEND_POLL_FIRST)
                .build()
        } else {
            opcode::Recv::new(fd, buf, len)
                .ioprio(IORING_RECVSEND_POLL_FIRST)
                .build()
        }
        .user_data(UD_RECV);
        // SAFETY: the receive writes into the decoder's spare bytes (`len`
        // of them from `buf`) and, for RECVMSG, reads `op.msg`/`op.iov` and
        // writes `op.cmsg` — all owned by `self`, at stable addresses (heap).
        // They stay valid and untouched until the completion is reaped:
        // `armed` is set below, `decoder()` withholds the decoder while it
        // is, nothing re-arms before the reap, and the ring is dropped
        // before them (field order).
        unsafe { self.ring.submission().push(&sqe) }
            .map_err(|_| io::Error::other("client ring full"))?;
        self.armed = true;
        ring::submit(&self.ring)
    }

    /// Takes the receive's completion if it arrived (cancellation
    /// completions are only consumed).
    fn reap(&mut self, fds: &mut Vec<OwnedFd>) -> Option<Read> {
        let mut res = None;
        for cqe in self.ring.completion() {
            if cqe.user_data() == UD_RECV {
                res = Some(cqe.result());
            }
        }
        let res = res?;
        self.armed = false;
        Some(self.finish(res, fds))
    }

    fn finish(&mut self, res: i32, fds: &mut Vec<OwnedFd>) -> Read {
        if res > 0 {
            let n = res as usize;
            let fds_truncated = self.armed_with_fds && {
                // SAFETY: this is the completion of the RECVMSG armed with
                // `op.msg`, which succeeded: the kernel wrote its control
                // length and flags back, and the descriptors in `op.cmsg`
                // are taken once, here (the next `arm` rebuilds the header).
                unsafe { sys::take_rights(&self.op.msg, fds) }
            };
            self.decoder.filled(n);
            return Read::Bytes { n, fds_truncated };
        }
        match -res {
            0 => Read::Eof,
            // Ended without data (cancelled, interrupted): the next read
            // arms another receive.
            libc::ECANCELED | libc::EAGAIN | libc::EINTR => Read::Nothing,
            errno => Read::Failed(io::Error::from_raw_os_error(errno)),
        }
    }
}
