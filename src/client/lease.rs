//! Writable page leases: the write half of the page protocol.
//!
//! A [`PageLease`] is one page the layout's allocator handed to this client
//! and that no key names yet. Its bytes are writable (`&mut [u8]`) because
//! the allocator's hand-out is exclusive — no other `alloc` returns the page
//! until this grant is freed — and the lease is neither `Clone` nor shared,
//! so at most one mutable view of the page exists at a time. No reader can
//! know the page before its key is registered, and registering consumes the
//! lease: after that the bytes can no longer be written through it.
//!
//! Dropping a lease without registering it aborts the write: the page goes
//! back to the allocator (exactly once — the allocator refuses a second free
//! of the same grant).
//!
//! **A lease keeps its client.** The page lies in a region of this
//! instance, which the directory frees once the instance is gone (its
//! session ended and its grace period passed) — and may then grant to
//! another writer. So a lease holds the client, and with it the session,
//! alive until it is dropped or registered. A lease parked with a
//! registration whose outcome is unknown (`write.rs`) lets go of it: the
//! client keeps those itself, and they must not keep it alive. After an
//! explicit [`Client::close`](super::Client::close) a lease can no longer
//! be written (its region is revoked).
//!
//! **Publication.** Before registration the bytes must be visible to every
//! reader (DESIGN §3): `register` publishes them under the pool's visibility
//! mode unless they were written by a non-temporal [`PageLease::write`]
//! (which publishes by itself) and not touched since. Under
//! `Visibility::Flush` it also writes back any line the lease may have
//! written past the chunk, so that no dirty line of a registered page stays
//! in this host's cache.

use std::fmt;
use std::sync::Arc;

use cxlkv_controlplane::proto::Location;
use cxlkv_dataplane::copy::{self, CopyPath};
use cxlkv_dataplane::ids::{Generation, PageIndex};
use cxlkv_dataplane::map::PageViewMut;
use cxlkv_dataplane::visibility::Visibility;

use super::Client;
use super::error::ClientError;
use super::regions::OwnedRegion;
use super::shared::Shared;

/// One allocated, not yet registered page (see the module docs). Keeps its
/// client alive until it is registered, dropped or parked.
pub struct PageLease {
    region: Arc<OwnedRegion>,
    layout_ix: u32,
    page: PageIndex,
    generation: Generation,
    len_bytes: usize,
    /// The chunk is not all published: bytes were written since the last
    /// publication, or the length grew past what it covered.
    needs_publish: bool,
    /// Bytes `[0, published_bytes)` were published since the last write.
    published_bytes: usize,
    /// The page was written through this lease (lines anywhere in it may
    /// be dirty in this host's cache).
    touched: bool,
    /// Bytes `[0, dirty_end)` may have been written through the lease since
    /// the last publication wrote them back — past the chunk too
    /// (`bytes_mut` lends the whole page).
    dirty_end: usize,
    /// Registration took the page (it must not be freed on drop).
    consumed: bool,
    /// The client, held alive while the user owns the lease; `None` once
    /// parked ([`PageLease::detach`]). Dropped last (fields drop in order).
    client: Option<Client>,
}

impl PageLease {
    pub(crate) fn new(
        client: Client,
        region: Arc<OwnedRegion>,
        layout_ix: u32,
        page: PageIndex,
        generation: Generation,
    ) -> Self {
        Self {
            region,
            layout_ix,
            page,
            generation,
            len_bytes: 0,
            needs_publish: false,
            published_bytes: 0,
            touched: false,
            dirty_end: 0,
            consumed: false,
            client: Some(client),
        }
    }

    /// Lets go of the client: the lease is about to be kept by the client
    /// itself (a parked registration), where holding it would keep the
    /// client alive for good — and could drop its last handle on the
    /// maintenance thread, which resends parked batches.
    pub(crate) fn detach(&mut self) {
        self.client = None;
    }

    /// The layout's page size: the most a chunk can hold.
    pub fn page_size_bytes(&self) -> usize {
        self.region.page_size_bytes
    }

    /// Where the page lies in this process, as addresses (no reference to
    /// it is formed): for a caller that must tell whether a source buffer
    /// overlaps it, as the C ABI's `cxlkv_lease_write` does.
    pub fn page_addresses(&self) -> std::ops::Range<usize> {
        let size = self.page_size_bytes();
        let start = self.region.mapping.ffi_base_ptr() as usize + self.page.0 as usize * size;
        start..start + size
    }

