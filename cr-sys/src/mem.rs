//! Reading and writing another process's memory: process_vm_readv/writev
//! (fast, but only for pages the target may access itself) and
//! /proc/PID/mem (slower, but reaches PROT_NONE and read-only pages).
//!
//! The kernel surprises here: process_vm_readv *pins* the pages it reads
//! (FOLL_PIN), and since Linux 5.19 a read pin of an anonymous page that
//! may be shared copy-on-write (mapped by a parent and its forked
//! children) first gives the reader's target a private copy ("unshare",
//! so the pinned page cannot change under a later fork): reading the
//! memory of a process tree that runs on breaks its sharing, page by page
//! (its Pss grows to its Rss). /proc/PID/mem takes plain references
//! (FOLL_GET) and never copies: read such pages through [`ProcMem`].

use crate::error::{io_err, Errno, Result, SysError};
use nix::sys::uio::{process_vm_readv, process_vm_writev, RemoteIoVec};
use nix::unistd::Pid;
use std::fs::File;
use std::io::{IoSlice, IoSliceMut};
use std::os::unix::fs::FileExt;

/// Move `len` bytes between us and `addr` of process `pid`, one
/// process_vm_readv/writev (`op`) per `step(done)` until all moved; `step`
/// returns the bytes the call moved.
fn vm_loop(
    op: &'static str,
    pid: i32,
    addr: u64,
    len: usize,
    mut step: impl FnMut(usize) -> nix::Result<usize>,
) -> Result<()> {
    let mut done = 0usize;
    while done < len {
        match step(done) {
            Err(e) => {
                return Err(SysError::Memory {
                    op,
                    pid,
                    addr: addr + done as u64,
                    len: len - done,
                    source: e.into(),
                })
            }
            Ok(0) => {
                return Err(SysError::ShortMemory {
                    op,
                    pid,
                    addr,
                    done,
                    len,
                })
            }
            Ok(n) => done += n,
        }
    }
    Ok(())
}

/// The remote half of a transfer: `len` bytes at `addr` of the other process.
fn remote(addr: u64, len: usize) -> [RemoteIoVec; 1] {
    [RemoteIoVec {
        base: addr as usize,
        len,
    }]
}

/// Read `buf.len()` bytes at `addr` of process `pid` with process_vm_readv.
pub fn read_vm(pid: i32, addr: u64, buf: &mut [u8]) -> Result<()> {
    let len = buf.len();
    vm_loop("process_vm_readv", pid, addr, len, |done| {
        process_vm_readv(
            Pid::from_raw(pid),
            &mut [IoSliceMut::new(&mut buf[done..])],
            &remote(addr + done as u64, len - done),
        )
    })
}

/// Write `buf` at `addr` of process `pid` with process_vm_writev.
pub fn write_vm(pid: i32, addr: u64, buf: &[u8]) -> Result<()> {
    vm_loop("process_vm_writev", pid, addr, buf.len(), |done| {
        process_vm_writev(
            Pid::from_raw(pid),
            &[IoSlice::new(&buf[done..])],
            &remote(addr + done as u64, buf.len() - done),
        )
    })
}

/// /proc/PID/mem, which reads and writes regardless of page protection.
pub struct ProcMem {
    pid: i32,
    file: File,
}

impl ProcMem {
    pub fn open(pid: i32, write: bool) -> Result<Self> {
        let path = format!("/proc/{pid}/mem");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(write)
            .open(&path)
            .map_err(io_err(&path))?;
        Ok(ProcMem { pid, file })
    }

    pub fn read(&self, addr: u64, buf: &mut [u8]) -> Result<()> {
        self.file
            .read_exact_at(buf, addr)
            .map_err(|e| SysError::Memory {
                op: "read of /proc/PID/mem",
                pid: self.pid,
                addr,
                len: buf.len(),
                source: Errno(e.raw_os_error().unwrap_or(libc::EIO)),
            })
    }

