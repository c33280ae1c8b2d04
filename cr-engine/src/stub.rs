//! A process being rebuilt by a restore: a stub (our clone with the saved
//! PID) driven by injected system calls, with a scratch area of its own for
//! their memory arguments (see `restore`).
//!
//! Calls whose results are not needed may be queued ([`Stub::later`]) and
//! run together in one stop ([`Stub::flush`], with
//! `cr_sys::remote::Injector::batch`) when the stub has a code page for
//! batches ([`Stub::code`]) and is `trap_free`; else one after the other.

use cr_sys::error::{Errno, Result, SysError};
use cr_sys::mem;
use cr_sys::remote::{trap_free, Arg, Injector, BATCH_LINKS_MAX, BATCH_MAX};

/// Scratch memory for syscall arguments inside the stub.
pub const SCRATCH: u64 = 64 * 1024;
/// The last bytes of the scratch area hold per-thread arguments (the largest:
/// supplementary groups).
pub const THREAD_ARGS: u64 = 12 * 1024;

pub struct Stub<'a> {
    pub inj: Injector<'a>,
    pub pid: i32,
    /// The scratch area (0 until mapped).
    pub scratch: u64,
    cursor: u64,
    /// The stub's fd number of a pidfd of the restorer (see [`Stub::grab`]).
    pub grab_pidfd: Option<u64>,
    /// A page of the stub, executable and writable, where batches of
    /// queued calls run (None: no batches, see `memory::map_scratch`).
    pub code: Option<u64>,
    /// Calls queued by [`Stub::later`], not run yet.
    queue: Vec<Queued>,
    /// Of their arguments, how many are results of queued calls.
    links: usize,
    /// The lowest offset in the scratch area a queued call's argument
    /// points to (what [`Stub::put`] must not overwrite before the queue
    /// is run).
    queued_lo: Option<u64>,
}

/// Whether a call may run in a batch after queued ones ([`Stub::call`]):
/// not one that makes a task (the batch does not follow it), nor one that
/// sends a signal or changes a signal's action (SIGTRAP's would matter
/// to the batch's `int3`), nor one that changes memory mappings (the
/// batch's code page is among them) or installs a seccomp filter.
fn batchable(nr: i64, args: [u64; 6]) -> bool {
    const NOT: &[i64] = &[
        libc::SYS_clone,
        libc::SYS_clone3,
        libc::SYS_fork,
        libc::SYS_vfork,
        libc::SYS_execve,
        libc::SYS_execveat,
        libc::SYS_rt_sigaction,
        libc::SYS_kill,
        libc::SYS_tkill,
        libc::SYS_tgkill,
        libc::SYS_rt_sigqueueinfo,
        libc::SYS_rt_tgsigqueueinfo,
        libc::SYS_seccomp,
        libc::SYS_munmap,
        libc::SYS_mremap,
        libc::SYS_mprotect,
    ];
    let seccomp = nr == libc::SYS_prctl && args[0] == libc::PR_SET_SECCOMP as u64;
    !(NOT.contains(&nr) || seccomp)
}

/// A call queued by [`Stub::later`].
struct Queued {
    name: &'static str,
    nr: i64,
    args: [Arg; 6],
    /// What a failure means, for its error.
    what: String,
}