    /// Bytes of the chunk (what registration will record).
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// Sets the chunk length after writing through [`PageLease::bytes_mut`].
    pub fn set_len(&mut self, len_bytes: usize) -> Result<(), ClientError> {
        if len_bytes > self.page_size_bytes() {
            return Err(ClientError::ChunkLength {
                index: 0,
                len_bytes,
                page_size_bytes: self.page_size_bytes() as u64,
            });
        }
        self.len_bytes = len_bytes;
        if len_bytes > self.published_bytes {
            // A publication before this covered less than the chunk now
            // holds (`publish` at length 0, then `set_len`).
            self.needs_publish = true;
        }
        Ok(())
    }

    /// The whole page, writable. Marks the lease as needing publication.
    /// Fails if the region was taken back from this instance (it was refused
    /// at a reattach, e.g. after the instance expired while disconnected),
    /// and in a process forked from the one that allocated the page (the
    /// parent's copy of the lease may write it too: `fork.rs`).
    pub fn bytes_mut(&mut self) -> Result<PageViewMut<'_>, ClientError> {
        if let Some(client) = &self.client {
            client.shared().check_process()?;
        }
        // Acquire: pairs with the Release that revokes the region.
        if self
            .region
            .revoked
            .load(std::sync::atomic::Ordering::Acquire)
        {
            return Err(ClientError::RegionRevoked {
                region: self.region.desc.region_id(),
            });
        }
        self.needs_publish = true;
        self.published_bytes = 0;
        self.touched = true;
        let page_size = self.page_size_bytes();
        self.dirty_end = page_size;
        // SAFETY: this lease holds the allocator's exclusive grant of
        // `(page, generation)` (see the module docs): no other lease, read
        // guard or process touches the page until it is registered, which
        // consumes the lease; `&mut self` keeps this the only view from it.
        let view = unsafe {
            self.region
                .mapping
                .page_mut(page_size, self.page, page_size)
        };
        Ok(view.expect("invariant: the allocator only hands out pages inside its region"))
    }

    /// Copies `src` to the start of the page with the fastest routine and
    /// sets the length to `src.len()`. Returns the routine used (a
    /// non-temporal one also publishes the bytes).
    pub fn write(&mut self, src: &[u8]) -> Result<CopyPath, ClientError> {
        if src.is_empty() || src.len() > self.page_size_bytes() {
            return Err(ClientError::ChunkLength {
                index: 0,
                len_bytes: src.len(),
                page_size_bytes: self.page_size_bytes() as u64,
            });
        }
        let touched_before = self.needs_publish;
        // `bytes_mut` lends the whole page; this copy writes `src.len()`.
        let dirty_before = self.dirty_end;
        let path = {
            let mut view = self.bytes_mut()?;
            copy::copy_in(&mut view[..src.len()], src)
        };
        self.len_bytes = src.len();
        self.dirty_end = dirty_before.max(src.len());
        self.needs_publish = touched_before || !path.satisfies_publish();
        if !self.needs_publish {
            self.published_bytes = src.len();
        }
        Ok(path)
    }

    /// Makes the chunk's bytes visible to readers under the pool's mode (a
    /// fence on a coherent pool). `register` does this when needed.
    ///
    /// Under `Visibility::Flush` it also writes back the lines written past
    /// the chunk (through [`bytes_mut`](Self::bytes_mut), before a shorter
    /// [`set_len`](Self::set_len)): no reader reads them, but once the lease
    /// is registered nothing else would write them back, and a line left
    /// dirty in this host's cache can be evicted over the page at any time
    /// — after its region has gone to another host too. Only lines past the
    /// chunk that the lease may have written are added: none for a chunk
    /// written by [`write`](Self::write) or filling what was written.
    pub fn publish(&mut self) {
        if self.needs_publish {
            super::regions::write_back(self.region.visibility, self.chunk());
            self.needs_publish = false;
            self.published_bytes = self.len_bytes;
        }
        if self.dirty_end > self.len_bytes && self.region.visibility == Visibility::Flush {
            let page = self
                .region
                .mapping
                .page(self.page_size_bytes(), self.page, self.dirty_end)
                .expect("invariant: the allocator only hands out pages inside its region");
            super::regions::write_back(self.region.visibility, &page.as_bytes()[self.len_bytes..]);
        }
        self.dirty_end = 0;
    }

    /// Where the chunk will live once registered.
    pub fn location(&self) -> Location {
        Location {
            region: self.region.desc.region,
            page: self.page.0,
            generation: self.generation.0,
            len_bytes: self.len_bytes as u32,
        }
    }

    /// Gives the page back unused (same as dropping the lease).
    pub fn abort(self) {}

    /// Whether the lease was allocated by the layout numbered `layout_ix`
    /// of the client whose state is `shared`. A layout's index alone does
    /// not name it: another client's layout may have the same one, and its
    /// page lies in a region (of another pool, perhaps) that this client's
    /// allocator knows nothing of — or names one of its own regions by the
    /// same id. A parked lease (no client) belongs to no caller.
    pub(crate) fn is_of(&self, shared: &Arc<Shared>, layout_ix: u32) -> bool {
        self.layout_ix == layout_ix
            && self
                .client
                .as_ref()
                .is_some_and(|c| Arc::ptr_eq(c.shared(), shared))
    }

    /// The page is still this lease's grant: no freed-page notice (for a
    /// registration whose reply was overtaken) has freed it.
    pub(crate) fn still_allocated(&self) -> bool {
        self.region.alloc.is_allocated(self.page, self.generation)
    }

    /// Registration succeeded: the page now belongs to its key; dropping the
    /// lease must not free it (a freed-page notice will, after a delete).
    pub(crate) fn consume(mut self) {
        self.consumed = true;
    }

    fn chunk(&self) -> &[u8] {
        self.region
            .mapping
            .page(self.page_size_bytes(), self.page, self.len_bytes)
            .expect("invariant: the allocator only hands out pages inside its region")
            .as_bytes()
    }
}