    pub fn write(&self, addr: u64, buf: &[u8]) -> Result<()> {
        self.file
            .write_all_at(buf, addr)
            .map_err(|e| SysError::Memory {
                op: "write of /proc/PID/mem",
                pid: self.pid,
                addr,
                len: buf.len(),
                source: Errno(e.raw_os_error().unwrap_or(libc::EIO)),
            })
    }
}

/// Copy a string into a NUL-terminated byte vector.
pub fn cstring_bytes(s: &str) -> Vec<u8> {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    v
}

/// The data ranges (byte offsets) of a file within `[start, end)`, found with
/// SEEK_DATA/SEEK_HOLE; used on shared memory objects (tmpfs/shmem), where
/// holes are pages nobody ever wrote.
pub fn data_ranges(file: &File, start: u64, end: u64) -> Result<Vec<(u64, u64)>> {
    use crate::error::NixResult;
    use nix::unistd::{lseek, Whence};
    let seek = |off: u64, whence| lseek(file, off as i64, whence).map(|o| o as u64);
    let mut out = Vec::new();
    let mut off = start;
    while off < end {
        let data = match seek(off, Whence::SeekData) {
            Err(nix::errno::Errno::ENXIO) => break,
            r => r.or_sys(|| "lseek(SEEK_DATA)".into())?,
        };
        if data >= end {
            break;
        }
        let hole = seek(data, Whence::SeekHole).or_sys(|| "lseek(SEEK_HOLE)".into())?;
        out.push((data, hole.min(end)));
        off = hole;
    }
    Ok(out)
}

/// How fd `fd1` of `pid1` orders against fd `fd2` of `pid2` (kcmp
/// KCMP_FILE: Equal when they are the same open file description; the
/// kernel's order of the others is arbitrary but total, so descriptions can
/// be kept sorted and found by binary search).
pub fn file_order(pid1: i32, fd1: i32, pid2: i32, fd2: i32) -> Result<std::cmp::Ordering> {
    match kcmp_file(pid1, fd1, pid2, fd2)? {
        0 => Ok(std::cmp::Ordering::Equal),
        1 => Ok(std::cmp::Ordering::Less),
        2 => Ok(std::cmp::Ordering::Greater),
        r => Err(SysError::Syscall {
            what: format!("kcmp of fd {fd1} of {pid1} and fd {fd2} of {pid2} gave no order ({r})"),
            source: Errno(libc::EINVAL),
        }),
    }
}

/// Whether fd `fd1` of `pid1` and fd `fd2` of `pid2` are the same open file
/// description (kcmp KCMP_FILE).
pub fn same_file(pid1: i32, fd1: i32, pid2: i32, fd2: i32) -> Result<bool> {
    Ok(kcmp_file(pid1, fd1, pid2, fd2)? == 0)
}

/// Whether fd `fd` of `pid` is the file item `tfd` of epoll `epfd` (of
/// process `epid`) watches (kcmp KCMP_EPOLL_TFD): the item's file may be
/// open at another number than its key. `toff` picks among the items with
/// key `tfd` (several files added as the same number, closed between): the
/// kernel counts them in the order fdinfo lists them.
pub fn is_epoll_target(
    pid: i32,
    fd: i32,
    epid: i32,
    epfd: i32,
    tfd: i32,
    toff: u32,
) -> Result<bool> {
    const KCMP_EPOLL_TFD: i64 = 7;
    // struct kcmp_epoll_slot { __u32 efd, tfd, toff; }.
    let slot: [u32; 3] = [epfd as u32, tfd as u32, toff];
    // SAFETY: kcmp only reads the slot, which lives through the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            pid,
            epid,
            KCMP_EPOLL_TFD,
            fd as i64,
            slot.as_ptr(),
        )
    };
    if r < 0 {
        return Err(SysError::Syscall {
            what: format!("kcmp of fd {fd} of {pid} and item {tfd} of epoll {epfd} of {epid}"),
            source: Errno::last(),
        });
    }
    Ok(r == 0)
}

