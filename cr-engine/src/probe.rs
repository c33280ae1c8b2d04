//! Asking a frozen process what only it can tell (its brk, signal actions,
//! timers, per-thread addresses...): system calls injected into its threads
//! (`cr_sys::remote`), with one page of scratch memory mapped inside it for
//! their results. The page is unmapped when the probe is closed or dropped,
//! so a failed checkpoint leaves nothing behind in the process.
//!
//! [`Probe::calls`] asks several questions in one stop of the thread (see
//! `cr_sys::remote::Injector::batch`): the scratch memory is then two
//! pages, data and code, mapped read-write-executable. Not in a process
//! with a seccomp filter (which might refuse or kill for such a page), nor
//! in a thread whose SIGTRAP is ignored or pending; there, and with
//! `CR_BATCH_CALLS=0` in the environment, one call after the other, two
//! stops each.

use cr_sys::error::Result;
use cr_sys::ptrace::Tracee;
use cr_sys::remote::{find_syscall_insn, trap_free, Injector, BATCH_MAX};
use cr_sys::{mem, PAGE_SIZE};

pub struct Probe<'a> {
    tracees: &'a mut [Tracee],
    ip: u64,
    scratch: Option<u64>,
    /// The code page of batches, right after the scratch page (mapped
    /// with it).
    code: Option<u64>,
}

/// Whether batches may be used at all (`CR_BATCH_CALLS=0`: never).
pub(crate) fn batching_wanted() -> bool {
    std::env::var("CR_BATCH_CALLS").map_or(true, |v| v != "0")
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
            code: None,
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
        let pid = self.pid();
        let batches = batching_wanted() && trap_free(pid, pid);
        let mut inj = Injector::new(&mut self.tracees[0], self.ip)?;
        let rwx = (libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC) as u64;
        let flags = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64;
        let both = if batches {
            // Refused where W^X is enforced (MDWE, SELinux execmem): then
            // one page, no batches.
            let r = inj.syscall_raw(
                libc::SYS_mmap,
                [0, 2 * Self::SCRATCH, rwx, flags, u64::MAX, 0],
            )?;
            (r >= 0).then_some(r as u64)
        } else {
            None
        };
        let s = match both {
            Some(s) => s,
            None => inj.mmap_anon(0, Self::SCRATCH)?,
        };
        inj.finish()?;
        self.scratch = Some(s);
        self.code = both.map(|s| s + Self::SCRATCH);
        Ok(s)
    }

    /// Run `calls` (name, number, arguments) in thread `i` (0: the main
    /// one), each `-errno` an error naming it; their results. In as few
    /// stops as batches allow (see the module docs).
    pub fn calls(&mut self, i: usize, calls: &[(&'static str, i64, [u64; 6])]) -> Result<Vec<u64>> {
        let raw = self.calls_raw(i, calls)?;
        self.checked(i, calls, raw)
    }

    /// The raw results `raw` of `calls` made in thread `i`, each `-errno`
    /// an error naming its call (as [`Probe::calls`] answers).
    pub fn checked(
        &self,
        i: usize,
        calls: &[(&'static str, i64, [u64; 6])],
        raw: Vec<i64>,
    ) -> Result<Vec<u64>> {
        let pid = self.tracees[i].tid();
        calls
            .iter()
            .zip(raw)
            .map(|(c, r)| {
                if (-4095..0).contains(&r) {
                    Err(cr_sys::SysError::Remote {
                        name: c.0,
                        pid,
                        source: cr_sys::Errno(-r as i32),
                    })
                } else {
                    Ok(r as u64)
                }
            })
            .collect()
    }

    /// [`Probe::calls`], the raw results (`-errno` on failure).
    pub fn calls_raw(
        &mut self,
        i: usize,
        calls: &[(&'static str, i64, [u64; 6])],
    ) -> Result<Vec<i64>> {
        if calls.is_empty() {
            return Ok(Vec::new());
        }
        self.scratch()?;
        let pid = self.pid();
        let code = self.code.filter(|_| trap_free(pid, self.tracees[i].tid()));
        let mut inj = Injector::new(&mut self.tracees[i], self.ip)?;
        let mut out = Vec::with_capacity(calls.len());
        match code {
            Some(code) => {
                for chunk in calls.chunks(BATCH_MAX) {
                    let nrs: Vec<(i64, [u64; 6])> = chunk.iter().map(|c| (c.1, c.2)).collect();
                    out.extend(inj.batch(code, &nrs)?);
                }
            }
            None => {
                for c in calls {
                    out.push(inj.syscall_raw(c.1, c.2)?);
                }
            }
        }
        inj.finish()?;
        Ok(out)
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
            let len = match self.code.take() {
                Some(_) => 2 * Self::SCRATCH,
                None => Self::SCRATCH,
            };
            self.call("munmap", libc::SYS_munmap, [s, len, 0, 0, 0, 0])?;
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
