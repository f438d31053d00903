//! The `/metrics` endpoint: a minimal HTTP/1.1 responder on its own thread
//! (`cxlkv-metrics`), for Prometheus scrapes.
//!
//! One connection at a time, each answered and closed (`Connection:
//! close`): a scrape is one small request every few seconds. Every bound is
//! a named constant: the request head is at most [`MAX_REQUEST_BYTES`]
//! (else `431`), reading it must finish within [`REQUEST_TIMEOUT`] as a
//! whole (a client trickling bytes is cut off), writing the answer within
//! [`WRITE_TIMEOUT`]. `GET /metrics` (or `HEAD`; a query string is ignored)
//! answers `200` with the text exposition, `503` when the event loop did
//! not produce a snapshot in time; any other path `404`, any other method
//! `405`, a malformed request line `400`.
//!
//! The thread waits in `poll(2)` on the listener and on a wake socket; the
//! server's shutdown closes the wake socket's other end and joins the
//! thread. Parsing ([`route`]) and the answer's bytes ([`response`]) are
//! pure functions; [`serve_connection`] and the accept loop are the I/O
//! around them.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::ServerError;

/// Largest request head read (request line and headers).
pub const MAX_REQUEST_BYTES: usize = 8 << 10;
/// Deadline for the whole request head.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// Deadline for writing one answer.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest `poll(2)` between checks of the wake socket (it is also polled;
/// this only bounds a wait should a wake be missed).
const POLL_TIMEOUT_MS: i32 = 1000;

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `GET` or `HEAD` (`head_only`) of `/metrics`.
    Metrics {
        head_only: bool,
    },
    NotFound,
    MethodNotAllowed,
    BadRequest,
}

/// The end of the request head (`\r\n\r\n`, or a bare `\n\n`) in `buf`, if
/// it has arrived.
pub fn head_end(buf: &[u8]) -> Option<usize> {
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Routes a request by its request line (`METHOD TARGET HTTP/1.x`).
pub fn route(head: &[u8]) -> Route {
    let line_end = head.iter().position(|&b| b == b'\n').unwrap_or(head.len());
    let Ok(line) = std::str::from_utf8(&head[..line_end]) else {
        return Route::BadRequest;
    };
    let mut parts = line.trim_end_matches('\r').split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Route::BadRequest;
    };
    if !version.starts_with("HTTP/1.") || !target.starts_with('/') {
        return Route::BadRequest;
    }
    let path = target.split('?').next().unwrap_or(target);
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        m if !m.is_empty() && m.bytes().all(|b| b.is_ascii_uppercase()) => {
            return Route::MethodNotAllowed;
        }
        _ => return Route::BadRequest,
    };
    if path == "/metrics" {
        Route::Metrics { head_only }
    } else {
        Route::NotFound
    }
}

/// The bytes of an answer (`Connection: close`; the body is left out when
/// `head_only`, its length is not).
pub fn response(status: u16, content_type: &str, body: &[u8], head_only: bool) -> Vec<u8> {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Error",
    };
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    if status == 405 {
        out.push_str("Allow: GET, HEAD\r\n");
    }
    out.push_str("\r\n");
    let mut out = out.into_bytes();
    if !head_only {
        out.extend_from_slice(body);
    }
    out
}

/// The content type of the Prometheus text format.
pub const EXPOSITION_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Produces the exposition text, or says why it cannot.
pub type RenderFn = Box<dyn Fn() -> Result<String, String> + Send>;

/// Reads one request from `stream`, answers it, closes it.
fn serve_connection(stream: TcpStream, render: &RenderFn) -> io::Result<()> {
    serve_connection_within(stream, render, WRITE_TIMEOUT)
}

fn serve_connection_within(
    mut stream: TcpStream,
    render: &RenderFn,
    write_timeout: Duration,
) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    let deadline = Instant::now() + REQUEST_TIMEOUT;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    let answer = loop {
        if let Some(end) = head_end(&buf) {
            break match route(&buf[..end]) {
                Route::Metrics { head_only } => match render() {
                    Ok(text) => response(200, EXPOSITION_CONTENT_TYPE, text.as_bytes(), head_only),
                    Err(why) => response(503, "text/plain", why.as_bytes(), head_only),
                },
                Route::NotFound => response(404, "text/plain", b"try /metrics\n", false),
                Route::MethodNotAllowed => response(405, "text/plain", b"", false),
                Route::BadRequest => response(400, "text/plain", b"", false),
            };
        }
        if buf.len() >= MAX_REQUEST_BYTES {
            break response(431, "text/plain", b"", false);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break response(408, "text/plain", b"", false);
        }
        stream.set_read_timeout(Some(left))?;
        let want = chunk.len().min(MAX_REQUEST_BYTES - buf.len());
        match stream.read(&mut chunk[..want]) {
            // The client went away before finishing its request.
            Ok(0) => return Ok(()),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                break response(408, "text/plain", b"", false);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    };
    write_all_by(&mut stream, &answer, Instant::now() + write_timeout)?;
    stream.shutdown(std::net::Shutdown::Write)
}

/// `write_all` that gives up at `deadline` as a whole: a socket timeout
/// bounds one `write(2)`, and a reader draining a little at a time would
/// keep every write making progress (and the one metrics thread, which the
/// server's shutdown joins, busy) for as long as it likes.
fn write_all_by(stream: &mut TcpStream, mut bytes: &[u8], deadline: Instant) -> io::Result<()> {
    while !bytes.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the answer was not taken in time",
            ));
        }
        stream.set_write_timeout(Some(left))?;
        match stream.write(bytes) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // The socket's timeout (kernel ticks) may end a moment before
            // the deadline: the same deadline either way.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the answer was not taken in time",
                ));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The running endpoint. [`MetricsEndpoint::stop`] ends its thread.
