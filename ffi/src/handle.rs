//! Handles: opaque tokens for the objects C holds.
//!
//! A handle is **not an address**. It is a 64-bit token — a type tag, a
//! slot number and the slot's generation — typed in C as a pointer to an
//! incomplete struct (`cxlkv_client *`, …) so that the compiler keeps the
//! kinds apart. The library never dereferences it: every entry point looks
//! the token up in the [`Registry`] of its type, which answers with the
//! object (an `Arc`, so a concurrent free cannot pull it from under a call
//! in progress) or with `CXLKV_STATUS_BAD_HANDLE`.
//!
//! What this detects, without undefined behaviour: NULL; a handle already
//! freed (its slot's generation moved on, also after the slot was reused);
//! a handle of another type (wrong tag); any value that is not a token (bad
//! tag or slot). What it cannot detect: a garbage value that happens to
//! equal a live token of the right type (it must match an 8-bit tag, a slot
//! and a 32-bit generation).
//!
//! Slots are reused (free list), so the registry's memory is bounded by the
//! number of live handles, at most [`MAX_HANDLES`] per type. A slot whose
//! generation reached `u32::MAX` is retired instead of reused, so that a
//! generation never wraps: the free list is a stack, and an engine that
//! takes and releases one view in a loop reuses the same slot every time —
//! at ten million a second it would wrap in seven minutes, and a stale copy
//! of a released handle would then name the new one. A retired slot costs
//! 16 bytes once per 2^32 frees.
//!
//! **Handles do not cross `fork`.** A child process inherits a copy of the
//! registries, and with them the parent's clients — the same connection,
//! the same session, copies of the page allocators. A call through such a
//! handle would speak on the parent's connection, and freeing it would end
//! the parent's session (releasing the pins of the views the parent still
//! reads) from a process that has none of the client's threads. So every
//! slot records the process *incarnation* it was filled in — a counter a
//! `pthread_atfork` child handler bumps, shared with the Rust client's own
//! guard (`cxlkv::client::process_incarnation`) — and a handle filled before the
//! fork is refused in the child (`CXLKV_STATUS_BAD_HANDLE`, saying so), by
//! the functions that free handles too: the child's copy of the object is
//! never dropped, so nothing is sent and the parent is untouched. Handles
//! the child makes itself (it connects its own client) work as anywhere.

use std::fmt;
use std::sync::Arc;

use parking_lot::RwLock;

use crate::status::{FfiError, cxlkv_status};

// Tokens are 64-bit values carried in pointers.
const _: () = assert!(usize::BITS == 64, "cxlkv's C ABI needs 64-bit pointers");

/// Most live handles of one type (the slot field is 24 bits; 0 is unused).
pub(crate) const MAX_HANDLES: usize = (1 << SLOT_BITS) - 1;

const SLOT_BITS: u32 = 24;
const GENERATION_SHIFT: u32 = SLOT_BITS;
const TAG_SHIFT: u32 = 56;

/// This process's incarnation (`cxlkv::client::process_incarnation`: the
/// counter the client's own fork guard uses), registering the fork handler
/// first — before the first handle exists, so that no fork can copy a
/// handle unseen.
fn incarnation() -> u32 {
    cxlkv::client::process_incarnation()
}

/// One type tag per handle type (the token's top byte; never 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Tag {
    Client = 0xC1,
    Layout = 0xC2,
    Lease = 0xC3,
    Guard = 0xC4,
    Observer = 0xC5,
    Tier = 0xC6,
}

impl Tag {
    const ALL: [Tag; 6] = [
        Tag::Client,
        Tag::Layout,
        Tag::Lease,
        Tag::Guard,
        Tag::Observer,
        Tag::Tier,
    ];

    fn name(self) -> &'static str {
        match self {
            Tag::Client => "client",
            Tag::Layout => "layout",
            Tag::Lease => "lease",
            Tag::Guard => "view guard",
            Tag::Observer => "map observer",
            Tag::Tier => "tier",
        }
    }
}

