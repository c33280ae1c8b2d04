//! Dirty-page tracking: which pages a process wrote since a point in time.
//!
//! Two kernel mechanisms, detected at run time:
//!
//! - **userfaultfd write-protect, asynchronous** (`UFFD_FEATURE_WP_ASYNC`,
//!   Linux 6.7+): a userfaultfd created *inside* the process (by injected
//!   syscalls, see cr-agent's `tracking`) write-protects its anonymous
//!   memory; the first write to a page clears the protection in the kernel,
//!   without any fault reaching user space. `PAGEMAP_SCAN` with
//!   `PM_SCAN_WP_MATCHING` then lists the written pages and protects them
//!   again in one atomic step. Only VMAs registered with the userfaultfd
//!   (`uw` in smaps' VmFlags) are tracked: the kernel drops the registration
//!   of a VMA moved by mremap (we do not ask for `EVENT_REMAP`) and a new
//!   mapping starts unregistered, so both count as entirely written.
//! - **soft-dirty** (`CONFIG_MEM_SOFT_DIRTY`): writing "4" to
//!   `/proc/PID/clear_refs` clears the bits, pagemap bit 55 shows a written
//!   page, and new or moved VMAs are soft-dirty as a whole.
//!
//! Neither sees writes by a device through pinned pages (RDMA, io_uring
//! fixed buffers): such memory is written without a page fault.

use crate::error::{io_err, Errno, Result, SysError};
use crate::PAGE_SIZE;
use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::OnceLock;

/// userfaultfd(2) flags: user-mode faults only (allowed without
/// CAP_SYS_PTRACE even when vm.unprivileged_userfaultfd is 0).
pub const UFFD_USER_MODE_ONLY: u64 = 1;
pub const UFFD_API: u64 = 0xAA;
pub const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
pub const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;
/// The features our trackers ask for; a userfaultfd whose fdinfo shows
/// exactly these is taken for one of ours.
pub const TRACKER_FEATURES: u64 = UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED;
/// `_IOWR(0xAA, 0x3F, struct uffdio_api)` (24 bytes).
pub const UFFDIO_API: u64 = 0xc018_aa3f;
/// `_IOWR(0xAA, 0x00, struct uffdio_register)` (32 bytes).
pub const UFFDIO_REGISTER: u64 = 0xc020_aa00;
pub const UFFDIO_REGISTER_MODE_WP: u64 = 2;
/// `_IOR(0xAA, 0x01, struct uffdio_range)` (16 bytes).
const UFFDIO_UNREGISTER: u64 = 0x8010_aa01;

/// `_IOWR('f', 16, struct pm_scan_arg)` (96 bytes).
const PAGEMAP_SCAN: u64 = 0xc060_6610;
const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;
pub const PAGE_IS_WRITTEN: u64 = 1 << 1;
pub const PAGE_IS_PRESENT: u64 = 1 << 3;
pub const PAGE_IS_SWAPPED: u64 = 1 << 4;
pub const PAGE_IS_PFNZERO: u64 = 1 << 5;

#[repr(C)]
#[derive(Default)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}

/// The pages of `[start, end)` (one userfaultfd-registered VMA, or several
/// adjacent ones) written since the last scan, or mapping the shared zero
/// page, as ranges with their `PAGE_IS_*` categories (present or swapped,
/// written, shared zero page); the written ones are write-protected again
/// before the call returns. `pagemap` is the process's `/proc/PID/pagemap`.
/// Ranges are appended to `out`.
pub fn scan_written_and_reset(
    pagemap: &File,
    pid: i32,
    start: u64,
    end: u64,
    out: &mut Vec<(u64, u64, u64)>,
) -> Result<()> {
    scan(
        pagemap,
        pid,
        (start, end),
        PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC,
        Match {
            anyof: PAGE_IS_WRITTEN | PAGE_IS_PFNZERO,
            ..Match::default()
        },
        out,
    )
}

