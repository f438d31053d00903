//! `cxlkv bench copy`: the copy engine against `memcpy` into the same pool.
//!
//! Each case copies chunks of one size into a mapped region of the pool and
//! reports GB/s of [`copy_in`] (`ours`) against `ptr::copy_nonoverlapping`
//! (`<[u8]>::copy_from_slice`, libc `memcpy`) into the same mapping
//! (`baseline`, the physical ceiling a user would otherwise get;
//! `ratio = ours / baseline`). Two more contestants run in the same reps:
//! - `baseline_flushed_gbps`: the same `memcpy`, then every line of the
//!   chunk written back (`clwb`, else `clflushopt`; `flush_instruction`)
//!   and an `sfence` — what a `memcpy` must add before another host may
//!   read the chunk from memory shared without coherence (a CXL pool in
//!   `Flush` visibility), and what our copy's non-temporal stores, ending with
//!   their own `sfence`, already are;
//! - `nt_gbps`: the best non-temporal routine forced at every size, which
//!   shows where streaming stores win whatever the threshold.
//!
//! What keeps the comparison honest:
//! - **No contestant pays for another's write-backs.** `memcpy` leaves up to
//!   a cache's worth of dirty lines behind, whose write-back would land in
//!   the next contestant's timer. After each contestant, untimed, every line
//!   it wrote is written back and evicted (`clflushopt`, else `clflush`, then
//!   `mfence`; `evict_between`), and so is the whole span before a
//!   destination's first case: each timer starts with nothing of the
//!   destination in the cache, dirty or clean.
//! - **Long enough to pay for its own write-backs.** Each contestant copies
//!   `rep_bytes` per repetition: at least eight times the last-level cache
//!   (read from sysfs; bounded, see `MAX_REP_BYTES`), so the write-back of
//!   `memcpy`'s own dirty lines, which the cache defers, is mostly inside
//!   its own timer.
//! - **Streaming destination and source.** Consecutive copies walk through a
//!   span of at least twice the last-level cache, for the destination (the
//!   mapped region) and the source (a heap buffer) alike, and the walk
//!   continues across contestants and repetitions.
//! - **Prefaulted pages.** The region is mapped with [`Populate::Eager`] and
//!   the source filled before anything is timed.
//! - **Interleaving and medians.** Every repetition times all contestants
//!   back to back, in an order that rotates; each figure is the median of
//!   `--reps` repetitions.
//!
//! Destinations: `dest=shm` (a temporary file under `/dev/shm`, the embedded
//! default backing) and `dest=hugetlb` (a `MFD_HUGETLB` memfd, after
//! reserving the 2 MiB huge pages it needs under the shared lock file; skipped
//! with a note when none can be had). `--pool PATH` measures on that device
//! or file instead (overwriting its first bytes; refused while a pool
//! manager holds it), named by its kind (`dest=devdax`, `dest=hugetlb`,
//! `dest=shm`, `dest=file`). Sizes: 64 KiB to 64 MiB, or
//! `--chunk-sizes` or `CXLKV_BENCH_CHUNK_SIZES` (`sizes_from` says which).

use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::pool_target::{self, BenchPool};
use super::{Better, Record, Reporter, median, size_label};
use crate::cli::BenchArgs;
use crate::dataplane::backing::{self, Backing, BackingKind, Extent, OpenOptions};
use crate::dataplane::copy::{self, CopyPath, copy_in};
use crate::dataplane::hugepages::{HUGE_PAGE_BYTES, HugePageReservation};
use crate::dataplane::ids::{PageIndex, RegionId};
use crate::dataplane::map::{MapObservers, MappedRegion, Populate};
use crate::dataplane::visibility::{self, Visibility, VisibilityOps};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// Chunk sizes: powers of 4 from 64 KiB (a small chunk) to 64 MiB (a large
/// model's 256-token chunk).
const SIZES: &[usize] = &[64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB];
const QUICK_SIZES: &[usize] = &[64 * KIB, MIB, 64 * MIB];

/// Bytes each contestant copies per repetition (at least four chunks), at
/// least: long enough for a stable rate. Raised to [`LLC_MULTIPLE`] times
/// the last-level cache, up to the `MAX_` bound (a run stays in minutes).
const REP_BYTES: usize = 256 * MIB;
const QUICK_REP_BYTES: usize = 64 * MIB;
const MAX_REP_BYTES: usize = 4 << 30;
const QUICK_MAX_REP_BYTES: usize = 512 * MIB;
/// Bytes per repetition as a multiple of the last-level cache (module docs).
pub(super) const LLC_MULTIPLE: usize = 8;

