//! Thin, checked wrappers over the socket system calls the transport needs
//! and `std` does not offer: peer credentials, descriptor passing, eventfd,
//! `poll` with a timeout, abortive close.
//!
//! Every function here takes borrowed descriptors and returns `io::Result`;
//! all `unsafe` of the transport's socket handling lives in this file.

use std::io::{self, IoSlice};
use std::mem::{MaybeUninit, size_of};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// Most descriptors one frame may carry (`SCM_RIGHTS`). The pool device is
/// one descriptor; a handful leaves room without sizing control buffers for
/// the kernel's limit of 253.
pub const MAX_FDS_PER_FRAME: usize = 8;

/// Control-buffer size for `MAX_FDS_PER_FRAME` descriptors, as `u64` words so
/// the buffer is aligned for `cmsghdr`.
const CMSG_WORDS: usize = cmsg_space_bytes(MAX_FDS_PER_FRAME).div_ceil(8);

const fn cmsg_align(n: usize) -> usize {
    (n + size_of::<usize>() - 1) & !(size_of::<usize>() - 1)
}

/// Mirrors CMSG_SPACE (which is `unsafe` only because it is an FFI shim).
const fn cmsg_space_bytes(fds: usize) -> usize {
    cmsg_align(size_of::<libc::cmsghdr>()) + cmsg_align(fds * size_of::<RawFd>())
}

/// The credentials of a Unix-socket peer, read by the kernel at `connect`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
}

fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn cvt_size(ret: libc::ssize_t) -> io::Result<usize> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret as usize)
    }
}

/// `SO_PEERCRED` of a connected Unix socket.
pub fn peer_cred(fd: BorrowedFd<'_>) -> io::Result<PeerCred> {
    let mut cred = MaybeUninit::<libc::ucred>::zeroed();
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a writable `ucred`-sized buffer and `len` says so; the
    // kernel writes at most `len` bytes. `fd` is a live descriptor (borrowed).
    cvt(unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            cred.as_mut_ptr().cast(),
            &mut len,
        )
    })?;
    if len as usize != size_of::<libc::ucred>() {
        return Err(io::Error::other("SO_PEERCRED returned a short ucred"));
    }
    // SAFETY: zero-initialised and fully written by the kernel (length checked).
    let cred = unsafe { cred.assume_init() };
    Ok(PeerCred {
        pid: cred.pid,
        uid: cred.uid,
        gid: cred.gid,
    })
}

/// Builds a `msghdr` for `bufs` with `fds` as one `SCM_RIGHTS` message in
/// `control`. The returned header borrows `bufs` and `control` through raw
/// pointers: both must outlive every use of it.
pub(crate) fn msghdr_with_fds(
    bufs: &[IoSlice<'_>],
    fds: &[RawFd],
    control: &mut CmsgBuf,
) -> io::Result<libc::msghdr> {
    if fds.len() > MAX_FDS_PER_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "too many descriptors for one frame",
        ));
    }
    // SAFETY: an all-zero msghdr is a valid empty message.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = bufs.as_ptr() as *mut libc::iovec; // IoSlice is ABI-compatible with iovec.
    msg.msg_iovlen = bufs.len() as _;
    if !fds.is_empty() {
        let data_len = size_of_val(fds) as libc::c_uint;
        msg.msg_control = control.words.as_mut_ptr().cast();
        // SAFETY: CMSG_SPACE is a pure computation.
        msg.msg_controllen = unsafe { libc::CMSG_SPACE(data_len) } as _;
        debug_assert!(msg.msg_controllen as usize <= CMSG_WORDS * 8);
        // SAFETY: msg_control points at `control`, which holds at least
        // CMSG_SPACE(data_len) bytes (MAX_FDS_PER_FRAME checked above) and is
        // aligned for cmsghdr (u64 words); FIRSTHDR is non-null since
        // msg_controllen >= sizeof(cmsghdr). CMSG_DATA stays within it.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(data_len) as _;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr().cast::<u8>(),
                libc::CMSG_DATA(cmsg),
                data_len as usize,
            );
        }
    }
    Ok(msg)
}

