//! The entry points end to end against an in-process server, called the
//! way C calls them (raw pointers, handles, statuses). The C test
//! (`ffi/tests/c/api_test.c`, run by `scripts/test-ffi.sh`) covers every
//! function from C, under AddressSanitizer too; these run with
//! `cargo test` and pin the semantics the Rust side promises.

use std::ffi::{CStr, CString, c_void};
use std::mem::{MaybeUninit, size_of};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};

use cxlkv::server::{Server, ServerConfig, ServerHandle};

use crate::args::cxlkv_bytes;
use crate::boundary::cxlkv_last_error;
use crate::client::*;
use crate::config::*;
use crate::layout::*;
use crate::read::*;
use crate::status::cxlkv_status::{self, *};

const PAGE: u64 = 64 << 10;
const FINGERPRINT: u64 = 0xF1F1;

fn last_error() -> String {
    // SAFETY: NUL-terminated, valid until this thread's next call; copied.
    unsafe { CStr::from_ptr(cxlkv_last_error()) }
        .to_string_lossy()
        .into_owned()
}

#[track_caller]
fn ok(status: cxlkv_status) {
    assert_eq!(status, CXLKV_STATUS_OK, "{}", last_error());
}

/// The tests below count live handles in the process-wide registries, so
/// they run one at a time.
static SERIAL: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

struct Fixture {
    server: Option<ServerHandle>,
    socket: CString,
    _serial: parking_lot::MutexGuard<'static, ()>,
}

impl Fixture {
    fn new(tag: &str) -> Self {
        Self::with(tag, |_| {})
    }

    /// A server configured as `new`'s, then by `edit`.
    fn with(tag: &str, edit: impl FnOnce(&mut ServerConfig)) -> Self {
        let serial = SERIAL.lock();
        let mut cfg = ServerConfig::ephemeral(tag);
        cfg.pool_size_bytes = 64 << 20;
        edit(&mut cfg);
        let server = Server::start(cfg).expect("server starts");
        let socket = CString::new(server.socket_path().as_os_str().as_encoded_bytes()).unwrap();
        Self {
            server: Some(server),
            socket,
            _serial: serial,
        }
    }

    fn config(&self) -> cxlkv_config {
        let mut c = MaybeUninit::<cxlkv_config>::uninit();
        // SAFETY: room for one config.
        ok(unsafe { cxlkv_config_init(c.as_mut_ptr(), size_of::<cxlkv_config>() as u32) });
        // SAFETY: initialised above.
        let mut c = unsafe { c.assume_init() };
        c.socket_path = self.socket.as_ptr();
        c.region_size_bytes = 4 << 20;
        c
    }

    fn connect(&self) -> (*mut cxlkv_client, *mut cxlkv_layout) {
        let config = self.config();
        let mut client = std::ptr::null_mut();
        // SAFETY: live config with valid strings, live out slot.
        ok(unsafe { cxlkv_connect(&config, &mut client) });
        let mut layout = std::ptr::null_mut();
        // SAFETY: NULL options, live out slot.
        ok(unsafe { cxlkv_layout_open(client, PAGE, FINGERPRINT, std::ptr::null(), &mut layout) });
        (client, layout)
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            let _ = s.shutdown();
        }
    }
}

fn bytes(b: &[u8]) -> cxlkv_bytes {
    cxlkv_bytes {
        data: b.as_ptr(),
        len: b.len(),
    }
}

fn close(client: *mut cxlkv_client, layout: *mut cxlkv_layout) {
    ok(cxlkv_layout_close(layout));
    // SAFETY: a handle (checked).
    ok(unsafe { cxlkv_close(client) });
}

#[test]
fn put_then_get_reads_the_same_bytes_in_place_until_released() {
    let fx = Fixture::new("ffi-put-get");
    let (client, layout) = fx.connect();
    let keys: Vec<Vec<u8>> = (0..8).map(|i| format!("k{i}").into_bytes()).collect();
    let values: Vec<Vec<u8>> = (0..8).map(|i| vec![i as u8; 1000 + i]).collect();
    let kd: Vec<cxlkv_bytes> = keys.iter().map(|k| bytes(k)).collect();
    let vd: Vec<cxlkv_bytes> = values.iter().map(|v| bytes(v)).collect();
    let mut results = vec![MaybeUninit::<cxlkv_register_result>::uninit(); 8];
    // SAFETY: 8 keys, 8 values, 8 result slots, all live.
    ok(unsafe {
        cxlkv_batch_put(
            layout,
            kd.as_ptr(),
            vd.as_ptr(),
            8,
            results.as_mut_ptr().cast(),
        )
    });
    for r in &results {
        // SAFETY: written by the call.
        assert_eq!(
            // SAFETY: passed on to the caller.
            unsafe { r.assume_init() }.outcome,
            cxlkv_register_outcome::CXLKV_REGISTER_INSERTED
        );
    }

    let mut views = vec![MaybeUninit::<cxlkv_view>::uninit(); 9];
    let mut kd2 = kd.clone();
    kd2.push(bytes(b"absent"));
    // SAFETY: 9 keys and 9 view slots.
    ok(unsafe { cxlkv_batch_get(layout, kd2.as_ptr(), 9, views.as_mut_ptr().cast()) });
    // SAFETY: written by the call.
    let mut views: Vec<cxlkv_view> = views
        .into_iter()
        .map(|v| unsafe { v.assume_init() })
        .collect();
    for (i, v) in views[..8].iter().enumerate() {
        assert!(!v.guard.is_null());
        // SAFETY: a live view's data covers len_bytes until released.
        let got = unsafe { std::slice::from_raw_parts(v.data, v.len_bytes as usize) };
        assert_eq!(got, &values[i][..]);
    }
    assert!(views[8].guard.is_null() && views[8].data.is_null());
    assert_eq!(crate::read::live_guards(), 8);

    // Pinned: the delete is refused while the views live.
    let mut del = MaybeUninit::<cxlkv_delete_result>::uninit();
    // SAFETY: one key, one slot.
    ok(unsafe { cxlkv_delete(layout, keys[0].as_ptr(), keys[0].len(), del.as_mut_ptr()) });
    // SAFETY: written by the call.
    assert_eq!(
        // SAFETY: passed on to the caller.
        unsafe { del.assume_init() }.outcome,
        cxlkv_delete_outcome::CXLKV_DELETE_PINNED
    );

    let stale = views[0];
    // SAFETY: 9 live views.
    ok(unsafe { cxlkv_batch_release(views.as_mut_ptr(), 9) });
    assert!(
        views.iter().all(|v| v.guard.is_null() && v.data.is_null()),
        "zeroed"
    );
    assert_eq!(crate::read::live_guards(), 0);
    let mut again = stale;
    // SAFETY: a copy of a released view: its guard is checked.
    assert_eq!(
        // SAFETY: passed on to the caller.
        unsafe { cxlkv_release(&mut again) },
        CXLKV_STATUS_BAD_HANDLE
    );

    // SAFETY: one key, one slot.
    ok(unsafe { cxlkv_delete(layout, keys[0].as_ptr(), keys[0].len(), del.as_mut_ptr()) });
    // SAFETY: written by the call.
    assert_eq!(
        // SAFETY: passed on to the caller.
        unsafe { del.assume_init() }.outcome,
        cxlkv_delete_outcome::CXLKV_DELETE_DELETED
    );
    let mut present = true;
    // SAFETY: one key, one slot.
    ok(unsafe { cxlkv_exists(layout, keys[0].as_ptr(), keys[0].len(), &mut present) });
    assert!(!present);
    close(client, layout);
}

#[test]
fn a_lease_written_in_place_registers_and_duplicates_name_the_winner() {
    let fx = Fixture::new("ffi-lease");
    let (client, layout) = fx.connect();
    let mut lease = std::ptr::null_mut();
    // SAFETY: live out slot.
    ok(unsafe { cxlkv_alloc(layout, &mut lease) });
    let (mut data, mut cap) = (std::ptr::null_mut(), 0u64);
    // SAFETY: live out slots.
    ok(unsafe { cxlkv_lease_data(lease, &mut data, &mut cap) });
    assert_eq!(cap, PAGE);
    // SAFETY: the lease's page is `cap` writable bytes until registered.
    unsafe { std::ptr::write_bytes(data, 0xAB, 5000) };
    ok(cxlkv_lease_set_len(lease, 5000));
    let mut r = MaybeUninit::<cxlkv_register_result>::uninit();
    // SAFETY: key, lease handle, result slot.
    ok(unsafe { cxlkv_register(layout, b"w".as_ptr(), 1, lease, r.as_mut_ptr()) });
    // SAFETY: written by the call.
    let r = unsafe { r.assume_init() };
    assert_eq!(r.outcome, cxlkv_register_outcome::CXLKV_REGISTER_INSERTED);
    // The handle was consumed.
    assert_eq!(cxlkv_lease_set_len(lease, 1), CXLKV_STATUS_BAD_HANDLE);
    assert!(last_error().contains("already freed"), "{}", last_error());

    let mut view = MaybeUninit::<cxlkv_view>::uninit();
    // SAFETY: key and view slot.
    ok(unsafe { cxlkv_get(layout, b"w".as_ptr(), 1, view.as_mut_ptr()) });
    // SAFETY: written by the call.
    let mut view = unsafe { view.assume_init() };
    assert_eq!(view.len_bytes, 5000);
    // SAFETY: a live view.
    assert!(
        // SAFETY: passed on to the caller.
        unsafe { std::slice::from_raw_parts(view.data, 5000) }
            .iter()
            .all(|b| *b == 0xAB)
    );

    let mut r = MaybeUninit::<cxlkv_register_result>::uninit();
    // SAFETY: key, value, result slot.
    ok(unsafe {
        cxlkv_put(
            layout,
            b"w".as_ptr(),
            1,
            b"other".as_ptr(),
            5,
            r.as_mut_ptr(),
        )
    });
    // SAFETY: written by the call.
    let r = unsafe { r.assume_init() };
    assert_eq!(r.outcome, cxlkv_register_outcome::CXLKV_REGISTER_DUPLICATE);
    assert_eq!(r.winner, view.location, "the winner is the first chunk");
    // SAFETY: a live view.
    ok(unsafe { cxlkv_release(&mut view) });
    assert_eq!(crate::layout::live_leases(), 0);
    close(client, layout);
}