/// Granule of a destination page (a chunk's slot is rounded up to it).
const PAGE_GRANULE: usize = backing::PAGE_GRANULE_BYTES as usize;

/// Assumed last-level cache size where sysfs does not say.
const FALLBACK_LLC_BYTES: usize = 64 * MIB;

/// How long to wait for another process holding the huge page lock.
const HUGEPAGE_LOCK_TIMEOUT: Duration = Duration::from_secs(60);

/// Bytes per repetition for a cache of `llc_bytes`: `base` raised to
/// [`LLC_MULTIPLE`] × LLC, at most `max`.
pub(super) fn rep_bytes_for(llc_bytes: usize, base: usize, max: usize) -> usize {
    base.max(LLC_MULTIPLE.saturating_mul(llc_bytes)).min(max)
}

/// [`rep_bytes_for`], with a note when the cap keeps it under
/// `LLC_MULTIPLE` times the cache.
pub(super) fn rep_bytes_noted(
    reporter: &mut Reporter,
    llc_bytes: usize,
    base: usize,
    max: usize,
) -> usize {
    let rep_bytes = rep_bytes_for(llc_bytes, base, max);
    if rep_bytes < LLC_MULTIPLE * llc_bytes {
        reporter.note(&format!(
            "{} MiB per repetition is less than {LLC_MULTIPLE} x the last-level cache ({} MiB)",
            rep_bytes / MIB,
            llc_bytes / MIB
        ));
    }
    rep_bytes
}

pub fn run(args: &BenchArgs, reporter: &mut Reporter) -> anyhow::Result<()> {
    let (default_sizes, base_rep_bytes, max_rep_bytes) = if args.quick {
        (QUICK_SIZES, QUICK_REP_BYTES, QUICK_MAX_REP_BYTES)
    } else {
        (SIZES, REP_BYTES, MAX_REP_BYTES)
    };
    let (sizes, sizes_from) = match super::chunk_sizes(args)? {
        Some((sizes, from)) => (sizes, from),
        None => (default_sizes.to_vec(), "default"),
    };
    let llc_bytes = llc_bytes().unwrap_or_else(|| {
        reporter.note(&format!(
            "last-level cache size not found in sysfs; assuming {} MiB",
            FALLBACK_LLC_BYTES / MIB
        ));
        FALLBACK_LLC_BYTES
    });
    let rep_bytes = rep_bytes_noted(reporter, llc_bytes, base_rep_bytes, max_rep_bytes);
    let largest = sizes
        .iter()
        .map(|s| s.next_multiple_of(PAGE_GRANULE))
        .max()
        .unwrap_or(MIB);
    let span_bytes = (2 * llc_bytes)
        .max(2 * largest)
        .next_multiple_of(HUGE_PAGE_BYTES as usize);
    let nt = [CopyPath::NonTemporalAvx512, CopyPath::NonTemporalAvx2]
        .into_iter()
        .find(|p| p.is_available());
    let mut plan = Plan {
        sizes,
        sizes_from,
        rep_bytes,
        reps: args.reps,
        llc_bytes,
        nt,
        source: Source::new(span_bytes),
        pool: pool_target::DEFAULT_POOL_LABEL.to_owned(),
    };

    if let Some(pool) = &args.pool {
        let target = BenchPool::from_args(args)?;
        target.check_unused()?;
        let backing = backing::open(pool, &OpenOptions::new())
            .with_context(|| format!("opening --pool {}", pool.display()))?;
        reporter.note(&format!(
            "measuring on {} ({}); its first bytes are overwritten",
            pool.display(),
            backing.kind()
        ));
        plan.pool = target.label();
        return plan.measure(reporter, target.dest(), &*backing);
    }

    let shm = TempPool::create(span_bytes)?;
    plan.measure(reporter, "shm", &*shm.backing)?;
    drop(shm);

    let pages = (span_bytes as u64).div_ceil(HUGE_PAGE_BYTES);
    match HugePageReservation::reserve(pages, HUGEPAGE_LOCK_TIMEOUT) {
        Err(err) => reporter.note(&format!(
            "skipping dest=hugetlb: cannot reserve {pages} huge pages of 2 MiB: {:#}",
            anyhow::Error::new(err)
        )),
        Ok(reservation) => match hugetlb_memfd(span_bytes as u64) {
            Err(err) => reporter.note(&format!("skipping dest=hugetlb: {err:#}")),
            Ok(backing) => {
                plan.measure(reporter, "hugetlb", &*backing)?;
                // The memfd's pages return to the kernel pool when the last
                // reference goes; only then can the reservation shrink it.
                drop(backing);
                drop(reservation);
            }
        },
    }
    Ok(())
}

