//! Capture of memory: classify each mapping, decide page by page (pagemap,
//! and the dirty tracker when there is a parent image) what must be read,
//! then read, hash, compare and store those pages on the worker pool.
//!
//! A page goes to the image as one of: unchanged since the parent (known
//! from the tracker without reading it, or read and found equal to the
//! parent's by hash), all zero (anonymous: left out; over a file page:
//! recorded as zero), or stored (once per image: see `cr_image::store`).
//!
//! Stored: pages a private mapping owns (present or swapped, and not the
//! file's own page), and the written pages of shared anonymous memory, read
//! from the shared object itself (/proc/PID/map_files, SEEK_DATA) once per
//! object: other processes mapping it refer to its first ("owner")
//! mapping. Not stored: untouched pages, file pages of private file
//! mappings (the file has them), shared file mappings (the file is the
//! memory), droppable memory (the kernel may free it at any time), guard
//! regions (no page; reading one faults), and the kernel's special
//! mappings ([vdso], [vvar], [vsyscall]), which restore takes from the new
//! kernel.

use super::pool;
use crate::{fault, CheckpointError};
use cr_image::chain::{push_run, MemIndex};
use cr_image::model::{MemStats, Memory, PageAt, PageRun, Vma, VmaKind};
use cr_image::store::{is_zero, page_hash, OpenBlock, StoreWriter};
use cr_sys::mem::{read_vm, FileWindow, ProcMem};
use cr_sys::pagemap::{
    is_pte_marker, Pagemap, PFN_MASK, PM_EXCLUSIVE, PM_FILE, PM_GUARD_REGION, PM_PRESENT,
    PM_SOFT_DIRTY, PM_SWAP,
};
use cr_sys::proc::{self, MapEntry};
use cr_sys::PAGE_SIZE;
use std::fs::File;
use std::ops::Range;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Largest run of pages copied (and checksummed) as one unit.
pub const MAX_RUN_PAGES: u64 = 256;
/// Pagemap entries read at once.
const PAGEMAP_CHUNK: u64 = 32 * 1024;

/// Classify a mapping, refusing the kinds this build cannot restore.
pub fn classify(pid: i32, m: &MapEntry) -> Result<Vma, CheckpointError> {
    classify_with(pid, m, None)
}

/// [`classify`], with the exact path of a file mapping already known
/// (`link`: its map_files link read before the freeze, for a line of
/// /proc/PID/maps found unchanged since: see [`super::EarlyMaps::link`]);
/// None: the link is read now.
pub fn classify_with(pid: i32, m: &MapEntry, link: Option<&str>) -> Result<Vma, CheckpointError> {
    let unsupported = |what: String| CheckpointError::unsupported(pid, what);
    let mut anon_name = String::new();
    // /proc/PID/maps escapes a newline in a path as "\012"; the map_files
    // link gives the exact path.
    let path = match link {
        Some(l) if m.path.starts_with('/') => l.to_string(),
        _ if m.path.starts_with('/') => map_file_path(pid, m),
        _ => m.path.clone(),
    };
    let kind = match path.as_str() {
        "[vdso]" => VmaKind::Vdso,
        "[vvar]" => VmaKind::Vvar,
        "[vvar_vclock]" => VmaKind::VvarVclock,
        "[vsyscall]" => VmaKind::Vsyscall,
        "[heap]" => VmaKind::Heap,
        "[stack]" => VmaKind::Stack,
        "" if m.shared => VmaKind::AnonShared,
        "" => VmaKind::AnonPrivate,
        p if p.starts_with("[anon:") => {
            anon_name = p
                .trim_start_matches("[anon:")
                .trim_end_matches(']')
                .to_string();
            VmaKind::AnonPrivate
        }
        p if p.starts_with("[anon_shmem:") => {
            anon_name = p
                .trim_start_matches("[anon_shmem:")
                .trim_end_matches(']')
                .to_string();
            VmaKind::AnonShared
        }
        "/dev/zero (deleted)" if m.shared => VmaKind::AnonShared,
        // mmap(MAP_ANONYMOUS | MAP_HUGETLB): a file of the kernel's own
        // hugetlbfs mount, anonymous memory to the program.
        HUGE_ANON if m.shared => VmaKind::AnonShared,
        HUGE_ANON => VmaKind::AnonPrivate,
        // io_setup's completion ring: kind "aio" reads it.
        "/[aio] (deleted)" | "/[aio]" => VmaKind::Aio,
        // A socket's rings mapped from it (only a packet socket's can be
        // mapped and restored; the memory kind checks it holds one).
        p if p.starts_with("socket:[") => VmaKind::PacketRing,
        // An attach of a System V segment; its inode is the segment's id.
        p if p.starts_with("/SYSV") && m.shared => VmaKind::SysvShm,
        // memfds and deleted files: their content becomes an object of the
        // image, mapped again from the restored copy.
        p if p.starts_with("/memfd:") || p.ends_with(" (deleted)") => {
            if m.shared {
                VmaKind::FileShared
            } else {
                VmaKind::FilePrivate
            }
        }
        p if p.starts_with('/') && m.shared => VmaKind::FileShared,
        p if p.starts_with('/') => VmaKind::FilePrivate,
        p => {
            return Err(unsupported(format!(
                "special mapping {p} at {:#x}",
                m.start
            )))
        }
    };
    let huge_page_size = if m.has_flag("ht") {
        let link = format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end);
        cr_sys::fdio::huge_page_size_at(std::path::Path::new(&link))
            .map_err(|e| CheckpointError::from_sys(pid, e))?
            .ok_or_else(|| {
                unsupported(format!(
                    "hugetlb mapping {:#x}-{:#x} {path} not on hugetlbfs",
                    m.start, m.end
                ))
            })?
    } else {
        0
    };
    Ok(Vma {
        start: m.start,
        end: m.end,
        prot: m.prot,
        shared: m.shared,
        kind,
        pgoff: m.offset,
        path: if kind.is_file()
            || matches!(kind, VmaKind::SysvShm | VmaKind::Aio | VmaKind::PacketRing)
        {
            path
        } else {
            String::new()
        },
        dev: ((m.dev_major as u64) << 32) | m.dev_minor as u64,
        inode: m.inode,
        vm_flags: m.vm_flags.clone(),
        anon_name,
        shm_owner: None,
        object: None,
        aio: None,
        guards: Vec::new(),
        huge_page_size,
        relink: None,
    })
}