#[test]
fn batch_register_consumes_every_lease_even_when_one_handle_is_bad() {
    let fx = Fixture::new("ffi-consume");
    let (client, layout) = fx.connect();
    let mut leases = [std::ptr::null_mut(); 3];
    // SAFETY: three out slots.
    ok(unsafe { cxlkv_batch_alloc(layout, 3, leases.as_mut_ptr()) });
    let mut info = cxlkv_layout_info {
        size: size_of::<cxlkv_layout_info>() as u32,
        ..Default::default()
    };
    // SAFETY: live, sized out struct.
    ok(unsafe { cxlkv_query_layout(layout, &mut info) });
    let free_before = info.free_pages;
    // SAFETY: a lease handle.
    ok(cxlkv_lease_abort(leases[1]));
    let keys = [bytes(b"a"), bytes(b"b"), bytes(b"c")];
    let mut results = [MaybeUninit::<cxlkv_register_result>::uninit(); 3];
    // SAFETY: 3 keys, 3 handles (one freed: checked), 3 result slots.
    let s = unsafe {
        cxlkv_batch_register(
            layout,
            keys.as_ptr(),
            leases.as_ptr(),
            3,
            results.as_mut_ptr().cast(),
        )
    };
    assert_eq!(s, CXLKV_STATUS_BAD_HANDLE);
    assert!(last_error().contains("leases[1]"), "{}", last_error());
    assert_eq!(
        crate::layout::live_leases(),
        0,
        "the valid leases were consumed"
    );
    // SAFETY: live, sized out struct.
    ok(unsafe { cxlkv_query_layout(layout, &mut info) });
    assert_eq!(info.free_pages, free_before + 3, "every page went back");
    close(client, layout);
}

#[test]
fn a_lease_write_from_its_own_page_is_refused_not_aliased() {
    let fx = Fixture::new("ffi-lease-overlap");
    let (client, layout) = fx.connect();
    let mut lease = std::ptr::null_mut();
    // SAFETY: live out slot.
    ok(unsafe { cxlkv_alloc(layout, &mut lease) });
    let (mut data, mut cap) = (std::ptr::null_mut(), 0u64);
    // SAFETY: live out slots.
    ok(unsafe { cxlkv_lease_data(lease, &mut data, &mut cap) });
    // SAFETY: the page is `cap` bytes; these point inside it.
    let (inside, tail) = unsafe { (data.add(100), data.add(cap as usize - 10)) };
    for (src, len) in [(data, 10), (inside, 50), (tail, 10)] {
        // SAFETY: `src` is readable for `len` bytes (inside the page).
        let s = unsafe { cxlkv_lease_write(lease, src, len) };
        assert_eq!(s, CXLKV_STATUS_INVALID_ARGUMENT);
        assert!(last_error().contains("overlaps"), "{}", last_error());
    }
    // Any other buffer is copied.
    let other = [7u8; 64];
    // SAFETY: a live buffer of 64 bytes.
    ok(unsafe { cxlkv_lease_write(lease, other.as_ptr(), other.len()) });
    ok(cxlkv_lease_abort(lease));
    close(client, layout);
}

#[test]
fn batch_register_over_the_batch_limit_still_consumes_every_lease() {
    let fx = Fixture::new("ffi-consume-big");
    let (client, layout) = fx.connect();
    // A small page size, so that a batch over the limit fits the pool.
    let mut small = std::ptr::null_mut();
    // SAFETY: NULL options, live out slot.
    ok(unsafe { cxlkv_layout_open(client, 4096, FINGERPRINT + 1, std::ptr::null(), &mut small) });
    let n = cxlkv_controlplane::proto::MAX_BATCH + 1;
    let mut leases = vec![std::ptr::null_mut(); n];
    let half = n / 2;
    // SAFETY: out slots for `half` and `n - half` handles.
    ok(unsafe { cxlkv_batch_alloc(small, half, leases.as_mut_ptr()) });
    // SAFETY: as above.
    ok(unsafe { cxlkv_batch_alloc(small, n - half, leases[half..].as_mut_ptr()) });
    assert_eq!(crate::layout::live_leases(), n);
    let names: Vec<Vec<u8>> = (0..n).map(|i| format!("big{i}").into_bytes()).collect();
    let keys: Vec<cxlkv_bytes> = names.iter().map(|k| bytes(k)).collect();
    let mut results = vec![MaybeUninit::<cxlkv_register_result>::uninit(); n];
    // SAFETY: n keys, n lease handles, n result slots.
    let s = unsafe {
        cxlkv_batch_register(
            small,
            keys.as_ptr(),
            leases.as_ptr(),
            n,
            results.as_mut_ptr().cast(),
        )
    };
    assert_eq!(s, CXLKV_STATUS_BATCH_TOO_LARGE);
    assert_eq!(crate::layout::live_leases(), 0, "every lease consumed");
    assert_eq!(
        cxlkv_lease_abort(leases[0]),
        CXLKV_STATUS_BAD_HANDLE,
        "a consumed handle is freed"
    );
    ok(cxlkv_layout_close(small));
    close(client, layout);
}

