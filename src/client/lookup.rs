//! The read path and the other key operations: `get` (lookup with pins,
//! views in place), `exists`, `delete`.
//!
//! `batch_get` is one `Lookup` round trip taking one pin per found key. The
//! reply names every region its locations point into, so a peer region
//! this client has not mapped yet is mapped right there (lazily, then
//! cached) without a second round trip. Each found key becomes a
//! [`ReadGuard`] after `acquire` (a fence, or a cache invalidation of the
//! chunk on a `Flush` pool) — its bytes are the pool's bytes.

use cxlkv_controlplane::proto::{
    self, DeleteFrom, DeleteOutcome, DeleteReply, ExistsFrom, ExistsReply, Location, LookupFrom,
    LookupReply, RegionDesc,
};
use cxlkv_dataplane::visibility;

use super::error::ClientError;
use super::layout::LayoutHandle;
use super::read::ReadGuard;
use super::rpc::{Fail, Mode};

impl LayoutHandle {
    /// Checks a key batch against the session's limits (what the directory
    /// would refuse), before anything is allocated or sent.
    pub(super) fn check_keys<'k>(
        &self,
        keys: impl ExactSizeIterator<Item = &'k [u8]>,
    ) -> Result<(), ClientError> {
        let limits = self.shared().limits();
        let max_batch = (limits.max_batch as usize).min(proto::MAX_BATCH);
        if keys.len() > max_batch {
            return Err(ClientError::BatchTooLarge {
                len: keys.len(),
                max: max_batch,
            });
        }
        let max_key = (limits.max_key_bytes as usize).min(proto::MAX_KEY_BYTES);
        for (index, key) in keys.enumerate() {
            let len = key.len();
            if len == 0 || len > max_key {
                return Err(ClientError::KeyLength {
                    index,
                    len_bytes: len,
                    max_bytes: max_key,
                });
            }
        }
        Ok(())
    }

    /// The chunk under `key`, pinned and in place; `None` if absent.
    pub fn get(&self, key: impl AsRef<[u8]>) -> Result<Option<ReadGuard>, ClientError> {
        let mut out = self.batch_get(&[key])?;
        Ok(out.pop().expect("invariant: one result per key"))
    }

    /// The chunks under `keys` (one round trip), each pinned until its
    /// guard drops; `None` for absent keys.
    pub fn batch_get<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
    ) -> Result<Vec<Option<ReadGuard>>, ClientError> {
        let shared = self.shared();
        shared.check_open()?;
        self.check_keys(keys.iter().map(AsRef::as_ref))?;
        let mut msg = LookupFrom {
            meta: Default::default(),
            layout: self.state.layout,
            keys,
            pins: 1,
        };
        let n = keys.len();
        let reply =
            shared.mutating_call::<_, LookupReply, _>("lookup", Mode::NORMAL, &mut msg, |reply| {
                #[allow(unused_mut)]
                let mut locations: Vec<Option<Location>> = reply.locations().collect();
                #[cfg(test)]
                if super::staged::SHORT_LOOKUP_REPLY.take() {
                    locations.pop();
                }
                if locations.len() != n {
                    return Err(ClientError::BadReply {
                        op: "lookup",
                        source: proto::ProtoError::Malformed {
                            kind: proto::Kind::LookupReply,
                            len_bytes: 0,
                            detail: format!("{} locations for {n} keys", locations.len()),
                        },
                    });
                }
                Ok((locations, reply.regions().collect::<Vec<RegionDesc>>()))
            });
        let (locations, regions) = match reply {
            Ok(found) => found,
            Err(f) => return Err(super::staged::pinning_lookup_failed(shared, f)),
        };
        #[cfg(test)]
        if RECONNECT_BEFORE_COUNTING.replace(false) {
            shared.end_session("test: another thread reconnects here");
        }
        // Every pin taken is now owned by a guard-to-be: count them first, so
        // that any guard dropped below (or a failure) releases exactly them.
        let served_by = super::staged::SERVED_BY.get();
        let raced = {
            let mut ledger = shared.live_pins.lock();
            for (key, location) in keys.iter().zip(&locations) {
                if let Some(location) = location {
                    ledger.count(self.state.ix, key.as_ref(), 1, *location);
                }
            }
            // Under the ledger lock: a reattach that replaces the connection
            // from now on re-pins these too.
            shared.conn().map(|c| c.conn_no).ok() != Some(served_by)
        };
        if raced {
            // The session that took these pins was replaced after the reply
            // came (another thread reconnected), and its reattach re-pinned
            // the ledger before they were in it: the directory holds no pin
            // for these views, so their pages could be freed and reused
            // under them. End the session once more: the reattach takes
            // every ledger pin again, these included.
            shared.end_session("a reconnect raced a pinning lookup");
        }
        let mut out = Vec::with_capacity(n);
        let mut failure = None;
        for (key, location) in keys.iter().zip(locations) {
            let Some(location) = location else {
                out.push(None);
                continue;
            };
            let key = key.as_ref();
            if failure.is_some() {
                shared.release_pin(self.state.ix, key.into());
                continue;
            }
            match self.guard(key, location, &regions) {
                Ok(guard) => out.push(Some(guard)),
                Err(e) => {
                    shared.release_pin(self.state.ix, key.into());
                    failure = Some(e);
                }
            }
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    fn guard(
        &self,
        key: &[u8],
        location: Location,
        regions: &[RegionDesc],
    ) -> Result<ReadGuard, ClientError> {
        let shared = self.shared();
        let desc = regions.iter().find(|d| d.region == location.region);
        let (mapping, mode) = shared.resolve_region(&self.state, location.region, desc)?;
        let page_size = self.state.page_size_bytes;
        let view = mapping.page(
            page_size,
            location.page_index(),
            location.len_bytes as usize,
        )?;
        visibility::acquire(mode, view.as_bytes());
        Ok(ReadGuard::new(
            self.client.clone(),
            mapping,
            self.state.ix,
            key.into(),
            location,
            page_size,
        ))
    }

    /// Whether `key` exists (no pin taken).
    pub fn exists(&self, key: impl AsRef<[u8]>) -> Result<bool, ClientError> {
        let mut out = self.batch_exists(&[key])?;
        Ok(out.pop().expect("invariant: one result per key"))
    }

    /// Whether each key exists, in one read-only round trip.
    pub fn batch_exists<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<bool>, ClientError> {
        let shared = self.shared();
        shared.check_open()?;
        self.check_keys(keys.iter().map(AsRef::as_ref))?;
        let mut msg = ExistsFrom {
            meta: Default::default(),
            layout: self.state.layout,
            keys,
        };
        let n = keys.len();
        shared.read_call::<_, ExistsReply, _>("exists", &mut msg, |reply| {
            if reply.present.len() as usize != n {
                return Err(ClientError::BadReply {
                    op: "exists",
                    source: proto::ProtoError::Malformed {
                        kind: proto::Kind::ExistsReply,
                        len_bytes: 0,
                        detail: format!("{} bits for {n} keys", reply.present.len()),
                    },
                });
            }
            Ok(reply.present.iter().collect())
        })
    }

    /// Deletes `key`: `Deleted`, `Pinned` (someone holds a pin; nothing
    /// changed) or `Missing`.
    pub fn delete(&self, key: impl AsRef<[u8]>) -> Result<DeleteOutcome, ClientError> {
        let mut out = self.batch_delete(&[key])?;
        Ok(out.pop().expect("invariant: one result per key"))
    }

    /// Deletes keys in one round trip; one outcome per key, never conflated.
    /// The pages' owners (this client or others) get them back through
    /// freed-page notices.
    pub fn batch_delete<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
    ) -> Result<Vec<DeleteOutcome>, ClientError> {
        let shared = self.shared();
        shared.check_open()?;
        self.check_keys(keys.iter().map(AsRef::as_ref))?;
        let mut msg = DeleteFrom {
            meta: Default::default(),
            layout: self.state.layout,
            keys,
        };
        let n = keys.len();
        shared
            .mutating_call::<_, DeleteReply, _>("delete", Mode::NORMAL, &mut msg, |reply| {
                if reply.outcomes.len() != n {
                    return Err(ClientError::BadReply {
                        op: "delete",
                        source: proto::ProtoError::Malformed {
                            kind: proto::Kind::DeleteReply,
                            len_bytes: 0,
                            detail: format!("{} outcomes for {n} keys", reply.outcomes.len()),
                        },
                    });
                }
                Ok(reply.outcomes.iter().map(DeleteOutcome::from).collect())
            })
            .map_err(Fail::into_error)
    }
}

