//! The copy engine: moving KV chunks into and out of the pool at memory speed.
//!
//! [`copy_in`] (engine buffer → pool page) and [`copy_out`] (pool page →
//! engine buffer) pick one of two kinds of routine by size and CPU:
//!
//! - **Plain**: `<[u8]>::copy_from_slice`, i.e. libc `memcpy` (`rep movsb` or
//!   vector loops with ordinary stores). Best for small copies, and whenever
//!   the destination is read again soon, because it stays in cache.
//! - **Non-temporal** ([`CopyPath::NonTemporalAvx512`], else
//!   [`CopyPath::NonTemporalAvx2`]): unaligned vector loads, 64-byte aligned
//!   streaming stores (`vmovntdq`) that bypass the cache. For a large
//!   destination that is not about to be read on this core — a freshly
//!   allocated pool page, far (CXL) memory — this saves the read-for-ownership
//!   of every destination line (a third of the memory traffic of a cached
//!   copy) and does not evict the engine's working set. The unaligned head
//!   and tail (< 64 bytes each) are written with ordinary stores and then
//!   written back with the same line instruction [`crate::visibility::publish`]
//!   uses, and the routine ends with `sfence`. So **a non-temporal `copy_in`
//!   satisfies `publish` for the bytes it wrote**, in both visibility modes:
//!   the returned [`CopyPath`] says which routine ran
//!   ([`CopyPath::satisfies_publish`]) so the client can skip a redundant
//!   flush.
//!
//! **Thresholds**, measured on this project's development machine (an
//! Emerald Rapids VM with AVX-512, 2 MiB L2 per core, 300 MiB shared L3; a
//! busy shared machine — figures and commands in `docs/architecture.md`):
//!
//! - [`NT_COPY_IN_MIN_BYTES`] = 16 KiB. Into a cold destination (a pool page
//!   not touched recently, the normal case) non-temporal stores beat `memcpy`
//!   by 30–50 % from 16 KiB up (`cxlkv bench copy`, criterion `copy_in`); at
//!   4 KiB the gain shrinks to noise in one of the two measurements. The cost
//!   is a cache-hot destination (a page recycled right after this core
//!   touched it), where streaming stores lose up to 2× for pages that fit the
//!   L2 (criterion `copy_in_hot`, 256 KiB); that case is rare for KV pages,
//!   and in `Flush` mode a plain copy would pay a `clwb` per line on top.
//! - [`NT_COPY_OUT_MIN_BYTES`] = 8 MiB. Out of the pool the destination is
//!   an engine buffer that is usually reused, so it is cache-hot while it
//!   fits in the core's caches: `memcpy` wins by up to 25 % at 256 KiB–1 MiB,
//!   the two tie at 4 MiB, and streaming wins from 16 MiB (criterion
//!   `copy_out`).
//!
//! Lengths of source and destination must be equal (as for
//! `copy_from_slice`); any length and any alignment are accepted.

/// Copies into the pool of at least this many bytes use non-temporal stores
/// (see the module docs for the measurements behind it).
pub const NT_COPY_IN_MIN_BYTES: usize = 16 * 1024;

/// Copies out of the pool of at least this many bytes use non-temporal
/// stores: beyond the sizes a reused engine buffer keeps in cache.
pub const NT_COPY_OUT_MIN_BYTES: usize = 8 * 1024 * 1024;

/// Which routine a copy used.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CopyPath {
    /// `memcpy`: ordinary cached stores.
    Plain,
    /// 256-bit non-temporal stores (AVX2), then `sfence`.
    NonTemporalAvx2,
    /// 512-bit non-temporal stores (AVX-512F), then `sfence`.
    NonTemporalAvx512,
}

impl CopyPath {
    /// A short name for logs and bench output: `plain`, `nt-avx2`, `nt-avx512`.
    pub fn as_str(self) -> &'static str {
        match self {
            CopyPath::Plain => "plain",
            CopyPath::NonTemporalAvx2 => "nt-avx2",
            CopyPath::NonTemporalAvx512 => "nt-avx512",
        }
    }

    /// True for the streaming-store routines.
    pub fn is_non_temporal(self) -> bool {
        !matches!(self, CopyPath::Plain)
    }

    /// True when the copy left the destination written back to memory and
    /// fenced, as [`crate::visibility::publish`] would.
    pub fn satisfies_publish(self) -> bool {
        self.is_non_temporal()
    }

    /// True when this CPU can run the routine.
    pub fn is_available(self) -> bool {
        match self {
            CopyPath::Plain => true,
            #[cfg(target_arch = "x86_64")]
            CopyPath::NonTemporalAvx2 => std::is_x86_feature_detected!("avx2"),
            #[cfg(target_arch = "x86_64")]
            CopyPath::NonTemporalAvx512 => std::is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            CopyPath::NonTemporalAvx2 | CopyPath::NonTemporalAvx512 => false,
        }
    }
}

