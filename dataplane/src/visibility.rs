//! Making written bytes visible to readers on other hosts.
//!
//! On one host, cache coherence makes a store visible to every core, so a
//! writer needs only to order its stores before the registration that
//! publishes the key. CXL memory shared by several hosts is different: before
//! CXL 3.0's back-invalidate snoop, a device cannot tell host B's caches that
//! host A wrote a line, and host A's writes may sit dirty in A's caches
//! indefinitely. So without help, B can read stale lines from its own cache,
//! or the device's old bytes because A never wrote back. The fix is in
//! software, per range:
//!
//! - [`publish`] (writer, after writing, before registering the key): write
//!   every 64-byte line of the range back to memory — `clwb` (keeps the line
//!   cached, cheapest), else `clflushopt`, else `clflush` — then `sfence`,
//!   which waits until the write-backs are globally visible.
//! - [`acquire`] (reader, before reading another host's bytes): evict every
//!   line of the range from this host's caches with `clflushopt` (`clflush`
//!   where absent), then `mfence`, so the following loads go to memory.
//!
//! **Modes** ([`Visibility`], chosen per pool): `Coherent` — one host, or a
//! platform with hardware coherence — makes both calls a fence only (release
//! for publish, acquire for acquire: free on x86, where only the compiler is
//! constrained). `Flush` costs one instruction per line plus a fence: for a
//! multi-megabyte chunk, publishing with `clwb` costs roughly a second pass
//! over the range at memory speed, and acquire makes every subsequent read a
//! cache miss. Writing a page with non-temporal stores ([`crate::copy`])
//! already leaves the lines out of the cache and ends with `sfence`, so such a
//! copy satisfies `publish` by itself; the copy engine reports which path ran.
//!
//! CPU support is detected once at run time (`cpuid`). On architectures other
//! than x86-64, `Flush` degrades to a sequentially consistent fence and
//! [`line_flush`] reports [`LineFlush::Unsupported`]: correct only where the
//! platform is coherent, which callers can check and refuse otherwise.

use std::sync::OnceLock;
use std::sync::atomic::{Ordering, fence};

/// Bytes per cache line: the unit of write-back and invalidation.
pub const CACHE_LINE_BYTES: usize = 64;

/// How a pool makes writes visible to readers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Visibility {
    /// Hardware keeps caches coherent for every reader: fences only.
    Coherent,
    /// Readers may be on hosts without coherence: write back and invalidate.
    Flush,
}

/// The instruction used to write back or evict one cache line.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LineFlush {
    /// Write back, keep the line (`clwb`; publish only).
    Clwb,
    /// Write back and evict, weakly ordered (`clflushopt`).
    Clflushopt,
    /// Write back and evict, ordered (`clflush`).
    Clflush,
    /// No line flush on this architecture.
    Unsupported,
}

impl LineFlush {
    pub fn as_str(self) -> &'static str {
        match self {
            LineFlush::Clwb => "clwb",
            LineFlush::Clflushopt => "clflushopt",
            LineFlush::Clflush => "clflush",
            LineFlush::Unsupported => "none",
        }
    }
}

/// The instructions this CPU offers, detected once.
#[derive(Debug, Clone, Copy)]
struct LineOps {
    /// Best instruction for publish (write back).
    write_back: LineFlush,
    /// Best instruction for acquire (evict).
    evict: LineFlush,
}