struct Slot<T> {
    generation: u32,
    /// The process incarnation the value was inserted in.
    incarnation: u32,
    value: Option<Arc<T>>,
}

struct Slots<T> {
    entries: Vec<Slot<T>>,
    free: Vec<u32>,
    live: usize,
}

/// The live handles of one type.
pub(crate) struct Registry<T> {
    tag: Tag,
    slots: RwLock<Slots<T>>,
}

impl<T> fmt::Debug for Registry<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry")
            .field("tag", &self.tag)
            .field("live", &self.live())
            .finish()
    }
}

fn token(tag: Tag, slot: u32, generation: u32) -> usize {
    debug_assert!((slot as usize) < (1 << SLOT_BITS));
    ((tag as usize) << TAG_SHIFT)
        | ((generation as usize) << GENERATION_SHIFT)
        | (slot as usize + 1)
}

/// `(tag byte, slot, generation)` of a token; `None` when the slot field
/// is 0 (no token has it).
fn decode(raw: usize) -> Option<(u8, u32, u32)> {
    let slot = (raw & ((1 << SLOT_BITS) - 1)) as u32;
    let generation = ((raw >> GENERATION_SHIFT) & 0xFFFF_FFFF) as u32;
    let tag = (raw >> TAG_SHIFT) as u8;
    slot.checked_sub(1).map(|s| (tag, s, generation))
}

impl<T> Registry<T> {
    pub const fn new(tag: Tag) -> Self {
        Self {
            tag,
            slots: RwLock::new(Slots {
                entries: Vec::new(),
                free: Vec::new(),
                live: 0,
            }),
        }
    }

    pub fn live(&self) -> usize {
        self.slots.read().live
    }

    fn full(&self) -> FfiError {
        FfiError::new(
            cxlkv_status::CXLKV_STATUS_TOO_MANY_HANDLES,
            format!(
                "the process holds {MAX_HANDLES} live {} handles (the limit)",
                self.tag.name()
            ),
        )
    }

    /// Registers `value`; its token.
    pub fn insert(&self, value: T) -> Result<usize, FfiError> {
        let mut out = self.insert_all(vec![value])?;
        Ok(out.pop().expect("invariant: one token per value"))
    }

    /// Registers every value or none (then the values are dropped); their
    /// tokens in order.
    pub fn insert_all(&self, values: Vec<T>) -> Result<Vec<usize>, FfiError> {
        let incarnation = incarnation();
        let mut slots = self.slots.write();
        // Room for all of them, counting the slot field's range too (retired
        // slots use it up): then no insert below can fail.
        let fresh = values.len().saturating_sub(slots.free.len());
        if slots.live + values.len() > MAX_HANDLES || slots.entries.len() + fresh > MAX_HANDLES {
            return Err(self.full());
        }
        let mut tokens = Vec::with_capacity(values.len());
        for value in values {
            let ix = match slots.free.pop() {
                Some(ix) => ix,
                None => {
                    slots.entries.push(Slot {
                        generation: 1,
                        incarnation,
                        value: None,
                    });
                    (slots.entries.len() - 1) as u32
                }
            };
            let slot = &mut slots.entries[ix as usize];
            debug_assert!(slot.value.is_none());
            slot.value = Some(Arc::new(value));
            slot.incarnation = incarnation;
            tokens.push(token(self.tag, ix, slot.generation));
            slots.live += 1;
        }
        Ok(tokens)
    }

