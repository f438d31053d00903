//! Read guards and the pins behind them.
//!
//! A [`ReadGuard`] is a pinned, read-only view of one chunk, in place in the
//! pool: its bytes are the mapping's bytes (no copy). The pin, taken by the
//! `Lookup` that found the key, keeps the directory from deleting the key,
//! so the page's owner cannot reuse it while the guard lives. Dropping the
//! guard releases the pin.
//!
//! **A guard keeps its client.** Pins belong to the session, which ends
//! when the client does: so a guard holds the client alive (a clone of
//! its handle), and a view that outlives every `Client` and `LayoutHandle`
//! is still pinned; the session ends when the last guard goes. Only an
//! explicit [`Client::close`](super::Client::close) ends it under live
//! guards, which then stay mapped but unpinned.
//!
//! **Deferred, batched unpins.** A dropped guard queues its unpin; the
//! queue is sent as one `Unpin` per layout (a) by the maintenance thread
//! within `unpin_delay_us` (≤ 1 ms) of the first queued entry, or (b) before
//! *any* other request of this client, whichever comes first — so a client
//! always observes its own releases (drop a guard, then delete the key:
//! never `Pinned` by yourself). Entries are taken from the queue and sent
//! under one lock, and the queue's length is lowered only after the send,
//! so a thread that finds the queue empty knows every release queued
//! before it is already on the wire ahead of its own request.
//!
//! **Pins and sessions.** Pins belong to a session, i.e. a connection. The
//! [`LivePins`] registry counts the pins the client's live guards hold per
//! key; after a reconnect (which ends the old session and its pins) the
//! client takes them again on the new session and clears the queue (those
//! unpins died with the old session). Keys that cannot be pinned again
//! (deleted meanwhile, or not yet re-registered after a directory restart)
//! are counted as invalidated views.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cxlkv_controlplane::proto::Location;
use cxlkv_dataplane::map::MappedRegion;
use parking_lot::{Mutex, MutexGuard};

use super::Client;

/// A pinned, read-only view of one chunk in the shared pool. Derefs to the
/// chunk's bytes; dropping it releases the pin (see the module docs). Keeps
/// its client, and so the session holding the pin, alive.
pub struct ReadGuard {
    mapping: Arc<MappedRegion>,
    layout_ix: u32,
    key: Box<[u8]>,
    location: Location,
    page_size_bytes: usize,
    /// Dropped last (fields drop in order): when this is the client's last
    /// handle, the shutdown it runs finds the mapping released.
    client: Client,
}

impl ReadGuard {
    /// Builds a guard whose view was checked to lie in `mapping` (the caller
    /// holds one pin on `key` for it, registered in [`LivePins`]).
    pub(crate) fn new(
        client: Client,
        mapping: Arc<MappedRegion>,
        layout_ix: u32,
        key: Box<[u8]>,
        location: Location,
        page_size_bytes: usize,
    ) -> Self {
        debug_assert!(
            mapping
                .page(
                    page_size_bytes,
                    location.page_index(),
                    location.len_bytes as usize
                )
                .is_ok()
        );
        Self {
            mapping,
            layout_ix,
            key,
            location,
            page_size_bytes,
            client,
        }
    }

    /// The chunk, in place in the pool.
    pub fn bytes(&self) -> &[u8] {
        self.mapping
            .page(
                self.page_size_bytes,
                self.location.page_index(),
                self.location.len_bytes as usize,
            )
            .expect("invariant: the view was bounds-checked when the guard was made")
            .as_bytes()
    }

    pub fn key(&self) -> &[u8] {
        &self.key
    }

    /// Where the chunk lives (region, page, generation, length).
    pub fn location(&self) -> Location {
        self.location
    }

    /// Releases the pin now (same as dropping the guard).
    pub fn release(self) {}
}

impl std::ops::Deref for ReadGuard {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes()
    }
}

impl fmt::Debug for ReadGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadGuard")
            .field("key_len_bytes", &self.key.len())
            .field("location", &self.location)
            .finish()
    }
}