/// The exact path of file mapping `m` of `pid`: its map_files link, or
/// the path /proc/PID/maps shows (newlines unescaped) if the link cannot
/// be read.
pub fn map_file_path(pid: i32, m: &MapEntry) -> String {
    proc::read_link(&format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end))
        .unwrap_or_else(|_| m.path.replace("\\012", "\n"))
}

/// How /proc shows anonymous hugetlb memory (MAP_HUGETLB), private or
/// shared.
const HUGE_ANON: &str = "/anon_hugepage (deleted)";

/// Whether the page with pagemap entry `pm` of a VMA of `kind` is stored.
fn stored(kind: VmaKind, pm: u64) -> bool {
    match kind {
        VmaKind::AnonPrivate | VmaKind::Heap | VmaKind::Stack => pm & (PM_PRESENT | PM_SWAP) != 0,
        // A present page still marked as a file page is the file's own.
        VmaKind::FilePrivate => (pm & PM_PRESENT != 0 && pm & PM_FILE == 0) || pm & PM_SWAP != 0,
        _ => false,
    }
}

/// Where the bytes of a run are read from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Src {
    /// process_vm_readv at the run's address.
    Vm,
    /// /proc/PID/mem: a VMA not readable by the process itself, or a page
    /// the process may share copy-on-write with another (see [`page_src`]).
    Forced,
    /// The shared memory object opened through /proc/PID/map_files (index
    /// into the open files), at object offset `src_off`.
    Shm(usize),
}

/// Where page `pm` (its pagemap entry) of a VMA read from `src` is read
/// from. A page that is not mapped by this process alone (a private page
/// shared copy-on-write with a parent or child since a fork), or that is
/// swapped out (it may be), is read through /proc/PID/mem: process_vm_readv
/// pins the pages it reads, and the kernel copies a shared anonymous page
/// for a read pin ("unshare", Linux 5.19+), which would end its sharing
/// in every process a checkpoint lets run on (see `cr_sys::mem`).
fn page_src(src: Src, pm: u64) -> Src {
    let maybe_shared = pm & PM_SWAP != 0 || (pm & PM_PRESENT != 0 && pm & PM_EXCLUSIVE == 0);
    if src == Src::Vm && maybe_shared {
        Src::Forced
    } else {
        src
    }
}

/// A run of pages to read.
struct Run {
    vaddr: u64,
    pages: u64,
    src: Src,
    src_off: u64,
}

/// Which pages were written since the parent image, as the tracker says.
pub enum Dirty {
    /// No tracker: every page is read (and compared by hash when there is
    /// a parent).
    Unknown,
    /// userfaultfd-wp: pages of `tracked` (sorted address ranges) outside
    /// `written` are unchanged. `written` also holds the pages that map
    /// the shared zero page (written or not), each range with its
    /// `PAGE_IS_*` categories (`cr_sys::dirty::scan_written_and_reset`).
    Uffd {
        tracked: Vec<(u64, u64)>,
        written: Vec<(u64, u64, u64)>,
    },
    /// Soft-dirty: a page whose pagemap entry lacks bit 55 is unchanged.
    SoftDirty,
}

/// Whether `addr` is in one of the sorted, disjoint `ranges`.
fn in_ranges(ranges: &[(u64, u64)], addr: u64) -> bool {
    let i = ranges.partition_point(|r| r.1 <= addr);
    ranges.get(i).is_some_and(|r| r.0 <= addr)
}

/// Whether `addr` is in one of the sorted, disjoint `written` ranges.
fn in_written(written: &[(u64, u64, u64)], addr: u64) -> bool {
    let i = written.partition_point(|r| r.1 <= addr);
    written.get(i).is_some_and(|r| r.0 <= addr)
}

