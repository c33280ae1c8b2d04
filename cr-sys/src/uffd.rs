//! userfaultfd for post-copy ("lazy") restore: the missing pages of a
//! restored process served on demand (`UFFDIO_COPY`, `UFFDIO_ZEROPAGE`)
//! from a userfaultfd created inside that process (by injected system
//! calls, see `cr_engine::kinds::memory::lazy`) and taken by the restorer.
//!
//! The userfaultfd is registered in missing mode on the process's private
//! anonymous mappings. The non-cooperative events (fork, mremap, madvise
//! DONTNEED/REMOVE, munmap) are asked for too: without them the kernel
//! silently drops the registration of a moved or forked mapping, whose
//! missing pages would then read as zeros, and a page dropped by the
//! program would be filled again with its old content. While such an event
//! is unread, `UFFDIO_COPY` fails with `EAGAIN` (the kernel's
//! `mmap_changing`): read the events, then retry.
//!
//! The write-protect trackers of incremental checkpoints are userfaultfds
//! too; their constants live in [`crate::dirty`].

use crate::error::{Errno, Result, SysError};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

pub use crate::dirty::{UFFDIO_API, UFFDIO_REGISTER, UFFD_API};

pub const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;
pub const UFFD_FEATURE_EVENT_FORK: u64 = 1 << 1;
pub const UFFD_FEATURE_EVENT_REMAP: u64 = 1 << 2;
pub const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
pub const UFFD_FEATURE_EVENT_UNMAP: u64 = 1 << 6;
/// What a post-copy userfaultfd asks for (see the module doc).
pub const LAZY_FEATURES: u64 = UFFD_FEATURE_EVENT_FORK
    | UFFD_FEATURE_EVENT_REMAP
    | UFFD_FEATURE_EVENT_REMOVE
    | UFFD_FEATURE_EVENT_UNMAP;

/// `_IOR(0xAA, 0x02, struct uffdio_range)` (16 bytes).
const UFFDIO_WAKE: u64 = 0x8010_aa02;
/// `_IOWR(0xAA, 0x03, struct uffdio_copy)` (40 bytes).
const UFFDIO_COPY: u64 = 0xc028_aa03;
/// `_IOWR(0xAA, 0x04, struct uffdio_zeropage)` (32 bytes).
const UFFDIO_ZEROPAGE: u64 = 0xc020_aa04;

const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
const UFFD_EVENT_FORK: u8 = 0x13;
const UFFD_EVENT_REMAP: u8 = 0x14;
const UFFD_EVENT_REMOVE: u8 = 0x15;
const UFFD_EVENT_UNMAP: u8 = 0x16;

/// One message read from a userfaultfd.
#[derive(Debug)]
pub enum Event {
    /// A thread waits for the page at `addr`.
    PageFault { addr: u64 },
    /// The process forked: `fd` (now an fd of the reader) serves the child.
    Fork { fd: OwnedFd },
    /// `[from, from+len)` moved to `to` (mremap).
    Remap { from: u64, to: u64, len: u64 },
    /// `[start, end)` was dropped (madvise DONTNEED/REMOVE) or unmapped:
    /// its pages are zero (or gone), never to be filled again.
    Remove { start: u64, end: u64 },
    /// A message of a kind we did not ask for.
    Other(u8),
}

/// How a `UFFDIO_COPY` or `UFFDIO_ZEROPAGE` ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fill {
    /// Every byte is in.
    Done,
    /// The first `n` bytes are in; the page after them already was there
    /// (`EEXIST`).
    Exists(u64),
    /// A non-cooperative event is unread (`EAGAIN`); `n` bytes went in.
    Again(u64),
    /// The process's memory is gone (`ESRCH`: it exited).
    Gone,
}

fn fill_result(r: i32, asked: u64, done: i64, what: impl FnOnce() -> String) -> Result<Fill> {
    if r == 0 {
        return Ok(Fill::Done);
    }
    let e = Errno::last();
    let done = done.max(0) as u64;
    match e.0 {
        libc::EEXIST => Ok(Fill::Exists(done)),
        libc::EAGAIN if done < asked => Ok(Fill::Again(done)),
        libc::EAGAIN => Ok(Fill::Done),
        libc::ESRCH => Ok(Fill::Gone),
        _ => Err(SysError::Syscall {
            what: what(),
            source: e,
        }),
    }
}