impl<'a> Stub<'a> {
    pub fn new(inj: Injector<'a>) -> Stub<'a> {
        Stub {
            pid: inj.pid(),
            inj,
            scratch: 0,
            cursor: 0,
            grab_pidfd: None,
            code: None,
            queue: Vec::new(),
            links: 0,
            queued_lo: None,
        }
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Run a call now, after the queued ones (in their batch, when they
    /// make one); its result.
    pub fn call(&mut self, name: &'static str, nr: i64, args: [u64; 6]) -> Result<u64> {
        if self.queue.is_empty() || !batchable(nr, args) {
            self.flush()?;
            return self.inj.call(name, nr, args);
        }
        self.queue.push(Queued {
            name,
            nr,
            args: args.map(Arg::Val),
            what: String::new(),
        });
        let r = self.run_queue(true)?;
        if (-4095..0).contains(&r) {
            return Err(SysError::Remote {
                name,
                pid: self.pid,
                source: Errno(-r as i32),
            });
        }
        Ok(r as u64)
    }

    /// Queue a call whose result is not needed (but for its failure): it
    /// runs at the next [`Stub::flush`] (or [`Stub::call`], or when the
    /// queue is full), its failure then an error naming it as
    /// [`Stub::call`]'s, after `what` (what it was for). Its memory
    /// arguments must be in the scratch area ([`Stub::put`]) or stay as
    /// they are until then. Not for a call that creates a task (clone).
    /// A kind that queues calls flushes before it returns.
    pub fn later(
        &mut self,
        name: &'static str,
        nr: i64,
        args: [u64; 6],
        what: String,
    ) -> Result<()> {
        self.later_linked(&[(name, nr, args.map(Arg::Val))], what)
    }

    /// Queue calls as [`Stub::later`] does, in one batch (the queue is
    /// run first when they would not fit in it): an argument
    /// [`Arg::ResultOf`]`(k)` is the result of call `k` of `calls`, e.g.
    /// the fd an earlier one returned. At most [`BATCH_LINKS_MAX`] such
    /// arguments.
    pub fn later_linked(
        &mut self,
        calls: &[(&'static str, i64, [Arg; 6])],
        what: String,
    ) -> Result<()> {
        let links = calls
            .iter()
            .flat_map(|(_, _, a)| a.iter())
            .filter(|a| matches!(a, Arg::ResultOf(_)))
            .count();
        assert!(
            calls.len() <= BATCH_MAX && links <= BATCH_LINKS_MAX,
            "a group of {} calls with {links} links",
            calls.len()
        );
        if self.queue.len() + calls.len() > BATCH_MAX || self.links + links > BATCH_LINKS_MAX {
            self.flush()?;
        }
        let base = self.queue.len();
        let area = self.scratch..self.scratch + SCRATCH - THREAD_ARGS;
        for &(name, nr, args) in calls {
            for a in args.iter() {
                if let Arg::Val(a) = *a {
                    if self.scratch != 0 && area.contains(&a) {
                        let off = a - self.scratch;
                        self.queued_lo = Some(self.queued_lo.map_or(off, |lo| lo.min(off)));
                    }
                }
            }
            let args = args.map(|a| match a {
                Arg::ResultOf(k) => Arg::ResultOf(base + k),
                v => v,
            });
            self.queue.push(Queued {
                name,
                nr,
                args,
                what: what.clone(),
            });
        }
        self.links += links;
        if self.queue.len() == BATCH_MAX {
            self.flush()?;
        }
        Ok(())
    }

    /// Run the queued calls, in order: in one stop when the stub can run a
    /// batch (a code page, SIGTRAP neither ignored nor pending), else one
    /// after the other. The first that failed is the error (with a batch,
    /// the ones after it ran too; a failed restore kills the stub anyway).
    pub fn flush(&mut self) -> Result<()> {
        if !self.queue.is_empty() {
            self.run_queue(false)?;
        }
        Ok(())
    }

    /// Hand the stub over to another thread of ours (its queued calls run
    /// first): see `Injector::park`. Until [`Stub::unpark`] by the thread
    /// that goes on with it, nothing may be injected.
    pub fn park(&mut self) -> Result<()> {
        self.flush()?;
        self.inj.park()
    }

    /// Take a stub parked by another thread, traced by this one with
    /// `options` (`kinds::tree::restore::stub_options`).
    pub fn unpark(&mut self, options: u64) -> Result<()> {
        self.inj.unpark(options)
    }

    /// Run the queue (not empty); the raw result of its last call, whose
    /// failure is left to the caller when it is `call`'s.
    fn run_queue(&mut self, last_is_call: bool) -> Result<i64> {
        self.queued_lo = None;
        self.links = 0;
        let queue = std::mem::take(&mut self.queue);
        let code = self
            .code
            .filter(|_| queue.len() > 1 && trap_free(self.pid, self.pid));
        let mut raw = match code {
            Some(code) => {
                let calls: Vec<(i64, [Arg; 6])> = queue.iter().map(|c| (c.nr, c.args)).collect();
                self.inj.batch_linked(code, &calls)?
            }
            None => Vec::with_capacity(queue.len()),
        };
        let last = queue.len() - 1;
        let mut r = 0;
        for (i, c) in queue.into_iter().enumerate() {
            r = match raw.get(i) {
                Some(r) => *r,
                None => {
                    let args = c.args.map(|a| a.value(&raw));
                    let r = self.inj.syscall_raw(c.nr, args)?;
                    raw.push(r);
                    r
                }
            };
            if (-4095..0).contains(&r) && !(last_is_call && i == last) {
                // As `SysError::Remote` says it, after what it was for.
                return Err(SysError::Syscall {
                    what: format!("{}: remote {} in process {}", c.what, c.name, self.pid),
                    source: Errno(-r as i32),
                });
            }
        }
        Ok(r)
    }

    /// Copy bytes into the scratch area; returns their address in the stub.
    /// The area is used round and round: once it would overwrite what a
    /// queued call may still read, the queue is run first.
    pub fn put(&mut self, data: &[u8]) -> Result<u64> {
        let len = (data.len() as u64).div_ceil(16) * 16;
        if self.scratch == 0 || len > SCRATCH - THREAD_ARGS {
            return Err(cr_sys::SysError::Syscall {
                what: format!(
                    "an argument of {} bytes does not fit the restorer's scratch memory",
                    data.len()
                ),
                source: cr_sys::Errno(libc::E2BIG),
            });
        }
        let wrap = self.cursor + len > SCRATCH - THREAD_ARGS;
        if wrap {
            self.cursor = 0;
        }
        // What was put before the cursor is safe until the next wrap;
        // what is after it (put before the last wrap) only up to it.
        let at_risk = wrap
            || self
                .queued_lo
                .is_some_and(|lo| lo >= self.cursor && self.cursor + len > lo);
        if at_risk && !self.queue.is_empty() {
            self.flush()?;
        }
        let addr = self.scratch + self.cursor;
        mem::write_vm(self.pid, addr, data)?;
        self.cursor += len;
        Ok(addr)
    }

    pub fn put_str(&mut self, s: &str) -> Result<u64> {
        self.put(&mem::cstring_bytes(s))
    }

    /// openat(AT_FDCWD, path, flags) inside the stub.
    pub fn open(&mut self, path: &str, flags: i32) -> Result<u64> {
        let p = self.put_str(path)?;
        self.call(
            "openat",
            libc::SYS_openat,
            [libc::AT_FDCWD as u64, p, flags as u64, 0, 0, 0],
        )
    }

    /// openat(dir, rel, flags) inside the stub, `dir` being a directory fd
    /// of the restorer's (taken for the call, as [`Stub::grab`] does): a
    /// path as the restorer sees it, whatever the stub's mount namespace.
    pub fn open_at_ours(&mut self, dir: i32, rel: &str, flags: i32) -> Result<u64> {
        let Some(pidfd) = self.grab_pidfd else {
            return Err(cr_sys::SysError::Syscall {
                what: "pidfd_getfd (the restorer's pidfd is gone)".into(),
                source: cr_sys::Errno(libc::EBADF),
            });
        };
        let d = self.call(
            "pidfd_getfd",
            libc::SYS_pidfd_getfd,
            [pidfd, dir as u64, 0, 0, 0, 0],
        )?;
        let p = self.put_str(rel);
        let r =
            p.and_then(|p| self.call("openat", libc::SYS_openat, [d, p, flags as u64, 0, 0, 0]));
        self.call("close", libc::SYS_close, [d, 0, 0, 0, 0, 0])?;
        r
    }

    /// Take the restorer's fd `ours` into the stub as fd `want` (the same
    /// open file description, through pidfd_getfd on the restorer's pidfd
    /// the stub inherited): queued ([`Stub::later_at`]), so `ours` must
    /// stay open until the caller flushes.
    pub fn grab(&mut self, ours: i32, want: i32, cloexec: bool) -> Result<()> {
        let Some(pidfd) = self.grab_pidfd else {
            return Err(cr_sys::SysError::Syscall {
                what: "pidfd_getfd (the restorer's pidfd is gone)".into(),
                source: cr_sys::Errno(libc::EBADF),
            });
        };
        self.later_at(
            (
                "pidfd_getfd",
                libc::SYS_pidfd_getfd,
                [pidfd, ours as u64, 0, 0, 0, 0],
            ),
            want,
            cloexec,
            format!("cannot take the restorer's fd {ours} as fd {want}"),
        )
    }

    /// Queue `call`, which makes a new fd (openat, pidfd_getfd...), and
    /// the calls that move that fd to number `want` (close-on-exec or
    /// not), in one batch: one stop, where running `call` and waiting for
    /// its result, then moving the fd, took three or more. The new fd is
    /// the lowest free one, which may be `want` itself (where a `dup3`
    /// onto itself fails): it is copied above `want` first
    /// (F_DUPFD_CLOEXEC), closed, and the copy moved to `want`.
    pub fn later_at(
        &mut self,
        call: (&'static str, i64, [u64; 6]),
        want: i32,
        cloexec: bool,
        what: String,
    ) -> Result<()> {
        let flag = if cloexec { libc::O_CLOEXEC as u64 } else { 0 };
        let (v, got, above) = (Arg::Val, Arg::ResultOf(0), Arg::ResultOf(1));
        let z = v(0);
        let (name, nr, args) = call;
        self.later_linked(
            &[
                (name, nr, args.map(Arg::Val)),
                (
                    "fcntl(F_DUPFD_CLOEXEC)",
                    libc::SYS_fcntl,
                    [
                        got,
                        v(libc::F_DUPFD_CLOEXEC as u64),
                        v(want as u64 + 1),
                        z,
                        z,
                        z,
                    ],
                ),
                ("close", libc::SYS_close, [got, z, z, z, z, z]),
                (
                    "dup3",
                    libc::SYS_dup3,
                    [above, v(want as u64), v(flag), z, z, z],
                ),
                ("close", libc::SYS_close, [above, z, z, z, z, z]),
            ],
            what,
        )
    }

    /// Move the new fd `got` (close-on-exec, as pidfd_getfd makes it) to
    /// number `want`: queued ([`Stub::later`]), the caller flushes.
    pub fn place(&mut self, got: u64, want: i32, cloexec: bool) -> Result<()> {
        let flag = if cloexec { libc::O_CLOEXEC as u64 } else { 0 };
        let what = || format!("cannot move fd {got} to {want}");
        if got == want as u64 {
            if !cloexec {
                self.later(
                    "fcntl(F_SETFD)",
                    libc::SYS_fcntl,
                    [got, libc::F_SETFD as u64, 0, 0, 0, 0],
                    what(),
                )?;
            }
            return Ok(());
        }
        self.later(
            "dup3",
            libc::SYS_dup3,
            [got, want as u64, flag, 0, 0, 0],
            what(),
        )?;
        self.later("close", libc::SYS_close, [got, 0, 0, 0, 0, 0], what())?;
        Ok(())
    }

    /// The per-thread argument area at the end of the scratch memory.
    pub fn thread_args(&self) -> u64 {
        self.scratch + SCRATCH - THREAD_ARGS
    }
}