/// An aligned control-message buffer for up to `MAX_FDS_PER_FRAME` fds.
#[derive(Debug, Clone)]
pub(crate) struct CmsgBuf {
    words: [u64; CMSG_WORDS],
}

impl Default for CmsgBuf {
    fn default() -> Self {
        Self {
            words: [0; CMSG_WORDS],
        }
    }
}

/// `sendmsg` of `bufs` with `fds` attached (`SCM_RIGHTS`), non-blocking,
/// without `SIGPIPE`. Returns the bytes written.
pub fn send_with_fds(fd: BorrowedFd<'_>, bufs: &[IoSlice<'_>], fds: &[RawFd]) -> io::Result<usize> {
    let mut control = CmsgBuf::default();
    let msg = msghdr_with_fds(bufs, fds, &mut control)?;
    // SAFETY: `msg` points at `bufs` and `control`, both alive for the call.
    cvt_size(unsafe {
        libc::sendmsg(
            fd.as_raw_fd(),
            &msg,
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    })
}

/// Outcome of one `recvmsg`.
#[derive(Debug)]
pub struct Received {
    pub bytes: usize,
    /// True when the kernel had to drop descriptors (more than
    /// `MAX_FDS_PER_FRAME`): it closed them, and the frame is incomplete.
    pub fds_truncated: bool,
}

/// A `msghdr` that receives into `iov` with `control` as its control
/// buffer. It points at both through raw pointers: they must outlive every
/// use of it (for io_uring, until the operation completes).
pub(crate) fn recv_msghdr(iov: &mut libc::iovec, control: &mut CmsgBuf) -> libc::msghdr {
    // SAFETY: an all-zero msghdr is a valid empty message.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.words.as_mut_ptr().cast();
    msg.msg_controllen = CMSG_WORDS * 8;
    msg
}

/// Takes ownership of the descriptors a receive put into `msg`'s control
/// buffer (appended to `fds`) and says whether the kernel had to drop some
/// (`MSG_CTRUNC`).
///
/// # Safety
/// `msg` is the header of a receive that succeeded: the kernel filled its
/// control buffer up to `msg_controllen` and set `msg_flags`, and the
/// descriptors in it are owned by nobody yet (each call takes them once).
pub(crate) unsafe fn take_rights(msg: &libc::msghdr, fds: &mut Vec<OwnedFd>) -> bool {
    // SAFETY: per the contract, the control buffer holds well-formed
    // cmsghdrs up to msg_controllen; FIRSTHDR/NXTHDR stay within that length,
    // and each SCM_RIGHTS payload holds (cmsg_len - CMSG_LEN(0)) / sizeof(int)
    // descriptors that this process now owns.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data_len = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(cmsg);
                for i in 0..data_len / size_of::<RawFd>() {
                    let raw = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                    fds.push(OwnedFd::from_raw_fd(raw));
                }
            }
            cmsg = libc::CMSG_NXTHDR(msg, cmsg);
        }
    }
    msg.msg_flags & libc::MSG_CTRUNC != 0
}

/// Non-blocking `recvmsg` into `buf`; descriptors that arrive are appended
/// to `fds` (close-on-exec). `Ok(bytes == 0)` is end of stream.
pub fn recv_with_fds(
    fd: BorrowedFd<'_>,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> io::Result<Received> {
    let mut control = CmsgBuf::default();
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut msg = recv_msghdr(&mut iov, &mut control);
    // SAFETY: `iov` covers `buf` (writable, borrowed mutably for the call) and
    // `msg_control` covers `control`; both outlive the call.
    let bytes = cvt_size(unsafe {
        libc::recvmsg(
            fd.as_raw_fd(),
            &mut msg,
            libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC,
        )
    })?;
    // SAFETY: the recvmsg above succeeded and its descriptors are taken once.
    let fds_truncated = unsafe { take_rights(&msg, fds) };
    Ok(Received {
        bytes,
        fds_truncated,
    })
}

