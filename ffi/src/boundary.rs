//! The boundary itself: every entry point runs its body through [`call`],
//! which catches panics (nothing unwinds into C), turns the result into a
//! status and keeps the calling thread's last error message.
//!
//! The message lives in a thread-local `CString`; `cxlkv_last_error` hands
//! out a pointer into it. The pointer stays valid until the same thread's
//! next `cxlkv_*` call that goes through [`call`] (every fallible one),
//! which replaces the message — with an empty string on success, so a stale
//! message is never mistaken for the latest one.

use std::any::Any;
use std::cell::RefCell;
use std::ffi::{CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::status::{FfiError, cxlkv_status};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: &str) {
    // Interior NULs would truncate the message in C: show them instead.
    let bytes: Vec<u8> = message
        .bytes()
        .map(|b| if b == 0 { b'?' } else { b })
        .collect();
    let text = CString::new(bytes).unwrap_or_default();
    // A thread being torn down has no slot left: nothing to keep then.
    let _ = LAST_ERROR.try_with(|slot| *slot.borrow_mut() = text);
}

/// Runs `body` as the entry point `name`: its error (or a panic) becomes
/// a status plus the thread's last error message; success clears the
/// message.
pub(crate) fn call(name: &str, body: impl FnOnce() -> Result<(), FfiError>) -> cxlkv_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => {
            set_last_error("");
            cxlkv_status::CXLKV_STATUS_OK
        }
        Ok(Err(e)) => {
            set_last_error(&format!("{name}: {}", without_own_op(name, &e.message)));
            e.status
        }
        Err(payload) => {
            set_last_error(&format!(
                "{name}: internal error (a bug in cxlkv, please report): {}",
                panic_message(payload.as_ref())
            ));
            cxlkv_status::CXLKV_STATUS_PANIC
        }
    }
}

/// `message` without a leading `"{op}: "` that only repeats the entry
/// point's own name (`cxlkv_tier_reserve_read` and the tier's
/// `reserve_read: …`), which would read twice in the last error. Any other
/// op says something the name does not (`cxlkv_batch_get` and `lookup: …`)
/// and is kept.
fn without_own_op<'a>(name: &str, message: &'a str) -> &'a str {
    let bare = name.strip_prefix("cxlkv_").unwrap_or(name);
    let own = [bare, bare.strip_prefix("tier_").unwrap_or(bare)];
    match message.split_once(": ") {
        Some((op, rest)) if own.contains(&op) => rest,
        _ => message,
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> &str {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s
    } else {
        "panic with a non-text payload"
    }
}

/// The calling thread's last error message: empty after a successful call,
/// else `"<function>: <what went wrong, with which input>"`. Never NULL.
/// Valid until this thread's next `cxlkv_*` call that returns a status.
///
/// Thread safety: any thread; each thread sees its own message.
#[unsafe(no_mangle)]
pub extern "C" fn cxlkv_last_error() -> *const c_char {
    static EMPTY: &[u8] = b"\0";
    LAST_ERROR
        .try_with(|slot| slot.borrow().as_ptr())
        .unwrap_or(EMPTY.as_ptr().cast())
}

#[cfg(test)]
mod tests {
    use std::ffi::CStr;

    use super::*;

    fn last() -> String {
        // SAFETY: `cxlkv_last_error` returns a NUL-terminated string valid
        // until this thread's next call; it is copied at once.
        unsafe { CStr::from_ptr(cxlkv_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_becomes_a_status_and_a_message() {
        let status = call("cxlkv_test", || panic!("boom {}", 7));
        assert_eq!(status, cxlkv_status::CXLKV_STATUS_PANIC);
        assert!(last().contains("cxlkv_test"), "{}", last());
        assert!(last().contains("boom 7"), "{}", last());
    }

    #[test]
    fn an_op_that_repeats_the_functions_name_is_said_once() {
        let refused = |op: &'static str| {
            FfiError::from(cxlkv::tier::TierError::KeyLength {
                op,
                index: 0,
                len_bytes: 0,
                max_bytes: 512,
            })
        };
        call("cxlkv_tier_reserve_read", || Err(refused("reserve_read")));
        assert_eq!(
            last(),
            "cxlkv_tier_reserve_read: key 0 is 0 bytes; keys are 1..=512 bytes"
        );
        // An op that is not the function's own name says something: kept.
        call("cxlkv_tier_reserve_read", || Err(refused("read")));
        assert_eq!(
            last(),
            "cxlkv_tier_reserve_read: read: key 0 is 0 bytes; keys are 1..=512 bytes"
        );
        call("cxlkv_batch_get", || Err(refused("lookup")));
        assert!(
            last().starts_with("cxlkv_batch_get: lookup: "),
            "{}",
            last()
        );
    }

    #[test]
    fn success_clears_the_previous_message() {
        let status = call("cxlkv_test", || Err(FfiError::null("out")));
        assert_eq!(status, cxlkv_status::CXLKV_STATUS_INVALID_ARGUMENT);
        assert_eq!(last(), "cxlkv_test: `out` is NULL");
        assert_eq!(call("cxlkv_test", || Ok(())), cxlkv_status::CXLKV_STATUS_OK);
        assert_eq!(last(), "");
    }

    #[test]
    fn messages_are_per_thread() {
        call("cxlkv_test", || Err(FfiError::invalid("here")));
        std::thread::spawn(|| {
            assert_eq!(last(), "");
            call("cxlkv_test", || Err(FfiError::invalid("there")));
            assert_eq!(last(), "cxlkv_test: there");
        })
        .join()
        .unwrap();
        assert_eq!(last(), "cxlkv_test: here");
    }

    #[test]
    fn interior_nuls_do_not_truncate_the_message() {
        call("cxlkv_test", || Err(FfiError::invalid("a\0b")));
        assert_eq!(last(), "cxlkv_test: a?b");
    }
}
