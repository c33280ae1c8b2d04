//! A seized thread as a value: [`Tracee`] detaches (or, for restore stubs,
//! kills) on drop, so an early return or a panic can never leave an
//! application frozen or traced.

use crate::error::{Errno, Result, SysError};
use crate::regs::UserRegs;
use nix::sys::ptrace;
use nix::unistd::Pid;
use std::time::{Duration, Instant};
use tracing::{debug, warn};

const PTRACE_GETSIGMASK: libc::c_uint = 0x420a;
const PTRACE_SETSIGMASK: libc::c_uint = 0x420b;
const PTRACE_GET_RSEQ_CONFIGURATION: libc::c_uint = 0x420f;
const PTRACE_SECCOMP_GET_FILTER: libc::c_uint = 0x420c;
const PTRACE_SECCOMP_GET_METADATA: libc::c_uint = 0x420d;
/// Largest seccomp program (BPF_MAXINSNS instructions of 8 bytes).
const SECCOMP_MAX_PROG: usize = 4096 * 8;
const PTRACE_PEEKSIGINFO: libc::c_uint = 0x4209;
const PTRACE_PEEKSIGINFO_SHARED: u32 = 1;
/// sizeof(siginfo_t).
pub const SIGINFO_SIZE: usize = 128;

#[repr(C)]
struct PeekSiginfoArgs {
    off: u64,
    flags: u32,
    nr: i32,
}
const NT_X86_XSTATE: libc::c_int = 0x202;
/// Big enough for every XSAVE layout (AMX tiles included).
const XSTATE_BUF: usize = 64 * 1024;

pub const PTRACE_EVENT_STOP: i32 = 128;
pub const PTRACE_EVENT_CLONE: i32 = 3;
pub const PTRACE_EVENT_FORK: i32 = 1;
/// Option: the tracee's seccomp filters do not judge its system calls
/// while it is traced (needs CAP_SYS_ADMIN and a tracer without filters
/// of its own; the seize fails with EPERM otherwise).
pub const PTRACE_O_SUSPEND_SECCOMP: u64 = 1 << 21;

/// What a ptrace-stop was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// PTRACE_EVENT_* stop (`event`), with the stop signal.
    Event { event: i32, sig: i32 },
    /// Syscall-enter or -exit stop (PTRACE_O_TRACESYSGOOD).
    Syscall,
    /// Signal-delivery stop: `sig` is about to be delivered.
    Signal(i32),
}

/// rseq registration of a thread (PTRACE_GET_RSEQ_CONFIGURATION).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RseqConfig {
    pub addr: u64,
    pub len: u32,
    pub signature: u32,
}

#[repr(C)]
#[derive(Default)]
struct PtraceRseqConfiguration {
    rseq_abi_pointer: u64,
    rseq_abi_size: u32,
    signature: u32,
    flags: u32,
    pad: u32,
}

/// What happens to a tracee when its [`Tracee`] is dropped without an explicit release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnDrop {
    /// Detach and let it run on (an application being checkpointed).
    Detach,
    /// Kill it and reap it (a half-built restore stub).
    Kill,
}

/// A thread attached with PTRACE_SEIZE.
#[derive(Debug)]
pub struct Tracee {
    tid: i32,
    stopped: bool,
    attached: bool,
    on_drop: OnDrop,
    /// The signal of the PTRACE_EVENT_STOP that ended the last
    /// [`Tracee::interrupt`] (0: none yet).
    event_sig: i32,
    /// A job-control stop signal (SIGSTOP: the one no mask holds back)
    /// that the thread dequeued while we injected into it, taken from it
    /// so that the injection goes on ([`Tracee::take_stop`]); sent again
    /// when the thread is let go (0: none).
    taken_stop: i32,
    /// Handed over to another tracer thread ([`Tracee::park`]): no
    /// thread traces it until [`Tracee::unpark`]; dropped so, a stub
    /// (`OnDrop::Kill`) is killed all the same.
    parked: bool,
}