/// Non-blocking `recv` without ancillary data (descriptors sent to us are
/// discarded by the kernel).
pub fn recv(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is writable for its length for the duration of the call.
    cvt_size(unsafe {
        libc::recv(
            fd.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    })
}

/// Non-blocking `send` without `SIGPIPE`.
pub fn send(fd: BorrowedFd<'_>, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: `buf` is readable for its length for the duration of the call.
    cvt_size(unsafe {
        libc::send(
            fd.as_raw_fd(),
            buf.as_ptr().cast(),
            buf.len(),
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    })
}

/// Waits until `fd` is ready for `events` (`libc::POLLIN`/`POLLOUT`) or the
/// timeout passes. Returns the revents (0 on timeout). `EINTR` counts as a
/// spurious wake-up (0), so callers re-check their deadline.
pub fn poll_one(
    fd: BorrowedFd<'_>,
    events: libc::c_short,
    timeout: Duration,
) -> io::Result<libc::c_short> {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events,
        revents: 0,
    };
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int;
    // SAFETY: one valid pollfd, count 1.
    match cvt(unsafe { libc::poll(&mut pfd, 1, ms) }) {
        Ok(_) => Ok(pfd.revents),
        Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(0),
        Err(e) => Err(e),
    }
}

/// True if the peer of a connected socket closed it altogether, not just
/// its writing half (`shutdown(SHUT_WR)`): both directions are shut
/// (`POLLHUP`). A Unix socket tells at once (its peer's close shuts both);
/// a TCP socket only learns when the peer refuses a write, so this is false
/// until then. Errors count as "not known to be gone".
pub fn peer_hung_up(fd: BorrowedFd<'_>) -> bool {
    // Events 0: POLLHUP is reported whatever is asked for.
    poll_one(fd, 0, Duration::ZERO).is_ok_and(|revents| revents & libc::POLLHUP != 0)
}

/// A non-blocking, close-on-exec eventfd (counter semantics).
pub fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; a non-negative result is a fresh descriptor we own.
    let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) })?;
    // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Adds one to an eventfd's counter (wakes its waiter). A full counter
/// (`EAGAIN`) already means "wake up", so it is not an error.
pub fn eventfd_signal(fd: BorrowedFd<'_>) -> io::Result<()> {
    let one: u64 = 1;
    // SAFETY: writes 8 readable bytes from `one`.
    match cvt_size(unsafe { libc::write(fd.as_raw_fd(), (&raw const one).cast(), 8) }) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(()),
        Err(e) => Err(e),
    }
}

/// Resets an eventfd's counter; `EAGAIN` (already zero) is fine.
pub fn eventfd_drain(fd: BorrowedFd<'_>) -> io::Result<()> {
    let mut value: u64 = 0;
    // SAFETY: reads 8 bytes into `value`.
    match cvt_size(unsafe { libc::read(fd.as_raw_fd(), (&raw mut value).cast(), 8) }) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(()),
        Err(e) => Err(e),
    }
}

/// `SO_LINGER {on, 0}`: the next close of a TCP socket sends RST instead of
/// FIN (an abortive close, used to inject connection resets). A no-op in
/// effect on Unix sockets.
pub fn set_linger_zero(fd: BorrowedFd<'_>) -> io::Result<()> {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: passes a valid `linger` of the stated size.
    cvt(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const linger).cast(),
            size_of::<libc::linger>() as libc::socklen_t,
        )
    })
    .map(drop)
}