#[test]
fn a_view_outliving_its_closed_client_stays_mapped_but_not_pinned() {
    let fx = Fixture::new("ffi-close-unpins");
    let (client, layout) = fx.connect();
    let (other, other_layout) = fx.connect();
    let value = vec![7u8; 3000];
    let mut r = MaybeUninit::<cxlkv_register_result>::uninit();
    // SAFETY: one key, one value, one result slot.
    ok(unsafe {
        cxlkv_put(
            layout,
            b"kept".as_ptr(),
            4,
            value.as_ptr(),
            value.len(),
            r.as_mut_ptr(),
        )
    });
    let mut view = MaybeUninit::<cxlkv_view>::uninit();
    // SAFETY: one key, one view slot.
    ok(unsafe { cxlkv_get(other_layout, b"kept".as_ptr(), 4, view.as_mut_ptr()) });
    // SAFETY: written by the call.
    let mut view = unsafe { view.assume_init() };
    // SAFETY: a handle (checked).
    ok(unsafe { cxlkv_close(other) });
    // SAFETY: the view is not released: its mapping lives.
    let got = unsafe { std::slice::from_raw_parts(view.data, view.len_bytes as usize) };
    assert_eq!(got, &value[..], "still mapped");
    // The server releases the closed session's pin when it sees the
    // connection close: soon, not necessarily before the next request.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let outcome = loop {
        let mut del = MaybeUninit::<cxlkv_delete_result>::uninit();
        // SAFETY: one key, one slot.
        ok(unsafe { cxlkv_delete(layout, b"kept".as_ptr(), 4, del.as_mut_ptr()) });
        // SAFETY: written by the call.
        let outcome = unsafe { del.assume_init() }.outcome;
        if outcome == cxlkv_delete_outcome::CXLKV_DELETE_DELETED
            || std::time::Instant::now() > deadline
        {
            break outcome;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(
        outcome,
        cxlkv_delete_outcome::CXLKV_DELETE_DELETED,
        "the closed session's pin is gone (docs: release views before closing)"
    );
    // SAFETY: a live view.
    ok(unsafe { cxlkv_release(&mut view) });
    ok(cxlkv_layout_close(other_layout));
    close(client, layout);
}

#[test]
fn bad_handles_and_arguments_give_statuses_not_crashes() {
    let fx = Fixture::new("ffi-bad");
    let (client, layout) = fx.connect();
    let garbage = 0x1234_5678usize as *const cxlkv_layout;
    let mut present = false;
    // SAFETY: the handles are checked before anything else is touched.
    unsafe {
        assert_eq!(
            cxlkv_exists(garbage, b"k".as_ptr(), 1, &mut present),
            CXLKV_STATUS_BAD_HANDLE
        );
        assert_eq!(
            cxlkv_exists(client.cast(), b"k".as_ptr(), 1, &mut present),
            CXLKV_STATUS_BAD_HANDLE,
            "a client handle is not a layout handle"
        );
        assert!(last_error().contains("client handle"), "{}", last_error());
        assert_eq!(
            cxlkv_exists(layout, std::ptr::null(), 1, &mut present),
            CXLKV_STATUS_INVALID_ARGUMENT
        );
        assert_eq!(
            cxlkv_exists(layout, b"k".as_ptr(), 1, std::ptr::null_mut()),
            CXLKV_STATUS_INVALID_ARGUMENT
        );
        assert_eq!(
            cxlkv_exists(layout, b"k".as_ptr(), 0, &mut present),
            CXLKV_STATUS_KEY_LENGTH
        );
        assert_eq!(
            cxlkv_exists(layout, b"k".as_ptr(), 513, &mut present),
            CXLKV_STATUS_KEY_LENGTH
        );
        let mut r = MaybeUninit::<cxlkv_register_result>::uninit();
        assert_eq!(
            cxlkv_put(layout, b"k".as_ptr(), 1, b"v".as_ptr(), 0, r.as_mut_ptr()),
            CXLKV_STATUS_CHUNK_LENGTH
        );
        let big = vec![1u8; PAGE as usize + 1];
        assert_eq!(
            cxlkv_put(
                layout,
                b"k".as_ptr(),
                1,
                big.as_ptr(),
                big.len(),
                r.as_mut_ptr()
            ),
            CXLKV_STATUS_CHUNK_LENGTH,
            "larger than the page"
        );
        let mut views = [MaybeUninit::<cxlkv_view>::uninit(); 1];
        assert_eq!(
            cxlkv_batch_get(
                layout,
                std::ptr::dangling::<cxlkv_bytes>(),
                5000,
                views.as_mut_ptr().cast()
            ),
            CXLKV_STATUS_BATCH_TOO_LARGE
        );
        assert_eq!(
            cxlkv_batch_get(layout, std::ptr::null(), 0, std::ptr::null_mut()),
            CXLKV_STATUS_OK
        );
        let mut l = std::ptr::null_mut();
        assert_eq!(
            cxlkv_layout_open(client, 1000, 1, std::ptr::null(), &mut l),
            CXLKV_STATUS_INVALID_PAGE_SIZE
        );
        assert!(l.is_null());
    }
    close(client, layout);
    // After close: the freed handles are refused, and NULL frees are no-ops.
    // SAFETY: checked handles.
    unsafe {
        assert_eq!(cxlkv_close(client), CXLKV_STATUS_BAD_HANDLE);
        assert_eq!(cxlkv_close(std::ptr::null_mut()), CXLKV_STATUS_OK);
    }
    assert_eq!(cxlkv_flush_unpins(client), CXLKV_STATUS_BAD_HANDLE);
}

/// docs/c-api.md, "Outputs of a failed call": whatever a failed call
/// fails on — a bad handle, a bad entry found after the outputs were
/// checked — it leaves its outputs unset, not as the caller (or an earlier
/// call) left them; only a batch over the limit writes nothing.
#[test]
fn a_failed_call_leaves_its_outputs_unset_not_stale() {
    let fx = Fixture::new("ffi-unset");
    let (client, layout) = fx.connect();
    let keys = [bytes(b"u0"), bytes(b"u1")];
    let values = [bytes(b"zero"), bytes(b"one")];
    let mut results = [MaybeUninit::<cxlkv_register_result>::zeroed(); 2];
    // SAFETY: two keys, two values, two result slots.
    ok(unsafe {
        cxlkv_batch_put(
            layout,
            keys.as_ptr(),
            values.as_ptr(),
            2,
            results.as_mut_ptr().cast(),
        )
    });
    // SAFETY: written by the call that succeeded.
    let inserted = unsafe { results[0].assume_init() };
    assert_eq!(
        inserted.outcome,
        cxlkv_register_outcome::CXLKV_REGISTER_INSERTED
    );

    // The second value is refused after the outputs were checked: the
    // first call's results do not survive.
    let big = vec![1u8; PAGE as usize + 1];
    let bad_values = [bytes(b"zero"), bytes(&big)];
    // SAFETY: as above.
    let s = unsafe {
        cxlkv_batch_put(
            layout,
            keys.as_ptr(),
            bad_values.as_ptr(),
            2,
            results.as_mut_ptr().cast(),
        )
    };
    assert_eq!(s, CXLKV_STATUS_CHUNK_LENGTH);
    for r in &results {
        // SAFETY: every slot was written (unset) by the failed call.
        let r = unsafe { r.assume_init() };
        assert_eq!(r.outcome, cxlkv_register_outcome::CXLKV_REGISTER_NONE);
        assert_eq!(r.winner, cxlkv_location::default());
    }

    let garbage = 0x1234_5678usize as *const cxlkv_layout;
    let stale_view = cxlkv_view {
        guard: 0x10usize as *mut _,
        data: 0x10usize as *const u8,
        len_bytes: 7,
        location: inserted.winner,
    };
    let mut views = [stale_view; 2];
    let mut present = [true; 2];
    let mut deleted = [MaybeUninit::<cxlkv_delete_result>::zeroed(); 2];
    let mut leases = [0x10usize as *mut cxlkv_lease; 2];
    let mut l = 0x10usize as *mut cxlkv_layout;
    // SAFETY: the handles are checked; every output covers `n` slots.
    unsafe {
        assert_eq!(
            cxlkv_batch_get(garbage, keys.as_ptr(), 2, views.as_mut_ptr()),
            CXLKV_STATUS_BAD_HANDLE
        );
        assert_eq!(
            cxlkv_batch_exists(garbage, keys.as_ptr(), 2, present.as_mut_ptr()),
            CXLKV_STATUS_BAD_HANDLE
        );
        assert_eq!(
            cxlkv_batch_delete(garbage, keys.as_ptr(), 2, deleted.as_mut_ptr().cast()),
            CXLKV_STATUS_BAD_HANDLE
        );
        assert_eq!(
            cxlkv_batch_alloc(garbage, 2, leases.as_mut_ptr()),
            CXLKV_STATUS_BAD_HANDLE
        );
        assert_eq!(
            cxlkv_layout_open(garbage.cast(), PAGE, 1, std::ptr::null(), &mut l),
            CXLKV_STATUS_BAD_HANDLE
        );
    }
    assert!(
        views
            .iter()
            .all(|v| v.guard.is_null() && v.data.is_null() && v.len_bytes == 0)
    );
    assert_eq!(present, [false; 2]);
    for d in &deleted {
        // SAFETY: every slot was written (unset) by the failed call.
        let d = unsafe { d.assume_init() };
        assert_eq!(d.outcome, cxlkv_delete_outcome::CXLKV_DELETE_NONE);
    }
    assert_eq!(leases, [std::ptr::null_mut(); 2]);
    assert!(l.is_null());
    let mut len = 99usize;
    let mut buf = [0 as std::ffi::c_char; 128];
    // SAFETY: the handle is checked; 128 writable bytes, a live out slot.
    let s = unsafe { cxlkv_instance_id(garbage.cast(), buf.as_mut_ptr(), buf.len(), &mut len) };
    assert_eq!((s, len), (CXLKV_STATUS_BAD_HANDLE, 0));
    len = 99;
    // SAFETY: a NULL buffer with room claimed is refused before any write.
    let s = unsafe { cxlkv_instance_id(client, std::ptr::null_mut(), 128, &mut len) };
    assert_eq!((s, len), (CXLKV_STATUS_INVALID_ARGUMENT, 0));

    // Over the fixed ceiling (4096) nothing is written.
    let mut one = [true];
    // SAFETY: refused on `n` before any pointer is used.
    let s = unsafe { cxlkv_batch_exists(layout, std::ptr::dangling(), 5000, one.as_mut_ptr()) };
    assert_eq!(s, CXLKV_STATUS_BATCH_TOO_LARGE);
    assert_eq!(one, [true]);
    close(client, layout);
}

#[test]
fn a_layout_of_a_closed_client_reports_closed() {
    let fx = Fixture::new("ffi-closed");
    let (client, layout) = fx.connect();
    // SAFETY: a live handle.
    ok(unsafe { cxlkv_close(client) });
    let mut present = false;
    // SAFETY: live key and out slot.
    let s = unsafe { cxlkv_exists(layout, b"k".as_ptr(), 1, &mut present) };
    assert_eq!(s, CXLKV_STATUS_CLOSED, "{}", last_error());
    ok(cxlkv_layout_close(layout));
}

static MAPPED: AtomicUsize = AtomicUsize::new(0);
static UNMAPPED: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" fn on_map(user: *mut c_void, info: *const cxlkv_map_info) {
    assert_eq!(user as usize, 0xBEEF);
    // SAFETY: the library passes a live info struct.
    assert!(!unsafe { &*info }.base.is_null());
    MAPPED.fetch_add(1, Ordering::SeqCst);
}

unsafe extern "C" fn before_unmap(_: *mut c_void, _: *const cxlkv_map_info) {
    UNMAPPED.fetch_add(1, Ordering::SeqCst);
}

#[test]
fn map_callbacks_see_each_region_mapped_and_unmapped_once() {
    let fx = Fixture::new("ffi-map");
    let mut config = fx.config();
    config.initial_reservation_bytes = 4 << 20;
    config.map_callbacks = cxlkv_map_callbacks {
        on_map: Some(on_map),
        before_unmap: Some(before_unmap),
        user_data: 0xBEEF as *mut c_void,
    };
    let mut client = std::ptr::null_mut();
    // SAFETY: live config, live out slot.
    ok(unsafe { cxlkv_connect(&config, &mut client) });
    let mut layout = std::ptr::null_mut();
    // SAFETY: NULL options, live out slot.
    ok(unsafe { cxlkv_layout_open(client, PAGE, FINGERPRINT, std::ptr::null(), &mut layout) });
    assert_eq!(
        MAPPED.load(Ordering::SeqCst),
        1,
        "the initial reservation's region"
    );
    // The client first: the layout handle keeps the region mapped, so the
    // callbacks must outlive `cxlkv_close` (as the header says).
    // SAFETY: a handle (checked).
    ok(unsafe { cxlkv_close(client) });
    assert_eq!(UNMAPPED.load(Ordering::SeqCst), 0, "still mapped");
    ok(cxlkv_layout_close(layout));
    assert_eq!(UNMAPPED.load(Ordering::SeqCst), 1);
}

