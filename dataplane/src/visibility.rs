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
//! and a store fence, `sfence`, for publish, so that non-temporal stores are
//! ordered too; acquire for acquire: free on x86, where only the compiler is
//! constrained). `Flush` costs one instruction per line plus a fence: for a
//! multi-megabyte chunk, publishing with `clwb` costs roughly a second pass
//! over the range at memory speed, and acquire makes every subsequent read a
//! cache miss. Writing a page with non-temporal stores ([`crate::copy`])
//! already leaves the lines out of the cache and ends with `sfence`, so such a
//! copy satisfies `publish` by itself; the copy engine reports which path ran.
//!
//! CPU support is detected once at run time (`cpuid`). On architectures other
//! than x86-64 there is no line instruction ([`line_flush`] reports
//! [`LineFlush::Unsupported`]): `Flush` would run fences only, correct only
//! where the platform is coherent, so [`check_mode`] refuses it — the client
//! and the pool manager call it when they open a pool.
//!
//! **Forcing a choice.** [`publish`] and [`acquire`] run the best instruction
//! this CPU has, so on one machine only one of the fallbacks ever executes. A
//! [`VisibilityOps`] fixes the instructions instead:
//! [`VisibilityOps::for_mode`] is exactly what the two functions run,
//! [`VisibilityOps::with_instruction`] forces one line instruction (`clwb`,
//! `clflushopt`, `clflush`, or [`LineFlush::Unsupported`]: the `Flush` fences
//! with no line instruction) and [`VisibilityOps::fence_only`] the `Coherent`
//! fences. Forcing an instruction the CPU lacks is refused with
//! [`VisibilityError::InstructionUnsupported`] rather than executed (it would
//! raise `SIGILL`). Tests use this to run every path this CPU can run. What no
//! test on one host can show is that a missing write-back loses data: one
//! host's caches are coherent, so every choice reads back correctly there.

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

/// Why a forced instruction choice was refused.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum VisibilityError {
    /// This CPU does not implement the instruction (`cpuid` says so), so
    /// executing it would raise `SIGILL`.
    #[error("this CPU does not support {}", instruction.as_str())]
    InstructionUnsupported { instruction: LineFlush },
    /// `Flush` asked for on an architecture without a line flush: it would
    /// run fences only, and readers on other hosts would see stale bytes.
    #[error(
        "visibility `flush` needs a cache-line write-back instruction, which this architecture lacks here: \
         on a non-coherent pool readers would see stale bytes (use a coherent platform)"
    )]
    FlushUnsupported,
}

/// Refuses a mode this machine cannot carry out: `Flush` without a line
/// flush instruction (every architecture but x86-64, for now).
pub fn check_mode(mode: Visibility) -> Result<(), VisibilityError> {
    check_mode_with(mode, line_flush())
}

fn check_mode_with(mode: Visibility, write_back: LineFlush) -> Result<(), VisibilityError> {
    match (mode, write_back) {
        (Visibility::Flush, LineFlush::Unsupported) => Err(VisibilityError::FlushUnsupported),
        _ => Ok(()),
    }
}

/// A fixed choice of what [`VisibilityOps::publish`] and
/// [`VisibilityOps::acquire`] execute.
///
/// [`publish`] and [`acquire`] are `VisibilityOps::for_mode(mode)`'s methods;
/// the other constructors force a choice (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct VisibilityOps {
    kind: OpsKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum OpsKind {
    /// `Coherent`: a release and a store fence to publish, an acquire fence
    /// to acquire.
    FenceOnly,
    /// `Flush`: `write_back` per line + `sfence` to publish, `evict` per line
    /// + `mfence` to acquire. Either may be `Unsupported` (fences only).
    Lines {
        write_back: LineFlush,
        evict: LineFlush,
    },
}

impl VisibilityOps {
    /// What [`publish`] and [`acquire`] run for `mode` on this CPU.
    pub fn for_mode(mode: Visibility) -> Self {
        let kind = match mode {
            Visibility::Coherent => OpsKind::FenceOnly,
            Visibility::Flush => {
                let ops = line_ops();
                OpsKind::Lines {
                    write_back: ops.write_back,
                    evict: ops.evict,
                }
            }
        };
        Self { kind }
    }