/// What two processes may share since a clone (kcmp types).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shared {
    /// The memory (CLONE_VM: a vfork child before its exec or exit).
    Vm = 1,
    /// The file descriptor table (CLONE_FILES).
    FdTable = 2,
    /// The working directory, root and umask (CLONE_FS).
    FsInfo = 3,
}

/// Whether processes `pid1` and `pid2` share `what` (kcmp KCMP_VM,
/// KCMP_FILES, KCMP_FS).
pub fn shares(pid1: i32, pid2: i32, what: Shared) -> Result<bool> {
    // SAFETY: kcmp takes only integers.
    let r = unsafe { libc::syscall(libc::SYS_kcmp, pid1, pid2, what as i64, 0i64, 0i64) };
    if r < 0 {
        return Err(SysError::Syscall {
            what: format!("kcmp ({what:?}) of processes {pid1} and {pid2}"),
            source: Errno::last(),
        });
    }
    Ok(r == 0)
}

fn kcmp_file(pid1: i32, fd1: i32, pid2: i32, fd2: i32) -> Result<i64> {
    const KCMP_FILE: i64 = 0;
    // Raw: nix has no kcmp.
    // SAFETY: kcmp takes only integers.
    let r = unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            pid1,
            pid2,
            KCMP_FILE,
            fd1 as i64,
            fd2 as i64,
        )
    };
    if r < 0 {
        return Err(SysError::Syscall {
            what: format!("kcmp of fd {fd1} of {pid1} and fd {fd2} of {pid2}"),
            source: Errno::last(),
        });
    }
    Ok(r)
}

/// A whole file mapped read-only (page stores are read from here straight
/// into the restored process).
pub struct FileMap {
    map: Option<memmap2::Mmap>,
}

impl FileMap {
    pub fn map(file: &File, path: &str) -> Result<Self> {
        let len = file.metadata().map_err(io_err(path))?.len();
        if len == 0 {
            return Ok(FileMap { map: None });
        }
        // SAFETY: image files are written once and then only read; a file
        // truncated under us would raise SIGBUS, which is the documented
        // risk of reading an image that is being deleted.
        let map = unsafe { memmap2::Mmap::map(file) }.map_err(io_err(path))?;
        Ok(FileMap { map: Some(map) })
    }

    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }

    /// Drop our page table entries for bytes `off..off + len` (widened to
    /// whole pages): the file's pages stay in the page cache, but no
    /// longer count in our resident set. A restore reading a store of any
    /// size through the map keeps its RSS bounded this way.
    pub fn release(&self, off: usize, len: usize) {
        let Some(map) = &self.map else {
            return;
        };
        let len = len.min(map.len().saturating_sub(off));
        if len == 0 {
            return;
        }
        // SAFETY: the map is a shared, read-only mapping of a file that is
        // only read. MADV_DONTNEED on such a mapping only zaps our page
        // table entries: the next access (a slice another thread still
        // holds included) faults the very same bytes back in from the
        // page cache, so no reference sees its memory change.
        // (memmap2 widens the start to its page; madvise the length.)
        let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, off, len) };
    }
}

/// Bytes of a file mapped shared and writable, every page faulted in at
/// once (MAP_POPULATE), and unmapped when dropped: a bounded window into a
/// large memfd, so that data can be copied into it without a buffer while
/// only the window counts in our resident set (memfd pages are shmem:
/// they count in RssShmem only while mapped).
pub struct FileWindow {
    map: memmap2::MmapMut,
}