impl Drop for ReadGuard {
    fn drop(&mut self) {
        if self.client.shared().owner.forked() {
            // The pin is the parent's (`fork.rs`): nothing is released or
            // queued here. (Nothing queued here could be sent either — the
            // child's requests are refused — but queueing takes the pin
            // ledger's lock, which a thread of the parent may have held at
            // the fork.)
            return;
        }
        let key = std::mem::take(&mut self.key);
        self.client.shared().release_pin(self.layout_ix, key);
    }
}

/// Pin counts by `(layout index, key)`.
pub(crate) type PinCounts = HashMap<(u32, Box<[u8]>), u32>;

/// The pin ledger: the pins the current session holds for live views
/// (what it derefs to), and the live views whose pins were lost.
#[derive(Debug, Default)]
pub(crate) struct PinLedger {
    held: PinCounts,
    /// Live views per key whose pins died with a session and could not be
    /// taken again (counted as invalidated). Their releases send no unpin:
    /// one session's pins on one key are interchangeable, so such an unpin
    /// would release the pin of a newer view of the same key.
    pub orphans: PinCounts,
    /// Where the views counted in `held` read, per key. All of a key's
    /// pinned views read one location (a pinned key cannot be deleted, so
    /// it cannot move); a reattach compares it with where the key is now,
    /// since between the old session's end and the new pins the key may
    /// have been deleted and written again elsewhere. Kept in step with
    /// `held` (`count`, `take_held`; a reattach prunes what it dropped).
    pub at: HashMap<(u32, Box<[u8]>), Location>,
}

impl PinLedger {
    /// Counts `n` pins the current session took for views of `key` that
    /// read `location`.
    pub fn count(&mut self, layout_ix: u32, key: &[u8], n: u32, location: Location) {
        let k = (layout_ix, Box::<[u8]>::from(key));
        *self.held.entry(k.clone()).or_insert(0) += n;
        self.at.insert(k, location);
    }

    /// Takes up to `n` of the current session's pins on `k` out of the
    /// ledger (forgetting the key's location with its last pin); returns
    /// how many were taken.
    pub fn take_held(&mut self, k: &(u32, Box<[u8]>), n: u64) -> u64 {
        let taken = take_count(&mut self.held, k, n);
        if taken > 0 && !self.held.contains_key(k) {
            self.at.remove(k);
        }
        taken
    }

    /// Forgets the locations of keys no view holds a pin on any more.
    pub fn prune_locations(&mut self) {
        let held = &self.held;
        self.at.retain(|k, _| held.contains_key(k));
    }
}

impl std::ops::Deref for PinLedger {
    type Target = PinCounts;

    fn deref(&self) -> &PinCounts {
        &self.held
    }
}

impl std::ops::DerefMut for PinLedger {
    fn deref_mut(&mut self) -> &mut PinCounts {
        &mut self.held
    }
}

/// Takes up to `n` from `map[k]`, removing the entry at zero; returns how
/// many were taken.
pub(crate) fn take_count(map: &mut PinCounts, k: &(u32, Box<[u8]>), n: u64) -> u64 {
    let Some(have) = map.get_mut(k) else {
        return 0;
    };
    let take = n.min(u64::from(*have));
    // `take` ≤ `*have`, a u32.
    *have -= take as u32;
    if *have == 0 {
        map.remove(k);
    }
    take
}

/// Pins held by live guards, per `(layout, key)`.
#[derive(Debug, Default)]
pub(crate) struct LivePins {
    map: Mutex<PinLedger>,
}

impl LivePins {
    pub fn lock(&self) -> MutexGuard<'_, PinLedger> {
        self.map.lock()
    }

    /// Counts one view's release; true when it held a pin of the current
    /// session (an unpin is due), false when its pin was lost with a
    /// session (an orphan, or a release never counted).
    pub fn remove(ledger: &mut PinLedger, layout_ix: u32, key: &[u8]) -> bool {
        let k = (layout_ix, Box::<[u8]>::from(key));
        if take_count(&mut ledger.orphans, &k, 1) == 1 {
            return false;
        }
        ledger.take_held(&k, 1) == 1
    }
}

/// Unpins waiting to be sent.
#[derive(Debug, Default)]
pub(crate) struct UnpinQueue {
    /// Entries queued and not yet on the wire; lowered only after the send.
    pending: AtomicUsize,
    /// Sequence numbers of the `Unpin` requests on the wire whose replies
    /// are not handled yet (a flush waits for those another thread sent
    /// before it, too).
    unanswered: Mutex<BTreeSet<u64>>,
    queue: Mutex<Vec<(u32, Box<[u8]>)>>,
}

