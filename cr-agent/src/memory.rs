//! Memory capture: classify each VMA, decide page by page (pagemap) what
//! must be stored, and copy those pages into the page file with several
//! threads.
//!
//! Stored: pages a private mapping owns (present or swapped, and not the
//! file's own page), and the written pages of shared anonymous memory, read
//! from the shared object itself (/proc/PID/map_files, SEEK_DATA) once per
//! object: other processes mapping it refer to its first ("owner") mapping. Not stored:
//! untouched pages, file pages of private file mappings (the file has
//! them), shared file mappings (the file is the memory), and the kernel's
//! special mappings ([vdso], [vvar], [vsyscall]), which restore takes from
//! the new kernel.

use crate::{fault, CheckpointError};
use cr_image::{proto, PageWriter};
use cr_sys::mem::{read_vm, ProcMem};
use cr_sys::pagemap::{Pagemap, PM_FILE, PM_PRESENT, PM_SWAP};
use cr_sys::proc::{self, MapEntry};
use cr_sys::PAGE_SIZE;
use proto::VmaKind;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Largest run of pages copied (and checksummed) as one unit.
pub const MAX_RUN_PAGES: u64 = 256;
/// Pagemap entries read at once.
const PAGEMAP_CHUNK: u64 = 32 * 1024;

/// Classify a mapping, refusing the kinds this build cannot restore.
pub fn classify(pid: i32, m: &MapEntry) -> Result<proto::Vma, CheckpointError> {
    let unsupported = |what: String| CheckpointError::Unsupported { pid, what };
    let mut anon_name = String::new();
    // /proc/PID/maps escapes a newline in a path as "\012"; the map_files
    // link gives the exact path.
    let path = if m.path.starts_with('/') {
        proc::read_link(&format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end))
            .unwrap_or_else(|_| m.path.replace("\\012", "\n"))
    } else {
        m.path.clone()
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
        p if p.starts_with("/SYSV") => {
            return Err(unsupported(format!(
                "System V shared memory mapping at {:#x}",
                m.start
            )))
        }
        // memfds and deleted files: their content becomes an object of the
        // image (see capture), mapped again from the restored copy.
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
    Ok(proto::Vma {
        start: m.start,
        end: m.end,
        prot: m.prot,
        shared: m.shared,
        kind: kind as i32,
        pgoff: m.offset,
        path: if matches!(kind, VmaKind::FilePrivate | VmaKind::FileShared) {
            path
        } else {
            String::new()
        },
        dev: ((m.dev_major as u64) << 32) | m.dev_minor as u64,
        inode: m.inode,
        vm_flags: m.vm_flags.clone(),
        anon_name,
        shm_owner_pid: 0,
        shm_owner_start: 0,
        shm_owner_end: 0,
        object: 0,
    })
}

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
    /// /proc/PID/mem (VMA not readable by the process itself).
    Forced,
    /// The shared memory object opened through /proc/PID/map_files (index
    /// into the open files), at object offset `src_off`.
    Shm(usize),
}

/// A run of pages to copy, with its place in the page file.
struct Run {
    vaddr: u64,
    pages: u64,
    offset: u64,
    src: Src,
    src_off: u64,
}

/// Append page `vaddr` (read from `src` at `src_off`) to the runs. A run
/// never crosses a VMA boundary (`vma_start`): restore makes each VMA
/// writable only while it fills that VMA.
fn push_page(
    runs: &mut Vec<Run>,
    offset: &mut u64,
    vma_start: u64,
    vaddr: u64,
    src: Src,
    src_off: u64,
) {
    match runs.last_mut() {
        Some(r)
            if r.vaddr + r.pages * PAGE_SIZE == vaddr
                && r.vaddr >= vma_start
                && r.src_off + r.pages * PAGE_SIZE == src_off
                && r.pages < MAX_RUN_PAGES
                && r.src == src =>
        {
            r.pages += 1
        }
        _ => runs.push(Run {
            vaddr,
            pages: 1,
            offset: *offset,
            src,
            src_off,
        }),
    }
    *offset += PAGE_SIZE;
}

