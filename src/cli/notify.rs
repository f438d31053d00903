//! The systemd readiness protocol (`sd_notify(3)`), so that the shipped
//! units can be `Type=notify`: `cxlkv pool` and `cxlkv serve` say
//! `READY=1` once they listen, and `STOPPING=1` when a signal stops them.
//!
//! Why: with `Type=exec` systemd counts a daemon as started as soon as it
//! is executed, before its socket exists, so `After=cxlkv-pool.service`
//! ordered nothing — a `cxlkv serve` with `pool_daemon` started in the same
//! boot transaction found no daemon, failed ("pool manager unreachable"),
//! and came up only on its `Restart=`; and units ordered after
//! `cxlkv.service` could not count on its socket either.
//!
//! Outside systemd (`$NOTIFY_SOCKET` unset) nothing is sent. The message is
//! one datagram to the socket the variable names: a path, or an abstract
//! name written with a leading `@`. A failure to send is logged, never
//! fatal: the service serves either way, and systemd's start timeout says
//! the rest.

use std::os::unix::net::{SocketAddr, UnixDatagram};

/// The variable systemd sets for a `Type=notify` service.
pub const NOTIFY_SOCKET_ENV: &str = "NOTIFY_SOCKET";

/// Sends `state` (`READY=1`, `STOPPING=1`, ...) to the service manager, if
/// there is one.
pub fn notify(state: &str) {
    let Some(target) = std::env::var_os(NOTIFY_SOCKET_ENV) else {
        return;
    };
    if let Err(e) = send(&target, state) {
        tracing::warn!(
            socket = %target.to_string_lossy(),
            state,
            error = %e,
            "cannot notify the service manager"
        );
    }
}

fn send(target: &std::ffi::OsStr, state: &str) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = target.as_bytes();
    let addr = match bytes.strip_prefix(b"@") {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            SocketAddr::from_abstract_name(name)?
        }
        None => SocketAddr::from_pathname(target)?,
    };
    let socket = UnixDatagram::unbound()?;
    socket.send_to_addr(state.as_bytes(), &addr)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_reaches_a_path_socket_and_an_abstract_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let listener = UnixDatagram::bind(&path).unwrap();
        send(path.as_os_str(), "READY=1").unwrap();
        let mut buf = [0u8; 64];
        let n = listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");

        use std::os::linux::net::SocketAddrExt;
        let name = format!("cxlkv-notify-test-{}", std::process::id());
        let abstract_listener =
            UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap())
                .unwrap();
        send(std::ffi::OsStr::new(&format!("@{name}")), "STOPPING=1").unwrap();
        let n = abstract_listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");
    }
}