#[cfg(test)]
thread_local! {
    /// Test fail point: the next pinning `batch_get` on this thread has its
    /// session replaced (ended and reattached, as a reconnect by another
    /// thread would) after its reply came and before its pins are counted.
    static RECONNECT_BEFORE_COUNTING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Test fail point: re-pinning after a reconnect on this thread finds
    /// no key (as when a directory restart has not seen its owner yet): no
    /// `Lookup` is sent, so no pin is taken.
    pub(crate) static REPIN_FINDS_NOTHING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::{Client, ClientConfig, DeleteOutcome, LayoutOptions};
    use crate::server::{Server, ServerConfig, ServerHandle};

    /// A server (small pool, 4 MiB regions) and two clients on it, each
    /// with the same 4 KiB layout: the writer's and the reader's.
    fn writer_and_reader(
        tag: &str,
    ) -> (ServerHandle, (Client, LayoutHandle), (Client, LayoutHandle)) {
        let mut cfg = ServerConfig::ephemeral(tag);
        cfg.pool_size_bytes = 64 << 20;
        cfg.default_region_bytes = 4 << 20;
        let server = Server::start(cfg).expect("the server starts");
        let connect = || {
            let c = Client::connect(ClientConfig::unix(server.socket_path())).expect("connect");
            let opts = LayoutOptions {
                initial_reservation_bytes: 0,
                region_size_bytes: 4 << 20,
                auto_expand: true,
            };
            let l = c.layout_with(4096, 7, opts).expect("a layout");
            (c, l)
        };
        let writer = connect();
        let reader = connect();
        (server, writer, reader)
    }

    /// Pins the directory counts for `client`'s instance, over all its
    /// sessions (a replaced one keeps its pins until the server sees its
    /// connection close).
    fn pins_held(client: &Client) -> u64 {
        let stats = client.directory_stats(proto::sections::INSTANCES).unwrap();
        let row = stats
            .instances
            .iter()
            .find(|r| r.instance_id == client.instance_id());
        row.map_or(0, |r| r.pins)
    }

    /// Found by `cxlkv chaos` (torn reads of held views after server
    /// restarts): another thread's reconnect between a lookup's reply and
    /// the counting of its pins re-pinned the old ledger, so the new
    /// session held no pin for the new views and their key could be
    /// deleted (and the page reused) under them.
    #[test]
    fn a_reconnect_between_a_lookup_reply_and_its_pin_count_still_protects_the_view() {
        let (_server, (_writer, wl), (reader, rl)) = writer_and_reader("lookup-race");
        wl.put(b"k", b"the writer's bytes").unwrap();
        RECONNECT_BEFORE_COUNTING.set(true);
        let guard = rl.get(b"k").unwrap().expect("found");
        assert!(reader.stats().reconnects >= 1, "the fail point reconnected");
        assert_eq!(
            wl.delete(b"k").unwrap(),
            DeleteOutcome::Pinned { pins: 1 },
            "the view's pin is held by the reader's current session"
        );
        assert_eq!(guard.bytes(), b"the writer's bytes");
        drop(guard);
        reader.flush_unpins().unwrap();
        assert_eq!(wl.delete(b"k").unwrap(), DeleteOutcome::Deleted);
    }

    /// Found by reading the reattach (session 17): it published the new
    /// session before re-pinning the live views, so a view another thread
    /// took on the new session in between was counted in the ledger and
    /// then pinned again by the re-pin — one pin too many, held until the
    /// session ends, so the key could not be deleted. The reattach now sets
    /// the session up before publishing it: the other thread's lookup
    /// waits for it.
    #[test]
    fn a_view_taken_while_a_reattach_sets_up_its_session_is_pinned_once() {
        let (_server, (_writer, wl), (reader, rl)) = writer_and_reader("repin-race");
        wl.put(b"k", b"the writer's bytes").unwrap();
        let held = rl.get(b"k").unwrap().expect("found");
        let other = std::sync::Arc::new(parking_lot::Mutex::new(None));
        let (rl2, other2) = (rl.clone(), std::sync::Arc::clone(&other));
        rl.shared().before_repin.set(move || {
            let t = std::thread::spawn(move || rl2.get(b"k").unwrap().expect("found"));
            // Long enough for the get to finish on a published session; it
            // waits for the reattach (this thread) when there is none.
            std::thread::sleep(std::time::Duration::from_millis(300));
            *other2.lock() = Some(t);
        });
        rl.shared().end_session("test: a reconnect");
        let newer = other
            .lock()
            .take()
            .expect("the fail point ran")
            .join()
            .unwrap();
        assert_eq!(newer.bytes(), b"the writer's bytes");
        drop(held);
        drop(newer);
        reader.flush_unpins().unwrap();
        // The replaced session's pin goes when the server sees its
        // connection close; nothing may be left on the current one.
        let pins_held = || pins_held(&reader);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while pins_held() > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(pins_held(), 0, "a pin outlived every view");
        assert_eq!(wl.delete(b"k").unwrap(), DeleteOutcome::Deleted);
    }

    /// An unpin that cannot be delivered (here: the connection's in-flight
    /// bound refuses it) leaves its pin on a session that lives on: nothing else would
    /// release it, and the key could not be deleted until the session
    /// ended. The client ends the session instead; the pin goes with it.
    #[test]
    fn an_unpin_given_up_ends_its_session_so_the_pin_does_not_outlive_the_view() {
        let (_server, (_writer, wl), (reader, rl)) = writer_and_reader("unpin-given-up");
        wl.put(b"k", b"the writer's bytes").unwrap();
        let guard = rl.get(b"k").unwrap().expect("found");
        let fail = &rl.shared().unpins_not_sent;
        fail.store(true, std::sync::atomic::Ordering::Relaxed);
        drop(guard);
        reader.flush_unpins().unwrap();
        fail.store(false, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(reader.stats().unpins_dropped, 1);
        // The next request reattaches; the old session's pin goes when the
        // server sees its connection close.
        assert!(rl.exists(b"k").unwrap());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut outcome = wl.delete(b"k").unwrap();
        while outcome != DeleteOutcome::Deleted && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
            outcome = wl.delete(b"k").unwrap();
        }
        assert_eq!(outcome, DeleteOutcome::Deleted, "the pin outlived its view");
        assert!(reader.stats().reconnects >= 1);
    }

    /// Found by a review of the client: more views of one key than one
    /// `Unpin` entry may release (`MAX_PINS_PER_KEY`), dropped between two
    /// flushes, were merged into one count the directory refuses. The
    /// unpins were given up and the session ended, and the client's own
    /// delete found the key `Pinned` by itself — against "drop a guard,
    /// then delete the key: never `Pinned` by yourself" (`read.rs`).
    #[test]
    fn a_client_that_dropped_every_view_of_a_key_can_delete_it() {
        let (_server, (_writer, wl), (reader, rl)) = writer_and_reader("many-views");
        wl.put(b"k", b"the writer's bytes").unwrap();
        let views: Vec<_> = (0..=proto::MAX_PINS_PER_KEY)
            .map(|_| rl.get(b"k").unwrap().expect("found"))
            .collect();
        let (before, session) = (reader.stats(), reader.session_id());
        // Keeps the maintenance thread from flushing part of the queue
        // early (as when guards drop faster than `unpin_delay_us`).
        rl.shared()
            .unpin_timer_armed
            .store(true, std::sync::atomic::Ordering::SeqCst);
        drop(views);
        assert_eq!(rl.delete(b"k").unwrap(), DeleteOutcome::Deleted);
        let after = reader.stats();
        assert_eq!(after.unpins_dropped, before.unpins_dropped, "{after:?}");
        assert_eq!(after.unpins_not_held, before.unpins_not_held, "{after:?}");
        assert_eq!(reader.session_id(), session, "the session was ended");
    }

    /// Found by a review of the client: a guard kept the client's shared
    /// state but not the client, so dropping the last `Client` and
    /// `LayoutHandle` ended the session under it — its pin released, the
    /// key deletable and its page reusable while the guard still read it.
    /// A guard keeps its client now; the session ends with the last guard.
    #[test]
    fn a_view_that_outlives_its_client_is_still_pinned() {
        let (server, (_writer, wl), (reader, rl)) = writer_and_reader("outlive");
        wl.put(b"k", b"the writer's bytes").unwrap();
        let guard = rl.get(b"k").unwrap().expect("found");
        let sessions = || server.directory_stats().unwrap().sessions;
        let open = sessions();
        drop(rl);
        drop(reader);
        // A session that ended is seen by the server within milliseconds;
        // this one must not end at all while the guard lives.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while std::time::Instant::now() < deadline {
            let outcome = wl.delete(b"k").unwrap();
            assert_eq!(
                outcome,
                DeleteOutcome::Pinned { pins: 1 },
                "a live guard's key; the guard reads {:?}",
                String::from_utf8_lossy(&guard)
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(sessions(), open);
        assert_eq!(guard.bytes(), b"the writer's bytes");
        // The last handle gone, the session ends (nothing else keeps it).
        drop(guard);
        delete_when_unpinned(&wl, b"k");
        assert_eq!(sessions(), open - 1);
    }

    /// Found by `cxlkv chaos` (torn reads of held views after server
    /// restarts): a view whose pin could not be taken again after a
    /// reconnect, dropped after a newer view of the same key was taken,
    /// released the newer view's pin, and the key was deleted (its page
    /// reused) under the newer view.
    #[test]
    fn an_invalidated_views_release_does_not_unpin_a_newer_view_of_the_key() {
        let (_server, (_writer, wl), (reader, rl)) = writer_and_reader("orphan-unpin");
        wl.put(b"k", b"the writer's bytes").unwrap();
        let old = rl.get(b"k").unwrap().expect("found");
        REPIN_FINDS_NOTHING.set(true);
        rl.shared()
            .end_session("test: a reconnect that cannot re-pin");
        REPIN_FINDS_NOTHING.set(false);
        assert_eq!(reader.stats().views_invalidated, 1);
        let newer = rl.get(b"k").unwrap().expect("found");
        // The replaced session still holds the old view's pin until the
        // server sees its connection close; the current one holds the newer
        // view's. Dropping the old view must not touch the current pin.
        let pins_held = || pins_held(&reader);
        let before = pins_held();
        drop(old);
        reader.flush_unpins().unwrap();
        assert_eq!(pins_held(), before, "the orphan's release sent no unpin");
        assert!(matches!(
            wl.delete(b"k").unwrap(),
            DeleteOutcome::Pinned { .. }
        ));
        assert_eq!(newer.bytes(), b"the writer's bytes");
        drop(newer);
        reader.flush_unpins().unwrap();
        assert_eq!(pins_held(), before - 1, "the newer view's pin released");
    }

    /// Found by a review of the L1 tier (session 22): a reattach took a
    /// key's pins again with one lookup capped at the protocol's per-key
    /// limit, and counted the rest as lost — views left readable but
    /// unprotected (and a directory announcing a lower limit refused the
    /// lookup, failing the reconnect). A count above the directory's limit
    /// is now taken by several lookups.
    #[test]
    fn a_reattach_takes_again_more_pins_on_a_key_than_one_lookup_may_take() {
        let (_server, (_writer, wl), (reader, rl)) = writer_and_reader("repin-split");
        wl.put(b"k", b"the writer's bytes").unwrap();
        let limit = rl.shared().limits().max_pins_per_key;
        let views: Vec<_> = (0..=limit)
            .map(|_| rl.get(b"k").unwrap().expect("found"))
            .collect();
        let want = u64::from(limit) + 1;
        rl.shared().end_session("test: a reconnect");
        assert!(rl.exists(b"k").unwrap(), "the next request reattached");
        assert_eq!(reader.stats().views_invalidated, 0, "every pin taken again");
        // The replaced session's pins go when the server sees its
        // connection close; then the current session's are what is left.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while pins_held(&reader) > want && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(pins_held(&reader), want, "one pin per live view");
        assert_eq!(views[0].bytes(), b"the writer's bytes");
        drop(views);
        reader.flush_unpins().unwrap();
        assert_eq!(pins_held(&reader), 0, "every view's release unpinned");
        assert_eq!(wl.delete(b"k").unwrap(), DeleteOutcome::Deleted);
    }

    /// Found by a review of the L1 tier (session 22; the reference's
    /// scenario 12): a pinning lookup whose reply was well formed but could
    /// not be read (one location short) was taken for a refusal, so the
    /// pins the directory took for it were never counted nor released, and
    /// the keys stayed pinned for the session's lifetime. Its session is
    /// now ended, as for a lost reply, and the pins go with it.
    #[test]
    fn a_pinning_lookup_whose_reply_cannot_be_read_does_not_leave_its_pins() {
        let (_server, (_writer, wl), (reader, rl)) = writer_and_reader("short-reply");
        wl.put(b"k", b"the writer's bytes").unwrap();
        crate::client::staged::SHORT_LOOKUP_REPLY.set(true);
        let err = rl.get(b"k").unwrap_err();
        assert!(
            matches!(err, ClientError::BadReply { op: "lookup", .. }),
            "{err:?}"
        );
        assert!(rl.exists(b"k").unwrap(), "the next request reattached");
        assert!(reader.stats().reconnects >= 1, "the session was ended");
        delete_when_unpinned(&wl, b"k");
        assert_eq!(pins_held(&reader), 0);
    }

    /// The same for the L1 tier's pinning lookup (`lookup_pinned`): the
    /// reserve reports the key unavailable and leaves no pin behind.
    #[test]
    fn a_tier_reserve_whose_reply_cannot_be_read_does_not_leave_its_pins() {
        use crate::tier::{Holds, L1Tier, TierConfig};
        let (_server, (_writer, wl), (reader, rl)) = writer_and_reader("tier-short-reply");
        wl.put(b"k", b"the writer's bytes").unwrap();
        let tier = L1Tier::new(rl.clone(), TierConfig::default()).unwrap();
        crate::client::staged::SHORT_LOOKUP_REPLY.set(true);
        let got = tier.reserve_read(&[b"k"], Holds::total(3)).unwrap();
        assert!(got[0].page.is_none(), "{:?}", got[0].code);
        assert!(rl.exists(b"k").unwrap(), "the next request reattached");
        assert!(reader.stats().reconnects >= 1, "the session was ended");
        delete_when_unpinned(&wl, b"k");
        tier.check_invariants().unwrap();
    }

    /// The writer deletes `key` (once nobody pins it any more); panics
    /// after 10 s.
    fn delete_when_unpinned(wl: &LayoutHandle, key: &[u8]) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut outcome = wl.delete(key).unwrap();
        while outcome != DeleteOutcome::Deleted && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
            outcome = wl.delete(key).unwrap();
        }
        assert_eq!(outcome, DeleteOutcome::Deleted, "a pin outlived its reader");
    }

    /// Found by an audit of the L1 tier: a reattach that could not take a
    /// staged read's pins again (counted as orphans) left the tier's entry
    /// on the old page. The key was deleted and written again elsewhere;
    /// a later `reserve_read` pinned the new location and was handed the
    /// old page — bytes nothing protects, maybe another key's.
    #[test]
    fn a_tier_read_after_a_reattach_lost_the_staged_pins_serves_the_keys_new_page() {
        use crate::tier::{Holds, L1Tier, TierCode, TierConfig};
        let (_server, (_writer, wl), (reader, rl)) = writer_and_reader("tier-moved");
        wl.put(b"k", b"A").unwrap();
        let tier = L1Tier::new(rl.clone(), TierConfig::default()).unwrap();
        let first = tier.reserve_read(&[b"k"], Holds::ONE).unwrap();
        let old = first[0].page.clone().expect("found");
        REPIN_FINDS_NOTHING.set(true);
        rl.shared()
            .end_session("test: a reconnect that cannot re-pin");
        REPIN_FINDS_NOTHING.set(false);
        assert_eq!(reader.stats().views_invalidated, 1);
        // Nothing protects the key now (the replaced session's pin goes when
        // the server sees its connection close): it is deleted and written
        // again, on another page.
        delete_when_unpinned(&wl, b"k");
        wl.put(b"filler", b"F").unwrap();
        wl.put(b"k", b"B").unwrap();
        let now = wl.get(b"k").unwrap().expect("found").location();
        wl.client.flush_unpins().unwrap();
        assert_ne!(now, old.location(), "the key moved");

        let second = tier.reserve_read(&[b"k"], Holds::ONE).unwrap();
        assert_eq!(second[0].code, TierCode::Success);
        let page = second[0].page.clone().expect("found");
        assert_eq!(page.location(), now, "the page the new pin protects");
        // SAFETY: this reservation holds the key's pin; nobody writes a
        // registered page.
        assert_eq!(unsafe { page.as_slice() }, b"B");
        let unsafe_read = tier.unsafe_read(&[b"k"]).unwrap();
        assert_eq!(
            unsafe_read[0].page.as_ref().map(|p| p.location()),
            Some(now)
        );
        // Both readers finish, in either order: the new pin is held until
        // the last one, and released then.
        assert_eq!(
            tier.finish_read(&[b"k"], Holds::ONE).unwrap(),
            vec![TierCode::Success]
        );
        assert!(matches!(
            wl.delete(b"k").unwrap(),
            DeleteOutcome::Pinned { pins: 1 }
        ));
        assert_eq!(
            tier.finish_read(&[b"k"], Holds::ONE).unwrap(),
            vec![TierCode::Success]
        );
        assert_eq!(wl.delete(b"k").unwrap(), DeleteOutcome::Deleted);
        tier.check_invariants().unwrap();
    }

    /// A region the maintenance thread took out of its table for return is
    /// still reachable by a thread that found it before (here: a snapshot
    /// held across the removal, as an allocating thread holds one); a page of
    /// it registered and then deleted by someone else must be freed by the
    /// notice, not counted as a notice for an unknown region (the page, and
    /// the region with it, would never be free again).
    #[test]
    fn a_notice_for_a_region_taken_out_for_return_frees_its_page() {
        let (_server, (writer, wl), (_reader, rl)) = writer_and_reader("notice-returning");
        wl.put(b"k", &[7u8; 100]).unwrap();
        let region =
            cxlkv_dataplane::ids::RegionId(wl.get(b"k").unwrap().unwrap().location().region);
        wl.client.flush_unpins().unwrap();
        let snapshot = wl.state.regions.read();
        wl.state.regions.remove(region).unwrap();
        assert_eq!(rl.delete(b"k").unwrap(), DeleteOutcome::Deleted);
        // The writer's next reply carries the notice.
        assert!(!wl.exists(b"k").unwrap());
        let stats = writer.stats();
        assert_eq!(stats.notices_unknown_region, 0, "{stats:?}");
        assert_eq!(stats.pages_freed_by_notice, 1, "{stats:?}");
        let r = snapshot.get(region).expect("the snapshot still holds it");
        assert_eq!(
            r.alloc.free_pages(),
            r.alloc.page_count(),
            "the page is free"
        );
    }
}