/// Plan the runs of all stored pages; returns them, the page file size and
/// the shared memory objects they read from.
fn plan(pid: i32, vmas: &[proto::Vma]) -> Result<(Vec<Run>, u64, Vec<File>), CheckpointError> {
    let sys = |e| CheckpointError::from_sys(pid, e);
    let pagemap = Pagemap::open(pid).map_err(sys)?;
    let mut runs: Vec<Run> = Vec::new();
    let mut files: Vec<File> = Vec::new();
    let mut offset = 0u64;
    let mut buf = vec![0u64; PAGEMAP_CHUNK as usize];
    for v in vmas {
        let kind = VmaKind::try_from(v.kind).unwrap_or(VmaKind::Unspecified);
        if kind == VmaKind::AnonShared {
            if v.shm_owner_pid != 0 {
                continue; // an earlier process holds these pages
            }
            // Read the object itself: it may hold pages this process never
            // touched (written by another process sharing it).
            let path = format!("/proc/{pid}/map_files/{:x}-{:x}", v.start, v.end);
            let f =
                File::open(&path).map_err(|source| sys(cr_sys::SysError::Io { path, source }))?;
            let len = v.end - v.start;
            for (a, b) in cr_sys::mem::data_ranges(&f, v.pgoff, v.pgoff + len).map_err(sys)? {
                let a = a & !(PAGE_SIZE - 1);
                for off in (a..b).step_by(PAGE_SIZE as usize) {
                    let vaddr = v.start + off - v.pgoff;
                    push_page(
                        &mut runs,
                        &mut offset,
                        v.start,
                        vaddr,
                        Src::Shm(files.len()),
                        off,
                    );
                }
            }
            files.push(f);
            continue;
        }
        if !matches!(
            kind,
            VmaKind::AnonPrivate | VmaKind::Heap | VmaKind::Stack | VmaKind::FilePrivate
        ) {
            continue;
        }
        let src = if v.prot & libc::PROT_READ as u32 == 0 {
            Src::Forced
        } else {
            Src::Vm
        };
        let mut addr = v.start;
        while addr < v.end {
            let n = ((v.end - addr) / PAGE_SIZE).min(PAGEMAP_CHUNK);
            let entries = &mut buf[..n as usize];
            pagemap.read(addr, entries).map_err(sys)?;
            for (i, &pm) in entries.iter().enumerate() {
                if stored(kind, pm) {
                    let page = addr + i as u64 * PAGE_SIZE;
                    push_page(&mut runs, &mut offset, v.start, page, src, page);
                }
            }
            addr += n * PAGE_SIZE;
        }
    }
    Ok((runs, offset, files))
}

/// Progress callback: bytes copied so far.
pub type Progress<'a> = &'a (dyn Fn(u64) + Sync);

/// Copy every stored page of `vmas` into `writer`; returns the page file
/// description parts (size and runs).
pub fn dump(
    pid: i32,
    vmas: &[proto::Vma],
    writer: &PageWriter,
    workers: usize,
    progress: Progress<'_>,
) -> Result<(u64, Vec<proto::PageExtent>), CheckpointError> {
    let (runs, size, files) = plan(pid, vmas)?;
    let hashes: Vec<AtomicU64> = runs.iter().map(|_| AtomicU64::new(0)).collect();
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let copied = AtomicU64::new(0);
    let first_error: Mutex<Option<CheckpointError>> = Mutex::new(None);
    let procmem = if runs.iter().any(|r| r.src == Src::Forced) {
        Some(ProcMem::open(pid, false).map_err(|e| CheckpointError::from_sys(pid, e))?)
    } else {
        None
    };
    let half = runs.len() / 2;
    let workers = workers.clamp(1, 64).min(runs.len().max(1));
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                let mut buf = vec![0u8; (MAX_RUN_PAGES * PAGE_SIZE) as usize];
                let result = (|| -> Result<(), CheckpointError> {
                    loop {
                        if failed.load(Ordering::Relaxed) {
                            return Ok(());
                        }
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(r) = runs.get(i) else { return Ok(()) };
                        if i == half {
                            fault::check("mid-memory")?;
                        }
                        let b = &mut buf[..(r.pages * PAGE_SIZE) as usize];
                        match (r.src, &procmem) {
                            (Src::Forced, Some(pm)) => pm.read(r.vaddr, b),
                            (Src::Shm(i), _) => {
                                files[i].read_exact_at(b, r.src_off).map_err(|source| {
                                    cr_sys::SysError::Io {
                                        path: format!(
                                            "shared memory at {:#x} of process {pid}",
                                            r.vaddr
                                        ),
                                        source,
                                    }
                                })
                            }
                            _ => read_vm(pid, r.vaddr, b),
                        }
                        .map_err(|e| CheckpointError::from_sys(pid, e))?;
                        hashes[i].store(cr_image::checksum(b), Ordering::Relaxed);
                        writer.write_at(r.offset, b)?;
                        let done =
                            copied.fetch_add(b.len() as u64, Ordering::Relaxed) + b.len() as u64;
                        progress(done);
                    }
                })();
                if let Err(e) = result {
                    failed.store(true, Ordering::Relaxed);
                    first_error.lock().expect("error slot").get_or_insert(e);
                }
            });
        }
    });
    if let Some(e) = first_error.into_inner().expect("error slot") {
        return Err(e);
    }
    let extents = runs
        .iter()
        .zip(&hashes)
        .map(|(r, h)| proto::PageExtent {
            vaddr: r.vaddr,
            nr_pages: r.pages as u32,
            offset: r.offset,
            xxh3: h.load(Ordering::Relaxed),
        })
        .collect();
    Ok((size, extents))
}