    /// The `Coherent` fences, whatever the CPU.
    pub fn fence_only() -> Self {
        Self {
            kind: OpsKind::FenceOnly,
        }
    }

    /// `Flush` mode with `instruction` forced for every line of both calls —
    /// except that `clwb` only writes back, so with [`LineFlush::Clwb`]
    /// acquire evicts with this CPU's best evicting instruction.
    /// [`LineFlush::Unsupported`] forces the `Flush` fences without any line
    /// instruction (the portable fallback). Refused when the CPU lacks the
    /// instruction.
    pub fn with_instruction(instruction: LineFlush) -> Result<Self, VisibilityError> {
        Self::with_instruction_on(line_ops().supported, instruction)
    }

    /// [`Self::with_instruction`] against a given feature set (tests present
    /// CPUs this machine is not).
    fn with_instruction_on(
        supported: Supported,
        instruction: LineFlush,
    ) -> Result<Self, VisibilityError> {
        if !supported.has(instruction) {
            return Err(VisibilityError::InstructionUnsupported { instruction });
        }
        let evict = match instruction {
            LineFlush::Clwb => supported.best_evict(),
            other => other,
        };
        Ok(Self {
            kind: OpsKind::Lines {
                write_back: instruction,
                evict,
            },
        })
    }

    /// The instruction publish runs per line (`None`: fences only).
    pub fn write_back(&self) -> Option<LineFlush> {
        match self.kind {
            OpsKind::FenceOnly => None,
            OpsKind::Lines { write_back, .. } => Some(write_back),
        }
    }

    /// The instruction acquire runs per line (`None`: fences only).
    pub fn evict(&self) -> Option<LineFlush> {
        match self.kind {
            OpsKind::FenceOnly => None,
            OpsKind::Lines { evict, .. } => Some(evict),
        }
    }

    /// Makes `bytes`, just written by this thread, visible to readers: call
    /// after writing a page and before registering its key.
    pub fn publish(&self, bytes: &[u8]) {
        match self.kind {
            // Release keeps the page's ordinary stores before whatever
            // publishes the key afterwards (an atomic store, or the syscall
            // that sends the registration); later operations may move
            // earlier, which exposes nothing unwritten. The store fence
            // orders weakly ordered stores too: an engine that wrote the
            // page with its own non-temporal stores and no `sfence`
            // (through `cxlkv_lease_data`) would otherwise rely on the
            // syscall to drain them, which x86 does not promise.
            OpsKind::FenceOnly => {
                fence(Ordering::Release);
                store_fence();
            }
            OpsKind::Lines { write_back, .. } => {
                flush_range(write_back, bytes);
                store_fence();
            }
        }
    }

    /// Makes the current contents of `bytes`, written by another host,
    /// visible to this thread's reads: call after looking the key up and
    /// before reading the page.
    pub fn acquire(&self, bytes: &[u8]) {
        match self.kind {
            // Acquire suffices: it keeps the page's loads after whatever told
            // us the key (the lookup reply); earlier operations may move
            // later, which reads nothing early.
            OpsKind::FenceOnly => fence(Ordering::Acquire),
            OpsKind::Lines { evict, .. } => {
                flush_range(evict, bytes);
                full_fence();
            }
        }
    }
}

/// Which line instructions a CPU implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Supported {
    clwb: bool,
    clflushopt: bool,
    clflush: bool,
}

impl Supported {
    fn has(self, instruction: LineFlush) -> bool {
        match instruction {
            LineFlush::Clwb => self.clwb,
            LineFlush::Clflushopt => self.clflushopt,
            LineFlush::Clflush => self.clflush,
            // No instruction to execute: always available.
            LineFlush::Unsupported => true,
        }
    }

    fn best_evict(self) -> LineFlush {
        if self.clflushopt {
            LineFlush::Clflushopt
        } else if self.clflush {
            LineFlush::Clflush
        } else {
            LineFlush::Unsupported
        }
    }