/// The pages of `[start, end)` that are present or swapped (or hold a
/// userfaultfd marker, which shows as swapped), as ranges with their
/// `PAGE_IS_*` categories (present, swapped, written, shared zero page),
/// appended to `out`; nothing is changed. One walk of the page tables that
/// returns ranges: cheaper than reading `/proc/PID/pagemap` page by page.
/// (It returns every such page, so it costs about 3 ns a page more than
/// [`scan_holes`], which returns what is seldom there.)
pub fn scan_categories(
    pagemap: &File,
    pid: i32,
    start: u64,
    end: u64,
    out: &mut Vec<(u64, u64, u64)>,
) -> Result<()> {
    scan(
        pagemap,
        pid,
        (start, end),
        0,
        Match {
            anyof: PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
            ..Match::default()
        },
        out,
    )
}

/// The pages of `[start, end)` that are neither present nor swapped (no
/// page, no swap entry, no userfaultfd marker: never touched, or emptied
/// by MADV_DONTNEED since), as ranges appended to `out`; nothing is
/// changed. The page tables are walked as by [`scan_categories`], but only
/// these holes are returned: over memory that is all there, it costs what
/// the dirty tracker's own scan costs.
pub fn scan_holes(
    pagemap: &File,
    pid: i32,
    start: u64,
    end: u64,
    out: &mut Vec<(u64, u64)>,
) -> Result<()> {
    let mut regions = Vec::new();
    scan(
        pagemap,
        pid,
        (start, end),
        0,
        Match {
            inverted: PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
            all: PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
            anyof: 0,
        },
        &mut regions,
    )?;
    for (a, b, _) in regions {
        match out.last_mut() {
            Some(last) if last.1 == a => last.1 = b,
            _ => out.push((a, b)),
        }
    }
    Ok(())
}

/// Which pages a PAGEMAP_SCAN returns: those whose categories, with the
/// `inverted` ones flipped, include all of `all` and (unless 0) any of
/// `anyof`.
#[derive(Default, Clone, Copy)]
struct Match {
    inverted: u64,
    all: u64,
    anyof: u64,
}

/// PAGEMAP_SCAN of `range` with `flags`: the pages `m` matches, as
/// (start, end, categories) ranges (categories among present, swapped,
/// written and shared zero page).
fn scan(
    pagemap: &File,
    pid: i32,
    (start, end): (u64, u64),
    flags: u64,
    m: Match,
    out: &mut Vec<(u64, u64, u64)>,
) -> Result<()> {
    let mut regions = vec![PageRegion::default(); 4096];
    let mut at = start;
    // Pages below this were reported already.
    let mut covered = start;
    while at < end {
        let mut arg = PmScanArg {
            size: std::mem::size_of::<PmScanArg>() as u64,
            flags,
            start: at,
            end,
            vec: regions.as_mut_ptr() as u64,
            vec_len: regions.len() as u64,
            category_inverted: m.inverted,
            category_mask: m.all,
            category_anyof_mask: m.anyof,
            return_mask: PAGE_IS_PRESENT | PAGE_IS_SWAPPED | PAGE_IS_WRITTEN | PAGE_IS_PFNZERO,
            ..Default::default()
        };
        // Raw: nix has no PAGEMAP_SCAN.
        // SAFETY: `arg` is a pm_scan_arg of the size it declares; `vec`
        // points to `vec_len` page_region structs we own, which the kernel
        // fills.
        let n = unsafe { libc::ioctl(pagemap.as_raw_fd(), PAGEMAP_SCAN as _, &mut arg) };
        if n < 0 {
            return Err(SysError::Syscall {
                what: format!("PAGEMAP_SCAN of {start:#x}-{end:#x} of process {pid}"),
                source: Errno::last(),
            });
        }
        for r in &regions[..n as usize] {
            let a = r.start.max(covered);
            if r.end <= a {
                continue;
            }
            match out.last_mut() {
                Some(last) if last.1 == a && last.2 == r.categories => last.1 = r.end,
                _ => out.push((a, r.end, r.categories)),
            }
            covered = r.end;
        }
        // The kernel (6.18) may report a walk_end short of the ranges it
        // returned (seen when its own buffer filled during the walk): the
        // next call starts after both, and what is reported again is
        // dropped above.
        let next = arg.walk_end.max(covered);
        if next <= at {
            break;
        }
        at = next;
    }
    Ok(())
}