fn line_ops() -> LineOps {
    static OPS: OnceLock<LineOps> = OnceLock::new();
    *OPS.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> LineOps {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // Leaf 1 EDX bit 19: CLFSH. Leaf 7 subleaf 0 EBX bit 23: CLFLUSHOPT,
    // bit 24: CLWB (Intel SDM vol. 2A, CPUID).
    let leaf1 = __cpuid(1);
    let max_leaf = __cpuid(0).eax;
    let leaf7_ebx = if max_leaf >= 7 {
        __cpuid_count(7, 0).ebx
    } else {
        0
    };
    let clflush = leaf1.edx & (1 << 19) != 0;
    let clflushopt = leaf7_ebx & (1 << 23) != 0;
    let clwb = leaf7_ebx & (1 << 24) != 0;
    let evict = if clflushopt {
        LineFlush::Clflushopt
    } else if clflush {
        LineFlush::Clflush
    } else {
        LineFlush::Unsupported
    };
    let write_back = if clwb { LineFlush::Clwb } else { evict };
    LineOps { write_back, evict }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> LineOps {
    LineOps {
        write_back: LineFlush::Unsupported,
        evict: LineFlush::Unsupported,
    }
}

/// The instruction [`publish`] uses in `Flush` mode on this CPU.
pub fn line_flush() -> LineFlush {
    line_ops().write_back
}

/// The instruction [`acquire`] uses in `Flush` mode on this CPU.
pub fn line_evict() -> LineFlush {
    line_ops().evict
}

/// Makes `bytes`, just written by this thread, visible to readers under
/// `mode`: call after writing a page and before registering its key.
pub fn publish(mode: Visibility, bytes: &[u8]) {
    match mode {
        // Release suffices: it keeps the page's stores before whatever
        // publishes the key afterwards (an atomic store, or the syscall that
        // sends the registration); later operations may move earlier, which
        // exposes nothing unwritten.
        Visibility::Coherent => fence(Ordering::Release),
        Visibility::Flush => {
            flush_range(line_ops().write_back, bytes);
            store_fence();
        }
    }
}

/// Makes the current contents of `bytes`, written by another host, visible to
/// this thread's reads under `mode`: call after looking the key up and before
/// reading the page.
pub fn acquire(mode: Visibility, bytes: &[u8]) {
    match mode {
        // Acquire suffices: it keeps the page's loads after whatever told us
        // the key (the lookup reply); earlier operations may move later, which
        // reads nothing early.
        Visibility::Coherent => fence(Ordering::Acquire),
        Visibility::Flush => {
            flush_range(line_ops().evict, bytes);
            full_fence();
        }
    }
}

/// Applies `op` to every cache line that holds a byte of `bytes`.
fn flush_range(op: LineFlush, bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    let start = bytes.as_ptr() as usize & !(CACHE_LINE_BYTES - 1);
    let end = bytes.as_ptr() as usize + bytes.len();
    let mut line = start;
    while line < end {
        flush_line(op, line);
        line += CACHE_LINE_BYTES;
    }
}

/// Writes back (and, except `clwb`, evicts) the line at `addr`. The line
/// must hold at least one byte of a live allocation or mapping: a 64-byte line
/// never straddles a page, so it is then mapped in full. Callers only pass
/// lines containing bytes of a slice they hold.
#[cfg(target_arch = "x86_64")]
pub(crate) fn flush_line(op: LineFlush, addr: usize) {
    let p = addr as *const u8;
    match op {
        // SAFETY: the line is mapped (see above). The instruction changes no
        // memory contents, only cache state; the asm block is not `nomem`, so
        // the compiler keeps it after the stores it must write back. CPU
        // support was checked by `detect` (the same holds for the arms below).
        LineFlush::Clwb => unsafe {
            std::arch::asm!("clwb [{p}]", p = in(reg) p, options(nostack, preserves_flags));
        },
        // SAFETY: as above.
        LineFlush::Clflushopt => unsafe {
            std::arch::asm!("clflushopt [{p}]", p = in(reg) p, options(nostack, preserves_flags));
        },
        // SAFETY: as above.
        LineFlush::Clflush => unsafe {
            std::arch::asm!("clflush [{p}]", p = in(reg) p, options(nostack, preserves_flags));
        },
        LineFlush::Unsupported => {}
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn flush_line(_op: LineFlush, _addr: usize) {}

/// Waits until earlier stores, non-temporal stores and line write-backs are
/// globally visible.
#[cfg(target_arch = "x86_64")]
pub(crate) fn store_fence() {
    // SAFETY: SSE is part of the x86-64 baseline, so the instruction exists;
    // a fence touches no memory.
    unsafe { std::arch::x86_64::_mm_sfence() };
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn store_fence() {
    fence(Ordering::SeqCst);
}

#[cfg(target_arch = "x86_64")]
fn full_fence() {
    // SAFETY: SSE2 is part of the x86-64 baseline; a fence touches no memory.
    unsafe { std::arch::x86_64::_mm_mfence() };
}

#[cfg(not(target_arch = "x86_64"))]
fn full_fence() {
    fence(Ordering::SeqCst);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backing::tests::ShmPath;
    use crate::backing::{Extent, OpenOptions, open};
    use crate::ids::{PageIndex, RegionId};
    use crate::map::{MapObservers, MappedRegion, Populate};

    #[test]
    fn this_cpu_has_line_flush_support_on_x86_64() {
        if cfg!(target_arch = "x86_64") {
            // clflush is part of SSE2, the x86-64 baseline.
            assert_ne!(line_evict(), LineFlush::Unsupported);
            assert_ne!(line_flush(), LineFlush::Unsupported);
            assert_ne!(line_evict(), LineFlush::Clwb, "clwb does not evict");
        }
    }

    #[test]
    fn publish_and_acquire_run_on_a_real_mapping_in_both_modes() {
        let path = ShmPath::new("visibility");
        let backing = open(&path.0, &OpenOptions::new().create_size_bytes(2 << 20)).expect("pool");
        let observers = MapObservers::new();
        let extent = Extent::new(0, 2 << 20);
        // SAFETY: the writer view is dropped before either reader view exists.
        let (writer, reader) = unsafe {
            (
                MappedRegion::map(&*backing, RegionId(1), extent, Populate::Eager, &observers)
                    .expect("writer map"),
                MappedRegion::map(&*backing, RegionId(1), extent, Populate::Lazy, &observers)
                    .expect("reader map"),
            )
        };
        for (i, mode) in [Visibility::Coherent, Visibility::Flush]
            .into_iter()
            .enumerate()
        {
            let value = i as u8 + 1;
            // Odd offset and length: the partial first and last lines count.
            let len = 64 * 1024 - 3;
            {
                // SAFETY: page 1 is written only here, and read after the view
                // is gone.
                let mut page =
                    unsafe { writer.page_mut(64 * 1024, PageIndex(1), len) }.expect("page");
                page.fill(value);
                publish(mode, &page[1..]);
                publish(mode, &[]);
            }
            let view = reader.page(64 * 1024, PageIndex(1), len).expect("view");
            acquire(mode, &view[1..]);
            acquire(mode, &[]);
            assert!(view.iter().all(|&b| b == value), "mode {mode:?}");
        }
    }
}