/// What every destination is measured with.
struct Plan {
    sizes: Vec<usize>,
    /// `default`, or the variable the sizes came from.
    sizes_from: &'static str,
    rep_bytes: usize,
    reps: usize,
    llc_bytes: usize,
    nt: Option<CopyPath>,
    source: Source,
    /// The `pool` field: `default`, or `--pool`'s path.
    pool: String,
}

/// The contestants of one repetition.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Contestant {
    Ours,
    Baseline,
    /// `memcpy`, then the chunk written back and fenced.
    BaselineFlushed,
    ForcedNt(CopyPath),
}

/// One chunk size in a mapped span: its slot (the size rounded up to whole
/// 4 KiB granules) and how many slots the span holds.
#[derive(Clone, Copy)]
struct Slots {
    size: usize,
    page_bytes: usize,
    pages: u32,
}

impl Plan {
    fn measure(
        &mut self,
        reporter: &mut Reporter,
        dest: &str,
        backing: &dyn Backing,
    ) -> anyhow::Result<()> {
        let align = backing.align_bytes() as usize;
        let mut span_bytes = self.source.len().min(backing.size_bytes() as usize);
        span_bytes -= span_bytes % align;
        if span_bytes < 2 * self.llc_bytes {
            reporter.note(&format!(
                "dest={dest}: pool span {} MiB is less than twice the last-level cache ({} MiB); \
                 some copies may hit cache",
                span_bytes / MIB,
                self.llc_bytes / MIB
            ));
        }
        let observers = MapObservers::new();
        // SAFETY: this process is the only user of the region (a private
        // temporary pool, or a pool the operator handed to the bench and no
        // pool manager holds), writes go through one page view at a time,
        // and reads (the evictions) only while no write view exists.
        let region = unsafe {
            MappedRegion::map(
                backing,
                RegionId(0),
                Extent::new(0, span_bytes as u64),
                Populate::Eager,
                &observers,
            )
        }
        .with_context(|| {
            format!(
                "mapping {} MiB of {}",
                span_bytes / MIB,
                backing.path().display()
            )
        })?;
        // Nothing of the span in the cache before the first timer (the
        // prefault may have zeroed pages through it).
        evict(
            region
                .page(span_bytes, PageIndex(0), span_bytes)?
                .as_bytes(),
        );

        let mut cursor = Cursor::default();
        for size in self.sizes.clone() {
            let page_bytes = size.next_multiple_of(PAGE_GRANULE);
            let Ok(pages) = region.page_count(page_bytes) else {
                reporter.note(&format!("dest={dest}: size {size} does not fit; skipped"));
                continue;
            };
            if (pages as usize) < 2 {
                reporter.note(&format!("dest={dest}: size {size} fills the span; skipped"));
                continue;
            }
            let slots = Slots {
                size,
                page_bytes,
                pages,
            };
            let chunks_per_rep = (self.rep_bytes / size).max(4);
            let mut contestants = vec![
                Contestant::Ours,
                Contestant::Baseline,
                Contestant::BaselineFlushed,
            ];
            if let Some(nt) = self.nt {
                contestants.push(Contestant::ForcedNt(nt));
            }
            let mut samples = vec![Vec::with_capacity(self.reps); contestants.len()];
            for rep in 0..self.reps {
                for k in 0..contestants.len() {
                    let slot = (k + rep) % contestants.len();
                    let gbps = self.time_one(
                        &region,
                        contestants[slot],
                        slots,
                        chunks_per_rep,
                        &mut cursor,
                    )?;
                    samples[slot].push(gbps);
                }
            }
            let mut medians = samples.iter_mut().map(|s| median(s));
            let ours = medians.next().unwrap_or(0.0);
            let baseline = medians.next().unwrap_or(0.0);
            let baseline_flushed = medians.next().unwrap_or(0.0);
            let nt_gbps = medians.next();
            let mut record = Record::new(
                "copy",
                format!("size={},dest={dest}", size_label(size)),
                ours,
                baseline,
                "GB/s",
                Better::Higher,
            )
            .with("path", copy::choose_copy_in(size).as_str())
            .with("size_bytes", size)
            .with("chunk_bytes", size)
            .with("sizes_from", self.sizes_from)
            .with("baseline_flushed_gbps", baseline_flushed)
            .with(
                "ratio_flushed",
                if baseline_flushed > 0.0 {
                    ours / baseline_flushed
                } else {
                    0.0
                },
            )
            .with("flush_instruction", visibility::line_flush().as_str())
            .with("evict_between", visibility::line_evict().as_str())
            .with("reps", self.reps)
            .with("rep_bytes", chunks_per_rep * size)
            .with("span_bytes", span_bytes)
            .with("llc_bytes", self.llc_bytes)
            .with("pool", self.pool.as_str())
            .with("dest", dest);
            if let (Some(nt), Some(nt_gbps)) = (self.nt, nt_gbps) {
                record = record
                    .with("nt_path", nt.as_str())
                    .with("nt_gbps", nt_gbps)
                    .with("nt_wins", nt_gbps > baseline);
            }
            reporter.emit(&record)?;
        }
        Ok(())
    }