#[test]
fn stats_structs_report_what_the_caller_can_hold() {
    let fx = Fixture::new("ffi-stats");
    let (client, layout) = fx.connect();
    let mut r = MaybeUninit::<cxlkv_register_result>::uninit();
    // SAFETY: key, value, result slot.
    ok(unsafe { cxlkv_put(layout, b"s".as_ptr(), 1, b"v".as_ptr(), 1, r.as_mut_ptr()) });
    let mut stats = cxlkv_client_stats {
        size: size_of::<cxlkv_client_stats>() as u32,
        ..Default::default()
    };
    // SAFETY: live, sized out struct.
    ok(unsafe { cxlkv_query_stats(client, &mut stats) });
    assert!(stats.requests >= 2, "hello and register at least");
    // A size no header ever declared is refused.
    let mut short = cxlkv_usage {
        size: 8,
        ..Default::default()
    };
    // SAFETY: a live struct of at least 8 bytes.
    let s = unsafe { cxlkv_query_usage(client, &mut short) };
    assert_eq!(
        s, CXLKV_STATUS_INVALID_ARGUMENT,
        "8 is no released size of cxlkv_usage"
    );
    let mut usage = cxlkv_usage {
        size: size_of::<cxlkv_usage>() as u32,
        ..Default::default()
    };
    // SAFETY: live, sized out struct.
    ok(unsafe { cxlkv_query_usage(client, &mut usage) });
    assert_eq!(usage.instance_used_bytes, PAGE);
    let mut dir = cxlkv_directory_stats {
        size: size_of::<cxlkv_directory_stats>() as u32,
        ..Default::default()
    };
    // SAFETY: live, sized out struct.
    ok(unsafe { cxlkv_query_directory(client, &mut dir) });
    assert_eq!(dir.keys, 1);
    assert_eq!(dir.size as usize, size_of::<cxlkv_directory_stats>());
    assert_eq!(dir.max_pinned_entries, 4 << 20, "the default pair limit");
    // A caller built before the pin fields were appended declares the old
    // size: answered, and nothing written past it.
    let old_bytes = size_of::<cxlkv_directory_stats>() - 3 * 8;
    let mut old = cxlkv_directory_stats {
        size: old_bytes as u32,
        pinned_entries: u64::MAX,
        max_pinned_entries: u64::MAX,
        pin_ledger_bytes: u64::MAX,
        ..Default::default()
    };
    // SAFETY: live struct, larger than the size it declares.
    ok(unsafe { cxlkv_query_directory(client, &mut old) });
    assert_eq!((old.size as usize, old.keys), (old_bytes, 1));
    assert_eq!(
        (
            old.pinned_entries,
            old.max_pinned_entries,
            old.pin_ledger_bytes
        ),
        (u64::MAX, u64::MAX, u64::MAX),
        "bytes past the declared size are the caller's"
    );
    let mut info = cxlkv_session_info {
        size: size_of::<cxlkv_session_info>() as u32,
        ..Default::default()
    };
    // SAFETY: live, sized out struct.
    ok(unsafe { cxlkv_query_session(client, &mut info) });
    assert_ne!(info.session_id, 0);
    assert_eq!(info.owned_keys, 1);
    let mut buf = [0 as std::ffi::c_char; 128];
    let mut len = 0;
    // SAFETY: 128 writable bytes, live out slot.
    ok(unsafe { cxlkv_instance_id(client, buf.as_mut_ptr(), buf.len(), &mut len) });
    assert!(len > 0);
    close(client, layout);
}

/// The session's batch and key limits are the directory's; a caller
/// compiled against the 40-byte struct is still answered (its size's
/// fields only).
#[test]
fn the_session_info_tells_the_directorys_batch_and_key_limits() {
    let fx = Fixture::with("ffi-limits", |cfg| cfg.directory.max_batch = 64);
    let (client, layout) = fx.connect();
    let mut info = cxlkv_session_info {
        size: size_of::<cxlkv_session_info>() as u32,
        ..Default::default()
    };
    // SAFETY: live, sized out struct.
    ok(unsafe { cxlkv_query_session(client, &mut info) });
    assert_eq!(info.max_batch, 64);
    assert_eq!(
        info.max_key_bytes as usize,
        cxlkv_controlplane::proto::MAX_KEY_BYTES
    );
    let mut old = cxlkv_session_info {
        size: 40,
        max_batch: 7,
        ..Default::default()
    };
    // SAFETY: live out struct, larger than the size it declares.
    ok(unsafe { cxlkv_query_session(client, &mut old) });
    assert_ne!(old.session_id, 0);
    assert_eq!(old.max_batch, 7, "nothing written past the declared size");
    close(client, layout);
}

#[test]
fn a_tcp_addr_may_name_its_host() {
    const SECRET: &[u8] = b"ffi-tcp-host-secret";
    // Listen where `localhost` resolves first: "localhost:<port>" reaches it.
    let local = ("localhost", 0)
        .to_socket_addrs()
        .expect("localhost resolves")
        .next()
        .expect("to an address");
    let fx = Fixture::with("ffi-tcp-host", |cfg| {
        cfg.tcp_listen = Some(SocketAddr::new(local.ip(), 0));
        cfg.tcp_secret = Some(SECRET.to_vec());
    });
    let port = fx
        .server
        .as_ref()
        .and_then(|s| s.tcp_addr())
        .expect("a TCP listener")
        .port();
    let connect = |addr: &str| {
        let addr = CString::new(addr).unwrap();
        let mut config = fx.config();
        config.socket_path = std::ptr::null();
        config.tcp_addr = addr.as_ptr();
        config.client_secret = SECRET.as_ptr();
        config.client_secret_len = SECRET.len();
        let mut client = std::ptr::null_mut();
        // SAFETY: live config with valid strings and secret, live out slot.
        let s = unsafe { cxlkv_connect(&config, &mut client) };
        (s, client)
    };
    let (s, client) = connect(&format!("localhost:{port}"));
    ok(s);
    let mut info = cxlkv_session_info {
        size: size_of::<cxlkv_session_info>() as u32,
        ..Default::default()
    };
    // SAFETY: live, sized out struct.
    ok(unsafe { cxlkv_query_session(client, &mut info) });
    assert_ne!(info.session_id, 0, "a session over TCP by host name");
    // SAFETY: a handle (checked).
    ok(unsafe { cxlkv_close(client) });
    for bad in ["localhost", "localhost:port", "localhost:99999", ":1"] {
        let (s, client) = connect(bad);
        assert_eq!(s, CXLKV_STATUS_INVALID_ARGUMENT, "{bad:?}");
        assert!(client.is_null(), "{bad:?}");
        let message = last_error();
        assert!(message.contains("`config.tcp_addr`"), "{bad:?}: {message}");
    }
}

/// docs/c-api.md, "Outputs of a failed call": a `cxlkv_batch_register`
/// refused because its `leases` array cannot be read (NULL, misaligned)
/// consumes nothing, but its results are unset all the same — not left as
/// an earlier call wrote them.
#[test]
fn a_batch_register_refused_for_its_leases_array_leaves_its_results_unset() {
    let fx = Fixture::new("ffi-reg-unset");
    let (client, layout) = fx.connect();
    let keys = [bytes(b"r0"), bytes(b"r1")];
    let stale = cxlkv_register_result {
        outcome: cxlkv_register_outcome::CXLKV_REGISTER_INSERTED,
        reject_reason: cxlkv_reject_reason::CXLKV_REJECT_NONE,
        winner: cxlkv_location {
            region_id: 9,
            ..Default::default()
        },
    };
    let unset = <cxlkv_register_result as crate::args::Unset>::UNSET;
    // Room for two lease pointers one byte off their alignment.
    let raw = [0u64; 3];
    let misaligned = raw
        .as_ptr()
        .cast::<u8>()
        .wrapping_add(1)
        .cast::<*mut cxlkv_lease>();
    for (leases, what) in [
        (std::ptr::null(), "`leases` is NULL"),
        (misaligned, "`leases`"),
    ] {
        let mut results = [stale; 2];
        // SAFETY: `leases` is refused (NULL or misaligned) before it is
        // read; two keys and two result slots.
        let s =
            unsafe { cxlkv_batch_register(layout, keys.as_ptr(), leases, 2, results.as_mut_ptr()) };
        assert_eq!(s, CXLKV_STATUS_INVALID_ARGUMENT, "{}", last_error());
        assert!(last_error().contains(what), "{}", last_error());
        assert_eq!(results, [unset; 2], "{what}: stale results survived");
    }
    close(client, layout);
}

