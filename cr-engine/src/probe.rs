//! Asking a frozen process what only it can tell (its brk, signal actions,
//! timers, per-thread addresses...): system calls injected into its threads
//! (`cr_sys::remote`), with one page of scratch memory mapped inside it for
//! their results. The page is unmapped when the probe is closed or dropped,
//! so a failed checkpoint leaves nothing behind in the process.

use cr_sys::error::Result;
use cr_sys::ptrace::Tracee;
use cr_sys::remote::{find_syscall_insn, Injector};
use cr_sys::{mem, PAGE_SIZE};

pub struct Probe<'a> {
    tracees: &'a mut [Tracee],
    ip: u64,
    scratch: Option<u64>,
}

impl<'a> Probe<'a> {
    /// Scratch bytes available to a query.
    pub const SCRATCH: u64 = PAGE_SIZE;

    /// A probe into the frozen threads `tracees` (the main thread first).
    pub fn open(tracees: &'a mut [Tracee]) -> Result<Probe<'a>> {
        let pid = tracees[0].tid();
        let ip = find_syscall_insn(pid)?;
        Ok(Probe {
            tracees,
            ip,
            scratch: None,
        })
    }

    pub fn pid(&self) -> i32 {
        self.tracees[0].tid()
    }

    /// The frozen threads, main first.
    pub fn tracees(&self) -> &[Tracee] {
        self.tracees
    }

    /// The scratch page in the process (mapped on first use).
    pub fn scratch(&mut self) -> Result<u64> {
        if let Some(s) = self.scratch {
            return Ok(s);
        }
        let mut inj = Injector::new(&mut self.tracees[0], self.ip)?;
        let s = inj.mmap_anon(0, Self::SCRATCH)?;
        inj.finish()?;
        self.scratch = Some(s);
        Ok(s)
    }

    /// Run `f` with injected system calls in thread `i` (0: the main one).
    pub fn on<R>(&mut self, i: usize, f: impl FnOnce(&mut Injector<'_>) -> Result<R>) -> Result<R> {
        let mut inj = Injector::new(&mut self.tracees[i], self.ip)?;
        let r = f(&mut inj)?;
        inj.finish()?;
        Ok(r)
    }

    /// One injected system call in the main thread.
    pub fn call(&mut self, name: &'static str, nr: i64, args: [u64; 6]) -> Result<u64> {
        self.on(0, |inj| inj.call(name, nr, args))
    }

    /// Bytes of the scratch page, from `off`.
    pub fn read(&mut self, off: u64, buf: &mut [u8]) -> Result<()> {
        let s = self.scratch()?;
        mem::read_vm(self.pid(), s + off, buf)
    }

    /// Unmap the scratch page.
    pub fn close(mut self) -> Result<()> {
        self.unmap()
    }

    /// Unmap the scratch page now (it is mapped again on next use): the
    /// process's mappings are read without it.
    pub fn unmap(&mut self) -> Result<()> {
        if let Some(s) = self.scratch.take() {
            self.call("munmap", libc::SYS_munmap, [s, Self::SCRATCH, 0, 0, 0, 0])?;
        }
        Ok(())
    }
}

impl Drop for Probe<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.unmap() {
            tracing::warn!(pid = self.pid(), error = %cr_sys::error::one_line(&e), "cannot unmap the probe's scratch page");
        }
    }
}

/// The little-endian u64 at word `i` of `raw`.
pub fn word(raw: &[u8], i: usize) -> u64 {
    raw.get(i * 8..i * 8 + 8)
        .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
}