#[derive(Debug)]
pub(crate) struct MetricsEndpoint {
    addr: SocketAddr,
    /// Dropping it wakes the thread's `poll` (end of file on the other end).
    wake: UnixStream,
    join: JoinHandle<()>,
}

impl MetricsEndpoint {
    /// Binds `addr` (port 0 picks a free port).
    pub fn bind(addr: SocketAddr) -> Result<TcpListener, ServerError> {
        TcpListener::bind(addr).map_err(|source| ServerError::Metrics { addr, source })
    }

    /// Serves `listener` on a new thread until [`stop`](Self::stop).
    pub fn spawn(listener: TcpListener, render: RenderFn) -> Result<Self, ServerError> {
        let thread_err = |source| ServerError::Thread {
            name: "metrics",
            source,
        };
        let addr = listener.local_addr().map_err(thread_err)?;
        listener.set_nonblocking(true).map_err(thread_err)?;
        let (wake, woken) = UnixStream::pair().map_err(thread_err)?;
        let join = std::thread::Builder::new()
            .name("cxlkv-metrics".into())
            .spawn(move || accept_loop(&listener, &woken, &render))
            .map_err(thread_err)?;
        Ok(Self { addr, wake, join })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Ends the thread (after the answer it may be writing) and waits for
    /// it.
    pub fn stop(self) {
        drop(self.wake);
        if self.join.join().is_err() {
            tracing::error!("the metrics thread panicked");
        }
    }
}

fn accept_loop(listener: &TcpListener, woken: &UnixStream, render: &RenderFn) {
    loop {
        let mut fds = [
            libc::pollfd {
                fd: listener.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: woken.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a live array of 2 initialised pollfd structs for
        // the duration of the call; both descriptors are owned by this
        // thread's borrows and stay open.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, POLL_TIMEOUT_MS) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            tracing::error!(error = %e, "metrics endpoint: poll failed; stopping");
            return;
        }
        if fds[1].revents != 0 {
            return;
        }
        if fds[0].revents == 0 {
            continue;
        }
        match listener.accept() {
            Ok((stream, peer)) => {
                if let Err(e) = serve_connection(stream, render) {
                    tracing::debug!(%peer, error = %e, "metrics scrape failed");
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => {
                tracing::warn!(error = %e, "metrics endpoint: accept failed");
                // Out of descriptors and the like: do not spin on it.
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_routed_by_method_and_path() {
        let m = |s: &str| route(s.as_bytes());
        assert_eq!(
            m("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
            Route::Metrics { head_only: false }
        );
        assert_eq!(
            m("HEAD /metrics?x=1 HTTP/1.0\r\n\r\n"),
            Route::Metrics { head_only: true }
        );
        assert_eq!(m("GET / HTTP/1.1\r\n\r\n"), Route::NotFound);
        assert_eq!(m("POST /metrics HTTP/1.1\r\n\r\n"), Route::MethodNotAllowed);
        assert_eq!(m("GET /metrics\r\n\r\n"), Route::BadRequest);
        assert_eq!(m("GET metrics HTTP/1.1\r\n\r\n"), Route::BadRequest);
        assert_eq!(m("\u{1}\u{2} /metrics HTTP/1.1\r\n\r\n"), Route::BadRequest);
        assert_eq!(route(b"GET /\xff HTTP/1.1\r\n\r\n"), Route::BadRequest);
    }

    /// A reader that takes a little at a time keeps every write making
    /// progress: the deadline is the answer's, not each write's.
    #[test]
    fn a_reader_draining_slowly_is_cut_off_at_the_answers_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let render: RenderFn = Box::new(|| Ok("x".repeat(32 << 20)));
        let server = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let start = Instant::now();
            let r = serve_connection_within(stream, &render, Duration::from_millis(300));
            (r, start.elapsed())
        });
        let mut client = TcpStream::connect(addr).unwrap();
        client.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut buf = vec![0u8; 64 << 10];
        let started = Instant::now();
        // 64 KiB every 20 ms: all 32 MiB would take about 10 s.
        while started.elapsed() < Duration::from_secs(8) {
            match client.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        let (r, took) = server.join().unwrap();
        assert_eq!(r.unwrap_err().kind(), io::ErrorKind::TimedOut);
        assert!(took < Duration::from_secs(3), "gave up after {took:?}");
    }

    #[test]
    fn the_head_ends_at_the_first_empty_line() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n\r\nbody"), Some(24));
        assert_eq!(head_end(b"GET / HTTP/1.1\n\n"), Some(16));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n"), None);
    }

    #[test]
    fn a_head_answer_has_the_length_but_not_the_body() {
        let full = response(200, "text/plain", b"abc", false);
        let head = response(200, "text/plain", b"abc", true);
        let full = String::from_utf8(full).unwrap();
        let head = String::from_utf8(head).unwrap();
        assert!(full.starts_with("HTTP/1.1 200 OK\r\n"));
        assert!(full.contains("Content-Length: 3\r\n"));
        assert!(full.ends_with("\r\n\r\nabc"));
        assert!(head.contains("Content-Length: 3\r\n"));
        assert!(head.ends_with("\r\n\r\n"));
    }
}