impl FileWindow {
    /// Map bytes `off..off + len` of `file` (`off` a multiple of the page
    /// size, `len` > 0). For files private to this process (a memfd it
    /// created and never passes on) that stay at least `off + len` long
    /// while mapped; windows over one range must not be alive at once.
    pub fn map(file: &File, off: u64, len: usize, what: &str) -> Result<Self> {
        // SAFETY: the caller maps only a file of its own (a memfd no other
        // process holds) that is not truncated while the window lives, and
        // never two windows over the same bytes at once: the bytes behind
        // the slices handed out change only through them.
        let map = unsafe {
            memmap2::MmapOptions::new()
                .offset(off)
                .len(len)
                .populate()
                .map_mut(file)
        }
        .map_err(io_err(format!("window of {len} bytes at {off} of {what}")))?;
        Ok(FileWindow { map })
    }

    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }
}

/// Write several pieces into process `pid` with as few process_vm_writev
/// calls as possible: `(remote address, bytes)` pairs.
pub fn write_vm_many(pid: i32, pieces: &[(u64, &[u8])]) -> Result<()> {
    const IOV_MAX: usize = 1024;
    for chunk in pieces.chunks(IOV_MAX) {
        let local: Vec<IoSlice> = chunk.iter().map(|(_, b)| IoSlice::new(b)).collect();
        let remote: Vec<RemoteIoVec> = chunk
            .iter()
            .map(|(a, b)| RemoteIoVec {
                base: *a as usize,
                len: b.len(),
            })
            .collect();
        let want: usize = chunk.iter().map(|(_, b)| b.len()).sum();
        let r = process_vm_writev(Pid::from_raw(pid), &local, &remote);
        if r.map_or(true, |n| n < want) {
            // Short or failed: redo piece by piece for an exact error.
            for (a, b) in chunk {
                write_vm(pid, *a, b)?;
            }
        }
    }
    Ok(())
}

/// The mmap flags asking anonymous memory for huge pages of `page_size`
/// bytes (MAP_HUGETLB and the size's log2 in the MAP_HUGE_SHIFT bits);
/// 0 for base pages (`page_size` 0).
pub fn huge_mmap_flags(page_size: u64) -> i32 {
    if page_size == 0 {
        0
    } else {
        libc::MAP_HUGETLB | ((page_size.trailing_zeros() as i32) << libc::MAP_HUGE_SHIFT)
    }
}

/// The memfd_create flags asking for huge pages of `page_size` bytes
/// (MFD_HUGETLB, the size as for mmap); 0 for base pages.
pub fn huge_memfd_flags(page_size: u64) -> libc::c_uint {
    if page_size == 0 {
        0
    } else {
        libc::MFD_HUGETLB | (page_size.trailing_zeros() << libc::MFD_HUGE_SHIFT)
    }
}

/// A new shared anonymous memory object of `size` bytes (what
/// mmap(MAP_SHARED | MAP_ANONYMOUS) makes: shown as "/dev/zero (deleted)"
/// where it is mapped, or "/anon_hugepage (deleted)" with huge pages of
/// `huge_page_size` bytes), as an fd open read-write: mapped here, opened
/// through /proc/self/map_files, unmapped.
pub fn shmem_object(size: u64, huge_page_size: u64) -> Result<std::os::fd::OwnedFd> {
    let what = || {
        format!("mmap(MAP_SHARED | MAP_ANONYMOUS, {size} bytes, huge pages of {huge_page_size})")
    };
    // SAFETY: a new mapping at an address the kernel picks; no Rust
    // reference points into it, and it is unmapped below.
    let at = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size as usize,
            libc::PROT_NONE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS | huge_mmap_flags(huge_page_size),
            -1,
            0,
        )
    };
    if at == libc::MAP_FAILED {
        return Err(SysError::Io {
            path: what(),
            source: std::io::Error::last_os_error(),
        });
    }
    let start = at as u64;
    let path = format!("/proc/self/map_files/{start:x}-{:x}", start + size);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(io_err(&path));
    // SAFETY: the mapping made above, of that size, not used by anything.
    unsafe { libc::munmap(at, size as usize) };
    Ok(file?.into())
}
