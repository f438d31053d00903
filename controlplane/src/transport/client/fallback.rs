//! The client's syscall wire: non-blocking `recvmsg` (Unix sockets, while
//! replies may still carry descriptors) or `recv` (TCP, and Unix sockets
//! once the caller declined descriptors) into the decoder, `poll` to sleep.

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::time::Duration;

use super::{READ_CHUNK_BYTES, Read};
use crate::frame::FrameDecoder;
use crate::transport::sys;

pub(super) struct SyscallWire {
    pub(super) decoder: FrameDecoder,
    with_fds: bool,
}

impl SyscallWire {
    pub(super) fn new(with_fds: bool) -> Self {
        Self {
            decoder: FrameDecoder::new(),
            with_fds,
        }
    }

    /// One non-blocking receive; `accept_fds` false reads with `recv`
    /// (see [`RpcClient::decline_fds`](super::RpcClient::decline_fds)).
    pub(super) fn read(
        &mut self,
        sock: BorrowedFd<'_>,
        fds: &mut Vec<OwnedFd>,
        accept_fds: bool,
    ) -> Read {
        let spare = self.decoder.spare(READ_CHUNK_BYTES);
        let res = if self.with_fds && accept_fds {
            sys::recv_with_fds(sock, spare, fds)
        } else {
            sys::recv(sock, spare).map(|bytes| sys::Received {
                bytes,
                fds_truncated: false,
            })
        };
        match res {
            Ok(r) if r.bytes == 0 => Read::Eof,
            Ok(r) => {
                self.decoder.filled(r.bytes);
                Read::Bytes {
                    n: r.bytes,
                    fds_truncated: r.fds_truncated,
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                Read::Nothing
            }
            Err(e) => Read::Failed(e),
        }
    }
}

/// Sleeps until the socket is readable (or hung up), or `timeout`.
pub(super) fn block(sock: BorrowedFd<'_>, timeout: Duration) -> io::Result<()> {
    sys::poll_one(sock, libc::POLLIN, timeout).map(drop)
}