impl Dirty {
    /// Whether the page at `addr` (pagemap entry `pm`) is known unchanged.
    fn clean(&self, addr: u64, pm: u64, zero_pfn: Option<u64>) -> bool {
        // The shared zero page after MADV_DONTNEED and a read keeps the
        // page's "clean" state while its content became zero.
        let zero = pm & PM_PRESENT != 0 && zero_pfn.is_some_and(|z| pm & PFN_MASK == z);
        // A swap entry whose type we cannot see (no CAP_SYS_ADMIN) may be a
        // pte marker over a page emptied by MADV_DONTNEED: read it.
        let known = pm & PM_PRESENT != 0 || pm & PFN_MASK != 0;
        if zero || !known {
            return false;
        }
        match self {
            Dirty::Unknown => false,
            Dirty::Uffd { tracked, written } => {
                in_ranges(tracked, addr) && !in_written(written, addr)
            }
            Dirty::SoftDirty => pm & PM_SOFT_DIRTY == 0,
        }
    }
}

/// One step of a process's memory, in address order.
enum Item {
    /// Pages known unchanged since the parent: their hashes are the
    /// parent's, copied from it only when the image is assembled (in
    /// [`copy`], once a checkpoint that continues has let the process run:
    /// 8 bytes a page, 8 MB at 4 GiB, not copied while it is frozen).
    Parent { vaddr: u64, pages: u64 },
    /// A run to read (index into the runs).
    Read(usize),
}

/// What became of the pages of one run that was read.
#[derive(Default)]
struct RunOut {
    /// The image's runs of these pages, merged as [`push_run`] merges them
    /// (consecutive pages stored one after the other in a block are one
    /// run): a few per run read, where one entry per page cost 24 bytes of
    /// every page dumped.
    runs: Vec<PageRun>,
    /// XXH3-64 of each page in the store or the parent, in order.
    hashes: Vec<u64>,
    /// Pages left out (all zero, or unreadable in a pre-dump) or all zero
    /// over a file page.
    zero: u64,
    parent: u64,
    stored: u64,
}

/// What a dump of one process reads, decided while it is frozen.
pub struct Plan {
    items: Vec<Item>,
    runs: Vec<Run>,
    files: Vec<File>,
    /// Bytes to read.
    pub bytes: u64,
    zero_pfn_pages: u64,
}

/// Append page `vaddr` (read from `src` at `src_off`) to the runs. A run
/// never crosses a VMA boundary (`vma_start`): restore makes each VMA
/// writable only while it fills that VMA.
fn read_page(p: &mut Plan, vma_start: u64, vaddr: u64, src: Src, src_off: u64) {
    let extends = p.runs.last().is_some_and(|r| {
        r.vaddr + r.pages * PAGE_SIZE == vaddr
            && r.vaddr >= vma_start
            && r.src_off + r.pages * PAGE_SIZE == src_off
            && r.pages < MAX_RUN_PAGES
            && r.src == src
    }) && matches!(p.items.last(), Some(Item::Read(i)) if *i == p.runs.len() - 1);
    if extends {
        if let Some(r) = p.runs.last_mut() {
            r.pages += 1;
        }
    } else {
        p.runs.push(Run {
            vaddr,
            pages: 1,
            src,
            src_off,
        });
        p.items.push(Item::Read(p.runs.len() - 1));
    }
    p.bytes += PAGE_SIZE;
}

/// Append the `n` pages from `page` on, unchanged since the parent (which
/// holds each of them), to the plan.
fn parent_pages(p: &mut Plan, page: u64, n: u64) {
    match p.items.last_mut() {
        Some(Item::Parent { vaddr, pages }) if *vaddr + *pages * PAGE_SIZE == page => *pages += n,
        _ => p.items.push(Item::Parent {
            vaddr: page,
            pages: n,
        }),
    }
}

/// The ranges of its object (byte offsets) each shared anonymous mapping
/// stores, by the mapping's start.
pub type ShmReads = std::collections::HashMap<u64, Vec<(u64, u64)>>;