    /// Why `raw` names no live object of this type.
    fn bad(&self, raw: usize, arg: &str, slots: &Slots<T>) -> FfiError {
        let bad = |what: String| {
            FfiError::new(
                cxlkv_status::CXLKV_STATUS_BAD_HANDLE,
                format!("`{arg}` ({raw:#x}) {what}"),
            )
        };
        if raw == 0 {
            return FfiError::new(
                cxlkv_status::CXLKV_STATUS_BAD_HANDLE,
                format!("`{arg}` is NULL"),
            );
        }
        match decode(raw) {
            Some((tag, _, _)) if tag != self.tag as u8 => {
                match Tag::ALL.iter().find(|t| **t as u8 == tag) {
                    Some(other) => bad(format!(
                        "is a {} handle, not a {} handle",
                        other.name(),
                        self.tag.name()
                    )),
                    None => bad("is not a cxlkv handle".into()),
                }
            }
            Some((_, ix, generation))
                if slots.entries.get(ix as usize).is_some_and(|s| {
                    s.generation == generation
                        && s.value.is_some()
                        && s.incarnation != incarnation()
                }) =>
            {
                bad(format!(
                    "is a {} handle made before this process was forked: a handle is valid \
                     only in the process that made it (connect a client in this process); \
                     nothing was sent, the parent's session is untouched",
                    self.tag.name()
                ))
            }
            Some((_, ix, _)) if (ix as usize) < slots.entries.len() => bad(format!(
                "is a {} handle that was already freed",
                self.tag.name()
            )),
            _ => bad("is not a cxlkv handle".into()),
        }
    }

    /// The object named by `raw` (the argument `arg`).
    pub fn get(&self, raw: usize, arg: &str) -> Result<Arc<T>, FfiError> {
        let slots = self.slots.read();
        if let Some((tag, ix, generation)) = decode(raw)
            && tag == self.tag as u8
            && let Some(slot) = slots.entries.get(ix as usize)
            && slot.generation == generation
            && slot.incarnation == incarnation()
            && let Some(value) = &slot.value
        {
            return Ok(Arc::clone(value));
        }
        Err(self.bad(raw, arg, &slots))
    }

    /// Frees the handle `raw`; the object (which lives on while calls in
    /// progress hold it).
    pub fn remove(&self, raw: usize, arg: &str) -> Result<Arc<T>, FfiError> {
        let mut slots = self.slots.write();
        if let Some((tag, ix, generation)) = decode(raw)
            && tag == self.tag as u8
            && let Some(slot) = slots.entries.get_mut(ix as usize)
            && slot.generation == generation
            // An inherited handle stays (its object is never dropped here).
            && slot.incarnation == incarnation()
            && let Some(value) = slot.value.take()
        {
            // At the last generation the slot is retired (module docs): its
            // tokens, the freed one included, never name anything again.
            let next = slot.generation.checked_add(1);
            if let Some(next) = next {
                slot.generation = next;
                slots.free.push(ix);
            }
            slots.live -= 1;
            return Ok(value);
        }
        Err(self.bad(raw, arg, &slots))
    }
}