impl UnpinQueue {
    /// True when some release is queued and not yet sent.
    pub fn has_pending(&self) -> bool {
        // Acquire: pairs with the Release decrement in `sent`, so a thread
        // that reads 0 also sees that the send happened before it.
        self.pending.load(Ordering::Acquire) > 0
    }

    /// Queues one unpin; returns true if the queue was empty (the caller
    /// wakes the maintenance thread to bound the delay).
    pub fn push(&self, layout_ix: u32, key: Box<[u8]>) -> bool {
        let mut q = self.queue.lock();
        q.push((layout_ix, key));
        // Relaxed: the queue lock orders it with the flushers' decrement.
        self.pending.fetch_add(1, Ordering::Relaxed) == 0
    }

    /// Locks the queue for a flush: the caller takes the entries, sends
    /// them, and then calls [`UnpinQueue::sent`] before unlocking.
    pub fn lock(&self) -> MutexGuard<'_, Vec<(u32, Box<[u8]>)>> {
        self.queue.lock()
    }

    /// `n` entries taken by a flush are on the wire (or were dropped), in
    /// the requests numbered `seqs`, whose replies are awaited
    /// ([`answered`](Self::answered) each).
    pub fn sent(&self, n: usize, seqs: impl IntoIterator<Item = u64>) {
        // Before `pending` falls: a flusher that sees nothing pending sees
        // these as unanswered.
        self.unanswered.lock().extend(seqs);
        // Release: see `has_pending`.
        self.pending.fetch_sub(n, Ordering::Release);
    }

    /// The reply of the `Unpin` numbered `seq`, sent under
    /// [`sent`](Self::sent), was handled (or the request given up).
    pub fn answered(&self, seq: u64) {
        self.unanswered.lock().remove(&seq);
    }

    /// The newest `Unpin` on the wire, unanswered (`None`: none is).
    pub fn newest_unanswered(&self) -> Option<u64> {
        self.unanswered.lock().last().copied()
    }

    /// Whether some `Unpin` numbered `seq` or lower is still unanswered.
    pub fn unanswered_up_to(&self, seq: u64) -> bool {
        self.unanswered.lock().first().is_some_and(|&s| s <= seq)
    }
}