/// The ptrace requests nix lacks (PTRACE_GETREGSET with NT_X86_XSTATE,
/// PTRACE_GETSIGMASK, PTRACE_PEEKSIGINFO, PTRACE_GET_RSEQ_CONFIGURATION),
/// and those that deliver a signal: nix's `Signal` cannot name the
/// realtime ones.
fn ptrace_raw(
    req: libc::c_uint,
    tid: i32,
    addr: usize,
    data: usize,
) -> std::result::Result<i64, Errno> {
    // SAFETY: every caller passes addr/data that are valid for `req` (pointers to
    // live, correctly sized buffers, or plain integers).
    let r = unsafe {
        libc::ptrace(
            req,
            tid,
            addr as *mut libc::c_void,
            data as *mut libc::c_void,
        )
    };
    if r == -1 {
        Err(Errno::last())
    } else {
        Ok(r)
    }
}

/// waitpid(tid, __WALL) returning the raw status. Raw: nix's WaitStatus
/// fails (EINVAL) on a stop by a realtime signal, and callers want the
/// status itself.
pub fn wait_raw(tid: i32, flags: i32) -> std::result::Result<(i32, i32), Errno> {
    let mut status = 0;
    loop {
        // SAFETY: status is a valid out pointer.
        let r = unsafe { libc::waitpid(tid, &mut status, flags | libc::__WALL) };
        if r == -1 {
            let e = Errno::last();
            if e.0 == libc::EINTR {
                continue;
            }
            return Err(e);
        }
        return Ok((r, status));
    }
}

/// How long [`Tracee::kill_and_reap`] waits for the killed thread group.
pub const KILL_REAP_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a tracee may take to reach a ptrace-stop (after PTRACE_INTERRUPT,
/// a resumed injected system call, a signal delivery): every wait of a
/// tracer has a deadline, so a thread stuck in the kernel can never hang
/// the tracer for good.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(20);

/// Why a bounded wait returned without a status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitFailed {
    /// waitpid failed (ECHILD: not ours, or reaped by someone else).
    Errno(Errno),
    /// Nothing came before the deadline.
    Timeout,
}

/// One waitpid(tid, flags | __WALL); EINTR is returned, not retried.
fn wait_once(tid: i32, flags: i32) -> std::result::Result<i32, Errno> {
    let mut status = 0;
    // SAFETY: status is a valid out pointer.
    let r = unsafe { libc::waitpid(tid, &mut status, flags | libc::__WALL) };
    if r == -1 {
        return Err(Errno::last());
    }
    Ok(status)
}

/// waitpid(`tid`, `flags` | __WALL) until it reports a status or `timeout`
/// passes; the raw status. A status already there is taken at once
/// (WNOHANG); otherwise the thread sleeps in a blocking waitpid that its
/// own timer interrupts at the deadline (`crate::deadline`), so a tracer
/// neither spins on a CPU that its frozen tracees need to run their
/// injected calls nor hangs for good on a thread stuck in the kernel.
/// Threads that cannot have a timer poll: yields first, then sleeps of up
/// to 1 ms.
pub fn wait_timed(tid: i32, flags: i32, timeout: Duration) -> std::result::Result<i32, WaitFailed> {
    let deadline = Instant::now() + timeout;
    match wait_raw(tid, flags | libc::WNOHANG) {
        Ok((0, _)) => {}
        Ok((_, status)) => return Ok(status),
        Err(e) => return Err(WaitFailed::Errno(e)),
    }
    if let Some(r) = crate::deadline::blocking(deadline, || wait_once(tid, flags)) {
        return r.map_err(|e| match e.0 {
            libc::ETIMEDOUT => WaitFailed::Timeout,
            _ => WaitFailed::Errno(e),
        });
    }
    let mut polls = 0u32;
    let mut pause = Duration::from_micros(20);
    loop {
        match wait_raw(tid, flags | libc::WNOHANG) {
            Ok((0, _)) => {}
            Ok((_, status)) => return Ok(status),
            Err(e) => return Err(WaitFailed::Errno(e)),
        }
        if Instant::now() >= deadline {
            return Err(WaitFailed::Timeout);
        }
        polls += 1;
        if polls < 200 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }
}