/// `shutdown(SHUT_RDWR)`: makes pending receives on the socket complete (with
/// end of stream) so an io_uring backend can retire its operations before
/// closing the descriptor. `ENOTCONN` (peer already gone) is fine.
pub fn shutdown(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: plain syscall on a live descriptor.
    match cvt(unsafe { libc::shutdown(fd.as_raw_fd(), libc::SHUT_RDWR) }) {
        Ok(_) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Wraps a descriptor returned by the kernel (e.g. by an accept completion).
///
/// # Safety
/// `raw` must be an open descriptor that nothing else owns.
pub unsafe fn own_fd(raw: RawFd) -> OwnedFd {
    // SAFETY: upheld by the caller.
    unsafe { OwnedFd::from_raw_fd(raw) }
}

/// What a socket file found where a listener is to bind is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExistingSocket {
    /// A server of ours answers on it: it is in use.
    Answering,
    /// Nobody listens (connecting is refused): left by a process that died.
    Stale,
    /// A listener accepts on it but never answered within the patience
    /// given: a stalled server, or another program's socket. Not ours to
    /// remove.
    SilentListener,
}

/// Classifies the socket file at `path` (which must be a socket): connects
/// and asks `answers` whether a server of ours replies. A listener that
/// accepts without answering is asked again until `patience` runs out —
/// the kernel tears a killed process's listener down a moment after it
/// died (an io_uring's file references outlive it briefly), after which
/// connecting is refused and the file is stale; one still accepting then
/// is alive, and removing its file would cut its clients off.
pub fn classify_existing_socket(
    path: &std::path::Path,
    answers: impl Fn(&std::os::unix::net::UnixStream) -> bool,
    patience: std::time::Duration,
) -> io::Result<ExistingSocket> {
    let deadline = std::time::Instant::now() + patience;
    loop {
        let silent = match connect_nonblocking(path) {
            Ok(Some(stream)) => {
                stream.set_nonblocking(false)?;
                if answers(&stream) {
                    return Ok(ExistingSocket::Answering);
                }
                true
            }
            // Its backlog is full: a listener that does not accept.
            Ok(None) => true,
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                return Ok(ExistingSocket::Stale);
            }
            Err(e) => return Err(e),
        };
        if silent && std::time::Instant::now() >= deadline {
            return Ok(ExistingSocket::SilentListener);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Connects to the Unix socket at `path` without blocking: `None` when the
/// listener's backlog is full (`EAGAIN`; a blocking connect would wait for
/// room, without bound, on a listener that never accepts). The stream is
/// non-blocking.
pub fn connect_nonblocking(
    path: &std::path::Path,
) -> io::Result<Option<std::os::unix::net::UnixStream>> {
    let (addr, len) = unix_addr(path)?;
    // SAFETY: socket has no memory preconditions.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket and nothing else owns it.
    let stream = unsafe { std::os::unix::net::UnixStream::from_raw_fd(fd) };
    // SAFETY: `addr` is a live sockaddr_un and `len` does not exceed its
    // size (`unix_addr`); the descriptor is open (owned by `stream`).
    let rc = unsafe { libc::connect(fd, (&raw const addr).cast::<libc::sockaddr>(), len) };
    if rc == 0 {
        return Ok(Some(stream));
    }
    let e = io::Error::last_os_error();
    // A Unix stream connect completes at once or fails: EAGAIN means no
    // room in the backlog.
    match e.raw_os_error() {
        Some(libc::EAGAIN) => Ok(None),
        _ => Err(e),
    }
}

/// The address of the Unix socket at `path`, and its length.
fn unix_addr(path: &std::path::Path) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: an all-zero sockaddr_un is a valid value of the C struct.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket path too long for sockaddr_un (or has a NUL byte)",
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, &b) in addr.sun_path.iter_mut().zip(bytes) {
        *d = b as libc::c_char;
    }
    let len = size_of::<libc::sa_family_t>() + bytes.len() + 1;
    Ok((addr, len as libc::socklen_t))
}

/// Binds a listening Unix socket at `path` whose file has exactly `mode`
/// (permission bits), whatever the process umask: `socket`, `bind`,
/// `chmod`, then `listen`. No peer can connect before `listen`, so none
/// connects while the file still has the umask's mode (with umask 0, 0777:
/// anyone). Close-on-exec, blocking (the caller sets what it needs). On a
/// failure after `bind` the file is removed again.
pub fn bind_unix_listener(
    path: &std::path::Path,
    mode: u32,
) -> io::Result<std::os::unix::net::UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    let (addr, len) = unix_addr(path)?;
    // SAFETY: socket has no memory preconditions.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket and nothing else owns it.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `addr` is a live sockaddr_un and `len` does not exceed its
    // size (`unix_addr`); the descriptor is open (owned by `owned`).
    let rc = unsafe { libc::bind(fd, (&raw const addr).cast::<libc::sockaddr>(), len) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let listened = std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot set mode {mode:o} on {}: {e}", path.display()),
            )
        })
        .and_then(|()| {
            // SAFETY: the descriptor is open (owned by `owned`); listen
            // takes no pointers.
            if unsafe { libc::listen(fd, libc::SOMAXCONN) } == 0 {
                Ok(())
            } else {
                Err(io::Error::last_os_error())
            }
        });
    if let Err(e) = listened {
        let _ = std::fs::remove_file(path);
        return Err(e);
    }
    Ok(std::os::unix::net::UnixListener::from(owned))
}