/// Groups taken entries into one `(layout, keys, counts)` batch per layout,
/// merging repeated keys into a count. A count is at most
/// `max_pins_per_entry` (the session's per-key limit, which the directory
/// enforces on every `Unpin` entry): a key released more often than that
/// appears in several entries, each within the limit.
pub(crate) fn group_unpins(
    entries: Vec<(u32, Box<[u8]>)>,
    max_pins_per_entry: u32,
) -> Vec<(u32, Vec<Vec<u8>>, Vec<u32>)> {
    assert!(max_pins_per_entry >= 1, "an unpin count is at least 1");
    let mut by_layout: HashMap<u32, HashMap<Box<[u8]>, u64>> = HashMap::new();
    for (layout, key) in entries {
        *by_layout.entry(layout).or_default().entry(key).or_insert(0) += 1;
    }
    let mut out: Vec<_> = by_layout
        .into_iter()
        .map(|(layout, by_key)| {
            let (mut keys, mut counts) = (Vec::new(), Vec::new());
            for (key, mut left) in by_key {
                while left > 0 {
                    let count = left.min(u64::from(max_pins_per_entry));
                    keys.push(key.to_vec());
                    // At most `max_pins_per_entry`, a u32.
                    counts.push(count as u32);
                    left -= count;
                }
            }
            (layout, keys, counts)
        })
        .collect();
    out.sort_by_key(|(layout, _, _)| *layout);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpins_are_grouped_per_layout_with_repeated_keys_counted() {
        let entries = vec![
            (1, Box::from(&b"a"[..])),
            (0, Box::from(&b"a"[..])),
            (1, Box::from(&b"a"[..])),
            (1, Box::from(&b"b"[..])),
        ];
        let groups = group_unpins(entries, 1024);
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[0], (0, vec![b"a".to_vec()], vec![1]));
        let (layout, keys, counts) = &groups[1];
        assert_eq!(*layout, 1);
        let mut pairs: Vec<_> = keys.iter().cloned().zip(counts.iter().copied()).collect();
        pairs.sort();
        assert_eq!(pairs, vec![(b"a".to_vec(), 2), (b"b".to_vec(), 1)]);
    }

    /// Found by a review of the client: more releases of one key than one
    /// `Unpin` entry may count (`MAX_PINS_PER_KEY`), queued between two
    /// flushes, were merged into one count the directory refuses; the
    /// unpins were given up and the session ended. The count is split.
    #[test]
    fn a_key_released_more_often_than_one_entry_may_count_is_split_over_entries() {
        let limit = cxlkv_controlplane::proto::MAX_PINS_PER_KEY as u32;
        let entries = |n: u32| (0..n).map(|_| (0, Box::from(&b"k"[..]))).collect();
        let groups = group_unpins(entries(2 * limit + 1), limit);
        assert_eq!(groups.len(), 1);
        let (layout, keys, mut counts) = groups.into_iter().next().expect("one layout");
        assert_eq!(layout, 0);
        assert!(keys.iter().all(|k| k == b"k"), "{keys:?}");
        counts.sort_unstable();
        assert_eq!(
            counts,
            vec![1, limit, limit],
            "every pin, in entries within the limit"
        );
        // A session announcing a lower limit gets entries within its own.
        let (_, _, counts) = group_unpins(entries(7), 3).remove(0);
        assert!(counts.iter().all(|&c| (1..=3).contains(&c)), "{counts:?}");
        assert_eq!(counts.iter().sum::<u32>(), 7);
    }

    #[test]
    fn the_queue_reports_pending_until_the_flush_says_sent() {
        let q = UnpinQueue::default();
        assert!(!q.has_pending());
        assert!(q.push(0, Box::from(&b"k"[..])));
        assert!(!q.push(0, Box::from(&b"j"[..])));
        let mut locked = q.lock();
        let taken = std::mem::take(&mut *locked);
        assert!(q.has_pending(), "taken but not yet sent");
        assert_eq!(q.newest_unanswered(), None);
        q.sent(taken.len(), [7, 9]);
        drop(locked);
        assert!(!q.has_pending());
        // What a flush waits for: the requests on the wire when it began,
        // not those sent after.
        assert_eq!(q.newest_unanswered(), Some(9));
        q.sent(0, [12]);
        q.answered(7);
        assert!(q.unanswered_up_to(9), "9 is still on the wire");
        q.answered(9);
        assert!(!q.unanswered_up_to(9), "12 is newer than the flush");
        assert_eq!(q.newest_unanswered(), Some(12));
        q.answered(12);
        assert_eq!(q.newest_unanswered(), None);
    }

    #[test]
    fn live_pins_count_per_key_and_refuse_a_release_never_counted() {
        let pins = LivePins::default();
        let mut map = pins.lock();
        for key in [&b"a"[..], &b"a"[..], &b"b"[..]] {
            *map.entry((0, key.into())).or_insert(0) += 1;
        }
        assert!(LivePins::remove(&mut map, 0, b"a"));
        assert!(LivePins::remove(&mut map, 0, b"a"));
        assert!(!LivePins::remove(&mut map, 0, b"a"));
        assert!(!LivePins::remove(&mut map, 1, b"b"));
        assert!(LivePins::remove(&mut map, 0, b"b"));
        assert!(map.is_empty());
    }

    #[test]
    fn an_orphaned_views_release_sends_no_unpin_even_when_a_newer_view_holds_one() {
        let pins = LivePins::default();
        let mut map = pins.lock();
        // One view whose pin was lost, one newer view with a pin.
        map.orphans.insert((0, b"k".as_slice().into()), 1);
        map.insert((0, b"k".as_slice().into()), 1);
        assert!(!LivePins::remove(&mut map, 0, b"k"), "the orphan's release");
        assert!(LivePins::remove(&mut map, 0, b"k"), "the pinned view's");
        assert!(!LivePins::remove(&mut map, 0, b"k"), "nothing left");
        assert!(map.is_empty() && map.orphans.is_empty());
    }
}