/// Remove the registration of `[start, end)` with the userfaultfd `uffd`,
/// which may be a copy of one held by another process (the kernel acts on
/// the memory of the process that created it). The kernel removes the
/// write protection from every page of the range meanwhile, holding that
/// process's mmap lock: a range of a few tens of MiB at a time keeps its
/// page faults from waiting long. A range registered with another
/// userfaultfd is refused (EINVAL, Linux 6.15+), as one that holds a
/// mapping that cannot be registered.
pub fn unregister(uffd: BorrowedFd<'_>, start: u64, end: u64) -> Result<()> {
    let mut range = [start, end - start];
    // Raw: nix has no userfaultfd ioctls.
    // SAFETY: `range` is a struct uffdio_range (two u64s) the kernel reads.
    let r = unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_UNREGISTER as _, range.as_mut_ptr()) };
    if r < 0 {
        return Err(SysError::Syscall {
            what: format!("UFFDIO_UNREGISTER of {start:#x}-{end:#x}"),
            source: Errno::last(),
        });
    }
    Ok(())
}

/// Whether the kernel has PAGEMAP_SCAN (probed once on our own pagemap).
pub fn pagemap_scan_supported() -> bool {
    static S: OnceLock<bool> = OnceLock::new();
    *S.get_or_init(|| {
        let Ok(f) = File::open("/proc/self/pagemap") else {
            return false;
        };
        let mut arg = PmScanArg {
            size: std::mem::size_of::<PmScanArg>() as u64,
            category_mask: PAGE_IS_WRITTEN,
            return_mask: PAGE_IS_WRITTEN,
            ..Default::default()
        };
        // SAFETY: an empty range with no output vector: the kernel only
        // validates the argument.
        let r = unsafe { libc::ioctl(f.as_raw_fd(), PAGEMAP_SCAN as _, &mut arg) };
        r >= 0
    })
}

/// Whether userfaultfd offers asynchronous write-protect (probed once by
/// creating one in this process; the userfaultfd is closed again).
pub fn uffd_wp_async_supported() -> bool {
    static S: OnceLock<bool> = OnceLock::new();
    *S.get_or_init(|| {
        // Raw: nix has neither userfaultfd nor its ioctls.
        // SAFETY: userfaultfd takes only flags.
        let r = unsafe {
            libc::syscall(
                libc::SYS_userfaultfd,
                libc::O_CLOEXEC | libc::O_NONBLOCK | UFFD_USER_MODE_ONLY as i32,
            )
        };
        // Closed when dropped.
        let Ok(fd) = crate::fdio::own(r, String::new) else {
            return false;
        };
        let mut api = [UFFD_API, TRACKER_FEATURES, 0u64];
        // SAFETY: `api` is a struct uffdio_api (three u64s) the kernel fills.
        let r = unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API as _, api.as_mut_ptr()) };
        r == 0 && api[1] & TRACKER_FEATURES == TRACKER_FEATURES && pagemap_scan_supported()
    })
}

/// Whether fd `fd` of `pid` is a userfaultfd with exactly our trackers'
/// features (from its fdinfo `API:` line).
pub fn is_tracker_fd(pid: i32, fd: i32) -> bool {
    let Ok(info) = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")) else {
        return false;
    };
    info.lines()
        .find_map(|l| l.strip_prefix("API:"))
        .and_then(|v| v.trim().split(':').nth(1).map(str::to_string))
        .and_then(|f| u64::from_str_radix(&f, 16).ok())
        // The kernel adds UFFD_FEATURE_INITIALIZED (bit 31) once UFFDIO_API ran.
        .is_some_and(|f| f & !(1 << 31) == TRACKER_FEATURES)
}

/// Pagemap bit of a soft-dirty page.
pub const PM_SOFT_DIRTY: u64 = crate::pagemap::PM_SOFT_DIRTY;

/// Whether the kernel keeps soft-dirty bits (probed once on a page of our
/// own: cleared, written, and read back from pagemap).
pub fn soft_dirty_supported() -> bool {
    static S: OnceLock<bool> = OnceLock::new();
    *S.get_or_init(|| probe_soft_dirty().unwrap_or(false))
}