/// The last error says "with which input" went wrong: a NULL entry of a
/// batch is named by its index (`keys[1].data`, not `key`), and a
/// single-entry call names its own parameter (`lease`, not `leases[0]`).
#[test]
fn a_null_entry_is_named_as_the_caller_passed_it() {
    let fx = Fixture::new("ffi-null-entry");
    let (client, layout) = fx.connect();
    let null = cxlkv_bytes {
        data: std::ptr::null(),
        len: 2,
    };
    let keys = [bytes(b"n0"), null];
    let good_keys = [bytes(b"n0"), bytes(b"n1")];
    let values = [bytes(b"v0"), bytes(b"v1")];
    let null_value = [bytes(b"v0"), null];
    let mut views = [MaybeUninit::<cxlkv_view>::uninit(); 2];
    let mut present = [false; 2];
    let mut deleted = [MaybeUninit::<cxlkv_delete_result>::uninit(); 2];
    let mut results = [MaybeUninit::<cxlkv_register_result>::uninit(); 2];
    let mut one = MaybeUninit::<cxlkv_register_result>::uninit();
    let mut view = MaybeUninit::<cxlkv_view>::uninit();
    let check = |function: &str, status: cxlkv_status, want: &str| {
        let message = last_error();
        assert_eq!(status, CXLKV_STATUS_INVALID_ARGUMENT, "{message}");
        assert_eq!(message, format!("{function}: {want}"));
    };
    check(
        "cxlkv_batch_get",
        // SAFETY: each array holds two entries and each out slot is live
        // (here and below); a NULL entry is refused before it is read.
        unsafe { cxlkv_batch_get(layout, keys.as_ptr(), 2, views.as_mut_ptr().cast()) },
        "`keys[1].data` is NULL",
    );
    check(
        "cxlkv_batch_exists",
        // SAFETY: see above.
        unsafe { cxlkv_batch_exists(layout, keys.as_ptr(), 2, present.as_mut_ptr()) },
        "`keys[1].data` is NULL",
    );
    check(
        "cxlkv_batch_delete",
        // SAFETY: see above.
        unsafe { cxlkv_batch_delete(layout, keys.as_ptr(), 2, deleted.as_mut_ptr().cast()) },
        "`keys[1].data` is NULL",
    );
    check(
        "cxlkv_batch_put",
        // SAFETY: see above.
        unsafe {
            cxlkv_batch_put(
                layout,
                keys.as_ptr(),
                values.as_ptr(),
                2,
                results.as_mut_ptr().cast(),
            )
        },
        "`keys[1].data` is NULL",
    );
    check(
        "cxlkv_batch_put",
        // SAFETY: see above.
        unsafe {
            cxlkv_batch_put(
                layout,
                good_keys.as_ptr(),
                null_value.as_ptr(),
                2,
                results.as_mut_ptr().cast(),
            )
        },
        "`values[1].data` is NULL",
    );
    check(
        "cxlkv_get",
        // SAFETY: see above.
        unsafe { cxlkv_get(layout, std::ptr::null(), 2, view.as_mut_ptr()) },
        "`key` is NULL",
    );
    check(
        "cxlkv_put",
        // SAFETY: see above.
        unsafe {
            cxlkv_put(
                layout,
                b"n0".as_ptr(),
                2,
                std::ptr::null(),
                2,
                one.as_mut_ptr(),
            )
        },
        "`data` is NULL",
    );
    // A NULL lease is a bad handle, under its own name.
    // SAFETY: see above.
    let s = unsafe {
        cxlkv_register(
            layout,
            b"n0".as_ptr(),
            2,
            std::ptr::null_mut(),
            one.as_mut_ptr(),
        )
    };
    assert_eq!(s, CXLKV_STATUS_BAD_HANDLE);
    assert_eq!(last_error(), "cxlkv_register: `lease` is NULL");
    let mut leases = [std::ptr::null_mut::<cxlkv_lease>(); 2];
    // SAFETY: two lease slots.
    ok(unsafe { cxlkv_batch_alloc(layout, 1, leases.as_mut_ptr()) });
    // SAFETY: two keys, two lease handles (one NULL), two result slots.
    let s = unsafe {
        cxlkv_batch_register(
            layout,
            good_keys.as_ptr(),
            leases.as_ptr(),
            2,
            results.as_mut_ptr().cast(),
        )
    };
    assert_eq!(s, CXLKV_STATUS_BAD_HANDLE);
    assert_eq!(last_error(), "cxlkv_batch_register: `leases[1]` is NULL");
    assert_eq!(
        crate::layout::live_leases(),
        0,
        "the valid lease was consumed"
    );
    let mut lease = std::ptr::null_mut();
    // SAFETY: one lease slot.
    ok(unsafe { cxlkv_alloc(layout, &mut lease) });
    // SAFETY: a NULL source is refused before it is read.
    let s = unsafe { cxlkv_lease_write(lease, std::ptr::null(), 4) };
    assert_eq!(s, CXLKV_STATUS_INVALID_ARGUMENT);
    assert_eq!(last_error(), "cxlkv_lease_write: `src` is NULL");
    ok(cxlkv_lease_abort(lease));
    close(client, layout);
}

/// `cxlkv_session_info` while the server is gone: the client keeps the
/// session it last opened (and its directory's limits) until a reconnect
/// replaces it, so `session_id` is not 0 then — the header used to say it
/// was, a disconnection signal no caller could ever see.
#[test]
fn the_session_info_keeps_the_last_session_while_the_server_is_gone() {
    let mut fx = Fixture::with("ffi-gone", |cfg| cfg.directory.max_batch = 64);
    let mut config = fx.config();
    config.request_timeout_ms = 200;
    config.max_retries = 0;
    config.reconnect_timeout_ms = 300;
    let mut client = std::ptr::null_mut();
    // SAFETY: live config with valid strings, live out slot.
    ok(unsafe { cxlkv_connect(&config, &mut client) });
    let mut layout = std::ptr::null_mut();
    // SAFETY: NULL options, live out slot.
    ok(unsafe { cxlkv_layout_open(client, PAGE, FINGERPRINT, std::ptr::null(), &mut layout) });
    let info = || {
        let mut info = cxlkv_session_info {
            size: size_of::<cxlkv_session_info>() as u32,
            ..Default::default()
        };
        // SAFETY: live, sized out struct.
        ok(unsafe { cxlkv_query_session(client, &mut info) });
        info
    };
    let before = info();
    assert_ne!(before.session_id, 0);
    let _ = fx.server.take().expect("a server").shutdown();
    let mut present = true;
    // SAFETY: one key, one out slot.
    let s = unsafe { cxlkv_exists(layout, b"k".as_ptr(), 1, &mut present) };
    assert!(
        matches!(s, CXLKV_STATUS_DISCONNECTED | CXLKV_STATUS_UNANSWERED),
        "{s:?}: {}",
        last_error()
    );
    let after = info();
    assert_eq!(
        after.session_id, before.session_id,
        "the last session, not 0"
    );
    assert_eq!(after.directory_epoch, before.directory_epoch);
    assert_eq!(
        after.max_batch, 64,
        "the directory's limit, not the protocol's"
    );
    close(client, layout);
}

/// docs/c-api.md, "Calls as a thread exits": a `pthread_key_create`
/// destructor runs after the thread's other thread-locals — the library's
/// included — are destroyed (glibc runs them last), and calls made there
/// work as on a live thread. They used to return `CXLKV_STATUS_PANIC`.
#[test]
fn calls_from_a_pthread_key_destructor_work_as_on_a_live_thread() {
    static LAYOUT: AtomicUsize = AtomicUsize::new(0);
    static STATUSES: std::sync::Mutex<Vec<(&str, cxlkv_status)>> =
        std::sync::Mutex::new(Vec::new());
    extern "C" fn at_exit(_value: *mut c_void) {
        let layout = LAYOUT.load(Ordering::Acquire) as *mut cxlkv_layout;
        let record = |what, s| STATUSES.lock().unwrap().push((what, s));
        let mut view = MaybeUninit::<cxlkv_view>::uninit();
        // SAFETY: a live layout (closed only after this thread is joined),
        // a one-byte key, a live out slot.
        let s = unsafe { cxlkv_get(layout, b"k".as_ptr(), 1, view.as_mut_ptr()) };
        record("get", s);
        if s == CXLKV_STATUS_OK {
            // SAFETY: the view `cxlkv_get` filled in.
            record("release", unsafe { cxlkv_release(view.as_mut_ptr()) });
        }
        let mut result = MaybeUninit::<cxlkv_register_result>::uninit();
        // SAFETY: as above; a one-byte chunk.
        let s = unsafe {
            cxlkv_put(
                layout,
                b"k2".as_ptr(),
                2,
                b"v".as_ptr(),
                1,
                result.as_mut_ptr(),
            )
        };
        record("put", s);
    }

    let fx = Fixture::new("ffi-key-dtor");
    let (client, layout) = fx.connect();
    let mut result = MaybeUninit::<cxlkv_register_result>::uninit();
    // SAFETY: live layout, one-byte key and chunk, live out slot.
    ok(unsafe {
        cxlkv_put(
            layout,
            b"k".as_ptr(),
            1,
            b"v".as_ptr(),
            1,
            result.as_mut_ptr(),
        )
    });
    LAYOUT.store(layout as usize, Ordering::Release);
    let mut key: libc::pthread_key_t = 0;
    // SAFETY: a live out slot and a destructor that does not unwind.
    let created = unsafe { libc::pthread_key_create(&mut key, Some(at_exit)) };
    assert_eq!(created, 0);
    std::thread::spawn(move || {
        let layout = LAYOUT.load(Ordering::Acquire) as *const cxlkv_layout;
        let mut present = false;
        // SAFETY: live layout, one-byte key, live out slot. The library's
        // thread-locals are made here, so the thread destroys them.
        ok(unsafe { cxlkv_exists(layout, b"k".as_ptr(), 1, &mut present) });
        assert!(present);
        // SAFETY: a key just created; any non-NULL value (never read)
        // runs the destructor.
        let set = unsafe { libc::pthread_setspecific(key, std::ptr::dangling::<c_void>()) };
        assert_eq!(set, 0);
    })
    .join()
    .unwrap();
    // SAFETY: the key is no longer used.
    unsafe { libc::pthread_key_delete(key) };
    assert_eq!(
        *STATUSES.lock().unwrap(),
        [
            ("get", CXLKV_STATUS_OK),
            ("release", CXLKV_STATUS_OK),
            ("put", CXLKV_STATUS_OK)
        ]
    );
    close(client, layout);
}