    fn best_write_back(self) -> LineFlush {
        if self.clwb {
            LineFlush::Clwb
        } else {
            self.best_evict()
        }
    }
}

/// The instructions this CPU offers, detected once.
#[derive(Debug, Clone, Copy)]
struct LineOps {
    supported: Supported,
    /// Best instruction for publish (write back).
    write_back: LineFlush,
    /// Best instruction for acquire (evict).
    evict: LineFlush,
}

impl LineOps {
    fn new(supported: Supported) -> Self {
        Self {
            supported,
            write_back: supported.best_write_back(),
            evict: supported.best_evict(),
        }
    }
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
    LineOps::new(Supported {
        clflush: leaf1.edx & (1 << 19) != 0,
        clflushopt: leaf7_ebx & (1 << 23) != 0,
        clwb: leaf7_ebx & (1 << 24) != 0,
    })
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> LineOps {
    LineOps::new(Supported {
        clwb: false,
        clflushopt: false,
        clflush: false,
    })
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
    VisibilityOps::for_mode(mode).publish(bytes);
}

/// Makes the current contents of `bytes`, written by another host, visible to
/// this thread's reads under `mode`: call after looking the key up and before
/// reading the page.
pub fn acquire(mode: Visibility, bytes: &[u8]) {
    VisibilityOps::for_mode(mode).acquire(bytes);
}

/// Applies `op` to every cache line that holds a byte of `bytes`.
fn flush_range(op: LineFlush, bytes: &[u8]) {
    if op == LineFlush::Unsupported {
        return;
    }
    for line in line_addresses(bytes) {
        flush_line(op, line);
    }
}

/// [`acquire`] of the `len` bytes at address `start`, for bytes no slice
/// may cover (`MappedRegion::read_shared`). The caller guarantees the range
/// is mapped (a line holding one of its bytes is then mapped in full).
pub(crate) fn acquire_addresses(mode: Visibility, start: usize, len: usize) {
    let ops = VisibilityOps::for_mode(mode);
    match ops.kind {
        OpsKind::FenceOnly => fence(Ordering::Acquire),
        OpsKind::Lines { evict, .. } => {
            flush_addresses(evict, start, len);
            full_fence();
        }
    }
}

/// [`publish`] of the `len` bytes at address `start`, for bytes no slice
/// may cover (`MappedRegion::write_shared`). The caller guarantees the range
/// is mapped (a line holding one of its bytes is then mapped in full).
pub(crate) fn publish_addresses(mode: Visibility, start: usize, len: usize) {
    let ops = VisibilityOps::for_mode(mode);
    match ops.kind {
        OpsKind::FenceOnly => {
            fence(Ordering::Release);
            store_fence();
        }
        OpsKind::Lines { write_back, .. } => {
            flush_addresses(write_back, start, len);
            store_fence();
        }
    }
}

/// Applies `op` to every cache line holding one of the `len` bytes at
/// address `start` (none when `len` is 0).
fn flush_addresses(op: LineFlush, start: usize, len: usize) {
    if op == LineFlush::Unsupported || len == 0 {
        return;
    }
    let first = start & !(CACHE_LINE_BYTES - 1);
    for line in (first..start + len).step_by(CACHE_LINE_BYTES) {
        flush_line(op, line);
    }
}

/// The address of every 64-byte line holding a byte of `bytes`, in order:
/// the partial first and last lines included, nothing outside — none for an
/// empty slice, whose pointer may be dangling.
fn line_addresses(bytes: &[u8]) -> impl Iterator<Item = usize> {
    let address = bytes.as_ptr() as usize;
    let start = address & !(CACHE_LINE_BYTES - 1);
    let end = if bytes.is_empty() {
        start
    } else {
        address + bytes.len()
    };
    (start..end).step_by(CACHE_LINE_BYTES)
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
        // support was checked by `detect`, or by `with_instruction` for a
        // forced choice (the same holds for the arms below).
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
    fn flush_is_refused_where_no_line_flush_exists_and_coherent_never() {
        assert_eq!(
            check_mode_with(Visibility::Flush, LineFlush::Unsupported),
            Err(VisibilityError::FlushUnsupported)
        );
        assert_eq!(check_mode_with(Visibility::Flush, LineFlush::Clwb), Ok(()));
        assert_eq!(
            check_mode_with(Visibility::Coherent, LineFlush::Unsupported),
            Ok(())
        );
        if cfg!(target_arch = "x86_64") {
            assert_eq!(check_mode(Visibility::Flush), Ok(()));
        }
    }

    #[test]
    fn this_cpu_has_line_flush_support_on_x86_64() {
        if cfg!(target_arch = "x86_64") {
            // clflush is part of SSE2, the x86-64 baseline.
            assert_ne!(line_evict(), LineFlush::Unsupported);
            assert_ne!(line_flush(), LineFlush::Unsupported);
            assert_ne!(line_evict(), LineFlush::Clwb, "clwb does not evict");
        }
    }

    /// Every choice a caller can force, with what `with_instruction` or
    /// `fence_only` makes of it.
    fn every_choice() -> Vec<(&'static str, Result<VisibilityOps, VisibilityError>)> {
        vec![
            ("clwb", VisibilityOps::with_instruction(LineFlush::Clwb)),
            (
                "clflushopt",
                VisibilityOps::with_instruction(LineFlush::Clflushopt),
            ),
            (
                "clflush",
                VisibilityOps::with_instruction(LineFlush::Clflush),
            ),
            (
                "flush fences, no line instruction",
                VisibilityOps::with_instruction(LineFlush::Unsupported),
            ),
            ("fence only", Ok(VisibilityOps::fence_only())),
            (
                "Coherent mode",
                Ok(VisibilityOps::for_mode(Visibility::Coherent)),
            ),
            ("Flush mode", Ok(VisibilityOps::for_mode(Visibility::Flush))),
        ]
    }

    /// Publishes through one mapping with `ops` and acquires through another,
    /// on an odd offset and length so the partial first and last lines count.
    fn round_trip(writer: &MappedRegion, reader: &MappedRegion, ops: VisibilityOps, value: u8) {
        let len = 64 * 1024 - 3;
        {
            // SAFETY: page 1 is written only here, and read after the view is
            // gone.
            let mut page = unsafe { writer.page_mut(64 * 1024, PageIndex(1), len) }.expect("page");
            page.fill(value);
            ops.publish(&page[1..]);
            ops.publish(&[]);
        }
        let view = reader.page(64 * 1024, PageIndex(1), len).expect("view");
        ops.acquire(&view[1..]);
        ops.acquire(&[]);
        assert!(view.iter().all(|&b| b == value), "{ops:?}");
    }

    #[test]
    fn publish_and_acquire_run_with_every_instruction_this_cpu_supports() {
        let path = ShmPath::new("visibility");
        let backing = open(&path.0, &OpenOptions::new().create_size_bytes(2 << 20)).expect("pool");
        let observers = MapObservers::new();
        let extent = Extent::new(0, 2 << 20);
        // SAFETY: the writer view is dropped before any reader view exists.
        let (writer, reader) = unsafe {
            (
                MappedRegion::map(&*backing, RegionId(1), extent, Populate::Eager, &observers)
                    .expect("writer map"),
                MappedRegion::map(&*backing, RegionId(1), extent, Populate::Lazy, &observers)
                    .expect("reader map"),
            )
        };
        let supported = line_ops().supported;
        let mut ran = Vec::new();
        for (value, (name, choice)) in (1u8..).zip(every_choice()) {
            match choice {
                Ok(ops) => {
                    round_trip(&writer, &reader, ops, value);
                    ran.push(name);
                }
                Err(VisibilityError::InstructionUnsupported { instruction }) => {
                    assert!(!supported.has(instruction), "{name} refused but supported");
                    eprintln!("{name}: not supported by this CPU, refused");
                }
                Err(e @ VisibilityError::FlushUnsupported) => {
                    panic!("{name}: a forced choice is never refused as a mode: {e}")
                }
            }
        }
        eprintln!("ran publish/acquire with: {ran:?}");
        if cfg!(target_arch = "x86_64") {
            assert!(ran.contains(&"clflush"), "clflush is x86-64 baseline");
        }
        // The free functions are the detected choice.
        publish(Visibility::Flush, &[1]);
        acquire(Visibility::Coherent, &[1]);
    }

    #[test]
    fn forced_instructions_run_exactly_what_was_chosen() {
        let all = Supported {
            clwb: true,
            clflushopt: true,
            clflush: true,
        };
        for instruction in [
            LineFlush::Clflushopt,
            LineFlush::Clflush,
            LineFlush::Unsupported,
        ] {
            let ops = VisibilityOps::with_instruction_on(all, instruction).expect("supported");
            assert_eq!(
                (ops.write_back(), ops.evict()),
                (Some(instruction), Some(instruction))
            );
        }
        // clwb cannot evict: acquire falls back to the best evicting instruction.
        let ops = VisibilityOps::with_instruction_on(all, LineFlush::Clwb).expect("supported");
        assert_eq!(
            (ops.write_back(), ops.evict()),
            (Some(LineFlush::Clwb), Some(LineFlush::Clflushopt))
        );
        let only_clwb_and_clflush = Supported {
            clflushopt: false,
            ..all
        };
        let ops = VisibilityOps::with_instruction_on(only_clwb_and_clflush, LineFlush::Clwb)
            .expect("supported");
        assert_eq!(ops.evict(), Some(LineFlush::Clflush));
        let fences = VisibilityOps::fence_only();
        assert_eq!((fences.write_back(), fences.evict()), (None, None));
        assert_eq!(VisibilityOps::for_mode(Visibility::Coherent), fences);
        assert_eq!(
            VisibilityOps::for_mode(Visibility::Flush).write_back(),
            Some(line_flush())
        );
    }

    #[test]
    fn forcing_an_instruction_the_cpu_lacks_is_refused() {
        let old_cpu = Supported {
            clwb: false,
            clflushopt: false,
            clflush: true,
        };
        for instruction in [LineFlush::Clwb, LineFlush::Clflushopt] {
            let err = VisibilityOps::with_instruction_on(old_cpu, instruction)
                .expect_err("missing instruction");
            assert_eq!(err, VisibilityError::InstructionUnsupported { instruction });
            assert!(err.to_string().contains(instruction.as_str()), "{err}");
        }
        assert!(VisibilityOps::with_instruction_on(old_cpu, LineFlush::Clflush).is_ok());
        let no_lines = Supported {
            clflush: false,
            ..old_cpu
        };
        assert!(VisibilityOps::with_instruction_on(no_lines, LineFlush::Clflush).is_err());
        // The fences-only fallback needs nothing.
        assert!(VisibilityOps::with_instruction_on(no_lines, LineFlush::Unsupported).is_ok());
        // And on this CPU: whatever it lacks is refused, never executed.
        let here = line_ops().supported;
        for instruction in [LineFlush::Clwb, LineFlush::Clflushopt, LineFlush::Clflush] {
            assert_eq!(
                VisibilityOps::with_instruction(instruction).is_ok(),
                here.has(instruction)
            );
        }
    }

    #[test]
    fn every_line_holding_a_byte_is_flushed_and_no_other() {
        let buffer = vec![0u8; 4 * CACHE_LINE_BYTES];
        let base = buffer.as_ptr() as usize;
        let aligned = (base + CACHE_LINE_BYTES - 1) & !(CACHE_LINE_BYTES - 1);
        let offset = aligned - base;
        let lines = |from: usize, len: usize| -> Vec<usize> {
            line_addresses(&buffer[offset + from..offset + from + len])
                .map(|line| line - aligned)
                .collect()
        };
        assert_eq!(lines(0, 0), Vec::<usize>::new());
        assert_eq!(lines(5, 0), Vec::<usize>::new());
        assert_eq!(lines(0, 1), vec![0]);
        assert_eq!(lines(63, 1), vec![0]);
        assert_eq!(lines(63, 2), vec![0, 64]);
        assert_eq!(lines(0, 64), vec![0]);
        assert_eq!(lines(0, 65), vec![0, 64]);
        assert_eq!(lines(1, 128), vec![0, 64, 128]);
        assert_eq!(lines(64, 128), vec![64, 128]);
    }
}
