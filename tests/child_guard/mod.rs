//! A child process killed and reaped when its guard drops, so that a failing
//! test leaves no server, pool daemon or demo process behind.

use std::process::Child;

/// Owns a child process: on drop, `SIGKILL` and `wait` (errors ignored: the
/// child may already have exited and been reaped through `.0`).
pub struct Guard(pub Option<Child>);

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