/// A forced routine this CPU lacks.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CopyError {
    #[error("copy routine {} is not supported by this CPU", path.as_str())]
    Unavailable { path: CopyPath },
}

/// The best non-temporal routine of this CPU, if any.
fn best_non_temporal() -> Option<CopyPath> {
    [CopyPath::NonTemporalAvx512, CopyPath::NonTemporalAvx2]
        .into_iter()
        .find(|p| p.is_available())
}

/// The routine [`copy_in`] uses for `len_bytes` on this CPU.
pub fn choose_copy_in(len_bytes: usize) -> CopyPath {
    choose(len_bytes, NT_COPY_IN_MIN_BYTES)
}

/// The routine [`copy_out`] uses for `len_bytes` on this CPU.
pub fn choose_copy_out(len_bytes: usize) -> CopyPath {
    choose(len_bytes, NT_COPY_OUT_MIN_BYTES)
}

fn choose(len_bytes: usize, nt_min_bytes: usize) -> CopyPath {
    if len_bytes >= nt_min_bytes {
        best_non_temporal().unwrap_or(CopyPath::Plain)
    } else {
        CopyPath::Plain
    }
}

/// Copies `src` into a pool page (`dst`, e.g. a `PageViewMut`); returns the
/// routine used — if it [satisfies publish](CopyPath::satisfies_publish), the
/// caller need not call `publish` for `dst`.
///
/// # Panics
/// If the lengths differ.
pub fn copy_in(dst: &mut [u8], src: &[u8]) -> CopyPath {
    let path = choose_copy_in(src.len());
    run(path, dst, src);
    path
}

/// Copies a pool page (`src`, e.g. a `PageView`) out to `dst`; returns the
/// routine used. Call [`crate::visibility::acquire`] on `src` first when the
/// pool's mode requires it.
///
/// # Panics
/// If the lengths differ.
pub fn copy_out(dst: &mut [u8], src: &[u8]) -> CopyPath {
    let path = choose_copy_out(src.len());
    run(path, dst, src);
    path
}

/// Copies with a given routine (benches and tests force each one).
///
/// # Panics
/// If the lengths differ.
pub fn copy_with(path: CopyPath, dst: &mut [u8], src: &[u8]) -> Result<(), CopyError> {
    if !path.is_available() {
        return Err(CopyError::Unavailable { path });
    }
    run(path, dst, src);
    Ok(())
}