/// Put `src` at `dst` (page aligned, whole pages) in the registered
/// process, waking the threads that wait for it.
pub fn copy(fd: BorrowedFd<'_>, dst: u64, src: &[u8]) -> Result<Fill> {
    // struct uffdio_copy { dst, src, len, mode, copy (out) }
    let mut arg = [dst, src.as_ptr() as u64, src.len() as u64, 0, 0];
    // SAFETY: `arg` is a struct uffdio_copy; the kernel reads `src.len()`
    // bytes from `src`, which lives across the call, and writes only the
    // last field.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_COPY as _, arg.as_mut_ptr()) };
    fill_result(r, src.len() as u64, arg[4] as i64, || {
        format!("UFFDIO_COPY of {} bytes at {dst:#x}", src.len())
    })
}

/// Map zero pages at `[dst, dst+len)` in the registered process, waking
/// the threads that wait for them.
pub fn zeropage(fd: BorrowedFd<'_>, dst: u64, len: u64) -> Result<Fill> {
    // struct uffdio_zeropage { range { start, len }, mode, zeropage (out) }
    let mut arg = [dst, len, 0, 0];
    // SAFETY: `arg` is a struct uffdio_zeropage; the kernel writes only
    // its last field.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_ZEROPAGE as _, arg.as_mut_ptr()) };
    fill_result(r, len, arg[3] as i64, || {
        format!("UFFDIO_ZEROPAGE of {len} bytes at {dst:#x}")
    })
}

/// Wake the threads waiting for `[dst, dst+len)` (its pages are there).
pub fn wake(fd: BorrowedFd<'_>, dst: u64, len: u64) -> Result<()> {
    let mut arg = [dst, len];
    // SAFETY: `arg` is a struct uffdio_range the kernel only reads.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_WAKE as _, arg.as_mut_ptr()) };
    if r == 0 || Errno::last().0 == libc::ESRCH {
        return Ok(());
    }
    Err(SysError::Syscall {
        what: format!("UFFDIO_WAKE at {dst:#x}"),
        source: Errno::last(),
    })
}

/// Wait up to `timeout_ms` (-1: for ever) until one of `fds` has a
/// message; returns whether any has.
pub fn wait(fds: &[BorrowedFd<'_>], timeout_ms: i32) -> Result<bool> {
    let mut p: Vec<libc::pollfd> = fds
        .iter()
        .map(|f| libc::pollfd {
            fd: f.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    loop {
        // SAFETY: `p` is an array of `p.len()` pollfds the kernel fills.
        let r = unsafe { libc::poll(p.as_mut_ptr(), p.len() as _, timeout_ms) };
        if r >= 0 {
            return Ok(r > 0);
        }
        let e = Errno::last();
        if e.0 != libc::EINTR {
            return Err(SysError::Syscall {
                what: "poll of userfaultfds".into(),
                source: e,
            });
        }
    }
}

/// The messages waiting on `fd` (non-blocking: none when there are none).
pub fn read_events(fd: BorrowedFd<'_>, out: &mut Vec<Event>) -> Result<()> {
    const MSG: usize = 32;
    let mut buf = [0u8; MSG * 64];
    loop {
        // SAFETY: reads at most `buf.len()` bytes into `buf`.
        let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = Errno::last();
            return match e.0 {
                libc::EAGAIN => Ok(()),
                libc::EINTR => continue,
                _ => Err(SysError::Syscall {
                    what: "read of a userfaultfd".into(),
                    source: e,
                }),
            };
        }
        let n = n as usize;
        for m in buf[..n].chunks_exact(MSG) {
            let u64_at = |i: usize| u64::from_ne_bytes(m[i..i + 8].try_into().expect("8 bytes"));
            out.push(match m[0] {
                // struct uffd_msg: event (u8), 7 reserved bytes, then the
                // union at offset 8.
                UFFD_EVENT_PAGEFAULT => Event::PageFault { addr: u64_at(16) },
                UFFD_EVENT_FORK => {
                    let fd = i32::from_ne_bytes(m[8..12].try_into().expect("4 bytes"));
                    // SAFETY: the read just installed this fd in our
                    // table for us (msg.arg.fork.ufd); nobody else owns it.
                    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
                    Event::Fork { fd }
                }
                UFFD_EVENT_REMAP => Event::Remap {
                    from: u64_at(8),
                    to: u64_at(16),
                    len: u64_at(24),
                },
                UFFD_EVENT_REMOVE | UFFD_EVENT_UNMAP => Event::Remove {
                    start: u64_at(8),
                    end: u64_at(16),
                },
                k => Event::Other(k),
            });
        }
        if n < buf.len() {
            return Ok(());
        }
    }
}