/// Creates the directory a socket at `socket` goes in (0755, with its
/// parents; `.` for a bare name) and checks it with
/// [`check_socket_dir`]. What a listener does before binding (the
/// server's and the pool daemon's). A directory it creates gets 0755
/// exactly, whatever the umask (a restrictive one would otherwise lock
/// out the socket's group); an existing one is left as it is.
pub fn prepare_socket_dir(socket: &std::path::Path) -> io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let dir = match socket.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => std::path::Path::new("."),
    };
    let existed = std::fs::symlink_metadata(dir).is_ok();
    let context = |e: io::Error| {
        io::Error::new(
            e.kind(),
            format!("cannot create the socket directory {}: {e}", dir.display()),
        )
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
        .map_err(context)?;
    if !existed {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).map_err(context)?;
    }
    check_socket_dir(dir)
}

/// Whether `dir` is a safe place for a listening socket: it, and every
/// directory above it, is owned by this process's effective user or by
/// root, and not writable by group or others unless sticky (as `/tmp` is).
/// Otherwise another local user could move the directory or the socket
/// aside after it is bound and put their own in its place, and local
/// clients would take their pool descriptors from that user's server: the
/// default `/tmp/cxlkv-<uid>` directory of a user without
/// `XDG_RUNTIME_DIR` can be created first by anyone. `PermissionDenied`
/// naming the directory and its owner or mode otherwise. Symbolic links
/// are resolved first (what matters is where the socket lands).
///
/// What it cannot stop: in a sticky shared directory, another user may
/// bind the socket's name before the server's first start (the server then
/// refuses to start, the name being in use); clients do not check the
/// server's identity.
pub fn check_socket_dir(dir: &std::path::Path) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let real = std::fs::canonicalize(dir)?;
    if !std::fs::metadata(&real)?.is_dir() {
        return Err(io::Error::new(
            io::ErrorKind::NotADirectory,
            format!("{} is not a directory", dir.display()),
        ));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    for d in real.ancestors() {
        let meta = std::fs::metadata(d)?;
        let whose = if d == real {
            format!("socket directory {}", d.display())
        } else {
            format!(
                "{} (above the socket directory {})",
                d.display(),
                real.display()
            )
        };
        if meta.uid() != euid && meta.uid() != 0 {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "{whose} belongs to uid {}, not to this user (uid {euid}) or root: \
                     another user could replace the socket",
                    meta.uid()
                ),
            ));
        }
        let mode = meta.mode();
        if mode & 0o022 != 0 && mode & 0o1000 == 0 {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "{whose} is writable by group or others (mode {:o}) and not sticky: \
                     another user could replace the socket",
                    mode & 0o7777
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    /// The socket file gets the mode asked for, not the umask's (a
    /// process umask of 022 would give 0755, of 0 0777), and it accepts
    /// connections; a failed bind leaves no file behind.
    #[test]
    fn a_bound_unix_socket_has_exactly_the_mode_asked_for() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        for mode in [0o600, 0o660] {
            let path = dir.path().join(format!("s{mode:o}.sock"));
            let listener = bind_unix_listener(&path, mode).unwrap();
            let got = std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777;
            assert_eq!(got, mode, "{}", path.display());
            let _client = UnixStream::connect(&path).unwrap();
            let (_server_side, _) = listener.accept().unwrap();
        }
        let taken = dir.path().join("s600.sock");
        assert!(bind_unix_listener(&taken, 0o600).is_err(), "in use");
        assert!(taken.exists(), "the other listener's file stays");
    }

    #[test]
    fn a_socket_directory_must_be_ours_or_roots_and_not_writable_by_others_unless_sticky() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let set = |mode: u32| {
            std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(mode)).unwrap();
        };
        for ok in [0o700, 0o755, 0o1777] {
            set(ok);
            check_socket_dir(d.path()).unwrap_or_else(|e| panic!("{ok:o}: {e}"));
        }
        for bad in [0o777, 0o775, 0o757] {
            set(bad);
            let e = check_socket_dir(d.path()).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{bad:o}");
            assert!(e.to_string().contains("writable by group or others"), "{e}");
        }
        set(0o755);
        // Another user's directory: only root can make one to try.
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } == 0 {
            std::os::unix::fs::chown(d.path(), Some(4242), None).unwrap();
            let e = check_socket_dir(d.path()).unwrap_err();
            assert!(e.to_string().contains("belongs to uid 4242"), "{e}");
            std::os::unix::fs::chown(d.path(), Some(0), None).unwrap();
        } else {
            eprintln!("not root: the other-owner case is not checked");
        }
        let f = d.path().join("file");
        std::fs::write(&f, b"").unwrap();
        assert!(check_socket_dir(&f).is_err(), "a file is not a directory");
        // Every directory above counts: a safe directory of ours inside an
        // unsafe one is refused, naming the unsafe one.
        let inner = d.path().join("inner");
        std::fs::create_dir(&inner).unwrap();
        set(0o755);
        check_socket_dir(&inner).unwrap();
        set(0o777);
        let e = check_socket_dir(&inner).unwrap_err();
        assert!(e.to_string().contains("above the socket directory"), "{e}");
        set(0o755);
    }

    #[test]
    fn descriptors_cross_a_socketpair_with_their_bytes() {
        let (a, b) = UnixStream::pair().unwrap();
        let (r, w) = UnixStream::pair().unwrap();
        let sent = send_with_fds(a.as_fd(), &[IoSlice::new(b"hi")], &[w.as_raw_fd()]).unwrap();
        assert_eq!(sent, 2);
        let mut buf = [0u8; 8];
        let mut fds = Vec::new();
        let got = recv_with_fds(b.as_fd(), &mut buf, &mut fds).unwrap();
        assert_eq!((got.bytes, got.fds_truncated, fds.len()), (2, false, 1));
        // The received descriptor is the same socket: writing through it reaches `r`.
        send(fds[0].as_fd(), b"x").unwrap();
        assert_eq!(recv(r.as_fd(), &mut buf).unwrap(), 1);
    }

    #[test]
    fn peer_credentials_name_this_process() {
        let (a, _b) = UnixStream::pair().unwrap();
        let cred = peer_cred(a.as_fd()).unwrap();
        assert_eq!(cred.pid, std::process::id() as i32);
        // SAFETY: getuid has no preconditions.
        assert_eq!(cred.uid, unsafe { libc::getuid() });
    }

    #[test]
    fn too_many_descriptors_are_refused_before_the_syscall() {
        let (a, _b) = UnixStream::pair().unwrap();
        let fds = vec![a.as_raw_fd(); MAX_FDS_PER_FRAME + 1];
        let err = send_with_fds(a.as_fd(), &[IoSlice::new(b"x")], &fds).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }
}