/// Kill process `pid` (SIGKILL, the whole thread group) whose attached
/// threads are `tracees`, and collect the exit of every one of them, in
/// whatever order the kernel reports them. Returns the TIDs whose exit did
/// not come within `timeout` (a thread stuck in an uninterruptible sleep);
/// they are left as they are.
///
/// No single thread may be waited for (blocking) while others are left
/// unreaped: a traced thread that exits stays a zombie until its tracer
/// reaps it, and
/// - the exit of the thread group leader is reported only after every other
///   thread of the group has been reaped;
/// - when the process is PID 1 of a PID namespace (a `cr_run` job), the last
///   of its threads to exit, whichever it is, waits in the kernel
///   (zap_pid_ns_processes) until every other PID of the namespace, its
///   sibling threads included, is freed: it becomes a zombie only after we
///   have reaped all the others. Waiting for it first never returns.
///
/// So every thread is polled (WNOHANG, never waitpid(-1): that would steal
/// the stops and exits of other tracees of this process) until each has
/// been reaped or is no longer ours (ECHILD: its real parent reaped it), or
/// until `timeout`. A tracee that is not our child is reaped by its parent;
/// we only collect its exit notification.
pub fn kill_and_reap_all(pid: i32, tracees: Vec<Tracee>, timeout: Duration) -> Vec<i32> {
    let mut left: Vec<i32> = Vec::with_capacity(tracees.len());
    for mut t in tracees {
        if t.attached {
            left.push(t.tid);
        }
        // Dying threads are neither detached nor killed again on drop.
        t.attached = false;
        t.stopped = false;
    }
    if left.is_empty() {
        return left;
    }
    let _ = kill(pid, libc::SIGKILL);
    // The leader's exit comes last: poll the other threads first.
    left.sort_by_key(|&tid| tid == pid);
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_micros(100);
    loop {
        left.retain(|&tid| match wait_raw(tid, libc::WNOHANG) {
            Ok((0, _)) => true,
            Ok((_, status)) => !(libc::WIFEXITED(status) || libc::WIFSIGNALED(status)),
            Err(_) => false,
        });
        if left.is_empty() {
            return left;
        }
        if Instant::now() >= deadline {
            warn!(pid, tids = ?left, ?timeout, "killed threads did not exit; not waiting for them any longer");
            return left;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

/// The exit of the child behind `pidfd`, if it has exited: reaped, as a
/// shell shows it (the exit code, or 128 + the signal). `None` while it
/// runs. Only exits are asked for (WEXITED, never WSTOPPED): a child in a
/// job-control stop is not reported, and the stops of a child that one of
/// our threads traces must never be waited for here (its tracer waits for
/// them: a caller lets a traced child alone, see the agent's reaper).
pub fn reap_exited(pidfd: std::os::fd::BorrowedFd<'_>) -> std::result::Result<Option<i32>, Errno> {
    use nix::sys::wait::{waitid, Id, WaitPidFlag, WaitStatus};
    let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG;
    loop {
        return match waitid(Id::PIDFd(pidfd), flags) {
            Ok(WaitStatus::Exited(_, code)) => Ok(Some(code)),
            Ok(WaitStatus::Signaled(_, sig, _)) => Ok(Some(128 + sig as i32)),
            Ok(_) => Ok(None),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => Err(e.into()),
        };
    }
}

/// Send a signal to a process (raw: any signal number, realtime ones
/// included, which nix's `Signal` cannot name).
pub fn kill(pid: i32, sig: i32) -> std::result::Result<(), Errno> {
    // SAFETY: kill has no memory-safety preconditions.
    if unsafe { libc::kill(pid, sig) } == -1 {
        Err(Errno::last())
    } else {
        Ok(())
    }
}

impl Tracee {
    /// PTRACE_SEIZE `tid` with `options` (PTRACE_O_*), then stop it with
    /// PTRACE_INTERRUPT and wait for the stop. Signals that arrive first are
    /// delivered as usual, so nothing the application expects is lost.
    pub fn seize(tid: i32, options: u64, on_drop: OnDrop) -> Result<Self> {
        let options = ptrace::Options::from_bits_retain(options as libc::c_int);
        ptrace::seize(Pid::from_raw(tid), options).map_err(|e| SysError::Ptrace {
            op: "seize",
            tid,
            source: e.into(),
        })?;
        let mut t = Tracee {
            tid,
            stopped: false,
            attached: true,
            on_drop,
            event_sig: 0,
            taken_stop: 0,
            parked: false,
        };
        t.interrupt()?;
        Ok(t)
    }

    /// [`Tracee::seize`] with PTRACE_O_SUSPEND_SECCOMP added while
    /// `*suspend` holds: the tracee's seccomp filters then do not judge the
    /// system calls injected into it. The kernel allows that only to a
    /// tracer with CAP_SYS_ADMIN and no filter of its own; where it refuses
    /// (EPERM), the seize is made without, and `*suspend` turns false so
    /// that later seizes do not try again.
    pub fn seize_past_seccomp(
        tid: i32,
        options: u64,
        on_drop: OnDrop,
        suspend: &mut bool,
    ) -> Result<Self> {
        if *suspend {
            match Tracee::seize(tid, options | PTRACE_O_SUSPEND_SECCOMP, on_drop) {
                Err(SysError::Ptrace { source, .. }) if source.0 == libc::EPERM => {
                    debug!(tid, "seccomp filters cannot be suspended here (no CAP_SYS_ADMIN, or a filter of our own)");
                    *suspend = false;
                }
                r => return r,
            }
        }
        Tracee::seize(tid, options, on_drop)
    }

    /// Take over a thread that was attached automatically (PTRACE_O_TRACECLONE)
    /// and wait for its first stop.
    pub fn attach_new(tid: i32, on_drop: OnDrop) -> Result<Self> {
        let mut t = Tracee {
            tid,
            stopped: false,
            attached: true,
            on_drop,
            event_sig: 0,
            taken_stop: 0,
            parked: false,
        };
        loop {
            match t.wait_stop()? {
                Stop::Event { .. } => return Ok(t),
                Stop::Signal(sig) => t.resume(libc::PTRACE_CONT, sig)?,
                Stop::Syscall => t.resume(libc::PTRACE_CONT, 0)?,
            }
        }
    }

    pub fn tid(&self) -> i32 {
        self.tid
    }

    /// The job-control signal (SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU) that
    /// stopped the thread's process before it was seized, when it was in
    /// a group stop: the kernel reports it with the PTRACE_EVENT_STOP of
    /// the seize (do_jobctl_trap; SIGTRAP for a running thread).
    pub fn group_stop_signal(&self) -> Option<i32> {
        matches!(
            self.event_sig,
            libc::SIGSTOP | libc::SIGTSTP | libc::SIGTTIN | libc::SIGTTOU
        )
        .then_some(self.event_sig)
    }

    fn pid(&self) -> Pid {
        Pid::from_raw(self.tid)
    }

    /// Note that the thread dequeued job-control stop signal `sig` (at a
    /// signal-delivery stop during an injection) and that the tracer
    /// suppressed it: the stop is kept for [`Tracee::taken_stop`] and is
    /// sent again when the thread is detached.
    pub fn take_stop(&mut self, sig: i32) {
        debug!(tid = self.tid, sig, "stop signal taken during an injection");
        self.taken_stop = sig;
    }

    /// The stop signal taken from the thread during an injection (see
    /// [`Tracee::take_stop`]), if any.
    pub fn taken_stop(&self) -> Option<i32> {
        (self.taken_stop != 0).then_some(self.taken_stop)
    }

    fn failed(&self, op: &'static str, source: Errno) -> SysError {
        SysError::Ptrace {
            op,
            tid: self.tid,
            source,
        }
    }

    /// Stop a running tracee (PTRACE_INTERRUPT) and wait until it is in a
    /// ptrace-stop.
    pub fn interrupt(&mut self) -> Result<()> {
        ptrace::interrupt(self.pid()).map_err(|e| self.failed("interrupt", e.into()))?;
        loop {
            match self.wait_stop()? {
                Stop::Event { sig, .. } => {
                    self.event_sig = sig;
                    return Ok(());
                }
                Stop::Signal(sig) => {
                    // Deliver it as if we were not here; the interrupt stays pending.
                    debug!(
                        tid = self.tid,
                        sig, "delivering signal that arrived before the stop"
                    );
                    self.resume(libc::PTRACE_CONT, sig)?;
                }
                Stop::Syscall => self.resume(libc::PTRACE_CONT, 0)?,
            }
        }
    }

    /// Wait for the next ptrace-stop of this tracee (at most [`STOP_TIMEOUT`]).
    pub fn wait_stop(&mut self) -> Result<Stop> {
        let status = wait_timed(self.tid, 0, STOP_TIMEOUT).map_err(|e| match e {
            WaitFailed::Errno(source) => SysError::Wait {
                tid: self.tid,
                source,
            },
            WaitFailed::Timeout => SysError::StopTimeout {
                tid: self.tid,
                secs: STOP_TIMEOUT.as_secs(),
            },
        })?;
        if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
            self.attached = false;
            self.stopped = false;
            return Err(SysError::Exited {
                tid: self.tid,
                status,
            });
        }
        if !libc::WIFSTOPPED(status) {
            return Err(SysError::UnexpectedStop {
                tid: self.tid,
                status,
                during: "wait",
            });
        }
        self.stopped = true;
        let sig = libc::WSTOPSIG(status);
        let event = status >> 16;
        Ok(if event != 0 {
            Stop::Event { event, sig }
        } else if sig == libc::SIGTRAP | 0x80 {
            Stop::Syscall
        } else {
            Stop::Signal(sig)
        })
    }

    /// Resume with a ptrace request (PTRACE_CONT, PTRACE_SYSCALL) and signal.
    pub fn resume(&mut self, req: libc::c_uint, sig: i32) -> Result<()> {
        ptrace_raw(req, self.tid, 0, sig as usize)
            .map_err(|source| self.failed("resume", source))?;
        self.stopped = false;
        Ok(())
    }

    pub fn get_regs(&self) -> Result<UserRegs> {
        ptrace::getregs(self.pid()).map_err(|e| self.failed("getregs", e.into()))
    }

    pub fn set_regs(&self, regs: &UserRegs) -> Result<()> {
        ptrace::setregs(self.pid(), *regs).map_err(|e| self.failed("setregs", e.into()))
    }

    /// The whole XSAVE area (NT_X86_XSTATE).
    pub fn get_xstate(&self) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; XSTATE_BUF];
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        ptrace_raw(
            libc::PTRACE_GETREGSET,
            self.tid,
            NT_X86_XSTATE as usize,
            &mut iov as *mut _ as usize,
        )
        .map_err(|source| self.failed("getregset(NT_X86_XSTATE)", source))?;
        buf.truncate(iov.iov_len);
        Ok(buf)
    }

    pub fn set_xstate(&self, xstate: &[u8]) -> Result<()> {
        let mut buf = xstate.to_vec();
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        ptrace_raw(
            libc::PTRACE_SETREGSET,
            self.tid,
            NT_X86_XSTATE as usize,
            &mut iov as *mut _ as usize,
        )
        .map_err(|source| self.failed("setregset(NT_X86_XSTATE)", source))?;
        Ok(())
    }

    pub fn get_sigmask(&self) -> Result<u64> {
        let mut mask: u64 = 0;
        ptrace_raw(
            PTRACE_GETSIGMASK,
            self.tid,
            8,
            &mut mask as *mut u64 as usize,
        )
        .map_err(|source| self.failed("getsigmask", source))?;
        Ok(mask)
    }

    pub fn set_sigmask(&self, mask: u64) -> Result<()> {
        ptrace_raw(PTRACE_SETSIGMASK, self.tid, 8, &mask as *const u64 as usize)
            .map_err(|source| self.failed("setsigmask", source))?;
        Ok(())
    }

    /// Seccomp filter `index` of the thread's chain (0: the oldest) as raw
    /// `struct sock_filter` instructions and the flags it was installed
    /// with; None past the oldest filter.
    pub fn seccomp_filter(&self, index: u64) -> Result<Option<(Vec<u8>, u64)>> {
        let mut prog = vec![0u8; SECCOMP_MAX_PROG];
        let n = match ptrace_raw(
            PTRACE_SECCOMP_GET_FILTER,
            self.tid,
            index as usize,
            prog.as_mut_ptr() as usize,
        ) {
            Ok(n) => n,
            Err(e) if e.0 == libc::ENOENT => return Ok(None),
            Err(source) => return Err(self.failed("seccomp_get_filter", source)),
        };
        prog.truncate((n.max(0) as usize * 8).min(SECCOMP_MAX_PROG));
        // struct seccomp_metadata { u64 filter_off; u64 flags; }
        let mut meta = [index, 0u64];
        ptrace_raw(
            PTRACE_SECCOMP_GET_METADATA,
            self.tid,
            std::mem::size_of_val(&meta),
            meta.as_mut_ptr() as usize,
        )
        .map_err(|source| self.failed("seccomp_get_metadata", source))?;
        Ok(Some((prog, meta[1])))
    }

    pub fn get_rseq(&self) -> Result<RseqConfig> {
        let mut conf = PtraceRseqConfiguration::default();
        ptrace_raw(
            PTRACE_GET_RSEQ_CONFIGURATION,
            self.tid,
            std::mem::size_of::<PtraceRseqConfiguration>(),
            &mut conf as *mut _ as usize,
        )
        .map_err(|source| self.failed("get_rseq_configuration", source))?;
        Ok(RseqConfig {
            addr: conf.rseq_abi_pointer,
            len: conf.rseq_abi_size,
            signature: conf.signature,
        })
    }

    /// get_robust_list(2) of the thread: the head of its robust futex list
    /// (in its TLS, registered by glibc at thread start) and the list's
    /// length; (0, 0) when none is registered.
    pub fn get_robust_list(&self) -> Result<(u64, u64)> {
        let mut head: u64 = 0;
        let mut len: u64 = 0;
        // SAFETY: get_robust_list writes one pointer and one size_t through
        // the two pointers, which point at our locals.
        let r = unsafe {
            libc::syscall(
                libc::SYS_get_robust_list,
                self.tid,
                &mut head as *mut u64,
                &mut len as *mut u64,
            )
        };
        if r < 0 {
            return Err(self.failed("get_robust_list", Errno::last()));
        }
        Ok((head, len))
    }

    /// PTRACE_GETEVENTMSG: after a fork/clone event, the new task's PID in
    /// the tracer's PID namespace.
    pub fn event_msg(&self) -> Result<u64> {
        ptrace::getevent(self.pid())
            .map(|msg| msg as u64)
            .map_err(|e| self.failed("geteventmsg", e.into()))
    }

    /// PTRACE_GETSIGINFO: the raw siginfo of the signal this thread is
    /// stopped for (a signal-delivery-stop).
    pub fn siginfo(&self) -> Result<[u8; SIGINFO_SIZE]> {
        let mut buf = [0u8; SIGINFO_SIZE];
        ptrace_raw(
            libc::PTRACE_GETSIGINFO,
            self.tid,
            0,
            buf.as_mut_ptr() as usize,
        )
        .map_err(|source| self.failed("getsiginfo", source))?;
        Ok(buf)
    }

    /// Pending signals without dequeuing them: the thread's own queue, or
    /// the process-wide one (`shared`). Each entry is a raw siginfo_t.
    pub fn pending_signals(&self, shared: bool) -> Result<Vec<Vec<u8>>> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; SIGINFO_SIZE * 32];
        loop {
            let args = PeekSiginfoArgs {
                off: out.len() as u64,
                flags: if shared { PTRACE_PEEKSIGINFO_SHARED } else { 0 },
                nr: 32,
            };
            let n = ptrace_raw(
                PTRACE_PEEKSIGINFO,
                self.tid,
                &args as *const _ as usize,
                buf.as_mut_ptr() as usize,
            )
            .map_err(|source| self.failed("peeksiginfo", source))? as usize;
            out.extend(
                buf[..n * SIGINFO_SIZE]
                    .chunks_exact(SIGINFO_SIZE)
                    .map(<[u8]>::to_vec),
            );
            if n < 32 {
                return Ok(out);
            }
        }
    }

    /// Let the thread go at the syscall-entry stop it is in (its call,
    /// one that sleeps until a signal comes or ptrace interrupts it, such
    /// as `pause` with every signal blocked, then runs untraced) so that
    /// another thread of ours can trace it ([`Tracee::unpark`]): ptrace ties
    /// a tracee to the one thread that seized it. No group stop is used
    /// (a SIGSTOP given at the detach would leave the process stopped for
    /// good at its release). Until the unpark nothing kills it if we die
    /// (no PTRACE_O_EXITKILL): callers keep that window short.
    pub fn park(&mut self) -> Result<()> {
        if !self.attached || !self.stopped {
            return Err(self.failed("park", Errno(libc::ESRCH)));
        }
        ptrace_raw(libc::PTRACE_DETACH, self.tid, 0, 0)
            .map_err(|source| self.failed("detach to hand over", source))?;
        self.attached = false;
        self.stopped = false;
        self.parked = true;
        Ok(())
    }

    /// Trace a thread [`Tracee::park`]ed by another thread of ours, from
    /// this one: PTRACE_SEIZE with `options` (they are the tracer's, not
    /// the thread's: PTRACE_O_EXITKILL and the others are given again),
    /// then PTRACE_INTERRUPT, which ends its sleeping call, and its stop.
    /// Its registers are those of the interrupted call (an injector
    /// writes every one it needs).
    pub fn unpark(&mut self, options: u64) -> Result<()> {
        if !self.parked {
            return Err(self.failed("unpark", Errno(libc::ESRCH)));
        }
        let opts = ptrace::Options::from_bits_retain(options as libc::c_int);
        ptrace::seize(self.pid(), opts).map_err(|e| self.failed("seize", e.into()))?;
        self.parked = false;
        self.attached = true;
        let event_sig = self.event_sig;
        let r = self.interrupt();
        self.event_sig = event_sig;
        r
    }

    /// Detach, delivering `sig` (0 for none). The thread runs on.
    pub fn detach(mut self, sig: i32) -> Result<()> {
        self.detach_inner(sig)
    }

    fn detach_inner(&mut self, sig: i32) -> Result<()> {
        if !self.attached {
            return Ok(());
        }
        if !self.stopped {
            // PTRACE_DETACH needs a ptrace-stop.
            self.interrupt()?;
        }
        let r = ptrace_raw(libc::PTRACE_DETACH, self.tid, 0, sig as usize)
            .map_err(|source| self.failed("detach", source));
        self.attached = false;
        self.stopped = false;
        if r.is_ok() && self.taken_stop != 0 {
            // The stop the thread dequeued while we injected: sent again,
            // to the process (a group stop), now that it runs untraced.
            let sig = std::mem::take(&mut self.taken_stop);
            let tgid = crate::proc::status(self.tid).map_or(self.tid, |s| s.tgid);
            if let Err(e) = kill(tgid, sig) {
                warn!(tid = self.tid, sig, error = %e, "could not send the taken stop signal again");
            }
        }
        r.map(|_| ())
    }

    /// Kill the tracee's process (SIGKILL) and collect this thread's exit:
    /// [`kill_and_reap_all`] with this one thread. A process with several
    /// threads must give [`kill_and_reap_all`] all of them at once.
    pub fn kill_and_reap(self) {
        let pid = self.tid;
        kill_and_reap_all(pid, vec![self], KILL_REAP_TIMEOUT);
    }

    /// Kill a restore stub and reap it (within [`KILL_REAP_TIMEOUT`]).
    ///
    /// PID 1 of a PID namespace only finishes dying once its (traced)
    /// children are reaped, so whatever this thread traces or fathered
    /// that exits meanwhile is reaped too: `__WNOTHREAD` keeps the wait to
    /// this thread's own tracees and children (the stubs of this restore),
    /// never another thread's (another session's tracees, or processes a
    /// reaper watches), and WNOHANG with a deadline keeps it bounded.
    fn kill_inner(&mut self) {
        if !self.attached {
            return;
        }
        self.attached = false;
        let _ = kill(self.tid, libc::SIGKILL);
        let deadline = Instant::now() + KILL_REAP_TIMEOUT;
        let mut pause = Duration::from_micros(50);
        loop {
            match wait_raw(self.tid, libc::WNOHANG) {
                Ok((0, _)) => {}
                Ok((_, st)) if libc::WIFEXITED(st) || libc::WIFSIGNALED(st) => return,
                Ok(_) => {}
                Err(_) => return, // not ours any more, or gone
            }
            // Reap this thread's other exited stubs (never blocking).
            while let Ok((p, _)) = wait_raw(-1, libc::WNOHANG | libc::__WNOTHREAD) {
                if p <= 0 {
                    break;
                }
                if p == self.tid {
                    return;
                }
            }
            if Instant::now() >= deadline {
                warn!(
                    tid = self.tid,
                    "a killed restore stub was not reaped in time"
                );
                return;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }
}

impl Drop for Tracee {
    fn drop(&mut self) {
        if self.parked && self.on_drop == OnDrop::Kill {
            // Traced by none of our threads: killed; its parent reaps it.
            let _ = kill(self.tid, libc::SIGKILL);
            return;
        }
        if !self.attached {
            return;
        }
        match self.on_drop {
            OnDrop::Detach => {
                if let Err(e) = self.detach_inner(0) {
                    warn!(tid = self.tid, error = %e, "could not detach from thread");
                }
            }
            OnDrop::Kill => self.kill_inner(),
        }
    }
}
