//! The in-process [`PoolService`]: a session of the core in this process,
//! for `cxlkv serve` (the directory and the pool manager in one process).
//!
//! Same path as the wire, minus the socket: requests go into the core's
//! command channel, run in arrival order with everything else, and answers
//! come back through the callback once their records are durable. The
//! session's caller is the session itself (`Caller::Remote` with the session
//! number as its connection), so it is gone — and its directory's regions
//! start their grace period — when the [`LocalPool`] is dropped, exactly like
//! a closed connection. Sequence numbers continue from the welcome's
//! `last_seq`, so a directory restarted in process resumes numbering safely.

use std::sync::mpsc;
use std::time::Duration;

use parking_lot::Mutex;

use super::core::{Callback, CoreLink, Op, ReplyTo, SessionTransport};
use super::{PoolCallback, PoolReply, PoolRequest, PoolService, PoolServiceError, PoolSession};
use crate::pool::Caller;
use crate::proto::{ErrorCode, PROTOCOL_MAX, PROTOCOL_MIN, PoolWelcome};

/// An in-process pool session (see the module essay).
#[derive(Debug)]
pub struct LocalPool {
    link: CoreLink,
    session: u64,
    /// The next `seq`; taken under the lock together with the send, so
    /// requests reach the core in `seq` order.
    next_seq: Mutex<u64>,
    welcome: PoolWelcome,
}

impl LocalPool {
    pub(crate) fn attach(
        link: CoreLink,
        directory_id: &str,
        timeout: Duration,
    ) -> Result<(Self, PoolSession), PoolServiceError> {
        let session = link.new_session();
        if !link.open(
            session,
            Caller::Remote {
                connection: session,
            },
            SessionTransport::InProcess,
        ) {
            return Err(PoolServiceError::new(
                ErrorCode::Internal,
                "the pool service has stopped",
                0,
            ));
        }
        let (tx, rx) = mpsc::sync_channel(1);
        let hello = Op::Hello {
            protocol_min: PROTOCOL_MIN,
            protocol_max: PROTOCOL_MAX,
            directory_id: directory_id.to_owned(),
            secret: None,
        };
        let done: PoolCallback = Box::new(move |r| {
            let _ = tx.send(r);
        });
        let answer = match link.request(session, hello, ReplyTo::Callback(Callback::new(done))) {
            Ok(()) => rx.recv_timeout(timeout).unwrap_or_else(|_| {
                Err(PoolServiceError::new(
                    ErrorCode::Timeout,
                    "no welcome from the pool service",
                    timeout.as_millis() as u64,
                ))
            }),
            Err((_, e)) => Err(e),
        };
        match answer {
            Ok(PoolReply::Welcome { welcome, fds }) => {
                let pool = Self {
                    link,
                    session,
                    next_seq: Mutex::new(welcome.last_seq.saturating_add(1)),
                    welcome: welcome.clone(),
                };
                Ok((pool, PoolSession { welcome, fds }))
            }
            Ok(other) => {
                link.closed(session);
                Err(PoolServiceError::new(
                    ErrorCode::Internal,
                    format!("unexpected answer to the hello: {other:?}"),
                    0,
                ))
            }
            Err(e) => {
                link.closed(session);
                Err(e)
            }
        }
    }
}

impl PoolService for LocalPool {
    fn submit(&self, request: PoolRequest, done: PoolCallback) {
        let mut next = self.next_seq.lock();
        let mutating = request.is_mutating();
        let seq = if mutating { *next } else { 0 };
        match self.link.request(
            self.session,
            Op::from_request(request, seq),
            ReplyTo::Callback(Callback::new(done)),
        ) {
            Ok(()) => {
                if mutating {
                    *next += 1;
                }
            }
            Err((ReplyTo::Callback(done), e)) => {
                drop(next);
                done.call(Err(e));
            }
            Err((ReplyTo::Wire { .. }, _)) => unreachable!("a callback was sent"),
        }
    }

    fn welcome(&self) -> PoolWelcome {
        self.welcome.clone()
    }
}

impl Drop for LocalPool {
    fn drop(&mut self) {
        self.link.closed(self.session);
    }
}