mod tier {
    use std::sync::Mutex;

    use super::*;
    use crate::tier::*;

    /// `cxlkv_tier_reserve_write` of `keys` (one temporary flag and one page
    /// slot each), `len_bytes` 100, in `mode`.
    fn reserve_write(
        tier: *const cxlkv_tier,
        keys: &[cxlkv_bytes],
        temporary: &[u8],
        mode: u32,
        pages: &mut [cxlkv_tier_page],
    ) -> cxlkv_status {
        assert!(temporary.len() == keys.len() && pages.len() == keys.len());
        // SAFETY: a flag and a page slot for each key (checked above); the
        // tier handle is checked by the call.
        unsafe {
            cxlkv_tier_reserve_write(
                tier,
                keys.as_ptr(),
                temporary.as_ptr(),
                keys.len(),
                100,
                mode,
                pages.as_mut_ptr(),
            )
        }
    }

    /// What the listener heard, and what its re-entrant calls answered.
    #[derive(Default)]
    struct Heard {
        calls: Vec<(&'static str, Vec<Vec<u8>>)>,
        reentrant: Vec<cxlkv_status>,
        tier: usize,
    }

    static HEARD: Mutex<Option<Heard>> = Mutex::new(None);

    fn keys_of(keys: *const cxlkv_bytes, n: usize) -> Vec<Vec<u8>> {
        (0..n)
            .map(|i| {
                // SAFETY: the library passes `n` live keys for the call.
                let k = unsafe { &*keys.add(i) };
                // SAFETY: each key covers `len` bytes for the call.
                unsafe { std::slice::from_raw_parts(k.data, k.len) }.to_vec()
            })
            .collect()
    }

    unsafe extern "C" fn write_finished(_: *mut c_void, keys: *const cxlkv_bytes, n: usize) {
        let mut g = HEARD.lock().unwrap();
        let h = g.as_mut().unwrap();
        h.calls.push(("write_finished", keys_of(keys, n)));
        // A listener runs under the tier's lock: calling a locked operation
        // of the same tier is refused, a lock-free one is answered.
        let tier = h.tier as *const cxlkv_tier;
        let mut evictable = false;
        // SAFETY: a checked handle and live out slots.
        h.reentrant
            .push(unsafe { cxlkv_tier_is_key_evictable(tier, b"x".as_ptr(), 1, &mut evictable) });
        let mut status = std::mem::MaybeUninit::<cxlkv_tier_status>::zeroed();
        // SAFETY: the size field is set before the call.
        unsafe { (*status.as_mut_ptr()).size = size_of::<cxlkv_tier_status>() as u32 };
        // SAFETY: a checked handle and a sized out struct.
        h.reentrant
            .push(unsafe { cxlkv_tier_report_status(tier, status.as_mut_ptr()) });
    }

    unsafe extern "C" fn deleted(_: *mut c_void, keys: *const cxlkv_bytes, n: usize) {
        let mut g = HEARD.lock().unwrap();
        g.as_mut()
            .unwrap()
            .calls
            .push(("deleted", keys_of(keys, n)));
    }

    #[test]
    fn a_tier_round_trip_with_listeners_through_the_c_abi() {
        let fx = Fixture::new("ffi-tier");
        let (client, layout) = fx.connect();
        let mut tier = std::ptr::null_mut();
        // SAFETY: NULL config, live out slot.
        ok(unsafe { cxlkv_tier_open(layout, std::ptr::null(), &mut tier) });
        *HEARD.lock().unwrap() = Some(Heard {
            tier: tier as usize,
            ..Default::default()
        });
        let listener = cxlkv_tier_listener {
            size: size_of::<cxlkv_tier_listener>() as u32,
            reserved: 0,
            reserved_read: None,
            read_finished: None,
            reserved_write: None,
            write_finished: Some(write_finished),
            finish_write_and_reserve_read: None,
            deleted: Some(deleted),
            accessed: None,
            user_data: std::ptr::null_mut(),
        };
        // SAFETY: a live listener struct.
        ok(unsafe { cxlkv_tier_register_listener(tier, &listener) });

        let keys = [bytes(b"t0"), bytes(b"t1")];
        let temporary = [0u8, 0];
        let mut pages = [NO_PAGE_FOR_TESTS; 2];
        ok(reserve_write(tier, &keys, &temporary, 0, &mut pages));
        for (i, p) in pages.iter().enumerate() {
            assert_eq!(p.code, cxlkv_tier_code::CXLKV_TIER_SUCCESS);
            assert_eq!(p.len_bytes, 100);
            // SAFETY: a write reservation's page, `len_bytes` writable bytes.
            unsafe { std::ptr::write_bytes(p.data, b'a' + i as u8, 100) };
        }
        let mut codes = [cxlkv_tier_code::CXLKV_TIER_KEY_NOT_EXIST; 2];
        // SAFETY: two keys, two code slots.
        ok(unsafe { cxlkv_tier_finish_write(tier, keys.as_ptr(), 2, codes.as_mut_ptr()) });
        assert_eq!(codes, [cxlkv_tier_code::CXLKV_TIER_SUCCESS; 2]);

        // SAFETY: as above.
        ok(unsafe { cxlkv_tier_reserve_read(tier, keys.as_ptr(), 2, 1, pages.as_mut_ptr()) });
        // SAFETY: a held read page covers `len_bytes`.
        let first = unsafe { std::slice::from_raw_parts(pages[0].data, 100) };
        assert!(first.iter().all(|b| *b == b'a'));
        // SAFETY: two keys, two code slots.
        ok(unsafe { cxlkv_tier_delete(tier, keys.as_ptr(), 2, false, codes.as_mut_ptr()) });
        assert_eq!(codes, [cxlkv_tier_code::CXLKV_TIER_KEY_IS_LOCKED; 2]);
        // SAFETY: as above.
        ok(unsafe { cxlkv_tier_finish_read(tier, keys.as_ptr(), 2, 1, codes.as_mut_ptr()) });
        // SAFETY: as above.
        ok(unsafe { cxlkv_tier_delete(tier, keys.as_ptr(), 2, false, codes.as_mut_ptr()) });
        assert_eq!(codes, [cxlkv_tier_code::CXLKV_TIER_SUCCESS; 2]);

        // A key twice in one call is refused as a whole.
        let twice = [bytes(b"t0"), bytes(b"t0")];
        // SAFETY: as above.
        let s = unsafe { cxlkv_tier_finish_read(tier, twice.as_ptr(), 2, 1, codes.as_mut_ptr()) };
        assert_eq!(s, CXLKV_STATUS_TIER_DUPLICATE_KEY);
        let s = reserve_write(tier, &keys, &temporary, 1, &mut pages);
        assert_eq!(s, CXLKV_STATUS_TIER_UNSUPPORTED_MODE);

        ok(cxlkv_tier_close(tier));
        let heard = HEARD.lock().unwrap().take().unwrap();
        let t = |k: &[u8]| k.to_vec();
        assert_eq!(
            heard.calls,
            vec![
                ("write_finished", vec![t(b"t0"), t(b"t1")]),
                // The refused delete: nothing removed (always notified).
                ("deleted", vec![]),
                // finish_read: no private page reclaimed (always notified).
                ("deleted", vec![]),
                ("deleted", vec![t(b"t0"), t(b"t1")]),
            ]
        );
        assert_eq!(
            heard.reentrant,
            vec![CXLKV_STATUS_OK, CXLKV_STATUS_TIER_REENTRANT]
        );
        // SAFETY: a freed handle is checked.
        let s = unsafe { cxlkv_tier_reserve_read(tier, keys.as_ptr(), 2, 1, pages.as_mut_ptr()) };
        assert_eq!(s, CXLKV_STATUS_BAD_HANDLE);
        close(client, layout);
    }

    /// A tier whose client was closed answers `CLOSED`, as the client's
    /// layouts do — not per-key codes (`OUT_OF_MEMORY`, `KEY_IS_LOCKED`)
    /// that the closed client's failures would otherwise read as — and
    /// can still be closed.
    #[test]
    fn a_tier_of_a_closed_client_answers_closed() {
        let fx = Fixture::new("ffi-tier-client-closed");
        let (client, layout) = fx.connect();
        let mut tier = std::ptr::null_mut();
        // SAFETY: NULL config, live out slot.
        ok(unsafe { cxlkv_tier_open(layout, std::ptr::null(), &mut tier) });
        // SAFETY: a handle (checked).
        ok(unsafe { cxlkv_close(client) });

        let keys = [bytes(b"c0")];
        let temporary = [0u8];
        let mut pages = [NO_PAGE_FOR_TESTS];
        let s = reserve_write(tier, &keys, &temporary, 0, &mut pages);
        assert_eq!(s, CXLKV_STATUS_CLOSED, "{}", last_error());
        assert_eq!(pages[0].code, cxlkv_tier_code::CXLKV_TIER_NOT_DONE);
        let mut codes = [cxlkv_tier_code::CXLKV_TIER_SUCCESS];
        // SAFETY: one key, one code slot.
        let s = unsafe { cxlkv_tier_delete(tier, keys.as_ptr(), 1, false, codes.as_mut_ptr()) };
        assert_eq!(s, CXLKV_STATUS_CLOSED, "{}", last_error());
        assert_eq!(codes, [cxlkv_tier_code::CXLKV_TIER_NOT_DONE]);
        ok(cxlkv_tier_close(tier));
        ok(cxlkv_layout_close(layout));
    }