    /// Copies `chunks` chunks with one contestant, continuing the walk
    /// through destination and source; returns GB/s. Then, untimed, writes
    /// back and evicts every slot it wrote (module docs).
    fn time_one(
        &mut self,
        region: &MappedRegion,
        contestant: Contestant,
        slots: Slots,
        chunks: usize,
        cursor: &mut Cursor,
    ) -> anyhow::Result<f64> {
        let Slots {
            size,
            page_bytes,
            pages,
        } = slots;
        let first_page = cursor.page;
        let publish = VisibilityOps::for_mode(Visibility::Flush);
        let start = Instant::now();
        for _ in 0..chunks {
            let index = PageIndex(cursor.page % pages);
            cursor.page = cursor.page.wrapping_add(1);
            let src = self.source.next(size, &mut cursor.source_offset);
            // SAFETY: one view at a time, in a region no one else touches
            // (see `measure`).
            let mut dst = unsafe { region.page_mut(page_bytes, index, size) }?;
            match contestant {
                Contestant::Ours => {
                    copy_in(&mut dst, src);
                }
                Contestant::Baseline => dst.copy_from_slice(src),
                Contestant::BaselineFlushed => {
                    dst.copy_from_slice(src);
                    publish.publish(&dst);
                }
                Contestant::ForcedNt(path) => copy::copy_with(path, &mut dst, src)?,
            }
        }
        let secs = start.elapsed().as_secs_f64();
        let written = chunks.min(pages as usize) as u32;
        for k in 0..written {
            let index = PageIndex(first_page.wrapping_add(k) % pages);
            evict(region.page(page_bytes, index, size)?.as_bytes());
        }
        Ok((chunks * size) as f64 / secs.max(1e-9) / 1e9)
    }
}

/// Writes back and evicts every cache line of `bytes` (`clflushopt`, else
/// `clflush`, then `mfence`): the next timer finds none of them cached.
pub(super) fn evict(bytes: &[u8]) {
    VisibilityOps::for_mode(Visibility::Flush).acquire(bytes);
}

/// Where the walk through destination pages and source bytes stands.
#[derive(Default)]
struct Cursor {
    page: u32,
    source_offset: usize,
}

/// The source buffer: at least twice the LLC, filled (so prefaulted) once.
struct Source {
    bytes: Vec<u8>,
}

impl Source {
    fn new(len: usize) -> Self {
        let bytes = (0..len).map(|i| (i as u8) ^ ((i >> 12) as u8)).collect();
        Self { bytes }
    }

    fn len(&self) -> usize {
        self.bytes.len()
    }

    /// The next `size` bytes of the walk, wrapping to the start.
    fn next(&self, size: usize, offset: &mut usize) -> &[u8] {
        if *offset + size > self.bytes.len() {
            *offset = 0;
        }
        let chunk = &self.bytes[*offset..*offset + size];
        *offset += size;
        chunk
    }
}

/// A pool file under `/dev/shm`, removed on drop. It holds a shared
/// `flock` on the file for its life, so another bench's stale-file sweep
/// (`stale::sweep`) sees it in use even from a pid namespace where this
/// bench's pid names no process.
struct TempPool {
    backing: Arc<dyn Backing>,
    path: PathBuf,
    _lock: std::fs::File,
}

impl TempPool {
    fn create(size_bytes: usize) -> anyhow::Result<Self> {
        let path = Path::new(backing::DEFAULT_POOL_DIR)
            .join(format!("cxlkv-bench-copy-{}", std::process::id()));
        let backing = backing::open(
            &path,
            &OpenOptions::new().create_size_bytes(size_bytes as u64),
        )
        .with_context(|| format!("creating the temporary pool {}", path.display()))?;
        let lock = lock_shared(&path)
            .with_context(|| format!("locking the temporary pool {}", path.display()));
        let lock = match lock {
            Ok(lock) => lock,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
        };
        Ok(Self {
            backing,
            path,
            _lock: lock,
        })
    }
}