/// Runs an available routine.
fn run(path: CopyPath, dst: &mut [u8], src: &[u8]) {
    assert_eq!(
        dst.len(),
        src.len(),
        "copy between slices of different lengths"
    );
    match path {
        CopyPath::Plain => dst.copy_from_slice(src),
        #[cfg(target_arch = "x86_64")]
        CopyPath::NonTemporalAvx2 | CopyPath::NonTemporalAvx512 => {
            debug_assert!(
                path.is_available(),
                "{} checked by the caller",
                path.as_str()
            );
            x86::copy_non_temporal(path, dst, src);
        }
        #[cfg(not(target_arch = "x86_64"))]
        CopyPath::NonTemporalAvx2 | CopyPath::NonTemporalAvx512 => {
            unreachable!("non-temporal routines are unavailable off x86-64")
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::CopyPath;
    use crate::visibility::{self, CACHE_LINE_BYTES};
    use std::arch::x86_64::{
        __m256i, __m512i, _mm256_loadu_si256, _mm256_stream_si256, _mm512_loadu_si512,
        _mm512_stream_si512,
    };

    /// Head with ordinary stores up to the first 64-byte boundary of `dst`,
    /// whole lines with streaming stores, tail with ordinary stores; then the
    /// (at most two) partially written lines are written back and everything
    /// is fenced.
    pub(super) fn copy_non_temporal(path: CopyPath, dst: &mut [u8], src: &[u8]) {
        let len = dst.len();
        let misalign = dst.as_ptr() as usize % CACHE_LINE_BYTES;
        let head = ((CACHE_LINE_BYTES - misalign) % CACHE_LINE_BYTES).min(len);
        let body = (len - head) / CACHE_LINE_BYTES * CACHE_LINE_BYTES;
        let (dst_head, rest) = dst.split_at_mut(head);
        let (dst_body, dst_tail) = rest.split_at_mut(body);
        let (src_head, rest) = src.split_at(head);
        let (src_body, src_tail) = rest.split_at(body);

        dst_head.copy_from_slice(src_head);
        match path {
            // SAFETY: `copy_with`/`choose` only select this path after
            // detecting AVX-512F; `dst_body` starts on a 64-byte boundary and
            // both bodies hold whole 64-byte lines.
            CopyPath::NonTemporalAvx512 => unsafe { stream_avx512(dst_body, src_body) },
            // SAFETY: as above, for AVX2.
            CopyPath::NonTemporalAvx2 => unsafe { stream_avx2(dst_body, src_body) },
            CopyPath::Plain => unreachable!("plain copies do not come here"),
        }
        dst_tail.copy_from_slice(src_tail);

        let flush = visibility::line_flush();
        if !dst_head.is_empty() {
            visibility::flush_line(flush, dst_head.as_ptr() as usize);
        }
        if !dst_tail.is_empty() {
            visibility::flush_line(flush, dst_tail.as_ptr() as usize);
        }
        visibility::store_fence();
    }

    /// # Safety
    /// The CPU supports AVX-512F; `dst` is 64-byte aligned; both slices hold
    /// the same whole number of 64-byte lines.
    #[target_feature(enable = "avx512f")]
    unsafe fn stream_avx512(dst: &mut [u8], src: &[u8]) {
        debug_assert!(dst.is_empty() || (dst.as_ptr() as usize).is_multiple_of(64));
        for (d, s) in dst.chunks_exact_mut(64).zip(src.chunks_exact(64)) {
            // SAFETY: `s` is 64 readable bytes (unaligned loads are fine);
            // `d` is 64 writable bytes at a 64-byte boundary, as the
            // streaming store requires.
            unsafe {
                let v = _mm512_loadu_si512(s.as_ptr().cast::<__m512i>());
                _mm512_stream_si512(d.as_mut_ptr().cast::<__m512i>(), v);
            }
        }
    }

    /// # Safety
    /// The CPU supports AVX2; `dst` is 64-byte aligned; both slices hold the
    /// same whole number of 64-byte lines.
    #[target_feature(enable = "avx2")]
    unsafe fn stream_avx2(dst: &mut [u8], src: &[u8]) {
        debug_assert!(dst.is_empty() || (dst.as_ptr() as usize).is_multiple_of(64));
        for (d, s) in dst.chunks_exact_mut(64).zip(src.chunks_exact(64)) {
            // SAFETY: `s` is 64 readable bytes; `d` is 64 writable bytes at a
            // 64-byte (so also 32-byte) boundary, as the streaming store
            // requires; both halves stay inside the line.
            unsafe {
                let lo = _mm256_loadu_si256(s.as_ptr().cast::<__m256i>());
                let hi = _mm256_loadu_si256(s.as_ptr().add(32).cast::<__m256i>());
                _mm256_stream_si256(d.as_mut_ptr().cast::<__m256i>(), lo);
                _mm256_stream_si256(d.as_mut_ptr().add(32).cast::<__m256i>(), hi);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX_LEN: usize = 4160;
    const SLACK: usize = 64;

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 8) as u8))
            .collect()
    }

    /// Every length 0..=4160 at misaligned source and destination offsets
    /// (all 64 destination offsets per length, a rotating source offset),
    /// checking the copied bytes and that no byte outside the destination
    /// changed.
    fn check_all_lengths(path: CopyPath) {
        // 64-byte aligned backing storage so that offsets are real alignments.
        let mut src_store = vec![0u128; (MAX_LEN + 2 * SLACK) / 16 + 4];
        let mut dst_store = vec![0u128; (MAX_LEN + 2 * SLACK) / 16 + 4];
        let src_buf = aligned_bytes(&mut src_store);
        src_buf.copy_from_slice(&pattern(src_buf.len(), 7));
        let src_buf: &[u8] = src_buf;
        let dst_buf = aligned_bytes(&mut dst_store);
        let canvas = pattern(dst_buf.len(), 200);
        dst_buf.copy_from_slice(&canvas);
        for len in 0..=MAX_LEN {
            for dst_off in 0..SLACK {
                let src_off = (dst_off * 5 + len) % SLACK;
                let src = &src_buf[src_off..src_off + len];
                copy_with(path, &mut dst_buf[dst_off..dst_off + len], src).expect("path available");
                assert!(
                    dst_buf[dst_off..dst_off + len] == *src,
                    "{}: len {len} dst_off {dst_off} src_off {src_off}",
                    path.as_str()
                );
                assert!(
                    dst_buf[..dst_off] == canvas[..dst_off]
                        && dst_buf[dst_off + len..] == canvas[dst_off + len..],
                    "{}: wrote outside the destination, len {len} dst_off {dst_off}",
                    path.as_str()
                );
                dst_buf[dst_off..dst_off + len].copy_from_slice(&canvas[dst_off..dst_off + len]);
            }
        }
    }

    /// The 64-byte aligned part of a buffer.
    fn aligned_bytes(store: &mut [u128]) -> &mut [u8] {
        // SAFETY: u128 has no padding and any bytes are valid u8s; the slice
        // covers exactly the storage and borrows it mutably.
        let bytes: &mut [u8] = unsafe {
            std::slice::from_raw_parts_mut(store.as_mut_ptr().cast::<u8>(), store.len() * 16)
        };
        let skip = (64 - bytes.as_ptr() as usize % 64) % 64;
        let usable = MAX_LEN + 2 * SLACK;
        &mut bytes[skip..skip + usable]
    }

    #[test]
    fn plain_copy_is_exact_for_every_length_and_alignment() {
        check_all_lengths(CopyPath::Plain);
    }

    #[test]
    fn avx2_non_temporal_copy_is_exact_for_every_length_and_alignment() {
        if !CopyPath::NonTemporalAvx2.is_available() {
            eprintln!("skipping: this CPU has no AVX2");
            return;
        }
        check_all_lengths(CopyPath::NonTemporalAvx2);
    }

    #[test]
    fn avx512_non_temporal_copy_is_exact_for_every_length_and_alignment() {
        if !CopyPath::NonTemporalAvx512.is_available() {
            eprintln!("skipping: this CPU has no AVX-512F");
            return;
        }
        check_all_lengths(CopyPath::NonTemporalAvx512);
    }

    #[test]
    fn copy_in_picks_non_temporal_stores_only_for_large_copies() {
        assert_eq!(choose_copy_in(0), CopyPath::Plain);
        assert_eq!(choose_copy_in(NT_COPY_IN_MIN_BYTES - 1), CopyPath::Plain);
        let large = choose_copy_in(NT_COPY_IN_MIN_BYTES);
        assert_eq!(large, best_non_temporal().unwrap_or(CopyPath::Plain));
        assert_eq!(large.satisfies_publish(), large.is_non_temporal());

        let src = pattern(NT_COPY_IN_MIN_BYTES + 3, 1);
        let mut dst = vec![0u8; src.len()];
        assert_eq!(copy_in(&mut dst, &src), large);
        assert_eq!(dst, src);
        let mut back = vec![0u8; src.len()];
        assert_eq!(copy_out(&mut back, &dst), choose_copy_out(src.len()));
        assert_eq!(back, src);
    }

    #[test]
    fn forcing_an_unavailable_routine_is_an_error() {
        for path in [CopyPath::NonTemporalAvx2, CopyPath::NonTemporalAvx512] {
            let mut dst = [0u8; 8];
            let result = copy_with(path, &mut dst, &[1u8; 8]);
            if path.is_available() {
                assert_eq!(result, Ok(()));
                assert_eq!(dst, [1u8; 8]);
            } else {
                assert_eq!(result, Err(CopyError::Unavailable { path }));
                assert_eq!(dst, [0u8; 8], "nothing copied");
            }
        }
    }

    #[test]
    #[should_panic(expected = "different lengths")]
    fn copies_between_slices_of_different_lengths_panic() {
        copy_in(&mut [0u8; 4], &[0u8; 5]);
    }
}