    /// A failed tier call's per-key outputs read `NOT_DONE`, never the
    /// `SUCCESS` (0) a zero-initialised array starts with, nor an earlier
    /// call's results.
    #[test]
    fn a_failed_tier_call_leaves_not_done_not_success() {
        let fx = Fixture::new("ffi-tier-unset");
        let (client, layout) = fx.connect();
        let mut tier = 0x10usize as *mut cxlkv_tier;
        // SAFETY: the layout handle is checked; live out slot.
        let s = unsafe { cxlkv_tier_open(std::ptr::null(), std::ptr::null(), &mut tier) };
        assert_eq!(s, CXLKV_STATUS_BAD_HANDLE);
        assert!(tier.is_null());
        // SAFETY: NULL config, live out slot.
        ok(unsafe { cxlkv_tier_open(layout, std::ptr::null(), &mut tier) });

        let twice = [bytes(b"t0"), bytes(b"t0")];
        let mut codes = [cxlkv_tier_code::CXLKV_TIER_SUCCESS; 2];
        // SAFETY: two keys, two code slots.
        let s = unsafe { cxlkv_tier_finish_write(tier, twice.as_ptr(), 2, codes.as_mut_ptr()) };
        assert_eq!(s, CXLKV_STATUS_TIER_DUPLICATE_KEY);
        assert_eq!(codes, [cxlkv_tier_code::CXLKV_TIER_NOT_DONE; 2]);

        let keys = [bytes(b"t0"), bytes(b"t1")];
        let temporary = [0u8, 0];
        let mut pages = [cxlkv_tier_page {
            code: cxlkv_tier_code::CXLKV_TIER_SUCCESS,
            data: 0x10usize as *mut u8,
            len_bytes: 100,
            ..NO_PAGE_FOR_TESTS
        }; 2];
        let s = reserve_write(tier, &keys, &temporary, 7, &mut pages);
        assert_eq!(s, CXLKV_STATUS_INVALID_ARGUMENT, "an unknown mode");
        for p in &pages {
            assert_eq!(p.code, cxlkv_tier_code::CXLKV_TIER_NOT_DONE);
            assert!(p.data.is_null());
            assert_eq!(p.len_bytes, 0);
        }
        ok(cxlkv_tier_close(tier));

        let (mut used, mut total, mut writes, mut reads) = (9u64, 9u64, 9u64, 9u64);
        let mut healthy = true;
        // SAFETY: a freed handle is checked; live out slots.
        unsafe {
            assert_eq!(
                cxlkv_tier_get_memory_usage(tier, &mut used, &mut total),
                CXLKV_STATUS_BAD_HANDLE
            );
            assert_eq!(
                cxlkv_tier_sweep_now(tier, &mut writes, &mut reads),
                CXLKV_STATUS_BAD_HANDLE
            );
            assert_eq!(
                cxlkv_tier_memcheck(tier, &mut healthy),
                CXLKV_STATUS_BAD_HANDLE
            );
        }
        assert_eq!((used, total, writes, reads, healthy), (0, 0, 0, 0, false));
        close(client, layout);
    }

    /// A NULL key of a tier call is named by its index, as the layout
    /// calls name theirs (`keys[1].data`, not `key`).
    #[test]
    fn a_null_key_of_a_tier_call_is_named_by_its_index() {
        let fx = Fixture::new("ffi-tier-null-key");
        let (client, layout) = fx.connect();
        let mut tier = std::ptr::null_mut();
        // SAFETY: NULL config, live out slot.
        ok(unsafe { cxlkv_tier_open(layout, std::ptr::null(), &mut tier) });
        let keys = [
            bytes(b"t0"),
            cxlkv_bytes {
                data: std::ptr::null(),
                len: 2,
            },
        ];
        let mut pages = [NO_PAGE_FOR_TESTS; 2];
        // SAFETY: two keys (the NULL one refused before it is read), two
        // page slots.
        let s = unsafe { cxlkv_tier_reserve_read(tier, keys.as_ptr(), 2, 1, pages.as_mut_ptr()) };
        assert_eq!(s, CXLKV_STATUS_INVALID_ARGUMENT);
        assert_eq!(
            last_error(),
            "cxlkv_tier_reserve_read: `keys[1].data` is NULL"
        );
        // SAFETY: as above; no output.
        let s = unsafe { cxlkv_tier_touch_keys(tier, keys.as_ptr(), 2) };
        assert_eq!(s, CXLKV_STATUS_INVALID_ARGUMENT);
        assert_eq!(
            last_error(),
            "cxlkv_tier_touch_keys: `keys[1].data` is NULL"
        );
        ok(cxlkv_tier_close(tier));
        close(client, layout);
    }

    /// A versioned struct's `reserved` field or flag bit may get a meaning
    /// in a later minor version (its size unchanged): a library that
    /// cannot honour it refuses it rather than ignoring it.
    #[test]
    fn unknown_flags_and_reserved_fields_of_tier_structs_are_refused() {
        let fx = Fixture::new("ffi-tier-reserved");
        let (client, layout) = fx.connect();
        let mut config = std::mem::MaybeUninit::<cxlkv_tier_config>::zeroed();
        // SAFETY: a writable struct of the declared size.
        ok(unsafe {
            cxlkv_tier_config_init(config.as_mut_ptr(), size_of::<cxlkv_tier_config>() as u32)
        });
        // SAFETY: initialised by the call above.
        let mut config = unsafe { config.assume_init() };
        config.flags = 1 << 31;
        let mut tier = std::ptr::null_mut();
        // SAFETY: a live config, a live out slot.
        let s = unsafe { cxlkv_tier_open(layout, &config, &mut tier) };
        assert_eq!(s, CXLKV_STATUS_INVALID_ARGUMENT);
        assert!(tier.is_null());
        assert!(
            last_error().contains("unknown bits 0x80000000"),
            "{}",
            last_error()
        );
        config.flags = 0;
        // SAFETY: as above.
        ok(unsafe { cxlkv_tier_open(layout, &config, &mut tier) });
        let listener = cxlkv_tier_listener {
            size: size_of::<cxlkv_tier_listener>() as u32,
            reserved: 1,
            reserved_read: None,
            read_finished: None,
            reserved_write: None,
            write_finished: None,
            finish_write_and_reserve_read: None,
            deleted: None,
            accessed: None,
            user_data: std::ptr::null_mut(),
        };
        // SAFETY: a live listener struct.
        let s = unsafe { cxlkv_tier_register_listener(tier, &listener) };
        assert_eq!(s, CXLKV_STATUS_INVALID_ARGUMENT);
        ok(cxlkv_tier_close(tier));
        close(client, layout);
    }

    /// Regions `before_unmap` reported, for the hold test.
    static UNMAPPED_REGIONS: Mutex<Vec<u64>> = Mutex::new(Vec::new());

    unsafe extern "C" fn note_unmap(_: *mut c_void, info: *const cxlkv_map_info) {
        // SAFETY: the library passes a live info struct.
        let region = unsafe { &*info }.region_id;
        UNMAPPED_REGIONS.lock().unwrap().push(region);
    }

    fn unmapped(region: u64) -> bool {
        UNMAPPED_REGIONS.lock().unwrap().contains(&region)
    }