impl fmt::Debug for PageLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PageLease")
            .field("location", &self.location())
            .field("needs_publish", &self.needs_publish)
            .field("published_bytes", &self.published_bytes)
            .finish()
    }
}

impl Drop for PageLease {
    fn drop(&mut self) {
        if !self.consumed {
            // Written: no dirty line may outlive the lease on a non-coherent
            // pool (`write_back_page`), not even one past the chunk a
            // publication covered — while the page is still this lease's.
            // A freed-page notice may have freed it (a registration that ran
            // and whose key was deleted, the lease dropped after its resend
            // was refused); then the page may be another lease's already,
            // whose `&mut [u8]` a view formed here would alias, and there is
            // nothing to write back: a lease is published in full before its
            // registration is sent. That notice is applied before the
            // registration's outcome is handed back (`exchange` absorbs a
            // reply's notices first), so it is seen here.
            if self.touched && self.still_allocated() {
                self.region.write_back_page(self.page);
            }
            // A refused free (stale or double: the page was already freed by
            // a notice) is counted by the allocator; nothing else to do.
            let _ = self.region.alloc.free(self.page, self.generation);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use crate::client::{Client, ClientConfig, ClientError, LayoutHandle, LayoutOptions};
    use crate::server::{Server, ServerConfig, ServerHandle};

    /// A server's configuration: a small pool, 4 MiB regions.
    fn server_config(tag: &str) -> ServerConfig {
        let mut cfg = ServerConfig::ephemeral(tag);
        cfg.pool_size_bytes = 64 << 20;
        cfg.default_region_bytes = 4 << 20;
        cfg
    }

    /// A server (small pool, 4 MiB regions), a client and a 4 KiB layout
    /// that owns no region yet.
    fn one_layout(tag: &str) -> (ServerHandle, Client, LayoutHandle) {
        let server = Server::start(server_config(tag)).expect("the server starts");
        layout_on(server, |_| {})
    }

    /// A client of `server` (its configuration adjusted by `tune`) and a
    /// 4 KiB layout that owns no region yet.
    fn layout_on(
        server: ServerHandle,
        tune: impl FnOnce(&mut ClientConfig),
    ) -> (ServerHandle, Client, LayoutHandle) {
        let mut cfg = ClientConfig::unix(server.socket_path());
        tune(&mut cfg);
        let client = Client::connect(cfg).expect("connect");
        let opts = LayoutOptions {
            initial_reservation_bytes: 0,
            region_size_bytes: 4 << 20,
            auto_expand: true,
        };
        let layout = client.layout_with(4096, 7, opts).expect("a layout");
        (server, client, layout)
    }

    /// Found by an audit of the C ABI (session 19): `batch_put` allocated
    /// its pages — asking the directory for a region if need be — before
    /// checking the keys, which `batch_register` then refused.
    #[test]
    fn a_put_with_a_key_the_directory_would_refuse_allocates_nothing() {
        let (_server, client, layout) = one_layout("put-keys");
        let before = client.stats();
        for key in [Vec::new(), vec![b'k'; 4096]] {
            assert!(matches!(
                layout.put(&key, b"bytes"),
                Err(ClientError::KeyLength { index: 0, .. })
            ));
        }
        let after = client.stats();
        assert_eq!(after.regions_acquired, before.regions_acquired);
        assert_eq!(after.requests, before.requests, "nothing was sent");
        // A valid one does take a region.
        layout.put(b"k", b"bytes").unwrap();
        assert_eq!(client.stats().regions_acquired, before.regions_acquired + 1);
    }

    /// Found by an audit (session 19): `publish` at length 0 cleared the
    /// flag, and a `set_len` after it did not set it again, so `register`
    /// published nothing — the chunk's lines stayed dirty in this host's
    /// cache while the key was visible to other hosts (`visibility =
    /// flush`). The flag is what `register` and the drop decide by.
    #[test]
    fn a_length_set_after_an_early_publish_is_published_again() {
        let (_server, _client, layout) = one_layout("lease-publish");
        let mut lease = layout.alloc().unwrap();
        lease.bytes_mut().unwrap()[..100].fill(7);
        lease.publish();
        assert!(!lease.needs_publish, "nothing left: the chunk is empty");
        lease.set_len(100).unwrap();
        assert!(lease.needs_publish, "the 100 bytes were never published");
        lease.publish();
        assert_eq!((lease.needs_publish, lease.published_bytes), (false, 100));
        // Shrinking needs nothing more; growing again does.
        lease.set_len(50).unwrap();
        assert!(!lease.needs_publish);
        lease.set_len(200).unwrap();
        assert!(lease.needs_publish);
    }

    /// A server (small pool, 4 MiB regions), a client that publishes by
    /// writing lines back (`visibility = flush`) and a 4 KiB layout.
    fn flush_layout(tag: &str) -> (ServerHandle, Client, LayoutHandle) {
        let server = Server::start(server_config(tag)).expect("the server starts");
        layout_on(server, |cfg| {
            cfg.visibility = Some(cxlkv_dataplane::visibility::Visibility::Flush)
        })
    }

    /// Whether every 64-byte line of `page` lies in one of `ranges`.
    fn every_line_in(page: std::ops::Range<usize>, ranges: &[std::ops::Range<usize>]) -> bool {
        (page.start..page.end)
            .step_by(64)
            .all(|line| ranges.iter().any(|r| r.contains(&line)))
    }

    /// Found by a review of the client (session 25): registration published
    /// only the chunk (`[0, len)`), and a registered lease is not written
    /// back on drop, so lines written through `bytes_mut` past the chunk
    /// stayed dirty in this host's cache (`visibility = flush`) — until an
    /// eviction wrote them over the page, perhaps after its region had gone
    /// to another host. Registration now writes back every line the lease
    /// may have written.
    #[test]
    fn lines_written_past_the_chunk_are_written_back_at_registration() {
        use crate::client::regions::test_recorder;
        let (_server, _client, layout) = flush_layout("lease-past-chunk");
        let mut lease = layout.alloc().unwrap();
        let page = lease.page_addresses();
        lease.bytes_mut().unwrap().fill(7);
        lease.set_len(100).unwrap();
        test_recorder::take();
        assert_eq!(
            layout.register(b"k", lease).unwrap(),
            crate::client::RegisterOutcome::Inserted
        );
        let written_back = test_recorder::take();
        assert!(
            every_line_in(page.clone(), &written_back),
            "page {page:x?}, written back {written_back:x?}"
        );
        // Bytes written by `write` reach no further than its source.
        let mut lease = layout.alloc().unwrap();
        let page = lease.page_addresses();
        lease.write(&[9u8; 1000]).unwrap();
        test_recorder::take();
        layout.register(b"k2", lease).unwrap();
        let written_back = test_recorder::take();
        assert!(
            written_back.iter().all(|r| r.end <= page.start + 1024),
            "page {page:x?}, written back {written_back:x?}"
        );
    }

    /// Found by a review of the client (session 25): a lease dropped after
    /// a freed-page notice had freed its page (a registration that ran, was
    /// deleted, and whose resend was refused) wrote the page back through a
    /// shared view of it — while the page may already be another lease's,
    /// whose `&mut [u8]` it aliased. A lease no longer holding its page
    /// leaves it alone.
    #[test]
    fn a_lease_whose_page_a_notice_freed_leaves_the_page_alone_on_drop() {
        use crate::client::regions::test_recorder;
        let (_server, _client, layout) = flush_layout("lease-freed-under");
        let mut first = layout.alloc().unwrap();
        first.bytes_mut().unwrap().fill(1);
        let page = first.page_addresses();
        // What applying the notice does.
        first
            .region
            .alloc
            .free(first.page, first.generation)
            .unwrap();
        let mut second = layout.alloc().unwrap();
        assert_eq!(second.page_addresses(), page, "the page is reused");
        second.bytes_mut().unwrap().fill(2);
        test_recorder::take();
        drop(first);
        let written_back = test_recorder::take();
        assert!(
            written_back
                .iter()
                .all(|r| r.end <= page.start || r.start >= page.end),
            "page {page:x?}, written back {written_back:x?}"
        );
        assert!(second.still_allocated(), "the second lease keeps the page");
    }

    /// Sessions the server holds open, waiting up to 10 s for it to reach
    /// `want` (a session ends when the server sees its connection close).
    fn sessions_when(server: &ServerHandle, want: u64) -> u64 {
        let sessions = || server.directory_stats().expect("stats").sessions;
        let deadline = Instant::now() + Duration::from_secs(10);
        while sessions() != want && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        sessions()
    }

    /// Found by a review of the client: a lease kept its region mapped but
    /// not its client, so a lease outliving its `Client` and `LayoutHandle`
    /// wrote a region of an instance whose session had ended — a region
    /// the directory frees (and may grant to another writer) once the
    /// instance's grace period passes. A lease keeps its client now; the
    /// session ends with the last lease.
    #[test]
    fn a_lease_that_outlives_its_client_keeps_the_session() {
        let (server, client, layout) = one_layout("lease-outlives");
        let mut lease = layout.alloc().unwrap();
        let open = server.directory_stats().unwrap().sessions;
        drop(layout);
        drop(client);
        // A session that ended is seen by the server within milliseconds.
        let deadline = Instant::now() + Duration::from_secs(1);
        while Instant::now() < deadline {
            let now = server.directory_stats().unwrap().sessions;
            assert_eq!(now, open, "the session ended under a live lease");
            std::thread::sleep(Duration::from_millis(20));
        }
        lease.write(b"bytes").unwrap();
        drop(lease);
        assert_eq!(
            sessions_when(&server, open - 1),
            open - 1,
            "the last lease ends it"
        );
    }

    /// An explicit close ends the session under live leases (as it does
    /// under views): such a lease can no longer be written.
    #[test]
    fn a_lease_cannot_be_written_after_its_client_is_closed() {
        let (_server, client, layout) = one_layout("lease-closed");
        let mut lease = layout.alloc().unwrap();
        client.close().unwrap();
        assert!(matches!(
            lease.write(b"bytes"),
            Err(ClientError::RegionRevoked { .. })
        ));
        assert!(matches!(layout.alloc(), Err(ClientError::Closed)));
    }

    /// A registration whose outcome is unknown is parked with its leases,
    /// which the client keeps: they must not keep it alive in turn (a
    /// cycle: the session would never end), nor be the last handle the
    /// maintenance thread drops.
    #[cfg(feature = "fault-injection")]
    #[test]
    fn a_parked_registration_does_not_keep_its_client_alive() {
        use cxlkv_controlplane::proto::Kind;
        use cxlkv_controlplane::transport::fault::{FaultScript, ReplyMatch};
        let script = FaultScript::new();
        let server =
            Server::start_with_faults(server_config("lease-parked"), Box::new(script.clone()))
                .expect("the server starts");
        let (server, client, layout) = layout_on(server, |cfg| {
            cfg.request_timeout_ms = 200;
            cfg.max_retries = 1;
        });
        let _ = script.drop_reply(ReplyMatch::request_kind(Kind::Register.as_u16()));
        assert!(layout.put(b"lost", b"bytes").is_err());
        assert_eq!(client.unresolved_registrations(), 1);
        let open = server.directory_stats().unwrap().sessions;
        drop(layout);
        drop(client);
        assert_eq!(
            sessions_when(&server, open - 1),
            open - 1,
            "the session ended"
        );
    }
}