/// Decide what to do with every page of `vmas` of `pid`: read it, or take
/// it from the parent. `shm`: what of its object each shared anonymous
/// mapping stores.
pub fn plan(
    pid: i32,
    vmas: &[Vma],
    shm: &ShmReads,
    parent: Option<&MemIndex<'_>>,
    dirty: &Dirty,
) -> Result<Plan, CheckpointError> {
    let sys = |e| CheckpointError::from_sys(pid, e);
    let pagemap = Pagemap::open(pid).map_err(sys)?;
    let zero_pfn = cr_sys::dirty::zero_pfn();
    let mut p = Plan {
        items: Vec::new(),
        runs: Vec::new(),
        files: Vec::new(),
        bytes: 0,
        zero_pfn_pages: 0,
    };
    let mut buf = vec![0u64; PAGEMAP_CHUNK as usize];
    // Addresses are visited in increasing order.
    let mut cursor = parent.map(|ix| ix.cursor());
    for v in vmas {
        if v.kind == VmaKind::AnonShared {
            // Read the object itself: it may hold pages this process never
            // touched (written by another process sharing it). Only what
            // no earlier mapping of it stores.
            let ranges = shm.get(&v.start).map_or(&[][..], Vec::as_slice);
            if ranges.is_empty() {
                continue;
            }
            let path = format!("/proc/{pid}/map_files/{:x}-{:x}", v.start, v.end);
            let f =
                File::open(&path).map_err(|source| sys(cr_sys::SysError::Io { path, source }))?;
            let fi = p.files.len();
            for &(ra, rb) in ranges {
                for (a, b) in cr_sys::mem::data_ranges(&f, ra, rb).map_err(sys)? {
                    let a = a & !(PAGE_SIZE - 1);
                    for off in (a..b).step_by(PAGE_SIZE as usize) {
                        read_page(&mut p, v.start, v.start + off - v.pgoff, Src::Shm(fi), off);
                    }
                }
            }
            p.files.push(f);
            continue;
        }
        if !v.kind.is_anon_private() && v.kind != VmaKind::FilePrivate {
            continue;
        }
        // Droppable memory (MAP_DROPPABLE) is what the kernel may free at
        // any time, as under memory pressure: not saved, it comes back
        // empty (as CRIU does; zdtm maps11 expects it).
        if v.has_flag("dp") {
            continue;
        }
        let src = if v.prot & libc::PROT_READ as u32 == 0 {
            Src::Forced
        } else {
            Src::Vm
        };
        if let (Some(c), Dirty::Uffd { tracked, written }) = (&mut cursor, dirty) {
            if v.kind.is_anon_private() && within(tracked, v.start, v.end) {
                plan_tracked(&mut p, pid, &pagemap, v, src, c, written)?;
                continue;
            }
        }
        let mut addr = v.start;
        while addr < v.end {
            let n = ((v.end - addr) / PAGE_SIZE).min(PAGEMAP_CHUNK);
            let entries = &mut buf[..n as usize];
            pagemap.read(addr, entries).map_err(sys)?;
            for (i, &pm) in entries.iter().enumerate() {
                // The tracker's mark on an empty page, or a guard region
                // (no page; reading it faults): nothing to keep.
                if !stored(v.kind, pm) || is_pte_marker(pm) || pm & PM_GUARD_REGION != 0 {
                    continue;
                }
                let page = addr + i as u64 * PAGE_SIZE;
                let anon = v.kind != VmaKind::FilePrivate;
                if anon && pm & PM_PRESENT != 0 && zero_pfn.is_some_and(|z| pm & PFN_MASK == z) {
                    p.zero_pfn_pages += 1;
                    continue; // the shared zero page: nothing to keep
                }
                let known = match &mut cursor {
                    Some(c) if dirty.clean(page, pm, zero_pfn) => c.hash_of(page).is_some(),
                    _ => false,
                };
                if known {
                    parent_pages(&mut p, page, 1);
                } else {
                    read_page(&mut p, v.start, page, page_src(src, pm), page);
                }
            }
            addr += n * PAGE_SIZE;
        }
    }
    Ok(p)
}

/// Whether `[start, end)` lies within one of the sorted, disjoint `ranges`.
fn within(ranges: &[(u64, u64)], start: u64, end: u64) -> bool {
    let i = ranges.partition_point(|r| r.1 <= start);
    ranges.get(i).is_some_and(|r| r.0 <= start && end <= r.1)
}