    /// Holds do not cross `fork`, as handles do not: a child releasing a
    /// page its parent held is refused and releases nothing (its copy of
    /// the mapping stays, no `before_unmap` runs there), and the parent's
    /// hold is still its own to release.
    #[test]
    fn a_tier_page_held_before_a_fork_is_not_released_in_the_child() {
        let fx = Fixture::new("ffi-tier-hold-fork");
        let (client, layout) = fx.connect();
        let chunk = [b'F'; 100];
        let mut result = MaybeUninit::<cxlkv_register_result>::uninit();
        // SAFETY: a live key, chunk and out slot.
        ok(unsafe {
            cxlkv_put(
                layout,
                b"f".as_ptr(),
                1,
                chunk.as_ptr(),
                100,
                result.as_mut_ptr(),
            )
        });
        let mut tier_config = MaybeUninit::<cxlkv_tier_config>::uninit();
        // SAFETY: room for one config.
        ok(unsafe {
            cxlkv_tier_config_init(
                tier_config.as_mut_ptr(),
                size_of::<cxlkv_tier_config>() as u32,
            )
        });
        // SAFETY: initialised above.
        let mut tier_config = unsafe { tier_config.assume_init() };
        tier_config.flags = CXLKV_TIER_HOLD_MAPPINGS;
        let mut tier = std::ptr::null_mut();
        // SAFETY: a live config, a live out slot.
        ok(unsafe { cxlkv_tier_open(layout, &tier_config, &mut tier) });
        let keys = [bytes(b"f")];
        let mut pages = [NO_PAGE_FOR_TESTS; 1];
        // SAFETY: one key, one page slot.
        ok(unsafe { cxlkv_tier_reserve_read(tier, keys.as_ptr(), 1, 1, pages.as_mut_ptr()) });
        let data = pages[0].data;
        assert!(!data.is_null());

        // SAFETY: the child calls one function, which takes only the holds'
        // lock (no other thread of this serialised test holds it), formats
        // a message (glibc's allocator is fork-safe), and leaves with
        // `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let refused = cxlkv_tier_release_page(data) == CXLKV_STATUS_BAD_HANDLE
                && last_error().contains("before this process was forked");
            // SAFETY: ends the child without running the harness's exit.
            unsafe { libc::_exit(if refused { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: `pid` is this test's child; `status` a valid out pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the child released a hold its parent took (status {status:#x})"
        );
        ok(cxlkv_tier_release_page(data));
        let codes = &mut [cxlkv_tier_code::CXLKV_TIER_KEY_NOT_EXIST];
        // SAFETY: one key, one code slot.
        ok(unsafe { cxlkv_tier_finish_read(tier, keys.as_ptr(), 1, 1, codes.as_mut_ptr()) });
        ok(cxlkv_tier_close(tier));
        close(client, layout);
    }

    /// Found by a review: once the sweeper reclaimed a read reservation,
    /// nothing kept the peer region behind its page mapped, and evicting
    /// the region from the mapping cache unmapped it under the address the
    /// tier had handed out (a Python memoryview of it then faulted). With
    /// `CXLKV_TIER_HOLD_MAPPINGS` the page stays mapped until its hold is
    /// released, however its reservation ended.
    #[test]
    fn a_held_tier_page_stays_mapped_after_its_reservation_is_swept() {
        let fx = Fixture::new("ffi-tier-hold");
        // Two other instances publish a key each, in their own regions.
        let (p_client, p_layout) = fx.connect();
        let (q_client, q_layout) = fx.connect();
        let mut result = MaybeUninit::<cxlkv_register_result>::uninit();
        for (layout, key, fill) in [(p_layout, b"k1", b'A'), (q_layout, b"k2", b'B')] {
            let chunk = [fill; 1000];
            // SAFETY: a live key, chunk and out slot.
            ok(unsafe {
                cxlkv_put(
                    layout,
                    key.as_ptr(),
                    2,
                    chunk.as_ptr(),
                    1000,
                    result.as_mut_ptr(),
                )
            });
        }
        // The reader maps at most one peer region at a time.
        let mut config = fx.config();
        config.max_peer_mappings = 1;
        config.map_callbacks = cxlkv_map_callbacks {
            on_map: None,
            before_unmap: Some(note_unmap),
            user_data: std::ptr::null_mut(),
        };
        let mut client = std::ptr::null_mut();
        // SAFETY: live config, live out slot.
        ok(unsafe { cxlkv_connect(&config, &mut client) });
        let mut layout = std::ptr::null_mut();
        // SAFETY: NULL options, live out slot.
        ok(unsafe { cxlkv_layout_open(client, PAGE, FINGERPRINT, std::ptr::null(), &mut layout) });
        let mut tier_config = MaybeUninit::<cxlkv_tier_config>::uninit();
        // SAFETY: room for one config.
        ok(unsafe {
            cxlkv_tier_config_init(
                tier_config.as_mut_ptr(),
                size_of::<cxlkv_tier_config>() as u32,
            )
        });
        // SAFETY: initialised above.
        let mut tier_config = unsafe { tier_config.assume_init() };
        tier_config.flags = CXLKV_TIER_HOLD_MAPPINGS;
        tier_config.read_ttl_ms = 1;
        let mut tier = std::ptr::null_mut();
        // SAFETY: a live config, a live out slot.
        ok(unsafe { cxlkv_tier_open(layout, &tier_config, &mut tier) });

        let keys = [bytes(b"k1")];
        let mut pages = [NO_PAGE_FOR_TESTS; 1];
        // SAFETY: one key, one page slot.
        ok(unsafe { cxlkv_tier_reserve_read(tier, keys.as_ptr(), 1, 1, pages.as_mut_ptr()) });
        assert_eq!(pages[0].code, cxlkv_tier_code::CXLKV_TIER_SUCCESS);
        let (data, region) = (pages[0].data, pages[0].location.region_id);
        // The reservation expires and is reclaimed: its pin and its
        // staging's reference to the mapping go.
        std::thread::sleep(std::time::Duration::from_millis(5));
        let (mut swept_writes, mut swept_reads) = (0, 0);
        // SAFETY: live out slots.
        ok(unsafe { cxlkv_tier_sweep_now(tier, &mut swept_writes, &mut swept_reads) });
        assert_eq!((swept_writes, swept_reads), (0, 1));
        // Reading the other instance's key maps its region, which evicts
        // the first one from the one-entry cache.
        let mut view = MaybeUninit::<cxlkv_view>::uninit();
        // SAFETY: a live key and out slot.
        ok(unsafe { cxlkv_get(layout, b"k2".as_ptr(), 2, view.as_mut_ptr()) });
        // SAFETY: the view the call wrote.
        ok(unsafe { cxlkv_release(view.as_mut_ptr()) });
        let mut stats = cxlkv_client_stats {
            size: size_of::<cxlkv_client_stats>() as u32,
            ..Default::default()
        };
        // SAFETY: live, sized out struct.
        ok(unsafe { cxlkv_query_stats(client, &mut stats) });
        assert_eq!(stats.peer_regions_evicted, 1);
        // The maintenance thread retires an evicted region within a tick
        // (100 ms) and unmaps it once nothing holds it: not while the hold
        // lasts.
        std::thread::sleep(std::time::Duration::from_millis(600));
        assert!(
            !unmapped(region),
            "the held page's region was unmapped under its address"
        );
        // SAFETY: the page is held, so mapped; its bytes are stale at worst.
        let first = unsafe { std::slice::from_raw_parts(data, 1000) };
        assert!(first.iter().all(|b| *b == b'A'), "nobody reused the page");

        ok(cxlkv_tier_release_page(data));
        let s = cxlkv_tier_release_page(data);
        assert_eq!(s, CXLKV_STATUS_BAD_HANDLE, "released twice");
        assert!(
            last_error().contains("not a held tier page"),
            "{}",
            last_error()
        );
        ok(cxlkv_tier_release_page(std::ptr::null()));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !unmapped(region) {
            assert!(
                std::time::Instant::now() < deadline,
                "the region stayed mapped after its last hold was released"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }

        ok(cxlkv_tier_close(tier));
        close(client, layout);
        close(p_client, p_layout);
        close(q_client, q_layout);
    }

    /// Every page a holding tier returns is held once, whichever call
    /// returned it; a tier without the flag takes no hold.
    #[test]
    fn a_holding_tier_holds_each_page_it_returns_once_per_return() {
        let fx = Fixture::new("ffi-tier-hold-count");
        let (client, layout) = fx.connect();
        let mut tier_config = MaybeUninit::<cxlkv_tier_config>::uninit();
        // SAFETY: room for one config.
        ok(unsafe {
            cxlkv_tier_config_init(
                tier_config.as_mut_ptr(),
                size_of::<cxlkv_tier_config>() as u32,
            )
        });
        // SAFETY: initialised above.
        let mut tier_config = unsafe { tier_config.assume_init() };
        let mut plain = std::ptr::null_mut();
        // SAFETY: a live config, a live out slot.
        ok(unsafe { cxlkv_tier_open(layout, &tier_config, &mut plain) });
        tier_config.flags = CXLKV_TIER_HOLD_MAPPINGS;
        let mut tier = std::ptr::null_mut();
        // SAFETY: as above.
        ok(unsafe { cxlkv_tier_open(layout, &tier_config, &mut tier) });

        let keys = [bytes(b"h0"), bytes(b"h1")];
        let temporary = [0u8, 1];
        let mut pages = [NO_PAGE_FOR_TESTS; 2];
        ok(reserve_write(tier, &keys, &temporary, 0, &mut pages));
        let written: Vec<*mut u8> = pages.iter().map(|p| p.data).collect();
        let mut codes = [cxlkv_tier_code::CXLKV_TIER_NOT_DONE; 2];
        // SAFETY: one key, one code slot.
        ok(unsafe { cxlkv_tier_finish_write(tier, keys.as_ptr(), 1, codes.as_mut_ptr()) });
        // The promote of the temporary returns its page again: held twice.
        // SAFETY: one key, one page slot.
        ok(unsafe {
            cxlkv_tier_finish_write_and_reserve_read(
                tier,
                keys[1..].as_ptr(),
                1,
                1,
                pages.as_mut_ptr(),
            )
        });
        assert_eq!(pages[0].data, written[1]);
        // A read of h0 and an unsafe read of it return the page written
        // (registered in place): held twice more.
        // SAFETY: one key, one page slot.
        ok(unsafe { cxlkv_tier_reserve_read(tier, keys.as_ptr(), 1, 1, pages.as_mut_ptr()) });
        assert_eq!(pages[0].data, written[0]);
        // SAFETY: as above.
        ok(unsafe { cxlkv_tier_unsafe_read(tier, keys.as_ptr(), 1, pages.as_mut_ptr()) });
        assert_eq!(pages[0].data, written[0]);
        // The other tier takes no hold on what it returns.
        // SAFETY: as above.
        ok(unsafe { cxlkv_tier_reserve_read(plain, keys.as_ptr(), 1, 1, pages.as_mut_ptr()) });
        assert_eq!(pages[0].data, written[0]);
        ok(cxlkv_tier_close(plain));
        // Closing the tier leaves the holds: they are the caller's.
        ok(cxlkv_tier_close(tier));
        for (data, holds) in [(written[0], 3), (written[1], 2)] {
            for _ in 0..holds {
                ok(cxlkv_tier_release_page(data));
            }
            assert_eq!(cxlkv_tier_release_page(data), CXLKV_STATUS_BAD_HANDLE);
        }
        close(client, layout);
    }

    const NO_PAGE_FOR_TESTS: cxlkv_tier_page = cxlkv_tier_page {
        code: cxlkv_tier_code::CXLKV_TIER_KEY_NOT_EXIST,
        reserved: 0,
        data: std::ptr::null_mut(),
        len_bytes: 0,
        page_size_bytes: 0,
        location: cxlkv_location {
            region_id: 0,
            page: 0,
            generation: 0,
            len_bytes: 0,
            reserved: 0,
        },
    };
}
