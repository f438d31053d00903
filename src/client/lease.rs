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
//! **Publication.** Before registration the bytes must be visible to every
//! reader (DESIGN §3): `register` publishes them under the pool's visibility
//! mode unless they were written by a non-temporal [`PageLease::write`]
//! (which publishes by itself) and not touched since.

use std::fmt;
use std::sync::Arc;

use cxlkv_controlplane::proto::Location;
use cxlkv_dataplane::copy::{self, CopyPath};
use cxlkv_dataplane::ids::{Generation, PageIndex};
use cxlkv_dataplane::map::PageViewMut;
use cxlkv_dataplane::visibility;

use super::error::ClientError;
use super::regions::OwnedRegion;

/// One allocated, not yet registered page (see the module docs).
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
    /// Registration took the page (it must not be freed on drop).
    consumed: bool,
}

impl PageLease {
    pub(crate) fn new(
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
            consumed: false,
        }
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
    /// at a reattach, e.g. after the instance expired while disconnected).
    pub fn bytes_mut(&mut self) -> Result<PageViewMut<'_>, ClientError> {
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
        let path = {
            let mut view = self.bytes_mut()?;
            copy::copy_in(&mut view[..src.len()], src)
        };
        self.len_bytes = src.len();
        self.needs_publish = touched_before || !path.satisfies_publish();
        if !self.needs_publish {
            self.published_bytes = src.len();
        }
        Ok(path)
    }

    /// Makes the chunk's bytes visible to readers under the pool's mode (a
    /// fence on a coherent pool). `register` does this when needed.
    pub fn publish(&mut self) {
        if self.needs_publish {
            visibility::publish(self.region.visibility, self.chunk());
            self.needs_publish = false;
            self.published_bytes = self.len_bytes;
        }
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

    pub(crate) fn layout_ix(&self) -> u32 {
        self.layout_ix
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
            if self.touched {
                // Written: no dirty line may outlive the lease on a
                // non-coherent pool (`write_back_page`), not even one past
                // the chunk a publication covered.
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
    use crate::client::{Client, ClientConfig, LayoutHandle, LayoutOptions};
    use crate::server::{Server, ServerConfig, ServerHandle};

    /// A server (small pool, 4 MiB regions), a client and a 4 KiB layout
    /// that owns no region yet.
    fn one_layout(tag: &str) -> (ServerHandle, Client, LayoutHandle) {
        let mut cfg = ServerConfig::ephemeral(tag);
        cfg.pool_size_bytes = 64 << 20;
        cfg.default_region_bytes = 4 << 20;
        let server = Server::start(cfg).expect("the server starts");
        let client = Client::connect(ClientConfig::unix(server.socket_path())).expect("connect");
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
        use crate::client::ClientError;
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
}