/// A token as the C pointer type `H` (never dereferenced by anyone).
pub(crate) fn to_ptr<H>(raw: usize) -> *mut H {
    std::ptr::without_provenance_mut(raw)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_freed_handle_is_refused_even_after_its_slot_is_reused() {
        let r: Registry<u32> = Registry::new(Tag::Client);
        let a = r.insert(1).unwrap();
        assert_eq!(*r.get(a, "a").unwrap(), 1);
        assert_eq!(*r.remove(a, "a").unwrap(), 1);
        let b = r.insert(2).unwrap();
        assert_ne!(a, b, "same slot, new generation");
        let e = r.get(a, "a").unwrap_err();
        assert_eq!(e.status, cxlkv_status::CXLKV_STATUS_BAD_HANDLE);
        assert!(e.message.contains("already freed"), "{e}");
        assert!(r.remove(a, "a").is_err(), "double free refused");
        assert_eq!(*r.get(b, "b").unwrap(), 2);
        assert_eq!(r.live(), 1);
    }

    #[test]
    fn a_slot_at_its_last_generation_is_retired_so_a_generation_never_wraps() {
        let r: Registry<u32> = Registry::new(Tag::Guard);
        let a = r.insert(1).unwrap();
        r.slots.write().entries[0].generation = u32::MAX;
        let last = token(Tag::Guard, 0, u32::MAX);
        assert_eq!(*r.remove(last, "last").unwrap(), 1);
        let b = r.insert(2).unwrap();
        assert_eq!(decode(b).map(|(_, slot, _)| slot), Some(1), "a new slot");
        for stale in [a, last] {
            let e = r.get(stale, "stale").unwrap_err();
            assert_eq!(e.status, cxlkv_status::CXLKV_STATUS_BAD_HANDLE);
        }
        // A wrapped generation would have been 0 or 1 on slot 0: neither
        // names anything.
        assert!(r.get(token(Tag::Guard, 0, 1), "wrapped").is_err());
        assert_eq!(r.live(), 1);
    }

    #[test]
    fn null_foreign_and_garbage_tokens_are_refused_with_reasons() {
        let clients: Registry<u32> = Registry::new(Tag::Client);
        let layouts: Registry<u32> = Registry::new(Tag::Layout);
        let l = layouts.insert(5).unwrap();
        let cases = [
            (0usize, "is NULL"),
            (l, "is a layout handle, not a client handle"),
            (0x1234_5678, "not a cxlkv handle"),
            (usize::MAX, "not a cxlkv handle"),
            (token(Tag::Client, 99, 1), "not a cxlkv handle"),
        ];
        for (raw, why) in cases {
            let e = clients.get(raw, "client").unwrap_err();
            assert_eq!(e.status, cxlkv_status::CXLKV_STATUS_BAD_HANDLE);
            assert!(e.message.contains(why), "{raw:#x}: {e}");
        }
    }

    #[test]
    fn insert_all_is_all_or_nothing_and_tokens_are_distinct() {
        let r: Registry<usize> = Registry::new(Tag::Guard);
        let tokens = r.insert_all((0..100).collect()).unwrap();
        let mut sorted = tokens.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 100);
        for (i, t) in tokens.iter().enumerate() {
            assert_eq!(*r.get(*t, "t").unwrap(), i);
        }
        for t in tokens {
            r.remove(t, "t").unwrap();
        }
        assert_eq!(r.live(), 0);
    }

    #[test]
    fn a_handle_made_before_a_fork_is_refused_in_the_child_and_kept_in_the_parent() {
        let r: Registry<u32> = Registry::new(Tag::Client);
        let a = r.insert(7).unwrap();
        // SAFETY: the child touches only `r` (its own lock, which no other
        // thread holds) and the allocator (glibc's is fork-safe), panics
        // nowhere, and leaves with `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let refused = |e: Result<Arc<u32>, FfiError>| {
                e.is_err_and(|e| {
                    e.status == cxlkv_status::CXLKV_STATUS_BAD_HANDLE
                        && e.message.contains("before this process was forked")
                })
            };
            let ok = refused(r.get(a, "a"))
                && refused(r.remove(a, "a"))
                && r.insert(8)
                    .is_ok_and(|b| r.get(b, "b").is_ok_and(|v| *v == 8));
            // SAFETY: ends the child without running the harness's exit.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: `pid` is this test's child; `status` is a valid out pointer.
        let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(waited, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the child accepted an inherited handle, or refused its own (status {status:#x})"
        );
        assert_eq!(
            *r.get(a, "a").unwrap(),
            7,
            "the parent's handle is untouched"
        );
        assert_eq!(*r.remove(a, "a").unwrap(), 7);
    }

    #[test]
    fn an_object_outlives_its_handle_while_a_call_holds_it() {
        let r: Registry<String> = Registry::new(Tag::Lease);
        let t = r.insert("x".into()).unwrap();
        let held = r.get(t, "t").unwrap();
        r.remove(t, "t").unwrap();
        assert_eq!(held.as_str(), "x");
    }
}