/// Opens `path` (not following a link) and takes a shared `flock` on it,
/// held until the returned file is closed.
fn lock_shared(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    // SAFETY: `file` is an open descriptor for the call's duration; the lock
    // is released when it is closed.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file)
}

impl Drop for TempPool {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A `MFD_HUGETLB` memfd of `size_bytes` as a hugetlbfs backing.
fn hugetlb_memfd(size_bytes: u64) -> anyhow::Result<Arc<dyn Backing>> {
    // SAFETY: the name is a valid NUL-terminated string; the flags are plain
    // integers.
    let fd = unsafe {
        libc::memfd_create(
            c"cxlkv-bench-hugetlb".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_HUGETLB | libc::MFD_HUGE_2MB,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("memfd_create(MFD_HUGETLB)");
    }
    // SAFETY: memfd_create returned a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let file = std::fs::File::from(fd);
    file.set_len(size_bytes)
        .context("sizing the hugetlb memfd")?;
    Ok(backing::from_fd(
        OwnedFd::from(file),
        BackingKind::Hugetlbfs,
        size_bytes,
        HUGE_PAGE_BYTES,
    )?)
}

/// The last-level cache size of CPU 0, from sysfs (`None` where sysfs does
/// not describe the caches).
pub fn llc_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    let mut best: Option<(u32, usize)> = None;
    for entry in dir.flatten() {
        let path = entry.path();
        let read = |name: &str| std::fs::read_to_string(path.join(name)).ok();
        let (Some(level), Some(kind), Some(size)) = (read("level"), read("type"), read("size"))
        else {
            continue;
        };
        if kind.trim() == "Instruction" {
            continue;
        }
        let (Ok(level), Some(size)) = (level.trim().parse::<u32>(), parse_cache_size(&size)) else {
            continue;
        };
        if best.is_none_or(|(l, _)| level > l) {
            best = Some((level, size));
        }
    }
    best.map(|(_, size)| size)
}

/// Parses sysfs cache sizes such as `307200K` or `2M`.
fn parse_cache_size(raw: &str) -> Option<usize> {
    let raw = raw.trim();
    let (digits, unit) = match raw.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => raw.split_at(i),
        None => (raw, ""),
    };
    let value: usize = digits.parse().ok()?;
    let scale = match unit {
        "" => 1,
        "K" => KIB,
        "M" => MIB,
        "G" => 1 << 30,
        _ => return None,
    };
    value.checked_mul(scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_sizes_parse_with_units() {
        assert_eq!(parse_cache_size("307200K\n"), Some(307_200 * KIB));
        assert_eq!(parse_cache_size("2M"), Some(2 * MIB));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size("12Q"), None);
        assert_eq!(parse_cache_size(""), None);
    }

    #[test]
    fn bytes_per_rep_cover_eight_caches_within_the_bound() {
        assert_eq!(rep_bytes_for(16 * MIB, 256 * MIB, 4 << 30), 256 * MIB);
        assert_eq!(rep_bytes_for(48 * MIB, 256 * MIB, 4 << 30), 384 * MIB);
        assert_eq!(rep_bytes_for(1 << 30, 256 * MIB, 4 << 30), 4 << 30);
    }

    /// A bench in another pid namespace cannot tell by the pid whether
    /// the pool is still used: the sweep's lock test must say so, or it
    /// would remove the name of a pool a running `copy` uses.
    #[test]
    fn the_temporary_pool_is_seen_in_use_by_the_stale_file_sweep() {
        let pool = TempPool::create(2 * MIB).expect("a temporary pool");
        assert!(super::super::stale::locked(&pool.path));
        let path = pool.path.clone();
        drop(pool);
        assert!(!path.exists(), "removed on drop");
    }

    #[test]
    fn the_source_walk_wraps_and_stays_in_bounds() {
        let source = Source::new(10);
        let mut offset = 0;
        assert_eq!(source.next(4, &mut offset).len(), 4);
        assert_eq!(source.next(4, &mut offset).len(), 4);
        assert_eq!(offset, 8);
        // 8 + 4 > 10: wraps to the start.
        assert_eq!(source.next(4, &mut offset).as_ptr(), source.bytes.as_ptr());
        assert_eq!(offset, 4);
    }
}