/// [`plan`] of anonymous VMA `v`, tracked as a whole by uffd-wp since the
/// parent image, stretch by stretch instead of page by page, so that a
/// freeze costs what changed, not the size of the memory:
///
/// - a page written since the parent (`written`, from the tracker's own
///   scan, with its categories) is read, or left out if it maps the shared
///   zero page;
/// - a hole (no page, no swap entry: found by one PAGEMAP_SCAN that
///   returns only those, as after MADV_DONTNEED) is left out: it reads
///   zero;
/// - any other page is unchanged: the parent's (its hash taken from the
///   parent when the image is assembled) or, where the parent holds
///   nothing, empty then and still: those stretches alone have their
///   categories scanned, and a present page is read (as [`plan`] would), a
///   swapped one (or a userfaultfd marker, which shows as swapped) left
///   out.
///
/// Only the pages read have their pagemap entries read (for [`page_src`]).
fn plan_tracked(
    p: &mut Plan,
    pid: i32,
    pagemap: &Pagemap,
    v: &Vma,
    src: Src,
    cursor: &mut cr_image::chain::MemCursor<'_, '_>,
    written: &[(u64, u64, u64)],
) -> Result<(), CheckpointError> {
    use cr_sys::dirty::{PAGE_IS_PFNZERO, PAGE_IS_PRESENT};
    let sys = |e| CheckpointError::from_sys(pid, e);
    let mut holes = Vec::new();
    cr_sys::dirty::scan_holes(pagemap.file(), pid, v.start, v.end, &mut holes).map_err(sys)?;
    let steps = tracked_steps(v, written, &holes, cursor);
    // The categories of the stretches the parent lacks, a scan per group
    // of them (those less than 2 MiB apart scanned as one).
    let mut held = Vec::new();
    let mut group: Option<(u64, u64)> = None;
    for &(a, b, _) in steps.iter().filter(|s| s.2 == Step::Gap) {
        match &mut group {
            Some(g) if a < g.1 + GAP_JOIN => g.1 = b,
            _ => {
                if let Some((ga, gb)) = group.replace((a, b)) {
                    cr_sys::dirty::scan_categories(pagemap.file(), pid, ga, gb, &mut held)
                        .map_err(sys)?;
                }
            }
        }
    }
    if let Some((ga, gb)) = group {
        cr_sys::dirty::scan_categories(pagemap.file(), pid, ga, gb, &mut held).map_err(sys)?;
    }
    for (a, b, step) in steps {
        match step {
            Step::Written(cat) if cat & PAGE_IS_PFNZERO != 0 => {
                p.zero_pfn_pages += (b - a) / PAGE_SIZE; // nothing to keep
            }
            Step::Written(_) => read_stretch(p, pid, pagemap, v, src, a, b)?,
            Step::Parent => parent_pages(p, a, (b - a) / PAGE_SIZE),
            Step::Gap => {
                let first = held.partition_point(|h: &(u64, u64, u64)| h.1 <= a);
                for &(ha, hb, cat) in held[first..].iter().take_while(|h| h.0 < b) {
                    let (s, e) = (ha.max(a), hb.min(b));
                    if cat & PAGE_IS_PFNZERO != 0 {
                        p.zero_pfn_pages += (e - s) / PAGE_SIZE;
                    } else if cat & PAGE_IS_PRESENT != 0 {
                        read_stretch(p, pid, pagemap, v, src, s, e)?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// Stretches the parent lacks closer than this are scanned as one.
const GAP_JOIN: u64 = 2 << 20;

/// What [`plan_tracked`] does with a stretch of pages.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Written since the parent (with its categories).
    Written(u64),
    /// Unchanged, and the parent holds every page of it.
    Parent,
    /// Unchanged or empty, and the parent holds none of it.
    Gap,
}

/// The stretches of tracked VMA `v`, in address order, with what to do
/// with each: the pages of `written` and those the parent holds, the rest
/// but the `holes` (left out: they are empty) as gaps.
fn tracked_steps(
    v: &Vma,
    written: &[(u64, u64, u64)],
    holes: &[(u64, u64)],
    cursor: &mut cr_image::chain::MemCursor<'_, '_>,
) -> Vec<(u64, u64, Step)> {
    let mut steps = Vec::new();
    let mut at = v.start;
    let mut wi = written.partition_point(|w| w.1 <= at);
    let mut hi = 0;
    while at < v.end {
        while written.get(wi).is_some_and(|w| w.1 <= at) {
            wi += 1;
        }
        while holes.get(hi).is_some_and(|h| h.1 <= at) {
            hi += 1;
        }
        if let Some(&(ws, we, cat)) = written.get(wi) {
            if ws <= at {
                let end = we.min(v.end);
                steps.push((at, end, Step::Written(cat)));
                at = end;
                continue;
            }
        }
        if let Some(&(hs, he)) = holes.get(hi) {
            if hs <= at {
                at = he.min(v.end);
                continue;
            }
        }
        let stop = v
            .end
            .min(written.get(wi).map_or(u64::MAX, |w| w.0))
            .min(holes.get(hi).map_or(u64::MAX, |h| h.0));
        while at < stop {
            match cursor.hashes_from(at) {
                Ok(hashes) => {
                    let n = (hashes.len() as u64).min((stop - at) / PAGE_SIZE);
                    steps.push((at, at + n * PAGE_SIZE, Step::Parent));
                    at += n * PAGE_SIZE;
                }
                Err(next) => {
                    let end = next.min(stop);
                    steps.push((at, end, Step::Gap));
                    at = end;
                }
            }
        }
    }
    steps
}

/// Read the pages `[start, end)` of `v` (where from depends on their
/// pagemap entries: see `page_src`).
fn read_stretch(
    p: &mut Plan,
    pid: i32,
    pagemap: &Pagemap,
    v: &Vma,
    src: Src,
    start: u64,
    end: u64,
) -> Result<(), CheckpointError> {
    let mut entries = Vec::new();
    let mut at = start;
    while at < end {
        let n = ((end - at) / PAGE_SIZE).min(PAGEMAP_CHUNK);
        entries.resize(n as usize, 0);
        pagemap
            .read(at, &mut entries)
            .map_err(|e| CheckpointError::from_sys(pid, e))?;
        for (k, &pm) in entries.iter().enumerate() {
            let q = at + k as u64 * PAGE_SIZE;
            read_page(p, v.start, q, page_src(src, pm), q);
        }
        at += n * PAGE_SIZE;
    }
    Ok(())
}

/// How the pages of one process are copied.
pub struct Copy<'a> {
    pub pid: i32,
    pub vmas: &'a [Vma],
    /// The process's memory in the parent image.
    pub parent: Option<&'a MemIndex<'a>>,
    pub store: &'a StoreWriter,
    /// The memory of the process's parent in the tree, stored before it in
    /// this image: a page with the same content at the same address is
    /// the page they share copy-on-write, and takes the parent's place in
    /// the store (what the restore shares again, `cow`), found whatever the
    /// store's bounded dedup cache remembers.
    pub kin: Option<&'a MemIndex<'a>>,
    pub workers: usize,
    /// The process runs meanwhile (pre-dump): pages that cannot be read
    /// any more are left out instead of failing the dump.
    pub live: bool,
    /// The pages were copied out while the process was frozen (see
    /// [`snapshot`]): they are taken from there, not from the process.
    pub snapshot: Option<(&'a Snapshot, &'a Arena)>,
}

/// The process's memory a plan names, copied out while it is frozen, so
/// it can run on while the pages are hashed, compared and written
/// (checkpoint-and-continue: the freeze is the copy).
pub struct Snapshot {
    pub region: Region,
    /// Where each run of the plan starts in the region.
    offsets: Vec<usize>,
    /// The runs copied through one window each (see [`pool::groups`]).
    windows: Vec<Range<usize>>,
}

/// Room for snapshots: a memfd whose pages are allocated before the tree
/// is frozen, so the freeze pays only the copy. The process's pages are
/// read straight into a window of it (one copy; see [`snapshot`]), and
/// hashed and stored from a window of it (see [`copy`]); each window is
/// unmapped once done, so at most [`pool::window_bytes`] per worker count
/// in the checkpointer's resident set (its peak RSS stays bounded at any
/// image size). The pages are still memory of the machine (shmem,
/// swappable) until they are stored: then they are freed. A process that
/// does not fit in what was reserved gets room added while the budget
/// lasts.
pub struct Arena {
    file: File,
    /// Bytes of `file` allocated.
    held: usize,
    /// Bytes of `file` handed out.
    used: usize,
    /// Most bytes held in all.
    budget: usize,
}

/// Bytes `len` at `start` of the arena's file.
#[derive(Debug, Clone, Copy)]
pub struct Region {
    start: usize,
    len: usize,
}

impl Arena {
    /// `reserve` bytes allocated now, at most `budget` in all.
    pub fn new(reserve: usize, budget: usize) -> std::io::Result<Arena> {
        let file = File::from(
            cr_sys::fdio::memfd_create("cr-snapshot", 0).map_err(std::io::Error::other)?,
        );
        let mut a = Arena {
            file,
            held: 0,
            used: 0,
            budget,
        };
        a.grow(reserve)?;
        Ok(a)
    }

    /// Allocate `more` bytes at the end of the file, written with zeros.
    /// (fallocate alone is not enough: shmem leaves the pages it allocates
    /// to be cleared at their first fault, which would then fall in the
    /// freeze, when a window over them is mapped.)
    fn grow(&mut self, more: usize) -> std::io::Result<()> {
        const CHUNK: usize = 1 << 20;
        let zeros = vec![0u8; CHUNK.min(more)];
        let end = self.held + more;
        let mut at = self.held;
        while at < end {
            let n = (end - at).min(CHUNK);
            self.file.write_all_at(&zeros[..n], at as u64)?;
            at += n;
        }
        self.held = end;
        Ok(())
    }

    /// Bytes allocated so far (reserved ahead, or added since).
    pub fn held(&self) -> usize {
        self.held
    }

    /// A region of `len` bytes, or None when the budget is spent.
    pub fn take(&mut self, len: usize) -> Option<Region> {
        let end = self.used + len;
        if end > self.held {
            if end > self.budget {
                return None;
            }
            self.grow(end - self.held).ok()?;
        }
        let r = Region {
            start: self.used,
            len,
        };
        self.used = end;
        Some(r)
    }

    /// Bytes `off..off + len` of region `r`, mapped (one worker's
    /// window: windows over the same bytes never live at once).
    fn window(&self, r: &Region, off: usize, len: usize) -> Result<FileWindow, CheckpointError> {
        debug_assert!(off + len <= r.len);
        FileWindow::map(
            &self.file,
            (r.start + off) as u64,
            len,
            "the snapshot memfd",
        )
        .map_err(CheckpointError::Sys)
    }

    /// Give bytes `off..off + len` of region `r` back to the machine: they
    /// are stored.
    fn free(&self, r: &Region, off: usize, len: usize) -> Result<(), CheckpointError> {
        cr_sys::fdio::punch_hole(
            self.file.as_fd(),
            (r.start + off) as u64,
            len as u64,
            "snapshot memfd",
        )
        .map_err(CheckpointError::Sys)
    }
}

/// Where group `g` of runs lies in the snapshot: (offset, bytes).
fn span(plan: &Plan, offsets: &[usize], g: &Range<usize>) -> (usize, usize) {
    let last = &plan.runs[g.end - 1];
    let end = offsets[g.end - 1] + (last.pages * PAGE_SIZE) as usize;
    (offsets[g.start], end - offsets[g.start])
}

/// Open /proc/PID/mem if a run of `plan` needs it.
fn procmem_for(pid: i32, plan: &Plan) -> Result<Option<ProcMem>, CheckpointError> {
    if plan.runs.iter().any(|r| r.src == Src::Forced) {
        Ok(Some(
            ProcMem::open(pid, false).map_err(|e| CheckpointError::from_sys(pid, e))?,
        ))
    } else {
        Ok(None)
    }
}

/// Read run `r` of `plan` into `b` (its length). In a live copy, pages that
/// cannot be read any more are cleared in `ok` instead of failing.
fn read_run(
    pid: i32,
    plan: &Plan,
    procmem: Option<&ProcMem>,
    r: &Run,
    b: &mut [u8],
    live: bool,
    ok: &mut [bool],
) -> Result<(), CheckpointError> {
    let read = |b: &mut [u8], vaddr: u64, src_off: u64| match (r.src, procmem) {
        (Src::Forced, Some(pm)) => pm.read(vaddr, b),
        (Src::Shm(f), _) => {
            plan.files[f]
                .read_exact_at(b, src_off)
                .map_err(|source| cr_sys::SysError::Io {
                    path: format!("shared memory at {vaddr:#x} of process {pid}"),
                    source,
                })
        }
        _ => read_vm(pid, vaddr, b),
    };
    if let Err(e) = read(b, r.vaddr, r.src_off) {
        if !live {
            return Err(CheckpointError::from_sys(pid, e));
        }
        // The process changed its mappings meanwhile: keep what can still
        // be read.
        for (k, page) in b.chunks_exact_mut(PAGE_SIZE as usize).enumerate() {
            let off = k as u64 * PAGE_SIZE;
            ok[k] = read(page, r.vaddr + off, r.src_off + off).is_ok();
        }
    }
    Ok(())
}

/// Copy what `plan` says must be read into `region` of `arena`, on the
/// worker pool, while the process is frozen: each worker maps a window of
/// the arena and reads runs of the process straight into it (one copy per
/// page), then unmaps it. `progress` gets the bytes copied so far.
pub fn snapshot(
    pid: i32,
    plan: &Plan,
    arena: &Arena,
    region: Region,
    workers: usize,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Snapshot, CheckpointError> {
    let procmem = procmem_for(pid, plan)?;
    let mut offsets = Vec::with_capacity(plan.runs.len());
    let mut off = 0;
    for r in &plan.runs {
        offsets.push(off);
        off += (r.pages * PAGE_SIZE) as usize;
    }
    let workers = if plan.bytes < pool::ONE_WORKER_BYTES {
        1
    } else {
        workers.max(1)
    };
    // Consecutive runs, at most a window's bytes together (a run alone may
    // fill one), each group copied through one mapped window.
    let windows = pool::groups(
        plan.runs.iter().map(|r| (r.pages * PAGE_SIZE) as usize),
        usize::MAX,
        pool::window_bytes(workers),
    );
    let next = AtomicUsize::new(0);
    let copied = AtomicU64::new(0);
    let half = plan.runs.len() / 2;
    pool::run(workers.min(windows.len().max(1)), |stop| {
        let mut ok = vec![true; MAX_RUN_PAGES as usize];
        while !stop.stopped() {
            let Some(g) = windows.get(next.fetch_add(1, Ordering::Relaxed)) else {
                return Ok::<(), CheckpointError>(());
            };
            if g.contains(&half) {
                fault::check("mid-memory")?;
            }
            let (at, len) = span(plan, &offsets, g);
            let mut w = arena.window(&region, at, len)?;
            let bytes = w.bytes_mut();
            for i in g.clone() {
                let r = &plan.runs[i];
                let b = &mut bytes[offsets[i] - at..][..(r.pages * PAGE_SIZE) as usize];
                read_run(pid, plan, procmem.as_ref(), r, b, false, &mut ok)?;
            }
            // Unmapped now: its pages leave our resident set.
            drop(w);
            let done = copied.fetch_add(len as u64, Ordering::Relaxed) + len as u64;
            progress(done);
        }
        Ok(())
    })?;
    Ok(Snapshot {
        region,
        offsets,
        windows,
    })
}

/// Hash, compare and store what `plan` says must be read (from the process,
/// or from its snapshot) and describe every page of the process.
/// `progress` gets the bytes done so far.
pub fn copy(
    a: &Copy<'_>,
    plan: Plan,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Memory, CheckpointError> {
    let pid = a.pid;
    let outcomes: Vec<Mutex<RunOut>> = plan
        .runs
        .iter()
        .map(|_| Mutex::new(RunOut::default()))
        .collect();
    let next = AtomicUsize::new(0);
    let copied = AtomicU64::new(0);
    let dups = AtomicU64::new(0);
    let procmem = match a.snapshot {
        Some(_) => None,
        None => procmem_for(pid, &plan)?,
    };
    let half = plan.runs.len() / 2;
    let file_private = |vaddr: u64| {
        let i = a.vmas.partition_point(|v| v.end <= vaddr);
        a.vmas
            .get(i)
            .is_some_and(|v| v.kind == VmaKind::FilePrivate)
    };
    // From a snapshot: the windows it was copied through, each mapped
    // again, hashed and stored in place, then freed. From the process:
    // one run at a time through a buffer per worker.
    let singles: Vec<Range<usize>>;
    let groups = match a.snapshot {
        Some((snap, _)) => &snap.windows,
        None => {
            singles = (0..plan.runs.len()).map(|i| i..i + 1).collect();
            &singles
        }
    };
    let workers = a.workers.min(groups.len().max(1));
    pool::run(workers, |stop| {
        let mut buf = match a.snapshot {
            Some(_) => Vec::new(),
            None => vec![0u8; (MAX_RUN_PAGES * PAGE_SIZE) as usize],
        };
        // Which pages of the run could be read (all of a snapshot's).
        let mut ok = vec![true; MAX_RUN_PAGES as usize];
        let mut block: Option<OpenBlock> = None;
        let result = (|| -> Result<(), CheckpointError> {
            while !stop.stopped() {
                let Some(g) = groups.get(next.fetch_add(1, Ordering::Relaxed)) else {
                    return Ok(());
                };
                let window = match a.snapshot {
                    Some((snap, arena)) => {
                        let (at, len) = span(&plan, &snap.offsets, g);
                        Some((arena.window(&snap.region, at, len)?, at, len))
                    }
                    None => None,
                };
                for i in g.clone() {
                    let r = &plan.runs[i];
                    let len = (r.pages * PAGE_SIZE) as usize;
                    let b: &[u8] = match (&window, a.snapshot) {
                        (Some((w, at, _)), Some((snap, _))) => {
                            &w.bytes()[snap.offsets[i] - at..][..len]
                        }
                        _ => {
                            if i == half {
                                fault::check("mid-memory")?;
                            }
                            let b = &mut buf[..len];
                            ok[..r.pages as usize].fill(true);
                            read_run(pid, &plan, procmem.as_ref(), r, b, a.live, &mut ok)?;
                            b
                        }
                    };
                    let mut out = RunOut {
                        hashes: Vec::with_capacity(r.pages as usize),
                        ..RunOut::default()
                    };
                    for (k, page) in b.chunks_exact(PAGE_SIZE as usize).enumerate() {
                        let vaddr = r.vaddr + k as u64 * PAGE_SIZE;
                        if !ok[k] {
                            out.zero += 1;
                        } else if is_zero(page) {
                            out.zero += 1;
                            if file_private(vaddr) {
                                push_run(&mut out.runs, vaddr, 1, PageAt::Zero);
                            }
                        } else {
                            let h = page_hash(page);
                            let h64 = h as u64;
                            out.hashes.push(h64);
                            if a.parent.and_then(|ix| ix.hash_of(vaddr)) == Some(h64) {
                                out.parent += 1;
                                push_run(&mut out.runs, vaddr, 1, PageAt::Parent);
                            } else {
                                let kin = a
                                    .kin
                                    .and_then(|ix| ix.stored_at(vaddr))
                                    .and_then(|(hk, loc)| (hk == h64).then_some(loc));
                                let (loc, dup) = match kin {
                                    Some(loc) => (loc, true),
                                    None => a.store.add(&mut block, h, page)?,
                                };
                                if dup {
                                    dups.fetch_add(1, Ordering::Relaxed);
                                }
                                out.stored += 1;
                                let at = PageAt::Store {
                                    block: loc.block,
                                    page: loc.page,
                                };
                                push_run(&mut out.runs, vaddr, 1, at);
                            }
                        }
                    }
                    *outcomes[i].lock().unwrap_or_else(|p| p.into_inner()) = out;
                    let done = copied.fetch_add(b.len() as u64, Ordering::Relaxed) + b.len() as u64;
                    progress(done);
                }
                if let (Some((w, at, len)), Some((snap, arena))) = (window, a.snapshot) {
                    // Stored: unmapped, and given back to the machine.
                    drop(w);
                    arena.free(&snap.region, at, len)?;
                }
            }
            Ok(())
        })();
        result.and_then(|()| a.store.close(block.take()).map_err(CheckpointError::from))
    })?;
    // Assemble the runs in address order.
    let mut mem = Memory {
        stats: MemStats {
            pages_zero: plan.zero_pfn_pages,
            pages_read: plan.bytes / PAGE_SIZE,
            pages_dup: dups.into_inner(),
            ..Default::default()
        },
        ..Default::default()
    };
    let (runs, hashes, stats) = (&mut mem.runs, &mut mem.hashes, &mut mem.stats);
    hashes.reserve(
        plan.items
            .iter()
            .map(|i| match i {
                Item::Parent { pages, .. } => *pages,
                Item::Read(r) => plan.runs[*r].pages,
            })
            .sum::<u64>() as usize,
    );
    let mut cursor = a.parent.map(|ix| ix.cursor());
    for item in &plan.items {
        match item {
            &Item::Parent { vaddr, pages } => {
                // The plan found every one of these pages in the parent.
                let lost = |at: u64| {
                    CheckpointError::Invalid(format!(
                        "the parent image holds no page at {at:#x} of process {pid} any more"
                    ))
                };
                let c = cursor.as_mut().ok_or_else(|| lost(vaddr))?;
                c.extend_hashes(vaddr, pages, hashes).map_err(lost)?;
                push_run(runs, vaddr, pages as u32, PageAt::Parent);
                stats.pages_parent += pages;
            }
            Item::Read(i) => {
                // Taken: each run's description is freed once copied.
                let out =
                    std::mem::take(&mut *outcomes[*i].lock().unwrap_or_else(|p| p.into_inner()));
                stats.pages_zero += out.zero;
                stats.pages_parent += out.parent;
                stats.pages_stored += out.stored;
                hashes.extend_from_slice(&out.hashes);
                for pr in out.runs {
                    push_run(runs, pr.vaddr, pr.pages, pr.at);
                }
            }
        }
    }
    // Duplicates were counted as stored pages too.
    stats.pages_stored -= stats.pages_dup.min(stats.pages_stored);
    Ok(mem)
}