fn probe_soft_dirty() -> Result<bool> {
    let mut page = vec![0u8; 2 * PAGE_SIZE as usize];
    let addr = (page.as_ptr() as u64).next_multiple_of(PAGE_SIZE);
    let off = (addr - page.as_ptr() as u64) as usize;
    page[off] = 1;
    clear_soft_dirty(std::process::id() as i32)?;
    let pm = crate::pagemap::Pagemap::open(std::process::id() as i32)?;
    let mut e = [0u64];
    pm.read(addr, &mut e)?;
    let before = e[0] & PM_SOFT_DIRTY != 0;
    // SAFETY: a volatile write to memory we own (so it is not elided).
    unsafe { std::ptr::write_volatile(page.as_mut_ptr().add(off), 2) };
    pm.read(addr, &mut e)?;
    Ok(!before && e[0] & PM_SOFT_DIRTY != 0)
}

/// Clear the soft-dirty bits of every page of `pid`.
pub fn clear_soft_dirty(pid: i32) -> Result<()> {
    let path = format!("/proc/{pid}/clear_refs");
    std::fs::write(&path, b"4").map_err(io_err(path))
}

/// The physical frame of the shared zero page (needs CAP_SYS_ADMIN to
/// read PFNs; None otherwise). Probed once on a page of our own that was
/// only read.
pub fn zero_pfn() -> Option<u64> {
    static S: OnceLock<Option<u64>> = OnceLock::new();
    *S.get_or_init(|| {
        // A fresh private anonymous mapping of our own (unmapped on drop).
        let map = memmap2::MmapOptions::new()
            .len(2 * PAGE_SIZE as usize)
            .map_anon()
            .ok()?;
        // A read (never a write) maps the zero page; black_box keeps it.
        std::hint::black_box(map[0]);
        let pfn = crate::pagemap::Pagemap::open(std::process::id() as i32)
            .and_then(|pm| {
                let mut e = [0u64];
                pm.read(map.as_ptr() as u64, &mut e)?;
                Ok(e[0])
            })
            .ok()
            .filter(|e| e & crate::pagemap::PM_PRESENT != 0)
            .map(|e| e & crate::pagemap::PFN_MASK)
            .filter(|&pfn| pfn != 0);
        drop(map);
        pfn
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The probes answer without error on any kernel (what they answer
    /// depends on it).
    #[test]
    fn probes_run() {
        eprintln!(
            "pagemap_scan {} uffd_wp_async {} soft_dirty {} zero_pfn {:?}",
            pagemap_scan_supported(),
            uffd_wp_async_supported(),
            soft_dirty_supported(),
            zero_pfn()
        );
    }

    /// The holes of a mapping are the pages never touched and those
    /// emptied by MADV_DONTNEED; the categories scan returns the others.
    #[test]
    fn holes_and_categories_split_a_mapping() {
        if !pagemap_scan_supported() {
            eprintln!("no PAGEMAP_SCAN: skipped");
            return;
        }
        let n = 16usize;
        let mut map = memmap2::MmapOptions::new()
            .len(n * PAGE_SIZE as usize)
            .map_anon()
            .expect("anonymous mapping");
        let base = map.as_ptr() as u64;
        // Pages 0-5 written, 6-7 never touched, 8-11 written, 12-15 never.
        for k in (0..6).chain(8..12) {
            map[k * PAGE_SIZE as usize] = 1;
        }
        // Page 3 emptied again.
        // SAFETY: one page of our own mapping, which nothing refers to.
        let r = unsafe {
            libc::madvise(
                map.as_mut_ptr().add(3 * PAGE_SIZE as usize).cast(),
                PAGE_SIZE as usize,
                libc::MADV_DONTNEED,
            )
        };
        assert_eq!(r, 0, "madvise");
        let pm = File::open("/proc/self/pagemap").expect("own pagemap");
        let page = |k: u64| base + k * PAGE_SIZE;
        let mut holes = Vec::new();
        scan_holes(&pm, 0, base, page(n as u64), &mut holes).expect("scan_holes");
        assert_eq!(
            holes,
            vec![(page(3), page(4)), (page(6), page(8)), (page(12), page(16))]
        );
        let mut held = Vec::new();
        scan_categories(&pm, 0, base, page(n as u64), &mut held).expect("scan_categories");
        let held: Vec<_> = held.iter().map(|&(a, b, _)| (a, b)).collect();
        assert_eq!(
            held,
            vec![(page(0), page(3)), (page(4), page(6)), (page(8), page(12))]
        );
        drop(map);
    }
}
